//! `optimizer`: turns `@gradients` into the training step `@train_step`.
//!
//! Input: `@gradients(params..., inputs...) -> (loss, grads...)` from [`crate::Autodiff`].
//! Output: `@train_step(params..., state..., inputs..., step) -> (loss, params'..., state'...)`
//! with one update op per parameter (`xf.adamw` or `xf.sgd`, located `optimizer.<param>`),
//! and `@gradients` removed (its ops are inlined). AdamW state is two moments per parameter,
//! arguments named `opt.m.<param>` and `opt.v.<param>`; `step` (i32, from 1) drives bias
//! correction and the learning-rate schedule ([`LrSchedule`], attributes of every update).
//! Weight decay applies to matrices only, not to norm scales and biases (as in GPT-2 and
//! Llama training, Megatron-LM and Hugging Face). The updates alias their state, so codegen
//! updates in place.
//!
//! **Clipping** by the global gradient norm (Megatron-LM's `--clip-grad`, default 1.0): each
//! gradient's `xf.sum_squares` (located `optimizer.<param>.grad_norm`), summed in parameter
//! order, gives `xf.clip_coef` (located `optimizer.grad_norm`), which every update reads as
//! its `grad_scale`. The norm is of the gradients the updates read: after data-parallel
//! reduction, in fp32 under mixed precision, and once per parameter; partitioning turns the
//! sum over shards into all-reduces of scalars (see `sharding::GroupNormSums`), and under
//! pipeline parallelism the sum travels from stage to stage.
//!
//! Without clipping each update is placed right after the last op that reads its parameter
//! or its gradient, not at the end: the gradient's buffer is then free while the backward
//! pass goes on, so the step never holds every gradient at once (PyTorch's "optimizer in
//! backward"). Clipping needs every gradient before the first update, so the updates follow
//! the norm, as in Megatron-LM.
//!
//! Mixed precision (bf16 parameters), as Megatron-LM trains: each bf16 parameter has an fp32
//! master copy `opt.master.<param>` (role [`ArgRole::Master`]) and fp32 moments; the bf16
//! gradient is cast to fp32 (so data-parallel reduction and accumulation over micro-batches
//! run in fp32), the update runs on the master in fp32, and the new bf16 parameter is the
//! master cast back. The IR shows the two `xf.cast` ops around every update.

use std::collections::HashMap;

use shardc_ir::ops::cast::cast_attrs;
use shardc_ir::ops::LrSchedule;
use shardc_ir::facts::{master_name, state_name, Origin, Role};
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

impl OptimizerKind {
    /// The peak learning rate.
    pub fn lr(&self) -> f64 {
        match *self {
            OptimizerKind::AdamW { lr, .. } | OptimizerKind::Sgd { lr, .. } => lr,
        }
    }
}

/// How the learning rate moves over the iterations, the peak being the optimizer's `lr`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    /// Iterations of linear warmup (0: none).
    pub warmup_steps: i64,
    /// Iteration at which the decay reaches `min_lr` (0: constant after the warmup).
    pub decay_steps: i64,
    /// Learning rate at the end of the decay.
    pub min_lr: f64,
    /// Cosine decay (else linear).
    pub cosine: bool,
}

impl Schedule {
    /// No warmup and no decay.
    pub const CONSTANT: Schedule = Schedule { warmup_steps: 0, decay_steps: 0, min_lr: 0.0, cosine: false };

    /// The schedule of an optimizer whose peak learning rate is `lr`.
    pub fn with_peak(&self, lr: f64) -> LrSchedule {
        let min_lr = if self.decay_steps == 0 { lr } else { self.min_lr };
        LrSchedule { lr, min_lr, warmup_steps: self.warmup_steps, decay_steps: self.decay_steps, cosine: self.cosine }
    }
}

/// The `optimizer` pass.
#[derive(Clone, Copy, Debug)]
pub struct Optimizer {
    /// Update rule.
    pub kind: OptimizerKind,
    /// Learning-rate schedule.
    pub schedule: Schedule,
    /// Largest global gradient norm (clipping); 0: no clipping.
    pub clip_grad: f64,
}

