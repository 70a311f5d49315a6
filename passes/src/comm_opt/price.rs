//! Pricing: collectives by the cluster model, ops by their roofline time, whole functions.

use super::*;

/// The modelled cost of `func` as it is: every op and collective once.
pub(super) fn func_cost(func: &Func, grid: &[i64], cluster: &Cluster) -> f64 {
    let compute: f64 = func
        .ops
        .iter()
        .filter(|op| collective_kind(op).is_none())
        .map(|op| EPSILON + roofline(cluster, func, &op.name, &op.operands.iter().filter_map(|v| func.tensor(*v).cloned()).collect::<Vec<_>>(), &op.attrs))
        .sum();
    let slices: f64 = func
        .ops
        .iter()
        .filter(|op| matches!(collective_kind(op), Some(Kind::Coll { op: CollOp::Slice(_), .. })))
        .filter_map(|op| func.tensor(op.results[0]))
        .map(|t| t.bytes() as f64 / cluster.gpu.memory_bandwidth)
        .sum();
    let collectives = func.ops.iter().filter(|op| collective_kind(op).is_some()).count() as f64 * EPSILON;
    compute + slices + collectives + price(func, grid, cluster).0
}

/// (seconds, bytes, count) of the collectives of `func`.
pub fn price(func: &Func, grid: &[i64], cluster: &Cluster) -> (f64, f64, usize) {
    let mut total = (0.0, 0.0, 0);
    // A bucket's members travel as one all-reduce.
    let mut buckets: BTreeMap<i64, (Vec<usize>, f64)> = BTreeMap::new();
    for op in func.ops.iter().filter(|o| o.name == "shard.all_reduce") {
        if let (Some(AttrValue::Int(b)), Some(t)) = (op.attrs.get("xf.bucket"), func.tensor(op.results[0])) {
            let axes: Vec<usize> = op.attrs.axes("grid_axes").unwrap_or_default().into_iter().map(usize::from).collect();
            let e = buckets.entry(*b).or_insert((axes, 0.0));
            e.1 += t.bytes() as f64;
        }
    }
    for (axes, bytes) in buckets.values() {
        total.0 += cluster.time(Collective::AllReduce, *bytes, grid, axes);
        total.1 += bytes;
        total.2 += 1;
    }
    // Every other collective, rewritable or kept as it is (a gather for one reader).
    for op in func.ops.iter().filter(|o| o.attrs.get("xf.bucket").is_none()) {
        let Some(Kind::Coll { op: c, axes }) = any_collective(op) else { continue };
        let (Some(input), Some(output)) = (func.tensor(op.operands[0]), func.tensor(op.results[0])) else { continue };
        let (kind, bytes) = collective_cost_shape(c, input, output);
        let axes: Vec<usize> = axes.iter().map(|&a| a as usize).collect();
        total.0 += cluster.time(kind, bytes, grid, &axes);
        if kind != Collective::AllSlice {
            total.1 += bytes;
            total.2 += 1;
        }
    }
    total
}

pub(super) fn collective_cost_shape(op: CollOp, input: &TensorTy, output: &TensorTy) -> (Collective, f64) {
    match op {
        CollOp::Gather(_) => (Collective::AllGather, output.bytes() as f64),
        CollOp::Slice(_) => (Collective::AllSlice, input.bytes() as f64),
        CollOp::ReduceScatter(_) => (Collective::ReduceScatter, input.bytes() as f64),
        CollOp::Reduce { .. } => (Collective::AllReduce, input.bytes() as f64),
        CollOp::Broadcast(_) => (Collective::Broadcast, input.bytes() as f64),
        CollOp::Bucket => (Collective::AllReduce, input.bytes() as f64),
    }
}

pub(super) fn roofline(cluster: &Cluster, _func: &Func, name: &str, inputs: &[TensorTy], attrs: &Attrs) -> f64 {
    let Some(def) = lookup(name) else { return 0.0 };
    let refs: Vec<&TensorTy> = inputs.iter().collect();
    let Ok(outputs) = def.infer(&refs, attrs) else { return 0.0 };
    cluster.op_time(def, &refs, &outputs, attrs)
}
