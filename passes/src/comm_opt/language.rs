//! The e-graph's language: what an e-node stands for (collectives, `xf` ops, opaque ops,
//! projections), the tables its symbols refer to, terms to add, and the lowering of the IR's
//! collectives to it and back.

use super::*;

/// What an e-node stands for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Kind {
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
pub(super) enum CollOp {
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
pub(super) struct Tables {
    pub(super) func: Func,
    pub(super) grid: Vec<i64>,
    pub(super) kinds: HashMap<Symbol, Kind>,
    pub(super) symbols: HashMap<Kind, Symbol>,
    pub(super) attrs: Vec<Attrs>,
    /// Indices into `attrs` by [`attrs_hash`], ascending: finding a table entry equal to new
    /// attributes looks at the few with their hash, not the whole table (which has an entry
    /// per op, so a search per rewrite is quadratic in the depth of the model).
    pub(super) attrs_by_hash: HashMap<u64, Vec<usize>>,
    pub(super) locs: Vec<(String, shardc_ir::facts::Origin)>,
}

/// A hash of attributes that equal attributes share (`0.0 == -0.0`, so both hash as zero).
pub(super) fn attrs_hash(attrs: &Attrs) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = rustc_hash::FxHasher::default();
    for (name, value) in attrs.iter() {
        name.hash(&mut hasher);
        match value {
            AttrValue::Int(v) => (0u8, v).hash(&mut hasher),
            AttrValue::Float(v) => (1u8, if *v == 0.0 { 0 } else { v.to_bits() }).hash(&mut hasher),
            AttrValue::Bool(v) => (2u8, v).hash(&mut hasher),
            AttrValue::Str(v) => (3u8, v).hash(&mut hasher),
            AttrValue::Symbol(v) => (4u8, v).hash(&mut hasher),
            AttrValue::Index(v) => (5u8, v).hash(&mut hasher),
            AttrValue::Axes(v) => (6u8, v).hash(&mut hasher),
            AttrValue::Ints(v) => (7u8, v).hash(&mut hasher),
            AttrValue::Reduction(v) => (8u8, v).hash(&mut hasher),
            AttrValue::Type(v) => (9u8, v).hash(&mut hasher),
            AttrValue::Unit => 10u8.hash(&mut hasher),
        }
    }
    hasher.finish()
}

impl Tables {
    pub(super) fn symbol(&mut self, kind: Kind) -> Symbol {
        if let Some(s) = self.symbols.get(&kind) {
            return *s;
        }
        let symbol = Symbol::from(format!("{kind:?}"));
        self.kinds.entry(symbol).or_insert_with(|| kind.clone());
        self.symbols.insert(kind, symbol);
        symbol
    }

    /// Adds `attrs` to the table as a new entry; returns its index.
    pub(super) fn push_attrs(&mut self, attrs: Attrs) -> usize {
        let index = self.attrs.len();
        self.attrs_by_hash.entry(attrs_hash(&attrs)).or_default().push(index);
        self.attrs.push(attrs);
        index
    }

    /// The index of the first table entry equal to `attrs`, added if there is none.
    pub(super) fn intern_attrs(&mut self, attrs: Attrs) -> usize {
        let found = self.attrs_by_hash.get(&attrs_hash(&attrs)).and_then(|same_hash| same_hash.iter().copied().find(|&i| self.attrs[i] == attrs));
        match found {
            Some(i) => i,
            None => self.push_attrs(attrs),
        }
    }

    pub(super) fn group(&self, axes: &[u16]) -> i64 {
        axes.iter().map(|&a| self.grid.get(a as usize).copied().unwrap_or(1)).product()
    }
}

pub(super) type Graph = EGraph<SymbolLang, Tables>;

