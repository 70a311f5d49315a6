//! A vocabulary padded for tensor parallelism (Megatron's `make-vocab-size-divisible-by`)
//! trains exactly like the unpadded one: padded logits never enter the softmax or the loss,
//! padded rows of the embedding and LM head get no gradient and stay zero, and the real
//! rows start from the same values.

use std::time::Duration;

use shardc_ir::mesh::Mesh;
use shardc_ir::spec::{lower, Spec, StepShape};
use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind};
use shardc_runtime::data::ByteCorpus;
use shardc_runtime::train::{train_spmd, Trainer};
use shardc_runtime::Program;

use crate::common::*;

const STEPS: u64 = 3;
const TOLERANCE: f64 = 1e-5;
/// AdamW with weight decay: a padded row that got any gradient would move by about `lr`.
const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, epsilon: 1e-3, weight_decay: 0.1 };

fn spec(name: &str, vocab_multiple: u64) -> Spec {
    let mut spec = spec_with_dtype(name, "f32");
    spec.training.micro_batch = 4;
    spec.model.vocab_multiple = vocab_multiple;
    spec
}

/// The training step of `spec` on `mesh`, its vocabulary padded to `padded_vocab` rows.
fn compile(spec: &Spec, mesh: Mesh, padded_vocab: u64) -> Program {
    let mut module = lower(spec, StepShape { rows: spec.training.micro_batch, padded_vocab, sequence_chunks: 1 }).unwrap();
    let options = CompileOptions { optimizer: ADAMW, mesh, vocab: padded_vocab as i64, kv_heads: spec.model.kv_heads() as i64, ..Default::default() };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{} {mesh}: {e:?}", spec.name));
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap()
}

fn corpus(spec: &Spec) -> ByteCorpus {
    ByteCorpus::new(std::fs::read(root().join("data/kjv-genesis-exodus.txt")).unwrap(), spec.seq_len() as usize, spec.model.vocab as usize).unwrap()
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let scale = a.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-2);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Padded and partitioned (vocab-parallel over tp) runs equal the unpadded single device:
/// 256 classes padded to 258 (tp 1, 2), 264 (tp 4), and 400 at tp=4, where the last rank
/// holds nothing but padding.
#[test]
fn padded_vocabularies_train_like_unpadded_ones() {
    for name in ["tiny", "tiny-llama"] {
        for (multiple, dp, tp) in [(3u64, 1u64, 1u64), (3, 1, 2), (3, 2, 2), (3, 1, 4), (100, 1, 4)] {
            let spec = spec(name, multiple);
            let padded = spec.model.padded_vocab(tp);
            assert!(padded > spec.model.vocab && padded % tp == 0, "{padded}");
            let what = format!("{name} vocab 256 padded to {padded} at dp={dp} tp={tp}");
            let corpus = corpus(&spec);
            let layers = spec.model.layers as usize;
            let mut reference = Trainer::new(compile(&spec, Mesh::default(), spec.model.vocab), 7, layers).unwrap();
            let losses: Vec<f64> = (0..STEPS).map(|_| reference.step(&corpus).unwrap()).collect();
            let want = reference.parameters().unwrap();

            let program = compile(&spec, Mesh { dp, tp, pp: 1, cp: 1, ep: 1 }, padded);
            let embedding = program.arg("embed.tokens.weight").unwrap();
            assert_eq!(embedding.unpadded.as_deref(), Some(&[256usize, 16][..]), "{what}");
            let (got_losses, got) = if dp * tp == 1 {
                let mut trainer = Trainer::new(program, 7, layers).unwrap();
                let losses: Vec<f64> = (0..STEPS).map(|_| trainer.step(&corpus).unwrap()).collect();
                let params = trainer.parameters().unwrap().into_iter().map(|(n, s, v)| (n, s, v.iter().map(|&x| x as f64).collect())).collect();
                (losses, params)
            } else {
                let run = train_spmd(&program, 7, layers, &corpus, STEPS, Duration::from_secs(30)).unwrap();
                (run.losses, run.parameters)
            };
            for (step, (a, b)) in losses.iter().zip(&got_losses).enumerate() {
                assert!((a - b).abs() <= TOLERANCE * a.abs(), "{what} step {}: loss {a} vs {b}", step + 1);
            }
            for ((name_a, shape_a, a), (name_b, shape_b, b)) in want.iter().zip(&got) {
                assert_eq!((name_a, shape_a), (name_b, shape_b), "{what}: parameters come back unpadded");
                let a: Vec<f64> = a.iter().map(|&x| x as f64).collect();
                let err = rel(&a, b);
                assert!(err <= TOLERANCE, "{what}: parameter {name_a} differs by {err:e}");
            }
        }
    }
}

/// The padding itself: after AdamW steps with weight decay, the padded rows of the embedding
/// and of an untied LM head are still exactly zero (no gradient ever reached them), and the
/// real rows started from the unpadded model's initial values.
#[test]
fn padded_rows_stay_zero() {
    for name in ["tiny", "tiny-llama"] {
        let spec = spec(name, 100);
        let padded = spec.model.padded_vocab(1) as usize;
        assert_eq!(padded, 300);
        let layers = spec.model.layers as usize;
        let corpus = corpus(&spec);
        let mut trainer = Trainer::new(compile(&spec, Mesh::default(), padded as u64), 7, layers).unwrap();
        let initial = trainer.parameters().unwrap();
        let unpadded = Trainer::new(compile(&spec, Mesh::default(), spec.model.vocab), 7, layers).unwrap().parameters().unwrap();
        assert_eq!(initial, unpadded, "{name}: the real rows start as the unpadded model's");
        for _ in 0..STEPS {
            trainer.step(&corpus).unwrap();
        }
        let exec = trainer.executor();
        let table = exec.read::<f32>("embed.tokens.weight").unwrap();
        assert_eq!(table.len(), padded * 16);
        assert!(table[256 * 16..].iter().all(|&x| x == 0.0), "{name}: padded embedding rows moved");
        assert!(table[..256 * 16].iter().any(|&x| x != 0.0));
        if name == "tiny-llama" {
            // Untied head [hidden, vocab]: the padded columns of every row.
            let head = exec.read::<f32>("lm_head.weight").unwrap();
            assert!(head.chunks(padded).all(|row| row[256..].iter().all(|&x| x == 0.0)), "padded LM-head columns moved");
        }
    }
}
