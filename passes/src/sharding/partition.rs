//! `partition`: rewrites an annotated function into the per-rank SPMD program.
//!
//! Input: a function annotated by propagation. Output: the same function over per-rank
//! tensor types, every argument recording the global tensor it is a shard of, and an
//! explicit `shard` collective wherever a value's sharding differs from what its consumer
//! needs. Per dimension only the axes past the common prefix of the two splits move (a
//! dimension split `[tp, dp]`, a ZeRO shard of a tensor-parallel shard, is gathered over
//! `dp` alone where `[tp]` is wanted), in this order:
//! - `shard.all_slice` of each dimension that should be split further, over axes that are
//!   not reduced and do not move from another dimension (a local slice, no communication:
//!   the reduction that follows then moves only this rank's part);
//! - `shard.all_reduce` over the axes a value is partial over and its consumer cannot take
//!   partial (the sum of a row-parallel matmul before its bias, a gradient before a norm),
//!   or `shard.reduce_scatter` when the consumer wants it split further over those same
//!   axes (a gradient arriving at its ZeRO optimizer shard, on its tensor-parallel shard);
//! - `shard.all_gather` of every dimension split over axes it should not be, then the
//!   remaining `shard.all_slice`s. Gathers come first: an axis that moves between
//!   dimensions must never split two of them at once.
//!
//! Every collective carries `xf.cause`, naming the op and operand that needed it; the same
//! reshard of one value is made once and shared by its consumers, except a gather of a
//! parameter (ZeRO-3), made once for the forward pass (the loss's ancestors) and once for
//! the backward and marked `xf.per_reader`, so that no whole parameter lives from its
//! forward reader to its backward one (ZeRO-3's 1.5x the volume of data parallelism). Returned values
//! take their argument's sharding when they update it in place (parameters, optimizer
//! state), and are otherwise replicated (the loss, reduced over the data-parallel axis).

use std::collections::HashMap;

use shardc_ir::sharding::{Axis, Sharding};
use shardc_ir::{ArgLayout, AttrValue, Attrs, Func, FuncBuilder, Module, Reduction, TensorTy, Type, Value};

use super::{plan_op_in, sharding_of, FuncIndex};
use crate::{Changed, Pass, PassError};

/// The `partition` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct Partition;

impl Pass for Partition {
    fn name(&self) -> &'static str {
        "partition"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let Some(grid) = module.grids.first().cloned() else {
            return Ok(Changed::No);
        };
        for func in module.funcs.iter_mut().filter(|f| !f.shardings.is_empty()) {
            *func = partition_func(func, &grid.name, &grid.shape)
                .map_err(|message| PassError::User { pass: "partition".into(), message: format!("@{}: {message}", func.name) })?;
        }
        Ok(Changed::Yes)
    }
}

/// A grid axis that `current` splits last along dimension `from` and `target` last along
/// dimension `to`, everything else of those two dimensions as `target` wants it, and nothing
/// partial over it: what one all-to-all does.
fn moved_axis(current: &Sharding, target: &Sharding) -> Option<(usize, usize, Axis)> {
    (0..current.split.len()).find_map(|from| {
        let (&axis, rest) = current.split[from].split_last()?;
        if current.partial.contains(&axis) || target.split[from] != rest {
            return None;
        }
        let to = (0..current.split.len()).find(|&to| to != from && target.split[to].split_last() == Some((&axis, current.split[to].as_slice())))?;
        Some((from, to, axis))
    })
}

/// Builds the per-rank function.
struct Partitioner<'f> {
    global: &'f Func,
    /// The global function's arguments, indexed.
    index: FuncIndex,
    grid: String,
    grid_shape: Vec<i64>,
    fb: FuncBuilder,
    /// Global value -> its per-rank value, with the sharding that value has.
    local: HashMap<Value, (Value, Sharding)>,
    /// Reshards already made: (global value, target sharding) -> per-rank value.
    reshards: HashMap<(Value, Sharding), Value>,
    /// Reshards that gather a parameter, and whether a forward op made them: forgotten when
    /// the pass leaves that phase.
    per_reader: Vec<((Value, Sharding), bool)>,
    /// Whether the op being partitioned is in the forward pass (an ancestor of the loss).
    forward: bool,
}

