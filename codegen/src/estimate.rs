//! The step time of compiled rank programs on a cluster, from the programs themselves.
//!
//! Every instruction is priced: an `xf` kernel by the roofline of its registry cost (FLOPs
//! against the GPU's peak for its dtype, bytes against its memory bandwidth), a collective
//! by the alpha-beta model of its axes ([`shardc_ir::cluster`]), a pipeline send by its link.
//! A program without stages is walked in order with a clock: an asynchronous gradient bucket
//! goes on the wire when its last member is staged and its wait stalls only for what the
//! compute since then did not cover. Pipeline programs are priced per stage and section, and
//! the schedule they carry is simulated with those costs, so the bubble is the schedule's own;
//! each rank's step section (updates and the data-parallel syncs, in the order the rank runs
//! them) follows, waiting only for what is left of the step buckets its chunks sent during
//! their last backward work, placed on the simulated timeline.
//!
//! Model FLOPs count `6 N` per token for the parameters plus `12 L s h` for attention scores
//! (PaLM's MFU convention), whatever recomputation or partitioning adds.

use std::collections::BTreeMap;

use shardc_ir::cluster::{Cluster, Collective};
use shardc_ir::ops::{lookup, Cost, KernelClass};
use shardc_ir::{AttrValue, Attrs, TensorTy};
use shardc_runtime::program::{Attr, DeviceCall, Instr, KernelArg, Program, Phase};
use shardc_runtime::pipeline::schedule_of;
use shardc_runtime::schedule::{simulate_shared, simulate_with, Work};
use shardc_ir::DType;
use shardc_ir::facts::{Block, Origin, Role};
use shardc_ir::mesh::{DP_AXIS, PP_AXIS};

/// The estimate of one training step.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Estimate {
    /// Seconds per optimizer step.
    pub step_seconds: f64,
    /// Compute seconds of the busiest rank.
    pub compute_seconds: f64,
    /// Communication seconds not hidden behind compute, by axes (`tp`, `dp`, `dp+tp`, `pp`).
    pub exposed_communication: BTreeMap<String, f64>,
    /// Idle seconds of the pipeline schedule (per rank, on average).
    pub bubble_seconds: f64,
    /// Tokens per second of the whole cluster.
    pub tokens_per_second: f64,
    /// Model FLOPs per step (6 N + 12 L s h per token).
    pub model_flops: f64,
    /// Model FLOPs per second over the peak of every GPU used.
    pub mfu: f64,
    /// What bounds the step: `compute`, `communication`, `pipeline bubble` or, on a shared
    /// host, `shared cores`.
    pub bound: String,
    /// Seconds of the busiest rank's step by kernel class (`gemm`, `attention`,
    /// `memory-bound`, `optimizer`) and by collective and axes (`all_reduce tp`; exposed or
    /// not), per step.
    pub breakdown: BTreeMap<String, f64>,
    /// On a shared host: seconds of every rank's compute on its cores, when that bounds the
    /// step (0 otherwise).
    pub shared_compute: f64,
}

/// The model being trained, for model FLOPs.
#[derive(Clone, Copy, Debug)]
pub struct ModelShape {
    /// Parameters.
    pub parameters: f64,
    /// Layers.
    pub layers: f64,
    /// Hidden size.
    pub hidden: f64,
    /// Sequence length.
    pub seq: f64,
    /// Tokens per optimizer step (global batch x sequence).
    pub tokens_per_step: f64,
}

/// The IR type of a program buffer.
pub fn buffer_type(program: &Program, buffer: usize) -> TensorTy {
    let b = &program.buffers[buffer];
    TensorTy::new(b.shape.iter().map(|&d| d as i64).collect::<Vec<_>>(), b.dtype)
}

/// An instruction's attributes as IR attributes (what the op registry reads).
pub fn instr_attrs(instr: &Instr) -> Attrs {
    let mut out = Attrs::new();
    for (name, value) in &instr.attrs {
        let v = match value {
            Attr::Bool(b) => AttrValue::Bool(*b),
            Attr::Int(i) => AttrValue::Int(*i),
            Attr::Float(f) => AttrValue::Float(*f),
            Attr::Str(s) => AttrValue::Str(s.clone()),
            Attr::Ints(v) => AttrValue::Ints(v.clone()),
        };
        out = out.with(name, v);
    }
    out
}

