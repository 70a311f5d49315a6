//! Normalisations over the last dimension, `xf.layernorm` and `xf.rmsnorm`, and their
//! backward ops (which recompute the row statistics instead of storing them).

use crate::kernel::{elements, flat, last, per_row, Arg, DeviceKernel, KernelCx, Launch, ROW_BLOCK};
use super::{arity, float, rank_at_least, AttrKind, OpDef, Signature, Slot, VjpCx};
use crate::attrs::Attrs;
use crate::graph::Value;
use crate::sharding::{FactorKind, Linearity, ShardingRule};
use crate::types::{DType, TensorTy};

/// Checks that a per-feature parameter (`gamma`, `beta`) is a vector of the last dimension.
fn feature_vector(what: &str, x: &TensorTy, p: &TensorTy) -> Result<(), String> {
    float(what, p)?;
    if p.shape.len() == 1 && Some(p.shape[0]) == x.last_dim() && p.dtype == x.dtype {
        Ok(())
    } else {
        Err(format!("{what} {p} must be a vector of the last dimension of x {x}"))
    }
}

/// Checks the `epsilon` attribute.
fn epsilon(attrs: &Attrs) -> Result<(), String> {
    let eps = attrs.float("epsilon")?;
    if eps > 0.0 && eps.is_finite() { Ok(()) } else { Err(format!("epsilon must be positive, got {eps}")) }
}

/// `y = (x - mean) / sqrt(var + epsilon) * gamma + beta` over the last dimension
/// (biased variance, as in PyTorch).
#[derive(Debug)]
pub struct LayerNorm;

impl OpDef for LayerNorm {
    fn mnemonic(&self) -> &'static str {
        "layernorm"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        norm_launch(cx, true)
    }
    fn summary(&self) -> &'static str {
        "(x - mean) / sqrt(var + epsilon) * gamma + beta over the last dim"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "x", constraint: "T" },
                Slot { name: "gamma", constraint: "P" },
                Slot { name: "beta", constraint: "P" },
            ],
            results: &[Slot { name: "y", constraint: "T" }],
            attrs: &[("epsilon", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        float("x", inputs[0])?;
        rank_at_least("x", inputs[0], 1)?;
        feature_vector("gamma", inputs[0], inputs[1])?;
        feature_vector("beta", inputs[0], inputs[2])?;
        epsilon(attrs)?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        // mean, centre, square, variance sum, normalise, scale, shift (+ the row's rsqrt).
        8.0
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let (x, gamma) = (cx.operands[0], cx.operands[1]);
        let attrs = cx.attrs.clone();
        let d = cx.emit_multi("xf.layernorm_grad", &[x, gamma, grads[0]], attrs)?;
        Ok(vec![Some(d[0]), Some(d[1]), Some(d[2])])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        norm_rule(inputs[0], 2, false, 1, 0)
    }
}

/// `y = x / sqrt(mean(x^2) + epsilon) * gamma` over the last dimension (Llama's norm).
#[derive(Debug)]
pub struct RmsNorm;

impl OpDef for RmsNorm {
    fn mnemonic(&self) -> &'static str {
        "rmsnorm"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        norm_launch(cx, false)
    }
    fn summary(&self) -> &'static str {
        "x / sqrt(mean(x^2) + epsilon) * gamma over the last dim"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "T" }, Slot { name: "gamma", constraint: "P" }],
            results: &[Slot { name: "y", constraint: "T" }],
            attrs: &[("epsilon", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        float("x", inputs[0])?;
        rank_at_least("x", inputs[0], 1)?;
        feature_vector("gamma", inputs[0], inputs[1])?;
        epsilon(attrs)?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        5.0
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let (x, gamma) = (cx.operands[0], cx.operands[1]);
        let attrs = cx.attrs.clone();
        let d = cx.emit_multi("xf.rmsnorm_grad", &[x, gamma, grads[0]], attrs)?;
        Ok(vec![Some(d[0]), Some(d[1])])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        norm_rule(inputs[0], 1, false, 1, 0)
    }
}

