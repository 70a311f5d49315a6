//! Schedule generators.

use super::{Item, Kind, Schedule, ScheduleError, Work};

fn item(work: Work, microbatch: usize, chunk: usize) -> Item {
    Item { work, microbatch, chunk }
}

/// The most model chunks per rank of an interleaved schedule.
pub const MAX_CHUNKS: usize = 64;
/// The most work items (stages x micro-batches x chunks x 3) of a schedule.
pub const MAX_ITEMS: usize = 1 << 24;

/// Builds a schedule of `kind` for `stages` pipeline ranks, `microbatches` micro-batches and
/// `chunks` model chunks per rank (interleaved only; it needs `microbatches` to be a multiple
/// of `stages`).
pub fn generate(kind: Kind, stages: usize, microbatches: usize, chunks: usize) -> Result<Schedule, ScheduleError> {
    let (p, m) = (stages, microbatches);
    if p == 0 || m == 0 {
        return Err(ScheduleError::Invalid("stages and micro-batches must be at least 1".into()));
    }
    if kind == Kind::Interleaved && !(1..=MAX_CHUNKS).contains(&chunks) {
        return Err(ScheduleError::Invalid(format!("virtual stages (chunks per rank) must be between 1 and {MAX_CHUNKS}, got {chunks}")));
    }
    // Every item is simulated and drawn: a schedule larger than this is a typo, not a plan.
    let v = if kind == Kind::Interleaved { chunks.max(1) } else { 1 };
    let items = p.saturating_mul(m).saturating_mul(v).saturating_mul(3);
    if items > MAX_ITEMS {
        return Err(ScheduleError::Invalid(format!("{p} stages x {m} micro-batches x {v} chunks make {items} work items, more than the {MAX_ITEMS} a schedule may have")));
    }
    if kind == Kind::Interleaved && m % p != 0 {
        return Err(ScheduleError::Invalid(format!("interleaved 1F1B needs micro-batches ({m}) to be a multiple of stages ({p})")));
    }
    let ranks = match kind {
        Kind::Gpipe => (0..p).map(|_| (0..m).map(|i| item(Work::F, i, 0)).chain((0..m).map(|i| item(Work::B, i, 0))).collect()).collect(),
        Kind::OneFOneB => (0..p).map(|s| one_f_one_b(p, m, s)).collect(),
        Kind::Interleaved => (0..p).map(|s| interleaved(p, m, v, s)).collect(),
        Kind::ZeroBubble => zero_bubble(p, m),
    };
    Ok(Schedule { kind, stages: p, microbatches: m, chunks: v, ranks })
}

/// Rank `s` of 1F1B: `p - s - 1` warm-up forwards, then one forward and one backward at a
/// time, then the remaining backwards.
fn one_f_one_b(p: usize, m: usize, s: usize) -> Vec<Item> {
    let warmup = (p - s - 1).min(m);
    let mut items: Vec<Item> = (0..warmup).map(|i| item(Work::F, i, 0)).collect();
    for i in 0..m - warmup {
        items.push(item(Work::F, warmup + i, 0));
        items.push(item(Work::B, i, 0));
    }
    items.extend((m - warmup..m).map(|i| item(Work::B, i, 0)));
    items
}

/// Rank `s` of interleaved 1F1B (Narayanan et al. 2021, as Megatron-LM orders it): forward
/// work visits chunks in groups of `p` micro-batches; backward work visits them in reverse.
fn interleaved(p: usize, m: usize, v: usize, s: usize) -> Vec<Item> {
    let total = m * v;
    let forward = |k: usize| item(Work::F, (k / (p * v)) * p + k % p, (k / p) % v);
    let backward = |k: usize| item(Work::B, (k / (p * v)) * p + k % p, v - 1 - (k / p) % v);
    let warmup = ((p - s - 1) * 2 + (v - 1) * p).min(total);
    let mut items: Vec<Item> = (0..warmup).map(forward).collect();
    for i in 0..total - warmup {
        items.push(forward(warmup + i));
        items.push(backward(i));
    }
    items.extend((total - warmup..total).map(backward));
    items
}

/// ZB-H1 (Qi et al. 2023): backward split into input gradient `B` and weight gradient `W`;
/// each rank, when free, runs a ready `B` first, else a forward while it holds fewer than
/// `p - s` micro-batches (1F1B's memory), else a pending `W`. Built by simulating with unit
/// costs, so the weight gradients land in what would be bubbles.
fn zero_bubble(p: usize, m: usize) -> Vec<Vec<Item>> {
    let mut f_done = vec![vec![None::<usize>; m]; p];
    let mut b_done = vec![vec![None::<usize>; m]; p];
    let mut w_done = vec![vec![false; m]; p];
    let mut next_f = vec![0usize; p];
    let mut ranks: Vec<Vec<Item>> = vec![Vec::new(); p];
    let mut t = 0usize;
    let total = 3 * m * p;
    let mut placed = 0;
    while placed < total {
        // Decisions at time t use work finished by t (every item takes one unit).
        let finished = |d: Option<usize>| d.is_some_and(|end| end <= t);
        let mut chosen = vec![None; p];
        for s in 0..p {
            let in_flight = (0..m).filter(|&i| f_done[s][i].is_some() && b_done[s][i].is_none()).count();
            let b = (0..m).find(|&i| b_done[s][i].is_none() && finished(f_done[s][i]) && (s == p - 1 || finished(b_done[s + 1][i])));
            let f = (next_f[s] < m && in_flight < p - s && (s == 0 || finished(f_done[s - 1][next_f[s]]))).then_some(next_f[s]);
            let w = (0..m).find(|&i| !w_done[s][i] && finished(b_done[s][i]));
            chosen[s] = b.map(|i| item(Work::B, i, 0)).or(f.map(|i| item(Work::F, i, 0))).or(w.map(|i| item(Work::W, i, 0)));
        }
        for (s, c) in chosen.into_iter().enumerate() {
            let Some(c) = c else { continue };
            match c.work {
                Work::F => {
                    f_done[s][c.microbatch] = Some(t + 1);
                    next_f[s] += 1;
                }
                Work::B => b_done[s][c.microbatch] = Some(t + 1),
                Work::W => w_done[s][c.microbatch] = true,
            }
            ranks[s].push(c);
            placed += 1;
        }
        t += 1;
    }
    ranks
}
