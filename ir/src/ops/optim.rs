//! Optimizer updates as ops: `xf.adamw` and `xf.sgd`, and the global gradient norm that
//! clips them: `xf.sum_squares` per gradient and `xf.clip_coef` on the sum. The updates
//! update their state in place (see [`OpDef::in_place`]), so a training step does not hold
//! two copies of the parameters.
//!
//! Both updates take the iteration `step` (i32, from 1) and compute their learning rate from
//! it by the schedule in their attributes ([`LrSchedule`]), and scale the gradient by
//! `grad_scale` (a scalar: the clipping coefficient, or 1).

use crate::kernel::{blocks_for, Arg, DeviceKernel, KernelCx, Launch, ROW_BLOCK};
use super::{arity, float, AttrKind, Cost, OpDef, Signature, Slot};
use crate::attrs::{AttrValue, Attrs};
use crate::sharding::{FactorKind, Linearity, ShardingRule};
use crate::types::{DType, TensorTy};

/// The learning rate of iteration `t` (counting from 1, as Megatron-LM's iterations): linear
/// warmup to `lr` over `warmup_steps` (`lr t / warmup_steps`), then decay to `min_lr` at
/// `decay_steps`, cosine (`min + (lr - min) (1 + cos(pi r)) / 2`) or linear (`min + (lr -
/// min)(1 - r)`) in `r = (t - warmup) / (decay - warmup)`, and `min_lr` after it.
/// `decay_steps = 0` keeps `lr` after the warmup. The update ops carry it as attributes; the
/// kernels compute it (the CPU one is `shardc_runtime::cpu::learning_rate`; the CUDA one is
/// written by `lr_at!` below).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at and after `decay_steps`.
    pub min_lr: f64,
    /// Iterations of linear warmup (0: none).
    pub warmup_steps: i64,
    /// Iteration at which the decay reaches `min_lr` (0: no decay).
    pub decay_steps: i64,
    /// Cosine decay (else linear).
    pub cosine: bool,
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f64) -> LrSchedule {
        LrSchedule { lr, min_lr: lr, warmup_steps: 0, decay_steps: 0, cosine: false }
    }

    /// Why the schedule is not usable, naming the setting.
    pub fn check(&self) -> Result<(), String> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(format!("lr must be a finite number >= 0, got {}", self.lr));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return Err(format!("min_lr must be between 0 and lr ({}), got {}", self.lr, self.min_lr));
        }
        if self.warmup_steps < 0 || self.decay_steps < 0 {
            return Err(format!("warmup_steps ({}) and decay_steps ({}) must be >= 0", self.warmup_steps, self.decay_steps));
        }
        if self.decay_steps > 0 && self.decay_steps <= self.warmup_steps {
            return Err(format!("decay_steps ({}) must exceed warmup_steps ({}), or be 0 for no decay", self.decay_steps, self.warmup_steps));
        }
        Ok(())
    }

    /// `attrs` with the schedule's attributes added.
    pub fn add_to(&self, attrs: Attrs) -> Attrs {
        attrs
            .with("lr", AttrValue::Float(self.lr))
            .with("min_lr", AttrValue::Float(self.min_lr))
            .with("warmup_steps", AttrValue::Int(self.warmup_steps))
            .with("decay_steps", AttrValue::Int(self.decay_steps))
            .with("cosine", AttrValue::Int(self.cosine as i64))
    }

    /// The schedule an update op's attributes describe.
    pub fn of(attrs: &Attrs) -> Result<LrSchedule, String> {
        let schedule = LrSchedule {
            lr: attrs.float("lr")?,
            min_lr: attrs.float("min_lr")?,
            warmup_steps: attrs.int("warmup_steps")?,
            decay_steps: attrs.int("decay_steps")?,
            cosine: attrs.int("cosine")? != 0,
        };
        schedule.check()?;
        Ok(schedule)
    }
}

