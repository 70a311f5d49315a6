//! `split-stages`: cuts the (partitioned) `@train_step` into pipeline stages.
//!
//! Input: `@train_step` from the optimizer pass (and, on a multi-rank mesh, the sharding
//! passes), over a grid whose third axis is `pp`. Output: `@stage0 .. @stage{S-1}` (S = pp x
//! virtual stages per rank) and no `@train_step`. Stage `k` runs on pipeline rank `k % pp`
//! as its model chunk `k / pp` (round-robin, so interleaved 1F1B falls out).
//!
//! **Where ops go.** The model is cut into blocks: the embedding, each layer's attention
//! block and MLP block, and the head (final norm, LM head, loss). Each block weighs what its
//! ops cost (forward, backward and update ops together, priced by the registry's FLOP and
//! byte facts on a roofline, see [`op_time`]), and consecutive blocks are dealt to stages to
//! minimise the heaviest stage, so the embedding and the head weigh on the first and last
//! stages. A manual split (`layers` ranges per stage) overrides the balance. Every op follows
//! its block by location (`layers.3.mlp.up.grad` is layer 3's MLP block, `optimizer.<param>`
//! is that parameter's block).
//!
//! **Phases.** Each op of a stage gets an `xf.phase`: `forward` (everything the loss needs),
//! `backward`, `weight` (with `split_weight_grads`: backward ops no other stage waits for,
//! the weight gradients that zero-bubble schedules defer) and `step` (updates and everything
//! else the optimizer pass made, such as the global gradient norm, and the gradient
//! collectives that only feed them: summation commutes with them, so they run once
//! on the gradients accumulated over the micro-batches). Ops are ordered phase by phase, so
//! each phase is one contiguous section of the stage. The runtime runs the forward, backward
//! and weight sections once per micro-batch, keeps what a later section of the same
//! micro-batch reads, sums what the step section reads over the micro-batches, and runs the
//! step section once per global batch. The loss seed becomes `1/m`, so the summed gradients
//! are those of the mean loss over the `m` micro-batches. Gradient collectives and gradient
//! sums (`xf.add`) that only feed updates move into the step section too: they are linear, so
//! a data-parallel all-reduce runs once per step on the summed gradient, not per micro-batch
//! (and `bucket-step-gradients` then puts those all-reduces in buckets).
//!
//! **Boundaries.** A value made on one stage and read on another travels by an explicit
//! `shard.send` on the sender and a `shard.recv` on the receiver, over the `pp` grid axis,
//! paired by an `xf.transfer` number and sent once per micro-batch. The receive buffer is a
//! `tensor.empty`. Step sections exchange once per step instead: a parameter read on several
//! stages (tied embeddings) is mirrored on each; the readers send their gradient contribution,
//! summed over the micro-batches, to the stage that updates it, which sends the updated value
//! back (Megatron-LM's embedding group, as point-to-point transfers). A step section sends
//! first and receives right before a value's first use, so no two stages wait on each other.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use shardc_ir::facts::{Block, Role};
use shardc_ir::mesh::PP_AXIS;
use shardc_ir::ops::lookup;
use shardc_ir::{ArgRole, AttrValue, Attrs, Func, FuncBuilder, Module, Op, Phase, TensorTy, Value};

use crate::{Changed, Pass, PassError};

/// The `split-stages` pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitStages {
    /// Pipeline ranks (the `pp` axis).
    pub ranks: usize,
    /// Model chunks per rank (interleaved schedules); stages = ranks x chunks.
    pub chunks: usize,
    /// Micro-batches per optimizer step (scales the loss seed).
    pub microbatches: usize,
    /// Layer ranges per stage (`0..=5, 6..=11`), overriding the cost balance.
    pub manual: Option<Vec<(usize, usize)>>,
    /// Split the backward into input-gradient (`backward`) and weight-gradient (`weight`)
    /// sections, for zero-bubble schedules.
    pub split_weight_grads: bool,
}


