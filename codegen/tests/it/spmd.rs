//! Partitioned training equals single-device training: same losses and the same updated
//! parameters after three optimizer steps, for tiny GPT and tiny Llama on several meshes.

use std::time::Duration;

use shardc_ir::mesh::Mesh;
use shardc_passes::sharding::ContextAttention;
use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind};
use shardc_runtime::data::ByteCorpus;
use shardc_runtime::train::{train_spmd, Trainer};
use shardc_runtime::Program;

use crate::common::*;

const STEPS: u64 = 3;
const TOLERANCE: f64 = 1e-5;

fn compile(name: &str, mesh: Mesh) -> (Program, shardc_ir::spec::Spec) {
    compile_zero(name, mesh, 0)
}

/// SGD: AdamW divides each gradient by its own magnitude, so for a gradient that is exactly
/// zero in theory (the attention key bias: softmax ignores a per-row shift) it turns
/// rounding noise into full-size steps, and the comparison would measure noise.
const SGD: OptimizerKind = OptimizerKind::Sgd { lr: 0.1, weight_decay: 0.0 };

/// AdamW for the ZeRO tests (they need optimizer state to shard); its large epsilon keeps
/// those noise-sized gradients from turning into full steps.
const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, epsilon: 1e-3, weight_decay: 0.1 };

fn compile_zero(name: &str, mesh: Mesh, zero: u8) -> (Program, shardc_ir::spec::Spec) {
    compile_with(name, mesh, zero, if zero > 0 { ADAMW } else { SGD }, false)
}

fn compile_with(name: &str, mesh: Mesh, zero: u8, optimizer: OptimizerKind, sequence_parallel: bool) -> (Program, shardc_ir::spec::Spec) {
    // Context parallelism in its zigzag order, as the CLI lowers it.
    let chunks = if mesh.cp > 1 { 2 * mesh.cp } else { 1 };
    compile_in_order(name, mesh, zero, optimizer, sequence_parallel, chunks, ContextAttention::Auto)
}

#[allow(clippy::too_many_arguments)]
fn compile_in_order(name: &str, mesh: Mesh, zero: u8, optimizer: OptimizerKind, sequence_parallel: bool, sequence_chunks: u64, context_attention: ContextAttention) -> (Program, shardc_ir::spec::Spec) {
    let mut spec = spec_with_dtype(name, "f32");
    // A batch every tested data-parallel degree divides.
    spec.training.micro_batch = 4;
    let mut module = model_in_order(&spec, sequence_chunks);
    let options = CompileOptions {
        optimizer,
        mesh,
        vocab: spec.model.vocab as i64,
        kv_heads: spec.model.kv_heads() as i64,
        zero,
        sequence_parallel,
        context_attention,
        ..Default::default()
    };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{name} {mesh}: {e:?}"));
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    (shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap(), spec)
}

fn corpus(spec: &shardc_ir::spec::Spec) -> ByteCorpus {
    ByteCorpus::new(std::fs::read(root().join("data/kjv-genesis-exodus.txt")).unwrap(), spec.seq_len() as usize, spec.model.vocab as usize).unwrap()
}

/// Relative difference of two tensors: max |a - b| / max |a|, with max |a| floored at the
/// initialisation scale (0.01). The floor matters for one tensor: the attention key bias
/// starts at zero and its gradient is zero in exact arithmetic (softmax ignores a per-row
/// shift of the scores), so both runs hold only rounding noise there (~1e-9).
fn rel(a: &[f64], b: &[f64]) -> f64 {
    let scale = a.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-2);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn check(name: &str, dp: u64, tp: u64) {
    check_zero(name, dp, tp, 0);
}

fn check_zero(name: &str, dp: u64, tp: u64, zero: u8) {
    check_all(name, dp, tp, zero, false);
}

fn check_all(name: &str, dp: u64, tp: u64, zero: u8, sequence_parallel: bool) {
    check_mesh(name, Mesh { dp, tp, pp: 1, cp: 1, ep: 1 }, zero, sequence_parallel);
}

/// With context parallelism, its gathered form (the ring has a test of its own).
fn check_mesh(name: &str, mesh: Mesh, zero: u8, sequence_parallel: bool) {
    check_in_order(name, mesh, zero, sequence_parallel, if mesh.cp > 1 { 2 * mesh.cp } else { 1 }, ContextAttention::AllGather);
}