/// CUDA C statements setting `acc_t lr_t` from the step operand `$step` (see [`LrSchedule::at`]).
macro_rules! lr_at {
    ($step:literal) => {
        concat!(
            "acc_t t_ = ", $step, "; acc_t lr_t; ",
            "if ({warmup_steps} > (acc_t)0 && t_ <= {warmup_steps}) lr_t = {lr} * t_ / {warmup_steps}; ",
            "else if ({decay_steps} <= (acc_t)0) lr_t = {lr}; ",
            "else if (t_ >= {decay_steps}) lr_t = {min_lr}; ",
            "else { acc_t r_ = (t_ - {warmup_steps}) / ({decay_steps} - {warmup_steps}); ",
            "lr_t = {min_lr} + ({lr} - {min_lr}) * ({cosine} > (acc_t)0.5 ? (acc_t)0.5 * ((acc_t)1 + cos((acc_t)3.141592653589793 * r_)) : (acc_t)1 - r_); } "
        )
    };
}

/// The schedule's attribute slots, shared by both updates.
const SCHEDULE_ATTRS: [(&str, AttrKind); 5] =
    [("lr", AttrKind::Float), ("min_lr", AttrKind::Float), ("warmup_steps", AttrKind::Int), ("decay_steps", AttrKind::Int), ("cosine", AttrKind::Int)];

/// `rule` with the `grad_scale` operand added: one value, never split.
fn with_scale(mut rule: ShardingRule) -> ShardingRule {
    rule.operands.push(vec![rule.factors.len()]);
    rule.factors.push(FactorKind::Blocked);
    rule
}

/// Checks the `step` and `grad_scale` operands of an update on `param`.
fn check_step_and_scale(step: &TensorTy, scale: &TensorTy, param: &TensorTy) -> Result<(), String> {
    if *step != TensorTy::scalar(DType::I32) {
        return Err(format!("step {step} must be tensor<i32>"));
    }
    if *scale != TensorTy::new(vec![1], param.dtype) {
        return Err(format!("grad_scale {scale} must be a tensor<1x{}> (one value of the parameter's type)", param.dtype.mlir()));
    }
    Ok(())
}

/// AdamW (Loshchilov and Hutter) with bias correction, at step `t >= 1`, on the scaled
/// gradient `g = grad_scale grad`:
/// `m' = b1 m + (1 - b1) g`, `v' = b2 v + (1 - b2) g^2`,
/// `p' = p - lr_t (m' / (1 - b1^t) / (sqrt(v' / (1 - b2^t)) + eps) + weight_decay p)`.
/// `step` is an i32 scalar, so one compiled step serves every iteration; `lr_t` is the
/// schedule's ([`LrSchedule`]) at `t`.
#[derive(Debug)]
pub struct AdamW;

impl OpDef for AdamW {
    fn mnemonic(&self) -> &'static str {
        "adamw"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise {
            body: concat!(
                lr_at!("{in4}"),
                "acc_t g = {in5} * {in1}; \
                 acc_t m = {beta1} * {in2} + ((acc_t)1 - {beta1}) * g; \
                 acc_t v = {beta2} * {in3} + ((acc_t)1 - {beta2}) * g * g; \
                 acc_t bc1 = (acc_t)1 - pow({beta1}, {in4}), bc2 = (acc_t)1 - pow({beta2}, {in4}); \
                 {out0} = {in0} - lr_t * ((m / bc1) / (sqrt(v / bc2) + {epsilon}) + {weight_decay} * {in0}); \
                 {out1} = m; {out2} = v;"
            ),
        })
    }
    fn summary(&self) -> &'static str {
        "AdamW update with bias correction: (param, m, v) -> (param', m', v')"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "param", constraint: "P" },
                Slot { name: "grad", constraint: "P" },
                Slot { name: "m", constraint: "P" },
                Slot { name: "v", constraint: "P" },
                Slot { name: "step", constraint: "S" },
                Slot { name: "grad_scale", constraint: "G" },
            ],
            results: &[
                Slot { name: "new_param", constraint: "P" },
                Slot { name: "new_m", constraint: "P" },
                Slot { name: "new_v", constraint: "P" },
            ],
            attrs: &[
                SCHEDULE_ATTRS[0],
                SCHEDULE_ATTRS[1],
                SCHEDULE_ATTRS[2],
                SCHEDULE_ATTRS[3],
                SCHEDULE_ATTRS[4],
                ("beta1", AttrKind::Float),
                ("beta2", AttrKind::Float),
                ("epsilon", AttrKind::Float),
                ("weight_decay", AttrKind::Float),
            ],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 6)?;
        let p = inputs[0];
        float("param", p)?;
        for (name, t) in [("grad", inputs[1]), ("m", inputs[2]), ("v", inputs[3])] {
            if t != p {
                return Err(format!("{name} {t} must have the type of param {p}"));
            }
        }
        check_step_and_scale(inputs[4], inputs[5], p)?;
        LrSchedule::of(attrs)?;
        for name in ["beta1", "beta2", "epsilon", "weight_decay"] {
            attrs.float(name)?;
        }
        Ok(vec![p.clone(), p.clone(), p.clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], _outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        let n = inputs[0].num_elements() as f64;
        // Read p, g, m, v; write p, m, v.
        // The square root and division are instructions of their own (vectorised on CPUs,
        // reciprocal units on GPUs), counted with the arithmetic: no special functions.
        Cost { flops: 12.0 * n, bytes: 7.0 * inputs[0].bytes() as f64, special: 0.0 }
    }
    fn in_place(&self) -> &'static [(usize, usize)] {
        &[(0, 0), (1, 2), (2, 3)]
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Parameter, gradient and moments share every factor; step is a scalar, the scale
        // one value.
        let mut rule = ShardingRule::elementwise(inputs[0].rank(), 4, 3, Linearity::None);
        rule.operands.push(vec![]);
        with_scale(rule)
    }
}

