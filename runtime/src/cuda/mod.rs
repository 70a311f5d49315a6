//! The CUDA backend (cargo feature `cuda`): runs a rank program's device plan
//! ([`crate::program::DevicePlan`]) on an NVIDIA GPU.
//!
//! The module is compiled by NVRTC to the GPU's machine code when the program is loaded
//! (kept in a cache on disk: [`compile`]); matrix products go to cuBLAS
//! (fp32 accumulation); collectives run either among ranks that share one GPU (the
//! single-device mode for development: every rank of a small mesh has its own memory on one
//! card, and collectives are device copies and sums in a fixed order), or over NCCL with one
//! process per GPU ([`nccl`]). cudarc loads every library when first used, so this builds on
//! machines without CUDA; [`check_available`] looks for the libraries first because cudarc
//! panics when one is missing.
//!
//! All `unsafe` of the runtime lives here and in [`nccl`]: raw device pointers (one
//! allocation per memory-plan slot), kernel launches with arguments the device plan describes,
//! and cuBLAS/NCCL calls on them.

#![allow(unsafe_code)]

pub mod compile;
pub mod device;
pub mod emulate;
mod lt;
pub mod nccl;

use std::collections::HashMap;

use cudarc::driver::{sys as dsys, CudaContext};

pub use compile::{compile_ptx, compile_ptx_for};
use device::{ColumnMajorGemm, Device, KernelValue};

use crate::collectives::MeshShape;
use shardc_ir::mesh::PP_AXIS;

use crate::program::{Attr, BufferId, DeviceCall, DevicePlan, Gemm, Instr, KernelArg, KeptKind, Program, Role, Phase};
use crate::{DType, RuntimeError};

fn err(message: impl Into<String>) -> RuntimeError {
    RuntimeError::Device(message.into())
}

/// Checks that the CUDA driver, cuBLAS and NVRTC can be loaded and that there is a GPU,
/// without touching cudarc's panicking loaders.
pub fn check_available() -> Result<(), RuntimeError> {
    // SAFETY: only tries to dlopen the libraries.
    if !unsafe { dsys::is_culib_present() } {
        return Err(err("no CUDA driver (libcuda.so) on this machine"));
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(err("NVRTC (libnvrtc.so.13) was not found: put the CUDA 13 libraries on LD_LIBRARY_PATH (pip's nvidia-cuda-nvrtc has them under nvidia/cu13/lib)"));
    }
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(err("cuBLAS (libcublas.so.13) was not found: put the CUDA 13 libraries on LD_LIBRARY_PATH (pip's nvidia-cublas)"));
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err(err("the CUDA driver reports no GPU")),
        Err(e) => Err(err(format!("the CUDA driver failed to start: {e:?}"))),
    }
}

/// One rank's memory on the device: (pointer, bytes) of each slot and of its scratch.
struct RankMemory {
    rank: usize,
    /// Argument slots (and, in a plan without an arena, every slot); (pointer, bytes), a null
    /// pointer for a slot the arena replaces.
    slots: Vec<(u64, usize)>,
    /// The arena every temporary lives in, at its planned offset.
    arena: (u64, usize),
    workspace: (u64, usize),
}

/// Where the ranks of a program run.
#[derive(Clone, Debug)]
pub enum Placement {
    /// Every rank of the mesh on one GPU (`device`), collectives by device copies.
    SingleDevice {
        /// GPU ordinal.
        device: usize,
    },
    /// This process is one rank, on its own GPU, with NCCL (see [`nccl::Bootstrap`]).
    Nccl(nccl::Bootstrap),
    /// Every rank on the CPU emulation of a device ([`emulate`]): tests without a GPU.
    Emulated,
    /// This thread is one rank of an emulated multi-process run: its own emulated device and
    /// NCCL emulated by the CPU collectives ([`nccl::EmulatedWorld`]): the NCCL paths in
    /// tests without GPUs.
    EmulatedNccl(nccl::EmulatedWorld),
}

impl Placement {
    /// GPU 0, or its CPU emulation when `SHARDC_GPU_EMULATE=1` (trying the GPU path without
    /// one).
    pub fn first_gpu_or_emulated() -> Placement {
        if std::env::var("SHARDC_GPU_EMULATE").is_ok_and(|v| v == "1") { Placement::Emulated } else { Placement::SingleDevice { device: 0 } }
    }
}

/// The ranks of `mesh` an executor on one device runs: all, or those of one pipeline rank.
fn own_ranks(mesh: &MeshShape, pipeline_rank: Option<usize>) -> Vec<usize> {
    (0..mesh.ranks()).filter(|&r| pipeline_rank.is_none_or(|p| mesh.coords(r).get(2) == Some(&p))).collect()
}

/// Pipeline sends not yet received, between the executors of one device's pipeline ranks:
/// each message is a copy in memory of the sender's, until the receiver has copied it out.
#[derive(Debug, Default)]
pub struct Mailbox {
    /// (tag, receiving rank) -> (pointer, bytes, sending rank).
    messages: HashMap<(u64, usize), (u64, usize, usize)>,
    /// Copies received, for their senders to reuse: (sending rank, pointer, bytes).
    received: Vec<(usize, u64, usize)>,
}

/// Shared between the executors of one device's pipeline ranks (one thread drives them).
pub type SharedMailbox = std::rc::Rc<std::cell::RefCell<Mailbox>>;

/// Runs a program on a GPU, keeping its arguments between runs.
pub struct CudaExecutor {
    program: Program,
    plan: DevicePlan,
    mesh: MeshShape,
    device: device::Metered,
    ranks: Vec<RankMemory>,
    /// Scratch for collectives among ranks on this device: (pointer, bytes).
    staging: Option<(u64, usize)>,
    nccl: Option<nccl::Comms>,
    /// Gradient buckets on the communication stream (NCCL): the event each `xf.wait` of the
    /// bucket makes the compute stream wait for.
    buckets: HashMap<i64, Vec<cudarc::driver::CudaEvent>>,
    /// Members of reduce-scatter and all-gather buckets reached so far (NCCL): a bucket is
    /// issued as one group when its last member is reached.
    pending_groups: HashMap<i64, Vec<nccl::GroupMember>>,
    /// The same for asynchronous buckets of shifts (ring attention's key/value blocks).
    pending_shifts: HashMap<i64, Vec<nccl::ShiftMember>>,
    /// Staging of asynchronous reduce-scatters along inner dimensions, by instruction:
    /// (pointer, bytes), reused every step.
    async_staging: HashMap<usize, (u64, usize)>,
    /// Device copies of buffers a pipeline keeps between sections or sums over micro-batches.
    holds: Vec<Hold>,
    /// Where pipeline sends go and receives come from, with the (step, micro-batch) their
    /// tags carry, and this executor's copies for sends, free to reuse: (pointer, bytes).
    mailbox: Option<SharedMailbox>,
    transfer_context: (u64, u64),
    send_copies: Vec<(u64, usize)>,
    /// Gradient buckets with a region of the arena: instruction -> (region, whether it is the
    /// region's last member, which sends the whole region with one collective).
    bucket_regions: HashMap<usize, (usize, bool)>,
    /// A pipeline rank's step buckets (its regions): the input of each member -> the member,
    /// whose output the micro-batches' gradients are summed into; and the regions sent this
    /// step, with the events their first member makes the compute stream wait for.
    step_bucket_inputs: HashMap<BufferId, usize>,
    /// The whole gradients of a reduce-scatter step bucket's members (ZeRO), summed over
    /// the micro-batches outside the arena: input -> per local rank, its pointer. The
    /// bucket's scatters read them while the rank works on; their shards land in the region.
    scatter_sums: HashMap<BufferId, Vec<u64>>,
    step_buckets_sent: HashMap<usize, Vec<cudarc::driver::CudaEvent>>,
    /// Step buckets sent inside their chunk's last backward work (as the layers that fill
    /// them finish), and the gradient buffers summed into them then: the item's end neither
    /// sums nor sends them again.
    sent_early: std::collections::HashSet<usize>,
    summed_early: std::collections::HashSet<BufferId>,
    early_sends: usize,
    /// Collectives issued (one per instruction or bucket region, whatever the local ranks).
    collectives_issued: usize,
    /// A process's copies of the buffers it sent to other processes' pipeline ranks:
    /// (pointer, bytes, the send's completion; none when it is done or emulated). A copy is
    /// reused once its send is complete.
    sent_copies: Vec<(u64, usize, Option<cudarc::driver::CudaEvent>)>,
    /// What each peer process sends this one in a step, in the order it sends them (NCCL
    /// matches a pair's sends and receives by order alone): (global rank) -> (tag, bytes).
    /// A receive that is not the next one its peer sends first takes the ones before it
    /// into `stash`, where their own receives find them.
    expected: HashMap<usize, std::collections::VecDeque<(u64, usize)>>,
    /// Messages received ahead of their receive: (peer, tag) -> (pointer, bytes); and stash
    /// buffers free to reuse (a buffer is refilled only by a later receive on the compute
    /// stream, after the copy out of it: no synchronisation mid-step).
    stash: HashMap<(usize, u64), (u64, usize)>,
    stash_free: Vec<(u64, usize)>,
    /// Transfers between two chunks of this process's own pipeline rank (interleaved
    /// schedules' step sections): tag -> the sent copy (pointer, bytes), a device copy.
    to_self: HashMap<u64, (u64, usize)>,
    /// A fault to inject in this process (`SHARDC_FAULT=RANK:INSTRUCTION:KIND`, one process
    /// of a multi-process run): how the others end when one fails.
    fault: Option<crate::cpu::Fault>,
    /// While profiling: a marker before each run of instructions (`None`) and after each
    /// instruction (its index), on the compute stream.
    profile: Option<Vec<(Option<usize>, device::Marker)>>,
    /// A pipeline rank's kept values, by buffer: (chunk, kind, byte offset in its set).
    kept_of: Vec<Option<(usize, KeptKind, usize)>>,
    /// Storage of kept values, a set per micro-batch in flight, pooled over the chunks
    /// ([`crate::program::KeptPool`] decides which set each takes).
    kept_sets: Vec<KeptSet>,
    kept_pool: crate::program::KeptPool,
    /// The set each chunk's kept buffers of each kind are in now.
    kept_bound: Vec<[Option<usize>; 2]>,
}

/// Storage for one micro-batch's kept values of one chunk and kind
/// ([`crate::program::ChunkPlan::kept_set`]) on every local rank: the forward writes them
/// here and the backward reads them here.
struct KeptSet {
    /// Per local rank: the set's pointer.
    pointers: Vec<u64>,
}

/// A set of [`CudaExecutor::take_kept`], taken for a chunk's kept values of one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeptId {
    set: usize,
    chunk: usize,
    kind: KeptKind,
}

/// Device copies of some buffers of every local rank: values a pipeline keeps from one
/// section to a later one of the same micro-batch, or gradients it sums over micro-batches.
struct Hold {
    buffers: Vec<BufferId>,
    /// Per local rank, per buffer: (pointer, bytes).
    copies: Vec<Vec<(u64, usize)>>,
    in_use: bool,
}

/// A hold of [`CudaExecutor::hold`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldId(usize);

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        // The communicators go first: freeing memory synchronises the device, which must not
        // wait on a transfer to a peer that failed.
        drop(self.nccl.take());
        let mut pointers: Vec<u64> = self.ranks.iter().flat_map(|r| r.slots.iter().map(|s| s.0).chain([r.arena.0, r.workspace.0])).filter(|&p| p != 0).collect();
        pointers.extend(self.staging.map(|s| s.0));
        pointers.extend(self.async_staging.values().map(|s| s.0));
        pointers.extend(self.holds.iter().flat_map(|h| h.copies.iter().flatten().map(|c| c.0)));
        pointers.extend(self.kept_sets.iter().flat_map(|k| k.pointers.iter().copied()));
        pointers.extend(self.scatter_sums.values().flatten());
        pointers.extend(self.send_copies.iter().map(|c| c.0));
        pointers.extend(self.sent_copies.iter().map(|c| c.0));
        pointers.extend(self.stash.values().chain(&self.stash_free).chain(self.to_self.values()).map(|c| c.0));
        for ptr in pointers {
            self.device.free(ptr);
        }
    }
}

impl std::fmt::Debug for CudaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaExecutor").field("program", &self.program.name).field("ranks", &self.ranks.len()).finish()
    }
}

/// Every buffer a device call names exists, and a fused call names an instruction that
/// computes it (a plan read from a file is checked before any pointer is made of it).
fn check_call_buffers(program: &Program, plan: &DevicePlan) -> Result<(), RuntimeError> {
    let n = program.buffers.len();
    for (index, calls) in plan.calls.iter().enumerate() {
        for call in calls {
            let named: Vec<usize> = match call {
                DeviceCall::Launch { args, .. } => args.iter().filter_map(|a| if let KernelArg::Buffer(b) = a { Some(*b) } else { None }).collect(),
                DeviceCall::Gemm(g) => vec![g.a, g.b, g.c],
                DeviceCall::GemmEpilogue { gemm: g, epilogue } => {
                    let named: Vec<usize> = [g.a, g.b, g.c].into_iter().chain(epilogue.bias).chain(epilogue.aux).collect();
                    if let Some(b) = named.iter().find(|&&b| b >= n) {
                        return Err(err(format!("instruction {index}'s device call names buffer {b}, but the program has {n}")));
                    }
                    let bad = |why: String| Err(err(format!("instruction {index}'s GEMM epilogue {why}")));
                    let fits = |v: usize| i32::try_from(v).is_ok();
                    let elements = g.batch.checked_mul(g.m).and_then(|x| x.checked_mul(g.n));
                    match elements {
                        Some(e) if e > 0 && [g.m, g.n, g.k, g.batch].into_iter().all(fits) => {
                            if program.buffers[g.c].len() < e || epilogue.aux.is_some_and(|a| program.buffers[a].len() < e) {
                                return bad(format!("writes {e} elements into a smaller buffer"));
                            }
                        }
                        _ => return bad(format!("has dimensions {}x{}x{} (batch {}) outside cuBLAS's range", g.m, g.n, g.k, g.batch)),
                    }
                    if epilogue.bias.is_some_and(|b| program.buffers[b].len() != g.n) {
                        return bad(format!("has a bias that is not one vector of the product's {} columns", g.n));
                    }
                    if epilogue.activation == crate::program::EpilogueActivation::GeluGrad && epilogue.aux.is_none() {
                        return bad("takes GELU's gradient without the pre-activation (aux) it reads".into());
                    }
                    named
                }
                DeviceCall::Copy { from, to } => vec![*from, *to],
                DeviceCall::Fused { into } if *into >= plan.calls.len() => return Err(err(format!("instruction {index}'s device call is fused into instruction {into}, which does not exist"))),
                DeviceCall::Fused { .. } | DeviceCall::Runtime => Vec::new(),
            };
            if let Some(b) = named.into_iter().find(|&b| b >= n) {
                return Err(err(format!("instruction {index}'s device call names buffer {b}, but the program has {n}")));
            }
        }
    }
    Ok(())
}

/// The prelude's kernels the executor itself launches.
const HELPERS: &[&str] = &["shardc_fill_zero", "shardc_copy_blocks", "shardc_accumulate", "shardc_accumulate_f32", crate::program::GEMM_EPILOGUE_KERNEL];

/// Ops the device plan leaves to the runtime.
const RUNTIME_OPS: &[&str] = &["shard.all_reduce", "shard.all_gather", "shard.all_slice", "shard.reduce_scatter", "shard.all_to_all", "shard.broadcast", "shard.send", "shard.recv", "shard.shift", "tensor.empty"];

