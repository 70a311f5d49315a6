//! The memory estimator against the published formulas (shared/refs/memory-formulas.md) on
//! the shipped gpt3-175b- and llama-7b-shaped specs.

use shardc_codegen::estimate::memory;
use shardc_ir::mesh::Mesh;
use shardc_passes::{compile_pipeline, CompileOptions};

use crate::common::*;

fn compile(name: &str, mesh: Mesh, micro_batch: u64, zero: u8) -> (shardc_runtime::Program, shardc_ir::spec::Spec, u64) {
    let mut spec = spec_with_dtype(name, "bf16");
    spec.training.micro_batch = micro_batch;
    let mut module = model(&spec);
    let params = module.func("forward").unwrap().parameter_count();
    let options = CompileOptions { mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, zero, comm_opt: false, ..Default::default() };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    (shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &module.grids[0].shape).unwrap(), spec, params)
}

fn close(what: &str, ours: f64, formula: f64) {
    let err = (ours - formula).abs() / formula;
    assert!(err <= 0.05, "{what}: estimate {ours:.4e} vs formula {formula:.4e} ({:.1}% off)", 100.0 * err);
}

/// Model states: 16 Psi bytes per replica, sharded by ZeRO stage (Rajbhandari et al.), with
/// Psi the parameters of one model-parallel rank, plus what keeping gradients in fp32 adds
/// (the program casts bf16 gradients up before reducing and accumulating them, as
/// Megatron-LM does in bf16 training: 4 Psi bytes instead of 2, sharded from stage 2). The
/// estimate reads the types and layouts of the program compiled at each stage.
#[test]
fn model_states_follow_the_zero_formulas() {
    for (name, tp) in [("gpt3-175b", 8), ("llama-7b", 4)] {
        let dp = 8u64;
        let d = dp as f64;
        for zero in 0..=3u8 {
            let (program, _, params) = compile(name, Mesh { dp, tp, pp: 1 }, dp, zero);
            let psi = params as f64 / tp as f64;
            let formula = [16.0 * psi, 4.0 * psi + 12.0 * psi / d, 2.0 * psi + 14.0 * psi / d, 16.0 * psi / d][zero as usize];
            let fp32_gradients = if zero >= 2 { 2.0 * psi / d } else { 2.0 * psi };
            let m = &memory(std::slice::from_ref(&program), zero)[0];
            close(&format!("{name} tp={tp} dp={dp} ZeRO-{zero}"), m.parameters + m.gradients + m.optimizer, formula + fp32_gradients);
            // The 12 Psi of fp32 master weights and moments, sharded from stage 1.
            close(&format!("{name} ZeRO-{zero} optimizer"), m.optimizer, if zero >= 1 { 12.0 * psi / d } else { 12.0 * psi });
        }
    }
}

/// Activations of a GPT-style layer under tensor parallelism (Korthikanti et al. Table 2). Our
/// attention is fused (scores are recomputed in the backward pass, as the selective
/// recomputation row assumes) and the model has no dropout, so the row to meet is
/// `s b h (10 + 24/t)` less the two `s b h` bytes of dropout masks.
#[test]
fn activations_follow_the_tensor_parallel_formula() {
    let (tp, dp) = (8u64, 8u64);
    let (program, spec, _) = compile("gpt3-175b", Mesh { dp, tp, pp: 1 }, dp, 0);
    let m = &memory(std::slice::from_ref(&program), 0)[0];
    let (s, b, h, layers) = (spec.seq_len() as f64, 1.0, spec.model.hidden as f64, spec.model.layers as f64);
    let t = tp as f64;
    let per_layer = s * b * h * (10.0 + 24.0 / t) - 2.0 * s * b * h;
    close("gpt3-175b activations", m.activations, per_layer * layers);
    assert_eq!(m.in_flight, 1);
}

/// The same accounting for the Llama layer (RMSNorm, SwiGLU, no dropout, fused attention):
/// norm inputs and outputs whole (8 s b h), q, k, v and the attention output split (8 s b h /
/// t with as many kv heads as heads), the gate and up projections and their product split
/// (6 s b f / t).
#[test]
fn llama_activations_follow_the_same_accounting() {
    let (tp, dp) = (4u64, 8u64);
    let (program, spec, _) = compile("llama-7b", Mesh { dp, tp, pp: 1 }, dp, 0);
    let m = &memory(std::slice::from_ref(&program), 0)[0];
    let (s, h, f, layers, t) = (spec.seq_len() as f64, spec.model.hidden as f64, spec.model.ffn_hidden as f64, spec.model.layers as f64, tp as f64);
    assert_eq!(spec.model.kv_heads(), spec.model.heads, "the formula below assumes as many kv heads as heads");
    let per_layer = s * h * (8.0 + 8.0 / t) + 6.0 * s * f / t;
    close("llama-7b activations", m.activations, per_layer * layers);
}

/// The planner's unit costs read bytes per parameter from the compiled program's types: in
/// mixed precision 2 for the bf16 weights, 4 for the fp32 gradients, 12 for the fp32 master
/// copy and two moments; an f32 program keeps 4, 4 and 8 (two moments, no master).
#[test]
fn unit_costs_read_bytes_per_parameter_from_the_program() {
    let cluster = shardc_ir::cluster::Cluster::default();
    for (dtype, want) in [("bf16", (2.0, 4.0, 12.0)), ("f32", (4.0, 4.0, 8.0))] {
        let mut spec = spec_with_dtype("tiny", dtype);
        spec.training.micro_batch = 1;
        let mut module = model(&spec);
        let cx = shardc_ir::mlir::IrContext::new().unwrap();
        compile_pipeline(&CompileOptions { comm_opt: false, ..Default::default() }).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
        let program = shardc_codegen::lower_func(module.func("train_step").unwrap()).unwrap();
        let u = shardc_codegen::estimate::unit_costs(&program, &cluster);
        assert_eq!((u.parameter_bytes, u.gradient_bytes, u.state_bytes), want, "{dtype}");
        assert!(u.layer_kept > 0.0 && u.temporaries >= 0.0);
    }
}
