//! Device code: a rank program's CUDA module and the calls of each instruction.
//!
//! Every op's device fact comes from the registry ([`shardc_ir::ops::OpDef::device`]). Runs
//! of element-wise instructions become one generated kernel: values that only the run reads
//! stay in registers, so `matmul -> add bias -> gelu` reads and writes memory once for the
//! add and the gelu together. Matrix products become cuBLAS calls; collectives are left to
//! the runtime.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use shardc_ir::kernel::{Arg, DeviceKernel, Gemm, KernelCx, PRELUDE};
use shardc_ir::ops::lookup;
use shardc_ir::TensorTy;
use shardc_runtime::DType;
use shardc_runtime::program::{Attr, BufferId, DeviceCall, DevicePlan, Epilogue, EpilogueActivation, KernelArg, Program};

use crate::CodegenError;

/// The floating-point storage type of a program's module: its tensors' one float type, or
/// bf16 for a mixed-precision program (bf16 compute, fp32 master weights, state, gradient
/// accumulation and loss).
fn float_dtype(program: &Program) -> Result<DType, String> {
    let mut kinds: Vec<DType> = Vec::new();
    for b in program.buffers.iter().filter(|b| b.dtype != DType::I32) {
        if !kinds.contains(&b.dtype) {
            kinds.push(b.dtype);
        }
    }
    match kinds[..] {
        [] => Ok(DType::F32),
        [one] => Ok(one),
        _ if kinds.iter().all(|d| matches!(d, DType::F32 | DType::Bf16)) => Ok(DType::Bf16),
        _ => Err(format!("mixes {kinds:?} tensors; device code takes one float type per program, or bf16 with fp32 (mixed precision)")),
    }
}

/// The element type an instruction's kernel is instantiated for in a module of storage type
/// `module`: the module's, or fp32 for an instruction of a bf16 module that reads and writes
/// only fp32 floats (mixed precision).
fn instance_dtype(program: &Program, index: usize, module: DType) -> Result<DType, String> {
    let instr = &program.instrs[index];
    // Statistics are kept in the accumulator type (fp32 beside bf16 storage).
    let statistics = lookup(&instr.op).map_or(&[][..], |op| op.statistics_slots());
    let floats: Vec<DType> = instr.inputs.iter().chain(&instr.outputs).enumerate().filter(|(slot, _)| !statistics.contains(slot)).map(|(_, &b)| program.buffers[b].dtype).filter(|&d| d != DType::I32).collect();
    if module != DType::Bf16 || floats.iter().all(|&d| d == DType::Bf16) {
        return Ok(module);
    }
    if floats.iter().all(|&d| d == DType::F32) {
        return Ok(DType::F32);
    }
    Err(format!("`{}` reads and writes both bf16 and fp32 tensors; only element-wise ops (casts) may", instr.op))
}

/// `source` with every kernel renamed `NAME` + `suffix`.
fn suffix_kernels(source: &str, suffix: &str) -> String {
    const MARK: &str = "__global__ void ";
    let mut out = String::with_capacity(source.len() + 64);
    let mut rest = source;
    while let Some(at) = rest.find(MARK) {
        let name_start = at + MARK.len();
        let name_end = rest[name_start..].find('(').map_or(rest.len(), |p| name_start + p);
        out.push_str(&rest[..name_end]);
        out.push_str(suffix);
        rest = &rest[name_end..];
    }
    out.push_str(rest);
    out
}

/// Bytes of `acc_t` for a storage type.
fn acc_bytes(dtype: DType) -> usize {
    if dtype == DType::F64 { 8 } else { 4 }
}

/// The instruction's device fact, from the registry.
fn device_kernel(program: &Program, index: usize) -> Result<Option<DeviceKernel>, String> {
    let instr = &program.instrs[index];
    let Some(def) = lookup(&instr.op) else {
        return if instr.op.starts_with("shard.") || instr.op == "tensor.empty" { Ok(None) } else { Err(format!("`{}` has no device form", instr.op)) };
    };
    let ty = |b: BufferId| {
        let buffer = &program.buffers[b];
        TensorTy::new(buffer.shape.iter().map(|&d| d as i64).collect::<Vec<_>>(), buffer.dtype)
    };
    let inputs: Vec<TensorTy> = instr.inputs.iter().map(|&b| ty(b)).collect();
    let input_refs: Vec<&TensorTy> = inputs.iter().collect();
    let outputs: Vec<TensorTy> = instr.outputs.iter().map(|&b| ty(b)).collect();
    let attrs = crate::estimate::instr_attrs(instr);
    def.device(&KernelCx { inputs: &input_refs, outputs: &outputs, attrs: &attrs }).map(Some)
}

/// Choices of the device code generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceOptions {
    /// Fold bias adds, GELU and GELU's gradient into the GEMMs that feed them (cuBLASLt's
    /// epilogues); off, they run as element-wise kernels.
    pub gemm_epilogues: bool,
    /// Fuse runs of element-wise instructions into one kernel (and optimizer updates into
    /// multi-tensor batches); off, each instruction is its own launch (what calibration's
    /// chain of tiny kernels needs to measure a launch).
    pub elementwise_fusion: bool,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions { gemm_epilogues: true, elementwise_fusion: true }
    }
}

/// Generates the device plan of `program`: its CUDA module and every instruction's calls.
pub fn device_plan(program: &Program) -> Result<DevicePlan, CodegenError> {
    device_plan_with(program, DeviceOptions::default())
}

