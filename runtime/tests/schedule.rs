//! Pipeline schedules: bubbles and memory computed from the schedules themselves agree with
//! the published formulas (Narayanan et al. 2021; Qi et al. 2023), and invalid schedules are
//! caught.

use shardc_runtime::schedule::{generate, simulate, svg, Costs, Item, Kind, Schedule, ScheduleError, Work};

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
        // ZB-H1 keeps 1F1B's memory.
        assert!(zb.peak_in_flight[0] <= p, "{:?}", zb.peak_in_flight);
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
    let missing = Schedule { kind: Kind::OneFOneB, stages: 2, microbatches: 1, chunks: 1, ranks: vec![vec![f(0), b(0)], vec![f(0)]] };
    assert!(matches!(simulate(&missing, UNIT), Err(ScheduleError::Items { rank: 1, .. })));
    assert!(generate(Kind::Interleaved, 4, 6, 2).is_err());
}

#[test]
fn one_f_one_b_picture() {
    let schedule = generate(Kind::OneFOneB, 4, 8, 1).unwrap();
    insta::assert_snapshot!(svg(&schedule, &simulate(&schedule, UNIT).unwrap()));
}
