//! Gradient clipping by the global norm and the learning-rate schedule: checked against an
//! independent computation on one device, then partitioned runs (tp, dp, ZeRO, sequence
//! parallelism, pipeline stages) against one device with clipping active.

use std::time::Duration;

use shardc_ir::mesh::Mesh;
use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind, PipelineOptions, Schedule};
use shardc_runtime::collectives::Algorithm;
use shardc_runtime::data::ByteCorpus;
use shardc_runtime::pipeline::train_pipeline;
use shardc_runtime::schedule::{generate, Kind};
use shardc_runtime::train::{train_spmd, Trainer};
use shardc_runtime::Program;

use crate::common::*;

const SEED: u64 = 7;
const ROWS: u64 = 4;
const LR: f64 = 0.1;
const SGD: OptimizerKind = OptimizerKind::Sgd { lr: LR, weight_decay: 0.0 };
/// Warmup over 2 steps, cosine decay to a tenth at step 6.
const SCHEDULE: Schedule = Schedule { warmup_steps: 2, decay_steps: 6, min_lr: LR / 10.0, cosine: true };

fn corpus(spec: &shardc_ir::spec::Spec) -> ByteCorpus {
    ByteCorpus::new(std::fs::read(root().join("data/kjv-genesis-exodus.txt")).unwrap(), spec.seq_len() as usize, spec.model.vocab as usize).unwrap()
}

fn spec(name: &str) -> shardc_ir::spec::Spec {
    let mut spec = spec_with_dtype(name, "f32");
    spec.training.micro_batch = ROWS;
    spec
}

fn options(spec: &shardc_ir::spec::Spec, mesh: Mesh, optimizer: OptimizerKind, schedule: Schedule, clip_grad: f64) -> CompileOptions {
    CompileOptions { optimizer, schedule, clip_grad, mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, ..Default::default() }
}

fn compile(spec: &shardc_ir::spec::Spec, options: &CompileOptions) -> Program {
    let mut module = model(spec);
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{}: {e:?}", options.mesh));
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_else(|| vec![1, 1, 1]);
    shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap()
}

/// Parameters after `steps` steps on one device.
fn single(spec: &shardc_ir::spec::Spec, optimizer: OptimizerKind, schedule: Schedule, clip_grad: f64, steps: u64) -> Vec<(String, Vec<f64>)> {
    single_on(spec, &corpus(spec), optimizer, schedule, clip_grad, steps)
}

fn single_on(spec: &shardc_ir::spec::Spec, corpus: &ByteCorpus, optimizer: OptimizerKind, schedule: Schedule, clip_grad: f64, steps: u64) -> Vec<(String, Vec<f64>)> {
    let program = compile(spec, &options(spec, Mesh::default(), optimizer, schedule, clip_grad));
    let mut trainer = Trainer::new(program, SEED, spec.model.layers as usize).unwrap();
    for _ in 0..steps {
        trainer.step(corpus).unwrap();
    }
    trainer.parameters().unwrap().into_iter().map(|(n, _, v)| (n, v.iter().map(|&x| x as f64).collect())).collect()
}

fn initial(spec: &shardc_ir::spec::Spec) -> Vec<(String, Vec<f64>)> {
    single(spec, SGD, Schedule::CONSTANT, 0.0, 0)
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let scale = a.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-2);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// One SGD step with lr 1 and no clipping moves each parameter by minus its gradient; the
/// clipped step moves it by minus `max_norm / (norm + 1e-6)` times that, the norm taken over
/// every parameter's gradient (computed here from the unclipped step, independently of the
/// compiled norm).
#[test]
fn a_clipped_step_scales_every_gradient_by_max_norm_over_the_global_norm() {
    let spec = spec("tiny");
    let unit = OptimizerKind::Sgd { lr: 1.0, weight_decay: 0.0 };
    let before = initial(&spec);
    let plain = single(&spec, unit, Schedule::CONSTANT, 0.0, 1);
    let gradients: Vec<Vec<f64>> = before.iter().zip(&plain).map(|((_, b), (_, a))| b.iter().zip(a).map(|(x, y)| x - y).collect()).collect();
    let norm = gradients.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
    assert!(norm > 0.1, "the test needs a gradient to clip: norm {norm}");
    for max_norm in [norm / 4.0, 2.0 * norm] {
        let clipped = single(&spec, unit, Schedule::CONSTANT, max_norm, 1);
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        for (((name, b), (_, a)), g) in before.iter().zip(&clipped).zip(&gradients) {
            let step: Vec<f64> = b.iter().zip(a).map(|(x, y)| x - y).collect();
            let want: Vec<f64> = g.iter().map(|x| coef * x).collect();
            let err = rel(&want, &step);
            assert!(err < 2e-4, "max_norm {max_norm} (norm {norm}): {name} moved by {err:e} off the clipped gradient");
        }
    }
}

