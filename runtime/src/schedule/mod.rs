//! Pipeline schedules as data: for each pipeline rank, the ordered list of work items
//! (forward `F`, backward `B`, and for zero-bubble schedules the weight-gradient part `W`)
//! with their micro-batch and model chunk.
//!
//! [`generate`] builds GPipe, 1F1B, interleaved 1F1B and ZB-H1 schedules; [`simulate`] runs
//! one against per-item costs, honouring the dependencies between stages (a stage's forward
//! needs the previous stage's, a backward the next stage's backward and its own forward, a
//! weight gradient its backward), and reports start times, the bubble fraction, peak
//! in-flight activations, and a deadlock as an error. Bubbles and memory are therefore
//! computed from the schedule itself, not from formulas; tests check the formulas hold.

mod generate;
mod render;

pub use generate::generate;
pub use render::{svg, trace_json};

use serde::{Deserialize, Serialize};

/// Kind of work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Work {
    /// Forward pass of one micro-batch through one model chunk.
    F,
    /// Backward pass (input gradient and, unless split off into `W`, weight gradient).
    B,
    /// Weight-gradient part of a backward pass (zero-bubble schedules).
    W,
}

/// One work item on a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Item {
    /// What.
    pub work: Work,
    /// Which micro-batch.
    pub microbatch: usize,
    /// Which of the rank's model chunks (interleaved schedules; 0 otherwise).
    pub chunk: usize,
}

/// A schedule family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward, one backward in the steady state.
    OneFOneB,
    /// 1F1B over `v` model chunks per rank.
    Interleaved,
    /// ZB-H1: 1F1B with backward split into input and weight gradients, the weight
    /// gradients filling the bubbles (Qi et al. 2023).
    ZeroBubble,
}

impl Kind {
    /// The usual name: `GPipe`, `1F1B`, `interleaved 1F1B`, `ZB-H1`.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Gpipe => "GPipe",
            Kind::OneFOneB => "1F1B",
            Kind::Interleaved => "interleaved 1F1B",
            Kind::ZeroBubble => "ZB-H1",
        }
    }

    /// Parses `gpipe`, `1f1b`, `interleaved` or `zb-h1`.
    pub fn parse(text: &str) -> Option<Kind> {
        Some(match text {
            "gpipe" => Kind::Gpipe,
            "1f1b" => Kind::OneFOneB,
            "interleaved" => Kind::Interleaved,
            "zb-h1" | "zero-bubble" => Kind::ZeroBubble,
            _ => return None,
        })
    }
}

/// A pipeline schedule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    /// Family.
    pub kind: Kind,
    /// Pipeline ranks.
    pub stages: usize,
    /// Micro-batches per optimizer step.
    pub microbatches: usize,
    /// Model chunks per rank (1 unless interleaved).
    pub chunks: usize,
    /// Each rank's items in execution order.
    pub ranks: Vec<Vec<Item>>,
}

impl Schedule {
    /// The pipeline stage (0 .. stages * chunks) that chunk `chunk` of `rank` runs: model
    /// chunks are dealt round-robin, so rank r holds stages r, r + p, r + 2p, ...
    pub fn stage_of(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }

    /// Whether the schedule is forward work alone (an evaluation's: no gradients, so no step).
    pub fn is_forward_only(&self) -> bool {
        self.ranks.iter().flatten().all(|i| i.work == Work::F)
    }

    /// This pipeline's forward work alone over `microbatches` micro-batches, as Megatron-LM
    /// evaluates (its forward-only schedule): every rank runs micro-batch after micro-batch,
    /// each through its chunks in order. Every item waits only on items of earlier
    /// micro-batches or earlier stages, which each rank runs before it: none waits forever.
    pub fn forward_only(&self, microbatches: usize) -> Schedule {
        let items: Vec<Item> = (0..microbatches).flat_map(|microbatch| (0..self.chunks).map(move |chunk| Item { work: Work::F, microbatch, chunk })).collect();
        Schedule { microbatches, ranks: vec![items; self.stages], ..self.clone() }
    }
}

/// Costs of one item, in any time unit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// A forward through one chunk.
    pub f: f64,
    /// A backward through one chunk (the input-gradient part when `W` is split off).
    pub b: f64,
    /// A weight-gradient part.
    pub w: f64,
}

