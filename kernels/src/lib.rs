//! CUDA kernels of kvmesh: gather/scatter between pool slots and an engine's
//! paged KV layout, and block checksums on the GPU. They will be compiled at
//! run time with NVRTC through `cudarc`, each next to a CPU reference
//! implementation that tests compare against.
//!
//! What exists today: [`layout`], the engine layouts, the layout-independent
//! packing of a block inside a slot, and the CPU reference of gather and
//! scatter. The GPU kernels, GPU pools and the device check are not built
//! yet (issue 15).
#![forbid(unsafe_code)]

pub mod layout;