/// Roofline time of one op on a reference accelerator (989 TFLOP/s dense, 3.35 TB/s of
/// memory bandwidth: an H100 SXM), in seconds. Only ratios matter for balancing stages.
pub fn op_time(func: &Func, op: &Op) -> f64 {
    let Some(def) = lookup(&op.name) else {
        return 0.0;
    };
    let inputs: Vec<&TensorTy> = op.operands.iter().filter_map(|v| func.tensor(*v)).collect();
    let outputs: Vec<TensorTy> = op.results.iter().filter_map(|v| func.tensor(*v).cloned()).collect();
    let cost = def.cost(&inputs, &outputs, &op.attrs);
    (cost.flops / 989e12).max(cost.bytes / 3.35e12)
}

/// Index of a block: 0 the embedding, `1 + 2N` layer N's attention, `2 + 2N` its MLP,
/// `2L + 1` the head (`head`); `None` for ops the model did not place.
fn block_of(block: Block, head: usize) -> Option<usize> {
    match block {
        Block::Embedding => Some(0),
        Block::Attention(n) => Some(1 + 2 * n as usize),
        Block::Mlp(n) => Some(2 + 2 * n as usize),
        Block::Head => Some(head),
        Block::Unplaced => None,
    }
}

/// Deals `costs` (consecutive blocks) to `stages` stages minimising the heaviest; returns
/// each block's stage. Stages may stay empty only when there are fewer blocks than stages.
pub fn balance(costs: &[f64], stages: usize) -> Vec<usize> {
    let n = costs.len();
    if n < stages {
        // Fewer blocks than stages: spread them so the first and last stay at the ends (the
        // loss must be on the last stage), leaving empty stages between.
        let last = n.saturating_sub(1).max(1);
        return (0..n).map(|i| (i * (stages - 1) + last / 2) / last).collect();
    }
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |s, c| {
            *s += c;
            Some(*s)
        }))
        .collect();
    let min_per_stage = 1;
    // best[k][i]: heaviest stage when the first i blocks fill k stages; cut[k][i]: where the
    // k-th stage starts.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; stages + 1];
    let mut cut = vec![vec![0usize; n + 1]; stages + 1];
    best[0][0] = 0.0;
    for k in 1..=stages {
        for i in 0..=n {
            for j in 0..=i {
                if i - j < min_per_stage || best[k - 1][j] == inf {
                    continue;
                }
                let heaviest = best[k - 1][j].max(prefix[i] - prefix[j]);
                // Ties go to the later cut: earlier stages stay lighter (they hold more
                // micro-batches' activations in 1F1B).
                if heaviest <= best[k][i] {
                    best[k][i] = heaviest;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut stage_of = vec![0; n];
    let mut i = n;
    for k in (1..=stages).rev() {
        let j = cut[k][i];
        for s in &mut stage_of[j..i] {
            *s = k - 1;
        }
        i = j;
    }
    stage_of
}

/// [`balance`] of blocks some of which are tied to the block before them (`tied[i]`: block
/// `i` must share block `i - 1`'s stage): tied runs are dealt as one.
pub fn balance_tied(costs: &[f64], tied: &[bool], stages: usize) -> Vec<usize> {
    let mut group = Vec::with_capacity(costs.len());
    let mut group_costs: Vec<f64> = Vec::new();
    for (i, &c) in costs.iter().enumerate() {
        if i == 0 || !tied.get(i).copied().unwrap_or(false) {
            group_costs.push(0.0);
        }
        *group_costs.last_mut().expect("a group was started") += c;
        group.push(group_costs.len() - 1);
    }
    let stage_of_group = balance(&group_costs, stages);
    group.iter().map(|&g| stage_of_group[g]).collect()
}

impl Pass for SplitStages {
    fn name(&self) -> &'static str {
        "split-stages"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let user = |message: String| PassError::User { pass: self.name().into(), message };
        let index = module.funcs.iter().position(|f| f.name == "train_step").ok_or_else(|| user("the module has no @train_step to split".into()))?;
        let grid = module.grids.first().ok_or_else(|| user("the module has no grid; the sharding passes make one".into()))?;
        if grid.shape.get(PP_AXIS).copied() != Some(self.ranks as i64) {
            return Err(user(format!("the grid {:?} has no pp axis of size {}", grid.shape, self.ranks)));
        }
        let stages = split(&module.funcs[index], self, &grid.name).map_err(user)?;
        module.funcs.remove(index);
        module.funcs.extend(stages);
        Ok(Changed::Yes)
    }
}

/// Per-op facts of the split.
struct Plan {
    phase: Vec<Phase>,
    stage: Vec<usize>,
}

fn split(func: &Func, options: &SplitStages, grid: &str) -> Result<Vec<Func>, String> {
    let n_stages = options.ranks * options.chunks;
    if n_stages == 0 || options.microbatches == 0 {
        return Err("stages and micro-batches must be at least 1".into());
    }
    let loss = match (func.returns.first(), func.result_names.first()) {
        (Some(v), Some(name)) if name == "loss" => *v,
        _ => return Err("@train_step must return the loss first".into()),
    };
    let layers = func.ops.iter().filter_map(|op| op.origin.block.layer()).max().map_or(0, |l| l as usize + 1);
    let head = 2 * layers + 1;
    let n_blocks = head + 1;

    // Producer of each value, consumers of each value.
    let mut producer: HashMap<Value, usize> = HashMap::new();
    let mut consumers: HashMap<Value, Vec<usize>> = HashMap::new();
    for (i, op) in func.ops.iter().enumerate() {
        for r in &op.results {
            producer.insert(*r, i);
        }
        for v in &op.operands {
            consumers.entry(*v).or_default().push(i);
        }
    }

    // Phases: the loss's ancestors are the forward; updates and what follows them, plus the
    // collectives that only feed them, are the step; the rest is the backward.
    let n = func.ops.len();
    let mut phase = vec![Phase::Backward; n];
    let mut stack = vec![loss];
    let mut seen = HashSet::new();
    while let Some(v) = stack.pop() {
        if let Some(&i) = producer.get(&v)
            && seen.insert(i)
        {
            phase[i] = Phase::Forward;
            stack.extend(func.ops[i].operands.iter().copied());
        }
    }
    for (i, op) in func.ops.iter().enumerate() {
        let after_update = op.operands.iter().any(|v| producer.get(v).is_some_and(|&p| phase[p] == Phase::Step));
        // What the optimizer pass made (updates, the global norm and its pieces) runs once
        // per step on the accumulated gradients: a norm of each micro-batch's gradients
        // summed would not be the norm of their sum. Not the fp32 cast of a bf16 gradient:
        // it runs per micro-batch, so the accumulation is in fp32.
        let of_optimizer = op.origin.role == Role::Optimizer && op.name != "xf.cast";
        if op.name == "xf.adamw" || op.name == "xf.sgd" || of_optimizer || after_update {
            if phase[i] == Phase::Forward {
                return Err(format!("{}: the loss depends on an optimizer update", op.loc));
            }
            phase[i] = Phase::Step;
        }
    }
    // Values that differ between micro-batches: the forward's, and what depends on them.
    // A backward op that depends on none of them (a ZeRO slice of a parameter for its
    // update, say) computes the same value for every micro-batch; the step must read it
    // once, not summed over the micro-batches.
    let mut varies = vec![false; n];
    for (i, op) in func.ops.iter().enumerate() {
        varies[i] = phase[i] == Phase::Forward || op.operands.iter().any(|v| producer.get(v).is_some_and(|&p| varies[p]));
    }
    for i in (0..n).rev() {
        let op = &func.ops[i];
        // Linear in the gradients: summing over micro-batches first changes nothing.
        let linear = op.name.starts_with("shard.") || op.name == "xf.wait" || op.name == "xf.add";
        let of_gradients = op.operands.iter().all(|v| producer.get(v).is_some_and(|&p| phase[p] != Phase::Forward));
        let users: Vec<usize> = op.results.iter().flat_map(|r| consumers.get(r).cloned().unwrap_or_default()).collect();
        let moves = (linear && of_gradients) || !varies[i];
        if phase[i] == Phase::Backward && moves && !users.is_empty() && users.iter().all(|&u| phase[u] == Phase::Step) {
            phase[i] = Phase::Step;
        }
    }
    // What the step reads from the backward is summed over the micro-batches: it must be a
    // per-micro-batch value, or the sum would count it m times.
    for (_, op) in func.ops.iter().enumerate().filter(|(i, _)| phase[*i] == Phase::Step) {
        if let Some(p) = op.operands.iter().filter_map(|v| producer.get(v)).find(|&&p| phase[p] == Phase::Backward && !varies[p]) {
            return Err(format!("{}: the step reads `{}` from the backward, but it is the same for every micro-batch and would be summed over them", op.loc, func.ops[*p].loc));
        }
    }

    // Blocks and their costs.
    let mut block: Vec<Option<usize>> = func.ops.iter().map(|op| block_of(op.origin.block, head)).collect();
    // Unlocated ops follow their first located consumer, else their producers.
    for i in (0..n).rev() {
        if block[i].is_none() {
            block[i] = func.ops[i].results.iter().flat_map(|r| consumers.get(r).cloned().unwrap_or_default()).find_map(|u| block[u]);
        }
    }
    for i in 0..n {
        if block[i].is_none() {
            block[i] = func.ops[i].operands.iter().filter_map(|v| producer.get(v).and_then(|&p| block[p])).max();
        }
        if block[i].is_none() {
            return Err(format!("{}: cannot tell which layer `{}` belongs to", func.ops[i].loc, func.ops[i].name));
        }
    }
    let block: Vec<usize> = block.into_iter().map(|b| b.unwrap_or(0)).collect();
    let mut costs = vec![0.0; n_blocks];
    for (i, op) in func.ops.iter().enumerate() {
        costs[block[i]] += op_time(func, op);
    }
    // A value the backward makes in one block and reads in a later one (a layer's attention
    // recomputed for its MLP's backward, under full recomputation) ties the blocks between
    // to one stage: the backward runs from the last stage to the first, so no schedule could
    // send it the other way.
    let mut tied = vec![false; n_blocks];
    // (Step sections exchange values once per step, in any direction.)
    for (c, op) in func.ops.iter().enumerate().filter(|(c, _)| phase[*c] == Phase::Backward) {
        for &p in op.operands.iter().filter_map(|v| producer.get(v)).filter(|&&p| phase[p] == Phase::Backward && block[p] < block[c]) {
            for t in &mut tied[block[p] + 1..=block[c]] {
                *t = true;
            }
        }
    }
    let stage_of_block = match &options.manual {
        Some(ranges) => manual_blocks(ranges, layers, n_stages)?,
        None => balance_tied(&costs, &tied, n_stages),
    };
    let stage: Vec<usize> = block.iter().map(|&b| stage_of_block[b]).collect();
    let plan = Plan { phase, stage };

    // Owner stage of every argument: parameters and their state live where they are updated
    // (else where first read); inputs are fed to every stage that reads them. A parameter
    // read on another stage too (tied embeddings) is mirrored there: the owner sends its
    // updated value once per step, and the reader sends its summed gradient contribution.
    let mut owner: HashMap<Value, usize> = HashMap::new();
    for (i, op) in func.ops.iter().enumerate() {
        for v in &op.operands {
            owner.entry(*v).or_insert(plan.stage[i]);
        }
        if op.name == "xf.adamw" || op.name == "xf.sgd" {
            for v in &op.operands {
                owner.insert(*v, plan.stage[i]);
            }
        }
    }
    let arg_role: HashMap<Value, ArgRole> = func.args.iter().map(|a| (a.value, a.role)).collect();
    // Where a value is made: (stage, phase); `None` for inputs, which every stage has.
    let home = |v: Value| -> Option<(usize, Phase)> {
        match producer.get(&v) {
            Some(&p) => Some((plan.stage[p], plan.phase[p])),
            None if matches!(arg_role.get(&v), Some(ArgRole::Input | ArgRole::Param)) => None,
            None => Some((owner.get(&v).copied().unwrap_or(0), Phase::Forward)),
        }
    };

    // Transfers: (value, from stage, to stage) -> (number, receiving phase).
    let mut transfers: BTreeMap<(Value, usize, usize), (i64, Phase)> = BTreeMap::new();
    let mut next_tag = 0i64;
    for (i, op) in func.ops.iter().enumerate() {
        let (to, consumer_phase) = (plan.stage[i], plan.phase[i]);
        for v in &op.operands {
            let Some((from, made)) = home(*v) else {
                continue;
            };
            if from == to {
                if made == Phase::Forward && consumer_phase == Phase::Step && producer.contains_key(v) {
                    return Err(format!("{}: the update reads a forward value ({v}), which differs per micro-batch", op.loc));
                }
                continue;
            }
            if consumer_phase == Phase::Step && made == Phase::Forward {
                return Err(format!("{}: reads {v} from stage {from} in the step section; a forward value differs per micro-batch", op.loc));
            }
            let receive = consumer_phase;
            // The receive must come after the send in every schedule: forward values flow
            // to later stages, gradients to earlier ones.
            let ordered = match (made, receive) {
                (Phase::Forward, Phase::Forward) => from < to,
                (Phase::Forward, _) => true,
                (Phase::Backward | Phase::Weight, Phase::Backward | Phase::Weight) => from > to,
                // Step sections run after every micro-batch: a gradient summed on one stage
                // goes to another once per step.
                (_, Phase::Step) => true,
                _ => false,
            };
            if !ordered {
                return Err(format!("{}: reads {v}, made on stage {from} in the {} section, on stage {to} in the {} section: no schedule orders that", op.loc, made.label(), receive.label()));
            }
            let entry = transfers.entry((*v, from, to)).or_insert_with(|| {
                next_tag += 1;
                (next_tag - 1, receive)
            });
            entry.1 = entry.1.min(receive);
        }
    }

    // Mirrored parameters: the owner sends the updated value to each other stage reading it.
    let new_value: HashMap<&str, Value> = func.returns.iter().zip(&func.result_names).map(|(v, n)| (n.as_str(), *v)).collect();
    for arg in func.args.iter().filter(|a| a.role == ArgRole::Param) {
        let Some(&home_stage) = owner.get(&arg.value) else { continue };
        // The consumer lists, not a walk of every op per parameter (quadratic in depth).
        let readers: BTreeSet<usize> = consumers.get(&arg.value).into_iter().flatten().map(|&i| plan.stage[i]).collect();
        let Some(&updated) = new_value.get(arg.name.as_str()) else { continue };
        for reader in readers.into_iter().filter(|&r| r != home_stage) {
            transfers.entry((updated, home_stage, reader)).or_insert_with(|| {
                next_tag += 1;
                (next_tag - 1, Phase::Step)
            });
        }
    }

    // Weight-gradient sections: backward ops no transfer to another stage waits for.
    let mut sections = Plan { phase: plan.phase.clone(), stage: plan.stage.clone() };
    if options.split_weight_grads {
        let mut needed: HashSet<usize> = HashSet::new();
        let mut stack: Vec<usize> = transfers
            .iter()
            .filter(|(_, (_, receive))| *receive != Phase::Step)
            .filter_map(|((v, _, _), _)| producer.get(v).copied())
            .filter(|&p| plan.phase[p] == Phase::Backward)
            .collect();
        while let Some(i) = stack.pop() {
            if plan.phase[i] != Phase::Backward || !needed.insert(i) {
                continue;
            }
            for v in &func.ops[i].operands {
                if let Some(&p) = producer.get(v)
                    && plan.stage[p] == plan.stage[i]
                {
                    stack.push(p);
                }
            }
        }
        for i in 0..n {
            if plan.phase[i] == Phase::Backward && !needed.contains(&i) {
                sections.phase[i] = Phase::Weight;
            }
        }
    }

    (0..n_stages).map(|k| build_stage(func, &sections, k, options, grid, &transfers, &producer, &owner, &home)).collect()
}

/// The transfers of `v`, in the map's order: a range of the map, not a walk of all of it
/// (a lookup per operand would otherwise be quadratic in the depth of the model).
fn transfers_of(transfers: &BTreeMap<(Value, usize, usize), (i64, Phase)>, v: Value) -> impl Iterator<Item = (&(Value, usize, usize), &(i64, Phase))> {
    transfers.range((v, 0, 0)..=(v, usize::MAX, usize::MAX))
}

/// Stage of each block for manual layer ranges.
fn manual_blocks(ranges: &[(usize, usize)], layers: usize, stages: usize) -> Result<Vec<usize>, String> {
    if ranges.len() != stages {
        return Err(format!("--stages names {} stages, the pipeline has {stages} (pp x virtual stages)", ranges.len()));
    }
    let mut next = 0;
    let mut stage_of = vec![0; 2 * layers + 2];
    for (k, &(first, last)) in ranges.iter().enumerate() {
        if first != next || last < first {
            return Err(format!("--stages: stage {k} must start at layer {next} and not end before it starts, got {first}-{last}"));
        }
        if last >= layers {
            return Err(format!("--stages: stage {k} ends at layer {last}, but the model's layers are 0-{}", layers.saturating_sub(1)));
        }
        for l in first..=last {
            stage_of[1 + 2 * l] = k;
            stage_of[2 + 2 * l] = k;
        }
        next = last + 1;
    }
    if next != layers {
        return Err(format!("--stages covers layers 0-{} but the model has {layers}", next.saturating_sub(1)));
    }
    stage_of[2 * layers + 1] = stages - 1;
    Ok(stage_of)
}

#[allow(clippy::too_many_arguments)]
fn build_stage(
    func: &Func,
    plan: &Plan,
    k: usize,
    options: &SplitStages,
    grid: &str,
    transfers: &BTreeMap<(Value, usize, usize), (i64, Phase)>,
    producer: &HashMap<Value, usize>,
    owner: &HashMap<Value, usize>,
    home: &dyn Fn(Value) -> Option<(usize, Phase)>,
) -> Result<Func, String> {
    let p = options.ranks;
    let mut fb = FuncBuilder::new(&format!("stage{k}"));
    let mut map: HashMap<Value, Value> = HashMap::new();
    let axes = AttrValue::axes(&[PP_AXIS as u16]);
    let with_phase = |attrs: Attrs, phase: Phase| attrs.with("xf.phase", AttrValue::Str(phase.label().into()));

    // Arguments this stage reads or owns (a parameter read here is mirrored here).
    let mut ops: Vec<usize> = (0..func.ops.len()).filter(|&i| plan.stage[i] == k).collect();
    ops.sort_by_key(|&i| (plan.phase[i], i));
    let used: BTreeSet<Value> = ops.iter().flat_map(|&i| func.ops[i].operands.iter().copied()).collect();
    for arg in &func.args {
        let here = match arg.role {
            ArgRole::Input => used.contains(&arg.value),
            ArgRole::Param => used.contains(&arg.value) || owner.get(&arg.value) == Some(&k),
            ArgRole::OptState | ArgRole::Master => owner.get(&arg.value) == Some(&k),
        };
        if here {
            let v = fb.arg_like(arg, func.ty(arg.value).clone());
            if let Some(layout) = &arg.layout {
                fb.set_layout(v, layout.clone());
            }
            map.insert(arg.value, v);
        }
    }
    let made_in = |v: Value| producer.get(&v).map(|&p| plan.phase[p]);

    // Sends of `v` from this stage whose receive is (`step`) or is not (`!step`) in a step
    // section.
    // Attributes of a send to stage `peer` (`to_stage`) or a receive from it (`from_stage`).
    // What a transfer carries, for `explain`: the value and the stages it goes between.
    let named = |v: Value| producer.get(&v).map_or_else(|| func.args.iter().find(|a| a.value == v).map_or_else(|| format!("{v:?}"), |a| a.name.clone()), |&p| func.ops[p].loc.clone());
    let cause = |v: Value, from: usize, to: usize| AttrValue::Str(format!("`{}` made on stage {from} and read on stage {to}", named(v)));
    let point_to_point = |peer: usize, tag: i64, sending: bool, phase: Phase| {
        let (peer_attr, stage_attr) = if sending { ("destination", "xf.to_stage") } else { ("source", "xf.from_stage") };
        let attrs = Attrs::new()
            .with("grid", AttrValue::Symbol(grid.to_string()))
            .with("grid_axes", axes.clone())
            .with(peer_attr, AttrValue::Ints(vec![(peer % p) as i64]))
            .with("xf.transfer", AttrValue::Int(tag))
            .with(stage_attr, AttrValue::Int(peer as i64));
        with_phase(attrs, phase)
    };
    // Step sections carry `xf.order`, the place of each op in the unsplit step (a send at
    // its value's producer, a receive at its first reader): a rank runs its chunks' step
    // sections merged in that order, so that no chunk waits on a later one of its own rank.
    let ordered = |attrs: Attrs, phase: Phase, order: i64| if phase == Phase::Step { attrs.with("xf.order", AttrValue::Int(order)) } else { attrs };
    let send = |fb: &mut FuncBuilder, map: &HashMap<Value, Value>, v: Value, phase: Phase, step: bool, order: i64| {
        for (&(_, from, to), &(tag, receive)) in transfers_of(transfers, v) {
            if from != k || (receive == Phase::Step) != step {
                continue;
            }
            let attrs = ordered(point_to_point(to, tag, true, phase), phase, order).with("xf.cause", cause(v, from, to));
            fb.op_typed("shard.send", &[map[&v]], attrs, vec![func.ty(v).clone()], &format!("send.{tag}"));
        }
    };
    let receive = |fb: &mut FuncBuilder, map: &mut HashMap<Value, Value>, v: Value, from: usize, tag: i64, phase: Phase, order: i64| {
        let ty = func.ty(v).clone();
        let empty = fb.op_typed("tensor.empty", &[], ordered(with_phase(Attrs::new(), phase), phase, order), vec![ty.clone()], &format!("recv.{tag}.buffer"))[0];
        let attrs = ordered(point_to_point(from, tag, false, phase), phase, order).with("xf.cause", cause(v, from, k));
        let received = fb.op_typed("shard.recv", &[empty], attrs, vec![ty], &format!("recv.{tag}"))[0];
        map.insert(v, received);
    };
    // Per-micro-batch sections receive what they need at their start.
    let receive_all = |fb: &mut FuncBuilder, map: &mut HashMap<Value, Value>, phase: Phase| {
        for (&(v, from, to), &(tag, when)) in transfers {
            if to == k && when == phase && phase != Phase::Step {
                receive(fb, map, v, from, tag, phase, -1);
            }
        }
    };
    // The step section first sends every summed gradient other stages wait for, and
    // receives only right before a value's first use: a stage may wait for another's update
    // only after giving it what that update needs.
    let open_step = |fb: &mut FuncBuilder, map: &HashMap<Value, Value>| {
        let ready: BTreeSet<Value> = transfers
            .iter()
            .filter(|((v, from, _), (_, when))| *from == k && *when == Phase::Step && made_in(*v) != Some(Phase::Step))
            .map(|((v, _, _), _)| *v)
            .collect();
        for v in ready {
            send(fb, map, v, Phase::Step, true, -1);
        }
    };

    receive_all(&mut fb, &mut map, Phase::Forward);
    let mut current = Phase::Forward;
    let advance = |current: &mut Phase, to: Phase, fb: &mut FuncBuilder, map: &mut HashMap<Value, Value>| {
        while *current < to {
            *current = match *current {
                Phase::Forward => Phase::Backward,
                Phase::Backward => Phase::Weight,
                _ => Phase::Step,
            };
            receive_all(fb, map, *current);
            if *current == Phase::Step {
                open_step(fb, map);
            }
        }
    };
    for &i in &ops {
        let op = &func.ops[i];
        let phase = plan.phase[i];
        fb.set_origin(op.origin);
        advance(&mut current, phase, &mut fb, &mut map);
        if phase == Phase::Step {
            for v in &op.operands {
                if !map.contains_key(v)
                    && let Some((&(_, from, _), &(tag, _))) = transfers_of(transfers, *v).find(|((_, _, to), (_, when))| *to == k && *when == Phase::Step)
                {
                    receive(&mut fb, &mut map, *v, from, tag, Phase::Step, i as i64);
                }
            }
        }
        let operands =
            op.operands.iter().map(|v| map.get(v).copied().ok_or_else(|| format!("{}: stage {k} has no {v} (made on stage {:?})", op.loc, home(*v).map(|h| h.0)))).collect::<Result<Vec<_>, _>>()?;
        let mut attrs = ordered(with_phase(op.attrs.clone(), phase), phase, i as i64);
        // The seed of the backward: the loss's gradient, the one gradient fill of ones (the
        // others fill zeros).
        if op.name == "xf.fill_like" && op.origin.role == Role::Gradient && matches!(op.attrs.get("value"), Some(AttrValue::Float(x)) if *x == 1.0) {
            // Each micro-batch's loss is a mean over its tokens; the step's loss is the mean
            // over micro-batches, so each micro-batch's gradient carries a factor 1/m.
            let seed = match op.attrs.get("value") {
                Some(AttrValue::Float(x)) => *x,
                _ => 1.0,
            };
            attrs = attrs.with("value", AttrValue::Float(seed / options.microbatches as f64));
        }
        let results = fb.op_typed(&op.name, &operands, attrs, op.results.iter().map(|r| func.ty(*r).clone()).collect(), &op.loc);
        for (old, new) in op.results.iter().zip(results) {
            map.insert(*old, new);
        }
        for r in &op.results {
            send(&mut fb, &map, *r, phase, phase == Phase::Step, i as i64);
        }
    }
    advance(&mut current, Phase::Step, &mut fb, &mut map);
    // Mirrored parameters' new values arrive last.
    for (&(v, from, to), &(tag, when)) in transfers {
        if to == k && when == Phase::Step && !map.contains_key(&v) {
            receive(&mut fb, &mut map, v, from, tag, Phase::Step, func.ops.len() as i64 + tag);
        }
    }

    // Results: the loss on the last stage, each owner's updated parameters and state.
    let param_names: HashSet<&str> = func.args.iter().filter(|a| a.role == ArgRole::Param).map(|a| a.name.as_str()).collect();
    let (mut values, mut names) = (Vec::new(), Vec::new());
    for (v, name) in func.returns.iter().zip(&func.result_names) {
        let made_here = match producer.get(v) {
            Some(&p) => plan.stage[p] == k,
            None => owner.get(v) == Some(&k),
        };
        // A mirror returns the owner's update under the parameter's name.
        let mirrored = transfers_of(transfers, *v).any(|((_, _, to), (_, when))| *to == k && *when == Phase::Step) && param_names.contains(name.as_str());
        if made_here || mirrored {
            values.push(map[v]);
            names.push(name.clone());
        }
    }
    Ok(fb.finish(&values, &names))
}
