//! `bucket-gradients`: data-parallel gradient synchronisation (and ZeRO's gathers of the
//! updated shards) in buckets, asynchronously.
//!
//! Input: a partitioned training step. Output: every collective over `dp` alone of one of
//! three kinds is marked `xf.async`, with `xf.bucket` = its bucket and `xf.bucket_members` =
//! the bucket's size:
//! - an all-reduce whose result an optimizer update reads (a gradient's data-parallel sum);
//! - a reduce-scatter along dimension 0 whose result an update reads (ZeRO's gradient
//!   shard);
//! - an all-gather along dimension 0 of what an update writes, or of its bf16 cast (ZeRO-1/2
//!   gathering the updated shard back into the whole parameter).
//!
//! Buckets hold one kind each and fill in the order the values become ready, up to
//! `bucket_bytes` (of the collective's larger side), so a bucket can be sent the moment its
//! last member exists while compute goes on. Each reader then reads `xf.wait` of the value.
//! The updates move to the end of the step, as in PyTorch's DDP, and the all-reduce waits
//! with them (the reduced gradients stay alive until then, in their regions). A scatter
//! bucket reads its whole gradients until its wait, so bucket k is waited for as bucket
//! k + 2 goes out: at most two are in flight and ZeRO's saving on gradients stays. A gather
//! bucket goes out right after the update of its last member, overlapping the updates after
//! it, and is waited for where it is first read (the step's results). Backends send an
//! all-reduce bucket as one collective over the concatenated gradients and a reduce-scatter
//! or all-gather bucket as its members in one group (one NCCL launch); dimension 0 keeps
//! each member's blocks contiguous, so none needs staging.

use std::collections::{HashMap, HashSet};

use shardc_ir::{AttrValue, Attrs, Func, Module, Op, Value};

use crate::{Changed, Pass, PassError};

/// The `bucket-gradients` pass.
#[derive(Clone, Copy, Debug)]
pub struct BucketGradients {
    /// Largest bucket, in bytes.
    pub bucket_bytes: u64,
}

/// What an asynchronous collective of this pass does.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Kind {
    /// A gradient's sum over dp.
    GradientSum,
    /// A gradient's ZeRO shard: its sum over dp, scattered along dimension 0.
    GradientShard,
    /// An updated ZeRO shard gathered back into the parameter along dimension 0.
    ParameterGather,
}

fn is_update(op: &Op) -> bool {
    op.name == "xf.adamw" || op.name == "xf.sgd"
}

fn dp_only(op: &Op) -> bool {
    op.attrs.axes("grid_axes").is_ok_and(|axes| axes == [super::DP])
}

fn along_dimension_0(op: &Op, attr: &str) -> bool {
    op.attrs.index(attr) == Ok(0)
}

/// The collectives of `func` this pass makes asynchronous, in program order, with their kind.
fn candidates(func: &Func) -> Vec<(usize, Kind)> {
    let grad_of_update: HashSet<Value> = func.ops.iter().filter(|o| is_update(o)).map(|o| o.operands[1]).collect();
    let mut written_by_update: HashSet<Value> = func.ops.iter().filter(|o| is_update(o)).flat_map(|o| o.results.first().copied()).collect();
    // Mixed precision gathers the bf16 copy of the updated fp32 master shard.
    let casts: Vec<Value> = func.ops.iter().filter(|o| o.name == "xf.cast" && written_by_update.contains(&o.operands[0])).map(|o| o.results[0]).collect();
    written_by_update.extend(casts);
    (0..func.ops.len())
        .filter_map(|i| {
            let op = &func.ops[i];
            if op.attrs.get("xf.async").is_some() || !dp_only(op) {
                return None;
            }
            let kind = match op.name.as_str() {
                "shard.all_reduce" if grad_of_update.contains(&op.results[0]) => Kind::GradientSum,
                "shard.reduce_scatter" if grad_of_update.contains(&op.results[0]) && along_dimension_0(op, "scatter_axis") => Kind::GradientShard,
                "shard.all_gather" if written_by_update.contains(&op.operands[0]) && along_dimension_0(op, "gather_axis") => Kind::ParameterGather,
                _ => return None,
            };
            Some((i, kind))
        })
        .collect()
}

