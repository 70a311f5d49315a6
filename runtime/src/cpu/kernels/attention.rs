//! CPU kernels: Attention and its backward (`ir/src/ops/attention.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[
    kernel!("xf.attention", attention_kernel, forward_scratch),
    kernel!("xf.attention_grad", attention_grad_kernel, backward_scratch),
    kernel!("xf.attention_block", attention_block_kernel, forward_scratch),
    kernel!("xf.attention_merge", attention_merge_kernel),
    kernel!("xf.attention_block_grad", attention_block_grad_kernel, backward_scratch),
];

/// Elements of `shape`.
fn elements(shape: Option<&&[usize]>) -> usize {
    shape.map_or(0, |s| s.iter().fold(1usize, |n, &d| n.saturating_mul(d)))
}

/// The forward kernels' heads-first copies: q, k, v and the output (see
/// [`operands_heads_first`]); a row of scores a thread is small beside them.
fn forward_scratch(_: &Instr, shapes: &[&[usize]]) -> usize {
    let (q, k) = (elements(shapes.first()), elements(shapes.get(1)));
    q.saturating_mul(2).saturating_add(k.saturating_mul(2))
}

/// The backward kernels' heads-first copies: q, the output, its gradient and q's gradient;
/// k, v and their gradients.
fn backward_scratch(_: &Instr, shapes: &[&[usize]]) -> usize {
    let (q, k) = (elements(shapes.first()), elements(shapes.get(1)));
    q.saturating_mul(4).saturating_add(k.saturating_mul(4))
}

fn attention_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    attention::<T>(instr, ins, outs, cx.seq_offset)
}
fn attention_grad_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    attention_grad::<T>(instr, ins, outs, cx.seq_offset)
}

