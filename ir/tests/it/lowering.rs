//! The frontend: snapshots of the lowered tiny models, parameter counts of the shipped specs,
//! and FLOP counts against the published formula.

use shardc_ir::mlir::{print_module, IrContext, PrintStyle};
use crate::lower_one;
use shardc_ir::{verify, ArgRole};

use crate::shipped_spec;

fn lowered_text(name: &str) -> String {
    let module = lower_one(&shipped_spec(name)).unwrap();
    assert!(verify::verify_module(&module).is_empty());
    let cx = IrContext::new().unwrap();
    print_module(&cx, &module, PrintStyle::Plain).unwrap()
}

#[test]
fn tiny_gpt_forward() {
    insta::assert_snapshot!(lowered_text("tiny"));
}

#[test]
fn tiny_llama_forward() {
    insta::assert_snapshot!(lowered_text("tiny-llama"));
}

#[test]
fn parameter_counts_of_shipped_specs() {
    let count = |name: &str| lower_one(&shipped_spec(name)).unwrap().funcs[0].parameter_count();
    // GPT-2 small with tied embeddings, 1024 positions, vocab 50257.
    assert_eq!(count("gpt2-small"), 124_439_808);
    // Llama-7B: untied head, no biases, RMSNorm.
    assert_eq!(count("llama-7b"), 6_738_415_616);
    // The GPT parameter formula of Narayanan et al.: 12 L h^2 (1 + 13/(12h) + (v+s)/(12Lh)).
    let (l, h, v, s) = (96.0f64, 12288.0f64, 50257.0f64, 2048.0f64);
    // The formula leaves out the final LayerNorm (2h parameters), which the model has.
    let formula = 12.0 * l * h * h * (1.0 + 13.0 / (12.0 * h) + (v + s) / (12.0 * l * h));
    assert_eq!(count("gpt3-175b") as f64, (formula + 2.0 * h).round());
}

#[test]
fn layer_structure_is_named() {
    let module = lower_one(&shipped_spec("tiny-llama")).unwrap();
    let forward = &module.funcs[0];
    let names: Vec<&str> = forward.args_with(ArgRole::Param).map(|a| a.name.as_str()).collect();
    assert_eq!(names[0], "embed.tokens.weight");
    assert!(names.contains(&"layers.1.mlp.gate.weight"));
    assert_eq!(names.last(), Some(&"lm_head.weight"));
    let locs: Vec<&str> = forward.ops.iter().map(|o| o.loc.as_str()).collect();
    assert!(locs.contains(&"layers.0.attn.q.rope"));
    assert!(locs.contains(&"layers.1.attn.core"));
    // Grouped-query attention: k has kv_heads = 2 heads of 4 side by side, which the
    // attention reads as they are.
    let k = forward.ops.iter().find(|o| o.loc == "layers.0.attn.k.rope").unwrap();
    assert_eq!(forward.tensor(k.results[0]).unwrap().shape, vec![2, 8, 2 * 4]);
    let core = forward.ops.iter().find(|o| o.loc == "layers.0.attn.core").unwrap();
    assert_eq!(core.attrs.int("head_dim"), Ok(4));
    assert!(!forward.ops.iter().any(|o| o.name.ends_with("_heads")), "a copy between the projections and attention");
}

#[test]
fn forward_flops_match_the_published_formula() {
    // Narayanan et al.: forward FLOPs = 24 B s h^2 L + 4 B s^2 h L + 2 B s h v for a GPT layer
    // with a 4h MLP, counting matmuls only. Our total adds element-wise work on top, which
    // must stay a small fraction.
    let spec = shipped_spec("gpt2-small");
    let forward = &lower_one(&spec).unwrap().funcs[0];
    let (b, s, h, l, v) = (8.0, 1024.0, 768.0, 12.0, 50257.0);
    let matmuls = 24.0 * b * s * h * h * l + 4.0 * b * s * s * h * l + 2.0 * b * s * h * v;
    let ours = forward.cost().flops;
    assert!(ours >= matmuls, "{ours} < {matmuls}");
    assert!((ours - matmuls) / matmuls < 0.02, "element-wise share too large: {ours} vs {matmuls}");
}

#[test]
fn json_and_toml_specs_agree() {
    let toml_spec = shipped_spec("tiny");
    let json = serde_json::to_string_pretty(&toml_spec).unwrap();
    let json_spec = shardc_ir::spec::parse(&json, shardc_ir::spec::Format::Json, "tiny.json").unwrap();
    assert_eq!(toml_spec, json_spec);
}

#[test]
fn bf16_and_f64_specs_lower_and_verify() {
    for dtype in ["bf16", "f64"] {
        let text = std::fs::read_to_string(crate::workspace_root().join("models/tiny-llama.toml")).unwrap();
        let text = text.replace("dtype = \"f32\"", &format!("dtype = \"{dtype}\""));
        let spec = shardc_ir::spec::parse(&text, shardc_ir::spec::Format::Toml, "x.toml").unwrap();
        let module = lower_one(&spec).unwrap();
        let cx = IrContext::new().unwrap();
        let text = print_module(&cx, &module, PrintStyle::Plain).unwrap();
        assert!(text.contains(&format!("x{dtype}>")), "{dtype} missing from the dump");
    }
}
