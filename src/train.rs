//! `shardc run` (train on the CPU runtime) and `shardc bench` (time a training step).

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use miette::{IntoDiagnostic, Result, WrapErr, miette};
use shardc_ir::spec::Spec;
use shardc_runtime::Program;
use shardc_runtime::data::Corpus;
use shardc_runtime::train::Trainer;

use crate::options::StepArgs;

/// Arguments of `shardc run`.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Model spec (.toml or .json), or a Hugging Face model folder (its weights are the
    /// starting point).
    #[arg(required_unless_present = "hf")]
    pub spec: Option<PathBuf>,
    /// Optimizer steps in all, counted from the start of training (as Megatron-LM's
    /// --train-iters): a run resumed at step 20 with --steps 40 runs steps 21 to 40.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Seed of the initial parameters and the data order (default 0; a resumed run keeps its
    /// checkpoint's).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Save the trained parameters as safetensors.
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// Start from parameters in a safetensors file.
    #[arg(long, value_name = "FILE")]
    pub load: Option<PathBuf>,
    /// Print `step N loss X` every N steps (0: only the summary).
    #[arg(long, default_value_t = 0)]
    pub log_every: u64,
    /// Backend: cpu (the default and the reference).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Device mesh as axis=size pairs: one CPU thread per rank, real collectives.
    #[arg(long, default_value = "dp=1,tp=1,pp=1")]
    pub mesh: String,
    /// All-reduce algorithm between ranks: ring (bandwidth-optimal) or tree (latency-optimal).
    #[arg(long, default_value = "ring")]
    pub collectives: String,
    /// With pipeline stages: write the last step's measured timeline as Chrome/Perfetto
    /// trace JSON (one track per pipeline rank).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Save sharded checkpoints in DIR: one safetensors file per rank with its shards of the
    /// parameters and optimizer state, and a manifest (spec, mesh, step, seed), atomically.
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// Steps between checkpoints, at multiples of N counted from the start of training
    /// (default: one at the end of the run).
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Continue from the latest checkpoint in DIR, under this run's mesh (any dp, tp, pp,
    /// ZeRO stage): the shards are reassembled and cut again; the run goes on to step `--steps`.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// With --resume: train on with this run's --lr, --min-lr, warmup, decay and --clip-grad
    /// instead of refusing settings that differ from the checkpoint's (as Megatron-LM's
    /// --override-opt_param-scheduler; e.g. a lower learning rate after a loss spike).
    #[arg(long, requires = "resume")]
    pub override_schedule: bool,
    /// Check every op's results for NaN and infinity, and stop at the first op that makes
    /// one, naming it and its layer.
    #[arg(long)]
    pub check_numerics: bool,
    /// Seconds a rank waits for another before the run stops with an error that names the
    /// rank that stopped answering and the collective that waited. Under NCCL, where a
    /// collective's wait happens on the device: the most a wait on the device (one per step)
    /// may last before every communicator is aborted, and at least ten minutes (PyTorch's
    /// default NCCL timeout).
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    pub timeout: u64,
    /// Write the trained model as a Hugging Face folder (config.json, model.safetensors) of
    /// its family (GPT-2 or Llama), loadable by `transformers`.
    #[arg(long, value_name = "DIR")]
    pub save_hf: Option<PathBuf>,
    #[command(flatten)]
    pub step: StepArgs,
    #[command(flatten)]
    pub input: crate::data::DataArgs,
}

/// Compiles the spec's training step to a single-device rank program.
pub fn compile_train_step(spec: &Spec, step: &StepArgs) -> Result<Program> {
    compile_train_step_on(spec, step, shardc_ir::mesh::Mesh::default())
}

/// Compiles the spec's training step for `mesh` (partitioned when it has several ranks).
pub fn compile_train_step_on(spec: &Spec, step: &StepArgs, mesh: shardc_ir::mesh::Mesh) -> Result<Program> {
    let options = step.compile_options(spec, mesh)?;
    let mut module = shardc_ir::spec::lower(spec, spec.step_shape(&mesh)).into_diagnostic()?;
    let cx = crate::ir_context()?;
    shardc_passes::compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).into_diagnostic()?;
    let train_step = module.func("train_step").ok_or_else(|| miette!("the pipeline produced no @train_step"))?;
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    shardc_codegen::lower_func_on(train_step, &grid).into_diagnostic()
}

/// Compiles the spec's training step into pipeline stages (when the options ask for stages
/// or micro-batches): one rank program per pipeline rank, and the schedule to run them by.
pub fn compile_pipeline_programs(spec: &Spec, step: &StepArgs, mesh: shardc_ir::mesh::Mesh) -> Result<Vec<Program>> {
    let options = step.compile_options(spec, mesh)?;
    let schedule = step.schedule(spec, mesh)?.ok_or_else(|| miette!("no pipeline stages or micro-batches were asked for"))?;
    let mut module = shardc_ir::spec::lower(spec, spec.step_shape(&mesh)).into_diagnostic()?;
    let cx = crate::ir_context()?;
    shardc_passes::compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).into_diagnostic()?;
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    shardc_codegen::lower_pipeline(&module, &grid, &schedule).into_diagnostic()
}

fn check_backend(backend: &str) -> Result<()> {
    if let Ok(text) = std::env::var("SHARDC_EMULATE_PROCESSES") {
        #[cfg(feature = "cuda")]
        let emulating = emulating_the_gpu();
        #[cfg(not(feature = "cuda"))]
        let emulating = false;
        if backend != "cuda" || !emulating {
            return Err(miette!(
                help = "run with --backend cuda and SHARDC_GPU_EMULATE=1, or unset SHARDC_EMULATE_PROCESSES",
                "SHARDC_EMULATE_PROCESSES={text}: emulated processes are a GPU run's, on emulated devices"
            ));
        }
    }
    match backend {
        "cpu" => Ok(()),
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err(miette!("--backend cuda: the CUDA backend is not built into this shardc: rebuild with `--features cuda` (no CUDA toolkit is needed to build)")),
        // Fails before any compiling when there is no GPU, driver or CUDA library.
        #[cfg(feature = "cuda")]
        "cuda" if emulating_the_gpu() => Ok(()),
        #[cfg(feature = "cuda")]
        "cuda" => shardc_runtime::cuda::check_available().map_err(|e| miette!("--backend cuda: {e}")),
        other => Err(miette!(help = "use --backend cpu or --backend cuda", "--backend: unknown backend `{other}`")),
    }
}

/// `--steps N` of `run` and `bench`: the step counter the compiled step reads is 32-bit, so
/// larger counts are refused before any work (they would fail at step 2^31, or overflow).
fn check_steps(flag: &str, steps: u64) -> Result<()> {
    if steps > shardc_runtime::train::MAX_STEPS {
        return Err(miette!(
            help = format!("give at most {} steps", shardc_runtime::train::MAX_STEPS),
            "{flag} {steps}: the training step counts its iterations in a 32-bit integer (AdamW's bias correction reads it), so a run has at most {} steps",
            shardc_runtime::train::MAX_STEPS
        ));
    }
    Ok(())
}

