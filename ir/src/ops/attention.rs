//! `xf.attention`: scaled dot-product attention with grouped key/value heads, and its
//! backward op `xf.attention_grad`.

use crate::kernel::{dims, Arg, DeviceKernel, KernelCx, Launch};
use super::{arity, float, head_dim, io_bytes, rank_is, AttrKind, Cost, KernelClass, OpDef, Signature, Slot, VjpCx};
use crate::attrs::Attrs;
use crate::graph::Value;
use crate::sharding::{FactorKind, Linearity, ShardingRule};
use crate::types::{DType, TensorTy};

/// Scaled dot-product attention, one op with this decomposition:
///
/// ```text
/// g        = q_heads / kv_heads                 (grouped-query attention; 1 = multi-head)
/// s[h,i,j] = scale * sum_d q[h,i,d] k[h/g,j,d]  (+ -inf where j > i when causal)
/// p        = softmax_j(s)
/// out[h,i,d] = sum_j p[h,i,j] v[h/g,j,d]
/// ```
///
/// Operands are the projections as they come, heads side by side in the features
/// (FlashAttention's `[b, s, h, d]` layout): `q [b, s, q_heads * d]`, `k`, `v
/// [b, s, kv_heads * d]`, with `d` the `head_dim` attribute; the kernels read each head with
/// a row stride, so no copy puts heads first. Heads are independent, which is what makes
/// splitting them over tensor-parallel ranks free of communication. One op (rather than
/// matmul/softmax pieces) keeps the S x S scores an internal of the kernel, as flash
/// attention does, and gives one VJP.
#[derive(Debug)]
pub struct Attention;

impl OpDef for Attention {
    fn mnemonic(&self) -> &'static str {
        "attention"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        forward(cx, Arg::Int(0))
    }
    fn summary(&self) -> &'static str {
        "softmax(scale * q k^T + causal mask) v over heads; kv heads shared by q_heads/kv_heads; (out, lse)"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "q", constraint: "Q" },
                Slot { name: "k", constraint: "K" },
                Slot { name: "v", constraint: "K" },
            ],
            results: &[Slot { name: "out", constraint: "Q" }, Slot { name: "lse", constraint: "S" }],
            attrs: &[("causal", AttrKind::Bool), ("scale", AttrKind::Float), ("head_dim", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        let heads = check_qkv(inputs, attrs)?;
        Ok(vec![inputs[0].clone(), heads.stats(inputs[0])])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], attrs: &Attrs) -> Cost {
        let Ok(Heads { b, s, hq, d, keys, .. }) = Heads::of(inputs, attrs) else { return Cost { flops: 0.0, bytes: io_bytes(inputs, outputs), special: 0.0 } };
        let (b, h, s, d, keys) = (b as f64, hq as f64, s as f64, d as f64, keys as f64);
        // q k^T and p v: 2 * 2*b*h*s*keys*d (the causal half is counted in full, as the
        // published model-FLOP formulas do); softmax with scale and mask: 5 per score.
        let flops = 4.0 * b * h * s * keys * d + 5.0 * b * h * s * keys;
        Cost { flops, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn kernel_class(&self, inputs: &[&TensorTy], attrs: &Attrs) -> KernelClass {
        attention_class(inputs, attrs, 2.0, on_tensor_cores(inputs, attrs))
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        // From the output and its rows' log-sum-exp, as FlashAttention-2's backward: the
        // probabilities come back without a walk for the rows' statistics. (The lse result
        // is a statistic for the backward alone; nothing differentiates through it.)
        let operands = [cx.operands[0], cx.operands[1], cx.operands[2], cx.results[0], cx.results[1], grads[0]];
        let attrs = cx.attrs.clone();
        let d = cx.emit_multi("xf.attention_grad", &operands, attrs)?;
        Ok(vec![Some(d[0]), Some(d[1]), Some(d[2])])
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Batch and heads free (q heads and kv heads share the factor: splitting both by the
        // same count keeps every group of q heads with its kv head; a split of the features
        // is one of whole heads, as `head_dim` checks); query positions free (context
        // parallelism: a rank attends from its own queries to every key, so keys and values
        // are gathered); key positions stay whole.
        attention_rule(&[QUERY, KEYS, KEYS], &[QUERY, STATS])
    }
    fn position_factor(&self) -> Option<usize> {
        Some(QUERY_POSITIONS)
    }
    fn statistics_slots(&self) -> &'static [usize] {
        STATISTICS
    }
    fn backward_only_results(&self) -> &'static [usize] {
        // lse
        &[1]
    }
}

/// Checks `q`, `k`, `v` (the first three operands) and the attributes.
/// The ring attention step's attribute: which step of the ring an op is, so that its
/// kernel knows whose keys it holds (rank `(p - step) mod n` of its cp group's `n`).
pub const RING_STEP_ATTR: &str = "xf.ring_step";

/// The element type of attention's row statistics (log-sum-exp): fp32, or f64 for an f64
/// model, as FlashAttention keeps them.
pub fn stats_dtype(q: &TensorTy) -> DType {
    if q.dtype == DType::F64 { DType::F64 } else { DType::F32 }
}

/// The rows' statistics (`[b, h, s]`) of attention over these operands (`q`, `k`, `v` first)
/// and attributes: what `xf.attention`'s second result is.
pub fn attention_stats(inputs: &[&TensorTy], attrs: &Attrs) -> Result<TensorTy, String> {
    Ok(Heads::of(inputs, attrs)?.stats(inputs[0]))
}

/// Attention's sizes: `q [b, s, hq * d]` against `k`, `v [b, keys, hk * d]`.
#[derive(Clone, Copy, Debug)]
struct Heads {
    b: usize,
    s: usize,
    hq: usize,
    d: usize,
    keys: usize,
    hk: usize,
}

impl Heads {
    /// The sizes of `q` and `k` (the first two operands) by `head_dim`; `Err` where they are
    /// not `[b, s, heads * head_dim]` tensors.
    fn of(inputs: &[&TensorTy], attrs: &Attrs) -> Result<Heads, String> {
        let d = head_dim(attrs)?;
        let (q, k) = (inputs[0], inputs[1]);
        for (what, t) in [("q", q), ("k", k)] {
            rank_is(what, t, 3)?;
            if t.shape[2] % d != 0 {
                return Err(format!("the features of {what} {t} are not whole heads of head_dim = {d}"));
            }
            if t.shape[2] == 0 {
                return Err(format!("{what} {t} has no heads"));
            }
        }
        let size = |x: i64| usize::try_from(x).map_err(|_| format!("a negative extent in {q} or {k}"));
        Ok(Heads { b: size(q.shape[0])?, s: size(q.shape[1])?, hq: size(q.shape[2] / d)?, d: size(d)?, keys: size(k.shape[1])?, hk: size(k.shape[2] / d)? })
    }

    /// `[b, hq, s]` statistics of the queries `q`.
    fn stats(&self, q: &TensorTy) -> TensorTy {
        TensorTy::new([self.b as i64, self.hq as i64, self.s as i64], stats_dtype(q))
    }
}

fn check_block(inputs: &[&TensorTy], attrs: &Attrs) -> Result<Heads, String> {
    let heads = check_qkv(inputs, attrs)?;
    attrs.int(RING_STEP_ATTR)?;
    Ok(heads)
}

fn check_stats(what: &str, t: &TensorTy, expected: &TensorTy) -> Result<(), String> {
    if t != expected {
        return Err(format!("{what} {t} must be {expected} (one statistic per query row)"));
    }
    Ok(())
}

/// The forward's launch (`out` and `lse`), on tensor cores where [`mma_kernels`] has them and
/// the scalar flash kernel (`attention_fwd`) elsewhere; `k0` the sequence row of the first key
/// (a ring step's block starts at its source rank's part).
fn forward(cx: &KernelCx<'_>, k0: Arg) -> Result<DeviceKernel, String> {
    let Heads { b, s, hq, d, keys, .. } = Heads::of(cx.inputs, cx.attrs)?;
    if b * s == 0 {
        return Ok(DeviceKernel::Launches(Vec::new()));
    }
    let mut args = vec![Arg::Out(0), Arg::Out(1), Arg::In(0), Arg::In(1), Arg::In(2)];
    args.extend(attention_args(cx.inputs, cx.attrs)?);
    args.extend(context_args(cx, k0));
    if let Some([kernel, _, _]) = mma_kernels(cx) {
        let grid = [query_tiles(s, MMA_ROWS, kernel)?, crate::kernel::grid_y(b * hq, "(sequence, query head) pairs")?, 1];
        return Ok(DeviceKernel::Launches(vec![Launch { kernel, source: ATTENTION_MMA_CUDA, grid, block: FLASH_THREADS as u32, shared: 0, workspace: 0, args }]));
    }
    let tiles = flash_tiles(d, s.max(keys), cx.inputs[0].dtype)?;
    args.extend([Arg::Int(tiles.0 as i64), Arg::Int(tiles.1 as i64)]);
    // One block per tile of query rows (x) of each sequence's head (y).
    let grid = [query_tiles(s, tiles.0, "attention_fwd")?, crate::kernel::grid_y(b * hq, "(sequence, query head) pairs")?, 1];
    let shared = flash_shared(d, tiles, 1, 2, 1);
    Ok(DeviceKernel::Launches(vec![Launch { kernel: "attention_fwd", source: ATTENTION_CUDA, grid, block: FLASH_THREADS as u32, shared, workspace: 0, args }]))
}

/// The backward's two launches (`dq`, then `dk`/`dv` from the rows' statistics the first
/// leaves in the workspace). Operands are q, k, v, out, lse, dout (the whole attention's
/// `out` and `lse`); `ring` (a ring step's backward): the keys are the block at the step's
/// row.
fn backward(cx: &KernelCx<'_>, ring: bool) -> Result<DeviceKernel, String> {
    let Heads { b, s, hq, d, keys, hk } = Heads::of(cx.inputs, cx.attrs)?;
    if b * s == 0 {
        return Ok(DeviceKernel::Launches(Vec::new()));
    }
    let mut shape_args = attention_args(cx.inputs, cx.attrs)?;
    shape_args.extend(context_args(cx, if ring { Arg::RingKeyOffset } else { Arg::Int(0) }));
    let dout = Arg::In(5);
    let mut q_args = vec![Arg::Out(0), Arg::Workspace, Arg::In(0), Arg::In(1), Arg::In(2), dout.clone(), Arg::In(3), Arg::In(4)];
    // The tensor-core kernels' tiles are compile-time; the scalar ones take theirs.
    let (names, source, rows, shared) = match mma_kernels(cx) {
        Some([_, q_kernel, kv_kernel]) => ([q_kernel, kv_kernel], ATTENTION_MMA_CUDA, MMA_ROWS, 0),
        None => {
            let tiles = flash_tiles(d, s.max(keys), cx.inputs[0].dtype)?;
            shape_args.extend([Arg::Int(tiles.0 as i64), Arg::Int(tiles.1 as i64)]);
            (["attention_grad_q", "attention_grad_kv"], ATTENTION_CUDA, tiles.0, flash_shared(d, tiles, 2, 2, 2))
        }
    };
    let workspace = b * hq * s * 3;
    q_args.extend(shape_args.iter().cloned());
    let mut kv_args = vec![Arg::Out(1), Arg::Out(2), Arg::Workspace, Arg::In(0), Arg::In(1), Arg::In(2), dout];
    kv_args.extend(shape_args);
    let (row_tiles, key_tiles) = (query_tiles(s, rows, "attention_grad")?, query_tiles(keys, rows, "attention_grad")?);
    let (q_grid, kv_grid) = ([row_tiles, crate::kernel::grid_y(b * hq, "(sequence, query head) pairs")?, 1], [key_tiles, crate::kernel::grid_y(b * hk, "(sequence, kv head) pairs")?, 1]);
    Ok(DeviceKernel::Launches(vec![
        Launch { kernel: names[0], source, grid: q_grid, block: FLASH_THREADS as u32, shared, workspace, args: q_args },
        Launch { kernel: names[1], source, grid: kv_grid, block: FLASH_THREADS as u32, shared, workspace, args: kv_args },
    ]))
}