/// Attention's sizes from `q [b, s, hq * d]` and `k [b, keys, hk * d]` (`d` the `head_dim`
/// attribute): `(b, s, hq, d, keys, hk)`.
fn sizes(instr: &Instr, ins: &[In<'_>]) -> Result<(usize, usize, usize, usize, usize, usize), String> {
    let d = head_dim(instr)?;
    let (qs, ks) = (ins[0].shape(), ins[1].shape());
    let sizes = (qs[0], qs[1], qs[2] / d, d, ks[1], ks[2] / d);
    if sizes.2 == 0 || sizes.5 == 0 {
        return Err(format!("`{}`: q {qs:?} and k {ks:?} must hold whole heads of head_dim = {d}", instr.op));
    }
    Ok(sizes)
}

/// Operands `slots` of `ins` heads first (see [`heads_first`]); query-shaped (`[b, s, hq * d]`)
/// unless the slot is k's or v's (1, 2: `[b, keys, hk * d]`).
fn operands_heads_first<T: Real, const N: usize>(ins: &[In<'_>], slots: [usize; N], (s, hq, d, keys, hk): (usize, usize, usize, usize, usize)) -> Result<[Vec<T>; N], String> {
    let mut out = Vec::with_capacity(N);
    for slot in slots {
        let (rows, heads) = if matches!(slot, 1 | 2) { (keys, hk) } else { (s, hq) };
        out.push(heads_first(ins[slot].get::<T>()?, rows, heads, d));
    }
    out.try_into().map_err(|_| "operand count".to_string())
}

/// `[b, s, h, d] -> [b, h, s, d]`: the kernels below walk one head's rows contiguously.
fn heads_first<T: Real>(x: &[T], s: usize, h: usize, d: usize) -> Vec<T> {
    let mut y = vec![T::zero(); x.len()];
    y.par_chunks_mut(s * d).enumerate().for_each(|(bh, y)| {
        let (bi, hi) = (bh / h, bh % h);
        for (i, row) in y.chunks_mut(d).enumerate() {
            let at = ((bi * s + i) * h + hi) * d;
            row.copy_from_slice(&x[at..at + d]);
        }
    });
    y
}

/// `[b, h, s, d] -> [b, s, h, d]` into `y`: the inverse of [`heads_first`].
fn heads_back<T: Real>(x: &[T], y: &mut [T], s: usize, h: usize, d: usize) {
    y.par_chunks_mut(h * d).enumerate().for_each(|(bs, y)| {
        let (bi, i) = (bs / s, bs % s);
        for (hi, row) in y.chunks_mut(d).enumerate() {
            let at = ((bi * h + hi) * s + i) * d;
            row.copy_from_slice(&x[at..at + d]);
        }
    });
}

/// Which keys each query row sees. Row `i` is row `offset + i` of the sequence and key `j`
/// row `key_offset + j` (a ring step's block starts at its source rank's part). In the
/// natural order a row sees a prefix of the keys; in zigzag order (context parallelism) rows
/// and keys are at `zigzag_position` of their index, and a row sees the keys at or before
/// its position.
struct Visibility {
    causal: bool,
    offset: usize,
    key_offset: usize,
    keys: usize,
    /// Zigzag order: the position of each key (empty in the natural order).
    key_positions: Vec<usize>,
    order: (usize, usize),
}

impl Visibility {
    fn new(instr: &Instr, offset: usize, key_offset: usize, keys: usize) -> Result<Visibility, String> {
        let causal = instr.bool("causal")?;
        let order = super::zigzag_order(instr);
        let key_positions = if order.0 > 1 { (0..keys).map(|j| shardc_ir::ops::zigzag_position(key_offset + j, order.1, order.0)).collect() } else { Vec::new() };
        Ok(Visibility { causal, offset, key_offset, keys, key_positions, order })
    }

    /// A ring step's visibility: this rank's queries are part `p` of `n` (`cx.seq_part`), and
    /// at step `t` it holds the keys of part `(p - t) mod n`.
    fn of_ring_step(instr: &Instr, cx: &RankCx, keys: usize) -> Result<Visibility, String> {
        Visibility::new(instr, cx.seq_offset, crate::cpu::ring_source(instr, cx.seq_part)? * keys, keys)
    }

    /// The position of query row `i`.
    fn query_position(&self, i: usize) -> usize {
        shardc_ir::ops::zigzag_position(self.offset + i, self.order.1, self.order.0)
    }

    /// The keys row `i` sees: a prefix length, or a mask of every key (zigzag order).
    fn row(&self, i: usize, mask: &mut [bool]) -> Option<usize> {
        if !self.causal {
            return Some(self.keys);
        }
        if self.key_positions.is_empty() {
            return Some((self.offset + i + 1).saturating_sub(self.key_offset).min(self.keys));
        }
        let at = self.query_position(i);
        mask.iter_mut().zip(&self.key_positions).for_each(|(m, &k)| *m = k <= at);
        None
    }

    /// Whether key `j` is hidden from the row whose mask [`Visibility::row`] last filled (the
    /// zigzag order walks every key): a hidden key is skipped, not multiplied by its zero
    /// probability, so that a NaN or inf there does not reach the row.
    fn hidden(&self, mask: &[bool], j: usize) -> bool {
        self.causal && !self.key_positions.is_empty() && !mask[j]
    }

    /// Whether row `i` sees key `j`.
    fn sees(&self, i: usize, j: usize) -> bool {
        match self.key_positions.get(j) {
            _ if !self.causal => true,
            Some(&k) => k <= self.query_position(i),
            None => self.key_offset + j <= self.offset + i,
        }
    }
}

/// Softmax probabilities of query row `i` against the keys `mask` shows, into `p` (zero
/// where hidden); returns the log-sum-exp of the scaled scores.
fn attention_row_masked<T: Real>(q_i: &[T], k: &[T], d: usize, mask: &[bool], scale: T, p: &mut [T]) -> T {
    let mut max = T::neg_infinity();
    for (j, &seen) in mask.iter().enumerate() {
        if seen {
            let s = q_i.iter().zip(&k[j * d..(j + 1) * d]).map(|(&a, &b)| a * b).sum::<T>() * scale;
            p[j] = s;
            max = max.max(s);
        }
    }
    let mut sum = T::zero();
    for (pj, &seen) in p.iter_mut().zip(mask) {
        *pj = if seen { (*pj - max).exp() } else { T::zero() };
        sum += *pj;
    }
    let inv = T::one() / sum;
    p[..mask.len()].iter_mut().for_each(|pj| *pj *= inv);
    max + sum.ln()
}

/// Probabilities of row `i` into `p`; returns how many leading keys to walk (every key in
/// zigzag order, where `p` is zero for the hidden ones) and the row's log-sum-exp.
fn row_probabilities<T: Real>(seen: &Visibility, i: usize, q_i: &[T], k: &[T], d: usize, scale: T, mask: &mut [bool], p: &mut [T]) -> (usize, T) {
    match seen.row(i, mask) {
        Some(visible) => (visible, attention_row(q_i, k, d, visible, scale, p)),
        None => (seen.keys, attention_row_masked(q_i, k, d, mask, scale, p)),
    }
}

/// Probabilities of row `i` into `p` from its saved log-sum-exp, `exp(score - lse)` (zero for
/// the keys it does not see, and for every key where it sees none); returns how many leading
/// keys to walk, as [`row_probabilities`].
#[allow(clippy::too_many_arguments)]
fn saved_probabilities<T: Real>(seen: &Visibility, i: usize, q_i: &[T], k: &[T], d: usize, scale: T, lse: T, mask: &mut [bool], p: &mut [T]) -> usize {
    let (visible, prefix) = match seen.row(i, mask) {
        Some(visible) => (visible, true),
        None => (seen.keys, false),
    };
    for (j, pj) in p[..visible].iter_mut().enumerate() {
        let sees = (prefix || mask[j]) && lse != T::neg_infinity();
        *pj = if sees { (q_i.iter().zip(&k[j * d..(j + 1) * d]).map(|(&a, &b)| a * b).sum::<T>() * scale - lse).exp() } else { T::zero() };
    }
    visible
}

/// Softmax probabilities of query row `i` against every visible key, into `p`; returns the
/// log-sum-exp of the scaled scores.
fn attention_row<T: Real>(q_i: &[T], k: &[T], d: usize, visible: usize, scale: T, p: &mut [T]) -> T {
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
    max + sum.ln()
}

/// Attention of `[b, s, hq * d]` queries, the first at position `offset`, against
/// `[b, keys, hk * d]` keys and values (a context-parallel rank's queries against the whole
/// sequence: `keys` is a multiple of `s`).
pub(super) fn attention<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], offset: usize) -> Result<(), String> {
    let scale = T::of(instr.float("scale")?);
    let (b, s, hq, d, keys, hk) = sizes(instr, ins)?;
    if b * s == 0 {
        // No rows: nothing to write.
        return Ok(());
    }
    let seen = Visibility::new(instr, offset, 0, keys)?;
    let group = hq / hk;
    let [q, k, v] = operands_heads_first::<T, 3>(ins, [0, 1, 2], (s, hq, d, keys, hk))?;
    let (out_slot, lse_slot) = outs.split_at_mut(1);
    let mut out = vec![T::zero(); q.len()];
    let lse = lse_slot[0].get::<T>()?;
    out.par_chunks_mut(s * d).zip(lse.par_chunks_mut(s)).enumerate().for_each(|(bh, (out, lse))| {
        let (b, h) = (bh / hq, bh % hq);
        let kv = (b * hk + h / group) * keys * d;
        let (k, v, q) = (&k[kv..kv + keys * d], &v[kv..kv + keys * d], &q[bh * s * d..(bh + 1) * s * d]);
        let (mut p, mut mask) = (vec![T::zero(); keys], vec![false; keys]);
        for i in 0..s {
            let (visible, row_lse) = row_probabilities(&seen, i, &q[i * d..(i + 1) * d], k, d, scale, &mut mask, &mut p);
            lse[i] = row_lse;
            let o = &mut out[i * d..(i + 1) * d];
            o.fill(T::zero());
            for j in (0..visible).filter(|&j| !seen.hidden(&mask, j)) {
                for (o, &vv) in o.iter_mut().zip(&v[j * d..(j + 1) * d]) {
                    *o += p[j] * vv;
                }
            }
        }
    });
    heads_back(&out, out_slot[0].get::<T>()?, s, hq, d);
    Ok(())
}

