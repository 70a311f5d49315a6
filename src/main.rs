//! `shardc`: compile a transformer model spec into a partitioned training plan.
//!
//! This is the CLI edge: it reads files, prints, writes dumps and maps errors to miette
//! reports and exit codes. Everything else is in the library crates, in pipeline order:
//! `ir` (spec, dialect, MLIR) -> `passes` -> `codegen` -> `runtime`.

#![forbid(unsafe_code)]

mod calibrate;
mod data;
mod fit;
mod hf;
mod host;
mod input;
mod inspect;
mod options;
mod plan;
mod report;
mod summary;
mod train;

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};
use miette::{miette, IntoDiagnostic, Result, WrapErr};
use serde::Serialize;
use shardc_ir::mesh::Mesh;
use shardc_ir::mlir::{irdl_source, print_module, IrContext, PrintStyle, XF_IRDL};
use shardc_ir::spec::{self, Spec};

use options::StepArgs;
use summary::Summary;

/// shardc partitions the training of a transformer across many accelerators, as a compiler:
/// a model spec is lowered to MLIR (our `xf` dialect plus upstream's `shard` dialect) and
/// transformed by a pipeline of named, verified passes.
#[derive(Parser, Debug)]
#[command(name = "shardc", version, about, long_about = None, after_help = "Examples:\n  shardc ir models/tiny.toml\n  shardc compile models/gpt2-small.toml --mesh dp=2,tp=4 -o plan.json\n  shardc compile models/tiny.toml --print-ir-after-all --dump-dir out/ir\n  shardc run models/tiny.toml --steps 200\n  shardc inspect plan.json\n  shardc bench models/gpt2-small.toml --seq 128 --micro-batch 1")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print a spec lowered to MLIR (`func.func @forward` in xf ops).
    ///
    /// Example: shardc ir models/tiny.toml | mlir-opt-22 --irdl-file=ir/dialect/xf.irdl.mlir
    Ir {
        /// Model spec (.toml or .json).
        spec: PathBuf,
        /// Print every op in MLIR's generic form.
        #[arg(long)]
        generic: bool,
        /// Leave out locations (`loc("layers.0.attn.q")`).
        #[arg(long)]
        no_locations: bool,
    },
    /// Run the pass pipeline on a spec for a mesh and print a summary.
    ///
    /// Example: shardc compile models/gpt2-small.toml --mesh dp=2,tp=4,pp=1 -o plan.json
    Compile {
        /// Model spec (.toml or .json), or a Hugging Face model folder.
        #[arg(required_unless_present = "hf")]
        spec: Option<PathBuf>,
        /// Device mesh as axis=size pairs; omitted axes are 1.
        #[arg(long, default_value = "dp=1,tp=1,pp=1")]
        mesh: String,
        /// Print the IR after every pass (to stdout).
        #[arg(long)]
        print_ir_after_all: bool,
        /// Print the IR after the named pass (repeatable); `input` is the IR before any pass.
        #[arg(long, value_name = "PASS")]
        print_ir_after: Vec<String>,
        /// Write the IR before and after every pass into DIR as NN-PASS.mlir.
        #[arg(long, value_name = "DIR")]
        dump_dir: Option<PathBuf>,
        /// Write the compiled plan (rank programs with their memory plans) as JSON.
        #[arg(short, long, value_name = "FILE")]
        output: Option<PathBuf>,
        /// Code for: cpu (rank programs only) or cuda (plus each training step's CUDA
        /// module and device calls, for `--backend cuda` and the runtime-only binary).
        #[arg(long, default_value = "cpu")]
        target: String,
        #[command(flatten)]
        step: StepArgs,
    },
    /// Train a spec on the CPU backend, or on GPUs with --backend cuda, on a corpus (text read
    /// as bytes unless the data says otherwise).
    ///
    /// Example: shardc run models/tiny.toml --steps 200 --save tiny.safetensors
    Run(train::RunArgs),
    /// The logits of a Hugging Face model (GPT-2 or Llama) on a batch of token ids, computed
    /// on a mesh (partitioned, then gathered); for comparing with `transformers`.
    ///
    /// Example: shardc logits --hf out/hf-gpt2 --tokens '1,2,3;4,5,6' --mesh tp=2 -o logits.json
    Logits(hf::LogitsArgs),
    /// Print a compiled plan (or a single rank program) readably: instructions, buffers,
    /// memory.
    ///
    /// Example: shardc inspect plan.json --instrs
    Inspect(inspect::InspectArgs),
    /// Time a training step on the CPU runtime (optionally against PyTorch).
    ///
    /// Example: shardc bench models/gpt2-small.toml --seq 128 --micro-batch 1
    Bench(train::BenchArgs),
    /// Measure this machine's cost-model parameters (GEMMs of the spec's shapes, memory
    /// bandwidth, kernel dispatch, attention, the runtime's all-reduce) on the CPU backend and
    /// write a cluster TOML for --cluster.
    ///
    /// Example: shardc calibrate models/gpt2-small.toml -o cpu.toml
    Calibrate(calibrate::CalibrateArgs),
    /// List every collective and pipeline transfer the partitioner inserts, with its cause
    /// and byte cost: in one micro-batch's step, or, with pipeline stages or several
    /// micro-batches, in each pipeline rank's whole step.
    ///
    /// Example: shardc explain models/tiny.toml --mesh dp=2,tp=2
    Explain {
        /// Model spec (.toml or .json), or a Hugging Face model folder.
        #[arg(required_unless_present = "hf")]
        spec: Option<PathBuf>,
        /// Device mesh as axis=size pairs.
        #[arg(long, default_value = "dp=1,tp=1,pp=1")]
        mesh: String,
        #[command(flatten)]
        model: options::ModelArgs,
        #[command(flatten)]
        batch: options::BatchArgs,
        #[command(flatten)]
        strategy: options::StrategyArgs,
    },
    /// Search every strategy for a model on a number of GPUs; list the fastest that fit, and
    /// say what bounds each.
    ///
    /// Example: shardc plan models/gpt3-175b.toml --gpus 1024 --gpu a100-80g --global-batch 1536 --explain
    Plan(plan::PlanArgs),
    /// Generate a pipeline schedule, check it by simulation, and report its bubble and memory.
    ///
    /// Example: shardc schedule --pp 4 --microbatches 8 --schedule 1f1b --svg out.svg
    Schedule {
        /// Pipeline stages (ranks).
        #[arg(long)]
        pp: usize,
        /// Micro-batches per optimizer step.
        #[arg(long)]
        microbatches: usize,
        /// gpipe, 1f1b, interleaved or zb-h1.
        #[arg(long, default_value = "1f1b")]
        schedule: String,
        /// Model chunks per rank for the interleaved schedule (default 2).
        #[arg(long)]
        virtual_stages: Option<usize>,
        /// Write the timeline as SVG.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
        /// Write the timeline as Chrome/Perfetto trace JSON.
        #[arg(long, value_name = "FILE")]
        trace: Option<PathBuf>,
    },
    /// Print the xf dialect's IRDL definition, generated from the op registry.
    ///
    /// Example: shardc dialect --check ir/dialect/xf.irdl.mlir
    Dialect {
        /// Compare with this file instead of printing; fail if it is out of date.
        #[arg(long, value_name = "FILE")]
        check: Option<PathBuf>,
    },
    /// List the xf ops with their operands, attributes and meaning.
    ///
    /// Example: shardc ops
    Ops,
}

