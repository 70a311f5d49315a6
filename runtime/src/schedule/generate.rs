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

/// ZB-H1 (Qi et al. 2023, §2.1): backward split into input gradient `B` and weight gradient
/// `W`. Rank `s` runs 1F1B's forwards and input gradients (`p - s - 1` warm-up forwards,
/// then a forward and a `B` at a time) and delays its weight gradients by `s` micro-batches:
/// after the `B` of micro-batch `i` comes the `W` of micro-batch `i - s`, and the rest at the
/// end. Every rank then holds at most `p` micro-batches from forward to `W` (1F1B's first
/// rank, which holds the most), the later ranks' `B`s start earlier, and the delayed `W`s fill
/// the tail's bubbles: (p - 1)(F + B - W) of idle time a rank, a third of 1F1B's when the
/// three take as long.
fn zero_bubble(p: usize, m: usize) -> Vec<Vec<Item>> {
    (0..p)
        .map(|s| {
            let mut items = Vec::with_capacity(3 * m);
            let mut weights = 0..m;
            for one in one_f_one_b(p, m, s) {
                items.push(one);
                if one.work == Work::B && one.microbatch >= s {
                    items.extend(weights.next().map(|i| item(Work::W, i, 0)));
                }
            }
            items.extend(weights.map(|i| item(Work::W, i, 0)));
            items
        })
        .collect()
}
