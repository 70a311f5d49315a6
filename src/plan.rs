//! `shardc plan`: the fastest strategy that fits, and why.
//!
//! The model is compiled once per tensor-parallel variant (tp, sequence parallelism,
//! recomputation), cut to one layer; the compiled rank program's instructions are priced on
//! the cluster model ([`shardc_codegen::estimate::unit_costs`]). Every strategy (dp x tp x pp,
//! micro-batch size and count, schedule and virtual stages, ZeRO stage) is then composed from
//! those measured costs: a stage's forward and backward per micro-batch, the schedule's own
//! bubble (simulated with unit costs; the closed forms, which the schedule tests check, for
//! schedules too long to simulate here), the data-parallel sync over its link (overlapping the
//! last backward), the update, and the memory of the fullest stage in the compiled program's own types. The
//! search is exhaustive over the space below; a strategy that does not fit memory is dropped.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use miette::{miette, IntoDiagnostic, Result};
use shardc_codegen::estimate::{data_parallel_traffic, unit_costs, DataParallelTraffic, UnitCosts};
use shardc_ir::cluster::{Cluster, Collective};
use shardc_ir::mesh::Mesh;
use shardc_ir::spec::Spec;
use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind, Recompute};
use shardc_runtime::schedule::{generate, simulate, Costs, Kind};

use crate::options::StepArgs;

/// Sequences per micro-batch the search tries.
const SEARCHED_MICRO_BATCHES: [u64; 5] = [1, 2, 4, 8, 16];

/// Most micro-batches per step a listed plan may have: what `--microbatches` accepts.
const MAX_MICROBATCHES: u64 = 4096;

/// The shortest part of a sequence a context-parallel rank is given in the search: shorter
/// parts make attention too small a share of the step to gain from splitting it.
const MIN_CONTEXT_PART: u64 = 1024;

/// Arguments of `shardc plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Model spec (.toml or .json), or a Hugging Face model folder.
    #[arg(required_unless_present = "hf")]
    pub spec: Option<PathBuf>,
    /// GPUs to use.
    #[arg(long)]
    pub gpus: u64,
    /// GPUs per node (default: the cluster's, 8).
    #[arg(long)]
    pub gpus_per_node: Option<usize>,
    /// Nodes: with --gpus, sets the GPUs per node (GPUs / nodes).
    #[arg(long)]
    pub nodes: Option<u64>,
    /// How many plans to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Say why the best plan beats the runner-up.
    #[arg(long)]
    pub explain: bool,
    /// Write a self-contained HTML report (SVG charts: memory per stage, time breakdown,
    /// the pipeline timeline of the best plan, and the table).
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    #[command(flatten)]
    pub model: crate::options::ModelArgs,
    #[command(flatten)]
    pub batch: crate::options::BatchArgs,
    #[command(flatten)]
    pub hardware: crate::options::HardwareArgs,
    #[command(flatten)]
    pub only: PlanConstraints,
}

/// Constraints on the strategies `plan` lists (with `--micro-batch` and `--microbatches`):
/// each one left out is searched.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Constraints (each one left out is searched)")]
pub struct PlanConstraints {
    /// Only plans at this ZeRO stage (0 to 3).
    #[arg(long)]
    pub zero: Option<u8>,
    /// Only this pipeline schedule where a plan has pipeline stages: gpipe, 1f1b,
    /// interleaved or zb-h1 (plans without stages stay).
    #[arg(long)]
    pub schedule: Option<String>,
    /// Only this activation recomputation: none, selective-attention or full.
    #[arg(long)]
    pub recompute: Option<String>,
    /// Only plans with (true) or without (false) sequence parallelism.
    #[arg(long, value_name = "BOOL")]
    pub sequence_parallel: Option<bool>,
}

impl PlanArgs {
    /// The step arguments `plan` reads: the model, the sequence and global batch, and the
    /// hardware. `--micro-batch` and `--microbatches` constrain the search instead of
    /// overriding the spec (given alone, `--microbatches` would set the global batch).
    fn step(&self) -> StepArgs {
        let batch = crate::options::BatchArgs { micro_batch: None, microbatches: None, ..self.batch.clone() };
        StepArgs { model: self.model.clone(), batch, hardware: self.hardware.clone(), ..StepArgs::default() }
    }

    /// The constraints as a filter, and their description; refuses unknown values by name.
    fn constraints(&self) -> Result<(impl Fn(&Plan) -> bool + '_, Vec<String>)> {
        let only = &self.only;
        if let Some(b) = self.batch.micro_batch
            && !SEARCHED_MICRO_BATCHES.contains(&b)
        {
            return Err(miette!(help = "use --micro-batch 1, 2, 4, 8 or 16", "--micro-batch {b}: plan searches micro-batches of 1, 2, 4, 8 and 16 sequences"));
        }
        if let Some(m) = self.batch.microbatches
            && !(1..=MAX_MICROBATCHES).contains(&m)
        {
            return Err(miette!(help = format!("use 1 to {MAX_MICROBATCHES} micro-batches"), "--microbatches must be between 1 and {MAX_MICROBATCHES}, got {m}"));
        }
        if let Some(z) = only.zero
            && z > 3
        {
            return Err(miette!(help = "use 0, 1, 2 or 3", "--zero: there is no ZeRO stage {z}"));
        }
        let schedule = match &only.schedule {
            Some(name) => Some(match Kind::parse(name).ok_or_else(|| miette!(help = "use gpipe, 1f1b, interleaved or zb-h1", "--schedule: unknown schedule `{name}`"))? {
                Kind::Gpipe => "gpipe",
                Kind::OneFOneB => "1f1b",
                Kind::Interleaved => "interleaved",
                Kind::ZeroBubble => "zb-h1",
            }),
            None => None,
        };
        let recompute = match only.recompute.as_deref() {
            None => None,
            Some("none") => Some("none"),
            Some("selective-attention") => Some("selective"),
            Some("full") => Some("full"),
            Some(other) => return Err(miette!(help = "use none, selective-attention or full", "--recompute: unknown policy `{other}`")),
        };
        let mut said = Vec::new();
        for (flag, value) in [
            ("--micro-batch", self.batch.micro_batch.map(|b| b.to_string())),
            ("--microbatches", self.batch.microbatches.map(|m| m.to_string())),
            ("--zero", only.zero.map(|z| z.to_string())),
            ("--schedule", schedule.map(str::to_string)),
            ("--recompute", only.recompute.clone()),
            ("--sequence-parallel", only.sequence_parallel.map(|b| b.to_string())),
        ] {
            if let Some(v) = value {
                said.push(format!("{flag} {v}"));
            }
        }
        let admit = move |p: &Plan| {
            self.batch.micro_batch.is_none_or(|b| p.micro_batch == b)
                && self.batch.microbatches.is_none_or(|m| p.microbatches == m)
                && only.zero.is_none_or(|z| p.zero == z)
                && schedule.is_none_or(|s| p.pp == 1 || p.schedule == s)
                && recompute.is_none_or(|r| p.recompute == r)
                && only.sequence_parallel.is_none_or(|sp| p.sequence_parallel == sp)
        };
        Ok((admit, said))
    }
}

