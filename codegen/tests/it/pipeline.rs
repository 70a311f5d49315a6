//! Pipeline-parallel training equals single-device training: tiny GPT and tiny Llama on
//! (dp, tp, pp) in {(1,1,2), (1,1,4), (2,2,2)}, under every schedule, with 4 and 8
//! micro-batches: the same loss at each of three optimizer steps, the same gradients of the
//! first step, the same parameters after the third. The single device runs the whole global
//! batch (m micro-batches' rows) in one step.

use std::time::Duration;

use shardc_ir::mesh::Mesh;
use shardc_passes::sharding::ContextAttention;
use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind, PipelineOptions};
use shardc_runtime::collectives::Algorithm;
use shardc_runtime::data::ByteCorpus;
use shardc_runtime::init::init_param;
use shardc_runtime::pipeline::{train_pipeline, PipelineRun};
use shardc_runtime::schedule::{generate, Kind};
use shardc_runtime::train::Trainer;
use shardc_runtime::Program;

use crate::common::*;

const STEPS: u64 = 3;
const TOLERANCE: f64 = 1e-5;
/// SGD, so that a step's parameter change is the gradient times the learning rate (and, as
/// in the spmd tests, AdamW would turn the key bias's rounding-noise gradient into steps).
const LR: f64 = 0.1;
const SGD: OptimizerKind = OptimizerKind::Sgd { lr: LR, weight_decay: 0.0 };
const KINDS: [Kind; 4] = [Kind::Gpipe, Kind::OneFOneB, Kind::Interleaved, Kind::ZeroBubble];

fn options(spec: &shardc_ir::spec::Spec, mesh: Mesh, pipeline: Option<PipelineOptions>) -> CompileOptions {
    CompileOptions { optimizer: SGD, mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, pipeline, context_attention: ATTENTION.with(|a| a.get()), ..Default::default() }
}

thread_local! {
    /// Context parallelism's attention in the programs this thread compiles.
    pub(crate) static ATTENTION: std::cell::Cell<ContextAttention> = const { std::cell::Cell::new(ContextAttention::Auto) };
}

fn corpus(spec: &shardc_ir::spec::Spec) -> ByteCorpus {
    ByteCorpus::new(std::fs::read(root().join("data/kjv-genesis-exodus.txt")).unwrap(), spec.seq_len() as usize, spec.model.vocab as usize).unwrap()
}

/// The pipeline programs and schedule of `name` on `mesh`.
pub fn compile_stages(name: &str, mesh: Mesh, kind: Kind, microbatches: usize) -> (Vec<Program>, shardc_ir::spec::Spec) {
    compile_stages_with(name, mesh, kind, microbatches, |_| {})
}

/// [`compile_stages`] with the compile options changed by `edit`.
pub fn compile_stages_with(name: &str, mesh: Mesh, kind: Kind, microbatches: usize, edit: impl Fn(&mut CompileOptions)) -> (Vec<Program>, shardc_ir::spec::Spec) {
    let spec = spec_with_dtype(name, "f32");
    let chunks = if kind == Kind::Interleaved { 2 } else { 1 };
    let stages = PipelineOptions { chunks, microbatches, manual: None, split_weight_grads: kind == Kind::ZeroBubble };
    let mut module = model_in_order(&spec, if mesh.cp > 1 { 2 * mesh.cp } else { 1 });
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    let mut options = options(&spec, mesh, Some(stages));
    edit(&mut options);
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{name} {mesh}: {e:?}"));
    let grid = module.grids[0].shape.clone();
    let schedule = generate(kind, mesh.pp as usize, microbatches, chunks).unwrap();
    (shardc_codegen::lower_pipeline(&module, &grid, &schedule).unwrap(), spec)
}

/// Single-device losses, first-step gradients and final parameters for `rows` rows a step.
struct Reference {
    losses: Vec<f64>,
    gradients: Vec<(String, Vec<f64>)>,
    parameters: Vec<(String, Vec<f64>)>,
}

fn reference(name: &str, rows: u64, clip_grad: f64) -> Reference {
    let mut spec = spec_with_dtype(name, "f32");
    spec.training.micro_batch = rows;
    let mut module = model(&spec);
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&CompileOptions { clip_grad, ..options(&spec, Mesh::default(), None) }).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    let program = shardc_codegen::lower_func(module.func("train_step").unwrap()).unwrap();
    let layers = spec.model.layers as usize;
    let corpus = corpus(&spec);
    let mut trainer = Trainer::new(program, SEED, layers).unwrap();
    let mut losses = vec![trainer.step(&corpus).unwrap()];
    let gradients = trainer.parameters().unwrap().into_iter().map(|(n, _, after)| {
        let before = init_param(&n, after.len(), SEED, layers);
        let g = before.iter().zip(&after).map(|(b, a)| (b - *a as f64) / LR).collect();
        (n, g)
    }).collect();
    losses.extend((1..STEPS).map(|_| trainer.step(&corpus).unwrap()));
    let parameters = trainer.parameters().unwrap().into_iter().map(|(n, _, v)| (n, v.iter().map(|&x| x as f64).collect())).collect();
    Reference { losses, gradients, parameters }
}

const SEED: u64 = 5;

/// As in the spmd tests: max |a - b| over max |a|, floored at the initialisation scale.
fn rel(a: &[f64], b: &[f64]) -> f64 {
    let scale = a.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-2);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn by_name<'a>(run: &'a PipelineRun, name: &str) -> &'a [f64] {
    &run.parameters.iter().find(|(n, _, _)| n == name).unwrap_or_else(|| panic!("no parameter {name} in the pipeline run")).2
}

