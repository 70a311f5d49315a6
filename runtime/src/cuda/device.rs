//! What the executor needs of a device: memory, kernel launches, GEMMs. Two implementations:
//! a real GPU through cudarc ([`Gpu`]), and an emulation on the CPU ([`super::emulate`]) that
//! runs the very same CUDA C, so the device plan and the executor are tested without a GPU.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{result as drv, CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};

use super::err;
use crate::program::Gemm;
use crate::{DType, RuntimeError};

/// A kernel argument's value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelValue {
    /// A device pointer.
    Ptr(u64),
    /// `long long`.
    I64(i64),
    /// `double`.
    F64(f64),
    /// `int`.
    I32(i32),
}

/// A GEMM in cuBLAS's column-major terms (what `cublasGemmStridedBatchedEx` receives).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColumnMajorGemm {
    /// op(A) transposes A.
    pub transpose_a: bool,
    /// op(B) transposes B.
    pub transpose_b: bool,
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Contracted dimension.
    pub k: usize,
    /// A.
    pub a: u64,
    /// Leading dimension of A.
    pub lda: usize,
    /// Batch stride of A (elements).
    pub stride_a: usize,
    /// B.
    pub b: u64,
    /// Leading dimension of B.
    pub ldb: usize,
    /// Batch stride of B.
    pub stride_b: usize,
    /// C.
    pub c: u64,
    /// Leading dimension of C.
    pub ldc: usize,
    /// Batch stride of C.
    pub stride_c: usize,
    /// Batch items.
    pub batch: usize,
}

impl ColumnMajorGemm {
    /// A row-major `C = op(A) op(B)` is the column-major `C^T = op(B)^T op(A)^T`: swap the
    /// operands and the output's dimensions; every stored matrix keeps its leading dimension.
    pub fn of(g: &Gemm, a: u64, b: u64, c: u64) -> ColumnMajorGemm {
        ColumnMajorGemm {
            transpose_a: g.transpose_b,
            transpose_b: g.transpose_a,
            m: g.n,
            n: g.m,
            k: g.k,
            a: b,
            lda: g.ldb,
            stride_a: g.stride_b,
            b: a,
            ldb: g.lda,
            stride_b: g.stride_a,
            c,
            ldc: g.ldc,
            stride_c: g.stride_c,
            batch: g.batch,
        }
    }
}

/// An epilogue with device pointers (0: absent). In cuBLAS's column-major terms the bias is a
/// vector of C's rows; `aux` has C's layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceEpilogue {
    /// Bias pointer.
    pub bias: u64,
    /// What follows the bias.
    pub activation: crate::program::EpilogueActivation,
    /// The pre-activation: written under GELU, read under its gradient.
    pub aux: u64,
}

/// A point in a device's queue of work: the time between two is what the device spent on
/// the calls queued between them.
pub enum Marker {
    /// An event recorded on the GPU's stream (timed when the GPU reaches it).
    Event(cudarc::driver::CudaEvent),
    /// The host's clock, for a device that runs each call before returning (the emulation).
    Host(std::time::Instant),
}

impl Marker {
    /// Seconds from this marker to `end` (waits for `end` to be reached).
    pub fn seconds_to(&self, end: &Marker) -> Result<f64, RuntimeError> {
        match (self, end) {
            (Marker::Event(a), Marker::Event(b)) => a.elapsed_ms(b).map(|ms| ms as f64 / 1e3).map_err(|e| err(format!("timing events: {e:?}"))),
            (Marker::Host(a), Marker::Host(b)) => Ok(b.saturating_duration_since(*a).as_secs_f64()),
            _ => Err(err("markers of two kinds of device")),
        }
    }
}

