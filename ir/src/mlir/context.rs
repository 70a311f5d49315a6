//! [`IrContext`]: an MLIR context with every upstream dialect (the `shard` dialect's sharding
//! models are only registered by `register_all_dialects`) plus `xf`, loaded from the checked-in
//! IRDL file. Diagnostics are captured as owned [`Diag`]s instead of going to stderr.

use std::cell::RefCell;
use std::rc::Rc;

use melior::dialect::DialectRegistry;
use melior::diagnostic::Diagnostic;
use melior::ir::Module;
use melior::utility::{load_irdl_dialects, register_all_dialects};
use melior::Context;

use super::irdl::XF_IRDL;
use crate::IrError;

pub use crate::error::Diag;

/// A copy of an MLIR diagnostic.
fn diag_from_mlir(d: &Diagnostic) -> Diag {
    let mut message = d.to_string();
    for i in 0..d.note_count() {
        if let Ok(note) = d.note(i) {
            message.push_str(&format!("\n  note: {note}"));
        }
    }
    Diag { loc: d.location().to_string(), message }
}

/// An MLIR context ready for shardc's IR. Owns the context; modules borrow it.
pub struct IrContext {
    context: Context,
    // Kept alive for the context's lifetime, as the registry's extensions are referenced.
    _registry: DialectRegistry,
}

impl std::fmt::Debug for IrContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IrContext").finish_non_exhaustive()
    }
}

impl IrContext {
    /// Creates a context with upstream dialects and `xf` loaded.
    pub fn new() -> Result<IrContext, IrError> {
        let registry = DialectRegistry::new();
        register_all_dialects(&registry);
        let context = Context::new();
        context.append_dialect_registry(&registry);
        context.load_all_available_dialects();
        let cx = IrContext { context, _registry: registry };
        let (loaded, diags) = cx.collect(|| {
            // Loading a dialect twice into one context crashes MLIR; a fresh context has none.
            let module = Module::parse(&cx.context, XF_IRDL)?;
            Some(load_irdl_dialects(&module))
        });
        if loaded != Some(true) {
            return Err(IrError::Mlir { what: "loading the xf IRDL dialect".into(), diags });
        }
        Ok(cx)
    }

    /// The underlying melior context.
    pub fn mlir(&self) -> &Context {
        &self.context
    }

    /// Runs `f` and returns what it returned together with every diagnostic MLIR emitted
    /// meanwhile (which then does not reach stderr).
    pub fn collect<T>(&self, f: impl FnOnce() -> T) -> (T, Vec<Diag>) {
        let diags = Rc::new(RefCell::new(Vec::new()));
        let sink = diags.clone();
        let id = self.context.attach_diagnostic_handler(move |d| {
            sink.borrow_mut().push(diag_from_mlir(&d));
            true
        });
        let result = f();
        self.context.detach_diagnostic_handler(id);
        let diags = diags.borrow().clone();
        (result, diags)
    }
}