/// One step of ring attention (context parallelism): this rank's queries against the block
/// of keys and values it holds at this step of the ring, `(out, lse)` with `out` normalised
/// over the block's visible keys and `lse` their log-sum-exp (`-inf` where a row sees none).
/// [`AttentionMerge`] combines the steps; [`AttentionBlockGrad`] is the backward.
#[derive(Debug)]
pub struct AttentionBlock;

impl OpDef for AttentionBlock {
    fn mnemonic(&self) -> &'static str {
        "attention_block"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        forward(cx, Arg::RingKeyOffset)
    }
    fn summary(&self) -> &'static str {
        "one ring-attention step: queries against the key/value block held at xf.ring_step; (out, lse)"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "q", constraint: "Q" }, Slot { name: "k", constraint: "K" }, Slot { name: "v", constraint: "K" }],
            results: &[Slot { name: "out", constraint: "Q" }, Slot { name: "lse", constraint: "S" }],
            attrs: &[("causal", AttrKind::Bool), ("scale", AttrKind::Float), ("head_dim", AttrKind::Int), (RING_STEP_ATTR, AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        let heads = check_block(inputs, attrs)?;
        Ok(vec![inputs[0].clone(), heads.stats(inputs[0])])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], attrs: &Attrs) -> Cost {
        Attention.cost(inputs, outputs, attrs)
    }
    fn kernel_class(&self, inputs: &[&TensorTy], attrs: &Attrs) -> KernelClass {
        attention_class(inputs, attrs, 2.0, on_tensor_cores(inputs, attrs))
    }
    fn statistics_slots(&self) -> &'static [usize] {
        STATISTICS
    }
}

/// Combines two partial attentions of the same queries over disjoint keys by their
/// log-sum-exps (online softmax): `out = (e^{l1-m} o1 + e^{l2-m} o2) / (e^{l1-m} + e^{l2-m})`,
/// `lse = m + log(e^{l1-m} + e^{l2-m})`, `m = max(l1, l2)`.
#[derive(Debug)]
pub struct AttentionMerge;

impl OpDef for AttentionMerge {
    fn mnemonic(&self) -> &'static str {
        "attention_merge"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (q, lse) = (dims(cx.inputs[0]), dims(cx.inputs[1]));
        let (b, h, s) = (lse[0], lse[1], lse[2]);
        let (rows, d) = (b * h * s, q[2] / h.max(1));
        if rows == 0 {
            return Ok(DeviceKernel::Launches(Vec::new()));
        }
        let args = vec![Arg::Out(0), Arg::Out(1), Arg::In(0), Arg::In(1), Arg::In(2), Arg::In(3), Arg::Int(h as i64), Arg::Int(s as i64), Arg::Int(rows as i64), Arg::Int(d as i64)];
        let (grid, block) = ([crate::kernel::blocks_for(rows), 1, 1], crate::kernel::ROW_BLOCK);
        Ok(DeviceKernel::Launches(vec![Launch { kernel: "attention_merge", source: ATTENTION_CUDA, grid, block, shared: 0, workspace: 0, args }]))
    }
    fn summary(&self) -> &'static str {
        "merge two partial attentions (out, lse) over disjoint keys by their log-sum-exps"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "out_a", constraint: "Q" },
                Slot { name: "lse_a", constraint: "S" },
                Slot { name: "out_b", constraint: "Q" },
                Slot { name: "lse_b", constraint: "S" },
            ],
            results: &[Slot { name: "out", constraint: "Q" }, Slot { name: "lse", constraint: "S" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 4)?;
        let q = inputs[0];
        float("out_a", q)?;
        rank_is("out_a", q, 3)?;
        if inputs[2] != q {
            return Err(format!("out_b {} must have the type of out_a {q}", inputs[2]));
        }
        // The heads are lse's: `[b, h, s]` of `[b, s, h * d]` rows.
        let lse = inputs[1];
        rank_is("lse_a", lse, 3)?;
        let heads = lse.shape[1];
        if heads <= 0 || q.shape[2] <= 0 || q.shape[2] % heads != 0 {
            return Err(format!("lse_a {lse} must have a whole number of heads in out_a {q}"));
        }
        let stats = TensorTy::new([q.shape[0], heads, q.shape[1]], stats_dtype(q));
        check_stats("lse_a", lse, &stats)?;
        check_stats("lse_b", inputs[3], &stats)?;
        Ok(vec![q.clone(), stats])
    }
    fn flops_per_element(&self) -> f64 {
        // Two scales and a sum per output element (the exps are per row).
        3.0
    }
    fn statistics_slots(&self) -> &'static [usize] {
        // lse_a, lse_b; lse
        &[1, 3, 5]
    }
}

/// The backward of one [`AttentionBlock`] step from the whole attention's `out` and `lse`:
/// this step's share of dq, and the gradients of the block's keys and values from this
/// rank's queries (FlashAttention-2's backward with saved statistics).
#[derive(Debug)]
pub struct AttentionBlockGrad;

impl OpDef for AttentionBlockGrad {
    fn mnemonic(&self) -> &'static str {
        "attention_block_grad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        backward(cx, true)
    }
    fn summary(&self) -> &'static str {
        "ring-attention step backward: (dq, dk, dv) of the block at xf.ring_step from q, k, v, out, lse, dout"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "q", constraint: "Q" },
                Slot { name: "k", constraint: "K" },
                Slot { name: "v", constraint: "K" },
                Slot { name: "out", constraint: "Q" },
                Slot { name: "lse", constraint: "S" },
                Slot { name: "dout", constraint: "Q" },
            ],
            results: &[Slot { name: "dq", constraint: "Q" }, Slot { name: "dk", constraint: "K" }, Slot { name: "dv", constraint: "K" }],
            attrs: &[("causal", AttrKind::Bool), ("scale", AttrKind::Float), ("head_dim", AttrKind::Int), (RING_STEP_ATTR, AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 6)?;
        let heads = check_block(&inputs[..3], attrs)?;
        for (what, t) in [("out", inputs[3]), ("dout", inputs[5])] {
            if t != inputs[0] {
                return Err(format!("{what} {t} must have the type of q {}", inputs[0]));
            }
        }
        check_stats("lse", inputs[4], &heads.stats(inputs[0]))?;
        Ok(vec![inputs[0].clone(), inputs[1].clone(), inputs[2].clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], attrs: &Attrs) -> Cost {
        AttentionGrad.cost(inputs, outputs, attrs)
    }
    fn kernel_class(&self, inputs: &[&TensorTy], attrs: &Attrs) -> KernelClass {
        // Priced as the gathered attention's backward (see AttentionGrad): the GPU runs a
        // ring step's backward on the same kernels (tensor cores where `mma_kernels` has
        // them), so the two forms differ in what they send, not in an assumed kernel.
        attention_class(inputs, attrs, BACKWARD_PRODUCTS, on_tensor_cores(inputs, attrs))
    }
    fn statistics_slots(&self) -> &'static [usize] {
        STATISTICS
    }
}

/// The factor of the query positions in [`attention_rule`].
const QUERY_POSITIONS: usize = 2;
/// [`attention_rule`]'s factors of a query-shaped (`[b, s, h * d]`), key-shaped and
/// statistics (`[b, h, s]`) tensor.
const QUERY: &[usize] = &[0, QUERY_POSITIONS, 1];
const KEYS: &[usize] = &[0, 3, 1];
const STATS: &[usize] = &[0, 1, QUERY_POSITIONS];
/// The slot (operands, then results) of the rows' log-sum-exp in `xf.attention` (its second
/// result) and `xf.attention_grad` (its fifth operand), and in the ring steps' ops alike.
const STATISTICS: &[usize] = &[4];

/// Factors of attention's operands and results: batch 0, heads 1 (the features of a
/// query- or key-shaped tensor, whole heads of `head_dim` each), query positions 2, key
/// positions 3 (blocked), by the shape of each: query-shaped (q, out, dout, dq), key-shaped
/// (k, v, dk, dv) or the rows' statistics (lse, `[b, h, s]`).
fn attention_rule(operands: &[&[usize]], results: &[&[usize]]) -> ShardingRule {
    ShardingRule {
        operands: operands.iter().map(|dims| dims.to_vec()).collect(),
        results: results.iter().map(|dims| dims.to_vec()).collect(),
        factors: vec![FactorKind::Free, FactorKind::Free, FactorKind::Free, FactorKind::Blocked],
        linearity: Linearity::None,
    }
}

fn check_qkv(inputs: &[&TensorTy], attrs: &Attrs) -> Result<Heads, String> {
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    for (what, t) in [("q", q), ("k", k), ("v", v)] {
        float(what, t)?;
        rank_is(what, t, 3)?;
    }
    if k != v {
        return Err(format!("k {k} and v {v} must have the same type"));
    }
    let heads = Heads::of(inputs, attrs)?;
    let Heads { b, s, hq, keys, hk, .. } = heads;
    // A context-parallel rank's queries are a part of the sequence its keys cover (and a
    // query sees at least one key).
    let whole_queries = if s == 0 { keys == 0 } else { keys > 0 && keys % s == 0 };
    if k.shape[0] != b as i64 || !whole_queries || k.dtype != q.dtype {
        return Err(format!("k/v {k} must match q {q} in batch and type, and their sequence be q's or a whole number of q's"));
    }
    if hk == 0 || hq % hk != 0 {
        return Err(format!("q heads ({hq}) must be a multiple of kv heads ({hk})"));
    }
    attrs.bool("causal")?;
    attrs.float("scale")?;
    Ok(heads)
}

/// Attention backward, as FlashAttention-2's: it recomputes the probabilities
/// `p = exp(scale q k^T - lse)` from `q`, `k` and the forward's row log-sum-exp (nothing of
/// size S x S is kept from the forward pass) and, with `dp = dout v^T` and
/// `ds = p * (dp - rowsum(dout * out))`: `dq = scale ds k`, `dk = scale ds^T q`,
/// `dv = p^T dout`, where the gradients of a shared kv head sum over its query heads.
#[derive(Debug)]
pub struct AttentionGrad;

