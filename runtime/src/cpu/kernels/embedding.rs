//! CPU kernels: The embedding lookup and its gradient (`ir/src/ops/embedding.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[kernel!("xf.embedding", embedding_kernel), kernel!("xf.embedding_grad", embedding_grad_kernel)];

fn embedding_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    embedding::<T>(ins, outs, cx)
}
fn embedding_grad_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    embedding_grad::<T>(ins, outs, cx)
}

/// Row lookup. With a vocab-split table (`cx.rows`), this rank holds rows
/// `first..first + local`: it copies those and writes zeros for ids other ranks hold, and
/// the all-reduce that follows sums the lookups.
pub(super) fn embedding<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
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

/// Scatter-add. With a vocab-split table (`cx.rows`), this rank sums into the rows
/// `first..first + local` it holds and skips ids other ranks hold (their rows are summed
/// there).
pub(super) fn embedding_grad<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    let ids = ins[0].get::<i32>()?;
    let dy = ins[1].get::<T>()?;
    let (local, hidden) = (outs[0].shape()[0], outs[0].shape()[1]);
    let (first, vocab) = cx.rows.unwrap_or((0, local));
    let out = outs[0].get::<T>()?;
    out.fill(T::zero());
    // Sequential over tokens: repeated ids add up in token order (deterministic).
    for (t, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(format!("token id {id} is outside the vocabulary of {vocab}"));
        }
        let Some(r) = (id as usize).checked_sub(first).filter(|&r| r < local) else { continue };
        let row = &mut out[r * hidden..(r + 1) * hidden];
        for (o, &d) in row.iter_mut().zip(&dy[t * hidden..(t + 1) * hidden]) {
            *o += d;
        }
    }
    Ok(())
}
