//! `comm-opt`: rewrites the collectives of a partitioned training step to the cheapest
//! equivalent program, by equality saturation (`egg`) priced by the cluster model.
//!
//! Every op of `@train_step` becomes an e-node: collectives (`all_gather`, `all_slice`,
//! `all_reduce`, `reduce_scatter`) and single-result `xf` ops as rewritable nodes, everything
//! else as opaque nodes whose operands may still change. Gradient buckets and the gathers
//! of a parameter made for one reader (`xf.per_reader`, ZeRO-3) are opaque too, and priced
//! as the collectives they are: as e-nodes two equal gathers would be one, holding the
//! whole parameter between its readers. The rules below grow the e-graph
//! until it saturates or hits a limit (nodes, iterations, wall time; the report says which).
//! Extraction picks, per e-class, the node of least cost: collectives by the alpha-beta model
//! of their axes ([`shardc_ir::cluster`]), ops by their roofline time on the cluster's GPU,
//! so moving compute across a collective is priced too. The function is then rebuilt from
//! the extracted nodes, ops in their original order as far as dependencies allow.
//!
//! Rules (each has a test on concrete tensors in the CPU runtime):
//! * `slice-of-gather`: `all_slice(all_gather(x, a, d), a, d) = x`;
//! * `gather-of-slice`: `all_gather(all_slice(x, a, d), a, d) = x` (x is whole over `a`);
//! * `split-all-reduce`: `all_reduce(x, a) = all_gather(reduce_scatter(x, a, d), a, d)`;
//! * `join-all-reduce`: the converse;
//! * `commute-gather`: an op whose sharding rule maps the gathered dimension to a free factor
//!   runs on the shards: `op(all_gather(x, a, d), y) = all_gather(op(x, y'), a, d')`, with `y'`
//!   the matching shard of each other operand (its own un-gathered value, or a local slice);
//!   element-wise ops, norms over another dimension, attention over heads, ... all qualify by
//!   their registry rule, so sequence parallelism falls out of rewriting;
//! * `sum-of-all-reduces`: `add(all_reduce(x, a), all_reduce(y, a)) = all_reduce(add(x, y), a)`;
//! * `merge-axes`: `all_reduce(all_reduce(x, a), b) = all_reduce(x, a + b)`;
//! * `size-one-axis`: a collective over axes of total size 1 is its operand;
//! * `broadcast-of-replicated`: a broadcast over axes its operand is already replicated over
//!   (an all-reduce's or all-gather's result, an argument not split over them) is the operand;
//! * `bucket`: two all-reduces over the same axes whose operands do not depend on each other
//!   share one launch (one message of both), as gradient buckets do.
//!
//! Extraction is greedy and DAG-aware (a class used twice is paid once within a region; heavy
//! ops bound the regions), under a few policies (every node; whole all-reduces only; the
//! buckets), and the candidate program the model prices lowest wins, if it beats the input.
//! The bucket pairs are proposed in a second phase, among the collectives the first keeps.

use std::collections::{BTreeMap, BinaryHeap};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::time::{Duration, Instant};

use egg::{Analysis, CostFunction, DidMerge, EGraph, Id, Language, Symbol, SymbolLang};
use serde::{Deserialize, Serialize};
use shardc_ir::cluster::{Cluster, Collective};
use shardc_ir::ops::lookup;
use shardc_ir::sharding::FactorKind;
use shardc_ir::{AttrValue, Attrs, Func, FuncBuilder, Module, TensorTy, Type, Value};

use crate::{Changed, Pass, PassError};

/// The `comm-opt` pass.
#[derive(Clone, Debug)]
pub struct CommOpt {
    /// Prices collectives and compute.
    pub cluster: Cluster,
    /// Stop growing the e-graph past this many e-nodes.
    pub node_limit: usize,
    /// Stop after this many rounds of rule applications.
    pub iteration_limit: usize,
    /// Stop after this much wall time.
    pub time_limit: Duration,
}

impl Default for CommOpt {
    fn default() -> Self {
        CommOpt { cluster: Cluster::default(), node_limit: 200_000, iteration_limit: 30, time_limit: Duration::from_secs(5) }
    }
}

/// What the pass did, for the compile summary (stored in the module's notes).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CommOptReport {
    /// Estimated communication seconds of one step before and after.
    pub time_before: f64,
    /// After.
    pub time_after: f64,
    /// Bytes the collectives move (full sizes) before.
    pub bytes_before: f64,
    /// After.
    pub bytes_after: f64,
    /// Collectives before and after.
    pub collectives_before: usize,
    /// After.
    pub collectives_after: usize,
    /// Unions each rule made.
    pub rules: BTreeMap<String, usize>,
    /// Size of the saturated e-graph.
    pub enodes: usize,
    /// E-classes.
    pub eclasses: usize,
    /// Rounds of rule application.
    pub iterations: usize,
    /// Why saturation stopped: `saturated`, `node limit`, `iteration limit` or `time limit`.
    pub stop: String,
    /// Wall time of the pass in seconds.
    pub seconds: f64,
}

