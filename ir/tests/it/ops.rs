//! Shape rules and costs of individual ops, including the errors they report.

use shardc_ir::ops::lookup;
use shardc_ir::{AttrValue, Attrs, DType, TensorTy};

fn t(shape: &[i64]) -> TensorTy {
    TensorTy::new(shape, DType::F32)
}

fn mm(transpose_lhs: bool, transpose_rhs: bool) -> Attrs {
    Attrs::new().with("transpose_lhs", AttrValue::Bool(transpose_lhs)).with("transpose_rhs", AttrValue::Bool(transpose_rhs))
}

fn infer(op: &str, inputs: &[TensorTy], attrs: Attrs) -> Result<Vec<TensorTy>, String> {
    let refs: Vec<&TensorTy> = inputs.iter().collect();
    lookup(op).unwrap().infer(&refs, &attrs)
}

#[test]
fn matmul_shapes_and_flops() {
    assert_eq!(infer("xf.matmul", &[t(&[2, 8, 16]), t(&[16, 64])], mm(false, false)).unwrap(), vec![t(&[2, 8, 64])]);
    // Tied LM head: [b, s, h] x [v, h]^T.
    assert_eq!(infer("xf.matmul", &[t(&[2, 8, 16]), t(&[100, 16])], mm(false, true)).unwrap(), vec![t(&[2, 8, 100])]);
    // Batched with equal batch dims.
    assert_eq!(infer("xf.matmul", &[t(&[3, 4, 5]), t(&[3, 5, 6])], mm(false, false)).unwrap(), vec![t(&[3, 4, 6])]);
    let err = infer("xf.matmul", &[t(&[2, 8, 16]), t(&[15, 64])], mm(false, false)).unwrap_err();
    assert!(err.contains("contracted dimensions differ"), "{err}");
    let err = infer("xf.matmul", &[t(&[3, 4, 5]), t(&[2, 5, 6])], mm(false, false)).unwrap_err();
    assert!(err.contains("batch dimensions"), "{err}");
    let def = lookup("xf.matmul").unwrap();
    let (a, b) = (t(&[2, 8, 16]), t(&[16, 64]));
    let cost = def.cost(&[&a, &b], &[t(&[2, 8, 64])], &mm(false, false));
    assert_eq!(cost.flops, 2.0 * 2.0 * 8.0 * 16.0 * 64.0);
}

#[test]
fn attention_accepts_grouped_kv_heads() {
    let attrs = Attrs::new().with("causal", AttrValue::Bool(true)).with("scale", AttrValue::Float(0.5));
    let out = infer("xf.attention", &[t(&[2, 8, 16, 4]), t(&[2, 2, 16, 4]), t(&[2, 2, 16, 4])], attrs.clone()).unwrap();
    // The output, and its rows' log-sum-exp for the backward.
    assert_eq!(out, vec![t(&[2, 8, 16, 4]), t(&[2, 8, 16])]);
    let err = infer("xf.attention", &[t(&[2, 8, 16, 4]), t(&[2, 3, 16, 4]), t(&[2, 3, 16, 4])], attrs).unwrap_err();
    assert!(err.contains("multiple of kv heads"), "{err}");
}

#[test]
fn broadcasting_add_needs_trailing_dims() {
    assert_eq!(infer("xf.add", &[t(&[2, 8, 16]), t(&[16])], Attrs::new()).unwrap(), vec![t(&[2, 8, 16])]);
    assert_eq!(infer("xf.add", &[t(&[2, 8, 16]), t(&[8, 16])], Attrs::new()).unwrap(), vec![t(&[2, 8, 16])]);
    let err = infer("xf.add", &[t(&[2, 8, 16]), t(&[8])], Attrs::new()).unwrap_err();
    assert!(err.contains("trailing dimensions"), "{err}");
}

#[test]
fn heads_round_trip_shapes() {
    let split = infer("xf.split_heads", &[t(&[2, 8, 12])], Attrs::new().with("heads", AttrValue::Int(3))).unwrap();
    assert_eq!(split, vec![t(&[2, 3, 8, 4])]);
    assert_eq!(infer("xf.merge_heads", &split, Attrs::new()).unwrap(), vec![t(&[2, 8, 12])]);
    let err = infer("xf.split_heads", &[t(&[2, 8, 12])], Attrs::new().with("heads", AttrValue::Int(5))).unwrap_err();
    assert!(err.contains("not divisible"), "{err}");
}

#[test]
fn slice_bounds_are_checked() {
    let attrs = |start, size| {
        Attrs::new().with("axis", AttrValue::Int(0)).with("start", AttrValue::Int(start)).with("size", AttrValue::Int(size))
    };
    assert_eq!(infer("xf.slice", &[t(&[16, 4])], attrs(0, 8)).unwrap(), vec![t(&[8, 4])]);
    assert!(infer("xf.slice", &[t(&[16, 4])], attrs(10, 8)).unwrap_err().contains("out of range"));
    assert!(infer("xf.slice", &[t(&[16, 4])], attrs(i64::MAX, 8)).unwrap_err().contains("out of range"));
}

#[test]
fn ids_must_be_integers() {
    let ids = TensorTy::new([2, 8], DType::I32);
    assert_eq!(infer("xf.embedding", &[t(&[64, 16]), ids.clone()], Attrs::new()).unwrap(), vec![t(&[2, 8, 16])]);
    assert!(infer("xf.embedding", &[t(&[64, 16]), t(&[2, 8])], Attrs::new()).unwrap_err().contains("token ids"));
    assert_eq!(infer("xf.cross_entropy", &[t(&[2, 8, 64]), ids], Attrs::new()).unwrap(), vec![TensorTy::scalar(DType::F32)]);
}

#[test]
fn wrong_arity_and_missing_attributes_are_errors() {
    assert!(infer("xf.gelu", &[], Attrs::new()).unwrap_err().contains("expects 1 operands"));
    assert!(infer("xf.rope", &[t(&[1, 2, 3, 4])], Attrs::new()).unwrap_err().contains("theta"));
    let odd = infer("xf.rope", &[t(&[1, 2, 3, 5])], Attrs::new().with("theta", AttrValue::Float(1e4))).unwrap_err();
    assert!(odd.contains("even"), "{odd}");
}

#[test]
fn registry_names_are_unique() {
    let mut names: Vec<String> = shardc_ir::ops::REGISTRY.iter().map(|op| op.name()).collect();
    let n = names.len();
    names.sort();
    names.dedup();
    assert_eq!(n, names.len());
}
