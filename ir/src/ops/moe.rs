//! Mixture of experts: routing, the permutation of tokens into per-expert buffers and back, the
//! grouped expert GEMM, and the load-balancing loss, each with its gradient.
//!
//! Shapes stay static. Tokens `x [B, S, d]` are routed per sequence: each sequence (row `b`)
//! gives every expert `C` slots (`capacity`; dropless routing takes `C = S`, so no token is
//! ever dropped), and the experts' inputs are one buffer `[E, B, C, d]`. A slot past an
//! expert's count holds zeros, and the grouped GEMM (`xf.expert_matmul`) reads the counts
//! `[E, B]` and multiplies only the rows that hold tokens, so its work is that of the routed
//! tokens (`B x S x k` rows when dropless), not of the buffer.
//!
//! Routing per sequence keeps the batch a plain batch dimension: splitting it over data
//! parallel ranks changes nothing of which token goes where, so a partitioned step routes
//! exactly as one device does (and drops the same tokens under a capacity). For the same
//! reason the load-balancing loss is the sequence-wise one of DeepSeek-V3: the Switch
//! Transformer loss of each sequence (the model adds their mean).

use super::{arity, float, ids, io_bytes, positive, rank_is, AttrKind, Cost, KernelClass, OpDef, Signature, Slot, VjpCx};
use crate::kernel::{elements, flat, Arg, DeviceKernel, KernelCx, Launch};
use crate::attrs::{AttrValue, Attrs};
use crate::graph::Value;
use crate::sharding::{FactorKind, Linearity, ShardingRule};
use crate::types::{DType, TensorTy};

use FactorKind::{Blocked, Free};

/// Checks `experts`/`slots`-like i32 operands `[B, S, k]`.
fn assignments(what: &str, t: &TensorTy) -> Result<(), String> {
    ids(what, t)?;
    rank_is(what, t, 3)
}

/// Checks that `a` and `b` have equal shapes.
fn same_shape(what: &str, a: &TensorTy, other: &str, b: &TensorTy) -> Result<(), String> {
    if a.shape == b.shape { Ok(()) } else { Err(format!("{what} {a} must have the shape of {other} {b}")) }
}

/// Checks a per-expert buffer `[E, B, C, d]` against tokens' assignments `[B, S, k]`.
fn buffer(buf: &TensorTy, experts: &TensorTy) -> Result<(), String> {
    float("buffer", buf)?;
    rank_is("buffer", buf, 4)?;
    if buf.shape[1] != experts.shape[0] {
        return Err(format!("buffer {buf} must have the batch of experts {experts} as its dimension 1"));
    }
    Ok(())
}

/// `xf.moe_route`: softmax top-k gating. For each token, the `top_k` largest router logits
/// (ties to the lower expert) pick its experts, best first, and their softmax over just
/// those logits weighs them (Mixtral's gates: the softmax over all experts, renormalised over
/// the chosen).
#[derive(Debug)]
pub struct MoeRoute;

