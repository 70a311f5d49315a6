//! Model specs, TOML and JSON: parsing and checking never panic, whatever the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardc_ir::spec::{check, parse, Format};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    for format in [Format::Toml, Format::Json] {
        if let Ok(spec) = parse(text, format, "fuzz") {
            let _ = check(&spec);
        }
    }
});
