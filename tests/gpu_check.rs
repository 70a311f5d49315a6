//! The GPU check's two halves on the emulated device (the generated kernels compiled as C++
//! and run on CPU fibers): plans compiled by `shardc compile --target cuda`, pipeline ranks
//! given device plans and attention programs built as `examples/gpu-check-plans.rs` does for
//! `scripts/gpu-check.sh prepare`, and a manifest run by `shardc-gpu check`, `bench` and
//! `table` (the binary's own code, built into this test so it is never a stale copy).
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::process::Command;

#[allow(dead_code)]
#[path = "../runtime/src/bin/shardc-gpu.rs"]
mod shardc_gpu;

#[allow(dead_code)]
#[path = "../examples/gpu-check-plans.rs"]
mod plans;

use shardc_runtime::cuda::Placement;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardc-gpu-check-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("plans")).unwrap();
    dir
}

/// `shardc compile models/tiny.toml ARGS --target cuda -o DIR/plans/NAME.json`.
fn compile(dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    let out = dir.join("plans").join(format!("{name}.json"));
    let status = Command::new(env!("CARGO_BIN_EXE_shardc"))
        .args(["compile", "models/tiny.toml", "--target", "cuda", "--optimizer", "sgd", "--gpu", "h200"])
        .args(args)
        .arg("-o")
        .arg(&out)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    out
}

fn cli(args: &[&str]) -> Result<bool, String> {
    shardc_gpu::cli(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>(), &Placement::Emulated)
}

fn results(dir: &Path, what: &str) -> shardc_gpu::Results {
    serde_json::from_str(&std::fs::read_to_string(dir.join(format!("results-{what}.json"))).unwrap()).unwrap()
}