impl OpDef for MoeRoute {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (e, k) = (cx.inputs[0].shape[2], cx.attrs.int("top_k")?);
        let tokens = elements(cx.inputs[0]) / e.max(1) as usize;
        let args = vec![Arg::Out(0), Arg::Out(1), Arg::In(0), Arg::Int(tokens as i64), Arg::Int(e), Arg::Int(k)];
        Ok(DeviceKernel::Launches(vec![flat("moe_route", MOE_CUDA, tokens, args)]))
    }
    fn mnemonic(&self) -> &'static str {
        "moe_route"
    }
    fn summary(&self) -> &'static str {
        "top-k gating: experts = argtop_k(logits), gates = softmax over the chosen logits"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "logits", constraint: "L" }],
            results: &[Slot { name: "gates", constraint: "G" }, Slot { name: "experts", constraint: "I" }],
            attrs: &[("top_k", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        let logits = inputs[0];
        float("logits", logits)?;
        rank_is("logits", logits, 3)?;
        let k = positive("top_k", attrs.int("top_k")?)?;
        if k > logits.shape[2] {
            return Err(format!("attribute `top_k` ({k}) exceeds the {} experts of logits {logits}", logits.shape[2]));
        }
        let (b, s) = (logits.shape[0], logits.shape[1]);
        Ok(vec![TensorTy::new([b, s, k], logits.dtype), TensorTy::new([b, s, k], DType::I32)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        // A pass over each row per choice, and an exponential per choice.
        let (logits, gates) = (inputs[0].num_elements() as f64, outputs[0].num_elements() as f64);
        let k = outputs[0].shape.last().copied().unwrap_or(1) as f64;
        Cost { flops: logits * k + 4.0 * gates, bytes: io_bytes(inputs, outputs), special: gates }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let experts = cx.ty(cx.operands[0])?.shape[2];
        let (gates, chosen) = (cx.results[0], cx.results[1]);
        let d = cx.emit("xf.moe_route_grad", &[gates, chosen, grads[0]], Attrs::new().with("experts", AttrValue::Int(experts)))?;
        Ok(vec![Some(d)])
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Factors: batch (0), sequence (1) pass; the experts (2) and choices (3) stay whole.
        ShardingRule { operands: vec![vec![0, 1, 2]], results: vec![vec![0, 1, 3], vec![0, 1, 3]], factors: vec![Free, Free, Blocked, Blocked], linearity: Linearity::None }
    }
}

/// `xf.moe_route_grad`: the gradient of the gates with respect to the router logits:
/// `dlogits[e_j] = g_j (dg_j - sum_i g_i dg_i)` at the chosen experts, zero elsewhere.
#[derive(Debug)]
pub struct MoeRouteGrad;

impl OpDef for MoeRouteGrad {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (e, k) = (cx.attrs.int("experts")?, cx.inputs[0].shape[2]);
        let tokens = elements(cx.inputs[0]) / k.max(1) as usize;
        let args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), Arg::In(2), Arg::Int(tokens as i64), Arg::Int(e), Arg::Int(k)];
        Ok(DeviceKernel::Launches(vec![flat("moe_route_grad", MOE_CUDA, tokens, args)]))
    }
    fn mnemonic(&self) -> &'static str {
        "moe_route_grad"
    }
    fn summary(&self) -> &'static str {
        "gradient of top-k gating: dlogits[experts] = gates * (dgates - <gates, dgates>)"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "gates", constraint: "G" }, Slot { name: "experts", constraint: "I" }, Slot { name: "dgates", constraint: "G" }],
            results: &[Slot { name: "dlogits", constraint: "L" }],
            attrs: &[("experts", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        let (gates, experts, dgates) = (inputs[0], inputs[1], inputs[2]);
        float("gates", gates)?;
        assignments("experts", experts)?;
        same_shape("experts", experts, "gates", gates)?;
        same_shape("dgates", dgates, "gates", gates)?;
        let e = positive("experts", attrs.int("experts")?)?;
        Ok(vec![TensorTy::new([gates.shape[0], gates.shape[1], e], gates.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        Cost { flops: 4.0 * inputs[0].num_elements() as f64, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule { operands: vec![vec![0, 1, 2]; 3], results: vec![vec![0, 1, 3]], factors: vec![Free, Free, Blocked, Blocked], linearity: Linearity::None }
    }
}

/// `xf.moe_aux_loss`: the load-balancing loss of each sequence `b`:
/// `loss[b] = E / (S k) sum_e count[b, e] P[b, e]`, where `count[b, e]` is how many of the
/// sequence's `S x k` choices picked expert `e` and `P[b, e]` the mean over its tokens of the
/// softmax over all `E` router logits (Switch Transformer's loss, 1 for a uniform router; the
/// sequence-wise form of DeepSeek-V3). Only `P` carries a gradient.
#[derive(Debug)]
pub struct MoeAuxLoss;

impl OpDef for MoeAuxLoss {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (b, s, e) = (cx.inputs[0].shape[0], cx.inputs[0].shape[1], cx.inputs[0].shape[2]);
        let k = cx.inputs[1].shape[2];
        let counts = aux_counts(b, s, e, k);
        let args = vec![Arg::Out(0), Arg::In(0), Arg::Workspace, Arg::Int(b), Arg::Int(s), Arg::Int(e), Arg::Int(k)];
        Ok(DeviceKernel::Launches(vec![counts, Launch { workspace: (b * e) as usize, ..flat("moe_aux_loss", MOE_CUDA, b as usize, args) }]))
    }
    fn mnemonic(&self) -> &'static str {
        "moe_aux_loss"
    }
    fn summary(&self) -> &'static str {
        "load-balancing loss per sequence: E/(S k) sum_e count_e * mean_s softmax(logits)_e"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "logits", constraint: "L" }, Slot { name: "experts", constraint: "I" }],
            results: &[Slot { name: "loss", constraint: "O" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        let (logits, experts) = (inputs[0], inputs[1]);
        float("logits", logits)?;
        rank_is("logits", logits, 3)?;
        assignments("experts", experts)?;
        if experts.shape[..2] != logits.shape[..2] {
            return Err(format!("experts {experts} must have the batch and sequence of logits {logits}"));
        }
        Ok(vec![TensorTy::new([logits.shape[0]], logits.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        let n = inputs[0].num_elements() as f64;
        Cost { flops: 5.0 * n, bytes: io_bytes(inputs, outputs), special: n }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let d = cx.emit("xf.moe_aux_loss_grad", &[cx.operands[0], cx.operands[1], grads[0]], Attrs::new())?;
        Ok(vec![Some(d), None])
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // The batch (0) passes. A sequence's tokens (1), the experts (2) and the choices (3)
        // meet in a product of sums: whole.
        ShardingRule { operands: vec![vec![0, 1, 2], vec![0, 1, 3]], results: vec![vec![0]], factors: vec![Free, Blocked, Blocked, Blocked], linearity: Linearity::None }
    }
}

/// `xf.moe_aux_loss_grad`: the load-balancing loss's gradient with respect to the router
/// logits: each sequence's `dloss[b]` times the softmax's Jacobian applied to
/// `E count[b, e] / (S^2 k)`.
#[derive(Debug)]
pub struct MoeAuxLossGrad;

impl OpDef for MoeAuxLossGrad {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (b, s, e) = (cx.inputs[0].shape[0], cx.inputs[0].shape[1], cx.inputs[0].shape[2]);
        let k = cx.inputs[1].shape[2];
        let counts = aux_counts(b, s, e, k);
        let args = vec![Arg::Out(0), Arg::In(0), Arg::In(2), Arg::Workspace, Arg::Int(b), Arg::Int(s), Arg::Int(e), Arg::Int(k)];
        Ok(DeviceKernel::Launches(vec![counts, Launch { workspace: (b * e) as usize, ..flat("moe_aux_loss_grad", MOE_CUDA, (b * s) as usize, args) }]))
    }
    fn mnemonic(&self) -> &'static str {
        "moe_aux_loss_grad"
    }
    fn summary(&self) -> &'static str {
        "gradient of the load-balancing loss with respect to the router logits"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "logits", constraint: "L" }, Slot { name: "experts", constraint: "I" }, Slot { name: "dloss", constraint: "O" }],
            results: &[Slot { name: "dlogits", constraint: "L" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        MoeAuxLoss.infer(&inputs[..2], attrs)?;
        if inputs[2].shape[..] != [inputs[0].shape[0]] {
            return Err(format!("dloss {} must hold one value per sequence of logits {}", inputs[2], inputs[0]));
        }
        Ok(vec![inputs[0].clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        let n = inputs[0].num_elements() as f64;
        Cost { flops: 7.0 * n, bytes: io_bytes(inputs, outputs), special: n }
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule { operands: vec![vec![0, 1, 2], vec![0, 1, 3], vec![0]], results: vec![vec![0, 1, 2]], factors: vec![Free, Blocked, Blocked, Blocked], linearity: Linearity::None }
    }
}

/// `xf.moe_slots`: each choice's slot in its expert's buffer of `capacity` rows per sequence,
/// and how many rows of each buffer hold tokens. Within a sequence, first choices take slots
/// before second choices (as GShard and Switch give them priority), each in the order of the
/// tokens' positions (a sequence held in zigzag order says so in `xf.zigzag`, so context
/// parallelism drops what one device drops); a choice past its expert's capacity is dropped
/// (slot -1). `counts[e, b] = min(choices, C)`.
#[derive(Debug)]
pub struct MoeSlots;

impl OpDef for MoeSlots {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (b, s, k) = (cx.inputs[0].shape[0], cx.inputs[0].shape[1], cx.inputs[0].shape[2]);
        let (chunks, _) = super::zigzag_of(cx.attrs.ints(super::ZIGZAG_ATTR).ok().as_deref());
        let args = vec![Arg::Out(0), Arg::Out(1), Arg::In(0), Arg::Int(b), Arg::Int(s), Arg::Int(k), Arg::Int(cx.attrs.int("experts")?), Arg::Int(cx.attrs.int("capacity")?), Arg::Int(chunks as i64)];
        Ok(DeviceKernel::Launches(vec![flat("moe_slots", MOE_CUDA, b as usize, args)]))
    }
    fn mnemonic(&self) -> &'static str {
        "moe_slots"
    }
    fn summary(&self) -> &'static str {
        "slot of each choice in its expert's buffer (-1: dropped past capacity), and rows per buffer"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "experts", constraint: "I" }],
            results: &[Slot { name: "slots", constraint: "I" }, Slot { name: "counts", constraint: "C" }],
            attrs: &[("experts", AttrKind::Int), ("capacity", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        assignments("experts", inputs[0])?;
        let e = positive("experts", attrs.int("experts")?)?;
        positive("capacity", attrs.int("capacity")?)?;
        Ok(vec![inputs[0].clone(), TensorTy::new([e, inputs[0].shape[0]], DType::I32)])
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // The batch (0) passes; slots are handed out in order along the sequence (1) and the
        // choices (2); the counts' expert dimension (3) has no operand.
        ShardingRule { operands: vec![vec![0, 1, 2]], results: vec![vec![0, 1, 2], vec![3, 0]], factors: vec![Free, Blocked, Blocked, Blocked], linearity: Linearity::None }
    }
}

