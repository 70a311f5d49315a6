//! Codegen: a verified function of the IR becomes a rank program ([`shardc_runtime::Program`]).
//!
//! Every tensor value gets a buffer; every op an instruction, in program order. The memory
//! plan comes from liveness: a temporary lives from the op that defines it to its last use
//! (to the end if the function returns it). On a device all temporaries live in one arena at
//! offsets planned greedy by size (largest first, each at the lowest offset free for its
//! lifetime), which reaches the live-set lower bound on the shipped models; the CPU backend
//! keeps typed storage slots, shared by temporaries whose lifetimes do not overlap (best fit,
//! growing the largest free slot when none fits). Arguments keep their own slots for the
//! whole run. Ops that declare in-place results (optimizer
//! updates) write into their operand's buffer when that operand is dead afterwards, so a
//! training step updates parameters and optimizer state where they are.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod arena;
pub mod device;
pub mod estimate;

use std::collections::BTreeMap;

use shardc_ir::ops::lookup;
use shardc_ir::{AttrValue, Func, Value};
use shardc_runtime::schedule::{simulate, Costs, Kind, Schedule, Work};
use shardc_runtime::DType;
use shardc_runtime::program::{Attr, Binding, Buffer, BucketRegion, FORMAT_VERSION, Instr, Layout, MemoryPlan, PipelinePlan, Program};

/// Why a function cannot become a rank program.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodegenError {
    /// The function uses something codegen does not lower yet.
    #[error("@{func}: {loc}: cannot generate code: {reason}")]
    Unsupported {
        /// Function name.
        func: String,
        /// Location of the op.
        loc: String,
        /// What is unsupported.
        reason: String,
    },
}

/// Converts an attribute to the program's form; the grid symbol (`@mesh`) carries nothing a
/// rank program needs.
fn convert_attr(value: &AttrValue) -> Option<Attr> {
    Some(match value {
        AttrValue::Int(v) => Attr::Int(*v),
        AttrValue::Float(v) => Attr::Float(*v),
        AttrValue::Bool(v) => Attr::Bool(*v),
        AttrValue::Str(s) => Attr::Str(s.clone()),
        AttrValue::Symbol(_) => return None,
        AttrValue::Index(d) => Attr::Int(*d as i64),
        AttrValue::Axes(axes) => Attr::Ints(axes.iter().map(|&a| i64::from(a)).collect()),
        AttrValue::Ints(values) => Attr::Ints(values.clone()),
        AttrValue::Reduction(r) => Attr::Str(r.label().to_string()),
        AttrValue::Type(t) => Attr::Str(t.mlir().to_string()),
        AttrValue::Unit => Attr::Bool(true),
    })
}

/// Lowers `func` to a rank program for a single device.
pub fn lower_func(func: &Func) -> Result<Program, CodegenError> {
    lower_func_on(func, &[])
}

/// Lowers `func` to a rank program for a grid of `grid` extents (empty: one device). A
/// partitioned function gives the same program to every rank; ranks differ only in their
/// coordinates, which collectives and vocab-split lookups read at run time.
pub fn lower_func_on(func: &Func, grid: &[i64]) -> Result<Program, CodegenError> {
    lower_func_keeping(func, grid, |_, _| Ok(Vec::new()))
}

