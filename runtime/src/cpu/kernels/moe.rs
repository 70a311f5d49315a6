//! CPU kernels: Mixture of experts (`ir/src/ops/moe.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[
    kernel!("xf.moe_route", moe_route),
    kernel!("xf.moe_route_grad", moe_route_grad),
    kernel!("xf.moe_aux_loss", moe_aux_loss),
    kernel!("xf.moe_aux_loss_grad", moe_aux_loss_grad),
    kernel!("xf.moe_slots", moe_slots),
    kernel!("xf.moe_dispatch", moe_dispatch),
    kernel!("xf.moe_collect", moe_collect),
    kernel!("xf.moe_combine", moe_combine),
    kernel!("xf.moe_combine_grad", moe_combine_grad),
    kernel!("xf.expert_matmul", expert_matmul),
    kernel!("xf.expert_matmul_wgrad", expert_matmul_wgrad),
];

/// The `k` largest of `row`, best first; ties go to the lower index. `taken` is scratch of
/// the row's length.
fn top_k<T: Real>(row: &[T], k: usize, chosen: &mut Vec<usize>, taken: &mut Vec<bool>) {
    chosen.clear();
    taken.clear();
    taken.resize(row.len(), false);
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (e, &v) in row.iter().enumerate() {
            if taken[e] {
                continue;
            }
            // `!(v <= best)` also takes a NaN, and a NaN once best stays: a NaN logit is
            // chosen and poisons the gates (the run's numerics checks then name it).
            if best.is_none_or(|b| !row[b].is_nan() && !(v <= row[b])) {
                best = Some(e);
            }
        }
        if let Some(b) = best {
            taken[b] = true;
            chosen.push(b);
        }
    }
}

fn moe_route<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let logits = ins[0].get::<T>()?;
    let e = ins[0].shape()[2];
    let k = instr.int("top_k")? as usize;
    let (gates_slot, experts_slot) = outs.split_at_mut(1);
    let (gates, experts) = (gates_slot[0].get::<T>()?, experts_slot[0].get::<i32>()?);
    gates.par_chunks_mut(k).zip(experts.par_chunks_mut(k)).zip(logits.par_chunks(e)).for_each_init(|| (Vec::new(), Vec::new()), |(chosen, taken), ((g, ex), row)| {
        top_k(row, k, chosen, taken);
        let max = row[chosen[0]];
        let mut sum = T::zero();
        for (j, &c) in chosen.iter().enumerate() {
            g[j] = (row[c] - max).exp();
            sum += g[j];
            ex[j] = c as i32;
        }
        g.iter_mut().for_each(|g| *g = *g / sum);
    });
    Ok(())
}

/// The expert of a choice, checked against the experts there are.
fn expert_of(id: i32, experts: usize) -> Result<usize, String> {
    usize::try_from(id).ok().filter(|&e| e < experts).ok_or_else(|| format!("expert id {id} is outside the {experts} experts"))
}

fn moe_route_grad<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let (gates, experts, dgates) = (ins[0].get::<T>()?, ins[1].get::<i32>()?, ins[2].get::<T>()?);
    let k = *ins[0].shape().last().unwrap_or(&1);
    let e = instr.int("experts")? as usize;
    let out = outs[0].get::<T>()?;
    out.par_chunks_mut(e).enumerate().try_for_each(|(t, row)| {
        row.fill(T::zero());
        let (g, dg, ex) = (&gates[t * k..(t + 1) * k], &dgates[t * k..(t + 1) * k], &experts[t * k..(t + 1) * k]);
        let dot: T = g.iter().zip(dg).map(|(&a, &b)| a * b).sum();
        for j in 0..k {
            row[expert_of(ex[j], e)?] += g[j] * (dg[j] - dot);
        }
        Ok(())
    })
}

/// Per sequence `b`: the softmax of each token's router logits into `probs` (`S x E`), and
/// `weights[e] = E count[b, e] / (S^2 k)`, the loss's derivative with respect to each
/// probability of the sequence.
fn aux_terms<T: Real>(logits: &[T], experts: &[i32], s: usize, e: usize, k: usize, probs: &mut [T], weights: &mut [T]) -> Result<(), String> {
    for (p, row) in probs.chunks_mut(e).zip(logits.chunks(e)) {
        let max = row.iter().copied().fold(T::neg_infinity(), T::max);
        let mut sum = T::zero();
        for (p, &l) in p.iter_mut().zip(row) {
            *p = (l - max).exp();
            sum += *p;
        }
        p.iter_mut().for_each(|p| *p = *p / sum);
    }
    weights.fill(T::zero());
    let scale = T::of(e as f64 / ((s * s * k) as f64));
    for &id in experts {
        weights[expert_of(id, e)?] += scale;
    }
    Ok(())
}

