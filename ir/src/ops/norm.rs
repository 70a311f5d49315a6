//! Normalisations over the last dimension, `xf.layernorm` and `xf.rmsnorm`, and their
//! backward ops (which recompute the row statistics instead of storing them).

use crate::kernel::{elements, flat, last, per_row, Arg, DeviceKernel, KernelCx, Launch};
use super::{arity, float, rank_at_least, AttrKind, OpDef, Signature, Slot, VjpCx};
use crate::attrs::Attrs;
use crate::graph::Value;
use crate::sharding::{FactorKind, Linearity, ShardingRule};
use crate::types::TensorTy;

/// Checks that a per-feature parameter (`gamma`, `beta`) is a vector of the last dimension.
fn feature_vector(what: &str, x: &TensorTy, p: &TensorTy) -> Result<(), String> {
    float(what, p)?;
    if p.shape.len() == 1 && Some(p.shape[0]) == x.last_dim() && p.dtype == x.dtype {
        Ok(())
    } else {
        Err(format!("{what} {p} must be a vector of the last dimension of x {x}"))
    }
}

/// Checks the `epsilon` attribute.
fn epsilon(attrs: &Attrs) -> Result<(), String> {
    let eps = attrs.float("epsilon")?;
    if eps > 0.0 && eps.is_finite() { Ok(()) } else { Err(format!("epsilon must be positive, got {eps}")) }
}

/// `y = (x - mean) / sqrt(var + epsilon) * gamma + beta` over the last dimension
/// (biased variance, as in PyTorch).
#[derive(Debug)]
pub struct LayerNorm;

impl OpDef for LayerNorm {
    fn mnemonic(&self) -> &'static str {
        "layernorm"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        norm_launch(cx, true)
    }
    fn summary(&self) -> &'static str {
        "(x - mean) / sqrt(var + epsilon) * gamma + beta over the last dim"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "x", constraint: "T" },
                Slot { name: "gamma", constraint: "P" },
                Slot { name: "beta", constraint: "P" },
            ],
            results: &[Slot { name: "y", constraint: "T" }],
            attrs: &[("epsilon", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        float("x", inputs[0])?;
        rank_at_least("x", inputs[0], 1)?;
        feature_vector("gamma", inputs[0], inputs[1])?;
        feature_vector("beta", inputs[0], inputs[2])?;
        epsilon(attrs)?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        // mean, centre, square, variance sum, normalise, scale, shift (+ the row's rsqrt).
        8.0
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let (x, gamma) = (cx.operands[0], cx.operands[1]);
        let attrs = cx.attrs.clone();
        let d = cx.emit_multi("xf.layernorm_grad", &[x, gamma, grads[0]], attrs)?;
        Ok(vec![Some(d[0]), Some(d[1]), Some(d[2])])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        norm_rule(inputs[0], 2, false, 1, 0)
    }
}

/// `y = x / sqrt(mean(x^2) + epsilon) * gamma` over the last dimension (Llama's norm).
#[derive(Debug)]
pub struct RmsNorm;

impl OpDef for RmsNorm {
    fn mnemonic(&self) -> &'static str {
        "rmsnorm"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        norm_launch(cx, false)
    }
    fn summary(&self) -> &'static str {
        "x / sqrt(mean(x^2) + epsilon) * gamma over the last dim"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "T" }, Slot { name: "gamma", constraint: "P" }],
            results: &[Slot { name: "y", constraint: "T" }],
            attrs: &[("epsilon", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        float("x", inputs[0])?;
        rank_at_least("x", inputs[0], 1)?;
        feature_vector("gamma", inputs[0], inputs[1])?;
        epsilon(attrs)?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        5.0
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let (x, gamma) = (cx.operands[0], cx.operands[1]);
        let attrs = cx.attrs.clone();
        let d = cx.emit_multi("xf.rmsnorm_grad", &[x, gamma, grads[0]], attrs)?;
        Ok(vec![Some(d[0]), Some(d[1])])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        norm_rule(inputs[0], 1, false, 1, 0)
    }
}

/// Checks `(x, gamma, dy)` of a norm's backward op.
fn backward_operands(inputs: &[&TensorTy], attrs: &Attrs) -> Result<(), String> {
    arity(inputs, 3)?;
    float("x", inputs[0])?;
    rank_at_least("x", inputs[0], 1)?;
    feature_vector("gamma", inputs[0], inputs[1])?;
    if inputs[2] != inputs[0] {
        return Err(format!("dy {} must have the type of x {}", inputs[2], inputs[0]));
    }
    epsilon(attrs)
}

