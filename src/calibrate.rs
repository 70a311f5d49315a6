//! `shardc calibrate`: measures the cluster model's physical parameters on this machine's
//! CPU backend, or on a GPU, and writes them as a cluster TOML that `--cluster` reads.
//!
//! On a GPU (`--backend cuda`, with the GPU's preset from `--gpu`) the same single-op
//! programs, with their device code, are timed on the device (in-process, or in two halves
//! for a GPU machine without the compiler: `--emit DIR` writes the programs, `shardc-gpu
//! calibrate DIR` times them there, and `--measured DIR/measured.json` fits here). The fit
//! keeps the preset's peaks, SMs and tile and finds the shares of them that the device
//! reaches: GEMM efficiency and per-tile overhead, attention and vector shares, the memory
//! efficiency (a streaming add) and the launch latency (a chain of tiny kernels).
//!
//! Every figure is timed through the runtime the training step runs on: single-op programs
//! built with the op registry, lowered by codegen and run by the CPU executor (so dispatch
//! overhead, threading and bf16 widening are what a step pays), the whole step on two rank
//! threads at once, and a `shard.all_reduce` program on two rank threads. The kernels are the
//! distinct ones of the spec's training step (at one micro-batch and at four). Parameters are
//! then fitted to the model's formulas ([`Cluster::kernel_time`], [`Cluster::time`]): physics
//! fitted to measurements, never a table of measured rows.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use miette::{miette, IntoDiagnostic, Result};
use shardc_ir::cluster::{Cluster, Link};
use shardc_ir::ops::{lookup, Cost, KernelClass};
use shardc_ir::{ArgRole, Attrs, DType, FuncBuilder, TensorTy};
use shardc_runtime::cpu::CpuExecutor;

use crate::options::StepArgs;

/// Arguments of `shardc calibrate`.
#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// Model spec whose training step's kernels are timed (calibrate on the model you will
    /// run; models/gpt2-small.toml suits GPT-2-sized models).
    pub spec: PathBuf,
    /// Backend to measure: cpu, or cuda (the GPU named by --gpu, e.g. --gpu h100-sxm).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// With --backend cuda: write the single-kernel programs to time into this folder (with
    /// kernels.json) and stop, for `shardc-gpu calibrate DIR` on a GPU machine.
    #[arg(long, value_name = "DIR")]
    pub emit: Option<PathBuf>,
    /// With --backend cuda: fit from this file of measured seconds (`shardc-gpu calibrate`'s
    /// measured.json) instead of timing here.
    #[arg(long, value_name = "FILE")]
    pub measured: Option<PathBuf>,
    /// Write the cluster TOML here (default: print it).
    #[arg(long, short = 'o', value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Timed repetitions of each kernel and collective (the fastest is kept).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Measure small shapes only, in about a second (for tests; less accurate).
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    pub model: crate::options::ModelArgs,
    #[command(flatten)]
    pub batch: crate::options::BatchArgs,
    #[command(flatten)]
    pub hardware: crate::options::HardwareArgs,
}

impl CalibrateArgs {
    /// The step arguments calibration reads (the model, the sequence, the hardware).
    fn step(&self) -> StepArgs {
        StepArgs { model: self.model.clone(), batch: self.batch.clone(), hardware: self.hardware.clone(), ..StepArgs::default() }
    }

    /// Sequences per micro-batch at which the step's kernels are timed: one and
    /// `--micro-batch` (default four; one alone with --quick).
    fn micro_batches(&self) -> Result<Vec<u64>> {
        for (flag, given) in [("--global-batch", self.batch.global_batch.is_some()), ("--microbatches", self.batch.microbatches.is_some())] {
            if given {
                return Err(miette!(help = "give --micro-batch B to time the kernels of micro-batches of B sequences as well as of one", "{flag}: calibration times the kernels of one micro-batch, whatever the global batch"));
            }
        }
        Ok(match (self.batch.micro_batch, self.quick) {
            (Some(0), _) => return Err(miette!(help = "use 1 or more", "--micro-batch must be at least 1")),
            (Some(1), _) | (None, true) => vec![1],
            (Some(b), _) => vec![1, b],
            (None, false) => vec![1, 4],
        })
    }
}

/// Bytes written between timed runs to push a kernel's data out of the caches (more than
/// the last-level cache of current server CPUs).
const EVICT_BYTES: usize = 256 << 20;

/// One timed kernel: its class, arithmetic and bytes as the registry counts them, and the
/// measured seconds.
#[derive(Clone, Debug)]
struct Sample {
    what: String,
    class: KernelClass,
    cost: Cost,
    bf16: bool,
    seconds: f64,
}

/// Rank threads that run the step together, to measure how ranks sharing a host slow each
/// other down.
const SHARED_RANKS: usize = 2;

