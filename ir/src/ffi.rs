//! The one place in the workspace that calls MLIR's C API directly, for what melior 0.27 does
//! not wrap. Each function is a thin, safe wrapper.
#![allow(unsafe_code)]

use melior::ir::operation::OperationPrintingFlags;

/// Makes the printer name SSA values after their name locations (`%layers.0.attn.q = ...`)
/// instead of numbering them, so a dump reads like the model.
pub fn print_name_loc_as_prefix(flags: OperationPrintingFlags) -> OperationPrintingFlags {
    // SAFETY: `flags` owns a live MlirOpPrintingFlags (created by melior, destroyed on drop);
    // the call only sets a flag on it.
    unsafe { mlir_sys::mlirOpPrintingFlagsPrintNameLocAsPrefix(flags.to_raw()) };
    flags
}
