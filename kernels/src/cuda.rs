//! The GPU side: the CUDA driver and NVRTC through `cudarc`, loaded at run
//! time (`dynamic-loading`: no CUDA is needed to build, and a machine
//! without a driver gets [`GpuError::NoDriver`], never a panic).
//!
//! - [`Gpu`]: one device's primary context and a stream; the kernels of
//!   `cuda/kernels.cu` compiled with NVRTC for the device's architecture on
//!   first use.
//! - [`GpuPool`]: device memory from the virtual-memory API (`cuMemCreate`
//!   with a POSIX file-descriptor shareable handle, `cuMemAddressReserve`,
//!   `cuMemMap`, `cuMemSetAccess`): what a daemon's GPU pool is made of. Its
//!   fd can be exported ([`GpuPool::export_fd`]) and imported by another
//!   process, on the same GPU or another one of the node
//!   ([`Gpu::import_pool`]), which then reads the same memory in place.
//! - [`Gpu::kvsum64`], [`Gpu::gather`], [`Gpu::scatter`]: the kernels, each
//!   equal to its CPU reference ([`crate::checksum`], [`crate::layout`]).
//!
//! **Status (no GPU on the machines this was written on):** this module
//! builds and its no-driver paths are tested everywhere; the GPU paths are
//! exercised only by `kvmesh-gpu-check` (`scripts/gpu-check.sh`) on a
//! machine with an NVIDIA GPU. See docs/GPU.md for what was verified where.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, result, sys};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

use crate::layout::{LayoutError, PagedKv};

/// The kernels' CUDA source (compiled by NVRTC at run time).
pub const KERNELS_CU: &str = include_str!("cuda/kernels.cu");

/// Why a GPU operation cannot run.
#[derive(Clone, Debug, thiserror::Error)]
pub enum GpuError {
    /// No CUDA driver library on this machine (or it does not initialise).
    #[error("no CUDA driver on this machine: {0}")]
    NoDriver(String),
    /// The driver runs but the device asked for is not there.
    #[error("no CUDA device {ordinal} (this machine has {count})")]
    NoDevice {
        /// Ordinal asked.
        ordinal: usize,
        /// Devices there are.
        count: usize,
    },
    /// NVRTC (the run-time compiler) is missing or failed.
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    /// A CUDA driver call failed.
    #[error("CUDA {call}: {err}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's error.
        err: String,
    },
    /// The device cannot do what was asked (no VMM, no fd handles, no peer
    /// access).
    #[error("CUDA device {ordinal}: {what}")]
    Unsupported {
        /// Device.
        ordinal: usize,
        /// What it lacks.
        what: String,
    },
    /// A shape, size or alignment the kernels refuse.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A range or argument outside what the buffers hold.
    #[error("{0}")]
    Invalid(String),
}

fn drv(call: &'static str) -> impl FnOnce(result::DriverError) -> GpuError {
    move |e| GpuError::Driver { call, err: e.to_string() }
}

/// Whether the CUDA driver library can be loaded and initialised here.
/// Never panics (cudarc itself panics when a library is missing, so this
/// is asked before anything else touches the driver).
pub fn driver() -> Result<(), GpuError> {
    static INIT: OnceLock<Result<(), GpuError>> = OnceLock::new();
    INIT.get_or_init(|| {
        // Only tries to dlopen the library names cudarc would use;
        // loading libcuda runs its initialisers, which is what using CUDA
        // means; nothing is called through it here.
        // SAFETY: a dlopen probe, nothing called.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::NoDriver("libcuda.so (the NVIDIA driver library) cannot be loaded".into()));
        }
        result::init().map_err(|e| GpuError::NoDriver(format!("cuInit failed: {e}")))
    })
    .clone()
}

/// Number of CUDA devices (an error where there is no driver).
pub fn device_count() -> Result<usize, GpuError> {
    driver()?;
    let n = result::device::get_count().map_err(drv("cuDeviceGetCount"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Whether NVRTC can be loaded (the kernels need it; pools do not).
pub fn nvrtc() -> Result<(), GpuError> {
    // SAFETY: as in `driver`: a dlopen of NVRTC's library names, nothing called.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::Nvrtc(
            "libnvrtc.so cannot be loaded (install the CUDA NVRTC library or add it to LD_LIBRARY_PATH)".into(),
        ))
    }
}

/// Compiles the kernels' source to PTX for compute capability `cc` with
/// NVRTC. Needs NVRTC only, no driver or GPU: tests run it wherever the
/// library is (scripts/test.sh installs it from the Python registry).
pub fn compile_ptx(cc: (i32, i32)) -> Result<Ptx, GpuError> {
    nvrtc()?;
    let (major, minor) = cc;
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}"), "-default-device".into()],
        ..Default::default()
    };
    compile_ptx_with_opts(KERNELS_CU, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => GpuError::Nvrtc(log.to_string_lossy().into_owned()),
        e => GpuError::Nvrtc(format!("{e:?}")),
    })
}

