//! The short summary `shardc compile` prints, and the figures it is made of.

use serde::{Deserialize, Serialize};
use shardc_ir::mesh::Mesh;
use shardc_ir::spec::Spec;
use shardc_ir::Module;

/// Figures of one compiled step, as printed and as written into the plan file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// Trainable parameters.
    pub parameters: u64,
    /// Parameters one token uses (a mixture of experts' unchosen experts left out): what the
    /// model FLOPs count.
    #[serde(default)]
    pub active_parameters: u64,
    /// Bytes of the parameters in the spec's dtype.
    pub parameter_bytes: u64,
    /// Forward FLOPs of one micro-batch (sum of the op registry's costs).
    pub forward_flops_per_microbatch: f64,
    /// FLOPs of one `train_step` (one micro-batch: forward, backward, optimizer), summed
    /// from the op registry's costs over the real training-step IR.
    pub train_step_flops_per_microbatch: f64,
    /// The step's batch: micro-batch per replica, dp, micro-batches per step, global batch.
    pub batch: shardc_ir::spec::Batch,
    /// Memory of the training step's rank program: arguments (parameters, optimizer
    /// state, inputs) and the peak of temporaries with and without slot reuse.
    pub memory: Option<MemorySummary>,
    /// Collectives of the training step by kind and axes, as rank 0 runs them.
    #[serde(default)]
    pub communication: Vec<CommSummary>,
    /// Ops of each kind in `@forward`.
    pub op_counts: std::collections::BTreeMap<String, usize>,
    /// Where a GPU runs the step's attention: on tensor cores, or on CUDA cores and why.
    pub attention: Option<String>,
    /// Modelled step time on the cluster (`--gpu`, `--cluster`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate: Option<shardc_codegen::estimate::Estimate>,
    /// Memory per GPU as the program stores it (types and layouts), the fullest rank's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_estimate: Option<shardc_codegen::estimate::MemoryEstimate>,
    /// HBM bytes of the GPU.
    #[serde(default)]
    pub gpu_memory: f64,
    /// The GPU the estimate is for.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub gpu: String,
    /// What the communication optimizer did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_opt: Option<shardc_passes::CommOptReport>,
    /// Pipeline stages, when the step is cut into them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageSummary>,
}

/// One pipeline stage.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageSummary {
    /// Stage number.
    pub stage: usize,
    /// Pipeline rank running it.
    pub rank: usize,
    /// What it holds: `embedding, layers 0-5`.
    pub holds: String,
    /// Parameters it owns (this rank's shards).
    pub parameters: u64,
    /// Its share of the step's estimated time (the balance the split aimed at).
    pub time_share: f64,
    /// Peak memory of its pipeline rank's program (all the rank's chunks).
    pub rank_peak_bytes: u64,
}

/// What a stage function holds, from its op locations.
fn stage_holds(func: &shardc_ir::Func) -> String {
    let mut parts = Vec::new();
    if func.ops.iter().any(|o| o.loc.starts_with("embed.")) {
        parts.push("embedding".to_string());
    }
    let mut blocks: Vec<(usize, bool)> = func
        .ops
        .iter()
        .filter_map(|o| {
            let rest = o.loc.strip_prefix("layers.")?;
            let (n, part) = rest.split_once('.')?;
            Some((n.parse().ok()?, part.starts_with("mlp")))
        })
        .collect();
    blocks.sort_unstable();
    blocks.dedup();
    if let (Some(first), Some(last)) = (blocks.first(), blocks.last()) {
        let name = |(n, mlp): (usize, bool), whole: bool| if whole { format!("{n}") } else { format!("{n}.{}", if mlp { "mlp" } else { "attn" }) };
        // A range starting at an MLP block or ending at an attention block cuts a layer.
        let whole = !first.1 && last.1;
        let text = if first == last {
            format!("layer {}", name(*first, false))
        } else if whole && first.0 == last.0 {
            format!("layer {}", first.0)
        } else {
            format!("layers {}-{}", name(*first, !first.1), name(*last, last.1))
        };
        parts.push(text);
    }
    if func.ops.iter().any(|o| o.loc == "lm_head" || o.loc == "loss") {
        parts.push("head and loss".into());
    }
    if parts.is_empty() { "nothing (more stages than blocks)".into() } else { parts.join(", ") }
}