/// Fills buckets with `items` (an op, its bucket's key, its bytes) in their order, one open
/// bucket per key, each up to `bucket_bytes` (a larger item fills one alone); buckets are
/// numbered from `next` in the order they open. Returns each op's bucket, and each bucket's
/// number of members.
fn fill_buckets<K: std::hash::Hash + Eq>(items: impl IntoIterator<Item = (usize, K, u64)>, bucket_bytes: u64, next: &mut i64) -> (Vec<(usize, i64)>, HashMap<i64, i64>) {
    let mut bucket_of = Vec::new();
    let mut open: HashMap<K, (i64, u64)> = HashMap::new();
    for (i, key, bytes) in items {
        let entry = open.entry(key).or_insert_with(|| {
            *next += 1;
            (*next - 1, 0)
        });
        if entry.1 > 0 && entry.1.saturating_add(bytes) > bucket_bytes {
            *next += 1;
            *entry = (*next - 1, 0);
        }
        entry.1 = entry.1.saturating_add(bytes);
        bucket_of.push((i, entry.0));
    }
    let mut members: HashMap<i64, i64> = HashMap::new();
    for (_, b) in &bucket_of {
        *members.entry(*b).or_insert(0) += 1;
    }
    (bucket_of, members)
}

/// Which ops of `ops` move to the end of the step: those reading a synced gradient
/// (`gradient_values`), what reads their results, and every member and wait of an existing
/// bucket one of whose ops moves (with what reads those), until nothing changes.
fn moved_ops(ops: &[Op], gradient_values: &HashSet<Value>) -> Vec<bool> {
    let bucket = |op: &Op| match op.attrs.get("xf.bucket") {
        Some(AttrValue::Int(b)) => Some(*b),
        _ => None,
    };
    let mut moves = vec![false; ops.len()];
    loop {
        let mut values: HashSet<Value> = gradient_values.clone();
        let mut buckets: HashSet<i64> = HashSet::new();
        for (i, op) in ops.iter().enumerate() {
            if moves[i] {
                values.extend(op.results.iter().copied());
                buckets.extend(bucket(op));
            }
        }
        let mut changed = false;
        for (i, op) in ops.iter().enumerate() {
            if !moves[i] && (op.operands.iter().any(|v| values.contains(v)) || bucket(op).is_some_and(|b| buckets.contains(&b))) {
                moves[i] = true;
                values.extend(op.results.iter().copied());
                buckets.extend(bucket(op));
                changed = true;
            }
        }
        if !changed {
            return moves;
        }
    }
}

