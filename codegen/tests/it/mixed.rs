//! Mixed precision as Megatron-LM trains: bf16 parameters and compute, fp32 master weights and
//! Adam moments, gradients cast to fp32 before they are reduced and accumulated, the update in
//! fp32, and the loss in fp32. The CPU runtime stores bf16 and computes in f32, so every mesh
//! is checked against the f32 program.

use std::time::Duration;

use shardc_ir::mesh::Mesh;
use shardc_ir::{ArgRole, DType};
use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind, PipelineOptions};
use shardc_runtime::collectives::Algorithm;
use shardc_runtime::data::ByteCorpus;
use shardc_runtime::pipeline::train_pipeline;
use shardc_runtime::schedule::{generate, Kind};
use shardc_runtime::train::{train_spmd, Trainer};

use crate::common::*;

const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 3e-3, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 };

fn module(name: &str, dtype: &str, mesh: Mesh, zero: u8, microbatches: usize) -> (shardc_ir::Module, shardc_ir::spec::Spec) {
    let mut spec = spec_with_dtype(name, dtype);
    spec.training.micro_batch = 4;
    let mut module = model(&spec);
    let pipeline = (mesh.pp > 1 || microbatches > 1).then_some(PipelineOptions { chunks: 1, microbatches, manual: None, split_weight_grads: false });
    let options = CompileOptions { optimizer: ADAMW, mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, zero, pipeline, ..Default::default() };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{name} {dtype} {mesh}: {e:?}"));
    (module, spec)
}

/// Losses of `steps` steps of `name` in `dtype` on `mesh`.
fn losses(name: &str, dtype: &str, mesh: Mesh, zero: u8, microbatches: usize, steps: u64) -> Vec<f64> {
    let (module, spec) = module(name, dtype, mesh, zero, microbatches);
    let layers = spec.model.layers as usize;
    let corpus = ByteCorpus::new(std::fs::read(root().join("data/kjv-genesis-exodus.txt")).unwrap(), spec.seq_len() as usize, spec.model.vocab as usize).unwrap();
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    if mesh.pp > 1 || microbatches > 1 {
        let programs = shardc_codegen::lower_pipeline(&module, &grid, &generate(Kind::OneFOneB, mesh.pp as usize, microbatches, 1).unwrap()).unwrap();
        return train_pipeline(&programs, 3, layers, &corpus, steps, Duration::from_secs(60), Algorithm::Ring).unwrap().losses;
    }
    let program = shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap();
    if mesh.ranks() > 1 {
        return train_spmd(&program, 3, layers, &corpus, steps, Duration::from_secs(60)).unwrap().losses;
    }
    let mut trainer = Trainer::new(program, 3, layers).unwrap();
    (0..steps).map(|_| trainer.step(&corpus).unwrap()).collect()
}

/// The training step shows mixed precision in its IR: every bf16 parameter has an fp32
/// master copy and fp32 moments, its gradient is cast to fp32 before the update and the
/// updated master cast back to bf16, and the loss is computed in fp32 from the bf16 logits
/// (no fp32 copy of them or of their gradient: the loss ops read bf16 and keep their loss and
/// row statistics in fp32). ZeRO shards the fp32 state over dp.
#[test]
fn the_training_step_keeps_fp32_masters_and_moments() {
    for (mesh, zero) in [(Mesh::default(), 0u8), (Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 1)] {
        let (module, _) = module("tiny-llama", "bf16", mesh, zero, 1);
        let step = module.func("train_step").unwrap();
        let params: Vec<_> = step.args_with(ArgRole::Param).collect();
        assert!(!params.is_empty());
        for p in &params {
            assert_eq!(step.tensor(p.value).unwrap().dtype, DType::Bf16, "{}", p.name);
            for (name, role) in [(format!("opt.master.{}", p.name), ArgRole::Master), (format!("opt.m.{}", p.name), ArgRole::OptState), (format!("opt.v.{}", p.name), ArgRole::OptState)] {
                let arg = step.args.iter().find(|a| a.name == name).unwrap_or_else(|| panic!("no `{name}`"));
                assert_eq!((arg.role, step.tensor(arg.value).unwrap().dtype), (role, DType::F32), "{name}");
                if zero >= 1 && p.name.ends_with(".weight") && !p.name.contains("norm") {
                    let layout = arg.layout.as_ref().unwrap();
                    assert!(layout.sharding.split.iter().flatten().any(|&a| a == 0), "{name} is not sharded over dp: {:?}", layout.sharding.split);
                }
            }
        }
        let casts: Vec<_> = step.ops.iter().filter(|op| op.name == "xf.cast").collect();
        let to = |dtype: DType| casts.iter().filter(|op| step.tensor(op.results[0]).unwrap().dtype == dtype).count();
        // Per parameter: gradient up and master down, and nothing else.
        assert_eq!(to(DType::F32), params.len(), "{mesh}");
        assert_eq!(to(DType::Bf16), params.len(), "{mesh}: the master weights down");
        let reads_logits = |name: &str| matches!(name, "xf.cross_entropy" | "xf.cross_entropy_grad" | "xf.cross_entropy_stats" | "xf.cross_entropy_grad_shard" | "xf.row_max");
        assert!(step.ops.iter().any(|op| reads_logits(&op.name)));
        for op in step.ops.iter().filter(|op| reads_logits(&op.name)) {
            assert_eq!(step.tensor(op.operands[0]).unwrap().dtype, DType::Bf16, "{}: {} reads the bf16 logits", op.loc, op.name);
            for r in &op.results {
                let t = step.tensor(*r).unwrap();
                // The logits' gradient is bf16; the loss and the rows' statistics are fp32.
                assert_eq!(t.dtype, if op.name.ends_with("grad") || op.name.ends_with("grad_shard") { DType::Bf16 } else { DType::F32 }, "{}: {}", op.loc, op.name);
            }
        }
        assert_eq!(step.tensor(step.returns[0]).unwrap().dtype, DType::F32, "{mesh}: the loss");
        for update in step.ops.iter().filter(|op| op.name == "xf.adamw") {
            assert!(update.operands[..4].iter().all(|v| step.tensor(*v).unwrap().dtype == DType::F32), "{}: the update runs in fp32", update.loc);
        }
    }
}