impl Partitioner<'_> {
    fn local_type(&self, global: &TensorTy, sharding: &Sharding) -> Result<TensorTy, String> {
        Ok(TensorTy::new(sharding.local_shape(&global.shape, &self.grid_shape)?, global.dtype))
    }

    /// Emits one collective on `value` and returns its result.
    fn collective(&mut self, name: &str, value: Value, attrs: Attrs, result: TensorTy, loc: &str, cause: &str) -> Value {
        let attrs = attrs.with("grid", AttrValue::Symbol(self.grid.to_string())).with("xf.cause", AttrValue::Str(cause.to_string()));
        self.fb.op_typed(name, &[value], attrs, vec![Type::Tensor(result)], loc)[0]
    }

    /// The per-rank value of `value` laid out as `target`, emitting collectives as needed.
    ///
    /// Per dimension, the axes past the longest common prefix of the current and the target
    /// split move: a `[tp, dp]` shard wanted `[tp]` is gathered over `dp` within its
    /// tensor-parallel shard, and one wanted `[tp, dp]` from `[tp]` is sliced over `dp`. In
    /// order: local slices over axes that neither move from another dimension nor are
    /// reduced (a partial sum sliced is the partial sum of the slice, so the reduction moves
    /// only this rank's part); the reduction, as one reduce-scatter when the dimension's
    /// remaining slice is over exactly the reduced axes, else an all-reduce; every gather;
    /// then the remaining slices. Gathers precede those slices because an axis may move from
    /// one dimension to another (dp from the vocabulary to the batch), and it must never
    /// split two at once.
    fn reshard(&mut self, value: Value, target: &Sharding, loc: &str, cause: &str) -> Result<Value, String> {
        let (mut v, mut s) = self.local[&value].clone();
        if s == *target {
            return Ok(v);
        }
        if let Some(done) = self.reshards.get(&(value, target.clone())) {
            return Ok(*done);
        }
        let global = self.global.tensor(value).ok_or("non-tensor value")?.clone();
        if target.partial.iter().any(|a| !s.partial.contains(a)) {
            return Err(format!("{loc}: cannot make a complete value partial ({cause})"));
        }
        let rank = global.rank();
        // An axis that leaves the end of one dimension's split for the end of another's, the
        // rest of both already in place, is one all-to-all: tokens dispatched to the experts
        // of their ep rank, and combined back.
        while let Some((from, to, axis)) = moved_axis(&s, target) {
            s.split[from].pop();
            s.split[to].push(axis);
            let ty = self.local_type(&global, &s)?;
            let attrs = Attrs::new().with("grid_axes", AttrValue::axes(&[axis])).with("split_axis", AttrValue::Index(to)).with("concat_axis", AttrValue::Index(from));
            let what = format!("{} moved from dimension {from} to dimension {to} for {cause}", shardc_ir::mesh::axis_name(axis as usize));
            v = self.collective("shard.all_to_all", v, attrs, ty, &format!("{loc}.all_to_all"), &what);
        }
        if s == *target {
            self.reshards.insert((value, target.clone()), v);
            return Ok(v);
        }
        let reduce: Vec<Axis> = s.partial.iter().copied().filter(|a| !target.partial.contains(a)).collect();
        let common = |a: &[Axis], b: &[Axis]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let gathered_axes: Vec<Axis> = (0..rank).flat_map(|d| s.split[d][common(&s.split[d], &target.split[d])..].to_vec()).collect();
        // Local slices first, on dimensions that gather nothing.
        for d in 0..rank {
            if s.split[d].len() != common(&s.split[d], &target.split[d]) {
                continue;
            }
            let axes: Vec<Axis> = target.split[d][s.split[d].len()..].iter().take_while(|a| !reduce.contains(a) && !gathered_axes.contains(a)).copied().collect();
            if !axes.is_empty() {
                v = self.slice(v, &mut s, &global, d, &axes, loc, cause)?;
            }
        }
        // A sum over a group of one rank (the dp axis of a grid whose data-parallel ranks are
        // one expert group) is the value itself.
        let reduce: Vec<Axis> = reduce.into_iter().filter(|&a| self.grid_shape.get(a as usize).copied().unwrap_or(1) > 1).collect();
        if reduce.is_empty() {
            s.partial.retain(|a| target.partial.contains(a));
        }
        if !reduce.is_empty() {
            s.partial.retain(|a| target.partial.contains(a));
            // A partial sum that is then sliced over the same axes along one dimension is one
            // reduce-scatter: each rank receives only the reduced part it keeps, of the shard
            // it holds (the tensor-parallel shard of a ZeRO gradient split `[tp, dp]`).
            let scatter = (0..rank).find(|&d| target.split[d].len() == s.split[d].len() + reduce.len() && target.split[d].starts_with(&s.split[d]) && target.split[d].ends_with(&reduce));
            let reduction = AttrValue::Reduction(Reduction::Sum);
            if let Some(d) = scatter {
                s.split[d] = target.split[d].clone();
                let ty = self.local_type(&global, &s)?;
                let attrs = Attrs::new().with("grid_axes", AttrValue::axes(&reduce)).with("reduction", reduction).with("scatter_axis", AttrValue::Index(d));
                v = self.collective("shard.reduce_scatter", v, attrs, ty, &format!("{loc}.reduce_scatter"), &format!("partial sum reduce-scattered along dimension {d} for {cause}"));
            } else {
                let ty = self.local_type(&global, &s)?;
                let attrs = Attrs::new().with("grid_axes", AttrValue::axes(&reduce)).with("reduction", reduction);
                v = self.collective("shard.all_reduce", v, attrs, ty, &format!("{loc}.all_reduce"), &format!("partial sum reduced for {cause}"));
            }
        }
        // A parameter kept sharded (ZeRO-3) is gathered once for the forward pass and once
        // for the backward: sharing one gather between the two would hold the whole parameter
        // from its forward reader to its backward one, the memory ZeRO-3 spends communication
        // to save. Such gathers are marked `xf.per_reader` (comm-opt keeps them apart) and are
        // shared only by readers of one phase (a tied embedding's lookup and LM head).
        let parameter = self.index.is_param(value);
        let mut gathered = false;
        for d in 0..rank {
            let keep = common(&s.split[d], &target.split[d]);
            if s.split[d].len() > keep {
                let axes = s.split[d].split_off(keep);
                let ty = self.local_type(&global, &s)?;
                let mut attrs = Attrs::new().with("grid_axes", AttrValue::axes(&axes)).with("gather_axis", AttrValue::Index(d));
                if parameter {
                    attrs = attrs.with("xf.per_reader", AttrValue::Bool(true));
                }
                v = self.collective("shard.all_gather", v, attrs, ty, &format!("{loc}.all_gather"), &format!("dimension {d} gathered for {cause}"));
                gathered = true;
            }
        }
        for d in 0..rank {
            if s.split[d] != target.split[d] {
                let axes = target.split[d][s.split[d].len()..].to_vec();
                v = self.slice(v, &mut s, &global, d, &axes, loc, cause)?;
            }
        }
        if gathered && parameter {
            self.per_reader.push(((value, target.clone()), self.forward));
        }
        self.reshards.insert((value, target.clone()), v);
        Ok(v)
    }

    /// Slices dimension `d` of `v` (laid out as `s`) further over `axes`: a local copy.
    #[allow(clippy::too_many_arguments)]
    fn slice(&mut self, v: Value, s: &mut Sharding, global: &TensorTy, d: usize, axes: &[Axis], loc: &str, cause: &str) -> Result<Value, String> {
        s.split[d].extend_from_slice(axes);
        let ty = self.local_type(global, s)?;
        let attrs = Attrs::new().with("grid_axes", AttrValue::axes(axes)).with("slice_axis", AttrValue::Index(d));
        Ok(self.collective("shard.all_slice", v, attrs, ty, &format!("{loc}.all_slice"), &format!("dimension {d} sliced for {cause}")))
    }
}