impl Pass for BucketGradients {
    fn name(&self) -> &'static str {
        "bucket-gradients"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let Some(func) = module.funcs.iter_mut().find(|f| f.name == "train_step") else {
            return Ok(Changed::No);
        };
        let found = candidates(func);
        if found.is_empty() {
            return Ok(Changed::No);
        }
        // Fill buckets in program order (the order values become ready), one open bucket
        // per kind; a bucket's number is the order in which it was opened.
        let kind_of: HashMap<usize, Kind> = found.iter().copied().collect();
        let bytes = |i: usize| func.tensor(func.ops[i].operands[0]).map_or(0, |t| t.bytes()).max(func.tensor(func.ops[i].results[0]).map_or(0, |t| t.bytes()));
        let (filled, members) = fill_buckets(found.iter().map(|&(i, kind)| (i, kind, bytes(i))), self.bucket_bytes, &mut 0);
        let bucket_of: Vec<(usize, Kind, usize)> = filled.into_iter().map(|(i, b)| (i, kind_of[&i], b as usize)).collect();
        let members: HashMap<usize, i64> = members.into_iter().map(|(b, n)| (b as usize, n)).collect();
        let mut waited: HashMap<Value, Value> = HashMap::new();
        let mut gradient_waits = Vec::new();
        let mut gather_waits = Vec::new();
        for &(i, kind, b) in &bucket_of {
            let op = &mut func.ops[i];
            op.attrs = std::mem::take(&mut op.attrs)
                .with("xf.async", AttrValue::Bool(true))
                .with("xf.bucket", AttrValue::Int(b as i64))
                .with("xf.bucket_members", AttrValue::Int(members[&b]));
            let (value, loc, origin) = (op.results[0], op.loc.clone(), op.origin);
            func.types.push(func.types[value.0 as usize].clone());
            let wait = Value(func.types.len() as u32 - 1);
            let attrs = Attrs::new().with("xf.bucket", AttrValue::Int(b as i64));
            let wait_op = Op { name: "xf.wait".into(), operands: vec![value], results: vec![wait], attrs, loc: format!("{loc}.wait"), origin };
            if kind == Kind::ParameterGather { gather_waits.push(wait_op) } else { gradient_waits.push(wait_op) }
            waited.insert(value, wait);
        }
        // Waits, then what reads the synced gradients (the updates, the global norm's sums
        // of squares) and whatever reads those (a ZeRO gather of the updated shard), at the
        // end of the step, in their order: nothing reads a gradient before its wait.
        // An earlier bucket (comm-opt's, of an all-reduce that reads a gradient and one that
        // does not, say the loss's) moves whole, with its waits: its members go out together.
        let gradient_values: HashSet<Value> = gradient_waits.iter().map(|w| w.operands[0]).collect();
        let moves = moved_ops(&func.ops, &gradient_values);
        let original_results: Vec<Value> = func.ops.iter().map(|op| op.results.first().copied().unwrap_or(Value(u32::MAX))).collect();
        let (mut moved, mut rest) = (Vec::new(), Vec::new());
        for (op, moves) in func.ops.drain(..).zip(moves) {
            if moves { moved.push(op) } else { rest.push(op) }
        }
        // A gather bucket goes out together right after the op that makes the last of its
        // members' operands (backends issue a bucket at its last member anyway), so the updates
        // between its members stay together for multi-tensor launches.
        let bucket_attr = |op: &Op| match op.attrs.get("xf.bucket") {
            Some(AttrValue::Int(b)) => *b,
            _ => -1,
        };
        let gathered: HashSet<Value> = gather_waits.iter().map(|w| w.operands[0]).collect();
        let is_gather = |op: &Op| op.results.first().is_some_and(|r| gathered.contains(r));
        let (gathers, others): (Vec<Op>, Vec<Op>) = rest.into_iter().chain(moved).partition(|op| is_gather(op));
        let mut gather_buckets: Vec<(i64, Vec<Op>)> = Vec::new();
        for op in gathers {
            match gather_buckets.iter_mut().find(|(b, _)| *b == bucket_attr(&op)) {
                Some((_, members)) => members.push(op),
                None => gather_buckets.push((bucket_attr(&op), vec![op])),
            }
        }
        // Each bucket with the operands still to be made before it can go.
        let mut gathers_of: Vec<(HashSet<Value>, Vec<Op>)> = gather_buckets.into_iter().map(|(_, members)| (members.iter().map(|m| m.operands[0]).collect(), members)).collect();
        // A scatter bucket's input gradients stay whole until its wait: bucket k is waited
        // for just before bucket k + 2's last member is issued, so at most two are in flight
        // (as FSDP and DeepSpeed bound them) and the whole gradients die as the backward
        // pass goes on. The last two, and the all-reduce buckets (their members are copied
        // into their region at once), are waited for before the first reader.
        let scatter_buckets: Vec<usize> = {
            let mut seen = Vec::new();
            for &(_, kind, b) in &bucket_of {
                if kind == Kind::GradientShard && !seen.contains(&b) {
                    seen.push(b);
                }
            }
            seen
        };
        let last_member = |b: usize| bucket_of.iter().rev().find(|(_, _, x)| *x == b).map(|&(i, _, _)| i);
        let mut early_waits: HashMap<usize, Vec<Op>> = HashMap::new();
        let mut late_waits = Vec::new();
        for wait in gradient_waits {
            let b = bucket_attr(&wait) as usize;
            let issue_point = scatter_buckets.iter().position(|&x| x == b).and_then(|k| scatter_buckets.get(k + 2)).and_then(|&later| last_member(later));
            match issue_point {
                Some(i) => early_waits.entry(i).or_default().push(wait),
                None => late_waits.push(wait),
            }
        }
        // Members by their result, to find the issue points in the new order.
        let member_at: HashMap<Value, usize> = early_waits.keys().map(|&i| (original_results[i], i)).collect();
        let mut ops = Vec::with_capacity(others.len() + gradient_values.len() * 2);
        let mut late_waits = Some(late_waits);
        for op in others {
            if let Some(i) = op.results.first().and_then(|r| member_at.get(r)) {
                ops.extend(early_waits.remove(i).unwrap_or_default());
            }
            // The remaining gradient waits come before the first reader of a synced gradient.
            if op.operands.iter().any(|v| gradient_values.contains(v)) {
                ops.extend(late_waits.take().unwrap_or_default());
            }
            let results = op.results.clone();
            ops.push(op);
            for (remaining, members) in &mut gathers_of {
                if !members.is_empty() && results.iter().any(|r| remaining.remove(r)) && remaining.is_empty() {
                    ops.append(members);
                }
            }
        }
        ops.extend(late_waits.take().unwrap_or_default());
        // A gather whose operand no op made (never the case for an update's result) stays
        // in the step, after everything.
        ops.extend(gathers_of.into_iter().flat_map(|(_, members)| members));
        // Each gather's wait before its first reader, or at the end when only returned.
        let mut pending: Vec<Op> = gather_waits;
        let mut placed = Vec::with_capacity(ops.len() + pending.len());
        for op in ops {
            let (now, later): (Vec<Op>, Vec<Op>) = pending.into_iter().partition(|w| op.operands.contains(&w.operands[0]));
            placed.extend(now);
            pending = later;
            placed.push(op);
        }
        placed.extend(pending);
        for op in &mut placed {
            if op.name == "xf.wait" {
                continue;
            }
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
        func.ops = placed;
        Ok(Changed::Yes)
    }
}