/// The outcome of [`simulate`].
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// For each rank, each item with its start and end time.
    pub ranks: Vec<Vec<(Item, f64, f64)>>,
    /// End of the last item.
    pub makespan: f64,
    /// Idle time over total rank time, between 0 and 1.
    pub bubble: f64,
    /// For each rank, the most micro-batches whose activations it holds at once: forward
    /// done, backward not yet (where the rank splits off weight gradients, until the weight
    /// gradient, which reads them too).
    pub peak_in_flight: Vec<usize>,
}

/// Why a schedule is invalid.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// An item appears twice or one is missing.
    #[error("rank {rank}: {message}")]
    Items {
        /// The rank.
        rank: usize,
        /// What is wrong.
        message: String,
    },
    /// No rank can make progress.
    #[error("deadlock: every rank waits ({0})")]
    Deadlock(String),
    /// Bad parameters.
    #[error("{0}")]
    Invalid(String),
}

/// Runs `schedule` with `costs`: every item starts when its rank is free and its inputs exist.
pub fn simulate(schedule: &Schedule, costs: Costs) -> Result<Timeline, ScheduleError> {
    simulate_with(schedule, |_, item| match item.work {
        Work::F => costs.f,
        Work::B => costs.b,
        Work::W => costs.w,
    })
}

/// Checks that every rank runs each of its items exactly once.
fn check_items(schedule: &Schedule) -> Result<(), ScheduleError> {
    let (m, v) = (schedule.microbatches, schedule.chunks);
    let splits_w = schedule.ranks.iter().flatten().any(|i| i.work == Work::W);
    for (rank, items) in schedule.ranks.iter().enumerate() {
        let mut seen = std::collections::HashSet::new();
        for item in items {
            if item.microbatch >= m || item.chunk >= v || !seen.insert(*item) {
                return Err(ScheduleError::Items { rank, message: format!("{item:?} is out of range or repeated") });
            }
        }
        let expected = m * v * if splits_w { 3 } else { 2 };
        if seen.len() != expected {
            return Err(ScheduleError::Items { rank, message: format!("{} items, expected {expected}", seen.len()) });
        }
    }
    Ok(())
}

/// What `item` on `rank` waits for, as (work, micro-batch, stage): a stage's forward needs
/// the previous stage's, a backward the next stage's backward and its own forward, a weight
/// gradient its backward.
fn dependencies(schedule: &Schedule, rank: usize, item: &Item) -> Vec<(Work, usize, usize)> {
    let last_stage = schedule.stages * schedule.chunks - 1;
    let stage = schedule.stage_of(rank, item.chunk);
    match item.work {
        Work::F if stage == 0 => vec![],
        Work::F => vec![(Work::F, item.microbatch, stage - 1)],
        Work::B if stage == last_stage => vec![(Work::F, item.microbatch, stage)],
        Work::B => vec![(Work::F, item.microbatch, stage), (Work::B, item.microbatch, stage + 1)],
        Work::W => vec![(Work::B, item.microbatch, stage)],
    }
}

impl Timeline {
    /// The timeline of each rank's items with their start and end times, simulated or
    /// measured: its bubble and peak in-flight micro-batches.
    pub fn of_items(ranks: Vec<Vec<(Item, f64, f64)>>, makespan: f64) -> Timeline {
        timeline(ranks, makespan)
    }
}

/// The timeline of placed items: makespan, bubble and peak in-flight micro-batches.
fn timeline(out: Vec<Vec<(Item, f64, f64)>>, makespan: f64) -> Timeline {
    let busy: f64 = out.iter().flatten().map(|(_, s, e)| e - s).sum();
    let bubble = if makespan > 0.0 { 1.0 - busy / (makespan * out.len() as f64) } else { 0.0 };
    let peak_in_flight = out
        .iter()
        .map(|items| {
            let (mut live, mut peak) = (0i64, 0i64);
            let released_by = if items.iter().any(|(item, _, _)| item.work == Work::W) { Work::W } else { Work::B };
            for (item, _, _) in items {
                match item.work {
                    Work::F => live += 1,
                    work if work == released_by => live -= 1,
                    _ => {}
                }
                peak = peak.max(live);
            }
            peak as usize
        })
        .collect();
    Timeline { ranks: out, makespan, bubble, peak_in_flight }
}

