//! `overlap-collectives`: a collective that has independent compute to hide behind runs
//! asynchronously, as Megatron's tensor-parallel layers overlap a data gradient's
//! all-reduce (or, with sequence parallelism, reduce-scatter) with the weight gradient's
//! GEMM.
//!
//! Input: a partitioned training step without pipeline stages, after `bucket-gradients`,
//! or the stages of `split-stages` (after `bucket-step-gradients`), each forward, backward
//! and weight section on its own: nothing moves across a section's edge and every wait lies
//! in its collective's section (at the section's end at the latest), with its phase and
//! `xf.order`.
//! Each synchronous sum all-reduce, reduce-scatter, or all-gather of contiguous blocks
//! (gathered along its first dimension of more than one element) first moves up to just
//! after the op that makes its operand: nothing between them reads its result, and what
//! stood between now runs while it is on the wire. If any compute op then lies between it
//! and its first reader (for a scatter, which holds its whole input until its wait, or the
//! next collective over the same axes: one in flight per communicator), it is marked
//! `xf.async` as a bucket of its own (`xf.bucket`, `xf.bucket_members = 1`) and its readers
//! read an `xf.wait` placed just before that point.
//! Backends run it on its communicator's stream (a reduce-scatter along an inner dimension
//! stages its blocks in a buffer of its own) and join it at the wait; the CPU backend on its
//! communication thread. A gather along an inner dimension would need its blocks rearranged
//! after the wait, so it stays synchronous. Gathers of arguments (ZeRO-3's parameter
//! shards, gathered where they are read) are prefetched: each goes out as early as the bytes
//! of those out ahead of their first reader stay within `prefetch_bytes`.

use std::collections::{HashMap, HashSet};

use shardc_ir::{AttrValue, Attrs, Func, Module, Op, Reduction, Value};

use crate::{Changed, Pass, PassError};

/// The `overlap-collectives` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct OverlapCollectives {
    /// Most bytes of parameter gathers out ahead of their first reader (0: none ahead).
    pub prefetch_bytes: u64,
}

/// Whether `op` is a collective this pass may make asynchronous.
fn candidate(func: &Func, op: &Op) -> bool {
    if op.attrs.get("xf.async").is_some() || op.operands.len() != 1 || op.results.len() != 1 {
        return false;
    }
    let Some(t) = func.tensor(op.operands[0]) else { return false };
    if t.dtype == shardc_ir::DType::I32 {
        return false;
    }
    let sum = op.attrs.get("reduction").is_none() || op.attrs.reduction("reduction") == Ok(Reduction::Sum);
    match op.name.as_str() {
        "shard.all_reduce" | "shard.reduce_scatter" => sum,
        "shard.all_gather" => {
            let axis = op.attrs.index("gather_axis").ok();
            axis.is_some_and(|a| a <= t.shape.len() && t.shape[..a].iter().all(|&d| d == 1))
        }
        _ => false,
    }
}

/// Whether `op` is work a collective can hide behind.
fn computes(op: &Op) -> bool {
    op.name.starts_with("xf.") && op.name != "xf.wait"
}

impl Pass for OverlapCollectives {
    fn name(&self) -> &'static str {
        "overlap-collectives"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        // Bucket numbers of this pass start past any other's, across the module (a pipeline
        // rank's program joins several stages).
        let mut next_bucket = module.funcs.iter().flat_map(|f| f.ops.iter()).filter_map(|o| match o.attrs.get("xf.bucket") { Some(AttrValue::Int(b)) => Some(*b + 1), _ => None }).max().unwrap_or(0).max(1 << 21);
        if let Some(func) = module.funcs.iter_mut().find(|f| f.name == "train_step") {
            let end = func.ops.len();
            return Ok(if self.overlap_section(func, 0..end, &mut next_bucket, false) { Changed::Yes } else { Changed::No });
        }
        // Pipeline stages: each forward, backward and weight section on its own, so every
        // wait lies in its collective's section (which runs once per micro-batch); the step
        // section's gathers are `bucket-step-gradients`' work.
        let mut changed = Changed::No;
        for func in module.funcs.iter_mut().filter(|f| super::bucket::is_stage(f)) {
            let mut start = 0;
            while start < func.ops.len() {
                let phase = func.ops[start].attrs.get("xf.phase").cloned();
                let end = (start..func.ops.len()).find(|&i| func.ops[i].attrs.get("xf.phase") != phase.as_ref()).unwrap_or(func.ops.len());
                let before = func.ops.len();
                let in_step = matches!(&phase, Some(AttrValue::Str(p)) if p == "step");
                if phase.is_some() && !in_step && self.overlap_section(func, start..end, &mut next_bucket, true) {
                    changed = Changed::Yes;
                }
                // The section grew by its waits.
                start = end + (func.ops.len() - before);
            }
        }
        Ok(changed)
    }
}

