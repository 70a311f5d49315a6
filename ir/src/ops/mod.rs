//! The op registry: every fact about an `xf` op lives with the op, in one place.
//!
//! An op is a unit struct implementing [`OpDef`]: its signature (which also generates the IRDL
//! definition in `ir/dialect/xf.irdl.mlir`), its shape rule and its FLOP/byte cost. Later
//! stages add their facts (sharding rule, VJP, kernel name) to the same trait, so adding an op
//! means one new `impl` here plus its kernels, and one line in [`REGISTRY`].
//!
//! IRDL checks only that operands are ranked tensors and that slots sharing a constraint have
//! equal types; everything shape-related is checked here by [`OpDef::infer`].

mod attention;
pub mod cast;
mod elementwise;
mod embedding;
mod heads;
mod loss;
mod matmul;
mod moe;
mod norm;
mod optim;
mod reduce;
mod rope;

use crate::attrs::Attrs;
use crate::types::{DType, TensorTy};

pub use attention::{attention_stats, off_tensor_cores, stats_dtype, Attention, AttentionBlock, AttentionBlockGrad, AttentionGrad, AttentionMerge, RING_STEP_ATTR};
pub use cast::Cast;
pub use elementwise::{Activation, ActivationGrad, Add, Mul, Scale, Swiglu, SwigluGrad, GELU, GELU_GRAD, SILU, SILU_GRAD};
pub use embedding::{Embedding, EmbeddingGrad};
pub use heads::{zigzag_of, zigzag_position, zigzag_row, Pad, RepeatHeads, Slice, SumHeads, Zigzag, ZIGZAG_ATTR};
pub use loss::{CrossEntropy, CrossEntropyFinish, CrossEntropyGrad, CrossEntropyGradShard, CrossEntropyStats, RowMax};
pub use matmul::{MatMul, MatMulWeightGrad};
pub use moe::{ExpertMatMul, ExpertMatMulWeightGrad, MoeAuxLoss, MoeAuxLossGrad, MoeCollect, MoeCombine, MoeCombineGrad, MoeDispatch, MoeRoute, MoeRouteGrad, MoeSlots};
pub use norm::{LayerNorm, LayerNormGrad, RmsNorm, RmsNormGrad};
pub use optim::{AdamW, ClipCoef, LrSchedule, Sgd, SumSquares};
pub use reduce::{Constant, FillLike, SumLeading, Wait};
pub use rope::{Rope, RopeGrad};

use crate::graph::{FuncBuilder, Value};
use crate::kernel::{DeviceKernel, KernelCx};
use crate::sharding::ShardingRule;

/// Every `xf` op, in the order the dialect file lists them.
pub static REGISTRY: &[&dyn OpDef] = &[
    &Embedding,
    &MatMul,
    &Add,
    &Mul,
    &Scale,
    &GELU,
    &SILU,
    &Swiglu,
    &LayerNorm,
    &RmsNorm,
    &Rope,
    &Slice,
    &RepeatHeads,
    &Zigzag,
    &SumHeads,
    &Attention,
    &AttentionBlock,
    &AttentionMerge,
    &AttentionBlockGrad,
    &CrossEntropy,
    // Mixture of experts: routing, permutation, the grouped GEMM, load balancing.
    &MoeRoute,
    &MoeSlots,
    &MoeDispatch,
    &ExpertMatMul,
    &MoeCombine,
    &MoeAuxLoss,
    // Reductions and fills, used by gradients.
    &SumLeading,
    &FillLike,
    &Pad,
    &Wait,
    // Backward ops, emitted by the VJP rules of the ops above.
    &EmbeddingGrad,
    &MatMulWeightGrad,
    &GELU_GRAD,
    &SILU_GRAD,
    &SwigluGrad,
    &LayerNormGrad,
    &RmsNormGrad,
    &RopeGrad,
    &AttentionGrad,
    &CrossEntropyGrad,
    &MoeRouteGrad,
    &MoeAuxLossGrad,
    &MoeCollect,
    &MoeCombineGrad,
    &ExpertMatMulWeightGrad,
    // Pieces of vocab-parallel cross-entropy, made by partitioning.
    &RowMax,
    &CrossEntropyStats,
    &CrossEntropyFinish,
    &CrossEntropyGradShard,
    // Optimizers, and the casts of mixed precision around them.
    &AdamW,
    &Sgd,
    &SumSquares,
    &ClipCoef,
    &Constant,
    &Cast,
];

