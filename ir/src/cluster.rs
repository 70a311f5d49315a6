//! The cluster model: how long a kernel, a collective and a transfer take, from a few physical
//! parameters of the device and its links. Each constant of the presets names its source;
//! `shardc calibrate` measures the same parameters on the machine at hand.
//!
//! **Kernels** ([`Cluster::kernel_time`]) follow the class the op registry gives them:
//!
//! * a GEMM runs in output tiles of `gemm_tile` on `sms` processors, in waves: a partial tile
//!   costs a whole one (tile quantization) and a last partial wave a whole wave (wave
//!   quantization; NVIDIA's "Matrix Multiplication Background" guide). Each tile's main loop
//!   runs at `gemm_efficiency` of its processor's share of the peak and pays a fixed
//!   `gemm_k_overhead` steps of the contracted dimension (filling the software pipeline, the
//!   epilogue), so thin products run far below peak. When the tiles cannot fill the
//!   processors, the contracted dimension is split (cuBLAS's split-K);
//! * attention is priced as the flash-attention algorithm runs it: one block of query rows per
//!   (batch, head) and tile row, streaming over the keys it sees (half of them, plus the
//!   diagonal block, when causal), at `attention_efficiency` of the peak; its memory traffic
//!   is its inputs and outputs once;
//! * everything else is a roofline of its arithmetic at `vector_efficiency` of the fp32 peak
//!   (a transcendental, exp, log or tanh, counting `special_cost` operations)
//!   and its bytes at `memory_efficiency` of the memory bandwidth;
//! * every kernel pays `kernel_launch`.
//!
//! **Collectives** follow NCCL's cost structure: a fixed latency per collective (`launch`),
//! a latency per algorithm step (`alpha` of the link) and the bytes at the link's bus bandwidth
//! (nccl-tests' definition: the bandwidth a ring sustains per GPU). A mesh axis lives on the
//! links its group spans: axes are placed innermost first (`tp`, then `dp`, then `pp` by
//! default), and a group that fits inside one node uses the intra-node link, anything wider
//! the inter-node network.
//!
//! * ring all-reduce: `2 (n-1)` steps, each moving `1/n` of the bytes: `2 (n-1) alpha + 2
//!   (n-1)/n B beta`;
//! * tree all-reduce (latency-bound small messages): `2 ceil(log2 n) alpha + 2 B beta`; the
//!   cheaper of the two is used, as NCCL's tuner picks;
//! * all-gather and reduce-scatter: `(n-1) alpha + (n-1)/n B beta`, `B` the gathered size;
//! * send: `alpha + B beta`; an all-slice is local (no communication).
//!
//! **A shared host** (`shared_host`, the CPU runtime: a thread per rank on one machine) has one
//! pool of cores: ranks that compute at once share it (and slow each other down by
//! `shared_slowdown`), and its collectives are work of the same cores: the step is the compute
//! of every rank in sequence plus the communication. Pipeline ranks draw on one pool of worker
//! threads, so that a rank alone in another's bubble has every core; while two compute at once
//! their kernels queue behind each other's (`shared_pool_slowdown`).
//!
//! Presets describe common GPUs and their interconnects; a TOML file overrides any field
//! (see [`Cluster::from_toml`]; [`Cluster::to_toml`] writes one). The communication optimizer,
//! the estimate and the planner share this model.

use serde::{Deserialize, Serialize};

/// Grid axes from the fastest-varying rank coordinate to the slowest: tp, then cp, then ep,
/// then dp, then pp (Megatron-Core's order), as the runtimes number ranks. A grid without a
/// cp or ep axis skips it. Expert parallelism is carved from dp, its groups the adjacent
/// data-parallel ranks, so a rank's data-parallel index (`dp x ep + ep`) is what it is
/// without it.
pub const RANK_ORDER: [usize; 5] = [crate::mesh::TP_AXIS, crate::mesh::CP_AXIS, crate::mesh::EP_AXIS, crate::mesh::DP_AXIS, crate::mesh::PP_AXIS];

use crate::ops::{Cost, KernelClass, OpDef};
use crate::{Attrs, DType, TensorTy};

