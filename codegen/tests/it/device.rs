//! Device code: every op of the training steps has a device form, element-wise chains fuse,
//! the generated CUDA module is snapshot-tested, and (with `--features cuda` and NVRTC on the
//! library path) every generated module compiles to PTX.

use shardc_codegen::device::device_plan;
use shardc_ir::mesh::Mesh;
use shardc_passes::{compile_pipeline, CompileOptions, OptimizerKind};
use shardc_runtime::program::{DeviceCall, DevicePlan, KernelArg};
use shardc_runtime::Program;

use crate::common::*;

fn train_step(name: &str, dtype: &str, mesh: Mesh, sequence_parallel: bool) -> Program {
    train_step_zero(name, dtype, mesh, sequence_parallel, 0)
}

fn train_step_zero(name: &str, dtype: &str, mesh: Mesh, sequence_parallel: bool, zero: u8) -> Program {
    let mut spec = spec_with_dtype(name, dtype);
    spec.training.micro_batch = 4;
    let mut module = model(&spec);
    let options = CompileOptions {
        optimizer: OptimizerKind::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 },
        mesh,
        vocab: spec.model.vocab as i64,
        kv_heads: spec.model.kv_heads() as i64,
        sequence_parallel,
        zero,
        ..Default::default()
    };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap_or_else(|e| panic!("{name} {mesh}: {e:?}"));
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap()
}

/// Every configuration whose module is compile-checked.
fn configurations() -> Vec<(String, Program)> {
    let mut out = Vec::new();
    for name in ["tiny", "tiny-llama"] {
        for dtype in ["f32", "bf16", "f64"] {
            out.push((format!("{name} {dtype}"), train_step(name, dtype, Mesh::default(), false)));
        }
        out.push((format!("{name} f32 dp=2,tp=2"), train_step(name, "f32", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, false)));
        out.push((format!("{name} bf16 tp=2 sp"), train_step(name, "bf16", Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, true)));
    }
    // The experts' kernels, in every precision, and expert parallelism.
    for dtype in ["f32", "bf16", "f64"] {
        out.push((format!("tiny-moe {dtype}"), train_step("tiny-moe", dtype, Mesh::default(), false)));
    }
    out.push(("tiny-moe f32 dp=2,ep=2,tp=2".into(), train_step("tiny-moe", "f32", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 2 }, false)));
    // ZeRO-3's gathered parameters, and context parallelism: the ring's block kernels and
    // merge, and the gathered keys' scalar kernels, at head dims 4 and 16.
    out.push(("tiny bf16 dp=2 ZeRO-3".into(), train_step_zero("tiny", "bf16", Mesh { dp: 2, ..Mesh::default() }, false, 3)));
    for (dtype, hidden) in [("f32", 16), ("bf16", 64)] {
        for policy in [shardc_passes::sharding::ContextAttention::Ring, shardc_passes::sharding::ContextAttention::AllGather] {
            let mut spec = spec_with_dtype("tiny-llama", dtype);
            spec.model.hidden = hidden;
            spec.training.micro_batch = 2;
            let options = CompileOptions { mesh: Mesh { cp: 2, ..Mesh::default() }, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, context_attention: policy, ..Default::default() };
            out.push((format!("tiny-llama {dtype} hidden {hidden} cp=2 {policy:?}"), compiled_step(&spec, &options)));
        }
    }
    // ZeRO-1 and 2's updates and gathers of the updated shards, with clipping and without
    // (the multi-tensor update kernels are batched differently).
    for (name, dtype, zero, clip_grad) in [("tiny", "bf16", 1, 0.0), ("tiny-llama", "bf16", 2, 1.0), ("tiny-llama", "f32", 1, 1.0)] {
        let mut spec = spec_with_dtype(name, dtype);
        spec.training.micro_batch = 4;
        let options = CompileOptions { mesh: Mesh { dp: 2, ..Mesh::default() }, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, zero, clip_grad, ..Default::default() };
        out.push((format!("{name} {dtype} dp=2 ZeRO-{zero} clip {clip_grad}"), compiled_step(&spec, &options)));
    }
    // Pipeline ranks and gradient accumulation: their sections, step sections and step
    // buckets.
    use shardc_runtime::schedule::Kind;
    for (name, mesh, kind) in [
        ("tiny", Mesh { pp: 2, ..Mesh::default() }, Kind::Interleaved),
        ("tiny-llama", Mesh { dp: 2, tp: 2, pp: 2, cp: 1, ep: 1 }, Kind::ZeroBubble),
        ("tiny", Mesh { dp: 2, ..Mesh::default() }, Kind::OneFOneB),
    ] {
        let (stages, _) = crate::pipeline::compile_stages(name, mesh, kind, 4);
        for (rank, program) in stages.into_iter().enumerate() {
            out.push((format!("{name} {mesh} {kind:?} pipeline rank {rank}"), program));
        }
    }
    out
}

fn check_plan(what: &str, program: &Program, plan: &DevicePlan) {
    assert_eq!(plan.calls.len(), program.instrs.len(), "{what}");
    for (i, (instr, calls)) in program.instrs.iter().zip(&plan.calls).enumerate() {
        assert!(!calls.is_empty(), "{what}: instruction {i} ({}) has no device call", instr.op);
        for call in calls {
            match call {
                DeviceCall::Launch { kernel, args, block, .. } => {
                    assert!(plan.source.contains(&format!("void {kernel}(")), "{what}: `{kernel}` is not defined in the module");
                    assert_eq!(block % 32, 0, "{what}: `{kernel}` block of {block} threads");
                    for arg in args {
                        if let KernelArg::Buffer(b) = arg {
                            assert!(*b < program.buffers.len());
                        }
                    }
                }
                DeviceCall::Fused { into } => match &plan.calls[*into][0] {
                    DeviceCall::GemmEpilogue { epilogue, .. } => assert!(*into < i && epilogue.members.contains(&i), "{what}: {i} fused into the GEMM of {into}"),
                    // A kernel launches at its first member, but a multi-tensor norm at its
                    // last share (when every share's gradient is made).
                    other => {
                        let norm = instr.op == "xf.sum_squares" && program.instrs[*into].op == "xf.sum_squares" && *into > i;
                        assert!((*into < i || norm) && matches!(other, DeviceCall::Launch { .. }), "{what}: {i} fused into {into}")
                    }
                },
                DeviceCall::GemmEpilogue { gemm, epilogue } => {
                    assert!(instr.op == "xf.matmul" && gemm.m * gemm.n * gemm.k > 0, "{what}: {} as a GEMM with an epilogue", instr.op);
                    assert!(!epilogue.members.is_empty() && epilogue.members.iter().all(|&m| m > i && plan.calls[m] == [DeviceCall::Fused { into: i }]), "{what}: {i}'s epilogue members {:?}", epilogue.members);
                }
                DeviceCall::Runtime => assert!(instr.op.starts_with("shard.") || instr.op == "tensor.empty", "{what}: {} left to the runtime", instr.op),
                DeviceCall::Gemm(g) => assert!(instr.op.starts_with("xf.matmul") && g.m * g.n * g.k > 0, "{what}: {} as a GEMM", instr.op),
                DeviceCall::Copy { .. } => assert_eq!(instr.op, "xf.wait"),
            }
        }
    }
}

#[test]
fn every_op_of_the_training_steps_has_a_device_form() {
    for (what, program) in configurations() {
        let plan = device_plan(&program).unwrap_or_else(|e| panic!("{what}: {e}"));
        check_plan(&what, &program, &plan);
    }
}

/// A step's gradient-norm shares follow one another (the optimizer emits them together, each
/// after its fp32 cast under mixed precision; `group-norm-sums` keeps them together when
/// partitioned), so the device computes the whole norm in two launches at the last share
/// (each member's blocks, then each member's total), where it took two per parameter: single
/// device and partitioned, f32 and bf16. The emulated-device training tests check the sums.
#[test]
fn the_gradient_norm_is_two_launches() {
    for (dtype, mesh) in [("f32", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }), ("f32", Mesh::default()), ("bf16", Mesh::default()), ("bf16", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 })] {
        let what = format!("{dtype} {mesh}");
        let program = train_step("tiny", dtype, mesh, false);
        let plan = device_plan(&program).unwrap();
        let shares: Vec<usize> = program.instrs.iter().enumerate().filter(|(_, i)| i.op == "xf.sum_squares").map(|(k, _)| k).collect();
        assert!(shares.len() > 30, "{what}: {}", shares.len());
        let launches: Vec<&str> = shares.iter().flat_map(|&k| &plan.calls[k]).filter_map(|c| if let DeviceCall::Launch { kernel, .. } = c { Some(kernel.as_str()) } else { None }).collect();
        assert_eq!(launches.len(), 2, "{what}: {launches:?}");
        assert!(launches[0].starts_with("sum_squares_multi_") && launches[1].starts_with("sum_squares_multi_total_"), "{what}: {launches:?}");
        let last = *shares.last().unwrap();
        assert!(shares[..shares.len() - 1].iter().all(|&k| matches!(plan.calls[k].as_slice(), [DeviceCall::Fused { into }] if *into == last)), "{what}");
    }
}

/// A batch of gradient-norm shares ends at a wait for communication: where asynchronous
/// buckets are waited for between the shares (dp=2, tp=2 with sequence parallelism and 1 MiB
/// buckets), the shares before a wait launch before it, while the later buckets are still on
/// the wire (as the shares did one by one), never all after the last wait. The batches still
/// take fewer launches than a pair per share.
#[test]
fn gradient_norm_batches_end_at_waits_for_buckets() {
    let mut spec = spec_with_dtype("tiny", "f32");
    spec.training.micro_batch = 4;
    let mut module = model(&spec);
    // Sequence parallelism's norm gradients are reduced over tp in asynchronous buckets
    // that the shares wait for.
    let mesh = Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 };
    let options = CompileOptions { mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, sequence_parallel: true, grad_bucket_bytes: 1 << 20, ..Default::default() };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    let program = shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap();
    let plan = device_plan(&program).unwrap();
    check_plan("tiny dp=2,tp=2 sp buckets", &program, &plan);
    let shares: Vec<usize> = program.instrs.iter().enumerate().filter(|(_, i)| i.op == "xf.sum_squares").map(|(k, _)| k).collect();
    let waits: Vec<usize> = program.instrs.iter().enumerate().filter(|(_, i)| i.op == "xf.wait").map(|(k, _)| k).collect();
    assert!(waits.iter().any(|&w| w > shares[0] && w < *shares.last().unwrap()), "no wait between the shares: the test does not test the cut");
    for &k in &shares {
        if let [DeviceCall::Fused { into }] = plan.calls[k].as_slice() {
            assert!(!waits.iter().any(|&w| k < w && w < *into), "share {k} waits past a bucket's wait to {into}");
        }
    }
    let launches = shares.iter().flat_map(|&k| &plan.calls[k]).filter(|c| matches!(c, DeviceCall::Launch { .. })).count();
    assert!(launches < 2 * shares.len(), "{launches} launches for {} shares", shares.len());
}

/// The MLP's up projection ends in bias and GELU (storing the pre-activation the backward
/// reads), every other biased projection in its bias, and the backward's data gradient
/// through GELU in GELU's gradient: cuBLASLt's epilogues, with nothing left for the
/// element-wise kernels to do there. f64 modules keep plain GEMMs (no cuBLASLt epilogues).
#[test]
fn gemm_epilogues_fold_bias_gelu_and_its_gradient() {
    use shardc_runtime::program::EpilogueActivation;
    for dtype in ["f32", "bf16"] {
        let program = train_step("tiny", dtype, Mesh::default(), false);
        let plan = device_plan(&program).unwrap();
        let epilogue = |loc: &str| {
            let at = program.instrs.iter().position(|i| i.op == "xf.matmul" && i.loc.ends_with(loc)).unwrap_or_else(|| panic!("no matmul at {loc}"));
            match &plan.calls[at][0] {
                DeviceCall::GemmEpilogue { epilogue, .. } => (epilogue.bias.is_some(), epilogue.activation, epilogue.aux, epilogue.members.clone()),
                other => panic!("{dtype} {loc}: {other:?}"),
            }
        };
        let (bias, activation, aux, members) = epilogue("layers.0.mlp.up");
        assert!(bias && activation == EpilogueActivation::Gelu, "{dtype}");
        let ops: Vec<&str> = members.iter().map(|&m| program.instrs[m].op.as_str()).collect();
        assert_eq!(ops, ["xf.add", "xf.gelu"], "{dtype}");
        // The pre-activation is stored for the GELU gradient, which reads it as its epilogue's aux.
        let pre = aux.expect("the pre-activation is kept");
        let down_grad = program.instrs.iter().position(|i| i.op == "xf.matmul" && i.loc.ends_with("layers.0.mlp.down.grad")).unwrap();
        match &plan.calls[down_grad][0] {
            DeviceCall::GemmEpilogue { epilogue, .. } => {
                assert_eq!((epilogue.activation, epilogue.aux, epilogue.bias), (EpilogueActivation::GeluGrad, Some(pre), None), "{dtype}");
                assert_eq!(program.instrs[epilogue.members[0]].op, "xf.gelu_grad");
            }
            other => panic!("{dtype}: the down projection's data gradient is {other:?}"),
        }
        for loc in ["layers.0.attn.q", "layers.0.attn.out", "layers.0.mlp.down"] {
            let (bias, activation, aux, members) = epilogue(loc);
            assert!(bias && activation == EpilogueActivation::None && aux.is_none() && members.len() == 1, "{dtype} {loc}");
        }
    }
    let program = train_step("tiny", "f64", Mesh::default(), false);
    let plan = device_plan(&program).unwrap();
    assert!(!plan.calls.iter().flatten().any(|c| matches!(c, DeviceCall::GemmEpilogue { .. })), "f64 keeps plain GEMMs");
}

#[test]
fn elementwise_chains_fuse_and_keep_only_what_others_read() {
    let program = train_step("tiny", "f32", Mesh::default(), false);
    // With the epilogues on, the bias adds and GELU are the GEMMs' (see above): no kernel has them.
    let with_epilogues = device_plan(&program).unwrap();
    assert!(!with_epilogues.source.contains("// xf.add -> xf.gelu\n") && !with_epilogues.source.contains("// xf.add -> xf.add\n"));
    let plan = shardc_codegen::device::device_plan_with(&program, shardc_codegen::device::DeviceOptions { gemm_epilogues: false, ..Default::default() }).unwrap();
    let fused = plan.calls.iter().filter(|c| matches!(c.first(), Some(DeviceCall::Fused { .. }))).count();
    assert!(fused >= 8, "only {fused} instructions fused");
    // Bias add and GELU in one kernel; both values are stored because the backward's
    // gelu_grad reads the pre-activation.
    let at = plan.source.find("// xf.add -> xf.gelu\n").expect("a fused bias add and gelu");
    let kernel = &plan.source[at..at + plan.source[at..].find("\n}\n").unwrap()];
    assert_eq!(kernel.matches("] = store(").count(), 2, "{kernel}");
    // A bias add feeding a residual add keeps the biased value in a register.
    let at = plan.source.find("// xf.add -> xf.add\n").expect("a fused bias and residual add");
    let kernel = &plan.source[at..at + plan.source[at..].find("\n}\n").unwrap()];
    assert_eq!(kernel.matches("] = store(").count(), 1, "{kernel}");
    // The AdamW updates run as multi-tensor launches, in place: all of them in launches of
    // at most 16 kernel groups each (a norm's weight and bias, of one length, are one group).
    let updates: Vec<usize> = program.instrs.iter().enumerate().filter(|(_, i)| i.op == "xf.adamw").map(|(k, _)| k).collect();
    let launches: std::collections::BTreeSet<usize> = updates
        .iter()
        .map(|&k| match &plan.calls[k][0] {
            DeviceCall::Fused { into } => *into,
            DeviceCall::Launch { .. } => k,
            other => panic!("update {k} runs as {other:?}"),
        })
        .collect();
    assert!(launches.len() <= updates.len().div_ceil(8) && launches.len() < updates.len(), "{} updates in {} launches", updates.len(), launches.len());
    for &first in &launches {
        let DeviceCall::Launch { kernel, .. } = &plan.calls[first][0] else { unreachable!() };
        assert!(kernel.starts_with("multi_tensor_"), "{kernel}");
        let at = plan.source.find(&format!("void {kernel}(")).unwrap();
        let text = &plan.source[at..at + plan.source[at..].find("\n}\n").unwrap()];
        assert!(text.contains("i64 e = i - 0;") && text.contains("else "), "{text}");
    }
}

/// A multi-tensor launch equals its members run one by one: the emulated device trains tiny
/// with AdamW through the launches exactly as the CPU backend does (see `emulated`), and a
/// member's elements are only its own: each branch indexes its buffers by `e`, its offset
/// within the member, never past the member's length.
#[test]
fn multi_tensor_members_index_only_their_own_elements() {
    let program = train_step("tiny", "f32", Mesh::default(), false);
    let plan = device_plan(&program).unwrap();
    let mut seen = 0;
    for at in plan.source.match_indices("extern \"C\" __global__ void multi_tensor_").map(|(at, _)| at) {
        let text = &plan.source[at..at + plan.source[at..].find("\n}\n").unwrap()];
        // Branch k covers [offset_k, offset_k + n_k): the offsets subtracted are the running
        // sums of the tests' bounds.
        let bounds: Vec<usize> = text.match_indices("if (i < ").map(|(k, _)| text[k + 8..].split(')').next().unwrap().parse().unwrap()).collect();
        let offsets: Vec<usize> = text.match_indices("i64 e = i - ").map(|(k, _)| text[k + 12..].split(';').next().unwrap().parse().unwrap()).collect();
        assert_eq!(offsets.len(), bounds.len() + 1, "{text}");
        assert_eq!(offsets[0], 0);
        assert_eq!(&offsets[1..], &bounds[..], "{text}");
        assert!(!text.contains("[i]") && !text.contains("[i %"), "a member indexes by the launch's index: {text}");
        seen += 1;
    }
    assert!(seen >= 1, "no multi-tensor launch");
}

/// A step's parameter updates go in multi-tensor launches of up to 16 kernel groups wherever
/// something holds them to the step's end: clipping (the global norm), or data-parallel
/// gradient buckets, with clipping or without. With neither, each update follows its own
/// gradient in the backward, so that the gradient's memory is free at once (the memory plan
/// reuses it for the next): one launch per update, by design. Tiny and tiny-llama, f32 and
/// bf16 with masters. (Not here: tiny-llama in bf16 on one device with clipping, where the
/// memory plan puts the first new bf16 parameters in their gradients' freed storage, so an
/// update and its cast cannot share a kernel: 4 of its 21 updates are launches of their own.)
#[test]
fn parameter_updates_are_multi_tensor_launches_where_the_step_holds_them_to_its_end() {
    for (name, dtype, dp, clip_grad) in [("tiny", "f32", 1, 1.0), ("tiny", "f32", 1, 0.0), ("tiny-llama", "f32", 1, 1.0), ("tiny-llama", "bf16", 1, 0.0), ("tiny-llama", "bf16", 2, 1.0), ("tiny-llama", "bf16", 2, 0.0), ("tiny", "f32", 2, 1.0), ("tiny", "f32", 2, 0.0)] {
        let what = format!("{name} {dtype} dp={dp} clip {clip_grad}");
        let mut spec = spec_with_dtype(name, dtype);
        spec.training.micro_batch = 4;
        let options = CompileOptions { mesh: Mesh { dp, ..Mesh::default() }, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, clip_grad, ..Default::default() };
        let program = compiled_step(&spec, &options);
        let plan = device_plan(&program).unwrap();
        let updates: Vec<usize> = (0..program.instrs.len()).filter(|&i| program.instrs[i].op == "xf.adamw").collect();
        let launch_of = |i: usize| match plan.calls[i].as_slice() {
            [DeviceCall::Fused { into }] => *into,
            _ => i,
        };
        let launches: std::collections::BTreeSet<usize> = updates.iter().map(|&i| launch_of(i)).collect();
        let held = dp > 1 || clip_grad > 0.0;
        if held {
            assert!(launches.len() <= updates.len().div_ceil(16), "{what}: {} updates in {} launches", updates.len(), launches.len());
        } else {
            assert_eq!(launches.len(), updates.len(), "{what}");
            assert!(updates.iter().all(|&u| program.instrs[..u].iter().any(|i| i.outputs.contains(&program.instrs[u].inputs[1]))), "{what}");
        }
    }
}

