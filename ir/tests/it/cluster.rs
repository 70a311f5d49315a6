//! The cluster model: collective times, link placement, TOML overrides.

use shardc_ir::cluster::{Cluster, Collective, Link};
use shardc_ir::ops::{Cost, KernelClass};


#[test]
fn ring_all_reduce_moves_twice_the_share_and_gathers_once() {
    let c = Cluster::preset("a100-80g").unwrap();
    let grid = [1, 4, 1];
    let bytes = 1e9;
    let link = c.link(&grid, &[1]);
    assert_eq!(link, c.intra_node, "tp=4 fits in a node");
    let ar = c.time(Collective::AllReduce, bytes, &grid, &[1]);
    let ag = c.time(Collective::AllGather, bytes, &grid, &[1]);
    let rs = c.time(Collective::ReduceScatter, bytes, &grid, &[1]);
    assert!((ar - (c.launch + 6.0 * link.alpha + 1.5 * bytes * link.beta())).abs() < 1e-12);
    assert!((ag + rs - ar - c.launch).abs() < 1e-12, "all-reduce = reduce-scatter + all-gather in the ring model, but one launch");
    // A tiny message is latency-bound: the tree is cheaper.
    let small = c.time(Collective::AllReduce, 8.0, &[1, 64, 1], &[1]);
    assert!(small < c.launch + 2.0 * 63.0 * c.inter_node.alpha);
    assert_eq!(c.time(Collective::AllReduce, bytes, &[1, 1, 1], &[1]), 0.0, "an axis of size 1 costs nothing");
}

#[test]
fn axes_outside_a_node_use_the_network() {
    let c = Cluster::preset("h100-sxm").unwrap();
    // tp=8 fills the node; dp is placed outside it.
    let grid = [4, 8, 1];
    assert_eq!(c.link(&grid, &[1]), c.intra_node);
    assert_eq!(c.link(&grid, &[0]), c.inter_node);
    // dp=2 inside a node when tp=4 leaves room.
    assert_eq!(c.link(&[2, 4, 1], &[0]), c.intra_node);
}

/// A group spanning nodes with k members in each drives k network cards at once (one per
/// GPU), up to what NVLink carries: 8 HDR NICs of 24 GB/s give DGX-A100 nodes about 192 GB/s
/// of all-reduce bus bandwidth (nccl-tests), one NIC per node's member gives 24.
#[test]
fn a_group_spanning_nodes_uses_the_network_cards_of_its_members_in_each_node() {
    let a100 = Cluster::preset("a100-80g").unwrap();
    let nic = a100.inter_node.bandwidth;
    // dp=48 alone: 8 members per node.
    assert!((a100.link(&[48, 1, 1], &[0]).bandwidth - 8.0 * nic).abs() < 1.0);
    // tp=2 inside, dp=48 outside: 4 members of a dp group per node.
    assert!((a100.link(&[48, 2, 1], &[0]).bandwidth - 4.0 * nic).abs() < 1.0);
    // tp=8 fills the node: one member per node, one card.
    assert_eq!(a100.link(&[48, 8, 1], &[0]), a100.inter_node);
    // Never more than NVLink inside the node carries (H100: 8 x 47 > 370 GB/s).
    let h100 = Cluster::preset("h100-sxm").unwrap();
    assert_eq!(h100.link(&[16, 1, 1], &[0]).bandwidth, h100.intra_node.bandwidth);
    // Latency stays the network's.
    assert_eq!(h100.link(&[16, 1, 1], &[0]).alpha, h100.inter_node.alpha);
    // A 1 GB all-reduce over 6 DGX-A100 nodes takes about 2 (47/48) GB / 192 GB/s.
    let t = a100.time(Collective::AllReduce, 1e9, &[48, 1, 1], &[0]);
    assert!((t / (2.0 * 47.0 / 48.0 * 1e9 / 192e9) - 1.0).abs() < 0.05, "{t}");
}

#[test]
fn toml_overrides_presets_and_names_bad_fields() {
    let c = Cluster::from_toml("preset = \"a100-40g\"\ngpus_per_node = 4\n[inter_node]\nalpha = 2e-5\nbandwidth = 12.5e9\n").unwrap();
    assert_eq!(c.gpu.name, "a100-40g");
    assert_eq!(c.gpus_per_node, 4);
    assert_eq!(c.inter_node, Link { alpha: 2e-5, bandwidth: 12.5e9 });
    assert!(Cluster::from_toml("preset = \"tpu\"").unwrap_err().contains("unknown GPU `tpu`"));
    assert!(Cluster::from_toml("[intra_node]\nlatency = 1").unwrap_err().contains("intra_node.latency"));
    assert!(Cluster::from_toml("gpus_per_node = -1").unwrap_err().contains("positive"));
}

