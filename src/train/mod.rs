//! `shardc run`: training on the CPU runtime (one rank, rank threads of a mesh, pipelines),
//! with the compiled steps it runs; `bench` times them, `checkpoints` is what runs write and
//! read back, `cuda` the GPU backend's runs.

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

mod bench;
mod checkpoints;
#[cfg(feature = "cuda")]
mod cuda;

pub use bench::*;
use checkpoints::*;
pub(crate) use checkpoints::{make_parent, writable_file};
#[cfg(feature = "cuda")]
use cuda::*;

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
    /// Backend: cpu (the default and the reference) or cuda (every rank on one GPU, or one
    /// process per GPU under torchrun).
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
    #[arg(long, value_name = "N", requires = "checkpoint")]
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
    /// Default: 60.
    #[arg(long, value_name = "SECONDS")]
    pub timeout: Option<u64>,
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

impl RunArgs {
    /// `--timeout`, 60 seconds unless given (at least 1).
    pub fn timeout_seconds(&self) -> u64 {
        self.timeout.unwrap_or(60).max(1)
    }
}

/// Options for talking between ranks are refused on a run of one rank, which has nobody to
/// talk to: they would change nothing.
fn refuse_rank_options_on_one_rank(args: &RunArgs, mesh: shardc_ir::mesh::Mesh) -> Result<()> {
    if mesh.ranks() > 1 {
        return Ok(());
    }
    if args.collectives != "ring" {
        return Err(miette!(help = "add ranks (--mesh dp=2, say), or leave --collectives out", "--collectives {} chooses how ranks reduce together, and --mesh {mesh} has one rank", args.collectives));
    }
    if let Some(timeout) = args.timeout {
        return Err(miette!(help = "add ranks (--mesh dp=2, say), or leave --timeout out", "--timeout {timeout} bounds how long a rank waits for another, and --mesh {mesh} has one rank"));
    }
    Ok(())
}

/// How the loss moved from `first` to `last`: "0.7% lower", or "0.1% higher".
pub(super) fn loss_change(first: f64, last: f64) -> String {
    let change = 100.0 * (1.0 - last / first);
    if change >= 0.0 { format!("{change:.1}% lower") } else { format!("{:.1}% higher", -change) }
}

/// A run's own processes are ranks of a GPU run: torchrun's `RANK` and `WORLD_SIZE` name
/// them, and the CPU backend, which runs every rank in this process, would train the whole
/// mesh once in each.
fn refuse_processes_on_the_cpu(args: &RunArgs) -> Result<()> {
    let world = std::env::var("WORLD_SIZE").ok().and_then(|w| w.trim().parse::<usize>().ok()).unwrap_or(1);
    if args.backend == "cpu" && std::env::var_os("RANK").is_some() && world > 1 {
        return Err(miette!(help = "run with --backend cuda under torchrun (one process per GPU), or unset RANK and WORLD_SIZE to run every rank in one CPU process", "RANK is set (a process of {world}): the CPU backend runs every rank of the mesh in one process, so each of the {world} would train the whole run"));
    }
    Ok(())
}

pub fn run(args: &RunArgs) -> Result<()> {
    check_steps("--steps", args.steps)?;
    check_backend(&args.backend)?;
    refuse_processes_on_the_cpu(args)?;
    crate::data::refuse_unused(&args.input)?;
    // The learning rate decays over the whole run unless told otherwise (as Megatron-LM's
    // --lr-decay-iters defaults to --train-iters).
    let mut args = args.clone();
    // A resumed run continues its checkpoint's decay (its --steps may have been shorter).
    let resumed_decay = args.resume.as_deref().and_then(|dir| shardc_runtime::checkpoint::read_manifest(dir).ok()).and_then(|m| m.optimizer).map(|o| o.decay_steps);
    if args.step.training.lr_decay_steps.is_none() && args.step.training.lr_decay.as_deref() != Some("constant") {
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
    args.step.refuse_what_the_step_does_not_do(&spec, mesh)?;
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
        cuda::emulated_processes(mesh)?;
    }
    refuse_rank_options_on_one_rank(args, mesh)?;
    // The tests' fault injection: a value it cannot read would be a fault silently not made.
    if let Ok(text) = std::env::var("SHARDC_FAULT") {
        match shardc_runtime::cpu::Fault::from_env() {
            None => return Err(miette!(help = "e.g. SHARDC_FAULT=1:30:panic, or unset it", "SHARDC_FAULT={text}: expected RANK:INSTRUCTION:panic|kernel|hang")),
            Some(fault) if fault.rank >= mesh.ranks() as usize => return Err(miette!(help = format!("give a rank below {}, or unset it", mesh.ranks()), "SHARDC_FAULT={text}: the mesh {mesh} has no rank {}", fault.rank)),
            Some(_) => {}
        }
    }
    // A model without a Hugging Face family is refused before it trains, not after.
    if args.save_hf.is_some() {
        shardc_ir::spec::hf::to_hf_config(&spec).map_err(|e| miette!(help = "--save-hf writes GPT-2, Llama and Mixtral models; use --save for the others", "--save-hf: {e}"))?;
    }
    if args.backend == "cpu" && mesh.ranks() as usize > shardc_runtime::train::MAX_CPU_RANKS {
        return Err(miette!(
            help = format!("price a mesh this large with `shardc compile` or `shardc plan`; run at most {} ranks", shardc_runtime::train::MAX_CPU_RANKS),
            "--mesh {mesh}: the CPU backend runs a thread per rank, and {} ranks are more than it runs",
            mesh.ranks()
        ));
    }
    let pipelined = args.step.compile_options(&spec, mesh)?.pipeline.is_some();
    if args.trace.is_some() && !pipelined && args.backend == "cpu" {
        return Err(miette!(help = "trace a pipeline: add --mesh pp=N, or --microbatches M with M > 1", "--trace writes a pipeline schedule's measured timeline, and this run has one micro-batch and no pipeline stages"));
    }
    // Last of the checks before any work: it proves the outputs writable.
    check_outputs(args)?;
    #[cfg(feature = "cuda")]
    if args.backend == "cuda" {
        if let Some(fits) = &fits {
            println!("{fits}");
        }
        return run_cuda(args, &spec, mesh);
    }
    if pipelined {
        return run_pipelined(args, &spec, mesh, fits.as_deref());
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
        println!("  loss        {first:.4} at step 1 -> {last:.4} (mean of the last {} steps), {}", tail.len(), loss_change(first, last));
        println!("  time        {elapsed:.2} s, {:.1} ms per step, {:.0} tokens/s", 1e3 * elapsed / losses.count as f64, losses.count as f64 * trainer.tokens_per_step() as f64 / elapsed);
    }
    let state = trainer.state().into_diagnostic()?;
    if let Some(dir) = &args.save_hf {
        crate::hf::save(dir, &spec, &state)?;
    }
    save_parameters(args, &spec, Some(&state))?;
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
        println!("  loss        {first:.4} at step {} -> {last:.4} (mean of the last {} steps), {}", first_step + 1, tail.len(), loss_change(*first, last));
    }
}

