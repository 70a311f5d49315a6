//! `shardc inspect`: a compiled plan (or one rank program) in readable form.

use std::path::PathBuf;

use clap::Args;
use miette::{miette, IntoDiagnostic, Result, WrapErr};
use shardc_runtime::Program;

use crate::summary::bytes;

/// Arguments of `shardc inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A plan written by `shardc compile -o`, or a single rank program.
    pub plan: PathBuf,
    /// List every instruction.
    #[arg(long)]
    pub instrs: bool,
}

pub fn inspect(args: &InspectArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.plan).into_diagnostic().wrap_err_with(|| format!("reading {}", args.plan.display()))?;
    let programs = match serde_json::from_str::<crate::PlanFile>(&text) {
        Ok(plan) => {
            println!("plan for {} on mesh {}; passes {}", plan.spec.name, plan.mesh, plan.passes.join(" -> "));
            plan.programs
        }
        Err(_) => vec![Program::from_json(&text).into_diagnostic().wrap_err_with(|| format!("{} is neither a plan nor a rank program", args.plan.display()))?],
    };
    if programs.is_empty() {
        return Err(miette!("{} holds no programs", args.plan.display()));
    }
    for program in &programs {
        program.validate().into_diagnostic()?;
        let m = &program.memory;
        println!("\nprogram @{}: {} instructions, {} buffers in {} slots", program.name, program.instrs.len(), program.buffers.len(), m.slots.len());
        println!("  arguments    {} ({} buffers)", bytes(m.argument_bytes as u64), program.args.len());
        println!(
            "  temporaries  {} peak with reuse, {} without ({:.1}x saved)",
            bytes(m.temporary_bytes as u64),
            bytes(m.temporary_bytes_without_reuse as u64),
            m.temporary_bytes_without_reuse as f64 / m.temporary_bytes.max(1) as f64
        );
        println!(
            "  live bound   {} of temporaries alive at once at most (the plan's peak is {:.2}x it)",
            bytes(m.live_bound_bytes as u64),
            m.temporary_bytes as f64 / m.live_bound_bytes.max(1) as f64
        );
        println!("  peak         {}", bytes(program.peak_bytes() as u64));
        let mut counts = std::collections::BTreeMap::new();
        for i in &program.instrs {
            *counts.entry(i.op.as_str()).or_insert(0) += 1;
        }
        println!("  ops          {}", counts.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", "));
        if let Some(pipeline) = &program.pipeline {
            use shardc_runtime::program::Section;
            for chunk in &pipeline.chunks {
                let sizes: Vec<String> = [Section::Forward, Section::Backward, Section::Weight, Section::Step]
                    .iter()
                    .map(|&s| format!("{} {}", s.label(), chunk.range(s).len()))
                    .collect();
                println!(
                    "  stage {:<6} instructions: {}; keeps {} buffers per micro-batch, sums {} over micro-batches",
                    chunk.stage,
                    sizes.join(", "),
                    chunk.keep_forward.len() + chunk.keep_backward.len(),
                    chunk.sum_backward.len() + chunk.sum_weight.len()
                );
            }
            let items: Vec<String> = pipeline.items.iter().map(|i| format!("{:?}{}{}", i.work, i.microbatch, if pipeline.chunks.len() > 1 { format!(".{}", i.chunk) } else { String::new() })).collect();
            println!("  schedule     {} on pipeline rank {} of {}: {}", pipeline.kind.label(), pipeline.rank, pipeline.ranks, items.join(" "));
        }
        if args.instrs {
            for (index, instr) in program.instrs.iter().enumerate() {
                let show = |ids: &[usize]| {
                    ids.iter().map(|&b| format!("b{b}{:?}", program.buffers[b].shape)).collect::<Vec<_>>().join(" ")
                };
                println!("  {index:>5}  {:<22} {:<34} {} -> {}", instr.op, instr.loc, show(&instr.inputs), show(&instr.outputs));
            }
        }
    }
    Ok(())
}
