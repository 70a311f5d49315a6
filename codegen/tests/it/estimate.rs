//! The memory estimator against the published formulas (shared/refs/memory-formulas.md) on
//! the shipped gpt3-175b- and llama-7b-shaped specs.

use shardc_codegen::estimate::memory;
use shardc_ir::mesh::Mesh;
use shardc_passes::{compile_pipeline, CompileOptions};

use crate::common::*;

fn compile(name: &str, mesh: Mesh, micro_batch: u64, zero: u8) -> (shardc_runtime::Program, shardc_ir::spec::Spec, u64) {
    let mut spec = spec_with_dtype(name, "bf16");
    spec.training.micro_batch = micro_batch;
    let mut module = model(&spec);
    let params = module.func("forward").unwrap().parameter_count();
    let options = CompileOptions { mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, zero, comm_opt: false, ..Default::default() };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    let grid = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    (shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap(), spec, params)
}

fn close(what: &str, ours: f64, formula: f64) {
    let err = (ours - formula).abs() / formula;
    assert!(err <= 0.05, "{what}: estimate {ours:.4e} vs formula {formula:.4e} ({:.1}% off)", 100.0 * err);
}

/// Model states: 16 Psi bytes per replica, sharded by ZeRO stage (Rajbhandari et al.), with
/// Psi the parameters of one model-parallel rank, plus what keeping gradients in fp32 adds
/// (the program casts bf16 gradients up before reducing and accumulating them, as
/// Megatron-LM does in bf16 training: 4 Psi bytes instead of 2, sharded from stage 2). The
/// estimate reads the types and layouts of the program compiled at each stage.
#[test]
fn model_states_follow_the_zero_formulas() {
    for (name, tp) in [("gpt3-175b", 8), ("llama-7b", 4)] {
        let dp = 8u64;
        let d = dp as f64;
        for zero in 0..=3u8 {
            let (program, _, params) = compile(name, Mesh { dp, tp, pp: 1, cp: 1, ep: 1 }, dp, zero);
            let psi = params as f64 / tp as f64;
            let formula = [16.0 * psi, 4.0 * psi + 12.0 * psi / d, 2.0 * psi + 14.0 * psi / d, 16.0 * psi / d][zero as usize];
            let fp32_gradients = if zero >= 2 { 2.0 * psi / d } else { 2.0 * psi };
            let m = &memory(std::slice::from_ref(&program), zero)[0];
            close(&format!("{name} tp={tp} dp={dp} ZeRO-{zero}"), m.parameters + m.all_gradients + m.optimizer, formula + fp32_gradients);
            // The 12 Psi of fp32 master weights and moments, sharded from stage 1.
            close(&format!("{name} ZeRO-{zero} optimizer"), m.optimizer, if zero >= 1 { 12.0 * psi / d } else { 12.0 * psi });
        }
    }
}

/// Activations of a GPT-style layer under tensor parallelism (Korthikanti et al. Table 2). Our
/// attention is fused (scores are recomputed in the backward pass, as the selective
/// recomputation row assumes) and the model has no dropout, so the row to meet is
/// `s b h (10 + 24/t)` less the two `s b h` bytes of dropout masks, plus what
/// FlashAttention-2's backward reads that the row leaves out: each row's log-sum-exp in fp32
/// (`4 s b a / t`). (Its output is the projection's input, which the row counts: heads stay
/// side by side in the features, so no copy of it in heads is kept.)
#[test]
fn activations_follow_the_tensor_parallel_formula() {
    let (tp, dp) = (8u64, 8u64);
    let (program, spec, _) = compile("gpt3-175b", Mesh { dp, tp, pp: 1, cp: 1, ep: 1 }, dp, 0);
    let m = &memory(std::slice::from_ref(&program), 0)[0];
    let (s, b, h, layers) = (spec.seq_len() as f64, 1.0, spec.model.hidden as f64, spec.model.layers as f64);
    let t = tp as f64;
    let flash = 4.0 * s * b * spec.model.heads as f64 / t;
    let per_layer = s * b * h * (10.0 + 24.0 / t) - 2.0 * s * b * h + flash;
    close("gpt3-175b activations", m.kept_per_microbatch, per_layer * layers);
    assert_eq!(m.in_flight, 1);
}