fn check_in_order(name: &str, mesh: Mesh, zero: u8, sequence_parallel: bool, sequence_chunks: u64, context_attention: ContextAttention) {
    let Mesh { dp, tp, cp, .. } = mesh;
    let optimizer = if zero > 0 { ADAMW } else { SGD };
    let (single, spec) = compile_with(name, Mesh::default(), 0, optimizer, false);
    let corpus = corpus(&spec);
    let mut trainer = Trainer::new(single, 11, spec.model.layers as usize).unwrap();
    let losses: Vec<f64> = (0..STEPS).map(|_| trainer.step(&corpus).unwrap()).collect();
    let reference = trainer.parameters().unwrap();

    let (partitioned, _) = compile_in_order(name, mesh, zero, optimizer, sequence_parallel, sequence_chunks, context_attention);
    if context_attention == ContextAttention::Ring {
        assert!(partitioned.instrs.iter().any(|i| i.op == "shard.shift"), "{name} {mesh}: no ring");
    }
    let run = train_spmd(&partitioned, 11, spec.model.layers as usize, &corpus, STEPS, Duration::from_secs(30)).unwrap();
    for (step, (a, b)) in losses.iter().zip(&run.losses).enumerate() {
        assert!((a - b).abs() <= TOLERANCE * a.abs(), "{name} dp={dp} cp={cp} tp={tp} zero={zero} sp={sequence_parallel} step {}: loss {a} vs {b}", step + 1);
    }
    for ((name_a, _, a), (name_b, _, b)) in reference.iter().zip(&run.parameters) {
        assert_eq!(name_a, name_b);
        let a: Vec<f64> = a.iter().map(|&x| x as f64).collect();
        let err = rel(&a, b);
        assert!(err <= TOLERANCE, "{name} dp={dp} cp={cp} tp={tp} zero={zero} sp={sequence_parallel}: parameter {name_a} differs by {err:e} after {STEPS} steps");
    }
}

#[test]
fn tiny_gpt_partitioned_equals_single_device() {
    for (dp, tp) in [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1)] {
        check("tiny", dp, tp);
    }
}

#[test]
fn tiny_llama_partitioned_equals_single_device() {
    // (1, 4): tp does not divide the 2 kv heads; they are repeated and sliced per rank.
    for (dp, tp) in [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1)] {
        check("tiny-llama", dp, tp);
    }
}

/// Mixture of experts (issue 21): 8 experts, top-2, dropless; tokens split over data-parallel
/// ranks route as on one device, and tensor parallelism splits every expert's MLP.
#[test]
fn tiny_moe_partitioned_equals_single_device() {
    for (dp, tp) in [(2, 1), (1, 2), (2, 2), (4, 1)] {
        check("tiny-moe", dp, tp);
    }
    check_zero("tiny-moe", 2, 2, 1);
    check_all("tiny-moe", 1, 2, 0, true);
    check_mesh("tiny-moe", Mesh { dp: 2, tp: 1, pp: 1, cp: 2, ep: 1 }, 0, false);
}

/// Expert parallelism (issue 21): the experts split over ep ranks carved from dp, tokens
/// dispatched to them and combined back by all-to-alls, expert gradients reduced over the
/// data-parallel ranks holding the same experts; alone, with tensor parallelism inside the
/// experts, with ZeRO and with pipeline stages. Losses and parameters equal one device.
#[test]
fn expert_parallel_equals_single_device() {
    let mesh = |dp, ep, tp, pp| Mesh { dp, tp, pp, cp: 1, ep };
    for m in [mesh(2, 2, 1, 1), mesh(4, 4, 1, 1), mesh(4, 2, 1, 1), mesh(2, 2, 2, 1), mesh(2, 2, 1, 2)] {
        check_mesh("tiny-moe", m, 0, false);
    }
    check_mesh("tiny-moe", mesh(4, 2, 1, 1), 1, false);
    // With a capacity (half the even share: choices dropped) tokens are dropped as on one
    // device, also under context parallelism's zigzag order (slots go by position).
    for m in [mesh(4, 4, 1, 1), mesh(2, 2, 2, 1)] {
        check_mesh("tiny-moe-capacity", m, 0, false);
    }
    check_mesh("tiny-moe-capacity", Mesh { dp: 1, tp: 1, pp: 1, cp: 2, ep: 1 }, 0, false);
    check_mesh("tiny-moe-capacity", Mesh { dp: 2, tp: 1, pp: 1, cp: 2, ep: 2 }, 0, false);
    check_mesh("tiny-moe", mesh(2, 2, 2, 1), 0, true);
    // The dispatch and combine are all-to-alls over ep (per layer: tokens and their counts
    // to the experts, outputs back, and the two gradients the other way), and nothing
    // gathers an expert.
    let (program, _) = compile("tiny-moe", mesh(4, 4, 1, 1));
    let over_ep: Vec<&str> = program.instrs.iter().filter(|i| i.ints("grid_axes").is_ok_and(|a| a == [shardc_ir::mesh::EP_AXIS as i64])).map(|i| i.op.as_str()).collect();
    assert_eq!(over_ep.iter().filter(|op| **op == "shard.all_to_all").count(), 2 * 5, "{over_ep:?}");
    assert!(!over_ep.contains(&"shard.all_gather"), "{over_ep:?}");
}

