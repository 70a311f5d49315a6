//! Options shared by the commands that compile a spec: overrides of the spec's step shape,
//! and the training-step options.

use std::path::{Path, PathBuf};

use clap::Args;
use miette::{Result, miette};
use shardc_ir::spec::{self, Spec};
use shardc_passes::{CompileOptions, OptimizerKind, Recompute, Schedule};

use crate::report;

/// How to build the training step: every option group, as `compile`, `run` and `bench` take
/// them. Commands that use fewer take only their groups, and build the rest from
/// [`StepArgs::default`] (clap's defaults).
#[derive(Args, Debug, Clone)]
pub struct StepArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub batch: BatchArgs,
    #[command(flatten)]
    pub strategy: StrategyArgs,
    #[command(flatten)]
    pub training: TrainingArgs,
    #[command(flatten)]
    pub hardware: HardwareArgs,
}

/// The model: a spec or a Hugging Face folder, and its element type.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// A Hugging Face model folder (config.json and model.safetensors, or sharded files with
    /// their index) of the GPT-2 or Llama family, in place of a spec: the config becomes the
    /// spec, and `run` starts from its weights.
    #[arg(long, value_name = "DIR")]
    pub hf: Option<PathBuf>,
    /// Override the spec's model.dtype: f32, bf16 (mixed precision: bf16 weights and compute,
    /// fp32 master weights, Adam moments, gradient reduction and accumulation, and loss) or f64.
    #[arg(long)]
    pub dtype: Option<String>,
}

/// The step's shape: sequence length and batch.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Batch")]
pub struct BatchArgs {
    /// Override the spec's training.seq_len.
    #[arg(long)]
    pub seq: Option<u64>,
    /// Sequences per micro-batch on each data-parallel replica (overrides the spec's
    /// training.micro_batch), as Megatron-LM's --micro-batch-size.
    #[arg(long)]
    pub micro_batch: Option<u64>,
    /// Sequences per optimizer step over all replicas and micro-batches: micro-batch x dp x
    /// micro-batches (overrides the spec's training.global_batch).
    #[arg(long)]
    pub global_batch: Option<u64>,
    /// Micro-batches per optimizer step (gradient accumulation; the pipeline's m). Default:
    /// global batch / (micro-batch x dp); given alone, it sets the global batch.
    #[arg(long)]
    pub microbatches: Option<u64>,
}

/// How the step is partitioned and what it keeps: recomputation, ZeRO, sequence parallelism, buckets, the pipeline.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Strategy")]
pub struct StrategyArgs {
    /// Activation recomputation: none, full or selective-attention.
    #[arg(long, default_value = "none")]
    pub recompute: String,
    /// ZeRO stage with data parallelism: 1-2 shard optimizer state over dp (gradients are
    /// reduce-scattered into the shards), 3 shards parameters too.
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Sequence parallelism: split the residual stream and norms along the sequence over tp.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Data-parallel bucket size in MiB: gradient all-reduces, ZeRO's gradient scatters and
    /// gathers of updated shards go out asynchronously in buckets of this size, and ZeRO-3
    /// prefetches up to this much of its parameter gathers (0: none of these; each
    /// collective on its own). Default 25. Steps of several micro-batches or pipeline stages
    /// reduce their gradients once per step, in buckets of this size (all-reduces, or ZeRO's
    /// reduce-scatters) that a GPU sends as the last backward of the step fills them.
    #[arg(long)]
    pub grad_bucket_mb: Option<u64>,
    /// Partition naively (gather every column-parallel matmul's result), to see what the
    /// communication optimizer recovers.
    #[arg(long)]
    pub naive_partition: bool,
    /// Skip the communication optimizer (`comm-opt`).
    #[arg(long)]
    pub no_comm_opt: bool,
    /// Context parallelism's attention with cp > 1: all-gather (keys and values gathered over
    /// cp), ring (key/value blocks passed round the cp ranks) or auto (the cheaper on the
    /// cluster model).
    #[arg(long, value_name = "FORM")]
    pub cp_attention: Option<String>,
    /// Pipeline schedule with pp > 1: gpipe, 1f1b, interleaved or zb-h1.
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Model chunks per pipeline rank for the interleaved schedule (default 2).
    #[arg(long)]
    pub virtual_stages: Option<u64>,
    /// Manual pipeline split as layer ranges per stage, e.g. `0-5,6-11` (the embedding goes
    /// with the first stage, the head with the last); default: balanced by cost.
    #[arg(long, value_name = "RANGES")]
    pub stages: Option<String>,
}