/// The `bucket-step-gradients` pass: data-parallel gradient buckets of the step sections of
/// pipeline stages (and of gradient accumulation).
///
/// Input: the stages of `split-stages`. A stage's step section all-reduces over dp the
/// gradients its backward (or weight) section summed over the micro-batches, or, under ZeRO,
/// reduce-scatters them along dimension 0. Output: each such collective, a sum over `dp`
/// alone whose operand only it reads, carries `xf.step_bucket` = its bucket (numbered across
/// the module, so unique on every pipeline rank) and `xf.step_bucket_members` = the bucket's
/// size. Buckets fill in the order of the step section, one open bucket per kind (all-reduce
/// or reduce-scatter) and element type, up to `bucket_bytes` of the members' inputs.
///
/// The ops stay synchronous where they are; what the attribute promises is that a bucket's
/// members read gradients final after the chunk's last backward work of the step. The memory
/// plan lays each bucket's outputs back to back as one region alive the whole step. A backend
/// sums the micro-batches' gradients into that region (an all-reduce bucket) or into a
/// buffer of the whole gradients (a reduce-scatter bucket, whose shards land in the region),
/// and sends the bucket as one collective (one NCCL group for the scatters), on its
/// communication stream or thread, as soon as the chunk's last backward is done (Megatron-LM's
/// contiguous gradient buffer with `--overlap-grad-reduce`, and its distributed optimizer's
/// reduce-scatter); the step section's members then only wait for it.
///
/// Under ZeRO the step section then gathers each updated shard back into its parameter: those
/// gathers become asynchronous buckets, waited for at the section's end (see
/// `bucket_step_gathers`).
#[derive(Clone, Copy, Debug)]
pub struct BucketStepGradients {
    /// Largest bucket, in bytes.
    pub bucket_bytes: u64,
}