/// [`lower_func_on`], with the buffers `kept(instructions, is_argument)` names held outside
/// the arena (a pipeline rank's kept values: the runtime gives each micro-batch in flight
/// storage of its own, so the arena holds what one work item needs).
fn lower_func_keeping(func: &Func, grid: &[i64], kept: impl FnOnce(&[Instr], &[bool]) -> Result<Vec<usize>, CodegenError>) -> Result<Program, CodegenError> {
    let unsupported = |loc: &str, reason: String| CodegenError::Unsupported { func: func.name.clone(), loc: loc.to_string(), reason };
    let n_values = func.types.len();
    let end = func.ops.len();

    // Last op index that reads each value; returned values live to the end.
    let mut last_use = vec![None::<usize>; n_values];
    for (i, op) in func.ops.iter().enumerate() {
        for v in &op.operands {
            last_use[v.0 as usize] = Some(i);
        }
    }
    for v in &func.returns {
        last_use[v.0 as usize] = Some(end);
    }
    // An asynchronous gather, scatter or shift reads its input on the communication stream
    // until its wait (an all-reduce bucket's member is copied into its region at once).
    let waits: std::collections::HashMap<Value, usize> = func.ops.iter().enumerate().filter(|(_, op)| op.name == "xf.wait").map(|(i, op)| (op.operands[0], i)).collect();
    for op in &func.ops {
        if matches!(op.attrs.get("xf.async"), Some(AttrValue::Bool(true))) && matches!(op.name.as_str(), "shard.reduce_scatter" | "shard.all_gather" | "shard.shift") {
            if let (Some(&wait), Some(input)) = (op.results.first().and_then(|r| waits.get(r)), op.operands.first()) {
                let last = &mut last_use[input.0 as usize];
                *last = Some(last.map_or(wait, |l| l.max(wait)));
            }
        }
    }
    // A pipeline rank of several chunks runs their step sections merged in the training
    // step's order (`xf.order`), not one chunk after another as they are laid out: what a
    // step section reads or makes lives to the end, so no chunk's step shares storage with
    // another's.
    let is_step = |op: &shardc_ir::Op| matches!(op.attrs.get("xf.phase"), Some(AttrValue::Str(p)) if p == "step");
    let steps: Vec<usize> = (0..end).filter(|&i| is_step(&func.ops[i])).collect();
    if steps.windows(2).any(|w| w[1] != w[0] + 1) {
        // A wait's result is its operand's buffer (in place): the result living to the end
        // keeps it, and the wait stays its operand's last reader.
        let waited: std::collections::HashSet<Value> = steps.iter().filter(|&&i| func.ops[i].name == "xf.wait").map(|&i| func.ops[i].operands[0]).collect();
        for &i in &steps {
            let operands = if func.ops[i].name == "xf.wait" { &[][..] } else { &func.ops[i].operands[..] };
            for v in operands.iter().chain(&func.ops[i].results).filter(|v| !waited.contains(v)) {
                last_use[v.0 as usize] = Some(end);
            }
        }
    }

    // Buffers: arguments first, then op results; an in-place result reuses its operand's.
    let mut buffer_of: Vec<Option<usize>> = vec![None; n_values];
    let mut buffers: Vec<Buffer> = Vec::new();
    let new_buffer = |v: Value, name: &str, buffers: &mut Vec<Buffer>| -> Result<usize, CodegenError> {
        let t = func.tensor(v).ok_or_else(|| unsupported(name, format!("value {v} is not a tensor")))?;
        let shape = t.shape.iter().map(|&d| usize::try_from(d).map_err(|_| unsupported(name, format!("dynamic or negative dimension in {t}")))).collect::<Result<Vec<_>, _>>()?;
        buffers.push(Buffer { shape, dtype: t.dtype, slot: usize::MAX, name: name.to_string() });
        Ok(buffers.len() - 1)
    };
    for arg in &func.args {
        buffer_of[arg.value.0 as usize] = Some(new_buffer(arg.value, &arg.name, &mut buffers)?);
    }
    // An argument may be overwritten in place only by its own new value: a result returned
    // under the argument's name (an optimizer update). Anything else would clobber an input
    // the caller still owns.
    let arg_name: std::collections::HashMap<Value, &str> = func.args.iter().map(|a| (a.value, a.name.as_str())).collect();
    let returned_as: std::collections::HashMap<Value, &str> = func.returns.iter().zip(&func.result_names).map(|(v, n)| (*v, n.as_str())).collect();
    let mut instrs = Vec::with_capacity(func.ops.len());
    for (i, op) in func.ops.iter().enumerate() {
        let in_place = match lookup(&op.name) {
            Some(def) => def.in_place(),
            None if op.name.starts_with("shard.") || op.name == "tensor.empty" => &[],
            None => return Err(unsupported(&op.loc, format!("`{}` has no kernel", op.name))),
        };
        let mut outputs = Vec::with_capacity(op.results.len());
        for (r, result) in op.results.iter().enumerate() {
            let alias = in_place.iter().find(|(res, _)| *res == r).map(|(_, operand)| op.operands[*operand]).filter(|operand| {
                // Only when this op is the operand's last reader and reads it once; an
                // argument only when this result is its new value.
                let dead_after = last_use[operand.0 as usize] == Some(i) && op.operands.iter().filter(|o| *o == operand).count() == 1;
                let owned = match arg_name.get(operand) {
                    Some(name) => returned_as.get(result) == Some(name),
                    None => true,
                };
                dead_after && owned
            });
            let id = match alias {
                Some(operand) => buffer_of[operand.0 as usize].expect("operands are defined before use"),
                None => new_buffer(*result, &op.loc, &mut buffers)?,
            };
            buffer_of[result.0 as usize] = Some(id);
            outputs.push(id);
        }
        let mut attrs = BTreeMap::new();
        for (name, value) in op.attrs.iter() {
            if let Some(value) = convert_attr(value) {
                attrs.insert(name.clone(), value);
            }
        }
        let inputs = op.operands.iter().map(|v| buffer_of[v.0 as usize].expect("verified IR defines before use")).collect();
        instrs.push(Instr { op: op.name.clone(), attrs, inputs, outputs, loc: op.loc.clone(), origin: op.origin });
    }

    let mut is_arg = vec![false; buffers.len()];
    for a in &func.args {
        is_arg[buffer_of[a.value.0 as usize].expect("arguments have buffers")] = true;
    }
    let mut outside = is_arg.clone();
    for b in kept(&instrs, &is_arg)? {
        outside[b] = true;
    }
    let memory = plan_memory(&mut buffers, &buffer_of, &last_use, &instrs, &is_arg, &outside);
    let args = func
        .args
        .iter()
        .map(|a| Binding {
            name: a.name.clone(),
            buffer: buffer_of[a.value.0 as usize].unwrap(),
            role: Some(a.role),
            layout: a.layout.as_ref().map(|l| Layout {
                global_shape: l.global_shape.iter().map(|&d| d as usize).collect(),
                split: l.sharding.split.iter().map(|axes| axes.iter().map(|&a| a as usize).collect()).collect(),
            }),
            unpadded: a.unpadded.as_ref().map(|u| u.iter().map(|&d| d as usize).collect()),
            block: a.block,
        })
        .collect();
    let results = func
        .returns
        .iter()
        .enumerate()
        .map(|(i, v)| Binding { name: func.result_names.get(i).cloned().unwrap_or_else(|| format!("result{i}")), buffer: buffer_of[v.0 as usize].unwrap(), role: None, layout: None, unpadded: None, block: Default::default() })
        .collect();
    let mesh = grid.iter().map(|&e| e as usize).collect();
    Ok(Program { format_version: FORMAT_VERSION, name: func.name.clone(), mesh, buffers, args, results, instrs, memory, pipeline: None, device: None })
}

