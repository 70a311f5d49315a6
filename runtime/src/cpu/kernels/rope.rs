//! CPU kernels: Rotary position embeddings (`ir/src/ops/rope.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[kernel!("xf.rope", rope_kernel), kernel!("xf.rope_grad", rope_grad_kernel)];

fn rope_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    rope::<T>(instr, ins, outs, 1.0, cx.seq_offset)
}
fn rope_grad_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    rope::<T>(instr, ins, outs, -1.0, cx.seq_offset)
}

/// Rotary embedding on each head of `[b, s, h * d]` whose first row is at position `offset`;
/// `sign = -1` rotates back (the gradient).
pub(super) fn rope<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], sign: f64, offset: usize) -> Result<(), String> {
    let theta = instr.float("theta")?;
    let d = head_dim(instr)?;
    let shape = ins[0].shape();
    let (s, width) = (shape[1], shape[2]);
    if width == 0 || shape[0] * s == 0 {
        return Ok(());
    }
    let half = d / 2;
    // The sequence may be held in zigzag order (context parallelism): row p is at position
    // zigzag_position(p).
    let (chunks, len) = zigzag_order(instr);
    // cos/sin tables per (position, pair), computed in f64.
    let mut table = Vec::with_capacity(s * half);
    for pos in 0..s {
        let at = shardc_ir::ops::zigzag_position(offset + pos, len, chunks);
        for i in 0..half {
            let angle = at as f64 * theta.powf(-2.0 * i as f64 / d as f64);
            table.push((T::of(angle.cos()), T::of(sign * angle.sin())));
        }
    }
    let x = ins[0].get::<T>()?;
    // A row of the sequence at a time: its heads share the row's angles.
    outs[0].get::<T>()?.par_chunks_mut(width).zip(x.par_chunks(width)).enumerate().for_each(|(row, (y, x))| {
        let pos = row % s;
        for (y, x) in y.chunks_mut(d).zip(x.chunks(d)) {
            for i in 0..half {
                let (cos, sin) = table[pos * half + i];
                y[i] = x[i] * cos - x[i + half] * sin;
                y[i + half] = x[i + half] * cos + x[i] * sin;
            }
        }
    });
    Ok(())
}
