//! `shardc-gpu`: the runtime-only binary of the GPU check (no MLIR, no compiler), for a GPU
//! machine that has no Rust toolchain. It reads compiled plans (`shardc compile --target
//! cuda -o`; pipeline ranks given their device plans by `examples/gpu-check-plans.rs`) and
//! one-op programs listed in a manifest, and
//!
//! * `check MANIFEST`: trains each case on the GPU and on the CPU backend (the oracle) from
//!   the same seed and batches, and compares losses and first-step gradients; a plan with
//!   pipeline ranks (pipeline stages, or gradient accumulation over micro-batches) runs them
//!   all, every rank of the mesh on the one GPU, and on the CPU through the pipeline runtime;
//! * `bench MANIFEST`: times each workload's training step and cuBLAS on a large GEMM, and
//!   prints achieved TFLOP/s against that measured peak and MFU, each beside the cluster
//!   model's prediction that `shardc compile --gpu` left in the plan; then times each
//!   attention case's forward and backward programs and prints their TFLOP/s (FLOPs from the
//!   op registry, staged in the manifest) beside the predicted times. It writes the times
//!   beside the manifest, `bench-measured.json`, for `scripts/gpu-check.sh report`;
//! * `table MANIFEST`: the one table of every row `check` and `bench` left beside the
//!   manifest (`results-check.json`, `results-bench.json`): case, measured, predicted, their
//!   ratio, and the verdict, MFU or TFLOP/s;
//! * `calibrate DIR`: times each single-kernel program that `shardc calibrate --backend cuda
//!   --emit DIR` listed in `DIR/kernels.json` and writes `DIR/measured.json`, from which
//!   `shardc calibrate --measured` fits the cluster model on the build machine;
//! * `train PLAN --data FILE [--steps N] [--seed S] [--resume DIR] [--checkpoint DIR]
//!   [--eval-every N [--eval-windows W]]`: trains a compiled plan as `shardc run --backend
//!   cuda` does (every rank on the GPU, or one rank per process under torchrun), from the
//!   seed or a checkpoint, evaluates on held-out windows on the devices, and checkpoints at
//!   the end (checkpoints move between the two);
//! * `precompile ARCH CACHE PATH...`: compiles the device module of every plan and program
//!   under each PATH (a JSON file or a folder of them) to machine code for ARCH (`sm_90`)
//!   with NVRTC, into the kernel cache folder CACHE, with no GPU needed: a run with
//!   `SHARDC_KERNEL_CACHE=CACHE` then loads each module without compiling it.
//!
//! Exit status 1 when a case does not match (or anything fails). With
//! `SHARDC_GPU_EMULATE=1` the device is the CPU emulation (for trying the check without a
//! GPU; slow beyond tiny models; no cuBLAS peak, so no GEMM share).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use shardc_runtime::cuda::{self, Placement};
use shardc_runtime::data::ByteCorpus;
use shardc_runtime::{DType, Program};

#[derive(Deserialize)]
struct Manifest {
    /// Training text (bytes).
    data: PathBuf,
    #[serde(default)]
    cases: Vec<Case>,
    #[serde(default)]
    bench: Vec<Workload>,
    #[serde(default)]
    attention: Vec<AttentionCase>,
    /// One-op programs forward and backward (attention shapes, norms) whose outputs `check`
    /// compares with the CPU backend's (the tensor-core kernels run only on a GPU: the
    /// emulation takes their fallback; a norm's row cache past 48 KiB of shared memory opts
    /// in only on a GPU).
    #[serde(default)]
    attention_checks: Vec<AttentionCase>,
}

/// A GPU run compared with a CPU run.
#[derive(Deserialize)]
struct Case {
    name: String,
    /// The plan the GPU runs.
    program: PathBuf,
    /// The plan the CPU runs (the same, or its f32 twin for a bf16 case).
    reference: PathBuf,
    steps: u64,
    /// SGD learning rate of both plans (first-step gradients are (p0 - p1) / lr).
    lr: f64,
    loss_tolerance: f64,
    /// Relative tolerance of first-step gradients; absent: not compared (bf16 parameters
    /// cannot resolve one small step).
    gradient_tolerance: Option<f64>,
}

/// A timed training step.
#[derive(Deserialize)]
struct Workload {
    name: String,
    program: PathBuf,
    steps: u64,
    /// Runs the GEMM epilogues as the plain GEMM and the epilogue kernel (`SHARDC_CUBLASLT=0`),
    /// to measure what cuBLASLt's fused epilogues save.
    #[serde(default)]
    without_cublaslt: bool,
}

/// Attention forward and backward at one shape, as `gpu-check-plans attention` staged them.
#[derive(Deserialize)]
struct AttentionCase {
    name: String,
    forward: OneOp,
    backward: OneOp,
    /// Timed runs of each (the fastest counts), after a warm-up run.
    #[serde(default = "three")]
    repeats: usize,
    /// For `attention_checks`: the largest difference of any result over its scale.
    #[serde(default)]
    tolerance: Option<f64>,
}

fn three() -> usize {
    3
}

/// A one-op program, its FLOPs (the op registry's cost) and the cluster model's seconds.
#[derive(Deserialize)]
struct OneOp {
    program: PathBuf,
    flops: f64,
    predicted_seconds: f64,
    /// Attention's FLOPs as FlashAttention's benchmarks count them (`4 b h s^2 d` forward,
    /// halved when causal; 2.5 times that backward), to compare with published rates.
    #[serde(default)]
    fa_flops: Option<f64>,
}

/// One line of the final table.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Row {
    pub case: String,
    pub measured: String,
    pub predicted: String,
    /// Predicted over measured time.
    pub ratio: String,
    pub result: String,
    pub ok: bool,
}

/// What `check` or `bench` leaves beside the manifest for `table`.
#[derive(Serialize, Deserialize, Default, Debug)]
pub struct Results {
    pub device: String,
    pub notes: Vec<String>,
    pub rows: Vec<Row>,
    /// Whether every case of the manifest ran: false in what is written after each row, so
    /// a run stopped by its time limit shows in the table.
    #[serde(default)]
    pub complete: bool,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match cli(&args, &Placement::first_gpu_or_emulated()) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("shardc-gpu: {e}");
            std::process::exit(1);
        }
    }
}