/// Assigns every buffer a slot: arguments their own, temporaries by liveness.
fn plan_memory(buffers: &mut [Buffer], buffer_of: &[Option<usize>], last_use: &[Option<usize>], instrs: &[Instr], is_arg: &[bool], outside: &[bool]) -> MemoryPlan {
    let end = instrs.len();
    // A buffer's last use is the latest last use of any value living in it.
    let mut buffer_last = vec![0usize; buffers.len()];
    for (v, b) in buffer_of.iter().enumerate() {
        if let Some(b) = b {
            buffer_last[*b] = buffer_last[*b].max(last_use[v].unwrap_or(0));
        }
    }
    let mut slots: Vec<(usize, DType)> = Vec::new();
    let mut argument_bytes = 0;
    for (b, buffer) in buffers.iter_mut().enumerate() {
        if is_arg[b] {
            buffer.slot = slots.len();
            slots.push((buffer.len(), buffer.dtype));
            argument_bytes = buffer.len().saturating_mul(buffer.dtype.bytes()).saturating_add(argument_bytes);
        }
    }
    let mut free: Vec<usize> = Vec::new();
    // Buffers to release after each instruction.
    let mut release: Vec<Vec<usize>> = vec![Vec::new(); end + 1];
    let mut without_reuse = 0;
    for (i, instr) in instrs.iter().enumerate() {
        for &b in &instr.outputs {
            if is_arg[b] || buffers[b].slot != usize::MAX {
                continue;
            }
            let (len, dt) = (buffers[b].len(), buffers[b].dtype);
            without_reuse = len.saturating_mul(dt.bytes()).saturating_add(without_reuse);
            // Best fit among free slots of this type; else grow the largest; else a new slot.
            let fitting = free.iter().enumerate().filter(|(_, s)| slots[**s].1 == dt && slots[**s].0 >= len).min_by_key(|(_, s)| slots[**s].0);
            let chosen = match fitting {
                Some((at, _)) => Some(free.swap_remove(at)),
                None => free.iter().enumerate().filter(|(_, s)| slots[**s].1 == dt).max_by_key(|(_, s)| slots[**s].0).map(|(at, _)| at).map(|at| free.swap_remove(at)),
            };
            let slot = match chosen {
                Some(s) => {
                    slots[s].0 = slots[s].0.max(len);
                    s
                }
                None => {
                    slots.push((len, dt));
                    slots.len() - 1
                }
            };
            buffers[b].slot = slot;
            release[buffer_last[b].min(end).max(i)].push(b);
        }
        for b in std::mem::take(&mut release[i]) {
            free.push(buffers[b].slot);
        }
    }
    // The arena holds the temporaries but those kept outside it (the CPU backend's typed
    // slots above hold every one).
    let groups = bucket_groups(buffers, outside, instrs, &buffer_last, end);
    let live_bound_bytes = live_bound(buffers, outside, instrs, &buffer_last, end, &groups);
    let (offsets, arena_bytes, buckets) = plan_arena(buffers, outside, instrs, &buffer_last, end, &groups);
    // The plan's peak is the arena's: the CPU backend keeps typed slots (reused by size),
    // a device allocates the arena.
    MemoryPlan { slots, argument_bytes, temporary_bytes: arena_bytes, temporary_bytes_without_reuse: without_reuse, live_bound_bytes, arena_bytes, offsets, buckets }
}