/// Whether forward `item`'s kept values can stay where its forward left them: its backward
/// is the rank's `next` item and the last to read them (no weight-gradient item of its own
/// comes later). The pipeline runtimes copy them aside only otherwise.
pub fn backward_follows(item: Item, next: Option<Item>, splits_w: bool) -> bool {
    !splits_w && item.work == Work::F && next == Some(Item { work: Work::B, ..item })
}

/// The first of `items` (a rank's, in order) that is a forward whose backward does not come
/// right after it ([`backward_follows`]): the rank runs forwards ahead and needs storage for
/// each micro-batch in flight's kept values; `None` where every backward follows its forward.
pub fn forward_ahead(items: &[Item]) -> Option<usize> {
    let splits_w = items.iter().any(|i| i.work == Work::W);
    (0..items.len()).find(|&at| items[at].work == Work::F && !backward_follows(items[at], items.get(at + 1).copied(), splits_w))
}

/// How a pipeline rank running `items` (in order) takes and frees copies of its micro-batches'
/// kept values, as both pipeline runtimes do: after each item, its chunk and the change in
/// that chunk's copies of forward values and of backward values. A forward's copy is taken
/// at its end (none when its backward comes next: [`backward_follows`]) and freed at its
/// backward's end, or, where the schedule splits off weight gradients, at the weight
/// gradient, which frees the backward's copy taken at the backward's end too.
pub fn kept_copy_changes(items: &[Item]) -> Vec<(usize, i64, i64)> {
    let splits_w = items.iter().any(|i| i.work == Work::W);
    let in_place = |at: usize| backward_follows(items[at], items.get(at + 1).copied(), splits_w);
    items
        .iter()
        .enumerate()
        .map(|(at, item)| {
            let (forward, backward) = match item.work {
                Work::F if in_place(at) => (0, 0),
                Work::F => (1, 0),
                Work::B if splits_w => (0, 1),
                Work::B if at > 0 && in_place(at - 1) => (0, 0),
                Work::B => (-1, 0),
                Work::W => (-1, -1),
            };
            (item.chunk, forward, backward)
        })
        .collect()
}

/// [`simulate`] with each item's cost from `cost(rank, item)` (stages of different weight).
pub fn simulate_with(schedule: &Schedule, cost: impl Fn(usize, &Item) -> f64) -> Result<Timeline, ScheduleError> {
    use std::collections::HashMap;
    check_items(schedule)?;
    let p = schedule.stages;
    // Finish time of (work, microbatch, stage).
    let mut done: HashMap<(Work, usize, usize), f64> = HashMap::new();
    let mut next = vec![0usize; p];
    let mut free = vec![0f64; p];
    let mut out: Vec<Vec<(Item, f64, f64)>> = vec![Vec::new(); p];
    let total: usize = schedule.ranks.iter().map(Vec::len).sum();
    let mut placed = 0;
    // Ranks to try, and ranks blocked on a missing (work, micro-batch, stage): a finished item
    // wakes only the ranks waiting for it, so the simulation is linear in the items (a scan
    // of every rank per round was quadratic in the stages).
    let mut ready_ranks: Vec<usize> = (0..p).rev().collect();
    let mut waiting: HashMap<(Work, usize, usize), Vec<usize>> = HashMap::new();
    while let Some(rank) = ready_ranks.pop() {
        while let Some(item) = schedule.ranks[rank].get(next[rank]).copied() {
            let stage = schedule.stage_of(rank, item.chunk);
            let deps = dependencies(schedule, rank, &item);
            if let Some(missing) = deps.iter().find(|d| !done.contains_key(d)) {
                waiting.entry(*missing).or_default().push(rank);
                break;
            }
            let ready = deps.iter().map(|d| done[d]).fold(0f64, f64::max);
            let cost = cost(rank, &item);
            let start = ready.max(free[rank]);
            free[rank] = start + cost;
            let key = (item.work, item.microbatch, stage);
            done.insert(key, start + cost);
            if let Some(woken) = waiting.remove(&key) {
                ready_ranks.extend(woken);
            }
            out[rank].push((item, start, start + cost));
            next[rank] += 1;
            placed += 1;
        }
    }
    if placed < total {
        return Err(deadlock(schedule, &next));
    }
    let makespan = free.iter().copied().fold(0f64, f64::max);
    Ok(timeline(out, makespan))
}