/// The command line on `placement`: whether everything matched.
pub fn cli(args: &[String], placement: &Placement) -> Result<bool, String> {
    match args {
        [command, manifest] if command == "check" => load(manifest).and_then(|(m, dir)| check(&m, &dir, placement)),
        [command, manifest] if command == "bench" => load(manifest).and_then(|(m, dir)| bench(&m, &dir, placement)),
        [command, manifest] if command == "table" => table(Path::new(manifest).parent().unwrap_or(Path::new(""))),
        [command, dir] if command == "calibrate" => calibrate(Path::new(dir), placement),
        [command, manifest] if command == "profile" => load(manifest).and_then(|(m, dir)| profile(&m, &dir, placement)),
        [command, arch, cache, paths @ ..] if command == "precompile" && !paths.is_empty() => precompile(arch, Path::new(cache), paths),
        [command, plan, options @ ..] if command == "train" => train(Path::new(plan), options, placement),
        [command] if command == "available" => match placement {
            Placement::Emulated => Ok(true),
            _ => cuda::check_available().map(|()| true).map_err(|e| e.to_string()),
        },
        _ => Err("usage: shardc-gpu check MANIFEST | bench MANIFEST | profile MANIFEST | table MANIFEST | calibrate DIR | precompile ARCH CACHE PATH... | train PLAN --data FILE [--steps N] [--seed S] [--resume DIR] [--checkpoint DIR] [--eval-every N [--eval-windows W]] | available".into()),
    }
}

/// `precompile`: every distinct device module under `paths` compiled for `arch` into `cache`.
fn precompile(arch: &str, cache: &Path, paths: &[String]) -> Result<bool, String> {
    let capability = arch
        .strip_prefix("sm_")
        .filter(|d| d.len() >= 2 && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| Some((d[..d.len() - 1].parse::<i32>().ok()?, d[d.len() - 1..].parse::<i32>().ok()?)))
        .ok_or_else(|| format!("architecture `{arch}`: give a real GPU architecture such as sm_90 (an H100 or H200) or sm_80 (an A100)"))?;
    // An architecture of the right form that this NVRTC does not know (sm_99, sm_00) is named
    // here, with those it does, not by NVRTC's "invalid value" once per module.
    let archs = cuda::compile::supported_archs().map_err(|e| e.to_string())?;
    if !archs.contains(&(capability.0 * 10 + capability.1)) {
        let known: Vec<String> = archs.iter().map(|a| format!("sm_{a}")).collect();
        return Err(format!("architecture `{arch}`: this NVRTC compiles for {}: give one of those (sm_90 for an H100 or H200)", known.join(", ")));
    }
    // The folder is checked before any compile: a module takes NVRTC seconds, and a folder that
    // cannot be written would fail each of them only after its compile.
    if cache.as_os_str().is_empty() {
        return Err("kernel cache folder (CACHE) is empty: give a folder such as kernel-cache".into());
    }
    let probe = cache.join(format!(".probe-{}", std::process::id()));
    std::fs::create_dir_all(cache)
        .and_then(|()| std::fs::write(&probe, b""))
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| format!("kernel cache folder (CACHE) {}: {e}: give a folder this user can create and write", cache.display()))?;
    let mut files = Vec::new();
    for path in paths.iter().map(Path::new) {
        if path.is_dir() {
            let entries = std::fs::read_dir(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
            let mut inside: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "json")).collect();
            inside.sort();
            files.extend(inside);
        } else {
            files.push(path.to_path_buf());
        }
    }
    // A plan file holds `programs`; a one-op or calibration program is one program. Other
    // JSON (a kernel list, measured times) has no device source and is passed over.
    let mut sources: Vec<String> = Vec::new();
    for file in &files {
        let value = read_json(file)?;
        let programs = match value.get("programs").and_then(|p| p.as_array()) {
            Some(programs) => programs.iter().collect(),
            None => vec![&value],
        };
        for program in programs {
            if let Some(source) = program.get("device").and_then(|d| d.get("source")).and_then(|s| s.as_str())
                && !sources.iter().any(|s| s == source)
            {
                sources.push(source.to_string());
            }
        }
    }
    if sources.is_empty() {
        return Err(format!("no device code in {} file(s): compile the plans with `shardc compile --target cuda`", files.len()));
    }
    let began = std::time::Instant::now();
    // Modules compile side by side, a thread per core (NVRTC compiles separate programs
    // concurrently), each taking the next module in turn.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(sources.len());
    let compile_next = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(source) = sources.get(i) else { return done };
            let one = std::time::Instant::now();
            let origin = cuda::compile::precompile(source, capability, cache).map_err(|e| format!("module {} of {}: {e}", i + 1, sources.len()));
            done.push((i, origin.map(|o| (o, one.elapsed().as_secs_f64()))));
        }
    };
    type Compiled = (usize, Result<(cuda::compile::Origin, f64), String>);
    let mut done: Vec<Compiled> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers).map(|_| s.spawn(compile_next)).collect();
        handles.into_iter().map(|h| h.join().map_err(|_| "a compile worker panicked".to_string())).collect::<Result<Vec<_>, String>>().map(|d| d.into_iter().flatten().collect())
    })?;
    done.sort_by_key(|(i, _)| *i);
    let done = done.into_iter().map(|(_, r)| r).collect::<Result<Vec<_>, String>>()?;
    let mut compiled = 0;
    for (source, (origin, seconds)) in sources.iter().zip(&done) {
        let fresh = *origin == cuda::compile::Origin::Compiled;
        compiled += usize::from(fresh);
        let first_line = source.lines().next().unwrap_or("").trim_start_matches("// ");
        println!("  {seconds:>6.1} s  {:<9} {first_line}", if fresh { "compiled" } else { "cached" });
    }
    println!("shardc-gpu precompile: {} modules for {arch} in {} ({compiled} compiled now) in {:.0} s", sources.len(), cache.display(), began.elapsed().as_secs_f64());
    Ok(true)
}

fn load(path: &str) -> Result<(Manifest, PathBuf), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
    let manifest: Manifest = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    let dir = Path::new(path).parent().map(Path::to_path_buf).unwrap_or_default();
    Ok((manifest, dir))
}