/// Plain SGD with decoupled weight decay at step `t >= 1`:
/// `p' = p - lr_t (grad_scale grad + weight_decay p)`, `lr_t` the schedule's at `t`.
#[derive(Debug)]
pub struct Sgd;

impl OpDef for Sgd {
    fn mnemonic(&self) -> &'static str {
        "sgd"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise { body: concat!(lr_at!("{in2}"), "{out0} = {in0} - lr_t * ({in3} * {in1} + {weight_decay} * {in0});") })
    }
    fn summary(&self) -> &'static str {
        "SGD update: param - lr (grad + weight_decay param)"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "param", constraint: "P" },
                Slot { name: "grad", constraint: "P" },
                Slot { name: "step", constraint: "S" },
                Slot { name: "grad_scale", constraint: "G" },
            ],
            results: &[Slot { name: "new_param", constraint: "P" }],
            attrs: &[SCHEDULE_ATTRS[0], SCHEDULE_ATTRS[1], SCHEDULE_ATTRS[2], SCHEDULE_ATTRS[3], SCHEDULE_ATTRS[4], ("weight_decay", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 4)?;
        float("param", inputs[0])?;
        if inputs[1] != inputs[0] {
            return Err(format!("grad {} must have the type of param {}", inputs[1], inputs[0]));
        }
        check_step_and_scale(inputs[2], inputs[3], inputs[0])?;
        LrSchedule::of(attrs)?;
        attrs.float("weight_decay")?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        3.0
    }
    fn in_place(&self) -> &'static [(usize, usize)] {
        &[(0, 0)]
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        let mut rule = ShardingRule::elementwise(inputs[0].rank(), 2, 1, Linearity::None);
        rule.operands.push(vec![]);
        with_scale(rule)
    }
}

/// The sum of the squares of every element of `x`, one value (`tensor<1xT>`: pipeline stages
/// send it, and `shard.send` takes no scalars) of `x`'s type: one gradient's share of the
/// global norm. On a sharded `x` the result is a partial sum over the shards.
#[derive(Debug)]
pub struct SumSquares;