impl Pass for Optimizer {
    fn name(&self) -> &'static str {
        "optimizer"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let user = |message: String| PassError::User { pass: self.name().into(), message };
        let gradients = module.func("gradients").ok_or_else(|| user("the module has no @gradients; run autodiff first".into()))?;
        let schedule = self.schedule.with_peak(self.kind.lr());
        schedule.check().map_err(|e| user(format!("learning-rate schedule: {e}")))?;
        if !(self.clip_grad.is_finite() && self.clip_grad >= 0.0) {
            return Err(user(format!("clip_grad must be a finite number >= 0 (0: no clipping), got {}", self.clip_grad)));
        }
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
                        // State follows its parameter, padding, place and split included.
                        fb.set_origin(Origin::of(params[i].block));
                        let v = fb.arg_typed(&state_name(s, &params[i].name), state_type(i), ArgRole::OptState);
                        fb.set_unpadded(v, params[i].unpadded.clone());
                        if let Some(kind) = params[i].kind {
                            fb.set_kind(v, kind);
                        }
                        v
                    })
                    .collect()
            })
            .collect();
        let masters: Vec<Option<Value>> = (0..params.len())
            .map(|i| {
                mixed[i].then(|| {
                    fb.set_origin(Origin::of(params[i].block));
                    let v = fb.arg_typed(&master_name(&params[i].name), state_type(i), ArgRole::Master);
                    fb.set_unpadded(v, params[i].unpadded.clone());
                    if let Some(kind) = params[i].kind {
                        fb.set_kind(v, kind);
                    }
                    v
                })
            })
            .collect();
        fb.set_origin(Origin::default());
        let step = fb.arg_typed("step", Type::Tensor(TensorTy::scalar(DType::I32)), ArgRole::Input);
        for op in &gradients.ops {
            let operands: Vec<Value> = op.operands.iter().map(|v| map[v]).collect();
            let results = fb.clone_op(gradients, op, &operands, &op.loc);
            map.extend(op.results.iter().copied().zip(results));
        }
        let loss = map[&gradients.returns[0]];
        let build = |fb: &mut FuncBuilder, name: &str, operands: &[Value], attrs: Attrs, loc: &str| {
            fb.op_multi(name, operands, attrs, loc).map_err(|e| PassError::Internal { pass: "optimizer".into(), source: e.into() })
        };
        // The gradient each update reads: fp32 under mixed precision (the update runs on the
        // fp32 master), so data-parallel reduction and the norm run in fp32 too.
        let of_param = |i: usize| Origin { block: params[i].block, role: Role::Optimizer, residual: false };
        let update_grad = |fb: &mut FuncBuilder, i: usize| -> Result<Value, PassError> {
            fb.set_origin(of_param(i));
            let grad = map[&gradients.returns[i + 1]];
            Ok(match masters[i] {
                Some(_) => build(fb, "xf.cast", &[grad], cast_attrs(DType::F32), &format!("optimizer.{}", params[i].name))?[0],
                None => grad,
            })
        };
        // With clipping: every gradient, the sum of their squares and the coefficient come
        // before the first update, which all read the coefficient as their gradient scale.
        // The shares come one after another and their sum after them all (in parameter
        // order), so a device computes every share in one multi-tensor launch.
        let mut clipped: Vec<(Value, Value)> = Vec::new();
        if self.clip_grad > 0.0 {
            for i in 0..params.len() {
                let grad = update_grad(&mut fb, i)?;
                let squares = build(&mut fb, "xf.sum_squares", &[grad], Attrs::new(), &format!("optimizer.{}.grad_norm", params[i].name))?[0];
                clipped.push((grad, squares));
            }
            let mut total: Option<Value> = None;
            for (i, &(_, squares)) in clipped.iter().enumerate() {
                fb.set_origin(of_param(i));
                total = Some(match total {
                    Some(sum) => build(&mut fb, "xf.add", &[sum, squares], Attrs::new(), &format!("optimizer.{}.grad_norm", params[i].name))?[0],
                    None => squares,
                });
            }
            if let Some(total) = total {
                fb.set_origin(Origin::default().with_role(Role::Optimizer));
                let coef = build(&mut fb, "xf.clip_coef", &[total], Attrs::new().with("max_norm", AttrValue::Float(self.clip_grad)), "optimizer.grad_norm")?[0];
                for entry in &mut clipped {
                    entry.1 = coef;
                }
            }
        }
        let mut new_params = Vec::new();
        let mut new_masters = Vec::new();
        let mut new_state: Vec<Vec<Value>> = vec![Vec::new(); state_names.len()];
        for (i, param) in params.iter().enumerate() {
            // Without clipping the scale is 1, made in the update's unit (the cast, scale,
            // update and cast back stay together when updates are placed early).
            let (grad, scale) = match clipped.get(i) {
                Some(&(grad, coef)) => (grad, coef),
                None => {
                    let grad = update_grad(&mut fb, i)?;
                    let dtype = if mixed[i] { DType::F32 } else { gradients.tensor(param.value).map_or(DType::F32, |t| t.dtype) };
                    let attrs = Attrs::new().with("value", AttrValue::Float(1.0)).with("to", AttrValue::Type(dtype));
                    (grad, build(&mut fb, "xf.constant", &[], attrs, &format!("optimizer.{}", param.name))?[0])
                }
            };
            fb.set_origin(of_param(i));
            let is_matrix = gradients.tensor(param.value).is_some_and(|t| t.rank() >= 2);
            let loc = format!("optimizer.{}", param.name);
            let p = masters[i].unwrap_or(map[&param.value]);
            let mut updated = |fb: &mut FuncBuilder, value: Value| -> Result<(), PassError> {
                if masters[i].is_some() {
                    new_masters.push(value);
                    new_params.push(build(fb, "xf.cast", &[value], cast_attrs(DType::Bf16), &loc)?[0]);
                } else {
                    new_params.push(value);
                }
                Ok(())
            };
            let weight_decay = |wd: f64| AttrValue::Float(if is_matrix { wd } else { 0.0 });
            match self.kind {
                OptimizerKind::AdamW { beta1, beta2, epsilon, weight_decay: wd, .. } => {
                    let attrs = schedule
                        .add_to(Attrs::new())
                        .with("beta1", AttrValue::Float(beta1))
                        .with("beta2", AttrValue::Float(beta2))
                        .with("epsilon", AttrValue::Float(epsilon))
                        .with("weight_decay", weight_decay(wd));
                    let r = build(&mut fb, "xf.adamw", &[p, grad, state[0][i], state[1][i], step, scale], attrs, &loc)?;
                    updated(&mut fb, r[0])?;
                    new_state[0].push(r[1]);
                    new_state[1].push(r[2]);
                }
                OptimizerKind::Sgd { weight_decay: wd, .. } => {
                    let attrs = schedule.add_to(Attrs::new()).with("weight_decay", weight_decay(wd));
                    let r = build(&mut fb, "xf.sgd", &[p, grad, step, scale], attrs, &loc)?;
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
            names.extend(params.iter().map(|p| state_name(state_names[k], &p.name)));
        }
        returns.extend(&new_masters);
        names.extend(params.iter().zip(&mixed).filter(|(_, m)| **m).map(|(p, _)| master_name(&p.name)));
        let mut train_step = fb.finish(&returns, &names);
        if self.clip_grad == 0.0 {
            place_updates_early(&mut train_step);
        }
        module.funcs.retain(|f| f.name != "gradients" && f.name != "train_step");
        module.funcs.push(train_step);
        Ok(Changed::Yes)
    }
}

/// Moves every update op (of the optimizer's role) to just after the last op that reads its
/// parameter or defines or reads its gradient. Updates read only values defined before that
/// point and nothing but the function's results reads them, so the order stays valid.
fn place_updates_early(func: &mut shardc_ir::Func) {
    let (updates, mut rest): (Vec<_>, Vec<_>) = func.ops.drain(..).partition(|op| op.origin.role == Role::Optimizer);
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
    // parameter, its gradient). The last op touching each value is found in one walk, not
    // one walk per unit (quadratic in the depth of the model).
    let mut last_touch: HashMap<Value, usize> = HashMap::new();
    for (i, op) in rest.iter().enumerate() {
        for v in op.operands.iter().chain(&op.results) {
            last_touch.insert(*v, i);
        }
    }
    let mut after: Vec<(Option<usize>, Vec<shardc_ir::Op>)> = units
        .into_iter()
        .map(|unit| {
            let made: Vec<Value> = unit.iter().flat_map(|op| op.results.iter().copied()).collect();
            let at = unit.iter().flat_map(|op| op.operands.iter()).filter(|v| !made.contains(v)).filter_map(|v| last_touch.get(v).copied()).max();
            (at, unit)
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