fn read_json(path: &Path) -> Result<serde_json::Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The programs a plan file written by `shardc compile -o` trains with: its pipeline ranks
/// (pipeline stages or several micro-batches per step), in rank order, or else its
/// `train_step`. With `device`, each must carry its device plan.
fn step_programs(path: &Path, device: bool) -> Result<Vec<Program>, String> {
    let plan = read_json(path)?;
    let programs = plan.get("programs").and_then(|p| p.as_array()).ok_or_else(|| format!("{}: not a shardc plan", path.display()))?;
    let parse = |p: &serde_json::Value| Program::from_value(p.clone()).map_err(|e| format!("{}: {e}", path.display()));
    let ranks = programs.iter().filter(|p| p.get("pipeline").is_some_and(|x| !x.is_null())).map(parse).collect::<Result<Vec<_>, _>>()?;
    let mut chosen = if ranks.is_empty() {
        let step = programs.iter().find(|p| p.get("name").and_then(|n| n.as_str()) == Some("train_step")).ok_or_else(|| format!("{}: no train_step", path.display()))?;
        vec![parse(step)?]
    } else {
        ranks
    };
    chosen.sort_by_key(|p| p.pipeline.as_ref().map_or(0, |x| x.rank));
    if device && let Some(p) = chosen.iter().find(|p| p.device.is_none()) {
        return Err(format!(
            "{}: program `{}` has no device code (compile with `shardc compile --target cuda`, which gives every training step and pipeline rank its device code)",
            path.display(),
            p.name
        ));
    }
    Ok(chosen)
}

/// The compiler's estimate for the plan (`shardc compile --gpu`), if the plan carries one.
fn estimate(path: &Path) -> Option<serde_json::Value> {
    read_json(path).ok()?.get("summary")?.get("estimate").cloned()
}

/// Layers of the model, from its parameter names (`layers.N.`) in any program, for the
/// initialisation scale.
fn layers(programs: &[Program]) -> usize {
    programs.iter().flat_map(|p| &p.args).filter_map(|a| a.name.strip_prefix("layers.")?.split('.').next()?.parse::<usize>().ok()).max().map_or(1, |l| l + 1)
}

fn global_shape(program: &Program, binding: &shardc_runtime::program::Binding) -> Vec<usize> {
    binding.layout.as_ref().map_or_else(|| program.buffers[binding.buffer].shape.clone(), |l| l.global_shape.clone())
}

fn corpus(manifest: &Manifest, dir: &Path, programs: &[Program]) -> Result<ByteCorpus, String> {
    byte_corpus(&dir.join(&manifest.data), programs)
}

/// `path`'s bytes as training text, one token per byte, in windows of the programs' sequence
/// over the model's vocabulary (as `shardc run` reads text without a tokenizer).
fn byte_corpus(path: &Path, programs: &[Program]) -> Result<ByteCorpus, String> {
    let seq = programs.iter().find_map(|p| p.arg("tokens").or_else(|| p.arg("targets")).map(|a| global_shape(p, a)[1])).ok_or("no tokens input")?;
    // The model's vocabulary: the embedding table's rows before padding.
    let vocab = programs
        .iter()
        .find_map(|p| p.args.iter().find(|a| a.name == "embed.tokens.weight").map(|a| a.logical_shape(&global_shape(p, a))[0]))
        .ok_or("no embedding table")?;
    let bytes = std::fs::read(path).map_err(|e| format!("reading the corpus {}: {e}", path.display()))?;
    ByteCorpus::new(bytes, seq, vocab).map_err(|e| e.to_string())
}

/// `train PLAN --data FILE [--steps N] [--seed S] [--resume DIR] [--checkpoint DIR]
/// [--eval-every N [--eval-windows W]]`: trains the plan's step (or pipeline ranks) on
/// `placement` as `shardc run --backend cuda` does, from the seed or a checkpoint, on FILE's
/// bytes as text (one token per byte), evaluates every N steps and at the end (the first W
/// held-out windows, 64 by default, on the devices with the step's forward, as `shardc run
/// --eval-every` does), and checkpoints at the end: every rank on one GPU, or, under
/// torchrun (`RANK`, `WORLD_SIZE`, ...), one rank per process over NCCL, each reading and
/// writing its own shards. Its checkpoints resume under `shardc run` and the other way round:
/// what a GPU machine with no compiler trains with.
fn train(plan: &Path, options: &[String], placement: &Placement) -> Result<bool, String> {
    train_saying(plan, options, placement, &mut |line| println!("{line}"))
}

/// [`train`], each line it prints given to `say` (rank 0's, in a multi-process run).
pub fn train_saying(plan: &Path, options: &[String], placement: &Placement, say: &mut dyn FnMut(String)) -> Result<bool, String> {
    const FLAGS: [&str; 7] = ["--data", "--steps", "--seed", "--resume", "--checkpoint", "--eval-every", "--eval-windows"];
    let mut given: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
    for pair in options.chunks(2) {
        match pair {
            [flag, value] if FLAGS.contains(&flag.as_str()) => {
                if given.insert(flag.as_str(), value.as_str()).is_some() {
                    return Err(format!("{flag} is given twice"));
                }
            }
            [flag, ..] => return Err(format!("train: unknown option `{flag}` or one without its value (options: --data FILE, --steps N, --seed S, --resume DIR, --checkpoint DIR, --eval-every N, --eval-windows W)")),
            [] => {}
        }
    }
    let number = |flag: &str, default: u64| -> Result<u64, String> { given.get(flag).map_or(Ok(default), |v| v.parse().map_err(|_| format!("{flag} {v}: expected a whole number"))) };
    let (steps, seed, eval_every, eval_windows) = (number("--steps", 1)?, number("--seed", 0)?, number("--eval-every", 0)?, number("--eval-windows", 64)?);
    if steps == 0 {
        return Err("--steps 0: train at least one step".into());
    }
    if given.contains_key("--eval-windows") && eval_every == 0 {
        return Err("--eval-windows sizes the validation loss, which train prints only with --eval-every N".into());
    }
    if eval_every > 0 && eval_windows == 0 {
        return Err("--eval-windows 0: evaluate on at least one window, e.g. --eval-windows 64".into());
    }
    let data = given.get("--data").ok_or("train: give --data FILE (text, one token per byte)")?;
    let programs = step_programs(plan, true)?;
    let model = read_json(plan)?.get("spec").and_then(|s| s.get("model")).cloned().ok_or_else(|| format!("{}: the plan has no spec", plan.display()))?;
    let corpus = byte_corpus(Path::new(data), &programs)?;
    let placement = match std::env::var_os("RANK") {
        Some(_) => Placement::Nccl(cuda::nccl::Bootstrap::from_env().map_err(|e| e.to_string())?),
        None => placement.clone(),
    };
    let speaks = match &placement {
        Placement::Nccl(b) => b.rank == 0,
        _ => true,
    };
    let mut trainer = match given.get("--resume") {
        Some(dir) => cuda::CudaTrainer::resume(&programs, &placement, Path::new(dir)).map_err(|e| format!("resuming from {dir}: {e}"))?.0,
        None => cuda::CudaTrainer::new(&programs, &placement, seed, layers(&programs), None).map_err(|e| e.to_string())?,
    };
    let last = trainer.steps_taken() + steps;
    for _ in 0..steps {
        let (loss, _) = trainer.step(&corpus).map_err(|e| e.to_string())?;
        let at = trainer.steps_taken();
        if !loss.is_finite() {
            return Err(format!("the loss became {loss} at step {at}"));
        }
        if speaks {
            say(format!("step {at} loss {loss:.6}"));
        }
        if eval_every > 0 && (at % eval_every == 0 || at == last) {
            let loss = trainer.evaluate(&corpus, eval_windows as usize).map_err(|e| format!("evaluating after step {at}: {e}"))?;
            if speaks {
                say(format!("step {at} validation loss {loss:.6}"));
            }
        }
    }
    if let Some(dir) = given.get("--checkpoint") {
        let dir = Path::new(dir);
        let written = if trainer.process_rank().is_some() { trainer.checkpoint_own_shards(dir, model, None, false).map(|p| p.unwrap_or_default()) } else { trainer.checkpoint_every_rank(dir, model, None, None) };
        let written = written.map_err(|e| format!("checkpointing into {}: {e}", dir.display()))?;
        if speaks {
            say(format!("checkpoint step {} in {}", trainer.steps_taken(), written.display()));
        }
    }
    Ok(true)
}

