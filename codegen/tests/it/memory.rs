//! The memory plan: temporaries share slots, optimizer updates happen in place, and
//! recomputation lowers the peak of temporaries.

use shardc_passes::{compile_pipeline, CompileOptions, Recompute};
use shardc_runtime::Program;

use crate::common::*;

fn train_step(name: &str, recompute: Recompute, seq: u64) -> Program {
    let mut spec = spec_with_dtype(name, "f32");
    spec.training.seq_len = Some(seq);
    spec.model.max_seq = seq;
    let mut module = model(&spec);
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&CompileOptions { recompute, ..Default::default() }).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    shardc_codegen::lower_func(module.func("train_step").unwrap()).unwrap()
}

#[test]
fn temporaries_share_slots() {
    let p = train_step("tiny-llama", Recompute::None, 8);
    p.validate().unwrap();
    assert!(p.memory.temporary_bytes * 2 < p.memory.temporary_bytes_without_reuse, "{:?}", p.memory);
}

#[test]
fn optimizer_updates_in_place() {
    let p = train_step("tiny", Recompute::None, 8);
    for arg in p.args.iter().filter(|a| a.role == Some(shardc_runtime::program::Role::Param)) {
        let result = p.result(&arg.name).unwrap();
        assert_eq!(result.buffer, arg.buffer, "{} is not updated in place", arg.name);
        let m = format!("opt.m.{}", arg.name);
        assert_eq!(p.result(&m).unwrap().buffer, p.arg(&m).unwrap().buffer);
    }
    // Arguments: parameters, two moments each, tokens, targets, step.
    let params: usize = p.args.iter().filter(|a| a.role == Some(shardc_runtime::program::Role::Param)).map(|a| p.buffers[a.buffer].len()).sum();
    assert_eq!(p.memory.argument_bytes, 3 * 4 * params + 2 * 4 * 2 * 8 + 4);
}

#[test]
fn no_two_live_buffers_share_a_slot() {
    // Replays the program and checks that a slot is never overwritten while a buffer in it
    // is still to be read.
    for recompute in [Recompute::None, Recompute::Full] {
        let p = train_step("tiny-llama", recompute, 8);
        let mut last_read = vec![0usize; p.buffers.len()];
        for (i, instr) in p.instrs.iter().enumerate() {
            for &b in &instr.inputs {
                last_read[b] = i;
            }
        }
        for r in &p.results {
            last_read[r.buffer] = usize::MAX;
        }
        let mut holder: Vec<Option<usize>> = vec![None; p.memory.slots.len()];
        for (i, instr) in p.instrs.iter().enumerate() {
            for &b in &instr.outputs {
                let slot = p.buffers[b].slot;
                if let Some(previous) = holder[slot] {
                    assert!(previous == b || last_read[previous] <= i, "instruction {i} overwrites live buffer {previous} in slot {slot}");
                }
                holder[slot] = Some(b);
            }
        }
    }
}

#[test]
fn recomputation_lowers_peak_temporaries() {
    // A longer sequence makes activations dominate.
    let none = train_step("tiny-llama", Recompute::None, 16).memory.temporary_bytes;
    let full = train_step("tiny-llama", Recompute::Full, 16).memory.temporary_bytes;
    assert!(full < none, "full recompute {full} B, none {none} B");
}

#[test]
fn running_a_program_never_clobbers_its_inputs() {
    // In-place ops may write into an argument only as its own update; @forward has none.
    let spec = spec_with_dtype("tiny", "f64");
    let forward = model(&spec).funcs.remove(0);
    let mut exec = executor(&forward);
    init_params(&mut exec, 3, 2);
    let tokens: Vec<i32> = (0..16).map(|i| i * 7 % 256).collect();
    exec.write::<i32>("tokens", &tokens).unwrap();
    exec.write::<i32>("targets", &tokens).unwrap();
    let before: Vec<Vec<f64>> = exec.args_with(shardc_runtime::program::Role::Param).iter().map(|(n, _)| exec.read::<f64>(n).unwrap().to_vec()).collect();
    exec.run().unwrap();
    let first = exec.read::<f64>("loss").unwrap()[0];
    exec.run().unwrap();
    assert_eq!(first.to_bits(), exec.read::<f64>("loss").unwrap()[0].to_bits());
    let after: Vec<Vec<f64>> = exec.args_with(shardc_runtime::program::Role::Param).iter().map(|(n, _)| exec.read::<f64>(n).unwrap().to_vec()).collect();
    assert_eq!(before, after);
}