impl CudaExecutor {
    /// Loads `program` (which must carry a device plan) onto the GPU(s) of `placement`.
    pub fn new(program: Program, placement: &Placement) -> Result<CudaExecutor, RuntimeError> {
        program.validate()?;
        let plan = program.device.clone().ok_or_else(|| err("the program has no device plan: compile it with `--target cuda`"))?;
        if plan.calls.len() != program.instrs.len() {
            return Err(err("the device plan does not match the program's instructions"));
        }
        let pipeline_rank = program.pipeline.as_ref().filter(|p| p.ranks > 1).map(|p| p.rank);
        check_call_buffers(&program, &plan)?;
        for (instr, calls) in program.instrs.iter().zip(&plan.calls) {
            if calls.iter().any(|c| matches!(c, DeviceCall::Runtime)) && !RUNTIME_OPS.contains(&instr.op.as_str()) {
                return Err(err(format!("`{}` (at {}) has no CUDA implementation", instr.op, instr.loc)));
            }
        }
        let mesh = MeshShape(if program.mesh.is_empty() { vec![1] } else { program.mesh.clone() });
        let mut kernels = plan.kernels();
        kernels.extend(HELPERS.iter().map(|h| h.to_string()));
        kernels.sort();
        kernels.dedup();
        enum Comm<'a> {
            None,
            Nccl(&'a nccl::Bootstrap),
            Emulated(&'a nccl::EmulatedWorld),
        }
        let (device, local_ranks, comm): (Box<dyn Device>, Vec<usize>, Comm<'_>) = match placement {
            Placement::SingleDevice { device } => (Box::new(device::Gpu::new(*device, &plan.source, &kernels)?), own_ranks(&mesh, pipeline_rank), Comm::None),
            Placement::Emulated => (Box::new(emulate::Emulated::new(&plan.source, &kernels)?), own_ranks(&mesh, pipeline_rank), Comm::None),
            Placement::Nccl(b) => {
                if b.world != mesh.ranks() {
                    return Err(err(format!("WORLD_SIZE is {} but the program's mesh {:?} has {} ranks", b.world, mesh.0, mesh.ranks())));
                }
                (Box::new(device::Gpu::new(b.local_rank, &plan.source, &kernels)?), vec![b.rank], Comm::Nccl(b))
            }
            Placement::EmulatedNccl(w) => {
                if w.size() != mesh.ranks() {
                    return Err(err(format!("the emulated world has {} ranks but the program's mesh {:?} has {}", w.size(), mesh.0, mesh.ranks())));
                }
                (Box::new(emulate::Emulated::new(&plan.source, &kernels)?), vec![w.rank()], Comm::Emulated(w))
            }
        };
        let mut device = device::Metered::new(device);
        // With an arena plan, temporaries live in one arena of the plan's size; arguments keep
        // their slots.
        let arena_plan = !program.memory.offsets.is_empty();
        let argument_slots: std::collections::HashSet<usize> = program.args.iter().map(|a| program.buffers[a.buffer].slot).collect();
        let mut ranks = Vec::new();
        for rank in local_ranks {
            let mut slots = Vec::new();
            for (s, &(len, dtype)) in program.memory.slots.iter().enumerate() {
                if arena_plan && !argument_slots.contains(&s) {
                    slots.push((0, 0));
                    continue;
                }
                let bytes = len.saturating_mul(dtype.bytes());
                slots.push((device.alloc(bytes)?, bytes));
            }
            let arena_bytes = if arena_plan { program.memory.arena_bytes } else { 0 };
            let arena = (if arena_bytes > 0 { device.alloc(arena_bytes)? } else { 0 }, arena_bytes);
            let workspace = (device.alloc(plan.workspace_bytes)?, plan.workspace_bytes);
            ranks.push(RankMemory { rank, slots, arena, workspace });
        }
        let nccl = match comm {
            Comm::Nccl(b) => {
                let comms = nccl::Comms::new(b, &mesh)?;
                let byte = device.alloc(1)?;
                let connected = comms.connect_pipeline_edges(b.rank, &mesh, byte, device.stream().map(|s| s.as_ref()));
                device.free(byte);
                connected?;
                Some(comms)
            }
            Comm::Emulated(w) => Some(nccl::Comms::emulated(w.clone(), &mesh)),
            Comm::None => None,
        };
        let fault = crate::cpu::Fault::from_env().filter(|f| nccl.is_some() && ranks.first().is_some_and(|r| r.rank == f.rank));
        let bucket_regions = program.memory.buckets.iter().enumerate().flat_map(|(k, r)| r.members.iter().map(move |&m| (m, (k, Some(&m) == r.members.last())))).collect();
        let step_bucket_inputs: HashMap<BufferId, usize> = if program.pipeline.is_some() { program.memory.buckets.iter().flat_map(|r| r.members.iter().map(|&m| (program.instrs[m].inputs[0], m))).collect() } else { HashMap::new() };
        let mut scatter_sums = HashMap::new();
        for k in (0..program.memory.buckets.len()).filter(|&k| program.pipeline.is_some() && program.step_bucket_scatters(k)) {
            for b in program.step_bucket_inputs(k) {
                let bytes = program.buffers[b].len() * program.buffers[b].dtype.bytes();
                let mut mine = Vec::with_capacity(ranks.len());
                for _ in 0..ranks.len() {
                    mine.push(device.alloc(bytes.max(1))?);
                }
                scatter_sums.insert(b, mine);
            }
        }
        // Each chunk's kept values outside the arena: where in a set each buffer lies.
        let mut kept_of = vec![None; program.buffers.len()];
        let chunks = program.pipeline.as_ref().map_or(0, |p| p.chunks.len());
        for c in 0..chunks {
            for kind in [KeptKind::Forward, KeptKind::Backward] {
                let (placed, _) = program.pipeline.as_ref().map(|p| p.chunks[c].kept_set(&program, kind)).unwrap_or_default();
                for (b, offset) in placed {
                    kept_of[b] = Some((c, kind, offset));
                }
            }
        }
        let kept_bound = vec![[None; 2]; chunks];
        Ok(CudaExecutor {
            program,
            plan,
            mesh,
            device,
            ranks,
            staging: None,
            nccl,
            buckets: HashMap::new(),
            pending_groups: HashMap::new(),
            pending_shifts: HashMap::new(),
            async_staging: HashMap::new(),
            holds: Vec::new(),
            mailbox: None,
            transfer_context: (0, 0),
            send_copies: Vec::new(),
            bucket_regions,
            step_bucket_inputs,
            scatter_sums,
            step_buckets_sent: HashMap::new(),
            sent_early: Default::default(),
            summed_early: Default::default(),
            early_sends: 0,
            collectives_issued: 0,
            sent_copies: Vec::new(),
            expected: HashMap::new(),
            stash: HashMap::new(),
            stash_free: Vec::new(),
            to_self: HashMap::new(),
            fault,
            profile: None,
            kept_of,
            kept_sets: Vec::new(),
            kept_pool: Default::default(),
            kept_bound,
        })
    }

    /// The program.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The global ranks this executor runs.
    pub fn ranks(&self) -> Vec<usize> {
        self.ranks.iter().map(|r| r.rank).collect()
    }

    /// The device's name.
    pub fn device_name(&self) -> String {
        self.device.name()
    }

    fn buffer_ptr(&self, local: usize, buffer: usize) -> u64 {
        if let Some(Some((chunk, kind, offset))) = self.kept_of.get(buffer)
            && let Some(set) = self.kept_bound[*chunk][*kind as usize]
        {
            return self.kept_sets[set].pointers[local] + *offset as u64;
        }
        match self.program.arena_range(buffer) {
            Some((offset, _)) => self.ranks[local].arena.0 + offset as u64,
            None => self.ranks[local].slots[self.program.buffers[buffer].slot].0,
        }
    }

    fn binding(&self, name: &str) -> Result<usize, RuntimeError> {
        let b = self.program.arg(name).or_else(|| self.program.result(name)).ok_or_else(|| RuntimeError::Binding(format!("the program has no argument or result `{name}`")))?;
        Ok(b.buffer)
    }

    /// Writes f64 values into a named buffer of local rank `local`, converted to its type.
    pub fn write(&mut self, local: usize, name: &str, values: &[f64]) -> Result<(), RuntimeError> {
        let buffer = self.binding(name)?;
        let b = &self.program.buffers[buffer];
        if b.len() != values.len() {
            return Err(RuntimeError::Binding(format!("`{name}` takes {} elements (shape {:?}), got {}", b.len(), b.shape, values.len())));
        }
        self.wait_for_device()?;
        self.device.upload(self.buffer_ptr(local, buffer), &encode(values, b.dtype))
    }

    /// Reads a named buffer of local rank `local` as f64.
    pub fn read(&self, local: usize, name: &str) -> Result<Vec<f64>, RuntimeError> {
        self.read_buffer(local, self.binding(name)?)
    }

    /// The values of buffer `buffer` on local rank `local`.
    pub fn read_buffer(&self, local: usize, buffer: BufferId) -> Result<Vec<f64>, RuntimeError> {
        let b = self.program.buffers.get(buffer).ok_or_else(|| err(format!("no buffer {buffer}")))?;
        let mut bytes = vec![0u8; b.len() * b.dtype.bytes()];
        self.wait_for_device()?;
        self.device.download(&mut bytes, self.buffer_ptr(local, buffer))?;
        Ok(decode(&bytes, b.dtype))
    }

    /// Copies each result that is an argument's new value into the argument when they differ.
    pub fn carry_state(&mut self) -> Result<(), RuntimeError> {
        let pairs: Vec<(usize, usize)> = self.program.results.iter().filter_map(|r| self.program.arg(&r.name).map(|a| (r.buffer, a.buffer))).filter(|(r, a)| r != a).collect();
        for local in 0..self.ranks.len() {
            for &(from, to) in &pairs {
                self.copy(local, from, to)?;
            }
        }
        Ok(())
    }

    fn copy(&self, local: usize, from: usize, to: usize) -> Result<(), RuntimeError> {
        let b = &self.program.buffers[from];
        self.copy_raw(self.buffer_ptr(local, to), self.buffer_ptr(local, from), b.len() * b.dtype.bytes())
    }

    fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<(), RuntimeError> {
        if dst == src || bytes == 0 {
            return Ok(());
        }
        self.device.copy(dst, src, bytes)
    }

    /// Waits for the device, and for this process's pipeline sends.
    pub fn synchronize(&self) -> Result<(), RuntimeError> {
        match &self.nccl {
            // Under NCCL's watchdog: a peer that failed or hangs ends the wait with an error.
            Some(comms) => comms.guard(|| {
                self.device.synchronize()?;
                comms.synchronize()
            }),
            None => self.device.synchronize(),
        }
    }

    /// Waits for the device's queued work (not pipeline sends, which may wait for their
    /// receivers), under NCCL's watchdog: queued work may wait on a peer that failed, and
    /// that wait ends with an error instead of never.
    fn wait_for_device(&self) -> Result<(), RuntimeError> {
        match &self.nccl {
            Some(comms) => comms.guard(|| self.device.synchronize()),
            None => self.device.synchronize(),
        }
    }

    /// Runs every instruction once on every local rank (in lockstep, so that collectives
    /// among ranks on this device find every input ready).
    pub fn run(&mut self) -> Result<(), RuntimeError> {
        self.run_range(0..self.program.instrs.len())?;
        // Every bucket issued was waited for (validated; a bucket left here would be a
        // transfer nothing joined).
        if let Some(bucket) = self.pending_groups.keys().chain(self.pending_shifts.keys()).chain(self.buckets.keys()).next() {
            return Err(err(format!("bucket {bucket} was never completed and waited for")));
        }
        self.synchronize()
    }

    /// Runs instructions `0..end` on every local rank, the part of a step that makes its loss
    /// ([`Program::loss_partial`]), then waits for the collectives it started: the
    /// backward's early parameter gathers, and bucket members whose buckets the rest of the
    /// step would send, are dropped unsent (every rank of the step runs the same part, so
    /// none waits on a peer for them).
    pub fn run_until(&mut self, end: usize) -> Result<(), RuntimeError> {
        self.run_range(0..end)?;
        self.synchronize()?;
        self.forget_step_state();
        Ok(())
    }

    /// A set for chunk `chunk`'s kept values of `kind` (a free one, or a new one), bound:
    /// the chunk's kept buffers of that kind are in it until another is bound. `None` where
    /// the chunk keeps no such values.
    pub fn take_kept(&mut self, chunk: usize, kind: KeptKind) -> Result<Option<KeptId>, RuntimeError> {
        let Some(plan) = self.program.pipeline.as_ref() else { return Ok(None) };
        let bytes = plan.chunks.get(chunk).map_or(0, |c| c.kept_set(&self.program, kind).1);
        if bytes == 0 {
            return Ok(None);
        }
        let (set, new) = self.kept_pool.take(bytes);
        if new {
            let pointers = (0..self.ranks.len()).map(|_| self.device.alloc(bytes)).collect::<Result<Vec<_>, _>>()?;
            self.kept_sets.push(KeptSet { pointers });
        }
        let id = KeptId { set, chunk, kind };
        self.bind_kept(id);
        Ok(Some(id))
    }

    /// Puts the kept buffers of `id`'s chunk and kind in `id` (a micro-batch's backward or
    /// weight gradient reading what its forward or backward kept there).
    pub fn bind_kept(&mut self, id: KeptId) {
        self.kept_bound[id.chunk][id.kind as usize] = Some(id.set);
    }

    /// Frees a set for reuse by a later [`CudaExecutor::take_kept`].
    pub fn free_kept(&mut self, id: KeptId) {
        self.kept_pool.free(id.set);
    }

    /// Copies `buffers` of every local rank into a hold (reusing a free one of the same
    /// buffers), for [`CudaExecutor::restore`] later.
    pub fn hold(&mut self, buffers: &[BufferId]) -> Result<HoldId, RuntimeError> {
        let id = match self.holds.iter().position(|h| !h.in_use && h.buffers == buffers) {
            Some(id) => id,
            None => {
                let mut copies = Vec::with_capacity(self.ranks.len());
                for _ in 0..self.ranks.len() {
                    let mut mine = Vec::with_capacity(buffers.len());
                    for &b in buffers {
                        let bytes = self.program.buffers[b].len() * self.program.buffers[b].dtype.bytes();
                        mine.push((self.device.alloc(bytes.max(1))?, bytes));
                    }
                    copies.push(mine);
                }
                self.holds.push(Hold { buffers: buffers.to_vec(), copies, in_use: false });
                self.holds.len() - 1
            }
        };
        self.holds[id].in_use = true;
        self.fill(HoldId(id), false)?;
        Ok(HoldId(id))
    }

    /// `hold = buffers` (or `hold += buffers` when `add`): sums over micro-batches.
    pub fn fill(&self, id: HoldId, add: bool) -> Result<(), RuntimeError> {
        let hold = &self.holds[id.0];
        for (local, copies) in hold.copies.iter().enumerate() {
            for (&b, &(ptr, bytes)) in hold.buffers.iter().zip(copies) {
                let buffer = &self.program.buffers[b];
                if add {
                    if buffer.dtype != DType::F32 && buffer.dtype != self.plan.dtype {
                        return Err(err(format!("cannot sum {:?} buffer `{}` on the GPU", buffer.dtype, buffer.name)));
                    }
                    self.accumulate(ptr, self.buffer_ptr(local, b), buffer.len(), false, buffer.dtype)?;
                } else {
                    self.copy_raw(ptr, self.buffer_ptr(local, b), bytes)?;
                }
            }
        }
        Ok(())
    }

    /// Copies a hold back into its buffers on every local rank.
    pub fn restore(&self, id: HoldId) -> Result<(), RuntimeError> {
        let hold = &self.holds[id.0];
        for (local, copies) in hold.copies.iter().enumerate() {
            for (&b, &(ptr, bytes)) in hold.buffers.iter().zip(copies) {
                self.copy_raw(self.buffer_ptr(local, b), ptr, bytes)?;
            }
        }
        Ok(())
    }

    /// Frees a hold for reuse by a later [`CudaExecutor::hold`].
    pub fn release(&mut self, id: HoldId) {
        self.holds[id.0].in_use = false;
    }

    /// Sums those of `buffers` that a step bucket reduces into their member's place in the
    /// bucket's region, or, a reduce-scatter's, into its whole sum outside the arena
    /// (`first`: the step's first micro-batch, copied), on every local rank, as Megatron-LM
    /// accumulates into its contiguous gradient buffer; returns the others, for a hold.
    pub fn sum_into_step_buckets(&self, buffers: &[BufferId], first: bool) -> Result<Vec<BufferId>, RuntimeError> {
        let mut rest = Vec::with_capacity(buffers.len());
        for &b in buffers {
            let Some(&member) = self.step_bucket_inputs.get(&b) else {
                rest.push(b);
                continue;
            };
            if self.summed_early.contains(&b) {
                continue;
            }
            let out = self.program.instrs[member].outputs[0];
            let buffer = &self.program.buffers[b];
            let sums = self.scatter_sums.get(&b);
            for local in 0..self.ranks.len() {
                let dst = sums.map_or_else(|| self.buffer_ptr(local, out), |s| s[local]);
                let src = self.buffer_ptr(local, b);
                if first {
                    self.copy_raw(dst, src, buffer.len() * buffer.dtype.bytes())?;
                } else if buffer.dtype != DType::F32 && buffer.dtype != self.plan.dtype {
                    return Err(err(format!("cannot sum {:?} buffer `{}` on the GPU", buffer.dtype, buffer.name)));
                } else {
                    self.accumulate(dst, src, buffer.len(), false, buffer.dtype)?;
                }
            }
        }
        Ok(rest)
    }

    /// Sends the step buckets of `chunk` (its last backward work of the step done, so its
    /// regions hold the summed gradients): one collective per region, on the communication
    /// stream under NCCL, in place among this device's ranks otherwise; the step section's
    /// first member of each waits for it. Returns how many went out.
    pub fn start_step_buckets(&mut self, chunk: &crate::program::ChunkPlan) -> Result<usize, RuntimeError> {
        let regions: Vec<usize> = (0..self.program.memory.buckets.len()).filter(|&k| self.program.memory.buckets[k].members.iter().all(|m| chunk.early_syncs.contains(m)) && !self.sent_early.contains(&k)).collect();
        self.forget_early_step_buckets();
        for &k in &regions {
            self.send_step_bucket(k)?;
        }
        Ok(regions.len())
    }

    /// Starts step bucket region `k`'s collective, once a step.
    fn send_step_bucket(&mut self, k: usize) -> Result<(), RuntimeError> {
        if self.step_buckets_sent.contains_key(&k) {
            return Err(err(format!("step bucket {} was sent twice in one step", self.program.memory.buckets[k].bucket)));
        }
        let events = self.reduce_region(k)?;
        self.step_buckets_sent.insert(k, events);
        Ok(())
    }

    /// Sends step bucket region `k` from inside its chunk's last backward work: sums the
    /// gradients of this micro-batch into the region (`first(buffer)`: the step's first
    /// micro-batch, copied) and starts its collective; the work's end then leaves it alone.
    pub fn send_step_bucket_early(&mut self, k: usize, first: impl Fn(BufferId) -> bool) -> Result<(), RuntimeError> {
        let inputs = self.program.step_bucket_inputs(k);
        for &b in &inputs {
            self.sum_into_step_buckets(&[b], first(b))?;
        }
        self.send_step_bucket(k)?;
        self.summed_early.extend(inputs);
        self.sent_early.insert(k);
        self.early_sends += 1;
        Ok(())
    }

    /// How many step buckets went out inside their chunk's last backward work since the
    /// executor was made.
    pub fn step_buckets_sent_early(&self) -> usize {
        self.early_sends
    }

    /// Forgets the early sends of a chunk's last backward work: at its end, and at a step's
    /// start (after a step that failed inside that work, a stale entry would make the next
    /// step skip that gradient's sums).
    pub fn forget_early_step_buckets(&mut self) {
        self.sent_early.clear();
        self.summed_early.clear();
    }

    /// Forgets what a step that failed part-way left behind, at the next step's start: early
    /// sends, step buckets sent and not waited for, and asynchronous buckets half issued or
    /// not joined (their members would otherwise join the next step's).
    pub fn forget_step_state(&mut self) {
        self.forget_early_step_buckets();
        self.step_buckets_sent.clear();
        self.pending_groups.clear();
        self.pending_shifts.clear();
        self.buckets.clear();
    }

    /// Sums region `k` of the memory plan over its members' group, in place: on the
    /// communication stream under NCCL (the events to join), else among this device's ranks
    /// at once.
    fn reduce_region(&mut self, k: usize) -> Result<Vec<cudarc::driver::CudaEvent>, RuntimeError> {
        let r = self.program.memory.buckets[k].clone();
        let instr = &self.program.instrs[r.members[0]];
        let axes: Vec<usize> = instr.ints("grid_axes").map_err(err)?.iter().map(|&a| a as usize).collect();
        if self.program.pipeline.is_some() && self.program.step_bucket_scatters(k) {
            return self.scatter_region(k, &axes);
        }
        self.collectives_issued += 1;
        if let Some(comms) = &self.nccl {
            let at = self.ranks[0].arena.0 + r.offset as u64;
            // On the communicator's stream, joined at the bucket's wait (the emulated device,
            // without streams, runs it at once).
            let stream = self.device.stream().cloned();
            return Ok(comms.all_reduce_in_place(&axes, at, r.len(), r.dtype, self.ranks[0].rank, stream.as_deref())?.into_iter().collect());
        }
        // Sum in rank order into the staging buffer, then hand out: every rank gets the same
        // bits, as from an instruction's own all-reduce.
        let staging = self.staging(r.bytes)?;
        for group in self.local_groups(&axes, "shard.all_reduce")? {
            let at = |local: usize| self.ranks[local].arena.0 + r.offset as u64;
            self.copy_raw(staging, at(group[0]), r.bytes)?;
            for &l in &group[1..] {
                self.accumulate(staging, at(l), r.len(), false, r.dtype)?;
            }
            for &l in &group {
                self.copy_raw(at(l), staging, r.bytes)?;
            }
        }
        Ok(Vec::new())
    }

    /// Reduce-scatters step bucket region `k`'s whole gradients (summed over micro-batches in
    /// [`CudaExecutor::scatter_sums`]) over `axes` along dimension 0, each rank's shard into
    /// its member's output in the region: one NCCL group on the communication stream (the
    /// events to join), else among this device's ranks at once, summed in rank order as an
    /// instruction's own reduce-scatter is.
    fn scatter_region(&mut self, k: usize, axes: &[usize]) -> Result<Vec<cudarc::driver::CudaEvent>, RuntimeError> {
        let members = self.program.memory.buckets[k].members.clone();
        self.collectives_issued += 1;
        let sum_of = |this: &Self, input: BufferId, local: usize| this.scatter_sums.get(&input).map(|s| s[local]).ok_or_else(|| err(format!("no sum of `{}` for its reduce-scatter bucket", this.program.buffers[input].name)));
        if let Some(comms) = &self.nccl {
            let mut group = Vec::with_capacity(members.len());
            for &m in &members {
                let instr = &self.program.instrs[m];
                let (input, output) = (instr.inputs[0], instr.outputs[0]);
                let out = &self.program.buffers[output];
                group.push(nccl::GroupMember { gather: false, axes: axes.to_vec(), send: sum_of(self, input, 0)?, recv: self.buffer_ptr(0, output), count: out.len(), dtype: out.dtype });
            }
            let stream = self.device.stream().cloned();
            return Ok(comms.run_group(&group, self.ranks[0].rank, stream.as_deref())?.into_iter().collect());
        }
        let groups = self.local_groups(axes, "shard.reduce_scatter")?;
        for &m in &members {
            let instr = &self.program.instrs[m];
            let (input, output) = (instr.inputs[0], instr.outputs[0]);
            let (len, dtype) = (self.program.buffers[input].len(), self.program.buffers[input].dtype);
            let shard_bytes = self.program.buffers[output].len() * dtype.bytes();
            let staging = self.staging(len * dtype.bytes())?;
            for group in &groups {
                self.copy_raw(staging, sum_of(self, input, group[0])?, len * dtype.bytes())?;
                for &l in &group[1..] {
                    self.accumulate(staging, sum_of(self, input, l)?, len, false, dtype)?;
                }
                // Along dimension 0, rank `p`'s shard is block `p` of the sum.
                for (p, &l) in group.iter().enumerate() {
                    self.copy_raw(self.buffer_ptr(l, output), staging + (p * shard_bytes) as u64, shard_bytes)?;
                }
            }
        }
        Ok(Vec::new())
    }

    /// A member of a step bucket in the step section: its value is already in its region,
    /// sent at its chunk's last backward; the first member reached makes the compute stream
    /// wait for the bucket.
    fn step_bucket_member(&mut self, index: usize, region: usize) -> Result<(), RuntimeError> {
        let r = &self.program.memory.buckets[region];
        let Some(events) = self.step_buckets_sent.get_mut(&region) else {
            return Err(err(format!("step bucket {} was not sent at its chunk's last backward", r.bucket)));
        };
        if !events.is_empty() {
            let stream = self.device.stream().cloned().ok_or_else(|| err("no GPU stream"))?;
            for event in std::mem::take(events) {
                stream.wait(&event).map_err(|e| err(format!("{e:?}")))?;
            }
        }
        if r.members.last() == Some(&index) {
            self.step_buckets_sent.remove(&region);
        }
        Ok(())
    }

    /// Runs instructions `range` once on every local rank, in lockstep (without waiting for
    /// the device at the end).
    pub fn run_range(&mut self, range: std::ops::Range<usize>) -> Result<(), RuntimeError> {
        match self.run_until_blocked(&range.collect::<Vec<_>>())? {
            0 => Ok(()),
            left => Err(err(format!("a pipeline receive found no message ({left} instructions not run)"))),
        }
    }

    /// Takes back the copies of this executor's sends that their receivers are done with.
    pub fn reclaim_sends(&mut self) {
        let Some(mailbox) = &self.mailbox else { return };
        let mine = self.ranks();
        let mut m = mailbox.borrow_mut();
        let (back, keep): (Vec<_>, Vec<_>) = m.received.drain(..).partition(|(sender, _, _)| mine.contains(sender));
        m.received = keep;
        self.send_copies.extend(back.into_iter().map(|(_, ptr, bytes)| (ptr, bytes)));
    }

    /// Shares `mailbox` with the executors of the other pipeline ranks on this device.
    pub fn set_mailbox(&mut self, mailbox: SharedMailbox) {
        self.mailbox = Some(mailbox);
    }

    /// The (step, micro-batch) the next pipeline sends and receives belong to.
    pub fn set_transfer_context(&mut self, step: u64, microbatch: u64) {
        self.transfer_context = (step, microbatch);
    }

    /// Runs `indices` in order on every local rank until one is a pipeline receive whose
    /// message has not been sent yet; returns how many were left (0: all ran).
    pub fn run_until_blocked(&mut self, indices: &[usize]) -> Result<usize, RuntimeError> {
        for (done, &index) in indices.iter().enumerate() {
            if let Some(f) = self.fault.filter(|f| f.instruction == index) {
                self.inject(f)?;
            }
            let op = self.program.instrs[index].op.as_str();
            let allocation = op == "tensor.empty";
            if matches!(op, "shard.send" | "shard.recv") {
                self.mark(None)?;
                let ran = self.point_to_point(index).map_err(|e| {
                    let instr = &self.program.instrs[index];
                    RuntimeError::Kernel { index, op: instr.op.clone(), loc: instr.loc.clone(), message: e.to_string() }
                })?;
                if !ran {
                    self.unmark();
                    return Ok(indices.len() - done);
                }
                self.mark(Some(index))?;
                continue;
            }
            let calls = self.plan.calls[index].clone();
            self.wait_for_bucket(index)?;
            // Only an instruction that puts work on the device is timed, from a marker just
            // before its work (not after the previous instruction's, which would count the
            // host's time between them whenever the device waits for it).
            let works = !allocation && calls.iter().any(|c| !matches!(c, DeviceCall::Fused { .. }));
            if works {
                self.mark(None)?;
            }
            for call in &calls {
                let result = match call {
                    DeviceCall::Fused { .. } => Ok(()),
                    DeviceCall::Runtime => self.collective(index),
                    _ => (0..self.ranks.len()).try_for_each(|local| self.call(index, local, call)),
                };
                result.map_err(|e| {
                    let instr = &self.program.instrs[index];
                    RuntimeError::Kernel { index, op: instr.op.clone(), loc: instr.loc.clone(), message: e.to_string() }
                })?;
            }
            if works {
                self.mark(Some(index))?;
            }
        }
        Ok(0)
    }

    /// While profiling, a marker on the compute stream after `instruction`'s work (`None`:
    /// before it).
    fn mark(&mut self, instruction: Option<usize>) -> Result<(), RuntimeError> {
        if let Some(markers) = &mut self.profile {
            markers.push((instruction, self.device.marker()?));
        }
        Ok(())
    }

    /// Drops the marker before an instruction that did not run after all (a receive whose
    /// message has not come).
    fn unmark(&mut self) {
        if let Some(markers) = &mut self.profile
            && matches!(markers.last(), Some((None, _)))
        {
            markers.pop();
        }
    }

    /// Starts (or stops) timing each instruction that puts work on the device (not one fused
    /// into another, nor an allocation): every local rank's calls of an instruction count as
    /// one span, between markers on the compute stream just before and after them.
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(Vec::new);
    }

