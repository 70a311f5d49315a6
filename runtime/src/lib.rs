//! shardc's runtime: executes rank programs.
//!
//! A rank program ([`program::Program`]) is plain data: numbered buffers with a memory plan,
//! and instructions (kernels, later collectives and send/recv) in execution order. Codegen
//! writes it, this crate runs it. This crate does not depend on MLIR, so a small runtime
//! binary can run a program on a machine with no compiler toolchain.
//!
//! The CPU backend ([`cpu`]) is the default and the test oracle: f32 and f64 kernels (bf16
//! tensors are stored as bf16 and computed on in f32, rounded once per result) with a
//! real GEMM (the `gemm` crate) and rayon, deterministic (every reduction has a fixed order,
//! whatever the thread schedule), so that the same seed gives bit-identical runs.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod checkpoint;
pub mod collectives;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod eval;
pub mod hf;
mod error;
pub mod init;
pub mod inspect;
pub mod layout;
pub mod memory;
pub mod pipeline;
pub mod program;
pub mod report;
pub mod schedule;
pub mod tensor_file;
pub mod train;

pub use error::RuntimeError;
pub use program::{Attr, BufferId, DType, Instr, Program};
