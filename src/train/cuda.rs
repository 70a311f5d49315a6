//! `shardc run --backend cuda`: every rank on the GPU, or one process per GPU (torchrun's
//! environment), and the emulated processes that test it.

use super::*;

/// Whether `--backend cuda` runs on the CPU emulation of the device (`SHARDC_GPU_EMULATE=1`):
/// the whole GPU path, kernels included, on a machine without a GPU (slow; for tests).
#[cfg(feature = "cuda")]
pub(super) fn emulating_the_gpu() -> bool {
    std::env::var("SHARDC_GPU_EMULATE").is_ok_and(|v| v == "1")
}

/// What a GPU run cannot do yet, refused before anything is compiled or written (the output
/// checks create folders).
#[cfg(feature = "cuda")]
pub(super) fn refuse_what_gpu_runs_cannot_do(args: &RunArgs) -> Result<()> {
    if args.trace.is_some() {
        return Err(miette!(
            help = "trace the same schedule on the CPU backend (--backend cpu with --mesh pp=N or --microbatches M)",
            "--trace writes the timeline the CPU pipeline runtime measures item by item; the CUDA backend runs a schedule's items on its streams without timing each"
        ));
    }
    // An unknown name is refused as such first; a known one other than the default is the
    // CPU backend's choice.
    if super::collective_algorithm(&args.collectives)? != shardc_runtime::collectives::Algorithm::Ring {
        return Err(miette!(help = "leave the choice to NCCL (its NCCL_ALGO variable selects ring or tree), or run on the CPU backend", "--collectives {}: the CPU backend's algorithm; a GPU run's collectives are NCCL's or device copies", args.collectives));
    }
    if args.check_numerics {
        return Err(miette!(help = "run the same step with --backend cpu --check-numerics to find the op; a GPU run stops at the first step whose loss is not finite", "--check-numerics checks every op's results on the CPU backend only"));
    }
    Ok(())
}

/// What the run held on its devices, measured as the executors allocate (the most bytes at
/// once: what `torch.cuda.max_memory_allocated` reports), beside the compiled plan's
/// `memory/GPU`, which counts the same for a process that runs one rank. The processes of a
/// multi-process run each give their peak (every one calls this), and the busiest one is
/// set beside its own pipeline rank's estimate.
#[cfg(feature = "cuda")]
fn device_memory_line(trainer: &mut shardc_runtime::cuda::CudaTrainer, programs: &[Program], zero: u8, placement: &shardc_runtime::cuda::Placement) -> Result<String> {
    let size = |b: f64| if b >= 0.1e9 { format!("{:.2} GB", b / 1e9) } else if b >= 0.1e6 { format!("{:.2} MB", b / 1e6) } else { format!("{:.1} kB", b / 1e3) };
    let held = trainer.peak_device_bytes();
    let estimates = shardc_codegen::estimate::memory(programs, zero);
    // The emulation has no cuBLASLt, whose workspace the estimate counts on every GPU.
    let emulated = matches!(placement, shardc_runtime::cuda::Placement::Emulated | shardc_runtime::cuda::Placement::EmulatedNccl(_));
    let without = |estimated: f64| if emulated { format!(", {} without cuBLASLt's workspace, which the emulation lacks", size(estimated - shardc_runtime::program::CUBLASLT_WORKSPACE_BYTES as f64)) } else { String::new() };
    if let (Some(_), [(stage, _, peak)]) = (trainer.process_rank(), held.as_slice()) {
        // Every process's (peak's high and low 31 bits, pipeline rank): i32s go through NCCL.
        let (high, low) = ((*peak >> 31) as i32, (*peak & 0x7fff_ffff) as i32);
        let all = trainer.gather_from_every_process(&[high, low, *stage as i32]).into_diagnostic()?;
        let peaks: Vec<(usize, usize)> = all.chunks_exact(3).map(|p| (((p[0] as usize) << 31) | p[1] as usize, p[2] as usize)).collect();
        let (rank, &(measured, busiest)) = peaks.iter().enumerate().max_by(|a, b| a.1.0.cmp(&b.1.0).then(b.0.cmp(&a.0))).ok_or_else(|| miette!("no process reported its memory"))?;
        let estimated = estimates.get(busiest).map_or(0.0, |m| m.total);
        return Ok(format!("{} at most on one device (rank {rank}'s, the busiest of {} processes), measured as it allocates (the compiled plan's memory/GPU for its pipeline rank: {}{})", size(measured as f64), peaks.len(), size(estimated), without(estimated)));
    }
    let ranks: usize = held.iter().map(|(_, ranks, _)| ranks.len()).sum();
    let estimated = match held.as_slice() {
        [(stage, _, _)] if ranks <= 1 => estimates.get(*stage).map_or(0.0, |m| m.total),
        _ => estimates.iter().map(|m| m.total).fold(0.0, f64::max),
    };
    let total: f64 = held.iter().map(|(_, _, peak)| *peak as f64).sum();
    Ok(if ranks <= 1 {
        format!("{} at most on the device, measured as it allocates (the compiled plan's memory/GPU: {}{})", size(total), size(estimated), without(estimated))
    } else {
        format!("{} at most for its {ranks} ranks on one device, measured as it allocates (the compiled plan's memory/GPU, a process per rank: {}{})", size(total), size(estimated), without(estimated))
    })
}

