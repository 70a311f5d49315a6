//! Rank programs (plan JSON): loading and validating never panic; a program that validates
//! names only buffers, slots and instructions that exist.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardc_runtime::Program;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(program) = Program::from_json(text) {
        if program.validate().is_ok() {
            let _ = program.peak_bytes();
            for instr in &program.instrs {
                for b in instr.inputs.iter().chain(&instr.outputs) {
                    assert!(*b < program.buffers.len());
                }
            }
        }
    }
});
