//! The step time of compiled rank programs on a cluster, from the programs themselves.
//!
//! Every instruction is priced: an `xf` kernel by the roofline of its registry cost (FLOPs
//! against the GPU's peak for its dtype, bytes against its memory bandwidth), a collective
//! by the alpha-beta model of its axes ([`shardc_ir::cluster`]), a pipeline send by its link.
//! A program without stages is walked in order with a clock: an asynchronous gradient bucket
//! goes on the wire when its last member is staged and its wait stalls only for what the
//! compute since then did not cover. Pipeline programs are priced per stage and section, and
//! the schedule they carry is simulated with those costs, so the bubble is the schedule's own;
//! each rank's step section (updates and the data-parallel syncs) follows.
//!
//! Model FLOPs count `6 N` per token for the parameters plus `12 L s h` for attention scores
//! (PaLM's MFU convention), whatever recomputation or partitioning adds.

use std::collections::BTreeMap;

use shardc_ir::cluster::{Cluster, Collective};
use shardc_ir::ops::lookup;
use shardc_ir::{AttrValue, Attrs, TensorTy};
use shardc_runtime::program::{Attr, Instr, Program, Section};
use shardc_runtime::schedule::{simulate_with, Schedule, Work};
use shardc_runtime::DType;

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
    /// What bounds the step: `compute`, `communication` or `pipeline bubble`.
    pub bound: String,
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

fn ty(program: &Program, buffer: usize) -> TensorTy {
    let b = &program.buffers[buffer];
    let dtype = match b.dtype {
        DType::F32 => shardc_ir::DType::F32,
        DType::Bf16 => shardc_ir::DType::Bf16,
        DType::F64 => shardc_ir::DType::F64,
        DType::I32 => shardc_ir::DType::I32,
    };
    TensorTy::new(b.shape.iter().map(|&d| d as i64).collect::<Vec<_>>(), dtype)
}

