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
        let mut args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), Arg::In(2)];
        args.extend(attention_args(&q, hk, cx.attrs)?);
        // One block per query row (x) of each sequence's head (y); shared memory for one
        // chunk of keys and the row's output, whatever the sequence length.
        let grid = [u32::try_from(s).map_err(|_| format!("a sequence of {s} is too long for attention_fwd"))?, crate::kernel::grid_y(b * hq, "(sequence, query head) pairs")?, 1];
        Ok(DeviceKernel::Launches(vec![Launch { kernel: "attention_fwd", source: ATTENTION_CUDA, grid, block: KEY_CHUNK as u32, shared: KEY_CHUNK + q[3], workspace: 0, args }]))
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
        let shape_args = attention_args(&q, hk, cx.attrs)?;
        let workspace = b * hq * s * 3;
        let mut q_args = vec![Arg::Out(0), Arg::Workspace, Arg::In(0), Arg::In(1), Arg::In(2), Arg::In(3)];
        q_args.extend(shape_args.iter().cloned());
        let mut kv_args = vec![Arg::Out(1), Arg::Out(2), Arg::Workspace, Arg::In(0), Arg::In(1), Arg::In(2), Arg::In(3)];
        kv_args.extend(shape_args);
        let rows = u32::try_from(s).map_err(|_| format!("a sequence of {s} is too long for attention_grad"))?;
        let (q_grid, kv_grid) = ([rows, crate::kernel::grid_y(b * hq, "(sequence, query head) pairs")?, 1], [rows, crate::kernel::grid_y(b * hk, "(sequence, kv head) pairs")?, 1]);
        Ok(DeviceKernel::Launches(vec![
            Launch { kernel: "attention_grad_q", source: ATTENTION_CUDA, grid: q_grid, block: KEY_CHUNK as u32, shared: 2 * KEY_CHUNK + 2 * d, workspace, args: q_args },
            Launch { kernel: "attention_grad_kv", source: ATTENTION_CUDA, grid: kv_grid, block: 128, shared: 2 * d, workspace, args: kv_args },
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

/// Keys per chunk of the attention kernels' online softmax (and their threads per block).
const KEY_CHUNK: usize = 128;

/// CUDA C of this file's ops (see [`crate::kernel`]).
const ATTENTION_CUDA: &str = r#"// Keys are visited in chunks of KEY_CHUNK (the block size: one score per thread), so shared
// memory holds one chunk's probabilities and per-row vectors of the head dim, whatever the
// sequence length (no S x S or S-long buffer anywhere).
#define KEY_CHUNK 128
// Scores of keys [j0, j0 + n) against query row qi (times scale) into p; returns the block's
// largest.
__device__ acc_t chunk_scores(acc_t* p, const T* qi, const T* k, i64 j0, i64 n, i64 d, acc_t scale) {
  acc_t mx = NEG_INF;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    acc_t dot = 0;
    for (i64 c = 0; c < d; c++) dot += load(qi[c]) * load(k[(j0 + j) * d + c]);
    p[j] = dot * scale;
    mx = fmax(mx, p[j]);
  }
  return block_max(mx);
}
// One block per (query row, batch x head), an online softmax over the key chunks (flash
// attention's running max and sum; the output rescaled whenever the max grows).
extern "C" __global__ void attention_fwd(T* out, const T* q, const T* k, const T* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) {
  extern __shared__ unsigned char shared_raw[];
  acc_t* p = (acc_t*)shared_raw;
  acc_t* o = p + KEY_CHUNK;
  i64 i = blockIdx.x, bh = blockIdx.y, b = bh / hq, h = bh % hq;
  i64 kv = (b * hk + h / (hq / hk)) * s * d;
  const T* qi = q + (bh * s + i) * d;
  i64 visible = causal ? i + 1 : s;
  acc_t scale = (acc_t)scale_, mx = NEG_INF, sum = 0;
  for (i64 c = threadIdx.x; c < d; c += blockDim.x) o[c] = 0;
  for (i64 j0 = 0; j0 < visible; j0 += KEY_CHUNK) {
    i64 n = visible - j0 < KEY_CHUNK ? visible - j0 : KEY_CHUNK;
    acc_t grown = fmax(mx, chunk_scores(p, qi, k + kv, j0, n, d, scale));
    acc_t rescale = exp(mx - grown), part = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) { p[j] = exp(p[j] - grown); part += p[j]; }
    sum = sum * rescale + block_sum(part);
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
      acc_t acc = 0;
      for (i64 j = 0; j < n; j++) acc += p[j] * load(v[kv + (j0 + j) * d + c]);
      o[c] = o[c] * rescale + acc;
    }
    mx = grown;
    __syncthreads();
  }
  for (i64 c = threadIdx.x; c < d; c += blockDim.x) out[(bh * s + i) * d + c] = store(o[c] / sum);
}
// Backward, per query row, in two passes over the key chunks: the row's max and sum (online),
// then with p = exp(score - max) / sum and dp = dout . v: rowdot = sum p dp, and
// dq = scale (sum p dp k - rowdot sum p k). The row's (max, sum, rowdot) go to `stats` for the
// keys' kernel.
extern "C" __global__ void attention_grad_q(T* dq, acc_t* stats, const T* q, const T* k, const T* v, const T* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) {
  extern __shared__ unsigned char shared_raw[];
  acc_t* p = (acc_t*)shared_raw;
  acc_t* dp = p + KEY_CHUNK;
  acc_t* pdpk = dp + KEY_CHUNK;
  acc_t* pk = pdpk + d;
  i64 i = blockIdx.x, bh = blockIdx.y, b = bh / hq, h = bh % hq;
  i64 kv = (b * hk + h / (hq / hk)) * s * d;
  const T* qi = q + (bh * s + i) * d;
  const T* doi = dout + (bh * s + i) * d;
  i64 visible = causal ? i + 1 : s;
  acc_t scale = (acc_t)scale_, mx = NEG_INF, sum = 0, rowdot = 0;
  for (i64 j0 = 0; j0 < visible; j0 += KEY_CHUNK) {
    i64 n = visible - j0 < KEY_CHUNK ? visible - j0 : KEY_CHUNK;
    acc_t grown = fmax(mx, chunk_scores(p, qi, k + kv, j0, n, d, scale)), part = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) part += exp(p[j] - grown);
    sum = sum * exp(mx - grown) + block_sum(part);
    mx = grown;
  }
  for (i64 c = threadIdx.x; c < d; c += blockDim.x) { pdpk[c] = 0; pk[c] = 0; }
  for (i64 j0 = 0; j0 < visible; j0 += KEY_CHUNK) {
    i64 n = visible - j0 < KEY_CHUNK ? visible - j0 : KEY_CHUNK;
    chunk_scores(p, qi, k + kv, j0, n, d, scale);
    acc_t part = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
      acc_t dot = 0;
      for (i64 c = 0; c < d; c++) dot += load(doi[c]) * load(v[kv + (j0 + j) * d + c]);
      p[j] = exp(p[j] - mx) / sum;
      dp[j] = dot;
      part += p[j] * dot;
    }
    rowdot += block_sum(part);
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
      acc_t a = 0, bsum = 0;
      for (i64 j = 0; j < n; j++) { acc_t kc = load(k[kv + (j0 + j) * d + c]); a += p[j] * dp[j] * kc; bsum += p[j] * kc; }
      pdpk[c] += a;
      pk[c] += bsum;
    }
    __syncthreads();
  }
  for (i64 c = threadIdx.x; c < d; c += blockDim.x) dq[(bh * s + i) * d + c] = store((pdpk[c] - rowdot * pk[c]) * scale);
  if (threadIdx.x == 0) { acc_t* st = stats + (bh * s + i) * 3; st[0] = mx; st[1] = sum; st[2] = rowdot; }
}
// Backward, per key row of a kv head: dk and dv summed over the heads sharing it and the
// query rows that see it, in order.
extern "C" __global__ void attention_grad_kv(T* dk, T* dv, const acc_t* stats, const T* q, const T* k, const T* v, const T* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal) {
  extern __shared__ unsigned char shared_raw[];
  acc_t* dk_acc = (acc_t*)shared_raw;
  acc_t* dv_acc = dk_acc + d;
  i64 j = blockIdx.x, bg = blockIdx.y, b = bg / hk, g = bg % hk, group = hq / hk;
  const T* kj = k + (bg * s + j) * d;
  const T* vj = v + (bg * s + j) * d;
  acc_t scale = (acc_t)scale_;
  for (i64 c = threadIdx.x; c < d; c += blockDim.x) { dk_acc[c] = 0; dv_acc[c] = 0; }
  for (i64 gh = 0; gh < group; gh++) {
    i64 bh = b * hq + g * group + gh;
    for (i64 i = causal ? j : 0; i < s; i++) {
      const T* qi = q + (bh * s + i) * d;
      const T* doi = dout + (bh * s + i) * d;
      acc_t score = 0, dpij = 0;
      for (i64 c = threadIdx.x; c < d; c += blockDim.x) { score += load(qi[c]) * load(kj[c]); dpij += load(doi[c]) * load(vj[c]); }
      score = block_sum(score);
      dpij = block_sum(dpij);
      const acc_t* st = stats + (bh * s + i) * 3;
      acc_t pij = exp(score * scale - st[0]) / st[1];
      acc_t ds = pij * (dpij - st[2]) * scale;
      for (i64 c = threadIdx.x; c < d; c += blockDim.x) { dk_acc[c] += ds * load(qi[c]); dv_acc[c] += pij * load(doi[c]); }
    }
  }
  for (i64 c = threadIdx.x; c < d; c += blockDim.x) { dk[(bg * s + j) * d + c] = store(dk_acc[c]); dv[(bg * s + j) * d + c] = store(dv_acc[c]); }
}
"#;

/// The shape and attribute arguments the attention kernels share.
fn attention_args(q: &[usize], hk: usize, attrs: &Attrs) -> Result<Vec<Arg>, String> {
    let (hq, s, d) = (q[1], q[2], q[3]);
    Ok(vec![Arg::Int(hq as i64), Arg::Int(hk as i64), Arg::Int(s as i64), Arg::Int(d as i64), Arg::Float(attrs.float("scale")?), Arg::Int(attrs.bool("causal")? as i64)])
}
