//! A training loop over a compiled `train_step` program: parameters initialised (or loaded),
//! optimizer state zeroed, one step per call on a batch from the corpus.

use std::collections::HashMap;

use crate::RuntimeError;
use crate::cpu::CpuExecutor;
use crate::data::Corpus;
use crate::init::init_binding;
use crate::program::{Program, Role};

/// Most optimizer steps a run may count to: the compiled step reads its counter as a 32-bit
/// integer (`step`, which AdamW's bias correction uses), so step 2^31 cannot be expressed.
pub const MAX_STEPS: u64 = i32::MAX as u64;

/// Drives `train_step` on the CPU.
#[derive(Debug)]
pub struct Trainer {
    exec: CpuExecutor,
    step: u64,
    seed: u64,
    rows: usize,
    seq: usize,
}

impl Trainer {
    /// Sets up `program` (a `train_step`): parameters from `seed`, state zero.
    pub fn new(program: Program, seed: u64, layers: usize) -> Result<Trainer, RuntimeError> {
        let tokens = program.arg("tokens").ok_or_else(|| RuntimeError::Binding("the program has no `tokens` input".into()))?;
        let shape = program.buffers[tokens.buffer].shape.clone();
        if shape.len() != 2 || program.arg("step").is_none() {
            return Err(RuntimeError::Binding("not a training step: expected tokens [batch, seq] and a step input".into()));
        }
        let params: Vec<(crate::program::Binding, Vec<usize>)> = program.args.iter().filter(|a| matches!(a.role, Some(Role::Param | Role::Master))).map(|a| (a.clone(), program.buffers[a.buffer].shape.clone())).collect();
        let mut exec = CpuExecutor::new(program)?;
        for (binding, shape) in params {
            write_f64(&mut exec, &binding.name, &init_binding(&binding, &shape, seed, layers))?;
        }
        Ok(Trainer { exec, step: 0, seed, rows: shape[0], seq: shape[1] })
    }

    /// Replaces parameters with `tensors` (`name -> (shape, values)`); every parameter must be
    /// present with its shape.
    pub fn load(&mut self, tensors: &std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>) -> Result<(), RuntimeError> {
        let params: Vec<(crate::program::Binding, Vec<usize>)> = self.param_bindings();
        for (binding, shape) in params {
            let name = &binding.name;
            let logical = binding.logical_shape(&shape);
            let (file_shape, values) = tensors.get(name).ok_or_else(|| RuntimeError::Binding(format!("the checkpoint has no tensor `{name}`")))?;
            if *file_shape != logical {
                return Err(RuntimeError::Binding(format!("checkpoint tensor `{name}` has shape {file_shape:?}, the model needs {logical:?}")));
            }
            let values: Vec<f64> = values.iter().map(|&v| v as f64).collect();
            write_f64(&mut self.exec, name, &binding.to_program(&values, &shape))?;
        }
        Ok(())
    }

    /// The parameter arguments with their shapes.
    fn param_bindings(&self) -> Vec<(crate::program::Binding, Vec<usize>)> {
        let program = self.exec.program();
        program.args.iter().filter(|a| a.role == Some(Role::Param)).map(|a| (a.clone(), program.buffers[a.buffer].shape.clone())).collect()
    }

    /// Every parameter as `(name, shape, f32 values)`.
    pub fn parameters(&self) -> Result<crate::checkpoint::NamedTensors, RuntimeError> {
        self.param_bindings()
            .into_iter()
            .map(|(binding, shape)| {
                let name = binding.name.clone();
                let values: Vec<f32> = self.exec.read_f64(&name)?.iter().map(|&v| v as f32).collect();
                // As the model has it: a padded vocabulary's real rows.
                Ok((name, binding.logical_shape(&shape), binding.from_program(&values, &shape)))
            })
            .collect()
    }

