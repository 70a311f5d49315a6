//! Rank arithmetic on a device mesh: coordinates and the groups collectives run over.

/// Extent of each mesh axis. On the (dp, tp, pp) grid of a training mesh, ranks are numbered
/// as Megatron-LM numbers them: tensor-parallel ranks adjacent, then data-parallel, then
/// pipeline (rank = tp + TP (dp + DP pp)), so that under torchrun, which gives a node
/// consecutive ranks, a tensor-parallel group stays inside a node, as the cost model
/// assumes. Any other grid is numbered row-major over its coordinates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshShape(pub Vec<usize>);

impl MeshShape {
    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.0.iter().product()
    }

    /// The axes from the one whose coordinate changes slowest with the rank to the fastest.
    fn slowest_first(&self) -> Vec<usize> {
        match self.0.len() {
            // A training grid, (dp, tp, pp), (dp, tp, pp, cp) or (dp, tp, pp, cp, ep): pp
            // slowest, then dp, ep, cp, tp fastest.
            n @ (3..=5) => shardc_ir::cluster::RANK_ORDER.iter().rev().copied().filter(|&a| a < n).collect(),
            n => (0..n).collect(),
        }
    }

    /// Coordinates of `rank`.
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        let mut coords = vec![0; self.0.len()];
        let mut rest = rank;
        for axis in self.slowest_first().into_iter().rev() {
            coords[axis] = rest % self.0[axis];
            rest /= self.0[axis];
        }
        coords
    }

    /// The rank at `coords`.
    pub fn rank(&self, coords: &[usize]) -> usize {
        self.slowest_first().into_iter().fold(0, |acc, axis| acc * self.0[axis] + coords[axis])
    }

    /// Coordinates of `rank` numbered row-major (pp fastest on a training mesh): the order of
    /// checkpoints written before format 2.
    pub fn row_major_coords(&self, rank: usize) -> Vec<usize> {
        let mut coords = vec![0; self.0.len()];
        let mut rest = rank;
        for (axis, &extent) in self.0.iter().enumerate().rev() {
            coords[axis] = rest % extent;
            rest /= extent;
        }
        coords
    }

    /// The ranks that share `rank`'s coordinates on every axis not in `axes`, ordered
    /// row-major over `axes` (in the order given): the group of a collective over `axes`.
    pub fn group(&self, rank: usize, axes: &[usize]) -> Vec<usize> {
        let base = self.coords(rank);
        let mut members = vec![base.clone()];
        for &axis in axes {
            members = members
                .into_iter()
                .flat_map(|c| {
                    (0..self.0[axis]).map(move |i| {
                        let mut c = c.clone();
                        c[axis] = i;
                        c
                    })
                })
                .collect();
        }
        members.iter().map(|c| self.rank(c)).collect()
    }
}