/// Compiles the kernels' source to machine code (CUBIN) for `sm_XY` with
/// NVRTC. Needs NVRTC only.
pub fn compile_cubin(cc: (i32, i32)) -> Result<Vec<u8>, GpuError> {
    use cudarc::nvrtc::{result as nv, sys as nvs};
    nvrtc()?;
    let src = std::ffi::CString::new(KERNELS_CU).map_err(|e| GpuError::Nvrtc(e.to_string()))?;
    let prog = nv::create_program(&src, None).map_err(|e| GpuError::Nvrtc(format!("{e:?}")))?;
    let opts = [format!("--gpu-architecture=sm_{}{}", cc.0, cc.1), "-default-device".to_string()];
    // SAFETY: `prog` was just created from `src`, which outlives it; it is
    // destroyed once, below, whatever happened.
    let out = unsafe {
        let r = match nv::compile_program(prog, &opts) {
            Err(e) => {
                let log = nv::get_program_log(prog).unwrap_or_default();
                let log: Vec<u8> = log.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                Err(GpuError::Nvrtc(format!("{e:?}: {}", String::from_utf8_lossy(&log))))
            }
            Ok(()) => {
                let mut size = 0usize;
                match nvs::nvrtcGetCUBINSize(prog, &mut size).result() {
                    Err(e) => Err(GpuError::Nvrtc(format!("nvrtcGetCUBINSize: {e:?}"))),
                    Ok(()) => {
                        let mut bin = vec![0u8; size];
                        nvs::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast())
                            .result()
                            .map(|()| bin)
                            .map_err(|e| GpuError::Nvrtc(format!("nvrtcGetCUBIN: {e:?}")))
                    }
                }
            }
        };
        let _ = nv::destroy_program(prog);
        r
    };
    match out {
        Ok(bin) if bin.starts_with(b"\x7fELF") => Ok(bin),
        Ok(_) => Err(GpuError::Nvrtc("NVRTC returned no ELF image".into())),
        Err(e) => Err(e),
    }
}

/// Logs through stderr only where nothing else is set up (this crate has
/// no logging dependency): a one-line note for operators.
fn tracing_free_log(msg: &str) {
    eprintln!("kvmesh-kernels: {msg}");
}

/// The UUID of CUDA device `ordinal` (the same in every process, whatever
/// `CUDA_VISIBLE_DEVICES` renumbers).
pub fn device_uuid(ordinal: usize) -> Result<[u8; 16], GpuError> {
    driver()?;
    let dev = result::device::get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
    let u = result::device::get_uuid(dev).map_err(drv("cuDeviceGetUuid"))?;
    Ok(u.bytes.map(|b| b as u8))
}

/// The ordinal, in this process, of the device with `uuid` (`None`: not
/// visible here).
pub fn ordinal_of(uuid: &[u8; 16]) -> Result<Option<usize>, GpuError> {
    for d in 0..device_count()? {
        if device_uuid(d)? == *uuid {
            return Ok(Some(d));
        }
    }
    Ok(None)
}

/// Whether device `from` can read memory of device `to` (peer access).
pub fn can_access(from: usize, to: usize) -> Result<bool, GpuError> {
    driver()?;
    let a = result::device::get(from as i32).map_err(drv("cuDeviceGet"))?;
    let b = result::device::get(to as i32).map_err(drv("cuDeviceGet"))?;
    let mut ok = 0i32;
    // SAFETY: both are valid device handles; `ok` receives one int.
    unsafe { sys::cuDeviceCanAccessPeer(&mut ok, a, b) }.result().map_err(drv("cuDeviceCanAccessPeer"))?;
    Ok(ok != 0)
}

/// Parses a device name of the config: `"cuda:N"`.
pub fn parse_device(s: &str) -> Option<usize> {
    let n = s.strip_prefix("cuda:")?;
    if n.is_empty() || n.len() > 3 || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

struct Kernels {
    kvsum: CudaFunction,
    moves: [(usize, CudaFunction); 4],
}

/// One CUDA device: its primary context, a stream, the kernels.
pub struct Gpu {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: OnceLock<Result<Kernels, GpuError>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("ordinal", &self.ordinal).finish()
    }
}

/// A range of device memory the caller vouches for: `len` bytes at `ptr`,
/// allocated in this process's address space for the device (our own
/// [`GpuBuffer`] or [`GpuPool`], or an engine's tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRange {
    ptr: u64,
    len: usize,
}

