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
        // records the global token count so each rank divides by it). A split vocabulary is
        // handled by partitioning the op into local max / sum-exp / target-logit pieces and
        // all-reduces of per-token values (vocab-parallel cross-entropy): no logits move.
        let r = inputs[0].rank();
        let mut factors = vec![FactorKind::Free; r];
        factors[r - 1] = FactorKind::Collective;
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
        factors[r - 1] = FactorKind::Collective;
        ShardingRule {
            operands: vec![(0..r).collect(), (0..r - 1).collect(), vec![]],
            results: vec![(0..r).collect()],
            factors,
            linearity: Linearity::None,
        }
    }
}

/// Checks `logits [..., v]` against per-token operands `[...]` of a vocab-parallel piece.
fn per_token(what: &str, logits: &TensorTy, t: &TensorTy) -> Result<(), String> {
    if t.shape[..] != logits.shape[..logits.rank() - 1] || t.dtype != logits.dtype {
        return Err(format!("{what} {t} must have the token dims of logits {logits}"));
    }
    Ok(())
}

/// Vocab-parallel cross-entropy, piece 1: `max[t] = max over this rank's vocab of logits`.
#[derive(Debug)]
pub struct RowMax;

impl OpDef for RowMax {
    fn mnemonic(&self) -> &'static str {
        "row_max"
    }
    fn summary(&self) -> &'static str {
        "maximum over the last dim (vocab-parallel cross-entropy)"
    }
    fn signature(&self) -> Signature {
        Signature { operands: &[Slot { name: "x", constraint: "T" }], results: &[Slot { name: "max", constraint: "U" }], attrs: &[] }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        float("x", inputs[0])?;
        rank_at_least("x", inputs[0], 1)?;
        Ok(vec![TensorTy::new(inputs[0].shape[..inputs[0].rank() - 1].to_vec(), inputs[0].dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        Cost { flops: inputs[0].num_elements() as f64, bytes: io_bytes(inputs, outputs) }
    }
}

/// Piece 2: with the global `max`, `sumexp[t] = sum over this rank's vocab of
/// exp(logits - max)` and `target[t]` = the target's logit if this rank holds it, else 0.
/// The rank's first vocab id comes from its coordinates (`xf.vocab_split_axes`).
#[derive(Debug)]
pub struct CrossEntropyStats;

impl OpDef for CrossEntropyStats {
    fn mnemonic(&self) -> &'static str {
        "cross_entropy_stats"
    }
    fn summary(&self) -> &'static str {
        "local sum of exp(logits - max) and the owned target logit (vocab-parallel cross-entropy)"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "logits", constraint: "L" },
                Slot { name: "targets", constraint: "I" },
                Slot { name: "max", constraint: "M" },
            ],
            results: &[Slot { name: "sumexp", constraint: "M" }, Slot { name: "target", constraint: "M" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        check_logits(inputs[0], inputs[1])?;
        per_token("max", inputs[0], inputs[2])?;
        Ok(vec![inputs[2].clone(), inputs[2].clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        Cost { flops: 3.0 * inputs[0].num_elements() as f64, bytes: io_bytes(inputs, outputs) }
    }
}

/// Piece 3: `loss = sum over tokens of (max + ln sumexp - target) / tokens` (the global
/// token count in `xf.tokens`).
#[derive(Debug)]
pub struct CrossEntropyFinish;

impl OpDef for CrossEntropyFinish {
    fn mnemonic(&self) -> &'static str {
        "cross_entropy_finish"
    }
    fn summary(&self) -> &'static str {
        "mean of max + ln(sumexp) - target (vocab-parallel cross-entropy)"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "max", constraint: "M" },
                Slot { name: "sumexp", constraint: "M" },
                Slot { name: "target", constraint: "M" },
            ],
            results: &[Slot { name: "loss", constraint: "S" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        float("max", inputs[0])?;
        if inputs[1] != inputs[0] || inputs[2] != inputs[0] {
            return Err("max, sumexp and target must have one type".into());
        }
        Ok(vec![TensorTy::scalar(inputs[0].dtype)])
    }
    fn flops_per_element(&self) -> f64 {
        3.0
    }
}

/// The gradient on this rank's vocab shard: `(exp(logits - max) / sumexp - onehot) * dloss /
/// tokens`, the one-hot set only where this rank holds the target.
#[derive(Debug)]
pub struct CrossEntropyGradShard;

impl OpDef for CrossEntropyGradShard {
    fn mnemonic(&self) -> &'static str {
        "cross_entropy_grad_shard"
    }
    fn summary(&self) -> &'static str {
        "cross-entropy gradient on a vocab shard from the global max and sumexp"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "logits", constraint: "L" },
                Slot { name: "targets", constraint: "I" },
                Slot { name: "dloss", constraint: "S" },
                Slot { name: "max", constraint: "M" },
                Slot { name: "sumexp", constraint: "M" },
            ],
            results: &[Slot { name: "dlogits", constraint: "L" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 5)?;
        check_logits(inputs[0], inputs[1])?;
        per_token("max", inputs[0], inputs[3])?;
        per_token("sumexp", inputs[0], inputs[4])?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        4.0
    }
}
