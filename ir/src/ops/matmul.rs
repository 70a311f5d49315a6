//! `xf.matmul`: batched matrix product with optional transposes.

use super::{arity, float, io_bytes, rank_at_least, same_dtype, AttrKind, Cost, OpDef, Signature, Slot};
use crate::attrs::Attrs;
use crate::types::TensorTy;

/// `out[..., m, n] = sum_k lhs[..., m, k] * rhs[..., k, n]`.
///
/// `lhs` has rank >= 2; its leading dimensions are batch dimensions. `rhs` is either a
/// matrix (shared across the batch: a linear layer's weight, stored `[in, out]`) or has the
/// same batch dimensions as `lhs`. `transpose_lhs`/`transpose_rhs` swap the last two
/// dimensions of an operand before the product (the tied LM head reads the `[vocab, hidden]`
/// embedding table with `transpose_rhs`).
#[derive(Debug)]
pub struct MatMul;

/// The dimensions of one matmul instance, after transposes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatMulDims {
    /// Leading (batch) dimensions of the output.
    pub batch: Vec<i64>,
    /// Rows of the output.
    pub m: i64,
    /// Contracted dimension.
    pub k: i64,
    /// Columns of the output.
    pub n: i64,
}

impl MatMul {
    /// Checks operands and returns the product's dimensions.
    pub fn dims(lhs: &TensorTy, rhs: &TensorTy, attrs: &Attrs) -> Result<MatMulDims, String> {
        float("lhs", lhs)?;
        float("rhs", rhs)?;
        same_dtype(lhs, rhs)?;
        rank_at_least("lhs", lhs, 2)?;
        rank_at_least("rhs", rhs, 2)?;
        let last2 = |t: &TensorTy, transpose: bool| {
            let (a, b) = (t.shape[t.rank() - 2], t.shape[t.rank() - 1]);
            if transpose { (b, a) } else { (a, b) }
        };
        let (m, k) = last2(lhs, attrs.bool("transpose_lhs")?);
        let (k_rhs, n) = last2(rhs, attrs.bool("transpose_rhs")?);
        if k != k_rhs {
            return Err(format!("contracted dimensions differ: lhs {lhs} has {k}, rhs {rhs} has {k_rhs}"));
        }
        let batch = lhs.shape[..lhs.rank() - 2].to_vec();
        if rhs.rank() > 2 && rhs.shape[..rhs.rank() - 2] != batch[..] {
            return Err(format!("rhs {rhs} must be a matrix or have the batch dimensions of lhs {lhs}"));
        }
        Ok(MatMulDims { batch, m, k, n })
    }
}

impl OpDef for MatMul {
    fn mnemonic(&self) -> &'static str {
        "matmul"
    }
    fn summary(&self) -> &'static str {
        "batched matrix product lhs[..., m, k] x rhs[(...), k, n], optional transposes"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "lhs", constraint: "A" }, Slot { name: "rhs", constraint: "B" }],
            results: &[Slot { name: "out", constraint: "C" }],
            attrs: &[("transpose_lhs", AttrKind::Bool), ("transpose_rhs", AttrKind::Bool)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        let dims = MatMul::dims(inputs[0], inputs[1], attrs)?;
        let mut shape = dims.batch;
        shape.extend([dims.m, dims.n]);
        Ok(vec![TensorTy::new(shape, inputs[0].dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], attrs: &Attrs) -> Cost {
        // 2*m*k*n per batch element (one multiply and one add per term).
        let flops = MatMul::dims(inputs[0], inputs[1], attrs)
            .map(|d| 2.0 * d.batch.iter().map(|&b| b as f64).product::<f64>() * (d.m * d.k) as f64 * d.n as f64)
            .unwrap_or(0.0);
        Cost { flops, bytes: io_bytes(inputs, outputs) }
    }
}
