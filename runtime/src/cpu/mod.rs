//! The CPU backend: executes a [`Program`] on this machine's cores.
//!
//! Storage is one typed vector per memory-plan slot. To run an instruction, its output slots
//! are moved out of the slot table (so they can be written while the inputs are borrowed from
//! the table), the kernel runs, and the outputs are put back. An in-place op's input slot is
//! then empty; its kernel reads the old value from the output instead.

mod comm;
mod gemm;
mod kernels;
#[cfg(feature = "cuda")]
pub(crate) use kernels::{gelu, gelu_derivative};
mod numerics;
mod storage;

use comm::*;
pub use numerics::{check_numerics, Fault, FaultKind};
use numerics::*;
pub use storage::{Element, Storage};
pub(crate) use storage::{In, Out};
pub use kernels::learning_rate;

/// The `xf` ops the CPU backend has kernels for (the rest of an op's facts live with it in
/// the IR's op registry; codegen's tests check the two cover the same ops).
pub fn kernel_ops() -> Vec<&'static str> {
    kernels::ops().collect()
}

use crate::collectives::{Algorithm, AsyncComm, Communicator, MeshShape, ReduceOp};
use crate::program::{Buffer, BufferId, Instr, Program, Role};
use crate::{DType, RuntimeError};
use shardc_ir::mesh::PP_AXIS;

/// What a kernel may need to know about its rank.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RankCx {
    /// For a vocab-split embedding: (first row this rank holds, rows in the whole table).
    pub rows: Option<(usize, usize)>,
    /// The position of this rank's first sequence row (context parallelism; 0 otherwise).
    pub seq_offset: usize,
    /// This rank's place among the ranks that split the sequence, and their count ((0, 1)
    /// when it is whole).
    pub seq_part: (usize, usize),
}

/// Runs one program on the CPU, keeping its arguments (parameters, optimizer state) between
/// runs. A partitioned program runs on one rank of its mesh, with a communicator.
#[derive(Debug)]
pub struct CpuExecutor {
    program: Program,
    slots: Vec<Storage>,
    comm: Option<AsyncComm>,
    mesh: MeshShape,
    algorithm: Algorithm,
    /// (step, micro-batch) of the work running now: pipeline sends and receives are paired
    /// by it and their transfer number.
    transfer_context: (u64, u64),
    /// Time spent waiting in pipeline receives since [`CpuExecutor::take_waited`].
    waited: std::time::Duration,
    /// All-reduces started ahead of their instruction ([`CpuExecutor::start_early`]): the
    /// instruction then only takes the result.
    early: std::collections::HashMap<usize, (u64, DType)>,
    /// Step buckets started ahead of their members: member -> bucket, and the buckets on
    /// the wire. The first member run lands the bucket; the others find it landed.
    /// Members of step buckets started early: instruction -> (bucket, its place in the bucket).
    early_buckets: std::collections::HashMap<usize, (i64, usize)>,
    early_flights: std::collections::HashMap<i64, comm::InFlight>,
    /// An injected fault (`SHARDC_FAULT`), for testing how a run ends when a rank fails.
    fault: Option<Fault>,
    /// The world's abort flag (set when any rank fails).
    abort: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Check every result for NaN/infinity ([`check_numerics`]).
    numerics: bool,
    /// Seconds spent in each instruction so far, when profiling ([`CpuExecutor::profile`]).
    profile: Option<Vec<f64>>,
}

/// Whether executors made from now on time every instruction ([`profile_executors`]).
static PROFILE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes every executor created afterwards time each instruction (read with
/// [`CpuExecutor::take_profile`]; multi-rank runs return rank 0's).
pub fn profile_executors(on: bool) {
    PROFILE.store(on, std::sync::atomic::Ordering::SeqCst);
}

/// Threads the CPU kernels share (rayon's pool): every rank's kernels run on these.
pub fn worker_threads() -> usize {
    rayon::current_num_threads()
}

/// Runs `work` with the kernels it starts on a pool of its own: one `ranks`-th of the worker
/// threads (at least one), as each of `ranks` ranks on this host computes. Ranks sharing one
/// pool would queue their short kernels behind each other's long ones and idle at every
/// collective; separate pools let the operating system share the cores between them.
pub fn with_worker_share<R: Send>(ranks: usize, work: impl FnOnce() -> R + Send) -> R {
    if ranks <= 1 {
        return work();
    }
    let threads = (worker_threads() / ranks).max(1);
    match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
        Ok(pool) => pool.install(work),
        // Without a pool of its own the rank shares the global one.
        Err(_) => work(),
    }
}