fn check(name: &str) {
    let meshes = [(1, 1, 2), (1, 1, 4), (2, 2, 2)].map(|(dp, tp, pp)| Mesh { dp, tp, pp, cp: 1, ep: 1 });
    check_on(name, &meshes, &KINDS, &[4, 8]);
}

fn check_on(name: &str, meshes: &[Mesh], kinds: &[Kind], microbatches: &[usize]) {
    for &m in microbatches {
        let want = reference(name, 2 * m as u64, 1.0);
        for &mesh in meshes {
            for &kind in kinds {
                let what = format!("{name} {mesh} {} m={m}", kind.label());
                let (programs, spec) = compile_stages(name, mesh, kind, m);
                let layers = spec.model.layers as usize;
                let corpus = corpus(&spec);
                let run = |steps| train_pipeline(&programs, SEED, layers, &corpus, steps, Duration::from_secs(30), Algorithm::Ring).unwrap_or_else(|e| panic!("{what}: {e}"));
                let first = run(1);
                assert_eq!(first.parameters.len(), want.gradients.len(), "{what}: every parameter is on one stage");
                for (param, g) in &want.gradients {
                    let before = init_param(param, g.len(), SEED, layers);
                    let got: Vec<f64> = before.iter().zip(by_name(&first, param)).map(|(b, a)| (b - a) / LR).collect();
                    let err = rel(g, &got);
                    assert!(err <= TOLERANCE, "{what}: gradient of {param} differs by {err:e}");
                }
                let full = run(STEPS);
                for (step, (a, b)) in want.losses.iter().zip(&full.losses).enumerate() {
                    assert!((a - b).abs() <= TOLERANCE * a.abs(), "{what} step {}: loss {a} vs {b}", step + 1);
                }
                for (param, a) in &want.parameters {
                    let err = rel(a, by_name(&full, param));
                    assert!(err <= TOLERANCE, "{what}: parameter {param} differs by {err:e} after {STEPS} steps");
                }
            }
        }
    }
}

#[test]
fn tiny_gpt_pipelined_equals_single_device() {
    check("tiny");
}

#[test]
fn tiny_llama_pipelined_equals_single_device() {
    check("tiny-llama");
}

/// Context parallelism composes with pipeline stages (issue 20): cp=2 x pp=2, and with data
/// and tensor parallelism too, equal one device.
#[test]
fn context_parallel_pipelines_equal_single_device() {
    let meshes = [Mesh { dp: 1, tp: 1, pp: 2, cp: 2, ep: 1 }, Mesh { dp: 2, tp: 2, pp: 2, cp: 2, ep: 1 }];
    for name in ["tiny", "tiny-llama"] {
        check_on(name, &meshes[..1], &[Kind::OneFOneB, Kind::Interleaved, Kind::ZeroBubble], &[4]);
        check_on(name, &meshes[1..], &[Kind::OneFOneB], &[4]);
    }
    // Ring attention inside pipeline stages.
    ATTENTION.with(|a| a.set(ContextAttention::Ring));
    let (programs, _) = compile_stages("tiny-llama", meshes[0], Kind::OneFOneB, 4);
    assert!(programs.iter().any(|p| p.instrs.iter().any(|i| i.op == "shard.shift")), "the stages ring");
    check_on("tiny-llama", &meshes, &[Kind::OneFOneB, Kind::ZeroBubble], &[4]);
    ATTENTION.with(|a| a.set(ContextAttention::Auto));
}

/// What the runtime measured agrees with the schedule: 1F1B keeps at most `p - s`
/// micro-batches of activations on stage `s`, GPipe all `m`.
#[test]
fn kept_activations_follow_the_schedule() {
    for (kind, first_stage) in [(Kind::OneFOneB, 4), (Kind::Gpipe, 8)] {
        let (programs, spec) = compile_stages("tiny", Mesh { dp: 1, tp: 1, pp: 4, cp: 1, ep: 1 }, kind, 8);
        let run = train_pipeline(&programs, SEED, spec.model.layers as usize, &corpus(&spec), 1, Duration::from_secs(30), Algorithm::Ring).unwrap();
        assert_eq!(run.timeline.peak_in_flight[0], first_stage, "{}", kind.label());
        // Bytes kept grow with the micro-batches held (rank 1 holds a layer; rank 0 may hold
        // just the embedding, which keeps nothing).
        assert!(run.peak_kept_bytes[1] > 0);
    }
    let bytes = |kind| {
        let (programs, spec) = compile_stages("tiny", Mesh { dp: 1, tp: 1, pp: 4, cp: 1, ep: 1 }, kind, 8);
        train_pipeline(&programs, SEED, spec.model.layers as usize, &corpus(&spec), 1, Duration::from_secs(30), Algorithm::Ring).unwrap().peak_kept_bytes[1]
    };
    assert!(bytes(Kind::OneFOneB) < bytes(Kind::Gpipe));
}

