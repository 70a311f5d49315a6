//! CPU kernels: Head layouts, slices and pads (`ir/src/ops/heads.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[
    kernel!("xf.slice", slice_kernel),
    kernel!("xf.pad", pad_kernel),
    kernel!("xf.repeat_heads", repeat_heads_kernel),
    kernel!("xf.sum_heads", sum_heads_kernel),
    kernel!("xf.zigzag", zigzag_kernel),
];

/// Reorders one axis into zigzag order or back (`xf.zigzag`); token ids as well as floats.
fn zigzag_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    if ins[0].dtype() == DType::I32 {
        zigzag::<i32>(instr, ins, outs)
    } else {
        zigzag::<T>(instr, ins, outs)
    }
}

fn zigzag<T: Element + Copy>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let axis = usize::try_from(instr.int("axis")?).map_err(|_| "xf.zigzag: negative axis")?;
    let chunks = usize::try_from(instr.int("chunks")?).map_err(|_| "xf.zigzag: negative chunks")?;
    let inverse = instr.bool("inverse")?;
    let shape = ins[0].shape();
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let x = ins[0].get::<T>()?;
    let y = outs[0].get::<T>()?;
    for (block_y, block_x) in y.chunks_mut(n * inner).zip(x.chunks(n * inner)) {
        for p in 0..n {
            let q = shardc_ir::ops::zigzag_position(p, n, chunks);
            let (to, from) = if inverse { (q, p) } else { (p, q) };
            block_y[to * inner..(to + 1) * inner].copy_from_slice(&block_x[from * inner..(from + 1) * inner]);
        }
    }
    Ok(())
}

fn slice_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    slice_or_pad::<T>(instr, ins, outs, false)
}
fn pad_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    slice_or_pad::<T>(instr, ins, outs, true)
}
fn repeat_heads_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    repeat_heads::<T>(instr, ins, outs, false)
}
fn sum_heads_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    repeat_heads::<T>(instr, ins, outs, true)
}

pub(super) fn slice_or_pad<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], pad: bool) -> Result<(), String> {
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

/// `repeat_heads` (each head copied `times` times) or, with `sum`, its transpose `sum_heads`
/// (each group of `times` heads summed, in head order).
pub(super) fn repeat_heads<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], sum: bool) -> Result<(), String> {
    let times = instr.int("times")?.max(1) as usize;
    let d = head_dim(instr)?;
    let x = ins[0].get::<T>()?;
    let small = if sum { outs[0].shape().to_vec() } else { ins[0].shape().to_vec() };
    // `[b, s, heads * d]`: rows of the sequence, each `heads` heads of d.
    let (block, heads) = (d, small[2] / d);
    let y = outs[0].get::<T>()?;
    if sum {
        y.fill(T::zero());
    }
    for b in 0..small[0] * small[1] {
        for h in 0..heads {
            for k in 0..times {
                let big = ((b * heads * times) + h * times + k) * block;
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
