//! `shard-megatron`: the Megatron-LM layout as annotations of the training step's arguments.
//!
//! Input: a module with `@train_step` (or `@gradients`) and no grid. Output: the grid
//! `@mesh` of shape `dp x tp x pp` (axes named `dp`, `tp`, `pp`; with context parallelism
//! `dp x tp x pp x cp`) and a sharding for every
//! argument: column-parallel weights (q, k, v, MLP up and gate, stored `[in, out]`) split
//! their output dimension over `tp`, and their biases with them; row-parallel weights
//! (attention out, MLP down) split their input dimension; the embedding table and an untied
//! LM head split the vocabulary (vocab-parallel) when `tp` divides it; norms and positions
//! are replicated; optimizer state follows its parameter; tokens and targets split the batch
//! over `dp`, and their sequence over `cp` (context parallelism: every activation's sequence
//! is then split, attention gathers keys and values, and weight gradients are reduced over
//! `dp` and `cp` together). Everything else follows from the ops' sharding rules in
//! propagation.
//!
//! Sequence parallelism pins the residual stream (`[batch, seq, hidden]` results of the
//! residual adds, the row-parallel bias adds and the embedding's position add) to be split
//! along the sequence over `tp` (and the batch over `dp`). Norms then run on sequence shards,
//! a row-parallel sum arrives reduce-scattered instead of all-reduced, and a column-parallel
//! layer all-gathers its input along the sequence (Korthikanti et al. 2022).
//!
//! ZeRO adds `dp` to one dimension of each tensor it shards (the first whose extent the
//! extra split divides): optimizer state from stage 1, parameters at stage 3. On a dimension
//! already split over `tp`, `dp` comes after it (`[tp, dp]`, outermost first): each rank's
//! tensor-parallel shard stays whole and is split over `dp`, as in Megatron's distributed
//! optimizer, so per rank the state is 1/(dp x tp) of the tensor. Propagation then makes the
//! update run on the shard, the gradient arrive reduce-scattered over `dp` on the rank's tp
//! shard, the new parameter be all-gathered over `dp` (stages 1-2) and, at stage 3, every
//! reader of a parameter gather it over `dp` first; nothing of ZeRO crosses `tp`.

use std::collections::HashSet;

use shardc_ir::facts::{Block, ParamKind};
use shardc_ir::mesh::Mesh;
use shardc_ir::sharding::Sharding;
use shardc_ir::{ArgRole, Grid, Module, Value};

use super::{FuncIndex, CP, DP, EP, TP};
use crate::{Changed, Pass, PassError};

/// The `shard-megatron` pass.
#[derive(Clone, Copy, Debug)]
pub struct ShardMegatron {
    /// The mesh.
    pub mesh: Mesh,
    /// ZeRO stage: 1 and 2 shard optimizer state over `dp` (gradients are reduce-scattered
    /// straight into the shards either way), 3 shards the parameters too.
    pub zero: u8,
    /// Sequence parallelism: the residual stream is split along the sequence over `tp`.
    pub sequence_parallel: bool,
    /// Vocabulary size of the model (the vocab-parallel split needs tp to divide it).
    pub vocab: i64,
    /// Key/value heads (their projections split only when tp divides them).
    pub kv_heads: i64,
    /// A deliberately naive layout, for the communication optimizer to improve: the result
    /// of every column-parallel matmul is gathered right away (and sliced again where a
    /// row-parallel matmul needs it split), as a partitioner that inserts collectives
    /// greedily would do.
    pub naive: bool,
}

/// Sharding of a parameter of `kind` (as the model declares it) and `rank` dimensions.
fn param_sharding(kind: Option<ParamKind>, rank: usize, tp: i64, ep: i64, vocab: i64, kv_heads: i64) -> Sharding {
    let mut s = tensor_parallel_sharding(kind, rank, tp, vocab, kv_heads);
    // Expert parallelism: each rank of an expert group holds its share of the experts.
    if ep > 1 && matches!(kind, Some(ParamKind::ExpertColumn | ParamKind::ExpertRow)) {
        s.split[0] = vec![EP];
    }
    s
}