fn deadlock(schedule: &Schedule, next: &[usize]) -> ScheduleError {
    let waiting: Vec<String> = (0..schedule.stages).filter_map(|r| schedule.ranks[r].get(next[r]).map(|i| format!("rank {r} at {i:?}"))).collect();
    ScheduleError::Deadlock(waiting.join(", "))
}

/// [`simulate_with`] for pipeline ranks that share one host's cores, as the CPU backend runs
/// them (a thread per rank, one pool of worker threads): `cost(rank, item)` is an item's
/// seconds with the host to itself; while k ranks compute at once, each gets a k-th of the
/// host, slowed by `slowdown` (their contention for caches and memory, as calibrated), so a
/// rank alone in another's bubble runs at full speed. `replicas`: the ranks each pipeline
/// rank's program stands for (dp x tp), computing alongside it. After its last item a rank
/// runs its `tail` (the optimizer step) under the same sharing. The makespan includes the
/// tails.
pub fn simulate_shared(schedule: &Schedule, cost: impl Fn(usize, &Item) -> f64, tail: impl Fn(usize) -> f64, replicas: f64, slowdown: f64) -> Result<Timeline, ScheduleError> {
    use std::collections::HashMap;
    check_items(schedule)?;
    let p = schedule.stages;
    // What a rank computes now: its item (None: its tail), the work left (seconds with the
    // host to itself) and when it started.
    struct Running {
        item: Option<Item>,
        left: f64,
        start: f64,
    }
    let mut running: Vec<Option<Running>> = (0..p).map(|_| None).collect();
    let mut tail_started = vec![false; p];
    let mut done: HashMap<(Work, usize, usize), f64> = HashMap::new();
    let mut next = vec![0usize; p];
    let mut out: Vec<Vec<(Item, f64, f64)>> = vec![Vec::new(); p];
    // Seconds the ranks spent in their tails (busy, though not items of the timeline).
    let mut tails = 0.0f64;
    let mut now = 0.0f64;
    loop {
        for rank in 0..p {
            if running[rank].is_some() {
                continue;
            }
            match schedule.ranks[rank].get(next[rank]).copied() {
                Some(item) if dependencies(schedule, rank, &item).iter().all(|d| done.contains_key(d)) => {
                    running[rank] = Some(Running { item: Some(item), left: cost(rank, &item).max(0.0), start: now });
                    next[rank] += 1;
                }
                Some(_) => {}
                None if !tail_started[rank] => {
                    tail_started[rank] = true;
                    running[rank] = Some(Running { item: None, left: tail(rank).max(0.0), start: now });
                }
                None => {}
            }
        }
        let active = running.iter().flatten().count();
        if active == 0 {
            if tail_started.iter().all(|&t| t) {
                break;
            }
            return Err(deadlock(schedule, &next));
        }
        let sharing = active as f64 * replicas.max(1.0);
        let rate = if sharing > 1.0 { 1.0 / (sharing * slowdown.max(1.0)) } else { 1.0 };
        // Up to the next finish.
        let first = running.iter().flatten().map(|r| r.left).fold(f64::INFINITY, f64::min);
        if !first.is_finite() {
            return Err(ScheduleError::Invalid("an item's cost is not finite".into()));
        }
        now += first / rate;
        for rank in 0..p {
            let Some(r) = running[rank].as_mut() else { continue };
            r.left -= first;
            if r.left <= first * 1e-12 {
                match r.item {
                    Some(item) => {
                        done.insert((item.work, item.microbatch, schedule.stage_of(rank, item.chunk)), now);
                        out[rank].push((item, r.start, now));
                    }
                    None => tails += now - r.start,
                }
                running[rank] = None;
            }
        }
    }
    let mut timeline = timeline(out, now);
    // A rank in its tail is busy: the bubble is the idle time of items and tails alike.
    if now > 0.0 {
        timeline.bubble = (timeline.bubble - tails / (now * p as f64)).max(0.0);
    }
    Ok(timeline)
}
