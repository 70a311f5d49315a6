//! Training runs through the CPU runtime: the loss falls, and runs are bit-identical.

use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind};
use shardc_runtime::data::ByteCorpus;
use shardc_runtime::train::Trainer;

use crate::common::*;

/// Compiles `name`'s training step and returns the loss of each of `steps` steps.
fn losses(name: &str, steps: usize, seed: u64, options: CompileOptions) -> Vec<f64> {
    let spec = spec_with_dtype(name, "f32");
    let mut module = model(&spec);
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    let program = shardc_codegen::lower_func(module.func("train_step").unwrap()).unwrap();
    let mut trainer = Trainer::new(program, seed, spec.model.layers as usize).unwrap();
    let bytes = std::fs::read(root().join("data/kjv-genesis-exodus.txt")).unwrap();
    let corpus = ByteCorpus::new(bytes, spec.seq_len() as usize, spec.model.vocab as usize).unwrap();
    (0..steps).map(|_| trainer.step(&corpus).unwrap()).collect()
}

fn adamw(lr: f64) -> CompileOptions {
    CompileOptions { optimizer: OptimizerKind::adamw(lr), ..Default::default() }
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

#[test]
fn tiny_gpt_loss_falls() {
    let l = losses("tiny", 100, 0, adamw(3e-3));
    // Byte-level start: ln(256) = 5.55.
    assert!((l[0] - 256f64.ln()).abs() < 0.1, "initial loss {}", l[0]);
    assert!(mean(&l[90..]) < 0.75 * l[0], "loss went from {} to {}", l[0], mean(&l[90..]));
}

#[test]
fn tiny_llama_loss_falls() {
    let l = losses("tiny-llama", 100, 0, adamw(3e-3));
    assert!(mean(&l[90..]) < 0.75 * l[0], "loss went from {} to {}", l[0], mean(&l[90..]));
}

#[test]
fn sgd_also_trains() {
    let l = losses("tiny", 60, 0, CompileOptions { optimizer: OptimizerKind::Sgd { lr: 0.5, weight_decay: 0.0 }, ..Default::default() });
    assert!(mean(&l[50..]) < 0.9 * l[0], "loss went from {} to {}", l[0], mean(&l[50..]));
}

#[test]
fn same_seed_gives_bit_identical_losses() {
    let a = losses("tiny-llama", 20, 5, adamw(3e-3));
    let b = losses("tiny-llama", 20, 5, adamw(3e-3));
    assert_eq!(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    let c = losses("tiny-llama", 20, 6, adamw(3e-3));
    assert_ne!(a, c, "a different seed must give a different run");
}

#[test]
fn recomputation_does_not_change_the_losses() {
    let plain = losses("tiny", 5, 1, adamw(3e-3));
    for recompute in [shardc_passes::Recompute::Full, shardc_passes::Recompute::SelectiveAttention] {
        let other = losses("tiny", 5, 1, CompileOptions { recompute, ..adamw(3e-3) });
        for (a, b) in plain.iter().zip(&other) {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "{recompute:?}: {a} vs {b}");
        }
    }
}