/// The optimizer and its learning-rate schedule.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Optimizer")]
pub struct TrainingArgs {
    /// Optimizer: adamw or sgd. AdamW uses betas 0.9 and 0.95, epsilon 1e-8 and weight decay
    /// 0.1 on matrices only (never on norm scales or biases), as Megatron-LM and Hugging Face
    /// do; sgd has no weight decay.
    #[arg(long, default_value = "adamw")]
    pub optimizer: String,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Iterations of linear learning-rate warmup from 0 to --lr (iteration t of the warmup
    /// uses lr x t / warmup).
    #[arg(long, default_value_t = 0)]
    pub lr_warmup_steps: u64,
    /// Learning-rate decay after the warmup: cosine (the default), linear or constant; it
    /// needs --lr-decay-steps outside `run`.
    #[arg(long)]
    pub lr_decay: Option<String>,
    /// Iteration at which the decay reaches --min-lr; 0: no decay (the rate stays at --lr
    /// after the warmup, as with --lr-decay constant). Default: `run`'s --steps (as
    /// Megatron-LM's --lr-decay-iters defaults to --train-iters); other commands: no decay.
    #[arg(long)]
    pub lr_decay_steps: Option<u64>,
    /// Learning rate at the end of the decay. Default: --lr / 10.
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// Clip gradients to this global norm (over every parameter once, across tp, pp, dp and
    /// ZeRO shards), as Megatron-LM's --clip-grad; 0 turns clipping off.
    #[arg(long, default_value_t = 1.0)]
    pub clip_grad: f64,
}

/// The cluster model that prices the step and whose memory it must fit.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Hardware")]
pub struct HardwareArgs {
    /// GPU preset the cluster model prices with: a100-40g, a100-80g, h100-sxm (the default)
    /// or h200. Given (or with --cluster), `compile` refuses a plan that does not fit its
    /// memory, and says which change would.
    #[arg(long)]
    pub gpu: Option<String>,
    /// Cluster model overrides as TOML (preset, gpus_per_node, launch, placement, [gpu],
    /// [intra_node], [inter_node]); see ir/src/cluster.rs. The file names its GPU (`preset`),
    /// so it is not given with --gpu.
    #[arg(long, value_name = "FILE", conflicts_with = "gpu")]
    pub cluster: Option<PathBuf>,
}

/// Every option at clap's default, as if none were given.
fn defaults<T: Args + clap::FromArgMatches>() -> T {
    let matches = T::augment_args(clap::Command::new("defaults").no_binary_name(true)).get_matches_from(std::iter::empty::<String>());
    T::from_arg_matches(&matches).expect("every option has a default or is optional")
}

impl Default for StepArgs {
    fn default() -> Self {
        defaults()
    }
}

/// Gradient bucket size without `--grad-bucket-mb`, in MiB.
pub const DEFAULT_GRAD_BUCKET_MB: u64 = 25;

impl StepArgs {
    /// Refuses what the user asked for that this step would not do: comm-opt's choice on a
    /// step with several micro-batches or pipeline stages (whose pass pipeline runs no
    /// comm-opt). The options are the user's: internal callers (the memory estimate skips
    /// comm-opt) set fields past this check.
    pub fn refuse_what_the_step_does_not_do(&self, spec: &Spec, mesh: shardc_ir::mesh::Mesh) -> Result<()> {
        // Buckets gather gradients that travel over data-parallel ranks: without any, a size
        // would change nothing (0, no buckets, says what holds anyway).
        if let Some(mb) = self.strategy.grad_bucket_mb.filter(|&mb| mb > 0)
            && mesh.dp * mesh.cp * mesh.ep == 1
        {
            return Err(miette!(help = "add data parallelism (--mesh dp=2, say), or leave --grad-bucket-mb out", "--grad-bucket-mb {mb} sizes the buckets data-parallel gradients travel in, and --mesh {mesh} has no data-parallel ranks"));
        }
        let Some(pipeline) = self.pipeline_options(spec, mesh)? else { return Ok(()) };
        let what = if mesh.pp > 1 { format!("pipeline stages (--mesh {mesh})") } else { format!("{} micro-batches", pipeline.microbatches) };
        if self.strategy.no_comm_opt {
            return Err(miette!(help = "leave --no-comm-opt out, or give --microbatches 1 at pp=1 to see comm-opt's work", "--no-comm-opt: comm-opt does not run on a step of {what}"));
        }
        Ok(())
    }

