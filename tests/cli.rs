//! End-to-end tests of the `shardc` binary: what a user types, what they see.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn shardc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardc"))
        .args(args)
        .current_dir(root())
        .env("NO_COLOR", "1")
        .output()
        .expect("shardc runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// Feeds `text` to `mlir-opt-22` with our dialect; panics with its complaint if it rejects it.
fn assert_mlir_opt_accepts(text: &str) {
    let mut child = Command::new("mlir-opt-22")
        .arg(format!("--irdl-file={}", root().join("ir/dialect/xf.irdl.mlir").display()))
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mlir-opt-22 not found: run scripts/setup");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "mlir-opt-22 rejected:\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn ir_output_parses_with_mlir_opt() {
    for spec in ["models/tiny.toml", "models/tiny-llama.toml"] {
        for extra in [&[][..], &["--generic"][..], &["--no-locations"][..]] {
            let mut args = vec!["ir", spec];
            args.extend_from_slice(extra);
            let out = shardc(&args);
            assert!(out.status.success(), "{}", stderr(&out));
            assert!(stdout(&out).contains("forward"));
            assert_mlir_opt_accepts(&stdout(&out));
        }
    }
}

/// `compile` says where a GPU runs the step's attention, read from the op registry as the
/// device plan launches it: on tensor cores in bf16 at a head dim they take (context-parallel
/// ranks too), else on CUDA cores with what keeps it there (the element type, the head dim).
#[test]
fn compile_says_where_a_gpu_runs_attention() {
    for (args, says) in [
        (vec!["models/gpt2-small.toml", "--dtype", "bf16"], "24 ops on tensor cores (bf16 with fp32 accumulation)"),
        (vec!["models/gpt2-small.toml"], "24 ops on CUDA cores (f32): tensor cores take bf16 at head dims 16 to 128 in steps of 16"),
        (vec!["models/tiny-llama.toml", "--dtype", "bf16", "--mesh", "cp=2"], "8 ops on CUDA cores (head dim 4)"),
        (vec!["models/llama-7b.toml", "--mesh", "cp=2", "--seq", "8192"], "128 ops on tensor cores (bf16 with fp32 accumulation)"),
        (vec!["models/llama-7b.toml", "--mesh", "cp=2", "--seq", "8192", "--cp-attention", "ring"], "128 ops on tensor cores (bf16 with fp32 accumulation)"),
        (vec!["models/tiny.toml", "--dtype", "f64"], "4 ops on CUDA cores (f64, head dim 4)"),
    ] {
        let out = shardc(&[&["compile", "--microbatches", "1"][..], &args].concat());
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let line = stdout(&out).lines().find(|l| l.trim_start().starts_with("attention ")).map(str::to_string).unwrap_or_default();
        assert!(line.contains(says), "{args:?}: {line}");
    }
}

#[test]
fn compile_prints_a_summary_for_gpt2_small() {
    let out = shardc(&["compile", "models/gpt2-small.toml", "--mesh", "dp=2,tp=4,pp=1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("124,439,808"), "{text}");
    insta::assert_snapshot!(without_timings(&text));
}

/// ZeRO on a dp x tp mesh shards each tensor-parallel shard over dp: at stages 1 and 2 each
/// rank sends what plain data parallelism sends (gradients reduce-scattered, parameters
/// all-gathered, over dp only), ZeRO-3 adds the gathers of each parameter's readers, nothing
/// crosses tp, and the optimizer state per rank halves.
#[test]
fn zero_on_dp_and_tp_sends_what_data_parallelism_sends() {
    let summary = |zero: &str| {
        let out = shardc(&["compile", "models/gpt2-small.toml", "--mesh", "dp=2,tp=2", "--seq", "128", "--micro-batch", "2", "--microbatches", "1", "--zero", zero]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let field = |text: &str, key: &str| text.lines().find_map(|l| l.trim_start().strip_prefix(key)).unwrap_or_else(|| panic!("no `{key}` in {text}")).trim().to_string();
    // "330.6 MiB per training step ..." -> MiB.
    let sent = |text: &str| {
        let line = field(text, "comm/rank");
        let mut words = line.split_whitespace();
        let (n, unit): (f64, &str) = (words.next().unwrap().parse().unwrap(), words.next().unwrap());
        n * match unit {
            "KiB" => 1.0 / 1024.0,
            "MiB" => 1.0,
            "GiB" => 1024.0,
            _ => panic!("unit in {line}"),
        }
    };
    let optimizer = |text: &str| -> f64 { field(text, "memory/GPU").split(", ").find_map(|p| p.strip_prefix("optimizer ")).unwrap().trim_end_matches(" GB").parse().unwrap() };
    let plain = summary("0");
    for zero in ["1", "2", "3"] {
        let text = summary(zero);
        assert!(!field(&text, "comm/rank").contains("tp+dp"), "ZeRO-{zero} communicates across tp: {text}");
        if zero == "3" {
            // Each weight gathered once for the forward (the tied table's lookup and LM head
            // share it) and once for the backward: 1.5x; biases and norms, read only in the
            // forward, 1x. At most ZeRO's 1.5x.
            assert!(sent(&text) > 1.3 * sent(&plain) && sent(&text) <= 1.5 * sent(&plain), "ZeRO-3: {} MiB vs {} MiB", sent(&text), sent(&plain));
        } else {
            assert_eq!(sent(&text), sent(&plain), "ZeRO-{zero}: {text}");
        }
        // 124M parameters' two f32 Adam moments (8 bytes each) over tp=2, then over dp=2 as
        // well.
        assert!((optimizer(&plain) - 0.5).abs() < 0.05 && (optimizer(&text) - optimizer(&plain) / 2.0).abs() < 0.06, "ZeRO-{zero}: {} vs {} GB", optimizer(&text), optimizer(&plain));
    }
}

/// `text` with the wall time of a pass (`saturated, 604 ms;`) replaced by `<ms>`: snapshots
/// hold what is deterministic.
fn without_timings(text: &str) -> String {
    text.lines()
        .map(|line| match line.find(" ms;") {
            Some(end) => {
                let start = line[..end].rfind(' ').map_or(end, |s| s + 1);
                format!("{}<ms>{}", &line[..start], &line[end + 3..])
            }
            None => line.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

#[test]
fn llama_7b_parameter_count_is_printed() {
    let out = shardc(&["compile", "models/llama-7b.toml"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("6,738,415,616"), "{}", stdout(&out));
}

#[test]
fn dump_dir_holds_ir_before_and_after_every_pass() {
    let dir = tempdir("dump");
    let out = shardc(&["compile", "models/tiny.toml", "--microbatches", "1", "--dump-dir", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut files: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    files.sort();
    assert_eq!(files, ["00-input.mlir", "01-verify.mlir", "02-autodiff.mlir", "03-optimizer.mlir"]);
    for file in files {
        assert_mlir_opt_accepts(&std::fs::read_to_string(dir.join(file)).unwrap());
    }
    // Mixed precision, a padded vocabulary and ZeRO on dp x tp: casts, master copies and
    // unpadded shapes parse too, after every pass and with every stage.
    for extra in [&["--mesh", "dp=2,tp=4", "--zero", "1", "--microbatches", "1"][..], &["--mesh", "dp=2,pp=2", "--zero", "1"]] {
        let dir = tempdir("dump-mixed");
        let out = shardc(&[&["compile", "models/tiny.toml", "--dtype", "bf16", "--dump-dir", dir.to_str().unwrap()][..], extra].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        let mut seen = String::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            assert_mlir_opt_accepts(&text);
            seen.push_str(&text);
        }
        for part in ["\"xf.cast\"", "xf.master", "xf.unpadded_shape", "shard.reduce_scatter"] {
            assert!(seen.contains(part) || (part == "xf.unpadded_shape" && !extra.contains(&"dp=2,tp=4")), "{extra:?}: no `{part}` in the dumps");
        }
    }
}

#[test]
fn print_ir_after_named_pass_and_all() {
    let out = shardc(&["compile", "models/tiny.toml", "--print-ir-after=verify"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert_eq!(text.matches("// -----// IR after").count(), 1);
    assert!(text.contains("// -----// IR after verify //----- //"));
    let out = shardc(&["compile", "models/tiny.toml", "--print-ir-after-all"]);
    let text = stdout(&out);
    assert!(text.contains("IR after input") && text.contains("IR after verify"), "{text}");
}

#[test]
fn unknown_pass_name_lists_the_passes() {
    let out = shardc(&["compile", "models/tiny.toml", "--print-ir-after=partition-everything"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("no pass named `partition-everything`") && err.contains("input, verify, autodiff, optimizer"), "{err}");
}

#[test]
fn plan_file_is_written() {
    let dir = tempdir("plan");
    let plan = dir.join("plan.json");
    let out = shardc(&["compile", "models/tiny-llama.toml", "--mesh", "tp=2", "--microbatches", "1", "-o", plan.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(json["format_version"], 1);
    assert_eq!(json["mesh"]["tp"], 2);
    // embed 256*16 + 2 layers * (norms 2*16 + q,out 2*16*16 + k,v 2*16*8 + gate,up,down 3*16*48)
    // + final norm 16 + untied head 16*256.
    assert_eq!(json["summary"]["parameters"], 4096 + 2 * (32 + 512 + 256 + 2304) + 16 + 4096);
    let programs = json["programs"].as_array().unwrap();
    assert_eq!(programs[0]["name"], "train_step");
    assert!(programs[0]["instrs"].as_array().unwrap().len() > 100);
}

#[test]
fn every_invalid_spec_gives_a_one_screen_error_naming_the_field() {
    let dir = root().join("ir/tests/specs");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let out = shardc(&["ir", path.to_str().unwrap()]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{}: {err}", path.display());
        assert!(!err.contains("panicked"), "{err}");
        assert!(err.lines().count() <= 40, "{}: more than one screen:\n{err}", path.display());
        assert!(err.contains("invalid model spec"), "{err}");
        let name = path.file_name().unwrap().to_string_lossy();
        if name.contains("heads_not_dividing_hidden") {
            assert!(err.contains("model.heads") && err.contains("divisible"), "{err}");
        }
    }
}

#[test]
fn spec_error_rendering() {
    let out = shardc(&["ir", "ir/tests/specs/several_errors.toml"]);
    insta::assert_snapshot!(stderr(&out));
}

#[test]
fn invalid_meshes_are_refused_with_the_fix() {
    for (mesh, expect) in [
        ("tp=3", "does not divide the 4 attention heads"),
        ("xp=2", "unknown axis `xp`"),
        ("dp=0", "must be an integer from 1"),
        ("dp=2,dp=2", "given twice"),
        ("pp=9", "exceeds the 6 blocks of the model"),
        ("dp=3", "global batch 8 is not a multiple of micro-batch 2 x dp 3"),
        ("tp", "not of the form axis=size"),
        ("cp=3", "cp=3 does not divide the sequence of 8"),
        ("cp=8", "cp=8 does not divide the sequence of 8"),
    ] {
        let out = shardc(&["compile", "models/tiny.toml", "--mesh", mesh]);
        assert_eq!(out.status.code(), Some(1), "{mesh}");
        let err = stderr(&out);
        assert!(err.contains(expect), "{mesh}: {err}");
        assert!(err.contains("help"), "{mesh}: {err}");
    }
}

#[test]
fn missing_spec_file_is_a_clear_error() {
    let out = shardc(&["ir", "models/does-not-exist.toml"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("cannot read") && err.contains("No such file"), "{err}");
}

#[test]
fn checked_in_dialect_is_current() {
    let out = shardc(&["dialect", "--check", "ir/dialect/xf.irdl.mlir"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Every subcommand is listed under its own summary (`schedule`'s text once sat under `plan`
/// and nothing under `schedule`), and its own help gives an example of it.
#[test]
fn help_explains_each_command_with_an_example() {
    let text = stdout(&shardc(&["--help"]));
    let summaries = [
        ("ir", "Print a spec lowered to MLIR"),
        ("compile", "Run the pass pipeline"),
        ("run", "Train a spec"),
        ("logits", "The logits of a Hugging Face model"),
        ("inspect", "Print a compiled plan"),
        ("bench", "Time a training step"),
        ("calibrate", "Measure this machine's cost-model parameters"),
        ("explain", "List every collective and pipeline transfer"),
        ("plan", "Search every strategy"),
        ("schedule", "Generate a pipeline schedule"),
        ("dialect", "Print the xf dialect's IRDL"),
        ("ops", "List the xf ops"),
    ];
    for (command, summary) in summaries {
        let line = text.lines().find(|l| l.trim_start().starts_with(&format!("{command} "))).unwrap_or_else(|| panic!("`{command}` is not listed: {text}"));
        assert!(line.contains(summary), "`{command}` is listed as `{line}`");
        let help = stdout(&shardc(&[command, "--help"]));
        assert!(help.contains(&format!("Example: shardc {command}")), "{command} --help: {help}");
    }
    let listed = text.lines().skip_while(|l| !l.starts_with("Commands:")).skip(1).take_while(|l| !l.is_empty()).filter(|l| !l.trim_start().starts_with("help ")).count();
    assert_eq!(listed, summaries.len(), "{text}");
    let text = stdout(&shardc(&["compile", "--help"]));
    assert!(text.contains("--dump-dir"), "{text}");
}

/// `bench` times pipelines and meshes whose step has several micro-batches (both failed with
/// "the pipeline produced no @train_step"), says how many it timed, and refuses what it
/// cannot time; `calibrate` refuses the batch options it does not use and a GPU named for
/// the CPU backend.
#[test]
fn bench_and_calibrate_use_or_refuse_their_options() {
    for (mesh, extra, says) in [("dp=2", vec![], "1 micro-batches"), ("pp=2", vec![], "4 micro-batches"), ("dp=2", vec!["--microbatches", "2"], "2 micro-batches"), ("dp=1", vec!["--global-batch", "4"], "2 micro-batches")] {
        let out = shardc(&[&["bench", "models/tiny.toml", "--steps", "1", "--mesh", mesh][..], &extra].concat());
        assert!(out.status.success() && stdout(&out).contains(says), "bench --mesh {mesh} {extra:?}: {}{}", stdout(&out), stderr(&out));
    }
    for (args, says) in [
        (vec!["bench", "models/tiny.toml", "--mesh", "pp=2", "--profile"], "--profile"),
        (vec!["bench", "models/tiny.toml", "--mesh", "dp=2", "--torch", "python3"], "--torch"),
        (vec!["bench", "models/tiny.toml", "--microbatches", "2", "--torch", "python3"], "--torch"),
        (vec!["bench", "models/tiny.toml", "--sequence-parallel"], "--sequence-parallel"),
        (vec!["calibrate", "models/tiny.toml", "--quick", "--global-batch", "8"], "--global-batch"),
        (vec!["calibrate", "models/tiny.toml", "--quick", "--microbatches", "2"], "--microbatches"),
        (vec!["calibrate", "models/tiny.toml", "--quick", "--gpu", "h100-sxm"], "--gpu"),
        (vec!["calibrate", "models/tiny.toml", "--quick", "--lr", "1"], "unexpected argument '--lr'"),
    ] {
        let out = shardc(&args);
        assert!(!out.status.success() && unwrapped(&stderr(&out)).contains(says), "{args:?}: {}", stderr(&out));
    }
}

/// The long options `shardc COMMAND --help` lists.
fn long_options(command: &str) -> Vec<String> {
    let help = stdout(&shardc(&[command, "--help"]));
    let mut options: Vec<String> = help
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("-o, ").or_else(|| l.strip_prefix("-h, ")).unwrap_or(l);
            l.strip_prefix("--").map(|rest| format!("--{}", rest.split([' ', '=']).next().unwrap()))
        })
        .filter(|o| o != "--help" && o != "--version")
        .collect();
    options.sort();
    options.dedup();
    options
}

/// Every option of every command but the two that time things (`bench` and `calibrate`, whose
/// options are `run`'s groups and are tried there) changes what it prints or writes, or is
/// refused by name: none is accepted and ignored (`plan` once took --lr, --zero and
/// --schedule and did nothing with them; `--virtual-stages` without the interleaved schedule
/// and `--lr-decay` without decay steps were dropped). Each option is tried against a base
/// command where it can matter (a mesh with dp and tp, or pipeline stages on a four-layer
/// model); a new option without an entry here fails the test.
#[test]
fn every_option_changes_the_result_or_is_refused() {
    let dir = tempdir("every-option");
    let spec4 = dir.join("tiny4.toml");
    std::fs::write(&spec4, std::fs::read_to_string(root().join("models/tiny.toml")).unwrap().replace("layers = 2", "layers = 4")).unwrap();
    let cluster = dir.join("cluster.toml");
    std::fs::write(&cluster, "preset = \"h200\"\n").unwrap();
    let (spec4, cluster) = (spec4.to_str().unwrap().to_string(), cluster.to_str().unwrap().to_string());
    let out_file = dir.join("out.json");
    let written = |what: &str| dir.join(what).to_str().unwrap().to_string();
    // (command, the base's arguments, options tried on it: (option, its arguments)); files
    // that an option writes are checked to exist instead.
    type Cases = Vec<(&'static str, Vec<String>, Vec<(&'static str, Vec<String>)>)>;
    let v = |args: &[&str]| args.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let out_arg = out_file.to_str().unwrap().to_string();
    // The batch's options on dp=2 (two micro-batches of the spec's global batch of 8).
    let batch_options = vec![("--micro-batch", v(&["--micro-batch", "1"])), ("--global-batch", v(&["--global-batch", "4"])), ("--microbatches", v(&["--microbatches", "1"]))];
    // The model's and the strategy's on dp=2 x tp=2 with one micro-batch (buckets are for
    // steps without accumulation).
    let strategy_options = vec![
        ("--hf", v(&["--hf", "tests/data/hf-tiny-llama"])),
        ("--dtype", v(&["--dtype", "bf16"])),
        ("--seq", v(&["--seq", "4"])),
        ("--recompute", v(&["--recompute", "full"])),
        ("--zero", v(&["--zero", "1"])),
        ("--sequence-parallel", v(&["--sequence-parallel"])),
        ("--grad-bucket-mb", v(&["--grad-bucket-mb", "0"])),
        ("--naive-partition", v(&["--naive-partition"])),
        ("--no-comm-opt", v(&["--no-comm-opt"])),
        ("--cp-attention", v(&["--cp-attention", "ring"])),
    ];
    // The pipeline's, on four layers over two stages.
    let pipeline_options = vec![("--schedule", v(&["--schedule", "gpipe"])), ("--virtual-stages", v(&["--virtual-stages", "2"])), ("--stages", v(&["--stages", "0-0,1-3"]))];
    let mut cases: Cases = vec![];
    let mut compile = strategy_options.clone();
    compile.extend([
        ("--print-ir-after-all", v(&["--print-ir-after-all"])),
        ("--print-ir-after", v(&["--print-ir-after", "input"])),
        ("--target", v(&["--target", "cuda"])),
        ("--optimizer", v(&["--optimizer", "sgd"])),
        ("--lr", v(&["--lr", "0.01"])),
        ("--lr-warmup-steps", v(&["--lr-warmup-steps", "10"])),
        ("--lr-decay", v(&["--lr-decay", "linear"])),
        ("--lr-decay-steps", v(&["--lr-decay-steps", "100"])),
        ("--min-lr", v(&["--min-lr", "0.0001"])),
        ("--clip-grad", v(&["--clip-grad", "0"])),
        ("--gpu", v(&["--gpu", "a100-80g"])),
        ("--cluster", v(&["--cluster", &cluster])),
    ]);
    let one_microbatch = ["models/tiny.toml", "--mesh", "dp=2,tp=2", "--global-batch", "4"];
    let pipelined = [spec4.as_str(), "--mesh", "pp=2", "--microbatches", "4"];
    cases.push(("compile", v(&[&one_microbatch[..], &["-o", &out_arg]].concat()), compile.clone()));
    cases.push(("compile", v(&["models/tiny.toml", "--mesh", "dp=2", "-o", &out_arg]), batch_options.clone()));
    // A step of two micro-batches has no comm-opt, and one pipeline stage no layer ranges
    // to split: each is refused by name. Its gradients go in step buckets of
    // --grad-bucket-mb (0: one collective each), which `explain` and `run` say.
    let on_accumulation = vec![("--grad-bucket-mb", v(&["--grad-bucket-mb", "0"])), ("--no-comm-opt", v(&["--no-comm-opt"])), ("--stages", v(&["--stages", "0-1"]))];
    cases.push(("compile", v(&["models/tiny.toml", "--mesh", "dp=2", "-o", &out_arg]), on_accumulation.clone()));
    cases.push(("explain", v(&["models/tiny.toml", "--mesh", "dp=2"]), on_accumulation.clone()));
    cases.push(("run", v(&["models/tiny.toml", "--steps", "1", "--mesh", "dp=2"]), on_accumulation));
    cases.push(("compile", v(&["models/tiny.toml", "-o", &out_arg]), vec![("--mesh", v(&["--mesh", "tp=2"])), ("--dump-dir", v(&["--dump-dir", &written("dump")])), ("--output", v(&[]))]));
    cases.push(("compile", v(&[&pipelined[..], &["-o", &out_arg]].concat()), pipeline_options.clone()));
    // Context parallelism's attention, where there is context parallelism.
    // (Auto takes the ring for the tiny models: the gathers are the change.)
    let context = ["models/tiny-llama.toml", "--mesh", "cp=2", "--microbatches", "1"];
    cases.push(("compile", v(&[&context[..], &["-o", &out_arg]].concat()), vec![("--cp-attention", v(&["--cp-attention", "all-gather"]))]));
    cases.push(("explain", v(&context), vec![("--cp-attention", v(&["--cp-attention", "all-gather"]))]));
    cases.push(("run", v(&[&context[..], &["--steps", "1", "--log-every", "1"]].concat()), vec![("--cp-attention", v(&["--cp-attention", "all-gather"]))]));
    let (batch_options_run, pipeline_options_run) = (batch_options.clone(), pipeline_options.clone());
    let pipelined_run = [spec4.as_str(), "--steps", "1", "--mesh", "pp=2", "--microbatches", "4"];
    cases.push(("explain", v(&one_microbatch), strategy_options));
    cases.push(("explain", v(&["models/tiny.toml", "--mesh", "dp=2"]), batch_options));
    cases.push(("explain", v(&pipelined), pipeline_options));
    cases.push(("explain", v(&["models/tiny.toml"]), vec![("--mesh", v(&["--mesh", "tp=2"]))]));
    cases.push((
        "plan",
        v(&["models/tiny.toml", "--gpus", "4", "--top", "3"]),
        vec![
            ("--gpus", v(&["--gpus", "8"])),
            ("--gpus-per-node", v(&["--gpus-per-node", "2"])),
            ("--nodes", v(&["--nodes", "2"])),
            ("--top", v(&["--top", "1"])),
            ("--explain", v(&["--explain"])),
            ("--report", v(&["--report", &written("plan.html")])),
            ("--hf", v(&["--hf", "tests/data/hf-tiny-llama"])),
            ("--dtype", v(&["--dtype", "bf16"])),
            ("--seq", v(&["--seq", "4"])),
            ("--micro-batch", v(&["--micro-batch", "2"])),
            ("--global-batch", v(&["--global-batch", "16"])),
            ("--microbatches", v(&["--microbatches", "1"])),
            ("--gpu", v(&["--gpu", "a100-40g"])),
            ("--cluster", v(&["--cluster", &cluster])),
            ("--zero", v(&["--zero", "1"])),
            ("--schedule", v(&["--schedule", "zb-h1"])),
            ("--recompute", v(&["--recompute", "full"])),
            ("--sequence-parallel", v(&["--sequence-parallel", "true"])),
        ],
    ));
    // `run`: the losses, and the lines that say what the run does.
    let data = dir.join("data.txt");
    std::fs::write(&data, "In the beginning God created the heaven and the earth. ".repeat(40)).unwrap();
    let data = data.to_str().unwrap().to_string();
    let (saved, checkpoint) = (written("saved.safetensors"), written("ckpt"));
    let run = |args: &[&str]| v(&[&["--log-every", "1"][..], args].concat());
    // Four steps: a schedule's shape shows from the third loss on.
    let dp2 = ["models/tiny.toml", "--steps", "4", "--mesh", "dp=2", "--global-batch", "4"];
    let mut on_dp2 = vec![
        ("--steps", v(&["--steps", "3"])),
        ("--seed", v(&["--seed", "1"])),
        ("--save", v(&["--save", &saved])),
        ("--load", v(&["--load", &saved])),
        ("--log-every", v(&["--log-every", "2"])),
        ("--backend", v(&["--backend", "cuda"])),
        ("--collectives", v(&["--collectives", "tree"])),
        ("--timeout", v(&["--timeout", "5"])),
        ("--check-numerics", v(&["--check-numerics"])),
        ("--trace", v(&["--trace", &written("trace.json")])),
        ("--checkpoint", v(&["--checkpoint", &checkpoint])),
        ("--save-hf", v(&["--save-hf", &written("hf-out")])),
    ];
    // The Hugging Face test models have 64 ids: they train on ids below 64.
    let ids = dir.join("ids.bin");
    std::fs::write(&ids, (0..4096u16).flat_map(|i| (i * 7 % 64).to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let ids = ids.to_str().unwrap().to_string();
    // (Tensor parallelism's options are tried on tp=2 below.)
    on_dp2.extend(compile.iter().filter(|(o, _)| !o.starts_with("--print-ir") && !["--target", "--hf", "--sequence-parallel", "--naive-partition", "--no-comm-opt"].contains(o)).cloned());
    on_dp2.push(("--hf", v(&["--hf", "tests/data/hf-tiny-llama", "--data", &ids, "--data-format", "u16"])));
    cases.push(("run", run(&dp2), on_dp2));
    cases.push(("run", run(&["models/tiny.toml", "--steps", "5", "--mesh", "dp=2", "--global-batch", "4"]), vec![("--resume", v(&["--resume", &checkpoint]))]));
    cases.push(("run", run(&["models/tiny.toml", "--steps", "5", "--mesh", "dp=2", "--global-batch", "4", "--resume", &checkpoint, "--lr", "0.001"]), vec![("--override-schedule", v(&["--override-schedule"]))]));
    cases.push(("run", run(&["models/tiny.toml", "--steps", "2", "--checkpoint", &written("ckpt2")]), vec![("--checkpoint-every", v(&["--checkpoint-every", "1"]))]));
    cases.push(("run", run(&["models/tiny.toml", "--steps", "1", "--mesh", "tp=2", "--global-batch", "2"]), vec![("--sequence-parallel", v(&["--sequence-parallel"])), ("--naive-partition", v(&["--naive-partition"])), ("--no-comm-opt", v(&["--no-comm-opt"]))]));
    cases.push(("run", run(&["models/tiny.toml", "--steps", "1", "--mesh", "dp=2"]), batch_options_run.clone()));
    cases.push(("run", run(&["models/tiny.toml", "--steps", "1"]), vec![("--mesh", v(&["--mesh", "dp=2"]))]));
    let mut on_pipeline = pipeline_options_run.clone();
    on_pipeline.push(("--trace", v(&["--trace", &written("pipeline-trace.json")])));
    cases.push(("run", run(&pipelined_run), on_pipeline));
    cases.push((
        "run",
        run(&["models/tiny.toml", "--steps", "1", "--data", &data]),
        vec![
            ("--tokenizer", v(&["--tokenizer", &data])),
            ("--eval-fraction", v(&["--eval-fraction", "0.5"])),
            ("--eval-every", v(&["--eval-every", "1"])),
            ("--eval-windows", v(&["--eval-windows", "1", "--eval-every", "1"])),
        ],
    ));
    // Token ids in a `.bin` (read as nanoGPT's uint16), or its bytes read as text.
    cases.push(("run", run(&["models/tiny.toml", "--steps", "1", "--data", &ids]), vec![("--data", v(&["--data", "data/kjv-genesis-exodus.txt"])), ("--data-format", v(&["--data-format", "text"]))]));
    // The other commands' options.
    let plan_file = written("plan.json");
    assert!(shardc(&["compile", "models/tiny.toml", "-o", &plan_file]).status.success());
    cases.push(("ir", v(&["models/tiny.toml"]), vec![("--generic", v(&["--generic"])), ("--no-locations", v(&["--no-locations"]))]));
    cases.push((
        "schedule",
        v(&["--pp", "4", "--microbatches", "8"]),
        vec![
            ("--pp", v(&["--pp", "2"])),
            ("--microbatches", v(&["--microbatches", "4"])),
            ("--schedule", v(&["--schedule", "gpipe"])),
            ("--virtual-stages", v(&["--virtual-stages", "4"])),
            ("--svg", v(&["--svg", &written("schedule.svg")])),
            ("--trace", v(&["--trace", &written("schedule.json")])),
        ],
    ));
    cases.push(("schedule", v(&["--pp", "4", "--microbatches", "8", "--schedule", "interleaved"]), vec![("--virtual-stages", v(&["--virtual-stages", "4"]))]));
    cases.push((
        "logits",
        v(&["--hf", "tests/data/hf-tiny-llama", "--tokens", "1,2,3"]),
        vec![
            ("--tokens", v(&["--tokens", "1,2"])),
            ("--mesh", v(&["--mesh", "tp=2"])),
            ("--output", v(&["-o", &written("logits.json")])),
            ("--hf", v(&["--hf", "tests/data/hf-tiny-gpt2"])),
            ("--dtype", v(&["--dtype", "bf16"])),
        ],
    ));
    cases.push(("inspect", v(&[&plan_file]), vec![("--instrs", v(&["--instrs"]))]));
    cases.push(("dialect", v(&[]), vec![("--check", v(&["--check", "ir/dialect/xf.irdl.mlir"]))]));
    // What a run shows: its status, what it printed, and the file it wrote.
    let result = |command: &str, args: &[String]| -> (bool, String) {
        let _ = std::fs::remove_file(&out_file);
        let out = shardc(&[&[command][..], &args.iter().map(String::as_str).collect::<Vec<_>>()].concat());
        // Without the seconds the search and comm-opt took.
        let file = match std::fs::read_to_string(&out_file).ok().and_then(|f| serde_json::from_str::<serde_json::Value>(&f).ok()) {
            Some(mut plan) => {
                if let Some(c) = plan.pointer_mut("/summary/comm_opt").and_then(|c| c.as_object_mut()) {
                    c.remove("seconds");
                }
                plan.to_string()
            }
            None => String::new(),
        };
        let text = stdout(&out);
        let untimed = |l: &str| -> String {
            if l.starts_with("shardc plan:") {
                return l.rsplit_once(", ").map_or(l, |(a, _)| a).to_string();
            }
            // A number of milliseconds (comm-opt's own time among them) says nothing here.
            let words: Vec<&str> = l.split(' ').collect();
            words.iter().enumerate().filter(|(i, w)| !(w.parse::<f64>().is_ok() && words.get(i + 1).is_some_and(|n| n.starts_with("ms")))).map(|(_, w)| *w).collect::<Vec<_>>().join(" ")
        };
        // A run's measured time and bubble change from run to run.
        let printed = text.lines().filter(|l| !l.starts_with("  time ") && !l.starts_with("  pipeline    measured")).map(untimed).collect::<Vec<_>>().join("\n");
        (out.status.success(), format!("{printed}{}{file}", if out.status.success() { String::new() } else { stderr(&out) }))
    };
    for command in ["compile", "explain", "plan", "run", "ir", "schedule", "logits", "inspect", "dialect", "ops"] {
        let tried: std::collections::BTreeSet<&str> = cases.iter().filter(|c| c.0 == command).flat_map(|c| c.2.iter().map(|(o, _)| *o)).collect();
        let accepted = long_options(command);
        assert_eq!(accepted.iter().map(String::as_str).collect::<std::collections::BTreeSet<_>>(), tried, "`{command}`'s options and the options tried differ");
    }
    for (command, base, options) in &cases {
        let (ok, before) = result(command, base);
        // A resume with another learning rate is refused until --override-schedule.
        let needs_the_option = options.iter().any(|(o, _)| *o == "--override-schedule");
        assert!(ok != needs_the_option, "{command} {base:?}: {}", &before[..before.len().min(2000)]);
        assert!(result(command, base).1 == before, "{command} {base:?} prints something else each time");
        for (option, extra) in options {
            if extra.is_empty() {
                assert!(std::fs::metadata(&out_file).is_ok(), "{command} {option}: nothing written");
                continue;
            }
            let (ok, after) = result(command, &[base.clone(), extra.clone()].concat());
            if let Some(path) = extra.iter().find(|a| a.starts_with(dir.to_str().unwrap()) && !a.ends_with(".toml")) {
                if ok {
                    assert!(std::fs::metadata(path).is_ok(), "{command} {option}: {path} not written: {}", &after[..after.len().min(2000)]);
                } else {
                    assert!(unwrapped(&after).contains(option), "{command} {base:?} {extra:?}: refused without naming {option}: {}", &after[..after.len().min(2000)]);
                }
                continue;
            }
            if ok {
                assert!(before != after, "{command} {base:?}: {option} {extra:?} changes nothing");
            } else {
                assert!(unwrapped(&after).contains(option), "{command} {base:?} {extra:?}: refused without naming {option}: {}", &after[..after.len().min(2000)]);
            }
        }
    }
    // A cluster file names its GPU: --gpu beside it would be ignored, so the two are refused.
    for command in [&["compile", "models/tiny.toml"][..], &["plan", "models/tiny.toml", "--gpus", "2"], &["run", "models/tiny.toml", "--steps", "1"]] {
        let out = shardc(&[command, &["--gpu", "h200", "--cluster", &cluster]].concat());
        assert!(!out.status.success() && stderr(&out).contains("--cluster") && stderr(&out).contains("--gpu"), "{command:?}: {}", stderr(&out));
    }
    // Options of the training step that plan does not take are refused, not ignored.
    for option in ["--lr", "--optimizer", "--no-comm-opt", "--grad-bucket-mb", "--stages", "--virtual-stages"] {
        let out = shardc(&["plan", "models/tiny.toml", "--gpus", "4", option, "1"]);
        assert!(!out.status.success() && stderr(&out).contains(&format!("unexpected argument '{option}'")), "plan {option}: {}", stderr(&out));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `run --help` states the optimizer's defaults: AdamW's betas, epsilon and weight decay
/// (matrices only), as the README does (issue 17).
#[test]
fn run_help_states_the_optimizer_defaults() {
    let help = stdout(&shardc(&["run", "--help"]));
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for default in ["betas 0.9 and 0.95", "epsilon 1e-8", "weight decay 0.1 on matrices only (never on norm scales or biases)", "sgd has no weight decay", "[default: adamw]", "[default: 0.003]", "Default: --lr / 10"] {
        assert!(help.contains(default), "run --help does not state `{default}`: {help}");
    }
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(readme.contains("betas 0.9, 0.95, eps 1e-8, weight decay 0.1 on matrices only: never on norm scales or biases"), "the README states other defaults");
}

/// `--resume` continues a checkpoint and `--load` starts fresh from parameters: both at once
/// is refused, naming both, before any work (issue 17).
#[test]
fn resume_with_load_is_refused_naming_both() {
    let dir = tempdir("resume-load");
    let ckpt = dir.join("ckpt");
    let weights = dir.join("tiny.safetensors");
    let out = shardc(&["run", "models/tiny.toml", "--steps", "2", "--micro-batch", "2", "--checkpoint", ckpt.to_str().unwrap(), "--save", weights.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = shardc(&["run", "models/tiny.toml", "--steps", "4", "--micro-batch", "2", "--resume", ckpt.to_str().unwrap(), "--load", weights.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(err.contains("--load") && err.contains("--resume"), "{err}");
    assert!(!stdout(&out).contains("step 3"), "trained before refusing: {}", stdout(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Options that would change nothing in the run they are given to are refused naming the
/// option, before any work (issue 19's review: each was accepted and ignored).
#[test]
fn options_that_would_change_nothing_are_refused_by_name() {
    let cases: [(&[&str], &str); 13] = [
        (&["run", "models/tiny.toml", "--steps", "1", "--checkpoint-every", "1"], "--checkpoint"),
        (&["run", "--hf", "tests/data/hf-tiny-llama", "--steps", "1", "--load", "x.safetensors"], "both say where the parameters start"),
        (&["run", "models/tiny.toml", "--steps", "1", "--grad-bucket-mb", "5"], "--grad-bucket-mb 5"),
        (&["run", "models/tiny.toml", "--steps", "1", "--eval-windows", "5"], "--eval-windows 5"),
        (&["run", "models/tiny.toml", "--steps", "1", "--data-format", "u16"], "--data-format"),
        (&["run", "models/tiny.toml", "--steps", "1", "--lr-decay-steps", "10", "--lr-decay", "constant"], "--lr-decay-steps: --lr-decay constant"),
        (&["compile", "models/tiny.toml", "--min-lr", "0.001", "--lr-decay", "constant"], "--min-lr: --lr-decay constant"),
        (&["run", "models/tiny.toml", "--hf", "tests/data/hf-tiny-llama", "--steps", "1"], "--hf"),
        (&["compile", "models/tiny.toml", "--zero", "1"], "--zero 1"),
        (&["compile", "models/tiny.toml", "--microbatches", "1", "--schedule", "gpipe"], "--schedule gpipe"),
        (&["run", "models/tiny.toml", "--steps", "1", "--collectives", "tree"], "--collectives tree"),
        (&["run", "models/tiny.toml", "--steps", "1", "--timeout", "5"], "--timeout 5"),
        (&["run", "models/tiny.toml", "--steps", "1", "--zero", "2"], "--zero 2"),
    ];
    for (args, says) in cases {
        let out = shardc(args);
        let err = unwrapped(&stderr(&out));
        assert_eq!(out.status.code().map(|c| c != 0), Some(true), "{args:?} was accepted: {}", stdout(&out));
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!stdout(&out).contains("step 1"), "{args:?} trained before refusing");
    }
    // A CPU run started as one of torchrun's processes would train the whole mesh in each.
    let out = Command::new(env!("CARGO_BIN_EXE_shardc")).args(["run", "models/tiny.toml", "--steps", "1"]).current_dir(root()).env("NO_COLOR", "1").env("RANK", "0").env("WORLD_SIZE", "2").output().unwrap();
    assert!(!out.status.success() && unwrapped(&stderr(&out)).contains("RANK is set (a process of 2)"), "{}", stderr(&out));
    // Where they matter, they are taken.
    for args in [&["compile", "models/tiny.toml", "--mesh", "dp=2", "--zero", "1"][..], &["compile", "models/tiny.toml", "--schedule", "gpipe"], &["run", "models/tiny.toml", "--steps", "2", "--lr-decay", "constant"], &["compile", "models/tiny.toml", "--mesh", "dp=2", "--grad-bucket-mb", "5"], &["compile", "models/tiny.toml", "--grad-bucket-mb", "0"]] {
        let out = shardc(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }
}

fn tempdir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shardc-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}


#[test]
fn run_trains_and_the_loss_falls() {
    let dir = tempdir("run");
    let weights = dir.join("tiny.safetensors");
    let out = shardc(&["run", "models/tiny.toml", "--steps", "60", "--log-every", "20", "--save", weights.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let losses: Vec<f64> = text.lines().filter_map(|l| l.strip_prefix("step ")).map(|l| l.split_whitespace().nth(2).unwrap().parse().unwrap()).collect();
    assert_eq!(losses.len(), 3, "{text}");
    assert!(losses[2] < losses[0], "{text}");
    assert!(text.contains("% lower"), "{text}");
    // Loading the saved parameters resumes from where training stopped: the first loss is
    // far below the untrained one.
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--log-every", "1", "--load", weights.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let resumed: f64 = stdout(&out).lines().find_map(|l| l.strip_prefix("step 1 loss ")).unwrap().trim().parse().unwrap();
    assert!(resumed < 5.0, "resumed at {resumed}");
}

#[test]
fn same_seed_same_loss_curve_from_the_cli() {
    let run = || stdout(&shardc(&["run", "models/tiny-llama.toml", "--steps", "10", "--log-every", "1", "--seed", "3"]));
    let curve = |text: String| text.lines().filter(|l| l.starts_with("step ")).map(String::from).collect::<Vec<_>>();
    let (a, b) = (curve(run()), curve(run()));
    assert_eq!(a.len(), 10);
    assert_eq!(a, b);
}

#[test]
fn run_errors_are_clear() {
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--backend", "tpu"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("unknown backend"), "{}", stderr(&out));
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--load", "Cargo.toml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("safetensors"), "{}", stderr(&out));
    let out = shardc(&["run", "models/tiny.toml", "--lr=-1"]);
    assert!(stderr(&out).contains("--lr must be positive"), "{}", stderr(&out));
    let out = shardc(&["run", "models/tiny.toml", "--seq", "999"]);
    assert!(stderr(&out).contains("seq_len"), "{}", stderr(&out));
    // An override that breaks the spec is refused, not silently adjusted.
    let out = shardc(&["run", "models/tiny.toml", "--micro-batch", "3"]);
    assert_eq!(out.status.code(), Some(1));
    let err = unwrapped(&stderr(&out));
    assert!(err.contains("global_batch (8)") && err.contains("micro_batch (3)"), "{err}");
}

#[test]
fn inspect_shows_programs_and_memory() {
    let dir = tempdir("inspect");
    let plan = dir.join("plan.json");
    let out = shardc(&["compile", "models/tiny.toml", "--microbatches", "1", "-o", plan.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = shardc(&["inspect", plan.to_str().unwrap(), "--instrs"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for expected in ["program @train_step", "program @forward", "peak", "xf.adamw", "without", "layers.1.mlp.down", "live bound", "the plan's peak is 1.00x it"] {
        assert!(text.contains(expected), "missing {expected}:\n{text}");
    }
    let out = shardc(&["inspect", "Cargo.toml"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn a_closed_pipe_ends_quietly() {
    use std::io::Read;
    let mut child = Command::new(env!("CARGO_BIN_EXE_shardc"))
        // Far more output than a pipe buffer holds, so shardc is still writing when it closes.
        .args(["ir", "models/gpt2-small.toml"])
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read a little, then close the pipe, as `| head -1` does.
    let mut first = [0u8; 16];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn partitioned_run_and_explain() {
    let out = shardc(&["run", "models/tiny.toml", "--mesh", "dp=2,tp=2", "--steps", "2", "--log-every", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("4 CPU threads") && text.contains("step 2 loss"), "{text}");
    // The same seed gives the single-device run's first loss.
    let single = stdout(&shardc(&["run", "models/tiny.toml", "--steps", "1", "--log-every", "1"]));
    let first = |t: &str| t.lines().find_map(|l| l.strip_prefix("step 1 loss ")).map(|v| v.trim().parse::<f64>().unwrap()).unwrap();
    assert!((first(&text) - first(&single)).abs() < 1e-5, "{text}\n{single}");

    // ZeRO and sequence parallelism from the command line: still the same first loss.
    let out = shardc(&["run", "models/tiny.toml", "--mesh", "dp=2,tp=2", "--zero", "1", "--sequence-parallel", "--steps", "1", "--log-every", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!((first(&stdout(&out)) - first(&single)).abs() < 1e-5, "{}", stdout(&out));
    // Tree all-reduce: the same loss to within rounding (another summation order).
    let out = shardc(&["run", "models/tiny.toml", "--mesh", "dp=2,tp=2", "--collectives", "tree", "--steps", "1", "--log-every", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!((first(&stdout(&out)) - first(&single)).abs() < 1e-5, "{}", stdout(&out));
    let out = shardc(&["run", "models/tiny.toml", "--mesh", "dp=2", "--zero", "4"]);
    assert!(stderr(&out).contains("no ZeRO stage 4"), "{}", stderr(&out));

    let out = shardc(&["explain", "models/tiny.toml", "--mesh", "tp=2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("cause: partial sum reduced for operand 0 of xf.add `layers.0.attn.out.bias_add`"), "{text}");
    assert!(text.contains("total sent by rank 0"), "{text}");
}

#[test]
fn schedule_command_reports_bubbles_and_writes_pictures() {
    let dir = tempdir("schedule");
    let (svg, trace) = (dir.join("1f1b.svg"), dir.join("1f1b.json"));
    let out = shardc(&["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--svg", svg.to_str().unwrap(), "--trace", trace.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    // (p - 1) / (m + p - 1) = 3 / 11.
    assert!(stdout(&out).contains("bubble      27.3%"), "{}", stdout(&out));
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert_eq!(json["traceEvents"].as_array().unwrap().len(), 4 * 16);
    let out = shardc(&["schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("multiple of stages"), "{}", stderr(&out));
}

/// The issue's 3D run: dp=2, tp=2, pp=2 with 4 micro-batches of 1 sequence per replica gives
/// the single device's loss curve: both take the spec's global batch of 8 sequences per step
/// (the single device as 4 micro-batches of 2).
#[test]
fn three_d_run_matches_the_single_device_curve() {
    let dir = tempdir("pipeline");
    let trace = dir.join("trace.json");
    let steps = "20";
    let out = shardc(&["run", "models/tiny.toml", "--mesh", "dp=2,tp=2,pp=2", "--micro-batch", "1", "--microbatches", "4", "--steps", steps, "--log-every", "1", "--trace", trace.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("8 CPU threads") && text.contains("1F1B schedule") && text.contains("measured bubble"), "{text}");
    let single = stdout(&shardc(&["run", "models/tiny.toml", "--steps", steps, "--log-every", "1"]));
    let curve = |t: &str| -> Vec<f64> { t.lines().filter(|l| l.starts_with("step ")).filter_map(|l| l.split_once(" loss ")).map(|(_, v)| v.trim().parse::<f64>().unwrap()).collect() };
    let (a, b) = (curve(&text), curve(&single));
    assert_eq!(a.len(), 20, "{text}");
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "step {}: {x} vs {y}", step + 1);
    }
    assert!(a[19] < a[0], "the loss falls: {a:?}");
    // The measured trace: one track per pipeline rank, 2 x 4 items each.
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert_eq!(json["traceEvents"].as_array().unwrap().len(), 2 * 8);

    // Other schedules, manual stages, and the errors that name the option to fix.
    let out = shardc(&["run", "models/tiny-llama.toml", "--mesh", "pp=2", "--schedule", "zb-h1", "--stages", "0-0,1-1", "--steps", "1", "--log-every", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = shardc(&["run", "models/tiny.toml", "--mesh", "pp=2", "--stages", "0-1", "--steps", "1"]);
    assert!(stderr(&out).contains("--stages names 1 stages"), "{}", stderr(&out));
    let out = shardc(&["run", "models/tiny.toml", "--mesh", "pp=2", "--schedule", "interleaved", "--microbatches", "3", "--steps", "1"]);
    assert!(stderr(&out).contains("multiple of pp"), "{}", stderr(&out));
    let out = shardc(&["run", "models/tiny.toml", "--mesh", "pp=2", "--schedule", "2f2b", "--steps", "1"]);
    assert!(stderr(&out).contains("unknown schedule"), "{}", stderr(&out));
}

/// The planner on the issue's case: gpt3-175b on 1024 A100-80GB (8 per node), global batch
/// 1536, sequence 2048. Its best plan keeps tensor parallelism inside a node and runs the
/// pipeline across nodes; it prints per-GPU TFLOP/s, explains the winner, and writes a
/// self-contained report.
#[test]
fn plan_picks_tensor_parallelism_in_a_node_and_pipelines_across_nodes() {
    let dir = tempdir("plan");
    let report = dir.join("plan.html");
    let out = shardc(&["plan", "models/gpt3-175b.toml", "--gpus", "1024", "--gpu", "a100-80g", "--global-batch", "1536", "--seq", "2048", "--explain", "--report", report.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let best = text.lines().find(|l| l.trim_start().starts_with("1 ")).unwrap_or_else(|| panic!("{text}"));
    let field = |name: &str| -> u64 { best.split_whitespace().find_map(|w| w.strip_prefix(&format!("{name}="))).unwrap().parse().unwrap() };
    let (tp, pp, dp) = (field("tp"), field("pp"), field("dp"));
    assert_eq!(tp * pp * dp, 1024, "{best}");
    assert!((2..=8).contains(&tp), "tensor parallelism inside a node: {best}");
    assert!(pp > 1 && tp * pp > 8, "the pipeline spans nodes: {best}");
    assert!(text.contains("TFLOP/s") && text.contains("why #1 beats #2"), "{text}");
    let html = std::fs::read_to_string(&report).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>") && html.matches("<svg").count() >= 3, "memory, time and timeline charts");
    // Nothing fits on too few GPUs: a clear error.
    let out = shardc(&["plan", "models/gpt3-175b.toml", "--gpus", "8", "--gpu", "a100-80g"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("no strategy fits"), "{}", stderr(&out));
}

/// Interleaved 1F1B spreads model chunks over pipeline ranks: at pp=1 it is refused with the
/// fix, where its tied embedding's chunks waited on each other until the rank timed out.
#[test]
fn interleaved_schedule_on_one_pipeline_rank_is_refused() {
    let run = ["run", "models/tiny.toml", "--steps", "2", "--schedule", "interleaved", "--clip-grad", "0"];
    let compile = ["compile", "models/tiny.toml", "--schedule", "interleaved", "--clip-grad", "0"];
    for args in [&run[..], &compile[..]] {
        let out = shardc(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}{}", stdout(&out), stderr(&out));
        let err = stderr(&out);
        assert!(err.contains("--schedule interleaved") && err.contains("pp=1") && err.contains("1f1b"), "{args:?}: {err}");
    }
}

/// The optimizer's and the data split's flags are checked before any work, each error
/// naming its flag: `--min-lr` above `--lr` passed with `--lr-decay constant`, and a bad
/// `--eval-fraction` was reported as a `--data` error.
#[test]
fn optimizer_and_split_flags_are_checked_by_name() {
    for (args, says) in [
        (vec!["--clip-grad=-1"], "--clip-grad must be a finite number >= 0, got -1"),
        (vec!["--clip-grad", "nan"], "--clip-grad must be a finite number >= 0, got NaN"),
        (vec!["--clip-grad", "inf"], "--clip-grad must be a finite number >= 0, got inf"),
        (vec!["--lr", "0"], "--lr must be positive"),
        (vec!["--lr", "1e-320"], "--lr 1e-320 is outside the range of f32"),
        (vec!["--clip-grad", "1e-300"], "--clip-grad 1e-300 is outside the range of f32"),
        (vec!["--min-lr", "0.1"], "--min-lr 0.1 is outside 0..=--lr"),
        (vec!["--min-lr", "0.1", "--lr-decay", "constant"], "--min-lr 0.1 is outside 0..=--lr"),
        (vec!["--min-lr", "nan", "--lr-decay", "linear"], "--min-lr NaN is outside 0..=--lr"),
        (vec!["--lr-decay", "bogus"], "--lr-decay: unknown decay `bogus`"),
        (vec!["--lr-warmup-steps", "5", "--lr-decay-steps", "5"], "--lr-decay-steps 5 must exceed --lr-warmup-steps 5"),
        (vec!["--lr-warmup-steps", "2147483648"], "--lr-warmup-steps 2147483648 is more iterations than a step counter holds"),
        (vec!["--eval-fraction", "nan"], "--eval-fraction NaN is not in [0, 1)"),
        (vec!["--eval-fraction", "1"], "--eval-fraction 1 is not in [0, 1)"),
        (vec!["--eval-fraction=-0.5"], "--eval-fraction -0.5 is not in [0, 1)"),
        (vec!["--mesh", "dp=2", "--microbatches", "1", "--grad-bucket-mb", "17592186044416"], "--grad-bucket-mb 17592186044416 is more bytes than a bucket can count"),
    ] {
        let out = shardc(&[&["run", "models/tiny.toml", "--steps", "3"][..], &args].concat());
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stdout(&out));
        assert!(unwrapped(&stderr(&out)).contains(says), "{args:?}: {}", stderr(&out));
    }
    let out = shardc(&["run", "models/tiny.toml", "--steps", "0"]);
    assert!(out.status.code() == Some(1) && unwrapped(&stderr(&out)).contains("--steps 0: the run would train nothing"), "{}", stderr(&out));
}

/// The plan's best configuration, as the command it prints, compiles and trains: the tiny
/// model on 8 ranks of the CPU runtime.
#[test]
fn the_planned_configuration_compiles_and_runs() {
    let out = shardc(&["plan", "models/tiny.toml", "--gpus", "8", "--top", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let command = text.lines().find_map(|l| l.trim().strip_prefix("best as a command: shardc ")).unwrap_or_else(|| panic!("{text}"));
    let args: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(args[0], "run");
    let mut compile = args.clone();
    compile[0] = "compile";
    let out = shardc(&compile);
    assert!(out.status.success(), "{command}: {}", stderr(&out));
    let mut run = args.clone();
    run.extend(["--steps", "2", "--log-every", "1"]);
    let out = shardc(&run);
    assert!(out.status.success(), "{command}: {}", stderr(&out));
    assert!(stdout(&out).contains("step 2 loss"), "{}", stdout(&out));
}

/// Without a GPU (as on CI), `--backend cuda` ends with one line saying why, and a failure
/// status; built without the `cuda` feature, it says how to get the backend.
#[test]
fn cuda_backend_without_a_gpu_fails_with_one_line() {
    let out = shardc(&["run", "models/tiny.toml", "--backend", "cuda", "--steps", "1"]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    if cfg!(feature = "cuda") {
        // Whichever is missing first: the driver here, or a library on a GPU machine.
        assert!(err.contains("CUDA driver") || err.contains("not found") || err.contains("no GPU"), "{err}");
    } else {
        assert!(err.contains("--features cuda"), "{err}");
    }
}

/// `--target cuda` puts each training step's device plan into the plan file and reports it.
#[test]
fn compile_for_cuda_writes_device_code() {
    let dir = std::env::temp_dir().join(format!("shardc-cuda-plan-{}", std::process::id()));
    let path = dir.join("plan.json");
    let out = shardc(&["compile", "models/tiny-llama.toml", "--mesh", "tp=2", "--microbatches", "1", "--dtype", "bf16", "--target", "cuda", "-o", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("device      cuda (Bf16):"), "{text}");
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let step = plan["programs"].as_array().unwrap().iter().find(|p| p["name"] == "train_step").unwrap();
    assert_eq!(step["device"]["dtype"], "bf16");
    assert!(step["device"]["source"].as_str().unwrap().contains("#define BF16"));
    assert_eq!(step["device"]["calls"].as_array().unwrap().len(), step["instrs"].as_array().unwrap().len());
    // The device line counts a gradient bucket's region as one collective, as the backend
    // issues it, and never a `tensor.empty`.
    let out = shardc(&["compile", "models/tiny.toml", "--mesh", "dp=2", "--microbatches", "1", "--target", "cuda", "-o", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let step = plan["programs"].as_array().unwrap().iter().find(|p| p["name"] == "train_step").unwrap();
    let regions = step["memory"]["buckets"].as_array().unwrap();
    let members: usize = regions.iter().map(|r| r["members"].as_array().unwrap().len()).sum();
    let collectives = step["instrs"].as_array().unwrap().iter().filter(|i| i["op"].as_str().unwrap().starts_with("shard.")).count();
    assert!(members > 1, "tiny at dp=2 has one bucket of many gradients");
    let expected = format!("{} collectives;", collectives - members + regions.len());
    assert!(stdout(&out).contains(&expected), "{expected} in {}", stdout(&out));
    // So does the comm/rank line: one all-reduce over dp per bucket, plus the unbucketed ones.
    let dp_all_reduces: Vec<&serde_json::Value> = step["instrs"].as_array().unwrap().iter().filter(|i| i["op"] == "shard.all_reduce" && i["attrs"]["grid_axes"] == serde_json::json!([0])).collect();
    let buckets: std::collections::BTreeSet<i64> = dp_all_reduces.iter().filter_map(|i| i["attrs"]["xf.bucket"].as_i64()).collect();
    let unbucketed = dp_all_reduces.iter().filter(|i| i["attrs"]["xf.bucket"].is_null()).count();
    assert!(!buckets.is_empty(), "{:?}", dp_all_reduces.first());
    let expected = format!(" {} all_reduce over dp (", unbucketed + buckets.len());
    assert!(stdout(&out).contains(&expected), "{expected} in {}", stdout(&out));
    // And a step of several micro-batches, whose step section sends the gradients in step
    // buckets (`xf.step_bucket`): one all-reduce over dp each.
    let out = shardc(&["compile", "models/tiny.toml", "--mesh", "dp=2", "--microbatches", "4", "--target", "cuda", "-o", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let ranks: Vec<&serde_json::Value> = plan["programs"].as_array().unwrap().iter().filter(|p| !p["pipeline"].is_null()).collect();
    assert_eq!(ranks.len(), 1, "gradient accumulation runs as one pipeline rank");
    let dp_all_reduces: Vec<&serde_json::Value> = ranks[0]["instrs"].as_array().unwrap().iter().filter(|i| i["op"] == "shard.all_reduce" && i["attrs"]["grid_axes"] == serde_json::json!([0])).collect();
    let step_buckets: std::collections::BTreeSet<i64> = dp_all_reduces.iter().filter_map(|i| i["attrs"]["xf.step_bucket"].as_i64()).collect();
    let unbucketed = dp_all_reduces.iter().filter(|i| i["attrs"]["xf.step_bucket"].is_null()).count();
    assert!(!step_buckets.is_empty() && dp_all_reduces.len() > step_buckets.len() + unbucketed, "tiny at dp=2 over 4 micro-batches has step buckets of several gradients");
    let expected = format!(" {} all_reduce over dp (", unbucketed + step_buckets.len());
    assert!(stdout(&out).contains(&expected), "{expected} in {}", stdout(&out));
    // Pipeline ranks get device code too (the CUDA backend runs pipeline schedules).
    let out = shardc(&["compile", "models/tiny.toml", "--mesh", "pp=2", "--microbatches", "4", "--target", "cuda", "-o", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let ranks: Vec<&serde_json::Value> = plan["programs"].as_array().unwrap().iter().filter(|p| !p["pipeline"].is_null()).collect();
    assert_eq!(ranks.len(), 2);
    assert!(ranks.iter().all(|p| p["device"]["source"].as_str().is_some_and(|s| s.contains("__global__"))), "a pipeline rank has no device code");
    let _ = std::fs::remove_dir_all(dir);
    let bad = shardc(&["compile", "models/tiny.toml", "--target", "tpu"]);
    assert!(!bad.status.success() && stderr(&bad).contains("unknown target"), "{}", stderr(&bad));
}

/// Context parallelism (issue 20): tiny Llama with its sequences split over cp=2 (and
/// tensor parallelism) trains like one device for 50 steps, as its losses show; the run and
/// its compiled program say what crosses the cp ranks.
#[test]
fn context_parallel_runs_train_like_one_device() {
    let base = ["run", "models/tiny-llama.toml", "--steps", "50", "--log-every", "1"];
    let single = losses_by_step(&shardc(&base));
    let out = shardc(&[&base[..], &["--mesh", "cp=2,tp=2"]].concat());
    assert!(stdout(&out).contains("mesh dp=1,cp=2,tp=2,pp=1 (4 CPU threads"), "{}", stdout(&out));
    assert_same_losses(&single, &losses_by_step(&out), "cp=2,tp=2");
    assert_eq!(single.len(), 50);
    // GQA's key/value heads gathered over cp, weights' gradients reduced over it.
    let compiled = shardc(&["compile", "models/tiny-llama.toml", "--mesh", "cp=2,tp=2"]);
    let text = stdout(&compiled);
    assert!(text.contains("all_gather over cp") && text.contains("reduce_scatter over cp") && text.contains("all_reduce over cp"), "{text}");
    // Ring attention trains the same, and `explain` lists each pass of a block with its cause.
    let ring = shardc(&[&base[..], &["--mesh", "cp=2,tp=2", "--cp-attention", "ring"]].concat());
    assert_same_losses(&single, &losses_by_step(&ring), "cp=2,tp=2 ring");
    let explained = shardc(&["explain", "models/tiny-llama.toml", "--mesh", "cp=2", "--microbatches", "1", "--cp-attention", "ring"]);
    let text = stdout(&explained);
    assert!(text.contains("shard.shift") && text.contains("ring attention of `layers.0.attn.core`: keys passed to the next cp rank (step 1)"), "{text}");
    // On the (emulated) GPU too, gathered and as a ring.
    let gpu = |extra: &[&str]| Command::new(env!("CARGO_BIN_EXE_shardc")).args([&["run", "models/tiny-llama.toml", "--mesh", "cp=2,tp=2", "--backend", "cuda", "--steps", "3", "--log-every", "1"][..], extra].concat()).current_dir(root()).env("SHARDC_GPU_EMULATE", "1").output().unwrap();
    let on_gpu = losses_by_step(&gpu(&[]));
    let three = losses_by_step(&shardc(&["run", "models/tiny-llama.toml", "--steps", "3", "--log-every", "1"]));
    assert_eq!(on_gpu.len(), 3);
    for (step, loss) in &on_gpu {
        assert!((loss - three[step]).abs() <= 1e-4 * three[step].abs(), "step {step}: GPU {loss}, one device {}", three[step]);
    }
    let ring = losses_by_step(&gpu(&["--cp-attention", "ring"]));
    assert_eq!(ring.len(), 3);
    for (step, loss) in &ring {
        assert!((loss - three[step]).abs() <= 1e-4 * three[step].abs(), "step {step}: GPU ring {loss}, one device {}", three[step]);
    }
}

/// Context-parallel attention in bf16 runs on tensor cores, gathered and as a ring: a Llama
/// of head dim 16 over cp=2 (sequences of 32 in zigzag chunks of 8) on the emulated GPU trains
/// as one device does on the CPU, to bf16's rounding of the attention's probabilities.
#[test]
fn context_parallel_attention_runs_on_tensor_cores_in_bf16() {
    let dir = tempdir("cp-mma");
    let spec = std::fs::read_to_string(root().join("models/tiny-llama.toml")).unwrap();
    let spec = spec.replace("hidden = 16\n", "hidden = 64\n").replace("max_seq = 16\n", "max_seq = 32\n").replace("seq_len = 8\n", "seq_len = 32\n").replace("dtype = \"f32\"", "dtype = \"bf16\"");
    let model = dir.join("head-dim-16.toml");
    std::fs::write(&model, spec).unwrap();
    let model = model.to_str().unwrap();
    let base = ["run", model, "--steps", "2", "--log-every", "1", "--microbatches", "1"];
    let single = losses_by_step(&shardc(&base));
    for extra in [&[][..], &["--cp-attention", "ring"]] {
        let compiled = shardc(&[&["compile", model, "--mesh", "cp=2", "--microbatches", "1"][..], extra].concat());
        assert!(stdout(&compiled).contains("ops on tensor cores (bf16 with fp32 accumulation)") && !stdout(&compiled).contains("CUDA cores"), "{extra:?}: {}", stdout(&compiled));
        let out = Command::new(env!("CARGO_BIN_EXE_shardc")).args([&base[..], &["--mesh", "cp=2", "--backend", "cuda"], extra].concat()).current_dir(root()).env("SHARDC_GPU_EMULATE", "1").output().unwrap();
        let on_gpu = losses_by_step(&out);
        assert_eq!(on_gpu.len(), 2, "{extra:?}: {}", stdout(&out));
        for (step, loss) in &on_gpu {
            assert!((loss - single[step]).abs() <= 1e-3 * single[step].abs(), "{extra:?} step {step}: GPU {loss}, one device {}", single[step]);
        }
    }
}

/// A 128K-token context for Llama-7B on 128 GPUs (dp=4, cp=4, tp=8): rotary positions extend
/// past the spec's max_seq, the step compiles, and its memory estimate fits an 80 GB GPU.
#[test]
fn long_context_llama_7b_compiles_and_fits_an_80_gb_gpu() {
    let out = shardc(&["compile", "models/llama-7b.toml", "--mesh", "dp=4,cp=4,tp=8", "--seq", "131072", "--gpu", "h100-sxm"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("a sequence of 131072 extends the model's max_seq of 4096"), "{}", stderr(&out));
    let text = unwrapped(&stdout(&out));
    assert!(text.contains("dp=4,cp=4,tp=8,pp=1 (128 ranks)"), "{text}");
    assert!(text.contains("fits in h100-sxm's 85.9 GB"), "{text}");
    // A learned position table has the rows it has.
    let out = shardc(&["compile", "models/gpt2-small.toml", "--mesh", "cp=2", "--seq", "4096"]);
    assert!(!out.status.success() && stderr(&out).contains("max_seq"), "{}", stderr(&out));
}

/// `plan` searches context parallelism where sequences are long (issue 20): for Llama-7B at
/// 32K tokens on 64 GPUs, in bf16 (a context-parallel rank's attention on tensor cores, as
/// the whole sequence's) and in f32, it lists cp plans and picks one; the command it suggests
/// compiles to the memory per GPU the plan lists (within 5%). At 1K tokens it lists none.
#[test]
fn plan_searches_context_parallelism_for_long_sequences() {
    let f32 = shardc(&["plan", "models/llama-7b.toml", "--seq", "32768", "--gpus", "64", "--top", "1", "--dtype", "f32"]);
    let first = stdout(&f32).lines().find(|l| l.trim_start().starts_with("1 ")).unwrap_or_default().to_string();
    assert!(f32.status.success() && first.contains(" cp="), "{}", stdout(&f32));
    let out = shardc(&["plan", "models/llama-7b.toml", "--seq", "32768", "--gpus", "64", "--top", "5"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let best = text.lines().find(|l| l.trim_start().starts_with("1 ")).unwrap_or_default();
    assert!(best.contains(" cp="), "the best plan at 32K tokens splits the sequence: {text}");
    let command = text.lines().find_map(|l| l.split_once("best as a command: shardc ")).map(|(_, c)| c.to_string()).unwrap_or_default();
    // The form of attention the plan priced is pinned: `auto` in a step of several
    // micro-batches would choose again (the ring does not overlap there).
    assert!(command.contains(" --cp-attention ring") || command.contains(" --cp-attention all-gather"), "{command}");
    let mut args: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(args.first(), Some(&"run"), "{text}");
    args[0] = "compile";
    let compiled = shardc(&args);
    assert!(compiled.status.success(), "{command}: {}", stderr(&compiled));
    // The plan composes one-layer units; the compiled step is the whole model: within 5%.
    let memory = |text: &str, marker: &str| text.split(marker).nth(1).and_then(|rest| rest.split_whitespace().next().and_then(|n| n.parse::<f64>().ok()));
    let listed = best.split("GB").next().and_then(|head| head.split_whitespace().last().and_then(|n| n.parse::<f64>().ok()));
    let (listed, compiled_memory) = (listed.unwrap_or(0.0), memory(&stdout(&compiled), "memory/GPU  ").unwrap_or(f64::MAX));
    assert!((listed - compiled_memory).abs() <= 0.05 * compiled_memory, "plan {listed} GB, compiled {compiled_memory} GB: {best}\n{}", stdout(&compiled));
    let short = shardc(&["plan", "models/llama-7b.toml", "--seq", "1024", "--gpus", "64", "--top", "50"]);
    assert!(short.status.success() && !stdout(&short).contains(" cp="), "{}", stdout(&short));
}

/// What a review of context parallelism found (issue 20), each now held: the naive layout
/// with comm-opt moved the cp gather of the queries past rotary embedding and attention
/// (wrong positions, wrong losses); `bench` dropped cp and skipped the mesh checks; `explain`
/// named the wrong rank of a later pipeline stage; the sequence-parallel divisibility error
/// named a pass; `inspect` printed the mesh in another order; and `--cp-attention ring` on
/// the naive layout did nothing.
#[test]
fn context_parallel_review_findings_hold() {
    let base = ["run", "models/tiny-llama.toml", "--steps", "3", "--log-every", "1", "--dtype", "f64", "--microbatches", "1"];
    let single = losses_by_step(&shardc(&base));
    let naive = losses_by_step(&shardc(&[&base[..], &["--mesh", "cp=2,tp=2", "--naive-partition"]].concat()));
    for (step, loss) in &naive {
        assert!((loss - single[step]).abs() <= 1e-9 * single[step].abs(), "naive cp=2,tp=2 step {step}: {loss} vs {}", single[step]);
    }
    // The ring under recomputation: the recomputed attention rings too.
    for recompute in ["full", "selective-attention"] {
        let ringed = losses_by_step(&shardc(&[&base[..], &["--mesh", "cp=2", "--cp-attention", "ring", "--recompute", recompute]].concat()));
        for (step, loss) in &ringed {
            assert!((loss - single[step]).abs() <= 1e-9 * single[step].abs(), "ring, recompute {recompute}, step {step}: {loss} vs {}", single[step]);
        }
    }
    let ring = shardc(&[&base[..], &["--mesh", "cp=2,tp=2", "--naive-partition", "--cp-attention", "ring"]].concat());
    assert!(!ring.status.success() && unwrapped(&stderr(&ring)).contains("cannot run as a ring"), "{}", stderr(&ring));
    let bench = shardc(&["bench", "models/tiny-llama.toml", "--mesh", "cp=3,tp=2", "--steps", "1"]);
    assert!(!bench.status.success() && unwrapped(&stderr(&bench)).contains("cp=3 does not divide the sequence of 8"), "{}", stderr(&bench));
    let bench = shardc(&["bench", "models/tiny-llama.toml", "--mesh", "cp=2,tp=2", "--steps", "1"]);
    assert!(stdout(&bench).contains("mesh dp=1,cp=2,tp=2,pp=1 (4 rank threads"), "{}{}", stdout(&bench), stderr(&bench));
    let explain = shardc(&["explain", "models/tiny-llama.toml", "--mesh", "cp=2,pp=2"]);
    assert!(stdout(&explain).contains("pipeline rank 1 of 2") && stdout(&explain).contains("(bytes sent by rank 2)"), "{}", stdout(&explain));
    let sp = shardc(&["compile", "models/tiny-llama.toml", "--mesh", "cp=2,tp=4", "--sequence-parallel", "--seq", "12"]);
    let err = unwrapped(&stderr(&sp));
    assert!(!sp.status.success() && err.contains("--sequence-parallel") && err.contains("tp=4 x cp=2 does not divide the sequence of 12") && !err.contains("pass `"), "{err}");
    let dir = tempdir("cp-inspect");
    let plan = dir.join("plan.json");
    assert!(shardc(&["compile", "models/tiny-llama.toml", "--mesh", "cp=2,pp=2", "-o", plan.to_str().unwrap()]).status.success());
    let inspected = shardc(&["inspect", plan.to_str().unwrap()]);
    assert!(stdout(&inspected).contains("mesh dp=1,cp=2,tp=1,pp=2"), "{}", stdout(&inspected));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `step N loss X` lines of a run, by step.
fn losses_by_step(out: &Output) -> std::collections::BTreeMap<u64, f64> {
    assert!(out.status.success(), "{}{}", stdout(out), stderr(out));
    stdout(out)
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("step ")?;
            let (step, loss) = rest.split_once(" loss ")?;
            Some((step.parse().ok()?, loss.trim().parse().ok()?))
        })
        .collect()
}

fn assert_same_losses(expected: &std::collections::BTreeMap<u64, f64>, got: &std::collections::BTreeMap<u64, f64>, what: &str) {
    assert!(!got.is_empty(), "{what}: no losses");
    for (step, loss) in got {
        let want = expected[step];
        assert!((loss - want).abs() <= 1e-5 * want.abs(), "{what}: step {step} loss {loss}, uninterrupted {want}");
    }
}

/// Train 20 steps at dp=2,tp=2, checkpoint, resume at pp=2 and at dp=4 to step 40 (`--steps`
/// is the total, as Megatron-LM's --train-iters): the next 20 steps' losses equal an
/// uninterrupted 40-step run's.
#[test]
fn checkpoints_resume_under_another_mesh() {
    let dir = std::env::temp_dir().join(format!("shardc-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ckpt = dir.join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    // The learning rate decays over 40 steps in every leg: the schedule is the run's, as
    // Megatron-LM requires it to match on resume.
    let base = ["run", "models/tiny.toml", "--log-every", "1", "--seed", "3", "--lr-decay-steps", "40"];
    let with = |extra: &[&str]| shardc(&[&base[..], extra].concat());
    let uninterrupted = losses_by_step(&with(&["--mesh", "dp=2,tp=2", "--micro-batch", "4", "--steps", "40"]));
    assert_eq!(uninterrupted.len(), 40);
    let first = losses_by_step(&with(&["--mesh", "dp=2,tp=2", "--micro-batch", "4", "--steps", "20", "--checkpoint", ckpt]));
    assert_same_losses(&uninterrupted, &first, "first 20 steps");
    assert!(dir.join("ckpt/LATEST").exists() && dir.join("ckpt/step-00000020/rank-00003.safetensors").exists());
    // The spec's global batch of 8 sequences on every mesh: 2 micro-batches of 4 here.
    let pipelined = losses_by_step(&with(&["--mesh", "pp=2", "--micro-batch", "4", "--steps", "40", "--resume", ckpt]));
    assert_eq!(pipelined.keys().copied().collect::<Vec<_>>(), (21..=40).collect::<Vec<u64>>());
    assert_same_losses(&uninterrupted, &pipelined, "resumed at pp=2");
    let data_parallel = losses_by_step(&with(&["--mesh", "dp=4", "--micro-batch", "2", "--steps", "40", "--resume", ckpt]));
    assert_same_losses(&uninterrupted, &data_parallel, "resumed at dp=4");
    // Optimizer state sharded by ZeRO on resume.
    let zero = losses_by_step(&with(&["--mesh", "dp=4", "--zero", "1", "--micro-batch", "2", "--steps", "30", "--resume", ckpt]));
    assert_same_losses(&uninterrupted, &zero, "resumed at dp=4 with ZeRO-1");
    let single = losses_by_step(&with(&["--micro-batch", "4", "--steps", "25", "--resume", ckpt]));
    assert_same_losses(&uninterrupted, &single, "resumed on one device");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A process killed in the middle of writing a checkpoint leaves the previous one loadable,
/// and resuming from it continues the run exactly.
#[test]
fn a_crash_while_checkpointing_keeps_the_last_good_checkpoint() {
    let dir = std::env::temp_dir().join(format!("shardc-ckpt-crash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ckpt = dir.join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap();
    let base = ["run", "models/tiny.toml", "--log-every", "1", "--mesh", "dp=2,tp=2", "--micro-batch", "4"];
    let uninterrupted = losses_by_step(&shardc(&[&base[..], &["--steps", "20"]].concat()));
    // The second checkpoint (step 20) dies after rank 1's file.
    let crashed = Command::new(env!("CARGO_BIN_EXE_shardc"))
        .args([&base[..], &["--steps", "20", "--checkpoint-every", "10", "--checkpoint", ckpt_arg]].concat())
        .current_dir(root())
        .env("SHARDC_FAULT_CHECKPOINT", "2:1")
        .output()
        .unwrap();
    assert!(!crashed.status.success(), "the injected fault did not stop the run");
    assert_eq!(std::fs::read_to_string(ckpt.join("LATEST")).unwrap().trim(), "step-00000010");
    assert!(!ckpt.join("step-00000020").exists());
    let resumed = losses_by_step(&shardc(&[&base[..], &["--steps", "20", "--resume", ckpt_arg]].concat()));
    assert_eq!(resumed.keys().copied().collect::<Vec<_>>(), (11..=20).collect::<Vec<u64>>());
    assert_same_losses(&uninterrupted, &resumed, "resumed after the crash");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh run into a folder holding a longer run's checkpoints keeps what it writes (pruning
/// by folder name deleted each new checkpoint as it was written, and LATEST named a missing
/// folder), and leaves the other run's later checkpoints alone.
#[test]
fn a_fresh_run_into_a_used_checkpoint_folder_keeps_its_checkpoints() {
    let dir = tempdir("ckpt-reuse");
    let ckpt = dir.join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap();
    let base = ["run", "models/tiny.toml", "--micro-batch", "2", "--checkpoint", ckpt_arg];
    let out = shardc(&[&base[..], &["--steps", "8", "--checkpoint-every", "4"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let out = shardc(&[&base[..], &["--steps", "3", "--checkpoint-every", "1"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(ckpt.join("LATEST")).unwrap().trim(), "step-00000003");
    for (step, kept) in [(1, false), (2, true), (3, true), (8, true)] {
        assert_eq!(ckpt.join(format!("step-{step:08}")).exists(), kept, "step {step}");
    }
    let out = shardc(&["run", "models/tiny.toml", "--micro-batch", "2", "--steps", "4", "--resume", ckpt_arg, "--log-every", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("step 4 loss"), "{}", stdout(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--steps` is the total from the start of training and `--checkpoint-every` counts the same
/// way: a run resumed at step 5 saves at 6 and 8 and stops at 9, as the uninterrupted one.
#[test]
fn steps_and_checkpoints_count_from_the_start_of_training() {
    let dir = tempdir("ckpt-total");
    let ckpt = dir.join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap();
    let base = ["run", "models/tiny.toml", "--micro-batch", "2", "--log-every", "1", "--checkpoint", ckpt_arg, "--checkpoint-every", "2"];
    let out = shardc(&[&base[..], &["--steps", "5"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let saved = |text: &str| text.lines().filter_map(|l| l.trim().strip_prefix("checkpoint  step ")?.split_whitespace().next()?.parse::<u64>().ok()).collect::<Vec<_>>();
    assert_eq!(saved(&stdout(&out)), vec![2, 4, 5]);
    let out = shardc(&[&base[..], &["--steps", "9", "--resume", ckpt_arg]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(saved(&stdout(&out)), vec![6, 8, 9]);
    assert_eq!(losses_by_step(&out).keys().copied().collect::<Vec<_>>(), (6..=9).collect::<Vec<u64>>());
    let out = shardc(&[&base[..], &["--steps", "5", "--resume", ckpt_arg]].concat());
    assert!(!out.status.success() && stderr(&out).contains("--train-iters"), "{}", stderr(&out));
    // What the checkpoint fixes is not changed on resume.
    let out = shardc(&[&base[..], &["--steps", "12", "--resume", ckpt_arg, "--seed", "7"]].concat());
    assert!(!out.status.success() && stderr(&out).contains("--seed 7") && stderr(&out).contains("data order"), "{}", stderr(&out));
    let out = shardc(&[&base[..], &["--steps", "12", "--resume", ckpt_arg, "--optimizer", "sgd"]].concat());
    assert!(!out.status.success() && stderr(&out).contains("--optimizer sgd"), "{}", stderr(&out));
    let out = shardc(&[&base[..], &["--steps", "12", "--resume", ckpt_arg, "--seed", "0"]].concat());
    assert!(out.status.success(), "the checkpoint's own seed is fine: {}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The built-in corpus travels inside the binary: `shardc run` trains from any folder.
#[test]
fn run_trains_outside_the_repository() {
    let dir = tempdir("elsewhere");
    for mesh in ["dp=1", "dp=2"] {
        let out = Command::new(env!("CARGO_BIN_EXE_shardc"))
            .args(["run", root().join("models/tiny.toml").to_str().unwrap(), "--steps", "2", "--micro-batch", "4", "--mesh", mesh])
            .current_dir(&dir)
            .env("NO_COLOR", "1")
            .output()
            .unwrap();
        assert!(out.status.success() && stdout(&out).contains("loss"), "{mesh}: {}", stderr(&out));
    }
    let out = shardc(&["run", "models/tiny.toml", "--steps", "2", "--data", "/nonexistent/corpus.txt"]);
    assert!(!out.status.success() && stderr(&out).contains("--data"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes `ids` as a Megatron-LM indexed dataset `PREFIX.bin` + `PREFIX.idx` of int32 tokens
/// (dtype code 4), cut into documents of `doc` tokens, as Megatron's `_IndexWriter` does.
fn write_megatron(prefix: &std::path::Path, ids: &[u32], doc: usize) {
    let lengths: Vec<i32> = ids.chunks(doc).map(|c| c.len() as i32).collect();
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(4);
    idx.extend((lengths.len() as u64).to_le_bytes());
    idx.extend((lengths.len() as u64 + 1).to_le_bytes());
    idx.extend(lengths.iter().flat_map(|l| l.to_le_bytes()));
    let mut pointer = 0u64;
    for l in &lengths {
        idx.extend(pointer.to_le_bytes());
        pointer += *l as u64 * 4;
    }
    idx.extend((0..=lengths.len() as u64).flat_map(|d| d.to_le_bytes()));
    std::fs::write(prefix.with_extension("idx"), idx).unwrap();
    std::fs::write(prefix.with_extension("bin"), ids.iter().flat_map(|&t| (t as i32).to_le_bytes()).collect::<Vec<u8>>()).unwrap();
}

/// Token ids with structure to learn, below the tiny models' vocabulary of 256.
fn learnable_ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + i / 11) % 200).collect()
}

/// Pre-tokenized data as nanoGPT (flat uint16 `.bin`) and Megatron-LM (`.bin` + `.idx`)
/// write it: the same ids in either file give the same run, and `--data-format u32` reads
/// flat uint32.
#[test]
fn run_trains_on_token_files() {
    let dir = tempdir("token-files");
    let ids = learnable_ids(6000);
    let flat = dir.join("train.bin");
    std::fs::write(&flat, ids.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let wide = dir.join("train.u32");
    std::fs::write(&wide, ids.iter().flat_map(|&t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let prefix = dir.join("corpus_text_document");
    write_megatron(&prefix, &ids, 500);
    let base = ["run", "models/tiny.toml", "--steps", "6", "--log-every", "1"];
    let run = |data: &str, extra: &[&str]| shardc(&[&base[..], &["--data", data], extra].concat());
    let nanogpt = run(flat.to_str().unwrap(), &[]);
    assert!(stdout(&nanogpt).contains("(uint16): 6000 tokens, 659 windows of 9 for training, 7 held out"), "{}", stdout(&nanogpt));
    let reference = losses_by_step(&nanogpt);
    assert_eq!(reference.len(), 6);
    for (data, extra, format) in [
        (wide.to_str().unwrap(), &["--data-format", "u32"][..], "(uint32)"),
        (prefix.to_str().unwrap(), &[][..], "(megatron int32)"),
        (prefix.with_extension("bin").to_str().unwrap(), &[][..], "(megatron int32)"),
        (prefix.with_extension("idx").to_str().unwrap(), &["--data-format", "megatron"][..], "(megatron int32)"),
    ] {
        let out = run(data, extra);
        assert!(stdout(&out).contains(format), "{data}: {}{}", stdout(&out), stderr(&out));
        assert_eq!(losses_by_step(&out), reference, "{data}: the same ids train differently");
    }
    // Read as text, the same file is other tokens: another run.
    assert_ne!(losses_by_step(&run(flat.to_str().unwrap(), &["--data-format", "text"])), reference);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Token files that cannot be trained on are refused with the file, the place and the fix.
#[test]
fn bad_token_files_are_refused_by_name() {
    let dir = tempdir("token-files-bad");
    let refused = |data: &std::path::Path, extra: &[&str]| {
        let out = shardc(&[&["run", "models/tiny.toml", "--steps", "1", "--data", data.to_str().unwrap()][..], extra].concat());
        assert!(!out.status.success(), "{} was accepted", data.display());
        unwrapped(&stderr(&out))
    };
    // An id at or above the vocabulary (256 for tiny), at token 1234.
    let mut ids = learnable_ids(3000);
    ids[1234] = 300;
    let big = dir.join("big.bin");
    std::fs::write(&big, ids.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let err = refused(&big, &[]);
    assert!(err.contains("big.bin") && err.contains("token 1234 (byte offset 2468) is 300") && err.contains("vocabulary of 256"), "{err}");
    // The same in a Megatron dataset.
    let prefix = dir.join("mega");
    write_megatron(&prefix, &ids, 1000);
    let err = refused(&prefix, &[]);
    assert!(err.contains("mega.bin") && err.contains("token 1234 (byte offset 4936) is 300"), "{err}");
    // A flat file cut in the middle of a token.
    let odd = dir.join("odd.bin");
    std::fs::write(&odd, vec![1u8; 4001]).unwrap();
    let err = refused(&odd, &[]);
    assert!(err.contains("odd.bin") && err.contains("4001 bytes") && err.contains("truncated"), "{err}");
    let err = refused(&odd, &["--data-format", "u32"]);
    assert!(err.contains("uint32"), "{err}");
    // An empty file, and one shorter than a window.
    let empty = dir.join("empty.bin");
    std::fs::write(&empty, b"").unwrap();
    assert!(refused(&empty, &[]).contains("empty"));
    let short = dir.join("short.txt");
    std::fs::write(&short, b"abc").unwrap();
    assert!(refused(&short, &[]).contains("fewer than one window"));
    // A .bin that its .idx does not describe.
    write_megatron(&prefix, &learnable_ids(3000), 1000);
    std::fs::write(prefix.with_extension("bin"), vec![0u8; 4 * 2999]).unwrap();
    let err = refused(&prefix, &[]);
    assert!(err.contains("mega.bin") && err.contains("mega.idx") && err.contains("not a pair"), "{err}");
    // Floating-point token ids (Megatron dtype code 7, float32).
    let mut idx = std::fs::read(prefix.with_extension("idx")).unwrap();
    idx[17] = 7;
    std::fs::write(prefix.with_extension("idx"), idx).unwrap();
    let err = refused(&prefix, &["--data-format", "megatron"]);
    assert!(err.contains("float32") && err.contains("integer token ids"), "{err}");
    // An index without its .bin is a dataset missing a file (it was trained on as text).
    std::fs::remove_file(prefix.with_extension("bin")).unwrap();
    let err = refused(&prefix.with_extension("idx"), &[]);
    assert!(err.contains("mega.bin") && err.contains("No such file"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint records its data (source, format, tokens, position); resuming on other data
/// is refused naming both, and on the same data it continues the uninterrupted order.
#[test]
fn resuming_on_other_data_is_refused() {
    let dir = tempdir("resume-data");
    let ckpt = dir.join("ckpt");
    let (a, b) = (dir.join("a.bin"), dir.join("b.bin"));
    std::fs::write(&a, learnable_ids(4000).iter().flat_map(|&t| (t as u16).to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    std::fs::write(&b, learnable_ids(4100).iter().flat_map(|&t| (t as u16).to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    // One learning-rate schedule for both legs (decay over 70 steps).
    let base = ["run", "models/tiny.toml", "--log-every", "1", "--lr-decay-steps", "70"];
    let with = |data: &std::path::Path, extra: &[&str]| shardc(&[&base[..], &["--data", data.to_str().unwrap()], extra].concat());
    // 40 steps of 8 windows: 320 samples, of an epoch of 440 training windows.
    let uninterrupted = losses_by_step(&with(&a, &["--steps", "70", "--micro-batch", "4"]));
    let first = with(&a, &["--steps", "40", "--micro-batch", "4", "--checkpoint", ckpt.to_str().unwrap()]);
    assert_same_losses(&uninterrupted, &losses_by_step(&first), "first 40 steps");
    let manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ckpt.join("step-00000040/manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["data"]["samples"], 320, "{manifest}");
    assert_eq!(manifest["data"]["epoch"], 0);
    assert_eq!(manifest["data"]["identity"]["tokens"], 4000);
    assert_eq!(manifest["data"]["identity"]["format"], "uint16");
    let out = with(&b, &["--steps", "70", "--resume", ckpt.to_str().unwrap()]);
    let err = unwrapped(&stderr(&out));
    assert!(!out.status.success() && err.contains("a.bin (uint16, 4000 tokens)") && err.contains("b.bin (uint16, 4100 tokens)"), "{err}");
    let out = with(&a, &["--steps", "70", "--resume", ckpt.to_str().unwrap(), "--eval-fraction", "0.1"]);
    assert!(!out.status.success() && stderr(&out).contains("--eval-fraction"), "{}", stderr(&out));
    // The same data continues into the second epoch as the uninterrupted run, on another mesh.
    let resumed = losses_by_step(&with(&a, &["--steps", "70", "--resume", ckpt.to_str().unwrap(), "--mesh", "dp=2", "--micro-batch", "2"]));
    assert_eq!(resumed.keys().copied().collect::<Vec<_>>(), (41..=70).collect::<Vec<u64>>());
    assert_same_losses(&uninterrupted, &resumed, "resumed on the same data");
    let _ = std::fs::remove_dir_all(&dir);
}

fn validation_losses(out: &Output) -> Vec<(u64, f64)> {
    assert!(out.status.success(), "{}{}", stdout(out), stderr(out));
    stdout(out)
        .lines()
        .filter_map(|l| {
            let (step, loss) = l.strip_prefix("step ")?.split_once(" validation loss ")?;
            Some((step.parse().ok()?, loss.trim().parse().ok()?))
        })
        .collect()
}

/// `--eval-every N` prints the loss on held-out windows every N steps and at the end; it
/// falls as the model trains, and it is the same number whatever mesh trained the model.
#[test]
fn validation_loss_falls_and_is_the_same_on_every_mesh() {
    let base = ["run", "models/tiny.toml", "--steps", "25", "--eval-every", "10", "--micro-batch", "2", "--seed", "1"];
    let single = validation_losses(&shardc(&[&base[..], &["--microbatches", "4"]].concat()));
    assert_eq!(single.iter().map(|v| v.0).collect::<Vec<_>>(), vec![10, 20, 25]);
    assert!(single.iter().all(|v| v.1.is_finite()));
    assert!(single[2].1 < single[0].1 && single[0].1 < 256f64.ln(), "{single:?}");
    for mesh in ["dp=2", "pp=2", "tp=2"] {
        let other = validation_losses(&shardc(&[&base[..], &["--mesh", mesh]].concat()));
        assert_eq!(other.len(), single.len(), "{mesh}");
        for ((step, a), (_, b)) in single.iter().zip(&other) {
            assert!((a - b).abs() <= 1e-5 * a.abs(), "{mesh}: step {step} validation loss {b}, one device {a}");
        }
    }
    // Nor on the micro-batch it evaluates in: every one of the windows counts. Three
    // windows in batches of two dropped the third, so --micro-batch changed the number.
    let three = ["run", "models/tiny.toml", "--steps", "4", "--eval-every", "2", "--global-batch", "4", "--seed", "1", "--eval-windows", "3"];
    let by_one = validation_losses(&shardc(&[&three[..], &["--micro-batch", "1"]].concat()));
    let by_two = validation_losses(&shardc(&[&three[..], &["--micro-batch", "2"]].concat()));
    assert_eq!(by_one.len(), 2);
    for ((step, a), (_, b)) in by_one.iter().zip(&by_two) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {step}: validation loss {b} in batches of 2, {a} in batches of 1");
    }
    // The held-out windows are out of training: with none held out, there is nothing to
    // evaluate on.
    let out = shardc(&[&base[..], &["--eval-fraction", "0"]].concat());
    assert!(!out.status.success() && stderr(&out).contains("--eval-fraction 0"), "{}", stderr(&out));
    let help = stdout(&shardc(&["run", "--help"]));
    for default in ["[default: auto]", "[default: 0.01]", "Default: 64", "Default: the built-in text"] {
        assert!(help.contains(default), "--help does not state {default}");
    }
}

/// Text through a Hugging Face tokenizer.json: given with --tokenizer, or found in the --hf
/// folder.
#[test]
fn text_is_tokenized_by_a_tokenizer_json() {
    let dir = tempdir("tokenizer");
    let words = ["[UNK]", "in", "the", "beginning", "god", "created", "heaven", "and", "earth", "."];
    let vocab: serde_json::Map<String, serde_json::Value> = words.iter().enumerate().map(|(i, w)| (w.to_string(), serde_json::json!(i))).collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let file = dir.join("tokenizer.json");
    std::fs::write(&file, tokenizer.to_string()).unwrap();
    let text = dir.join("text.txt");
    // 10 words and a full stop, of which `void` is unknown: 11 tokens a sentence.
    std::fs::write(&text, "In the beginning God created the heaven and the earth void.\n".repeat(300)).unwrap();
    let out = shardc(&["run", "models/tiny.toml", "--steps", "3", "--data", text.to_str().unwrap(), "--tokenizer", file.to_str().unwrap(), "--log-every", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("(text, tokenized by tokenizer.json): 3600 tokens"), "{}", stdout(&out));
    // A Hugging Face folder with a tokenizer.json reads text through it.
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    for name in ["config.json", "model.safetensors"] {
        std::fs::copy(root().join("tests/data/hf-tiny-gpt2").join(name), hf.join(name)).unwrap();
    }
    std::fs::copy(&file, hf.join("tokenizer.json")).unwrap();
    let out = shardc(&["run", "--hf", hf.to_str().unwrap(), "--seq", "8", "--micro-batch", "2", "--steps", "2", "--data", text.to_str().unwrap(), "--eval-every", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("tokenized by tokenizer.json") && stdout(&out).contains("step 2 validation loss"), "{}", stdout(&out));
    // A tokenizer for token ids is a mistake.
    let ids = dir.join("ids.bin");
    std::fs::write(&ids, vec![1u8; 400]).unwrap();
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--data", ids.to_str().unwrap(), "--tokenizer", file.to_str().unwrap()]);
    assert!(!out.status.success() && unwrapped(&stderr(&out)).contains("read as u16 token ids, not text"), "{}", stderr(&out));
    // A broken tokenizer is named.
    std::fs::write(&file, "{}").unwrap();
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--data", text.to_str().unwrap(), "--tokenizer", file.to_str().unwrap()]);
    assert!(!out.status.success() && stderr(&out).contains("--tokenizer"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--data` and `--tokenizer` paths that are not files are refused by name before reading:
/// `/dev/zero` as text or as a tokenizer was read until memory ran out, and a pipe of token
/// ids was called an empty file. Text through a pipe still trains.
#[test]
fn data_and_tokenizers_that_are_not_files_are_refused_by_name() {
    let dir = tempdir("data-kinds");
    let fifo = dir.join("ids.fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let fifo = fifo.to_str().unwrap();
    let folder = dir.to_str().unwrap();
    for (args, says) in [
        (vec!["--data", "/dev/zero"], "--data /dev/zero: a device"),
        (vec!["--data", "/dev/zero", "--data-format", "u16"], "--data /dev/zero: a device"),
        (vec!["--data", folder], "a directory"),
        (vec!["--data", fifo, "--data-format", "u16"], "a pipe"),
        (vec!["--data", fifo, "--data-format", "megatron"], "ids.fifo.bin"),
        (vec!["--tokenizer", "/dev/zero"], "--tokenizer /dev/zero: more than"),
    ] {
        let started = std::time::Instant::now();
        let out = shardc(&[&["run", "models/tiny.toml", "--steps", "1"][..], &args].concat());
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        assert!(unwrapped(&stderr(&out)).contains(says), "{args:?}: {}", stderr(&out));
        assert!(started.elapsed().as_secs() < 30, "{args:?} took {:?}", started.elapsed());
    }
    // Text through a pipe: read to its end.
    let writer = {
        let fifo = fifo.to_string();
        std::thread::spawn(move || std::fs::write(fifo, std::fs::read(root().join("data/kjv-genesis-exodus.txt")).unwrap()).unwrap())
    };
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--data", fifo]);
    writer.join().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("369509 tokens"), "{}", stdout(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sizes that would panic, hang or exhaust memory are refused up front, naming the limit.
#[test]
fn huge_or_zero_sizes_are_refused_up_front() {
    let started = std::time::Instant::now();
    for (args, says) in [
        (vec!["schedule", "--pp", "4", "--microbatches", "8", "--virtual-stages", "0"], "--virtual-stages 0"),
        (vec!["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--virtual-stages", "18446744073709551615"], "virtual stages"),
        (vec!["schedule", "--pp", "1048576", "--microbatches", "1048576"], "a schedule may have"),
        (vec!["run", "models/tiny.toml", "--mesh", "dp=100000", "--micro-batch", "1", "--global-batch", "100000", "--steps", "1"], "thread per rank"),
        (vec!["compile", "models/tiny.toml", "--mesh", "pp=2", "--stages", "0-0,1-5"], "ends at layer 5"),
    ] {
        let out = shardc(&args);
        assert!(!out.status.success() && stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
    assert!(started.elapsed().as_secs() < 60, "refused only after working");
    // A timeout too large for the clock waits as long as it must.
    let out = shardc(&["run", "models/tiny.toml", "--steps", "2", "--mesh", "dp=2", "--micro-batch", "4", "--timeout", "18446744073709551615"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `text` with miette's wrapping undone: the frame characters dropped and every run of
/// whitespace one space, so that a message can be matched whole wherever it wrapped.
fn unwrapped(text: &str) -> String {
    text.replace(['│', '╰', '─', '▶', '×'], " ").split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Sizes that each pass but multiply into a tensor past 2^48 elements (codegen's byte counts
/// overflowed on a `hidden` of 2^31) are refused naming the field and the limit, from a spec
/// and from a Hugging Face config alike (issue 17).
#[test]
fn sizes_past_the_tensor_limit_are_refused_naming_the_field() {
    let dir = tempdir("tensor-limit");
    let text = std::fs::read_to_string(root().join("models/tiny-llama.toml")).unwrap();
    let wide = text.replace("hidden = 16\n", "hidden = 2147483648\n").replace("heads = 4\n", "heads = 1\n").replace("kv_heads = 2\n", "kv_heads = 1\n");
    assert_ne!(wide, text);
    let spec = dir.join("wide.toml");
    std::fs::write(&spec, wide).unwrap();
    let out = shardc(&["compile", spec.to_str().unwrap()]);
    assert!(!out.status.success() && stderr(&out).contains("model.hidden") && stderr(&out).contains("(2^48)"), "{}", stderr(&out));
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root().join("tests/data/hf-tiny-llama/config.json")).unwrap()).unwrap();
    let fields = config.as_object_mut().unwrap();
    fields.remove("head_dim");
    fields.insert("hidden_size".into(), (1u64 << 31).into());
    std::fs::write(hf.join("config.json"), config.to_string()).unwrap();
    let out = shardc(&["compile", "--hf", hf.to_str().unwrap()]);
    assert!(!out.status.success() && stderr(&out).contains("`hidden_size`") && stderr(&out).contains("(2^48)"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("panicked"));
    // Device code: attention's grid has one block per (sequence, head) pair in y, where CUDA
    // allows 65535; more were cast to u32 and launched (or failed at launch).
    let out = shardc(&["compile", "models/tiny.toml", "--target", "cuda", "--micro-batch", "20000", "--global-batch", "20000"]);
    assert!(!out.status.success() && unwrapped(&stderr(&out)).contains("80000 blocks in the grid's y dimension, more than the 65535 CUDA allows"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--steps` past the 32-bit step counter the compiled step reads is refused before any work,
/// naming the limit: u64::MAX overflowed a capacity, 10^12 reserved terabytes (issue 17).
#[test]
fn step_counts_past_the_counter_are_refused_up_front() {
    let started = std::time::Instant::now();
    for args in [
        vec!["run", "models/tiny.toml", "--steps", "18446744073709551615"],
        vec!["run", "models/tiny.toml", "--steps", "1000000000000"],
        vec!["run", "models/tiny-llama.toml", "--steps", "2147483648", "--mesh", "pp=2"],
        vec!["bench", "models/tiny.toml", "--steps", "18446744073709551615"],
    ] {
        let out = shardc(&args);
        assert!(!out.status.success() && stderr(&out).contains("--steps") && stderr(&out).contains("at most 2147483647 steps"), "{args:?}: {}", stderr(&out));
        assert!(!stderr(&out).contains("panicked"), "{args:?}");
    }
    assert!(started.elapsed().as_secs() < 30, "refused only after working");
}

/// A checkpoint manifest edited by hand (step, mesh, splits, shapes) is refused naming the
/// field or tensor: these panicked on an index, aborted allocating, or resumed garbage
/// (issue 17).
#[test]
fn edited_checkpoint_manifests_are_refused_by_name() {
    let dir = tempdir("ckpt-edited");
    let ckpt = dir.join("ckpt");
    let out = shardc(&["run", "models/tiny.toml", "--steps", "2", "--mesh", "dp=2,tp=2", "--checkpoint", ckpt.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let saved = ckpt.join("step-00000002");
    let original: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(saved.join("manifest.json")).unwrap()).unwrap();
    let edits: Vec<(&str, Box<dyn Fn(&mut serde_json::Value)>, &str)> = vec![
        ("step", Box::new(|m| m["step"] = serde_json::json!(1u64 << 40)), "`step` is 1099511627776"),
        ("negative step", Box::new(|m| m["step"] = serde_json::json!(-1)), "`step`: invalid value"),
        ("mesh", Box::new(|m| m["mesh"] = serde_json::json!([4])), "names grid axis 1"),
        ("huge mesh", Box::new(|m| m["mesh"] = serde_json::json!([1u64 << 32, 1u64 << 32, 1])), "more than 1048576 ranks"),
        ("split", Box::new(|m| m["tensors"][0]["split"] = serde_json::json!([[7], []])), "names grid axis 7"),
        ("huge shape", Box::new(|m| m["tensors"][0]["global_shape"] = serde_json::json!([1u64 << 40, 1u64 << 40])), "elements a tensor may have"),
        ("shape", Box::new(|m| m["tensors"][0]["global_shape"] = serde_json::json!([1u64 << 31, 16])), "makes shards of [1073741824, 16]"),
        ("swapped mesh", Box::new(|m| m["mesh"] = serde_json::json!([1, 4, 1])), "over the mesh [1, 4, 1] makes shards of"),
        // The optimizer record: a resume's advice would name `--optimizer lion` or `--lr -1`.
        ("optimizer", Box::new(|m| m["optimizer"]["update"] = serde_json::json!("lion")), "`optimizer.update` is `lion`, which is not an optimizer shardc has (adamw or sgd)"),
        ("lr", Box::new(|m| m["optimizer"]["lr"] = serde_json::json!(-1.0)), "`optimizer.lr` is -1, not a positive learning rate"),
        ("zero lr", Box::new(|m| m["optimizer"]["lr"] = serde_json::json!(0.0)), "`optimizer.lr` is 0, not a positive learning rate"),
        ("min-lr", Box::new(|m| m["optimizer"]["min_lr"] = serde_json::json!(1.0)), "`optimizer.min_lr` is 1, outside 0..=`optimizer.lr`"),
        ("negative min-lr", Box::new(|m| m["optimizer"]["min_lr"] = serde_json::json!(-0.5)), "`optimizer.min_lr` is -0.5"),
        ("warmup", Box::new(|m| m["optimizer"]["warmup_steps"] = serde_json::json!(-3)), "`optimizer.warmup_steps` is -3, outside 0..=2147483647"),
        ("decay", Box::new(|m| m["optimizer"]["decay_steps"] = serde_json::json!(1i64 << 40)), "`optimizer.decay_steps` is 1099511627776, outside 0..=2147483647"),
        ("decay before warmup", Box::new(|m| { m["optimizer"]["warmup_steps"] = serde_json::json!(10); m["optimizer"]["decay_steps"] = serde_json::json!(5) }), "`optimizer.decay_steps` 5 does not exceed `optimizer.warmup_steps` 10"),
        ("clip", Box::new(|m| m["optimizer"]["clip_grad"] = serde_json::json!(-1.0)), "`optimizer.clip_grad` is -1, not a finite norm of at least 0"),
    ];
    assert!(original["optimizer"]["update"] == "adamw", "the run records its optimizer: {original}");
    for (what, edit, says) in edits {
        let mut manifest = original.clone();
        edit(&mut manifest);
        std::fs::write(saved.join("manifest.json"), manifest.to_string()).unwrap();
        let out = shardc(&["run", "models/tiny.toml", "--steps", "4", "--mesh", "dp=2,tp=2", "--resume", ckpt.to_str().unwrap()]);
        assert!(!out.status.success() && unwrapped(&stderr(&out)).contains(says), "{what}: {}", stderr(&out));
        assert!(!stderr(&out).contains("panicked") && !stderr(&out).contains("--optimizer lion") && !stderr(&out).contains("--lr -1"), "{what}: {}", stderr(&out));
    }
    // The record as written resumes.
    std::fs::write(saved.join("manifest.json"), original.to_string()).unwrap();
    let out = shardc(&["run", "models/tiny.toml", "--steps", "3", "--mesh", "dp=2,tp=2", "--resume", ckpt.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Hugging Face folder whose tensor has the wrong rank or size (a 1-D `lm_head.weight`, a
/// scalar `c_attn`) is an error naming the tensor and the shape its config makes it; these
/// panicked on an index or an underflow (issue 17).
#[test]
fn hugging_face_tensors_of_the_wrong_shape_are_named() {
    let dir = tempdir("hf-shapes");
    for (family, tensor, shape, wanted) in [
        ("llama", "lm_head.weight", vec![1024], "[64, 16]"),
        ("llama", "model.layers.1.self_attn.k_proj.weight", vec![16, 8], "[8, 16]"),
        ("gpt2", "transformer.h.0.attn.c_attn.weight", vec![], "[16, 48]"),
        ("gpt2", "transformer.h.1.attn.c_attn.bias", vec![], "[48]"),
    ] {
        let hf = dir.join(format!("{family}-{tensor}"));
        std::fs::create_dir_all(&hf).unwrap();
        let source = root().join(format!("tests/data/hf-tiny-{family}"));
        std::fs::copy(source.join("config.json"), hf.join("config.json")).unwrap();
        let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = shardc_runtime::hf::read_dir(&source)
            .unwrap()
            .into_iter()
            .map(|(name, (old, values))| {
                let values: Vec<f32> = values.into_iter().map(|v| v as f32).collect();
                if name != tensor {
                    return (name, old, values);
                }
                let len = shape.iter().product::<usize>();
                (name, shape.clone(), values[..len].to_vec())
            })
            .collect();
        shardc_runtime::hf::write_safetensors(&hf.join("model.safetensors"), &tensors).unwrap();
        // Text whose bytes are all inside the tiny vocabulary of 64, so that the run gets as
        // far as the weights.
        let data = dir.join("digits.txt");
        std::fs::write(&data, "0123456789 ".repeat(200)).unwrap();
        for args in [vec!["logits", "--hf", hf.to_str().unwrap(), "--tokens", "1,2,3"], vec!["run", "--hf", hf.to_str().unwrap(), "--steps", "1", "--data", data.to_str().unwrap()]] {
            let out = shardc(&args);
            let text = unwrapped(&stderr(&out));
            assert!(!out.status.success() && text.contains(&format!("`{tensor}` has shape {shape:?}; its config.json makes it {wanted}")), "{args:?}: {}", stderr(&out));
            assert!(!text.contains("panicked"), "{args:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `inspect` of a plan whose byte counts were edited (u64::MAX, or less than its buffers
/// need) or whose versions are unknown refuses it naming the field, instead of printing what
/// the buffers do not make; a long schedule is abbreviated; and the step shapes issue 17
/// listed are refused or priced as printed (issue 17).
#[test]
fn inspect_refuses_plans_whose_numbers_do_not_add_up() {
    let dir = tempdir("inspect-edited");
    let plan = dir.join("plan.json");
    let out = shardc(&["compile", "models/tiny.toml", "--mesh", "pp=2", "--microbatches", "4096", "-o", plan.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The micro-batches printed are the ones priced: 4096 of 2 sequences of 8 tokens.
    let text = stdout(&out);
    assert!(text.contains("4096 micro-batches per step (global batch 8192 sequences)"), "{text}");
    let out = shardc(&["inspect", plan.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("... and ") && stdout(&out).len() < 20_000, "{}", stdout(&out).len());
    let original: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let max = serde_json::json!(u64::MAX);
    let edits: Vec<(Box<dyn Fn(&mut serde_json::Value)>, &str)> = vec![
        (Box::new(|p| p["programs"][0]["memory"]["argument_bytes"] = max.clone()), "`argument_bytes` is 18446744073709551615 bytes, but its buffers make"),
        (Box::new(|p| p["programs"][1]["memory"]["temporary_bytes"] = max.clone()), "`temporary_bytes` is 18446744073709551615 bytes, more than"),
        (Box::new(|p| p["programs"][1]["memory"]["arena_bytes"] = serde_json::json!(16)), "must be at least its live bound"),
        (Box::new(|p| p["programs"][0]["memory"]["slots"][0][0] = max.clone()), "more than the 281474976710656 a buffer may have"),
        (Box::new(|p| p["programs"][0]["format_version"] = serde_json::json!(7)), "format version 7"),
        // A program from another shardc fails with its version before serde meets a field or
        // device call this one does not know.
        (
            Box::new(|p| {
                p["programs"][0]["format_version"] = serde_json::json!(1);
                p["programs"][0]["device"] = serde_json::json!({"calls": [{"unknown_call": {}}]});
            }),
            "format version 1 is not supported (this runtime reads version 6)",
        ),
        (Box::new(|p| p["format_version"] = serde_json::json!(7)), "plan `format_version` is 7"),
        (Box::new(|p| p["programs"][2]["mesh"] = serde_json::json!([u64::MAX, 2])), "mesh [18446744073709551615, 2]"),
    ];
    for (edit, says) in edits {
        let mut edited = original.clone();
        edit(&mut edited);
        std::fs::write(&plan, edited.to_string()).unwrap();
        let out = shardc(&["inspect", plan.to_str().unwrap()]);
        assert!(!out.status.success() && unwrapped(&stderr(&out)).contains(says), "{says}: {}", stderr(&out));
        assert!(!stderr(&out).contains("panicked"));
    }
    for (args, says) in [
        (vec!["plan", "models/tiny.toml", "--gpus", "8", "--global-batch", "18446744073709551615"], "exceeds the largest supported size"),
        // Plans with more micro-batches than a step compiles were listed first.
        (vec!["plan", "models/tiny.toml", "--gpus", "8", "--global-batch", "2147483648"], "needs more than the 4096 micro-batches a step may have"),
        (vec!["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--virtual-stages", "18446744073709551615"], "between 1 and 64"),
        (vec!["schedule", "--pp", "1048576", "--microbatches", "1048576"], "a schedule may have"),
    ] {
        let out = shardc(&args);
        assert!(!out.status.success() && unwrapped(&stderr(&out)).contains(says), "{args:?}: {}", stderr(&out));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every file argument is read bounded: `/dev/zero` as a spec, plan, cluster file, measured
/// times, dialect or weights is an error naming the flag, not a read until memory runs out
/// (issue 17).
#[test]
fn endless_input_files_are_refused_naming_the_flag() {
    let started = std::time::Instant::now();
    for (args, says) in [
        (vec!["ir", "/dev/zero"], "larger than 16 MiB"),
        (vec!["compile", "/dev/zero"], "larger than 16 MiB"),
        (vec!["compile", "models/tiny.toml", "--cluster", "/dev/zero"], "--cluster /dev/zero: more than 16.0 MiB"),
        (vec!["inspect", "/dev/zero"], "inspect /dev/zero: more than 256.0 MiB"),
        (vec!["dialect", "--check", "/dev/zero"], "--check /dev/zero: more than 16.0 MiB"),
        (vec!["run", "models/tiny.toml", "--steps", "1", "--load", "/dev/zero"], "--load /dev/zero: not a regular file"),
    ] {
        let out = shardc(&args);
        assert!(!out.status.success() && unwrapped(&stderr(&out)).contains(says), "{args:?}: {}", stderr(&out));
    }
    assert!(started.elapsed().as_secs() < 60, "refused only after reading for long");
}

/// An error in a spec of one huge line shows an excerpt around the field, not the line
/// (miette rendered a 50 MB line whole, for minutes), and a spec past 16 MiB is refused before
/// it is parsed (issue 17).
#[test]
fn errors_in_huge_one_line_specs_show_an_excerpt() {
    let dir = tempdir("huge-line");
    let started = std::time::Instant::now();
    for (file, text) in [
        ("line.toml", format!("name = \"x\"\n[model]\nvocab = 256 {}\n", "x".repeat(4 << 20))),
        ("line.json", format!("{{\"name\": \"x\", \"model\": {{\"vocab\": 256, \"junk\": \"{}\"}}}}", "y".repeat(4 << 20))),
    ] {
        let spec = dir.join(file);
        std::fs::write(&spec, text).unwrap();
        let out = shardc(&["compile", spec.to_str().unwrap()]);
        let err = stderr(&out);
        assert!(!out.status.success() && err.contains("an excerpt of a") && err.len() < 4000, "{file}: {} bytes: {}", err.len(), &err[..err.len().min(2000)]);
    }
    let spec = dir.join("huge.toml");
    std::fs::write(&spec, format!("name = \"x\"\n# {}\n", "z".repeat(17 << 20))).unwrap();
    let out = shardc(&["compile", spec.to_str().unwrap()]);
    assert!(!out.status.success() && unwrapped(&stderr(&out)).contains("is larger than 16 MiB, the most a spec file may be"), "{}", stderr(&out));
    assert!(started.elapsed().as_secs() < 60, "took {:?}", started.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A CPU run that cannot fit in the host's memory is refused before it allocates, naming what
/// its compiled programs need and what the host has: llama-7b in f32 on a 16 GiB host (set by
/// SHARDC_HOST_MEMORY, so the test does not depend on this machine), and a run whose storage
/// slots alone exceed it, with the slots figure the run itself reports (issue 17).
#[test]
fn cpu_runs_that_cannot_fit_in_memory_are_refused_up_front() {
    let with_memory = |memory: &str, args: &[&str]| Command::new(env!("CARGO_BIN_EXE_shardc")).args(args).current_dir(root()).env("NO_COLOR", "1").env("SHARDC_HOST_MEMORY", memory).output().unwrap();
    let started = std::time::Instant::now();
    let out = with_memory("16GiB", &["run", "models/llama-7b.toml", "--dtype", "f32", "--steps", "1"]);
    let text = unwrapped(&stderr(&out));
    assert!(!out.status.success() && text.contains("this CPU run needs about") && text.contains("and this host has 16.0 GiB available (as SHARDC_HOST_MEMORY sets)"), "{}", stderr(&out));
    assert!(text.contains("GiB in the storage slots") && text.contains("smaller model"), "{text}");
    assert!(started.elapsed().as_secs() < 60, "refused only after working");
    // The slots counted are the ones the run allocates: "CPU storage" as `run` prints it.
    let fits = with_memory("1TiB", &["run", "models/tiny.toml", "--micro-batch", "8", "--global-batch", "8", "--steps", "1"]);
    assert!(fits.status.success(), "{}", stderr(&fits));
    let storage = stdout(&fits).split("CPU storage ").nth(1).unwrap().split_whitespace().take(2).collect::<Vec<_>>().join(" ");
    let out = with_memory("1KiB", &["run", "models/tiny.toml", "--micro-batch", "8", "--global-batch", "8", "--steps", "1"]);
    let text = unwrapped(&stderr(&out));
    assert!(!out.status.success() && text.contains(&format!("{storage} in the storage slots of the memory plans of its 1 rank")), "{storage}: {text}");
    // And the attention backward's working memory: heads-first copies of q, its output,
    // their gradients, k, v and theirs, 8 tensors of 8 x 8 x 16 f32 values.
    assert!(text.contains(&format!("{} of working memory (each rank's largest instruction)", shardc_runtime::inspect::bytes(8 * 8 * 8 * 16 * 4))), "{text}");
    let out = with_memory("lots", &["run", "models/tiny.toml", "--steps", "1"]);
    assert!(!out.status.success() && stderr(&out).contains("SHARDC_HOST_MEMORY=lots"), "{}", stderr(&out));
    // The training data is read into memory too: a 64 MiB token file on a host with 32 MiB
    // was read whole (the check counted the programs only). The file is sparse: refused
    // before any of it is read.
    let dir = tempdir("host-memory-data");
    let big = dir.join("big.bin");
    std::fs::File::create(&big).unwrap().set_len(64 << 20).unwrap();
    for mesh in ["dp=1", "dp=2", "pp=2"] {
        let started = std::time::Instant::now();
        let out = with_memory("32MiB", &["run", "models/tiny.toml", "--mesh", mesh, "--steps", "1", "--data", big.to_str().unwrap()]);
        let text = unwrapped(&stderr(&out));
        assert!(!out.status.success() && text.contains("and 64.0 MiB of training data read into memory (--data)"), "{mesh}: {text}");
        assert!(started.elapsed().as_secs() < 30, "{mesh}: refused only after reading");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// transformers 5 configs give RoPE's base in `rope_parameters` (as tests/data/hf-tiny-llama
/// does): it is honoured, so a base of 500000 gives other logits than 10000, and scaled RoPE
/// is refused naming the field (issue 17).
#[test]
fn rope_parameters_of_transformers_5_configs_are_honoured() {
    let dir = tempdir("rope-parameters");
    let source = root().join("tests/data/hf-tiny-llama");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["rope_parameters"]["rope_theta"], serde_json::json!(10000.0), "the checked-in config uses the transformers 5 layout");
    let folder = |tag: &str, rope: serde_json::Value| {
        let hf = dir.join(tag);
        std::fs::create_dir_all(&hf).unwrap();
        std::fs::copy(source.join("model.safetensors"), hf.join("model.safetensors")).unwrap();
        let mut config = config.clone();
        config["rope_parameters"] = rope;
        std::fs::write(hf.join("config.json"), config.to_string()).unwrap();
        hf
    };
    let out = dir.join("logits.json");
    let base = folder("base", serde_json::json!({"rope_type": "default", "rope_theta": 10000.0}));
    let wide = folder("wide", serde_json::json!({"rope_type": "default", "rope_theta": 500000.0}));
    let (_, checked_in) = hf_logits(source.to_str().unwrap(), "1,2,3,4,5,6,7,8", "dp=1,tp=1,pp=1", &out);
    let (_, at_10000) = hf_logits(base.to_str().unwrap(), "1,2,3,4,5,6,7,8", "dp=1,tp=1,pp=1", &out);
    let (_, at_500000) = hf_logits(wide.to_str().unwrap(), "1,2,3,4,5,6,7,8", "dp=1,tp=1,pp=1", &out);
    assert_eq!(checked_in, at_10000);
    // Heads of 4 dimensions have one slow frequency (theta^-1/2: 1/100 against 1/707), so the
    // logits move little, but far more than rounding (runs are bit-for-bit deterministic).
    assert!(max_relative(&at_500000, &at_10000) > 1e-6, "the base changed nothing: {}", max_relative(&at_500000, &at_10000));
    let plan = dir.join("plan.json");
    let compiled = shardc(&["compile", "--hf", wide.to_str().unwrap(), "-o", plan.to_str().unwrap()]);
    assert!(compiled.status.success(), "{}", stderr(&compiled));
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(written["spec"]["model"]["rope_theta"], serde_json::json!(500000.0));
    let scaled = folder("llama3", serde_json::json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}));
    let out = shardc(&["compile", "--hf", scaled.to_str().unwrap()]);
    assert!(!out.status.success() && unwrapped(&stderr(&out)).contains("`rope_parameters.rope_type` = \"llama3\" is not supported"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// What cannot be shown as it is is refused, not mangled: a spec name with a terminal escape
/// (it would act on the terminal), logits that are not finite (JSON would hold null).
#[test]
fn unprintable_names_and_non_finite_logits_are_errors() {
    let dir = tempdir("unprintable");
    let spec = dir.join("escape.toml");
    let text = std::fs::read_to_string(root().join("models/tiny.toml")).unwrap();
    let name_line = text.lines().find(|l| l.starts_with("name")).unwrap().to_string();
    std::fs::write(&spec, text.replace(&name_line, "name = \"tiny\\u001b[2J\"")).unwrap();
    let out = shardc(&["compile", spec.to_str().unwrap()]);
    assert!(!out.status.success() && stderr(&out).contains("control characters"), "{}", stderr(&out));
    assert!(!stdout(&out).contains('\u{1b}') && !stderr(&out).contains("\u{1b}[2J"), "the escape reached the terminal");
    // A NaN in the first tensor of a Hugging Face folder.
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(root().join("tests/data/hf-tiny-gpt2").join(file), hf.join(file)).unwrap();
    }
    let mut bytes = std::fs::read(hf.join("model.safetensors")).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes[8 + header..8 + header + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(hf.join("model.safetensors"), &bytes).unwrap();
    let json = dir.join("logits.json");
    let out = shardc(&["logits", "--hf", hf.to_str().unwrap(), "--tokens", "1,2,3", "-o", json.to_str().unwrap()]);
    assert!(!out.status.success() && unwrapped(&stderr(&out)).contains("holds NaN at element 0"), "{}{}", stdout(&out), stderr(&out));
    // Finite weights whose logits are not: a final norm scale of 1e300 (f64 in the file, inf
    // in the f32 model).
    let tensors: Vec<(String, &str, Vec<usize>, Vec<u8>)> = safetensors_file(root().join("tests/data/hf-tiny-gpt2/model.safetensors").to_str().unwrap())
        .into_iter()
        .map(|(name, (shape, values))| {
            let scale = if name == "transformer.ln_f.weight" { 1e300 } else { 1.0 };
            (name, "F64", shape, values.iter().flat_map(|&v| (v * scale).to_le_bytes()).collect())
        })
        .collect();
    write_safetensors(&hf.join("model.safetensors"), &tensors);
    let out = shardc(&["logits", "--hf", hf.to_str().unwrap(), "--tokens", "1,2,3", "-o", json.to_str().unwrap()]);
    assert!(!out.status.success() && stderr(&out).contains("would not hold it"), "{}{}", stdout(&out), stderr(&out));
    assert!(!json.exists(), "a file of nulls was written");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Terminal escapes anywhere in an input (any spec field, a comment shown in a parse error's
/// excerpt, a Hugging Face config, a plan file) reach the terminal escaped, never raw, and a
/// parser quoting a 15 MiB value prints a cut message, not the value (issue 17).
#[test]
fn escapes_and_huge_values_in_errors_never_reach_the_terminal_raw() {
    let dir = tempdir("escapes");
    let text = std::fs::read_to_string(root().join("models/tiny.toml")).unwrap();
    let norm_line = text.lines().find(|l| l.trim_start().starts_with("norm")).map(str::to_string);
    let mut inputs: Vec<(&str, String)> = vec![("comment.toml", format!("# comment \u{1b}[2J\nname = 5\n"))];
    if let Some(line) = norm_line {
        inputs.push(("field.toml", text.replace(&line, "norm = \"x\\u001b[2Jy\"")));
    } else {
        inputs.push(("field.toml", text.replacen("[model]", "[model]\nnorm = \"x\\u001b[2Jy\"", 1)));
    }
    for (file, body) in &inputs {
        let spec = dir.join(file);
        std::fs::write(&spec, body).unwrap();
        let out = shardc(&["compile", spec.to_str().unwrap()]);
        let err = stderr(&out);
        assert!(!out.status.success(), "{file}: {err}");
        assert!(!err.contains('\u{1b}') && !stdout(&out).contains('\u{1b}'), "{file}: an escape reached the terminal: {err:?}");
        assert!(err.contains("\\u{1b}"), "{file}: the escape is not shown escaped: {err}");
    }
    // A Hugging Face config naming an escape as its model type.
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::write(hf.join("config.json"), "{\"model_type\": \"x\\u001b[2Jy\"}").unwrap();
    let out = shardc(&["compile", "--hf", hf.to_str().unwrap()]);
    assert!(!out.status.success() && !stderr(&out).contains('\u{1b}'), "{:?}", stderr(&out));
    // A plan whose buffer type is an escape.
    let plan = dir.join("plan.json");
    let out = shardc(&["compile", "models/tiny.toml", "-o", plan.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let edited = std::fs::read_to_string(&plan).unwrap().replace("\"dtype\":\"f32\"", "\"dtype\":\"z\\u001b[31mq\"");
    assert!(edited.contains("\\u001b[31mq"), "the plan's buffer types are not written as expected");
    std::fs::write(&plan, edited).unwrap();
    let out = shardc(&["inspect", plan.to_str().unwrap()]);
    assert!(!out.status.success() && !stderr(&out).contains('\u{1b}') && !stdout(&out).contains('\u{1b}'), "{:?}", stderr(&out));
    // A 15 MiB string where a number belongs, in TOML and in JSON.
    for (file, body) in [
        ("huge-value.toml", format!("name = \"x\"\n[model]\nvocab = \"{}\"\n", "x".repeat(15 << 20))),
        ("huge-value.json", format!("{{\"name\": \"x\", \"model\": {{\"vocab\": \"{}\"}}}}", "x".repeat(15 << 20))),
    ] {
        let spec = dir.join(file);
        std::fs::write(&spec, body).unwrap();
        let out = shardc(&["compile", spec.to_str().unwrap()]);
        let err = stderr(&out);
        assert!(!out.status.success() && err.len() < 20_000, "{file}: {} bytes of error", err.len());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `schedule` simulates in time linear in the work items: a million stages with one
/// micro-batch (the quadratic scan ran for hours) finishes in seconds (issue 17).
#[test]
fn schedules_of_many_stages_simulate_in_linear_time() {
    let started = std::time::Instant::now();
    let out = shardc(&["schedule", "--pp", "1048576", "--microbatches", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(started.elapsed().as_secs() < 60, "took {:?}", started.elapsed());
}

/// A loss or state that stops being finite ends the run at that step on every layout, and
/// nothing of it is checkpointed: the last good checkpoint stays the one to resume from.
#[test]
fn a_non_finite_step_stops_every_layout_and_is_never_checkpointed() {
    let dir = tempdir("ckpt-nan");
    // The CPU backend at each layout, and the GPU's (emulated) with every rank on the device
    // and as two processes, each writing its own shards.
    let gpu = |env: &'static [(&'static str, &'static str)]| move |args: &[&str]| run_on_emulated_gpu(&args[1..], env);
    let runs: Vec<(&str, Box<dyn Fn(&[&str]) -> Output>)> = vec![
        ("dp=1", Box::new(|a: &[&str]| shardc(a))),
        ("dp=2", Box::new(|a: &[&str]| shardc(a))),
        ("tp=2", Box::new(|a: &[&str]| shardc(a))),
        ("pp=2", Box::new(|a: &[&str]| shardc(a))),
        ("tp=2", Box::new(gpu(&[]))),
        ("dp=2", Box::new(gpu(&[("SHARDC_EMULATE_PROCESSES", "2")]))),
    ];
    for (i, (mesh, run)) in runs.iter().enumerate() {
        let ckpt = dir.join(format!("{i}-{mesh}"));
        let ckpt_arg = ckpt.to_str().unwrap();
        // In f64, where a learning rate of 1e300 is in range (f32 refuses it up front): step 3
        // takes the weights to about 1e300, and step 4's logits overflow.
        let base = ["run", "models/tiny.toml", "--dtype", "f64", "--micro-batch", "2", "--mesh", mesh, "--checkpoint", ckpt_arg, "--checkpoint-every", "1"];
        let out = run(&[&base[..], &["--steps", "2"]].concat());
        assert!(out.status.success(), "{mesh}: {}", stderr(&out));
        let out = run(&[&base[..], &["--steps", "5", "--resume", ckpt_arg, "--lr", "1e300", "--override-schedule"]].concat());
        assert!(!out.status.success(), "{mesh}: a run that blew up exited 0:\n{}", stdout(&out));
        assert!(stderr(&out).contains("lower --lr"), "{mesh}: {}", stderr(&out));
        let latest = std::fs::read_to_string(ckpt.join("LATEST")).unwrap();
        assert!(["step-00000002", "step-00000003"].contains(&latest.trim()), "{mesh}: {latest}");
        assert!(!ckpt.join("step-00000004").exists() && !ckpt.join("step-00000005").exists(), "{mesh}: a non-finite step was checkpointed");
        let good = ckpt.join("step-00000002");
        let out = shardc(&["run", "models/tiny.toml", "--dtype", "f64", "--micro-batch", "2", "--mesh", mesh, "--steps", "3", "--resume", good.to_str().unwrap(), "--log-every", "1"]);
        assert!(out.status.success() && stdout(&out).contains("step 3 loss"), "{mesh}: {}{}", stdout(&out), stderr(&out));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A resume reads the data its checkpoint's run read, or is refused naming both and the
/// flag that resumes: `--data FILE` for a file, no `--data` for the built-in corpus (whose
/// name is no path to give).
#[test]
fn a_resume_on_other_data_is_refused_with_the_flag_that_resumes() {
    let dir = tempdir("resume-data");
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, "Call me Ishmael. Some years ago, never mind how long precisely. ".repeat(60)).unwrap();
    let (built_in, from_file) = (dir.join("built-in"), dir.join("from-file"));
    let base = ["run", "models/tiny.toml", "--steps", "1"];
    for (ckpt, data) in [(&built_in, None), (&from_file, Some(&corpus))] {
        let mut args: Vec<&str> = base.to_vec();
        args.extend(["--checkpoint", ckpt.to_str().unwrap()]);
        if let Some(data) = data {
            args.extend(["--data", data.to_str().unwrap()]);
        }
        let out = shardc(&args);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let resume = |ckpt: &std::path::Path, data: Option<&std::path::Path>| {
        let mut args: Vec<&str> = vec!["run", "models/tiny.toml", "--steps", "2", "--resume", ckpt.to_str().unwrap()];
        if let Some(data) = data {
            args.extend(["--data", data.to_str().unwrap()]);
        }
        let out = shardc(&args);
        assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
        unwrapped(&stderr(&out))
    };
    let err = resume(&built_in, Some(&corpus));
    assert!(err.contains("trained on the built-in corpus") && err.contains("resume without --data"), "{err}");
    let err = resume(&from_file, None);
    // (The report wraps the path at its hyphens.)
    assert!(err.contains("resume with the checkpoint's data (--data /") && err.contains("corpus.txt), or start a new run"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every output path is checked before any training: a wrong one fails at once, naming the
/// flag, instead of after the last step.
#[test]
fn output_paths_are_checked_before_training() {
    let dir = tempdir("outputs");
    let file = dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let file = file.to_str().unwrap();
    let folder = dir.to_str().unwrap();
    for (flag, path, says) in [
        ("--checkpoint", file, "is not a folder"),
        ("--save-hf", file, "is not a folder"),
        ("--save", folder, "is a folder"),
        ("--trace", folder, "is a folder"),
        ("--checkpoint", "/proc/shardc-cannot-be-here", "--checkpoint /proc/shardc-cannot-be-here"),
        ("--save", "/proc/shardc-cannot-be-here/p.safetensors", "--save /proc/shardc-cannot-be-here"),
    ] {
        let started = std::time::Instant::now();
        let out = shardc(&["run", "models/tiny.toml", "--steps", "1000000", flag, path]);
        assert!(!out.status.success(), "{flag} {path}");
        assert!(stderr(&out).contains(flag) && stderr(&out).contains(says), "{flag} {path}: {}", stderr(&out));
        assert!(!stdout(&out).contains("loss"), "{flag} {path}: trained before failing");
        assert!(started.elapsed().as_secs() < 60, "{flag} {path}: not refused up front");
    }
    // Outputs that would overwrite an input or each other are refused before anything is
    // written or made (they once overwrote the corpus, wrote the trace over the parameters,
    // and put shardc-named weights in a Hugging Face folder); outputs that only share a
    // folder are not.
    let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
    std::fs::write(at("corpus.txt"), "In the beginning was the corpus. ".repeat(40)).unwrap();
    std::fs::copy(root().join("models/tiny.toml"), at("tiny.toml")).unwrap();
    std::fs::write(at("cluster.toml"), "preset = \"h200\"\n").unwrap();
    let cases: Vec<(Vec<String>, &str, &str)> = vec![
        (vec!["--data".into(), at("corpus.txt"), "--save".into(), at("corpus.txt")], "is the --data file the run reads", "corpus.txt"),
        (vec!["--data".into(), at("corpus.txt"), "--save".into(), format!("{}/../corpus.txt", at("sub"))], "is the --data file the run reads", "corpus.txt"),
        (vec!["--save".into(), at("tiny.toml")], "is the spec file the run reads", "tiny.toml"),
        (vec!["--cluster".into(), at("cluster.toml"), "--save".into(), at("cluster.toml")], "is the --cluster file the run reads", "cluster.toml"),
        (vec!["--mesh".into(), "pp=2".into(), "--save".into(), at("x.st"), "--trace".into(), at("x.st")], "is also the --save file", "x.st"),
        (vec!["--save-hf".into(), at("hf-out"), "--save".into(), at("hf-out/model.safetensors")], "is a file of the --save-hf folder", "hf-out"),
        (vec!["--checkpoint".into(), at("ckpt"), "--save".into(), at("ckpt/LATEST")], "is a file of the --checkpoint folder", "ckpt"),
        (vec!["--save-hf".into(), at("both"), "--save".into(), at("both")], "is also the --save-hf folder", "both"),
        (vec!["--checkpoint".into(), at("ckpt2"), "--save-hf".into(), at("ckpt2/step-00000001")], "of the --checkpoint folder", "ckpt2"),
    ];
    for (args, says, made) in cases {
        let spec = if args.contains(&at("tiny.toml")) { at("tiny.toml") } else { "models/tiny.toml".into() };
        let mut all = vec!["run".to_string(), spec, "--steps".into(), "1".into()];
        all.extend(args.iter().cloned());
        let out = shardc(&all.iter().map(String::as_str).collect::<Vec<_>>());
        let err = unwrapped(&stderr(&out));
        assert!(!out.status.success() && err.contains(says), "{args:?}: wanted `{says}` in {err}");
        assert!(!stdout(&out).contains("loss"), "{args:?}: trained before failing");
        if !made.contains('.') {
            assert!(!dir.join(made).exists(), "{args:?}: made {made} before refusing");
        }
    }
    assert!(std::fs::read_to_string(at("corpus.txt")).unwrap().starts_with("In the beginning"));
    assert!(std::fs::read_to_string(at("tiny.toml")).unwrap().contains("[model]"));
    // A Megatron-LM dataset's other file, and an output through a link whose target's folder
    // is yet to be made (the link's own folder was checked, and the write failed after the
    // run).
    write_megatron(&dir.join("mega"), &(0..2000u32).map(|i| i % 200).collect::<Vec<_>>(), 100);
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--data", &at("mega.bin"), "--save", &at("mega.idx")]);
    assert!(!out.status.success() && unwrapped(&stderr(&out)).contains("is the --data file the run reads"), "{}", stderr(&out));
    std::os::unix::fs::symlink(dir.join("later/made.safetensors"), dir.join("link.safetensors")).unwrap();
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--save", &at("link.safetensors")]);
    assert!(out.status.success() && dir.join("later/made.safetensors").is_file(), "{}", stderr(&out));
    // A run's outputs beside its checkpoints, and --save over the --load file it started from
    // (read whole before training, replaced at once after).
    let weights = at("runs/a/final.safetensors");
    for args in [vec!["--checkpoint", &at("runs/a")[..], "--save", &weights, "--save-hf", &at("runs/a/hf")], vec!["--load", &weights, "--save", &weights]] {
        let out = shardc(&[&["run", "models/tiny.toml", "--steps", "1"][..], &args[..]].concat());
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }
    assert!(dir.join("runs/a/LATEST").is_file() && dir.join("runs/a/hf/config.json").is_file());
    // What a second review found. A spec named config.json in the folder --save-hf writes.
    std::fs::create_dir_all(dir.join("specdir")).unwrap();
    let spec_json = serde_json::to_string(&shardc_ir::spec::parse_file(&root().join("models/tiny.toml")).unwrap()).unwrap();
    std::fs::write(at("specdir/config.json"), &spec_json).unwrap();
    // A hub cache: a snapshot's files are links to blobs another snapshot shares.
    std::fs::create_dir_all(dir.join("cache/blobs")).unwrap();
    std::fs::create_dir_all(dir.join("cache/snapshots/abc")).unwrap();
    std::fs::create_dir_all(dir.join("cache/snapshots/def")).unwrap();
    for (file, blob) in [("config.json", "c1"), ("model.safetensors", "w1")] {
        std::fs::copy(root().join("tests/data/hf-tiny-gpt2").join(file), dir.join("cache/blobs").join(blob)).unwrap();
        for snapshot in ["abc", "def"] {
            std::os::unix::fs::symlink(format!("../../blobs/{blob}"), dir.join("cache/snapshots").join(snapshot).join(file)).unwrap();
        }
    }
    write_small_vocabulary_ids(&dir.join("ids.u16"));
    let hf = |rest: &[&str]| -> Vec<String> { [&["--hf", &at("cache/snapshots/abc")[..], "--data", &at("ids.u16"), "--data-format", "u16", "--seq", "8", "--micro-batch", "2"][..], rest].concat().iter().map(|s| s.to_string()).collect() };
    // A checkpoint of two steps, to resume one step folder of.
    assert!(shardc(&["run", "models/tiny.toml", "--steps", "2", "--checkpoint", &at("ck"), "--checkpoint-every", "1"]).status.success());
    // A folder of another model's sharded weights.
    std::fs::create_dir_all(dir.join("sharded")).unwrap();
    std::fs::write(at("sharded/model.safetensors.index.json"), "{}").unwrap();
    std::os::unix::fs::symlink("loop-b", dir.join("loop-a")).unwrap();
    std::os::unix::fs::symlink("loop-a", dir.join("loop-b")).unwrap();
    std::os::unix::fs::symlink("not-yet", dir.join("dangling-folder")).unwrap();
    std::fs::write(at("p.st"), b"not read: refused first").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["run".into(), at("specdir/config.json"), "--save-hf".into(), at("specdir")], "is the spec file the run reads"),
        ([vec!["run".into()], hf(&["--save", &at("cache/blobs/w1")])].concat(), "is the --hf file the run reads"),
        ([vec!["run".into()], hf(&["--save-hf", &at("cache/snapshots/def")])].concat(), "is the --hf file the run reads"),
        (vec!["run".into(), "models/tiny.toml".into(), "--microbatches".into(), "2".into(), "--load".into(), at("p.st"), "--trace".into(), at("p.st")], "is the --load file the run reads"),
        (vec!["run".into(), "models/tiny.toml".into(), "--resume".into(), at("ck/step-00000001"), "--save".into(), at("ck/LATEST")], "is a file of the --resume folder"),
        (vec!["run".into(), "models/tiny.toml".into(), "--resume".into(), at("ck/step-00000001"), "--save-hf".into(), at("ck/step-00000001")], "of the --resume folder"),
        (vec!["run".into(), "models/tiny.toml".into(), "--save-hf".into(), at("sharded")], "holds model.safetensors.index.json, another model's weights"),
        (vec!["run".into(), "models/tiny.toml".into(), "--save".into(), at("loop-a")], "too many levels of links"),
        (vec!["run".into(), "models/tiny.toml".into(), "--save-hf".into(), at("dangling-folder")], "a link to"),
        // Refused after the output checks once; now before them, and nothing is made.
        (vec!["run".into(), "models/tiny.toml".into(), "--micro-batch".into(), "8".into(), "--trace".into(), at("nd7/t.json"), "--checkpoint".into(), at("nd8")], "--trace writes a pipeline schedule's"),
        (vec!["run".into(), "models/tiny-moe-capacity.toml".into(), "--save-hf".into(), at("nd9")], "--save-hf"),
    ];
    for (args, says) in cases {
        let mut all = args.clone();
        all.extend(["--steps".to_string(), "3".to_string()]);
        let out = shardc(&all.iter().map(String::as_str).collect::<Vec<_>>());
        let err = unwrapped(&stderr(&out));
        assert!(!out.status.success() && err.contains(says) && !stdout(&out).contains("loss"), "{args:?}: wanted `{says}` in {err}");
    }
    assert_eq!(std::fs::read_to_string(at("specdir/config.json")).unwrap(), spec_json);
    assert!(["nd7", "nd8", "nd9", "not-yet"].iter().all(|d| !dir.join(d).exists()), "a refused run made a folder");
    // A trace needs a pipeline: refused up front otherwise, not silently skipped.
    let trace = dir.join("t.json");
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1000000", "--mesh", "dp=2", "--microbatches", "1", "--trace", trace.to_str().unwrap()]);
    assert!(!out.status.success() && stderr(&out).contains("--trace") && !stdout(&out).contains("loss"), "{}", stderr(&out));
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--mesh", "pp=2", "--trace", trace.to_str().unwrap()]);
    assert!(out.status.success() && trace.exists(), "{}", stderr(&out));
    let out = shardc(&["plan", "models/tiny.toml", "--gpus", "2", "--gpu", "a100-80g", "--report", folder]);
    assert!(!out.status.success() && stderr(&out).contains("--report"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint folder has one writer at a time, a changed shard is refused rather than
/// resumed, and what crashed runs left half-written is cleared.
#[test]
fn checkpoint_folders_are_locked_checksummed_and_cleaned() {
    let dir = tempdir("ckpt-guard");
    let ckpt = dir.join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap();
    let base = ["run", "models/tiny.toml", "--micro-batch", "2", "--mesh", "dp=2", "--checkpoint", ckpt_arg];
    // A crashed run's leftovers.
    std::fs::create_dir_all(ckpt.join(".partial-step-00000009-4242")).unwrap();
    std::fs::write(ckpt.join(".LATEST-4242"), "step-00000009").unwrap();
    // Another run holds the folder.
    let held = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(ckpt.join(".lock")).unwrap();
    held.lock().unwrap();
    let out = shardc(&[&base[..], &["--steps", "2"]].concat());
    assert!(!out.status.success() && stderr(&out).contains("another run is writing"), "{}", stderr(&out));
    drop(held);
    let out = shardc(&[&base[..], &["--steps", "2"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!ckpt.join(".partial-step-00000009-4242").exists() && !ckpt.join(".LATEST-4242").exists(), "leftovers cleared");
    // One flipped bit in a shard.
    let shard = ckpt.join("step-00000002").join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    let out = shardc(&["run", "models/tiny.toml", "--micro-batch", "2", "--mesh", "dp=2", "--steps", "3", "--resume", ckpt_arg]);
    assert!(!out.status.success(), "resumed from a changed shard");
    assert!(stderr(&out).contains("00001.safetensors") && stderr(&out).contains("changed after"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Logits of a Hugging Face folder at a mesh, as (shape, values).
fn hf_logits(dir: &str, tokens: &str, mesh: &str, out: &std::path::Path) -> (Vec<usize>, Vec<f64>) {
    let run = shardc(&["logits", "--hf", dir, "--tokens", tokens, "--mesh", mesh, "-o", out.to_str().unwrap()]);
    assert!(run.status.success(), "{dir} {mesh}: {}", stderr(&run));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
    let shape = json["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    (shape, json["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect())
}

fn max_relative(ours: &[f64], theirs: &[f64]) -> f64 {
    let scale = theirs.iter().map(|v| v.abs()).fold(0.0, f64::max);
    ours.iter().zip(theirs).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max) / scale
}

/// Small GPT-2 and Llama models made by `transformers` (tests/data, from
/// scripts/check-hf --fixtures): shardc's logits equal transformers' within 1e-4 at meshes
/// (1,1,1), (1,2,1) and (2,2,2).
#[test]
fn hugging_face_models_give_transformers_logits_on_every_mesh() {
    let out = std::env::temp_dir().join(format!("shardc-hf-logits-{}.json", std::process::id()));
    for family in ["gpt2", "llama"] {
        let dir = format!("tests/data/hf-tiny-{family}");
        let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root().join(&dir).join("expected_logits.json")).unwrap()).unwrap();
        let tokens: Vec<String> = expected["tokens"].as_array().unwrap().iter().map(|row| row.as_array().unwrap().iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",")).collect();
        let want: Vec<f64> = expected["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        for mesh in ["dp=1,tp=1,pp=1", "dp=1,tp=2,pp=1", "dp=2,tp=2,pp=2"] {
            let (shape, got) = hf_logits(&dir, &tokens.join(";"), mesh, &out);
            assert_eq!(shape.iter().map(|&d| d as u64).collect::<Vec<_>>(), expected["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect::<Vec<_>>());
            let error = max_relative(&got, &want);
            assert!(error <= 1e-4, "{family} at {mesh}: logits differ from transformers by {error:.2e}");
        }
    }
    let _ = std::fs::remove_file(out);
}

/// `--save-hf` writes the model back in the Hugging Face layout: a run that does not move the
/// weights (learning rate 0) exports a folder with the same logits as the one it read.
#[test]
fn save_hf_round_trips() {
    let tmp = std::env::temp_dir().join(format!("shardc-save-hf-{}", std::process::id()));
    let out = tmp.join("logits.json");
    // The tiny models' vocabulary is 64 ids: a corpus of bytes below 64 (text: a .bin would
    // be read as uint16 ids).
    std::fs::create_dir_all(&tmp).unwrap();
    let data = tmp.join("data.txt");
    std::fs::write(&data, (0..4096u32).map(|i| ((i * 7 + i / 13) % 64) as u8).collect::<Vec<u8>>()).unwrap();
    for family in ["gpt2", "llama"] {
        let source = format!("tests/data/hf-tiny-{family}");
        let saved = tmp.join(family);
        let run = shardc(&["run", "--hf", &source, "--data", data.to_str().unwrap(), "--steps", "1", "--lr", "1e-30", "--seq", "8", "--micro-batch", "2", "--mesh", "tp=2", "--save-hf", saved.to_str().unwrap()]);
        assert!(run.status.success(), "{}", stderr(&run));
        assert!(saved.join("config.json").exists() && saved.join("model.safetensors").exists());
        // The vocabulary was padded to 256 rows for tp=2 and is exported unpadded.
        let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(saved.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["vocab_size"], 64, "{family}");
        let (_, before) = hf_logits(&source, "1,2,3,4;5,6,7,8", "dp=1,tp=1,pp=1", &out);
        let (_, after) = hf_logits(saved.to_str().unwrap(), "1,2,3,4;5,6,7,8", "dp=1,tp=1,pp=1", &out);
        assert!(max_relative(&after, &before) < 1e-6, "{family}: the exported model computes other logits");
    }
    let _ = std::fs::remove_dir_all(tmp);
}

/// A Hugging Face config's bad value is named by its key in config.json (`num_hidden_layers`,
/// not shardc's `model.layers`), and the command-line overrides are mentioned only when some
/// were given (issue 17).
#[test]
fn hugging_face_config_errors_name_the_config_key() {
    let dir = tempdir("hf-config-keys");
    let edited = |family: &str, key: &str, value: serde_json::Value| {
        let hf = dir.join(format!("{family}-{key}"));
        std::fs::create_dir_all(&hf).unwrap();
        let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root().join(format!("tests/data/hf-tiny-{family}/config.json"))).unwrap()).unwrap();
        config[key] = value;
        std::fs::write(hf.join("config.json"), config.to_string()).unwrap();
        hf.to_str().unwrap().to_string()
    };
    for (family, key, value, says) in [
        ("llama", "num_hidden_layers", serde_json::json!(5000), "`num_hidden_layers`: 5000 layers exceed the supported maximum of 4096"),
        ("gpt2", "n_layer", serde_json::json!(5000), "`n_layer`: 5000 layers exceed the supported maximum of 4096"),
        ("gpt2", "n_head", serde_json::json!(3), "`n_head`: hidden (16) must be divisible by heads (3)"),
        ("llama", "num_key_value_heads", serde_json::json!(3), "`num_key_value_heads`: heads (4) must be a multiple of kv_heads (3)"),
    ] {
        let hf = edited(family, key, value);
        let out = shardc(&["compile", "--hf", &hf]);
        let err = unwrapped(&stderr(&out));
        assert!(!out.status.success() && err.contains(says) && err.contains("config.json"), "{key}: {err}");
        assert!(!err.contains("override") && !err.contains("given") && !err.contains("model."), "{key}: {err}");
    }
    // An override that breaks the model is named, as the flag, and the config's key in the help.
    let out = shardc(&["compile", "--hf", "tests/data/hf-tiny-gpt2", "--seq", "100"]);
    let err = unwrapped(&stderr(&out));
    assert!(!out.status.success() && err.contains("training.seq_len (--seq): seq_len (100) exceeds the model's max_seq (16)") && err.contains("`n_positions`"), "{err}");
    let out = shardc(&["compile", "--hf", "tests/data/hf-tiny-gpt2", "--seq", "100", "--micro-batch", "2"]);
    assert!(unwrapped(&stderr(&out)).contains("(with --seq, --micro-batch given)"), "{}", stderr(&out));
    // A layer in the weights past the config's layer count is named with the key.
    let hf = edited("gpt2", "n_layer", serde_json::json!(1));
    std::fs::copy(root().join("tests/data/hf-tiny-gpt2/model.safetensors"), std::path::Path::new(&hf).join("model.safetensors")).unwrap();
    let out = shardc(&["logits", "--hf", &hf, "--tokens", "1,2,3"]);
    let err = unwrapped(&stderr(&out));
    assert!(!out.status.success() && err.contains("is in layer 1, past config.json's `n_layer` = 1 (layers 0 to 0)"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Architectures and fields shardc does not model are refused by name.
#[test]
fn unsupported_hugging_face_configs_are_named() {
    let tmp = std::env::temp_dir().join(format!("shardc-hf-bad-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let dir = tmp.to_str().unwrap();
    for (config, needle) in [
        (r#"{"model_type": "mistral"}"#, "model_type `mistral`"),
        (r#"{"model_type": "gpt2", "vocab_size": 64, "n_positions": 16, "n_embd": 16, "n_layer": 1, "n_head": 2, "activation_function": "gelu"}"#, "`activation_function`"),
        (r#"{"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16, "rope_scaling": {"type": "linear", "factor": 2.0}}"#, "`rope_scaling`"),
        (r#"{"model_type": "llama", "hidden_size": 16}"#, "is missing"),
    ] {
        std::fs::write(tmp.join("config.json"), config).unwrap();
        let out = shardc(&["compile", "--hf", dir]);
        assert!(!out.status.success(), "{config}");
        assert!(stderr(&out).contains(needle), "{config}: {}", stderr(&out));
        assert!(!stderr(&out).contains("panicked"));
    }
    let _ = std::fs::remove_dir_all(tmp);
}

/// A model saved in shards (`model-0000X-of-0000N.safetensors` with its index) reads the same.
#[test]
fn sharded_hugging_face_weights_read_the_same() {
    let tmp = std::env::temp_dir().join(format!("shardc-hf-shards-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let source = root().join("tests/data/hf-tiny-llama");
    std::fs::copy(source.join("config.json"), tmp.join("config.json")).unwrap();
    let tensors = shardc_runtime::hf::read_dir(&source).unwrap();
    let all: Vec<(String, Vec<usize>, Vec<f32>)> = tensors.iter().map(|(n, (s, v))| (n.clone(), s.clone(), v.iter().map(|&x| x as f32).collect())).collect();
    let (first, second) = all.split_at(all.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", second)] {
        shardc_runtime::hf::write_safetensors(&tmp.join(file), part).unwrap();
        for (name, _, _) in part {
            map.insert(name.clone(), serde_json::Value::String(file.into()));
        }
    }
    std::fs::write(tmp.join("model.safetensors.index.json"), serde_json::json!({"metadata": {}, "weight_map": map}).to_string()).unwrap();
    let out = tmp.join("logits.json");
    let (_, whole) = hf_logits("tests/data/hf-tiny-llama", "1,2,3,4", "dp=1,tp=1,pp=1", &out);
    let (_, sharded) = hf_logits(tmp.to_str().unwrap(), "1,2,3,4", "dp=1,tp=1,pp=1", &out);
    assert_eq!(whole, sharded);
    let _ = std::fs::remove_dir_all(tmp);
}

/// A rank that panics, fails a kernel or stops answering ends the whole run (tp=2, pp=2)
/// within the timeout plus 5 s, with an error naming the failed rank, its instruction and
/// the collective that was waiting; the process exits non-zero and never hangs.
#[test]
fn rank_faults_end_the_run_with_the_cause_named() {
    for kind in ["panic", "kernel", "hang"] {
        let began = std::time::Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_shardc"))
            .args(["run", "models/tiny.toml", "--mesh", "tp=2,pp=2", "--microbatches", "2", "--steps", "3", "--timeout", "3"])
            .current_dir(root())
            .env("NO_COLOR", "1")
            .env("RUST_BACKTRACE", "0")
            .env("SHARDC_FAULT", format!("1:30:{kind}"))
            .output()
            .unwrap();
        let elapsed = began.elapsed().as_secs_f64();
        let err = stderr(&out).replace('│', " ").split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(!out.status.success(), "{kind}: the run succeeded");
        assert!(elapsed < 3.0 + 5.0, "{kind}: took {elapsed:.1} s");
        assert!(err.contains("rank 1") && err.contains("instruction 30"), "{kind}: {err}");
        assert!(err.contains("recv") || err.contains("reduce-scatter") || err.contains("all-reduce"), "{kind}: no waiting collective named: {err}");
        match kind {
            "panic" => assert!(err.contains("rank 1 failed: panicked: injected fault"), "{err}"),
            "kernel" => assert!(err.contains("rank 1 failed: instruction 30") && err.contains("injected kernel failure"), "{err}"),
            _ => assert!(err.contains("no message from rank 1 within 3s") && err.contains("hung (injected)"), "{err}"),
        }
    }
}

/// `--check-numerics` stops at the first op that makes a NaN or an infinity and names it
/// with its layer; without it a diverging run is caught only at the loss.
#[test]
fn check_numerics_names_the_first_op_that_overflows() {
    // No clipping: it would tame the divergence this test needs.
    let base = ["run", "models/tiny.toml", "--lr", "1e4", "--optimizer", "sgd", "--steps", "20", "--clip-grad", "0"];
    let out = shardc(&[&base[..], &["--check-numerics"]].concat());
    let err = stderr(&out).replace('│', " ").split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(!out.status.success());
    assert!(err.contains("produced") && (err.contains("inf") || err.contains("NaN")) && err.contains("at lm_head"), "{err}");
    let out = shardc(&[&base[..], &["--mesh", "tp=2", "--check-numerics"]].concat());
    let err = stderr(&out).replace('│', " ").split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(err.contains("rank ") && err.contains("produced"), "{err}");
    let plain = shardc(&base);
    assert!(stderr(&plain).contains("the loss became"), "{}", stderr(&plain));
}

/// With the GPU named, a plan that does not fit its memory is refused with the estimate per
/// component and the cheapest change that fits; without `--gpu` the summary only says so.
#[test]
fn over_memory_plans_are_refused_with_a_fix() {
    // GPT-2 small in mixed precision, 96 sequences of 1024 per replica (64 fit since the
    // loss reads the bf16 logits without an fp32 copy).
    let args = ["compile", "models/gpt2-small.toml", "--mesh", "dp=2", "--seq", "1024", "--micro-batch", "96", "--microbatches", "1", "--dtype", "bf16"];
    let out = shardc(&[&args[..], &["--gpu", "a100-40g"]].concat());
    let err = stderr(&out).replace('│', " ").split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(!out.status.success(), "{err}");
    for part in ["per GPU but a100-40g has 42.9 GB", "weights", "gradients", "optimizer", "activations", "temporaries", "cheapest change that fits: --recompute full"] {
        assert!(err.contains(part), "missing `{part}`: {err}");
    }
    let ok = shardc(&args);
    assert!(ok.status.success(), "{}", stderr(&ok));
    let fits = shardc(&[&args[..], &["--gpu", "a100-40g", "--recompute", "full"]].concat());
    assert!(fits.status.success(), "{}", stderr(&fits));
    // `run` refuses the same plan before training.
    let run = shardc(&["run", "models/gpt2-small.toml", "--mesh", "dp=2", "--seq", "1024", "--micro-batch", "96", "--microbatches", "1", "--dtype", "bf16", "--gpu", "a100-40g", "--steps", "1"]);
    assert!(!run.status.success() && stderr(&run).contains("cheapest change that fits"), "{}", stderr(&run));
}

/// Megatron-LM's batch conventions: `--micro-batch` is per data-parallel replica, the global
/// batch is micro-batch x dp x micro-batches, and the micro-batches are derived from the
/// global batch when not given, at any pp; what the summary says is what the programs run.
#[test]
fn batch_sizes_follow_megatron() {
    // GPT-3 175B at dp=8, tp=8, pp=16 with micro-batch 1 per replica: 1536 / 8 = 192.
    let out = shardc(&["compile", "models/gpt3-175b.toml", "--mesh", "dp=8,tp=8,pp=16"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("micro-batch 1 per replica x dp 8, 192 micro-batches per step (global batch 1536 sequences)"), "{}", stdout(&out));
    // tiny's global batch of 8 at dp=2, tp=2 with 2 per replica: 2 micro-batches, and the
    // compiled programs carry 2, with 2 x 2 rows each.
    let dir = tempdir("batch");
    let plan = dir.join("plan.json");
    let out = shardc(&["compile", "models/tiny.toml", "--mesh", "dp=2,tp=2", "-o", plan.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("micro-batch 2 per replica x dp 2, 2 micro-batches per step (global batch 8 sequences)"), "{}", stdout(&out));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let rank = json["programs"].as_array().unwrap().iter().find(|p| p["pipeline"].is_object()).unwrap();
    assert_eq!(rank["pipeline"]["microbatches"], 2);
    let tokens = rank["args"].as_array().unwrap().iter().find(|a| a["name"] == "tokens").unwrap();
    assert_eq!(tokens["layout"]["global_shape"], serde_json::json!([4, 8]));
    // An inconsistent triple names all three numbers and a fix.
    let out = shardc(&["compile", "models/tiny.toml", "--mesh", "dp=2", "--microbatches", "3", "--global-batch", "8"]);
    let err = stderr(&out).replace('│', " ").split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(out.status.code(), Some(1), "{err}");
    for part in ["global batch 8", "micro-batch 2", "dp 2", "3 micro-batches", "--global-batch 12"] {
        assert!(err.contains(part), "missing `{part}`: {err}");
    }
    let out = shardc(&["run", "models/tiny.toml", "--mesh", "dp=3"]);
    assert!(stderr(&out).contains("global batch 8 is not a multiple of micro-batch 2 x dp 3 = 6"), "{}", stderr(&out));
}

/// The tied embedding's gradient with dp = 2 and 2 micro-batches (pp = 1): the same losses
/// as one device on the same 16 sequences a step (its lookup part was once lost).
#[test]
fn tied_embeddings_with_data_parallel_accumulation_match_one_device() {
    for spec in ["models/tiny.toml", "models/tiny-llama.toml"] {
        let run = |extra: &[&str]| losses_by_step(&shardc(&[&["run", spec, "--steps", "3", "--log-every", "1"][..], extra].concat()));
        let one = run(&["--micro-batch", "16", "--microbatches", "1"]);
        for extra in [&["--mesh", "dp=2", "--micro-batch", "4", "--microbatches", "2"][..], &["--mesh", "dp=2", "--micro-batch", "4", "--microbatches", "2", "--zero", "1"], &["--mesh", "dp=2,pp=2", "--micro-batch", "4", "--microbatches", "2"]] {
            assert_same_losses(&one, &run(extra), &format!("{spec} {extra:?}"));
        }
    }
}

/// `--dtype bf16` trains in mixed precision on the CPU (bf16 storage, f32 arithmetic, fp32
/// master weights, moments and gradients): over 50 steps of tiny its loss curve (the mean of
/// each 5 steps) stays within 2% of the f32 run's and falls as far, on one device and on
/// dp=2,tp=2 with ZeRO-1. Single steps stay within 5%: the two models drift apart slowly (AdamW
/// turns bf16 rounding into full-size steps on small gradients), so a rare token can cost one
/// model a few nats more than the other (step 42 here: 3% of the step's mean loss).
#[test]
fn bf16_mixed_precision_follows_the_f32_loss_curve() {
    for mesh in ["dp=1", "dp=2,tp=2"] {
        let run = |dtype: &str| losses_by_step(&shardc(&["run", "models/tiny.toml", "--mesh", mesh, "--zero", if mesh == "dp=1" { "0" } else { "1" }, "--dtype", dtype, "--steps", "50", "--log-every", "1"]));
        let (f32, bf16) = (run("f32"), run("bf16"));
        assert_eq!(bf16.len(), 50);
        for (step, want) in &f32 {
            let got = bf16[step];
            assert!((got - want).abs() <= 0.05 * want, "{mesh} step {step}: bf16 {got} vs f32 {want}");
        }
        let means = |c: &std::collections::BTreeMap<u64, f64>| c.values().copied().collect::<Vec<f64>>().chunks(5).map(|w| w.iter().sum::<f64>() / 5.0).collect::<Vec<f64>>();
        for (window, (want, got)) in means(&f32).iter().zip(means(&bf16)).enumerate() {
            assert!((got - want).abs() <= 0.02 * want, "{mesh} steps {}-{}: bf16 mean {got} vs f32 {want}", 5 * window + 1, 5 * window + 5);
        }
        let fall = |c: &std::collections::BTreeMap<u64, f64>| c[&1] - c[&50];
        assert!(fall(&f32) > 0.3 && (fall(&bf16) - fall(&f32)).abs() <= 0.1 * fall(&f32), "{mesh}: f32 falls {}, bf16 {}", fall(&f32), fall(&bf16));
    }
}

/// A padded vocabulary moves between meshes: tiny with `vocab_multiple = 100` is padded to
/// 400 rows at tp=2 and to 300 at tp=1; a checkpoint of the tp=2 run resumes at tp=1 (and in
/// `--save` files the table has its 256 real rows) with the losses of an uninterrupted run.
#[test]
fn padded_vocabularies_checkpoint_across_tensor_parallel_degrees() {
    let dir = tempdir("padded");
    let spec = dir.join("tiny-padded.toml");
    let text = std::fs::read_to_string(root().join("models/tiny.toml")).unwrap().replace("dtype = \"f32\"", "dtype = \"f32\"\nvocab_multiple = 100");
    std::fs::write(&spec, text).unwrap();
    let spec = spec.to_str().unwrap();
    let ckpt = dir.join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let out = shardc(&["compile", spec, "--mesh", "tp=2"]);
    assert!(stdout(&out).contains("vocab 256 (padded to 400, a multiple of 100 x tp 2)"), "{}", stdout(&out));
    let base = ["run", spec, "--log-every", "1", "--lr-decay-steps", "20"];
    let with = |extra: &[&str]| shardc(&[&base[..], extra].concat());
    let uninterrupted = losses_by_step(&with(&["--steps", "20"]));
    let first = losses_by_step(&with(&["--mesh", "tp=2", "--steps", "10", "--checkpoint", ckpt]));
    assert_same_losses(&uninterrupted, &first, "tp=2, padded to 400");
    let saved = dir.join("params.safetensors");
    let resumed = losses_by_step(&with(&["--steps", "20", "--resume", ckpt, "--save", saved.to_str().unwrap()]));
    assert_eq!(resumed.keys().copied().collect::<Vec<_>>(), (11..=20).collect::<Vec<u64>>());
    assert_same_losses(&uninterrupted, &resumed, "resumed at tp=1, padded to 300");
    let tensors = shardc_runtime::checkpoint::from_bytes(&std::fs::read(&saved).unwrap()).unwrap();
    assert_eq!(tensors["embed.tokens.weight"].0, vec![256, 16]);
    let _ = std::fs::remove_dir_all(dir);
}

/// GPT-2's and GPT-3's vocabulary of 50257 is padded for tensor parallelism, so tp=4 and tp=8
/// split the embedding, the LM head and the loss over the vocabulary: `explain` shows the
/// vocab-parallel cross-entropy's collectives and the lookup's partial sum, and no collective
/// gathers the logits.
#[test]
fn gpt_vocabularies_are_vocab_parallel_at_tp_4_and_8() {
    for (spec, mesh, padded) in [("models/gpt2-small.toml", "tp=4", "50688"), ("models/gpt3-175b.toml", "tp=8", "51200")] {
        let out = shardc(&["explain", spec, "--mesh", mesh, "--seq", "128", "--micro-batch", "1", "--microbatches", "1", "--no-comm-opt"]);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        for part in ["vocab-parallel cross-entropy of `loss`: max over the vocabulary shards", "partial sum reduced for operand 0 of xf.add `embed.positions`"] {
            assert!(text.contains(part), "{spec} {mesh}: missing `{part}`");
        }
        assert!(!text.lines().any(|l| l.contains("all_gather") && l.contains("lm_head")), "{spec} {mesh}: logits gathered");
        let summary = stdout(&shardc(&["compile", spec, "--mesh", mesh, "--seq", "128", "--micro-batch", "1", "--microbatches", "1", "--no-comm-opt"]));
        assert!(summary.contains(&format!("vocab 50257 (padded to {padded}")), "{summary}");
    }
}

/// `logits` refuses token ids outside the model's vocabulary, naming the real size: the tiny
/// models have 64 ids, padded to 128 rows (tp=1) or 512 (tp=4); an id in the padding once
/// read a zero row and gave logits for a token the model does not have.
#[test]
fn logits_refuse_token_ids_outside_the_real_vocabulary() {
    let out = std::env::temp_dir().join(format!("shardc-logits-range-{}.json", std::process::id()));
    for mesh in ["dp=1,tp=1,pp=1", "dp=1,tp=4,pp=1"] {
        for tokens in ["1,2,64", "1,2,100", "1,2,-1"] {
            let run = shardc(&["logits", "--hf", "tests/data/hf-tiny-gpt2", "--tokens", tokens, "--mesh", mesh, "-o", out.to_str().unwrap()]);
            let err = stderr(&run).replace('│', " ").split_whitespace().collect::<Vec<_>>().join(" ");
            assert_eq!(run.status.code(), Some(1), "{mesh} {tokens}: {}", stdout(&run));
            assert!(err.contains("vocabulary of 64"), "{mesh} {tokens}: {err}");
            assert!(!err.contains("panicked"), "{err}");
        }
    }
    let _ = std::fs::remove_file(out);
}

/// A checkpoint holds real-shaped tensors and (in mixed precision) fp32 masters, so neither
/// `model.vocab_multiple` nor `model.dtype` makes it another model: a run resumes under
/// another padding with the uninterrupted losses, an f32 checkpoint resumes in bf16 (each
/// master starts as its parameter), and a bf16 checkpoint resumes in f32 from the masters,
/// not from the bf16-rounded parameters. Spec numbers compare by value (`256` and `256.0`).
/// A real change of model is refused by field.
#[test]
fn checkpoints_resume_under_another_padding_and_precision() {
    let dir = tempdir("precision");
    let spec = dir.join("tiny-padded.toml");
    let text = std::fs::read_to_string(root().join("models/tiny.toml")).unwrap().replace("dtype = \"f32\"", "dtype = \"f32\"\nvocab_multiple = 100");
    std::fs::write(&spec, text).unwrap();
    let padded = spec.to_str().unwrap();
    let run = |spec: &str, extra: &[&str]| shardc(&[&["run", spec, "--log-every", "1", "--lr-decay", "constant"][..], extra].concat());
    // Padding: 400 rows at tp=2 (multiple 100) resumed with 256 (the default 128).
    let ckpt = dir.join("padding");
    let uninterrupted = losses_by_step(&run("models/tiny.toml", &["--steps", "8"]));
    losses_by_step(&run(padded, &["--mesh", "tp=2", "--steps", "4", "--checkpoint", ckpt.to_str().unwrap()]));
    let resumed = losses_by_step(&run("models/tiny.toml", &["--mesh", "tp=2", "--steps", "8", "--resume", ckpt.to_str().unwrap()]));
    assert_eq!(resumed.keys().copied().collect::<Vec<_>>(), (5..=8).collect::<Vec<u64>>());
    assert_same_losses(&uninterrupted, &resumed, "resumed with another vocab_multiple");
    // The manifest rewritten by a JSON tool that writes integers as floats (`256.0`) is the
    // same model.
    let manifest = ckpt.join("step-00000004/manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap().replace("\"vocab\": 256", "\"vocab\": 256.0").replace("\"layers\": 2", "\"layers\": 2.0");
    assert!(text.contains("256.0") && text.contains("2.0"), "{text}");
    std::fs::write(&manifest, text).unwrap();
    let rewritten = losses_by_step(&run("models/tiny.toml", &["--mesh", "tp=2", "--steps", "8", "--resume", ckpt.to_str().unwrap()]));
    assert_same_losses(&uninterrupted, &rewritten, "resumed from a manifest whose integers became floats");
    // f32 -> bf16.
    let ckpt = dir.join("f32");
    losses_by_step(&run("models/tiny.toml", &["--steps", "4", "--checkpoint", ckpt.to_str().unwrap()]));
    let resumed = losses_by_step(&run("models/tiny.toml", &["--dtype", "bf16", "--mesh", "dp=2,tp=2", "--zero", "1", "--steps", "8", "--resume", ckpt.to_str().unwrap()]));
    for (step, loss) in &resumed {
        assert!((loss - uninterrupted[step]).abs() <= 0.02 * loss, "step {step}: bf16 resumed {loss}, f32 {}", uninterrupted[step]);
    }
    // bf16 -> f32: with a negligible learning rate the f32 run saves what it started from,
    // which must be the bf16 run's fp32 masters (what its --save wrote), not their bf16
    // rounding (a relative difference of up to 2^-9).
    let ckpt = dir.join("bf16");
    let masters = dir.join("masters.safetensors");
    losses_by_step(&run("models/tiny.toml", &["--dtype", "bf16", "--steps", "4", "--checkpoint", ckpt.to_str().unwrap(), "--save", masters.to_str().unwrap()]));
    let after = dir.join("after.safetensors");
    losses_by_step(&run("models/tiny.toml", &["--mesh", "tp=2", "--steps", "5", "--lr", "1e-30", "--override-schedule", "--resume", ckpt.to_str().unwrap(), "--save", after.to_str().unwrap()]));
    let read = |p: &std::path::Path| shardc_runtime::checkpoint::from_bytes(&std::fs::read(p).unwrap()).unwrap();
    let (masters, after) = (read(&masters), read(&after));
    assert_eq!(masters.len(), after.len());
    for (name, (shape, values)) in &masters {
        assert_eq!(&after[name].0, shape, "{name}");
        for (a, m) in after[name].1.iter().zip(values) {
            assert!((a - m).abs() <= 1e-6 * m.abs() + 1e-20, "{name}: the f32 run started from {a}, the master is {m}");
        }
    }
    // Another model is still refused, by field.
    let out = run("models/tiny-llama.toml", &["--steps", "5", "--resume", ckpt.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("norm"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(dir);
}

/// The summary's per-stage parameter count is per rank on a partitioned mesh, padded or not:
/// tiny's vocabulary padded to 400 rows (`vocab_multiple = 100`) counts like the unpadded 256,
/// not as the whole real table on every rank.
#[test]
fn stage_parameter_counts_are_per_rank_with_a_padded_vocabulary() {
    let dir = tempdir("stage-params");
    let stage_lines = |multiple: u64, mesh: &[&str]| {
        let spec = dir.join(format!("tiny-{multiple}.toml"));
        let text = std::fs::read_to_string(root().join("models/tiny.toml")).unwrap().replace("dtype = \"f32\"", &format!("dtype = \"f32\"\nvocab_multiple = {multiple}"));
        std::fs::write(&spec, text).unwrap();
        let out = shardc(&[&["compile", spec.to_str().unwrap()][..], mesh].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out).lines().filter(|l| l.contains(" parameters, ")).map(|l| l.split(" parameters, ").next().unwrap().rsplit(' ').next().unwrap().to_string()).collect::<Vec<_>>()
    };
    for mesh in [&["--mesh", "tp=1"][..], &["--mesh", "tp=2"], &["--mesh", "dp=2,tp=2", "--zero", "3"], &["--mesh", "tp=2,pp=2"]] {
        let (padded, unpadded) = (stage_lines(100, mesh), stage_lines(1, mesh));
        assert!(!padded.is_empty());
        assert_eq!(padded, unpadded, "{mesh:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Batch sizes at the largest each field accepts (micro-batch 2^31) never crash: their
/// activations pass the 2^48 elements a tensor may have, so compile and run refuse them naming
/// the field and the limit (the memory plan's sums once overflowed, a panic in debug builds
/// and wrong sizes in release); the largest micro-batches within the limit compile to a plan
/// that is priced and does not fit.
#[test]
fn the_largest_batch_sizes_end_in_a_plan_or_an_error_never_a_crash() {
    let huge = ["--micro-batch", "2147483648", "--global-batch", "2147483648"];
    for command in [&["compile", "models/gpt3-175b.toml", "--mesh", "tp=8,pp=16"][..], &["run", "models/gpt2-small.toml", "--steps", "1"][..]] {
        let out = shardc(&[command, &huge].concat());
        let err = unwrapped(&stderr(&out));
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(!err.contains("panicked") && !err.contains("memory allocation of"), "{err}");
        assert!(err.contains("training.micro_batch (--micro-batch): a micro-batch's activations") && err.contains("(2^48)"), "{err}");
    }
    let out = shardc(&["compile", "models/gpt3-175b.toml", "--mesh", "tp=8,pp=16", "--micro-batch", "2048", "--global-batch", "2048"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("does NOT fit"), "{}", stdout(&out));
}

/// `--check-numerics` with a vocab-parallel loss whose tensor-parallel ranks hold only padding
/// (the tiny Hugging Face models' 64 ids padded to 512 rows at tp=4: ranks 1 to 3 have no real
/// class): the empty shard's row maximum is no false alarm, in f32 and bf16, and the losses
/// are those of the unchecked run.
#[test]
fn check_numerics_accepts_shards_of_padding_only() {
    let dir = tempdir("numerics-padding");
    let data = dir.join("data.txt");
    std::fs::write(&data, (0..4096u32).map(|i| ((i * 7 + i / 13) % 64) as u8).collect::<Vec<u8>>()).unwrap();
    for dtype in ["f32", "bf16"] {
        for mesh in ["tp=4", "dp=2,tp=2"] {
            let args = ["run", "--hf", "tests/data/hf-tiny-gpt2", "--data", data.to_str().unwrap(), "--seq", "8", "--micro-batch", "1", "--global-batch", "4", "--steps", "2", "--log-every", "1", "--dtype", dtype, "--mesh", mesh];
            let unchecked = losses_by_step(&shardc(&args));
            let checked = shardc(&[&args[..], &["--check-numerics"]].concat());
            assert!(checked.status.success(), "{dtype} {mesh}: {}", stderr(&checked));
            assert_same_losses(&unchecked, &losses_by_step(&checked), &format!("{dtype} {mesh} with --check-numerics"));
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn calibrate_writes_a_cluster_that_compile_and_bench_price_with() {
    let dir = tempdir("calibrate");
    let file = dir.join("cpu.toml");
    let out = shardc(&["calibrate", "models/tiny.toml", "--quick", "--repeats", "2", "-o", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&file).unwrap();
    let cluster = shardc_ir::cluster::Cluster::from_toml(&text).unwrap();
    assert_eq!(cluster.gpu.name, "cpu");
    assert!(cluster.shared_host, "CPU ranks share the host's cores");
    for (what, x) in [("peak", cluster.gpu.fp32_flops), ("bandwidth", cluster.gpu.memory_bandwidth), ("dispatch", cluster.gpu.kernel_launch), ("link", cluster.intra_node.bandwidth)] {
        assert!(x.is_finite() && x > 0.0, "{what} = {x}");
    }
    assert!(stderr(&out).contains("GEMM peak"), "{}", stderr(&out));
    // The written file is exactly what the model reads back.
    assert_eq!(shardc_ir::cluster::Cluster::from_toml(&cluster.to_toml()).unwrap(), cluster);

    // compile prices the step with it; two ranks on one host share its cores.
    let out = shardc(&["compile", "models/tiny.toml", "--mesh", "dp=2", "--cluster", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("on 2 x cpu") && stdout(&out).contains("shared cores"), "{}", stdout(&out));

    // bench prints the prediction beside the measurement, and per class with --profile.
    let out = shardc(&["bench", "models/tiny.toml", "--steps", "2", "--profile", "--cluster", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("  predicted") && text.contains("vs the fastest step"), "{text}");
    for class in ["gemm", "attention", "memory-bound", "optimizer", "xf.matmul"] {
        assert!(text.lines().any(|l| l.trim_start().starts_with(class)), "no {class} row:\n{text}");
    }
    let out = shardc(&["bench", "models/tiny.toml", "--steps", "1", "--mesh", "dp=2", "--microbatches", "1", "--profile", "--cluster", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("mesh dp=2") && text.contains("  predicted"), "{text}");
    assert!(text.lines().any(|l| l.trim_start().starts_with("all_reduce dp")), "rank 0's gradient sync is profiled:\n{text}");

    // Bad input is named.
    let out = shardc(&["calibrate", "models/tiny.toml", "--repeats", "0"]);
    assert!(!out.status.success() && stderr(&out).contains("--repeats"), "{}", stderr(&out));
    let out = shardc(&["calibrate", "models/tiny.toml", "--quick", "--dtype", "bf16"]);
    assert!(!out.status.success() && stderr(&out).contains("--dtype f32"), "{}", stderr(&out));
    let out = shardc(&["calibrate", "models/tiny.toml", "--quick", "-o", "/nonexistent/shardc/cpu.toml"]);
    assert!(!out.status.success() && stderr(&out).contains("/nonexistent/shardc/cpu.toml"), "{}", stderr(&out));
    let out = shardc(&["bench", "models/tiny.toml", "--mesh", "pp=2", "--profile"]);
    assert!(!out.status.success() && stderr(&out).contains("--profile"), "{}", stderr(&out));
    std::fs::remove_dir_all(&dir).ok();
}

/// GPU calibration in its two halves (the programs emitted here, their times from elsewhere,
/// the fit here): times made by a known cluster model are fitted back to its parameters. And
/// in one process on the emulated device.
#[test]
fn gpu_calibration_recovers_the_parameters_that_made_the_times() {
    use shardc_ir::cluster::Cluster;
    let dir = tempdir("calibrate-gpu");
    let kernels = dir.join("kernels");
    let out = shardc(&["calibrate", "models/tiny.toml", "--backend", "cuda", "--gpu", "h100-sxm", "--quick", "--emit", kernels.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("shardc-gpu calibrate"), "{}", stderr(&out));
    // The device that made the times: an H100 at other shares of its peaks.
    let mut known = Cluster::preset("h100-sxm").unwrap();
    known.gpu.gemm_efficiency = 0.6;
    known.gpu.gemm_k_overhead = 64.0;
    known.gpu.attention_efficiency = 0.35;
    known.gpu.vector_efficiency = 0.25;
    known.gpu.memory_efficiency = 0.7;
    known.gpu.kernel_launch = 6e-6;
    let list: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(kernels.join("kernels.json")).unwrap()).unwrap();
    assert!(list.len() > 20, "{} kernels", list.len());
    // The chain that times a launch launches each of its 200 adds (fused, it would be one
    // kernel: on an H200 it timed 0.1 us a "launch").
    let chain: shardc_runtime::Program = serde_json::from_str(&std::fs::read_to_string(kernels.join(list[1]["program"].as_str().unwrap())).unwrap()).unwrap();
    assert!(list[1]["name"].as_str().unwrap().contains("200 dependent tiny adds"), "{:?}", list[1]);
    let launches = chain.device.as_ref().unwrap().calls.iter().flatten().filter(|c| matches!(c, shardc_runtime::program::DeviceCall::Launch { .. })).count();
    assert_eq!(launches, 200);
    let mut measured = serde_json::Map::new();
    for k in &list {
        let program: shardc_runtime::Program = serde_json::from_str(&std::fs::read_to_string(kernels.join(k["program"].as_str().unwrap())).unwrap()).unwrap();
        assert!(program.device.is_some(), "each kernel program carries its device code");
        let seconds: f64 = program.instrs.iter().map(|i| shardc_codegen::estimate::instruction_cost(&program, i, &known).1).sum();
        measured.insert(k["name"].as_str().unwrap().to_string(), serde_json::json!(seconds));
    }
    let times = dir.join("measured.json");
    std::fs::write(&times, serde_json::to_string(&measured).unwrap()).unwrap();
    let file = dir.join("h100.toml");
    let out = shardc(&["calibrate", "models/tiny.toml", "--backend", "cuda", "--gpu", "h100-sxm", "--quick", "--measured", times.to_str().unwrap(), "-o", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let fitted = Cluster::from_toml(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let g = &fitted.gpu;
    for (what, got, want, tolerance) in [
        ("memory_efficiency", g.memory_efficiency, 0.7, 0.02),
        ("kernel_launch", g.kernel_launch, 6e-6, 0.02),
        ("gemm_efficiency", g.gemm_efficiency, 0.6, 0.05),
        ("gemm_k_overhead", g.gemm_k_overhead, 64.0, 0.05),
        ("attention_efficiency", g.attention_efficiency, 0.35, 0.05),
    ] {
        assert!((got / want - 1.0).abs() < tolerance, "{what}: fitted {got}, made with {want}\n{}", stderr(&out));
    }
    // The preset's physics stays: peaks, SMs, tile, bandwidth, links.
    let preset = Cluster::preset("h100-sxm").unwrap();
    assert_eq!((g.bf16_flops, g.sms, g.gemm_tile, g.memory_bandwidth), (preset.gpu.bf16_flops, preset.gpu.sms, preset.gpu.gemm_tile, preset.gpu.memory_bandwidth));
    assert_eq!(fitted.inter_node, preset.inter_node);
    // compile prices with it.
    let out = shardc(&["compile", "models/tiny.toml", "--cluster", file.to_str().unwrap()]);
    assert!(out.status.success() && stdout(&out).contains("estimate"), "{}", stderr(&out));

    // In one process, on the CPU emulation of the device (its times mean nothing; the path
    // is the one a GPU takes).
    let emulated = dir.join("emulated.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_shardc"))
        .args(["calibrate", "models/tiny.toml", "--backend", "cuda", "--gpu", "h100-sxm", "--quick", "--repeats", "1", "-o", emulated.to_str().unwrap()])
        .current_dir(root())
        .env("SHARDC_GPU_EMULATE", "1")
        .output()
        .unwrap();
    if cfg!(feature = "cuda") {
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(Cluster::from_toml(&std::fs::read_to_string(&emulated).unwrap()).is_ok());
    } else {
        assert!(stderr(&out).contains("--emit DIR"), "{}", stderr(&out));
    }

    // Bad input is named.
    let out = shardc(&["calibrate", "models/tiny.toml", "--backend", "cuda", "--quick"]);
    assert!(!out.status.success() && stderr(&out).contains("--gpu"), "{}", stderr(&out));
    let out = shardc(&["calibrate", "models/tiny.toml", "--quick", "--emit", kernels.to_str().unwrap()]);
    assert!(!out.status.success() && stderr(&out).contains("--backend cuda"), "{}", stderr(&out));
    std::fs::write(&times, "{}").unwrap();
    let out = shardc(&["calibrate", "models/tiny.toml", "--backend", "cuda", "--gpu", "h100-sxm", "--quick", "--measured", times.to_str().unwrap()]);
    assert!(!out.status.success() && stderr(&out).contains("no time for"), "{}", stderr(&out));
    let out = shardc(&["calibrate", "models/tiny.toml", "--backend", "tpu"]);
    assert!(!out.status.success() && stderr(&out).contains("--backend tpu"), "{}", stderr(&out));
    std::fs::remove_dir_all(&dir).ok();
}

/// A measured.json whose times are not times of a kernel run (zero, negative, a launch chain
/// of 1e-322 s, 1e300 s) is refused, naming the file, the kernel and the range; never fitted
/// into shares pinned at their bounds or a cluster TOML that --cluster refuses.
#[test]
fn gpu_calibration_refuses_implausible_measured_times() {
    let dir = tempdir("calibrate-gpu-hostile");
    let kernels = dir.join("kernels");
    let out = shardc(&["calibrate", "models/tiny.toml", "--backend", "cuda", "--gpu", "h100-sxm", "--quick", "--emit", kernels.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let list: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(kernels.join("kernels.json")).unwrap()).unwrap();
    let names: Vec<String> = list.iter().map(|k| k["name"].as_str().unwrap().to_string()).collect();
    let times = dir.join("measured.json");
    let file = dir.join("fitted.toml");
    // (index of the kernel given the bad time, its time)
    for (bad, seconds) in [(1usize, 1e-322), (5, 0.0), (5, -1e-3), (7, 1e300), (0, 1e-300)] {
        let mut measured = serde_json::Map::new();
        for (i, name) in names.iter().enumerate() {
            measured.insert(name.clone(), serde_json::json!(if i == bad { seconds } else { 1e-5 * (1 + i % 7) as f64 }));
        }
        std::fs::write(&times, serde_json::to_string(&measured).unwrap()).unwrap();
        std::fs::remove_file(&file).ok();
        let out = shardc(&["calibrate", "models/tiny.toml", "--backend", "cuda", "--gpu", "h100-sxm", "--quick", "--measured", times.to_str().unwrap(), "-o", file.to_str().unwrap()]);
        let err = stderr(&out);
        assert!(!out.status.success(), "{seconds} s for `{}` was fitted:\n{err}", names[bad]);
        assert!(err.contains("--measured") && err.contains(names[bad].split_whitespace().nth(1).unwrap()) && err.contains("time"), "{err}");
        assert!(!file.exists(), "no TOML written for {seconds} s");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The rows of `shardc plan`'s table: (strategy, memory in GB, bound-by column).
fn plan_rows(text: &str) -> Vec<(String, f64, String)> {
    text.lines()
        .filter(|l| l.split_whitespace().next().is_some_and(|w| w.parse::<usize>().is_ok()) && l.contains(" GB  "))
        .map(|l| {
            let (head, bound) = l.split_once(" GB  ").unwrap();
            let memory: f64 = head.split_whitespace().last().unwrap().parse().unwrap();
            // The label ends with the ZeRO stage: `z0` to `z3`.
            let words: Vec<&str> = head.split_whitespace().skip(1).collect();
            let end = words.iter().position(|w| w.len() == 2 && w.starts_with('z')).unwrap_or(words.len() - 1);
            let strategy = words[..=end].join(" ");
            (strategy, memory, bound.trim().to_string())
        })
        .collect()
}

/// `shardc plan --explain` says where the best plan's step goes, per kernel class and per
/// collective, and the parts that make the step (all but the dp collectives, which overlap
/// the last backward and count by their exposed part) sum to it; the table names each plan's
/// dominant term with its share, and a line names the assumption behind the best: the
/// preset's constant, marked uncalibrated, or the `--cluster` file's.
#[test]
fn plan_says_where_the_step_goes_and_what_bounds_it() {
    let args = ["plan", "models/gpt3-175b.toml", "--gpus", "1024", "--global-batch", "1536", "--explain"];
    let out = shardc(&[&args[..], &["--gpu", "a100-80g"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let step: f64 = text.split("where #1's step goes (").nth(1).and_then(|r| r.split(" s;").next()).unwrap_or_else(|| panic!("{text}")).parse().unwrap();
    let parts: Vec<(String, f64)> = text
        .split("where #1's step goes")
        .nth(1)
        .unwrap()
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("  ") && l.contains(" s "))
        .map(|l| {
            let (name, rest) = l.trim().split_once("  ").unwrap();
            (name.trim().to_string(), rest.split_whitespace().next().unwrap().parse().unwrap())
        })
        .collect();
    let part = |name: &str| parts.iter().find(|(n, _)| n == name).map(|(_, t)| *t);
    for class in ["gemm", "attention", "memory-bound", "optimizer", "all_reduce tp", "send pp", "pipeline bubble"] {
        assert!(part(class).is_some_and(|t| t > 0.0), "{class} missing: {text}");
    }
    let sum: f64 = parts.iter().filter(|(n, _)| !n.ends_with(" dp")).map(|(_, t)| t).sum();
    assert!((sum - step).abs() <= 0.001 * step + 0.01, "parts sum to {sum}, the step is {step}: {text}");
    // The table's dominant term for #1 is the largest part, with its share.
    let rows = plan_rows(&text);
    let (name, largest) = parts.iter().filter(|(n, _)| !n.ends_with(" dp")).fold(("", 0.0), |b, (n, t)| if *t > b.1 { (n.as_str(), *t) } else { b });
    assert_eq!(name, "gemm", "{text}");
    assert!(rows[0].2.starts_with(&format!("gemm {:.0}%", 100.0 * largest / step)), "{:?} vs {largest}: {text}", rows[0]);
    assert!(rows.iter().all(|r| !r.2.is_empty()), "every plan names its bound: {text}");
    assert!(text.contains("#1 is bounded by GEMM time") && text.contains("gemm_efficiency 0.85 of 312 TFLOP/s (a100-80g preset, uncalibrated)"), "{text}");
    // The bytes per parameter of the dp collectives, read from the compiled step of #1's ZeRO
    // stage (mixed precision: fp32 gradients reduce-scattered, bf16 weights gathered).
    let zero: u8 = rows[0].0.rsplit(" z").next().unwrap().parse().unwrap();
    if zero == 1 || zero == 2 {
        assert!(text.contains(&format!("dp sync at ZeRO-{zero}: bytes per parameter the compiled step moves: all_reduce 0.00, reduce_scatter 4.00, all_gather 2.00")), "{text}");
    }
    // With a cluster file, the line names the file's constant instead.
    let dir = tempdir("plan-bound");
    let file = dir.join("cluster.toml");
    std::fs::write(&file, "preset = \"a100-80g\"\n[gpu]\ngemm_efficiency = 0.6\n").unwrap();
    let out = shardc(&[&args[..], &["--cluster", file.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let line = text.lines().find(|l| l.contains("#1 is bounded by")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("gemm_efficiency 0.60") && line.contains(&format!("(--cluster {})", file.display())) && !line.contains("uncalibrated"), "{line}");
}

/// The planner never lists less memory per GPU than the compiled step it suggests holds,
/// under every schedule (pipeline ranks keep each micro-batch in flight's values outside
/// the arena, whose peak then holds a backward's temporaries beside them), so a plan it
/// says fits does fit; and it is not far above.
#[test]
fn planned_memory_covers_the_compiled_step_under_every_schedule() {
    for schedule in ["1f1b", "interleaved", "gpipe", "zb-h1"] {
        let common = ["--micro-batch", "8", "--microbatches", "8", "--recompute", "none", "--zero", "0", "--schedule", schedule];
        let out = shardc(&[&["plan", "models/gpt2-small.toml", "--gpus", "4", "--global-batch", "64", "--top", "40"][..], &common].concat());
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        let row = text.lines().find(|l| l.contains("dp=1 tp=2 pp=2 ") && !l.contains(" sp ")).unwrap_or_else(|| panic!("{schedule}: no tp=2 pp=2 plan: {text}"));
        let planned: f64 = row.split("GB").next().and_then(|h| h.split_whitespace().last()).and_then(|n| n.parse().ok()).unwrap();
        let mut compile = vec!["compile", "models/gpt2-small.toml", "--mesh", "dp=1,tp=2,pp=2"];
        compile.extend(common);
        if schedule == "interleaved" {
            compile.extend(["--virtual-stages", "2"]);
        }
        let compiled = stdout(&shardc(&compile));
        let memory: f64 = compiled.split("memory/GPU  ").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{compiled}"));
        assert!(planned >= memory - 0.05 && planned <= 1.3 * memory, "{schedule}: planned {planned} GB, compiled {memory} GB");
    }
}

/// A plan whose memory exceeds the GPU's is not listed: with the GPU's memory cut to 50 GB,
/// exactly the plans estimated at or under 50 GB remain (the estimate does not depend on the
/// capacity), among them none of the faster ones that need more.
#[test]
fn plans_that_exceed_the_gpu_memory_are_not_listed() {
    let args = ["plan", "models/gpt3-175b.toml", "--gpus", "1024", "--global-batch", "1536", "--top", "100000"];
    let out = shardc(&[&args[..], &["--gpu", "a100-80g"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let all = plan_rows(&stdout(&out));
    let dir = tempdir("plan-hbm");
    let file = dir.join("cluster.toml");
    std::fs::write(&file, "preset = \"a100-80g\"\n[gpu]\nmemory_bytes = 50e9\n").unwrap();
    let out = shardc(&[&args[..], &["--cluster", file.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let small = plan_rows(&text);
    assert!(text.contains(&format!("{} fit", small.len())), "{text}");
    assert!(!small.is_empty() && small.iter().all(|r| r.1 <= 50.0), "{text}");
    // Printed to 0.1 GB: leave out the plans within rounding of the limit.
    let under = all.iter().filter(|r| r.1 < 49.95).count();
    let near = all.iter().filter(|r| (49.95..=50.05).contains(&r.1)).count();
    assert!(small.len() >= under && small.len() <= under + near, "{} listed, {under} under 50 GB (+{near} at it)", small.len());
    assert!(all[0].1 > 50.0 && !small.iter().any(|r| r.0 == all[0].0), "the 80 GB best ({:?}) is gone", all[0]);
}

#[test]
fn zero_that_cannot_shard_a_tensor_says_so() {
    // dp=3 divides no dimension of tiny (all powers of two): ZeRO would silently keep every
    // tensor whole on each rank.
    let out = shardc(&["compile", "models/tiny.toml", "--mesh", "dp=3", "--micro-batch", "1", "--microbatches", "1", "--zero", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let line = text.lines().find(|l| l.trim_start().starts_with("warning")).unwrap_or_else(|| panic!("no warning:\n{text}"));
    assert!(line.contains("ZeRO-1") && line.contains("dp=3") && line.contains("opt.m."), "{line}");
    // dp=2 shards everything: no warning.
    let out = shardc(&["compile", "models/tiny.toml", "--mesh", "dp=2", "--micro-batch", "1", "--microbatches", "1", "--zero", "1"]);
    assert!(out.status.success() && !stdout(&out).contains("warning"), "{}", stdout(&out));
}

/// The checkpoint records the update rule, the learning-rate schedule and the clipping norm
/// the programs were compiled with (read from their update ops): a resumed run continues that
/// decay even when the first leg's --steps was shorter, and other settings are refused with the
/// checkpoint's own as the fix (issue 17).
#[test]
fn resumed_runs_continue_the_checkpoints_schedule_and_refuse_other_settings() {
    let dir = tempdir("resume-schedule");
    let ckpt = dir.join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let base = ["run", "models/tiny.toml", "--log-every", "1", "--lr-warmup-steps", "2"];
    let with = |extra: &[&str]| shardc(&[&base[..], extra].concat());
    // The first leg decays over its 6 steps; the uninterrupted twin is told so.
    let uninterrupted = losses_by_step(&with(&["--steps", "10", "--lr-decay-steps", "6"]));
    losses_by_step(&with(&["--steps", "6", "--checkpoint", ckpt]));
    let manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("ckpt/step-00000006/manifest.json")).unwrap()).unwrap();
    let record = &manifest["optimizer"];
    assert_eq!((record["update"].as_str(), record["warmup_steps"].as_i64(), record["decay_steps"].as_i64(), record["clip_grad"].as_f64()), (Some("adamw"), Some(2), Some(6), Some(1.0)), "{manifest}");
    assert!((record["min_lr"].as_f64().unwrap() - 3e-4).abs() < 1e-12, "{record}");
    let resumed = losses_by_step(&with(&["--steps", "10", "--resume", ckpt]));
    assert_eq!(resumed.keys().copied().collect::<Vec<_>>(), (7..=10).collect::<Vec<u64>>());
    assert_same_losses(&uninterrupted, &resumed, "resumed past the end of the decay");
    // --override-schedule trains on with this run's settings, saying what changed.
    let out = with(&["--steps", "8", "--resume", ckpt, "--lr", "0.001", "--override-schedule"]);
    assert!(out.status.success() && stdout(&out).contains("overridden (--override-schedule): lr 0.003 (this run: 0.001)"), "{}{}", stdout(&out), stderr(&out));
    for (extra, named, fix) in [
        (vec!["--lr", "0.01"], "lr 0.003 (this run: 0.01)", "--lr 0.003"),
        (vec!["--clip-grad", "0"], "clip-grad 1 (this run: 0)", "--clip-grad 1"),
        (vec!["--lr-decay-steps", "12"], "lr-decay-steps 6 (this run: 12)", "--lr-decay-steps 6"),
        (vec!["--lr-decay", "linear"], "lr-decay cosine (this run: linear)", "--lr-decay cosine"),
    ] {
        let out = with(&[&["--steps", "12", "--resume", ckpt][..], &extra].concat());
        let err = unwrapped(&stderr(&out));
        assert!(!out.status.success() && err.contains("other optimizer settings") && err.contains(named) && err.contains(fix), "{extra:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Copies the folder `from` (and what it holds) to `to`.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().map(Result::unwrap) {
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Every tensor of a safetensors file, by name, as f64.
fn safetensors_file(file: &str) -> shardc_runtime::hf::Tensors {
    let file = shardc_runtime::tensor_file::TensorFile::open(std::path::Path::new(file)).unwrap();
    file.names().into_iter().map(|name| (name.clone(), file.read_f64(&name).unwrap().unwrap())).collect()
}

/// `shardc run --backend cuda ARGS` on the emulated device, with the variables `env`.
fn run_on_emulated_gpu(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_shardc"));
    command.args(["run", "--backend", "cuda"]).args(args).current_dir(root()).env("NO_COLOR", "1").env("SHARDC_GPU_EMULATE", "1");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("shardc runs")
}

/// Writes 4000 token ids below 64 (the vocabulary of the tiny Hugging Face models in
/// tests/data) as a u16 file, for `--data FILE --data-format u16`.
fn write_small_vocabulary_ids(path: &std::path::Path) {
    std::fs::write(path, (0..4000u32).map(|i| (i % 64) as u16).flat_map(u16::to_le_bytes).collect::<Vec<u8>>()).unwrap();
}

/// Writes a safetensors file by hand: (name, dtype as safetensors spells it, shape, bytes).
fn write_safetensors(path: &std::path::Path, tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut at = 0;
    for (name, dtype, shape, bytes) in tensors {
        header.insert(name.clone(), serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [at, at + bytes.len()] }));
        at += bytes.len();
    }
    let header = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header);
    tensors.iter().for_each(|t| file.extend(&t.3));
    std::fs::write(path, file).unwrap();
}

/// `--load` checks its file against the model before any work, the same way on both
/// backends, naming the tensor: a NaN or an infinity (which a run only met at its first
/// loss, blamed on the learning rate; the CPU's and the GPU's losses even differed there),
/// a tensor the model has no place for (an extra one, a layer past the model's, a Hugging
/// Face name: use `--hf`), one that is not floating point, one of another shape, one
/// missing. Any floating-point dtype loads on both (the CPU refused bf16 and f64 files that
/// the GPU read), to the same losses.
#[test]
fn load_checks_its_file_against_the_model_on_both_backends() {
    let dir = tempdir("load-checks");
    let saved = dir.join("tiny.safetensors");
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--save", saved.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let params = safetensors_file(saved.to_str().unwrap());
    let f32_bytes = |values: &[f64]| values.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect::<Vec<u8>>();
    let f32_tensors = || -> Vec<(String, &str, Vec<usize>, Vec<u8>)> { params.iter().map(|(name, (shape, values))| (name.clone(), "F32", shape.clone(), f32_bytes(values))).collect() };
    let with = |name: &str, change: &dyn Fn(&mut Vec<(String, &str, Vec<usize>, Vec<u8>)>)| -> String {
        let mut tensors = f32_tensors();
        change(&mut tensors);
        let path = dir.join(format!("{name}.safetensors"));
        write_safetensors(&path, &tensors);
        path.to_str().unwrap().to_string()
    };
    let poke = |tensor: &str, at: usize, value: f32| {
        let tensor = tensor.to_string();
        move |t: &mut Vec<(String, &str, Vec<usize>, Vec<u8>)>| {
            let entry = t.iter_mut().find(|e| e.0 == tensor).unwrap();
            entry.3[4 * at..4 * at + 4].copy_from_slice(&value.to_le_bytes());
        }
    };
    let one_layer = dir.join("tiny-1-layer.toml");
    std::fs::write(&one_layer, std::fs::read_to_string(root().join("models/tiny.toml")).unwrap().replace("layers = 2", "layers = 1")).unwrap();
    let tiny = "models/tiny.toml".to_string();
    let cases: Vec<(String, String, String)> = vec![
        (tiny.clone(), with("nan", &poke("embed.tokens.weight", 25, f32::NAN)), "tensor `embed.tokens.weight` holds NaN at element 25".into()),
        (tiny.clone(), with("inf", &poke("final_norm.weight", 3, f32::NEG_INFINITY)), "tensor `final_norm.weight` holds -inf at element 3".into()),
        (tiny.clone(), with("extra", &|t| t.push(("extra.thing".into(), "F32", vec![2], vec![0; 8]))), "tensor `extra.thing` is not a parameter of this model".into()),
        (one_layer.to_str().unwrap().to_string(), saved.to_str().unwrap().to_string(), "tensor `layers.1.".into()),
        (tiny.clone(), with("hf-names", &|t| t.iter_mut().find(|e| e.0 == "final_norm.weight").unwrap().0 = "transformer.ln_f.weight".into()), "load from its folder with `--hf DIR`".into()),
        (tiny.clone(), with("int", &|t| t.iter_mut().find(|e| e.0 == "final_norm.weight").unwrap().1 = "I32"), "tensor `final_norm.weight` is I32: parameters are read from floating-point tensors".into()),
        (tiny.clone(), with("shape", &|t| t.iter_mut().find(|e| e.0 == "final_norm.weight").unwrap().2 = vec![4, 4]), "tensor `final_norm.weight` has shape [4, 4], the model needs [16]".into()),
        (tiny.clone(), with("missing", &|t| t.retain(|e| e.0 != "final_norm.bias")), "has no `final_norm.bias`, a parameter of this model".into()),
    ];
    for (spec, file, want) in &cases {
        let args = [spec.as_str(), "--steps", "1", "--load", file.as_str()];
        for (backend, out) in [("cpu", shardc(&[&["run"][..], &args[..]].concat())), ("cuda", run_on_emulated_gpu(&args, &[]))] {
            let err = unwrapped(&stderr(&out));
            assert_eq!(out.status.code(), Some(1), "{backend} {file}: {err}");
            assert!(err.contains(want) && err.contains("--load"), "{backend} {file}: wanted `{want}` in {err}");
            assert!(!err.contains("panicked") && !err.contains("--lr"), "{backend} {file}: {err}");
        }
    }
    // Hugging Face weights are checked the same way: an infinity names its tensor.
    let hf = dir.join("hf-inf");
    copy_dir(&root().join("tests/data/hf-tiny-gpt2"), &hf);
    let weights = hf.join("model.safetensors");
    let at = shardc_runtime::tensor_file::TensorFile::open(&weights).unwrap().byte_range("transformer.ln_f.weight").unwrap().start as usize;
    let mut bytes = std::fs::read(&weights).unwrap();
    bytes[at..at + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    std::fs::write(&weights, bytes).unwrap();
    let ids = dir.join("ids.u16");
    write_small_vocabulary_ids(&ids);
    let args = ["--hf", hf.to_str().unwrap(), "--seq", "8", "--micro-batch", "2", "--steps", "1", "--data", ids.to_str().unwrap(), "--data-format", "u16"];
    for (backend, out) in [("cpu", shardc(&[&["run"][..], &args[..]].concat())), ("cuda", run_on_emulated_gpu(&args, &[]))] {
        let err = unwrapped(&stderr(&out));
        assert_eq!(out.status.code(), Some(1), "{backend}: {err}");
        assert!(err.contains("tensor `transformer.ln_f.weight` holds inf at element 0"), "{backend}: {err}");
    }
    // bf16 and f64 files load on both backends, to the same first losses.
    let bf16 = dir.join("bf16.safetensors");
    write_safetensors(&bf16, &params.iter().map(|(name, (shape, values))| (name.clone(), "BF16", shape.clone(), values.iter().flat_map(|&v| (((v as f32).to_bits() >> 16) as u16).to_le_bytes()).collect())).collect::<Vec<_>>());
    let f64_file = dir.join("f64.safetensors");
    write_safetensors(&f64_file, &params.iter().map(|(name, (shape, values))| (name.clone(), "F64", shape.clone(), values.iter().flat_map(|v| v.to_le_bytes()).collect())).collect::<Vec<_>>());
    let mut first_losses = Vec::new();
    for file in [&bf16, &f64_file, &saved] {
        let args = ["models/tiny.toml", "--steps", "1", "--log-every", "1", "--load", file.to_str().unwrap()];
        let (cpu, gpu) = (losses_by_step(&shardc(&[&["run"][..], &args[..]].concat())), losses_by_step(&run_on_emulated_gpu(&args, &[])));
        assert!(cpu.len() == 1 && gpu.len() == 1, "{file:?}: CPU {cpu:?}, GPU {gpu:?}");
        assert!((cpu[&1] - gpu[&1]).abs() <= 1e-5 * cpu[&1], "{file:?}: CPU {cpu:?}, GPU {gpu:?}");
        first_losses.push(cpu[&1]);
    }
    // The f64 file holds the f32 values exactly; bf16 rounds them.
    assert_eq!(first_losses[1], first_losses[2]);
    assert!((first_losses[0] - first_losses[2]).abs() < 1e-2 * first_losses[2], "{first_losses:?}");
    // --save writes an f64 model's parameters in f64 (it wrote f32, rounding each), an f32
    // or bf16 model's in f32 (which their values, a bf16 model's fp32 masters, take exactly).
    for (dtype, want) in [("f64", "F64"), ("f32", "F32"), ("bf16", "F32")] {
        let file = dir.join(format!("saved-{dtype}.safetensors"));
        let out = shardc(&["run", "models/tiny.toml", "--dtype", dtype, "--steps", "1", "--save", file.to_str().unwrap()]);
        assert!(out.status.success(), "{dtype}: {}", stderr(&out));
        let header = shardc_runtime::tensor_file::TensorFile::open(&file).unwrap();
        assert!(header.names().iter().all(|n| format!("{:?}", header.info(n).unwrap().dtype) == want), "{dtype}: --save wrote {:?}", header.names().iter().map(|n| header.info(n).unwrap().dtype).collect::<Vec<_>>());
    }
}

/// What a checkpoint and a Hugging Face folder hold is read alike on both backends: a NaN in
/// a checkpoint's state is refused naming the tensor on `--resume` (the CPU resumed it and
/// failed at a later loss, blaming the learning rate, where the GPU refused it), and a
/// Hugging Face tensor that becomes no parameter (GPT-2's mask buffers, even of -inf) is not
/// read on either (the CPU refused what the GPU never read).
#[test]
fn checkpoints_and_hugging_face_folders_are_read_alike_on_both_backends() {
    let dir = tempdir("read-alike");
    let ckpt = dir.join("ckpt");
    let out = shardc(&["run", "models/tiny.toml", "--steps", "1", "--checkpoint", ckpt.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    // A NaN in the rank file's first tensor, the manifest's checksums dropped (as a checkpoint
    // of a shardc that wrote none).
    let step = ckpt.join("step-00000001");
    let manifest_path = step.join("manifest.json");
    let mut manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
    manifest.as_object_mut().unwrap().remove("checksums");
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let rank_file = step.join(manifest["files"][0].as_str().unwrap());
    let header = shardc_runtime::tensor_file::TensorFile::open(&rank_file).unwrap();
    let name = header.names().into_iter().find(|n| format!("{:?}", header.info(n).unwrap().dtype) == "F32").unwrap();
    let at = header.byte_range(&name).unwrap().start as usize;
    let mut bytes = std::fs::read(&rank_file).unwrap();
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&rank_file, bytes).unwrap();
    let args = ["models/tiny.toml", "--steps", "3", "--resume", step.to_str().unwrap()];
    for (backend, out) in [("cpu", shardc(&[&["run"][..], &args[..]].concat())), ("cuda", run_on_emulated_gpu(&args, &[]))] {
        let err = unwrapped(&stderr(&out));
        assert!(out.status.code() == Some(1) && err.contains(&format!("tensor `{name}` holds NaN at element 0")), "{backend}: {err}");
    }
    // GPT-2's mask buffers of -inf beside the weights: never read, on either backend.
    let hf = dir.join("hf-masks");
    copy_dir(&root().join("tests/data/hf-tiny-gpt2"), &hf);
    let weights = hf.join("model.safetensors");
    let mut tensors: Vec<(String, &str, Vec<usize>, Vec<u8>)> = safetensors_file(weights.to_str().unwrap()).into_iter().map(|(n, (shape, values))| (n, "F32", shape, values.iter().flat_map(|&v| (v as f32).to_le_bytes()).collect())).collect();
    tensors.push(("transformer.h.0.attn.masked_bias".into(), "F32", vec![], f32::NEG_INFINITY.to_le_bytes().to_vec()));
    write_safetensors(&weights, &tensors);
    let ids = dir.join("ids.u16");
    write_small_vocabulary_ids(&ids);
    let args = ["--hf", hf.to_str().unwrap(), "--seq", "8", "--micro-batch", "2", "--steps", "1", "--log-every", "1", "--data", ids.to_str().unwrap(), "--data-format", "u16"];
    let (cpu, gpu) = (shardc(&[&["run"][..], &args[..]].concat()), run_on_emulated_gpu(&args, &[]));
    let (cpu, gpu) = (losses_by_step(&cpu), losses_by_step(&gpu));
    assert!(cpu.len() == 1 && gpu.len() == 1 && (cpu[&1] - gpu[&1]).abs() <= 1e-4 * cpu[&1], "CPU {cpu:?}, GPU {gpu:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `run --backend cuda`, here on the emulated device (`SHARDC_GPU_EMULATE=1`: the generated
/// kernels compiled as C++), takes every option the CPU backend takes, or refuses it with
/// the reason before any work: the same losses as the CPU backend from the seed, from
/// Hugging Face weights, from `--load` and across `--checkpoint` and `--resume` (between
/// backends too), the same validation losses (in one process or a process per rank), and
/// files that load back to the same model; `--trace`, the CPU's collective algorithms and
/// numerics checks are refused.
#[test]
fn gpu_runs_take_every_run_option_or_refuse_it() {
    let dir = tempdir("gpu-run-options");
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let gpu = run_on_emulated_gpu;
    let cpu = |args: &[&str]| shardc(&[&["run"][..], args].concat());
    let close = |want: &std::collections::BTreeMap<u64, f64>, got: &std::collections::BTreeMap<u64, f64>, what: &str| {
        assert!(!got.is_empty() && got.keys().all(|k| want.contains_key(k)), "{what}: steps {:?} of {:?}", got.keys(), want.keys());
        for (step, loss) in got {
            assert!((loss - want[step]).abs() <= 1e-4 * want[step].abs(), "{what}: step {step} loss {loss}, CPU {}", want[step]);
        }
    };
    let base = ["models/tiny.toml", "--microbatches", "1", "--log-every", "1", "--lr-decay-steps", "4"];
    let (cpu_file, gpu_file, checkpoint, hf_out) = (path("cpu.safetensors"), path("gpu.safetensors"), path("ckpt"), path("hf"));
    let cpu_hf = path("cpu-hf");
    let reference_out = cpu(&[&base[..], &["--steps", "4", "--save", &cpu_file, "--save-hf", &cpu_hf, "--eval-every", "2"]].concat());
    let reference = losses_by_step(&reference_out);
    // Two steps, a checkpoint, and a resume to step 4 with every output written.
    let first = losses_by_step(&gpu(&[&base[..], &["--steps", "2", "--checkpoint", &checkpoint]].concat(), &[]));
    let resumed_out = gpu(&[&base[..], &["--steps", "4", "--resume", &checkpoint, "--checkpoint", &checkpoint, "--save", &gpu_file, "--save-hf", &hf_out, "--eval-every", "2"]].concat(), &[]);
    let resumed = losses_by_step(&resumed_out);
    // What the GPU run evaluates and writes, read from the device a tensor at a time, is
    // what the CPU run evaluates and writes.
    let (cpu_validation, gpu_validation) = (validation_losses(&reference_out), validation_losses(&resumed_out));
    assert_eq!(gpu_validation.len(), 1, "{}", stdout(&resumed_out));
    assert!((gpu_validation[0].1 - cpu_validation[1].1).abs() <= 1e-5 * cpu_validation[1].1, "validation loss at step 4: GPU {gpu_validation:?}, CPU {cpu_validation:?}");
    let (cpu_params, gpu_params) = (safetensors_file(&cpu_file), safetensors_file(&gpu_file));
    assert_eq!(cpu_params.keys().collect::<Vec<_>>(), gpu_params.keys().collect::<Vec<_>>());
    for (name, (shape, values)) in &gpu_params {
        // A key bias's gradient is zero but for rounding (softmax ignores a shift that is the
        // same for every key), which Adam scales into steps of the learning rate either way.
        if name.ends_with("attn.k.bias") {
            continue;
        }
        let (cpu_shape, cpu_values) = &cpu_params[name];
        assert_eq!(shape, cpu_shape, "--save: {name}");
        assert!(max_relative(values, cpu_values) < 1e-4, "--save: {name} differs from the CPU run's");
    }
    // Both runs' Hugging Face folders are their saved parameters, exported.
    for (params, folder) in [(&cpu_params, &cpu_hf), (&gpu_params, &hf_out)] {
        let written = safetensors_file(&format!("{folder}/model.safetensors"));
        let tied = !written.contains_key("lm_head.weight");
        let exported = shardc_runtime::hf::export(shardc_runtime::hf::Family::Gpt2, params, tied).unwrap();
        assert_eq!(exported.len(), written.len(), "{folder}");
        for (name, shape, values) in exported {
            assert_eq!((&shape, values.iter().map(|&v| v as f64).collect::<Vec<_>>()), (&written[&name].0, written[&name].1.clone()), "{folder}: {name}");
        }
    }
    let mut whole = first.clone();
    whole.extend(resumed.clone());
    assert_eq!(whole.len(), 4);
    close(&reference, &whole, "GPU run resumed at step 2");
    assert!(stdout(&resumed_out).contains("resume      step 2"), "{}", stdout(&resumed_out));
    assert!(dir.join("ckpt/step-00000002").is_dir() && dir.join("ckpt/step-00000004").is_dir() && dir.join("hf/config.json").is_file());
    // The GPU's checkpoint resumes on the CPU backend.
    let on_cpu = losses_by_step(&cpu(&[&base[..], &["--steps", "4", "--resume", &format!("{checkpoint}/step-00000002")]].concat()));
    assert_eq!(on_cpu.keys().copied().collect::<Vec<_>>(), [3, 4]);
    close(&reference, &on_cpu, "CPU run resumed from the GPU's checkpoint");
    // The saved parameters are the CPU run's: loaded on either backend, the same first loss.
    let from_cpu_file = losses_by_step(&cpu(&["models/tiny.toml", "--microbatches", "1", "--log-every", "1", "--steps", "1", "--load", &cpu_file]));
    let from_gpu_file = losses_by_step(&gpu(&["models/tiny.toml", "--microbatches", "1", "--log-every", "1", "--steps", "1", "--load", &gpu_file], &[]));
    close(&from_cpu_file, &from_gpu_file, "--load");
    // Hugging Face weights (a 64-token vocabulary: token ids from a u16 file).
    let ids = dir.join("ids.u16");
    std::fs::write(&ids, (0..4000u32).map(|i| ((i * 7 + i / 13) % 64) as u16).flat_map(u16::to_le_bytes).collect::<Vec<u8>>()).unwrap();
    let hf = ["--hf", "tests/data/hf-tiny-gpt2", "--seq", "8", "--micro-batch", "2", "--steps", "2", "--log-every", "1", "--data", ids.to_str().unwrap(), "--data-format", "u16"];
    let hf_gpu = gpu(&hf, &[]);
    assert!(stdout(&hf_gpu).contains("weights     36 tensors from tests/data/hf-tiny-gpt2"), "{}", stdout(&hf_gpu));
    close(&losses_by_step(&cpu(&hf)), &losses_by_step(&hf_gpu), "--hf");
    // Gradient accumulation (the spec's 4 micro-batches per step) at dp=2 under ZB-H1, and
    // pipeline stages with every rank on the device, checkpointed on the GPU and resumed on
    // the CPU.
    let accumulating = ["models/tiny.toml", "--mesh", "dp=2", "--micro-batch", "2", "--schedule", "zb-h1", "--steps", "2", "--log-every", "1"];
    close(&losses_by_step(&cpu(&accumulating)), &losses_by_step(&gpu(&accumulating, &[])), "gradient accumulation");
    let (pipelined, pp_checkpoint) = (["models/tiny.toml", "--mesh", "pp=2", "--schedule", "interleaved", "--virtual-stages", "2", "--log-every", "1", "--lr-decay-steps", "3"], path("pp-ckpt"));
    let reference = losses_by_step(&cpu(&[&pipelined[..], &["--steps", "3"]].concat()));
    close(&reference, &losses_by_step(&gpu(&[&pipelined[..], &["--steps", "2", "--checkpoint", &pp_checkpoint]].concat(), &[])), "pp=2 interleaved on the GPU");
    close(&reference, &losses_by_step(&cpu(&[&pipelined[..], &["--steps", "3", "--resume", &pp_checkpoint]].concat())), "pp=2 resumed on the CPU");
    // Every rank's file written from its shards in device memory (ZeRO-1's sharded moments
    // too), never the assembled state, and resumed on the CPU.
    let (sharded, tp_checkpoint) = (["models/tiny.toml", "--mesh", "dp=2,tp=2", "--zero", "1", "--microbatches", "1", "--log-every", "1", "--lr-decay-steps", "3"], path("tp-ckpt"));
    let reference = losses_by_step(&cpu(&[&sharded[..], &["--steps", "3"]].concat()));
    close(&reference, &losses_by_step(&gpu(&[&sharded[..], &["--steps", "2", "--checkpoint", &tp_checkpoint]].concat(), &[])), "dp=2,tp=2 ZeRO-1 on the GPU");
    assert!(dir.join("tp-ckpt/step-00000002/rank-00003.safetensors").is_file());
    close(&reference, &losses_by_step(&cpu(&[&sharded[..], &["--steps", "3", "--resume", &tp_checkpoint]].concat())), "dp=2,tp=2 ZeRO-1 resumed on the CPU");
    // A process per rank evaluates its own shards on its device, with the step's forward:
    // a step without sections (its loss's dp sum left to the host) and interleaved pipeline
    // stages, 5 windows over batches of 4: the CPU's validation losses on the whole model.
    for (args, processes) in [(&sharded[..], "4"), (&pipelined[..], "2")] {
        let evaluated = [args, &["--steps", "2", "--eval-every", "1", "--eval-windows", "5"]].concat();
        let (on_cpu, in_processes) = (validation_losses(&cpu(&evaluated)), validation_losses(&gpu(&evaluated, &[("SHARDC_EMULATE_PROCESSES", processes)])));
        assert_eq!(in_processes.iter().map(|v| v.0).collect::<Vec<_>>(), [1, 2], "{args:?}");
        for ((step, want), (_, got)) in on_cpu.iter().zip(&in_processes) {
            assert!((got - want).abs() <= 1e-5 * want, "{args:?}: step {step} validation loss {got} in processes, {want} on the CPU");
        }
    }
    // What a GPU run cannot do is refused before any work, with the reason.
    for (args, env, says) in [
        (vec!["models/tiny.toml", "--steps", "2", "--microbatches", "1", "--trace", "t.json"], vec![], "--trace writes the timeline the CPU pipeline runtime measures item by item"),
        (vec!["models/tiny.toml", "--steps", "2", "--microbatches", "1", "--collectives", "tree"], vec![], "--collectives tree: the CPU backend's algorithm"),
        (vec!["models/tiny.toml", "--steps", "2", "--microbatches", "1", "--collectives", "bogus"], vec![], "--collectives: unknown algorithm `bogus`"),
        (vec!["models/tiny.toml", "--steps", "2", "--microbatches", "1", "--check-numerics"], vec![], "--check-numerics checks every op's results on the CPU backend only"),
        (vec!["models/tiny.toml", "--steps", "2", "--microbatches", "1", "--mesh", "dp=2"], vec![("RANK", "0"), ("WORLD_SIZE", "2")], "RANK is set with SHARDC_GPU_EMULATE=1: an emulated device cannot reach the run's other processes"),
        (vec!["models/tiny.toml", "--steps", "2", "--microbatches", "1"], vec![("RANK", "1"), ("WORLD_SIZE", "1")], "RANK=1 must be below WORLD_SIZE=1"),
        (vec!["models/tiny.toml", "--steps", "2", "--microbatches", "1", "--save", "out.safetensors/"], vec![], "--save out.safetensors/: is a folder"),
        (vec!["models/tiny.toml", "--steps", "2", "--microbatches", "1", "--mesh", "dp=2", "--checkpoint", "ck"], vec![("SHARDC_EMULATE_PROCESSES", "3")], "SHARDC_EMULATE_PROCESSES=3: the mesh dp=2,tp=1,pp=1 has 2 ranks, one per process"),
    ] {
        let out = gpu(&args, &env);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stdout(&out));
        assert!(unwrapped(&stderr(&out)).contains(says), "{args:?}: {}", stderr(&out));
    }
    assert!(!root().join("t.json").exists() && !root().join("ck").exists(), "a refused run wrote an output");
    std::fs::remove_dir_all(&dir).ok();
}

/// A multi-process GPU run writes `--save` and `--save-hf` whole, from the rank files its
/// processes write from their own shards (its last checkpoint's, or ones written for the
/// files alone and removed after): the same files as every rank on one GPU writes, for
/// tensor and data parallelism with ZeRO-1 and a padded vocabulary, in bf16 with fp32
/// masters, and over pipeline stages.
#[test]
fn gpu_processes_write_whole_files_from_their_rank_files() {
    let dir = tempdir("gpu-process-save");
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    // 256 ids padded to a multiple of 3 x tp.
    let padded = path("tiny-padded.toml");
    std::fs::write(&padded, std::fs::read_to_string(root().join("models/tiny.toml")).unwrap().replace("vocab = 256", "vocab = 256\nvocab_multiple = 3")).unwrap();
    let cases: [(&str, &[&str], &str); 3] = [
        ("zero1", &[&padded, "--mesh", "dp=2,tp=2", "--zero", "1", "--optimizer", "adamw", "--microbatches", "1"], "4"),
        ("bf16", &["models/tiny-llama.toml", "--mesh", "tp=2", "--dtype", "bf16", "--microbatches", "1"], "2"),
        ("pp", &["models/tiny.toml", "--mesh", "pp=2", "--microbatches", "4"], "2"),
    ];
    for (tag, args, processes) in cases {
        let base = [args, &["--steps", "2"][..]].concat();
        let (file, hf) = (path(&format!("{tag}-one.safetensors")), path(&format!("{tag}-one-hf")));
        let one = run_on_emulated_gpu(&[&base[..], &["--save", &file, "--save-hf", &hf]].concat(), &[]);
        assert!(one.status.success(), "{tag}: {}", stderr(&one));
        let (want_params, want_hf) = (safetensors_file(&file), safetensors_file(&format!("{hf}/model.safetensors")));
        for with_checkpoint in [false, true] {
            let what = format!("{tag} over {processes} processes, checkpointing {with_checkpoint}");
            let (file, hf, checkpoint) = (path(&format!("{tag}-{with_checkpoint}.safetensors")), path(&format!("{tag}-{with_checkpoint}-hf")), path(&format!("{tag}-ckpt")));
            let mut command = [&base[..], &["--save", &file, "--save-hf", &hf]].concat();
            if with_checkpoint {
                command.extend(["--checkpoint", &checkpoint]);
            }
            let out = run_on_emulated_gpu(&command, &[("SHARDC_EMULATE_PROCESSES", processes)]);
            assert!(out.status.success(), "{what}: {}{}", stdout(&out), stderr(&out));
            assert!(stdout(&out).contains(&format!("saved       {file}")), "{what}: {}", stdout(&out));
            for (want, got) in [(&want_params, safetensors_file(&file)), (&want_hf, safetensors_file(&format!("{hf}/model.safetensors")))] {
                assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{what}");
                for (name, (shape, values)) in &got {
                    assert_eq!(shape, &want[name].0, "{what}: {name}");
                    assert!(max_relative(values, &want[name].1) < 1e-5, "{what}: {name} differs from every rank on one GPU's");
                }
            }
            // The padded vocabulary is written unpadded; the rank files written for the
            // files alone are gone.
            let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(format!("{hf}/config.json")).unwrap()).unwrap();
            assert_eq!((config["vocab_size"].as_u64(), want_params["embed.tokens.weight"].0[0]), (Some(256), 256), "{what}");
            let left: Vec<String> = std::fs::read_dir(&hf).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
            assert_eq!(left.len(), 2, "{what}: {left:?}");
            let hidden: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).filter(|n| n.starts_with('.')).collect();
            assert!(hidden.is_empty(), "{what}: {hidden:?}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A GPU run says what it held on the device, measured as it allocates, beside the compiled
/// plan's memory/GPU: for one process a rank (pipeline stages and ZeRO over four emulated
/// processes) the two agree (the emulation has no cuBLASLt workspace, which the plan counts
/// and the line takes out).
#[test]
fn gpu_runs_report_the_device_memory_they_held_beside_the_plan() {
    // The busiest process is rank 0 in the first, the last pipeline rank in the second (ZB-H1
    // holds as many micro-batches there, and the head's): each against its own estimate.
    for (args, processes, busiest) in [(&["--mesh", "dp=2,pp=2", "--microbatches", "4", "--zero", "1", "--optimizer", "adamw"][..], "4", "rank 0's"), (&["--mesh", "pp=2", "--schedule", "zb-h1", "--microbatches", "4"], "2", "rank 1's")] {
        let out = run_on_emulated_gpu(&[&["models/tiny.toml", "--steps", "2"][..], args].concat(), &[("SHARDC_EMULATE_PROCESSES", processes)]);
        let text = unwrapped(&stdout(&out));
        assert!(out.status.success(), "{text}{}", stderr(&out));
        let line = text.split(" memory ").nth(1).unwrap_or_default();
        let measured = line.split_whitespace().next().unwrap_or_default();
        let planned = line.split("MB, ").nth(1).and_then(|rest| rest.split_whitespace().next()).unwrap_or_default();
        assert!(!measured.is_empty() && measured == planned && line.contains("measured as it allocates") && line.contains(busiest), "{args:?}: {line}\n{text}");
    }
}

/// The processes of a multi-process GPU run (here emulated: `SHARDC_EMULATE_PROCESSES=N`,
/// one thread per process, each on its own emulated device, NCCL emulated) checkpoint each
/// its own rank file from device memory, rank 0 the manifest; processes on another mesh
/// resume from it reading only their own shards, and so does the CPU backend, with the
/// uninterrupted run's losses. A process killed after writing its file leaves the previous
/// checkpoint to resume from. `--load` and Hugging Face weights are read shard by shard,
/// and pipeline stages run across processes. Only rank 0 prints.
#[test]
fn gpu_processes_checkpoint_their_own_shards_and_resume_on_another_mesh() {
    let dir = tempdir("gpu-processes-checkpoint");
    let ckpt = dir.join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap();
    let processes = run_on_emulated_gpu;
    let close = |want: &std::collections::BTreeMap<u64, f64>, got: &std::collections::BTreeMap<u64, f64>, what: &str| {
        assert!(!got.is_empty() && got.keys().all(|k| want.contains_key(k)), "{what}: steps {:?} of {:?}", got.keys(), want.keys());
        for (step, loss) in got {
            assert!((loss - want[step]).abs() <= 1e-4 * want[step].abs(), "{what}: step {step} loss {loss}, uninterrupted {}", want[step]);
        }
    };
    let base = ["models/tiny.toml", "--microbatches", "1", "--log-every", "1", "--lr-decay-steps", "4", "--optimizer", "adamw"];
    let reference = losses_by_step(&shardc(&[&["run"][..], &base[..], &["--mesh", "dp=2,tp=2", "--steps", "4"]].concat()));
    let first = processes(&[&base[..], &["--mesh", "dp=2,tp=2", "--zero", "1", "--steps", "2", "--checkpoint", ckpt_arg]].concat(), &[("SHARDC_EMULATE_PROCESSES", "4")]);
    close(&reference, &losses_by_step(&first), "four processes, ZeRO-1");
    let said = stdout(&first);
    assert_eq!(said.matches("shardc: training").count(), 1, "rank 0 alone prints: {said}");
    assert!(said.contains("each process wrote its own rank file"), "{said}");
    let step2 = ckpt.join("step-00000002");
    let files: Vec<_> = (0..4).map(|r| step2.join(format!("rank-{r:05}.safetensors"))).collect();
    assert!(files.iter().all(|f| f.is_file()) && step2.join("manifest.json").is_file(), "{said}");
    // Two processes at dp=2 without tensor parallelism or ZeRO (the same global batch), and
    // the CPU backend, resume from it.
    let resumed = processes(&[&base[..], &["--mesh", "dp=2", "--steps", "4", "--resume", ckpt_arg]].concat(), &[("SHARDC_EMULATE_PROCESSES", "2")]);
    assert!(stdout(&resumed).contains("resume      step 2"), "{}", stdout(&resumed));
    close(&reference, &losses_by_step(&resumed), "two processes at dp=2 resumed at step 2");
    let on_cpu = shardc(&[&["run"][..], &base[..], &["--mesh", "dp=2,tp=2", "--steps", "4", "--resume", ckpt_arg]].concat());
    close(&reference, &losses_by_step(&on_cpu), "the CPU backend resumed from the processes' checkpoint");
    // A world of one process (torchrun's WORLD_SIZE=1) holds every rank: it checkpoints
    // them all, resumes from them and writes whole files (it failed after training, asking
    // for a call only a program makes).
    let alone = dir.join("alone");
    let saved = dir.join("alone.safetensors");
    let one = processes(&[&base[..], &["--steps", "2", "--checkpoint", alone.to_str().unwrap(), "--save", saved.to_str().unwrap()]].concat(), &[("SHARDC_EMULATE_PROCESSES", "1")]);
    assert!(one.status.success() && saved.is_file() && alone.join("step-00000002").join("manifest.json").is_file(), "{}{}", stdout(&one), stderr(&one));
    let straight = losses_by_step(&shardc(&[&["run"][..], &base[..], &["--steps", "4"]].concat()));
    close(&straight, &losses_by_step(&one), "a world of one process");
    // Started as torchrun starts it (RANK=0, WORLD_SIZE=1) on the emulated device: the same
    // world of one, not a real NCCL bootstrap.
    let torchrun = processes(&[&base[..], &["--steps", "4"]].concat(), &[("RANK", "0"), ("WORLD_SIZE", "1")]);
    close(&straight, &losses_by_step(&torchrun), "torchrun's world of one process, emulated");
    let on = processes(&[&base[..], &["--steps", "4", "--resume", alone.to_str().unwrap()]].concat(), &[("SHARDC_EMULATE_PROCESSES", "1")]);
    close(&straight, &losses_by_step(&on), "a world of one process resumed at step 2");
    // A rank file changed since it was written is refused, and the run does not say it
    // resumed first (the GPU reads the files after checking the manifest).
    let file = alone.join("step-00000002").join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let refused = processes(&[&base[..], &["--steps", "4", "--resume", alone.to_str().unwrap()]].concat(), &[]);
    assert!(!refused.status.success() && unwrapped(&stderr(&refused)).contains("the file changed after it was written"), "{}", stderr(&refused));
    assert!(!stdout(&refused).contains("resume      step"), "said it resumed: {}", stdout(&refused));
    // Emulated processes on the CPU backend are refused, not ignored.
    let on_cpu_backend = Command::new(env!("CARGO_BIN_EXE_shardc")).args(["run", "models/tiny.toml", "--steps", "1"]).current_dir(root()).env("NO_COLOR", "1").env("SHARDC_EMULATE_PROCESSES", "1").output().unwrap();
    assert!(unwrapped(&stderr(&on_cpu_backend)).contains("SHARDC_EMULATE_PROCESSES=1: emulated processes are a GPU run's"), "{}", stderr(&on_cpu_backend));
    // A rank file changed after it was written: the processes that read it say so, and the
    // others end with them instead of waiting in the first step's collectives.
    let forged = dir.join("forged");
    copy_dir(&ckpt, &forged);
    let file = forged.join("step-00000002/rank-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let refused = processes(&[&base[..], &["--mesh", "dp=2,tp=2", "--steps", "4", "--timeout", "600", "--resume", forged.to_str().unwrap()]].concat(), &[("SHARDC_EMULATE_PROCESSES", "4")]);
    let said = unwrapped(&stderr(&refused));
    assert!(!refused.status.success() && said.contains("rank-00001.safetensors: the file changed after it was written"), "{said}");
    assert!(!said.contains("panicked") && !said.contains("within 600s"), "{said}");
    // Rank 1 killed after writing its file of the second checkpoint (step 3): step 2 stays
    // the latest, and the next run clears what the crashed one left.
    let crashed = processes(
        &[&base[..], &["--mesh", "dp=2,tp=2", "--zero", "1", "--steps", "4", "--resume", ckpt_arg, "--checkpoint", ckpt_arg, "--checkpoint-every", "1"]].concat(),
        &[("SHARDC_EMULATE_PROCESSES", "4"), ("SHARDC_FAULT_CHECKPOINT", "2:1")],
    );
    assert!(!crashed.status.success(), "{}", stdout(&crashed));
    assert_eq!(std::fs::read_to_string(ckpt.join("LATEST")).unwrap().trim(), "step-00000003");
    assert!(ckpt.join(".partial-step-00000004-processes").is_dir(), "the crashed checkpoint's rank files stay until the next run");
    let again = processes(&[&base[..], &["--mesh", "dp=2,tp=2", "--steps", "4", "--resume", ckpt_arg, "--checkpoint", ckpt_arg]].concat(), &[("SHARDC_EMULATE_PROCESSES", "4")]);
    close(&reference, &losses_by_step(&again), "resumed after the crash");
    assert!(!ckpt.join(".partial-step-00000004-processes").exists() && ckpt.join("step-00000004").is_dir());
    // `--load` and Hugging Face weights: each process reads its own shards of each tensor.
    let file = dir.join("params.safetensors");
    let saved = shardc(&[&["run"][..], &base[..], &["--steps", "1", "--save", file.to_str().unwrap()]].concat());
    assert!(saved.status.success(), "{}", stderr(&saved));
    let load = ["models/tiny.toml", "--microbatches", "1", "--log-every", "1", "--steps", "2", "--mesh", "dp=2,tp=2", "--load", file.to_str().unwrap()];
    close(&losses_by_step(&shardc(&[&["run"][..], &load[..]].concat())), &losses_by_step(&processes(&load, &[("SHARDC_EMULATE_PROCESSES", "4")])), "--load in four processes");
    let ids = dir.join("ids.u16");
    std::fs::write(&ids, (0..4000u32).map(|i| ((i * 7 + i / 13) % 64) as u16).flat_map(u16::to_le_bytes).collect::<Vec<u8>>()).unwrap();
    let hf = ["--hf", "tests/data/hf-tiny-gpt2", "--seq", "8", "--micro-batch", "2", "--steps", "2", "--log-every", "1", "--data", ids.to_str().unwrap(), "--data-format", "u16", "--mesh", "tp=2"];
    let hf_processes = processes(&hf, &[("SHARDC_EMULATE_PROCESSES", "2")]);
    assert!(stdout(&hf_processes).contains("each process reads its own shards"), "{}", stdout(&hf_processes));
    close(&losses_by_step(&shardc(&[&["run"][..], &hf[..]].concat())), &losses_by_step(&hf_processes), "--hf in two processes");
    // Pipeline stages across processes (interleaved, 2 virtual stages, at dp=2): the CPU
    // backend's losses, checkpointed by every process (the tied embedding by its first
    // holder) and resumed on the CPU.
    let (pipelined, pp_checkpoint) = (["models/tiny.toml", "--mesh", "dp=2,pp=2", "--schedule", "interleaved", "--virtual-stages", "2", "--log-every", "1", "--lr-decay-steps", "3"], dir.join("pp-ckpt"));
    let pp_arg = pp_checkpoint.to_str().unwrap();
    let reference = losses_by_step(&shardc(&[&["run"][..], &pipelined[..], &["--steps", "3"]].concat()));
    let staged = processes(&[&pipelined[..], &["--steps", "2", "--checkpoint", pp_arg]].concat(), &[("SHARDC_EMULATE_PROCESSES", "4")]);
    close(&reference, &losses_by_step(&staged), "dp=2, pp=2 interleaved in four processes");
    close(&reference, &losses_by_step(&shardc(&[&["run"][..], &pipelined[..], &["--steps", "3", "--resume", pp_arg]].concat())), "resumed on the CPU from the pipeline processes' checkpoint");
    close(&reference, &losses_by_step(&processes(&[&pipelined[..], &["--steps", "3", "--resume", pp_arg]].concat(), &[("SHARDC_EMULATE_PROCESSES", "4")])), "resumed in four pipeline processes");
    std::fs::remove_dir_all(&dir).ok();
}

/// A process of a multi-process GPU run that panics, fails a kernel or stops answering
/// (emulated processes, `SHARDC_FAULT`) ends every process: the run exits non-zero with the
/// failing process's rank and cause, and never hangs (a silent one within `--timeout`).
#[test]
fn gpu_process_faults_end_every_process_with_the_cause_named() {
    for (kind, says) in [("panic", "rank 1 panics at instruction 30"), ("kernel", "injected kernel failure"), ("hang", "no message from rank 1 within 3s")] {
        let out = Command::new(env!("CARGO_BIN_EXE_shardc"))
            .args(["run", "--backend", "cuda", "models/tiny.toml", "--mesh", "dp=2", "--microbatches", "1", "--steps", "3", "--timeout", "3"])
            .current_dir(root())
            .env("NO_COLOR", "1")
            .env("RUST_BACKTRACE", "0")
            .env("SHARDC_GPU_EMULATE", "1")
            .env("SHARDC_EMULATE_PROCESSES", "2")
            .env("SHARDC_FAULT", format!("1:30:{kind}"))
            .output()
            .unwrap();
        let said = unwrapped(&stderr(&out));
        assert_eq!(out.status.code(), Some(1), "{kind}: {said}");
        assert!(said.contains(says), "{kind}: {said}");
    }
    // A fault that cannot be made is refused, not silently left out: with every rank on one
    // device (no process of its own to end), or a value it cannot read.
    for (backend, env, says) in [
        ("cuda", "1:30:panic", "a fault is injected into one rank's process"),
        ("cpu", "1:thirty:panic", "expected RANK:INSTRUCTION:panic|kernel|hang"),
        ("cpu", "1:30:panic:later", "expected RANK:INSTRUCTION:panic|kernel|hang"),
        ("cpu", "7:30:panic", "the mesh dp=2,tp=1,pp=1 has no rank 7"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_shardc"))
            .args(["run", "--backend", backend, "models/tiny.toml", "--mesh", "dp=2", "--microbatches", "1", "--steps", "1"])
            .current_dir(root())
            .env("NO_COLOR", "1")
            .env("SHARDC_GPU_EMULATE", "1")
            .env("SHARDC_FAULT", env)
            .output()
            .unwrap();
        let said = unwrapped(&stderr(&out));
        assert!(out.status.code() == Some(1) && said.contains(says) && !stdout(&out).contains("loss"), "{backend} SHARDC_FAULT={env}: {said}");
    }
}

/// Checkpoints of format 1 numbered their rank files row-major (pipeline rank fastest);
/// ranks are now numbered as Megatron-LM does (tensor-parallel fastest). Such a checkpoint
/// still resumes into the same run: a format-2 checkpoint rewritten the old way (files
/// renamed to the old numbering, the manifest marked format 1) gives the uninterrupted losses.
#[test]
fn checkpoints_of_the_row_major_format_resume_into_the_same_run() {
    use shardc_runtime::collectives::MeshShape;
    let dir = tempdir("ckpt-format1");
    let ckpt = dir.join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap();
    let base = ["run", "models/tiny.toml", "--mesh", "dp=2,tp=2,pp=2", "--log-every", "1", "--lr-decay-steps", "4"];
    let uninterrupted = losses_by_step(&shardc(&[&base[..], &["--steps", "4"]].concat()));
    let out = shardc(&[&base[..], &["--steps", "2", "--checkpoint", ckpt_arg]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let step = ckpt.join("step-00000002");
    let manifest_path = step.join("manifest.json");
    let mut manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
    assert_eq!(manifest["format_version"], 3);
    // Rank files hold each tensor in f32, the type an f32 model's state takes exactly (format
    // 2 wrote f64: twice the bytes).
    for file in manifest["files"].as_array().unwrap() {
        let bytes = std::fs::read(step.join(file.as_str().unwrap())).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        assert!(n % 8 == 0 && header.values().all(|t| t["dtype"] == "F32"), "{file}: {header:?}");
    }
    let mesh = MeshShape(manifest["mesh"].as_array().unwrap().iter().map(|e| e.as_u64().unwrap() as usize).collect());
    let (files, sums) = (manifest["files"].as_array().unwrap().clone(), manifest["checksums"].as_array().unwrap().clone());
    let row_major = |coords: &[usize]| coords.iter().zip(&mesh.0).fold(0, |acc, (&c, &e)| acc * e + c);
    let (mut old_files, mut old_sums) = (vec![serde_json::Value::Null; files.len()], vec![serde_json::Value::Null; files.len()]);
    let staged = dir.join("staged");
    std::fs::create_dir_all(&staged).unwrap();
    for (rank, file) in files.iter().enumerate() {
        let old = row_major(&mesh.coords(rank));
        let name = format!("rank-{old:05}.safetensors");
        std::fs::rename(step.join(file.as_str().unwrap()), staged.join(&name)).unwrap();
        (old_files[old], old_sums[old]) = (serde_json::Value::from(name), sums[rank].clone());
    }
    assert!(files.iter().enumerate().any(|(rank, _)| row_major(&mesh.coords(rank)) != rank), "the numbering changed on this mesh");
    for entry in std::fs::read_dir(&staged).unwrap() {
        let entry = entry.unwrap();
        std::fs::rename(entry.path(), step.join(entry.file_name())).unwrap();
    }
    // Format 1 wrote f64 values: so do these files now.
    for (name, sum) in old_files.iter().zip(old_sums.iter_mut()) {
        let path = step.join(name.as_str().unwrap());
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let mut tensors: Vec<(&String, &serde_json::Value)> = header.iter().collect();
        tensors.sort_by_key(|(_, t)| t["data_offsets"][0].as_u64().unwrap());
        let wide: Vec<(String, &str, Vec<usize>, Vec<u8>)> = tensors
            .into_iter()
            .map(|(tensor, info)| {
                let (begin, end) = (info["data_offsets"][0].as_u64().unwrap() as usize, info["data_offsets"][1].as_u64().unwrap() as usize);
                let shape = serde_json::from_value(info["shape"].clone()).unwrap();
                (tensor.clone(), "F64", shape, bytes[8 + n + begin..8 + n + end].chunks_exact(4).flat_map(|c| (f32::from_le_bytes(c.try_into().unwrap()) as f64).to_le_bytes()).collect())
            })
            .collect();
        write_safetensors(&path, &wide);
        *sum = crc32fast::hash(&std::fs::read(&path).unwrap()).into();
    }
    manifest["files"] = old_files.into();
    manifest["checksums"] = old_sums.into();
    manifest["format_version"] = 1.into();
    std::fs::write(&manifest_path, serde_json::to_string_pretty(&manifest).unwrap()).unwrap();
    let resumed = losses_by_step(&shardc(&[&base[..], &["--steps", "4", "--resume", ckpt_arg]].concat()));
    assert_eq!(resumed.keys().copied().collect::<Vec<_>>(), [3, 4]);
    assert_same_losses(&uninterrupted, &resumed, "format-1 checkpoint");
    std::fs::remove_dir_all(&dir).ok();
}

/// Mixture of experts (issue 21): a tiny Mixtral-style model (8 experts, top-2, dropless)
/// trains like one device over data, expert, tensor and pipeline parallelism; a
/// Mixtral-8x7B-shaped spec compiles for 64 GPUs with its all-to-alls and counts its active
/// parameters for the model FLOPs; the (emulated) GPU backend trains it too.
#[test]
fn mixture_of_experts_trains_like_one_device() {
    let base = ["run", "models/tiny-moe.toml", "--steps", "50", "--log-every", "1"];
    let single = losses_by_step(&shardc(&base));
    assert_eq!(single.len(), 50);
    assert!(single[&50] < single[&1], "tiny-moe does not learn: {single:?}");
    // Expert parallelism carved from dp: 4 ranks with 2 experts each, and with tp and pp.
    for mesh in ["dp=4", "dp=2,tp=2", "pp=2", "dp=4,ep=4", "dp=2,ep=2,tp=2", "dp=2,ep=2,pp=2"] {
        let out = shardc(&[&base[..], &["--mesh", mesh]].concat());
        assert_same_losses(&single, &losses_by_step(&out), mesh);
    }
    let out = shardc(&[&base[..], &["--mesh", "dp=4,ep=4"]].concat());
    assert!(stdout(&out).contains("mesh dp=4,ep=4,tp=1,pp=1 (4 CPU threads"), "{}", stdout(&out));
    // `explain` shows the dispatch and combine; in mixed precision with ZeRO too, an expert's
    // gradient is reduce-scattered over the data-parallel ranks holding the same experts only.
    let explained = stdout(&shardc(&["explain", "models/tiny-moe.toml", "--mesh", "dp=4,ep=2", "--zero", "1", "--dtype", "bf16", "--microbatches", "1"]));
    assert!(explained.contains("shard.all_to_all   over ep") && explained.contains("ep moved from dimension 1 to dimension 0 for operand 0 of xf.expert_matmul `layers.0.mlp.experts.gate`"), "{explained}");
    // Reduce-scattered in fp32 (4 bytes an element: 3 KiB of the 768-element shard's 1536
    // gradient elements to send), after the cast, as dense gradients are.
    assert!(explained.lines().any(|l| l.contains("shard.reduce_scatter over dp ") && l.contains("3.0 KiB") && l.contains("experts.gate.weight")), "{explained}");
    assert!(!explained.lines().any(|l| l.contains("over dp+ep") && l.contains("experts")), "{explained}");
    // And trains as data parallelism alone does, in bf16 (its rounding apart).
    let bf16 = |mesh: &str| losses_by_step(&shardc(&["run", "models/tiny-moe.toml", "--mesh", mesh, "--dtype", "bf16", "--zero", "1", "--steps", "10", "--log-every", "1"]));
    let (dense, experts) = (bf16("dp=4"), bf16("dp=4,ep=2"));
    assert_eq!(experts.len(), 10);
    for (step, loss) in &experts {
        assert!((loss - dense[step]).abs() <= 2e-3 * dense[step], "bf16 step {step}: ep=2 {loss}, dp=4 alone {}", dense[step]);
    }
    // ep must divide dp and the experts, and needs experts.
    let bad = shardc(&["compile", "models/tiny-moe.toml", "--mesh", "dp=2,ep=4"]);
    assert!(!bad.status.success() && unwrapped(&stderr(&bad)).contains("ep=4 does not divide dp=2"), "{}", stderr(&bad));
    let bad = shardc(&["compile", "models/tiny-llama.toml", "--mesh", "dp=2,ep=2"]);
    assert!(!bad.status.success() && unwrapped(&stderr(&bad)).contains("the model has none"), "{}", stderr(&bad));
    // Mixtral-8x7B on 64 GPUs: one expert per rank of each expert group, and it fits.
    let out = shardc(&["compile", "models/mixtral-8x7b.toml", "--mesh", "dp=8,ep=8,tp=8", "--zero", "1", "--gpu", "h100-sxm"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = unwrapped(&stdout(&out));
    assert!(text.contains("dp=8,ep=8,tp=8,pp=1 (64 ranks)") && text.contains("all_to_all over ep") && text.contains("fits in h100-sxm"), "{text}");
    assert!(text.contains("46,702,792,704") && text.contains("12,879,925,248 active per token"), "{text}");
    assert!(text.contains("xf.expert_matmul 96") && text.contains("xf.moe_dispatch 32"), "{text}");
    // `plan` searches ep with dp, tp, pp: expert-parallel strategies are among those listed.
    let planned = stdout(&shardc(&["plan", "models/mixtral-8x7b.toml", "--gpus", "64", "--top", "40"]));
    assert!(planned.lines().any(|l| l.contains(" ep=8 ") && l.contains("GB")), "{planned}");
    // On the (emulated) GPU too, expert parallel.
    let gpu = Command::new(env!("CARGO_BIN_EXE_shardc")).args(["run", "models/tiny-moe.toml", "--mesh", "dp=2,ep=2", "--backend", "cuda", "--steps", "3", "--log-every", "1"]).current_dir(root()).env("SHARDC_GPU_EMULATE", "1").output().unwrap();
    let on_gpu = losses_by_step(&gpu);
    assert_eq!(on_gpu.len(), 3, "{}", stderr(&gpu));
    let three = losses_by_step(&shardc(&["run", "models/tiny-moe.toml", "--steps", "3", "--log-every", "1"]));
    for (step, loss) in &on_gpu {
        assert!((loss - three[step]).abs() <= 1e-4 * three[step].abs(), "step {step}: GPU {loss}, one device {}", three[step]);
    }
}

/// Mixtral in the Hugging Face layout (issue 21): `--save-hf` of tiny-moe writes a
/// `MixtralForCausalLM` config and each expert's w1, w3 and w2 as `nn.Linear` weights under
/// `block_sparse_moe`; `--hf` reads them back (stacking the experts) on an expert-parallel
/// mesh, and a run that does not move the weights exports the same logits.
#[test]
fn mixtral_round_trips_through_the_hugging_face_layout() {
    let tmp = tempdir("mixtral-hf");
    let (first, second, out) = (tmp.join("first"), tmp.join("second"), tmp.join("logits.json"));
    let run = shardc(&["run", "models/tiny-moe.toml", "--steps", "2", "--save-hf", first.to_str().unwrap()]);
    assert!(run.status.success(), "{}", stderr(&run));
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(first.join("config.json")).unwrap()).unwrap();
    assert_eq!((config["model_type"].as_str(), config["num_local_experts"].as_u64(), config["num_experts_per_tok"].as_u64()), (Some("mixtral"), Some(8), Some(2)), "{config}");
    // Hugging Face's load-balancing coefficient is shardc's weight over top_k.
    assert!((config["router_aux_loss_coef"].as_f64().unwrap() - 0.005).abs() < 1e-12, "{config}");
    let bytes = std::fs::read(first.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(header["model.layers.1.block_sparse_moe.experts.7.w2.weight"]["shape"], serde_json::json!([16, 24]), "down: [hidden, ffn]");
    assert_eq!(header["model.layers.0.block_sparse_moe.experts.0.w1.weight"]["shape"], serde_json::json!([24, 16]), "gate: [ffn, hidden]");
    assert_eq!(header["model.layers.0.block_sparse_moe.gate.weight"]["shape"], serde_json::json!([8, 16]), "router: [experts, hidden]");
    let data = tmp.join("data.txt");
    std::fs::write(&data, (0..4096u32).map(|i| b'a' + ((i * 7 + i / 13) % 26) as u8).collect::<Vec<u8>>()).unwrap();
    let run = shardc(&["run", "--hf", first.to_str().unwrap(), "--data", data.to_str().unwrap(), "--steps", "1", "--lr", "1e-30", "--seq", "8", "--micro-batch", "2", "--mesh", "dp=2,ep=2", "--save-hf", second.to_str().unwrap()]);
    assert!(run.status.success(), "{}", stderr(&run));
    let (_, before) = hf_logits(first.to_str().unwrap(), "1,2,3,4;5,6,7,8", "dp=1,tp=1,pp=1", &out);
    let (_, after) = hf_logits(second.to_str().unwrap(), "1,2,3,4;5,6,7,8", "dp=1,tp=1,pp=1", &out);
    assert!(max_relative(&after, &before) < 1e-6, "the re-exported Mixtral computes other logits");
    let (_, partitioned) = hf_logits(first.to_str().unwrap(), "1,2,3,4;5,6,7,8", "dp=2,ep=2", &out);
    assert!(max_relative(&partitioned, &before) < 1e-6, "expert-parallel logits differ");
    // A mixture of experts Hugging Face has no layout for (shared experts) is refused before
    // it trains.
    let shared = tmp.join("shared.toml");
    std::fs::write(&shared, std::fs::read_to_string(root().join("models/tiny-moe.toml")).unwrap().replace("aux_loss_weight = 0.01", "aux_loss_weight = 0.01\nshared_experts = 1")).unwrap();
    let refused = shardc(&["run", shared.to_str().unwrap(), "--steps", "1", "--save-hf", tmp.join("never").to_str().unwrap()]);
    assert!(!refused.status.success() && unwrapped(&stderr(&refused)).contains("--save-hf: `tiny-moe` is neither") && !stdout(&refused).contains("loss"), "{}", stderr(&refused));
    // A config with more experts than the folder holds is refused naming the tensor.
    let broken = tmp.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::copy(first.join("config.json"), broken.join("config.json")).unwrap();
    let mut config = config.clone();
    config["num_local_experts"] = serde_json::json!(9);
    config["num_experts_per_tok"] = serde_json::json!(2);
    std::fs::write(broken.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(first.join("model.safetensors"), broken.join("model.safetensors")).unwrap();
    let refused = shardc(&["logits", "--hf", broken.to_str().unwrap(), "--tokens", "1,2"]);
    assert!(!refused.status.success() && unwrapped(&stderr(&refused)).contains("`model.layers.0.block_sparse_moe.gate.weight` has shape [8, 16]; its config.json makes it [9, 16]"), "{}", stderr(&refused));
}
