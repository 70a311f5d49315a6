//! The pipeline verifies after every pass, hands the IR to its observer, and reports a pass
//! that leaves broken IR as an internal error naming the pass.

use std::path::PathBuf;

use shardc_ir::mlir::IrContext;
use shardc_ir::spec::{lower, parse_file};
use shardc_ir::Module;
use shardc_passes::{compile_pipeline, Changed, Pass, PassError, Pipeline, VerifyShapes};

fn tiny(name: &str) -> Module {
    tiny_on(name, shardc_ir::mesh::Mesh::default())
}

/// The model lowered for `mesh` (its sequences in zigzag order under context parallelism).
fn tiny_on(name: &str, mesh: shardc_ir::mesh::Mesh) -> Module {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let spec = parse_file(&root.join(format!("models/{name}.toml"))).unwrap();
    let shape = shardc_ir::spec::StepShape { rows: spec.training.micro_batch, ..spec.step_shape(&mesh) };
    lower(&spec, shape).unwrap()
}

/// Runs `pipeline` and returns every IR text it observed, with the pass names.
fn run_observed(pipeline: &Pipeline, module: &mut Module) -> Result<Vec<(String, String)>, PassError> {
    let cx = IrContext::new().unwrap();
    let mut seen = Vec::new();
    pipeline.run(&cx, module, |_| true, |pass, ir| seen.push((pass.to_string(), ir.to_string())))?;
    Ok(seen)
}

#[test]
fn verify_pass_leaves_tiny_models_unchanged() {
    for name in ["tiny", "tiny-llama"] {
        let mut module = tiny(name);
        let before = module.clone();
        let cx = IrContext::new().unwrap();
        let report = Pipeline::new().then(VerifyShapes).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
        assert_eq!(report.passes.len(), 1);
        assert_eq!(report.passes[0].changed, Changed::No);
        assert_eq!(module, before);
    }
}

#[test]
fn ir_after_verify_on_tiny_llama() {
    let mut module = tiny("tiny-llama");
    let seen = run_observed(&compile_pipeline(&Default::default()), &mut module).unwrap();
    let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["input", "verify", "autodiff", "optimizer"]);
    // Dumps carry name locations, so every op is traceable to its layer.
    insta::assert_snapshot!(seen[1].1);
}

/// A deliberately wrong pass: it changes a matmul's result type without changing its operands.
struct CorruptMatmul;

impl Pass for CorruptMatmul {
    fn name(&self) -> &'static str {
        "corrupt-matmul"
    }
    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let func = &mut module.funcs[0];
        let op = func.ops.iter().find(|o| o.name == "xf.matmul").unwrap().clone();
        let result = op.results[0].0 as usize;
        if let shardc_ir::Type::Tensor(t) = &mut func.types[result] {
            t.shape[2] += 1;
        }
        Ok(Changed::Yes)
    }
}

#[test]
fn broken_ir_after_a_pass_is_an_internal_error_naming_the_pass() {
    let mut module = tiny("tiny");
    let err = run_observed(&Pipeline::new().then(VerifyShapes).then(CorruptMatmul), &mut module).unwrap_err();
    let PassError::Internal { pass, source } = &err else { panic!("expected an internal error, got {err}") };
    assert_eq!(pass, "corrupt-matmul");
    let text = source.to_string();
    assert!(text.contains("layers.0.attn.q"), "{text}");
    assert!(text.contains("shape rule gives"), "{text}");
}

/// A pass that breaks SSA form by making the first op use the function's last value.
struct BreakSsa;

impl Pass for BreakSsa {
    fn name(&self) -> &'static str {
        "break-ssa"
    }
    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let func = &mut module.funcs[0];
        // Use a value before its definition.
        let last = func.ops.last().unwrap().results[0];
        func.ops[0].operands[0] = last;
        Ok(Changed::Yes)
    }
}

#[test]
fn use_before_definition_is_caught() {
    let mut module = tiny("tiny");
    let err = run_observed(&Pipeline::new().then(BreakSsa), &mut module).unwrap_err();
    let PassError::Internal { source, .. } = &err else { panic!("expected an internal error, got {err}") };
    assert!(source.to_string().contains("before it is defined"), "{source}");
}

