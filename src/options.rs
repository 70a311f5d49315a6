//! Options shared by the commands that compile a spec: overrides of the spec's step shape,
//! and the training-step options.

use std::path::{Path, PathBuf};

use clap::Args;
use miette::{miette, Result};
use shardc_ir::spec::{self, Spec};
use shardc_passes::{CompileOptions, OptimizerKind, Recompute};

use crate::report;

/// How to build the training step.
#[derive(Args, Debug, Clone)]
pub struct StepArgs {
    /// Override the spec's training.seq_len.
    #[arg(long)]
    pub seq: Option<u64>,
    /// Override the spec's training.micro_batch.
    #[arg(long)]
    pub micro_batch: Option<u64>,
    /// Activation recomputation: none, full or selective-attention.
    #[arg(long, default_value = "none")]
    pub recompute: String,
    /// Optimizer: adamw or sgd.
    #[arg(long, default_value = "adamw")]
    pub optimizer: String,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// ZeRO stage with data parallelism: 1-2 shard optimizer state over dp (gradients are
    /// reduce-scattered into the shards), 3 shards parameters too.
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Sequence parallelism: split the residual stream and norms along the sequence over tp.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Data-parallel gradient bucket size in MiB (0: one synchronous all-reduce per gradient).
    #[arg(long, default_value_t = 25)]
    pub grad_bucket_mb: u64,
}

impl StepArgs {
    /// The pipeline options these arguments ask for, for `spec` on `mesh`.
    pub fn compile_options(&self, spec: &Spec, mesh: shardc_ir::mesh::Mesh) -> Result<CompileOptions> {
        let recompute = Recompute::parse(&self.recompute)
            .ok_or_else(|| miette!(help = "use none, full or selective-attention", "--recompute: unknown policy `{}`", self.recompute))?;
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err(miette!(help = "a typical value is 3e-3 for the tiny models, 6e-4 for GPT-2", "--lr must be positive, got {}", self.lr));
        }
        let optimizer = match self.optimizer.as_str() {
            "adamw" => OptimizerKind::adamw(self.lr),
            "sgd" => OptimizerKind::Sgd { lr: self.lr, weight_decay: 0.0 },
            other => return Err(miette!(help = "use adamw or sgd", "--optimizer: unknown optimizer `{other}`")),
        };
        if self.zero > 3 {
            return Err(miette!(help = "use 0, 1, 2 or 3", "--zero: there is no ZeRO stage {}", self.zero));
        }
        Ok(CompileOptions { recompute, optimizer, mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, zero: self.zero, sequence_parallel: self.sequence_parallel, grad_bucket_bytes: self.grad_bucket_mb << 20 })
    }

    /// Loads a spec and applies `--seq` / `--micro-batch`.
    pub fn load_spec(&self, path: &Path) -> Result<Spec> {
        let mut spec = spec::parse_file(path).map_err(report::spec_report)?;
        if let Some(seq) = self.seq {
            spec.training.seq_len = Some(seq);
        }
        if let Some(mb) = self.micro_batch {
            spec.training.micro_batch = mb;
        }
        let errors = spec::check(&spec);
        if let Some(e) = errors.first() {
            return Err(miette!(help = e.help.clone().unwrap_or_default(), "with the command-line overrides, {e}"));
        }
        Ok(spec)
    }
}

/// Where the default corpus lives, relative to the repository.
pub fn default_corpus() -> PathBuf {
    PathBuf::from("data/kjv-genesis-exodus.txt")
}