impl DeviceRange {
    /// A range of memory this crate did not allocate (an engine's tensor,
    /// handed over by the C ABI or Python).
    ///
    /// # Safety
    /// `ptr .. ptr + len` must be device memory (or memory mapped for the
    /// device) that stays allocated while any operation using the range
    /// runs.
    // SAFETY: an `unsafe fn` — its callers uphold the `# Safety` contract
    // above; the body's own unsafe blocks state what they rely on.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        DeviceRange { ptr, len }
    }

    /// Start address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sub-range `offset .. offset + len`, checked.
    pub fn sub(&self, offset: usize, len: usize) -> Result<DeviceRange, GpuError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(DeviceRange { ptr: self.ptr + offset as u64, len }),
            _ => Err(GpuError::Invalid(format!("range {offset}+{len} outside {} bytes", self.len))),
        }
    }
}

impl Gpu {
    /// Opens device `ordinal` (its primary context). A clear error where
    /// there is no driver or no such device.
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        Ok(Gpu { ordinal, ctx, stream, kernels: OnceLock::new() })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name and compute capability.
    pub fn describe(&self) -> Result<(String, (i32, i32)), GpuError> {
        let name = self.ctx.name().map_err(drv("cuDeviceGetName"))?;
        let cc = self.ctx.compute_capability().map_err(drv("cuDeviceGetAttribute"))?;
        Ok((name, cc))
    }

    fn attr(&self, a: sys::CUdevice_attribute) -> Result<i32, GpuError> {
        self.ctx.attribute(a).map_err(drv("cuDeviceGetAttribute"))
    }

