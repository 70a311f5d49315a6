//! Pipeline-parallel training: every rank of a `dp x tp x pp` mesh runs its pipeline rank's
//! program (one thread each), walking its list of the schedule's work items.
//!
//! Per step, the global batch is cut into `m` micro-batches. A forward item runs the chunk's
//! forward section on one micro-batch and keeps the buffers its backward will read; a
//! backward item puts them back, runs the backward section (and the weight section, unless
//! the schedule defers it to a `W` item) and adds the gradients into the chunk's sums. Sends
//! and receives inside the sections move activations and their gradients between stage
//! ranks, tagged by transfer, step and micro-batch. As soon as a chunk has done its last
//! backward work of the step, the all-reduces of its summed gradients (the data-parallel sync)
//! start on the communication thread, overlapping whatever work the rank still has. After the
//! last item, each chunk's step section runs once (taking those results), then the next step
//! starts.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::RuntimeError;
use crate::collectives::{Algorithm, CollectiveKind, MeshShape};
use crate::cpu::Storage;
use crate::data::Corpus;
use crate::program::{Program, Role, Phase};
use crate::schedule::{Item, Schedule, Timeline, Work};
use crate::train::{on_every_rank_of, read_f64};

/// What a pipeline-parallel run produced.
#[derive(Debug, Clone)]
pub struct PipelineRun {
    /// Loss of each step: the mean over its micro-batches.
    pub losses: Vec<f64>,
    /// Every parameter, reassembled from the ranks that hold it: (name, global shape, values).
    pub parameters: Vec<(String, Vec<usize>, Vec<f64>)>,
    /// Bytes each rank sent, per kind of transfer.
    pub bytes_sent: Vec<BTreeMap<CollectiveKind, u64>>,
    /// The last step as it ran on the ranks of data-parallel and tensor-parallel coordinate
    /// 0, one row per pipeline rank, in milliseconds from the step's start; an item starts
    /// when its receives have returned, so its bubble is the measured idle time.
    pub timeline: Timeline,
    /// Most bytes of kept activations (forward buffers awaiting their backward) each of
    /// those pipeline ranks held at once.
    pub peak_kept_bytes: Vec<usize>,
    /// Gradient all-reduces and reduce-scatters (one per step bucket) each of those pipeline
    /// ranks started as soon as their chunk's backward work was done, in the last step
    /// (overlapping the rest of its work).
    pub early_syncs: Vec<usize>,
    /// Where the run ended: every parameter and optimizer state, global.
    pub state: crate::train::TrainState,
    /// Wall-clock seconds of each step on the slowest rank.
    pub step_seconds: Vec<f64>,
}

fn storage_bytes(values: &[Storage]) -> usize {
    values
        .iter()
        .map(|s| match s {
            Storage::F32(v) => v.len() * 4,
            Storage::F64(v) => v.len() * 8,
            Storage::I32(v) => v.len() * 4,
            Storage::Bf16(v) => v.len() * 2,
            Storage::Empty => 0,
        })
        .sum()
}

/// Trains the pipeline `programs` (one per pipeline rank, from codegen, each carrying its
/// items of the schedule) for `steps` steps. Parameters start from `seed` as global tensors, sharded per rank, and each
/// step's global batch is `m` micro-batches of the programs' batch, so the run is comparable
/// with a single device running the whole batch at once.
#[allow(clippy::too_many_arguments)]
pub fn train_pipeline(
    programs: &[Program],
    seed: u64,
    layers: usize,
    corpus: &Corpus,
    steps: u64,
    timeout: Duration,
    algorithm: Algorithm,
) -> Result<PipelineRun, RuntimeError> {
    train_pipeline_from(programs, seed, layers, corpus, steps, timeout, algorithm, None)
}

