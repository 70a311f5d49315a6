//! The CUDA backend (cargo feature `cuda`): runs a rank program's device plan
//! ([`crate::program::DevicePlan`]) on an NVIDIA GPU.
//!
//! The module is compiled by NVRTC when the program is loaded; matrix products go to cuBLAS
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

pub mod nccl;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{result as drv, sys as dsys, CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};

use crate::collectives::MeshShape;
use crate::program::{Attr, DeviceCall, DevicePlan, GemmCall, Instr, KernelArg, Program, Role};
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

/// Compiles a device module to PTX with NVRTC (checks that NVRTC is present first).
pub fn compile_ptx(source: &str) -> Result<String, RuntimeError> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(err("NVRTC (libnvrtc.so.13) was not found: put pip's nvidia-cuda-nvrtc (nvidia/cu13/lib) on LD_LIBRARY_PATH"));
    }
    let options = cudarc::nvrtc::CompileOptions { name: Some("shardc.cu".into()), ..Default::default() };
    match cudarc::nvrtc::compile_ptx_with_opts(source, options) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => Err(err(format!("NVRTC rejected the module:\n{}", log.to_string_lossy()))),
        Err(e) => Err(err(format!("NVRTC failed: {e:?}"))),
    }
}

/// Device memory: one allocation, freed on drop.
struct DeviceMemory {
    ptr: dsys::CUdeviceptr,
    bytes: usize,
}

impl DeviceMemory {
    fn new(bytes: usize) -> Result<DeviceMemory, RuntimeError> {
        // SAFETY: a fresh allocation of at least one byte on the current context.
        let ptr = unsafe { drv::malloc_sync(bytes.max(1)) }.map_err(|e| err(format!("out of device memory allocating {bytes} bytes: {e:?}")))?;
        Ok(DeviceMemory { ptr, bytes })
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync and not freed elsewhere.
        let _ = unsafe { drv::free_sync(self.ptr) };
    }
}

/// One rank's memory: its slots and scratch.
struct RankMemory {
    rank: usize,
    slots: Vec<DeviceMemory>,
    workspace: DeviceMemory,
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
}

/// Runs a program on a GPU, keeping its arguments between runs.
pub struct CudaExecutor {
    program: Program,
    plan: DevicePlan,
    mesh: MeshShape,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
    blas: cudarc::cublas::CudaBlas,
    ranks: Vec<RankMemory>,
    /// Scratch for collectives among ranks on this device.
    staging: Option<DeviceMemory>,
    nccl: Option<nccl::Comms>,
}

impl std::fmt::Debug for CudaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaExecutor").field("program", &self.program.name).field("ranks", &self.ranks.len()).finish()
    }
}

/// Ops the device plan leaves to the runtime.
const RUNTIME_OPS: &[&str] = &["shard.all_reduce", "shard.all_gather", "shard.all_slice", "shard.reduce_scatter", "shard.broadcast", "tensor.empty"];