/// Checks `x [B, S, d]`, `experts` and `slots` `[B, S, k]` of a dispatch or combine.
fn tokens_and_slots(x: &TensorTy, experts: &TensorTy, slots: &TensorTy) -> Result<(), String> {
    float("x", x)?;
    rank_is("x", x, 3)?;
    assignments("experts", experts)?;
    same_shape("slots", slots, "experts", experts)?;
    if experts.shape[..2] != x.shape[..2] {
        return Err(format!("experts {experts} must have the batch and sequence of {x}"));
    }
    Ok(())
}

/// Buffer rule shared by dispatch, collect and combine: factors batch (0), sequence (1),
/// hidden (2), choices (3), experts (4), slots (5).
const BUF: [usize; 4] = [4, 0, 5, 2];
const TOKENS: [usize; 3] = [0, 1, 2];
const CHOICES: [usize; 3] = [0, 1, 3];
const PERMUTE_FACTORS: [FactorKind; 6] = [Free, Blocked, Free, Blocked, Blocked, Blocked];

/// `xf.moe_dispatch`: tokens into per-expert buffers: `buf[e_j, b, slot_j, :] = x[b, s, :]`
/// for every kept choice, zeros in the unused slots.
#[derive(Debug)]
pub struct MoeDispatch;

impl OpDef for MoeDispatch {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (b, s, d) = (cx.inputs[0].shape[0], cx.inputs[0].shape[1], cx.inputs[0].shape[2]);
        let k = cx.inputs[1].shape[2];
        let (e, c) = (cx.attrs.int("experts")?, cx.attrs.int("capacity")?);
        let zero = flat("shardc_fill_zero", "", elements(&cx.outputs[0]), vec![Arg::Out(0), Arg::Int(e * b * c * d)]);
        let args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), Arg::In(2), Arg::Int(b), Arg::Int(s), Arg::Int(k), Arg::Int(d), Arg::Int(e), Arg::Int(c)];
        Ok(DeviceKernel::Launches(vec![zero, flat("moe_dispatch", MOE_CUDA, (b * s * k * d) as usize, args)]))
    }
    fn mnemonic(&self) -> &'static str {
        "moe_dispatch"
    }
    fn summary(&self) -> &'static str {
        "permute tokens into per-expert buffers: buf[experts, b, slots, :] = x[b, s, :]"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "X" }, Slot { name: "experts", constraint: "I" }, Slot { name: "slots", constraint: "I" }],
            results: &[Slot { name: "buffer", constraint: "B" }],
            attrs: &[("experts", AttrKind::Int), ("capacity", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        let (x, experts, slots) = (inputs[0], inputs[1], inputs[2]);
        tokens_and_slots(x, experts, slots)?;
        let e = positive("experts", attrs.int("experts")?)?;
        let c = positive("capacity", attrs.int("capacity")?)?;
        Ok(vec![TensorTy::new([e, x.shape[0], c, x.shape[2]], x.dtype)])
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let dx = cx.emit("xf.moe_collect", &[grads[0], cx.operands[1], cx.operands[2]], Attrs::new())?;
        Ok(vec![Some(dx), None, None])
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule { operands: vec![TOKENS.to_vec(), CHOICES.to_vec(), CHOICES.to_vec()], results: vec![BUF.to_vec()], factors: PERMUTE_FACTORS.to_vec(), linearity: Linearity::Sum }
    }
}