    /// Continues from a saved state: parameters and optimizer state replaced, the step
    /// counter set (the next step is `state.step + 1`).
    pub fn restore(&mut self, state: &TrainState) -> Result<(), RuntimeError> {
        let program = self.exec.program();
        let args: Vec<(crate::program::Binding, Vec<usize>)> = program.args.iter().filter(|a| a.role.is_some_and(Role::is_state)).map(|a| (a.clone(), program.buffers[a.buffer].shape.clone())).collect();
        for (binding, shape) in args {
            write_f64(&mut self.exec, &binding.name, &state.for_program(&binding, &shape)?)?;
        }
        self.step = state.step;
        Ok(())
    }

    /// Where this run stands: steps taken, parameters and optimizer state.
    pub fn state(&self) -> Result<TrainState, RuntimeError> {
        let values = read_state(&self.exec)?;
        let mesh = crate::collectives::MeshShape(vec![1]);
        TrainState::collect(std::slice::from_ref(self.exec.program()), &mesh, &[values], self.step)
    }

    /// Tokens per step.
    pub fn tokens_per_step(&self) -> usize {
        self.rows * self.seq
    }

    /// Runs one optimizer step on the next batch of `corpus`; returns its loss.
    pub fn step(&mut self, corpus: &Corpus) -> Result<f64, RuntimeError> {
        corpus.check_seq(self.seq)?;
        self.step += 1;
        let (tokens, targets) = corpus.batch(self.seed, self.step, self.rows);
        self.exec.write::<i32>("tokens", &tokens)?;
        self.exec.write::<i32>("targets", &targets)?;
        let step = i32::try_from(self.step).map_err(|_| RuntimeError::Binding("step counter overflow".into()))?;
        self.exec.write::<i32>("step", &[step])?;
        self.exec.run()?;
        self.exec.carry_state()?;
        Ok(self.exec.read_f64("loss")?[0])
    }

    /// The executor (program, memory, buffers).
    pub fn executor(&self) -> &CpuExecutor {
        &self.exec
    }

    /// The executor, to change how it runs (profiling).
    pub fn executor_mut(&mut self) -> &mut CpuExecutor {
        &mut self.exec
    }
}

/// Writes f64 values into an f32 or f64 argument.
pub(crate) fn write_f64(exec: &mut CpuExecutor, name: &str, values: &[f64]) -> Result<(), RuntimeError> {
    exec.write_f64(name, values)
}

/// A run's parameters, read one tensor at a time: what writing or evaluating a model needs,
/// so that neither holds the run's whole state at once. Each is global and as the model has
/// it (a padded vocabulary's real rows), and is the fp32 master where the run keeps one
/// (mixed precision: the bf16 parameter is that copy rounded).
pub trait ParameterSource {
    /// Every parameter's name and global shape.
    fn parameter_shapes(&self) -> Result<std::collections::BTreeMap<String, Vec<usize>>, RuntimeError>;

    /// Parameter `name`'s values.
    fn parameter_values(&self, name: &str) -> Result<Vec<f64>, RuntimeError>;
}

impl ParameterSource for TrainState {
    fn parameter_shapes(&self) -> Result<std::collections::BTreeMap<String, Vec<usize>>, RuntimeError> {
        Ok(self.tensors.iter().filter(|(name, _)| crate::program::state_of(name).is_none()).map(|(name, (shape, _))| (name.clone(), shape.clone())).collect())
    }

    fn parameter_values(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        self.parameter(name).map(|(_, values)| values.clone()).ok_or_else(|| RuntimeError::Binding(format!("the run's state has no parameter `{name}`")))
    }
}

/// Where a run stands: optimizer steps taken, and the global value of every parameter and
/// optimizer-state tensor (whatever mesh produced them). A run started from it continues as
/// if it had never stopped: batches are a function of (seed, step).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainState {
    /// Optimizer steps taken.
    pub step: u64,
    /// `name -> (global shape, values)`.
    pub tensors: std::collections::BTreeMap<String, (Vec<usize>, Vec<f64>)>,
}

