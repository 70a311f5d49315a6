//! Integration tests of the `ir` crate, in one binary: every melior-linked test binary costs
//! ~245 MB of disk and a long link.

mod cluster;
mod dialect;
mod lowering;
mod mlir_opt;
mod no_panic;
mod ops;
mod spec_errors;

use std::path::PathBuf;

/// The workspace root (models/ lives there).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("ir/ has a parent").to_path_buf()
}

/// Parses a shipped model spec.
pub fn shipped_spec(name: &str) -> shardc_ir::spec::Spec {
    let path = workspace_root().join("models").join(format!("{name}.toml"));
    shardc_ir::spec::parse_file(&path).unwrap_or_else(|e| panic!("{e}"))
}

/// Lowers a spec for one device (its micro-batch rows, its vocabulary padded for tp = 1).
pub fn lower_one(spec: &shardc_ir::spec::Spec) -> Result<shardc_ir::Module, shardc_ir::spec::LowerError> {
    shardc_ir::spec::lower(spec, spec.step_shape(&shardc_ir::mesh::Mesh::default()))
}
