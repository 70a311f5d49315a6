//! Refusing plans that do not fit the GPU the user named, with the estimate per component
//! and the cheapest change that fits.

use miette::{IntoDiagnostic, Result, miette};
use shardc_codegen::estimate::MemoryEstimate;
use shardc_ir::mesh::Mesh;
use shardc_ir::spec::Spec;

use crate::options::StepArgs;

/// Compiles the training step for (`step`, `mesh`) and returns the largest rank's memory
/// estimate.
pub fn memory_estimate(spec: &Spec, step: &StepArgs, mesh: Mesh) -> Result<Option<MemoryEstimate>> {
    // Rewriting collectives hardly moves memory; skipping it keeps the search quick.
    let options = step.with(|s| s.strategy.no_comm_opt = true).compile_options(spec, mesh)?;
    let mut module = shardc_ir::spec::lower(spec, spec.step_shape(&mesh)).into_diagnostic()?;
    let cx = crate::ir_context()?;
    shardc_passes::compile_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).into_diagnostic()?;
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    let programs = match step.schedule(spec, mesh)? {
        Some(schedule) => shardc_codegen::lower_pipeline(&module, &grid, &schedule).into_diagnostic()?,
        None => {
            let func = module.func("train_step").ok_or_else(|| miette!("the pipeline produced no @train_step"))?;
            vec![shardc_codegen::lower_func_on(func, &grid).into_diagnostic()?]
        }
    };
    Ok(shardc_codegen::estimate::memory(&programs, step.strategy.zero).into_iter().max_by(|a, b| a.total.total_cmp(&b.total)))
}

fn gb(bytes: f64) -> String {
    format!("{:.1} GB", bytes / 1e9)
}

/// The changes worth trying, cheapest in step time first: shard optimizer state and
/// gradients over dp (ZeRO), recompute, a smaller micro-batch, then more GPUs (tp, pp).
fn candidates(spec: &Spec, step: &StepArgs, mesh: Mesh) -> Vec<(String, Spec, StepArgs, Mesh)> {
    let mut out = Vec::new();
    let mut push = |what: String, spec: &Spec, step: StepArgs, mesh: Mesh| {
        if mesh.check(spec).is_empty() {
            out.push((what, spec.clone(), step, mesh));
        }
    };
    if mesh.dp > 1 {
        for zero in step.strategy.zero + 1..=3 {
            push(format!("--zero {zero}"), spec, step.with(|s| s.strategy.zero = zero), mesh);
        }
    }
    for (recompute, label) in [("selective-attention", "--recompute selective-attention"), ("full", "--recompute full")] {
        if step.strategy.recompute != recompute && step.strategy.recompute != "full" {
            push(label.into(), spec, step.with(|s| s.strategy.recompute = recompute.into()), mesh);
        }
    }
    let micro = spec.training.micro_batch;
    if micro / 2 >= mesh.dp && micro % 2 == 0 {
        let mut smaller = spec.clone();
        smaller.training.micro_batch = micro / 2;
        push(format!("--micro-batch {}", micro / 2), &smaller, step.with(|s| s.batch.micro_batch = Some(micro / 2)), mesh);
    }
    push(format!("tp={} (twice the GPUs)", mesh.tp * 2), spec, step.clone(), Mesh { tp: mesh.tp * 2, ..mesh });
    push(format!("pp={} (twice the GPUs)", mesh.pp * 2), spec, step.clone(), Mesh { pp: mesh.pp * 2, ..mesh });
    out
}

/// When the user named the hardware and the plan's estimate exceeds its memory: an error
/// with the estimate per component and the cheapest single change that fits.
pub fn refuse_if_too_big(spec: &Spec, step: &StepArgs, mesh: Mesh, estimate: &MemoryEstimate, gpu: &str, capacity: f64) -> Result<()> {
    if !step.hardware_given() || estimate.total <= capacity {
        return Ok(());
    }
    let breakdown = format!(
        "weights {}, gradients {}, optimizer {}, activations {} ({} micro-batch{} in flight), temporaries {}{}{}",
        gb(estimate.parameters),
        gb(estimate.gradients),
        gb(estimate.optimizer),
        gb(estimate.activations),
        estimate.in_flight,
        if estimate.in_flight == 1 { "" } else { "es" },
        gb(estimate.temporaries),
        if estimate.staging > 0.0 { format!(", staging {}", gb(estimate.staging)) } else { String::new() },
        if estimate.device_scratch > 0.0 { format!(", device scratch {:.1} MiB", estimate.device_scratch / (1u64 << 20) as f64) } else { String::new() }
    );
    let mut closest: Option<(String, f64)> = None;
    let mut fix = None;
    for (what, spec, step, mesh) in candidates(spec, step, mesh) {
        let Ok(Some(m)) = memory_estimate(&spec, &step, mesh) else { continue };
        if m.total <= capacity {
            fix = Some(format!("cheapest change that fits: {what} (about {} per GPU)", gb(m.total)));
            break;
        }
        if closest.as_ref().is_none_or(|(_, t)| m.total < *t) {
            closest = Some((what, m.total));
        }
    }
    let help = fix.unwrap_or_else(|| match closest {
        Some((what, total)) => format!("no single change fits; the closest is {what} at {}: combine it with others (more tp/pp, ZeRO, recomputation, a smaller micro-batch)", gb(total)),
        None => "use more GPUs (tp, pp) or ZeRO with dp > 1".into(),
    });
    Err(miette!(help = help, "the plan needs {} per GPU but {gpu} has {}: {breakdown}", gb(estimate.total), gb(capacity)))
}

/// When ZeRO is asked for but some optimizer state (from stage 1) or parameters (stage 3)
/// stay whole on every data-parallel rank because no dimension of theirs divides by dp: a line
/// that says how much, which tensors, and what dp would shard them. ZeRO shards each tensor
/// along a dimension dp divides (Megatron's distributed optimizer pads one flat buffer instead).
pub fn zero_gaps(programs: &[shardc_runtime::Program], zero: u8, dp: u64) -> Option<String> {
    use shardc_runtime::program::Role;
    if zero == 0 || dp <= 1 {
        return None;
    }
    let mut left: Vec<(&str, &[usize], usize)> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for program in programs {
        for a in &program.args {
            let sharded_kinds = matches!(a.role, Some(Role::OptState | Role::Master)) || (zero >= 3 && a.role == Some(Role::Param));
            let Some(layout) = a.layout.as_ref().filter(|_| sharded_kinds) else { continue };
            if layout.split.iter().flatten().any(|&axis| axis == 0) || !seen.insert(a.name.as_str()) {
                continue;
            }
            let buffer = &program.buffers[a.buffer];
            left.push((a.name.as_str(), &layout.global_shape, buffer.len() * buffer.dtype.bytes()));
        }
    }
    if left.is_empty() {
        return None;
    }
    let bytes: usize = left.iter().map(|l| l.2).sum();
    let examples: Vec<String> = left.iter().take(3).map(|(name, shape, _)| format!("{name} {shape:?}")).collect();
    Some(format!(
        "ZeRO-{zero} leaves {} per rank of {} tensors whole: no dimension divides by dp={dp} (e.g. {}); a dp that divides one dimension of each shards them",
        crate::summary::bytes(bytes as u64),
        left.len(),
        examples.join(", ")
    ))
}