    /// These arguments with `change` made to a copy.
    pub fn with(&self, change: impl FnOnce(&mut StepArgs)) -> StepArgs {
        let mut step = self.clone();
        change(&mut step);
        step
    }

    /// These arguments for one micro-batch's step, whatever the global batch.
    pub fn one_microbatch(&self) -> StepArgs {
        self.with(|s| {
            s.batch.microbatches = Some(1);
            s.batch.global_batch = None;
        })
    }
}

/// Parses `0-5,6-11` (a single layer may be written `7`).
pub fn parse_stage_ranges(text: &str) -> std::result::Result<Vec<(usize, usize)>, String> {
    text.split(',')
        .map(|part| {
            let part = part.trim();
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let parse = |x: &str| x.trim().parse::<usize>().map_err(|_| format!("`{part}` is not a layer range like 0-5"));
            Ok((parse(a)?, parse(b)?))
        })
        .collect()
}

impl StepArgs {
    /// The pipeline options these arguments ask for, for `spec` on `mesh`.
    pub fn compile_options(&self, spec: &Spec, mesh: shardc_ir::mesh::Mesh) -> Result<CompileOptions> {
        let recompute = Recompute::parse(&self.strategy.recompute).ok_or_else(|| miette!(help = "use none, full or selective-attention", "--recompute: unknown policy `{}`", self.strategy.recompute))?;
        if !(self.training.lr > 0.0 && self.training.lr.is_finite()) {
            return Err(miette!(help = "a typical value is 3e-3 for the tiny models, 6e-4 for GPT-2", "--lr must be positive, got {}", self.training.lr));
        }
        let optimizer = match self.training.optimizer.as_str() {
            "adamw" => OptimizerKind::adamw(self.training.lr),
            "sgd" => OptimizerKind::Sgd { lr: self.training.lr, weight_decay: 0.0 },
            other => {
                return Err(miette!(help = "use adamw or sgd", "--optimizer: unknown optimizer `{other}`"));
            }
        };
        if self.strategy.zero > 3 {
            return Err(miette!(help = "use 0, 1, 2 or 3", "--zero: there is no ZeRO stage {}", self.strategy.zero));
        }
        if self.strategy.zero > 0 && mesh.dp == 1 {
            return Err(miette!(help = "add data parallelism (--mesh dp=2 or more), or leave --zero out", "--zero {} shards optimizer state over the data-parallel ranks, and --mesh {mesh} has one (dp=1)", self.strategy.zero));
        }
        if self.strategy.sequence_parallel && mesh.tp == 1 {
            return Err(miette!(help = "add tensor parallelism (--mesh tp=2 or more), or leave --sequence-parallel out", "--sequence-parallel splits the sequence over the tensor-parallel ranks, and --mesh {mesh} has one (tp=1)"));
        }
        if self.strategy.sequence_parallel && mesh.cp > 1 && !spec.seq_len().is_multiple_of(mesh.tp * mesh.cp) {
            return Err(miette!(
                help = format!("use a sequence that is a multiple of {} (--seq), or leave --sequence-parallel out", mesh.tp * mesh.cp),
                "--sequence-parallel splits each cp rank's part of the sequence over tp, and tp={} x cp={} does not divide the sequence of {}",
                mesh.tp,
                mesh.cp,
                spec.seq_len()
            ));
        }
        if self.strategy.naive_partition && mesh.tp == 1 {
            return Err(miette!(help = "add tensor parallelism (--mesh tp=2 or more), or leave --naive-partition out", "--naive-partition changes how the tensor-parallel ranks split the layers, and --mesh {mesh} has one (tp=1)"));
        }
        let schedule = self.lr_schedule()?;
        if !(self.training.clip_grad.is_finite() && self.training.clip_grad >= 0.0) {
            return Err(miette!(help = "Megatron-LM's default is 1.0; 0 turns clipping off", "--clip-grad must be a finite number >= 0, got {}", self.training.clip_grad));
        }
        // The update runs in f32 unless the whole model is f64: a value that f32 rounds to 0
        // or infinity would train without updating, or blow up, without a word.
        if spec.model.dtype != shardc_ir::spec::SpecDType::F64 {
            let range = f32::MIN_POSITIVE as f64..=f32::MAX as f64;
            for (flag, value) in [("--lr", self.training.lr), ("--clip-grad", self.training.clip_grad)] {
                if value != 0.0 && !range.contains(&value) {
                    return Err(miette!(
                        help = format!("use a value between {:.3e} and {:.3e}, or train in f64 (`dtype = \"f64\"` in the spec)", range.start(), range.end()),
                        "{flag} {value:e} is outside the range of f32, the type the optimizer update computes in"
                    ));
                }
            }
        }
        let context_attention = match &self.strategy.cp_attention {
            None => shardc_passes::sharding::ContextAttention::Auto,
            Some(_) if mesh.cp == 1 => {
                return Err(miette!(help = "add context parallelism (--mesh cp=2 or more), or leave --cp-attention out", "--cp-attention chooses how context-parallel ranks attend, and --mesh {mesh} has none (cp=1)"));
            }
            Some(text) => shardc_passes::sharding::ContextAttention::parse(text).ok_or_else(|| miette!(help = "use all-gather, ring or auto", "--cp-attention: unknown form `{text}`"))?,
        };
        let pipeline = self.pipeline_options(spec, mesh)?;
        // Shifted, 2^44 MiB and more wrapped to 0 bytes: one all-reduce per gradient.
        let grad_bucket_mb = self.strategy.grad_bucket_mb.unwrap_or(DEFAULT_GRAD_BUCKET_MB);
        let grad_bucket_bytes = grad_bucket_mb.checked_mul(1 << 20).ok_or_else(|| miette!(help = "Megatron-LM's default bucket is 40 MiB; 0 reduces each gradient on its own", "--grad-bucket-mb {grad_bucket_mb} is more bytes than a bucket can count"))?;
        Ok(CompileOptions {
            recompute,
            optimizer,
            schedule,
            clip_grad: self.training.clip_grad,
            mesh,
            vocab: spec.model.padded_vocab(mesh.tp) as i64,
            kv_heads: spec.model.kv_heads() as i64,
            zero: self.strategy.zero,
            sequence_parallel: self.strategy.sequence_parallel,
            grad_bucket_bytes,
            pipeline,
            naive_partition: self.strategy.naive_partition,
            comm_opt: !self.strategy.no_comm_opt,
            cluster: self.cluster_model()?,
            context_attention,
        })
    }