/// [`device_plan`] with `options`.
pub fn device_plan_with(program: &Program, options: DeviceOptions) -> Result<DevicePlan, CodegenError> {
    let fail = |index: usize, reason: String| {
        let loc = program.instrs.get(index).map_or_else(String::new, |i| i.loc.clone());
        CodegenError::Unsupported { func: program.name.clone(), loc, reason }
    };
    let dtype = float_dtype(program).map_err(|e| fail(0, e))?;
    let acc = acc_bytes(dtype);
    let kernels: Vec<Option<DeviceKernel>> = (0..program.instrs.len()).map(|i| device_kernel(program, i).map_err(|e| fail(i, e))).collect::<Result<_, _>>()?;
    let readers = Readers::of(program);
    let epilogues = if options.gemm_epilogues { gemm_epilogues(program, &kernels, &readers, dtype) } else { HashMap::new() };
    let fused_into: HashMap<usize, usize> = epilogues.iter().flat_map(|(&gemm, (_, e))| e.members.iter().map(move |&m| (m, gemm))).collect();
    let taken: HashSet<usize> = fused_into.keys().copied().collect();
    let groups = if options.elementwise_fusion {
        elementwise_groups(program, &kernels, &taken)
    } else {
        // Each element-wise instruction a kernel of its own.
        kernels.iter().enumerate().filter(|(i, k)| matches!(k, Some(DeviceKernel::Elementwise { .. })) && !taken.contains(i)).map(|(i, _)| (i, vec![i])).collect()
    };
    let batches = if options.elementwise_fusion { multi_tensor_batches(program, &groups) } else { HashMap::new() };
    let norms = if options.elementwise_fusion { norm_batches(program, &kernels, dtype, &epilogues) } else { HashMap::new() };
    // A norm batch's members before its last, which launches them all.
    let norm_members: HashMap<usize, usize> = norms.iter().flat_map(|(&last, members)| members[..members.len() - 1].iter().map(move |&m| (m, last))).collect();

    let mut sources: Vec<&'static str> = Vec::new();
    // Sources instantiated for fp32 buffers in a bf16 module (mixed precision).
    let mut f32_sources: Vec<&'static str> = Vec::new();
    let mut generated = String::new();
    // Generated kernels of fp32 instructions in a bf16 module (inside the fp32 scope).
    let mut generated_f32 = String::new();
    let mut calls: Vec<Vec<DeviceCall>> = vec![Vec::new(); program.instrs.len()];
    let mut workspace = 0usize;
    let mut index = 0;
    while index < program.instrs.len() {
        let instr = &program.instrs[index];
        if let Some(&gemm) = fused_into.get(&index) {
            calls[index] = vec![DeviceCall::Fused { into: gemm }];
            index += 1;
            continue;
        }
        if let Some((gemm, epilogue)) = epilogues.get(&index) {
            calls[index] = vec![DeviceCall::GemmEpilogue { gemm: gemm.clone(), epilogue: epilogue.clone() }];
            index += 1;
            continue;
        }
        if let Some(batch) = batches.get(&index) {
            let members: Vec<Vec<usize>> = batch.iter().map(|first| groups[first].clone()).collect();
            let (name, text, args, n) = fuse_multi(program, &members, &kernels, &readers, dtype).map_err(|e| fail(index, e))?;
            generated.push_str(&text);
            calls[index] = vec![DeviceCall::Launch { kernel: name, grid: [shardc_ir::kernel::blocks_for(n), 1, 1], block: shardc_ir::kernel::ROW_BLOCK, shared_bytes: 0, args }];
            let all: Vec<usize> = members.iter().flatten().copied().collect();
            for &member in &all[1..] {
                calls[member] = vec![DeviceCall::Fused { into: index }];
            }
            index = all.last().copied().unwrap_or(index) + 1;
            continue;
        }
        if let Some(&last) = norm_members.get(&index) {
            calls[index] = vec![DeviceCall::Fused { into: last }];
            index += 1;
            continue;
        }
        if let Some(batch) = norms.get(&index) {
            let fp32 = instance_dtype(program, index, dtype).map_err(|e| fail(index, e))? != dtype;
            let (source, text, launches, blocks) = fuse_norms(program, batch, &kernels).map_err(|e| fail(index, e))?;
            let list = if fp32 { &mut f32_sources } else { &mut sources };
            if !list.contains(&source) {
                list.push(source);
            }
            workspace = workspace.max(blocks * acc);
            if fp32 { &mut generated_f32 } else { &mut generated }.push_str(&text);
            calls[index] = launches;
            index += 1;
            continue;
        }
        if let Some(group) = groups.get(&index) {
            let (name, text, args, n) = fuse(program, group, &kernels, &readers, dtype).map_err(|e| fail(index, e))?;
            generated.push_str(&text);
            calls[index] = vec![DeviceCall::Launch { kernel: name, grid: [shardc_ir::kernel::blocks_for(n), 1, 1], block: shardc_ir::kernel::ROW_BLOCK, shared_bytes: 0, args }];
            for &member in &group[1..] {
                calls[member] = vec![DeviceCall::Fused { into: index }];
            }
            index = group.last().copied().unwrap_or(index) + 1;
            continue;
        }
        calls[index] = match &kernels[index] {
            None => vec![DeviceCall::Runtime],
            Some(DeviceKernel::PassThrough) => vec![DeviceCall::Copy { from: instr.inputs[0], to: instr.outputs[0] }],
            Some(DeviceKernel::Elementwise { .. }) => return Err(fail(index, "an element-wise op outside a kernel group".into())),
            Some(DeviceKernel::Gemm(_)) if instance_dtype(program, index, dtype).map_err(|e| fail(index, e))? != dtype => {
                return Err(fail(index, "a matrix product of fp32 tensors in a bf16 program: mixed precision multiplies in bf16".into()));
            }
            Some(DeviceKernel::Gemm(g)) => vec![DeviceCall::Gemm(Gemm { a: instr.inputs[g.a], b: instr.inputs[g.b], c: instr.outputs[g.c], ..g.clone() })],
            Some(DeviceKernel::Launches(launches)) => {
                let fp32 = instance_dtype(program, index, dtype).map_err(|e| fail(index, e))? != dtype;
                launches
                .iter()
                .map(|l| {
                    let list = if fp32 { &mut f32_sources } else { &mut sources };
                    if !l.source.is_empty() && !list.contains(&l.source) {
                        list.push(l.source);
                    }
                    workspace = workspace.max(l.workspace * acc);
                    let shared = l.shared * acc;
                    if shared > shardc_ir::kernel::MAX_SHARED_BYTES {
                        return Err(fail(index, format!("`{}` needs {shared} bytes of shared memory (at most {}): the sequence is too long for this kernel", l.kernel, shardc_ir::kernel::MAX_SHARED_BYTES)));
                    }
                    let args = l
                        .args
                        .iter()
                        .map(|a| {
                            Ok(match a {
                                Arg::In(i) => KernelArg::Buffer(*instr.inputs.get(*i).ok_or_else(|| fail(index, format!("`{}` names operand {i}", l.kernel)))?),
                                Arg::Out(i) => KernelArg::Buffer(*instr.outputs.get(*i).ok_or_else(|| fail(index, format!("`{}` names result {i}", l.kernel)))?),
                                Arg::Null => KernelArg::Null,
                                Arg::Workspace => KernelArg::Workspace,
                                Arg::Int(v) => KernelArg::Int(*v),
                                Arg::Float(v) => KernelArg::Float(*v),
                                Arg::RankOffset => KernelArg::RankOffset,
                                Arg::RingKeyOffset => KernelArg::RingKeyOffset,
                            })
                        })
                        .collect::<Result<Vec<_>, CodegenError>>()?;
                    let kernel = if fp32 { format!("{}{}", l.kernel, shardc_ir::kernel::F32_SUFFIX) } else { l.kernel.to_string() };
                    Ok(DeviceCall::Launch { kernel, grid: l.grid, block: l.block, shared_bytes: shared as u32, args })
                })
                .collect::<Result<Vec<_>, CodegenError>>()?
            }
        };
        index += 1;
    }

    let mut source = String::new();
    let _ = writeln!(source, "// shardc device module for `{}` ({:?} storage).", program.name, dtype);
    match dtype {
        DType::Bf16 => source.push_str("#define BF16\n"),
        DType::F64 => source.push_str("#define F64\n"),
        _ => {}
    }
    source.push_str(PRELUDE);
    for text in sources {
        source.push_str(text);
    }
    if !f32_sources.is_empty() {
        source.push_str(shardc_ir::kernel::F32_SCOPE_OPEN);
        for text in f32_sources {
            source.push_str(&suffix_kernels(text, shardc_ir::kernel::F32_SUFFIX));
        }
        source.push_str(&generated_f32);
        source.push_str(shardc_ir::kernel::F32_SCOPE_CLOSE);
    }
    source.push_str(&generated);
    Ok(DevicePlan { dtype, source, workspace_bytes: workspace, calls })
}

