//! CPU kernels of every `xf` op, generic over f32 and f64.
//!
//! Semantics are those documented on the ops in `ir/src/ops`. Parallel loops split work over
//! rows (rayon); every reduction across rows sums fixed chunks in a fixed order, so results
//! are bit-identical from run to run whatever the thread schedule.

use num_traits::Float;
use rayon::prelude::*;

use super::gemm::{matmul as gemm_matmul, Strided};
use super::{Element, In, Out, RankCx};
use crate::program::{DType, Instr};

/// Float types with kernels.
pub(crate) trait Real: Float + Element + std::iter::Sum + std::ops::AddAssign + std::ops::SubAssign + std::ops::MulAssign + Send + Sync {
    fn of(v: f64) -> Self;
}
impl Real for f32 {
    fn of(v: f64) -> Self {
        v as f32
    }
}
impl Real for f64 {
    fn of(v: f64) -> Self {
        v
    }
}

/// Ops with a CPU kernel.
const SUPPORTED: &[&str] = &[
    "xf.embedding", "xf.embedding_grad", "xf.matmul", "xf.matmul_wgrad", "xf.add", "xf.mul", "xf.scale", "xf.fill_like",
    "xf.sum_leading", "xf.gelu", "xf.gelu_grad", "xf.silu", "xf.silu_grad", "xf.swiglu", "xf.swiglu_grad", "xf.layernorm",
    "xf.layernorm_grad", "xf.rmsnorm", "xf.rmsnorm_grad", "xf.rope", "xf.rope_grad", "xf.split_heads", "xf.merge_heads",
    "xf.slice", "xf.pad", "xf.repeat_heads", "xf.sum_heads", "xf.attention", "xf.attention_grad", "xf.cross_entropy", "xf.cross_entropy_grad", "xf.adamw",
    "xf.sgd", "xf.row_max", "xf.wait", "xf.cross_entropy_stats", "xf.cross_entropy_finish", "xf.cross_entropy_grad_shard", "xf.cast",
    "xf.sum_squares", "xf.clip_coef", "xf.constant",
];

/// Whether `op` has a CPU kernel.
pub(crate) fn supported(op: &str) -> bool {
    SUPPORTED.contains(&op)
}

/// Rows handled per parallel task in row-wise kernels and fixed-order reductions.
const ROW_CHUNK: usize = 16;

/// Runs one instruction.
pub(crate) fn run(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    if instr.op == "xf.cast" {
        return cast(ins, outs);
    }
    let float = ins.iter().map(|i| i.dtype()).chain(outs.iter().map(|o| o.buffer.dtype)).find(|d| *d != DType::I32);
    match float {
        Some(DType::F64) => run_typed::<f64>(instr, ins, outs, cx),
        _ => run_typed::<f32>(instr, ins, outs, cx),
    }
}

/// `xf.cast`: the value in the result's type (bf16 operands and results arrive widened to
/// f32; the executor rounds a bf16 result).
fn cast(ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    match (ins[0].dtype(), outs[0].buffer.dtype) {
        (DType::F32, DType::F32) => outs[0].get::<f32>()?.copy_from_slice(ins[0].get::<f32>()?),
        (DType::F64, DType::F64) => outs[0].get::<f64>()?.copy_from_slice(ins[0].get::<f64>()?),
        (DType::F32, DType::F64) => outs[0].get::<f64>()?.iter_mut().zip(ins[0].get::<f32>()?).for_each(|(d, &s)| *d = s as f64),
        (DType::F64, DType::F32) => outs[0].get::<f32>()?.iter_mut().zip(ins[0].get::<f64>()?).for_each(|(d, &s)| *d = s as f32),
        (from, to) => return Err(format!("no cast from {from:?} to {to:?}")),
    }
    Ok(())
}

