//! Errors of the `ir` crate.

use crate::mlir::Diag;

/// An error from MLIR or from our IR's structural checks.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum IrError {
    /// MLIR refused something; `diags` holds what it said.
    #[error("MLIR failed {what}{}", render_diags(.diags))]
    Mlir {
        /// What we were doing.
        what: String,
        /// MLIR's diagnostics.
        diags: Vec<Diag>,
    },
    /// The structural verifier found problems.
    #[error("{} structural error(s):\n  {}", .0.len(), .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
    Verify(Vec<crate::verify::VerifyError>),
    /// An op could not be built.
    #[error(transparent)]
    Build(#[from] crate::graph::BuildError),
}

fn render_diags(diags: &[Diag]) -> String {
    diags.iter().map(|d| format!("\n  {d}")).collect()
}
