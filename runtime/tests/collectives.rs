//! The CPU collectives: correct results for every algorithm and group size, identical
//! results on every rank, the bytes the ring formulas predict, and a clean error instead of
//! a hang when a rank does not take part.

use std::time::{Duration, Instant};

use shardc_runtime::collectives::{world, Algorithm, CollectiveKind, CommError, Communicator, MeshShape, ReduceOp};

/// Runs `f` on every rank of a world of `n`, one thread each; returns the results by rank.
fn run<R: Send>(n: usize, timeout: Duration, f: impl Fn(&mut Communicator) -> R + Sync) -> Vec<R> {
    let comms = world(n, timeout);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms.into_iter().map(|mut c| s.spawn(move || f(&mut c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn value(rank: usize, i: usize) -> i32 {
    ((rank * 31 + i * 7) % 23) as i32 - 11
}

const T: Duration = Duration::from_secs(10);

#[test]
fn all_reduce_ring_and_tree() {
    for n in 1..=8 {
        for len in [0, 1, 5, 13, 100] {
            for algorithm in [Algorithm::Ring, Algorithm::Tree] {
                for op in [ReduceOp::Sum, ReduceOp::Max] {
                    let all: Vec<usize> = (0..n).collect();
                    let results = run(n, T, |c| {
                        let mut data: Vec<i32> = (0..len).map(|i| value(c.rank(), i)).collect();
                        c.all_reduce(&all, &mut data, op, algorithm).unwrap();
                        data
                    });
                    let expected: Vec<i32> = (0..len)
                        .map(|i| match op {
                            ReduceOp::Sum => (0..n).map(|r| value(r, i)).sum(),
                            ReduceOp::Max => (0..n).map(|r| value(r, i)).max().unwrap(),
                        })
                        .collect();
                    for r in &results {
                        assert_eq!(*r, expected, "n={n} len={len} {algorithm:?} {op:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn float_all_reduce_is_bit_identical_on_every_rank_and_run() {
    let n = 5;
    let all: Vec<usize> = (0..n).collect();
    let once = || {
        run(n, T, |c| {
            let mut data: Vec<f32> = (0..1000).map(|i| ((c.rank() * 1000 + i) as f32 * 0.37).sin() * 1e3).collect();
            c.all_reduce(&all, &mut data, ReduceOp::Sum, Algorithm::Ring).unwrap();
            data.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
        })
    };
    let a = once();
    assert!(a.iter().all(|r| *r == a[0]));
    assert_eq!(a, once());
}

#[test]
fn all_gather_and_reduce_scatter() {
    for n in 1..=5 {
        let all: Vec<usize> = (0..n).collect();
        let gathered = run(n, T, |c| {
            let local: Vec<i32> = (0..3).map(|i| value(c.rank(), i)).collect();
            let mut out = vec![0; 3 * n];
            c.all_gather(&all, &local, &mut out).unwrap();
            out
        });
        let expected: Vec<i32> = (0..n).flat_map(|r| (0..3).map(move |i| value(r, i))).collect();
        assert!(gathered.iter().all(|g| *g == expected), "n={n}");

        for len in [n, 7, 11] {
            let parts = run(n, T, |c| {
                let data: Vec<i32> = (0..len).map(|i| value(c.rank(), i)).collect();
                let (start, end) = (c.rank() * (len / n) + c.rank().min(len % n), (c.rank() + 1) * (len / n) + (c.rank() + 1).min(len % n));
                let mut out = vec![0; end - start];
                c.reduce_scatter(&all, &data, &mut out, ReduceOp::Sum).unwrap();
                out
            });
            let sums: Vec<i32> = (0..len).map(|i| (0..n).map(|r| value(r, i)).sum()).collect();
            assert_eq!(parts.concat(), sums, "n={n} len={len}");
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    for n in 1..=6 {
        for root in 0..n {
            let all: Vec<usize> = (0..n).collect();
            let results = run(n, T, |c| {
                let mut data: Vec<i32> = (0..4).map(|i| value(c.rank(), i)).collect();
                c.broadcast(&all, &mut data, root).unwrap();
                data
            });
            let expected: Vec<i32> = (0..4).map(|i| value(root, i)).collect();
            assert!(results.iter().all(|r| *r == expected), "n={n} root={root}");
        }
    }
}

#[test]
fn groups_of_a_mesh_run_interleaved_without_mixing() {
    // dp=2 x tp=2 x pp=2: every rank all-reduces over tp, then over dp, then over both,
    // then sends to its pipeline peer.
    let mesh = MeshShape(vec![2, 2, 2]);
    let results = run(8, T, |c| {
        let rank = c.rank();
        let mut tp = vec![rank as i32];
        c.all_reduce(&mesh.group(rank, &[1]), &mut tp, ReduceOp::Sum, Algorithm::Ring).unwrap();
        let mut dp = vec![rank as i32];
        c.all_reduce(&mesh.group(rank, &[0]), &mut dp, ReduceOp::Sum, Algorithm::Tree).unwrap();
        let mut both = vec![1];
        c.all_reduce(&mesh.group(rank, &[0, 1]), &mut both, ReduceOp::Sum, Algorithm::Ring).unwrap();
        let coords = mesh.coords(rank);
        let peer = mesh.rank(&[coords[0], coords[1], 1 - coords[2]]);
        let mut from_peer = [0i32];
        if coords[2] == 0 {
            c.send(peer, 7, &[rank as i32]).unwrap();
            c.recv(peer, 8, &mut from_peer).unwrap();
        } else {
            c.recv(peer, 7, &mut from_peer).unwrap();
            c.send(peer, 8, &[rank as i32]).unwrap();
        }
        (tp[0], dp[0], both[0], from_peer[0], peer)
    });
    for (rank, (tp, dp, both, from_peer, peer)) in results.into_iter().enumerate() {
        let expect = |axes: &[usize]| mesh.group(rank, axes).iter().map(|&r| r as i32).sum::<i32>();
        assert_eq!(tp, expect(&[1]));
        assert_eq!(dp, expect(&[0]));
        assert_eq!(both, 4);
        assert_eq!(from_peer, peer as i32);
    }
}

#[test]
fn bytes_sent_match_the_ring_formulas() {
    // NCCL's bus-bandwidth convention: all-reduce moves 2 (n-1)/n of the buffer per rank,
    // all-gather and reduce-scatter (n-1)/n of the full buffer.
    let (n, len) = (4usize, 1024usize);
    let all: Vec<usize> = (0..n).collect();
    let counters = run(n, T, |c| {
        let mut data = vec![1.0f32; len];
        c.all_reduce(&all, &mut data, ReduceOp::Sum, Algorithm::Ring).unwrap();
        let mut gathered = vec![0.0f32; len];
        c.all_gather(&all, &data[..len / n], &mut gathered).unwrap();
        let mut part = vec![0.0f32; len / n];
        c.reduce_scatter(&all, &data, &mut part, ReduceOp::Sum).unwrap();
        c.bytes_sent().clone()
    });
    let bytes = (len * 4) as u64;
    for sent in counters {
        assert_eq!(sent[&CollectiveKind::AllReduce], 2 * (n as u64 - 1) * bytes / n as u64);
        assert_eq!(sent[&CollectiveKind::AllGather], (n as u64 - 1) * bytes / n as u64);
        assert_eq!(sent[&CollectiveKind::ReduceScatter], (n as u64 - 1) * bytes / n as u64);
    }
}

#[test]
fn a_rank_that_exits_ends_the_collective_and_is_named() {
    let start = Instant::now();
    let results = run(3, Duration::from_millis(300), |c| {
        if c.rank() == 2 {
            return None; // leaves: its end of every channel is dropped
        }
        let mut data = vec![1.0f32; 8];
        Some(c.all_reduce(&[0, 1, 2], &mut data, ReduceOp::Sum, Algorithm::Ring))
    });
    assert!(start.elapsed() < Duration::from_secs(3));
    // Every waiting rank fails; the rank waiting on the one that left names it. (A rank
    // waiting on a rank that is itself stuck names its own peer: naming the root cause
    // everywhere needs an abort broadcast, which fault handling adds.)
    let errors: Vec<CommError> = results.into_iter().flatten().map(|r| r.unwrap_err()).collect();
    assert_eq!(errors.len(), 2);
    assert!(
        errors.iter().any(|e| matches!(e, CommError::Timeout { peer: 2, .. } | CommError::PeerGone { peer: 2, .. })),
        "{errors:?}"
    );
}

#[test]
fn a_rank_that_stalls_ends_the_collective_within_the_timeout() {
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let results = run(3, timeout, |c| {
        if c.rank() == 2 {
            std::thread::sleep(timeout * 3); // alive, but never calls the collective
            return None;
        }
        let mut data = vec![1.0f32; 8];
        Some(c.all_reduce(&[0, 1, 2], &mut data, ReduceOp::Sum, Algorithm::Ring))
    });
    assert!(start.elapsed() < timeout * 3 + Duration::from_secs(2));
    let errors: Vec<CommError> = results.into_iter().flatten().map(|r| r.unwrap_err()).collect();
    assert_eq!(errors.len(), 2);
    assert!(errors.iter().all(|e| matches!(e, CommError::Timeout { .. })), "{errors:?}");
    assert!(errors.iter().any(|e| matches!(e, CommError::Timeout { peer: 2, .. })), "{errors:?}");
}

#[test]
fn mesh_groups_are_row_major() {
    let mesh = MeshShape(vec![2, 4, 1]);
    assert_eq!(mesh.coords(5), vec![1, 1, 0]);
    assert_eq!(mesh.rank(&[1, 1, 0]), 5);
    assert_eq!(mesh.group(5, &[1]), vec![4, 5, 6, 7]);
    assert_eq!(mesh.group(5, &[0]), vec![1, 5]);
    assert_eq!(mesh.group(5, &[0, 1]), vec![0, 1, 2, 3, 4, 5, 6, 7]);
}

/// Ranks of a (dp, tp, pp) mesh are numbered as Megatron-LM numbers them: tensor-parallel
/// ranks adjacent, then data-parallel, then pipeline; so a tp group is a run of consecutive
/// ranks (inside a node under torchrun), and every rank has one place.
#[test]
fn ranks_are_numbered_tensor_parallel_fastest_then_data_then_pipeline() {
    let (dp, tp, pp) = (3, 2, 4);
    let mesh = MeshShape(vec![dp, tp, pp]);
    let mut seen = vec![false; mesh.ranks()];
    for p in 0..pp {
        for d in 0..dp {
            for t in 0..tp {
                let rank = mesh.rank(&[d, t, p]);
                assert_eq!(rank, t + tp * (d + dp * p), "dp {d} tp {t} pp {p}");
                assert_eq!(mesh.coords(rank), vec![d, t, p]);
                assert!(!std::mem::replace(&mut seen[rank], true));
            }
        }
    }
    // A tp group is consecutive; a pipeline's stages are tp x dp apart.
    assert_eq!(mesh.group(5, &[1]), vec![4, 5]);
    assert_eq!(mesh.group(1, &[2]), vec![1, 7, 13, 19]);
    // Checkpoints of format 1 numbered the files row-major (pp fastest).
    assert_eq!(mesh.row_major_coords(1), vec![0, 0, 1]);
    assert_eq!(mesh.rank(&mesh.row_major_coords(4)), mesh.rank(&[0, 1, 0]));
    // Grids other than (dp, tp, pp) stay row-major.
    let flat = MeshShape(vec![2, 3]);
    assert_eq!(flat.coords(1), vec![0, 1]);
}
