//! The rank program: the serialized, versioned contract between codegen and runtimes.
//!
//! Buffers are numbered; each lives in a storage slot. Arguments and results are named
//! buffers (`layers.0.attn.q.weight`, `loss`). Temporaries share slots according to the
//! memory plan, which codegen computed from liveness: two buffers share a slot only when their
//! lifetimes do not overlap. An instruction may name the same buffer as input and output when
//! its op updates in place (optimizer steps); such kernels read the old value from the output.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Bumped whenever the format changes incompatibly. 2: device calls with GEMM epilogues
/// (`gemm_epilogue`), which a reader of version 1 does not know. 3: gradient bucket regions
/// in pipeline and accumulation programs (`xf.step_bucket`), which a reader of version 2
/// refuses with a message about bucket regions instead of its version. 4: attention keeps
/// its rows' log-sum-exp (`xf.attention` has two results, `xf.attention_grad` six operands)
/// and a vocab-split table's gradient holds its rank's rows (`xf.embedding_grad` with
/// `xf.row_split_axes`), which a reader of version 3 would run wrongly. 5: heads stay side by
/// side in the features (`xf.attention`, `xf.rope` and the head repeats read `[b, s, h * d]`
/// by their `head_dim`; `xf.split_heads` and `xf.merge_heads` are gone). 6: a pipeline rank's
/// kept values may live outside the arena (a temporary with no offset), in storage of each
/// micro-batch's own, which a reader of version 5 would run from null pointers.
pub const FORMAT_VERSION: u32 = 6;

/// Most elements one buffer may have: what a spec allows one tensor (2^48, see
/// `shardc_ir::spec::MAX_TENSOR_ELEMENTS`), so that a buffer's bytes and the memory plan's
/// sums stay far inside `usize`.
pub const MAX_BUFFER_ELEMENTS: usize = 1 << 48;

/// Most ranks a program's mesh may have (each mesh axis holds at most 2^20).
pub const MAX_MESH_RANKS: usize = 1 << 20;

pub use shardc_ir::types::DType;
use shardc_ir::facts::{Block, Origin};

/// Index of a buffer in [`Program::buffers`].
pub type BufferId = usize;

/// One buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Storage slot (index into [`MemoryPlan::slots`]).
    pub slot: usize,
    /// Where it comes from (the SSA value's name), for messages and `shardc inspect`.
    pub name: String,
}

impl Buffer {
    /// Number of elements (saturating: a size beyond `usize` is one no allocation meets).
    pub fn len(&self) -> usize {
        self.shape.iter().fold(1usize, |n, &d| n.saturating_mul(d))
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Role of an argument: the IR's.
pub use shardc_ir::ArgRole as Role;

/// A named argument or result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Binding {
    /// Name (`layers.0.attn.q.weight`, `tokens`, `loss`).
    pub name: String,
    /// The buffer.
    pub buffer: BufferId,
    /// Role (arguments only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// For a partitioned argument: the global tensor's shape and the grid axes splitting
    /// each of its dimensions, so a runtime can initialise the global tensor and take its
    /// rank's shard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<Layout>,
    /// For a tensor padded beyond the model's size (a vocabulary padded for tensor
    /// parallelism): the real tensor's shape, at the start of the global one. Outside the
    /// program (initial values, checkpoints, saved files) the tensor has this shape; the
    /// padding is zero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpadded: Option<Vec<usize>>,
    /// The part of the model an argument belongs to (a parameter's layer, say).
    #[serde(default, skip_serializing_if = "Block::is_unplaced")]
    pub block: Block,
}

pub use shardc_ir::facts::{master_name, master_of, state_name, state_of};

impl Binding {
    /// The shape of the tensor outside the program: its unpadded shape, or `global`.
    pub fn logical_shape(&self, global: &[usize]) -> Vec<usize> {
        self.unpadded.clone().unwrap_or_else(|| global.to_vec())
    }

    /// `values` of the tensor outside the program (its logical shape) as the program holds
    /// it globally (`global` shape): padded with zeros.
    pub fn to_program<T: Copy + Default>(&self, values: &[T], global: &[usize]) -> Vec<T> {
        match &self.unpadded {
            Some(unpadded) => crate::layout::pad(values, unpadded, global),
            None => values.to_vec(),
        }
    }

    /// The global value the program holds (`global` shape) as the tensor outside it.
    pub fn from_program<T: Copy + Default>(&self, values: &[T], global: &[usize]) -> Vec<T> {
        match &self.unpadded {
            Some(unpadded) => crate::layout::unpad(values, global, unpadded),
            None => values.to_vec(),
        }
    }
}

/// The global shape and split of a partitioned argument.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// Shape of the whole tensor.
    pub global_shape: Vec<usize>,
    /// Grid axes splitting each dimension.
    pub split: Vec<Vec<usize>>,
}

/// An attribute value of an instruction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Attr {
    /// Boolean.
    Bool(bool),
    /// Integer.
    Int(i64),
    /// Float.
    Float(f64),
    /// Integers (grid axes of a collective).
    Ints(Vec<i64>),
    /// Text (a reduction kind, a collective's cause).
    Str(String),
}

/// One instruction: a kernel call over buffers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Instr {
    /// Op name, e.g. `xf.matmul`.
    pub op: String,
    /// Attributes of the op.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: BTreeMap<String, Attr>,
    /// Input buffers.
    pub inputs: Vec<BufferId>,
    /// Output buffers.
    pub outputs: Vec<BufferId>,
    /// Model location, e.g. `layers.3.attn.q`, for people.
    pub loc: String,
    /// Where the op comes from, as facts (what estimates read in place of `loc`).
    #[serde(default, skip_serializing_if = "Origin::is_default")]
    pub origin: Origin,
}

impl Instr {
    /// An integer attribute.
    pub fn int(&self, name: &str) -> Result<i64, String> {
        match self.attrs.get(name) {
            Some(Attr::Int(v)) => Ok(*v),
            other => Err(format!("attribute `{name}`: expected an integer, got {other:?}")),
        }
    }

    /// A float attribute.
    pub fn float(&self, name: &str) -> Result<f64, String> {
        match self.attrs.get(name) {
            Some(Attr::Float(v)) => Ok(*v),
            Some(Attr::Int(v)) => Ok(*v as f64),
            other => Err(format!("attribute `{name}`: expected a float, got {other:?}")),
        }
    }

    /// An integer-list attribute.
    pub fn ints(&self, name: &str) -> Result<Vec<i64>, String> {
        match self.attrs.get(name) {
            Some(Attr::Ints(v)) => Ok(v.clone()),
            other => Err(format!("attribute `{name}`: expected integers, got {other:?}")),
        }
    }

    /// A boolean attribute.
    pub fn bool(&self, name: &str) -> Result<bool, String> {
        match self.attrs.get(name) {
            Some(Attr::Bool(v)) => Ok(*v),
            other => Err(format!("attribute `{name}`: expected a boolean, got {other:?}")),
        }
    }
}

/// Storage slots and what they add up to.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// Size of each slot in elements, and its element type.
    pub slots: Vec<(usize, DType)>,
    /// Bytes of argument buffers (parameters, optimizer state, inputs).
    pub argument_bytes: usize,
    /// Bytes of temporary slots: the peak of temporaries with reuse.
    pub temporary_bytes: usize,
    /// What temporaries would take without reuse.
    pub temporary_bytes_without_reuse: usize,
    /// The lower bound of any plan: the most bytes of temporaries alive at one instruction.
    #[serde(default)]
    pub live_bound_bytes: usize,
    /// Bytes of the one arena all temporaries live in on a device (offset-based plan).
    #[serde(default)]
    pub arena_bytes: usize,
    /// Per buffer: its byte offset in the arena (temporaries), or `None` (arguments). Two
    /// buffers overlap in the arena only if no instruction sees both alive. Empty in plans
    /// without an arena.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub offsets: Vec<Option<usize>>,
    /// Data-parallel gradient buckets laid out as one range of the arena each, so that a
    /// backend reduces a bucket with one collective over contiguous memory. Empty in plans
    /// without an arena or without buckets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buckets: Vec<BucketRegion>,
}

