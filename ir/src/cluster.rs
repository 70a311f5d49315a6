//! The cluster model: what a GPU computes and how fast its links move bytes, per mesh axis.
//!
//! Communication is priced by the alpha-beta model: a message of `n` bytes over a link costs
//! `alpha + n * beta` seconds (latency plus inverse bandwidth). A mesh axis lives on the
//! links its group spans: axes are placed innermost first (`tp`, then `dp`, then `pp` by
//! default), and a group that fits inside one node uses the intra-node link (NVLink-class),
//! anything wider the inter-node network. Collectives follow their algorithm:
//!
//! * ring all-reduce: `2 (n-1)` steps, each moving `1/n` of the bytes: `2 (n-1) alpha + 2
//!   (n-1)/n B beta`;
//! * tree all-reduce (latency-bound small messages): `2 ceil(log2 n) alpha + 2 B beta`; the
//!   cheaper of the two is used;
//! * all-gather and reduce-scatter: `(n-1) alpha + (n-1)/n B beta`, `B` the gathered size;
//! * send: `alpha + B beta`; an all-slice is local (no communication).
//!
//! Presets describe common GPUs and their interconnects; a TOML file overrides any field
//! (see [`Cluster::from_toml`]). The communication optimizer and the planner share this model.

use serde::{Deserialize, Serialize};

/// One link class: latency and inverse bandwidth.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Latency per message step, in seconds.
    pub alpha: f64,
    /// Bandwidth per GPU, in bytes per second (beta is its inverse).
    pub bandwidth: f64,
}

impl Link {
    /// Seconds per byte.
    pub fn beta(&self) -> f64 {
        1.0 / self.bandwidth
    }
}

/// What one GPU computes and holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// Preset name, e.g. `h100-sxm`.
    pub name: String,
    /// Peak dense bf16/fp16 FLOP/s.
    pub bf16_flops: f64,
    /// Peak fp32 FLOP/s (without tensor cores).
    pub fp32_flops: f64,
    /// HBM bytes.
    pub memory_bytes: f64,
    /// HBM bandwidth in bytes per second.
    pub memory_bandwidth: f64,
}

/// The collective being priced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// Sum (or max) over the group, result everywhere.
    AllReduce,
    /// Concatenation of every rank's part, result everywhere.
    AllGather,
    /// Sum over the group, each rank keeping one part.
    ReduceScatter,
    /// From one rank to the group.
    Broadcast,
    /// Point to point.
    Send,
    /// Each rank keeps its part of a replicated value: no communication.
    AllSlice,
}

/// A cluster: GPUs, nodes and links, and where mesh axes live.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// The GPU.
    pub gpu: Gpu,
    /// GPUs per node.
    pub gpus_per_node: usize,
    /// Link between GPUs of one node.
    pub intra_node: Link,
    /// Link between nodes (per GPU).
    pub inter_node: Link,
    /// Mesh axes from innermost (placed inside a node first) to outermost, by index
    /// (0 dp, 1 tp, 2 pp).
    pub placement: Vec<usize>,
    /// Fixed cost of launching one collective (kernel launch and synchronisation), in
    /// seconds, on top of its alpha-beta time: two collectives cost more than one moving
    /// the same bytes.
    pub launch: f64,
    /// Share of the peak FLOP/s that real kernels reach (cuBLAS GEMMs at these sizes reach
    /// 0.7 to 0.8 on A100/H100).
    pub compute_efficiency: f64,
    /// Share of the HBM bandwidth that memory-bound kernels reach (about 0.8 to 0.9).
    pub memory_efficiency: f64,
}