/// Runs of consecutive element-wise instructions that one kernel computes, keyed by their
/// first instruction. An instruction joins the run before it when its results have the run's
/// length, every operand it reads at a broadcast index comes from outside the run and
/// shares no storage with what the run writes, and none of its results shares storage with
/// an operand the run reads at a broadcast index (a ZeRO-3 gathered bias whose slot the
/// memory plan hands to the next value): the kernel's threads write element `i` while
/// others still read element `i % len`.
fn elementwise_groups(program: &Program, kernels: &[Option<DeviceKernel>], taken: &HashSet<usize>) -> HashMap<usize, Vec<usize>> {
    use shardc_runtime::program::Alias;
    let len = |b: BufferId| program.buffers[b].len();
    let mut groups: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut current: Vec<usize> = Vec::new();
    let mut n = 0;
    let mut written: HashSet<BufferId> = HashSet::new();
    // Buffers the run reads element by element, and at a broadcast index.
    let mut read: HashSet<BufferId> = HashSet::new();
    let mut broadcast: HashSet<BufferId> = HashSet::new();
    let close = |current: &mut Vec<usize>, groups: &mut HashMap<usize, Vec<usize>>| {
        if let Some(&first) = current.first() {
            groups.insert(first, std::mem::take(current));
        }
    };
    // A pipeline runs its sections apart (a forward on one micro-batch, later its backward):
    // a kernel group launches at its first member, so no group may span two sections.
    let section_starts: HashSet<usize> = program.pipeline.iter().flat_map(|p| &p.chunks).flat_map(|c| c.sections.iter().flat_map(|&(start, end)| [start, end])).collect();
    for (i, kernel) in kernels.iter().enumerate() {
        // An instruction a GEMM's epilogue computes is not element-wise work of its own.
        let elementwise = matches!(kernel, Some(DeviceKernel::Elementwise { .. })) && !taken.contains(&i);
        if !elementwise || section_starts.contains(&i) {
            close(&mut current, &mut groups);
            written.clear();
            read.clear();
            broadcast.clear();
            if !elementwise {
                continue;
            }
        }
        let instr = &program.instrs[i];
        let out_len = instr.outputs.first().map_or(0, |&b| len(b));
        // Every thread of the kernel runs the whole run for its element: a value one thread
        // writes may share memory with what another reads only element for element (the same
        // buffer, or one exactly on top of it), never shifted, and never what is read at a
        // broadcast index.
        let element_wise = |a: BufferId, b: BufferId| a == b || matches!(program.alias(a, b), Alias::None | Alias::Exact);
        let apart = |a: BufferId, b: BufferId| program.alias(a, b) == Alias::None;
        let fits = |written: &HashSet<BufferId>, read: &HashSet<BufferId>, broadcast: &HashSet<BufferId>, n: usize| {
            out_len == n
                && instr.outputs.iter().all(|&o| len(o) == n && read.iter().all(|&r| element_wise(o, r)) && broadcast.iter().all(|&r| apart(o, r)))
                && instr.inputs.iter().all(|&x| if len(x) == n { written.iter().all(|&w| element_wise(x, w)) } else { written.iter().all(|&w| apart(x, w)) })
        };
        if current.is_empty() || !fits(&written, &read, &broadcast, n) {
            close(&mut current, &mut groups);
            written.clear();
            read.clear();
            broadcast.clear();
            n = out_len;
        }
        current.push(i);
        written.extend(instr.outputs.iter().copied());
        read.extend(instr.inputs.iter().filter(|&&b| len(b) == n).copied());
        broadcast.extend(instr.inputs.iter().filter(|&&b| len(b) != n).copied());
    }
    close(&mut current, &mut groups);
    groups
}

