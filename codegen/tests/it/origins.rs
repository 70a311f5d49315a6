//! Passes decide by ops' structured facts (their origin: block, layer, role; parameters'
//! kinds), never by location strings or names: renaming every location to a meaningless
//! one leaves every compiled program as it was, but for the locations themselves.

use std::collections::HashMap;

use shardc_ir::Module;
use shardc_ir::mesh::Mesh;
use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind, PipelineOptions, Recompute};
use shardc_runtime::schedule::{generate, Kind};
use shardc_runtime::Program;

use crate::common::*;

/// Every op's location renamed `x0`, `x1`, ... (equal locations stay equal), and every
/// argument's name: the names a pass could read meaning from.
fn scrambled(module: &Module) -> Module {
    let mut module = module.clone();
    let mut names: HashMap<String, String> = HashMap::new();
    let mut rename = |text: &str| {
        let n = names.len();
        names.entry(text.to_string()).or_insert_with(|| format!("x{n}")).clone()
    };
    for func in &mut module.funcs {
        for op in &mut func.ops {
            op.loc = rename(&op.loc);
        }
        for arg in &mut func.args {
            arg.name = rename(&arg.name);
        }
        // The result names follow the arguments they update (`loss` first).
        for name in func.result_names.iter_mut().skip(1) {
            *name = rename(name);
        }
    }
    module
}

/// The programs of `module` compiled under `options`, without locations or names.
fn programs(mut module: Module, options: &CompileOptions) -> Vec<Program> {
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    let mut programs = match &options.pipeline {
        Some(p) => {
            let kind = if p.chunks > 1 { Kind::Interleaved } else if p.split_weight_grads { Kind::ZeroBubble } else { Kind::OneFOneB };
            let schedule = generate(kind, options.mesh.pp as usize, p.microbatches, p.chunks).unwrap();
            shardc_codegen::lower_pipeline(&module, &grid, &schedule).unwrap()
        }
        None => vec![shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap()],
    };
    for program in &mut programs {
        for instr in &mut program.instrs {
            instr.loc.clear();
        }
        for binding in program.args.iter_mut().chain(&mut program.results) {
            binding.name.clear();
        }
        for buffer in &mut program.buffers {
            buffer.name.clear();
        }
        // Causes name the ops they serve.
        for instr in &mut program.instrs {
            instr.attrs.remove("xf.cause");
        }
    }
    programs
}

#[test]
fn passes_read_no_meaning_from_locations_or_names() {
    let adamw = OptimizerKind::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 };
    let cases: Vec<(&str, &str, CompileOptions)> = vec![
        // Tensor, data and sequence parallelism, ZeRO, recomputation, clipping, buckets.
        ("tiny", "f32", CompileOptions { mesh: Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, zero: 1, sequence_parallel: true, recompute: Recompute::Full, clip_grad: 1.0, grad_bucket_bytes: 1 << 12, optimizer: adamw, ..Default::default() }),
        // Pipeline stages (balanced by block), weight sections, selective recomputation.
        ("tiny-llama", "f32", CompileOptions { mesh: Mesh { dp: 1, tp: 2, pp: 2, cp: 1, ep: 1 }, recompute: Recompute::SelectiveAttention, pipeline: Some(PipelineOptions { chunks: 1, microbatches: 2, manual: None, split_weight_grads: true }), ..Default::default() }),
        // Interleaved chunks, mixed precision, ZeRO-3.
        ("tiny", "bf16", CompileOptions { mesh: Mesh { dp: 2, tp: 1, pp: 2, cp: 1, ep: 1 }, zero: 3, optimizer: adamw, pipeline: Some(PipelineOptions { chunks: 2, microbatches: 2, manual: None, split_weight_grads: false }), ..Default::default() }),
        // The naive layout and the communication optimizer that repairs it.
        ("tiny", "f32", CompileOptions { mesh: Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, naive_partition: true, comm_opt: true, ..Default::default() }),
    ];
    for (name, dtype, options) in cases {
        let spec = spec_with_dtype(name, dtype);
        let options = CompileOptions { vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, ..options };
        let module = model(&spec);
        let plain = programs(module.clone(), &options);
        let renamed = programs(scrambled(&module), &options);
        assert_eq!(plain.len(), renamed.len(), "{name} {dtype} {}", options.mesh);
        for (rank, (a, b)) in plain.iter().zip(&renamed).enumerate() {
            assert!(a == b, "{name} {dtype} {}: program {rank} changed when locations and names did", options.mesh);
        }
    }
}
