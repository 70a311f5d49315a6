//! `ring-attention`: context parallelism's attention as a ring of key/value blocks.
//!
//! Input: a partitioned step whose attention reads keys and values all-gathered over the
//! `cp` axis (attention's sharding rule keeps key positions whole) and whose `dk`, `dv` are
//! reduce-scattered back. Output, for each such attention the policy picks: a ring of `cp`
//! steps, as Megatron-LM's context parallelism and ring attention (Liu et al. 2023) run it.
//! - Forward: step `t` attends from this rank's queries to the block it holds
//!   (`xf.attention_block`, the block of rank `p - t`), merges it into the running result
//!   by log-sum-exp (`xf.attention_merge`), and passes the block on to the next rank
//!   (`shard.shift ... offset = 1 rotate`), so no rank ever holds more than two blocks.
//! - Backward: the blocks go round again with their key and value gradients: step `t` adds
//!   this rank's queries' share of the block's gradients (`xf.attention_block_grad`, from the
//!   forward's output and log-sum-exp) to the sums that travel with it; a last shift brings
//!   each block's sums home. `dq` sums the steps locally.
//!
//! `Policy::Auto` prices both forms on the cluster model, per attention, and keeps the
//! cheaper: each moves `cp - 1` blocks of keys and values a way, but the ring's transfers are
//! `cp - 1` messages of one block to one neighbour, where the all-gather is one collective.

use std::collections::{HashMap, HashSet};

use shardc_ir::cluster::{Cluster, Collective};
use shardc_ir::sharding::Axis;
use shardc_ir::{AttrValue, Attrs, Func, Module, Op, TensorTy, Type, Value};

use super::CP;
use crate::{Changed, Pass, PassError};

/// Which form context parallelism's attention takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// Keys and values all-gathered over cp (Llama 3's context parallelism).
    AllGather,
    /// A ring of key/value blocks.
    Ring,
    /// The cheaper of the two on the cluster model.
    #[default]
    Auto,
}

impl Policy {
    /// Parses `auto`, `all-gather` or `ring`.
    pub fn parse(text: &str) -> Option<Policy> {
        match text {
            "auto" => Some(Policy::Auto),
            "all-gather" => Some(Policy::AllGather),
            "ring" => Some(Policy::Ring),
            _ => None,
        }
    }
}

/// The `ring-attention` pass.
#[derive(Clone, Debug, Default)]
pub struct RingAttention {
    /// Which form to take.
    pub policy: Policy,
    /// The cluster `Policy::Auto` prices on.
    pub cluster: Cluster,
    /// Whether the shifts may run asynchronously, each pair behind the attention of the
    /// block before (a step without pipeline sections: backends overlap only there).
    pub overlap: bool,
}

/// A forward attention made a ring: what its backward needs.
#[derive(Clone, Copy)]
struct Ringed {
    keys: Value,
    values: Value,
    out: Value,
    lse: Value,
}

impl Pass for RingAttention {
    fn name(&self) -> &'static str {
        "ring-attention"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let Some(grid) = module.grids.first().cloned() else { return Ok(Changed::No) };
        let parts = grid.shape.get(CP as usize).copied().unwrap_or(1);
        if parts <= 1 || self.policy == Policy::AllGather {
            return Ok(Changed::No);
        }
        let mut changed = Changed::No;
        let mut ringed = 0usize;
        for func in module.funcs.iter_mut().filter(|f| f.ops.iter().any(|o| o.name.starts_with("shard."))) {
            let (rewritten, count) = rewrite(func, &grid.name, &grid.shape, self);
            // Asked for the ring, every context-parallel attention takes it, or the step is
            // refused: an option that silently changed nothing would mislead.
            let split = func.ops.iter().filter(|o| o.name == "xf.attention" && o.attrs.axes("xf.seq_split_axes").is_ok_and(|a| a == [CP])).count();
            if self.policy == Policy::Ring && count < split {
                let missed = rewritten.ops.iter().find(|o| o.name == "xf.attention").map_or_else(String::new, |o| o.loc.clone());
                return Err(PassError::User {
                    pass: self.name().into(),
                    message: format!("@{}: `{missed}` reads keys and values that are not all-gathered over cp right before it (as the naive layout leaves them), so it cannot run as a ring; use --cp-attention all-gather or auto", func.name),
                });
            }
            if count > 0 {
                *func = rewritten;
                ringed += count;
                changed = Changed::Yes;
            }
        }
        if ringed > 0 {
            module.notes.insert(self.name().into(), format!("{ringed} attentions run as a ring over cp={parts}"));
        }
        Ok(changed)
    }
}