/// What one instruction costs: compute seconds, or communication seconds over named axes.
enum Priced {
    Compute(&'static str, f64),
    Communication(String, f64),
}

impl Priced {
    fn seconds(&self) -> f64 {
        match self {
            Priced::Compute(_, t) | Priced::Communication(_, t) => *t,
        }
    }
}

fn axis_names(axes: &[usize]) -> String {
    axes.iter().map(|&a| shardc_ir::mesh::axis_name(a)).collect::<Vec<_>>().join("+")
}

fn price(program: &Program, instr: &Instr, cluster: &Cluster) -> Priced {
    let grid: Vec<i64> = program.mesh.iter().map(|&e| e as i64).collect();
    let input = instr.inputs.first().map(|&b| buffer_type(program, b));
    let output = instr.outputs.first().map(|&b| buffer_type(program, b));
    let bytes = |t: &Option<TensorTy>| t.as_ref().map_or(0.0, |t| t.bytes() as f64);
    let axes: Vec<usize> = instr.ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect();
    let collective = |kind: Collective, b: f64| Priced::Communication(axis_names(&axes), cluster.time(kind, b, &grid, &axes));
    let copy = |b: f64| cluster.gpu.kernel_launch + b / (cluster.gpu.memory_bandwidth * cluster.gpu.memory_efficiency);
    if let Some((kind, b)) = collective_of(program, instr) {
        return collective(kind, b);
    }
    match instr.op.as_str() {
        "shard.send" => Priced::Communication("pp".into(), cluster.time(Collective::Send, bytes(&input), &grid, &[PP_AXIS])),
        "shard.recv" => Priced::Communication("pp".into(), 0.0),
        "shard.all_slice" | "tensor.empty" => Priced::Compute("memory-bound", copy(bytes(&output))),
        name => {
            let Some(def) = lookup(name) else { return Priced::Compute("memory-bound", 0.0) };
            let inputs: Vec<TensorTy> = instr.inputs.iter().map(|&b| buffer_type(program, b)).collect();
            let outputs: Vec<TensorTy> = instr.outputs.iter().map(|&b| buffer_type(program, b)).collect();
            let refs: Vec<&TensorTy> = inputs.iter().collect();
            let class = match def.kernel_class(&refs, &instr_attrs(instr)) {
                KernelClass::Gemm { .. } => "gemm",
                KernelClass::Attention { .. } => "attention",
                KernelClass::Memory if matches!(name, "xf.adamw" | "xf.sgd") => "optimizer",
                KernelClass::Memory => "memory-bound",
            };
            Priced::Compute(class, cluster.op_time(def, &refs, &outputs, &instr_attrs(instr)))
        }
    }
}

/// The kernels of a program's device plan that compute more than their own instruction: a
/// fused element-wise kernel (or a multi-tensor batch) at its first instruction, a GEMM with
/// an epilogue at its product, a multi-tensor gradient norm at its last share. Such a kernel is priced once, as the one kernel it is, and the
/// instructions it absorbed cost nothing of their own. Empty without a device plan (the CPU
/// backend runs every instruction as its own kernel).
#[derive(Default)]
struct Fusion {
    /// Kernel's instruction -> the instructions it computes besides its own.
    members: std::collections::HashMap<usize, Vec<usize>>,
}

impl Fusion {
    fn of(program: &Program) -> Fusion {
        let mut members: std::collections::HashMap<usize, Vec<usize>> = std::collections::HashMap::new();
        if let Some(plan) = &program.device {
            for (index, calls) in plan.calls.iter().enumerate() {
                // (Indices out of range, from an edited plan, are left to price alone.)
                if let [DeviceCall::Fused { into }] = calls.as_slice()
                    && *into < program.instrs.len()
                    && index < program.instrs.len()
                {
                    members.entry(*into).or_default().push(index);
                }
            }
        }
        Fusion { members }
    }
}

/// [`price`] for instruction `index` as its device plan runs it (see [`Fusion`]).
fn price_at(program: &Program, index: usize, fusion: &Fusion, cluster: &Cluster) -> Priced {
    let instr = &program.instrs[index];
    let Some(plan) = &program.device else { return price(program, instr, cluster) };
    // The arithmetic of instructions one kernel computes (their values stay on chip).
    let arithmetic = |instrs: &[usize]| -> Cost {
        let mut total = Cost::default();
        for member in instrs.iter().filter_map(|&m| program.instrs.get(m)) {
            if let Some(def) = lookup(&member.op) {
                let inputs: Vec<TensorTy> = member.inputs.iter().map(|&b| buffer_type(program, b)).collect();
                let outputs: Vec<TensorTy> = member.outputs.iter().map(|&b| buffer_type(program, b)).collect();
                let c = def.cost(&inputs.iter().collect::<Vec<_>>(), &outputs, &instr_attrs(member));
                total.flops += c.flops;
                total.special += c.special;
            }
        }
        total
    };
    let members = fusion.members.get(&index).map_or(&[][..], Vec::as_slice);
    let class_of = |i: &Instr| if matches!(i.op.as_str(), "xf.adamw" | "xf.sgd") { "optimizer" } else { "memory-bound" };
    match plan.calls.get(index).map(Vec::as_slice) {
        Some([DeviceCall::Fused { into }]) => Priced::Compute(program.instrs.get(*into).map_or("memory-bound", class_of), 0.0),
        Some([DeviceCall::GemmEpilogue { epilogue, .. }]) => {
            let Some(def) = lookup(&instr.op) else { return price(program, instr, cluster) };
            let inputs: Vec<TensorTy> = instr.inputs.iter().map(|&b| buffer_type(program, b)).collect();
            let outputs: Vec<TensorTy> = instr.outputs.iter().map(|&b| buffer_type(program, b)).collect();
            let refs: Vec<&TensorTy> = inputs.iter().collect();
            let attrs = instr_attrs(instr);
            let mut cost = def.cost(&refs, &outputs, &attrs);
            let extra = arithmetic(members);
            cost.flops += extra.flops;
            cost.special += extra.special;
            // The epilogue reads the bias, and stores (GELU) or reads (its gradient) the
            // pre-activation besides the product.
            let bytes = |b: Option<usize>| b.map_or(0.0, |b| buffer_type(program, b).bytes() as f64);
            cost.bytes += bytes(epilogue.bias) + bytes(epilogue.aux);
            let bf16 = inputs.first().is_some_and(|t| t.dtype == DType::Bf16);
            Priced::Compute("gemm", cluster.kernel_time(&def.kernel_class(&refs, &attrs), &cost, bf16))
        }
        Some(launches) if fusion.members.contains_key(&index) && !launches.is_empty() && launches.iter().all(|c| matches!(c, DeviceCall::Launch { .. })) => {
            // One pass over memory: every buffer the kernels take is read from memory, or
            // written, or both; the values between their instructions never leave the chip
            // (a multi-tensor norm's partial sums, in the workspace, are a few per block).
            let args: Vec<&KernelArg> = launches.iter().flat_map(|c| if let DeviceCall::Launch { args, .. } = c { args.as_slice() } else { &[] }).collect();
            let mut group: Vec<usize> = members.to_vec();
            group.push(index);
            group.sort_unstable();
            let mut written: std::collections::HashSet<usize> = std::collections::HashSet::new();
            let mut read: std::collections::HashSet<usize> = std::collections::HashSet::new();
            for &m in &group {
                let member = &program.instrs[m];
                read.extend(member.inputs.iter().filter(|b| !written.contains(b)));
                written.extend(member.outputs.iter().copied());
            }
            let mut cost = arithmetic(&group);
            let mut seen = std::collections::HashSet::new();
            for arg in args {
                if let KernelArg::Buffer(b) = arg
                    && let Some(buffer) = program.buffers.get(*b)
                    && seen.insert(*b)
                {
                    let passes = (usize::from(read.contains(b)) + usize::from(written.contains(b))).max(1);
                    cost.bytes += passes as f64 * buffer.len().saturating_mul(buffer.dtype.bytes()) as f64;
                }
            }
            Priced::Compute(class_of(instr), cluster.kernel_time(&KernelClass::Memory, &cost, false) + extra_launches(launches, cluster))
        }
        Some(calls) => match price(program, instr, cluster) {
            Priced::Compute(class, t) => Priced::Compute(class, t + extra_launches(calls, cluster)),
            communication => communication,
        },
        None => price(program, instr, cluster),
    }
}

/// The launch cost of an instruction's kernels beyond the one its price counts: a norm's
/// backward, a bias gradient or the loss run as several kernels (a reduction's second stage,
/// say), each paying a launch.
fn extra_launches(calls: &[DeviceCall], cluster: &Cluster) -> f64 {
    let kernels = calls.iter().filter(|c| matches!(c, DeviceCall::Launch { .. } | DeviceCall::Gemm(_) | DeviceCall::GemmEpilogue { .. })).count();
    kernels.saturating_sub(1) as f64 * cluster.gpu.kernel_launch
}

/// The collective an instruction runs and the bytes it is priced by: a gather's whole
/// result, else its input (a bucket is priced as one collective of its members' sum).
fn collective_of(program: &Program, instr: &Instr) -> Option<(Collective, f64)> {
    let kind = match instr.op.as_str() {
        "shard.all_reduce" => Collective::AllReduce,
        "shard.all_gather" => Collective::AllGather,
        "shard.reduce_scatter" => Collective::ReduceScatter,
        "shard.broadcast" => Collective::Broadcast,
        // One message to the next rank of the ring (and one from the previous, at once).
        "shard.shift" => Collective::Send,
        "shard.all_to_all" => Collective::AllToAll,
        _ => return None,
    };
    let counted = if kind == Collective::AllGather { instr.outputs[0] } else { instr.inputs[0] };
    Some((kind, buffer_type(program, counted).bytes() as f64))
}

/// What one instruction costs on `cluster`: its class (`gemm`, `attention`,
/// `memory-bound`, `optimizer`, or the collective and its axes) and seconds.
pub fn instruction_cost(program: &Program, instr: &Instr, cluster: &Cluster) -> (String, f64) {
    match price(program, instr, cluster) {
        Priced::Compute(class, t) => (class.to_string(), t),
        Priced::Communication(axes, t) => (format!("{} {axes}", instr.op.strip_prefix("shard.").unwrap_or(&instr.op)), t),
    }
}

/// Compute and communication seconds of instructions `range`, walked in order with
/// asynchronous buckets overlapping the compute after them.
#[derive(Default, Clone)]
struct Walk {
    clock: f64,
    compute: f64,
    exposed: BTreeMap<String, f64>,
    /// Seconds by kernel class and by collective (whether exposed or overlapped).
    breakdown: BTreeMap<String, f64>,
    /// Seconds of every collective, exposed or overlapped.
    communication: f64,
    /// Each instruction walked and the clock when it began (seconds since the walk began).
    began: Vec<(usize, f64)>,
}

/// The one collective of a pipeline rank's step bucket region `k`: an all-reduce of the
/// region in place, or (ZeRO) a group of reduce-scatters of its members' whole gradients;
/// with its bytes, counted as [`collective_of`] counts them, and its name.
fn step_bucket_collective(program: &Program, k: usize) -> (Collective, f64, &'static str) {
    let r = &program.memory.buckets[k];
    if program.step_bucket_scatters(k) {
        let bytes: usize = program.step_bucket_inputs(k).iter().map(|&b| program.buffers[b].len().saturating_mul(program.buffers[b].dtype.bytes())).sum();
        return (Collective::ReduceScatter, bytes as f64, "reduce_scatter");
    }
    (Collective::AllReduce, r.bytes as f64, "all_reduce")
}

fn walk(program: &Program, range: std::ops::Range<usize>, cluster: &Cluster) -> Walk {
    walk_with(program, range, cluster, &BTreeMap::new())
}

/// [`walk`] over `instructions` in that order, with the step buckets already on the wire
/// when the walk starts (`early`: region -> seconds of its collective and of it still to
/// run; see [`early_step_buckets`]): the step section waits for what is left at the
/// bucket's first member, and what comes after on that communicator queues behind it.
fn walk_with(program: &Program, instructions: impl IntoIterator<Item = usize>, cluster: &Cluster, early: &BTreeMap<usize, (f64, f64)>) -> Walk {
    let mut w = Walk::default();
    // Bucket -> (staged members' bytes, axes, members left); bucket -> done time.
    let mut staging: BTreeMap<i64, (f64, Vec<usize>, i64)> = BTreeMap::new();
    let mut done: BTreeMap<i64, (f64, String)> = BTreeMap::new();
    // Every operation on a communicator runs on that communicator's stream, in issue order
    // (the CUDA backend's `Comms`; the CPU backend's communication thread runs them all in
    // order): a bucket starts when it is complete and its communicator is done with what
    // came before, and a synchronous collective over axes with a bucket in flight starts
    // when that bucket ends. Communicator (its axes) -> when its last operation ends.
    let mut communicator_free: BTreeMap<Vec<usize>, f64> = BTreeMap::new();
    // Step buckets sent inside the chunk's last backward work are still on their
    // communicator's stream when this section starts (`left` after it): a bucket sent at the
    // work's end, or a synchronous collective over the same axes, queues behind them, as on
    // the GPU.
    for (&k, &(_, left)) in early {
        let axes: Vec<usize> = program.memory.buckets[k].members.first().map(|&m| program.instrs[m].ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect()).unwrap_or_default();
        let free = communicator_free.entry(axes).or_insert(0.0);
        *free = free.max(left);
    }
    let grid: Vec<i64> = program.mesh.iter().map(|&e| e as i64).collect();
    let fusion = Fusion::of(program);
    // A pipeline rank's step buckets: each is one collective of its region's bytes, priced
    // at its first member (as if it started there, not at the chunk's last backward).
    let step_bucket_of: BTreeMap<usize, usize> = if program.pipeline.is_some() { program.memory.buckets.iter().enumerate().flat_map(|(k, r)| r.members.iter().map(move |&m| (m, k))).collect() } else { BTreeMap::new() };
    let mut step_buckets_priced = std::collections::BTreeSet::new();
    for index in instructions {
        w.began.push((index, w.clock));
        let instr = &program.instrs[index];
        if let Some(&k) = step_bucket_of.get(&index) {
            if let Some(&(t, left)) = early.get(&k) {
                if step_buckets_priced.insert(k) {
                    let axes: Vec<usize> = instr.ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect();
                    let wait = (left - w.clock).max(0.0);
                    w.communication += t;
                    let (_, _, name) = step_bucket_collective(program, k);
                    *w.breakdown.entry(format!("{name} {} (bucketed)", axis_names(&axes))).or_insert(0.0) += t;
                    *w.exposed.entry(axis_names(&axes)).or_insert(0.0) += wait;
                    w.clock += wait;
                }
            } else if step_buckets_priced.insert(k) {
                let (collective, bytes, name) = step_bucket_collective(program, k);
                let axes: Vec<usize> = instr.ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect();
                let t = cluster.time(collective, bytes, &grid, &axes);
                let free = communicator_free.entry(axes.clone()).or_insert(0.0);
                let queued = (*free - w.clock).max(0.0);
                *free = w.clock + queued + t;
                w.communication += t;
                *w.breakdown.entry(format!("{name} {} (bucketed)", axis_names(&axes))).or_insert(0.0) += t;
                *w.exposed.entry(axis_names(&axes)).or_insert(0.0) += queued + t;
                w.clock += queued + t;
            }
            continue;
        }
        if let (Ok(bucket), true) = (instr.int("xf.bucket"), instr.bool("xf.async").unwrap_or(false)) {
            let axes: Vec<usize> = instr.ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect();
            let members = instr.int("xf.bucket_members").unwrap_or(1);
            // A bucket is one collective of its members' bytes: an all-reduce over the
            // concatenated gradients, or gathers or scatters launched as one NCCL group.
            let (collective, bytes) = collective_of(program, instr).unwrap_or((Collective::AllReduce, 0.0));
            let e = staging.entry(bucket).or_insert((0.0, axes, members));
            e.0 += bytes;
            e.2 -= 1;
            if e.2 <= 0 {
                let (b, axes, _) = staging.remove(&bucket).unwrap_or_default();
                let name = instr.op.strip_prefix("shard.").unwrap_or(&instr.op);
                let t = cluster.time(collective, b, &grid, &axes);
                w.communication += t;
                *w.breakdown.entry(format!("{name} {} (bucketed)", axis_names(&axes))).or_insert(0.0) += t;
                let free = communicator_free.entry(axes.clone()).or_insert(0.0);
                *free = w.clock.max(*free) + t;
                done.insert(bucket, (*free, axis_names(&axes)));
            }
            continue;
        }
        if instr.op == "xf.wait" {
            if let Some((at, axes)) = instr.int("xf.bucket").ok().and_then(|b| done.remove(&b)) {
                if at > w.clock {
                    *w.exposed.entry(axes).or_insert(0.0) += at - w.clock;
                    w.clock = at;
                }
            }
            continue;
        }
        match price_at(program, index, &fusion, cluster) {
            Priced::Compute(class, t) => {
                w.compute += t;
                w.clock += t;
                *w.breakdown.entry(class.to_string()).or_insert(0.0) += t;
            }
            Priced::Communication(axes, t) => {
                let kind = instr.op.strip_prefix("shard.").unwrap_or(&instr.op);
                *w.breakdown.entry(format!("{kind} {axes}")).or_insert(0.0) += t;
                // Pipeline transfers have communicators of their own.
                let queued = match instr.op.as_str() {
                    "shard.send" | "shard.recv" => 0.0,
                    _ => {
                        let group: Vec<usize> = instr.ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect();
                        let free = communicator_free.entry(group).or_insert(0.0);
                        let queued = (*free - w.clock).max(0.0);
                        *free = w.clock + queued + t;
                        queued
                    }
                };
                *w.exposed.entry(axes).or_insert(0.0) += queued + t;
                w.communication += t;
                w.clock += queued + t;
            }
        }
    }
    w
}

/// The sections an item of `work` runs (a backward item runs the weight section too unless
/// the schedule splits it off).
fn sections_of(work: Work, splits_w: bool) -> &'static [Phase] {
    match work {
        Work::F => &[Phase::Forward],
        Work::B if splits_w => &[Phase::Backward],
        Work::B => &[Phase::Backward, Phase::Weight],
        Work::W => &[Phase::Weight],
    }
}