/// The same accounting for the Llama layer (RMSNorm, SwiGLU, no dropout, fused attention):
/// norm inputs and outputs whole (8 s b h), q, k, v and the attention output split (8 s b h /
/// t with as many kv heads as heads), the gate and up projections and their product split
/// (6 s b f / t), and FlashAttention-2's saved log-sum-exp, as above.
#[test]
fn llama_activations_follow_the_same_accounting() {
    let (tp, dp) = (4u64, 8u64);
    let (program, spec, _) = compile("llama-7b", Mesh { dp, tp, pp: 1, cp: 1, ep: 1 }, dp, 0);
    let m = &memory(std::slice::from_ref(&program), 0)[0];
    let (s, h, f, layers, t) = (spec.seq_len() as f64, spec.model.hidden as f64, spec.model.ffn_hidden as f64, spec.model.layers as f64, tp as f64);
    assert_eq!(spec.model.kv_heads(), spec.model.heads, "the formula below assumes as many kv heads as heads");
    let flash = 4.0 * s * spec.model.heads as f64 / t;
    let per_layer = s * h * (8.0 + 8.0 / t) + 6.0 * s * f / t + flash;
    close("llama-7b activations", m.kept_per_microbatch, per_layer * layers);
}

/// The planner's unit costs read bytes per parameter from the compiled program's types: in
/// mixed precision 2 for the bf16 weights, 4 for the fp32 gradients, 12 for the fp32 master
/// copy and two moments; an f32 program keeps 4, 4 and 8 (two moments, no master).
#[test]
fn unit_costs_read_bytes_per_parameter_from_the_program() {
    let cluster = shardc_ir::cluster::Cluster::default();
    for (dtype, want) in [("bf16", (2.0, 4.0, 12.0)), ("f32", (4.0, 4.0, 8.0))] {
        let mut spec = spec_with_dtype("tiny", dtype);
        spec.training.micro_batch = 1;
        let mut module = model(&spec);
        let cx = shardc_ir::mlir::IrContext::new().unwrap();
        compile_pipeline(&CompileOptions { comm_opt: false, ..Default::default() }).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
        let program = shardc_codegen::lower_func(module.func("train_step").unwrap()).unwrap();
        let u = shardc_codegen::estimate::unit_costs(&program, &cluster);
        assert_eq!((u.parameter_bytes, u.gradient_bytes, u.state_bytes), want, "{dtype}");
        assert!(u.layer_kept > 0.0 && u.temporaries >= 0.0);
    }
}

/// The one-layer-ish tiny step at dp=2 under ZeRO stage `zero`, with gradient buckets of
/// `bucket_bytes` (0: none).
fn tiny_dp2(dtype: &str, zero: u8, bucket_bytes: u64) -> shardc_runtime::Program {
    let mut spec = spec_with_dtype("tiny", dtype);
    spec.training.micro_batch = 2;
    let options = CompileOptions { mesh: Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, zero, comm_opt: false, grad_bucket_bytes: bucket_bytes, ..Default::default() };
    compiled_step(&spec, &options)
}

