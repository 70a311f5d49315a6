//! A CPU emulation of the device, for testing the CUDA path on machines without a GPU.
//!
//! The generated module is compiled as C++ by the system compiler (`c++`, g++ or clang) with
//! a small header that stands in for CUDA: a block's threads are fibers (ucontext) on the
//! launching thread, switched at `__syncthreads` and at warp shuffles (which synchronise the
//! warp only); `__shared__` arrays are thread-local statics (blocks run one after another).
//! GEMMs follow cuBLAS's column-major contract exactly, so the row-major conversion is exercised too. Memory is host memory:
//! "device pointers" are addresses. Slow, and only as exact as the kernels are portable C++,
//! which they are by construction.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::device::{DeviceEpilogue, ColumnMajorGemm, Device, KernelValue};
use super::err;
use crate::{DType, RuntimeError};

/// What stands in for the CUDA runtime when the module is compiled as C++.
const SHIM: &str = r#"#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <functional>
#include <ucontext.h>
using std::exp; using std::log; using std::tanh; using std::sqrt; using std::pow; using std::cos; using std::sin; using std::fmax;
// A block's threads are fibers on the launching OS thread, switched at barriers; blocks run
// one after another. Everything is per OS thread, so concurrent launches do not meet.
struct uint3_ { unsigned x, y, z; };
static thread_local uint3_ threadIdx, blockIdx, blockDim, gridDim;
struct ShimBarrier { unsigned count = 0, arrived = 0, generation = 0; };
// Switches are __builtin_setjmp/longjmp (no system call); a fiber's first entry onto its own
// stack goes through setcontext.
struct ShimFiber { ucontext_t context; void* jump[5]; bool done, started; };
static thread_local void* shim_scheduler_jump[5];
static thread_local std::vector<ShimFiber> shim_fibers;
static thread_local std::vector<std::vector<char>> shim_stacks;
static thread_local unsigned shim_current;
static thread_local const std::function<void()>* shim_kernel;
static thread_local ShimBarrier shim_block_barrier, shim_warp_barriers[32];
static thread_local double shim_lanes[1024];
alignas(128) static thread_local unsigned char shim_dynamic_shared[99 * 1024];
// The GPU faults on a vector access (or a cp.async, an ldmatrix row) at an address that is not
// a multiple of its size, where the host does not: kernels name such accesses, and here they
// are checked (memory is aligned as cudaMalloc aligns it).
#define SHARDC_EMULATED 1
inline void shim_check_aligned(const void* p, unsigned bytes, const char* what, const char* where) {
  if ((uintptr_t)p % bytes != 0) {
    std::fprintf(stderr, "emulated device: %s (%p) in %s is not %u-byte aligned, as the GPU requires\n", what, p, where, bytes);
    std::abort();
  }
}
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static thread_local
static void shim_wait(ShimBarrier& b) {
  unsigned generation = b.generation;
  if (++b.arrived == b.count) { b.arrived = 0; b.generation++; return; }
  while (b.generation == generation) {
    if (__builtin_setjmp(shim_fibers[shim_current].jump) == 0) __builtin_longjmp(shim_scheduler_jump, 1);
  }
}
inline void __syncthreads() { shim_wait(shim_block_barrier); }
// A warp's 32 threads exchange values through the lane array, synchronised as a warp.
template <class V> V __shfl_down_sync(unsigned, V v, int offset) {
  unsigned t = threadIdx.x;
  shim_lanes[t] = (double)v;
  shim_wait(shim_warp_barriers[t >> 5]);
  unsigned lane = t & 31u;
  V r = (lane + offset < 32u && t + offset < blockDim.x) ? (V)shim_lanes[t + offset] : v;
  shim_wait(shim_warp_barriers[t >> 5]);
  return r;
}
// A value from lane `src` of the warp (every lane names its own source).
template <class V> V __shfl_sync(unsigned, V v, int src) {
  unsigned t = threadIdx.x;
  shim_lanes[t] = (double)v;
  shim_wait(shim_warp_barriers[t >> 5]);
  V r = (V)shim_lanes[(t & ~31u) + ((unsigned)src & 31u)];
  shim_wait(shim_warp_barriers[t >> 5]);
  return r;
}
template <class V> V __shfl_xor_sync(unsigned mask, V v, int lane_mask) { return __shfl_sync(mask, v, (int)((threadIdx.x & 31u) ^ (unsigned)lane_mask)); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static void shim_entry() {
  (*shim_kernel)();
  shim_fibers[shim_current].done = true;
  __builtin_longjmp(shim_scheduler_jump, 1);
}
static void shim_run(unsigned gx, unsigned gy, unsigned gz, unsigned threads, const std::function<void()>& kernel) {
  const size_t stack = 64 * 1024;
  shim_fibers.resize(threads);
  while (shim_stacks.size() < threads) shim_stacks.emplace_back(stack);
  shim_kernel = &kernel;
  blockDim = {threads, 1, 1}; gridDim = {gx, gy, gz};
  ucontext_t blank;
  getcontext(&blank);
  for (unsigned z = 0; z < gz; z++) for (unsigned y = 0; y < gy; y++) for (unsigned x = 0; x < gx; x++) {
    blockIdx = {x, y, z};
    shim_block_barrier = ShimBarrier{threads, 0, 0};
    for (unsigned w = 0; w < 32; w++) shim_warp_barriers[w] = ShimBarrier{threads > 32 * w ? (threads - 32 * w < 32 ? threads - 32 * w : 32) : 0, 0, 0};
    for (unsigned t = 0; t < threads; t++) {
      ShimFiber& f = shim_fibers[t];
      f.done = false;
      f.started = false;
      f.context = blank;
      f.context.uc_stack.ss_sp = shim_stacks[t].data();
      f.context.uc_stack.ss_size = stack;
      f.context.uc_link = nullptr;
      makecontext(&f.context, shim_entry, 0);
    }
    unsigned remaining = threads;
    while (remaining > 0) {
      for (unsigned t = 0; t < threads; t++) {
        if (shim_fibers[t].done) continue;
        shim_current = t;
        threadIdx = {t, 0, 0};
        ShimFiber& f = shim_fibers[t];
        if (__builtin_setjmp(shim_scheduler_jump) == 0) {
          if (!f.started) { f.started = true; setcontext(&f.context); }
          else __builtin_longjmp(f.jump, 1);
        }
        if (shim_fibers[t].done) remaining--;
      }
    }
  }
}
struct ShimArg { unsigned long long p; long long i; double f; int i32; };
"#;

/// One parameter of a kernel signature: how to read it from a [`ShimArg`].
fn parameter_reader(param: &str, index: usize) -> Result<String, String> {
    let param = param.trim();
    let name_at = param.rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
    let ty = param[..name_at].trim();
    Ok(if ty.contains('*') {
        format!("({ty})a[{index}].p")
    } else {
        match ty {
            "i64" | "long long" => format!("a[{index}].i"),
            "double" => format!("a[{index}].f"),
            "int" => format!("a[{index}].i32"),
            other => return Err(format!("kernel parameter type `{other}` has no emulation")),
        }
    })
}

/// The module as C++: the shim, the source (dynamic shared memory made a pointer), and a
/// `launch_NAME(args, gx, gy, gz, threads)` for every kernel.
pub fn cpp_source(source: &str) -> Result<String, String> {
    let mut launchers = String::new();
    // Kernels a bf16 module instantiates for fp32 buffers live in a namespace where `T` is
    // float: their launchers go there too, so names and pointer types resolve the same way.
    let mut scoped = String::new();
    let scope = match (source.find("namespace fp32_instance {"), source.find("}  // namespace fp32_instance")) {
        (Some(open), Some(close)) => open..close,
        _ => 0..0,
    };
    let marker = "extern \"C\" __global__ void ";
    let mut at = 0;
    for piece in source.split(marker).skip(1) {
        at = source[at..].find(marker).map_or(at, |p| at + p + marker.len());
        let launchers = if scope.contains(&at) { &mut scoped } else { &mut launchers };
        let open = piece.find('(').ok_or("a kernel without parameters")?;
        let name = piece[..open].trim();
        let close = piece.find(')').ok_or("a kernel without a closing parenthesis")?;
        let params: Vec<&str> = piece[open + 1..close].split(',').filter(|p| !p.trim().is_empty()).collect();
        let reads = params.iter().enumerate().map(|(i, p)| parameter_reader(p, i)).collect::<Result<Vec<_>, _>>()?;
        launchers.push_str(&format!(
            "extern \"C\" void launch_{name}(const ShimArg* a, unsigned gx, unsigned gy, unsigned gz, unsigned threads) {{ shim_run(gx, gy, gz, threads, [&] {{ {name}({}); }}); }}\n",
            reads.join(", ")
        ));
    }
    if !scoped.is_empty() {
        launchers.push_str(&format!("namespace fp32_instance {{\n{scoped}}}\n"));
    }
    let body = source.replace("extern __shared__ unsigned char shared_raw[];", "unsigned char* shared_raw = shim_dynamic_shared;");
    Ok(format!("{SHIM}{body}\n{launchers}"))
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ShimArg {
    p: u64,
    i: i64,
    f: f64,
    i32: i32,
}

type Launcher = unsafe extern "C" fn(*const ShimArg, u32, u32, u32, u32);

/// Where cudaMalloc places an allocation: at a multiple of this many bytes.
const ALLOCATION_ALIGN: usize = 256;

/// The emulated device: the module built as a shared library, host memory.
pub struct Emulated {
    library: libloading::Library,
    launchers: HashMap<String, Launcher>,
    allocations: HashMap<u64, Box<[u64]>>,
}

impl Emulated {
    /// Compiles `source` with the system C++ compiler (cached by content in the temporary
    /// directory) and loads it.
    pub fn new(source: &str, kernels: &[String]) -> Result<Emulated, RuntimeError> {
        let cpp = cpp_source(source).map_err(err)?;
        let hash = crate::init::key(0, &cpp);
        let dir = std::env::temp_dir().join("shardc-emulated");
        std::fs::create_dir_all(&dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
        let library_path = dir.join(format!("module-{hash:016x}.so"));
        if !library_path.exists() {
            // Names of this attempt alone: threads of one process (the emulated processes of a
            // multi-process test) may build the same module at once; the last rename wins,
            // with identical bytes.
            static ATTEMPTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let attempt = format!("{}-{}", std::process::id(), ATTEMPTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            let source_path = dir.join(format!("module-{hash:016x}.{attempt}.cpp"));
            std::fs::write(&source_path, &cpp).map_err(|e| err(format!("{}: {e}", source_path.display())))?;
            let partial = dir.join(format!("module-{hash:016x}.{attempt}.so"));
            let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
            let output = std::process::Command::new(&compiler)
                .args(["-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o"])
                .arg(&partial)
                .arg(&source_path)
                .output()
                .map_err(|e| err(format!("running the C++ compiler `{compiler}` for the emulated device: {e}")))?;
            if !output.status.success() {
                return Err(err(format!("the emulated module does not compile:\n{}", String::from_utf8_lossy(&output.stderr))));
            }
            std::fs::rename(&partial, &library_path).map_err(|e| err(e.to_string()))?;
            let _ = std::fs::remove_file(&source_path);
        }
        // SAFETY: a library this function just built from the module and the shim; loading
        // runs no initialisers of ours beyond static zero-initialised arrays.
        let library = unsafe { libloading::Library::new(&library_path) }.map_err(|e| err(format!("loading {}: {e}", library_path.display())))?;
        let mut launchers = HashMap::new();
        for kernel in kernels {
            let symbol = format!("launch_{kernel}");
            // SAFETY: every launch_ function has the Launcher signature (cpp_source).
            let launcher: Launcher = *unsafe { library.get::<Launcher>(symbol.as_bytes()) }.map_err(|e| err(format!("`{kernel}`: {e}")))?;
            launchers.insert(kernel.clone(), launcher);
        }
        Ok(Emulated { library, launchers, allocations: HashMap::new() })
    }
}

impl Device for Emulated {
    fn alloc(&mut self, bytes: usize) -> Result<u64, RuntimeError> {
        // At a multiple of 256 bytes, as cudaMalloc places allocations, so that the kernels'
        // alignment checks see what the GPU would (the arena aligns within).
        let memory = vec![0u64; bytes.div_ceil(8).max(1) + ALLOCATION_ALIGN / 8].into_boxed_slice();
        let base = memory.as_ptr() as u64;
        let ptr = base.next_multiple_of(ALLOCATION_ALIGN as u64);
        self.allocations.insert(ptr, memory);
        Ok(ptr)
    }
    fn free(&mut self, ptr: u64) {
        self.allocations.remove(&ptr);
    }
    fn zero(&self, ptr: u64, bytes: usize) -> Result<(), RuntimeError> {
        // SAFETY: the caller's range inside an allocation of this device.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        Ok(())
    }
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), RuntimeError> {
        // SAFETY: ranges inside allocations of this device (they may overlap: memmove).
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn upload(&self, dst: u64, bytes: &[u8]) -> Result<(), RuntimeError> {
        // SAFETY: as copy.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst as *mut u8, bytes.len()) };
        Ok(())
    }
    fn download(&self, dst: &mut [u8], src: u64) -> Result<(), RuntimeError> {
        // SAFETY: as copy.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn launch(&self, kernel: &str, grid: [u32; 3], block: u32, shared_bytes: u32, args: &[KernelValue]) -> Result<(), RuntimeError> {
        let launcher = self.launchers.get(kernel).ok_or_else(|| err(format!("kernel `{kernel}` is not in the module")))?;
        // A launch may opt into up to MAX_SHARED_BYTES (the shim's buffer above).
        if shared_bytes as usize > shardc_ir::kernel::MAX_SHARED_BYTES || block > 1024 {
            return Err(err(format!("`{kernel}`: {block} threads and {shared_bytes} bytes of shared memory exceed a block's limits")));
        }
        // A GPU refuses a grid past 2^31 - 1 blocks in x or 65535 in y or z.
        if grid[0] > i32::MAX as u32 || grid[1] > 65_535 || grid[2] > 65_535 || grid.contains(&0) {
            return Err(err(format!("`{kernel}`: a grid of {grid:?} blocks is not one a GPU launches (x up to 2^31 - 1, y and z up to 65535, none 0)")));
        }
        let values: Vec<ShimArg> = args
            .iter()
            .map(|a| match *a {
                KernelValue::Ptr(p) => ShimArg { p, ..Default::default() },
                KernelValue::I64(i) => ShimArg { i, ..Default::default() },
                KernelValue::F64(f) => ShimArg { f, ..Default::default() },
                KernelValue::I32(i32) => ShimArg { i32, ..Default::default() },
            })
            .collect();
        let _ = &self.library;
        // SAFETY: the launcher reads as many arguments as the kernel has, typed as the
        // device plan generated them; pointers are addresses of this device's allocations.
        unsafe { launcher(values.as_ptr(), grid[0], grid[1], grid[2], block) };
        Ok(())
    }
    fn gemm(&self, dtype: DType, g: &ColumnMajorGemm) -> Result<(), RuntimeError> {
        gemm_with(dtype, g, None)
    }
    fn gemm_epilogue(&self, dtype: DType, g: &ColumnMajorGemm, e: &DeviceEpilogue) -> Result<bool, RuntimeError> {
        // As on a GPU, SHARDC_CUBLASLT=0 leaves the epilogue to the plain GEMM and its kernel.
        if std::env::var("SHARDC_CUBLASLT").is_ok_and(|v| v == "0") {
            return Ok(false);
        }
        gemm_with(dtype, g, Some(e))?;
        Ok(true)
    }
    fn synchronize(&self) -> Result<(), RuntimeError> {
        Ok(())
    }
    fn name(&self) -> String {
        "emulated GPU (CPU threads)".into()
    }
    fn stream(&self) -> Option<&Arc<CudaStream>> {
        None
    }
}

/// cuBLAS's contract, `C(m x n, ldc) = op(A) op(B)` column-major per batch item, and
/// cuBLASLt's epilogues on it: the bias (a vector of C's rows) and the activation applied to
/// the accumulated value, rounded to the storage type once; GELU stores its input in `aux`.
fn gemm_with(dtype: DType, g: &ColumnMajorGemm, epilogue: Option<&DeviceEpilogue>) -> Result<(), RuntimeError> {
    use crate::program::EpilogueActivation;
    let size = dtype.bytes();
    let read = |base: u64, index: usize| -> f64 {
        let at = (base as usize + index * size) as *const u8;
        // SAFETY: indices within the operands as the GEMM describes them.
        unsafe {
            match dtype {
                DType::F64 => (at as *const f64).read_unaligned(),
                DType::Bf16 => f32::from_bits(((at as *const u16).read_unaligned() as u32) << 16) as f64,
                _ => (at as *const f32).read_unaligned() as f64,
            }
        }
    };
    let write = |base: u64, index: usize, v: f64| {
        let at = (base as usize + index * size) as *mut u8;
        // SAFETY: as `read`, for C and the epilogue's auxiliary matrix (C's layout).
        unsafe {
            match dtype {
                DType::F64 => (at as *mut f64).write_unaligned(v),
                DType::Bf16 => (at as *mut u16).write_unaligned(super::bf16_bits(v as f32)),
                _ => (at as *mut f32).write_unaligned(v as f32),
            }
        }
    };
    // GELU as the CPU kernels compute it, in the accumulator type (fp32 beside fp32 and bf16).
    let gelu = |x: f64| crate::cpu::gelu(x as f32) as f64;
    let gelu_df = |x: f64| crate::cpu::gelu_derivative(x as f32) as f64;
    for item in 0..g.batch {
        for j in 0..g.n {
            for i in 0..g.m {
                let mut acc = 0.0f64;
                for p in 0..g.k {
                    let a = if g.transpose_a { read(g.a, item * g.stride_a + i * g.lda + p) } else { read(g.a, item * g.stride_a + p * g.lda + i) };
                    let b = if g.transpose_b { read(g.b, item * g.stride_b + p * g.ldb + j) } else { read(g.b, item * g.stride_b + j * g.ldb + p) };
                    acc += a * b;
                }
                let at = item * g.stride_c + j * g.ldc + i;
                if let Some(e) = epilogue {
                    if dtype != DType::F64 {
                        acc = acc as f32 as f64;
                    }
                    if e.bias != 0 {
                        acc += read(e.bias, i);
                    }
                    match e.activation {
                        EpilogueActivation::None => {}
                        EpilogueActivation::Gelu => {
                            if e.aux != 0 {
                                write(e.aux, at, acc);
                            }
                            acc = gelu(acc);
                        }
                        EpilogueActivation::GeluGrad => acc *= gelu_df(read(e.aux, at)),
                    }
                }
                write(g.c, at, acc);
            }
        }
    }
    Ok(())
}