    /// The device seconds of each instruction run with work since profiling started (in run
    /// order; an instruction that ran twice appears twice), waiting for the device;
    /// profiling goes on. A pipeline send or receive is a span of its own (its copy on the
    /// stream).
    pub fn take_profile(&mut self) -> Result<Vec<(usize, f64)>, RuntimeError> {
        let Some(markers) = self.profile.as_mut().map(std::mem::take) else { return Ok(Vec::new()) };
        self.device.synchronize()?;
        let mut spans = Vec::new();
        for pair in markers.windows(2) {
            if let (_, before) = &pair[0]
                && let (Some(index), after) = &pair[1]
            {
                spans.push((*index, before.seconds_to(after)?));
            }
        }
        Ok(spans)
    }

    /// A pipeline send (a copy of the buffer posted for its receiver) or receive (the posted
    /// copy taken) of every local rank, tagged as the CPU backend tags them; `false` for a
    /// receive whose message some local rank does not have yet (nothing is done then).
    fn point_to_point(&mut self, index: usize) -> Result<bool, RuntimeError> {
        let instr = self.program.instrs[index].clone();
        let transfer = instr.int("xf.transfer").map_err(err)? as u64;
        let (step, microbatch) = self.transfer_context;
        if transfer >= 1 << 20 || microbatch >= 1 << 16 || step >= 1 << 28 {
            return Err(err(format!("transfer {transfer}, micro-batch {microbatch} or step {step} is too large to tag")));
        }
        let tag = (step << 36) | (transfer << 16) | microbatch;
        let sending = instr.op == "shard.send";
        let peer_index = instr.ints(if sending { "destination" } else { "source" }).map_err(err)?.first().copied().ok_or_else(|| err(format!("`{}` has no peer", instr.op)))?;
        let peers: Vec<usize> = self
            .ranks()
            .into_iter()
            .map(|rank| self.mesh.group(rank, &[PP_AXIS]).get(peer_index as usize).copied().ok_or_else(|| err(format!("peer {peer_index} is outside the pp axis"))))
            .collect::<Result<_, _>>()?;
        if self.nccl.is_some() {
            // One process per rank: a send goes from a copy on its own stream (the buffer's
            // storage may be reused at once, and the compute stream does not wait for the
            // receiver); a receive holds up the compute stream until its bytes are in.
            let (buffer, peer, rank) = (if sending { instr.inputs[0] } else { instr.outputs[0] }, peers[0], self.ranks[0].rank);
            let bytes = self.program.buffers[buffer].len() * self.program.buffers[buffer].dtype.bytes();
            let stream = self.device.stream().cloned();
            if !sending {
                let ptr = self.buffer_ptr(0, buffer);
                if peer == rank {
                    let (copy, sent) = self.to_self.remove(&tag).ok_or_else(|| err(format!("rank {rank} receives transfer {transfer} from itself before sending it")))?;
                    self.copy_raw(ptr, copy, bytes.min(sent))?;
                    self.sent_copies.push((copy, sent, None));
                    return Ok(true);
                }
                if let Some(stashed) = self.stash.remove(&(peer, tag)) {
                    self.copy_raw(ptr, stashed.0, bytes)?;
                    self.stash_free.push(stashed);
                    return Ok(true);
                }
                let comms = self.nccl.as_ref().ok_or_else(|| err("no NCCL communicator"))?;
                // The peer's sends before this one come first, into the stash.
                while let Some((next, next_bytes)) = self.expected.get_mut(&peer).and_then(|q| q.pop_front()) {
                    if next == tag {
                        break;
                    }
                    let stashed = match self.stash_free.iter().position(|b| b.1 == next_bytes) {
                        Some(at) => self.stash_free.swap_remove(at).0,
                        None => self.device.alloc(next_bytes.max(1))?,
                    };
                    comms.recv(stashed, next_bytes, peer, next, rank, stream.as_deref())?;
                    self.stash.insert((peer, next), (stashed, next_bytes));
                }
                comms.recv(ptr, bytes, peer, tag, rank, stream.as_deref())?;
                return Ok(true);
            }
            let free = self.sent_copies.iter().position(|c| c.1 == bytes && c.2.as_ref().is_none_or(|e| e.is_complete()));
            let (copy, _, _) = match free {
                Some(at) => self.sent_copies.swap_remove(at),
                None => (self.device.alloc(bytes.max(1))?, bytes, None),
            };
            self.copy_raw(copy, self.buffer_ptr(0, buffer), bytes)?;
            if peer == rank {
                // To a chunk of this same pipeline rank: the copy waits for its receive.
                self.to_self.insert(tag, (copy, bytes));
                return Ok(true);
            }
            let done = self.nccl.as_ref().ok_or_else(|| err("no NCCL communicator"))?.send(copy, bytes, peer, tag, rank, stream.as_deref())?;
            self.sent_copies.push((copy, bytes, done));
            return Ok(true);
        }
        let mailbox = self.mailbox.clone().ok_or_else(|| err("a pipeline send or receive needs the other pipeline ranks' executors on this device"))?;
        if sending {
            let buffer = &self.program.buffers[instr.inputs[0]];
            let bytes = buffer.len() * buffer.dtype.bytes();
            // Copies the receivers have taken come back for reuse.
            let mine = self.ranks();
            let returned: Vec<(u64, usize)> = {
                let mut m = mailbox.borrow_mut();
                let (back, keep): (Vec<_>, Vec<_>) = m.received.drain(..).partition(|(sender, _, _)| mine.contains(sender));
                m.received = keep;
                back.into_iter().map(|(_, ptr, bytes)| (ptr, bytes)).collect()
            };
            self.send_copies.extend(returned);
            for (local, &peer) in peers.iter().enumerate() {
                let copy = match self.send_copies.iter().position(|c| c.1 == bytes) {
                    Some(at) => self.send_copies.swap_remove(at),
                    None => (self.device.alloc(bytes.max(1))?, bytes),
                };
                self.copy_raw(copy.0, self.buffer_ptr(local, instr.inputs[0]), bytes)?;
                let rank = self.ranks[local].rank;
                if mailbox.borrow_mut().messages.insert((tag, peer), (copy.0, bytes, rank)).is_some() {
                    return Err(err(format!("rank {rank} sent transfer {transfer} of micro-batch {microbatch} twice")));
                }
            }
            // The receivers copy on their own stream: the copies must be complete first.
            self.synchronize()?;
            return Ok(true);
        }
        let mine = self.ranks();
        if !mine.iter().all(|rank| mailbox.borrow().messages.contains_key(&(tag, *rank))) {
            return Ok(false);
        }
        let buffer = &self.program.buffers[instr.outputs[0]];
        let bytes = buffer.len() * buffer.dtype.bytes();
        for (local, rank) in mine.into_iter().enumerate() {
            let (ptr, sent, sender) = mailbox.borrow_mut().messages.remove(&(tag, rank)).ok_or_else(|| err("a message vanished"))?;
            if sent != bytes {
                return Err(err(format!("rank {rank} received {sent} bytes from rank {sender} for a buffer of {bytes}")));
            }
            self.copy_raw(self.buffer_ptr(local, instr.outputs[0]), ptr, bytes)?;
            // The sender may reuse its copy once this one is done.
            self.synchronize()?;
            mailbox.borrow_mut().received.push((sender, ptr, sent));
        }
        Ok(true)
    }

