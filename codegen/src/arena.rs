//! Placing temporaries in one arena, greedy by size, in time that grows with the number of
//! temporaries times a logarithm rather than with the number of pairs alive together.
//!
//! The memory plan ([`crate::lower_func_on`]) places the largest temporaries first, each at
//! the lowest aligned offset where it overlaps no placed temporary whose lifetime meets its
//! own. Listing those placed temporaries for every new one is quadratic in the depth of a
//! model: a training step keeps every layer's activations (and, with clipping, every
//! gradient) alive across most of the step, so each temporary meets a number of others that
//! grows with the layers. [`place`] finds the same offset without listing them, from a
//! segment tree over instruction indices whose nodes hold unions of occupied offset ranges.

use std::collections::BTreeMap;

/// A temporary to place: `bytes` (a multiple of 16) alive from instruction `first` to
/// instruction `last`, both included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Item {
    /// Size in bytes.
    pub bytes: usize,
    /// First instruction that uses it.
    pub first: usize,
    /// Last instruction that uses it (at least `first`).
    pub last: usize,
    /// Offsets are rounded up to a multiple of this (a power of two).
    pub align: usize,
}

/// Places `items` in order, each at the lowest offset that is a multiple of its `align` and
/// where it overlaps no earlier item alive at some instruction it is alive at. Returns each
/// item's offset and the arena's size (the highest end).
///
/// The offset is a function of the occupied ranges alone: scanning the overlapping items by
/// offset and moving past each one that is in the way (the plan's definition) stops at the
/// lowest aligned offset where the item fits, because no aligned fit can lie below the end
/// of a range that reaches past it. So any search that finds the lowest fit gives the same
/// plan; the test `arena_matches_the_quadratic_scan` checks this against the scan.
pub fn place(items: &[Item]) -> (Vec<usize>, usize) {
    let times = items.iter().map(|i| i.last.max(i.first) + 1).max().unwrap_or(0);
    let mut tree = TimeTree::new(times);
    let mut offsets = Vec::with_capacity(items.len());
    let mut arena = 0usize;
    for item in items {
        let (first, end) = (item.first, item.last.max(item.first) + 1);
        let offset = tree.lowest_fit(first, end, item.bytes, item.align.max(1));
        let top = offset.saturating_add(item.bytes);
        tree.insert(1, 0, tree.size, first, end, offset, top);
        offsets.push(offset);
        arena = arena.max(top);
    }
    (offsets, arena)
}

/// Disjoint offset ranges `[start, end)`, merged where they touch, by start.
#[derive(Clone, Debug, Default)]
struct Occupied(BTreeMap<usize, usize>);

impl Occupied {
    /// Adds `[start, end)`, merging it with every range it overlaps or touches.
    fn insert(&mut self, start: usize, end: usize) {
        let (mut start, mut end) = (start, end);
        if let Some((&s, &e)) = self.0.range(..=start).next_back()
            && e >= start
        {
            start = s;
            end = end.max(e);
        }
        while let Some((&s, &e)) = self.0.range(start..=end).next() {
            self.0.remove(&s);
            end = end.max(e);
        }
        self.0.insert(start, end);
    }