/// A pipeline rank keeps each micro-batch in flight's values in a set of storage of its own,
/// outside the arena, which its forward writes and its backward reads: 1F1B's first stage of
/// p holds p micro-batches' values, as Megatron-LM's does, not p copies beside the running
/// one's in the arena. The last stage, whose every backward comes right after its forward,
/// keeps them in the arena (which frees them as the backward reads them for last), and a
/// plan that leaves them there under a schedule that runs forwards ahead is refused.
#[test]
fn kept_values_take_a_set_per_micro_batch_in_flight_outside_the_arena() {
    use shardc_runtime::program::KeptKind;
    let (programs, _) = compile_stages("tiny", Mesh { dp: 1, tp: 1, pp: 2, cp: 1, ep: 1 }, Kind::OneFOneB, 4);
    let kept = |p: &Program| p.pipeline.as_ref().unwrap().chunks.iter().flat_map(|c| c.keep_forward.clone()).collect::<Vec<_>>();
    assert!(!kept(&programs[0]).is_empty() && kept(&programs[0]).iter().all(|&b| programs[0].arena_range(b).is_none()), "the first stage keeps its values outside the arena");
    assert!(kept(&programs[1]).iter().all(|&b| programs[1].arena_range(b).is_some()), "the last stage keeps them in the arena");
    let set = programs[0].pipeline.as_ref().unwrap().chunks[0].kept_set(&programs[0], KeptKind::Forward).1;
    let estimates = shardc_codegen::estimate::memory(&programs, 0);
    assert_eq!(estimates[0].activations, 2.0 * set as f64, "two micro-batches in flight on the first of two stages: two sets");
    // The arena holds no kept value: all of it is temporaries.
    assert_eq!(estimates[0].temporaries, programs[0].memory.arena_bytes as f64);
    // The last stage's plan run by the first stage's schedule would overwrite its values.
    let mut forwards_ahead = programs[1].clone();
    forwards_ahead.pipeline.as_mut().unwrap().items = programs[0].pipeline.as_ref().unwrap().items.iter().map(|i| shardc_runtime::schedule::Item { chunk: 0, ..*i }).collect();
    let error = forwards_ahead.validate().unwrap_err().to_string();
    assert!(error.contains("is kept in the arena, but item 0's forward is not followed by its backward"), "{error}");
    // A kept buffer out of range, or an argument (which the runtime would send to a
    // micro-batch's storage), is refused, not run.
    for (bad, says) in [(99_999, "names a buffer or instruction out of range"), (programs[0].args[0].buffer, "keeps argument buffer")] {
        let mut edited = programs[0].clone();
        edited.pipeline.as_mut().unwrap().chunks[0].keep_forward.push(bad);
        let error = edited.validate().unwrap_err().to_string();
        assert!(error.contains(says), "{error}");
    }
    // Interleaved, a rank's chunks share sets of one size: it holds no more than the sets
    // each chunk would hold apart.
    let (interleaved, _) = compile_stages("tiny", Mesh { dp: 1, tp: 1, pp: 2, cp: 1, ep: 1 }, Kind::Interleaved, 4);
    for p in &interleaved {
        let plan = p.pipeline.as_ref().unwrap();
        let apart: usize = (0..plan.chunks.len())
            .map(|c| {
                let mine: Vec<_> = plan.items.iter().copied().filter(|i| i.chunk == c).collect();
                let mut one = p.clone();
                one.pipeline.as_mut().unwrap().items = mine.clone();
                shardc_runtime::program::KeptPool::of_schedule(&one, &mine)
            })
            .sum();
        let pooled = shardc_runtime::program::KeptPool::of_schedule(p, &plan.items);
        assert!(pooled > 0 && pooled <= apart, "rank {}: {pooled} pooled against {apart} apart", plan.rank);
    }
}

/// Codegen refuses a schedule that does not fit the stages, and one that deadlocks.
#[test]
fn schedules_are_checked_before_they_are_attached() {
    let spec = spec_with_dtype("tiny", "f32");
    let stages = |split_weight_grads| {
        let pipeline = PipelineOptions { chunks: 1, microbatches: 4, manual: None, split_weight_grads };
        let mut module = model(&spec);
        let cx = shardc_ir::mlir::IrContext::new().unwrap();
        compile_pipeline(&options(&spec, Mesh { dp: 1, tp: 1, pp: 2, cp: 1, ep: 1 }, Some(pipeline))).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
        module
    };
    let grid = [1, 1, 2];
    let plain = stages(false);
    let error = |module: &shardc_ir::Module, schedule: &shardc_runtime::schedule::Schedule| shardc_codegen::lower_pipeline(module, &grid, schedule).unwrap_err().to_string();
    assert!(error(&plain, &generate(Kind::OneFOneB, 4, 4, 1).unwrap()).contains("for 4 ranks x 1 chunks; the stages need 2 x 1"));
    assert!(error(&plain, &generate(Kind::ZeroBubble, 2, 4, 1).unwrap()).contains("has weight-gradient items but the stages have no weight sections"));
    let mut backwards_first = generate(Kind::Gpipe, 2, 4, 1).unwrap();
    backwards_first.ranks[1].reverse();
    assert!(error(&plain, &backwards_first).contains("invalid GPipe schedule"));
    // Each rank program carries its own items.
    let programs = shardc_codegen::lower_pipeline(&stages(true), &grid, &generate(Kind::ZeroBubble, 2, 4, 1).unwrap()).unwrap();
    assert_eq!(programs[1].pipeline.as_ref().unwrap().items.len(), 12);
}