/// Each instruction item `item` of pipeline rank `rank` runs, and when it begins, the item
/// starting at `start` (`walks`: the rank's sections' walks).
fn item_began(walks: &BTreeMap<(usize, usize, usize), Walk>, rank: usize, item: &shardc_runtime::schedule::Item, start: f64, splits_w: bool) -> Vec<(usize, f64)> {
    let (mut began, mut offset) = (Vec::new(), start);
    for &s in sections_of(item.work, splits_w) {
        let w = &walks[&(rank, item.chunk, s as usize)];
        began.extend(w.began.iter().map(|&(i, t)| (i, offset + t)));
        offset += w.clock;
    }
    began
}

/// The step buckets of pipeline rank `rank` that are on the wire when the schedule ends
/// (`makespan`), as the CUDA backend sends them: a chunk's buckets go out inside its last
/// backward work as their gradients are made ([`Program::step_bucket_triggers`]), the rest
/// of the chunk's early syncs at that work's end; each after the buckets before it on its
/// communicator, whatever chunk sent them. `items`: the rank's simulated timeline; `walks`:
/// its sections' walks, the work being the weight section alone when the schedule splits it
/// off. Region -> (seconds of its collective, seconds of it left after `makespan`).
fn early_step_buckets(program: &Program, items: &[(shardc_runtime::schedule::Item, f64, f64)], walks: &BTreeMap<(usize, usize, usize), Walk>, rank: usize, splits_w: bool, makespan: f64, cluster: &Cluster) -> EarlyBuckets {
    let Some(plan) = program.pipeline.as_ref() else { return EarlyBuckets::default() };
    let grid: Vec<i64> = program.mesh.iter().map(|&e| e as i64).collect();
    // (when it goes out, chunk, region)
    let mut sends: Vec<(f64, usize, usize)> = Vec::new();
    for (c, chunk) in plan.chunks.iter().enumerate() {
        let Some((item, start, end)) = items.iter().rev().find(|(item, _, _)| item.chunk == c && item.work != Work::F) else { continue };
        let (began, end) = (item_began(walks, rank, item, *start, splits_w), *end);
        let instructions: Vec<usize> = began.iter().map(|&(i, _)| i).collect();
        let triggered = program.step_bucket_triggers(chunk, &instructions);
        sends.extend(triggered.iter().map(|&(at, k)| (began[at].1, c, k)));
        sends.extend(
            (0..program.memory.buckets.len())
                .filter(|&k| program.memory.buckets[k].members.iter().all(|m| chunk.early_syncs.contains(m)) && !triggered.iter().any(|&(_, t)| t == k))
                .map(|k| (end, c, k)),
        );
    }
    sends.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut out = EarlyBuckets::default();
    for (at, _, k) in sends {
        let r = &program.memory.buckets[k];
        let axes: Vec<usize> = program.instrs[r.members[0]].ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect();
        let (collective, bytes, _) = step_bucket_collective(program, k);
        let t = cluster.time(collective, bytes, &grid, &axes);
        let queue = out.queues.entry(axes).or_default();
        let done = queue.last().map_or(0.0, |&(_, done)| done).max(at) + t;
        queue.push((at, done));
        out.left.insert(k, (t, (done - makespan).max(0.0)));
    }
    out
}

/// A pipeline rank's step buckets sent during the schedule ([`early_step_buckets`]).
#[derive(Default)]
struct EarlyBuckets {
    /// Region -> (seconds of its collective, seconds of it left when the schedule ends).
    left: BTreeMap<usize, (f64, f64)>,
    /// Communicator (its axes) -> each bucket's (send, end) on it, in order.
    queues: BTreeMap<Vec<usize>, Vec<(f64, f64)>>,
}

impl EarlyBuckets {
    /// How long a collective issued at `at` on the communicator of `axes` waits for the step
    /// buckets sent before it (it runs on that communicator's stream after them).
    fn wait(&self, axes: &[usize], at: f64) -> f64 {
        self.queues.get(axes).and_then(|q| q.iter().rev().find(|&&(sent, _)| sent <= at)).map_or(0.0, |&(_, done)| (done - at).max(0.0))
    }
}