/// Temporaries that one instruction sees alive together (each from its first writer to its
/// last reader), by an independent walk of the program.
fn live_together(p: &Program) -> Vec<(usize, usize, usize)> {
    let args: std::collections::HashSet<usize> = p.args.iter().map(|a| a.buffer).collect();
    let mut first = std::collections::HashMap::new();
    let mut last = std::collections::HashMap::new();
    for (i, instr) in p.instrs.iter().enumerate() {
        for &b in instr.outputs.iter().filter(|b| !args.contains(b)) {
            first.entry(b).or_insert(i);
            last.insert(b, i.max(*last.get(&b).unwrap_or(&0)));
        }
        for &b in instr.inputs.iter().filter(|b| !args.contains(b)) {
            last.insert(b, i.max(*last.get(&b).unwrap_or(&0)));
        }
    }
    for r in &p.results {
        if !args.contains(&r.buffer) {
            last.insert(r.buffer, p.instrs.len());
        }
    }
    first.into_iter().map(|(b, f)| (b, f, last[&b])).collect()
}

/// The arena plan places every temporary so that two alive at one instruction never share
/// memory, and its size is within 10% of the live-set bound (the most bytes alive at one
/// instruction) for the shipped specs at several meshes and for the configuration Megatron-LM
/// trained a 1.7B GPT with (hidden 2304, 24 layers, sequence 2048, micro-batch 16, full
/// recomputation, 32 data-parallel ranks), where the old slot plan needed 1.9x the bound.
#[test]
fn the_arena_plan_is_sound_and_near_the_live_set_bound() {
    use shardc_ir::mesh::Mesh;
    let compile = |spec: shardc_ir::spec::Spec, mesh: Mesh, recompute: Recompute| -> Program {
        let mut module = model(&spec);
        let options = CompileOptions { recompute, mesh, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, comm_opt: false, ..Default::default() };
        let cx = shardc_ir::mlir::IrContext::new().unwrap();
        compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
        let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
        shardc_codegen::lower_func_on(module.func("train_step").unwrap(), &grid).unwrap()
    };
    let mut cases: Vec<(String, Program)> = Vec::new();
    for name in ["tiny", "tiny-llama", "gpt2-small"] {
        for (mesh, recompute) in [(Mesh::default(), Recompute::None), (Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, Recompute::None), (Mesh { dp: 1, tp: 4, pp: 1, cp: 1, ep: 1 }, Recompute::Full)] {
            let mut spec = spec_with_dtype(name, "bf16");
            spec.training.micro_batch = 4;
            spec.training.seq_len = Some(spec.seq_len().min(128));
            cases.push((format!("{name} {mesh} {recompute:?}"), compile(spec, mesh, recompute)));
        }
    }
    let mut big = spec_with_dtype("gpt2-small", "bf16");
    (big.model.hidden, big.model.layers, big.model.heads, big.model.ffn_hidden, big.model.vocab, big.model.max_seq) = (2304, 24, 24, 9216, 51200, 2048);
    (big.training.seq_len, big.training.micro_batch) = (Some(2048), 16 * 32);
    cases.push(("gpt-1.7b dp=32 full recompute".into(), compile(big, Mesh { dp: 32, tp: 1, pp: 1, cp: 1, ep: 1 }, Recompute::Full)));
    for (what, p) in &cases {
        p.validate().unwrap();
        let m = &p.memory;
        assert!(m.live_bound_bytes > 0 && m.arena_bytes >= m.live_bound_bytes, "{what}: {} vs bound {}", m.arena_bytes, m.live_bound_bytes);
        // Greedy by size stays within 10% of the bound; on a program whose temporaries are a
        // few dozen KiB (tiny in bf16 mixed precision: 78.9 KiB against 70.7) one misplaced
        // buffer is more than that, so those get 15%. (Placing in program order packs tiny
        // to 1.004x, but moves a GELU gradient onto storage an instruction before it still
        // reads, which loses its GEMM epilogue: size order is kept.)
        let slack = if m.live_bound_bytes < 1 << 20 { 1.15 } else { 1.10 };
        assert!(m.arena_bytes as f64 <= slack * m.live_bound_bytes as f64, "{what}: the arena is {:.2}x the live-set bound", m.arena_bytes as f64 / m.live_bound_bytes as f64);
        assert_eq!(m.temporary_bytes, m.arena_bytes);
        if p.instrs.len() < 3000 {
            let live = live_together(p);
            for (i, &(a, fa, la)) in live.iter().enumerate() {
                for &(b, fb, lb) in &live[i + 1..] {
                    if fa <= lb && fb <= la {
                        assert_eq!(p.alias(a, b), shardc_runtime::program::Alias::None, "{what}: `{}` and `{}` are alive together but share memory", p.buffers[a].name, p.buffers[b].name);
                    }
                }
            }
        }
    }
}

