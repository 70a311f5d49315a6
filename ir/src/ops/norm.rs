//! Normalisations over the last dimension: `xf.layernorm` and `xf.rmsnorm`.

use super::{arity, float, rank_at_least, AttrKind, OpDef, Signature, Slot};
use crate::attrs::Attrs;
use crate::types::TensorTy;

/// Checks that a per-feature parameter (`gamma`, `beta`) is a vector of the last dimension.
fn feature_vector(what: &str, x: &TensorTy, p: &TensorTy) -> Result<(), String> {
    float(what, p)?;
    if p.shape.len() == 1 && Some(p.shape[0]) == x.last_dim() && p.dtype == x.dtype {
        Ok(())
    } else {
        Err(format!("{what} {p} must be a vector of the last dimension of x {x}"))
    }
}

/// Checks the `epsilon` attribute.
fn epsilon(attrs: &Attrs) -> Result<(), String> {
    let eps = attrs.float("epsilon")?;
    if eps > 0.0 && eps.is_finite() { Ok(()) } else { Err(format!("epsilon must be positive, got {eps}")) }
}

/// `y = (x - mean) / sqrt(var + epsilon) * gamma + beta` over the last dimension
/// (biased variance, as in PyTorch).
#[derive(Debug)]
pub struct LayerNorm;

impl OpDef for LayerNorm {
    fn mnemonic(&self) -> &'static str {
        "layernorm"
    }
    fn summary(&self) -> &'static str {
        "(x - mean) / sqrt(var + epsilon) * gamma + beta over the last dim"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[
                Slot { name: "x", constraint: "T" },
                Slot { name: "gamma", constraint: "P" },
                Slot { name: "beta", constraint: "P" },
            ],
            results: &[Slot { name: "y", constraint: "T" }],
            attrs: &[("epsilon", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 3)?;
        float("x", inputs[0])?;
        rank_at_least("x", inputs[0], 1)?;
        feature_vector("gamma", inputs[0], inputs[1])?;
        feature_vector("beta", inputs[0], inputs[2])?;
        epsilon(attrs)?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        // mean, centre, square, variance sum, normalise, scale, shift (+ the row's rsqrt).
        8.0
    }
}

/// `y = x / sqrt(mean(x^2) + epsilon) * gamma` over the last dimension (Llama's norm).
#[derive(Debug)]
pub struct RmsNorm;

impl OpDef for RmsNorm {
    fn mnemonic(&self) -> &'static str {
        "rmsnorm"
    }
    fn summary(&self) -> &'static str {
        "x / sqrt(mean(x^2) + epsilon) * gamma over the last dim"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "x", constraint: "T" }, Slot { name: "gamma", constraint: "P" }],
            results: &[Slot { name: "y", constraint: "T" }],
            attrs: &[("epsilon", AttrKind::Float)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        float("x", inputs[0])?;
        rank_at_least("x", inputs[0], 1)?;
        feature_vector("gamma", inputs[0], inputs[1])?;
        epsilon(attrs)?;
        Ok(vec![inputs[0].clone()])
    }
    fn flops_per_element(&self) -> f64 {
        5.0
    }
}