/// How far past a GEMM its epilogue's instructions may lie (the backward's weight-gradient
/// GEMM sits between a data-gradient GEMM and the GELU gradient that reads it).
const EPILOGUE_WINDOW: usize = 4;

/// GEMMs whose product only feeds a bias add, then perhaps GELU, or only GELU's gradient:
/// each becomes one [`DeviceCall::GemmEpilogue`] at the GEMM (cuBLASLt's fused epilogues), so
/// the product never makes a round trip through memory. Keyed by the GEMM's instruction.
///
/// The fused call writes its results at the GEMM, earlier than the instructions it replaces:
/// every instruction in between must neither touch that storage nor write what the call
/// reads, and none may start a pipeline section. Only fp32 and bf16 modules (cuBLASLt's
/// epilogues).
fn gemm_epilogues(program: &Program, kernels: &[Option<DeviceKernel>], readers: &Readers, dtype: DType) -> HashMap<usize, (Gemm, Epilogue)> {
    use shardc_ir::kernel::EpilogueStage;
    use shardc_runtime::program::Alias;
    let mut found = HashMap::new();
    if !matches!(dtype, DType::F32 | DType::Bf16) {
        return found;
    }
    let section_starts: HashSet<usize> = program.pipeline.iter().flat_map(|p| &p.chunks).flat_map(|c| c.sections.iter().map(|&(start, _)| start)).collect();
    let stage = |i: usize| lookup(&program.instrs[i].op).and_then(|op| op.gemm_epilogue());
    let buffers = &program.buffers;
    // The first instruction after `after` (within the window, no section between) that reads `v`.
    let next_reader = |v: BufferId, after: usize, limit: usize| -> Option<usize> {
        ((after + 1)..program.instrs.len().min(limit + 1)).take_while(|k| !section_starts.contains(k)).find(|&k| program.instrs[k].inputs.contains(&v))
    };
    let disjoint = |x: BufferId, y: BufferId| x != y && program.alias(x, y) == Alias::None;
    for (i, kernel) in kernels.iter().enumerate() {
        let Some(DeviceKernel::Gemm(g)) = kernel else { continue };
        let instr = &program.instrs[i];
        let (a, b, c) = (instr.inputs[g.a], instr.inputs[g.b], instr.outputs[g.c]);
        let product_len = buffers[c].len();
        if [a, b, c].iter().any(|&x| buffers[x].dtype != dtype) || g.ldc != g.n || (g.batch > 1 && g.stride_c != g.m * g.n) || product_len != g.batch * g.m * g.n {
            continue;
        }
        let limit = i + EPILOGUE_WINDOW;
        let Some(first) = next_reader(c, i, limit) else { continue };
        let first_instr = &program.instrs[first];
        let (mut members, mut bias, mut aux, mut activation, out);
        members = vec![first];
        bias = None;
        aux = None;
        activation = EpilogueActivation::None;
        match stage(first) {
            Some(EpilogueStage::GeluGrad) => {
                // dx = dy * gelu'(x) with dy the product, read by nothing else.
                if first_instr.inputs.len() != 2 || first_instr.inputs[1] != c || first_instr.inputs[0] == c || readers.reads[c] != 1 || readers.outside(c) {
                    continue;
                }
                aux = Some(first_instr.inputs[0]);
                activation = EpilogueActivation::GeluGrad;
                out = first_instr.outputs[0];
                if buffers[out].dtype != dtype {
                    continue;
                }
            }
            Some(EpilogueStage::Bias | EpilogueStage::Gelu) => {
                // The value after the bias (the product itself without one) and how many of its
                // reads are still to come.
                let (value, mut reads_left, at) = if stage(first) == Some(EpilogueStage::Bias) {
                    let rhs = first_instr.inputs.get(1).copied();
                    let o1 = first_instr.outputs[0];
                    let Some(rhs) = rhs.filter(|&r| first_instr.inputs[0] == c && r != c && buffers[r].shape == [g.n] && buffers[r].dtype == dtype) else { continue };
                    if buffers[o1].len() != product_len || buffers[o1].dtype != dtype {
                        continue;
                    }
                    if o1 != c && (readers.reads[c] != 1 || readers.outside(c)) {
                        continue;
                    }
                    bias = Some(rhs);
                    let left = if o1 == c { readers.reads[c] - 1 } else { readers.reads[o1] };
                    (o1, left, first)
                } else {
                    members.clear();
                    (c, readers.reads[c], i)
                };
                let gelu = next_reader(value, at, limit).filter(|&q| stage(q) == Some(EpilogueStage::Gelu) && program.instrs[q].inputs == [value]);
                match gelu {
                    Some(q) => {
                        members.push(q);
                        reads_left -= 1;
                        activation = EpilogueActivation::Gelu;
                        out = program.instrs[q].outputs[0];
                        if buffers[out].dtype != dtype {
                            continue;
                        }
                        // The backward reads the pre-activation: the epilogue stores it as well.
                        if reads_left > 0 || readers.outside(value) {
                            aux = Some(value);
                        }
                    }
                    None if bias.is_some() => out = value,
                    None => continue,
                }
            }
            None => continue,
        }
        let last = *members.iter().max().unwrap_or(&i);
        let mut reads = vec![a, b];
        reads.extend(bias);
        let mut writes = vec![out];
        match activation {
            EpilogueActivation::GeluGrad => reads.extend(aux),
            _ => writes.extend(aux),
        }
        if aux.is_some_and(|x| buffers[x].dtype != dtype || buffers[x].len() != product_len) || buffers[out].len() != product_len {
            continue;
        }
        let writes_apart = writes.iter().all(|&w| reads.iter().all(|&r| disjoint(w, r))) && writes.len() == writes.iter().collect::<HashSet<_>>().len() && writes.iter().all(|&w| writes.iter().all(|&v| v == w || disjoint(v, w)));
        // A wait in between may end an asynchronous collective whose input (not the wait's
        // operand) the memory plan frees there: the call's results could land on bytes the
        // communication stream still reads.
        let between_apart = (i + 1..last).filter(|k| !members.contains(k)).all(|k| {
            let between = &program.instrs[k];
            between.op != "xf.wait"
                && between.inputs.iter().chain(&between.outputs).all(|&x| writes.iter().all(|&w| disjoint(x, w))) && between.outputs.iter().all(|&y| reads.iter().all(|&r| disjoint(y, r)))
        });
        if !writes_apart || !between_apart {
            continue;
        }
        found.insert(i, (Gemm { a, b, c: out, ..g.clone() }, Epilogue { bias, activation, aux, members }));
    }
    found
}