fn run_typed<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    match instr.op.as_str() {
        "xf.embedding" => embedding::<T>(ins, outs, cx),
        "xf.embedding_grad" => embedding_grad::<T>(ins, outs),
        "xf.matmul" => matmul::<T>(instr, ins, outs),
        "xf.matmul_wgrad" => matmul_wgrad::<T>(ins, outs),
        "xf.add" => broadcast::<T>(ins, outs, |a, b| a + b),
        "xf.mul" => broadcast::<T>(ins, outs, |a, b| a * b),
        "xf.scale" => {
            let factor = T::of(instr.float("factor")?);
            unary::<T>(ins, outs, |x| x * factor)
        }
        "xf.fill_like" | "xf.constant" => {
            outs[0].get::<T>()?.fill(T::of(instr.float("value")?));
            Ok(())
        }
        "xf.sum_leading" => sum_leading::<T>(ins, outs),
        "xf.gelu" => unary::<T>(ins, outs, gelu),
        "xf.gelu_grad" => binary::<T>(ins, outs, |x, dy| dy * gelu_derivative(x)),
        "xf.silu" => unary::<T>(ins, outs, |x| x * sigmoid(x)),
        "xf.silu_grad" => binary::<T>(ins, outs, |x, dy| dy * silu_derivative(x)),
        "xf.swiglu" => binary::<T>(ins, outs, |g, u| g * sigmoid(g) * u),
        "xf.swiglu_grad" => swiglu_grad::<T>(ins, outs),
        "xf.layernorm" => layernorm::<T>(instr, ins, outs),
        "xf.layernorm_grad" => norm_grad::<T>(instr, ins, outs, true),
        "xf.rmsnorm" => rmsnorm::<T>(instr, ins, outs),
        "xf.rmsnorm_grad" => norm_grad::<T>(instr, ins, outs, false),
        "xf.rope" => rope::<T>(instr, ins, outs, 1.0),
        "xf.rope_grad" => rope::<T>(instr, ins, outs, -1.0),
        "xf.split_heads" => split_heads::<T>(ins, outs, true),
        "xf.merge_heads" => split_heads::<T>(ins, outs, false),
        "xf.slice" => slice_or_pad::<T>(instr, ins, outs, false),
        "xf.repeat_heads" => repeat_heads::<T>(instr, ins, outs, false),
        "xf.sum_heads" => repeat_heads::<T>(instr, ins, outs, true),
        "xf.pad" => slice_or_pad::<T>(instr, ins, outs, true),
        "xf.attention" => attention::<T>(instr, ins, outs),
        "xf.attention_grad" => attention_grad::<T>(instr, ins, outs),
        "xf.cross_entropy" => cross_entropy::<T>(instr, ins, outs),
        "xf.cross_entropy_grad" => cross_entropy_grad::<T>(instr, ins, outs),
        "xf.row_max" => row_max::<T>(instr, ins, outs, cx),
        // The bucket was sent when its last member was ready: nothing to wait for here.
        "xf.wait" => seed_in_place::<T>(ins, outs, &[(0, 0)]),
        "xf.cross_entropy_stats" => cross_entropy_stats::<T>(instr, ins, outs, cx),
        "xf.cross_entropy_finish" => cross_entropy_finish::<T>(instr, ins, outs),
        "xf.cross_entropy_grad_shard" => cross_entropy_grad_shard::<T>(instr, ins, outs, cx),
        "xf.adamw" => adamw::<T>(instr, ins, outs),
        "xf.sgd" => sgd::<T>(instr, ins, outs),
        "xf.sum_squares" => {
            // Fixed chunks in parallel, then the chunk sums in order: the same sum every run.
            let x = ins[0].get::<T>()?;
            let partials: Vec<T> = x.par_chunks(4096).map(|c| c.iter().map(|&v| v * v).sum()).collect();
            outs[0].get::<T>()?[0] = partials.into_iter().sum();
            Ok(())
        }
        "xf.clip_coef" => {
            let max_norm = instr.float("max_norm")?;
            let total = ins[0].get::<T>()?[0];
            let coef = T::of(max_norm) / (total.sqrt() + T::of(1e-6));
            outs[0].get::<T>()?[0] = if coef < T::one() { coef } else { T::one() };
            Ok(())
        }
        other => Err(format!("no CPU kernel for `{other}`")),
    }
}

fn sigmoid<T: Real>(x: T) -> T {
    T::one() / (T::one() + (-x).exp())
}

fn silu_derivative<T: Real>(x: T) -> T {
    let s = sigmoid(x);
    s * (T::one() + x * (T::one() - s))
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_A: f64 = 0.044_715;

fn gelu<T: Real>(x: T) -> T {
    let u = T::of(GELU_C) * (x + T::of(GELU_A) * x * x * x);
    T::of(0.5) * x * (T::one() + u.tanh())
}

fn gelu_derivative<T: Real>(x: T) -> T {
    let u = T::of(GELU_C) * (x + T::of(GELU_A) * x * x * x);
    let t = u.tanh();
    let du = T::of(GELU_C) * (T::one() + T::of(3.0 * GELU_A) * x * x);
    T::of(0.5) * (T::one() + t) + T::of(0.5) * x * (T::one() - t * t) * du
}

fn unary<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], f: impl Fn(T) -> T + Sync) -> Result<(), String> {
    let x = ins[0].get::<T>()?;
    let y = outs[0].get::<T>()?;
    y.par_chunks_mut(4096).zip(x.par_chunks(4096)).for_each(|(y, x)| y.iter_mut().zip(x).for_each(|(y, &x)| *y = f(x)));
    Ok(())
}

fn binary<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], f: impl Fn(T, T) -> T + Sync) -> Result<(), String> {
    let (a, b) = (ins[0].get::<T>()?, ins[1].get::<T>()?);
    let y = outs[0].get::<T>()?;
    y.par_chunks_mut(4096)
        .zip(a.par_chunks(4096).zip(b.par_chunks(4096)))
        .for_each(|(y, (a, b))| y.iter_mut().zip(a.iter().zip(b)).for_each(|(y, (&a, &b))| *y = f(a, b)));
    Ok(())
}