/// The tensor-parallel part of [`param_sharding`].
fn tensor_parallel_sharding(kind: Option<ParamKind>, rank: usize, tp: i64, vocab: i64, kv_heads: i64) -> Sharding {
    if tp == 1 {
        return Sharding::replicated(rank);
    }
    match kind {
        // [in, out] weights split `out`; their [out] biases likewise.
        Some(ParamKind::Column) => Sharding::split_dim(rank, rank - 1, &[TP]),
        Some(ParamKind::KeyValue) if kv_heads % tp == 0 => Sharding::split_dim(rank, rank - 1, &[TP]),
        // [in, out] weights split `in`; the [out] bias is added after the all-reduce.
        Some(ParamKind::Row) if rank == 2 => Sharding::split_dim(rank, 0, &[TP]),
        Some(ParamKind::TokenEmbedding) if vocab % tp == 0 => Sharding::split_dim(rank, 0, &[TP]),
        Some(ParamKind::LmHead) if vocab % tp == 0 => Sharding::split_dim(rank, 1, &[TP]),
        // Tensor parallelism inside each expert, as in a dense MLP.
        Some(ParamKind::ExpertColumn) => Sharding::split_dim(rank, rank - 1, &[TP]),
        Some(ParamKind::ExpertRow) => Sharding::split_dim(rank, rank - 2, &[TP]),
        _ => Sharding::replicated(rank),
    }
}