/// Most kernel groups in one multi-tensor launch (each brings a handful of pointer
/// parameters; CUDA passes at most 4 KiB of them on older drivers).
const MAX_MULTI_TENSOR: usize = 16;

/// Runs of consecutive kernel groups that each update a parameter (`xf.adamw`, `xf.sgd`) and
/// that one multi-tensor launch computes, keyed by their first group's first instruction,
/// as the groups' first instructions: at most [`MAX_MULTI_TENSOR`] each, within one pipeline
/// section, and independent (no member writes storage another reads or writes, so their
/// threads may run in any order). The updates of a step follow one another once clipping or
/// gradient buckets hold them to the step's end, so a bucket's updates become one launch.
fn multi_tensor_batches(program: &Program, groups: &HashMap<usize, Vec<usize>>) -> HashMap<usize, Vec<usize>> {
    use shardc_runtime::program::Alias;
    let section_starts: HashSet<usize> = program.pipeline.iter().flat_map(|p| &p.chunks).flat_map(|c| c.sections.iter().flat_map(|&(start, end)| [start, end])).collect();
    let updates = |group: &[usize]| group.iter().any(|&i| matches!(program.instrs[i].op.as_str(), "xf.adamw" | "xf.sgd"));
    let mut firsts: Vec<usize> = groups.keys().copied().filter(|f| updates(&groups[f])).collect();
    firsts.sort_unstable();
    let buffers_of = |group: &[usize]| -> (Vec<BufferId>, Vec<BufferId>) {
        let ins = group.iter().flat_map(|&i| program.instrs[i].inputs.iter().copied()).collect();
        let outs = group.iter().flat_map(|&i| program.instrs[i].outputs.iter().copied()).collect();
        (ins, outs)
    };
    let apart = |a: &[BufferId], b: &[BufferId]| a.iter().all(|&x| b.iter().all(|&y| x != y && program.alias(x, y) == Alias::None));
    runs(firsts, |current, first| {
        let previous = &groups[current.last().unwrap_or(&first)];
        let (ins, outs) = buffers_of(&groups[&first]);
        previous.last().copied() == Some(first - 1)
            && !section_starts.contains(&first)
            && current.len() < MAX_MULTI_TENSOR
            && current.iter().all(|m| {
                let (m_ins, m_outs) = buffers_of(&groups[m]);
                apart(&outs, &m_ins) && apart(&outs, &m_outs) && apart(&m_outs, &ins)
            })
    })
}

/// Runs of `candidates`, in order, each growing while `joins(run, next)` holds, keyed by
/// their first: those of two or more.
fn runs(candidates: impl IntoIterator<Item = usize>, mut joins: impl FnMut(&[usize], usize) -> bool) -> HashMap<usize, Vec<usize>> {
    let mut batches: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut current: Vec<usize> = Vec::new();
    for next in candidates {
        if !current.is_empty() && !joins(&current, next) {
            if current.len() >= 2 {
                batches.insert(current[0], std::mem::take(&mut current));
            }
            current.clear();
        }
        current.push(next);
    }
    if current.len() >= 2 {
        batches.insert(current[0], current);
    }
    batches
}