/// One gradient bucket's range of the arena: the outputs of its members (asynchronous
/// all-reduces of one element type, over the same grid axes) back to back, each at a 16-byte
/// boundary. The gaps between members are reduced too and never read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketRegion {
    /// The members' `xf.bucket`.
    pub bucket: i64,
    /// Element type of every member.
    pub dtype: DType,
    /// Byte offset in the arena.
    pub offset: usize,
    /// Bytes, a multiple of the element size.
    pub bytes: usize,
    /// The members' instruction indices, in program order.
    pub members: Vec<usize>,
}

impl BucketRegion {
    /// Elements the region's one collective reduces.
    pub fn len(&self) -> usize {
        self.bytes / self.dtype.bytes()
    }

    /// Whether the region holds nothing.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

/// A program for one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// Function name, e.g. `train_step`.
    pub name: String,
    /// Extent of each grid axis (dp, tp, pp); empty for a single-device program.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mesh: Vec<usize>,
    /// Every buffer.
    pub buffers: Vec<Buffer>,
    /// Arguments, in order.
    pub args: Vec<Binding>,
    /// Results, in order.
    pub results: Vec<Binding>,
    /// Instructions in execution order.
    pub instrs: Vec<Instr>,
    /// Slots and memory figures.
    pub memory: MemoryPlan,
    /// For a pipeline rank: its model chunks and their sections.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelinePlan>,
    /// For an accelerator backend: the CUDA module and each instruction's device calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DevicePlan>,
}

/// How a program runs on a CUDA device: one generated module (CUDA C, compiled by NVRTC when
/// the program is loaded) and, per instruction, the kernel launches or cuBLAS calls it takes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DevicePlan {
    /// Floating-point element type the module was generated for.
    pub dtype: DType,
    /// The CUDA C module.
    pub source: String,
    /// Bytes of scratch memory the launches need (shared by all instructions).
    pub workspace_bytes: usize,
    /// The calls of each instruction, parallel to [`Program::instrs`].
    pub calls: Vec<Vec<DeviceCall>>,
}

impl DevicePlan {
    /// The kernels the calls launch, in call order (with repeats).
    pub fn kernels(&self) -> Vec<String> {
        self.calls.iter().flatten().filter_map(|c| if let DeviceCall::Launch { kernel, .. } = c { Some(kernel.clone()) } else { None }).collect()
    }
}

/// One device call of an instruction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DeviceCall {
    /// A kernel of the module.
    Launch {
        /// `__global__` function name.
        kernel: String,
        /// Grid size.
        grid: [u32; 3],
        /// Threads per block.
        block: u32,
        /// Dynamic shared memory in bytes.
        shared_bytes: u32,
        /// Arguments in order.
        args: Vec<KernelArg>,
    },
    /// `C[b] = op(A[b]) op(B[b])`, row-major, through cuBLAS (fp32 accumulation).
    Gemm(Gemm),
    /// A GEMM whose product goes through an epilogue before it is stored: cuBLASLt's fused
    /// bias, GELU and GELU-gradient epilogues, or the GEMM then [`GEMM_EPILOGUE_KERNEL`]
    /// where cuBLASLt has no algorithm. `gemm.c` is the epilogue's result.
    GemmEpilogue {
        /// The product.
        gemm: Gemm,
        /// What is applied to it.
        epilogue: Epilogue,
    },
    /// The output takes the input's value (a device copy unless they share storage).
    Copy {
        /// Source buffer.
        from: BufferId,
        /// Destination buffer.
        to: BufferId,
    },
    /// Computed by the fused kernel of another instruction: an earlier one (an element-wise
    /// group or multi-tensor batch launches at its first member, a GEMM with an epilogue at
    /// its product), or, for a multi-tensor gradient norm, its batch's last share (when every
    /// share's gradient is made).
    Fused {
        /// That instruction.
        into: usize,
    },
    /// Run by the runtime itself: collectives, sends and receives, `tensor.empty`.
    Runtime,
}

/// The prelude's kernel that runs an [`Epilogue`] after a plain GEMM.
pub const GEMM_EPILOGUE_KERNEL: &str = "shardc_gemm_epilogue";

/// The workspace the CUDA backend gives cuBLASLt on a GPU of compute capability 9 or later
/// (NVIDIA's recommended size; [`CUBLASLT_WORKSPACE_BYTES_BEFORE_SM90`] before), once per GPU
/// that runs GEMM epilogues.
pub const CUBLASLT_WORKSPACE_BYTES: usize = 32 << 20;

/// [`CUBLASLT_WORKSPACE_BYTES`] on GPUs before compute capability 9.
pub const CUBLASLT_WORKSPACE_BYTES_BEFORE_SM90: usize = 4 << 20;

/// What a [`DeviceCall::GemmEpilogue`] applies to the product `P` (row-major, contiguous), in
/// order: `P + bias`, then the activation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Epilogue {
    /// A vector of the product's columns, added to every row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias: Option<BufferId>,
    /// The activation after the bias.
    pub activation: EpilogueActivation,
    /// [`EpilogueActivation::Gelu`]: where `P + bias` is stored too (the backward reads it);
    /// [`EpilogueActivation::GeluGrad`]: the pre-activation it reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux: Option<BufferId>,
    /// The instructions the call computes besides the GEMM (their calls are
    /// [`DeviceCall::Fused`] into it).
    pub members: Vec<usize>,
}

/// The activation of an [`Epilogue`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EpilogueActivation {
    /// None.
    None,
    /// GELU (tanh approximation).
    Gelu,
    /// `P * gelu'(aux)`.
    GeluGrad,
}

impl EpilogueActivation {
    /// The `activation` argument of [`GEMM_EPILOGUE_KERNEL`].
    pub fn code(self) -> i32 {
        match self {
            EpilogueActivation::None => 0,
            EpilogueActivation::Gelu => 1,
            EpilogueActivation::GeluGrad => 2,
        }
    }
}

/// A row-major (batched) matrix product: the op's [`Gemm`] with operand and result indices
/// replaced by buffers.
pub use shardc_ir::kernel::Gemm;

/// A kernel argument.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelArg {
    /// Device pointer of a buffer.
    Buffer(BufferId),
    /// A null pointer.
    Null,
    /// Device pointer of the scratch memory.
    Workspace,
    /// `long long`.
    Int(i64),
    /// `double`.
    Float(f64),
    /// `long long`: the first row this rank holds of a table split over the instruction's
    /// `xf.row_split_axes` / `xf.vocab_split_axes`, or the position of its first sequence row
    /// split over `xf.seq_split_axes` (0 when not split).
    RankOffset,
    /// `long long`: the sequence row of the first key of the block a ring-attention step
    /// holds ([`crate::cpu::ring_key_offset`]).
    RingKeyOffset,
}

pub use shardc_ir::facts::Phase;

/// One model chunk (pipeline stage) of a pipeline rank.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChunkPlan {
    /// The pipeline stage this chunk is.
    pub stage: usize,
    /// Instruction range `[start, end)` of each section, indexed by [`Phase`].
    pub sections: [(usize, usize); 4],
    /// Buffers the forward section makes and a later section of the same micro-batch reads.
    pub keep_forward: Vec<BufferId>,
    /// Buffers the backward section makes and the weight section reads.
    pub keep_backward: Vec<BufferId>,
    /// Buffers the backward section makes and the step reads: summed over micro-batches.
    pub sum_backward: Vec<BufferId>,
    /// Buffers the weight section makes and the step reads: summed over micro-batches.
    pub sum_weight: Vec<BufferId>,
    /// Step-section all-reduces (and reduce-scatters along dimension 0) that may start as
    /// soon as the chunk's last backward (and weight) work of the step is done, before the
    /// step section runs: each reads a summed
    /// gradient that no earlier instruction of the step section writes. Checked by
    /// [`Program::validate`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub early_syncs: Vec<usize>,
}

impl ChunkPlan {
    /// The instruction range of `section`.
    pub fn range(&self, section: Phase) -> std::ops::Range<usize> {
        let (start, end) = self.sections[section as usize];
        start..end
    }