/// The members of one data-parallel gradient bucket of one element type, which the arena lays
/// back to back: (instruction, output buffer) in program order, alive from the first write
/// of any member to the last reader of any.
struct BucketGroup {
    bucket: i64,
    dtype: DType,
    members: Vec<(usize, usize)>,
    first: usize,
    last: usize,
}

/// The bucket groups of a program: the outputs of its asynchronous bucketed all-reduces (or
/// of a pipeline rank's step buckets), by (bucket, element type), in the order of their
/// first members.
fn bucket_groups(buffers: &[Buffer], is_arg: &[bool], instrs: &[Instr], buffer_last: &[usize], end: usize) -> Vec<BucketGroup> {
    let mut by_key: std::collections::HashMap<(i64, DType), Vec<(usize, usize)>> = std::collections::HashMap::new();
    let mut in_bucket = vec![false; buffers.len()];
    let mut step_bucket: std::collections::HashSet<i64> = std::collections::HashSet::new();
    // A pipeline rank's regions are its step buckets only: an asynchronous all-reduce inside a
    // section (`overlap-collectives`, one behind the compute after it) reduces in its own
    // output.
    let sectioned = instrs.iter().any(|i| i.attrs.contains_key("xf.phase"));
    for (i, instr) in instrs.iter().enumerate() {
        if let (true, Ok(true), Ok(bucket), Some(&b)) = (instr.op == "shard.all_reduce", instr.bool("xf.async"), instr.int("xf.bucket"), instr.outputs.first())
            && !sectioned
            && !is_arg[b]
            && !in_bucket[b]
        {
            in_bucket[b] = true;
            by_key.entry((bucket, buffers[b].dtype)).or_default().push((i, b));
        }
        // A step bucket of a pipeline stage (`bucket-step-gradients`): the micro-batches'
        // gradients are summed into its region (or, reduce-scattered, into whole gradients
        // whose shards land in it) and it is sent before the step section runs.
        if let (true, Ok(bucket), Some(&b)) = (matches!(instr.op.as_str(), "shard.all_reduce" | "shard.reduce_scatter"), instr.int("xf.step_bucket"), instr.outputs.first())
            && !is_arg[b]
            && !in_bucket[b]
        {
            in_bucket[b] = true;
            step_bucket.insert(bucket);
            by_key.entry((bucket, buffers[b].dtype)).or_default().push((i, b));
        }
    }
    // A buffer's first writer may come before its bucket's all-reduce (none does today: a
    // collective's output is a buffer of its own), so a region's life starts at the first
    // instruction writing any member.
    let mut first_write = vec![usize::MAX; buffers.len()];
    for (i, instr) in instrs.iter().enumerate() {
        for &b in &instr.outputs {
            first_write[b] = first_write[b].min(i);
        }
    }
    let mut groups: Vec<BucketGroup> = by_key
        .into_iter()
        .map(|((bucket, dtype), members)| {
            let first = members.iter().map(|&(_, b)| first_write[b]).min().unwrap_or(0);
            let last = members.iter().map(|&(i, b)| buffer_last[b].min(end).max(i)).max().unwrap_or(0);
            // A step bucket's region is written from the first micro-batch's backward on,
            // while any section may run: it is alive over the whole program.
            let (first, last) = if step_bucket.contains(&bucket) { (0, end) } else { (first, last) };
            BucketGroup { bucket, dtype, members, first, last }
        })
        .collect();
    groups.sort_by_key(|g| (g.bucket, g.members[0].0));
    groups
}

