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