/// Runs verify, autodiff (with `recompute`) and the optimizer on a tiny model and returns the
/// IR printed after `pass`.
fn ir_after(model: &str, recompute: shardc_passes::Recompute, pass: &str) -> String {
    let options = shardc_passes::CompileOptions { recompute, ..Default::default() };
    let mut module = tiny(model);
    let seen = run_observed(&compile_pipeline(&options), &mut module).unwrap();
    seen.into_iter().find(|(name, _)| name == pass).map(|(_, ir)| ir).unwrap()
}

#[test]
fn gradients_of_tiny_gpt() {
    insta::assert_snapshot!(ir_after("tiny", shardc_passes::Recompute::None, "autodiff"));
}

#[test]
fn train_step_of_tiny_gpt() {
    insta::assert_snapshot!(ir_after("tiny", shardc_passes::Recompute::None, "optimizer"));
}

/// Weight decay falls on matrices only (projections, embeddings, the LM head), never on norm
/// scales and biases, as Megatron-LM and Hugging Face train; every update carries the
/// schedule's attributes and reads the clipping coefficient.
#[test]
fn weight_decay_skips_norms_and_biases_and_updates_read_the_clip() {
    for model in ["tiny", "tiny-llama"] {
        let options = shardc_passes::CompileOptions { optimizer: shardc_passes::OptimizerKind::adamw(1e-3), ..Default::default() };
        let mut module = tiny(model);
        compile_pipeline(&options).run(&IrContext::new().unwrap(), &mut module, |_| false, |_, _| {}).unwrap();
        let step = module.func("train_step").unwrap();
        let coef = step.ops.iter().find(|op| op.name == "xf.clip_coef").expect("clipping is on by default").results[0];
        let updates: Vec<_> = step.ops.iter().filter(|op| op.name == "xf.adamw").collect();
        assert_eq!(updates.len(), step.args_with(shardc_ir::ArgRole::Param).count());
        for op in updates {
            let param = op.loc.strip_prefix("optimizer.").unwrap();
            let decay = match op.attrs.get("weight_decay") {
                Some(shardc_ir::AttrValue::Float(x)) => *x,
                other => panic!("{param}: {other:?}"),
            };
            let matrix = step.tensor(op.operands[0]).unwrap().rank() >= 2;
            let norm_or_bias = param.ends_with(".bias") || param.contains("norm.");
            assert_eq!(norm_or_bias, !matrix, "{model} {param}");
            assert_eq!(decay, if matrix { 0.1 } else { 0.0 }, "{model} {param}");
            assert_eq!(op.operands[5], coef, "{model} {param}: the update must read the clipping coefficient");
            for attr in ["lr", "min_lr", "warmup_steps", "decay_steps", "cosine"] {
                assert!(op.attrs.get(attr).is_some(), "{model} {param}: no {attr}");
            }
        }
    }
}

#[test]
fn train_step_of_tiny_llama() {
    insta::assert_snapshot!(ir_after("tiny-llama", shardc_passes::Recompute::None, "optimizer"));
}

#[test]
fn train_step_of_tiny_llama_with_full_recompute() {
    insta::assert_snapshot!(ir_after("tiny-llama", shardc_passes::Recompute::Full, "optimizer"));
}

#[test]
fn train_step_of_tiny_llama_with_selective_recompute() {
    insta::assert_snapshot!(ir_after("tiny-llama", shardc_passes::Recompute::SelectiveAttention, "optimizer"));
}

#[test]
fn recompute_copies_exactly_the_chosen_ops() {
    use shardc_passes::Recompute;
    let count = |recompute| {
        let ir = ir_after("tiny-llama", recompute, "optimizer");
        // Ops whose result is a recomputed copy: `%layers.0.mlp.up.recompute = "xf.matmul"(...)`.
        ir.lines().filter(|l| l.trim_start().split(" = ").next().is_some_and(|lhs| lhs.contains(".recompute"))).count()
    };
    assert_eq!(count(Recompute::None), 0);
    // The attention core of each layer is recomputed, and nothing else: its backward reads
    // the core's output and log-sum-exp, which are then not kept from the forward pass (as
    // Megatron-LM's selective recomputation reruns the flash forward in the backward).
    assert_eq!(count(Recompute::SelectiveAttention), 2);
    // Every op of both layers but two per layer whose recomputed copies feed nothing: the
    // last residual add (its value is kept: the next layer's input) and the MLP's down
    // projection that only feeds it.
    let layer_ops = tiny("tiny-llama").funcs[0].ops.iter().filter(|o| o.loc.starts_with("layers.")).count();
    assert_eq!(count(Recompute::Full), layer_ops - 4);
}

