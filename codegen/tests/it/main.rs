//! Numeric tests: IR -> passes -> codegen -> CPU runtime, in one binary.

mod checkpoint;
mod clipping;
mod comm_opt;
mod device;
mod epilogues;
mod estimate;
mod common;
mod gradcheck;
mod memory;
mod mixed;
mod moe;
mod norm_kernels;
mod origins;
mod padding;
mod pipeline;
mod spmd;
mod training;
mod zero;