/// LayerNorm backward: with `xhat = (x - mean) * rstd` per row of `n` features and
/// `g = dy * gamma`: `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`,
/// `dgamma = sum over rows of dy * xhat`, `dbeta = sum over rows of dy`.
#[derive(Debug)]
pub struct LayerNormGrad;

impl OpDef for LayerNormGrad {
    fn mnemonic(&self) -> &'static str {
        "layernorm_grad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        norm_grad_launches(cx, true)
    }
    fn summary(&self) -> &'static str {
        "layernorm backward: (dx, dgamma, dbeta) from x, gamma, dy"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "x", constraint: "T" },
                Slot { name: "gamma", constraint: "P" },
                Slot { name: "dy", constraint: "T" },
            ],
            results: &[
                Slot { name: "dx", constraint: "T" },
                Slot { name: "dgamma", constraint: "P" },
                Slot { name: "dbeta", constraint: "P" },
            ],
            attrs: &[("epsilon", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        backward_operands(inputs, attrs)?;
        Ok(vec![inputs[0].clone(), inputs[1].clone(), inputs[1].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        // Counted per element of every result; the work is ~14 per element of x.
        14.0 / 3.0
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // dgamma and dbeta sum over rows: split rows leave them partial.
        norm_rule(inputs[0], 1, true, 1, 2)
    }
}

/// RMSNorm backward: with `xhat = x * rstd` and `g = dy * gamma`:
/// `dx = rstd * (g - xhat * mean(g * xhat))`, `dgamma = sum over rows of dy * xhat`.
#[derive(Debug)]
pub struct RmsNormGrad;

impl OpDef for RmsNormGrad {
    fn mnemonic(&self) -> &'static str {
        "rmsnorm_grad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        norm_grad_launches(cx, false)
    }
    fn summary(&self) -> &'static str {
        "rmsnorm backward: (dx, dgamma) from x, gamma, dy"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "x", constraint: "T" },
                Slot { name: "gamma", constraint: "P" },
                Slot { name: "dy", constraint: "T" },
            ],
            results: &[Slot { name: "dx", constraint: "T" }, Slot { name: "dgamma", constraint: "P" }],
            attrs: &[("epsilon", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        backward_operands(inputs, attrs)?;
        Ok(vec![inputs[0].clone(), inputs[1].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        5.0
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        norm_rule(inputs[0], 1, true, 1, 1)
    }
}

/// `x [..., h]` with per-feature parameters `[h]`: rows free, the normalised h blocked.
/// `params` parameter operands follow x (and `dy` after them for backward ops); results are
/// x-shaped `x_results` then `param_results` vectors of h.
fn norm_rule(x: &TensorTy, params: usize, with_dy: bool, x_results: usize, param_results: usize) -> ShardingRule {
    let r = x.rank();
    let xs: Vec<usize> = (0..r).collect();
    let h = vec![r - 1];
    let mut operands = vec![xs.clone()];
    operands.extend(std::iter::repeat_n(h.clone(), params));
    if with_dy {
        operands.push(xs.clone());
    }
    let mut results = vec![xs; x_results];
    results.extend(std::iter::repeat_n(h, param_results));
    let mut factors = vec![FactorKind::Free; r];
    factors[r - 1] = FactorKind::Blocked;
    ShardingRule { operands, results, factors, linearity: Linearity::None }
}

/// CUDA C of this file's ops (see [`crate::kernel`]).
const NORM_CUDA: &str = r#"// A row's mean (0 unless centered) and 1 / sqrt(variance + eps), by the whole block.
__device__ void row_stats(const T* xr, i64 n, double eps, i64 centered, acc_t* mean_out, acc_t* rstd_out) {
  acc_t mean = 0, q = 0;
  if (centered) {
    acc_t s = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += load(xr[j]);
    mean = block_sum(s) / (acc_t)n;
  }
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) { acc_t v = load(xr[j]) - mean; q += v * v; }
  *mean_out = mean;
  *rstd_out = (acc_t)1 / sqrt(block_sum(q) / (acc_t)n + (acc_t)eps);
}
// One block per row: layernorm (centered, with beta) or rmsnorm (beta null).
extern "C" __global__ void norm_rows(T* y, const T* x, const T* gamma, const T* beta, i64 rows, i64 n, double eps, i64 centered) {
  i64 r = ROW_INDEX;
  if (r >= rows) return;
  const T* xr = x + r * n;
  acc_t mean, rstd;
  row_stats(xr, n, eps, centered, &mean, &rstd);
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    acc_t v = (load(xr[j]) - mean) * rstd * load(gamma[j]);
    if (beta) v += load(beta[j]);
    y[r * n + j] = store(v);
  }
}
// Backward, per row: dx, and each row's (mean, rstd) into `stats` for norm_grad_params.
extern "C" __global__ void norm_grad_rows(T* dx, acc_t* stats, const T* x, const T* gamma, const T* dy, i64 rows, i64 n, double eps, i64 centered) {
  i64 r = ROW_INDEX;
  if (r >= rows) return;
  const T* xr = x + r * n;
  const T* dyr = dy + r * n;
  acc_t mean, rstd;
  row_stats(xr, n, eps, centered, &mean, &rstd);
  acc_t g_sum = 0, gx_sum = 0;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    acc_t g = load(dyr[j]) * load(gamma[j]);
    g_sum += g;
    gx_sum += g * (load(xr[j]) - mean) * rstd;
  }
  g_sum = block_sum(g_sum);
  gx_sum = block_sum(gx_sum);
  acc_t mean_g = centered ? g_sum / (acc_t)n : (acc_t)0, mean_gx = gx_sum / (acc_t)n;
  for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
    acc_t xhat = (load(xr[j]) - mean) * rstd;
    dx[r * n + j] = store(rstd * (load(dyr[j]) * load(gamma[j]) - mean_g - xhat * mean_gx));
  }
  if (threadIdx.x == 0) { stats[2 * r] = mean; stats[2 * r + 1] = rstd; }
}
// One thread per feature sums its column over the rows in order: dgamma and dbeta (if any).
extern "C" __global__ void norm_grad_params(T* dgamma, T* dbeta, const acc_t* stats, const T* x, const T* dy, i64 rows, i64 n) {
  GRID_STRIDE(j, n) {
    acc_t dg = 0, db = 0;
    for (i64 r = 0; r < rows; r++) {
      acc_t d = load(dy[r * n + j]);
      dg += d * (load(x[r * n + j]) - stats[2 * r]) * stats[2 * r + 1];
      db += d;
    }
    dgamma[j] = store(dg);
    if (dbeta) dbeta[j] = store(db);
  }
}
"#;

