//! A training loop over a compiled `train_step` program: parameters initialised (or loaded),
//! optimizer state zeroed, one step per call on a batch from the corpus.

use crate::cpu::CpuExecutor;
use crate::data::ByteCorpus;
use crate::init::init_param;
use crate::program::{Program, Role};
use crate::RuntimeError;

/// Drives `train_step` on the CPU.
#[derive(Debug)]
pub struct Trainer {
    exec: CpuExecutor,
    step: u64,
    seed: u64,
    rows: usize,
    seq: usize,
}

impl Trainer {
    /// Sets up `program` (a `train_step`): parameters from `seed`, state zero.
    pub fn new(program: Program, seed: u64, layers: usize) -> Result<Trainer, RuntimeError> {
        let tokens = program.arg("tokens").ok_or_else(|| RuntimeError::Binding("the program has no `tokens` input".into()))?;
        let shape = program.buffers[tokens.buffer].shape.clone();
        if shape.len() != 2 || program.arg("step").is_none() {
            return Err(RuntimeError::Binding("not a training step: expected tokens [batch, seq] and a step input".into()));
        }
        let mut exec = CpuExecutor::new(program)?;
        for (name, shape) in exec.args_with(Role::Param) {
            let values = init_param(&name, shape.iter().product(), seed, layers);
            write_f64(&mut exec, &name, &values)?;
        }
        Ok(Trainer { exec, step: 0, seed, rows: shape[0], seq: shape[1] })
    }

    /// Replaces parameters with `tensors` (`name -> (shape, values)`); every parameter must be
    /// present with its shape.
    pub fn load(&mut self, tensors: &std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>) -> Result<(), RuntimeError> {
        for (name, shape) in self.exec.args_with(Role::Param) {
            let (file_shape, values) = tensors.get(&name).ok_or_else(|| RuntimeError::Binding(format!("the checkpoint has no tensor `{name}`")))?;
            if *file_shape != shape {
                return Err(RuntimeError::Binding(format!("checkpoint tensor `{name}` has shape {file_shape:?}, the model needs {shape:?}")));
            }
            let values: Vec<f64> = values.iter().map(|&v| v as f64).collect();
            write_f64(&mut self.exec, &name, &values)?;
        }
        Ok(())
    }

    /// Every parameter as `(name, shape, f32 values)`.
    pub fn parameters(&self) -> Result<Vec<(String, Vec<usize>, Vec<f32>)>, RuntimeError> {
        self.exec
            .args_with(Role::Param)
            .into_iter()
            .map(|(name, shape)| {
                let values = match self.exec.read::<f32>(&name) {
                    Ok(v) => v.to_vec(),
                    Err(_) => self.exec.read::<f64>(&name)?.iter().map(|&v| v as f32).collect(),
                };
                Ok((name, shape, values))
            })
            .collect()
    }

    /// Tokens per step.
    pub fn tokens_per_step(&self) -> usize {
        self.rows * self.seq
    }

    /// Runs one optimizer step on the next batch of `corpus`; returns its loss.
    pub fn step(&mut self, corpus: &ByteCorpus) -> Result<f64, RuntimeError> {
        self.step += 1;
        let (tokens, targets) = corpus.batch(self.seed, self.step, self.rows, self.seq);
        self.exec.write::<i32>("tokens", &tokens)?;
        self.exec.write::<i32>("targets", &targets)?;
        let step = i32::try_from(self.step).map_err(|_| RuntimeError::Binding("step counter overflow".into()))?;
        self.exec.write::<i32>("step", &[step])?;
        self.exec.run()?;
        match self.exec.read::<f32>("loss") {
            Ok(v) => Ok(v[0] as f64),
            Err(_) => Ok(self.exec.read::<f64>("loss")?[0]),
        }
    }

    /// The executor (program, memory, buffers).
    pub fn executor(&self) -> &CpuExecutor {
        &self.exec
    }
}

/// Writes f64 values into an f32 or f64 argument.
fn write_f64(exec: &mut CpuExecutor, name: &str, values: &[f64]) -> Result<(), RuntimeError> {
    match exec.write::<f64>(name, values) {
        Ok(()) => Ok(()),
        Err(_) => exec.write::<f32>(name, &values.iter().map(|&v| v as f32).collect::<Vec<_>>()),
    }
}
