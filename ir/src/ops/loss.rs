//! `xf.cross_entropy`: mean token cross-entropy of logits against targets, and its gradient.

use crate::kernel::{elements, last, per_row, Arg, DeviceKernel, KernelCx, Launch};
use super::{arity, float, ids, io_bytes, rank_at_least, Cost, OpDef, Signature, Slot, VjpCx};
use crate::attrs::Attrs;
use crate::graph::Value;
use crate::sharding::{FactorKind, Linearity, ShardingRule};
use crate::types::TensorTy;

/// The type of the loss and of a row's statistics: fp32 for bf16 or fp32 logits (the loss is
/// computed in fp32 arithmetic from bf16 logits, as a fused cross-entropy does, with no fp32
/// copy of the logits), f64 for f64 ones.
fn statistics(logits: &TensorTy, shape: Vec<i64>) -> TensorTy {
    TensorTy::new(shape, super::attention::stats_dtype(logits))
}

/// `loss = mean_t (logsumexp(logits[t, :]) - logits[t, targets[t]])` over every token
/// position `t`; `logits [..., vocab]`, `targets [...]` (i32). The result is a scalar.
#[derive(Debug)]
pub struct CrossEntropy;

impl OpDef for CrossEntropy {
    fn mnemonic(&self) -> &'static str {
        "cross_entropy"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let v = last(cx.inputs[0]);
        let rows = elements(cx.inputs[0]) / v.max(1);
        let tokens = tokens(cx.attrs, rows);
        let row = Launch { workspace: rows, ..per_row("cross_entropy_rows", LOSS_CUDA, rows, vec![Arg::Workspace, Arg::In(0), Arg::In(1), Arg::Int(rows as i64), Arg::Int(v as i64), Arg::Int(classes(cx.attrs))]) };
        let mean = Launch { grid: [1, 1, 1], block: 32, workspace: rows, ..per_row("cross_entropy_mean", LOSS_CUDA, 1, vec![Arg::Out(0), Arg::Workspace, Arg::Int(rows as i64), Arg::Int(tokens)]) };
        Ok(DeviceKernel::Launches(vec![row, mean]))
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
        Ok(vec![statistics(inputs[0], Vec::new())])
    }
    fn statistics_slots(&self) -> &'static [usize] {
        // loss
        &[2]
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        // max, subtract, exp, sum per logit; an exp per logit and a log per row.
        let (n, rows) = (inputs[0].num_elements() as f64, inputs[1].num_elements() as f64);
        Cost { flops: 4.0 * n, bytes: io_bytes(inputs, outputs), special: n + rows }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let operands = [cx.operands[0], cx.operands[1], grads[0]];
        // A padded vocabulary's real class count goes with the gradient.
        let attrs = match cx.attrs.get("xf.classes") {
            Some(classes) => Attrs::new().with("xf.classes", classes.clone()),
            None => Attrs::new(),
        };
        Ok(vec![Some(cx.emit("xf.cross_entropy_grad", &operands, attrs)?), None])
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
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        ce_grad_launch(cx, false)
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
        if *inputs[2] != statistics(inputs[0], Vec::new()) {
            return Err(format!("dloss {} must be a scalar of the loss's type ({})", inputs[2], statistics(inputs[0], Vec::new())));
        }
        Ok(vec![inputs[0].clone()])
    }
    fn statistics_slots(&self) -> &'static [usize] {
        // dloss
        &[2]
    }
    fn special_per_element(&self) -> f64 {
        // The softmax recomputed: one exp per logit.
        1.0
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
    if *t != statistics(logits, logits.shape[..logits.rank() - 1].to_vec()) {
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
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let v = last(cx.inputs[0]);
        let rows = elements(cx.inputs[0]) / v.max(1);
        let first = if cx.attrs.get("xf.vocab_split_axes").is_some() { Arg::RankOffset } else { Arg::Int(0) };
        Ok(DeviceKernel::Launches(vec![per_row("row_max", LOSS_CUDA, rows, vec![Arg::Out(0), Arg::In(0), Arg::Int(rows as i64), Arg::Int(v as i64), first, Arg::Int(classes(cx.attrs))])]))
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
        Ok(vec![statistics(inputs[0], inputs[0].shape[..inputs[0].rank() - 1].to_vec())])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        Cost { flops: inputs[0].num_elements() as f64, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn statistics_slots(&self) -> &'static [usize] {
        // max
        &[1]
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
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let v = last(cx.inputs[0]);
        let rows = elements(cx.inputs[0]) / v.max(1);
        let args = vec![Arg::Out(0), Arg::Out(1), Arg::In(0), Arg::In(1), Arg::In(2), Arg::Int(rows as i64), Arg::Int(v as i64), Arg::RankOffset, Arg::Int(classes(cx.attrs))];
        Ok(DeviceKernel::Launches(vec![per_row("cross_entropy_stats", LOSS_CUDA, rows, args)]))
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
        // An exp per logit.
        Cost { flops: 3.0 * inputs[0].num_elements() as f64, bytes: io_bytes(inputs, outputs), special: inputs[0].num_elements() as f64 }
    }
    fn statistics_slots(&self) -> &'static [usize] {
        // max, sumexp, target
        &[2, 3, 4]
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
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let rows = elements(cx.inputs[0]);
        let args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), Arg::In(2), Arg::Int(rows as i64), Arg::Int(tokens(cx.attrs, rows))];
        Ok(DeviceKernel::Launches(vec![Launch { grid: [1, 1, 1], block: 32, ..per_row("cross_entropy_finish", LOSS_CUDA, 1, args) }]))
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
    fn statistics_slots(&self) -> &'static [usize] {
        // every operand and the loss
        &[0, 1, 2, 3]
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
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        ce_grad_launch(cx, true)
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
        if *inputs[2] != statistics(inputs[0], Vec::new()) {
            return Err(format!("dloss {} must be a scalar of the loss's type ({})", inputs[2], statistics(inputs[0], Vec::new())));
        }
        Ok(vec![inputs[0].clone()])
    }
    fn statistics_slots(&self) -> &'static [usize] {
        // dloss, max, sumexp
        &[2, 3, 4]
    }
    fn special_per_element(&self) -> f64 {
        // The softmax recomputed: one exp per logit.
        1.0
    }
    fn flops_per_element(&self) -> f64 {
        4.0
    }
}