/// Collectives of one kind over one set of axes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CommSummary {
    /// Op name.
    pub op: String,
    /// Axis names, e.g. `tp`.
    pub axes: String,
    /// How many.
    pub count: usize,
    /// Bytes rank 0 sends for them.
    pub bytes: u64,
}

/// Names of grid axes, for reports.
pub fn axis_names(axes: &[usize]) -> String {
    axes.iter().map(|&a| shardc_ir::mesh::axis_name(a)).collect::<Vec<_>>().join("+")
}

/// Memory of one rank program.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemorySummary {
    /// Parameters, optimizer state and inputs.
    pub argument_bytes: u64,
    /// Peak of temporaries with slot reuse.
    pub temporary_bytes: u64,
    /// Temporaries without reuse.
    pub temporary_bytes_without_reuse: u64,
}

impl Summary {
    /// Collects the figures of `@forward` and `@train_step`.
    pub fn of(spec: &Spec, batch: shardc_ir::spec::Batch, module: &Module, programs: &[shardc_runtime::Program]) -> Summary {
        let forward = module.func("forward");
        let parameters = forward.map_or(0, |f| f.parameter_count());
        let dtype: shardc_ir::DType = spec.model.dtype.into();
        Summary {
            parameters,
            active_parameters: forward.map_or(0, |f| f.active_parameter_count()),
            parameter_bytes: parameters.saturating_mul(dtype.bytes() as u64),
            forward_flops_per_microbatch: forward.map_or(0.0, |f| f.cost().flops),
            train_step_flops_per_microbatch: module.func("train_step").map_or(0.0, |f| f.cost().flops),
            batch,
            communication: programs.iter().find(|p| p.name == "train_step").map(communication).unwrap_or_default(),
            memory: programs.iter().find(|p| p.name == "train_step").map(|p| MemorySummary {
                argument_bytes: p.memory.argument_bytes as u64,
                temporary_bytes: p.memory.temporary_bytes as u64,
                temporary_bytes_without_reuse: p.memory.temporary_bytes_without_reuse as u64,
            }),
            op_counts: forward.map(|f| f.op_counts()).unwrap_or_default(),
            attention: attention_cores(module),
            stages: Vec::new(),
            estimate: None,
            memory_estimate: None,
            gpu_memory: 0.0,
            gpu: String::new(),
            comm_opt: module.notes.get("comm-opt").and_then(|json| serde_json::from_str(json).ok()),
        }
        .with_stages(module, programs)
    }

    /// Adds the pipeline stages of `module`, if it has any.
    fn with_stages(mut self, module: &Module, programs: &[shardc_runtime::Program]) -> Summary {
        let stages: Vec<&shardc_ir::Func> = (0..).map_while(|k| module.func(&format!("stage{k}"))).collect();
        if stages.is_empty() {
            return self;
        }
        let time = |f: &shardc_ir::Func| f.ops.iter().map(|op| shardc_passes::op_time(f, op)).sum::<f64>();
        let total: f64 = stages.iter().map(|f| time(f)).sum::<f64>().max(f64::MIN_POSITIVE);
        let ranks: Vec<&shardc_runtime::Program> = programs.iter().filter(|p| p.pipeline.is_some()).collect();
        // Per rank: the heaviest pipeline rank's stages.
        let pp = ranks.len().max(1);
        self.train_step_flops_per_microbatch = (0..pp).map(|r| stages.iter().skip(r).step_by(pp).map(|f| f.cost().flops).sum::<f64>()).fold(0.0, f64::max);
        self.stages = stages
            .iter()
            .enumerate()
            .map(|(k, f)| StageSummary {
                stage: k,
                rank: k % ranks.len().max(1),
                holds: stage_holds(f),
                parameters: f.parameter_count(),
                time_share: time(f) / total,
                rank_peak_bytes: ranks.get(k % ranks.len().max(1)).map_or(0, |p| p.peak_bytes() as u64),
            })
            .collect();
        if let Some(p) = ranks.iter().max_by_key(|p| p.peak_bytes()) {
            self.memory = Some(MemorySummary {
                argument_bytes: p.memory.argument_bytes as u64,
                temporary_bytes: p.memory.temporary_bytes as u64,
                temporary_bytes_without_reuse: p.memory.temporary_bytes_without_reuse as u64,
            });
            self.communication = communication(p);
        }
        self
    }