/// [`train_pipeline`] from a saved state (`None`: from the seed's initial parameters): runs
/// steps `state.step + 1 ..= state.step + steps`.
#[allow(clippy::too_many_arguments)]
pub fn train_pipeline_from(
    programs: &[Program],
    seed: u64,
    layers: usize,
    corpus: &Corpus,
    steps: u64,
    timeout: Duration,
    algorithm: Algorithm,
    start: Option<&crate::train::TrainState>,
) -> Result<PipelineRun, RuntimeError> {
    let first_step = start.map_or(0, |s| s.step);
    let first = programs.first().ok_or_else(|| RuntimeError::Program("no pipeline programs".into()))?;
    let schedule = &schedule_of(programs)?;
    if programs.len() != schedule.stages {
        return Err(RuntimeError::Program(format!("{} pipeline programs for a schedule of {} ranks", programs.len(), schedule.stages)));
    }
    for (s, program) in programs.iter().enumerate() {
        let plan = program.pipeline.as_ref().ok_or_else(|| RuntimeError::Program(format!("program {s} is not a pipeline rank")))?;
        if plan.rank != s || plan.chunks.len() != schedule.chunks {
            return Err(RuntimeError::Program(format!("program {s} is pipeline rank {} with {} chunks; the schedule wants rank {s} with {}", plan.rank, plan.chunks.len(), schedule.chunks)));
        }
    }
    let tokens = programs.iter().find_map(|p| p.arg("tokens")).ok_or_else(|| RuntimeError::Binding("no pipeline stage reads `tokens`".into()))?;
    let layout = tokens.layout.clone().ok_or_else(|| RuntimeError::Binding("`tokens` has no layout: the program is not partitioned".into()))?;
    let (rows, seq) = (layout.global_shape[0], layout.global_shape[1]);
    corpus.check_seq(seq)?;
    let m = schedule.microbatches;
    let splits_w = schedule.ranks.iter().flatten().any(|i| i.work == Work::W);

    type RankResult = (Vec<f64>, HashMap<String, Vec<f64>>, BTreeMap<CollectiveKind, u64>, Vec<(Item, f64, f64)>, usize, usize, HashMap<String, Vec<f64>>, Vec<f64>);
    let results: Vec<RankResult> = on_every_rank_of(programs, seed, layers, timeout, algorithm, start, |exec, mesh, rank| {
        let program = exec.program().clone();
        let plan = program.pipeline.clone().ok_or_else(|| RuntimeError::Program("not a pipeline rank".into()))?;
        let items = &schedule.ranks[plan.rank];
        let tokens_layout = program.arg("tokens").and_then(|b| b.layout.clone());
        let targets_layout = program.arg("targets").and_then(|b| b.layout.clone());
        // The chunk whose forward makes the loss, if this rank has it.
        let loss_chunk = program.result("loss").and_then(|loss| {
            let maker = program.instrs.iter().position(|i| i.outputs.contains(&loss.buffer))?;
            plan.chunks.iter().position(|c| c.range(Phase::Forward).contains(&maker))
        });
        // The item after which a chunk has no backward work left this step: its gradients are
        // final, and its data-parallel sync starts then, while other work goes on.
        let last_backward: Vec<Option<usize>> =
            (0..plan.chunks.len()).map(|c| items.iter().rposition(|i| i.chunk == c && i.work != Work::F)).collect();
        let step_order = program.step_order(&plan.chunks);
        let mut losses = Vec::new();
        let mut trace = Vec::new();
        let mut early_syncs = 0;
        let mut peak_kept = 0usize;
        let mut step_seconds = Vec::new();
        // Gradient sums and kept values live across steps and micro-batches: their storage is
        // reused, not allocated afresh each time.
        let mut sums: Vec<Vec<Storage>> = vec![Vec::new(); plan.chunks.len()];
        let mut sums_weight: Vec<Vec<Storage>> = vec![Vec::new(); plan.chunks.len()];
        let mut spare_forward: Vec<Vec<Storage>> = Vec::new();
        let mut spare_backward: Vec<Vec<Storage>> = Vec::new();
        for step in first_step + 1..=first_step + steps {
            let began = Instant::now();
            let (t, g) = corpus.batch(seed, step, rows * m);
            let micro = |data: &[i32], j: usize| data[j * rows * seq..(j + 1) * rows * seq].to_vec();
            if program.arg("step").is_some() {
                exec.write::<i32>("step", &[i32::try_from(step).map_err(|_| RuntimeError::Binding("step counter overflow".into()))?])?;
            }
            let mut kept_forward: HashMap<(usize, usize), Vec<Storage>> = HashMap::new();
            let mut kept_backward: HashMap<(usize, usize), Vec<Storage>> = HashMap::new();
            let mut in_place: std::collections::HashSet<(usize, usize)> = std::collections::HashSet::new();
            // Whether a chunk's sums have their first micro-batch in this step.
            let mut summing = vec![false; plan.chunks.len()];
            let mut summing_weight = vec![false; plan.chunks.len()];
            let mut loss_sum = 0.0;
            let start = Instant::now();
            trace.clear();
            early_syncs = 0;
            for (position, item) in items.iter().enumerate() {
                let (c, j) = (item.chunk, item.microbatch);
                let chunk = &plan.chunks[c];
                if let Some(l) = &tokens_layout {
                    exec.write::<i32>("tokens", &crate::layout::local_shard(&micro(&t, j), l, mesh, rank))?;
                }
                if let Some(l) = &targets_layout {
                    exec.write::<i32>("targets", &crate::layout::local_shard(&micro(&g, j), l, mesh, rank))?;
                }
                exec.set_transfer_context(step, j as u64);
                exec.take_waited();
                let began = start.elapsed().as_secs_f64() * 1e3;
                match item.work {
                    Work::F => {
                        exec.run_range(chunk.range(Phase::Forward))?;
                        // Kept values stay in place when this micro-batch's backward comes next.
                        if crate::schedule::backward_follows(*item, items.get(position + 1).copied(), splits_w) {
                            in_place.insert((c, j));
                        } else {
                            kept_forward.insert((c, j), exec.save_into(&chunk.keep_forward, spare_forward.pop().unwrap_or_default()));
                        }
                        if loss_chunk == Some(c) {
                            loss_sum += read_f64(exec, "loss")?[0];
                        }
                    }
                    Work::B => {
                        if !in_place.remove(&(c, j)) {
                            let kept = kept_forward.get(&(c, j)).ok_or_else(|| RuntimeError::Program(format!("backward of micro-batch {j} before its forward")))?;
                            exec.restore(&chunk.keep_forward, kept)?;
                        }
                        exec.run_range(chunk.range(Phase::Backward))?;
                        exec.accumulate(&chunk.sum_backward, &mut sums[c], !std::mem::replace(&mut summing[c], true))?;
                        if splits_w {
                            kept_backward.insert((c, j), exec.save_into(&chunk.keep_backward, spare_backward.pop().unwrap_or_default()));
                        } else {
                            exec.run_range(chunk.range(Phase::Weight))?;
                            exec.accumulate(&chunk.sum_weight, &mut sums_weight[c], !std::mem::replace(&mut summing_weight[c], true))?;
                            spare_forward.extend(kept_forward.remove(&(c, j)));
                        }
                    }
                    Work::W => {
                        let kept = kept_forward.remove(&(c, j)).ok_or_else(|| RuntimeError::Program(format!("weight gradient of micro-batch {j} before its forward")))?;
                        exec.restore(&chunk.keep_forward, &kept)?;
                        spare_forward.push(kept);
                        let kept = kept_backward.remove(&(c, j)).ok_or_else(|| RuntimeError::Program(format!("weight gradient of micro-batch {j} before its backward")))?;
                        exec.restore(&chunk.keep_backward, &kept)?;
                        spare_backward.push(kept);
                        exec.run_range(chunk.range(Phase::Weight))?;
                        exec.accumulate(&chunk.sum_weight, &mut sums_weight[c], !std::mem::replace(&mut summing_weight[c], true))?;
                    }
                }
                if last_backward[c] == Some(position) {
                    exec.restore(&chunk.sum_backward, &sums[c])?;
                    exec.restore(&chunk.sum_weight, &sums_weight[c])?;
                    let ready: Vec<usize> = chunk.sum_backward.iter().chain(&chunk.sum_weight).copied().collect();
                    early_syncs += exec.start_early(&chunk.early_syncs, &ready)?;
                }
                let held: usize = kept_forward.values().chain(kept_backward.values()).map(|v| storage_bytes(v)).sum();
                peak_kept = peak_kept.max(held);
                // Time blocked in receives is idle time, not work: the item starts when its
                // inputs have arrived (receives open each section).
                let waited = exec.take_waited().as_secs_f64() * 1e3;
                let ended = start.elapsed().as_secs_f64() * 1e3;
                trace.push((*item, (began + waited).min(ended), ended));
            }
            // Step sections exchange once per step: their transfers carry micro-batch 0.
            exec.set_transfer_context(step, 0);
            for (c, chunk) in plan.chunks.iter().enumerate() {
                exec.restore(&chunk.sum_backward, &sums[c])?;
                exec.restore(&chunk.sum_weight, &sums_weight[c])?;
            }
            exec.run_list(&step_order)?;
            exec.carry_state()?;
            // The rank that computes the loss stops the run at the first step that breaks it
            // (the others see it fail and stop too).
            if loss_chunk.is_some() && !loss_sum.is_finite() {
                return Err(RuntimeError::NonFiniteLoss { step, loss: loss_sum / m as f64 });
            }
            losses.push(loss_sum / m as f64);
            step_seconds.push(began.elapsed().as_secs_f64());
        }
        let params: HashMap<String, Vec<f64>> =
            program.args.iter().filter(|a| a.role == Some(Role::Param)).map(|a| Ok((a.name.clone(), read_f64(exec, &a.name)?))).collect::<Result<_, RuntimeError>>()?;
        Ok((losses, params, exec.bytes_sent()?, trace, peak_kept, early_syncs, crate::train::read_state(exec)?, step_seconds))
    })?;

    let mesh = MeshShape(if first.mesh.is_empty() { vec![1] } else { first.mesh.clone() });
    let pp_rank = |rank: usize| mesh.coords(rank).get(2).copied().unwrap_or(0);
    let front = |rank: usize| mesh.coords(rank).iter().take(2).all(|&c| c == 0);
    // The loss lives on the pipeline rank that holds the head.
    let loss_rank = (0..mesh.ranks()).find(|&r| front(r) && programs[pp_rank(r)].result("loss").is_some()).ok_or_else(|| RuntimeError::Program("no pipeline stage returns the loss".into()))?;
    let mut parameters = Vec::new();
    for (s, program) in programs.iter().enumerate() {
        // A mirrored parameter (tied embeddings) is on several pipeline ranks, equal on all.
        for p in program.args.iter().filter(|a| a.role == Some(Role::Param)) {
            if parameters.iter().any(|(n, _, _)| *n == p.name) {
                continue;
            }
            let layout = p.layout.as_ref().ok_or_else(|| RuntimeError::Binding(format!("`{}` has no layout", p.name)))?;
            let shards: Vec<(usize, Vec<f64>)> = (0..mesh.ranks()).filter(|&r| pp_rank(r) == s).map(|r| (r, results[r].1[&p.name].clone())).collect();
            let global = crate::layout::assemble_some(&shards, layout, &mesh);
            parameters.push((p.name.clone(), p.logical_shape(&layout.global_shape), p.from_program(&global, &layout.global_shape)));
        }
    }
    let rows_of_timeline: Vec<usize> = (0..schedule.stages).map(|s| (0..mesh.ranks()).find(|&r| front(r) && pp_rank(r) == s).unwrap_or(0)).collect();
    let ranks: Vec<Vec<(Item, f64, f64)>> = rows_of_timeline.iter().map(|&r| results[r].3.clone()).collect();
    let makespan = ranks.iter().flatten().map(|x| x.2).fold(0.0, f64::max);
    let values: Vec<HashMap<String, Vec<f64>>> = results.iter().map(|r| r.6.clone()).collect();
    let state = crate::train::TrainState::collect(programs, &mesh, &values, first_step + steps)?;
    Ok(PipelineRun {
        step_seconds: (0..steps as usize).map(|i| results.iter().filter_map(|r| r.7.get(i)).fold(0.0, |a: f64, &b| a.max(b))).collect(),
        state,
        losses: results[loss_rank].0.clone(),
        parameters,
        bytes_sent: results.iter().map(|r| r.2.clone()).collect(),
        peak_kept_bytes: rows_of_timeline.iter().map(|&r| results[r].4).collect(),
        early_syncs: rows_of_timeline.iter().map(|&r| results[r].5).collect(),
        timeline: Timeline::of_items(ranks, makespan),
    })
}