impl TrainState {
    /// The global value of `name`, which must have `shape`.
    pub fn global(&self, name: &str, shape: &[usize]) -> Result<Vec<f64>, RuntimeError> {
        let (have, values) = self.tensors.get(name).ok_or_else(|| {
            RuntimeError::Binding(format!("the checkpoint has no `{name}`: it was saved from another model or with another optimizer"))
        })?;
        if have != shape {
            return Err(RuntimeError::Binding(format!("checkpoint tensor `{name}` has shape {have:?}, the model needs {shape:?}")));
        }
        Ok(values.clone())
    }

    /// The global value `binding` (global shape `shape`) takes in a program: the state's
    /// tensor, padded as the program pads it.
    pub fn for_program(&self, binding: &crate::program::Binding, shape: &[usize]) -> Result<Vec<f64>, RuntimeError> {
        let logical = binding.logical_shape(shape);
        // A run in mixed precision resumed from one without: the master starts as the
        // parameter. A parameter whose fp32 master the state holds (a mixed-precision run's)
        // takes the master: the full value, of which the bf16 parameter is the rounding.
        let master = crate::program::master_name(&binding.name);
        let name = match crate::program::master_of(&binding.name) {
            Some(param) if !self.tensors.contains_key(&binding.name) => param,
            None if binding.role == Some(Role::Param) && self.tensors.contains_key(&master) => &master,
            _ => &binding.name,
        };
        Ok(binding.to_program(&self.global(name, &logical)?, shape))
    }

    /// The value of parameter `name`: its fp32 master copy where the run keeps one (mixed
    /// precision: the bf16 parameter is that copy rounded), else the parameter.
    pub fn parameter(&self, name: &str) -> Option<&(Vec<usize>, Vec<f64>)> {
        self.tensors.get(&crate::program::master_name(name)).or_else(|| self.tensors.get(name))
    }

    /// A fresh run from given parameters (global, by name): step 0, optimizer state zero.
    pub fn from_parameters(params: std::collections::BTreeMap<String, (Vec<usize>, Vec<f64>)>, programs: &[Program]) -> TrainState {
        let mut tensors = params;
        for program in programs {
            for a in program.args.iter().filter(|a| matches!(a.role, Some(Role::OptState | Role::Master))) {
                let shape = a.logical_shape(&a.layout.as_ref().map_or_else(|| program.buffers[a.buffer].shape.clone(), |l| l.global_shape.clone()));
                let len = shape.iter().product();
                // A master copy starts as its parameter; moments start at zero.
                let initial = crate::program::master_of(&a.name).and_then(|p| tensors.get(p)).map(|(_, v)| v.clone()).unwrap_or_else(|| vec![0.0; len]);
                tensors.entry(a.name.clone()).or_insert((shape, initial));
            }
        }
        TrainState { step: 0, tensors }
    }

    /// Collects the state of every rank's program: each tensor assembled from the ranks that
    /// hold it (a mirrored tensor is taken from its first holder). `values[rank]` maps the
    /// rank's argument names to its local values; `programs[pp]` is the program of pipeline
    /// coordinate `pp` (one program: every rank's).
    pub fn collect(programs: &[Program], mesh: &crate::collectives::MeshShape, values: &[HashMap<String, Vec<f64>>], step: u64) -> Result<TrainState, RuntimeError> {
        let program_of = |rank: usize| if programs.len() == 1 { 0 } else { mesh.coords(rank).get(2).copied().unwrap_or(0) };
        let mut tensors = std::collections::BTreeMap::new();
        for (s, program) in programs.iter().enumerate() {
            for a in program.args.iter().filter(|a| a.role.is_some_and(Role::is_state)) {
                if tensors.contains_key(&a.name) {
                    continue;
                }
                let (global_shape, global) = match &a.layout {
                    Some(layout) => {
                        let shards: Vec<(usize, Vec<f64>)> = (0..mesh.ranks()).filter(|&r| program_of(r) == s).filter_map(|r| values[r].get(&a.name).map(|v| (r, v.clone()))).collect();
                        (layout.global_shape.clone(), crate::layout::assemble_some(&shards, layout, mesh))
                    }
                    None => (program.buffers[a.buffer].shape.clone(), values[0].get(&a.name).cloned().unwrap_or_default()),
                };
                // Outside programs a tensor has its unpadded shape.
                tensors.insert(a.name.clone(), (a.logical_shape(&global_shape), a.from_program(&global, &global_shape)));
            }
        }
        Ok(TrainState { step, tensors })
    }
}

