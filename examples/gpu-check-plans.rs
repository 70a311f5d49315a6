//! Build-machine half of `scripts/gpu-check.sh prepare`: what the staged runtime-only binary
//! (`shardc-gpu`, no compiler) needs beyond `shardc compile --target cuda -o`.
//!
//! ```text
//! cargo run --example gpu-check-plans -- attention --seq S --batch B --heads H --head-dim D
//!     [--kv-heads K] [--causal true|false] [--cp N] [--tag NAME] [--dtype bf16|f32]
//!     (--gpu NAME | --cluster FILE) [--emit DIR]
//! ```
//!
//! * `attention` builds the two one-op programs of attention at that shape (causal unless
//!   `--causal false`; `K` key/value heads, default `H`; files named `attention-sS-` or,
//!   with a tag, `attention-NAME-`)
//!   (`xf.attention` and its backward `xf.attention_grad`, as `shardc calibrate` builds its
//!   kernel programs), writes them with their device plans to `DIR` (with `--emit`), and prints
//!   one JSON object: for each, the program's path (`DIR`'s last component joined with the
//!   file name: relative to the folder that holds `DIR`, where the manifest lies), its FLOPs
//!   (the op registry's cost, as every estimate counts them) and the cluster model's predicted
//!   seconds for one run (`Cluster::op_time`: launch plus the flash-attention block model),
//!   and its FLOPs as FlashAttention's benchmarks count them (`fa_flops`). With `--cp N`
//!   (files `attention-sS-cpN-`) the programs are context parallelism's: each of N ranks
//!   attends from its part of the sequence (zigzag order of 2N chunks, as `--mesh cp=N`
//!   lowers it) to the gathered keys, all N ranks on the one GPU, so FLOPs, FlashAttention's
//!   count and the prediction are the N ranks' together, the whole sequence's work.
//! * `norm --rows R --features N [--dtype bf16|f32] [--rms true] --gpu NAME [--emit DIR]`
//!   builds the one-op programs of a layernorm (rmsnorm with `--rms true`) over `[R, N]` and
//!   its backward, files `norm-NAME-fwd.json` and `-bwd.json`, and prints their entry in the
//!   same form, for `check` to compare with the CPU backend: a row at the edge of the 48 KiB
//!   a block gets without opting in (12288 features in fp32 forward, 6144 backward) is what
//!   the emulated device cannot check.

use std::path::{Path, PathBuf};

use shardc_ir::cluster::Cluster;
use shardc_ir::ops::lookup;
use shardc_ir::{ArgRole, AttrValue, Attrs, DType, FuncBuilder, TensorTy};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("attention") => attention(&args[1..]).map(|entry| println!("{entry}")),
        Some("norm") => norm(&args[1..]).map(|entry| println!("{entry}")),
        _ => Err("usage: gpu-check-plans attention --seq S --batch B --heads H --head-dim D [--dtype bf16|f32] (--gpu NAME | --cluster FILE) [--emit DIR] | norm --rows R --features N [--dtype bf16|f32] [--rms true] --gpu NAME [--emit DIR]".into()),
    };
    if let Err(e) = result {
        eprintln!("gpu-check-plans: {e}");
        std::process::exit(1);
    }
}