    /// The values one micro-batch in flight keeps of `kind` outside the arena (its own
    /// storage on a device: the forward writes them there and the backward reads them there,
    /// with no copy): each buffer's byte offset in that storage, and its bytes. A buffer
    /// both lists name is kept with the forward's (its backward rewrites it there, in place,
    /// for the weight gradient).
    pub fn kept_set(&self, program: &Program, kind: KeptKind) -> (Vec<(BufferId, usize)>, usize) {
        let buffers: Vec<BufferId> = match kind {
            KeptKind::Forward => self.keep_forward.clone(),
            KeptKind::Backward => self.keep_backward.iter().copied().filter(|b| !self.keep_forward.contains(b)).collect(),
        };
        // Kept values the plan leaves in its arena stay there (a rank whose every backward
        // comes right after its forward).
        let buffers: Vec<BufferId> = buffers.into_iter().filter(|&b| program.arena_range(b).is_none()).collect();
        let mut at = 0usize;
        let placed = buffers
            .into_iter()
            .map(|b| {
                let offset = at;
                let bytes = program.buffers[b].len().saturating_mul(program.buffers[b].dtype.bytes());
                // 256-byte aligned, as the arena aligns what cuBLAS reads.
                at = offset.saturating_add(bytes.max(1).next_multiple_of(256));
                (b, offset)
            })
            .collect();
        (placed, at)
    }
}

/// Storage of a pipeline rank's kept values, pooled over its chunks and kinds: a set taken
/// for some bytes is a free one of that size, or else a new one. What the CUDA runtime
/// allocates and the estimate counts, by one rule.
#[derive(Clone, Debug, Default)]
pub struct KeptPool {
    /// Each set's (capacity in bytes, whether in use).
    sets: Vec<(usize, bool)>,
}

impl KeptPool {
    /// Takes a set of `bytes`: its index, and whether it is new.
    pub fn take(&mut self, bytes: usize) -> (usize, bool) {
        // Sets of one size only: a small need taking a large set would leave the next large
        // need to make another (pooling by size never holds more than pooling by chunk).
        let fit = self.sets.iter().position(|s| !s.1 && s.0 == bytes);
        match fit {
            Some(i) => {
                self.sets[i].1 = true;
                (i, false)
            }
            None => {
                self.sets.push((bytes, true));
                (self.sets.len() - 1, true)
            }
        }
    }

    /// Frees set `set` for a later [`KeptPool::take`].
    pub fn free(&mut self, set: usize) {
        if let Some(s) = self.sets.get_mut(set) {
            s.1 = false;
        }
    }

    /// Bytes of every set made.
    pub fn bytes(&self) -> usize {
        self.sets.iter().map(|s| s.0).fold(0, usize::saturating_add)
    }

    /// The bytes of the sets pipeline rank `program` makes running its schedule `items` in
    /// order, as the CUDA runtime takes and frees them: a forward takes a set for its kept
    /// values, its backward frees it (where the schedule splits off weight gradients, the
    /// backward takes one of its own and the weight gradient frees both).
    pub fn of_schedule(program: &Program, items: &[crate::schedule::Item]) -> usize {
        use crate::schedule::Work;
        let Some(plan) = &program.pipeline else { return 0 };
        let splits_w = items.iter().any(|i| i.work == Work::W);
        let size = |c: usize, kind: KeptKind| plan.chunks.get(c).map_or(0, |chunk| chunk.kept_set(program, kind).1);
        let mut pool = KeptPool::default();
        let mut held: std::collections::HashMap<(usize, usize, KeptKind), usize> = std::collections::HashMap::new();
        for item in items {
            let (c, j) = (item.chunk, item.microbatch);
            let (takes, frees): (&[KeptKind], &[KeptKind]) = match item.work {
                Work::F => (&[KeptKind::Forward], &[]),
                Work::B if splits_w => (&[KeptKind::Backward], &[]),
                Work::B => (&[], &[KeptKind::Forward]),
                Work::W => (&[], &[KeptKind::Forward, KeptKind::Backward]),
            };
            for &kind in takes {
                let bytes = size(c, kind);
                if bytes > 0 {
                    held.insert((c, j, kind), pool.take(bytes).0);
                }
            }
            for &kind in frees {
                if let Some(set) = held.remove(&(c, j, kind)) {
                    pool.free(set);
                }
            }
        }
        pool.bytes()
    }
}

/// Which kept values of a micro-batch a set holds: the forward's (read by its backward and
/// weight gradient) or a split backward's (read by its weight gradient).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeptKind {
    /// Kept from the forward.
    Forward = 0,
    /// Kept from the backward.
    Backward = 1,
}

/// The pipeline facts of a rank program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PipelinePlan {
    /// This program's pipeline rank (its `pp` coordinate).
    pub rank: usize,
    /// Pipeline ranks.
    pub ranks: usize,
    /// Model chunks, in chunk order (stage `rank + chunk * ranks`).
    pub chunks: Vec<ChunkPlan>,
    /// The schedule family the items come from.
    pub kind: crate::schedule::Kind,
    /// Micro-batches per optimizer step.
    pub microbatches: usize,
    /// This rank's work items of the schedule, in execution order.
    pub items: Vec<crate::schedule::Item>,
}

/// Where a step without pipeline sections makes its loss ([`Program::loss_partial`]):
/// instructions `0..end` make `buffer` on every rank and write none of the step's arguments;
/// the loss is the sum of `buffer` over the ranks of a group along mesh `axes` (none: it is
/// `buffer` itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LossPartial {
    /// The buffer each rank holds its part of the loss in.
    pub buffer: BufferId,
    /// The instructions that make it: `0..end`.
    pub end: usize,
    /// The mesh axes the loss sums it over.
    pub axes: Vec<usize>,
}

/// How two buffers share device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alias {
    /// Disjoint.
    None,
    /// The same start and element type: element `i` of one is element `i` of the other.
    Exact,
    /// Overlapping otherwise.
    Partial,
}

impl Program {
    /// The device memory of buffer `b`: (arena offset, bytes) for a temporary of an arena
    /// plan, else `None` (it has its own slot).
    pub fn arena_range(&self, b: BufferId) -> Option<(usize, usize)> {
        let offset = (*self.memory.offsets.get(b)?)?;
        let buffer = &self.buffers[b];
        Some((offset, buffer.len().saturating_mul(buffer.dtype.bytes())))
    }

    /// How buffers `a` and `b` share storage on a device: by arena range where the plan has
    /// one (a buffer outside it shares with none), else by slot.
    pub fn alias(&self, a: BufferId, b: BufferId) -> Alias {
        let (ba, bb) = (&self.buffers[a], &self.buffers[b]);
        let exact_or = |overlap: bool, same_start: bool| match (overlap, same_start && ba.dtype == bb.dtype) {
            (false, _) => Alias::None,
            (true, true) => Alias::Exact,
            (true, false) => Alias::Partial,
        };
        match (self.arena_range(a), self.arena_range(b)) {
            (Some((oa, la)), Some((ob, lb))) => exact_or(oa < ob + lb && ob < oa + la && la > 0 && lb > 0, oa == ob),
            // Outside an arena, every buffer has storage of its own (arguments, and a
            // pipeline rank's kept values); without one, buffers share typed slots.
            (None, None) if !self.memory.offsets.is_empty() => exact_or(a == b, true),
            (None, None) => exact_or(ba.slot == bb.slot, true),
            _ => Alias::None,
        }
    }

    /// The gradients step bucket region `k` reduces: its members' inputs.
    pub fn step_bucket_inputs(&self, k: usize) -> Vec<BufferId> {
        self.memory.buckets[k].members.iter().map(|&m| self.instrs[m].inputs[0]).collect()
    }

    /// Bytes of device staging a process of a multi-process (NCCL) run needs for instruction
    /// `index`, and whether it keeps them for that instruction alone: a gather or reduce-scatter
    /// along an inner dimension rearranges the group's whole tensor (NCCL's `[n][local]`) in
    /// the executor's shared staging, an asynchronous one in a buffer of its own (the transfer
    /// reads it while later instructions run), and an all-to-all stages its parts to send and
    /// to receive (twice its input). Everything else runs on the buffers themselves.
    pub fn nccl_staging_bytes(&self, index: usize) -> (usize, bool) {
        let Some(instr) = self.instrs.get(index) else { return (0, false) };
        let (Some(&input), Some(&output)) = (instr.inputs.first(), instr.outputs.first()) else { return (0, false) };
        let bytes = |b: BufferId| self.buffers[b].len().saturating_mul(self.buffers[b].dtype.bytes());
        let inner = |attr: &str| instr.int(attr).is_ok_and(|axis| self.buffers[input].shape.iter().take(axis.max(0) as usize).product::<usize>() > 1);
        let asynchronous = instr.bool("xf.async") == Ok(true);
        match instr.op.as_str() {
            "shard.all_gather" if !asynchronous && inner("gather_axis") => (bytes(output), false),
            "shard.reduce_scatter" if inner("scatter_axis") => (bytes(input), asynchronous),
            "shard.all_to_all" => (2 * bytes(input), false),
            _ => (0, false),
        }
    }