/// Every parameter and optimizer-state argument of a rank, as f64.
pub(crate) fn read_state(exec: &CpuExecutor) -> Result<HashMap<String, Vec<f64>>, RuntimeError> {
    exec.program().args.iter().filter(|a| a.role.is_some_and(Role::is_state)).map(|a| Ok((a.name.clone(), read_f64(exec, &a.name)?))).collect()
}

/// What a multi-rank training run produced.
#[derive(Debug, Clone)]
pub struct SpmdRun {
    /// Loss of each step (every rank holds the same, reduced value).
    pub losses: Vec<f64>,
    /// Every parameter, reassembled from the ranks' shards: (name, global shape, values).
    pub parameters: Vec<(String, Vec<usize>, Vec<f64>)>,
    /// Bytes each rank sent, per kind of collective.
    pub bytes_sent: Vec<std::collections::BTreeMap<crate::collectives::CollectiveKind, u64>>,
    /// Where the run ended: every parameter and optimizer state, global.
    pub state: TrainState,
    /// Wall-clock seconds of each step on the slowest rank.
    pub step_seconds: Vec<f64>,
    /// Rank 0's seconds in each instruction over the steps after the first (the only one
    /// when there is one), when profiling ([`crate::cpu::profile_executors`]); empty
    /// otherwise.
    pub profile: Vec<f64>,
}

/// The global batch shape `(rows, seq)` of a partitioned program's `tokens` input, and its
/// layout.
fn batch_layout(program: &Program) -> Result<(usize, usize, crate::program::Layout), RuntimeError> {
    let tokens = program.arg("tokens").ok_or_else(|| RuntimeError::Binding("the program has no `tokens` input".into()))?;
    let layout = tokens.layout.clone().ok_or_else(|| RuntimeError::Binding("`tokens` has no layout: the program is not partitioned".into()))?;
    Ok((layout.global_shape[0], layout.global_shape[1], layout))
}

/// Runs `body` on every rank of the programs' mesh, one thread each (plus each rank's
/// communication thread): the rank at `pp` coordinate `s` runs `programs[s]` (one program:
/// every rank runs it). Before `body`, every parameter is initialised as the global tensor
/// from `seed` and the rank takes its shard, so runs are comparable with a single device.
/// Returns the results by rank.
/// The most ranks the CPU backend runs at once (a thread each).
pub const MAX_CPU_RANKS: usize = 1024;