/// `out[i] = f(a[i], b[i mod len(b)])`: `b` broadcast over the leading dims of `a`. When
/// the op runs in place (`out` is `a`'s buffer), `a` is read from `out`.
fn broadcast<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], f: impl Fn(T, T) -> T + Sync) -> Result<(), String> {
    let b = ins[1].get::<T>()?;
    let y = outs[0].get::<T>()?;
    let n = b.len().max(1);
    if ins[0].is_taken() {
        y.par_chunks_mut(n).for_each(|y| {
            for (y, &b) in y.iter_mut().zip(b) {
                *y = f(*y, b);
            }
        });
        return Ok(());
    }
    let a = ins[0].get::<T>()?;
    y.par_chunks_mut(n).zip(a.par_chunks(n)).for_each(|(y, a)| {
        for ((y, &a), &b) in y.iter_mut().zip(a).zip(b) {
            *y = f(a, b);
        }
    });
    Ok(())
}

fn sum_leading<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let x = ins[0].get::<T>()?;
    let y = outs[0].get::<T>()?;
    let n = y.len().max(1);
    let rows = x.len() / n;
    if n == 1 {
        // A full reduction: sum fixed chunks in parallel, then the chunk sums in order.
        let partials: Vec<T> = x.par_chunks(4096).map(|c| c.iter().copied().sum()).collect();
        y[0] = partials.into_iter().sum();
        return Ok(());
    }
    // Each output column is summed over rows in row order, by one task.
    y.par_chunks_mut(64).enumerate().for_each(|(block, ys)| {
        let start = block * 64;
        for (j, y) in ys.iter_mut().enumerate() {
            let mut acc = T::zero();
            for r in 0..rows {
                acc += x[r * n + start + j];
            }
            *y = acc;
        }
    });
    Ok(())
}

/// Row lookup. With a vocab-split table (`cx.rows`), this rank holds rows
/// `first..first + local`: it copies those and writes zeros for ids other ranks hold, and
/// the all-reduce that follows sums the lookups.
fn embedding<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    let table = ins[0].get::<T>()?;
    let ids = ins[1].get::<i32>()?;
    let (local, hidden) = (ins[0].shape()[0], ins[0].shape()[1]);
    let (first, vocab) = cx.rows.unwrap_or((0, local));
    if let Some(bad) = ids.iter().find(|&&id| id < 0 || id as usize >= vocab) {
        return Err(format!("token id {bad} is outside the vocabulary of {vocab}"));
    }
    let y = outs[0].get::<T>()?;
    y.par_chunks_mut(hidden).zip(ids.par_iter()).for_each(|(row, &id)| {
        match (id as usize).checked_sub(first).filter(|&r| r < local) {
            Some(r) => row.copy_from_slice(&table[r * hidden..(r + 1) * hidden]),
            None => row.fill(T::zero()),
        }
    });
    Ok(())
}

fn embedding_grad<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let ids = ins[0].get::<i32>()?;
    let dy = ins[1].get::<T>()?;
    let (vocab, hidden) = (outs[0].shape()[0], outs[0].shape()[1]);
    let out = outs[0].get::<T>()?;
    out.fill(T::zero());
    // Sequential over tokens: repeated ids add up in token order (deterministic).
    for (t, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(format!("token id {id} is outside the vocabulary of {vocab}"));
        }
        let row = &mut out[id as usize * hidden..(id as usize + 1) * hidden];
        for (o, &d) in row.iter_mut().zip(&dy[t * hidden..(t + 1) * hidden]) {
            *o += d;
        }
    }
    Ok(())
}

fn matmul<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (ta, tb) = (instr.bool("transpose_lhs")?, instr.bool("transpose_rhs")?);
    let (sa, sb) = (ins[0].shape(), ins[1].shape());
    let (a, b) = (ins[0].get::<T>()?, ins[1].get::<T>()?);
    let (ra, ca) = (sa[sa.len() - 2], sa[sa.len() - 1]);
    let (rb, cb) = (sb[sb.len() - 2], sb[sb.len() - 1]);
    let (m, k) = if ta { (ca, ra) } else { (ra, ca) };
    let n = if tb { rb } else { cb };
    let batch: usize = sa[..sa.len() - 2].iter().product();
    let shared_rhs = sb.len() == 2;
    let y = outs[0].get::<T>()?;
    if shared_rhs && !ta {
        // The batch folds into the rows: one product of (batch * m) x k by k x n.
        return gemm_matmul(y, a, Strided::row_major(batch * m, k, false), b, Strided::row_major(k, n, tb), false);
    }
    for i in 0..batch {
        let a_i = &a[i * ra * ca..(i + 1) * ra * ca];
        let b_i = if shared_rhs { b } else { &b[i * rb * cb..(i + 1) * rb * cb] };
        gemm_matmul(&mut y[i * m * n..(i + 1) * m * n], a_i, Strided::row_major(m, k, ta), b_i, Strided::row_major(k, n, tb), false)?;
    }
    Ok(())
}