/// `attention ARGS`: the manifest entry of one attention shape (see the module comment),
/// the programs written with `--emit DIR`.
pub fn attention(args: &[String]) -> Result<serde_json::Value, String> {
    let mut options = std::collections::HashMap::new();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} wants a value"))?;
        if !matches!(flag.as_str(), "--seq" | "--batch" | "--heads" | "--head-dim" | "--kv-heads" | "--causal" | "--cp" | "--tag" | "--dtype" | "--gpu" | "--cluster" | "--emit") {
            return Err(format!("unknown option {flag}"));
        }
        options.insert(flag.trim_start_matches('-').to_string(), value.clone());
    }
    let number = |name: &str| -> Result<i64, String> {
        let text = options.get(name).ok_or_else(|| format!("--{name} is required"))?;
        text.parse::<i64>().ok().filter(|&n| n > 0).ok_or_else(|| format!("--{name} {text}: not a positive integer"))
    };
    let (seq, batch, heads, head_dim) = (number("seq")?, number("batch")?, number("heads")?, number("head-dim")?);
    let kv_heads = if options.contains_key("kv-heads") { number("kv-heads")? } else { heads };
    if heads % kv_heads != 0 {
        return Err(format!("--kv-heads {kv_heads} must divide --heads {heads}"));
    }
    let causal = match options.get("causal").map_or("true", String::as_str) {
        "true" => true,
        "false" => false,
        other => return Err(format!("--causal {other}: use true or false")),
    };
    let cp = if options.contains_key("cp") { number("cp")? } else { 1 };
    if cp > 1 && seq % (2 * cp) != 0 {
        return Err(format!("--cp {cp}: the sequence of {seq} must split into {} equal chunks (two a rank, in zigzag order)", 2 * cp));
    }
    let stem = match options.get("tag") {
        Some(tag) if !tag.is_empty() && tag.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') => format!("attention-{tag}"),
        Some(tag) => return Err(format!("--tag {tag}: use letters, digits and dashes")),
        None if cp > 1 => format!("attention-s{seq}-cp{cp}"),
        None => format!("attention-s{seq}"),
    };
    let dtype = match options.get("dtype").map_or("bf16", String::as_str) {
        "bf16" => DType::Bf16,
        "f32" => DType::F32,
        other => return Err(format!("--dtype {other}: use bf16 or f32")),
    };
    let cluster = match (options.get("gpu"), options.get("cluster")) {
        (Some(gpu), None) => Cluster::preset(gpu).ok_or_else(|| format!("--gpu {gpu}: use one of {}", shardc_ir::cluster::GPU_PRESETS.join(", ")))?,
        (None, Some(file)) => Cluster::from_toml(&std::fs::read_to_string(file).map_err(|e| format!("--cluster {file}: {e}"))?).map_err(|e| format!("--cluster {file}: {e}"))?,
        _ => return Err("give one of --gpu NAME and --cluster FILE".into()),
    };
    let emit = options.get("emit").map(PathBuf::from);
    // Heads side by side in the features, as the model's projections make them.
    let width = |h: i64| h.checked_mul(head_dim).ok_or_else(|| format!("--heads {h} x --head-dim {head_dim} is too large"));
    // A context-parallel rank's queries are its part; its keys are gathered whole.
    let q = TensorTy::new([batch, seq / cp, width(heads)?], dtype);
    let kv = TensorTy::new([batch, seq, width(kv_heads)?], dtype);
    let mut attrs = Attrs::new().with("causal", AttrValue::Bool(causal)).with("scale", AttrValue::Float(1.0 / (head_dim as f64).sqrt())).with("head_dim", AttrValue::Int(head_dim));
    if cp > 1 {
        attrs = attrs.with("xf.seq_split_axes", AttrValue::axes(&[shardc_ir::mesh::CP_AXIS as u16])).with(shardc_ir::ops::ZIGZAG_ATTR, AttrValue::Ints(vec![2 * cp, seq]));
    }
    let mut out = serde_json::Map::new();
    // The forward's row statistics (its log-sum-exp), which the backward reads.
    let forward = lookup("xf.attention").ok_or("no xf.attention in the registry")?.infer(&[&q, &kv, &kv], &attrs)?;
    let lse = forward[1].clone();
    for (key, short, op, types) in [("forward", "fwd", "xf.attention", vec![q.clone(), kv.clone(), kv.clone()]), ("backward", "bwd", "xf.attention_grad", vec![q.clone(), kv.clone(), kv.clone(), q.clone(), lse, q.clone()])] {
        // Backward: q, k, v, the forward's output and log-sum-exp, and the output's gradient.
        let (flops, seconds) = price(&cluster, op, &types, &attrs)?;
        let (flops, seconds) = (flops * cp as f64, seconds * cp as f64);
        let file = format!("{stem}-{short}.json");
        // FlashAttention's benchmarks count 4 b h s^2 d forward (two products), halved when
        // causal, and 2.5 times that backward: published rates use this count.
        let forward_fa = 4.0 * (batch * heads * seq * seq * head_dim) as f64 * if causal { 0.5 } else { 1.0 };
        let fa_flops = if key == "forward" { forward_fa } else { 2.5 * forward_fa };
        let mut entry = serde_json::json!({ "flops": flops, "predicted_seconds": seconds, "fa_flops": fa_flops });
        if let Some(dir) = &emit {
            std::fs::create_dir_all(dir).map_err(|e| format!("--emit {}: {e}", dir.display()))?;
            let mut program = one_op_program(op, &types, &attrs)?;
            if cp > 1 {
                // Every rank of the cp group on this GPU, one after another.
                program.mesh = vec![1, 1, 1, cp as usize];
            }
            std::fs::write(dir.join(&file), serde_json::to_string(&program).map_err(|e| e.to_string())?).map_err(|e| format!("--emit {}: {e}", dir.display()))?;
            let relative = dir.file_name().map_or_else(|| PathBuf::from(&file), |d| Path::new(d).join(&file));
            entry["program"] = serde_json::json!(relative);
        }
        out.insert(key.to_string(), entry);
    }
    let heads_text = if kv_heads == heads { format!("{heads} heads") } else { format!("{heads} heads ({kv_heads} kv)") };
    let dims = format!("b={batch}, {heads_text} of {head_dim}, {}{}", if causal { "causal, " } else { "" }, if dtype == DType::Bf16 { "bf16" } else { "f32" });
    let parts = if cp > 1 { format!(" cp={cp}") } else { String::new() };
    out.insert("name".into(), serde_json::json!(format!("attention fwd+bwd s={seq}{parts} ({dims})")));
    out.insert("gpu".into(), serde_json::json!(cluster.gpu.name));
    Ok(serde_json::Value::Object(out))
}