    fn bind(&self) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))
    }

    fn kernels(&self) -> Result<&Kernels, GpuError> {
        self.kernels.get_or_init(|| self.compile()).as_ref().map_err(Clone::clone)
    }

    fn compile(&self) -> Result<Kernels, GpuError> {
        let cc = self.ctx.compute_capability().map_err(drv("cuDeviceGetAttribute"))?;
        // Machine code for this exact architecture when NVRTC knows it: no
        // JIT by the driver, so an NVRTC newer than the driver (whose PTX
        // the driver could not read) still works. Else PTX, JIT-compiled.
        let image = match compile_cubin(cc) {
            Ok(cubin) => Ptx::from_binary(cubin),
            Err(e) => {
                tracing_free_log(&format!("NVRTC has no machine code for sm_{}{} ({e}); using PTX", cc.0, cc.1));
                compile_ptx(cc)?
            }
        };
        let module = self.ctx.load_module(image).map_err(drv("cuModuleLoadData"))?;
        let f = |name: &str| module.load_function(name).map_err(drv("cuModuleGetFunction"));
        Ok(Kernels {
            kvsum: f("kvsum_partial")?,
            moves: [(16, f("kv_move_16")?), (8, f("kv_move_8")?), (4, f("kv_move_4")?), (1, f("kv_move_1")?)],
        })
    }

    /// Compiles the kernels now (they are otherwise compiled on first use).
    pub fn warm_up(&self) -> Result<(), GpuError> {
        self.kernels().map(|_| ())
    }

    /// Waits for everything queued on this device's stream.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize().map_err(drv("cuStreamSynchronize"))
    }

    /// Device time of `reps` runs of `f` (queued on this device's stream,
    /// after one warm-up run), in milliseconds, from CUDA events.
    pub fn time_ms(&self, reps: usize, mut f: impl FnMut() -> Result<(), GpuError>) -> Result<f64, GpuError> {
        f()?;
        self.synchronize()?;
        let ev = || self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("cuEventCreate"));
        let (start, end) = (ev()?, ev()?);
        start.record(&self.stream).map_err(drv("cuEventRecord"))?;
        for _ in 0..reps {
            f()?;
        }
        end.record(&self.stream).map_err(drv("cuEventRecord"))?;
        end.synchronize().map_err(drv("cuEventSynchronize"))?;
        Ok(f64::from(start.elapsed_ms(&end).map_err(drv("cuEventElapsedTime"))?))
    }

    /// Waits for all work of this device's context, on every stream (an
    /// engine's torch or CuPy stream too, when it uses the primary context
    /// as they do), so a kernel launched next sees their writes.
    pub fn sync_context(&self) -> Result<(), GpuError> {
        self.ctx.synchronize().map_err(drv("cuCtxSynchronize"))
    }

    /// Allocates `bytes` of device memory (`cuMemAlloc`).
    pub fn alloc(&self, bytes: usize) -> Result<GpuBuffer, GpuError> {
        if bytes == 0 {
            return Err(GpuError::Invalid("allocation of 0 bytes".into()));
        }
        self.bind()?;
        // SAFETY: a fresh allocation of `bytes` in the bound context; freed
        // once, by `GpuBuffer::drop`, with the context bound again.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(drv("cuMemAlloc"))?;
        Ok(GpuBuffer { ctx: self.ctx.clone(), range: DeviceRange { ptr, len: bytes } })
    }

    /// Copies host bytes into device memory (waits until done).
    pub fn copy_to_device(&self, dst: DeviceRange, src: &[u8]) -> Result<(), GpuError> {
        if src.len() > dst.len {
            return Err(GpuError::Invalid(format!("{} bytes into a range of {}", src.len(), dst.len)));
        }
        self.bind()?;
        // On our stream, then wait for it: the bytes are on the device when
        // this returns (a plain cuMemcpyHtoD from pageable memory may return
        // while its DMA is still running, unordered with our stream).
        // `dst` holds at least `src.len()` bytes of device memory
        // (DeviceRange's contract, checked length); `src` is borrowed until
        // the stream is synchronised below.
        // SAFETY: checked device range, `src` borrowed until synced.
        unsafe { result::memcpy_htod_async(dst.ptr, src, self.stream.cu_stream()) }
            .map_err(drv("cuMemcpyHtoDAsync"))?;
        self.synchronize()
    }

    /// Copies device memory into host bytes (waits until done).
    pub fn copy_to_host(&self, dst: &mut [u8], src: DeviceRange) -> Result<(), GpuError> {
        if dst.len() > src.len {
            return Err(GpuError::Invalid(format!("{} bytes from a range of {}", dst.len(), src.len)));
        }
        self.bind()?;
        // `src` holds at least `dst.len()` bytes of device memory;
        // `dst` is borrowed mutably until the stream (which orders the copy
        // after our kernels) is synchronised below.
        // SAFETY: checked device range, `dst` borrowed until synced.
        unsafe { result::memcpy_dtoh_async(dst, src.ptr, self.stream.cu_stream()) }
            .map_err(drv("cuMemcpyDtoHAsync"))?;
        self.synchronize()
    }

    /// Device-to-device copy of `len` bytes, queued on the stream (the
    /// baseline of the bandwidth checks).
    pub fn copy_device(&self, dst: DeviceRange, src: DeviceRange, len: usize) -> Result<(), GpuError> {
        if len > dst.len || len > src.len {
            return Err(GpuError::Invalid(format!(
                "copy of {len} bytes between ranges of {} and {}",
                src.len, dst.len
            )));
        }
        self.bind()?;
        // Both ranges hold `len` bytes of device memory that stay
        // allocated while the stream runs (DeviceRange's contract; our own
        // buffers synchronise before they free).
        // SAFETY: both ranges hold `len` bytes while the stream runs.
        unsafe { result::memcpy_dtod_async(dst.ptr, src.ptr, len, self.stream.cu_stream()) }
            .map_err(drv("cuMemcpyDtoDAsync"))
    }

    /// `kvsum64` of `range`, computed on the device (equal to
    /// [`crate::checksum::kvsum64`] of the same bytes). The range must start
    /// on 8 bytes (slot payloads start on 64).
    pub fn kvsum64(&self, range: DeviceRange) -> Result<u64, GpuError> {
        if !range.ptr.is_multiple_of(8) {
            return Err(GpuError::Invalid(format!("kvsum64: address {:#x} is not 8-byte aligned", range.ptr)));
        }
        let k = self.kernels()?;
        let mut out = self.stream.alloc_zeros::<u64>(1).map_err(drv("cuMemAlloc"))?;
        let words = range.len.div_ceil(8) as u64;
        let threads = 256u32;
        let blocks = words.div_ceil(u64::from(threads)).clamp(1, 1024) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let len = range.len as u64;
        let mut b = self.stream.launch_builder(&k.kvsum);
        b.arg(&range.ptr).arg(&len).arg(&mut out);
        // kvsum_partial(const u8*, u64, u64*) takes exactly these
        // arguments; it reads `len` bytes at `ptr` (the range's contract)
        // and adds into the one u64 of `out`, which cudarc keeps alive and
        // orders by its events until the launch completes.
        // SAFETY: signature matches; reads stay in the range.
        unsafe { b.launch(cfg) }.map_err(drv("cuLaunchKernel"))?;
        let s = self.stream.clone_dtoh(&out).map_err(drv("cuMemcpyDtoH"))?;
        Ok(crate::checksum::finish(s[0], len))
    }

    /// Gathers pages of an engine's paged KV cache into slots: for each
    /// `(page, slot)` pair, page `page` of `tensors` (one per layer, or one
    /// for cross-layer) packed into `slot` exactly as
    /// [`PagedKv::gather`] does on the CPU.
    pub fn gather(
        &self,
        shape: &PagedKv,
        tensors: &[DeviceRange],
        pairs: &[(usize, DeviceRange)],
    ) -> Result<(), GpuError> {
        self.moves(0, shape, tensors, pairs)
    }

    /// Scatters slots back into pages (the inverse of [`Gpu::gather`]);
    /// writes only those pages.
    pub fn scatter(
        &self,
        shape: &PagedKv,
        tensors: &[DeviceRange],
        pairs: &[(usize, DeviceRange)],
    ) -> Result<(), GpuError> {
        self.moves(1, shape, tensors, pairs)
    }

    fn moves(
        &self,
        dir: u32,
        shape: &PagedKv,
        tensors: &[DeviceRange],
        pairs: &[(usize, DeviceRange)],
    ) -> Result<(), GpuError> {
        let plan = Plan::new(shape, tensors, pairs)?;
        if pairs.is_empty() {
            return Ok(());
        }
        let k = self.kernels()?;
        let func = &k
            .moves
            .iter()
            .find(|(u, _)| *u == plan.unit)
            .ok_or_else(|| GpuError::Invalid(format!("no kernel for {}-byte units", plan.unit)))?
            .1;
        let tensor_ptrs: Vec<u64> = tensors.iter().map(|t| t.ptr).collect();
        let d_tensors = self.stream.clone_htod(&tensor_ptrs).map_err(drv("cuMemcpyHtoD"))?;
        // At most 65,535 grid rows per launch.
        for chunk in pairs.chunks(65_535) {
            let pages: Vec<u64> = chunk.iter().map(|(p, _)| *p as u64).collect();
            let slots: Vec<u64> = chunk.iter().map(|(_, s)| s.ptr).collect();
            let d_pages = self.stream.clone_htod(&pages).map_err(drv("cuMemcpyHtoD"))?;
            let d_slots = self.stream.clone_htod(&slots).map_err(drv("cuMemcpyHtoD"))?;
            let threads = 256u32;
            let blocks = u64::from(plan.units).div_ceil(u64::from(threads)).clamp(1, 4096) as u32;
            let cfg = LaunchConfig {
                grid_dim: (blocks, chunk.len() as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let layout = plan.layout;
            let nb = shape.num_blocks as u64;
            let mut b = self.stream.launch_builder(func);
            b.arg(&dir)
                .arg(&layout)
                .arg(&nb)
                .arg(&plan.nl)
                .arg(&plan.kvn)
                .arg(&plan.tt)
                .arg(&plan.hh)
                .arg(&plan.row_units)
                .arg(&d_tensors)
                .arg(&d_pages)
                .arg(&d_slots);
            // kv_move_<unit>(u32, u32, u64, u32 x5, U* const*, const
            // u64*, U* const*) takes exactly these arguments. `Plan::new`
            // checked every page < num_blocks, every tensor's length equal to
            // the shape's, every slot >= the block, every pointer and the row
            // aligned to the unit, and that the block's units fit in u32: so
            // each thread reads and writes inside the ranges the caller
            // vouched for. The pointer tables live in `d_*`, which cudarc
            // keeps until the launch completes.
            // SAFETY: signature matches; `Plan::new` bounds every access.
            unsafe { b.launch(cfg) }.map_err(drv("cuLaunchKernel"))?;
        }
        self.synchronize()
    }

    /// Allocates a pool of `bytes` (rounded up to the allocation
    /// granularity) from the virtual-memory API, exportable as a POSIX fd.
    pub fn alloc_pool(&self, bytes: usize) -> Result<GpuPool, GpuError> {
        use sys::CUdevice_attribute as A;
        if self.attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? == 0 {
            return Err(GpuError::Unsupported {
                ordinal: self.ordinal,
                what: "no virtual memory management (cuMemCreate)".into(),
            });
        }
        if self.attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)? == 0 {
            return Err(GpuError::Unsupported { ordinal: self.ordinal, what: "no POSIX fd shareable handles".into() });
        }
        let rdma = self.attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)? != 0;
        let prop = self.prop(rdma);
        let size = self.round_to_granularity(&prop, bytes)?;
        self.bind()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // `prop` is a fully initialised allocation property for this
        // device; `handle` receives the new allocation, released by
        // `GpuPool::drop` (or below on failure).
        // SAFETY: initialised `prop`, `handle` released on drop.
        unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }.result().map_err(drv("cuMemCreate"))?;
        self.map_pool(handle, size, true, rdma)
    }

    /// Imports a pool another process exported ([`GpuPool::export_fd`]),
    /// mapped for this device (the exporter's device, or another GPU of the
    /// node with peer access: reads then go over NVLink/PCIe).
    pub fn import_pool(&self, fd: &OwnedFd, bytes: usize) -> Result<GpuPool, GpuError> {
        let prop = self.prop(false);
        let size = self.round_to_granularity(&prop, bytes)?;
        self.bind()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let raw: RawFd = fd.as_raw_fd();
        // For POSIX fd handles the driver takes the fd itself cast to
        // a pointer (CUDA driver API docs); it dups what it needs, the fd stays
        // ours.
        // SAFETY: the fd is passed by value, stays ours.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                raw as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        }
        .result()
        .map_err(drv("cuMemImportFromShareableHandle"))?;
        self.map_pool(handle, size, false, false)
    }

    fn prop(&self, rdma: bool) -> sys::CUmemAllocationProp {
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            location: self.location(self.ordinal),
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: u8::from(rdma),
                usage: 0,
                reserved: [0; 4],
            },
        }
    }

    fn location(&self, ordinal: usize) -> sys::CUmemLocation {
        sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal as i32 }
    }

    fn round_to_granularity(&self, prop: &sys::CUmemAllocationProp, bytes: usize) -> Result<usize, GpuError> {
        if bytes == 0 {
            return Err(GpuError::Invalid("pool of 0 bytes".into()));
        }
        self.bind()?;
        let mut g: usize = 0;
        // SAFETY: `prop` is initialised; `g` receives one usize.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        }
        .result()
        .map_err(drv("cuMemGetAllocationGranularity"))?;
        let g = g.max(1);
        bytes.checked_next_multiple_of(g).ok_or_else(|| GpuError::Invalid(format!("pool of {bytes} bytes overflows")))
    }

    /// Reserves an address range, maps `handle` there and grants this
    /// device read-write access. Releases `handle` (and whatever was done)
    /// on failure.
    fn map_pool(
        &self,
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
        owner: bool,
        rdma: bool,
    ) -> Result<GpuPool, GpuError> {
        let mut pool = GpuPool {
            ctx: self.ctx.clone(),
            handle,
            range: DeviceRange { ptr: 0, len: size },
            mapped: false,
            owner,
            rdma,
            ordinal: self.ordinal,
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: reserves `size` bytes of device address space; freed by
        // `GpuPool::drop` once `range.ptr` is set.
        unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) }.result().map_err(drv("cuMemAddressReserve"))?;
        pool.range.ptr = ptr;
        // SAFETY: maps the whole allocation (`size` is its rounded size) at
        // the start of the range just reserved.
        unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) }.result().map_err(drv("cuMemMap"))?;
        pool.mapped = true;
        pool.grant(self.ordinal)?;
        Ok(pool)
    }
}

