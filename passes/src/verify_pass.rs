//! `verify`: checks the module without changing it.
//!
//! Input: any module. Output: the same module. It fails with every structural problem when an
//! op breaks its shape rule or the function is not in SSA form; the pipeline's MLIR verifier
//! runs after it as after every pass. It is the first pass so that IR read from outside
//! (a spec's lowering today, a `.mlir` file later) is checked before any rewrite.

use shardc_ir::{verify, IrError, Module};

use crate::{Changed, Pass, PassError};

/// The `verify` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct VerifyShapes;

impl Pass for VerifyShapes {
    fn name(&self) -> &'static str {
        "verify"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let problems = verify::verify_module(module);
        if problems.is_empty() {
            Ok(Changed::No)
        } else {
            Err(PassError::User { pass: self.name().into(), message: IrError::Verify(problems).to_string() })
        }
    }
}