fn main() -> Result<()> {
    sigpipe::reset();
    report::install_terminal_safe_reports();
    let cli = Cli::parse();
    match cli.command {
        Command::Ir { spec, generic, no_locations } => {
            let spec = load_spec(&spec)?;
            let module = spec::lower(&spec, spec.step_shape(&Mesh::default())).into_diagnostic()?;
            let cx = ir_context()?;
            let style = match (generic, no_locations) {
                (true, _) => PrintStyle::Generic,
                (false, true) => PrintStyle::Plain,
                (false, false) => PrintStyle::WithLocations,
            };
            print!("{}", print_module(&cx, &module, style).into_diagnostic()?);
            Ok(())
        }
        Command::Compile { spec, mesh, print_ir_after_all, print_ir_after, dump_dir, output, target, step } => {
            compile(spec.as_deref(), &mesh, print_ir_after_all, &print_ir_after, dump_dir.as_deref(), output.as_deref(), &target, &step)
        }
        Command::Explain { spec, mesh, model, batch, strategy } => explain(spec.as_deref(), &mesh, &StepArgs { model, batch, strategy, ..StepArgs::default() }),
        Command::Run(args) => train::run(&args),
        Command::Logits(args) => hf::logits(&args),
        Command::Schedule { pp, microbatches, schedule, virtual_stages, svg, trace } => {
            pipeline_schedule(pp, microbatches, &schedule, virtual_stages, svg.as_deref(), trace.as_deref())
        }
        Command::Inspect(args) => inspect::inspect(&args),
        Command::Plan(args) => plan::plan(&args),
        Command::Bench(args) => train::bench(&args),
        Command::Calibrate(args) => calibrate::calibrate(&args),
        Command::Dialect { check } => {
            let generated = irdl_source();
            match check {
                None => print!("{generated}"),
                Some(path) => {
                    let on_disk = input::read_text("--check", &path, input::MAX_TEXT_BYTES)?;
                    if on_disk != generated {
                        return Err(miette!(
                            help = "regenerate it: shardc dialect > ir/dialect/xf.irdl.mlir",
                            "{} is out of date with the op registry",
                            path.display()
                        ));
                    }
                    // The built-in copy is what the binary loads; it must match as well.
                    if XF_IRDL != generated {
                        return Err(miette!("this binary was built with an outdated dialect file; rebuild"));
                    }
                    println!("{} is up to date", path.display());
                }
            }
            Ok(())
        }
        Command::Ops => {
            for op in shardc_ir::ops::REGISTRY {
                let sig = op.signature();
                let operands: Vec<&str> = sig.operands.iter().map(|s| s.name).collect();
                let attrs: Vec<&str> = sig.attrs.iter().map(|(n, _)| *n).collect();
                println!("{:<18} ({}){}", op.name(), operands.join(", "), if attrs.is_empty() { String::new() } else { format!(" {{{}}}", attrs.join(", ")) });
                println!("{:<18} {}", "", op.summary());
            }
            Ok(())
        }
    }
}