/// Alignment of a temporary in the arena: 256 bytes for large ones (what cuBLAS likes), 16
/// for the small ones (vector loads), so per-token scalars do not each take 256 bytes.
fn arena_align(bytes: usize) -> usize {
    if bytes >= 4096 { 256 } else { 16 }
}

/// Offsets of every temporary in one arena, greedy by size (TFLite's GreedyBySize, XLA's heap
/// simulator's idea): the largest buffers are placed first, each at the lowest aligned offset
/// where it overlaps no placed buffer whose lifetime meets its own (from the instruction that
/// first writes it to its last reader, both included, so an instruction's operands and results
/// never share memory unless they are one buffer). Returns the offsets by buffer and the
/// arena's size. [`arena::place`] finds each offset without listing the buffers alive with
/// it, which would be quadratic in the depth of the model.
///
/// The outputs of a data-parallel gradient bucket's members (of one element type) are
/// placed as one item, back to back, alive from the first member's birth to the last one's
/// death: the bucket's [`BucketRegion`], which a backend reduces with one collective.
fn plan_arena(buffers: &[Buffer], is_arg: &[bool], instrs: &[Instr], buffer_last: &[usize], end: usize, groups: &[BucketGroup]) -> (Vec<Option<usize>>, usize, Vec<BucketRegion>) {
    let mut seen = vec![false; buffers.len()];
    let mut in_bucket = vec![false; buffers.len()];
    for g in groups {
        for &(_, b) in &g.members {
            in_bucket[b] = true;
        }
    }
    // (buffers with their offsets within the item, bytes, first, last)
    let mut items: Vec<(Vec<(usize, usize)>, usize, usize, usize)> = Vec::new();
    for (i, instr) in instrs.iter().enumerate() {
        for &b in &instr.outputs {
            if is_arg[b] || in_bucket[b] || std::mem::replace(&mut seen[b], true) {
                continue;
            }
            items.push((vec![(b, 0)], padded_bytes(&buffers[b]), i, buffer_last[b].min(end).max(i)));
        }
    }
    let mut regions = Vec::new();
    for g in groups {
        let mut within = Vec::with_capacity(g.members.len());
        let mut bytes = 0usize;
        for &(_, b) in &g.members {
            within.push((b, bytes));
            bytes = bytes.saturating_add(padded_bytes(&buffers[b]));
        }
        regions.push((items.len(), g.bucket, g.dtype, bytes, g.members.iter().map(|m| m.0).collect::<Vec<_>>()));
        items.push((within, bytes, g.first, g.last));
    }
    // Greedy by size, except that bucket regions (alive to the step's end) go first, at the
    // bottom of the arena: placed among the shorter-lived temporaries they fragment it.
    let mut order: Vec<usize> = (0..items.len()).collect();
    let is_region = |k: usize| k >= items.len() - regions.len();
    order.sort_by(|&x, &y| is_region(y).cmp(&is_region(x)).then(items[y].1.cmp(&items[x].1)).then(items[x].2.cmp(&items[y].2)));
    let to_place: Vec<arena::Item> = order.iter().map(|&k| arena::Item { bytes: items[k].1, first: items[k].2, last: items[k].3, align: arena_align(items[k].1) }).collect();
    let (placed, arena_bytes) = arena::place(&to_place);
    let mut offsets = vec![None; buffers.len()];
    let mut item_offset = vec![0; items.len()];
    for (&k, offset) in order.iter().zip(placed) {
        item_offset[k] = offset;
        for &(b, within) in &items[k].0 {
            offsets[b] = Some(offset + within);
        }
    }
    let buckets = regions.into_iter().map(|(k, bucket, dtype, bytes, members)| BucketRegion { bucket, dtype, offset: item_offset[k], bytes, members }).collect();
    (offsets, arena_bytes, buckets)
}