    /// The learning-rate schedule of --lr-warmup-steps, --lr-decay, --lr-decay-steps and
    /// --min-lr (the peak is --lr).
    pub fn lr_schedule(&self) -> Result<Schedule> {
        // Iterations are i32 in the compiled step.
        let limit = i32::MAX as u64;
        if self.training.lr_warmup_steps > limit {
            return Err(miette!(help = format!("use at most {limit}"), "--lr-warmup-steps {} is more iterations than a step counter holds", self.training.lr_warmup_steps));
        }
        let min_lr = self.training.min_lr.unwrap_or(self.training.lr / 10.0);
        if !(min_lr.is_finite() && min_lr >= 0.0 && min_lr <= self.training.lr) {
            return Err(miette!(help = format!("use a value between 0 and --lr ({})", self.training.lr), "--min-lr {min_lr} is outside 0..=--lr"));
        }
        let decay_steps = self.training.lr_decay_steps.unwrap_or(0);
        // A constant rate has no decay to take steps or a floor.
        if self.training.lr_decay.as_deref() == Some("constant") {
            for (flag, given) in [("--min-lr", self.training.min_lr.is_some()), ("--lr-decay-steps", self.training.lr_decay_steps.is_some_and(|n| n > 0))] {
                if given {
                    return Err(miette!(help = "give --lr-decay cosine or linear to decay, or leave it out", "{flag}: --lr-decay constant keeps the rate at --lr after the warmup"));
                }
            }
        }
        // Without decay steps there is no decay: its shape and floor would be ignored.
        if decay_steps == 0 {
            for (flag, given) in [("--lr-decay", self.training.lr_decay.as_deref().is_some_and(|d| d != "constant")), ("--min-lr", self.training.min_lr.is_some())] {
                if given {
                    return Err(miette!(help = "add --lr-decay-steps N (run's default is --steps)", "{flag} shapes a decay, and there is none without --lr-decay-steps"));
                }
            }
        }
        let cosine = match self.training.lr_decay.as_deref().unwrap_or("cosine") {
            "cosine" => true,
            "linear" => false,
            "constant" => return Ok(Schedule { warmup_steps: self.training.lr_warmup_steps as i64, ..Schedule::CONSTANT }),
            other => return Err(miette!(help = "use cosine, linear or constant", "--lr-decay: unknown decay `{other}`")),
        };
        if decay_steps > limit {
            return Err(miette!(help = format!("use at most {limit}"), "--lr-decay-steps {decay_steps} is more iterations than a step counter holds"));
        }
        if decay_steps > 0 && decay_steps <= self.training.lr_warmup_steps {
            return Err(miette!(
                help = "make --lr-decay-steps larger than --lr-warmup-steps, or use --lr-decay constant",
                "--lr-decay-steps {decay_steps} must exceed --lr-warmup-steps {}",
                self.training.lr_warmup_steps
            ));
        }
        Ok(Schedule { warmup_steps: self.training.lr_warmup_steps as i64, decay_steps: decay_steps as i64, min_lr, cosine })
    }

