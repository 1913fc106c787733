//! CUDA kernels of kvmesh: gather/scatter between pool slots and an engine's
//! paged KV layout, and block checksums on the GPU, compiled at run time
//! with NVRTC through `cudarc`, each next to a CPU reference that tests
//! compare it with.
//!
//! - [`layout`]: the engine layouts, the layout-independent packing of a
//!   block inside a slot, and the CPU reference of gather and scatter;
//! - [`checksum`]: `kvsum64`, the parallel payload checksum of GPU pools,
//!   and its CPU reference;
//! - [`cuda`]: the driver (loaded at run time: a machine without one gets
//!   an error, never a panic), GPU pools from the virtual-memory API with
//!   fd export/import, and the kernels;
//! - [`raw`]: the same over raw pointers, host or device, for the C ABI
//!   and Python.
//!
//! `unsafe` is allowed here (and in `ffi/`) only; each block says why it
//! holds in a `// SAFETY:` comment.

pub mod checksum;
pub mod cuda;
pub mod layout;
pub mod raw;