/// A temporary's bytes in the arena: rounded up to 16 (vector loads), at least 16.
fn padded_bytes(buffer: &Buffer) -> usize {
    buffer.len().saturating_mul(buffer.dtype.bytes()).div_ceil(16).saturating_mul(16).max(16)
}

/// The lower bound of any plan of temporaries: the most bytes of temporaries alive at one
/// instruction (each from the instruction that makes it to its last reader, as the plan
/// keeps them).
fn live_bound(buffers: &[Buffer], is_arg: &[bool], instrs: &[Instr], buffer_last: &[usize], end: usize, groups: &[BucketGroup]) -> usize {
    let mut delta = vec![0i128; end + 2];
    let mut seen = vec![false; buffers.len()];
    // A bucket's members are alive from the bucket region's first write: the region is one
    // range of memory, so any plan holds all of it from then on.
    let mut born = vec![usize::MAX; buffers.len()];
    let mut dies = vec![0; buffers.len()];
    for g in groups {
        for &(_, b) in &g.members {
            born[b] = g.first;
            dies[b] = g.last;
        }
    }
    for (i, instr) in instrs.iter().enumerate() {
        for &b in &instr.outputs {
            if is_arg[b] || std::mem::replace(&mut seen[b], true) {
                continue;
            }
            let bytes = buffers[b].len().saturating_mul(buffers[b].dtype.bytes()) as i128;
            delta[born[b].min(i)] += bytes;
            delta[buffer_last[b].min(end).max(i).max(dies[b]) + 1] -= bytes;
        }
    }
    let (mut live, mut peak) = (0i128, 0i128);
    for d in delta {
        live += d;
        peak = peak.max(live);
    }
    usize::try_from(peak).unwrap_or(usize::MAX)
}