#[test]
fn train_step_signature_orders_params_state_inputs() {
    let mut module = tiny("tiny");
    let cx = IrContext::new().unwrap();
    compile_pipeline(&Default::default()).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    let step = module.func("train_step").unwrap();
    let roles: Vec<shardc_ir::ArgRole> = step.args.iter().map(|a| a.role).collect();
    let rank = |r: &shardc_ir::ArgRole| match r {
        shardc_ir::ArgRole::Param => 0,
        shardc_ir::ArgRole::OptState | shardc_ir::ArgRole::Master => 1,
        shardc_ir::ArgRole::Input => 2,
    };
    let mut sorted = roles.clone();
    sorted.sort_by_key(rank);
    assert_eq!(roles, sorted);
    let n_params = step.args_with(shardc_ir::ArgRole::Param).count();
    assert_eq!(step.args_with(shardc_ir::ArgRole::OptState).count(), 2 * n_params);
    assert_eq!(step.returns.len(), 1 + 3 * n_params);
    assert_eq!(step.result_names[0], "loss");
    assert_eq!(step.ops.iter().filter(|o| o.name == "xf.adamw").count(), n_params);
}

/// Runs `mlir-opt-22 --irdl-file=<xf>` on `text`; panics with its complaint if it rejects it.
fn assert_mlir_opt_accepts(text: &str) {
    use std::io::Write;
    let irdl = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("ir/dialect/xf.irdl.mlir");
    let mut child = std::process::Command::new("mlir-opt-22")
        .arg(format!("--irdl-file={}", irdl.display()))
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("mlir-opt-22 not found: run scripts/setup");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "mlir-opt-22 rejected the dump:\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn every_dump_of_the_training_pipeline_parses_with_mlir_opt() {
    use shardc_passes::Recompute;
    for model in ["tiny", "tiny-llama"] {
        for recompute in [Recompute::None, Recompute::Full, Recompute::SelectiveAttention] {
            let options = shardc_passes::CompileOptions { recompute, ..Default::default() };
            let mut module = tiny(model);
            for (pass, ir) in run_observed(&compile_pipeline(&options), &mut module).unwrap() {
                assert!(!ir.is_empty(), "{model} {pass}");
                assert_mlir_opt_accepts(&ir);
            }
        }
    }
}

/// The IR after each sharding pass on tiny GPT at tp=2.
fn sharded_ir(pass: &str) -> String {
    sharded_ir_of("tiny", shardc_ir::mesh::Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, pass)
}

fn sharded_ir_of(model: &str, mesh: shardc_ir::mesh::Mesh, pass: &str) -> String {
    sharded_ir_with(model, mesh, pass, shardc_passes::sharding::ContextAttention::Auto)
}

fn sharded_ir_with(model: &str, mesh: shardc_ir::mesh::Mesh, pass: &str, context_attention: shardc_passes::sharding::ContextAttention) -> String {
    let kv_heads = if model == "tiny-llama" { 2 } else { 4 };
    let options = shardc_passes::CompileOptions { mesh, vocab: 256, kv_heads, context_attention, ..Default::default() };
    let mut module = tiny_on(model, mesh);
    let seen = run_observed(&compile_pipeline(&options), &mut module).unwrap();
    for (_, ir) in &seen {
        assert_mlir_opt_accepts(ir);
    }
    seen.into_iter().find(|(name, _)| name == pass).map(|(_, ir)| ir).unwrap()
}

/// Tensor parallelism that would cut a per-head op's features into parts of heads (here the
/// key/value projections of tiny Llama's 2 kv heads at tp=4, with `expand-kv-heads` told no
/// kv head count) is refused by `partition` as the user's mesh, naming the op and the fix,
/// not built and then failed by the verifier as a bug of shardc.
#[test]
fn partition_refuses_parts_of_heads() {
    let mesh = shardc_ir::mesh::Mesh { tp: 4, ..Default::default() };
    let options = shardc_passes::CompileOptions { mesh, vocab: 256, kv_heads: 0, ..Default::default() };
    let mut module = tiny_on("tiny-llama", mesh);
    let err = run_observed(&compile_pipeline(&options), &mut module).unwrap_err().to_string();
    assert!(err.contains("not whole heads") && err.contains("use a tp that divides"), "{err}");
    assert!(!err.contains("bug"), "{err}");
}

#[test]
fn shard_megatron_on_tiny_gpt_tp2() {
    insta::assert_snapshot!(sharded_ir("shard-megatron"));
}