/// `norm ARGS`: the check entry of one norm shape (see the module comment).
pub fn norm(args: &[String]) -> Result<serde_json::Value, String> {
    let mut options = std::collections::HashMap::new();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} wants a value"))?;
        if !matches!(flag.as_str(), "--rows" | "--features" | "--dtype" | "--rms" | "--gpu" | "--emit") {
            return Err(format!("unknown option {flag}"));
        }
        options.insert(flag.trim_start_matches('-').to_string(), value.clone());
    }
    let number = |name: &str| -> Result<i64, String> {
        let text = options.get(name).ok_or_else(|| format!("--{name} is required"))?;
        text.parse::<i64>().ok().filter(|&n| n > 0).ok_or_else(|| format!("--{name} {text}: not a positive integer"))
    };
    let (rows, features) = (number("rows")?, number("features")?);
    let (dtype, short) = match options.get("dtype").map_or("f32", String::as_str) {
        "bf16" => (DType::Bf16, "bf16"),
        "f32" => (DType::F32, "f32"),
        other => return Err(format!("--dtype {other}: use bf16 or f32")),
    };
    let op = match options.get("rms").map_or("false", String::as_str) {
        "true" => "rmsnorm",
        "false" => "layernorm",
        other => return Err(format!("--rms {other}: use true or false")),
    };
    let gpu = options.get("gpu").ok_or("--gpu NAME is required")?;
    let cluster = Cluster::preset(gpu).ok_or_else(|| format!("--gpu {gpu}: use one of {}", shardc_ir::cluster::GPU_PRESETS.join(", ")))?;
    let (x, weight) = (TensorTy::new([rows, features], dtype), TensorTy::new([features], dtype));
    let attrs = Attrs::new().with("epsilon", AttrValue::Float(1e-5));
    let forward_inputs = if op == "layernorm" { vec![x.clone(), weight.clone(), weight.clone()] } else { vec![x.clone(), weight.clone()] };
    let stem = format!("norm-{op}-{rows}x{features}-{short}");
    let mut out = serde_json::Map::new();
    for (key, part, name, types) in [("forward", "fwd", format!("xf.{op}"), forward_inputs), ("backward", "bwd", format!("xf.{op}_grad"), vec![x.clone(), weight.clone(), x.clone()])] {
        let (flops, seconds) = price(&cluster, &name, &types, &attrs)?;
        let file = format!("{stem}-{part}.json");
        let mut entry = serde_json::json!({ "flops": flops, "predicted_seconds": seconds });
        if let Some(dir) = options.get("emit").map(PathBuf::from) {
            std::fs::create_dir_all(&dir).map_err(|e| format!("--emit {}: {e}", dir.display()))?;
            let program = one_op_program(&name, &types, &attrs)?;
            std::fs::write(dir.join(&file), serde_json::to_string(&program).map_err(|e| e.to_string())?).map_err(|e| format!("--emit {}: {e}", dir.display()))?;
            let relative = dir.file_name().map_or_else(|| PathBuf::from(&file), |d| Path::new(d).join(&file));
            entry["program"] = serde_json::json!(relative);
        }
        out.insert(key.to_string(), entry);
    }
    out.insert("name".into(), serde_json::json!(format!("{op} fwd+bwd [{rows}, {features}] {short}")));
    out.insert("gpu".into(), serde_json::json!(cluster.gpu.name));
    Ok(serde_json::Value::Object(out))
}

/// FLOPs (the registry's cost) and the cluster's predicted seconds of one `op` on `types`.
fn price(cluster: &Cluster, op: &str, types: &[TensorTy], attrs: &Attrs) -> Result<(f64, f64), String> {
    let def = lookup(op).ok_or_else(|| format!("no op `{op}` in the registry"))?;
    let refs: Vec<&TensorTy> = types.iter().collect();
    let outputs = def.infer(&refs, attrs).map_err(|e| format!("{op}: {e}"))?;
    Ok((def.cost(&refs, &outputs, attrs).flops, cluster.op_time(def, &refs, &outputs, attrs)))
}

/// A program of one `op` on inputs of `types`, with its device plan.
fn one_op_program(op: &str, types: &[TensorTy], attrs: &Attrs) -> Result<shardc_runtime::Program, String> {
    let mut fb = FuncBuilder::new("attention");
    let inputs: Vec<_> = types.iter().enumerate().map(|(i, t)| fb.arg(&format!("in{i}"), t.clone(), ArgRole::Input)).collect();
    let results = fb.op_multi(op, &inputs, attrs.clone(), "gpu-check").map_err(|e| format!("{op}: {e}"))?;
    let names: Vec<String> = (0..results.len()).map(|i| format!("out{i}")).collect();
    let program = shardc_codegen::lower_func(&fb.finish(&results, &names)).map_err(|e| format!("{op}: {e}"))?;
    shardc_codegen::device::with_device_plan(program).map_err(|e| format!("{op}: {e}"))
}