pub(crate) fn on_every_rank_of<R: Send>(
    programs: &[Program],
    seed: u64,
    layers: usize,
    timeout: std::time::Duration,
    algorithm: crate::collectives::Algorithm,
    start: Option<&TrainState>,
    body: impl Fn(&mut CpuExecutor, &crate::collectives::MeshShape, usize) -> Result<R, RuntimeError> + Sync,
) -> Result<Vec<R>, RuntimeError> {
    use crate::collectives::{MeshShape, world};
    let first = programs.first().ok_or_else(|| RuntimeError::Program("no programs to run".into()))?;
    let mesh = MeshShape(if first.mesh.is_empty() { vec![1] } else { first.mesh.clone() });
    if mesh.ranks() > MAX_CPU_RANKS {
        return Err(RuntimeError::Program(format!(
            "a mesh of {} ranks: the CPU backend runs a thread per rank, at most {MAX_CPU_RANKS}; price larger meshes with `shardc compile` or `shardc plan`",
            mesh.ranks()
        )));
    }
    let comms = world(mesh.ranks(), timeout);
    // SPMD ranks do the same work at the same time: each computes on its own share of the
    // worker threads. Pipeline ranks take turns (one idles in the other's bubble): one pool
    // lets the busy rank use every core.
    let share = if programs.iter().any(|p| p.pipeline.is_some()) { 1 } else { mesh.ranks() };
    let results: Vec<Result<R, RuntimeError>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (mesh, body) = (&mesh, &body);
                s.spawn(move || {
                    let rank = comm.rank();
                    let abort = comm.abort_flag();
                    let run = || -> Result<R, RuntimeError> {
                        let program = match programs {
                            [only] => only,
                            _ => programs.get(mesh.coords(rank).get(2).copied().unwrap_or(0)).ok_or_else(|| RuntimeError::Program(format!("no program for rank {rank}")))?,
                        };
                        let mut exec = CpuExecutor::with_communicator(program.clone(), comm, algorithm)?;
                        for p in program.args.iter().filter(|a| a.role.is_some_and(Role::is_state)) {
                            let layout = p.layout.as_ref().ok_or_else(|| RuntimeError::Binding(format!("`{}` has no layout", p.name)))?;
                            let shard = match start {
                                Some(state) => crate::layout::local_shard(&state.for_program(p, &layout.global_shape)?, layout, mesh, rank),
                                // Each rank makes only its own shard, from global indices.
                                None if matches!(p.role, Some(Role::Param | Role::Master)) => crate::init::init_shard(p, &layout.global_shape, mesh, rank, seed, layers),
                                None => continue,
                            };
                            write_f64(&mut exec, &p.name, &shard)?;
                        }
                        body(&mut exec, mesh, rank)
                    };
                    // A failing or panicking rank stops the others at once (their waits see
                    // the abort flag) instead of after the timeout.
                    let caught = crate::cpu::with_worker_share(share, || std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)));
                    let result = match caught {
                        Ok(result) => result,
                        Err(panic) => {
                            let what = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "a panic".into());
                            Err(RuntimeError::Ranks(format!("panicked: {what}")))
                        }
                    };
                    if result.is_err() {
                        abort.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    result
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(RuntimeError::Program("a rank's thread failed".into())))).collect()
    });
    root_cause(results)
}

/// The results of every rank, or one error that puts the cause first: the rank that failed
/// (its instruction and why), then what the other ranks were waiting for when they stopped.
fn root_cause<R>(results: Vec<Result<R, RuntimeError>>) -> Result<Vec<R>, RuntimeError> {
    if results.iter().all(Result::is_ok) {
        return Ok(results.into_iter().filter_map(Result::ok).collect());
    }
    // Failures in order of how close they are to the cause: a rank's own error, then a rank
    // that waited in vain (a peer stopped answering), then ranks stopped because of others.
    let rank_of = |i: usize, e: &RuntimeError| {
        let text = e.to_string();
        let class = if text.contains("because another rank failed") || text.contains("was stopped") {
            2
        } else if text.contains("no message from rank") || text.contains(" left during ") {
            1
        } else {
            0
        };
        (class, i, text)
    };
    let mut failures: Vec<(u8, usize, String)> = results.iter().enumerate().filter_map(|(i, r)| r.as_ref().err().map(|e| rank_of(i, e))).collect();
    failures.sort();
    let (_, rank, cause) = &failures[0];
    let others: Vec<String> = failures[1..].iter().map(|(_, r, t)| format!("rank {r}: {t}")).collect();
    let mut message = format!("rank {rank} failed: {cause}");
    if !others.is_empty() {
        message.push_str(&format!("; then {}", others.join("; ")));
    }
    Err(RuntimeError::Ranks(message))
}

/// Writes this rank's shard of a global batch into `tokens` and `targets`.
fn write_batch(exec: &mut CpuExecutor, layout: &crate::program::Layout, mesh: &crate::collectives::MeshShape, rank: usize, tokens: &[i32], targets: &[i32]) -> Result<(), RuntimeError> {
    use crate::layout::local_shard;
    exec.write::<i32>("tokens", &local_shard(tokens, layout, mesh, rank))?;
    exec.write::<i32>("targets", &local_shard(targets, layout, mesh, rank))
}