    /// The printed summary.
    pub fn render(&self, spec: &Spec, mesh: &Mesh, passes: &[&str]) -> String {
        let m = &spec.model;
        let mut out = String::new();
        let mut line = |key: &str, value: String| out.push_str(&format!("  {key:<12}{value}\n"));
        line(
            "model",
            format!(
                "{} layers, hidden {}, {} heads ({} kv), ffn {}, vocab {}, {:?}/{:?}/{:?}{}",
                m.layers,
                m.hidden,
                m.heads,
                m.kv_heads(),
                m.ffn_hidden,
                if m.padded_vocab(mesh.tp) == m.vocab {
                    m.vocab.to_string()
                } else {
                    format!("{} (padded to {}, a multiple of {} x tp {})", m.vocab, m.padded_vocab(mesh.tp), m.vocab_multiple, mesh.tp)
                },
                m.norm,
                m.activation,
                m.positions,
                if m.tied_embeddings { ", tied embeddings" } else { "" }
            )
            .to_lowercase(),
        );
        let active = if self.active_parameters != self.parameters { format!(", {} active per token", thousands(self.active_parameters)) } else { String::new() };
        line("parameters", format!("{} ({}){active}", thousands(self.parameters), bytes(self.parameter_bytes)));
        line(
            "step",
            format!(
                "seq {} x micro-batch {} per replica x dp {}, {} micro-batch{} per step (global batch {} sequences)",
                spec.seq_len(),
                self.batch.micro_batch,
                self.batch.dp,
                self.batch.microbatches,
                if self.batch.microbatches == 1 { "" } else { "es" },
                self.batch.global_batch
            ),
        );
        let step_flops = self.train_step_flops_per_microbatch * self.batch.microbatches as f64;
        if mesh.ranks() > 1 {
            // The training step is a rank's program; the forward figure is the whole model's.
            line(
                "FLOPs",
                format!(
                    "{} forward (whole model) and {} training step on each rank, per micro-batch",
                    flops(self.forward_flops_per_microbatch),
                    flops(self.train_step_flops_per_microbatch)
                ),
            );
        } else {
            line(
                "FLOPs",
                format!(
                    "{} forward, {} training step per micro-batch ({:.2}x forward); {} per step",
                    flops(self.forward_flops_per_microbatch),
                    flops(self.train_step_flops_per_microbatch),
                    self.train_step_flops_per_microbatch / self.forward_flops_per_microbatch.max(1.0),
                    flops(step_flops)
                ),
            );
        }
        if let Some(m) = &self.memory {
            line(
                "memory",
                format!(
                    "{} arguments (parameters, optimizer state, inputs) + {} peak temporaries ({} without reuse)",
                    bytes(m.argument_bytes),
                    bytes(m.temporary_bytes),
                    bytes(m.temporary_bytes_without_reuse)
                ),
            );
        }
        if mesh.ranks() > 1 {
            line("mesh", format!("{mesh} ({} ranks): partitioned; training-step FLOPs and memory are per rank", mesh.ranks()));
        } else {
            line("mesh", format!("{mesh} (1 rank)"));
        }
        line("passes", passes.join(" -> "));
        if let Some(r) = &self.comm_opt {
            let rules: Vec<String> = r.rules.iter().map(|(name, n)| format!("{name} x{n}")).collect();
            line(
                "comm-opt",
                format!(
                    "{} collectives, {:.1} us, {} -> {} collectives, {:.1} us, {} (modelled per micro-batch step)",
                    r.collectives_before,
                    r.time_before * 1e6,
                    bytes(r.bytes_before as u64),
                    r.collectives_after,
                    r.time_after * 1e6,
                    bytes(r.bytes_after as u64)
                ),
            );
            line(
                "",
                format!(
                    "e-graph {} nodes, {} classes, {} iterations, stopped: {}, {:.0} ms; rules fired: {}",
                    r.enodes,
                    r.eclasses,
                    r.iterations,
                    r.stop,
                    r.seconds * 1e3,
                    if rules.is_empty() { "none".to_string() } else { rules.join(", ") }
                ),
            );
        }
        for s in &self.stages {
            line(
                if s.stage == 0 { "stages" } else { "" },
                format!(
                    "stage {} on pipeline rank {}: {}; {} parameters, {:.0}% of the step's time; rank memory {}",
                    s.stage,
                    s.rank,
                    s.holds,
                    thousands(s.parameters),
                    100.0 * s.time_share,
                    bytes(s.rank_peak_bytes)
                ),
            );
        }
        if !self.communication.is_empty() {
            let parts: Vec<String> = self
                .communication
                .iter()
                .map(|c| format!("{} {} over {} ({})", c.count, c.op, c.axes, bytes(c.bytes)))
                .collect();
            line("comm/rank", format!("{} per training step of one micro-batch (rank 0): {}", bytes(self.communication.iter().map(|c| c.bytes).sum()), parts.join(", ")));
        }
        if let Some(e) = &self.estimate {
            let comm: Vec<String> = e.exposed_communication.iter().map(|(axes, t)| format!("{axes} {:.2} ms", t * 1e3)).collect();
            line(
                "estimate",
                format!(
                    "{:.2} ms per step on {} x {}: {:.0} tokens/s, MFU {:.1}% ({} model FLOPs: 6N + 12Lsh per token)",
                    e.step_seconds * 1e3,
                    mesh.ranks(),
                    self.gpu,
                    e.tokens_per_second,
                    100.0 * e.mfu,
                    flops(e.model_flops)
                ),
            );
            line(
                "",
                format!(
                    "compute {:.2} ms (busiest rank), exposed communication {}, pipeline bubble {:.2} ms: {}-bound",
                    e.compute_seconds * 1e3,
                    if comm.is_empty() { "none".to_string() } else { comm.join(", ") },
                    e.bubble_seconds * 1e3,
                    e.bound
                ),
            );
        }
        if let Some(m) = &self.memory_estimate {
            // In the unit of the largest part: a tiny model's are not all "0.0 GB".
            let largest = [m.parameters, m.gradients, m.optimizer, m.activations, m.temporaries, m.staging].into_iter().fold(0.0, f64::max);
            let (unit, scale) = if largest >= 0.1e9 { ("GB", 1e9) } else if largest >= 0.1e6 { ("MB", 1e6) } else { ("kB", 1e3) };
            let gb = |b: f64| format!("{:.1} {unit}", b / scale);
            let total = if m.total >= 0.1e9 { format!("{:.1} GB", m.total / 1e9) } else { format!("{:.1} MB", m.total / 1e6) };
            line(
                "memory/GPU",
                format!(
                    "{} {}: weights {}, gradients {}, optimizer {}, activations {}, temporaries {}{}{}{}; {} in {}'s {}",
                    total,
                    match spec.model.dtype {
                        shardc_ir::spec::SpecDType::Bf16 => "in mixed precision (bf16 weights; fp32 gradients, master weights and moments)",
                        shardc_ir::spec::SpecDType::F32 => "in f32",
                        shardc_ir::spec::SpecDType::F64 => "in f64",
                    },
                    gb(m.parameters),
                    // A step without a pipeline frees activations as it makes gradients:
                    // its peak holds only some of them.
                    if gb(m.all_gradients) != gb(m.gradients) { format!("{} at the peak ({} per step as reduced)", gb(m.gradients), gb(m.all_gradients)) } else { gb(m.gradients) },
                    gb(m.optimizer),
                    if m.in_flight <= 1 && gb(m.kept_per_microbatch) != gb(m.activations) {
                        format!("{} at the peak (of {} kept per micro-batch)", gb(m.activations), gb(m.kept_per_microbatch))
                    } else {
                        format!("{} ({} micro-batch{} in flight)", gb(m.activations), m.in_flight, if m.in_flight == 1 { "" } else { "es" })
                    },
                    gb(m.temporaries),
                    if m.staging > 0.0 { format!(", staging {}", gb(m.staging)) } else { String::new() },
                    // MiB-sized: shown in MiB, where GB would round it away.
                    if m.device_scratch > 0.0 { format!(", device scratch {:.1} MiB", m.device_scratch / (1u64 << 20) as f64) } else { String::new() },
                    // Bucketed gradients are reduced in place in their own buffers: part of
                    // the gradients and temporaries above, not extra.
                    if m.buckets > 0.0 { format!(" (dp buckets: {} of reduced gradients, in place, counted above)", gb(m.buckets)) } else { String::new() },
                    if m.total <= self.gpu_memory { "fits" } else { "does NOT fit" },
                    self.gpu,
                    format!("{:.1} GB", self.gpu_memory / 1e9)
                ),
            );
        }
        let ops: Vec<String> = self.op_counts.iter().map(|(name, n)| format!("{name} {n}")).collect();
        line("ops", ops.join(", "));
        if let Some(attention) = &self.attention {
            line("attention", attention.clone());
        }
        out
    }
}