/// Most gradients in one multi-tensor norm (two pointers each in the kernels' parameters).
const MAX_NORM_MEMBERS: usize = 64;

/// Runs of `xf.sum_squares` (each gradient's share of the global norm that clipping takes)
/// that two launches compute for all of them, keyed by the last: at most
/// [`MAX_NORM_MEMBERS`], within one pipeline section, of one kernel instance type. A step's
/// shares follow one another (the optimizer emits them together, each after the cast that
/// makes its fp32 gradient under mixed precision), so the norm is two launches where it was
/// two per parameter. The launch is the last member's: every member's gradient is made by
/// then. Each member reads a gradient that stays alive past the run and writes a fresh scalar
/// read only after it, and nothing between two members touches either (counting what a GEMM
/// between writes for the epilogue members it computes), so computing them all at the last is
/// the same as one after another. A run ends at a wait for communication (`xf.wait`, a
/// pipeline's step bucket): the shares before it run while the rest is still on the wire, as
/// they did one by one.
fn norm_batches(program: &Program, kernels: &[Option<DeviceKernel>], module: DType, epilogues: &HashMap<usize, (Gemm, Epilogue)>) -> HashMap<usize, Vec<usize>> {
    let section_starts: HashSet<usize> = program.pipeline.iter().flat_map(|p| &p.chunks).flat_map(|c| c.sections.iter().flat_map(|&(start, end)| [start, end])).collect();
    let is_share = |i: usize| program.instrs[i].op == "xf.sum_squares" && matches!(&kernels[i], Some(DeviceKernel::Launches(l)) if l.len() == 2);
    // Where each buffer is last read (arguments and results: never dead).
    let mut last_read = vec![0usize; program.buffers.len()];
    for (i, instr) in program.instrs.iter().enumerate() {
        for &b in &instr.inputs {
            last_read[b] = i;
        }
    }
    for binding in program.args.iter().chain(&program.results) {
        last_read[binding.buffer] = usize::MAX;
    }
    let batches = runs((0..program.instrs.len()).filter(|&i| is_share(i)), |current, i| {
        let last = *current.last().expect("runs joins to a nonempty run");
        let mine: Vec<BufferId> = current.iter().flat_map(|&m| program.instrs[m].inputs.iter().chain(&program.instrs[m].outputs)).copied().collect();
        let outputs: Vec<BufferId> = current.iter().flat_map(|&m| program.instrs[m].outputs.iter()).copied().collect();
        let apart = |a: &[BufferId], b: &[BufferId]| a.iter().all(|&x| b.iter().all(|&y| x != y && program.alias(x, y) == shardc_runtime::program::Alias::None));
        // What instruction j's device call writes: its outputs, and those of the epilogue
        // members a GEMM there computes.
        let writes = |j: usize| -> Vec<BufferId> {
            let members = epilogues.get(&j).map_or(&[][..], |(_, e)| e.members.as_slice());
            program.instrs[j].outputs.iter().chain(members.iter().flat_map(|&m| &program.instrs[m].outputs)).copied().collect()
        };
        // Nothing between reads a member's scalar or writes (or shares storage with) a
        // member's buffers.
        let untouched = (last + 1..i).all(|j| apart(&writes(j), &mine) && apart(&program.instrs[j].inputs, &outputs));
        // Nothing between waits for communication.
        let waits = (last + 1..i).any(|j| program.instrs[j].op == "xf.wait" || program.instrs[j].attrs.contains_key("xf.step_bucket"));
        // Every member's gradient is still alive at the launch.
        let alive = current.iter().all(|&m| last_read[program.instrs[m].inputs[0]] >= i);
        untouched && alive && !waits && !(last + 1..=i).any(|j| section_starts.contains(&j)) && current.len() < MAX_NORM_MEMBERS && instance_dtype(program, i, module).ok() == instance_dtype(program, current[0], module).ok()
    });
    batches.into_values().map(|members| (*members.last().expect("a run has members"), members)).collect()
}

