//! `autodiff`: reverse-mode differentiation of `@forward` into `@gradients`.
//!
//! Input: a module with `func.func @forward(params..., inputs...) -> loss` (a float scalar).
//! Output: the same module plus `func.func @gradients(params..., inputs...) -> (loss,
//! d loss / d param...)`, one gradient per parameter in argument order. The forward ops are
//! copied first, then each op's VJP (from the op registry, [`shardc_ir::ops::OpDef::vjp`]) is
//! emitted in reverse order; gradients reaching a value along several paths are summed with
//! `xf.add`. Every gradient op is located at its forward op plus `.grad`.
//!
//! Activation recomputation trades compute for memory: before the backward ops of layer
//! `layers.N`, the forward ops of that layer are emitted again (located `….recompute`) and the
//! backward ops read those copies, so the first copies die at the end of the forward pass.
//! `full` recomputes every op of the layer from its input; `selective-attention` recomputes
//! only the attention core (Korthikanti et al. 2022).

use std::collections::{HashMap, HashSet};

use shardc_ir::facts::{Origin, Role};
use shardc_ir::ops::{lookup, VjpCx};
use shardc_ir::{ArgRole, AttrValue, Attrs, Func, FuncBuilder, Module, Op, Value};

use crate::{Changed, Pass, PassError};

/// Which forward activations are recomputed in the backward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Keep every activation the backward pass reads.
    #[default]
    None,
    /// Keep only each layer's input; recompute the rest of the layer.
    Full,
    /// Recompute the attention core of each layer.
    SelectiveAttention,
}

impl Recompute {
    /// Parses `none`, `full` or `selective-attention`.
    pub fn parse(text: &str) -> Option<Recompute> {
        Some(match text {
            "none" => Recompute::None,
            "full" => Recompute::Full,
            "selective-attention" | "selective" => Recompute::SelectiveAttention,
            _ => return None,
        })
    }

    fn recomputes(self, op: &Op) -> bool {
        match self {
            Recompute::None => false,
            Recompute::Full => true,
            Recompute::SelectiveAttention => op.name == "xf.attention",
        }
    }
}

/// The `autodiff` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct Autodiff {
    /// Activation recomputation policy.
    pub recompute: Recompute,
}

impl Pass for Autodiff {
    fn name(&self) -> &'static str {
        "autodiff"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let user = |message: String| PassError::User { pass: self.name().into(), message };
        let forward = module.func("forward").ok_or_else(|| user("the module has no @forward to differentiate".into()))?;
        let gradients = differentiate(forward, self.recompute).map_err(user)?;
        module.funcs.retain(|f| f.name != "gradients");
        module.funcs.push(gradients);
        Ok(Changed::Yes)
    }
}

