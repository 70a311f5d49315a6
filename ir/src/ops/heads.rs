//! Layout ops: `xf.slice` and its transpose `xf.pad`, `xf.zigzag` (context parallelism's
//! order of the sequence), and `xf.repeat_heads` with its transpose `xf.sum_heads`.
//!
//! Heads stay side by side in the features, `[b, s, heads * head_dim]`, as the projections
//! write them: the ops that work per head (attention, rotary embedding, these repeats) take
//! `head_dim` and read each head at a row stride, so no copy ever puts heads first.

use crate::kernel::{dims, elements, flat, Arg, DeviceKernel, KernelCx};
use super::{arity, float, head_dim, io_bytes, positive, rank_is, AttrKind, Cost, OpDef, Signature, Slot, VjpCx};
use crate::attrs::{AttrValue, Attrs};
use crate::graph::Value;
use crate::sharding::{FactorKind, Linearity, ShardingRule};
use crate::types::TensorTy;

/// `y = x[..., start:start+size, ...]` along `axis` (e.g. the first `seq` rows of the learned
/// position table).
#[derive(Debug)]
pub struct Slice;

impl OpDef for Slice {
    fn mnemonic(&self) -> &'static str {
        "slice"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        slice_pad_launch(cx.inputs[0], &cx.outputs[0], cx.attrs, false)
    }
    fn summary(&self) -> &'static str {
        "contiguous slice x[start:start+size] along one axis"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "T" }],
            results: &[Slot { name: "y", constraint: "U" }],
            attrs: &[("axis", AttrKind::Int), ("start", AttrKind::Int), ("size", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        let x = inputs[0];
        let axis = attrs.int("axis")?;
        let start = attrs.int("start")?;
        let size = positive("size", attrs.int("size")?)?;
        let Some(&extent) = usize::try_from(axis).ok().and_then(|a| x.shape.get(a)) else {
            return Err(format!("axis {axis} is out of range for {x}"));
        };
        if start < 0 || start.checked_add(size).is_none_or(|end| end > extent) {
            return Err(format!("slice [{start}, {start}+{size}) is out of range for axis {axis} of {x}"));
        }
        let mut shape = x.shape.clone();
        shape[axis as usize] = size;
        Ok(vec![TensorTy::new(shape, x.dtype)])
    }
    fn cost(&self, _inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        // Reads only the rows it keeps.
        Cost { flops: 0.0, bytes: 2.0 * outputs.iter().map(|t| t.bytes() as f64).sum::<f64>(), special: 0.0 }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let axis = cx.attrs.int("axis")?;
        let extent = cx.ty(cx.operands[0])?.shape[axis as usize];
        let attrs = Attrs::new()
            .with("axis", AttrValue::Int(axis))
            .with("start", AttrValue::Int(cx.attrs.int("start")?))
            .with("size", AttrValue::Int(extent));
        Ok(vec![Some(cx.emit("xf.pad", &[grads[0]], attrs)?)])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], attrs: &Attrs) -> ShardingRule {
        let axis = attrs.int("axis").unwrap_or(0).max(0) as usize;
        ShardingRule::elementwise(inputs[0].rank(), 1, 1, Linearity::Sum).block(axis.min(inputs[0].rank().saturating_sub(1)))
    }
}

/// Position of row `p` of a sequence of `len` rows held in zigzag order of `chunks` equal
/// chunks: part `r` of `chunks / 2` holds chunk `r`, then chunk `chunks - 1 - r` (context
/// parallelism's load balancing under a causal mask, as Megatron-LM orders the sequence for
/// cp ranks: every rank gets one early and one late chunk). With `chunks <= 1`, `p` itself.
pub fn zigzag_position(p: usize, len: usize, chunks: usize) -> usize {
    if chunks <= 1 || len < chunks {
        return p;
    }
    let c = len / chunks;
    let (pair, within) = (p / (2 * c), p % (2 * c));
    let chunk = if within < c { pair } else { chunks - 1 - pair };
    chunk * c + within % c
}

