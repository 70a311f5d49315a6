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
