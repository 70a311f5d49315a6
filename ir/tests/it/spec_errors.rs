//! Every invalid spec under `tests/specs` gets errors that name the field, point at it, say
//! how to fix it, and never panic. The rendered errors are snapshotted.

use shardc_ir::spec::{parse, Format};

#[test]
fn invalid_specs_are_reported() {
    insta::glob!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests"), "specs/*", |path| {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(path).unwrap();
        let errors = parse(&text, Format::from_path(&name), &name).expect_err("spec must be rejected");
        assert!(!errors.errors.is_empty());
        let mut report = errors.to_string();
        for e in &errors.errors {
            // Semantic and type errors name a field; only a file that does not parse as
            // TOML/JSON at all may have none.
            if !name.contains("syntax") && !name.contains("trailing_comma") && !name.contains("missing_section") {
                assert!(!e.field.is_empty(), "{name}: error without a field: {e}");
            }
            let span = e.span.clone().unwrap_or_else(|| panic!("{name}: error without a span: {e}"));
            report.push_str(&format!("\n--- {} points at: {:?}", e.field, &text[span.start..span.end.min(text.len())]));
        }
        insta::assert_snapshot!(report);
    });
}

#[test]
fn several_errors_are_all_reported_in_source_order() {
    let text = std::fs::read_to_string(crate::workspace_root().join("ir/tests/specs/several_errors.toml")).unwrap();
    let errors = parse(&text, Format::Toml, "several_errors.toml").unwrap_err();
    let fields: Vec<&str> = errors.errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(fields, ["model.heads", "model.kv_heads", "training.global_batch"]);
}

/// `Spec::batch`: Megatron's meaning (micro-batch per replica; global = micro-batch x dp x
/// micro-batches), micro-batches derived from the global batch, and every inconsistency an
/// error that names the numbers and a fix.
#[test]
fn batches_follow_megatron() {
    let spec = crate::shipped_spec("gpt3-175b");
    let b = spec.batch(8, None, None).unwrap();
    assert_eq!((b.micro_batch, b.dp, b.microbatches, b.global_batch, b.rows()), (1, 8, 192, 1536, 8));
    let tiny = crate::shipped_spec("tiny");
    assert_eq!(tiny.batch(1, None, None).unwrap().microbatches, 4);
    assert_eq!(tiny.batch(4, None, None).unwrap().microbatches, 1);
    // `--microbatches` alone sets the global batch; with a global batch they must agree.
    let mut free = tiny.clone();
    free.training.global_batch = None;
    assert_eq!(free.batch(2, Some(3), None).unwrap().global_batch, 12);
    assert_eq!(free.batch(2, None, None).unwrap().global_batch, 4);
    assert_eq!(tiny.batch(2, Some(2), Some(8)).unwrap().microbatches, 2);
    let e = tiny.batch(2, Some(3), Some(8)).unwrap_err();
    assert!(e.message.contains("global batch 8") && e.message.contains("micro-batch 2") && e.message.contains("dp 2") && e.message.contains("3 micro-batches"), "{e}");
    assert!(e.help.unwrap().contains("--global-batch 12"));
    let e = tiny.batch(3, None, None).unwrap_err();
    assert!(e.message.contains("not a multiple of micro-batch 2 x dp 3 = 6"), "{e}");
    assert!(e.help.unwrap().contains("6 or 12"));
    // A global batch smaller than one micro-batch step.
    assert!(tiny.batch(8, None, None).is_err());
    // Hostile sizes are errors, not overflows.
    assert!(tiny.batch(u64::MAX, None, None).is_err());
    assert!(tiny.batch(2, Some(u64::MAX), None).is_err());
}

/// Sizes that each pass the per-field limit but multiply into a tensor past
/// `MAX_TENSOR_ELEMENTS` are refused, naming the field and the limit: a `hidden` of 2^31
/// (a `[hidden, hidden]` weight of 2^62 elements overflowed codegen's byte counts), and a
/// micro-batch whose activations grow past it only on many data-parallel replicas.
#[test]
fn sizes_whose_tensors_overflow_are_refused_naming_the_field() {
    use shardc_ir::spec::{check, MAX_TENSOR_ELEMENTS};
    let tiny = crate::shipped_spec("tiny-llama");
    let mut wide = tiny.clone();
    (wide.model.hidden, wide.model.heads, wide.model.kv_heads) = (1 << 31, 1, Some(1));
    let errors = check(&wide);
    let hidden = errors.iter().find(|e| e.field == "model.hidden").unwrap_or_else(|| panic!("{errors:?}"));
    assert!(hidden.message.contains("[hidden, hidden]") && hidden.message.contains("2^48"), "{hidden}");
    // At the limit itself a spec is accepted.
    (wide.model.hidden, wide.model.ffn_hidden) = (1 << 24, 1 << 24);
    assert!(check(&wide).is_empty(), "{:?}", check(&wide));
    let mut long = tiny.clone();
    (long.model.max_seq, long.training.seq_len, long.model.hidden) = (1 << 31, Some(1 << 31), 1 << 18);
    long.model.ffn_hidden = 64;
    let errors = check(&long);
    assert!(errors.iter().any(|e| e.field == "training.seq_len" && e.message.contains("activations")), "{errors:?}");
    // The batch's rows multiply by dp: fine on one replica, refused on a million.
    let mut big_batch = tiny.clone();
    (big_batch.model.hidden, big_batch.model.ffn_hidden, big_batch.training.global_batch) = (1 << 16, 1 << 16, None);
    (big_batch.model.max_seq, big_batch.training.seq_len, big_batch.training.micro_batch) = (1 << 14, Some(1 << 14), 1);
    assert!(check(&big_batch).is_empty());
    assert!(big_batch.batch(1, None, None).is_ok());
    let e = big_batch.batch(1 << 20, None, None).unwrap_err();
    assert!(e.field == "training.micro_batch" && e.message.contains(&MAX_TENSOR_ELEMENTS.to_string()), "{e}");
}