impl CpuExecutor {
    /// Validates `program` and allocates its slots, zero-filled.
    pub fn new(program: Program) -> Result<CpuExecutor, RuntimeError> {
        program.validate()?;
        for instr in &program.instrs {
            if !kernels::supported(&instr.op) && !COLLECTIVES.contains(&instr.op.as_str()) {
                return Err(RuntimeError::Program(format!("no CPU kernel for `{}` (at {})", instr.op, instr.loc)));
            }
        }
        // Memory the host cannot give (an absurd batch) is an error, not an abort: the
        // whole plan is reserved once first, then allocated zero-filled.
        let total = program.memory.slots.iter().fold(0usize, |sum, &(len, dtype)| sum.saturating_add(len.saturating_mul(dtype.bytes())));
        Vec::<u8>::new().try_reserve_exact(total).map_err(|_| {
            RuntimeError::Binding(format!("cannot allocate the program's {total} bytes of memory on this host (the memory plan of `{}`); use a smaller micro-batch or sequence", program.name))
        })?;
        let slots = program
            .memory
            .slots
            .iter()
            .map(|&(len, dtype)| match dtype {
                DType::F32 => Ok(Storage::F32(vec![0.0; len])),
                DType::F64 => Ok(Storage::F64(vec![0.0; len])),
                DType::I32 => Ok(Storage::I32(vec![0; len])),
                DType::Bf16 => Ok(Storage::Bf16(vec![half::bf16::ZERO; len])),
            })
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        let mesh = MeshShape(if program.mesh.is_empty() { vec![1] } else { program.mesh.clone() });
        let program_len = program.instrs.len();
        Ok(CpuExecutor {
            program,
            slots,
            comm: None,
            mesh,
            algorithm: Algorithm::Ring,
            transfer_context: (0, 0),
            waited: std::time::Duration::ZERO,
            early: Default::default(),
            early_buckets: Default::default(),
            early_flights: Default::default(),
            fault: None,
            abort: None,
            numerics: CHECK_NUMERICS.load(std::sync::atomic::Ordering::SeqCst),
            profile: PROFILE.load(std::sync::atomic::Ordering::SeqCst).then(|| vec![0.0; program_len]),
        })
    }

    /// Sets up a partitioned program on the rank `comm` belongs to.
    pub fn with_communicator(program: Program, comm: Communicator, algorithm: Algorithm) -> Result<CpuExecutor, RuntimeError> {
        let mut exec = CpuExecutor::new(program)?;
        if exec.mesh.ranks() != comm.size() {
            return Err(RuntimeError::Program(format!("the program's mesh {:?} has {} ranks, the world {}", exec.mesh.0, exec.mesh.ranks(), comm.size())));
        }
        exec.abort = Some(comm.abort_flag());
        exec.fault = Fault::from_env().filter(|f| f.rank == comm.rank());
        // Collectives run on the rank's communication thread, so a gradient bucket can be
        // on the wire while this thread computes.
        exec.comm = Some(AsyncComm::start(comm));
        exec.algorithm = algorithm;
        Ok(exec)
    }

