//! Mixture of experts (issue 21): the routing ops against independent models of their rules.

use shardc_ir::{ArgRole, AttrValue, Attrs, DType, FuncBuilder, TensorTy};

use crate::common::*;

/// Runs `moe_route` and `moe_aux_loss` on `logits [b, s, e]`; returns the gates, the choices
/// and each sequence's loss.
fn route_and_balance(logits: &[f64], (b, s, e): (i64, i64, i64), k: i64) -> (Vec<f64>, Vec<i32>, Vec<f64>) {
    let mut fb = FuncBuilder::new("route");
    let x = fb.arg("logits", TensorTy::new([b, s, e], DType::F64), ArgRole::Input);
    let route = fb.op_multi("xf.moe_route", &[x], Attrs::new().with("top_k", AttrValue::Int(k)), "route").unwrap();
    let loss = fb.op("xf.moe_aux_loss", &[x, route[1]], Attrs::new(), "aux").unwrap();
    let func = fb.finish(&[route[0], route[1], loss], &["gates".into(), "experts".into(), "aux".into()]);
    let mut exec = executor(&func);
    exec.write::<f64>("logits", logits).unwrap();
    exec.run().unwrap();
    (exec.read::<f64>("gates").unwrap().to_vec(), exec.read::<i32>("experts").unwrap().to_vec(), exec.read::<f64>("aux").unwrap().to_vec())
}

#[test]
fn load_balancing_loss_matches_its_formula() {
    let (b, s, e, k) = (3usize, 6usize, 5usize, 2usize);
    let logits = randn(4, "router", b * s * e, 1.0);
    let (gates, experts, aux) = route_and_balance(&logits, (b as i64, s as i64, e as i64), k as i64);
    for row in 0..b {
        // The formula, from scratch: top-k by sorting, softmax over all experts.
        let mut count = vec![0.0; e];
        let mut mean_prob = vec![0.0; e];
        for t in 0..s {
            let l = &logits[(row * s + t) * e..(row * s + t + 1) * e];
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&i, &j| l[j].partial_cmp(&l[i]).unwrap().then(i.cmp(&j)));
            let chosen = &order[..k];
            let got = &experts[(row * s + t) * k..(row * s + t + 1) * k];
            assert_eq!(got, &chosen.iter().map(|&c| c as i32).collect::<Vec<_>>()[..], "sequence {row} token {t}: the experts chosen");
            // Gates: the softmax over the chosen logits (the full softmax renormalised).
            let z: f64 = chosen.iter().map(|&c| l[c].exp()).sum();
            for (j, &c) in chosen.iter().enumerate() {
                assert!((gates[(row * s + t) * k + j] - l[c].exp() / z).abs() < 1e-12);
                count[c] += 1.0;
            }
            let total: f64 = l.iter().map(|v| v.exp()).sum();
            for c in 0..e {
                mean_prob[c] += l[c].exp() / total / s as f64;
            }
        }
        let expected = e as f64 / (s * k) as f64 * (0..e).map(|c| count[c] * mean_prob[c]).sum::<f64>();
        assert!((aux[row] - expected).abs() < 1e-12, "sequence {row}: loss {} vs the formula's {expected}", aux[row]);
    }
    // A uniform router balances perfectly by the loss's measure: 1 whatever the choices.
    let (_, _, aux) = route_and_balance(&vec![0.0; b * s * e], (b as i64, s as i64, e as i64), k as i64);
    assert!(aux.iter().all(|a| (a - 1.0).abs() < 1e-12), "uniform router: {aux:?}");
}

/// The slots and counts `moe_slots` gives `experts [1, s, k]` with `capacity` slots.
fn slots(experts: &[i32], s: i64, k: i64, e: i64, capacity: i64) -> (Vec<i32>, Vec<i32>) {
    let mut fb = FuncBuilder::new("slots");
    let x = fb.arg("experts", TensorTy::new([1, s, k], DType::I32), ArgRole::Input);
    // A float argument too, so that the program has an element type.
    let y = fb.arg("y", TensorTy::new([1], DType::F64), ArgRole::Input);
    let attrs = Attrs::new().with("experts", AttrValue::Int(e)).with("capacity", AttrValue::Int(capacity));
    let out = fb.op_multi("xf.moe_slots", &[x], attrs, "slots").unwrap();
    let func = fb.finish(&[out[0], out[1], y], &["slots".into(), "counts".into(), "y".into()]);
    let mut exec = executor(&func);
    exec.write::<i32>("experts", experts).unwrap();
    exec.write::<f64>("y", &[0.0]).unwrap();
    exec.run().unwrap();
    (exec.read::<i32>("slots").unwrap().to_vec(), exec.read::<i32>("counts").unwrap().to_vec())
}

#[test]
fn capacity_drops_are_deterministic_and_counted() {
    // Three tokens choose (0, 1), (1, 0), (0, 1); two slots per expert. First choices go
    // first: token 0 -> expert 0, token 1 -> expert 1, token 2 -> expert 0; then the second
    // choices: token 0 -> expert 1 (its second slot), and tokens 1 and 2 find theirs full.
    let experts = [0, 1, 1, 0, 0, 1];
    let (slot, counts) = slots(&experts, 3, 2, 2, 2);
    assert_eq!(slot, [0, 1, 0, -1, 1, -1]);
    assert_eq!(counts, [2, 2]);
    assert_eq!(slot.iter().filter(|&&s| s < 0).count(), 2, "two choices dropped");
    // The same input drops the same choices, every time.
    for _ in 0..3 {
        assert_eq!(slots(&experts, 3, 2, 2, 2).0, slot);
    }
    // Dropless (capacity = tokens): nothing is dropped, and the counts add up to s x k.
    let (slot, counts) = slots(&experts, 3, 2, 2, 3);
    assert!(slot.iter().all(|&s| s >= 0));
    assert_eq!(counts.iter().sum::<i32>(), 6);
}