    /// What each peer process sends this one in step `step`, in its order: (global rank) ->
    /// (transfer tag without the step, bytes); see `expected`.
    pub fn expect_receives(&mut self, step: u64, order: &HashMap<usize, Vec<(u64, usize)>>) {
        self.expected = order.iter().map(|(&peer, sends)| (peer, sends.iter().map(|&(tag, bytes)| ((step << 36) | tag, bytes)).collect())).collect();
    }

    /// Fails as `fault` says, at its instruction.
    fn inject(&self, fault: crate::cpu::Fault) -> Result<(), RuntimeError> {
        use crate::cpu::FaultKind;
        let instr = &self.program.instrs[fault.instruction];
        let (rank, at) = (self.ranks[0].rank, format!("instruction {} (`{}` at {})", fault.instruction, instr.op, instr.loc));
        let fail = |message: &str| RuntimeError::Kernel { index: fault.instruction, op: instr.op.clone(), loc: instr.loc.clone(), message: message.into() };
        match fault.kind {
            FaultKind::Panic => panic!("injected fault: rank {rank} panics at {at}"),
            FaultKind::Kernel => Err(fail("injected kernel failure (SHARDC_FAULT)")),
            FaultKind::Hang => {
                // Silent until the others give up on this process (emulated: the world's abort
                // flag; under NCCL, for ever, as a hung GPU would be).
                let abort = self.nccl.as_ref().and_then(|c| c.abort_flag());
                while !abort.as_ref().is_some_and(|a| a.load(std::sync::atomic::Ordering::SeqCst)) {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(fail("hung (injected) and was stopped once the other processes gave up on it"))
            }
        }
    }

    fn call(&self, index: usize, local: usize, call: &DeviceCall) -> Result<(), RuntimeError> {
        match call {
            DeviceCall::Launch { kernel, grid, block, shared_bytes, args } => {
                let instr = &self.program.instrs[index];
                let rank = self.ranks[local].rank;
                let offset = crate::cpu::split_rows(instr, &self.program, &self.mesh, rank).map_or_else(|| crate::cpu::seq_offset(instr, &self.program, &self.mesh, rank), |(first, _)| first);
                let values: Vec<KernelValue> = args
                    .iter()
                    .map(|arg| -> Result<KernelValue, RuntimeError> {
                        Ok(match arg {
                        KernelArg::Buffer(b) => KernelValue::Ptr(self.buffer_ptr(local, *b)),
                        KernelArg::Null => KernelValue::Ptr(0),
                        KernelArg::Workspace => KernelValue::Ptr(self.ranks[local].workspace.0),
                        KernelArg::Int(v) => KernelValue::I64(*v),
                        KernelArg::Float(v) => KernelValue::F64(*v),
                        KernelArg::RankOffset => KernelValue::I64(offset as i64),
                        KernelArg::RingKeyOffset => KernelValue::I64(crate::cpu::ring_key_offset(instr, &self.program, &self.mesh, rank).map_err(err)? as i64),
                        })
                    })
                    .collect::<Result<_, _>>()?;
                self.device.launch(kernel, *grid, *block, *shared_bytes, &values)
            }
            DeviceCall::Gemm(g) => {
                let (a, b, c) = (self.buffer_ptr(local, g.a), self.buffer_ptr(local, g.b), self.buffer_ptr(local, g.c));
                self.device.gemm(self.plan.dtype, &ColumnMajorGemm::of(g, a, b, c))
            }
            DeviceCall::GemmEpilogue { gemm: g, epilogue } => {
                let ptr = |b: Option<usize>| b.map_or(0, |b| self.buffer_ptr(local, b));
                let (a, b, c) = (self.buffer_ptr(local, g.a), self.buffer_ptr(local, g.b), self.buffer_ptr(local, g.c));
                let fused = device::DeviceEpilogue { bias: ptr(epilogue.bias), activation: epilogue.activation, aux: ptr(epilogue.aux) };
                gemm_with_epilogue(&*self.device, self.plan.dtype, &ColumnMajorGemm::of(g, a, b, c), &fused, g.batch * g.m * g.n, g.n)
            }
            DeviceCall::Copy { from, to } => self.copy(local, *from, *to),
            DeviceCall::Fused { .. } | DeviceCall::Runtime => Ok(()),
        }
    }

    /// `dst[o * dst_stride + j] = src[o * src_stride + j]` over bytes.
    fn copy_blocks(&self, dst: u64, dst_stride: usize, src: u64, src_stride: usize, outer: usize, block: usize) -> Result<(), RuntimeError> {
        if outer == 1 || (dst_stride == block && src_stride == block) {
            return self.copy_raw(dst, src, outer * block);
        }
        let grid = (outer * block).div_ceil(256).clamp(1, 65_535) as u32;
        let args = [KernelValue::Ptr(dst), KernelValue::I64(dst_stride as i64), KernelValue::Ptr(src), KernelValue::I64(src_stride as i64), KernelValue::I64(outer as i64), KernelValue::I64(block as i64)];
        self.device.launch("shardc_copy_blocks", [grid, 1, 1], 256, 0, &args)
    }

    /// `dst += src` (or `max`) over `n` elements of `dtype` (the module's float type, or fp32
    /// in a mixed-precision module).
    fn accumulate(&self, dst: u64, src: u64, n: usize, max: bool, dtype: DType) -> Result<(), RuntimeError> {
        let grid = n.div_ceil(256).clamp(1, 65_535) as u32;
        let args = [KernelValue::Ptr(dst), KernelValue::Ptr(src), KernelValue::I64(n as i64), KernelValue::I32(max as i32)];
        let kernel = if dtype == DType::F32 { "shardc_accumulate_f32" } else { "shardc_accumulate" };
        self.device.launch(kernel, [grid, 1, 1], 256, 0, &args)
    }

    fn staging(&mut self, bytes: usize) -> Result<u64, RuntimeError> {
        if self.staging.is_none_or(|s| s.1 < bytes) {
            if let Some((ptr, _)) = self.staging.take() {
                self.device.free(ptr);
            }
            self.staging = Some((self.device.alloc(bytes)?, bytes));
        }
        Ok(self.staging.map_or(0, |s| s.0))
    }

    /// `values` of every process of a multi-process run, in rank order (each gives as many):
    /// an all-gather over the world communicator, the device synchronised. It is how the
    /// processes agree outside the program, e.g. that every rank file of a checkpoint is
    /// written, with its checksum.
    pub fn gather_from_every_process(&mut self, values: &[i32]) -> Result<Vec<i32>, RuntimeError> {
        let world = match &self.nccl {
            Some(_) => self.mesh.ranks(),
            None => return Err(err("this executor is not one process of a multi-process run")),
        };
        let count = values.len();
        let staging = self.staging(count * 4 * (world + 1))?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.wait_for_device()?;
        self.device.upload(staging, &bytes)?;
        let stream = self.device.stream().cloned();
        let rank = self.ranks[0].rank;
        self.nccl.as_ref().ok_or_else(|| err("no NCCL communicator"))?.all_gather_world(staging, staging + (count * 4) as u64, count, DType::I32, rank, stream.as_deref())?;
        self.wait_for_device()?;
        let mut out = vec![0u8; count * 4 * world];
        self.device.download(&mut out, staging + (count * 4) as u64)?;
        Ok(out.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Collectives issued so far: one per collective instruction, or one per gradient
    /// bucket whose members share a region of the arena.
    pub fn collectives_issued(&self) -> usize {
        self.collectives_issued
    }

    /// Every group of ranks along `axes`, once, as local ranks (a pipeline rank's executor
    /// holds its dp x tp ranks, so its groups).
    fn local_groups(&self, axes: &[usize], op: &str) -> Result<Vec<Vec<usize>>, RuntimeError> {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for rank in self.ranks() {
            let g = self.mesh.group(rank, axes).iter().map(|r| self.ranks.iter().position(|m| m.rank == *r)).collect::<Option<Vec<usize>>>();
            let g = g.ok_or_else(|| err(format!("`{op}` spans ranks this device does not hold")))?;
            if !groups.contains(&g) {
                groups.push(g);
            }
        }
        Ok(groups)
    }

    /// A member of a gradient bucket with a region: its value moves into its place in the
    /// region (the input's storage may be reused at once); the last member reduces the whole
    /// region with one collective, on the communication stream under NCCL (joined at the
    /// bucket's `xf.wait`), in place among the ranks of this device otherwise.
    fn bucket_member(&mut self, index: usize, region: usize, last: bool) -> Result<(), RuntimeError> {
        let instr = &self.program.instrs[index];
        let (input, output) = (instr.inputs[0], instr.outputs[0]);
        let bytes = self.program.buffers[input].len() * self.program.buffers[input].dtype.bytes();
        for local in 0..self.ranks.len() {
            self.copy_raw(self.buffer_ptr(local, output), self.buffer_ptr(local, input), bytes)?;
        }
        if !last {
            return Ok(());
        }
        let events = self.reduce_region(region)?;
        let bucket = self.program.memory.buckets[region].bucket;
        if !events.is_empty() {
            self.buckets.entry(bucket).or_default().extend(events);
        }
        Ok(())
    }

    /// Runs a collective (or `tensor.empty`) of every local rank.
    fn collective(&mut self, index: usize) -> Result<(), RuntimeError> {
        let instr = self.program.instrs[index].clone();
        if instr.op == "tensor.empty" {
            let b = &self.program.buffers[instr.outputs[0]];
            for local in 0..self.ranks.len() {
                self.device.zero(self.buffer_ptr(local, instr.outputs[0]), b.len() * b.dtype.bytes())?;
            }
            return Ok(());
        }
        if let Some(&(region, last)) = self.bucket_regions.get(&index) {
            if self.program.pipeline.is_some() {
                return self.step_bucket_member(index, region);
            }
            return self.bucket_member(index, region, last);
        }
        self.collectives_issued += 1;
        if self.nccl.is_some() {
            return self.collective_nccl(index, &instr);
        }
        let axes: Vec<usize> = instr.ints("grid_axes").map_err(err)?.iter().map(|&a| a as usize).collect();
        let (input, output) = (self.program.buffers[instr.inputs[0]].clone(), self.program.buffers[instr.outputs[0]].clone());
        if input.dtype == DType::I32 && matches!(instr.op.as_str(), "shard.all_reduce" | "shard.reduce_scatter") {
            return Err(err("reductions of integer tensors are not supported on the GPU"));
        }
        let es = input.dtype.bytes();
        let (in_shape, out_shape) = (input.shape.clone(), output.shape.clone());
        let (in_bytes, out_bytes) = (input.len() * es, output.len() * es);
        let split = |axis: usize| -> (usize, usize) { (in_shape[..axis].iter().product(), in_shape[axis + 1..].iter().product::<usize>() * es) };
        let groups = self.local_groups(&axes, &instr.op)?;
        match instr.op.as_str() {
            "shard.all_reduce" | "shard.reduce_scatter" => {
                let max = matches!(instr.attrs.get("reduction"), Some(Attr::Str(k)) if k == "max");
                let staging = self.staging(in_bytes)?;
                for group in &groups {
                    // Sum (or max) in rank order into the staging buffer, then hand out:
                    // every rank gets the same bits.
                    self.copy_raw(staging, self.buffer_ptr(group[0], instr.inputs[0]), in_bytes)?;
                    for &r in &group[1..] {
                        self.accumulate(staging, self.buffer_ptr(r, instr.inputs[0]), input.len(), max, input.dtype)?;
                    }
                    for (position, &r) in group.iter().enumerate() {
                        if instr.op == "shard.all_reduce" {
                            self.copy_raw(self.buffer_ptr(r, instr.outputs[0]), staging, out_bytes)?;
                        } else {
                            let axis = instr.int("scatter_axis").map_err(err)? as usize;
                            let (outer, inner) = split(axis);
                            let block = out_shape[axis] * inner;
                            self.copy_blocks(self.buffer_ptr(r, instr.outputs[0]), block, staging + (position * block) as u64, in_shape[axis] * inner, outer, block)?;
                        }
                    }
                }
                Ok(())
            }
            "shard.all_gather" => {
                let axis = instr.int("gather_axis").map_err(err)? as usize;
                let (outer, inner) = split(axis);
                let block = in_shape[axis] * inner;
                for group in &groups {
                    for &r in group {
                        for (position, &source) in group.iter().enumerate() {
                            self.copy_blocks(self.buffer_ptr(r, instr.outputs[0]) + (position * block) as u64, out_shape[axis] * inner, self.buffer_ptr(source, instr.inputs[0]), block, outer, block)?;
                        }
                    }
                }
                Ok(())
            }
            "shard.all_slice" => {
                let axis = instr.int("slice_axis").map_err(err)? as usize;
                let (outer, inner) = split(axis);
                let block = out_shape[axis] * inner;
                for group in &groups {
                    for (position, &r) in group.iter().enumerate() {
                        self.copy_blocks(self.buffer_ptr(r, instr.outputs[0]), block, self.buffer_ptr(r, instr.inputs[0]) + (position * block) as u64, in_shape[axis] * inner, outer, block)?;
                    }
                }
                Ok(())
            }
            "shard.all_to_all" => {
                // Rank p's block k along the split axis becomes block p, along the concat
                // axis, of rank k's output: staged contiguous between the two layouts.
                let layout = AllToAll::of(&instr, &in_shape, &out_shape, es, groups.first().map_or(1, Vec::len)).map_err(err)?;
                let staging = self.staging(layout.part)?;
                for group in &groups {
                    for (p, &source) in group.iter().enumerate() {
                        for (k, &dest) in group.iter().enumerate() {
                            self.copy_blocks(staging, layout.split_block, self.buffer_ptr(source, instr.inputs[0]) + (k * layout.split_block) as u64, layout.split_stride, layout.split_outer, layout.split_block)?;
                            self.copy_blocks(self.buffer_ptr(dest, instr.outputs[0]) + (p * layout.concat_block) as u64, layout.concat_stride, staging, layout.concat_block, layout.concat_outer, layout.concat_block)?;
                        }
                    }
                }
                Ok(())
            }
            "shard.shift" => {
                // Every input of a group staged first (an output may share its rank's input's
                // storage), then each moved `offset` places on round the ring. Asynchronous
                // ones too, at once: without streams nothing overlaps.
                for group in &groups {
                    let n = group.len();
                    let offset = instr.int("offset").map_err(err)?.rem_euclid(n as i64) as usize;
                    let staging = self.staging(in_bytes * n)?;
                    for (position, &r) in group.iter().enumerate() {
                        self.copy_raw(staging + (position * in_bytes) as u64, self.buffer_ptr(r, instr.inputs[0]), in_bytes)?;
                    }
                    for position in 0..n {
                        self.copy_raw(self.buffer_ptr(group[(position + offset) % n], instr.outputs[0]), staging + (position * in_bytes) as u64, in_bytes)?;
                    }
                }
                Ok(())
            }
            "shard.broadcast" => {
                let root = instr.ints("root").map_err(err)?;
                let extents: Vec<usize> = axes.iter().map(|&a| self.mesh.0[a]).collect();
                let root = root.iter().zip(&extents).fold(0usize, |acc, (&r, &e)| acc * e + r as usize);
                let staging = self.staging(in_bytes)?;
                for group in &groups {
                    self.copy_raw(staging, self.buffer_ptr(group[root], instr.inputs[0]), in_bytes)?;
                    for &r in group {
                        self.copy_raw(self.buffer_ptr(r, instr.outputs[0]), staging, out_bytes)?;
                    }
                }
                Ok(())
            }
            other => Err(err(format!("`{other}` is not supported on the GPU"))),
        }
    }

    fn collective_nccl(&mut self, index: usize, instr: &Instr) -> Result<(), RuntimeError> {
        let rank = self.ranks[0].rank;
        let (input, output) = (self.buffer_ptr(0, instr.inputs[0]), self.buffer_ptr(0, instr.outputs[0]));
        if instr.bool("xf.async") == Ok(true) && matches!(instr.op.as_str(), "shard.reduce_scatter" | "shard.all_gather") {
            return self.group_member(index, instr, input, output);
        }
        if instr.op == "shard.shift" {
            return self.shift_nccl(instr, input, output);
        }
        if instr.op == "shard.all_to_all" {
            return self.all_to_all_nccl(instr, input, output);
        }
        let in_buffer = self.program.buffers[instr.inputs[0]].clone();
        let out_buffer = self.program.buffers[instr.outputs[0]].clone();
        // What the collective rearranges on the device (a gather or scatter along an inner
        // dimension), the group's whole tensor: none for the rest.
        let staging = match self.program.nccl_staging_bytes(index) {
            (0, _) => 0,
            (bytes, _) => self.staging(bytes)?,
        };
        // None on the emulated device: its collectives run at once.
        let stream = self.device.stream().cloned();
        let comms = self.nccl.as_ref().ok_or_else(|| err("no NCCL communicator"))?;
        let bucket = instr.int("xf.bucket").ok().filter(|_| instr.bool("xf.async").unwrap_or(false) && instr.op == "shard.all_reduce");
        if let (Some(bucket), Some(stream)) = (bucket, &stream) {
            // An asynchronous all-reduce (a bucket member without a region): its value moves
            // to the output now (the input's slot may be reused at once), and the sum runs
            // in place on its communicator's stream while the compute stream goes on; the
            // bucket's `xf.wait` joins them.
            let bytes = in_buffer.len() * in_buffer.dtype.bytes();
            self.copy_raw(output, input, bytes)?;
            let axes: Vec<usize> = instr.ints("grid_axes").map_err(err)?.iter().map(|&a| a as usize).collect();
            if let Some(done) = comms.all_reduce_in_place(&axes, output, out_buffer.len(), out_buffer.dtype, rank, Some(stream))? {
                self.buckets.entry(bucket).or_default().push(done);
            }
            return Ok(());
        }
        comms.run(instr, rank, &self.mesh, &in_buffer, &out_buffer, input, output, staging, stream.as_deref(), |dst, ds, src, ss, outer, block| self.copy_blocks(dst, ds, src, ss, outer, block))
    }

    /// A member of a reduce-scatter or all-gather bucket (along dimension 0, checked by
    /// [`Program::validate`]) under NCCL: held until the bucket's last member is reached,
    /// then the whole bucket goes out as one NCCL group on the communication stream, after
    /// what the compute stream has queued, and the bucket's `xf.wait` joins it (the memory
    /// plan keeps every member's input and output alive until then). The emulated device
    /// runs the group at once.
    fn group_member(&mut self, index: usize, instr: &Instr, input: u64, output: u64) -> Result<(), RuntimeError> {
        let bucket = instr.int("xf.bucket").map_err(err)?;
        let members = instr.int("xf.bucket_members").map_err(err)?;
        let gather = instr.op == "shard.all_gather";
        let (in_buffer, out_buffer) = (&self.program.buffers[instr.inputs[0]], &self.program.buffers[instr.outputs[0]]);
        let axes: Vec<usize> = instr.ints("grid_axes").map_err(err)?.iter().map(|&a| a as usize).collect();
        let (in_shape, out_shape, dtype, count) = (in_buffer.shape.clone(), out_buffer.shape.clone(), in_buffer.dtype, if gather { in_buffer.len() } else { out_buffer.len() });
        let mut send = input;
        let axis = instr.int(if gather { "gather_axis" } else { "scatter_axis" }).map_err(err)? as usize;
        if !gather && in_shape[..axis].iter().product::<usize>() > 1 {
            // A scatter along an inner dimension (alone in its bucket, validated): its blocks
            // staged as [n][outer][chunk] in a buffer of its own, which nothing else touches
            // while the transfer reads it.
            let es = dtype.bytes();
            let (outer, inner) = (in_shape[..axis].iter().product::<usize>(), in_shape[axis + 1..].iter().product::<usize>() * es);
            let block = out_shape[axis] * inner;
            let bytes = in_shape.iter().product::<usize>() * es;
            let staging = match self.async_staging.get(&index) {
                Some(&(ptr, size)) if size >= bytes => ptr,
                _ => {
                    let ptr = self.device.alloc(bytes)?;
                    if let Some((old, _)) = self.async_staging.insert(index, (ptr, bytes)) {
                        self.device.free(old);
                    }
                    ptr
                }
            };
            let n = in_shape[axis] / out_shape[axis].max(1);
            for r in 0..n {
                self.copy_blocks(staging + (r * count * es) as u64, block, input + (r * block) as u64, in_shape[axis] * inner, outer, block)?;
            }
            send = staging;
        }
        let member = nccl::GroupMember { gather, axes, send, recv: output, count, dtype };
        let pending = self.pending_groups.entry(bucket).or_default();
        pending.push(member);
        // A bucket's members count as one collective, issued with the last.
        if (pending.len() as i64) < members {
            self.collectives_issued -= 1;
            return Ok(());
        }
        let group = self.pending_groups.remove(&bucket).unwrap_or_default();
        let comms = self.nccl.as_ref().ok_or_else(|| err("no NCCL communicator"))?;
        let stream = self.device.stream().cloned();
        if let Some(done) = comms.run_group(&group, self.ranks[0].rank, stream.as_deref())? {
            self.buckets.entry(bucket).or_default().push(done);
        }
        Ok(())
    }

    /// A shift of this process's rank: at once (the compute stream waits for it), or, a member
    /// of an asynchronous bucket, held until the bucket's last member and then sent with the
    /// others as one NCCL group on the cp communicator's stream, which the bucket's `xf.wait`
    /// joins (the memory plan keeps every member's input and output until then).
    /// An all-to-all as one NCCL group of sends and receives on its communicator's stream
    /// (`ncclSend`/`ncclRecv` to and from every peer, as NCCL's own all-to-all pattern): each
    /// part staged contiguous, sent to its peer, and received parts placed along the concat
    /// axis.
    fn all_to_all_nccl(&mut self, instr: &Instr, input: u64, output: u64) -> Result<(), RuntimeError> {
        let rank = self.ranks[0].rank;
        let axes: Vec<usize> = instr.ints("grid_axes").map_err(err)?.iter().map(|&a| a as usize).collect();
        let group = self.mesh.group(rank, &axes);
        let n = group.len();
        let p = group.iter().position(|&r| r == rank).ok_or_else(|| err("a rank outside its own group"))?;
        let (in_buffer, out_buffer) = (self.program.buffers[instr.inputs[0]].clone(), self.program.buffers[instr.outputs[0]].clone());
        let layout = AllToAll::of(instr, &in_buffer.shape, &out_buffer.shape, in_buffer.dtype.bytes(), n).map_err(err)?;
        let staging = self.staging(2 * n * layout.part)?;
        let (sent, received) = (staging, staging + (n * layout.part) as u64);
        for k in 0..n {
            self.copy_blocks(sent + (k * layout.part) as u64, layout.split_block, input + (k * layout.split_block) as u64, layout.split_stride, layout.split_outer, layout.split_block)?;
        }
        self.copy_raw(received + (p * layout.part) as u64, sent + (p * layout.part) as u64, layout.part)?;
        let members: Vec<nccl::ShiftMember> = (1..n)
            .map(|s| {
                let (to, from) = ((p + s) % n, (p + n - s) % n);
                nccl::ShiftMember { axes: axes.clone(), send: sent + (to * layout.part) as u64, recv: received + (from * layout.part) as u64, bytes: layout.part, to: (to, group[to]), from: (from, group[from]) }
            })
            .collect();
        let stream = self.device.stream().cloned();
        self.nccl.as_ref().ok_or_else(|| err("no NCCL communicator"))?.shift(&members, rank, stream.as_deref(), true)?;
        for k in 0..n {
            self.copy_blocks(output + (k * layout.concat_block) as u64, layout.concat_stride, received + (k * layout.part) as u64, layout.concat_block, layout.concat_outer, layout.concat_block)?;
        }
        Ok(())
    }

    fn shift_nccl(&mut self, instr: &Instr, input: u64, output: u64) -> Result<(), RuntimeError> {
        let rank = self.ranks[0].rank;
        let axes: Vec<usize> = instr.ints("grid_axes").map_err(err)?.iter().map(|&a| a as usize).collect();
        let group = self.mesh.group(rank, &axes);
        let n = group.len();
        let position = group.iter().position(|&r| r == rank).ok_or_else(|| err("a rank outside its own group"))?;
        let offset = instr.int("offset").map_err(err)?.rem_euclid(n as i64) as usize;
        let buffer = &self.program.buffers[instr.inputs[0]];
        let bytes = buffer.len() * buffer.dtype.bytes();
        if offset == 0 {
            return self.copy_raw(output, input, bytes);
        }
        let (to, from) = ((position + offset) % n, (position + n - offset) % n);
        let member = nccl::ShiftMember { axes, send: input, recv: output, bytes, to: (to, group[to]), from: (from, group[from]) };
        let stream = self.device.stream().cloned();
        if instr.bool("xf.async") != Ok(true) {
            self.nccl.as_ref().ok_or_else(|| err("no NCCL communicator"))?.shift(&[member], rank, stream.as_deref(), true)?;
            return Ok(());
        }
        let bucket = instr.int("xf.bucket").map_err(err)?;
        let members = instr.int("xf.bucket_members").map_err(err)?;
        let pending = self.pending_shifts.entry(bucket).or_default();
        pending.push(member);
        // A bucket's shifts count as one collective, issued with the last.
        if (pending.len() as i64) < members {
            self.collectives_issued -= 1;
            return Ok(());
        }
        let shifts = self.pending_shifts.remove(&bucket).unwrap_or_default();
        if let Some(done) = self.nccl.as_ref().ok_or_else(|| err("no NCCL communicator"))?.shift(&shifts, rank, stream.as_deref(), false)? {
            self.buckets.entry(bucket).or_default().push(done);
        }
        Ok(())
    }

    /// Before an `xf.wait`: the compute stream waits for its bucket's all-reduces.
    fn wait_for_bucket(&mut self, index: usize) -> Result<(), RuntimeError> {
        let instr = &self.program.instrs[index];
        if instr.op != "xf.wait" {
            return Ok(());
        }
        if instr.int("xf.bucket").is_ok_and(|b| self.pending_groups.contains_key(&b) || self.pending_shifts.contains_key(&b)) {
            return Err(err(format!("`{}` waits for a bucket whose last member has not been issued", instr.loc)));
        }
        let Some(events) = instr.int("xf.bucket").ok().and_then(|b| self.buckets.remove(&b)) else { return Ok(()) };
        let stream = self.device.stream().cloned().ok_or_else(|| err("no GPU stream"))?;
        for event in &events {
            stream.wait(event).map_err(|e| err(format!("{e:?}")))?;
        }
        Ok(())
    }

    /// Bytes of device memory this executor holds (all local ranks).
    pub fn device_bytes(&self) -> usize {
        self.ranks.iter().map(|r| r.slots.iter().map(|s| s.1).sum::<usize>() + r.arena.1 + r.workspace.1).sum()
    }

    /// The most bytes of device memory this executor has held at once (all local ranks,
    /// and the device's cuBLASLt workspace): every slot, arena, hold, transfer copy and
    /// staging buffer it allocated, measured as it allocates and frees them.
    pub fn peak_device_bytes(&self) -> usize {
        self.device.peak()
    }
}

/// What a checkpoint holds of `name` on local rank `local`: a bf16 parameter's fp32 master
/// value where the rank holds the master whole (as a checkpoint of the global state writes
/// it), else the values the device holds (under ZeRO the master is a shard of other ranks'
/// rows; its own entry keeps the fp32 values a resume reads).
fn read_for_checkpoint(exec: &CudaExecutor, local: usize, name: &str) -> Result<Vec<f64>, RuntimeError> {
    let program = exec.program();
    let master = shardc_ir::facts::master_name(name);
    match (program.arg(name), program.arg(&master)) {
        (Some(p), Some(m)) if program.buffers[p.buffer].len() == program.buffers[m.buffer].len() => exec.read(local, &master),
        _ => exec.read(local, name),
    }
}

/// f64 values as the bytes of `dtype` (bf16 rounded to nearest even).
pub fn encode(values: &[f64], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.bytes());
    for &v in values {
        match dtype {
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            DType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
            DType::Bf16 => out.extend_from_slice(&bf16_bits(v as f32).to_le_bytes()),
        }
    }
    out
}

/// The bytes of `dtype` as f64 values.
pub fn decode(bytes: &[u8], dtype: DType) -> Vec<f64> {
    let size = dtype.bytes();
    bytes
        .chunks_exact(size)
        .map(|c| match dtype {
            DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
            DType::F64 => f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]),
            DType::I32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
            DType::Bf16 => f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64,
        })
        .collect()
}

