//! `comm-opt`: rewrites the collectives of a partitioned training step to the cheapest
//! equivalent program, by equality saturation (`egg`) priced by the cluster model.
//!
//! Every op of `@train_step` becomes an e-node: collectives (`all_gather`, `all_slice`,
//! `all_reduce`, `reduce_scatter`) and single-result `xf` ops as rewritable nodes, everything
//! else as opaque nodes whose operands may still change. Gradient buckets and the gathers
//! of a parameter made for one reader (`xf.per_reader`, ZeRO-3) are opaque too, and priced
//! as the collectives they are: as e-nodes two equal gathers would be one, holding the
//! whole parameter between its readers. The rules below grow the e-graph
//! until it saturates or hits a limit (nodes, iterations, wall time; the report says which).
//! Extraction picks, per e-class, the node of least cost: collectives by the alpha-beta model
//! of their axes ([`shardc_ir::cluster`]), ops by their roofline time on the cluster's GPU,
//! so moving compute across a collective is priced too. The function is then rebuilt from
//! the extracted nodes, ops in their original order as far as dependencies allow.
//!
//! Rules (each has a test on concrete tensors in the CPU runtime):
//! * `slice-of-gather`: `all_slice(all_gather(x, a, d), a, d) = x`;
//! * `gather-of-slice`: `all_gather(all_slice(x, a, d), a, d) = x` (x is whole over `a`);
//! * `split-all-reduce`: `all_reduce(x, a) = all_gather(reduce_scatter(x, a, d), a, d)`;
//! * `join-all-reduce`: the converse;
//! * `commute-gather`: an op whose sharding rule maps the gathered dimension to a free factor
//!   runs on the shards: `op(all_gather(x, a, d), y) = all_gather(op(x, y'), a, d')`, with `y'`
//!   the matching shard of each other operand (its own un-gathered value, or a local slice);
//!   element-wise ops, norms over another dimension, attention over heads, ... all qualify by
//!   their registry rule, so sequence parallelism falls out of rewriting;
//! * `sum-of-all-reduces`: `add(all_reduce(x, a), all_reduce(y, a)) = all_reduce(add(x, y), a)`;
//! * `merge-axes`: `all_reduce(all_reduce(x, a), b) = all_reduce(x, a + b)`;
//! * `size-one-axis`: a collective over axes of total size 1 is its operand;
//! * `broadcast-of-replicated`: a broadcast over axes its operand is already replicated over
//!   (an all-reduce's or all-gather's result, an argument not split over them) is the operand;
//! * `bucket`: two all-reduces over the same axes whose operands do not depend on each other
//!   share one launch (one message of both), as gradient buckets do.
//!
//! Extraction is greedy and DAG-aware (a class used twice is paid once within a region; heavy
//! ops bound the regions), under a few policies (every node; whole all-reduces only; the
//! buckets), and the candidate program the model prices lowest wins, if it beats the input.
//! The bucket pairs are proposed in a second phase, among the collectives the first keeps.
//!
//! The parts: [`language`] (the e-nodes and their tables, and the IR's collectives to and
//! from them), [`analysis`] (types and replicated axes, with the purity assumption it rests
//! on), [`rules`], [`extract`], [`emit`] and [`price`]; this module runs the phases. egg
//! supplies the e-graph, its analysis and the cost-function interface; the rules are
//! hand-written searches rather than `Rewrite`s and the loop is ours rather than a `Runner`,
//! because the rules' preconditions read the analysis and the op registry's sharding rules
//! and their right sides carry new attributes (a `Pattern` spells neither), and because the
//! loop checks the node limit per match, records the nodes `split-all-reduce` adds (the
//! whole-all-reduce policy excludes them) and keeps each class's program position for
//! extraction's order.

use std::collections::{BTreeMap, BinaryHeap};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::time::{Duration, Instant};

use egg::{Analysis, CostFunction, DidMerge, EGraph, Id, Language, Symbol, SymbolLang};
use serde::{Deserialize, Serialize};
use shardc_ir::cluster::{Cluster, Collective};
use shardc_ir::ops::lookup;
use shardc_ir::sharding::FactorKind;
use shardc_ir::{AttrValue, Attrs, Func, FuncBuilder, Module, Reduction, TensorTy, Type, Value};