    /// The lowest offset at or above `from`, among `from` and `up(end)` of the ranges, where
    /// `bytes` overlap no range.
    fn first_fit(&self, from: usize, bytes: usize, up: impl Fn(usize) -> usize) -> usize {
        let mut offset = from;
        // The range starting last below the item's end ends last of those (they are
        // disjoint): the item fits unless that one reaches past its start.
        while let Some((_, &end)) = self.0.range(..offset.saturating_add(bytes)).next_back()
            && end > offset
        {
            offset = up(end);
        }
        offset
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Depth of the deepest nodes that keep a complete union (below: the root is depth 0).
const COMPLETE_DEPTH: u32 = 8;

/// A segment tree over instruction indices. An item alive over `[first, end)` is stored at
/// the nodes that cover that span exactly (`whole`: it is alive over all of theirs) and in
/// `within` of those nodes and all their ancestors. The items alive at some instruction of
/// a span are then `within` of the nodes covering the span and `whole` of those nodes'
/// ancestors, about 2 log(instructions) unions in all.
///
/// Long-lived items (kept activations, gradients waiting for the update) sit in `whole` of
/// nodes near the root, a different node for each span, so their offsets interleave across
/// those unions: no union has a long run of touching ranges, and a search that moves past one
/// range of one union at a time passes every long-lived item below its fit (quadratic in
/// depth again). The nodes of the top [`COMPLETE_DEPTH`] levels therefore also keep
/// `complete`, the union of `whole` over the node and its ancestors, where those items merge
/// into a few ranges; an item stored at such a node is added to the complete unions of its
/// descendants down to that depth (at most 2^COMPLETE_DEPTH of them).
struct TimeTree {
    /// Leaves: a power of two at least the number of instructions.
    size: usize,
    /// Per node (1 the root, `2n` and `2n + 1` the children of `n`): items covering it.
    whole: Vec<Occupied>,
    /// Per node: items stored at it or below it.
    within: Vec<Occupied>,
    /// Per node of depth at most [`COMPLETE_DEPTH`]: items covering it or an ancestor.
    complete: Vec<Occupied>,
}

impl TimeTree {
    fn new(times: usize) -> Self {
        let size = times.max(1).next_power_of_two();
        let complete_nodes = (2usize << COMPLETE_DEPTH).min(2 * size);
        TimeTree { size, whole: vec![Occupied::default(); 2 * size], within: vec![Occupied::default(); 2 * size], complete: vec![Occupied::default(); complete_nodes] }
    }

    /// Adds `[offset, top)` to the complete unions of `node` and its descendants.
    fn complete_below(&mut self, node: usize, offset: usize, top: usize) {
        if node >= self.complete.len() {
            return;
        }
        self.complete[node].insert(offset, top);
        self.complete_below(2 * node, offset, top);
        self.complete_below(2 * node + 1, offset, top);
    }

    /// The lowest offset, a multiple of `align`, where `bytes` overlap nothing stored at
    /// some instruction of `[first, end)`.
    fn lowest_fit(&self, first: usize, end: usize, bytes: usize, align: usize) -> usize {
        let up = |x: usize| x.div_ceil(align).saturating_mul(align);
        // The offset ranges taken at some instruction of [first, end): a few unions.
        let mut sets = Vec::new();
        self.collect(1, 0, self.size, first, end, &mut sets);
        // Move up while any union is in the way. Each move passes a whole occupied range of
        // one union, and never the lowest common fit.
        let mut offset = 0usize;
        loop {
            let before = offset;
            for set in &sets {
                offset = set.first_fit(offset, bytes, up);
            }
            if offset == before {
                return offset;
            }
        }
    }

    /// Adds offsets `[offset, top)` over instructions `[first, end)`; `node` spans `[lo, hi)`.
    #[allow(clippy::too_many_arguments)]
    fn insert(&mut self, node: usize, lo: usize, hi: usize, first: usize, end: usize, offset: usize, top: usize) {
        if end <= lo || hi <= first {
            return;
        }
        self.within[node].insert(offset, top);
        if first <= lo && hi <= end {
            self.whole[node].insert(offset, top);
            self.complete_below(node, offset, top);
            return;
        }
        let mid = lo + (hi - lo) / 2;
        self.insert(2 * node, lo, mid, first, end, offset, top);
        self.insert(2 * node + 1, mid, hi, first, end, offset, top);
    }

    /// Pushes the unions holding every item alive at some instruction of `[first, end)`.
    fn collect<'a>(&'a self, node: usize, lo: usize, hi: usize, first: usize, end: usize, out: &mut Vec<&'a Occupied>) {
        if end <= lo || hi <= first {
            return;
        }
        let mut push = |set: &'a Occupied| {
            if !set.is_empty() {
                out.push(set);
            }
        };
        // Above the complete depth, ancestors' `whole` is left to a complete union below.
        let depth = node.ilog2();
        if first <= lo && hi <= end {
            push(&self.within[node]);
            if depth <= COMPLETE_DEPTH && node > 1 {
                push(&self.complete[node / 2]);
            }
            return;
        }
        if depth == COMPLETE_DEPTH {
            push(&self.complete[node]);
        } else if depth > COMPLETE_DEPTH {
            push(&self.whole[node]);
        }
        let mid = lo + (hi - lo) / 2;
        self.collect(2 * node, lo, mid, first, end, out);
        self.collect(2 * node + 1, mid, hi, first, end, out);
    }
}
