//! `xf.rope`: rotary position embedding, and `xf.rope_grad`, its transpose.

use crate::kernel::{dims, flat, Arg, DeviceKernel, KernelCx};
use super::{arity, float, head_dim, rank_is, AttrKind, OpDef, Signature, Slot, VjpCx};
use crate::attrs::Attrs;
use crate::graph::Value;
use crate::sharding::{Linearity, ShardingRule};
use crate::types::TensorTy;

/// Rotary position embedding in the rotate-half layout (Hugging Face Llama):
/// for each head `x[b, pos, head * d .. (head + 1) * d]` with head dimension `d`, `i < d/2` and
/// `angle = pos * theta^(-2i/d)`:
/// `y[i] = x[i] cos(angle) - x[i + d/2] sin(angle)`,
/// `y[i + d/2] = x[i + d/2] cos(angle) + x[i] sin(angle)`.
/// Operates on the projection `[batch, seq, heads * head_dim]` (`head_dim` an attribute, as
/// attention's); positions are `0..seq`.
#[derive(Debug)]
pub struct Rope;

impl OpDef for Rope {
    fn mnemonic(&self) -> &'static str {
        "rope"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        rope_launch(cx, 1.0)
    }
    fn summary(&self) -> &'static str {
        "rotary position embedding (rotate-half) on each head of [batch, seq, heads * head_dim]"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "T" }],
            results: &[Slot { name: "y", constraint: "T" }],
            attrs: &[("theta", AttrKind::Float), ("head_dim", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        check_rope(inputs, attrs)
    }
    fn flops_per_element(&self) -> f64 {
        // two multiplies and one add per element; the angles, one per position and pair, are
        // shared by the heads (a table on the CPU, once per thread on the device).
        3.0
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let attrs = cx.attrs.clone();
        Ok(vec![Some(cx.emit("xf.rope_grad", &[grads[0]], attrs)?)])
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Batch, positions and features free (split positions, under context parallelism,
        // offset the angles by the rank's part: see `position_factor`; the features split
        // into whole heads, which `head_dim` checks, so the rotated pairs stay whole). A
        // rotation is linear.
        ShardingRule::elementwise(3, 1, 1, Linearity::Sum)
    }
    fn position_factor(&self) -> Option<usize> {
        Some(1)
    }
}

/// The transpose of [`Rope`]: each pair is rotated by `-angle` (a rotation's inverse is its
/// transpose), which is the gradient of the rotation.
#[derive(Debug)]
pub struct RopeGrad;

impl OpDef for RopeGrad {
    fn mnemonic(&self) -> &'static str {
        "rope_grad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        rope_launch(cx, -1.0)
    }
    fn summary(&self) -> &'static str {
        "rotary embedding backward: rotate by -angle"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "dy", constraint: "T" }],
            results: &[Slot { name: "dx", constraint: "T" }],
            attrs: &[("theta", AttrKind::Float), ("head_dim", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        check_rope(inputs, attrs)
    }
    fn flops_per_element(&self) -> f64 {
        3.0
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Batch, positions and features free (split positions, under context parallelism,
        // offset the angles by the rank's part: see `position_factor`; the features split
        // into whole heads, which `head_dim` checks, so the rotated pairs stay whole). A
        // rotation is linear.
        ShardingRule::elementwise(3, 1, 1, Linearity::Sum)
    }
    fn position_factor(&self) -> Option<usize> {
        Some(1)
    }
}

/// Shape rule shared by `rope` and `rope_grad`.
fn check_rope(inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
    {
        arity(inputs, 1)?;
        let x = inputs[0];
        float("x", x)?;
        rank_is("x", x, 3)?;
        let d = head_dim(attrs)?;
        if d % 2 != 0 {
            return Err(format!("head_dim = {d} must be even for rotary embedding"));
        }
        if x.shape[2] <= 0 || x.shape[2] % d != 0 {
            return Err(format!("the features of {x} are not whole heads of head_dim = {d}"));
        }
        let theta = attrs.float("theta")?;
        if !(theta > 0.0 && theta.is_finite()) {
            return Err(format!("theta must be positive, got {theta}"));
        }
        Ok(vec![x.clone()])
    }
}

/// CUDA C of this file's ops (see [`crate::kernel`]).
const ROPE_CUDA: &str = r#"// Rotary embedding on [b, s, h * d], each head's rotate-half pairs (i, i + d/2); sign -1
// rotates back. `offset` is the index of this rank's first row (context parallelism; 0
// otherwise), in a sequence of `len` rows held in zigzag order of `chunks` chunks (1: the
// natural order).
// A thread per (row, pair) computes the pair's angle once, in double as the CPU's table, and
// rotates that pair in each of the row's h heads (consecutive threads, consecutive pairs: each
// head's loads and stores are coalesced).
extern "C" __global__ void rope(T* y, const T* x, i64 b, i64 s, i64 h, i64 d, double theta, double sign, i64 offset, i64 chunks, i64 len) {
  i64 half = d / 2;
  GRID_STRIDE(p, b * s * half) {
    i64 i = p % half, row = p / half, pos = zigzag_position(offset + row % s, len, chunks);
    double angle = (double)pos * pow(theta, -2.0 * (double)i / (double)d);
    acc_t c = (acc_t)cos(angle), sn = (acc_t)(sign * sin(angle));
    for (i64 head = 0; head < h; head++) {
      i64 base = (row * h + head) * d;
      acc_t lo = load(x[base + i]), hi = load(x[base + i + half]);
      y[base + i] = store(lo * c - hi * sn);
      y[base + i + half] = store(hi * c + lo * sn);
    }
  }
}
"#;

/// Rotary embedding (`sign` 1) or its inverse (-1) over `[b, s, h * d]`.
fn rope_launch(cx: &KernelCx<'_>, sign: f64) -> Result<DeviceKernel, String> {
    let x = dims(cx.inputs[0]);
    let d = head_dim(cx.attrs)? as usize;
    let (b, s, h) = (x[0], x[1], x[2] / d);
    let args = vec![Arg::Out(0), Arg::In(0), Arg::Int(b as i64), Arg::Int(s as i64), Arg::Int(h as i64), Arg::Int(d as i64), Arg::Float(cx.attrs.float("theta")?), Arg::Float(sign), Arg::RankOffset];
    let (chunks, len) = super::zigzag_of(cx.attrs.ints(super::ZIGZAG_ATTR).ok().as_deref());
    let mut args = args;
    args.extend([Arg::Int(chunks as i64), Arg::Int(len as i64)]);
    Ok(DeviceKernel::Launches(vec![flat("rope", ROPE_CUDA, b * s * (d / 2), args)]))
}
