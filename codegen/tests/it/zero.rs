//! ZeRO on dp x tp meshes: what each rank sends and what it holds.
//!
//! ZeRO shards within each tensor-parallel shard (as Megatron's distributed optimizer does):
//! a gradient is reduce-scattered over dp on the rank's tp shard and the updated shard
//! all-gathered over dp (stages 1 and 2: plain data parallelism's volume); at stage 3 the
//! parameter stays sharded and is all-gathered over dp for each op that reads it. Nothing of
//! ZeRO crosses tp, and tp's own collectives do not change. The expected volumes are
//! computed here from the parameters' elements per tp shard and the ring algorithms, not
//! from the partitioned programs.

use std::collections::BTreeMap;
use std::time::Duration;

use shardc_ir::mesh::Mesh;
use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind};
use shardc_runtime::collectives::MeshShape;
use shardc_runtime::data::ByteCorpus;
use shardc_runtime::program::Role;
use shardc_runtime::report::comm_records;
use shardc_runtime::Program;

use crate::common::*;

const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, epsilon: 1e-3, weight_decay: 0.1 };

/// Grid axes of the mesh.
const DP: usize = 0;
const TP: usize = 1;

/// Meshes (dp, tp) every model is checked on.
const MESHES: [(u64, u64); 4] = [(2, 2), (2, 1), (4, 1), (4, 2)];

fn compile(name: &str, mesh: Mesh, zero: u8) -> (Program, shardc_ir::spec::Spec) {
    let mut spec = spec_with_dtype(name, "f32");
    spec.training.micro_batch = 4;
    let mut module = model(&spec);
    // No clipping: these volumes are the model's; the norm's one-value all-reduces (over
    // dp and tp together under ZeRO with tp) are checked in `clipping.rs`.
    let options = CompileOptions { optimizer: ADAMW, mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, zero, clip_grad: 0.0, ..Default::default() };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{name} {mesh} ZeRO-{zero}: {e:?}"));
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    (shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap(), spec)
}

/// Elements of chunk `i` of `len` split `n` ways, as the ring algorithms split buffers.
fn chunk(len: u64, n: u64, i: u64) -> u64 {
    len / n + u64::from(i < len % n)
}

/// Elements a rank at position `p` of a ring of `n` sends to all-reduce `len` elements.
fn ring_all_reduce(len: u64, n: u64, p: u64) -> u64 {
    if n == 1 { 0 } else { 2 * len - chunk(len, n, p) - chunk(len, n, (p + 1) % n) }
}

/// One parameter as tensor parallelism alone lays it out.
struct TpShard {
    name: String,
    /// Its per-rank shape under tp alone (global over the tp splits).
    shape: Vec<u64>,
    /// Passes of the single-device step that read it (forward, backward): ZeRO-3 gathers it
    /// once for each.
    readers: u64,
}