/// How long each item of pipeline rank `rank` (on its simulated timeline `items`) stalls
/// because its first collective on a communicator queues behind the step buckets already
/// on it (ZeRO-3's gathers behind another chunk's reduce-scatters, say): item -> (seconds,
/// the communicator's axes).
fn item_stalls(program: &Program, items: &[(shardc_runtime::schedule::Item, f64, f64)], walks: &BTreeMap<(usize, usize, usize), Walk>, rank: usize, splits_w: bool, early: &EarlyBuckets) -> std::collections::HashMap<shardc_runtime::schedule::Item, (f64, String)> {
    let mut stalls = std::collections::HashMap::new();
    if early.queues.is_empty() {
        return stalls;
    }
    for &(item, start, _) in items {
        let (mut seen, mut stall) = (std::collections::BTreeSet::new(), (0.0f64, String::new()));
        for (index, at) in item_began(walks, rank, &item, start, splits_w) {
            let instr = &program.instrs[index];
            if collective_of(program, instr).is_none() {
                continue;
            }
            let axes: Vec<usize> = instr.ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect();
            let wait = early.wait(&axes, at);
            if seen.insert(axes.clone()) && wait > stall.0 {
                stall = (wait, axis_names(&axes));
            }
        }
        if stall.0 > 0.0 {
            stalls.insert(item, stall);
        }
    }
    stalls
}

/// Seconds a pipeline rank spends around `section` of `chunk` moving the values its plan
/// carries between micro-batches (as the pipeline runtime runs a plan): kept forward values
/// saved after the forward and restored for the backward, backward values kept for a split
/// weight pass, and gradients summed over micro-batches (read both, write one) and restored
/// for the step. Copies read and write their bytes. Returns the seconds before the section's
/// instructions (restores) and after them (saves and sums).
fn bookkeeping(program: &Program, chunk: &shardc_runtime::program::ChunkPlan, section: Phase, splits_w: bool, cluster: &Cluster) -> (f64, f64) {
    let bytes = |buffers: &[usize]| buffers.iter().map(|&b| program.buffers[b].len().saturating_mul(program.buffers[b].dtype.bytes()) as f64).sum::<f64>();
    let (kept_f, kept_b, sum_b, sum_w) = (bytes(&chunk.keep_forward), bytes(&chunk.keep_backward), bytes(&chunk.sum_backward), bytes(&chunk.sum_weight));
    let split = if splits_w { 2.0 * kept_b } else { 0.0 };
    let (before, after) = match section {
        Phase::Forward => (0.0, 2.0 * kept_f),
        Phase::Backward => (2.0 * kept_f, 3.0 * sum_b + split),
        Phase::Weight => (split, 3.0 * sum_w),
        Phase::Step => (2.0 * (sum_b + sum_w), 0.0),
    };
    let seconds = |moved: f64| if moved <= 0.0 { 0.0 } else { cluster.gpu.kernel_launch + moved / (cluster.gpu.memory_bandwidth * cluster.gpu.memory_efficiency) };
    (seconds(before), seconds(after))
}

/// Estimates one optimizer step of `programs`: one program for every rank, or one per
/// pipeline rank (each carrying its schedule).
pub fn estimate(programs: &[Program], cluster: &Cluster, model: ModelShape) -> Estimate {
    let gpus: f64 = programs.first().map_or(1, |p| p.mesh.iter().product::<usize>().max(1)) as f64;
    let mut out = Estimate::default();
    let pipelined = programs.iter().all(|p| p.pipeline.is_some()) && !programs.is_empty();
    if let (true, Ok(schedule)) = (pipelined, schedule_of(programs)) {
        let plans: Vec<_> = programs.iter().filter_map(|p| p.pipeline.as_ref()).collect();
        let splits_w = schedule.ranks.iter().flatten().any(|i| i.work == Work::W);
        // Each (rank, chunk, section) of the micro-batches' work walked once, with the copies
        // the pipeline runtime makes around it.
        let mut walks: BTreeMap<(usize, usize, usize), Walk> = BTreeMap::new();
        for (rank, plan) in plans.iter().enumerate() {
            for (chunk, chunk_plan) in plan.chunks.iter().enumerate() {
                for s in [Phase::Forward, Phase::Backward, Phase::Weight] {
                    let mut w = walk(&programs[rank], chunk_plan.range(s), cluster);
                    let (before, after) = bookkeeping(&programs[rank], chunk_plan, s, splits_w, cluster);
                    // The restores come first: the instructions begin after them.
                    w.began.iter_mut().for_each(|(_, t)| *t += before);
                    let t = before + after;
                    w.clock += t;
                    w.compute += t;
                    *w.breakdown.entry("pipeline bookkeeping".into()).or_insert(0.0) += t;
                    walks.insert((rank, chunk, s as usize), w);
                }
            }
        }
        let item_time = |rank: usize, work: Work, chunk: usize| -> f64 { sections_of(work, splits_w).iter().map(|&s| walks[&(rank, chunk, s as usize)].clock).sum() };
        // Each rank's step section, walked in the order the rank runs it (every chunk's, by
        // `xf.order`), starting when the schedule's last item ends; `early`: its step buckets
        // already on the wire then (see [`early_step_buckets`]).
        let step_walk = |rank: usize, early: &BTreeMap<usize, (f64, f64)>| -> Walk {
            // The gradient sums are restored first: the buckets run on meanwhile.
            let t: f64 = plans[rank].chunks.iter().map(|c| bookkeeping(&programs[rank], c, Phase::Step, splits_w, cluster).0).sum();
            let early: BTreeMap<usize, (f64, f64)> = early.iter().map(|(&k, &(seconds, left))| (k, (seconds, (left - t).max(0.0)))).collect();
            let mut w = walk_with(&programs[rank], programs[rank].step_order(&plans[rank].chunks), cluster, &early);
            w.clock += t;
            w.compute += t;
            *w.breakdown.entry("pipeline bookkeeping".into()).or_insert(0.0) += t;
            w
        };
        let shared = cluster.shared_host && gpus > 1.0;
        let steps: Vec<Walk>;
        if shared {
            // Every rank computes on the host's cores: ranks computing at once share them
            // (slowed by queueing in one pool of worker threads), a rank alone in another's bubble has them all,
            // and the collectives are work of the same cores (their calibrated times are
            // those of every rank taking part at once). Each pipeline rank's program stands
            // for gpus / pipeline ranks replicas computing alongside it. The CPU backend's
            // pipeline runtime sends a chunk's step buckets at the end of its last backward
            // work, where they are work of the same cores: the step section pays for them.
            steps = (0..plans.len()).map(|r| step_walk(r, &BTreeMap::new())).collect();
            let replicas = gpus / plans.len() as f64;
            let timeline = simulate_shared(&schedule, |rank, item| item_time(rank, item.work, item.chunk), |r| steps[r].clock, replicas, cluster.shared_pool_slowdown);
            out.step_seconds = timeline.as_ref().map_or(0.0, |t| t.makespan);
            out.bubble_seconds = timeline.as_ref().map_or(0.0, |t| t.bubble * t.makespan);
        } else {
            // The step buckets go out during the schedule; collectives of later items on the
            // same communicator queue behind them, which stalls those items: the schedule is
            // simulated again with the stalls (once: the buckets are then placed on that
            // timeline).
            let first = simulate_with(&schedule, |rank, item| item_time(rank, item.work, item.chunk));
            let stalls: Vec<std::collections::HashMap<_, _>> = (0..plans.len())
                .map(|r| {
                    first.as_ref().map_or_else(
                        |_| Default::default(),
                        |t| item_stalls(&programs[r], &t.ranks[r], &walks, r, splits_w, &early_step_buckets(&programs[r], &t.ranks[r], &walks, r, splits_w, t.makespan, cluster)),
                    )
                })
                .collect();
            let timeline = simulate_with(&schedule, |rank, item| item_time(rank, item.work, item.chunk) + stalls[rank].get(item).map_or(0.0, |s: &(f64, String)| s.0));
            let makespan = timeline.as_ref().map_or(0.0, |t| t.makespan);
            steps = (0..plans.len())
                .map(|r| {
                    let early = timeline.as_ref().map_or_else(|_| BTreeMap::new(), |t| early_step_buckets(&programs[r], &t.ranks[r], &walks, r, splits_w, makespan, cluster).left);
                    step_walk(r, &early)
                })
                .collect();
            for (seconds, axes) in stalls.first().into_iter().flat_map(|s| s.values()) {
                *out.exposed_communication.entry(axes.clone()).or_insert(0.0) += seconds;
            }
            out.step_seconds = makespan + steps.iter().map(|w| w.clock).fold(0.0, f64::max);
            out.bubble_seconds = timeline.as_ref().map_or(0.0, |t| t.bubble * makespan);
        }
        let m = schedule.microbatches as f64;
        // A quantity of rank `r`'s walks over one step: every micro-batch's items, and the step.
        let per_rank = |r: usize, f: &dyn Fn(&Walk) -> f64| -> f64 {
            let per_item: f64 = (0..plans[r].chunks.len()).map(|c| [Phase::Forward, Phase::Backward, Phase::Weight].iter().map(|&s| f(&walks[&(r, c, s as usize)])).sum::<f64>()).sum();
            per_item * m + f(&steps[r])
        };
        out.compute_seconds = (0..plans.len()).map(|r| per_rank(r, &|w| w.compute)).fold(0.0, f64::max);
        // Communication of rank 0, per item times the micro-batches, plus its step.
        let rank0 = walks.iter().filter(|((rank, _, _), _)| *rank == 0).map(|(_, w)| (w, m));
        for (w, times) in rank0.chain(steps.first().map(|w| (w, 1.0))) {
            for (axes, t) in &w.exposed {
                *out.exposed_communication.entry(axes.clone()).or_insert(0.0) += t * times;
            }
            for (kind, t) in &w.breakdown {
                *out.breakdown.entry(kind.clone()).or_insert(0.0) += t * times;
            }
        }
        if shared {
            out.shared_compute = (0..plans.len()).map(|r| per_rank(r, &|w| w.compute)).sum::<f64>() * gpus / plans.len() as f64;
        }
    } else if let Some(program) = programs.first() {
        let w = walk(program, 0..program.instrs.len(), cluster);
        out.step_seconds = w.clock;
        out.compute_seconds = w.compute;
        if cluster.shared_host && gpus > 1.0 {
            // Every rank computes on the same cores at the same time, slowed by contending
            // for them, and the collectives are work of those cores too (their calibrated
            // times are those of every rank taking part at once): nothing overlaps.
            out.shared_compute = w.compute * gpus * cluster.shared_slowdown;
            out.step_seconds = out.shared_compute + w.communication;
        }
        out.exposed_communication = w.exposed;
        out.breakdown = w.breakdown;
    }
    out.exposed_communication.retain(|_, t| *t > 0.0);
    out.model_flops = model.tokens_per_step * (6.0 * model.parameters + 12.0 * model.layers * model.seq * model.hidden);
    if out.step_seconds > 0.0 {
        out.tokens_per_second = model.tokens_per_step / out.step_seconds;
        let fp32 = programs.first().and_then(|p| p.buffers.first()).is_some_and(|b| b.dtype != DType::Bf16);
        let peak = if fp32 { cluster.gpu.fp32_flops } else { cluster.gpu.bf16_flops };
        out.mfu = out.model_flops / out.step_seconds / (peak * gpus);
    }
    let communication: f64 = out.exposed_communication.values().sum();
    out.bound = if out.shared_compute > 0.0 {
        "shared cores".into()
    } else if out.bubble_seconds > out.compute_seconds.max(communication) {
        "pipeline bubble".into()
    } else if communication > out.compute_seconds {
        "communication".into()
    } else {
        "compute".into()
    };
    out
}

