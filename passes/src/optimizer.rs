//! `optimizer`: turns `@gradients` into the training step `@train_step`.
//!
//! Input: `@gradients(params..., inputs...) -> (loss, grads...)` from [`crate::Autodiff`].
//! Output: `@train_step(params..., state..., inputs..., step) -> (loss, params'..., state'...)`
//! with one update op per parameter (`xf.adamw` or `xf.sgd`, located `optimizer.<param>`),
//! and `@gradients` removed (its ops are inlined). AdamW state is two moments per parameter,
//! arguments named `opt.m.<param>` and `opt.v.<param>`; `step` (i32, from 1) drives bias
//! correction. Weight decay applies to matrices only, not to norm scales and biases (as in
//! GPT-2 and Llama training). The updates alias their state, so codegen updates in place.
//!
//! Each update is placed right after the last op that reads its parameter or its gradient,
//! not at the end: the gradient's buffer is then free while the backward pass goes on, so
//! the step never holds every gradient at once (PyTorch's "optimizer in backward").
//!
//! Mixed precision (bf16 parameters), as Megatron-LM trains: each bf16 parameter has an fp32
//! master copy `opt.master.<param>` (role [`ArgRole::Master`]) and fp32 moments; the bf16
//! gradient is cast to fp32 (so data-parallel reduction and accumulation over micro-batches
//! run in fp32), the update runs on the master in fp32, and the new bf16 parameter is the
//! master cast back. The IR shows the two `xf.cast` ops around every update.

use std::collections::HashMap;

use shardc_ir::ops::cast::cast_attrs;
use shardc_ir::{ArgRole, AttrValue, Attrs, DType, FuncBuilder, Module, TensorTy, Type, Value};

use crate::{Changed, Pass, PassError};

/// The update rule and its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerKind {
    /// AdamW with bias correction.
    AdamW {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Denominator epsilon.
        epsilon: f64,
        /// Decoupled weight decay (matrices only).
        weight_decay: f64,
    },
    /// Plain SGD.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Weight decay (matrices only).
        weight_decay: f64,
    },
}

impl OptimizerKind {
    /// AdamW with the usual betas (0.9, 0.95), epsilon 1e-8 and weight decay 0.1.
    pub fn adamw(lr: f64) -> Self {
        OptimizerKind::AdamW { lr, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 }
    }
}

/// The `optimizer` pass.
#[derive(Clone, Copy, Debug)]
pub struct Optimizer {
    /// Update rule.
    pub kind: OptimizerKind,
}