/// Context parallelism (issue 20): the sequence split over cp ranks, alone and with data and
/// tensor parallelism, sequence parallelism and ZeRO, equals one device.
#[test]
fn context_parallel_equals_single_device() {
    let mesh = |dp, cp, tp| Mesh { dp, tp, pp: 1, cp, ep: 1 };
    for name in ["tiny", "tiny-llama"] {
        for m in [mesh(1, 2, 1), mesh(1, 4, 1), mesh(2, 2, 2)] {
            check_mesh(name, m, 0, false);
        }
        check_mesh(name, mesh(1, 2, 2), 0, true);
        check_mesh(name, mesh(2, 2, 1), 1, false);
        // Each rank a contiguous part (no zigzag order) is as right, only unbalanced.
        check_in_order(name, mesh(1, 2, 1), 0, false, 1, ContextAttention::AllGather);
        check_in_order(name, mesh(2, 2, 2), 0, false, 1, ContextAttention::AllGather);
    }
}

/// Ring attention (issue 20): key/value blocks passed round the cp ranks, with their
/// gradients on the way back, equal one device; in zigzag order and in the natural order,
/// with data and tensor parallelism, sequence parallelism and ZeRO.
#[test]
fn ring_attention_equals_single_device() {
    let mesh = |dp, cp, tp| Mesh { dp, tp, pp: 1, cp, ep: 1 };
    let ring = ContextAttention::Ring;
    for name in ["tiny", "tiny-llama"] {
        for m in [mesh(1, 2, 1), mesh(1, 4, 1), mesh(2, 2, 2)] {
            check_in_order(name, m, 0, false, 2 * m.cp, ring);
        }
        check_in_order(name, mesh(1, 2, 2), 0, true, 4, ring);
        check_in_order(name, mesh(2, 2, 1), 1, false, 4, ring);
        check_in_order(name, mesh(1, 4, 1), 0, false, 1, ring);
    }
}

/// The ring's bytes per rank and layer: each way, cp - 1 blocks of keys and of values; on
/// the way back also cp blocks of their gradient sums (the last brings them home).
#[test]
fn ring_attention_traffic_equals_the_formula() {
    for cp in [2u64, 4] {
        let (program, spec) = compile_in_order("tiny-llama", Mesh { dp: 1, tp: 1, pp: 1, cp, ep: 1 }, 0, SGD, false, 2 * cp, ContextAttention::Ring);
        let m = &spec.model;
        let part = 4 * m.kv_heads() * (spec.seq_len() / cp) * m.head_dim() * 4;
        let records = shardc_runtime::report::comm_records(&program, 0);
        let shifts: Vec<u64> = records.iter().filter(|r| r.op == "shard.shift").map(|r| r.bytes).collect();
        assert!(records.iter().all(|r| r.axes != [shardc_ir::mesh::CP_AXIS] || r.op == "shard.shift" || r.op == "shard.all_reduce" || r.op == "shard.all_slice"), "cp={cp}: only the ring, the weight gradients and slices cross cp");
        assert_eq!(shifts.len() as u64, m.layers * (4 * (cp - 1) + 2 * cp), "cp={cp}: shifts");
        assert_eq!(shifts.iter().sum::<u64>(), m.layers * (4 * (cp - 1) + 2 * cp) * part, "cp={cp}: bytes");
    }
}

