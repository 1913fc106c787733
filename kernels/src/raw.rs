//! Gather, scatter and `kvsum64` over raw pointers, for the C ABI and
//! Python (an engine's connector hands over its tensors' addresses): host
//! memory runs the CPU reference, device memory the CUDA kernels, with the
//! same checks of the shape and sizes either way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::cuda::{DeviceRange, Gpu, GpuError};
use crate::layout::PagedKv;

/// Where the pointers of a call live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host memory of this process: the CPU reference runs.
    Host,
    /// Device memory of CUDA device N (or memory mapped for it).
    Cuda(usize),
}

impl Memory {
    /// -1 is host memory, N >= 0 CUDA device N (the C ABI's convention).
    pub fn from_code(device: i32) -> Option<Memory> {
        match device {
            -1 => Some(Memory::Host),
            d if d >= 0 => Some(Memory::Cuda(d as usize)),
            _ => None,
        }
    }
}

/// Which way a move goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Engine pages -> slots.
    Gather,
    /// Slots -> engine pages.
    Scatter,
}

/// The device `ordinal`, opened once per process and shared.
pub fn gpu(ordinal: usize) -> Result<Arc<Gpu>, GpuError> {
    static GPUS: Mutex<Option<HashMap<usize, Arc<Gpu>>>> = Mutex::new(None);
    let mut g = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    let map = g.get_or_insert_with(HashMap::new);
    if let Some(gpu) = map.get(&ordinal) {
        return Ok(gpu.clone());
    }
    let gpu = Arc::new(Gpu::open(ordinal)?);
    map.insert(ordinal, gpu.clone());
    Ok(gpu)
}

/// Moves pages between an engine's tensors and slots: for each `i`, page
/// `pages[i]` of `tensors` and the slot at `slots[i]` (`slot_bytes` long).
/// On a device, waits first for all work of the device's primary context
/// (other streams of the process, torch's among them) and returns when the
/// kernel finished. Work in another CUDA context must be synchronised by
/// its owner before the call.
///
/// # Safety
/// Every pointer of `tensors` must point to [`PagedKv::tensors`]' byte count
/// of memory of the kind `mem` says, every pointer of `slots` to
/// `slot_bytes`; the memory written (slots for a gather, the pages for a
/// scatter) must be writable and not overlap what is read, and nothing else
/// may write any of it during the call.
// SAFETY: an `unsafe fn` — its callers uphold the `# Safety` contract
// above; the body's own unsafe blocks state what they rely on.
pub unsafe fn move_pages(
    shape: &PagedKv,
    mem: Memory,
    dir: Direction,
    tensors: &[u64],
    pages: &[u64],
    slots: &[u64],
    slot_bytes: usize,
) -> Result<(), GpuError> {
    if pages.len() != slots.len() {
        return Err(GpuError::Invalid(format!("{} pages but {} slots", pages.len(), slots.len())));
    }
    let (n, bytes) = shape.tensors()?;
    if tensors.len() != n {
        return Err(
            crate::layout::LayoutError::Buffer { what: "engine tensors (count)", got: tensors.len(), want: n }.into()
        );
    }
    if tensors.iter().chain(slots).any(|&p| p == 0) {
        return Err(GpuError::Invalid("a tensor or slot pointer is NULL".into()));
    }
    let page = |p: u64| usize::try_from(p).map_err(|_| GpuError::Invalid(format!("page {p} out of range")));
    // Every page and the slot size are checked before a byte moves (an
    // error never leaves a scatter half done in the engine's tensors).
    for &p in pages {
        let p = page(p)?;
        if p >= shape.num_blocks {
            return Err(crate::layout::LayoutError::Page { page: p, num_blocks: shape.num_blocks }.into());
        }
    }
    let block = shape.block_bytes()?;
    if !pages.is_empty() && slot_bytes < block {
        return Err(crate::layout::LayoutError::Buffer { what: "slot payload", got: slot_bytes, want: block }.into());
    }
    match mem {
        Memory::Host => {
            // The caller vouches for `bytes` bytes at each tensor pointer and
            // `slot_bytes` at each slot, not overlapping, with no other writer
            // during the call: read where read, written where written. The
            // tensor views are made once for all pages.
            match dir {
                Direction::Gather => {
                    let views: Vec<&[u8]> = tensors
                        .iter()
                        // SAFETY: caller-vouched tensor memory, read only.
                        .map(|&t| unsafe { std::slice::from_raw_parts(t as *const u8, bytes) })
                        .collect();
                    for (&p, &s) in pages.iter().zip(slots) {
                        // SAFETY: caller-vouched slot memory, written, no overlap.
                        let slot = unsafe { std::slice::from_raw_parts_mut(s as *mut u8, slot_bytes) };
                        shape.gather(&views, page(p)?, slot)?;
                    }
                }
                Direction::Scatter => {
                    let mut views: Vec<&mut [u8]> = tensors
                        .iter()
                        // SAFETY: caller-vouched tensor memory, written, no overlap.
                        .map(|&t| unsafe { std::slice::from_raw_parts_mut(t as *mut u8, bytes) })
                        .collect();
                    for (&p, &s) in pages.iter().zip(slots) {
                        // SAFETY: caller-vouched slot memory, read only.
                        let slot = unsafe { std::slice::from_raw_parts(s as *const u8, slot_bytes) };
                        shape.scatter(slot, page(p)?, &mut views)?;
                    }
                }
            }
            Ok(())
        }
        Memory::Cuda(d) => {
            let gpu = gpu(d)?;
            // The caller's writes (on its own streams of this context, e.g.
            // torch's) land before our kernel reads.
            gpu.sync_context()?;
            // The caller vouches for the device memory behind every
            // pointer, for the sizes given, during the call (which
            // synchronises before it returns).
            // SAFETY: caller-vouched device memory for the call.
            let t: Vec<DeviceRange> = tensors.iter().map(|&p| unsafe { DeviceRange::from_raw(p, bytes) }).collect();
            let pairs: Vec<(usize, DeviceRange)> = pages
                .iter()
                .zip(slots)
                // SAFETY: as above.
                .map(|(&p, &s)| Ok((page(p)?, unsafe { DeviceRange::from_raw(s, slot_bytes) })))
                .collect::<Result<_, GpuError>>()?;
            match dir {
                Direction::Gather => gpu.gather(shape, &t, &pairs),
                Direction::Scatter => gpu.scatter(shape, &t, &pairs),
            }
        }
    }
}