pub(crate) fn load_spec(path: &Path) -> Result<Spec> {
    spec::parse_file(path).map_err(report::spec_report)
}

pub(crate) fn ir_context() -> Result<IrContext> {
    IrContext::new().into_diagnostic().wrap_err("setting up MLIR")
}

/// The plan file `compile -o` writes and `inspect` reads.
#[derive(Serialize, serde::Deserialize)]
pub(crate) struct PlanFile {
    /// Bumped whenever the layout changes.
    pub format_version: u32,
    pub spec: Spec,
    pub mesh: Mesh,
    pub passes: Vec<String>,
    pub summary: Summary,
    /// One program per function: the training step, and the forward pass for evaluation.
    pub programs: Vec<shardc_runtime::Program>,
}

fn compile(
    spec_path: Option<&Path>,
    mesh: &str,
    print_all: bool,
    print_after: &[String],
    dump_dir: Option<&Path>,
    output: Option<&Path>,
    target: &str,
    step: &StepArgs,
) -> Result<()> {
    if !matches!(target, "cpu" | "cuda") {
        return Err(miette!(help = "use --target cpu or --target cuda", "unknown target `{target}`"));
    }
    let spec = step.load_spec(spec_path)?;
    let source = step.hf_dir(spec_path).or_else(|| spec_path.map(Path::to_path_buf)).unwrap_or_default();
    let mesh = Mesh::parse(mesh).map_err(|e| report::mesh_report(vec![e]))?;
    let problems = mesh.check(&spec);
    if !problems.is_empty() {
        return Err(report::mesh_report(problems));
    }
    step.refuse_what_the_step_does_not_do(&spec, mesh)?;
    let pipeline = shardc_passes::compile_pipeline(&step.compile_options(&spec, mesh)?);
    let names = pipeline.names();
    for wanted in print_after {
        if wanted != "input" && !names.contains(&wanted.as_str()) {
            return Err(miette!(help = format!("the passes are: input, {}", names.join(", ")), "--print-ir-after: no pass named `{wanted}`"));
        }
    }
    if let Some(dir) = dump_dir {
        std::fs::create_dir_all(dir).into_diagnostic().wrap_err_with(|| format!("creating {}", dir.display()))?;
    }
    let mut module = spec::lower(&spec, spec.step_shape(&mesh)).into_diagnostic()?;
    let cx = ir_context()?;
    let wants = |pass: &str| print_all || dump_dir.is_some() || print_after.iter().any(|p| p == pass);
    let mut dump_index = 0;
    let mut io_error = None;
    let report = pipeline
        .run(&cx, &mut module, wants, |pass, ir| {
            if print_all || print_after.iter().any(|p| p == pass) {
                println!("// -----// IR after {pass} //----- //\n{ir}");
            }
            if let Some(dir) = dump_dir {
                let file = dir.join(format!("{dump_index:02}-{pass}.mlir"));
                if let Err(e) = std::fs::write(&file, ir) {
                    io_error.get_or_insert(format!("writing {}: {e}", file.display()));
                }
                dump_index += 1;
            }
        })
        .into_diagnostic()?;
    if let Some(e) = io_error {
        return Err(miette!("{e}"));
    }
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    let mut programs = ["train_step", "forward"]
        .iter()
        .filter_map(|name| module.func(name))
        .map(|f| if f.name == "train_step" { shardc_codegen::lower_func_on(f, &grid) } else { shardc_codegen::lower_func(f) })
        .collect::<Result<Vec<_>, _>>()
        .into_diagnostic()?;
    if let Some(schedule) = step.schedule(&spec, mesh)? {
        // One program per pipeline rank, each with its items of the schedule.
        programs.extend(shardc_codegen::lower_pipeline(&module, &grid, &schedule).into_diagnostic()?);
    }
    if target == "cuda" {
        // Device code for the training step and every pipeline rank (the CUDA backend runs
        // pipeline schedules too).
        for program in programs.iter_mut().filter(|p| p.name == "train_step" || p.pipeline.is_some()) {
            *program = shardc_codegen::device::with_device_plan(program.clone()).into_diagnostic()?;
        }
    }
    let batch = step.batch(&spec, mesh)?;
    let mut summary = Summary::of(&spec, batch, &module, &programs);
    {
        // The step the estimate prices: the pipeline ranks' programs, or the training step.
        let priced: Vec<shardc_runtime::Program> = match programs.iter().filter(|p| p.pipeline.is_some()).cloned().collect::<Vec<_>>() {
            ranks if !ranks.is_empty() => ranks,
            _ => programs.iter().filter(|p| p.name == "train_step").cloned().collect(),
        };
        if !priced.is_empty() {
            let shape = train::model_shape(&spec, summary.active_parameters as f64, batch.global_batch);
            let cluster = step.cluster_model()?;
            summary.gpu = cluster.gpu.name.clone();
            summary.estimate = Some(shardc_codegen::estimate::estimate(&priced, &cluster, shape));
            summary.memory_estimate = shardc_codegen::estimate::memory(&priced, step.strategy.zero).into_iter().max_by(|a, b| a.total.total_cmp(&b.total));
            summary.gpu_memory = cluster.gpu.memory_bytes;
            if let Some(m) = &summary.memory_estimate {
                fit::refuse_if_too_big(&spec, step, mesh, m, &cluster.gpu.name, cluster.gpu.memory_bytes)?;
            }
        }
    }
    println!("shardc: compiled {} ({})", spec.name, source.display());
    print!("{}", summary.render(&spec, &mesh, &report.passes.iter().map(|p| p.name).collect::<Vec<_>>()));
    for line in programs.iter().filter_map(summary::device_line) {
        println!("  device      {line}");
    }
    if let Some(line) = fit::zero_gaps(&programs, step.strategy.zero, mesh.dp) {
        println!("  warning     {line}");
    }
    if let Some(path) = output {
        let plan = PlanFile { format_version: shardc_runtime::inspect::PLAN_FORMAT_VERSION, spec, mesh, passes: names.iter().map(|n| n.to_string()).collect(), summary, programs };
        let json = serde_json::to_string(&plan).into_diagnostic()?;
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).into_diagnostic().wrap_err_with(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(path, json).into_diagnostic().wrap_err_with(|| format!("writing {}", path.display()))?;
        println!("  plan        written to {}", path.display());
    }
    Ok(())
}

