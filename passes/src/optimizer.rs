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

use std::collections::HashMap;

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
        // state[k][i]: state k of parameter i.
        let state: Vec<Vec<Value>> = state_names
            .iter()
            .map(|s| {
                params
                    .iter()
                    .map(|p| {
                        // State follows its parameter, padding included.
                        let v = fb.arg_typed(&format!("opt.{s}.{}", p.name), gradients.ty(p.value).clone(), ArgRole::OptState);
                        fb.set_unpadded(v, p.unpadded.clone());
                        v
                    })
                    .collect()
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
        let mut new_state: Vec<Vec<Value>> = vec![Vec::new(); state_names.len()];
        for (i, param) in params.iter().enumerate() {
            let p = map[&param.value];
            let grad = map[&gradients.returns[i + 1]];
            let is_matrix = gradients.tensor(param.value).is_some_and(|t| t.rank() >= 2);
            let loc = format!("optimizer.{}", param.name);
            let build = |fb: &mut FuncBuilder, name: &str, operands: &[Value], attrs: Attrs| {
                fb.op_multi(name, operands, attrs, &loc).map_err(|e| PassError::Internal { pass: "optimizer".into(), source: e.into() })
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
                    new_params.push(r[0]);
                    new_state[0].push(r[1]);
                    new_state[1].push(r[2]);
                }
                OptimizerKind::Sgd { lr, weight_decay } => {
                    let attrs = Attrs::new()
                        .with("lr", AttrValue::Float(lr))
                        .with("weight_decay", AttrValue::Float(if is_matrix { weight_decay } else { 0.0 }));
                    new_params.push(build(&mut fb, "xf.sgd", &[p, grad], attrs)?[0]);
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
    // For each update: the index in `rest` after which it may run (None: before every op).
    let mut after: Vec<(Option<usize>, shardc_ir::Op)> = updates
        .into_iter()
        .map(|update| {
            let touches = |op: &shardc_ir::Op| {
                op.operands.iter().chain(&op.results).any(|v| update.operands[..2].contains(v))
            };
            (rest.iter().rposition(touches), update)
        })
        .collect();
    // Stable by position, so updates at the same point keep the parameter order.
    after.sort_by_key(|(at, _)| at.map_or(0, |i| i + 1));
    let mut ops = Vec::with_capacity(rest.len() + after.len());
    let mut pending = after.into_iter().peekable();
    while let Some((None, _)) = pending.peek() {
        ops.push(pending.next().unwrap().1);
    }
    for (i, op) in rest.drain(..).enumerate() {
        ops.push(op);
        while pending.peek().is_some_and(|(at, _)| *at == Some(i)) {
            ops.push(pending.next().unwrap().1);
        }
    }
    func.ops = ops;
}