/// Device memory from `cuMemAlloc`, freed on drop.
pub struct GpuBuffer {
    ctx: Arc<CudaContext>,
    range: DeviceRange,
}

impl GpuBuffer {
    /// The whole buffer.
    pub fn range(&self) -> DeviceRange {
        self.range
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        // SAFETY: `range.ptr` came from `cuMemAlloc` in this context and is
        // freed once, after the context's work finished.
        let _ = unsafe { result::free_sync(self.range.ptr) };
    }
}

/// A pool of device memory from the virtual-memory API: allocated here
/// ([`Gpu::alloc_pool`], exportable) or imported ([`Gpu::import_pool`]).
pub struct GpuPool {
    ctx: Arc<CudaContext>,
    handle: sys::CUmemGenericAllocationHandle,
    range: DeviceRange,
    mapped: bool,
    owner: bool,
    rdma: bool,
    ordinal: usize,
}

impl std::fmt::Debug for GpuPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuPool").field("ordinal", &self.ordinal).field("bytes", &self.range.len).finish()
    }
}

impl GpuPool {
    /// The whole pool (its length is the rounded size).
    pub fn range(&self) -> DeviceRange {
        self.range
    }

    /// Whether the allocation asked for GPUDirect RDMA capability (the
    /// device supports it with VMM allocations).
    pub fn rdma_capable(&self) -> bool {
        self.rdma
    }