/// Bytes one GPU holds for a training step, in the program's own types (in mixed precision:
/// bf16 weights and activations; fp32 gradients, master weights and Adam moments), from the
/// compiled rank program.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemoryEstimate {
    /// Bytes of the weights this rank holds (its shards, in the program's layout and type:
    /// bf16 in mixed precision).
    pub parameters: f64,
    /// Bytes of gradients (fp32 in mixed precision, where the program casts them up before
    /// reducing and accumulating; from ZeRO stage 2, only the shard the optimizer state's
    /// layout gives this rank).
    pub gradients: f64,
    /// Bytes of every gradient of the step, as above (the model-states term of Rajbhandari et
    /// al.). A pipelined rank holds them all (its sums over micro-batches), so `gradients`
    /// is this; a step without a pipeline makes them in its arena as the backward pass frees
    /// activations, and `gradients` is the gradient values alive at the arena's peak: fewer,
    /// or more where unreduced copies (before a cast, a sum or a reduce-scatter) are alive
    /// there too.
    #[serde(default)]
    pub all_gradients: f64,
    /// Bytes of fp32 master weights, first and second moments, as the program's optimizer
    /// state arguments lay them out (sharded over dp within each tensor-parallel shard from
    /// stage 1).
    pub optimizer: f64,
    /// Forward values the backward pass reads: in a pipeline rank, the sets of storage the
    /// runtime gives each micro-batch's kept values from its forward to its backward (and
    /// weight-gradient) work, outside the arena, as many as its schedule has in flight at
    /// once; without a pipeline, the part alive at the arena's peak.
    pub activations: f64,
    /// Bytes of every forward value the backward pass reads, for one micro-batch (the
    /// quantity of Korthikanti et al.). A pipelined rank holds `in_flight` times this; a step
    /// without a pipeline frees them as it makes gradients, and `activations` is the part
    /// alive at the arena's peak.
    #[serde(default)]
    pub kept_per_microbatch: f64,
    /// Micro-batches whose activations the rank holds at once.
    pub in_flight: usize,
    /// Bytes of the peak of everything else the memory plan holds at once (in a pipeline
    /// rank, its arena, which holds no kept values, but the step buckets' regions, counted
    /// as gradients).
    pub temporaries: f64,
    /// Bytes the CUDA backend stages beside the memory plan (see `staging_bytes`): the
    /// copies a pipeline rank sends its transfers from, and the rearranged tensors of gathers,
    /// scatters and all-to-alls along inner dimensions; added to `total`.
    #[serde(default)]
    pub staging: f64,
    /// Bytes of data-parallel gradient buckets: the reduced gradients of every bucketed
    /// `xf.async` all-reduce, held from the bucket's issue to its `xf.wait` at the end of the
    /// step; in a pipeline rank, its step buckets' regions (all-reduced gradients, or ZeRO's
    /// reduce-scattered shards), alive the whole step.
    /// Not added to `total`: no backend stages a bucket in device memory of its own. The
    /// memory plan lays a bucket's all-reduce outputs back to back (a [`BucketRegion`] of
    /// the arena, so within `temporaries` and the gradient term's bytes: the input gradients
    /// die at the issue); the CUDA backend copies each member into its place and reduces
    /// the whole region with one collective, in place; only the CPU backend concatenates a
    /// bucket, in host memory.
    ///
    /// [`BucketRegion`]: shardc_runtime::program::BucketRegion
    #[serde(default)]
    pub buckets: f64,
    /// Bytes of gradient buckets beyond the above, staged in separate device buffers: 0 for
    /// every backend today (see `buckets`); added to `total`.
    #[serde(default)]
    pub bucket_staging: f64,
    /// Bytes the CUDA backend allocates beside the memory plan: the device plan's scratch (the
    /// launches' shared workspace) and cuBLASLt's workspace (its sm_90 size; 4 MiB on older
    /// GPUs). 0 for a program without device code; added to `total`.
    #[serde(default)]
    pub device_scratch: f64,
    /// The sum.
    pub total: f64,
}

/// What one parameter takes on a rank, read from the program's own buffers.
struct ParameterBytes {
    /// Its model-parallel share (elements).
    psi: f64,
    /// Elements this rank holds of one of its optimizer-state tensors.
    state_elements: f64,
    /// Bytes of the parameter as the program stores it (bf16 in mixed precision).
    param_bytes: f64,
    /// Bytes of its optimizer state on this rank: moments and the fp32 master copy, each in
    /// its own type and layout.
    state_bytes: f64,
    /// Bytes per element its gradient is reduced and accumulated in: fp32 when a master copy
    /// exists (the program casts the gradient up), else the parameter's own type.
    gradient_element_bytes: f64,
}

fn parameter_bytes(program: &Program) -> Vec<ParameterBytes> {
    use shardc_runtime::program::Role;
    let local = |b: &shardc_runtime::program::Binding| program.buffers[b.buffer].len() as f64;
    let bytes = |b: &shardc_runtime::program::Binding| local(b) * program.buffers[b.buffer].dtype.bytes() as f64;
    // opt.<kind>.<param> -> (bytes of every such tensor, whether a master copy is among them).
    let mut held: std::collections::HashMap<&str, (f64, bool)> = std::collections::HashMap::new();
    for a in program.args.iter().filter(|a| matches!(a.role, Some(Role::OptState | Role::Master))) {
        if let Some((_, param)) = shardc_ir::facts::state_of(&a.name) {
            let entry = held.entry(param).or_insert((0.0, false));
            entry.0 += bytes(a);
            entry.1 |= a.role == Some(Role::Master);
        }
    }
    let state: std::collections::HashMap<&str, f64> = program
        .args
        .iter()
        .filter(|a| a.role == Some(Role::OptState))
        .filter_map(|a| shardc_ir::facts::state_of(&a.name).filter(|(state, _)| *state == "m").map(|(_, param)| (param, local(a))))
        .collect();
    program
        .args
        .iter()
        .filter(|a| a.role == Some(Role::Param))
        .map(|a| {
            let psi = match &a.layout {
                Some(layout) => {
                    let global: f64 = layout.global_shape.iter().product::<usize>() as f64;
                    let parts: usize = layout.split.iter().flatten().filter(|&&axis| axis != 0).map(|&axis| program.mesh.get(axis).copied().unwrap_or(1)).product();
                    global / parts.max(1) as f64
                }
                None => local(a),
            };
            let own = program.buffers[a.buffer].dtype.bytes() as f64;
            let (state_bytes, master) = held.get(a.name.as_str()).copied().unwrap_or((0.0, false));
            ParameterBytes {
                psi,
                state_elements: state.get(a.name.as_str()).copied().unwrap_or(local(a)),
                param_bytes: bytes(a),
                state_bytes,
                gradient_element_bytes: if master { 4.0 } else { own },
            }
        })
        .collect()
}