/// A multi-tensor norm (see [`norm_batches`]): one launch in which each member's blocks (as
/// many as its own launch would have) sum their shares of its gradient into its range of the
/// workspace, then one in which block `k` adds member `k`'s partials in order: the same sums
/// as each member's own two launches. Returns the source its kernels call, their CUDA C, the
/// launches and the workspace's length (in accumulators).
fn fuse_norms(program: &Program, members: &[usize], kernels: &[Option<DeviceKernel>]) -> Result<(&'static str, String, Vec<DeviceCall>, usize), String> {
    let first = members[0];
    let (mut parts, mut totals, mut xs, mut ys) = (String::new(), String::new(), Vec::new(), Vec::new());
    let (mut part_args, mut total_args) = (vec![KernelArg::Workspace], vec![KernelArg::Workspace]);
    let mut offset = 0usize;
    let mut source = "";
    for (k, &i) in members.iter().enumerate() {
        let Some(DeviceKernel::Launches(launches)) = &kernels[i] else { return Err("a gradient norm share without its launches".into()) };
        source = launches[0].source;
        let blocks = launches[0].grid[0] as usize;
        let instr = &program.instrs[i];
        let n = program.buffers[instr.inputs[0]].len();
        let _ = writeln!(parts, "  {}if (b < {}) sum_squares_part(partial + {offset}, x{k}, {n}LL, b - {offset}, {blocks});", if k == 0 { "" } else { "else " }, offset + blocks);
        let _ = writeln!(totals, "    case {k}: sum_squares_total(y{k}, partial + {offset}, {blocks}); break;");
        xs.push(format!("const T* x{k}"));
        ys.push(format!("T* y{k}"));
        part_args.push(KernelArg::Buffer(instr.inputs[0]));
        total_args.push(KernelArg::Buffer(instr.outputs[0]));
        offset += blocks;
    }
    let (part, total) = (format!("sum_squares_multi_{first}"), format!("sum_squares_multi_total_{first}"));
    let locs: Vec<&str> = members.iter().map(|&i| program.instrs[i].loc.as_str()).collect();
    let text = format!(
        "// multi-tensor norm: {} gradients ({})\nextern \"C\" __global__ void {part}(acc_t* partial, {}) {{\n  i64 b = blockIdx.x;\n{parts}}}\nextern \"C\" __global__ void {total}(const acc_t* partial, {}) {{\n  switch (blockIdx.x) {{\n{totals}  }}\n}}\n",
        members.len(),
        locs.join(", "),
        xs.join(", "),
        ys.join(", ")
    );
    let block = shardc_ir::kernel::ROW_BLOCK;
    let launches = vec![
        DeviceCall::Launch { kernel: part, grid: [offset as u32, 1, 1], block, shared_bytes: 0, args: part_args },
        DeviceCall::Launch { kernel: total, grid: [members.len() as u32, 1, 1], block, shared_bytes: 0, args: total_args },
    ];
    Ok((source, text, launches, offset))
}

/// A fused element-wise kernel: its name, CUDA C, arguments and element count.
/// Who reads each buffer, counted once per program rather than once per kernel group (a walk
/// of every instruction per group is quadratic in the depth of the model).
struct Readers {
    /// Per buffer: how many operands of instructions are it.
    reads: Vec<usize>,
    /// Per buffer: whether the caller sees it (an argument or result) or a pipeline keeps or
    /// sums it across sections.
    seen_outside: Vec<bool>,
}

impl Readers {
    fn of(program: &Program) -> Self {
        let mut reads = vec![0; program.buffers.len()];
        for instr in &program.instrs {
            for &b in &instr.inputs {
                reads[b] += 1;
            }
        }
        let mut seen_outside = vec![false; program.buffers.len()];
        let mut outside: Vec<BufferId> = program.args.iter().chain(&program.results).map(|b| b.buffer).collect();
        if let Some(pipeline) = &program.pipeline {
            for chunk in &pipeline.chunks {
                outside.extend(chunk.keep_forward.iter().chain(&chunk.keep_backward).chain(&chunk.sum_backward).chain(&chunk.sum_weight).copied());
            }
        }
        for b in outside {
            seen_outside[b] = true;
        }
        Readers { reads, seen_outside }
    }

    fn outside(&self, b: BufferId) -> bool {
        self.seen_outside[b]
    }
}

fn fuse(program: &Program, group: &[usize], kernels: &[Option<DeviceKernel>], readers: &Readers, module: DType) -> Result<(String, String, Vec<KernelArg>, usize), String> {
    let mut params: Vec<BufferId> = Vec::new();
    let body = fuse_body(program, group, kernels, readers, module, &mut params, "i")?;
    let n = program.buffers[program.instrs[group[0]].outputs[0]].len();
    let ops: Vec<&str> = group.iter().map(|&i| program.instrs[i].op.as_str()).collect();
    let kernel = format!("fused_{}", group[0]);
    let text = format!("// {}\nextern \"C\" __global__ void {kernel}(i64 n, {}) {{\n  GRID_STRIDE(i, n) {{\n{body}  }}\n}}\n", ops.join(" -> "), signature(program, group, &params, module).join(", "));
    let mut args = vec![KernelArg::Int(n as i64)];
    args.extend(params.iter().map(|&b| KernelArg::Buffer(b)));
    Ok((kernel, text, args, n))
}

/// Several kernel groups of optimizer updates (each an update and what fuses with it, such as
/// the cast of a new master weight to bf16) in one launch, as a multi-tensor apply: the
/// launch's index space is the members' elements one after the other, and each thread runs
/// the member its index falls in. Members are independent (see [`multi_tensor_batches`]), so
/// no order among their threads matters.
fn fuse_multi(program: &Program, members: &[Vec<usize>], kernels: &[Option<DeviceKernel>], readers: &Readers, module: DType) -> Result<(String, String, Vec<KernelArg>, usize), String> {
    let mut params: Vec<BufferId> = Vec::new();
    let mut body = String::new();
    let mut offset = 0usize;
    for (k, group) in members.iter().enumerate() {
        let n = program.buffers[program.instrs[group[0]].outputs[0]].len();
        let member = fuse_body(program, group, kernels, readers, module, &mut params, "e")?;
        let test = if k + 1 == members.len() { String::new() } else { format!("if (i < {}) ", offset + n) };
        let _ = writeln!(body, "    {}{test}{{\n    i64 e = i - {offset};\n{member}    }}", if k == 0 { "" } else { "else " });
        offset += n;
    }
    let all: Vec<usize> = members.iter().flatten().copied().collect();
    let kernel = format!("multi_tensor_{}", all[0]);
    let text = format!(
        "// multi-tensor: {} members ({})\nextern \"C\" __global__ void {kernel}(i64 n, {}) {{\n  GRID_STRIDE(i, n) {{\n{body}  }}\n}}\n",
        members.len(),
        members.iter().map(|g| program.instrs[g[0]].loc.as_str()).collect::<Vec<_>>().join(", "),
        signature(program, &all, &params, module).join(", ")
    );
    let mut args = vec![KernelArg::Int(offset as i64)];
    args.extend(params.iter().map(|&b| KernelArg::Buffer(b)));
    Ok((kernel, text, args, offset))
}

