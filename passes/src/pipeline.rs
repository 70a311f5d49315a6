//! The pass trait and the pipeline that runs, verifies and observes passes.

use std::time::{Duration, Instant};

use shardc_ir::mlir::{emit, IrContext, PrintStyle};
use shardc_ir::{verify, IrError, Module};

/// Whether a pass changed the module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Changed {
    /// The module was rewritten.
    Yes,
    /// The module is as it was.
    No,
}

/// A pass over the whole module.
pub trait Pass {
    /// Kebab-case name, used by `--print-ir-after=NAME` and dump file names.
    fn name(&self) -> &'static str;

    /// Rewrites `module`. Errors caused by the user's input are [`PassError::User`].
    fn run(&self, module: &mut Module) -> Result<Changed, PassError>;
}

/// Why a pipeline stopped.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PassError {
    /// The input cannot be compiled as asked (e.g. an infeasible sharding).
    #[error("pass `{pass}`: {message}")]
    User {
        /// Pass name.
        pass: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A pass left IR that does not verify: a bug in shardc.
    #[error("internal error: IR after pass `{pass}` does not verify (a bug in shardc)")]
    Internal {
        /// Pass name (`input` for the IR before the first pass).
        pass: String,
        /// What the verifiers said.
        source: IrError,
    },
}

/// What one pass did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassRecord {
    /// Pass name.
    pub name: &'static str,
    /// Whether it changed the module.
    pub changed: Changed,
    /// Time spent in the pass itself (not verification).
    pub elapsed: Duration,
}

/// What a pipeline run did, pass by pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PipelineReport {
    /// One record per pass, in order.
    pub passes: Vec<PassRecord>,
}

/// An ordered list of passes.
#[derive(Default)]
pub struct Pipeline {
    passes: Vec<Box<dyn Pass>>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl Pipeline {
    /// An empty pipeline.
    pub fn new() -> Self {
        Pipeline::default()
    }

    /// Appends a pass.
    pub fn then(mut self, pass: impl Pass + 'static) -> Self {
        self.passes.push(Box::new(pass));
        self
    }

    /// Pass names, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    /// Runs every pass on `module`, verifying after each. `observe(name, ir)` is called with
    /// the printed IR (with locations) for the input (`name` = `input`) and after every pass
    /// for which `wants(name)` is true.
    pub fn run(
        &self,
        cx: &IrContext,
        module: &mut Module,
        wants: impl Fn(&str) -> bool,
        mut observe: impl FnMut(&str, &str),
    ) -> Result<PipelineReport, PassError> {
        check(cx, module, "input", &wants, &mut observe)?;
        let mut report = PipelineReport::default();
        for pass in &self.passes {
            let start = Instant::now();
            let changed = pass.run(module)?;
            report.passes.push(PassRecord { name: pass.name(), changed, elapsed: start.elapsed() });
            check(cx, module, pass.name(), &wants, &mut observe)?;
        }
        Ok(report)
    }
}

/// Verifies `module` (structurally, then through MLIR) and hands its text to the observer.
fn check(
    cx: &IrContext,
    module: &Module,
    pass: &str,
    wants: &impl Fn(&str) -> bool,
    observe: &mut impl FnMut(&str, &str),
) -> Result<(), PassError> {
    let internal = |source: IrError| PassError::Internal { pass: pass.to_string(), source };
    let problems = verify::verify_module(module);
    if !problems.is_empty() {
        return Err(internal(IrError::Verify(problems)));
    }
    let mlir = emit(cx, module).map_err(internal)?;
    mlir.verify(cx).map_err(internal)?;
    if wants(pass) {
        observe(pass, &mlir.print(PrintStyle::WithLocations));
    }
    Ok(())
}