/// Name of our dialect.
pub const DIALECT: &str = "xf";

/// Looks an op up by its full name (`xf.matmul`).
pub fn lookup(full_name: &str) -> Option<&'static dyn OpDef> {
    let mnemonic = full_name.strip_prefix("xf.")?;
    REGISTRY.iter().copied().find(|op| op.mnemonic() == mnemonic)
}

/// Kind of value an attribute holds; decides its IRDL constraint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttrKind {
    /// An `i64` integer attribute.
    Int,
    /// An `f64` float attribute.
    Float,
    /// An `i1` integer attribute (`true`/`false`).
    Bool,
    /// A type attribute (an element type such as `f32`).
    Type,
}

/// One operand or result slot. Slots of one op that name the same `constraint` must have
/// equal types; IRDL enforces it.
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    /// Name of the slot in the IRDL definition.
    pub name: &'static str,
    /// Name of the IRDL type-constraint variable.
    pub constraint: &'static str,
}

/// Operands, results and required attributes of an op.
#[derive(Clone, Copy, Debug)]
pub struct Signature {
    /// Operand slots, in order.
    pub operands: &'static [Slot],
    /// Result slots, in order.
    pub results: &'static [Slot],
    /// Required attributes (IRDL has no optional attributes).
    pub attrs: &'static [(&'static str, AttrKind)],
}

/// Estimated work of one op instance: floating-point operations and bytes moved to and from
/// memory (every operand read once, every result written once).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    /// Floating-point operations (a fused multiply-add counts 2).
    pub flops: f64,
    /// Bytes read plus bytes written.
    pub bytes: f64,
    /// Transcendental functions (exp, log, tanh): they run on a GPU's special-function units
    /// at a fraction of the arithmetic rate, and as library routines on a CPU (XLA's cost
    /// analysis counts its "transcendentals" apart too). Square roots and divisions are single
    /// instructions and count as arithmetic.
    pub special: f64,
}

/// How a kernel spends its time, for the cluster model ([`crate::cluster::Cluster::kernel_time`]):
/// GEMMs and attention run in tiles on the processors' matrix units, everything else streams
/// memory through vector units.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum KernelClass {
    /// `batch` independent products of an `m x k` and a `k x n` matrix.
    Gemm {
        /// Independent products.
        batch: f64,
        /// Rows of the result.
        m: f64,
        /// Columns of the result.
        n: f64,
        /// The contracted dimension.
        k: f64,
    },
    /// Fused attention (the flash-attention algorithm): blocks of query rows of each (batch,
    /// head) stream over the keys they see; `products` score-sized matrix products per
    /// visible (query, key) pair (2 forward: `q k^T`, `p v`; 9 backward, as its kernels walk).
    Attention {
        /// Batch times query heads.
        batch_heads: f64,
        /// Query rows.
        queries: f64,
        /// Keys.
        keys: f64,
        /// Head dimension.
        head_dim: f64,
        /// Whether each query sees only the keys before it (flash skips masked blocks).
        causal: bool,
        /// Matrix products per visible score.
        products: f64,
        /// Whether the kernels run their products on tensor cores (bf16 at the head dims
        /// they are built for); otherwise at the fp32 peak whatever the storage.
        tensor_cores: bool,
    },
    /// Element-wise, normalisation, reduction and optimizer kernels: bound by memory traffic
    /// or vector arithmetic.
    #[default]
    Memory,
}

impl std::ops::AddAssign for Cost {
    fn add_assign(&mut self, other: Cost) {
        self.flops += other.flops;
        self.bytes += other.bytes;
        self.special += other.special;
    }
}

/// Every fact about one `xf` op.
pub trait OpDef: Sync {
    /// Name inside the dialect, e.g. `matmul` for `xf.matmul`.
    fn mnemonic(&self) -> &'static str;

    /// One-line description, used in the dialect file and `shardc ops`.
    fn summary(&self) -> &'static str;

    /// Operand, result and attribute slots.
    fn signature(&self) -> Signature;