/// What an e-node stands for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Kind {
    /// Function argument `i`.
    Arg(usize),
    /// Original op `i`, not rewritten (its operands may be).
    Opaque(usize),
    /// Result `k` of a multi-result op (its operand is the op's tuple e-class).
    Proj(usize),
    /// A collective over grid `axes`.
    Coll { op: CollOp, axes: Vec<u16> },
    /// An `xf` op: name, attributes (table index), location (table index). With several
    /// results its e-class is a tuple, read through [`Kind::Proj`].
    Xf { name: String, attrs: usize, loc: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum CollOp {
    Gather(usize),
    Slice(usize),
    ReduceScatter(usize),
    Reduce { max: bool },
    /// From the in-group position `root` (row-major over the axes) to the group.
    Broadcast(usize),
    /// Sum-all-reduces of both operands as one message: a tuple, read through projections.
    Bucket,
}

/// Tables the e-nodes refer to, and each e-class's local type.
struct Tables {
    func: Func,
    grid: Vec<i64>,
    kinds: HashMap<Symbol, Kind>,
    symbols: HashMap<Kind, Symbol>,
    attrs: Vec<Attrs>,
    /// Indices into `attrs` by [`attrs_hash`], ascending: finding a table entry equal to new
    /// attributes looks at the few with their hash, not the whole table (which has an entry
    /// per op, so a search per rewrite is quadratic in the depth of the model).
    attrs_by_hash: HashMap<u64, Vec<usize>>,
    locs: Vec<String>,
}

/// A hash of attributes that equal attributes share (`0.0 == -0.0`, so both hash as zero).
fn attrs_hash(attrs: &Attrs) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = rustc_hash::FxHasher::default();
    for (name, value) in attrs.iter() {
        name.hash(&mut hasher);
        match value {
            AttrValue::Int(v) => (0u8, v).hash(&mut hasher),
            AttrValue::Float(v) => (1u8, if *v == 0.0 { 0 } else { v.to_bits() }).hash(&mut hasher),
            AttrValue::Bool(v) => (2u8, v).hash(&mut hasher),
            AttrValue::Str(v) => (3u8, v).hash(&mut hasher),
            AttrValue::Raw(v) => (4u8, v).hash(&mut hasher),
        }
    }
    hasher.finish()
}

impl Tables {
    fn symbol(&mut self, kind: Kind) -> Symbol {
        if let Some(s) = self.symbols.get(&kind) {
            return *s;
        }
        let symbol = Symbol::from(format!("{kind:?}"));
        self.kinds.entry(symbol).or_insert_with(|| kind.clone());
        self.symbols.insert(kind, symbol);
        symbol
    }

    /// Adds `attrs` to the table as a new entry; returns its index.
    fn push_attrs(&mut self, attrs: Attrs) -> usize {
        let index = self.attrs.len();
        self.attrs_by_hash.entry(attrs_hash(&attrs)).or_default().push(index);
        self.attrs.push(attrs);
        index
    }

    /// The index of the first table entry equal to `attrs`, added if there is none.
    fn intern_attrs(&mut self, attrs: Attrs) -> usize {
        let found = self.attrs_by_hash.get(&attrs_hash(&attrs)).and_then(|same_hash| same_hash.iter().copied().find(|&i| self.attrs[i] == attrs));
        match found {
            Some(i) => i,
            None => self.push_attrs(attrs),
        }
    }

    fn group(&self, axes: &[u16]) -> i64 {
        axes.iter().map(|&a| self.grid.get(a as usize).copied().unwrap_or(1)).product()
    }
}

/// What the analysis knows of an e-class: its local type, and the grid axes over which every
/// rank of a group holds the same value (bit `a` for axis `a`).
#[derive(Clone, Debug, Default, PartialEq)]
struct ClassData {
    ty: Option<TensorTy>,
    same: u8,
}

fn axis_bits(axes: &[u16]) -> u8 {
    axes.iter().filter(|&&a| a < 8).fold(0, |bits, &a| bits | 1 << a)
}

impl Analysis<SymbolLang> for Tables {
    type Data = ClassData;

    fn make(egraph: &mut EGraph<SymbolLang, Self>, enode: &SymbolLang, _id: Id) -> Self::Data {
        let egraph: &Graph = egraph;
        let tables = &egraph.analysis;
        let every: u8 = axis_bits(&(0..tables.grid.len() as u16).collect::<Vec<_>>());
        // Equal on every rank of a group when every operand is (an op of equal inputs).
        let children_same = enode.children.iter().fold(every, |bits, c| bits & egraph[*c].data.same);
        let same = match tables.kinds.get(&enode.op) {
            Some(Kind::Arg(i)) => match &tables.func.args[*i].layout {
                Some(layout) => every & !axis_bits(&layout.sharding.axes()),
                // No layout: the whole tensor on every rank.
                None => every,
            },
            Some(Kind::Coll { op: CollOp::Reduce { .. } | CollOp::Gather(_) | CollOp::Broadcast(_) | CollOp::Bucket, axes }) => children_same | axis_bits(axes),
            Some(Kind::Coll { op: CollOp::Slice(_) | CollOp::ReduceScatter(_), axes }) => children_same & !axis_bits(axes),
            _ => children_same,
        };
        ClassData { ty: Self::make_type(egraph, enode), same }
    }

    fn merge(&mut self, to: &mut Self::Data, from: Self::Data) -> DidMerge {
        let mut changed_to = false;
        if to.ty.is_none() && from.ty.is_some() {
            to.ty = from.ty.clone();
            changed_to = true;
        }
        // Equal values: what holds for one holds for both.
        let same = to.same | from.same;
        let changed_from = same != from.same || (from.ty.is_none() && to.ty.is_some());
        if same != to.same {
            to.same = same;
            changed_to = true;
        }
        DidMerge(changed_to, changed_from)
    }
}