/// CUDA C of this file's ops (see [`crate::kernel`]).
const LOSS_CUDA: &str = r#"#define LOSS_NAN ((acc_t)__int_as_float(0x7fc00000))
// Of a row of `v` logits starting at class `first`: how many are real classes (`classes`
// of a padded vocabulary; padded classes never enter the loss).
__device__ i64 real_classes(i64 classes, i64 first, i64 v) {
  i64 n = classes - first;
  return n < 0 ? 0 : (n < v ? n : v);
}
// A row's max and sum of exp(x - max) by the whole block in one pass over the row (online
// softmax: each thread rescales its running sum when its maximum grows), where two passes
// read a vocabulary-wide row twice.
__device__ void row_softmax_stats(const T* x, i64 n, acc_t* max_out, acc_t* sum_out) {
  acc_t mx = NEG_INF, sum = 0;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    acc_t v = load(x[j]);
    if (v > mx) { sum = sum * exp(mx - v) + (acc_t)1; mx = v; }
    // -inf adds nothing (exp(-inf - -inf) would be NaN, and NaN * 0 stays NaN); NaN still adds NaN.
    else if (v != NEG_INF) sum += exp(v - mx);
  }
  acc_t row_max = block_max(mx);
  // A thread that met no finite logit holds 0, or NaN if it met a NaN (which never raises
  // `mx`): keep that NaN, or a NaN logit alone in its thread would leave the loss finite.
  *sum_out = block_sum(mx == NEG_INF ? sum : sum * exp(mx - row_max));
  *max_out = row_max;
}
// Per row: its loss (logsumexp - target logit) into `row_loss`.
extern "C" __global__ void cross_entropy_rows(acc_t* row_loss, const T* logits, const int* targets, i64 rows, i64 v, i64 classes) {
  i64 r = ROW_INDEX;
  if (r >= rows) return;
  const T* x = logits + r * v;
  i64 n = real_classes(classes, 0, v);
  acc_t mx, sum;
  row_softmax_stats(x, n, &mx, &sum);
  if (threadIdx.x == 0) { i64 t = targets[r]; row_loss[r] = (t >= 0 && t < n) ? mx + log(sum) - load(x[t]) : LOSS_NAN; }
}
// The mean over `tokens` of per-row values, summed in row order by one thread.
extern "C" __global__ void cross_entropy_mean(acc_t* loss, const acc_t* row_loss, i64 rows, i64 tokens) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double total = 0;
  for (i64 r = 0; r < rows; r++) total += (double)row_loss[r];
  loss[0] = (acc_t)(total / (double)tokens);
}
// dlogits = softmax * dloss / tokens, minus that factor at the target. With `max_in` and
// `sumexp_in` (vocab-parallel), the row statistics come from the whole vocabulary and this
// rank's columns start at `first`.
extern "C" __global__ void cross_entropy_grad(T* g, const T* logits, const int* targets, const acc_t* dloss, const acc_t* max_in, const acc_t* sumexp_in, i64 rows, i64 v, i64 tokens, i64 first, i64 classes) {
  i64 r = ROW_INDEX;
  if (r >= rows) return;
  const T* x = logits + r * v;
  i64 n = real_classes(classes, first, v);
  acc_t mx, sum;
  if (max_in) { mx = max_in[r]; sum = sumexp_in[r]; }
  else row_softmax_stats(x, n, &mx, &sum);
  acc_t factor = dloss[0] / (acc_t)tokens;
  i64 t = (i64)targets[r] - first;
  for (i64 j = threadIdx.x; j < v; j += blockDim.x) g[r * v + j] = store(j < n ? exp(load(x[j]) - mx) / sum * factor - (j == t ? factor : (acc_t)0) : (acc_t)0);
}
extern "C" __global__ void row_max(acc_t* out, const T* x, i64 rows, i64 v, i64 first, i64 classes) {
  i64 r = ROW_INDEX;
  if (r >= rows) return;
  i64 n = real_classes(classes, first, v);
  acc_t mx = NEG_INF;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) mx = fmax(mx, load(x[r * v + j]));
  mx = block_max(mx);
  // A shard of padding only: the lowest finite float, below every real maximum, not -inf.
  if (n <= 0) mx = (acc_t)(-3.402823466e38f);
  if (threadIdx.x == 0) out[r] = mx;
}
// This rank's share of the row statistics: sum of exp(x - max) and the target's logit (0 if
// another rank holds it).
extern "C" __global__ void cross_entropy_stats(acc_t* sumexp, acc_t* target, const T* logits, const int* targets, const acc_t* max_in, i64 rows, i64 v, i64 first, i64 classes) {
  i64 r = ROW_INDEX;
  if (r >= rows) return;
  const T* x = logits + r * v;
  i64 n = real_classes(classes, first, v);
  acc_t mx = max_in[r], sum = 0;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) sum += exp(load(x[j]) - mx);
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    i64 t = (i64)targets[r] - first;
    sumexp[r] = sum;
    target[r] = (t >= 0 && t < v) ? load(x[t]) : (acc_t)0;
  }
}
extern "C" __global__ void cross_entropy_finish(acc_t* loss, const acc_t* mx, const acc_t* sumexp, const acc_t* target, i64 rows, i64 tokens) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double total = 0;
  for (i64 r = 0; r < rows; r++) total += (double)(mx[r] + log(sumexp[r]) - target[r]);
  loss[0] = (acc_t)(total / (double)tokens);
}
"#;

