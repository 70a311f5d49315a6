//! shardc's intermediate representation.
//!
//! The pipeline reads: model spec → [`spec::lower`] → [`graph::Module`] (owned Rust data that
//! passes rewrite) ↔ MLIR ([`mlir`], built with melior, verified and printed after every pass).
//!
//! Model ops live in our dialect `xf`, defined in IRDL (`dialect/xf.irdl.mlir`, generated from
//! [`ops::REGISTRY`]). Its semantics, op by op, are the doc comments of the `ops` module: every
//! op works on static ranked tensors; linear weights are `[in, out]`; activations are
//! `[batch, seq, features]`, attention's too: its heads lie side by side in the features
//! (`[batch, seq, heads * head_dim]`, the `head_dim` attribute saying where one ends).
//! Meshes, shardings and collectives are upstream MLIR's `shard` dialect, not ours.

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod attrs;
pub mod cluster;
#[cfg(feature = "mlir")]
mod ffi;
mod error;
pub mod facts;
pub mod graph;
pub mod kernel;
pub mod mesh;
#[cfg(feature = "mlir")]
pub mod mlir;
pub mod ops;
pub mod sharding;
pub mod spec;
pub mod types;
pub mod verify;

pub use attrs::{AttrValue, Attrs, Reduction};
pub use error::IrError;
pub use facts::Phase;
pub use graph::{ArgLayout, ArgRole, Func, FuncBuilder, Grid, Module, Op, Type, Value};
pub use types::{DType, TensorTy};
