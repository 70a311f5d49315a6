//! The rewrite rules: each search finds, in the current e-graph, pairs of terms the rule
//! proves equal (see the module above for the list). They are hand-written searches, not
//! egg `Rewrite`s: most need the analysis (replicated axes, types) and the op registry's
//! sharding rules in their preconditions, and build terms with new attributes (a gather's
//! new axis, an op's attributes on shards) that a `Pattern` cannot spell.

use super::*;

/// Smallest message, in bytes, worth bucketing with a neighbour: above it bandwidth, not
/// launches, decides.
pub(super) const BUCKET_BYTES: u64 = 4 << 20;

/// Pairs `(i, j)` of consecutive sum all-reduces (each op in at most one pair) over the same
/// axes, of one element type (a pair travels as one message of both), small, where `j`
/// does not depend on `i`'s result.
pub(super) fn bucket_pairs(func: &Func) -> Vec<(usize, usize)> {
    // Gradient syncs that feed updates are left to the gradient buckets, which overlap them
    // with the rest of the backward pass.
    let feeds_update: HashSet<Value> = func.ops.iter().filter(|o| o.name == "xf.adamw" || o.name == "xf.sgd").flat_map(|o| o.operands.iter().copied()).collect();
    let is_sum = |i: usize| matches!(collective_kind(&func.ops[i]), Some(Kind::Coll { op: CollOp::Reduce { max: false }, .. }))
        && !feeds_update.contains(&func.ops[i].results[0])
        && func.tensor(func.ops[i].results[0]).is_some_and(|t| t.bytes() <= BUCKET_BYTES && t.dtype.is_float());
    let axes = |i: usize| match collective_kind(&func.ops[i]) {
        Some(Kind::Coll { axes, .. }) => axes,
        _ => Vec::new(),
    };
    let reduces: Vec<usize> = (0..func.ops.len()).filter(|&i| is_sum(i)).collect();
    let mut pairs = Vec::new();
    let mut k = 0;
    while k + 1 < reduces.len() {
        let (i, j) = (reduces[k], reduces[k + 1]);
        let dtype = |i: usize| func.tensor(func.ops[i].results[0]).map(|t| t.dtype);
        if axes(i) == axes(j) && dtype(i) == dtype(j) && !depends_on(func, j, i) {
            pairs.push((i, j));
            k += 2;
        } else {
            k += 1;
        }
    }
    pairs
}

/// Whether op `later` reads (through any chain of ops) a result of op `earlier`.
pub(super) fn depends_on(func: &Func, later: usize, earlier: usize) -> bool {
    let mut tainted: HashSet<Value> = func.ops[earlier].results.iter().copied().collect();
    for op in &func.ops[earlier + 1..=later] {
        if op.operands.iter().any(|v| tainted.contains(v)) {
            tainted.extend(op.results.iter().copied());
        }
    }
    func.ops[later].results.iter().any(|r| tainted.contains(r))
}

