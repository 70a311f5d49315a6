//! Bad input never panics: every field of a valid spec is replaced by many wrong or extreme
//! values. Each variant must either be rejected with errors that name a field, or be
//! accepted, lowered and verified (by our verifier and MLIR's): validation never lets through
//! a spec the frontend cannot build.

use shardc_ir::mlir::{emit, IrContext};
use shardc_ir::spec::{parse, Format};
use crate::lower_one;
use shardc_ir::verify;

const VALUES: &[&str] = &[
    "0", "-1", "1", "3", "7", "2147483648", "2147483649", "9223372036854775807", "1e400", "0.5", "-0.0", "nan", "inf",
    "\"x\"", "\"rope\"", "\"rmsnorm\"", "\"swiglu\"", "\"bf16\"", "true", "[]", "{}",
];

#[test]
fn no_field_value_panics_and_accepted_specs_lower() {
    let llama = std::fs::read_to_string(crate::workspace_root().join("models/tiny-llama.toml")).unwrap();
    // The mixture of experts with every one of its fields given.
    let moe = std::fs::read_to_string(crate::workspace_root().join("models/tiny-moe.toml")).unwrap().replace(
        "aux_loss_weight = 0.01",
        "aux_loss_weight = 0.01\nexpert_ffn_hidden = 24\nshared_experts = 1\nfirst_dense = 0\nevery = 1\ncapacity_factor = 1.25",
    );
    let cx = IrContext::new().unwrap();
    for base in [llama, moe] {
    let (mut accepted, mut rejected) = (0, 0);
    for (i, line) in base.lines().enumerate() {
        let Some((key, _)) = line.split_once(" = ") else { continue };
        for value in VALUES {
            let mut lines: Vec<String> = base.lines().map(String::from).collect();
            lines[i] = format!("{key} = {value}");
            let text = lines.join("\n");
            match parse(&text, Format::Toml, "variant.toml") {
                Err(errors) => {
                    rejected += 1;
                    assert!(errors.errors.iter().all(|e| !e.message.is_empty()));
                }
                Ok(spec) => {
                    accepted += 1;
                    let module = lower_one(&spec).unwrap_or_else(|e| panic!("{key} = {value}: accepted but does not lower: {e}"));
                    assert!(verify::verify_module(&module).is_empty(), "{key} = {value}");
                    let mlir = emit(&cx, &module).unwrap();
                    mlir.verify(&cx).unwrap_or_else(|e| panic!("{key} = {value}: {e}"));
                }
            }
        }
    }
    assert!(accepted > 20 && rejected > 100, "accepted {accepted}, rejected {rejected}");
    }
}

#[test]
fn arbitrary_bytes_do_not_panic() {
    // A cheap deterministic stream of mangled inputs (xorshift), in both formats.
    let base = std::fs::read_to_string(crate::workspace_root().join("models/tiny.toml")).unwrap();
    let json = serde_json::to_string(&parse(&base, Format::Toml, "t").unwrap()).unwrap();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for (text, format) in [(base.as_str(), Format::Toml), (json.as_str(), Format::Json)] {
        for _ in 0..300 {
            let mut bytes = text.as_bytes().to_vec();
            for _ in 0..1 + next() % 4 {
                let at = (next() % bytes.len() as u64) as usize;
                match next() % 3 {
                    0 => bytes[at] = (next() % 128) as u8,
                    1 => {
                        bytes.remove(at);
                    }
                    _ => bytes.insert(at, b"0123456789-.\"=[]{},:e"[(next() % 21) as usize]),
                }
            }
            let mangled = String::from_utf8_lossy(&bytes);
            if let Ok(spec) = parse(&mangled, format, "mangled") {
                let module = lower_one(&spec).expect("accepted specs lower");
                assert!(verify::verify_module(&module).is_empty());
            }
        }
    }
}