/// With data parallelism, each chunk's gradient all-reduces start as soon as its backward
/// work is done (the comm thread runs them while the rank computes on): every dp gradient
/// sync of the step section starts early.
#[test]
fn data_parallel_syncs_start_when_a_chunk_is_done() {
    for kind in [Kind::OneFOneB, Kind::Interleaved, Kind::ZeroBubble] {
        let (programs, spec) = compile_stages("tiny", Mesh { dp: 2, tp: 1, pp: 2, cp: 1, ep: 1 }, kind, 4);
        let run = train_pipeline(&programs, SEED, spec.model.layers as usize, &corpus(&spec), 1, Duration::from_secs(30), Algorithm::Ring).unwrap();
        for (rank, program) in programs.iter().enumerate() {
            let plan = program.pipeline.as_ref().unwrap();
            let syncs = plan
                .chunks
                .iter()
                .flat_map(|c| program.instrs[c.range(shardc_runtime::program::Phase::Step)].iter().map(move |i| (c, i)))
                // Syncs of a summed gradient (not of one computed in the step, such as the
                // tied embedding's two contributions added together).
                .filter(|(c, i)| i.op == "shard.all_reduce" && i.ints("grid_axes").unwrap() == vec![0] && c.sum_backward.iter().chain(&c.sum_weight).any(|b| *b == i.inputs[0]))
                .count();
            assert!(syncs > 0, "{}: rank {rank} has dp syncs", kind.label());
            let early: usize = plan.chunks.iter().map(|c| c.early_syncs.len()).sum();
            assert!(early > 0 && early <= syncs, "{}: rank {rank}: {early} of {syncs} syncs may start early", kind.label());
            // Every early sync travels in a step bucket (the tiny model's fit in one per
            // chunk and element type): one collective per bucket.
            let regions = &program.memory.buckets;
            let bucketed: usize = regions.iter().map(|r| r.members.len()).sum();
            assert_eq!(bucketed, early, "{}: rank {rank}: every early sync is in a bucket", kind.label());
            assert_eq!(regions.len(), plan.chunks.len(), "{}: rank {rank}: one bucket per chunk", kind.label());
            assert_eq!(run.early_syncs[rank], regions.len(), "{}: rank {rank}: one collective per bucket", kind.label());
        }
    }
}

/// Without buckets (`grad_bucket_bytes` 0) each early sync is a collective of its own, and
/// buckets of a few bytes hold one gradient each; the trained parameters are the same. So
/// under ZeRO-1, whose buckets reduce-scatter the gradients into their shards, and with
/// tensor and sequence parallelism in gradient accumulation, whose step section interleaves
/// the buckets' members with other collectives (the CPU backend once landed a whole bucket at
/// its first member, over values the instructions before the others still used).
#[test]
fn step_buckets_change_the_collectives_not_the_result() {
    const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, epsilon: 1e-3, weight_decay: 0.1 };
    let stages = Mesh { dp: 2, tp: 1, pp: 2, cp: 1, ep: 1 };
    for zero in [0u8, 1] {
        step_buckets_change_the_collectives_not_the_result_with(stages, false, zero, if zero > 0 { ADAMW } else { SGD });
    }
    step_buckets_change_the_collectives_not_the_result_with(Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, true, 1, ADAMW);
}

fn step_buckets_change_the_collectives_not_the_result_with(mesh: Mesh, sequence_parallel: bool, zero: u8, optimizer: OptimizerKind) {
    let run = |bytes: u64| {
        let (programs, spec) = compile_stages_with("tiny", mesh, Kind::OneFOneB, 4, |o| {
            o.grad_bucket_bytes = bytes;
            o.zero = zero;
            o.optimizer = optimizer;
            o.sequence_parallel = sequence_parallel;
        });
        let run = train_pipeline(&programs, SEED, spec.model.layers as usize, &corpus(&spec), 2, Duration::from_secs(30), Algorithm::Ring).unwrap();
        (programs, run)
    };
    let (whole, bucketed) = run(25 << 20);
    let (none, unbucketed) = run(0);
    let (single, one_each) = run(1);
    for rank in 0..none.len() {
        let early: usize = none[rank].pipeline.as_ref().unwrap().chunks.iter().map(|c| c.early_syncs.len()).sum();
        // Of those, the sums over dp alone go in buckets (sequence parallelism's sums over tp
        // start on their own).
        let over_dp = |i: &usize| none[rank].instrs[*i].ints("grid_axes").is_ok_and(|a| a == [shardc_ir::mesh::DP_AXIS as i64]);
        let bucketable = none[rank].pipeline.as_ref().unwrap().chunks.iter().flat_map(|c| &c.early_syncs).filter(|i| over_dp(i)).count();
        assert!(none[rank].memory.buckets.is_empty());
        assert_eq!(unbucketed.early_syncs[rank], early, "rank {rank}: one collective per gradient without buckets");
        assert_eq!(single[rank].memory.buckets.len(), bucketable, "rank {rank}: buckets of one byte hold one gradient each");
        assert_eq!(one_each.early_syncs[rank], early);
        assert!(bucketed.early_syncs[rank] < early, "rank {rank}: {} collectives for {early} gradients", bucketed.early_syncs[rank]);
        // The regions are laid out: each member's output inside its region, and no other
        // temporary shares a region's storage (validated).
        whole[rank].validate().unwrap();
        let scatters = (0..whole[rank].memory.buckets.len()).filter(|&k| whole[rank].step_bucket_scatters(k)).count();
        assert!(if zero > 0 { scatters > 0 } else { scatters == 0 }, "rank {rank} ZeRO-{zero}: {scatters} buckets reduce-scatter");
        // ZeRO's gathers of the updated shards go out in asynchronous buckets too, waited
        // for at the end of the step section.
        let gathers = |p: &Program| p.instrs.iter().filter(|i| i.op == "shard.all_gather" && i.bool("xf.async") == Ok(true) && i.ints("grid_axes").is_ok_and(|a| a == [shardc_ir::mesh::DP_AXIS as i64])).count();
        assert!(if zero > 0 { gathers(&whole[rank]) > 0 } else { gathers(&whole[rank]) == 0 }, "rank {rank} ZeRO-{zero}: {} asynchronous gathers", gathers(&whole[rank]));
        assert_eq!(gathers(&none[rank]), 0, "rank {rank}: no buckets, no asynchronous gathers");
    }
    assert_eq!(bucketed.losses, unbucketed.losses);
    assert_eq!(bucketed.parameters, unbucketed.parameters);
    assert_eq!(one_each.parameters, unbucketed.parameters);
}

