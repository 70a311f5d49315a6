//! Optimizer updates as ops: `xf.adamw` and `xf.sgd`. They update their state in place (see
//! [`OpDef::in_place`]), so a training step does not hold two copies of the parameters.

use crate::kernel::{DeviceKernel, KernelCx};
use super::{arity, float, AttrKind, Cost, OpDef, Signature, Slot};
use crate::attrs::Attrs;
use crate::sharding::{Linearity, ShardingRule};
use crate::types::{DType, TensorTy};

/// AdamW (Loshchilov and Hutter) with bias correction, at step `t >= 1`:
/// `m' = b1 m + (1 - b1) g`, `v' = b2 v + (1 - b2) g^2`,
/// `p' = p - lr (m' / (1 - b1^t) / (sqrt(v' / (1 - b2^t)) + eps) + weight_decay p)`.
/// `step` is an i32 scalar, so one compiled step serves every iteration.
#[derive(Debug)]
pub struct AdamW;

impl OpDef for AdamW {
    fn mnemonic(&self) -> &'static str {
        "adamw"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise {
            body: "acc_t m = {beta1} * {in2} + ((acc_t)1 - {beta1}) * {in1}; \
                   acc_t v = {beta2} * {in3} + ((acc_t)1 - {beta2}) * {in1} * {in1}; \
                   acc_t bc1 = (acc_t)1 - pow({beta1}, {in4}), bc2 = (acc_t)1 - pow({beta2}, {in4}); \
                   {out0} = {in0} - {lr} * ((m / bc1) / (sqrt(v / bc2) + {epsilon}) + {weight_decay} * {in0}); \
                   {out1} = m; {out2} = v;",
        })
    }
    fn summary(&self) -> &'static str {
        "AdamW update with bias correction: (param, m, v) -> (param', m', v')"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "param", constraint: "P" },
                Slot { name: "grad", constraint: "P" },
                Slot { name: "m", constraint: "P" },
                Slot { name: "v", constraint: "P" },
                Slot { name: "step", constraint: "S" },
            ],
            results: &[
                Slot { name: "new_param", constraint: "P" },
                Slot { name: "new_m", constraint: "P" },
                Slot { name: "new_v", constraint: "P" },
            ],
            attrs: &[
                ("lr", AttrKind::Float),
                ("beta1", AttrKind::Float),
                ("beta2", AttrKind::Float),
                ("epsilon", AttrKind::Float),
                ("weight_decay", AttrKind::Float),
            ],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 5)?;
        let p = inputs[0];
        float("param", p)?;
        for (name, t) in [("grad", inputs[1]), ("m", inputs[2]), ("v", inputs[3])] {
            if t != p {
                return Err(format!("{name} {t} must have the type of param {p}"));
            }
        }
        if *inputs[4] != TensorTy::scalar(DType::I32) {
            return Err(format!("step {} must be tensor<i32>", inputs[4]));
        }
        for name in ["lr", "beta1", "beta2", "epsilon", "weight_decay"] {
            attrs.float(name)?;
        }
        Ok(vec![p.clone(), p.clone(), p.clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], _outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        let n = inputs[0].num_elements() as f64;
        // Read p, g, m, v; write p, m, v.
        // The square root and division are instructions of their own (vectorised on CPUs,
        // reciprocal units on GPUs), counted with the arithmetic: no special functions.
        Cost { flops: 12.0 * n, bytes: 7.0 * inputs[0].bytes() as f64, special: 0.0 }
    }
    fn in_place(&self) -> &'static [(usize, usize)] {
        &[(0, 0), (1, 2), (2, 3)]
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Parameter, gradient and moments share every factor; step is a scalar.
        let mut rule = ShardingRule::elementwise(inputs[0].rank(), 4, 3, Linearity::None);
        rule.operands.push(vec![]);
        rule
    }
}

/// Plain SGD with decoupled weight decay: `p' = p - lr (g + weight_decay p)`.
#[derive(Debug)]
pub struct Sgd;

impl OpDef for Sgd {
    fn mnemonic(&self) -> &'static str {
        "sgd"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise { body: "{out0} = {in0} - {lr} * ({in1} + {weight_decay} * {in0});" })
    }
    fn summary(&self) -> &'static str {
        "SGD update: param - lr (grad + weight_decay param)"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "param", constraint: "P" }, Slot { name: "grad", constraint: "P" }],
            results: &[Slot { name: "new_param", constraint: "P" }],
            attrs: &[("lr", AttrKind::Float), ("weight_decay", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        float("param", inputs[0])?;
        if inputs[1] != inputs[0] {
            return Err(format!("grad {} must have the type of param {}", inputs[1], inputs[0]));
        }
        attrs.float("lr")?;
        attrs.float("weight_decay")?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        3.0
    }
    fn in_place(&self) -> &'static [(usize, usize)] {
        &[(0, 0)]
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule::elementwise(inputs[0].rank(), 2, 1, Linearity::None)
    }
}
