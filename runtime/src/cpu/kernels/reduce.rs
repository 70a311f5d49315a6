//! CPU kernels: Reductions, constants and waits (`ir/src/ops/reduce.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[kernel!("xf.sum_leading", sum_leading_kernel), kernel!("xf.fill_like", fill_kernel), kernel!("xf.constant", fill_kernel), kernel!("xf.wait", wait_kernel)];

fn sum_leading_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    sum_leading::<T>(ins, outs)
}
fn fill_kernel<T: Real>(instr: &Instr, _: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    outs[0].get::<T>()?.fill(T::of(instr.float("value")?));
    Ok(())
}
/// The bucket was sent when its last member was ready: nothing to wait for here.
fn wait_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    seed_in_place::<T>(ins, outs, &[(0, 0)])
}

pub(super) fn sum_leading<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
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