/// `shardc explain`: each collective of the partitioned training step with its cause.
fn explain(spec_path: Option<&Path>, mesh: &str, step: &StepArgs) -> Result<()> {
    use shardc_runtime::program::Phase;
    let spec = step.load_spec(spec_path)?;
    let mesh = Mesh::parse(mesh).map_err(|e| report::mesh_report(vec![e]))?;
    let problems = mesh.check(&spec);
    if !problems.is_empty() {
        return Err(report::mesh_report(problems));
    }
    step.refuse_what_the_step_does_not_do(&spec, mesh)?;
    // Without stages or accumulation: the collectives of one micro-batch's training step.
    // Otherwise each pipeline rank's whole step: every micro-batch's, and the update's.
    let Some(schedule) = step.schedule(&spec, mesh)? else {
        let program = train::compile_train_step_on(&spec, step, mesh)?;
        let records = shardc_runtime::report::comm_records(&program, 0);
        println!("{} on {mesh}: {} collectives in the training step of one micro-batch (bytes sent by rank 0)", spec.name, records.len());
        let total = explain_records(&program, &records, |_| 1);
        println!("  total sent by rank 0: {}", summary::bytes(total));
        return Ok(());
    };
    let programs = train::compile_pipeline_programs(&spec, step, mesh)?;
    let m = schedule.microbatches;
    let mut total = 0;
    for program in &programs {
        let plan = program.pipeline.as_ref().ok_or_else(|| miette!("a pipeline rank's program has no pipeline plan"))?;
        // The first rank of the pipeline rank's tp x cp x dp block (ranks are numbered tp
        // fastest, then cp, then dp, then pp).
        let rank = plan.rank * (mesh.ranks() / mesh.pp) as usize;
        let records = shardc_runtime::report::comm_records(program, rank);
        // Forward, backward and weight sections run once per micro-batch, the step once.
        let runs = |index: usize| if plan.chunks.iter().any(|c| c.range(Phase::Step).contains(&index)) { 1 } else { m };
        let which = if plan.ranks > 1 { format!(", pipeline rank {} of {}", plan.rank, plan.ranks) } else { String::new() };
        println!(
            "{} on {mesh}{which}: {} collectives and transfers in the {} step of {m} micro-batches, {} of them once per micro-batch (bytes sent by rank {rank})",
            spec.name,
            records.len(),
            plan.kind.label(),
            records.iter().filter(|r| runs(r.index) > 1).count(),
        );
        let sent = explain_records(program, &records, runs);
        println!("  {}sent by rank {rank}: {}", if programs.len() == 1 { "total " } else { "" }, summary::bytes(sent));
        total += sent;
    }
    if programs.len() > 1 {
        println!("total sent by the first rank of each pipeline rank: {}", summary::bytes(total));
    }
    Ok(())
}

