//! Shardings of tensors over a device grid, and the per-op sharding rules that propagation
//! and partitioning read.
//!
//! A [`Sharding`] says, for each tensor dimension, which grid axes split it (as upstream
//! `shard.sharding`'s `split_axes`), and over which axes the value is a pending partial sum.
//! MLIR 22's `shard.sharding` has no partial state, so partial axes travel as an
//! `xf.partial` attribute on the `shard.shard` op that annotates the value.
//!
//! A [`ShardingRule`] describes an op by factors, as Shardy does: every dimension of every
//! operand and result names a factor. A factor split over some axes splits every dimension
//! it names; a factor that appears in operands but in no result is a reduction, so splitting
//! it leaves the results partial over its axes; a blocked factor must not be split at all
//! (the normalised dimension of a norm, the softmax dimension of a loss).

use serde::{Deserialize, Serialize};

/// A grid axis index.
pub type Axis = u16;

/// How one tensor is laid out over the grid.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Sharding {
    /// For each tensor dimension, the grid axes that split it (outermost first).
    pub split: Vec<Vec<Axis>>,
    /// Grid axes over which the value is a partial sum still to be reduced.
    pub partial: Vec<Axis>,
}

impl Sharding {
    /// Fully replicated, for a tensor of `rank` dimensions.
    pub fn replicated(rank: usize) -> Sharding {
        Sharding { split: vec![Vec::new(); rank], partial: Vec::new() }
    }

    /// One dimension split over `axes`, the rest replicated.
    pub fn split_dim(rank: usize, dim: usize, axes: &[Axis]) -> Sharding {
        let mut s = Sharding::replicated(rank);
        s.split[dim] = axes.to_vec();
        s
    }

    /// Whether no dimension is split and nothing is partial.
    pub fn is_replicated(&self) -> bool {
        self.partial.is_empty() && self.split.iter().all(Vec::is_empty)
    }

    /// Every axis the value is split or partial over.
    pub fn axes(&self) -> Vec<Axis> {
        self.split.iter().flatten().chain(&self.partial).copied().collect()
    }

    /// The per-rank shape of a tensor of `global` shape on a grid of `grid` extents; an
    /// error names a dimension that does not divide evenly.
    pub fn local_shape(&self, global: &[i64], grid: &[i64]) -> Result<Vec<i64>, String> {
        global
            .iter()
            .zip(self.split.iter().chain(std::iter::repeat(&Vec::new())))
            .enumerate()
            .map(|(dim, (&extent, axes))| {
                let parts: i64 = axes.iter().map(|&a| grid.get(a as usize).copied().unwrap_or(1)).product();
                if parts == 0 || extent % parts != 0 {
                    Err(format!("dimension {dim} of extent {extent} does not split evenly into {parts} parts over grid axes {axes:?}"))
                } else {
                    Ok(extent / parts)
                }
            })
            .collect()
    }

    /// MLIR syntax of `split_axes`: `#shard<axisarray[[0], [], [1]]>`.
    pub fn split_axes_attr(&self) -> String {
        let dims: Vec<String> = if self.split.is_empty() {
            // MLIR needs at least one sub-array, even for a scalar.
            vec!["[]".to_string()]
        } else {
            self.split.iter().map(|axes| format!("[{}]", axes.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", "))).collect()
        };
        format!("#shard<axisarray[{}]>", dims.join(", "))
    }
}

impl std::fmt::Display for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dims: Vec<String> = self.split.iter().map(|a| format!("{a:?}")).collect();
        write!(f, "[{}]", dims.join(", "))?;
        if !self.partial.is_empty() {
            write!(f, " partial {:?}", self.partial)?;
        }
        Ok(())
    }
}

/// What a factor may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FactorKind {
    /// May be split; if it appears in no result, splitting it makes the results partial.
    Free,
    /// Must stay whole (its dimension is normalised or reduced non-linearly).
    Blocked,
    /// May be split, and the op's partitioned form reduces over it with collectives of its
    /// own (vocab-parallel cross-entropy): its results are complete, not partial, over the
    /// factor's axes.
    Collective,
}

/// How partial operands may pass through an op without being reduced first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Linearity {
    /// Partial operands are reduced before the op.
    None,
    /// Linear in all float operands together (add, scale, layout ops, sums): the result is
    /// partial when every float operand is partial over the same axes.
    Sum,
    /// Linear in each operand separately (matmul, mul): the result is partial when exactly
    /// one operand is partial.
    Product,
    /// The op reads only its operands' types, not their values (`fill_like`).
    IgnoresValues,
}

/// An op's sharding rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardingRule {
    /// For each operand, a factor per dimension.
    pub operands: Vec<Vec<usize>>,
    /// For each result, a factor per dimension.
    pub results: Vec<Vec<usize>>,
    /// Kind of each factor.
    pub factors: Vec<FactorKind>,
    /// How partial operands pass through.
    pub linearity: Linearity,
}

impl ShardingRule {
    /// Every dimension of every operand and result is its own blocked factor: the always
    /// correct rule (everything replicated) for ops without a better one.
    pub fn replicated(operand_ranks: &[usize], result_ranks: &[usize]) -> ShardingRule {
        let mut next = 0;
        let mut fresh = |rank: usize| {
            let dims: Vec<usize> = (next..next + rank).collect();
            next += rank;
            dims
        };
        let operands = operand_ranks.iter().map(|&r| fresh(r)).collect();
        let results = result_ranks.iter().map(|&r| fresh(r)).collect();
        ShardingRule { operands, results, factors: vec![FactorKind::Blocked; next], linearity: Linearity::None }
    }

    /// Element-wise: every operand and result has the same dimensions (same factors).
    pub fn elementwise(rank: usize, operands: usize, results: usize, linearity: Linearity) -> ShardingRule {
        let dims: Vec<usize> = (0..rank).collect();
        ShardingRule {
            operands: vec![dims.clone(); operands],
            results: vec![dims; results],
            factors: vec![FactorKind::Free; rank],
            linearity,
        }
    }

    /// Blocks factor `f`.
    pub fn block(mut self, f: usize) -> ShardingRule {
        self.factors[f] = FactorKind::Blocked;
        self
    }
}
