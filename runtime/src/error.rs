//! Runtime errors: what failed, at which instruction and model location.

/// An error while loading or running a program.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The program is malformed or unsupported by this backend.
    #[error("invalid program: {0}")]
    Program(String),
    /// A kernel failed (bad input data, such as a token id outside the vocabulary).
    #[error("instruction {index} (`{op}` at {loc}): {message}")]
    Kernel {
        /// Instruction index.
        index: usize,
        /// Op name.
        op: String,
        /// Model location of the instruction.
        loc: String,
        /// What went wrong.
        message: String,
    },
    /// A named argument or result does not exist or has the wrong size.
    #[error("{0}")]
    Binding(String),
    /// A rank of a multi-rank run failed: the cause first, then what the others were doing.
    #[error("{0}")]
    Ranks(String),
    /// The GPU backend cannot run here or a device call failed.
    #[error("{0}")]
    Device(String),
    /// The loss stopped being a finite number: the run stops at that step, before anything of
    /// its state is saved.
    #[error("the loss became {loss} at step {step}")]
    NonFiniteLoss {
        /// The step (counted from the start of training).
        step: u64,
        /// The loss.
        loss: f64,
    },
    /// A state tensor holds a value that is not finite (a finite loss can precede an update
    /// that overflowed): it is not checkpointed.
    #[error("`{tensor}` holds {value} on rank {rank}: not checkpointed")]
    NonFiniteState {
        /// The tensor.
        tensor: String,
        /// The rank whose shard holds it.
        rank: usize,
        /// The value.
        value: f64,
    },
}
