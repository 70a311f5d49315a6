//! Collectives on the CPU backend: each `shard` op, point-to-point transfers, and gradient
//! buckets on the wire.

use super::*;

/// The collectives the executor runs itself (everything else is a kernel).
pub(super) const COLLECTIVES: &[&str] = &["shard.all_reduce", "shard.all_gather", "shard.all_slice", "shard.reduce_scatter", "shard.all_to_all", "shard.broadcast", "shard.send", "shard.recv", "shard.shift", "tensor.empty"];

/// A gradient bucket on the wire: its ticket and where its members' values go back.
#[derive(Debug)]
pub(super) struct InFlight {
    pub(super) ticket: u64,
    pub(super) dtype: DType,
    /// (slot, elements) of each member, in order.
    pub(super) members: Vec<(usize, usize)>,
}

impl InFlight {
    /// Waits for the bucket and keeps its reduced values, for each member to take its own
    /// where it runs ([`Landed::put`]).
    pub(super) fn receive(self, comm: &mut AsyncComm) -> Result<Landed, String> {
        let data = match self.dtype {
            DType::F64 => Storage::F64(comm.wait::<Vec<f64>>(self.ticket).map_err(|e| e.to_string())?),
            DType::Bf16 => Storage::Bf16(comm.wait::<Vec<half::bf16>>(self.ticket).map_err(|e| e.to_string())?),
            _ => Storage::F32(comm.wait::<Vec<f32>>(self.ticket).map_err(|e| e.to_string())?),
        };
        let mut at = 0;
        let members = self
            .members
            .iter()
            .map(|&(slot, len)| {
                at += len;
                (slot, at - len, len)
            })
            .collect();
        Ok(Landed { data, members })
    }

    /// Waits for the bucket and writes the reduced values back into the members' slots.
    pub(super) fn land(self, comm: &mut AsyncComm, slots: &mut [Storage]) -> Result<(), String> {
        let landed = self.receive(comm)?;
        (0..landed.members.len()).try_for_each(|k| landed.put(k, slots))
    }
}

/// A step bucket's reduced values, received: each member's (slot, offset, elements).
#[derive(Debug)]
pub(super) struct Landed {
    data: Storage,
    members: Vec<(usize, usize, usize)>,
}

impl Drop for Landed {
    /// The joined values go back to the pool the collectives draw their buffers from.
    fn drop(&mut self) {
        match std::mem::take(&mut self.data) {
            Storage::F64(v) => crate::collectives::pool::recycle(v),
            Storage::F32(v) => crate::collectives::pool::recycle(v),
            Storage::Bf16(v) => crate::collectives::pool::recycle(v),
            _ => {}
        }
    }
}

impl Landed {
    /// Writes member `k`'s values into its slot. A member's output may share its slot with
    /// values the instructions before it still use (the memory plan gives it the slot from
    /// that member on), so each member lands where it runs, not with the bucket's first.
    pub(super) fn put(&self, k: usize, slots: &mut [Storage]) -> Result<(), String> {
        let &(slot, at, len) = self.members.get(k).ok_or("a bucket member past the bucket's end")?;
        match (&self.data, &mut slots[slot]) {
            (Storage::F64(v), Storage::F64(out)) => out[..len].copy_from_slice(&v[at..at + len]),
            (Storage::F32(v), Storage::F32(out)) => out[..len].copy_from_slice(&v[at..at + len]),
            (Storage::Bf16(v), Storage::Bf16(out)) => out[..len].copy_from_slice(&v[at..at + len]),
            _ => return Err("bucket member of another type".into()),
        }
        Ok(())
    }
}