/// The estimate prices step buckets as a GPU sends them, inside the chunk's last backward
/// work as their layers finish: with one gradient a bucket at dp=2 over 4 micro-batches (one
/// pipeline rank), less of their time is exposed than they take, and the last of them is.
/// On a cluster of shared host cores (the CPU backend, which sends them at the work's end)
/// all of it is, and more where they queue behind each other.
///
/// Under ZeRO-1 the buckets are reduce-scatters, priced as such, and overlap the same way.
#[test]
fn step_buckets_overlap_the_last_backward_in_the_estimate() {
    use shardc_codegen::estimate::{estimate, ModelShape};
    const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, epsilon: 1e-3, weight_decay: 0.1 };
    let shape = ModelShape { parameters: 15_040.0, layers: 2.0, hidden: 16.0, seq: 8.0, tokens_per_step: 64.0 };
    let mut priced = Vec::new();
    for zero in [0u8, 1] {
        let (programs, _) = compile_stages_with("tiny", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, Kind::OneFOneB, 4, |o| {
            o.grad_bucket_bytes = 1;
            o.zero = zero;
            o.optimizer = if zero > 0 { ADAMW } else { SGD };
        });
        assert!(programs[0].memory.buckets.len() > 4, "ZeRO-{zero}: one bucket a gradient");
        let collective = if zero > 0 { "reduce_scatter dp (bucketed)" } else { "all_reduce dp (bucketed)" };
        let dp = |cluster: &shardc_ir::cluster::Cluster| {
            let e = estimate(&programs, cluster, shape);
            (e.exposed_communication.get("dp").copied().unwrap_or(0.0), e.breakdown.get(collective).copied().unwrap_or(0.0))
        };
        // Exposed dp time also counts the step section's other dp collectives (ZeRO's
        // gathers of the updated shards): the buckets' part is what the GPU hides against
        // the CPU backend, which sends them at the work's end and exposes all of it, and more
        // where they queue behind each other.
        let gpu = shardc_ir::cluster::Cluster::default();
        let (exposed_gpu, total) = dp(&gpu);
        priced.push(total);
        let cpu = shardc_ir::cluster::Cluster { shared_host: true, ..gpu };
        let (exposed_cpu, total_cpu) = dp(&cpu);
        let others = exposed_cpu - total_cpu;
        assert!(total > 0.0 && others >= 0.0, "ZeRO-{zero}: the CPU backend sends them at the end: exposed {exposed_cpu} of {total_cpu}");
        let hidden = total - (exposed_gpu - others);
        assert!(exposed_gpu > others && hidden > 0.1 * total, "ZeRO-{zero}: exposed {exposed_gpu} on a GPU, {exposed_cpu} on the CPU, for buckets of {total}");
    }
    // A reduce-scatter moves half an all-reduce's bytes (ring: (n-1)/n of the input against
    // 2(n-1)/n); the ZeRO buckets are the same gradients, less the unsharded ones.
    assert!(priced[1] < priced[0], "reduce-scatters {} s against all-reduces {} s", priced[1], priced[0]);
}

/// The step-time estimate over compiled programs: compute, the pipeline's sends, and the
/// bubble of the schedule the programs carry, simulated with the stages' own costs.
#[test]
fn estimates_price_programs_and_their_schedule() {
    use shardc_codegen::estimate::{estimate, ModelShape};
    let cluster = shardc_ir::cluster::Cluster::default();
    let shape = |m: f64| ModelShape { parameters: 15_040.0, layers: 2.0, hidden: 16.0, seq: 8.0, tokens_per_step: m * 16.0 };
    let (gpipe, _) = compile_stages("tiny", Mesh { dp: 1, tp: 1, pp: 4, cp: 1, ep: 1 }, Kind::Gpipe, 8);
    let (one, _) = compile_stages("tiny", Mesh { dp: 1, tp: 1, pp: 4, cp: 1, ep: 1 }, Kind::OneFOneB, 8);
    let e = estimate(&gpipe, &cluster, shape(8.0));
    assert!(e.step_seconds > 0.0 && e.bubble_seconds > 0.0 && e.compute_seconds > 0.0, "{e:?}");
    assert!(e.exposed_communication.contains_key("pp"), "pipeline sends are priced: {e:?}");
    assert!(e.mfu > 0.0 && e.mfu < 1.0 && e.tokens_per_second > 0.0);
    // The step covers the busiest rank's work and the bubble the schedule leaves.
    let f = estimate(&one, &cluster, shape(8.0));
    for e in [&e, &f] {
        assert!(e.step_seconds >= e.compute_seconds, "{e:?}");
        assert!(e.bubble_seconds < e.step_seconds, "{e:?}");
    }
}

