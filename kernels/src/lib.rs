//! CUDA kernels of kvmesh: gather/scatter between pool slots and an engine's
//! paged KV layout, and block checksums on the GPU. They will be compiled at
//! run time with NVRTC through `cudarc`, each next to a CPU reference
//! implementation that tests compare against.
//!
//! Nothing is implemented yet: GPU pools come after the host data path. This
//! crate exists so the workspace has its fixed shape; it exports nothing.
#![forbid(unsafe_code)]