#[test]
fn propagate_sharding_on_tiny_gpt_tp2() {
    insta::assert_snapshot!(sharded_ir("propagate-sharding"));
}

/// The global norm's sum of squares, added layout by layout: the column-parallel gradients'
/// partial sums (over tp) together, the replicated ones together, then the two groups.
#[test]
fn group_norm_sums_on_tiny_gpt_tp2() {
    let ir = sharded_ir("group-norm-sums");
    let sums: Vec<&str> = ir.lines().filter(|l| l.contains("xf.add") && l.contains("grad_norm")).collect();
    assert!(!sums.is_empty(), "{ir}");
    insta::assert_snapshot!(ir);
}

#[test]
fn partition_on_tiny_gpt_tp2() {
    let ir = sharded_ir("partition");
    // Every inserted collective says why it is there.
    for line in ir.lines().filter(|l| l.contains("shard.all_")) {
        assert!(line.contains("xf.cause"), "collective without a cause: {line}");
    }
    insta::assert_snapshot!(ir);
}

/// Context parallelism on tiny Llama (cp=2): tokens and targets reordered into zigzag order
/// (4 chunks; rank 0 holds chunks 0 and 3) and sliced along the sequence, each layer's keys
/// and values all-gathered over cp before attention and their gradients reduce-scattered
/// back, rotary embeddings and attention told the order and the axes that split their
/// positions, and the weight gradients all-reduced over cp.
#[test]
fn partition_on_tiny_llama_cp2() {
    let ir = sharded_ir_of("tiny-llama", shardc_ir::mesh::Mesh { dp: 1, tp: 1, pp: 1, cp: 2, ep: 1 }, "partition");
    assert!(ir.contains("shard.grid @mesh(shape = 1x1x1x2)"), "{ir}");
    let gathers = ir.lines().filter(|l| l.contains("shard.all_gather") && l.contains("grid_axes = [3]")).count();
    let scatters = ir.lines().filter(|l| l.contains("shard.reduce_scatter") && l.contains("grid_axes = [3]")).count();
    assert_eq!((gathers, scatters), (4, 4), "k and v of two layers, and their gradients: {ir}");
    // Per layer: rope of q and k, attention, and their backward ops.
    assert_eq!(ir.lines().filter(|l| l.contains("xf.seq_split_axes = array<i16: 3>") && l.contains("xf.zigzag = array<i64: 4, 8>")).count(), 2 * 6, "{ir}");
    let reorders = ir.lines().filter(|l| l.contains("\"xf.zigzag\"(%tokens)") || l.contains("\"xf.zigzag\"(%targets)")).count();
    assert!(reorders >= 2, "tokens and targets in zigzag order: {ir}");
    insta::assert_snapshot!(ir);
}

/// Ring attention on tiny Llama (cp=2): no gathers of keys and values left; per layer the
/// forward passes each block on once (`shard.shift ... offset = 1 rotate`, keys and values,
/// asynchronously behind the first block's attention) between two `xf.attention_block`
/// steps merged by `xf.attention_merge`, and the backward passes the blocks on once more and
/// their gradient sums twice (once on, once home). The dump parses with mlir-opt (checked
/// for every pass's dump).
#[test]
fn ring_attention_on_tiny_llama_cp2() {
    let ir = sharded_ir_with("tiny-llama", shardc_ir::mesh::Mesh { dp: 1, tp: 1, pp: 1, cp: 2, ep: 1 }, "ring-attention", shardc_passes::sharding::ContextAttention::Ring);
    let count = |what: &str| ir.lines().filter(|l| l.contains(what)).count();
    assert_eq!(count("shard.all_gather"), 0, "{ir}");
    assert_eq!(count("shard.shift") , 2 * (2 + 2 + 4), "{ir}");
    assert!(ir.contains("grid_axes = [3] shift_axis = 3 offset = 1 rotate"), "{ir}");
    assert_eq!(count("\"xf.attention_block\""), 2 * 2, "{ir}");
    assert_eq!(count("\"xf.attention_block_grad\""), 2 * 2, "{ir}");
    assert_eq!(count("\"xf.attention_merge\""), 2, "{ir}");
    // Each pair of shifts is on the wire while the block before is attended to: asynchronous,
    // two to a bucket, each waited for where its block is first read.
    assert_eq!(count("xf.async = true, xf.bucket = "), count("shard.shift"), "{ir}");
    assert_eq!(count("\"xf.wait\""), count("shard.shift"), "{ir}");
    insta::assert_snapshot!(ir);
}

