//! `overlap-collectives`: a collective that has independent compute to hide behind runs
//! asynchronously, as Megatron's tensor-parallel layers overlap a data gradient's
//! all-reduce (or, with sequence parallelism, reduce-scatter) with the weight gradient's
//! GEMM.
//!
//! Input: a partitioned training step without pipeline stages, after `bucket-gradients`.
//! Each synchronous sum all-reduce, reduce-scatter, or all-gather of contiguous blocks
//! (gathered along its first dimension of more than one element) first moves up to just
//! after the op that makes its operand: nothing between them reads its result, and what
//! stood between now runs while it is on the wire. If any compute op then lies between it
//! and its first reader (or the next collective over the same axes, which its
//! communicator's stream runs after it anyway: one in flight per communicator), it is marked
//! `xf.async` as a bucket of its own (`xf.bucket`, `xf.bucket_members = 1`) and its readers
//! read an `xf.wait` placed just before that point.
//! Backends run it on its communicator's stream (a reduce-scatter along an inner dimension
//! stages its blocks in a buffer of its own) and join it at the wait; the CPU backend on its
//! communication thread. A gather along an inner dimension would need its blocks rearranged
//! after the wait, so it stays synchronous.

use std::collections::HashMap;

use shardc_ir::{AttrValue, Attrs, Func, Module, Op, Value};

use crate::{Changed, Pass, PassError};

/// The `overlap-collectives` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct OverlapCollectives;

/// Whether `op` is a collective this pass may make asynchronous.
fn candidate(func: &Func, op: &Op) -> bool {
    if op.attrs.get("xf.async").is_some() || op.operands.len() != 1 || op.results.len() != 1 {
        return false;
    }
    let Some(t) = func.tensor(op.operands[0]) else { return false };
    if t.dtype == shardc_ir::DType::I32 {
        return false;
    }
    let sum = match op.attrs.get("reduction") {
        None => true,
        Some(AttrValue::Raw(r)) => r.contains("sum"),
        Some(_) => false,
    };
    match op.name.as_str() {
        "shard.all_reduce" | "shard.reduce_scatter" => sum,
        "shard.all_gather" => {
            let axis = match op.attrs.get("gather_axis") {
                Some(AttrValue::Raw(a)) => a.split(':').next().and_then(|n| n.trim().parse::<usize>().ok()),
                Some(AttrValue::Int(a)) => usize::try_from(*a).ok(),
                _ => None,
            };
            axis.is_some_and(|a| a <= t.shape.len() && t.shape[..a].iter().all(|&d| d == 1))
        }
        _ => false,
    }
}

/// Whether `op` is work a collective can hide behind.
fn computes(op: &Op) -> bool {
    op.name.starts_with("xf.") && op.name != "xf.wait"
}

impl Pass for OverlapCollectives {
    fn name(&self) -> &'static str {
        "overlap-collectives"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let Some(func) = module.funcs.iter_mut().find(|f| f.name == "train_step") else {
            return Ok(Changed::No);
        };
        // Move each candidate up to just after the op that makes its operand. One whose
        // result only the step returns (the loss, for the report) stays: nothing waits on it
        // but the step's end, and its result would live through the step in the arena.
        let read: std::collections::HashSet<Value> = func.ops.iter().flat_map(|o| o.operands.iter().copied()).collect();
        let candidate = |func: &Func, op: &Op| candidate(func, op) && read.contains(&op.results[0]);
        let mut ops: Vec<Op> = Vec::with_capacity(func.ops.len());
        let mut hoisted = false;
        for op in std::mem::take(&mut func.ops) {
            if candidate(func, &op) {
                let operand = op.operands[0];
                if let Some(maker) = ops.iter().rposition(|o| o.results.contains(&operand)) {
                    // After the maker and any collective already moved there (their order kept).
                    let mut at = maker + 1;
                    while at < ops.len() && candidate_or_moved(&ops[at], operand) {
                        at += 1;
                    }
                    if at < ops.len() {
                        hoisted = true;
                    }
                    ops.insert(at, op);
                    continue;
                }
            }
            ops.push(op);
        }
        // Then mark those with compute before their first reader.
        let mut next_bucket = ops.iter().filter_map(|o| match o.attrs.get("xf.bucket") { Some(AttrValue::Int(b)) => Some(*b + 1), _ => None }).max().unwrap_or(0).max(1 << 21);
        let mut waits: HashMap<usize, Vec<Op>> = HashMap::new();
        let mut waited: HashMap<Value, Value> = HashMap::new();
        let mut at_end = Vec::new();
        for i in 0..ops.len() {
            if !candidate(func, &ops[i]) {
                continue;
            }
            let result = ops[i].results[0];
            // Waited for before its first reader, or before the next collective over the same
            // axes (which its communicator's stream would run after it anyway): one in flight
            // per communicator, so what it holds (a scatter's whole input) is not held long.
            let axes = ops[i].attrs.get("grid_axes").cloned();
            let first_reader = (i + 1..ops.len()).find(|&j| ops[j].operands.contains(&result) || (ops[j].name.starts_with("shard.") && ops[j].attrs.get("grid_axes").cloned() == axes));
            let window = &ops[i + 1..first_reader.unwrap_or(ops.len())];
            if !window.iter().any(computes) {
                continue;
            }
            let bucket = next_bucket;
            next_bucket += 1;
            let op = &mut ops[i];
            op.attrs = std::mem::take(&mut op.attrs).with("xf.async", AttrValue::Bool(true)).with("xf.bucket", AttrValue::Int(bucket)).with("xf.bucket_members", AttrValue::Int(1));
            func.types.push(func.types[result.0 as usize].clone());
            let wait = Value(func.types.len() as u32 - 1);
            let wait_op = Op { name: "xf.wait".into(), operands: vec![result], results: vec![wait], attrs: Attrs::new().with("xf.bucket", AttrValue::Int(bucket)), loc: format!("{}.wait", op.loc) };
            match first_reader {
                Some(j) => waits.entry(j).or_default().push(wait_op),
                None => at_end.push(wait_op),
            }
            waited.insert(result, wait);
        }
        if waited.is_empty() && !hoisted {
            func.ops = ops;
            return Ok(Changed::No);
        }
        let mut placed = Vec::with_capacity(ops.len() + waited.len());
        for (j, mut op) in ops.into_iter().enumerate() {
            placed.extend(waits.remove(&j).unwrap_or_default());
            for operand in &mut op.operands {
                if let Some(w) = waited.get(operand) {
                    *operand = *w;
                }
            }
            placed.push(op);
        }
        placed.extend(at_end);
        for v in &mut func.returns {
            if let Some(w) = waited.get(v) {
                *v = *w;
            }
        }
        func.ops = placed;
        Ok(Changed::Yes)
    }
}

/// Whether `op` is a collective reading `operand` (one moved up behind its maker before).
fn candidate_or_moved(op: &Op, operand: Value) -> bool {
    op.name.starts_with("shard.") && op.operands.first() == Some(&operand)
}