impl OpDef for AttentionGrad {
    fn mnemonic(&self) -> &'static str {
        "attention_grad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        backward(cx, false)
    }
    fn summary(&self) -> &'static str {
        "attention backward: (dq, dk, dv) from q, k, v, out, lse, dout; recomputes the probabilities"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "q", constraint: "Q" },
                Slot { name: "k", constraint: "K" },
                Slot { name: "v", constraint: "K" },
                Slot { name: "out", constraint: "Q" },
                Slot { name: "lse", constraint: "S" },
                Slot { name: "dout", constraint: "Q" },
            ],
            results: &[
                Slot { name: "dq", constraint: "Q" },
                Slot { name: "dk", constraint: "K" },
                Slot { name: "dv", constraint: "K" },
            ],
            attrs: &[("causal", AttrKind::Bool), ("scale", AttrKind::Float), ("head_dim", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 6)?;
        let heads = check_qkv(inputs, attrs)?;
        for (what, t) in [("out", inputs[3]), ("dout", inputs[5])] {
            if t != inputs[0] {
                return Err(format!("{what} {t} must have the type of q {}", inputs[0]));
            }
        }
        check_stats("lse", inputs[4], &heads.stats(inputs[0]))?;
        Ok(vec![inputs[0].clone(), inputs[1].clone(), inputs[2].clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], attrs: &Attrs) -> Cost {
        let Ok(Heads { b, s, hq, d, keys, .. }) = Heads::of(inputs, attrs) else { return Cost { flops: 0.0, bytes: io_bytes(inputs, outputs), special: 0.0 } };
        let (b, h, s, d, keys) = (b as f64, hq as f64, s as f64, d as f64, keys as f64);
        // Recomputed q k^T, then dp, dq, dk, dv: five queries x keys x d products.
        Cost { flops: 10.0 * b * h * s * keys * d + 8.0 * b * h * s * keys, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn kernel_class(&self, inputs: &[&TensorTy], attrs: &Attrs) -> KernelClass {
        attention_class(inputs, attrs, BACKWARD_PRODUCTS, on_tensor_cores(inputs, attrs))
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // As the forward's; dk and dv lack the query positions, so with those split each
        // rank's dk and dv are partial sums over its queries.
        attention_rule(&[QUERY, KEYS, KEYS, QUERY, STATS, QUERY], &[QUERY, KEYS, KEYS])
    }
    fn position_factor(&self) -> Option<usize> {
        Some(QUERY_POSITIONS)
    }
    fn statistics_slots(&self) -> &'static [usize] {
        STATISTICS
    }
}

/// Query-by-key products of the backward kernels, from the forward's statistics: the dq
/// kernel's scores, dp and dq, and the keys' kernel's scores, dp, dk and dv (seven, where
/// FlashAttention-2's one kernel with atomic dq does five, and where walking the keys once
/// more for the rows' statistics took nine).
const BACKWARD_PRODUCTS: f64 = 7.0;

/// The flash-attention work of `q` `[b, s, h * d]` against keys `[b, t, kv * d]`.
fn attention_class(inputs: &[&TensorTy], attrs: &Attrs, products: f64, tensor_cores: bool) -> KernelClass {
    let Ok(Heads { b, s, hq, d, keys, .. }) = Heads::of(inputs, attrs) else { return KernelClass::Memory };
    KernelClass::Attention {
        batch_heads: b as f64 * hq as f64,
        queries: s as f64,
        keys: keys as f64,
        head_dim: d as f64,
        causal: attrs.bool("causal").unwrap_or(true),
        products,
        tensor_cores,
    }
}

/// Whether the attention (forward or backward, of a whole sequence, a context-parallel rank's
/// part or a ring step) of these operands runs on the tensor-core kernels ([`mma_kernels`],
/// whose results have the operands' type): the cost model prices what the device plan
/// launches.
fn on_tensor_cores(inputs: &[&TensorTy], attrs: &Attrs) -> bool {
    let d = Heads::of(inputs, attrs).map_or(0, |h| h.d);
    let bf16 = inputs.iter().enumerate().all(|(slot, t)| t.dtype == crate::types::DType::Bf16 || STATISTICS.contains(&slot));
    mma_head_dim(d).is_some() && bf16 && positions_fit(inputs, attrs)
}

/// Why the attention of these operands runs on the scalar CUDA-core kernels rather than on
/// tensor cores (its element type, its head dim); `None` where it runs on tensor cores. What
/// `shardc compile` tells the user.
pub fn off_tensor_cores(inputs: &[&TensorTy], attrs: &Attrs) -> Option<String> {
    if on_tensor_cores(inputs, attrs) {
        return None;
    }
    let d = Heads::of(inputs, attrs).map_or(0, |h| h.d);
    let mut reasons = Vec::new();
    // The first operand's type, or the first other one that is not bf16 (the statistics aside).
    if let Some((_, t)) = inputs.iter().enumerate().find(|(slot, t)| t.dtype != crate::types::DType::Bf16 && !STATISTICS.contains(slot)) {
        reasons.push(format!("{:?}", t.dtype).to_lowercase());
    }
    if mma_head_dim(d).is_none() {
        reasons.push(format!("head dim {d}"));
    }
    if !positions_fit(inputs, attrs) {
        reasons.push("a sequence of 2^30 rows or more".to_string());
    }
    Some(reasons.join(", "))
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
// Under context parallelism a rank's `sq` queries start at row q0 of the sequence and attend
// to all `sk` keys (gathered), the sequence possibly in zigzag order of `chunks` chunks
// (positions by zigzag_position; no tile is skipped then, the mask decides).
// Grouped-query heads read their kv head's tiles. Tensors are [b, s, heads * d] (heads side by
// side in a row of the sequence, as the projections write them): a head's rows are d values
// at a stride of heads * d; lse and stats are [b, h, s]. Shared matrices have a row stride of d + 1,
// so the threads of a warp reading different rows hit different banks. Every sum runs in a
// fixed order: results repeat bit for bit.
#define FA_THREADS 128
#define FA_COLS 16
// Rows [first, first + count) of a [limit][d] matrix with rows `stride` apart into dst (stride
// d + 1); zeros past limit.
__device__ void fa_load(acc_t* dst, const T* src, i64 stride, i64 first, i64 count, i64 limit, i64 d) {
  for (i64 e = threadIdx.x; e < count * d; e += blockDim.x) {
    i64 r = e / d, c = e % d;
    dst[r * (d + 1) + c] = first + r < limit ? load(src[(first + r) * stride + c]) : (acc_t)0;
  }
}
__device__ acc_t fa_dot(const acc_t* a, const acc_t* b, i64 d) {
  acc_t dot = 0;
  for (i64 c = 0; c < d; c++) dot += a[c] * b[c];
  return dot;
}
// Whether query i of sq (row q0 + i of the sequence) sees key j of sk (row k0 + j: a ring
// step's block starts at its source rank's part).
__device__ bool fa_visible(i64 i, i64 j, i64 sq, i64 sk, i64 causal, i64 q0, i64 chunks, i64 len, i64 k0) {
  if (i >= sq || j >= sk) return false;
  if (!causal) return true;
  return zigzag_position(k0 + j, len, chunks) <= zigzag_position(q0 + i, len, chunks);
}
// Keys a causal tile of queries [i0, i0 + rows) can see at most, in the natural order.
__device__ i64 fa_keys(i64 i0, i64 rows, i64 sk, i64 causal, i64 q0, i64 chunks, i64 k0) {
  if (!causal || chunks > 1) return sk;
  i64 last = q0 + i0 + rows - k0;
  return last < 0 ? 0 : last < sk ? last : sk;
}
// The keys of tile [j0, j0 + n) that query i may see are among its first fa_upto; in the
// zigzag order fa_visible decides each (fa_zigzag). Hidden keys are skipped, never multiplied
// by a zero probability: a NaN or inf there must not reach a row that does not see it.
__device__ i64 fa_upto(i64 i, i64 j0, i64 n, i64 sq, i64 causal, i64 q0, i64 chunks, i64 k0) {
  if (i >= sq) return 0;
  if (!causal || chunks > 1) return n;
  i64 last = q0 + i - k0 - j0 + 1;
  return last < 0 ? 0 : last < n ? last : n;
}
// The queries of tile [i0, i0 + n) that may see key j start at fa_from (the same rule).
__device__ i64 fa_from(i64 j, i64 i0, i64 n, i64 sk, i64 causal, i64 q0, i64 chunks, i64 k0) {
  if (j >= sk) return n;
  if (!causal || chunks > 1) return 0;
  i64 first = k0 + j - q0 - i0;
  return first < 0 ? 0 : first < n ? first : n;
}
#define fa_zigzag (causal && chunks > 1)
// For each of the thread's columns c (lane + c * tpr < d), the sum in key order of w[j] *
// m[j * ld + column] over the keys j < upto of the tile at j0 that query i sees: below upto
// every one in the natural order; in the zigzag order each key's visibility is tested once,
// not once per column.
__device__ void fa_weighted(acc_t* sums, const acc_t* w, const acc_t* m, i64 upto, i64 ld, i64 d, int lane, int tpr, i64 i, i64 j0, i64 sq, i64 sk, i64 causal, i64 q0, i64 chunks, i64 len, i64 k0) {
  for (int c = 0; c < FA_COLS; c++) sums[c] = 0;
  for (i64 j = 0; j < upto; j++)
    if (!fa_zigzag || fa_visible(i, j0 + j, sq, sk, causal, q0, chunks, len, k0))
      for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) sums[c] += w[j] * m[j * ld + lane + (i64)c * tpr];
}
// Forward: grid (query tiles, batch x query heads).
// With `lse` (a ring step, whose keys are the block at row k0): each row's log-sum-exp there
// too, and a row that sees none of the block gets zeros and -inf.
extern "C" __global__ void attention_fwd(T* out, acc_t* lse, const T* q, const T* k, const T* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0, i64 rows, i64 inner) {
  extern __shared__ unsigned char shared_raw[];
  i64 ld = d + 1;
  acc_t* qs = (acc_t*)shared_raw;
  acc_t* ks = qs + rows * ld;
  acc_t* vs = ks + inner * ld;
  acc_t* ps = vs + inner * ld;
  int tpr = FA_THREADS / (int)rows, r = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  i64 bh = blockIdx.y, b = bh / hq, h = bh % hq;
  i64 qstride = hq * d, kstride = hk * d, qo = b * s * qstride + h * d;
  i64 kv = b * sk * kstride + h / (hq / hk) * d;
  i64 i0 = (i64)blockIdx.x * rows, i = i0 + r;
  acc_t scale = (acc_t)scale_, mx = NEG_INF, sum = 0;
  acc_t o[FA_COLS];
  for (int c = 0; c < FA_COLS; c++) o[c] = 0;
  fa_load(qs, q + qo, qstride, i0, rows, s, d);
  i64 keys = fa_keys(i0, rows, sk, causal, q0, chunks, k0);
  for (i64 j0 = 0; j0 < keys; j0 += inner) {
    i64 n = keys - j0 < inner ? keys - j0 : inner;
    __syncthreads();
    fa_load(ks, k + kv, kstride, j0, n, sk, d);
    fa_load(vs, v + kv, kstride, j0, n, sk, d);
    __syncthreads();
    acc_t* pr = ps + r * inner;
    for (i64 j = lane; j < n; j += tpr) pr[j] = fa_dot(qs + r * ld, ks + j * ld, d) * scale;
    __syncthreads();
    acc_t grown = mx;
    for (i64 j = 0; j < n; j++) if (fa_visible(i, j0 + j, s, sk, causal, q0, chunks, len, k0)) grown = fmax(grown, pr[j]);
    acc_t rescale = grown == NEG_INF ? (acc_t)1 : exp(mx - grown);
    __syncthreads();
    for (i64 j = lane; j < n; j += tpr) pr[j] = fa_visible(i, j0 + j, s, sk, causal, q0, chunks, len, k0) ? exp(pr[j] - grown) : (acc_t)0;
    __syncthreads();
    acc_t part = 0;
    for (i64 j = 0; j < n; j++) part += pr[j];
    sum = sum * rescale + part;
    acc_t acc[FA_COLS];
    fa_weighted(acc, pr, vs, fa_upto(i, j0, n, s, causal, q0, chunks, k0), ld, d, lane, tpr, i, j0, s, sk, causal, q0, chunks, len, k0);
    for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) o[c] = o[c] * rescale + acc[c];
    mx = grown;
  }
  // A row that sees no key is 0; a NaN score makes the sum NaN, and the row NaN with it.
  if (i < s) {
    for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) out[qo + i * qstride + lane + (i64)c * tpr] = store(sum != (acc_t)0 ? o[c] / sum : (acc_t)0);
    if (lse && lane == 0) lse[bh * s + i] = sum != (acc_t)0 ? mx + log(sum) : NEG_INF;
  }
}
// Backward for dq, grid (query tiles, batch x query heads), in one walk over the key tiles,
// from the forward's `out` and `lse` (FlashAttention-2's backward): with p = exp(score - lse),
// dp = dout . v and rowdot = out . dout, dq = scale sum p (dp - rowdot) k. Each row's
// (lse, 1, rowdot) goes to `stats` for the keys' kernel (p = exp(score - max) / sum there).
extern "C" __global__ void attention_grad_q(T* dq, acc_t* stats, const T* q, const T* k, const T* v, const T* dout, const T* out, const acc_t* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0, i64 rows, i64 inner) {
  extern __shared__ unsigned char shared_raw[];
  i64 ld = d + 1;
  acc_t* qs = (acc_t*)shared_raw;
  acc_t* dos = qs + rows * ld;
  acc_t* ks = dos + rows * ld;
  acc_t* vs = ks + inner * ld;
  acc_t* ps = vs + inner * ld;
  int tpr = FA_THREADS / (int)rows, r = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  i64 bh = blockIdx.y, b = bh / hq, h = bh % hq;
  i64 qstride = hq * d, kstride = hk * d, qo = b * s * qstride + h * d;
  i64 kv = b * sk * kstride + h / (hq / hk) * d;
  i64 i0 = (i64)blockIdx.x * rows, i = i0 + r;
  acc_t scale = (acc_t)scale_, mx = NEG_INF, rowdot = 0;
  fa_load(qs, q + qo, qstride, i0, rows, s, d);
  fa_load(dos, dout + qo, qstride, i0, rows, s, d);
  i64 keys = fa_keys(i0, rows, sk, causal, q0, chunks, k0);
  acc_t* pr = ps + r * inner;
  // The rows of dout are in shared memory once every thread has loaded its part.
  __syncthreads();
  if (i < s) {
    mx = lse[bh * s + i];
    for (i64 c = 0; c < d; c++) rowdot += load(out[qo + i * qstride + c]) * dos[r * ld + c];
  }
  acc_t a[FA_COLS];
  for (int c = 0; c < FA_COLS; c++) a[c] = 0;
  for (i64 j0 = 0; j0 < keys; j0 += inner) {
    i64 n = keys - j0 < inner ? keys - j0 : inner;
    __syncthreads();
    fa_load(ks, k + kv, kstride, j0, n, sk, d);
    fa_load(vs, v + kv, kstride, j0, n, sk, d);
    __syncthreads();
    // pr holds ds = p (dp - rowdot) for the row's visible keys, 0 for the others.
    for (i64 j = lane; j < n; j += tpr) {
      // A NaN log-sum-exp makes the row's gradients NaN, as on the CPU.
      bool seen = fa_visible(i, j0 + j, s, sk, causal, q0, chunks, len, k0) && mx != NEG_INF;
      acc_t p = seen ? exp(fa_dot(qs + r * ld, ks + j * ld, d) * scale - mx) : (acc_t)0;
      pr[j] = seen ? p * (fa_dot(dos + r * ld, vs + j * ld, d) - rowdot) : (acc_t)0;
    }
    __syncthreads();
    acc_t x[FA_COLS];
    fa_weighted(x, pr, ks, fa_upto(i, j0, n, s, causal, q0, chunks, k0), ld, d, lane, tpr, i, j0, s, sk, causal, q0, chunks, len, k0);
    for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) a[c] += x[c];
  }
  if (i < s) {
    for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) dq[qo + i * qstride + lane + (i64)c * tpr] = store(a[c] * scale);
    if (lane == 0) { acc_t* st = stats + (bh * s + i) * 3; st[0] = mx; st[1] = 1; st[2] = rowdot; }
  }
}
// Backward for dk and dv, grid (key tiles, batch x kv heads): each key row's gradients summed
// over the query heads sharing its kv head and the query tiles that see it, in order, with
// p and ds = p (dp - rowdot) scale from the query rows' stats.
extern "C" __global__ void attention_grad_kv(T* dk, T* dv, const acc_t* stats, const T* q, const T* k, const T* v, const T* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0, i64 rows, i64 inner) {
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
  i64 qstride = hq * d, kstride = hk * d, ko = b * sk * kstride + g * d;
  i64 j0 = (i64)blockIdx.x * rows, j = j0 + r;
  acc_t scale = (acc_t)scale_;
  fa_load(ks, k + ko, kstride, j0, rows, sk, d);
  fa_load(vs, v + ko, kstride, j0, rows, sk, d);
  acc_t dk_acc[FA_COLS], dv_acc[FA_COLS];
  for (int c = 0; c < FA_COLS; c++) { dk_acc[c] = 0; dv_acc[c] = 0; }
  acc_t* pr = ps + r * inner;
  acc_t* dsr = dss + r * inner;
  // Causal, in the natural order: the first query tile holding a query that sees key j0.
  i64 first = causal && chunks <= 1 && k0 + j0 > q0 ? (k0 + j0 - q0) / inner * inner : 0;
  for (i64 gh = 0; gh < group; gh++) {
    i64 bh = b * hq + g * group + gh, qo = b * s * qstride + (g * group + gh) * d;
    for (i64 i0 = first; i0 < s; i0 += inner) {
      i64 n = s - i0 < inner ? s - i0 : inner;
      __syncthreads();
      fa_load(qs, q + qo, qstride, i0, n, s, d);
      fa_load(dos, dout + qo, qstride, i0, n, s, d);
      __syncthreads();
      for (i64 x = lane; x < n; x += tpr) {
        i64 i = i0 + x;
        const acc_t* st = stats + (bh * s + i) * 3;
        acc_t p = fa_visible(i, j, s, sk, causal, q0, chunks, len, k0) && st[0] != NEG_INF ? exp(fa_dot(qs + x * ld, ks + r * ld, d) * scale - st[0]) / st[1] : (acc_t)0;
        pr[x] = p;
        dsr[x] = p * (fa_dot(dos + x * ld, vs + r * ld, d) - st[2]) * scale;
      }
      __syncthreads();
      i64 from = fa_from(j, i0, n, sk, causal, q0, chunks, k0);
      if (fa_zigzag) {
        acc_t x_k[FA_COLS], x_v[FA_COLS];
        for (int c = 0; c < FA_COLS; c++) { x_k[c] = 0; x_v[c] = 0; }
        for (i64 x = from; x < n; x++)
          if (fa_visible(i0 + x, j, s, sk, causal, q0, chunks, len, k0))
            for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) {
              i64 col = lane + (i64)c * tpr;
              x_k[c] += dsr[x] * qs[x * ld + col];
              x_v[c] += pr[x] * dos[x * ld + col];
            }
        for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) { dk_acc[c] += x_k[c]; dv_acc[c] += x_v[c]; }
      } else {
        for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) {
          i64 col = lane + (i64)c * tpr;
          acc_t x_k = 0, x_v = 0;
          for (i64 x = from; x < n; x++) { x_k += dsr[x] * qs[x * ld + col]; x_v += pr[x] * dos[x * ld + col]; }
          dk_acc[c] += x_k;
          dv_acc[c] += x_v;
        }
      }
    }
  }
  if (j < sk)
    for (int c = 0; c < FA_COLS && lane + (i64)c * tpr < d; c++) {
      i64 col = lane + (i64)c * tpr;
      dk[ko + j * kstride + col] = store(dk_acc[c]);
      dv[ko + j * kstride + col] = store(dv_acc[c]);
    }
}
// Two partial attentions of the same rows over disjoint keys merged by their log-sum-exps
// (ring attention), a thread per row of the [b, h, s] statistics: its lse is read before it
// is written, so the results may take the operands' place.
extern "C" __global__ void attention_merge(T* out, acc_t* lse, const T* oa, const acc_t* la, const T* ob, const acc_t* lb, i64 h, i64 s, i64 rows, i64 d) {
  GRID_STRIDE(row, rows) {
    i64 at = ((row / (h * s) * s + row % s) * h + row / s % h) * d;
    acc_t a = la[row], b = lb[row], m = fmax(a, b);
    // Rows that see no key in either part; fmax drops a NaN, which must stay.
    if (a == NEG_INF && b == NEG_INF) {
      for (i64 c = 0; c < d; c++) out[at + c] = store((acc_t)0);
      lse[row] = NEG_INF;
      continue;
    }
    acc_t wa = exp(a - m), wb = exp(b - m), inv = (acc_t)1 / (wa + wb);
    for (i64 c = 0; c < d; c++) out[at + c] = store((wa * load(oa[at + c]) + wb * load(ob[at + c])) * inv);
    lse[row] = m + log(wa + wb);
  }
}
"#;