fn moe_aux_loss<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let (logits, experts) = (ins[0].get::<T>()?, ins[1].get::<i32>()?);
    let (b, s, e) = (ins[0].shape()[0], ins[0].shape()[1], ins[0].shape()[2]);
    let k = ins[1].shape()[2];
    let out = outs[0].get::<T>()?;
    debug_assert_eq!(out.len(), b);
    out.par_iter_mut().enumerate().try_for_each(|(row, out)| {
        let (mut probs, mut weights) = (vec![T::zero(); s * e], vec![T::zero(); e]);
        aux_terms(&logits[row * s * e..(row + 1) * s * e], &experts[row * s * k..(row + 1) * s * k], s, e, k, &mut probs, &mut weights)?;
        *out = probs.chunks(e).map(|p| p.iter().zip(&weights).map(|(&p, &w)| p * w).sum::<T>()).sum::<T>();
        Ok(())
    })
}

fn moe_aux_loss_grad<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let (logits, experts, dloss) = (ins[0].get::<T>()?, ins[1].get::<i32>()?, ins[2].get::<T>()?);
    let (s, e) = (ins[0].shape()[1], ins[0].shape()[2]);
    let k = ins[1].shape()[2];
    let out = outs[0].get::<T>()?;
    out.par_chunks_mut(s * e).enumerate().try_for_each(|(row, out)| {
        let mut weights = vec![T::zero(); e];
        aux_terms(&logits[row * s * e..(row + 1) * s * e], &experts[row * s * k..(row + 1) * s * k], s, e, k, out, &mut weights)?;
        // Through the softmax: dl = p * (w - <p, w>), times the sequence's dloss.
        for p in out.chunks_mut(e) {
            let dot: T = p.iter().zip(&weights).map(|(&p, &w)| p * w).sum();
            p.iter_mut().zip(&weights).for_each(|(p, &w)| *p = dloss[row] * *p * (w - dot));
        }
        Ok(())
    })
}

fn moe_slots<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let experts = ins[0].get::<i32>()?;
    let (b, s, k) = (ins[0].shape()[0], ins[0].shape()[1], ins[0].shape()[2]);
    let (e, capacity) = (instr.int("experts")? as usize, instr.int("capacity")? as usize);
    let (slots_slot, counts_slot) = outs.split_at_mut(1);
    let (slots, counts) = (slots_slot[0].get::<i32>()?, counts_slot[0].get::<i32>()?);
    let (chunks, _) = super::zigzag_order(instr);
    let mut next = vec![0usize; e];
    for row in 0..b {
        next.fill(0);
        // First choices before second choices, each in the order of the tokens' positions.
        for j in 0..k {
            for q in 0..s {
                let i = (row * s + shardc_ir::ops::zigzag_row(q, s, chunks)) * k + j;
                let expert = expert_of(experts[i], e)?;
                let slot = next[expert];
                next[expert] += 1;
                slots[i] = if slot < capacity { slot as i32 } else { -1 };
            }
        }
        for (expert, &n) in next.iter().enumerate() {
            counts[expert * b + row] = n.min(capacity) as i32;
        }
    }
    Ok(())
}

/// For every kept choice of the tokens `[B, S, k]`: `(token index, buffer row index)` in a
/// buffer `[E, B, C, _]`, checked.
fn kept_rows(experts: &[i32], slots: &[i32], b: usize, s: usize, k: usize, e: usize, c: usize) -> Result<Vec<(usize, usize, usize)>, String> {
    let mut rows = Vec::with_capacity(experts.len());
    for (i, (&id, &slot)) in experts.iter().zip(slots).enumerate() {
        if slot < 0 {
            continue;
        }
        let expert = expert_of(id, e)?;
        let slot = slot as usize;
        if slot >= c {
            return Err(format!("slot {slot} is outside the capacity of {c}"));
        }
        let token = i / k;
        let row = token / s;
        debug_assert!(row < b);
        rows.push((token, i, (expert * b + row) * c + slot));
    }
    Ok(rows)
}

/// `(B, S, k, E, C)` of a buffer `[E, B, C, d]` and assignments `[B, S, k]`.
fn buffer_dims(buf: &In<'_>, experts: &In<'_>) -> (usize, usize, usize, usize, usize) {
    let (e, c) = (buf.shape()[0], buf.shape()[2]);
    let (b, s, k) = (experts.shape()[0], experts.shape()[1], experts.shape()[2]);
    (b, s, k, e, c)
}

fn moe_dispatch<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let (x, experts, slots) = (ins[0].get::<T>()?, ins[1].get::<i32>()?, ins[2].get::<i32>()?);
    let (b, s, d) = (ins[0].shape()[0], ins[0].shape()[1], ins[0].shape()[2]);
    let k = ins[1].shape()[2];
    let (e, c) = (instr.int("experts")? as usize, instr.int("capacity")? as usize);
    let buf = outs[0].get::<T>()?;
    buf.fill(T::zero());
    for (token, _, row) in kept_rows(experts, slots, b, s, k, e, c)? {
        buf[row * d..(row + 1) * d].copy_from_slice(&x[token * d..(token + 1) * d]);
    }
    Ok(())
}

