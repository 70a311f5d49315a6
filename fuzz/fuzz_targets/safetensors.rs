//! safetensors files as the Hugging Face loader reads them (header length, JSON header, data):
//! parsing never panics, and every tensor read has as many values as its shape has elements.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardc_runtime::hf::parse_safetensors;

fuzz_target!(|data: &[u8]| {
    let Ok(tensors) = parse_safetensors(data) else { return };
    for (name, (shape, values)) in &tensors {
        assert_eq!(shape.iter().product::<usize>(), values.len(), "{name}");
    }
});
