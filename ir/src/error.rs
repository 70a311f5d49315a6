//! Errors of the `ir` crate.

/// One MLIR diagnostic, copied out of MLIR.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diag {
    /// Where MLIR located it (`loc("layers.0.attn.q")`, or a file position).
    pub loc: String,
    /// The message.
    pub message: String,
}

impl std::fmt::Display for Diag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.loc, self.message)
    }
}

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