/// Prints `records` of `program`, each run `runs(index)` times per step; the bytes they send.
fn explain_records(program: &shardc_runtime::Program, records: &[shardc_runtime::report::CommRecord], runs: impl Fn(usize) -> usize) -> u64 {
    let mut sent = 0;
    for r in records {
        let instr = &program.instrs[r.index];
        let group = match r.op.as_str() {
            "shard.send" => format!("to pp {}", instr.ints("destination").ok().and_then(|d| d.first().copied()).unwrap_or(-1)),
            "shard.recv" => format!("from pp {}", instr.ints("source").ok().and_then(|d| d.first().copied()).unwrap_or(-1)),
            _ => format!("over {}", summary::axis_names(&r.axes)),
        };
        let n = runs(r.index);
        let times = if n > 1 { format!(" x{n}") } else { String::new() };
        println!("  {:>5}  {:<18} {:<11} {:>12} elements {:>12}{times}  at {}", r.index, r.op, group, r.elements, summary::bytes(r.bytes), r.loc);
        // How it travels: in an asynchronous bucket, or in a pipeline or accumulation step's
        // step bucket, sent once its gradients are final.
        let travels = match (instr.int("xf.bucket"), instr.int("xf.step_bucket")) {
            (Ok(b), _) => Some(format!("asynchronous, in bucket {b} ({} members)", instr.int("xf.bucket_members").unwrap_or(1))),
            (_, Ok(b)) => Some(format!("in step bucket {b} ({} members), sent once the step's last backward has made its gradients", instr.int("xf.step_bucket_members").unwrap_or(1))),
            _ => None,
        };
        if let Some(travels) = travels {
            println!("         travels: {travels}");
        }
        if !r.cause.is_empty() {
            println!("         cause: {}", r.cause);
        }
        sent += r.bytes * n as u64;
    }
    sent
}