/// A device the executor drives. Every operation is ordered after the ones before it.
pub trait Device {
    /// Allocates `bytes` (zeroed).
    fn alloc(&mut self, bytes: usize) -> Result<u64, RuntimeError>;
    /// Frees an allocation.
    fn free(&mut self, ptr: u64);
    /// Zeroes `bytes` at `ptr`.
    fn zero(&self, ptr: u64, bytes: usize) -> Result<(), RuntimeError>;
    /// Copies `bytes` between device ranges.
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), RuntimeError>;
    /// Host to device (synchronous).
    fn upload(&self, dst: u64, bytes: &[u8]) -> Result<(), RuntimeError>;
    /// Device to host (waits for the work before it).
    fn download(&self, dst: &mut [u8], src: u64) -> Result<(), RuntimeError>;
    /// Launches a kernel of the module.
    fn launch(&self, kernel: &str, grid: [u32; 3], block: u32, shared_bytes: u32, args: &[KernelValue]) -> Result<(), RuntimeError>;
    /// A GEMM with fp32 (fp64 for f64) accumulation.
    fn gemm(&self, dtype: DType, g: &ColumnMajorGemm) -> Result<(), RuntimeError>;
    /// A GEMM with a fused epilogue, as cuBLASLt runs it: the product (kept in the
    /// accumulator type), plus the bias, through the activation, stored once. Returns false
    /// where the device has no fused form for it (the caller then runs [`Device::gemm`] and
    /// the prelude's epilogue kernel).
    fn gemm_epilogue(&self, _dtype: DType, _g: &ColumnMajorGemm, _e: &DeviceEpilogue) -> Result<bool, RuntimeError> {
        Ok(false)
    }
    /// A marker after everything queued so far (the host's clock where calls run at once).
    fn marker(&self) -> Result<Marker, RuntimeError> {
        Ok(Marker::Host(std::time::Instant::now()))
    }
    /// Bytes the device holds outside the executor's allocations (cuBLASLt's workspace).
    fn held_bytes(&self) -> usize {
        0
    }
    /// Waits for everything queued.
    fn synchronize(&self) -> Result<(), RuntimeError>;
    /// Its name, for reports.
    fn name(&self) -> String;
    /// The CUDA stream work is queued on (NCCL runs on it); none for an emulation.
    fn stream(&self) -> Option<&Arc<CudaStream>>;
    /// A second stream for communication that overlaps compute (data-parallel gradient
    /// buckets); none for an emulation.
    fn comm_stream(&self) -> Option<&Arc<CudaStream>> {
        None
    }
}

/// A device and what is allocated on it: the bytes live now and the most live at once (what
/// `torch.cuda.max_memory_allocated` reports), so a run says what it held, measured, beside
/// what the compiled plan says it holds. Allocation and freeing go through it; everything
/// else reaches the device.
pub struct Metered {
    device: Box<dyn Device>,
    sizes: HashMap<u64, usize>,
    live: usize,
    peak: usize,
}

impl Metered {
    /// Meters `device`, counting what it holds before any allocation (cuBLASLt's workspace).
    pub fn new(device: Box<dyn Device>) -> Metered {
        let held = device.held_bytes();
        Metered { device, sizes: HashMap::new(), live: held, peak: held }
    }
    /// Allocates `bytes` (zeroed) and counts them.
    pub fn alloc(&mut self, bytes: usize) -> Result<u64, RuntimeError> {
        let ptr = self.device.alloc(bytes)?;
        self.sizes.insert(ptr, bytes);
        self.live += bytes;
        self.peak = self.peak.max(self.live);
        Ok(ptr)
    }
    /// Frees an allocation of [`Metered::alloc`].
    pub fn free(&mut self, ptr: u64) {
        self.live -= self.sizes.remove(&ptr).unwrap_or(0);
        self.device.free(ptr);
    }
    /// The most bytes live at once so far.
    pub fn peak(&self) -> usize {
        self.peak
    }
}

impl std::ops::Deref for Metered {
    type Target = dyn Device;
    fn deref(&self) -> &Self::Target {
        &*self.device
    }
}

/// A GPU: one context, one stream, the module (a cubin from NVRTC or the kernel cache), cuBLAS.
pub struct Gpu {
    /// None where cuBLASLt's library is absent: epilogues then run unfused. First, so it is
    /// dropped (its handle and workspace freed) while the context still lives.
    lt: Option<super::lt::Lt>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
    /// Per kernel, the most dynamic shared memory a launch has asked for (and been given).
    shared_asked: std::sync::Mutex<HashMap<String, u32>>,
    blas: cudarc::cublas::CudaBlas,
}