/// Where a GPU runs the training step's attention (forward and backward, every stage), as the
/// op registry says and the device plan launches: on tensor cores, or on CUDA cores and why.
/// `None` without attention.
fn attention_cores(module: &Module) -> Option<String> {
    let (mut tensor, mut cuda, mut why) = (0usize, 0usize, std::collections::BTreeSet::new());
    for func in module.funcs.iter().filter(|f| f.name != "forward") {
        for op in func.ops.iter().filter(|op| matches!(op.name.as_str(), "xf.attention" | "xf.attention_grad" | "xf.attention_block" | "xf.attention_block_grad")) {
            let inputs: Vec<&shardc_ir::TensorTy> = op.operands.iter().filter_map(|v| func.tensor(*v)).collect();
            match shardc_ir::ops::off_tensor_cores(&inputs, &op.attrs) {
                None => tensor += 1,
                Some(reason) => {
                    cuda += 1;
                    why.insert(reason);
                }
            }
        }
    }
    match (tensor, cuda) {
        (0, 0) => None,
        (t, 0) => Some(format!("{t} ops on tensor cores (bf16 with fp32 accumulation)")),
        (t, c) => Some(format!(
            "{c} ops on CUDA cores ({}){}: tensor cores take bf16 at head dims 16 to 128 in steps of 16",
            why.into_iter().collect::<Vec<_>>().join("; "),
            if t > 0 { format!(", {t} on tensor cores") } else { String::new() }
        )),
    }
}

