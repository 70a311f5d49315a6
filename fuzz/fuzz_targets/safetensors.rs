//! safetensors files as shardc reads them one tensor at a time (`--load`, Hugging Face
//! folders, checkpoint rank files: header length, JSON header, data): parsing never panics,
//! and every tensor read has as many values as its shape has elements.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardc_runtime::tensor_file::tensors_of_bytes;

fuzz_target!(|data: &[u8]| {
    let Ok(tensors) = tensors_of_bytes(data) else { return };
    for (name, shape, values) in &tensors {
        if let Some(values) = values {
            assert_eq!(shape.iter().product::<usize>(), values.len(), "{name}");
        }
    }
});
