//! Global tensors and their per-rank shards: cut a rank's shard out of a global tensor (to
//! initialise partitioned parameters identically to a single device, and to feed each rank
//! its slice of the batch), and put shards back together.

use crate::collectives::MeshShape;
use crate::program::Layout;

/// For each dimension: (number of parts, this rank's part index).
fn parts(layout: &Layout, mesh: &MeshShape, rank: usize) -> Vec<(usize, usize)> {
    let coords = mesh.coords(rank);
    layout
        .split
        .iter()
        .map(|axes| {
            // Row-major over the axes in the order listed, as the collectives order groups.
            axes.iter().fold((1, 0), |(n, i), &a| (n * mesh.0[a], i * mesh.0[a] + coords[a]))
        })
        .chain(std::iter::repeat((1, 0)))
        .take(layout.global_shape.len())
        .collect()
}

/// Calls `f(global_index, local_index)` for every element of `rank`'s shard.
fn for_each<F: FnMut(usize, usize)>(layout: &Layout, mesh: &MeshShape, rank: usize, mut f: F) {
    let shape = &layout.global_shape;
    let p = parts(layout, mesh, rank);
    let local: Vec<usize> = shape.iter().zip(&p).map(|(&g, &(n, _))| g / n.max(1)).collect();
    let total: usize = local.iter().product();
    let mut index = vec![0usize; shape.len()];
    for l in 0..total {
        // Global index of the local multi-index.
        let mut g = 0;
        for d in 0..shape.len() {
            g = g * shape[d] + p[d].1 * local[d] + index[d];
        }
        f(g, l);
        for d in (0..shape.len()).rev() {
            index[d] += 1;
            if index[d] < local[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// `rank`'s shard of `global`.
pub fn local_shard<T: Copy + Default>(global: &[T], layout: &Layout, mesh: &MeshShape, rank: usize) -> Vec<T> {
    let len = layout.global_shape.iter().zip(parts(layout, mesh, rank)).map(|(&g, (n, _))| g / n.max(1)).product();
    let mut out = vec![T::default(); len];
    for_each(layout, mesh, rank, |g, l| out[l] = global[g]);
    out
}

/// `rank`'s shard of a tensor whose global element `g` is `value(g)`, made element by element
/// (the global tensor is never materialised).
pub fn shard_from<T: Copy + Default>(layout: &Layout, mesh: &MeshShape, rank: usize, value: impl Fn(usize) -> T) -> Vec<T> {
    let len = layout.global_shape.iter().zip(parts(layout, mesh, rank)).map(|(&g, (n, _))| g / n.max(1)).product();
    let mut out = vec![T::default(); len];
    for_each(layout, mesh, rank, |g, l| out[l] = value(g));
    out
}

/// [`shard_from`] with `value` evaluated on every core (a large parameter's initial values).
pub fn shard_from_par<T: Copy + Default + Send>(layout: &Layout, mesh: &MeshShape, rank: usize, value: impl Fn(usize) -> T + Sync) -> Vec<T> {
    use rayon::prelude::*;
    let globals = shard_from(layout, mesh, rank, |g| g);
    globals.into_par_iter().map(&value).collect()
}

/// The global tensor from every rank's shard (`shards[rank]`); replicas overwrite each other
/// with what must be the same values.
pub fn assemble<T: Copy + Default>(shards: &[Vec<T>], layout: &Layout, mesh: &MeshShape) -> Vec<T> {
    let indexed: Vec<(usize, &[T])> = shards.iter().enumerate().map(|(rank, s)| (rank, s.as_slice())).collect();
    assemble_from(&indexed, layout, mesh)
}

/// The global tensor from the shards of the ranks that hold it, `(rank, shard)` (pipeline
/// stages hold only their own parameters).
pub fn assemble_some<T: Copy + Default>(shards: &[(usize, Vec<T>)], layout: &Layout, mesh: &MeshShape) -> Vec<T> {
    let indexed: Vec<(usize, &[T])> = shards.iter().map(|(rank, s)| (*rank, s.as_slice())).collect();
    assemble_from(&indexed, layout, mesh)
}

fn assemble_from<T: Copy + Default>(shards: &[(usize, &[T])], layout: &Layout, mesh: &MeshShape) -> Vec<T> {
    let mut out = vec![T::default(); layout.global_shape.iter().product()];
    for &(rank, shard) in shards {
        for_each(layout, mesh, rank, |g, l| out[g] = shard[l]);
    }
    out
}

/// The shape of every rank's shard.
pub fn local_shape(layout: &Layout, mesh: &MeshShape) -> Vec<usize> {
    layout.global_shape.iter().zip(parts(layout, mesh, 0)).map(|(&g, (n, _))| g / n.max(1)).collect()
}

/// Which shard of the tensor `rank` holds: its part index along each dimension (ranks that
/// differ only on axes the layout does not split hold the same shard).
pub fn shard_index(layout: &Layout, mesh: &MeshShape, rank: usize) -> Vec<usize> {
    parts(layout, mesh, rank).into_iter().map(|(_, index)| index).collect()
}

/// Where `rank`'s shard lies in the global tensor: (first index, extent) along each
/// dimension (shards are blocks).
pub fn shard_box(layout: &Layout, mesh: &MeshShape, rank: usize) -> Vec<(usize, usize)> {
    layout.global_shape.iter().zip(parts(layout, mesh, rank)).map(|(&g, (n, i))| (i * (g / n.max(1)), g / n.max(1))).collect()
}

/// Copies the elements of `region` (a range per dimension, in global indices) from `src`, a
/// block of the global tensor at `src_box` ((first index, extent) per dimension), into `dst`,
/// another block at `dst_box`; both blocks hold the whole region.
pub fn copy_region<T: Copy>(src: &[T], src_box: &[(usize, usize)], dst: &mut [T], dst_box: &[(usize, usize)], region: &[std::ops::Range<usize>]) {
    let rank = region.len();
    if rank == 0 {
        if let (Some(d), Some(s)) = (dst.first_mut(), src.first()) {
            *d = *s;
        }
        return;
    }
    if region.iter().any(|r| r.is_empty()) {
        return;
    }
    let strides = |b: &[(usize, usize)]| {
        let mut st = vec![1usize; rank];
        for d in (0..rank.saturating_sub(1)).rev() {
            st[d] = st[d + 1] * b[d + 1].1;
        }
        st
    };
    let (ss, ds) = (strides(src_box), strides(dst_box));
    let row = region[rank - 1].len();
    let mut index: Vec<usize> = region.iter().map(|r| r.start).collect();
    loop {
        let at = |b: &[(usize, usize)], st: &[usize]| index.iter().zip(b).zip(st).map(|((&x, &(o, _)), &s)| (x - o) * s).sum::<usize>();
        let (s0, d0) = (at(src_box, &ss), at(dst_box, &ds));
        dst[d0..d0 + row].copy_from_slice(&src[s0..s0 + row]);
        // The next row: the last dimension is copied whole, the others count up.
        let mut d = rank - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < region[d].end {
                break;
            }
            index[d] = region[d].start;
        }
    }
}

/// How many distinct shards the layout cuts the tensor into.
pub fn shard_count(layout: &Layout, mesh: &MeshShape) -> usize {
    parts(layout, mesh, 0).into_iter().map(|(n, _)| n).product()
}

/// Calls `f(padded_index, unpadded_index)` for each element of a tensor of `unpadded` shape
/// placed at the start of one of `shape` (every dimension at least as large).
fn for_each_unpadded<F: FnMut(usize, usize)>(shape: &[usize], unpadded: &[usize], mut f: F) {
    let total: usize = unpadded.iter().product();
    let mut index = vec![0usize; unpadded.len()];
    for u in 0..total {
        let p = index.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i);
        f(p, u);
        for d in (0..unpadded.len()).rev() {
            index[d] += 1;
            if index[d] < unpadded[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// `values` of a tensor of `unpadded` shape, padded with zeros to `shape` (a vocabulary
/// padded for tensor parallelism).
pub fn pad<T: Copy + Default>(values: &[T], unpadded: &[usize], shape: &[usize]) -> Vec<T> {
    let mut out = vec![T::default(); shape.iter().product()];
    for_each_unpadded(shape, unpadded, |p, u| out[p] = values[u]);
    out
}

/// The `unpadded` start of `values`, a tensor of `shape`.
pub fn unpad<T: Copy + Default>(values: &[T], shape: &[usize], unpadded: &[usize]) -> Vec<T> {
    let mut out = vec![T::default(); unpadded.iter().product()];
    for_each_unpadded(shape, unpadded, |p, u| out[u] = values[p]);
    out
}