/// One link class: latency and inverse bandwidth.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Latency per algorithm step, in seconds.
    pub alpha: f64,
    /// Bus bandwidth per GPU, in bytes per second (beta is its inverse).
    pub bandwidth: f64,
}

impl Link {
    /// Seconds per byte.
    pub fn beta(&self) -> f64 {
        1.0 / self.bandwidth
    }
}

/// What one device (a GPU, or a CPU host) computes and holds, and how its kernels behave.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// Preset name, e.g. `h100-sxm`, or `cpu` for a calibrated host.
    pub name: String,
    /// Peak dense bf16/fp16 FLOP/s (tensor cores).
    pub bf16_flops: f64,
    /// Peak fp32 FLOP/s (without tensor cores).
    pub fp32_flops: f64,
    /// Memory bytes.
    pub memory_bytes: f64,
    /// Memory bandwidth in bytes per second.
    pub memory_bandwidth: f64,
    /// Processors that run GEMM tiles at once (streaming multiprocessors; on a CPU, worker
    /// threads).
    pub sms: usize,
    /// Output tile (rows, columns) one processor computes at a time.
    pub gemm_tile: [usize; 2],
    /// Share of a processor's peak a GEMM main loop reaches on whole tiles.
    pub gemm_efficiency: f64,
    /// Fixed work per tile, in steps of the contracted dimension (pipeline fill, epilogue).
    pub gemm_k_overhead: f64,
    /// Share of the peak fused attention reaches in its products.
    pub attention_efficiency: f64,
    /// Share of the fp32 peak the arithmetic of element-wise kernels reaches.
    pub vector_efficiency: f64,
    /// Share of the memory bandwidth memory-bound kernels reach.
    pub memory_efficiency: f64,
    /// Arithmetic operations one transcendental function (exp, log, tanh) costs in vector
    /// throughput.
    pub special_cost: f64,
    /// Seconds to launch (or dispatch) one kernel.
    pub kernel_launch: f64,
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
    /// Each rank sends a part to every other (expert dispatch and combine).
    AllToAll,
}

/// A cluster: devices, nodes and links, and where mesh axes live.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// The device.
    pub gpu: Gpu,
    /// GPUs per node.
    pub gpus_per_node: usize,
    /// Link between GPUs of one node.
    pub intra_node: Link,
    /// Link between nodes, per GPU (each GPU's own network card).
    pub inter_node: Link,
    /// Mesh axes from innermost (placed inside a node first) to outermost, by index
    /// (0 dp, 1 tp, 2 pp).
    pub placement: Vec<usize>,
    /// Fixed latency of one collective (launch, synchronisation, the protocol's base latency),
    /// in seconds, on top of its steps: two collectives cost more than one moving the same
    /// bytes.
    pub launch: f64,
    /// Whether every rank runs on one host and shares its cores (the CPU runtime).
    pub shared_host: bool,
    /// On a shared host: how much longer ranks computing at once take than the same work done
    /// one rank after another (contention for caches, memory and worker threads; 1 is none).
    pub shared_slowdown: f64,
    /// On a shared host: the same for pipeline ranks, which draw on one pool of worker
    /// threads instead of each on its share of them (their kernels queue behind each other's).
    pub shared_pool_slowdown: f64,
}

/// The contracted dimension is split only into parts at least this long (cuBLAS's split-K
/// keeps each part's main loop long enough to pay for the extra reduction).
const SPLIT_K_MIN: f64 = 256.0;

