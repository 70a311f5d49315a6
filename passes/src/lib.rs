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

mod pipeline;
mod verify_pass;

pub use pipeline::{Changed, Pass, PassError, PassRecord, Pipeline, PipelineReport};
pub use verify_pass::VerifyShapes;

/// The pipeline `shardc compile` runs. Later stages (autodiff, sharding, pipeline stages,
/// communication optimisation) are added here, in order, as straight-line code.
pub fn compile_pipeline() -> Pipeline {
    Pipeline::new().then(VerifyShapes)
}