/// The all-gather over cp along the sequence that made `value`, if one did: its operand.
fn gathered_over_cp(func: &Func, producer: &HashMap<Value, usize>, value: Value) -> Option<Value> {
    let op = &func.ops[*producer.get(&value)?];
    let over_cp = op.attrs.axes("grid_axes").ok()? == [CP];
    (op.name == "shard.all_gather" && over_cp && op.attrs.index("gather_axis") == Ok(1)).then(|| op.operands[0])
}

/// The reduce-scatter over cp along the sequence that is `value`'s only reader, if it is.
fn scattered_over_cp(func: &Func, readers: &HashMap<Value, Vec<usize>>, value: Value) -> Option<usize> {
    let [reader] = readers.get(&value)?.as_slice() else { return None };
    let op = &func.ops[*reader];
    let over_cp = op.attrs.axes("grid_axes").ok()? == [CP];
    (op.name == "shard.reduce_scatter" && over_cp && op.attrs.index("scatter_axis") == Ok(1)).then_some(*reader)
}

/// Whether the ring is cheaper than the gathers for the attention `op` of queries `q` and
/// key blocks `block` on `cluster`: the gathers and the gradients' scatters are exposed;
/// the ring's shifts, a pair of blocks at a time, are exposed only where they outlast the
/// block attention they run behind (all of them, without `overlap`), and the last pair of
/// gradient sums going home is exposed whole.
fn ring_is_cheaper(cluster: &Cluster, grid: &[i64], op: &Op, q: &TensorTy, block: &TensorTy, overlap: bool) -> bool {
    let n = grid.get(CP as usize).copied().unwrap_or(1).max(1) as f64;
    let bytes = block.bytes() as f64;
    let axes = [CP as usize];
    let gathered = 2.0 * cluster.time(Collective::AllGather, bytes * n, grid, &axes) + 2.0 * cluster.time(Collective::ReduceScatter, bytes * n, grid, &axes);
    let pair = cluster.time(Collective::Send, 2.0 * bytes, grid, &axes);
    let Ok(stats) = shardc_ir::ops::attention_stats(&[q, block, block], &op.attrs) else { return false };
    let attrs = op.attrs.clone().with(shardc_ir::ops::RING_STEP_ATTR, AttrValue::Int(0));
    let time = |name: &str, inputs: &[&TensorTy], outputs: &[TensorTy]| shardc_ir::ops::lookup(name).map_or(0.0, |def| cluster.op_time(def, inputs, outputs, &attrs));
    let forward = time("xf.attention_block", &[q, block, block], &[q.clone(), stats.clone()]);
    let backward = time("xf.attention_block_grad", &[q, block, block, q, &stats, q], &[q.clone(), block.clone(), block.clone()]);
    let behind = |compute: f64| if overlap { (pair - compute).max(0.0) } else { pair };
    // Forward: n - 1 pairs of blocks; backward: n - 1 pairs of blocks and n of gradient
    // sums, the last of which nothing hides.
    let ring = (n - 1.0) * behind(forward) + (n - 1.0) * behind(backward) + (n - 1.0) * behind(backward) + pair;
    ring < gathered
}

