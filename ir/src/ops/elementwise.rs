//! Element-wise ops: `add`, `mul` (with right-aligned broadcasting of the second operand),
//! `scale`, the activations `gelu`, `silu`, `swiglu`, and their backward ops.

use crate::kernel::{DeviceKernel, KernelCx};
use super::{arity, float, same_dtype, AttrKind, OpDef, Signature, Slot, VjpCx};
use crate::graph::Value;
use crate::sharding::{Linearity, ShardingRule};
use crate::attrs::Attrs;
use crate::types::TensorTy;

/// Checks that `rhs` broadcasts onto `lhs`: its shape equals the trailing dimensions of `lhs`
/// (a bias `[N]` onto `[B, S, N]`, positions `[S, H]` onto `[B, S, H]`).
fn broadcast_onto(lhs: &TensorTy, rhs: &TensorTy) -> Result<(), String> {
    float("lhs", lhs)?;
    float("rhs", rhs)?;
    same_dtype(lhs, rhs)?;
    let tail = lhs.rank().checked_sub(rhs.rank());
    match tail {
        Some(start) if lhs.shape[start..] == rhs.shape[..] => Ok(()),
        _ => Err(format!("rhs {rhs} must equal the trailing dimensions of lhs {lhs}")),
    }
}

const BINARY: &[Slot] = &[Slot { name: "lhs", constraint: "L" }, Slot { name: "rhs", constraint: "R" }];
const BINARY_OUT: &[Slot] = &[Slot { name: "out", constraint: "L" }];
const UNARY: &[Slot] = &[Slot { name: "x", constraint: "T" }];
const UNARY_OUT: &[Slot] = &[Slot { name: "y", constraint: "T" }];

/// `out = lhs + rhs`, `rhs` broadcast over the leading dimensions of `lhs`.
#[derive(Debug)]
pub struct Add;

impl OpDef for Add {
    fn mnemonic(&self) -> &'static str {
        "add"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise { body: "{out0} = {in0} + {in1};" })
    }
    fn summary(&self) -> &'static str {
        "lhs + rhs; rhs equals the trailing dims of lhs and is broadcast over the rest"
    }
    fn signature(&self) -> Signature {
        Signature { operands: BINARY, results: BINARY_OUT, attrs: &[] }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        broadcast_onto(inputs[0], inputs[1])?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        1.0
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn gemm_epilogue(&self) -> Option<crate::kernel::EpilogueStage> {
        Some(crate::kernel::EpilogueStage::Bias)
    }
    fn in_place(&self) -> &'static [(usize, usize)] {
        // Accumulating into a dead lhs (gradient sums, residual adds) needs no new buffer.
        &[(0, 0)]
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        // d lhs = dy; d rhs = dy summed over the dimensions rhs was broadcast along.
        let rhs = cx.sum_to(grads[0], cx.operands[1])?;
        Ok(vec![Some(grads[0]), Some(rhs)])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        broadcast_rule(inputs, Linearity::Sum)
    }
}

/// `out = lhs * rhs`, `rhs` broadcast over the leading dimensions of `lhs`.
#[derive(Debug)]
pub struct Mul;

impl OpDef for Mul {
    fn mnemonic(&self) -> &'static str {
        "mul"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise { body: "{out0} = {in0} * {in1};" })
    }
    fn summary(&self) -> &'static str {
        "lhs * rhs; rhs equals the trailing dims of lhs and is broadcast over the rest"
    }
    fn signature(&self) -> Signature {
        Signature { operands: BINARY, results: BINARY_OUT, attrs: &[] }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        broadcast_onto(inputs[0], inputs[1])?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        1.0
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let (lhs, rhs) = (cx.operands[0], cx.operands[1]);
        let d_lhs = cx.emit("xf.mul", &[grads[0], rhs], Attrs::new())?;
        let d_rhs_full = cx.emit("xf.mul", &[grads[0], lhs], Attrs::new())?;
        let d_rhs = cx.sum_to(d_rhs_full, rhs)?;
        Ok(vec![Some(d_lhs), Some(d_rhs)])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        broadcast_rule(inputs, Linearity::Product)
    }
}

/// `y = factor * x`.
#[derive(Debug)]
pub struct Scale;