impl Tables {
    fn make_type(egraph: &Graph, enode: &SymbolLang) -> Option<TensorTy> {
        let tables = &egraph.analysis;
        let child = |i: usize| enode.children.get(i).and_then(|c| egraph[*c].data.ty.clone());
        match tables.kinds.get(&enode.op)? {
            Kind::Proj(k) => {
                let tuple = enode.children.first()?;
                egraph[*tuple].nodes.iter().find_map(|n| result_types(egraph, n)).and_then(|types| types.into_iter().nth(*k))
            }
            Kind::Coll { op: CollOp::Bucket, .. } => None,
            Kind::Coll { op, axes } => {
                let mut t = child(0)?;
                let n = tables.group(axes);
                match op {
                    CollOp::Gather(d) => t.shape[*d] *= n,
                    CollOp::Slice(d) | CollOp::ReduceScatter(d) => t.shape[*d] /= n,
                    CollOp::Reduce { .. } | CollOp::Broadcast(_) | CollOp::Bucket => {}
                }
                Some(t)
            }
            _ => match result_types(egraph, enode)?[..] {
                [ref t] => Some(t.clone()),
                _ => None,
            },
        }
    }
}

type Graph = EGraph<SymbolLang, Tables>;

/// The result types of an op node (args, opaque and `xf` ops; not collectives or projections).
fn result_types(egraph: &Graph, node: &SymbolLang) -> Option<Vec<TensorTy>> {
    let tables = &egraph.analysis;
    match tables.kinds.get(&node.op)? {
        Kind::Arg(i) => Some(vec![tables.func.tensor(tables.func.args[*i].value)?.clone()]),
        Kind::Opaque(i) => tables.func.ops[*i].results.iter().map(|r| tables.func.tensor(*r).cloned()).collect(),
        Kind::Xf { name, attrs, .. } => {
            let inputs: Vec<TensorTy> = node.children.iter().map(|c| egraph[*c].data.ty.clone()).collect::<Option<_>>()?;
            let refs: Vec<&TensorTy> = inputs.iter().collect();
            lookup(name)?.infer(&refs, &tables.attrs[*attrs]).ok()
        }
        Kind::Coll { op: CollOp::Bucket, .. } => node.children.iter().map(|c| egraph[*c].data.ty.clone()).collect(),
        _ => None,
    }
}

/// A term to add: an existing class, a node over terms, or an `xf` op with new attributes.
#[derive(Clone)]
enum Term {
    Class(Id),
    Node(Kind, Vec<Term>),
    Op { name: String, attrs: Attrs, loc: usize, children: Vec<Term> },
}

fn add(egraph: &mut Graph, term: Term) -> Id {
    add_recording(egraph, term, &mut Vec::new())
}

/// [`add`], recording every node of the term (not the classes it reuses) in `made`.
fn add_recording(egraph: &mut Graph, term: Term, made: &mut Vec<SymbolLang>) -> Id {
    match term {
        Term::Class(id) => id,
        Term::Node(kind, children) => {
            let children: Vec<Id> = children.into_iter().map(|t| add_recording(egraph, t, made)).collect();
            let op = egraph.analysis.symbol(kind);
            let node = SymbolLang::new(op, children);
            made.push(node.clone());
            egraph.add(node)
        }
        Term::Op { name, attrs, loc, children } => {
            let children: Vec<Id> = children.into_iter().map(|t| add_recording(egraph, t, made)).collect();
            let tables = &mut egraph.analysis;
            let index = tables.intern_attrs(attrs);
            let op = tables.symbol(Kind::Xf { name, attrs: index, loc });
            let node = SymbolLang::new(op, children);
            made.push(node.clone());
            egraph.add(node)
        }
    }
}

fn coll_pair(axes: &[u16], x: Id, y: Id) -> Term {
    Term::Node(Kind::Coll { op: CollOp::Bucket, axes: axes.to_vec() }, vec![Term::Class(x), Term::Class(y)])
}

/// Smallest message, in bytes, worth bucketing with a neighbour: above it bandwidth, not
/// launches, decides.
const BUCKET_BYTES: u64 = 4 << 20;