/// Whether `func` is a pipeline stage of `split-stages` (`stage0`, `stage1`, ...).
pub(crate) fn is_stage(func: &Func) -> bool {
    func.name.strip_prefix("stage").is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
}

fn phase_of(op: &Op) -> Option<&str> {
    match op.attrs.get("xf.phase") {
        Some(AttrValue::Str(p)) => Some(p.as_str()),
        _ => None,
    }
}

/// The step-section all-reduces and reduce-scatters (along dimension 0) of `func` that may
/// travel in a step bucket, in op order.
fn step_candidates(func: &Func) -> Vec<usize> {
    let mut made_in: HashMap<Value, &str> = HashMap::new();
    let mut readers: HashMap<Value, usize> = HashMap::new();
    for op in &func.ops {
        for r in &op.results {
            made_in.insert(*r, phase_of(op).unwrap_or(""));
        }
        for v in &op.operands {
            *readers.entry(*v).or_insert(0) += 1;
        }
    }
    for v in &func.returns {
        *readers.entry(*v).or_insert(0) += 1;
    }
    let sum = |op: &Op| !matches!(op.attrs.get("reduction"), Some(AttrValue::Reduction(r)) if *r != shardc_ir::Reduction::Sum);
    (0..func.ops.len())
        .filter(|&i| {
            let op = &func.ops[i];
            (op.name == "shard.all_reduce" || (op.name == "shard.reduce_scatter" && along_dimension_0(op, "scatter_axis")))
                && phase_of(op) == Some("step")
                && dp_only(op)
                && sum(op)
                && op.attrs.get("xf.async").is_none()
                && op.operands.len() == 1
                && matches!(made_in.get(&op.operands[0]), Some(&"backward") | Some(&"weight"))
                && readers.get(&op.operands[0]) == Some(&1)
        })
        .collect()
}

impl Pass for BucketStepGradients {
    fn name(&self) -> &'static str {
        "bucket-step-gradients"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let (mut next, mut next_gather) = (0i64, 0i64);
        let mut changed = Changed::No;
        for func in module.funcs.iter_mut().filter(|f| is_stage(f)) {
            // (op, bucket) in op order; one open bucket per kind and element type.
            let items = step_candidates(func).into_iter().filter_map(|i| {
                let op = &func.ops[i];
                let t = func.tensor(op.operands[0])?;
                Some((i, (op.name == "shard.reduce_scatter", t.dtype), t.bytes()))
            });
            let (bucket_of, members) = fill_buckets(items.collect::<Vec<_>>(), self.bucket_bytes, &mut next);
            for (i, b) in bucket_of {
                let op = &mut func.ops[i];
                op.attrs = std::mem::take(&mut op.attrs).with("xf.step_bucket", AttrValue::Int(b)).with("xf.step_bucket_members", AttrValue::Int(members[&b]));
                changed = Changed::Yes;
            }
            if bucket_step_gathers(func, &mut next_gather, self.bucket_bytes) {
                changed = Changed::Yes;
            }
        }
        Ok(changed)
    }
}

