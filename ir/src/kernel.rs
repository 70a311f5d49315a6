//! Device kernels: how an `xf` op runs on an accelerator.
//!
//! Each op states its GPU code next to its other facts ([`crate::ops::OpDef::device`]): an
//! element-wise op gives one CUDA C statement per element (codegen fuses chains of them into
//! one kernel), a matrix product gives a GEMM for cuBLAS, the rest give CUDA C kernels and
//! their launches. Kernel sources are written over the storage type `T` and the accumulation
//! type `acc_t` ([`PRELUDE`]), so one text serves fp32, fp64 and bf16 (bf16 storage with fp32
//! accumulation). No CUDA header is needed: bf16 is converted by hand, so NVRTC compiles the
//! module with no include path.

use serde::{Deserialize, Serialize};

use crate::attrs::Attrs;
use crate::types::TensorTy;

/// How one op instance runs on a device.
#[derive(Clone, Debug, PartialEq)]
pub enum DeviceKernel {
    /// The result is the first operand (a copy when they live in different buffers).
    PassThrough,
    /// One element at a time. `body` is CUDA C statements over `{in0}`, `{in1}`, ... (the
    /// operands' values at the element, as `acc_t`; an operand shorter than the result is
    /// read at the index modulo its length, so a bias broadcasts) assigning `{out0}`, ...;
    /// `{name}` is the op's float attribute `name`.
    Elementwise {
        /// The statements.
        body: &'static str,
    },
    /// A matrix product for cuBLAS.
    Gemm(Gemm),
    /// Hand-written kernels, launched in order.
    Launches(Vec<Launch>),
}

/// `C[b] = op(A[b]) op(B[b])` over row-major matrices, `b` in `0..batch`.
///
/// An op's kernel names A, B and C by operand and result index; in a rank program (codegen
/// writes it, runtimes read it) the same struct names them by buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gemm {
    /// A: operand index (buffer in a rank program).
    pub a: usize,
    /// B: operand index (buffer in a rank program).
    pub b: usize,
    /// C: result index (buffer in a rank program).
    pub c: usize,
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Contracted dimension.
    pub k: usize,
    /// A is stored transposed (`[k, m]`).
    pub transpose_a: bool,
    /// B is stored transposed (`[n, k]`).
    pub transpose_b: bool,
    /// Row strides (elements) of A, B and C as stored.
    pub lda: usize,
    /// Row stride of B.
    pub ldb: usize,
    /// Row stride of C.
    pub ldc: usize,
    /// Elements between batch items of A, B (0: shared) and C.
    pub stride_a: usize,
    /// Batch stride of B.
    pub stride_b: usize,
    /// Batch stride of C.
    pub stride_c: usize,
    /// Batch items.
    pub batch: usize,
}

/// A stage of a GEMM epilogue (cuBLASLt's `CUBLASLT_EPILOGUE_*`), as an op declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EpilogueStage {
    /// `product + rhs`, `rhs` a vector of the product's columns broadcast over its rows.
    Bias,
    /// `gelu(x)` (tanh approximation) of the product (plus bias).
    Gelu,
    /// `dy * gelu'(x)` with `dy` the product and `x` the stored pre-activation.
    GeluGrad,
}

/// One launch of a hand-written kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// Name of the `__global__` function in `source`.
    pub kernel: &'static str,
    /// CUDA C defining it (shared by the op's launches; codegen includes each text once).
    pub source: &'static str,
    /// Grid size.
    pub grid: [u32; 3],
    /// Threads per block (a multiple of 32: block reductions need whole warps).
    pub block: u32,
    /// Dynamic shared memory, in `acc_t` elements.
    pub shared: usize,
    /// Scratch the launch reads or writes, in `acc_t` elements ([`Arg::Workspace`]).
    pub workspace: usize,
    /// Kernel arguments, in order.
    pub args: Vec<Arg>,
}

/// A kernel argument.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    /// Pointer to operand `i`.
    In(usize),
    /// Pointer to result `i`.
    Out(usize),
    /// A null pointer (an optional result that is absent).
    Null,
    /// Pointer to the op's scratch memory (`acc_t` elements, shared by its launches).
    Workspace,
    /// A `long long`.
    Int(i64),
    /// A `double`.
    Float(f64),
    /// `long long`: the first row (or vocabulary entry) this rank holds of a table split by
    /// the grid axes the instruction names, or the position of its first sequence row when
    /// its positions are split (`xf.seq_split_axes`); 0 when it is not split. Known only at
    /// run time.
    RankOffset,
    /// `long long`: the sequence row of the first key of the block a ring-attention step
    /// (`xf.ring_step`) holds: that of the part its cp group's rank `(p - step) mod n` holds.
    /// Known only at run time.
    RingKeyOffset,
}

/// Threads per block of row kernels.
pub const ROW_BLOCK: u32 = 256;

/// Dynamic shared memory a block gets without opting in, in bytes (every GPU since Kepler).
pub const DEFAULT_SHARED_BYTES: usize = 48 * 1024;

