//! `xf.attention`: scaled dot-product attention with grouped key/value heads.

use super::{arity, float, io_bytes, rank_is, AttrKind, Cost, OpDef, Signature, Slot};
use crate::attrs::Attrs;
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
        Ok(vec![q.clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        let q = inputs[0];
        let (b, h, s, d) = (q.shape[0] as f64, q.shape[1] as f64, q.shape[2] as f64, q.shape[3] as f64);
        // q k^T and p v: 2 * 2*b*h*s*s*d (the causal half is counted in full, as the
        // published model-FLOP formulas do); softmax with scale and mask: 5 per score.
        let flops = 4.0 * b * h * s * s * d + 5.0 * b * h * s * s;
        Cost { flops, bytes: io_bytes(inputs, outputs) }
    }
}