/// Vocab-parallel cross-entropy: when the loss or its gradient reads logits split along the
/// vocabulary, emit it as per-rank pieces joined by all-reduces of per-token values (the
/// global row max, the sum of exponentials, the target's logit) instead of gathering the
/// logits. Returns the per-rank result, or `None` when the op is not such a loss.
fn vocab_parallel_loss(p: &mut Partitioner<'_>, func: &Func, op: &shardc_ir::Op, plan: &super::OpPlan, operands: &[Value]) -> Result<Option<Value>, String> {
    if op.name != "xf.cross_entropy" && op.name != "xf.cross_entropy_grad" {
        return Ok(None);
    }
    let logits = func.tensor(op.operands[0]).ok_or("non-tensor logits")?.clone();
    let axes = plan.factor_axes[logits.rank() - 1].clone();
    if axes.is_empty() {
        return Ok(None);
    }
    let tokens: i64 = logits.shape[..logits.rank() - 1].iter().product();
    let local_logits = p.fb.tensor(operands[0]).ok_or("non-tensor logits")?.clone();
    // Per-token statistics and the loss in the loss's type (fp32 for bf16 logits).
    let statistics = shardc_ir::ops::lookup("xf.cross_entropy").ok_or("no xf.cross_entropy")?.infer(&[&local_logits, &TensorTy::new(local_logits.shape[..local_logits.rank() - 1].to_vec(), shardc_ir::DType::I32)], &Attrs::new())?[0].dtype;
    let per_token = Type::Tensor(TensorTy::new(local_logits.shape[..local_logits.rank() - 1].to_vec(), statistics));
    let per_token_ty = per_token.as_tensor().cloned().ok_or("per-token type")?;
    let split = AttrValue::axes(&axes);
    let reduce = |p: &mut Partitioner<'_>, v: Value, kind: Reduction, what: &str| {
        let attrs = Attrs::new().with("grid_axes", AttrValue::axes(&axes)).with("reduction", AttrValue::Reduction(kind));
        p.collective("shard.all_reduce", v, attrs, per_token_ty.clone(), &format!("{}.{what}", op.loc), &format!("vocab-parallel cross-entropy of `{}`: {what} over the vocabulary shards", op.loc))
    };
    // A padded vocabulary: every piece leaves out the classes past the real ones.
    let with_classes = |attrs: Attrs| match op.attrs.get("xf.classes") {
        Some(classes) => attrs.with("xf.classes", classes.clone()).with("xf.vocab_split_axes", split.clone()),
        None => attrs,
    };
    let local_max = p.fb.op_typed("xf.row_max", &operands[..1], with_classes(Attrs::new()), vec![per_token.clone()], &format!("{}.row_max", op.loc))[0];
    let max = reduce(p, local_max, Reduction::Max, "max");
    let stats = p.fb.op_typed(
        "xf.cross_entropy_stats",
        &[operands[0], operands[1], max],
        with_classes(Attrs::new().with("xf.vocab_split_axes", split.clone())),
        vec![per_token.clone(), per_token.clone()],
        &format!("{}.stats", op.loc),
    );
    let sumexp = reduce(p, stats[0], Reduction::Sum, "sumexp");
    let result = if op.name == "xf.cross_entropy" {
        let target = reduce(p, stats[1], Reduction::Sum, "target_logit");
        let scalar = Type::Tensor(TensorTy::scalar(statistics));
        p.fb.op_typed("xf.cross_entropy_finish", &[max, sumexp, target], Attrs::new().with("xf.tokens", AttrValue::Int(tokens)), vec![scalar], &op.loc)[0]
    } else {
        let attrs = with_classes(Attrs::new().with("xf.tokens", AttrValue::Int(tokens)).with("xf.vocab_split_axes", split.clone()));
        p.fb.op_typed("xf.cross_entropy_grad_shard", &[operands[0], operands[1], operands[2], max, sumexp], attrs, vec![Type::Tensor(local_logits)], &op.loc)[0]
    };
    Ok(Some(result))
}