/// Gradients accumulate over micro-batches in fp32: every value a pipeline rank sums over
/// micro-batches for its step is fp32.
#[test]
fn gradients_accumulate_in_fp32() {
    let (module, _) = module("tiny", "bf16", Mesh { dp: 2, tp: 1, pp: 2, cp: 1, ep: 1 }, 0, 2);
    let programs = shardc_codegen::lower_pipeline(&module, &module.grids[0].shape, &generate(Kind::OneFOneB, 2, 2, 1).unwrap()).unwrap();
    for program in &programs {
        for chunk in &program.pipeline.as_ref().unwrap().chunks {
            assert!(!chunk.sum_backward.is_empty());
            for &b in chunk.sum_backward.iter().chain(&chunk.sum_weight) {
                assert_eq!(program.buffers[b].dtype, shardc_runtime::DType::F32, "`{}` is summed in {:?}", program.buffers[b].name, program.buffers[b].dtype);
            }
        }
    }
}

/// On every mesh, the bf16 mixed-precision run tracks the f32 run within 2% step by step,
/// and the bf16 runs of different meshes agree with each other more closely still.
#[test]
fn mixed_precision_tracks_f32_on_every_mesh() {
    const STEPS: u64 = 6;
    for name in ["tiny", "tiny-llama"] {
        let single_bf16 = losses(name, "bf16", Mesh::default(), 0, 1, STEPS);
        for (mesh, zero, m) in [(Mesh::default(), 0u8, 1usize), (Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 0, 1), (Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 0, 1), (Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 1, 1), (Mesh { dp: 1, tp: 1, pp: 2, cp: 1, ep: 1 }, 0, 2), (Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 1, 2)] {
            let what = format!("{name} {mesh} ZeRO-{zero} m={m}");
            // The same global batch of 4 rows: m micro-batches of 4 / m.
            let f32 = losses(name, "f32", mesh, zero, m, STEPS);
            let bf16 = losses(name, "bf16", mesh, zero, m, STEPS);
            for (step, (a, b)) in f32.iter().zip(&bf16).enumerate() {
                assert!((a - b).abs() <= 0.02 * a.abs(), "{what} step {}: f32 {a} vs bf16 {b}", step + 1);
            }
            if m == 1 {
                for (step, (a, b)) in single_bf16.iter().zip(&bf16).enumerate() {
                    assert!((a - b).abs() <= 0.01 * a.abs(), "{what} step {}: bf16 on one device {a} vs {b}", step + 1);
                }
            }
            assert!(bf16[STEPS as usize - 1] < bf16[0], "{what}: the bf16 loss falls: {bf16:?}");
        }
    }
}