/// Lowers the pipeline stages of `module` (`@stage0 ..`, from the `split-stages` pass) to one
/// rank program per pipeline rank (the `pp` coordinate, grid axis 2). Rank `r` holds stages
/// `r, r + pp, r + 2 pp, ...` as its model chunks; their bodies are laid one after the other,
/// arguments shared by name (the inputs), so one memory plan covers them. The program's
/// [`PipelinePlan`] says where each chunk's forward, backward, weight and step sections are,
/// and which buffers a runtime must keep per micro-batch (read by a later section of the same
/// micro-batch) or sum over micro-batches (gradients the step section reads), and the
/// rank's work items of `schedule`, which is checked first: its ranks and chunks must match
/// the stages, it must split weight gradients exactly when the stages have weight sections,
/// and simulating it must finish (no item waits forever).
pub fn lower_pipeline(module: &shardc_ir::Module, grid: &[i64], schedule: &Schedule) -> Result<Vec<Program>, CodegenError> {
    let unsupported = |func: &str, reason: String| CodegenError::Unsupported { func: func.to_string(), loc: "module".into(), reason };
    let stages: Vec<&Func> = (0..).map_while(|k| module.func(&format!("stage{k}"))).collect();
    let pp = grid.get(2).copied().unwrap_or(1).max(1) as usize;
    if stages.is_empty() || stages.len() % pp != 0 {
        return Err(unsupported("stage0", format!("{} pipeline stages cannot be dealt to pp={pp} ranks", stages.len())));
    }
    let chunks = stages.len() / pp;
    if schedule.stages != pp || schedule.chunks != chunks {
        return Err(unsupported(
            "stage0",
            format!("the {} schedule is for {} ranks x {} chunks; the stages need {pp} x {chunks}", schedule.kind.label(), schedule.stages, schedule.chunks),
        ));
    }
    let weight_sections = stages.iter().any(|f| f.ops.iter().any(|op| matches!(op.attrs.get("xf.phase"), Some(AttrValue::Str(p)) if p == "weight")));
    let weight_items = schedule.ranks.iter().flatten().any(|i| i.work == Work::W);
    if weight_sections != weight_items {
        return Err(unsupported(
            "stage0",
            format!("the {} schedule {} weight-gradient items but the stages {} weight sections", schedule.kind.label(), if weight_items { "has" } else { "has no" }, if weight_sections { "have" } else { "have no" }),
        ));
    }
    simulate(schedule, Costs { f: 1.0, b: 1.0, w: 1.0 }).map_err(|e| unsupported("stage0", format!("invalid {} schedule: {e}", schedule.kind.label())))?;
    (0..pp)
        .map(|rank| {
            let mine: Vec<&Func> = (0..chunks).map(|c| stages[c * pp + rank]).collect();
            let (combined, chunk_of) = concat_stages(&mine, rank);
            // Kept values live outside the arena, in storage of each micro-batch's own, unless
            // every backward comes right after its forward (the last stage of 1F1B, one rank
            // accumulating): then they stay in the arena, which frees them as the backward
            // reads them for last.
            let ahead = shardc_runtime::schedule::forward_ahead(&schedule.ranks[rank]).is_some();
            let mut sections = Vec::new();
            let mut program = lower_func_keeping(&combined, grid, |instrs, is_arg| {
                sections = chunk_sections(instrs, is_arg, &combined, &chunk_of, rank, pp, chunks).map_err(|e| unsupported(&combined.name, e))?;
                Ok(if ahead { sections.iter().flat_map(|c| c.keep_forward.iter().chain(&c.keep_backward).copied()).collect() } else { Vec::new() })
            })?;
            let mut plan = pipeline_plan(&program, sections, rank, pp).map_err(|e| unsupported(&combined.name, e))?;
            plan.kind = schedule.kind;
            plan.microbatches = schedule.microbatches;
            plan.items = schedule.ranks[rank].clone();
            program.pipeline = Some(plan);
            Ok(program)
        })
        .collect()
}

/// One function holding `stages` back to back (arguments merged by name), and the chunk of
/// each op.
fn concat_stages(stages: &[&Func], rank: usize) -> (Func, Vec<usize>) {
    let mut func = Func {
        name: format!("pipeline_rank{rank}"),
        args: Vec::new(),
        ops: Vec::new(),
        returns: Vec::new(),
        result_names: Vec::new(),
        types: Vec::new(),
        shardings: Default::default(),
        constraints: Default::default(),
    };
    let mut by_name: std::collections::HashMap<String, Value> = std::collections::HashMap::new();
    let mut maps: Vec<std::collections::HashMap<Value, Value>> = vec![Default::default(); stages.len()];
    for (c, stage) in stages.iter().enumerate() {
        for arg in &stage.args {
            let v = *by_name.entry(arg.name.clone()).or_insert_with(|| {
                func.types.push(stage.ty(arg.value).clone());
                let v = Value(func.types.len() as u32 - 1);
                func.args.push(shardc_ir::graph::FuncArg { value: v, ..arg.clone() });
                v
            });
            maps[c].insert(arg.value, v);
        }
    }
    let mut chunk_of = Vec::new();
    for (c, stage) in stages.iter().enumerate() {
        for op in &stage.ops {
            let mut op2 = op.clone();
            op2.operands = op.operands.iter().map(|v| maps[c][v]).collect();
            op2.results = op
                .results
                .iter()
                .map(|r| {
                    func.types.push(stage.ty(*r).clone());
                    let v = Value(func.types.len() as u32 - 1);
                    maps[c].insert(*r, v);
                    v
                })
                .collect();
            func.ops.push(op2);
            chunk_of.push(c);
        }
        func.returns.extend(stage.returns.iter().map(|v| maps[c][v]));
        func.result_names.extend(stage.result_names.iter().cloned());
    }
    (func, chunk_of)
}

