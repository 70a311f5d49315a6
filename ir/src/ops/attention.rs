//! `xf.attention`: scaled dot-product attention with grouped key/value heads, and its
//! backward op `xf.attention_grad`.

use crate::kernel::{dims, Arg, DeviceKernel, KernelCx, Launch};
use super::{arity, float, io_bytes, rank_is, AttrKind, Cost, KernelClass, OpDef, Signature, Slot, VjpCx};
use crate::attrs::Attrs;
use crate::graph::Value;
use crate::sharding::{Linearity, ShardingRule};
use crate::types::TensorTy;

/// Scaled dot-product attention, one op with this decomposition:
///
/// ```text
/// g        = q_heads / kv_heads                 (grouped-query attention; 1 = multi-head)
/// s[h,i,j] = scale * sum_d q[h,i,d] k[h/g,j,d]  (+ -inf where j > i when causal)
/// p        = softmax_j(s)
/// out[h,i,d] = sum_j p[h,i,j] v[h/g,j,d]
/// ```
///
/// Operands are split heads: `q [b, q_heads, s, d]`, `k`, `v [b, kv_heads, s, d]`. Heads are
/// independent, which is what makes splitting them over tensor-parallel ranks free of
/// communication. One op (rather than matmul/softmax pieces) keeps the S x S scores an
/// internal of the kernel, as flash attention does, and gives one VJP.
#[derive(Debug)]
pub struct Attention;