fn rewrite(func: &Func, grid: &str, shape: &[i64], pass: &RingAttention) -> (Func, usize) {
    let producer: HashMap<Value, usize> = func.ops.iter().enumerate().flat_map(|(i, o)| o.results.iter().map(move |r| (*r, i))).collect();
    let mut readers: HashMap<Value, Vec<usize>> = HashMap::new();
    for (i, op) in func.ops.iter().enumerate() {
        for v in &op.operands {
            readers.entry(*v).or_default().push(i);
        }
    }
    for v in &func.returns {
        readers.entry(*v).or_default().push(usize::MAX);
    }
    let split_over_cp = |op: &Op| op.attrs.axes("xf.seq_split_axes").is_ok_and(|a| a == [CP]);
    // The forward attentions to ring, and the backward ones that read the same gathers.
    let mut forward: HashSet<usize> = HashSet::new();
    for (i, op) in func.ops.iter().enumerate().filter(|(_, o)| o.name == "xf.attention" && split_over_cp(o)) {
        let (Some(k), Some(_)) = (gathered_over_cp(func, &producer, op.operands[1]), gathered_over_cp(func, &producer, op.operands[2])) else { continue };
        let (Some(block), Some(q)) = (func.tensor(k), func.tensor(op.operands[0])) else { continue };
        if pass.policy == Policy::Ring || ring_is_cheaper(&pass.cluster, shape, op, q, block, pass.overlap) {
            forward.insert(i);
        }
    }
    let key = |op: &Op| (op.operands[0], op.operands[1], op.operands[2]);
    let forward_keys: HashSet<(Value, Value, Value)> = forward.iter().map(|&i| key(&func.ops[i])).collect();
    // Backward attentions whose dk and dv go only to their scatters: (op, dk's, dv's).
    let mut backward: HashMap<usize, (usize, usize)> = HashMap::new();
    for (i, op) in func.ops.iter().enumerate().filter(|(_, o)| o.name == "xf.attention_grad" && split_over_cp(o) && forward_keys.contains(&key(o))) {
        if let (Some(dk), Some(dv)) = (scattered_over_cp(func, &readers, op.results[1]), scattered_over_cp(func, &readers, op.results[2])) {
            backward.insert(i, (dk, dv));
        }
    }
    // A forward attention whose backward cannot take the ring (it would need the gathers
    // after all) stays as it is.
    let stuck: HashSet<(Value, Value, Value)> = func.ops.iter().enumerate().filter(|(i, o)| o.name == "xf.attention_grad" && forward_keys.contains(&key(o)) && !backward.contains_key(i)).map(|(_, o)| key(o)).collect();
    forward.retain(|&i| !stuck.contains(&key(&func.ops[i])));
    let forward_keys: HashSet<(Value, Value, Value)> = forward.iter().map(|&i| key(&func.ops[i])).collect();
    backward.retain(|&i, _| forward_keys.contains(&key(&func.ops[i])));
    if forward.is_empty() {
        return (func.clone(), 0);
    }
    let dropped: HashSet<usize> = backward.values().flat_map(|&(a, b)| [a, b]).collect();

    let mut out = func.clone();
    out.ops = Vec::with_capacity(func.ops.len() * 2);
    let mut rename: HashMap<Value, Value> = HashMap::new();
    let mut ringed: HashMap<(Value, Value, Value), Ringed> = HashMap::new();
    let parts = shape.get(CP as usize).copied().unwrap_or(1).max(1) as usize;
    // Buckets of their own, apart from those the later passes number.
    let mut next_bucket: i64 = RING_BUCKETS;
    for (i, op) in func.ops.iter().enumerate() {
        if dropped.contains(&i) {
            continue;
        }
        let mut op = op.clone();
        for v in op.operands.iter_mut() {
            if let Some(n) = rename.get(v) {
                *v = *n;
            }
        }
        let mut emit = Emitter { func: &mut out, grid, origin: op.clone(), overlap: pass.overlap, bucket: &mut next_bucket };
        if forward.contains(&i) {
            let original = &func.ops[i];
            let (q, keys, values) = (op.operands[0], gathered_over_cp(func, &producer, original.operands[1]).unwrap_or(op.operands[1]), gathered_over_cp(func, &producer, original.operands[2]).unwrap_or(op.operands[2]));
            let (o, lse) = emit.ring_forward(q, keys, values, parts);
            rename.insert(op.results[0], o);
            rename.insert(op.results[1], lse);
            ringed.insert(key(original), Ringed { keys, values, out: o, lse });
            continue;
        }
        if let Some(&(dk_scatter, dv_scatter)) = backward.get(&i) {
            let original = &func.ops[i];
            if let Some(ring) = ringed.get(&key(original)).copied() {
                let (dq, dk, dv) = emit.ring_backward(op.operands[0], ring, op.operands[5], parts);
                rename.insert(op.results[0], dq);
                rename.insert(func.ops[dk_scatter].results[0], dk);
                rename.insert(func.ops[dv_scatter].results[0], dv);
                continue;
            }
        }
        out.ops.push(op);
    }
    for v in out.returns.iter_mut() {
        if let Some(n) = rename.get(v) {
            *v = *n;
        }
    }
    // The gathers the rings replaced are read no more.
    loop {
        let read: HashSet<Value> = out.ops.iter().flat_map(|o| o.operands.iter().copied()).chain(out.returns.iter().copied()).collect();
        let before = out.ops.len();
        out.ops.retain(|o| o.name != "shard.all_gather" || o.results.iter().any(|r| read.contains(r)));
        if out.ops.len() == before {
            break;
        }
    }
    (out, forward.len())
}