/// Full recomputation as Megatron does it: of each transformer layer the backward pass keeps
/// only one forward tensor (the layer's output, which is the next layer's input) and
/// recomputes the rest; and no op of the step feeds nothing (the recomputed copy of a layer's
/// last residual add is removed).
#[test]
fn full_recomputation_keeps_one_tensor_per_layer_and_no_dead_ops() {
    for name in ["tiny", "tiny-llama"] {
        let p = train_step(name, Recompute::Full, 8);
        let seed = p.instrs.iter().position(|i| i.loc == "loss.seed").unwrap();
        let args: std::collections::HashSet<usize> = p.args.iter().map(|a| a.buffer).collect();
        let made: std::collections::HashMap<usize, &str> = p.instrs[..seed].iter().flat_map(|i| i.outputs.iter().map(move |&o| (o, i.loc.as_str()))).filter(|(o, _)| !args.contains(o)).collect();
        let kept: std::collections::BTreeSet<&str> = p.instrs[seed..].iter().flat_map(|i| i.inputs.iter()).filter_map(|b| made.get(b).copied()).collect();
        let in_layers: Vec<&&str> = kept.iter().filter(|loc| loc.starts_with("layers.")).collect();
        assert_eq!(in_layers.len(), 2, "{name}: kept {kept:?}");
        assert!(in_layers.iter().all(|loc| loc.ends_with(".mlp.residual")), "{name}: kept {kept:?}");
        let results: std::collections::HashSet<usize> = p.results.iter().map(|r| r.buffer).collect();
        for (i, instr) in p.instrs.iter().enumerate() {
            let read_later = instr.outputs.iter().any(|o| results.contains(o) || p.instrs[i + 1..].iter().any(|later| later.inputs.contains(o)));
            assert!(read_later, "{name}: instruction {i} (`{}` at {}) feeds nothing", instr.op, instr.loc);
        }
    }
}

/// The arena planner's scan as it was first written: list the placed items alive with the
/// new one, sort them by offset and move past each one in the way. Quadratic, and the
/// definition [`shardc_codegen::arena::place`] must match.
fn place_by_scan(items: &[shardc_codegen::arena::Item]) -> (Vec<usize>, usize) {
    let mut placed: Vec<(usize, usize, usize, usize)> = Vec::new();
    let mut offsets = Vec::new();
    let mut arena = 0usize;
    for item in items {
        let mut busy: Vec<(usize, usize)> = placed.iter().filter(|p| p.2 <= item.last && item.first <= p.3).map(|p| (p.0, p.1)).collect();
        busy.sort_unstable();
        let up = |x: usize| x.div_ceil(item.align).saturating_mul(item.align);
        let mut offset = 0usize;
        for &(o, len) in &busy {
            if offset.saturating_add(item.bytes) <= o {
                break;
            }
            offset = offset.max(up(o.saturating_add(len)));
        }
        offsets.push(offset);
        placed.push((offset, item.bytes, item.first, item.last));
        arena = arena.max(offset + item.bytes);
    }
    (offsets, arena)
}