/// An f32 rounded to bf16 (nearest, ties to even), as the device kernels do.
pub fn bf16_bits(f: f32) -> u16 {
    let u = f.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return 0x7fc0;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// What a GPU training run produced.
#[derive(Debug, Clone)]
pub struct CudaRun {
    /// Loss of each step.
    pub losses: Vec<f64>,
    /// Every parameter, reassembled from the ranks' shards: (name, global shape, values).
    pub parameters: Vec<(String, Vec<usize>, Vec<f64>)>,
    /// Wall time of each step (seconds), the device synchronised at its end.
    pub step_seconds: Vec<f64>,
    /// The GPU.
    pub device: String,
}

/// Trains `program` (a `train_step` with a device plan) for `steps` steps on `placement`:
/// parameters initialised as global tensors from `seed` and sharded, the same batches as the
/// CPU runs, so the results are comparable with [`crate::train::train_spmd`].
pub fn train(program: &Program, seed: u64, layers: usize, corpus: &crate::data::Corpus, steps: u64, placement: &Placement) -> Result<CudaRun, RuntimeError> {
    train_programs(std::slice::from_ref(program), seed, layers, corpus, steps, placement)
}

/// [`train`] for one program per pipeline rank (every rank on the placement's device).
pub fn train_programs(programs: &[Program], seed: u64, layers: usize, corpus: &crate::data::Corpus, steps: u64, placement: &Placement) -> Result<CudaRun, RuntimeError> {
    let mut trainer = CudaTrainer::new(programs, placement, seed, layers, None)?;
    let (mut losses, mut step_seconds) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let (loss, seconds) = trainer.step(corpus)?;
        losses.push(loss);
        step_seconds.push(seconds);
    }
    Ok(CudaRun { losses, parameters: trainer.parameters()?, step_seconds, device: trainer.device_name() })
}

/// A training run on the GPU(s) of a placement, one step at a time: the CUDA peer of the CPU
/// backend's [`crate::train::Trainer`], rank threads and pipeline runtime, with the same
/// batches, step counter and state, so a run can start from a checkpoint, a saved file or
/// Hugging Face weights and be checkpointed as it goes. One executor per pipeline rank
/// (one in all without stages); with a schedule, each walks its items as the CPU pipeline
/// runtime does, kept values and gradient sums held in device memory, and on one device the
/// pipeline ranks' executors take turns, each running until a receive waits for a send.
pub struct CudaTrainer {
    runners: Vec<Runner>,
    /// The programs this process runs, one per runner.
    programs: Vec<Program>,
    /// Every pipeline rank's program (what a checkpoint's manifest lists).
    every_program: Vec<Program>,
    /// A process of a multi-process pipeline: what each peer process sends it in a step, in
    /// the order it sends (see [`CudaExecutor::expect_receives`]).
    incoming: HashMap<usize, Vec<(u64, usize)>>,
    mesh: MeshShape,
    seed: u64,
    step: u64,
    /// Global rows of a micro-batch, and the sequence length.
    rows: usize,
    seq: usize,
    /// The schedule of programs that run in micro-batches (pipeline stages or gradient
    /// accumulation).
    schedule: Option<crate::schedule::Schedule>,
}

/// One pipeline rank's executor and its gradient sums, kept from step to step.
struct Runner {
    exec: CudaExecutor,
    sums: Vec<Option<HoldId>>,
    sums_weight: Vec<Option<HoldId>>,
}

impl std::fmt::Debug for CudaTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTrainer").field("pipeline_ranks", &self.runners.len()).field("step", &self.step).finish()
    }
}

/// Where one pipeline rank is in a step: its next item, the instructions of the one it runs
/// (stopped at a receive that waits), and what it holds per micro-batch.
#[derive(Default)]
struct Walk {
    position: usize,
    /// (instructions, how many have run, the item; `None`: the step section).
    running: Option<(Vec<usize>, usize, Option<crate::schedule::Item>)>,
    step_started: bool,
    done: bool,
    /// Per (chunk, micro-batch) whose forward (split backward) has begun: the set its kept
    /// values are in (none where the chunk keeps none).
    kept_forward: HashMap<(usize, usize), Option<KeptId>>,
    kept_backward: HashMap<(usize, usize), Option<KeptId>>,
    summing: Vec<bool>,
    summing_weight: Vec<bool>,
    /// Whether the running item is its chunk's last backward work of the step, and where its
    /// step buckets go out then (see [`Program::step_bucket_triggers`]), the next first.
    last_backward: bool,
    triggers: Vec<(usize, usize)>,
}

