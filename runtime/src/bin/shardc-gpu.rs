//! `shardc-gpu`: the runtime-only binary of the GPU check (no MLIR, no compiler), for a GPU
//! machine that has no Rust toolchain. It reads compiled plans (`shardc compile --target
//! cuda -o`) listed in a manifest and
//!
//! * `check MANIFEST`: trains each case on the GPU and on the CPU backend (the oracle) from
//!   the same seed and batches, and compares losses and first-step gradients;
//! * `bench MANIFEST`: times each workload's training step and cuBLAS on a large GEMM, and
//!   prints achieved TFLOP/s against that measured peak (and writes the step times beside the
//!   manifest, `bench-measured.json`, for `scripts/gpu-check.sh report`);
//! * `calibrate DIR`: times each single-kernel program that `shardc calibrate --backend cuda
//!   --emit DIR` listed in `DIR/kernels.json` and writes `DIR/measured.json`, from which
//!   `shardc calibrate --measured` fits the cluster model on the build machine.
//!
//! Exit status 1 when a case does not match (or anything fails). With
//! `SHARDC_GPU_EMULATE=1` the device is the CPU emulation (for trying the check without a
//! GPU; slow beyond tiny models).

use std::path::{Path, PathBuf};

use serde::Deserialize;
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
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.as_slice() {
        [command, manifest] if command == "check" => load(manifest).and_then(|(m, dir)| check(&m, &dir)),
        [command, manifest] if command == "bench" => load(manifest).and_then(|(m, dir)| bench(&m, &dir)),
        [command, dir] if command == "calibrate" => calibrate(Path::new(dir)),
        [command] if command == "available" => match Placement::first_gpu_or_emulated() {
            Placement::Emulated => Ok(true),
            _ => cuda::check_available().map(|()| true).map_err(|e| e.to_string()),
        },
        _ => Err("usage: shardc-gpu check MANIFEST | bench MANIFEST | calibrate DIR | available".into()),
    };
    match result {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("shardc-gpu: {e}");
            std::process::exit(1);
        }
    }
}

fn load(path: &str) -> Result<(Manifest, PathBuf), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
    let manifest: Manifest = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    let dir = Path::new(path).parent().map(Path::to_path_buf).unwrap_or_default();
    Ok((manifest, dir))
}

/// The `train_step` program of a plan file written by `shardc compile -o`.
fn train_step(path: &Path) -> Result<Program, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let plan: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let programs = plan.get("programs").and_then(|p| p.as_array()).ok_or_else(|| format!("{}: not a shardc plan", path.display()))?;
    let step = programs.iter().find(|p| p.get("name").and_then(|n| n.as_str()) == Some("train_step")).ok_or_else(|| format!("{}: no train_step", path.display()))?;
    serde_json::from_value(step.clone()).map_err(|e| format!("{}: {e}", path.display()))
}

/// The step time the compiler's cluster model predicted for the plan (`shardc compile --gpu`),
/// in seconds, if the plan carries one.
fn predicted_step(path: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(path).ok()?;
    let plan: serde_json::Value = serde_json::from_str(&text).ok()?;
    plan.get("summary")?.get("estimate")?.get("step_seconds")?.as_f64()
}

/// Layers of the model, from its parameter names (`layers.N.`), for the initialisation scale.
fn layers(program: &Program) -> usize {
    program.args.iter().filter_map(|a| a.name.strip_prefix("layers.")?.split('.').next()?.parse::<usize>().ok()).max().map_or(1, |l| l + 1)
}

fn corpus(manifest: &Manifest, dir: &Path, program: &Program) -> Result<ByteCorpus, String> {
    let tokens = program.arg("tokens").ok_or("no tokens input")?;
    let seq = tokens.layout.as_ref().map_or(program.buffers[tokens.buffer].shape[1], |l| l.global_shape[1]);
    // The model's vocabulary: the embedding table's rows before padding.
    let vocab = program
        .args
        .iter()
        .find(|a| a.name == "embed.tokens.weight")
        .map(|a| a.logical_shape(&a.layout.as_ref().map_or_else(|| program.buffers[a.buffer].shape.clone(), |l| l.global_shape.clone()))[0])
        .ok_or("no embedding table")?;
    let bytes = std::fs::read(dir.join(&manifest.data)).map_err(|e| format!("reading the corpus: {e}"))?;
    ByteCorpus::new(bytes, seq, vocab).map_err(|e| e.to_string())
}