/// The learning rate of iteration t, as Megatron-LM's OptimizerParamScheduler computes it
/// (with its num_steps = t): linear warmup from 0, then cosine or linear decay to min_lr.
fn megatron_lr(max_lr: f64, min_lr: f64, warmup: f64, decay: f64, cosine: bool, t: f64) -> f64 {
    if warmup > 0.0 && t <= warmup {
        return max_lr * t / warmup;
    }
    if t > decay {
        return min_lr;
    }
    let ratio = (t - warmup) / (decay - warmup);
    let coeff = if cosine { 0.5 * ((std::f64::consts::PI * ratio).cos() + 1.0) } else { 1.0 - ratio };
    min_lr + coeff * (max_lr - min_lr)
}

/// Each SGD step moves the parameters by the scheduled learning rate times the gradient:
/// the ratio of step t's move to step 1's (on the same gradient: every window of a corpus of
/// one repeated byte is the same, and a tiny learning rate barely changes the model)
/// follows the schedule.
#[test]
fn the_learning_rate_follows_warmup_and_decay() {
    for cosine in [true, false] {
        for t in 1..=8 {
            let ours = shardc_runtime::cpu::learning_rate(LR, LR / 10.0, 2, 6, cosine, t);
            let want = megatron_lr(LR, LR / 10.0, 2.0, 6.0, cosine, t as f64);
            assert!((ours - want).abs() < 1e-12, "cosine={cosine} t={t}: {ours} vs {want}");
        }
    }
    // The compiled step applies it: with a learning rate small enough that the gradient
    // barely changes over a few steps, step t moves the parameters lr(t) / lr(1) times as
    // far as step 1 (warmup: twice; then halfway down the cosine: 1.1 times).
    // f64 training (parameters are read back in f32: moves must stay well above its digits).
    let mut spec = spec_with_dtype("tiny", "f64");
    spec.training.micro_batch = ROWS;
    let tiny_lr = OptimizerKind::Sgd { lr: 1e-4, weight_decay: 0.0 };
    let schedule = Schedule { warmup_steps: 2, decay_steps: 4, min_lr: 1e-5, cosine: true };
    let same = ByteCorpus::new(vec![b'a'; 4096], spec.seq_len() as usize, spec.model.vocab as usize).unwrap();
    let mut moves = Vec::new();
    let mut previous = initial(&spec);
    for t in 1..=3u64 {
        let now = single_on(&spec, &same, tiny_lr, schedule, 0.0, t);
        let moved: f64 = previous.iter().zip(&now).map(|((_, a), (_, b))| a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f64>()).sum();
        moves.push(moved);
        previous = now;
    }
    for t in 2..=3usize {
        let want = shardc_runtime::cpu::learning_rate(1e-4, 1e-5, 2, 4, true, t as i64) / shardc_runtime::cpu::learning_rate(1e-4, 1e-5, 2, 4, true, 1);
        let got = moves[t - 1] / moves[0];
        assert!((got - want).abs() < 1e-2 * want, "step {t}: moved {got} times step 1's, the schedule says {want}");
    }
}