fn matmul_wgrad<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (a, b) = (ins[0].get::<T>()?, ins[1].get::<T>()?);
    let k = *ins[0].shape().last().unwrap_or(&1);
    let n = *ins[1].shape().last().unwrap_or(&1);
    let rows = a.len() / k.max(1);
    // out = a^T b with a viewed as rows x k.
    gemm_matmul(outs[0].get::<T>()?, a, Strided::row_major(k, rows, true), b, Strided::row_major(rows, n, false), false)
}

fn swiglu_grad<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (g, u, dy) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?);
    let (first, rest) = outs.split_at_mut(1);
    let (dg, du) = (first[0].get::<T>()?, rest[0].get::<T>()?);
    dg.par_chunks_mut(4096).zip(du.par_chunks_mut(4096)).enumerate().for_each(|(c, (dg, du))| {
        let base = c * 4096;
        for j in 0..dg.len() {
            let (g, u, dy) = (g[base + j], u[base + j], dy[base + j]);
            dg[j] = dy * u * silu_derivative(g);
            du[j] = dy * g * sigmoid(g);
        }
    });
    Ok(())
}

fn layernorm<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let eps = T::of(instr.float("epsilon")?);
    let (x, gamma, beta) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?);
    let n = gamma.len();
    let inv_n = T::one() / T::of(n as f64);
    outs[0].get::<T>()?.par_chunks_mut(n).zip(x.par_chunks(n)).for_each(|(y, x)| {
        let mean = x.iter().copied().sum::<T>() * inv_n;
        let var = x.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() * inv_n;
        let rstd = T::one() / (var + eps).sqrt();
        for j in 0..n {
            y[j] = (x[j] - mean) * rstd * gamma[j] + beta[j];
        }
    });
    Ok(())
}

fn rmsnorm<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let eps = T::of(instr.float("epsilon")?);
    let (x, gamma) = (ins[0].get::<T>()?, ins[1].get::<T>()?);
    let n = gamma.len();
    let inv_n = T::one() / T::of(n as f64);
    outs[0].get::<T>()?.par_chunks_mut(n).zip(x.par_chunks(n)).for_each(|(y, x)| {
        let rstd = T::one() / (x.iter().map(|&v| v * v).sum::<T>() * inv_n + eps).sqrt();
        for j in 0..n {
            y[j] = x[j] * rstd * gamma[j];
        }
    });
    Ok(())
}

/// Backward of layernorm (`centered`) or rmsnorm: `(dx, dgamma[, dbeta])`.
fn norm_grad<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], centered: bool) -> Result<(), String> {
    let eps = T::of(instr.float("epsilon")?);
    let (x, gamma, dy) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?);
    let n = gamma.len();
    let inv_n = T::one() / T::of(n as f64);
    let (first, rest) = outs.split_at_mut(1);
    let dx = first[0].get::<T>()?;
    // Each task handles ROW_CHUNK rows and returns its partial dgamma/dbeta; partials are
    // then added in chunk order.
    let partials: Vec<(Vec<T>, Vec<T>)> = dx
        .par_chunks_mut(n * ROW_CHUNK)
        .zip(x.par_chunks(n * ROW_CHUNK).zip(dy.par_chunks(n * ROW_CHUNK)))
        .map(|(dx, (x, dy))| {
            let mut dgamma = vec![T::zero(); n];
            let mut dbeta = vec![T::zero(); n];
            let mut xhat = vec![T::zero(); n];
            for ((dx, x), dy) in dx.chunks_mut(n).zip(x.chunks(n)).zip(dy.chunks(n)) {
                let mean = if centered { x.iter().copied().sum::<T>() * inv_n } else { T::zero() };
                let var = x.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() * inv_n;
                let rstd = T::one() / (var + eps).sqrt();
                let (mut mean_g, mut mean_gx) = (T::zero(), T::zero());
                for j in 0..n {
                    xhat[j] = (x[j] - mean) * rstd;
                    let g = dy[j] * gamma[j];
                    mean_g += g;
                    mean_gx += g * xhat[j];
                    dgamma[j] += dy[j] * xhat[j];
                    dbeta[j] += dy[j];
                }
                mean_g = if centered { mean_g * inv_n } else { T::zero() };
                mean_gx *= inv_n;
                for j in 0..n {
                    dx[j] = rstd * (dy[j] * gamma[j] - mean_g - xhat[j] * mean_gx);
                }
            }
            (dgamma, dbeta)
        })
        .collect();
    let dgamma = rest[0].get::<T>()?;
    dgamma.fill(T::zero());
    for (pg, _) in &partials {
        dgamma.iter_mut().zip(pg).for_each(|(a, &b)| *a += b);
    }
    if centered {
        let dbeta = rest[1].get::<T>()?;
        dbeta.fill(T::zero());
        for (_, pb) in &partials {
            dbeta.iter_mut().zip(pb).for_each(|(a, &b)| *a += b);
        }
    }
    Ok(())
}