fn cost(flops: f64, bytes: f64) -> Cost {
    Cost { flops, bytes, special: 0.0 }
}

fn gemm(m: f64, n: f64, k: f64) -> KernelClass {
    KernelClass::Gemm { batch: 1.0, m, n, k }
}

/// A cluster whose GEMM times are pure tile arithmetic: no launch, no memory bound.
fn tiles_only() -> Cluster {
    let mut c = Cluster::preset("h100-sxm").unwrap();
    c.gpu.kernel_launch = 0.0;
    c.gpu.memory_bandwidth = 1e30;
    c
}

#[test]
fn gemms_pay_for_whole_tiles_and_whole_waves() {
    let c = tiles_only();
    let g = &c.gpu;
    let t = |m: f64, n: f64, k: f64| c.kernel_time(&gemm(m, n, k), &cost(2.0 * m * n * k, 0.0), true);
    // One wave of whole tiles: the main loop at the efficiency, plus the per-tile overhead.
    let (rows, cols) = (g.gemm_tile[0] as f64, g.gemm_tile[1] as f64);
    let full = g.sms as f64 * rows;
    let expected = 2.0 * rows * cols * (4096.0 + g.gemm_k_overhead) / (g.bf16_flops * g.gemm_efficiency / g.sms as f64);
    assert!((t(full, cols, 4096.0) / expected - 1.0).abs() < 1e-12);
    // Tile quantization: one row more than whole tiles costs a whole extra tile row (here a
    // second wave).
    assert!((t(full + 1.0, cols, 4096.0) / t(full, cols, 4096.0) - 2.0).abs() < 1e-12);
    assert_eq!(t(full - 5.0, cols, 4096.0), t(full, cols, 4096.0), "a partial tile costs a whole one");
    // Wave quantization: sms + 1 tiles take two waves, the same as 2 sms tiles.
    assert_eq!(t(full + rows, cols, 4096.0), t(2.0 * full, cols, 4096.0));
    // Thin products (short K) run far below peak: the overhead is a fixed share per tile.
    let efficiency = |k: f64| 2.0 * (4.0 * full) * (4.0 * cols) * k / t(4.0 * full, 4.0 * cols, k) / g.bf16_flops;
    assert!(efficiency(128.0) < 0.55 * efficiency(16384.0), "K = 128 at {:.2} vs K = 16384 at {:.2}", efficiency(128.0), efficiency(16384.0));
    assert!(efficiency(16384.0) <= g.gemm_efficiency);
}

#[test]
fn few_tiles_split_the_contracted_dimension() {
    let c = tiles_only();
    // A weight gradient of a small matrix over many tokens: 4 tiles cannot fill 132 SMs,
    // so K is split, and the time is far below the unsplit four-tile wave.
    let (m, n, k) = (256.0, 256.0, 65536.0);
    let split = c.kernel_time(&gemm(m, n, k), &cost(2.0 * m * n * k, 0.0), true);
    let g = &c.gpu;
    let unsplit = 2.0 * 128.0 * 128.0 * (k + g.gemm_k_overhead) / (g.bf16_flops * g.gemm_efficiency / g.sms as f64);
    assert!(split < unsplit / 20.0, "split {split} vs unsplit {unsplit}");
}