impl Pass for ShardMegatron {
    fn name(&self) -> &'static str {
        "shard-megatron"
    }

    fn run(&self, module: &mut Module) -> Result<Changed, PassError> {
        let user = |message: String| PassError::User { pass: "shard-megatron".into(), message };
        let (dp, tp) = (self.mesh.dp as i64, self.mesh.tp as i64);
        let cp = self.mesh.cp as i64;
        let ep = self.mesh.ep as i64;
        if ep > 1 && dp % ep != 0 {
            return Err(user(format!("ep={ep} does not divide dp={dp}: expert parallelism is carved from the data-parallel ranks")));
        }
        // The cp axis only where there is context or expert parallelism, and the ep axis only
        // with expert parallelism, so other grids read as before. With ep the dp axis holds
        // the dp / ep expert groups.
        let mut grid = vec![if ep > 1 { dp / ep } else { dp }, tp, self.mesh.pp as i64];
        if cp > 1 || ep > 1 {
            grid.push(cp);
        }
        if ep > 1 {
            grid.push(ep);
        }
        // The data-parallel axes: a batch splits over them (outermost first), and gradients
        // of what every data-parallel rank holds are reduced over them.
        let data_axes: Vec<u16> = if ep > 1 { vec![DP, EP] } else { vec![DP] };
        let axes = shardc_ir::mesh::GRID_AXES[..grid.len()].iter().map(|a| a.to_string()).collect();
        module.grids = vec![Grid { name: "mesh".into(), shape: grid.clone(), axes }];
        let func = module
            .funcs
            .iter_mut()
            .find(|f| f.name == "train_step" || f.name == "gradients" || f.name == "logits")
            .ok_or_else(|| user("the module has no @train_step, @gradients or @logits to shard".into()))?;
        if self.zero > 3 {
            return Err(user(format!("ZeRO stage {} does not exist; use 0, 1, 2 or 3", self.zero)));
        }
        // Adds the data-parallel axes to the first dimension that can take them: all of them
        // for what every data-parallel rank holds, dp alone (the expert groups) for experts
        // already split over ep.
        let add_dp = |mut s: Sharding, shape: &[i64]| {
            let axes: Vec<u16> = data_axes.iter().copied().filter(|a| !s.axes().contains(a)).collect();
            let extent: i64 = axes.iter().map(|&a| grid[a as usize]).product();
            if extent <= 1 {
                return s;
            }
            for d in 0..shape.len() {
                let parts: i64 = s.split[d].iter().map(|&a| grid[a as usize]).product::<i64>() * extent;
                if shape[d] % parts == 0 {
                    s.split[d].extend(&axes);
                    return s;
                }
            }
            s
        };
        // Inputs whose sequence the step reorders before use (context parallelism's zigzag
        // order): each rank takes its part of the reordered sequence.
        let reorders: Vec<(Value, Value)> = func.ops.iter().filter(|o| o.name == "xf.zigzag" && o.attrs.int("axis") == Ok(1)).map(|o| (o.operands[0], o.results[0])).collect();
        let reordered: HashSet<Value> = reorders.iter().filter(|(input, _)| func.args.iter().any(|a| a.value == *input && a.role == ArgRole::Input)).map(|(input, _)| *input).collect();
        for arg in func.args.clone() {
            let Some(t) = func.tensor(arg.value).cloned() else { continue };
            let sharding = match arg.role {
                ArgRole::Param => {
                    let s = param_sharding(arg.kind, t.rank(), tp, ep, self.vocab, self.kv_heads);
                    if self.zero >= 3 { add_dp(s, &t.shape) } else { s }
                }
                // opt.m.<param> / opt.v.<param> / opt.master.<param> follow their parameter;
                // ZeRO shards them from stage 1 (the fp32 master weights are optimizer state,
                // as in Megatron's distributed optimizer).
                ArgRole::OptState | ArgRole::Master => {
                    let s = param_sharding(arg.kind, t.rank(), tp, ep, self.vocab, self.kv_heads);
                    if self.zero >= 1 { add_dp(s, &t.shape) } else { s }
                }
                ArgRole::Input => {
                    let mut s = Sharding::replicated(t.rank());
                    if t.rank() >= 1 && dp > 1 {
                        if t.shape[0] % dp != 0 {
                            return Err(user(format!("`{}` has batch {} which dp={dp} does not divide", arg.name, t.shape[0])));
                        }
                        s.split[0] = data_axes.clone();
                    }
                    // Context parallelism splits the sequence of tokens and targets; every
                    // activation's follows from the ops' rules. A sequence reordered first
                    // (zigzag order) is split after the reorder, below.
                    if t.rank() == 2 && cp > 1 && !reordered.contains(&arg.value) {
                        if t.shape[1] % cp != 0 {
                            return Err(user(format!("`{}` has a sequence of {} which cp={cp} does not divide", arg.name, t.shape[1])));
                        }
                        s.split[1] = vec![CP];
                    }
                    s
                }
            };
            func.shardings.insert(arg.value, sharding);
        }
        for (input, order) in reorders.iter().filter(|(input, _)| reordered.contains(input)) {
            let Some(t) = func.tensor(*order).cloned() else { continue };
            if t.rank() != 2 || t.shape[1] % cp != 0 {
                return Err(user(format!("the reordered sequence of {} is not [batch, seq] with cp={cp} dividing seq", t)));
            }
            let mut pin = func.shardings.get(input).cloned().unwrap_or_else(|| Sharding::replicated(2));
            pin.split[1] = vec![CP];
            func.constraints.insert(*order, pin);
        }
        // Every gradient is wanted in its optimizer state's layout (the parameter's, plus dp
        // under ZeRO): pin it there, so the op producing it computes it in that layout
        // rather than in whatever layout its inputs suggest.
        // Values some op makes, found once (not a walk of every op per update, quadratic in
        // the depth of the model).
        let produced_values: HashSet<Value> = func.ops.iter().flat_map(|o| o.results.iter().copied()).collect();
        // The axes that split the batch (the data axes, and cp's parts of the sequence): a
        // gradient computed from a rank's tokens is partial over them.
        let batch: Vec<super::Axis> = [(DP, dp), (EP, ep), (CP, cp)].into_iter().filter(|&(_, n)| n > 1).map(|(a, _)| a).collect();
        let casts: std::collections::HashMap<Value, Value> = func.ops.iter().filter(|o| o.name == "xf.cast").map(|o| (o.results[0], o.operands[0])).collect();
        let producer: std::collections::HashMap<Value, &str> = func.ops.iter().flat_map(|o| o.results.iter().map(move |r| (*r, o.name.as_str()))).collect();
        for op in func.ops.clone().iter().filter(|o| o.name == "xf.adamw" || o.name == "xf.sgd") {
            let (grad, state) = (op.operands[1], op.operands[if op.name == "xf.adamw" { 2 } else { 0 }]);
            let produced = produced_values.contains(&grad);
            if let (true, Some(layout)) = (produced, func.shardings.get(&state).cloned()) {
                let pin = Sharding { split: layout.split, partial: Vec::new() };
                // Mixed precision casts the bf16 gradient up first. The gradient op of a
                // tensor-parallel weight (a weight-gradient GEMM) or an expert's is pinned
                // too, to the part its rank holds (a column-parallel weight's gradient
                // computed from the gathered input and the local output gradient, as
                // Megatron-LM does, not whole as a partial sum over tp and then sliced), and
                // left partial over dp, so that the sum over the data-parallel ranks still
                // runs in fp32, after the cast.
                if let Some(cast) = casts.get(&grad).filter(|_| ep > 1 && pin.axes().contains(&EP)) {
                    let split = pin.split.iter().map(|axes| axes.iter().copied().filter(|&a| a != DP).collect()).collect();
                    func.constraints.insert(*cast, Sharding { split, partial: vec![DP] });
                } else if let Some(cast) = casts.get(&grad).filter(|bf16| tp > 1 && pin.axes().contains(&TP) && producer.get(*bf16) == Some(&"xf.matmul_wgrad")) {
                    // Partial over the axes that split the batch (dp and ep, and cp's sequence
                    // parts), which ZeRO also shards the state over.
                    let split = pin.split.iter().map(|axes| axes.iter().copied().filter(|a| !batch.contains(a)).collect()).collect();
                    func.constraints.insert(*cast, Sharding { split, partial: batch.clone() });
                }
                func.constraints.insert(grad, pin);
            }
        }
        // A vocab-parallel table's gradient (the embedding's scatter-add) is computed as the
        // rows its rank holds, as Megatron-LM's VocabParallelEmbedding does, partial over
        // the axes that split the batch: not the whole table on every tp rank, sliced (and,
        // with sequence parallelism, all-reduced over tp as well) afterwards. A gradient
        // already pinned (an untied f32 table's, which is the optimizer's operand) keeps its
        // pin, which splits the rows too.
        if tp > 1 {
            let tables: std::collections::HashMap<Value, Value> = func.ops.iter().filter(|o| o.name == "xf.embedding").map(|o| (o.operands[1], o.operands[0])).collect();
            for op in func.ops.iter().filter(|o| o.name == "xf.embedding_grad") {
                let Some(table) = tables.get(&op.operands[0]) else { continue };
                let Some(layout) = func.shardings.get(table) else { continue };
                let vocab_split = layout.split.first().is_some_and(|axes| axes.first() == Some(&TP));
                let same_rows = func.tensor(*table).zip(func.tensor(op.results[0])).is_some_and(|(t, g)| t.shape == g.shape);
                if vocab_split && same_rows && !func.constraints.contains_key(&op.results[0]) {
                    let split = layout.split.iter().map(|axes| axes.iter().copied().filter(|a| !batch.contains(a)).collect()).collect();
                    func.constraints.insert(op.results[0], Sharding { split, partial: batch.clone() });
                }
            }
        }
        if self.naive && tp > 1 {
            let index = FuncIndex::new(func);
            for op in func.ops.clone().iter().filter(|o| o.name == "xf.matmul") {
                let column = func.shardings.get(&op.operands[1]).is_some_and(|s| s.split.last().is_some_and(|axes| axes.contains(&TP)));
                let weight = index.is_param(op.operands[1]);
                // The LM head keeps its vocab-parallel loss: gathering the logits would make
                // a different program, not a worse layout of the same one.
                if column && weight && op.origin.block != Block::Head && let Some(t) = func.tensor(op.results[0]) {
                    // Gathered over tp; a context-parallel rank keeps its part of the sequence.
                    let pin = if cp > 1 && t.rank() == 3 { Sharding::split_dim(3, 1, &[CP]) } else { Sharding::replicated(t.rank()) };
                    func.constraints.insert(op.results[0], pin);
                }
            }
        }
        if self.sequence_parallel && tp > 1 {
            for op in func.ops.clone() {
                let Some(t) = op.results.first().and_then(|r| func.tensor(*r)).cloned() else { continue };
                if !op.origin.residual || t.rank() != 3 {
                    continue;
                }
                if t.shape[1] % (tp * cp) != 0 {
                    return Err(user(format!("sequence parallelism: tp={tp} (x cp={cp}) does not divide the sequence length {}", t.shape[1])));
                }
                // With context parallelism each cp rank's part of the sequence is split
                // further over tp, as Megatron-LM does.
                let mut pin = Sharding::split_dim(3, 1, if cp > 1 { &[CP, TP] } else { &[TP] });
                if dp > 1 {
                    pin.split[0] = data_axes.clone();
                }
                func.constraints.insert(op.results[0], pin);
            }
        }
        Ok(Changed::Yes)
    }
}