/// ZeRO's gathers of the updated shards in a stage's step section (all-gathers over `dp`
/// alone along dimension 0 of an update's result or its bf16 cast, read by nothing but the
/// stage's results): made asynchronous in buckets (`xf.bucket`, numbered from `next` across
/// the module; one open bucket per element type, up to `bucket_bytes`), each with an
/// `xf.wait` at the end of the step section. Each bucket moves up to just after the op that
/// makes the last of its members' operands, taking that op's `xf.order` (a rank runs its
/// step sections in that order): it goes out as one NCCL group as soon as its last member's
/// update is done, while the updates after it run (Megatron-LM's distributed optimizer
/// gathers its parameter buckets the same way), and the updates between two buckets stay
/// together for multi-tensor launches. Returns whether anything changed.
fn bucket_step_gathers(func: &mut Func, next: &mut i64, bucket_bytes: u64) -> bool {
    let mut read_by_ops: HashSet<Value> = HashSet::new();
    for op in &func.ops {
        read_by_ops.extend(op.operands.iter().copied());
    }
    let is_step = |op: &Op| phase_of(op) == Some("step");
    // The step section must be the function's tail, so the waits close it.
    if !func.ops.last().is_some_and(is_step) {
        return false;
    }
    let found: Vec<usize> = candidates(func)
        .into_iter()
        .filter(|&(i, kind)| kind == Kind::ParameterGather && is_step(&func.ops[i]) && !read_by_ops.contains(&func.ops[i].results[0]) && func.returns.contains(&func.ops[i].results[0]))
        .map(|(i, _)| i)
        .collect();
    if found.is_empty() {
        return false;
    }
    let items: Vec<(usize, shardc_ir::DType, u64)> = found.into_iter().filter_map(|i| func.tensor(func.ops[i].results[0]).map(|t| (i, t.dtype, t.bytes()))).collect();
    let (bucket_of, members) = fill_buckets(items, bucket_bytes, next);
    let mut waited: HashMap<Value, Value> = HashMap::new();
    let mut waits = Vec::with_capacity(bucket_of.len());
    let buckets_in_order: Vec<i64> = bucket_of.iter().map(|&(_, b)| b).fold(Vec::new(), |mut seen, b| {
        if !seen.contains(&b) {
            seen.push(b);
        }
        seen
    });
    for &(i, b) in &bucket_of {
        let op = &mut func.ops[i];
        op.attrs = std::mem::take(&mut op.attrs).with("xf.async", AttrValue::Bool(true)).with("xf.bucket", AttrValue::Int(b)).with("xf.bucket_members", AttrValue::Int(members[&b]));
        let (value, loc, origin) = (op.results[0], op.loc.clone(), op.origin);
        func.types.push(func.types[value.0 as usize].clone());
        let wait = Value(func.types.len() as u32 - 1);
        // Last in the training step's order too: a rank of several chunks runs their step
        // sections merged by `xf.order`.
        let attrs = Attrs::new().with("xf.bucket", AttrValue::Int(b)).with("xf.phase", AttrValue::Str("step".into())).with("xf.order", AttrValue::Int(i64::MAX));
        waits.push(Op { name: "xf.wait".into(), operands: vec![value], results: vec![wait], attrs, loc: format!("{loc}.wait"), origin });
        waited.insert(value, wait);
    }
    // Each bucket after the op that makes the last of its members' operands.
    let member_of: HashMap<usize, i64> = bucket_of.iter().copied().collect();
    let mut members_of: HashMap<i64, Vec<Op>> = HashMap::new();
    let mut rest = Vec::with_capacity(func.ops.len());
    for (i, op) in std::mem::take(&mut func.ops).into_iter().enumerate() {
        match member_of.get(&i) {
            Some(b) => members_of.entry(*b).or_default().push(op),
            None => rest.push(op),
        }
    }
    let mut pending: Vec<(HashSet<Value>, Vec<Op>)> = buckets_in_order.iter().map(|b| members_of.remove(b).unwrap_or_default()).map(|members| (members.iter().map(|m| m.operands[0]).collect(), members)).collect();
    let mut ops = Vec::with_capacity(rest.len() + bucket_of.len() + waits.len());
    for op in rest {
        let (results, order) = (op.results.clone(), op.attrs.get("xf.order").cloned());
        ops.push(op);
        for (remaining, members) in &mut pending {
            if !members.is_empty() && results.iter().any(|r| remaining.remove(r)) && remaining.is_empty() {
                for mut member in members.drain(..) {
                    if let Some(order) = &order {
                        member.attrs = std::mem::take(&mut member.attrs).with("xf.order", order.clone());
                    }
                    ops.push(member);
                }
            }
        }
    }
    // A member whose operand no op made (never an update's result) stays at the end.
    ops.extend(pending.into_iter().flat_map(|(_, members)| members));
    ops.extend(waits);
    func.ops = ops;
    for v in &mut func.returns {
        if let Some(w) = waited.get(v) {
            *v = *w;
        }
    }
    true
}