/// The pipeline plan of a lowered, concatenated pipeline rank from its chunks' sections
/// ([`chunk_sections`]): each chunk's step collectives that may start early.
fn pipeline_plan(program: &Program, mut plans: Vec<shardc_runtime::program::ChunkPlan>, rank: usize, pp: usize) -> Result<PipelinePlan, String> {
    for plan in &mut plans {
        plan.early_syncs = early_syncs(program, plan);
    }
    // `bucket-step-gradients` buckets only what may start early.
    for region in &program.memory.buckets {
        if let Some(&m) = region.members.iter().find(|m| !plans.iter().any(|c| c.early_syncs.contains(m))) {
            return Err(format!("{}: step bucket {} holds a collective that cannot start before its step section", program.instrs[m].loc, region.bucket));
        }
    }
    Ok(PipelinePlan { rank, ranks: pp, chunks: plans, kind: Kind::OneFOneB, microbatches: 1, items: Vec::new() })
}

/// Each chunk's sections of a concatenated pipeline rank's instructions, and the buffers a
/// section reads from an earlier one (kept values and gradient sums).
#[allow(clippy::too_many_arguments)]
fn chunk_sections(instrs: &[Instr], is_arg: &[bool], func: &Func, chunk_of: &[usize], rank: usize, pp: usize, chunks: usize) -> Result<Vec<shardc_runtime::program::ChunkPlan>, String> {
    use shardc_runtime::program::{ChunkPlan, Phase};
    if instrs.len() != func.ops.len() {
        return Err("codegen emitted instructions that are not one per op".into());
    }
    let phase_of = |i: usize| -> Result<Phase, String> {
        match func.ops[i].attrs.get("xf.phase") {
            Some(AttrValue::Str(s)) => Phase::parse(s).ok_or_else(|| format!("{}: unknown phase `{s}`", func.ops[i].loc)),
            _ => Err(format!("{}: `{}` has no xf.phase", func.ops[i].loc, func.ops[i].name)),
        }
    };
    let mut plans: Vec<ChunkPlan> = (0..chunks).map(|c| ChunkPlan { stage: c * pp + rank, ..ChunkPlan::default() }).collect();
    // Phase that defines each buffer.
    let mut defined: std::collections::HashMap<usize, (usize, Phase)> = std::collections::HashMap::new();
    // (chunk, which list, buffer) already in a keep or sum list.
    let mut listed: std::collections::HashSet<(usize, u8, usize)> = std::collections::HashSet::new();
    for (i, instr) in instrs.iter().enumerate() {
        let (c, section) = (chunk_of[i], phase_of(i)?);
        let range = &mut plans[c].sections[section as usize];
        if range.1 == 0 {
            *range = (i, i + 1);
        } else if range.1 == i {
            range.1 = i + 1;
        } else {
            return Err(format!("{}: the {} section of chunk {c} is not contiguous", instr.loc, section.label()));
        }
        for &b in &instr.inputs {
            let Some(&(dc, made)) = defined.get(&b) else {
                continue;
            };
            if dc != c || made == section {
                continue;
            }
            let plan = &mut plans[c];
            let (which, list) = match (made, section) {
                (Phase::Forward, Phase::Backward | Phase::Weight) => (0, &mut plan.keep_forward),
                (Phase::Backward, Phase::Weight) => (1, &mut plan.keep_backward),
                (Phase::Backward, Phase::Step) => (2, &mut plan.sum_backward),
                (Phase::Weight, Phase::Step) => (3, &mut plan.sum_weight),
                _ => {
                    return Err(format!("{}: reads a {} value in the {} section", instr.loc, made.label(), section.label()));
                }
            };
            // Each buffer once per list, in first-read order (a set beside the lists, as a
            // search of a list per read is quadratic in the depth of the model).
            if listed.insert((c, which, b)) {
                list.push(b);
            }
        }
        for &b in &instr.outputs {
            if !is_arg[b] {
                defined.insert(b, (c, section));
            }
        }
    }
    Ok(plans)
}

/// The step-section all-reduces of a chunk that may start before the step section runs, by
/// the rule [`Program::early_sync_error`] states (a tied embedding's two gradient parts are
/// added in place in the step section, so its sync must wait).
fn early_syncs(program: &Program, chunk: &shardc_runtime::program::ChunkPlan) -> Vec<usize> {
    chunk.range(shardc_runtime::program::Phase::Step).filter(|&index| program.early_sync_error(chunk, index).is_none()).collect()
}