impl OpDef for Scale {
    fn mnemonic(&self) -> &'static str {
        "scale"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise { body: "{out0} = {in0} * {factor};" })
    }
    fn summary(&self) -> &'static str {
        "factor * x"
    }
    fn signature(&self) -> Signature {
        Signature { operands: UNARY, results: UNARY_OUT, attrs: &[("factor", AttrKind::Float)] }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        float("x", inputs[0])?;
        attrs.float("factor")?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        1.0
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let attrs = cx.attrs.clone();
        Ok(vec![Some(cx.emit("xf.scale", &[grads[0]], attrs)?)])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule::elementwise(inputs[0].rank(), 1, 1, Linearity::Sum)
    }
}

/// GELU, tanh approximation (GPT-2's `gelu_new`):
/// A one-operand activation: its kernel body, cost, and the op of its derivative.
#[derive(Debug)]
pub struct Activation {
    mnemonic: &'static str,
    summary: &'static str,
    body: &'static str,
    flops_per_element: f64,
    /// The backward op, `dx = dy * f'(x)` from `(x, dy)`.
    grad: &'static str,
    /// As a GEMM epilogue (cuBLASLt has GELU, not SiLU).
    epilogue: Option<crate::kernel::EpilogueStage>,
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub const GELU: Activation = Activation {
    mnemonic: "gelu",
    summary: "GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))",
    body: "{out0} = gelu_f({in0});",
    // x^3, two multiply-adds, tanh (counted as 1), 1 + t, two multiplies.
    flops_per_element: 8.0,
    grad: "xf.gelu_grad",
    epilogue: Some(crate::kernel::EpilogueStage::Gelu),
};

/// SiLU (swish): `x * sigmoid(x)`.
pub const SILU: Activation = Activation {
    mnemonic: "silu",
    summary: "SiLU: x * sigmoid(x)",
    body: "{out0} = {in0} * sigmoid_f({in0});",
    flops_per_element: 4.0,
    grad: "xf.silu_grad",
    epilogue: None,
};

impl OpDef for Activation {
    fn mnemonic(&self) -> &'static str {
        self.mnemonic
    }
    fn gemm_epilogue(&self) -> Option<crate::kernel::EpilogueStage> {
        self.epilogue
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise { body: self.body })
    }
    fn summary(&self) -> &'static str {
        self.summary
    }
    fn signature(&self) -> Signature {
        Signature { operands: UNARY, results: UNARY_OUT, attrs: &[] }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        float("x", inputs[0])?;
        Ok(vec![inputs[0].clone()])
    }
    fn special_per_element(&self) -> f64 {
        // One tanh or exp per element.
        1.0
    }
    fn flops_per_element(&self) -> f64 {
        self.flops_per_element
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let x = cx.operands[0];
        Ok(vec![Some(cx.emit(self.grad, &[x, grads[0]], Attrs::new())?)])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule::elementwise(inputs[0].rank(), 1, 1, Linearity::None)
    }
}

/// SwiGLU gating: `silu(gate) * up` (Llama's MLP between its gate/up and down projections).
#[derive(Debug)]
pub struct Swiglu;

impl OpDef for Swiglu {
    fn mnemonic(&self) -> &'static str {
        "swiglu"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise { body: "{out0} = {in0} * sigmoid_f({in0}) * {in1};" })
    }
    fn summary(&self) -> &'static str {
        "SwiGLU gating: silu(gate) * up"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "gate", constraint: "T" }, Slot { name: "up", constraint: "T" }],
            results: &[Slot { name: "y", constraint: "T" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        float("gate", inputs[0])?;
        if inputs[0] != inputs[1] {
            return Err(format!("gate {} and up {} must have the same type", inputs[0], inputs[1]));
        }
        Ok(vec![inputs[0].clone()])
    }
    fn special_per_element(&self) -> f64 {
        // One exp per element.
        1.0
    }
    fn flops_per_element(&self) -> f64 {
        5.0
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let (gate, up) = (cx.operands[0], cx.operands[1]);
        let d = cx.emit_multi("xf.swiglu_grad", &[gate, up, grads[0]], Attrs::new())?;
        Ok(vec![Some(d[0]), Some(d[1])])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule::elementwise(inputs[0].rank(), 2, 1, Linearity::None)
    }
}