/// Rotary embedding on `[b, h, s, d]`; `sign = -1` rotates back (the gradient).
fn rope<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], sign: f64) -> Result<(), String> {
    let theta = instr.float("theta")?;
    let shape = ins[0].shape();
    let (s, d) = (shape[2], shape[3]);
    let half = d / 2;
    // cos/sin tables per (position, pair), computed in f64.
    let mut table = Vec::with_capacity(s * half);
    for pos in 0..s {
        for i in 0..half {
            let angle = pos as f64 * theta.powf(-2.0 * i as f64 / d as f64);
            table.push((T::of(angle.cos()), T::of(sign * angle.sin())));
        }
    }
    let x = ins[0].get::<T>()?;
    outs[0].get::<T>()?.par_chunks_mut(s * d).zip(x.par_chunks(s * d)).for_each(|(y, x)| {
        for pos in 0..s {
            let (y, x) = (&mut y[pos * d..(pos + 1) * d], &x[pos * d..(pos + 1) * d]);
            for i in 0..half {
                let (cos, sin) = table[pos * half + i];
                y[i] = x[i] * cos - x[i + half] * sin;
                y[i + half] = x[i + half] * cos + x[i] * sin;
            }
        }
    });
    Ok(())
}

/// `[b, s, h*d] <-> [b, h, s, d]`.
fn split_heads<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], split: bool) -> Result<(), String> {
    let heads_shape = if split { outs[0].shape().to_vec() } else { ins[0].shape().to_vec() };
    let (b, h, s, d) = (heads_shape[0], heads_shape[1], heads_shape[2], heads_shape[3]);
    let x = ins[0].get::<T>()?;
    let y = outs[0].get::<T>()?;
    y.par_chunks_mut(d).enumerate().for_each(|(row, y)| {
        // `row` indexes the output's rows of d elements.
        let src = if split {
            let (bi, hi, si) = (row / (h * s), (row / s) % h, row % s);
            ((bi * s + si) * h + hi) * d
        } else {
            let (bi, si, hi) = (row / (s * h), (row / h) % s, row % h);
            ((bi * h + hi) * s + si) * d
        };
        y.copy_from_slice(&x[src..src + d]);
    });
    let _ = b;
    Ok(())
}

fn slice_or_pad<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], pad: bool) -> Result<(), String> {
    let axis = instr.int("axis")? as usize;
    let start = instr.int("start")? as usize;
    let (full, part) = if pad { (outs[0].shape().to_vec(), ins[0].shape().to_vec()) } else { (ins[0].shape().to_vec(), outs[0].shape().to_vec()) };
    let outer: usize = full[..axis].iter().product();
    let inner: usize = full[axis + 1..].iter().product();
    let (full_extent, part_extent) = (full[axis], part[axis]);
    let x = ins[0].get::<T>()?;
    let y = outs[0].get::<T>()?;
    if pad {
        y.fill(T::zero());
    }
    for o in 0..outer {
        let full_at = (o * full_extent + start) * inner;
        let part_at = o * part_extent * inner;
        let len = part_extent * inner;
        if pad {
            y[full_at..full_at + len].copy_from_slice(&x[part_at..part_at + len]);
        } else {
            y[part_at..part_at + len].copy_from_slice(&x[full_at..full_at + len]);
        }
    }
    Ok(())
}

/// Softmax probabilities of query row `i` against every visible key, into `p`.
fn attention_row<T: Real>(q_i: &[T], k: &[T], d: usize, visible: usize, scale: T, p: &mut [T]) {
    let mut max = T::neg_infinity();
    for j in 0..visible {
        let s = q_i.iter().zip(&k[j * d..(j + 1) * d]).map(|(&a, &b)| a * b).sum::<T>() * scale;
        p[j] = s;
        max = max.max(s);
    }
    let mut sum = T::zero();
    for pj in p[..visible].iter_mut() {
        *pj = (*pj - max).exp();
        sum += *pj;
    }
    let inv = T::one() / sum;
    p[..visible].iter_mut().for_each(|pj| *pj *= inv);
}

fn attention<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (causal, scale) = (instr.bool("causal")?, T::of(instr.float("scale")?));
    let (qs, ks) = (ins[0].shape(), ins[1].shape());
    let (hq, s, d, hk) = (qs[1], qs[2], qs[3], ks[1]);
    let group = hq / hk;
    let (q, k, v) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?);
    outs[0].get::<T>()?.par_chunks_mut(s * d).enumerate().for_each(|(bh, out)| {
        let (b, h) = (bh / hq, bh % hq);
        let kv = (b * hk + h / group) * s * d;
        let (k, v, q) = (&k[kv..kv + s * d], &v[kv..kv + s * d], &q[bh * s * d..(bh + 1) * s * d]);
        let mut p = vec![T::zero(); s];
        for i in 0..s {
            let visible = if causal { i + 1 } else { s };
            attention_row(&q[i * d..(i + 1) * d], k, d, visible, scale, &mut p);
            let o = &mut out[i * d..(i + 1) * d];
            o.fill(T::zero());
            for j in 0..visible {
                for (o, &vv) in o.iter_mut().zip(&v[j * d..(j + 1) * d]) {
                    *o += p[j] * vv;
                }
            }
        }
    });
    Ok(())
}