impl OverlapCollectives {
    /// Overlaps the collectives among `func`'s ops `range` (the whole step, or one section of
    /// a pipeline stage: `section`, whose waits carry the section's `xf.phase` and its place
    /// in the step's `xf.order`, and go at the section's end at the latest). Returns whether
    /// anything changed.
    fn overlap_section(&self, func: &mut Func, range: std::ops::Range<usize>, next_bucket: &mut i64, section: bool) -> bool {
        // One whose result only the step returns (the loss, for the report) stays: nothing
        // waits on it but the step's end, and its result would live through the step.
        let read: HashSet<Value> = func.ops.iter().flat_map(|o| o.operands.iter().copied()).collect();
        let args: HashSet<Value> = func.args.iter().map(|a| a.value).collect();
        let original: Vec<Op> = func.ops[range.clone()].to_vec();
        let is_candidate = |op: &Op| candidate(func, op) && read.contains(&op.results[0]);
        // A trial with every candidate moved shows which would have compute to hide behind;
        // then only those move (a move that gains nothing would only lengthen a value's life).
        let trial = self.prefetch(func, hoist(original.clone(), &is_candidate), &args, &is_candidate);
        let chosen: HashSet<Value> = overlapped(&trial, &is_candidate).into_iter().map(|(i, _)| trial[i].results[0]).collect();
        let is_chosen = |op: &Op| is_candidate(op) && chosen.contains(&op.results[0]);
        let mut ops = self.prefetch(func, hoist(original, &is_chosen), &args, &is_chosen);
        let marked = overlapped(&ops, &is_chosen);
        if marked.is_empty() {
            return false;
        }
        // A section's waits: its phase, and the order of the op they precede (the section's
        // last op's at its end).
        let section_attrs = |at: Option<&Op>, last: &Op| {
            let mut attrs = Attrs::new();
            if section {
                for key in ["xf.phase", "xf.order"] {
                    if let Some(v) = at.unwrap_or(last).attrs.get(key) {
                        attrs = attrs.with(key, v.clone());
                    }
                }
            }
            attrs
        };
        let last = ops.last().cloned().expect("a section with a marked collective has ops");
        let mut waits: HashMap<usize, Vec<Op>> = HashMap::new();
        let mut waited: HashMap<Value, Value> = HashMap::new();
        let mut at_end = Vec::new();
        for (i, until) in marked {
            let result = ops[i].results[0];
            let bucket = *next_bucket;
            *next_bucket += 1;
            let attrs = section_attrs(until.map(|j| &ops[j]), &last).with("xf.bucket", AttrValue::Int(bucket));
            let op = &mut ops[i];
            op.attrs = std::mem::take(&mut op.attrs).with("xf.async", AttrValue::Bool(true)).with("xf.bucket", AttrValue::Int(bucket)).with("xf.bucket_members", AttrValue::Int(1));
            func.types.push(func.types[result.0 as usize].clone());
            let wait = Value(func.types.len() as u32 - 1);
            let wait_op = Op { name: "xf.wait".into(), operands: vec![result], results: vec![wait], attrs, loc: format!("{}.wait", op.loc), origin: op.origin };
            match until {
                Some(j) => waits.entry(j).or_default().push(wait_op),
                None => at_end.push(wait_op),
            }
            waited.insert(result, wait);
        }
        let mut placed = Vec::with_capacity(ops.len() + waited.len());
        for (j, op) in ops.into_iter().enumerate() {
            placed.extend(waits.remove(&j).unwrap_or_default());
            placed.push(op);
        }
        placed.extend(at_end);
        let wait_results: HashSet<Value> = waited.values().copied().collect();
        func.ops.splice(range, placed);
        // Every reader, in this section or a later one, reads the wait.
        for op in func.ops.iter_mut().filter(|o| !o.results.first().is_some_and(|r| wait_results.contains(r))) {
            for operand in &mut op.operands {
                if let Some(w) = waited.get(operand) {
                    *operand = *w;
                }
            }
        }
        for v in &mut func.returns {
            if let Some(w) = waited.get(v) {
                *v = *w;
            }
        }
        true
    }