/// Losses and parameters of a CPU run (the oracle).
fn cpu_run(program: &Program, corpus: &ByteCorpus, steps: u64) -> Result<(Vec<f64>, Vec<(String, Vec<f64>)>), String> {
    let layers = layers(program);
    if program.mesh.iter().product::<usize>() > 1 {
        let run = shardc_runtime::train::train_spmd(program, 0, layers, corpus, steps, std::time::Duration::from_secs(600)).map_err(|e| e.to_string())?;
        return Ok((run.losses, run.parameters.into_iter().map(|(n, _, v)| (n, v)).collect()));
    }
    let mut trainer = shardc_runtime::train::Trainer::new(program.clone(), 0, layers).map_err(|e| e.to_string())?;
    let losses = (0..steps).map(|_| trainer.step(corpus)).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
    let params = trainer.parameters().map_err(|e| e.to_string())?.into_iter().map(|(n, _, v)| (n, v.into_iter().map(f64::from).collect())).collect();
    Ok((losses, params))
}

/// max |a - b| / max(max |a|, 0.01): the initialisation scale floors the denominator.
fn relative(a: &[f64], b: &[f64]) -> f64 {
    let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    diff / a.iter().map(|x| x.abs()).fold(0.01, f64::max)
}

fn check(manifest: &Manifest, dir: &Path) -> Result<bool, String> {
    let mut all = true;
    println!("{:<28} {:>10} {:>10} {:>10} {:>12} {:>8}", "case (CPU vs GPU)", "loss CPU", "loss GPU", "loss rel", "grad rel", "match");
    for case in &manifest.cases {
        let (program, reference) = (train_step(&dir.join(&case.program))?, train_step(&dir.join(&case.reference))?);
        let corpus = corpus(manifest, dir, &program)?;
        let layers = layers(&program);
        let gpu = cuda::train(&program, 0, layers, &corpus, case.steps, &Placement::first_gpu_or_emulated()).map_err(|e| format!("{}: {e}", case.name))?;
        let (cpu_losses, _) = cpu_run(&reference, &corpus, case.steps)?;
        let loss_rel = cpu_losses.iter().zip(&gpu.losses).map(|(c, g)| (c - g).abs() / c.abs().max(1e-12)).fold(0.0, f64::max);
        let mut ok = loss_rel <= case.loss_tolerance && gpu.losses.iter().all(|l| l.is_finite());
        let mut grad_text = "n/a".to_string();
        if let Some(tolerance) = case.gradient_tolerance {
            // First-step gradients from one SGD step on each backend: (p0 - p1) / lr.
            let gpu_one = cuda::train(&program, 0, layers, &corpus, 1, &Placement::first_gpu_or_emulated()).map_err(|e| format!("{}: {e}", case.name))?;
            let (_, cpu_one) = cpu_run(&reference, &corpus, 1)?;
            let mut worst = (0.0f64, String::new());
            for (name, shape, after_gpu) in &gpu_one.parameters {
                let Some((_, after_cpu)) = cpu_one.iter().find(|(n, _)| n == name) else { continue };
                let initial = shardc_runtime::init::init_param(name, shape.iter().product(), 0, layers);
                let grad = |after: &[f64]| initial.iter().zip(after).map(|(p0, p1)| (p0 - p1) / case.lr).collect::<Vec<f64>>();
                let rel = relative(&grad(after_cpu), &grad(after_gpu));
                if rel > worst.0 {
                    worst = (rel, name.clone());
                }
            }
            grad_text = format!("{:.2e}", worst.0);
            if worst.0 > tolerance {
                ok = false;
                grad_text.push_str(&format!(" ({})", worst.1));
            }
        }
        all &= ok;
        println!(
            "{:<28} {:>10.5} {:>10.5} {:>10.2e} {:>12} {:>8}",
            case.name,
            cpu_losses.last().copied().unwrap_or(f64::NAN),
            gpu.losses.last().copied().unwrap_or(f64::NAN),
            loss_rel,
            grad_text,
            if ok { "yes" } else { "NO" }
        );
    }
    Ok(all)
}