pub fn run(args: &RunArgs) -> Result<()> {
    check_steps("--steps", args.steps)?;
    check_backend(&args.backend)?;
    // The learning rate decays over the whole run unless told otherwise (as Megatron-LM's
    // --lr-decay-iters defaults to --train-iters).
    let mut args = args.clone();
    // A resumed run continues its checkpoint's decay (its --steps may have been shorter).
    let resumed_decay = args.resume.as_deref().and_then(|dir| shardc_runtime::checkpoint::read_manifest(dir).ok()).and_then(|m| m.optimizer).map(|o| o.decay_steps);
    if args.step.training.lr_decay_steps.is_none() {
        match resumed_decay {
            Some(steps) if steps >= 0 => args.step.training.lr_decay_steps = Some(steps as u64),
            _ if args.steps > args.step.training.lr_warmup_steps && args.steps <= i32::MAX as u64 => args.step.training.lr_decay_steps = Some(args.steps),
            _ => {}
        }
    }
    let args = &args;
    shardc_runtime::cpu::check_numerics(args.check_numerics);
    let spec = args.step.load_spec(args.spec.as_deref())?;
    let mesh = shardc_ir::mesh::Mesh::parse(&args.mesh).map_err(|e| crate::report::mesh_report(vec![e]))?;
    let problems = mesh.check(&spec);
    if !problems.is_empty() {
        return Err(crate::report::mesh_report(problems));
    }
    // With the GPU named, a run that would not fit its memory is refused before any work.
    let fits = match args.step.hardware_given() {
        true => {
            let cluster = args.step.cluster_model()?;
            match crate::fit::memory_estimate(&spec, &args.step, mesh)? {
                Some(estimate) => {
                    crate::fit::refuse_if_too_big(&spec, &args.step, mesh, &estimate, &cluster.gpu.name, cluster.gpu.memory_bytes)?;
                    Some(format!("  memory/GPU  {} estimated per GPU at the busiest rank; fits in {}'s {}", crate::summary::bytes(estimate.total as u64), cluster.gpu.name, crate::summary::bytes(cluster.gpu.memory_bytes as u64)))
                }
                None => None,
            }
        }
        false => None,
    };
    refuse_load_with_resume(args)?;
    #[cfg(feature = "cuda")]
    if args.backend == "cuda" {
        refuse_what_gpu_runs_cannot_do(args)?;
    }
    check_outputs(args)?;
    if args.backend == "cpu" && mesh.ranks() as usize > shardc_runtime::train::MAX_CPU_RANKS {
        return Err(miette!(
            help = format!("price a mesh this large with `shardc compile` or `shardc plan`; run at most {} ranks", shardc_runtime::train::MAX_CPU_RANKS),
            "--mesh {mesh}: the CPU backend runs a thread per rank, and {} ranks are more than it runs",
            mesh.ranks()
        ));
    }
    #[cfg(feature = "cuda")]
    if args.backend == "cuda" {
        if let Some(fits) = &fits {
            println!("{fits}");
        }
        return run_cuda(args, &spec, mesh);
    }
    if args.step.compile_options(&spec, mesh)?.pipeline.is_some() {
        return run_pipelined(args, &spec, mesh, fits.as_deref());
    }
    if args.trace.is_some() {
        return Err(miette!(help = "trace a pipeline: add --mesh pp=N, or --microbatches M with M > 1", "--trace writes a pipeline schedule's measured timeline, and this run has one micro-batch and no pipeline stages"));
    }
    if mesh.ranks() > 1 {
        return run_partitioned(args, &spec, mesh, fits.as_deref());
    }
    let program = compile_train_step(&spec, &args.step)?;
    crate::host::refuse_if_over_memory(std::slice::from_ref(&program), data_bytes(args))?;
    let peak = program.cpu_storage_bytes();
    let mut corpus = training_corpus(args, &spec)?;
    let mut checkpoints = Checkpoints::new(args, &spec)?;
    let (resumed, seed) = checkpoints.resume(args, std::slice::from_ref(&program), &mut corpus)?;
    let mut trainer = Trainer::new(program.clone(), seed, spec.model.layers as usize).into_diagnostic()?;
    if let Some(state) = &resumed {
        trainer.restore(state).into_diagnostic()?;
    }
    let first_step = resumed.as_ref().map_or(0, |s| s.step);
    let to_run = steps_to_run(args, first_step)?;
    let rows = args.step.batch(&spec, mesh)?.global_batch as usize;
    let mut evaluation = crate::data::Evaluation::new(&args.input, &spec, &corpus)?;

    println!(
        "shardc: training {} on {} ({} tokens), {} steps of {} tokens, seed {}, CPU storage {}",
        spec.name,
        corpus.identity().source,
        corpus.len(),
        args.steps,
        trainer.tokens_per_step(),
        args.seed.unwrap_or(0),
        crate::summary::bytes(peak as u64)
    );
    print_data(&corpus, evaluation.as_ref());
    print_program(args, std::slice::from_ref(&program), mesh, fits.as_deref())?;
    let bar = ProgressBar::new(to_run);
    bar.set_style(ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").into_diagnostic()?);
    let start = Instant::now();
    // The first loss, the last ten and the count: memory that does not grow with --steps.
    let mut losses = LossSummary::default();
    for step in 1..=to_run {
        let loss = trainer.step(&corpus).into_diagnostic()?;
        if !loss.is_finite() {
            bar.finish_and_clear();
            return Err(miette!(help = "lower --lr", "the loss became {loss} at step {}", first_step + step));
        }
        losses.push(loss);
        // Every `every` iterations counted from the start of training, and at the end.
        let (at, end) = (first_step + step, first_step + to_run);
        if checkpoints.due(at, end) {
            let state = trainer.state().into_diagnostic()?;
            bar.suspend(|| checkpoints.save(&state, std::slice::from_ref(&program), seed, corpus.record(at, rows)))?;
        }
        if let Some(evaluation) = evaluation.as_mut().filter(|e| e.due(at, end)) {
            let state = trainer.state().into_diagnostic()?;
            bar.suspend(|| evaluation.report(at, &state, &corpus))?;
        }
        let tokens_per_s = step as f64 * trainer.tokens_per_step() as f64 / start.elapsed().as_secs_f64();
        bar.set_message(format!("loss {loss:.4}  {tokens_per_s:.0} tokens/s"));
        bar.inc(1);
        if args.log_every > 0 && step % args.log_every == 0 {
            bar.suspend(|| println!("step {} loss {loss:.6}", first_step + step));
        }
    }
    bar.finish_and_clear();
    if let Some(first) = losses.first {
        // The last ten steps' mean smooths the batch-to-batch noise.
        let tail = &losses.tail;
        let last = tail.iter().sum::<f64>() / tail.len() as f64;
        let elapsed = start.elapsed().as_secs_f64();
        println!("  loss        {first:.4} at step 1 -> {last:.4} (mean of the last {} steps), {:.1}% lower", tail.len(), 100.0 * (1.0 - last / first));
        println!("  time        {elapsed:.2} s, {:.1} ms per step, {:.0} tokens/s", 1e3 * elapsed / losses.count as f64, losses.count as f64 * trainer.tokens_per_step() as f64 / elapsed);
    }
    let state = trainer.state().into_diagnostic()?;
    if let Some(dir) = &args.save_hf {
        crate::hf::save(dir, &spec, &state)?;
    }
    save_parameters(args, Some(&state), std::slice::from_ref(&program))?;
    Ok(())
}

/// What the run's summary reports of its losses, kept in constant memory however many steps
/// run: the first, the last ten, and how many.
#[derive(Default)]
struct LossSummary {
    first: Option<f64>,
    tail: std::collections::VecDeque<f64>,
    count: u64,
}

impl LossSummary {
    fn push(&mut self, loss: f64) {
        self.first.get_or_insert(loss);
        if self.tail.len() == 10 {
            self.tail.pop_front();
        }
        self.tail.push_back(loss);
        self.count += 1;
    }
}

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
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// The cluster model's estimate of one step of `programs` (the training step, or one
/// program per pipeline rank).
fn predicted_step(spec: &Spec, step: &StepArgs, mesh: shardc_ir::mesh::Mesh, programs: &[Program]) -> Result<shardc_codegen::estimate::Estimate> {
    let cluster = step.cluster_model()?;
    let module = shardc_ir::spec::lower(spec, spec.step_shape(&shardc_ir::mesh::Mesh::default())).into_diagnostic()?;
    let parameters = module.func("forward").map_or(0, |f| f.parameter_count()) as f64;
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
fn bench_mesh(args: &BenchArgs, spec: &Spec, mesh: shardc_ir::mesh::Mesh, step: &StepArgs) -> Result<()> {
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
    println!("benchmark: {} training step on mesh {mesh} ({} rank threads on {} cores), seq {}, micro-batch {}, {} micro-batches, {} timed steps", spec.name, mesh.dp * mesh.tp * mesh.pp, shardc_runtime::cpu::worker_threads(), spec.seq_len(), spec.training.micro_batch, microbatches, steps);
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
fn print_profile(program: &Program, seconds: &[f64], cluster: &shardc_ir::cluster::Cluster) {
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
    // A benchmark times one micro-batch per replica, whatever the spec's global batch,
    // unless the mesh has pipeline stages or --microbatches or --global-batch ask for more.
    let batch_given = args.step.batch.microbatches.is_some() || args.step.batch.global_batch.is_some();
    let step = if mesh.pp > 1 || batch_given { args.step.clone() } else { args.step.one_microbatch() };
    let microbatches = step.microbatches(&spec, mesh)?;
    if mesh.dp * mesh.tp * mesh.pp > 1 || microbatches > 1 {
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
fn synthetic_corpus(spec: &Spec) -> Result<Corpus> {
    let vocab = spec.model.vocab.min(256) as usize;
    let bytes: Vec<u8> = (0..(spec.seq_len() as usize + 2) * 64).map(|i| (shardc_runtime::init::splitmix64(i as u64) % vocab as u64) as u8).collect();
    Corpus::new(bytes, spec.seq_len() as usize, spec.model.vocab as usize).into_diagnostic()
}

/// Runs bench/torch_step.py; returns (median step seconds, peak RSS bytes).
fn torch_step(python: &Path, spec_path: &Path, spec: &Spec, steps: u64) -> Result<(f64, u64)> {
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

/// `shardc run --mesh ...` with several ranks: one thread per rank.
/// Prints `step N loss X` lines (with `--log-every`) and the loss summary.
fn report_losses(args: &RunArgs, first_step: u64, losses: &[f64]) {
    if args.log_every > 0 {
        for (i, loss) in losses.iter().enumerate() {
            let step = first_step + i as u64 + 1;
            if step % args.log_every == 0 {
                println!("step {step} loss {loss:.6}");
            }
        }
    }
    if let Some(first) = losses.first() {
        let tail = &losses[losses.len().saturating_sub(10)..];
        let last = tail.iter().sum::<f64>() / tail.len() as f64;
        println!("  loss        {first:.4} at step {} -> {last:.4} (mean of the last {} steps), {:.1}% lower", first_step + 1, tail.len(), 100.0 * (1.0 - last / first));
    }
}

/// Whether two spec values of a manifest and a run are the same: numbers by value (a
/// manifest rewritten by a JSON tool may write `10000.0` as `10000`), anything else exactly.
fn same_value(a: Option<&serde_json::Value>, b: Option<&serde_json::Value>) -> bool {
    match (a, b) {
        (Some(serde_json::Value::Number(x)), Some(serde_json::Value::Number(y))) => x == y || x.as_f64().zip(y.as_f64()).is_some_and(|(x, y)| x == y),
        _ => a == b,
    }
}

/// Checkpoint and resume settings of a run.
struct Checkpoints {
    dir: Option<PathBuf>,
    every: u64,
    spec: serde_json::Value,
    /// Fault injection (`SHARDC_FAULT_CHECKPOINT=N:R`): the N-th checkpoint of this run kills
    /// the process after writing rank R's file.
    fault: Option<(usize, usize)>,
    saved: usize,
    /// This run's hold on `dir` (rank 0's, in a multi-process run).
    _lock: Option<shardc_runtime::checkpoint::FolderLock>,
    /// Whether this process prints what it saves and resumes (rank 0 of a multi-process
    /// run, or the one process).
    speaks: bool,
}

impl Checkpoints {
    fn new(args: &RunArgs, spec: &Spec) -> Result<Checkpoints> {
        Checkpoints::for_process(args, spec, None)
    }

    /// The checkpoints of one process of a multi-process run (`process_rank`; `None`: the
    /// only one): rank 0 holds the folder for the run, and speaks for it.
    fn for_process(args: &RunArgs, spec: &Spec, process_rank: Option<usize>) -> Result<Checkpoints> {
        let leads = process_rank.is_none_or(|r| r == 0);
        let fault = match std::env::var("SHARDC_FAULT_CHECKPOINT") {
            Ok(text) => {
                let parsed = text.split_once(':').and_then(|(n, r)| Some((n.parse::<usize>().ok()?, r.parse::<usize>().ok()?)));
                Some(parsed.ok_or_else(|| miette!("SHARDC_FAULT_CHECKPOINT={text}: expected CHECKPOINT:RANK, e.g. 2:1"))?)
            }
            Err(_) => None,
        };
        if args.checkpoint_every == Some(0) {
            return Err(miette!(help = "give a positive number of steps", "--checkpoint-every 0"));
        }
        let lock = match &args.checkpoint {
            Some(dir) if leads => Some(shardc_runtime::checkpoint::lock_folder(dir).map_err(|e| miette!("--checkpoint {e}"))?),
            _ => None,
        };
        Ok(Checkpoints { dir: args.checkpoint.clone(), every: args.checkpoint_every.unwrap_or(args.steps.max(1)), spec: serde_json::to_value(&spec.model).into_diagnostic()?, fault, saved: 0, _lock: lock, speaks: leads })
    }

    /// The run's starting state from `--resume`, checked against this spec and `corpus`
    /// (which continues from the checkpoint's place in the data order); and its seed.
    fn resume(&self, args: &RunArgs, programs: &[Program], corpus: &mut Corpus) -> Result<(Option<shardc_runtime::train::TrainState>, u64)> {
        let Some(dir) = &args.resume else {
            // `--load FILE` starts from its parameters (global tensors by name).
            if let Some(path) = &args.load {
                let bytes = crate::input::read_file("--load", path)?;
                let tensors = shardc_runtime::checkpoint::from_bytes(&bytes).into_diagnostic().wrap_err_with(|| format!("loading {}", path.display()))?;
                let params = tensors.into_iter().map(|(name, (shape, values))| (name, (shape, values.into_iter().map(f64::from).collect()))).collect();
                return Ok((Some(shardc_runtime::train::TrainState::from_parameters(params, programs)), args.seed.unwrap_or(0)));
            }
            // A Hugging Face model starts from its weights.
            if let Some(hf) = args.step.hf_dir(args.spec.as_deref()) {
                let params = crate::hf::load_weights(&hf, &args.step.load_spec(args.spec.as_deref())?)?;
                if self.speaks {
                    println!("  weights     {} tensors from {}", params.len(), hf.display());
                }
                return Ok((Some(shardc_runtime::train::TrainState::from_parameters(params, programs)), args.seed.unwrap_or(0)));
            }
            return Ok((None, args.seed.unwrap_or(0)));
        };
        let (manifest, state) = shardc_runtime::checkpoint::load_sharded(dir).into_diagnostic().wrap_err_with(|| format!("resuming from {}", dir.display()))?;
        self.check_resume(args, dir, &manifest, programs, corpus)?;
        Ok((Some(state), manifest.seed))
    }

    /// `--resume DIR`'s manifest, checked as [`Checkpoints::resume`] checks it, `corpus`
    /// moved to its place in the data order: what a process of a multi-process run resumes
    /// from, reading its own shards only.
    /// Returns the checkpoint folder itself (`LATEST` resolved once, so that every later read
    /// is of the checkpoint checked here).
    fn resume_manifest(&self, args: &RunArgs, programs: &[Program], corpus: &mut Corpus) -> Result<Option<PathBuf>> {
        let Some(dir) = &args.resume else { return Ok(None) };
        let (folder, manifest) = shardc_runtime::checkpoint::resolve(dir).into_diagnostic().wrap_err_with(|| format!("resuming from {}", dir.display()))?;
        self.check_resume(args, dir, &manifest, programs, corpus)?;
        Ok(Some(folder))
    }

    /// Refuses to resume `manifest` (of the checkpoint `dir`) with another model, seed,
    /// optimizer or schedule; moves `corpus` to the checkpoint's place in the data order.
    fn check_resume(&self, args: &RunArgs, dir: &std::path::Path, manifest: &shardc_runtime::checkpoint::Manifest, programs: &[Program], corpus: &mut Corpus) -> Result<()> {
        // Checkpoints hold real-shaped tensors and, in mixed precision, fp32 masters: the
        // padding and the precision may change between runs, the model may not.
        let differing: Vec<String> = match (&manifest.spec, &self.spec) {
            (serde_json::Value::Object(saved), serde_json::Value::Object(now)) => saved
                .keys()
                .chain(now.keys())
                .filter(|k| !matches!(k.as_str(), "vocab_multiple" | "dtype") && !same_value(saved.get(*k), now.get(*k)))
                .map(|k| format!("{k} {} (this run: {})", saved.get(k).map_or("unset".into(), |v| v.to_string()), now.get(k).map_or("unset".into(), |v| v.to_string())))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect(),
            (saved, now) if saved != now => vec!["the model".into()],
            _ => Vec::new(),
        };
        if !differing.is_empty() {
            return Err(miette!(help = "resume with the spec the checkpoint was trained with", "{}: the checkpoint was saved from another model: {}", dir.display(), differing.join(", ")));
        }
        // The seed fixes the run's data order, the optimizer its state: both come with the
        // checkpoint.
        if let Some(seed) = args.seed.filter(|&s| s != manifest.seed) {
            return Err(miette!(help = format!("resume without --seed (or with --seed {})", manifest.seed), "--seed {seed}: the checkpoint's run has seed {}, which fixes its data order", manifest.seed));
        }
        if args.step.training.optimizer == "sgd" && manifest.tensors.iter().any(|t| t.name.starts_with("opt.") && !t.name.starts_with("opt.master.")) {
            return Err(miette!(help = "resume with the checkpoint's optimizer (--optimizer adamw)", "--optimizer sgd: {} holds AdamW's moments, which SGD would drop", dir.display()));
        }
        // The schedule and clipping continue the checkpoint's (Megatron-LM checks them too).
        if let (Some(saved), Some(now)) = (&manifest.optimizer, shardc_runtime::checkpoint::OptimizerRecord::of(programs)) {
            let differing = saved.differences(&now);
            let rule_changed = saved.update != now.update;
            if !differing.is_empty() && args.override_schedule && !rule_changed {
                if self.speaks {
                    println!("  schedule    overridden (--override-schedule): {}", differing.join(", "));
                }
            } else if !differing.is_empty() {
                let decay = if saved.decay_steps == 0 { "constant" } else if saved.cosine { "cosine" } else { "linear" };
                return Err(miette!(
                    help = format!(
                        "resume with the checkpoint's settings: --optimizer {} --lr {} --min-lr {} --lr-warmup-steps {} --lr-decay {decay}{} --clip-grad {} (or add --override-schedule to train on with this run's)",
                        saved.update,
                        saved.lr,
                        saved.min_lr,
                        saved.warmup_steps,
                        if saved.decay_steps > 0 { format!(" --lr-decay-steps {}", saved.decay_steps) } else { String::new() },
                        saved.clip_grad
                    ),
                    "{}: the checkpoint's run trained with other optimizer settings: {}",
                    dir.display(),
                    differing.join(", ")
                ));
            }
        }
        crate::data::resume_data(dir, manifest.data.as_ref(), corpus, manifest.step)?;
        if self.speaks {
            println!("  resume      step {} from {} (saved on mesh {:?})", manifest.step, dir.display(), manifest.mesh);
        }
        Ok(())
    }

    /// Steps between checkpoints, when the run writes them.
    fn period(&self) -> Option<u64> {
        self.dir.as_ref().map(|_| self.every.max(1))
    }

    /// Whether the run checkpoints after iteration `step` of a run ending at `last`: every
    /// `every` iterations counted from the start of training, and at the end.
    fn due(&self, step: u64, last: u64) -> bool {
        self.period().is_some_and(|every| step.is_multiple_of(every) || step == last)
    }

    fn save(&mut self, state: &shardc_runtime::train::TrainState, programs: &[Program], seed: u64, data: shardc_runtime::data::DataRecord) -> Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        // A finite loss can precede an update that overflowed: a checkpoint must not keep it.
        if let Some((name, _)) = state.tensors.iter().find(|(_, (_, values))| values.iter().any(|v| !v.is_finite())) {
            return Err(miette!(
                help = "lower --lr; the checkpoints already in the folder are from before this step",
                "`{name}` is not finite after step {}: not checkpointed",
                state.step
            ));
        }
        self.saved += 1;
        let abort = self.fault.filter(|(n, _)| *n == self.saved).map(|(_, rank)| rank);
        let path = shardc_runtime::checkpoint::save_sharded(dir, state, programs, self.spec.clone(), seed, Some(data), abort).into_diagnostic().wrap_err_with(|| format!("checkpointing into {}", dir.display()))?;
        println!("  checkpoint  step {} in {}", state.step, path.display());
        Ok(())
    }

    /// One process of a multi-process GPU run checkpoints its own shards from device memory;
    /// rank 0 commits the checkpoint once every rank's file is written.
    #[cfg(feature = "cuda")]
    fn save_own_shards(&mut self, trainer: &mut shardc_runtime::cuda::CudaTrainer, data: shardc_runtime::data::DataRecord) -> Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        self.saved += 1;
        let abort = self.fault.is_some_and(|(n, rank)| n == self.saved && trainer.process_rank() == Some(rank));
        let committed = trainer.checkpoint_own_shards(dir, self.spec.clone(), Some(data), abort).into_diagnostic().wrap_err_with(|| format!("checkpointing into {}", dir.display()))?;
        if let Some(path) = committed {
            println!("  checkpoint  step {} in {} (each process wrote its own rank file)", trainer.steps_taken(), path.display());
        }
        Ok(())
    }
}

/// The compiled step a run executes, in a line: its instructions and collectives (gradient
/// buckets counted as the one collective each is), and how ranks talk and are checked.
fn print_program(args: &RunArgs, programs: &[Program], mesh: shardc_ir::mesh::Mesh, fits: Option<&str>) -> Result<()> {
    let instructions = programs.iter().map(|p| p.instrs.len()).max().unwrap_or(0);
    let (mut collectives, mut buckets) = (0, std::collections::BTreeSet::new());
    for (rank, program) in programs.iter().enumerate() {
        for instr in program.instrs.iter().filter(|i| i.op.starts_with("shard.")) {
            match instr.int("xf.bucket") {
                Ok(bucket) => {
                    if buckets.insert((rank, bucket)) {
                        collectives += 1;
                    }
                }
                Err(_) => collectives += 1,
            }
        }
    }
    let mut line = format!("  program     {instructions} instructions per rank, {collectives} collectives and transfers");
    if !buckets.is_empty() {
        line += &format!(" ({} gradient bucket{})", buckets.len(), if buckets.len() == 1 { "" } else { "s" });
    }
    if mesh.ranks() > 1 {
        line += &format!("; {} collectives, {} s timeout", collective_algorithm(&args.collectives).map(|a| if a == shardc_runtime::collectives::Algorithm::Ring { "ring" } else { "tree" })?, args.timeout);
    }
    if args.check_numerics {
        line += "; every op's results checked for NaN and infinity";
    }
    println!("{line}");
    if let Some(fits) = fits {
        println!("{fits}");
    }
    Ok(())
}

fn run_partitioned(args: &RunArgs, spec: &Spec, mesh: shardc_ir::mesh::Mesh, fits: Option<&str>) -> Result<()> {
    let program = compile_train_step_on(spec, &args.step, mesh)?;
    crate::host::refuse_if_over_memory(std::slice::from_ref(&program), data_bytes(args))?;
    let mut corpus = training_corpus(args, spec)?;
    println!(
        "shardc: training {} on mesh {mesh} ({} CPU threads, one per rank), {} steps, seed {}, CPU storage per rank {}",
        spec.name,
        mesh.ranks(),
        args.steps,
        args.seed.unwrap_or(0),
        crate::summary::bytes(program.cpu_storage_bytes() as u64)
    );
    let algorithm = collective_algorithm(&args.collectives)?;
    let start = Instant::now();
    let timeout = std::time::Duration::from_secs(args.timeout.max(1));
    let mut checkpoints = Checkpoints::new(args, spec)?;
    let (mut state, seed) = checkpoints.resume(args, std::slice::from_ref(&program), &mut corpus)?;
    let mut evaluation = crate::data::Evaluation::new(&args.input, spec, &corpus)?;
    print_data(&corpus, evaluation.as_ref());
    print_program(args, std::slice::from_ref(&program), mesh, fits)?;
    let rows = args.step.batch(spec, mesh)?.global_batch as usize;
    let first_step = state.as_ref().map_or(0, |s| s.step);
    let to_run = steps_to_run(args, first_step)?;
    let (mut losses, mut sent, mut at) = (Vec::new(), 0u64, first_step);
    for segment in segments(first_step, to_run, &[checkpoints.period(), evaluation.as_ref().map(crate::data::Evaluation::every)]) {
        let run = shardc_runtime::train::train_spmd_from(&program, seed, spec.model.layers as usize, &corpus, segment, timeout, algorithm, state.as_ref()).map_err(training_error)?;
        losses.extend(run.losses);
        sent += run.bytes_sent.iter().flat_map(|m| m.values()).sum::<u64>();
        at += segment;
        if checkpoints.due(at, first_step + to_run) {
            checkpoints.save(&run.state, std::slice::from_ref(&program), seed, corpus.record(at, rows))?;
        }
        if let Some(evaluation) = evaluation.as_mut().filter(|e| e.due(at, first_step + to_run)) {
            evaluation.report(at, &run.state, &corpus)?;
        }
        state = Some(run.state);
    }
    report_losses(args, first_step, &losses);
    if let (Some(dir), Some(state)) = (&args.save_hf, &state) {
        crate::hf::save(dir, spec, state)?;
    }
    save_parameters(args, state.as_ref(), std::slice::from_ref(&program))?;
    println!("  time        {:.2} s; {} sent between ranks in all", start.elapsed().as_secs_f64(), crate::summary::bytes(sent));
    Ok(())
}

/// The iterations left to run: `--steps` is the total from the start of training (as
/// Megatron-LM's `--train-iters`), so a resumed run stops where the uninterrupted one would.
fn steps_to_run(args: &RunArgs, first_step: u64) -> Result<u64> {
    if args.steps == 0 && first_step == 0 {
        return Err(miette!(help = "give --steps 1 or more", "--steps 0: the run would train nothing"));
    }
    if args.steps <= first_step {
        return Err(miette!(
            help = format!("--steps counts iterations from the start of training (as Megatron-LM's --train-iters): give more than {first_step} to train on"),
            "the checkpoint is at step {first_step}, and --steps {} asks for no more",
            args.steps
        ));
    }
    Ok(args.steps - first_step)
}

/// Every place the run will write, checked before training: a wrong or read-only path found
/// after the last step would lose the run.
fn check_outputs(args: &RunArgs) -> Result<()> {
    for (flag, dir) in [("--checkpoint", &args.checkpoint), ("--save-hf", &args.save_hf)] {
        if let Some(dir) = dir {
            writable_folder(flag, dir)?;
        }
    }
    for (flag, file) in [("--save", &args.save), ("--trace", &args.trace)] {
        if let Some(file) = file {
            writable_file(flag, file)?;
        }
    }
    Ok(())
}

/// Checks that `file` can be written (its folder created if needed), before the work that
/// produces it.
pub(crate) fn writable_file(flag: &str, file: &std::path::Path) -> Result<()> {
    if file.is_dir() {
        return Err(miette!(help = "give a file name", "{flag} {}: is a folder", file.display()));
    }
    let parent = file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    writable_folder(flag, parent)
}

/// Creates `dir` (and its parents) if needed and proves a file can be written in it.
fn writable_folder(flag: &str, dir: &std::path::Path) -> Result<()> {
    let fail = |e: std::io::Error| miette!(help = "give a folder this user can write to", "{flag} {}: {e}", dir.display());
    if dir.exists() && !dir.is_dir() {
        return Err(miette!(help = "give a folder, not a file", "{flag} {}: is not a folder", dir.display()));
    }
    std::fs::create_dir_all(dir).map_err(fail)?;
    let probe = dir.join(format!(".shardc-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(fail)?;
    std::fs::remove_file(&probe).map_err(fail)
}

/// Bytes the run's training data will take in memory, for the host memory check.
fn data_bytes(args: &RunArgs) -> u64 {
    crate::data::memory_bytes(&args.input, args.step.hf_dir(args.spec.as_deref()).as_deref())
}

/// The run's corpus (`--data`, or the built-in one), read as `--data-format` says.
fn training_corpus(args: &RunArgs, spec: &Spec) -> Result<Corpus> {
    crate::data::training_corpus(&args.input, spec, args.step.hf_dir(args.spec.as_deref()).as_deref())
}

/// The run's data, how it is cut, and its evaluation.
fn print_data(corpus: &Corpus, evaluation: Option<&crate::data::Evaluation>) {
    let identity = corpus.identity();
    println!(
        "  data        {} ({}): {} tokens, {} windows of {} for training, {} held out",
        identity.source,
        identity.format,
        identity.tokens,
        corpus.train_windows(),
        corpus.seq() + 1,
        corpus.validation_windows()
    );
    if let Some(evaluation) = evaluation {
        println!("  evaluation  {}", evaluation.describe(corpus));
    }
}

/// The runs between the iterations where a run stops to checkpoint or evaluate, when
/// `steps` iterations follow iteration `first`: multiples of each period, counted from the
/// start of training, and the end.
fn segments(first: u64, steps: u64, periods: &[Option<u64>]) -> impl Iterator<Item = u64> + use<> {
    // Lazy: `--checkpoint-every 1` over millions of steps holds no list of them.
    let periods: Vec<u64> = periods.iter().flatten().map(|&every| every.max(1)).collect();
    let (mut at, end) = (first, first.saturating_add(steps));
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let next = periods.iter().map(|&every| (at / every).saturating_add(1).saturating_mul(every)).fold(end, u64::min);
        let segment = next - at;
        at = next;
        Some(segment)
    })
}

/// A multi-rank run's failure; a loss that stopped being finite (the run stopped at that step,
/// nothing of it saved) says what to change.
fn training_error(e: shardc_runtime::RuntimeError) -> miette::Report {
    let text = e.to_string();
    if text.contains("the loss became") {
        miette!(help = "lower --lr (the last checkpoint, if any, is from before this step)", "{text}")
    } else {
        miette!("{text}")
    }
}

/// `--load` starts a fresh run from given parameters; `--resume` continues a saved one.
fn refuse_load_with_resume(args: &RunArgs) -> Result<()> {
    if args.load.is_some() && args.resume.is_some() {
        return Err(miette!(help = "give one of them: --resume continues a checkpoint with its optimizer state, --load starts fresh from parameters", "--load and --resume both say where to start"));
    }
    Ok(())
}

/// `--save FILE`: the trained parameters as global tensors, whatever the mesh.
fn save_parameters(args: &RunArgs, state: Option<&shardc_runtime::train::TrainState>, programs: &[Program]) -> Result<()> {
    let (Some(path), Some(state)) = (&args.save, state) else { return Ok(()) };
    let mut names: Vec<&str> = programs.iter().flat_map(|p| p.args.iter().filter(|a| a.role == Some(shardc_runtime::program::Role::Param)).map(|a| a.name.as_str())).collect();
    names.sort_unstable();
    names.dedup();
    let tensors: shardc_runtime::checkpoint::NamedTensors = names
        .into_iter()
        .map(|name| {
            let (shape, values) = state.parameter(name).ok_or_else(|| miette!("the run's state has no parameter `{name}`"))?;
            Ok((name.to_string(), shape.clone(), values.iter().map(|&v| v as f32).collect()))
        })
        .collect::<Result<_>>()?;
    let bytes = shardc_runtime::checkpoint::to_bytes(&tensors).into_diagnostic()?;
    std::fs::write(path, bytes).into_diagnostic().wrap_err_with(|| format!("writing {}", path.display()))?;
    println!("  saved       {}", path.display());
    Ok(())
}

fn collective_algorithm(name: &str) -> Result<shardc_runtime::collectives::Algorithm> {
    match name {
        "ring" => Ok(shardc_runtime::collectives::Algorithm::Ring),
        "tree" => Ok(shardc_runtime::collectives::Algorithm::Tree),
        other => Err(miette!(help = "use ring or tree", "--collectives: unknown algorithm `{other}`")),
    }
}

/// `shardc run` with pipeline stages or several micro-batches per step.
fn run_pipelined(args: &RunArgs, spec: &Spec, mesh: shardc_ir::mesh::Mesh, fits: Option<&str>) -> Result<()> {
    let programs = compile_pipeline_programs(spec, &args.step, mesh)?;
    crate::host::refuse_if_over_memory(&programs, data_bytes(args))?;
    let schedule = shardc_runtime::pipeline::schedule_of(&programs).into_diagnostic()?;
    let algorithm = collective_algorithm(&args.collectives)?;
    let mut corpus = training_corpus(args, spec)?;
    let peak = programs.iter().map(Program::cpu_storage_bytes).max().unwrap_or(0);
    println!(
        "shardc: training {} on mesh {mesh} ({} CPU threads, one per rank), {} schedule, {} micro-batches of {} sequences per replica per step (global batch {}), {} steps, seed {}, CPU storage per rank {}",
        spec.name,
        mesh.ranks(),
        schedule.kind.label(),
        schedule.microbatches,
        spec.training.micro_batch,
        schedule.microbatches as u64 * spec.training.micro_batch * mesh.dp,
        args.steps,
        args.seed.unwrap_or(0),
        crate::summary::bytes(peak as u64)
    );
    let start = Instant::now();
    let mut checkpoints = Checkpoints::new(args, spec)?;
    let (mut state, seed) = checkpoints.resume(args, &programs, &mut corpus)?;
    let mut evaluation = crate::data::Evaluation::new(&args.input, spec, &corpus)?;
    print_data(&corpus, evaluation.as_ref());
    print_program(args, &programs, mesh, fits)?;
    let rows = args.step.batch(spec, mesh)?.global_batch as usize;
    let first_step = state.as_ref().map_or(0, |s| s.step);
    let to_run = steps_to_run(args, first_step)?;
    let (mut losses, mut sent, mut last_run, mut at) = (Vec::new(), 0u64, None, first_step);
    for segment in segments(first_step, to_run, &[checkpoints.period(), evaluation.as_ref().map(crate::data::Evaluation::every)]) {
        let run = shardc_runtime::pipeline::train_pipeline_from(&programs, seed, spec.model.layers as usize, &corpus, segment, std::time::Duration::from_secs(args.timeout.max(1)), algorithm, state.as_ref())
            .map_err(training_error)?;
        losses.extend(run.losses.iter().copied());
        sent += run.bytes_sent.iter().flat_map(|m| m.values()).sum::<u64>();
        at += segment;
        if checkpoints.due(at, first_step + to_run) {
            checkpoints.save(&run.state, &programs, seed, corpus.record(at, rows))?;
        }
        if let Some(evaluation) = evaluation.as_mut().filter(|e| e.due(at, first_step + to_run)) {
            evaluation.report(at, &run.state, &corpus)?;
        }
        state = Some(run.state.clone());
        last_run = Some(run);
    }
    report_losses(args, first_step, &losses);
    if let (Some(dir), Some(state)) = (&args.save_hf, &state) {
        crate::hf::save(dir, spec, state)?;
    }
    save_parameters(args, state.as_ref(), &programs)?;
    let Some(run) = last_run else { return Ok(()) };
    println!("  time        {:.2} s; {} sent between ranks in all", start.elapsed().as_secs_f64(), crate::summary::bytes(sent));
    println!(
        "  pipeline    measured bubble {:.1}% of the last step; activations held at most {:?} micro-batches, {} per pipeline rank",
        100.0 * run.timeline.bubble,
        run.timeline.peak_in_flight,
        run.peak_kept_bytes.iter().map(|b| crate::summary::bytes(*b as u64)).collect::<Vec<_>>().join(", ")
    );
    if let Some(path) = &args.trace {
        std::fs::write(path, shardc_runtime::schedule::trace_json(&run.timeline)).into_diagnostic().wrap_err_with(|| format!("writing {}", path.display()))?;
        println!("  trace       {} (open in Perfetto or chrome://tracing)", path.display());
    }
    Ok(())
}

/// Whether `--backend cuda` runs on the CPU emulation of the device (`SHARDC_GPU_EMULATE=1`):
/// the whole GPU path, kernels included, on a machine without a GPU (slow; for tests).
#[cfg(feature = "cuda")]
fn emulating_the_gpu() -> bool {
    std::env::var("SHARDC_GPU_EMULATE").is_ok_and(|v| v == "1")
}

/// What a GPU run cannot do yet, refused before anything is compiled or written (the output
/// checks create folders).
#[cfg(feature = "cuda")]
fn refuse_what_gpu_runs_cannot_do(args: &RunArgs) -> Result<()> {
    if args.trace.is_some() {
        return Err(miette!(help = "trace a pipeline on the CPU backend (--backend cpu with --mesh pp=N or --microbatches M)", "--trace writes a pipeline schedule's measured timeline, and GPU runs have no pipeline stages"));
    }
    if args.collectives != "ring" {
        return Err(miette!(help = "leave the choice to NCCL (its NCCL_ALGO variable selects ring or tree), or run on the CPU backend", "--collectives {}: the CPU backend's algorithm; a GPU run's collectives are NCCL's or device copies", args.collectives));
    }
    if args.check_numerics {
        return Err(miette!(help = "run the same step with --backend cpu --check-numerics to find the op; a GPU run stops at the first step whose loss is not finite", "--check-numerics checks every op's results on the CPU backend only"));
    }
    // A process of a multi-process run holds its own shards only: whole files need them all
    // (a checkpoint is one rank file per process).
    if std::env::var_os("RANK").is_some() || std::env::var_os("SHARDC_EMULATE_PROCESSES").is_some() {
        for (flag, given) in [("--save", args.save.is_some()), ("--save-hf", args.save_hf.is_some())] {
            if given {
                return Err(miette!(
                    help = "checkpoint with --checkpoint DIR (each process writes its own rank file), then write the file on one host from a run that resumes it; or run every rank on one GPU",
                    "{flag}: each process of a multi-process GPU run holds only its own shards, and a whole file needs them all"
                ));
            }
        }
    }
    Ok(())
}

/// `shardc run --backend cuda`: the training step's device plan on one GPU (every rank of the
/// mesh on it), or one rank per process over NCCL when `RANK`/`WORLD_SIZE` are set. It
/// starts as the CPU backend does (from `--resume`, `--load`, Hugging Face weights or the
/// seed), takes the same batches, checkpoints and evaluates at the same steps, and saves the
/// same files; what a GPU run cannot do yet is refused before any work, with the reason.
/// `SHARDC_EMULATE_PROCESSES=N` (with `SHARDC_GPU_EMULATE=1`) runs the N processes of a
/// multi-process run as threads of this one, each on its own emulated device, NCCL emulated
/// by the CPU collectives: the multi-process path end to end without GPUs.
#[cfg(feature = "cuda")]
fn run_cuda(args: &RunArgs, spec: &Spec, mesh: shardc_ir::mesh::Mesh) -> Result<()> {
    use shardc_runtime::cuda::{self, Placement};
    let timeout = std::time::Duration::from_secs(args.timeout.max(1));
    if let Ok(text) = std::env::var("SHARDC_EMULATE_PROCESSES") {
        let processes: usize = text.trim().parse().ok().filter(|&n| n >= 1).ok_or_else(|| miette!(help = "give the number of processes, the mesh's ranks", "SHARDC_EMULATE_PROCESSES={text}: not a positive number"))?;
        // (`check_backend` has refused it outside an emulated GPU run.)
        if std::env::var_os("RANK").is_some() {
            return Err(miette!(help = "leave RANK and WORLD_SIZE unset", "SHARDC_EMULATE_PROCESSES={text}: emulated processes are threads of this process, not processes of a torchrun world"));
        }
        if processes != mesh.ranks() as usize {
            return Err(miette!(help = format!("set SHARDC_EMULATE_PROCESSES={}", mesh.ranks()), "SHARDC_EMULATE_PROCESSES={processes}: the mesh {mesh} has {} ranks, one per process", mesh.ranks()));
        }
        let worlds = cuda::nccl::EmulatedWorld::world(processes, timeout);
        let results: Vec<Result<()>> = std::thread::scope(|scope| {
            let handles: Vec<_> = worlds
                .into_iter()
                .map(|world| {
                    scope.spawn(move || {
                        // A process that fails or panics stops the others' waits at once, as
                        // the end of a real process ends its NCCL connections.
                        let mut abort = AbortOnDrop(Some(world.abort_flag()));
                        let result = run_cuda_process(args, spec, mesh, Placement::EmulatedNccl(world));
                        if result.is_ok() {
                            abort.0 = None;
                        }
                        result
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|payload| {
                        let message = payload.downcast_ref::<String>().cloned().or_else(|| payload.downcast_ref::<&str>().map(|m| m.to_string())).unwrap_or_default();
                        Err(miette!("the process panicked: {message}"))
                    })
                })
                .collect()
        });
        // Every rank ends with the run's error: the lowest rank's that failed of itself is
        // reported (not one that failed because another did).
        let failed: Vec<(usize, miette::Report)> = results.into_iter().enumerate().filter_map(|(rank, r)| r.err().map(|e| (rank, e))).collect();
        let secondary = |e: &miette::Report| {
            // The messages themselves (the report's rendering wraps lines).
            let text = e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ");
            text.contains(cuda::ANOTHER_PROCESS_FAILED) || text.contains("because another rank failed") || text.contains(" left during ") || text.contains("emulated communicator was poisoned")
        };
        let first = failed.iter().position(|(_, e)| !secondary(e)).unwrap_or(0);
        return match failed.into_iter().nth(first) {
            Some((rank, e)) => Err(e.wrap_err(format!("emulated process of rank {rank}"))),
            None => Ok(()),
        };
    }
    let placement = if std::env::var_os("RANK").is_some() {
        Placement::Nccl(cuda::nccl::Bootstrap::from_env().into_diagnostic()?.with_timeout(timeout))
    } else if emulating_the_gpu() {
        Placement::Emulated
    } else {
        Placement::SingleDevice { device: 0 }
    };
    run_cuda_process(args, spec, mesh, placement)
}

/// Sets the emulated world's abort flag when dropped (unless disarmed: its flag taken).
#[cfg(feature = "cuda")]
struct AbortOnDrop(Option<std::sync::Arc<std::sync::atomic::AtomicBool>>);

#[cfg(feature = "cuda")]
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(flag) = self.0.take() {
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// One process of `run --backend cuda`: every rank on one device, or one rank of a
/// multi-process run (which reads and writes only its own shards, and whose rank 0 alone
/// prints).
#[cfg(feature = "cuda")]
fn run_cuda_process(args: &RunArgs, spec: &Spec, mesh: shardc_ir::mesh::Mesh, placement: shardc_runtime::cuda::Placement) -> Result<()> {
    use shardc_runtime::cuda::{self, Placement};
    let process_rank = match &placement {
        Placement::Nccl(b) => Some(b.rank),
        Placement::EmulatedNccl(w) => Some(w.rank()),
        Placement::SingleDevice { .. } | Placement::Emulated => None,
    };
    let speaks = process_rank.is_none_or(|r| r == 0);
    // Pipeline stages or more than one micro-batch per step: one program per pipeline rank,
    // run by its schedule.
    let programs = if args.step.compile_options(spec, mesh)?.pipeline.is_some() { compile_pipeline_programs(spec, &args.step, mesh)? } else { vec![compile_train_step_on(spec, &args.step, mesh)?] };
    let programs = programs.into_iter().map(shardc_codegen::device::with_device_plan).collect::<Result<Vec<_>, _>>().into_diagnostic()?;
    let mut corpus = training_corpus(args, spec)?;
    let mut checkpoints = Checkpoints::for_process(args, spec, process_rank)?;
    // A process of a multi-process run resumes from its own shards of the checkpoint alone.
    let mut trainer = match process_rank.and(args.resume.as_ref()) {
        Some(dir) => {
            let folder = checkpoints.resume_manifest(args, &programs, &mut corpus)?.unwrap_or_else(|| dir.clone());
            cuda::CudaTrainer::resume(&programs, &placement, &folder).into_diagnostic().wrap_err_with(|| format!("resuming from {}", dir.display()))?.0
        }
        // Nor does it hold a whole tensor of `--load` or Hugging Face weights: it keeps its
        // shards of each parameter as it reads them.
        None if process_rank.is_some() && args.load.is_some() => {
            let path = args.load.as_ref().expect("matched");
            let file = shardc_runtime::tensor_file::TensorFile::open(path).map_err(|e| miette!("--load {e}"))?;
            let mut parameter = |name: &str| if file.info(name).is_some() { file.read_f64(name) } else { Ok(None) };
            cuda::CudaTrainer::from_parameters(&programs, &placement, args.seed.unwrap_or(0), &mut parameter).into_diagnostic().wrap_err_with(|| format!("loading {}", path.display()))?
        }
        None if process_rank.is_some() && args.step.hf_dir(args.spec.as_deref()).is_some() => {
            let hf = args.step.hf_dir(args.spec.as_deref()).expect("matched");
            let mut weights = crate::hf::LazyWeights::open(&hf, &args.step.load_spec(args.spec.as_deref())?)?;
            if speaks {
                println!("  weights     {} tensors from {} (each process reads its own shards)", weights.len(), hf.display());
            }
            let mut parameter = |name: &str| weights.parameter(name);
            cuda::CudaTrainer::from_parameters(&programs, &placement, args.seed.unwrap_or(0), &mut parameter).into_diagnostic().wrap_err_with(|| format!("reading the weights of {}", hf.display()))?
        }
        None => {
            let (resumed, seed) = checkpoints.resume(args, &programs, &mut corpus)?;
            cuda::CudaTrainer::new(&programs, &placement, seed, spec.model.layers as usize, resumed.as_ref()).into_diagnostic()?
        }
    };
    let (first_step, seed) = (trainer.steps_taken(), trainer.seed());
    let to_run = steps_to_run(args, first_step)?;
    let rows = args.step.batch(spec, mesh)?.global_batch as usize;
    let mut evaluation = crate::data::Evaluation::new(&args.input, spec, &corpus)?;
    let schedule = programs[0].pipeline.as_ref().map_or_else(String::new, |p| format!(", {} schedule, {} micro-batches per step", p.kind.label(), p.microbatches));
    if speaks {
        println!("shardc: training {} on the GPU ({placement:?}), mesh {mesh}{schedule}, {} steps, seed {seed}", spec.name, args.steps);
        print_data(&corpus, evaluation.as_ref());
    }
    let tokens = rows * spec.seq_len() as usize;
    let (mut losses, mut seconds) = (LossSummary::default(), Vec::new());
    let mut unevaluated = false;
    for step in 1..=to_run {
        let (loss, took) = trainer.step(&corpus).into_diagnostic()?;
        let at = first_step + step;
        if !loss.is_finite() {
            return Err(miette!(help = "lower --lr", "the loss became {loss} at step {at}"));
        }
        losses.push(loss);
        seconds.push(took);
        if speaks && args.log_every > 0 && at % args.log_every == 0 {
            println!("step {at} loss {loss:.6}");
        }
        let end = first_step + to_run;
        if checkpoints.due(at, end) {
            if process_rank.is_some() {
                checkpoints.save_own_shards(&mut trainer, corpus.record(at, rows))?;
            } else {
                checkpoints.save(&trainer.state().into_diagnostic()?, &programs, seed, corpus.record(at, rows))?;
            }
        }
        if let Some(evaluation) = evaluation.as_mut().filter(|e| e.due(at, end)) {
            // The held-out loss is computed on the CPU from the state read back.
            if trainer.holds_every_rank() {
                evaluation.report(at, &trainer.state().into_diagnostic()?, &corpus)?;
            } else {
                unevaluated = true;
            }
        }
    }
    if !speaks {
        return Ok(());
    }
    if let Some(first) = losses.first {
        let last = losses.tail.iter().sum::<f64>() / losses.tail.len() as f64;
        // The first step compiles and loads the kernels: it is not timed.
        let timed = &seconds[seconds.len().min(1)..];
        let per_step = if timed.is_empty() { seconds[0] } else { timed.iter().sum::<f64>() / timed.len() as f64 };
        println!("  device      {}", trainer.device_name());
        println!("  loss        {first:.4} at step {} -> {last:.4} (mean of the last {} steps), {:.1}% lower", first_step + 1, losses.tail.len(), 100.0 * (1.0 - last / first));
        println!("  time        {:.2} ms per step after the first, {:.0} tokens/s", 1e3 * per_step, tokens as f64 / per_step);
    }
    if unevaluated {
        println!("  evaluation  skipped: this process holds only its shards of the parameters");
    }
    if args.save_hf.is_some() || args.save.is_some() {
        let state = trainer.state().into_diagnostic()?;
        if let Some(dir) = &args.save_hf {
            crate::hf::save(dir, spec, &state)?;
        }
        save_parameters(args, Some(&state), &programs)?;
    }
    Ok(())
}