/// Which ops are in the forward pass: the ancestors of the function's first result (the
/// loss of a training step); every op of a function without one.
fn forward_ops(func: &Func) -> Vec<bool> {
    let Some(&loss) = func.returns.first().filter(|_| func.result_names.first().is_some_and(|n| n == "loss")) else {
        return vec![true; func.ops.len()];
    };
    let producer: HashMap<Value, usize> = func.ops.iter().enumerate().flat_map(|(i, op)| op.results.iter().map(move |r| (*r, i))).collect();
    let mut forward = vec![false; func.ops.len()];
    let mut stack = vec![loss];
    while let Some(v) = stack.pop() {
        if let Some(&i) = producer.get(&v)
            && !forward[i]
        {
            forward[i] = true;
            stack.extend(func.ops[i].operands.iter().copied());
        }
    }
    forward
}

fn partition_func(func: &Func, grid: &str, grid_shape: &[i64]) -> Result<Func, String> {
    let mut p = Partitioner {
        global: func,
        index: FuncIndex::new(func),
        grid: grid.to_string(),
        grid_shape: grid_shape.to_vec(),
        fb: FuncBuilder::new(&func.name),
        local: HashMap::new(),
        reshards: HashMap::new(),
        per_reader: Vec::new(),
        forward: true,
    };
    let forward = forward_ops(func);
    for arg in &func.args {
        let global = func.tensor(arg.value).ok_or("non-tensor argument")?.clone();
        let sharding = sharding_of(func, arg.value);
        let ty = p.local_type(&global, &sharding).map_err(|e| format!("argument `{}`: {e}", arg.name))?;
        let v = p.fb.arg_like(arg, Type::Tensor(ty));
        p.fb.set_layout(v, ArgLayout { global_shape: global.shape.clone(), sharding: sharding.clone() });
        p.local.insert(arg.value, (v, sharding));
    }
    for (index, op) in func.ops.iter().enumerate() {
        // Every remembered gather was made in the phase of the op before (gathers are made
        // in the current phase), so only a change of phase forgets them, all at once: a
        // walk of them per op would be quadratic under ZeRO-3 (one gather per parameter).
        if forward[index] != p.forward {
            p.forward = forward[index];
            for (key, made_forward) in std::mem::take(&mut p.per_reader) {
                if made_forward == p.forward {
                    p.per_reader.push((key, made_forward));
                } else {
                    p.reshards.remove(&key);
                }
            }
        }
        // What this op needs (reshards of its operands) and makes is placed with it.
        p.fb.set_origin(op.origin);
        let plan = plan_op_in(func, &p.index, op).map_err(|e| format!("{}: {e}", op.loc))?;
        let mut operands = Vec::with_capacity(op.operands.len());
        for (i, (value, target)) in op.operands.iter().zip(&plan.operands).enumerate() {
            let cause = format!("operand {i} of {} `{}`", op.name, op.loc);
            operands.push(p.reshard(*value, target, &op.loc, &cause)?);
        }
        if let Some(result) = vocab_parallel_loss(&mut p, func, op, &plan, &operands)? {
            p.local.insert(op.results[0], (result, plan.results[0].clone()));
            continue;
        }
        let mut types = Vec::with_capacity(op.results.len());
        for (r, s) in op.results.iter().zip(&plan.results) {
            let global = func.tensor(*r).ok_or("non-tensor result")?;
            types.push(Type::Tensor(p.local_type(global, s).map_err(|e| format!("{}: result of `{}`: {e}", op.loc, op.name))?));
        }
        let mut attrs = op.attrs.clone();
        // An op that reads positions of a split sequence offsets them by its rank's part.
        if let Some(f) = shardc_ir::ops::lookup(&op.name).and_then(|def| def.position_factor())
            && let Some(axes) = plan.factor_axes.get(f).filter(|axes| !axes.is_empty())
        {
            attrs = attrs.with("xf.seq_split_axes", AttrValue::axes(axes));
        }
        match op.name.as_str() {
            // A split batch leaves each rank's mean partial: divide by the global count.
            "xf.cross_entropy" | "xf.cross_entropy_grad" => {
                let logits = func.tensor(op.operands[0]).ok_or("non-tensor logits")?;
                let tokens: i64 = logits.shape[..logits.rank() - 1].iter().product();
                attrs = attrs.with("xf.tokens", AttrValue::Int(tokens));
            }
            // A vocab-split table: each rank looks up the rows it holds.
            "xf.embedding" if !plan.factor_axes[0].is_empty() => {
                attrs = attrs.with("xf.row_split_axes", AttrValue::axes(&plan.factor_axes[0]));
            }
            // Its gradient, split the same way: each rank sums into the rows it holds (the
            // vocab factor follows the ids' dimensions and hidden).
            "xf.embedding_grad" => {
                let vocab = func.tensor(op.operands[0]).map_or(0, TensorTy::rank) + 1;
                if let Some(axes) = plan.factor_axes.get(vocab).filter(|axes| !axes.is_empty()) {
                    attrs = attrs.with("xf.row_split_axes", AttrValue::axes(axes));
                    // `vocab` is the rows the result holds: a per-rank size, as heads are.
                    if let Some(Type::Tensor(t)) = types.first() {
                        attrs = attrs.with("vocab", AttrValue::Int(t.shape[0]));
                    }
                }
            }
            _ => {}
        }
        // An op that works per head (attention, rotary embedding, the head repeats) must get
        // whole heads on every rank: a split of its features into parts of heads is the
        // user's mesh, not a program to build.
        if attrs.get("head_dim").is_some()
            && let Some(def) = shardc_ir::ops::lookup(&op.name)
        {
            let local: Vec<&TensorTy> = operands.iter().filter_map(|v| p.fb.tensor(*v)).collect();
            if let Err(e) = def.infer(&local, &attrs) {
                return Err(format!("{}: tensor parallelism splits `{}` into parts that are not whole heads ({e}): use a tp that divides the number of heads and of kv heads", op.loc, op.name));
            }
        }
        let results = p.fb.op_typed(&op.name, &operands, attrs, types, &op.loc);
        for ((global, local), s) in op.results.iter().zip(results).zip(plan.results) {
            p.local.insert(*global, (local, s));
            // A pinned result is resharded right away, and every consumer sees the pin.
            if let Some(pin) = func.constraints.get(global) {
                let pinned = p.reshard(*global, pin, &op.loc, &format!("the layout pinned on the result of `{}`", op.loc))?;
                p.local.insert(*global, (pinned, pin.clone()));
            }
        }
    }
    p.fb.set_origin(Default::default());
    let mut returns = Vec::with_capacity(func.returns.len());
    // The first argument of each name, as a search of the arguments would find it.
    let mut arg_named: HashMap<&str, &shardc_ir::graph::FuncArg> = HashMap::with_capacity(func.args.len());
    for arg in &func.args {
        arg_named.entry(arg.name.as_str()).or_insert(arg);
    }
    for (value, name) in func.returns.iter().zip(&func.result_names) {
        // A state update keeps its argument's layout; anything else is replicated.
        let target = match arg_named.get(name.as_str()) {
            Some(arg) => sharding_of(func, arg.value),
            None => Sharding::replicated(func.tensor(*value).map_or(0, TensorTy::rank)),
        };
        returns.push(p.reshard(*value, &target, &format!("return.{name}"), &format!("result `{name}`"))?);
    }
    Ok(p.fb.finish(&returns, &func.result_names))
}