/// Puts a bucket on the wire, run by the communication thread while this one goes on: an
/// all-reduce bucket as the staged outputs of its members, concatenated, in one all-reduce
/// over their group; a reduce-scatter or all-gather bucket as its members' collectives one
/// after another (along dimension 0, so none needs rearranging), their outputs joined.
pub(super) fn send_bucket(members: &[usize], program: &Program, slots: &mut [Storage], comm: Option<&mut AsyncComm>, mesh: &MeshShape, rank: usize, algorithm: Algorithm) -> Result<InFlight, String> {
    let comm = comm.ok_or("a collective needs a communicator")?;
    let first = &program.instrs[members[0]];
    let axes: Vec<usize> = first.ints("grid_axes")?.iter().map(|&a| a as usize).collect();
    let group = mesh.group(rank, &axes);
    if first.op != "shard.all_reduce" {
        return send_group(members, program, slots, comm, group);
    }
    let buffers: Vec<&Buffer> = members.iter().map(|&i| &program.buffers[program.instrs[i].outputs[0]]).collect();
    let dtype = buffers[0].dtype;
    let ticket = submit_joined_all_reduce(&buffers, slots, comm, group, algorithm)?;
    Ok(InFlight { ticket, dtype, members: buffers.iter().map(|b| (b.slot, b.len())).collect() })
}

/// A step bucket started early (see [`CpuExecutor::start_early`]): one all-reduce over the
/// members' inputs (the gradients summed over the micro-batches), concatenated, landing in
/// their outputs; or, a bucket of ZeRO's reduce-scatters, its members one after another.
pub(super) fn send_bucket_of_inputs(members: &[usize], program: &Program, slots: &[Storage], comm: &mut AsyncComm, mesh: &MeshShape, rank: usize, algorithm: Algorithm) -> Result<InFlight, String> {
    let first = &program.instrs[members[0]];
    let axes: Vec<usize> = first.ints("grid_axes")?.iter().map(|&a| a as usize).collect();
    let group = mesh.group(rank, &axes);
    if first.op == "shard.reduce_scatter" {
        return send_group(members, program, slots, comm, group);
    }
    let inputs: Vec<&Buffer> = members.iter().map(|&i| &program.buffers[program.instrs[i].inputs[0]]).collect();
    let outputs: Vec<&Buffer> = members.iter().map(|&i| &program.buffers[program.instrs[i].outputs[0]]).collect();
    if inputs.iter().zip(&outputs).any(|(i, o)| i.dtype != o.dtype || i.len() != o.len()) || inputs.iter().any(|b| b.dtype != inputs[0].dtype) {
        return Err(format!("step bucket at {}: its members' inputs and outputs differ in type or size", first.loc));
    }
    let dtype = inputs[0].dtype;
    let ticket = submit_joined_all_reduce(&inputs, slots, comm, group, algorithm)?;
    Ok(InFlight { ticket, dtype, members: outputs.iter().map(|b| (b.slot, b.len())).collect() })
}

/// Submits one sum all-reduce over `buffers`' values, concatenated (all of one float type),
/// to the communication thread; returns its ticket.
fn submit_joined_all_reduce(buffers: &[&Buffer], slots: &[Storage], comm: &mut AsyncComm, group: Vec<usize>, algorithm: Algorithm) -> Result<u64, String> {
    fn submit<T: Element + crate::collectives::Elem>(buffers: &[&Buffer], slots: &[Storage], comm: &mut AsyncComm, group: Vec<usize>, algorithm: Algorithm) -> Result<u64, String> {
        let mut data = join_buffers::<T>(buffers, slots)?;
        Ok(comm.submit(move |c: &mut Communicator| c.all_reduce(&group, &mut data, ReduceOp::Sum, algorithm).map(|()| data)))
    }
    match buffers[0].dtype {
        DType::F64 => submit::<f64>(buffers, slots, comm, group, algorithm),
        DType::Bf16 => submit::<half::bf16>(buffers, slots, comm, group, algorithm),
        DType::F32 => submit::<f32>(buffers, slots, comm, group, algorithm),
        other => Err(format!("a bucket of {other:?} values: only floats are summed")),
    }
}

/// `buffers`' values, concatenated.
fn join_buffers<T: Element + crate::collectives::Elem>(buffers: &[&Buffer], slots: &[Storage]) -> Result<Vec<T>, String> {
    let mut joined: Vec<T> = crate::collectives::pool::buffer(buffers.iter().map(|b| b.len()).sum());
    let mut at = 0;
    for b in buffers {
        joined[at..at + b.len()].copy_from_slice(&T::slice(&slots[b.slot]).ok_or("bucket member of another type")?[..b.len()]);
        at += b.len();
    }
    Ok(joined)
}