impl Pass for Optimizer {
    fn name(&self) -> &'static str {
        "optimizer"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let user = |message: String| PassError::User { pass: self.name().into(), message };
        let gradients = module.func("gradients").ok_or_else(|| user("the module has no @gradients; run autodiff first".into()))?;
        let mut fb = FuncBuilder::new("train_step");
        let mut map: HashMap<Value, Value> = HashMap::new();
        for arg in &gradients.args {
            map.insert(arg.value, fb.arg_like(arg, gradients.ty(arg.value).clone()));
        }
        let params: Vec<_> = gradients.args_with(ArgRole::Param).cloned().collect();
        let state_names: &[&str] = match self.kind {
            OptimizerKind::AdamW { .. } => &["m", "v"],
            OptimizerKind::Sgd { .. } => &[],
        };
        // A bf16 parameter trains in mixed precision: fp32 master and state.
        let mixed: Vec<bool> = params.iter().map(|p| gradients.tensor(p.value).is_some_and(|t| t.dtype == DType::Bf16)).collect();
        let state_type = |i: usize| match gradients.tensor(params[i].value) {
            Some(t) if mixed[i] => Type::Tensor(TensorTy::new(t.shape.clone(), DType::F32)),
            _ => gradients.ty(params[i].value).clone(),
        };
        // state[k][i]: state k of parameter i.
        let state: Vec<Vec<Value>> = state_names
            .iter()
            .map(|s| {
                (0..params.len())
                    .map(|i| {
                        // State follows its parameter, padding included.
                        let v = fb.arg_typed(&format!("opt.{s}.{}", params[i].name), state_type(i), ArgRole::OptState);
                        fb.set_unpadded(v, params[i].unpadded.clone());
                        v
                    })
                    .collect()
            })
            .collect();
        let masters: Vec<Option<Value>> = (0..params.len())
            .map(|i| {
                mixed[i].then(|| {
                    let v = fb.arg_typed(&format!("opt.master.{}", params[i].name), state_type(i), ArgRole::Master);
                    fb.set_unpadded(v, params[i].unpadded.clone());
                    v
                })
            })
            .collect();
        let step = fb.arg_typed("step", Type::Tensor(TensorTy::scalar(DType::I32)), ArgRole::Input);
        for op in &gradients.ops {
            let operands: Vec<Value> = op.operands.iter().map(|v| map[v]).collect();
            let results = fb.clone_op(gradients, op, &operands, &op.loc);
            map.extend(op.results.iter().copied().zip(results));
        }
        let loss = map[&gradients.returns[0]];
        let mut new_params = Vec::new();
        let mut new_masters = Vec::new();
        let mut new_state: Vec<Vec<Value>> = vec![Vec::new(); state_names.len()];
        for (i, param) in params.iter().enumerate() {
            let grad = map[&gradients.returns[i + 1]];
            let is_matrix = gradients.tensor(param.value).is_some_and(|t| t.rank() >= 2);
            let loc = format!("optimizer.{}", param.name);
            let build = |fb: &mut FuncBuilder, name: &str, operands: &[Value], attrs: Attrs| {
                fb.op_multi(name, operands, attrs, &loc).map_err(|e| PassError::Internal { pass: "optimizer".into(), source: e.into() })
            };
            // Mixed precision: the update runs on the fp32 master with the fp32 gradient.
            let (p, grad) = match masters[i] {
                Some(master) => (master, build(&mut fb, "xf.cast", &[grad], cast_attrs(DType::F32))?[0]),
                None => (map[&param.value], grad),
            };
            let mut updated = |fb: &mut FuncBuilder, value: Value| -> Result<(), PassError> {
                if masters[i].is_some() {
                    new_masters.push(value);
                    new_params.push(build(fb, "xf.cast", &[value], cast_attrs(DType::Bf16))?[0]);
                } else {
                    new_params.push(value);
                }
                Ok(())
            };
            match self.kind {
                OptimizerKind::AdamW { lr, beta1, beta2, epsilon, weight_decay } => {
                    let attrs = Attrs::new()
                        .with("lr", AttrValue::Float(lr))
                        .with("beta1", AttrValue::Float(beta1))
                        .with("beta2", AttrValue::Float(beta2))
                        .with("epsilon", AttrValue::Float(epsilon))
                        .with("weight_decay", AttrValue::Float(if is_matrix { weight_decay } else { 0.0 }));
                    let r = build(&mut fb, "xf.adamw", &[p, grad, state[0][i], state[1][i], step], attrs)?;
                    updated(&mut fb, r[0])?;
                    new_state[0].push(r[1]);
                    new_state[1].push(r[2]);
                }
                OptimizerKind::Sgd { lr, weight_decay } => {
                    let attrs = Attrs::new()
                        .with("lr", AttrValue::Float(lr))
                        .with("weight_decay", AttrValue::Float(if is_matrix { weight_decay } else { 0.0 }));
                    let r = build(&mut fb, "xf.sgd", &[p, grad], attrs)?;
                    updated(&mut fb, r[0])?;
                }
            }
        }
        let mut returns = vec![loss];
        let mut names = vec!["loss".to_string()];
        returns.extend(&new_params);
        names.extend(params.iter().map(|p| p.name.clone()));
        for (k, values) in new_state.iter().enumerate() {
            returns.extend(values);
            names.extend(params.iter().map(|p| format!("opt.{}.{}", state_names[k], p.name)));
        }
        returns.extend(&new_masters);
        names.extend(params.iter().zip(&mixed).filter(|(_, m)| **m).map(|(p, _)| format!("opt.master.{}", p.name)));
        let mut train_step = fb.finish(&returns, &names);
        place_updates_early(&mut train_step);
        module.funcs.retain(|f| f.name != "gradients" && f.name != "train_step");
        module.funcs.push(train_step);
        Ok(Changed::Yes)
    }
}

/// Moves every update op (located `optimizer.*`) to just after the last op that reads its
/// parameter or defines or reads its gradient. Updates read only values defined before that
/// point and nothing but the function's results reads them, so the order stays valid.
fn place_updates_early(func: &mut shardc_ir::Func) {
    let (updates, mut rest): (Vec<_>, Vec<_>) = func.ops.drain(..).partition(|op| op.loc.starts_with("optimizer."));
    // One unit per parameter: its update, with the casts of mixed precision, in order.
    let mut units: Vec<Vec<shardc_ir::Op>> = Vec::new();
    for op in updates {
        match units.last_mut() {
            Some(unit) if unit[0].loc == op.loc => unit.push(op),
            _ => units.push(vec![op]),
        }
    }
    // For each unit: the index in `rest` after which it may run (None: before every op):
    // after the last op that reads or defines what the unit reads from outside itself (the
    // parameter, its gradient).
    let mut after: Vec<(Option<usize>, Vec<shardc_ir::Op>)> = units
        .into_iter()
        .map(|unit| {
            let made: Vec<Value> = unit.iter().flat_map(|op| op.results.iter().copied()).collect();
            let reads: Vec<Value> = unit.iter().flat_map(|op| op.operands.iter().copied()).filter(|v| !made.contains(v)).collect();
            let touches = |op: &shardc_ir::Op| op.operands.iter().chain(&op.results).any(|v| reads.contains(v));
            (rest.iter().rposition(touches), unit)
        })
        .collect();
    // Stable by position, so updates at the same point keep the parameter order.
    after.sort_by_key(|(at, _)| at.map_or(0, |i| i + 1));
    let mut ops = Vec::with_capacity(rest.len() + after.len());
    let mut pending = after.into_iter().peekable();
    while let Some((None, _)) = pending.peek() {
        ops.extend(pending.next().unwrap().1);
    }
    for (i, op) in rest.drain(..).enumerate() {
        ops.push(op);
        while pending.peek().is_some_and(|(at, _)| *at == Some(i)) {
            ops.extend(pending.next().unwrap().1);
        }
    }
    func.ops = ops;
}