impl CudaTrainer {
    /// Loads `programs` (one training step, or one program per pipeline rank) onto
    /// `placement` and writes their state on every local rank: `state`'s global tensors (from
    /// step `state.step`), or parameters and master copies initialised from `seed` and zero
    /// moments (step 0).
    pub fn new(programs: &[Program], placement: &Placement, seed: u64, layers: usize, state: Option<&crate::train::TrainState>) -> Result<CudaTrainer, RuntimeError> {
        let first = programs.first().ok_or_else(|| err("no programs to run"))?;
        let mesh = MeshShape(if first.mesh.is_empty() { vec![1] } else { first.mesh.clone() });
        CudaTrainer::load(programs, placement, state.map_or(0, |s| s.step), |program, a, global_shape, rank| {
            Ok(match (state, &a.layout) {
                (Some(state), Some(layout)) => crate::layout::local_shard(&state.for_program(a, global_shape)?, layout, &mesh, rank),
                (Some(state), None) => state.for_program(a, global_shape)?,
                // Parameters and their fp32 master copies start from the seed, each rank's
                // shard made from global indices alone; moments at 0.
                (None, _) if matches!(a.role, Some(Role::Param | Role::Master)) => crate::init::init_shard(a, global_shape, &mesh, rank, seed, layers),
                (None, _) => vec![0.0; program.buffers[a.buffer].len()],
            })
        })
        .map(|t| CudaTrainer { seed, ..t })
    }

    /// Loads `programs` onto `placement` and resumes from the checkpoint `dir` names at its
    /// step, each local rank reading its own shards, one tensor at a time, from the rank
    /// files that hold them ([`crate::checkpoint::ShardReader`]; the checkpoint's mesh may
    /// differ): no process holds more of the state on the host than the shard it uploads.
    /// Returns the checkpoint's manifest too.
    pub fn resume(programs: &[Program], placement: &Placement, dir: &std::path::Path) -> Result<(CudaTrainer, crate::checkpoint::Manifest), RuntimeError> {
        let first = programs.first().ok_or_else(|| err("no programs to run"))?;
        let mesh = MeshShape(if first.mesh.is_empty() { vec![1] } else { first.mesh.clone() });
        // The checkpoint `LATEST` names now, read from that folder alone.
        let (dir, manifest) = crate::checkpoint::resolve(dir)?;
        let mut reader = Some(crate::checkpoint::ShardReader::open(&dir));
        // A failure to read is said by `load`, once every process has got that far.
        let trainer = CudaTrainer::load(programs, placement, manifest.step, |program, a, _, rank| match reader.take() {
            Some(Err(e)) => Err(e),
            Some(Ok(open)) => {
                let shard = open.shard(program, a, &mesh, rank);
                reader = Some(Ok(open));
                shard
            }
            None => Err(err("the checkpoint could not be read")),
        })?;
        Ok((CudaTrainer { seed: manifest.seed, ..trainer }, manifest))
    }

    /// Loads `programs` onto `placement` at step 0 from parameters given whole one at a time:
    /// `parameter(name)` is a parameter's (shape, values) as the model has them (a padded
    /// vocabulary's real rows), or `None` when the source lacks it. Each local rank keeps only
    /// its shard; fp32 masters start as their parameter and moments at zero. What a process of
    /// a multi-process run does with `--load` or Hugging Face weights: no tensor stays whole.
    pub fn from_parameters(programs: &[Program], placement: &Placement, seed: u64, parameter: &mut dyn FnMut(&str) -> Result<Option<crate::tensor_file::Tensor>, RuntimeError>) -> Result<CudaTrainer, RuntimeError> {
        let first = programs.first().ok_or_else(|| err("no programs to run"))?;
        let mesh = MeshShape(if first.mesh.is_empty() { vec![1] } else { first.mesh.clone() });
        // The parameter last read: its master and every local rank take it next.
        let mut last: Option<(String, Vec<f64>)> = None;
        let trainer = CudaTrainer::load(programs, placement, 0, |program, a, global_shape, rank| {
            let name = match (a.role, crate::program::master_of(&a.name)) {
                (Some(Role::Master), Some(param)) => param.to_string(),
                (Some(Role::Param), _) => a.name.clone(),
                _ => return Ok(vec![0.0; program.buffers[a.buffer].len()]),
            };
            let logical = a.logical_shape(global_shape);
            if last.as_ref().is_none_or(|(n, _)| *n != name) {
                let (shape, values) = parameter(&name)?.ok_or_else(|| RuntimeError::Binding(format!("the weights have no `{name}`, a parameter of this model")))?;
                if shape != logical {
                    return Err(RuntimeError::Binding(format!("`{name}` has shape {shape:?} in the weights, the model needs {logical:?}")));
                }
                last = Some((name, a.to_program(&values, global_shape)));
            }
            let global = &last.as_ref().expect("read above").1;
            Ok(match &a.layout {
                Some(layout) => crate::layout::local_shard(global, layout, &mesh, rank),
                None => global.clone(),
            })
        })?;
        Ok(CudaTrainer { seed, ..trainer })
    }

    /// Loads `programs` onto `placement` at step `step`, every state argument of every local
    /// rank written with `value(program, argument, global shape, rank)` (the rank's shard).
    fn load(programs: &[Program], placement: &Placement, step: u64, mut value: impl FnMut(&Program, &crate::program::Binding, &[usize], usize) -> Result<Vec<f64>, RuntimeError>) -> Result<CudaTrainer, RuntimeError> {
        let first = programs.first().ok_or_else(|| err("no programs to run"))?;
        let mesh = MeshShape(if first.mesh.is_empty() { vec![1] } else { first.mesh.clone() });
        let schedule = if first.pipeline.is_some() { Some(crate::pipeline::schedule_of(programs)?) } else { None };
        if schedule.is_none() && programs.len() > 1 {
            return Err(err("several programs that are not pipeline ranks"));
        }
        let mailbox = SharedMailbox::default();
        let mut runners = Vec::new();
        let mut own = Vec::new();
        let mut failure: Option<RuntimeError> = None;
        // A process of a multi-process run runs its own pipeline rank's program only.
        let process_rank = match placement {
            Placement::Nccl(b) => Some(b.rank),
            Placement::EmulatedNccl(w) => Some(w.rank()),
            Placement::SingleDevice { .. } | Placement::Emulated => None,
        };
        for program in programs {
            let pipeline_rank = program.pipeline.as_ref().filter(|p| p.ranks > 1).map(|p| p.rank);
            if let (Some(rank), Some(p)) = (process_rank, pipeline_rank)
                && mesh.coords(rank).get(2) != Some(&p)
            {
                continue;
            }
            own.push(program.clone());
            let mut exec = CudaExecutor::new(program.clone(), placement)?;
            exec.set_mailbox(mailbox.clone());
            let chunks = program.pipeline.as_ref().map_or(0, |p| p.chunks.len());
            for a in program.args.iter().filter(|a| a.role.is_some_and(Role::is_state)) {
                let global_shape = a.layout.as_ref().map_or_else(|| program.buffers[a.buffer].shape.clone(), |l| l.global_shape.clone());
                for (local, rank) in exec.ranks().into_iter().enumerate() {
                    if failure.is_some() {
                        break;
                    }
                    match value(program, a, &global_shape, rank) {
                        Ok(shard) => exec.write(local, &a.name, &shard)?,
                        // One process's failure must reach the others: it is said after every
                        // process has loaded (or failed to).
                        Err(e) if process_rank.is_some() => failure = Some(e),
                        Err(e) => return Err(e),
                    }
                }
            }
            runners.push(Runner { exec, sums: vec![None; chunks], sums_weight: vec![None; chunks] });
        }
        let batch = programs.iter().find_map(|p| p.arg("tokens").or_else(|| p.arg("targets"))).ok_or_else(|| RuntimeError::Binding("no program reads `tokens` or `targets`".into()))?;
        let shape = batch.layout.as_ref().map_or_else(|| programs[0].buffers[batch.buffer].shape.clone(), |l| l.global_shape.clone());
        let incoming = match (process_rank, &schedule) {
            (Some(rank), Some(schedule)) => incoming_sends(programs, schedule, &mesh, rank),
            _ => HashMap::new(),
        };
        let mut trainer = CudaTrainer { runners, programs: own, every_program: programs.to_vec(), incoming, mesh, seed: 0, step, rows: shape[0], seq: shape[1], schedule };
        if let Some(rank) = process_rank {
            // Every process learns whether all loaded, and from which step.
            let all = trainer.gather_from_every_process(&[i32::from(failure.is_none()), (step & 0x7fff_ffff) as i32]);
            // A process's own failure is its error even when the gather fails too (the
            // others, having learnt of it, may end before the gather does).
            if let Some(e) = failure {
                return Err(err(format!("rank {rank} could not load its state: {e}")));
            }
            let all = all?;
            if let Some(failed) = all.chunks_exact(2).position(|p| p[0] == 0) {
                return Err(err(format!("{ANOTHER_PROCESS_FAILED}rank {failed} could not load its state (its own error says why)")));
            }
            if let Some(other) = all.chunks_exact(2).position(|p| p[1] != all[1]) {
                return Err(err(format!("rank 0 starts at step {} and rank {other} at step {}: the processes read different checkpoints (did another run write into the folder while they read it?)", all[1], all[2 * other + 1])));
            }
        }
        Ok(trainer)
    }

    /// This process's rank when it is one process of a multi-process run (NCCL, or its
    /// emulation); `None` when it holds every rank.
    pub fn process_rank(&self) -> Option<usize> {
        if self.holds_every_rank() { None } else { self.runners.first().and_then(|r| r.exec.ranks().first().copied()) }
    }

    /// `values` of every process of a multi-process run, in rank order
    /// ([`CudaExecutor::gather_from_every_process`]).
    pub fn gather_from_every_process(&mut self, values: &[i32]) -> Result<Vec<i32>, RuntimeError> {
        self.runners.first_mut().ok_or_else(|| err("no programs"))?.exec.gather_from_every_process(values)
    }

    /// One process of a multi-process run checkpoints into `dir`: it writes its rank's file
    /// from device memory, the processes exchange their files' checksums (and whether they
    /// wrote them), and rank 0 writes the manifest and commits the checkpoint; then every
    /// process learns whether rank 0 did. A failure on any rank ends every rank with an error
    /// naming it. `abort` kills this process after its file is written (fault injection).
    pub fn checkpoint_own_shards(&mut self, dir: &std::path::Path, spec: serde_json::Value, data: Option<crate::data::DataRecord>, abort: bool) -> Result<Option<std::path::PathBuf>, RuntimeError> {
        self.write_own_shards(dir, spec, data, abort, false)
    }

    /// [`CudaTrainer::checkpoint_own_shards`] of the parameters alone (and their fp32
    /// masters), each shard written once, by the lowest rank holding it: rank files to
    /// assemble whole parameters from (a multi-process run's `--save`), a fraction of a
    /// checkpoint's size, not to resume from.
    pub fn write_own_parameter_shards(&mut self, dir: &std::path::Path) -> Result<Option<std::path::PathBuf>, RuntimeError> {
        self.write_own_shards(dir, serde_json::Value::Null, None, false, true)
    }

    fn write_own_shards(&mut self, dir: &std::path::Path, spec: serde_json::Value, data: Option<crate::data::DataRecord>, abort: bool, parameters_only: bool) -> Result<Option<std::path::PathBuf>, RuntimeError> {
        let rank = self.process_rank().ok_or_else(|| err("this process holds every rank: save the global state with checkpoint::save_sharded"))?;
        let program_index = if self.every_program.len() == 1 { 0 } else { self.mesh.coords(rank).get(PP_AXIS).copied().unwrap_or(0) };
        // Every rank has reached the checkpoint before any writes (rank 0 cleared the folder
        // of what crashed runs left when it took it).
        self.gather_from_every_process(&[0])?;
        let runner = &self.runners[0];
        let written = crate::checkpoint::write_own_rank_file(dir, self.step, &self.every_program, rank, parameters_only, |binding| {
            let program = runner.exec.program();
            if program.arg(&binding.name).is_none() {
                return Err(err(format!("rank {rank}'s program (pipeline rank {program_index}) has no `{}`", binding.name)));
            }
            read_for_checkpoint(&runner.exec, 0, &binding.name)
        });
        if abort && written.is_ok() {
            std::process::abort();
        }
        // [ok, crc] from every rank: a rank that failed says so instead of leaving the others
        // waiting for its file.
        let (ok, crc) = match &written {
            Ok(crc) => (1, *crc as i32),
            Err(_) => (0, 0),
        };
        let all = self.gather_from_every_process(&[ok, crc]);
        // As when loading: a failed write is this rank's own error, whatever the gather did.
        written.map_err(|e| match e {
            // Said as a run of one process says it (the CLI adds what to do).
            e @ RuntimeError::NonFiniteState { .. } => e,
            e => err(format!("rank {rank} could not write its checkpoint file: {e}")),
        })?;
        let all = all?;
        if let Some(failed) = all.chunks_exact(2).position(|p| p[0] == 0) {
            return Err(err(format!("{ANOTHER_PROCESS_FAILED}rank {failed} could not write its checkpoint file; the checkpoint of step {} is not kept", self.step)));
        }
        let committed = if rank == 0 {
            let checksums = all.chunks_exact(2).map(|p| p[1] as u32).collect();
            Some(crate::checkpoint::commit_processes(dir, self.step, &self.every_program, spec, self.seed, data, checksums))
        } else {
            None
        };
        let done = self.gather_from_every_process(&[i32::from(committed.as_ref().is_none_or(|c| c.is_ok()))])?;
        match committed {
            Some(path) => path.map(Some),
            None if done[0] == 1 => Ok(None),
            None => Err(err(format!("{ANOTHER_PROCESS_FAILED}rank 0 could not commit the checkpoint of step {}", self.step))),
        }
    }

    /// Checkpoints a process that holds every rank ([`crate::checkpoint::save_sharded`]'s
    /// files and manifest), each rank's file written from its shards in device memory, one
    /// tensor at a time: the global state is never assembled on the host.
    pub fn checkpoint_every_rank(&self, dir: &std::path::Path, spec: serde_json::Value, data: Option<crate::data::DataRecord>, abort_after_rank: Option<usize>) -> Result<std::path::PathBuf, RuntimeError> {
        if !self.holds_every_rank() {
            return Err(err("this process holds only its own shards: checkpoint with checkpoint_own_shards"));
        }
        // Global rank -> (runner, its local index).
        let mut at = vec![None; self.mesh.ranks()];
        for (r, runner) in self.runners.iter().enumerate() {
            for (local, rank) in runner.exec.ranks().into_iter().enumerate() {
                if let Some(slot) = at.get_mut(rank) {
                    *slot = Some((r, local));
                }
            }
        }
        crate::checkpoint::save_rank_shards(dir, self.step, &self.every_program, spec, self.seed, data, abort_after_rank, |rank, tensor, _| {
            let (r, local) = at.get(rank).copied().flatten().ok_or_else(|| err(format!("no executor of this process holds rank {rank}")))?;
            read_for_checkpoint(&self.runners[r].exec, local, &tensor.name)
        })
    }

    /// The run's seed (initialisation and data order; a resumed run's is its checkpoint's).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Optimizer steps taken (from the start of training).
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// The GPU, or its emulation.
    pub fn device_name(&self) -> String {
        self.runners[0].exec.device_name()
    }

    /// Per pipeline rank this process runs: its program's pipeline rank (0 without stages),
    /// the mesh ranks its executor runs, and the most device bytes that executor has held at
    /// once (see [`CudaExecutor::peak_device_bytes`]).
    pub fn peak_device_bytes(&self) -> Vec<(usize, Vec<usize>, usize)> {
        self.runners.iter().zip(&self.programs).map(|(r, p)| (p.pipeline.as_ref().map_or(0, |p| p.rank), r.exec.ranks(), r.exec.peak_device_bytes())).collect()
    }

    /// Whether this process holds every rank (one device, or its emulation), and so the
    /// whole state; a process of a multi-process NCCL run holds its own shards only.
    pub fn holds_every_rank(&self) -> bool {
        self.runners.iter().map(|r| r.exec.ranks().len()).sum::<usize>() == self.mesh.ranks()
    }