/// A GPU preset.
pub fn gpu_preset(name: &str) -> Option<Gpu> {
    let gpu = |bf16: f64, fp32: f64, gib: f64, tbps: f64| Gpu {
        name: name.to_string(),
        bf16_flops: bf16 * 1e12,
        fp32_flops: fp32 * 1e12,
        memory_bytes: gib * (1u64 << 30) as f64,
        memory_bandwidth: tbps * 1e12,
    };
    Some(match name {
        "a100-40g" => gpu(312.0, 19.5, 40.0, 1.555),
        "a100-80g" => gpu(312.0, 19.5, 80.0, 2.039),
        "h100-sxm" => gpu(989.0, 67.0, 80.0, 3.35),
        "h200" => gpu(989.0, 67.0, 141.0, 4.8),
        _ => return None,
    })
}

/// Names of the GPU presets.
pub const GPU_PRESETS: &[&str] = &["a100-40g", "a100-80g", "h100-sxm", "h200"];

impl Cluster {
    /// A preset cluster of `gpu` nodes with 8 GPUs each: NVLink inside a node (A100: NVLink 3,
    /// about 240 GB/s of all-reduce bus bandwidth per GPU; H100/H200: NVLink 4, about
    /// 360 GB/s) and InfiniBand between nodes (one 200 Gb/s HDR NIC per A100, one 400 Gb/s
    /// NDR NIC per H100/H200).
    pub fn preset(gpu: &str) -> Option<Cluster> {
        let gpu = gpu_preset(gpu)?;
        let hopper = gpu.name.starts_with('h');
        Some(Cluster {
            gpus_per_node: 8,
            intra_node: Link { alpha: 3e-6, bandwidth: if hopper { 360e9 } else { 240e9 } },
            inter_node: Link { alpha: 10e-6, bandwidth: if hopper { 50e9 } else { 25e9 } },
            placement: vec![1, 0, 2],
            launch: 5e-6,
            compute_efficiency: 0.75,
            memory_efficiency: 0.85,
            gpu,
        })
    }