use crate::{Changed, Pass, PassError};

mod analysis;
mod emit;
mod extract;
mod language;
mod price;
mod rules;

use analysis::*;
use emit::*;
use extract::*;
use language::*;
use rules::*;
pub use price::price;
use price::*;

/// The `comm-opt` pass.
#[derive(Clone, Debug)]
pub struct CommOpt {
    /// Prices collectives and compute.
    pub cluster: Cluster,
    /// Stop growing the e-graph past this many e-nodes.
    pub node_limit: usize,
    /// Stop after this many rounds of rule applications.
    pub iteration_limit: usize,
    /// Stop after this much wall time.
    pub time_limit: Duration,
}

impl Default for CommOpt {
    fn default() -> Self {
        CommOpt { cluster: Cluster::default(), node_limit: 200_000, iteration_limit: 30, time_limit: Duration::from_secs(5) }
    }
}

/// What the pass did, for the compile summary (stored in the module's notes).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CommOptReport {
    /// Estimated communication seconds of one step before and after.
    pub time_before: f64,
    /// After.
    pub time_after: f64,
    /// Bytes the collectives move (full sizes) before.
    pub bytes_before: f64,
    /// After.
    pub bytes_after: f64,
    /// Collectives before and after.
    pub collectives_before: usize,
    /// After.
    pub collectives_after: usize,
    /// Unions each rule made.
    pub rules: BTreeMap<String, usize>,
    /// Size of the saturated e-graph.
    pub enodes: usize,
    /// E-classes.
    pub eclasses: usize,
    /// Rounds of rule application.
    pub iterations: usize,
    /// Why saturation stopped: `saturated`, `node limit`, `iteration limit` or `time limit`.
    pub stop: String,
    /// Wall time of the pass in seconds.
    pub seconds: f64,
}

impl Pass for CommOpt {
    fn name(&self) -> &'static str {
        "comm-opt"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let internal = |message: String| PassError::User { pass: self.name().into(), message };
        let Some(grid) = module.grids.first().map(|g| g.shape.clone()) else {
            return Ok(Changed::No);
        };
        let grid_name = module.grids[0].name.clone();
        let Some(index) = module.funcs.iter().position(|f| f.name == "train_step" || f.name == "gradients") else {
            return Ok(Changed::No);
        };
        let (func, report) = optimize(&module.funcs[index], &grid, &grid_name, self).map_err(internal)?;
        module.funcs[index] = func;
        module.notes.insert(self.name().into(), serde_json::to_string(&report).unwrap_or_default());
        Ok(Changed::Yes)
    }
}

/// The rewritten function and the report.
pub fn optimize(func: &Func, grid: &[i64], grid_name: &str, options: &CommOpt) -> Result<(Func, CommOptReport), String> {
    // Layout first (which collectives, where), then packing (which of them share a message):
    // bucket pairs are chosen among the collectives the layout keeps.
    let start = Instant::now();
    let (laid_out, layout) = optimize_phase(func, grid, grid_name, options, false)?;
    if bucket_pairs(&laid_out).is_empty() {
        return Ok((laid_out, CommOptReport { seconds: start.elapsed().as_secs_f64(), ..layout }));
    }
    let (packed, packing) = optimize_phase(&laid_out, grid, grid_name, options, true)?;
    let mut rules = layout.rules;
    for (rule, n) in packing.rules {
        *rules.entry(rule).or_insert(0) += n;
    }
    let report = CommOptReport {
        time_after: packing.time_after,
        bytes_after: packing.bytes_after,
        collectives_after: packing.collectives_after,
        rules,
        enodes: layout.enodes.max(packing.enodes),
        eclasses: layout.eclasses.max(packing.eclasses),
        seconds: start.elapsed().as_secs_f64(),
        ..layout
    };
    Ok((packed, report))
}

