//! `xf.cast`: a tensor converted to another float element type. Mixed precision is made of
//! it: bf16 gradients become fp32 for accumulation and the update, and the updated fp32
//! master weights become the bf16 parameters the next step computes with.

use super::{arity, float, AttrKind, OpDef, Signature, Slot, VjpCx};
use crate::attrs::{AttrValue, Attrs};
use crate::graph::Value;
use crate::kernel::{DeviceKernel, KernelCx};
use crate::sharding::{FactorKind, Linearity, ShardingRule};
use crate::types::{DType, TensorTy};

/// `y = x` as element type `to` (rounded to nearest even when narrowing).
#[derive(Debug)]
pub struct Cast;

/// The target type of a cast: its `to` attribute (`f32`, `bf16`, `f64`).
pub fn cast_target(attrs: &Attrs) -> Result<DType, String> {
    match attrs.get("to") {
        Some(AttrValue::Type(d)) if *d != DType::I32 => Ok(*d),
        // A rank program keeps the type as its name.
        Some(AttrValue::Str(text)) => match DType::from_mlir(text.trim()) {
            Some(d) if d != DType::I32 => Ok(d),
            _ => Err(format!("`to` = {text} is not a float element type (f32, bf16 or f64)")),
        },
        Some(AttrValue::Type(d)) => Err(format!("`to` = {} is not a float element type (f32, bf16 or f64)", d.mlir())),
        other => Err(format!("`to` must be an element type such as f32, got {other:?}")),
    }
}

/// The `to` attribute for `dtype`.
pub fn cast_attrs(dtype: DType) -> Attrs {
    Attrs::new().with("to", AttrValue::Type(dtype))
}

impl OpDef for Cast {
    fn mnemonic(&self) -> &'static str {
        "cast"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        // Values are loaded as acc_t and stored as each buffer's own type.
        Ok(DeviceKernel::Elementwise { body: "{out0} = {in0};" })
    }
    fn summary(&self) -> &'static str {
        "x converted to the float element type `to` (mixed precision)"
    }
    fn signature(&self) -> Signature {
        Signature { operands: &[Slot { name: "x", constraint: "X" }], results: &[Slot { name: "y", constraint: "Y" }], attrs: &[("to", AttrKind::Type)] }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        float("x", inputs[0])?;
        Ok(vec![TensorTy::new(inputs[0].shape.clone(), cast_target(attrs)?)])
    }
    fn flops_per_element(&self) -> f64 {
        1.0
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        // The gradient goes back in the operand's type.
        let dtype = cx.ty(cx.operands[0])?.dtype;
        Ok(vec![Some(cx.emit("xf.cast", &[grads[0]], cast_attrs(dtype))?)])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Element-wise, and linear: a partial sum stays partial, so a reduction after a
        // widening cast runs in the wider type (fp32 gradient reduction).
        let r = inputs[0].rank();
        ShardingRule { operands: vec![(0..r).collect()], results: vec![(0..r).collect()], factors: vec![FactorKind::Free; r], linearity: Linearity::Sum }
    }
}