    /// Result types for these operand types and attributes, or why they are invalid.
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String>;

    /// Floating-point operations per result element, for ops whose work is proportional to
    /// their output (element-wise ops); ops with other shapes of work override [`OpDef::cost`].
    fn flops_per_element(&self) -> f64 {
        0.0
    }

    /// Special-function operations (see [`Cost::special`]) per result element, for ops priced by
    /// the default [`OpDef::cost`].
    fn special_per_element(&self) -> f64 {
        0.0
    }

    /// How one instance spends its time (GEMM, attention or memory-bound); the default is
    /// memory-bound.
    fn kernel_class(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> KernelClass {
        KernelClass::Memory
    }

    /// Cost of one instance.
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        let out_elems: f64 = outputs.iter().map(|t| t.num_elements() as f64).sum();
        Cost { flops: out_elems * self.flops_per_element(), bytes: io_bytes(inputs, outputs), special: out_elems * self.special_per_element() }
    }

    /// Full name, e.g. `xf.matmul`.
    fn name(&self) -> String {
        format!("{DIALECT}.{}", self.mnemonic())
    }

    /// Whether [`OpDef::vjp`] is defined: autodiff differentiates through this op.
    fn differentiable(&self) -> bool {
        false
    }

    /// The vector-Jacobian product: given the gradient of every result (`grads`, one per
    /// result), emits ops through `cx` that compute the gradient of every operand (`None`
    /// for operands that carry no gradient, such as token ids).
    fn vjp(&self, _cx: &mut VjpCx<'_>, _grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        Err(format!("{} has no VJP", self.name()))
    }

    /// Results that are statistics kept for the backward (attention's log-sum-exp): the VJP
    /// takes no gradient for them, and autodiff refuses a loss that depends on one.
    fn backward_only_results(&self) -> &'static [usize] {
        &[]
    }

    /// How the op may be split over a device grid, by factors (see [`crate::sharding`]).
    /// The default keeps every dimension whole, which is always correct; ops override it.
    fn sharding_rule(&self, inputs: &[&TensorTy], attrs: &Attrs) -> ShardingRule {
        let results = self.infer(inputs, attrs).map(|r| r.iter().map(TensorTy::rank).collect::<Vec<_>>()).unwrap_or_default();
        ShardingRule::replicated(&inputs.iter().map(|t| t.rank()).collect::<Vec<_>>(), &results)
    }

    /// The factor of its sharding rule that indexes sequence positions the op reads (rotary
    /// angles, the causal mask's query rows). Where partitioning splits that factor, the op
    /// is told the axes (`xf.seq_split_axes`) and its kernels offset positions by this
    /// rank's part: the op's result then depends on its rank, not only on its operands.
    fn position_factor(&self) -> Option<usize> {
        None
    }

    /// Operands and results (as one list: operands first) kept in the kernels' accumulator
    /// type whatever the storage type (attention's row statistics: fp32 in a bf16 module).
    fn statistics_slots(&self) -> &'static [usize] {
        &[]
    }

    /// What this op can be as a stage of a matrix product's epilogue (cuBLASLt's bias, GELU
    /// and GELU-gradient epilogues), when it reads the product: codegen folds it into the GEMM.
    fn gemm_epilogue(&self) -> Option<crate::kernel::EpilogueStage> {
        None
    }

    /// Pairs `(result, operand)` where the result may share the operand's buffer (optimizer
    /// updates write the parameter in place). Codegen aliases them when the operand is dead
    /// after the op; kernels of such ops read the old value from the result buffer.
    fn in_place(&self) -> &'static [(usize, usize)] {
        &[]
    }

    /// How the op runs on a device (CUDA C and its launches, or a GEMM); see [`crate::kernel`].
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Err(format!("{} has no device kernel", self.name()))
    }
}

/// What a VJP rule sees of the op it differentiates, and how it emits gradient ops.
#[derive(Debug)]
pub struct VjpCx<'a> {
    fb: &'a mut FuncBuilder,
    /// The forward op's operands (recomputed copies when activation recomputation applies).
    pub operands: Vec<Value>,
    /// The forward op's results.
    pub results: Vec<Value>,
    /// The forward op's attributes.
    pub attrs: Attrs,
    /// Location of the emitted ops: the forward op's location plus `.grad`.
    pub loc: String,
}

