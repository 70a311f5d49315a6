//! Element-wise ops: `add`, `mul` (with right-aligned broadcasting of the second operand),
//! `scale`, and the activations `gelu`, `silu`, `swiglu`.

use super::{arity, float, same_dtype, AttrKind, OpDef, Signature, Slot};
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
}

/// `out = lhs * rhs`, `rhs` broadcast over the leading dimensions of `lhs`.
#[derive(Debug)]
pub struct Mul;

impl OpDef for Mul {
    fn mnemonic(&self) -> &'static str {
        "mul"
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
}

/// `y = factor * x`.
#[derive(Debug)]
pub struct Scale;

impl OpDef for Scale {
    fn mnemonic(&self) -> &'static str {
        "scale"
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
}

/// GELU, tanh approximation (GPT-2's `gelu_new`):
/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
#[derive(Debug)]
pub struct Gelu;

impl OpDef for Gelu {
    fn mnemonic(&self) -> &'static str {
        "gelu"
    }
    fn summary(&self) -> &'static str {
        "GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))"
    }
    fn signature(&self) -> Signature {
        Signature { operands: UNARY, results: UNARY_OUT, attrs: &[] }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        float("x", inputs[0])?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        // x^3, two multiply-adds, tanh (counted as 1), 1 + t, two multiplies.
        8.0
    }
}

/// SiLU (swish): `x * sigmoid(x)`.
#[derive(Debug)]
pub struct Silu;

impl OpDef for Silu {
    fn mnemonic(&self) -> &'static str {
        "silu"
    }
    fn summary(&self) -> &'static str {
        "SiLU: x * sigmoid(x)"
    }
    fn signature(&self) -> Signature {
        Signature { operands: UNARY, results: UNARY_OUT, attrs: &[] }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        float("x", inputs[0])?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        4.0
    }
}

/// SwiGLU gating: `silu(gate) * up` (Llama's MLP between its gate/up and down projections).
#[derive(Debug)]
pub struct Swiglu;

impl OpDef for Swiglu {
    fn mnemonic(&self) -> &'static str {
        "swiglu"
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
    fn flops_per_element(&self) -> f64 {
        5.0
    }
}
