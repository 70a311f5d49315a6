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
                for (result, sharding) in func.ops[i].results.clone().into_iter().zip(plan.results) {
                    // A pinned result takes its pinned layout (partitioning reshards to it).
                    let sharding = func.constraints.get(&result).cloned().unwrap_or(sharding);
                    func.shardings.insert(result, sharding);
                }
            }
        }
        Ok(Changed::Yes)
    }
}
