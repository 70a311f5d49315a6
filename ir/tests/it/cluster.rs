//! The cluster model: collective times, link placement, TOML overrides.

use shardc_ir::cluster::{Cluster, Collective, Link};


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