/// Seconds of one run of `program` on the CPU executor: the fastest of `repeats` after a
/// warm-up (the least disturbed by anything else running on the host). With `copies` > 1,
/// that many rank threads run their own copy at the same moment (as ranks of one host do)
/// and a run takes as long as the slowest; with `own_shares`, each copy computes on its share
/// of the worker threads (as the ranks of a dp/tp mesh do), otherwise all on one pool (as
/// pipeline ranks do).
fn time_program(program: &shardc_runtime::Program, repeats: usize, copies: usize, own_shares: bool) -> Result<f64> {
    let barrier = std::sync::Barrier::new(copies.max(1));
    let share = if own_shares { copies } else { 1 };
    let runs: Vec<Result<Vec<f64>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..copies.max(1)).map(|_| s.spawn(|| shardc_runtime::cpu::with_worker_share(share, || time_copy(program, repeats, &barrier)))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a timing thread panicked".into()))).collect()
    });
    fastest_of_slowest(runs, repeats, "timing a kernel")
}

/// The fastest repeat, each repeat taking as long as its slowest thread (`runs`: each thread's
/// seconds per repeat).
fn fastest_of_slowest(runs: Vec<Result<Vec<f64>, String>>, repeats: usize, what: &str) -> Result<f64> {
    let mut slowest = vec![0.0f64; repeats.max(1)];
    for run in runs {
        for (s, t) in slowest.iter_mut().zip(run.map_err(|e| miette!("{what}: {e}"))?) {
            *s = s.max(t);
        }
    }
    Ok(slowest.into_iter().fold(f64::INFINITY, f64::min))
}

/// One thread's timed runs of `program` (see [`time_program`]).
fn time_copy(program: &shardc_runtime::Program, repeats: usize, barrier: &std::sync::Barrier) -> Result<Vec<f64>, String> {
    let fail = |e: shardc_runtime::RuntimeError| e.to_string();
    let mut exec = CpuExecutor::new(program.clone()).map_err(fail)?;
    for arg in exec.program().args.clone() {
        let buffer = &exec.program().buffers[arg.buffer];
        let values = shardc_runtime::init::step_like_values(buffer.len(), buffer.dtype);
        if buffer.dtype == shardc_runtime::DType::I32 {
            exec.write::<i32>(&arg.name, &values.iter().map(|&v| v as i32).collect::<Vec<_>>()).map_err(fail)?;
        } else {
            exec.write_f64(&arg.name, &values).map_err(fail)?;
        }
    }
    exec.run().map_err(fail)?;
    // In a step, a kernel finds its weights and inputs out of cache (the step's other kernels
    // went through since): evict them before each timed run.
    let mut evict = vec![0u8; EVICT_BYTES];
    (0..repeats.max(1))
        .map(|i| {
            evict.iter_mut().step_by(64).for_each(|b| *b = b.wrapping_add(i as u8 | 1));
            barrier.wait();
            let t = Instant::now();
            exec.run().map(|()| t.elapsed().as_secs_f64()).map_err(fail)
        })
        .collect()
}

/// Times one instance of op `name` on inputs of `types` (step-like values, see
/// [`time_copy`]).
fn time_op(name: &str, types: &[TensorTy], attrs: Attrs, repeats: usize) -> Result<Sample> {
    let (program, mut sample) = kernel_program(name, types, attrs)?;
    sample.seconds = time_program(&program, repeats, 1, true)?;
    Ok(sample)
}

/// A program of one instance of op `name` on inputs of `types`, and its sample (class, cost;
/// no time yet).
fn kernel_program(name: &str, types: &[TensorTy], attrs: Attrs) -> Result<(shardc_runtime::Program, Sample)> {
    let def = lookup(name).ok_or_else(|| miette!("no op `{name}` in the registry"))?;
    let mut fb = FuncBuilder::new("calibrate");
    let args: Vec<_> = types.iter().enumerate().map(|(i, t)| fb.arg(&format!("in{i}"), t.clone(), ArgRole::Input)).collect();
    let results = fb.op_multi(name, &args, attrs.clone(), "calibrate").map_err(|e| miette!("{name}: {e}"))?;
    // A result that updates an operand in place (optimizer updates) is returned under the
    // operand's name, as a training step returns new state: codegen then gives both one
    // buffer and the kernel updates it in place, as it does in the step.
    let names: Vec<String> = (0..results.len()).map(|i| match def.in_place().iter().find(|(r, _)| *r == i) {
        Some((_, operand)) => format!("in{operand}"),
        None => format!("out{i}"),
    }).collect();
    let func = fb.finish(&results, &names);
    let program = shardc_codegen::lower_func(&func).into_diagnostic()?;
    let refs: Vec<&TensorTy> = types.iter().collect();
    let outputs = def.infer(&refs, &attrs).map_err(|e| miette!("{name}: {e}"))?;
    let cost = def.cost(&refs, &outputs, &attrs);
    let shape = types.iter().map(|t| format!("{:?}", t.shape)).collect::<Vec<_>>().join(" ");
    Ok((program, Sample { what: format!("{name} {shape}"), class: def.kernel_class(&refs, &attrs), cost, bf16: types[0].dtype == DType::Bf16, seconds: 0.0 }))
}