/// `xf.moe_collect`: the dispatch's adjoint: `y[b, s, :] = sum over kept choices j of
/// buf[e_j, b, slot_j, :]`.
#[derive(Debug)]
pub struct MoeCollect;

impl OpDef for MoeCollect {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Launches(vec![gather_launch(cx, Arg::Null, 1, 2)]))
    }
    fn mnemonic(&self) -> &'static str {
        "moe_collect"
    }
    fn summary(&self) -> &'static str {
        "sum each token's rows back out of per-expert buffers (the adjoint of moe_dispatch)"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "buffer", constraint: "B" }, Slot { name: "experts", constraint: "I" }, Slot { name: "slots", constraint: "I" }],
            results: &[Slot { name: "y", constraint: "X" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        let (buf, experts, slots) = (inputs[0], inputs[1], inputs[2]);
        assignments("experts", experts)?;
        same_shape("slots", slots, "experts", experts)?;
        buffer(buf, experts)?;
        Ok(vec![TensorTy::new([experts.shape[0], experts.shape[1], buf.shape[3]], buf.dtype)])
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule { operands: vec![BUF.to_vec(), CHOICES.to_vec(), CHOICES.to_vec()], results: vec![TOKENS.to_vec()], factors: PERMUTE_FACTORS.to_vec(), linearity: Linearity::Sum }
    }
}

/// `xf.moe_combine`: the experts' outputs back to their tokens, weighed by the gates:
/// `y[b, s, :] = sum over kept choices j of gates[b, s, j] buf[e_j, b, slot_j, :]` (a dropped
/// choice adds nothing).
#[derive(Debug)]
pub struct MoeCombine;