/// Trains a partitioned `train_step` for `steps` steps, one thread per rank of its mesh.
/// Each step feeds every rank its shard of the same global batch, so the run is comparable
/// with a single-device run of the same seed.
pub fn train_spmd(program: &Program, seed: u64, layers: usize, corpus: &Corpus, steps: u64, timeout: std::time::Duration) -> Result<SpmdRun, RuntimeError> {
    train_spmd_with(program, seed, layers, corpus, steps, timeout, crate::collectives::Algorithm::Ring)
}

/// [`train_spmd`] with the all-reduce algorithm chosen.
pub fn train_spmd_with(
    program: &Program,
    seed: u64,
    layers: usize,
    corpus: &Corpus,
    steps: u64,
    timeout: std::time::Duration,
    algorithm: crate::collectives::Algorithm,
) -> Result<SpmdRun, RuntimeError> {
    train_spmd_from(program, seed, layers, corpus, steps, timeout, algorithm, None)
}

/// [`train_spmd_with`] from a saved state (`None`: from the seed's initial parameters):
/// runs steps `state.step + 1 ..= state.step + steps`.
#[allow(clippy::too_many_arguments)]
pub fn train_spmd_from(
    program: &Program,
    seed: u64,
    layers: usize,
    corpus: &Corpus,
    steps: u64,
    timeout: std::time::Duration,
    algorithm: crate::collectives::Algorithm,
    start: Option<&TrainState>,
) -> Result<SpmdRun, RuntimeError> {
    let (rows, seq, tokens) = batch_layout(program)?;
    corpus.check_seq(seq)?;
    let params: Vec<_> = program.args.iter().filter(|a| a.role == Some(Role::Param)).collect();
    let first = start.map_or(0, |s| s.step);
    let results = on_every_rank_of(std::slice::from_ref(program), seed, layers, timeout, algorithm, start, |exec, mesh, rank| {
        let (mut losses, mut step_seconds) = (Vec::new(), Vec::new());
        for step in first + 1..=first + steps {
            let began = std::time::Instant::now();
            let (t, g) = corpus.batch(seed, step, rows);
            write_batch(exec, &tokens, mesh, rank, &t, &g)?;
            exec.write::<i32>("step", &[i32::try_from(step).map_err(|_| RuntimeError::Binding("step counter overflow".into()))?])?;
            exec.run()?;
            exec.carry_state()?;
            let loss = read_f64(exec, "loss")?[0];
            if !loss.is_finite() {
                return Err(RuntimeError::NonFiniteLoss { step, loss });
            }
            losses.push(loss);
            step_seconds.push(began.elapsed().as_secs_f64());
            if step == first + 1 && steps > 1 {
                // The first step warms up (first touches of memory): profile the rest.
                exec.take_profile();
            }
        }
        let shards = params.iter().map(|p| read_f64(exec, &p.name)).collect::<Result<Vec<_>, _>>()?;
        Ok((losses, shards, exec.bytes_sent()?, read_state(exec)?, step_seconds, exec.take_profile()))
    })?;
    let mesh = crate::collectives::MeshShape(if program.mesh.is_empty() { vec![1] } else { program.mesh.clone() });
    let parameters = params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let layout = p.layout.as_ref().expect("every parameter was initialised from its layout");
            let shards: Vec<Vec<f64>> = results.iter().map(|r| r.1[i].clone()).collect();
            let global = crate::layout::assemble(&shards, layout, &mesh);
            (p.name.clone(), p.logical_shape(&layout.global_shape), p.from_program(&global, &layout.global_shape))
        })
        .collect();
    let values: Vec<HashMap<String, Vec<f64>>> = results.iter().map(|r| r.3.clone()).collect();
    let state = TrainState::collect(std::slice::from_ref(program), &mesh, &values, first + steps)?;
    let step_seconds = (0..steps as usize).map(|i| results.iter().filter_map(|r| r.4.get(i)).fold(0.0, |a: f64, &b| a.max(b))).collect();
    Ok(SpmdRun { losses: results[0].0.clone(), parameters, bytes_sent: results.iter().map(|r| r.2.clone()).collect(), state, step_seconds, profile: results[0].5.clone() })
}