/// Context parallelism's attention gathers every layer's keys and values over cp and
/// reduce-scatters their gradients back: per rank and layer, 2 x (cp - 1) x its own part of
/// k (and of v) sent by each (a ring all-gather and reduce-scatter each send (cp - 1) parts
/// of the cp), and nothing else over cp but the weight gradients' all-reduces.
#[test]
fn context_parallel_key_value_traffic_equals_the_formula() {
    for cp in [2u64, 4] {
        let (program, spec) = compile_in_order("tiny-llama", Mesh { dp: 1, tp: 1, pp: 1, cp, ep: 1 }, 0, SGD, false, 2 * cp, ContextAttention::AllGather);
        let m = &spec.model;
        // [micro-batch 4, kv heads, seq / cp, head dim] in f32.
        let part = 4 * m.kv_heads() * (spec.seq_len() / cp) * m.head_dim() * 4;
        let records = shardc_runtime::report::comm_records(&program, 0);
        let over_cp = |op: &str| records.iter().filter(|r| r.op == op && r.axes == [shardc_ir::mesh::CP_AXIS]).map(|r| r.bytes).collect::<Vec<_>>();
        let (gathers, scatters) = (over_cp("shard.all_gather"), over_cp("shard.reduce_scatter"));
        let per_layer = 2 * (cp - 1) * part;
        assert_eq!(gathers.len() as u64, 2 * m.layers, "cp={cp}: one gather of k and one of v per layer");
        assert_eq!(gathers.iter().sum::<u64>(), m.layers * per_layer, "cp={cp}: gathered bytes");
        assert_eq!(scatters.len() as u64, 2 * m.layers, "cp={cp}: one scatter of dk and one of dv per layer");
        assert_eq!(scatters.iter().sum::<u64>(), m.layers * per_layer, "cp={cp}: scattered bytes");
    }
}

#[test]
fn measured_bytes_equal_the_compile_time_report() {
    let mesh = |dp, cp, tp| Mesh { dp, tp, pp: 1, cp, ep: 1 };
    for (name, mesh, ring) in [("tiny", mesh(2, 1, 2), false), ("tiny-llama", mesh(1, 1, 2), false), ("tiny", mesh(4, 1, 1), false), ("tiny-llama", mesh(2, 2, 2), false), ("tiny", mesh(1, 4, 1), false), ("tiny-llama", mesh(1, 4, 1), true)] {
        let attention = if ring { ContextAttention::Ring } else { ContextAttention::AllGather };
        let (program, spec) = compile_in_order(name, mesh, 0, SGD, false, if mesh.cp > 1 { 2 * mesh.cp } else { 1 }, attention);
        check_measured_bytes(&program, &spec);
    }
    // Expert parallelism's all-to-alls, alone and with tensor parallelism.
    for mesh in [Mesh { dp: 4, tp: 1, pp: 1, cp: 1, ep: 4 }, Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 2 }] {
        let (program, spec) = compile("tiny-moe", mesh);
        assert!(shardc_runtime::report::comm_records(&program, 0).iter().any(|r| r.op == "shard.all_to_all" && r.bytes > 0), "{mesh}: no all-to-all");
        check_measured_bytes(&program, &spec);
    }
}

/// Two steps of `program`: every rank's byte counters equal twice its compile-time report.
fn check_measured_bytes(program: &Program, spec: &shardc_ir::spec::Spec) {
    let run = train_spmd(program, 3, spec.model.layers as usize, &corpus(spec), 2, Duration::from_secs(30)).unwrap();
    for (rank, measured) in run.bytes_sent.iter().enumerate() {
        let mut expected = std::collections::BTreeMap::new();
        for record in shardc_runtime::report::comm_records(program, rank) {
            if let Some(kind) = record.kind {
                *expected.entry(kind).or_insert(0u64) += 2 * record.bytes;
            }
        }
        expected.retain(|_, v| *v > 0);
        assert_eq!(measured, &expected, "{} rank {rank}", spec.name);
    }
}

