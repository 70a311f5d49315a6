//! SPMD partitioning: a strategy annotates arguments, propagation extends shardings through
//! every op by the op's sharding rule, and partitioning rewrites the function into the
//! per-rank program with explicit `shard` collectives.
//!
//! [`plan_op`] is the one place where an op's rule meets its operands' shardings; both
//! propagation (to annotate results) and partitioning (to insert collectives) call it, so
//! the two can never disagree.

mod bucket;
mod expand_kv;
mod megatron;
mod norm;
mod overlap;
mod partition;
mod propagate;
mod ring;

use shardc_ir::ops::lookup;
use shardc_ir::sharding::{Axis, FactorKind, Linearity, Sharding};
use shardc_ir::{Func, Op, TensorTy};

pub use bucket::{BucketGradients, BucketStepGradients};
pub use expand_kv::ExpandKvHeads;
pub use megatron::ShardMegatron;
pub use norm::GroupNormSums;
pub use overlap::OverlapCollectives;
pub use partition::Partition;
pub use propagate::PropagateSharding;
pub use ring::{Policy as ContextAttention, RingAttention};

/// The data-parallel grid axis ([`shardc_ir::mesh::DP_AXIS`]) as a sharding names it.
pub const DP: Axis = shardc_ir::mesh::DP_AXIS as Axis;
/// The tensor-parallel axis.
pub const TP: Axis = shardc_ir::mesh::TP_AXIS as Axis;
/// The pipeline axis.
pub const PP: Axis = shardc_ir::mesh::PP_AXIS as Axis;
/// The context-parallel axis.
pub const CP: Axis = shardc_ir::mesh::CP_AXIS as Axis;
/// The expert-parallel axis.
pub const EP: Axis = shardc_ir::mesh::EP_AXIS as Axis;

/// What one op needs and produces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpPlan {
    /// The sharding each operand must have when the op reads it.
    pub operands: Vec<Sharding>,
    /// The sharding of each result.
    pub results: Vec<Sharding>,
    /// Grid axes assigned to each factor of the rule.
    pub factor_axes: Vec<Vec<Axis>>,
}

/// The sharding of `value` in `func` (replicated when not annotated).
pub fn sharding_of(func: &Func, value: shardc_ir::Value) -> Sharding {
    func.shardings.get(&value).cloned().unwrap_or_else(|| Sharding::replicated(func.tensor(value).map_or(0, TensorTy::rank)))
}

/// Applies `op`'s sharding rule to the current shardings of its operands.
///
/// Each factor takes the axes of a pinned result first, then of the first operand dimension
/// that carries it (tensor-parallel parameters, then activations and inputs, then other
/// parameter splits), up to the first axis another factor already took or that operand is
/// partial over; a later operand may extend a factor's axes with further ones of its own
/// (a dimension split `[tp, dp]` after `[tp]`); blocked factors take none. An operand's
/// required sharding follows its factors; a result is split by its factors and partial
/// over the axes of every split factor some operand has but the result lacks (a reduction). Partial operands are reduced first unless the op's linearity lets
/// the partial sum pass through to the results.
pub fn plan_op(func: &Func, op: &Op) -> Result<OpPlan, String> {
    plan_op_in(func, &FuncIndex::new(func), op)
}

/// Facts about a function's arguments that [`plan_op`] needs for every op, computed once
/// per function so that planning every op of a deep model stays linear in its size (a
/// search of the arguments per operand is quadratic: a layer adds both ops and arguments).
#[derive(Clone, Debug)]
pub struct FuncIndex {
    /// Per value (indexed by `Value.0`): whether it is an argument that is not a per-step
    /// input (a parameter or optimizer state).
    state: Vec<bool>,
    /// Per value: whether it is a parameter argument.
    param: Vec<bool>,
}

impl FuncIndex {
    /// Indexes `func`'s arguments.
    pub fn new(func: &Func) -> Self {
        let mut state = vec![false; func.types.len()];
        let mut param = vec![false; func.types.len()];
        for arg in &func.args {
            let i = arg.value.0 as usize;
            if i >= state.len() {
                state.resize(i + 1, false);
                param.resize(i + 1, false);
            }
            state[i] |= arg.role != shardc_ir::ArgRole::Input;
            param[i] |= arg.role == shardc_ir::ArgRole::Param;
        }
        FuncIndex { state, param }
    }

    /// Whether `value` is an argument other than a per-step input.
    pub fn is_state(&self, value: shardc_ir::Value) -> bool {
        self.state.get(value.0 as usize).copied().unwrap_or(false)
    }

    /// Whether `value` is a parameter argument.
    pub fn is_param(&self, value: shardc_ir::Value) -> bool {
        self.param.get(value.0 as usize).copied().unwrap_or(false)
    }
}