impl Gpu {
    /// Opens GPU `device` and loads `source` (its cubin from NVRTC or the kernel cache) with `kernels`.
    pub fn new(device: usize, source: &str, kernels: &[String]) -> Result<Gpu, RuntimeError> {
        super::check_available()?;
        let count = CudaContext::device_count().map_err(|e| err(format!("{e:?}")))? as usize;
        if device >= count {
            return Err(err(format!("GPU {device} does not exist (this machine has {count})")));
        }
        let ctx = CudaContext::new(device).map_err(|e| err(format!("creating a context on GPU {device}: {e:?}")))?;
        // SAFETY: the executor passes raw pointers only, so cudarc's per-slice events are unused.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let capability = ctx.compute_capability().map_err(|e| err(format!("reading GPU {device}'s compute capability: {e:?}")))?;
        // The GPU's own machine code (cached on disk), so the driver has nothing to JIT; should
        // the driver refuse a cubin (one from a newer NVRTC than it knows), it JITs the PTX.
        let cubin = super::compile::cubin_for(source, capability)?;
        let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)) {
            Ok(module) => module,
            Err(refused) => {
                let ptx = super::compile_ptx_for(source, Some(capability))?;
                ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(|e| err(format!("loading the module: {e:?} (its cubin: {refused:?})")))?
            }
        };
        let mut functions = HashMap::new();
        for kernel in kernels {
            if !functions.contains_key(kernel) {
                functions.insert(kernel.clone(), module.load_function(kernel).map_err(|e| err(format!("kernel `{kernel}`: {e:?}")))?);
            }
        }
        let blas = cudarc::cublas::CudaBlas::new(stream.clone()).map_err(|e| err(format!("cuBLAS: {e:?}")))?;
        let comm = ctx.new_stream().map_err(|e| err(format!("creating a stream: {e:?}")))?;
        // SAFETY: only tries to dlopen the library.
        let lt = if unsafe { cudarc::cublaslt::sys::is_culib_present() } { Some(super::lt::Lt::new(capability.0)?) } else { None };
        Ok(Gpu { ctx, stream, comm, _module: module, functions, shared_asked: Default::default(), blas, lt })
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Work still queued may use cuBLASLt's workspace, which `lt` frees first.
        let _ = self.stream.synchronize();
        let _ = self.comm.synchronize();
    }
}