#[test]
fn arena_matches_the_quadratic_scan() {
    use shardc_codegen::arena::{place, Item};
    // A small deterministic generator (xorshift), so failures reproduce.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n) as usize
    };
    // Past 256 instructions the tree is deeper than its complete unions (both paths).
    for case in 0..340 {
        let times = 1 + if case < 300 { next(200) } else { next(6000) };
        let count = 1 + if case < 300 { next(120) } else { next(600) };
        let mut items: Vec<Item> = (0..count)
            .map(|_| {
                let bytes = 16 * (1 + next(if case % 3 == 0 { 4 } else { 400 }) as usize);
                let first = next(times as u64);
                // Some items live long (activations kept for the backward), most briefly.
                let span = if next(4) == 0 { next(times as u64) } else { next(4) };
                let align = if bytes >= 4096 { 256 } else { 16 };
                Item { bytes, first, last: (first + span).min(times - 1), align }
            })
            .collect();
        // The plan places the largest first, earlier ones first among equals.
        items.sort_by(|x, y| y.bytes.cmp(&x.bytes).then(x.first.cmp(&y.first)));
        assert_eq!(place(&items), place_by_scan(&items), "case {case}: {items:?}");
    }
}

/// A plan's gradient bucket regions are checked when it is loaded: a region naming an
/// instruction that is not one of its bucket's asynchronous all-reduces, reaching past the
/// arena, missing a member's output, or overlapping another region is refused.
#[test]
fn edited_bucket_regions_are_refused() {
    use shardc_ir::mesh::Mesh;
    let spec = {
        let mut spec = spec_with_dtype("tiny", "f32");
        spec.training.micro_batch = 4;
        spec
    };
    let options = CompileOptions { mesh: Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, grad_bucket_bytes: 4096, ..Default::default() };
    let program = compiled_step(&spec, &options);
    program.validate().unwrap();
    assert!(program.memory.buckets.len() >= 2, "{} regions", program.memory.buckets.len());
    let refused = |what: &str, edit: &dyn Fn(&mut Program)| {
        let mut p = program.clone();
        edit(&mut p);
        let e = p.validate().expect_err(what).to_string();
        assert!(e.contains("bucket"), "{what}: {e}");
    };
    refused("a member that is not an all-reduce", &|p| p.memory.buckets[0].members[0] = 0);
    refused("a member out of range", &|p| p.memory.buckets[0].members.push(usize::MAX));
    refused("a member twice", &|p| {
        let m = p.memory.buckets[0].members[0];
        p.memory.buckets[0].members.push(m);
    });
    refused("past the arena", &|p| p.memory.buckets[0].offset = p.memory.arena_bytes);
    refused("an overflowing size", &|p| p.memory.buckets[0].bytes = usize::MAX);
    refused("a member outside", &|p| p.memory.buckets[0].bytes = 16);
    refused("overlapping regions", &|p| {
        let first = p.memory.buckets[0].clone();
        p.memory.buckets[1].offset = first.offset;
    });
    refused("no members", &|p| p.memory.buckets[0].members.clear());
    refused("a wait before the last member", &|p| {
        let region = p.memory.buckets[0].clone();
        let first = region.members[0];
        // An instruction before the last member becomes a wait of the bucket.
        p.instrs[first].op = "xf.wait".into();
        p.instrs[first].attrs.insert("xf.bucket".into(), shardc_runtime::program::Attr::Int(region.bucket));
        p.memory.buckets[0].members.remove(0);
        p.memory.buckets[0].offset = p.arena_range(p.instrs[p.memory.buckets[0].members[0]].outputs[0]).unwrap().0;
        p.memory.buckets[0].bytes = region.offset + region.bytes - p.memory.buckets[0].offset;
    });
    refused("regions in a pipeline program", &|p| {
        p.pipeline = Some(shardc_runtime::program::PipelinePlan { rank: 0, ranks: 1, chunks: vec![], kind: shardc_runtime::schedule::Kind::OneFOneB, microbatches: 1, items: vec![] });
    });
}