    /// The cluster model: `--cluster FILE` if given, else the `--gpu` preset.
    pub fn cluster_model(&self) -> Result<shardc_ir::cluster::Cluster> {
        use shardc_ir::cluster::{Cluster, GPU_PRESETS};
        match &self.hardware.cluster {
            Some(path) => {
                let text = crate::input::read_text("--cluster", path, crate::input::MAX_TEXT_BYTES)?;
                Cluster::from_toml(&text).map_err(|e| miette!(help = "see the cluster fields in ir/src/cluster.rs", "--cluster {}: {e}", path.display()))
            }
            None => {
                let gpu = self.hardware.gpu.as_deref().unwrap_or("h100-sxm");
                Cluster::preset(gpu).ok_or_else(|| miette!(help = format!("use one of {}", GPU_PRESETS.join(", ")), "--gpu: unknown GPU `{gpu}`"))
            }
        }
    }

    /// Whether the user named the hardware (`--gpu` or `--cluster`): plans must then fit it.
    pub fn hardware_given(&self) -> bool {
        self.hardware.gpu.is_some() || self.hardware.cluster.is_some()
    }

    /// The schedule `--schedule` names.
    pub fn schedule_kind(&self) -> Result<shardc_runtime::schedule::Kind> {
        shardc_runtime::schedule::Kind::parse(&self.strategy.schedule).ok_or_else(|| miette!(help = "use gpipe, 1f1b, interleaved or zb-h1", "--schedule: unknown schedule `{}`", self.strategy.schedule))
    }

