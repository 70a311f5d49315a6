//! The `xf` dialect in IRDL, generated from the op registry.
//!
//! `ir/dialect/xf.irdl.mlir` is checked in so that `mlir-opt-22 --irdl-file=...` can verify our
//! dumps without shardc; it is produced by [`irdl_source`], and a test fails when the two
//! differ (run `SHARDC_BLESS=1 cargo test` to rewrite it). Adding an op therefore never means
//! editing the dialect file by hand.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use crate::ops::{AttrKind, REGISTRY};

/// The checked-in dialect definition, loaded into every [`super::IrContext`].
pub const XF_IRDL: &str = include_str!("../../dialect/xf.irdl.mlir");

/// Generates the IRDL definition of `xf` from the op registry.
pub fn irdl_source() -> String {
    let mut out = String::new();
    out.push_str("// The xf dialect: shardc's transformer ops, in IRDL.\n");
    out.push_str("// Generated from the op registry (ir/src/ops) by `shardc dialect`; do not edit.\n");
    out.push_str("// IRDL checks operand kinds and equal-type constraints; shape rules live in Rust.\n");
    out.push_str("irdl.dialect @xf {\n");
    for op in REGISTRY {
        let sig = op.signature();
        let _ = writeln!(out, "  // xf.{}: {}", op.mnemonic(), op.summary());
        let _ = writeln!(out, "  irdl.operation @{} {{", op.mnemonic());
        // One constraint variable per distinct name: slots sharing one must have equal types.
        let mut seen = BTreeSet::new();
        for slot in sig.operands.iter().chain(sig.results) {
            if seen.insert(slot.constraint) {
                let _ = writeln!(out, "    %{} = irdl.base \"!builtin.tensor\"", slot.constraint);
            }
        }
        // Each attribute gets its own variable: IRDL binds a variable to one value, so a
        // shared one would force all attributes of a kind to be equal.
        for (name, kind) in sig.attrs {
            let base = match kind {
                AttrKind::Float => "#builtin.float",
                AttrKind::Type => "#builtin.type",
                AttrKind::Int | AttrKind::Bool => "#builtin.integer",
            };
            let _ = writeln!(out, "    %{name} = irdl.base \"{base}\"");
        }
        if !sig.attrs.is_empty() {
            let attrs: Vec<String> = sig.attrs.iter().map(|(name, _)| format!("\"{name}\" = %{name}")).collect();
            let _ = writeln!(out, "    irdl.attributes {{{}}}", attrs.join(", "));
        }
        let slots = |slots: &[crate::ops::Slot]| {
            slots.iter().map(|s| format!("{}: %{}", s.name, s.constraint)).collect::<Vec<_>>().join(", ")
        };
        let _ = writeln!(out, "    irdl.operands({})", slots(sig.operands));
        let _ = writeln!(out, "    irdl.results({})", slots(sig.results));
        out.push_str("  }\n");
    }
    out.push_str("}\n");
    out
}
