//! `xf.attention`: scaled dot-product attention with grouped key/value heads, and its
//! backward op `xf.attention_grad`.

use super::{arity, float, io_bytes, rank_is, AttrKind, Cost, OpDef, Signature, Slot, VjpCx};
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
        Cost { flops, bytes: io_bytes(inputs, outputs) }
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
        Cost { flops: 10.0 * b * h * s * s * d + 8.0 * b * h * s * s, bytes: io_bytes(inputs, outputs) }
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule::elementwise(4, 4, 3, Linearity::None).block(2).block(3)
    }
}