/// One strategy and what it costs.
#[derive(Clone, Debug)]
pub struct Plan {
    pub tp: u64,
    /// Context-parallel ranks (1: none).
    pub cp: u64,
    /// Expert-parallel ranks, carved from dp (1: none).
    pub ep: u64,
    pub pp: u64,
    pub dp: u64,
    pub micro_batch: u64,
    pub microbatches: u64,
    pub schedule: &'static str,
    pub virtual_stages: u64,
    pub sequence_parallel: bool,
    pub recompute: &'static str,
    pub zero: u8,
    pub step_seconds: f64,
    pub compute: f64,
    pub bubble: f64,
    pub communication: f64,
    pub memory: f64,
    pub mfu: f64,
    pub tflops_per_gpu: f64,
    /// Memory of each pipeline stage: (weights, gradients, optimizer, activations, temporaries).
    pub stage_memory: Vec<[f64; 5]>,
    /// Index of the one-layer variant whose unit costs compose this plan.
    pub unit: usize,
    /// Data-parallel collectives per step (kind, seconds), priced from the bytes per
    /// parameter the compiled dp=2 program of this ZeRO stage moves.
    pub sync: [(&'static str, f64); 3],
    /// Seconds of the sync not hidden behind the last micro-batch's backward.
    pub sync_exposed: f64,
    /// Seconds of the optimizer update.
    pub update: f64,
    /// Seconds of pipeline sends per step.
    pub sends: f64,
    /// Seconds of ZeRO-3's parameter gathers per step (every micro-batch's forward and
    /// backward).
    pub gathers: f64,
    /// Whether the busiest stage is the first (embedding) rather than the last (head).
    pub first_is_fuller: bool,
    /// The schedule's bubble as a fraction of the pipeline time, and whether the schedule
    /// was simulated (or, too long to simulate, taken from its closed form).
    pub bubble_fraction: f64,
    pub bubble_simulated: bool,
    /// Layers of the model.
    pub layers: u64,
    /// Whether the model trains in f32 (its GEMMs against the fp32 peak).
    pub fp32: bool,
}

impl Plan {
    /// Where the step goes, composed from the unit costs `units[self.unit]`: seconds per step
    /// of the busiest stage by kernel class (`gemm`, `attention`, `memory-bound`,
    /// `optimizer`), by collective and axes (`all_reduce tp`, `send pp`; the dp sync as
    /// `all_reduce dp` etc., whole, with `dp sync exposed` the part the last backward does
    /// not hide), and `pipeline bubble`. The compute, tp, pp, bubble, exposed sync and
    /// optimizer entries sum to the step.
    pub fn breakdown(&self, units: &[UnitCosts]) -> Vec<(String, f64)> {
        let Some(u) = units.get(self.unit) else { return Vec::new() };
        let per_microbatch = self.microbatches as f64 * self.micro_batch as f64;
        let lps = self.layers_per_stage();
        let mut parts: std::collections::BTreeMap<String, f64> = std::collections::BTreeMap::new();
        for (key, t) in &u.layer_breakdown {
            *parts.entry(key.clone()).or_insert(0.0) += per_microbatch * lps * t;
        }
        let ends: Vec<&std::collections::BTreeMap<String, f64>> = match (self.pp, self.first_is_fuller) {
            (1, _) => vec![&u.embed_breakdown, &u.head_breakdown],
            (_, true) => vec![&u.embed_breakdown],
            (_, false) => vec![&u.head_breakdown],
        };
        for end in ends {
            for (key, t) in end {
                *parts.entry(key.clone()).or_insert(0.0) += per_microbatch * t;
            }
        }
        let mut out: Vec<(String, f64)> = parts.into_iter().collect();
        out.push(("send pp".into(), self.sends));
        out.push(("all_gather dp per micro-batch".into(), self.gathers));
        out.push(("pipeline bubble".into(), self.bubble));
        out.push(("optimizer".into(), self.update));
        for (kind, t) in self.sync {
            out.push((format!("{kind} dp"), t));
        }
        out.push(("dp sync exposed".into(), self.sync_exposed));
        out.retain(|(_, t)| *t > 0.0);
        out
    }

    /// Layers on one pipeline stage.
    fn layers_per_stage(&self) -> f64 {
        self.layers as f64 / self.pp as f64
    }

    /// The term that bounds the step (the largest part of it), with its seconds: the dp
    /// sync counts only for its exposed part.
    pub fn dominant(&self, units: &[UnitCosts]) -> (String, f64) {
        self.breakdown(units)
            .into_iter()
            .filter(|(k, _)| !k.ends_with(" dp"))
            .fold((String::new(), f64::MIN), |best, (k, t)| if t > best.1 { (k, t) } else { best })
    }

    /// What bounds the step, in a few words, for the table: the dominant term and its share,
    /// and memory when it is tight.
    pub fn bottleneck(&self, units: &[UnitCosts], hbm: f64) -> String {
        let (term, t) = self.dominant(units);
        let word = format!("{term} {:.0}%", 100.0 * t / self.step_seconds);
        if self.memory > 0.9 * hbm { format!("{word}, memory-tight ({:.0}% of HBM)", 100.0 * self.memory / hbm) } else { word }
    }

    /// The assumption that bounds the estimate, in words: the dominant term and the cluster
    /// constant (or the schedule simulation) it rests on, and where the cluster came from.
    pub fn assumption(&self, units: &[UnitCosts], cluster: &Cluster, source: &str) -> String {
        let (term, t) = self.dominant(units);
        let g = &cluster.gpu;
        let grid = plan_grid(self.dp, self.tp, self.pp, self.cp, self.ep);
        let link = |axis: usize| {
            let l = if axis == 2 { cluster.send_link(&grid, &[axis]) } else { cluster.link(&grid, &[axis]) };
            let name = if l == cluster.intra_node { "intra-node link" } else { "inter-node link" };
            format!("the {name}'s {:.0} GB/s", l.bandwidth / 1e9)
        };
        let share = 100.0 * t / self.step_seconds;
        let what = match term.as_str() {
            "gemm" => format!("GEMM time ({share:.0}% of the step) at gemm_efficiency {:.2} of {:.0} TFLOP/s", g.gemm_efficiency, self.peak(cluster) / 1e12),
            "attention" => format!("attention time ({share:.0}% of the step) at attention_efficiency {:.2} of {:.0} TFLOP/s", g.attention_efficiency, self.peak(cluster) / 1e12),
            "memory-bound" => format!("memory-bound kernels ({share:.0}% of the step) at {:.0} GB/s x memory_efficiency {:.2}", g.memory_bandwidth / 1e9, g.memory_efficiency),
            "optimizer" => format!("the optimizer update ({share:.0}% of the step) at {:.0} GB/s", g.memory_bandwidth / 1e9),
            "pipeline bubble" => format!(
                "the pipeline bubble ({share:.0}% of the step, {:.1}% of the pipeline) from the {} of {} p={} m={} v={}",
                100.0 * self.bubble_fraction,
                if self.bubble_simulated { "schedule simulation" } else { "closed form" },
                self.schedule,
                self.pp,
                self.microbatches,
                self.virtual_stages
            ),
            "dp sync exposed" => format!("the dp sync ({share:.0}% of the step exposed) overlapping only the last backward, over {}", link(0)),
            "send pp" => format!("pipeline sends ({share:.0}% of the step), unoverlapped, over {}", link(2)),
            "all_gather dp per micro-batch" => format!("ZeRO-3 parameter gathers in every micro-batch ({share:.0}% of the step), unoverlapped, over {}", link(0)),
            other if other.ends_with(" tp") => format!("tp collectives ({other}, {share:.0}% of the step), unoverlapped, over {}", link(1)),
            other => format!("{other} ({share:.0}% of the step)"),
        };
        let hbm = g.memory_bytes;
        let headroom = if self.memory > 0.9 * hbm { format!("; memory headroom only {:.1} GB of {:.0} GB", (hbm - self.memory) / 1e9, hbm / 1e9) } else { String::new() };
        format!("bounded by {what} ({source}){headroom}")
    }

    fn peak(&self, cluster: &Cluster) -> f64 {
        if self.fp32 { cluster.gpu.fp32_flops } else { cluster.gpu.bf16_flops }
    }

    fn label(&self) -> String {
        let schedule = if self.pp == 1 { "-".to_string() } else if self.virtual_stages > 1 { format!("{} v={}", self.schedule, self.virtual_stages) } else { self.schedule.to_string() };
        format!(
            "dp={} {}{}tp={} pp={} b={} m={} {} {}{} z{}",
            self.dp,
            if self.ep > 1 { format!("ep={} ", self.ep) } else { String::new() },
            if self.cp > 1 { format!("cp={} ", self.cp) } else { String::new() },
            self.tp,
            self.pp,
            self.micro_batch,
            self.microbatches,
            schedule,
            if self.sequence_parallel { "sp " } else { "" },
            self.recompute,
            self.zero
        )
    }
}

/// Bubble fraction, peak micro-batches in flight on the first stage of a schedule, and
/// whether they come from simulating it (or from its closed form).
fn schedule_facts(kind: Kind, p: u64, m: u64, v: u64, cache: &mut HashMap<(u8, u64, u64, u64), (f64, f64, bool)>) -> Option<(f64, f64, bool)> {
    let key = (kind as u8, p, m, v);
    if let Some(f) = cache.get(&key) {
        return Some(*f);
    }
    let (pf, mf, vf) = (p as f64, m as f64, v as f64);
    let facts = if p * m * v <= 2048 {
        let schedule = generate(kind, p as usize, m as usize, v as usize).ok()?;
        let costs = if kind == Kind::ZeroBubble { Costs { f: 1.0, b: 1.0, w: 1.0 } } else { Costs { f: 1.0 / vf, b: 1.0 / vf, w: 0.0 } };
        let t = simulate(&schedule, costs).ok()?;
        (t.bubble, t.peak_in_flight.first().copied().unwrap_or(1) as f64 / vf, true)
    } else {
        // The closed forms the schedule tests check against the simulation.
        let (bubble, in_flight) = match kind {
            Kind::Gpipe => ((pf - 1.0) / (mf + pf - 1.0), mf),
            Kind::OneFOneB => ((pf - 1.0) / (mf + pf - 1.0), pf.min(mf)),
            Kind::Interleaved => ((pf - 1.0) / (vf * mf + pf - 1.0), (2.0 * (pf - 1.0) + (vf - 1.0) * pf + 1.0).min(mf * vf) / vf),
            // ZB-H1 fills most of 1F1B's bubble with weight gradients: a third of it remains.
            Kind::ZeroBubble => ((pf - 1.0) / (3.0 * mf + pf - 1.0), pf.min(mf)),
        };
        (bubble, in_flight, false)
    };
    cache.insert(key, facts);
    Some(facts)
}

/// The training step of the model cut to one layer, one sequence per data-parallel rank, on
/// `mesh` (no pipeline) under ZeRO stage `zero`.
/// Context parallelism's attention is chosen on `cluster` (the ring where it is cheaper there).
fn compile_unit(spec: &Spec, cluster: &Cluster, mesh: Mesh, zero: u8, sequence_parallel: bool, recompute: Recompute) -> Result<shardc_runtime::Program> {
    let (tp, mesh) = (mesh.tp, Mesh { pp: 1, ..mesh });
    let mut one = spec.clone();
    one.model.layers = 1;
    // A mixture of experts' unit is one of its MoE layers (its dense layers, if any, are
    // priced as MoE layers too: an upper bound).
    if let Some(moe) = one.model.moe.as_mut() {
        moe.first_dense = 0;
        moe.every = 1;
    }
    one.training.micro_batch = 1;
    one.training.global_batch = None;
    let options = CompileOptions {
        recompute,
        optimizer: OptimizerKind::adamw(1e-4),
        zero,
        mesh,
        vocab: spec.model.padded_vocab(tp) as i64,
        kv_heads: spec.model.kv_heads() as i64,
        sequence_parallel,
        comm_opt: false,
        grad_bucket_bytes: 0,
        cluster: cluster.clone(),
        ..Default::default()
    };
    let mut module = shardc_ir::spec::lower(&one, one.step_shape(&options.mesh)).into_diagnostic()?;
    let cx = crate::ir_context()?;
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).into_diagnostic()?;
    let f = module.func("train_step").ok_or_else(|| miette!("no @train_step"))?;
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    shardc_codegen::lower_func_on(f, &grid).into_diagnostic()
}

/// What the search found.
pub struct Searched {
    /// Every strategy that fits, fastest first.
    pub plans: Vec<Plan>,
    /// Strategies considered.
    pub considered: usize,
    /// Whether splits were skipped for needing more than [`MAX_MICROBATCHES`] micro-batches.
    pub too_many_microbatches: bool,
    /// Unit costs of each one-layer variant ([`Plan::unit`] indexes them).
    pub units: Vec<UnitCosts>,
    /// What the data-parallel collectives move per parameter under each ZeRO stage.
    pub traffic: Vec<DataParallelTraffic>,
}

/// A one-layer program to compile: a tensor-parallel variant for unit costs, or the dp=2
/// step of a ZeRO stage for its data-parallel traffic.
#[derive(Clone, Copy)]
enum Job {
    Unit(u64, u64, u64, bool, Recompute),
    Sync(u8),
}

enum Measured {
    Unit(UnitCosts),
    Sync(DataParallelTraffic),
}

/// Every strategy for `gpus` GPUs that fits, fastest first.
pub fn search(spec: &Spec, cluster: &Cluster, gpus: u64, global_batch: u64) -> Result<Searched> {
    let m = &spec.model;
    let (layers, seq, hidden) = (m.layers, spec.seq_len(), m.hidden as f64);
    let tps: Vec<u64> = [1u64, 2, 4, 8, 16].into_iter().filter(|&t| t <= gpus && t as usize <= cluster.gpus_per_node && m.heads % t == 0 && m.ffn_hidden % t == 0 && m.kv_heads() % t == 0 && gpus % t == 0).collect();
    let recomputes = [("none", Recompute::None), ("selective", Recompute::SelectiveAttention), ("full", Recompute::Full)];
    // Unit costs of each tensor-parallel variant, compiled on both cores.
    // Context parallelism where a rank's part of the sequence stays long enough to be
    // worth splitting (MIN_CONTEXT_PART tokens) and the zigzag order's 2 x cp chunks divide it.
    let cps: Vec<u64> = [1u64, 2, 4, 8, 16].into_iter().filter(|&c| c == 1 || (seq % (2 * c) == 0 && seq / c >= MIN_CONTEXT_PART && gpus % c == 0)).collect();
    // Expert parallelism for MoE models: ep divides the experts (and, below, dp).
    let eps: Vec<u64> = [1u64, 2, 4, 8, 16, 32, 64].into_iter().filter(|&e| e == 1 || m.moe.as_ref().is_some_and(|moe| moe.experts % e == 0 && gpus % e == 0)).collect();
    let mut variants: Vec<(u64, u64, u64, bool, &'static str, Recompute)> = Vec::new();
    for &t in &tps {
        for &c in cps.iter().filter(|&&c| gpus % (t * c) == 0) {
            for &e in eps.iter().filter(|&&e| gpus % (t * c * e) == 0) {
                for sp in [false, true].into_iter().filter(|&sp| !sp || (t > 1 && seq % (t * c) == 0)) {
                    for (n, r) in recomputes {
                        variants.push((t, c, e, sp, n, r));
                    }
                }
            }
        }
    }
    // And, per ZeRO stage, the one-layer step at dp=2 whose dp collectives say what the
    // data-parallel sync moves per parameter (the same at any tp: per model-parallel share).
    let mut jobs: Vec<Job> = variants.iter().map(|&(t, c, e, sp, _, r)| Job::Unit(t, c, e, sp, r)).collect();
    if gpus > 1 {
        jobs.extend((0..=3u8).map(Job::Sync));
    }
    // Alternate jobs between the two threads: the dp=2 compiles are the cheapest.
    let halves: [Vec<Job>; 2] = [jobs.iter().step_by(2).copied().collect(), jobs.iter().skip(1).step_by(2).copied().collect()];
    let measured: Vec<Result<Measured>> = std::thread::scope(|s| {
        let run = |job: Job| match job {
            // An expert-parallel unit is one expert group: dp = ep ranks of one sequence each.
            Job::Unit(t, c, e, sp, r) => compile_unit(spec, cluster, Mesh { dp: e, tp: t, pp: 1, cp: c, ep: e }, 0, sp, r).map(|p| Measured::Unit(unit_costs(&p, cluster))),
            Job::Sync(zero) => compile_unit(spec, cluster, Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, zero, false, Recompute::None).map(|p| Measured::Sync(data_parallel_traffic(&p))),
        };
        let handles: Vec<_> = halves.iter().map(|half| s.spawn(move || half.iter().map(|&job| run(job)).collect::<Vec<_>>())).collect();
        let mut results: Vec<std::vec::IntoIter<Result<Measured>>> = handles.into_iter().map(|h| h.join().unwrap_or_else(|_| vec![Err(miette!("compiling a one-layer variant panicked"))]).into_iter()).collect();
        // Back in job order.
        (0..jobs.len()).map(|i| results[i % 2].next().unwrap_or_else(|| Err(miette!("a one-layer variant was not compiled")))).collect()
    });
    let mut units: Vec<UnitCosts> = Vec::new();
    let mut traffic: Vec<DataParallelTraffic> = Vec::new();
    for m in measured {
        match m? {
            Measured::Unit(u) => units.push(u),
            Measured::Sync(t) => traffic.push(t),
        }
    }
    let peak = if matches!(spec.model.dtype, shardc_ir::spec::SpecDType::F32) { cluster.gpu.fp32_flops } else { cluster.gpu.bf16_flops };
    let active_params = {
        let module = shardc_ir::spec::lower(spec, spec.step_shape(&Mesh::default())).into_diagnostic()?;
        module.func("forward").map_or(0, |f| f.active_parameter_count()) as f64
    };
    let tokens = (global_batch * seq) as f64;
    let model_flops = tokens * (6.0 * active_params + 12.0 * layers as f64 * seq as f64 * hidden);
    let hbm = cluster.gpu.memory_bytes;
    let fp32 = matches!(spec.model.dtype, shardc_ir::spec::SpecDType::F32);
    let mut cache = HashMap::new();
    let mut plans = Vec::new();
    let mut considered = 0usize;
    let mut too_many_microbatches = false;
    for (index, (&(tp, cp, ep, sp, rname, _), u)) in variants.iter().zip(&units).enumerate() {
        for pp in (1..=layers.min(gpus / (tp * cp))).filter(|&p| layers % p == 0 && gpus % (tp * cp * p) == 0) {
            let dp = gpus / (tp * cp * pp);
            if global_batch % dp != 0 || dp % ep != 0 {
                continue;
            }
            let per_replica = global_batch / dp;
            for b in SEARCHED_MICRO_BATCHES.into_iter().filter(|b| per_replica % b == 0) {
                let mbs = per_replica / b;
                // A step compiles at most MAX_MICROBATCHES micro-batches (`--microbatches`):
                // a plan with more could not be run as listed.
                if mbs > MAX_MICROBATCHES {
                    too_many_microbatches = true;
                    continue;
                }
                let kinds: Vec<(Kind, &'static str, u64)> = if pp == 1 {
                    vec![(Kind::OneFOneB, "-", 1)]
                } else {
                    let mut k = vec![(Kind::Gpipe, "gpipe", 1), (Kind::OneFOneB, "1f1b", 1), (Kind::ZeroBubble, "zb-h1", 1)];
                    for v in [2u64, 4] {
                        if mbs % pp == 0 && layers % (pp * v) == 0 {
                            k.push((Kind::Interleaved, "interleaved", v));
                        }
                    }
                    k
                };
                let lps = (layers / pp) as f64;
                let bf = b as f64;
                // The fuller of the first and last stages (one stage holds both ends).
                let (embed, head) = (u.embed.0 + u.embed.1, u.head.0 + u.head.1);
                let first = bf * (lps * (u.layer_forward + u.layer_backward) + embed + if pp == 1 { head } else { 0.0 });
                let last = bf * (lps * (u.layer_forward + u.layer_backward) + head + if pp == 1 { embed } else { 0.0 });
                let grid = plan_grid(dp, tp, pp, cp, ep);
                // A rank's part of the sequence: 1/cp of it, and 1/tp of that with sequence
                // parallelism.
                let part = seq as f64 / cp as f64 / if sp { tp as f64 } else { 1.0 };
                let send = if pp > 1 { 2.0 * cluster.time(Collective::Send, 2.0 * bf * part * hidden, &grid, &[2]) } else { 0.0 };
                // The gradients of the dp x cp ranks that hold the same parameters are summed.
                // With expert parallelism, every data-parallel rank's: the dense parameters' sum
                // runs over dp and ep, an expert's over the dp / ep ranks that hold it (priced
                // over all of them: a ring moves the same bytes per rank either way).
                let mut sync_axes = vec![shardc_ir::mesh::DP_AXIS];
                if cp > 1 {
                    sync_axes.push(shardc_ir::mesh::CP_AXIS);
                }
                if ep > 1 {
                    sync_axes.push(shardc_ir::mesh::EP_AXIS);
                }
                let sync_axes = sync_axes.as_slice();
                let first_is_fuller = first >= last;
                let psi = lps * u.layer_params + u.other_params;
                for &(kind, sname, v) in &kinds {
                    let Some((bubble_fraction, in_flight, bubble_simulated)) = schedule_facts(kind, pp, mbs, v, &mut cache) else { continue };
                    for zero in 0..=if dp > 1 { 3u8 } else { 0 } {
                        considered += 1;
                        // ZeRO-3 gathers the stage's stored shards in every micro-batch's
                        // forward and backward, inline, as its compiled program does.
                        let gather = match traffic.get(zero as usize) {
                            // Over all dp ranks (an expert's over the dp / ep holding it:
                            // priced as the dense ones', the same bytes per rank of a ring).
                            Some(t) if dp > 1 => t.microbatch_time(cluster, psi, &plan_grid(dp, tp, pp, cp, 1)),
                            _ => 0.0,
                        };
                        let stage = first.max(last) + send + gather;
                        let d = dp as f64;
                        // ZeRO shards only the tensors with a dimension dp divides; the rest
                        // stay whole on every rank, as the compiled program keeps them.
                        // An expert is sharded over the dp / ep ranks holding it.
                        let experts_sharded = u.expert_params - u.expert_params / (dp / ep) as f64;
                        let (layer_shardable, other_shardable) = (u.shardable_params(true, dp), u.shardable_params(false, dp));
                        let sharded = |psi: f64, shardable: f64| psi - shardable + shardable / d;
                        let shard = |from: u8| if zero >= from { sharded(psi, lps * layer_shardable + other_shardable) - lps * experts_sharded } else { psi };
                        // Per stage: its layers, the embedding on the first, the head on the
                        // last (each half of the measured rest); 1F1B-like schedules hold fewer
                        // micro-batches on later stages (ZB-H1 holds as many on each: a
                        // micro-batch is held to its weight gradient). Run in micro-batches, a
                        // stage keeps each one in flight's values in storage of its own,
                        // outside its memory plan (`MemoryEstimate::activations`); under ZB-H1
                        // the values its backward makes for the weight gradient too, taken as
                        // large as the forward's.
                        let stage_memory: Vec<[f64; 5]> = (0..pp)
                            .map(|s| {
                                let ends = (s == 0) as u8 as f64 + (s == pp - 1) as u8 as f64;
                                let psi_s = lps * u.layer_params + ends * u.other_params / 2.0;
                                let shard_s = |from: u8| if zero >= from { sharded(psi_s, lps * layer_shardable + ends * other_shardable / 2.0) - lps * experts_sharded } else { psi_s };
                                let flight = if kind == Kind::Gpipe || kind == Kind::ZeroBubble || pp == 1 { in_flight } else { (in_flight - s as f64).max(1.0) };
                                let adjacent = kind == Kind::OneFOneB && s == pp - 1;
                                // A set per micro-batch in flight; interleaved and GPipe,
                                // about one more: their ranks' arenas (whose peak is a
                                // backward beside the kept values, not sharing their memory)
                                // hold more than the one-layer unit's temporaries count.
                                let copies = match kind {
                                    _ if mbs == 1 && pp == 1 => 1.0,
                                    Kind::ZeroBubble => 2.0 * flight.max(1.0),
                                    _ if adjacent => 1.0,
                                    Kind::Interleaved | Kind::Gpipe => flight.max(1.0) + 1.0,
                                    _ => flight.max(1.0),
                                };
                                let kept = bf * (lps * u.layer_kept + ends * u.other_kept / 2.0) * copies;
                                // Bytes per parameter as the compiled program keeps them.
                                // Accumulated over several micro-batches, the gradients are
                                // summed whole and reduce-scattered once, at the step (as the
                                // compiled program's plan lists them): ZeRO-2 shards them
                                // only without accumulation.
                                let gradients = if mbs > 1 { psi_s } else { shard_s(2) };
                                [u.parameter_bytes * shard_s(3), u.gradient_bytes * gradients, u.state_bytes * shard_s(1), kept, bf * u.temporaries]
                            })
                            .collect();
                        // Gradient buckets (ZeRO 0, dp > 1: `shardc run` buckets by default)
                        // add no bytes: each member is reduced in its own all-reduce output,
                        // the reduced gradient the gradient term counts, and its input dies
                        // at the issue (see `MemoryEstimate::buckets`).
                        let memory = stage_memory.iter().map(|m| m.iter().sum::<f64>()).fold(0.0, f64::max);
                        if memory > hbm {
                            continue;
                        }
                        let busy = mbs as f64 * stage;
                        let pipeline = busy / (1.0 - bubble_fraction);
                        // The dp collectives the compiled step of this ZeRO stage issues, by
                        // kind, at the bytes per parameter they move there (in the types the
                        // program reduces and gathers in), for this stage's parameters.
                        let sync_parts = match traffic.get(zero as usize) {
                            Some(t) if dp * cp > 1 => t.times(cluster, psi, &grid, sync_axes),
                            _ => [("all_reduce", 0.0), ("reduce_scatter", 0.0), ("all_gather", 0.0)],
                        };
                        let sync: f64 = sync_parts.iter().map(|(_, t)| t).sum();
                        let exposed = (sync - bf * lps * u.layer_backward).max(0.0);
                        // The update reads the gradient and the state, writes the state and the
                        // parameter.
                        let update = (u.gradient_bytes + 2.0 * u.state_bytes + u.parameter_bytes) * shard(1) / cluster.gpu.memory_bandwidth;
                        let step = pipeline + exposed + update;
                        plans.push(Plan {
                            tp,
                            cp,
                            ep,
                            pp,
                            dp,
                            micro_batch: b,
                            microbatches: mbs,
                            schedule: sname,
                            virtual_stages: v,
                            sequence_parallel: sp,
                            recompute: rname,
                            zero,
                            step_seconds: step,
                            compute: busy,
                            bubble: pipeline - busy,
                            communication: exposed + mbs as f64 * (send + gather),
                            memory,
                            mfu: model_flops / step / (peak * gpus as f64),
                            tflops_per_gpu: model_flops / step / gpus as f64 / 1e12,
                            stage_memory,
                            unit: index,
                            sync: sync_parts,
                            sync_exposed: exposed,
                            update,
                            sends: mbs as f64 * send,
                            gathers: mbs as f64 * gather,
                            first_is_fuller,
                            bubble_fraction,
                            bubble_simulated,
                            layers,
                            fp32,
                        });
                    }
                }
            }
        }
    }
    // Fastest first; among equals, the one that leaves more memory free.
    plans.sort_by(|a, b| a.step_seconds.total_cmp(&b.step_seconds).then(a.memory.total_cmp(&b.memory)));
    Ok(Searched { plans, considered, too_many_microbatches, units, traffic })
}

/// `shardc plan`.
pub fn plan(args: &PlanArgs) -> Result<()> {
    if let Some(path) = &args.report {
        crate::train::writable_file("--report", path)?;
    }
    let step = args.step();
    let (admit, constraints) = args.constraints()?;
    let spec = step.load_spec(args.spec.as_deref())?;
    let mut cluster = step.cluster_model()?;
    if let Some(n) = args.gpus_per_node {
        cluster.gpus_per_node = n;
    }
    if args.gpus == 0 {
        return Err(miette!(help = "ask for at least one GPU", "--gpus must be positive"));
    }
    if let Some(nodes) = args.nodes {
        if nodes == 0 || args.gpus % nodes != 0 {
            return Err(miette!(help = "use a number of nodes that divides --gpus", "--nodes {nodes} does not divide --gpus {}", args.gpus));
        }
        cluster.gpus_per_node = (args.gpus / nodes) as usize;
    }
    let global_batch = step.batch.global_batch.or(spec.training.global_batch).unwrap_or(spec.training.micro_batch);
    if global_batch == 0 {
        return Err(miette!(help = "a global batch is at least one sequence", "--global-batch must be at least 1"));
    }
    let start = Instant::now();
    // Progress on a terminal (compiling the variants is most of the time); hidden otherwise.
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message("compiling one-layer variants and composing strategies");
    spinner.enable_steady_tick(std::time::Duration::from_millis(100));
    let searched = search(&spec, &cluster, args.gpus, global_batch);
    spinner.finish_and_clear();
    let Searched { mut plans, considered, too_many_microbatches, units, traffic } = searched?;
    let fitting = plans.len();
    plans.retain(|p| admit(p));
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "shardc plan: {} on {} x {} ({} per node), global batch {} x {} tokens: {} strategies considered, {} fit, {:.2} s",
        spec.name,
        args.gpus,
        cluster.gpu.name,
        cluster.gpus_per_node,
        global_batch,
        spec.seq_len(),
        considered,
        plans.len(),
        elapsed
    );
    if considered == 0 && too_many_microbatches {
        return Err(miette!(
            help = format!("use a smaller --global-batch, or more GPUs (at most {MAX_MICROBATCHES} x 16 sequences per data-parallel replica)"),
            "every split of the global batch of {global_batch} sequences over {} GPUs needs more than the {MAX_MICROBATCHES} micro-batches a step may have",
            args.gpus
        ));
    }
    if considered == 0 {
        return Err(miette!(
            help = format!("use a GPU count whose data-parallel part divides the global batch of {global_batch} sequences (tensor parallelism stays within a node of {})", cluster.gpus_per_node),
            "no valid strategy splits {} on {} GPUs",
            spec.name,
            args.gpus
        ));
    }
    if fitting == 0 {
        return Err(miette!(help = "add GPUs, or lower --global-batch / --seq", "no strategy fits in {:.0} GB per GPU", cluster.gpu.memory_bytes / 1e9));
    }
    if !constraints.is_empty() {
        println!("  constrained to {}: {} of the {fitting} that fit", constraints.join(", "), plans.len());
    }
    if plans.is_empty() {
        return Err(miette!(
            help = "drop a constraint, or add GPUs (the micro-batches searched are 1, 2, 4, 8 and 16 sequences)",
            "no strategy that fits in {:.0} GB per GPU meets {}",
            cluster.gpu.memory_bytes / 1e9,
            constraints.join(", ")
        ));
    }
    println!("  {:<3} {:<58} {:>10} {:>7} {:>10} {:>10}  {}", "#", "strategy", "step", "MFU", "TFLOP/s", "memory", "bound by (share of the step)");
    for (i, p) in plans.iter().take(args.top).enumerate() {
        println!(
            "  {:<3} {:<58} {:>10} {:>6.1}% {:>10.1} {:>7.1} GB  {}",
            i + 1,
            p.label(),
            if p.step_seconds >= 1.0 { format!("{:.2} s", p.step_seconds) } else { format!("{:.3} ms", p.step_seconds * 1e3) },
            100.0 * p.mfu,
            p.tflops_per_gpu,
            p.memory / 1e9,
            p.bottleneck(&units, cluster.gpu.memory_bytes)
        );
    }
    // Where the numbers come from: a preset's data-sheet constants, or the user's file.
    let source = match &step.hardware.cluster {
        Some(path) => format!("--cluster {}", path.display()),
        None => format!("{} preset, uncalibrated", cluster.gpu.name),
    };
    println!("  #1 is {}", plans[0].assumption(&units, &cluster, &source));
    // The best plan as a command line (`--micro-batch` is per data-parallel replica, as `b`).
    let best = &plans[0];
    let mut command = format!(
        "shardc run {} --mesh {} --micro-batch {} --microbatches {} --recompute {} --zero {}",
        step.hf_dir(args.spec.as_deref()).or_else(|| args.spec.clone()).unwrap_or_default().display(),
        Mesh { dp: best.dp, tp: best.tp, pp: best.pp, cp: best.cp, ep: best.ep },
        best.micro_batch,
        best.microbatches,
        best.recompute,
        best.zero
    );
    if best.pp > 1 {
        command.push_str(&format!(" --schedule {}", best.schedule));
        if best.virtual_stages > 1 {
            command.push_str(&format!(" --virtual-stages {}", best.virtual_stages));
        }
    }
    if best.sequence_parallel {
        command.push_str(" --sequence-parallel");
    }
    // The form of context-parallel attention the plan was priced with: a step of several
    // micro-batches compiled with `auto` would choose again, without the ring's overlap.
    if let Some(form) = units.get(best.unit).and_then(|u| u.context_attention) {
        command.push_str(&format!(" --cp-attention {form}"));
    }
    if step.batch.seq.is_some() {
        command.push_str(&format!(" --seq {}", spec.seq_len()));
    }
    if let Some(dtype) = &step.model.dtype {
        command.push_str(&format!(" --dtype {dtype}"));
    }
    println!("  best as a command: {command}");
    if args.explain {
        explain_best(&plans[0], &units, &traffic);
    }
    if args.explain && plans.len() > 1 {
        let (a, b) = (&plans[0], &plans[1]);
        println!("why #1 beats #2 ({:.1}% faster):", 100.0 * (b.step_seconds / a.step_seconds - 1.0));
        for (what, x, y) in [("compute", a.compute, b.compute), ("pipeline bubble", a.bubble, b.bubble), ("exposed communication", a.communication, b.communication)] {
            if (x - y).abs() > 1e-9 {
                println!("  {what:<22} {:>9.3} s vs {:>9.3} s", x, y);
            }
        }
        println!("  memory                 {:>7.1} GB vs {:>7.1} GB", a.memory / 1e9, b.memory / 1e9);
        let differs: Vec<String> = [
            ("tp", a.tp.to_string(), b.tp.to_string()),
            ("pp", a.pp.to_string(), b.pp.to_string()),
            ("dp", a.dp.to_string(), b.dp.to_string()),
            ("micro-batch", a.micro_batch.to_string(), b.micro_batch.to_string()),
            ("schedule", format!("{} v={}", a.schedule, a.virtual_stages), format!("{} v={}", b.schedule, b.virtual_stages)),
            ("sequence parallel", a.sequence_parallel.to_string(), b.sequence_parallel.to_string()),
            ("recompute", a.recompute.to_string(), b.recompute.to_string()),
            ("ZeRO", a.zero.to_string(), b.zero.to_string()),
        ]
        .into_iter()
        .filter(|(_, x, y)| x != y)
        .map(|(what, x, y)| format!("{what} {x} instead of {y}"))
        .collect();
        println!("  they differ in: {}", differs.join(", "));
    }
    if let Some(path) = &args.report {
        crate::train::make_parent(path)?;
        std::fs::write(path, report_html(&spec, &cluster, args.gpus, global_batch, &plans[..plans.len().min(args.top)], &units)).into_diagnostic()?;
        println!("  report      {}", path.display());
    }
    Ok(())
}

/// Where the best plan's step goes: per kernel class and per collective (kind and axes),
/// composed from the unit costs, with what the dp collectives move per parameter.
fn explain_best(best: &Plan, units: &[UnitCosts], traffic: &[DataParallelTraffic]) {
    println!("where #1's step goes ({:.3} s; busiest stage, per step):", best.step_seconds);
    for (what, t) in best.breakdown(units) {
        let note = if what.ends_with(" dp") { " (overlaps the last backward)" } else { "" };
        println!("  {what:<22} {t:>9.3} s {:>6.1}%{note}", 100.0 * t / best.step_seconds);
    }
    if let Some(t) = traffic.get(best.zero as usize).filter(|_| best.dp > 1) {
        let moved: Vec<String> = t.kinds().iter().filter(|(_, _, b)| *b > 0.0).map(|(_, name, b)| format!("{name} {b:.2}")).collect();
        println!("  dp sync at ZeRO-{}: bytes per parameter the compiled step moves: {}", best.zero, moved.join(", "));
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Stacked horizontal bars, one per row, of (label, parts); parts share `colors` and `names`.
fn bars(title: &str, rows: &[(String, Vec<f64>)], names: &[&str], colors: &[&str], unit: &str, scale: f64) -> String {
    let (left, width, row) = (120.0, 560.0, 26.0);
    let max = rows.iter().map(|(_, p)| p.iter().sum::<f64>()).fold(0.0, f64::max).max(f64::MIN_POSITIVE);
    let height = 50.0 + rows.len() as f64 * row + 30.0;
    let mut svg = format!(r#"<svg xmlns="http://www.w3.org/2000/svg" width="{:.0}" height="{height:.0}" font-family="sans-serif" font-size="12"><text x="4" y="18" font-size="14">{}</text>"#, left + width + 120.0, escape(title));
    for (i, (label, parts)) in rows.iter().enumerate() {
        let y = 34.0 + i as f64 * row;
        svg.push_str(&format!(r#"<text x="4" y="{:.0}">{}</text>"#, y + 15.0, escape(label)));
        let mut x = left;
        for (k, part) in parts.iter().enumerate() {
            let w = part / max * width;
            svg.push_str(&format!(r#"<rect x="{x:.1}" y="{y:.0}" width="{w:.1}" height="20" fill="{}"><title>{}: {:.2} {unit}</title></rect>"#, colors[k % colors.len()], names[k], part / scale));
            x += w;
        }
        svg.push_str(&format!(r#"<text x="{:.1}" y="{:.0}">{:.1} {unit}</text>"#, x + 4.0, y + 15.0, parts.iter().sum::<f64>() / scale));
    }
    let y = 34.0 + rows.len() as f64 * row + 14.0;
    for (k, name) in names.iter().enumerate() {
        let x = left + k as f64 * 110.0;
        svg.push_str(&format!(r#"<rect x="{x:.0}" y="{:.0}" width="10" height="10" fill="{}"/><text x="{:.0}" y="{:.0}">{name}</text>"#, y - 9.0, colors[k % colors.len()], x + 14.0, y));
    }
    svg.push_str("</svg>");
    svg
}

/// The HTML report of the best plans.
fn report_html(spec: &Spec, cluster: &Cluster, gpus: u64, global_batch: u64, plans: &[Plan], units: &[UnitCosts]) -> String {
    let best = &plans[0];
    let colors = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f"];
    let memory = bars(
        &format!("Memory per GPU by pipeline stage (best plan), {} GB of HBM", (cluster.gpu.memory_bytes / 1e9).round()),
        &best.stage_memory.iter().enumerate().map(|(s, m)| (format!("stage {s}"), m.to_vec())).collect::<Vec<_>>(),
        &["weights", "gradients", "optimizer", "activations", "temporaries"],
        &colors,
        "GB",
        1e9,
    );
    let time = bars(
        "Step time of the best plans",
        &plans.iter().enumerate().map(|(i, p)| (format!("#{}", i + 1), vec![p.compute, p.bubble, p.communication])).collect::<Vec<_>>(),
        &["compute", "bubble", "communication"],
        &colors,
        "s",
        1.0,
    );
    // The best plan's schedule, with unit costs, capped to a readable number of micro-batches.
    let timeline = if best.pp > 1 {
        let kind = Kind::parse(best.schedule).unwrap_or(Kind::OneFOneB);
        let m = if kind == Kind::Interleaved { (best.microbatches.min(2 * best.pp) / best.pp).max(1) * best.pp } else { best.microbatches.min(2 * best.pp) };
        generate(kind, best.pp as usize, m as usize, best.virtual_stages as usize)
            .ok()
            .and_then(|s| {
                let v = s.chunks as f64;
                let costs = if kind == Kind::ZeroBubble { Costs { f: 1.0, b: 1.0, w: 1.0 } } else { Costs { f: 1.0 / v, b: 1.0 / v, w: 0.0 } };
                simulate(&s, costs).ok().map(|t| (m, shardc_runtime::schedule::svg(&s, &t)))
            })
            .map(|(m, svg)| format!("<h2>Pipeline timeline</h2><p>{} micro-batches shown of {} (unit costs).</p>{svg}", m, best.microbatches))
            .unwrap_or_default()
    } else {
        String::new()
    };
    let rows: String = plans
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "<tr><td>{}</td><td>{}</td><td>{:.2} s</td><td>{:.1}%</td><td>{:.1}</td><td>{:.1} GB</td><td>{}</td></tr>",
                i + 1,
                escape(&p.label()),
                p.step_seconds,
                100.0 * p.mfu,
                p.tflops_per_gpu,
                p.memory / 1e9,
                escape(&p.bottleneck(units, cluster.gpu.memory_bytes))
            )
        })
        .collect();
    format!(
        r#"<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>shardc plan: {name}</title>
<style>body {{ font-family: sans-serif; margin: 24px; }} table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }} td:nth-child(2) {{ text-align: left; }}</style></head>
<body><h1>shardc plan: {name} on {gpus} x {gpu}</h1>
<p>Global batch {global_batch} x {seq} tokens, {per_node} GPUs per node. Best: <b>{label}</b>, {step:.2} s per step, MFU {mfu:.1}%, {tflops:.1} TFLOP/s per GPU, {bound}.</p>
<h2>Top plans</h2><table><tr><th>#</th><th>strategy</th><th>step</th><th>MFU</th><th>TFLOP/s per GPU</th><th>memory per GPU</th><th>bottleneck</th></tr>{rows}</table>
<h2>Memory</h2>{memory}
<h2>Time</h2>{time}
{timeline}
</body></html>
"#,
        name = escape(&spec.name),
        gpu = escape(&cluster.gpu.name),
        seq = spec.seq_len(),
        per_node = cluster.gpus_per_node,
        label = escape(&best.label()),
        step = best.step_seconds,
        mfu = 100.0 * best.mfu,
        tflops = best.tflops_per_gpu,
        bound = escape(&best.bottleneck(units, cluster.gpu.memory_bytes)),
    )
}

/// The grid a plan's mesh runs on (see `shard-megatron`): `[dp, tp, pp]`, with cp, and with
/// ep the dp axis holding the dp / ep expert groups.
fn plan_grid(dp: u64, tp: u64, pp: u64, cp: u64, ep: u64) -> Vec<i64> {
    let mut grid = vec![(dp / ep.max(1)) as i64, tp as i64, pp as i64, cp as i64];
    if ep > 1 {
        grid.push(ep as i64);
    }
    grid
}