/// Most dynamic shared memory a launch may ask for, in bytes: what a block may opt into on
/// every GPU of compute capability 8.6 and 8.9 (99 KiB; an A100 allows 163 KiB, an H100 or
/// H200 227 KiB). The runtime opts a kernel in when a launch asks for more than
/// [`DEFAULT_SHARED_BYTES`].
pub const MAX_SHARED_BYTES: usize = 99 * 1024;

/// Most blocks a CUDA grid may have in its y dimension.
pub const MAX_GRID_Y: usize = 65_535;

/// `n` blocks in a grid's y dimension (one per `what`), or why a launch cannot have them:
/// CUDA allows at most [`MAX_GRID_Y`] there, and a larger count would fail at launch (or,
/// cast to `u32`, silently cover fewer).
pub fn grid_y(n: usize, what: &str) -> Result<u32, String> {
    match u32::try_from(n) {
        Ok(blocks) if (1..=MAX_GRID_Y).contains(&n) => Ok(blocks),
        _ => Err(format!("{n} {what} make {n} blocks in the grid's y dimension, more than the {MAX_GRID_Y} CUDA allows: use a smaller micro-batch, or more tensor parallelism")),
    }
}

/// Blocks for a grid-stride loop over `n` elements at [`ROW_BLOCK`] threads.
pub fn blocks_for(n: usize) -> u32 {
    n.div_ceil(ROW_BLOCK as usize).clamp(1, 65_535) as u32
}

/// A one-dimensional grid-stride launch over `n` elements.
pub fn flat(kernel: &'static str, source: &'static str, n: usize, args: Vec<Arg>) -> Launch {
    Launch { kernel, source, grid: [blocks_for(n), 1, 1], block: ROW_BLOCK, shared: 0, workspace: 0, args }
}

/// One block per row.
pub fn per_row(kernel: &'static str, source: &'static str, rows: usize, args: Vec<Arg>) -> Launch {
    let (x, y) = split_grid(rows);
    Launch { kernel, source, grid: [x, y, 1], block: ROW_BLOCK, shared: 0, workspace: 0, args }
}

/// A row count as a 2-D grid (grid y is limited to 65535): kernels take the row as
/// `blockIdx.y * gridDim.x + blockIdx.x` and skip rows past the end (`ROW_INDEX`).
fn split_grid(rows: usize) -> (u32, u32) {
    let x = rows.clamp(1, 65_535);
    (x as u32, rows.div_ceil(x).max(1) as u32)
}

/// Element counts as `usize`.
pub fn dims(t: &TensorTy) -> Vec<usize> {
    t.shape.iter().map(|&d| d.max(0) as usize).collect()
}

/// Elements of a tensor.
pub fn elements(t: &TensorTy) -> usize {
    t.num_elements() as usize
}

/// Length of the last dimension (1 for a scalar).
pub fn last(t: &TensorTy) -> usize {
    t.shape.last().map_or(1, |&d| d.max(0) as usize)
}

/// What an op's device fact is given.
pub struct KernelCx<'a> {
    /// Operand types.
    pub inputs: &'a [&'a TensorTy],
    /// Result types.
    pub outputs: &'a [TensorTy],
    /// Attributes.
    pub attrs: &'a Attrs,
}

/// Definitions every generated module starts with, after codegen's `typedef`s of `T`
/// (storage) and `acc_t` (accumulation) and the `BF16`/`F64` switch.
pub const PRELUDE: &str = r#"typedef long long i64;
#if defined(BF16)
struct bf16_t { unsigned short bits; };
typedef bf16_t T;
typedef float acc_t;
__device__ __forceinline__ acc_t load(T v) { return __uint_as_float(((unsigned)v.bits) << 16); }
__device__ __forceinline__ T store(acc_t f) {
  unsigned u = __float_as_uint(f);
  T r;
  if ((u & 0x7fffffffu) > 0x7f800000u) { r.bits = 0x7fc0; return r; }
  u += 0x7fffu + ((u >> 16) & 1u);
  r.bits = (unsigned short)(u >> 16);
  return r;
}
// Mixed precision: fp32 buffers (master weights, moments, fp32 gradients and losses) beside
// the bf16 ones; acc_t is float, so they load and store as themselves.
__device__ __forceinline__ acc_t load(float v) { return v; }
#elif defined(F64)
typedef double T;
typedef double acc_t;
__device__ __forceinline__ acc_t load(T v) { return v; }
__device__ __forceinline__ T store(acc_t v) { return v; }
#else
typedef float T;
typedef float acc_t;
__device__ __forceinline__ acc_t load(T v) { return v; }
__device__ __forceinline__ T store(acc_t v) { return v; }
#endif
__device__ __forceinline__ acc_t load(int v) { return (acc_t)v; }
#define NEG_INF ((acc_t)(-__int_as_float(0x7f800000)))
#define ROW_INDEX ((i64)blockIdx.y * gridDim.x + blockIdx.x)
#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)
// Position of row p of a sequence of len rows in zigzag order of `chunks` chunks (part r holds
// chunks r and chunks-1-r; see ir::ops::zigzag_position); chunks <= 1: p itself.
__device__ __forceinline__ i64 zigzag_position(i64 p, i64 len, i64 chunks) {
  if (chunks <= 1 || len < chunks) return p;
  i64 c = len / chunks, pair = p / (2 * c), w = p % (2 * c);
  return (w < c ? pair : chunks - 1 - pair) * c + w % c;
}

