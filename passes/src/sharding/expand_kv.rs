//! `expand-kv-heads`: lines grouped key/value heads up with the query heads when tensor
//! parallelism cannot split the key/value heads themselves.
//!
//! Input: `@forward` whose `xf.attention` ops have `kv_heads` that `tp` does not divide
//! (tiny Llama's 2 kv heads at tp=4). Output: each such attention reads
//! `xf.repeat_heads(k)` and `xf.repeat_heads(v)` (`times` = query heads / kv heads), so all
//! three operands have the query head count and split over `tp` alike; the key/value
//! projections stay replicated, as Megatron does. Runs before autodiff, which differentiates
//! the repeat as a `sum_heads`. The function computes the same values.

use shardc_ir::{AttrValue, Attrs, Module, Op, TensorTy, Type, Value};

use crate::{Changed, Pass, PassError};

/// The `expand-kv-heads` pass.
#[derive(Clone, Copy, Debug)]
pub struct ExpandKvHeads {
    /// Tensor-parallel degree.
    pub tp: i64,
}

impl Pass for ExpandKvHeads {
    fn name(&self) -> &'static str {
        "expand-kv-heads"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let Some(func) = module.funcs.iter_mut().find(|f| f.name == "forward" || f.name == "logits") else {
            return Ok(Changed::No);
        };
        let mut changed = Changed::No;
        let mut i = 0;
        while i < func.ops.len() {
            let op = func.ops[i].clone();
            // Heads are whole `head_dim`s of the features, `[b, s, heads * head_dim]`.
            let head_dim = op.attrs.int("head_dim").unwrap_or(0);
            let heads = |v: Option<&Value>| v.and_then(|v| func.tensor(*v)).and_then(|t| t.shape.get(2).copied()).filter(|_| head_dim > 0).map(|width| width / head_dim);
            let (Some(hq), Some(hk)) = (heads(op.operands.first()), heads(op.operands.get(1))) else {
                i += 1;
                continue;
            };
            if op.name != "xf.attention" || hk == 0 || hk % self.tp == 0 || hq == hk {
                i += 1;
                continue;
            }
            let times = hq / hk;
            let mut inserted = 0;
            for (slot, what) in [(1, "k"), (2, "v")] {
                let source = func.ops[i + inserted].operands[slot];
                let t = func.tensor(source).cloned().ok_or_else(|| PassError::User {
                    pass: "expand-kv-heads".into(),
                    message: format!("{}: the {what} operand of the attention is not a tensor", op.loc),
                })?;
                let repeated = TensorTy::new([t.shape[0], t.shape[1], hq * head_dim], t.dtype);
                func.types.push(Type::Tensor(repeated));
                let value = Value(func.types.len() as u32 - 1);
                let loc = format!("{}.{what}.repeat", op.loc.trim_end_matches(".core"));
                let repeat = Op {
                    name: "xf.repeat_heads".into(),
                    operands: vec![source],
                    results: vec![value],
                    attrs: Attrs::new().with("times", AttrValue::Int(times)).with("head_dim", AttrValue::Int(head_dim)),
                    loc,
                    origin: op.origin,
                };
                func.ops.insert(i + inserted, repeat);
                inserted += 1;
                func.ops[i + inserted].operands[slot] = value;
            }
            changed = Changed::Yes;
            i += inserted + 1;
        }
        Ok(changed)
    }
}