/// A reduce-scatter or all-gather bucket (see [`send_bucket`]): every member's input is
/// copied now (staged, for a scatter along an inner dimension; the memory plan keeps it
/// alive until the wait anyway) and the members run on the communication thread in program
/// order, as every rank of the group issues them.
pub(super) fn send_group(members: &[usize], program: &Program, slots: &[Storage], comm: &mut AsyncComm, group: Vec<usize>) -> Result<InFlight, String> {
    if program.instrs[members[0]].op == "shard.shift" {
        return send_shifts(members, program, slots, comm, group);
    }
    let gather = program.instrs[members[0]].op == "shard.all_gather";
    let pairs: Vec<(&Buffer, &Buffer)> = members.iter().map(|&i| (&program.buffers[program.instrs[i].inputs[0]], &program.buffers[program.instrs[i].outputs[0]])).collect();
    // A scatter along an inner dimension sends its blocks staged as [n][outer][chunk], as
    // the synchronous one does; a gather is along its first dimension of more than one
    // element (validated), so its blocks need no rearranging.
    let axes: Vec<usize> = members.iter().map(|&i| program.instrs[i].int(if gather { "gather_axis" } else { "scatter_axis" }).map(|a| a as usize)).collect::<Result<_, _>>()?;
    let n = group.len();
    pub(super) fn submit<T: Element + crate::collectives::Elem>(pairs: &[(&Buffer, &Buffer)], axes: &[usize], n: usize, slots: &[Storage], comm: &mut AsyncComm, group: Vec<usize>, gather: bool) -> Result<u64, String> {
        let stage = |(i, o): &(&Buffer, &Buffer), axis: usize| -> Result<Vec<T>, String> {
            let input = &T::slice(&slots[i.slot]).ok_or("bucket member of another type")?[..i.len()];
            let outer: usize = i.shape[..axis.min(i.shape.len())].iter().product();
            if gather || outer == 1 {
                return Ok(crate::collectives::pool::filled(input));
            }
            let inner: usize = i.shape[axis + 1..].iter().product();
            let block = o.shape[axis] * inner;
            let mut staged = crate::collectives::pool::buffer(input.len());
            for r in 0..n {
                for b in 0..outer {
                    let src = (b * i.shape[axis] + r * o.shape[axis]) * inner;
                    let dst = (r * outer + b) * block;
                    staged[dst..dst + block].copy_from_slice(&input[src..src + block]);
                }
            }
            Ok(staged)
        };
        let inputs: Vec<Vec<T>> = pairs.iter().zip(axes).map(|(pair, &axis)| stage(pair, axis)).collect::<Result<_, _>>()?;
        let out_lens: Vec<usize> = pairs.iter().map(|(_, o)| o.len()).collect();
        Ok(comm.submit(move |c: &mut Communicator| {
            let mut joined: Vec<T> = crate::collectives::pool::buffer(out_lens.iter().sum());
            let mut at = 0;
            for (input, len) in inputs.into_iter().zip(out_lens) {
                let out = &mut joined[at..at + len];
                if gather { c.all_gather(&group, &input, out)? } else { c.reduce_scatter(&group, &input, out, ReduceOp::Sum)? }
                crate::collectives::pool::recycle(input);
                at += len;
            }
            Ok(joined)
        }))
    }
    let dtype = pairs[0].1.dtype;
    let ticket = match dtype {
        DType::F64 => submit::<f64>(&pairs, &axes, n, slots, comm, group, gather)?,
        DType::Bf16 => submit::<half::bf16>(&pairs, &axes, n, slots, comm, group, gather)?,
        DType::F32 => submit::<f32>(&pairs, &axes, n, slots, comm, group, gather)?,
        other => return Err(format!("a bucket of {other:?} values: only floats are reduced or gathered asynchronously")),
    };
    Ok(InFlight { ticket, dtype, members: pairs.iter().map(|(_, o)| (o.slot, o.len())).collect() })
}