/// Bytes of the sets of kept values pipeline rank `program` holds while it runs its schedule
/// `items`, as the CUDA runtime holds them: a micro-batch's forward values from its forward to
/// its backward (to its weight gradient, which reads them too, where the schedule splits it
/// off), and its backward values from the backward to the weight gradient, each in a set
/// pooled over the rank's chunks ([`KeptPool`]).
///
/// [`KeptPool`]: shardc_runtime::program::KeptPool
fn held_activations(program: &Program, items: &[shardc_runtime::schedule::Item]) -> f64 {
    shardc_runtime::program::KeptPool::of_schedule(program, items) as f64
}

/// Bytes of staging the CUDA backend keeps beside the memory plan in a process of a
/// multi-process run: the copies a pipeline rank sends from (a transfer's buffer is copied
/// out of the arena, which the next instructions reuse, and the copy is reused by later
/// transfers of its size once sent: one per size, and on a GPU one more for each send of that
/// size still in flight when another begins), and the collectives' staging
/// ([`Program::nccl_staging_bytes`]: one buffer as large as the largest need, and one of
/// its own for each asynchronous reduce-scatter along an inner dimension).
fn staging_bytes(program: &Program) -> f64 {
    let sizes: std::collections::BTreeSet<usize> = program.instrs.iter().filter(|i| i.op == "shard.send").filter_map(|i| i.inputs.first()).map(|&b| program.buffers[b].len().saturating_mul(program.buffers[b].dtype.bytes())).collect();
    let needs: Vec<(usize, bool)> = (0..program.instrs.len()).map(|i| program.nccl_staging_bytes(i)).collect();
    let shared = needs.iter().filter(|n| !n.1).map(|n| n.0).max().unwrap_or(0);
    let own: usize = needs.iter().filter(|n| n.1).map(|n| n.0).sum();
    (sizes.into_iter().sum::<usize>() + shared + own) as f64
}

/// Bytes of forward values read after the forward pass, per micro-batch, in the program's
/// types.
fn kept_activations(program: &Program) -> f64 {
    let elements = |buffers: &[usize]| buffers.iter().map(|&b| program.buffers[b].len() as f64 * program.buffers[b].dtype.bytes() as f64).sum::<f64>();
    if let Some(plan) = &program.pipeline {
        return plan.chunks.iter().map(|c| elements(&c.keep_forward)).sum::<f64>() / plan.chunks.len().max(1) as f64;
    }
    // The forward pass ends where the loss seed starts the backward pass.
    let Some(end) = backward_start(program) else { return 0.0 };
    let args: std::collections::HashSet<usize> = program.args.iter().map(|a| a.buffer).collect();
    let defined: std::collections::HashSet<usize> = program.instrs[..end].iter().flat_map(|i| i.outputs.iter().copied()).filter(|b| !args.contains(b)).collect();
    let kept: std::collections::BTreeSet<usize> = program.instrs[end..].iter().flat_map(|i| i.inputs.iter().copied()).filter(|b| defined.contains(b)).collect();
    elements(&kept.into_iter().collect::<Vec<_>>())
}

/// What a program's arena holds at the instruction where the most of its temporaries are
/// alive: forward values the backward pass reads, gradients (what an `optimizer.*`
/// instruction reads), and the rest.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ArenaPeak {
    /// The instruction.
    pub at: usize,
    /// Bytes of all temporaries alive there.
    pub live: f64,
    /// Of those, forward values the backward pass reads.
    pub kept: f64,
    /// Of those, values the optimizer section reads (gradients, reduced or not).
    pub gradients: f64,
    /// The most bytes of other temporaries (neither kept for the backward nor gradients)
    /// alive at any one instruction, which need not be the peak's: a MoE layer's expert
    /// buffers peak in its backward, while fewer gradients are alive.
    pub scratch: f64,
}

/// The peak of `program`'s temporaries (buffers placed in the arena), by what they hold.
pub fn arena_peak(program: &Program) -> ArenaPeak {
    let n = program.instrs.len();
    let args: std::collections::HashSet<usize> = program.args.iter().map(|a| a.buffer).collect();
    let (mut first, mut last) = (vec![usize::MAX; program.buffers.len()], vec![0usize; program.buffers.len()]);
    for (i, instr) in program.instrs.iter().enumerate() {
        for &b in instr.outputs.iter().chain(&instr.inputs) {
            first[b] = first[b].min(i);
            last[b] = last[b].max(i);
        }
    }
    for r in &program.results {
        last[r.buffer] = n.saturating_sub(1);
    }
    let temporary = |b: usize| !args.contains(&b) && first[b] != usize::MAX;
    let bytes = |b: usize| program.buffers[b].len() as f64 * program.buffers[b].dtype.bytes() as f64;
    let mut delta = vec![0.0f64; n + 1];
    for b in (0..program.buffers.len()).filter(|&b| temporary(b)) {
        delta[first[b]] += bytes(b);
        delta[last[b].max(first[b]) + 1] -= bytes(b);
    }
    let (mut live, mut peak) = (0.0f64, ArenaPeak::default());
    for (i, d) in delta.iter().take(n).enumerate() {
        live += d;
        if live > peak.live {
            (peak.at, peak.live) = (i, live);
        }
    }
    let seed = backward_start(program).unwrap_or(n);
    let alive = |b: usize| temporary(b) && first[b] <= peak.at && peak.at <= last[b];
    let read_by = |from: usize, to: usize, which: &dyn Fn(&shardc_runtime::program::Instr) -> bool| -> std::collections::HashSet<usize> {
        program.instrs[from..to].iter().filter(|i| which(i)).flat_map(|i| i.inputs.iter().copied()).collect()
    };
    let kept_set = read_by(seed, n, &|_| true);
    // Gradients: what the optimizer section reads, and what reaches it through sums, casts and
    // collectives (a tied embedding's two partial gradients, a bf16 gradient before its
    // fp32 cast, a gradient before its reduction).
    let mut gradient_set = read_by(0, n, &|i| i.origin.role == Role::Optimizer);
    for instr in program.instrs[seed.min(n)..].iter().rev() {
        let carries = matches!(instr.op.as_str(), "xf.add" | "xf.cast") || instr.op.starts_with("shard.") || instr.op == "xf.wait";
        if carries && instr.origin.role != Role::Optimizer && instr.outputs.iter().any(|b| gradient_set.contains(b)) {
            gradient_set.extend(instr.inputs.iter().copied());
        }
    }
    for b in (0..program.buffers.len()).filter(|&b| alive(b)) {
        if first[b] < seed && kept_set.contains(&b) {
            peak.kept += bytes(b);
        } else if gradient_set.contains(&b) {
            peak.gradients += bytes(b);
        }
    }
    // The other temporaries alive at each instruction, at their most.
    let mut other = vec![0.0f64; n + 1];
    for b in (0..program.buffers.len()).filter(|&b| temporary(b) && !(first[b] < seed && kept_set.contains(&b)) && !gradient_set.contains(&b)) {
        other[first[b]] += bytes(b);
        other[last[b].max(first[b]) + 1] -= bytes(b);
    }
    let mut live = 0.0f64;
    for d in other.iter().take(n) {
        live += d;
        peak.scratch = peak.scratch.max(live);
    }
    peak
}

/// Bytes of the program's gradient bucket regions (the outputs of its bucketed `xf.async`
/// all-reduces, back to back). Other asynchronous collectives read and write their own
/// buffers, which the memory plan keeps alive until their wait: they are in `temporaries`.
fn bucket_bytes(program: &Program) -> f64 {
    program.memory.buckets.iter().map(|r| r.bytes as f64).sum()
}