    /// Runs one optimizer step on the next batch of `corpus` (the batch the CPU backend takes
    /// at that step); returns its loss and wall seconds, the device synchronised at its end.
    pub fn step(&mut self, corpus: &crate::data::Corpus) -> Result<(f64, f64), RuntimeError> {
        corpus.check_seq(self.seq)?;
        let step = self.step + 1;
        let counter = i32::try_from(step).map_err(|_| RuntimeError::Binding("step counter overflow".into()))?;
        let microbatches = self.schedule.as_ref().map_or(1, |s| s.microbatches);
        let (t, g) = corpus.batch(self.seed, step, self.rows * microbatches);
        let (t, g): (Vec<f64>, Vec<f64>) = (t.iter().map(|&v| v as f64).collect(), g.iter().map(|&v| v as f64).collect());
        for runner in &mut self.runners {
            if runner.exec.program().arg("step").is_some() {
                for local in 0..runner.exec.ranks().len() {
                    runner.exec.write(local, "step", &[counter as f64])?;
                }
            }
        }
        let began = std::time::Instant::now();
        let loss = if self.schedule.is_some() {
            self.scheduled_step(step, &t, &g)?
        } else {
            self.write_batch(0, &t, &g, 0)?;
            self.runners[0].exec.run()?;
            self.runners[0].exec.read(0, "loss")?[0]
        };
        for runner in &mut self.runners {
            runner.exec.carry_state()?;
            runner.exec.reclaim_sends();
            runner.exec.synchronize()?;
        }
        let seconds = began.elapsed().as_secs_f64();
        self.step = step;
        Ok((loss, seconds))
    }

    /// The model's mean loss over the first `windows` validation windows of `corpus`,
    /// computed on the devices from this process's own shards with the step's forward alone:
    /// each pipeline rank's forward sections, micro-batch after micro-batch (Megatron-LM's
    /// forward-only schedule), or a step without sections up to where its loss is made
    /// ([`Program::loss_partial`]). Batches are the step's micro-batch over its replicas;
    /// every window counts: the last, partial batch is filled with copies of its first
    /// window, whose own loss (a batch of its copies alone) is taken out again. The run's
    /// state is left as it was; every process returns the same loss.
    pub fn evaluate(&mut self, corpus: &crate::data::Corpus, windows: usize) -> Result<f64, RuntimeError> {
        corpus.check_seq(self.seq)?;
        let (rows, windows) = (self.rows, windows.min(corpus.validation_windows() as usize));
        if windows == 0 || rows == 0 {
            return Err(RuntimeError::Binding("no validation windows to evaluate on: hold out some with --eval-fraction".into()));
        }
        let (full, left) = (windows / rows, windows % rows);
        let batches = full + if left > 0 { 2 } else { 0 };
        // Batch `b`'s tokens and targets, and the weight of its mean loss in the windows' sum.
        let batch = |b: usize| -> (Vec<f64>, Vec<f64>, f64) {
            let widen = |(t, g): (Vec<i32>, Vec<i32>)| -> (Vec<f64>, Vec<f64>) { (t.into_iter().map(f64::from).collect(), g.into_iter().map(f64::from).collect()) };
            if b < full {
                let (t, g) = widen(corpus.validation_batch(b * rows, rows));
                return (t, g, rows as f64);
            }
            let first = full * rows;
            // The partial batch, then its first window's copies alone.
            let (real, weight) = if b == full { (left, rows as f64) } else { (0, -((rows - left) as f64)) };
            let (mut t, mut g) = if real > 0 { widen(corpus.validation_batch(first, real)) } else { (Vec::new(), Vec::new()) };
            let (t0, g0) = widen(corpus.validation_batch(first, 1));
            for _ in real..rows {
                t.extend_from_slice(&t0);
                g.extend_from_slice(&g0);
            }
            (t, g, weight)
        };
        let step = self.step;
        let sum = match self.schedule.clone() {
            Some(schedule) => {
                // As many micro-batches a walk as the training step has, each walk ending with
                // its sends complete: no more transfer copies in flight than a step has (the
                // first stage waits on no receive, so it would otherwise run every forward
                // before the next stage began, each with a copy of what it sends).
                let group = schedule.microbatches.clamp(1, 1 << 12);
                let mut sum = 0.0;
                for start in (0..batches).step_by(group) {
                    let (mut t, mut g, mut weights) = (Vec::new(), Vec::new(), Vec::new());
                    for b in start..batches.min(start + group) {
                        let (bt, bg, w) = batch(b);
                        t.extend(bt);
                        g.extend(bg);
                        weights.push(w);
                    }
                    let forward = schedule.forward_only(weights.len());
                    if let Some(rank) = self.process_rank() {
                        let incoming = incoming_sends(&self.every_program, &forward, &self.mesh, rank);
                        for runner in &mut self.runners {
                            runner.exec.expect_receives(step, &incoming);
                        }
                    }
                    let losses = self.walk(&forward, step, &t, &g)?;
                    sum += losses.iter().zip(&weights).map(|(l, w)| l * w).sum::<f64>();
                    for runner in &mut self.runners {
                        runner.exec.synchronize()?;
                        runner.exec.reclaim_sends();
                    }
                }
                self.from_the_loss_maker(sum)?
            }
            None => {
                let partial = self.programs[0].loss_partial().map_err(|e| err(format!("evaluating with the training step: {e}")))?;
                let ranks = self.runners[0].exec.ranks();
                let mut sums = vec![0.0; ranks.len()];
                for b in 0..batches {
                    let (t, g, w) = batch(b);
                    self.write_batch(0, &t, &g, 0)?;
                    self.runners[0].exec.run_until(partial.end)?;
                    for (local, sum) in sums.iter_mut().enumerate() {
                        *sum += w * self.runners[0].exec.read_buffer(local, partial.buffer)?[0];
                    }
                }
                // The loss's own reduction: its parts summed over rank 0's group.
                let group = self.mesh.group(0, &partial.axes);
                if self.process_rank().is_some() {
                    let [high, low] = f64_as_i32s(sums[0]);
                    let all = self.gather_from_every_process(&[ranks[0] as i32, high, low])?;
                    all.chunks_exact(3).filter(|p| group.contains(&(p[0] as usize))).map(|p| f64_of_i32s(p[1], p[2])).sum()
                } else {
                    ranks.iter().zip(&sums).filter(|(r, _)| group.contains(r)).map(|(_, s)| s).sum()
                }
            }
        };
        Ok(sum / windows as f64)
    }

    /// [`CudaTrainer::step`] with every instruction timed on the device: the loss, the step's
    /// wall seconds and, per pipeline rank, (instruction, device seconds) in run order.
    pub fn profiled_step(&mut self, corpus: &crate::data::Corpus) -> Result<(f64, f64, Vec<Vec<(usize, f64)>>), RuntimeError> {
        for runner in &mut self.runners {
            runner.exec.set_profiling(true);
        }
        let stepped = self.step(corpus);
        let mut spans = Vec::with_capacity(self.runners.len());
        for runner in &mut self.runners {
            spans.push(runner.exec.take_profile());
            runner.exec.set_profiling(false);
        }
        let (loss, seconds) = stepped?;
        Ok((loss, seconds, spans.into_iter().collect::<Result<_, _>>()?))
    }

    /// The programs this process runs, one per pipeline rank (what
    /// [`CudaTrainer::profiled_step`]'s spans index).
    pub fn programs(&self) -> &[Program] {
        &self.programs
    }

    /// Writes micro-batch `j` of the step's tokens and targets (`t`, `g`) on every local rank
    /// of pipeline rank `s`, as far as its program reads them.
    fn write_batch(&mut self, s: usize, t: &[f64], g: &[f64], j: usize) -> Result<(), RuntimeError> {
        let size = self.rows * self.seq;
        let exec = &mut self.runners[s].exec;
        for (name, values) in [("tokens", &t[j * size..(j + 1) * size]), ("targets", &g[j * size..(j + 1) * size])] {
            let Some(layout) = exec.program().arg(name).map(|b| b.layout.clone()) else { continue };
            for (local, rank) in exec.ranks().into_iter().enumerate() {
                let shard = match &layout {
                    Some(layout) => crate::layout::local_shard(values, layout, &self.mesh, rank),
                    None => values.to_vec(),
                };
                exec.write(local, name, &shard)?;
            }
        }
        Ok(())
    }

    /// One step of programs that run in micro-batches, as the CPU pipeline runtime runs
    /// them: each pipeline rank's items in order (a forward's kept values held until its
    /// backward, gradients summed into holds), then its step section once on the sums; the
    /// pipeline ranks take turns, each running until a receive waits. Returns the mean loss.
    fn scheduled_step(&mut self, step: u64, t: &[f64], g: &[f64]) -> Result<f64, RuntimeError> {
        let schedule = self.schedule.clone().ok_or_else(|| err("no schedule"))?;
        if !self.incoming.is_empty() {
            for runner in &mut self.runners {
                runner.exec.expect_receives(step, &self.incoming);
            }
        }
        let losses = self.walk(&schedule, step, t, g)?;
        let loss = losses.iter().sum::<f64>() / schedule.microbatches as f64;
        self.from_the_loss_maker(loss)
    }

    /// `value` as the processes whose pipeline rank makes the loss have it: across the
    /// processes of a multi-process pipeline, every one takes the first such process's.
    fn from_the_loss_maker(&mut self, value: f64) -> Result<f64, RuntimeError> {
        if self.process_rank().is_none() || self.every_program.len() == 1 {
            return Ok(value);
        }
        let makes_loss = self.programs.iter().any(|p| p.result("loss").is_some_and(|l| p.instrs.iter().any(|i| i.outputs.contains(&l.buffer))));
        let [high, low] = f64_as_i32s(value);
        let all = self.gather_from_every_process(&[i32::from(makes_loss), high, low])?;
        let from = all.chunks_exact(3).find(|p| p[0] == 1).ok_or_else(|| err("no process's pipeline rank makes the loss"))?;
        Ok(f64_of_i32s(from[1], from[2]))
    }

    /// Runs `schedule`'s items on this process's pipeline ranks, the ranks taking turns, each
    /// running until a receive waits, and then each rank's step section on the summed
    /// gradients; a forward-only schedule (an evaluation) has no step, and its kept values
    /// are let go at once. Returns the loss each micro-batch made here (0 where this
    /// process's pipeline ranks make none).
    fn walk(&mut self, schedule: &crate::schedule::Schedule, step: u64, t: &[f64], g: &[f64]) -> Result<Vec<f64>, RuntimeError> {
        let whole_step = !schedule.is_forward_only();
        let splits_w = schedule.ranks.iter().flatten().any(|i| i.work == crate::schedule::Work::W);
        for runner in &mut self.runners {
            runner.exec.forget_step_state();
        }
        let mut walks: Vec<Walk> = self
            .runners
            .iter()
            .map(|r| {
                let chunks = r.sums.len();
                Walk { summing: vec![false; chunks], summing_weight: vec![false; chunks], ..Walk::default() }
            })
            .collect();
        let mut losses = vec![0.0; schedule.microbatches];
        loop {
            let mut progressed = false;
            for s in 0..self.runners.len() {
                let plan = self.programs[s].pipeline.clone().ok_or_else(|| err("not a pipeline program"))?;
                let items = &schedule.ranks[plan.rank];
                loop {
                    if walks[s].done {
                        break;
                    }
                    if walks[s].running.is_none() {
                        if walks[s].position < items.len() {
                            let item = items[walks[s].position];
                            let instructions = self.begin_item(s, &mut walks[s], item, step, t, g, splits_w)?;
                            // The chunk's last backward work: its step buckets go out as they fill.
                            let last_backward = whole_step && items.iter().rposition(|i| i.chunk == item.chunk && i.work != crate::schedule::Work::F) == Some(walks[s].position);
                            walks[s].last_backward = last_backward;
                            walks[s].triggers = if last_backward { self.programs[s].step_bucket_triggers(&plan.chunks[item.chunk], &instructions) } else { Vec::new() };
                            walks[s].running = Some((instructions, 0, Some(item)));
                        } else if whole_step && !walks[s].step_started {
                            let runner = &mut self.runners[s];
                            for id in runner.sums.iter().chain(&runner.sums_weight).flatten() {
                                runner.exec.restore(*id)?;
                            }
                            // Step sections exchange once per step: their transfers carry
                            // micro-batch 0.
                            runner.exec.set_transfer_context(step, 0);
                            walks[s].step_started = true;
                            walks[s].running = Some((self.programs[s].step_order(&plan.chunks), 0, None));
                        } else {
                            walks[s].done = true;
                            break;
                        }
                    }
                    let (instructions, ran, item) = walks[s].running.take().ok_or_else(|| err("nothing running"))?;
                    // Up to the next step bucket that fills inside this work, if any.
                    let stop = walks[s].triggers.first().map_or(instructions.len(), |&(at, _)| at.clamp(ran, instructions.len()));
                    let left = self.runners[s].exec.run_until_blocked(&instructions[ran..stop])?;
                    let now = stop - left;
                    progressed |= now > ran;
                    if left > 0 {
                        walks[s].running = Some((instructions, now, item));
                        break;
                    }
                    if now < instructions.len() {
                        let c = item.map(|i| i.chunk).ok_or_else(|| err("a step bucket trigger outside an item"))?;
                        let chunk = &plan.chunks[c];
                        while let Some(&(at, k)) = walks[s].triggers.first().filter(|&&(at, _)| at <= now) {
                            debug_assert_eq!(at, now);
                            walks[s].triggers.remove(0);
                            let (summing, summing_weight) = (walks[s].summing[c], walks[s].summing_weight[c]);
                            // The step's first micro-batch copies into the region, the others add.
                            let first = |b: BufferId| if chunk.sum_weight.contains(&b) { !summing_weight } else { !summing };
                            self.runners[s].exec.send_step_bucket_early(k, first)?;
                        }
                        walks[s].running = Some((instructions, now, item));
                        progressed = true;
                        continue;
                    }
                    if let Some(item) = item {
                        losses[item.microbatch] += self.finish_item(s, &mut walks[s], item, splits_w, !whole_step)?;
                        // The chunk's last backward work of the step: its gradients are final
                        // and its step buckets go out while the rank works on.
                        if walks[s].last_backward {
                            self.runners[s].exec.start_step_buckets(&plan.chunks[item.chunk])?;
                        }
                        walks[s].position += 1;
                        progressed = true;
                        // Forward work alone: the ranks take an item each in turn, so that
                        // what one sends is received (and its copy reused) before it sends more.
                        if !whole_step {
                            break;
                        }
                        continue;
                    }
                    progressed = true;
                }
            }
            if walks.iter().all(|w| w.done) {
                break;
            }
            if !progressed {
                let waiting: Vec<String> = walks.iter().enumerate().filter(|(_, w)| !w.done).map(|(s, w)| format!("pipeline rank {s} at item {}", w.position)).collect();
                return Err(err(format!("the pipeline ranks wait on each other's sends: {}", waiting.join(", "))));
            }
        }
        Ok(losses)
    }

    /// Starts `item` on pipeline rank `s`: its micro-batch's data, its transfers' tags and
    /// the values it needs put back; returns the instructions it runs.
    #[allow(clippy::too_many_arguments)]
    fn begin_item(&mut self, s: usize, walk: &mut Walk, item: crate::schedule::Item, step: u64, t: &[f64], g: &[f64], splits_w: bool) -> Result<Vec<usize>, RuntimeError> {
        use crate::schedule::Work;
        let (c, j) = (item.chunk, item.microbatch);
        self.write_batch(s, t, g, j)?;
        let plan = self.programs[s].pipeline.as_ref().ok_or_else(|| err("not a pipeline program"))?;
        let chunk = &plan.chunks[c];
        let exec = &mut self.runners[s].exec;
        exec.set_transfer_context(step, j as u64);
        // The forward writes its kept values into a set of the micro-batch's own; its backward
        // and weight gradient read them there (no copy).
        Ok(match item.work {
            Work::F => {
                walk.kept_forward.insert((c, j), exec.take_kept(c, KeptKind::Forward)?);
                chunk.range(Phase::Forward).collect()
            }
            Work::B => {
                if let Some(kept) = *walk.kept_forward.get(&(c, j)).ok_or_else(|| err(format!("backward of micro-batch {j} before its forward")))? {
                    exec.bind_kept(kept);
                }
                let mut instructions: Vec<usize> = chunk.range(Phase::Backward).collect();
                if splits_w {
                    walk.kept_backward.insert((c, j), exec.take_kept(c, KeptKind::Backward)?);
                } else {
                    instructions.extend(chunk.range(Phase::Weight));
                }
                instructions
            }
            Work::W => {
                let (Some(forward), Some(backward)) = (walk.kept_forward.get(&(c, j)), walk.kept_backward.get(&(c, j))) else {
                    return Err(err(format!("weight gradient of micro-batch {j} before its forward and backward")));
                };
                for kept in [*forward, *backward].into_iter().flatten() {
                    exec.bind_kept(kept);
                }
                chunk.range(Phase::Weight).collect()
            }
        })
    }

