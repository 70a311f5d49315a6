//! `xf.cross_entropy`: mean token cross-entropy of logits against targets, and its gradient.

use super::{arity, float, ids, io_bytes, rank_at_least, Cost, OpDef, Signature, Slot, VjpCx};
use crate::attrs::Attrs;
use crate::graph::Value;
use crate::sharding::{FactorKind, Linearity, ShardingRule};
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
        check_logits(inputs[0], inputs[1])?;
        Ok(vec![TensorTy::scalar(inputs[0].dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        // max, subtract, exp, sum per logit.
        Cost { flops: 4.0 * inputs[0].num_elements() as f64, bytes: io_bytes(inputs, outputs) }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let operands = [cx.operands[0], cx.operands[1], grads[0]];
        Ok(vec![Some(cx.emit("xf.cross_entropy_grad", &operands, Attrs::new())?), None])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Token dims are reductions (a split batch leaves the mean partial; partitioning
        // records the global token count so each rank divides by it); the vocab stays whole.
        let r = inputs[0].rank();
        let mut factors = vec![FactorKind::Free; r];
        factors[r - 1] = FactorKind::Blocked;
        ShardingRule { operands: vec![(0..r).collect(), (0..r - 1).collect()], results: vec![vec![]], factors, linearity: Linearity::None }
    }
}

fn check_logits(logits: &TensorTy, targets: &TensorTy) -> Result<(), String> {
    float("logits", logits)?;
    rank_at_least("logits", logits, 1)?;
    ids("targets", targets)?;
    if logits.shape[..logits.rank() - 1] != targets.shape[..] {
        return Err(format!("targets {targets} must match the leading dimensions of logits {logits}"));
    }
    Ok(())
}

/// `dlogits[t, :] = dloss * (softmax(logits[t, :]) - onehot(targets[t])) / tokens`.
#[derive(Debug)]
pub struct CrossEntropyGrad;

impl OpDef for CrossEntropyGrad {
    fn mnemonic(&self) -> &'static str {
        "cross_entropy_grad"
    }
    fn summary(&self) -> &'static str {
        "dloss * (softmax(logits) - onehot(targets)) / tokens"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "logits", constraint: "L" },
                Slot { name: "targets", constraint: "I" },
                Slot { name: "dloss", constraint: "S" },
            ],
            results: &[Slot { name: "dlogits", constraint: "L" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        check_logits(inputs[0], inputs[1])?;
        if *inputs[2] != TensorTy::scalar(inputs[0].dtype) {
            return Err(format!("dloss {} must be a scalar of the logits' type", inputs[2]));
        }
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        5.0
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        let r = inputs[0].rank();
        let mut factors = vec![FactorKind::Free; r];
        factors[r - 1] = FactorKind::Blocked;
        ShardingRule {
            operands: vec![(0..r).collect(), (0..r - 1).collect(), vec![]],
            results: vec![(0..r).collect()],
            factors,
            linearity: Linearity::None,
        }
    }
}