    /// Gathers of arguments (ZeRO-3's parameter shards, gathered where they are read) among
    /// `movable`, prefetched: each goes out as early as the bytes of those already out and
    /// not yet read stay within `prefetch_bytes` (as FSDP limits its all-gathers ahead), and
    /// always before its first reader.
    fn prefetch(&self, func: &Func, ops: Vec<Op>, args: &HashSet<Value>, movable: &dyn Fn(&Op) -> bool) -> Vec<Op> {
        let is_prefetch = |op: &Op| op.name == "shard.all_gather" && movable(op) && args.contains(&op.operands[0]);
        if self.prefetch_bytes == 0 || !ops.iter().any(is_prefetch) {
            return ops;
        }
        let (gathers, rest): (Vec<Op>, Vec<Op>) = ops.into_iter().partition(is_prefetch);
        let bytes = |op: &Op| func.tensor(op.results[0]).map_or(0, |t| t.bytes());
        let position: HashMap<Value, usize> = gathers.iter().enumerate().map(|(k, g)| (g.results[0], k)).collect();
        let mut gathers = gathers.into_iter().map(Some).collect::<Vec<_>>();
        let (mut next, mut ahead) = (0usize, Vec::<(Value, u64)>::new());
        let mut placed = Vec::with_capacity(rest.len() + gathers.len());
        for op in rest {
            // Whatever this op reads goes out first, then what the budget allows.
            let needed = op.operands.iter().filter_map(|v| position.get(v)).map(|&k| k + 1).max().unwrap_or(0);
            while next < gathers.len() {
                let size = gathers[next].as_ref().map_or(0, bytes);
                let within = ahead.iter().map(|(_, b)| b).sum::<u64>() + size <= self.prefetch_bytes;
                if next >= needed && !within {
                    break;
                }
                let g = gathers[next].take().expect("each gather goes out once");
                ahead.push((g.results[0], size));
                placed.push(g);
                next += 1;
            }
            ahead.retain(|(v, _)| !op.operands.contains(v));
            placed.push(op);
        }
        placed.extend(gathers.into_iter().flatten());
        placed
    }
}

/// `ops` with each op that `movable` accepts moved up to just after the op that makes its
/// operand (nothing between reads its result, so what stood between runs while it is on
/// the wire); one whose operand is an argument stays.
fn hoist(original: Vec<Op>, movable: &dyn Fn(&Op) -> bool) -> Vec<Op> {
    let mut ops: Vec<Op> = Vec::with_capacity(original.len());
    for op in original {
        if movable(&op) {
            let operand = op.operands[0];
            if let Some(maker) = ops.iter().rposition(|o| o.results.contains(&operand)) {
                // After the maker and any collective already moved there (their order kept).
                let mut at = maker + 1;
                while at < ops.len() && candidate_or_moved(&ops[at], operand) {
                    at += 1;
                }
                ops.insert(at, op);
                continue;
            }
        }
        ops.push(op);
    }
    ops
}

/// The ops of `ops` that `movable` accepts with compute between them and where they must
/// be waited for, with that point (`None`: the end): the first reader; for a scatter, which
/// holds its whole input until its wait, the next collective over the same axes at the
/// latest (its communicator's stream runs that after it anyway), so one scatter is in
/// flight per communicator. A gather's input and output live that long regardless, and an
/// all-reduce's input is copied into its output at once.
fn overlapped(ops: &[Op], movable: &dyn Fn(&Op) -> bool) -> Vec<(usize, Option<usize>)> {
    let communicates = |op: &Op| op.name.starts_with("shard.") && op.name != "shard.all_slice";
    (0..ops.len())
        .filter(|&i| movable(&ops[i]))
        .filter_map(|i| {
            let result = ops[i].results[0];
            let axes = ops[i].attrs.get("grid_axes");
            let scatter = ops[i].name == "shard.reduce_scatter";
            let until = (i + 1..ops.len()).find(|&j| ops[j].operands.contains(&result) || (scatter && communicates(&ops[j]) && ops[j].attrs.get("grid_axes") == axes));
            ops[i + 1..until.unwrap_or(ops.len())].iter().any(computes).then_some((i, until))
        })
        .collect()
}

/// Whether `op` is a collective reading `operand` (one moved up behind its maker before).
fn candidate_or_moved(op: &Op, operand: Value) -> bool {
    op.name.starts_with("shard.") && op.operands.first() == Some(&operand)
}