/// Checks `(x, gamma, dy)` of a norm's backward op.
fn backward_operands(inputs: &[&TensorTy], attrs: &Attrs) -> Result<(), String> {
    arity(inputs, 3)?;
    float("x", inputs[0])?;
    rank_at_least("x", inputs[0], 1)?;
    feature_vector("gamma", inputs[0], inputs[1])?;
    if inputs[2] != inputs[0] {
        return Err(format!("dy {} must have the type of x {}", inputs[2], inputs[0]));
    }
    epsilon(attrs)
}

/// LayerNorm backward: with `xhat = (x - mean) * rstd` per row of `n` features and
/// `g = dy * gamma`: `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`,
/// `dgamma = sum over rows of dy * xhat`, `dbeta = sum over rows of dy`.
#[derive(Debug)]
pub struct LayerNormGrad;

impl OpDef for LayerNormGrad {
    fn mnemonic(&self) -> &'static str {
        "layernorm_grad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        norm_grad_launches(cx, true)
    }
    fn summary(&self) -> &'static str {
        "layernorm backward: (dx, dgamma, dbeta) from x, gamma, dy"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "x", constraint: "T" },
                Slot { name: "gamma", constraint: "P" },
                Slot { name: "dy", constraint: "T" },
            ],
            results: &[
                Slot { name: "dx", constraint: "T" },
                Slot { name: "dgamma", constraint: "P" },
                Slot { name: "dbeta", constraint: "P" },
            ],
            attrs: &[("epsilon", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        backward_operands(inputs, attrs)?;
        Ok(vec![inputs[0].clone(), inputs[1].clone(), inputs[1].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        // Counted per element of every result; the work is ~14 per element of x.
        14.0 / 3.0
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // dgamma and dbeta sum over rows: split rows leave them partial.
        norm_rule(inputs[0], 1, true, 1, 2)
    }
}

/// RMSNorm backward: with `xhat = x * rstd` and `g = dy * gamma`:
/// `dx = rstd * (g - xhat * mean(g * xhat))`, `dgamma = sum over rows of dy * xhat`.
#[derive(Debug)]
pub struct RmsNormGrad;

impl OpDef for RmsNormGrad {
    fn mnemonic(&self) -> &'static str {
        "rmsnorm_grad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        norm_grad_launches(cx, false)
    }
    fn summary(&self) -> &'static str {
        "rmsnorm backward: (dx, dgamma) from x, gamma, dy"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "x", constraint: "T" },
                Slot { name: "gamma", constraint: "P" },
                Slot { name: "dy", constraint: "T" },
            ],
            results: &[Slot { name: "dx", constraint: "T" }, Slot { name: "dgamma", constraint: "P" }],
            attrs: &[("epsilon", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        backward_operands(inputs, attrs)?;
        Ok(vec![inputs[0].clone(), inputs[1].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        5.0
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        norm_rule(inputs[0], 1, true, 1, 1)
    }
}

/// `x [..., h]` with per-feature parameters `[h]`: rows free, the normalised h blocked.
/// `params` parameter operands follow x (and `dy` after them for backward ops); results are
/// x-shaped `x_results` then `param_results` vectors of h.
fn norm_rule(x: &TensorTy, params: usize, with_dy: bool, x_results: usize, param_results: usize) -> ShardingRule {
    let r = x.rank();
    let xs: Vec<usize> = (0..r).collect();
    let h = vec![r - 1];
    let mut operands = vec![xs.clone()];
    operands.extend(std::iter::repeat_n(h.clone(), params));
    if with_dy {
        operands.push(xs.clone());
    }
    let mut results = vec![xs; x_results];
    results.extend(std::iter::repeat_n(h, param_results));
    let mut factors = vec![FactorKind::Free; r];
    factors[r - 1] = FactorKind::Blocked;
    ShardingRule { operands, results, factors, linearity: Linearity::None }
}

/// CUDA C of this file's ops (see [`crate::kernel`]).
///
/// The row kernels take `cached`: when set, the launch gives them dynamic shared memory for
/// the row (and, backward, `dy * gamma`), which they read from global memory once and then
/// work from; otherwise (rows too wide for shared memory) they read it again for each pass.
/// Both cases run one body, templated over where the row is read from.
const NORM_CUDA: &str = r#"// A row's mean (0 unless centered) and 1 / sqrt(variance + eps), by the whole block, from the
// row in global memory (R = T) or its copy in shared memory (R = acc_t). Two passes (mean,
// then the centred squares), for accuracy.
template <class R> __device__ void row_stats(const R* xr, i64 n, double eps, i64 centered, acc_t* mean_out, acc_t* rstd_out) {
  acc_t mean = 0, q = 0;
  if (centered) {
    acc_t s = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += load(xr[j]);
    mean = block_sum(s) / (acc_t)n;
  }
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) { acc_t v = load(xr[j]) - mean; q += v * v; }
  *mean_out = mean;
  *rstd_out = (acc_t)1 / sqrt(block_sum(q) / (acc_t)n + (acc_t)eps);
}
// The row kernels' shared copies: every loop over a row strides by the block from threadIdx.x,
// so a thread reads back only the elements it wrote itself and no barrier is needed between
// filling the copy and using it.
template <class R> __device__ void norm_row(T* yr, const R* xr, const T* gamma, const T* beta, i64 n, double eps, i64 centered) {
  acc_t mean, rstd;
  row_stats(xr, n, eps, centered, &mean, &rstd);
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    acc_t v = (load(xr[j]) - mean) * rstd * load(gamma[j]);
    if (beta) v += load(beta[j]);
    yr[j] = store(v);
  }
}
// One block per row: layernorm (centered, with beta) or rmsnorm (beta null).
extern "C" __global__ void norm_rows(T* y, const T* x, const T* gamma, const T* beta, i64 rows, i64 n, double eps, i64 centered, i64 cached) {
  extern __shared__ unsigned char shared_raw[];
  i64 r = ROW_INDEX;
  if (r >= rows) return;
  const T* xr = x + r * n;
  if (cached) {
    acc_t* row = (acc_t*)shared_raw;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) row[j] = load(xr[j]);
    norm_row(y + r * n, row, gamma, beta, n, eps, centered);
  } else {
    norm_row(y + r * n, xr, gamma, beta, n, eps, centered);
  }
}
// dx of one row from x and g = dy * gamma (gamma null: dyr already holds g).
template <class R, class D> __device__ void norm_grad_row(T* dxr, const R* xr, const D* dyr, const T* gamma, i64 n, double eps, i64 centered, acc_t* mean_out, acc_t* rstd_out) {
  acc_t mean, rstd;
  row_stats(xr, n, eps, centered, &mean, &rstd);
  acc_t g_sum = 0, gx_sum = 0;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    acc_t g = gamma ? load(dyr[j]) * load(gamma[j]) : load(dyr[j]);
    g_sum += g;
    gx_sum += g * (load(xr[j]) - mean) * rstd;
  }
  g_sum = block_sum(g_sum);
  gx_sum = block_sum(gx_sum);
  acc_t mean_g = centered ? g_sum / (acc_t)n : (acc_t)0, mean_gx = gx_sum / (acc_t)n;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    acc_t g = gamma ? load(dyr[j]) * load(gamma[j]) : load(dyr[j]);
    acc_t xhat = (load(xr[j]) - mean) * rstd;
    dxr[j] = store(rstd * (g - mean_g - xhat * mean_gx));
  }
  *mean_out = mean;
  *rstd_out = rstd;
}
// Backward, per row: dx, and each row's (mean, rstd) into the workspace's first 2 * rows for
// the parameter gradients. Cached: x and dy * gamma in shared memory, 2n acc_t.
extern "C" __global__ void norm_grad_rows(T* dx, acc_t* stats, const T* x, const T* gamma, const T* dy, i64 rows, i64 n, double eps, i64 centered, i64 cached) {
  extern __shared__ unsigned char shared_raw[];
  i64 r = ROW_INDEX;
  if (r >= rows) return;
  const T* xr = x + r * n;
  const T* dyr = dy + r * n;
  acc_t mean, rstd;
  if (cached) {
    acc_t* xs = (acc_t*)shared_raw;
    acc_t* gs = xs + n;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) { xs[j] = load(xr[j]); gs[j] = load(dyr[j]) * load(gamma[j]); }
    norm_grad_row(dx + r * n, xs, gs, (const T*)0, n, eps, centered, &mean, &rstd);
  } else {
    norm_grad_row(dx + r * n, xr, dyr, gamma, n, eps, centered, &mean, &rstd);
  }
  if (threadIdx.x == 0) { stats[2 * r] = mean; stats[2 * r + 1] = rstd; }
}
// Parameter gradients, first stage: block (x: a tile of 32 features, y: a chunk of `chunk`
// rows). Warp w sums rows w, w + warps, ... of the chunk for its 32 features (coalesced), then
// warp 0 adds the warps' sums in order and writes the chunk's partial dgamma (and dbeta) to
// the workspace after the row statistics: dgamma's [chunks][n], then dbeta's.
extern "C" __global__ void norm_grad_param_chunks(acc_t* work, const T* x, const T* dy, i64 rows, i64 n, i64 chunk, i64 centered) {
  extern __shared__ unsigned char shared_raw[];
  acc_t* part = (acc_t*)shared_raw;
  const acc_t* stats = work;
  acc_t* partial = work + 2 * rows;
  i64 chunks = gridDim.y, c = blockIdx.y;
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  i64 j = (i64)blockIdx.x * 32 + lane;
  i64 r0 = c * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
  acc_t dg = 0, db = 0;
  if (j < n) {
    for (i64 r = r0 + warp; r < r1; r += warps) {
      acc_t d = load(dy[r * n + j]);
      dg += d * (load(x[r * n + j]) - stats[2 * r]) * stats[2 * r + 1];
      db += d;
    }
  }
  part[warp * 32 + lane] = dg;
  part[(warps + warp) * 32 + lane] = db;
  __syncthreads();
  if (warp == 0 && j < n) {
    dg = 0;
    db = 0;
    for (int w = 0; w < warps; w++) { dg += part[w * 32 + lane]; db += part[(warps + w) * 32 + lane]; }
    partial[c * n + j] = dg;
    if (centered) partial[(chunks + c) * n + j] = db;
  }
}
// Second stage: each feature's chunk partials added in chunk order (no atomics, so the sums
// repeat bit for bit from run to run).
extern "C" __global__ void norm_grad_params(T* dgamma, T* dbeta, const acc_t* work, i64 rows, i64 n, i64 chunks) {
  const acc_t* partial = work + 2 * rows;
  GRID_STRIDE(j, n) {
    acc_t dg = 0, db = 0;
    for (i64 c = 0; c < chunks; c++) {
      dg += partial[c * n + j];
      if (dbeta) db += partial[(chunks + c) * n + j];
    }
    dgamma[j] = store(dg);
    if (dbeta) dbeta[j] = store(db);
  }
}
"#;