    /// A cluster from TOML: `preset = "a100-80g"` picks the base, and any of
    /// `gpus_per_node`, `placement = ["tp", "dp", "pp"]`, `[gpu]` fields, `[intra_node]` and
    /// `[inter_node]` (`alpha` in seconds, `bandwidth` in bytes/s) override it.
    pub fn from_toml(text: &str) -> Result<Cluster, String> {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.to_string())?;
        let preset = table.get("preset").and_then(|v| v.as_str()).unwrap_or("h100-sxm");
        let mut cluster = Cluster::preset(preset).ok_or_else(|| format!("preset: unknown GPU `{preset}`; use one of {}", GPU_PRESETS.join(", ")))?;
        let number = |v: &toml::Value, field: &str| -> Result<f64, String> {
            v.as_float().or_else(|| v.as_integer().map(|i| i as f64)).filter(|x| *x > 0.0 && x.is_finite()).ok_or_else(|| format!("{field}: expected a positive number"))
        };
        for (key, value) in &table {
            match key.as_str() {
                "preset" => {}
                "gpus_per_node" => cluster.gpus_per_node = number(value, key)? as usize,
                "launch" => cluster.launch = number(value, key)?,
                "compute_efficiency" | "memory_efficiency" => {
                    let x = number(value, key)?;
                    if x > 1.0 {
                        return Err(format!("{key}: a share of the peak, at most 1, got {x}"));
                    }
                    if key == "compute_efficiency" { cluster.compute_efficiency = x } else { cluster.memory_efficiency = x }
                }
                "placement" => {
                    let names = value.as_array().ok_or("placement: expected a list like [\"tp\", \"dp\", \"pp\"]")?;
                    cluster.placement = names
                        .iter()
                        .map(|n| match n.as_str() {
                            Some("dp") => Ok(0),
                            Some("tp") => Ok(1),
                            Some("pp") => Ok(2),
                            _ => Err(format!("placement: unknown axis {n}; use dp, tp and pp")),
                        })
                        .collect::<Result<_, _>>()?;
                }
                "intra_node" | "inter_node" => {
                    let t = value.as_table().ok_or_else(|| format!("{key}: expected a table with alpha and bandwidth"))?;
                    let link = if key == "intra_node" { &mut cluster.intra_node } else { &mut cluster.inter_node };
                    for (field, v) in t {
                        match field.as_str() {
                            "alpha" => link.alpha = number(v, &format!("{key}.alpha"))?,
                            "bandwidth" => link.bandwidth = number(v, &format!("{key}.bandwidth"))?,
                            other => return Err(format!("{key}.{other}: unknown field; use alpha or bandwidth")),
                        }
                    }
                }
                "gpu" => {
                    let t = value.as_table().ok_or("gpu: expected a table")?;
                    for (field, v) in t {
                        let x = number(v, &format!("gpu.{field}"))?;
                        match field.as_str() {
                            "bf16_flops" => cluster.gpu.bf16_flops = x,
                            "fp32_flops" => cluster.gpu.fp32_flops = x,
                            "memory_bytes" => cluster.gpu.memory_bytes = x,
                            "memory_bandwidth" => cluster.gpu.memory_bandwidth = x,
                            other => return Err(format!("gpu.{other}: unknown field")),
                        }
                    }
                }
                other => return Err(format!("{other}: unknown field; use preset, gpus_per_node, launch, compute_efficiency, memory_efficiency, placement, gpu, intra_node or inter_node")),
            }
        }
        Ok(cluster)
    }

    /// The link a group over `axes` of a mesh of `grid` extents uses: inside a node when the
    /// span of the group (its axes and every axis placed inside them) fits in a node.
    pub fn link(&self, grid: &[i64], axes: &[usize]) -> Link {
        let extent = |a: usize| grid.get(a).copied().unwrap_or(1).max(1) as usize;
        let outermost = axes.iter().filter_map(|a| self.placement.iter().position(|p| p == a)).max();
        let span: usize = match outermost {
            Some(o) => self.placement[..=o].iter().map(|&a| extent(a)).product(),
            None => axes.iter().map(|&a| extent(a)).product(),
        };
        if span <= self.gpus_per_node { self.intra_node } else { self.inter_node }
    }

    /// Seconds for `collective` over `axes` of `grid`, moving `bytes` (the full, gathered or
    /// reduced size).
    pub fn time(&self, collective: Collective, bytes: f64, grid: &[i64], axes: &[usize]) -> f64 {
        let n: i64 = axes.iter().map(|&a| grid.get(a).copied().unwrap_or(1).max(1)).product();
        if n <= 1 || collective == Collective::AllSlice {
            return 0.0;
        }
        let link = self.link(grid, axes);
        let (n, a, b) = (n as f64, link.alpha, link.beta());
        let share = (n - 1.0) / n;
        self.launch + match collective {
            Collective::AllReduce => {
                let ring = 2.0 * (n - 1.0) * a + 2.0 * share * bytes * b;
                let tree = 2.0 * n.log2().ceil() * a + 2.0 * bytes * b;
                ring.min(tree)
            }
            Collective::AllGather | Collective::ReduceScatter => (n - 1.0) * a + share * bytes * b,
            // Pipelined over a ring: the bytes once, n - 1 latencies.
            Collective::Broadcast => (n - 1.0) * a + bytes * b,
            Collective::Send => a + bytes * b,
            Collective::AllSlice => 0.0,
        }
    }

    /// Roofline seconds of work of `flops` and `bytes` of memory traffic, at the achievable
    /// shares of peak compute and bandwidth.
    pub fn compute_time(&self, flops: f64, bytes: f64, fp32: bool) -> f64 {
        let peak = if fp32 { self.gpu.fp32_flops } else { self.gpu.bf16_flops };
        (flops / (peak * self.compute_efficiency)).max(bytes / (self.gpu.memory_bandwidth * self.memory_efficiency))
    }
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster::preset("h100-sxm").expect("the h100-sxm preset exists")
    }
}