    /// The pipeline schedule these arguments ask for, when the step has stages or
    /// micro-batches.
    pub fn schedule(&self, spec: &Spec, mesh: shardc_ir::mesh::Mesh) -> Result<Option<shardc_runtime::schedule::Schedule>> {
        let Some(stages) = self.pipeline_options(spec, mesh)? else { return Ok(None) };
        shardc_runtime::schedule::generate(self.schedule_kind()?, mesh.pp as usize, stages.microbatches, stages.chunks)
            .map(Some)
            .map_err(|e| miette!(help = "check --mesh pp=, --microbatches and --virtual-stages", "{e}"))
    }

    /// The step's batch on `mesh`: micro-batch per replica, dp, micro-batches and global
    /// batch, from the spec and `--micro-batch`, `--microbatches`, `--global-batch`.
    pub fn batch(&self, spec: &Spec, mesh: shardc_ir::mesh::Mesh) -> Result<spec::Batch> {
        if let Some(m) = self.batch.microbatches
            && (m == 0 || m > 4096)
        {
            return Err(miette!(help = "use 1 to 4096 micro-batches", "--microbatches must be between 1 and 4096, got {m}"));
        }
        let batch = spec.batch(mesh.dp, self.batch.microbatches, self.batch.global_batch).map_err(|e| miette!(help = e.help.clone().unwrap_or_default(), "{}", e.message))?;
        if batch.microbatches > 4096 {
            return Err(miette!(
                help = format!("use a larger --micro-batch or a smaller --global-batch (global {} / (micro-batch {} x dp {}))", batch.global_batch, batch.micro_batch, batch.dp),
                "{} micro-batches per step is more than the 4096 supported",
                batch.microbatches
            ));
        }
        Ok(batch)
    }

    /// Micro-batches per step on `mesh` (see [`StepArgs::batch`]).
    pub fn microbatches(&self, spec: &Spec, mesh: shardc_ir::mesh::Mesh) -> Result<u64> {
        Ok(self.batch(spec, mesh)?.microbatches)
    }

    /// Stages and micro-batches, when the step is pipelined or accumulates gradients.
    fn pipeline_options(&self, spec: &Spec, mesh: shardc_ir::mesh::Mesh) -> Result<Option<shardc_passes::PipelineOptions>> {
        use shardc_runtime::schedule::Kind;
        let kind = self.schedule_kind()?;
        // Interleaving spreads model chunks over pipeline ranks; on one rank its first and last
        // chunk would wait on each other (a tied embedding's gradient and update).
        if kind == Kind::Interleaved && mesh.pp == 1 {
            return Err(miette!(
                help = "use --schedule 1f1b (or gpipe) to accumulate gradients on one pipeline rank, or add pipeline ranks with --mesh pp=N",
                "--schedule interleaved interleaves model chunks over pipeline ranks, and --mesh {mesh} has one (pp=1)"
            ));
        }
        let chunks = match (kind, self.strategy.virtual_stages) {
            (Kind::Interleaved, v) => v.unwrap_or(2),
            (_, None) => 1,
            (_, Some(v)) => return Err(miette!(help = "add --schedule interleaved, or leave --virtual-stages out", "--virtual-stages {v} splits ranks into chunks for the interleaved schedule, and the schedule is {}", self.strategy.schedule)),
        };
        let m = self.microbatches(spec, mesh)?;
        if mesh.pp == 1 && m == 1 && self.strategy.stages.is_none() {
            if kind != Kind::OneFOneB {
                return Err(miette!(
                    help = "add pipeline ranks (--mesh pp=N) or micro-batches (--microbatches M), or leave --schedule out",
                    "--schedule {} orders micro-batches over pipeline stages, and this step has one micro-batch and --mesh {mesh} one stage (pp=1)",
                    self.strategy.schedule
                ));
            }
            return Ok(None);
        }
        if chunks == 0 || chunks > 64 {
            return Err(miette!(help = "use 2 to 4 virtual stages per rank", "--virtual-stages must be between 1 and 64, got {chunks}"));
        }
        if kind == Kind::Interleaved && m % mesh.pp != 0 {
            return Err(miette!(help = format!("use a multiple of pp={} micro-batches", mesh.pp), "--microbatches {m}: interleaved 1F1B needs a multiple of pp"));
        }
        if mesh.pp == 1 && self.strategy.stages.is_some() {
            return Err(miette!(help = "add pipeline ranks with --mesh pp=N, or leave --stages out", "--stages splits the layers over pipeline stages, and --mesh {mesh} has one (pp=1)"));
        }
        let manual = match &self.strategy.stages {
            Some(text) => Some(parse_stage_ranges(text).map_err(|e| miette!(help = "write one layer range per stage, e.g. --stages 0-5,6-11", "--stages: {e}"))?),
            None => None,
        };
        Ok(Some(shardc_passes::PipelineOptions { chunks: chunks as usize, microbatches: m as usize, manual, split_weight_grads: kind == Kind::ZeroBubble }))
    }

