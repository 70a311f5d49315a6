//! `bucket-gradients`: data-parallel gradient synchronisation in buckets, asynchronously.
//!
//! Input: a partitioned training step. Output: every all-reduce over `dp` alone whose result
//! an optimizer update reads (a gradient's data-parallel sum) is marked `xf.async`, with
//! `xf.bucket` = its bucket and `xf.bucket_members` = the bucket's size. Buckets fill in the
//! order the gradients become ready, up to `bucket_bytes` each, so a bucket can be sent the
//! moment its last gradient exists while the backward pass goes on. Each update then reads
//! `xf.wait` of its gradient, and the waits and updates move to the end of the step, as in
//! PyTorch's DDP (the gradients stay alive until then). Backends send a bucket as one
//! collective over the concatenated gradients.

use std::collections::HashMap;

use shardc_ir::{AttrValue, Attrs, Module, Op, Value};

use crate::{Changed, Pass, PassError};

/// The `bucket-gradients` pass.
#[derive(Clone, Copy, Debug)]
pub struct BucketGradients {
    /// Largest bucket, in bytes.
    pub bucket_bytes: u64,
}

impl Pass for BucketGradients {
    fn name(&self) -> &'static str {
        "bucket-gradients"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let Some(func) = module.funcs.iter_mut().find(|f| f.name == "train_step") else {
            return Ok(Changed::No);
        };
        let is_update = |op: &Op| op.name == "xf.adamw" || op.name == "xf.sgd";
        // Gradient syncs: dp-only all-reduces whose result is an update's gradient.
        let grad_of_update: std::collections::HashSet<Value> = func.ops.iter().filter(|o| is_update(o)).map(|o| o.operands[1]).collect();
        let syncs: Vec<usize> = (0..func.ops.len())
            .filter(|&i| {
                let op = &func.ops[i];
                op.name == "shard.all_reduce"
                    && op.attrs.get("xf.async").is_none()
                    && matches!(op.attrs.get("grid_axes"), Some(AttrValue::Raw(a)) if a == "array<i16: 0>")
                    && grad_of_update.contains(&op.results[0])
            })
            .collect();
        if syncs.is_empty() {
            return Ok(Changed::No);
        }
        // Fill buckets in program order (the order gradients become ready).
        let mut bucket_of: Vec<(usize, usize)> = Vec::new();
        let (mut bucket, mut filled) = (0usize, 0u64);
        for &i in &syncs {
            let bytes = func.tensor(func.ops[i].results[0]).map_or(0, |t| t.bytes());
            if filled > 0 && filled + bytes > self.bucket_bytes {
                bucket += 1;
                filled = 0;
            }
            filled += bytes;
            bucket_of.push((i, bucket));
        }
        let mut members: HashMap<usize, i64> = HashMap::new();
        for (_, b) in &bucket_of {
            *members.entry(*b).or_insert(0) += 1;
        }
        let mut waited: HashMap<Value, Value> = HashMap::new();
        let mut waits = Vec::new();
        for (i, b) in &bucket_of {
            let op = &mut func.ops[*i];
            op.attrs = std::mem::take(&mut op.attrs)
                .with("xf.async", AttrValue::Bool(true))
                .with("xf.bucket", AttrValue::Int(*b as i64))
                .with("xf.bucket_members", AttrValue::Int(members[b]));
            let (value, loc) = (op.results[0], op.loc.clone());
            func.types.push(func.types[value.0 as usize].clone());
            let wait = Value(func.types.len() as u32 - 1);
            let attrs = Attrs::new().with("xf.bucket", AttrValue::Int(*b as i64));
            waits.push(Op { name: "xf.wait".into(), operands: vec![value], results: vec![wait], attrs, loc: format!("{loc}.wait") });
            waited.insert(value, wait);
        }
        // Waits, then what reads the synced gradients (the updates, the global norm's sums
        // of squares) and whatever reads those (a ZeRO gather of the updated shard), at the
        // end of the step, in their order: nothing reads a gradient before its wait.
        let mut moved_values: std::collections::HashSet<Value> = std::collections::HashSet::new();
        let (mut updates, rest): (Vec<Op>, Vec<Op>) = func.ops.drain(..).partition(|op| {
            let moved = op.operands.iter().any(|v| waited.contains_key(v) || moved_values.contains(v));
            if moved {
                moved_values.extend(op.results.iter().copied());
            }
            moved
        });
        for op in &mut updates {
            for operand in &mut op.operands {
                if let Some(w) = waited.get(operand) {
                    *operand = *w;
                }
            }
        }
        func.ops = rest;
        func.ops.extend(waits);
        func.ops.extend(updates);
        Ok(Changed::Yes)
    }
}