type Parameters = Vec<(String, Vec<f64>)>;

/// Losses and parameters of a CPU run (the oracle): the pipeline runtime for pipeline ranks,
/// rank threads for a mesh, one trainer otherwise.
fn cpu_run(programs: &[Program], corpus: &ByteCorpus, steps: u64) -> Result<(Vec<f64>, Parameters), String> {
    let layers = layers(programs);
    let timeout = std::time::Duration::from_secs(600);
    let program = &programs[0];
    if program.pipeline.is_some() {
        let run = shardc_runtime::pipeline::train_pipeline(programs, 0, layers, corpus, steps, timeout, shardc_runtime::collectives::Algorithm::Ring).map_err(|e| e.to_string())?;
        return Ok((run.losses, run.parameters.into_iter().map(|(n, _, v)| (n, v)).collect()));
    }
    if program.mesh.iter().product::<usize>() > 1 {
        let run = shardc_runtime::train::train_spmd(program, 0, layers, corpus, steps, timeout).map_err(|e| e.to_string())?;
        return Ok((run.losses, run.parameters.into_iter().map(|(n, _, v)| (n, v)).collect()));
    }
    let mut trainer = shardc_runtime::train::Trainer::new(program.clone(), 0, layers).map_err(|e| e.to_string())?;
    let losses = (0..steps).map(|_| trainer.step(corpus)).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
    let params = trainer.parameters().map_err(|e| e.to_string())?.into_iter().map(|(n, _, v)| (n, v.into_iter().map(f64::from).collect())).collect();
    Ok((losses, params))
}

/// max |a - b| / max(max |a|, 0.01): the initialisation scale floors the denominator.
/// Infinite when the lengths differ or any value is not finite (`f64::max` would skip a NaN).
fn relative(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() || a.iter().chain(b).any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    diff / a.iter().map(|x| x.abs()).fold(0.01, f64::max)
}

/// What a plan runs: mesh (dp, tp, pp) and, with pipeline ranks, schedule and micro-batches.
fn layout_note(programs: &[Program]) -> String {
    let mesh = &programs[0].mesh;
    let at = |i: usize| mesh.get(i).copied().unwrap_or(1);
    let mut note = format!("({},{},{})", at(0), at(1), at(2));
    if let Some(p) = &programs[0].pipeline {
        note += &format!(" {} x{}", p.kind.label(), p.microbatches);
    }
    note
}

fn check(manifest: &Manifest, dir: &Path, placement: &Placement) -> Result<bool, String> {
    let mut all = true;
    let mut results = Results::default();
    results.notes.push(format!("numerics: {} steps per case from seed 0, GPU against the CPU backend (the bf16 cases against the f32 plan)", manifest.cases.iter().map(|c| c.steps).max().unwrap_or(0)));
    println!("{:<40} {:>10} {:>10} {:>10} {:>12} {:>8} {:>6}", "case (CPU vs GPU)", "loss CPU", "loss GPU", "loss rel", "grad rel", "match", "s");
    for case in &manifest.cases {
        // A case that cannot run is a failed row: the cases after it still run.
        let row = check_case(manifest, dir, placement, case, &mut results.device).unwrap_or_else(|(label, e)| {
            println!("{label:<40} {:>10} {:>10} {:>10} {:>12} {:>8}", "-", "-", "-", "-", "ERROR");
            error_row(&label, &e)
        });
        all &= row.ok;
        results.rows.push(row);
        // After every row, so a run stopped by its time limit still leaves what it did.
        write_results(dir, "check", &results)?;
    }
    for a in &manifest.attention_checks {
        let began = std::time::Instant::now();
        let tolerance = a.tolerance.unwrap_or(2e-2);
        let mut worst: (f64, String) = (0.0, String::new());
        let mut error = None;
        for (what, op) in [("forward", &a.forward), ("backward", &a.backward)] {
            let program = read_json(&dir.join(&op.program)).and_then(|v| Program::from_value(v).map_err(|e| format!("{}: {e}", op.program.display())));
            match program.and_then(|p| one_op_against_the_cpu(&p, placement)) {
                Ok(errors) => {
                    for (name, rel) in errors {
                        if rel > worst.0 || worst.1.is_empty() {
                            worst = (rel, format!("{what} {name}"));
                        }
                    }
                }
                Err(e) => {
                    error.get_or_insert(format!("{what}: {e}"));
                }
            }
        }
        let ok = error.is_none() && worst.0 <= tolerance;
        println!("{:<40} {:>10} {:>10} {:>10.2e} {:>12} {:>8} {:>6.1}", a.name, "-", "-", worst.0, "-", if ok { "yes" } else if error.is_some() { "ERROR" } else { "NO" }, began.elapsed().as_secs_f64());
        all &= ok;
        results.rows.push(Row {
            case: a.name.clone(),
            measured: format!("rel {:.1e} ({})", worst.0, worst.1),
            predicted: "-".into(),
            ratio: "-".into(),
            result: match error {
                Some(e) => format!("ERROR: {e}"),
                None if ok => format!("match (outputs and gradients {tolerance:.0e})"),
                None => format!("MISMATCH: {} rel {:.2e} > {tolerance:.0e}", worst.1, worst.0),
            },
            ok,
        });
        write_results(dir, "check", &results)?;
    }
    results.complete = true;
    write_results(dir, "check", &results)?;
    Ok(all)
}

