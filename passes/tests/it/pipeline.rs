//! The pipeline verifies after every pass, hands the IR to its observer, and reports a pass
//! that leaves broken IR as an internal error naming the pass.

use std::path::PathBuf;

use shardc_ir::mlir::IrContext;
use shardc_ir::spec::{lower, parse_file};
use shardc_ir::Module;
use shardc_passes::{compile_pipeline, Changed, Pass, PassError, Pipeline, VerifyShapes};

fn tiny(name: &str) -> Module {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    lower(&parse_file(&root.join(format!("models/{name}.toml"))).unwrap()).unwrap()
}

/// Runs `pipeline` and returns every IR text it observed, with the pass names.
fn run_observed(pipeline: &Pipeline, module: &mut Module) -> Result<Vec<(String, String)>, PassError> {
    let cx = IrContext::new().unwrap();
    let mut seen = Vec::new();
    pipeline.run(&cx, module, |_| true, |pass, ir| seen.push((pass.to_string(), ir.to_string())))?;
    Ok(seen)
}

#[test]
fn verify_pass_leaves_tiny_models_unchanged() {
    for name in ["tiny", "tiny-llama"] {
        let mut module = tiny(name);
        let before = module.clone();
        let cx = IrContext::new().unwrap();
        let report = compile_pipeline().run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
        assert_eq!(report.passes.len(), 1);
        assert_eq!(report.passes[0].changed, Changed::No);
        assert_eq!(module, before);
    }
}

#[test]
fn ir_after_verify_on_tiny_llama() {
    let mut module = tiny("tiny-llama");
    let seen = run_observed(&compile_pipeline(), &mut module).unwrap();
    let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["input", "verify"]);
    // Dumps carry name locations, so every op is traceable to its layer.
    insta::assert_snapshot!(seen[1].1);
}

/// A deliberately wrong pass: it changes a matmul's result type without changing its operands.
struct CorruptMatmul;

impl Pass for CorruptMatmul {
    fn name(&self) -> &'static str {
        "corrupt-matmul"
    }
    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let func = &mut module.funcs[0];
        let op = func.ops.iter().find(|o| o.name == "xf.matmul").unwrap().clone();
        let result = op.results[0].0 as usize;
        if let shardc_ir::Type::Tensor(t) = &mut func.types[result] {
            t.shape[2] += 1;
        }
        Ok(Changed::Yes)
    }
}

#[test]
fn broken_ir_after_a_pass_is_an_internal_error_naming_the_pass() {
    let mut module = tiny("tiny");
    let err = run_observed(&Pipeline::new().then(VerifyShapes).then(CorruptMatmul), &mut module).unwrap_err();
    let PassError::Internal { pass, source } = &err else { panic!("expected an internal error, got {err}") };
    assert_eq!(pass, "corrupt-matmul");
    let text = source.to_string();
    assert!(text.contains("layers.0.attn.q"), "{text}");
    assert!(text.contains("shape rule gives"), "{text}");
}

/// A pass that breaks SSA form by making the first op use the function's last value.
struct BreakSsa;

impl Pass for BreakSsa {
    fn name(&self) -> &'static str {
        "break-ssa"
    }
    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let func = &mut module.funcs[0];
        // Use a value before its definition.
        let last = func.ops.last().unwrap().results[0];
        func.ops[0].operands[0] = last;
        Ok(Changed::Yes)
    }
}

#[test]
fn use_before_definition_is_caught() {
    let mut module = tiny("tiny");
    let err = run_observed(&Pipeline::new().then(BreakSsa), &mut module).unwrap_err();
    assert!(err.to_string().contains("before it is defined"), "{err}");
}