#[test]
fn causal_flash_attention_does_about_half_the_work_and_memory_kernels_follow_the_roofline() {
    let c = tiles_only();
    let attention = |causal: bool| KernelClass::Attention { batch_heads: 32.0 * 16.0, queries: 4096.0, keys: 4096.0, head_dim: 128.0, causal, products: 2.0, tensor_cores: true };
    let (full, causal) = (c.kernel_time(&attention(false), &cost(0.0, 0.0), true), c.kernel_time(&attention(true), &cost(0.0, 0.0), true));
    let ratio = causal / full;
    assert!((ratio - (4096.0 + 128.0) / 2.0 / 4096.0).abs() < 1e-12, "causal / full = {ratio}");
    // The backward's five products cost 2.5 forwards.
    let backward = KernelClass::Attention { batch_heads: 32.0 * 16.0, queries: 4096.0, keys: 4096.0, head_dim: 128.0, causal: true, products: 5.0, tensor_cores: true };
    assert!((c.kernel_time(&backward, &cost(0.0, 0.0), true) / causal - 2.5).abs() < 1e-12);
    // bf16 storage whose kernels have no tensor-core path (an odd head dim) runs at the fp32 peak.
    let scalar = KernelClass::Attention { batch_heads: 32.0 * 16.0, queries: 4096.0, keys: 4096.0, head_dim: 128.0, causal: true, products: 2.0, tensor_cores: false };
    let ratio = (c.kernel_time(&scalar, &cost(0.0, 0.0), true) - c.gpu.kernel_launch) / (causal - c.gpu.kernel_launch);
    assert!((ratio - c.gpu.bf16_flops / c.gpu.fp32_flops).abs() < 1e-9, "scalar / tensor cores = {ratio}");
    // Memory-bound: bytes at the achievable bandwidth, plus the launch.
    let h = Cluster::preset("h100-sxm").unwrap();
    let bytes = 1e9;
    let t = h.kernel_time(&KernelClass::Memory, &cost(1e6, bytes), true);
    assert!((t - h.gpu.kernel_launch - bytes / (h.gpu.memory_bandwidth * h.gpu.memory_efficiency)).abs() < 1e-15);
    // Special functions cost special_cost operations each.
    let special = Cost { flops: 1e9, bytes: 0.0, special: 1e9 };
    let t = h.kernel_time(&KernelClass::Memory, &special, false) - h.gpu.kernel_launch;
    assert!((t - (1.0 + h.gpu.special_cost) * 1e9 / (h.gpu.fp32_flops * h.gpu.vector_efficiency)).abs() < 1e-12);
    // A tiny kernel costs its launch.
    assert!((h.kernel_time(&KernelClass::Memory, &cost(1.0, 4.0), true) / h.gpu.kernel_launch - 1.0).abs() < 1e-3);
}

#[test]
fn cluster_toml_round_trips_and_refuses_the_old_efficiency() {
    let mut c = Cluster::preset("a100-80g").unwrap();
    c.gpu.name = "cpu".into();
    c.gpu.sms = 2;
    c.gpu.gemm_tile = [16, 32];
    c.gpu.gemm_k_overhead = 0.0;
    c.gpu.fp32_flops = 1.234567891e11;
    c.shared_host = true;
    c.shared_slowdown = 1.0625;
    c.shared_pool_slowdown = 1.09;
    c.intra_node = Link { alpha: 3.3e-6, bandwidth: 5.5e9 };
    let text = c.to_toml();
    assert_eq!(Cluster::from_toml(&text).unwrap(), c, "{text}");
    // Ranks are placed tp innermost, then cp, ep, dp, pp: no other order describes a run.
    let other = Cluster::from_toml("placement = [\"dp\", \"tp\", \"pp\"]").unwrap_err();
    assert!(other.contains("placement: shardc places ranks as Megatron-Core does"), "{other}");
    let old = Cluster::from_toml("compute_efficiency = 0.7").unwrap_err();
    assert!(old.contains("gemm_efficiency"), "{old}");
    assert!(Cluster::from_toml("[gpu]\ngemm_efficiency = 1.5").unwrap_err().contains("at most 1"));
    assert!(Cluster::from_toml("[gpu]\ngemm_tile = [128]").unwrap_err().contains("gpu.gemm_tile"));
    assert!(Cluster::from_toml("[gpu]\nsms = 0").unwrap_err().contains("gpu.sms"));
    assert!(Cluster::from_toml("shared_pool_slowdown = 0.5").unwrap_err().contains("shared_pool_slowdown: at least 1"));
    assert!(Cluster::from_toml("shared_slowdown = 1e308").unwrap_err().contains("shared_slowdown: at most 64"));
    assert!(Cluster::from_toml("[gpu]\nwarp = 32").unwrap_err().contains("gpu.warp: unknown field"));
}

/// The network cards a group drives are those of its members in the node that holds the
/// fewest of them: a group that does not fill its nodes evenly is as fast as its emptiest
/// node.
#[test]
fn a_group_filling_its_nodes_unevenly_is_priced_by_its_emptiest_node() {
    let a100 = Cluster::preset("a100-80g").unwrap();
    let nic = a100.inter_node.bandwidth;
    // dp=12 over nodes of 8: the second node holds 4 members.
    let link = a100.link(&[12, 1, 1], &[0]);
    assert!((link.bandwidth - 4.0 * nic).abs() < 1.0, "{} GB/s, 4 NICs are {} GB/s", link.bandwidth / 1e9, 4.0 * nic / 1e9);
    // tp=3 inside, dp=4: the dp group of tp rank 0 is ranks 0, 3, 6 (node 0) and 9 (node 1).
    let link = a100.link(&[4, 3, 1], &[0]);
    assert!((link.bandwidth - nic).abs() < 1.0, "{} GB/s, one NIC is {} GB/s", link.bandwidth / 1e9, nic / 1e9);
    // dp=3 on nodes of 2.
    let mut two = a100.clone();
    two.gpus_per_node = 2;
    assert!((two.link(&[3, 1, 1], &[0]).bandwidth - nic).abs() < 1.0);
    // Even fills keep their cards: tp=2 inside dp=48 (4 per node), dp=16 (8 per node).
    assert!((a100.link(&[48, 2, 1], &[0]).bandwidth - 4.0 * nic).abs() < 1.0);
    assert!((a100.link(&[16, 1, 1], &[0]).bandwidth - 8.0 * nic).abs() < 1.0);
    // One GPU per node: one card.
    let mut one = a100.clone();
    one.gpus_per_node = 1;
    assert_eq!(one.link(&[4, 2, 2], &[0, 1, 2]), one.inter_node);
}

