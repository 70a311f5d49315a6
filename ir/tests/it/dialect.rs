//! The checked-in IRDL file is what the op registry generates, it loads, and MLIR's verifier
//! enforces what IRDL can express.

use shardc_ir::mlir::{irdl_source, IrContext, XF_IRDL};

use crate::workspace_root;

#[test]
fn checked_in_dialect_matches_the_registry() {
    let generated = irdl_source();
    let path = workspace_root().join("ir/dialect/xf.irdl.mlir");
    if std::env::var_os("SHARDC_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    assert!(
        XF_IRDL == generated,
        "ir/dialect/xf.irdl.mlir is out of date with the op registry; run `SHARDC_BLESS=1 cargo test` (or `shardc dialect > ir/dialect/xf.irdl.mlir`) and review the diff"
    );
}

#[test]
fn every_registered_op_is_loaded_into_mlir() {
    let cx = IrContext::new().unwrap();
    for op in shardc_ir::ops::REGISTRY {
        assert!(cx.mlir().is_registered_operation(&op.name()), "{} is not registered", op.name());
    }
}

/// Parses MLIR text in a fresh context and returns the diagnostics, or `None` if it verified.
fn parse_errors(text: &str) -> Option<String> {
    let cx = IrContext::new().unwrap();
    let (module, diags) = cx.collect(|| melior::ir::Module::parse(cx.mlir(), text).is_some());
    if module { None } else { Some(diags.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")) }
}

#[test]
fn irdl_verifier_rejects_mismatched_element_wise_types() {
    let text = r#"func.func @f(%a: tensor<4x8xf32>) -> tensor<4x16xf32> {
      %0 = "xf.gelu"(%a) : (tensor<4x8xf32>) -> tensor<4x16xf32>
      return %0 : tensor<4x16xf32> }"#;
    let errors = parse_errors(text).expect("must not verify");
    assert!(errors.contains("expected 'tensor<4x8xf32>' but got 'tensor<4x16xf32>'"), "{errors}");
}

#[test]
fn irdl_verifier_requires_attributes() {
    let text = r#"func.func @f(%a: tensor<4x8xf32>, %g: tensor<8xf32>) -> tensor<4x8xf32> {
      %0 = "xf.rmsnorm"(%a, %g) : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
      return %0 : tensor<4x8xf32> }"#;
    let errors = parse_errors(text).expect("must not verify");
    assert!(errors.contains("attribute \"epsilon\" is expected but not provided"), "{errors}");
}

#[test]
fn irdl_verifier_rejects_unknown_ops() {
    let text = r#"func.func @f(%a: tensor<4xf32>) -> tensor<4xf32> {
      %0 = "xf.softplus"(%a) : (tensor<4xf32>) -> tensor<4xf32>
      return %0 : tensor<4xf32> }"#;
    let errors = parse_errors(text).expect("must not verify");
    assert!(errors.contains("xf.softplus"), "{errors}");
}

#[test]
fn two_contexts_load_the_dialect_independently() {
    // Loading twice into one context crashes MLIR; each IrContext loads into its own.
    let a = IrContext::new().unwrap();
    let b = IrContext::new().unwrap();
    assert!(a.mlir().is_registered_operation("xf.matmul"));
    assert!(b.mlir().is_registered_operation("xf.matmul"));
}