/// The result types of an op node (args, opaque and `xf` ops; not collectives or projections).
pub(super) fn result_types(egraph: &Graph, node: &SymbolLang) -> Option<Vec<TensorTy>> {
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
pub(super) enum Term {
    Class(Id),
    Node(Kind, Vec<Term>),
    Op { name: String, attrs: Attrs, loc: usize, children: Vec<Term> },
}

pub(super) fn add(egraph: &mut Graph, term: Term) -> Id {
    add_recording(egraph, term, &mut Vec::new())
}

/// [`add`], recording every node of the term (not the classes it reuses) in `made`.
pub(super) fn add_recording(egraph: &mut Graph, term: Term, made: &mut Vec<SymbolLang>) -> Id {
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

pub(super) fn coll_pair(axes: &[u16], x: Id, y: Id) -> Term {
    Term::Node(Kind::Coll { op: CollOp::Bucket, axes: axes.to_vec() }, vec![Term::Class(x), Term::Class(y)])
}

pub(super) fn coll(op: CollOp, axes: &[u16], child: Term) -> Term {
    Term::Node(Kind::Coll { op, axes: axes.to_vec() }, vec![child])
}

/// Ops whose attributes or meaning depend on where a split lies, and heavy ops (the
/// matmuls and attention that partitioning placed): never moved across a gather.
pub(super) fn pinned_op(name: &str) -> bool {
    heavy_op(name) || name.starts_with("xf.cross_entropy") || name == "xf.row_max"
}

/// Ops whose cost dwarfs moving data and whose layout partitioning fixed (the matmuls next
/// to the tensor-parallel collectives): their e-classes hold one form, and extraction treats
/// them as region boundaries. Attention is not among them: it runs on any heads' shard.
pub(super) fn heavy_op(name: &str) -> bool {
    name.starts_with("xf.matmul") || name.starts_with("xf.embedding") || name == "xf.adamw" || name == "xf.sgd"
}

/// The collective an op is, if the pass rewrites it.
pub(super) fn collective_kind(op: &shardc_ir::Op) -> Option<Kind> {
    // Gradient buckets, and gathers of a parameter made for one reader (ZeRO-3: merging two
    // would hold the whole parameter between its readers), stay as they are.
    if op.attrs.get("xf.async").is_some() || op.attrs.get("xf.bucket").is_some() || op.attrs.get("xf.per_reader").is_some() {
        return None;
    }
    any_collective(op)
}

/// The collective an op is, whether or not the pass may rewrite it.
pub(super) fn any_collective(op: &shardc_ir::Op) -> Option<Kind> {
    let int = |name: &str| op.attrs.index(name).ok();
    let axes = op.attrs.axes("grid_axes").ok()?;
    let op_kind = match op.name.as_str() {
        "shard.all_gather" => CollOp::Gather(int("gather_axis")?),
        "shard.all_slice" => CollOp::Slice(int("slice_axis")?),
        "shard.reduce_scatter" => CollOp::ReduceScatter(int("scatter_axis")?),
        "shard.all_reduce" => CollOp::Reduce { max: op.attrs.reduction("reduction") == Ok(Reduction::Max) },
        "shard.broadcast" => match op.attrs.get("root") {
            // A static root only; its position in the group is fixed by the grid.
            Some(AttrValue::Ints(index)) if op.operands.len() == 1 => CollOp::Broadcast(usize::try_from(index.first().copied().unwrap_or(0)).ok()?),
            _ => return None,
        },
        _ => return None,
    };
    Some(Kind::Coll { op: op_kind, axes })
}

/// The `shard` op name and attributes of a new collective.
pub(super) fn collective_attrs(op: CollOp, axes: &[u16], grid: &str) -> (String, Attrs) {
    let base = Attrs::new().with("grid", AttrValue::Symbol(grid.to_string())).with("grid_axes", AttrValue::axes(axes));
    let sum = AttrValue::Reduction(Reduction::Sum);
    match op {
        CollOp::Gather(d) => ("shard.all_gather".into(), base.with("gather_axis", AttrValue::Index(d))),
        CollOp::Slice(d) => ("shard.all_slice".into(), base.with("slice_axis", AttrValue::Index(d))),
        CollOp::ReduceScatter(d) => ("shard.reduce_scatter".into(), base.with("reduction", sum).with("scatter_axis", AttrValue::Index(d))),
        CollOp::Reduce { max } => ("shard.all_reduce".into(), base.with("reduction", if max { AttrValue::Reduction(Reduction::Max) } else { sum })),
        CollOp::Broadcast(root) => ("shard.broadcast".into(), base.with("root", AttrValue::Ints(vec![root as i64]))),
        CollOp::Bucket => ("shard.all_reduce".into(), base.with("reduction", sum)),
    }
}