/// Head dims the tensor-core kernels are instantiated for, with their forward, `dq` and
/// `dk`/`dv` kernels for one whole sequence and for context parallelism (`_cp`: a rank's part
/// of the queries or a ring step's keys, in any order; kept apart so that the whole
/// sequence's kernels compute no position and keep their registers for the accumulators).
type MmaKernels = [&'static str; 3];
const MMA_HEAD_DIMS: [(usize, MmaKernels, MmaKernels); 8] = [(16, ["attention_fwd_mma16", "attention_grad_q_mma16", "attention_grad_kv_mma16"], ["attention_fwd_mma16_cp", "attention_grad_q_mma16_cp", "attention_grad_kv_mma16_cp"]), (32, ["attention_fwd_mma32", "attention_grad_q_mma32", "attention_grad_kv_mma32"], ["attention_fwd_mma32_cp", "attention_grad_q_mma32_cp", "attention_grad_kv_mma32_cp"]), (48, ["attention_fwd_mma48", "attention_grad_q_mma48", "attention_grad_kv_mma48"], ["attention_fwd_mma48_cp", "attention_grad_q_mma48_cp", "attention_grad_kv_mma48_cp"]), (64, ["attention_fwd_mma64", "attention_grad_q_mma64", "attention_grad_kv_mma64"], ["attention_fwd_mma64_cp", "attention_grad_q_mma64_cp", "attention_grad_kv_mma64_cp"]), (80, ["attention_fwd_mma80", "attention_grad_q_mma80", "attention_grad_kv_mma80"], ["attention_fwd_mma80_cp", "attention_grad_q_mma80_cp", "attention_grad_kv_mma80_cp"]), (96, ["attention_fwd_mma96", "attention_grad_q_mma96", "attention_grad_kv_mma96"], ["attention_fwd_mma96_cp", "attention_grad_q_mma96_cp", "attention_grad_kv_mma96_cp"]), (112, ["attention_fwd_mma112", "attention_grad_q_mma112", "attention_grad_kv_mma112"], ["attention_fwd_mma112_cp", "attention_grad_q_mma112_cp", "attention_grad_kv_mma112_cp"]), (128, ["attention_fwd_mma128", "attention_grad_q_mma128", "attention_grad_kv_mma128"], ["attention_fwd_mma128_cp", "attention_grad_q_mma128_cp", "attention_grad_kv_mma128_cp"])];

/// Rows per block of the tensor-core kernels (four warps of 16).
const MMA_ROWS: usize = 64;

/// The tensor-core kernels (forward, `dq`, `dk`/`dv`) for these operands, if they have them:
/// bf16 storage throughout and a head dim that is a multiple of 16 up to 128 (the fragments
/// of `mma.m16n8k16`, and accumulators that fit in registers).
fn mma_kernels(cx: &KernelCx<'_>) -> Option<MmaKernels> {
    use crate::types::DType;
    let d = Heads::of(cx.inputs, cx.attrs).ok()?.d;
    // Every tensor but the rows' statistics (fp32 whatever the storage type).
    let bf16 = cx.inputs.iter().copied().chain(cx.outputs).enumerate().all(|(slot, t)| t.dtype == DType::Bf16 || STATISTICS.contains(&slot));
    let (whole, parts) = mma_head_dim(d).filter(|_| bf16 && positions_fit(cx.inputs, cx.attrs))?;
    Some(if context_parallel(cx.inputs, cx.attrs) { parts } else { whole })
}

/// Whether every row of the op's sequence has a position that the tensor-core kernels'
/// 32-bit masks hold (`FA_NO_KEY`, 2^31 - 1, marks a key past the end): its queries, its keys
/// and the whole sequence of its zigzag order, with room for a rank's offset into it. Longer
/// sequences (no GPU holds one) take the scalar kernels, whose positions are 64-bit.
fn positions_fit(inputs: &[&TensorTy], attrs: &Attrs) -> bool {
    const LIMIT: i64 = 1 << 30;
    let (_, len) = super::zigzag_of(attrs.ints(super::ZIGZAG_ATTR).ok().as_deref());
    [inputs[0].shape.get(1), inputs[1].shape.get(1)].iter().all(|s| s.is_some_and(|&s| s < LIMIT)) && (len as i64) < LIMIT
}

/// Whether the op attends from a part of the sequence or to a part of it (context
/// parallelism): its positions are split or in zigzag order, its keys are not its queries'
/// rows, or it is a ring step.
fn context_parallel(inputs: &[&TensorTy], attrs: &Attrs) -> bool {
    ["xf.seq_split_axes", super::ZIGZAG_ATTR, RING_STEP_ATTR].iter().any(|a| attrs.get(a).is_some()) || inputs[0].shape.get(1) != inputs[1].shape.get(1)
}

/// The kernels' context-parallel arguments: the keys, this rank's first query row, the
/// zigzag order, and `k0`, the row of the first key.
fn context_args(cx: &KernelCx<'_>, k0: Arg) -> [Arg; 5] {
    let (chunks, len) = super::zigzag_of(cx.attrs.ints(super::ZIGZAG_ATTR).ok().as_deref());
    [Arg::Int(dims(cx.inputs[1])[1] as i64), Arg::RankOffset, Arg::Int(chunks as i64), Arg::Int(len as i64), k0]
}

/// The tensor-core kernels of a head dim, if they are built for it.
fn mma_head_dim(d: usize) -> Option<(MmaKernels, MmaKernels)> {
    MMA_HEAD_DIMS.iter().find(|(dim, _, _)| *dim == d).map(|(_, whole, parts)| (*whole, *parts))
}

/// CUDA C of the tensor-core kernels (bf16 modules only; see [`mma_kernels`]).
const ATTENTION_MMA_CUDA: &str = r#"#if defined(BF16)
// Flash attention on tensor cores, bf16 with fp32 accumulation, in FlashAttention-2's layout:
// a block of four warps owns 64 rows (queries forward and for dq, keys for dk and dv), 16 per
// warp, held as mma A fragments in registers; the other side comes in tiles of rows staged in
// shared memory (bf16 bits, row stride D + 8 against bank conflicts, 16 bytes per copy, by
// cp.async from sm_80 so that a tile loads while the previous one is multiplied). Every
// product is an m16n8k16 mma whose B operand is read from the staged rows by ldmatrix
// (transposed where the tile's rows are the reduced index), so nothing is transposed in
// memory: the keys' kernel computes S^T = K Q^T and dP^T = V dO^T. A product's accumulators
// become the next product's A fragments (their layouts line up), rounded to bf16. Online
// softmax per row across tiles, in base 2 (scores times scale * log2(e), exp2): the four
// threads of a quad that share a row exchange its max by shuffles and keep partial sums,
// added up at the end. Causal tiles wholly past the diagonal are skipped, and tiles wholly
// visible are not masked. Causal query tiles run in reverse (the longest first). Each kernel
// comes twice: for one whole sequence, and for context parallelism (`_cp`, CP), where a
// rank's queries are a part of the sequence (from row q0) against the gathered keys or a ring
// step's block (from row k0), in zigzag order: tiles are compared by their rows' positions.
#define FA_MMA_ROWS 64
#define FA_MMA_THREADS 128
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f
// An access the GPU requires to be aligned to `bytes` (a vector load or store, a cp.async, an
// ldmatrix row): checked on the emulated device, where the host would not fault.
#ifdef SHARDC_EMULATED
#define FA_ALIGNED(p, bytes) shim_check_aligned((const void*)(p), bytes, #p, __func__)
#else
#define FA_ALIGNED(p, bytes)
#endif
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
// Four 8x8 bf16 matrices from shared memory, as ldmatrix.x4 loads them: lane l names (by `at`,
// its offset in `tile`, 16-byte aligned) row l % 8 of matrix l / 8, and gets in r[m] matrix m's
// row g, columns 2t and 2t + 1 (an mma B fragment of a tile whose rows are B's columns) or,
// TRANS, its column g, rows 2t and 2t + 1 (of a tile whose rows are B's rows). Before sm_80
// (and on the emulated device) the warp gathers the same by shuffling the lanes' offsets.
template <bool TRANS>
__device__ __forceinline__ void fa_ldsm(unsigned* r, const unsigned short* tile, int at) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned a = (unsigned)__cvta_generic_to_shared(tile + at);
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#else
  int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  FA_ALIGNED(tile + at, 16);
  for (int m = 0; m < 4; m++)
    if (TRANS) {
      int lo = __shfl_sync(0xffffffffu, at, 8 * m + 2 * t), hi = __shfl_sync(0xffffffffu, at, 8 * m + 2 * t + 1);
      r[m] = fa_pair(tile[lo + g], tile[hi + g]);
    } else {
      int row = __shfl_sync(0xffffffffu, at, 8 * m + g);
      r[m] = fa_pair(tile[row + 2 * t], tile[row + 2 * t + 1]);
    }
#endif
}
// 16 bytes from global `src` to shared `dst` (both 16-byte aligned), zeros where !inside (src
// is then not read): cp.async from sm_80, complete once the thread's fa_wait returns and
// visible to the block after a __syncthreads; before (and on the emulated device) at once.
__device__ __forceinline__ void fa_copy16(unsigned short* dst, const unsigned short* src, bool inside) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned to = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(inside ? 16 : 0) : "memory");
#else
  FA_ALIGNED(dst, 16);
  if (inside) FA_ALIGNED(src, 16);
  unsigned* d4 = (unsigned*)dst;
  const unsigned* s4 = (const unsigned*)src;
  for (int w = 0; w < 4; w++) d4[w] = inside ? s4[w] : 0u;