/// Runs a one-op program on the GPU and on the CPU backend from the same inputs (q, k and v
/// at a few units, so the softmax has real peaks to track; the output gradient at one): each
/// result's name and largest difference over its scale.
fn one_op_against_the_cpu(program: &Program, placement: &Placement) -> Result<Vec<(String, f64)>, String> {
    let text = |e: shardc_runtime::RuntimeError| e.to_string();
    let mut cpu = shardc_runtime::cpu::CpuExecutor::new(program.clone()).map_err(text)?;
    let mut gpu = cuda::CudaExecutor::new(program.clone(), placement).map_err(text)?;
    for (i, arg) in program.args.iter().enumerate() {
        let scale = if i < 3 { 3.0 } else { 1.0 };
        let values: Vec<f64> = (0..program.buffers[arg.buffer].len()).map(|j| 2.0 * (shardc_runtime::init::uniform(i as u64 + 11, j as u64) - 0.5) * scale).collect();
        cpu.write_f64(&arg.name, &values).map_err(text)?;
        gpu.write(0, &arg.name, &values).map_err(text)?;
    }
    cpu.run().map_err(text)?;
    gpu.run().map_err(text)?;
    gpu.synchronize().map_err(text)?;
    program.results.iter().map(|r| Ok((r.name.clone(), relative(&cpu.read_f64(&r.name).map_err(text)?, &gpu.read(0, &r.name).map_err(text)?)))).collect()
}

/// One case of `check`: its row, or its label and why it could not run.
fn check_case(manifest: &Manifest, dir: &Path, placement: &Placement, case: &Case, device: &mut String) -> Result<Row, (String, String)> {
    let unnamed = |e: String| (case.name.clone(), e);
    let (programs, reference) = (step_programs(&dir.join(&case.program), true).map_err(unnamed)?, step_programs(&dir.join(&case.reference), false).map_err(unnamed)?);
    let label = format!("{} {}", case.name, layout_note(&programs));
    let named = |e: String| (label.clone(), e);
    let corpus = corpus(manifest, dir, &programs).map_err(named)?;
    let layers = layers(&programs);
    let began = std::time::Instant::now();
    // The CPU oracle (its steps, then one step for the gradients) runs on its own thread
    // while the GPU trains: neither waits for the other.
    let (gpu, gpu_one, cpu, cpu_one) = std::thread::scope(|s| {
        let oracle = s.spawn(|| {
            let steps = cpu_run(&reference, &corpus, case.steps);
            let one = if case.gradient_tolerance.is_some() { Some(cpu_run(&reference, &corpus, 1)) } else { None };
            (steps, one)
        });
        let gpu = cuda::train_programs(&programs, 0, layers, &corpus, case.steps, placement);
        // First-step gradients from one SGD step on each backend: (p0 - p1) / lr.
        let gpu_one = if case.gradient_tolerance.is_some() && gpu.is_ok() { Some(cuda::train_programs(&programs, 0, layers, &corpus, 1, placement)) } else { None };
        let (cpu, cpu_one) = oracle.join().unwrap_or_else(|_| (Err("the CPU oracle panicked".into()), None));
        (gpu, gpu_one, cpu, cpu_one)
    });
    let gpu = gpu.map_err(|e| named(e.to_string()))?;
    device.clone_from(&gpu.device);
    let (cpu_losses, _) = cpu.map_err(|e| named(format!("(CPU) {e}")))?;
    let loss_rel = cpu_losses.iter().zip(&gpu.losses).map(|(c, g)| (c - g).abs() / c.abs().max(1e-12)).fold(0.0, f64::max);
    let mut ok = loss_rel <= case.loss_tolerance && gpu.losses.len() == cpu_losses.len() && gpu.losses.iter().all(|l| l.is_finite());
    let mut why = if ok { String::new() } else { format!("loss rel {loss_rel:.2e} > {:.0e}", case.loss_tolerance) };
    let mut grad_text = "n/a".to_string();
    if let Some(tolerance) = case.gradient_tolerance {
        let gpu_one = gpu_one.ok_or_else(|| named("no one-step GPU run".into()))?.map_err(|e| named(e.to_string()))?;
        let (_, cpu_one) = cpu_one.ok_or_else(|| named("no one-step CPU run".into()))?.map_err(|e| named(format!("(CPU) {e}")))?;
        let mut worst: Option<(f64, String)> = None;
        for (name, shape, after_gpu) in &gpu_one.parameters {
            let Some((_, after_cpu)) = cpu_one.iter().find(|(n, _)| n == name) else { continue };
            let initial = shardc_runtime::init::init_param(name, shape.iter().product(), 0, layers);
            let grad = |after: &[f64]| initial.iter().zip(after).map(|(p0, p1)| (p0 - p1) / case.lr).collect::<Vec<f64>>();
            let rel = relative(&grad(after_cpu), &grad(after_gpu));
            if worst.as_ref().is_none_or(|(w, _)| rel > *w) {
                worst = Some((rel, name.clone()));
            }
        }
        let Some(worst) = worst else {
            return Err(named("no parameter of the GPU run is in the CPU run".into()));
        };
        grad_text = format!("{:.2e}", worst.0);
        if worst.0 > tolerance {
            ok = false;
            grad_text.push_str(&format!(" ({})", worst.1));
            why = format!("{why}{}gradient of {} rel {:.2e} > {tolerance:.0e}", if why.is_empty() { "" } else { "; " }, worst.1, worst.0);
        }
    }
    println!(
        "{:<40} {:>10.5} {:>10.5} {:>10.2e} {:>12} {:>8} {:>6.1}",
        label,
        cpu_losses.last().copied().unwrap_or(f64::NAN),
        gpu.losses.last().copied().unwrap_or(f64::NAN),
        loss_rel,
        grad_text,
        if ok { "yes" } else { "NO" },
        began.elapsed().as_secs_f64()
    );
    let tolerances = match case.gradient_tolerance {
        Some(g) => format!("loss {:.0e}, grad {g:.0e}", case.loss_tolerance),
        None => format!("loss {:.0e}", case.loss_tolerance),
    };
    Ok(Row {
        case: label.clone(),
        measured: if case.gradient_tolerance.is_some() { format!("loss rel {loss_rel:.1e}, grad rel {grad_text}") } else { format!("loss rel {loss_rel:.1e}") },
        predicted: "-".into(),
        ratio: "-".into(),
        result: if ok { format!("match ({tolerances})") } else { format!("MISMATCH: {why}") },
        ok,
    })
}