/// The processes `SHARDC_EMULATE_PROCESSES` asks a GPU run to emulate (none when unset),
/// checked against `mesh` before any work (a refused run leaves no checkpoint folder).
#[cfg(feature = "cuda")]
pub(super) fn emulated_processes(mesh: shardc_ir::mesh::Mesh) -> Result<Option<usize>> {
    let Ok(text) = std::env::var("SHARDC_EMULATE_PROCESSES") else { return Ok(None) };
    let processes: usize = text.trim().parse().ok().filter(|&n| n >= 1).ok_or_else(|| miette!(help = "give the number of processes, the mesh's ranks", "SHARDC_EMULATE_PROCESSES={text}: not a positive number"))?;
    // (`check_backend` has refused it outside an emulated GPU run.)
    if std::env::var_os("RANK").is_some() {
        return Err(miette!(help = "leave RANK and WORLD_SIZE unset", "SHARDC_EMULATE_PROCESSES={text}: emulated processes are threads of this process, not processes of a torchrun world"));
    }
    if processes != mesh.ranks() as usize {
        return Err(miette!(help = format!("set SHARDC_EMULATE_PROCESSES={}", mesh.ranks()), "SHARDC_EMULATE_PROCESSES={processes}: the mesh {mesh} has {} ranks, one per process", mesh.ranks()));
    }
    Ok(Some(processes))
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
pub(super) fn run_cuda(args: &RunArgs, spec: &Spec, mesh: shardc_ir::mesh::Mesh) -> Result<()> {
    use shardc_runtime::cuda::{self, Placement};
    let timeout = std::time::Duration::from_secs(args.timeout_seconds());
    if let Some(processes) = emulated_processes(mesh)? {
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
    let placement = if std::env::var_os("RANK").is_some() && emulating_the_gpu() {
        // An emulated device reaches no other process: a world of one runs on the emulated
        // communicator, a larger one as threads of one process.
        let world = std::env::var("WORLD_SIZE").ok().and_then(|w| w.trim().parse::<usize>().ok());
        let rank = std::env::var("RANK").unwrap_or_default();
        if world == Some(1) && rank.trim() != "0" {
            return Err(miette!(help = "a world of one process is rank 0", "RANK={rank} must be below WORLD_SIZE=1"));
        }
        if world != Some(1) {
            return Err(miette!(
                help = format!("run one process with SHARDC_EMULATE_PROCESSES={}: it runs the processes as threads, NCCL emulated between them", world.unwrap_or(2)),
                "RANK is set with SHARDC_GPU_EMULATE=1: an emulated device cannot reach the run's other processes"
            ));
        }
        Placement::EmulatedNccl(cuda::nccl::EmulatedWorld::world(1, timeout).into_iter().next().ok_or_else(|| miette!("no emulated process"))?)
    } else if std::env::var_os("RANK").is_some() {
        Placement::Nccl(cuda::nccl::Bootstrap::from_env().into_diagnostic()?.with_timeout(timeout))
    } else if emulating_the_gpu() {
        Placement::Emulated
    } else {
        Placement::SingleDevice { device: 0 }
    };
    // The tests' fault injection ends one rank's process; every rank on one device has none
    // of its own, and a fault set for one would be silently left out.
    if let (Some(fault), Placement::Emulated | Placement::SingleDevice { .. }) = (std::env::var("SHARDC_FAULT").ok(), &placement) {
        return Err(miette!(help = "unset SHARDC_FAULT, or run the ranks as processes (SHARDC_EMULATE_PROCESSES, or torchrun)", "SHARDC_FAULT={fault}: a fault is injected into one rank's process, and here every rank shares one"));
    }
    run_cuda_process(args, spec, mesh, placement)
}

/// Sets the emulated world's abort flag when dropped (unless disarmed: its flag taken).
#[cfg(feature = "cuda")]
pub(super) struct AbortOnDrop(Option<std::sync::Arc<std::sync::atomic::AtomicBool>>);

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
pub(super) fn run_cuda_process(args: &RunArgs, spec: &Spec, mesh: shardc_ir::mesh::Mesh, placement: shardc_runtime::cuda::Placement) -> Result<()> {
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
    // Every process, and every rank of one device, reads the checkpoint, `--load` file or
    // Hugging Face weights one tensor (or its shard) at a time: none holds the whole state.
    let mut trainer = match args.resume.as_ref() {
        Some(dir) => {
            let (folder, resumed) = checkpoints.resume_manifest(args, &programs, &mut corpus)?.unwrap_or_else(|| (dir.clone(), String::new()));
            let trainer = cuda::CudaTrainer::resume(&programs, &placement, &folder).into_diagnostic().wrap_err_with(|| format!("resuming from {}", dir.display()))?.0;
            if speaks && !resumed.is_empty() {
                println!("{resumed}");
            }
            trainer
        }
        // Of `--load` or Hugging Face weights it reads one tensor at a time (whole, in f64)
        // and keeps only its ranks' shards of it.
        None if args.load.is_some() => {
            let path = args.load.as_ref().expect("matched");
            let file = shardc_runtime::checkpoint::open_parameter_file(path, &programs).map_err(|e| miette!("--load {e}"))?;
            let mut parameter = |name: &str| file.read_f64(name);
            cuda::CudaTrainer::from_parameters(&programs, &placement, args.seed.unwrap_or(0), &mut parameter).map_err(|e| miette!("--load {e}"))?
        }
        None if args.step.hf_dir(args.spec.as_deref()).is_some() => {
            let hf = args.step.hf_dir(args.spec.as_deref()).expect("matched");
            let mut weights = crate::hf::LazyWeights::open(&hf, &args.step.load_spec(args.spec.as_deref())?)?;
            if speaks {
                let how = if process_rank.is_some() { " (each process reads its own shards)" } else { "" };
                println!("  weights     {} tensors from {}{how}", weights.len(), hf.display());
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
    // Evaluated on the devices, every process with its own shards.
    let evaluation = crate::data::Evaluation::on_devices(&args.input, &corpus)?;
    let schedule = programs[0].pipeline.as_ref().map_or_else(String::new, |p| format!(", {} schedule, {} micro-batches per step", p.kind.label(), p.microbatches));
    if speaks {
        println!("shardc: training {} on the GPU ({placement:?}), mesh {mesh}{schedule}, {} steps, seed {seed}", spec.name, args.steps);
        print_data(&corpus, evaluation.as_ref());
    }
    let tokens = rows * spec.seq_len() as usize;
    let (mut losses, mut seconds) = (LossSummary::default(), Vec::new());
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
            // A process of a world of one holds every rank: it writes them all.
            if trainer.process_rank().is_some() {
                checkpoints.save_own_shards(&mut trainer, corpus.record(at, rows))?;
            } else {
                checkpoints.save_every_rank(&trainer, corpus.record(at, rows))?;
            }
        }
        if let Some(evaluation) = evaluation.as_ref().filter(|e| e.due(at, end)) {
            let loss = trainer.evaluate(&corpus, evaluation.windows()).into_diagnostic().wrap_err_with(|| format!("evaluating after step {at}"))?;
            if speaks {
                crate::data::Evaluation::print(at, loss);
            }
        }
    }
    // Every process gives its peak; rank 0 says it.
    let memory = device_memory_line(&mut trainer, &programs, args.step.strategy.zero, &placement)?;
    // The processes of a multi-process run each hold their own shards: whole files are
    // written from their rank files.
    let rank_files = if (args.save.is_some() || args.save_hf.is_some()) && !trainer.holds_every_rank() { Some(checkpoints.rank_files_for_saving(args, &mut trainer)?) } else { None };
    if !speaks {
        return Ok(());
    }
    if let Some(first) = losses.first {
        let last = losses.tail.iter().sum::<f64>() / losses.tail.len() as f64;
        // The first step compiles and loads the kernels: it is not timed.
        let timed = &seconds[seconds.len().min(1)..];
        let per_step = if timed.is_empty() { seconds[0] } else { timed.iter().sum::<f64>() / timed.len() as f64 };
        println!("  device      {}", trainer.device_name());
        println!("  loss        {first:.4} at step {} -> {last:.4} (mean of the last {} steps), {}", first_step + 1, losses.tail.len(), super::loss_change(first, last));
        let which = if timed.is_empty() { "for the one step (which compiles and loads the kernels)" } else { "per step after the first" };
        println!("  time        {:.2} ms {which}, {:.0} tokens/s", 1e3 * per_step, tokens as f64 / per_step);
        println!("  memory      {memory}");
    }
    // Written a tensor at a time, from the device or from the rank files: the state is
    // never whole on the host.
    let save = || -> Result<()> {
        let reader = match &rank_files {
            Some((dir, _)) => Some(shardc_runtime::checkpoint::ShardReader::open(dir).into_diagnostic().wrap_err_with(|| format!("reading the rank files in {}", dir.display()))?),
            None => None,
        };
        let source: &dyn shardc_runtime::train::ParameterSource = match &reader {
            Some(reader) => reader,
            None => &trainer,
        };
        if let Some(dir) = &args.save_hf {
            crate::hf::save(dir, spec, source)?;
        }
        save_parameters(args, spec, Some(source))
    };
    let saved = save();
    // The rank files written for the files go, whether or not they were written.
    if let Some((dir, true)) = &rank_files {
        let _ = std::fs::remove_dir_all(dir);
    }
    saved?;
    Ok(())
}
