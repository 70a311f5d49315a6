//! `group-norm-sums`: one reduction per layout for the global gradient norm.
//!
//! Input: a sharded training step (after propagation) whose optimizer clips by the global
//! norm: `xf.sum_squares` of every gradient, added in parameter order (located
//! `optimizer.<param>.grad_norm`) into the operand of `xf.clip_coef`. A sum of squares of a
//! gradient split over some axes is a partial sum over them, and adding partial sums of
//! different axes forces an all-reduce of the running sum at every change, one per
//! parameter at worst. Output: the same sum, added layout by layout (the terms partial over
//! the same axes first, each group in parameter order), so partitioning all-reduces each
//! group's total once, as Megatron-LM reduces the norm once per model-parallel group. A
//! replicated gradient (a norm scale under tensor parallelism) stays a replicated term and
//! counts once, not once per rank.

use std::collections::HashSet;

use shardc_ir::sharding::Axis;
use shardc_ir::facts::{Origin, Role};
use shardc_ir::{Attrs, Module, Op, Value};

use super::{plan_op_in, FuncIndex};
use crate::{Changed, Pass, PassError};

/// The `group-norm-sums` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupNormSums;

impl Pass for GroupNormSums {
    fn name(&self) -> &'static str {
        "group-norm-sums"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let user = |message: String| PassError::User { pass: "group-norm-sums".into(), message };
        let mut changed = Changed::No;
        for func in module.funcs.iter_mut().filter(|f| !f.shardings.is_empty()) {
            let Some(clip) = func.ops.iter().position(|op| op.name == "xf.clip_coef") else { continue };
            // The chain: the optimizer's adds whose operands are sums of squares or earlier
            // adds of the chain.
            let terms: Vec<(Value, (String, Origin))> = func.ops.iter().filter(|op| op.name == "xf.sum_squares").map(|op| (op.results[0], (op.loc.clone(), op.origin))).collect();
            let mut chain: HashSet<Value> = HashSet::new();
            let mut chain_ops: HashSet<usize> = HashSet::new();
            let term_values: HashSet<Value> = terms.iter().map(|(v, _)| *v).collect();
            for (i, op) in func.ops.iter().enumerate() {
                if op.name == "xf.add" && op.origin.role == Role::Optimizer && op.operands.iter().all(|v| term_values.contains(v) || chain.contains(v)) {
                    chain.insert(op.results[0]);
                    chain_ops.insert(i);
                }
            }
            let total = func.ops[clip].operands[0];
            if terms.len() < 2 || !(chain.contains(&total) || term_values.contains(&total)) {
                continue;
            }
            // One walk of the ops, not one per partial sum: the chain grows with the model.
            let read_outside = func
                .ops
                .iter()
                .enumerate()
                .any(|(i, op)| !chain_ops.contains(&i) && op.operands.iter().any(|v| *v != total && chain.contains(v)));
            // Something else reads a running sum: regrouping would change what it reads, so the
            // sum stays as written (correct, with more all-reduces).
            if read_outside {
                continue;
            }
            // Groups of terms by the axes their partial sum spans, in order of first use.
            let mut groups: Vec<(Vec<Axis>, Vec<(Value, (String, Origin))>)> = Vec::new();
            for (value, loc) in &terms {
                let mut partial = func.shardings.get(value).map(|s| s.partial.clone()).unwrap_or_default();
                partial.sort_unstable();
                match groups.iter_mut().find(|(axes, _)| *axes == partial) {
                    Some((_, members)) => members.push((*value, loc.clone())),
                    None => groups.push((partial, vec![(*value, loc.clone())])),
                }
            }
            if groups.len() < 2 {
                continue;
            }
            // New adds replace the chain, right before the coefficient.
            let mut adds: Vec<Op> = Vec::new();
            let fresh = |func: &mut shardc_ir::Func, like: Value| {
                func.types.push(func.types[like.0 as usize].clone());
                Value(func.types.len() as u32 - 1)
            };
            let mut group_totals: Vec<Value> = Vec::new();
            for (_, members) in &groups {
                let mut sum = members[0].0;
                for (value, (loc, origin)) in &members[1..] {
                    let result = fresh(func, *value);
                    adds.push(Op { name: "xf.add".into(), operands: vec![sum, *value], results: vec![result], attrs: Attrs::new(), loc: loc.clone(), origin: *origin });
                    sum = result;
                }
                group_totals.push(sum);
            }
            let mut sum = group_totals[0];
            for &group_total in &group_totals[1..] {
                let result = fresh(func, group_total);
                adds.push(Op { name: "xf.add".into(), operands: vec![sum, group_total], results: vec![result], attrs: Attrs::new(), loc: "optimizer.grad_norm".into(), origin: Origin::default().with_role(Role::Optimizer) });
                sum = result;
            }
            let mut ops: Vec<Op> = Vec::with_capacity(func.ops.len() + adds.len());
            // Where the new adds start; the coefficient follows them.
            let mut first_add = 0;
            for (i, op) in func.ops.drain(..).enumerate() {
                if chain_ops.contains(&i) {
                    continue;
                }
                if i == clip {
                    first_add = ops.len();
                    ops.extend(adds.iter().cloned());
                    let mut op = op;
                    op.operands[0] = sum;
                    ops.push(op);
                    continue;
                }
                ops.push(op);
            }
            func.ops = ops;
            for v in &chain {
                func.shardings.remove(v);
            }
            // Annotate the new sums as propagation would, in order (each reads the one before).
            let index = FuncIndex::new(func);
            for at in first_add..=first_add + adds.len() {
                let op = func.ops[at].clone();
                let plan = plan_op_in(func, &index, &op).map_err(|m| user(format!("{}: {m}", op.loc)))?;
                for (result, sharding) in op.results.iter().zip(plan.results) {
                    func.shardings.insert(*result, sharding);
                }
            }
            changed = Changed::Yes;
        }
        Ok(changed)
    }
}