/// The schedule the programs carry, checked: every rank's items, one family, and a
/// simulation that finishes.
pub fn schedule_of(programs: &[Program]) -> Result<Schedule, RuntimeError> {
    let plans = programs
        .iter()
        .enumerate()
        .map(|(s, p)| p.pipeline.as_ref().ok_or_else(|| RuntimeError::Program(format!("program {s} is not a pipeline rank"))))
        .collect::<Result<Vec<_>, _>>()?;
    let first = plans.first().ok_or_else(|| RuntimeError::Program("no pipeline programs".into()))?;
    if plans.iter().any(|p| p.kind != first.kind || p.microbatches != first.microbatches || p.chunks.len() != first.chunks.len()) {
        return Err(RuntimeError::Program("the pipeline programs carry different schedules; compile them together".into()));
    }
    let schedule = Schedule {
        kind: first.kind,
        stages: plans.len(),
        microbatches: first.microbatches,
        chunks: first.chunks.len(),
        ranks: plans.iter().map(|p| p.items.clone()).collect(),
    };
    crate::schedule::simulate(&schedule, crate::schedule::Costs { f: 1.0, b: 1.0, w: 1.0 }).map_err(|e| RuntimeError::Program(format!("invalid schedule: {e}")))?;
    Ok(schedule)
}