/// A GPU preset. Peaks are the vendors' data-sheet figures; SM counts the architecture
/// white papers' (A100: 108, H100 SXM: 132).
pub fn gpu_preset(name: &str) -> Option<Gpu> {
    let gpu = |bf16: f64, fp32: f64, gib: f64, tbps: f64, sms: usize, gemm_efficiency: f64| Gpu {
        name: name.to_string(),
        bf16_flops: bf16 * 1e12,
        fp32_flops: fp32 * 1e12,
        memory_bytes: gib * (1u64 << 30) as f64,
        memory_bandwidth: tbps * 1e12,
        sms,
        // cuBLAS's common tensor-core tile for large bf16 products (the "Matrix Multiplication
        // Background" guide's tile-quantization examples use 128 x 128 and 256 x 128).
        gemm_tile: [128, 128],
        gemm_efficiency,
        // About 128 steps of K per tile: at K = 128 a tile runs at half its main-loop speed,
        // as thin GEMMs measure in the same guide's K sweeps.
        gemm_k_overhead: 128.0,
        // FlashAttention-2 reaches 50-73% of the A100's peak forward and backward (Dao 2023,
        // fig. 4-6); the backward, five products per score, is the slower: 0.55 overall.
        attention_efficiency: 0.55,
        // Element-wise arithmetic on CUDA cores; rarely the bound next to memory traffic.
        vector_efficiency: 0.5,
        // STREAM-like kernels reach about 85-90% of HBM bandwidth (vendors' bandwidth tests).
        memory_efficiency: 0.85,
        // 16 special-function units per SM against 64 (A100) or 128 (H100) FP32 lanes doing
        // 2 FLOPs per FMA (architecture white papers): 8 or 16 FLOPs per special op.
        special_cost: if sms > 120 { 16.0 } else { 8.0 },
        // A CUDA kernel launch costs about 4-5 microseconds end to end in a stream of
        // dependent kernels (the figure CUDA graphs remove).
        kernel_launch: 4e-6,
    };
    // Large cuBLAS bf16 GEMMs: about 85% of peak on A100 (270 of 312 TFLOP/s) and 75% on
    // H100 SXM (about 750 of 989 TFLOP/s: power-limited clocks under tensor-core load).
    Some(match name {
        "a100-40g" => gpu(312.0, 19.5, 40.0, 1.555, 108, 0.85),
        "a100-80g" => gpu(312.0, 19.5, 80.0, 2.039, 108, 0.85),
        "h100-sxm" => gpu(989.0, 67.0, 80.0, 3.35, 132, 0.75),
        "h200" => gpu(989.0, 67.0, 141.0, 4.8, 132, 0.75),
        _ => return None,
    })
}

/// Names of the GPU presets.
pub const GPU_PRESETS: &[&str] = &["a100-40g", "a100-80g", "h100-sxm", "h200"];

impl Cluster {
    /// A preset cluster of `gpu` nodes with 8 GPUs each: NVLink inside a node and InfiniBand
    /// between nodes. Bus bandwidths are nccl-tests measurements reported by NCCL's
    /// maintainers (nccl/nccl-tests issues 149, 212, 290, 812): 8 A100 over NVSwitch about
    /// 230 GB/s, 8 H100 about 370 GB/s with rings; one 200 Gb/s HDR NIC per A100 about
    /// 24 GB/s, one 400 Gb/s NDR NIC per H100/H200 about 47 GB/s. Latencies are NCCL's tuning
    /// table (src/graph/tuning.cc): about 8 microseconds of base latency per collective
    /// (Simple protocol), about 1 microsecond per NVLink step and 5 per network step.
    pub fn preset(gpu: &str) -> Option<Cluster> {
        let gpu = gpu_preset(gpu)?;
        let hopper = gpu.name.starts_with('h');
        Some(Cluster {
            gpus_per_node: 8,
            intra_node: Link { alpha: 1e-6, bandwidth: if hopper { 370e9 } else { 230e9 } },
            inter_node: Link { alpha: 5e-6, bandwidth: if hopper { 47e9 } else { 24e9 } },
            placement: RANK_ORDER.to_vec(),
            launch: 8e-6,
            shared_host: false,
            shared_slowdown: 1.0,
            shared_pool_slowdown: 1.0,
            gpu,
        })
    }