fn write_results(dir: &Path, what: &str, results: &Results) -> Result<(), String> {
    let out = dir.join(format!("results-{what}.json"));
    std::fs::write(&out, serde_json::to_string_pretty(results).map_err(|e| e.to_string())?).map_err(|e| format!("writing {}: {e}", out.display()))
}

/// Milliseconds, with as many decimals as a small time needs.
fn ms(seconds: f64) -> String {
    let ms = 1e3 * seconds;
    if ms >= 100.0 { format!("{ms:.1} ms") } else if ms >= 1.0 { format!("{ms:.2} ms") } else { format!("{ms:.4} ms") }
}

fn bench(manifest: &Manifest, dir: &Path, placement: &Placement) -> Result<bool, String> {
    let mut results = Results::default();
    let mut all = true;
    results.notes.push("predicted: the cluster model's h200 preset (`shardc compile --gpu h200`); pred/meas below 1: the GPU is slower than the model".into());
    // cuBLAS on one large square GEMM: the reference for achieved GEMM throughput. The
    // emulated device has no cuBLAS to measure.
    let peaks = match placement {
        Placement::SingleDevice { device } => match cuda::gemm_peak(*device, 8192, DType::Bf16, 20).and_then(|bf16| Ok((bf16, cuda::gemm_peak(*device, 8192, DType::F32, 5)?))) {
            Ok((bf16, f32)) => {
                println!("cuBLAS peak (8192^3 GEMM): bf16 {bf16:.1} TFLOP/s, f32 {f32:.1} TFLOP/s");
                results.notes.push(format!("cuBLAS measured peak (8192^3 GEMM): bf16 {bf16:.1} TFLOP/s, f32 {f32:.1} TFLOP/s"));
                Some((bf16, f32))
            }
            Err(e) => {
                // The timed workloads still run: their rows then have no GEMM share.
                println!("cuBLAS peak: ERROR {e}");
                results.notes.push(format!("cuBLAS peak not measured: {e}"));
                all = false;
                None
            }
        },
        _ => {
            results.notes.push("cuBLAS peak not measured (no GPU of this process's own): no GEMM shares".into());
            None
        }
    };
    println!("{:<34} {:>6} {:>10} {:>14} {:>12} {:>8} {:>14} {:>10}", "workload", "dtype", "ms/step", "GEMM TFLOP/s", "peak", "ratio", "predicted ms", "pred/meas");
    let mut measured = serde_json::Map::new();
    // A workload that cannot run is an error row; the ones after it still run, and the rows
    // so far are written after each, so a run stopped by its time limit leaves them.
    let save = |results: &Results, measured: &serde_json::Map<String, serde_json::Value>| -> Result<(), String> {
        // For `scripts/gpu-check.sh report`: the calibrated model's prediction beside these.
        let out = dir.join("bench-measured.json");
        std::fs::write(&out, serde_json::to_string_pretty(measured).map_err(|e| e.to_string())?).map_err(|e| format!("writing {}: {e}", out.display()))?;
        write_results(dir, "bench", results)
    };
    for w in &manifest.bench {
        let row = bench_workload(manifest, dir, placement, w, peaks, &mut results.device).unwrap_or_else(|e| {
            println!("{:<34} ERROR {e}", w.name);
            (error_row(&w.name, &e), None)
        });
        all &= row.0.ok;
        results.rows.push(row.0);
        if let Some(seconds) = row.1 {
            measured.insert(w.program.display().to_string(), serde_json::json!(seconds));
        }
        save(&results, &measured)?;
    }
    if !manifest.attention.is_empty() {
        println!("{:<58} {:>12} {:>12} {:>12} {:>14} {:>10}", "attention", "fwd ms", "bwd ms", "TFLOP/s", "predicted ms", "pred/meas");
    }
    for a in &manifest.attention {
        let row = bench_attention(dir, placement, a, peaks, &mut measured).unwrap_or_else(|e| {
            println!("{:<58} ERROR {e}", a.name);
            error_row(&a.name, &e)
        });
        all &= row.ok;
        results.rows.push(row);
        save(&results, &measured)?;
    }
    results.complete = true;
    save(&results, &measured)?;
    Ok(all)
}

/// The row of a case that could not run.
fn error_row(case: &str, e: &str) -> Row {
    Row { case: case.into(), measured: "-".into(), predicted: "-".into(), ratio: "-".into(), result: format!("ERROR: {e}"), ok: false }
}