/// ZeRO's asynchronous reduce-scatters read their input on the communication stream until
/// their bucket's wait: the memory plan keeps every member's input alive until then, and a
/// plan edited so that something overwrites it in flight, that splits another dimension, or
/// that miscounts or never waits for a bucket is refused when loaded.
#[test]
fn async_scatter_inputs_live_until_their_wait_and_edits_are_refused() {
    use shardc_ir::mesh::Mesh;
    use shardc_runtime::program::Attr;
    let mut spec = spec_with_dtype("tiny", "f32");
    spec.training.micro_batch = 4;
    let options = CompileOptions { mesh: Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, zero: 2, grad_bucket_bytes: 4096, ..Default::default() };
    let program = compiled_step(&spec, &options);
    program.validate().unwrap();
    let scatters: Vec<usize> = (0..program.instrs.len()).filter(|&i| program.instrs[i].op == "shard.reduce_scatter" && program.instrs[i].bool("xf.async") == Ok(true)).collect();
    assert!(scatters.len() > 10, "{} async scatters", scatters.len());
    // Independently of the validator: nothing between a member and its bucket's first wait
    // writes storage the member's input occupies.
    for &m in &scatters {
        let bucket = program.instrs[m].int("xf.bucket").unwrap();
        let wait = program.instrs.iter().position(|i| i.op == "xf.wait" && i.int("xf.bucket") == Ok(bucket)).unwrap();
        let input = program.instrs[m].inputs[0];
        for w in m + 1..wait {
            for &o in &program.instrs[w].outputs {
                assert_eq!(program.alias(o, input), shardc_runtime::program::Alias::None, "instruction {w} overwrites the input of {m} in flight");
            }
        }
    }
    let refused = |what: &str, edit: &dyn Fn(&mut Program)| {
        let mut p = program.clone();
        edit(&mut p);
        let e = p.validate().expect_err(what).to_string();
        assert!(e.contains("bucket") || e.contains("asynchronous") || e.contains("do not fit"), "{what}: {e}");
    };
    let first = scatters[0];
    refused("another dimension", &|p| {
        p.instrs[first].attrs.insert("scatter_axis".into(), Attr::Int(1));
    });
    refused("a miscounted bucket", &|p| {
        p.instrs[first].attrs.insert("xf.bucket_members".into(), Attr::Int(99));
    });
    refused("a bucket never waited for", &|p| {
        let bucket = p.instrs[first].int("xf.bucket").unwrap();
        for i in p.instrs.iter_mut().filter(|i| i.op == "xf.wait" && i.int("xf.bucket") == Ok(bucket)) {
            i.attrs.insert("xf.bucket".into(), Attr::Int(-7));
        }
    });
    refused("an input overwritten in flight", &|p| {
        // The next kernel after the member writes into the member's input.
        let input = p.instrs[first].inputs[0];
        let writer = (first + 1..p.instrs.len()).find(|&w| !p.instrs[w].op.starts_with("shard.") && !p.instrs[w].outputs.is_empty()).unwrap();
        let out = p.instrs[writer].outputs[0];
        p.buffers[out].slot = p.buffers[input].slot;
        if let (Some(a), Some(_)) = (p.memory.offsets.get(input).copied().flatten(), p.memory.offsets.get(out)) {
            p.memory.offsets[out] = Some(a);
        }
    });
    refused("a read of the output before the wait", &|p| {
        let output = p.instrs[first].outputs[0];
        let bucket = p.instrs[first].int("xf.bucket").unwrap();
        let wait = p.instrs.iter().position(|i| i.op == "xf.wait" && i.int("xf.bucket") == Ok(bucket)).unwrap();
        let reader = (first + 1..wait).find(|&r| p.instrs[r].op.starts_with("xf.") && !p.instrs[r].inputs.is_empty()).unwrap();
        p.instrs[reader].inputs[0] = output;
    });
    refused("a scatter into a buffer of the wrong size", &|p| {
        let output = p.instrs[first].outputs[0];
        p.instrs[first].outputs[0] = p.instrs[first].inputs[0];
        let _ = output;
    });
    refused("an async op that is not a collective", &|p| {
        let update = p.instrs.iter().position(|i| i.op == "xf.adamw").unwrap();
        p.instrs[update].attrs.insert("xf.async".into(), Attr::Bool(true));
    });
}

