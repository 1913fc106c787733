//! The memory of one pool: host shared memory (a memfd, or a SysV segment
//! UCX allocated) or CUDA device memory (a `kvmesh_kernels::cuda::GpuPool`
//! from the virtual-memory API). The store writes headers and trailers and
//! the commit path checksums payloads through this type, so neither cares
//! which it is.
//!
//! **Checksums differ by kind:** a host pool's slots carry xxh3-64 of the
//! payload (fast on a CPU), a GPU pool's `kvsum64` (computed on the GPU by
//! every thread at once: `kvmesh_kernels::checksum`); `PoolInfo.device`
//! tells a reader which.

use std::sync::Arc;

use kvmesh_ffi_os::SharedMapping;
use kvmesh_kernels::cuda::{Gpu, GpuPool};

/// A GPU pool of this daemon: the device and its memory.
pub struct CudaMemory {
    /// Device the pool lives on (shared with every other user in the
    /// process).
    pub gpu: Arc<Gpu>,
    /// The allocation, mapped for the device.
    pub pool: GpuPool,
    /// Bytes the store uses (whole slots; the allocation may be rounded up).
    pub bytes: u64,
    /// The device's UUID (what clients find their own ordinal of it by).
    pub uuid: [u8; 16],
}

/// A pool's memory.
#[derive(Clone)]
pub enum PoolMemory {
    /// Host shared memory, mapped in this process.
    Host(Arc<SharedMapping>),
    /// CUDA device memory.
    Cuda(Arc<CudaMemory>),
}

impl PoolMemory {
    /// Bytes of the pool (for a GPU pool, the whole slots the store uses).
    pub fn len(&self) -> u64 {
        match self {
            PoolMemory::Host(m) => m.len(),
            PoolMemory::Cuda(c) => c.bytes,
        }
    }

    /// Whether the pool is empty (never: pools have at least one slot).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Locked in RAM (device memory is never swapped out).
    pub fn mlocked(&self) -> bool {
        match self {
            PoolMemory::Host(m) => m.mlocked(),
            PoolMemory::Cuda(_) => true,
        }
    }

    /// Bytes of a host pool the kernel maps with huge pages (device memory:
    /// 0, it has its own page sizes).
    pub fn huge_page_bytes(&self) -> u64 {
        match self {
            PoolMemory::Host(m) => m.huge_page_bytes(),
            PoolMemory::Cuda(_) => 0,
        }
    }

    /// The host mapping, for what only host pools do (UCX registration,
    /// one-sided reads, the cluster).
    pub fn host(&self) -> Option<&Arc<SharedMapping>> {
        match self {
            PoolMemory::Host(m) => Some(m),
            PoolMemory::Cuda(_) => None,
        }
    }

    /// Writes `src` at `offset` (a copy to the device for a GPU pool).
    pub fn copy_in(&self, offset: u64, src: &[u8]) -> Result<(), String> {
        match self {
            PoolMemory::Host(m) => m.copy_in(offset, src).map_err(|e| e.to_string()),
            PoolMemory::Cuda(c) => {
                let r = c.pool.range().sub(offset as usize, src.len()).map_err(|e| e.to_string())?;
                c.gpu.copy_to_device(r, src).map_err(|e| e.to_string())
            }
        }
    }

    /// Reads `dst.len()` bytes at `offset` (a copy from the device for a
    /// GPU pool).
    pub fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), String> {
        match self {
            PoolMemory::Host(m) => m.copy_out(offset, dst).map_err(|e| e.to_string()),
            PoolMemory::Cuda(c) => {
                let r = c.pool.range().sub(offset as usize, dst.len()).map_err(|e| e.to_string())?;
                c.gpu.copy_to_host(dst, r).map_err(|e| e.to_string())
            }
        }
    }

    /// The payload checksum of `len` bytes at `offset`: xxh3-64 on a host
    /// pool, `kvsum64` computed on the device on a GPU pool.
    pub fn checksum(&self, offset: u64, len: u64) -> Result<u64, String> {
        match self {
            PoolMemory::Host(m) => {
                let region = m.read(offset, len).map_err(|e| e.to_string())?;
                Ok(kvmesh_common::checksum(&region))
            }
            PoolMemory::Cuda(c) => {
                let r = c.pool.range().sub(offset as usize, len as usize).map_err(|e| e.to_string())?;
                c.gpu.kvsum64(r).map_err(|e| e.to_string())
            }
        }
    }

    /// The GPU's UUID (empty for host memory).
    pub fn device_uuid(&self) -> Vec<u8> {
        match self {
            PoolMemory::Host(_) => Vec::new(),
            PoolMemory::Cuda(c) => c.uuid.to_vec(),
        }
    }

    /// Whether checksums are computed on a GPU (always off the runtime's
    /// threads: they wait for the device).
    pub fn is_gpu(&self) -> bool {
        matches!(self, PoolMemory::Cuda(_))
    }
}
