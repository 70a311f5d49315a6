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
mod comm_opt;
mod optimizer;
mod pipeline;
pub mod sharding;
mod stages;
mod verify_pass;

pub use autodiff::{Autodiff, Recompute, differentiate};
pub use comm_opt::{optimize as optimize_communication, price as price_communication, CommOpt, CommOptReport};
pub use optimizer::{Optimizer, OptimizerKind, Schedule};
pub use pipeline::{Changed, Pass, PassError, PassRecord, Pipeline, PipelineReport};
pub use stages::{SplitStages, balance, balance_tied, op_time};
pub use verify_pass::VerifyShapes;

/// Options of the compile pipeline.
#[derive(Clone, Debug, PartialEq)]
pub struct CompileOptions {
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Update rule of the training step.
    pub optimizer: OptimizerKind,
    /// Learning-rate schedule (the peak is the optimizer's `lr`).
    pub schedule: Schedule,
    /// Largest global gradient norm; 0 turns clipping off.
    pub clip_grad: f64,
    /// The device mesh; with more than one rank the sharding passes run.
    pub mesh: shardc_ir::mesh::Mesh,
    /// Vocabulary size and key/value heads of the model, for the sharding strategy.
    pub vocab: i64,
    /// Key/value heads of the model.
    pub kv_heads: i64,
    /// ZeRO stage (0 to 3).
    pub zero: u8,
    /// Sequence parallelism over the tensor-parallel axis.
    pub sequence_parallel: bool,
    /// Largest data-parallel gradient bucket in bytes (0: no buckets, synchronous syncs).
    pub grad_bucket_bytes: u64,
    /// Pipeline stages and micro-batches; `None`: one micro-batch per step, no stages.
    pub pipeline: Option<PipelineOptions>,
    /// Start from a deliberately naive partitioning (every column-parallel matmul's result
    /// gathered), to see what the communication optimizer recovers.
    pub naive_partition: bool,
    /// Rewrite the partitioned step's collectives to the cheapest equivalent (`comm-opt`).
    pub comm_opt: bool,
    /// The cluster that prices communication and compute.
    pub cluster: shardc_ir::cluster::Cluster,
    /// Context parallelism's attention: keys and values all-gathered, a ring, or the cheaper.
    pub context_attention: sharding::ContextAttention,
}

/// How the training step is cut into pipeline stages and micro-batches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineOptions {
    /// Model chunks per pipeline rank (interleaved schedules), 1 otherwise.
    pub chunks: usize,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub microbatches: usize,
    /// Layer ranges per stage, overriding the cost balance.
    pub manual: Option<Vec<(usize, usize)>>,
    /// Split backward sections into input and weight gradients (zero-bubble schedules).
    pub split_weight_grads: bool,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            recompute: Recompute::None,
            optimizer: OptimizerKind::adamw(1e-3),
            schedule: Schedule::CONSTANT,
            clip_grad: 1.0,
            mesh: shardc_ir::mesh::Mesh::default(),
            vocab: 1,
            kv_heads: 1,
            zero: 0,
            sequence_parallel: false,
            grad_bucket_bytes: 25 << 20,
            pipeline: None,
            naive_partition: false,
            comm_opt: true,
            context_attention: sharding::ContextAttention::Auto,
            cluster: shardc_ir::cluster::Cluster::default(),
        }
    }
}

/// The pipeline `shardc compile` runs, in order, as straight-line code. The sharding passes
/// run only for meshes of more than one rank.
pub fn compile_pipeline(options: &CompileOptions) -> Pipeline {
    let tp = options.mesh.tp as i64;
    let mut pipeline = Pipeline::new().then(VerifyShapes);
    if tp > 1 && options.kv_heads % tp != 0 {
        pipeline = pipeline.then(sharding::ExpandKvHeads { tp });
    }
    let pipeline = pipeline.then(Autodiff { recompute: options.recompute }).then(Optimizer { kind: options.optimizer, schedule: options.schedule, clip_grad: options.clip_grad });
    if options.mesh.ranks() <= 1 && options.pipeline.is_none() {
        return pipeline;
    }
    let pipeline = pipeline
        .then(sharding::ShardMegatron {
            mesh: options.mesh,
            zero: options.zero,
            sequence_parallel: options.sequence_parallel,
            vocab: options.vocab,
            kv_heads: options.kv_heads,
            naive: options.naive_partition,
        })
        .then(sharding::PropagateSharding)
        .then(sharding::GroupNormSums)
        .then(sharding::Partition);
    // With pipeline stages the optimizer stays out: merging equal values is common
    // subexpression elimination, which would share values across stage boundaries.
    let optimize_comm = options.comm_opt && options.pipeline.is_none();
    let pipeline = if optimize_comm { pipeline.then(CommOpt { cluster: options.cluster.clone(), ..CommOpt::default() }) } else { pipeline };
    let pipeline = if options.mesh.cp > 1 { pipeline.then(sharding::RingAttention { policy: options.context_attention, cluster: options.cluster.clone(), overlap: options.pipeline.is_none() }) } else { pipeline };
    if let Some(stages) = &options.pipeline {
        // Gradient syncs run once per global batch on the accumulated gradients, in the
        // stages' step sections.
        let pipeline = pipeline.then(SplitStages {
            ranks: options.mesh.pp as usize,
            chunks: stages.chunks,
            microbatches: stages.microbatches,
            manual: stages.manual.clone(),
            split_weight_grads: stages.split_weight_grads,
        });
        // Those syncs travel in buckets that start once a chunk's backward work is done.
        let pipeline = if options.mesh.dp > 1 && options.grad_bucket_bytes > 0 { pipeline.then(sharding::BucketStepGradients { bucket_bytes: options.grad_bucket_bytes }) } else { pipeline };
        // Within each forward, backward and weight section, a collective runs behind the
        // compute after it (sequence parallelism's reduce-scatters behind the weight
        // gradients' GEMMs, ZeRO-3's gathers ahead of their layers).
        return pipeline.then(sharding::OverlapCollectives { prefetch_bytes: options.grad_bucket_bytes });
    }
    let pipeline = if options.mesh.dp > 1 && options.grad_bucket_bytes > 0 { pipeline.then(sharding::BucketGradients { bucket_bytes: options.grad_bucket_bytes }) } else { pipeline };
    // Parameter gathers run ahead by up to a gradient bucket's bytes.
    pipeline.then(sharding::OverlapCollectives { prefetch_bytes: options.grad_bucket_bytes })
}

/// The passes for inference (`@logits` from [`shardc_ir::spec::lower_logits`]): checked, then
/// with a mesh of several ranks split like the training step (tensor parallelism as Megatron,
/// the batch over dp) with the logits gathered whole on every rank. A `pp` axis runs replicas.
pub fn inference_pipeline(options: &CompileOptions) -> Pipeline {
    let tp = options.mesh.tp as i64;
    let mut pipeline = Pipeline::new().then(VerifyShapes);
    if tp > 1 && options.kv_heads % tp != 0 {
        pipeline = pipeline.then(sharding::ExpandKvHeads { tp });
    }
    if options.mesh.ranks() <= 1 {
        return pipeline;
    }
    pipeline
        .then(sharding::ShardMegatron {
            mesh: options.mesh,
            zero: 0,
            sequence_parallel: options.sequence_parallel,
            vocab: options.vocab,
            kv_heads: options.kv_heads,
            naive: false,
        })
        .then(sharding::PropagateSharding)
        .then(sharding::Partition)
}
