//! CPU kernels: Attention and its backward (`ir/src/ops/attention.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[kernel!("xf.attention", attention_kernel), kernel!("xf.attention_grad", attention_grad_kernel)];

fn attention_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    attention::<T>(instr, ins, outs, cx.seq_offset)
}
fn attention_grad_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    attention_grad::<T>(instr, ins, outs, cx.seq_offset)
}

/// Keys that query row `i` (at position `offset + i`) sees of `keys`.
fn visible_keys(causal: bool, offset: usize, i: usize, keys: usize) -> usize {
    if causal { (offset + i + 1).min(keys) } else { keys }
}

/// Softmax probabilities of query row `i` against every visible key, into `p`.
pub(super) fn attention_row<T: Real>(q_i: &[T], k: &[T], d: usize, visible: usize, scale: T, p: &mut [T]) {
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

/// Attention of `[b, hq, s, d]` queries, the first at position `offset`, against
/// `[b, hk, keys, d]` keys and values (a context-parallel rank's queries against the whole
/// sequence: `keys` is a multiple of `s`).
pub(super) fn attention<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], offset: usize) -> Result<(), String> {
    let (causal, scale) = (instr.bool("causal")?, T::of(instr.float("scale")?));
    let (qs, ks) = (ins[0].shape(), ins[1].shape());
    let (hq, s, d, hk, keys) = (qs[1], qs[2], qs[3], ks[1], ks[2]);
    let group = hq / hk;
    let (q, k, v) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?);
    outs[0].get::<T>()?.par_chunks_mut(s * d).enumerate().for_each(|(bh, out)| {
        let (b, h) = (bh / hq, bh % hq);
        let kv = (b * hk + h / group) * keys * d;
        let (k, v, q) = (&k[kv..kv + keys * d], &v[kv..kv + keys * d], &q[bh * s * d..(bh + 1) * s * d]);
        let mut p = vec![T::zero(); keys];
        for i in 0..s {
            let visible = visible_keys(causal, offset, i, keys);
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

/// The backward of [`attention`]: dq for this rank's queries, and dk, dv over every key
/// from those queries alone (partial sums when the queries are split).
pub(super) fn attention_grad<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], offset: usize) -> Result<(), String> {
    let (causal, scale) = (instr.bool("causal")?, T::of(instr.float("scale")?));
    let (qs, ks) = (ins[0].shape(), ins[1].shape());
    let (hq, s, d, hk, keys) = (qs[1], qs[2], qs[3], ks[1], ks[2]);
    let group = hq / hk;
    let (q, k, v, dout) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?, ins[3].get::<T>()?);
    let (dq_out, rest) = outs.split_at_mut(1);
    let (dk_out, dv_out) = rest.split_at_mut(1);
    let (dq, dk, dv) = (dq_out[0].get::<T>()?, dk_out[0].get::<T>()?, dv_out[0].get::<T>()?);
    // One task per (batch, kv head): it owns that head's dk/dv and its group's dq, and sums
    // the group's contributions in head order.
    dq.par_chunks_mut(group * s * d)
        .zip(dk.par_chunks_mut(keys * d).zip(dv.par_chunks_mut(keys * d)))
        .enumerate()
        .for_each(|(bg, (dq, (dk, dv)))| {
            let (b, g) = (bg / hk, bg % hk);
            let kv = (b * hk + g) * keys * d;
            let (k, v) = (&k[kv..kv + keys * d], &v[kv..kv + keys * d]);
            dk.fill(T::zero());
            dv.fill(T::zero());
            let (mut p, mut dp) = (vec![T::zero(); keys], vec![T::zero(); keys]);
            for gh in 0..group {
                let h = g * group + gh;
                let at = (b * hq + h) * s * d;
                let (q, dout) = (&q[at..at + s * d], &dout[at..at + s * d]);
                let dq = &mut dq[gh * s * d..(gh + 1) * s * d];
                for i in 0..s {
                    let visible = visible_keys(causal, offset, i, keys);
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