/// `y[token] = sum over its kept choices of weight(choice) * buf[row]`.
fn gather_rows<T: Real>(ins: &[In<'_>], experts: &In<'_>, slots: &[i32], outs: &mut [Out<'_>], weight: impl Fn(usize) -> T) -> Result<(), String> {
    let buf = ins[0].get::<T>()?;
    let (b, s, k, e, c) = buffer_dims(&ins[0], experts);
    let d = ins[0].shape()[3];
    let y = outs[0].get::<T>()?;
    y.fill(T::zero());
    // Choices in order: each token's rows add up in choice order.
    for (token, choice, row) in kept_rows(experts.get::<i32>()?, slots, b, s, k, e, c)? {
        let w = weight(choice);
        for (y, &v) in y[token * d..(token + 1) * d].iter_mut().zip(&buf[row * d..(row + 1) * d]) {
            *y += w * v;
        }
    }
    Ok(())
}

fn moe_collect<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    gather_rows::<T>(ins, &ins[1], ins[2].get::<i32>()?, outs, |_| T::one())
}

fn moe_combine<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let gates = ins[1].get::<T>()?;
    gather_rows::<T>(ins, &ins[2], ins[3].get::<i32>()?, outs, |choice| gates[choice])
}

fn moe_combine_grad<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let (buf, gates, experts, slots, dy) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<i32>()?, ins[3].get::<i32>()?, ins[4].get::<T>()?);
    let (b, s, k, e, c) = buffer_dims(&ins[0], &ins[2]);
    let d = ins[0].shape()[3];
    let (dbuf_slot, dgates_slot) = outs.split_at_mut(1);
    let (dbuf, dgates) = (dbuf_slot[0].get::<T>()?, dgates_slot[0].get::<T>()?);
    dbuf.fill(T::zero());
    dgates.fill(T::zero());
    for (token, choice, row) in kept_rows(experts, slots, b, s, k, e, c)? {
        let (dy, value) = (&dy[token * d..(token + 1) * d], &buf[row * d..(row + 1) * d]);
        dgates[choice] = dy.iter().zip(value).map(|(&a, &b)| a * b).sum();
        dbuf[row * d..(row + 1) * d].iter_mut().zip(dy).for_each(|(o, &g)| *o = gates[choice] * g);
    }
    Ok(())
}

/// The rows of group `(e, b)` that hold tokens.
fn filled(counts: &[i32], group: usize, capacity: usize) -> Result<usize, String> {
    usize::try_from(counts[group]).ok().filter(|&n| n <= capacity).ok_or_else(|| format!("expert count {} is outside 0..={capacity}", counts[group]))
}

fn expert_matmul<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let (x, w, counts) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<i32>()?);
    let (e, b, c, m) = (ins[0].shape()[0], ins[0].shape()[1], ins[0].shape()[2], ins[0].shape()[3]);
    let transposed = instr.bool("transpose_rhs")?;
    let n = outs[0].shape()[3];
    let y = outs[0].get::<T>()?;
    y.par_chunks_mut(c * n).enumerate().try_for_each(|(group, y)| {
        let rows = filled(counts, group, c)?;
        y[rows * n..].fill(T::zero());
        if rows == 0 {
            return Ok(());
        }
        let expert = group / b;
        let x = &x[group * c * m..group * c * m + rows * m];
        let w = &w[expert * m * n..(expert + 1) * m * n];
        gemm_matmul(&mut y[..rows * n], x, Strided::row_major(rows, m, false), w, Strided::row_major(m, n, transposed), false)
    })?;
    debug_assert_eq!(y.len(), e * b * c * n);
    Ok(())
}

fn expert_matmul_wgrad<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let (x, dy, counts) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<i32>()?);
    let (b, c, m) = (ins[0].shape()[1], ins[0].shape()[2], ins[0].shape()[3]);
    let n = ins[1].shape()[3];
    let dw = outs[0].get::<T>()?;
    dw.par_chunks_mut(m * n).enumerate().try_for_each(|(expert, dw)| {
        dw.fill(T::zero());
        // Sequences in order: the gradient sums the same way whatever the threads.
        for row in 0..b {
            let group = expert * b + row;
            let rows = filled(counts, group, c)?;
            if rows == 0 {
                continue;
            }
            let x = &x[group * c * m..group * c * m + rows * m];
            let dy = &dy[group * c * n..group * c * n + rows * n];
            gemm_matmul(dw, x, Strided::row_major(m, rows, true), dy, Strided::row_major(rows, n, false), true)?;
        }
        Ok(())
    })
}