/// The compiled step a run executes, in a line: its instructions and collectives (gradient
/// buckets counted as the one collective each is), and how ranks talk and are checked.
fn print_program(args: &RunArgs, programs: &[Program], mesh: shardc_ir::mesh::Mesh, fits: Option<&str>) -> Result<()> {
    let instructions = programs.iter().map(|p| p.instrs.len()).max().unwrap_or(0);
    // The busiest pipeline rank's; a bucket's members travel as one message.
    let mut most = (0, 0);
    for program in programs {
        // Buckets of one step (`xf.bucket`) and of a pipeline or accumulation step's step
        // section (`xf.step_bucket`), numbered apart.
        let (mut messages, mut members) = (0usize, std::collections::BTreeMap::<(bool, i64), usize>::new());
        for instr in program.instrs.iter().filter(|i| i.op.starts_with("shard.")) {
            match (instr.int("xf.bucket"), instr.int("xf.step_bucket")) {
                (Ok(bucket), _) => *members.entry((false, bucket)).or_default() += 1,
                (_, Ok(bucket)) => *members.entry((true, bucket)).or_default() += 1,
                _ => messages += 1,
            }
        }
        let shared = members.values().filter(|&&n| n > 1).count();
        most = most.max((messages + members.len(), shared));
    }
    let (collectives, shared) = most;
    let mut line = format!("  program     {instructions} instructions per rank, {collectives} collectives and transfers per rank");
    if shared > 0 {
        line += &format!(" ({shared} of them one message for several collectives)");
    }
    // The wait the run applies (at least a second).
    let timeout = args.timeout_seconds();
    if mesh.ranks() > 1 {
        line += &format!("; {} collectives, {timeout} s timeout", collective_algorithm(&args.collectives).map(|a| if a == shardc_runtime::collectives::Algorithm::Ring { "ring" } else { "tree" })?);
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
    let timeout = std::time::Duration::from_secs(args.timeout_seconds());
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
    save_parameters(args, spec, state.as_ref().map(|s| s as &dyn shardc_runtime::train::ParameterSource))?;
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
        let run = shardc_runtime::pipeline::train_pipeline_from(&programs, seed, spec.model.layers as usize, &corpus, segment, std::time::Duration::from_secs(args.timeout_seconds()), algorithm, state.as_ref())
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
    save_parameters(args, spec, state.as_ref().map(|s| s as &dyn shardc_runtime::train::ParameterSource))?;
    let Some(run) = last_run else { return Ok(()) };
    println!("  time        {:.2} s; {} sent between ranks in all", start.elapsed().as_secs_f64(), crate::summary::bytes(sent));
    println!(
        "  pipeline    measured bubble {:.1}% of the last step; activations of at most {:?} micro-batches at once, {} per pipeline rank in copies beside the running one's",
        100.0 * run.timeline.bubble,
        run.timeline.peak_in_flight,
        run.peak_kept_bytes.iter().map(|b| crate::summary::bytes(*b as u64)).collect::<Vec<_>>().join(", ")
    );
    if let Some(path) = &args.trace {
        make_parent(path)?;
        std::fs::write(path, shardc_runtime::schedule::trace_json(&run.timeline)).into_diagnostic().wrap_err_with(|| format!("writing {}", path.display()))?;
        println!("  trace       {} (open in Perfetto or chrome://tracing)", path.display());
    }
    Ok(())
}