/// Real classes of a padded vocabulary (`xf.classes`); without it, every class is.
fn classes(attrs: &Attrs) -> i64 {
    attrs.int("xf.classes").unwrap_or(i64::MAX)
}

/// Tokens the mean loss divides by: the global count when the batch is split over ranks.
fn tokens(attrs: &Attrs, local: usize) -> i64 {
    attrs.int("xf.tokens").unwrap_or(local as i64).max(1)
}

/// `cross_entropy_grad`, or with `shard` its vocab-parallel form reading the global row
/// statistics (operands 3 and 4).
fn ce_grad_launch(cx: &KernelCx<'_>, shard: bool) -> Result<DeviceKernel, String> {
    let v = last(cx.inputs[0]);
    let rows = elements(cx.inputs[0]) / v.max(1);
    let (max, sumexp, first) = if shard { (Arg::In(3), Arg::In(4), Arg::RankOffset) } else { (Arg::Null, Arg::Null, Arg::Int(0)) };
    let args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), Arg::In(2), max, sumexp, Arg::Int(rows as i64), Arg::Int(v as i64), Arg::Int(tokens(cx.attrs, rows)), first, Arg::Int(classes(cx.attrs))];
    Ok(DeviceKernel::Launches(vec![per_row("cross_entropy_grad", LOSS_CUDA, rows, args)]))
}