/// `acc_t` elements of static shared memory the row kernels' `block_sum` takes (`part[32]`).
const BLOCK_SUM_SCRATCH: usize = 32;

/// Rows of the parameter gradients' first stage per block, at least (see [`param_chunks`]).
const MIN_CHUNK_ROWS: usize = 64;

/// Most chunks of rows: the second stage adds this many partials per feature, at most.
const MAX_CHUNKS: usize = 256;

/// Features per block of the parameter gradients' first stage (one per lane of a warp).
const FEATURE_TILE: usize = 32;

/// Rows and features of a norm's `x`.
fn norm_rows(x: &TensorTy) -> (usize, usize) {
    let n = last(x).max(1);
    (elements(x) / n, n)
}

/// `acc_t` elements of shared memory for `arrays` copies of a row of `n` (the row kernels'
/// cache), or 0 when they would not fit beside `block_sum`'s scratch in
/// [`crate::kernel::MAX_SHARED_BYTES`]: the kernel then reads the row from global memory on
/// every pass. Up to 25312 features forward and 12656 backward in fp32 and bf16 (`acc_t` is
/// float: GPT-3's 12288 both ways), half that in fp64.
fn row_cache(x: &TensorTy, n: usize, arrays: usize) -> usize {
    let acc = if x.dtype == DType::F64 { 8 } else { 4 };
    let elements = arrays * n;
    if (elements + BLOCK_SUM_SCRATCH) * acc <= crate::kernel::MAX_SHARED_BYTES { elements } else { 0 }
}