/// Same-type check of the operands of a backward element-wise op.
fn same_types(what: &[&str], inputs: &[&TensorTy]) -> Result<TensorTy, String> {
    arity(inputs, what.len())?;
    float(what[0], inputs[0])?;
    for (name, t) in what.iter().zip(inputs).skip(1) {
        if *t != inputs[0] {
            return Err(format!("{name} {t} must have the type of {} {}", what[0], inputs[0]));
        }
    }
    Ok(inputs[0].clone())
}

/// The backward op of an [`Activation`]: `dx = dy * f'(x)` from `(x, dy)`.
#[derive(Debug)]
pub struct ActivationGrad {
    mnemonic: &'static str,
    summary: &'static str,
    body: &'static str,
    flops_per_element: f64,
    /// As a GEMM epilogue.
    epilogue: Option<crate::kernel::EpilogueStage>,
}

/// `dx = dy * gelu'(x)` for the tanh approximation.
pub const GELU_GRAD: ActivationGrad = ActivationGrad {
    mnemonic: "gelu_grad",
    summary: "dy * gelu'(x) (tanh approximation)",
    body: "{out0} = {in1} * gelu_df({in0});",
    flops_per_element: 14.0,
    epilogue: Some(crate::kernel::EpilogueStage::GeluGrad),
};

/// `dx = dy * silu'(x) = dy * s (1 + x (1 - s))` with `s = sigmoid(x)`.
pub const SILU_GRAD: ActivationGrad = ActivationGrad {
    mnemonic: "silu_grad",
    summary: "dy * silu'(x)",
    body: "{out0} = {in1} * silu_df({in0});",
    flops_per_element: 7.0,
    epilogue: None,
};

impl OpDef for ActivationGrad {
    fn mnemonic(&self) -> &'static str {
        self.mnemonic
    }
    fn gemm_epilogue(&self) -> Option<crate::kernel::EpilogueStage> {
        self.epilogue
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise { body: self.body })
    }
    fn summary(&self) -> &'static str {
        self.summary
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "T" }, Slot { name: "dy", constraint: "T" }],
            results: &[Slot { name: "dx", constraint: "T" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        Ok(vec![same_types(&["x", "dy"], inputs)?])
    }
    fn special_per_element(&self) -> f64 {
        // One tanh or exp per element.
        1.0
    }
    fn flops_per_element(&self) -> f64 {
        self.flops_per_element
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule::elementwise(inputs[0].rank(), 2, 1, Linearity::None)
    }
}

/// `dgate = dy * up * silu'(gate)`, `dup = dy * silu(gate)`.
#[derive(Debug)]
pub struct SwigluGrad;

impl OpDef for SwigluGrad {
    fn mnemonic(&self) -> &'static str {
        "swiglu_grad"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise { body: "{out0} = {in2} * {in1} * silu_df({in0}); {out1} = {in2} * {in0} * sigmoid_f({in0});" })
    }
    fn summary(&self) -> &'static str {
        "(dy * up * silu'(gate), dy * silu(gate))"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "gate", constraint: "T" },
                Slot { name: "up", constraint: "T" },
                Slot { name: "dy", constraint: "T" },
            ],
            results: &[Slot { name: "dgate", constraint: "T" }, Slot { name: "dup", constraint: "T" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        let t = same_types(&["gate", "up", "dy"], inputs)?;
        Ok(vec![t.clone(), t])
    }
    fn special_per_element(&self) -> f64 {
        // One exp per element.
        1.0
    }
    fn flops_per_element(&self) -> f64 {
        6.0
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule::elementwise(inputs[0].rank(), 3, 2, Linearity::None)
    }
}

/// `lhs [d0..dr]` and `rhs` = the trailing dims of `lhs`, sharing their factors.
fn broadcast_rule(inputs: &[&TensorTy], linearity: Linearity) -> ShardingRule {
    let rank = inputs[0].rank();
    let rhs_rank = inputs.get(1).map_or(0, |t| t.rank()).min(rank);
    let mut rule = ShardingRule::elementwise(rank, 1, 1, linearity);
    rule.operands.push((rank - rhs_rank..rank).collect());
    rule
}
