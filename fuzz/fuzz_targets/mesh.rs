//! Mesh options (`dp=2,tp=4,pp=1`): parsing, and checking a parsed mesh against a model.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardc_ir::mesh::Mesh;

const TINY: &str = include_str!("../../models/tiny-llama.toml");

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(mesh) = Mesh::parse(text) {
        let spec = shardc_ir::spec::parse(TINY, shardc_ir::spec::Format::Toml, "tiny-llama").expect("the shipped spec parses");
        let _ = mesh.check(&spec);
        let _ = mesh.ranks();
    }
});