fn attention_grad<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (causal, scale) = (instr.bool("causal")?, T::of(instr.float("scale")?));
    let (qs, ks) = (ins[0].shape(), ins[1].shape());
    let (hq, s, d, hk) = (qs[1], qs[2], qs[3], ks[1]);
    let group = hq / hk;
    let (q, k, v, dout) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?, ins[3].get::<T>()?);
    let (dq_out, rest) = outs.split_at_mut(1);
    let (dk_out, dv_out) = rest.split_at_mut(1);
    let (dq, dk, dv) = (dq_out[0].get::<T>()?, dk_out[0].get::<T>()?, dv_out[0].get::<T>()?);
    // One task per (batch, kv head): it owns that head's dk/dv and its group's dq, and sums
    // the group's contributions in head order.
    dq.par_chunks_mut(group * s * d)
        .zip(dk.par_chunks_mut(s * d).zip(dv.par_chunks_mut(s * d)))
        .enumerate()
        .for_each(|(bg, (dq, (dk, dv)))| {
            let (b, g) = (bg / hk, bg % hk);
            let kv = (b * hk + g) * s * d;
            let (k, v) = (&k[kv..kv + s * d], &v[kv..kv + s * d]);
            dk.fill(T::zero());
            dv.fill(T::zero());
            let (mut p, mut dp) = (vec![T::zero(); s], vec![T::zero(); s]);
            for gh in 0..group {
                let h = g * group + gh;
                let at = (b * hq + h) * s * d;
                let (q, dout) = (&q[at..at + s * d], &dout[at..at + s * d]);
                let dq = &mut dq[gh * s * d..(gh + 1) * s * d];
                for i in 0..s {
                    let visible = if causal { i + 1 } else { s };
                    let (q_i, do_i) = (&q[i * d..(i + 1) * d], &dout[i * d..(i + 1) * d]);
                    attention_row(q_i, k, d, visible, scale, &mut p);
                    let mut rowdot = T::zero();
                    for j in 0..visible {
                        dp[j] = do_i.iter().zip(&v[j * d..(j + 1) * d]).map(|(&a, &b)| a * b).sum::<T>();
                        rowdot += p[j] * dp[j];
                    }
                    let dq_i = &mut dq[i * d..(i + 1) * d];
                    dq_i.fill(T::zero());
                    for j in 0..visible {
                        let ds = p[j] * (dp[j] - rowdot) * scale;
                        let (k_j, dk_j) = (&k[j * d..(j + 1) * d], &mut dk[j * d..(j + 1) * d]);
                        for c in 0..d {
                            dq_i[c] += ds * k_j[c];
                            dk_j[c] += ds * q_i[c];
                        }
                        let dv_j = &mut dv[j * d..(j + 1) * d];
                        for c in 0..d {
                            dv_j[c] += p[j] * do_i[c];
                        }
                    }
                }
            }
        });
    Ok(())
}

/// Tokens the mean divides by: the global count when the batch is split over ranks.
fn token_count(instr: &Instr, local: usize) -> usize {
    instr.int("xf.tokens").map_or(local, |n| n.max(1) as usize)
}

/// Of a row of `v` logits whose first class is `first`: how many are real classes, given
/// a padded vocabulary's class count (`xf.classes`); the rest never enter the loss.
fn real_classes(instr: &Instr, first: usize, v: usize) -> usize {
    match instr.int("xf.classes") {
        Ok(classes) => (classes.max(0) as usize).saturating_sub(first).min(v),
        Err(_) => v,
    }
}

fn cross_entropy<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let logits = ins[0].get::<T>()?;
    let targets = ins[1].get::<i32>()?;
    let vocab = *ins[0].shape().last().unwrap_or(&1);
    let real = real_classes(instr, 0, vocab);
    check_targets(targets, real)?;
    // Per-row losses in f64, summed in row order.
    let losses: Vec<f64> = logits
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            let row = &row[..real];
            let max = row.iter().copied().fold(T::neg_infinity(), T::max);
            let sum: T = row.iter().map(|&x| (x - max).exp()).sum();
            (max + sum.ln() - row[t as usize]).to_f64().unwrap_or(f64::NAN)
        })
        .collect();
    let mean = losses.iter().sum::<f64>() / token_count(instr, losses.len().max(1)) as f64;
    outs[0].get::<T>()?[0] = T::of(mean);
    Ok(())
}