/// `shardc schedule`: a pipeline schedule, simulated with unit costs.
fn pipeline_schedule(pp: usize, microbatches: usize, kind: &str, virtual_stages: Option<usize>, svg: Option<&Path>, trace: Option<&Path>) -> Result<()> {
    use shardc_runtime::schedule::{generate, simulate, Costs, Kind};
    let name = kind;
    let kind = Kind::parse(kind).ok_or_else(|| miette!(help = "use gpipe, 1f1b, interleaved or zb-h1", "--schedule: unknown schedule `{kind}`"))?;
    let chunks = match (kind, virtual_stages) {
        (Kind::Interleaved, v) => v.unwrap_or(2),
        (_, None) => 1,
        (_, Some(v)) => return Err(miette!(help = "add --schedule interleaved, or leave --virtual-stages out", "--virtual-stages {v} splits ranks into chunks for the interleaved schedule, and the schedule is {name}")),
    };
    if chunks == 0 {
        return Err(miette!(help = "use 1 (no interleaving) or more", "--virtual-stages 0: a rank holds at least one model chunk"));
    }
    let schedule = generate(kind, pp, microbatches, chunks).map_err(|e| miette!(help = "check --pp, --microbatches and --virtual-stages", "{e}"))?;
    // Unit costs: a forward and a backward of one stage take one unit each (a backward split
    // into input and weight gradients, one unit each; an interleaved chunk 1/v).
    let v = schedule.chunks as f64;
    let costs = match kind {
        Kind::ZeroBubble => Costs { f: 1.0, b: 1.0, w: 1.0 },
        _ => Costs { f: 1.0 / v, b: 1.0 / v, w: 0.0 },
    };
    let timeline = simulate(&schedule, costs).into_diagnostic()?;
    println!("{} schedule: {} stages, {} micro-batches{}", kind.label(), pp, microbatches, if schedule.chunks > 1 { format!(", {} chunks per rank", schedule.chunks) } else { String::new() });
    println!("  bubble      {:.1}% of the step (makespan {:.2} units)", 100.0 * timeline.bubble, timeline.makespan);
    println!("  in flight   {:?} micro-batches of activations at most, per rank", timeline.peak_in_flight);
    if let Some(path) = svg {
        std::fs::write(path, shardc_runtime::schedule::svg(&schedule, &timeline)).into_diagnostic().wrap_err_with(|| format!("writing {}", path.display()))?;
        println!("  picture     {}", path.display());
    }
    if let Some(path) = trace {
        std::fs::write(path, shardc_runtime::schedule::trace_json(&timeline)).into_diagnostic().wrap_err_with(|| format!("writing {}", path.display()))?;
        println!("  trace       {}", path.display());
    }
    Ok(())
}