/// Reads an f32 or f64 buffer as f64.
pub(crate) fn read_f64(exec: &CpuExecutor, name: &str) -> Result<Vec<f64>, RuntimeError> {
    exec.read_f64(name)
}

/// Runs a partitioned `gradients` function once on every rank of its mesh (parameters from
/// `seed`, the first batch of `corpus`) and returns rank 0's results by name: the loss and
/// every gradient, which the partitioner leaves replicated.
pub fn gradients_spmd(program: &Program, seed: u64, layers: usize, corpus: &Corpus, timeout: std::time::Duration) -> Result<Vec<(String, Vec<f64>)>, RuntimeError> {
    let (rows, seq, tokens) = batch_layout(program)?;
    corpus.check_seq(seq)?;
    let (t, g) = corpus.batch(seed, 1, rows);
    let mut results = on_every_rank_of(std::slice::from_ref(program), seed, layers, timeout, crate::collectives::Algorithm::Ring, None, |exec, mesh, rank| {
        write_batch(exec, &tokens, mesh, rank, &t, &g)?;
        exec.run()?;
        program.results.iter().map(|r| Ok((r.name.clone(), read_f64(exec, &r.name)?))).collect()
    })?;
    if results.is_empty() {
        return Err(RuntimeError::Program("the program's mesh has no ranks".into()));
    }
    Ok(results.swap_remove(0))
}

/// Runs a `logits` program (from `lower_logits`) with `params` (global tensors by name) on
/// `tokens` (the whole batch, row-major), on every rank of its mesh; returns the logits,
/// which every rank holds whole, of the real classes only (`classes` of each row: a padded
/// vocabulary's padded logits are dropped).
pub fn logits(program: &Program, params: &std::collections::BTreeMap<String, (Vec<usize>, Vec<f64>)>, tokens: &[i32], classes: usize) -> Result<Vec<f64>, RuntimeError> {
    // A padded vocabulary has rows beyond `classes`: an id there would read a zero row of
    // padding rather than fail, so ids are checked against the real vocabulary here.
    if let Some(&bad) = tokens.iter().find(|&&t| t < 0 || t as usize >= classes) {
        return Err(RuntimeError::Binding(format!("token id {bad} is outside the model's vocabulary of {classes}")));
    }
    let ranks: usize = program.mesh.iter().product::<usize>().max(1);
    let state = TrainState { step: 0, tensors: params.clone() };
    let row = program.result("logits").and_then(|r| program.buffers[r.buffer].shape.last().copied()).ok_or_else(|| RuntimeError::Binding("the program returns no `logits`".into()))?;
    let real = |values: Vec<f64>| -> Vec<f64> { values.chunks(row.max(1)).flat_map(|r| r[..classes.min(row)].to_vec()).collect() };
    if ranks == 1 {
        let params: Vec<(crate::program::Binding, Vec<usize>)> = program.args.iter().filter(|a| a.role == Some(Role::Param)).map(|a| (a.clone(), program.buffers[a.buffer].shape.clone())).collect();
        let mut exec = CpuExecutor::new(program.clone())?;
        for (binding, shape) in params {
            write_f64(&mut exec, &binding.name, &state.for_program(&binding, &shape)?)?;
        }
        exec.write::<i32>("tokens", tokens)?;
        exec.run()?;
        return Ok(real(read_f64(&exec, "logits")?));
    }
    let layout = program.arg("tokens").and_then(|t| t.layout.clone()).ok_or_else(|| RuntimeError::Binding("`tokens` has no layout".into()))?;
    let mut results = on_every_rank_of(std::slice::from_ref(program), 0, 1, std::time::Duration::from_secs(60), crate::collectives::Algorithm::Ring, Some(&state), |exec, mesh, rank| {
        exec.write::<i32>("tokens", &crate::layout::local_shard(tokens, &layout, mesh, rank))?;
        exec.run()?;
        read_f64(exec, "logits")
    })?;
    Ok(real(results.swap_remove(0)))
}