impl OpDef for Attention {
    fn mnemonic(&self) -> &'static str {
        "attention"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (q, k) = (dims(cx.inputs[0]), dims(cx.inputs[1]));
        let (b, hq, s, hk) = (q[0], q[1], q[2], k[1]);
        if let Some(kernel) = mma_forward_kernel(cx) {
            let mut args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), Arg::In(2)];
            args.extend(attention_args(&q, hk, cx.attrs)?);
            let grid = [query_tiles(s, MMA_ROWS, kernel)?, crate::kernel::grid_y(b * hq, "(sequence, query head) pairs")?, 1];
            return Ok(DeviceKernel::Launches(vec![Launch { kernel, source: ATTENTION_MMA_CUDA, grid, block: FLASH_THREADS as u32, shared: 0, workspace: 0, args }]));
        }
        let tiles = flash_tiles(q[3], s, cx.inputs[0].dtype)?;
        let mut args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), Arg::In(2)];
        args.extend(attention_args(&q, hk, cx.attrs)?);
        args.extend([Arg::Int(tiles.0 as i64), Arg::Int(tiles.1 as i64)]);
        // One block per tile of query rows (x) of each sequence's head (y).
        let grid = [query_tiles(s, tiles.0, "attention_fwd")?, crate::kernel::grid_y(b * hq, "(sequence, query head) pairs")?, 1];
        let shared = flash_shared(q[3], tiles, 1, 2, 1);
        Ok(DeviceKernel::Launches(vec![Launch { kernel: "attention_fwd", source: ATTENTION_CUDA, grid, block: FLASH_THREADS as u32, shared, workspace: 0, args }]))
    }
    fn summary(&self) -> &'static str {
        "softmax(scale * q k^T + causal mask) v over heads; kv heads shared by q_heads/kv_heads"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "q", constraint: "Q" },
                Slot { name: "k", constraint: "K" },
                Slot { name: "v", constraint: "K" },
            ],
            results: &[Slot { name: "out", constraint: "Q" }],
            attrs: &[("causal", AttrKind::Bool), ("scale", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        check_qkv(inputs, attrs)?;
        Ok(vec![inputs[0].clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        let q = inputs[0];
        let (b, h, s, d) = (q.shape[0] as f64, q.shape[1] as f64, q.shape[2] as f64, q.shape[3] as f64);
        // q k^T and p v: 2 * 2*b*h*s*s*d (the causal half is counted in full, as the
        // published model-FLOP formulas do); softmax with scale and mask: 5 per score.
        let flops = 4.0 * b * h * s * s * d + 5.0 * b * h * s * s;
        Cost { flops, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn kernel_class(&self, inputs: &[&TensorTy], attrs: &Attrs) -> KernelClass {
        attention_class(inputs, attrs, 2.0)
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let operands = [cx.operands[0], cx.operands[1], cx.operands[2], grads[0]];
        let attrs = cx.attrs.clone();
        let d = cx.emit_multi("xf.attention_grad", &operands, attrs)?;
        Ok(vec![Some(d[0]), Some(d[1]), Some(d[2])])
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Batch and heads free (q heads and kv heads share the factor: splitting both by the
        // same count keeps every group of q heads with its kv head); positions and the head
        // dim stay whole.
        ShardingRule::elementwise(4, 3, 1, Linearity::None).block(2).block(3)
    }
}

/// Checks `q`, `k`, `v` (the first three operands) and the attributes.
fn check_qkv(inputs: &[&TensorTy], attrs: &Attrs) -> Result<(), String> {
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    for (what, t) in [("q", q), ("k", k), ("v", v)] {
        float(what, t)?;
        rank_is(what, t, 4)?;
    }
    if k != v {
        return Err(format!("k {k} and v {v} must have the same type"));
    }
    let (b, hq, s, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    if k.shape[0] != b || k.shape[2] != s || k.shape[3] != d || k.dtype != q.dtype {
        return Err(format!("k/v {k} must match q {q} in batch, sequence, head dim and type"));
    }
    if k.shape[1] == 0 || hq % k.shape[1] != 0 {
        return Err(format!("q heads ({hq}) must be a multiple of kv heads ({})", k.shape[1]));
    }
    attrs.bool("causal")?;
    attrs.float("scale")?;
    Ok(())
}

/// Attention backward. It recomputes the probabilities `p` from `q` and `k` (nothing of size
/// S x S is kept from the forward pass) and, with `dp = dout v^T` and
/// `ds = p * (dp - rowsum(dp * p))`: `dq = scale ds k`, `dk = scale ds^T q`, `dv = p^T dout`,
/// where the gradients of a shared kv head sum over its query heads.
#[derive(Debug)]
pub struct AttentionGrad;

impl OpDef for AttentionGrad {
    fn mnemonic(&self) -> &'static str {
        "attention_grad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (q, k) = (dims(cx.inputs[0]), dims(cx.inputs[1]));
        let (b, hq, s, d, hk) = (q[0], q[1], q[2], q[3], k[1]);
        let tiles = flash_tiles(d, s, cx.inputs[0].dtype)?;
        let mut shape_args = attention_args(&q, hk, cx.attrs)?;
        shape_args.extend([Arg::Int(tiles.0 as i64), Arg::Int(tiles.1 as i64)]);
        let workspace = b * hq * s * 3;
        let mut q_args = vec![Arg::Out(0), Arg::Workspace, Arg::In(0), Arg::In(1), Arg::In(2), Arg::In(3)];
        q_args.extend(shape_args.iter().cloned());
        let mut kv_args = vec![Arg::Out(1), Arg::Out(2), Arg::Workspace, Arg::In(0), Arg::In(1), Arg::In(2), Arg::In(3)];
        kv_args.extend(shape_args);
        let row_tiles = query_tiles(s, tiles.0, "attention_grad")?;
        let (q_grid, kv_grid) = ([row_tiles, crate::kernel::grid_y(b * hq, "(sequence, query head) pairs")?, 1], [row_tiles, crate::kernel::grid_y(b * hk, "(sequence, kv head) pairs")?, 1]);
        let shared = flash_shared(d, tiles, 2, 2, 2);
        Ok(DeviceKernel::Launches(vec![
            Launch { kernel: "attention_grad_q", source: ATTENTION_CUDA, grid: q_grid, block: FLASH_THREADS as u32, shared, workspace, args: q_args },
            Launch { kernel: "attention_grad_kv", source: ATTENTION_CUDA, grid: kv_grid, block: FLASH_THREADS as u32, shared, workspace, args: kv_args },
        ]))
    }
    fn summary(&self) -> &'static str {
        "attention backward: (dq, dk, dv) from q, k, v, dout; recomputes the probabilities"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "q", constraint: "Q" },
                Slot { name: "k", constraint: "K" },
                Slot { name: "v", constraint: "K" },
                Slot { name: "dout", constraint: "Q" },
            ],
            results: &[
                Slot { name: "dq", constraint: "Q" },
                Slot { name: "dk", constraint: "K" },
                Slot { name: "dv", constraint: "K" },
            ],
            attrs: &[("causal", AttrKind::Bool), ("scale", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 4)?;
        check_qkv(inputs, attrs)?;
        if inputs[3] != inputs[0] {
            return Err(format!("dout {} must have the type of q {}", inputs[3], inputs[0]));
        }
        Ok(vec![inputs[0].clone(), inputs[1].clone(), inputs[2].clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        let q = inputs[0];
        let (b, h, s, d) = (q.shape[0] as f64, q.shape[1] as f64, q.shape[2] as f64, q.shape[3] as f64);
        // Recomputed q k^T, then dp, dq, dk, dv: five S x S x d products.
        Cost { flops: 10.0 * b * h * s * s * d + 8.0 * b * h * s * s, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn kernel_class(&self, inputs: &[&TensorTy], attrs: &Attrs) -> KernelClass {
        attention_class(inputs, attrs, 5.0)
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule::elementwise(4, 4, 3, Linearity::None).block(2).block(3)
    }
}

/// The flash-attention work of `q` `[b, h, s, d]` against keys `[b, kv, t, d]`.
fn attention_class(inputs: &[&TensorTy], attrs: &Attrs, products: f64) -> KernelClass {
    let (q, k) = (inputs[0], inputs[1]);
    if q.rank() != 4 || k.rank() != 4 {
        return KernelClass::Memory;
    }
    KernelClass::Attention {
        batch_heads: (q.shape[0] * q.shape[1]) as f64,
        queries: q.shape[2] as f64,
        keys: k.shape[2] as f64,
        head_dim: q.shape[3] as f64,
        causal: attrs.bool("causal").unwrap_or(true),
        products,
    }
}

/// Threads per block of the attention kernels.
const FLASH_THREADS: usize = 128;

/// Head-dim columns one thread accumulates in registers, at most (`FA_COLS` below).
const FLASH_COLS: usize = 16;

/// Outer rows per block, at most (queries forward and for `dq`, keys for `dk`/`dv`).
const FLASH_MAX_ROWS: usize = 32;

/// Inner rows per tile, at most (keys forward and for `dq`, queries for `dk`/`dv`).
const FLASH_MAX_INNER: usize = 64;

/// Shared memory a block may have without opting in, in bytes.
const FLASH_SHARED_BYTES: usize = 48 * 1024;

/// The attention kernels' tiles for a head dim: `rows` outer rows per block (so
/// `FLASH_THREADS / rows` threads per row, each owning at most [`FLASH_COLS`] of the head
/// dim in registers) and `inner` rows per tile of the other side, staged in shared memory
/// once for all the block's rows. Every kernel's shared memory, at a row stride of `d + 1`
/// (no bank conflicts), fits in 48 KiB: two `[rows][d]` and two `[inner][d]` matrices and two
/// `[rows][inner]` tiles of scores. Powers of two, as large as fit: fp32 d=64 gives 32 x 32,
/// d=128 16 x 16.
fn flash_tiles(d: usize, s: usize, dtype: crate::types::DType) -> Result<(usize, usize), String> {
    let acc = if dtype == crate::types::DType::F64 { 8 } else { 4 };
    // No larger than the sequence needs (a short sequence gets more threads per row).
    let longest = s.max(1).next_power_of_two();
    let mut rows = FLASH_MAX_ROWS.min(longest);
    while rows > 1 && (FLASH_THREADS / rows) * FLASH_COLS < d {
        rows /= 2;
    }
    let fits = |rows: usize, inner: usize| (2 * rows + 2 * inner) * (d + 1) + 2 * rows * inner <= FLASH_SHARED_BYTES / acc;
    while rows > 1 && !fits(rows, 1) {
        rows /= 2;
    }
    let fits = |inner: usize| fits(rows, inner);
    let mut inner = FLASH_MAX_INNER.min(longest);
    while inner > 1 && !fits(inner) {
        inner /= 2;
    }
    if (FLASH_THREADS / rows) * FLASH_COLS < d || !fits(inner) {
        return Err(format!("a head dim of {d} is too large for the attention kernels (their tiles must fit 48 KiB of shared memory): use a smaller head dim"));
    }
    Ok((rows, inner))
}

/// `acc_t` elements of shared memory of a kernel with tiles `(rows, inner)`: `matrices` of
/// `[rows][d + 1]` and of `[inner][d + 1]`, and `scores` tiles of `[rows][inner]`.
fn flash_shared(d: usize, (rows, inner): (usize, usize), outer_matrices: usize, inner_matrices: usize, scores: usize) -> usize {
    (outer_matrices * rows + inner_matrices * inner) * (d + 1) + scores * rows * inner
}

/// CUDA C of this file's ops (see [`crate::kernel`]).
const ATTENTION_CUDA: &str = r#"// Flash attention (FlashAttention-2's loop order) without tensor cores: a block of FA_THREADS
// threads holds `rows` outer rows (queries forward and for dq, keys for dk and dv), each row
// shared by tpr = FA_THREADS / rows threads that own the head-dim columns lane, lane + tpr, ...
// (at most FA_COLS, in registers). The other side is walked in tiles of `inner` rows, staged in
// shared memory once for all the block's rows; scores live only as one [rows][inner] tile, with
// an online softmax (running max and sum) across tiles, so nothing grows with the sequence.
// Causal tiles wholly above the diagonal are skipped, and partly masked ones masked by element.
// Grouped-query heads read their kv head's tiles. Shared matrices have a row stride of d + 1,
// so the threads of a warp reading different rows hit different banks. Every sum runs in a
// fixed order: results repeat bit for bit.
#define FA_THREADS 128
#define FA_COLS 16
// Rows [first, first + count) of a [limit][d] matrix into dst (stride d + 1); zeros past limit.
__device__ void fa_load(acc_t* dst, const T* src, i64 first, i64 count, i64 limit, i64 d) {
  for (i64 e = threadIdx.x; e < count * d; e += blockDim.x) {
    i64 r = e / d, c = e % d;
    dst[r * (d + 1) + c] = first + r < limit ? load(src[(first + r) * d + c]) : (acc_t)0;
  }
}
__device__ acc_t fa_dot(const acc_t* a, const acc_t* b, i64 d) {
  acc_t dot = 0;
  for (i64 c = 0; c < d; c++) dot += a[c] * b[c];
  return dot;
}
// Whether query i sees key j.
__device__ bool fa_visible(i64 i, i64 j, i64 s, i64 causal) { return i < s && j < s && (!causal || j <= i); }
// Forward: grid (query tiles, batch x query heads).
extern "C" __global__ void attention_fwd(T* out, const T* q, const T* k, const T* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 rows, i64 inner) {
  extern __shared__ unsigned char shared_raw[];
  i64 ld = d + 1;
  acc_t* qs = (acc_t*)shared_raw;
  acc_t* ks = qs + rows * ld;
  acc_t* vs = ks + inner * ld;
  acc_t* ps = vs + inner * ld;
  int tpr = FA_THREADS / (int)rows, r = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  i64 bh = blockIdx.y, b = bh / hq, h = bh % hq;
  i64 kv = (b * hk + h / (hq / hk)) * s * d;
  i64 i0 = (i64)blockIdx.x * rows, i = i0 + r;
  acc_t scale = (acc_t)scale_, mx = NEG_INF, sum = 0;
  acc_t o[FA_COLS];
  for (int c = 0; c < FA_COLS; c++) o[c] = 0;
  fa_load(qs, q + bh * s * d, i0, rows, s, d);
  i64 keys = causal && i0 + rows < s ? i0 + rows : s;
  for (i64 j0 = 0; j0 < keys; j0 += inner) {
    i64 n = keys - j0 < inner ? keys - j0 : inner;
    __syncthreads();
    fa_load(ks, k + kv, j0, n, s, d);
    fa_load(vs, v + kv, j0, n, s, d);
    __syncthreads();
    acc_t* pr = ps + r * inner;
    for (i64 j = lane; j < n; j += tpr) pr[j] = fa_dot(qs + r * ld, ks + j * ld, d) * scale;
    __syncthreads();
    acc_t grown = mx;
    for (i64 j = 0; j < n; j++) if (fa_visible(i, j0 + j, s, causal)) grown = fmax(grown, pr[j]);
    acc_t rescale = grown == NEG_INF ? (acc_t)1 : exp(mx - grown);
    __syncthreads();
    for (i64 j = lane; j < n; j += tpr) pr[j] = fa_visible(i, j0 + j, s, causal) ? exp(pr[j] - grown) : (acc_t)0;
    __syncthreads();
    acc_t part = 0;
    for (i64 j = 0; j < n; j++) part += pr[j];
    sum = sum * rescale + part;
    for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) {
      i64 col = lane + (i64)c * tpr;
      acc_t acc = 0;
      for (i64 j = 0; j < n; j++) acc += pr[j] * vs[j * ld + col];
      o[c] = o[c] * rescale + acc;
    }
    mx = grown;
  }
  if (i < s)
    for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) out[(bh * s + i) * d + lane + (i64)c * tpr] = store(o[c] / sum);
}
// Backward for dq, grid (query tiles, batch x query heads), in two walks over the key tiles:
// the rows' max and sum (online), then with p = exp(score - max) / sum and dp = dout . v:
// rowdot = sum p dp, and dq = scale (sum p dp k - rowdot sum p k). Each row's (max, sum,
// rowdot) goes to `stats` for the keys' kernel.
extern "C" __global__ void attention_grad_q(T* dq, acc_t* stats, const T* q, const T* k, const T* v, const T* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 rows, i64 inner) {
  extern __shared__ unsigned char shared_raw[];
  i64 ld = d + 1;
  acc_t* qs = (acc_t*)shared_raw;
  acc_t* dos = qs + rows * ld;
  acc_t* ks = dos + rows * ld;
  acc_t* vs = ks + inner * ld;
  acc_t* ps = vs + inner * ld;
  acc_t* dps = ps + rows * inner;
  int tpr = FA_THREADS / (int)rows, r = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  i64 bh = blockIdx.y, b = bh / hq, h = bh % hq;
  i64 kv = (b * hk + h / (hq / hk)) * s * d;
  i64 i0 = (i64)blockIdx.x * rows, i = i0 + r;
  acc_t scale = (acc_t)scale_, mx = NEG_INF, sum = 0, rowdot = 0;
  fa_load(qs, q + bh * s * d, i0, rows, s, d);
  fa_load(dos, dout + bh * s * d, i0, rows, s, d);
  i64 keys = causal && i0 + rows < s ? i0 + rows : s;
  acc_t* pr = ps + r * inner;
  acc_t* dpr = dps + r * inner;
  for (i64 j0 = 0; j0 < keys; j0 += inner) {
    i64 n = keys - j0 < inner ? keys - j0 : inner;
    __syncthreads();
    fa_load(ks, k + kv, j0, n, s, d);
    __syncthreads();
    for (i64 j = lane; j < n; j += tpr) pr[j] = fa_dot(qs + r * ld, ks + j * ld, d) * scale;
    __syncthreads();
    acc_t grown = mx, part = 0;
    for (i64 j = 0; j < n; j++) if (fa_visible(i, j0 + j, s, causal)) grown = fmax(grown, pr[j]);
    for (i64 j = 0; j < n; j++) if (fa_visible(i, j0 + j, s, causal)) part += exp(pr[j] - grown);
    sum = (grown == NEG_INF ? (acc_t)0 : sum * exp(mx - grown)) + part;
    mx = grown;
  }
  acc_t a[FA_COLS], pk[FA_COLS];
  for (int c = 0; c < FA_COLS; c++) { a[c] = 0; pk[c] = 0; }
  for (i64 j0 = 0; j0 < keys; j0 += inner) {
    i64 n = keys - j0 < inner ? keys - j0 : inner;
    __syncthreads();
    fa_load(ks, k + kv, j0, n, s, d);
    fa_load(vs, v + kv, j0, n, s, d);
    __syncthreads();
    for (i64 j = lane; j < n; j += tpr) {
      bool seen = fa_visible(i, j0 + j, s, causal);
      pr[j] = seen ? exp(fa_dot(qs + r * ld, ks + j * ld, d) * scale - mx) / sum : (acc_t)0;
      dpr[j] = fa_dot(dos + r * ld, vs + j * ld, d);
    }
    __syncthreads();
    for (i64 j = 0; j < n; j++) rowdot += pr[j] * dpr[j];
    for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) {
      i64 col = lane + (i64)c * tpr;
      acc_t x = 0, y = 0;
      for (i64 j = 0; j < n; j++) { acc_t kc = ks[j * ld + col]; x += pr[j] * dpr[j] * kc; y += pr[j] * kc; }
      a[c] += x;
      pk[c] += y;
    }
  }
  if (i < s) {
    for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) dq[(bh * s + i) * d + lane + (i64)c * tpr] = store((a[c] - rowdot * pk[c]) * scale);
    if (lane == 0) { acc_t* st = stats + (bh * s + i) * 3; st[0] = mx; st[1] = sum; st[2] = rowdot; }
  }
}
// Backward for dk and dv, grid (key tiles, batch x kv heads): each key row's gradients summed
// over the query heads sharing its kv head and the query tiles that see it, in order, with
// p and ds = p (dp - rowdot) scale from the query rows' stats.
extern "C" __global__ void attention_grad_kv(T* dk, T* dv, const acc_t* stats, const T* q, const T* k, const T* v, const T* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 rows, i64 inner) {
  extern __shared__ unsigned char shared_raw[];
  i64 ld = d + 1;
  acc_t* ks = (acc_t*)shared_raw;
  acc_t* vs = ks + rows * ld;
  acc_t* qs = vs + rows * ld;
  acc_t* dos = qs + inner * ld;
  acc_t* ps = dos + inner * ld;
  acc_t* dss = ps + rows * inner;
  int tpr = FA_THREADS / (int)rows, r = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  i64 bg = blockIdx.y, b = bg / hk, g = bg % hk, group = hq / hk;
  i64 j0 = (i64)blockIdx.x * rows, j = j0 + r;
  acc_t scale = (acc_t)scale_;
  fa_load(ks, k + bg * s * d, j0, rows, s, d);
  fa_load(vs, v + bg * s * d, j0, rows, s, d);
  acc_t dk_acc[FA_COLS], dv_acc[FA_COLS];
  for (int c = 0; c < FA_COLS; c++) { dk_acc[c] = 0; dv_acc[c] = 0; }
  acc_t* pr = ps + r * inner;
  acc_t* dsr = dss + r * inner;
  // Causal: the first query tile holding a query that sees key j0.
  i64 first = causal ? j0 / inner * inner : 0;
  for (i64 gh = 0; gh < group; gh++) {
    i64 bh = b * hq + g * group + gh;
    for (i64 i0 = first; i0 < s; i0 += inner) {
      i64 n = s - i0 < inner ? s - i0 : inner;
      __syncthreads();
      fa_load(qs, q + bh * s * d, i0, n, s, d);
      fa_load(dos, dout + bh * s * d, i0, n, s, d);
      __syncthreads();
      for (i64 x = lane; x < n; x += tpr) {
        i64 i = i0 + x;
        const acc_t* st = stats + (bh * s + i) * 3;
        acc_t p = fa_visible(i, j, s, causal) ? exp(fa_dot(qs + x * ld, ks + r * ld, d) * scale - st[0]) / st[1] : (acc_t)0;
        pr[x] = p;
        dsr[x] = p * (fa_dot(dos + x * ld, vs + r * ld, d) - st[2]) * scale;
      }
      __syncthreads();
      for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) {
        i64 col = lane + (i64)c * tpr;
        acc_t x_k = 0, x_v = 0;
        for (i64 x = 0; x < n; x++) { x_k += dsr[x] * qs[x * ld + col]; x_v += pr[x] * dos[x * ld + col]; }
        dk_acc[c] += x_k;
        dv_acc[c] += x_v;
      }
    }
  }
  if (j < s)
    for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) {
      i64 col = lane + (i64)c * tpr;
      dk[(bg * s + j) * d + col] = store(dk_acc[c]);
      dv[(bg * s + j) * d + col] = store(dv_acc[c]);
    }
}
"#;

/// Head dims the tensor-core forward kernel is instantiated for (`attention_fwd_mma{D}`).
const MMA_HEAD_DIMS: [(usize, &str); 8] = [(16, "attention_fwd_mma16"), (32, "attention_fwd_mma32"), (48, "attention_fwd_mma48"), (64, "attention_fwd_mma64"), (80, "attention_fwd_mma80"), (96, "attention_fwd_mma96"), (112, "attention_fwd_mma112"), (128, "attention_fwd_mma128")];

/// Query rows per block of the tensor-core kernel (four warps of 16).
const MMA_ROWS: usize = 64;

/// The tensor-core forward kernel for these operands, if it has one: bf16 storage and a head
/// dim that is a multiple of 16 up to 128 (the fragments of `mma.m16n8k16`, and the
/// accumulators that fit in registers).
fn mma_forward_kernel(cx: &KernelCx<'_>) -> Option<&'static str> {
    use crate::types::DType;
    let d = dims(cx.inputs[0])[3];
    let bf16 = cx.inputs.iter().all(|t| t.dtype == DType::Bf16) && cx.outputs.iter().all(|t| t.dtype == DType::Bf16);
    MMA_HEAD_DIMS.iter().find(|(dim, _)| bf16 && *dim == d).map(|(_, name)| *name)
}

/// CUDA C of the tensor-core forward pass (bf16 modules only; see [`mma_forward_kernel`]).
const ATTENTION_MMA_CUDA: &str = r#"#if defined(BF16)
// Flash attention forward on tensor cores, for bf16 with fp32 accumulation (FlashAttention-2's
// layout): a block of four warps holds 64 query rows, 16 per warp, as mma A fragments in
// registers; keys and values come in tiles of 64 rows through shared memory (bf16 bits, row
// stride D + 8 against bank conflicts). Scores S = Q K^T and the update O += P V are
// m16n8k16 products; P passes from the scores' accumulator fragments straight into A fragments
// (their layouts line up), rounded to bf16. The online softmax runs per row across tiles: the
// four threads of a quad that share a row exchange its max by shuffles and keep partial sums,
// added up at the end. Causal tiles past the block's last row are skipped.
#define FA_MMA_ROWS 64
#define FA_MMA_KEYS 64
__device__ __forceinline__ float fa_lo(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float fa_hi(unsigned u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ unsigned fa_pair(unsigned short lo, unsigned short hi) { return (unsigned)lo | ((unsigned)hi << 16); }
__device__ __forceinline__ unsigned fa_round_pair(float lo, float hi) { return fa_pair(::store(lo).bits, ::store(hi).bits); }
// d += a b for one warp: a 16x16 bf16, b 16x8 bf16, d 16x8 fp32, in the fragment layouts of
// PTX's mma.m16n8k16 (g = lane / 4, t = lane % 4; a register's low half holds the lower index):
// a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9];
// b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]; d[0..1] = D[g][2t, 2t+1], d[2..3] = D[g+8][2t, 2t+1].
// Before sm_80 (and on the emulated device) the warp gathers the same fragments by shuffles.
__device__ __forceinline__ void fa_mma(float* d, const unsigned* a, const unsigned* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  unsigned lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
  float rows[2][16], cols[2][16];
  for (unsigned src = 0; src < 4; src++) {
    unsigned k = 2 * src;
    for (unsigned x = 0; x < 4; x++) {
      unsigned u = __shfl_sync(0xffffffffu, a[x], (int)(4 * g + src));
      rows[x & 1][k + (x >> 1) * 8] = fa_lo(u);
      rows[x & 1][k + (x >> 1) * 8 + 1] = fa_hi(u);
    }
    for (unsigned c = 0; c < 2; c++)
      for (unsigned x = 0; x < 2; x++) {
        unsigned u = __shfl_sync(0xffffffffu, b[x], (int)(8 * t + 4 * c + src));
        cols[c][k + x * 8] = fa_lo(u);
        cols[c][k + x * 8 + 1] = fa_hi(u);
      }
  }
  for (int r = 0; r < 2; r++)
    for (int c = 0; c < 2; c++) {
      float acc = 0;
      for (int k = 0; k < 16; k++) acc += rows[r][k] * cols[c][k];
      d[2 * r + c] += acc;
    }
#endif
}
template <int D>
__device__ void fa_mma_forward(unsigned short* out, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, double scale_, i64 causal) {
  __shared__ unsigned short ks[FA_MMA_KEYS][D + 8];
  __shared__ unsigned short vs[FA_MMA_KEYS][D + 8];
  const int KSTEPS = D / 16, NTILES = D / 8;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  i64 bh = blockIdx.y, b = bh / hq, h = bh % hq;
  i64 kv = (b * hk + h / (hq / hk)) * s * D;
  i64 i0 = (i64)blockIdx.x * FA_MMA_ROWS;
  // The two query rows of this thread's fragments.
  i64 rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
  const unsigned short* qb = q + bh * s * D;
  unsigned qa[KSTEPS][4];
  for (int kk = 0; kk < KSTEPS; kk++)
    for (int x = 0; x < 4; x++) {
      i64 row = rows[x & 1];
      int col = kk * 16 + 2 * t + (x >> 1) * 8;
      qa[kk][x] = row < s ? fa_pair(qb[row * D + col], qb[row * D + col + 1]) : 0u;
    }
  float o[NTILES][4];
  for (int n = 0; n < NTILES; n++)
    for (int x = 0; x < 4; x++) o[n][x] = 0;
  float mx[2] = {NEG_INF, NEG_INF}, sum[2] = {0, 0}, scale = (float)scale_;
  i64 keys = causal && i0 + FA_MMA_ROWS < s ? i0 + FA_MMA_ROWS : s;
  for (i64 j0 = 0; j0 < keys; j0 += FA_MMA_KEYS) {
    __syncthreads();
    for (int e = threadIdx.x; e < FA_MMA_KEYS * D; e += blockDim.x) {
      int r = e / D, c = e % D;
      bool in = j0 + r < s;
      ks[r][c] = in ? k[kv + (j0 + r) * D + c] : (unsigned short)0;
      vs[r][c] = in ? v[kv + (j0 + r) * D + c] : (unsigned short)0;
    }
    __syncthreads();
    // Scores of this warp's 16 rows against the tile's 64 keys: 8 tiles of 8 keys.
    float sc[FA_MMA_KEYS / 8][4];
    for (int n = 0; n < FA_MMA_KEYS / 8; n++) {
      for (int x = 0; x < 4; x++) sc[n][x] = 0;
      for (int kk = 0; kk < KSTEPS; kk++) {
        const unsigned short* key = ks[n * 8 + g] + kk * 16 + 2 * t;
        unsigned bf[2] = {fa_pair(key[0], key[1]), fa_pair(key[8], key[9])};
        fa_mma(sc[n], qa[kk], bf);
      }
    }
    float grown[2] = {mx[0], mx[1]};
    for (int n = 0; n < FA_MMA_KEYS / 8; n++)
      for (int x = 0; x < 4; x++) {
        i64 i = rows[x >> 1], j = j0 + n * 8 + 2 * t + (x & 1);
        sc[n][x] = i < s && j < s && (!causal || j <= i) ? sc[n][x] * scale : NEG_INF;
        grown[x >> 1] = fmax(grown[x >> 1], sc[n][x]);
      }
    float rescale[2];
    for (int half = 0; half < 2; half++) {
      grown[half] = fmax(grown[half], __shfl_xor_sync(0xffffffffu, grown[half], 1));
      grown[half] = fmax(grown[half], __shfl_xor_sync(0xffffffffu, grown[half], 2));
      rescale[half] = grown[half] == NEG_INF ? 1.0f : exp(mx[half] - grown[half]);
      mx[half] = grown[half];
      sum[half] *= rescale[half];
    }
    for (int n = 0; n < FA_MMA_KEYS / 8; n++)
      for (int x = 0; x < 4; x++) {
        float m = mx[x >> 1];
        sc[n][x] = m == NEG_INF ? 0.0f : exp(sc[n][x] - m);
        sum[x >> 1] += sc[n][x];
      }
    for (int n = 0; n < NTILES; n++)
      for (int x = 0; x < 4; x++) o[n][x] *= rescale[x >> 1];
    // O += P V, 16 keys at a time: P's A fragment is two score tiles' accumulators.
    for (int kk = 0; kk < FA_MMA_KEYS / 16; kk++) {
      unsigned pa[4] = {fa_round_pair(sc[2 * kk][0], sc[2 * kk][1]), fa_round_pair(sc[2 * kk][2], sc[2 * kk][3]),
                        fa_round_pair(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), fa_round_pair(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
      int key = kk * 16 + 2 * t;
      for (int n = 0; n < NTILES; n++) {
        int col = n * 8 + g;
        unsigned bf[2] = {fa_pair(vs[key][col], vs[key + 1][col]), fa_pair(vs[key + 8][col], vs[key + 9][col])};
        fa_mma(o[n], pa, bf);
      }
    }
  }
  for (int half = 0; half < 2; half++) {
    sum[half] += __shfl_xor_sync(0xffffffffu, sum[half], 1);
    sum[half] += __shfl_xor_sync(0xffffffffu, sum[half], 2);
  }
  for (int n = 0; n < NTILES; n++)
    for (int x = 0; x < 4; x++) {
      i64 i = rows[x >> 1];
      if (i < s) out[(bh * s + i) * D + n * 8 + 2 * t + (x & 1)] = ::store(o[n][x] / sum[x >> 1]).bits;
    }
}
extern "C" __global__ void attention_fwd_mma16(unsigned short* out, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) { fa_mma_forward<16>(out, q, k, v, hq, hk, s, scale_, causal); }
extern "C" __global__ void attention_fwd_mma32(unsigned short* out, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) { fa_mma_forward<32>(out, q, k, v, hq, hk, s, scale_, causal); }
extern "C" __global__ void attention_fwd_mma48(unsigned short* out, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) { fa_mma_forward<48>(out, q, k, v, hq, hk, s, scale_, causal); }
extern "C" __global__ void attention_fwd_mma64(unsigned short* out, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) { fa_mma_forward<64>(out, q, k, v, hq, hk, s, scale_, causal); }
extern "C" __global__ void attention_fwd_mma80(unsigned short* out, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) { fa_mma_forward<80>(out, q, k, v, hq, hk, s, scale_, causal); }
extern "C" __global__ void attention_fwd_mma96(unsigned short* out, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) { fa_mma_forward<96>(out, q, k, v, hq, hk, s, scale_, causal); }
extern "C" __global__ void attention_fwd_mma112(unsigned short* out, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) { fa_mma_forward<112>(out, q, k, v, hq, hk, s, scale_, causal); }
extern "C" __global__ void attention_fwd_mma128(unsigned short* out, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) { fa_mma_forward<128>(out, q, k, v, hq, hk, s, scale_, causal); }
#endif
"#;

/// Blocks of `rows` outer rows over a sequence of `s`.
fn query_tiles(s: usize, rows: usize, kernel: &str) -> Result<u32, String> {
    u32::try_from(s.div_ceil(rows).max(1)).map_err(|_| format!("a sequence of {s} is too long for {kernel}"))
}

/// The shape and attribute arguments the attention kernels share.
fn attention_args(q: &[usize], hk: usize, attrs: &Attrs) -> Result<Vec<Arg>, String> {
    let (hq, s, d) = (q[1], q[2], q[3]);
    Ok(vec![Arg::Int(hq as i64), Arg::Int(hk as i64), Arg::Int(s as i64), Arg::Int(d as i64), Arg::Float(attrs.float("scale")?), Arg::Int(attrs.bool("causal")? as i64)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::DType;

    /// Every head dim up to 2048 gets tiles whose every kernel fits 48 KiB of shared memory,
    /// with each thread owning at most `FLASH_COLS` columns; larger head dims are refused by
    /// name, never launched with too little shared memory.
    #[test]
    fn tiles_fit_shared_memory_or_the_head_dim_is_refused() {
        for dtype in [DType::F32, DType::Bf16, DType::F64] {
            let acc = if dtype == DType::F64 { 8 } else { 4 };
            for d in 1..=2048 {
                match flash_tiles(d, 1 << 20, dtype) {
                    Ok((rows, inner)) => {
                        assert!(rows.is_power_of_two() && inner.is_power_of_two() && rows <= FLASH_MAX_ROWS && inner <= FLASH_MAX_INNER, "d={d}: {rows} x {inner}");
                        assert!((FLASH_THREADS / rows) * FLASH_COLS >= d, "d={d}: {rows} rows leave too few threads per row");
                        assert!(flash_shared(d, (rows, inner), 2, 2, 2) * acc <= FLASH_SHARED_BYTES, "d={d} {dtype:?}");
                    }
                    Err(e) => {
                        assert!(dtype == DType::F64 && d > 1500, "d={d} {dtype:?} refused: {e}");
                        assert!(e.contains("head dim"), "{e}");
                    }
                }
            }
            assert!(flash_tiles(2049, 4096, dtype).unwrap_err().contains("head dim of 2049"));
        }
        assert_eq!(flash_tiles(64, 1024, DType::F32), Ok((32, 32)));
        assert_eq!(flash_tiles(128, 1024, DType::F32), Ok((16, 16)));
        assert_eq!(flash_tiles(128, 1024, DType::Bf16), Ok((16, 16)));
        // A sequence of 5 in tiles of 8 (16 threads per row).
        assert_eq!(flash_tiles(64, 5, DType::F32), Ok((8, 8)));
    }
}
