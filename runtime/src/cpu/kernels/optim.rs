//! CPU kernels: Optimizer updates and gradient clipping (`ir/src/ops/optim.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[kernel!("xf.adamw", adamw_kernel), kernel!("xf.sgd", sgd_kernel), kernel!("xf.sum_squares", sum_squares_kernel), kernel!("xf.clip_coef", clip_coef_kernel)];

fn adamw_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    adamw::<T>(instr, ins, outs)
}
fn sgd_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    sgd::<T>(instr, ins, outs)
}
/// Fixed chunks in parallel, then the chunk sums in order: the same sum every run.
fn sum_squares_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let x = ins[0].get::<T>()?;
    let partials: Vec<T> = x.par_chunks(4096).map(|c| c.iter().map(|&v| v * v).sum()).collect();
    outs[0].get::<T>()?[0] = partials.into_iter().sum();
    Ok(())
}
fn clip_coef_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let max_norm = instr.float("max_norm")?;
    let total = ins[0].get::<T>()?[0];
    let coef = T::of(max_norm) / (total.sqrt() + T::of(1e-6));
    outs[0].get::<T>()?[0] = if coef < T::one() { coef } else { T::one() };
    Ok(())
}

/// The learning rate of an update instruction at its `step` operand, by the schedule in its
/// attributes (shardc_ir's `LrSchedule`).
pub(super) fn scheduled_lr(instr: &Instr, step: &In<'_>) -> Result<(i32, f64), String> {
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

pub(super) fn adamw<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
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

pub(super) fn sgd<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
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
