//! NCCL collectives, one process per GPU, bootstrapped the torchrun way: `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`. Rank 0 creates the NCCL unique
//! id and serves it over TCP on the port after `MASTER_PORT` (torchrun's own store listens on
//! `MASTER_PORT` itself; `SHARDC_BOOTSTRAP_PORT` names another); the others fetch it. One communicator spans the world and one
//! more is split off for every set of grid axes the program's collectives run over.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use cudarc::nccl::{result as nr, sys as ns};

use crate::collectives::MeshShape;
use crate::program::{Attr, Buffer, Instr};
use crate::{DType, RuntimeError};

fn err(message: impl Into<String>) -> RuntimeError {
    RuntimeError::Device(message.into())
}

/// This process's place in the world, from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bootstrap {
    /// Global rank.
    pub rank: usize,
    /// Ranks in all.
    pub world: usize,
    /// GPU of this process on its node.
    pub local_rank: usize,
    /// Address rank 0 serves the unique id on.
    pub master: String,
    /// How long a rank waits for the others to connect (`run --timeout`).
    pub timeout: Duration,
}

impl Bootstrap {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (default: `RANK`), `MASTER_ADDR` (default
    /// 127.0.0.1) and `MASTER_PORT` (default 29500). Rank 0 serves the NCCL id on
    /// `MASTER_PORT + 1`, or on `SHARDC_BOOTSTRAP_PORT` when set: under torchrun,
    /// `MASTER_PORT` is its agent's store, which the workers' own processes must not bind.
    pub fn from_env() -> Result<Bootstrap, RuntimeError> {
        Bootstrap::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Bootstrap::from_env`] over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Bootstrap, RuntimeError> {
        let number = |name: &str, value: Option<String>| -> Result<Option<usize>, RuntimeError> {
            value.map(|v| v.trim().parse::<usize>().map_err(|_| err(format!("{name}={v} is not a non-negative integer")))).transpose()
        };
        let rank = number("RANK", var("RANK"))?.ok_or_else(|| err("RANK is not set (torchrun convention: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"))?;
        let world = number("WORLD_SIZE", var("WORLD_SIZE"))?.ok_or_else(|| err("WORLD_SIZE is not set"))?;
        if rank >= world {
            return Err(err(format!("RANK={rank} must be below WORLD_SIZE={world}")));
        }
        let local_rank = number("LOCAL_RANK", var("LOCAL_RANK"))?.unwrap_or(rank);
        let addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = match number("SHARDC_BOOTSTRAP_PORT", var("SHARDC_BOOTSTRAP_PORT"))? {
            Some(port) => port,
            None => number("MASTER_PORT", var("MASTER_PORT"))?.unwrap_or(29500).saturating_add(1),
        };
        if !(1..=65535).contains(&port) {
            return Err(err(format!("the NCCL id would be served on port {port} (MASTER_PORT + 1, or SHARDC_BOOTSTRAP_PORT), which is not a TCP port: set SHARDC_BOOTSTRAP_PORT to a free port below 65536")));
        }
        Ok(Bootstrap { rank, world, local_rank, master: format!("{addr}:{port}"), timeout: Duration::from_secs(120) })
    }

    /// The same place, waiting `timeout` for the other ranks.
    pub fn with_timeout(self, timeout: Duration) -> Bootstrap {
        Bootstrap { timeout, ..self }
    }

    /// The NCCL unique id: made by rank 0 and sent to every other rank over TCP.
    fn unique_id(&self) -> Result<ns::ncclUniqueId, RuntimeError> {
        let bytes = self.exchange_id(|| {
            let id = nr::get_uniqueid().map_err(|e| err(format!("ncclGetUniqueId: {e:?}")))?;
            let mut bytes = [0u8; 128];
            for (d, &s) in bytes.iter_mut().zip(id.internal.iter()) {
                *d = s as u8;
            }
            Ok(bytes)
        })?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(bytes) {
            *d = s as std::ffi::c_char;
        }
        Ok(ns::ncclUniqueId { internal })
    }

    /// The 128 bytes of the NCCL id: rank 0 makes them with `make` and serves them on
    /// [`Bootstrap::master`] to every other rank, which fetches them, both within the timeout.
    pub fn exchange_id(&self, make: impl FnOnce() -> Result<[u8; 128], RuntimeError>) -> Result<[u8; 128], RuntimeError> {
        let timeout = self.timeout;
        if self.rank == 0 {
            let bytes = make()?;
            let listener = std::net::TcpListener::bind(&self.master)
                .map_err(|e| err(format!("rank 0 cannot listen on {} (MASTER_ADDR, and MASTER_PORT + 1 or SHARDC_BOOTSTRAP_PORT) for the NCCL id: {e}; set SHARDC_BOOTSTRAP_PORT to a free port", self.master)))?;
            listener.set_nonblocking(true).map_err(|e| err(e.to_string()))?;
            let began = Instant::now();
            let mut served = 0;
            while served + 1 < self.world {
                match listener.accept() {
                    Ok((mut stream, _)) => {
                        stream.set_nonblocking(false).map_err(|e| err(e.to_string()))?;
                        stream.write_all(&bytes).map_err(|e| err(format!("sending the NCCL id: {e}")))?;
                        served += 1;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if began.elapsed() > timeout {
                            return Err(err(format!("only {served} of {} ranks connected to {} within {timeout:?}", self.world - 1, self.master)));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(err(format!("accepting on {}: {e}", self.master))),
                }
            }
            Ok(bytes)
        } else {
            let began = Instant::now();
            loop {
                match std::net::TcpStream::connect(&self.master) {
                    Ok(mut stream) => {
                        // Something else on the port (not rank 0) may never send the id.
                        let left = timeout.saturating_sub(began.elapsed()).max(Duration::from_millis(100));
                        stream.set_read_timeout(Some(left)).map_err(|e| err(e.to_string()))?;
                        let mut bytes = [0u8; 128];
                        stream
                            .read_exact(&mut bytes)
                            .map_err(|e| err(format!("rank {} reading the NCCL id from {}: {e} (is rank 0 serving there? SHARDC_BOOTSTRAP_PORT must be the same on every rank)", self.rank, self.master)))?;
                        return Ok(bytes);
                    }
                    Err(_) if began.elapsed() < timeout => std::thread::sleep(Duration::from_millis(100)),
                    Err(e) => return Err(err(format!("rank {} cannot reach rank 0 at {} within {timeout:?}: {e}", self.rank, self.master))),
                }
            }
        }
    }
}

/// One "process" of an emulated multi-process run: the CPU backend's collectives between
/// threads stand in for NCCL, so the NCCL paths of the executor (one rank per process, a
/// bucket's one collective, the staging around gathers and scatters) run in tests without
/// GPUs, each thread an executor on the emulated device.
#[derive(Clone)]
pub struct EmulatedWorld {
    rank: usize,
    size: usize,
    comm: std::sync::Arc<std::sync::Mutex<crate::collectives::Communicator>>,
}

impl EmulatedWorld {
    /// A world of `size` emulated processes, by rank; a collective waits up to `timeout` for
    /// the others.
    pub fn world(size: usize, timeout: Duration) -> Vec<EmulatedWorld> {
        crate::collectives::world(size, timeout).into_iter().enumerate().map(|(rank, c)| EmulatedWorld { rank, size, comm: std::sync::Arc::new(std::sync::Mutex::new(c)) }).collect()
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in all.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The world's abort flag: set when a process fails, every emulated wait ends at once.
    pub fn abort_flag(&self) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
        match self.comm.lock() {
            Ok(comm) => comm.abort_flag(),
            Err(poisoned) => poisoned.into_inner().abort_flag(),
        }
    }
}

impl std::fmt::Debug for EmulatedWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EmulatedWorld(rank {} of {})", self.rank, self.size)
    }
}

/// NCCL communicators: the world and one per set of grid axes; or their emulation.
pub struct Comms {
    backend: Backend,
}

enum Backend {
    Nccl {
        world: ns::ncclComm_t,
        groups: HashMap<Vec<usize>, ns::ncclComm_t>,
        /// One two-rank communicator per direction of each pipeline edge (sender, receiver):
        /// its sender only sends and its receiver only receives, in one order.
        edges: HashMap<(usize, usize), ns::ncclComm_t>,
        /// A stream per receiving peer that this rank's sends run on, so that a send waiting
        /// for its receiver never holds up the compute stream (an isend).
        send_streams: std::sync::Mutex<HashMap<usize, std::sync::Arc<CudaStream>>>,
        /// A stream per communicator of `groups`, that every operation on it runs on, in
        /// the order this rank issues them: NCCL does not allow one communicator's kernels
        /// to run concurrently from two streams (a synchronous collective on the compute
        /// stream while a bucket on the communication stream is in flight would).
        group_streams: std::sync::Mutex<HashMap<Vec<usize>, std::sync::Arc<CudaStream>>>,
        /// Watches the communicators for NCCL's asynchronous errors and for waits on the
        /// device that outlast the timeout.
        watchdog: Watchdog,
    },
    Emulated {
        world: EmulatedWorld,
        mesh: MeshShape,
        /// Point-to-point messages so far, per (peer, whether sent to it): NCCL matches a
        /// pair's sends and receives by their order, and so does the emulation.
        sequence: std::sync::Mutex<HashMap<(usize, bool), u64>>,
        /// The same for shifts (ring attention's blocks), whose peers are in the cp groups.
        shifts: std::sync::Mutex<HashMap<(usize, bool), u64>>,
    },
}

/// One shift of a rank (see [`Comms::shift`]): `bytes` at `send` go to the rank `to` places
/// on in the group along `axes`, and `bytes` from the rank as many places before come into
/// `recv`. A peer is (its position in the group, its global rank).
#[derive(Clone, Debug)]
pub struct ShiftMember {
    /// The grid axes of its group.
    pub axes: Vec<usize>,
    /// What it sends.
    pub send: u64,
    /// Where it receives.
    pub recv: u64,
    /// Bytes each way.
    pub bytes: usize,
    /// Whom it sends to.
    pub to: (usize, usize),
    /// Whom it receives from.
    pub from: (usize, usize),
}

/// One member of a bucket of gathers or scatters along dimension 0 (see
/// [`Comms::run_group`]): device pointers to what it sends and receives, and `count`
/// elements sent (a gather) or received (a scatter).
#[derive(Clone, Debug)]
pub struct GroupMember {
    /// An all-gather (else a sum reduce-scatter).
    pub gather: bool,
    /// The grid axes of its group.
    pub axes: Vec<usize>,
    /// What it sends.
    pub send: u64,
    /// Where it receives.
    pub recv: u64,
    /// Elements sent (a gather) or received (a scatter).
    pub count: usize,
    /// Element type.
    pub dtype: DType,
}

/// A collective as NCCL names it, with what differs between them.
#[derive(Clone, Copy)]
enum Call {
    AllReduce { max: bool },
    AllGather,
    ReduceScatter,
    Broadcast { root: usize },
}

impl Comms {
    /// Joins the world, splits a communicator off for every set of the mesh's grid axes,
    /// and makes the two-rank communicators of the pipeline edges.
    pub fn new(bootstrap: &Bootstrap, mesh: &MeshShape) -> Result<Comms, RuntimeError> {
        // SAFETY: only dlopens the library.
        if !unsafe { ns::is_culib_present() } {
            return Err(err("NCCL (libnccl.so) was not found: put pip's nvidia-nccl on LD_LIBRARY_PATH with a libnccl.so symlink to libnccl.so.2"));
        }
        let id = bootstrap.unique_id()?;
        let mut world = std::ptr::null_mut();
        // SAFETY: a fresh communicator handle; every rank calls this with the same id.
        unsafe { nr::comm_init_rank(&mut world, bootstrap.world as i32, id, bootstrap.rank as i32) }.map_err(|e| err(format!("ncclCommInitRank: {e:?}")))?;
        let mut groups = HashMap::new();
        // Every set of grid axes (in ascending order, as the programs name them), whatever
        // this rank's program uses: every rank must split the world alike, and pipeline
        // ranks' programs differ (a stage's collectives over dp x tp that another lacks).
        let axes_count = mesh.0.len();
        let axis_sets: Vec<Vec<usize>> = (1u32..1 << axes_count).map(|bits| (0..axes_count).filter(|a| bits & (1 << a) != 0).collect()).collect();
        for axes in axis_sets {
            let group = mesh.group(bootstrap.rank, &axes);
            let color = group.iter().copied().min().unwrap_or(0) as i32;
            let key = group.iter().position(|&r| r == bootstrap.rank).unwrap_or(0) as i32;
            let mut comm = std::ptr::null_mut();
            // SAFETY: collective over the world communicator; every rank splits the same sets
            // in the same (sorted) order.
            unsafe { ns::ncclCommSplit(world, color, key, &mut comm, std::ptr::null_mut()) }.result().map_err(|e| err(format!("ncclCommSplit: {e:?}")))?;
            groups.insert(axes, comm);
        }
        let edges = pipeline_edges(world, bootstrap.rank, mesh)?;
        let handles = Handles(groups.values().chain(edges.values()).copied().chain([world]).collect());
        // A step's device work is queued ahead of its one wait, so that wait may last a
        // step: at least PyTorch's default NCCL timeout of ten minutes.
        let watchdog = Watchdog::start(handles, bootstrap.rank, bootstrap.timeout.max(Duration::from_secs(600)));
        Ok(Comms { backend: Backend::Nccl { world, groups, edges, send_streams: Default::default(), group_streams: Default::default(), watchdog } })
    }

    /// The emulation of NCCL for one process of an emulated world (see [`EmulatedWorld`]).
    pub fn emulated(world: EmulatedWorld, mesh: &MeshShape) -> Comms {
        Comms { backend: Backend::Emulated { world, mesh: mesh.clone(), sequence: Default::default(), shifts: Default::default() } }
    }

    /// Runs one NCCL call of `rank` over its group along `axes`: `count` elements of `dtype`
    /// (sent, for a gather; received, for a scatter), on `stream` (NCCL), or at once in host
    /// memory (the emulation, whose device pointers are addresses).
    #[allow(clippy::too_many_arguments)]
    fn call(&self, call: Call, axes: &[usize], send: u64, recv: u64, count: usize, dtype: DType, rank: usize, stream: Option<&CudaStream>) -> Result<(), RuntimeError> {
        match &self.backend {
            Backend::Nccl { .. } => self.on_group_stream(axes, stream, |own| self.nccl_call(call, axes, send, recv, count, dtype, rank, own)),
            Backend::Emulated { world, mesh, .. } => {
                let group = mesh.group(rank, axes);
                let mut comm = world.comm.lock().map_err(|_| err("the emulated communicator was poisoned by a failed rank"))?;
                let result = match dtype {
                    DType::F32 => emulated_call::<f32>(call, &mut comm, &group, send, recv, count),
                    DType::F64 => emulated_call::<f64>(call, &mut comm, &group, send, recv, count),
                    DType::I32 => emulated_call::<i32>(call, &mut comm, &group, send, recv, count),
                    DType::Bf16 => emulated_call::<half::bf16>(call, &mut comm, &group, send, recv, count),
                };
                result.map_err(|e| err(format!("emulated NCCL on rank {rank}: {e}")))
            }
        }
    }

    /// Runs `issue` (NCCL calls on the communicator of `axes`, given its stream) on that
    /// communicator's own stream, after what `stream` has queued, and makes `stream` wait for
    /// it: to `stream` the calls are in order, as if issued on it, while every operation of
    /// the communicator stays on one stream.
    fn on_group_stream(&self, axes: &[usize], stream: Option<&CudaStream>, issue: impl FnOnce(&CudaStream) -> Result<(), RuntimeError>) -> Result<(), RuntimeError> {
        let done = self.after_on_group_stream(axes, stream, issue)?;
        let stream = stream.ok_or_else(|| err("NCCL needs a GPU stream"))?;
        stream.wait(&done).map_err(|e| err(format!("{e:?}")))
    }

    /// As [`Comms::on_group_stream`], but `stream` goes on: the completion event is returned
    /// for whoever waits for it (an asynchronous collective's `xf.wait`).
    fn after_on_group_stream(&self, axes: &[usize], stream: Option<&CudaStream>, issue: impl FnOnce(&CudaStream) -> Result<(), RuntimeError>) -> Result<cudarc::driver::CudaEvent, RuntimeError> {
        let Backend::Nccl { group_streams, watchdog, .. } = &self.backend else { return Err(err("not an NCCL backend")) };
        // Inside NCCL until the calls are enqueued (a group's at its end): no abort meanwhile.
        let _in_nccl = watchdog.enter()?;
        let stream = stream.ok_or_else(|| err("NCCL needs a GPU stream"))?;
        let own = {
            let mut streams = group_streams.lock().map_err(|_| err("poisoned"))?;
            match streams.get(axes) {
                Some(s) => s.clone(),
                None => {
                    let s = stream.context().new_stream().map_err(|e| err(format!("a stream for the communicator of axes {axes:?}: {e:?}")))?;
                    streams.insert(axes.to_vec(), s.clone());
                    s
                }
            }
        };
        let ready = stream.record_event(None).map_err(|e| err(format!("{e:?}")))?;
        own.wait(&ready).map_err(|e| err(format!("{e:?}")))?;
        // The event follows whatever `issue` enqueued (or failed to).
        let issued = issue(&own);
        let done = own.record_event(None).map_err(|e| err(format!("{e:?}")))?;
        issued.map(|()| done)
    }

    /// One NCCL call on the communicator of `axes`, on `own` (its stream).
    #[allow(clippy::too_many_arguments)]
    fn nccl_call(&self, call: Call, axes: &[usize], send: u64, recv: u64, count: usize, dtype: DType, rank: usize, own: &CudaStream) -> Result<(), RuntimeError> {
        match &self.backend {
            Backend::Nccl { groups, watchdog, .. } => {
                watchdog.live()?;
                let comm = *groups.get(axes).ok_or_else(|| err(format!("no communicator for axes {axes:?}")))?;
                let s = own.cu_stream() as ns::cudaStream_t;
                let ty = nccl_type(dtype);
                let check = |r: Result<nr::NcclStatus, nr::NcclError>, what: &str| r.map(|_| ()).map_err(|e| err(format!("{what} on rank {rank}: {e:?}")));
                // SAFETY: pointers into this rank's device memory or staging, sized by the
                // caller from the buffers' shapes; every rank of the group issues the same call.
                match call {
                    Call::AllReduce { max } => {
                        let op = if max { ns::ncclRedOp_t::ncclMax } else { ns::ncclRedOp_t::ncclSum };
                        check(unsafe { nr::all_reduce(send as *const _, recv as *mut _, count, ty, op, comm, s) }, "ncclAllReduce")
                    }
                    Call::AllGather => check(unsafe { nr::all_gather(send as *const _, recv as *mut _, count, ty, comm, s) }, "ncclAllGather"),
                    Call::ReduceScatter => check(unsafe { nr::reduce_scatter(send as *const _, recv as *mut _, count, ty, ns::ncclRedOp_t::ncclSum, comm, s) }, "ncclReduceScatter"),
                    Call::Broadcast { root } => check(unsafe { nr::broadcast(send as *const _, recv as *mut _, count, ty, root as i32, comm, s) }, "ncclBroadcast"),
                }
            }
            Backend::Emulated { .. } => Err(err("an NCCL call on the emulation")),
        }
    }

    /// Gathers `count` elements of `dtype` at `send` from every rank of the world into
    /// `recv` (rank order), on `stream`: what the processes of a run tell each other outside
    /// the program (a checkpoint's rank files written, and their checksums).
    #[allow(clippy::too_many_arguments)]
    pub fn all_gather_world(&self, send: u64, recv: u64, count: usize, dtype: DType, rank: usize, stream: Option<&CudaStream>) -> Result<(), RuntimeError> {
        match &self.backend {
            Backend::Nccl { world, watchdog, .. } => {
                let _in_nccl = watchdog.enter()?;
                let s = stream.ok_or_else(|| err("NCCL needs a GPU stream"))?.cu_stream() as ns::cudaStream_t;
                // SAFETY: `send` holds `count` and `recv` `count` x world elements of this
                // rank's device memory (the caller's staging); every rank issues the same call.
                unsafe { nr::all_gather(send as *const _, recv as *mut _, count, nccl_type(dtype), *world, s) }.map(|_| ()).map_err(|e| err(format!("ncclAllGather over the world on rank {rank}: {e:?}")))
            }
            Backend::Emulated { world, .. } => {
                let group: Vec<usize> = (0..world.size).collect();
                let mut comm = world.comm.lock().map_err(|_| err("the emulated communicator was poisoned by a failed rank"))?;
                let result = match dtype {
                    DType::I32 => emulated_call::<i32>(Call::AllGather, &mut comm, &group, send, recv, count),
                    other => return Err(err(format!("the world's all-gather carries i32, not {other:?}"))),
                };
                result.map_err(|e| err(format!("emulated NCCL on rank {rank}: {e}")))
            }
        }
    }

    /// Sends `bytes` at `ptr` to global rank `peer` without holding up `stream` (an isend):
    /// on the stream of this rank's sends to that peer, after what `stream` has queued;
    /// returns the event of its completion (NCCL; none in the emulation, which posts a copy
    /// at once). `tag` says which transfer it is: the emulation checks that the receiver
    /// expects it (NCCL matches a pair's sends and receives by their order alone).
    pub fn send(&self, ptr: u64, bytes: usize, peer: usize, tag: u64, rank: usize, stream: Option<&CudaStream>) -> Result<Option<cudarc::driver::CudaEvent>, RuntimeError> {
        match &self.backend {
            Backend::Nccl { edges, send_streams, watchdog, .. } => {
                let _in_nccl = watchdog.enter()?;
                let stream = stream.ok_or_else(|| err("NCCL needs a GPU stream"))?;
                let comm = *edges.get(&(rank, peer)).ok_or_else(|| err(format!("rank {rank} has no pipeline edge to rank {peer}")))?;
                let sends = {
                    let mut streams = send_streams.lock().map_err(|_| err("poisoned"))?;
                    match streams.get(&peer) {
                        Some(s) => s.clone(),
                        None => {
                            let s = stream.context().new_stream().map_err(|e| err(format!("a stream for sends to rank {peer}: {e:?}")))?;
                            streams.insert(peer, s.clone());
                            s
                        }
                    }
                };
                let ready = stream.record_event(None).map_err(|e| err(format!("{e:?}")))?;
                sends.wait(&ready).map_err(|e| err(format!("{e:?}")))?;
                // SAFETY: `ptr` holds `bytes` of this rank's device memory (a send copy the
                // caller keeps until the returned event completes); in the edge's
                // communicator this rank is 0 and the receiver 1.
                unsafe { nr::send(ptr as *const _, bytes, ns::ncclDataType_t::ncclUint8, 1, comm, sends.cu_stream() as ns::cudaStream_t) }.map_err(|e| err(format!("ncclSend from rank {rank} to rank {peer}: {e:?}")))?;
                sends.record_event(None).map(Some).map_err(|e| err(format!("{e:?}")))
            }
            Backend::Emulated { .. } if peer == rank => Err(err(format!("rank {rank} has no pipeline edge to itself"))),
            Backend::Emulated { world, sequence, .. } => {
                let k = next_in_sequence(sequence, peer, true)?;
                // SAFETY: the emulated device's pointers are host addresses of at least
                // `bytes` (the executor's send copy).
                let data = unsafe { std::slice::from_raw_parts(ptr as *const u8, bytes) };
                let message: Vec<u8> = tag.to_le_bytes().iter().chain(data).copied().collect();
                let mut comm = world.comm.lock().map_err(|_| err("the emulated communicator was poisoned by a failed rank"))?;
                comm.send_owned(peer, k, message).map_err(|e| err(format!("emulated NCCL on rank {rank}: {e}")))?;
                Ok(None)
            }
        }
    }

    /// Receives `bytes` from global rank `peer` into `ptr`, on `stream` (what follows on it
    /// waits for them): the next message of that peer's sends to this rank.
    pub fn recv(&self, ptr: u64, bytes: usize, peer: usize, tag: u64, rank: usize, stream: Option<&CudaStream>) -> Result<(), RuntimeError> {
        match &self.backend {
            Backend::Nccl { edges, watchdog, .. } => {
                let _in_nccl = watchdog.enter()?;
                let stream = stream.ok_or_else(|| err("NCCL needs a GPU stream"))?;
                let comm = *edges.get(&(peer, rank)).ok_or_else(|| err(format!("rank {rank} has no pipeline edge from rank {peer}")))?;
                // SAFETY: `ptr` is the receiving buffer of `bytes` in this rank's device
                // memory; in the edge's communicator the sender is 0.
                unsafe { nr::recv(ptr as *mut _, bytes, ns::ncclDataType_t::ncclUint8, 0, comm, stream.cu_stream() as ns::cudaStream_t) }.map(|_| ()).map_err(|e| err(format!("ncclRecv on rank {rank} from rank {peer}: {e:?}")))
            }
            Backend::Emulated { .. } if peer == rank => Err(err(format!("rank {rank} has no pipeline edge from itself"))),
            Backend::Emulated { world, sequence, .. } => {
                let k = next_in_sequence(sequence, peer, false)?;
                let mut comm = world.comm.lock().map_err(|_| err("the emulated communicator was poisoned by a failed rank"))?;
                let message = comm.recv_raw_bytes(peer, k).map_err(|e| err(format!("emulated NCCL on rank {rank}: {e}")))?;
                let sent = u64::from_le_bytes(message.get(..8).and_then(|b| b.try_into().ok()).ok_or_else(|| err("a point-to-point message without its tag"))?);
                if sent != tag || message.len() - 8 != bytes {
                    return Err(err(format!(
                        "rank {rank}'s receive {k} from rank {peer} expects transfer {tag:#x} of {bytes} bytes, and that rank's send {k} to it is transfer {sent:#x} of {} bytes: the two ranks' schedules disagree",
                        message.len() - 8
                    )));
                }
                // SAFETY: the receiving buffer, a host address of at least `bytes`.
                unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, bytes) }.copy_from_slice(&message[8..]);
                Ok(())
            }
        }
    }

    /// Connects every pipeline edge with one byte each way of its communicator, round by
    /// round as the edges were made (each rank in at most one edge per round, so no round
    /// waits on another): NCCL connects a pair on its first transfer, and a first send that
    /// blocks the host mid-step could wait on a peer that waits on this rank. `byte` is one
    /// byte of device memory.
    pub fn connect_pipeline_edges(&self, rank: usize, mesh: &MeshShape, byte: u64, stream: Option<&CudaStream>) -> Result<(), RuntimeError> {
        let Backend::Nccl { edges, watchdog, .. } = &self.backend else { return Ok(()) };
        let _in_nccl = watchdog.enter()?;
        let stream = stream.ok_or_else(|| err("NCCL needs a GPU stream"))?;
        let s = stream.cu_stream() as ns::cudaStream_t;
        let rounds = edge_rounds(mesh);
        let count = rounds.iter().map(|(_, r)| r + 1).max().unwrap_or(0);
        for round in 0..count {
            for ((from, to), _) in rounds.iter().filter(|(e, r)| *r == round && (e.0 == rank || e.1 == rank)) {
                let comm = *edges.get(&(*from, *to)).ok_or_else(|| err(format!("no communicator for the pipeline edge {from} -> {to}")))?;
                // SAFETY: one byte of this rank's device memory; the pair's other rank makes the
                // matching call in the same round.
                let result = unsafe {
                    if *from == rank {
                        nr::send(byte as *const _, 1, ns::ncclDataType_t::ncclUint8, 1, comm, s)
                    } else {
                        nr::recv(byte as *mut _, 1, ns::ncclDataType_t::ncclUint8, 0, comm, s)
                    }
                };
                result.map_err(|e| err(format!("connecting the pipeline edge {from} -> {to} on rank {rank}: {e:?}")))?;
                stream.synchronize().map_err(|e| err(format!("{e:?}")))?;
            }
        }
        Ok(())
    }

    /// The emulated world's abort flag (none under NCCL).
    pub fn abort_flag(&self) -> Option<std::sync::Arc<std::sync::atomic::AtomicBool>> {
        match &self.backend {
            Backend::Emulated { world, .. } => Some(world.abort_flag()),
            Backend::Nccl { .. } => None,
        }
    }

    /// Runs `wait` (a wait on the device, which NCCL transfers may hold up) under the
    /// watchdog: if a communicator reports an asynchronous error, or the wait outlasts the
    /// timeout (a peer that died or hangs leaves NCCL's kernels waiting for ever), every
    /// communicator is aborted, which ends the wait, and this rank's error names why. Not
    /// under NCCL: `wait` alone.
    pub fn guard<T>(&self, wait: impl FnOnce() -> Result<T, RuntimeError>) -> Result<T, RuntimeError> {
        match &self.backend {
            Backend::Nccl { watchdog, .. } => watchdog.guard(wait),
            Backend::Emulated { .. } => wait(),
        }
    }

    /// Waits for this rank's pipeline sends (their streams).
    pub fn synchronize(&self) -> Result<(), RuntimeError> {
        if let Backend::Nccl { send_streams, .. } = &self.backend {
            for stream in send_streams.lock().map_err(|_| err("poisoned"))?.values() {
                stream.synchronize().map_err(|e| err(format!("{e:?}")))?;
            }
        }
        Ok(())
    }

    /// Sums `len` elements of `dtype` at `ptr` over the group of `rank` along `axes`, in
    /// place (a bucket's region, or one asynchronous all-reduce's output), after what
    /// `stream` has queued, without holding it up: returns the event of its completion
    /// (NCCL; the emulation runs it at once).
    pub fn all_reduce_in_place(&self, axes: &[usize], ptr: u64, len: usize, dtype: DType, rank: usize, stream: Option<&CudaStream>) -> Result<Option<cudarc::driver::CudaEvent>, RuntimeError> {
        let what = |e: RuntimeError| err(format!("a bucket's all-reduce: {e}"));
        // `ptr` is `len` elements of this rank's memory (a bucket region the program
        // validated, or an output); every rank of the group issues the same call.
        match &self.backend {
            Backend::Nccl { .. } => self.after_on_group_stream(axes, stream, |own| self.nccl_call(Call::AllReduce { max: false }, axes, ptr, ptr, len, dtype, rank, own)).map(Some).map_err(what),
            Backend::Emulated { .. } => self.call(Call::AllReduce { max: false }, axes, ptr, ptr, len, dtype, rank, stream).map(|()| None).map_err(what),
        }
    }

    /// Runs a bucket of reduce-scatters or all-gathers of contiguous blocks (`members`, in
    /// program order) of this rank as one NCCL group, which NCCL launches as one kernel, on
    /// their communicator's stream after what `stream` has queued, without holding it up:
    /// returns the event of its completion. The emulation runs them one after another at
    /// once.
    pub fn run_group(&self, members: &[GroupMember], rank: usize, stream: Option<&CudaStream>) -> Result<Option<cudarc::driver::CudaEvent>, RuntimeError> {
        let what = || format!("a bucket of {} {}", members.len(), if members.first().is_some_and(|m| m.gather) { "all-gathers" } else { "reduce-scatters" });
        let call = |m: &GroupMember| if m.gather { Call::AllGather } else { Call::ReduceScatter };
        let Some(first) = members.first() else { return Ok(None) };
        if members.iter().any(|m| m.axes != first.axes) {
            return Err(err(format!("{}: members over different axes", what())));
        }
        if !matches!(self.backend, Backend::Nccl { .. }) {
            return members.iter().try_for_each(|m| self.call(call(m), &m.axes, m.send, m.recv, m.count, m.dtype, rank, stream)).map(|()| None).map_err(|e| err(format!("{}: {e}", what())));
        }
        // The whole group on its communicator's stream: NCCL enqueues a group's kernel at
        // ncclGroupEnd, so the completion event is recorded after it.
        self.after_on_group_stream(&first.axes, stream, |own| {
            nr::group_start().map_err(|e| err(format!("ncclGroupStart on rank {rank}: {e:?}")))?;
            // Every member is issued, and the group always closed, before an error is reported.
            let issued: Result<(), RuntimeError> = members.iter().try_for_each(|m| self.nccl_call(call(m), &m.axes, m.send, m.recv, m.count, m.dtype, rank, own));
            let ended = nr::group_end().map(|_| ()).map_err(|e| err(format!("ncclGroupEnd on rank {rank}: {e:?}")));
            issued.and(ended)
        })
        .map(Some)
        .map_err(|e| err(format!("{}: {e}", what())))
    }

    /// Runs `members` (shifts of this rank over one group, in program order) as one NCCL group
    /// of sends and receives on the group's communicator stream, after what `stream` has
    /// queued: with `join`, `stream` waits for them (a synchronous shift); else the event of
    /// their completion is returned for the bucket's `xf.wait`. The emulation sends them all,
    /// then receives them, at once.
    pub fn shift(&self, members: &[ShiftMember], rank: usize, stream: Option<&CudaStream>, join: bool) -> Result<Option<cudarc::driver::CudaEvent>, RuntimeError> {
        let Some(first) = members.first() else { return Ok(None) };
        if members.iter().any(|m| m.axes != first.axes) {
            return Err(err(format!("{} shifts over different axes in one group", members.len())));
        }
        match &self.backend {
            Backend::Nccl { groups, .. } => {
                let comm = *groups.get(&first.axes).ok_or_else(|| err(format!("no communicator for axes {:?}", first.axes)))?;
                let done = self.after_on_group_stream(&first.axes, stream, |own| {
                    let s = own.cu_stream() as ns::cudaStream_t;
                    nr::group_start().map_err(|e| err(format!("ncclGroupStart on rank {rank}: {e:?}")))?;
                    // SAFETY: each member's `send` and `recv` hold `bytes` of this rank's device
                    // memory that the memory plan keeps until the shift is waited for; every rank
                    // of the group issues its shifts in the same order, and the peers' positions
                    // are in the group's communicator.
                    let issued: Result<(), RuntimeError> = members.iter().try_for_each(|m| unsafe {
                        nr::send(m.send as *const _, m.bytes, ns::ncclDataType_t::ncclUint8, m.to.0 as i32, comm, s).map_err(|e| err(format!("ncclSend of a shift from rank {rank} to rank {}: {e:?}", m.to.1)))?;
                        nr::recv(m.recv as *mut _, m.bytes, ns::ncclDataType_t::ncclUint8, m.from.0 as i32, comm, s).map(|_| ()).map_err(|e| err(format!("ncclRecv of a shift on rank {rank} from rank {}: {e:?}", m.from.1)))
                    });
                    let ended = nr::group_end().map(|_| ()).map_err(|e| err(format!("ncclGroupEnd on rank {rank}: {e:?}")));
                    issued.and(ended)
                })?;
                if !join {
                    return Ok(Some(done));
                }
                stream.ok_or_else(|| err("NCCL needs a GPU stream"))?.wait(&done).map_err(|e| err(format!("{e:?}")))?;
                Ok(None)
            }
            Backend::Emulated { world, shifts, .. } => {
                let mut comm = world.comm.lock().map_err(|_| err("the emulated communicator was poisoned by a failed rank"))?;
                let fail = |e: crate::collectives::CommError| err(format!("emulated NCCL shift on rank {rank}: {e}"));
                for m in members {
                    let k = next_in_sequence(shifts, m.to.1, true)?;
                    // SAFETY: the emulated device's pointers are host addresses of at least
                    // `bytes`.
                    let data = unsafe { std::slice::from_raw_parts(m.send as *const u8, m.bytes) }.to_vec();
                    comm.send_owned(m.to.1, (1 << 62) | k, data).map_err(fail)?;
                }
                for m in members {
                    let k = next_in_sequence(shifts, m.from.1, false)?;
                    let message = comm.recv_raw_bytes(m.from.1, (1 << 62) | k).map_err(fail)?;
                    if message.len() != m.bytes {
                        return Err(err(format!("rank {rank}'s shift {k} from rank {} brought {} bytes for a buffer of {}: the ranks' programs disagree", m.from.1, message.len(), m.bytes)));
                    }
                    // SAFETY: the receiving buffer, a host address of at least `bytes`.
                    unsafe { std::slice::from_raw_parts_mut(m.recv as *mut u8, m.bytes) }.copy_from_slice(&message);
                }
                Ok(None)
            }
        }
    }

    /// Runs one collective of this rank on `stream`. `staging` holds at least the group's
    /// whole tensor; `copy_blocks` rearranges blocks on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        instr: &Instr,
        rank: usize,
        mesh: &MeshShape,
        input: &Buffer,
        output: &Buffer,
        in_ptr: u64,
        out_ptr: u64,
        staging: u64,
        stream: Option<&CudaStream>,
        copy_blocks: impl Fn(u64, usize, u64, usize, usize, usize) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let axes: Vec<usize> = instr.ints("grid_axes").map_err(err)?.iter().map(|&a| a as usize).collect();
        let group = mesh.group(rank, &axes);
        let n = group.len();
        let position = group.iter().position(|&r| r == rank).unwrap_or(0);
        let dtype = input.dtype;
        let es = input.dtype.bytes();
        let split = |axis: usize| -> (usize, usize) { (input.shape[..axis].iter().product(), input.shape[axis + 1..].iter().product::<usize>() * es) };
        // Pointers into this rank's slots or the staging buffer, sized by the buffers' shapes.
        match instr.op.as_str() {
            "shard.all_reduce" => {
                let max = matches!(instr.attrs.get("reduction"), Some(Attr::Str(k)) if k == "max");
                self.call(Call::AllReduce { max }, &axes, in_ptr, out_ptr, input.len(), dtype, rank, stream)
            }
            "shard.all_gather" => {
                let axis = instr.int("gather_axis").map_err(err)? as usize;
                let (outer, inner) = split(axis);
                if outer == 1 {
                    // Each rank's block is contiguous: NCCL's [n][local] is the output.
                    return self.call(Call::AllGather, &axes, in_ptr, out_ptr, input.len(), dtype, rank, stream);
                }
                let block = input.shape[axis] * inner;
                self.call(Call::AllGather, &axes, in_ptr, staging, input.len(), dtype, rank, stream)?;
                // staging is [n][local]; interleave along the axis.
                for r in 0..n {
                    copy_blocks(out_ptr + (r * block) as u64, output.shape[axis] * inner, staging + (r * input.len() * es) as u64, block, outer, block)?;
                }
                Ok(())
            }
            "shard.reduce_scatter" => {
                let axis = instr.int("scatter_axis").map_err(err)? as usize;
                let (outer, inner) = split(axis);
                if outer == 1 {
                    return self.call(Call::ReduceScatter, &axes, in_ptr, out_ptr, output.len(), dtype, rank, stream);
                }
                let block = output.shape[axis] * inner;
                for r in 0..n {
                    copy_blocks(staging + (r * output.len() * es) as u64, block, in_ptr + (r * block) as u64, input.shape[axis] * inner, outer, block)?;
                }
                self.call(Call::ReduceScatter, &axes, staging, out_ptr, output.len(), dtype, rank, stream)
            }
            "shard.all_slice" => {
                let axis = instr.int("slice_axis").map_err(err)? as usize;
                let (outer, inner) = split(axis);
                let block = output.shape[axis] * inner;
                copy_blocks(out_ptr, block, in_ptr + (position * block) as u64, input.shape[axis] * inner, outer, block)
            }
            "shard.broadcast" => {
                let root = instr.ints("root").map_err(err)?;
                let extents: Vec<usize> = axes.iter().map(|&a| mesh.0[a]).collect();
                let root = root.iter().zip(&extents).fold(0usize, |acc, (&r, &e)| acc * e + r as usize);
                self.call(Call::Broadcast { root }, &axes, in_ptr, out_ptr, input.len(), dtype, rank, stream)
            }
            other => Err(err(format!("`{other}` is not supported over NCCL"))),
        }
    }
}

/// The next number of the emulated messages between this rank and `peer` (sent to it, or
/// received from it).
fn next_in_sequence(sequence: &std::sync::Mutex<HashMap<(usize, bool), u64>>, peer: usize, sending: bool) -> Result<u64, RuntimeError> {
    let mut sequence = sequence.lock().map_err(|_| err("poisoned"))?;
    let n = sequence.entry((peer, sending)).or_insert(0);
    *n += 1;
    Ok(*n - 1)
}

/// Every directed pipeline edge of `mesh` (a rank to its neighbours along the pp axis, both
/// ways, wrapping around as interleaved schedules do), in an order every rank computes alike,
/// each given a round in which neither of its ranks is in another edge.
pub fn edge_rounds(mesh: &MeshShape) -> Vec<((usize, usize), usize)> {
    let pp = mesh.0.get(2).copied().unwrap_or(1);
    if pp < 2 {
        return Vec::new();
    }
    let mut edges: Vec<(usize, usize)> = Vec::new();
    for rank in 0..mesh.ranks() {
        let coords = mesh.coords(rank);
        for step in [1, pp - 1] {
            let mut to = coords.clone();
            to[2] = (coords[2] + step) % pp;
            edges.push((rank, mesh.rank(&to)));
        }
    }
    edges.sort();
    edges.dedup();
    let mut busy: Vec<std::collections::HashSet<usize>> = Vec::new();
    edges
        .into_iter()
        .map(|(a, b)| {
            let round = busy.iter().position(|used| !used.contains(&a) && !used.contains(&b)).unwrap_or(busy.len());
            if round == busy.len() {
                busy.push(Default::default());
            }
            busy[round].extend([a, b]);
            ((a, b), round)
        })
        .collect()
}

/// The two-rank communicator of each pipeline edge of `rank` (see [`edge_rounds`]): one
/// `ncclCommSplit` of the world per round, which every rank calls (those outside the
/// round's edges with no colour).
fn pipeline_edges(world: ns::ncclComm_t, rank: usize, mesh: &MeshShape) -> Result<HashMap<(usize, usize), ns::ncclComm_t>, RuntimeError> {
    let rounds = edge_rounds(mesh);
    let count = rounds.iter().map(|(_, r)| r + 1).max().unwrap_or(0);
    let mut edges = HashMap::new();
    for round in 0..count {
        let mine = rounds.iter().enumerate().find(|(_, ((a, b), r))| *r == round && (*a == rank || *b == rank));
        // NCCL_SPLIT_NOCOLOR is -1.
        let (color, key) = match mine {
            Some((index, ((a, _), _))) => (index as i32, i32::from(*a != rank)),
            None => (-1, 0),
        };
        let mut comm = std::ptr::null_mut();
        // SAFETY: collective over the world communicator; every rank makes the same rounds.
        unsafe { ns::ncclCommSplit(world, color, key, &mut comm, std::ptr::null_mut()) }.result().map_err(|e| err(format!("ncclCommSplit for a pipeline edge: {e:?}")))?;
        if let Some((_, (edge, _))) = mine {
            edges.insert(*edge, comm);
        }
    }
    Ok(edges)
}

/// NCCL's name for an element type.
fn nccl_type(dtype: DType) -> ns::ncclDataType_t {
    match dtype {
        DType::F32 => ns::ncclDataType_t::ncclFloat32,
        DType::F64 => ns::ncclDataType_t::ncclFloat64,
        DType::I32 => ns::ncclDataType_t::ncclInt32,
        DType::Bf16 => ns::ncclDataType_t::ncclBfloat16,
    }
}

/// One collective of the emulation over host memory: `count` elements sent (a gather) or
/// received (a scatter), as NCCL counts them.
fn emulated_call<T: crate::collectives::Elem + Default>(call: Call, comm: &mut crate::collectives::Communicator, group: &[usize], send: u64, recv: u64, count: usize) -> Result<(), crate::collectives::CommError> {
    use crate::collectives::{Algorithm, ReduceOp};
    let n = group.len();
    let (send_len, recv_len) = match call {
        Call::AllGather => (count, count * n),
        Call::ReduceScatter => (count * n, count),
        _ => (count, count),
    };
    // SAFETY: the emulated device's pointers are host addresses of allocations at least this
    // long (the caller sized them from the buffers' shapes, as for NCCL); the input is copied
    // out before the output is written, so the two may be one buffer.
    let input: Vec<T> = unsafe { std::slice::from_raw_parts(send as *const T, send_len) }.to_vec();
    let out: &mut [T] = unsafe { std::slice::from_raw_parts_mut(recv as *mut T, recv_len) };
    match call {
        Call::AllReduce { max } => {
            out.copy_from_slice(&input);
            comm.all_reduce(group, out, if max { ReduceOp::Max } else { ReduceOp::Sum }, Algorithm::Ring)
        }
        Call::AllGather => comm.all_gather(group, &input, out),
        Call::ReduceScatter => comm.reduce_scatter(group, &input, out, ReduceOp::Sum),
        Call::Broadcast { root } => {
            out.copy_from_slice(&input);
            comm.broadcast(group, out, root)
        }
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        let Backend::Nccl { world, groups, edges, watchdog, .. } = &mut self.backend else { return };
        // The watchdog stops first; if it aborted the communicators, they are gone.
        if watchdog.stop() {
            return;
        }
        // Aborted rather than destroyed: a destroy waits for operations in flight, which
        // after a failure may wait on a peer that is gone; a run that ends well has nothing
        // in flight (every step ends synchronised).
        for comm in groups.values().chain(edges.values()) {
            // SAFETY: communicators this struct created.
            let _ = unsafe { nr::comm_abort(*comm) };
        }
        // SAFETY: as above.
        let _ = unsafe { nr::comm_abort(*world) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pipeline neighbour pair has an edge each way (wrapping around), and no rank is
    /// in two edges of one round: each round's `ncclCommSplit` pairs ranks, and every rank
    /// computes the same rounds.
    #[test]
    fn pipeline_edges_pair_every_neighbour_both_ways_in_rounds() {
        for extents in [vec![1, 1, 2], vec![2, 2, 2], vec![2, 1, 4], vec![1, 2, 3], vec![2, 2, 1]] {
            let mesh = MeshShape(extents.clone());
            let rounds = edge_rounds(&mesh);
            let pp = extents[2];
            let expected = if pp < 2 { 0 } else if pp == 2 { mesh.ranks() } else { 2 * mesh.ranks() };
            assert_eq!(rounds.len(), expected, "{extents:?}");
            for ((a, b), _) in &rounds {
                let (ca, cb) = (mesh.coords(*a), mesh.coords(*b));
                assert_eq!((ca[0], ca[1]), (cb[0], cb[1]), "{extents:?}: an edge between ranks of other dp or tp coordinates");
                assert!((ca[2] + 1) % pp == cb[2] || (cb[2] + 1) % pp == ca[2], "{extents:?}: {a} -> {b} are not neighbours");
                assert!(rounds.iter().any(|((x, y), _)| (x, y) == (b, a)), "{extents:?}: {a} -> {b} has no way back");
            }
            for round in 0..rounds.iter().map(|(_, r)| r + 1).max().unwrap_or(0) {
                let mut seen = std::collections::HashSet::new();
                for ((a, b), _) in rounds.iter().filter(|(_, r)| *r == round) {
                    assert!(seen.insert(*a) && seen.insert(*b), "{extents:?}: a rank twice in round {round}");
                }
            }
            assert_eq!(rounds, edge_rounds(&mesh), "the rounds are a function of the mesh");
        }
    }
}

/// Communicator handles the watchdog thread polls and, on a failure, aborts.
struct Handles(Vec<ns::ncclComm_t>);

// SAFETY: NCCL allows `ncclCommGetAsyncError` and `ncclCommAbort` from another thread while
// the communicator is in use; the watchdog aborts only while the owning thread waits on the
// device (armed), never while it issues calls, and the handles outlive the thread (`stop`
// joins it before the communicators are dropped).
unsafe impl Send for Handles {}
// SAFETY: as above; the handles are only read (the watchdog's two closures share them).
unsafe impl Sync for Handles {}

/// What the owning thread and the watchdog thread share.
#[derive(Default)]
struct WatchState {
    /// While the owning thread waits on the device: until when it may.
    armed_until: Option<std::time::Instant>,
    /// Why the communicators failed, once they did.
    tripped: Option<String>,
    /// Whether the watchdog aborted them (they must not be used or aborted again).
    aborted: bool,
    /// Whether the owner is inside an NCCL call (no abort may run then).
    in_call: bool,
    stop: bool,
}

/// The owner's stay inside NCCL calls (see [`Watchdog::enter`]).
struct InNccl<'a>(&'a std::sync::Mutex<WatchState>);

impl Drop for InNccl<'_> {
    fn drop(&mut self) {
        if let Ok(mut s) = self.0.lock() {
            s.in_call = false;
        }
    }
}

/// A thread that polls a process's NCCL communicators every 50 ms, as PyTorch's NCCL
/// watchdog does: an asynchronous error (a peer's connection lost, say) or a wait on the
/// device past the timeout trips it, and while the owner waits it aborts every communicator
/// so that the wait ends.
struct Watchdog {
    state: std::sync::Arc<std::sync::Mutex<WatchState>>,
    timeout: Duration,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(handles: Handles, rank: usize, timeout: Duration) -> Watchdog {
        let handles = std::sync::Arc::new(handles);
        let polled = handles.clone();
        let poll = move || {
            for &comm in &polled.0 {
                let mut state = ns::ncclResult_t::ncclSuccess;
                // SAFETY: a live communicator of this process (see `Handles`).
                let result = unsafe { ns::ncclCommGetAsyncError(comm, &mut state) };
                if !matches!(result, ns::ncclResult_t::ncclSuccess) || !matches!(state, ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress) {
                    return Some(format!("NCCL reported {state:?} on rank {rank} (a peer process failed or its connection was lost)"));
                }
            }
            None
        };
        let abort = move || {
            for &comm in &handles.0 {
                // SAFETY: as above; the owner is blocked in its wait, not in NCCL.
                let _ = unsafe { nr::comm_abort(comm) };
            }
        };
        Watchdog::start_with(rank, timeout, Duration::from_millis(50), poll, abort)
    }

    /// The watchdog over `poll` (an asynchronous error, if any) and `abort`, checked every
    /// `every`.
    fn start_with(rank: usize, timeout: Duration, every: Duration, poll: impl Fn() -> Option<String> + Send + 'static, abort: impl Fn() + Send + 'static) -> Watchdog {
        let state = std::sync::Arc::new(std::sync::Mutex::new(WatchState::default()));
        let shared = state.clone();
        let thread = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || loop {
                std::thread::sleep(every);
                let Ok(mut s) = shared.lock() else { return };
                if s.stop || s.aborted {
                    return;
                }
                if s.tripped.is_none() {
                    s.tripped = poll();
                }
                if s.tripped.is_none() && s.armed_until.is_some_and(|until| std::time::Instant::now() > until) {
                    s.tripped = Some(format!("rank {rank}: no progress on the device within {timeout:?} (--timeout): a peer process failed or hangs"));
                }
                // Aborted at once unless the owner is inside an NCCL call (then at its next
                // wait or call): a wait anywhere else on the device ends.
                if s.tripped.is_some() && (s.armed_until.is_some() || !s.in_call) {
                    abort();
                    s.aborted = true;
                    return;
                }
            })
            .ok();
        Watchdog { state, timeout, thread }
    }

    /// Marks the owner inside NCCL calls until the returned guard drops; an error (and no
    /// call) when the communicators failed or were aborted.
    fn enter(&self) -> Result<InNccl<'_>, RuntimeError> {
        let mut s = self.state.lock().map_err(|_| err("the NCCL watchdog's state was poisoned"))?;
        match (&s.tripped, s.aborted) {
            (Some(why), _) => return Err(err(format!("{why}; the communicators are aborted"))),
            (None, true) => return Err(err("the NCCL communicators were aborted")),
            (None, false) => s.in_call = true,
        }
        Ok(InNccl(&self.state))
    }

    /// An error when the communicators failed or were aborted.
    fn live(&self) -> Result<(), RuntimeError> {
        let s = self.state.lock().map_err(|_| err("the NCCL watchdog's state was poisoned"))?;
        match (&s.tripped, s.aborted) {
            (Some(why), _) => Err(err(format!("{why}; the communicators are aborted"))),
            (None, true) => Err(err("the NCCL communicators were aborted")),
            (None, false) => Ok(()),
        }
    }

    fn guard<T>(&self, wait: impl FnOnce() -> Result<T, RuntimeError>) -> Result<T, RuntimeError> {
        self.live()?;
        self.state.lock().map_err(|_| err("poisoned"))?.armed_until = Some(deadline(std::time::Instant::now(), self.timeout));
        let result = wait();
        // Disarmed under the lock: an abort in progress finishes first.
        let mut s = self.state.lock().map_err(|_| err("poisoned"))?;
        s.armed_until = None;
        match &s.tripped {
            Some(why) => Err(err(format!("{why}; the communicators are aborted"))),
            None => result,
        }
    }

    /// Stops the thread; whether it had aborted the communicators.
    fn stop(&mut self) -> bool {
        if let Ok(mut s) = self.state.lock() {
            s.stop = true;
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.state.lock().map(|s| s.aborted).unwrap_or(true)
    }
}

/// `after` past `from`, or as far as the clock reaches (`--timeout` takes any number of
/// seconds, which `Instant + Duration` would overflow on).
fn deadline(from: std::time::Instant, after: std::time::Duration) -> std::time::Instant {
    let mut after = after;
    loop {
        match from.checked_add(after) {
            Some(at) => return at,
            None => after /= 2,
        }
    }
}

#[cfg(test)]
mod watchdog_tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    fn watchdog(timeout_ms: u64, error: Arc<AtomicBool>, aborts: Arc<AtomicUsize>) -> Watchdog {
        let poll = move || error.load(Ordering::SeqCst).then(|| "NCCL reported ncclRemoteError on rank 3".to_string());
        let abort = move || {
            aborts.fetch_add(1, Ordering::SeqCst);
        };
        Watchdog::start_with(3, Duration::from_millis(timeout_ms), Duration::from_millis(5), poll, abort)
    }

    /// `--timeout` takes any number of seconds: a guarded wait under the largest arms a
    /// deadline as far as the clock reaches instead of overflowing (a panic in every build).
    #[test]
    fn a_timeout_past_the_clocks_range_waits_without_overflowing() {
        let now = std::time::Instant::now();
        assert!(deadline(now, Duration::MAX) > now + Duration::from_secs(1 << 30));
        assert_eq!(deadline(now, Duration::from_secs(5)), now + Duration::from_secs(5));
        let dog = Watchdog::start_with(0, Duration::from_secs(u64::MAX), Duration::from_millis(5), || None, || {});
        assert_eq!(dog.guard(|| Ok(7)).unwrap(), 7);
    }

    #[test]
    fn a_wait_past_the_timeout_aborts_the_communicators_and_says_why() {
        let aborts = Arc::new(AtomicUsize::new(0));
        let mut w = watchdog(50, Arc::new(AtomicBool::new(false)), aborts.clone());
        assert_eq!(w.guard(|| Ok(1)).unwrap(), 1, "a quick wait passes");
        // A wait that only ends once the communicators are aborted (as a hung NCCL kernel).
        let seen = aborts.clone();
        let e = w.guard(|| {
            while seen.load(Ordering::SeqCst) == 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(())
        });
        let e = e.expect_err("tripped").to_string();
        assert!(e.contains("rank 3: no progress on the device within 50ms"), "{e}");
        assert_eq!(aborts.load(Ordering::SeqCst), 1);
        assert!(w.live().is_err() && w.guard(|| Ok(())).is_err(), "nothing runs on aborted communicators");
        assert!(w.stop(), "the drop must not abort them again");
    }

    #[test]
    fn an_asynchronous_error_aborts_at_once_unless_the_owner_is_inside_nccl() {
        let (error, aborts) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let mut w = watchdog(10_000, error.clone(), aborts.clone());
        // Inside an NCCL call: recorded, not aborted (the call may be using them).
        let inside = w.enter().unwrap();
        error.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(aborts.load(Ordering::SeqCst), 0);
        let e = w.live().expect_err("tripped").to_string();
        assert!(e.contains("ncclRemoteError on rank 3"), "{e}");
        // Out of it (waiting on the device anywhere, say): aborted, and no call enters.
        drop(inside);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(aborts.load(Ordering::SeqCst), 1);
        assert!(w.enter().is_err());
        assert!(w.stop(), "the drop must not abort them again");
    }

    #[test]
    fn an_error_during_a_wait_aborts_at_once() {
        let (error, aborts) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let mut w = watchdog(10_000, error.clone(), aborts.clone());
        let (flag, seen) = (error.clone(), aborts.clone());
        let e = w.guard(|| {
            flag.store(true, Ordering::SeqCst);
            while seen.load(Ordering::SeqCst) == 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(())
        });
        assert!(e.expect_err("tripped").to_string().contains("ncclRemoteError"));
        assert!(w.stop());
    }
}