/// What the data-parallel collectives of a compiled step move per parameter, against an
/// independent count: ZeRO-0 all-reduces each gradient once (in the type it is reduced in:
/// fp32 in mixed precision); ZeRO-3 reduce-scatters each gradient and gathers each parameter
/// (in its stored type) for the forward and again for the backward where the backward reads
/// it: the weights of products (the token table too, read again as the tied head) and norm
/// scales, not biases or the position table (their gradients do not read them). In the
/// ring model (bandwidth-bound) an all-reduce moves 2 (n-1)/n of its bytes, a gather or
/// reduce-scatter (n-1)/n: ZeRO-3 over ZeRO-0 is (2 p + g) / 2 g, the textbook 1.5x in f32
/// (a little less for what is gathered once), and about 1.0x in mixed precision (gathering
/// bf16 weights costs half of reducing an fp32 gradient), where the flat 1.5 the planner used
/// was off by half.
#[test]
fn zero3_sync_over_zero0_is_what_the_compiled_collectives_move() {
    use shardc_runtime::program::Role;
    let cluster = shardc_ir::cluster::Cluster::preset("h100-sxm").unwrap();
    let grid = [64i64, 1, 1];
    // Large enough that latencies vanish against the bytes.
    let params = 1e11;
    // One micro-batch: the per-step collectives and the gathers of the stored shards.
    let seconds = |t: &shardc_codegen::estimate::DataParallelTraffic| t.times(&cluster, params, &grid, &[0]).iter().map(|(_, s)| s).sum::<f64>() + t.microbatch_time(&cluster, params, &grid);
    for (dtype, param_bytes, gradient_bytes, textbook) in [("f32", 4.0, 4.0, 1.5), ("bf16", 2.0, 4.0, 1.0)] {
        let zero0 = tiny_dp2(dtype, 0, 0);
        let t0 = shardc_codegen::estimate::data_parallel_traffic(&zero0);
        let t3 = shardc_codegen::estimate::data_parallel_traffic(&tiny_dp2(dtype, 3, 0));
        let once = |name: &str| name.ends_with(".bias") || name.starts_with("embed.positions");
        let count = |gathered_once: bool| zero0.args.iter().filter(|a| a.role == Some(Role::Param) && once(&a.name) == gathered_once).map(|a| zero0.buffers[a.buffer].len() as f64).sum::<f64>();
        let (gathered_once, gathered_twice) = (count(true), count(false));
        assert!(gathered_once > 0.0 && gathered_twice > 0.0);
        // The loss's dp all-reduce adds 4 bytes over the whole model.
        let loss = 4.0 / (gathered_once + gathered_twice);
        let exact = |what: &str, ours: f64, want: f64| assert!((ours - want).abs() < 1e-9 * want.max(1.0), "{dtype} {what}: {ours} vs {want}");
        exact("ZeRO-0 all-reduce bytes per parameter", t0.all_reduce, gradient_bytes + loss);
        assert_eq!((t0.reduce_scatter, t0.all_gather, t0.gather_per_microbatch), (0.0, 0.0, 0.0), "{dtype}: {t0:?}");
        exact("ZeRO-3 reduce-scatter bytes per parameter", t3.reduce_scatter, gradient_bytes);
        // ZeRO-3 gathers the stored shards (per micro-batch), nothing after the update.
        assert_eq!(t3.all_gather, 0.0, "{dtype}: {t3:?}");
        exact("ZeRO-3 all-gather bytes per parameter", t3.gather_per_microbatch, param_bytes * (2.0 * gathered_twice + gathered_once) / (gathered_twice + gathered_once));
        // The loss and, its gradients being shards, the clipping norm's one fp32 value.
        exact("ZeRO-3 all-reduce (the loss and the gradient norm)", t3.all_reduce, 2.0 * loss);
        // Stages 1 and 2 reduce-scatter the gradient and gather the updated shard once.
        for zero in [1, 2] {
            let t = shardc_codegen::estimate::data_parallel_traffic(&tiny_dp2(dtype, zero, 0));
            exact(&format!("ZeRO-{zero} reduce-scatter"), t.reduce_scatter, gradient_bytes);
            exact(&format!("ZeRO-{zero} all-gather of the update"), t.all_gather, param_bytes);
            assert_eq!(t.gather_per_microbatch, 0.0, "{dtype} ZeRO-{zero}: {t:?}");
        }
        let ratio = seconds(&t3) / seconds(&t0);
        let gathered = param_bytes * (2.0 * gathered_twice + gathered_once) / (gathered_twice + gathered_once);
        close(&format!("{dtype} ZeRO-3 / ZeRO-0 sync"), ratio, (gathered + gradient_bytes) / (2.0 * gradient_bytes));
        // Within a few percent of the textbook ratio (what is gathered once is 6% of the tiny
        // model).
        assert!((ratio - textbook).abs() < 0.05 * textbook, "{dtype}: {ratio} vs {textbook}");
    }
}

/// With buckets on, the memory estimate reports the bucketed gradients (every dp gradient
/// all-reduce's output, held from its bucket's issue to the step's end): the fp32 gradient
/// of every parameter at dp=2, tp=1. They stage in no buffer of their own, so the total is
/// the components' sum with no staging; with buckets off, there are none.
#[test]
fn bucket_bytes_appear_in_the_memory_estimate() {
    let bucketed = tiny_dp2("bf16", 0, 25 << 20);
    let plain = tiny_dp2("bf16", 0, 0);
    let m = &memory(std::slice::from_ref(&bucketed), 0)[0];
    let p = &memory(std::slice::from_ref(&plain), 0)[0];
    assert!(bucketed.instrs.iter().any(|i| i.attrs.contains_key("xf.bucket")), "buckets are on");
    close("bucketed gradient bytes", m.buckets, m.all_gradients);
    let params: f64 = bucketed.args.iter().filter(|a| a.role == Some(shardc_runtime::program::Role::Param)).map(|a| bucketed.buffers[a.buffer].len() as f64).sum();
    close("bucketed gradient bytes, 4 per parameter", m.buckets, 4.0 * params);
    assert_eq!((p.buckets, p.bucket_staging, m.bucket_staging), (0.0, 0.0, 0.0));
    assert_eq!(m.total, m.parameters + m.gradients + m.optimizer + m.activations + m.temporaries + m.bucket_staging);
}