    /// This executor's rank (0 without a communicator).
    pub fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, AsyncComm::rank)
    }

    /// Bytes this rank has sent so far, per kind of collective (empty on one rank).
    pub fn bytes_sent(&mut self) -> Result<std::collections::BTreeMap<crate::collectives::CollectiveKind, u64>, RuntimeError> {
        match &mut self.comm {
            Some(c) => c.bytes_sent().map_err(|e| RuntimeError::Program(e.to_string())),
            None => Ok(Default::default()),
        }
    }

    /// Starts timing every instruction (wall-clock seconds, waits included), or stops.
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(|| vec![0.0; self.program.instrs.len()]);
    }

    /// Seconds spent in each instruction since profiling started (empty when not profiling),
    /// and starts again from zero.
    pub fn take_profile(&mut self) -> Vec<f64> {
        match &mut self.profile {
            Some(p) => std::mem::replace(p, vec![0.0; p.len()]),
            None => Vec::new(),
        }
    }

    /// The program being run.
    pub fn program(&self) -> &Program {
        &self.program
    }

    fn binding(&self, name: &str) -> Result<&Buffer, RuntimeError> {
        let binding = self.program.arg(name).or_else(|| self.program.result(name)).ok_or_else(|| RuntimeError::Binding(format!("the program has no argument or result `{name}`")))?;
        Ok(&self.program.buffers[binding.buffer])
    }

    /// Writes an argument (or any named buffer).
    pub fn write<T: Element>(&mut self, name: &str, data: &[T]) -> Result<(), RuntimeError> {
        let buffer = self.binding(name)?.clone();
        if buffer.len() != data.len() || buffer.dtype != T::DTYPE {
            return Err(RuntimeError::Binding(format!("`{name}` takes {} {:?} elements (shape {:?}), got {} {:?}", buffer.len(), buffer.dtype, buffer.shape, data.len(), T::DTYPE)));
        }
        let slot = T::slice_mut(&mut self.slots[buffer.slot]).ok_or_else(|| RuntimeError::Binding(format!("`{name}` has no storage")))?;
        slot[..data.len()].copy_from_slice(data);
        Ok(())
    }

    /// Writes an argument of any float type from f64 values (rounded to its type).
    pub fn write_f64(&mut self, name: &str, data: &[f64]) -> Result<(), RuntimeError> {
        let buffer = self.binding(name)?.clone();
        if buffer.len() != data.len() {
            return Err(RuntimeError::Binding(format!("`{name}` takes {} elements (shape {:?}), got {}", buffer.len(), buffer.shape, data.len())));
        }
        if self.slots[buffer.slot].set_f64(data) { Ok(()) } else { Err(RuntimeError::Binding(format!("`{name}` is {:?}, not a float", buffer.dtype))) }
    }

    /// Reads a float result or argument of any float type as f64.
    pub fn read_f64(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        let buffer = self.binding(name)?;
        self.slots[buffer.slot].to_f64(buffer.len()).ok_or_else(|| RuntimeError::Binding(format!("`{name}` is {:?}, not a float", buffer.dtype)))
    }

    /// Reads a result or argument.
    pub fn read<T: Element>(&self, name: &str) -> Result<&[T], RuntimeError> {
        let buffer = self.binding(name)?;
        T::slice(&self.slots[buffer.slot]).map(|s| &s[..buffer.len()]).ok_or_else(|| RuntimeError::Binding(format!("`{name}` is {:?}, not {:?}", buffer.dtype, T::DTYPE)))
    }

    /// Names and shapes of the arguments with `role`.
    pub fn args_with(&self, role: Role) -> Vec<(String, Vec<usize>)> {
        self.program.args.iter().filter(|a| a.role == Some(role)).map(|a| (a.name.clone(), self.program.buffers[a.buffer].shape.clone())).collect()
    }

    /// Copies every result that is the new value of an argument (same name) into that
    /// argument when they live in different buffers, so the next run reads the new state.
    /// (Usually the update happened in place and there is nothing to copy; a sharded update
    /// that is gathered back returns a fresh buffer.)
    pub fn carry_state(&mut self) -> Result<(), RuntimeError> {
        let pairs: Vec<(usize, usize)> = self.program.results.iter().filter_map(|r| self.program.arg(&r.name).map(|a| (r.buffer, a.buffer))).filter(|(r, a)| r != a).collect();
        for (from, to) in pairs {
            let (from, to) = (&self.program.buffers[from], &self.program.buffers[to]);
            if from.slot == to.slot {
                continue;
            }
            let len = from.len().min(to.len());
            // Taken out for the copy (not cloned: the slot may hold a whole gathered tensor).
            let source = std::mem::take(&mut self.slots[from.slot]);
            match (&source, &mut self.slots[to.slot]) {
                (Storage::F32(s), Storage::F32(d)) => d[..len].copy_from_slice(&s[..len]),
                (Storage::F64(s), Storage::F64(d)) => d[..len].copy_from_slice(&s[..len]),
                (Storage::I32(s), Storage::I32(d)) => d[..len].copy_from_slice(&s[..len]),
                (Storage::Bf16(s), Storage::Bf16(d)) => d[..len].copy_from_slice(&s[..len]),
                _ => {
                    self.slots[from.slot] = source;
                    return Err(RuntimeError::Binding(format!("result `{}` and its argument differ in type", from.name)));
                }
            };
            self.slots[from.slot] = source;
        }
        Ok(())
    }

    /// Sets the (step, micro-batch) that pipeline sends and receives of the next instructions
    /// belong to.
    pub fn set_transfer_context(&mut self, step: u64, microbatch: u64) {
        self.transfer_context = (step, microbatch);
    }

    /// Time spent waiting in pipeline receives since the last call.
    pub fn take_waited(&mut self) -> std::time::Duration {
        std::mem::take(&mut self.waited)
    }

    /// Copies of the values of `buffers`.
    pub fn save(&self, buffers: &[BufferId]) -> Vec<Storage> {
        self.save_into(buffers, Vec::new())
    }

    /// Copies of the values of `buffers`, written into `spare` (storage an earlier save
    /// returned, no longer needed) where it has room: a pipeline saves the same buffers for
    /// every micro-batch, and reusing their storage spares the host fresh pages each time.
    pub fn save_into(&self, buffers: &[BufferId], mut spare: Vec<Storage>) -> Vec<Storage> {
        spare.resize_with(buffers.len(), Storage::default);
        for (&b, out) in buffers.iter().zip(spare.iter_mut()) {
            let buffer = &self.program.buffers[b];
            fn copy<T: Copy>(source: &[T], out: &mut Storage, wrap: fn(Vec<T>) -> Storage, get: fn(&mut Storage) -> Option<&mut Vec<T>>) {
                match get(out) {
                    Some(v) => {
                        v.clear();
                        v.extend_from_slice(source);
                    }
                    None => *out = wrap(source.to_vec()),
                }
            }
            let len = buffer.len();
            match &self.slots[buffer.slot] {
                Storage::F32(v) => copy(&v[..len], out, Storage::F32, |s| if let Storage::F32(v) = s { Some(v) } else { None }),
                Storage::F64(v) => copy(&v[..len], out, Storage::F64, |s| if let Storage::F64(v) = s { Some(v) } else { None }),
                Storage::I32(v) => copy(&v[..len], out, Storage::I32, |s| if let Storage::I32(v) = s { Some(v) } else { None }),
                Storage::Bf16(v) => copy(&v[..len], out, Storage::Bf16, |s| if let Storage::Bf16(v) = s { Some(v) } else { None }),
                Storage::Empty => *out = Storage::Empty,
            }
        }
        spare
    }

    /// Writes values [`CpuExecutor::save`]d from `buffers` back into them.
    pub fn restore(&mut self, buffers: &[BufferId], values: &[Storage]) -> Result<(), RuntimeError> {
        for (&b, value) in buffers.iter().zip(values) {
            let slot = self.program.buffers[b].slot;
            match (value, &mut self.slots[slot]) {
                (Storage::F32(s), Storage::F32(d)) => d[..s.len()].copy_from_slice(s),
                (Storage::F64(s), Storage::F64(d)) => d[..s.len()].copy_from_slice(s),
                (Storage::I32(s), Storage::I32(d)) => d[..s.len()].copy_from_slice(s),
                (Storage::Bf16(s), Storage::Bf16(d)) => d[..s.len()].copy_from_slice(s),
                _ => {
                    return Err(RuntimeError::Binding(format!("`{}`: restored value of another type", self.program.buffers[b].name)));
                }
            }
        }
        Ok(())
    }

    /// Adds the values of `buffers` into `sums`; with `first`, starts them (reusing the
    /// storage of the last step's sums).
    pub fn accumulate(&self, buffers: &[BufferId], sums: &mut Vec<Storage>, first: bool) -> Result<(), RuntimeError> {
        if first || sums.is_empty() {
            *sums = self.save_into(buffers, std::mem::take(sums));
            return Ok(());
        }
        for (&b, sum) in buffers.iter().zip(sums.iter_mut()) {
            let buffer = &self.program.buffers[b];
            match (sum, &self.slots[buffer.slot]) {
                (Storage::F32(d), Storage::F32(s)) => d.iter_mut().zip(s.iter()).for_each(|(d, s)| *d += s),
                (Storage::F64(d), Storage::F64(s)) => d.iter_mut().zip(s.iter()).for_each(|(d, s)| *d += s),
                // Summed in f32, rounded once per addition (mixed precision sums gradients in
                // f32 buffers; this serves a bf16 value read across micro-batches).
                (Storage::Bf16(d), Storage::Bf16(s)) => d.iter_mut().zip(s.iter()).for_each(|(d, s)| *d = half::bf16::from_f32(d.to_f32() + s.to_f32())),
                _ => {
                    return Err(RuntimeError::Binding(format!("`{}`: only float values are summed over micro-batches", buffer.name)));
                }
            }
        }
        Ok(())
    }

    /// Starts the all-reduces and reduce-scatters `indices` (a chunk's `early_syncs`, which codegen chose and
    /// [`Program::validate`] checked: no earlier instruction of their section writes their
    /// input) on the communication thread now, with the inputs' current values; the
    /// instructions, when run, wait for them instead. Returns how many started. This is how a
    /// pipeline rank overlaps its data-parallel gradient sync with the backward work it still
    /// has to do.
    ///
    /// A step bucket (a region of the memory plan) whose members are all among `indices`
    /// goes out as one all-reduce over its members' inputs, concatenated (or, of ZeRO's
    /// reduce-scatters, as its members one after another), and counts once.
    pub fn start_early(&mut self, indices: &[usize], ready: &[BufferId]) -> Result<usize, RuntimeError> {
        let CpuExecutor { program, slots, comm, mesh, algorithm, early, early_buckets, early_flights, .. } = self;
        let Some(comm) = comm.as_mut() else { return Ok(0) };
        let rank = comm.rank();
        let mut started = 0;
        let mut bucketed = std::collections::HashSet::new();
        if program.pipeline.is_some() && !program.memory.buckets.is_empty() {
            let (wanted, ready): (std::collections::HashSet<usize>, std::collections::HashSet<BufferId>) = (indices.iter().copied().collect(), ready.iter().copied().collect());
            for region in &program.memory.buckets {
                let members = &region.members;
                if !members.iter().all(|m| wanted.contains(m) && program.instrs.get(*m).is_some_and(|i| ready.contains(&i.inputs[0]))) || early_flights.contains_key(&region.bucket) {
                    continue;
                }
                let flight = comm::send_bucket_of_inputs(members, program, slots, comm, mesh, rank, *algorithm).map_err(RuntimeError::Program)?;
                early_flights.insert(region.bucket, flight);
                early_buckets.extend(members.iter().enumerate().map(|(k, &m)| (m, (region.bucket, k))));
                bucketed.extend(members.iter().copied());
                started += 1;
            }
        }
        for &index in indices.iter().filter(|i| !bucketed.contains(*i)) {
            let instr = program.instrs.get(index).ok_or_else(|| RuntimeError::Program(format!("early sync {index} is out of range")))?;
            // A reduce-scatter (ZeRO's gradient shard) outside a bucket: as a group of one,
            // under a key no bucket has (buckets count from 0).
            if instr.op == "shard.reduce_scatter" && ready.contains(&instr.inputs[0]) {
                let key = -1 - index as i64;
                if early_flights.contains_key(&key) {
                    continue;
                }
                let flight = comm::send_bucket_of_inputs(&[index], program, slots, comm, mesh, rank, *algorithm).map_err(RuntimeError::Program)?;
                early_flights.insert(key, flight);
                early_buckets.insert(index, (key, 0));
                started += 1;
                continue;
            }
            let sum = !matches!(instr.attrs.get("reduction"), Some(crate::program::Attr::Str(k)) if k != "sum");
            if instr.op != "shard.all_reduce" || !sum || instr.bool("xf.async").unwrap_or(false) || !ready.contains(&instr.inputs[0]) || early.contains_key(&index) {
                continue;
            }
            let axes: Vec<usize> = instr.ints("grid_axes").map_err(RuntimeError::Program)?.iter().map(|&a| a as usize).collect();
            let group = mesh.group(rank, &axes);
            let buffer = &program.buffers[instr.inputs[0]];
            let algorithm = *algorithm;
            let ticket = match (&slots[buffer.slot], buffer.dtype) {
                (Storage::F64(v), DType::F64) => {
                    let mut data = crate::collectives::pool::filled(&v[..buffer.len()]);
                    comm.submit(move |c: &mut Communicator| c.all_reduce(&group, &mut data, ReduceOp::Sum, algorithm).map(|()| data))
                }
                (Storage::F32(v), DType::F32) => {
                    let mut data = crate::collectives::pool::filled(&v[..buffer.len()]);
                    comm.submit(move |c: &mut Communicator| c.all_reduce(&group, &mut data, ReduceOp::Sum, algorithm).map(|()| data))
                }
                (Storage::Bf16(v), DType::Bf16) => {
                    let mut data = crate::collectives::pool::filled(&v[..buffer.len()]);
                    comm.submit(move |c: &mut Communicator| c.all_reduce(&group, &mut data, ReduceOp::Sum, algorithm).map(|()| data))
                }
                _ => continue,
            };
            early.insert(index, (ticket, buffer.dtype));
            started += 1;
        }
        Ok(started)
    }

    /// Runs every instruction once.
    pub fn run(&mut self) -> Result<(), RuntimeError> {
        self.run_range(0..self.program.instrs.len())
    }

    /// Runs the instructions of `range` (one section of a pipeline stage) once.
    pub fn run_range(&mut self, range: std::ops::Range<usize>) -> Result<(), RuntimeError> {
        self.run_list(&range.collect::<Vec<_>>())
    }

    /// Runs `instructions` once, in that order (a pipeline rank's step sections, merged in
    /// the training step's order): an asynchronous bucket goes out at its last member and
    /// lands at its wait, both among them.
    pub fn run_list(&mut self, instructions: &[usize]) -> Result<(), RuntimeError> {
        let CpuExecutor { program, slots, comm, mesh, algorithm, transfer_context, waited, early, early_buckets, early_flights, fault, abort, numerics, profile } = self;
        let rank = comm.as_ref().map_or(0, AsyncComm::rank);
        // Gradient buckets: members staged so far, and buckets on the wire.
        let mut waiting: std::collections::HashMap<i64, Vec<usize>> = std::collections::HashMap::new();
        let mut in_flight: std::collections::HashMap<i64, InFlight> = std::collections::HashMap::new();
        // Step buckets started early and received, for their members to take their values.
        let mut landed: std::collections::HashMap<i64, comm::Landed> = std::collections::HashMap::new();
        // When profiling: the instruction running and since when.
        let mut running: Option<(usize, std::time::Instant)> = None;
        let mut clock = |index: Option<usize>, profile: &mut Option<Vec<f64>>| {
            let Some(times) = profile.as_mut() else { return };
            let now = std::time::Instant::now();
            if let Some((i, began)) = running {
                times[i] += (now - began).as_secs_f64();
            }
            running = index.map(|i| (i, now));
        };
        for &index in instructions {
            let instr = program.instrs.get(index).ok_or_else(|| RuntimeError::Program(format!("instruction {index} is out of range")))?;
            clock(Some(index), profile);
            if let Some(f) = fault.filter(|f| f.instruction == index) {
                let instr = &program.instrs[f.instruction];
                let at = format!("instruction {} (`{}` at {})", f.instruction, instr.op, instr.loc);
                let fail = |message: String| RuntimeError::Kernel { index: f.instruction, op: instr.op.clone(), loc: instr.loc.clone(), message };
                match f.kind {
                    FaultKind::Panic => panic!("injected fault: rank {rank} panics at {at}"),
                    FaultKind::Kernel => return Err(fail("injected kernel failure (SHARDC_FAULT)".into())),
                    FaultKind::Hang => {
                        // Silent until the others give up on this rank and set the abort flag.
                        while !abort.as_ref().is_some_and(|a| a.load(std::sync::atomic::Ordering::SeqCst)) {
                            std::thread::sleep(std::time::Duration::from_millis(10));
                        }
                        return Err(fail("hung (injected) and was stopped once the other ranks gave up on it".into()));
                    }
                }
            }
            // A member of a step bucket started early: the first receives the whole bucket,
            // each takes its own values where it runs.
            if let Some((bucket, position)) = early_buckets.remove(&index) {
                let fail = |message: String| RuntimeError::Kernel { index, op: instr.op.clone(), loc: instr.loc.clone(), message };
                if let Some(flight) = early_flights.remove(&bucket) {
                    let comm = comm.as_mut().ok_or_else(|| RuntimeError::Program("an early bucket without a communicator".into()))?;
                    landed.insert(bucket, flight.receive(comm).map_err(fail)?);
                }
                landed.get(&bucket).ok_or_else(|| fail("its bucket was received by no member".into()))?.put(position, slots).map_err(fail)?;
                continue;
            }
            // Started early: take the result.
            if let Some((ticket, dtype)) = early.remove(&index) {
                let comm = comm.as_mut().ok_or_else(|| RuntimeError::Program("an early all-reduce without a communicator".into()))?;
                let out = &program.buffers[instr.outputs[0]];
                let fail = |e: String| RuntimeError::Kernel { index, op: instr.op.clone(), loc: instr.loc.clone(), message: e };
                match dtype {
                    DType::F64 => {
                        let data: Vec<f64> = comm.wait(ticket).map_err(|e| fail(e.to_string()))?;
                        f64::slice_mut(&mut slots[out.slot]).ok_or_else(|| fail("output is not f64".into()))?[..data.len()].copy_from_slice(&data);
                        crate::collectives::pool::recycle(data);
                    }
                    DType::Bf16 => {
                        let data: Vec<half::bf16> = comm.wait(ticket).map_err(|e| fail(e.to_string()))?;
                        half::bf16::slice_mut(&mut slots[out.slot]).ok_or_else(|| fail("output is not bf16".into()))?[..data.len()].copy_from_slice(&data);
                        crate::collectives::pool::recycle(data);
                    }
                    _ => {
                        let data: Vec<f32> = comm.wait(ticket).map_err(|e| fail(e.to_string()))?;
                        f32::slice_mut(&mut slots[out.slot]).ok_or_else(|| fail("output is not f32".into()))?[..data.len()].copy_from_slice(&data);
                        crate::collectives::pool::recycle(data);
                    }
                }
                continue;
            }
            // A wait for a bucket on the wire: take its result back into its members' slots.
            if instr.op == "xf.wait" {
                if let Some(flight) = instr.int("xf.bucket").ok().and_then(|b| in_flight.remove(&b)) {
                    let comm = comm.as_mut().ok_or_else(|| RuntimeError::Program("a bucket without a communicator".into()))?;
                    flight.land(comm, slots).map_err(|message| RuntimeError::Kernel { index, op: instr.op.clone(), loc: instr.loc.clone(), message })?;
                }
            }
            let cx = rank_cx(instr, program, mesh, rank).map_err(|message| RuntimeError::Kernel { index, op: instr.op.clone(), loc: instr.loc.clone(), message })?;
            let mut taken: Vec<(usize, Storage)> = instr
                .outputs
                .iter()
                .map(|&b| {
                    let slot = program.buffers[b].slot;
                    (slot, std::mem::take(&mut slots[slot]))
                })
                .collect();
            let result = {
                let ins: Vec<In<'_>> = instr.inputs.iter().map(|&b| In { buffer: &program.buffers[b], storage: &slots[program.buffers[b].slot] }).collect();
                let mut outs: Vec<Out<'_>> = taken.iter_mut().zip(&instr.outputs).map(|((_, storage), &b)| Out { buffer: &program.buffers[b], storage }).collect();
                if COLLECTIVES.contains(&instr.op.as_str()) {
                    let began = std::time::Instant::now();
                    let result = collective(instr, &ins, &mut outs, comm.as_mut(), mesh, rank, *algorithm, *transfer_context);
                    if instr.op == "shard.recv" {
                        *waited += began.elapsed();
                    }
                    result
                } else if ins.iter().map(|i| i.buffer).chain(outs.iter().map(|o| &*o.buffer)).any(|b| b.dtype == DType::Bf16) {
                    run_widened(instr, &ins, &mut outs, &cx)
                } else {
                    kernels::run(instr, &ins, &mut outs, &cx)
                }
            };
            // Put the outputs back before reporting any error: the arguments (parameters)
            // stay intact and readable.
            for (slot, storage) in taken {
                slots[slot] = storage;
            }
            result.map_err(|message| RuntimeError::Kernel { index, op: instr.op.clone(), loc: instr.loc.clone(), message })?;
            if *numerics {
                for &out in &instr.outputs {
                    let buffer = &program.buffers[out];
                    if let Some((at, value)) = first_non_finite(&slots[buffer.slot], buffer.len()) {
                        return Err(RuntimeError::Kernel {
                            index,
                            op: instr.op.clone(),
                            loc: instr.loc.clone(),
                            message: format!("produced {value} at element {at} of `{}` (shape {:?}): the first non-finite value of the step", buffer.name, buffer.shape),
                        });
                    }
                }
            }
            // An async member of a gradient bucket was only staged; the bucket goes out as
            // one all-reduce as soon as its last member is ready.
            if let (Ok(bucket), Ok(members)) = (instr.int("xf.bucket"), instr.int("xf.bucket_members")) {
                let staged = waiting.entry(bucket).or_default();
                staged.push(index);
                if staged.len() as i64 == members {
                    let staged = waiting.remove(&bucket).unwrap_or_default();
                    let flight = send_bucket(&staged, program, slots, comm.as_mut(), mesh, rank, *algorithm).map_err(|message| RuntimeError::Kernel {
                        index,
                        op: instr.op.clone(),
                        loc: instr.loc.clone(),
                        message,
                    })?;
                    in_flight.insert(bucket, flight);
                }
            }
        }
        clock(None, profile);
        if let Some(bucket) = waiting.keys().chain(in_flight.keys()).next() {
            return Err(RuntimeError::Program(format!("gradient bucket {bucket} was never completed and waited for")));
        }
        Ok(())
    }
}

