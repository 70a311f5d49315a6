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
    // Heads side by side in the features: q [b, s, 8 heads x 4], k and v 2 heads.
    let attrs = Attrs::new().with("causal", AttrValue::Bool(true)).with("scale", AttrValue::Float(0.5)).with("head_dim", AttrValue::Int(4));
    let out = infer("xf.attention", &[t(&[2, 16, 32]), t(&[2, 16, 8]), t(&[2, 16, 8])], attrs.clone()).unwrap();
    // The output, and its rows' log-sum-exp ([b, heads, s]) for the backward.
    assert_eq!(out, vec![t(&[2, 16, 32]), t(&[2, 8, 16])]);
    let err = infer("xf.attention", &[t(&[2, 16, 32]), t(&[2, 16, 12]), t(&[2, 16, 12])], attrs.clone()).unwrap_err();
    assert!(err.contains("multiple of kv heads"), "{err}");
    // Features that are not whole heads are refused by name.
    let err = infer("xf.attention", &[t(&[2, 16, 30]), t(&[2, 16, 8]), t(&[2, 16, 8])], attrs.clone()).unwrap_err();
    assert!(err.contains("not whole heads of head_dim = 4"), "{err}");
    let err = infer("xf.attention", &[t(&[2, 16, 32]), t(&[2, 16, 8]), t(&[2, 16, 8])], attrs.with("head_dim", AttrValue::Int(0))).unwrap_err();
    assert!(err.contains("head_dim"), "{err}");
}

#[test]
fn broadcasting_add_needs_trailing_dims() {
    assert_eq!(infer("xf.add", &[t(&[2, 8, 16]), t(&[16])], Attrs::new()).unwrap(), vec![t(&[2, 8, 16])]);
    assert_eq!(infer("xf.add", &[t(&[2, 8, 16]), t(&[8, 16])], Attrs::new()).unwrap(), vec![t(&[2, 8, 16])]);
    let err = infer("xf.add", &[t(&[2, 8, 16]), t(&[8])], Attrs::new()).unwrap_err();
    assert!(err.contains("trailing dimensions"), "{err}");
}

/// Per-head ops refuse operands with no heads, attention a query with no keys, and a repeat
/// past i64: errors by name, never a kernel that panics on an empty row.
#[test]
fn per_head_ops_refuse_empty_heads_and_overflow() {
    let attention = Attrs::new().with("causal", AttrValue::Bool(true)).with("scale", AttrValue::Float(0.5)).with("head_dim", AttrValue::Int(4));
    let err = infer("xf.attention", &[t(&[1, 3, 0]), t(&[1, 3, 4]), t(&[1, 3, 4])], attention.clone()).unwrap_err();
    assert!(err.contains("has no heads"), "{err}");
    let err = infer("xf.attention", &[t(&[1, 3, 4]), t(&[1, 0, 4]), t(&[1, 0, 4])], attention).unwrap_err();
    assert!(err.contains("whole number of q's"), "{err}");
    let rope = Attrs::new().with("theta", AttrValue::Float(1e4)).with("head_dim", AttrValue::Int(4));
    assert!(infer("xf.rope", &[t(&[1, 3, 0])], rope).unwrap_err().contains("not whole heads"));
    let lse = TensorTy::new([1, 2, 3], DType::F32);
    let err = infer("xf.attention_merge", &[t(&[1, 3, 0]), lse.clone(), t(&[1, 3, 0]), lse], Attrs::new()).unwrap_err();
    assert!(err.contains("whole number of heads"), "{err}");
    let repeat = Attrs::new().with("times", AttrValue::Int(1 << 62)).with("head_dim", AttrValue::Int(4));
    assert!(infer("xf.repeat_heads", &[t(&[2, 16, 8])], repeat).unwrap_err().contains("too large"));
}

#[test]
fn head_repeats_round_trip_shapes() {
    let attrs = Attrs::new().with("times", AttrValue::Int(3)).with("head_dim", AttrValue::Int(4));
    let repeated = infer("xf.repeat_heads", &[t(&[2, 8, 8])], attrs.clone()).unwrap();
    assert_eq!(repeated, vec![t(&[2, 8, 24])]);
    assert_eq!(infer("xf.sum_heads", &repeated, attrs.clone()).unwrap(), vec![t(&[2, 8, 8])]);
    let err = infer("xf.sum_heads", &[t(&[2, 8, 8])], attrs.clone()).unwrap_err();
    assert!(err.contains("groups of 3"), "{err}");
    let err = infer("xf.repeat_heads", &[t(&[2, 8, 10])], attrs).unwrap_err();
    assert!(err.contains("not whole heads"), "{err}");
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
    let rope = |head_dim: i64| Attrs::new().with("theta", AttrValue::Float(1e4)).with("head_dim", AttrValue::Int(head_dim));
    assert!(infer("xf.rope", &[t(&[1, 3, 8])], Attrs::new().with("head_dim", AttrValue::Int(4))).unwrap_err().contains("theta"));
    assert!(infer("xf.rope", &[t(&[1, 3, 8])], Attrs::new().with("theta", AttrValue::Float(1e4))).unwrap_err().contains("head_dim"));
    let odd = infer("xf.rope", &[t(&[1, 3, 10])], rope(5)).unwrap_err();
    assert!(odd.contains("even"), "{odd}");
    assert!(infer("xf.rope", &[t(&[1, 3, 10])], rope(4)).unwrap_err().contains("not whole heads"));
}

#[test]
fn registry_names_are_unique() {
    let mut names: Vec<String> = shardc_ir::ops::REGISTRY.iter().map(|op| op.name()).collect();
    let n = names.len();
    names.sort();
    names.dedup();
    assert_eq!(n, names.len());
}
