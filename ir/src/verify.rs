//! Structural checks that MLIR's verifier cannot make for IRDL ops: SSA well-formedness and
//! every `xf` op's shape rule. Run after every pass; a failure after a pass is a bug in that
//! pass, a failure on imported IR is the input's fault.

use crate::graph::{Func, Module, Value};
use crate::ops;
use crate::types::TensorTy;

/// One structural problem, located by function and op location name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("@{func}: {loc}: {message}")]
pub struct VerifyError {
    /// Function name.
    pub func: String,
    /// Location name of the offending op (or `return`).
    pub loc: String,
    /// What is wrong.
    pub message: String,
}

/// Checks every function of `module`; returns every problem found, not only the first.
pub fn verify_module(module: &Module) -> Vec<VerifyError> {
    module.funcs.iter().flat_map(verify_func).collect()
}

/// Checks one function.
pub fn verify_func(func: &Func) -> Vec<VerifyError> {
    let mut errors = Vec::new();
    let mut error = |loc: &str, message: String| {
        errors.push(VerifyError { func: func.name.clone(), loc: loc.to_string(), message });
    };
    let mut defined = vec![false; func.types.len()];
    fn define(defined: &mut [bool], v: Value, loc: &str, error: &mut dyn FnMut(&str, String)) {
        match defined.get_mut(v.0 as usize) {
            Some(slot) if !*slot => *slot = true,
            Some(_) => error(loc, format!("value {v} is defined twice")),
            None => error(loc, format!("value {v} has no type")),
        }
    }
    for arg in &func.args {
        define(&mut defined, arg.value, &arg.name, &mut error);
    }
    for op in &func.ops {
        for v in &op.operands {
            if !defined.get(v.0 as usize).copied().unwrap_or(false) {
                error(&op.loc, format!("`{}` uses {v} before it is defined", op.name));
            }
        }
        for v in &op.results {
            define(&mut defined, *v, &op.loc, &mut error);
        }
        if op.name.starts_with("xf.") {
            check_shape_rule(func, op, &mut error);
        }
    }
    for v in &func.returns {
        if !defined.get(v.0 as usize).copied().unwrap_or(false) {
            error("return", format!("returns undefined value {v}"));
        }
    }
    errors
}

/// Re-infers an `xf` op's result types and compares them with the ones it carries.
fn check_shape_rule(func: &Func, op: &crate::graph::Op, error: &mut impl FnMut(&str, String)) {
    let Some(def) = ops::lookup(&op.name) else {
        return error(&op.loc, format!("`{}` is not a registered xf op", op.name));
    };
    let inputs: Option<Vec<&TensorTy>> = op.operands.iter().map(|v| func.tensor(*v)).collect();
    let Some(inputs) = inputs else {
        return error(&op.loc, format!("`{}` has a non-tensor operand", op.name));
    };
    match def.infer(&inputs, &op.attrs) {
        Err(reason) => error(&op.loc, format!("`{}`: {reason}", op.name)),
        Ok(expected) => {
            let actual: Vec<Option<&TensorTy>> = op.results.iter().map(|v| func.tensor(*v)).collect();
            let expected_refs: Vec<Option<&TensorTy>> = expected.iter().map(Some).collect();
            if actual != expected_refs {
                let show = |ts: &[Option<&TensorTy>]| {
                    ts.iter().map(|t| t.map_or("?".to_string(), |t| t.to_string())).collect::<Vec<_>>().join(", ")
                };
                error(&op.loc, format!("`{}` results are ({}) but its shape rule gives ({})", op.name, show(&actual), show(&expected_refs)));
            }
        }
    }
}