impl CudaExecutor {
    /// Loads `program` (which must carry a device plan) onto the GPU(s) of `placement`.
    pub fn new(program: Program, placement: &Placement) -> Result<CudaExecutor, RuntimeError> {
        program.validate()?;
        let plan = program.device.clone().ok_or_else(|| err("the program has no device plan: compile it with `--target cuda`"))?;
        if plan.calls.len() != program.instrs.len() {
            return Err(err("the device plan does not match the program's instructions"));
        }
        if program.pipeline.is_some() {
            return Err(err("pipeline programs run on the CPU backend only; use dp and tp on the GPU"));
        }
        for (instr, calls) in program.instrs.iter().zip(&plan.calls) {
            if calls.iter().any(|c| matches!(c, DeviceCall::Runtime)) && !RUNTIME_OPS.contains(&instr.op.as_str()) {
                return Err(err(format!("`{}` (at {}) has no CUDA implementation", instr.op, instr.loc)));
            }
        }
        check_available()?;
        let mesh = MeshShape(if program.mesh.is_empty() { vec![1] } else { program.mesh.clone() });
        let (device, local_ranks, bootstrap) = match placement {
            Placement::SingleDevice { device } => (*device, (0..mesh.ranks()).collect::<Vec<_>>(), None),
            Placement::Nccl(b) => {
                if b.world != mesh.ranks() {
                    return Err(err(format!("WORLD_SIZE is {} but the program's mesh {:?} has {} ranks", b.world, mesh.0, mesh.ranks())));
                }
                (b.local_rank, vec![b.rank], Some(b.clone()))
            }
        };
        let count = CudaContext::device_count().map_err(|e| err(format!("{e:?}")))? as usize;
        if device >= count {
            return Err(err(format!("GPU {device} does not exist (this machine has {count})")));
        }
        let ctx = CudaContext::new(device).map_err(|e| err(format!("creating a context on GPU {device}: {e:?}")))?;
        // SAFETY: this executor passes raw pointers only, so cudarc's per-slice events are unused.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let ptx = compile_ptx(&plan.source)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(|e| err(format!("loading the module: {e:?}")))?;
        let mut functions = HashMap::new();
        for call in plan.calls.iter().flatten() {
            if let DeviceCall::Launch { kernel, .. } = call {
                if !functions.contains_key(kernel) {
                    functions.insert(kernel.clone(), module.load_function(kernel).map_err(|e| err(format!("kernel `{kernel}`: {e:?}")))?);
                }
            }
        }
        for helper in ["shardc_fill_zero", "shardc_copy_blocks", "shardc_accumulate"] {
            functions.insert(helper.to_string(), module.load_function(helper).map_err(|e| err(format!("kernel `{helper}`: {e:?}")))?);
        }
        let blas = cudarc::cublas::CudaBlas::new(stream.clone()).map_err(|e| err(format!("cuBLAS: {e:?}")))?;
        let mut ranks = Vec::new();
        for rank in local_ranks {
            let slots = program.memory.slots.iter().map(|&(len, dtype)| DeviceMemory::new(len * dtype.bytes())).collect::<Result<Vec<_>, _>>()?;
            let memory = RankMemory { rank, slots, workspace: DeviceMemory::new(plan.workspace_bytes)? };
            for slot in &memory.slots {
                // SAFETY: the whole allocation, on this context.
                unsafe { drv::memset_d8_async(slot.ptr, 0, slot.bytes, stream.cu_stream()) }.map_err(|e| err(format!("{e:?}")))?;
            }
            ranks.push(memory);
        }
        let nccl = match bootstrap {
            Some(b) => Some(nccl::Comms::new(&b, &program, &mesh)?),
            None => None,
        };
        Ok(CudaExecutor { program, plan, mesh, ctx, stream, _module: module, functions, blas, ranks, staging: None, nccl })
    }

    /// The program.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The global ranks this executor runs.
    pub fn ranks(&self) -> Vec<usize> {
        self.ranks.iter().map(|r| r.rank).collect()
    }

