//! Hugging Face `config.json`: mapping to a spec (and back) never panics; what it accepts
//! passes or fails the spec check with an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardc_ir::spec::hf::{from_hf_config, to_hf_config};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok((spec, _)) = from_hf_config(text, "fuzz", 128, 1) {
        let _ = shardc_ir::spec::check(&spec);
        let _ = to_hf_config(&spec);
    }
});
