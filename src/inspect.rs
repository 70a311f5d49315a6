//! `shardc inspect`: a compiled plan (or one rank program) in readable form. Reading and
//! describing are the runtime's (`shardc_runtime::inspect`, also fuzzed); this is the IO.

use std::path::PathBuf;

use clap::Args;
use miette::{miette, Result};

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
    let text = crate::input::read_text("inspect", &args.plan, crate::input::MAX_PLAN_BYTES)?;
    let (header, programs) = shardc_runtime::inspect::read_plan(&text)
        .map_err(|e| miette!(help = "give a plan written by `shardc compile -o`, or recompile it", "{} is not a plan this shardc reads: {e}", args.plan.display()))?;
    if let Some(h) = header {
        println!("plan for {} on mesh {}; passes {}", h.model, h.mesh, h.passes.join(" -> "));
    }
    for program in &programs {
        print!("\n{}", shardc_runtime::inspect::describe(program, args.instrs));
    }
    Ok(())
}