/// Scatter buckets hold whole gradients only while in flight, at most two at a time: with
/// small buckets, ZeRO-2 and 3's peak of temporaries stays within three of the largest
/// buckets' inputs of the peak without buckets (where each gradient dies at its own
/// scatter).
#[test]
fn scatter_buckets_hold_whole_gradients_only_while_in_flight() {
    use shardc_ir::mesh::Mesh;
    let mut spec = spec_with_dtype("tiny", "f32");
    spec.training.micro_batch = 4;
    // Enough layers that two buckets in flight are a fraction of every gradient.
    spec.model.layers = 8;
    for zero in [2u8, 3] {
        let peak = |bucket_bytes: u64| {
            let options = CompileOptions { mesh: Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, zero, grad_bucket_bytes: bucket_bytes, ..Default::default() };
            compiled_step(&spec, &options)
        };
        let (plain, bucketed) = (peak(0), peak(2048));
        let mut inputs: std::collections::BTreeMap<i64, usize> = Default::default();
        for i in bucketed.instrs.iter().filter(|i| i.op == "shard.reduce_scatter" && i.bool("xf.async") == Ok(true)) {
            let b = &bucketed.buffers[i.inputs[0]];
            *inputs.entry(i.int("xf.bucket").unwrap()).or_default() += b.len() * b.dtype.bytes();
        }
        assert!(inputs.len() >= 6, "ZeRO-{zero}: {} scatter buckets", inputs.len());
        let largest = inputs.values().max().copied().unwrap();
        let total: usize = inputs.values().sum();
        assert!(3 * largest < total, "ZeRO-{zero}: the bound must be tighter than holding every gradient");
        let (a, b) = (plain.memory.temporary_bytes, bucketed.memory.temporary_bytes);
        assert!(b <= a + 3 * largest, "ZeRO-{zero}: {b} bytes of temporaries with buckets, {a} without, buckets of up to {largest}");
    }
}

/// comm-opt's bucketed pairs (awaited at once, early in the backward) may share storage with
/// the step's gradient buckets, which live to the end of the step: regions that are never
/// alive together are accepted, as the arena placed them (tiny at dp=2, tp=2 overlaps a
/// pair's region with a later bucket's).
#[test]
fn bucket_regions_alive_at_different_times_may_share_storage() {
    use shardc_ir::mesh::Mesh;
    let mut spec = spec_with_dtype("tiny", "f32");
    spec.training.micro_batch = 4;
    let options = CompileOptions { mesh: Mesh { dp: 2, tp: 2, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, ..Default::default() };
    let program = compiled_step(&spec, &options);
    program.validate().unwrap();
    let regions = &program.memory.buckets;
    let shared = regions.iter().enumerate().any(|(k, a)| regions[k + 1..].iter().any(|b| a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes));
    assert!(shared, "no two regions share storage: {regions:?}");
}

/// ZeRO-3's parameter gathers go out ahead of their readers, asynchronously, with at most a
/// bucket's bytes out ahead at once (or the one gather a reader needs, when larger), and
/// the peak of temporaries grows by no more than that.
#[test]
fn parameter_gathers_are_prefetched_within_their_budget() {
    use shardc_ir::mesh::Mesh;
    let mut spec = spec_with_dtype("tiny", "f32");
    spec.training.micro_batch = 4;
    let compile = |bucket_bytes: u64| {
        let options = CompileOptions { mesh: Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 }, vocab: spec.model.vocab as i64, zero: 3, grad_bucket_bytes: bucket_bytes, ..Default::default() };
        compiled_step(&spec, &options)
    };
    let budget = 4096usize;
    let (plain, prefetched) = (compile(0), compile(budget as u64));
    let args: std::collections::HashSet<usize> = prefetched.args.iter().map(|a| a.buffer).collect();
    let gathers: Vec<usize> = (0..prefetched.instrs.len()).filter(|&i| prefetched.instrs[i].op == "shard.all_gather" && args.contains(&prefetched.instrs[i].inputs[0])).collect();
    let asynchronous = gathers.iter().filter(|&&i| prefetched.instrs[i].bool("xf.async") == Ok(true)).count();
    assert!(asynchronous * 2 > gathers.len(), "{asynchronous} of {} parameter gathers asynchronous", gathers.len());
    let bytes = |b: usize| prefetched.buffers[b].len() * prefetched.buffers[b].dtype.bytes();
    let largest = gathers.iter().map(|&i| bytes(prefetched.instrs[i].outputs[0])).max().unwrap();
    // Out ahead: issued, and its wait (the value's first read) not yet reached.
    let mut ahead: Vec<(usize, usize)> = Vec::new();
    for (i, instr) in prefetched.instrs.iter().enumerate() {
        if instr.op == "xf.wait" {
            ahead.retain(|&(out, _)| instr.inputs[0] != out);
        }
        if gathers.contains(&i) && instr.bool("xf.async") == Ok(true) {
            ahead.push((instr.outputs[0], bytes(instr.outputs[0])));
            let total: usize = ahead.iter().map(|a| a.1).sum();
            assert!(total <= budget.max(largest), "instruction {i}: {total} bytes of gathers out ahead");
        }
    }
    let (a, b) = (plain.memory.temporary_bytes, prefetched.memory.temporary_bytes);
    assert!(b <= a + budget.max(largest) * 2, "{b} bytes of temporaries prefetching, {a} without");
}