pub(super) type Match = (&'static str, Term, Term);

/// Every rule's matches in the current e-graph: (rule, a term, an equal term).
pub(super) fn search(egraph: &Graph) -> Vec<Match> {
    let tables = &egraph.analysis;
    let kind = |node: &SymbolLang| tables.kinds.get(&node.op);
    let nodes_of = |id: Id| egraph[id].nodes.iter();
    let mut out: Vec<Match> = Vec::new();
    for class in egraph.classes() {
        let here = class.id;
        let ty = class.data.ty.clone();
        for node in &class.nodes {
            match kind(node) {
                Some(Kind::Coll { op, axes }) => {
                    let child = node.children[0];
                    if tables.group(axes) == 1 {
                        out.push(("size-one-axis", Term::Class(here), Term::Class(child)));
                        continue;
                    }
                    if matches!(op, CollOp::Broadcast(_)) && replicated_over(egraph, child, axes) {
                        out.push(("broadcast-of-replicated", Term::Class(here), Term::Class(child)));
                    }
                    for inner in nodes_of(child) {
                        let Some(Kind::Coll { op: inner_op, axes: inner_axes }) = kind(inner) else { continue };
                        let same_axes = inner_axes == axes;
                        match (op, inner_op) {
                            (CollOp::Slice(d), CollOp::Gather(e)) if d == e && same_axes => out.push(("slice-of-gather", Term::Class(here), Term::Class(inner.children[0]))),
                            (CollOp::Gather(d), CollOp::Slice(e)) if d == e && same_axes && replicated_over(egraph, inner.children[0], axes) => {
                                out.push(("gather-of-slice", Term::Class(here), Term::Class(inner.children[0])))
                            }
                            (CollOp::Gather(d), CollOp::ReduceScatter(e)) if d == e && same_axes => {
                                out.push(("join-all-reduce", Term::Class(here), coll(CollOp::Reduce { max: false }, axes, Term::Class(inner.children[0]))))
                            }
                            (CollOp::Reduce { max: false }, CollOp::Reduce { max: false }) if !inner_axes.iter().any(|a| axes.contains(a)) => {
                                let mut merged: Vec<u16> = axes.iter().chain(inner_axes).copied().collect();
                                merged.sort_unstable();
                                out.push(("merge-axes", Term::Class(here), coll(CollOp::Reduce { max: false }, &merged, Term::Class(inner.children[0]))));
                            }
                            _ => {}
                        }
                    }
                    // Split along one dimension: the longest one divisible by the group, other
                    // than the last (the sequence of an activation, where sequence
                    // parallelism cuts it; a vector's only dimension).
                    // Only where a reader could run on the shards: a split all-reduce that
                    // feeds only matmuls and updates would be gathered again at once.
                    let movable_reader = class.parents().any(|p| {
                        egraph[p].nodes.iter().any(|n| n.children.iter().any(|k| egraph.find(*k) == here) && matches!(kind(n), Some(Kind::Xf { name, .. }) if !pinned_op(name)))
                    });
                    if let (CollOp::Reduce { max: false }, Some(ty), true) = (op, &ty, movable_reader) {
                        let n = tables.group(axes);
                        let candidates = if ty.rank() > 1 { ty.rank() - 1 } else { ty.rank() };
                        let longest = (0..candidates).filter(|&d| ty.shape[d] % n == 0 && ty.shape[d] >= n).max_by_key(|&d| (ty.shape[d], std::cmp::Reverse(d)));
                        if let Some(d) = longest {
                            out.push(("split-all-reduce", Term::Class(here), coll(CollOp::Gather(d), axes, coll(CollOp::ReduceScatter(d), axes, Term::Class(child)))));
                        }
                    }
                }
                Some(Kind::Xf { name, attrs, loc }) if !pinned_op(name) => {
                    commute_gather(egraph, here, node, name, *attrs, *loc, &mut out);
                    if name == "xf.add" {
                        sum_of_all_reduces(egraph, here, node, *attrs, *loc, &mut out);
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// `add(all_reduce(x, a), all_reduce(y, a)) = all_reduce(add(x, y), a)` for same-shape operands.
pub(super) fn sum_of_all_reduces(egraph: &Graph, here: Id, node: &SymbolLang, attrs: usize, loc: usize, out: &mut Vec<Match>) {
    let tables = &egraph.analysis;
    let [a, b] = node.children[..] else { return };
    if egraph[a].data.ty != egraph[b].data.ty {
        return;
    }
    let reduces = |id: Id| -> Vec<(Vec<u16>, Id)> {
        egraph[id]
            .nodes
            .iter()
            .filter_map(|n| match tables.kinds.get(&n.op) {
                Some(Kind::Coll { op: CollOp::Reduce { max: false }, axes }) => Some((axes.clone(), n.children[0])),
                _ => None,
            })
            .collect()
    };
    for (axes_a, x) in reduces(a) {
        for (axes_b, y) in reduces(b) {
            if axes_a == axes_b {
                let sum = Term::Node(Kind::Xf { name: "xf.add".into(), attrs, loc }, vec![Term::Class(x), Term::Class(y)]);
                out.push(("sum-of-all-reduces", Term::Class(here), coll(CollOp::Reduce { max: false }, &axes_a, sum)));
            }
        }
    }
}

/// `op(all_gather(x, a, d), y) = all_gather(op(x, y'), a, d')` when the op's sharding rule
/// maps `d` to a free factor that lands on result dimension `d'`; a result the factor does not
/// reach is a sum over it, so it becomes `all_reduce(op(x, y'), a)`. Multi-result ops match
/// through their projections.
#[allow(clippy::too_many_arguments)]
pub(super) fn commute_gather(egraph: &Graph, here: Id, node: &SymbolLang, name: &str, attrs: usize, loc: usize, out: &mut Vec<Match>) {
    let tables = &egraph.analysis;
    let Some(def) = lookup(name) else { return };
    let Some(inputs): Option<Vec<TensorTy>> = node.children.iter().map(|c| egraph[*c].data.ty.clone()).collect() else { return };
    let Some(result_tys) = result_types(egraph, node) else { return };
    let refs: Vec<&TensorTy> = inputs.iter().collect();
    let rule = def.sharding_rule(&refs, &tables.attrs[attrs]);
    if rule.results.len() != result_tys.len() {
        return;
    }
    for (i, &child) in node.children.iter().enumerate() {
        for inner in &egraph[child].nodes {
            let Some(Kind::Coll { op: CollOp::Gather(d), axes }) = tables.kinds.get(&inner.op) else { continue };
            let Some(&factor) = rule.operands.get(i).and_then(|dims| dims.get(*d)) else { continue };
            if rule.factors.get(factor) != Some(&FactorKind::Free) || rule.operands[i].iter().filter(|&&f| f == factor).count() != 1 {
                continue;
            }
            // An op that reads the positions along the factor (rotary angles, the causal
            // mask) would read its shard's rows as the first ones: it needs the rank's offset
            // that partitioning gives it (`xf.seq_split_axes`), not a gather moved past it.
            if def.position_factor() == Some(factor) {
                continue;
            }
            let n = tables.group(axes);
            // Where the factor lands in each result: a dimension, or nowhere (a sum).
            let mut lands: Vec<Option<usize>> = Vec::new();
            let mut ok = true;
            for (k, dims) in rule.results.iter().enumerate() {
                let at: Vec<usize> = dims.iter().enumerate().filter(|(_, f)| **f == factor).map(|(j, _)| j).collect();
                match at[..] {
                    [] => lands.push(None),
                    [j] if result_tys[k].shape[j] % n == 0 => lands.push(Some(j)),
                    _ => ok = false,
                }
            }
            // A sum is only a partial sum of float values.
            if !ok || lands.iter().zip(&result_tys).any(|(l, t)| l.is_none() && !t.dtype.is_float()) {
                continue;
            }
            // Every operand's shard along the factor.
            let mut children: Vec<Term> = Vec::new();
            let mut types: Vec<TensorTy> = Vec::new();
            for (j, &other) in node.children.iter().enumerate() {
                if j == i {
                    children.push(Term::Class(inner.children[0]));
                    types.push(egraph[inner.children[0]].data.ty.clone().unwrap_or_else(|| inputs[j].clone()));
                    continue;
                }
                let dims: Vec<usize> = rule.operands[j].iter().enumerate().filter(|(_, f)| **f == factor).map(|(k, _)| k).collect();
                // Every rank of the group must read the same other operands: a value that
                // differs per rank (a partial sum, a data-parallel shard) would be mixed
                // across ranks by the gather.
                let same_everywhere = || replicated_over(egraph, other, axes);
                match dims[..] {
                    [] if same_everywhere() => {
                        children.push(Term::Class(other));
                        types.push(inputs[j].clone());
                    }
                    [e] if inputs[j].shape[e] % n == 0 => {
                        let gathered = egraph[other].nodes.iter().find(|m| matches!(tables.kinds.get(&m.op), Some(Kind::Coll { op: CollOp::Gather(g), axes: ga }) if *g == e && ga == axes));
                        children.push(match gathered {
                            Some(m) => Term::Class(m.children[0]),
                            None if same_everywhere() => coll(CollOp::Slice(e), axes, Term::Class(other)),
                            None => {
                                ok = false;
                                continue;
                            }
                        });
                        let mut t = inputs[j].clone();
                        t.shape[e] /= n;
                        types.push(t);
                    }
                    _ => ok = false,
                }
            }
            if !ok {
                continue;
            }
            let expected: Vec<TensorTy> = result_tys
                .iter()
                .zip(&lands)
                .map(|(t, l)| {
                    let mut t = t.clone();
                    if let Some(j) = l {
                        t.shape[*j] /= n;
                    }
                    t
                })
                .collect();
            let local_attrs = tables.attrs[attrs].clone();
            let refs: Vec<&TensorTy> = types.iter().collect();
            if def.infer(&refs, &local_attrs).ok() != Some(expected.clone()) {
                continue;
            }
            let moved = || Term::Op { name: name.to_string(), attrs: local_attrs.clone(), loc, children: children.clone() };
            let rewrite = |value: Term, land: Option<usize>| match land {
                Some(j) => coll(CollOp::Gather(j), axes, value),
                None => coll(CollOp::Reduce { max: false }, axes, value),
            };
            if result_tys.len() == 1 {
                out.push(("commute-gather", Term::Class(here), rewrite(moved(), lands[0])));
            } else {
                for (k, land) in lands.iter().enumerate() {
                    let project = |tuple: Term| Term::Node(Kind::Proj(k), vec![tuple]);
                    out.push(("commute-gather", project(Term::Class(here)), rewrite(project(moved()), *land)));
                }
            }
        }
    }
}