/// `124439808` -> `124,439,808`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes in binary units.
pub fn bytes(n: u64) -> String {
    shardc_runtime::inspect::bytes(n)
}

/// FLOPs in decimal units.
pub fn flops(n: f64) -> String {
    let units = ["FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP"];
    let mut value = n;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < units.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.2} {}", units[unit])
}

/// Collectives of `program` grouped by op and axes, for rank 0: a bucket (of one step, or of
/// a pipeline or accumulation step's step section) counts as the one collective (an
/// all-reduce) or NCCL group (of gathers or scatters) issued for it, not one per member.
fn communication(program: &shardc_runtime::Program) -> Vec<CommSummary> {
    let mut groups: std::collections::BTreeMap<(String, String), (usize, u64)> = std::collections::BTreeMap::new();
    let mut buckets_seen = std::collections::HashSet::new();
    for r in shardc_runtime::report::comm_records(program, 0) {
        let entry = groups.entry((r.op.trim_start_matches("shard.").to_string(), axis_names(&r.axes))).or_insert((0, 0));
        // Buckets of a single step (`xf.bucket`) and of a pipeline or accumulation step's
        // step section (`xf.step_bucket`), numbered apart.
        let instr = &program.instrs[r.index];
        let bucket = instr.int("xf.bucket").ok().map(|b| (false, b)).or_else(|| instr.int("xf.step_bucket").ok().map(|b| (true, b)));
        if bucket.is_none_or(|b| buckets_seen.insert(b)) {
            entry.0 += 1;
        }
        entry.1 += r.bytes;
    }
    groups.into_iter().map(|((op, axes), (count, bytes))| CommSummary { op, axes, count, bytes }).collect()
}