impl OpDef for MoeCombine {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Launches(vec![gather_launch(cx, Arg::In(1), 2, 3)]))
    }
    fn mnemonic(&self) -> &'static str {
        "moe_combine"
    }
    fn summary(&self) -> &'static str {
        "unpermute expert outputs, weighed by gates: y[b, s, :] = sum_j gates_j buf[experts_j, b, slots_j, :]"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "buffer", constraint: "B" },
                Slot { name: "gates", constraint: "G" },
                Slot { name: "experts", constraint: "I" },
                Slot { name: "slots", constraint: "I" },
            ],
            results: &[Slot { name: "y", constraint: "X" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 4)?;
        let (buf, gates, experts, slots) = (inputs[0], inputs[1], inputs[2], inputs[3]);
        float("gates", gates)?;
        assignments("experts", experts)?;
        same_shape("gates", gates, "experts", experts)?;
        same_shape("slots", slots, "experts", experts)?;
        buffer(buf, experts)?;
        Ok(vec![TensorTy::new([experts.shape[0], experts.shape[1], buf.shape[3]], buf.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        // A multiply-add per element of every choice's row.
        let k = inputs[1].shape.last().copied().unwrap_or(1) as f64;
        Cost { flops: 2.0 * k * outputs[0].num_elements() as f64, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let (buf, gates, experts, slots) = (cx.operands[0], cx.operands[1], cx.operands[2], cx.operands[3]);
        let d = cx.emit_multi("xf.moe_combine_grad", &[buf, gates, experts, slots, grads[0]], Attrs::new())?;
        Ok(vec![Some(d[0]), Some(d[1]), None, None])
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule { operands: vec![BUF.to_vec(), CHOICES.to_vec(), CHOICES.to_vec(), CHOICES.to_vec()], results: vec![TOKENS.to_vec()], factors: PERMUTE_FACTORS.to_vec(), linearity: Linearity::Product }
    }
}

/// `xf.moe_combine_grad`: the combine's gradients: `dbuf[e_j, b, slot_j, :] = gates_j
/// dy[b, s, :]` (zeros elsewhere) and `dgates_j = <dy[b, s, :], buf[e_j, b, slot_j, :]>`.
#[derive(Debug)]
pub struct MoeCombineGrad;

impl OpDef for MoeCombineGrad {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let buf = cx.inputs[0];
        let (e, c, d) = (buf.shape[0], buf.shape[2], buf.shape[3]);
        let (b, s, k) = (cx.inputs[2].shape[0], cx.inputs[2].shape[1], cx.inputs[2].shape[2]);
        let zero = flat("shardc_fill_zero", "", elements(&cx.outputs[0]), vec![Arg::Out(0), Arg::Int(e * b * c * d)]);
        let dims = [Arg::Int(b), Arg::Int(s), Arg::Int(k), Arg::Int(d), Arg::Int(e), Arg::Int(c)];
        let mut scatter = vec![Arg::Out(0), Arg::In(4), Arg::In(1), Arg::In(2), Arg::In(3)];
        scatter.extend(dims.clone());
        let mut gates = vec![Arg::Out(1), Arg::In(0), Arg::In(4), Arg::In(2), Arg::In(3)];
        gates.extend(dims);
        Ok(DeviceKernel::Launches(vec![zero, flat("moe_dispatch_weighted", MOE_CUDA, (b * s * k * d) as usize, scatter), flat("moe_gate_grad", MOE_CUDA, (b * s * k) as usize, gates)]))
    }
    fn mnemonic(&self) -> &'static str {
        "moe_combine_grad"
    }
    fn summary(&self) -> &'static str {
        "gradients of moe_combine: dbuf = gates * dy in the choices' slots, dgates = <dy, buf row>"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "buffer", constraint: "B" },
                Slot { name: "gates", constraint: "G" },
                Slot { name: "experts", constraint: "I" },
                Slot { name: "slots", constraint: "I" },
                Slot { name: "dy", constraint: "X" },
            ],
            results: &[Slot { name: "dbuffer", constraint: "B" }, Slot { name: "dgates", constraint: "G" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 5)?;
        let y = MoeCombine.infer(&inputs[..4], attrs)?;
        same_shape("dy", inputs[4], "the combined tokens", &y[0])?;
        Ok(vec![inputs[0].clone(), inputs[1].clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        let k = inputs[1].shape.last().copied().unwrap_or(1) as f64;
        Cost { flops: 4.0 * k * inputs[4].num_elements() as f64, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // dgates sums over the hidden dimension while dbuf keeps it: hidden stays whole.
        let mut factors = PERMUTE_FACTORS.to_vec();
        factors[2] = Blocked;
        ShardingRule {
            operands: vec![BUF.to_vec(), CHOICES.to_vec(), CHOICES.to_vec(), CHOICES.to_vec(), TOKENS.to_vec()],
            results: vec![BUF.to_vec(), CHOICES.to_vec()],
            factors,
            linearity: Linearity::None,
        }
    }
}

/// The rows of an expert buffer `[E, B, C, _]` that hold tokens, for the cost model: each
/// sequence routes `routed` choices (`S x k`) over `experts_total` experts, so a buffer of
/// `C` slots per (expert, sequence) holds `min(C, routed / experts_total)` of them on average
/// (exactly so when dropless and balanced; the kernels skip the empty rows).
fn routed_rows(buf: &TensorTy, attrs: &Attrs) -> f64 {
    let (e, b, c) = (buf.shape[0] as f64, buf.shape[1] as f64, buf.shape[2] as f64);
    let routed = attrs.int("routed").unwrap_or(i64::MAX) as f64;
    let total = attrs.int("experts_total").unwrap_or(1).max(1) as f64;
    e * b * c.min(routed / total)
}

/// Checks a grouped GEMM's buffer `[E, B, C, m]` and counts `[E, B]`.
fn grouped(x: &TensorTy, counts: &TensorTy) -> Result<(), String> {
    float("x", x)?;
    rank_is("x", x, 4)?;
    ids("counts", counts)?;
    if counts.shape[..] != x.shape[..2] {
        return Err(format!("counts {counts} must be the [experts, batch] of {x}"));
    }
    Ok(())
}

/// `xf.expert_matmul`: the grouped GEMM of the experts:
/// `out[e, b, r, :] = x[e, b, r, :] @ w[e]` for the rows `r < counts[e, b]` that hold tokens,
/// zeros for the rest. `w` is `[E, m, n]` (`[E, n, m]` with `transpose_rhs`, as the input
/// gradient reads it). `routed` and `experts_total` say how full the buffers are, for the cost.
#[derive(Debug)]
pub struct ExpertMatMul;

impl ExpertMatMul {
    fn dims(inputs: &[&TensorTy], attrs: &Attrs) -> Result<(i64, i64), String> {
        let (x, w, counts) = (inputs[0], inputs[1], inputs[2]);
        grouped(x, counts)?;
        float("w", w)?;
        rank_is("w", w, 3)?;
        if w.dtype != x.dtype {
            return Err(format!("element types differ: {x} and {w}"));
        }
        let (wm, wn) = if attrs.bool("transpose_rhs")? { (w.shape[2], w.shape[1]) } else { (w.shape[1], w.shape[2]) };
        if w.shape[0] != x.shape[0] || wm != x.shape[3] {
            return Err(format!("w {w} must hold one [{}, n] matrix per expert of {x}", x.shape[3]));
        }
        positive("routed", attrs.int("routed")?)?;
        positive("experts_total", attrs.int("experts_total")?)?;
        Ok((wm, wn))
    }
}

impl OpDef for ExpertMatMul {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let x = cx.inputs[0];
        let (e, b, c, m) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
        let n = cx.outputs[0].shape[3];
        let transposed = i64::from(cx.attrs.bool("transpose_rhs")?);
        let args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), Arg::In(2), Arg::Int(e * b), Arg::Int(b), Arg::Int(c), Arg::Int(m), Arg::Int(n), Arg::Int(transposed)];
        Ok(DeviceKernel::Launches(vec![flat("expert_matmul", MOE_CUDA, elements(&cx.outputs[0]), args)]))
    }
    fn mnemonic(&self) -> &'static str {
        "expert_matmul"
    }
    fn summary(&self) -> &'static str {
        "grouped expert GEMM: out[e, b, r] = x[e, b, r] @ w[e] for rows r < counts[e, b], zeros after"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "X" }, Slot { name: "w", constraint: "W" }, Slot { name: "counts", constraint: "C" }],
            results: &[Slot { name: "out", constraint: "Y" }],
            attrs: &[("transpose_rhs", AttrKind::Bool), ("routed", AttrKind::Int), ("experts_total", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        let (_, n) = ExpertMatMul::dims(inputs, attrs)?;
        let x = inputs[0];
        Ok(vec![TensorTy::new([x.shape[0], x.shape[1], x.shape[2], n], x.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], attrs: &Attrs) -> Cost {
        let (m, n) = (inputs[0].shape[3] as f64, outputs[0].shape[3] as f64);
        Cost { flops: 2.0 * routed_rows(inputs[0], attrs) * m * n, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn kernel_class(&self, inputs: &[&TensorTy], attrs: &Attrs) -> KernelClass {
        let Ok((m, n)) = ExpertMatMul::dims(inputs, attrs) else { return KernelClass::Memory };
        let e = inputs[0].shape[0] as f64;
        KernelClass::Gemm { batch: e, m: routed_rows(inputs[0], attrs) / e, n: n as f64, k: m as f64 }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        if cx.attrs.bool("transpose_rhs")? {
            return Err("the VJP of a transposed expert_matmul is not defined (only the backward emits one)".into());
        }
        let (x, w, counts, dy) = (cx.operands[0], cx.operands[1], cx.operands[2], grads[0]);
        let dx = cx.emit("xf.expert_matmul", &[dy, w, counts], cx.attrs.clone().with("transpose_rhs", AttrValue::Bool(true)))?;
        let dw_attrs = Attrs::new().with("routed", cx.attrs.get("routed").cloned().unwrap_or(AttrValue::Int(1))).with("experts_total", cx.attrs.get("experts_total").cloned().unwrap_or(AttrValue::Int(1)));
        let dw = cx.emit("xf.expert_matmul_wgrad", &[x, dy, counts], dw_attrs)?;
        Ok(vec![Some(dx), Some(dw), None])
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], attrs: &Attrs) -> ShardingRule {
        // Factors: experts (0), batch (1), slots (2), contracted (3, a sum), outputs (4).
        let w = if attrs.bool("transpose_rhs").unwrap_or(false) { vec![0, 4, 3] } else { vec![0, 3, 4] };
        ShardingRule { operands: vec![vec![0, 1, 2, 3], w, vec![0, 1]], results: vec![vec![0, 1, 2, 4]], factors: vec![Free; 5], linearity: Linearity::Product }
    }
}

/// `xf.expert_matmul_wgrad`: the experts' weight gradients, `dw[e] = sum over b and the rows
/// r < counts[e, b] of x[e, b, r, :]^T dy[e, b, r, :]`.
#[derive(Debug)]
pub struct ExpertMatMulWeightGrad;

impl OpDef for ExpertMatMulWeightGrad {
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let x = cx.inputs[0];
        let (e, b, c, m) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
        let n = cx.inputs[1].shape[3];
        let args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), Arg::In(2), Arg::Int(e), Arg::Int(b), Arg::Int(c), Arg::Int(m), Arg::Int(n)];
        Ok(DeviceKernel::Launches(vec![flat("expert_matmul_wgrad", MOE_CUDA, elements(&cx.outputs[0]), args)]))
    }
    fn mnemonic(&self) -> &'static str {
        "expert_matmul_wgrad"
    }
    fn summary(&self) -> &'static str {
        "weight gradient of the grouped expert GEMM: dw[e] = sum_b x[e, b]^T dy[e, b] over filled rows"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "X" }, Slot { name: "dy", constraint: "Y" }, Slot { name: "counts", constraint: "C" }],
            results: &[Slot { name: "dw", constraint: "W" }],
            attrs: &[("routed", AttrKind::Int), ("experts_total", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        let (x, dy, counts) = (inputs[0], inputs[1], inputs[2]);
        grouped(x, counts)?;
        float("dy", dy)?;
        rank_is("dy", dy, 4)?;
        if dy.shape[..3] != x.shape[..3] || dy.dtype != x.dtype {
            return Err(format!("dy {dy} must match x {x} but in its last dimension"));
        }
        positive("routed", attrs.int("routed")?)?;
        positive("experts_total", attrs.int("experts_total")?)?;
        Ok(vec![TensorTy::new([x.shape[0], x.shape[3], dy.shape[3]], x.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], attrs: &Attrs) -> Cost {
        let (m, n) = (inputs[0].shape[3] as f64, inputs[1].shape[3] as f64);
        Cost { flops: 2.0 * routed_rows(inputs[0], attrs) * m * n, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn kernel_class(&self, inputs: &[&TensorTy], attrs: &Attrs) -> KernelClass {
        let e = inputs[0].shape[0] as f64;
        KernelClass::Gemm { batch: e, m: inputs[0].shape[3] as f64, n: inputs[1].shape[3] as f64, k: routed_rows(inputs[0], attrs) / e }
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Batch (1) and slots (2) are sums: split, the gradient comes out partial.
        ShardingRule { operands: vec![vec![0, 1, 2, 3], vec![0, 1, 2, 4], vec![0, 1]], results: vec![vec![0, 3, 4]], factors: vec![Free; 5], linearity: Linearity::Product }
    }
}

/// The per-sequence expert counts of the load-balancing loss and its gradient, into the
/// workspace (`[B, E]`, as `acc_t`).
fn aux_counts(b: i64, s: i64, e: i64, k: i64) -> Launch {
    let args = vec![Arg::Workspace, Arg::In(1), Arg::Int(b), Arg::Int(s), Arg::Int(e), Arg::Int(k)];
    Launch { workspace: (b * e) as usize, ..flat("moe_aux_counts", MOE_CUDA, b as usize, args) }
}

/// `moe_collect` (no gates) or `moe_combine`: each token's rows summed back from the buffer.
fn gather_launch(cx: &KernelCx<'_>, gates: Arg, experts: usize, slots: usize) -> Launch {
    let buf = cx.inputs[0];
    let (e, c, d) = (buf.shape[0], buf.shape[2], buf.shape[3]);
    let (b, s, k) = (cx.inputs[experts].shape[0], cx.inputs[experts].shape[1], cx.inputs[experts].shape[2]);
    let args = vec![Arg::Out(0), Arg::In(0), gates, Arg::In(experts), Arg::In(slots), Arg::Int(b), Arg::Int(s), Arg::Int(k), Arg::Int(d), Arg::Int(e), Arg::Int(c)];
    flat("moe_gather", MOE_CUDA, (b * s * d) as usize, args)
}

/// CUDA C of this file's ops (see [`crate::kernel`]): one thread per token, sequence or
/// element, each walking its choices in order, so results repeat bit for bit. The grouped
/// GEMMs are plain loops over the filled rows (a tiled grouped GEMM is future work).
const MOE_CUDA: &str = r#"// Top-k of each token's router logits (ties to the lower expert), and the softmax over them.
extern "C" __global__ void moe_route(T* gates, int* experts, const T* logits, i64 tokens, i64 e, i64 k) {
  GRID_STRIDE(t, tokens) {
    const T* row = logits + t * e;
    for (i64 j = 0; j < k; j++) {
      i64 best = -1;
      for (i64 x = 0; x < e; x++) {
        bool taken = false;
        for (i64 q = 0; q < j; q++) taken = taken || experts[t * k + q] == x;
        // A NaN, once best, stays: it poisons the gates, and the numerics checks name it.
        if (!taken && (best < 0 || (load(row[best]) == load(row[best]) && !(load(row[x]) <= load(row[best]))))) best = x;
      }
      experts[t * k + j] = (int)best;
    }
    acc_t top = load(row[experts[t * k]]), sum = 0;
    for (i64 j = 0; j < k; j++) sum += exp(load(row[experts[t * k + j]]) - top);
    for (i64 j = 0; j < k; j++) gates[t * k + j] = store(exp(load(row[experts[t * k + j]]) - top) / sum);
  }
}
extern "C" __global__ void moe_route_grad(T* out, const T* gates, const int* experts, const T* dgates, i64 tokens, i64 e, i64 k) {
  GRID_STRIDE(t, tokens) {
    for (i64 x = 0; x < e; x++) out[t * e + x] = store((acc_t)0);
    acc_t dot = 0;
    for (i64 j = 0; j < k; j++) dot += load(gates[t * k + j]) * load(dgates[t * k + j]);
    for (i64 j = 0; j < k; j++) {
      int x = experts[t * k + j];
      if (x >= 0 && x < e) out[t * e + x] = store(load(gates[t * k + j]) * (load(dgates[t * k + j]) - dot));
    }
  }
}
// counts[b, x] = E / (S^2 k) x (the choices of sequence b that picked x).
extern "C" __global__ void moe_aux_counts(acc_t* counts, const int* experts, i64 b, i64 s, i64 e, i64 k) {
  GRID_STRIDE(row, b) {
    for (i64 x = 0; x < e; x++) counts[row * e + x] = 0;
    acc_t scale = (acc_t)e / ((acc_t)s * (acc_t)s * (acc_t)k);
    for (i64 i = 0; i < s * k; i++) {
      int x = experts[row * s * k + i];
      if (x >= 0 && x < e) counts[row * e + x] += scale;
    }
  }
}
// loss[b] = sum over the sequence's tokens of <softmax(logits), counts[b]>.
extern "C" __global__ void moe_aux_loss(T* loss, const T* logits, const acc_t* counts, i64 b, i64 s, i64 e, i64 k) {
  GRID_STRIDE(row, b) {
    acc_t total = 0;
    for (i64 t = 0; t < s; t++) {
      const T* l = logits + (row * s + t) * e;
      acc_t top = NEG_INF, sum = 0, dot = 0;
      for (i64 x = 0; x < e; x++) top = fmax(top, load(l[x]));
      for (i64 x = 0; x < e; x++) { acc_t p = exp(load(l[x]) - top); sum += p; dot += p * counts[row * e + x]; }
      total += dot / sum;
    }
    loss[row] = store(total);
  }
}
extern "C" __global__ void moe_aux_loss_grad(T* out, const T* logits, const T* dloss, const acc_t* counts, i64 b, i64 s, i64 e, i64 k) {
  GRID_STRIDE(t, b * s) {
    i64 row = t / s;
    const T* l = logits + t * e;
    acc_t top = NEG_INF, sum = 0, dot = 0;
    for (i64 x = 0; x < e; x++) top = fmax(top, load(l[x]));
    for (i64 x = 0; x < e; x++) { acc_t p = exp(load(l[x]) - top); sum += p; dot += p * counts[row * e + x]; }
    dot /= sum;
    acc_t g = load(dloss[row]);
    for (i64 x = 0; x < e; x++) { acc_t p = exp(load(l[x]) - top) / sum; out[t * e + x] = store(g * p * (counts[row * e + x] - dot)); }
  }
}
// Per sequence: first choices before second choices, each in token order; counts serve as
// the running slot numbers, clamped to the capacity at the end.
// The row of position q in zigzag order (see zigzag_position).
__device__ __forceinline__ i64 zigzag_row(i64 q, i64 len, i64 chunks) {
  if (chunks <= 1 || len < chunks) return q;
  i64 c = len / chunks, chunk = q / c, w = q % c;
  return chunk < chunks / 2 ? chunk * 2 * c + w : (chunks - 1 - chunk) * 2 * c + c + w;
}
extern "C" __global__ void moe_slots(int* slots, int* counts, const int* experts, i64 b, i64 s, i64 k, i64 e, i64 c, i64 chunks) {
  GRID_STRIDE(row, b) {
    for (i64 x = 0; x < e; x++) counts[x * b + row] = 0;
    for (i64 j = 0; j < k; j++) {
      for (i64 q = 0; q < s; q++) {
        i64 i = (row * s + zigzag_row(q, s, chunks)) * k + j;
        int x = experts[i];
        if (x < 0 || x >= e) { slots[i] = -1; continue; }
        int slot = counts[x * b + row]++;
        slots[i] = slot < c ? slot : -1;
      }
    }
    for (i64 x = 0; x < e; x++) counts[x * b + row] = counts[x * b + row] < c ? counts[x * b + row] : (int)c;
  }
}
extern "C" __global__ void moe_dispatch(T* buf, const T* x, const int* experts, const int* slots, i64 b, i64 s, i64 k, i64 d, i64 e, i64 c) {
  GRID_STRIDE(i, b * s * k * d) {
    i64 choice = i / d, col = i % d, token = choice / k, row = token / s;
    int ex = experts[choice], slot = slots[choice];
    if (slot >= 0 && slot < c && ex >= 0 && ex < e) buf[((ex * b + row) * c + slot) * d + col] = x[token * d + col];
  }
}
// The combine's gradient into the buffer: gates x dy in each kept choice's slot.
extern "C" __global__ void moe_dispatch_weighted(T* buf, const T* dy, const T* gates, const int* experts, const int* slots, i64 b, i64 s, i64 k, i64 d, i64 e, i64 c) {
  GRID_STRIDE(i, b * s * k * d) {
    i64 choice = i / d, col = i % d, token = choice / k, row = token / s;
    int ex = experts[choice], slot = slots[choice];
    if (slot >= 0 && slot < c && ex >= 0 && ex < e) buf[((ex * b + row) * c + slot) * d + col] = store(load(gates[choice]) * load(dy[token * d + col]));
  }
}
extern "C" __global__ void moe_gate_grad(T* dgates, const T* buf, const T* dy, const int* experts, const int* slots, i64 b, i64 s, i64 k, i64 d, i64 e, i64 c) {
  GRID_STRIDE(choice, b * s * k) {
    i64 token = choice / k, row = token / s;
    int ex = experts[choice], slot = slots[choice];
    acc_t dot = 0;
    if (slot >= 0 && slot < c && ex >= 0 && ex < e)
      for (i64 col = 0; col < d; col++) dot += load(dy[token * d + col]) * load(buf[((ex * b + row) * c + slot) * d + col]);
    dgates[choice] = store(dot);
  }
}
// y[token] = sum over its kept choices of (gate) x buffer row; gates null: weight 1.
extern "C" __global__ void moe_gather(T* y, const T* buf, const T* gates, const int* experts, const int* slots, i64 b, i64 s, i64 k, i64 d, i64 e, i64 c) {
  GRID_STRIDE(i, b * s * d) {
    i64 token = i / d, col = i % d, row = token / s;
    acc_t sum = 0;
    for (i64 j = 0; j < k; j++) {
      i64 choice = token * k + j;
      int ex = experts[choice], slot = slots[choice];
      if (slot >= 0 && slot < c && ex >= 0 && ex < e) sum += (gates ? load(gates[choice]) : (acc_t)1) * load(buf[((ex * b + row) * c + slot) * d + col]);
    }
    y[i] = store(sum);
  }
}
// out[g, r, :] = x[g, r, :] @ w[expert of g] for the rows r < counts[g] that hold tokens.
extern "C" __global__ void expert_matmul(T* out, const T* x, const T* w, const int* counts, i64 groups, i64 b, i64 c, i64 m, i64 n, i64 transposed) {
  GRID_STRIDE(i, groups * c * n) {
    i64 g = i / (c * n), r = (i / n) % c, col = i % n, ex = g / b;
    acc_t sum = 0;
    if (r < counts[g]) {
      const T* xr = x + (g * c + r) * m;
      const T* we = w + ex * m * n;
      for (i64 q = 0; q < m; q++) sum += load(xr[q]) * load(transposed ? we[col * m + q] : we[q * n + col]);
    }
    out[i] = store(sum);
  }
}
extern "C" __global__ void expert_matmul_wgrad(T* dw, const T* x, const T* dy, const int* counts, i64 e, i64 b, i64 c, i64 m, i64 n) {
  GRID_STRIDE(i, e * m * n) {
    i64 ex = i / (m * n), p = (i / n) % m, q = i % n;
    acc_t sum = 0;
    for (i64 row = 0; row < b; row++) {
      i64 g = ex * b + row;
      for (i64 r = 0; r < counts[g] && r < c; r++) sum += load(x[(g * c + r) * m + p]) * load(dy[(g * c + r) * n + q]);
    }
    dw[i] = store(sum);
  }
}
"#;