    /// The Hugging Face folder the model comes from: `--hf`, or a spec path that is such a
    /// folder.
    pub fn hf_dir(&self, path: Option<&Path>) -> Option<PathBuf> {
        self.model.hf.clone().or_else(|| path.filter(|p| p.join("config.json").is_file()).map(Path::to_path_buf))
    }

    /// Loads a spec (or a Hugging Face config) and applies `--seq` / `--micro-batch` /
    /// `--dtype`.
    pub fn load_spec(&self, path: Option<&Path>) -> Result<Spec> {
        // With a Hugging Face folder: its config, and the family that names its keys.
        let mut hf = None;
        if let (Some(dir), Some(path)) = (&self.model.hf, path) {
            return Err(miette!(
                help = "give the spec file or --hf DIR, not both",
                "--hf {} and the spec {} both name the model",
                dir.display(),
                path.display()
            ));
        }
        let mut spec = match (self.hf_dir(path), path) {
            (Some(dir), _) => {
                let config = dir.join("config.json");
                let text = crate::input::read_text("--hf", &config, crate::input::MAX_TEXT_BYTES)?;
                let name = dir.file_name().map_or_else(|| "hf-model".into(), |n| n.to_string_lossy().to_string());
                let (spec, family) = spec::hf::from_hf_config(&text, &name, self.batch.seq.unwrap_or(128), self.batch.micro_batch.unwrap_or(1))
                    .map_err(|e| miette!(help = "shardc reads GPT-2 and Llama configurations", "{}: {e}", dir.display()))?;
                hf = Some((config, family));
                spec
            }
            (None, Some(path)) => spec::parse_file(path).map_err(report::spec_report)?,
            (None, None) => return Err(miette!(help = "give a spec file (models/tiny.toml) or --hf DIR", "no model given")),
        };
        if let Some(seq) = self.batch.seq {
            spec.training.seq_len = Some(seq);
            // Rotary positions are computed, not looked up: a longer sequence extends them
            // (as long-context training raises max_position_embeddings); a learned table
            // has the rows it has.
            if spec.model.positions == spec::Positions::Rope && seq > spec.model.max_seq {
                eprintln!("note: a sequence of {seq} extends the model's max_seq of {} (rotary positions)", spec.model.max_seq);
                spec.model.max_seq = seq;
            }
        }
        if let Some(mb) = self.batch.micro_batch {
            spec.training.micro_batch = mb;
        }
        match (self.batch.global_batch, self.batch.microbatches) {
            (Some(global), _) => spec.training.global_batch = Some(global),
            // `--microbatches` alone sets the global batch (micro-batch x dp x micro-batches).
            (None, Some(_)) => spec.training.global_batch = None,
            (None, None) => {}
        }
        if let Some(dtype) = &self.model.dtype {
            spec.model.dtype = match dtype.as_str() {
                "f32" => spec::SpecDType::F32,
                "bf16" => spec::SpecDType::Bf16,
                "f64" => spec::SpecDType::F64,
                other => return Err(miette!(help = "use f32, bf16 or f64", "--dtype: unknown element type `{other}`")),
            };
        }
        let errors = spec::check(&spec);
        if let Some(e) = errors.first() {
            return Err(self.check_report(e, hf.as_ref().map(|(config, family)| (config.as_path(), *family))));
        }
        Ok(spec)
    }