impl OpDef for SumSquares {
    fn mnemonic(&self) -> &'static str {
        "sum_squares"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        // Block sums into scratch, then one block adds them in order: a fixed order, so
        // the norm repeats from run to run.
        let n = crate::kernel::elements(cx.inputs[0]);
        let blocks = blocks_for(n).min(1024) as usize;
        Ok(DeviceKernel::Launches(vec![
            Launch { kernel: "sum_squares_blocks", source: SUM_SQUARES_CUDA, grid: [blocks as u32, 1, 1], block: ROW_BLOCK, shared: 0, workspace: blocks, args: vec![Arg::Workspace, Arg::In(0), Arg::Int(n as i64)] },
            Launch { kernel: "sum_squares_finish", source: SUM_SQUARES_CUDA, grid: [1, 1, 1], block: ROW_BLOCK, shared: 0, workspace: blocks, args: vec![Arg::Out(0), Arg::Workspace, Arg::Int(blocks as i64)] },
        ]))
    }
    fn summary(&self) -> &'static str {
        "sum of squares of every element (a gradient's share of the global norm)"
    }
    fn signature(&self) -> Signature {
        Signature { operands: &[Slot { name: "x", constraint: "T" }], results: &[Slot { name: "y", constraint: "U" }], attrs: &[] }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        float("x", inputs[0])?;
        Ok(vec![TensorTy::new(vec![1], inputs[0].dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        Cost { flops: 2.0 * inputs[0].num_elements() as f64, bytes: super::io_bytes(inputs, outputs), special: 0.0 }
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Every dimension is summed: a split one leaves a partial sum. Squares are not
        // linear, so a partial operand is reduced first.
        let r = inputs[0].rank();
        let mut rule = ShardingRule::elementwise(r, 1, 1, Linearity::None);
        rule.results = vec![vec![r]];
        rule.factors.push(FactorKind::Blocked);
        rule
    }
}

/// The clipping coefficient of gradients whose squared global norm is `sum_squares`:
/// `min(1, max_norm / (sqrt(sum_squares) + 1e-6))`, as Megatron-LM's `clip_grad_norm`.
#[derive(Debug)]
pub struct ClipCoef;

impl OpDef for ClipCoef {
    fn mnemonic(&self) -> &'static str {
        "clip_coef"
    }
    fn device(&self, _cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        Ok(DeviceKernel::Elementwise { body: "acc_t c_ = {max_norm} / (sqrt({in0}) + (acc_t)1e-6); {out0} = c_ < (acc_t)1 ? c_ : (acc_t)1;" })
    }
    fn summary(&self) -> &'static str {
        "gradient clipping coefficient min(1, max_norm / (sqrt(sum_squares) + 1e-6))"
    }
    fn signature(&self) -> Signature {
        Signature { operands: &[Slot { name: "sum_squares", constraint: "T" }], results: &[Slot { name: "coef", constraint: "T" }], attrs: &[("max_norm", AttrKind::Float)] }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        float("sum_squares", inputs[0])?;
        if inputs[0].shape != [1] {
            return Err(format!("sum_squares {} must be one value (tensor<1x...>)", inputs[0]));
        }
        let max_norm = attrs.float("max_norm")?;
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(format!("max_norm must be a finite number > 0, got {max_norm}"));
        }
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        4.0
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        ShardingRule::elementwise(1, 1, 1, Linearity::None).block(0)
    }
}

/// CUDA C of [`SumSquares`].
const SUM_SQUARES_CUDA: &str = r#"// Block `block` of `blocks` sums the squares of its grid-stride share of x into
// partial[block]; then one block adds a gradient's partials in order. The same partials
// whichever launch runs them: alone, or in a multi-tensor norm with other gradients (codegen
// gives each member its own range of blocks), so the norm repeats from run to run either way.
__device__ __forceinline__ void sum_squares_part(acc_t* partial, const T* x, i64 n, i64 block, i64 blocks) {
  acc_t acc = 0;
  for (i64 i = block * blockDim.x + threadIdx.x; i < n; i += blocks * blockDim.x) { acc_t v = load(x[i]); acc += v * v; }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[block] = acc;
}
__device__ __forceinline__ void sum_squares_total(T* y, const acc_t* partial, i64 blocks) {
  acc_t acc = 0;
  for (i64 i = threadIdx.x; i < blocks; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) y[0] = store(acc);
}
extern "C" __global__ void sum_squares_blocks(acc_t* partial, const T* x, i64 n) { sum_squares_part(partial, x, n, blockIdx.x, gridDim.x); }
extern "C" __global__ void sum_squares_finish(T* y, const acc_t* partial, i64 blocks) { sum_squares_total(y, partial, blocks); }
"#;