fn bench(manifest: &Manifest, dir: &Path) -> Result<bool, String> {
    let peak_bf16 = cuda::gemm_peak(0, 8192, DType::Bf16, 20).map_err(|e| e.to_string())?;
    let peak_f32 = cuda::gemm_peak(0, 8192, DType::F32, 5).map_err(|e| e.to_string())?;
    println!("cuBLAS peak (8192^3 GEMM): bf16 {peak_bf16:.1} TFLOP/s, f32 {peak_f32:.1} TFLOP/s");
    println!("{:<34} {:>6} {:>10} {:>14} {:>12} {:>8} {:>14} {:>10}", "workload", "dtype", "ms/step", "GEMM TFLOP/s", "peak", "ratio", "predicted ms", "pred/meas");
    let mut measured = serde_json::Map::new();
    for w in &manifest.bench {
        let program = train_step(&dir.join(&w.program))?;
        let plan = program.device.clone().ok_or("the plan has no device code")?;
        let corpus = corpus(manifest, dir, &program)?;
        let run = cuda::train(&program, 0, layers(&program), &corpus, w.steps.max(2), &Placement::first_gpu_or_emulated()).map_err(|e| format!("{}: {e}", w.name))?;
        // The first step compiles nothing but warms caches and cuBLAS heuristics.
        let timed = &run.step_seconds[1..];
        let mut sorted = timed.to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        let ranks = program.mesh.iter().product::<usize>().max(1) as f64;
        let achieved = cuda::gemm_flops(&plan) * ranks / median / 1e12;
        let peak = if plan.dtype == DType::Bf16 { peak_bf16 } else { peak_f32 };
        // The compiler's prediction for this GPU (the preset the plan was compiled with).
        let (predicted, ratio) = match predicted_step(&dir.join(&w.program)) {
            Some(p) => (format!("{:.2}", 1e3 * p), format!("{:.2}", p / median)),
            None => ("-".into(), "-".into()),
        };
        println!("{:<34} {:>6} {:>10.2} {:>14.1} {:>12.1} {:>7.0}% {:>14} {:>10}", w.name, format!("{:?}", plan.dtype).to_lowercase(), 1e3 * median, achieved, peak, 100.0 * achieved / peak, predicted, ratio);
        measured.insert(w.program.display().to_string(), serde_json::json!(median));
    }
    // For `scripts/gpu-check.sh report`: the calibrated model's prediction beside these.
    let out = dir.join("bench-measured.json");
    std::fs::write(&out, serde_json::to_string_pretty(&measured).map_err(|e| e.to_string())?).map_err(|e| format!("writing {}: {e}", out.display()))?;
    Ok(true)
}

/// One single-kernel program to time, as `shardc calibrate --emit` lists it.
#[derive(Deserialize)]
struct Kernel {
    name: String,
    program: PathBuf,
}

/// `calibrate DIR`: times every program of `DIR/kernels.json` (the fastest of 5 runs) and
/// writes `DIR/measured.json` (name -> seconds).
fn calibrate(dir: &Path) -> Result<bool, String> {
    let list = dir.join("kernels.json");
    let text = std::fs::read_to_string(&list).map_err(|e| format!("reading {}: {e} (write it with `shardc calibrate --backend cuda --emit DIR`)", list.display()))?;
    let kernels: Vec<Kernel> = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", list.display()))?;
    let placement = Placement::first_gpu_or_emulated();
    let mut measured = serde_json::Map::new();
    for k in &kernels {
        let path = dir.join(&k.program);
        let text = std::fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        let program: Program = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let seconds = cuda::time_program(program, &placement, 5).map_err(|e| format!("{}: {e}", k.name))?;
        if seconds > 1e-3 {
            println!("  {:<78} {:>9.3} ms", k.name, 1e3 * seconds);
        }
        measured.insert(k.name.clone(), serde_json::json!(seconds));
    }
    let out = dir.join("measured.json");
    std::fs::write(&out, serde_json::to_string_pretty(&measured).map_err(|e| e.to_string())?).map_err(|e| format!("writing {}: {e}", out.display()))?;
    println!("shardc-gpu calibrate: timed {} kernels; wrote {}", kernels.len(), out.display());
    Ok(true)
}