fn check_targets(targets: &[i32], vocab: usize) -> Result<(), String> {
    match targets.iter().find(|&&t| t < 0 || t as usize >= vocab) {
        Some(bad) => Err(format!("target id {bad} is outside the vocabulary of {vocab}")),
        None => Ok(()),
    }
}

fn cross_entropy_grad<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let logits = ins[0].get::<T>()?;
    let targets = ins[1].get::<i32>()?;
    let dloss = ins[2].get::<T>()?[0];
    let vocab = *ins[0].shape().last().unwrap_or(&1);
    let real = real_classes(instr, 0, vocab);
    check_targets(targets, real)?;
    let factor = dloss / T::of(token_count(instr, targets.len().max(1)) as f64);
    outs[0].get::<T>()?.par_chunks_mut(vocab).zip(logits.par_chunks(vocab).zip(targets.par_iter())).for_each(|(g, (row, &t))| {
        let row = &row[..real];
        let max = row.iter().copied().fold(T::neg_infinity(), T::max);
        let sum: T = row.iter().map(|&x| (x - max).exp()).sum();
        for (g, &x) in g.iter_mut().zip(row) {
            *g = (x - max).exp() / sum * factor;
        }
        // Padded classes have no probability, so no gradient.
        g[real..].iter_mut().for_each(|g| *g = T::zero());
        g[t as usize] -= factor;
    });
    Ok(())
}

/// For an in-place update, copies each operand's old value into its result unless the
/// result already is the operand's buffer (then the input slot is empty).
fn seed_in_place<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], pairs: &[(usize, usize)]) -> Result<(), String> {
    for &(out, input) in pairs {
        if !ins[input].is_taken() {
            let old = ins[input].get::<T>()?;
            outs[out].get::<T>()?.copy_from_slice(old);
        }
    }
    Ok(())
}

/// The learning rate of an update instruction at its `step` operand, by the schedule in its
/// attributes (shardc_ir's `LrSchedule`).
fn scheduled_lr(instr: &Instr, step: &In<'_>) -> Result<(i32, f64), String> {
    let (lr, min_lr) = (instr.float("lr")?, instr.float("min_lr")?);
    let (warmup, decay, cosine) = (instr.int("warmup_steps")?, instr.int("decay_steps")?, instr.int("cosine")? != 0);
    if decay > 0 && decay <= warmup {
        return Err(format!("decay_steps ({decay}) must exceed warmup_steps ({warmup})"));
    }
    let step = step.get::<i32>()?[0];
    if step < 1 {
        return Err(format!("step must be at least 1, got {step}"));
    }
    Ok((step, learning_rate(lr, min_lr, warmup, decay, cosine, step as i64)))
}

/// The learning rate of iteration `t` (from 1): linear warmup to `lr` over `warmup` steps,
/// then decay to `min_lr` at `decay` (cosine or linear; none when `decay` is 0), `min_lr` after.
pub fn learning_rate(lr: f64, min_lr: f64, warmup: i64, decay: i64, cosine: bool, t: i64) -> f64 {
    let (tf, w, d) = (t as f64, warmup as f64, decay as f64);
    if warmup > 0 && t <= warmup {
        return lr * tf / w;
    }
    if decay == 0 {
        return lr;
    }
    if t >= decay {
        return min_lr;
    }
    let r = (tf - w) / (d - w);
    let coeff = if cosine { 0.5 * (1.0 + (std::f64::consts::PI * r).cos()) } else { 1.0 - r };
    min_lr + (lr - min_lr) * coeff
}

fn adamw<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (b1, b2) = (instr.float("beta1")?, instr.float("beta2")?);
    let (eps, wd) = (instr.float("epsilon")?, instr.float("weight_decay")?);
    let (step, lr) = scheduled_lr(instr, &ins[4])?;
    let scale = ins[5].get::<T>()?[0];
    seed_in_place::<T>(ins, outs, &[(0, 0), (1, 2), (2, 3)])?;
    let grad = ins[1].get::<T>()?;
    let (bc1, bc2) = (1.0 - b1.powi(step), 1.0 - b2.powi(step));
    let (lr, b1, b2, eps, wd, bc1, bc2) = (T::of(lr), T::of(b1), T::of(b2), T::of(eps), T::of(wd), T::of(bc1), T::of(bc2));
    let (p_out, rest) = outs.split_at_mut(1);
    let (m_out, v_out) = rest.split_at_mut(1);
    let (p, m, v) = (p_out[0].get::<T>()?, m_out[0].get::<T>()?, v_out[0].get::<T>()?);
    p.par_chunks_mut(4096).zip(m.par_chunks_mut(4096).zip(v.par_chunks_mut(4096))).zip(grad.par_chunks(4096)).for_each(
        |((p, (m, v)), g)| {
            for i in 0..p.len() {
                let g = scale * g[i];
                m[i] = b1 * m[i] + (T::one() - b1) * g;
                v[i] = b2 * v[i] + (T::one() - b2) * g * g;
                let update = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps);
                p[i] = p[i] - lr * (update + wd * p[i]);
            }
        },
    );
    Ok(())
}