/// The memory of each rank program (one, or one per pipeline rank) compiled under ZeRO stage
/// `zero`: parameters and optimizer state are counted in the program's own layouts, so the
/// estimate says what the program shards.
pub fn memory(programs: &[Program], zero: u8) -> Vec<MemoryEstimate> {
    let pipelined = programs.iter().all(|p| p.pipeline.is_some()) && !programs.is_empty();
    let schedule = schedule_of(programs).ok().filter(|_| pipelined);
    let in_flight: Vec<usize> = match &schedule {
        // In-flight micro-batches per chunk-sized share of the rank's layers.
        Some(schedule) => simulate_with(schedule, |_, _| 1.0).map(|t| t.peak_in_flight).unwrap_or_else(|_| vec![1; programs.len()]),
        None => vec![1; programs.len()],
    };
    programs
        .iter()
        .zip(in_flight)
        .enumerate()
        .map(|(rank, (program, in_flight))| {
            // Parameters and optimizer state as the program lays them out (ZeRO shards them
            // over dp within each tensor-parallel shard); gradients as the optimizer state
            // from stage 2, which keeps only the reduce-scattered shard.
            let shards = parameter_bytes(program);
            let sum = |f: &dyn Fn(&ParameterBytes) -> f64| shards.iter().map(f).sum::<f64>();
            // Bytes as the program stores them: bf16 parameters, fp32 master weights and
            // moments, fp32 gradients in mixed precision; f32 throughout in an f32 program.
            let (parameters, optimizer) = (sum(&|s| s.param_bytes), sum(&|s| s.state_bytes));
            let all_gradients = if zero >= 2 { sum(&|s| s.state_elements * s.gradient_element_bytes) } else { sum(&|s| s.psi * s.gradient_element_bytes) };
            let kept_per_microbatch = kept_activations(program);
            let (kept, gradients, temporaries) = match &program.pipeline {
                // The pipeline runtime keeps each micro-batch's values and the gradient sums
                // in storage of their own, beside the arena of temporaries. The sums are what the plan
                // lists: whole gradients, reduce-scattered only in the step (ZeRO-2 shards
                // them only without accumulation), as Megatron's gradient buffer is whole.
                Some(plan) => {
                    let bytes = |ids: &[usize]| ids.iter().map(|&b| program.buffers[b].len().saturating_mul(program.buffers[b].dtype.bytes()) as f64).sum::<f64>();
                    // An all-reduce step bucket's gradients are summed in its region of the
                    // arena (alive the whole step), not in storage of their own: counted as
                    // gradients, once. A reduce-scatter bucket's are summed whole outside the
                    // arena, and its region holds their shards besides.
                    let in_region: std::collections::HashSet<usize> = (0..program.memory.buckets.len()).filter(|&k| !program.step_bucket_scatters(k)).flat_map(|k| program.step_bucket_inputs(k)).collect();
                    let held = |ids: &[usize]| bytes(&ids.iter().copied().filter(|b| !in_region.contains(b)).collect::<Vec<_>>());
                    let regions: f64 = program.memory.buckets.iter().map(|r| r.bytes as f64).sum();
                    let sums: f64 = plan.chunks.iter().map(|c| held(&c.sum_backward) + held(&c.sum_weight)).sum::<f64>() + regions;
                    // Kept values live outside the arena, a set per micro-batch in flight;
                    // where every backward comes right after its forward, in the arena,
                    // which holds one micro-batch's (the rest of it is temporaries).
                    let arena = (program.memory.temporary_bytes as f64 - regions).max(0.0);
                    let outside = plan.chunks.iter().any(|c| c.keep_forward.iter().any(|&b| program.arena_range(b).is_none()));
                    if outside {
                        let sets = schedule.as_ref().and_then(|s| s.ranks.get(rank)).map_or(kept_per_microbatch * in_flight as f64, |items| held_activations(program, items));
                        (sets, sums, arena)
                    } else {
                        let running = kept_per_microbatch.min(arena);
                        (running, sums, arena - running)
                    }
                }
                // A step without a pipeline holds its gradients in the arena, from the
                // backward pass to the update: the terms are what the arena holds at its peak.
                None => {
                    let peak = arena_peak(program);
                    let rest = (program.memory.temporary_bytes as f64 - peak.kept - peak.gradients).max(0.0);
                    (peak.kept, peak.gradients, rest)
                }
            };
            let activations = if program.pipeline.is_some() { kept } else { kept * in_flight as f64 };
            let staging = staging_bytes(program);
            let buckets = bucket_bytes(program);
            // Members are reduced in their own output buffers (see `MemoryEstimate::buckets`).
            let bucket_staging = 0.0;
            // The CUDA backend gives cuBLASLt its workspace on every GPU where the library
            // loads, whatever the plan: counted at its sm_90 size, the larger.
            let device_scratch = program.device.as_ref().map_or(0.0, |plan| (plan.workspace_bytes + shardc_runtime::program::CUBLASLT_WORKSPACE_BYTES) as f64);
            let mut m = MemoryEstimate { parameters, gradients, all_gradients, optimizer, activations, kept_per_microbatch, in_flight, temporaries, staging, buckets, bucket_staging, device_scratch, total: 0.0 };
            m.total = m.parameters + m.gradients + m.optimizer + m.activations + m.temporaries + m.staging + m.bucket_staging + m.device_scratch;
            m
        })
        .collect()
}

/// Per-layer and per-step costs measured on a compiled program of a model cut to one layer
/// (the planner composes them for any depth, data and pipeline split).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UnitCosts {
    /// Seconds of one layer's forward (compute and its tensor-parallel collectives).
    pub layer_forward: f64,
    /// Seconds of one layer's backward (with any recomputation).
    pub layer_backward: f64,
    /// Seconds of the embedding's forward and backward.
    pub embed: (f64, f64),
    /// Seconds of the head's (final norm, LM head, loss) forward and backward.
    pub head: (f64, f64),
    /// Bytes one layer keeps for its backward pass (in the program's types).
    pub layer_kept: f64,
    /// Bytes the embedding and head keep.
    pub other_kept: f64,
    /// Bytes per parameter of the weights, as the program stores them (2 in mixed precision).
    pub parameter_bytes: f64,
    /// Bytes per parameter of its gradient as reduced and accumulated (4 in mixed precision).
    pub gradient_bytes: f64,
    /// Bytes per parameter of optimizer state: moments and master copy (12 in mixed
    /// precision with AdamW).
    pub state_bytes: f64,
    /// Parameters of one layer on one tensor-parallel rank.
    pub layer_params: f64,
    /// Parameters of the embedding and head on one tensor-parallel rank.
    pub other_params: f64,
    /// Shape of each parameter on one tensor-parallel rank, and whether it belongs to the
    /// layer (else to the embedding and head): ZeRO shards a tensor only along a dimension
    /// that dp divides.
    pub param_shapes: Vec<(bool, Vec<usize>)>,
    /// Elements of the layer's parameters split over the expert-parallel axis (a MoE
    /// layer's experts, per rank): ZeRO shards them over the data-parallel ranks holding the
    /// same experts only.
    pub expert_params: f64,
    /// Peak temporary bytes besides kept values.
    pub temporaries: f64,
    /// One layer's forward and backward seconds by kernel class (`gemm`, `attention`,
    /// `memory-bound`) and by collective and axes (`all_reduce tp`), as priced above.
    pub layer_breakdown: BTreeMap<String, f64>,
    /// The same for the embedding's forward and backward.
    pub embed_breakdown: BTreeMap<String, f64>,
    /// The same for the head's forward and backward.
    pub head_breakdown: BTreeMap<String, f64>,
    /// Under context parallelism, the form of attention the unit compiled to: `ring` (key
    /// and value blocks passed around the ring) or `all-gather`; `None` without it.
    pub context_attention: Option<&'static str>,
}

/// Bytes per parameter the data-parallel collectives of a compiled step move, by kind, as
/// [`Cluster::time`] prices them (an all-reduce or reduce-scatter by its input, an
/// all-gather by its output); parameters are the model-parallel share (the program's
/// parameters before any ZeRO split over dp).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DataParallelTraffic {
    /// Gradient all-reduces (ZeRO stage 0).
    pub all_reduce: f64,
    /// Gradient reduce-scatters (from stage 1).
    pub reduce_scatter: f64,
    /// Gathers of updated parameter shards (stages 1 and 2), once per step.
    pub all_gather: f64,
    /// Gathers of stored parameter shards before their forward and backward use (stage 3):
    /// pipelined programs issue them in the forward and backward sections, so once per
    /// micro-batch, inline.
    pub gather_per_microbatch: f64,
    /// Collectives over dp the step issues.
    pub collectives: usize,
}