/// One timed training step: its row, and the median step's seconds where the plan's
/// prediction is comparable (fused epilogues).
fn bench_workload(manifest: &Manifest, dir: &Path, placement: &Placement, w: &Workload, peaks: Option<(f64, f64)>, device: &mut String) -> Result<(Row, Option<f64>), String> {
    let path = dir.join(&w.program);
    let programs = step_programs(&path, true)?;
    let corpus = corpus(manifest, dir, &programs)?;
    if w.without_cublaslt {
        // SAFETY: set while this process runs no other thread (each case's ranks are
        // joined before the next case starts), read by the runtime's GEMM calls.
        unsafe { std::env::set_var("SHARDC_CUBLASLT", "0") };
    }
    let run = cuda::train_programs(&programs, 0, layers(&programs), &corpus, w.steps.max(2), placement).map_err(|e| format!("{}: {e}", w.name));
    if w.without_cublaslt {
        // SAFETY: as above.
        unsafe { std::env::remove_var("SHARDC_CUBLASLT") };
    }
    let run = run?;
    device.clone_from(&run.device);
    // The first step compiles nothing but warms caches and cuBLAS heuristics.
    let mut sorted = run.step_seconds[1..].to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let dtype = programs[0].device.as_ref().map_or(DType::F32, |d| d.dtype);
    // GEMM throughput of a one-program step: every rank runs the plan's products once.
    let gemm = match programs.as_slice() {
        [program] if program.pipeline.is_none() => {
            let ranks = program.mesh.iter().product::<usize>().max(1) as f64;
            program.device.as_ref().map(|plan| cuda::gemm_flops(plan) * ranks / median / 1e12)
        }
        _ => None,
    };
    let peak = peaks.map(|(bf16, f32)| if dtype == DType::Bf16 { bf16 } else { f32 });
    // The compiler's prediction for this GPU (the preset the plan was compiled with), and
    // MFU: model FLOPs over the GPU's nominal peak, which the estimate's MFU fixes.
    let estimate = estimate(&path);
    let field = |name: &str| estimate.as_ref().and_then(|e| e.get(name)).and_then(|v| v.as_f64());
    // The plan's estimate prices its GEMM epilogues as cuBLASLt runs them, fused: it
    // predicts nothing for the fallback this row times.
    let (predicted, model_mfu) = if w.without_cublaslt { (None, None) } else { (field("step_seconds"), field("mfu")) };
    let fmt = |x: Option<f64>, f: &dyn Fn(f64) -> String| x.map_or_else(|| "-".to_string(), f);
    println!(
        "{:<34} {:>6} {:>10.2} {:>14} {:>12} {:>8} {:>14} {:>10}",
        w.name,
        format!("{dtype:?}").to_lowercase(),
        1e3 * median,
        fmt(gemm, &|g| format!("{g:.1}")),
        fmt(peak, &|p| format!("{p:.1}")),
        fmt(gemm.zip(peak).map(|(g, p)| g / p), &|r| format!("{:.0}%", 100.0 * r)),
        fmt(predicted, &|p| format!("{:.2}", 1e3 * p)),
        fmt(predicted, &|p| format!("{:.2}", p / median)),
    );
    let mut result = Vec::new();
    if let (Some(p), Some(m)) = (predicted, model_mfu) {
        result.push(format!("MFU {:.1}% (model {:.1}%)", 100.0 * m * p / median, 100.0 * m));
    }
    if let Some(g) = gemm {
        result.push(match peak {
            Some(p) => format!("GEMM {g:.1} TFLOP/s = {:.0}% of cuBLAS", 100.0 * g / p),
            None => format!("GEMM {g:.1} TFLOP/s"),
        });
    }
    let row = Row {
        case: format!("{} {}", w.name, format!("{dtype:?}").to_lowercase()),
        measured: format!("{} /step", ms(median)),
        predicted: fmt(predicted, &ms),
        ratio: fmt(predicted, &|p| format!("{:.2}", p / median)),
        result: result.join(", "),
        ok: true,
    };
    Ok((row, (!w.without_cublaslt).then_some(median)))
}

/// One attention shape's forward and backward, timed: its row (the times go into `measured`).
fn bench_attention(dir: &Path, placement: &Placement, a: &AttentionCase, peaks: Option<(f64, f64)>, measured: &mut serde_json::Map<String, serde_json::Value>) -> Result<Row, String> {
    let mut times = Vec::new();
    for op in [&a.forward, &a.backward] {
        let program = Program::from_value(read_json(&dir.join(&op.program))?).map_err(|e| format!("{}: {e}", op.program.display()))?;
        let seconds = cuda::time_program(program, placement, a.repeats).map_err(|e| format!("{}: {e}", a.name))?;
        measured.insert(op.program.display().to_string(), serde_json::json!(seconds));
        times.push(seconds);
    }
    let (fwd, bwd) = (times[0], times[1]);
    let (total, predicted) = (fwd + bwd, a.forward.predicted_seconds + a.backward.predicted_seconds);
    let tflops = |flops: f64, seconds: f64| flops / seconds / 1e12;
    // Three significant figures down to a tiny (emulated) rate.
    let fmt = |x: f64| if x >= 100.0 { format!("{x:.0}") } else if x >= 1.0 { format!("{x:.1}") } else { format!("{x:.3}") };
    let rate = tflops(a.forward.flops + a.backward.flops, total);
    println!("{:<58} {:>12.3} {:>12.3} {:>12.1} {:>14.3} {:>10.2}", a.name, 1e3 * fwd, 1e3 * bwd, rate, 1e3 * predicted, predicted / total);
    let mut share = peaks.map_or_else(String::new, |(bf16, _)| format!(", {:.0}% of cuBLAS bf16", 100.0 * rate / bf16));
    if let (Some(f), Some(b)) = (a.forward.fa_flops, a.backward.fa_flops) {
        share.push_str(&format!("; FlashAttention's count: {} TFLOP/s (fwd {}, bwd {})", fmt(tflops(f + b, total)), fmt(tflops(f, fwd)), fmt(tflops(b, bwd))));
    }
    Ok(Row {
        case: a.name.clone(),
        measured: format!("{} + {} = {}", ms(fwd), ms(bwd), ms(total)),
        predicted: ms(predicted),
        ratio: format!("{:.2}", predicted / total),
        result: format!("{} TFLOP/s (fwd {}, bwd {}){share}", fmt(rate), fmt(tflops(a.forward.flops, fwd)), fmt(tflops(a.backward.flops, bwd))),
        ok: true,
    })
}

/// `profile MANIFEST`: each timed workload's step with every instruction timed on the device
/// (after two warm-up steps): where the step's time goes, by op and by op and shapes, and
/// how much of the step the device spent in instructions at all (the rest is the host:
/// launches it could not queue ahead, uploads, the loss read back). Writes
/// `profile-N.json` beside the manifest for each workload N (instruction, op, shapes,
/// seconds), for the cost model to be checked against.
fn profile(manifest: &Manifest, dir: &Path, placement: &Placement) -> Result<bool, String> {
    let mut all = true;
    for (n, w) in manifest.bench.iter().enumerate().filter(|(_, w)| !w.without_cublaslt) {
        match profile_workload(manifest, dir, placement, w, n) {
            Ok(()) => {}
            Err(e) => {
                println!("{}: ERROR {e}", w.name);
                all = false;
            }
        }
    }
    Ok(all)
}