/// A fused kernel never stores into the storage of an operand it reads at a broadcast index
/// (a bias, a norm's weight): its threads write element `i` while others still read element
/// `i % len` of the operand. Under ZeRO-3 a gathered bias is a temporary whose slot the
/// memory plan gives to the next value once the bias add has read it, such as the residual
/// sum that the bias add fuses with.
#[test]
fn fused_kernels_never_overwrite_an_operand_read_at_a_broadcast_index() {
    let mut programs = configurations();
    for name in ["tiny", "tiny-llama"] {
        for dtype in ["f32", "bf16"] {
            programs.push((format!("{name} {dtype} dp=2 ZeRO-3"), train_step_zero(name, dtype, Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, false, 3)));
        }
    }
    for (what, program) in programs {
        let plan = device_plan(&program).unwrap();
        // On a device, temporaries live at their arena offsets.
        assert!(!program.memory.offsets.is_empty(), "{what}: the plan has an arena");
        for (first, calls) in plan.calls.iter().enumerate() {
            if !matches!(calls.first(), Some(DeviceCall::Launch { .. })) {
                continue;
            }
            let group: Vec<usize> = std::iter::once(first).chain((first + 1..plan.calls.len()).filter(|&i| matches!(plan.calls[i].first(), Some(DeviceCall::Fused { into }) if *into == first))).collect();
            for &i in &group {
                // An instruction's own length (a multi-tensor launch's members differ in it).
                let n = program.buffers[program.instrs[i].outputs[0]].len();
                for &b in program.instrs[i].inputs.iter().filter(|&&b| program.buffers[b].len() != n) {
                    for &j in &group {
                        for &o in &program.instrs[j].outputs {
                            assert_eq!(
                                program.alias(o, b),
                                shardc_runtime::program::Alias::None,
                                "{what}: the kernel of instructions {group:?} stores `{}` (instruction {j}) where instruction {i} reads `{}` at a broadcast index",
                                program.buffers[o].name,
                                program.buffers[b].name
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn the_generated_module_is_stable() {
    let program = train_step("tiny", "f32", Mesh::default(), false);
    let plan = device_plan(&program).unwrap();
    // The generated part: fused kernels and the call list (the hand-written kernels are the
    // ops' own text, compiled below).
    let generated: String = plan.source.split("// xf.").skip(1).map(|k| format!("// xf.{k}")).collect();
    insta::assert_snapshot!("tiny_fused_kernels", generated);
    let calls: Vec<String> = program
        .instrs
        .iter()
        .zip(&plan.calls)
        .map(|(instr, calls)| {
            let what: Vec<String> = calls
                .iter()
                .map(|c| match c {
                    DeviceCall::Launch { kernel, grid, block, shared_bytes, .. } => format!("{kernel}<<<{grid:?}, {block}, {shared_bytes}>>>"),
                    DeviceCall::Gemm(g) => format!("gemm m={} n={} k={} ta={} tb={} batch={}", g.m, g.n, g.k, g.transpose_a, g.transpose_b, g.batch),
                    DeviceCall::GemmEpilogue { gemm: g, epilogue: e } => format!(
                        "gemm m={} n={} k={} ta={} tb={} batch={} epilogue{}{:?}{}",
                        g.m, g.n, g.k, g.transpose_a, g.transpose_b, g.batch,
                        if e.bias.is_some() { " bias " } else { " " },
                        e.activation,
                        if e.aux.is_some() { " aux" } else { "" }
                    ),
                    DeviceCall::Fused { into } => format!("fused into {into}"),
                    DeviceCall::Copy { .. } => "copy".into(),
                    DeviceCall::Runtime => "runtime".into(),
                })
                .collect();
            format!("{:<22} {:<28} {}", instr.op, instr.loc, what.join("; "))
        })
        .collect();
    insta::assert_snapshot!("tiny_device_calls", calls.join("\n"));
}

/// The op registry and the CPU backend's kernel registry cover the same ops: every `xf` op
/// has a CPU kernel (the reference every other backend is tested against), and every CPU
/// kernel is of an op the registry defines.
#[test]
fn every_op_has_a_cpu_kernel_and_every_cpu_kernel_an_op() {
    let kernels: std::collections::BTreeSet<&str> = shardc_runtime::cpu::kernel_ops().into_iter().collect();
    let ops: std::collections::BTreeSet<String> = shardc_ir::ops::REGISTRY.iter().map(|op| format!("xf.{}", op.mnemonic())).collect();
    let without: Vec<&String> = ops.iter().filter(|op| !kernels.contains(op.as_str())).collect();
    assert!(without.is_empty(), "ops without a CPU kernel: {without:?}");
    let strays: Vec<&&str> = kernels.iter().filter(|k| !ops.contains(**k)).collect();
    assert!(strays.is_empty(), "CPU kernels of no op: {strays:?}");
}

/// The device program of `xf.attention` and `xf.attention_grad` on `q [b, s, hq * d]` and
/// `k, v [b, s, hk * d]`, with `dout`, returning `out`, `lse`, `dq`, `dk` and `dv`.
fn attention_program(dtype: shardc_ir::types::DType, s: i64, causal: bool, (b, hq, hk, d): (i64, i64, i64, i64)) -> Program {
    use shardc_ir::attrs::{AttrValue, Attrs};
    use shardc_ir::graph::{ArgRole, FuncBuilder};
    use shardc_ir::types::TensorTy;
    let attrs = Attrs::new().with("causal", AttrValue::Bool(causal)).with("scale", AttrValue::Float(1.0 / (d as f64).sqrt())).with("head_dim", AttrValue::Int(d));
    let (qt, kt) = (TensorTy::new(vec![b, s, hq * d], dtype), TensorTy::new(vec![b, s, hk * d], dtype));
    let mut fb = FuncBuilder::new("attention");
    let args: Vec<_> = [("q", &qt), ("k", &kt), ("v", &kt), ("dout", &qt)].iter().map(|(n, t)| fb.arg(n, (*t).clone(), ArgRole::Input)).collect();
    let out = fb.op_multi("xf.attention", &args[..3], attrs.clone(), "fwd").unwrap();
    let grads = fb.op_multi("xf.attention_grad", &[args[0], args[1], args[2], out[0], out[1], args[3]], attrs, "bwd").unwrap();
    let results = [out[0], out[1], grads[0], grads[1], grads[2]];
    let func = fb.finish(&results, &["out".to_string(), "lse".to_string(), "dq".to_string(), "dk".to_string(), "dv".to_string()]);
    shardc_codegen::device::with_device_plan(shardc_codegen::lower_func(&func).unwrap()).unwrap()
}

/// Heads side by side in the features are independent attentions: on the CPU backend (the
/// oracle the device is checked against), attention over `q [b, s, 4 heads x 3]` against two
/// kv heads, forward and backward, equals attention over each query head's columns alone
/// against its kv head's columns, head by head, element for element. An independent check
/// of the `[b, s, h * d]` layout that the CPU and device kernels share.
#[test]
fn heads_side_by_side_are_independent_attentions() {
    use shardc_ir::types::DType;
    let (b, s, hq, hk, d) = (2usize, 5usize, 4usize, 2usize, 3usize);
    let input = |i: u64, len: usize| -> Vec<f64> { (0..len).map(|j| 2.0 * (shardc_runtime::init::uniform(i + 31, j as u64) - 0.5)).collect() };
    let (q, k, v, dout) = (input(0, b * s * hq * d), input(1, b * s * hk * d), input(2, b * s * hk * d), input(3, b * s * hq * d));
    let run = |heads: (i64, i64), inputs: [&[f64]; 4]| -> Vec<Vec<f64>> {
        let mut cpu = shardc_runtime::cpu::CpuExecutor::new(attention_program(DType::F64, s as i64, true, (b as i64, heads.0, heads.1, d as i64))).unwrap();
        for (name, values) in ["q", "k", "v", "dout"].into_iter().zip(inputs) {
            cpu.write_f64(name, values).unwrap();
        }
        cpu.run().unwrap();
        ["out", "lse", "dq", "dk", "dv"].iter().map(|name| cpu.read_f64(name).unwrap()).collect()
    };
    let all = run((hq as i64, hk as i64), [&q, &k, &v, &dout]);
    // Columns of head `h` of a [b, s, heads * d] tensor.
    let columns = |x: &[f64], heads: usize, h: usize| -> Vec<f64> { x.chunks(heads * d).flat_map(|row| row[h * d..(h + 1) * d].to_vec()).collect() };
    let (mut dk_sum, mut dv_sum) = (vec![vec![0.0; b * s * d]; hk], vec![vec![0.0; b * s * d]; hk]);
    for h in 0..hq {
        let g = h / (hq / hk);
        let one = run((1, 1), [&columns(&q, hq, h), &columns(&k, hk, g), &columns(&v, hk, g), &columns(&dout, hq, h)]);
        assert_eq!(columns(&all[0], hq, h), one[0], "out of head {h}");
        let lse: Vec<f64> = (0..b).flat_map(|bi| all[1][(bi * hq + h) * s..(bi * hq + h + 1) * s].to_vec()).collect();
        assert_eq!(lse, one[1], "lse of head {h}");
        assert_eq!(columns(&all[2], hq, h), one[2], "dq of head {h}");
        dk_sum[g].iter_mut().zip(&one[3]).for_each(|(a, x)| *a += x);
        dv_sum[g].iter_mut().zip(&one[4]).for_each(|(a, x)| *a += x);
    }
    // A kv head's gradients sum over its query heads (in head order, as the kernel sums).
    for g in 0..hk {
        for (name, all, sum) in [("dk", &all[3], &dk_sum[g]), ("dv", &all[4], &dv_sum[g])] {
            let got = columns(all, hk, g);
            assert!(got.iter().zip(sum).all(|(x, y)| (x - y).abs() <= 1e-12 * (1.0 + y.abs())), "{name} of kv head {g}: {got:?} against {sum:?}");
        }
    }
}

/// Whether an NVRTC error means the library is missing and the user asked to go without it
/// (`SHARDC_SKIP_NVRTC=1`, said on stderr). A missing NVRTC otherwise fails the test, so the
/// PTX checks never pass by not running: `make test` (scripts/test) installs NVRTC from PyPI.
#[cfg(feature = "cuda")]
fn skipping_nvrtc(e: &shardc_runtime::RuntimeError, test: &str) -> bool {
    let missing = e.to_string().contains("was not found");
    let skip = std::env::var("SHARDC_SKIP_NVRTC").is_ok_and(|v| v == "1") && std::env::var("SHARDC_REQUIRE_NVRTC").map_or(true, |v| v != "1");
    if missing && skip {
        eprintln!("SKIPPED {test}: SHARDC_SKIP_NVRTC=1 and {e}");
        return true;
    }
    assert!(!missing, "{test}: {e}\n(run scripts/setup-nvrtc and put the directory it prints on LD_LIBRARY_PATH, or set SHARDC_SKIP_NVRTC=1 to skip the PTX checks)");
    false
}

/// The tensor-core attention kernels compile to `mma.sync`, `ldmatrix` and `cp.async` for an
/// sm_90 GPU (an H100 or H200), and to the shuffle fallback for sm_75.
#[cfg(feature = "cuda")]
#[test]
fn tensor_core_attention_compiles_to_mma_for_sm_90() {
    let program = attention_program(shardc_ir::types::DType::Bf16, 256, true, (1, 2, 1, 64));
    let source = &program.device.as_ref().unwrap().source;
    match shardc_runtime::cuda::compile_ptx_for(source, Some((9, 0))) {
        Ok(ptx) => {
            assert!(ptx.contains(".target sm_90"), "not compiled for sm_90");
            assert!(ptx.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"), "no tensor-core products in the sm_90 PTX");
            // B fragments by ldmatrix (transposed for P times a tile), tiles staged by cp.async.
            for instruction in ["ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "cp.async.cg.shared.global", "cp.async.wait_group"] {
                assert!(ptx.contains(instruction), "no {instruction} in the sm_90 PTX");
            }
            for kernel in ["attention_fwd_mma64", "attention_grad_q_mma64", "attention_grad_kv_mma64", "attention_fwd_mma64_cp", "attention_grad_q_mma64_cp", "attention_grad_kv_mma64_cp"] {
                assert!(ptx.contains(&format!(".entry {kernel}")), "{kernel} is not in the PTX");
            }
        }
        Err(e) if skipping_nvrtc(&e, "tensor_core_attention_compiles_to_mma_for_sm_90") => return,
        Err(e) => panic!("{e}"),
    }
    let fallback = shardc_runtime::cuda::compile_ptx_for(source, Some((7, 5))).unwrap();
    assert!(!fallback.contains("mma.sync") && !fallback.contains("ldmatrix") && !fallback.contains("cp.async") && fallback.contains("shfl.sync"), "sm_75 has no bf16 mma.sync (nor cp.async): the kernel must gather fragments by shuffles");
}

/// NVRTC compiles every generated module (a missing NVRTC fails unless skipped by name: see
/// `skipping_nvrtc`).
#[cfg(feature = "cuda")]
#[test]
fn every_generated_module_compiles_to_ptx() {
    let mut compiled = 0;
    for (what, program) in configurations() {
        let plan = device_plan(&program).unwrap();
        match shardc_runtime::cuda::compile_ptx(&plan.source) {
            Ok(ptx) => {
                assert!(ptx.contains(".entry"), "{what}: no kernels in the PTX");
                compiled += 1;
            }
            Err(e) if skipping_nvrtc(&e, "every_generated_module_compiles_to_ptx") => return,
            Err(e) => panic!("{what}: {e}"),
        }
    }
    assert_eq!(compiled, configurations().len());
}

/// The CUDA path end to end on the emulated device (the module compiled as C++ and run on
/// CPU threads; cuBLAS's column-major contract followed exactly): a training step's losses
/// and parameters equal the CPU backend's, single-device and partitioned (collectives among
/// the ranks sharing the device), f32 and bf16.
#[cfg(feature = "cuda")]
mod emulated {
    use super::*;
    use shardc_runtime::cuda::{self, Placement};
    use shardc_runtime::data::ByteCorpus;

    /// Warmup, cosine decay to a tenth at step 3.
    const SCHEDULE: shardc_passes::Schedule = shardc_passes::Schedule { warmup_steps: 1, decay_steps: 3, min_lr: 0.01, cosine: true };
    /// Small enough to clip every step.
    const CLIP: f64 = 0.05;

    fn sgd_step(name: &str, dtype: &str, mesh: Mesh) -> (Program, shardc_ir::spec::Spec) {
        sgd_step_padded(name, dtype, mesh, None)
    }

    /// With `vocab_multiple`, the vocabulary padded for the mesh's tp, as `shardc` pads it.
    fn sgd_step_padded(name: &str, dtype: &str, mesh: Mesh, vocab_multiple: Option<u64>) -> (Program, shardc_ir::spec::Spec) {
        sgd_step_tuned(name, dtype, mesh, vocab_multiple, |_| {})
    }

    /// The same, with `tune` changing the options (ZeRO, sequence parallelism, bucket size).
    fn sgd_step_tuned(name: &str, dtype: &str, mesh: Mesh, vocab_multiple: Option<u64>, tune: impl FnOnce(&mut CompileOptions)) -> (Program, shardc_ir::spec::Spec) {
        let mut spec = spec_with_dtype(name, dtype);
        spec.training.micro_batch = 4;
        let padded_vocab = match vocab_multiple {
            Some(multiple) => {
                spec.model.vocab_multiple = multiple;
                spec.model.padded_vocab(mesh.tp)
            }
            None => spec.model.vocab,
        };
        let sequence_chunks = if mesh.cp > 1 { 2 * mesh.cp } else { 1 };
        let mut module = shardc_ir::spec::lower(&spec, shardc_ir::spec::StepShape { rows: spec.training.micro_batch, padded_vocab, sequence_chunks }).unwrap();
        // Warmup, cosine decay and a clipping norm small enough to clip every step: the
        // device's kernels for the schedule, the sums of squares and the coefficient are
        // checked against the CPU's.
        let mut options = CompileOptions {
            optimizer: OptimizerKind::Sgd { lr: 0.1, weight_decay: 0.0 },
            schedule: SCHEDULE,
            clip_grad: CLIP,
            // The GPU runs context parallelism's gathered form (its ring kernels are CPU-only).
            context_attention: shardc_passes::sharding::ContextAttention::AllGather,
            mesh,
            vocab: padded_vocab as i64,
            kv_heads: spec.model.kv_heads() as i64,
            ..Default::default()
        };
        tune(&mut options);
        let cx = shardc_ir::mlir::IrContext::new().unwrap();
        compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
        let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
        let program = shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap();
        (shardc_codegen::device::with_device_plan(program).unwrap(), spec)
    }

    /// `run(rank, placement)` on one thread per process of an emulated world of `ranks`
    /// processes (NCCL emulated between them); the results by rank.
    fn in_processes<T: Send>(ranks: usize, run: impl Fn(usize, Placement) -> T + Sync) -> Vec<T> {
        let worlds = cuda::nccl::EmulatedWorld::world(ranks, std::time::Duration::from_secs(60));
        std::thread::scope(|scope| {
            let run = &run;
            let handles: Vec<_> = worlds.into_iter().map(|world| scope.spawn(move || run(world.rank(), Placement::EmulatedNccl(world)))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Trains `programs` (one step, or one per pipeline rank) for `steps` in one emulated
    /// process per rank and checks every process against the CPU backend's `cpu_losses` and
    /// global `cpu_parameters`: its losses to 1e-5, and the shards it holds to 1e-4.
    fn processes_equal_the_cpu(what: &str, programs: &[Program], spec: &shardc_ir::spec::Spec, steps: u64, cpu_losses: &[f64], cpu_parameters: &[(String, Vec<usize>, Vec<f64>)]) {
        let grid = shardc_runtime::collectives::MeshShape(programs[0].mesh.clone());
        let runs: Vec<(Vec<f64>, Vec<(usize, String, Vec<f64>)>)> = in_processes(grid.ranks(), |rank, placement| {
            let mut trainer = cuda::CudaTrainer::new(programs, &placement, 0, spec.model.layers as usize, None).unwrap_or_else(|e| panic!("{what} rank {rank}: {e}"));
            assert!(!trainer.holds_every_rank() || grid.ranks() == 1);
            let corpus = corpus(spec);
            let losses = (0..steps).map(|_| trainer.step(&corpus).unwrap_or_else(|e| panic!("{what} rank {rank}: {e}")).0).collect();
            (losses, trainer.parameter_shards().unwrap())
        });
        for (rank, (losses, shards)) in runs.iter().enumerate() {
            for (step, (c, g)) in cpu_losses.iter().zip(losses).enumerate() {
                assert!((c - g).abs() <= 1e-5 * c.abs(), "{what} rank {rank} step {}: CPU loss {c}, process {g}", step + 1);
            }
            assert!(!shards.is_empty(), "{what} rank {rank}: no parameters");
            let program = &programs[if programs.len() == 1 { 0 } else { grid.coords(rank)[2] }];
            for (held, param, values) in shards {
                assert_eq!(*held, rank, "{what}: a process holds rank {held}'s shards");
                let (_, _, global) = cpu_parameters.iter().find(|(n, _, _)| n == param).unwrap();
                let expected = match &program.arg(param).unwrap().layout {
                    Some(layout) => shardc_runtime::layout::local_shard(global, layout, &grid, rank),
                    None => global.clone(),
                };
                let rel = relative(&expected, values);
                assert!(rel <= 1e-4, "{what} rank {rank}: `{param}` differs by {rel:.2e} after {steps} steps");
            }
        }
    }

    fn corpus(spec: &shardc_ir::spec::Spec) -> ByteCorpus {
        ByteCorpus::new(std::fs::read(root().join("data/kjv-genesis-exodus.txt")).unwrap(), spec.seq_len() as usize, spec.model.vocab as usize).unwrap()
    }

    /// CPU losses and parameters of the f32 twin of a program.
    fn cpu(name: &str, mesh: Mesh, steps: u64) -> (Vec<f64>, Vec<(String, Vec<f64>)>) {
        let (program, spec) = sgd_step(name, "f32", mesh);
        let corpus = corpus(&spec);
        let layers = spec.model.layers as usize;
        if mesh.ranks() > 1 {
            let run = shardc_runtime::train::train_spmd(&program, 0, layers, &corpus, steps, std::time::Duration::from_secs(60)).unwrap();
            return (run.losses, run.parameters.into_iter().map(|(n, _, v)| (n, v)).collect());
        }
        let mut trainer = shardc_runtime::train::Trainer::new(program, 0, layers).unwrap();
        let losses = (0..steps).map(|_| trainer.step(&corpus).unwrap()).collect();
        (losses, trainer.parameters().unwrap().into_iter().map(|(n, _, v)| (n, v.into_iter().map(f64::from).collect())).collect())
    }

    fn relative(a: &[f64], b: &[f64]) -> f64 {
        let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        diff / a.iter().map(|x| x.abs()).fold(0.01, f64::max)
    }

    /// How far the device's parameters may be from the CPU's after the steps, as a share of
    /// the largest update the CPU made. A device that did not train is off by at least the
    /// whole update (1.0); bf16 measures 0.12 to 0.17 against the f32 CPU, f32 about 2e-6.
    fn update_tolerance(dtype: &str) -> f64 {
        if dtype == "bf16" { 0.5 } else { 1e-3 }
    }

    fn check(name: &str, dtype: &str, mesh: Mesh, loss_tolerance: f64, param_tolerance: f64) {
        check_tuned(name, dtype, mesh, loss_tolerance, param_tolerance, |_| {});
    }

    /// [`check`] of the step as `tune` compiles it, against the CPU backend's default one.
    fn check_tuned(name: &str, dtype: &str, mesh: Mesh, loss_tolerance: f64, param_tolerance: f64, tune: impl FnOnce(&mut CompileOptions)) {
        const STEPS: u64 = 3;
        let (program, spec) = sgd_step_tuned(name, dtype, mesh, None, tune);
        let run = cuda::train(&program, 0, spec.model.layers as usize, &corpus(&spec), STEPS, &Placement::Emulated).unwrap_or_else(|e| panic!("{name} {dtype} {mesh}: {e}"));
        let (losses, params) = cpu(name, mesh, STEPS);
        for (step, (c, g)) in losses.iter().zip(&run.losses).enumerate() {
            assert!((c - g).abs() <= loss_tolerance * c.abs(), "{name} {dtype} {mesh} step {}: CPU loss {c}, device {g}", step + 1);
        }
        assert_eq!(run.parameters.len(), params.len());
        // Initialisation is by global index, so one device's is every mesh's.
        let (_, initial) = cpu(name, Mesh::default(), 0);
        let (mut off, mut size) = (0.0f64, 0.0f64);
        for (name_p, _, values) in &run.parameters {
            let (_, expected) = params.iter().find(|(n, _)| n == name_p).unwrap();
            let rel = relative(expected, values);
            assert!(rel <= param_tolerance, "{name} {dtype} {mesh}: `{name_p}` differs by {rel:.2e} after {STEPS} steps");
            // Against the size of the updates, not of the parameters: a device that did not
            // train (or trained another way) is off by a whole update.
            let (_, start) = initial.iter().find(|(n, _)| n == name_p).unwrap();
            for ((v, s), p) in values.iter().zip(start).zip(expected) {
                size = size.max((p - s).abs());
                off = off.max((v - p).abs());
            }
        }
        assert!(size > 0.0, "{name} {dtype} {mesh}: the CPU did not train");
        let worst_update = off / size;
        assert!(worst_update <= update_tolerance(dtype), "{name} {dtype} {mesh}: the device's parameters differ from the CPU's by {worst_update:.2e} of the largest update ({size:.2e})");
    }

    /// Attention forward and backward over many tiles of the flash kernels' online softmax
    /// (sequences of 1, 127 and 260: one key, ragged tiles, many tiles; 8192 with causal tile
    /// skipping), causal and not, grouped-query (2 query heads on 1 kv head, and 4 on 2), odd
    /// head dims and the head dims where the tiles change (64: 32 x 32; 128: 16 x 16; 200: 8
    /// rows of 16 threads), in f32 and f64: the device equals the CPU backend's kernels on the
    /// same one-op programs. (Small widths: the emulated device runs a block's threads as
    /// fibers.)
    #[test]
    fn attention_over_many_tiles_equals_the_cpu() {
        use shardc_ir::types::DType;
        let mut cases = vec![];
        for (dtype, s, causal) in [(DType::F32, 1i64, true), (DType::F32, 127, false), (DType::F32, 260, true), (DType::F32, 260, false), (DType::F64, 260, true)] {
            cases.push((dtype, s, causal, (1i64, 2i64, 1i64, 5i64)));
        }
        for d in [64, 128, 200] {
            cases.push((DType::F32, 70, true, (1, 2, 1, d)));
        }
        cases.push((DType::F32, 45, false, (2, 4, 2, 33)));
        cases.push((DType::F32, 8192, true, (1, 1, 1, 4)));
        for (dtype, s, causal, shape) in cases {
            let (what, _, errors) = attention_against_the_cpu(dtype, s, causal, shape);
            let tolerance = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            for (name, rel) in errors {
                assert!(rel <= tolerance, "{what}: `{name}` differs by {rel:.2e}");
            }
        }
    }

    /// bf16 attention forward and backward on tensor cores (`mma.m16n8k16` fragments and
    /// `ldmatrix` loads, which the emulated device gathers by warp shuffles as pre-sm_80 GPUs
    /// do, and `cp.async` staging, which it copies at once): every head dim built
    /// (16, 32, 48, 64, 80, 96, 112, 128), both tile sizes (64 rows up to d = 64,
    /// 32 past it), ragged tiles (s = 1, 70, 130, 150, 200, 260), causal and not, tiles wholly
    /// visible (unmasked) and not, grouped-query heads (the keys' kernel pipelining across the
    /// query heads of its kv head), equal to the CPU backend to bf16's resolution (a wrong
    /// fragment layout is off by the values' own scale).
    #[test]
    fn attention_on_tensor_cores_equals_the_cpu() {
        use shardc_ir::types::DType;
        let cases = [(1i64, true, (1i64, 1i64, 1i64, 16i64)), (70, true, (1, 2, 1, 64)), (200, false, (2, 4, 2, 32)), (70, false, (1, 2, 2, 128)), (130, true, (1, 1, 1, 48)), (150, true, (1, 2, 1, 96)), (260, true, (1, 4, 2, 80)), (100, false, (1, 2, 1, 112))];
        for (s, causal, shape) in cases {
            let (what, kernels, errors) = attention_against_the_cpu(DType::Bf16, s, causal, shape);
            for kernel in ["attention_fwd_mma", "attention_grad_q_mma", "attention_grad_kv_mma"] {
                assert!(kernels.iter().any(|k| *k == format!("{kernel}{}", shape.3)), "{what}: `{kernel}` is not on tensor cores: {kernels:?}");
            }
            for (name, rel) in errors {
                assert!(rel <= 1e-2, "{what}: `{name}` differs by {rel:.2e}");
            }
        }
    }

    /// A NaN score makes its attention row NaN on the device as on the CPU, in the scalar and
    /// the tensor-core kernels: the rows' guard for a row that sees no key once wrote 0 for a
    /// NaN sum, so a diverged run trained on with a finite loss.
    #[test]
    fn a_nan_score_makes_its_attention_row_nan_as_on_the_cpu() {
        use shardc_ir::types::DType;
        // (dtype, head dim, the operand poked, its row): a NaN query makes its row's score NaN
        // and so its output, its log-sum-exp and the gradients it reaches; a NaN value or
        // output gradient at position 5 reaches only the rows that see position 5 (causal: a
        // hidden key is skipped, never multiplied by its zero probability). Every result is NaN
        // exactly where the CPU's is. On tensor cores (bf16, head dim 16) a hidden position
        // inside a diagonal tile is multiplied by zero in the MMA (a NaN there reaches the
        // tile's rows, and a NaN query the keys' gradients past it): only the NaN query's
        // output and dq are checked there.
        // 80 positions: several tiles of keys and of queries, the poke in the first or a later.
        const S: usize = 80;
        let cases = [
            (DType::F32, 8, "q", 3),
            (DType::F32, 8, "q", 70),
            (DType::Bf16, 16, "q", 3),
            (DType::Bf16, 16, "q", 70),
            (DType::F32, 8, "v", 5),
            (DType::F32, 8, "v", 70),
            (DType::F32, 8, "dout", 5),
            (DType::F32, 8, "dout", 70),
            (DType::F64, 8, "v", 5),
            (DType::F64, 8, "dout", 5),
            (DType::F32, 8, "k", 5),
            (DType::F32, 8, "k", 70),
        ];
        for (dtype, d, poked, at) in cases {
            let what = format!("{dtype:?} d={d}: NaN in {poked} row {at}");
            let program = attention_program(dtype, S as i64, true, (1, 2, 2, d));
            let mut cpu = shardc_runtime::cpu::CpuExecutor::new(program.clone()).unwrap();
            let mut device = cuda::CudaExecutor::new(program.clone(), &Placement::Emulated).unwrap();
            for (i, name) in ["q", "k", "v", "dout"].iter().enumerate() {
                let len = program.buffers[program.arg(name).unwrap().buffer].len();
                let mut values: Vec<f64> = (0..len).map(|j| shardc_runtime::init::uniform(i as u64 + 3, j as u64) - 0.5).collect();
                if *name == poked {
                    // Row `at` of the first head: [b, s, heads x d].
                    values[at * 2 * d as usize] = f64::NAN;
                }
                cpu.write_f64(name, &values).unwrap();
                device.write(0, name, &values).unwrap();
            }
            cpu.run().unwrap();
            device.run().unwrap();
            let results: &[&str] = if dtype == DType::Bf16 { &["out", "dq"] } else { &["out", "dq", "dk", "dv"] };
            for &result in results {
                let (c, g) = (cpu.read_f64(result).unwrap(), device.read(0, result).unwrap());
                let nan = |v: &[f64]| v.iter().map(|x| x.is_nan()).collect::<Vec<_>>();
                assert_eq!(nan(&g), nan(&c), "{what}: where {result} is NaN on the device and on the CPU");
                assert!(g.iter().chain(&c).all(|x| x.is_nan() || x.is_finite()), "{what}: {result} has an infinity");
            }
            let (c, g) = (cpu.read_f64("out").unwrap(), device.read(0, "out").unwrap());
            let row = |v: &[f64], r: usize| v[r * 2 * d as usize..r * 2 * d as usize + d as usize].to_vec();
            let first_nan = if poked == "q" || poked == "v" || poked == "k" { at } else { S };
            for r in 0..S {
                assert_eq!(row(&c, r).iter().any(|x| x.is_nan()), r >= first_nan && (poked != "q" || r == at), "{what}: the CPU's row {r} {:?}", row(&c, r));
                assert_eq!(row(&g, r).iter().any(|x| x.is_nan()), r >= first_nan && (poked != "q" || r == at), "{what}: the device's row {r} {:?}", row(&g, r));
            }
        }
    }

    /// Context-parallel attention on tensor cores (bf16): a rank's part of the queries against
    /// the gathered keys, and each step of the ring (the queries against one rank's block of
    /// keys, backward from the whole attention's `out` and `lse`), in the zigzag order of
    /// 2 x cp chunks and in the natural order, on every rank of cp = 2 and 4 held on one
    /// device, equal a direct f64 evaluation over the rows' positions to bf16's resolution.
    /// Chunks of 64 rows (key tiles wholly visible, skipped, or on the diagonal), of 24 and 16
    /// (tiles across chunks), parts that start off a tile's edge, ragged parts, grouped-query
    /// heads, rows that see none of a ring block (zero output, `-inf` log-sum-exp), not causal.
    #[test]
    fn context_parallel_attention_on_tensor_cores_equals_a_direct_evaluation() {
        // (cp, len, ring step or gathered keys, zigzag order, causal, (b, hq, hk, d))
        let cases = [
            (2usize, 256usize, None, true, true, (1usize, 2usize, 1usize, 16usize)),
            (2, 96, None, true, true, (1, 4, 2, 32)),
            (2, 80, None, false, false, (2, 2, 1, 64)),
            // Rank 1's queries from row 65: its first query tile and the key tile from row 128
            // meet at one position (the diagonal's last query sees its first key).
            (2, 130, None, false, true, (1, 2, 1, 16)),
            // From row 78: the fourth warp's queries (positions 126 to 141) see every key of
            // the tile from 64 but the last (127): a tile masked by one key.
            (2, 156, None, false, true, (1, 2, 1, 16)),
            (4, 128, Some(0), true, true, (1, 2, 1, 16)),
            (4, 128, Some(1), true, true, (1, 2, 1, 16)),
            (4, 128, Some(2), true, true, (1, 2, 2, 48)),
            (2, 256, Some(1), true, true, (1, 2, 1, 112)),
            (4, 128, Some(3), true, true, (1, 2, 1, 16)),
            (2, 160, Some(1), false, true, (1, 2, 1, 128)),
            (2, 160, Some(0), false, true, (1, 2, 1, 80)),
        ];
        for (cp, len, ring, zigzag, causal, shape) in cases {
            let (b, hq, hk, d) = shape;
            let what = format!("cp={cp} len={len} ring step {ring:?} zigzag={zigzag} causal={causal} b={b} hq={hq} hk={hk} d={d}");
            let part = len / cp;
            let chunks = if zigzag { 2 * cp } else { 1 };
            let position = |row: usize| shardc_ir::ops::zigzag_position(row, len, chunks);
            let program = context_attention_program(cp, len, ring, zigzag, causal, shape);
            let kernels = program.device.as_ref().unwrap().kernels();
            for kernel in ["attention_fwd_mma", "attention_grad_q_mma", "attention_grad_kv_mma"] {
                assert!(kernels.iter().any(|k| *k == format!("{kernel}{d}_cp")), "{what}: `{kernel}` is not on tensor cores: {kernels:?}");
            }
            let mut device = cuda::CudaExecutor::new(program.clone(), &Placement::Emulated).unwrap();
            // The whole sequence's rows (in its order), one part per rank; values of a few units.
            let rows = |seed: u64, heads: usize, scale: f64| -> Vec<Vec<f64>> {
                (0..cp).map(|p| (0..b * part * heads * d).map(|j| 2.0 * scale * (shardc_runtime::init::uniform(seed, (p * b * part * heads * d + j) as u64) - 0.5)).collect()).collect()
            };
            let (mut q, k, v, mut dout) = (rows(41, hq, 3.0), rows(42, hk, 3.0), rows(43, hk, 1.0), rows(44, hq, 1.0));
            let (k, v): (Vec<Vec<f64>>, Vec<Vec<f64>>) = (k.iter().map(|x| round_bf16(x)).collect(), v.iter().map(|x| round_bf16(x)).collect());
            // Written and read back: the reference sees the device's bf16 values.
            for rank in 0..cp {
                for (name, values) in [("q", &mut q[rank]), ("dout", &mut dout[rank])] {
                    device.write(rank, name, values).unwrap();
                    *values = device.read(rank, name).unwrap();
                }
            }
            let source = |rank: usize| ring.map_or(rank, |step| (rank + cp - step) % cp);
            let keys_of = |parts: &[Vec<f64>], rank: usize| -> (Vec<f64>, Vec<usize>) {
                match ring {
                    // Every part, batch by batch: [b, len, hk * d].
                    None => ((0..b).flat_map(|bi| (0..cp).flat_map(move |p| parts[p][bi * part * hk * d..(bi + 1) * part * hk * d].to_vec())).collect(), (0..len).map(position).collect()),
                    Some(_) => (parts[source(rank)].clone(), (source(rank) * part..(source(rank) + 1) * part).map(position).collect()),
                }
            };
            let all_keys: Vec<usize> = (0..len).map(position).collect();
            let gathered = |parts: &[Vec<f64>]| -> Vec<f64> { (0..b).flat_map(|bi| (0..cp).flat_map(move |p| parts[p][bi * part * hk * d..(bi + 1) * part * hk * d].to_vec())).collect() };
            let mut expected = Vec::new();
            for rank in 0..cp {
                let (ks, key_positions) = keys_of(&k, rank);
                let (vs, _) = keys_of(&v, rank);
                device.write(rank, "k", &ks).unwrap();
                device.write(rank, "v", &vs).unwrap();
                let (ks, vs) = (device.read(rank, "k").unwrap(), device.read(rank, "v").unwrap());
                let query_positions: Vec<usize> = (rank * part..(rank + 1) * part).map(position).collect();
                let sizes = (b, hq, hk, d, causal);
                let (out, lse) = direct_attention(&query_positions, &key_positions, &q[rank], &ks, &vs, sizes);
                // The backward reads the whole attention's out and lse: a ring step's block's
                // are a part of it.
                let (whole_out, whole_lse) = match ring {
                    None => (out.clone(), lse.clone()),
                    Some(_) => {
                        let (kw, vw) = (gathered(&k), gathered(&v));
                        let (o, l) = direct_attention(&query_positions, &all_keys, &q[rank], &kw, &vw, sizes);
                        device.write(rank, "whole_out", &o).unwrap();
                        device.write(rank, "whole_lse", &l).unwrap();
                        (device.read(rank, "whole_out").unwrap(), l)
                    }
                };
                let (dq, dk, dv) = direct_attention_grad(&query_positions, &key_positions, &q[rank], &ks, &vs, &whole_out, &whole_lse, &dout[rank], sizes);
                expected.push([("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)]);
            }
            device.run().unwrap();
            for (rank, results) in expected.into_iter().enumerate() {
                for (name, want) in results {
                    let got = device.read(rank, name).unwrap();
                    assert_eq!(got.len(), want.len(), "{what} rank {rank}: {name}");
                    if name == "lse" {
                        // -inf exactly where a row sees none of the keys.
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(g.is_finite(), w.is_finite(), "{what} rank {rank}: lse[{i}] {g} against {w}");
                        }
                    }
                    let finite = |x: &f64| if x.is_finite() { *x } else { 0.0 };
                    let scale = want.iter().map(|x| finite(x).abs()).fold(1.0, f64::max);
                    let off = got.iter().zip(&want).map(|(g, w)| (finite(g) - finite(w)).abs()).fold(0.0, f64::max) / scale;
                    assert!(off <= 1e-2, "{what} rank {rank}: `{name}` differs by {off:.2e}");
                }
            }
            if let Some(step) = ring {
                // Rows that see none of the block: zeros and -inf (the ring's merge then keeps
                // the other steps' results).
                let hidden = (0..cp).any(|rank| device.read(rank, "lse").unwrap().iter().any(|l| l.is_infinite()));
                assert_eq!(hidden, causal && step > 0, "{what}");
            }
        }
    }

    /// A NaN query makes its row NaN in a ring step's attention wherever the row sees a key of
    /// the step's block, on the CPU as on the device (tensor cores, bf16); a row that sees none
    /// of the block stays zero with a log-sum-exp of -inf. The CPU's ring step took a row whose
    /// every score was NaN for one that sees no key (`max` skips a NaN), so a NaN query came
    /// out of the ring's merge as a zero row. Rank 0 of cp=2, zigzag: rows 0 to 15 at
    /// positions 0 to 15, rows 16 to 31 at 48 to 63; step 0's keys are its own, step 1's rank
    /// 1's (positions 16 to 47), which row 3 does not see.
    #[test]
    fn a_nan_query_reaches_its_row_in_a_ring_step_as_on_the_cpu() {
        let (cp, len, (b, h, d)) = (2usize, 64usize, (1usize, 2usize, 16usize));
        let part = len / cp;
        for step in [0usize, 1] {
            for poked in [3usize, 20] {
                let what = format!("ring step {step}: NaN in query row {poked}");
                let program = context_attention_program(cp, len, Some(step), true, true, (b, h, h, d));
                let mut cpu = shardc_runtime::cpu::CpuExecutor::new(program.clone()).unwrap();
                let mut device = cuda::CudaExecutor::new(program.clone(), &Placement::Emulated).unwrap();
                for (i, name) in ["q", "k", "v", "dout", "whole_out", "whole_lse"].iter().enumerate() {
                    let len = program.buffers[program.arg(name).unwrap().buffer].len();
                    let mut values = round_bf16(&(0..len).map(|j| shardc_runtime::init::uniform(i as u64 + 7, j as u64) - 0.5).collect::<Vec<f64>>());
                    if *name == "q" {
                        // Head 0 of the row: [b, part, h x d].
                        values[poked * h * d] = f64::NAN;
                    }
                    cpu.write_f64(name, &values).unwrap();
                    for rank in 0..cp {
                        device.write(rank, name, &values).unwrap();
                    }
                }
                cpu.run().unwrap();
                device.run().unwrap();
                let sees_block = !(step == 1 && poked < 16);
                let (out, lse) = (cpu.read_f64("out").unwrap(), cpu.read_f64("lse").unwrap());
                let (gpu_out, gpu_lse) = (device.read(0, "out").unwrap(), device.read(0, "lse").unwrap());
                for (who, out, lse) in [("CPU", &out, &lse), ("device", &gpu_out, &gpu_lse)] {
                    for row in 0..part {
                        for head in 0..h {
                            let nan = row == poked && head == 0 && sees_block;
                            let values = &out[(row * h + head) * d..(row * h + head + 1) * d];
                            assert!(values.iter().all(|x| x.is_nan() == nan), "{what}: the {who}'s row {row} head {head}: {values:?}");
                            let l = lse[head * part + row];
                            assert_eq!(l.is_nan(), nan, "{what}: the {who}'s lse of row {row} head {head}: {l}");
                        }
                    }
                    if !sees_block {
                        assert!(lse[poked] == f64::NEG_INFINITY && out[poked * h * d..(poked * h + 1) * d].iter().all(|&x| x == 0.0), "{what}: the {who}'s hidden row");
                    }
                }
            }
        }
    }

    /// Every mask of the context-parallel tensor-core kernels is exact, key by key (a 1e-2
    /// tolerance could miss one key too many or too few): with every query zero (uniform
    /// probabilities) and one key's k and v nonzero per sequence and head, `out[i]` and
    /// `dq[i]` are nonzero exactly where query i sees that key; with one query's q and dout
    /// nonzero, `dk[j]` and `dv[j]` are nonzero exactly where that query sees key j. Probes
    /// at every edge of a chunk and of a 16-row tile (and every row of a short part), over
    /// every cp rank: zigzag chunks of 5 (tiles across chunks), ring steps of chunks of 64
    /// and 32, and natural-order parts from rows 65 (a query tile and a key tile meet at one
    /// position) and 78.
    #[test]
    fn context_parallel_tensor_core_masks_are_exact_key_by_key() {
        // (cp, len, ring step or gathered keys, zigzag order, head dim); causal, 2 sequences
        // of 4 heads.
        for (cp, len, ring, zigzag, d) in [(2usize, 20usize, None, true, 16usize), (2, 130, None, false, 16), (2, 156, None, false, 16), (3, 384, Some(1), true, 16), (4, 256, Some(2), true, 16)] {
            let what = format!("cp={cp} len={len} ring step {ring:?} zigzag={zigzag} d={d}");
            let problems = mask_patterns(cp, len, ring, zigzag, (2, 4, d));
            assert!(problems.is_empty(), "{what}: {} wrong, first {:?}", problems.len(), &problems[..problems.len().min(6)]);
        }
    }

    /// The probes of [`context_parallel_tensor_core_masks_are_exact_key_by_key`] for one case:
    /// each one that does not hold.
    fn mask_patterns(cp: usize, len: usize, ring: Option<usize>, zigzag: bool, (b, h, d): (usize, usize, usize)) -> Vec<String> {
        let part = len / cp;
        let chunks = if zigzag { 2 * cp } else { 1 };
        let position = |row: usize| shardc_ir::ops::zigzag_position(row, len, chunks);
        let program = context_attention_program(cp, len, ring, zigzag, true, (b, h, h, d));
        assert!(program.device.as_ref().unwrap().kernels().iter().any(|k| *k == format!("attention_fwd_mma{d}_cp")));
        let mut device = cuda::CudaExecutor::new(program.clone(), &Placement::Emulated).unwrap();
        let keys = if ring.is_some() { part } else { len };
        let source = |rank: usize| ring.map_or(0, |step| (rank + cp - step) % cp);
        let key_row = |rank: usize, j: usize| if ring.is_some() { source(rank) * part + j } else { j };
        let sees = |rank: usize, i: usize, j: usize| position(key_row(rank, j)) <= position(rank * part + i);
        let random = |seed: u64, n: usize| round_bf16(&(0..n).map(|j| 6.0 * (shardc_runtime::init::uniform(seed, j as u64) - 0.5)).collect::<Vec<f64>>());
        // Rows either side of every chunk's and 16-row tile's edge, and the ends.
        let chunk = if zigzag { len / chunks } else { part };
        let probes_of = |n: usize| -> Vec<usize> {
            let mut rows = std::collections::BTreeSet::new();
            for unit in [chunk, 16] {
                for edge in (0..=n).step_by(unit.max(1)) {
                    rows.extend([edge.wrapping_sub(1), edge].into_iter().filter(|&r| r < n));
                }
            }
            rows.extend([0, n - 1]);
            if n <= 64 {
                rows.extend(0..n);
            }
            rows.into_iter().collect()
        };
        let (key_probes, query_probes) = (probes_of(keys), probes_of(part));
        // One probe per (sequence, head) a run.
        let lanes = b * h;
        let mut problems = Vec::new();
        for (kind, probes) in [("key", &key_probes), ("query", &query_probes)] {
            for run in 0..probes.len().div_ceil(lanes) {
                let probe = |lane: usize| probes[(run * lanes + lane).min(probes.len() - 1)];
                for rank in 0..cp {
                    let seed = 100 * run as u64 + 10 * rank as u64;
                    let (qlen, klen) = (b * part * h * d, b * keys * h * d);
                    let (mut q, mut k, mut v, mut dout) = (random(seed + 1, qlen), random(seed + 2, klen), random(seed + 3, klen), random(seed + 4, qlen));
                    // Only the probed row of each (sequence, head) keeps its values: the
                    // key's k and v, or the query's q and dout (every other query zero).
                    let (rows, kept): (usize, [&mut Vec<f64>; 2]) = if kind == "key" { (keys, [&mut k, &mut v]) } else { (part, [&mut q, &mut dout]) };
                    for x in kept {
                        for (e, value) in x.iter_mut().enumerate() {
                            let (row, head) = ((e / (h * d)) % rows, e % (h * d) / d);
                            if row != probe(e / (rows * h * d) * h + head) {
                                *value = 0.0;
                            }
                        }
                    }
                    if kind == "key" {
                        q.iter_mut().for_each(|x| *x = 0.0);
                    }
                    for (name, values) in [("q", &q), ("k", &k), ("v", &v), ("dout", &dout)] {
                        device.write(rank, name, values).unwrap();
                    }
                    if ring.is_some() {
                        let query_positions: Vec<usize> = (rank * part..(rank + 1) * part).map(position).collect();
                        let key_positions: Vec<usize> = (0..keys).map(|j| position(key_row(rank, j))).collect();
                        let (out, lse) = direct_attention(&query_positions, &key_positions, &q, &k, &v, (b, h, h, d, true));
                        device.write(rank, "whole_out", &out).unwrap();
                        device.write(rank, "whole_lse", &lse.iter().map(|&l| if l.is_finite() { l } else { 0.0 }).collect::<Vec<f64>>()).unwrap();
                    }
                }
                device.run().unwrap();
                for rank in 0..cp {
                    let got: std::collections::HashMap<&str, Vec<f64>> = ["out", "dq", "dk", "dv"].iter().map(|n| (*n, device.read(rank, n).unwrap())).collect();
                    let nonzero = |name: &str, bi: usize, head: usize, row: usize, rows: usize| -> Option<bool> {
                        let at = (bi * rows + row) * h * d + head * d;
                        let x = &got[name][at..at + d];
                        (!x.iter().any(|v| v.is_nan())).then(|| x.iter().any(|&v| v != 0.0))
                    };
                    for bi in 0..b {
                        for head in 0..h {
                            let p = probe(bi * h + head);
                            if kind == "key" {
                                for i in 0..part {
                                    let want = sees(rank, i, p);
                                    // A row that sees the key alone has dq = 0 (p = 1: ds = 0).
                                    let alone = (0..keys).filter(|&j| sees(rank, i, j)).count() == 1;
                                    for name in ["out", "dq"].into_iter().filter(|&n| n == "out" || !(alone && want)) {
                                        if nonzero(name, bi, head, i, part) != Some(want) {
                                            problems.push(format!("rank {rank}: {name} of query {i} (position {}) with key {p} (position {}) alone: {:?}, sees {want}", position(rank * part + i), position(key_row(rank, p)), nonzero(name, bi, head, i, part)));
                                        }
                                    }
                                }
                            } else {
                                let alone = (0..keys).filter(|&j| sees(rank, p, j)).count() == 1;
                                for j in 0..keys {
                                    let want = sees(rank, p, j);
                                    for name in ["dk", "dv"].into_iter().filter(|&n| n == "dv" || !(alone && want)) {
                                        if nonzero(name, bi, head, j, keys) != Some(want) {
                                            problems.push(format!("rank {rank}: {name} of key {j} (position {}) with query {p} (position {}) alone: {:?}, sees {want}", position(key_row(rank, j)), position(rank * part + p), nonzero(name, bi, head, j, keys)));
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        problems
    }

    /// Attention of one cp rank's part of `len` rows over `cp` ranks (mesh axis 3), bf16: the
    /// gathered form (`xf.attention` and its backward against all `len` keys) or one ring
    /// step (`xf.attention_block` against a part's keys, its backward from the whole
    /// attention's `whole_out` and `whole_lse`); results out, lse, dq, dk, dv.
    fn context_attention_program(cp: usize, len: usize, ring: Option<usize>, zigzag: bool, causal: bool, (b, hq, hk, d): (usize, usize, usize, usize)) -> Program {
        use shardc_ir::attrs::{AttrValue, Attrs};
        use shardc_ir::graph::{ArgRole, FuncBuilder};
        use shardc_ir::types::{DType, TensorTy};
        let part = len / cp;
        let mut attrs = Attrs::new()
            .with("causal", AttrValue::Bool(causal))
            .with("scale", AttrValue::Float(1.0 / (d as f64).sqrt()))
            .with("head_dim", AttrValue::Int(d as i64))
            .with("xf.seq_split_axes", AttrValue::axes(&[3]));
        if zigzag {
            attrs = attrs.with(shardc_ir::ops::ZIGZAG_ATTR, AttrValue::Ints(vec![2 * cp as i64, len as i64]));
        }
        let keys = if ring.is_some() { part } else { len };
        let (qt, kt) = (TensorTy::new(vec![b as i64, part as i64, (hq * d) as i64], DType::Bf16), TensorTy::new(vec![b as i64, keys as i64, (hk * d) as i64], DType::Bf16));
        let mut fb = FuncBuilder::new("attention");
        let args: Vec<_> = [("q", &qt), ("k", &kt), ("v", &kt), ("dout", &qt)].iter().map(|(n, t)| fb.arg(n, (*t).clone(), ArgRole::Input)).collect();
        let results = match ring {
            None => {
                let out = fb.op_multi("xf.attention", &args[..3], attrs.clone(), "fwd").unwrap();
                let grads = fb.op_multi("xf.attention_grad", &[args[0], args[1], args[2], out[0], out[1], args[3]], attrs, "bwd").unwrap();
                [out[0], out[1], grads[0], grads[1], grads[2]]
            }
            Some(step) => {
                let attrs = attrs.with(shardc_ir::ops::RING_STEP_ATTR, AttrValue::Int(step as i64));
                let whole_out = fb.arg("whole_out", qt.clone(), ArgRole::Input);
                let whole_lse = fb.arg("whole_lse", TensorTy::new(vec![b as i64, hq as i64, part as i64], DType::F32), ArgRole::Input);
                let out = fb.op_multi("xf.attention_block", &args[..3], attrs.clone(), "fwd").unwrap();
                let grads = fb.op_multi("xf.attention_block_grad", &[args[0], args[1], args[2], whole_out, whole_lse, args[3]], attrs, "bwd").unwrap();
                [out[0], out[1], grads[0], grads[1], grads[2]]
            }
        };
        let func = fb.finish(&results, &["out".to_string(), "lse".to_string(), "dq".to_string(), "dk".to_string(), "dv".to_string()]);
        let mut program = shardc_codegen::device::with_device_plan(shardc_codegen::lower_func(&func).unwrap()).unwrap();
        program.mesh = vec![1, 1, 1, cp];
        program
    }

    /// The sizes of [`direct_attention`]: batch, query heads, kv heads, head dim, causal.
    type Sizes = (usize, usize, usize, usize, bool);

    /// Attention in f64 straight from its definition, over queries and keys at the sequence
    /// positions given (`q [b, nq, hq * d]`, `k`, `v [b, nk, hk * d]`; a query sees the keys at
    /// or before its position when causal): `(out, lse)`, a row that sees no key 0 and `-inf`.
    fn direct_attention(query_positions: &[usize], key_positions: &[usize], q: &[f64], k: &[f64], v: &[f64], (b, hq, hk, d, causal): Sizes) -> (Vec<f64>, Vec<f64>) {
        let (nq, nk, scale) = (query_positions.len(), key_positions.len(), 1.0 / (d as f64).sqrt());
        let (mut out, mut lse) = (vec![0.0; b * nq * hq * d], vec![f64::NEG_INFINITY; b * hq * nq]);
        for bi in 0..b {
            for h in 0..hq {
                let g = h / (hq / hk);
                for i in 0..nq {
                    let seen: Vec<usize> = (0..nk).filter(|&j| !causal || key_positions[j] <= query_positions[i]).collect();
                    if seen.is_empty() {
                        continue;
                    }
                    let score = |j: usize| scale * (0..d).map(|c| q[(bi * nq + i) * hq * d + h * d + c] * k[(bi * nk + j) * hk * d + g * d + c]).sum::<f64>();
                    let scores: Vec<f64> = seen.iter().map(|&j| score(j)).collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for c in 0..d {
                        out[(bi * nq + i) * hq * d + h * d + c] = seen.iter().zip(&scores).map(|(&j, s)| (s - m).exp() * v[(bi * nk + j) * hk * d + g * d + c]).sum::<f64>() / sum;
                    }
                    lse[(bi * hq + h) * nq + i] = m + sum.ln();
                }
            }
        }
        (out, lse)
    }

    /// The backward of [`direct_attention`] from the whole attention's `out` and `lse`
    /// (FlashAttention-2's): `(dq, dk, dv)`, dk and dv summed over these queries.
    #[allow(clippy::too_many_arguments)]
    fn direct_attention_grad(query_positions: &[usize], key_positions: &[usize], q: &[f64], k: &[f64], v: &[f64], out: &[f64], lse: &[f64], dout: &[f64], (b, hq, hk, d, causal): Sizes) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (nq, nk, scale) = (query_positions.len(), key_positions.len(), 1.0 / (d as f64).sqrt());
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        for bi in 0..b {
            for h in 0..hq {
                let g = h / (hq / hk);
                for i in 0..nq {
                    let (qi, l) = ((bi * nq + i) * hq * d + h * d, lse[(bi * hq + h) * nq + i]);
                    let rowdot: f64 = (0..d).map(|c| out[qi + c] * dout[qi + c]).sum();
                    for j in (0..nk).filter(|&j| !causal || key_positions[j] <= query_positions[i]) {
                        let kj = (bi * nk + j) * hk * d + g * d;
                        let p = (scale * (0..d).map(|c| q[qi + c] * k[kj + c]).sum::<f64>() - l).exp();
                        let ds = p * ((0..d).map(|c| dout[qi + c] * v[kj + c]).sum::<f64>() - rowdot);
                        for c in 0..d {
                            dq[qi + c] += scale * ds * k[kj + c];
                            dk[kj + c] += scale * ds * q[qi + c];
                            dv[kj + c] += p * dout[qi + c];
                        }
                    }
                }
            }
        }
        (dq, dk, dv)
    }

    /// Values rounded to bf16 as the device stores them.
    fn round_bf16(values: &[f64]) -> Vec<f64> {
        values.iter().map(|&x| f32::from_bits((cuda::bf16_bits(x as f32) as u32) << 16) as f64).collect()
    }

    /// Runs `xf.attention` and `xf.attention_grad` on `q [b, hq, s, d]`, `k, v [b, hk, s, d]`
    /// on the CPU and the emulated device; the case's name, the device's kernels and each
    /// result's largest difference against the values' scale (at least 1: with one key, dk
    /// is 0 up to rounding).
    fn attention_against_the_cpu(dtype: shardc_ir::types::DType, s: i64, causal: bool, shape: (i64, i64, i64, i64)) -> (String, Vec<String>, Vec<(&'static str, f64)>) {
        let (b, hq, hk, d) = shape;
        let what = format!("{dtype:?} s={s} causal={causal} b={b} hq={hq} hk={hk} d={d}");
        let program = attention_program(dtype, s, causal, shape);
        let kernels = program.device.as_ref().unwrap().kernels();
        let mut cpu = shardc_runtime::cpu::CpuExecutor::new(program.clone()).unwrap();
        let mut device = cuda::CudaExecutor::new(program.clone(), &Placement::Emulated).unwrap();
        for (i, name) in ["q", "k", "v", "dout"].iter().enumerate() {
            let len = program.buffers[program.arg(name).unwrap().buffer].len();
            // Scores of a few units, so the softmax has real peaks to track.
            let values: Vec<f64> = (0..len).map(|j| 2.0 * (shardc_runtime::init::uniform(i as u64 + 11, j as u64) - 0.5) * if *name == "dout" { 1.0 } else { 3.0 }).collect();
            cpu.write_f64(name, &values).unwrap();
            device.write(0, name, &values).unwrap();
        }
        cpu.run().unwrap();
        device.run().unwrap();
        // The forward's row log-sum-exp too: the backward recomputes the probabilities from it.
        let errors = ["out", "lse", "dq", "dk", "dv"]
            .into_iter()
            .map(|name| {
                let (c, g) = (cpu.read_f64(name).unwrap(), device.read(0, name).unwrap());
                (name, c.iter().zip(&g).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / c.iter().map(|x| x.abs()).fold(1.0, f64::max))
            })
            .collect();
        (what, kernels, errors)
    }

    /// Pipelines and gradient accumulation on the device equal the CPU pipeline runtime on
    /// the same programs: every rank of the mesh on one device (each pipeline rank's executor
    /// runs until a receive waits for another's send), tiny GPT and tiny Llama at (1,1,2) and
    /// (2,2,2) under 1F1B, interleaved and ZB-H1, and one pipeline rank summing micro-batches
    /// (GPipe at dp=2; 1F1B at (1,1,1)). Losses to 1e-5, parameters after two steps to 1e-4.
    #[test]
    fn pipelines_and_gradient_accumulation_equal_the_cpu_pipeline_runtime() {
        use shardc_runtime::schedule::Kind;
        const STEPS: u64 = 2;
        let mut cases = vec![("tiny", Mesh::default(), Kind::OneFOneB, 4), ("tiny", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, Kind::Gpipe, 3)];
        for name in ["tiny", "tiny-llama"] {
            for mesh in [Mesh { dp: 1, tp: 1, pp: 2, cp: 1, ep: 1 }, Mesh { dp: 2, tp: 2, pp: 2, cp: 1, ep: 1 }] {
                for kind in [Kind::OneFOneB, Kind::Interleaved, Kind::ZeroBubble] {
                    cases.push((name, mesh, kind, 4));
                }
            }
        }
        for (name, mesh, kind, microbatches) in cases {
            let what = format!("{name} {mesh} {kind:?} x{microbatches}");
            let (programs, spec) = crate::pipeline::compile_stages(name, mesh, kind, microbatches);
            assert_eq!(programs.len(), mesh.pp as usize, "{what}");
            let programs: Vec<Program> = programs.into_iter().map(|p| shardc_codegen::device::with_device_plan(p).unwrap()).collect();
            let corpus = corpus(&spec);
            let layers = spec.model.layers as usize;
            let cpu = shardc_runtime::pipeline::train_pipeline(&programs, 0, layers, &corpus, STEPS, std::time::Duration::from_secs(60), shardc_runtime::collectives::Algorithm::Ring).unwrap();
            let run = cuda::train_programs(&programs, 0, layers, &corpus, STEPS, &Placement::Emulated).unwrap_or_else(|e| panic!("{what}: {e}"));
            for (step, (c, g)) in cpu.losses.iter().zip(&run.losses).enumerate() {
                assert!((c - g).abs() <= 1e-5 * c.abs(), "{what} step {}: CPU loss {c}, device {g}", step + 1);
            }
            assert_eq!(run.parameters.len(), cpu.parameters.len(), "{what}");
            for (param, _, values) in &run.parameters {
                let (_, _, expected) = cpu.parameters.iter().find(|(n, _, _)| n == param).unwrap();
                let rel = relative(expected, values);
                assert!(rel <= 1e-4, "{what}: `{param}` differs by {rel:.2e} after {STEPS} steps");
            }
        }
    }

    /// Step buckets go out inside their chunk's last backward work, as the layers that fill
    /// them finish (Megatron-LM's `--overlap-grad-reduce`), not after it: with one gradient a
    /// bucket, most are sent early, and training still equals the CPU pipeline runtime (which
    /// sends them at the work's end) at dp=2 under 1F1B, interleaved and ZB-H1 over two stages,
    /// and with accumulation on one; with ZeRO-1 and ZeRO-2 the buckets reduce-scatter. Every
    /// rank on one device, and one process per rank.
    #[test]
    fn step_buckets_go_out_as_their_layers_finish() {
        use shardc_runtime::schedule::Kind;
        const STEPS: u64 = 2;
        let two_stages = Mesh { dp: 2, tp: 1, pp: 2, cp: 1, ep: 1 };
        let accumulation = Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 };
        for (mesh, kind, zero) in [(two_stages, Kind::OneFOneB, 0), (two_stages, Kind::Interleaved, 0), (two_stages, Kind::ZeroBubble, 0), (accumulation, Kind::OneFOneB, 0), (two_stages, Kind::Interleaved, 1), (accumulation, Kind::OneFOneB, 2)] {
            let what = format!("{mesh} {kind:?} ZeRO-{zero}");
            let (programs, spec) = crate::pipeline::compile_stages_with("tiny", mesh, kind, 4, |o| {
                o.grad_bucket_bytes = 1;
                o.zero = zero;
                // ZeRO shards optimizer state: AdamW's moments.
                if zero > 0 {
                    o.optimizer = OptimizerKind::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 };
                }
            });
            let programs: Vec<Program> = programs.into_iter().map(|p| shardc_codegen::device::with_device_plan(p).unwrap()).collect();
            let buckets: usize = programs.iter().map(|p| p.memory.buckets.len()).sum();
            assert!(buckets > 4, "{what}: one bucket a gradient");
            // Under ZeRO the buckets of sharded gradients reduce-scatter (the distributed
            // optimizer's gradient shards); without it every bucket all-reduces.
            let scatters: usize = programs.iter().map(|p| (0..p.memory.buckets.len()).filter(|&k| p.step_bucket_scatters(k)).count()).sum();
            assert!(if zero > 0 { scatters > buckets / 2 } else { scatters == 0 }, "{what}: {scatters} of {buckets} buckets reduce-scatter");
            // And the gathers of the updated shards are asynchronous, in buckets.
            let gathers: usize = programs.iter().map(|p| p.instrs.iter().filter(|i| i.op == "shard.all_gather" && i.bool("xf.async") == Ok(true)).count()).sum();
            assert!(if zero > 0 { gathers > 0 } else { gathers == 0 }, "{what}: {gathers} asynchronous gathers");
            // Each wait updates its gather's result in place, merged chunks' step sections too
            // (no second copy of the parameter).
            for p in &programs {
                for w in p.instrs.iter().filter(|i| i.op == "xf.wait") {
                    assert_eq!(w.inputs[0], w.outputs[0], "{what}: {} has a buffer of its own", w.loc);
                }
            }
            let (cpu, trainer) = one_device_equals_the_cpu_pipeline(&what, &programs, &spec, STEPS);
            // Each step, every bucket whose gradients are all made before the work's end goes
            // out early: most of them.
            let early = trainer.step_buckets_sent_early();
            assert!(early >= STEPS as usize * buckets / 2 && early <= STEPS as usize * buckets, "{what}: {early} of {} bucket sends went out early", STEPS as usize * buckets);
            // One process per rank (NCCL emulated, each communicator's operations matched by
            // their order): every dp peer sends its buckets in the same order.
            processes_equal_the_cpu(&format!("{what} in processes"), &programs, &spec, STEPS, &cpu.losses, &cpu.parameters);
        }
    }

    /// Trains `programs` (a pipeline's ranks) `steps` steps with every rank on one emulated
    /// device and on the CPU pipeline runtime; asserts they agree (losses to 1e-5, parameters
    /// to 1e-4) and returns both.
    fn one_device_equals_the_cpu_pipeline(what: &str, programs: &[Program], spec: &shardc_ir::spec::Spec, steps: u64) -> (shardc_runtime::pipeline::PipelineRun, cuda::CudaTrainer) {
        let corpus = corpus(spec);
        let layers = spec.model.layers as usize;
        let cpu = shardc_runtime::pipeline::train_pipeline(programs, 0, layers, &corpus, steps, std::time::Duration::from_secs(60), shardc_runtime::collectives::Algorithm::Ring).unwrap();
        let mut trainer = cuda::CudaTrainer::new(programs, &Placement::Emulated, 0, layers, None).unwrap();
        let losses: Vec<f64> = (0..steps).map(|_| trainer.step(&corpus).unwrap().0).collect();
        for (step, (c, g)) in cpu.losses.iter().zip(&losses).enumerate() {
            assert!((c - g).abs() <= 1e-5 * c.abs(), "{what} step {}: CPU loss {c}, device {g}", step + 1);
        }
        for (param, _, values) in &trainer.parameters().unwrap() {
            let (_, _, expected) = cpu.parameters.iter().find(|(n, _, _)| n == param).unwrap();
            let rel = relative(expected, values);
            assert!(rel <= 1e-4, "{what}: `{param}` differs by {rel:.2e} after {steps} steps");
        }
        (cpu, trainer)
    }

    /// Tensor parallelism inside pipeline stages (tp=2, pp=2): a collective with compute
    /// after it runs asynchronously and is waited for inside its section (tiny GPT's data
    /// gradients' all-reduces behind their weight gradients' GEMMs, in their own outputs;
    /// with sequence parallelism, tiny Llama's LM-head reduce-scatter), and training equals
    /// the CPU pipeline runtime under 1F1B and ZB-H1 (whose backward sections have no weight
    /// gradients left to hide behind), every rank on one device and one process per rank.
    #[test]
    fn tensor_parallel_collectives_overlap_inside_pipeline_stages() {
        use shardc_runtime::program::Phase;
        use shardc_runtime::schedule::Kind;
        const STEPS: u64 = 2;
        for (name, sequence_parallel, kind) in [("tiny", false, Kind::OneFOneB), ("tiny-llama", true, Kind::OneFOneB), ("tiny-llama", true, Kind::ZeroBubble)] {
            let what = format!("{name} sp={sequence_parallel} pp=2 {kind:?}");
            let (programs, spec) = crate::pipeline::compile_stages_with(name, Mesh { dp: 1, tp: 2, pp: 2, cp: 1, ep: 1 }, kind, 4, |o| o.sequence_parallel = sequence_parallel);
            let programs: Vec<Program> = programs.into_iter().map(|p| shardc_codegen::device::with_device_plan(p).unwrap()).collect();
            let overlapped: usize = programs
                .iter()
                .map(|p| {
                    let plan = p.pipeline.as_ref().unwrap();
                    assert!(p.memory.buckets.is_empty(), "{what}: no step buckets without dp, and no regions for the sections' collectives");
                    let sections: Vec<std::ops::Range<usize>> = plan.chunks.iter().flat_map(|c| [Phase::Forward, Phase::Backward, Phase::Weight].map(|s| c.range(s))).collect();
                    p.instrs.iter().enumerate().filter(|(i, instr)| instr.op.starts_with("shard.") && instr.bool("xf.async") == Ok(true) && sections.iter().any(|r| r.contains(i))).count()
                })
                .sum();
            if kind != Kind::ZeroBubble {
                assert!(overlapped >= 1, "{what}: {overlapped} collectives overlap compute");
            }
            let (cpu, _) = one_device_equals_the_cpu_pipeline(&what, &programs, &spec, STEPS);
            processes_equal_the_cpu(&format!("{what} in processes"), &programs, &spec, STEPS, &cpu.losses, &cpu.parameters);
        }
    }

    /// `memory/GPU` is what the CUDA backend holds in a process of a multi-process run, in
    /// pipelines and gradient accumulation too: the most device bytes each process's executor
    /// had at once over two steps (measured as it allocates: arena, argument slots, the
    /// pipeline's copies of each micro-batch's kept values and its gradient sums, send copies,
    /// ZeRO's whole gradients and the collectives' staging) equal the estimate, but for the
    /// step's inputs and the processes' agreement at start (a few integers each).
    #[test]
    fn the_memory_estimate_is_what_each_process_holds_in_pipelines_and_accumulation() {
        use shardc_runtime::program::{Role, CUBLASLT_WORKSPACE_BYTES};
        use shardc_runtime::schedule::Kind;
        const ADAMW: OptimizerKind = OptimizerKind::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 };
        let stages = Mesh { dp: 1, tp: 1, pp: 2, cp: 1, ep: 1 };
        let accumulation = Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 };
        let both = Mesh { dp: 2, tp: 1, pp: 2, cp: 1, ep: 1 };
        let cases = [
            ("tiny", stages, Kind::OneFOneB, 0u8, 0u64),
            ("tiny", stages, Kind::Interleaved, 0, 0),
            ("tiny", stages, Kind::ZeroBubble, 0, 0),
            ("tiny", accumulation, Kind::OneFOneB, 0, 1),
            ("tiny", accumulation, Kind::OneFOneB, 2, 1),
            ("tiny", both, Kind::Interleaved, 1, 4096),
            ("tiny-llama", Mesh { dp: 2, tp: 2, pp: 2, cp: 1, ep: 1 }, Kind::OneFOneB, 1, 4096),
        ];
        for (name, mesh, kind, zero, bucket_bytes) in cases {
            let what = format!("{name} {mesh} {kind:?} ZeRO-{zero}");
            let (programs, spec) = crate::pipeline::compile_stages_with(name, mesh, kind, 4, |o| {
                o.grad_bucket_bytes = bucket_bytes;
                o.zero = zero;
                o.optimizer = ADAMW;
            });
            let programs: Vec<Program> = programs.into_iter().map(|p| shardc_codegen::device::with_device_plan(p).unwrap()).collect();
            let estimates = shardc_codegen::estimate::memory(&programs, zero);
            let world = shardc_runtime::collectives::MeshShape(programs[0].mesh.clone()).ranks();
            let held = in_processes(world, |_, placement| {
                let mut trainer = cuda::CudaTrainer::new(&programs, &placement, 0, spec.model.layers as usize, None).unwrap();
                let corpus = corpus(&spec);
                for _ in 0..2 {
                    trainer.step(&corpus).unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                trainer.peak_device_bytes()
            });
            for (rank, executors) in held.into_iter().enumerate() {
                let [(stage, ranks, peak)] = executors.as_slice() else { panic!("{what}: a process runs one executor") };
                assert_eq!(ranks, &vec![rank], "{what}");
                let (program, estimate) = (&programs[*stage], &estimates[*stage]);
                let inputs: usize = program.args.iter().filter(|a| a.role == Some(Role::Input)).map(|a| program.buffers[a.buffer].len() * program.buffers[a.buffer].dtype.bytes()).sum();
                // The emulated device has no cuBLASLt workspace.
                let expected = estimate.total - CUBLASLT_WORKSPACE_BYTES as f64 + inputs as f64;
                let agreement = 4.0 * 4.0 * (world + 1) as f64;
                assert!((*peak as f64 - expected).abs() <= agreement, "{what} rank {rank}: held {peak} bytes, estimated {expected} ({estimate:?})");
            }
        }
    }

    /// Pipeline stages across processes, one per rank as under torchrun (NCCL emulated, a
    /// pair's sends and receives matched by their order alone, as NCCL matches them, the
    /// emulation checking that each receive gets the transfer it expects): each process runs
    /// its own pipeline rank's items, its sends on streams of their own. Tiny GPT at (1,1,2)
    /// and tiny Llama at (2,2,2) under 1F1B, interleaved and ZB-H1 equal the CPU pipeline
    /// runtime: every process's losses, and the shards it holds after two steps.
    #[test]
    fn pipeline_stages_in_processes_equal_the_cpu_pipeline_runtime() {
        use shardc_runtime::schedule::Kind;
        const STEPS: u64 = 2;
        for (name, mesh) in [("tiny", Mesh { dp: 1, tp: 1, pp: 2, cp: 1, ep: 1 }), ("tiny-llama", Mesh { dp: 2, tp: 2, pp: 2, cp: 1, ep: 1 })] {
            for kind in [Kind::OneFOneB, Kind::Interleaved, Kind::ZeroBubble] {
                let what = format!("{name} {mesh} {kind:?}");
                let (programs, spec) = crate::pipeline::compile_stages(name, mesh, kind, 4);
                let programs: Vec<Program> = programs.into_iter().map(|p| shardc_codegen::device::with_device_plan(p).unwrap()).collect();
                let corpus = corpus(&spec);
                let layers = spec.model.layers as usize;
                let cpu = shardc_runtime::pipeline::train_pipeline(&programs, 0, layers, &corpus, STEPS, std::time::Duration::from_secs(60), shardc_runtime::collectives::Algorithm::Ring).unwrap();
                processes_equal_the_cpu(&what, &programs, &spec, STEPS, &cpu.losses, &cpu.parameters);
            }
        }
    }

    /// Data-parallel gradients in buckets of about 4 KiB (several buckets of several
    /// gradients each): every bucket is one range of the arena, reduced with one collective,
    /// and training equals the CPU backend (which reduces each bucket's concatenation).
    #[test]
    fn gradient_buckets_are_contiguous_and_reduced_with_one_collective_each() {
        const STEPS: u64 = 3;
        for (name, mesh) in [("tiny", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }), ("tiny-llama", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 })] {
            let bucketed = |bucket_bytes: u64| sgd_step_tuned(name, "f32", mesh, None, |o| o.grad_bucket_bytes = bucket_bytes);
            let (program, spec) = bucketed(4096);
            let regions = &program.memory.buckets;
            let members: usize = regions.iter().map(|r| r.members.len()).sum();
            let asynchronous = program.instrs.iter().filter(|i| i.bool("xf.async") == Ok(true)).count();
            assert!(regions.len() >= 3 && members > regions.len(), "{name} {mesh}: {} regions of {members} members", regions.len());
            assert_eq!(members, asynchronous, "{name} {mesh}: every bucketed all-reduce lies in a region");
            for r in regions {
                // Back to back: each member starts where the one before it ends (16-byte padded).
                let mut at = r.offset;
                for &m in &r.members {
                    let (offset, bytes) = program.arena_range(program.instrs[m].outputs[0]).unwrap();
                    assert_eq!(offset, at, "{name} {mesh}: bucket {} member {m}", r.bucket);
                    at = offset + bytes.div_ceil(16) * 16;
                }
                assert_eq!(at, r.offset + r.bytes, "{name} {mesh}: bucket {} ends at its last member", r.bucket);
            }
            let runtime_collectives = program.instrs.iter().filter(|i| i.op.starts_with("shard.") && !matches!(i.op.as_str(), "shard.send" | "shard.recv")).count();
            let mut device = cuda::CudaExecutor::new(program.clone(), &Placement::Emulated).unwrap();
            let corpus = corpus(&spec);
            let run = cuda::train(&program, 0, spec.model.layers as usize, &corpus, STEPS, &Placement::Emulated).unwrap_or_else(|e| panic!("{name} {mesh}: {e}"));
            // One step's collectives (on zeros: the count does not depend on values), counted
            // by the executor: one per bucket, not per member.
            device.run().unwrap();
            assert_eq!(device.collectives_issued(), runtime_collectives - members + regions.len(), "{name} {mesh}");
            // The CPU backend, with the same buckets, reduces each bucket's concatenation.
            let cpu = shardc_runtime::train::train_spmd(&bucketed(4096).0, 0, spec.model.layers as usize, &corpus, STEPS, std::time::Duration::from_secs(60)).unwrap();
            for (step, (c, g)) in cpu.losses.iter().zip(&run.losses).enumerate() {
                assert!((c - g).abs() <= 1e-5 * c.abs(), "{name} {mesh} step {}: CPU loss {c}, device {g}", step + 1);
            }
            for (name_p, _, values) in &run.parameters {
                let (_, _, expected) = cpu.parameters.iter().find(|(n, _, _)| n == name_p).unwrap();
                assert!(relative(expected, values) <= 1e-4, "{name} {mesh}: `{name_p}` differs after {STEPS} steps");
            }
        }
    }

    /// One process per rank, as under torchrun, with NCCL emulated by the CPU collectives
    /// between threads (each thread an executor on its own emulated device): the NCCL paths
    /// (a bucket region's one all-reduce, tensor-parallel all-reduces, ZeRO-3's reduce-scatters
    /// and gathers and sequence parallelism's, with their staging) train as the CPU backend
    /// does: every process's losses, and the whole parameters it holds, after three steps.
    #[test]
    fn processes_over_emulated_nccl_equal_the_cpu_backend() {
        const STEPS: u64 = 3;
        let compile = |name: &str, mesh: Mesh, zero: u8, sequence_parallel: bool, grad_bucket_bytes: u64| {
            sgd_step_tuned(name, "f32", mesh, None, |o| {
                o.zero = zero;
                o.sequence_parallel = sequence_parallel;
                o.grad_bucket_bytes = grad_bucket_bytes;
            })
        };
        let default_buckets = CompileOptions::default().grad_bucket_bytes;
        for (name, mesh, zero, sequence_parallel, buckets) in [
            ("tiny", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 0, false, 4096),
            ("tiny-llama", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 0, false, default_buckets),
            ("tiny", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 3, false, default_buckets),
            ("tiny", Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 0, true, default_buckets),
            // ZeRO-3's reduce-scatter buckets, each issued as one group.
            ("tiny", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 3, false, 2048),
            // Context parallelism: gathers and scatters over cp groups of processes.
            ("tiny-llama", Mesh { dp: 2, tp: 1, pp: 1, cp: 2, ep: 1 }, 0, false, default_buckets),
        ] {
            let what = format!("{name} {mesh} ZeRO-{zero} sp={sequence_parallel}");
            let (program, spec) = compile(name, mesh, zero, sequence_parallel, buckets);
            if zero > 0 && buckets < default_buckets {
                let scatter_buckets: std::collections::BTreeSet<i64> = program.instrs.iter().filter(|i| i.op == "shard.reduce_scatter" && i.bool("xf.async") == Ok(true)).map(|i| i.int("xf.bucket").unwrap()).collect();
                assert!(scatter_buckets.len() >= 2, "{what}: {} scatter buckets", scatter_buckets.len());
            }
            let layers = spec.model.layers as usize;
            let cpu = shardc_runtime::train::train_spmd(&program, 0, layers, &corpus(&spec), STEPS, std::time::Duration::from_secs(60)).unwrap();
            processes_equal_the_cpu(&what, std::slice::from_ref(&program), &spec, STEPS, &cpu.losses, &cpu.parameters);
        }
    }

    /// Ring attention across processes (issue 20): each pair of key/value blocks goes round
    /// the cp ranks as one NCCL group of sends and receives on the cp communicator's stream
    /// behind the attention of the block before, joined at its wait (emulated), and the
    /// blocks' gradient sums the same way back; with tp inside each cp rank. Every process
    /// trains as the CPU backend's ring does, and the CPU's ring as its gathers do.
    #[test]
    fn ring_attention_in_processes_equals_the_cpu_backend() {
        const STEPS: u64 = 3;
        use shardc_passes::sharding::ContextAttention;
        for (name, mesh) in [("tiny-llama", Mesh { dp: 1, tp: 2, pp: 1, cp: 2, ep: 1 }), ("tiny", Mesh { dp: 1, tp: 1, pp: 1, cp: 4, ep: 1 })] {
            let what = format!("{name} {mesh} ring");
            let (program, spec) = sgd_step_tuned(name, "f32", mesh, None, |o| o.context_attention = ContextAttention::Ring);
            let shifts = program.instrs.iter().filter(|i| i.op == "shard.shift").count();
            let buckets: std::collections::BTreeSet<i64> = program.instrs.iter().filter(|i| i.op == "shard.shift" && i.bool("xf.async") == Ok(true)).map(|i| i.int("xf.bucket").unwrap()).collect();
            assert!(shifts >= 4 && buckets.len() * 2 == shifts, "{what}: {shifts} shifts in {} buckets", buckets.len());
            let layers = spec.model.layers as usize;
            let cpu = shardc_runtime::train::train_spmd(&program, 0, layers, &corpus(&spec), STEPS, std::time::Duration::from_secs(60)).unwrap();
            let (gathered, _) = sgd_step_tuned(name, "f32", mesh, None, |o| o.context_attention = ContextAttention::AllGather);
            let reference = shardc_runtime::train::train_spmd(&gathered, 0, layers, &corpus(&spec), STEPS, std::time::Duration::from_secs(60)).unwrap();
            for (c, g) in reference.losses.iter().zip(&cpu.losses) {
                assert!((c - g).abs() <= 1e-5 * c.abs(), "{what}: the CPU's ring {g}, its gathers {c}");
            }
            for (param, _, values) in &cpu.parameters {
                let (_, _, gathered) = reference.parameters.iter().find(|(n, _, _)| n == param).unwrap();
                assert!(relative(gathered, values) <= 1e-6, "{what}: the CPU's ring and gathers differ in `{param}`");
            }
            processes_equal_the_cpu(&what, std::slice::from_ref(&program), &spec, STEPS, &cpu.losses, &cpu.parameters);
        }
        // Inside pipeline stages (cp=2 x pp=2): the shifts synchronous, between the stages'
        // sends and receives.
        crate::pipeline::ATTENTION.with(|a| a.set(ContextAttention::Ring));
        let (programs, spec) = crate::pipeline::compile_stages("tiny-llama", Mesh { dp: 1, tp: 1, pp: 2, cp: 2, ep: 1 }, shardc_runtime::schedule::Kind::OneFOneB, 4);
        crate::pipeline::ATTENTION.with(|a| a.set(ContextAttention::Auto));
        assert!(programs.iter().any(|p| p.instrs.iter().any(|i| i.op == "shard.shift" && i.bool("xf.async") != Ok(true))), "the stages ring, synchronously");
        let programs: Vec<Program> = programs.into_iter().map(|p| shardc_codegen::device::with_device_plan(p).unwrap()).collect();
        let layers = spec.model.layers as usize;
        let cpu = shardc_runtime::pipeline::train_pipeline(&programs, 0, layers, &corpus(&spec), 2, std::time::Duration::from_secs(60), shardc_runtime::collectives::Algorithm::Ring).unwrap();
        processes_equal_the_cpu("tiny-llama cp=2 pp=2 ring", &programs, &spec, 2, &cpu.losses, &cpu.parameters);
    }

    /// ZeRO-1 and 2 under AdamW (whose state they shard) with small buckets: one process per
    /// rank issues each reduce-scatter and gather bucket as one NCCL group on the
    /// communication stream (emulated), and trains as every rank on one device does with
    /// the same kernels and plain copies for collectives.
    #[test]
    fn zero_buckets_in_processes_equal_every_rank_on_one_device() {
        const STEPS: u64 = 3;
        let adamw = OptimizerKind::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 };
        for (name, mesh, zero, buckets) in [("tiny", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 1, 2048), ("tiny-llama", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 2, 4096)] {
            let what = format!("{name} {mesh} ZeRO-{zero} buckets of {buckets} B");
            let (program, spec) = sgd_step_tuned(name, "f32", mesh, None, |o| {
                o.optimizer = adamw;
                o.zero = zero;
                o.grad_bucket_bytes = buckets;
            });
            let count = |op: &str| program.instrs.iter().filter(|i| i.op == op && i.bool("xf.async") == Ok(true)).map(|i| i.int("xf.bucket").unwrap()).collect::<std::collections::BTreeSet<i64>>().len();
            assert!(count("shard.reduce_scatter") >= 2 && count("shard.all_gather") >= 2, "{what}: {} scatter and {} gather buckets", count("shard.reduce_scatter"), count("shard.all_gather"));
            let mut single = cuda::CudaTrainer::new(std::slice::from_ref(&program), &Placement::Emulated, 0, spec.model.layers as usize, None).unwrap();
            let corpus = corpus(&spec);
            let losses: Vec<f64> = (0..STEPS).map(|_| single.step(&corpus).unwrap().0).collect();
            let state = single.state().unwrap();
            let whole: Vec<(String, Vec<usize>, Vec<f64>)> = state.tensors.into_iter().map(|(n, (shape, values))| (n, shape, values)).collect();
            processes_equal_the_cpu(&what, std::slice::from_ref(&program), &spec, STEPS, &losses, &whole);
        }
    }

    /// What `--save`, `--save-hf` and `--eval-every` read from a GPU run, one tensor at a
    /// time from device memory, is the run's whole state: every parameter, global and
    /// unpadded, the fp32 master where mixed precision keeps one. Tiny Llama in bf16 at
    /// dp=2 tp=2 with ZeRO-1 and a padded vocabulary, and tiny GPT over two pipeline stages.
    #[test]
    fn a_gpu_runs_parameters_read_a_tensor_at_a_time_are_its_whole_state() {
        use shardc_runtime::train::ParameterSource;
        let adamw = OptimizerKind::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 };
        let (program, spec) = sgd_step_tuned("tiny-llama", "bf16", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, Some(3), |o| {
            o.optimizer = adamw;
            o.zero = 1;
        });
        let (stages, gpt) = crate::pipeline::compile_stages("tiny", Mesh { dp: 2, tp: 2, pp: 2, cp: 1, ep: 1 }, shardc_runtime::schedule::Kind::OneFOneB, 4);
        let stages: Vec<Program> = stages.into_iter().map(|p| shardc_codegen::device::with_device_plan(p).unwrap()).collect();
        for (what, programs, spec) in [("tiny-llama bf16 dp=2 tp=2 ZeRO-1", vec![program], spec), ("tiny (2,2,2) 1F1B", stages, gpt)] {
            let mut trainer = cuda::CudaTrainer::new(&programs, &Placement::Emulated, 0, spec.model.layers as usize, None).unwrap();
            trainer.step(&corpus(&spec)).unwrap();
            let state = trainer.state().unwrap();
            let shapes = trainer.parameter_shapes().unwrap();
            let expected: Vec<&String> = state.tensors.keys().filter(|n| shardc_runtime::program::state_of(n).is_none()).collect();
            assert_eq!(shapes.keys().collect::<Vec<_>>(), expected, "{what}");
            let mut masters = 0;
            for (name, shape) in &shapes {
                let (whole_shape, whole) = state.parameter(name).unwrap();
                assert_eq!(shape, whole_shape, "{what}: {name}");
                assert_eq!(&trainer.parameter_values(name).unwrap(), whole, "{what}: {name}");
                masters += usize::from(state.tensors.contains_key(&shardc_runtime::program::master_name(name)));
            }
            assert_eq!(masters > 0, what.contains("bf16"), "{what}: {masters} masters");
            // The vocabulary padded for tp=2 is read back unpadded.
            assert_eq!(shapes["embed.tokens.weight"][0], spec.model.vocab as usize, "{what}");
        }
    }

    /// A GPU run evaluates on its devices, each process from its own shards, with its
    /// training step's forward alone: each pipeline rank's forward sections (Megatron-LM's
    /// forward-only schedule), or a step without sections up to where its loss is made, whose
    /// data-parallel sum (bucketed with the gradients at the step's end) is left to the host.
    /// The held-out loss is the CPU evaluator's on the whole model, with a last partial batch
    /// (13 windows over batches of 8 and of 4), the same on every process, in no more device
    /// memory than the step, and the run goes on as if it had not evaluated. Tiny at dp=2
    /// tp=2 with ZeRO-3, and over (2,2,2) 1F1B.
    #[test]
    fn gpu_runs_evaluate_with_their_own_forward_and_shards() {
        const WINDOWS: usize = 13;
        let adamw = OptimizerKind::AdamW { lr: 0.01, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 };
        let (program, spec) = sgd_step_tuned("tiny", "f32", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, None, |o| {
            o.optimizer = adamw;
            o.zero = 3;
        });
        let partial = program.loss_partial().unwrap();
        assert_eq!(partial.axes, [0], "the loss's sum over dp is left to the host");
        assert!(partial.end < program.instrs.len() / 2, "the loss is made by instruction {} of {}", partial.end, program.instrs.len());
        // A step whose forward would write its state (as the update does) is not run to evaluate.
        let mut hostile = program.clone();
        let param = hostile.args.iter().find(|a| a.name == "embed.tokens.weight").unwrap().buffer;
        hostile.instrs[1].outputs = vec![param];
        let refused = hostile.loss_partial().unwrap_err();
        assert!(refused.contains("instruction 1") && refused.contains("`embed.tokens.weight`"), "{refused}");
        hostile.results.retain(|r| r.name != "loss");
        assert_eq!(hostile.loss_partial().unwrap_err(), "the program returns no `loss`");
        let (stages, gpt) = crate::pipeline::compile_stages("tiny", Mesh { dp: 2, tp: 2, pp: 2, cp: 1, ep: 1 }, shardc_runtime::schedule::Kind::OneFOneB, 4);
        let stages: Vec<Program> = stages.into_iter().map(|p| shardc_codegen::device::with_device_plan(p).unwrap()).collect();
        for (what, programs, spec) in [("tiny dp=2 tp=2 ZeRO-3", vec![program], spec), ("tiny (2,2,2) 1F1B", stages, gpt)] {
            let (corpus, layers) = (corpus(&spec), spec.model.layers as usize);
            let mut trainer = cuda::CudaTrainer::new(&programs, &Placement::Emulated, 0, layers, None).unwrap();
            trainer.step(&corpus).unwrap();
            let peak = trainer.peak_device_bytes();
            let state = trainer.state().unwrap();
            let on_cpu = cpu_evaluator(&spec, &corpus, WINDOWS).loss(&state, &corpus).unwrap();
            let on_device = trainer.evaluate(&corpus, WINDOWS).unwrap();
            assert!((on_device - on_cpu).abs() <= 1e-5 * on_cpu, "{what}: the device evaluates {on_device}, the CPU {on_cpu}");
            assert_eq!(trainer.state().unwrap().tensors, state.tensors, "{what}: evaluating changed the state");
            // However many windows, no more device memory than the step held (a forward-only
            // walk's first stage once sent every micro-batch ahead, each from a copy kept).
            trainer.evaluate(&corpus, 100).unwrap();
            assert_eq!(trainer.peak_device_bytes(), peak, "{what}: evaluating 13 and 100 windows");
            let next = trainer.step(&corpus).unwrap().0;
            let mut twin = cuda::CudaTrainer::new(&programs, &Placement::Emulated, 0, layers, None).unwrap();
            twin.step(&corpus).unwrap();
            assert_eq!(twin.step(&corpus).unwrap().0, next, "{what}: the step after evaluating");
            let ranks = shardc_runtime::collectives::MeshShape(programs[0].mesh.clone()).ranks();
            let in_processes = in_processes(ranks, |rank, placement| {
                let mut trainer = cuda::CudaTrainer::new(&programs, &placement, 0, layers, None).unwrap();
                trainer.step(&corpus).unwrap();
                let loss = trainer.evaluate(&corpus, WINDOWS).unwrap_or_else(|e| panic!("{what} rank {rank}: {e}"));
                (loss, trainer.step(&corpus).unwrap().0)
            });
            for (rank, (loss, after)) in in_processes.into_iter().enumerate() {
                assert!((loss - on_cpu).abs() <= 1e-5 * on_cpu, "{what} rank {rank}: evaluates {loss}, the CPU {on_cpu}");
                assert!((after - next).abs() <= 1e-5 * next, "{what} rank {rank}: the step after evaluating took {after}, one device {next}");
            }
        }
    }

    /// The CPU's evaluation of `spec` over `windows` windows (as `shardc run --eval-every`
    /// on the CPU backend): its forward compiled for one device.
    fn cpu_evaluator(spec: &shardc_ir::spec::Spec, corpus: &ByteCorpus, windows: usize) -> shardc_runtime::eval::Evaluator {
        let shape = shardc_ir::spec::StepShape { rows: 1, padded_vocab: spec.model.vocab, sequence_chunks: 1 };
        let mut eval_spec = spec.clone();
        eval_spec.training.micro_batch = 1;
        eval_spec.training.global_batch = None;
        let mut module = shardc_ir::spec::lower(&eval_spec, shape).unwrap();
        let options = CompileOptions { vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, ..Default::default() };
        let cx = shardc_ir::mlir::IrContext::new().unwrap();
        shardc_passes::inference_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
        let program = shardc_codegen::lower_func(module.func("forward").unwrap()).unwrap();
        shardc_runtime::eval::Evaluator::new(program, corpus, windows).unwrap()
    }

    /// One process per rank (emulated NCCL) checkpoints from device memory: each writes its
    /// own rank file, rank 0 the manifest once every file is written. The checkpoint equals
    /// the one a single device saves from the whole state, and processes on another mesh
    /// (another padding, no ZeRO) resume from it, each reading only its own shards, and take
    /// the step the uninterrupted run takes.
    #[test]
    fn processes_checkpoint_their_own_shards_and_resume_from_them_on_any_mesh() {
        let adamw = OptimizerKind::AdamW { lr: 0.1, beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1 };
        let compile = |mesh: Mesh, zero: u8| {
            sgd_step_tuned("tiny-llama", "f32", mesh, Some(3), |o| {
                o.optimizer = adamw;
                o.zero = zero;
            })
        };
        let train_in_processes = |program: &Program, spec: &shardc_ir::spec::Spec, run: &(dyn Fn(usize, &mut cuda::CudaTrainer, &ByteCorpus) -> f64 + Sync), resume: Option<&std::path::Path>| -> Vec<f64> {
            in_processes(program.mesh.iter().product(), |rank, placement| {
                let mut trainer = match resume {
                    Some(dir) => cuda::CudaTrainer::resume(std::slice::from_ref(program), &placement, dir).unwrap_or_else(|e| panic!("rank {rank}: {e}")).0,
                    None => cuda::CudaTrainer::new(std::slice::from_ref(program), &placement, 0, spec.model.layers as usize, None).unwrap(),
                };
                run(rank, &mut trainer, &corpus(spec))
            })
        };
        let (program, spec) = compile(Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 1);
        // Every rank on one device: two steps, the whole state, the third step's loss.
        let mut single = cuda::CudaTrainer::new(std::slice::from_ref(&program), &Placement::Emulated, 0, spec.model.layers as usize, None).unwrap();
        let corpus = corpus(&spec);
        single.step(&corpus).unwrap();
        single.step(&corpus).unwrap();
        let whole = single.state().unwrap();
        let third = single.step(&corpus).unwrap().0;
        let dir = crate::checkpoint::TempDir::new();
        let saved = dir.path().to_path_buf();
        let losses = train_in_processes(
            &program,
            &spec,
            &|rank, trainer, corpus| {
                trainer.step(corpus).unwrap();
                trainer.step(corpus).unwrap();
                let committed = trainer.checkpoint_own_shards(&saved, serde_json::Value::Null, None, false).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                assert_eq!(committed.is_some(), rank == 0, "rank 0 commits the checkpoint, and only rank 0");
                trainer.step(corpus).unwrap().0
            },
            None,
        );
        for (rank, loss) in losses.iter().enumerate() {
            assert!((loss - third).abs() <= 1e-5 * third.abs(), "rank {rank}: step 3 loss {loss}, one device {third}");
        }
        let (manifest, state) = shardc_runtime::checkpoint::load_sharded(dir.path()).unwrap();
        assert_eq!((manifest.step, manifest.files.len(), manifest.checksums.len()), (2, 4, 4));
        assert_eq!(state.tensors.keys().collect::<Vec<_>>(), whole.tensors.keys().collect::<Vec<_>>());
        for (name, (shape, values)) in &whole.tensors {
            let (saved_shape, saved_values) = &state.tensors[name];
            assert_eq!(saved_shape, shape, "`{name}`");
            assert!(relative(values, saved_values) <= 1e-5, "`{name}` differs by {:.2e} from the one device's", relative(values, saved_values));
        }
        assert!(!dir.path().join(".partial-step-00000002-processes").exists(), "the rank files' folder became the checkpoint");
        // Resumed: on the same mesh, and at tp=2 without ZeRO (258 vocabulary rows either way,
        // but other shards: the optimizer state whole on every data-parallel rank).
        for (mesh, zero) in [(Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 1), (Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 0), (Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, 3)] {
            let (resumed, spec) = compile(mesh, zero);
            let losses = train_in_processes(
                &resumed,
                &spec,
                &|rank, trainer, corpus| {
                    assert_eq!(trainer.steps_taken(), 2, "rank {rank}");
                    trainer.step(corpus).unwrap().0
                },
                Some(dir.path()),
            );
            for (rank, loss) in losses.iter().enumerate() {
                assert!((loss - third).abs() <= 1e-5 * third.abs(), "{mesh} ZeRO-{zero} rank {rank}: resumed step 3 loss {loss}, uninterrupted {third}");
            }
        }
    }

    #[test]
    fn tiny_gpt_f32_single_device() {
        check("tiny", "f32", Mesh::default(), 1e-5, 1e-4);
    }

    #[test]
    fn tiny_gpt_f32_tensor_and_data_parallel_on_one_device() {
        check("tiny", "f32", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 1e-5, 1e-4);
    }

    /// Context parallelism (issue 20) on the device: every rank's part of the sequence in
    /// zigzag order, keys and values gathered over cp, positions offset by the rank's part
    /// (the scalar flash kernels: head dim 4), with data and tensor parallelism; the
    /// tensor-core kernels' context-parallel forms are checked by
    /// `context_parallel_attention_on_tensor_cores_equals_a_direct_evaluation` and, end to
    /// end, by the CLI's `context_parallel_attention_runs_on_tensor_cores_in_bf16`.
    #[test]
    fn context_parallel_on_one_device() {
        check("tiny-llama", "f32", Mesh { dp: 1, tp: 1, pp: 1, cp: 2, ep: 1 }, 1e-5, 1e-4);
        check("tiny", "f32", Mesh { dp: 2, tp: 2, pp: 1, cp: 2, ep: 1 }, 1e-5, 1e-4);
        check("tiny-llama", "f32", Mesh { dp: 1, tp: 2, pp: 1, cp: 4, ep: 1 }, 1e-5, 1e-4);
        check("tiny-llama", "bf16", Mesh { dp: 1, tp: 2, pp: 1, cp: 2, ep: 1 }, 2e-2, 2e-2);
    }

    /// Ring attention on the device: each step's block attention (the flash kernels with the
    /// block's first key row and a log-sum-exp), the merges, the steps' backward from the
    /// whole attention's statistics, and the shifts (asynchronous, two to a bucket) as copies
    /// among the ranks of one device; GQA and RoPE (tiny Llama) and MHA (tiny GPT), with tp.
    #[test]
    fn ring_attention_on_one_device() {
        let ring = |o: &mut CompileOptions| o.context_attention = shardc_passes::sharding::ContextAttention::Ring;
        // Parameters to 1e-5 (the gathers' runs agree to 1e-7; a block kernel reading dout's
        // rows before they were all staged was off by 1e-4).
        check_tuned("tiny-llama", "f32", Mesh { dp: 1, tp: 1, pp: 1, cp: 2, ep: 1 }, 1e-5, 1e-5, ring);
        check_tuned("tiny", "f32", Mesh { dp: 2, tp: 2, pp: 1, cp: 2, ep: 1 }, 1e-5, 1e-5, ring);
        check_tuned("tiny", "f32", Mesh { dp: 1, tp: 1, pp: 1, cp: 4, ep: 1 }, 1e-5, 1e-5, ring);
        check_tuned("tiny-llama", "bf16", Mesh { dp: 1, tp: 2, pp: 1, cp: 2, ep: 1 }, 2e-2, 2e-2, ring);
    }

    /// Mixture of experts (issue 21) on the GPU backend: the routing, permutation and grouped
    /// GEMM kernels, and the all-to-alls of expert parallelism as copies among the ranks of
    /// one device, equal the CPU backend's single-device run; in bf16 within its rounding.
    #[test]
    fn experts_on_one_device() {
        check("tiny-moe", "f32", Mesh::default(), 1e-5, 1e-5);
        check("tiny-moe", "f32", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 2 }, 1e-5, 1e-5);
        check("tiny-moe", "f32", Mesh { dp: 4, tp: 1, pp: 1, cp: 1, ep: 4 }, 1e-5, 1e-5);
        check("tiny-moe", "f32", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 2 }, 1e-5, 1e-5);
        check("tiny-moe", "bf16", Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 2 }, 2e-2, 2e-2);
    }

    /// Expert parallelism with one process per rank: each all-to-all is one NCCL group of
    /// sends and receives (emulated), and the run equals the CPU backend's.
    #[test]
    fn expert_parallel_processes_equal_the_cpu_backend() {
        const STEPS: u64 = 3;
        for mesh in [Mesh { dp: 4, tp: 1, pp: 1, cp: 1, ep: 4 }, Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 2 }] {
            let (program, spec) = sgd_step_tuned("tiny-moe", "f32", mesh, None, |_| {});
            assert!(program.instrs.iter().any(|i| i.op == "shard.all_to_all"), "{mesh}: no all-to-all");
            let cpu = shardc_runtime::train::train_spmd(&program, 0, spec.model.layers as usize, &corpus(&spec), STEPS, std::time::Duration::from_secs(60)).unwrap();
            processes_equal_the_cpu(&format!("tiny-moe {mesh}"), std::slice::from_ref(&program), &spec, STEPS, &cpu.losses, &cpu.parameters);
        }
    }

    #[test]
    fn tiny_llama_f32_tensor_parallel_on_one_device() {
        check("tiny-llama", "f32", Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, 1e-5, 1e-4);
    }

    /// A padded vocabulary, vocab-parallel over tp=2 (256 classes in 258 rows, and in 400
    /// rows, where most of the second rank's are padding), equals the CPU backend's unpadded
    /// single-device run: the device kernels leave the padded classes out of the loss.
    #[test]
    fn tiny_llama_f32_padded_vocabulary_on_one_device() {
        for multiple in [3, 100] {
            let (program, spec) = sgd_step_padded("tiny-llama", "f32", Mesh { dp: 1, tp: 2, pp: 1, cp: 1, ep: 1 }, Some(multiple));
            let run = cuda::train(&program, 0, spec.model.layers as usize, &corpus(&spec), 3, &Placement::Emulated).unwrap();
            let (losses, params) = cpu("tiny-llama", Mesh::default(), 3);
            for (c, g) in losses.iter().zip(&run.losses) {
                assert!((c - g).abs() <= 1e-5 * c.abs(), "multiple {multiple}: CPU loss {c}, device {g}");
            }
            for (name_p, shape, values) in &run.parameters {
                let (_, expected) = params.iter().find(|(n, _)| n == name_p).unwrap();
                assert_eq!(shape.iter().product::<usize>(), expected.len(), "{name_p} comes back unpadded");
                let rel = relative(expected, values);
                assert!(rel <= 1e-4, "multiple {multiple}: `{name_p}` differs by {rel:.2e}");
            }
        }
    }

    /// ZeRO-3 on the device (each bias and weight gathered into a temporary before the op
    /// that reads it) trains like the CPU backend without ZeRO.
    #[test]
    fn tiny_gpt_zero3_on_one_device() {
        let mesh = Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 };
        let (program, spec) = sgd_step_tuned("tiny", "f32", mesh, None, |o| o.zero = 3);
        let run = cuda::train(&program, 0, 2, &corpus(&spec), 3, &Placement::Emulated).unwrap();
        let (losses, params) = cpu("tiny", mesh, 3);
        for (step, (c, g)) in losses.iter().zip(&run.losses).enumerate() {
            assert!((c - g).abs() <= 1e-5 * c.abs(), "step {}: CPU loss {c}, device with ZeRO-3 {g}", step + 1);
        }
        for (name_p, _, values) in &run.parameters {
            let (_, expected) = params.iter().find(|(n, _)| n == name_p).unwrap();
            let rel = relative(expected, values);
            assert!(rel <= 1e-4, "`{name_p}` differs by {rel:.2e} after 3 steps");
        }
    }

    #[test]
    fn tiny_gpt_bf16_against_f32() {
        // bf16 storage (8-bit mantissa), fp32 accumulation: losses within 2%, parameters
        // within bf16's resolution of their scale, and within half the largest update of
        // the f32 CPU's (no training would be off by all of it).
        check("tiny", "bf16", Mesh::default(), 2e-2, 2e-2);
    }

    /// Mixed precision partitioned on the device: fp32 gradient reductions among the ranks
    /// sharing it, and the vocab-parallel loss read from the bf16 logits with its statistics
    /// in fp32.
    #[test]
    fn tiny_llama_bf16_mixed_precision_tensor_and_data_parallel() {
        check("tiny-llama", "bf16", Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, 2e-2, 2e-2);
    }
}

/// The estimate prices the kernels a device plan launches, not the instructions: a fused
/// element-wise kernel or a GEMM with its epilogue is one launch, and the values passed
/// between the instructions it absorbed never go to memory.
#[test]
fn the_estimate_prices_the_kernels_the_device_plan_launches() {
    use shardc_codegen::device::with_device_plan;
    use shardc_codegen::estimate::{estimate, ModelShape};
    use shardc_ir::cluster::Cluster;
    let shape = ModelShape { parameters: 1.0, layers: 1.0, hidden: 1.0, seq: 1.0, tokens_per_step: 1.0 };
    // Every kernel costs its launch (1 s) and nothing else; or its bytes (1 s each) only.
    let mut launches = Cluster::default();
    (launches.gpu.memory_bandwidth, launches.gpu.fp32_flops, launches.gpu.bf16_flops, launches.gpu.kernel_launch) = (f64::INFINITY, f64::INFINITY, f64::INFINITY, 1.0);
    let mut bytes = Cluster::default();
    (bytes.gpu.memory_bandwidth, bytes.gpu.memory_efficiency, bytes.gpu.fp32_flops, bytes.gpu.bf16_flops, bytes.gpu.kernel_launch) = (1.0, 1.0, f64::INFINITY, f64::INFINITY, 0.0);
    for dtype in ["f32", "bf16"] {
        let cpu = train_step("tiny", dtype, Mesh::default(), false);
        let gpu = with_device_plan(cpu.clone()).unwrap();
        let plan = gpu.device.as_ref().unwrap();
        let absorbed = plan.calls.iter().filter(|c| matches!(c.as_slice(), [DeviceCall::Fused { .. }])).count();
        assert!(absorbed > 50, "{dtype}: {absorbed}");
        let seconds = |p: &Program, c: &Cluster| estimate(std::slice::from_ref(p), c, shape).compute_seconds;
        // Each kernel the plan launches is priced one launch: an absorbed instruction is one
        // fewer, an instruction of several kernels (a norm's backward and its second stage)
        // pays for each.
        let kernels = plan.calls.iter().flatten().filter(|c| matches!(c, DeviceCall::Launch { .. } | DeviceCall::Gemm(_) | DeviceCall::GemmEpilogue { .. })).count();
        let several: usize = plan.calls.iter().map(|c| c.iter().filter(|c| matches!(c, DeviceCall::Launch { .. })).count().saturating_sub(1)).sum();
        assert!(several > 5, "{dtype}: {several} launches beyond an instruction's first");
        assert_eq!(seconds(&gpu, &launches), kernels as f64, "{dtype}: the plan launches {kernels} kernels");
        assert_eq!(seconds(&cpu, &launches) - seconds(&gpu, &launches), (absorbed - several) as f64, "{dtype}");
        // And its results, kept on chip, are bytes not moved; what the plan still stores (the
        // pre-activation GELU's gradient reads) is counted.
        let (moved_cpu, moved_gpu) = (seconds(&cpu, &bytes), seconds(&gpu, &bytes));
        assert!(moved_gpu < moved_cpu, "{dtype}: {moved_gpu} of {moved_cpu} bytes");
        let up = gpu.instrs.iter().position(|i| i.op == "xf.matmul" && i.loc.ends_with("layers.0.mlp.up")).unwrap();
        let DeviceCall::GemmEpilogue { gemm, epilogue } = &plan.calls[up][0] else { panic!("{dtype}: the up projection has no epilogue") };
        let size = |b: usize| (gpu.buffers[b].len() * gpu.buffers[b].dtype.bytes()) as f64;
        let mut alone = gpu.clone();
        alone.instrs = vec![gpu.instrs[up].clone()];
        alone.device.as_mut().unwrap().calls = vec![plan.calls[up].clone()];
        let want = size(gemm.a) + size(gemm.b) + size(gemm.c) + size(epilogue.bias.unwrap()) + size(epilogue.aux.unwrap());
        assert_eq!(seconds(&alone, &bytes), want, "{dtype}: the up projection with bias, GELU and its stored pre-activation");
    }
}

/// `memory/GPU` is what the CUDA backend allocates. The executor holds the memory plan's
/// argument slots and arena and the device plan's scratch; the estimate counts the same,
/// except the step's inputs (tokens, targets and the step counter: bytes, not gigabytes),
/// and adds cuBLASLt's workspace, which the device holds once for every executor on it.
#[cfg(feature = "cuda")]
#[test]
fn the_memory_estimate_is_what_the_cuda_backend_allocates() {
    use shardc_runtime::cuda::{CudaExecutor, Placement};
    use shardc_runtime::program::{Role, CUBLASLT_WORKSPACE_BYTES};
    for (dtype, zero) in [("f32", 0), ("bf16", 0), ("bf16", 1)] {
        let mesh = if zero > 0 { Mesh { dp: 2, ..Mesh::default() } } else { Mesh::default() };
        let program = shardc_codegen::device::with_device_plan(train_step_zero("tiny", dtype, mesh, false, zero)).unwrap();
        let estimate = shardc_codegen::estimate::memory(std::slice::from_ref(&program), zero).remove(0);
        let executor = CudaExecutor::new(program.clone(), &Placement::Emulated).unwrap();
        let ranks = program.mesh.iter().product::<usize>().max(1);
        let per_rank = executor.device_bytes() / ranks;
        let inputs: usize = program.args.iter().filter(|a| a.role == Some(Role::Input)).map(|a| program.buffers[a.buffer].len() * program.buffers[a.buffer].dtype.bytes()).sum();
        // The device's cuBLASLt workspace (the emulation has no cuBLASLt to allocate it).
        let lt = CUBLASLT_WORKSPACE_BYTES;
        assert_eq!(estimate.device_scratch, (program.device.as_ref().unwrap().workspace_bytes + lt) as f64, "{dtype}");
        assert_eq!(per_rank as f64, estimate.total - lt as f64 + inputs as f64, "{dtype} ZeRO-{zero}: allocated vs estimated ({estimate:?})");
    }
}

/// The cost model prices attention on tensor cores exactly where the device plan launches
/// the tensor-core kernels: bf16 with a head dim they take, on one whole sequence or a
/// context-parallel rank's part (gathered keys or a ring step); f32 runs the scalar flash
/// kernels.
#[test]
fn attention_is_priced_on_tensor_cores_where_it_runs_on_them() {
    use shardc_ir::ops::{lookup, KernelClass};
    use shardc_passes::sharding::ContextAttention;
    let mut seen = [false; 2];
    for (dtype, mesh, policy) in [
        ("bf16", Mesh::default(), ContextAttention::Auto),
        ("f32", Mesh::default(), ContextAttention::Auto),
        ("bf16", Mesh { cp: 2, ..Mesh::default() }, ContextAttention::AllGather),
        ("bf16", Mesh { cp: 2, ..Mesh::default() }, ContextAttention::Ring),
    ] {
        let mut spec = spec_with_dtype("tiny-llama", dtype);
        // Head dim 16: the smallest the tensor-core kernels take.
        spec.model.hidden = 64;
        spec.training.micro_batch = 2;
        let options = CompileOptions { mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, context_attention: policy, ..Default::default() };
        let program = compiled_step(&spec, &options);
        let plan = device_plan(&program).unwrap();
        let mut attention = 0;
        for (index, instr) in program.instrs.iter().enumerate() {
            let Some(def) = lookup(&instr.op).filter(|_| instr.op.starts_with("xf.attention")) else { continue };
            let inputs: Vec<_> = instr.inputs.iter().map(|&b| shardc_codegen::estimate::buffer_type(&program, b)).collect();
            let refs: Vec<_> = inputs.iter().collect();
            // (A ring's merge of partial results is element-wise.)
            let KernelClass::Attention { tensor_cores, .. } = def.kernel_class(&refs, &shardc_codegen::estimate::instr_attrs(instr)) else { continue };
            let launched = plan.calls[index].iter().any(|c| matches!(c, DeviceCall::Launch { kernel, .. } if kernel.contains("mma")));
            assert_eq!(tensor_cores, launched, "{dtype} {mesh} {policy:?}: {} at {}", instr.op, instr.loc);
            // A context-parallel rank's attention takes the kernels that place it in the sequence.
            let parts = plan.calls[index].iter().all(|c| !matches!(c, DeviceCall::Launch { kernel, .. } if kernel.contains("mma") && kernel.ends_with("_cp") != (mesh.cp > 1)));
            assert!(parts, "{dtype} {mesh} {policy:?}: {} at {}: {:?}", instr.op, instr.loc, plan.calls[index]);
            seen[usize::from(launched)] = true;
            attention += 1;
        }
        assert!(attention >= 4, "{dtype} {mesh} {policy:?}: {attention} attention instructions");
    }
    assert_eq!(seen, [true, true], "both kinds of kernel were checked");
}

/// Runs the one-op function `func` on the CPU backend and on the emulated device from the same
/// `inputs` (name, values): the CPU's and the device's value of its result `result`.
#[cfg(feature = "cuda")]
fn cpu_and_emulated(func: &shardc_ir::graph::Func, inputs: &[(&str, &[f64])], result: &str) -> (Vec<f64>, Vec<f64>) {
    use shardc_runtime::cuda::{CudaExecutor, Placement};
    let program = shardc_codegen::device::with_device_plan(shardc_codegen::lower_func(func).unwrap()).unwrap();
    let mut cpu = shardc_runtime::cpu::CpuExecutor::new(program.clone()).unwrap();
    let mut gpu = CudaExecutor::new(program.clone(), &Placement::Emulated).unwrap();
    for &(name, values) in inputs {
        if program.arg(name).is_some_and(|a| program.buffers[a.buffer].dtype == shardc_runtime::DType::I32) {
            cpu.write(name, &values.iter().map(|&v| v as i32).collect::<Vec<i32>>()).unwrap();
        } else {
            cpu.write_f64(name, values).unwrap();
        }
        gpu.write(0, name, values).unwrap();
    }
    cpu.run().unwrap();
    gpu.run().unwrap();
    (cpu.read_f64(result).unwrap(), gpu.read(0, result).unwrap())
}

/// `xf.sum_leading` on the device sums its rows in chunks, each chunk apart, then the chunks
/// in order: on the emulated device it equals the CPU backend at shapes with several chunks,
/// a ragged last column tile and a ragged last chunk, and with one row.
#[cfg(feature = "cuda")]
#[test]
fn bias_gradients_sum_their_rows_in_chunks_as_the_cpu_does() {
    use shardc_ir::attrs::{AttrValue, Attrs};
    use shardc_ir::graph::{ArgRole, FuncBuilder};
    use shardc_ir::types::{DType, TensorTy};
    for (rows, columns) in [(1000, 70), (4096, 33), (1, 40), (130, 1)] {
        let mut fb = FuncBuilder::new("sum");
        let x = fb.arg("x", TensorTy::new(vec![rows, columns], DType::F32), ArgRole::Input);
        let y = fb.op("xf.sum_leading", &[x], Attrs::new().with("keep", AttrValue::Int(1)), "sum").unwrap();
        let func = fb.finish(&[y], &["y".to_string()]);
        let values: Vec<f64> = (0..rows * columns).map(|i| ((i * 7919 % 1000) as f64 - 500.0) / 250.0).collect();
        let (want, got) = cpu_and_emulated(&func, &[("x", &values)], "y");
        assert_eq!(want.len(), columns as usize);
        for (j, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!((w - g).abs() <= 1e-4 * (1.0 + w.abs()), "[{rows}, {columns}] column {j}: CPU {w}, device {g}");
        }
    }
}

/// `xf.embedding_grad` on the device deals the vocabulary rows to threads by residue: on the
/// emulated device it equals the CPU backend with repeated ids, a vocabulary smaller than the
/// split and one that is not a power of two.
#[cfg(feature = "cuda")]
#[test]
fn embedding_gradients_sum_repeated_ids_as_the_cpu_does() {
    use shardc_ir::attrs::{AttrValue, Attrs};
    use shardc_ir::graph::{ArgRole, FuncBuilder};
    use shardc_ir::types::{DType, TensorTy};
    for (vocab, tokens, hidden) in [(37, 100, 8), (5, 40, 3), (300, 257, 33)] {
        let mut fb = FuncBuilder::new("embed");
        let ids = fb.arg("ids", TensorTy::new(vec![1, tokens], DType::I32), ArgRole::Input);
        let dy = fb.arg("dy", TensorTy::new(vec![1, tokens, hidden], DType::F32), ArgRole::Input);
        let grad = fb.op("xf.embedding_grad", &[ids, dy], Attrs::new().with("vocab", AttrValue::Int(vocab)), "embed").unwrap();
        let func = fb.finish(&[grad], &["grad".to_string()]);
        // Ids repeat (a few rows take many tokens); every row past them stays zero.
        let id_values: Vec<f64> = (0..tokens).map(|t| ((t * t + 3 * t) % vocab.min(29)) as f64).collect();
        let dy_values: Vec<f64> = (0..tokens * hidden).map(|i| ((i * 7919 % 1000) as f64 - 500.0) / 250.0).collect();
        let (want, got) = cpu_and_emulated(&func, &[("ids", &id_values), ("dy", &dy_values)], "grad");
        assert_eq!(want.len(), (vocab * hidden) as usize);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!((w - g).abs() <= 1e-4 * (1.0 + w.abs()), "vocab {vocab}, element {i}: CPU {w}, device {g}");
        }
    }
}

/// The ops that work per head of `[b, s, h * d]` (heads side by side in the features) on the
/// device: `xf.repeat_heads` and `xf.sum_heads` equal the CPU backend exactly, and
/// `xf.rope` and `xf.rope_grad` to rounding, in f32 and bf16, one head and several, odd
/// sequences; rope_grad undoes rope.
#[cfg(feature = "cuda")]
#[test]
fn per_head_ops_read_heads_side_by_side_as_the_cpu_does() {
    use shardc_ir::attrs::{AttrValue, Attrs};
    use shardc_ir::graph::{ArgRole, FuncBuilder};
    use shardc_ir::types::{DType, TensorTy};
    for dtype in [DType::F32, DType::Bf16] {
        for (b, s, heads, d) in [(2, 5, 3, 8), (1, 7, 2, 4), (3, 4, 1, 16)] {
            let what = format!("{dtype:?} [{b}, {s}, {heads} x {d}]");
            let mut fb = FuncBuilder::new("heads");
            let x = fb.arg("x", TensorTy::new(vec![b, s, heads * d], dtype), ArgRole::Input);
            let per_head = |extra: (&str, AttrValue)| Attrs::new().with("head_dim", AttrValue::Int(d)).with(extra.0, extra.1);
            let repeated = fb.op("xf.repeat_heads", &[x], per_head(("times", AttrValue::Int(2))), "repeat").unwrap();
            let summed = fb.op("xf.sum_heads", &[repeated], per_head(("times", AttrValue::Int(2))), "sum").unwrap();
            let rotated = fb.op("xf.rope", &[x], per_head(("theta", AttrValue::Float(100.0))), "rope").unwrap();
            let back = fb.op("xf.rope_grad", &[rotated], per_head(("theta", AttrValue::Float(100.0))), "rope_grad").unwrap();
            let names = ["repeated", "summed", "rotated", "back"].map(String::from);
            let func = fb.finish(&[repeated, summed, rotated, back], &names);
            // Small integers: exact in bf16, so copies and sums must equal the CPU's.
            let values: Vec<f64> = (0..b * s * heads * d).map(|i| (i % 251) as f64 - 125.0).collect();
            for result in ["repeated", "summed"] {
                let (want, got) = cpu_and_emulated(&func, &[("x", &values)], result);
                assert_eq!(want, got, "{what} {result}");
            }
            let (_, summed) = cpu_and_emulated(&func, &[("x", &values)], "summed");
            assert_eq!(summed, values.iter().map(|v| 2.0 * v).collect::<Vec<_>>(), "{what}: sum_heads of repeat_heads is not twice x");
            let tolerance = if dtype == DType::Bf16 { 1e-2 } else { 1e-5 };
            for result in ["rotated", "back"] {
                let (want, got) = cpu_and_emulated(&func, &[("x", &values)], result);
                let scale = want.iter().map(|x| x.abs()).fold(1.0, f64::max);
                assert!(want.iter().zip(&got).all(|(w, g)| (w - g).abs() <= tolerance * scale), "{what} {result}");
                if result == "back" {
                    assert!(want.iter().zip(&values).all(|(w, x)| (w - x).abs() <= tolerance * scale), "{what}: rope_grad does not undo rope");
                }
            }
        }
    }
}

/// LayerNorm and RMSNorm forward and backward on the device, with a warp per row (rows enough
/// to fill a GPU) and with a block per row (few rows): on the emulated device each result
/// equals the CPU backend's.
#[cfg(feature = "cuda")]
#[test]
fn norms_by_warp_and_by_block_equal_the_cpu() {
    use shardc_ir::attrs::{AttrValue, Attrs};
    use shardc_ir::graph::{ArgRole, FuncBuilder};
    use shardc_ir::types::{DType, TensorTy};
    for (rows, n) in [(1100, 40), (6, 300)] {
        for centered in [true, false] {
            let mut fb = FuncBuilder::new("norm");
            let x = fb.arg("x", TensorTy::new(vec![rows, n], DType::F32), ArgRole::Input);
            let gamma = fb.arg("gamma", TensorTy::new(vec![n], DType::F32), ArgRole::Input);
            let dy = fb.arg("dy", TensorTy::new(vec![rows, n], DType::F32), ArgRole::Input);
            let eps = Attrs::new().with("epsilon", AttrValue::Float(1e-5));
            let (forward, backward) = if centered { ("xf.layernorm", "xf.layernorm_grad") } else { ("xf.rmsnorm", "xf.rmsnorm_grad") };
            let mut operands = vec![x, gamma];
            let beta = centered.then(|| fb.arg("beta", TensorTy::new(vec![n], DType::F32), ArgRole::Input));
            operands.extend(beta);
            let y = fb.op(forward, &operands, eps.clone(), "norm").unwrap();
            let grads = fb.op_multi(backward, &[x, gamma, dy], eps, "norm.grad").unwrap();
            let mut results = vec![y];
            results.extend(&grads);
            let names: Vec<String> = ["y", "dx", "dgamma", "dbeta"][..results.len()].iter().map(|s| s.to_string()).collect();
            let func = fb.finish(&results, &names);
            let wave = |len: i64, k: i64| -> Vec<f64> { (0..len).map(|i| (((i * k) % 97) as f64 - 48.0) / 16.0).collect() };
            let (xs, gs, bs, dys) = (wave(rows * n, 31), wave(n, 7), wave(n, 5), wave(rows * n, 13));
            let mut inputs: Vec<(&str, &[f64])> = vec![("x", &xs), ("gamma", &gs), ("dy", &dys)];
            if centered {
                inputs.push(("beta", &bs));
            }
            for name in &names {
                let (want, got) = cpu_and_emulated(&func, &inputs, name);
                let scale = want.iter().fold(1.0f64, |m, w| m.max(w.abs()));
                for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                    assert!((w - g).abs() <= 1e-4 * scale, "{forward} [{rows}, {n}] {name}[{i}]: CPU {w}, device {g}");
                }
            }
        }
    }
}

/// `xf.cross_entropy` and its gradient on `[rows, v]` logits of `dtype` (the loss and its
/// gradient's seed fp32 beside bf16 logits): results `loss` and `grad`.
#[cfg(feature = "cuda")]
fn cross_entropy_func(rows: i64, v: i64, dtype: shardc_ir::types::DType) -> shardc_ir::graph::Func {
    use shardc_ir::attrs::Attrs;
    use shardc_ir::graph::{ArgRole, FuncBuilder};
    use shardc_ir::types::{DType, TensorTy};
    let mut fb = FuncBuilder::new("ce");
    let logits = fb.arg("logits", TensorTy::new(vec![rows, v], dtype), ArgRole::Input);
    let targets = fb.arg("targets", TensorTy::new(vec![rows], DType::I32), ArgRole::Input);
    let dloss = fb.arg("dloss", TensorTy::scalar(if dtype == DType::Bf16 { DType::F32 } else { dtype }), ArgRole::Input);
    let loss = fb.op("xf.cross_entropy", &[logits, targets], Attrs::new(), "ce").unwrap();
    let grad = fb.op("xf.cross_entropy_grad", &[logits, targets, dloss], Attrs::new(), "ce.grad").unwrap();
    fb.finish(&[loss, grad], &["loss".to_string(), "grad".to_string()])
}

/// A NaN logit makes its row's loss and gradient NaN on the device as on the CPU, wherever it
/// falls among the block's threads: alone in its thread (which then never sees a finite
/// logit), before a larger logit of its thread, after one. The one-pass statistics once
/// dropped the sum of a thread whose logits were all NaN, so the loss stayed finite.
#[cfg(feature = "cuda")]
#[test]
fn a_nan_logit_makes_the_loss_nan_as_on_the_cpu() {
    use shardc_ir::types::DType;
    // Rows of 300 logits over a block of 256 threads: thread t holds t and t + 256 (t < 44),
    // or t alone.
    let (rows, v) = (2i64, 300i64);
    for dtype in [DType::F32, DType::Bf16] {
        let func = cross_entropy_func(rows, v, dtype);
        // (where the NaN goes in row 1, a larger logit it meets in its thread)
        for (at, larger) in [(100usize, None), (0, Some(256usize)), (256, Some(0)), (299, None)] {
            let what = format!("{dtype:?}: NaN at logit {at} of row 1");
            let mut xs: Vec<f64> = (0..rows * v).map(|i| ((i * 37 % 17) as f64 - 8.0) / 4.0).collect();
            xs[v as usize + at] = f64::NAN;
            if let Some(larger) = larger {
                xs[v as usize + larger] = 5.0;
            }
            let inputs: Vec<(&str, &[f64])> = vec![("logits", &xs), ("targets", &[5.0, 7.0]), ("dloss", &[1.0])];
            let (want, got) = cpu_and_emulated(&func, &inputs, "loss");
            assert!(want[0].is_nan() && got[0].is_nan(), "{what}: loss on the CPU {}, on the device {}", want[0], got[0]);
            let (want, got) = cpu_and_emulated(&func, &inputs, "grad");
            let nan = |g: &[f64]| g.iter().map(|x| x.is_nan()).collect::<Vec<_>>();
            assert_eq!(nan(&got), nan(&want), "{what}: where the gradient is NaN");
            // Row 0, which has no NaN, is the CPU's.
            for (i, (w, g)) in want.iter().zip(&got).take(v as usize).enumerate() {
                assert!((w - g).abs() <= 2e-2 * (1.0 + w.abs()), "{what}: grad[{i}]: CPU {w}, device {g}");
            }
        }
    }
}

/// Ring attention's merge of two partial attentions keeps a NaN, on the device and on the
/// CPU: a row's part that saw no key (log-sum-exp -inf) beside a part gone NaN is NaN, not
/// the zero row of a query that sees no key at all (the merges took max(-inf, NaN) = -inf,
/// and a NaN in one ring step left its rows zero). Rows: both parts empty, one empty and one
/// NaN either way, one NaN beside a finite part, one empty beside a finite part.
#[cfg(feature = "cuda")]
#[test]
fn attention_merge_keeps_a_nan_part_as_the_cpu_does() {
    use shardc_ir::attrs::Attrs;
    use shardc_ir::graph::{ArgRole, FuncBuilder};
    use shardc_ir::types::{DType, TensorTy};
    // One sequence of 3 positions, 2 heads of 2: lse rows are [h, s].
    let (s, h, d) = (3i64, 2i64, 2i64);
    let inf = f64::NEG_INFINITY;
    let lse_a = [inf, inf, f64::NAN, 0.5, inf, 0.2];
    let lse_b = [inf, f64::NAN, inf, f64::NAN, 0.3, 0.1];
    // Row (head, position) is NaN where either part is; zero where both are empty.
    let nan_rows: Vec<bool> = lse_a.iter().zip(&lse_b).map(|(a, b)| a.is_nan() || b.is_nan()).collect();
    for dtype in [DType::F32, DType::F64] {
        let mut fb = FuncBuilder::new("merge");
        let out_ty = TensorTy::new(vec![1, s, h * d], dtype);
        let lse_ty = TensorTy::new(vec![1, h, s], dtype);
        let args = [fb.arg("out_a", out_ty.clone(), ArgRole::Input), fb.arg("lse_a", lse_ty.clone(), ArgRole::Input), fb.arg("out_b", out_ty, ArgRole::Input), fb.arg("lse_b", lse_ty, ArgRole::Input)];
        let merged = fb.op_multi("xf.attention_merge", &args, Attrs::new(), "merge").unwrap();
        let func = fb.finish(&merged, &["out".to_string(), "lse".to_string()]);
        let out_a: Vec<f64> = (0..s * h * d).map(|i| 0.1 * i as f64).collect();
        let out_b: Vec<f64> = (0..s * h * d).map(|i| 1.0 - 0.05 * i as f64).collect();
        let inputs: Vec<(&str, &[f64])> = vec![("out_a", &out_a), ("lse_a", &lse_a), ("out_b", &out_b), ("lse_b", &lse_b)];
        for name in ["out", "lse"] {
            let (want, got) = cpu_and_emulated(&func, &inputs, name);
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                // out is [s, h, d]; lse [h, s].
                let row = if name == "out" { (i as i64 / d % h * s + i as i64 / (h * d)) as usize } else { i };
                assert_eq!(w.is_nan(), nan_rows[row], "{dtype:?} {name}[{i}] on the CPU: {w}");
                assert_eq!(g.is_nan(), nan_rows[row], "{dtype:?} {name}[{i}] on the device: {g}");
                if !w.is_nan() {
                    assert!(w == g || (w - g).abs() <= 1e-6 * (1.0 + w.abs()), "{dtype:?} {name}[{i}]: CPU {w}, device {g}");
                }
            }
        }
    }
}

/// Cross-entropy (loss and gradient) with a -inf logit (a masked class) that a thread of the
/// row's block meets before a larger logit (a row longer than the block of 256): the one-pass
/// softmax statistics leave it out as the CPU backend does, so the loss stays finite.
#[cfg(feature = "cuda")]
#[test]
fn cross_entropy_leaves_out_negative_infinite_logits_as_the_cpu_does() {
    use shardc_ir::types::DType;
    let (rows, v) = (2i64, 300i64);
    for dtype in [DType::F32, DType::F64, DType::Bf16] {
        let func = cross_entropy_func(rows, v, dtype);
        let mut xs: Vec<f64> = (0..rows * v).map(|i| ((i * 37 % 17) as f64 - 8.0) / 4.0).collect();
        xs[0] = f64::NEG_INFINITY; // thread 0's first element of row 0
        xs[256] = 3.0; // thread 0's second element of row 0: a larger max
        let inputs: Vec<(&str, &[f64])> = vec![("logits", &xs), ("targets", &[5.0, 7.0]), ("dloss", &[1.0])];
        for name in ["loss", "grad"] {
            let (want, got) = cpu_and_emulated(&func, &inputs, name);
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                assert!((w - g).abs() <= 2e-2 * (1.0 + w.abs()), "{dtype:?} {name}[{i}]: CPU {w}, device {g}");
            }
        }
    }
}