/// A tensor-parallel weight's gradient GEMM gives the rank's shard in bf16 as in f32, with or
/// without sequence parallelism (from the gathered input and the local output gradient, as
/// Megatron-LM computes it): it was once computed whole, as a partial sum over tp, reduced
/// over dp and tp in fp32 and sliced, tp times the GEMM and a whole weight's all-reduce for
/// every column-parallel layer (GPT-3 175B at tp=8 with sequence parallelism: 55.8 GiB a
/// rank per micro-batch step). The embedding table's gradient, in either precision, is its
/// rank's vocabulary rows (it was the whole table on every tp rank, and with sequence
/// parallelism all-reduced over tp: GPT-3's 2.3 GiB in bf16 for each micro-batch). Under
/// sequence parallelism the bf16 run still follows one device's.
#[test]
fn tensor_parallel_weight_gradients_stay_sharded_in_bf16() {
    const STEPS: u64 = 4;
    let mesh = Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 };
    for name in ["tiny", "tiny-llama"] {
        for sequence_parallel in [false, true] {
            let what = format!("{name} {mesh} sp={sequence_parallel}");
            let compile = |dtype: &str, mesh: Mesh| {
                let mut spec = spec_with_dtype(name, dtype);
                spec.training.micro_batch = 4;
                let options = CompileOptions { optimizer: ADAMW, mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, sequence_parallel: sequence_parallel && mesh.tp > 1, ..Default::default() };
                (compiled_step(&spec, &options), spec)
            };
            let wgrads = |p: &shardc_runtime::Program| p.instrs.iter().filter(|i| i.op == "xf.matmul_wgrad").map(|i| (i.loc.clone(), p.buffers[i.outputs[0]].shape.clone())).collect::<Vec<_>>();
            let ((f32, _), (bf16, spec)) = (compile("f32", mesh), compile("bf16", mesh));
            assert_eq!(wgrads(&bf16), wgrads(&f32), "{what}: weight gradients in bf16 and f32");
            // No weight's gradient is reduced over tp, the embedding table's included (under
            // sequence parallelism each rank gathers the table's output gradient over tp and
            // sums into the vocabulary rows it holds, as Megatron-LM does).
            for program in [&bf16, &f32] {
                for i in program.instrs.iter().filter(|i| i.op == "shard.all_reduce" && i.ints("grid_axes").is_ok_and(|a| a.contains(&1))) {
                    // (The loss's per-token statistics, and their gradient's, are 2-D too.)
                    let weight_gradient = program.buffers[i.inputs[0]].shape.len() == 2 && !i.loc.starts_with("loss.");
                    assert!(!weight_gradient, "{what}: {} reduces a weight's gradient over tp", i.loc);
                }
                let vocab = spec_with_dtype(name, "f32").model.vocab as usize;
                let table_grads: Vec<_> = program.instrs.iter().filter(|i| i.op == "xf.embedding_grad").collect();
                assert_eq!(table_grads.len(), 1, "{what}");
                for i in table_grads {
                    assert_eq!(program.buffers[i.outputs[0]].shape[0], vocab / 2, "{what}: {} is not this rank's vocabulary rows", i.loc);
                    assert_eq!(i.ints("xf.row_split_axes").ok(), Some(vec![1]), "{what}: {}", i.loc);
                }
            }
            let layers = spec.model.layers as usize;
            let corpus = ByteCorpus::new(std::fs::read(root().join("data/kjv-genesis-exodus.txt")).unwrap(), spec.seq_len() as usize, spec.model.vocab as usize).unwrap();
            let run = train_spmd(&bf16, 3, layers, &corpus, STEPS, Duration::from_secs(60)).unwrap();
            let one = losses(name, "bf16", Mesh::default(), 0, 1, STEPS);
            for (step, (a, b)) in one.iter().zip(&run.losses).enumerate() {
                assert!((a - b).abs() <= 0.01 * a.abs(), "{what} step {}: bf16 on one device {a} vs {b}", step + 1);
            }
        }
    }
}

/// Under expert parallelism the data axes are dp and ep: a dense weight's and the embedding
/// table's bf16 gradients are left partial over both, so that their whole sum over the data
/// axes runs in fp32 after the cast (a pin partial over dp alone once summed the table's
/// gradient over ep in bf16). Every reduction of a 2-D gradient is of an fp32 buffer.
#[test]
fn gradient_sums_over_the_data_axes_stay_fp32_under_expert_parallelism() {
    let mesh = Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 2 };
    let spec = spec_with_dtype("tiny-moe", "bf16");
    let options = CompileOptions { optimizer: ADAMW, mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, ..Default::default() };
    let program = compiled_step(&spec, &options);
    let reductions: Vec<_> = program.instrs.iter().filter(|i| matches!(i.op.as_str(), "shard.all_reduce" | "shard.reduce_scatter") && program.buffers[i.inputs[0]].shape.len() == 2 && !i.loc.starts_with("loss.")).collect();
    assert!(!reductions.is_empty());
    for i in reductions {
        assert_eq!(program.buffers[i.inputs[0]].dtype, DType::F32, "{mesh}: {} reduces a gradient in {:?}", i.loc, program.buffers[i.inputs[0]].dtype);
    }
    let table = program.instrs.iter().find(|i| i.op == "xf.embedding_grad").unwrap();
    assert_eq!(program.buffers[table.outputs[0]].shape[0], spec.model.vocab as usize / 2);
}
