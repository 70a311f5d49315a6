//! The analysis every e-class carries: its local type, and the grid axes over which every
//! rank of a group holds the same value.
//!
//! Purity: an op's result is taken to be the same on every rank of a group wherever its
//! operands are. That holds for an `xf` op that is a function of its operands and attributes
//! alone. The ops that read their rank's offset into a split table or vocabulary (the
//! embedding and the vocab-parallel loss's pieces, marked `xf.row_split_axes` or
//! `xf.vocab_split_axes`, and the ops that read positions of a sequence split by context
//! parallelism, marked `xf.seq_split_axes`: the attributes every backend's kernels take the
//! offset from, see `runtime::cpu::split_rows` and `seq_offset`) are not: their results differ along those axes whatever their
//! operands, and [`rank_dependent_axes`] takes the axes away.

use super::*;

/// What the analysis knows of an e-class: its local type, and the grid axes over which every
/// rank of a group holds the same value (bit `a` for axis `a`).
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct ClassData {
    pub(super) ty: Option<TensorTy>,
    pub(super) same: u8,
}

/// Attributes naming the grid axes along which an op reads its rank's offset.
pub(super) const RANK_OFFSET_ATTRS: [&str; 3] = ["xf.row_split_axes", "xf.vocab_split_axes", "xf.seq_split_axes"];

/// The grid axes along which an op's result depends on the rank whatever its operands (bits
/// as [`axis_bits`]). An attribute of that name whose axes cannot be read counts as every
/// axis: unknown, so never replicated.
pub(super) fn rank_dependent_axes(attrs: &Attrs) -> u8 {
    RANK_OFFSET_ATTRS.iter().filter(|name| attrs.get(name).is_some()).fold(0, |bits, name| bits | attrs.axes(name).map_or(u8::MAX, |axes| axis_bits(&axes)))
}

pub(super) fn axis_bits(axes: &[u16]) -> u8 {
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
            Some(Kind::Xf { attrs, .. }) => children_same & !rank_dependent_axes(&tables.attrs[*attrs]),
            // A collective the pass does not rewrite (an all-to-all) hands each rank of its
            // group another part: never equal over its axes.
            Some(Kind::Opaque(i)) => {
                let op = &tables.func.ops[*i];
                let group = if op.name.starts_with("shard.") { op.attrs.axes("grid_axes").map_or(u8::MAX, |axes| axis_bits(&axes)) } else { 0 };
                children_same & !rank_dependent_axes(&op.attrs) & !group
            }
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
    pub(super) fn make_type(egraph: &Graph, enode: &SymbolLang) -> Option<TensorTy> {
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

/// Whether every rank of a group over `axes` holds the same value of class `id`: the
/// result of an all-reduce, all-gather or broadcast over those axes (or more), or an argument
/// whose layout does not split over them.
pub(super) fn replicated_over(egraph: &Graph, id: Id, axes: &[u16]) -> bool {
    let bits = axis_bits(axes);
    egraph[egraph.find(id)].data.same & bits == bits
}