/// A step that accumulates micro-batches sums whole gradients and reduce-scatters them only
/// in its step section, even under ZeRO-2: the memory estimate counts the sums its plan
/// lists (tiny GPT, dp=2, 4 micro-batches: every gradient whole, in f32), where it used to
/// count ZeRO-2's shards of them.
#[test]
fn accumulated_gradients_are_counted_whole_under_zero_2() {
    let spec = spec_with_dtype("tiny", "f32");
    let mut module = model(&spec);
    let stages = shardc_passes::PipelineOptions { chunks: 1, microbatches: 4, manual: None, split_weight_grads: false };
    let mesh = shardc_ir::mesh::Mesh { dp: 2, tp: 1, pp: 1, cp: 1, ep: 1 };
    let options = CompileOptions { mesh, zero: 2, vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, pipeline: Some(stages), ..Default::default() };
    let cx = shardc_ir::mlir::IrContext::new().unwrap();
    compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).unwrap();
    let schedule = shardc_runtime::schedule::generate(shardc_runtime::schedule::Kind::OneFOneB, 1, 4, 1).unwrap();
    let programs = shardc_codegen::lower_pipeline(&module, &module.grids[0].shape, &schedule).unwrap();
    let estimate = &shardc_codegen::estimate::memory(&programs, 2)[0];
    // 10,944 parameters in f32, whole; ZeRO-2's reduced shards are half of that at dp=2.
    assert!(estimate.gradients >= 10_944.0 * 4.0, "gradient sums {} B", estimate.gradients);
    assert!(estimate.all_gradients <= 0.6 * estimate.gradients, "ZeRO-2's reduced shards {} B", estimate.all_gradients);
    assert!(estimate.total >= estimate.gradients + estimate.parameters + estimate.optimizer, "{estimate:?}");
}

/// The CPU run's memory check counts the working memory of each rank's largest instruction
/// in its peak: tiny-llama's attention backward copies q, its output, their gradients (each
/// `b x s x hidden`), k, v and theirs (`b x s x kv_heads x head_dim`, half as wide) heads
/// first; in bf16 an instruction also widens the bf16 slots it touches to f32, at least the
/// logits the loss reads.
#[test]
fn the_cpu_footprint_counts_the_largest_instructions_working_memory() {
    use shardc_runtime::memory::{cpu_footprint, CpuFootprint};
    for (name, dtype) in [("tiny-llama", "f32"), ("tiny", "bf16")] {
        let spec = spec_with_dtype(name, dtype);
        let program = compiled_step(&spec, &CompileOptions { vocab: spec.model.vocab as i64, kv_heads: spec.model.kv_heads() as i64, ..Default::default() });
        let footprint = cpu_footprint(std::slice::from_ref(&program));
        let (b, s, h) = (spec.training.micro_batch as usize, spec.training.seq_len.unwrap_or(spec.model.max_seq) as usize, spec.model.hidden as usize);
        let kv = h * spec.model.kv_heads() as usize / spec.model.heads as usize;
        let attention = 4 * (4 * b * s * h + 4 * b * s * kv);
        if dtype == "f32" {
            assert!(kv < h, "{name}: grouped-query heads");
            assert_eq!(footprint.scratch, attention as u64, "{name}: the attention backward's copies");
        } else {
            let logits = 4 * b * s * spec.model.vocab as usize;
            assert!(footprint.scratch >= attention.max(logits) as u64, "{name} {dtype}: {} bytes, below the attention's {attention} or the widened logits' {logits}", footprint.scratch);
        }
        let without = CpuFootprint { scratch: 0, ..footprint };
        assert_eq!(footprint.peak(), without.peak() + footprint.scratch, "{name} {dtype}: the peak holds the working memory");
    }
}