    /// Whether this process allocated the pool (else it imported it).
    pub fn is_owner(&self) -> bool {
        self.owner
    }

    /// Grants device `ordinal` read-write access to the whole pool (the
    /// owning device at creation; another GPU of the node for peer reads).
    pub fn grant(&self, ordinal: usize) -> Result<(), GpuError> {
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal as i32,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: the range is reserved and mapped to this pool's allocation
        // (`mapped`); one access descriptor.
        unsafe { sys::cuMemSetAccess(self.range.ptr, self.range.len, &access, 1) }
            .result()
            .map_err(drv("cuMemSetAccess"))
    }

    /// A new POSIX fd for the pool's allocation, to pass to another process
    /// (SCM_RIGHTS), which maps it with [`Gpu::import_pool`].
    pub fn export_fd(&self) -> Result<OwnedFd, GpuError> {
        let mut fd: i32 = -1;
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: for POSIX fd handles the driver writes one int (the new fd)
        // at the pointer; the allocation was created with that handle type.
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut i32).cast::<c_void>(),
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }
        .result()
        .map_err(drv("cuMemExportToShareableHandle"))?;
        if fd < 0 {
            return Err(GpuError::Driver { call: "cuMemExportToShareableHandle", err: format!("returned fd {fd}") });
        }
        // SAFETY: the driver just created this fd for us; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