    /// The GPU's name and compute capability.
    pub fn device_name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "GPU".into());
        match self.ctx.compute_capability() {
            Ok((major, minor)) => format!("{name} (sm_{major}{minor})"),
            Err(_) => name,
        }
    }

    fn buffer_ptr(&self, local: usize, buffer: usize) -> dsys::CUdeviceptr {
        self.ranks[local].slots[self.program.buffers[buffer].slot].ptr
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
        let bytes = encode(values, b.dtype);
        let ptr = self.buffer_ptr(local, buffer);
        // SAFETY: the slot holds at least len elements of the buffer's type; synchronous copy.
        unsafe { drv::memcpy_htod_sync(ptr, &bytes) }.map_err(|e| err(format!("{e:?}")))
    }

    /// Reads a named buffer of local rank `local` as f64.
    pub fn read(&self, local: usize, name: &str) -> Result<Vec<f64>, RuntimeError> {
        let buffer = self.binding(name)?;
        let b = &self.program.buffers[buffer];
        let mut bytes = vec![0u8; b.len() * b.dtype.bytes()];
        self.stream.synchronize().map_err(|e| err(format!("{e:?}")))?;
        // SAFETY: reads the buffer's bytes from its slot.
        unsafe { drv::memcpy_dtoh_sync(&mut bytes, self.buffer_ptr(local, buffer)) }.map_err(|e| err(format!("{e:?}")))?;
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
        let (src, dst) = (self.buffer_ptr(local, from), self.buffer_ptr(local, to));
        if src == dst {
            return Ok(());
        }
        let b = &self.program.buffers[from];
        // SAFETY: both slots hold the buffer; stream-ordered.
        unsafe { drv::memcpy_dtod_async(dst, src, b.len() * b.dtype.bytes(), self.stream.cu_stream()) }.map_err(|e| err(format!("{e:?}")))
    }

    /// Waits for the GPU.
    pub fn synchronize(&self) -> Result<(), RuntimeError> {
        self.stream.synchronize().map_err(|e| err(format!("{e:?}")))?;
        if let Some(comms) = &self.nccl {
            comms.synchronize()?;
        }
        Ok(())
    }

    /// Runs every instruction once on every local rank (in lockstep, so that collectives
    /// among ranks on this device find every input ready).
    pub fn run(&mut self) -> Result<(), RuntimeError> {
        for index in 0..self.program.instrs.len() {
            let calls = self.plan.calls[index].clone();
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
        }
        self.synchronize()
    }

    fn call(&self, index: usize, local: usize, call: &DeviceCall) -> Result<(), RuntimeError> {
        match call {
            DeviceCall::Launch { kernel, grid, block, shared_bytes, args } => {
                let function = self.functions.get(kernel).ok_or_else(|| err(format!("kernel `{kernel}` is not in the module")))?;
                let instr = &self.program.instrs[index];
                let offset = rank_offset(instr, &self.program, &self.mesh, self.ranks[local].rank);
                // Argument values live in these vectors while the launch reads them.
                let mut pointers: Vec<u64> = Vec::new();
                let mut ints: Vec<i64> = Vec::new();
                let mut floats: Vec<f64> = Vec::new();
                enum Slot {
                    P(usize),
                    I(usize),
                    F(usize),
                }
                let mut order = Vec::with_capacity(args.len());
                for arg in args {
                    order.push(match arg {
                        KernelArg::Buffer(b) => {
                            pointers.push(self.buffer_ptr(local, *b));
                            Slot::P(pointers.len() - 1)
                        }
                        KernelArg::Null => {
                            pointers.push(0);
                            Slot::P(pointers.len() - 1)
                        }
                        KernelArg::Workspace => {
                            pointers.push(self.ranks[local].workspace.ptr);
                            Slot::P(pointers.len() - 1)
                        }
                        KernelArg::Int(v) => {
                            ints.push(*v);
                            Slot::I(ints.len() - 1)
                        }
                        KernelArg::Float(v) => {
                            floats.push(*v);
                            Slot::F(floats.len() - 1)
                        }
                        KernelArg::RankOffset => {
                            ints.push(offset as i64);
                            Slot::I(ints.len() - 1)
                        }
                    });
                }
                let mut builder = self.stream.launch_builder(function);
                for slot in &order {
                    match slot {
                        Slot::P(i) => builder.arg(&pointers[*i]),
                        Slot::I(i) => builder.arg(&ints[*i]),
                        Slot::F(i) => builder.arg(&floats[*i]),
                    };
                }
                let config = LaunchConfig { grid_dim: (grid[0], grid[1], grid[2]), block_dim: (*block, 1, 1), shared_mem_bytes: *shared_bytes };
                // SAFETY: the argument list was generated with the kernel's signature
                // (pointers into this rank's slots, i64, f64), checked by codegen's tests.
                unsafe { builder.launch(config) }.map(|_| ()).map_err(|e| err(format!("launching `{kernel}`: {e:?}")))
            }
            DeviceCall::Gemm(g) => self.gemm(local, g),
            DeviceCall::Copy { from, to } => self.copy(local, *from, *to),
            DeviceCall::Fused { .. } | DeviceCall::Runtime => Ok(()),
        }
    }

    /// A row-major GEMM of this rank's buffers.
    fn gemm(&self, local: usize, g: &GemmCall) -> Result<(), RuntimeError> {
        gemm_raw(&self.blas, self.plan.dtype, g, self.buffer_ptr(local, g.a), self.buffer_ptr(local, g.b), self.buffer_ptr(local, g.c))
    }

    /// `dst[o * dst_stride + j] = src[o * src_stride + j]` over bytes.
    fn copy_blocks(&self, dst: u64, dst_stride: usize, src: u64, src_stride: usize, outer: usize, block: usize) -> Result<(), RuntimeError> {
        if outer == 1 || (dst_stride == block && src_stride == block) {
            // SAFETY: contiguous ranges inside the caller's buffers.
            return unsafe { drv::memcpy_dtod_async(dst, src, outer * block, self.stream.cu_stream()) }.map_err(|e| err(format!("{e:?}")));
        }
        let grid = (outer * block).div_ceil(256).clamp(1, 65_535) as u32;
        // The helper takes (dst, dst_stride, src, src_stride, outer, block): pointers and
        // integers interleave, so it is launched through its own argument order.
        let function = self.functions.get("shardc_copy_blocks").ok_or_else(|| err("helper missing"))?;
        let (ds, ss, o, b) = (dst_stride as i64, src_stride as i64, outer as i64, block as i64);
        let mut builder = self.stream.launch_builder(function);
        builder.arg(&dst).arg(&ds).arg(&src).arg(&ss).arg(&o).arg(&b);
        let config = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the prelude's signature (u8*, i64, const u8*, i64, i64, i64).
        unsafe { builder.launch(config) }.map(|_| ()).map_err(|e| err(format!("shardc_copy_blocks: {e:?}")))
    }

    fn staging(&mut self, bytes: usize) -> Result<u64, RuntimeError> {
        if self.staging.as_ref().is_none_or(|s| s.bytes < bytes) {
            self.stream.synchronize().map_err(|e| err(format!("{e:?}")))?;
            self.staging = Some(DeviceMemory::new(bytes)?);
        }
        Ok(self.staging.as_ref().map_or(0, |s| s.ptr))
    }

    /// Runs a collective (or `tensor.empty`) of every local rank.
    fn collective(&mut self, index: usize) -> Result<(), RuntimeError> {
        let instr = self.program.instrs[index].clone();
        if instr.op == "tensor.empty" {
            for local in 0..self.ranks.len() {
                let b = &self.program.buffers[instr.outputs[0]];
                // SAFETY: the output's bytes.
                unsafe { drv::memset_d8_async(self.buffer_ptr(local, instr.outputs[0]), 0, b.len() * b.dtype.bytes(), self.stream.cu_stream()) }.map_err(|e| err(format!("{e:?}")))?;
            }
            return Ok(());
        }
        if self.nccl.is_some() {
            return self.collective_nccl(&instr);
        }
        let axes: Vec<usize> = instr.ints("grid_axes").map_err(err)?.iter().map(|&a| a as usize).collect();
        let (input, output) = (self.program.buffers[instr.inputs[0]].clone(), self.program.buffers[instr.outputs[0]].clone());
        let es = input.dtype.bytes();
        let (in_shape, out_shape) = (input.shape.clone(), output.shape.clone());
        let (in_bytes, out_bytes) = (input.len() * es, output.len() * es);
        let split = |axis: usize| -> (usize, usize) { (in_shape[..axis].iter().product(), in_shape[axis + 1..].iter().product::<usize>() * es) };
        // Every group of ranks along `axes`, once.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for r in 0..self.mesh.ranks() {
            let g = self.mesh.group(r, &axes);
            if !groups.contains(&g) {
                groups.push(g);
            }
        }
        match instr.op.as_str() {
            "shard.all_reduce" | "shard.reduce_scatter" => {
                let max = matches!(instr.attrs.get("reduction"), Some(Attr::Str(k)) if k == "max") as i32;
                let staging = self.staging(in_bytes)?;
                for group in &groups {
                    // Sum (or max) in rank order into the staging buffer, then hand out.
                    self.copy_raw(staging, self.buffer_ptr(group[0], instr.inputs[0]), in_bytes)?;
                    for &r in &group[1..] {
                        let grid = input.len().div_ceil(256).clamp(1, 65_535) as u32;
                        let function = self.functions.get("shardc_accumulate").ok_or_else(|| err("helper missing"))?;
                        let (src, n) = (self.buffer_ptr(r, instr.inputs[0]), input.len() as i64);
                        let mut builder = self.stream.launch_builder(function);
                        builder.arg(&staging).arg(&src).arg(&n).arg(&max);
                        let config = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                        // SAFETY: the prelude's (T*, const T*, i64, int).
                        unsafe { builder.launch(config) }.map(|_| ()).map_err(|e| err(format!("shardc_accumulate: {e:?}")))?;
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

    fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<(), RuntimeError> {
        if dst == src || bytes == 0 {
            return Ok(());
        }
        // SAFETY: callers pass ranges inside live allocations.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(|e| err(format!("{e:?}")))
    }

    fn collective_nccl(&mut self, instr: &Instr) -> Result<(), RuntimeError> {
        let rank = self.ranks[0].rank;
        let (input, output) = (self.buffer_ptr(0, instr.inputs[0]), self.buffer_ptr(0, instr.outputs[0]));
        let in_buffer = self.program.buffers[instr.inputs[0]].clone();
        let out_buffer = self.program.buffers[instr.outputs[0]].clone();
        let staging = self.staging(in_buffer.len().max(out_buffer.len()) * in_buffer.dtype.bytes() * self.mesh.ranks())?;
        let comms = self.nccl.as_ref().ok_or_else(|| err("no NCCL communicator"))?;
        comms.run(instr, rank, &self.mesh, &in_buffer, &out_buffer, input, output, staging, &self.stream, |dst, ds, src, ss, outer, block| self.copy_blocks(dst, ds, src, ss, outer, block))
    }

    /// Bytes of device memory this executor holds (all local ranks).
    pub fn device_bytes(&self) -> usize {
        self.ranks.iter().map(|r| r.slots.iter().map(|s| s.bytes).sum::<usize>() + r.workspace.bytes).sum()
    }
}

/// The first row of a split table this rank holds, as the CPU backend computes it.
fn rank_offset(instr: &Instr, program: &Program, mesh: &MeshShape, rank: usize) -> usize {
    for (attr, last_dim) in [("xf.row_split_axes", false), ("xf.vocab_split_axes", true)] {
        if let Ok(axes) = instr.ints(attr) {
            let axes: Vec<usize> = axes.iter().map(|&a| a as usize).collect();
            let group = mesh.group(rank, &axes);
            let position = group.iter().position(|&r| r == rank).unwrap_or(0);
            let shape = &program.buffers[instr.inputs[0]].shape;
            let rows = if last_dim { *shape.last().unwrap_or(&1) } else { shape[0] };
            return position * rows;
        }
    }
    0
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
pub fn train(program: &Program, seed: u64, layers: usize, corpus: &crate::data::ByteCorpus, steps: u64, placement: &Placement) -> Result<CudaRun, RuntimeError> {
    let mut exec = CudaExecutor::new(program.clone(), placement)?;
    let mesh = exec.mesh.clone();
    let tokens = program.arg("tokens").ok_or_else(|| RuntimeError::Binding("the program has no `tokens` input".into()))?;
    let token_shape = program.buffers[tokens.buffer].shape.clone();
    let (rows, seq) = match &tokens.layout {
        Some(l) => (l.global_shape[0], l.global_shape[1]),
        None => (token_shape[0], token_shape[1]),
    };
    let params: Vec<_> = program.args.iter().filter(|a| a.role == Some(Role::Param)).cloned().collect();
    let local_ranks = exec.ranks();
    for p in &params {
        let global_shape = p.layout.as_ref().map_or_else(|| program.buffers[p.buffer].shape.clone(), |l| l.global_shape.clone());
        let global = crate::init::init_param(&p.name, global_shape.iter().product(), seed, layers);
        for (local, &rank) in local_ranks.iter().enumerate() {
            let shard = match &p.layout {
                Some(layout) => crate::layout::local_shard(&global, layout, &mesh, rank),
                None => global.clone(),
            };
            exec.write(local, &p.name, &shard)?;
        }
    }
    let mut losses = Vec::new();
    let mut step_seconds = Vec::new();
    for step in 1..=steps {
        let (t, g) = corpus.batch(seed, step, rows, seq);
        let (t, g): (Vec<f64>, Vec<f64>) = (t.iter().map(|&v| v as f64).collect(), g.iter().map(|&v| v as f64).collect());
        for (local, &rank) in local_ranks.iter().enumerate() {
            let (ts, gs) = match &tokens.layout {
                Some(layout) => (crate::layout::local_shard(&t, layout, &mesh, rank), crate::layout::local_shard(&g, layout, &mesh, rank)),
                None => (t.clone(), g.clone()),
            };
            exec.write(local, "tokens", &ts)?;
            exec.write(local, "targets", &gs)?;
            exec.write(local, "step", &[step as f64])?;
        }
        let began = std::time::Instant::now();
        exec.run()?;
        exec.carry_state()?;
        exec.synchronize()?;
        step_seconds.push(began.elapsed().as_secs_f64());
        losses.push(exec.read(0, "loss")?[0]);
    }
    let mut parameters = Vec::new();
    for p in &params {
        let shards = (0..local_ranks.len()).map(|local| exec.read(local, &p.name)).collect::<Result<Vec<_>, _>>()?;
        match &p.layout {
            Some(layout) if shards.len() == mesh.ranks() => parameters.push((p.name.clone(), layout.global_shape.clone(), crate::layout::assemble(&shards, layout, &mesh))),
            Some(_) => {}
            None => parameters.push((p.name.clone(), program.buffers[p.buffer].shape.clone(), shards[0].clone())),
        }
    }
    Ok(CudaRun { losses, parameters, step_seconds, device: exec.device_name() })
}

/// Measures cuBLAS on one square GEMM (`size`^3, `dtype` operands, fp32 accumulation):
/// TFLOP/s over `iterations` calls after a warm-up. The reference the GPU check compares
/// achieved throughput with.
pub fn gemm_peak(device: usize, size: usize, dtype: DType, iterations: usize) -> Result<f64, RuntimeError> {
    check_available()?;
    let ctx = CudaContext::new(device).map_err(|e| err(format!("{e:?}")))?;
    // SAFETY: raw pointers only.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.default_stream();
    let blas = cudarc::cublas::CudaBlas::new(stream.clone()).map_err(|e| err(format!("cuBLAS: {e:?}")))?;
    let bytes = size * size * dtype.bytes();
    let (a, b, c) = (DeviceMemory::new(bytes)?, DeviceMemory::new(bytes)?, DeviceMemory::new(bytes)?);
    for m in [&a, &b, &c] {
        // SAFETY: whole allocations.
        unsafe { drv::memset_d8_async(m.ptr, 0, m.bytes, stream.cu_stream()) }.map_err(|e| err(format!("{e:?}")))?;
    }
    let call = GemmCall { a: 0, b: 1, c: 2, m: size, n: size, k: size, transpose_a: false, transpose_b: false, lda: size, ldb: size, ldc: size, stride_a: 0, stride_b: 0, stride_c: 0, batch: 1 };
    let run = |times: usize| -> Result<(), RuntimeError> {
        for _ in 0..times {
            gemm_raw(&blas, dtype, &call, a.ptr, b.ptr, c.ptr)?;
        }
        stream.synchronize().map_err(|e| err(format!("{e:?}")))
    };
    run(3)?;
    let began = std::time::Instant::now();
    run(iterations.max(1))?;
    let seconds = began.elapsed().as_secs_f64();
    Ok(2.0 * (size as f64).powi(3) * iterations.max(1) as f64 / seconds / 1e12)
}

/// One row-major GEMM on raw pointers: `C^T = op(B)^T op(A)^T` in cuBLAS's column-major terms.
fn gemm_raw(blas: &cudarc::cublas::CudaBlas, dtype: DType, g: &GemmCall, a: u64, b: u64, c: u64) -> Result<(), RuntimeError> {
    use cudarc::cublas::sys::{cublasComputeType_t as Compute, cublasOperation_t as Op, cudaDataType as Ty};
    let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
    let (ty, compute) = match dtype {
        DType::Bf16 => (Ty::CUDA_R_16BF, Compute::CUBLAS_COMPUTE_32F),
        DType::F64 => (Ty::CUDA_R_64F, Compute::CUBLAS_COMPUTE_64F),
        _ => (Ty::CUDA_R_32F, Compute::CUBLAS_COMPUTE_32F),
    };
    let (alpha32, beta32, alpha64, beta64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
    let (alpha, beta): (*const std::ffi::c_void, *const std::ffi::c_void) = if dtype == DType::F64 {
        (&alpha64 as *const f64 as *const _, &beta64 as *const f64 as *const _)
    } else {
        (&alpha32 as *const f32 as *const _, &beta32 as *const f32 as *const _)
    };
    let int = |v: usize| i32::try_from(v).map_err(|_| err(format!("GEMM dimension {v} exceeds cuBLAS's 32-bit range")));
    // SAFETY: pointers to device memory holding the operands with the strides `g` states;
    // alpha/beta are host scalars that outlive the call.
    unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            *blas.handle(),
            op(g.transpose_b),
            op(g.transpose_a),
            int(g.n)?,
            int(g.m)?,
            int(g.k)?,
            alpha,
            b as *const _,
            ty,
            int(g.ldb)?,
            g.stride_b as i64,
            a as *const _,
            ty,
            int(g.lda)?,
            g.stride_a as i64,
            beta,
            c as *mut _,
            ty,
            int(g.ldc)?,
            g.stride_c as i64,
            int(g.batch)?,
            compute,
            cudarc::cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| err(format!("cuBLAS GEMM {}x{}x{}: {e:?}", g.m, g.n, g.k)))
}

/// FLOPs of a device plan's GEMMs (2 m n k per batch item): what the step's matrix products
/// execute.
pub fn gemm_flops(plan: &DevicePlan) -> f64 {
    plan.calls.iter().flatten().map(|c| if let DeviceCall::Gemm(g) = c { 2.0 * (g.m * g.n * g.k * g.batch) as f64 } else { 0.0 }).sum()
}
