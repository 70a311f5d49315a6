//! The MLIR side of `ir`: one context wrapper that loads our IRDL dialect next to upstream's
//! dialects, emission of a [`crate::graph::Module`] as a real MLIR module, its verification
//! and printing. This is the only module of the workspace that touches melior.

mod context;
mod emit;
mod irdl;

pub use context::{Diag, IrContext};
pub use emit::{emit, print_module, MlirModule, PrintStyle};
pub use irdl::{irdl_source, XF_IRDL};