/// Tensor-parallel all-reduces inside each layer of gpt2-small at tp=4 (seq 128, batch 1).
#[test]
fn gpt2_small_at_tp4_has_two_forward_and_two_backward_all_reduces_per_layer() {
    let mut spec = crate::common::spec_with_dtype("gpt2-small", "f32");
    spec.training.seq_len = Some(128);
    spec.training.micro_batch = 1;
    let mut module = model(&spec);
    // No clipping: the global norm's all-reduces of one value are counted in their own test.
    let options = CompileOptions { mesh: Mesh { dp: 1, tp: 4, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, kv_heads: 12, clip_grad: 0.0, ..Default::default() };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    let program = shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &[1, 4, 1]).unwrap();
    let records = shardc_runtime::report::comm_records(&program, 0);
    let bsh = 128 * 768;
    for layer in 0..12 {
        let prefix = format!("layers.{layer}.");
        let in_layer: Vec<_> = records.iter().filter(|r| r.loc.starts_with(&prefix) && r.kind.is_some()).collect();
        let forward = in_layer.iter().filter(|r| !r.loc.contains(".grad")).count();
        let backward = in_layer.iter().filter(|r| r.loc.contains(".grad")).count();
        assert_eq!((forward, backward), (2, 2), "layer {layer}: {in_layer:#?}");
        for r in &in_layer {
            assert_eq!((r.op.as_str(), r.axes.as_slice(), r.elements), ("shard.all_reduce", &[1usize][..], bsh), "layer {layer}: {r:?}");
            // Ring all-reduce: 2 (n - 1) / n of the buffer per rank.
            assert_eq!(r.bytes, 2 * 3 * (bsh as u64 / 4) * 4);
        }
    }
}

#[test]
fn zero_stages_equal_single_device() {
    // Data parallelism alone, and with tensor parallelism (ZeRO shards each tp shard).
    for name in ["tiny", "tiny-llama"] {
        for (dp, tp) in [(2, 1), (2, 2)] {
            for zero in [1, 2, 3] {
                check_zero(name, dp, tp, zero);
            }
        }
    }
}

#[test]
fn zero_collectives() {
    let kinds = |zero: u8| {
        let (program, _) = compile_zero("tiny", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, zero);
        let mut counts = std::collections::BTreeMap::new();
        for r in shardc_runtime::report::comm_records(&program, 0) {
            *counts.entry(r.op).or_insert(0) += 1;
        }
        counts
    };
    let (program, _) = compile_zero("tiny", Mesh::default(), 1);
    // (The parameter count, from the single-device program.)
    let params = program.args.iter().filter(|a| a.role == Some(shardc_runtime::program::Role::Param)).count();
    // Plain data parallelism: one all-reduce per gradient, plus the loss.
    assert_eq!(kinds(0).get("shard.all_reduce"), Some(&(params + 1)));
    // ZeRO-1/2: gradients reduce-scattered into the state shards, parameters gathered back.
    for zero in [1, 2] {
        let k = kinds(zero);
        assert_eq!(k.get("shard.reduce_scatter"), Some(&params), "zero {zero}: {k:?}");
        assert_eq!(k.get("shard.all_gather"), Some(&params), "zero {zero}: {k:?}");
    }
    // ZeRO-3: parameters stay sharded; they are gathered where they are used.
    let k = kinds(3);
    assert_eq!(k.get("shard.reduce_scatter"), Some(&params), "{k:?}");
    assert!(k.get("shard.all_gather").copied().unwrap_or(0) >= params, "{k:?}");
}

#[test]
fn sequence_parallel_equals_single_device() {
    for name in ["tiny", "tiny-llama"] {
        for (dp, tp) in [(1, 2), (2, 2), (1, 4)] {
            check_all(name, dp, tp, 0, true);
        }
    }
    check_all("tiny", 2, 2, 1, true);
}