/// The training step of tiny GPT cut into two pipeline stages (2 micro-batches): sends and
/// receives at the boundary, every op in its section.
fn staged_ir(mesh: shardc_ir::mesh::Mesh, split_weight_grads: bool) -> String {
    let options = shardc_passes::CompileOptions {
        mesh,
        vocab: 256,
        kv_heads: 4,
        pipeline: Some(shardc_passes::PipelineOptions { chunks: 1, microbatches: 2, manual: None, split_weight_grads }),
        ..Default::default()
    };
    let mut module = tiny("tiny");
    let seen = run_observed(&compile_pipeline(&options), &mut module).unwrap();
    let ir = seen.into_iter().find(|(name, _)| name == "split-stages").map(|(_, ir)| ir).unwrap();
    assert_mlir_opt_accepts(&ir);
    ir
}

#[test]
fn split_stages_on_tiny_gpt_pp2() {
    let ir = staged_ir(shardc_ir::mesh::Mesh { dp: 1, tp: 1, pp: 2, cp: 1, ep: 1 }, false);
    // The residual stream crosses the boundary forward, its gradient backward.
    assert!(ir.contains("shard.send %layers.0.mlp.residual on @mesh grid_axes = [2] destination = [1]"), "{ir}");
    assert!(ir.contains("xf.from_stage = 1 : i64, xf.phase = \"backward\""), "{ir}");
    // Each transfer says what it carries between which stages.
    assert!(ir.contains("destination = [1] {xf.cause = \"`layers.0.mlp.residual` made on stage 0 and read on stage 1\""), "{ir}");
    // The loss seed carries the 1/m of the mean over micro-batches.
    assert!(ir.contains("value = 5.000000e-01 : f64"), "{ir}");
    insta::assert_snapshot!(ir);
}

/// Every dump of a partitioned pipeline, the communication optimizer's included, parses with
/// upstream MLIR; the naive layout too.
#[test]
fn partitioned_dumps_parse_with_mlir_opt() {
    for naive_partition in [false, true] {
        let options = shardc_passes::CompileOptions { mesh: shardc_ir::mesh::Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, vocab: 256, kv_heads: 4, naive_partition, ..Default::default() };
        let mut module = tiny("tiny");
        let seen = run_observed(&compile_pipeline(&options), &mut module).unwrap();
        assert!(seen.iter().any(|(pass, _)| pass == "comm-opt"));
        for (_, ir) in &seen {
            assert_mlir_opt_accepts(ir);
        }
    }
}

#[test]
fn split_stages_with_tensor_parallelism_and_weight_sections_parses() {
    let ir = staged_ir(shardc_ir::mesh::Mesh { dp: 2, tp: 2, pp: 2, cp: 1, ep: 1 }, true);
    assert!(ir.contains("xf.phase = \"weight\""), "zero-bubble sections");
    assert!(ir.contains("shard.all_reduce"), "tensor-parallel collectives stay inside the stages");
}

#[test]
fn stages_balance_the_heaviest() {
    use shardc_passes::balance;
    assert_eq!(balance(&[1.0, 1.0, 1.0, 1.0], 2), vec![0, 0, 1, 1]);
    assert_eq!(balance(&[3.0, 1.0, 1.0, 1.0], 2), vec![0, 1, 1, 1]);
    assert_eq!(balance(&[1.0, 1.0, 1.0, 4.0], 2), vec![0, 0, 0, 1]);
    // Fewer blocks than stages: first and last at the ends, empty stages between.
    assert_eq!(balance(&[1.0, 1.0], 4), vec![0, 3]);
    assert_eq!(balance(&[1.0; 6], 8), vec![0, 1, 3, 4, 6, 7]);
}

/// Blocks tied to the one before them share its stage: the balance cuts between the groups.
#[test]
fn tied_blocks_share_a_stage() {
    use shardc_passes::balance_tied;
    // Embedding, layer 0's attention and MLP, layer 1's attention and MLP, head.
    let costs = [1.0, 2.0, 2.0, 2.0, 2.0, 1.0];
    assert_eq!(balance_tied(&costs, &[false; 6], 2), vec![0, 0, 0, 1, 1, 1]);
    assert_eq!(balance_tied(&[1.0, 2.0, 2.0, 2.0, 2.0, 3.0], &[false; 6], 2), vec![0, 0, 0, 0, 1, 1]);
    // Each layer's MLP tied to its attention: the cut falls between layers.
    let tied = [false, false, true, false, true, false];
    assert_eq!(balance_tied(&[1.0, 2.0, 2.0, 2.0, 2.0, 3.0], &tied, 2), vec![0, 0, 0, 1, 1, 1]);
    assert_eq!(balance_tied(&costs, &tied, 4), vec![0, 1, 1, 2, 2, 3]);
}