/// Bytes of working memory instruction `instr` of `program` takes on the CPU backend while it
/// runs: its kernel's own, and the f32 copies of the bf16 slots it reads or writes
/// ([`run_widened`]).
pub(crate) fn scratch_bytes(program: &Program, instr: &Instr) -> usize {
    if COLLECTIVES.contains(&instr.op.as_str()) {
        return 0;
    }
    let bf16 = instr.inputs.iter().chain(&instr.outputs).filter_map(|&b| program.buffers.get(b)).filter(|b| b.dtype == DType::Bf16);
    let widened = bf16.map(|b| program.memory.slots.get(b.slot).map_or(b.len(), |&(len, _)| len).saturating_mul(4)).fold(0usize, usize::saturating_add);
    widened.saturating_add(kernels::scratch_bytes(program, instr))
}

/// Runs a kernel that reads or writes bf16 buffers as the f32 kernel: bf16 operands are
/// widened to f32 (exactly), the kernel computes in f32, and bf16 results are rounded to the
/// nearest even bf16 once, as an accelerator with bf16 storage and f32 arithmetic does.
fn run_widened(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    let wide = |b: &Buffer| if b.dtype == DType::Bf16 { Buffer { dtype: DType::F32, ..b.clone() } } else { b.clone() };
    let in_buffers: Vec<Buffer> = ins.iter().map(|i| wide(i.buffer)).collect();
    let in_storage: Vec<Option<Storage>> = ins.iter().map(|i| i.storage.widened()).collect();
    let out_buffers: Vec<Buffer> = outs.iter().map(|o| wide(o.buffer)).collect();
    let mut out_storage: Vec<Option<Storage>> = outs.iter().map(|o| o.storage.widened()).collect();
    {
        let wide_ins: Vec<In<'_>> = ins.iter().enumerate().map(|(k, i)| In { buffer: &in_buffers[k], storage: in_storage[k].as_ref().unwrap_or(i.storage) }).collect();
        let mut narrow_slots: Vec<&mut Storage> = outs.iter_mut().map(|o| &mut *o.storage).collect();
        let mut wide_outs: Vec<Out<'_>> = Vec::with_capacity(out_buffers.len());
        for ((buffer, widened), slot) in out_buffers.iter().zip(out_storage.iter_mut()).zip(narrow_slots.iter_mut()) {
            let storage: &mut Storage = match widened {
                Some(s) => s,
                None => slot,
            };
            wide_outs.push(Out { buffer, storage });
        }
        kernels::run(instr, &wide_ins, &mut wide_outs, cx)?;
    }
    for (out, widened) in outs.iter_mut().zip(out_storage) {
        if let (Some(Storage::F32(values)), Storage::Bf16(slot)) = (widened, &mut *out.storage) {
            slot.iter_mut().zip(values).for_each(|(d, s)| *d = half::bf16::from_f32(s));
        }
    }
    Ok(())
}

