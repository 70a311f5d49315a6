//! What a CPU run of rank programs holds in host memory, read from the programs alone: every
//! rank's storage slots (its memory plan) and its largest instruction's working memory, what
//! the pipeline runtime keeps between a micro-batch's forward and backward and sums over
//! micro-batches, and the run's state read back as f64 (each rank's shards, then the assembled global tensors), at the most of them
//! alive at once ([`CpuFootprint::peak`]). The CLI compares it
//! with the memory the host has before it allocates anything, so that a run that cannot fit is
//! refused with both numbers instead of being killed by the kernel half-way.

use crate::collectives::MeshShape;
use crate::program::{BufferId, Program, Role};

/// Host bytes of a CPU run, by what holds them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuFootprint {
    /// Ranks of the run (threads on this host).
    pub ranks: usize,
    /// Every rank's storage slots: parameters, optimizer state, inputs and temporaries as
    /// the memory plan lays them out.
    pub slots: u64,
    /// Working memory of every rank's largest instruction while it runs (the attention
    /// kernels' heads-first copies of their operands and results; f32 copies of the bf16
    /// slots an instruction reads and writes): each rank runs one instruction at a time, and
    /// its threads run at once.
    pub scratch: u64,
    /// Pipeline ranks' values kept per micro-batch in flight (the most the schedule has in
    /// flight at once) and gradients summed over micro-batches.
    pub pipeline: u64,
    /// The parameters and optimizer state every rank reads back as f64 when the run ends (or
    /// is checkpointed): its shards.
    pub state_shards: u64,
    /// The global tensors the state is assembled into.
    pub state_global: u64,
    /// Whether the run is a single device's (`Trainer`), which assembles the state while its
    /// slots are still allocated; rank threads have ended (and freed theirs) by then.
    pub single: bool,
}

impl CpuFootprint {
    /// The most the run holds at once: while the ranks run (slots, pipeline values, and the
    /// state as they read it back), or once they have ended (their state shards, copied once
    /// more as the runtime gathers them, and the assembled tensors); a single device
    /// assembles its state while its slots live.
    pub fn peak(&self) -> u64 {
        let running = self.slots.saturating_add(self.scratch).saturating_add(self.pipeline).saturating_add(self.state_shards);
        if self.single {
            return running.saturating_add(self.state_global);
        }
        running.max(self.state_shards.saturating_mul(2).saturating_add(self.state_global))
    }
}

/// The footprint of running `programs` on the CPU backend: one program every rank runs, or
/// one per pipeline rank (its `pp` coordinate), as the runtime runs them. The programs must
/// be valid ([`Program::validate`]).
pub fn cpu_footprint(programs: &[Program]) -> CpuFootprint {
    let Some(first) = programs.first() else { return CpuFootprint::default() };
    let mesh = MeshShape(if first.mesh.is_empty() { vec![1] } else { first.mesh.clone() });
    let ranks = mesh.ranks();
    let program_of = |rank: usize| match programs {
        [only] => Some(only),
        _ => programs.get(mesh.coords(rank).get(2).copied().unwrap_or(0)),
    };
    let single = programs.len() == 1 && first.mesh.is_empty() && first.pipeline.is_none();
    let mut out = CpuFootprint { ranks, single, ..CpuFootprint::default() };
    let mut global_state: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
    for rank in 0..ranks {
        let Some(program) = program_of(rank) else { continue };
        out.slots = out.slots.saturating_add(program.cpu_storage_bytes() as u64);
        let scratch = program.instrs.iter().map(|i| crate::cpu::scratch_bytes(program, i)).max().unwrap_or(0);
        out.scratch = out.scratch.saturating_add(scratch as u64);
        out.pipeline = out.pipeline.saturating_add(pipeline_bytes(program));
        for a in program.args.iter().filter(|a| a.role.is_some_and(Role::is_state)) {
            let local = program.buffers[a.buffer].len() as u64;
            out.state_shards = out.state_shards.saturating_add(local.saturating_mul(8));
            let global = a.layout.as_ref().map_or(local, |l| l.global_shape.iter().fold(1u64, |n, &d| n.saturating_mul(d as u64)));
            global_state.insert(&a.name, global.saturating_mul(8));
        }
    }
    out.state_global = global_state.values().fold(0, |sum, &b| sum.saturating_add(b));
    out
}

/// Bytes of buffers `ids` of `program`.
fn buffer_bytes(program: &Program, ids: &[BufferId]) -> u64 {
    ids.iter().map(|&b| program.buffers[b].len().saturating_mul(program.buffers[b].dtype.bytes()) as u64).fold(0, u64::saturating_add)
}

/// What the pipeline runtime holds for one pipeline rank besides its slots: each chunk's
/// kept forward values for every micro-batch whose forward ran and whose backward has not
/// (whose weight pass has not, where the schedule splits it off: it reads them too; none
/// when the backward comes right after the forward, whose values stay in place), and kept
/// backward values between a split backward and its weight pass, at the most its schedule
/// has at once, plus one copy of each chunk's gradient sums.
fn pipeline_bytes(program: &Program) -> u64 {
    let Some(plan) = &program.pipeline else { return 0 };
    let kept_forward: Vec<u64> = plan.chunks.iter().map(|c| buffer_bytes(program, &c.keep_forward)).collect();
    let kept_backward: Vec<u64> = plan.chunks.iter().map(|c| buffer_bytes(program, &c.keep_backward)).collect();
    let sums = plan.chunks.iter().map(|c| buffer_bytes(program, &c.sum_backward).saturating_add(buffer_bytes(program, &c.sum_weight))).fold(0, u64::saturating_add);
    // The CPU runtime reuses any spare copy: the most bytes in use at once.
    let (mut held, mut most) = (0i128, 0i128);
    for (chunk, forward, backward) in crate::schedule::kept_copy_changes(&plan.items) {
        let (Some(&f), Some(&b)) = (kept_forward.get(chunk), kept_backward.get(chunk)) else { continue };
        held += forward as i128 * f as i128 + backward as i128 * b as i128;
        most = most.max(held);
    }
    let most = u64::try_from(most).unwrap_or(u64::MAX);
    most.saturating_add(sums)
}