fn attrs(instr: &Instr) -> Attrs {
    let mut out = Attrs::new();
    for (name, value) in &instr.attrs {
        let v = match value {
            Attr::Bool(b) => AttrValue::Bool(*b),
            Attr::Int(i) => AttrValue::Int(*i),
            Attr::Float(f) => AttrValue::Float(*f),
            Attr::Str(s) => AttrValue::Str(s.clone()),
            Attr::Ints(v) => AttrValue::Raw(format!("array<i64: {}>", v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "))),
        };
        out = out.with(name, v);
    }
    out
}

/// What one instruction costs: compute seconds, or communication seconds over named axes.
enum Priced {
    Compute(f64),
    Communication(String, f64),
}

fn axis_names(axes: &[usize]) -> String {
    let names = ["dp", "tp", "pp"];
    axes.iter().map(|&a| names.get(a).copied().unwrap_or("?")).collect::<Vec<_>>().join("+")
}

fn price(program: &Program, instr: &Instr, cluster: &Cluster) -> Priced {
    let grid: Vec<i64> = program.mesh.iter().map(|&e| e as i64).collect();
    let input = instr.inputs.first().map(|&b| ty(program, b));
    let output = instr.outputs.first().map(|&b| ty(program, b));
    let bytes = |t: &Option<TensorTy>| t.as_ref().map_or(0.0, |t| t.bytes() as f64);
    let axes: Vec<usize> = instr.ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect();
    let collective = |kind: Collective, b: f64| Priced::Communication(axis_names(&axes), cluster.time(kind, b, &grid, &axes));
    match instr.op.as_str() {
        "shard.all_reduce" => collective(Collective::AllReduce, bytes(&input)),
        "shard.all_gather" => collective(Collective::AllGather, bytes(&output)),
        "shard.reduce_scatter" => collective(Collective::ReduceScatter, bytes(&input)),
        "shard.broadcast" => collective(Collective::Broadcast, bytes(&input)),
        "shard.send" => Priced::Communication("pp".into(), cluster.time(Collective::Send, bytes(&input), &grid, &[2])),
        "shard.recv" => Priced::Communication("pp".into(), 0.0),
        "shard.all_slice" | "tensor.empty" => Priced::Compute(bytes(&output) / cluster.gpu.memory_bandwidth),
        name => {
            let Some(def) = lookup(name) else { return Priced::Compute(0.0) };
            let inputs: Vec<TensorTy> = instr.inputs.iter().map(|&b| ty(program, b)).collect();
            let outputs: Vec<TensorTy> = instr.outputs.iter().map(|&b| ty(program, b)).collect();
            let refs: Vec<&TensorTy> = inputs.iter().collect();
            let cost = def.cost(&refs, &outputs, &attrs(instr));
            let fp32 = inputs.first().is_some_and(|t| t.dtype != shardc_ir::DType::Bf16);
            Priced::Compute(cluster.compute_time(cost.flops, cost.bytes, fp32))
        }
    }
}

/// Compute and communication seconds of instructions `range`, walked in order with
/// asynchronous buckets overlapping the compute after them.
#[derive(Default, Clone)]
struct Walk {
    clock: f64,
    compute: f64,
    exposed: BTreeMap<String, f64>,
}

fn walk(program: &Program, range: std::ops::Range<usize>, cluster: &Cluster) -> Walk {
    let mut w = Walk::default();
    // Bucket -> (staged members' bytes, axes, members left); bucket -> done time.
    let mut staging: BTreeMap<i64, (f64, Vec<usize>, i64)> = BTreeMap::new();
    let mut done: BTreeMap<i64, (f64, String)> = BTreeMap::new();
    let grid: Vec<i64> = program.mesh.iter().map(|&e| e as i64).collect();
    for instr in &program.instrs[range] {
        if let (Ok(bucket), true) = (instr.int("xf.bucket"), instr.bool("xf.async").unwrap_or(false)) {
            let axes: Vec<usize> = instr.ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect();
            let members = instr.int("xf.bucket_members").unwrap_or(1);
            let e = staging.entry(bucket).or_insert((0.0, axes, members));
            e.0 += ty(program, instr.inputs[0]).bytes() as f64;
            e.2 -= 1;
            if e.2 <= 0 {
                let (b, axes, _) = staging.remove(&bucket).unwrap_or_default();
                done.insert(bucket, (w.clock + cluster.time(Collective::AllReduce, b, &grid, &axes), axis_names(&axes)));
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
        match price(program, instr, cluster) {
            Priced::Compute(t) => {
                w.compute += t;
                w.clock += t;
            }
            Priced::Communication(axes, t) => {
                *w.exposed.entry(axes).or_insert(0.0) += t;
                w.clock += t;
            }
        }
    }
    w
}

/// Estimates one optimizer step of `programs`: one program for every rank, or one per
/// pipeline rank (each carrying its schedule).
pub fn estimate(programs: &[Program], cluster: &Cluster, model: ModelShape) -> Estimate {
    let gpus: f64 = programs.first().map_or(1, |p| p.mesh.iter().product::<usize>().max(1)) as f64;
    let mut out = Estimate::default();
    let pipelined = programs.iter().all(|p| p.pipeline.is_some()) && !programs.is_empty();
    if pipelined {
        let plans: Vec<_> = programs.iter().map(|p| p.pipeline.as_ref().expect("checked")).collect();
        let schedule = Schedule {
            kind: plans[0].kind,
            stages: plans.len(),
            microbatches: plans[0].microbatches,
            chunks: plans[0].chunks.len(),
            ranks: plans.iter().map(|p| p.items.clone()).collect(),
        };
        // Each (rank, chunk, section) walked once.
        let section = |rank: usize, chunk: usize, s: Section| walk(&programs[rank], plans[rank].chunks[chunk].range(s), cluster);
        let splits_w = schedule.ranks.iter().flatten().any(|i| i.work == Work::W);
        let mut walks: BTreeMap<(usize, usize, usize), Walk> = BTreeMap::new();
        for (rank, plan) in plans.iter().enumerate() {
            for chunk in 0..plan.chunks.len() {
                for s in [Section::Forward, Section::Backward, Section::Weight, Section::Step] {
                    walks.insert((rank, chunk, s as usize), section(rank, chunk, s));
                }
            }
        }
        let item_time = |rank: usize, work: Work, chunk: usize| -> f64 {
            let t = |s: Section| walks[&(rank, chunk, s as usize)].clock;
            match work {
                Work::F => t(Section::Forward),
                Work::B if splits_w => t(Section::Backward),
                Work::B => t(Section::Backward) + t(Section::Weight),
                Work::W => t(Section::Weight),
            }
        };
        let timeline = simulate_with(&schedule, |rank, item| item_time(rank, item.work, item.chunk));
        let step_tail = (0..plans.len()).map(|r| (0..plans[r].chunks.len()).map(|c| walks[&(r, c, Section::Step as usize)].clock).sum::<f64>()).fold(0.0, f64::max);
        let makespan = timeline.as_ref().map_or(0.0, |t| t.makespan);
        out.step_seconds = makespan + step_tail;
        out.bubble_seconds = timeline.as_ref().map_or(0.0, |t| t.bubble * makespan);
        let m = schedule.microbatches as f64;
        let busiest = (0..plans.len())
            .map(|r| {
                let per_item: f64 = (0..plans[r].chunks.len())
                    .map(|c| [Section::Forward, Section::Backward, Section::Weight].iter().map(|&s| walks[&(r, c, s as usize)].compute).sum::<f64>())
                    .sum();
                per_item * m + (0..plans[r].chunks.len()).map(|c| walks[&(r, c, Section::Step as usize)].compute).sum::<f64>()
            })
            .fold(0.0, f64::max);
        out.compute_seconds = busiest;
        // Communication of rank 0, per item times the micro-batches, plus its step.
        for ((rank, _, s), w) in &walks {
            if *rank != 0 {
                continue;
            }
            let times = if *s == Section::Step as usize { 1.0 } else { m };
            for (axes, t) in &w.exposed {
                *out.exposed_communication.entry(axes.clone()).or_insert(0.0) += t * times;
            }
        }
    } else if let Some(program) = programs.first() {
        let w = walk(program, 0..program.instrs.len(), cluster);
        out.step_seconds = w.clock;
        out.compute_seconds = w.compute;
        out.exposed_communication = w.exposed;
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
    out.bound = if out.bubble_seconds > out.compute_seconds.max(communication) {
        "pipeline bubble".into()
    } else if communication > out.compute_seconds {
        "communication".into()
    } else {
        "compute".into()
    };
    out
}