/// Per layer of gpt2-small at tp=4 (seq 128, batch 1) with sequence parallelism: the
/// tensor-parallel all-reduces become reduce-scatters and all-gathers of the same total
/// volume.
#[test]
fn gpt2_small_sequence_parallel_trades_all_reduces_for_reduce_scatter_and_all_gather() {
    let mut spec = crate::common::spec_with_dtype("gpt2-small", "f32");
    spec.training.seq_len = Some(128);
    spec.training.micro_batch = 1;
    let records = |sequence_parallel: bool| {
        let options = CompileOptions { mesh: Mesh { dp: 1, tp: 4, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, kv_heads: 12, sequence_parallel, clip_grad: 0.0, ..Default::default() };
        let program = compiled_step(&spec, &options);
        shardc_runtime::report::comm_records(&program, 0)
    };
    let (plain, sp) = (records(false), records(true));
    let bsh = 128 * 768;
    for layer in 0..12 {
        let prefix = format!("layers.{layer}.");
        // Activation collectives (b*s*h elements) of this layer.
        let activations = |rs: &[shardc_runtime::report::CommRecord], grad: bool| {
            let mut ops: Vec<String> = rs
                .iter()
                .filter(|r| r.loc.starts_with(&prefix) && r.elements == bsh && r.loc.contains(".grad") == grad && r.kind.is_some())
                .map(|r| r.op.clone())
                .collect();
            ops.sort();
            ops
        };
        for grad in [false, true] {
            assert_eq!(activations(&sp, grad), ["shard.all_gather", "shard.all_gather", "shard.reduce_scatter", "shard.reduce_scatter"], "layer {layer} grad={grad}");
            let volume = |rs: &[shardc_runtime::report::CommRecord]| {
                rs.iter().filter(|r| r.loc.starts_with(&prefix) && r.elements == bsh && r.loc.contains(".grad") == grad).map(|r| r.bytes).sum::<u64>()
            };
            assert_eq!(volume(&sp), volume(&plain), "layer {layer} grad={grad}");
        }
    }
}

#[test]
fn vocab_parallel_loss_moves_no_logits() {
    // tiny's vocabulary (256) splits over tp=2: the head and the loss stay vocab-parallel.
    let (program, _) = compile("tiny", Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 });
    let records = shardc_runtime::report::comm_records(&program, 0);
    assert!(records.iter().all(|r| r.op != "shard.all_gather"), "{records:#?}");
    let loss: Vec<_> = records.iter().filter(|r| r.loc.starts_with("loss")).collect();
    // Forward: max, sum of exponentials, target logit; backward: max, sum of exponentials.
    assert_eq!(loss.len(), 5, "{loss:#?}");
    // The helper compiles a micro-batch of 4 sequences of 8 tokens.
    assert!(loss.iter().all(|r| r.elements == 4 * 8), "per-token values only: {loss:#?}");
}

#[test]
fn gradient_buckets_are_async_and_equal_single_device() {
    let spec = {
        let mut s = crate::common::spec_with_dtype("tiny", "f32");
        s.training.micro_batch = 4;
        s
    };
    let build = |bucket_bytes: u64| {
        let mut module = model(&spec);
        let options = CompileOptions {
            optimizer: SGD,
            mesh: Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 },
            vocab: 256,
            kv_heads: 4,
            grad_bucket_bytes: bucket_bytes,
            ..Default::default()
        };
        let cx = shardc_ir::mlir::IrContext::new().unwrap();
        compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
        shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &[2, 1, 1]).unwrap()
    };
    // 1 KiB buckets: several buckets, every gradient sync async with an explicit wait.
    let program = build(1024);
    let params = program.args.iter().filter(|a| a.role == Some(shardc_runtime::program::Role::Param)).count();
    let asynchronous: Vec<_> = program.instrs.iter().filter(|i| i.attrs.contains_key("xf.async")).collect();
    assert_eq!(asynchronous.len(), params);
    assert_eq!(program.instrs.iter().filter(|i| i.op == "xf.wait").count(), params);
    let buckets: std::collections::BTreeSet<i64> = asynchronous.iter().map(|i| i.int("xf.bucket").unwrap()).collect();
    assert!(buckets.len() > 2, "{buckets:?}");
    // Every wait comes after the last gradient sync is issued.
    let last_issue = program.instrs.iter().rposition(|i| i.attrs.contains_key("xf.async")).unwrap();
    let first_wait = program.instrs.iter().position(|i| i.op == "xf.wait").unwrap();
    assert!(first_wait > last_issue);

    let corpus = corpus(&spec);
    let (single, _) = compile_with("tiny", Mesh::default(), 0, SGD, false);
    let mut trainer = Trainer::new(single, 5, 2).unwrap();
    let reference: Vec<f64> = (0..STEPS).map(|_| trainer.step(&corpus).unwrap()).collect();
    for bucket_bytes in [1024, 0] {
        let run = train_spmd(&build(bucket_bytes), 5, 2, &corpus, STEPS, Duration::from_secs(30)).unwrap();
        for (a, b) in reference.iter().zip(&run.losses) {
            assert!((a - b).abs() <= TOLERANCE * a.abs(), "buckets of {bucket_bytes} B: {a} vs {b}");
        }
        // One message per bucket: the counters equal the report.
        let expected: u64 = shardc_runtime::report::comm_records(&build(bucket_bytes), 0).iter().map(|r| r.bytes).sum::<u64>() * STEPS;
        assert_eq!(run.bytes_sent[0].values().sum::<u64>(), expected);
    }
}