/// Seconds per instruction of a program of `count` dependent tiny adds: what the executor
/// pays per kernel besides its work.
fn time_dispatch(count: usize, repeats: usize) -> Result<f64> {
    Ok(time_program(&dispatch_program(count)?, repeats, 1, true)? / count as f64)
}

/// A program of `count` dependent tiny adds.
fn dispatch_program(count: usize) -> Result<shardc_runtime::Program> {
    let mut fb = FuncBuilder::new("calibrate");
    let t = TensorTy::new([1, 8], DType::F32);
    let mut x = fb.arg("x", t, ArgRole::Input);
    for _ in 0..count {
        x = fb.op("xf.add", &[x, x], Attrs::new(), "calibrate").map_err(|e| miette!("{e}"))?;
    }
    let func = fb.finish(&[x], &["out".to_string()]);
    shardc_codegen::lower_func(&func).into_diagnostic()
}

/// Seconds of a data-parallel all-reduce of `elements` f32 over `ranks` rank threads, run as
/// the executor runs a program's `shard.all_reduce` (staging copies, the communication
/// thread, the ring): the fastest of `repeats` runs, each the slower rank's time.
fn time_all_reduce(ranks: usize, elements: usize, repeats: usize) -> Result<f64> {
    use shardc_ir::{AttrValue, Type};
    use shardc_runtime::collectives::{world, Algorithm};
    let ty = TensorTy::new([elements as i64], DType::F32);
    let mut fb = FuncBuilder::new("calibrate");
    let x = fb.arg("x", ty.clone(), ArgRole::Input);
    let attrs = Attrs::new()
        .with("grid", AttrValue::Symbol("mesh".into()))
        .with("grid_axes", AttrValue::axes(&[shardc_ir::mesh::DP_AXIS as u16]))
        .with("reduction", AttrValue::Reduction(shardc_ir::Reduction::Sum));
    let y = fb.op_typed("shard.all_reduce", &[x], attrs, vec![Type::Tensor(ty)], "calibrate")[0];
    let func = fb.finish(&[y], &["out".to_string()]);
    let program = shardc_codegen::lower_func_on(&func, &[ranks as i64, 1, 1]).into_diagnostic()?;
    let times: Vec<Result<Vec<f64>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = world(ranks, std::time::Duration::from_secs(120))
            .into_iter()
            .map(|comm| {
                let program = program.clone();
                s.spawn(move || {
                    let mut exec = CpuExecutor::with_communicator(program, comm, Algorithm::Ring).map_err(|e| e.to_string())?;
                    exec.write::<f32>("x", &vec![1.0; elements]).map_err(|e| e.to_string())?;
                    exec.run().map_err(|e| e.to_string())?;
                    (0..repeats.max(1))
                        .map(|_| {
                            let t = Instant::now();
                            exec.run().map(|()| t.elapsed().as_secs_f64()).map_err(|e| e.to_string())
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a rank thread panicked".into()))).collect()
    });
    fastest_of_slowest(times, repeats, "timing the all-reduce")
}

/// Squared log errors of `cluster`'s kernel times against `samples`, each weighted by its
/// share of the measured time (a step's time is mostly its long kernels).
fn log_error(cluster: &Cluster, samples: &[&Sample]) -> f64 {
    let total: f64 = samples.iter().map(|s| s.seconds).sum::<f64>().max(1e-30);
    samples.iter().map(|s| s.seconds / total * (cluster.kernel_time(&s.class, &s.cost, s.bf16) / s.seconds).ln().powi(2)).sum()
}

/// The spec's single-device training step of one micro-batch of `micro_batch` sequences.
fn step_program(spec: &shardc_ir::spec::Spec, step: &StepArgs, micro_batch: u64) -> Result<shardc_runtime::Program> {
    let mut spec = spec.clone();
    spec.training.micro_batch = micro_batch;
    spec.training.global_batch = None;
    crate::train::compile_train_step(&spec, &step.one_microbatch())
}

/// The distinct kernels (op, operand types, attributes) of `program`.
fn step_kernels(program: &shardc_runtime::Program) -> Vec<(Vec<TensorTy>, Attrs, String)> {
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for instr in program.instrs.iter().filter(|i| i.op.starts_with("xf.") && lookup(&i.op).is_some() && i.op != "xf.wait") {
        let types: Vec<TensorTy> = instr.inputs.iter().map(|&b| shardc_codegen::estimate::buffer_type(program, b)).collect();
        let attrs = shardc_codegen::estimate::instr_attrs(instr);
        let key = format!("{} {:?} {:?}", instr.op, types, attrs);
        if seen.insert(key) {
            out.push((types, attrs, instr.op.clone()));
        }
    }
    out
}

/// `shardc calibrate`.
pub fn calibrate(args: &CalibrateArgs) -> Result<()> {
    if args.repeats == 0 {
        return Err(miette!(help = "use --repeats 1 or more", "--repeats must be at least 1"));
    }
    match args.backend.as_str() {
        "cpu" if args.step().hardware_given() => Err(miette!(help = "the CPU backend measures this machine; add --backend cuda to calibrate a GPU preset", "--gpu and --cluster name the GPU that --backend cuda calibrates")),
        "cpu" if args.emit.is_some() || args.measured.is_some() => Err(miette!(help = "add --backend cuda --gpu NAME", "--emit and --measured calibrate a GPU (--backend cuda)")),
        "cpu" => calibrate_cpu(args),
        "cuda" => calibrate_cuda(args),
        other => Err(miette!(help = "use --backend cpu or --backend cuda", "--backend {other}: unknown backend")),
    }
}

/// `shardc calibrate --backend cpu`.
fn calibrate_cpu(args: &CalibrateArgs) -> Result<()> {
    let step = args.step();
    let micro_batches = args.micro_batches()?;
    let spec = step.load_spec(Some(&args.spec))?;
    let repeats = args.repeats;
    let started = Instant::now();
    let threads = shardc_runtime::cpu::worker_threads();
    eprintln!("shardc calibrate: {} worker threads; timing {}'s kernels on the cpu backend", threads, spec.name);

    // Dispatch: what every kernel pays besides its work.
    let kernel_launch = time_dispatch(if args.quick { 50 } else { 400 }, repeats)?;

    // A first figure for the memory bandwidth: an add streams two inputs and one output.
    let side = if args.quick { 512 } else { 4096 };
    let big = TensorTy::new([side, side], DType::F32);
    let add = time_op("xf.add", &[big.clone(), big.clone()], Attrs::new(), repeats)?;
    let streamed = add.cost.bytes / (add.seconds - kernel_launch).max(1e-9);

    // Every distinct kernel of the step, at one and (unless quick) four sequences per
    // micro-batch.
    let mut samples: Vec<Sample> = Vec::new();
    let one_sequence = step_program(&spec, &step, 1)?;
    for &b in &micro_batches {
        let program = if b == 1 { one_sequence.clone() } else { step_program(&spec, &step, b)? };
        for (types, attrs, op) in step_kernels(&program) {
            let sample = time_op(&op, &types, attrs, repeats)?;
            // A kernel too short for the clock says nothing the fit can use.
            if !(sample.seconds.is_finite() && sample.seconds > 0.0) {
                continue;
            }
            if sample.seconds > 1e-3 {
                eprintln!("  {:<78} {:>9.3} ms", sample.what, 1e3 * sample.seconds);
            }
            samples.push(sample);
        }
    }

    let mut cluster = Cluster::preset("h100-sxm").ok_or_else(|| miette!("the h100-sxm preset exists"))?;
    let g = &mut cluster.gpu;
    g.name = "cpu".into();
    g.memory_bytes = host_memory_bytes().ok_or_else(|| miette!(help = "calibrate on Linux, or set [gpu] memory_bytes in a cluster file by hand", "cannot read this host's memory size from /proc/meminfo"))?;
    g.memory_bandwidth = streamed;
    g.memory_efficiency = 1.0;
    g.kernel_launch = kernel_launch;
    g.sms = threads;
    g.gemm_efficiency = 1.0;

    // GEMM fit: the tile and per-tile overhead that best explain the f32 products' times,
    // with the peak that goes with them (the calibrated peak is what whole tiles reach, so
    // the efficiency is 1).
    let gemms: Vec<&Sample> = samples.iter().filter(|s| matches!(s.class, KernelClass::Gemm { .. }) && !s.bf16).collect();
    if gemms.is_empty() {
        return Err(miette!(help = "add --dtype f32 (the CPU backend computes bf16 in f32: one calibration serves both)", "the spec's training step has no f32 GEMMs to time"));
    }
    let mut best: Option<(f64, [usize; 2], f64, f64)> = None;
    for tile in [[8usize, 8usize], [16, 16], [32, 32], [64, 64], [128, 128]] {
        for k_overhead in (0..=64).map(|i| 8.0 * i as f64) {
            let mut trial = cluster.clone();
            trial.gpu.gemm_tile = tile;
            trial.gpu.gemm_k_overhead = k_overhead;
            // The peak that makes the geometric mean of predicted / measured 1.
            trial.gpu.fp32_flops = 1e12;
            let total: f64 = gemms.iter().map(|s| s.seconds).sum();
            let ratio: f64 = gemms.iter().map(|s| s.seconds / total * ((trial.kernel_time(&s.class, &s.cost, false) - kernel_launch).max(1e-12) / (s.seconds - kernel_launch).max(1e-12)).ln()).sum::<f64>();
            trial.gpu.fp32_flops = 1e12 * ratio.exp();
            let error = log_error(&trial, &gemms);
            if best.is_none_or(|b| error < b.0) {
                best = Some((error, tile, k_overhead, trial.gpu.fp32_flops));
            }
        }
    }
    let (gemm_error, tile, k_overhead, peak) = best.ok_or_else(|| miette!("no GEMM fit"))?;
    cluster.gpu.gemm_tile = tile;
    cluster.gpu.gemm_k_overhead = k_overhead;
    cluster.gpu.fp32_flops = peak;
    // The CPU backend widens bf16 to f32 for its arithmetic: the same peak.
    cluster.gpu.bf16_flops = peak;

    // Attention: the share of the peak that makes the fused kernels' times come out.
    let attention: Vec<&Sample> = samples.iter().filter(|s| matches!(s.class, KernelClass::Attention { .. })).collect();
    cluster.gpu.attention_efficiency = fit_share(&cluster, &attention, |c, x| c.gpu.attention_efficiency = x);
    // Memory-bound kernels: the bandwidth is the streaming figure (as STREAM measures a
    // host); the vector-arithmetic share and the cost of a transcendental are what best
    // explain the element-wise, normalisation and loss kernels on top of it.
    let vectors: Vec<&Sample> = samples.iter().filter(|s| matches!(s.class, KernelClass::Memory)).collect();
    fit_vectors(&mut cluster, &vectors);

    // Ranks on one host: two rank threads running the whole step at once (each its own
    // executor on its share of the worker threads, as the runtime runs a mesh) take this much
    // longer than running it one after the other: contention for caches and memory.
    // Pipeline ranks share one pool of worker threads instead. In passes that interleave the
    // three, so that a drift of the host's speed touches all alike.
    let step_repeats = repeats.min(3);
    let (mut solo, mut together, mut pooled) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for _ in 0..if args.quick { 1 } else { 2 } {
        solo = solo.min(time_program(&one_sequence, step_repeats, 1, true)?);
        together = together.min(time_program(&one_sequence, step_repeats, SHARED_RANKS, true)?);
        pooled = pooled.min(time_program(&one_sequence, step_repeats, SHARED_RANKS, false)?);
    }
    cluster.shared_slowdown = (together / (SHARED_RANKS as f64 * solo)).max(1.0);
    cluster.shared_pool_slowdown = (pooled / (SHARED_RANKS as f64 * solo)).max(1.0);

    // Collectives: the ring all-reduce between two rank threads, small to large.
    let sizes: Vec<usize> = if args.quick { vec![1 << 8, 1 << 16] } else { (0..8).map(|i| 1usize << (6 + 3 * i)).collect() };
    let mut points = Vec::new();
    for &n in &sizes {
        points.push(((n * 4) as f64, time_all_reduce(2, n, repeats)?));
    }
    // Two ranks: t = launch + 2 alpha + B / bandwidth. A line through the points (weighted
    // by relative error) gives the bandwidth and the latency.
    let (intercept, slope) = fit_line(&points);
    let bandwidth = if slope > 0.0 { 1.0 / slope } else { streamed };
    let (gemm_count, kernel_count) = (gemms.len(), samples.len());
    let latency = intercept.max(1e-7);
    // Two ranks cannot tell the per-collective latency from the per-step one: half each.
    cluster.launch = latency / 2.0;
    let link = Link { alpha: latency / 4.0, bandwidth };
    cluster.intra_node = link;
    cluster.inter_node = link;
    cluster.gpus_per_node = 1 << 16;
    cluster.shared_host = true;

    // How well the fitted model explains what was measured.
    let rms = |xs: &[&Sample]| if xs.is_empty() { 0.0 } else { log_error(&cluster, xs).sqrt().exp_m1() };
    let mut table = String::new();
    table += &format!("# shardc calibrate: {} worker threads, {} kernels of {}'s step timed ({} GEMMs) in {:.1} s\n", threads, kernel_count, spec.name, gemm_count, started.elapsed().as_secs_f64());
    table += &format!("# kernel dispatch {:.1} us; memory {:.1} GB/s (a streaming add); GEMM peak {:.1} GFLOP/s (tile {}x{}, {} steps of K per tile; fit error {:.1}%)\n", kernel_launch * 1e6, streamed / 1e9, peak / 1e9, tile[0], tile[1], k_overhead, 100.0 * gemm_error.sqrt().exp_m1());
    table += &format!(
        "# attention {:.1}% of peak (error {:.1}%); vector arithmetic {:.1}% of peak, a special function {:.1} operations (error {:.1}%)\n",
        100.0 * cluster.gpu.attention_efficiency,
        100.0 * rms(&attention),
        100.0 * cluster.gpu.vector_efficiency,
        cluster.gpu.special_cost,
        100.0 * rms(&vectors)
    );
    table += &format!(
        "# {} ranks computing at once take {:.2}x as long as in turn ({:.2}x drawing on one pool of worker threads, as pipeline ranks do)\n",
        SHARED_RANKS, cluster.shared_slowdown, cluster.shared_pool_slowdown
    );
    table += &format!("# all-reduce over 2 ranks: {:.1} us + {:.2} GB/s\n", latency * 1e6, bandwidth / 1e9);
    table += &longest_kernels(&cluster, &samples);
    write_cluster(args, &table, &cluster)
}

/// The longest kernels, measured beside the fitted model: where it is off.
fn longest_kernels(cluster: &Cluster, samples: &[Sample]) -> String {
    let mut longest: Vec<&Sample> = samples.iter().collect();
    longest.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let mut table = String::from("# longest kernels: measured ms, fitted ms\n");
    for s in longest.iter().take(16) {
        table += &format!("#   {:<70} {:>8.3} {:>8.3}\n", s.what, 1e3 * s.seconds, 1e3 * cluster.kernel_time(&s.class, &s.cost, s.bf16));
    }
    table
}

/// Writes `table` (comment lines) and the cluster TOML to `-o` (or prints them).
fn write_cluster(args: &CalibrateArgs, table: &str, cluster: &Cluster) -> Result<()> {
    // What --cluster will read: never write a file it refuses.
    if let Err(e) = Cluster::from_toml(&cluster.to_toml()) {
        return Err(miette!(help = "measure again (the times gave a parameter outside its range)", "the calibrated cluster is not a valid cluster TOML: {e}"));
    }
    let text = format!("{table}{}", cluster.to_toml());
    match &args.output {
        Some(path) => {
            std::fs::write(path, &text).map_err(|e| miette!(help = "write to a folder that exists", "-o {}: {e}", path.display()))?;
            eprint!("{table}");
            eprintln!("  wrote {}", path.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}

/// Elements of each operand of the streaming add that measures a GPU's memory bandwidth
/// (256 MB in f32: far beyond the L2 cache).
const GPU_STREAM_ELEMENTS: i64 = 1 << 26;
/// Tiny dependent kernels whose chain measures a GPU's launch latency.
const GPU_DISPATCH_CHAIN: usize = 200;
/// Plausible seconds of one run of a kernel program read from `--measured`.
const MEASURED_SECONDS: std::ops::RangeInclusive<f64> = 1e-9..=3600.0;

/// `shardc calibrate --backend cuda`.
fn calibrate_cuda(args: &CalibrateArgs) -> Result<()> {
    let step = args.step();
    let micro_batches = args.micro_batches()?;
    if !step.hardware_given() {
        return Err(miette!(help = format!("add --gpu NAME (one of {}) or --cluster FILE", shardc_ir::cluster::GPU_PRESETS.join(", ")), "--backend cuda calibrates a GPU: name its preset"));
    }
    if args.emit.is_some() && args.measured.is_some() {
        return Err(miette!(help = "emit on the build machine, time with shardc-gpu on the GPU machine, then fit with --measured", "--emit and --measured are two halves of one calibration: give one"));
    }
    let spec = step.load_spec(Some(&args.spec))?;
    let base = step.cluster_model()?;
    // The kernels to time, each a program with its device code: the streaming add, the chain
    // of tiny kernels, then every distinct kernel of the step at one and four sequences.
    let quick_sides = if args.quick { 1 << 16 } else { GPU_STREAM_ELEMENTS };
    let stream = TensorTy::new([quick_sides], DType::F32);
    let mut kernels: Vec<(shardc_runtime::Program, Sample)> = vec![kernel_program("xf.add", &[stream.clone(), stream], Attrs::new())?];
    let chain = dispatch_program(GPU_DISPATCH_CHAIN)?;
    kernels.push((chain, Sample { what: format!("{GPU_DISPATCH_CHAIN} dependent tiny adds"), class: KernelClass::Memory, cost: Cost::default(), bf16: false, seconds: 0.0 }));
    let mut seen = std::collections::BTreeSet::new();
    for &b in &micro_batches {
        for (types, attrs, op) in step_kernels(&step_program(&spec, &step, b)?) {
            if seen.insert(format!("{op} {types:?} {attrs:?}")) {
                kernels.push(kernel_program(&op, &types, attrs)?);
            }
        }
    }
    // The chain (second) keeps its kernels apart: fused, its 200 adds would be one launch and
    // time nothing of a launch.
    let mut kernels: Vec<(String, shardc_runtime::Program, Sample)> = kernels
        .into_iter()
        .enumerate()
        .map(|(i, (mut program, sample))| {
            let options = shardc_codegen::device::DeviceOptions { elementwise_fusion: i != 1, ..Default::default() };
            program.device = Some(shardc_codegen::device::device_plan_with(&program, options).into_diagnostic()?);
            Ok((format!("{i:03} {}", sample.what), program, sample))
        })
        .collect::<Result<_>>()?;

    if let Some(dir) = &args.emit {
        std::fs::create_dir_all(dir).map_err(|e| miette!(help = "give a folder that can be created", "--emit {}: {e}", dir.display()))?;
        let mut list = Vec::new();
        for (i, (name, program, _)) in kernels.iter().enumerate() {
            let file = format!("k{i:03}.json");
            let json = serde_json::to_string(program).into_diagnostic()?;
            std::fs::write(dir.join(&file), json).map_err(|e| miette!("--emit {}: {e}", dir.display()))?;
            list.push(serde_json::json!({ "name": name, "program": file }));
        }
        std::fs::write(dir.join("kernels.json"), serde_json::to_string_pretty(&list).into_diagnostic()?).map_err(|e| miette!("--emit {}: {e}", dir.display()))?;
        eprintln!("shardc calibrate: wrote {} kernel programs to {}; time them with `shardc-gpu calibrate {}` on the GPU, then fit with --measured {}/measured.json", kernels.len(), dir.display(), dir.display(), dir.display());
        return Ok(());
    }
    match &args.measured {
        Some(path) => {
            let text = crate::input::read_text("--measured", path, crate::input::MAX_TEXT_BYTES)?;
            let measured: std::collections::BTreeMap<String, f64> = serde_json::from_str(&text).map_err(|e| miette!(help = "give the measured.json that `shardc-gpu calibrate DIR` wrote", "--measured {}: {e}", path.display()))?;
            for (name, _, sample) in &mut kernels {
                let seconds = *measured.get(name).ok_or_else(|| {
                    miette!(help = "emit and fit with the same spec and options (--seq, --micro-batch, --dtype, --quick)", "--measured {}: no time for kernel `{name}`", path.display())
                })?;
                // A run of one kernel (or of the launch chain) on a GPU takes microseconds to
                // seconds: anything outside [1 ns, 1 h] is not a time of one (and would fit
                // shares pinned at their bounds, or a launch latency of 0 that the TOML
                // reader refuses).
                if !(MEASURED_SECONDS.contains(&seconds)) {
                    return Err(miette!(
                        help = "time the kernels again with `shardc-gpu calibrate DIR` (it writes seconds per run)",
                        "--measured {}: kernel `{name}`: {seconds:e} seconds is not the time of one run (expected {:e} to {:e})",
                        path.display(),
                        MEASURED_SECONDS.start(),
                        MEASURED_SECONDS.end()
                    ));
                }
                sample.seconds = seconds;
            }
        }
        None => time_on_device(&mut kernels, args.repeats)?,
    }
    let samples: Vec<Sample> = kernels.into_iter().map(|(_, _, s)| s).collect();
    if let Some(bad) = samples.iter().find(|s| !(s.seconds.is_finite() && s.seconds > 0.0)) {
        return Err(miette!(help = "time the kernels again", "kernel `{}` has no positive time ({})", bad.what, bad.seconds));
    }
    let (cluster, table) = fit_gpu(base, &samples, &spec.name);
    write_cluster(args, &table, &cluster)
}

/// Times each kernel program on the GPU (device 0, or the CPU emulation of the device with
/// `SHARDC_GPU_EMULATE=1`).
#[cfg(feature = "cuda")]
fn time_on_device(kernels: &mut [(String, shardc_runtime::Program, Sample)], repeats: usize) -> Result<()> {
    use shardc_runtime::cuda::Placement;
    let placement = Placement::first_gpu_or_emulated();
    for (name, program, sample) in kernels.iter_mut() {
        sample.seconds = shardc_runtime::cuda::time_program(program.clone(), &placement, repeats).map_err(|e| miette!("timing {name}: {e}"))?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn time_on_device(_: &mut [(String, shardc_runtime::Program, Sample)], _: usize) -> Result<()> {
    Err(miette!(help = "build shardc with --features cuda, or --emit DIR and time it with shardc-gpu calibrate DIR on the GPU machine", "this shardc has no CUDA backend"))
}

/// Fits the GPU's shares of its preset's peaks to `samples` (the streaming add first, the
/// launch chain second, then the step's kernels). Returns the cluster and its report.
fn fit_gpu(base: Cluster, samples: &[Sample], model: &str) -> (Cluster, String) {
    let mut cluster = base;
    let (stream, chain, step) = (&samples[0], &samples[1], &samples[2..]);
    cluster.gpu.kernel_launch = chain.seconds / GPU_DISPATCH_CHAIN as f64;
    let streamed = stream.cost.bytes / (stream.seconds - cluster.gpu.kernel_launch).max(1e-12);
    cluster.gpu.memory_efficiency = (streamed / cluster.gpu.memory_bandwidth).clamp(1e-3, 1.0);
    // GEMMs: the preset's tile, SMs and peaks; the efficiency of the main loop and the
    // per-tile overhead that best explain the products' times.
    let gemms: Vec<&Sample> = step.iter().filter(|s| matches!(s.class, KernelClass::Gemm { .. })).collect();
    let mut best = (f64::INFINITY, cluster.gpu.gemm_efficiency, cluster.gpu.gemm_k_overhead);
    for k_overhead in (0..=32).map(|i| 16.0 * i as f64) {
        let mut trial = cluster.clone();
        trial.gpu.gemm_k_overhead = k_overhead;
        trial.gpu.gemm_efficiency = fit_share(&trial, &gemms, |c, x| c.gpu.gemm_efficiency = x);
        let error = log_error(&trial, &gemms);
        if error < best.0 {
            best = (error, trial.gpu.gemm_efficiency, k_overhead);
        }
    }
    (cluster.gpu.gemm_efficiency, cluster.gpu.gemm_k_overhead) = (best.1, best.2);
    let attention: Vec<&Sample> = step.iter().filter(|s| matches!(s.class, KernelClass::Attention { .. })).collect();
    cluster.gpu.attention_efficiency = fit_share(&cluster, &attention, |c, x| c.gpu.attention_efficiency = x);
    let vectors: Vec<&Sample> = step.iter().filter(|s| matches!(s.class, KernelClass::Memory)).collect();
    fit_vectors(&mut cluster, &vectors);
    let rms = |xs: &[&Sample]| if xs.is_empty() { 0.0 } else { log_error(&cluster, xs).sqrt().exp_m1() };
    let g = &cluster.gpu;
    let mut table = format!("# shardc calibrate: {} ({}), {} kernels of {}'s step timed ({} GEMMs)\n", g.name, "cuda", step.len(), model, gemms.len());
    table += &format!("# launch {:.1} us; memory {:.0} GB/s ({:.0}% of {:.0}); GEMM main loop {:.0}% of peak, {} steps of K per tile (fit error {:.1}%)\n", 1e6 * g.kernel_launch, streamed / 1e9, 100.0 * g.memory_efficiency, g.memory_bandwidth / 1e9, 100.0 * g.gemm_efficiency, g.gemm_k_overhead, 100.0 * rms(&gemms));
    table += &format!("# attention {:.1}% of peak (error {:.1}%); vector arithmetic {:.1}% of peak, a special function {:.1} operations (error {:.1}%)\n", 100.0 * g.attention_efficiency, 100.0 * rms(&attention), 100.0 * g.vector_efficiency, g.special_cost, 100.0 * rms(&vectors));
    table += &longest_kernels(&cluster, step);
    (cluster, table)
}

/// Sets the vector-arithmetic share and the cost of a transcendental that best explain the
/// memory-bound kernels `vectors` on top of the cluster's bandwidth.
fn fit_vectors(cluster: &mut Cluster, vectors: &[&Sample]) {
    let mut best = (f64::INFINITY, 1.0, 1.0);
    for special_cost in (0..=24).map(|j| 2f64.powf(j as f64 / 3.0)) {
        let mut trial = cluster.clone();
        trial.gpu.special_cost = special_cost;
        let share = fit_share(&trial, vectors, |c, x| c.gpu.vector_efficiency = x);
        trial.gpu.vector_efficiency = share;
        let error = log_error(&trial, vectors);
        if error < best.0 {
            best = (error, share, special_cost);
        }
    }
    cluster.gpu.vector_efficiency = best.1;
    cluster.gpu.special_cost = best.2;
}

/// The share (0..1] that, set by `set`, makes the time-weighted median of predicted /
/// measured 1 for `samples` (1 when there are none or they are bound by memory): as much of
/// the kernels' time is over-predicted as under-predicted. A median, not a mean, so that one
/// kernel the model cannot explain (a serial walk the cost registry sees as a few bytes)
/// does not drag the share, and with it every other kernel, by orders of magnitude.
fn fit_share(cluster: &Cluster, samples: &[&Sample], set: impl Fn(&mut Cluster, f64)) -> f64 {
    if samples.is_empty() {
        return 1.0;
    }
    // Bisection on the time over-predicted less the time under-predicted, which falls as the
    // share grows.
    let balance = |x: f64| {
        let mut c = cluster.clone();
        set(&mut c, x);
        samples.iter().map(|s| s.seconds * (c.kernel_time(&s.class, &s.cost, s.bf16) / s.seconds).ln().signum()).sum::<f64>()
    };
    let (mut lo, mut hi) = (1e-4f64, 1.0f64);
    if balance(hi) >= 0.0 {
        return hi;
    }
    for _ in 0..60 {
        let mid = (lo * hi).sqrt();
        if balance(mid) > 0.0 { lo = mid } else { hi = mid }
    }
    hi
}

/// Least-squares line `t = a + b x` through `points`, each weighted by 1/t^2 (relative error).
fn fit_line(points: &[(f64, f64)]) -> (f64, f64) {
    let (mut sw, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, y) in points {
        let w = 1.0 / (y * y).max(1e-30);
        sw += w;
        sx += w * x;
        sy += w * y;
        sxx += w * x * x;
        sxy += w * x * y;
    }
    let det = sw * sxx - sx * sx;
    if det.abs() < 1e-300 {
        return (sy / sw.max(1e-300), 0.0);
    }
    let b = (sw * sxy - sx * sy) / det;
    ((sy - b * sx) / sw, b)
}

/// Total memory of this host (Linux), in bytes.
fn host_memory_bytes() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? * 1024.0)
}
