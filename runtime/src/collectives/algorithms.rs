//! Ring and tree algorithms over a group of ranks (listed in ring order).
//!
//! Ring (bandwidth-optimal): reduce-scatter then all-gather, each n - 1 steps of one chunk to
//! the next rank; every rank sends 2 (n - 1) / n of the buffer for an all-reduce.
//! Tree (latency-optimal for small messages): a binomial reduce to the group's first rank
//! and a binomial broadcast back, log2(n) rounds each.
//! Both give every rank bit-identical results: each chunk is reduced once, in a fixed order,
//! and then copied.

use super::{CollectiveKind, CommError, Communicator, Elem, ReduceOp};

/// Which all-reduce algorithm to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Algorithm {
    /// Reduce-scatter + all-gather around a ring.
    #[default]
    Ring,
    /// Binomial-tree reduce + broadcast.
    Tree,
}

/// Bounds of chunk `i` of `len` elements split `n` ways (the first `len % n` chunks are one
/// longer).
pub(crate) fn chunk(len: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    let (base, extra) = (len / n, len % n);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

impl Communicator {
    /// Reduces `data` over `group` in place; every member ends with the same result.
    pub fn all_reduce<T: Elem>(&mut self, group: &[usize], data: &mut [T], op: ReduceOp, algorithm: Algorithm) -> Result<(), CommError> {
        let n = group.len();
        let p = self.position(group)?;
        if n == 1 {
            return Ok(());
        }
        let (g, call) = self.begin(group);
        match algorithm {
            Algorithm::Ring => {
                self.ring_reduce_scatter(group, p, (g, call), data, op, CollectiveKind::AllReduce)?;
                self.ring_all_gather(group, p, (g, call), data, CollectiveKind::AllReduce)
            }
            Algorithm::Tree => {
                self.tree_reduce(group, p, (g, call), data, op)?;
                self.tree_broadcast(group, p, 0, (g, call), data, CollectiveKind::AllReduce)
            }
        }
    }

    /// Gathers each member's `local` into `out` (member i's part at chunk i, equal chunks).
    pub fn all_gather<T: Elem>(&mut self, group: &[usize], local: &[T], out: &mut [T]) -> Result<(), CommError> {
        let n = group.len();
        let p = self.position(group)?;
        if out.len() != local.len() * n {
            return Err(CommError::Shape { rank: self.rank, what: format!("all_gather: {} elements per rank x {n} ranks != {}", local.len(), out.len()) });
        }
        let mine = chunk(out.len(), n, p);
        out[mine].copy_from_slice(local);
        if n == 1 {
            return Ok(());
        }
        let key = self.begin(group);
        self.ring_all_gather(group, p, key, out, CollectiveKind::AllGather)
    }

    /// Reduces `data` over `group` and leaves member i the chunk i of the result in `out`.
    pub fn reduce_scatter<T: Elem>(&mut self, group: &[usize], data: &[T], out: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let n = group.len();
        let p = self.position(group)?;
        let mine = chunk(data.len(), n, p);
        if out.len() != mine.len() {
            return Err(CommError::Shape { rank: self.rank, what: format!("reduce_scatter: chunk of {} elements, output of {}", mine.len(), out.len()) });
        }
        let mut work = super::pool::filled(data);
        if n > 1 {
            let key = self.begin(group);
            self.ring_reduce_scatter(group, p, key, &mut work, op, CollectiveKind::ReduceScatter)?;
        }
        out.copy_from_slice(&work[mine]);
        super::pool::recycle(work);
        Ok(())
    }

    /// Sends `parts[k]` to member k of `group` and returns what each member sent this one
    /// (its own part kept): a pairwise exchange, member `p` sending to `p + s` and receiving
    /// from `p - s` in round `s`, so every round pairs every member with one peer.
    pub fn all_to_all<T: Elem>(&mut self, group: &[usize], mut parts: Vec<Vec<T>>) -> Result<Vec<Vec<T>>, CommError> {
        let n = group.len();
        let p = self.position(group)?;
        if parts.len() != n {
            return Err(CommError::Shape { rank: self.rank, what: format!("all_to_all: {} parts for a group of {n}", parts.len()) });
        }
        let mut received: Vec<Vec<T>> = (0..n).map(|_| Vec::new()).collect();
        received[p] = std::mem::take(&mut parts[p]);
        if n == 1 {
            return Ok(received);
        }
        let (g, call) = self.begin(group);
        for s in 1..n {
            let (to, from) = ((p + s) % n, (p + n - s) % n);
            self.send_raw(group[to], (g, call, s as u64), std::mem::take(&mut parts[to]), CollectiveKind::AllToAll, "all-to-all")?;
            received[from] = self.recv_raw(group[from], (g, call, s as u64), "all-to-all")?;
        }
        Ok(received)
    }

    /// Copies member `root`'s `data` to every member of `group`.
    pub fn broadcast<T: Elem>(&mut self, group: &[usize], data: &mut [T], root: usize) -> Result<(), CommError> {
        let p = self.position(group)?;
        if root >= group.len() {
            return Err(CommError::Shape { rank: self.rank, what: format!("broadcast: root {root} outside a group of {}", group.len()) });
        }
        if group.len() == 1 {
            return Ok(());
        }
        let key = self.begin(group);
        self.tree_broadcast(group, p, root, key, data, CollectiveKind::Broadcast)
    }

    /// Ring reduce-scatter in place: afterwards chunk `p` of `data` holds the reduction.
    fn ring_reduce_scatter<T: Elem>(&mut self, group: &[usize], p: usize, (g, call): (u64, u64), data: &mut [T], op: ReduceOp, kind: CollectiveKind) -> Result<(), CommError> {
        let n = group.len();
        let (next, prev) = (group[(p + 1) % n], group[(p + n - 1) % n]);
        for s in 0..n - 1 {
            let send = chunk(data.len(), n, (p + 2 * n - s - 1) % n);
            let recv = chunk(data.len(), n, (p + 2 * n - s - 2) % n);
            self.send_raw(next, (g, call, s as u64), super::pool::filled(&data[send]), kind, "ring reduce-scatter")?;
            let incoming: Vec<T> = self.recv_raw(prev, (g, call, s as u64), "ring reduce-scatter")?;
            for (d, &x) in data[recv].iter_mut().zip(&incoming) {
                *d = op.apply(x, *d);
            }
            super::pool::recycle(incoming);
        }
        Ok(())
    }

    /// Ring all-gather in place: chunk `p` of `data` is this rank's; afterwards all are filled.
    fn ring_all_gather<T: Elem>(&mut self, group: &[usize], p: usize, (g, call): (u64, u64), data: &mut [T], kind: CollectiveKind) -> Result<(), CommError> {
        let n = group.len();
        let (next, prev) = (group[(p + 1) % n], group[(p + n - 1) % n]);
        // Steps are numbered after the reduce-scatter's, so an all-reduce's two phases differ.
        let offset = n as u64;
        for s in 0..n - 1 {
            let send = chunk(data.len(), n, (p + n - s) % n);
            let recv = chunk(data.len(), n, (p + 2 * n - s - 1) % n);
            self.send_raw(next, (g, call, offset + s as u64), super::pool::filled(&data[send]), kind, "ring all-gather")?;
            let incoming: Vec<T> = self.recv_raw(prev, (g, call, offset + s as u64), "ring all-gather")?;
            data[recv].copy_from_slice(&incoming);
            super::pool::recycle(incoming);
        }
        Ok(())
    }

    /// Binomial reduce to the group's first member.
    fn tree_reduce<T: Elem>(&mut self, group: &[usize], p: usize, (g, call): (u64, u64), data: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let n = group.len();
        let mut mask = 1;
        while mask < n {
            if p & mask != 0 {
                return self.send_raw(group[p - mask], (g, call, mask as u64), super::pool::filled(data), CollectiveKind::AllReduce, "tree reduce");
            }
            if p + mask < n {
                let incoming: Vec<T> = self.recv_raw(group[p + mask], (g, call, mask as u64), "tree reduce")?;
                for (d, &x) in data.iter_mut().zip(&incoming) {
                    *d = op.apply(*d, x);
                }
                super::pool::recycle(incoming);
            }
            mask <<= 1;
        }
        Ok(())
    }

    /// Binomial broadcast from member `root`.
    fn tree_broadcast<T: Elem>(&mut self, group: &[usize], p: usize, root: usize, (g, call): (u64, u64), data: &mut [T], kind: CollectiveKind) -> Result<(), CommError> {
        let n = group.len();
        let rel = (p + n - root) % n;
        let member = |r: usize| group[(r + root) % n];
        let top = n.next_power_of_two();
        // Receive from the parent (the rank that differs in rel's lowest set bit), then send
        // to children at every lower bit.
        let mut mask = 1;
        while mask < top {
            if rel & mask != 0 {
                let incoming: Vec<T> = self.recv_raw(member(rel - mask), (g, call, (1 << 32) + mask as u64), "tree broadcast")?;
                data.copy_from_slice(&incoming);
                super::pool::recycle(incoming);
                break;
            }
            mask <<= 1;
        }
        mask >>= 1;
        while mask > 0 {
            if rel + mask < n {
                self.send_raw(member(rel + mask), (g, call, (1 << 32) + mask as u64), super::pool::filled(data), kind, "tree broadcast")?;
            }
            mask >>= 1;
        }
        Ok(())
    }
}