__device__ __forceinline__ acc_t sigmoid_f(acc_t x) { return (acc_t)1 / ((acc_t)1 + exp(-x)); }
__device__ __forceinline__ acc_t silu_df(acc_t x) { acc_t s = sigmoid_f(x); return s * ((acc_t)1 + x * ((acc_t)1 - s)); }
#define GELU_C ((acc_t)0.7978845608028654)
#define GELU_A ((acc_t)0.044715)
__device__ __forceinline__ acc_t gelu_f(acc_t x) { return (acc_t)0.5 * x * ((acc_t)1 + tanh(GELU_C * (x + GELU_A * x * x * x))); }
__device__ __forceinline__ acc_t gelu_df(acc_t x) {
  acc_t t = tanh(GELU_C * (x + GELU_A * x * x * x));
  return (acc_t)0.5 * ((acc_t)1 + t) + (acc_t)0.5 * x * ((acc_t)1 - t * t) * GELU_C * ((acc_t)1 + (acc_t)3 * GELU_A * x * x);
}

// Block reductions: every thread of the block calls them; all get the result. The order of
// the additions is fixed by the block size, so results repeat from run to run.
__device__ acc_t warp_sum(acc_t v) { for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o); return v; }
__device__ acc_t warp_max(acc_t v) { for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_down_sync(0xffffffffu, v, o)); return v; }
__device__ acc_t block_sum(acc_t v) {
  __shared__ acc_t part[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  // A block of one warp (a row kernel's warp per row): lane 0's sum is the block's, no barrier.
  if (blockDim.x == 32) return __shfl_sync(0xffffffffu, v, 0);
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = (int)threadIdx.x < warps ? part[threadIdx.x] : (acc_t)0;
  if (warp == 0) v = warp_sum(v);
  if (threadIdx.x == 0) part[0] = v;
  __syncthreads();
  return part[0];
}
__device__ acc_t block_max(acc_t v) {
  __shared__ acc_t part[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  if (blockDim.x == 32) return __shfl_sync(0xffffffffu, v, 0);
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = (int)threadIdx.x < warps ? part[threadIdx.x] : NEG_INF;
  if (warp == 0) v = warp_max(v);
  if (threadIdx.x == 0) part[0] = v;
  __syncthreads();
  return part[0];
}

// Runtime helpers: zero fill, copies of strided blocks (collectives on one device), sums.
extern "C" __global__ void shardc_fill_zero(T* out, i64 n) { GRID_STRIDE(i, n) out[i] = store((acc_t)0); }
// Strides and block in bytes, so it copies buffers of any element type.
extern "C" __global__ void shardc_copy_blocks(unsigned char* dst, i64 dst_stride, const unsigned char* src, i64 src_stride, i64 outer, i64 block) {
  GRID_STRIDE(i, outer * block) { i64 o = i / block, j = i % block; dst[o * dst_stride + j] = src[o * src_stride + j]; }
}
extern "C" __global__ void shardc_accumulate(T* dst, const T* src, i64 n, int max) {
  GRID_STRIDE(i, n) { acc_t a = load(dst[i]), b = load(src[i]); dst[i] = store(max ? fmax(a, b) : a + b); }
}
// A GEMM epilogue where cuBLASLt does not run it (no algorithm for the shape, or
// SHARDC_CUBLASLT=0): `out` holds the product (rows of `cols`); adds `bias[col]`, then
// GELU (storing the pre-activation in `aux` when given) or GELU's gradient at `aux`.
extern "C" __global__ void shardc_gemm_epilogue(T* out, T* aux, const T* bias, i64 n, i64 cols, int activation) {
  GRID_STRIDE(i, n) {
    acc_t v = load(out[i]);
    if (bias) v += load(bias[i % cols]);
    if (activation == 1) { if (aux) aux[i] = store(v); v = gelu_f(v); }
    else if (activation == 2) v = v * gelu_df(load(aux[i]));
    out[i] = store(v);
  }
}
// The same on fp32 buffers whatever the module's storage type (mixed precision).
extern "C" __global__ void shardc_accumulate_f32(float* dst, const float* src, i64 n, int max) {
  GRID_STRIDE(i, n) { float a = dst[i], b = src[i]; dst[i] = max ? fmax(a, b) : a + b; }
}
"#;

/// Opens the scope in which a bf16 module's kernels are instantiated for fp32 buffers (mixed
/// precision: the fp32 loss, for one): `T` is `float` there and `store` returns it. Kernels
/// defined inside carry the suffix [`F32_SUFFIX`].
pub const F32_SCOPE_OPEN: &str = "namespace fp32_instance {\ntypedef float T;\n__device__ __forceinline__ float store(float v) { return v; }\n";

/// Closes [`F32_SCOPE_OPEN`].
pub const F32_SCOPE_CLOSE: &str = "}  // namespace fp32_instance\n";

/// Suffix of a kernel's fp32 instance in a bf16 module.
pub const F32_SUFFIX: &str = "_f32";