fn sgd<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (_, lr) = scheduled_lr(instr, &ins[2])?;
    let (lr, wd) = (T::of(lr), T::of(instr.float("weight_decay")?));
    let scale = ins[3].get::<T>()?[0];
    seed_in_place::<T>(ins, outs, &[(0, 0)])?;
    let grad = ins[1].get::<T>()?;
    let p = outs[0].get::<T>()?;
    p.par_chunks_mut(4096).zip(grad.par_chunks(4096)).for_each(|(p, g)| {
        for i in 0..p.len() {
            p[i] = p[i] - lr * (scale * g[i] + wd * p[i]);
        }
    });
    Ok(())
}

/// `repeat_heads` (each head copied `times` times) or, with `sum`, its transpose `sum_heads`
/// (each group of `times` heads summed, in head order).
fn repeat_heads<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], sum: bool) -> Result<(), String> {
    let times = instr.int("times")?.max(1) as usize;
    let x = ins[0].get::<T>()?;
    let (small, large) = if sum { (outs[0].shape().to_vec(), ins[0].shape().to_vec()) } else { (ins[0].shape().to_vec(), outs[0].shape().to_vec()) };
    let block = small[2] * small[3];
    let heads = small[1];
    let y = outs[0].get::<T>()?;
    if sum {
        y.fill(T::zero());
    }
    for b in 0..small[0] {
        for h in 0..heads {
            for k in 0..times {
                let big = ((b * large[1]) + h * times + k) * block;
                let little = (b * heads + h) * block;
                if sum {
                    for i in 0..block {
                        y[little + i] += x[big + i];
                    }
                } else {
                    y[big..big + block].copy_from_slice(&x[little..little + block]);
                }
            }
        }
    }
    Ok(())
}

fn row_max<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    let x = ins[0].get::<T>()?;
    let v = *ins[0].shape().last().unwrap_or(&1);
    let real = real_classes(instr, vocab_range(cx, v).0, v);
    // A shard of padding only has no real class: its maximum is the lowest finite value
    // (not -inf, which --check-numerics would report), below every real one.
    outs[0].get::<T>()?.par_iter_mut().zip(x.par_chunks(v)).for_each(|(m, row)| *m = row[..real].iter().copied().reduce(T::max).unwrap_or_else(T::min_value));
    Ok(())
}

/// This rank's vocab range (first id, local size) and the whole vocabulary.
fn vocab_range(cx: &RankCx, local: usize) -> (usize, usize) {
    cx.rows.unwrap_or((0, local))
}

fn cross_entropy_stats<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    let logits = ins[0].get::<T>()?;
    let targets = ins[1].get::<i32>()?;
    let max = ins[2].get::<T>()?;
    let v = *ins[0].shape().last().unwrap_or(&1);
    let (first, vocab) = vocab_range(cx, v);
    let real = real_classes(instr, first, v);
    check_targets(targets, instr.int("xf.classes").map_or(vocab, |c| c.max(0) as usize))?;
    let (head, tail) = outs.split_at_mut(1);
    let (sumexp, target) = (head[0].get::<T>()?, tail[0].get::<T>()?);
    for (t, row) in logits.chunks(v).enumerate() {
        sumexp[t] = row[..real].iter().map(|&x| (x - max[t]).exp()).sum();
        target[t] = match (targets[t] as usize).checked_sub(first).filter(|&i| i < v) {
            Some(i) => row[i],
            None => T::zero(),
        };
    }
    Ok(())
}

fn cross_entropy_finish<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (max, sumexp, target) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?);
    let total: f64 = (0..max.len())
        .map(|t| (max[t] + sumexp[t].ln() - target[t]).to_f64().unwrap_or(f64::NAN))
        .sum();
    outs[0].get::<T>()?[0] = T::of(total / token_count(instr, max.len().max(1)) as f64);
    Ok(())
}

fn cross_entropy_grad_shard<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    let logits = ins[0].get::<T>()?;
    let targets = ins[1].get::<i32>()?;
    let dloss = ins[2].get::<T>()?[0];
    let (max, sumexp) = (ins[3].get::<T>()?, ins[4].get::<T>()?);
    let v = *ins[0].shape().last().unwrap_or(&1);
    let (first, _) = vocab_range(cx, v);
    let real = real_classes(instr, first, v);
    let factor = dloss / T::of(token_count(instr, targets.len().max(1)) as f64);
    let g = outs[0].get::<T>()?;
    for (t, (g, row)) in g.chunks_mut(v).zip(logits.chunks(v)).enumerate() {
        for (g, &x) in g.iter_mut().zip(&row[..real]) {
            *g = (x - max[t]).exp() / sumexp[t] * factor;
        }
        g[real..].iter_mut().for_each(|g| *g = T::zero());
        if let Some(i) = (targets[t] as usize).checked_sub(first).filter(|&i| i < v) {
            g[i] -= factor;
        }
    }
    Ok(())
}