    /// Whether step bucket region `k` reduce-scatters its gradients (ZeRO; the region holds
    /// the shards) rather than all-reducing them in place.
    pub fn step_bucket_scatters(&self, k: usize) -> bool {
        self.memory.buckets[k].members.first().is_some_and(|&m| self.instrs[m].op == "shard.reduce_scatter")
    }

    /// Where, in `instructions` (a chunk's last backward work of the step), each of `chunk`'s
    /// step buckets is complete: (how many of them must have run, the region), for every
    /// region whose gradients are all made before the work's last instruction, ordered by
    /// that position, ties by region. A GPU sends each bucket there, as the layers that fill
    /// it finish (Megatron-LM's `--overlap-grad-reduce`), and the estimate prices it so.
    pub fn step_bucket_triggers(&self, chunk: &ChunkPlan, instructions: &[usize]) -> Vec<(usize, usize)> {
        let mut triggers: Vec<(usize, usize)> = (0..self.memory.buckets.len())
            .filter(|&k| self.memory.buckets[k].members.iter().all(|m| chunk.early_syncs.contains(m)))
            .filter_map(|k| {
                // After the last instruction that writes one of the bucket's gradients; a
                // gradient the work does not make leaves the bucket to the work's end.
                let last = self.step_bucket_inputs(k).iter().map(|b| instructions.iter().rposition(|&i| self.instrs[i].outputs.contains(b))).collect::<Option<Vec<usize>>>()?;
                let at = last.into_iter().max()? + 1;
                (at < instructions.len()).then_some((at, k))
            })
            .collect();
        triggers.sort_unstable();
        triggers
    }

    /// The invariant that makes starting a collective early sound: an early sync is a sum
    /// all-reduce of the chunk's step section whose input is a summed gradient
    /// (`sum_backward` / `sum_weight`), and no instruction of the step section before it
    /// writes the input's storage. Otherwise the early collective would send a value that
    /// the step section has not finished (an in-place accumulation, say).
    pub fn check_early_syncs(&self, chunk: &ChunkPlan) -> Result<(), String> {
        chunk.early_syncs.iter().try_for_each(|&index| self.early_sync_error(chunk, index).map_or(Ok(()), Err))
    }

    /// Why instruction `index` of `chunk` may not start early (see
    /// [`Program::check_early_syncs`]), or `None` when it may. Codegen chooses the early
    /// syncs with it, so the rule has one statement.
    pub fn early_sync_error(&self, chunk: &ChunkPlan, index: usize) -> Option<String> {
        let step = chunk.range(Phase::Step);
        let Some(instr) = self.instrs.get(index).filter(|_| step.contains(&index)) else {
            return Some(format!("early sync {index} is not an instruction of the step section {step:?}"));
        };
        let sum = !matches!(instr.attrs.get("reduction"), Some(Attr::Str(k)) if k != "sum");
        // A reduce-scatter along dimension 0 (ZeRO's gradient shard) keeps each rank's block
        // contiguous, so it can go out in a group with others.
        let collective = instr.op == "shard.all_reduce" || (instr.op == "shard.reduce_scatter" && instr.int("scatter_axis") == Ok(0));
        if !collective || !sum || instr.bool("xf.async").unwrap_or(false) || instr.inputs.len() != 1 {
            return Some(format!("early sync {index} ({} at {}) is not a synchronous sum all-reduce or reduce-scatter along dimension 0", instr.op, instr.loc));
        }
        let input = instr.inputs[0];
        if !chunk.sum_backward.contains(&input) && !chunk.sum_weight.contains(&input) {
            return Some(format!("early sync {index} ({}) reads `{}`, which is not a gradient summed over micro-batches", instr.loc, self.buffers[input].name));
        }
        let slot = self.buffers[input].slot;
        let writer = (step.start..index).find(|&w| self.instrs[w].outputs.iter().any(|&o| self.buffers[o].slot == slot))?;
        let w = &self.instrs[writer];
        Some(format!("early sync {index} ({}) would send `{}` before instruction {writer} ({} at {}) of the same step section writes it", instr.loc, self.buffers[input].name, w.op, w.loc))
    }

    /// The memory plan's totals against the buffers they count (a plan file edited by hand
    /// must not report, or make a device allocate, what its buffers do not need): arguments
    /// and temporaries without reuse are exact sums of buffer bytes; the peak of temporaries
    /// lies between the largest temporary and their unreused sum plus alignment padding.
    /// Buffers, slots and indices must be in range (checked first).
    /// Each bucket region lies in the arena and holds exactly its members' outputs: members
    /// are asynchronous all-reduces of that bucket, of the region's type, over one set of
    /// axes, and each member's output lies inside the region; regions alive at once do not overlap.
    fn check_bucket_regions(&self) -> Result<(), String> {
        // A pipeline rank's regions are step buckets, sent before the step section runs.
        if let Some(pipeline) = &self.pipeline {
            return self.check_step_bucket_regions(pipeline);
        }
        let mut claimed = std::collections::HashSet::new();
        for region in &self.memory.buckets {
            let name = format!("gradient bucket {}", region.bucket);
            if self.memory.offsets.is_empty() {
                return Err(format!("{name} has a region but the plan has no arena"));
            }
            let end = region.offset.checked_add(region.bytes).filter(|&e| e <= self.memory.arena_bytes).ok_or(format!("{name}'s region lies outside the arena"))?;
            if region.bytes % region.dtype.bytes() != 0 || region.members.is_empty() {
                return Err(format!("{name}'s region is not whole elements of its members"));
            }
            let mut axes = None;
            for &m in &region.members {
                let instr = self.instrs.get(m).ok_or(format!("{name} names instruction {m}, out of range"))?;
                if instr.op != "shard.all_reduce" || instr.bool("xf.async") != Ok(true) || instr.int("xf.bucket") != Ok(region.bucket) || !claimed.insert(m) {
                    return Err(format!("{name} names instruction {m} ({}), not an asynchronous all-reduce of the bucket once", instr.op));
                }
                if axes.get_or_insert_with(|| instr.ints("grid_axes").ok()) != &instr.ints("grid_axes").ok() {
                    return Err(format!("{name}'s members reduce over different axes"));
                }
                let out = *instr.outputs.first().ok_or(format!("{name}: instruction {m} has no output"))?;
                let (at, bytes) = self.arena_range(out).ok_or(format!("{name}: the output of instruction {m} is not in the arena"))?;
                if self.buffers[out].dtype != region.dtype || at < region.offset || at + bytes > end {
                    return Err(format!("{name}: the output of instruction {m} lies outside the bucket's region or has another type"));
                }
            }
            // Every wait of the bucket comes after the member that issues its collective.
            let last = region.members.iter().copied().max().unwrap_or(0);
            if let Some(w) = self.instrs[..last].iter().position(|i| i.op == "xf.wait" && i.int("xf.bucket") == Ok(region.bucket)) {
                return Err(format!("{name}: instruction {w} waits for it before its last member (instruction {last}) is sent"));
            }
        }
        // Regions may share storage only at different times (comm-opt's pairs are awaited
        // at once, long before the step's buckets): a region is alive from its first member
        // to the last reader of a member's output.
        let mut last_read = vec![0usize; self.buffers.len()];
        for (i, instr) in self.instrs.iter().enumerate() {
            for &b in &instr.inputs {
                last_read[b] = i;
            }
        }
        let mut regions: Vec<(usize, usize, usize, usize, i64)> = self
            .memory
            .buckets
            .iter()
            .map(|r| {
                let first = r.members.iter().copied().min().unwrap_or(0);
                let last = r.members.iter().map(|&m| last_read[self.instrs[m].outputs[0]].max(m)).max().unwrap_or(0);
                (r.offset, r.offset + r.bytes, first, last, r.bucket)
            })
            .collect();
        regions.sort_unstable();
        for (k, a) in regions.iter().enumerate() {
            for b in regions[k + 1..].iter().take_while(|b| b.0 < a.1) {
                if a.2 <= b.3 && b.2 <= a.3 {
                    return Err(format!("gradient bucket regions {} and {} overlap while both are alive", a.4, b.4));
                }
            }
        }
        Ok(())
    }