impl DataParallelTraffic {
    /// The kinds, their names and bytes per parameter.
    pub fn kinds(&self) -> [(Collective, &'static str, f64); 3] {
        [(Collective::AllReduce, "all_reduce", self.all_reduce), (Collective::ReduceScatter, "reduce_scatter", self.reduce_scatter), (Collective::AllGather, "all_gather", self.all_gather)]
    }

    /// Seconds of the per-micro-batch gathers of `parameters` parameters over axis 0 (dp) of
    /// `grid`, priced as one collective.
    pub fn microbatch_time(&self, cluster: &Cluster, parameters: f64, grid: &[i64]) -> f64 {
        if self.gather_per_microbatch > 0.0 { cluster.time(Collective::AllGather, self.gather_per_microbatch * parameters, grid, &[DP_AXIS]) } else { 0.0 }
    }

    /// Seconds of each per-step kind for `parameters` parameters over the gradient-sync axes
    /// `axes` of `grid` (dp; dp and cp under context parallelism, whose ranks' gradients are
    /// summed together), each kind priced as one collective of all its bytes (as buckets
    /// send them).
    pub fn times(&self, cluster: &Cluster, parameters: f64, grid: &[i64], axes: &[usize]) -> [(&'static str, f64); 3] {
        self.kinds().map(|(kind, name, bytes)| (name, if bytes > 0.0 { cluster.time(kind, bytes * parameters, grid, axes) } else { 0.0 }))
    }
}

/// What the program's collectives over dp (those whose `grid_axes` include axis 0) move per
/// parameter.
pub fn data_parallel_traffic(program: &Program) -> DataParallelTraffic {
    let psi: f64 = parameter_bytes(program).iter().map(|s| s.psi).sum::<f64>().max(1.0);
    let stored: std::collections::HashSet<usize> = program.args.iter().filter(|a| a.role == Some(shardc_runtime::program::Role::Param)).map(|a| a.buffer).collect();
    let mut t = DataParallelTraffic::default();
    for instr in &program.instrs {
        if !instr.ints("grid_axes").unwrap_or_default().contains(&0) {
            continue;
        }
        let bytes = |b: Option<&usize>| b.map_or(0.0, |&b| program.buffers[b].len() as f64 * program.buffers[b].dtype.bytes() as f64);
        let slot = match instr.op.as_str() {
            "shard.all_reduce" => (&mut t.all_reduce, bytes(instr.inputs.first())),
            "shard.reduce_scatter" => (&mut t.reduce_scatter, bytes(instr.inputs.first())),
            "shard.all_gather" if instr.inputs.first().is_some_and(|b| stored.contains(b)) => (&mut t.gather_per_microbatch, bytes(instr.outputs.first())),
            "shard.all_gather" => (&mut t.all_gather, bytes(instr.outputs.first())),
            _ => continue,
        };
        *slot.0 += slot.1 / psi;
        t.collectives += 1;
    }
    t
}

impl UnitCosts {
    /// Parameters of one layer (`layer`) or of the embedding and head that ZeRO can shard over
    /// `dp`: those with a dimension `dp` divides (the sharding pass splits a tensor along the
    /// first such dimension and keeps the others whole on every rank).
    pub fn shardable_params(&self, layer: bool, dp: u64) -> f64 {
        self.param_shapes
            .iter()
            .filter(|(l, shape)| *l == layer && shape.iter().any(|&d| dp > 0 && d as u64 % dp == 0))
            .map(|(_, shape)| shape.iter().product::<usize>() as f64)
            .sum()
    }
}

/// Where the planner's per-layer model counts an instruction: with a layer, with the
/// embedding, or with the rest (the head, the loss and the optimizer, which the planner
/// prices once per step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Layer,
    Embedding,
    Rest,
}

impl Part {
    fn of(origin: Origin) -> Part {
        match origin.block {
            _ if origin.role == Role::Optimizer => Part::Rest,
            Block::Attention(_) | Block::Mlp(_) => Part::Layer,
            Block::Embedding => Part::Embedding,
            _ => Part::Rest,
        }
    }
}

/// Where the backward pass starts in a program of one stage: its first gradient instruction
/// (the loss's seed).
fn backward_start(program: &Program) -> Option<usize> {
    program.instrs.iter().position(|i| i.origin.role == Role::Gradient)
}

/// Measures [`UnitCosts`] on the training step of a one-layer model.
pub fn unit_costs(program: &Program, cluster: &Cluster) -> UnitCosts {
    let mut u = UnitCosts::default();
    let fusion = Fusion::of(program);
    let seed = backward_start(program).unwrap_or(program.instrs.len());
    for (index, instr) in program.instrs.iter().enumerate() {
        // Data-parallel gradient syncs (buckets over dp) are the planner's to price for each
        // data-parallel degree; every other collective counts, asynchronous or not (the
        // planner adds a layer's costs up without overlap).
        let dp_bucket = instr.bool("xf.async").unwrap_or(false) && instr.ints("grid_axes").is_ok_and(|a| a == [DP_AXIS as i64]);
        // So are the weight gradients' all-reduces over cp (a step reduces them over dp and
        // cp together, once, however many micro-batches it has).
        // And, with expert parallelism (a unit compiled at dp = ep), the weight gradients'
        // reductions over the data-parallel axes.
        let data_axes = [DP_AXIS as i64, shardc_ir::mesh::EP_AXIS as i64];
        let cp_sync = instr.op == "shard.all_reduce"
            && instr.origin.role == shardc_ir::facts::Role::Gradient
            && instr.ints("grid_axes").is_ok_and(|a| a == [shardc_ir::mesh::CP_AXIS as i64] || (!a.is_empty() && a.iter().all(|x| data_axes.contains(x))));
        if instr.op == "xf.adamw" || instr.op == "xf.sgd" || instr.op == "xf.wait" || dp_bucket || cp_sync {
            continue;
        }
        let priced = price_at(program, index, &fusion, cluster);
        let t = priced.seconds();
        let key = match &priced {
            Priced::Compute(class, _) => class.to_string(),
            Priced::Communication(axes, _) => format!("{} {axes}", instr.op.strip_prefix("shard.").unwrap_or(&instr.op)),
        };
        let part = Part::of(instr.origin);
        let classes = if part == Part::Layer {
            &mut u.layer_breakdown
        } else if part == Part::Embedding {
            &mut u.embed_breakdown
        } else {
            &mut u.head_breakdown
        };
        *classes.entry(key).or_insert(0.0) += t;
        let backward = index >= seed;
        let slot = if part == Part::Layer {
            if backward { &mut u.layer_backward } else { &mut u.layer_forward }
        } else if part == Part::Embedding {
            if backward { &mut u.embed.1 } else { &mut u.embed.0 }
        } else if backward {
            &mut u.head.1
        } else {
            &mut u.head.0
        };
        *slot += t;
    }
    if program.instrs.iter().any(|i| i.origin.block.layer().is_some() && i.op == "xf.attention") && program.mesh.get(shardc_ir::mesh::CP_AXIS).is_some_and(|&cp| cp > 1) {
        u.context_attention = Some("all-gather");
    }
    if program.instrs.iter().any(|i| i.op == "xf.attention_block") {
        u.context_attention = Some("ring");
    }
    // Kept values, by where they were made.
    let args: std::collections::HashSet<usize> = program.args.iter().map(|a| a.buffer).collect();
    let mut made_at: std::collections::HashMap<usize, Part> = std::collections::HashMap::new();
    for instr in &program.instrs[..seed] {
        for &b in &instr.outputs {
            if !args.contains(&b) {
                made_at.insert(b, Part::of(instr.origin));
            }
        }
    }
    let kept: std::collections::BTreeSet<usize> = program.instrs[seed..].iter().flat_map(|i| i.inputs.iter().copied()).filter(|b| made_at.contains_key(b)).collect();
    for b in kept {
        let bytes = program.buffers[b].len().saturating_mul(program.buffers[b].dtype.bytes()) as f64;
        if made_at[&b] == Part::Layer {
            u.layer_kept += bytes;
        } else {
            u.other_kept += bytes;
        }
    }
    for a in program.args.iter().filter(|a| a.role == Some(shardc_runtime::program::Role::Param)) {
        let n = program.buffers[a.buffer].len() as f64;
        if a.block.layer().is_some() {
            u.layer_params += n;
        } else {
            u.other_params += n;
        }
        let expert = a.layout.as_ref().is_some_and(|l| l.split.iter().flatten().any(|&axis| axis == shardc_ir::mesh::EP_AXIS));
        if expert {
            u.expert_params += n;
        } else {
            u.param_shapes.push((a.block.layer().is_some(), program.buffers[a.buffer].shape.clone()));
        }
    }
    // Bytes per parameter, read from the program's own types (one device: no sharding).
    let shards = parameter_bytes(program);
    let elements: f64 = shards.iter().map(|s| s.psi).sum::<f64>().max(1.0);
    u.parameter_bytes = shards.iter().map(|s| s.param_bytes).sum::<f64>() / elements;
    u.gradient_bytes = shards.iter().map(|s| s.psi * s.gradient_element_bytes).sum::<f64>() / elements;
    u.state_bytes = shards.iter().map(|s| s.state_bytes).sum::<f64>() / elements;
    // The planner adds every kept value and gradient of its own: temporaries are the rest of
    // the arena's peak (a step without a pipeline holds its gradients there).
    u.temporaries = match &program.pipeline {
        Some(_) => (program.memory.temporary_bytes as f64 - u.layer_kept - u.other_kept).max(0.0),
        // The rest of the peak. A MoE layer's expert buffers peak in its backward, where fewer
        // gradients are alive, so at one sequence they may hide under the gradients' peak and
        // then grow with the micro-batch unseen: there, the most scratch alive at any one time
        // (the planner adds the gradients' and kept values' peaks to it, so this errs high).
        None => {
            let peak = arena_peak(program);
            let rest = (program.memory.temporary_bytes as f64 - peak.kept - peak.gradients).max(0.0);
            if program.instrs.iter().any(|i| i.op == "xf.expert_matmul") { rest.max(peak.scratch) } else { rest }
        }
    };
    u
}