/// Every gradient of the partitioned `@gradients` equals the single-device gradient.
#[test]
fn every_gradient_equals_single_device() {
    use shardc_passes::sharding::{Partition, PropagateSharding, ShardMegatron};
    use shardc_passes::{Autodiff, Pass};
    let mesh = |dp, cp, tp| Mesh { dp, tp, pp: 1, cp, ep: 1 };
    for (name, mesh, sequence_parallel) in [("tiny", mesh(2, 1, 2), false), ("tiny-llama", mesh(1, 1, 4), false), ("tiny", mesh(1, 1, 2), true), ("tiny-llama", mesh(2, 1, 2), true), ("tiny", mesh(1, 2, 1), false), ("tiny-llama", mesh(2, 2, 2), true)] {
        let mut spec = crate::common::spec_with_dtype(name, "f32");
        spec.training.micro_batch = 4;
        let corpus = corpus(&spec);
        let gradients = |mesh: Mesh| {
            let mut module = model_in_order(&spec, if mesh.cp > 1 { 2 * mesh.cp } else { 1 });
            let kv_heads = spec.model.kv_heads() as i64;
            if mesh.tp > 1 && kv_heads % mesh.tp as i64 != 0 {
                shardc_passes::sharding::ExpandKvHeads { tp: mesh.tp as i64 }.run(&mut module).unwrap();
            }
            Autodiff::default().run(&mut module).unwrap();
            module.funcs.retain(|f| f.name == "gradients");
            if mesh.ranks() > 1 {
                ShardMegatron { mesh, zero: 0, sequence_parallel, vocab: spec.model.vocab as i64, kv_heads, naive: false }.run(&mut module).unwrap();
                PropagateSharding.run(&mut module).unwrap();
                Partition.run(&mut module).unwrap();
            }
            let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
            shardc_codegen::lower_func_on(module.func("gradients").unwrap(), &grid).unwrap()
        };
        // The single-device gradients, run directly (an unpartitioned program has no layouts).
        let single: Vec<(String, Vec<f64>)> = {
            let program = gradients(Mesh::default());
            let mut exec = shardc_runtime::cpu::CpuExecutor::new(program.clone()).unwrap();
            for (n, shape) in exec.args_with(shardc_runtime::program::Role::Param) {
                let v: Vec<f32> = shardc_runtime::init::init_param(&n, shape.iter().product(), 3, 2).iter().map(|&x| x as f32).collect();
                exec.write::<f32>(&n, &v).unwrap();
            }
            let (t, g) = corpus.batch(3, 1, 4);
            exec.write::<i32>("tokens", &t).unwrap();
            exec.write::<i32>("targets", &g).unwrap();
            exec.run().unwrap();
            program.results.iter().map(|r| (r.name.clone(), exec.read::<f32>(&r.name).unwrap().iter().map(|&x| x as f64).collect())).collect()
        };
        let partitioned = shardc_runtime::train::gradients_spmd(&gradients(mesh), 3, 2, &corpus, Duration::from_secs(30)).unwrap();
        assert_eq!(single.len(), partitioned.len());
        for ((na, a), (nb, b)) in single.iter().zip(&partitioned) {
            assert_eq!(na, nb);
            // Relative to the tensor's own scale; a gradient that is zero in theory (the
            // attention key bias: softmax ignores a per-row shift) holds only rounding noise,
            // compared absolutely.
            let scale = a.iter().fold(0f64, |m, x| m.max(x.abs()));
            let diff = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
            if scale > 1e-6 {
                assert!(diff / scale <= 1e-5, "{name} {mesh} sp={sequence_parallel}: {na} differs by {:e}", diff / scale);
            } else {
                assert!(diff <= 1e-8, "{name} {mesh} sp={sequence_parallel}: {na} (zero in theory) differs by {diff:e}");
            }
        }
    }
}