/// A pipeline send is one GPU's message to one GPU: it crosses nodes on one network card,
/// however many stages the node holds.
#[test]
fn a_pipeline_send_between_nodes_uses_one_network_card() {
    let a100 = Cluster::preset("a100-80g").unwrap();
    let bytes = 1e8;
    let t = a100.time(Collective::Send, bytes, &[1, 1, 16], &[2]);
    let one_card = a100.launch + a100.inter_node.alpha + bytes / a100.inter_node.bandwidth;
    assert!((t / one_card - 1.0).abs() < 1e-9, "{t} s, one card takes {one_card} s");
    // Inside a node: NVLink.
    let t = a100.time(Collective::Send, bytes, &[1, 1, 8], &[2]);
    assert!((t / (a100.launch + a100.intra_node.alpha + bytes / a100.intra_node.bandwidth) - 1.0).abs() < 1e-9);
}

/// Meshes too large to exist are priced without overflowing (debug builds check).
#[test]
fn huge_meshes_do_not_overflow_the_link_arithmetic() {
    let c = Cluster::preset("h100-sxm").unwrap();
    for grid in [[1i64 << 21, 1 << 21, 1 << 21], [i64::MAX, i64::MAX, 2], [1 << 40, 1 << 40, 1]] {
        for axes in [&[0usize][..], &[0, 1], &[0, 1, 2], &[2]] {
            let link = c.link(&grid, axes);
            assert!(link.bandwidth > 0.0 && link.bandwidth.is_finite());
            assert!(c.time(Collective::AllReduce, 1e9, &grid, axes).is_finite());
        }
    }
}

/// The cards a group drives, against counting them: every small mesh, placement and group.
#[test]
fn network_cards_match_a_count_of_members_per_node() {
    let base = Cluster::preset("a100-80g").unwrap();
    let extents = [1i64, 2, 3, 4, 6, 8];
    let placements = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
    let groups: [&[usize]; 7] = [&[0], &[1], &[2], &[0, 1], &[0, 2], &[1, 2], &[0, 1, 2]];
    for gpus_per_node in [1usize, 2, 4, 8] {
        for placement in placements {
            let mut c = base.clone();
            c.gpus_per_node = gpus_per_node;
            c.placement = placement.to_vec();
            for &a in &extents {
                for &b in &extents {
                    for &p in &extents {
                        let grid = [a, b, p];
                        for axes in groups {
                            let outermost = axes.iter().map(|x| placement.iter().position(|y| y == x).unwrap()).max().unwrap();
                            let placed: Vec<usize> = placement[..=outermost].to_vec();
                            let span: usize = placed.iter().map(|&x| grid[x] as usize).product();
                            if span <= gpus_per_node {
                                assert_eq!(c.link(&grid, axes), c.intra_node);
                                continue;
                            }
                            // Count: ranks laid out innermost first; a group is the ranks
                            // equal off its axes.
                            let mut counts = std::collections::HashMap::new();
                            for rank in 0..span {
                                let (mut rest, mut key) = (rank, Vec::new());
                                for &x in &placed {
                                    let coord = rest % grid[x] as usize;
                                    rest /= grid[x] as usize;
                                    if !axes.contains(&x) {
                                        key.push(coord);
                                    }
                                }
                                *counts.entry((key, rank / gpus_per_node)).or_insert(0usize) += 1;
                            }
                            let fewest = *counts.values().min().unwrap();
                            let want = (fewest as f64 * c.inter_node.bandwidth).min(c.intra_node.bandwidth.max(c.inter_node.bandwidth));
                            let got = c.link(&grid, axes).bandwidth;
                            assert!((got - want).abs() < 1.0, "grid {grid:?} axes {axes:?} placement {placement:?} {gpus_per_node}/node: {fewest} cards, priced {}", got / c.inter_node.bandwidth);
                        }
                    }
                }
            }
        }
    }
}