/// The unit costs' breakdown prices every instruction of a layer once: by kernel class and
/// by collective, it sums to the layer's forward and backward seconds, GEMMs are a part of
/// it, and the tp collectives appear under their axes.
#[test]
fn unit_cost_breakdown_sums_to_the_layer() {
    let cluster = shardc_ir::cluster::Cluster::preset("a100-80g").unwrap();
    let mut spec = spec_with_dtype("tiny", "bf16");
    spec.model.layers = 1;
    spec.training.micro_batch = 1;
    let options = CompileOptions { mesh: Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, comm_opt: false, ..Default::default() };
    let program = compiled_step(&spec, &options);
    let u = shardc_codegen::estimate::unit_costs(&program, &cluster);
    let sum: f64 = u.layer_breakdown.values().sum();
    close("layer breakdown", sum, u.layer_forward + u.layer_backward);
    close("embedding breakdown", u.embed_breakdown.values().sum(), u.embed.0 + u.embed.1);
    close("head breakdown", u.head_breakdown.values().sum(), u.head.0 + u.head.1);
    assert!(u.layer_breakdown.get("gemm").is_some_and(|&t| t > 0.0), "{:?}", u.layer_breakdown);
    assert!(u.layer_breakdown.get("all_reduce tp").is_some_and(|&t| t > 0.0), "{:?}", u.layer_breakdown);
    for key in u.layer_breakdown.keys() {
        assert!(["gemm", "attention", "memory-bound"].contains(&key.as_str()) || key.ends_with(" tp"), "{key}");
    }
}

#[test]
fn zero_shards_only_tensors_with_a_dimension_dp_divides() {
    // The planner's rule is the sharding pass's: a tensor is split along a dimension dp
    // divides, or kept whole on every rank.
    let units = shardc_codegen::estimate::UnitCosts { param_shapes: vec![(true, vec![2048, 2048]), (true, vec![2048]), (true, vec![6, 5]), (false, vec![131072, 2048])], ..Default::default() };
    assert_eq!(units.shardable_params(true, 2), (2048 * 2048 + 2048 + 30) as f64);
    assert_eq!(units.shardable_params(true, 3), 30.0, "only [6, 5] has a dimension 3 divides");
    assert_eq!(units.shardable_params(true, 48), 0.0, "48 divides no power of two");
    assert_eq!(units.shardable_params(false, 48), 0.0);
    assert_eq!(units.shardable_params(false, 64), (131072 * 2048) as f64);
}

/// A step without a pipeline makes its gradients in the arena while the backward pass frees
/// activations: the estimate counts them once, so its total is what the program holds
/// (parameters and optimizer state, as its arguments say, and its arena), not that plus
/// every gradient again; the model-states term still has every gradient.
#[test]
fn a_step_without_a_pipeline_counts_its_gradients_once() {
    use shardc_runtime::program::Role;
    for (name, mesh, zero) in [("tiny", Mesh { dp: 1, tp: 1, pp: 1, cp: 1, ep: 1 }, 0), ("tiny", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 0), ("tiny-llama", Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 0), ("tiny", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 2)] {
        let (program, _, _) = compile(name, mesh, 2, zero);
        assert!(program.pipeline.is_none());
        let m = &memory(std::slice::from_ref(&program), zero)[0];
        let state: f64 = program
            .args
            .iter()
            .filter(|a| matches!(a.role, Some(Role::Param | Role::OptState | Role::Master)))
            .map(|a| program.buffers[a.buffer].len() as f64 * program.buffers[a.buffer].dtype.bytes() as f64)
            .sum();
        let held = state + program.memory.arena_bytes as f64;
        assert!((m.total - held).abs() <= 1.0, "{name} {mesh:?}: estimate {} vs held {held} ({m:?})", m.total);
        assert!(m.activations <= m.kept_per_microbatch, "{name} {mesh:?}: {m:?}");
        let peak = shardc_codegen::estimate::arena_peak(&program);
        assert!(peak.live <= program.memory.arena_bytes as f64 && peak.kept + peak.gradients <= peak.live, "{peak:?}");
    }
}