impl Device for Gpu {
    fn alloc(&mut self, bytes: usize) -> Result<u64, RuntimeError> {
        // SAFETY: a fresh allocation on this context, zeroed before use.
        let ptr = unsafe { drv::malloc_sync(bytes.max(1)) }.map_err(|e| err(format!("out of device memory allocating {bytes} bytes: {e:?}")))?;
        self.zero(ptr, bytes)?;
        Ok(ptr)
    }
    fn free(&mut self, ptr: u64) {
        let _ = self.stream.synchronize();
        // SAFETY: allocated by `alloc`, freed once.
        let _ = unsafe { drv::free_sync(ptr) };
    }
    fn zero(&self, ptr: u64, bytes: usize) -> Result<(), RuntimeError> {
        // SAFETY: the caller's range inside a live allocation.
        unsafe { drv::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }.map_err(|e| err(format!("{e:?}")))
    }
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), RuntimeError> {
        // SAFETY: ranges inside live allocations; stream-ordered.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(|e| err(format!("{e:?}")))
    }
    fn upload(&self, dst: u64, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.synchronize()?;
        // SAFETY: synchronous copy into a live allocation of at least `bytes.len()`.
        unsafe { drv::memcpy_htod_sync(dst, bytes) }.map_err(|e| err(format!("{e:?}")))
    }
    fn download(&self, dst: &mut [u8], src: u64) -> Result<(), RuntimeError> {
        self.synchronize()?;
        // SAFETY: synchronous copy out of a live allocation.
        unsafe { drv::memcpy_dtoh_sync(dst, src) }.map_err(|e| err(format!("{e:?}")))
    }
    fn launch(&self, kernel: &str, grid: [u32; 3], block: u32, shared_bytes: u32, args: &[KernelValue]) -> Result<(), RuntimeError> {
        let function = self.functions.get(kernel).ok_or_else(|| err(format!("kernel `{kernel}` is not in the module")))?;
        let mut builder = self.stream.launch_builder(function);
        for arg in args {
            match arg {
                KernelValue::Ptr(v) => builder.arg(v),
                KernelValue::I64(v) => builder.arg(v),
                KernelValue::F64(v) => builder.arg(v),
                KernelValue::I32(v) => builder.arg(v),
            };
        }
        // A block whose dynamic and static shared memory pass the 48 KiB it gets by default
        // opts into more (a norm's row cache for a wide model), once per kernel and size: a
        // GPU that has less than the launch asks refuses it, naming the kernel.
        let mut asked = self.shared_asked.lock().map_err(|_| err("a launch on another thread panicked"))?;
        if shared_bytes > asked.get(kernel).copied().unwrap_or(0) {
            use cudarc::driver::sys::CUfunction_attribute_enum as Attribute;
            let fixed = function.get_attribute(Attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES).map_err(|e| err(format!("`{kernel}`'s static shared memory: {e:?}")))?;
            if shared_bytes as usize + fixed.max(0) as usize > shardc_ir::kernel::DEFAULT_SHARED_BYTES {
                function
                    .set_attribute(Attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes as i32)
                    .map_err(|e| err(format!("`{kernel}` asks for {shared_bytes} bytes of dynamic shared memory beside {fixed} static, more than this GPU gives a block (compute capability 8.0 or later gives 99 KiB and more): {e:?}")))?;
            }
            asked.insert(kernel.to_string(), shared_bytes);
        }
        drop(asked);
        let config = LaunchConfig { grid_dim: (grid[0], grid[1], grid[2]), block_dim: (block, 1, 1), shared_mem_bytes: shared_bytes };
        // SAFETY: argument lists are generated with the kernels' signatures (pointers into
        // live allocations, i64, f64, int); the emulated device runs the same launches in
        // the tests.
        unsafe { builder.launch(config) }.map(|_| ()).map_err(|e| err(format!("launching `{kernel}`: {e:?}")))
    }
    fn gemm(&self, dtype: DType, g: &ColumnMajorGemm) -> Result<(), RuntimeError> {
        use cudarc::cublas::sys::{cublasComputeType_t as Compute, cublasOperation_t as Op, cudaDataType as Ty};
        let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
        let (ty, compute) = match dtype {
            DType::Bf16 => (Ty::CUDA_R_16BF, Compute::CUBLAS_COMPUTE_32F),
            DType::F64 => (Ty::CUDA_R_64F, Compute::CUBLAS_COMPUTE_64F),
            _ => (Ty::CUDA_R_32F, Compute::CUBLAS_COMPUTE_32F),
        };
        let (alpha32, beta32, alpha64, beta64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
        let (alpha, beta): (*const std::ffi::c_void, *const std::ffi::c_void) = if dtype == DType::F64 {
            (&alpha64 as *const f64 as *const _, &beta64 as *const f64 as *const _)
        } else {
            (&alpha32 as *const f32 as *const _, &beta32 as *const f32 as *const _)
        };
        let int = |v: usize| i32::try_from(v).map_err(|_| err(format!("GEMM dimension {v} exceeds cuBLAS's 32-bit range")));
        // SAFETY: device pointers holding the operands with the strides `g` states; alpha
        // and beta are host scalars that outlive the call.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                op(g.transpose_a),
                op(g.transpose_b),
                int(g.m)?,
                int(g.n)?,
                int(g.k)?,
                alpha,
                g.a as *const _,
                ty,
                int(g.lda)?,
                g.stride_a as i64,
                g.b as *const _,
                ty,
                int(g.ldb)?,
                g.stride_b as i64,
                beta,
                g.c as *mut _,
                ty,
                int(g.ldc)?,
                g.stride_c as i64,
                int(g.batch)?,
                compute,
                cudarc::cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| err(format!("cuBLAS GEMM {}x{}x{}: {e:?}", g.m, g.n, g.k)))
    }
    fn gemm_epilogue(&self, dtype: DType, g: &ColumnMajorGemm, e: &DeviceEpilogue) -> Result<bool, RuntimeError> {
        match &self.lt {
            Some(lt) => lt.matmul(dtype, g, e, self.stream.cu_stream() as _),
            None => Ok(false),
        }
    }
    fn held_bytes(&self) -> usize {
        self.lt.as_ref().map_or(0, |lt| lt.workspace_bytes())
    }
    fn marker(&self) -> Result<Marker, RuntimeError> {
        let timed = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        self.stream.record_event(Some(timed)).map(Marker::Event).map_err(|e| err(format!("recording an event: {e:?}")))
    }
    fn synchronize(&self) -> Result<(), RuntimeError> {
        self.stream.synchronize().map_err(|e| err(format!("{e:?}")))?;
        self.comm.synchronize().map_err(|e| err(format!("{e:?}")))
    }
    fn name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "GPU".into());
        match self.ctx.compute_capability() {
            Ok((major, minor)) => format!("{name} (sm_{major}{minor})"),
            Err(_) => name,
        }
    }
    fn stream(&self) -> Option<&Arc<CudaStream>> {
        Some(&self.stream)
    }
    fn comm_stream(&self) -> Option<&Arc<CudaStream>> {
        Some(&self.comm)
    }
}