impl Drop for GpuPool {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        // Unmap, free the reservation and release the handle, each
        // once and in that order, only for what `map_pool` did; no work on
        // the pool is queued any more (synchronised above).
        // SAFETY: each undone once, after the work drained.
        unsafe {
            if self.mapped {
                let _ = sys::cuMemUnmap(self.range.ptr, self.range.len);
            }
            if self.range.ptr != 0 {
                let _ = sys::cuMemAddressFree(self.range.ptr, self.range.len);
            }
            let _ = sys::cuMemRelease(self.handle);
        }
    }
}

/// What a gather/scatter launch needs, every bound checked.
struct Plan {
    unit: usize,
    units: u32,
    layout: u32,
    nl: u32,
    kvn: u32,
    tt: u32,
    hh: u32,
    row_units: u32,
}

impl Plan {
    fn new(shape: &PagedKv, tensors: &[DeviceRange], pairs: &[(usize, DeviceRange)]) -> Result<Plan, GpuError> {
        let block = shape.block_bytes()?;
        let (n, bytes) = shape.tensors()?;
        if tensors.len() != n {
            return Err(LayoutError::Buffer { what: "engine tensors (count)", got: tensors.len(), want: n }.into());
        }
        if let Some(t) = tensors.iter().find(|t| t.len != bytes) {
            return Err(LayoutError::Buffer { what: "engine tensor", got: t.len, want: bytes }.into());
        }
        for (page, slot) in pairs {
            if *page >= shape.num_blocks {
                return Err(LayoutError::Page { page: *page, num_blocks: shape.num_blocks }.into());
            }
            if slot.len < block {
                return Err(LayoutError::Buffer { what: "slot payload", got: slot.len, want: block }.into());
            }
        }
        let row = shape.row_bytes_pub()?;
        let aligned = |u: usize| {
            row % u == 0
                && tensors.iter().all(|t| t.ptr % u as u64 == 0)
                && pairs.iter().all(|(_, s)| s.ptr % u as u64 == 0)
        };
        let unit = [16usize, 8, 4, 1].into_iter().find(|&u| aligned(u)).unwrap_or(1);
        let small = |v: usize, what: &str| {
            u32::try_from(v)
                .map_err(|_| GpuError::Invalid(format!("{what} = {v} does not fit the kernels' 32-bit indices")))
        };
        let (nl, kvn, tt, hh) = shape.dims();
        // The kernel's u32 grid-stride index must not wrap: a block of at
        // most 2^31 units (2 GiB of bytes at worst) leaves room for a whole
        // grid's stride.
        if block / unit > 1 << 31 {
            return Err(GpuError::Invalid(format!("a block of {block} bytes in {unit}-byte units is too large")));
        }
        Ok(Plan {
            unit,
            units: small(block / unit, "units of a block")?,
            layout: shape.layout.code(),
            nl: small(nl, "layers")?,
            kvn: small(kvn, "K/V")?,
            tt: small(tt, "tokens")?,
            hh: small(hh, "heads")?,
            row_units: small(row / unit, "row units")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, Layout};

    #[test]
    fn device_names_parse_strictly() {
        assert_eq!(parse_device("cuda:0"), Some(0));
        assert_eq!(parse_device("cuda:12"), Some(12));
        for bad in ["cuda:", "cuda:-1", "cuda:x", "cuda:1234", "gpu:0", "cuda: 1", "cuda:+1"] {
            assert_eq!(parse_device(bad), None, "{bad}");
        }
    }

    /// Without a driver (CI, this machine) opening a GPU is an error that
    /// says so, never a panic; with one, it opens or names the device.
    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        match Gpu::open(0) {
            Ok(g) => eprintln!("a CUDA device is present here: {:?}", g.describe()),
            Err(GpuError::NoDriver(why)) => {
                eprintln!("SKIP GPU paths: no CUDA driver ({why})");
                assert!(driver().is_err());
                assert!(matches!(device_count(), Err(GpuError::NoDriver(_))));
            }
            Err(e) => eprintln!("driver present, no usable device: {e}"),
        }
        assert!(matches!(Gpu::open(999), Err(GpuError::NoDriver(_) | GpuError::NoDevice { .. })));
    }

    /// The CUDA source compiles with NVRTC for the architectures kvmesh
    /// targets (Ampere, Hopper, Blackwell), and every kernel the host looks
    /// up is in the PTX. Needs only libnvrtc (no driver); skips loudly
    /// without it.
    #[test]
    fn kernels_compile_with_nvrtc() {
        if let Err(e) = nvrtc() {
            eprintln!("SKIP kernels_compile_with_nvrtc: {e}");
            if std::env::var_os("KVMESH_REQUIRE_NVRTC").is_some() {
                panic!("KVMESH_REQUIRE_NVRTC is set but {e}");
            }
            return;
        }
        for cc in [(8, 0), (9, 0), (10, 0)] {
            let ptx = compile_ptx(cc).unwrap_or_else(|e| panic!("compute_{}{}: {e}", cc.0, cc.1)).to_src();
            for f in ["kvsum_partial", "kv_move_16", "kv_move_8", "kv_move_4", "kv_move_1"] {
                assert!(ptx.contains(&format!(".entry {f}(")), "{f} missing from the PTX for {cc:?}");
            }
            assert!(ptx.contains(&format!(".target sm_{}{}", cc.0, cc.1)), "PTX for {cc:?}");
            // Machine code too (what a GPU of that architecture loads first).
            let cubin = compile_cubin(cc).unwrap_or_else(|e| panic!("sm_{}{}: {e}", cc.0, cc.1));
            assert!(cubin.len() > 1024 && cubin.starts_with(b"\x7fELF"), "CUBIN for {cc:?}");
            for f in ["kvsum_partial", "kv_move_16", "kv_move_1"] {
                assert!(cubin.windows(f.len()).any(|w| w == f.as_bytes()), "{f} missing from the CUBIN for {cc:?}");
            }
        }
    }

    /// A range that is only planned, never launched on.
    fn fake(ptr: u64, len: usize) -> DeviceRange {
        // SAFETY: the tests below hand these ranges to `Plan::new` only,
        // which reads their numbers; no device ever touches them.
        unsafe { DeviceRange::from_raw(ptr, len) }
    }

    /// The plan's checks are pure: they run without a GPU.
    #[test]
    fn plans_check_pages_sizes_and_pick_the_widest_aligned_unit() {
        let s = PagedKv {
            layout: Layout::Nhd,
            dtype: DType::F16,
            num_layers: 2,
            num_blocks: 4,
            block_tokens: 16,
            kv_heads: 2,
            head_dim: 64,
        };
        let (n, bytes) = s.tensors().unwrap();
        let block = s.block_bytes().unwrap();
        let t: Vec<DeviceRange> = (0..n).map(|i| fake(0x1000_0000 * (i as u64 + 1), bytes)).collect();
        let slot = fake(0x9000_0000, block);
        let p = Plan::new(&s, &t, &[(3, slot)]).unwrap();
        assert_eq!((p.unit, p.units, p.row_units), (16, (block / 16) as u32, 8));
        assert!(matches!(Plan::new(&s, &t, &[(4, slot)]), Err(GpuError::Layout(LayoutError::Page { .. }))));
        assert!(matches!(Plan::new(&s, &t[..1], &[(0, slot)]), Err(GpuError::Layout(LayoutError::Buffer { .. }))));
        let short = slot.sub(0, block - 1).unwrap();
        assert!(matches!(Plan::new(&s, &t, &[(0, short)]), Err(GpuError::Layout(LayoutError::Buffer { .. }))));
        // A slot on 4 bytes: 4-byte units.
        let odd = slot.sub(4, block - 4).unwrap();
        assert!(matches!(Plan::new(&s, &t, &[(0, odd)]), Err(GpuError::Layout(LayoutError::Buffer { .. }))));
        let odd = fake(0x9000_0004, block);
        assert_eq!(Plan::new(&s, &t, &[(0, odd)]).unwrap().unit, 4);
        // fp8 with an odd head_dim: bytes.
        let s8 = PagedKv { dtype: DType::Fp8, head_dim: 7, ..s };
        let (n8, bytes8) = s8.tensors().unwrap();
        let t8: Vec<DeviceRange> = (0..n8).map(|i| fake(0x1000_0000 * (i as u64 + 1), bytes8)).collect();
        assert_eq!(Plan::new(&s8, &t8, &[(0, slot)]).unwrap().unit, 1);
        assert!(slot.sub(block, 1).is_err());
    }
}