/// The same seed gives the same initial parameters whatever the mesh: every parameter is
/// initialised as the global tensor and then sharded, so runs at different meshes start
/// from identical models (bit for bit).
#[test]
fn initial_parameters_do_not_depend_on_the_mesh() {
    for name in ["tiny", "tiny-llama"] {
        let (single, spec) = compile(name, Mesh::default());
        let layers = spec.model.layers as usize;
        let reference = shardc_runtime::train::Trainer::new(single, 5, layers).unwrap().state().unwrap();
        let corpus = corpus(&spec);
        for (mesh, zero) in [(Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 0), (Mesh { dp: 1, tp: 4, pp: 1, cp: 1, ep: 1 }, 0), (Mesh { dp: 4, tp: 1, pp: 1, cp: 1, ep: 1 }, 3)] {
            let (program, _) = compile_zero(name, mesh, zero);
            let run = shardc_runtime::train::train_spmd_from(&program, 5, layers, &corpus, 0, std::time::Duration::from_secs(30), shardc_runtime::collectives::Algorithm::Ring, None).unwrap();
            for (param, (shape, values)) in reference.tensors.iter().filter(|(n, _)| !n.starts_with("opt.")) {
                let (got_shape, got) = &run.state.tensors[param];
                assert_eq!(got_shape, shape, "{name} {mesh}: `{param}`");
                // f32 storage on both sides: the values are the same f32 numbers.
                assert!(got == values, "{name} {mesh} ZeRO-{zero}: `{param}` starts differently");
            }
        }
    }
}

/// ZeRO's gradient reduce-scatters and gathers of updated shards go out asynchronously in
/// buckets (several, at 1 KiB) on the CPU backend's communication thread, and the run still
/// equals one device: losses and every parameter, at every stage; the bytes sent equal the
/// report's count of the program's collectives.
#[test]
fn zero_buckets_are_async_and_equal_single_device() {
    let spec = {
        let mut s = crate::common::spec_with_dtype("tiny", "f32");
        s.training.micro_batch = 4;
        s
    };
    let corpus = corpus(&spec);
    let (single, _) = compile_with("tiny", Mesh::default(), 0, ADAMW, false);
    let mut trainer = Trainer::new(single, 5, 2).unwrap();
    let reference: Vec<f64> = (0..STEPS).map(|_| trainer.step(&corpus).unwrap()).collect();
    let parameters = trainer.parameters().unwrap();
    for zero in [1u8, 2, 3] {
        let options = CompileOptions { optimizer: ADAMW, mesh: Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, vocab: 256, kv_heads: 4, zero, grad_bucket_bytes: 1024, ..Default::default() };
        let program = compiled_step(&spec, &options);
        let buckets = |op: &str| program.instrs.iter().filter(|i| i.op == op && i.bool("xf.async") == Ok(true)).filter_map(|i| i.int("xf.bucket").ok()).collect::<std::collections::BTreeSet<i64>>().len();
        assert!(buckets("shard.reduce_scatter") > 2, "ZeRO-{zero}: {} scatter buckets", buckets("shard.reduce_scatter"));
        assert!(buckets("shard.all_gather") > 2, "ZeRO-{zero}: {} gather buckets", buckets("shard.all_gather"));
        if zero == 3 {
            // ZeRO-3 keeps parameters sharded: nothing to gather after the update; its
            // asynchronous gathers are the parameters' own, prefetched one at a time.
            let args: std::collections::HashSet<usize> = program.args.iter().map(|a| a.buffer).collect();
            assert!(program.instrs.iter().filter(|i| i.op == "shard.all_gather" && i.bool("xf.async") == Ok(true)).all(|i| i.int("xf.bucket_members") == Ok(1) && args.contains(&i.inputs[0])));
        }
        let run = train_spmd(&program, 5, 2, &corpus, STEPS, Duration::from_secs(30)).unwrap();
        for (a, b) in reference.iter().zip(&run.losses) {
            assert!((a - b).abs() <= TOLERANCE * a.abs(), "ZeRO-{zero}: {a} vs {b}");
        }
        for ((name, _, a), (_, _, b)) in parameters.iter().zip(&run.parameters) {
            let a: Vec<f64> = a.iter().map(|&x| x as f64).collect();
            assert!(rel(&a, b) <= TOLERANCE, "ZeRO-{zero}: parameter {name} differs by {:e}", rel(&a, b));
        }
        let expected: u64 = shardc_runtime::report::comm_records(&program, 0).iter().map(|r| r.bytes).sum::<u64>() * STEPS;
        assert_eq!(run.bytes_sent[0].values().sum::<u64>(), expected, "ZeRO-{zero}");
    }
}