/// Gradient accumulation without pipeline stages (pp = 1, m > 1) on tied embeddings: the
/// embedding's gradient is the lookup's part plus the LM head's, added in place in the step
/// section, so its data-parallel all-reduce must not start before that add (it once did,
/// and the lookup's part was lost). Tied GPT and tied Llama at dp=2 and dp=2,tp=2 with 2 and
/// 3 micro-batches equal one device: with SGD, losses, first-step gradients and parameters;
/// with AdamW and ZeRO-1, losses and parameters.
#[test]
fn tied_embeddings_accumulate_over_micro_batches_with_data_parallelism() {
    const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, epsilon: 1e-3, weight_decay: 0.1 };
    let tied = |name: &str| {
        let mut spec = spec_with_dtype(name, "f32");
        spec.model.tied_embeddings = true;
        spec
    };
    let compile = |spec: &shardc_ir::spec::Spec, mesh: Mesh, optimizer: OptimizerKind, zero: u8, pipeline: Option<PipelineOptions>| {
        let mut module = model(spec);
        let cx = shardc_ir::mlir::IrContext::new().unwrap();
        let options = CompileOptions { optimizer, zero, ..options(spec, mesh, pipeline) };
        compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{} {mesh}: {e:?}", spec.name));
        module
    };
    for name in ["tiny", "tiny-llama"] {
        for m in [2usize, 3] {
            for (zero, optimizer) in [(0u8, SGD), (1, ADAMW)] {
                // One device: all m micro-batches' rows in one step.
                let mut one = tied(name);
                one.training.micro_batch *= m as u64;
                let layers = one.model.layers as usize;
                let corpus = corpus(&one);
                let single = shardc_codegen::lower_func(compile(&one, Mesh::default(), optimizer, 0, None).func("train_step").unwrap()).unwrap();
                let mut trainer = Trainer::new(single, SEED, layers).unwrap();
                let first_losses = trainer.step(&corpus).unwrap();
                let after_one = trainer.parameters().unwrap();
                let mut losses = vec![first_losses];
                losses.extend((1..STEPS).map(|_| trainer.step(&corpus).unwrap()));
                let want = trainer.parameters().unwrap();
                for (dp, tp) in [(2, 1), (2, 2)] {
                    let what = format!("tied {name} dp={dp} tp={tp} m={m} zero={zero}");
                    let spec = tied(name);
                    let mesh = Mesh { dp, tp, pp: 1, cp: 1, ep: 1 };
                    let stages = PipelineOptions { chunks: 1, microbatches: m, manual: None, split_weight_grads: false };
                    let module = compile(&spec, mesh, optimizer, zero, Some(stages));
                    let programs = shardc_codegen::lower_pipeline(&module, &module.grids[0].shape, &generate(Kind::OneFOneB, 1, m, 1).unwrap()).unwrap();
                    let run = |steps| train_pipeline(&programs, SEED, layers, &corpus, steps, Duration::from_secs(30), Algorithm::Ring).unwrap_or_else(|e| panic!("{what}: {e}"));
                    if zero == 0 {
                        let first = run(1);
                        for (param, _, after) in &after_one {
                            let before = init_param(param, after.len(), SEED, layers);
                            let g: Vec<f64> = before.iter().zip(after).map(|(b, a)| (b - *a as f64) / LR).collect();
                            let got: Vec<f64> = before.iter().zip(by_name(&first, param)).map(|(b, a)| (b - a) / LR).collect();
                            let err = rel(&g, &got);
                            assert!(err <= TOLERANCE, "{what}: gradient of {param} differs by {err:e}");
                        }
                    }
                    let full = run(STEPS);
                    for (step, (a, b)) in losses.iter().zip(&full.losses).enumerate() {
                        assert!((a - b).abs() <= TOLERANCE * a.abs(), "{what} step {}: loss {a} vs {b}", step + 1);
                    }
                    for (param, _, a) in &want {
                        let a: Vec<f64> = a.iter().map(|&x| x as f64).collect();
                        let err = rel(&a, by_name(&full, param));
                        assert!(err <= TOLERANCE, "{what}: parameter {param} differs by {err:e} after {STEPS} steps");
                    }
                }
            }
        }
    }
}

/// The early-start invariant is checked on every program: adding to a chunk's early syncs
/// an all-reduce whose input the step section writes first (the tied embedding's in-place
/// sum) makes the program invalid, with a message that names both instructions.
#[test]
fn an_early_sync_of_a_value_still_being_written_is_refused() {
    let mut spec = spec_with_dtype("tiny", "f32");
    spec.training.micro_batch = 2;
    let pipeline = PipelineOptions { chunks: 1, microbatches: 2, manual: None, split_weight_grads: false };
    let mut module = model(&spec);
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options(&spec, Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, Some(pipeline))).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    let programs = shardc_codegen::lower_pipeline(&module, &module.grids[0].shape, &generate(Kind::OneFOneB, 1, 2, 1).unwrap()).unwrap();
    let program = &programs[0];
    program.validate().unwrap();
    let chunk = &program.pipeline.as_ref().unwrap().chunks[0];
    let step = chunk.range(shardc_runtime::program::Phase::Step);
    // The all-reduce of the tied embedding's gradient: codegen left it out of the early syncs.
    let late: Vec<usize> = step
        .filter(|&i| {
            let instr = &program.instrs[i];
            instr.op == "shard.all_reduce" && !chunk.early_syncs.contains(&i) && chunk.sum_backward.iter().chain(&chunk.sum_weight).any(|b| *b == instr.inputs[0])
        })
        .collect();
    assert!(!late.is_empty(), "the tied embedding's sync waits for the in-place sum");
    for index in late {
        let mut mutated = program.clone();
        mutated.pipeline.as_mut().unwrap().chunks[0].early_syncs.push(index);
        let error = mutated.validate().unwrap_err().to_string();
        assert!(error.contains("before instruction") && error.contains("writes it"), "{error}");
    }
}