/// The rank facts an instruction's kernel needs.
fn rank_cx(instr: &Instr, program: &Program, mesh: &MeshShape, rank: usize) -> Result<RankCx, String> {
    Ok(RankCx { rows: split_rows(instr, program, mesh, rank), seq_offset: seq_offset(instr, program, mesh, rank), seq_part: seq_part(instr, mesh, rank) })
}

/// This rank's place in the group over an instruction's `xf.seq_split_axes`, and its size.
pub fn seq_part(instr: &Instr, mesh: &MeshShape, rank: usize) -> (usize, usize) {
    let Ok(axes) = instr.ints("xf.seq_split_axes") else { return (0, 1) };
    let axes: Vec<usize> = axes.iter().map(|&a| a as usize).collect();
    let group = mesh.group(rank, &axes);
    (group.iter().position(|&r| r == rank).unwrap_or(0), group.len().max(1))
}

/// The part of the sequence whose keys and values a ring-attention step (`xf.ring_step` t)
/// holds, of a rank whose queries are part `p` of `n`: `(p - t) mod n`, the blocks having
/// gone t places on round the ring.
pub fn ring_source(instr: &Instr, (part, parts): (usize, usize)) -> Result<usize, String> {
    let step = usize::try_from(instr.int(shardc_ir::ops::RING_STEP_ATTR)?).map_err(|_| format!("`{}` has a negative ring step", instr.loc))?;
    Ok((part + parts - step % parts) % parts)
}