impl TpShard {
    fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Every parameter's tp shard, from the global shapes and the tp-only program's splits, with
/// its readers counted in the single-device program.
fn tp_shards(name: &str, tp: u64) -> Vec<TpShard> {
    let (single, _) = compile(name, Mesh::default(), 0);
    let (tp_only, _) = compile(name, Mesh { dp: 1, tp, pp: 1, cp: 1, ep: 1 }, 0);
    single
        .args
        .iter()
        .filter(|a| a.role == Some(Role::Param))
        .map(|a| {
            let layout = tp_only.args.iter().find(|b| b.name == a.name).and_then(|b| b.layout.clone());
            let global: Vec<u64> = single.buffers[a.buffer].shape.iter().map(|&x| x as u64).collect();
            let shape = match layout {
                Some(l) => global.iter().zip(&l.split).map(|(&g, axes)| if axes.contains(&TP) { g / tp } else { g }).collect(),
                None => global,
            };
            // The forward ends where the loss's gradient seed starts the backward.
            let seed = single.instrs.iter().position(|i| i.loc == "loss.seed").unwrap();
            let reads = |range: std::ops::Range<usize>| single.instrs[range].iter().any(|i| i.inputs.contains(&a.buffer) && i.op != "xf.adamw" && i.op != "xf.sgd");
            let readers = reads(0..seed) as u64 + reads(seed..single.instrs.len()) as u64;
            TpShard { name: a.name.clone(), shape, readers }
        })
        .collect()
}

/// Bytes (f32) rank `p` of a dp group of `dp` sends over dp for one training step at ZeRO
/// stage `zero`: per parameter, an all-reduce of its tp shard (stage 0, or a shard dp divides
/// no dimension of), or a reduce-scatter plus an all-gather per update (stages 1 and 2) or per
/// reader (stage 3); and the loss's all-reduce.
fn zero_volume(shards: &[TpShard], dp: u64, p: u64, zero: u8) -> u64 {
    let mut elements = ring_all_reduce(1, dp, p);
    for s in shards {
        let n = s.elements();
        let divides = s.shape.iter().any(|&e| e % dp == 0);
        elements += match zero {
            1..=3 if divides => {
                let (reduce_scatter, all_gather) = (n - n / dp, (dp - 1) * (n / dp));
                reduce_scatter + all_gather * if zero == 3 { s.readers } else { 1 }
            }
            _ => ring_all_reduce(n, dp, p),
        };
    }
    4 * elements
}

/// Per rank: bytes sent over dp alone, over tp alone, and over any other group.
fn bytes_by_group(program: &Program, rank: usize) -> (u64, u64, BTreeMap<Vec<usize>, u64>) {
    let (mut dp, mut tp, mut other) = (0, 0, BTreeMap::new());
    for r in comm_records(program, rank) {
        match r.axes.as_slice() {
            [DP] => dp += r.bytes,
            [TP] => tp += r.bytes,
            _ if r.group_size > 1 && r.kind.is_some() => *other.entry(r.axes.clone()).or_insert(0) += r.bytes,
            _ => {}
        }
    }
    (dp, tp, other)
}

#[test]
fn zero_sends_data_parallel_volumes_within_each_tensor_parallel_shard() {
    for name in ["tiny", "tiny-llama"] {
        for (dp, tp) in MESHES {
            let mesh = Mesh { dp, tp, pp: 1, cp: 1, ep: 1 };
            let shards = tp_shards(name, tp);
            let (plain, spec) = compile(name, mesh, 0);
            let corpus = ByteCorpus::new(std::fs::read(root().join("data/kjv-genesis-exodus.txt")).unwrap(), spec.seq_len() as usize, spec.model.vocab as usize).unwrap();
            for zero in 0..=3u8 {
                let program = if zero == 0 { plain.clone() } else { compile(name, mesh, zero).0 };
                let what = format!("{name} dp={dp} tp={tp} ZeRO-{zero}");
                for rank in 0..(dp * tp) as usize {
                    let p = MeshShape(vec![dp as usize, tp as usize, 1]).coords(rank)[DP] as u64;
                    let (over_dp, over_tp, other) = bytes_by_group(&program, rank);
                    assert!(other.is_empty(), "{what} rank {rank}: collectives over several axes: {other:?}");
                    assert_eq!(over_dp, zero_volume(&shards, dp, p, zero), "{what} rank {rank}: bytes over dp");
                    // What tp sends does not change with ZeRO.
                    assert_eq!(over_tp, bytes_by_group(&plain, rank).1, "{what} rank {rank}: bytes over tp");
                }
                // Stages 1 and 2 send what plain data parallelism sends.
                if zero <= 2 {
                    for rank in 0..(dp * tp) as usize {
                        assert_eq!(bytes_by_group(&program, rank).0, bytes_by_group(&plain, rank).0, "{what} rank {rank}");
                    }
                }
                // A real run's counters equal the report (two steps).
                let run = shardc_runtime::train::train_spmd(&program, 3, spec.model.layers as usize, &corpus, 2, Duration::from_secs(30)).unwrap();
                for (rank, measured) in run.bytes_sent.iter().enumerate() {
                    let mut expected = BTreeMap::new();
                    for record in comm_records(&program, rank) {
                        if let Some(kind) = record.kind {
                            *expected.entry(kind).or_insert(0u64) += 2 * record.bytes;
                        }
                    }
                    expected.retain(|_, v| *v > 0);
                    assert_eq!(measured, &expected, "{what} rank {rank}: measured bytes");
                }
            }
        }
    }
}

/// At ZeRO-3 a weight matrix is read once forward and once backward: 1.5 times its
/// all-reduce's volume.
#[test]
fn zero3_gathers_a_weight_forward_and_backward() {
    let shards = tp_shards("tiny", 2);
    let up = shards.iter().find(|s| s.name == "layers.0.mlp.up.weight").unwrap();
    assert_eq!(up.readers, 2);
    let (program, _) = compile("tiny", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 3);
    let records: Vec<_> = comm_records(&program, 0).into_iter().filter(|r| r.loc.starts_with("layers.0.mlp.up.") && !r.loc.contains("bias") && r.bytes > 0).collect();
    let ops: Vec<&str> = records.iter().map(|r| r.op.as_str()).collect();
    assert_eq!(ops, ["shard.all_gather", "shard.all_gather", "shard.reduce_scatter"], "{records:#?}");
    // [16, 64] split [dp, tp]: each gather rebuilds the [16, 32] tp shard over dp.
    assert!(records.iter().all(|r| r.axes == [DP] && r.elements == 16 * 32), "{records:#?}");
    let sent: u64 = records.iter().map(|r| r.bytes).sum();
    assert_eq!(2 * sent, 3 * ring_all_reduce(16 * 32, 2, 0) * 4);
}

/// The optimizer state's layouts shard every state tensor over dp within its tp shard (1 /
/// (dp x tp) of the global per rank), and the memory estimate counts exactly those shards.
#[test]
fn optimizer_state_shards_over_dp_and_tp_as_the_memory_report_says() {
    for name in ["tiny", "tiny-llama"] {
        for (dp, tp) in [(2u64, 2u64), (4, 2), (2, 1)] {
            let shards = tp_shards(name, tp);
            for zero in 1..=3u8 {
                let what = format!("{name} dp={dp} tp={tp} ZeRO-{zero}");
                let (program, _) = compile(name, Mesh { dp, tp, pp: 1, cp: 1, ep: 1 }, zero);
                let mut state_elements = 0u64;
                for s in &shards {
                    let global: u64 = program.args.iter().find(|a| a.name == s.name).and_then(|a| a.layout.as_ref()).map_or(0, |l| l.global_shape.iter().product::<usize>() as u64);
                    assert!(s.shape.iter().any(|&e| e % dp == 0), "{what}: dp divides no dimension of `{}`", s.name);
                    let tp_split = global / s.elements();
                    for moment in ["opt.m.", "opt.v."] {
                        let arg = program.args.iter().find(|a| a.name == format!("{moment}{}", s.name)).unwrap();
                        let layout = arg.layout.as_ref().unwrap();
                        let local = program.buffers[arg.buffer].len() as u64;
                        assert_eq!(local * dp * tp_split, global, "{what}: `{}` holds {local} of {global}", arg.name);
                        // A dimension split over both keeps each tp shard whole: tp outermost.
                        for axes in &layout.split {
                            if axes.contains(&TP) && axes.contains(&DP) {
                                assert_eq!(axes, &[TP, DP], "{what}: `{}` is split {:?}", arg.name, layout.split);
                            }
                        }
                        if tp > 1 && tp_split > 1 {
                            let axes: Vec<usize> = layout.split.iter().flatten().copied().collect();
                            assert!(axes.contains(&TP) && axes.contains(&DP), "{what}: `{}` is split {:?}", arg.name, layout.split);
                        }
                    }
                    state_elements += s.elements() / dp;
                    // ZeRO-3 shards the parameter the same way.
                    let param = program.args.iter().find(|a| a.name == s.name).unwrap();
                    let local = program.buffers[param.buffer].len() as u64;
                    assert_eq!(local, if zero == 3 { s.elements() / dp } else { s.elements() }, "{what}: `{}`", s.name);
                }
                let m = &shardc_codegen::estimate::memory(std::slice::from_ref(&program), zero)[0];
                let tp_elements: u64 = shards.iter().map(TpShard::elements).sum();
                // An f32 program: f32 weights and gradients, two f32 moments (no master copy).
                assert_eq!(m.optimizer, 8.0 * state_elements as f64, "{what}: optimizer memory");
                assert_eq!(m.all_gradients, 4.0 * if zero >= 2 { state_elements } else { tp_elements } as f64, "{what}: gradient memory");
                assert_eq!(m.parameters, 4.0 * if zero == 3 { state_elements } else { tp_elements } as f64, "{what}: parameter memory");
            }
        }
    }
}
