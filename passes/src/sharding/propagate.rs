//! `propagate-sharding`: annotates every op result from its operands' shardings and the
//! op's sharding rule ([`super::plan_op`]), in program order.
//!
//! Input: a function whose arguments are annotated. Output: every tensor value annotated;
//! partial sums are marked (printed as `xf.partial` on the `shard.shard` annotation). No op
//! changes: where an operand's sharding differs from what its op needs, partitioning
//! inserts the collective, and `shardc explain` lists it with that cause.

use shardc_ir::Module;

use super::{plan_op_in, FuncIndex};
use crate::{Changed, Pass, PassError};

/// The `propagate-sharding` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct PropagateSharding;

impl Pass for PropagateSharding {
    fn name(&self) -> &'static str {
        "propagate-sharding"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        for func in module.funcs.iter_mut().filter(|f| !f.shardings.is_empty()) {
            // Propagation adds no arguments: one index serves every op.
            let index = FuncIndex::new(func);
            for i in 0..func.ops.len() {
                let plan = plan_op_in(func, &index, &func.ops[i]).map_err(|message| PassError::User {
                    pass: "propagate-sharding".into(),
                    message: format!("{}: {message}", func.ops[i].loc),
                })?;
                let scatter = positions_to_scatter(&func.ops[i], &plan);
                for (result, sharding) in func.ops[i].results.clone().into_iter().zip(plan.results) {
                    if let Some(axes) = &scatter
                        && !func.constraints.contains_key(&result)
                        && axes.axes.iter().all(|a| sharding.partial.contains(a))
                        && let Some(split) = sharding.split.get(axes.dim)
                        && split.is_empty()
                    {
                        let mut scattered = sharding.clone();
                        scattered.split[axes.dim] = axes.axes.clone();
                        scattered.partial.retain(|a| !axes.axes.contains(a));
                        func.constraints.insert(result, scattered);
                    }
                    // A pinned result takes its pinned layout (partitioning reshards to it).
                    let sharding = func.constraints.get(&result).cloned().unwrap_or(sharding);
                    func.shardings.insert(result, sharding);
                }
            }
        }
        Ok(Changed::Yes)
    }
}

/// The axes splitting an op's positions ([`shardc_ir::ops::OpDef::position_factor`]) and the
/// dimension they index (as in the op's first operand).
struct SplitPositions {
    axes: Vec<shardc_ir::sharding::Axis>,
    dim: usize,
}

/// Where an op's positions are split (context parallelism's queries), a result that comes
/// out partial over those axes with the same dimension whole (attention's dk and dv: each
/// rank's queries' part of every key's gradient) is reduce-scattered along it right away,
/// as Megatron's context parallelism does, rather than carried whole and partial into the
/// ops after it (a whole sequence's activation gradient, all-reduced later, for each layer).
fn positions_to_scatter(op: &shardc_ir::Op, plan: &super::OpPlan) -> Option<SplitPositions> {
    let def = shardc_ir::ops::lookup(&op.name)?;
    let f = def.position_factor()?;
    let axes = plan.factor_axes.get(f).filter(|a| !a.is_empty())?.clone();
    let dim = plan.operands.first()?.split.iter().position(|split| *split == axes)?;
    Some(SplitPositions { axes, dim })
}