/// One line about a program's device code: launches, fusion, GEMMs, what the runtime issues,
/// module size. Collectives are counted as the backend issues them: one per instruction
/// (never a `tensor.empty`, which only allocates), one per gradient bucket region and one per
/// NCCL group of a bucket of gathers or scatters, not one per member; sends and receives between pipeline stages apart. A pipeline rank's line
/// names its program.
pub fn device_line(program: &shardc_runtime::Program) -> Option<String> {
    use shardc_runtime::program::DeviceCall;
    let plan = program.device.as_ref()?;
    let calls = plan.calls.iter().flatten();
    let launches = calls.clone().filter(|c| matches!(c, DeviceCall::Launch { .. })).count();
    let fused = calls.clone().filter(|c| matches!(c, DeviceCall::Fused { .. })).count();
    let gemms = calls.clone().filter(|c| matches!(c, DeviceCall::Gemm(_) | DeviceCall::GemmEpilogue { .. })).count();
    let epilogues = calls.filter(|c| matches!(c, DeviceCall::GemmEpilogue { .. })).count();
    let runtime: Vec<&str> = plan.calls.iter().zip(&program.instrs).filter(|(c, _)| matches!(c.first(), Some(DeviceCall::Runtime))).map(|(_, i)| i.op.as_str()).collect();
    let transfers = runtime.iter().filter(|op| matches!(**op, "shard.send" | "shard.recv")).count();
    let per_instruction = runtime.iter().filter(|op| !matches!(**op, "shard.send" | "shard.recv" | "tensor.empty")).count();
    let members: usize = program.memory.buckets.iter().map(|r| r.members.len()).sum();
    // A bucket of asynchronous gathers or scatters goes out as one NCCL group.
    let grouped: Vec<i64> = program.instrs.iter().filter(|i| i.bool("xf.async") == Ok(true) && matches!(i.op.as_str(), "shard.reduce_scatter" | "shard.all_gather")).filter_map(|i| i.int("xf.bucket").ok()).collect();
    let groups = grouped.iter().collect::<std::collections::HashSet<_>>().len();
    let collectives = per_instruction.saturating_sub(members + grouped.len()) + program.memory.buckets.len() + groups;
    let who = if program.pipeline.is_some() { format!("{}: ", program.name) } else { String::new() };
    let transfers = if transfers > 0 { format!(", {transfers} sends and receives") } else { String::new() };
    Some(format!(
        "{who}cuda ({:?}): {launches} kernel launches ({fused} element-wise ops fused into others), {gemms} cuBLAS GEMMs ({epilogues} with fused epilogues), {collectives} collectives{transfers}; module {}, scratch {}",
        plan.dtype,
        bytes(plan.source.len() as u64),
        bytes(plan.workspace_bytes as u64)
    ))
}