    /// A cluster from TOML: `preset = "a100-80g"` picks the base, and any of
    /// `gpus_per_node`, `launch`, `shared_host`, `placement = ["tp", "cp", "dp", "pp"]`, `[gpu]`
    /// fields (those of [`Gpu`]), `[intra_node]` and `[inter_node]` (`alpha` in seconds,
    /// `bandwidth` in bytes/s) override it.
    pub fn from_toml(text: &str) -> Result<Cluster, String> {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.to_string())?;
        let preset = table.get("preset").and_then(|v| v.as_str()).unwrap_or("h100-sxm");
        let mut cluster = Cluster::preset(preset).ok_or_else(|| format!("preset: unknown GPU `{preset}`; use one of {}", GPU_PRESETS.join(", ")))?;
        let number = |v: &toml::Value, field: &str| -> Result<f64, String> {
            v.as_float().or_else(|| v.as_integer().map(|i| i as f64)).filter(|x| *x > 0.0 && x.is_finite()).ok_or_else(|| format!("{field}: expected a positive number"))
        };
        let share = |v: &toml::Value, field: &str| -> Result<f64, String> {
            let x = number(v, field)?;
            if x > 1.0 {
                return Err(format!("{field}: a share of the peak, at most 1, got {x}"));
            }
            Ok(x)
        };
        let count = |v: &toml::Value, field: &str| -> Result<usize, String> {
            v.as_integer().filter(|&i| i > 0 && i <= 1 << 20).map(|i| i as usize).ok_or_else(|| format!("{field}: expected a positive whole number"))
        };
        for (key, value) in &table {
            match key.as_str() {
                "preset" => {}
                "gpus_per_node" => cluster.gpus_per_node = count(value, key)?,
                "launch" => cluster.launch = number(value, key)?,
                "shared_host" => cluster.shared_host = value.as_bool().ok_or("shared_host: expected true or false")?,
                "shared_slowdown" | "shared_pool_slowdown" => {
                    let x = number(value, key)?;
                    if x < 1.0 {
                        return Err(format!("{key}: at least 1 (ranks cannot gain from sharing cores), got {x}"));
                    }
                    if x > 64.0 {
                        return Err(format!("{key}: at most 64 (two ranks that slow each other down more are not sharing a host, they are broken), got {x}"));
                    }
                    if key == "shared_slowdown" { cluster.shared_slowdown = x } else { cluster.shared_pool_slowdown = x }
                }
                "compute_efficiency" => return Err("compute_efficiency: replaced by the GEMM model's [gpu] gemm_efficiency (and attention_efficiency, vector_efficiency)".into()),
                "memory_efficiency" => cluster.gpu.memory_efficiency = share(value, key)?,
                "placement" => {
                    let names = value.as_array().ok_or("placement: expected a list like [\"tp\", \"dp\", \"pp\"]")?;
                    cluster.placement = names
                        .iter()
                        .map(|n| n.as_str().and_then(|n| crate::mesh::GRID_AXES.iter().position(|a| *a == n)).ok_or_else(|| format!("placement: unknown axis {n}; use tp, cp, ep, dp and pp")))
                        .collect::<Result<_, _>>()?;
                    // The runtimes number ranks tp fastest, then dp, then pp (Megatron-LM's
                    // order): a node holds whole tp groups first. Another order would price
                    // programs that no run places that way.
                    // Without cp, the order of the three others.
                    // Without cp or ep, the order of the others.
                    let others: Vec<usize> = RANK_ORDER.iter().copied().filter(|a| cluster.placement.contains(a)).collect();
                    if cluster.placement == others && cluster.placement.starts_with(&[crate::mesh::TP_AXIS]) && cluster.placement.ends_with(&[crate::mesh::DP_AXIS, crate::mesh::PP_AXIS]) {
                        cluster.placement = RANK_ORDER.to_vec();
                    }
                    if cluster.placement != RANK_ORDER {
                        return Err("placement: shardc places ranks as Megatron-Core does, tp innermost, then cp, then ep, then dp, then pp; give [\"tp\", \"cp\", \"ep\", \"dp\", \"pp\"] or leave it out".into());
                    }
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
                    let g = &mut cluster.gpu;
                    for (field, v) in t {
                        let name = format!("gpu.{field}");
                        match field.as_str() {
                            "name" => g.name = v.as_str().ok_or("gpu.name: expected a string")?.to_string(),
                            "bf16_flops" => g.bf16_flops = number(v, &name)?,
                            "fp32_flops" => g.fp32_flops = number(v, &name)?,
                            "memory_bytes" => g.memory_bytes = number(v, &name)?,
                            "memory_bandwidth" => g.memory_bandwidth = number(v, &name)?,
                            "sms" => g.sms = count(v, &name)?,
                            "gemm_tile" => {
                                let tile = v.as_array().filter(|a| a.len() == 2).ok_or("gpu.gemm_tile: expected [rows, columns]")?;
                                g.gemm_tile = [count(&tile[0], "gpu.gemm_tile")?, count(&tile[1], "gpu.gemm_tile")?];
                            }
                            "gemm_efficiency" => g.gemm_efficiency = share(v, &name)?,
                            "gemm_k_overhead" => {
                                // Zero is a valid overhead.
                                g.gemm_k_overhead = v.as_float().or_else(|| v.as_integer().map(|i| i as f64)).filter(|x| *x >= 0.0 && x.is_finite()).ok_or("gpu.gemm_k_overhead: expected a number of steps, 0 or more")?;
                            }
                            "attention_efficiency" => g.attention_efficiency = share(v, &name)?,
                            "vector_efficiency" => g.vector_efficiency = share(v, &name)?,
                            "memory_efficiency" => g.memory_efficiency = share(v, &name)?,
                            "special_cost" => g.special_cost = number(v, &name)?,
                            "kernel_launch" => g.kernel_launch = number(v, &name)?,
                            other => {
                                return Err(format!(
                                    "gpu.{other}: unknown field; use name, bf16_flops, fp32_flops, memory_bytes, memory_bandwidth, sms, gemm_tile, gemm_efficiency, gemm_k_overhead, attention_efficiency, vector_efficiency, memory_efficiency, special_cost or kernel_launch"
                                ))
                            }
                        }
                    }
                }
                other => return Err(format!("{other}: unknown field; use preset, gpus_per_node, launch, shared_host, shared_slowdown, shared_pool_slowdown, placement, gpu, intra_node or inter_node")),
            }
        }
        Ok(cluster)
    }

    /// The cluster as TOML that [`Cluster::from_toml`] reads back to the same cluster (every
    /// field written, so the file does not depend on the preset it names).
    pub fn to_toml(&self) -> String {
        let axis = |a: &usize| format!("\"{}\"", crate::mesh::axis_name(*a));
        let g = &self.gpu;
        let preset = if GPU_PRESETS.contains(&g.name.as_str()) { g.name.as_str() } else { "h100-sxm" };
        let mut out = String::new();
        out += &format!("preset = \"{preset}\"\n");
        out += &format!("gpus_per_node = {}\n", self.gpus_per_node);
        out += &format!("placement = [{}]\n", self.placement.iter().map(axis).collect::<Vec<_>>().join(", "));
        out += &format!("launch = {:e}\n", self.launch);
        out += &format!("shared_host = {}\nshared_slowdown = {:e}\nshared_pool_slowdown = {:e}\n\n[gpu]\n", self.shared_host, self.shared_slowdown, self.shared_pool_slowdown);
        out += &format!("name = {:?}\n", g.name);
        for (field, x) in [("bf16_flops", g.bf16_flops), ("fp32_flops", g.fp32_flops), ("memory_bytes", g.memory_bytes), ("memory_bandwidth", g.memory_bandwidth)] {
            out += &format!("{field} = {x:e}\n");
        }
        out += &format!("sms = {}\ngemm_tile = [{}, {}]\n", g.sms, g.gemm_tile[0], g.gemm_tile[1]);
        for (field, x) in [
            ("gemm_efficiency", g.gemm_efficiency),
            ("gemm_k_overhead", g.gemm_k_overhead),
            ("attention_efficiency", g.attention_efficiency),
            ("vector_efficiency", g.vector_efficiency),
            ("memory_efficiency", g.memory_efficiency),
            ("special_cost", g.special_cost),
            ("kernel_launch", g.kernel_launch),
        ] {
            out += &format!("{field} = {x:e}\n");
        }
        for (name, link) in [("intra_node", self.intra_node), ("inter_node", self.inter_node)] {
            out += &format!("\n[{name}]\nalpha = {:e}\nbandwidth = {:e}\n", link.alpha, link.bandwidth);
        }
        out
    }

    /// The link a group over `axes` of a mesh of `grid` extents uses: inside a node when the
    /// span of the group (its axes and every axis placed inside them) fits in a node.
    /// Between nodes, a group with k members in each node drives k network cards at once
    /// (NCCL runs a channel through each GPU's own NIC; nccl-tests on DGX-A100 nodes reach
    /// about 192 GB/s of bus bandwidth with 8 HDR NICs of 24 GB/s), up to what the node's
    /// NVLink carries.
    pub fn link(&self, grid: &[i64], axes: &[usize]) -> Link {
        self.group_link(grid, axes, false)
    }

    /// The link of a pipeline send over `axes`: one GPU's message to one other, which
    /// crosses nodes on that GPU's own network card.
    pub fn send_link(&self, grid: &[i64], axes: &[usize]) -> Link {
        self.group_link(grid, axes, true)
    }

    /// [`Cluster::link`]; with `one_card`, the link of one GPU's message to one other (a
    /// pipeline send), which crosses nodes on that GPU's own network card.
    fn group_link(&self, grid: &[i64], axes: &[usize], one_card: bool) -> Link {
        let extent = |a: usize| usize::try_from(grid.get(a).copied().unwrap_or(1).max(1)).unwrap_or(usize::MAX);
        let outermost = axes.iter().filter_map(|a| self.placement.iter().position(|p| p == a)).max();
        let members: usize = axes.iter().map(|&a| extent(a)).fold(1, usize::saturating_mul);
        // The axes placed inside the group's outermost one, innermost first, and whether each
        // is one of the group's.
        let placed: Vec<(usize, bool)> = match outermost {
            Some(o) => self.placement[..=o].iter().map(|&a| (extent(a), axes.contains(&a))).collect(),
            None => vec![(members, true)],
        };
        let span = placed.iter().map(|&(e, _)| e).fold(1, usize::saturating_mul);
        let gpus_per_node = self.gpus_per_node.max(1);
        if span <= gpus_per_node {
            return self.intra_node;
        }
        if one_card {
            return self.inter_node;
        }
        let per_node = fewest_members_per_node(&placed, gpus_per_node).clamp(1, gpus_per_node);
        Link { alpha: self.inter_node.alpha, bandwidth: (per_node as f64 * self.inter_node.bandwidth).min(self.intra_node.bandwidth.max(self.inter_node.bandwidth)) }
    }

    /// Seconds for `collective` over `axes` of `grid`, moving `bytes` (the full, gathered or
    /// reduced size).
    pub fn time(&self, collective: Collective, bytes: f64, grid: &[i64], axes: &[usize]) -> f64 {
        let n: i64 = axes.iter().map(|&a| grid.get(a).copied().unwrap_or(1).max(1)).fold(1, i64::saturating_mul);
        if n <= 1 || collective == Collective::AllSlice {
            return 0.0;
        }
        // A send, and an all-to-all's messages (each a different peer), cross nodes on one
        // GPU's own network card.
        let link = if matches!(collective, Collective::Send | Collective::AllToAll) { self.send_link(grid, axes) } else { self.link(grid, axes) };
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
            // Pairwise: n - 1 rounds, each rank keeping 1/n of its `bytes`.
            Collective::AllToAll => (n - 1.0) * a + share * bytes * b,
            Collective::AllSlice => 0.0,
        }
    }

    /// Seconds of one instance of the op `def` on these operand and result types.
    pub fn op_time(&self, def: &dyn OpDef, inputs: &[&TensorTy], outputs: &[TensorTy], attrs: &Attrs) -> f64 {
        let cost = def.cost(inputs, outputs, attrs);
        let bf16 = inputs.first().is_some_and(|t| t.dtype == DType::Bf16);
        self.kernel_time(&def.kernel_class(inputs, attrs), &cost, bf16)
    }

    /// Seconds of one kernel of `class` doing `cost` (its arithmetic, special functions and
    /// bytes), its products in bf16 (tensor cores) or not.
    pub fn kernel_time(&self, class: &KernelClass, cost: &Cost, bf16: bool) -> f64 {
        let (flops, bytes) = (cost.flops, cost.bytes);
        let g = &self.gpu;
        let peak = if bf16 { g.bf16_flops } else { g.fp32_flops };
        let memory = bytes / (g.memory_bandwidth * g.memory_efficiency);
        let sms = g.sms.max(1) as f64;
        let [tile_rows, tile_cols] = [g.gemm_tile[0].max(1) as f64, g.gemm_tile[1].max(1) as f64];
        let work = match *class {
            KernelClass::Gemm { batch, m, n, k } => {
                if batch * m * n * k <= 0.0 {
                    return g.kernel_launch;
                }
                let tiles = batch * (m / tile_rows).ceil() * (n / tile_cols).ceil();
                let splits = if tiles < sms { (sms / tiles).floor().min((k / SPLIT_K_MIN).floor()).max(1.0) } else { 1.0 };
                let waves = (tiles * splits / sms).ceil();
                let tile_flops = 2.0 * tile_rows * tile_cols * (k / splits + g.gemm_k_overhead);
                waves * tile_flops / (peak * g.gemm_efficiency / sms)
            }
            KernelClass::Attention { batch_heads, queries, keys, head_dim, causal, products, tensor_cores } => {
                let peak = if bf16 && tensor_cores { g.bf16_flops } else { g.fp32_flops };
                let blocks = batch_heads * (queries / tile_rows).ceil();
                // A causal block of query rows sees the keys before it: half of them on
                // average, plus its own diagonal block.
                let visible = if causal { ((keys + tile_rows) / 2.0).min(keys) } else { keys };
                let waves = (blocks / sms).ceil();
                let block_flops = 2.0 * products * tile_rows.min(queries) * visible * head_dim;
                waves * block_flops / (peak * g.attention_efficiency / sms)
            }
            KernelClass::Memory => (flops + g.special_cost * cost.special) / (g.fp32_flops * g.vector_efficiency),
        };
        g.kernel_launch + work.max(memory)
    }
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster::preset("h100-sxm").expect("the h100-sxm preset exists")
    }
}

