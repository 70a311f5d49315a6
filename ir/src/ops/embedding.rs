//! `xf.embedding`: row lookup in a table, and its gradient `xf.embedding_grad`.

use crate::kernel::{elements, flat, Arg, DeviceKernel, KernelCx, Launch, ROW_BLOCK};
use super::{arity, float, ids, io_bytes, positive, rank_is, AttrKind, Cost, OpDef, Signature, Slot, VjpCx};
use crate::attrs::{AttrValue, Attrs};
use crate::graph::Value;
use crate::sharding::{FactorKind, Linearity, ShardingRule};
use crate::types::TensorTy;

/// `out[..., :] = table[ids[...], :]`: token embedding lookup. `table` is `[vocab, hidden]`,
/// `ids` holds i32 row indices of any shape; the result appends the hidden dimension.
#[derive(Debug)]
pub struct Embedding;

impl OpDef for Embedding {
    fn mnemonic(&self) -> &'static str {
        "embedding"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (rows, hidden) = (cx.inputs[0].shape[0], cx.inputs[0].shape[1]);
        let tokens = elements(cx.inputs[1]);
        let args = vec![Arg::Out(0), Arg::In(0), Arg::In(1), Arg::Int(tokens as i64), Arg::Int(hidden), Arg::Int(rows), Arg::RankOffset];
        Ok(DeviceKernel::Launches(vec![flat("embedding", EMBEDDING_CUDA, tokens * hidden as usize, args)]))
    }
    fn summary(&self) -> &'static str {
        "row lookup: out[..., :] = table[ids[...], :]"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "table", constraint: "W" }, Slot { name: "ids", constraint: "I" }],
            results: &[Slot { name: "out", constraint: "O" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        let (table, index) = (inputs[0], inputs[1]);
        float("table", table)?;
        rank_is("table", table, 2)?;
        ids("ids", index)?;
        let mut shape = index.shape.clone();
        shape.push(table.shape[1]);
        Ok(vec![TensorTy::new(shape, table.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        // A gather reads only the rows it copies, not the whole table.
        let out = outputs.iter().map(|t| t.bytes() as f64).sum::<f64>();
        Cost { flops: 0.0, bytes: 2.0 * out + io_bytes(&inputs[1..], &[]), special: 0.0 }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        let vocab = cx.ty(cx.operands[0])?.shape[0];
        let ids = cx.operands[1];
        let d_table = cx.emit("xf.embedding_grad", &[ids, grads[0]], Attrs::new().with("vocab", AttrValue::Int(vocab)))?;
        Ok(vec![Some(d_table), None])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // Factors: vocab (0), hidden (1), the ids' dims (2..). Splitting the vocab is a
        // reduction: each rank looks up the rows it holds (zeros for the others), and the
        // partial results sum to the lookup (vocab-parallel embedding).
        let r = inputs[1].rank();
        let ids: Vec<usize> = (2..2 + r).collect();
        let mut out = ids.clone();
        out.push(1);
        ShardingRule { operands: vec![vec![0, 1], ids], results: vec![out], factors: vec![FactorKind::Free; 2 + r], linearity: Linearity::None }
    }
}

/// Threads per column of the embedding gradient's kernel (each takes the vocabulary rows of
/// one residue; a power of two).
const EMBEDDING_GRAD_SPLIT: i64 = 64;

/// `out[v, :] = sum of dy[t, :] over every position t with ids[t] = v`: the scatter-add that
/// is the gradient of an embedding lookup. `out` is `[vocab, hidden]`.
#[derive(Debug)]
pub struct EmbeddingGrad;

impl OpDef for EmbeddingGrad {
    fn mnemonic(&self) -> &'static str {
        "embedding_grad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (rows, hidden) = (cx.outputs[0].shape[0], cx.outputs[0].shape[1]);
        let tokens = elements(cx.inputs[0]) as i64;
        let zero = flat("shardc_fill_zero", "", elements(&cx.outputs[0]), vec![Arg::Out(0), Arg::Int(rows * hidden)]);
        // Vocabulary rows are dealt to `split` threads per column, so that many more threads
        // work than columns (one per column left an H200 at 1.9 ms for gpt2-small's 4096
        // tokens); a power of two, so a thread picks its rows with a mask, not a 64-bit
        // division per token.
        let split = (rows.clamp(1, EMBEDDING_GRAD_SPLIT) as u64).next_power_of_two() as i64;
        // The workspace (in acc_t, at least 4 bytes): counts and offsets of the parts, then
        // the lists of their tokens.
        let workspace = (2 * split + tokens) as usize;
        // `RankOffset`: the first row this rank holds of a vocab-split table (0 when whole).
        let part_args = vec![Arg::Workspace, Arg::In(0), Arg::Int(tokens), Arg::Int(rows), Arg::Int(split), Arg::RankOffset];
        let parts = |kernel| Launch { kernel, source: EMBEDDING_CUDA, grid: [split as u32, 1, 1], block: ROW_BLOCK, shared: 0, workspace, args: part_args.clone() };
        let args = vec![Arg::Out(0), Arg::Workspace, Arg::In(0), Arg::In(1), Arg::Int(hidden), Arg::Int(split), Arg::RankOffset];
        let sum = Launch { workspace, ..flat("embedding_grad", EMBEDDING_CUDA, (hidden * split) as usize, args) };
        Ok(DeviceKernel::Launches(vec![zero, parts("embedding_grad_count"), parts("embedding_grad_list"), sum]))
    }
    fn summary(&self) -> &'static str {
        "scatter-add: out[ids[...], :] += dy[..., :] into [vocab, hidden]"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "ids", constraint: "I" }, Slot { name: "dy", constraint: "D" }],
            results: &[Slot { name: "out", constraint: "W" }],
            attrs: &[("vocab", AttrKind::Int)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        let (index, dy) = (inputs[0], inputs[1]);
        ids("ids", index)?;
        float("dy", dy)?;
        if dy.rank() != index.rank() + 1 || dy.shape[..index.rank()] != index.shape[..] {
            return Err(format!("dy {dy} must be ids {index} plus a hidden dimension"));
        }
        let vocab = positive("vocab", attrs.int("vocab")?)?;
        Ok(vec![TensorTy::new([vocab, dy.shape[dy.rank() - 1]], dy.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        Cost { flops: inputs[1].num_elements() as f64, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // The ids' dims are reductions (rows are summed); hidden passes. The vocab dim of
        // the result has no operand dim: it is split only where the result is pinned split
        // (a vocab-parallel table's gradient), and then each rank sums into the rows it holds
        // (`xf.row_split_axes`, as the lookup reads them) and skips the other ids.
        let r = inputs[0].rank();
        let ids: Vec<usize> = (0..r).collect();
        let mut dy = ids.clone();
        dy.push(r);
        let factors = vec![FactorKind::Free; r + 2];
        ShardingRule { operands: vec![ids, dy], results: vec![vec![r + 1, r]], factors, linearity: Linearity::Product }
    }
}

/// CUDA C of this file's ops (see [`crate::kernel`]).
const EMBEDDING_CUDA: &str = r#"extern "C" __global__ void embedding(T* out, const T* table, const int* ids, i64 tokens, i64 hidden, i64 rows, i64 first) {
  GRID_STRIDE(i, tokens * hidden) {
    i64 t = i / hidden, c = i % hidden, r = (i64)ids[t] - first;
    out[i] = (r >= 0 && r < rows) ? table[r * hidden + c] : store((acc_t)0);
  }
}
// The gradient in three launches, each output element summed by one thread in token order
// (deterministic, the same sums as one thread per column). Vocabulary rows are dealt to
// `split` parts by their residue (a power of two). First each part's block lists its tokens
// (a stable partition of the token indices, no atomics), then thread (part, column) walks only
// its part's list: a walk over every token per thread left gpt2-small's 8192 tokens at
// 1.2 ms on an H200. The workspace holds, as ints: the parts' counts, their offsets, then
// the lists, `tokens` in all. A vocab-split table's rank holds rows [first, first + rows) and
// skips the other ids.
// Tokens [begin, end) of this thread's share of the ids, and how many of them fall in `part`.
__device__ __forceinline__ i64 embedding_share(const int* ids, i64 tokens, i64 rows, i64 split, i64 part, i64 first, i64* begin, i64* end) {
  i64 per = (tokens + blockDim.x - 1) / blockDim.x;
  *begin = (i64)threadIdx.x * per < tokens ? (i64)threadIdx.x * per : tokens;
  *end = *begin + per < tokens ? *begin + per : tokens;
  i64 n = 0;
  for (i64 t = *begin; t < *end; t++) { i64 r = ids[t] - first; n += (r >= 0 && r < rows && (r & (split - 1)) == part); }
  return n;
}
// Block `part`: how many tokens fall in the part.
extern "C" __global__ void embedding_grad_count(acc_t* work, const int* ids, i64 tokens, i64 rows, i64 split, i64 first) {
  __shared__ i64 shares[1024];
  int* counts = (int*)work;
  i64 part = blockIdx.x, begin, end;
  shares[threadIdx.x] = embedding_share(ids, tokens, rows, split, part, first, &begin, &end);
  __syncthreads();
  if (threadIdx.x == 0) {
    i64 n = 0;
    for (unsigned k = 0; k < blockDim.x; k++) n += shares[k];
    counts[part] = (int)n;
  }
}
// Block `part`: its tokens, in order, at its offset in the lists (each thread's share after
// the shares before it: a scan of the threads' counts).
extern "C" __global__ void embedding_grad_list(acc_t* work, const int* ids, i64 tokens, i64 rows, i64 split, i64 first) {
  __shared__ i64 before[1024];
  int* counts = (int*)work;
  int* offsets = counts + split;
  int* lists = offsets + split;
  i64 part = blockIdx.x, begin, end;
  before[threadIdx.x] = embedding_share(ids, tokens, rows, split, part, first, &begin, &end);
  __syncthreads();
  if (threadIdx.x == 0) {
    i64 at = 0;
    for (i64 q = 0; q < part; q++) at += counts[q];
    offsets[part] = (int)at;
    for (unsigned k = 0; k < blockDim.x; k++) { i64 n = before[k]; before[k] = at; at += n; }
  }
  __syncthreads();
  i64 at = before[threadIdx.x];
  for (i64 t = begin; t < end; t++) { i64 r = ids[t] - first; if (r >= 0 && r < rows && (r & (split - 1)) == part) lists[at++] = (int)t; }
}
// Thread (part, column): its part's tokens in order, each added to its row's column.
extern "C" __global__ void embedding_grad(T* out, const acc_t* work, const int* ids, const T* dy, i64 hidden, i64 split, i64 first) {
  const int* counts = (const int*)work;
  const int* offsets = counts + split;
  const int* lists = offsets + split;
  GRID_STRIDE(i, hidden * split) {
    i64 c = i % hidden, part = i / hidden;
    for (i64 k = offsets[part], last = k + counts[part]; k < last; k++) {
      i64 t = lists[k], r = ids[t] - first;
      out[r * hidden + c] = store(load(out[r * hidden + c]) + load(dy[t * hidden + c]));
    }
  }
}
"#;