    /// A pipeline rank's bucket regions (`xf.step_bucket`): each lies in the arena and holds
    /// exactly its members' outputs; the members are synchronous sum all-reduces (or
    /// reduce-scatters along dimension 0, all of one kind) of that bucket over one set of
    /// axes, all early syncs of one chunk, each the only reader of its input (a backend sums
    /// the micro-batches' gradients into the region, or a buffer of its own, instead); and since
    /// the region is written from the first micro-batch on, while any section runs, no other
    /// temporary and no other region shares its storage.
    fn check_step_bucket_regions(&self, pipeline: &PipelinePlan) -> Result<(), String> {
        if self.memory.buckets.is_empty() {
            return Ok(());
        }
        if self.memory.offsets.is_empty() {
            return Err("the plan has gradient bucket regions but no arena".into());
        }
        let mut readers = vec![0usize; self.buffers.len()];
        for instr in &self.instrs {
            for &b in &instr.inputs {
                readers[b] += 1;
            }
        }
        let mut claimed = std::collections::HashSet::new();
        let mut spans: Vec<(usize, usize, i64)> = Vec::new();
        for region in &self.memory.buckets {
            let name = format!("step bucket {}", region.bucket);
            let end = region.offset.checked_add(region.bytes).filter(|&e| e <= self.memory.arena_bytes).ok_or(format!("{name}'s region lies outside the arena"))?;
            if region.bytes % region.dtype.bytes() != 0 || region.members.is_empty() {
                return Err(format!("{name}'s region is not whole elements of its members"));
            }
            let chunk = pipeline.chunks.iter().find(|c| c.early_syncs.contains(&region.members[0])).ok_or(format!("{name}: instruction {} is not an early sync of any chunk", region.members[0]))?;
            let mut axes = None;
            for &m in &region.members {
                let instr = self.instrs.get(m).ok_or(format!("{name} names instruction {m}, out of range"))?;
                let kind = self.instrs[region.members[0]].op.as_str();
                let collective = matches!(kind, "shard.all_reduce" | "shard.reduce_scatter") && instr.op == kind && (kind == "shard.all_reduce" || instr.int("scatter_axis") == Ok(0));
                if !collective || instr.bool("xf.async").unwrap_or(false) || instr.int("xf.step_bucket") != Ok(region.bucket) || !claimed.insert(m) {
                    return Err(format!("{name} names instruction {m} ({}), not a synchronous all-reduce (or reduce-scatter along dimension 0) of the bucket, of one kind, once", instr.op));
                }
                if instr.int("xf.step_bucket_members") != Ok(region.members.len() as i64) {
                    return Err(format!("{name}: instruction {m} says its bucket has {:?} members; the region has {}", instr.int("xf.step_bucket_members").ok(), region.members.len()));
                }
                if !chunk.early_syncs.contains(&m) {
                    return Err(format!("{name}: instruction {m} ({}) is not an early sync of chunk {} (a bucket goes out at its chunk's last backward)", instr.loc, chunk.stage));
                }
                if axes.get_or_insert_with(|| instr.ints("grid_axes").ok()) != &instr.ints("grid_axes").ok() {
                    return Err(format!("{name}'s members reduce over different axes"));
                }
                if readers[instr.inputs[0]] != 1 {
                    return Err(format!("{name}: the input of instruction {m} ({}) has other readers; its micro-batches are summed into the region instead", self.buffers[instr.inputs[0]].name));
                }
                let out = *instr.outputs.first().ok_or(format!("{name}: instruction {m} has no output"))?;
                let (at, bytes) = self.arena_range(out).ok_or(format!("{name}: the output of instruction {m} is not in the arena"))?;
                if self.buffers[out].dtype != region.dtype || at < region.offset || at + bytes > end {
                    return Err(format!("{name}: the output of instruction {m} lies outside the bucket's region or has another type"));
                }
            }
            spans.push((region.offset, end, region.bucket));
        }
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(format!("step bucket regions {} and {} overlap", w[0].2, w[1].2));
        }
        let outputs: std::collections::HashSet<BufferId> = self.memory.buckets.iter().flat_map(|r| r.members.iter().map(|&m| self.instrs[m].outputs[0])).collect();
        for b in 0..self.buffers.len() {
            let Some((at, bytes)) = self.arena_range(b).filter(|&(_, bytes)| bytes > 0 && !outputs.contains(&b)) else { continue };
            // The last region starting before the buffer's end.
            let k = spans.partition_point(|s| s.0 < at + bytes);
            if k > 0 && spans[k - 1].1 > at {
                return Err(format!("buffer {b} ({}) shares storage with step bucket {}, which is alive the whole step", self.buffers[b].name, spans[k - 1].2));
            }
        }
        Ok(())
    }

    /// Every collective's buffers are what its group makes of them (backends size transfers
    /// from the buffers, so a plan edited otherwise would move bytes past a buffer's end):
    /// one input and one output of one type, over grid axes of the mesh; an all-reduce or
    /// broadcast keeps the shape; along its axis a reduce-scatter or slice divides the extent
    /// by the group's size and a gather multiplies it, other dimensions kept.
    fn check_collective_shapes(&self) -> Result<(), String> {
        for (i, instr) in self.instrs.iter().enumerate() {
            let axis_attr = match instr.op.as_str() {
                "shard.all_reduce" | "shard.broadcast" => None,
                "shard.reduce_scatter" => Some("scatter_axis"),
                "shard.all_gather" => Some("gather_axis"),
                "shard.all_slice" => Some("slice_axis"),
                "shard.all_to_all" => Some("split_axis"),
                _ => continue,
            };
            let at = || format!("instruction {i} (`{}` at {})", instr.op, instr.loc);
            let (&[input], &[output]) = (instr.inputs.as_slice(), instr.outputs.as_slice()) else {
                return Err(format!("{} has {} inputs and {} outputs, not one each", at(), instr.inputs.len(), instr.outputs.len()));
            };
            let (a, b) = (&self.buffers[input], &self.buffers[output]);
            if a.dtype != b.dtype {
                return Err(format!("{} turns {:?} into {:?}", at(), a.dtype, b.dtype));
            }
            let axes = instr.ints("grid_axes").map_err(|e| format!("{}: {e}", at()))?;
            let mut n = 1usize;
            for &g in &axes {
                let extent = usize::try_from(g).ok().and_then(|g| self.mesh.get(g)).ok_or(format!("{}: grid axis {g} is not one of the mesh's {}", at(), self.mesh.len()))?;
                n = n.saturating_mul(*extent);
            }
            let fits = match axis_attr {
                None => a.shape == b.shape,
                // Split along one dimension, concatenated along another.
                Some(_) if instr.op == "shard.all_to_all" => {
                    let dim = |attr: &str| instr.int(attr).ok().and_then(|d| usize::try_from(d).ok()).filter(|&d| d < a.shape.len() && a.shape.len() == b.shape.len());
                    match (dim("split_axis"), dim("concat_axis")) {
                        (Some(split), Some(concat)) if split != concat => {
                            let others = (0..a.shape.len()).all(|k| k == split || k == concat || a.shape[k] == b.shape[k]);
                            others && b.shape[split].checked_mul(n) == Some(a.shape[split]) && a.shape[concat].checked_mul(n) == Some(b.shape[concat])
                        }
                        _ => false,
                    }
                }
                Some(attr) => {
                    let d = instr.int(attr).ok().and_then(|d| usize::try_from(d).ok()).filter(|&d| d < a.shape.len() && a.shape.len() == b.shape.len());
                    d.is_some_and(|d| {
                        let others = (0..a.shape.len()).all(|k| k == d || a.shape[k] == b.shape[k]);
                        let (small, large) = if instr.op == "shard.all_gather" { (a.shape[d], b.shape[d]) } else { (b.shape[d], a.shape[d]) };
                        others && small.checked_mul(n) == Some(large)
                    })
                }
            };
            if !fits {
                return Err(format!("{}: shapes {:?} -> {:?} do not fit a group of {n} along {:?}", at(), a.shape, b.shape, axis_attr.map(|attr| instr.int(attr))));
            }
        }
        Ok(())
    }

    /// What makes an asynchronous collective sound (backends issue a bucket's members
    /// together on their communicator's stream once its last member is reached, and join it
    /// at the bucket's first `xf.wait`): an all-reduce is a sum; a reduce-scatter or
    /// all-gather splits its first dimension of more than one element (each rank's block is
    /// contiguous), or, for a reduce-scatter alone in its bucket, another (staged in a buffer
    /// of its own);
    /// its bucket has as many such members as each member says, of one op over one set of
    /// axes, in a program without pipeline sections; a wait of the bucket reads each member's
    /// output and the first comes after the last member; and until then nothing writes
    /// storage that a member reads or writes, since the transfer may still be using it.
    fn check_async_collectives(&self) -> Result<(), String> {
        let mut buckets: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
        for (i, instr) in self.instrs.iter().enumerate() {
            if instr.bool("xf.async") != Ok(true) {
                continue;
            }
            if instr.op == "shard.all_reduce" {
                // Buckets are sums: their members are joined into one all-reduce.
                if matches!(instr.attrs.get("reduction"), Some(Attr::Str(k)) if k != "sum") {
                    return Err(format!("instruction {i} (all-reduce at {}) is asynchronous but not a sum", instr.loc));
                }
                let bucket = instr.int("xf.bucket").map_err(|e| format!("asynchronous instruction {i} at {}: {e}", instr.loc))?;
                buckets.entry(bucket).or_default().push(i);
                continue;
            }
            if instr.op == "shard.reduce_scatter" && matches!(instr.attrs.get("reduction"), Some(Attr::Str(k)) if k != "sum") {
                return Err(format!("instruction {i} (reduce-scatter at {}) is asynchronous but not a sum", instr.loc));
            }
            // A shift (ring attention's blocks) sends its whole input: nothing to rearrange.
            if instr.op == "shard.shift" {
                if instr.inputs.len() != 1 || instr.outputs.len() != 1 {
                    return Err(format!("instruction {i} (`shard.shift` at {}) has {} inputs and {} outputs, not one each", instr.loc, instr.inputs.len(), instr.outputs.len()));
                }
                let bucket = instr.int("xf.bucket").map_err(|e| format!("asynchronous instruction {i} at {}: {e}", instr.loc))?;
                buckets.entry(bucket).or_default().push(i);
                continue;
            }
            let axis = match instr.op.as_str() {
                "shard.reduce_scatter" => "scatter_axis",
                "shard.all_gather" => "gather_axis",
                other => return Err(format!("instruction {i} (`{other}` at {}) is marked asynchronous; only all-reduces, reduce-scatters, all-gathers and shifts may be", instr.loc)),
            };
            if instr.inputs.len() != 1 || instr.outputs.len() != 1 {
                return Err(format!("instruction {i} (`{}` at {}) has {} inputs and {} outputs, not one each", instr.op, instr.loc, instr.inputs.len(), instr.outputs.len()));
            }
            let shape = &self.buffers[instr.inputs[0]].shape;
            let along = instr.int(axis).ok().and_then(|a| usize::try_from(a).ok()).filter(|&a| a < shape.len());
            let Some(along) = along else {
                return Err(format!("instruction {i} (`{}` at {}) is asynchronous along dimension {:?}, which its input of shape {shape:?} lacks", instr.op, instr.loc, instr.int(axis)));
            };
            // Blocks of an inner dimension are staged: a gather's after the transfer (which
            // no backend does asynchronously), a scatter's before it, in a buffer of the
            // instruction's own, so such a scatter goes alone.
            let contiguous = shape[..along].iter().all(|&d| d == 1);
            if !contiguous && (instr.op == "shard.all_gather" || instr.int("xf.bucket_members") != Ok(1)) {
                return Err(format!(
                    "instruction {i} (`{}` at {}) is asynchronous along dimension {along} of {shape:?}, whose blocks are not contiguous: only a reduce-scatter alone in its bucket may be",
                    instr.op, instr.loc
                ));
            }
            let bucket = instr.int("xf.bucket").map_err(|e| format!("asynchronous instruction {i} at {}: {e}", instr.loc))?;
            buckets.entry(bucket).or_default().push(i);
        }
        if let Some(pipeline) = self.pipeline.as_ref().filter(|_| !buckets.is_empty()) {
            self.check_pipeline_buckets(pipeline, &buckets)?;
        }
        for (bucket, members) in &buckets {
            let first = &self.instrs[members[0]];
            for &m in members {
                let instr = &self.instrs[m];
                if instr.op != first.op || instr.ints("grid_axes").ok() != first.ints("grid_axes").ok() || instr.int("xf.bucket_members") != Ok(members.len() as i64) {
                    return Err(format!("bucket {bucket}: instruction {m} (`{}` at {}) is not one of {} `{}` members over one set of axes", instr.op, instr.loc, members.len(), first.op));
                }
            }
            let last = *members.last().unwrap_or(&0);
            let is_wait = |i: &Instr| i.op == "xf.wait" && i.int("xf.bucket") == Ok(*bucket);
            if let Some(w) = self.instrs[..last].iter().position(is_wait) {
                return Err(format!("bucket {bucket}: instruction {w} waits for it before its last member (instruction {last}) is issued"));
            }
            let first_wait = self.instrs.iter().position(is_wait).ok_or(format!("bucket {bucket} is never waited for"))?;
            // An all-reduce's input is copied into its output (or region) when it is
            // reached, so only its output is the transfer's until the wait.
            let reduces = first.op == "shard.all_reduce";
            for &m in members {
                let (input, output) = (self.instrs[m].inputs[0], self.instrs[m].outputs[0]);
                if !self.instrs[first_wait..].iter().any(|i| is_wait(i) && i.inputs.first() == Some(&output)) {
                    return Err(format!("bucket {bucket}: no wait of the bucket reads the output of instruction {m} ({})", self.instrs[m].loc));
                }
                if !reduces && self.alias(input, output) != Alias::None {
                    return Err(format!("bucket {bucket}: instruction {m} ({}) writes storage it reads", self.instrs[m].loc));
                }
                // Its output is what the transfer writes: nothing reads it before the wait.
                if let Some(r) = (m + 1..first_wait).find(|&r| self.instrs[r].inputs.iter().any(|&b| self.alias(b, output) != Alias::None)) {
                    let reader = &self.instrs[r];
                    return Err(format!("bucket {bucket}: instruction {r} (`{}` at {}) reads the output of instruction {m} ({}) before instruction {first_wait} waits for it", reader.op, reader.loc, self.instrs[m].loc));
                }
                for (w, writer) in self.instrs.iter().enumerate().take(first_wait).skip(m + 1) {
                    if let Some(&o) = writer.outputs.iter().find(|&&o| (!reduces && self.alias(o, input) != Alias::None) || self.alias(o, output) != Alias::None) {
                        return Err(format!(
                            "bucket {bucket}: instruction {w} (`{}` at {}) writes `{}`, whose storage the transfer of instruction {m} ({}) still uses until instruction {first_wait} waits for it",
                            writer.op, writer.loc, self.buffers[o].name, self.instrs[m].loc
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// A pipeline rank's asynchronous buckets each lie, members and waits, in one section of
    /// one chunk: a forward, backward or weight section (`overlap-collectives`: one
    /// collective behind the compute after it), which runs whole once per micro-batch, or a
    /// step section, where they are ZeRO's gathers of updated shards
    /// (`bucket-step-gradients`). The step sections of several chunks run merged in the
    /// training step's order (`xf.order`): there every member must be issued before the
    /// first wait, and no instruction of another chunk's step section may write storage
    /// that a member reads or writes.
    fn check_pipeline_buckets(&self, pipeline: &PipelinePlan, buckets: &BTreeMap<i64, Vec<usize>>) -> Result<(), String> {
        // (Sections are checked against the instructions later; a plan edited out of range
        // must get an error here, not a panic.)
        if let Some(c) = pipeline.chunks.iter().position(|c| Phase::ALL.iter().any(|&p| c.range(p).end > self.instrs.len())) {
            return Err(format!("chunk {c}'s sections run past the program's {} instructions", self.instrs.len()));
        }
        // Where each instruction runs in the merged step order.
        let position: std::collections::HashMap<usize, usize> = self.step_order(&pipeline.chunks).into_iter().enumerate().map(|(k, i)| (i, k)).collect();
        for (bucket, members) in buckets {
            let first = &self.instrs[members[0]];
            let waits: Vec<usize> = self.instrs.iter().enumerate().filter(|(_, i)| i.op == "xf.wait" && i.int("xf.bucket") == Ok(*bucket)).map(|(w, _)| w).collect();
            let Some((chunk, phase)) = pipeline.chunks.iter().enumerate().find_map(|(c, plan)| Phase::ALL.iter().find(|&&p| plan.range(p).contains(&members[0])).map(|&p| (c, p))) else {
                return Err(format!("bucket {bucket}: instruction {} ({}) is asynchronous outside every section", members[0], first.loc));
            };
            let section = pipeline.chunks[chunk].range(phase);
            if let Some(i) = members.iter().chain(&waits).copied().find(|i| !section.contains(i)) {
                return Err(format!("bucket {bucket}: instruction {i} ({}) lies outside the {} section {section:?} of chunk {chunk} that issues the bucket", self.instrs[i].loc, phase.label()));
            }
            if phase != Phase::Step {
                continue;
            }
            if first.op != "shard.all_gather" {
                return Err(format!("a pipeline rank's program has an asynchronous `{}` (bucket {bucket}, at {}) in a step section; only ZeRO's gathers of updated shards may be", first.op, first.loc));
            }
            // The rank runs its step sections merged by `xf.order`: there too every member is
            // issued before the first wait.
            let last_member = members.iter().filter_map(|m| position.get(m)).max();
            if let Some(w) = waits.iter().find(|w| position.get(w) < last_member) {
                return Err(format!("bucket {bucket}: instruction {w} ({}) waits for it before its last member is issued in the step order (`xf.order`)", self.instrs[*w].loc));
            }
            for (c, other) in pipeline.chunks.iter().enumerate().filter(|&(c, _)| c != chunk) {
                for w in other.range(Phase::Step) {
                    for &m in members {
                        let touched = [self.instrs[m].inputs[0], self.instrs[m].outputs[0]];
                        if let Some(&o) = self.instrs[w].outputs.iter().find(|&&o| touched.iter().any(|&t| self.alias(o, t) != Alias::None)) {
                            return Err(format!("bucket {bucket}: instruction {w} of chunk {c}'s step section writes `{}`, whose storage the transfer of instruction {m} ({}) may still use", self.buffers[o].name, self.instrs[m].loc));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn check_memory_totals(&self) -> Result<(), String> {
        let m = &self.memory;
        let mut is_arg = vec![false; self.buffers.len()];
        for a in &self.args {
            is_arg[a.buffer] = true;
        }
        // Each buffer is at most 2^51 bytes and there are fewer than 2^64 of them: u128 sums
        // cannot overflow.
        let (mut arguments, mut temporaries, mut largest, mut padding) = (0u128, 0u128, 0u128, 0u128);
        for (b, buffer) in self.buffers.iter().enumerate() {
            let bytes = (buffer.len() * buffer.dtype.bytes()) as u128;
            if is_arg[b] {
                arguments += bytes;
            } else {
                temporaries += bytes;
                // With an arena, of the temporaries in it (a pipeline rank's kept values
                // live outside it).
                if m.offsets.is_empty() || m.offsets.get(b).is_some_and(|o| o.is_some()) {
                    largest = largest.max(bytes);
                }
                // Rounding to 16 bytes and aligning to at most 256.
                padding += 16 + 256;
            }
        }
        let field = |name: &str, value: usize, computed: u128| format!("the memory plan's `{name}` is {value} bytes, but its buffers make {computed}");
        if m.argument_bytes as u128 != arguments {
            return Err(field("argument_bytes", m.argument_bytes, arguments));
        }
        if m.temporary_bytes_without_reuse as u128 != temporaries {
            return Err(field("temporary_bytes_without_reuse", m.temporary_bytes_without_reuse, temporaries));
        }
        let most = temporaries + padding;
        for (name, value) in [("temporary_bytes", m.temporary_bytes), ("live_bound_bytes", m.live_bound_bytes), ("arena_bytes", m.arena_bytes)] {
            if value as u128 > most {
                return Err(format!("the memory plan's `{name}` is {value} bytes, more than its temporaries take without reuse ({temporaries}, and {padding} of alignment)"));
            }
        }
        // Plans with an arena also carry its peak and the live bound (older ones leave them 0).
        if !m.offsets.is_empty() && ((m.live_bound_bytes as u128) < largest || m.temporary_bytes < m.live_bound_bytes || m.arena_bytes != m.temporary_bytes) {
            return Err(format!(
                "the memory plan's peak of temporaries ({} bytes, arena {}) must be at least its live bound ({}), itself at least the largest temporary ({largest})",
                m.temporary_bytes, m.arena_bytes, m.live_bound_bytes
            ));
        }
        Ok(())
    }

    /// The instructions of every chunk's step section in the order a rank runs them: by
    /// `xf.order`, each op's place in the unsplit training step (so a chunk never waits on a
    /// later chunk of its own rank: the global norm needs every chunk's share before any
    /// chunk's update), chunk by chunk where it is absent.
    pub fn step_order(&self, chunks: &[ChunkPlan]) -> Vec<usize> {
        let mut order: Vec<(i64, usize, usize)> = chunks
            .iter()
            .enumerate()
            .flat_map(|(c, chunk)| chunk.range(Phase::Step).map(move |index| (c, index)))
            .map(|(c, index)| (self.instrs[index].int("xf.order").unwrap_or(i64::MIN), c, index))
            .collect();
        if order.iter().any(|(key, _, _)| *key == i64::MIN) {
            return chunks.iter().flat_map(|chunk| chunk.range(Phase::Step)).collect();
        }
        order.sort_unstable();
        order.into_iter().map(|(_, _, index)| index).collect()
    }

    /// Where a step without pipeline sections makes its loss, for evaluating the model on
    /// other batches with the forward alone. The loss's last reductions (sums over the
    /// batch's axes, which a communication optimizer may bucket with gradients to the end of
    /// the step) are left to the caller: see [`LossPartial`].
    pub fn loss_partial(&self) -> Result<LossPartial, String> {
        let loss = self.result("loss").ok_or("the program returns no `loss`")?.buffer;
        let (mut buffer, mut before, mut axes) = (loss, self.instrs.len(), Vec::new());
        let end = loop {
            let writer = (0..before).rev().find(|&i| self.instrs[i].outputs.contains(&buffer)).ok_or_else(|| format!("no instruction makes the loss's buffer {buffer}"))?;
            let instr = &self.instrs[writer];
            let sums = !matches!(instr.attrs.get("reduction"), Some(Attr::Str(r)) if r != "sum");
            match instr.op.as_str() {
                // A wait's value is its collective's.
                "xf.wait" => before = writer,
                "shard.all_reduce" if sums => {
                    axes.extend(instr.ints("grid_axes")?.into_iter().map(|a| a as usize));
                    buffer = instr.inputs[0];
                    before = writer;
                }
                _ => break writer + 1,
            }
        };
        // The forward must leave the run's state as it is (the update writes it in place).
        for (index, instr) in self.instrs[..end].iter().enumerate() {
            for &output in &instr.outputs {
                if let Some(arg) = self.args.iter().find(|a| self.alias(output, a.buffer) != Alias::None) {
                    return Err(format!("instruction {index} (`{}`), before the loss is made, writes the argument `{}`", instr.op, arg.name));
                }
            }
        }
        axes.sort_unstable();
        axes.dedup();
        Ok(LossPartial { buffer, end, axes })
    }

    /// Bytes the CPU backend allocates for the program: every storage slot (it keeps typed
    /// slots rather than the device's arena).
    pub fn cpu_storage_bytes(&self) -> usize {
        self.memory.slots.iter().fold(0usize, |sum, (len, dtype)| sum.saturating_add(len.saturating_mul(dtype.bytes())))
    }

    /// Peak bytes of the program: arguments plus temporaries.
    pub fn peak_bytes(&self) -> usize {
        self.memory.argument_bytes.saturating_add(self.memory.temporary_bytes)
    }

    /// The argument called `name`.
    pub fn arg(&self, name: &str) -> Option<&Binding> {
        self.args.iter().find(|b| b.name == name)
    }

    /// The result called `name`.
    pub fn result(&self, name: &str) -> Option<&Binding> {
        self.results.iter().find(|b| b.name == name)
    }

    /// Reads a program from JSON, checking the format version.
    pub fn from_json(text: &str) -> Result<Program, crate::RuntimeError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| crate::RuntimeError::Program(format!("not a rank program: {e}")))?;
        Program::from_value(value)
    }

    /// Reads a program from parsed JSON. The format version is checked before anything else,
    /// so a program written by another shardc fails with its version, not with a field or a
    /// device call this one does not know.
    pub fn from_value(value: serde_json::Value) -> Result<Program, crate::RuntimeError> {
        match value.get("format_version").and_then(serde_json::Value::as_u64) {
            Some(v) if v == u64::from(FORMAT_VERSION) => {}
            Some(v) => return Err(crate::RuntimeError::Program(format!("format version {v} is not supported (this runtime reads version {FORMAT_VERSION}); recompile the plan"))),
            None if value.get("format_version").is_some() => return Err(crate::RuntimeError::Program(format!("`format_version` is {}, not a version number (this runtime reads version {FORMAT_VERSION})", value["format_version"]))),
            None => return Err(crate::RuntimeError::Program("not a rank program: it has no `format_version`".into())),
        }
        serde_json::from_value(value).map_err(|e| crate::RuntimeError::Program(format!("not a rank program: {e}")))
    }

    /// Checks internal consistency: buffer and slot indices in range, slots large enough and
    /// of the right type. Runs before execution, so a corrupt file is an error, not a panic.
    pub fn validate(&self) -> Result<(), crate::RuntimeError> {
        let bad = |m: String| Err(crate::RuntimeError::Program(m));
        if self.format_version != FORMAT_VERSION {
            return bad(format!("format version {} is not supported (this runtime reads version {FORMAT_VERSION}); recompile the plan", self.format_version));
        }
        if self.mesh.contains(&0) || self.mesh.iter().try_fold(1usize, |acc, &e| acc.checked_mul(e)).is_none_or(|n| n > MAX_MESH_RANKS) {
            return bad(format!("mesh {:?} needs extents of at least 1 and at most {MAX_MESH_RANKS} ranks", self.mesh));
        }
        for (i, b) in self.buffers.iter().enumerate() {
            let Some(&(capacity, dtype)) = self.memory.slots.get(b.slot) else {
                return bad(format!("buffer {i} ({}) names slot {} of {}", b.name, b.slot, self.memory.slots.len()));
            };
            if b.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).is_none_or(|n| n > MAX_BUFFER_ELEMENTS) {
                return bad(format!("buffer {i} ({}) has shape {:?}, more than the {MAX_BUFFER_ELEMENTS} elements a buffer may have", b.name, b.shape));
            }
            if capacity < b.len() || dtype != b.dtype {
                return bad(format!("buffer {i} ({}) does not fit its slot {}", b.name, b.slot));
            }
        }
        if let Some((s, (capacity, _))) = self.memory.slots.iter().enumerate().find(|(_, (c, _))| *c > MAX_BUFFER_ELEMENTS) {
            return bad(format!("slot {s} holds {capacity} elements, more than the {MAX_BUFFER_ELEMENTS} a buffer may have"));
        }
        let in_range = |id: &BufferId| *id < self.buffers.len();
        for (i, instr) in self.instrs.iter().enumerate() {
            if !instr.inputs.iter().chain(&instr.outputs).all(in_range) {
                return bad(format!("instruction {i} ({}) names a buffer out of range", instr.op));
            }
            let mut slots: Vec<usize> = instr.outputs.iter().map(|o| self.buffers[*o].slot).collect();
            slots.sort_unstable();
            if slots.windows(2).any(|w| w[0] == w[1]) {
                return bad(format!("instruction {i} ({}) writes two outputs into one slot", instr.op));
            }
        }
        if !self.args.iter().chain(&self.results).all(|b| in_range(&b.buffer)) {
            return bad("an argument or result names a buffer out of range".into());
        }
        if let Err(m) = self.check_memory_totals() {
            return bad(m);
        }
        if !self.memory.offsets.is_empty() {
            if self.memory.offsets.len() != self.buffers.len() {
                return bad(format!("the arena plan has {} offsets for {} buffers", self.memory.offsets.len(), self.buffers.len()));
            }
            let mut outside: std::collections::HashSet<BufferId> = self.args.iter().map(|a| a.buffer).collect();
            if let Some(pipeline) = &self.pipeline {
                outside.extend(pipeline.chunks.iter().flat_map(|c| c.keep_forward.iter().chain(&c.keep_backward)).copied());
            }
            // What no instruction writes needs no storage.
            let written: std::collections::HashSet<BufferId> = self.instrs.iter().flat_map(|i| i.outputs.iter().copied()).collect();
            if let Some(i) = (0..self.buffers.len()).find(|i| self.memory.offsets[*i].is_none() && written.contains(i) && !outside.contains(i)) {
                return bad(format!("buffer {i} ({}) is a temporary with no place in the arena and is kept by no pipeline chunk", self.buffers[i].name));
            }
            // Kept values in the arena are overwritten by the next forward: only a rank whose
            // every backward comes right after its forward may leave them there.
            if let Some(pipeline) = &self.pipeline {
                let in_arena = pipeline.chunks.iter().flat_map(|c| c.keep_forward.iter().chain(&c.keep_backward)).find(|&&b| self.memory.offsets.get(b).is_some_and(|o| o.is_some()));
                if let (Some(at), Some(&b)) = (crate::schedule::forward_ahead(&pipeline.items), in_arena) {
                    return bad(format!("buffer {b} ({}) is kept in the arena, but item {at}'s forward is not followed by its backward: the next forward would overwrite it", self.buffers[b].name));
                }
            }
            for (i, b) in self.buffers.iter().enumerate() {
                if let Some(offset) = self.memory.offsets[i]
                    && offset.checked_add(b.len().saturating_mul(b.dtype.bytes())).is_none_or(|end| end > self.memory.arena_bytes)
                {
                    return bad(format!("buffer {i} ({}) lies outside the arena of {} bytes", b.name, self.memory.arena_bytes));
                }
            }
        }
        if let Err(m) = self.check_bucket_regions() {
            return bad(m);
        }
        if let Err(m) = self.check_collective_shapes() {
            return bad(m);
        }
        if let Err(m) = self.check_async_collectives() {
            return bad(m);
        }
        for b in &self.args {
            let global = b.layout.as_ref().map_or(&self.buffers[b.buffer].shape, |l| &l.global_shape);
            if let Some(u) = &b.unpadded
                && (u.len() != global.len() || u.iter().zip(global).any(|(u, g)| u > g))
            {
                return bad(format!("`{}`: unpadded shape {u:?} does not fit in {global:?}", b.name));
            }
        }
        if let Some(pipeline) = &self.pipeline {
            for chunk in &pipeline.chunks {
                let lists = [&chunk.keep_forward, &chunk.keep_backward, &chunk.sum_backward, &chunk.sum_weight];
                if !lists.iter().all(|l| l.iter().all(in_range)) || chunk.sections.iter().any(|&(s, e)| s > e || e > self.instrs.len()) {
                    return bad(format!("pipeline chunk {} names a buffer or instruction out of range", chunk.stage));
                }
                // Kept values are temporaries a section makes: an argument sent to a
                // micro-batch's storage would be read and written there.
                if let Some(&b) = chunk.keep_forward.iter().chain(&chunk.keep_backward).find(|&&b| self.args.iter().any(|a| a.buffer == b)) {
                    return bad(format!("pipeline chunk {} keeps argument buffer {b} ({}) as a value of its micro-batches", chunk.stage, self.buffers[b].name));
                }
                if let Err(m) = self.check_early_syncs(chunk) {
                    return bad(format!("pipeline chunk {}: {m}", chunk.stage));
                }
            }
        }
        Ok(())
    }
}