/// `kvsum64` of `len` bytes at `ptr` (host: the CPU reference; device: the
/// kernel, which needs an 8-byte aligned address).
///
/// # Safety
/// `ptr .. ptr + len` must be readable memory of the kind `mem` says, not
/// written by anyone during the call.
// SAFETY: an `unsafe fn` — its callers uphold the `# Safety` contract
// above; the body's own unsafe blocks state what they rely on.
pub unsafe fn kvsum64(mem: Memory, ptr: u64, len: usize) -> Result<u64, GpuError> {
    if ptr == 0 && len > 0 {
        return Err(GpuError::Invalid("pointer is NULL".into()));
    }
    match mem {
        Memory::Host if len == 0 => Ok(crate::checksum::kvsum64(&[])),
        Memory::Host => {
            // SAFETY: the caller vouches for `len` readable bytes at `ptr`.
            let b = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
            Ok(crate::checksum::kvsum64(b))
        }
        Memory::Cuda(d) => {
            let gpu = gpu(d)?;
            gpu.sync_context()?;
            // SAFETY: the caller vouches for the device memory.
            gpu.kvsum64(unsafe { DeviceRange::from_raw(ptr, len) })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, Layout};

    #[test]
    fn host_pointers_run_the_cpu_reference_and_bad_calls_are_errors() {
        let s = PagedKv {
            layout: Layout::FlashInfer,
            dtype: DType::Bf16,
            num_layers: 2,
            num_blocks: 3,
            block_tokens: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        let (n, bytes) = s.tensors().unwrap();
        let block = s.block_bytes().unwrap();
        let tensors: Vec<Vec<u8>> = (0..n).map(|i| (0..bytes).map(|j| (i * 7 + j * 13) as u8).collect()).collect();
        let mut slots = vec![vec![0u8; block]; 2];
        let tp: Vec<u64> = tensors.iter().map(|t| t.as_ptr() as u64).collect();
        let sp: Vec<u64> = slots.iter_mut().map(|t| t.as_mut_ptr() as u64).collect();
        // SAFETY: the pointers are of the live vectors above, of the sizes
        // given; slots and tensors are distinct allocations.
        unsafe { move_pages(&s, Memory::Host, Direction::Gather, &tp, &[2, 0], &sp, block) }.unwrap();
        let views: Vec<&[u8]> = tensors.iter().map(|t| &t[..]).collect();
        let mut want = vec![0u8; block];
        s.gather(&views, 2, &mut want).unwrap();
        assert_eq!(slots[0], want);
        s.gather(&views, 0, &mut want).unwrap();
        assert_eq!(slots[1], want);
        // SAFETY: as above.
        let sum = unsafe { kvsum64(Memory::Host, slots[1].as_ptr() as u64, block) }.unwrap();
        assert_eq!(sum, crate::checksum::kvsum64(&want));
        // Errors: a page outside, counts that differ, a short slot, NULL,
        // and a device code that is neither host nor a device.
        // SAFETY: as above; these calls fail before touching memory.
        assert!(unsafe { move_pages(&s, Memory::Host, Direction::Gather, &tp, &[3], &sp[..1], block) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { move_pages(&s, Memory::Host, Direction::Gather, &tp, &[0, 1], &sp[..1], block) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { move_pages(&s, Memory::Host, Direction::Gather, &tp, &[0], &sp[..1], block - 1) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { move_pages(&s, Memory::Host, Direction::Gather, &tp[..1], &[0], &sp[..1], block) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { move_pages(&s, Memory::Host, Direction::Gather, &tp, &[0], &[0], block) }.is_err());
        // A scatter with one bad page fails before it writes any page.
        for slot in slots.iter_mut() {
            slot.fill(0xab);
        }
        let sp: Vec<u64> = slots.iter_mut().map(|t| t.as_mut_ptr() as u64).collect();
        let mut tensors = tensors;
        let before = tensors.clone();
        let tpm: Vec<u64> = tensors.iter_mut().map(|t| t.as_mut_ptr() as u64).collect();
        // SAFETY: as above (the slots are read; the tensors, through
        // pointers taken for writing, written).
        let e = unsafe { move_pages(&s, Memory::Host, Direction::Scatter, &tpm, &[0, 3], &sp, block) };
        assert!(e.is_err());
        assert_eq!(tensors, before, "a failed scatter wrote the engine's tensors");
        // SAFETY: NULL with a length is refused before any read.
        assert!(unsafe { kvsum64(Memory::Host, 0, 8) }.is_err());
        assert_eq!(Memory::from_code(-2), None);
        assert_eq!(Memory::from_code(-1), Some(Memory::Host));
        assert_eq!(Memory::from_code(1), Some(Memory::Cuda(1)));
    }
}
