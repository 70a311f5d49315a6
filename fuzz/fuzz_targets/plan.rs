//! Plan files as `shardc inspect` reads them (a plan's header and programs, or one rank
//! program): reading never panics, and describing what was read never panics either (no
//! index out of range, no overflow in the byte counts it prints).
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardc_runtime::inspect::{describe, read_plan};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok((_, programs)) = read_plan(text) else { return };
    for program in &programs {
        let _ = describe(program, true);
    }
});