fn profile_workload(manifest: &Manifest, dir: &Path, placement: &Placement, w: &Workload, n: usize) -> Result<(), String> {
    let programs = step_programs(&dir.join(&w.program), true)?;
    let corpus = corpus(manifest, dir, &programs)?;
    let text = |e: shardc_runtime::RuntimeError| e.to_string();
    let mut trainer = cuda::CudaTrainer::new(&programs, placement, 0, layers(&programs), None).map_err(text)?;
    for _ in 0..2 {
        trainer.step(&corpus).map_err(text)?;
    }
    let (_, wall, spans) = trainer.profiled_step(&corpus).map_err(text)?;
    // (op, operand shapes) of each instruction run, with its seconds.
    let shapes = |p: &Program, ids: &[usize]| ids.iter().map(|&b| format!("{:?}", p.buffers[b].shape)).collect::<Vec<_>>().join(" ");
    let mut runs: Vec<(String, String, f64)> = Vec::new();
    for (program, spans) in trainer.programs().iter().zip(&spans) {
        for &(index, seconds) in spans {
            let instr = &program.instrs[index];
            runs.push((instr.op.clone(), format!("{} -> {}", shapes(program, &instr.inputs), shapes(program, &instr.outputs)), seconds));
        }
    }
    let busy: f64 = runs.iter().map(|r| r.2).sum();
    println!("== {} ({} instructions with device work timed): step {} wall, {} in their work on the device ({:.0}%) ==", w.name, runs.len(), ms(wall), ms(busy), 100.0 * busy / wall);
    let top = |key: &dyn Fn(&(String, String, f64)) -> String, title: &str, count: usize| {
        let mut by: std::collections::HashMap<String, (f64, usize)> = std::collections::HashMap::new();
        for r in &runs {
            let e = by.entry(key(r)).or_default();
            e.0 += r.2;
            e.1 += 1;
        }
        let mut rows: Vec<_> = by.into_iter().collect();
        rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
        println!("  {:<100} {:>6} {:>12} {:>6}", title, "runs", "total", "share");
        for (k, (seconds, runs)) in rows.into_iter().take(count) {
            println!("  {:<100} {:>6} {:>12} {:>5.1}%", k.chars().take(100).collect::<String>(), runs, ms(seconds), 100.0 * seconds / wall);
        }
    };
    top(&|r| r.0.clone(), "op", 12);
    top(&|r| format!("{} {}", r.0, r.1), "op and shapes", 15);
    let json: Vec<_> = runs.iter().map(|(op, shapes, seconds)| serde_json::json!({"op": op, "shapes": shapes, "seconds": seconds})).collect();
    let out = dir.join(format!("profile-{n}.json"));
    std::fs::write(&out, serde_json::to_string(&serde_json::json!({"workload": w.name, "wall_seconds": wall, "instructions": json})).map_err(|e| e.to_string())?).map_err(|e| format!("writing {}: {e}", out.display()))
}

/// `table MANIFEST`: one table of the rows `check` and `bench` wrote beside the manifest;
/// whether every row is good (a missing file is a row that is not).
fn table(dir: &Path) -> Result<bool, String> {
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    let mut device = String::new();
    for what in ["check", "bench"] {
        let path = dir.join(format!("results-{what}.json"));
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let results: Results = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
                if device.is_empty() {
                    device = results.device;
                }
                notes.extend(results.notes);
                rows.extend(results.rows);
                if !results.complete {
                    rows.push(Row { case: format!("({what})"), measured: "-".into(), predicted: "-".into(), ratio: "-".into(), result: format!("did not finish: {} stops after the rows above", path.display()), ok: false });
                }
            }
            Err(_) => rows.push(Row { case: format!("({what})"), measured: "-".into(), predicted: "-".into(), ratio: "-".into(), result: format!("did not finish: no {}", path.display()), ok: false }),
        }
    }
    let header = Row { case: "case".into(), measured: "measured".into(), predicted: "predicted".into(), ratio: "pred/meas".into(), result: "result".into(), ok: true };
    let width = |f: fn(&Row) -> &String| rows.iter().chain([&header]).map(|r| f(r).chars().count()).max().unwrap_or(0);
    let (c, m, p, r) = (width(|r| &r.case), width(|r| &r.measured), width(|r| &r.predicted), width(|r| &r.ratio));
    println!("gpu-check on {}", if device.is_empty() { "(no device recorded)" } else { &device });
    for note in &notes {
        println!("  {note}");
    }
    let line = |row: &Row| println!("{:<c$}  {:>m$}  {:>p$}  {:>r$}  {}", row.case, row.measured, row.predicted, row.ratio, row.result);
    line(&header);
    println!("{}", "-".repeat(c + m + p + r + 8 + width(|r| &r.result)));
    for row in &rows {
        line(row);
    }
    let bad = rows.iter().filter(|r| !r.ok).count();
    println!("{}", if bad == 0 { "gpu-check: every case matches".to_string() } else { format!("gpu-check: {bad} rows failed") });
    Ok(bad == 0)
}

/// One single-kernel program to time, as `shardc calibrate --emit` lists it.
#[derive(Deserialize)]
struct Kernel {
    name: String,
    program: PathBuf,
}

/// `calibrate DIR`: times every program of `DIR/kernels.json` (the fastest of 5 runs) and
/// writes `DIR/measured.json` (name -> seconds).
fn calibrate(dir: &Path, placement: &Placement) -> Result<bool, String> {
    let list = dir.join("kernels.json");
    let text = std::fs::read_to_string(&list).map_err(|e| format!("reading {}: {e} (write it with `shardc calibrate --backend cuda --emit DIR`)", list.display()))?;
    let kernels: Vec<Kernel> = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", list.display()))?;
    let mut measured = serde_json::Map::new();
    let out = dir.join("measured.json");
    let mut failed = 0;
    for k in &kernels {
        // A kernel that cannot run is named and left out of the fit; the others still run,
        // and what is timed so far is written after each.
        let path = dir.join(&k.program);
        let timed = Program::from_value(read_json(&path)?).map_err(|e| format!("{}: {e}", path.display())).and_then(|program| cuda::time_program(program, placement, 5).map_err(|e| e.to_string()));
        match timed {
            Ok(seconds) => {
                if seconds > 1e-3 {
                    println!("  {:<78} {:>9.3} ms", k.name, 1e3 * seconds);
                }
                measured.insert(k.name.clone(), serde_json::json!(seconds));
            }
            Err(e) => {
                println!("  {:<78} ERROR {e}", k.name);
                failed += 1;
            }
        }
        std::fs::write(&out, serde_json::to_string_pretty(&measured).map_err(|e| e.to_string())?).map_err(|e| format!("writing {}: {e}", out.display()))?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&measured).map_err(|e| e.to_string())?).map_err(|e| format!("writing {}: {e}", out.display()))?;
    println!("shardc-gpu calibrate: timed {} of {} kernels; wrote {}", measured.len(), kernels.len(), out.display());
    Ok(failed == 0)
}