/// ZeRO shards optimizer state under gradient accumulation and pipeline stages too: the
/// slice of a parameter that its update reads is the same for every micro-batch, so the step
/// reads it once (it was summed over the micro-batches, doubling the parameter). ZeRO 1 and
/// 3 with AdamW at dp=2 (pp=1 and pp=2, 2 micro-batches) give ZeRO 0's losses and parameters.
#[test]
fn zero_under_gradient_accumulation_equals_plain_data_parallelism() {
    const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, epsilon: 1e-3, weight_decay: 0.1 };
    let spec = spec_with_dtype("tiny-llama", "f32");
    let layers = spec.model.layers as usize;
    let corpus = corpus(&spec);
    for pp in [1u64, 2] {
        let run = |zero: u8| {
            let mesh = Mesh { dp: 2, tp: 1, pp, cp: 1, ep: 1 };
            let stages = PipelineOptions { chunks: 1, microbatches: 2, manual: None, split_weight_grads: false };
            let mut module = model(&spec);
            let cx = shardc_ir::mlir::IrContext::new().unwrap();
            compile_pipeline(&CompileOptions { optimizer: ADAMW, zero, ..options(&spec, mesh, Some(stages)) }).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
            let programs = shardc_codegen::lower_pipeline(&module, &module.grids[0].shape, &generate(Kind::OneFOneB, pp as usize, 2, 1).unwrap()).unwrap();
            train_pipeline(&programs, SEED, layers, &corpus, STEPS, Duration::from_secs(30), Algorithm::Ring).unwrap()
        };
        let plain = run(0);
        for zero in [1, 3] {
            let sharded = run(zero);
            for (a, b) in plain.losses.iter().zip(&sharded.losses) {
                assert!((a - b).abs() <= TOLERANCE * a.abs(), "pp={pp} zero={zero}: loss {a} vs {b}");
            }
            for (name, _, a) in &plain.parameters {
                let err = rel(a, by_name(&sharded, name));
                assert!(err <= TOLERANCE, "pp={pp} zero={zero}: parameter {name} differs by {err:e}");
            }
        }
    }
}

/// A pipeline rank's asynchronous collectives are ZeRO's gathers of updated shards inside one
/// chunk's step section; a plan edited otherwise is refused by name: an asynchronous
/// reduce-scatter, a gather waited for in another chunk's step section or before its bucket
/// goes out in the merged step order, sections past the instructions.
#[test]
fn step_gathers_outside_their_step_section_are_refused() {
    use shardc_runtime::program::{Attr, Phase};
    const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, epsilon: 1e-3, weight_decay: 0.1 };
    let (programs, _) = compile_stages_with("tiny", Mesh { dp: 2, tp: 1, pp: 2, cp: 1, ep: 1 }, Kind::Interleaved, 4, |o| {
        o.zero = 1;
        o.optimizer = ADAMW;
    });
    let program = &programs[0];
    program.validate().unwrap();
    let plan = program.pipeline.as_ref().unwrap();
    assert_eq!(plan.chunks.len(), 2);
    let in_chunk = |c: usize, op: &str| plan.chunks[c].range(Phase::Step).find(|&i| program.instrs[i].op == op && program.instrs[i].bool("xf.async") == Ok(true)).unwrap();
    // A reduce-scatter of the step section outside the step buckets (the tied embedding's,
    // summed in the step section) made asynchronous.
    let mut p = program.clone();
    let scatter = (0..p.instrs.len()).find(|&i| p.instrs[i].op == "shard.reduce_scatter" && p.instrs[i].int("xf.step_bucket").is_err()).unwrap();
    for (key, value) in [("xf.async", Attr::Bool(true)), ("xf.bucket", Attr::Int(999)), ("xf.bucket_members", Attr::Int(1))] {
        p.instrs[scatter].attrs.insert(key.into(), value);
    }
    let e = p.validate().unwrap_err().to_string();
    assert!(e.contains("asynchronous `shard.reduce_scatter`"), "{e}");
    // Chunk 1's wait made a wait of chunk 0's bucket.
    let mut p = program.clone();
    let bucket = p.instrs[in_chunk(0, "shard.all_gather")].int("xf.bucket").unwrap();
    let wait = plan.chunks[1].range(Phase::Step).find(|&i| p.instrs[i].op == "xf.wait").unwrap();
    p.instrs[wait].attrs.insert("xf.bucket".into(), Attr::Int(bucket));
    let e = p.validate().unwrap_err().to_string();
    assert!(e.contains("outside the step section") && e.contains(&format!("bucket {bucket}")), "{e}");
    // A wait run before its bucket's last member in the step order (`xf.order`), though
    // after it in the program.
    let mut p = program.clone();
    let wait = plan.chunks[0].range(Phase::Step).find(|&i| p.instrs[i].op == "xf.wait").unwrap();
    p.instrs[wait].attrs.insert("xf.order".into(), Attr::Int(0));
    let e = p.validate().unwrap_err().to_string();
    assert!(e.contains("before its last member is issued in the step order"), "{e}");
    // A step section past the instructions: an error, not a panic.
    let mut p = program.clone();
    p.pipeline.as_mut().unwrap().chunks[1].sections[Phase::Step as usize].1 = p.instrs.len() + 5;
    assert!(p.validate().is_err());
}

