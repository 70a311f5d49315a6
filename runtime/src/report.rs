//! What a rank program communicates, computed from the program alone: every collective
//! instruction, its group, its size and the bytes this rank sends for it under the ring
//! algorithms the CPU backend runs. Measured counters of a run must equal it.

use crate::collectives::{CollectiveKind, MeshShape};
use crate::program::{Attr, Program};

/// One collective of a program, as seen by one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommRecord {
    /// Instruction index.
    pub index: usize,
    /// Op name (`shard.all_reduce`, ...).
    pub op: String,
    /// Kind, for the byte counters (`None`: no communication, as for `all_slice`).
    pub kind: Option<CollectiveKind>,
    /// Grid axes of the group.
    pub axes: Vec<usize>,
    /// Ranks in the group.
    pub group_size: usize,
    /// Elements of the whole buffer (the reduced buffer, or the gathered result).
    pub elements: usize,
    /// Bytes this rank sends.
    pub bytes: u64,
    /// Model location of the instruction.
    pub loc: String,
    /// Why the partitioner put it there.
    pub cause: String,
}

/// Elements of chunk `i` of `len` split `n` ways (as the ring algorithms split buffers).
fn chunk_len(len: usize, n: usize, i: usize) -> usize {
    len / n + usize::from(i < len % n)
}

/// Every collective of `program` for `rank`. Members of an all-reduce bucket travel as one
/// all-reduce of their concatenation, counted at the bucket's last member; a bucket of
/// reduce-scatters or all-gathers runs its members' own collectives (in one group), each
/// counted as itself.
pub fn comm_records(program: &Program, rank: usize) -> Vec<CommRecord> {
    let mut records = collective_records(program, rank);
    let mut buckets: std::collections::BTreeMap<i64, Vec<usize>> = std::collections::BTreeMap::new();
    for (k, r) in records.iter().enumerate() {
        if let (Ok(b), "shard.all_reduce") = (program.instrs[r.index].int("xf.bucket"), r.op.as_str()) {
            buckets.entry(b).or_default().push(k);
        }
    }
    for members in buckets.values() {
        let len: usize = members.iter().map(|&k| records[k].elements).sum();
        let (n, p) = (records[members[0]].group_size, position(program, rank, &records[members[0]].axes));
        let width = program.buffers[program.instrs[records[members[0]].index].inputs[0]].dtype.bytes() as u64;
        let bytes = if n > 1 { (2 * len - chunk_len(len, n, p) - chunk_len(len, n, (p + 1) % n)) as u64 * width } else { 0 };
        for &k in members {
            records[k].bytes = 0;
        }
        if let Some(&last) = members.last() {
            records[last].bytes = bytes;
        }
    }
    records
}

fn position(program: &Program, rank: usize, axes: &[usize]) -> usize {
    let mesh = MeshShape(if program.mesh.is_empty() { vec![1] } else { program.mesh.clone() });
    mesh.group(rank, axes).iter().position(|&r| r == rank).unwrap_or(0)
}

fn collective_records(program: &Program, rank: usize) -> Vec<CommRecord> {
    let mesh = MeshShape(if program.mesh.is_empty() { vec![1] } else { program.mesh.clone() });
    program
        .instrs
        .iter()
        .enumerate()
        .filter(|(_, i)| i.op.starts_with("shard."))
        .map(|(index, instr)| {
            let axes: Vec<usize> = instr.ints("grid_axes").unwrap_or_default().iter().map(|&a| a as usize).collect();
            let group = mesh.group(rank, &axes);
            let (n, p) = (group.len(), group.iter().position(|&r| r == rank).unwrap_or(0));
            let input = &program.buffers[instr.inputs[0]];
            let output = &program.buffers[instr.outputs[0]];
            let width = input.dtype.bytes() as u64;
            let (kind, elements, sent) = match instr.op.as_str() {
                // Reduce-scatter sends every chunk but this rank's, all-gather every chunk
                // but the next rank's.
                "shard.all_reduce" if n > 1 => {
                    let len = input.len();
                    (Some(CollectiveKind::AllReduce), len, 2 * len - chunk_len(len, n, p) - chunk_len(len, n, (p + 1) % n))
                }
                "shard.all_reduce" => (Some(CollectiveKind::AllReduce), input.len(), 0),
                "shard.all_gather" => (Some(CollectiveKind::AllGather), output.len(), (n - 1) * input.len()),
                // Every chunk but this rank's own.
                "shard.reduce_scatter" => (Some(CollectiveKind::ReduceScatter), input.len(), input.len() - chunk_len(input.len(), n, p)),
                "shard.send" => (Some(CollectiveKind::Send), input.len(), input.len()),
                "shard.shift" if n > 1 => (Some(CollectiveKind::Send), input.len(), input.len()),
                // Every part but this rank's own, one to each peer.
                "shard.all_to_all" => (Some(CollectiveKind::AllToAll), input.len(), input.len() - input.len() / n.max(1)),
                _ => (None, output.len(), 0),
            };
            let cause = match instr.attrs.get("xf.cause") {
                Some(Attr::Str(c)) => c.clone(),
                _ => String::new(),
            };
            CommRecord { index, op: instr.op.clone(), kind, axes, group_size: n, elements, bytes: sent as u64 * width, loc: instr.loc.clone(), cause }
        })
        .collect()
}
