//! `shardc bench`: a training step timed on the CPU runtime (one rank, or a mesh of rank
//! threads, pipelines too), beside the cluster model's prediction and, optionally, PyTorch.

use super::*;

/// Arguments of `shardc bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model spec (.toml or .json).
    pub spec: PathBuf,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    pub steps: u64,
    /// Also time the same training step in PyTorch (CPU) through bench/torch_step.py with
    /// this Python interpreter.
    #[arg(long, value_name = "PYTHON")]
    pub torch: Option<PathBuf>,
    /// Device mesh as axis=size pairs: its ranks run as threads on this host (each step timed
    /// on its slowest rank).
    #[arg(long, default_value = "dp=1,tp=1,pp=1")]
    pub mesh: String,
    /// The measured seconds of each kernel class, collective and op next to the cluster
    /// model's (--cluster FILE, e.g. from `shardc calibrate`): of the one rank, or of rank 0
    /// of a dp/tp mesh.
    #[arg(long)]
    pub profile: bool,
    #[command(flatten)]
    pub step: StepArgs,
}

/// Peak resident memory of this process so far (Linux), in bytes.
pub(super) fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// The cluster model's estimate of one step of `programs` (the training step, or one
/// program per pipeline rank).
pub(super) fn predicted_step(spec: &Spec, step: &StepArgs, mesh: shardc_ir::mesh::Mesh, programs: &[Program]) -> Result<shardc_codegen::estimate::Estimate> {
    let cluster = step.cluster_model()?;
    let module = shardc_ir::spec::lower(spec, spec.step_shape(&shardc_ir::mesh::Mesh::default())).into_diagnostic()?;
    let parameters = module.func("forward").map_or(0, |f| f.active_parameter_count()) as f64;
    let shape = model_shape(spec, parameters, step.batch(spec, mesh)?.global_batch);
    Ok(shardc_codegen::estimate::estimate(programs, &cluster, shape))
}

/// The model as the estimate counts its FLOPs, for a step of `global_batch` sequences.
pub fn model_shape(spec: &Spec, parameters: f64, global_batch: u64) -> shardc_codegen::estimate::ModelShape {
    shardc_codegen::estimate::ModelShape {
        parameters,
        layers: spec.model.layers as f64,
        hidden: spec.model.hidden as f64,
        seq: spec.seq_len() as f64,
        tokens_per_step: (global_batch * spec.seq_len()) as f64,
    }
}

/// `shardc bench --mesh` with several ranks: one thread per rank on this host.
pub(super) fn bench_mesh(args: &BenchArgs, spec: &Spec, mesh: shardc_ir::mesh::Mesh, step: &StepArgs) -> Result<()> {
    let microbatches = step.microbatches(spec, mesh)?;
    let pipelined = mesh.pp > 1 || microbatches > 1;
    let programs = if pipelined { compile_pipeline_programs(spec, step, mesh)? } else { vec![compile_train_step_on(spec, step, mesh)?] };
    crate::host::refuse_if_over_memory(&programs, 0)?;
    let corpus = synthetic_corpus(spec)?;
    let timeout = std::time::Duration::from_secs(600);
    let layers = spec.model.layers as usize;
    // Per-step wall times of the slowest rank; the first step (warming up) is not timed.
    let steps = args.steps.max(1);
    shardc_runtime::cpu::profile_executors(args.profile);
    let (mut times, profile) = if pipelined {
        (shardc_runtime::pipeline::train_pipeline(&programs, 0, layers, &corpus, 1 + steps, timeout, shardc_runtime::collectives::Algorithm::Ring).into_diagnostic()?.step_seconds, Vec::new())
    } else {
        let run = shardc_runtime::train::train_spmd(&programs[0], 0, layers, &corpus, 1 + steps, timeout).into_diagnostic()?;
        (run.step_seconds, run.profile)
    };
    times.remove(0);
    let measured = times.iter().copied().fold(f64::INFINITY, f64::min);
    println!("benchmark: {} training step on mesh {mesh} ({} rank threads on {} cores), seq {}, micro-batch {}, {} micro-batches, {} timed steps", spec.name, mesh.ranks(), shardc_runtime::cpu::worker_threads(), spec.seq_len(), spec.training.micro_batch, microbatches, steps);
    println!("{:<22}{:>14}", "", "step time");
    println!("{:<22}{:>12.3} s   (fastest)", "shardc (CPU)", measured);
    if args.step.hardware_given() {
        let e = predicted_step(spec, step, mesh, &programs)?;
        println!("{:<22}{:>12.3} s   ({:+.1}% vs the fastest step; {})", "  predicted", e.step_seconds, 100.0 * (e.step_seconds / measured - 1.0), e.bound);
    }
    if args.profile {
        // Rank 0's instructions over the timed steps, per step.
        let cluster = step.cluster_model()?;
        let per_step: Vec<f64> = profile.iter().map(|t| t / steps as f64).collect();
        print_profile(&programs[0], &per_step, &cluster);
    }
    Ok(())
}