/// Pairs `(i, j)` of consecutive sum all-reduces (each op in at most one pair) over the same
/// axes, of one element type (a pair travels as one message of both), small, where `j`
/// does not depend on `i`'s result.
fn bucket_pairs(func: &Func) -> Vec<(usize, usize)> {
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
fn depends_on(func: &Func, later: usize, earlier: usize) -> bool {
    let mut tainted: HashSet<Value> = func.ops[earlier].results.iter().copied().collect();
    for op in &func.ops[earlier + 1..=later] {
        if op.operands.iter().any(|v| tainted.contains(v)) {
            tainted.extend(op.results.iter().copied());
        }
    }
    func.ops[later].results.iter().any(|r| tainted.contains(r))
}

fn coll(op: CollOp, axes: &[u16], child: Term) -> Term {
    Term::Node(Kind::Coll { op, axes: axes.to_vec() }, vec![child])
}

/// Ops whose attributes or meaning depend on where a split lies, and heavy ops (the
/// matmuls and attention that partitioning placed): never moved across a gather.
fn pinned_op(name: &str) -> bool {
    heavy_op(name) || name.starts_with("xf.cross_entropy") || name == "xf.row_max"
}

/// Ops whose cost dwarfs moving data and whose layout partitioning fixed (the matmuls next
/// to the tensor-parallel collectives): their e-classes hold one form, and extraction treats
/// them as region boundaries. Attention is not among them: it runs on any heads' shard.
fn heavy_op(name: &str) -> bool {
    name.starts_with("xf.matmul") || name.starts_with("xf.embedding") || name == "xf.adamw" || name == "xf.sgd"
}

/// Picks a node per e-class minimising the cost of the program as a DAG: each e-class a
/// node's subgraph uses is paid once, however many readers it has (greedy DAG extraction:
/// a node's cost set is the union of its children's, plus itself). Opaque and heavy ops
/// bound the regions: their cost set is themselves alone, so sets stay the size of the
/// communication region around them rather than the whole program. Classes are visited in
/// program order, so one or two sweeps usually settle.
fn extract(egraph: &Graph, cluster: &Cluster, order: &HashMap<Id, f64>, paid: &HashSet<Id>, excluded: &HashSet<SymbolLang>) -> HashMap<Id, SymbolLang> {
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

impl Pass for CommOpt {
    fn name(&self) -> &'static str {
        "comm-opt"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let internal = |message: String| PassError::User { pass: self.name().into(), message };
        let Some(grid) = module.grids.first().map(|g| g.shape.clone()) else {
            return Ok(Changed::No);
        };
        let grid_name = module.grids[0].name.clone();
        let Some(index) = module.funcs.iter().position(|f| f.name == "train_step" || f.name == "gradients") else {
            return Ok(Changed::No);
        };
        let (func, report) = optimize(&module.funcs[index], &grid, &grid_name, self).map_err(internal)?;
        module.funcs[index] = func;
        module.notes.insert(self.name().into(), serde_json::to_string(&report).unwrap_or_default());
        Ok(Changed::Yes)
    }
}

/// The rewritten function and the report.
pub fn optimize(func: &Func, grid: &[i64], grid_name: &str, options: &CommOpt) -> Result<(Func, CommOptReport), String> {
    // Layout first (which collectives, where), then packing (which of them share a message):
    // bucket pairs are chosen among the collectives the layout keeps.
    let start = Instant::now();
    let (laid_out, layout) = optimize_phase(func, grid, grid_name, options, false)?;
    if bucket_pairs(&laid_out).is_empty() {
        return Ok((laid_out, CommOptReport { seconds: start.elapsed().as_secs_f64(), ..layout }));
    }
    let (packed, packing) = optimize_phase(&laid_out, grid, grid_name, options, true)?;
    let mut rules = layout.rules;
    for (rule, n) in packing.rules {
        *rules.entry(rule).or_insert(0) += n;
    }
    let report = CommOptReport {
        time_after: packing.time_after,
        bytes_after: packing.bytes_after,
        collectives_after: packing.collectives_after,
        rules,
        enodes: layout.enodes.max(packing.enodes),
        eclasses: layout.eclasses.max(packing.eclasses),
        seconds: start.elapsed().as_secs_f64(),
        ..layout
    };
    Ok((packed, report))
}

/// One phase: the layout rules (`packing` false) or the bucket pairs (`packing` true).
fn optimize_phase(func: &Func, grid: &[i64], grid_name: &str, options: &CommOpt, packing: bool) -> Result<(Func, CommOptReport), String> {
    let start = Instant::now();
    let tables = Tables { func: func.clone(), grid: grid.to_vec(), kinds: HashMap::default(), symbols: HashMap::default(), attrs: Vec::new(), attrs_by_hash: HashMap::default(), locs: Vec::new() };
    let mut egraph: Graph = EGraph::new(tables);
    // The class of every value, the original op behind each (class, symbol), and each
    // class's position in the original order.
    let mut class_of: HashMap<Value, Id> = HashMap::default();
    let mut original: HashMap<(Id, Symbol), usize> = HashMap::default();
    let mut position: Vec<(Id, f64)> = Vec::new();
    for (i, arg) in func.args.iter().enumerate() {
        let id = add(&mut egraph, Term::Node(Kind::Arg(i), vec![]));
        class_of.insert(arg.value, id);
        position.push((id, -1.0));
    }
    for (i, op) in func.ops.iter().enumerate() {
        let children: Vec<Id> = op.operands.iter().map(|v| class_of.get(v).copied().ok_or_else(|| format!("{}: operand {v} is undefined", op.loc))).collect::<Result<_, _>>()?;
        let kind = match collective_kind(op) {
            Some(kind) => kind,
            None if !op.results.is_empty() && op.name.starts_with("xf.") && lookup(&op.name).is_some() && !heavy_op(&op.name) => {
                let tables = &mut egraph.analysis;
                let attrs = tables.push_attrs(op.attrs.clone());
                tables.locs.push(op.loc.clone());
                Kind::Xf { name: op.name.clone(), attrs, loc: tables.locs.len() - 1 }
            }
            None => Kind::Opaque(i),
        };
        let symbol = egraph.analysis.symbol(kind.clone());
        let id = egraph.add(SymbolLang::new(symbol, children));
        original.insert((id, symbol), i);
        position.push((id, i as f64));
        if op.results.len() == 1 {
            class_of.insert(op.results[0], id);
        } else {
            for (k, r) in op.results.iter().enumerate() {
                let rid = add(&mut egraph, Term::Node(Kind::Proj(k), vec![Term::Class(id)]));
                class_of.insert(*r, rid);
                position.push((rid, i as f64 + 0.1));
            }
        }
    }
    let roots: Vec<Id> = func.returns.iter().map(|v| class_of[v]).collect();
    let before = price(func, grid, &options.cluster);
    let mut rules: BTreeMap<String, usize> = BTreeMap::new();
    // Buckets: consecutive sum all-reduces over the same axes, neither of which depends on the
    // other, may travel as one message.
    let mut bucketed: Vec<SymbolLang> = Vec::new();
    for (i, j) in if packing { bucket_pairs(func) } else { Vec::new() } {
        let (a, b) = (class_of[&func.ops[i].results[0]], class_of[&func.ops[j].results[0]]);
        let (x, y) = (class_of[&func.ops[i].operands[0]], class_of[&func.ops[j].operands[0]]);
        let axes = match collective_kind(&func.ops[i]) {
            Some(Kind::Coll { axes, .. }) => axes,
            _ => continue,
        };
        let bucket = add(&mut egraph, coll_pair(&axes, x, y));
        let (p0, p1) = (add(&mut egraph, Term::Node(Kind::Proj(0), vec![Term::Class(bucket)])), add(&mut egraph, Term::Node(Kind::Proj(1), vec![Term::Class(bucket)])));
        position.push((bucket, j as f64));
        for (class, proj) in [(a, p0), (b, p1)] {
            if egraph.union(class, proj) {
                *rules.entry("bucket".into()).or_insert(0) += 1;
            }
        }
        for op in [i, j] {
            let symbol = egraph.analysis.symbol(collective_kind(&func.ops[op]).expect("a collective"));
            bucketed.push(SymbolLang::new(symbol, vec![class_of[&func.ops[op].operands[0]]]));
        }
    }
    egraph.rebuild();

    // Equality saturation.
    let mut iterations = 0;
    // Nodes that exist only because an all-reduce was split: one extraction policy leaves
    // them out, keeping every all-reduce whole.
    let mut split_nodes: Vec<SymbolLang> = Vec::new();
    let stop = loop {
        if packing {
            break "saturated";
        }
        if iterations >= options.iteration_limit {
            break "iteration limit";
        }
        if egraph.total_size() >= options.node_limit {
            break "node limit";
        }
        if start.elapsed() >= options.time_limit {
            break "time limit";
        }
        iterations += 1;
        let matches = search(&egraph);
        let mut changed = false;
        // New classes take the position of the class they join.
        let mut at: HashMap<Id, f64> = HashMap::default();
        for (id, p) in &position {
            let e = at.entry(egraph.find(*id)).or_insert(*p);
            *e = e.min(*p);
        }
        for (rule, target, term) in matches {
            if egraph.total_size() >= options.node_limit {
                break;
            }
            let target = add(&mut egraph, target);
            let id = if rule == "split-all-reduce" { add_recording(&mut egraph, term, &mut split_nodes) } else { add(&mut egraph, term) };
            position.push((id, at.get(&egraph.find(target)).copied().unwrap_or(f64::MAX / 32.0)));
            if egraph.union(target, id) {
                changed = true;
                *rules.entry(rule.to_string()).or_insert(0) += 1;
            }
        }
        egraph.rebuild();
        if !changed {
            break "saturated";
        }
    };

    // Extraction: a few candidate programs, and the one the cluster model prices lowest. The
    // original program is one of them, so the pass never makes a step costlier by its model.
    let mut order: HashMap<Id, f64> = HashMap::default();
    for (id, at) in &position {
        let c = egraph.find(*id);
        let e = order.entry(c).or_insert(*at);
        *e = e.min(*at);
    }
    let roots: Vec<Id> = roots.iter().map(|r| egraph.find(*r)).collect();
    let mut candidates = Vec::new();
    let split_nodes: HashSet<SymbolLang> = split_nodes.iter().map(|n| n.clone().map_children(|c| egraph.find(c))).collect();
    // Two policies: every node, and every node but those of split all-reduces (whole
    // all-reduces, where the first policy's greedy choices would mix both forms). The first
    // runs twice, the second time counting what the first keeps as already paid.
    // A third policy takes the buckets: their whole benefit (one launch for two messages) is
    // shared by two classes, which greedy extraction cannot see.
    let mut whole_and_bucketed = split_nodes.clone();
    whole_and_bucketed.extend(bucketed.iter().map(|n| n.clone().map_children(|c| egraph.find(c))));
    let policies: Vec<(HashSet<SymbolLang>, usize)> = if packing { vec![(whole_and_bucketed, 1)] } else { vec![(HashSet::default(), 2), (split_nodes, 1)] };
    // The policies are independent: one thread each.
    let per_policy: Vec<Vec<HashMap<Id, SymbolLang>>> = std::thread::scope(|s| {
        let handles: Vec<_> = policies
            .iter()
            .map(|(policy, rounds)| {
                let (egraph, order, roots) = (&egraph, &order, &roots);
                s.spawn(move || {
                    let mut paid: HashSet<Id> = HashSet::default();
                    let mut out = Vec::new();
                    for _ in 0..*rounds {
                        let choice = extract(egraph, &options.cluster, order, &paid, policy);
                        paid = boundary_operands(egraph, &choice, roots);
                        out.push(choice);
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    candidates.extend(per_policy.into_iter().flatten());
    let mut cost = Cost { egraph: &egraph, cluster: &options.cluster };
    let baseline = func_cost(func, grid, &options.cluster);
    let priced: Vec<(f64, HashMap<Id, SymbolLang>)> = candidates.into_iter().filter_map(|choice| program_cost(&egraph, &mut cost, &choice, &roots).map(|c| (c, choice))).collect();
    let best = priced.into_iter().min_by(|a, b| a.0.total_cmp(&b.0));
    let out = match best {
        Some((c, choice)) if c < baseline * (1.0 - 1e-9) => emit(func, &egraph, &choice, &roots, &order, &original, grid_name)?,
        _ => func.clone(),
    };
    let after = price(&out, grid, &options.cluster);
    let report = CommOptReport {
        time_before: before.0,
        time_after: after.0,
        bytes_before: before.1,
        bytes_after: after.1,
        collectives_before: before.2,
        collectives_after: after.2,
        rules,
        enodes: egraph.total_number_of_nodes(),
        eclasses: egraph.number_of_classes(),
        iterations,
        stop: stop.into(),
        seconds: start.elapsed().as_secs_f64(),
    };
    Ok((out, report))
}

/// The modelled cost of `func` as it is: every op and collective once.
fn func_cost(func: &Func, grid: &[i64], cluster: &Cluster) -> f64 {
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

/// The classes a choice reaches from the roots, in no particular order; `None` when some
/// class has no choice or the choice has a cycle.
fn reachable(egraph: &Graph, choice: &HashMap<Id, SymbolLang>, roots: &[Id]) -> Option<Vec<Id>> {
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
fn program_cost(egraph: &Graph, cost: &mut Cost<'_>, choice: &HashMap<Id, SymbolLang>, roots: &[Id]) -> Option<f64> {
    let classes = reachable(egraph, choice, roots)?;
    Some(classes.iter().map(|c| cost.cost(&choice[c], |_| 0.0)).sum())
}

/// Operand classes of the opaque and heavy ops a choice keeps: they are computed whatever
/// else is chosen, so the next extraction counts them as paid.
fn boundary_operands(egraph: &Graph, choice: &HashMap<Id, SymbolLang>, roots: &[Id]) -> HashSet<Id> {
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

/// Rebuilds the function from a choice, ops in their original order as far as dependencies
/// allow.
fn emit(func: &Func, egraph: &Graph, choice: &HashMap<Id, SymbolLang>, roots: &[Id], order: &HashMap<Id, f64>, original: &HashMap<(Id, Symbol), usize>, grid_name: &str) -> Result<Func, String> {
    let tables = &egraph.analysis;
    let needed = reachable(egraph, choice, roots).ok_or("the extracted program has a cycle")?;
    let chosen = |c: Id| &choice[&egraph.find(c)];
    let mut waiting: HashMap<Id, usize> = HashMap::default();
    let mut readers: HashMap<Id, Vec<Id>> = HashMap::default();
    for &c in &needed {
        let deps: HashSet<Id> = chosen(c).children.iter().map(|k| egraph.find(*k)).collect();
        waiting.insert(c, deps.len());
        for d in deps {
            readers.entry(d).or_default().push(c);
        }
    }
    let key = |c: Id| std::cmp::Reverse(((order.get(&c).copied().unwrap_or(f64::MAX / 32.0) * 16.0) as i64, usize::from(c)));
    let mut ready: BinaryHeap<(std::cmp::Reverse<(i64, usize)>, Id)> = needed.iter().filter(|c| waiting[c] == 0).map(|&c| (key(c), c)).collect();
    // Original op of each (class, symbol), to keep its attributes and location.
    let original_of: HashMap<(Id, Symbol), usize> = original.iter().map(|((id, s), i)| ((egraph.find(*id), *s), *i)).collect();

    let mut fb = FuncBuilder::new(&func.name);
    for arg in &func.args {
        let v = fb.arg_like(arg, func.ty(arg.value).clone());
        if let Some(layout) = &arg.layout {
            fb.set_layout(v, layout.clone());
        }
    }
    // FuncBuilder numbers arguments in declaration order.
    let arg_values: Vec<Value> = (0..func.args.len() as u32).map(Value).collect();
    let mut value_of: HashMap<Id, Value> = HashMap::default();
    let mut tuple_of: HashMap<Id, Vec<Value>> = HashMap::default();
    // Location of what made each class, so a new collective is named after its operand.
    let mut loc_of: HashMap<Id, String> = HashMap::default();
    // Bucket numbers of comm-opt's own buckets, apart from the gradient buckets' (from 0).
    let mut next_bucket: i64 = 1 << 20;
    while let Some((_, c)) = ready.pop() {
        let node = chosen(c);
        let kids: Vec<Value> = node.children.iter().filter_map(|k| value_of.get(&egraph.find(*k)).copied()).collect();
        let ty = || egraph[c].data.ty.clone().map(Type::Tensor).ok_or_else(|| "an extracted value has no type".to_string());
        let results: Vec<Value> = match &tables.kinds[&node.op] {
            Kind::Arg(i) => vec![arg_values[*i]],
            Kind::Opaque(i) => {
                let op = &func.ops[*i];
                fb.clone_op(func, op, &kids, &op.loc)
            }
            Kind::Proj(k) => {
                let tuple = tuple_of.get(&egraph.find(node.children[0])).ok_or("a projection of a value that is not a tuple")?;
                vec![tuple[*k]]
            }
            Kind::Xf { name, attrs, loc } => {
                let types = result_types(egraph, node).ok_or_else(|| format!("{}: `{name}` has no result types", tables.locs[*loc]))?;
                let mut attrs = tables.attrs[*attrs].clone();
                if name == "xf.split_heads" {
                    attrs = attrs.with("heads", AttrValue::Int(types[0].shape[1]));
                }
                fb.op_typed(name, &kids, attrs, types.into_iter().map(Type::Tensor).collect(), &tables.locs[*loc])
            }
            Kind::Coll { op: CollOp::Bucket, axes } => {
                // Both members staged, sent as one message, then awaited (the runtime's
                // gradient-bucket protocol).
                next_bucket += 1;
                let id = AttrValue::Int(next_bucket);
                let (name, base) = collective_attrs(CollOp::Bucket, axes, grid_name);
                let member = |loc: &str| {
                    base.clone()
                        .with("xf.async", AttrValue::Bool(true))
                        .with("xf.bucket", id.clone())
                        .with("xf.bucket_members", AttrValue::Int(2))
                        .with("xf.cause", AttrValue::Str(format!("bucketed by comm-opt with the all-reduce of `{loc}`")))
                };
                let locs: Vec<String> = node.children.iter().map(|k| loc_of.get(&egraph.find(*k)).cloned().unwrap_or_default()).collect();
                let types = result_types(egraph, node).ok_or("a bucket of untyped values")?;
                let sent: Vec<Value> = (0..2).map(|k| fb.op_typed(&name, &[kids[k]], member(&locs[1 - k]), vec![Type::Tensor(types[k].clone())], &format!("{}.all_reduce", locs[k]))[0]).collect();
                (0..2).map(|k| fb.op_typed("xf.wait", &[sent[k]], Attrs::new().with("xf.bucket", id.clone()), vec![Type::Tensor(types[k].clone())], &format!("{}.all_reduce.wait", locs[k]))[0]).collect()
            }
            Kind::Coll { op, axes } => {
                let (name, attrs, loc) = match original_of.get(&(c, node.op)) {
                    Some(&i) => (func.ops[i].name.clone(), func.ops[i].attrs.clone(), func.ops[i].loc.clone()),
                    None => {
                        let (name, attrs) = collective_attrs(*op, axes, grid_name);
                        let operand = loc_of.get(&egraph.find(node.children[0])).cloned().unwrap_or_else(|| "comm-opt".into());
                        let loc = format!("{operand}.{}", name.trim_start_matches("shard."));
                        (name, attrs.with("xf.cause", AttrValue::Str("chosen by comm-opt".into())), loc)
                    }
                };
                fb.op_typed(&name, &kids, attrs, vec![ty()?], &loc)
            }
        };
        let made_at = match &tables.kinds[&node.op] {
            Kind::Arg(i) => func.args[*i].name.clone(),
            Kind::Opaque(i) => func.ops[*i].loc.clone(),
            Kind::Xf { loc, .. } => tables.locs[*loc].clone(),
            Kind::Proj(_) | Kind::Coll { .. } => node.children.first().and_then(|k| loc_of.get(&egraph.find(*k)).cloned()).unwrap_or_default(),
        };
        loc_of.insert(c, made_at);
        if results.len() == 1 {
            value_of.insert(c, results[0]);
        } else {
            tuple_of.insert(c, results);
        }
        for r in readers.get(&c).cloned().unwrap_or_default() {
            let w = waiting.get_mut(&r).expect("every reader is needed");
            *w -= 1;
            if *w == 0 {
                ready.push((key(r), r));
            }
        }
    }
    let returns: Vec<Value> = roots.iter().map(|r| value_of.get(&egraph.find(*r)).copied().ok_or("a result was not rebuilt")).collect::<Result<_, _>>()?;
    Ok(fb.finish(&returns, &func.result_names))
}

/// The collective an op is, if the pass rewrites it.
fn collective_kind(op: &shardc_ir::Op) -> Option<Kind> {
    // Gradient buckets, and gathers of a parameter made for one reader (ZeRO-3: merging two
    // would hold the whole parameter between its readers), stay as they are.
    if op.attrs.get("xf.async").is_some() || op.attrs.get("xf.bucket").is_some() || op.attrs.get("xf.per_reader").is_some() {
        return None;
    }
    any_collective(op)
}

/// The collective an op is, whether or not the pass may rewrite it.
fn any_collective(op: &shardc_ir::Op) -> Option<Kind> {
    let int = |name: &str| match op.attrs.get(name)? {
        AttrValue::Raw(raw) => raw.trim_end_matches(" : index").trim().parse::<usize>().ok(),
        AttrValue::Int(i) => usize::try_from(*i).ok(),
        _ => None,
    };
    let axes: Vec<u16> = match op.attrs.get("grid_axes")? {
        AttrValue::Raw(raw) => raw.split_once(':')?.1.trim_end_matches('>').split(',').map(str::trim).filter(|t| !t.is_empty()).map(|t| t.parse().ok()).collect::<Option<_>>()?,
        _ => return None,
    };
    let op_kind = match op.name.as_str() {
        "shard.all_gather" => CollOp::Gather(int("gather_axis")?),
        "shard.all_slice" => CollOp::Slice(int("slice_axis")?),
        "shard.reduce_scatter" => CollOp::ReduceScatter(int("scatter_axis")?),
        "shard.all_reduce" => CollOp::Reduce { max: matches!(op.attrs.get("reduction"), Some(AttrValue::Raw(r)) if r.contains("max")) },
        "shard.broadcast" => match op.attrs.get("root") {
            // A static root only; its position in the group is fixed by the grid.
            Some(AttrValue::Raw(raw)) if raw.starts_with("array<i64:") && op.operands.len() == 1 => {
                let index: Vec<usize> = raw.split_once(':')?.1.trim_end_matches('>').split(',').map(str::trim).filter(|t| !t.is_empty()).map(|t| t.parse().ok()).collect::<Option<_>>()?;
                CollOp::Broadcast(index.first().copied().unwrap_or(0))
            }
            _ => return None,
        },
        _ => return None,
    };
    Some(Kind::Coll { op: op_kind, axes })
}

/// The `shard` op name and attributes of a new collective.
fn collective_attrs(op: CollOp, axes: &[u16], grid: &str) -> (String, Attrs) {
    let axes_attr = AttrValue::Raw(format!("array<i16: {}>", axes.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", ")));
    let base = Attrs::new().with("grid", AttrValue::Raw(format!("@{grid}"))).with("grid_axes", axes_attr);
    let sum = AttrValue::Raw("#shard<partial sum>".into());
    match op {
        CollOp::Gather(d) => ("shard.all_gather".into(), base.with("gather_axis", AttrValue::Raw(format!("{d} : index")))),
        CollOp::Slice(d) => ("shard.all_slice".into(), base.with("slice_axis", AttrValue::Raw(format!("{d} : index")))),
        CollOp::ReduceScatter(d) => ("shard.reduce_scatter".into(), base.with("reduction", sum).with("scatter_axis", AttrValue::Raw(format!("{d} : index")))),
        CollOp::Reduce { max } => ("shard.all_reduce".into(), base.with("reduction", if max { AttrValue::Raw("#shard<partial max>".into()) } else { sum })),
        CollOp::Broadcast(root) => ("shard.broadcast".into(), base.with("root", AttrValue::Raw(format!("array<i64: {root}>")))),
        CollOp::Bucket => ("shard.all_reduce".into(), base.with("reduction", AttrValue::Raw("#shard<partial sum>".into()))),
    }
}

/// (seconds, bytes, count) of the collectives of `func`.
pub fn price(func: &Func, grid: &[i64], cluster: &Cluster) -> (f64, f64, usize) {
    let mut total = (0.0, 0.0, 0);
    // A bucket's members travel as one all-reduce.
    let mut buckets: BTreeMap<i64, (Vec<usize>, f64)> = BTreeMap::new();
    for op in func.ops.iter().filter(|o| o.name == "shard.all_reduce") {
        if let (Some(AttrValue::Int(b)), Some(t)) = (op.attrs.get("xf.bucket"), func.tensor(op.results[0])) {
            let axes = match op.attrs.get("grid_axes") {
                Some(AttrValue::Raw(raw)) => raw.split_once(':').map_or(Vec::new(), |(_, l)| l.trim_end_matches('>').split(',').filter_map(|t| t.trim().parse().ok()).collect()),
                _ => Vec::new(),
            };
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

fn collective_cost_shape(op: CollOp, input: &TensorTy, output: &TensorTy) -> (Collective, f64) {
    match op {
        CollOp::Gather(_) => (Collective::AllGather, output.bytes() as f64),
        CollOp::Slice(_) => (Collective::AllSlice, input.bytes() as f64),
        CollOp::ReduceScatter(_) => (Collective::ReduceScatter, input.bytes() as f64),
        CollOp::Reduce { .. } => (Collective::AllReduce, input.bytes() as f64),
        CollOp::Broadcast(_) => (Collective::Broadcast, input.bytes() as f64),
        CollOp::Bucket => (Collective::AllReduce, input.bytes() as f64),
    }
}

/// Extraction cost: collective time by the cluster model, op time by the roofline.
struct Cost<'a> {
    egraph: &'a Graph,
    cluster: &'a Cluster,
}

/// Sweeps of greedy DAG extraction: costs only fall, but by ever smaller steps where choices
/// interact, so the sweeps stop here.
const MAX_SWEEPS: usize = 4;

/// Largest cost set extraction tracks per class.
const SET_CAP: usize = 48;

/// Every node costs at least this much, so that no cycle is free.
const EPSILON: f64 = 1e-12;

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

fn roofline(cluster: &Cluster, _func: &Func, name: &str, inputs: &[TensorTy], attrs: &Attrs) -> f64 {
    let Some(def) = lookup(name) else { return 0.0 };
    let refs: Vec<&TensorTy> = inputs.iter().collect();
    let Ok(outputs) = def.infer(&refs, attrs) else { return 0.0 };
    cluster.op_time(def, &refs, &outputs, attrs)
}

type Match = (&'static str, Term, Term);

/// Every rule's matches in the current e-graph: (rule, a term, an equal term).
fn search(egraph: &Graph) -> Vec<Match> {
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

/// Whether every rank of a group over `axes` holds the same value of class `id`: the
/// result of an all-reduce, all-gather or broadcast over those axes (or more), or an argument
/// whose layout does not split over them.
fn replicated_over(egraph: &Graph, id: Id, axes: &[u16]) -> bool {
    let bits = axis_bits(axes);
    egraph[egraph.find(id)].data.same & bits == bits
}

/// `add(all_reduce(x, a), all_reduce(y, a)) = all_reduce(add(x, y), a)` for same-shape operands.
fn sum_of_all_reduces(egraph: &Graph, here: Id, node: &SymbolLang, attrs: usize, loc: usize, out: &mut Vec<Match>) {
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
fn commute_gather(egraph: &Graph, here: Id, node: &SymbolLang, name: &str, attrs: usize, loc: usize, out: &mut Vec<Match>) {
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
            let mut local_attrs = tables.attrs[attrs].clone();
            if name == "xf.split_heads" {
                local_attrs = local_attrs.with("heads", AttrValue::Int(expected[0].shape[1]));
            }
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