/// Rows and features of a norm's `x`.
fn norm_rows(x: &TensorTy) -> (usize, usize) {
    let n = last(x).max(1);
    (elements(x) / n, n)
}

/// `layernorm` (`centered`: with mean and beta) or `rmsnorm`, one block per row.
fn norm_launch(cx: &KernelCx<'_>, centered: bool) -> Result<DeviceKernel, String> {
    let (rows, n) = norm_rows(cx.inputs[0]);
    let beta = if centered { Arg::In(2) } else { Arg::Null };
    let args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), beta, Arg::Int(rows as i64), Arg::Int(n as i64), Arg::Float(cx.attrs.float("epsilon")?), Arg::Int(centered as i64)];
    Ok(DeviceKernel::Launches(vec![per_row("norm_rows", NORM_CUDA, rows, args)]))
}

/// Backward of a norm: `dx` per row (saving the row statistics), then `dgamma` (and `dbeta`)
/// per feature.
fn norm_grad_launches(cx: &KernelCx<'_>, centered: bool) -> Result<DeviceKernel, String> {
    let (rows, n) = norm_rows(cx.inputs[0]);
    let (r, f) = (Arg::Int(rows as i64), Arg::Int(n as i64));
    let row_args = vec![Arg::Out(0), Arg::Workspace, Arg::In(0), Arg::In(1), Arg::In(2), r.clone(), f.clone(), Arg::Float(cx.attrs.float("epsilon")?), Arg::Int(centered as i64)];
    let dbeta = if centered { Arg::Out(2) } else { Arg::Null };
    let param_args = vec![Arg::Out(1), dbeta, Arg::Workspace, Arg::In(0), Arg::In(2), r, f];
    Ok(DeviceKernel::Launches(vec![
        Launch { workspace: 2 * rows, ..per_row("norm_grad_rows", NORM_CUDA, rows, row_args) },
        Launch { workspace: 2 * rows, ..flat("norm_grad_params", NORM_CUDA, n, param_args) },
    ]))
}
