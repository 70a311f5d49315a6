//! Helpers: compile functions to rank programs and run them.

use std::path::PathBuf;

use shardc_codegen::lower_func;
use shardc_ir::spec::{lower, parse, Format, Spec, StepShape};
use shardc_ir::{Func, Module};
use shardc_passes::{Autodiff, Pass, Recompute};
use shardc_runtime::cpu::CpuExecutor;
use shardc_runtime::init::{init_param, key, normal};
use shardc_runtime::program::Role;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A shipped spec with its dtype replaced.
pub fn spec_with_dtype(name: &str, dtype: &str) -> Spec {
    let text = std::fs::read_to_string(root().join(format!("models/{name}.toml"))).unwrap();
    let text = text.replace("dtype = \"f32\"", &format!("dtype = \"{dtype}\""));
    parse(&text, Format::Toml, name).unwrap()
}

/// `@forward` and `@gradients` of a module holding `@forward`.
pub fn forward_and_gradients(mut module: Module, recompute: Recompute) -> (Func, Func) {
    Autodiff { recompute }.run(&mut module).unwrap();
    (module.func("forward").unwrap().clone(), module.func("gradients").unwrap().clone())
}

pub fn executor(func: &Func) -> CpuExecutor {
    CpuExecutor::new(lower_func(func).unwrap()).unwrap()
}

/// Deterministic pseudo-random normal values.
pub fn randn(seed: u64, name: &str, len: usize, std: f64) -> Vec<f64> {
    let k = key(seed, name);
    (0..len as u64).map(|i| std * normal(k, i)).collect()
}

/// Initialises every parameter of `exec` as `shardc run` does.
pub fn init_params(exec: &mut CpuExecutor, seed: u64, layers: usize) {
    for (name, shape) in exec.args_with(Role::Param) {
        let len = shape.iter().product();
        exec.write::<f64>(&name, &init_param(&name, len, seed, layers)).unwrap();
    }
}

/// The spec's model lowered to a module: `training.micro_batch` rows per step in all (these
/// tests compare meshes on the same rows), the vocabulary as the spec gives it.
pub fn model(spec: &Spec) -> Module {
    model_in_order(spec, 1)
}

/// [`model`] with its sequences in zigzag order of `sequence_chunks` chunks (context
/// parallelism's order; 1: the natural order).
pub fn model_in_order(spec: &Spec, sequence_chunks: u64) -> Module {
    lower(spec, StepShape { rows: spec.training.micro_batch, padded_vocab: spec.model.vocab, sequence_chunks }).unwrap()
}

/// The rank program of `spec`'s training step compiled by the whole pipeline under
/// `options` (on the mesh's grid).
pub fn compiled_step(spec: &Spec, options: &shardc_passes::CompileOptions) -> shardc_runtime::Program {
    let mut module = model(spec);
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    shardc_passes::compile_pipeline(options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap()
}