/// Rows per chunk and chunks of the parameter gradients' first stage: chunks of at least
/// [`MIN_CHUNK_ROWS`] rows, and no more than [`MAX_CHUNKS`] of them. A function of the shape
/// only, so the order of the additions is too.
fn param_chunks(rows: usize) -> (usize, usize) {
    let chunk = rows.div_ceil(MAX_CHUNKS).max(MIN_CHUNK_ROWS);
    (chunk, rows.div_ceil(chunk).max(1))
}

/// Threads per row of the row kernels: one warp where there are rows enough to fill the GPU
/// with warps and a row is short enough for one (a block of 256 spent most of a 768-wide
/// row's time in its barriers), else a block of [`ROW_BLOCK`].
fn row_threads(rows: usize, n: usize) -> u32 {
    if rows >= WARP_ROWS_FROM && n <= WARP_ROW_MAX { 32 } else { ROW_BLOCK }
}

/// Rows from which a warp per row keeps an H100-class GPU (132 SMs) busy: about 8 warps on
/// each SM. Fewer, longer rows keep a block each.
const WARP_ROWS_FROM: usize = 1024;

/// Widest row one warp takes (128 elements a lane).
const WARP_ROW_MAX: usize = 4096;

/// `layernorm` (`centered`: with mean and beta) or `rmsnorm`, one block per row.
fn norm_launch(cx: &KernelCx<'_>, centered: bool) -> Result<DeviceKernel, String> {
    let (rows, n) = norm_rows(cx.inputs[0]);
    let cache = row_cache(cx.inputs[0], n, 1);
    let beta = if centered { Arg::In(2) } else { Arg::Null };
    let args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), beta, Arg::Int(rows as i64), Arg::Int(n as i64), Arg::Float(cx.attrs.float("epsilon")?), Arg::Int(centered as i64), Arg::Int((cache > 0) as i64)];
    Ok(DeviceKernel::Launches(vec![Launch { shared: cache, block: row_threads(rows, n), ..per_row("norm_rows", NORM_CUDA, rows, args) }]))
}