/// Under an interleaved schedule a rank's chunks finish their backward work at different
/// times, and the CUDA backend sends each chunk's step buckets then: the buckets of the chunk
/// that finishes first are on the wire while the other chunk still works, and those of the
/// last, sent as its layers finish, mostly overlap what is left of its work. The bucket
/// of the gradients made last goes out as the schedule ends and the step's updates wait
/// for it: some of it is exposed, never most. (The estimate once priced each chunk's
/// buckets from the end of its own work, as if the step section began there: 3.4e-5 s
/// exposed here where 1.2e-5 s is.) The same under ZB-H1, whose last backward work is a
/// weight pass.
#[test]
fn step_buckets_of_a_chunk_that_finishes_first_are_hidden_by_the_rest_of_the_schedule() {
    use shardc_codegen::estimate::{estimate, ModelShape};
    let shape = ModelShape { parameters: 15_040.0, layers: 2.0, hidden: 16.0, seq: 8.0, tokens_per_step: 64.0 };
    for kind in [Kind::Interleaved, Kind::ZeroBubble] {
        let (programs, _) = compile_stages_with("tiny", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, kind, 4, |o| {
            o.grad_bucket_bytes = 1;
            o.optimizer = SGD;
        });
        let cluster = shardc_ir::cluster::Cluster::default();
        let program = &programs[0];
        let plan = program.pipeline.as_ref().unwrap();
        // The chunk whose last backward work comes last, and what each chunk's buckets take on
        // the wire.
        let schedule = shardc_runtime::pipeline::schedule_of(&programs).unwrap();
        let last = schedule.ranks[0].iter().rev().find(|i| i.work != shardc_runtime::schedule::Work::F).unwrap().chunk;
        let grid: Vec<i64> = program.mesh.iter().map(|&e| e as i64).collect();
        let seconds = |cluster: &shardc_ir::cluster::Cluster, chunk: usize| -> f64 {
            let early = &plan.chunks[chunk].early_syncs;
            program
                .memory
                .buckets
                .iter()
                .filter(|r| r.members.iter().all(|m| early.contains(m)))
                .map(|r| {
                    let axes: Vec<usize> = program.instrs[r.members[0]].ints("grid_axes").unwrap().iter().map(|&a| a as usize).collect();
                    cluster.time(shardc_ir::cluster::Collective::AllReduce, r.bytes as f64, &grid, &axes)
                })
                .sum()
        };
        let others = |cluster: &shardc_ir::cluster::Cluster| (0..plan.chunks.len()).filter(|&c| c != last).map(|c| seconds(cluster, c)).sum::<f64>();
        let (late, early) = (seconds(&cluster, last), others(&cluster));
        assert!(late > 0.0 && (early > 0.0) == (kind == Kind::Interleaved), "{kind:?}: buckets of {late} s and {early} s");
        let e = estimate(&programs, &cluster, shape);
        let bucketed = e.breakdown["all_reduce dp (bucketed)"];
        assert!((bucketed - late - early).abs() < 1e-12 * bucketed.max(1.0), "{kind:?}: every step bucket is priced once: {bucketed} against {late} + {early}");
        let synchronous = e.breakdown.get("all_reduce dp").copied().unwrap_or(0.0);
        let exposed = e.exposed_communication["dp"] - synchronous;
        assert!(exposed > 0.0 && exposed < 0.5 * late, "{kind:?}: {exposed} s of the step buckets exposed beyond the synchronous collectives ({synchronous} s): some of the last chunk's {late} s, not most, and none of the first's {early} s");
        if kind != Kind::Interleaved {
            continue;
        }
        // On links so slow that the buckets take far longer than the compute, both chunks'
        // buckets queue on the one dp communicator: all of them end no sooner than their sum
        // after the first goes out, so at least that sum less the whole compute is exposed.
        let slow = shardc_ir::cluster::Link { alpha: 1e-3, bandwidth: 1e3 };
        let cluster = shardc_ir::cluster::Cluster { intra_node: slow, inter_node: slow, ..cluster };
        let (late, early) = (seconds(&cluster, last), others(&cluster));
        let e = estimate(&programs, &cluster, shape);
        let synchronous = e.breakdown.get("all_reduce dp").copied().unwrap_or(0.0);
        let exposed = e.exposed_communication["dp"];
        assert!(late.min(early) > 10.0 * e.compute_seconds, "the buckets ({late} s, {early} s) dwarf the compute ({} s)", e.compute_seconds);
        assert!(exposed >= synchronous + late + early - e.compute_seconds, "exposed {exposed} s: the buckets ({late} s + {early} s) queue behind each other");
        assert!(exposed <= synchronous + late + early + 1e-9, "exposed {exposed} s: no more than every dp collective");
    }
}

/// The data-parallel communicator runs one collective at a time, in issue order, on its own
/// stream: a rank's step cannot end before everything its program sends over dp has gone,
/// however it overlaps compute. On links slow enough that communication dominates, the
/// estimate's step is at least that sum. Under ZeRO-3 with an interleaved schedule this
/// takes the stalls of later items' gathers behind the step buckets an earlier-finishing
/// chunk sent (the estimate once priced those gathers as if the communicator were free).
#[test]
fn a_step_is_no_shorter_than_its_data_parallel_communicator_is_busy() {
    use shardc_codegen::estimate::{estimate, ModelShape};
    const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, epsilon: 1e-3, weight_decay: 0.1 };
    let shape = ModelShape { parameters: 15_040.0, layers: 2.0, hidden: 16.0, seq: 8.0, tokens_per_step: 64.0 };
    let slow = shardc_ir::cluster::Link { alpha: 1e-3, bandwidth: 1e3 };
    // dp inside a node of two GPUs, on slow links; pp between nodes, as fast as ever.
    let cluster = shardc_ir::cluster::Cluster { gpus_per_node: 2, intra_node: slow, ..shardc_ir::cluster::Cluster::default() };
    for (zero, kind, pp) in [(3u8, Kind::Interleaved, 2u64), (3, Kind::OneFOneB, 2), (1, Kind::Interleaved, 2), (0, Kind::ZeroBubble, 1)] {
        let (programs, _) = compile_stages_with("tiny", Mesh { dp: 2, tp: 1, pp, cp: 1, ep: 1 }, kind, 4, |o| {
            o.grad_bucket_bytes = 1;
            o.zero = zero;
            o.optimizer = ADAMW;
        });
        let e = estimate(&programs, &cluster, shape);
        let dp: f64 = e.breakdown.iter().filter(|(k, _)| k.ends_with(" dp") || k.ends_with(" dp (bucketed)")).map(|(_, t)| t).sum();
        assert!(e.step_seconds >= dp * (1.0 - 1e-9), "ZeRO-{zero} {kind:?} pp={pp}: a step of {} s, but rank 0 sends {dp} s over dp", e.step_seconds);
    }
}
