//! shardc's passes and the pipeline that runs them.
//!
//! A pass rewrites a [`shardc_ir::Module`] (owned data). The [`Pipeline`] runs passes in the
//! order written, and after every pass checks the result twice, with our structural verifier
//! (SSA form, every `xf` shape rule) and with MLIR's verifier on the emitted module (IRDL
//! constraints, `shard` op rules); a failure there is a bug in the pass, reported as
//! [`PassError::Internal`]. It hands the IR after each pass to an observer, which is how the
//! CLI implements `--print-ir-after-all`, `--print-ir-after=NAME` and `--dump-dir`.
//!
//! This crate does no IO.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod autodiff;
mod optimizer;
mod pipeline;
mod verify_pass;

pub use autodiff::{differentiate, Autodiff, Recompute};
pub use optimizer::{Optimizer, OptimizerKind};
pub use pipeline::{Changed, Pass, PassError, PassRecord, Pipeline, PipelineReport};
pub use verify_pass::VerifyShapes;

/// Options of the compile pipeline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompileOptions {
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Update rule of the training step.
    pub optimizer: OptimizerKind,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions { recompute: Recompute::None, optimizer: OptimizerKind::adamw(1e-3) }
    }
}

/// The pipeline `shardc compile` runs, in order. Later stages (sharding, pipeline stages,
/// communication optimisation) are added here as straight-line code.
pub fn compile_pipeline(options: &CompileOptions) -> Pipeline {
    Pipeline::new()
        .then(VerifyShapes)
        .then(Autodiff { recompute: options.recompute })
        .then(Optimizer { kind: options.optimizer })
}