/// The fewest members a group has in any node it spans, for a group over the axes `placed`
/// (extent, whether the group's), innermost first, laid out in row-major order from the
/// innermost over nodes of `gpus_per_node` GPUs, every group alike: the network cards the
/// group's collectives drive at once in its emptiest node.
fn fewest_members_per_node(placed: &[(usize, bool)], gpus_per_node: usize) -> usize {
    // The axes wholly inside a node, and the one cut by the node's edge: when the node holds
    // whole blocks of the axes inside it and an equal run of the cut one, every node holds
    // as many members of each group.
    let (mut inside, mut count) = (1usize, 1usize);
    for &(extent, member) in placed {
        if inside.saturating_mul(extent) <= gpus_per_node {
            inside *= extent;
            if member {
                count *= extent;
            }
            continue;
        }
        if gpus_per_node % inside == 0 && extent % (gpus_per_node / inside) == 0 {
            return if member { count * (gpus_per_node / inside) } else { count };
        }
        break;
    }
    // Uneven: count the members of each group in each node (a small span), or assume one.
    let span = placed.iter().map(|&(e, _)| e).fold(1, usize::saturating_mul);
    if span > 1 << 14 {
        return 1;
    }
    let mut counts: std::collections::HashMap<(usize, usize), usize> = std::collections::HashMap::new();
    for rank in 0..span {
        // The group: the rank's position along the axes that are not the group's.
        let (mut rest, mut group, mut stride) = (rank, 0, 1);
        for &(extent, member) in placed {
            if !member {
                group += (rest % extent) * stride;
                stride *= extent;
            }
            rest /= extent;
        }
        *counts.entry((group, rank / gpus_per_node)).or_default() += 1;
    }
    counts.values().copied().min().unwrap_or(1)
}
