//! The device mesh a user asks for: `dp x cp x tp x pp`, parsed from
//! `--mesh dp=2,cp=2,tp=4,pp=2`, and checked against a spec before any work is done. Expert
//! parallelism (`ep=4`) is carved from the data-parallel ranks, as in Megatron-Core: it adds
//! no ranks, it splits each MoE layer's experts over groups of `ep` data-parallel ranks.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::spec::Spec;

/// The grid axis of data parallelism. Every grid a pass builds is `[dp, tp, pp]`, and
/// `[dp, tp, pp, cp]` with context parallelism, `[dp / ep, tp, pp, cp, ep]` with expert
/// parallelism, in this order (ranks are still numbered tp fastest: see
/// [`crate::cluster::RANK_ORDER`]).
pub const DP_AXIS: usize = 0;
/// The grid axis of tensor parallelism.
pub const TP_AXIS: usize = 1;
/// The grid axis of pipeline parallelism.
pub const PP_AXIS: usize = 2;
/// The grid axis of context parallelism: every activation's sequence is split over it. Last,
/// so that a grid without it (cp=1) keeps the other axes' indices.
pub const CP_AXIS: usize = 3;
/// The grid axis of expert parallelism: the data-parallel ranks of one expert group. A grid
/// with it has the dp axis of `dp / ep` groups, and batches split over `[dp, ep]`, so that
/// each rank holds the same sequences as without it. Last, after cp (of extent 1 without
/// context parallelism).
pub const EP_AXIS: usize = 4;
/// The grid axes' names, by index.
pub const GRID_AXES: [&str; 5] = ["dp", "tp", "pp", "cp", "ep"];

/// The name of grid axis `axis` (`?` for one no grid has).
pub fn axis_name(axis: usize) -> &'static str {
    GRID_AXES.get(axis).copied().unwrap_or("?")
}

/// Data-, tensor-, pipeline-, context- and expert-parallel extents. Every axis is at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mesh {
    /// Data-parallel replicas.
    pub dp: u64,
    /// Tensor-parallel ranks per replica.
    pub tp: u64,
    /// Pipeline stages.
    pub pp: u64,
    /// Context-parallel ranks: each holds a part of every sequence.
    #[serde(default = "one")]
    pub cp: u64,
    /// Expert-parallel ranks: each MoE layer's experts are split over groups of `ep`
    /// data-parallel ranks (`ep` divides `dp`; it adds no ranks).
    #[serde(default = "one")]
    pub ep: u64,
}

fn one() -> u64 {
    1
}

impl Default for Mesh {
    fn default() -> Self {
        Mesh { dp: 1, tp: 1, pp: 1, cp: 1, ep: 1 }
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // cp and ep only where they are used, so the common meshes read as they always did.
        write!(f, "dp={}", self.dp)?;
        if self.ep > 1 {
            write!(f, ",ep={}", self.ep)?;
        }
        if self.cp > 1 {
            write!(f, ",cp={}", self.cp)?;
        }
        write!(f, ",tp={},pp={}", self.tp, self.pp)
    }
}

/// A problem with a mesh: which axis, what is wrong, how to fix it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("mesh: {message}")]
pub struct MeshError {
    /// What is wrong.
    pub message: String,
    /// How to fix it.
    pub help: String,
}

impl Mesh {
    /// Number of ranks (devices).
    pub fn ranks(&self) -> u64 {
        self.dp.saturating_mul(self.tp).saturating_mul(self.pp).saturating_mul(self.cp)
    }

