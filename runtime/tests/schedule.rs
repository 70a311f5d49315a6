//! Pipeline schedules: bubbles and memory computed from the schedules themselves agree with
//! the published formulas (Narayanan et al. 2021; Qi et al. 2023), and invalid schedules are
//! caught.

use shardc_runtime::schedule::{generate, simulate, simulate_shared, simulate_with, svg, Costs, Item, Kind, Schedule, ScheduleError, Work};

const UNIT: Costs = Costs { f: 1.0, b: 1.0, w: 1.0 };

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn gpipe_and_1f1b_bubbles_are_p_minus_1_over_m_plus_p_minus_1() {
    for kind in [Kind::Gpipe, Kind::OneFOneB] {
        for p in 1..=6 {
            for m in [1, 2, 4, 8, 16] {
                let timeline = simulate(&generate(kind, p, m, 1).unwrap(), UNIT).unwrap();
                let expected = (p - 1) as f64 / (m + p - 1) as f64;
                assert!(close(timeline.bubble, expected), "{kind:?} p={p} m={m}: {} vs {expected}", timeline.bubble);
            }
        }
    }
}

#[test]
fn interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1() {
    for p in [2, 4] {
        for v in [2, 3] {
            for m in [p, 2 * p, 4 * p] {
                // A chunk is 1/v of a stage's layers.
                let costs = Costs { f: 1.0 / v as f64, b: 1.0 / v as f64, w: 0.0 };
                let timeline = simulate(&generate(Kind::Interleaved, p, m, v).unwrap(), costs).unwrap();
                let expected = (p - 1) as f64 / (v * m + p - 1) as f64;
                assert!((timeline.bubble - expected).abs() < 1e-9, "p={p} v={v} m={m}: {} vs {expected}", timeline.bubble);
            }
        }
    }
}

#[test]
fn zero_bubble_beats_1f1b() {
    for (p, m) in [(2, 4), (4, 8), (4, 16), (8, 16)] {
        // 1F1B's backward is ZB's B plus W.
        let one = simulate(&generate(Kind::OneFOneB, p, m, 1).unwrap(), Costs { f: 1.0, b: 2.0, w: 0.0 }).unwrap();
        let zb = simulate(&generate(Kind::ZeroBubble, p, m, 1).unwrap(), UNIT).unwrap();
        assert!(zb.bubble < one.bubble, "p={p} m={m}: zb {} vs 1f1b {}", zb.bubble, one.bubble);
        // ZB-H1 keeps 1F1B's memory: a micro-batch is held from its forward to its weight
        // gradient, and no rank holds more than 1F1B's first (p).
        assert_eq!(zb.peak_in_flight, vec![p; p], "p={p} m={m}");
    }
}

