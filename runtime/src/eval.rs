//! Validation loss: the model's forward pass with its loss (`@forward`, lowered for one
//! device) run over the corpus's held-out windows with a run's current parameters.
//!
//! Whatever mesh trained the parameters, they are evaluated as global tensors on one
//! device: the same parameters give the same validation loss on every layout.

use crate::RuntimeError;
use crate::cpu::CpuExecutor;
use crate::data::Corpus;
use crate::program::{Program, Role};
use crate::train::ParameterSource;

/// Runs a forward-with-loss program over a fixed set of validation windows.
#[derive(Debug)]
pub struct Evaluator {
    exec: CpuExecutor,
    rows: usize,
    windows: usize,
}

impl Evaluator {
    /// Sets up `program` (a single-device `@forward` returning `loss`, whose `tokens` are
    /// `[rows, seq]`) to evaluate the first `windows` validation windows of `corpus`, rounded
    /// down to a whole number of batches of `rows`.
    pub fn new(program: Program, corpus: &Corpus, windows: usize) -> Result<Evaluator, RuntimeError> {
        let tokens = program.arg("tokens").ok_or_else(|| RuntimeError::Binding("the evaluation program has no `tokens` input".into()))?;
        let shape = program.buffers[tokens.buffer].shape.clone();
        if shape.len() != 2 || program.arg("targets").is_none() || program.result("loss").is_none() {
            return Err(RuntimeError::Binding("not a forward pass with a loss: expected tokens and targets [batch, seq] and a `loss` result".into()));
        }
        corpus.check_seq(shape[1])?;
        let rows = shape[0].max(1);
        let windows = windows.min(corpus.validation_windows() as usize) / rows * rows;
        if windows == 0 {
            return Err(RuntimeError::Binding(format!(
                "{} validation windows, fewer than the evaluation batch of {rows}: hold out more with --eval-fraction",
                corpus.validation_windows()
            )));
        }
        Ok(Evaluator { exec: CpuExecutor::new(program)?, rows, windows })
    }

    /// The validation windows each evaluation averages over.
    pub fn windows(&self) -> usize {
        self.windows
    }

    /// The mean cross-entropy of the model with the run's `parameters` over the validation
    /// windows (every window has the same number of tokens, so the mean of the batches'
    /// means is the mean over all tokens).
    pub fn loss(&mut self, parameters: &dyn ParameterSource, corpus: &Corpus) -> Result<f64, RuntimeError> {
        let program = self.exec.program();
        let params: Vec<(crate::program::Binding, Vec<usize>)> = program.args.iter().filter(|a| a.role == Some(Role::Param)).map(|a| (a.clone(), program.buffers[a.buffer].shape.clone())).collect();
        let shapes = parameters.parameter_shapes()?;
        // One parameter at a time, straight into the evaluation program's buffer.
        for (binding, shape) in params {
            let logical = binding.logical_shape(&shape);
            match shapes.get(&binding.name) {
                Some(have) if *have == logical => {}
                have => return Err(RuntimeError::Binding(format!("the run's parameter `{}` has shape {have:?}, the evaluation needs {logical:?}", binding.name))),
            }
            let values = binding.to_program(&parameters.parameter_values(&binding.name)?, &shape);
            self.exec.write_f64(&binding.name, &values)?;
        }
        let mut sum = 0.0;
        for first in (0..self.windows).step_by(self.rows) {
            let (tokens, targets) = corpus.validation_batch(first, self.rows);
            self.exec.write::<i32>("tokens", &tokens)?;
            self.exec.write::<i32>("targets", &targets)?;
            self.exec.run()?;
            sum += self.exec.read_f64("loss")?[0];
        }
        Ok(sum / (self.windows / self.rows) as f64)
    }
}