#endif
}
// The same for one float (zero where !inside).
__device__ __forceinline__ void fa_copy4(float* dst, const float* src, bool inside) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned to = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(to), "l"(src), "r"(inside ? 4 : 0) : "memory");
#else
  FA_ALIGNED(dst, 4);
  if (inside) FA_ALIGNED(src, 4);
  *dst = inside ? *src : 0.0f;
#endif
}
// Ends a group of this thread's copies; waits for all of them.
__device__ __forceinline__ void fa_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void fa_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}
// A shared tile of ROWS rows of D bf16 at stride D + 8, 16-byte aligned.
struct alignas(16) fa_vec { unsigned x, y, z, w; };
#define FA_TILE(D, ROWS) ((ROWS) * ((D) + 8) / 8)
// A fragments of the 16 rows from `row0` of a [s][D] matrix with rows `ld` apart (zeros past s).
template <int D>
__device__ void fa_fragments(unsigned (*a)[4], const unsigned short* m, i64 ld, i64 row0, i64 s) {
  int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int kk = 0; kk < D / 16; kk++)
    for (int x = 0; x < 4; x++) {
      i64 row = row0 + g + (x & 1) * 8;
      int col = kk * 16 + 2 * t + (x >> 1) * 8;
      if (row < s) FA_ALIGNED(m + row * ld + col, 4);
      a[kk][x] = row < s ? *(const unsigned*)(m + row * ld + col) : 0u;
    }
}
// Rows [first, first + ROWS) of a [s][D] matrix with rows `ld` apart into a shared tile of
// stride D + 8 (zeros past s), 8 values per copy (rows of D * 2 bytes at a stride of a
// multiple of D, a multiple of 16 bytes, from 16-byte aligned buffers).
template <int D, int ROWS>
__device__ __forceinline__ void fa_stage(unsigned short* tile, const unsigned short* m, i64 ld, i64 first, i64 s) {
  for (int e = threadIdx.x; e < ROWS * (D / 8); e += FA_MMA_THREADS) {
    int r = e / (D / 8), c = e % (D / 8) * 8;
    bool inside = first + r < s;
    fa_copy16(tile + r * (D + 8) + c, m + (inside ? first + r : 0) * ld + c, inside);
  }
}
// out[n] = A times rows n*8 .. n*8+7 of the tile (A B^T: the tile's rows are B's columns),
// for N (even) tiles of 8 rows.
template <int D, int N>
__device__ __forceinline__ void fa_products(float (*out)[4], const unsigned (*a)[4], const unsigned short* tile) {
  int lane = threadIdx.x & 31;
  // Matrix lane / 8: rows 8n + 8 (lane / 16) + lane % 8, columns 16kk + 8 ((lane / 8) % 2).
  int at = ((lane >> 4) * 8 + (lane & 7)) * (D + 8) + ((lane >> 3) & 1) * 8;
  for (int n = 0; n < N; n++)
    for (int x = 0; x < 4; x++) out[n][x] = 0;
  for (int n = 0; n < N; n += 2)
    for (int kk = 0; kk < D / 16; kk++) {
      unsigned bf[4];
      fa_ldsm<false>(bf, tile, at + n * 8 * (D + 8) + kk * 16);
      fa_mma(out[n], a[kk], bf);
      fa_mma(out[n + 1], a[kk], bf + 2);
    }
}
// acc += P times the tile (8N rows of D), P being N accumulator tiles of 8 columns rounded to
// bf16 A fragments, 16 columns at a time.
template <int D, int N>
__device__ __forceinline__ void fa_accumulate(float (*acc)[4], const float (*p)[4], const unsigned short* tile) {
  int lane = threadIdx.x & 31;
  // Matrix lane / 8: rows 16kk + 8 ((lane / 8) % 2) + lane % 8, columns 8n + 8 (lane / 16).
  int at = (((lane >> 3) & 1) * 8 + (lane & 7)) * (D + 8) + (lane >> 4) * 8;
  for (int kk = 0; kk < N / 2; kk++) {
    unsigned pa[4] = {fa_round_pair(p[2 * kk][0], p[2 * kk][1]), fa_round_pair(p[2 * kk][2], p[2 * kk][3]),
                      fa_round_pair(p[2 * kk + 1][0], p[2 * kk + 1][1]), fa_round_pair(p[2 * kk + 1][2], p[2 * kk + 1][3])};
    for (int n = 0; n < D / 8; n += 2) {
      unsigned bf[4];
      fa_ldsm<true>(bf, tile, at + kk * 16 * (D + 8) + n * 8);
      fa_mma(acc[n], pa, bf);
      fa_mma(acc[n + 1], pa, bf + 2);
    }
  }
}
// The larger of a and b, NaN if either is (fmax drops a NaN): a NaN score makes its row's
// maximum NaN, and so the row.
__device__ __forceinline__ float fa_max(float a, float b) { return b > a || b != b ? b : a; }
// A quad's maximum and sum of a row's values (the four threads sharing a fragment row).
__device__ __forceinline__ float fa_quad_max(float v) {
  v = fa_max(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fa_max(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float fa_quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
// Where a block's rows sit in the sequence: `sq` queries from row q0 and `sk` keys from row k0
// of a sequence of `len` rows, in zigzag order of `chunks` chunks (natural order: chunks <= 1).
// One whole sequence has q0 = k0 = 0 and sk = sq; a context-parallel rank's queries are its
// part (q0 its first row) against the gathered keys, or a ring step's block (k0 its first row).
struct fa_seq { i64 sq, sk, q0, k0, chunks, len, causal; };
// Positions of rows, as the masks compare them: a query past sq is FA_NO_QUERY, a key past
// sk FA_NO_KEY, so that causally no query sees it. (Positions fit 31 bits: `positions_fit`
// in the op leaves longer sequences to the scalar kernels.) The masked tiles' loops read positions from registers
// (a thread's own rows) and shared memory (the other side's tile), never computing one: the
// zigzag order's divisions there would cost the accumulators their registers.
#define FA_NO_QUERY (-1)
#define FA_NO_KEY 0x7fffffff
__device__ __forceinline__ int fa_query_position(const fa_seq& z, i64 i) { return i < z.sq ? (int)zigzag_position(z.q0 + i, z.len, z.chunks) : FA_NO_QUERY; }
__device__ __forceinline__ int fa_key_position(const fa_seq& z, i64 j) { return j < z.sk ? (int)zigzag_position(z.k0 + j, z.len, z.chunks) : FA_NO_KEY; }
// Whether the query at position qp sees the key at kp.
__device__ __forceinline__ bool fa_sees(int qp, int kp, i64 causal) { return causal ? kp <= qp : qp != FA_NO_QUERY && kp != FA_NO_KEY; }
// Whether query i sees key j of one whole sequence in its natural order.
__device__ __forceinline__ bool fa_sees_in_order(i64 i, i64 j, const fa_seq& z) { return i < z.sq && j < z.sk && (!z.causal || j <= i); }
// The kernels' place in the sequence: their arguments' with context parallelism (CP), else one
// whole sequence in its natural order, as constants the compiler folds into the kernels of
// a whole sequence (which then compute no position: their registers are the accumulators').
template <bool CP>
__device__ __forceinline__ fa_seq fa_place(fa_seq z) {
  if (!CP) { z.sk = z.sq; z.q0 = 0; z.k0 = 0; z.chunks = 1; z.len = 0; }
  return z;
}
// The positions of the n rows of a tile from row first into `at` (one per thread in turn;
// visible to the block after its next __syncthreads).
__device__ __forceinline__ void fa_key_positions(int* at, const fa_seq& z, i64 first, int n) {
  for (int e = threadIdx.x; e < n; e += FA_MMA_THREADS) at[e] = fa_key_position(z, first + e);
}
// The position of the first of sequence rows [first, first + n) (n > 0) where they lie in one
// chunk, whose rows hold consecutive positions; false where they cross chunks (such a tile is
// neither skipped nor left unmasked: the masks decide, key by key). Chunks of a few rows
// only cross tiles; a context-parallel rank's parts of sequences of 64 x 2cp rows or more, in
// multiples of 64, never do.
__device__ __forceinline__ bool fa_first_position(i64 first, i64 n, const fa_seq& z, i64* at) {
  if (z.chunks > 1 && z.len >= z.chunks && first / (z.len / z.chunks) != (first + n - 1) / (z.len / z.chunks)) return false;
  *at = zigzag_position(first, z.len, z.chunks);
  return true;
}
// Whether no query of [i0, i0 + qn) sees a key of [j0, j0 + kn) (tiles clipped to the rows
// there are): such a tile is skipped.
__device__ bool fa_hidden(const fa_seq& z, i64 i0, i64 qn, i64 j0, i64 kn) {
  qn = z.sq - i0 < qn ? z.sq - i0 : qn;
  kn = z.sk - j0 < kn ? z.sk - j0 : kn;
  if (qn <= 0 || kn <= 0) return true;
  i64 q, k;
  return z.causal && fa_first_position(z.q0 + i0, qn, z, &q) && fa_first_position(z.k0 + j0, kn, z, &k) && k > q + qn - 1;
}
// Whether every query of [i0, i0 + qn) sees every key of [j0, j0 + kn): such a tile goes
// unmasked.
__device__ bool fa_whole(const fa_seq& z, i64 i0, i64 qn, i64 j0, i64 kn) {
  if (i0 + qn > z.sq || j0 + kn > z.sk) return false;
  i64 q, k;
  return !z.causal || (fa_first_position(z.q0 + i0, qn, z, &q) && fa_first_position(z.k0 + j0, kn, z, &k) && k + kn - 1 <= q);
}
// The first key tile of kt rows from row j0 (a multiple of kt) that a query of [i0, i0 + rows)
// sees, sk if none: in the natural order the tiles past the diagonal are all hidden.
__device__ i64 fa_next_keys(const fa_seq& z, i64 i0, i64 rows, i64 j0, i64 kt) {
  for (; j0 < z.sk; j0 += kt) {
    if (!fa_hidden(z, i0, rows, j0, kt)) return j0;
    if (z.chunks <= 1) return z.sk;
  }
  return z.sk;
}
// One tile's online-softmax step on scores `sc` (N tiles of 8 columns from key j0; this
// thread's rows rows[0], rows[1]): masks (unless `whole`) and scales them by scale2 = scale *
// log2(e), grows the rows' maxima (base 2), rescales `sum` and `carried` by the growth, and
// leaves sc = exp2(score - max) (0 where masked).
// `sees(half, column)`: whether row rows[half] sees the key at column j0 + column.
template <int N, typename Sees>
__device__ __forceinline__ void fa_online(float (*sc)[4], float* mx, float* sum, float* carried, Sees sees, float scale2, bool whole) {
  int t = threadIdx.x & 3;
  float grown[2] = {mx[0], mx[1]};
#pragma unroll
  for (int n = 0; n < N; n++)
#pragma unroll
    for (int x = 0; x < 4; x++) {
      sc[n][x] = whole || sees(x >> 1, n * 8 + 2 * t + (x & 1)) ? sc[n][x] * scale2 : NEG_INF;
      grown[x >> 1] = fa_max(grown[x >> 1], sc[n][x]);
    }
  for (int half = 0; half < 2; half++) {
    grown[half] = fa_quad_max(grown[half]);
    float rescale = grown[half] == NEG_INF ? 1.0f : exp2f(mx[half] - grown[half]);
    mx[half] = grown[half];
    sum[half] *= rescale;
    carried[half] = rescale;
  }
  for (int n = 0; n < N; n++)
    for (int x = 0; x < 4; x++) {
      float m = mx[x >> 1];
      sc[n][x] = m == NEG_INF ? 0.0f : exp2f(sc[n][x] - m);
      sum[x >> 1] += sc[n][x];
    }
}
// Writes a warp's 16 rows of D accumulators (scaled by `by` per row) to a [s][D] matrix with
// rows `ld` apart, a pair of values per 32-bit store.
template <int D>
__device__ void fa_write(unsigned short* m, i64 ld, const float (*acc)[4], const i64* rows, const float* by, i64 s) {
  int t = threadIdx.x & 3;
  for (int n = 0; n < D / 8; n++)
    for (int half = 0; half < 2; half++)
      if (rows[half] < s) {
        FA_ALIGNED(m + rows[half] * ld + n * 8 + 2 * t, 4);
        *(unsigned*)(m + rows[half] * ld + n * 8 + 2 * t) = fa_round_pair(acc[n][2 * half] * by[half], acc[n][2 * half + 1] * by[half]);
      }
}
// The query tile of this block: in reverse when causal (the tiles with the most keys first).
__device__ __forceinline__ i64 fa_query_tile(i64 causal) { return causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x; }
// Forward: grid (query tiles of 64, batch x query heads); key tiles of 64, those the block's
// queries see. The block loads a tile's V while it multiplies Q K^T, and the next tile's K
// while it multiplies P V. With `lse` the rows' log-sum-exp too (a ring step's: a row that sees
// none of the block's keys gets zeros and -inf).
template <int D, bool CP>
__device__ void fa_mma_forward(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, double scale_, fa_seq at) {
  const int KT = 64;
  const fa_seq z = fa_place<CP>(at);
  __shared__ fa_vec ks_[FA_TILE(D, KT)];
  __shared__ fa_vec vs_[FA_TILE(D, KT)];
  // The positions of the staged K tile's keys (CP).
  __shared__ int kpos[CP ? KT : 1];
  unsigned short* ks = (unsigned short*)ks_;
  unsigned short* vs = (unsigned short*)vs_;
  int warp = threadIdx.x >> 5;
  i64 bh = blockIdx.y, b = bh / hq, h = bh % hq;
  i64 qld = hq * D, kld = hk * D, qo = b * z.sq * qld + h * D, kv = b * z.sk * kld + h / (hq / hk) * D;
  i64 i0 = fa_query_tile(z.causal) * FA_MMA_ROWS, row0 = i0 + warp * 16;
  i64 rows[2] = {row0 + ((threadIdx.x & 31) >> 2), row0 + ((threadIdx.x & 31) >> 2) + 8};
  int qpos[2] = {CP ? fa_query_position(z, rows[0]) : 0, CP ? fa_query_position(z, rows[1]) : 0};
  float scale2 = (float)scale_ * FA_LOG2E;
  i64 j0 = fa_next_keys(z, i0, FA_MMA_ROWS, 0, KT);
  auto sees = [&](int half, int column) { return CP ? fa_sees(qpos[half], kpos[column], z.causal) : fa_sees_in_order(rows[half], j0 + column, z); };
  if (j0 < z.sk) {
    fa_stage<D, KT>(ks, k + kv, kld, j0, z.sk);
    fa_commit();
    if (CP) fa_key_positions(kpos, z, j0, KT);
  }
  unsigned qa[D / 16][4];
  fa_fragments<D>(qa, q + qo, qld, row0, z.sq);
  float o[D / 8][4];
  for (int n = 0; n < D / 8; n++)
    for (int x = 0; x < 4; x++) o[n][x] = 0;
  float mx[2] = {NEG_INF, NEG_INF}, sum[2] = {0, 0}, rescale[2];
  while (j0 < z.sk) {
    // This tile's K is in, and every warp is done with the last tile's V.
    fa_wait();
    __syncthreads();
    fa_stage<D, KT>(vs, v + kv, kld, j0, z.sk);
    fa_commit();
    float sc[KT / 8][4];
    fa_products<D, KT / 8>(sc, qa, ks);
    fa_online<KT / 8>(sc, mx, sum, rescale, sees, scale2, fa_whole(z, row0, 16, j0, KT));
    for (int n = 0; n < D / 8; n++)
      for (int x = 0; x < 4; x++) o[n][x] *= rescale[x >> 1];
    // This tile's V is in, and every warp is done with its K.
    fa_wait();
    __syncthreads();
    i64 next = fa_next_keys(z, i0, FA_MMA_ROWS, j0 + KT, KT);
    if (next < z.sk) {
      fa_stage<D, KT>(ks, k + kv, kld, next, z.sk);
      fa_commit();
      if (CP) fa_key_positions(kpos, z, next, KT);
    }
    fa_accumulate<D, KT / 8>(o, sc, vs);
    j0 = next;
  }
  float total[2] = {fa_quad_sum(sum[0]), fa_quad_sum(sum[1])};
  // A row that sees no key is 0 (a NaN sum stays NaN).
  float inverse[2] = {total[0] != 0.0f ? 1.0f / total[0] : 0.0f, total[1] != 0.0f ? 1.0f / total[1] : 0.0f};
  fa_write<D>(out + qo, qld, o, rows, inverse, z.sq);
  // Each row's log-sum-exp of its scaled scores, in base e (the maxima are base 2).
  if ((threadIdx.x & 3) == 0)
    for (int half = 0; half < 2; half++)
      if (rows[half] < z.sq) lse[bh * z.sq + rows[half]] = total[half] != 0.0f ? (mx[half] + log2f(total[half])) * FA_LN2 : NEG_INF;
}
// Backward for dq: grid (query tiles of 64, batch x query heads), the key tiles of KT the
// block's queries see, one walk from the forward's `out` and `lse` (FlashAttention-2's
// backward; a ring step's are the whole attention's): with p = exp2(score - lse) (lse in
// base 2), dp = dout . v and rowdot = out . dout, ds = p (dp - rowdot) scale, and dq sums
// ds k. Each row's (lse, -, rowdot) goes to `stats` for the keys' kernel. K and V tiles in two
// buffers, the next tile's loading while this one's are multiplied.
template <int D, int KT, bool CP>
__device__ void fa_mma_grad_q(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse_in, i64 hq, i64 hk, double scale_, fa_seq at) {
  const fa_seq z = fa_place<CP>(at);
  __shared__ fa_vec ks_[2][FA_TILE(D, KT)];
  __shared__ fa_vec vs_[2][FA_TILE(D, KT)];
  __shared__ int kpos_[2][CP ? KT : 1];
  int warp = threadIdx.x >> 5, t = threadIdx.x & 3;
  i64 bh = blockIdx.y, b = bh / hq, h = bh % hq;
  i64 qld = hq * D, kld = hk * D, qo = b * z.sq * qld + h * D, kv = b * z.sk * kld + h / (hq / hk) * D;
  i64 i0 = fa_query_tile(z.causal) * FA_MMA_ROWS, row0 = i0 + warp * 16;
  i64 rows[2] = {row0 + ((threadIdx.x & 31) >> 2), row0 + ((threadIdx.x & 31) >> 2) + 8};
  int qpos[2] = {CP ? fa_query_position(z, rows[0]) : 0, CP ? fa_query_position(z, rows[1]) : 0};
  float scale = (float)scale_, scale2 = scale * FA_LOG2E;
  i64 j0 = fa_next_keys(z, i0, FA_MMA_ROWS, 0, KT);
  bool any = j0 < z.sk;
  if (any) {
    fa_stage<D, KT>((unsigned short*)ks_[0], k + kv, kld, j0, z.sk);
    fa_stage<D, KT>((unsigned short*)vs_[0], v + kv, kld, j0, z.sk);
    fa_commit();
    if (CP) fa_key_positions(kpos_[0], z, j0, KT);
  }
  unsigned qa[D / 16][4], da[D / 16][4];
  fa_fragments<D>(qa, q + qo, qld, row0, z.sq);
  fa_fragments<D>(da, dout + qo, qld, row0, z.sq);
  // The rows' statistics: the four threads of a quad each take a quarter of the row's
  // out . dout, summed by shuffles (every lane takes part; rows past sq read nothing).
  float lse[2], rowdot[2];
  for (int half = 0; half < 2; half++) {
    i64 i = rows[half];
    float dot = 0;
    if (i < z.sq)
      for (int c = t; c < D; c += 4) dot += fa_lo(out[qo + i * qld + c]) * fa_lo(dout[qo + i * qld + c]);
    rowdot[half] = fa_quad_sum(dot);
    lse[half] = i < z.sq ? lse_in[bh * z.sq + i] * FA_LOG2E : NEG_INF;
  }
  float acc[D / 8][4];
  for (int n = 0; n < D / 8; n++)
    for (int x = 0; x < 4; x++) acc[n][x] = 0;
  for (int step = 0; j0 < z.sk; step++) {
    const unsigned short* ks = (const unsigned short*)ks_[step & 1];
    const unsigned short* vs = (const unsigned short*)vs_[step & 1];
    const int* kpos = kpos_[step & 1];
    // This step's tiles are in, and every warp is done with the other buffers (the last step's).
    fa_wait();
    __syncthreads();
    i64 next = fa_next_keys(z, i0, FA_MMA_ROWS, j0 + KT, KT);
    if (next < z.sk) {
      fa_stage<D, KT>((unsigned short*)ks_[(step + 1) & 1], k + kv, kld, next, z.sk);
      fa_stage<D, KT>((unsigned short*)vs_[(step + 1) & 1], v + kv, kld, next, z.sk);
      fa_commit();
      if (CP) fa_key_positions(kpos_[(step + 1) & 1], z, next, KT);
    }
    float sc[KT / 8][4], dp[KT / 8][4];
    fa_products<D, KT / 8>(sc, qa, ks);
    fa_products<D, KT / 8>(dp, da, vs);
    bool whole = fa_whole(z, row0, 16, j0, KT);
#pragma unroll
    for (int n = 0; n < KT / 8; n++)
#pragma unroll
      for (int x = 0; x < 4; x++) {
        int half = x >> 1;
        int column = n * 8 + 2 * t + (x & 1);
        float p = whole || (CP ? fa_sees(qpos[half], kpos[column], z.causal) : fa_sees_in_order(rows[half], j0 + column, z)) ? exp2f(sc[n][x] * scale2 - lse[half]) : 0.0f;
        sc[n][x] = p * (dp[n][x] - rowdot[half]) * scale;
      }
    fa_accumulate<D, KT / 8>(acc, sc, ks);
    j0 = next;
  }
  float one[2] = {1.0f, 1.0f};
  fa_write<D>(dq + qo, qld, acc, rows, one, z.sq);
  if (t == 0)
    for (int half = 0; half < 2; half++)
      if (rows[half] < z.sq) {
        float* st = stats + (bh * z.sq + rows[half]) * 3;
        st[0] = any ? lse[half] : NEG_INF;
        st[1] = 1.0f;
        st[2] = any ? rowdot[half] : 0.0f;
      }
}
// Backward for dk and dv: grid (key tiles of 64, batch x kv heads), the query tiles of QT that
// see the block's keys (QT = 16 for context parallelism's widest heads, whose positions' registers
// would spill the accumulators at 32). Each warp's 16 keys hold K and V as A fragments, so S^T = K Q^T and
// dP^T = V dO^T come out with keys as rows; p^T and ds^T follow from the query rows' stats,
// and dv += p^T dout and dk += ds^T q, summed over the query heads sharing the kv head and the
// query tiles, in order: one pipeline over (head, query tile) steps, with Q, dO and the stats
// in two buffers, the next step's loading while this one's are multiplied.
template <int D, int QT, bool CP>
__device__ void fa_mma_grad_kv(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, double scale_, fa_seq at) {
  const fa_seq z = fa_place<CP>(at);
  __shared__ fa_vec qs_[2][FA_TILE(D, QT)];
  __shared__ fa_vec dos_[2][FA_TILE(D, QT)];
  // Per buffer, the query rows' lse (base 2) then their rowdot, and their positions.
  __shared__ float st_[2][2][QT];
  __shared__ int qpos_[2][CP ? QT : 1];
  int warp = threadIdx.x >> 5, t = threadIdx.x & 3;
  i64 bg = blockIdx.y, b = bg / hk, gk = bg % hk, group = hq / hk;
  i64 qld = hq * D, kld = hk * D, ko = b * z.sk * kld + gk * D;
  i64 j0 = (i64)blockIdx.x * FA_MMA_ROWS, row0 = j0 + warp * 16;
  i64 keys[2] = {row0 + ((threadIdx.x & 31) >> 2), row0 + ((threadIdx.x & 31) >> 2) + 8};
  int kpos[2] = {CP ? fa_key_position(z, keys[0]) : 0, CP ? fa_key_position(z, keys[1]) : 0};
  float scale = (float)scale_, scale2 = scale * FA_LOG2E;
  // Causal in the natural order: the query tiles before the first holding a query that sees
  // key j0 see none of the block's keys, the rest do, so the steps run over the tiles from
  // there; with context parallelism each tile is tested too (`next`).
  i64 first = z.causal && z.chunks <= 1 && z.k0 + j0 > z.q0 ? (z.k0 + j0 - z.q0) / QT * QT : 0;
  i64 tiles = z.sq > first ? (z.sq - first + QT - 1) / QT : 0, steps = group * tiles;
  // The first step from x whose query tile sees a key of the block (steps if none).
  auto next = [&](i64 x) -> i64 {
    if (CP)
      while (x < steps && fa_hidden(z, first + x % tiles * QT, QT, j0, FA_MMA_ROWS)) x++;
    return x;
  };
  // Step x's query tile into buffer `buffer`.
  auto stage = [&](i64 x, int buffer) {
    i64 bh = b * hq + gk * group + x / tiles, i0 = first + x % tiles * QT, qo = b * z.sq * qld + (gk * group + x / tiles) * D;
    fa_stage<D, QT>((unsigned short*)qs_[buffer], q + qo, qld, i0, z.sq);
    fa_stage<D, QT>((unsigned short*)dos_[buffer], dout + qo, qld, i0, z.sq);
    for (int e = threadIdx.x; e < 2 * QT; e += FA_MMA_THREADS) {
      int c = e % QT;
      bool inside = i0 + c < z.sq;
      fa_copy4(&st_[buffer][e / QT][c], stats + (bh * z.sq + (inside ? i0 + c : 0)) * 3 + (e / QT) * 2, inside);
    }
    fa_commit();
    if (CP)
      for (int e = threadIdx.x; e < QT; e += FA_MMA_THREADS) qpos_[buffer][e] = fa_query_position(z, i0 + e);
  };
  i64 x = next(0);
  if (x < steps) stage(x, 0);
  unsigned ka[D / 16][4], va[D / 16][4];
  fa_fragments<D>(ka, k + ko, kld, row0, z.sk);
  fa_fragments<D>(va, v + ko, kld, row0, z.sk);
  float dka[D / 8][4], dva[D / 8][4];
  for (int n = 0; n < D / 8; n++)
    for (int e = 0; e < 4; e++) { dka[n][e] = 0; dva[n][e] = 0; }
  // Buffers alternate by step (CP, where steps skip) or by x (every step taken).
  for (int step = 0; x < steps; step++) {
    int buffer = (CP ? step : (int)x) & 1;
    i64 i0 = first + x % tiles * QT;
    const unsigned short* qs = (const unsigned short*)qs_[buffer];
    const unsigned short* dos = (const unsigned short*)dos_[buffer];
    const float* lse = st_[buffer][0];
    const float* rowdot = st_[buffer][1];
    const int* qpos = qpos_[buffer];
    // This step's tiles are in, and every warp is done with the other buffers (the last step's).
    fa_wait();
    __syncthreads();
    i64 after = next(x + 1);
    if (after < steps) stage(after, buffer ^ 1);
    float sc[QT / 8][4], dp[QT / 8][4];
    fa_products<D, QT / 8>(sc, ka, qs);
    fa_products<D, QT / 8>(dp, va, dos);
    bool whole = fa_whole(z, i0, QT, row0, 16);
#pragma unroll
    for (int n = 0; n < QT / 8; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int c = n * 8 + 2 * t + (e & 1);
        float p = whole || (CP ? fa_sees(qpos[c], kpos[e >> 1], z.causal) : fa_sees_in_order(i0 + c, keys[e >> 1], z)) ? exp2f(sc[n][e] * scale2 - lse[c]) : 0.0f;
        sc[n][e] = p;
        dp[n][e] = p * (dp[n][e] - rowdot[c]) * scale;
      }
    fa_accumulate<D, QT / 8>(dva, sc, dos);
    fa_accumulate<D, QT / 8>(dka, dp, qs);
    x = after;
  }
  float one[2] = {1.0f, 1.0f};
  fa_write<D>(dk + ko, kld, dka, keys, one, z.sk);
  fa_write<D>(dv + ko, kld, dva, keys, one, z.sk);
}
extern "C" __global__ void attention_fwd_mma16(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<16, false>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma16(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<16, 64, false>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma16(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<16, 64, false>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma32(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<32, false>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma32(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<32, 64, false>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma32(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<32, 64, false>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma48(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<48, false>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma48(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<48, 64, false>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma48(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<48, 64, false>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma64(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<64, false>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma64(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<64, 64, false>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma64(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<64, 64, false>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma80(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<80, false>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma80(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<80, 32, false>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma80(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<80, 32, false>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma96(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<96, false>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma96(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<96, 32, false>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma96(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<96, 32, false>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma112(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<112, false>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma112(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<112, 32, false>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma112(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<112, 32, false>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma128(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<128, false>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma128(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<128, 32, false>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma128(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<128, 32, false>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma16_cp(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<16, true>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma16_cp(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<16, 64, true>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma16_cp(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<16, 64, true>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma32_cp(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<32, true>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma32_cp(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<32, 64, true>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma32_cp(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<32, 64, true>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma48_cp(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<48, true>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma48_cp(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<48, 64, true>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma48_cp(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<48, 64, true>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma64_cp(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<64, true>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma64_cp(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<64, 64, true>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma64_cp(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<64, 64, true>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma80_cp(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<80, true>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma80_cp(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<80, 32, true>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma80_cp(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<80, 32, true>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma96_cp(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<96, true>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma96_cp(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<96, 32, true>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma96_cp(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<96, 32, true>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma112_cp(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<112, true>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma112_cp(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<112, 32, true>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma112_cp(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<112, 16, true>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_fwd_mma128_cp(unsigned short* out, float* lse, const unsigned short* q, const unsigned short* k, const unsigned short* v, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_forward<128, true>(out, lse, q, k, v, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_q_mma128_cp(unsigned short* dq, float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, const unsigned short* out, const float* lse, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_q<128, 32, true>(dq, stats, q, k, v, dout, out, lse, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
extern "C" __global__ void attention_grad_kv_mma128_cp(unsigned short* dk, unsigned short* dv, const float* stats, const unsigned short* q, const unsigned short* k, const unsigned short* v, const unsigned short* dout, i64 hq, i64 hk, i64 s, i64 d, double scale_, i64 causal, i64 sk, i64 q0, i64 chunks, i64 len, i64 k0) { fa_mma_grad_kv<128, 16, true>(dk, dv, stats, q, k, v, dout, hq, hk, scale_, fa_seq{s, sk, q0, k0, chunks, len, causal}); }
#endif
"#;

/// Blocks of `rows` outer rows over a sequence of `s`.
fn query_tiles(s: usize, rows: usize, kernel: &str) -> Result<u32, String> {
    u32::try_from(s.div_ceil(rows).max(1)).map_err(|_| format!("a sequence of {s} is too long for {kernel}"))
}

/// The shape and attribute arguments the attention kernels share.
fn attention_args(inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<Arg>, String> {
    let Heads { hq, s, d, hk, .. } = Heads::of(inputs, attrs)?;
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

    /// A sequence whose positions the tensor-core kernels' 32-bit masks cannot hold takes the
    /// scalar kernels (64-bit positions), and `compile` says why; one row fewer stays on
    /// tensor cores. Queries, keys and a zigzag order's whole sequence each count.
    #[test]
    fn sequences_past_the_masks_positions_leave_tensor_cores() {
        let attrs = Attrs::new().with("causal", crate::attrs::AttrValue::Bool(true)).with("head_dim", crate::attrs::AttrValue::Int(16));
        let t = |s: i64| TensorTy::new([1, s, 32], DType::Bf16);
        let (edge, past) = ((1i64 << 30) - 1, 1i64 << 30);
        assert_eq!(off_tensor_cores(&[&t(edge), &t(edge), &t(edge)], &attrs), None);
        for (q, k) in [(past, 4), (4, past)] {
            let why = off_tensor_cores(&[&t(q), &t(k), &t(k)], &attrs).unwrap();
            assert_eq!(why, "a sequence of 2^30 rows or more", "q {q} k {k}");
        }
        let zigzag = attrs.clone().with(crate::ops::ZIGZAG_ATTR, crate::attrs::AttrValue::Ints(vec![4, past]));
        assert!(off_tensor_cores(&[&t(8), &t(8), &t(8)], &zigzag).is_some_and(|why| why.contains("2^30")));
        assert!(!on_tensor_cores(&[&t(8), &t(8), &t(8)], &zigzag));
    }

    /// Every tensor-core kernel the table names is an entry of the module text (spelled out,
    /// since the emulated device finds kernels by their literal signatures), with the tile
    /// size its head dim takes, and no entry is left out of the table.
    #[test]
    fn every_tensor_core_kernel_in_the_table_is_instantiated() {
        for (d, whole, parts) in MMA_HEAD_DIMS {
            assert!(d % 16 == 0 && d <= 128, "d={d}");
            for (name, cp) in whole.iter().map(|n| (n, false)).chain(parts.iter().map(|n| (n, true))) {
                assert_eq!(ATTENTION_MMA_CUDA.matches(&format!("extern \"C\" __global__ void {name}(")).count(), 1, "{name}");
                assert_eq!(name.ends_with("_cp"), cp, "{name}");
            }
            let tile = if d <= 64 { 64 } else { 32 };
            // The context-parallel keys' kernel of the widest heads takes query tiles of 16: at
            // 32 its positions' registers spill its accumulators (ptxas, sm_90).
            let parts_kv_tile = if d >= 112 { 16 } else { tile };
            for (template, cp, tile) in [("fa_mma_grad_q", false, tile), ("fa_mma_grad_kv", false, tile), ("fa_mma_grad_q", true, tile), ("fa_mma_grad_kv", true, parts_kv_tile)] {
                assert!(ATTENTION_MMA_CUDA.contains(&format!("{template}<{d}, {tile}, {cp}>(")), "{template}<{d}, {tile}, {cp}>");
            }
            for cp in [false, true] {
                assert!(ATTENTION_MMA_CUDA.contains(&format!("fa_mma_forward<{d}, {cp}>(")), "fa_mma_forward<{d}, {cp}>");
            }
        }
        assert_eq!(ATTENTION_MMA_CUDA.matches("extern \"C\" __global__ void ").count(), 6 * MMA_HEAD_DIMS.len());
        // The kernels stage tiles in strides of their compile-time thread count and own
        // compile-time rows per block: both must be the launches'.
        assert!(ATTENTION_MMA_CUDA.contains(&format!("#define FA_MMA_THREADS {FLASH_THREADS}\n")));
        assert!(ATTENTION_MMA_CUDA.contains(&format!("#define FA_MMA_ROWS {MMA_ROWS}\n")));
    }
}
