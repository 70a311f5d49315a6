//! CPU kernels: Normalisations (`ir/src/ops/norm.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[
    kernel!("xf.layernorm", layernorm_kernel),
    kernel!("xf.layernorm_grad", layernorm_grad_kernel),
    kernel!("xf.rmsnorm", rmsnorm_kernel),
    kernel!("xf.rmsnorm_grad", rmsnorm_grad_kernel),
];

fn layernorm_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    layernorm::<T>(instr, ins, outs)
}
fn layernorm_grad_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    norm_grad::<T>(instr, ins, outs, true)
}
fn rmsnorm_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    rmsnorm::<T>(instr, ins, outs)
}
fn rmsnorm_grad_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    norm_grad::<T>(instr, ins, outs, false)
}

pub(super) fn layernorm<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
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

pub(super) fn rmsnorm<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
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
pub(super) fn norm_grad<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], centered: bool) -> Result<(), String> {
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