/// The row of a sequence of `len` rows in zigzag order of `chunks` chunks that holds position
/// `q`: the inverse of [`zigzag_position`].
pub fn zigzag_row(q: usize, len: usize, chunks: usize) -> usize {
    if chunks <= 1 || len < chunks {
        return q;
    }
    let c = len / chunks;
    let (chunk, within) = (q / c, q % c);
    if chunk < chunks / 2 { chunk * 2 * c + within } else { (chunks - 1 - chunk) * 2 * c + c + within }
}

/// The zigzag order's attribute on ops that read positions: `[chunks, len]`, see
/// [`zigzag_position`]. Absent: natural order.
pub const ZIGZAG_ATTR: &str = "xf.zigzag";

/// `chunks` and `len` of an op's [`ZIGZAG_ATTR`] (its integers), `(1, 0)` (natural order)
/// without one.
pub fn zigzag_of(ints: Option<&[i64]>) -> (usize, usize) {
    match ints {
        Some(&[chunks, len]) => (usize::try_from(chunks).unwrap_or(1), usize::try_from(len).unwrap_or(0)),
        _ => (1, 0),
    }
}

/// Reorders one dimension into zigzag order (`y[p] = x[zigzag_position(p)]`), or back with
/// `inverse` (its transpose: the gradient). Context parallelism lowers a causal model on its
/// sequence in this order, so that the contiguous part each cp rank takes holds one early and
/// one late chunk.
#[derive(Debug)]
pub struct Zigzag;

impl OpDef for Zigzag {
    fn mnemonic(&self) -> &'static str {
        "zigzag"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let x = cx.inputs[0];
        let (axis, chunks) = zigzag_attrs(cx.attrs)?;
        let d = dims(x);
        let outer: usize = d[..axis].iter().product();
        let inner: usize = d[axis + 1..].iter().product();
        let kernel = if x.dtype == crate::types::DType::I32 { "zigzag_i32" } else { "zigzag" };
        let args = vec![Arg::Out(0), Arg::In(0), Arg::Int(outer as i64), Arg::Int(d[axis] as i64), Arg::Int(inner as i64), Arg::Int(chunks), Arg::Int(cx.attrs.bool("inverse")? as i64)];
        Ok(DeviceKernel::Launches(vec![flat(kernel, HEADS_CUDA, elements(x), args)]))
    }
    fn summary(&self) -> &'static str {
        "reorder one axis into zigzag order of `chunks` chunks (part r: chunks r and chunks-1-r), or back"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "T" }],
            results: &[Slot { name: "y", constraint: "T" }],
            attrs: &[("axis", AttrKind::Int), ("chunks", AttrKind::Int), ("inverse", AttrKind::Bool)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        let x = inputs[0];
        let (axis, chunks) = zigzag_attrs(attrs)?;
        attrs.bool("inverse")?;
        let Some(&extent) = x.shape.get(axis) else {
            return Err(format!("axis {axis} is out of range for {x}"));
        };
        if chunks < 2 || chunks % 2 != 0 || extent % chunks != 0 {
            return Err(format!("zigzag order needs an even number of chunks (got {chunks}) that divides axis {axis} of {x}"));
        }
        Ok(vec![x.clone()])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        Cost { flops: 0.0, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        if !cx.ty(cx.operands[0])?.dtype.is_float() {
            return Ok(vec![None]);
        }
        let attrs = cx.attrs.clone().with("inverse", AttrValue::Bool(!cx.attrs.bool("inverse")?));
        Ok(vec![Some(cx.emit("xf.zigzag", &[grads[0]], attrs)?)])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], attrs: &Attrs) -> ShardingRule {
        // The reordered axis stays whole (a row moves between parts); a permutation is linear.
        let axis = attrs.int("axis").unwrap_or(0).max(0) as usize;
        ShardingRule::elementwise(inputs[0].rank(), 1, 1, Linearity::Sum).block(axis.min(inputs[0].rank().saturating_sub(1)))
    }
}