    /// Parses `dp=2,tp=4,pp=2`; omitted axes are 1.
    pub fn parse(text: &str) -> Result<Mesh, MeshError> {
        let mut mesh = Mesh::default();
        let mut seen = Vec::new();
        let error = |message: String, help: &str| MeshError { message, help: help.to_string() };
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((axis, value)) = part.split_once('=') else {
                return Err(error(format!("`{part}` is not of the form axis=size"), "write e.g. --mesh dp=2,tp=4,pp=1"));
            };
            let axis = axis.trim();
            let size: u64 = match value.trim().parse() {
                Ok(n) if (1..=1 << 20).contains(&n) => n,
                _ => return Err(error(format!("size of `{axis}` must be an integer from 1 to 1048576, got `{}`", value.trim()), "write e.g. tp=4")),
            };
            if seen.contains(&axis.to_string()) {
                return Err(error(format!("axis `{axis}` is given twice"), "give each of dp, ep, cp, tp, pp at most once"));
            }
            seen.push(axis.to_string());
            match axis {
                "dp" => mesh.dp = size,
                "tp" => mesh.tp = size,
                "pp" => mesh.pp = size,
                "cp" => mesh.cp = size,
                "ep" => mesh.ep = size,
                _ => return Err(error(format!("unknown axis `{axis}`"), "the axes are dp (data), ep (expert, carved from dp), cp (context), tp (tensor) and pp (pipeline)")),
            }
        }
        Ok(mesh)
    }

    /// Checks that the mesh can partition this model; returns every problem.
    pub fn check(&self, spec: &Spec) -> Vec<MeshError> {
        let m = &spec.model;
        let mut errors = Vec::new();
        let mut error = |message: String, help: String| errors.push(MeshError { message, help });
        if !m.heads.is_multiple_of(self.tp) {
            error(format!("tp={} does not divide the {} attention heads", self.tp, m.heads), divisors_help("tp", m.heads));
        }
        if !m.ffn_hidden.is_multiple_of(self.tp) {
            error(format!("tp={} does not divide ffn_hidden={}", self.tp, m.ffn_hidden), divisors_help("tp", m.ffn_hidden));
        }
        if m.padded_vocab(self.tp) > crate::spec::MAX_DIM {
            error(format!("the vocabulary padded for tp={} ({} rows) exceeds the largest supported size", self.tp, m.padded_vocab(self.tp)), "use a smaller tp or model.vocab_multiple".into());
        }
        if self.cp > 1 {
            let seq = spec.seq_len();
            // Each rank holds two of 2 x cp chunks (one early, one late), so causal attention
            // costs every rank the same.
            if !seq.is_multiple_of(2 * self.cp) {
                error(
                    format!("cp={} does not divide the sequence of {seq} into {} equal chunks (each context-parallel rank holds two, one early and one late, to balance causal attention)", self.cp, 2 * self.cp),
                    format!("use a sequence that is a multiple of {} (--seq), or a smaller cp", 2 * self.cp),
                );
            }
        }
        if self.ep > 1 {
            match &m.moe {
                None => error(format!("ep={} splits experts, but the model has none", self.ep), "add a [model.moe] section, or leave ep out".into()),
                Some(moe) if !moe.experts.is_multiple_of(self.ep) => error(format!("ep={} does not divide the {} experts", self.ep, moe.experts), divisors_help("ep", moe.experts)),
                Some(_) => {}
            }
            if !self.dp.is_multiple_of(self.ep) {
                error(format!("ep={} does not divide dp={}: expert parallelism is carved from the data-parallel ranks", self.ep, self.dp), format!("use dp a multiple of {} (e.g. dp={}), or {}", self.ep, self.ep, divisors_help("ep", self.dp)));
            }
        }
        if self.pp > 2 * m.layers + 2 {
            error(format!("pp={} exceeds the {} blocks of the model (embedding, attention and MLP of each layer, head)", self.pp, 2 * m.layers + 2), format!("use pp <= {}", 2 * m.layers + 2));
        }
        errors
    }
}

/// "use tp in {1, 2, 4, ...}" for the divisors of `n` (the first few).
fn divisors_help(axis: &str, n: u64) -> String {
    let divisors: Vec<String> = (1..=n.min(1024)).filter(|d| n.is_multiple_of(*d)).take(8).map(|d| d.to_string()).collect();
    format!("use {axis} in {{{}}}", divisors.join(", "))
}