/// Full recomputation recomputes a layer's attention for its MLP's backward: a stage cut
/// between them (the cost balance cut tiny-llama's layer 1 there) could not be scheduled, and
/// the compile failed. The cut moves to a layer boundary.
#[test]
fn full_recomputation_keeps_each_layer_on_one_stage() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let spec = parse_file(&root.join("models/tiny-llama.toml")).unwrap();
    let mesh = shardc_ir::mesh::Mesh { dp: 1, tp: 1, pp: 2, cp: 1, ep: 1 };
    let mut module = lower(&spec, spec.step_shape(&mesh)).unwrap();
    let options = shardc_passes::CompileOptions {
        recompute: shardc_passes::Recompute::Full,
        mesh,
        vocab: spec.model.padded_vocab(1) as i64,
        kv_heads: spec.model.kv_heads() as i64,
        pipeline: Some(shardc_passes::PipelineOptions { chunks: 1, microbatches: 4, manual: None, split_weight_grads: false }),
        ..Default::default()
    };
    let cx = IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{e:?}"));
    let on = |stage: &str, prefix: &str| module.func(stage).unwrap().ops.iter().any(|op| op.loc.starts_with(prefix));
    assert!(on("stage0", "layers.0.") && on("stage1", "layers.1.attn") && on("stage1", "layers.1.mlp") && !on("stage0", "layers.1."), "layer 1 is cut between stages");
}

/// `bucket-gradients` under ZeRO-1 at dp=2 with small buckets: the gradients'
/// reduce-scatters are asynchronous in buckets of one kind, bucket k waited for as bucket
/// k + 2 goes out (the last two before the first update); each gather bucket follows the
/// update of its last member and is waited for at the end.
#[test]
fn bucket_gradients_on_tiny_gpt_dp2_zero1() {
    let options = shardc_passes::CompileOptions { mesh: shardc_ir::mesh::Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, vocab: 256, kv_heads: 4, zero: 1, grad_bucket_bytes: 4096, ..Default::default() };
    let mut module = tiny("tiny");
    let seen = run_observed(&compile_pipeline(&options), &mut module).unwrap();
    let (_, ir) = seen.iter().find(|(pass, _)| pass == "bucket-gradients").expect("bucket-gradients ran");
    assert_mlir_opt_accepts(ir);
    let lines: Vec<&str> = ir.lines().collect();
    let position = |needle: &str| lines.iter().position(|l| l.contains(needle)).unwrap_or_else(|| panic!("no `{needle}` in {ir}"));
    let scatters = lines.iter().filter(|l| l.contains("shard.reduce_scatter") && l.contains("xf.async = true")).count();
    let gathers = lines.iter().filter(|l| l.contains("shard.all_gather") && l.contains("xf.async = true")).count();
    assert!(scatters > 20 && gathers > 20, "{scatters} scatters, {gathers} gathers");
    // Early waits in the backward pass; no update before the gradient waits.
    let last_scatter = lines.iter().rposition(|l| l.contains("shard.reduce_scatter") && l.contains("xf.async = true")).unwrap();
    assert!(position("reduce_scatter.wait") < last_scatter, "bucket 0 is waited for in the backward pass");
    let last_wait = lines.iter().rposition(|l| l.contains("= \"xf.wait\"(%") && l.contains("reduce_scatter")).unwrap();
    assert!(last_wait < position("\"xf.adamw\""));
    let update = position("%optimizer.layers.1.mlp.up.weight:3 = \"xf.adamw\"");
    assert!(lines[update + 1].contains("%return.layers.1.mlp.up.weight.all_gather = shard.all_gather %optimizer.layers.1.mlp.up.weight#0"), "{}", lines[update + 1]);
    assert!(position("all_gather.wait") > position("%return.final_norm.bias.all_gather = "));
    insta::assert_snapshot!(ir.to_string());
}

