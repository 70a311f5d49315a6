//! CPU kernels: The loss and its vocab-parallel pieces (`ir/src/ops/loss.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[
    kernel!("xf.cross_entropy", cross_entropy_kernel),
    kernel!("xf.cross_entropy_grad", cross_entropy_grad_kernel),
    kernel!("xf.row_max", row_max_kernel),
    kernel!("xf.cross_entropy_stats", cross_entropy_stats_kernel),
    kernel!("xf.cross_entropy_finish", cross_entropy_finish_kernel),
    kernel!("xf.cross_entropy_grad_shard", cross_entropy_grad_shard_kernel),
];

fn cross_entropy_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    cross_entropy::<T>(instr, ins, outs)
}
fn cross_entropy_grad_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    cross_entropy_grad::<T>(instr, ins, outs)
}
fn row_max_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    row_max::<T>(instr, ins, outs, cx)
}
fn cross_entropy_stats_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    cross_entropy_stats::<T>(instr, ins, outs, cx)
}
fn cross_entropy_finish_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    cross_entropy_finish::<T>(instr, ins, outs)
}
fn cross_entropy_grad_shard_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    cross_entropy_grad_shard::<T>(instr, ins, outs, cx)
}

/// Tokens the mean divides by: the global count when the batch is split over ranks.
pub(super) fn token_count(instr: &Instr, local: usize) -> usize {
    instr.int("xf.tokens").map_or(local, |n| n.max(1) as usize)
}

/// Of a row of `v` logits whose first class is `first`: how many are real classes, given
/// a padded vocabulary's class count (`xf.classes`); the rest never enter the loss.
pub(super) fn real_classes(instr: &Instr, first: usize, v: usize) -> usize {
    match instr.int("xf.classes") {
        Ok(classes) => (classes.max(0) as usize).saturating_sub(first).min(v),
        Err(_) => v,
    }
}

pub(super) fn cross_entropy<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
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

pub(super) fn check_targets(targets: &[i32], vocab: usize) -> Result<(), String> {
    match targets.iter().find(|&&t| t < 0 || t as usize >= vocab) {
        Some(bad) => Err(format!("target id {bad} is outside the vocabulary of {vocab}")),
        None => Ok(()),
    }
}

pub(super) fn cross_entropy_grad<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
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

pub(super) fn row_max<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    let x = ins[0].get::<T>()?;
    let v = *ins[0].shape().last().unwrap_or(&1);
    let real = real_classes(instr, vocab_range(cx, v).0, v);
    // A shard of padding only has no real class: its maximum is the lowest finite value
    // (not -inf, which --check-numerics would report), below every real one.
    outs[0].get::<T>()?.par_iter_mut().zip(x.par_chunks(v)).for_each(|(m, row)| *m = row[..real].iter().copied().reduce(T::max).unwrap_or_else(T::min_value));
    Ok(())
}

/// This rank's vocab range (first id, local size) and the whole vocabulary.
pub(super) fn vocab_range(cx: &RankCx, local: usize) -> (usize, usize) {
    cx.rows.unwrap_or((0, local))
}

pub(super) fn cross_entropy_stats<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
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

pub(super) fn cross_entropy_finish<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (max, sumexp, target) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?);
    let total: f64 = (0..max.len())
        .map(|t| (max[t] + sumexp[t].ln() - target[t]).to_f64().unwrap_or(f64::NAN))
        .sum();
    outs[0].get::<T>()?[0] = T::of(total / token_count(instr, max.len().max(1)) as f64);
    Ok(())
}

pub(super) fn cross_entropy_grad_shard<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
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