/// Gradient buckets go out on one communication stream, one after another: over a network so
/// slow that every bucket outlasts the backward pass, the step takes at least the buckets'
/// time end to end (priced as overlapping each other, the step took little more than the
/// longest bucket), and the part not hidden behind compute is reported as exposed.
#[test]
fn gradient_buckets_are_priced_one_after_another_on_one_stream() {
    let program = tiny_dp2("f32", 0, 2048);
    let buckets: std::collections::BTreeSet<i64> = program.instrs.iter().filter(|i| i.bool("xf.async") == Ok(true)).filter_map(|i| i.int("xf.bucket").ok()).collect();
    assert!(buckets.len() >= 4, "{} buckets", buckets.len());
    let mut cluster = shardc_ir::cluster::Cluster::preset("h100-sxm").unwrap();
    cluster.intra_node.bandwidth = 1e6;
    cluster.inter_node.bandwidth = 1e6;
    let model = shardc_codegen::estimate::ModelShape { parameters: 1e5, layers: 2.0, hidden: 64.0, seq: 8.0, tokens_per_step: 32.0 };
    let e = shardc_codegen::estimate::estimate(std::slice::from_ref(&program), &cluster, model);
    let bucketed = e.breakdown.iter().filter(|(k, _)| k.contains("(bucketed)")).map(|(_, t)| t).sum::<f64>();
    assert!(bucketed > 10.0 * e.compute_seconds, "the network is not slow enough: {bucketed} s of buckets, {} s of compute", e.compute_seconds);
    assert!(e.step_seconds >= bucketed, "step {} s, buckets {bucketed} s end to end", e.step_seconds);
    let exposed = e.exposed_communication.get("dp").copied().unwrap_or(0.0);
    assert!(exposed >= bucketed - e.compute_seconds, "exposed {exposed} s of {bucketed} s");
}

/// ZeRO's buckets are priced as what the backends issue: each reduce-scatter or all-gather
/// bucket one collective of its members' bytes on the one communication stream (the kind in
/// the breakdown), overlapping the compute after it; the sum of those equals an independent
/// pricing of each bucket's members joined.
#[test]
fn zero_buckets_are_priced_as_one_collective_each_on_the_stream() {
    use shardc_ir::cluster::Collective;
    let program = tiny_dp2("f32", 1, 2048);
    let cluster = shardc_ir::cluster::Cluster::preset("h100-sxm").unwrap();
    let model = shardc_codegen::estimate::ModelShape { parameters: 1e5, layers: 2.0, hidden: 64.0, seq: 8.0, tokens_per_step: 32.0 };
    let e = shardc_codegen::estimate::estimate(std::slice::from_ref(&program), &cluster, model);
    let grid: Vec<i64> = program.mesh.iter().map(|&x| x as i64).collect();
    for (op, kind, name) in [("shard.reduce_scatter", Collective::ReduceScatter, "reduce_scatter dp (bucketed)"), ("shard.all_gather", Collective::AllGather, "all_gather dp (bucketed)")] {
        let mut bytes: std::collections::BTreeMap<i64, f64> = Default::default();
        for i in program.instrs.iter().filter(|i| i.op == op && i.bool("xf.async") == Ok(true)) {
            let b = if op == "shard.all_gather" { i.outputs[0] } else { i.inputs[0] };
            *bytes.entry(i.int("xf.bucket").unwrap()).or_default() += (program.buffers[b].len() * program.buffers[b].dtype.bytes()) as f64;
        }
        assert!(bytes.len() >= 2, "{op}: {} buckets", bytes.len());
        let want: f64 = bytes.values().map(|&b| cluster.time(kind, b, &grid, &[0])).sum();
        let got = e.breakdown.get(name).copied().unwrap_or(0.0);
        assert!((got - want).abs() <= 1e-12 + 1e-9 * want, "{name}: {got} s priced, {want} s from the buckets");
        // Not also priced as the members' own collectives.
        assert!(!e.breakdown.contains_key(&name.replace(" (bucketed)", "")), "{:?}", e.breakdown.keys());
    }
}