/// `overlap-collectives` on tiny at tp=2 with sequence parallelism: the data gradient's
/// reduce-scatter of each column-parallel layer moves up to just after its GEMM and runs
/// asynchronously behind the weight gradient's GEMM, waited for just before the norm's
/// backward reads it, as Megatron-LM overlaps them; the loss's all-reduce, which only the
/// step returns, stays where it is.
#[test]
fn overlap_collectives_on_tiny_gpt_tp2_sequence_parallel() {
    let options = shardc_passes::CompileOptions { mesh: shardc_ir::mesh::Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, vocab: 256, kv_heads: 4, sequence_parallel: true, ..Default::default() };
    let mut module = tiny("tiny");
    let seen = run_observed(&compile_pipeline(&options), &mut module).unwrap();
    let (_, ir) = seen.iter().find(|(pass, _)| pass == "overlap-collectives").expect("overlap-collectives ran");
    assert_mlir_opt_accepts(ir);
    let lines: Vec<&str> = ir.lines().collect();
    let position = |needle: &str| lines.iter().position(|l| l.contains(needle)).unwrap_or_else(|| panic!("no `{needle}` in {ir}"));
    let dgrad = position("%layers.1.mlp.up.grad = \"xf.matmul\"");
    assert!(lines[dgrad + 1].contains("%layers.1.mlp_norm.grad.reduce_scatter = shard.reduce_scatter %layers.1.mlp.up.grad on @mesh grid_axes = [1] scatter_axis = 1 {xf.async = true"), "{}", lines[dgrad + 1]);
    assert!(lines[dgrad + 2].contains("\"xf.matmul_wgrad\""), "{}", lines[dgrad + 2]);
    assert!(lines[dgrad + 3].contains("%layers.1.mlp_norm.grad.reduce_scatter.wait = \"xf.wait\""), "{}", lines[dgrad + 3]);
    assert!(lines[dgrad + 4].contains("\"xf.layernorm_grad\"(%layers.1.attn.residual, %layers.1.mlp_norm.weight, %layers.1.mlp_norm.grad.reduce_scatter.wait)"), "{}", lines[dgrad + 4]);
    assert!(ir.lines().any(|l| l.contains("%return.loss") || l.contains("%loss")), "the loss");
    assert!(!ir.lines().any(|l| l.contains("xf.wait") && l.contains("loss.all_reduce")), "the returned loss stays synchronous");
    insta::assert_snapshot!(ir.to_string());
}

/// `bucket-step-gradients` at dp=2, pp=2 (tiny GPT, 4 micro-batches): every data-parallel
/// all-reduce of a gradient summed over the micro-batches is in a step bucket, buckets are
/// unique across the stages, each says its size, and the dump parses with mlir-opt. Buckets
/// of one byte hold one gradient each.
#[test]
fn step_gradients_travel_in_buckets_of_each_stage() {
    let mesh = shardc_ir::mesh::Mesh { dp: 2, tp: 1, pp: 2, cp: 1, ep: 1 };
    let stages = shardc_passes::PipelineOptions { chunks: 1, microbatches: 4, manual: None, split_weight_grads: false };
    let buckets = |bytes: u64| {
        let options = shardc_passes::CompileOptions { mesh, vocab: 256, kv_heads: 4, grad_bucket_bytes: bytes, pipeline: Some(stages.clone()), ..Default::default() };
        let mut module = tiny_on("tiny", mesh);
        let seen = run_observed(&compile_pipeline(&options), &mut module).unwrap();
        let (_, ir) = seen.iter().find(|(pass, _)| pass == "bucket-step-gradients").expect("bucket-step-gradients ran");
        assert_mlir_opt_accepts(ir);
        let mut found: Vec<(String, i64, i64)> = Vec::new();
        for func in &module.funcs {
            for op in func.ops.iter().filter(|o| o.name == "shard.all_reduce" && o.attrs.axes("grid_axes") == Ok(vec![0])) {
                let step = matches!(op.attrs.get("xf.phase"), Some(shardc_ir::AttrValue::Str(p)) if p == "step");
                match (op.attrs.get("xf.step_bucket"), op.attrs.get("xf.step_bucket_members")) {
                    (Some(shardc_ir::AttrValue::Int(b)), Some(shardc_ir::AttrValue::Int(n))) => {
                        assert!(step, "{}: only step sections are bucketed", op.loc);
                        found.push((func.name.clone(), *b, *n));
                    }
                    _ => assert!(!step || op.loc.contains("embed"), "{}: a step-section gradient sync outside any bucket", op.loc),
                }
            }
        }
        found
    };
    let whole = buckets(25 << 20);
    assert!(!whole.is_empty());
    for (func, b, n) in &whole {
        let members = whole.iter().filter(|(_, x, _)| x == b).collect::<Vec<_>>();
        assert_eq!(members.len() as i64, *n, "bucket {b} says it has {n} members");
        assert!(members.iter().all(|(f, _, _)| f == func), "bucket {b} spans stages");
    }
    // One bucket per stage for the tiny model (f32 gradients, far under 25 MB).
    assert_eq!(whole.iter().map(|(_, b, _)| *b).collect::<std::collections::BTreeSet<_>>().len(), 2);
    let single = buckets(1);
    assert_eq!(single.len(), whole.len());
    assert!(single.iter().all(|(_, _, n)| *n == 1));
}