/// Runs a `shard` collective of this rank.
#[allow(clippy::too_many_arguments)]
pub(super) fn collective(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], comm: Option<&mut AsyncComm>, mesh: &MeshShape, rank: usize, algorithm: Algorithm, context: (u64, u64)) -> Result<(), String> {
    let dtype = ins.first().map_or_else(|| outs[0].buffer.dtype, In::dtype);
    match instr.op.as_str() {
        "tensor.empty" => match dtype {
            DType::F64 => Ok(outs[0].get::<f64>()?.fill(0.0)),
            DType::I32 => Ok(outs[0].get::<i32>()?.fill(0)),
            DType::Bf16 => Ok(outs[0].get::<half::bf16>()?.fill(half::bf16::ZERO)),
            _ => Ok(outs[0].get::<f32>()?.fill(0.0)),
        },
        "shard.shift" => match dtype {
            DType::F64 => shift::<f64>(instr, ins, outs, comm, mesh, rank, context),
            DType::I32 => shift::<i32>(instr, ins, outs, comm, mesh, rank, context),
            DType::Bf16 => shift::<half::bf16>(instr, ins, outs, comm, mesh, rank, context),
            _ => shift::<f32>(instr, ins, outs, comm, mesh, rank, context),
        },
        "shard.send" | "shard.recv" => match dtype {
            DType::F64 => point_to_point::<f64>(instr, ins, outs, comm, mesh, rank, context),
            DType::I32 => point_to_point::<i32>(instr, ins, outs, comm, mesh, rank, context),
            DType::Bf16 => point_to_point::<half::bf16>(instr, ins, outs, comm, mesh, rank, context),
            _ => point_to_point::<f32>(instr, ins, outs, comm, mesh, rank, context),
        },
        _ => match dtype {
            DType::F64 => collective_typed::<f64>(instr, ins, outs, comm, mesh, rank, algorithm),
            DType::I32 => collective_typed::<i32>(instr, ins, outs, comm, mesh, rank, algorithm),
            DType::Bf16 => collective_typed::<half::bf16>(instr, ins, outs, comm, mesh, rank, algorithm),
            _ => collective_typed::<f32>(instr, ins, outs, comm, mesh, rank, algorithm),
        },
    }
}