/// Backward of a norm: `dx` per row (saving the row statistics), then `dgamma` (and `dbeta`)
/// in two stages: partial sums per (feature tile, chunk of rows), then the chunks' partials
/// in order. The workspace holds the statistics (2 per row) and the partials (`chunks * n`
/// for dgamma, as many again for dbeta).
fn norm_grad_launches(cx: &KernelCx<'_>, centered: bool) -> Result<DeviceKernel, String> {
    let (rows, n) = norm_rows(cx.inputs[0]);
    let cache = row_cache(cx.inputs[0], n, 2);
    let (chunk, chunks) = param_chunks(rows);
    let workspace = 2 * rows + (1 + centered as usize) * chunks * n;
    let (r, f) = (Arg::Int(rows as i64), Arg::Int(n as i64));
    let row_args = vec![Arg::Out(0), Arg::Workspace, Arg::In(0), Arg::In(1), Arg::In(2), r.clone(), f.clone(), Arg::Float(cx.attrs.float("epsilon")?), Arg::Int(centered as i64), Arg::Int((cache > 0) as i64)];
    let chunk_args = vec![Arg::Workspace, Arg::In(0), Arg::In(2), r.clone(), f.clone(), Arg::Int(chunk as i64), Arg::Int(centered as i64)];
    let dbeta = if centered { Arg::Out(2) } else { Arg::Null };
    let param_args = vec![Arg::Out(1), dbeta, Arg::Workspace, r, f, Arg::Int(chunks as i64)];
    let tiles = u32::try_from(n.div_ceil(FEATURE_TILE)).map_err(|_| format!("{n} features are too many for norm_grad_param_chunks"))?;
    let chunk_launch = Launch {
        kernel: "norm_grad_param_chunks",
        source: NORM_CUDA,
        grid: [tiles, chunks as u32, 1],
        block: ROW_BLOCK,
        shared: 2 * ROW_BLOCK as usize,
        workspace,
        args: chunk_args,
    };
    Ok(DeviceKernel::Launches(vec![
        Launch { workspace, shared: cache, block: row_threads(rows, n), ..per_row("norm_grad_rows", NORM_CUDA, rows, row_args) },
        chunk_launch,
        Launch { workspace, ..flat("norm_grad_params", NORM_CUDA, n, param_args) },
    ]))
}