/// Builds `@gradients` from `forward`.
pub fn differentiate(forward: &Func, recompute: Recompute) -> Result<Func, String> {
    let [loss] = forward.returns[..] else {
        return Err(format!("@forward must return exactly one value (the loss), it returns {}", forward.returns.len()));
    };
    match forward.tensor(loss) {
        Some(t) if t.rank() == 0 && t.dtype.is_float() => {}
        other => return Err(format!("the loss must be a float scalar, got {}", other.map_or("a non-tensor".into(), |t| t.to_string()))),
    }
    let mut fb = FuncBuilder::new("gradients");
    // Forward value -> value in @gradients.
    let mut map: HashMap<Value, Value> = HashMap::new();
    for arg in &forward.args {
        map.insert(arg.value, fb.arg_like(arg, forward.ty(arg.value).clone()));
    }
    for op in &forward.ops {
        let operands: Vec<Value> = op.operands.iter().map(|v| map[v]).collect();
        let results = fb.clone_op(forward, op, &operands, &op.loc);
        map.extend(op.results.iter().copied().zip(results));
    }

    let fill = |fb: &mut FuncBuilder, like: Value, value: f64, loc: &str| {
        fb.op("xf.fill_like", &[like], Attrs::new().with("value", AttrValue::Float(value)), loc).map_err(|e| e.to_string())
    };
    // Gradient ops are placed with the forward op they differentiate.
    let gradient_of = |origin: Origin| Origin { block: origin.block, role: Role::Gradient, residual: false };
    let mut grads: HashMap<Value, Value> = HashMap::new();
    let loss_origin = forward.ops.iter().find(|op| op.results.contains(&loss)).map_or(Origin::default(), |op| op.origin);
    fb.set_origin(gradient_of(loss_origin));
    grads.insert(loss, fill(&mut fb, map[&loss], 1.0, "loss.seed")?);
    // Recomputed copies of forward values, per forward value.
    let mut recomputed: HashMap<Value, Value> = HashMap::new();
    let mut layers_done: HashSet<u32> = HashSet::new();

    for op in forward.ops.iter().rev() {
        if !op.results.iter().any(|r| grads.contains_key(r)) {
            continue;
        }
        let def = lookup(&op.name).filter(|d| d.differentiable()).ok_or_else(|| {
            format!("{}: cannot differentiate through `{}` (it has no VJP rule)", op.loc, op.name)
        })?;
        if let Some(&r) = def.backward_only_results().iter().find(|&&r| op.results.get(r).is_some_and(|v| grads.contains_key(v))) {
            let name = def.signature().results.get(r).map_or("?", |slot| slot.name);
            return Err(format!("{}: the loss depends on `{name}` of `{}`, a statistic kept for its backward that no gradient flows through", op.loc, op.name));
        }
        if recompute != Recompute::None
            && let Some(layer) = op.origin.block.layer()
                && layers_done.insert(layer) {
                    for fwd in forward.ops.iter().filter(|o| o.origin.block.layer() == Some(layer) && recompute.recomputes(o)) {
                        let operands: Vec<Value> = fwd.operands.iter().map(|v| *recomputed.get(v).unwrap_or(&map[v])).collect();
                        let replay = Op { origin: Origin { role: Role::Recompute, residual: false, ..fwd.origin }, ..fwd.clone() };
                        let results = fb.clone_op(forward, &replay, &operands, &format!("{}.recompute", fwd.loc));
                        recomputed.extend(fwd.results.iter().copied().zip(results));
                    }
                }
        fb.set_origin(gradient_of(op.origin));
        let current = |v: &Value| *recomputed.get(v).unwrap_or(&map[v]);
        let mut out_grads = Vec::with_capacity(op.results.len());
        for r in &op.results {
            let float = forward.tensor(*r).is_some_and(|t| t.dtype.is_float());
            out_grads.push(match grads.get(r) {
                Some(g) => *g,
                // An integer result (the experts a router picks) has no gradient; its slot
                // holds the result itself, which no VJP reads.
                None if !float => current(r),
                // A result nobody differentiates through (e.g. one output of a multi-result
                // op): its gradient is zero.
                None => fill(&mut fb, current(r), 0.0, &format!("{}.grad.zero", op.loc))?,
            });
        }
        let operands: Vec<Value> = op.operands.iter().map(current).collect();
        let results: Vec<Value> = op.results.iter().map(current).collect();
        let mut cx = VjpCx::new(&mut fb, operands, results, op.attrs.clone(), &op.loc);
        let in_grads = def.vjp(&mut cx, &out_grads).map_err(|e| format!("{}: VJP of `{}`: {e}", op.loc, op.name))?;
        for (operand, grad) in op.operands.iter().zip(in_grads) {
            let Some(grad) = grad else { continue };
            let total = match grads.get(operand) {
                Some(previous) => fb.op("xf.add", &[*previous, grad], Attrs::new(), &format!("{}.grad.acc", op.loc)).map_err(|e| e.to_string())?,
                None => grad,
            };
            grads.insert(*operand, total);
        }
    }

    let mut returns = vec![map[&loss]];
    let mut names = vec!["loss".to_string()];
    for arg in forward.args_with(ArgRole::Param) {
        fb.set_origin(gradient_of(Origin::of(arg.block)));
        let grad = match grads.get(&arg.value) {
            Some(g) => *g,
            // A parameter the loss does not depend on has a zero gradient.
            None => fill(&mut fb, map[&arg.value], 0.0, &format!("{}.grad.zero", arg.name))?,
        };
        returns.push(grad);
        names.push(format!("grad.{}", arg.name));
    }
    let mut gradients = fb.finish(&returns, &names);
    remove_dead_ops(&mut gradients);
    Ok(gradients)
}

/// Drops the ops whose results nothing reads and the function does not return (a
/// recomputed layer's last residual add, whose value the next layer's input already is).
/// Every `xf` op is pure, so what feeds nothing can go.
fn remove_dead_ops(func: &mut Func) {
    let mut live: HashSet<Value> = func.returns.iter().copied().collect();
    let mut keep = vec![false; func.ops.len()];
    for (i, op) in func.ops.iter().enumerate().rev() {
        if op.results.iter().any(|r| live.contains(r)) {
            keep[i] = true;
            live.extend(op.operands.iter().copied());
        }
    }
    let mut index = 0;
    func.ops.retain(|_| {
        index += 1;
        keep[index - 1]
    });
}

#[cfg(test)]
mod tests {
    use shardc_ir::graph::{ArgRole, FuncBuilder};
    use shardc_ir::{AttrValue, Attrs, DType, TensorTy};

    use super::{differentiate, Recompute};

    /// Attention's log-sum-exp is a statistic its backward reads, not a value its VJP
    /// differentiates: a loss that depends on it is refused by name, never given a gradient
    /// that leaves that dependence out.
    #[test]
    fn a_loss_through_attentions_log_sum_exp_is_refused() {
        let attrs = Attrs::new().with("causal", AttrValue::Bool(true)).with("scale", AttrValue::Float(0.5)).with("head_dim", AttrValue::Int(4));
        let t = TensorTy::new([1, 4, 2 * 4], DType::F32);
        for use_lse in [false, true] {
            let mut fb = FuncBuilder::new("forward");
            let qkv: Vec<_> = ["q", "k", "v"].iter().map(|n| fb.arg(n, t.clone(), ArgRole::Param)).collect();
            let out = fb.op_multi("xf.attention", &qkv, attrs.clone(), "attn").unwrap();
            let keep = Attrs::new().with("keep", AttrValue::Int(0));
            let loss = fb.op("xf.sum_leading", &[out[usize::from(use_lse)]], keep, "loss").unwrap();
            let forward = fb.finish(&[loss], &["loss".to_string()]);
            match differentiate(&forward, Recompute::None) {
                Ok(_) => assert!(!use_lse, "a loss of the log-sum-exp was differentiated"),
                Err(e) => {
                    assert!(use_lse, "{e}");
                    assert!(e.contains("`lse` of `xf.attention`") && e.contains("attn"), "{e}");
                }
            }
        }
    }
}
