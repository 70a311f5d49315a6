//! Extraction: a node per e-class minimising the program's modelled cost as a DAG (each
//! class paid once however many readers it has), with the cost function it uses.

use super::*;

/// Picks a node per e-class minimising the cost of the program as a DAG: each e-class a
/// node's subgraph uses is paid once, however many readers it has (greedy DAG extraction:
/// a node's cost set is the union of its children's, plus itself). Opaque and heavy ops
/// bound the regions: their cost set is themselves alone, so sets stay the size of the
/// communication region around them rather than the whole program. Classes are visited in
/// program order, so one or two sweeps usually settle.
pub(super) fn extract(egraph: &Graph, cluster: &Cluster, order: &HashMap<Id, f64>, paid: &HashSet<Id>, excluded: &HashSet<SymbolLang>) -> HashMap<Id, SymbolLang> {
    let tables = &egraph.analysis;
    let mut classes: Vec<Id> = egraph.classes().map(|c| c.id).collect();
    classes.sort_by(|a, b| order.get(a).unwrap_or(&f64::MAX).total_cmp(order.get(b).unwrap_or(&f64::MAX)).then(a.cmp(b)));
    let mut cost = Cost { egraph, cluster };
    let boundary = |node: &SymbolLang| match tables.kinds.get(&node.op) {
        Some(Kind::Xf { name, .. }) => heavy_op(name),
        Some(Kind::Coll { .. }) => false,
        _ => true,
    };
    let mut best: HashMap<Id, (f64, SymbolLang, std::rc::Rc<HashMap<Id, f64>>)> = HashMap::default();
    let mut own_cost: HashMap<&SymbolLang, f64> = HashMap::default();
    for _sweep in 0..MAX_SWEEPS {
        let mut changed = false;
        for &c in &classes {
            for node in &egraph[c].nodes {
                if excluded.contains(node) {
                    continue;
                }
                let own = *own_cost.entry(node).or_insert_with(|| cost.cost(node, |_| 0.0));
                if !own.is_finite() || node.children.iter().any(|k| !best.contains_key(&egraph.find(*k))) {
                    continue;
                }
                let set = if boundary(node) {
                    std::rc::Rc::new(std::iter::once((c, own)).collect())
                } else {
                    // Classes already paid for (read by ops that stay) add nothing.
                    // A child whose set is large (a long chain, such as the residual stream)
                    // counts as one entry of its total: sets stay small, and sharing that far
                    // away is not tracked.
                    let mut set: HashMap<Id, f64> = HashMap::default();
                    for k in node.children.iter().map(|k| egraph.find(*k)).filter(|k| !paid.contains(k)) {
                        let (total, _, kid) = &best[&k];
                        if kid.len() > SET_CAP {
                            set.insert(k, *total);
                        } else {
                            set.extend(kid.iter().map(|(k, v)| (*k, *v)));
                        }
                    }
                    if set.contains_key(&c) {
                        continue;
                    }
                    set.insert(c, own);
                    std::rc::Rc::new(set)
                };
                let total: f64 = set.values().sum();
                let better = match best.get(&c) {
                    Some((old, _, _)) => total < *old * (1.0 - 1e-9),
                    None => true,
                };
                if better {
                    best.insert(c, (total, node.clone(), set));
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    best.into_iter().map(|(c, (_, node, _))| (c, node)).collect()
}

/// The classes a choice reaches from the roots, in no particular order; `None` when some
/// class has no choice or the choice has a cycle.
pub(super) fn reachable(egraph: &Graph, choice: &HashMap<Id, SymbolLang>, roots: &[Id]) -> Option<Vec<Id>> {
    let mut seen: HashSet<Id> = HashSet::default();
    let mut out = Vec::new();
    let mut stack: Vec<Id> = roots.to_vec();
    while let Some(c) = stack.pop() {
        let c = egraph.find(c);
        if !seen.insert(c) {
            continue;
        }
        out.push(c);
        stack.extend(choice.get(&c)?.children.iter().map(|k| egraph.find(*k)));
    }
    // Acyclic: a topological order exists.
    let mut indegree: HashMap<Id, usize> = out.iter().map(|c| (*c, 0)).collect();
    for c in &out {
        for k in choice[c].children.iter().map(|k| egraph.find(*k)).collect::<HashSet<_>>() {
            *indegree.get_mut(&k)? += 1;
        }
    }
    let mut ready: Vec<Id> = indegree.iter().filter(|(_, d)| **d == 0).map(|(c, _)| *c).collect();
    let mut visited = 0;
    while let Some(c) = ready.pop() {
        visited += 1;
        for k in choice[&c].children.iter().map(|k| egraph.find(*k)).collect::<HashSet<_>>() {
            let d = indegree.get_mut(&k)?;
            *d -= 1;
            if *d == 0 {
                ready.push(k);
            }
        }
    }
    (visited == out.len()).then_some(out)
}

/// The modelled cost of the program a choice makes: every reached class once.
pub(super) fn program_cost(egraph: &Graph, cost: &mut Cost<'_>, choice: &HashMap<Id, SymbolLang>, roots: &[Id]) -> Option<f64> {
    let classes = reachable(egraph, choice, roots)?;
    Some(classes.iter().map(|c| cost.cost(&choice[c], |_| 0.0)).sum())
}

/// Operand classes of the opaque and heavy ops a choice keeps: they are computed whatever
/// else is chosen, so the next extraction counts them as paid.
pub(super) fn boundary_operands(egraph: &Graph, choice: &HashMap<Id, SymbolLang>, roots: &[Id]) -> HashSet<Id> {
    let tables = &egraph.analysis;
    let Some(classes) = reachable(egraph, choice, roots) else { return HashSet::default() };
    classes
        .iter()
        .filter(|c| match tables.kinds.get(&choice[c].op) {
            Some(Kind::Opaque(_)) => true,
            Some(Kind::Xf { name, .. }) => heavy_op(name),
            _ => false,
        })
        .flat_map(|c| choice[c].children.iter().map(|k| egraph.find(*k)))
        .collect()
}

/// Extraction cost: collective time by the cluster model, op time by the roofline.
pub(super) struct Cost<'a> {
    pub(super) egraph: &'a Graph,
    pub(super) cluster: &'a Cluster,
}

/// Sweeps of greedy DAG extraction: costs only fall, but by ever smaller steps where choices
/// interact, so the sweeps stop here.
pub(super) const MAX_SWEEPS: usize = 4;

/// Largest cost set extraction tracks per class.
pub(super) const SET_CAP: usize = 48;

/// Every node costs at least this much, so that no cycle is free.
pub(super) const EPSILON: f64 = 1e-12;

impl CostFunction<SymbolLang> for Cost<'_> {
    type Cost = f64;

    fn cost<C: FnMut(Id) -> f64>(&mut self, enode: &SymbolLang, mut costs: C) -> f64 {
        let tables = &self.egraph.analysis;
        let child_ty = |i: usize| enode.children.get(i).and_then(|c| self.egraph[*c].data.ty.clone());
        let own = match tables.kinds.get(&enode.op) {
            Some(Kind::Arg(_)) => 0.0,
            Some(Kind::Proj(_)) => EPSILON,
            Some(Kind::Opaque(i)) => {
                let op = &tables.func.ops[*i];
                let first = |values: &[Value]| values.first().and_then(|v| tables.func.tensor(*v));
                match (any_collective(op), op.attrs.get("xf.bucket"), first(&op.operands), first(&op.results)) {
                    // A collective kept as it is (a gather for one reader) costs what it sends.
                    (Some(Kind::Coll { op: c, axes }), None, Some(input), Some(output)) => {
                        let (kind, bytes) = collective_cost_shape(c, input, output);
                        let axes: Vec<usize> = axes.iter().map(|&a| a as usize).collect();
                        EPSILON + self.cluster.time(kind, bytes, &tables.grid, &axes)
                    }
                    _ => EPSILON + roofline(self.cluster, &tables.func, op.name.as_str(), &op.operands.iter().filter_map(|v| tables.func.tensor(*v).cloned()).collect::<Vec<_>>(), &op.attrs),
                }
            }
            Some(Kind::Xf { name, attrs, .. }) => {
                let inputs: Vec<TensorTy> = (0..enode.children.len()).filter_map(child_ty).collect();
                EPSILON + roofline(self.cluster, &tables.func, name, &inputs, &tables.attrs[*attrs])
            }
            Some(Kind::Coll { op: CollOp::Bucket, axes }) => {
                let bytes: Option<f64> = (0..enode.children.len()).map(|i| child_ty(i).map(|t| t.bytes() as f64)).sum();
                let axes: Vec<usize> = axes.iter().map(|&a| a as usize).collect();
                bytes.map_or(f64::INFINITY, |b| EPSILON + self.cluster.time(Collective::AllReduce, b, &tables.grid, &axes))
            }
            Some(Kind::Coll { op, axes }) => match child_ty(0) {
                Some(input) => {
                    let n = tables.group(axes);
                    let mut output = input.clone();
                    match op {
                        CollOp::Gather(d) => output.shape[*d] *= n,
                        CollOp::Slice(d) | CollOp::ReduceScatter(d) => output.shape[*d] /= n,
                        CollOp::Reduce { .. } | CollOp::Broadcast(_) | CollOp::Bucket => {}
                    }
                    let (kind, bytes) = collective_cost_shape(*op, &input, &output);
                    let axes: Vec<usize> = axes.iter().map(|&a| a as usize).collect();
                    // A local slice copies its part.
                    let local = if kind == Collective::AllSlice { output.bytes() as f64 / self.cluster.gpu.memory_bandwidth } else { 0.0 };
                    EPSILON + local + self.cluster.time(kind, bytes, &tables.grid, &axes)
                }
                None => f64::INFINITY,
            },
            None => f64::INFINITY,
        };
        enode.fold(own, |acc, id| acc + costs(id))
    }
}