/// [`plan_op`] with the function's arguments indexed once ([`FuncIndex::new`] of `func`).
pub fn plan_op_in(func: &Func, index: &FuncIndex, op: &Op) -> Result<OpPlan, String> {
    let current: Vec<Sharding> = op.operands.iter().map(|v| sharding_of(func, *v)).collect();
    let inputs: Vec<&TensorTy> = op.operands.iter().map(|v| func.tensor(*v).ok_or("non-tensor operand")).collect::<Result<_, _>>()?;
    let def = lookup(&op.name).ok_or_else(|| format!("`{}` has no sharding rule", op.name))?;
    let rule = def.sharding_rule(&inputs, &op.attrs);
    if rule.operands.len() != op.operands.len() || rule.results.len() != op.results.len() {
        return Err(format!("the sharding rule of `{}` does not match its operands", op.name));
    }
    // Partial sums that may pass through.
    let float_operands: Vec<usize> = (0..op.operands.len()).filter(|&i| inputs[i].dtype.is_float()).collect();
    let partials: Vec<&Vec<Axis>> = float_operands.iter().map(|&i| &current[i].partial).collect();
    let pass_through: Vec<Axis> = match rule.linearity {
        Linearity::Sum if !partials.is_empty() && partials.iter().all(|p| !p.is_empty() && *p == partials[0]) => partials[0].clone(),
        Linearity::Product if partials.iter().filter(|p| !p.is_empty()).count() == 1 => {
            partials.iter().find(|p| !p.is_empty()).map(|p| (*p).clone()).unwrap_or_default()
        }
        _ => Vec::new(),
    };
    let keeps_partial = |i: usize| match rule.linearity {
        Linearity::IgnoresValues => true,
        _ => !pass_through.is_empty() && !current[i].partial.is_empty(),
    };

    let mut factor_axes: Vec<Vec<Axis>> = vec![Vec::new(); rule.factors.len()];
    let mut taken: Vec<Axis> = pass_through.clone();
    // A factor takes the longest prefix of `axes` it can: the axes beyond what it already
    // holds, up to the first one another factor took or the operand is partial over. A
    // dimension split over several axes lists them outermost first, so a factor holding
    // `[tp]` that extends to `[tp, dp]` splits each tensor-parallel shard over `dp` (a ZeRO
    // shard of a tensor-parallel parameter), and one that stops at `[tp]` leaves an operand
    // split `[tp, dp]` to be gathered over `dp` alone.
    let assign = |f: usize, axes: &[Axis], partial: &[Axis], taken: &mut Vec<Axis>, factor_axes: &mut Vec<Vec<Axis>>| {
        if rule.factors[f] == FactorKind::Blocked || !axes.starts_with(&factor_axes[f]) {
            return;
        }
        let more: Vec<Axis> = axes[factor_axes[f].len()..].iter().take_while(|a| !taken.contains(a) && !partial.contains(a)).copied().collect();
        taken.extend(&more);
        factor_axes[f].extend(more);
    };
    // Round 0: the tensor-parallel axis of results a strategy pinned (sequence
    // parallelism's residual stream, gradients in their optimizer state's layout). Only tp:
    // a pinned dp split (a ZeRO gradient) is reached by reduce-scattering the result, not by
    // taking dp from the batch.
    // A pinned dimension split over the sequence's cp parts and then tp (sequence
    // parallelism under context parallelism) takes both.
    for (j, dims) in rule.results.iter().enumerate() {
        if let Some(pin) = func.constraints.get(&op.results[j]) {
            for (d, &f) in dims.iter().enumerate() {
                let Some(axes) = pin.split.get(d) else { continue };
                let through_tp = match axes.as_slice() {
                    [TP, ..] => &axes[..1],
                    [CP, TP, ..] => &axes[..2],
                    // An expert weight's gradient is computed on the rank of its experts.
                    [EP, ..] => &axes[..1],
                    _ => continue,
                };
                assign(f, through_tp, &[], &mut taken, &mut factor_axes);
            }
        }
    }
    // Then operands: the tensor-parallel axis from parameters first (a column-parallel
    // weight keeps its split and the activation is gathered, not the weight), then every
    // axis from activations and inputs, then from parameters and optimizer state (a
    // ZeRO-sharded parameter is gathered where it is used rather than taking dp from the
    // batch). The first round takes a dimension's outermost axis when it is tp (a ZeRO shard
    // of a tensor-parallel weight is split `[tp, dp]`: the matmul keeps tp, gathers dp).
    let is_param = |v: &shardc_ir::Value| index.is_state(*v);
    let params: Vec<usize> = (0..op.operands.len()).filter(|&i| is_param(&op.operands[i])).collect();
    let activations: Vec<usize> = (0..op.operands.len()).filter(|&i| !is_param(&op.operands[i])).collect();
    // Expert parallelism is kept the same way: experts split over ep stay where they are
    // and the tokens travel to them (an all-to-all), not the experts to the tokens.
    let rounds: [(&[usize], &[Axis]); 3] = [(&params, &[TP, EP]), (&activations, &[]), (&params, &[])];
    for (operands, only) in rounds {
        for &i in operands {
            for (d, &f) in rule.operands[i].iter().enumerate() {
                let axes: Vec<Axis> = current[i].split.get(d).cloned().unwrap_or_default();
                let axes: &[Axis] = match axes.first() {
                    _ if only.is_empty() => &axes,
                    Some(a) if only.contains(a) => &axes[..1],
                    _ => continue,
                };
                assign(f, axes, &current[i].partial, &mut taken, &mut factor_axes);
            }
        }
    }
    let required: Vec<Sharding> = rule
        .operands
        .iter()
        .enumerate()
        .map(|(i, dims)| Sharding {
            split: dims.iter().map(|&f| factor_axes[f].clone()).collect(),
            partial: if keeps_partial(i) { current[i].partial.clone() } else { Vec::new() },
        })
        .collect();
    let in_operands: Vec<usize> = rule.operands.iter().flatten().copied().collect();
    let results = rule
        .results
        .iter()
        .map(|dims| {
            let mut partial: Vec<Axis> = if rule.linearity == Linearity::IgnoresValues { Vec::new() } else { pass_through.clone() };
            for (f, axes) in factor_axes.iter().enumerate() {
                if !axes.is_empty() && in_operands.contains(&f) && !dims.contains(&f) && rule.factors[f] != FactorKind::Collective {
                    partial.extend(axes);
                }
            }
            partial.sort_unstable();
            partial.dedup();
            Sharding { split: dims.iter().map(|&f| factor_axes[f].clone()).collect(), partial }
        })
        .collect();
    Ok(OpPlan { operands: required, results, factor_axes })
}