/// ZB-H1's idle time is (p - 1)(F + B - W) a rank (Qi et al. 2023, §2.1): a third of 1F1B's
/// when the three passes take as long, and the weight gradients only fill the tail.
#[test]
fn zero_bubble_h1_idles_p_minus_1_times_f_plus_b_minus_w() {
    for costs in [UNIT, Costs { f: 1.0, b: 1.5, w: 0.5 }, Costs { f: 2.0, b: 2.0, w: 1.0 }] {
        for (p, m) in [(2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (4, 16), (8, 16)] {
            let timeline = simulate(&generate(Kind::ZeroBubble, p, m, 1).unwrap(), costs).unwrap();
            let work = m as f64 * (costs.f + costs.b + costs.w);
            let idle = (p - 1) as f64 * (costs.f + costs.b - costs.w);
            assert!(close(timeline.makespan, work + idle), "p={p} m={m} {costs:?}: makespan {} vs {}", timeline.makespan, work + idle);
        }
    }
}

#[test]
fn one_f_one_b_holds_p_micro_batches_where_gpipe_holds_m() {
    for (p, m) in [(4, 8), (4, 16), (2, 8)] {
        let one = simulate(&generate(Kind::OneFOneB, p, m, 1).unwrap(), UNIT).unwrap();
        let gpipe = simulate(&generate(Kind::Gpipe, p, m, 1).unwrap(), UNIT).unwrap();
        assert_eq!(one.peak_in_flight[0], p);
        assert!(one.peak_in_flight.iter().all(|&n| n <= p));
        assert_eq!(gpipe.peak_in_flight[0], m);
    }
}

#[test]
fn invalid_schedules_are_caught() {
    // Rank 1 wants the backward of micro-batch 0 before running its forward: it waits on
    // itself.
    let f = |i| Item { work: Work::F, microbatch: i, chunk: 0 };
    let b = |i| Item { work: Work::B, microbatch: i, chunk: 0 };
    let bad = Schedule { kind: Kind::OneFOneB, stages: 2, microbatches: 1, chunks: 1, ranks: vec![vec![f(0), b(0)], vec![b(0), f(0)]] };
    assert!(matches!(simulate(&bad, UNIT), Err(ScheduleError::Deadlock(_))));
    assert!(matches!(simulate_shared(&bad, |_, _| 1.0, |_| 0.0, 1.0, 1.0), Err(ScheduleError::Deadlock(_))));
    let good = generate(Kind::OneFOneB, 2, 2, 1).unwrap();
    assert!(matches!(simulate_shared(&good, |_, _| f64::INFINITY, |_| 0.0, 1.0, 1.0), Err(ScheduleError::Invalid(_))));
    assert!(simulate_shared(&good, |_, _| f64::NAN, |_| 0.0, 1.0, 1.0).is_ok_and(|t| t.makespan == 0.0), "a NaN cost counts as none");
    let missing = Schedule { kind: Kind::OneFOneB, stages: 2, microbatches: 1, chunks: 1, ranks: vec![vec![f(0), b(0)], vec![f(0)]] };
    assert!(matches!(simulate(&missing, UNIT), Err(ScheduleError::Items { rank: 1, .. })));
    assert!(generate(Kind::Interleaved, 4, 6, 2).is_err());
}

/// Ranks sharing one host's cores: a rank computing alone has the host to itself, ranks
/// computing at once split it (each program standing for `replicas` ranks), so with no
/// contention the makespan is every rank's work in turn whenever some rank always computes.
#[test]
fn ranks_sharing_a_host_split_it_and_a_rank_alone_has_it_all() {
    for (kind, p, m) in [(Kind::Gpipe, 2, 4), (Kind::OneFOneB, 2, 4), (Kind::OneFOneB, 4, 8), (Kind::ZeroBubble, 3, 6)] {
        let schedule = generate(kind, p, m, 1).unwrap();
        let cost = |rank: usize, item: &Item| (1 + rank) as f64 * if item.work == Work::F { 1.0 } else { 2.0 };
        let tail = |rank: usize| 0.5 * (1 + rank) as f64;
        let work: f64 = schedule.ranks.iter().enumerate().map(|(r, items)| items.iter().map(|i| cost(r, i)).sum::<f64>() + tail(r)).sum();
        // A forward chain from the first stage to the last and back: some rank always computes.
        let shared = simulate_shared(&schedule, cost, tail, 1.0, 1.0).unwrap();
        assert!((shared.makespan - work).abs() < 1e-9 * work, "{kind:?} p={p}: {} vs {work}", shared.makespan);
        // Each program standing for two ranks: half the speed throughout.
        let doubled = simulate_shared(&schedule, cost, tail, 2.0, 1.0).unwrap();
        assert!((doubled.makespan - 2.0 * work).abs() < 1e-9 * work, "{kind:?} p={p}: {}", doubled.makespan);
        // Contention only slows the stretches where ranks overlap.
        let contended = simulate_shared(&schedule, cost, tail, 1.0, 1.5).unwrap();
        assert!(contended.makespan > work && contended.makespan < 1.5 * work, "{kind:?} p={p}: {}", contended.makespan);
        // Dependencies hold: an item starts after what it needs, and every item ran once.
        assert_eq!(shared.ranks.iter().map(Vec::len).sum::<usize>(), schedule.ranks.iter().map(Vec::len).sum::<usize>());
        let dedicated = simulate_with(&schedule, cost).unwrap();
        assert!(dedicated.makespan <= shared.makespan, "a host of its own per rank is never slower");
    }
    // One rank alone: its items and tail back to back, as on a device of its own.
    let alone = generate(Kind::OneFOneB, 1, 3, 1).unwrap();
    let shared = simulate_shared(&alone, |_, _| 1.0, |_| 2.0, 1.0, 3.0).unwrap();
    assert!((shared.makespan - 8.0).abs() < 1e-12, "{}", shared.makespan);
}

/// A rank running its tail (the optimizer step) is busy, not in a bubble: a rank alone has
/// none, and the shared bubble is the idle time of items and tails.
#[test]
fn a_shared_hosts_bubble_does_not_count_the_tails() {
    let alone = generate(Kind::OneFOneB, 1, 3, 1).unwrap();
    let shared = simulate_shared(&alone, |_, _| 1.0, |_| 2.0, 1.0, 1.0).unwrap();
    assert!(shared.bubble.abs() < 1e-12, "one rank computing throughout: bubble {}", shared.bubble);
    // Two ranks: idle rank-time is the makespan times the ranks less what each computed
    // (items, stretched while shared, and tails).
    let schedule = generate(Kind::OneFOneB, 2, 4, 1).unwrap();
    let shared = simulate_shared(&schedule, |_, _| 1.0, |_| 3.0, 1.0, 1.0).unwrap();
    let items: f64 = shared.ranks.iter().flatten().map(|(_, s, e)| e - s).sum();
    assert!(shared.bubble < 1.0 - items / (2.0 * shared.makespan) - 1e-9, "tails counted as idle: bubble {}", shared.bubble);
    assert!(shared.bubble >= 0.0);
}

#[test]
fn one_f_one_b_picture() {
    let schedule = generate(Kind::OneFOneB, 4, 8, 1).unwrap();
    insta::assert_snapshot!(svg(&schedule, &simulate(&schedule, UNIT).unwrap()));
}