/// `bucket-step-gradients` under ZeRO-1 at dp=2, pp=2 (tiny GPT, AdamW, 4 micro-batches,
/// buckets of 4 KiB): the step sections' reduce-scatters of summed gradients travel in step
/// buckets of their own kind, and the gathers of the updated shards become asynchronous
/// buckets that each stage waits for at the end of its step section (in the training step's
/// order last, so merged chunks wait last too). The dump parses with mlir-opt.
#[test]
fn bucket_step_gradients_on_tiny_gpt_dp2_pp2_zero1() {
    let mesh = shardc_ir::mesh::Mesh { dp: 2, tp: 1, pp: 2, cp: 1, ep: 1 };
    let stages = shardc_passes::PipelineOptions { chunks: 1, microbatches: 4, manual: None, split_weight_grads: false };
    let optimizer = shardc_passes::OptimizerKind::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 };
    let options = shardc_passes::CompileOptions { mesh, vocab: 256, kv_heads: 4, zero: 1, optimizer, grad_bucket_bytes: 4096, pipeline: Some(stages), ..Default::default() };
    let mut module = tiny_on("tiny", mesh);
    let seen = run_observed(&compile_pipeline(&options), &mut module).unwrap();
    let (_, ir) = seen.iter().find(|(pass, _)| pass == "bucket-step-gradients").expect("bucket-step-gradients ran");
    assert_mlir_opt_accepts(ir);
    let stages: Vec<&shardc_ir::Func> = module.funcs.iter().filter(|f| f.name.starts_with("stage")).collect();
    assert_eq!(stages.len(), 2);
    for func in stages {
        let is_step = |op: &shardc_ir::Op| matches!(op.attrs.get("xf.phase"), Some(shardc_ir::AttrValue::Str(p)) if p == "step");
        let scatters: Vec<&shardc_ir::Op> = func.ops.iter().filter(|o| o.name == "shard.reduce_scatter" && is_step(o)).collect();
        assert!(scatters.len() > 5, "{}: {} step-section scatters", func.name, scatters.len());
        for op in &scatters {
            assert!(op.attrs.get("xf.step_bucket").is_some() || op.loc.contains("embed.tokens"), "{}: a summed gradient's scatter outside any step bucket", op.loc);
        }
        let gathers: Vec<usize> = (0..func.ops.len()).filter(|&i| func.ops[i].name == "shard.all_gather" && is_step(&func.ops[i])).collect();
        assert!(!gathers.is_empty(), "{}: no gathers of updated shards", func.name);
        let waits: Vec<usize> = (0..func.ops.len()).filter(|&i| func.ops[i].name == "xf.wait" && is_step(&func.ops[i])).collect();
        // Every gather but the tied embedding's, which stage 0 sends on to the LM head.
        for &g in &gathers {
            let asynchronous = func.ops[g].attrs.get("xf.async") == Some(&shardc_ir::AttrValue::Bool(true));
            assert_eq!(asynchronous, !func.ops[g].loc.contains("embed.tokens"), "{}", func.ops[g].loc);
        }
        let asynchronous = gathers.iter().filter(|&&g| func.ops[g].attrs.get("xf.async").is_some()).count();
        assert!(asynchronous >= gathers.len() - 1 && asynchronous > 0, "{}: {asynchronous} of {} gathers", func.name, gathers.len());
        assert_eq!(waits.len(), asynchronous, "{}: a wait for each asynchronous gather", func.name);
        // The waits close the function, last in the training step's order.
        assert_eq!(*waits.first().unwrap(), func.ops.len() - waits.len(), "{}: the waits end the step section", func.name);
        assert!(waits.iter().all(|&w| func.ops[w].attrs.get("xf.order") == Some(&shardc_ir::AttrValue::Int(i64::MAX)) && is_step(&func.ops[w])));
    }
    insta::assert_snapshot!(ir.to_string());
}