/// The backward of [`attention`]: dq for this rank's queries, and dk, dv over every key
/// from those queries alone (partial sums when the queries are split).
pub(super) fn attention_grad<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], offset: usize) -> Result<(), String> {
    let scale = T::of(instr.float("scale")?);
    let (b, s, hq, d, keys, hk) = sizes(instr, ins)?;
    if b * s == 0 {
        return Ok(());
    }
    let seen = Visibility::new(instr, offset, 0, keys)?;
    let group = hq / hk;
    let [q, k, v, out, dout] = operands_heads_first::<T, 5>(ins, [0, 1, 2, 3, 5], (s, hq, d, keys, hk))?;
    let lse = ins[4].get::<T>()?;
    let (mut dq, mut dk, mut dv) = (vec![T::zero(); q.len()], vec![T::zero(); k.len()], vec![T::zero(); k.len()]);
    // One task per (batch, kv head): it owns that head's dk/dv and its group's dq, and sums
    // the group's contributions in head order. The probabilities come from the forward's
    // log-sum-exp and rowsum(dp * p) is out . dout, as FlashAttention-2 computes them.
    dq.par_chunks_mut(group * s * d)
        .zip(dk.par_chunks_mut(keys * d).zip(dv.par_chunks_mut(keys * d)))
        .enumerate()
        .for_each(|(bg, (dq, (dk, dv)))| {
            let (b, g) = (bg / hk, bg % hk);
            let kv = (b * hk + g) * keys * d;
            let (k, v) = (&k[kv..kv + keys * d], &v[kv..kv + keys * d]);
            dk.fill(T::zero());
            dv.fill(T::zero());
            let (mut p, mut dp, mut mask) = (vec![T::zero(); keys], vec![T::zero(); keys], vec![false; keys]);
            for gh in 0..group {
                let h = g * group + gh;
                let at = (b * hq + h) * s * d;
                let (q, out, dout) = (&q[at..at + s * d], &out[at..at + s * d], &dout[at..at + s * d]);
                let lse = &lse[(b * hq + h) * s..(b * hq + h + 1) * s];
                let dq = &mut dq[gh * s * d..(gh + 1) * s * d];
                for i in 0..s {
                    let (q_i, o_i, do_i) = (&q[i * d..(i + 1) * d], &out[i * d..(i + 1) * d], &dout[i * d..(i + 1) * d]);
                    let visible = saved_probabilities(&seen, i, q_i, k, d, scale, lse[i], &mut mask, &mut p);
                    let rowdot = o_i.iter().zip(do_i).map(|(&a, &b)| a * b).sum::<T>();
                    for j in 0..visible {
                        dp[j] = do_i.iter().zip(&v[j * d..(j + 1) * d]).map(|(&a, &b)| a * b).sum::<T>();
                    }
                    let dq_i = &mut dq[i * d..(i + 1) * d];
                    dq_i.fill(T::zero());
                    for j in (0..visible).filter(|&j| !seen.hidden(&mask, j)) {
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
    write_gradients(outs, [&dq, &dk, &dv], [(s, hq), (keys, hk), (keys, hk)], d)
}

/// `dq`, `dk`, `dv` computed heads first into the op's three results.
fn write_gradients<T: Real>(outs: &mut [Out<'_>], grads: [&[T]; 3], shapes: [(usize, usize); 3], d: usize) -> Result<(), String> {
    for ((out, grad), (rows, heads)) in outs.iter_mut().zip(grads).zip(shapes) {
        heads_back(grad, out.get::<T>()?, rows, heads, d);
    }
    Ok(())
}

fn attention_block_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    let scale = T::of(instr.float("scale")?);
    let (b, s, hq, d, keys, hk) = sizes(instr, ins)?;
    if b * s == 0 {
        return Ok(());
    }
    let block = Visibility::of_ring_step(instr, cx, keys)?;
    let group = hq / hk;
    let [q, k, v] = operands_heads_first::<T, 3>(ins, [0, 1, 2], (s, hq, d, keys, hk))?;
    let (out_slot, lse_slot) = outs.split_at_mut(1);
    let mut out = vec![T::zero(); q.len()];
    let lse = lse_slot[0].get::<T>()?;
    out.par_chunks_mut(s * d).zip(lse.par_chunks_mut(s)).enumerate().for_each(|(bh, (out, lse))| {
        let (b, h) = (bh / hq, bh % hq);
        let kv = (b * hk + h / group) * keys * d;
        let (k, v, q) = (&k[kv..kv + keys * d], &v[kv..kv + keys * d], &q[bh * s * d..(bh + 1) * s * d]);
        let mut p = vec![T::zero(); keys];
        for i in 0..s {
            let q_i = &q[i * d..(i + 1) * d];
            let mut max = T::neg_infinity();
            for (j, pj) in p.iter_mut().enumerate() {
                *pj = if block.sees(i, j) { q_i.iter().zip(&k[j * d..(j + 1) * d]).map(|(&a, &b)| a * b).sum::<T>() * scale } else { T::neg_infinity() };
                max = max.max(*pj);
            }
            let o = &mut out[i * d..(i + 1) * d];
            o.fill(T::zero());
            // A row that sees none of the block. (Not read off `max`, which skips a NaN score
            // and is -inf for scores of -inf too: those rows are NaN, as in the whole
            // sequence's kernels.)
            if !(0..keys).any(|j| block.sees(i, j)) {
                lse[i] = T::neg_infinity();
                continue;
            }
            let mut sum = T::zero();
            for (j, pj) in p.iter_mut().enumerate() {
                *pj = (*pj - max).exp();
                sum += *pj;
                if *pj != T::zero() {
                    for (o, &vv) in o.iter_mut().zip(&v[j * d..(j + 1) * d]) {
                        *o += *pj * vv;
                    }
                }
            }
            let inv = T::one() / sum;
            o.iter_mut().for_each(|x| *x *= inv);
            lse[i] = max + sum.ln();
        }
    });
    heads_back(&out, out_slot[0].get::<T>()?, s, hq, d);
    Ok(())
}

fn attention_merge_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    // Rows of out are `[b, s, h]`, of lse `[b, h, s]`.
    let (out_shape, lse_shape) = (ins[0].shape(), ins[1].shape());
    let (h, s) = (lse_shape[1], lse_shape[2]);
    let d = out_shape[2] / h.max(1);
    if d == 0 || out_shape[0] * s == 0 {
        return Ok(());
    }
    let (oa, la, ob, lb) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?, ins[3].get::<T>()?);
    let (out_slot, lse_slot) = outs.split_at_mut(1);
    let (out, lse) = (out_slot[0].get::<T>()?, lse_slot[0].get::<T>()?);
    let stat = |row: usize| (row / (s * h) * h + row % h) * s + row / h % s;
    out.par_chunks_mut(d).enumerate().for_each(|(row, o)| {
        let (a, b) = (la[stat(row)], lb[stat(row)]);
        let m = a.max(b);
        // Rows that see no key in either part; `max` drops a NaN, which must stay.
        if a == T::neg_infinity() && b == T::neg_infinity() {
            o.fill(T::zero());
            return;
        }
        let (wa, wb) = ((a - m).exp(), (b - m).exp());
        let inv = T::one() / (wa + wb);
        let (xa, xb) = (&oa[row * d..(row + 1) * d], &ob[row * d..(row + 1) * d]);
        for ((o, &x), &y) in o.iter_mut().zip(xa).zip(xb) {
            *o = (wa * x + wb * y) * inv;
        }
    });
    lse.par_iter_mut().enumerate().for_each(|(row, l)| {
        let (a, b) = (la[row], lb[row]);
        let m = a.max(b);
        *l = if a == T::neg_infinity() && b == T::neg_infinity() { m } else { m + ((a - m).exp() + (b - m).exp()).ln() };
    });
    Ok(())
}

fn attention_block_grad_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    let scale = T::of(instr.float("scale")?);
    let (b, s, hq, d, keys, hk) = sizes(instr, ins)?;
    if b * s == 0 {
        return Ok(());
    }
    let block = Visibility::of_ring_step(instr, cx, keys)?;
    let group = hq / hk;
    let [q, k, v, out, dout] = operands_heads_first::<T, 5>(ins, [0, 1, 2, 3, 5], (s, hq, d, keys, hk))?;
    let lse = ins[4].get::<T>()?;
    let (mut dq, mut dk, mut dv) = (vec![T::zero(); q.len()], vec![T::zero(); k.len()], vec![T::zero(); k.len()]);
    // One task per (batch, kv head), as in `attention_grad`.
    dq.par_chunks_mut(group * s * d)
        .zip(dk.par_chunks_mut(keys * d).zip(dv.par_chunks_mut(keys * d)))
        .enumerate()
        .for_each(|(bg, (dq, (dk, dv)))| {
            let (b, g) = (bg / hk, bg % hk);
            let kv = (b * hk + g) * keys * d;
            let (k, v) = (&k[kv..kv + keys * d], &v[kv..kv + keys * d]);
            dk.fill(T::zero());
            dv.fill(T::zero());
            dq.fill(T::zero());
            for gh in 0..group {
                let h = g * group + gh;
                let at = (b * hq + h) * s * d;
                let rows = (b * hq + h) * s;
                let dq = &mut dq[gh * s * d..(gh + 1) * s * d];
                for i in 0..s {
                    let l = lse[rows + i];
                    if l == T::neg_infinity() {
                        continue;
                    }
                    let (q_i, o_i, do_i) = (&q[at + i * d..at + (i + 1) * d], &out[at + i * d..at + (i + 1) * d], &dout[at + i * d..at + (i + 1) * d]);
                    let rowdot = o_i.iter().zip(do_i).map(|(&a, &b)| a * b).sum::<T>();
                    for j in (0..keys).filter(|&j| block.sees(i, j)) {
                        let (k_j, v_j) = (&k[j * d..(j + 1) * d], &v[j * d..(j + 1) * d]);
                        let p = (q_i.iter().zip(k_j).map(|(&a, &b)| a * b).sum::<T>() * scale - l).exp();
                        let dp = do_i.iter().zip(v_j).map(|(&a, &b)| a * b).sum::<T>();
                        let ds = p * (dp - rowdot) * scale;
                        let dq_i = &mut dq[i * d..(i + 1) * d];
                        for c in 0..d {
                            dq_i[c] += ds * k_j[c];
                        }
                        let dk_j = &mut dk[j * d..(j + 1) * d];
                        for c in 0..d {
                            dk_j[c] += ds * q_i[c];
                        }
                        let dv_j = &mut dv[j * d..(j + 1) * d];
                        for c in 0..d {
                            dv_j[c] += p * do_i[c];
                        }
                    }
                }
            }
        });
    write_gradients(outs, [&dq, &dk, &dv], [(s, hq), (keys, hk), (keys, hk)], d)
}