/// Measured (`seconds` per instruction) beside predicted time of `program`, by kernel class
/// or collective and by op.
pub(super) fn print_profile(program: &Program, seconds: &[f64], cluster: &shardc_ir::cluster::Cluster) {
    let mut by_class: std::collections::BTreeMap<String, (f64, f64, usize)> = std::collections::BTreeMap::new();
    let mut by_op: std::collections::BTreeMap<String, (f64, f64, usize)> = std::collections::BTreeMap::new();
    for (instr, measured) in program.instrs.iter().zip(seconds) {
        let (class, predicted) = shardc_codegen::estimate::instruction_cost(program, instr, cluster);
        for (map, key) in [(&mut by_class, class), (&mut by_op, instr.op.clone())] {
            let row = map.entry(key).or_default();
            row.0 += measured;
            row.1 += predicted;
            row.2 += 1;
        }
    }
    for (title, rows) in [("per step, by class", &by_class), ("by op", &by_op)] {
        println!("{:<26}{:>8}{:>14}{:>14}{:>10}", title, "kernels", "measured", "predicted", "ratio");
        for (name, (measured, predicted, count)) in rows.iter() {
            println!("  {:<24}{:>8}{:>11.2} ms{:>11.2} ms{:>10.2}", name, count, 1e3 * measured, 1e3 * predicted, predicted / measured.max(1e-12));
        }
    }
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    // One warm-up step comes before the timed ones.
    check_steps("--steps", args.steps.saturating_add(1))?;
    let spec = args.step.load_spec(Some(&args.spec))?;
    let mesh = shardc_ir::mesh::Mesh::parse(&args.mesh).map_err(|e| crate::report::mesh_report(vec![e]))?;
    let problems = mesh.check(&spec);
    if !problems.is_empty() {
        return Err(crate::report::mesh_report(problems));
    }
    // A benchmark times one micro-batch per replica, whatever the spec's global batch,
    // unless the mesh has pipeline stages or --microbatches or --global-batch ask for more.
    let batch_given = args.step.batch.microbatches.is_some() || args.step.batch.global_batch.is_some();
    let step = if mesh.pp > 1 || batch_given { args.step.clone() } else { args.step.one_microbatch() };
    let microbatches = step.microbatches(&spec, mesh)?;
    step.refuse_what_the_step_does_not_do(&spec, mesh)?;
    if mesh.ranks() > 1 || microbatches > 1 {
        if args.torch.is_some() {
            return Err(miette!(help = "compare with PyTorch on one rank and one micro-batch (--mesh dp=1,tp=1,pp=1)", "--torch times one rank's step of one micro-batch only"));
        }
        if args.profile && (mesh.pp > 1 || microbatches > 1) {
            return Err(miette!(help = "profile dp and tp meshes with --microbatches 1", "--profile does not profile pipeline stages or accumulated micro-batches"));
        }
        return bench_mesh(args, &spec, mesh, &step);
    }
    let compile_start = Instant::now();
    let program = compile_train_step(&spec, &step)?;
    crate::host::refuse_if_over_memory(std::slice::from_ref(&program), 0)?;
    let compile_s = compile_start.elapsed().as_secs_f64();
    let (planned, cpu_slots) = (program.peak_bytes(), program.cpu_storage_bytes());
    let predicted = if args.step.hardware_given() { Some(predicted_step(&spec, &step, mesh, std::slice::from_ref(&program))?) } else { None };
    let cluster = step.cluster_model()?;
    let mut trainer = Trainer::new(program, 0, spec.model.layers as usize).into_diagnostic()?;
    let corpus = synthetic_corpus(&spec)?;
    trainer.step(&corpus).into_diagnostic()?;
    trainer.executor_mut().set_profiling(args.profile);
    let mut times = Vec::new();
    for _ in 0..args.steps.max(1) {
        let t = Instant::now();
        trainer.step(&corpus).into_diagnostic()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let (median, fastest) = (times[times.len() / 2], times[0]);
    let rss = peak_rss().unwrap_or(0);
    println!("benchmark: {} training step, seq {}, micro-batch {}, {} timed steps (median)", spec.name, spec.seq_len(), spec.training.micro_batch, times.len());
    println!("{:<22}{:>14}{:>16}{:>18}", "", "step time", "peak memory", "compile time");
    println!("{:<22}{:>12.3} s{:>16}{:>16.2} s", "shardc (CPU)", median, crate::summary::bytes(rss), compile_s);
    println!("{:<22}{:>12.3} s", "  fastest step", fastest);
    println!("{:<22}{:>14}{:>16}", "  planned by codegen", "", crate::summary::bytes(planned as u64));
    println!("{:<22}{:>14}{:>16}", "  CPU storage slots", "", crate::summary::bytes(cpu_slots as u64));
    if let Some(e) = &predicted {
        println!("{:<22}{:>12.3} s   ({:+.1}% vs the fastest step; {})", "  predicted", e.step_seconds, 100.0 * (e.step_seconds / fastest - 1.0), e.bound);
    }
    if args.profile {
        let profile: Vec<f64> = trainer.executor_mut().take_profile().iter().map(|t| t / times.len() as f64).collect();
        print_profile(trainer.executor().program(), &profile, &cluster);
    }
    if let Some(python) = &args.torch {
        let torch = torch_step(python, &args.spec, &spec, args.steps)?;
        println!("{:<22}{:>12.3} s{:>16}", "PyTorch (CPU)", torch.0, crate::summary::bytes(torch.1));
        println!("ratio shardc / PyTorch: {:.2} (below 1 means shardc is faster)", median / torch.0);
    }
    Ok(())
}

/// A corpus of the model's own vocabulary: benchmarks time steps, not learning.
pub(super) fn synthetic_corpus(spec: &Spec) -> Result<Corpus> {
    let vocab = spec.model.vocab.min(256) as usize;
    let bytes: Vec<u8> = (0..(spec.seq_len() as usize + 2) * 64).map(|i| (shardc_runtime::init::splitmix64(i as u64) % vocab as u64) as u8).collect();
    Corpus::new(bytes, spec.seq_len() as usize, spec.model.vocab as usize).into_diagnostic()
}

/// Runs bench/torch_step.py; returns (median step seconds, peak RSS bytes).
pub(super) fn torch_step(python: &Path, spec_path: &Path, spec: &Spec, steps: u64) -> Result<(f64, u64)> {
    let out = std::process::Command::new(python)
        .arg("bench/torch_step.py")
        .arg(spec_path)
        .args(["--seq", &spec.seq_len().to_string(), "--micro-batch", &spec.training.micro_batch.to_string(), "--steps", &steps.to_string()])
        .output()
        .into_diagnostic()
        .wrap_err_with(|| format!("running {} bench/torch_step.py", python.display()))?;
    if !out.status.success() {
        return Err(miette!(help = "scripts/bench-torch sets up a virtual environment with PyTorch", "the PyTorch benchmark failed:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).into_diagnostic().wrap_err("reading the PyTorch benchmark's JSON")?;
    let step = result["step_s"].as_f64().ok_or_else(|| miette!("the PyTorch benchmark printed no step_s"))?;
    Ok((step, result["peak_rss_bytes"].as_u64().unwrap_or(0)))
}