/// The pointer parameters of a fused kernel over `params`: written buffers mutable.
fn signature(program: &Program, group: &[usize], params: &[BufferId], module: DType) -> Vec<String> {
    let fp32 = |b: BufferId| module == DType::Bf16 && program.buffers[b].dtype == DType::F32;
    let written: HashSet<BufferId> = group.iter().flat_map(|&i| program.instrs[i].outputs.iter().copied()).collect();
    params
        .iter()
        .enumerate()
        .map(|(p, &b)| {
            let base = if program.buffers[b].dtype == DType::I32 {
                "int"
            } else if fp32(b) {
                "float"
            } else {
                "T"
            };
            if written.contains(&b) { format!("{base}* p{p}") } else { format!("const {base}* p{p}") }
        })
        .collect()
}

/// The statements of one kernel group for element `index` (a variable of the kernel), with
/// its buffers added to `params` (the kernel's pointer parameters, `p0`, `p1`, ...).
fn fuse_body(program: &Program, group: &[usize], kernels: &[Option<DeviceKernel>], readers: &Readers, module: DType, params: &mut Vec<BufferId>, index_var: &str) -> Result<String, String> {
    // fp32 buffers of a bf16 module (mixed precision) are `float`: loaded and stored as is.
    let fp32 = |b: BufferId| module == DType::Bf16 && program.buffers[b].dtype == DType::F32;
    let first = group[0];
    let n = program.buffers[program.instrs[first].outputs[0]].len();
    // Buffers something outside the run reads (or the caller sees) must be stored.
    let mut reads_in_group: HashMap<BufferId, usize> = HashMap::new();
    for &i in group {
        for &b in &program.instrs[i].inputs {
            *reads_in_group.entry(b).or_insert(0) += 1;
        }
    }
    let read_outside = |b: BufferId| readers.outside(b) || readers.reads[b] > reads_in_group.get(&b).copied().unwrap_or(0);

    // Pointer parameters, one per buffer, in first-use order.
    let param_of = |b: BufferId, params: &mut Vec<BufferId>| match params.iter().position(|&p| p == b) {
        Some(p) => p,
        None => {
            params.push(b);
            params.len() - 1
        }
    };
    let mut register: HashMap<BufferId, String> = HashMap::new();
    let mut body = String::new();
    let mut stores: Vec<(BufferId, String)> = Vec::new();
    let mut next = 0;
    for &i in group {
        let instr = &program.instrs[i];
        let Some(DeviceKernel::Elementwise { body: template }) = &kernels[i] else {
            return Err(format!("instruction {i} is not element-wise"));
        };
        let mut text = template.to_string();
        for (k, &b) in instr.inputs.iter().enumerate() {
            let value = match register.get(&b) {
                Some(r) => r.clone(),
                None => {
                    let p = param_of(b, params);
                    let name = format!("v{next}");
                    next += 1;
                    let index = if program.buffers[b].len() == n { index_var.to_string() } else { format!("{index_var} % {}", program.buffers[b].len().max(1)) };
                    let _ = writeln!(body, "    acc_t {name} = load(p{p}[{index}]);");
                    register.insert(b, name.clone());
                    name
                }
            };
            text = text.replace(&format!("{{in{k}}}"), &value);
        }
        let mut outs = Vec::new();
        for (k, &b) in instr.outputs.iter().enumerate() {
            let name = format!("v{next}");
            next += 1;
            text = text.replace(&format!("{{out{k}}}"), &name);
            outs.push((b, name));
        }
        for (name, value) in &instr.attrs {
            let literal = match value {
                Attr::Float(v) => format!("((acc_t){v:e})"),
                Attr::Int(v) => format!("((acc_t){v})"),
                _ => continue,
            };
            text = text.replace(&format!("{{{name}}}"), &literal);
        }
        if let Some(open) = text.find('{').filter(|&at| text[at..].find('}').is_some_and(|end| text[at + 1..at + end].chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))) {
            return Err(format!("`{}`: its kernel names `{}` which the instruction does not provide", instr.op, &text[open..open + text[open..].find('}').unwrap_or(0) + 1]));
        }
        let declared: Vec<&str> = outs.iter().map(|(_, name)| name.as_str()).collect();
        let _ = writeln!(body, "    acc_t {};", declared.join(", "));
        let _ = writeln!(body, "    {{ {text} }}  // {} {}", instr.op, instr.loc);
        for (b, name) in outs {
            register.insert(b, name.clone());
            stores.retain(|(s, _)| *s != b);
            if read_outside(b) {
                stores.push((b, name));
            }
        }
    }
    for (b, name) in &stores {
        let p = param_of(*b, params);
        if fp32(*b) {
            let _ = writeln!(body, "    p{p}[{index_var}] = {name};");
        } else {
            let _ = writeln!(body, "    p{p}[{index_var}] = store({name});");
        }
    }
    Ok(body)
}

/// Attaches the device plan to `program` (for `--target cuda` and the CUDA backend).
pub fn with_device_plan(mut program: Program) -> Result<Program, CodegenError> {
    program.device = Some(device_plan(&program)?);
    Ok(program)
}