/// Partitioned runs clip by the same global norm as one device: tensor parallelism (whose
/// replicated norms must count once), data parallelism with ZeRO (whose gradient shards must
/// each count), sequence parallelism, and pipeline stages (whose shares travel from stage to
/// stage). A small max norm keeps clipping active at every step.
#[test]
fn partitioned_clipping_equals_single_device() {
    const STEPS: u64 = 3;
    for name in ["tiny", "tiny-llama"] {
        let spec = spec(name);
        let corpus = corpus(&spec);
        for optimizer in [SGD, OptimizerKind::adamw(1e-2)] {
            let want = single(&spec, optimizer, SCHEDULE, 0.05, STEPS);
            let unclipped = single(&spec, optimizer, SCHEDULE, 0.0, STEPS);
            assert!(want.iter().zip(&unclipped).any(|((_, a), (_, b))| rel(a, b) > 1e-3), "{name}: clipping must change the run");
            let meshes: [(Mesh, u8, bool); 6] = [
                (Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 0, false),
                (Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 0, false),
                (Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 1, false),
                (Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 3, false),
                (Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 3, false),
                (Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 0, true),
            ];
            for (mesh, zero, sequence_parallel) in meshes {
                let what = format!("{name} {mesh} ZeRO-{zero} sp={sequence_parallel} {optimizer:?}");
                let options = CompileOptions { zero, sequence_parallel, ..options(&spec, mesh, optimizer, SCHEDULE, 0.05) };
                let run = train_spmd(&compile(&spec, &options), SEED, spec.model.layers as usize, &corpus, STEPS, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{what}: {e}"));
                for (param, a) in &want {
                    let got = &run.parameters.iter().find(|(n, _, _)| n == param).unwrap_or_else(|| panic!("{what}: no {param}")).2;
                    let err = rel(a, got);
                    assert!(err < 1e-4, "{what}: {param} differs by {err:e} after {STEPS} clipped steps");
                }
            }
            // Pipeline stages with gradient accumulation, with and without data parallelism.
            for (dp, pp) in [(1, 2), (2, 2)] {
                let mesh = Mesh { dp, tp: 1, pp, cp: 1, ep: 1 };
                for kind in [Kind::OneFOneB, Kind::ZeroBubble, Kind::Interleaved] {
                    let what = format!("{name} {mesh} {} {optimizer:?}", kind.label());
                    let microbatches = 2;
                    let chunks = if kind == Kind::Interleaved { 2 } else { 1 };
                    let pipeline = PipelineOptions { chunks, microbatches, manual: None, split_weight_grads: kind == Kind::ZeroBubble };
                    let mut stage_spec = spec.clone();
                    stage_spec.training.micro_batch = ROWS / microbatches as u64;
                    let mut module = model(&stage_spec);
                    let cx = shardc_ir::mlir::IrContext::new().unwrap();
                    let options = CompileOptions { pipeline: Some(pipeline), ..options(&spec, mesh, optimizer, SCHEDULE, 0.05) };
                    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{what}: {e:?}"));
                    let schedule = generate(kind, pp as usize, microbatches, chunks).unwrap();
                    let programs = shardc_codegen::lower_pipeline(&module, &module.grids[0].shape, &schedule).unwrap();
                    let run = train_pipeline(&programs, SEED, spec.model.layers as usize, &corpus, STEPS, Duration::from_secs(60), Algorithm::Ring).unwrap_or_else(|e| panic!("{what}: {e}"));
                    for (param, a) in &want {
                        let got = &run.parameters.iter().find(|(n, _, _)| n == param).unwrap_or_else(|| panic!("{what}: no {param}")).2;
                        let err = rel(a, got);
                        assert!(err < 1e-4, "{what}: {param} differs by {err:e} after {STEPS} clipped steps");
                    }
                }
            }
        }
    }
}

/// Partitioning reduces the norm once per layout of the gradients, not once per parameter:
/// one all-reduce of one value over tp at tp=2 (the replicated norms' squares stay out of
/// it), none with data parallelism alone (gradients are whole after their sync), one over dp
/// when ZeRO-3 shards the gradients.
#[test]
fn the_norm_is_reduced_once_per_layout() {
    let spec = spec("tiny");
    let one_value_all_reduces = |mesh: Mesh, zero: u8| {
        let options = CompileOptions { zero, ..options(&spec, mesh, SGD, Schedule::CONSTANT, 1.0) };
        let program = compile(&spec, &options);
        program.instrs.iter().filter(|i| i.op == "shard.all_reduce" && program.buffers[i.outputs[0]].len() == 1 && i.loc.contains("grad_norm")).count()
    };
    assert_eq!(one_value_all_reduces(Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 0), 1);
    assert_eq!(one_value_all_reduces(Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 0), 0);
    assert_eq!(one_value_all_reduces(Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 3), 1);
}