/// One phase: the layout rules (`packing` false) or the bucket pairs (`packing` true).
fn optimize_phase(func: &Func, grid: &[i64], grid_name: &str, options: &CommOpt, packing: bool) -> Result<(Func, CommOptReport), String> {
    let start = Instant::now();
    let tables = Tables { func: func.clone(), grid: grid.to_vec(), kinds: HashMap::default(), symbols: HashMap::default(), attrs: Vec::new(), attrs_by_hash: HashMap::default(), locs: Vec::new() };
    let mut egraph: Graph = EGraph::new(tables);
    // The class of every value, the original op behind each (class, symbol), and each
    // class's position in the original order.
    let mut class_of: HashMap<Value, Id> = HashMap::default();
    let mut original: HashMap<(Id, Symbol), usize> = HashMap::default();
    let mut position: Vec<(Id, f64)> = Vec::new();
    for (i, arg) in func.args.iter().enumerate() {
        let id = add(&mut egraph, Term::Node(Kind::Arg(i), vec![]));
        class_of.insert(arg.value, id);
        position.push((id, -1.0));
    }
    for (i, op) in func.ops.iter().enumerate() {
        let children: Vec<Id> = op.operands.iter().map(|v| class_of.get(v).copied().ok_or_else(|| format!("{}: operand {v} is undefined", op.loc))).collect::<Result<_, _>>()?;
        let kind = match collective_kind(op) {
            Some(kind) => kind,
            None if !op.results.is_empty() && op.name.starts_with("xf.") && lookup(&op.name).is_some() && !heavy_op(&op.name) => {
                let tables = &mut egraph.analysis;
                let attrs = tables.push_attrs(op.attrs.clone());
                tables.locs.push((op.loc.clone(), op.origin));
                Kind::Xf { name: op.name.clone(), attrs, loc: tables.locs.len() - 1 }
            }
            None => Kind::Opaque(i),
        };
        let symbol = egraph.analysis.symbol(kind.clone());
        let id = egraph.add(SymbolLang::new(symbol, children));
        original.insert((id, symbol), i);
        position.push((id, i as f64));
        if op.results.len() == 1 {
            class_of.insert(op.results[0], id);
        } else {
            for (k, r) in op.results.iter().enumerate() {
                let rid = add(&mut egraph, Term::Node(Kind::Proj(k), vec![Term::Class(id)]));
                class_of.insert(*r, rid);
                position.push((rid, i as f64 + 0.1));
            }
        }
    }
    let roots: Vec<Id> = func.returns.iter().map(|v| class_of[v]).collect();
    let before = price(func, grid, &options.cluster);
    let mut rules: BTreeMap<String, usize> = BTreeMap::new();
    // Buckets: consecutive sum all-reduces over the same axes, neither of which depends on the
    // other, may travel as one message.
    let mut bucketed: Vec<SymbolLang> = Vec::new();
    for (i, j) in if packing { bucket_pairs(func) } else { Vec::new() } {
        let (a, b) = (class_of[&func.ops[i].results[0]], class_of[&func.ops[j].results[0]]);
        let (x, y) = (class_of[&func.ops[i].operands[0]], class_of[&func.ops[j].operands[0]]);
        let axes = match collective_kind(&func.ops[i]) {
            Some(Kind::Coll { axes, .. }) => axes,
            _ => continue,
        };
        let bucket = add(&mut egraph, coll_pair(&axes, x, y));
        let (p0, p1) = (add(&mut egraph, Term::Node(Kind::Proj(0), vec![Term::Class(bucket)])), add(&mut egraph, Term::Node(Kind::Proj(1), vec![Term::Class(bucket)])));
        position.push((bucket, j as f64));
        for (class, proj) in [(a, p0), (b, p1)] {
            if egraph.union(class, proj) {
                *rules.entry("bucket".into()).or_insert(0) += 1;
            }
        }
        for op in [i, j] {
            let symbol = egraph.analysis.symbol(collective_kind(&func.ops[op]).expect("a collective"));
            bucketed.push(SymbolLang::new(symbol, vec![class_of[&func.ops[op].operands[0]]]));
        }
    }
    egraph.rebuild();

    // Equality saturation.
    let mut iterations = 0;
    // Nodes that exist only because an all-reduce was split: one extraction policy leaves
    // them out, keeping every all-reduce whole.
    let mut split_nodes: Vec<SymbolLang> = Vec::new();
    let stop = loop {
        if packing {
            break "saturated";
        }
        if iterations >= options.iteration_limit {
            break "iteration limit";
        }
        if egraph.total_size() >= options.node_limit {
            break "node limit";
        }
        if start.elapsed() >= options.time_limit {
            break "time limit";
        }
        iterations += 1;
        let matches = search(&egraph);
        let mut changed = false;
        // New classes take the position of the class they join.
        let mut at: HashMap<Id, f64> = HashMap::default();
        for (id, p) in &position {
            let e = at.entry(egraph.find(*id)).or_insert(*p);
            *e = e.min(*p);
        }
        for (rule, target, term) in matches {
            if egraph.total_size() >= options.node_limit {
                break;
            }
            let target = add(&mut egraph, target);
            let id = if rule == "split-all-reduce" { add_recording(&mut egraph, term, &mut split_nodes) } else { add(&mut egraph, term) };
            position.push((id, at.get(&egraph.find(target)).copied().unwrap_or(f64::MAX / 32.0)));
            if egraph.union(target, id) {
                changed = true;
                *rules.entry(rule.to_string()).or_insert(0) += 1;
            }
        }
        egraph.rebuild();
        if !changed {
            break "saturated";
        }
    };

    // Extraction: a few candidate programs, and the one the cluster model prices lowest. The
    // original program is one of them, so the pass never makes a step costlier by its model.
    let mut order: HashMap<Id, f64> = HashMap::default();
    for (id, at) in &position {
        let c = egraph.find(*id);
        let e = order.entry(c).or_insert(*at);
        *e = e.min(*at);
    }
    let roots: Vec<Id> = roots.iter().map(|r| egraph.find(*r)).collect();
    let mut candidates = Vec::new();
    let split_nodes: HashSet<SymbolLang> = split_nodes.iter().map(|n| n.clone().map_children(|c| egraph.find(c))).collect();
    // Two policies: every node, and every node but those of split all-reduces (whole
    // all-reduces, where the first policy's greedy choices would mix both forms). The first
    // runs twice, the second time counting what the first keeps as already paid.
    // A third policy takes the buckets: their whole benefit (one launch for two messages) is
    // shared by two classes, which greedy extraction cannot see.
    let mut whole_and_bucketed = split_nodes.clone();
    whole_and_bucketed.extend(bucketed.iter().map(|n| n.clone().map_children(|c| egraph.find(c))));
    let policies: Vec<(HashSet<SymbolLang>, usize)> = if packing { vec![(whole_and_bucketed, 1)] } else { vec![(HashSet::default(), 2), (split_nodes, 1)] };
    // The policies are independent: one thread each.
    let per_policy: Vec<Vec<HashMap<Id, SymbolLang>>> = std::thread::scope(|s| {
        let handles: Vec<_> = policies
            .iter()
            .map(|(policy, rounds)| {
                let (egraph, order, roots) = (&egraph, &order, &roots);
                s.spawn(move || {
                    let mut paid: HashSet<Id> = HashSet::default();
                    let mut out = Vec::new();
                    for _ in 0..*rounds {
                        let choice = extract(egraph, &options.cluster, order, &paid, policy);
                        paid = boundary_operands(egraph, &choice, roots);
                        out.push(choice);
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    candidates.extend(per_policy.into_iter().flatten());
    let mut cost = Cost { egraph: &egraph, cluster: &options.cluster };
    let baseline = func_cost(func, grid, &options.cluster);
    let priced: Vec<(f64, HashMap<Id, SymbolLang>)> = candidates.into_iter().filter_map(|choice| program_cost(&egraph, &mut cost, &choice, &roots).map(|c| (c, choice))).collect();
    let best = priced.into_iter().min_by(|a, b| a.0.total_cmp(&b.0));
    let out = match best {
        Some((c, choice)) if c < baseline * (1.0 - 1e-9) => emit(func, &egraph, &choice, &roots, &order, &original, grid_name)?,
        _ => func.clone(),
    };
    let after = price(&out, grid, &options.cluster);
    let report = CommOptReport {
        time_before: before.0,
        time_after: after.0,
        bytes_before: before.1,
        bytes_after: after.1,
        collectives_before: before.2,
        collectives_after: after.2,
        rules,
        enodes: egraph.total_number_of_nodes(),
        eclasses: egraph.number_of_classes(),
        iterations,
        stop: stop.into(),
        seconds: start.elapsed().as_secs_f64(),
    };
    Ok((out, report))
}
