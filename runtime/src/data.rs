//! Training data: a text file read as bytes, one token per byte, and a deterministic
//! sampler of (tokens, targets) windows.

use crate::init::{key, uniform};
use crate::RuntimeError;

/// A byte-level corpus.
#[derive(Clone, Debug)]
pub struct ByteCorpus {
    bytes: Vec<u8>,
}

impl ByteCorpus {
    /// A corpus of `bytes`: it must hold more than `seq + 1` bytes, and every byte must be a
    /// valid token of a `vocab`-sized vocabulary.
    pub fn new(bytes: Vec<u8>, seq: usize, vocab: usize) -> Result<ByteCorpus, RuntimeError> {
        if bytes.len() <= seq + 1 {
            return Err(RuntimeError::Binding(format!("the corpus has {} bytes, fewer than one sequence of {} tokens plus one", bytes.len(), seq)));
        }
        if let Some(&b) = bytes.iter().find(|&&b| b as usize >= vocab) {
            return Err(RuntimeError::Binding(format!(
                "byte {b} of the corpus is outside the model's vocabulary of {vocab}; byte-level training needs vocab >= 256"
            )));
        }
        Ok(ByteCorpus { bytes })
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the corpus is empty (never, once constructed).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The batch of `step`: `rows` windows of `seq` tokens at offsets drawn from
    /// (seed, step, row); targets are the tokens shifted by one.
    pub fn batch(&self, seed: u64, step: u64, rows: usize, seq: usize) -> (Vec<i32>, Vec<i32>) {
        let k = key(seed, "data");
        let span = (self.bytes.len() - seq - 1) as f64;
        let mut tokens = Vec::with_capacity(rows * seq);
        let mut targets = Vec::with_capacity(rows * seq);
        for row in 0..rows {
            let start = (uniform(k, step * rows as u64 + row as u64) * span) as usize;
            tokens.extend(self.bytes[start..start + seq].iter().map(|&b| b as i32));
            targets.extend(self.bytes[start + 1..start + seq + 1].iter().map(|&b| b as i32));
        }
        (tokens, targets)
    }
}