/// A pipeline send or receive between stage ranks along the `pp` axis. The message tag is
/// the transfer number with the (step, micro-batch) being run, so every send meets the one
/// receive that expects it, whatever order the schedule runs them in.
pub(super) fn point_to_point<T: Element + crate::collectives::Elem + Default>(
    instr: &Instr,
    ins: &[In<'_>],
    outs: &mut [Out<'_>],
    comm: Option<&mut AsyncComm>,
    mesh: &MeshShape,
    rank: usize,
    (step, microbatch): (u64, u64),
) -> Result<(), String> {
    let comm = comm.ok_or("a pipeline send or receive needs a communicator: run the program with one rank per mesh position")?;
    let transfer = instr.int("xf.transfer")? as u64;
    if transfer >= 1 << 20 || microbatch >= 1 << 16 || step >= 1 << 28 {
        return Err(format!("transfer {transfer}, micro-batch {microbatch} or step {step} is too large to tag"));
    }
    let tag = (step << 36) | (transfer << 16) | microbatch;
    let group = mesh.group(rank, &[PP_AXIS]);
    let (peer_attr, peer_name) = if instr.op == "shard.send" { ("destination", "destination") } else { ("source", "source") };
    let peer = instr.ints(peer_attr)?.first().copied().ok_or_else(|| format!("`{}` has no {peer_name}", instr.op))?;
    let peer = *group.get(peer as usize).ok_or_else(|| format!("{peer_name} {peer} is outside the pp axis of {} ranks", group.len()))?;
    if instr.op == "shard.send" {
        let data = crate::collectives::pool::filled(ins[0].get::<T>()?);
        comm.call(move |c| c.send_owned(peer, tag, data)).map_err(|e| e.to_string())
    } else {
        let out = outs[0].get::<T>()?;
        let len = out.len();
        let data: Vec<T> = comm.call(move |c| c.recv_owned(peer, tag, len)).map_err(|e| e.to_string())?;
        out.copy_from_slice(&data);
        crate::collectives::pool::recycle(data);
        Ok(())
    }
}

/// The ranks a `shard.shift` of `group` sends to and receives from at `position`.
fn shift_peers(instr: &Instr, group: &[usize], position: usize) -> Result<(usize, usize), String> {
    let n = group.len();
    let offset = instr.int("offset")?.rem_euclid(n as i64) as usize;
    Ok((group[(position + offset) % n], group[(position + n - offset) % n]))
}

/// An asynchronous bucket of shifts (ring attention's keys and values): every member's input
/// copied now, then on the communication thread each sent on round the ring and the one from
/// before received, in program order, their outputs joined for the wait.
fn send_shifts(members: &[usize], program: &Program, slots: &[Storage], comm: &mut AsyncComm, group: Vec<usize>) -> Result<InFlight, String> {
    let rank = comm.rank();
    let position = group.iter().position(|&r| r == rank).ok_or("rank outside its group")?;
    let mut plan = Vec::with_capacity(members.len());
    for &m in members {
        let instr = &program.instrs[m];
        let (to, from) = shift_peers(instr, &group, position)?;
        let buffer = instr.outputs[0] as u64;
        if buffer >= 1 << 24 {
            return Err(format!("buffer {buffer} is too large to tag a shift"));
        }
        // Asynchronous shifts run only in steps without pipeline sections: the buffer tags
        // them (each one is waited for before the next step issues it again).
        let tag = (1 << 63) | (1 << 62) | buffer;
        plan.push((to, from, tag, program.buffers[instr.outputs[0]].len()));
    }
    pub(super) fn submit<T: Element + crate::collectives::Elem>(members: &[usize], program: &Program, slots: &[Storage], comm: &mut AsyncComm, plan: Vec<(usize, usize, u64, usize)>) -> Result<u64, String> {
        let inputs: Vec<Vec<T>> = members
            .iter()
            .map(|&m| {
                let b = &program.buffers[program.instrs[m].inputs[0]];
                Ok(crate::collectives::pool::filled(&T::slice(&slots[b.slot]).ok_or("shift of another type")?[..b.len()]))
            })
            .collect::<Result<_, String>>()?;
        Ok(comm.submit(move |c: &mut Communicator| {
            let mut joined: Vec<T> = crate::collectives::pool::buffer(plan.iter().map(|p| p.3).sum());
            let mut at = 0;
            for (input, (to, from, tag, len)) in inputs.into_iter().zip(plan) {
                c.send_owned(to, tag, input)?;
                let received: Vec<T> = c.recv_owned(from, tag, len)?;
                joined[at..at + len].copy_from_slice(&received);
                crate::collectives::pool::recycle(received);
                at += len;
            }
            Ok(joined)
        }))
    }
    let dtype = program.buffers[program.instrs[members[0]].inputs[0]].dtype;
    let ticket = match dtype {
        DType::F64 => submit::<f64>(members, program, slots, comm, plan)?,
        DType::Bf16 => submit::<half::bf16>(members, program, slots, comm, plan)?,
        DType::F32 => submit::<f32>(members, program, slots, comm, plan)?,
        other => return Err(format!("a bucket of {other:?} shifts: only floats are shifted asynchronously")),
    };
    Ok(InFlight { ticket, dtype, members: members.iter().map(|&m| (program.buffers[program.instrs[m].outputs[0]].slot, program.buffers[program.instrs[m].outputs[0]].len())).collect() })
}

/// `shard.shift ... offset = k rotate`: every rank of the group sends its value `k` places
/// on around the ring and receives the value from `k` places before (ring attention passes
/// key and value blocks this way). The tag is the instruction's output buffer with the
/// (step, micro-batch) being run, so a rank that runs ahead never meets the wrong message.
pub(super) fn shift<T: Element + crate::collectives::Elem + Default>(
    instr: &Instr,
    ins: &[In<'_>],
    outs: &mut [Out<'_>],
    comm: Option<&mut AsyncComm>,
    mesh: &MeshShape,
    rank: usize,
    (step, microbatch): (u64, u64),
) -> Result<(), String> {
    if instr.bool("xf.async") == Ok(true) {
        // A member of a bucket: it goes out with the bucket (see `send_shifts`).
        return Ok(());
    }
    let axes: Vec<usize> = instr.ints("grid_axes")?.iter().map(|&a| a as usize).collect();
    let group = mesh.group(rank, &axes);
    let position = group.iter().position(|&r| r == rank).ok_or("rank outside its group")?;
    let (to, from) = shift_peers(instr, &group, position)?;
    let out = outs[0].get::<T>()?;
    if to == rank {
        out.copy_from_slice(ins[0].get::<T>()?);
        return Ok(());
    }
    let buffer = instr.outputs[0] as u64;
    if buffer >= 1 << 24 || microbatch >= 1 << 12 || step >= 1 << 26 {
        return Err(format!("buffer {buffer}, micro-batch {microbatch} or step {step} is too large to tag a shift"));
    }
    let tag = (1 << 63) | (step << 36) | (microbatch << 24) | buffer;
    let comm = comm.ok_or("a shift needs a communicator: run the program with one rank per mesh position")?;
    let data = crate::collectives::pool::filled(ins[0].get::<T>()?);
    let len = out.len();
    let received: Vec<T> = comm.call(move |c| c.send_owned(to, tag, data).and_then(|()| c.recv_owned(from, tag, len))).map_err(|e| e.to_string())?;
    out.copy_from_slice(&received);
    crate::collectives::pool::recycle(received);
    Ok(())
}

pub(super) fn collective_typed<T: Element + crate::collectives::Elem + Default>(
    instr: &Instr,
    ins: &[In<'_>],
    outs: &mut [Out<'_>],
    comm: Option<&mut AsyncComm>,
    mesh: &MeshShape,
    rank: usize,
    algorithm: Algorithm,
) -> Result<(), String> {
    let axes: Vec<usize> = instr.ints("grid_axes")?.iter().map(|&a| a as usize).collect();
    let group = mesh.group(rank, &axes);
    let position = group.iter().position(|&r| r == rank).ok_or("rank outside its group")?;
    if instr.bool("xf.async") == Ok(true) && matches!(instr.op.as_str(), "shard.reduce_scatter" | "shard.all_gather") {
        // A member of a bucket: it runs with the bucket (see `send_group`), its output
        // written when the bucket is waited for.
        return Ok(());
    }
    let n = group.len();
    let input = ins[0].get::<T>()?;
    let in_shape = ins[0].shape().to_vec();
    let out_shape = outs[0].shape().to_vec();
    let out = outs[0].get::<T>()?;
    // For gathers and slices along `axis`: outer rows, the axis, inner elements.
    let split = |axis: usize| {
        let outer: usize = in_shape[..axis].iter().product();
        let inner: usize = in_shape[axis + 1..].iter().product();
        (outer, inner)
    };
    match instr.op.as_str() {
        "shard.all_reduce" => {
            out.copy_from_slice(input);
            if instr.bool("xf.async").unwrap_or(false) {
                // Staged for its bucket; sent when the bucket is complete.
                return Ok(());
            }
            let comm = comm.ok_or("a collective needs a communicator: run the program with one rank per mesh position")?;
            let op = match instr.attrs.get("reduction") {
                Some(crate::program::Attr::Str(kind)) if kind == "max" => ReduceOp::Max,
                _ => ReduceOp::Sum,
            };
            let mut data = crate::collectives::pool::filled(out);
            let reduced = comm.call(move |c| c.all_reduce(&group, &mut data, op, algorithm).map(|()| data)).map_err(|e| e.to_string())?;
            out.copy_from_slice(&reduced);
            crate::collectives::pool::recycle(reduced);
            Ok(())
        }
        "shard.all_gather" => {
            let axis = instr.int("gather_axis")? as usize;
            let comm = comm.ok_or("a collective needs a communicator: run the program with one rank per mesh position")?;
            let local = crate::collectives::pool::filled(input);
            let gathered: Vec<T> = comm
                .call(move |c| {
                    let mut gathered = crate::collectives::pool::buffer(local.len() * n);
                    let result = c.all_gather(&group, &local, &mut gathered).map(|()| gathered);
                    crate::collectives::pool::recycle(local);
                    result
                })
                .map_err(|e| e.to_string())?;
            // gathered is [n][local]; interleave along `axis`.
            let (outer, inner) = split(axis);
            let block = in_shape[axis] * inner;
            for r in 0..n {
                for o in 0..outer {
                    let src = r * input.len() + o * block;
                    let dst = (o * n + r) * block;
                    out[dst..dst + block].copy_from_slice(&gathered[src..src + block]);
                }
            }
            crate::collectives::pool::recycle(gathered);
            Ok(())
        }
        "shard.reduce_scatter" => {
            let axis = instr.int("scatter_axis")? as usize;
            let comm = comm.ok_or("a collective needs a communicator: run the program with one rank per mesh position")?;
            // Stage the chunks along `axis` contiguously, [n][outer][chunk], then reduce-scatter.
            let (outer, inner) = split(axis);
            let block = out_shape[axis] * inner;
            let mut staged = crate::collectives::pool::buffer(input.len());
            for r in 0..n {
                for o in 0..outer {
                    let src = (o * in_shape[axis] + r * out_shape[axis]) * inner;
                    let dst = (r * outer + o) * block;
                    staged[dst..dst + block].copy_from_slice(&input[src..src + block]);
                }
            }
            let len = out.len();
            let part: Vec<T> = comm
                .call(move |c| {
                    let mut part = crate::collectives::pool::buffer(len);
                    let result = c.reduce_scatter(&group, &staged, &mut part, ReduceOp::Sum).map(|()| part);
                    crate::collectives::pool::recycle(staged);
                    result
                })
                .map_err(|e| e.to_string())?;
            out.copy_from_slice(&part);
            crate::collectives::pool::recycle(part);
            Ok(())
        }
        "shard.broadcast" => {
            // The root is an in-group multi-index; groups here are over the listed axes in
            // row-major order, so it is the position of that index.
            let root = instr.ints("root")?;
            let extents: Vec<usize> = axes.iter().map(|&a| mesh.0[a]).collect();
            let root = root.iter().zip(&extents).fold(0usize, |acc, (&r, &e)| acc * e + r as usize);
            let comm = comm.ok_or("a collective needs a communicator: run the program with one rank per mesh position")?;
            let mut data = crate::collectives::pool::filled(input);
            let data = comm.call(move |c| c.broadcast(&group, &mut data, root).map(|()| data)).map_err(|e| e.to_string())?;
            out.copy_from_slice(&data);
            crate::collectives::pool::recycle(data);
            Ok(())
        }
        "shard.all_to_all" => {
            let (split_axis, concat_axis) = (instr.int("split_axis")? as usize, instr.int("concat_axis")? as usize);
            let comm = comm.ok_or("a collective needs a communicator: run the program with one rank per mesh position")?;
            // Part k: this rank's block k along `split_axis`, for member k.
            let (outer, inner) = split(split_axis);
            let block = out_shape[split_axis] * inner;
            let parts: Vec<Vec<T>> = (0..n)
                .map(|k| {
                    let mut part = crate::collectives::pool::buffer(input.len() / n);
                    for o in 0..outer {
                        let src = (o * in_shape[split_axis] + k * out_shape[split_axis]) * inner;
                        part[o * block..(o + 1) * block].copy_from_slice(&input[src..src + block]);
                    }
                    part
                })
                .collect();
            let received = comm.call(move |c| c.all_to_all(&group, parts)).map_err(|e| e.to_string())?;
            // Member k's part goes to block k along `concat_axis` (each part has the output's
            // shape but that dimension, which is the input's).
            let outer: usize = out_shape[..concat_axis].iter().product();
            let block: usize = in_shape[concat_axis] * out_shape[concat_axis + 1..].iter().product::<usize>();
            for (k, part) in received.into_iter().enumerate() {
                for o in 0..outer {
                    let dst = (o * n + k) * block;
                    out[dst..dst + block].copy_from_slice(&part[o * block..(o + 1) * block]);
                }
                crate::collectives::pool::recycle(part);
            }
            Ok(())
        }
        "shard.all_slice" => {
            let axis = instr.int("slice_axis")? as usize;
            let (outer, inner) = split(axis);
            let block = out_shape[axis] * inner;
            for o in 0..outer {
                let src = (o * in_shape[axis] + position * out_shape[axis]) * inner;
                out[o * block..(o + 1) * block].copy_from_slice(&input[src..src + block]);
            }
            Ok(())
        }
        other => Err(format!("unknown collective `{other}`")),
    }
}
