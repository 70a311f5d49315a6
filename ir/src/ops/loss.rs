//! `xf.cross_entropy`: mean token cross-entropy of logits against targets.

use super::{arity, float, ids, io_bytes, rank_at_least, Cost, OpDef, Signature, Slot};
use crate::attrs::Attrs;
use crate::types::TensorTy;

/// `loss = mean_t (logsumexp(logits[t, :]) - logits[t, targets[t]])` over every token
/// position `t`; `logits [..., vocab]`, `targets [...]` (i32). The result is a scalar.
#[derive(Debug)]
pub struct CrossEntropy;

impl OpDef for CrossEntropy {
    fn mnemonic(&self) -> &'static str {
        "cross_entropy"
    }
    fn summary(&self) -> &'static str {
        "mean over tokens of logsumexp(logits) - logits[target]; scalar result"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "logits", constraint: "L" }, Slot { name: "targets", constraint: "I" }],
            results: &[Slot { name: "loss", constraint: "S" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        let (logits, targets) = (inputs[0], inputs[1]);
        float("logits", logits)?;
        rank_at_least("logits", logits, 1)?;
        ids("targets", targets)?;
        if logits.shape[..logits.rank() - 1] != targets.shape[..] {
            return Err(format!("targets {targets} must match the leading dimensions of logits {logits}"));
        }
        Ok(vec![TensorTy::scalar(logits.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        // max, subtract, exp, sum per logit.
        Cost { flops: 4.0 * inputs[0].num_elements() as f64, bytes: io_bytes(inputs, outputs) }
    }
}