#[test]
fn gpu_check_runs_pipelines_meshes_and_attention_on_the_emulated_device() {
    let dir = tempdir("manifest");
    std::fs::copy(root().join("data/kjv-genesis-exodus.txt"), dir.join("corpus.txt")).unwrap();
    compile(&dir, "one", &["--lr", "0.1", "--microbatches", "1"]);
    compile(&dir, "dp2tp2", &["--lr", "0.1", "--microbatches", "1", "--mesh", "dp=2,tp=2"]);
    let pp2 = compile(&dir, "pp2", &["--lr", "0.1", "--mesh", "pp=2", "--schedule", "1f1b"]);
    // `compile --target cuda` gives the pipeline ranks their device plans; a plan without
    // them (device code stripped) is refused by name.
    let mut bare: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&pp2).unwrap()).unwrap();
    for program in bare["programs"].as_array_mut().unwrap().iter_mut().filter(|p| !p["pipeline"].is_null()) {
        assert!(!program["device"].is_null(), "compile gave a pipeline rank no device plan");
        program["device"] = serde_json::Value::Null;
    }
    std::fs::write(dir.join("plans/pp2-bare.json"), serde_json::to_string(&bare).unwrap()).unwrap();
    compile(&dir, "one-lr2", &["--lr", "0.2", "--microbatches", "1"]);
    let attention = plans::attention(&["--seq", "40", "--batch", "1", "--heads", "2", "--head-dim", "8", "--gpu", "h200", "--emit"].map(String::from).into_iter().chain([dir.join("plans").display().to_string()]).collect::<Vec<_>>()).unwrap();
    assert_eq!(attention["forward"]["program"], "plans/attention-s40-fwd.json");
    // FLOPs are the registry's: 4 b h s^2 d + 5 b h s^2 forward.
    assert_eq!(attention["forward"]["flops"], 4.0 * 2.0 * 1600.0 * 8.0 + 5.0 * 2.0 * 1600.0);
    assert!(attention["backward"]["predicted_seconds"].as_f64().unwrap() > 0.0);
    // FlashAttention's count: 4 b h s^2 d forward, halved when causal; 2.5 times that backward.
    assert_eq!((attention["forward"]["fa_flops"].as_f64(), attention["backward"]["fa_flops"].as_f64()), (Some(0.5 * 4.0 * 2.0 * 1600.0 * 8.0), Some(2.5 * 0.5 * 4.0 * 2.0 * 1600.0 * 8.0)));

    // Context parallelism over 2 ranks (both on the one device): a rank's 32 queries against
    // the 64 gathered keys in zigzag order, bf16 at head dim 16 (the tensor-core kernels'
    // context-parallel forms), FLOPs and prediction the two ranks' together.
    let cp = plans::attention(&["--seq", "64", "--batch", "1", "--heads", "2", "--head-dim", "16", "--cp", "2", "--gpu", "h200", "--emit"].map(String::from).into_iter().chain([dir.join("plans").display().to_string()]).collect::<Vec<_>>()).unwrap();
    assert_eq!(cp["forward"]["program"], "plans/attention-s64-cp2-fwd.json");
    assert_eq!(cp["forward"]["flops"], 2.0 * (4.0 * 2.0 * 32.0 * 64.0 * 16.0 + 5.0 * 2.0 * 32.0 * 64.0));
    let cp_program: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("plans/attention-s64-cp2-fwd.json")).unwrap()).unwrap();
    assert!(cp_program.to_string().contains("attention_fwd_mma16_cp"), "the cp=2 programs run the context-parallel tensor-core kernels");
    assert!(plans::attention(&["--seq", "60", "--batch", "1", "--heads", "2", "--head-dim", "16", "--cp", "4", "--gpu", "h200"].map(String::from)).unwrap_err().contains("8 equal chunks"));

    // Outputs and gradients against the CPU backend: bf16, grouped-query, not causal, an odd
    // sequence, head dim 16 (the tensor-core kernels on a GPU; their fallback here).
    let attention_check = plans::attention(
        &["--seq", "37", "--batch", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--causal", "false", "--tag", "check-gqa", "--gpu", "h200", "--emit"].map(String::from).into_iter().chain([dir.join("plans").display().to_string()]).collect::<Vec<_>>(),
    )
    .unwrap();
    assert_eq!(attention_check["backward"]["program"], "plans/attention-check-gqa-bwd.json");
    // A norm whose fp32 row cache is GPT-3's 12288 features (48 KiB beside the block sum's
    // scratch: a GPU needs the opt-in), checked the same way.
    let norm_check = plans::norm(&["--rows", "3", "--features", "12288", "--dtype", "f32", "--gpu", "h200", "--emit"].map(String::from).into_iter().chain([dir.join("plans").display().to_string()]).collect::<Vec<_>>()).unwrap();
    assert_eq!(norm_check["forward"]["program"], "plans/norm-layernorm-3x12288-f32-fwd.json");

    let case = |name: &str, program: &str, reference: &str| {
        serde_json::json!({"name": name, "program": format!("plans/{program}.json"), "reference": format!("plans/{reference}.json"), "steps": 2, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3})
    };
    let manifest = |file: &str, cases: Vec<serde_json::Value>, bench: Vec<serde_json::Value>, attention: Vec<serde_json::Value>| {
        let path = dir.join(file);
        std::fs::write(&path, serde_json::json!({"data": "corpus.txt", "cases": cases, "bench": bench, "attention": attention}).to_string()).unwrap();
        path.display().to_string()
    };
    let good = manifest(
        "manifest.json",
        vec![case("tiny f32", "one", "one"), case("tiny f32", "dp2tp2", "dp2tp2"), case("tiny f32", "pp2", "pp2")],
        vec![serde_json::json!({"name": "tiny step", "program": "plans/one.json", "steps": 2}), serde_json::json!({"name": "tiny step unfused", "program": "plans/one.json", "steps": 2, "without_cublaslt": true})],
        vec![attention, cp],
    );
    let mut with_checks: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&good).unwrap()).unwrap();
    with_checks["attention_checks"] = serde_json::json!([attention_check, norm_check]);
    std::fs::write(&good, with_checks.to_string()).unwrap();
    assert_eq!(cli(&["check", &good]), Ok(true));
    let check = results(&dir, "check");
    let cases: Vec<&str> = check.rows.iter().map(|r| r.case.as_str()).collect();
    assert_eq!(cases, ["tiny f32 (1,1,1)", "tiny f32 (2,2,1)", "tiny f32 (1,1,2) 1F1B x4", "attention fwd+bwd s=37 (b=2, 4 heads (2 kv) of 16, bf16)", "layernorm fwd+bwd [3, 12288] f32"], "{check:?}");
    assert!(check.rows[4].measured.starts_with("rel "), "{check:?}");
    assert!(check.rows[3].measured.starts_with("rel "), "{check:?}");
    assert!(check.rows.iter().all(|r| r.ok && r.result.starts_with("match")), "{check:?}");
    assert_eq!(cli(&["bench", &good]), Ok(true));
    let bench = results(&dir, "bench");
    assert_eq!(bench.rows.len(), 4, "{bench:?}");
    // The same plan with the GEMM epilogues unfused (the plain GEMM and the epilogue kernel).
    // Its prediction would be the fused plan's: none is shown.
    assert!(bench.rows[1].case.starts_with("tiny step unfused") && bench.rows[1].measured.ends_with("/step") && bench.rows[1].predicted == "-", "{bench:?}");
    // The plan's own prediction (compiled with --gpu h200) beside the measured step, and the
    // attention row's TFLOP/s.
    assert!(bench.rows[0].predicted.ends_with("ms") && bench.rows[0].result.contains("MFU"), "{bench:?}");
    assert!(bench.rows[2].case.starts_with("attention fwd+bwd s=40") && bench.rows[2].result.contains("TFLOP/s") && bench.rows[2].result.contains("FlashAttention's count"), "{bench:?}");
    let measured: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("bench-measured.json")).unwrap()).unwrap();
    assert!(measured["plans/one.json"].as_f64().unwrap() > 0.0 && measured["plans/attention-s40-bwd.json"].as_f64().unwrap() > 0.0, "{measured}");
    assert!(bench.rows[3].case.starts_with("attention fwd+bwd s=64 cp=2") && bench.rows[3].result.contains("TFLOP/s"), "{bench:?}");
    assert!(measured["plans/attention-s64-cp2-bwd.json"].as_f64().unwrap() > 0.0, "{measured}");
    // The profile times every instruction of a step that puts work on the device: each such
    // instruction of the one-program step once (not one fused into another, nor an
    // allocation), their seconds no more than the step's wall time.
    assert_eq!(cli(&["profile", &good]), Ok(true));
    let profile: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("profile-0.json")).unwrap()).unwrap();
    let instructions = profile["instructions"].as_array().unwrap();
    let step: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("plans/one.json")).unwrap()).unwrap();
    let train_step = step["programs"].as_array().unwrap().iter().find(|p| p["name"] == "train_step").unwrap();
    let working: Vec<&str> = train_step["instrs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(train_step["device"]["calls"].as_array().unwrap())
        .filter(|(i, calls)| i["op"] != "tensor.empty" && calls.as_array().unwrap().iter().any(|c| c["kind"] != "fused"))
        .map(|(i, _)| i["op"].as_str().unwrap())
        .collect();
    assert!(working.len() < train_step["instrs"].as_array().unwrap().len(), "tiny's step fuses element-wise ops");
    assert_eq!(instructions.iter().map(|i| i["op"].as_str().unwrap()).collect::<Vec<_>>(), working);
    let busy: f64 = instructions.iter().map(|i| i["seconds"].as_f64().unwrap()).sum();
    assert!(busy > 0.0 && busy <= profile["wall_seconds"].as_f64().unwrap(), "{busy} {profile}");
    assert!(instructions.iter().any(|i| i["op"] == "xf.matmul" && i["shapes"].as_str().unwrap().contains("->")), "{profile}");
    assert!(!dir.join("profile-1.json").exists(), "the unfused twin of a workload is not profiled again");
    assert_eq!(cli(&["table", &good]), Ok(true));
    // Rows are written as each case finishes: a check stopped by its time limit leaves them
    // without `complete`, and the table says it did not finish.
    let mut partial: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("results-check.json")).unwrap()).unwrap();
    assert_eq!(partial["complete"], true);
    partial["complete"] = false.into();
    std::fs::write(dir.join("results-check.json"), partial.to_string()).unwrap();
    assert_eq!(cli(&["table", &good]), Ok(false));

    // A reference that trains differently (twice the learning rate) is a mismatch, in the
    // table too; a pipeline plan without device plans is refused by name.
    let bad = manifest("bad.json", vec![case("tiny f32", "one", "one-lr2")], vec![], vec![]);
    assert_eq!(cli(&["check", &bad]), Ok(false));
    let row = &results(&dir, "check").rows[0];
    assert!(!row.ok && row.result.contains("MISMATCH") && row.result.contains("gradient"), "{row:?}");
    assert_eq!(cli(&["table", &bad]), Ok(false));
    // A case that cannot run is an error row, and the cases after it still run.
    let bare = manifest("bare.json", vec![case("tiny f32", "pp2-bare", "pp2-bare"), case("tiny f32", "one", "one")], vec![], vec![]);
    assert_eq!(cli(&["check", &bare]), Ok(false));
    let rows = results(&dir, "check").rows;
    let err = &rows[0].result;
    assert!(!rows[0].ok && err.starts_with("ERROR") && err.contains("pipeline_rank0") && err.contains("no device code") && err.contains("--target cuda"), "{err}");
    assert!(rows[1].ok && rows[1].result.starts_with("match"), "{rows:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `shardc-gpu precompile` (what `gpu-check.sh prepare` runs): every distinct module of the
/// plans and one-op programs under the paths it is given, compiled by NVRTC to sm_90 machine
/// code in the cache folder, which a run then reads instead of compiling. A cached cubin is
/// used only for the very source it was compiled from.
#[test]
fn precompile_fills_the_kernel_cache_with_each_module_once() {
    use shardc_runtime::cuda::compile::{precompile, Origin};
    let dir = tempdir("precompile");
    let plan = compile(&dir, "one", &["--lr", "0.1", "--microbatches", "1"]);
    compile(&dir, "one-again", &["--lr", "0.1", "--microbatches", "1"]);
    plans::attention(&["--seq", "40", "--batch", "1", "--heads", "2", "--head-dim", "8", "--gpu", "h200", "--emit"].map(String::from).into_iter().chain([dir.join("plans").display().to_string()]).collect::<Vec<_>>()).unwrap();
    // Something that is not a program is passed over.
    std::fs::write(dir.join("plans/kernels.json"), "[]").unwrap();
    let cache = dir.join("cache");
    let cache_arg = cache.display().to_string();
    match cli(&["precompile", "sm_90", &cache_arg, &dir.join("plans").display().to_string()]) {
        Ok(true) => {}
        Err(e) if e.contains("was not found") && std::env::var("SHARDC_REQUIRE_NVRTC").map_or(true, |v| v != "1") => {
            eprintln!("SKIPPED precompile_fills_the_kernel_cache_with_each_module_once: {e}");
            return;
        }
        other => panic!("{other:?}"),
    }
    let mut cubins: Vec<PathBuf> = std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "cubin")).collect();
    cubins.sort();
    // The two identical plans share one module, and attention's forward and backward another.
    assert_eq!(cubins.len(), 2, "{cubins:?}");
    for cubin in &cubins {
        let bytes = std::fs::read(cubin).unwrap();
        assert_eq!(&bytes[..4], b"\x7fELF", "{} is not machine code", cubin.display());
        assert!(cubin.file_name().unwrap().to_str().unwrap().starts_with("sm_90-"));
    }
    // What a run loads: the plan's module, read back from the folder.
    let value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let step = value["programs"].as_array().unwrap().iter().find(|p| p["name"] == "train_step").unwrap();
    let program = shardc_runtime::Program::from_value(step.clone()).unwrap();
    let source = &program.device.as_ref().unwrap().source;
    assert_eq!(precompile(source, (9, 0), &cache).unwrap(), Origin::Disk);
    // A cached source that differs (a stale or damaged entry under the same name) is not
    // trusted: the module is compiled again and the entry rewritten.
    let stem = cubins.iter().map(|c| c.with_extension("cu")).find(|cu| std::fs::read_to_string(cu).unwrap() == *source).unwrap();
    std::fs::write(&stem, format!("{source}\n// changed")).unwrap();
    assert_eq!(precompile(source, (9, 0), &cache).unwrap(), Origin::Compiled);
    assert_eq!(std::fs::read_to_string(&stem).unwrap(), *source);
    assert_eq!(precompile(source, (9, 0), &cache).unwrap(), Origin::Disk);
    // A damaged cubin beside its very source (cut short) is compiled again and rewritten.
    let cubin = stem.with_extension("cubin");
    let whole = std::fs::read(&cubin).unwrap();
    std::fs::write(&cubin, &whole[..whole.len() - 1]).unwrap();
    assert_eq!(precompile(source, (9, 0), &cache).unwrap(), Origin::Compiled);
    assert_eq!(std::fs::read(&cubin).unwrap(), whole);
    // A cache folder that is a file is refused before any compile.
    let file = dir.join("not-a-folder");
    std::fs::write(&file, "").unwrap();
    let e = cli(&["precompile", "sm_90", &file.display().to_string(), &plan.display().to_string()]).unwrap_err();
    assert!(e.contains("CACHE") && e.contains("not-a-folder"), "{e}");
    // Another architecture is another entry.
    assert_eq!(precompile(source, (8, 0), &cache).unwrap(), Origin::Compiled);
    // Bad input names the fix.
    for arch in ["90", "sm_9", "compute_90", "sm_9x", "sm_99", "sm_00", "sm_1000"] {
        let e = cli(&["precompile", arch, &cache_arg, &plan.display().to_string()]).unwrap_err();
        assert!(e.contains("sm_90"), "{arch}: {e}");
    }
    let e = cli(&["precompile", "sm_90", &cache_arg, &dir.join("plans/kernels.json").display().to_string()]).unwrap_err();
    assert!(e.contains("--target cuda"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `shardc-gpu train` trains a compiled plan as `shardc run --backend cuda` does, and their
/// checkpoints move between them: a GPU machine with no compiler trains from the seed and
/// from `shardc run`'s checkpoint, and `shardc run` resumes from its, each with the losses of
/// the uninterrupted run (dp=2 and two pipeline stages over 4 micro-batches, every rank on
/// the emulated device), and it evaluates as `shardc run` does. Bad options are refused by
/// name.
#[test]
fn shardc_gpu_trains_a_plan_and_its_checkpoints_resume_under_shardc_run() {
    let dir = tempdir("train");
    let data = root().join("data/kjv-genesis-exodus.txt");
    let mesh = ["--mesh", "dp=2,pp=2", "--microbatches", "4"];
    let plan = compile(&dir, "stages", &mesh);
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_shardc"))
            .args(["run", "models/tiny.toml", "--backend", "cuda", "--optimizer", "sgd", "--lr-decay", "constant", "--log-every", "1"])
            .args(mesh)
            .args(extra)
            .current_dir(root())
            .env("SHARDC_GPU_EMULATE", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        text.lines().filter_map(|l| l.strip_prefix("step ")).map(|l| l.to_string()).collect::<Vec<_>>()
    };
    let straight = run(&["--steps", "4"]);
    assert_eq!(straight.len(), 4);
    // shardc-gpu from the seed, then shardc from its checkpoint.
    let from_gpu = dir.join("from-gpu");
    assert_eq!(cli(&["train", plan.to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "2", "--checkpoint", from_gpu.to_str().unwrap()]), Ok(true));
    assert_eq!(run(&["--steps", "4", "--resume", from_gpu.to_str().unwrap()]), straight[2..], "shardc run resumed from shardc-gpu's checkpoint");
    // shardc from the seed, then shardc-gpu from its checkpoint, then shardc again.
    let from_run = dir.join("from-run");
    assert_eq!(run(&["--steps", "1", "--checkpoint", from_run.to_str().unwrap()]), straight[..1]);
    let on = dir.join("on");
    assert_eq!(cli(&["train", plan.to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "2", "--resume", from_run.to_str().unwrap(), "--checkpoint", on.to_str().unwrap()]), Ok(true));
    assert_eq!(run(&["--steps", "4", "--resume", on.to_str().unwrap()]), straight[3..], "shardc-gpu resumed shardc's checkpoint at step 1 and trained to step 3");
    // Evaluated on the device as `shardc run` evaluates: the same validation losses.
    let evaluating = ["--steps", "2", "--eval-every", "1", "--eval-windows", "5"];
    let validation = |lines: Vec<String>| lines.into_iter().filter(|l| l.contains("validation loss")).collect::<Vec<_>>();
    let mut said = Vec::new();
    let trained = shardc_gpu::train_saying(&plan, &[&["--data", data.to_str().unwrap()][..], &evaluating].concat().iter().map(|a| a.to_string()).collect::<Vec<_>>(), &Placement::Emulated, &mut |line| said.push(line));
    assert_eq!(trained, Ok(true));
    let said: Vec<String> = said.into_iter().filter_map(|l| l.strip_prefix("step ").map(str::to_string)).collect();
    assert_eq!(validation(said.clone()).len(), 2, "{said:?}");
    assert_eq!(validation(said), validation(run(&evaluating)), "shardc-gpu train and shardc run evaluate alike");
    for (args, says) in [
        (vec!["--steps", "2"], "--data FILE"),
        (vec!["--data", "x", "--lr", "1"], "unknown option `--lr`"),
        (vec!["--data", "x", "--steps", "two"], "--steps two"),
        (vec!["--data", "x", "--eval-windows", "4"], "only with --eval-every N"),
        (vec!["--data", "x", "--eval-every", "1", "--eval-windows", "0"], "--eval-windows 0"),
    ] {
        let error = cli(&[&["train", plan.to_str().unwrap()][..], &args].concat()).unwrap_err();
        assert!(error.contains(says), "{args:?}: {error}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