    /// The flags given that change a loaded spec or config (`--seq`, `--micro-batch`,
    /// `--global-batch`, `--microbatches`, `--dtype`).
    fn overrides_given(&self) -> Vec<&'static str> {
        [
            ("--seq", self.batch.seq.is_some()),
            ("--micro-batch", self.batch.micro_batch.is_some()),
            ("--global-batch", self.batch.global_batch.is_some()),
            ("--microbatches", self.batch.microbatches.is_some()),
            ("--dtype", self.model.dtype.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }

    /// A spec check's error on the loaded model, in the words of where its values came from:
    /// a Hugging Face config's field by its key in `config.json`, and the command-line
    /// overrides only when some were given.
    fn check_report(&self, e: &spec::SpecError, hf: Option<(&Path, spec::hf::HfFamily)>) -> miette::Report {
        let keys = hf.map_or_else(Vec::new, |(_, family)| hf_config_keys(family));
        // Spec field names in the message and help become the config's keys.
        let rename = |text: &str| keys.iter().fold(text.to_string(), |text, (ours, theirs)| text.replace(ours, &format!("`{theirs}`")));
        let overrides = self.overrides_given();
        let subject = match (hf, keys.iter().find(|(ours, _)| *ours == e.field)) {
            (Some((config, _)), Some((_, key))) => format!("{}: `{key}`", config.display()),
            _ if e.field.is_empty() => String::new(),
            _ => match [("training.seq_len", "--seq"), ("training.micro_batch", "--micro-batch"), ("training.global_batch", "--global-batch")].iter().find(|(field, flag)| *field == e.field && overrides.contains(flag)) {
                Some((field, flag)) => format!("{field} ({flag})"),
                None => e.field.clone(),
            },
        };
        let subject = if subject.is_empty() { String::new() } else { format!("{subject}: ") };
        // A subject naming the one flag given says it already.
        let named = overrides.len() == 1 && subject.contains(&format!("({})", overrides[0]));
        let context = if overrides.is_empty() || named { String::new() } else { format!(" (with {} given)", overrides.join(", ")) };
        miette!(help = rename(e.help.as_deref().unwrap_or_default()), "{subject}{}{context}", rename(&e.message))
    }
}

/// The `config.json` key of each spec field a Llama (and Mixtral) config sets.
const LLAMA_CONFIG_KEYS: &[(&str, &str)] = &[
    ("model.vocab", "vocab_size"),
    ("model.max_seq", "max_position_embeddings"),
    ("model.hidden", "hidden_size"),
    ("model.layers", "num_hidden_layers"),
    ("model.kv_heads", "num_key_value_heads"),
    ("model.heads", "num_attention_heads"),
    ("model.ffn_hidden", "intermediate_size"),
    ("model.norm_eps", "rms_norm_eps"),
    ("model.rope_theta", "rope_theta"),
    ("model.tied_embeddings", "tie_word_embeddings"),
];

/// The `config.json` key of each spec field a Hugging Face config of `family` sets.
fn hf_config_keys(family: spec::hf::HfFamily) -> Vec<(&'static str, &'static str)> {
    match family {
        spec::hf::HfFamily::Gpt2 => vec![
            ("model.vocab", "vocab_size"),
            ("model.max_seq", "n_positions"),
            ("model.hidden", "n_embd"),
            ("model.layers", "n_layer"),
            // GPT-2 has no grouped-query attention: its kv heads are its heads.
            ("model.kv_heads", "n_head"),
            ("model.heads", "n_head"),
            ("model.ffn_hidden", "n_inner"),
            ("model.norm_eps", "layer_norm_epsilon"),
            ("model.tied_embeddings", "tie_word_embeddings"),
        ],
        spec::hf::HfFamily::Llama => LLAMA_CONFIG_KEYS.to_vec(),
        spec::hf::HfFamily::Mixtral => {
            let moe = [("model.moe.experts", "num_local_experts"), ("model.moe.top_k", "num_experts_per_tok"), ("model.moe.aux_loss_weight", "router_aux_loss_coef")];
            LLAMA_CONFIG_KEYS.iter().copied().chain(moe).collect()
        }
    }
}