/// The sequence row of the first key a ring-attention step holds: its source part's first
/// row (its key block, dimension 1 of operand 1, being one part).
pub fn ring_key_offset(instr: &Instr, program: &Program, mesh: &MeshShape, rank: usize) -> Result<usize, String> {
    let keys = instr.inputs.get(1).and_then(|&k| program.buffers[k].shape.get(1).copied()).ok_or_else(|| format!("`{}` has no key block", instr.op))?;
    Ok(ring_source(instr, seq_part(instr, mesh, rank))? * keys)
}

/// For an op that reads sequence positions split over its `xf.seq_split_axes` (see
/// `OpDef::position_factor`): the position of this rank's first row, its place in the group
/// times the rows of its part (dimension 1 of its first operand, `[batch, seq, heads * head_dim]`).
pub fn seq_offset(instr: &Instr, program: &Program, mesh: &MeshShape, rank: usize) -> usize {
    let Some(&first) = instr.inputs.first() else { return 0 };
    match seq_part(instr, mesh, rank).0 {
        0 => 0,
        part => part * program.buffers[first].shape.get(1).copied().unwrap_or(0),
    }
}

/// For a table split along its rows (the embedding's operand, or its gradient's result) or
/// logits along their last dimension (vocab-parallel cross-entropy): this rank's first index
/// and the whole extent. Every backend reads it the same way.
pub fn split_rows(instr: &Instr, program: &Program, mesh: &MeshShape, rank: usize) -> Option<(usize, usize)> {
    let mut found = None;
    for (attr, last_dim) in [("xf.row_split_axes", false), ("xf.vocab_split_axes", true)] {
        if let Ok(axes) = instr.ints(attr) {
            let axes: Vec<usize> = axes.iter().map(|&a| a as usize).collect();
            let group = mesh.group(rank, &axes);
            let position = group.iter().position(|&r| r == rank).unwrap_or(0);
            // The gradient of a lookup makes the table its first operand is for the lookup.
            let table = if instr.op == "xf.embedding_grad" { instr.outputs.first() } else { instr.inputs.first() };
            let Some(&table) = table else { continue };
            let shape = &program.buffers[table].shape;
            let rows = if last_dim { *shape.last().unwrap_or(&1) } else { shape[0] };
            found = Some((position * rows, rows * group.len()));
        }
    }
    found
}