/// Every operation on a communicator runs on its one stream, in order: under ZeRO-3 the
/// backward pass's synchronous gathers of parameters over dp wait for the gradient buckets
/// in flight over dp. Over a network slow enough that communication dominates, the step
/// takes at least every dp collective's time end to end (priced concurrently, it did not).
#[test]
fn collectives_on_one_communicator_are_priced_one_after_another() {
    let program = tiny_dp2("f32", 3, 2048);
    let asynchronous = program.instrs.iter().filter(|i| i.bool("xf.async") == Ok(true) && i.op == "shard.reduce_scatter").count();
    let sync_gathers_after = {
        let first = program.instrs.iter().position(|i| i.bool("xf.async") == Ok(true)).unwrap();
        program.instrs[first..].iter().filter(|i| i.op == "shard.all_gather" && i.bool("xf.async").is_err()).count()
    };
    assert!(asynchronous > 0 && sync_gathers_after > 0, "{asynchronous} async scatters, {sync_gathers_after} synchronous gathers after the first");
    let mut cluster = shardc_ir::cluster::Cluster::preset("h100-sxm").unwrap();
    cluster.intra_node.bandwidth = 1e6;
    cluster.inter_node.bandwidth = 1e6;
    let model = shardc_codegen::estimate::ModelShape { parameters: 1e5, layers: 2.0, hidden: 64.0, seq: 8.0, tokens_per_step: 32.0 };
    let e = shardc_codegen::estimate::estimate(std::slice::from_ref(&program), &cluster, model);
    let dp: f64 = e.breakdown.iter().filter(|(k, _)| k.contains(" dp")).map(|(_, t)| t).sum();
    assert!(dp > 10.0 * e.compute_seconds, "{dp} s over dp, {} s of compute", e.compute_seconds);
    assert!(e.step_seconds >= dp * (1.0 - 1e-9), "step {} s, dp collectives {dp} s end to end", e.step_seconds);
}

/// With sequence parallelism the data gradients' reduce-scatters run behind the weight
/// gradients' GEMMs: priced as such, part of the tensor-parallel communication is hidden
/// (exposed less than all of it), and each asynchronous one is priced once.
#[test]
fn sequence_parallel_scatters_are_priced_behind_the_weight_gradients() {
    let mut spec = spec_with_dtype("tiny", "f32");
    spec.training.micro_batch = 2;
    let options = CompileOptions { mesh: Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, sequence_parallel: true, ..Default::default() };
    let program = compiled_step(&spec, &options);
    let asynchronous = program.instrs.iter().filter(|i| i.op == "shard.reduce_scatter" && i.bool("xf.async") == Ok(true)).count();
    assert!(asynchronous >= 2, "{asynchronous} asynchronous scatters");
    let cluster = shardc_ir::cluster::Cluster::preset("h100-sxm").unwrap();
    let model = shardc_codegen::estimate::ModelShape { parameters: 1e5, layers: 2.0, hidden: 16.0, seq: 8.0, tokens_per_step: 16.0 };
    let e = shardc_codegen::estimate::estimate(std::slice::from_ref(&program), &cluster, model);
    let tp: f64 = e.breakdown.iter().filter(|(k, _)| k.ends_with(" tp") || k.contains(" tp (")).map(|(_, t)| t).sum();
    let exposed = e.exposed_communication.get("tp").copied().unwrap_or(0.0);
    assert!(exposed < tp * (1.0 - 1e-6), "exposed {exposed} s of {tp} s over tp");
    assert!((e.step_seconds - (e.compute_seconds + exposed + e.bubble_seconds)).abs() <= 1e-9 + 1e-6 * e.step_seconds, "step {} = compute {} + exposed {exposed} + bubble {}", e.step_seconds, e.compute_seconds, e.bubble_seconds);
}

/// A layer's unit costs count its tensor-parallel collectives whether or not they run
/// asynchronously (the planner adds a layer up without overlap): the layer's priced tp
/// communication equals every tp collective of the layer priced alone.
#[test]
fn unit_costs_count_asynchronous_tensor_parallel_collectives() {
    let cluster = shardc_ir::cluster::Cluster::preset("a100-80g").unwrap();
    let mut spec = spec_with_dtype("tiny", "f32");
    spec.model.layers = 1;
    spec.training.micro_batch = 2;
    let options = CompileOptions { mesh: Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, sequence_parallel: true, ..Default::default() };
    let program = compiled_step(&spec, &options);
    let layer_tp: Vec<&shardc_runtime::program::Instr> = program.instrs.iter().filter(|i| i.loc.starts_with("layers.") && i.op.starts_with("shard.") && i.op != "shard.all_slice").collect();
    assert!(layer_tp.iter().any(|i| i.bool("xf.async") == Ok(true)), "some of the layer's collectives are asynchronous");
    let want: f64 = layer_tp.iter().map(|i| shardc_codegen::estimate::instruction_cost(&program, i, &cluster).1).sum();
    let u = shardc_codegen::estimate::unit_costs(&program, &cluster);
    let got: f64 = u.layer_breakdown.iter().filter(|(k, _)| k.ends_with(" tp")).map(|(_, t)| t).sum();
    close("the layer's tp collectives", got, want);
}