fn zigzag_attrs(attrs: &Attrs) -> Result<(usize, i64), String> {
    let axis = usize::try_from(attrs.int("axis")?).map_err(|_| "axis must not be negative".to_string())?;
    Ok((axis, attrs.int("chunks")?))
}

/// `y` is zeros of extent `size` along `axis` with `x` written at `start`: the transpose of
/// [`Slice`] (its gradient).
#[derive(Debug)]
pub struct Pad;

impl OpDef for Pad {
    fn mnemonic(&self) -> &'static str {
        "pad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        slice_pad_launch(&cx.outputs[0], cx.inputs[0], cx.attrs, true)
    }
    fn summary(&self) -> &'static str {
        "zero-pad x to extent size along axis, x at offset start (slice's transpose)"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "T" }],
            results: &[Slot { name: "y", constraint: "U" }],
            attrs: &[("axis", AttrKind::Int), ("start", AttrKind::Int), ("size", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 1)?;
        let x = inputs[0];
        let axis = attrs.int("axis")?;
        let start = attrs.int("start")?;
        let size = positive("size", attrs.int("size")?)?;
        let Some(&extent) = usize::try_from(axis).ok().and_then(|a| x.shape.get(a)) else {
            return Err(format!("axis {axis} is out of range for {x}"));
        };
        if start < 0 || start.checked_add(extent).is_none_or(|end| end > size) {
            return Err(format!("{x} at offset {start} does not fit in extent {size} along axis {axis}"));
        }
        let mut shape = x.shape.clone();
        shape[axis as usize] = size;
        Ok(vec![TensorTy::new(shape, x.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        Cost { flops: 0.0, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], attrs: &Attrs) -> ShardingRule {
        let axis = attrs.int("axis").unwrap_or(0).max(0) as usize;
        ShardingRule::elementwise(inputs[0].rank(), 1, 1, Linearity::Sum).block(axis.min(inputs[0].rank().saturating_sub(1)))
    }
}

/// Checks `[b, s, h * d]` and the `times` and `head_dim` attributes of the head-repeat ops;
/// returns `x`, `times` and `h`.
fn check_heads(inputs: &[&TensorTy], attrs: &Attrs) -> Result<(TensorTy, i64, i64), String> {
    arity(inputs, 1)?;
    let x = inputs[0];
    float("x", x)?;
    rank_is("x", x, 3)?;
    let d = head_dim(attrs)?;
    if x.shape[2] <= 0 || x.shape[2] % d != 0 {
        return Err(format!("the features of {x} are not whole heads of head_dim = {d}"));
    }
    Ok((x.clone(), positive("times", attrs.int("times")?)?, x.shape[2] / d))
}

/// `y[b, s, head j] = x[b, s, head j / times]`: each head repeated `times` times in place, so
/// grouped key/value heads line up with the query heads (what tensor parallelism needs when
/// it cannot split the key/value heads themselves).
#[derive(Debug)]
pub struct RepeatHeads;

impl OpDef for RepeatHeads {
    fn mnemonic(&self) -> &'static str {
        "repeat_heads"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        repeat_launch(cx.inputs[0], &cx.outputs[0], cx.attrs, false)
    }
    fn summary(&self) -> &'static str {
        "[b, s, h*d] -> [b, s, h*times*d], head j reads head j / times"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "T" }],
            results: &[Slot { name: "y", constraint: "U" }],
            attrs: &[("times", AttrKind::Int), ("head_dim", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        let (x, times, _) = check_heads(inputs, attrs)?;
        let width = x.shape[2].checked_mul(times).ok_or_else(|| format!("{x} repeated {times} times is too large"))?;
        Ok(vec![TensorTy::new([x.shape[0], x.shape[1], width], x.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        Cost { flops: 0.0, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Batch free; the input heads stay whole; the output heads (their own factor) are
        // sliced by whoever needs them split.
        let factors = vec![FactorKind::Free, FactorKind::Blocked, FactorKind::Blocked, FactorKind::Blocked];
        ShardingRule { operands: vec![vec![0, 1, 2]], results: vec![vec![0, 1, 3]], factors, linearity: Linearity::Sum }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let attrs = cx.attrs.clone();
        Ok(vec![Some(cx.emit("xf.sum_heads", &[grads[0]], attrs)?)])
    }
}

/// `y[b, s, head i] = sum over k < times of x[b, s, head i * times + k]`: the transpose of
/// [`RepeatHeads`].
#[derive(Debug)]
pub struct SumHeads;

impl OpDef for SumHeads {
    fn mnemonic(&self) -> &'static str {
        "sum_heads"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        repeat_launch(&cx.outputs[0], cx.inputs[0], cx.attrs, true)
    }
    fn summary(&self) -> &'static str {
        "[b, s, h*times*d] -> [b, s, h*d], summing each group of times heads"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "T" }],
            results: &[Slot { name: "y", constraint: "U" }],
            attrs: &[("times", AttrKind::Int), ("head_dim", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        let (x, times, heads) = check_heads(inputs, attrs)?;
        if heads % times != 0 {
            return Err(format!("{heads} heads do not form groups of {times}"));
        }
        Ok(vec![TensorTy::new([x.shape[0], x.shape[1], x.shape[2] / times], x.dtype)])
    }
    fn flops_per_element(&self) -> f64 {
        1.0
    }
    fn sharding_rule(&self, _inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        let factors = vec![FactorKind::Free, FactorKind::Blocked, FactorKind::Blocked, FactorKind::Blocked];
        ShardingRule { operands: vec![vec![0, 1, 2]], results: vec![vec![0, 1, 3]], factors, linearity: Linearity::Sum }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let attrs = cx.attrs.clone();
        Ok(vec![Some(cx.emit("xf.repeat_heads", &[grads[0]], attrs)?)])
    }
}

/// CUDA C of this file's ops (see [`crate::kernel`]).
const HEADS_CUDA: &str = r#"// [outer, n, inner] reordered along n into zigzag order of `chunks` chunks, or back.
#define ZIGZAG_BODY \
  GRID_STRIDE(i, outer * n * inner) { \
    i64 o = i / (n * inner), p = (i / inner) % n, c = i % inner; \
    i64 q = zigzag_position(p, n, chunks); \
    if (inverse) y[(o * n + q) * inner + c] = x[i]; else y[i] = x[(o * n + q) * inner + c]; \
  }
extern "C" __global__ void zigzag(T* y, const T* x, i64 outer, i64 n, i64 inner, i64 chunks, i64 inverse) { ZIGZAG_BODY }
extern "C" __global__ void zigzag_i32(int* y, const int* x, i64 outer, i64 n, i64 inner, i64 chunks, i64 inverse) { ZIGZAG_BODY }
// [outer, full, inner] -> [outer, part, inner] from `start` (slice), or back with zeros (pad).
extern "C" __global__ void slice_pad(T* y, const T* x, i64 outer, i64 full, i64 part, i64 inner, i64 start, i64 pad) {
  i64 extent = pad ? full : part;
  GRID_STRIDE(i, outer * extent * inner) {
    i64 e = i % inner, a = (i / inner) % extent, o = i / (inner * extent);
    if (pad) { i64 p = a - start; y[i] = (p >= 0 && p < part) ? x[(o * part + p) * inner + e] : store((acc_t)0); }
    else y[i] = x[(o * full + start + a) * inner + e];
  }
}
// Each of `heads` heads of `block` values in each of `b` rows copied `times` times, or (sum)
// each group of `times` heads summed in order.
extern "C" __global__ void repeat_heads(T* y, const T* x, i64 b, i64 heads, i64 times, i64 block, i64 sum) {
  if (sum) {
    GRID_STRIDE(i, b * heads * block) {
      i64 e = i % block, h = (i / block) % heads, bi = i / (block * heads);
      acc_t acc = 0;
      for (i64 k = 0; k < times; k++) acc += load(x[(bi * heads * times + h * times + k) * block + e]);
      y[i] = store(acc);
    }
  } else {
    GRID_STRIDE(i, b * heads * times * block) {
      i64 e = i % block, hh = (i / block) % (heads * times), bi = i / (block * heads * times);
      y[i] = x[(bi * heads + hh / times) * block + e];
    }
  }
}
"#;

/// `slice` (`full` is the operand) or `pad` (`full` is the result) along `axis`.
fn slice_pad_launch(full: &TensorTy, part: &TensorTy, attrs: &Attrs, pad: bool) -> Result<DeviceKernel, String> {
    let axis = attrs.int("axis")? as usize;
    let (f, p) = (dims(full), dims(part));
    let outer: usize = f[..axis].iter().product();
    let inner: usize = f[axis + 1..].iter().product();
    let args = vec![Arg::Out(0), Arg::In(0), Arg::Int(outer as i64), Arg::Int(f[axis] as i64), Arg::Int(p[axis] as i64), Arg::Int(inner as i64), Arg::Int(attrs.int("start")?), Arg::Int(pad as i64)];
    Ok(DeviceKernel::Launches(vec![flat("slice_pad", HEADS_CUDA, elements(if pad { full } else { part }), args)]))
}

/// `repeat_heads` (`small` is the operand) or `sum_heads` (`small` is the result).
fn repeat_launch(small: &TensorTy, large: &TensorTy, attrs: &Attrs, sum: bool) -> Result<DeviceKernel, String> {
    let times = attrs.int("times")?.max(1);
    let d = head_dim(attrs)? as usize;
    let s = dims(small);
    // Rows of the sequence, each `heads` heads of d.
    let args = vec![Arg::Out(0), Arg::In(0), Arg::Int((s[0] * s[1]) as i64), Arg::Int((s[2] / d) as i64), Arg::Int(times), Arg::Int(d as i64), Arg::Int(sum as i64)];
    Ok(DeviceKernel::Launches(vec![flat("repeat_heads", HEADS_CUDA, elements(if sum { small } else { large }), args)]))
}

#[cfg(test)]
mod tests {
    use super::zigzag_position;

    /// The zigzag order is a permutation, and under a causal mask it gives every cp rank the
    /// same attention work (within 5%), where contiguous parts give the last rank 2cp - 1
    /// times the first's (issue 20).
    #[test]
    fn zigzag_order_is_a_permutation_that_balances_causal_attention() {
        for cp in [2usize, 4, 8, 16] {
            let len = 2 * cp * 16;
            let mut seen = vec![false; len];
            for p in 0..len {
                let q = zigzag_position(p, len, 2 * cp);
                assert!(!seen[q], "cp={cp}: position {q} twice");
                seen[q] = true;
            }
            // Per rank: the keys its queries see (a query at position q sees q + 1 keys).
            let work = |position: &dyn Fn(usize) -> usize| -> Vec<usize> { (0..cp).map(|r| (r * len / cp..(r + 1) * len / cp).map(|p| position(p) + 1).sum()).collect() };
            let balanced = work(&|p| zigzag_position(p, len, 2 * cp));
            let (most, least) = (*balanced.iter().max().unwrap() as f64, *balanced.iter().min().unwrap() as f64);
            assert!(most / least <= 1.05, "cp={cp}: zigzag work per rank {balanced:?}");
            let contiguous = work(&|p| p);
            assert!(*contiguous.last().unwrap() as f64 / contiguous[0] as f64 > 2.0, "cp={cp}: {contiguous:?}");
        }
        // The natural order where there is no zigzag.
        assert_eq!((0..8).map(|p| zigzag_position(p, 8, 1)).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
        assert_eq!((0..8).map(|p| zigzag_position(p, 8, 4)).collect::<Vec<_>>(), [0, 1, 6, 7, 2, 3, 4, 5]);
    }
}