/// The first bucket number of the ring's asynchronous shifts.
const RING_BUCKETS: i64 = 1 << 22;

/// Appends the ring's ops to a function, placed as the op they replace.
struct Emitter<'f> {
    func: &'f mut Func,
    grid: &'f str,
    origin: Op,
    /// Whether shifts go asynchronously, in pairs, waited for where they are read.
    overlap: bool,
    bucket: &'f mut i64,
}

/// A pair of shifts on the wire: their results, and the bucket they are waited for by.
struct Shifted {
    values: [Value; 2],
    bucket: Option<i64>,
}

impl Emitter<'_> {
    fn fresh(&mut self, ty: Type) -> Value {
        let v = Value(self.func.types.len() as u32);
        self.func.types.push(ty);
        v
    }

    fn push(&mut self, name: &str, operands: &[Value], attrs: Attrs, types: Vec<Type>, loc: &str) -> Vec<Value> {
        let results: Vec<Value> = types.into_iter().map(|t| self.fresh(t)).collect();
        self.func.ops.push(Op { name: name.into(), operands: operands.to_vec(), results: results.clone(), attrs, loc: loc.into(), origin: self.origin.origin });
        results
    }

    fn ty(&self, v: Value) -> Type {
        self.func.ty(v).clone()
    }

    /// The values of the previous rank of the ring, for `values` of this one: one bucket of
    /// two asynchronous shifts (with `overlap`), or two shifts.
    fn shift(&mut self, values: [Value; 2], what: [&str; 2], step: usize) -> Shifted {
        let bucket = self.overlap.then(|| {
            let b = *self.bucket;
            *self.bucket += 1;
            b
        });
        let mut out = [values[0]; 2];
        for (k, (&v, what)) in values.iter().zip(what).enumerate() {
            let mut attrs = Attrs::new()
                .with("grid", AttrValue::Symbol(self.grid.to_string()))
                .with("grid_axes", AttrValue::axes(&[CP as Axis]))
                .with("shift_axis", AttrValue::Index(CP as usize))
                .with("offset", AttrValue::Int(1))
                .with("rotate", AttrValue::Unit)
                .with("xf.cause", AttrValue::Str(format!("ring attention of `{}`: {what} passed to the next cp rank (step {step})", self.origin.loc)));
            if let Some(b) = bucket {
                attrs = attrs.with("xf.async", AttrValue::Bool(true)).with("xf.bucket", AttrValue::Int(b)).with("xf.bucket_members", AttrValue::Int(2));
            }
            let ty = self.ty(v);
            let loc = format!("{}.ring.shift", self.origin.loc);
            out[k] = self.push("shard.shift", &[v], attrs, vec![ty], &loc)[0];
        }
        Shifted { values: out, bucket }
    }

    /// The shifted values, waited for where they are first read.
    fn arrived(&mut self, shifted: Shifted) -> [Value; 2] {
        let Some(bucket) = shifted.bucket else { return shifted.values };
        shifted.values.map(|v| {
            let ty = self.ty(v);
            let loc = format!("{}.ring.wait", self.origin.loc);
            self.push("xf.wait", &[v], Attrs::new().with("xf.bucket", AttrValue::Int(bucket)), vec![ty], &loc)[0]
        })
    }

    fn block_attrs(&self, step: usize) -> Attrs {
        let mut attrs = Attrs::new();
        for name in ["causal", "scale", "head_dim", "xf.seq_split_axes", shardc_ir::ops::ZIGZAG_ATTR] {
            if let Some(v) = self.origin.attrs.get(name) {
                attrs = attrs.with(name, v.clone());
            }
        }
        attrs.with(shardc_ir::ops::RING_STEP_ATTR, AttrValue::Int(step as i64))
    }

    fn stats_type(&self, q: Value) -> Type {
        // The forward's own statistics type (it depends on the queries alone).
        let q = self.func.tensor(q).cloned().unwrap_or_else(|| TensorTy::new([0i64; 0], shardc_ir::DType::F32));
        let stats = shardc_ir::ops::attention_stats(&[&q, &q], &self.origin.attrs).unwrap_or_else(|_| TensorTy::new([0i64; 0], shardc_ir::ops::stats_dtype(&q)));
        Type::Tensor(stats)
    }

    /// Step `t` attends to the block it holds while the next block is on its way.
    fn ring_forward(&mut self, q: Value, keys: Value, values: Value, parts: usize) -> (Value, Value) {
        let loc = self.origin.loc.clone();
        let (qt, st) = (self.ty(q), self.stats_type(q));
        let (mut kv, mut result) = ([keys, values], None::<(Value, Value)>);
        for step in 0..parts {
            let next = (step + 1 < parts).then(|| self.shift(kv, ["keys", "values"], step + 1));
            let part = self.push("xf.attention_block", &[q, kv[0], kv[1]], self.block_attrs(step), vec![qt.clone(), st.clone()], &format!("{loc}.ring.{step}"));
            result = Some(match result {
                None => (part[0], part[1]),
                Some((o, lse)) => {
                    let merged = self.push("xf.attention_merge", &[o, lse, part[0], part[1]], Attrs::new(), vec![qt.clone(), st.clone()], &format!("{loc}.ring.{step}.merge"));
                    (merged[0], merged[1])
                }
            });
            if let Some(next) = next {
                kv = self.arrived(next);
            }
        }
        result.unwrap_or((q, q))
    }

    /// Step `t` adds this rank's share to the gradient sums of the block it holds (arriving
    /// from the rank before while its share is computed) and sends them on; the last shift
    /// brings each block's sums home.
    fn ring_backward(&mut self, q: Value, ring: Ringed, dout: Value, parts: usize) -> (Value, Value, Value) {
        let loc = self.origin.loc.clone();
        let (qt, kt) = (self.ty(q), self.ty(ring.keys));
        let mut kv = [ring.keys, ring.values];
        let (mut dq, mut travelling) = (None::<Value>, None::<Shifted>);
        for step in 0..parts {
            let next = (step + 1 < parts).then(|| self.shift(kv, ["keys", "values"], step + 1));
            let g = self.push("xf.attention_block_grad", &[q, kv[0], kv[1], ring.out, ring.lse, dout], self.block_attrs(step), vec![qt.clone(), kt.clone(), kt.clone()], &format!("{loc}.ring.{step}"));
            dq = Some(match dq {
                None => g[0],
                Some(sum) => self.push("xf.add", &[sum, g[0]], Attrs::new(), vec![qt.clone()], &format!("{loc}.ring.{step}.dq"))[0],
            });
            let sums = match travelling.take() {
                None => [g[1], g[2]],
                Some(shifted) => {
                    let [dk, dv] = self.arrived(shifted);
                    let dk = self.push("xf.add", &[dk, g[1]], Attrs::new(), vec![kt.clone()], &format!("{loc}.ring.{step}.sum"))[0];
                    let dv = self.push("xf.add", &[dv, g[2]], Attrs::new(), vec![kt.clone()], &format!("{loc}.ring.{step}.sum"))[0];
                    [dk, dv]
                }
            };
            travelling = Some(self.shift(sums, ["key gradients", "value gradients"], step + 1));
            if let Some(next) = next {
                kv = self.arrived(next);
            }
        }
        let [dk, dv] = match travelling {
            Some(shifted) => self.arrived(shifted),
            None => [ring.keys, ring.values],
        };
        (dq.unwrap_or(q), dk, dv)
    }
}