    /// Ends `item` on pipeline rank `s`: sums the gradients, frees the kept values its
    /// micro-batch's last reader has read (a forward's own, `forward_only`); returns the loss
    /// it made (0 where it made none).
    fn finish_item(&mut self, s: usize, walk: &mut Walk, item: crate::schedule::Item, splits_w: bool, forward_only: bool) -> Result<f64, RuntimeError> {
        use crate::schedule::Work;
        let (c, j) = (item.chunk, item.microbatch);
        let program = &self.programs[s];
        let plan = program.pipeline.as_ref().ok_or_else(|| err("not a pipeline program"))?;
        let chunk = &plan.chunks[c];
        let runner = &mut self.runners[s];
        // Sums a chunk's gradient buffers into its step buckets' regions and the rest into its
        // hold (the step's first micro-batch copies).
        let sum_into = |exec: &mut CudaExecutor, buffers: &[BufferId], hold: &mut Option<HoldId>, started: &mut bool| -> Result<(), RuntimeError> {
            let buffers = &exec.sum_into_step_buckets(buffers, !*started)?;
            match *hold {
                Some(id) => exec.fill(id, std::mem::replace(started, true)),
                None => {
                    *started = true;
                    *hold = Some(exec.hold(buffers)?);
                    Ok(())
                }
            }
        };
        let mut loss = 0.0;
        match item.work {
            Work::F => {
                let makes_loss = program.result("loss").is_some_and(|l| program.instrs[chunk.range(Phase::Forward)].iter().any(|i| i.outputs.contains(&l.buffer)));
                if makes_loss {
                    loss = runner.exec.read(0, "loss")?[0];
                }
                // No backward reads them.
                if forward_only
                    && let Some(kept) = walk.kept_forward.remove(&(c, j)).flatten()
                {
                    runner.exec.free_kept(kept);
                }
            }
            Work::B => {
                sum_into(&mut runner.exec, &chunk.sum_backward, &mut runner.sums[c], &mut walk.summing[c])?;
                if !splits_w {
                    sum_into(&mut runner.exec, &chunk.sum_weight, &mut runner.sums_weight[c], &mut walk.summing_weight[c])?;
                    if let Some(kept) = walk.kept_forward.remove(&(c, j)).flatten() {
                        runner.exec.free_kept(kept);
                    }
                }
            }
            Work::W => {
                sum_into(&mut runner.exec, &chunk.sum_weight, &mut runner.sums_weight[c], &mut walk.summing_weight[c])?;
                for kept in [walk.kept_forward.remove(&(c, j)).flatten(), walk.kept_backward.remove(&(c, j)).flatten()].into_iter().flatten() {
                    runner.exec.free_kept(kept);
                }
            }
        }
        Ok(loss)
    }

    /// How many step buckets went out inside their chunk's last backward work (as the layers
    /// that fill them finished) since the trainer was made, over its pipeline ranks.
    pub fn step_buckets_sent_early(&self) -> usize {
        self.runners.iter().map(|r| r.exec.step_buckets_sent_early()).sum()
    }

    /// Where the run stands: steps taken, and every parameter and optimizer-state tensor,
    /// global. Only a process that holds every rank has them all.
    pub fn state(&self) -> Result<crate::train::TrainState, RuntimeError> {
        if !self.holds_every_rank() {
            return Err(err("this process holds only its own shards (one rank of a multi-process run): the global state is not here"));
        }
        let mut values = vec![HashMap::new(); self.mesh.ranks()];
        for runner in &self.runners {
            let program = runner.exec.program();
            for (local, rank) in runner.exec.ranks().into_iter().enumerate() {
                for a in program.args.iter().filter(|a| a.role.is_some_and(Role::is_state)) {
                    values[rank].insert(a.name.clone(), runner.exec.read(local, &a.name)?);
                }
            }
        }
        crate::train::TrainState::collect(&self.programs, &self.mesh, &values, self.step)
    }

    /// Tensor `name` (a state argument) assembled from the ranks of the first pipeline rank
    /// that holds it, as the model has it (a padded vocabulary's real rows): one tensor read
    /// back, one shard of each part, never the whole state.
    fn global_tensor(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        if !self.holds_every_rank() {
            return Err(err("this process holds only its own shards (one rank of a multi-process run): the global tensors are not here"));
        }
        for runner in &self.runners {
            let program = runner.exec.program();
            let Some(a) = program.arg(name) else { continue };
            let shape = program.buffers[a.buffer].shape.clone();
            let Some(layout) = &a.layout else {
                return Ok(a.from_program(&runner.exec.read(0, name)?, &shape));
            };
            // Ranks that differ only on axes the layout does not split hold the same part.
            let mut parts = std::collections::HashSet::new();
            let mut shards = Vec::new();
            for (local, rank) in runner.exec.ranks().into_iter().enumerate() {
                if parts.insert(crate::layout::shard_index(layout, &self.mesh, rank)) {
                    shards.push((rank, runner.exec.read(local, name)?));
                }
            }
            return Ok(a.from_program(&crate::layout::assemble_some(&shards, layout, &self.mesh), &layout.global_shape));
        }
        Err(err(format!("no program of this run holds `{name}`")))
    }

    /// The parameter shards this process holds: (rank, name, values) of every local rank's
    /// parameters, in the program's layout (what a multi-process run's process can check or
    /// save without the others).
    pub fn parameter_shards(&self) -> Result<Vec<(usize, String, Vec<f64>)>, RuntimeError> {
        let mut shards = Vec::new();
        for runner in &self.runners {
            let program = runner.exec.program();
            for (local, rank) in runner.exec.ranks().into_iter().enumerate() {
                for p in program.args.iter().filter(|a| a.role == Some(Role::Param)) {
                    shards.push((rank, p.name.clone(), runner.exec.read(local, &p.name)?));
                }
            }
        }
        Ok(shards)
    }

    /// Every parameter this process can assemble: (name, global shape, values), as the model
    /// has them (a padded vocabulary's real rows); a tensor this process holds only a shard
    /// of is left out.
    pub fn parameters(&self) -> Result<Vec<(String, Vec<usize>, Vec<f64>)>, RuntimeError> {
        let mut parameters: Vec<(String, Vec<usize>, Vec<f64>)> = Vec::new();
        if self.holds_every_rank() {
            use crate::train::ParameterSource;
            // The parameters as the programs hold them (bf16 ones rounded), not their masters.
            for (name, shape) in self.parameter_shapes()? {
                let values = self.global_tensor(&name)?;
                parameters.push((name, shape, values));
            }
            return Ok(parameters);
        }
        // One rank of a multi-process run: the tensors it holds whole.
        let exec = &self.runners[0].exec;
        let program = exec.program();
        for p in program.args.iter().filter(|a| a.role == Some(Role::Param) && a.layout.is_none()) {
            let shape = &program.buffers[p.buffer].shape;
            parameters.push((p.name.clone(), p.logical_shape(shape), p.from_program(&exec.read(0, &p.name)?, shape)));
        }
        Ok(parameters)
    }
}

impl crate::train::ParameterSource for CudaTrainer {
    fn parameter_shapes(&self) -> Result<std::collections::BTreeMap<String, Vec<usize>>, RuntimeError> {
        let mut shapes = std::collections::BTreeMap::new();
        for program in &self.programs {
            for p in program.args.iter().filter(|a| a.role == Some(Role::Param)) {
                let shape = p.layout.as_ref().map_or_else(|| program.buffers[p.buffer].shape.clone(), |l| l.global_shape.clone());
                shapes.entry(p.name.clone()).or_insert_with(|| p.logical_shape(&shape));
            }
        }
        Ok(shapes)
    }

    fn parameter_values(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        let master = crate::program::master_name(name);
        let held = |n: &str| self.programs.iter().any(|p| p.arg(n).is_some());
        self.global_tensor(if held(&master) { &master } else { name })
    }
}

/// What each other process sends process `rank` in a step of `schedule`, in the order it
/// sends them: its pipeline rank's items in schedule order (a forward's, backward's and
/// weight gradient's instructions as [`CudaTrainer`] runs them), then its step section; each
/// send to `rank`'s pipeline rank as (tag without the step, bytes), by the sender's global rank.
fn incoming_sends(programs: &[Program], schedule: &crate::schedule::Schedule, mesh: &MeshShape, rank: usize) -> HashMap<usize, Vec<(u64, usize)>> {
    use crate::schedule::Work;
    let splits_w = schedule.ranks.iter().flatten().any(|i| i.work == Work::W);
    let mine = mesh.coords(rank).get(2).copied().unwrap_or(0);
    let mut out: HashMap<usize, Vec<(u64, usize)>> = HashMap::new();
    for program in programs {
        let Some(plan) = program.pipeline.as_ref() else { continue };
        let mut coords = mesh.coords(rank);
        coords[2] = plan.rank;
        let sender = mesh.rank(&coords);
        let mut order: Vec<(usize, u64)> = Vec::new();
        for item in &schedule.ranks[plan.rank] {
            let chunk = &plan.chunks[item.chunk];
            let sections: Vec<Phase> = match item.work {
                Work::F => vec![Phase::Forward],
                Work::B if splits_w => vec![Phase::Backward],
                Work::B => vec![Phase::Backward, Phase::Weight],
                Work::W => vec![Phase::Weight],
            };
            order.extend(sections.into_iter().flat_map(|section| chunk.range(section)).map(|index| (index, item.microbatch as u64)));
        }
        // A forward-only schedule (an evaluation) has no step section.
        if !schedule.is_forward_only() {
            order.extend(program.step_order(&plan.chunks).into_iter().map(|index| (index, 0)));
        }
        for (index, microbatch) in order {
            let instr = &program.instrs[index];
            let to_me = instr.op == "shard.send" && instr.ints("destination").ok().and_then(|d| d.first().copied()) == Some(mine as i64);
            if !to_me || sender == rank {
                continue;
            }
            let (Ok(transfer), Some(&input)) = (instr.int("xf.transfer"), instr.inputs.first()) else { continue };
            let buffer = &program.buffers[input];
            out.entry(sender).or_default().push((((transfer as u64) << 16) | microbatch, buffer.len() * buffer.dtype.bytes()));
        }
    }
    out
}

/// An f64's bits as two i32s (high, low), as [`CudaExecutor::gather_from_every_process`]
/// carries values between processes; [`f64_of_i32s`] is the inverse.
fn f64_as_i32s(value: f64) -> [i32; 2] {
    let bits = value.to_bits();
    [(bits >> 32) as u32 as i32, bits as u32 as i32]
}

fn f64_of_i32s(high: i32, low: i32) -> f64 {
    f64::from_bits(((high as u32 as u64) << 32) | low as u32 as u64)
}

/// How an error of a multi-process run starts when the process failed because another did
/// (whose own error says why): a launcher reporting one error prefers the others.
pub const ANOTHER_PROCESS_FAILED: &str = "another process failed: ";

/// A GEMM with epilogue `e` (`elements` results in rows of `cols`): fused where the device
/// can (cuBLASLt, the emulation), else the plain GEMM and the prelude's epilogue kernel.
pub fn gemm_with_epilogue(device: &dyn Device, dtype: DType, g: &ColumnMajorGemm, e: &device::DeviceEpilogue, elements: usize, cols: usize) -> Result<(), RuntimeError> {
    if device.gemm_epilogue(dtype, g, e)? {
        return Ok(());
    }
    gemm_then_epilogue(device, dtype, g, e, elements, cols)
}

/// The unfused form of [`gemm_with_epilogue`]: the GEMM rounds its product to the storage
/// type, then one kernel applies the epilogue (what the element-wise ops would compute).
pub fn gemm_then_epilogue(device: &dyn Device, dtype: DType, g: &ColumnMajorGemm, e: &device::DeviceEpilogue, elements: usize, cols: usize) -> Result<(), RuntimeError> {
    device.gemm(dtype, g)?;
    let grid = elements.div_ceil(256).clamp(1, 65_535) as u32;
    let args = [KernelValue::Ptr(g.c), KernelValue::Ptr(e.aux), KernelValue::Ptr(e.bias), KernelValue::I64(elements as i64), KernelValue::I64(cols.max(1) as i64), KernelValue::I32(e.activation.code())];
    device.launch(crate::program::GEMM_EPILOGUE_KERNEL, [grid, 1, 1], 256, 0, &args)
}

/// Measures cuBLAS on one square GEMM (`size`^3, `dtype` operands, fp32 accumulation):
/// TFLOP/s over `iterations` calls after a warm-up. The reference the GPU check compares
/// achieved throughput with.
pub fn gemm_peak(device: usize, size: usize, dtype: DType, iterations: usize) -> Result<f64, RuntimeError> {
    let mut gpu = device::Gpu::new(device, PRELUDE_ONLY, &[])?;
    let bytes = size * size * dtype.bytes();
    let (a, b, c) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?, gpu.alloc(bytes)?);
    let call = Gemm { a: 0, b: 1, c: 2, m: size, n: size, k: size, transpose_a: false, transpose_b: false, lda: size, ldb: size, ldc: size, stride_a: 0, stride_b: 0, stride_c: 0, batch: 1 };
    let gemm = ColumnMajorGemm::of(&call, a, b, c);
    let run = |times: usize| -> Result<(), RuntimeError> {
        for _ in 0..times {
            gpu.gemm(dtype, &gemm)?;
        }
        gpu.synchronize()
    };
    run(3)?;
    let began = std::time::Instant::now();
    run(iterations.max(1))?;
    let seconds = began.elapsed().as_secs_f64();
    for ptr in [a, b, c] {
        gpu.free(ptr);
    }
    Ok(2.0 * (size as f64).powi(3) * iterations.max(1) as f64 / seconds / 1e12)
}

/// Seconds of one run of `program` (one kernel, or a chain of them, for calibration) on the
/// device of `placement`, as a step pays it: queued behind the runs before it, not waited
/// for on its own. A short program runs many times between two waits (enough for a
/// millisecond), so the host's round trip of a wait (some 10 us on a GPU, longer than a
/// small kernel) is spread over them, as it is over a step's kernels. The fastest of
/// `repeats` such timings after a warm-up. Inputs are step-like values: floats of order one
/// (positive, as second moments are) and integers of 1 (a token id, a step count).
pub fn time_program(program: Program, placement: &Placement, repeats: usize) -> Result<f64, RuntimeError> {
    let mut exec = CudaExecutor::new(program, placement)?;
    // Every rank this process holds (a context-parallel program's, say), each with the same
    // values.
    for local in 0..exec.ranks().len() {
        for arg in exec.program().args.clone() {
            let buffer = &exec.program().buffers[arg.buffer];
            let values = crate::init::step_like_values(buffer.len(), buffer.dtype);
            exec.write(local, &arg.name, &values)?;
        }
    }
    let began = std::time::Instant::now();
    exec.run()?;
    exec.synchronize()?;
    let single = began.elapsed().as_secs_f64();
    let runs = (TIMED_SPAN_SECONDS / single.max(1e-9)).ceil().clamp(1.0, MAX_RUNS_PER_TIMING as f64) as usize;
    let mut fastest = f64::INFINITY;
    for _ in 0..repeats.max(1) {
        let began = std::time::Instant::now();
        for _ in 0..runs {
            exec.run_range(0..exec.program().instrs.len())?;
        }
        exec.synchronize()?;
        fastest = fastest.min(began.elapsed().as_secs_f64() / runs as f64);
    }
    Ok(fastest)
}

/// How long one timing of [`time_program`] lasts at least (runs of a short program added).
const TIMED_SPAN_SECONDS: f64 = 1e-3;
/// The most runs of one program in one timing.
const MAX_RUNS_PER_TIMING: usize = 200;

/// A module with no kernels, for a device used only for cuBLAS.
const PRELUDE_ONLY: &str = "extern \"C\" __global__ void shardc_nothing() {}\n";

/// FLOPs of a device plan's GEMMs (2 m n k per batch item): what the step's matrix products
/// execute.
pub fn gemm_flops(plan: &DevicePlan) -> f64 {
    plan.calls
        .iter()
        .flatten()
        .map(|c| match c {
            DeviceCall::Gemm(g) | DeviceCall::GemmEpilogue { gemm: g, .. } => 2.0 * (g.m * g.n * g.k * g.batch) as f64,
            _ => 0.0,
        })
        .sum()
}

/// How an all-to-all's parts lie in its buffers, in bytes: part k of the input is
/// `split_outer` rows of `split_block` bytes, `split_stride` apart, at `k x split_block`; it
/// lands in the output as `concat_outer` rows of `concat_block` bytes, `concat_stride`
/// apart, at `k x concat_block`; a part is `part` bytes.
struct AllToAll {
    part: usize,
    split_outer: usize,
    split_block: usize,
    split_stride: usize,
    concat_outer: usize,
    concat_block: usize,
    concat_stride: usize,
}

impl AllToAll {
    fn of(instr: &Instr, input: &[usize], output: &[usize], element: usize, n: usize) -> Result<AllToAll, String> {
        let (split, concat) = (instr.int("split_axis")? as usize, instr.int("concat_axis")? as usize);
        if split >= input.len() || concat >= input.len() || input.len() != output.len() {
            return Err(format!("all-to-all of {input:?} into {output:?} along {split} and {concat}"));
        }
        let inner = |shape: &[usize], axis: usize| shape[axis + 1..].iter().product::<usize>() * element;
        Ok(AllToAll {
            part: input.iter().product::<usize>() * element / n.max(1),
            split_outer: input[..split].iter().product(),
            split_block: output[split] * inner(input, split),
            split_stride: input[split] * inner(input, split),
            concat_outer: output[..concat].iter().product(),
            concat_block: input[concat] * inner(output, concat),
            concat_stride: output[concat] * inner(output, concat),
        })
    }
}
