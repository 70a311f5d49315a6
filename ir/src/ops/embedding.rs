//! `xf.embedding`: row lookup in a table.

use super::{arity, float, ids, io_bytes, rank_is, Cost, OpDef, Signature, Slot};
use crate::attrs::Attrs;
use crate::types::TensorTy;

/// `out[..., :] = table[ids[...], :]`: token embedding lookup. `table` is `[vocab, hidden]`,
/// `ids` holds i32 row indices of any shape; the result appends the hidden dimension.
#[derive(Debug)]
pub struct Embedding;

impl OpDef for Embedding {
    fn mnemonic(&self) -> &'static str {
        "embedding"
    }
    fn summary(&self) -> &'static str {
        "row lookup: out[..., :] = table[ids[...], :]"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "table", constraint: "W" }, Slot { name: "ids", constraint: "I" }],
            results: &[Slot { name: "out", constraint: "O" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        let (table, index) = (inputs[0], inputs[1]);
        float("table", table)?;
        rank_is("table", table, 2)?;
        ids("ids", index)?;
        let mut shape = index.shape.clone();
        shape.push(table.shape[1]);
        Ok(vec![TensorTy::new(shape, table.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        // A gather reads only the rows it copies, not the whole table.
        let out = outputs.iter().map(|t| t.bytes() as f64).sum::<f64>();
        Cost { flops: 0.0, bytes: 2.0 * out + io_bytes(&inputs[1..], &[]) }
    }
}