impl<'a> VjpCx<'a> {
    /// A context for differentiating one op.
    pub fn new(fb: &'a mut FuncBuilder, operands: Vec<Value>, results: Vec<Value>, attrs: Attrs, forward_loc: &str) -> Self {
        VjpCx { fb, operands, results, attrs, loc: format!("{forward_loc}.grad") }
    }

    /// The tensor type of a value.
    pub fn ty(&self, value: Value) -> Result<TensorTy, String> {
        self.fb.tensor(value).cloned().ok_or_else(|| format!("{value} is not a tensor"))
    }

    /// Emits a one-result op.
    pub fn emit(&mut self, name: &str, operands: &[Value], attrs: Attrs) -> Result<Value, String> {
        self.fb.op(name, operands, attrs, &self.loc).map_err(|e| e.to_string())
    }

    /// Emits an op with several results.
    pub fn emit_multi(&mut self, name: &str, operands: &[Value], attrs: Attrs) -> Result<Vec<Value>, String> {
        self.fb.op_multi(name, operands, attrs, &self.loc).map_err(|e| e.to_string())
    }

    /// `sum_leading(x)` down to the rank of `like`, or `x` itself when the shapes agree
    /// (the gradient of a broadcast operand).
    pub fn sum_to(&mut self, x: Value, like: Value) -> Result<Value, String> {
        let (tx, tl) = (self.ty(x)?, self.ty(like)?);
        if tx.shape == tl.shape {
            return Ok(x);
        }
        self.emit("xf.sum_leading", &[x], Attrs::new().with("keep", crate::AttrValue::Int(tl.rank() as i64)))
    }
}

/// Bytes of every operand plus every result.
pub fn io_bytes(inputs: &[&TensorTy], outputs: &[TensorTy]) -> f64 {
    inputs.iter().map(|t| t.bytes() as f64).sum::<f64>()
        + outputs.iter().map(|t| t.bytes() as f64).sum::<f64>()
}

/// Checks the operand count; shape rules start with it.
pub(crate) fn arity(inputs: &[&TensorTy], n: usize) -> Result<(), String> {
    if inputs.len() == n {
        Ok(())
    } else {
        Err(format!("expects {n} operands, got {}", inputs.len()))
    }
}

/// Checks that an operand holds floating-point values.
pub(crate) fn float(what: &str, t: &TensorTy) -> Result<(), String> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} must be a floating-point tensor, got {t}"))
    }
}

/// Checks that an operand holds token ids.
pub(crate) fn ids(what: &str, t: &TensorTy) -> Result<(), String> {
    if t.dtype == DType::I32 {
        Ok(())
    } else {
        Err(format!("{what} must be an i32 tensor of token ids, got {t}"))
    }
}

/// Checks a minimum rank.
pub(crate) fn rank_at_least(what: &str, t: &TensorTy, rank: usize) -> Result<(), String> {
    if t.rank() >= rank {
        Ok(())
    } else {
        Err(format!("{what} must have rank >= {rank}, got {t}"))
    }
}

/// Checks an exact rank.
pub(crate) fn rank_is(what: &str, t: &TensorTy, rank: usize) -> Result<(), String> {
    if t.rank() == rank {
        Ok(())
    } else {
        Err(format!("{what} must have rank {rank}, got {t}"))
    }
}

/// Checks that two operands have the same element type.
pub(crate) fn same_dtype(a: &TensorTy, b: &TensorTy) -> Result<(), String> {
    if a.dtype == b.dtype {
        Ok(())
    } else {
        Err(format!("element types differ: {a} and {b}"))
    }
}

/// A shape rule's error for a bad attribute value.
pub(crate) fn positive(name: &str, value: i64) -> Result<i64, String> {
    if value > 0 { Ok(value) } else { Err(format!("attribute `{name}` must be positive, got {value}")) }
}

/// The `head_dim` attribute of an op that works per head of `[b, s, heads * head_dim]`.
pub(crate) fn head_dim(attrs: &Attrs) -> Result<i64, String> {
    positive("head_dim", attrs.int("head_dim")?)
}
