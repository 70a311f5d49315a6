//! `xf.matmul`: batched matrix product with optional transposes, and `xf.matmul_wgrad`, the
//! weight gradient of a matrix shared across a batch.

use crate::kernel::{dims, DeviceKernel, Gemm, KernelCx};
use super::{arity, float, io_bytes, rank_at_least, same_dtype, AttrKind, Cost, KernelClass, OpDef, Signature, Slot, VjpCx};
use crate::attrs::{AttrValue, Attrs};
use crate::graph::Value;
use crate::sharding::{FactorKind, Linearity, ShardingRule};
use crate::types::TensorTy;

/// `out[..., m, n] = sum_k lhs[..., m, k] * rhs[..., k, n]`.
///
/// `lhs` has rank >= 2; its leading dimensions are batch dimensions. `rhs` is either a
/// matrix (shared across the batch: a linear layer's weight, stored `[in, out]`) or has the
/// same batch dimensions as `lhs`. `transpose_lhs`/`transpose_rhs` swap the last two
/// dimensions of an operand before the product (the tied LM head reads the `[vocab, hidden]`
/// embedding table with `transpose_rhs`).
#[derive(Debug)]
pub struct MatMul;

/// The dimensions of one matmul instance, after transposes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatMulDims {
    /// Leading (batch) dimensions of the output.
    pub batch: Vec<i64>,
    /// Rows of the output.
    pub m: i64,
    /// Contracted dimension.
    pub k: i64,
    /// Columns of the output.
    pub n: i64,
}

impl MatMul {
    /// Checks operands and returns the product's dimensions.
    pub fn dims(lhs: &TensorTy, rhs: &TensorTy, attrs: &Attrs) -> Result<MatMulDims, String> {
        float("lhs", lhs)?;
        float("rhs", rhs)?;
        same_dtype(lhs, rhs)?;
        rank_at_least("lhs", lhs, 2)?;
        rank_at_least("rhs", rhs, 2)?;
        let last2 = |t: &TensorTy, transpose: bool| {
            let (a, b) = (t.shape[t.rank() - 2], t.shape[t.rank() - 1]);
            if transpose { (b, a) } else { (a, b) }
        };
        let (m, k) = last2(lhs, attrs.bool("transpose_lhs")?);
        let (k_rhs, n) = last2(rhs, attrs.bool("transpose_rhs")?);
        if k != k_rhs {
            return Err(format!("contracted dimensions differ: lhs {lhs} has {k}, rhs {rhs} has {k_rhs}"));
        }
        let batch = lhs.shape[..lhs.rank() - 2].to_vec();
        if rhs.rank() > 2 && rhs.shape[..rhs.rank() - 2] != batch[..] {
            return Err(format!("rhs {rhs} must be a matrix or have the batch dimensions of lhs {lhs}"));
        }
        Ok(MatMulDims { batch, m, k, n })
    }
}

impl OpDef for MatMul {
    fn mnemonic(&self) -> &'static str {
        "matmul"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        let (transpose_a, transpose_b) = (cx.attrs.bool("transpose_lhs")?, cx.attrs.bool("transpose_rhs")?);
        let (sa, sb) = (dims(cx.inputs[0]), dims(cx.inputs[1]));
        let (ra, ca) = (sa[sa.len() - 2], sa[sa.len() - 1]);
        let (rb, cb) = (sb[sb.len() - 2], sb[sb.len() - 1]);
        let (m, k) = if transpose_a { (ca, ra) } else { (ra, ca) };
        let n = if transpose_b { rb } else { cb };
        let batch: usize = sa[..sa.len() - 2].iter().product();
        let shared_rhs = sb.len() == 2;
        let gemm = if shared_rhs && !transpose_a {
            // The batch folds into the rows: one (batch * m) x k by k x n product.
            Gemm { a: 0, b: 1, c: 0, m: batch * m, n, k, transpose_a, transpose_b, lda: ca, ldb: cb, ldc: n, stride_a: 0, stride_b: 0, stride_c: 0, batch: 1 }
        } else {
            let stride_b = if shared_rhs { 0 } else { rb * cb };
            Gemm { a: 0, b: 1, c: 0, m, n, k, transpose_a, transpose_b, lda: ca, ldb: cb, ldc: n, stride_a: ra * ca, stride_b, stride_c: m * n, batch }
        };
        Ok(DeviceKernel::Gemm(gemm))
    }
    fn summary(&self) -> &'static str {
        "batched matrix product lhs[..., m, k] x rhs[(...), k, n], optional transposes"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "lhs", constraint: "A" }, Slot { name: "rhs", constraint: "B" }],
            results: &[Slot { name: "out", constraint: "C" }],
            attrs: &[("transpose_lhs", AttrKind::Bool), ("transpose_rhs", AttrKind::Bool)],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        let dims = MatMul::dims(inputs[0], inputs[1], attrs)?;
        let mut shape = dims.batch;
        shape.extend([dims.m, dims.n]);
        Ok(vec![TensorTy::new(shape, inputs[0].dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], attrs: &Attrs) -> Cost {
        // 2*m*k*n per batch element (one multiply and one add per term).
        let flops = MatMul::dims(inputs[0], inputs[1], attrs)
            .map(|d| 2.0 * d.batch.iter().map(|&b| b as f64).product::<f64>() * (d.m * d.k) as f64 * d.n as f64)
            .unwrap_or(0.0);
        Cost { flops, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn kernel_class(&self, inputs: &[&TensorTy], attrs: &Attrs) -> KernelClass {
        let Ok(d) = MatMul::dims(inputs[0], inputs[1], attrs) else { return KernelClass::Memory };
        let batch = d.batch.iter().map(|&b| b as f64).product::<f64>();
        // A matrix shared by the batch is one GEMM over every batch row (as the kernels run it).
        let (batch, m) = if inputs[1].rank() == 2 { (1.0, batch * d.m as f64) } else { (batch, d.m as f64) };
        KernelClass::Gemm { batch, m, n: d.n as f64, k: d.k as f64 }
    }
    fn differentiable(&self) -> bool {
        true
    }
    fn vjp(&self, cx: &mut VjpCx<'_>, grads: &[Value]) -> Result<Vec<Option<Value>>, String> {
        // C = op(A) op(B), where op transposes the last two dims when its flag is set.
        let (a, b, dc) = (cx.operands[0], cx.operands[1], grads[0]);
        let ta = cx.attrs.bool("transpose_lhs")?;
        let tb = cx.attrs.bool("transpose_rhs")?;
        let mm = |ta: bool, tb: bool| {
            Attrs::new().with("transpose_lhs", AttrValue::Bool(ta)).with("transpose_rhs", AttrValue::Bool(tb))
        };
        // dA = dC op(B)^T, or op(B) dC^T when A enters transposed.
        let da = if ta { cx.emit("xf.matmul", &[b, dc], mm(tb, true))? } else { cx.emit("xf.matmul", &[dc, b], mm(false, !tb))? };
        let shared_rhs = cx.ty(b)?.rank() == 2 && cx.ty(a)?.rank() > 2;
        let db = if shared_rhs {
            // A matrix shared across the batch: its gradient sums every batch element.
            if ta {
                return Err("gradient of a shared rhs with a transposed batched lhs is not supported".into());
            }
            if tb { cx.emit("xf.matmul_wgrad", &[dc, a], Attrs::new())? } else { cx.emit("xf.matmul_wgrad", &[a, dc], Attrs::new())? }
        } else if tb {
            // dB = dC^T op(A)
            cx.emit("xf.matmul", &[dc, a], mm(true, ta))?
        } else {
            // dB = op(A)^T dC
            cx.emit("xf.matmul", &[a, dc], mm(!ta, false))?
        };
        Ok(vec![Some(da), Some(db)])
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], attrs: &Attrs) -> ShardingRule {
        // Factors: the batch dims of lhs, then m, k (contracted: a reduction), n.
        let (ra, rb) = (inputs[0].rank(), inputs[1].rank());
        let nb = ra - 2;
        let (m, k, n) = (nb, nb + 1, nb + 2);
        let ta = attrs.bool("transpose_lhs").unwrap_or(false);
        let tb = attrs.bool("transpose_rhs").unwrap_or(false);
        let mut lhs: Vec<usize> = (0..nb).collect();
        lhs.extend(if ta { [k, m] } else { [m, k] });
        let mut rhs: Vec<usize> = if rb > 2 { (0..nb).collect() } else { Vec::new() };
        rhs.extend(if tb { [n, k] } else { [k, n] });
        let mut out: Vec<usize> = (0..nb).collect();
        out.extend([m, n]);
        ShardingRule { operands: vec![lhs, rhs], results: vec![out], factors: vec![FactorKind::Free; nb + 3], linearity: Linearity::Product }
    }
}

/// `out[k, n] = sum over batch and m of a[..., m, k] * b[..., m, n]`: the gradient of a
/// weight matrix shared across every batch element (`a` the layer input, `b` the output
/// gradient), reduced in one GEMM with the batch folded into the contraction.
#[derive(Debug)]
pub struct MatMulWeightGrad;

impl OpDef for MatMulWeightGrad {
    fn mnemonic(&self) -> &'static str {
        "matmul_wgrad"
    }
    fn device(&self, cx: &KernelCx<'_>) -> Result<DeviceKernel, String> {
        // out[k, n] = a^T b, with a viewed as [rows, k] and b as [rows, n].
        let (a, b) = (dims(cx.inputs[0]), dims(cx.inputs[1]));
        let (k, n) = (*a.last().unwrap_or(&1), *b.last().unwrap_or(&1));
        let rows = a.iter().product::<usize>() / k.max(1);
        Ok(DeviceKernel::Gemm(Gemm { a: 0, b: 1, c: 0, m: k, n, k: rows, transpose_a: true, transpose_b: false, lda: k, ldb: n, ldc: n, stride_a: 0, stride_b: 0, stride_c: 0, batch: 1 }))
    }
    fn summary(&self) -> &'static str {
        "sum over batch of a[..., m, k]^T b[..., m, n] -> [k, n] (weight gradient)"
    }
    fn signature(&self) -> Signature {
        Signature {
            operands: &[Slot { name: "a", constraint: "A" }, Slot { name: "b", constraint: "B" }],
            results: &[Slot { name: "out", constraint: "C" }],
            attrs: &[],
        }
    }
    fn infer(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> Result<Vec<TensorTy>, String> {
        arity(inputs, 2)?;
        let (a, b) = (inputs[0], inputs[1]);
        float("a", a)?;
        float("b", b)?;
        same_dtype(a, b)?;
        rank_at_least("a", a, 2)?;
        if a.rank() != b.rank() || a.shape[..a.rank() - 1] != b.shape[..b.rank() - 1] {
            return Err(format!("a {a} and b {b} must agree in every dimension but the last"));
        }
        Ok(vec![TensorTy::new([a.shape[a.rank() - 1], b.shape[b.rank() - 1]], a.dtype)])
    }
    fn cost(&self, inputs: &[&TensorTy], outputs: &[TensorTy], _attrs: &Attrs) -> Cost {
        let rows = inputs[0].num_elements() as f64 / inputs[0].last_dim().unwrap_or(1).max(1) as f64;
        let (k, n) = (outputs[0].shape[0] as f64, outputs[0].shape[1] as f64);
        Cost { flops: 2.0 * rows * k * n, bytes: io_bytes(inputs, outputs), special: 0.0 }
    }
    fn kernel_class(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> KernelClass {
        // One GEMM contracting every row: [k, rows] x [rows, n].
        let (a, b) = (inputs[0], inputs[1]);
        let rows = a.num_elements() as f64 / a.last_dim().unwrap_or(1).max(1) as f64;
        KernelClass::Gemm { batch: 1.0, m: a.last_dim().unwrap_or(1) as f64, n: b.last_dim().unwrap_or(1) as f64, k: rows }
    }
    fn sharding_rule(&self, inputs: &[&TensorTy], _attrs: &Attrs) -> ShardingRule {
        // The shared leading dims (batch and m) are reductions; k and n pass.
        let r = inputs[0].rank();
        let (k, n) = (r - 1, r);
        let mut a: Vec<usize> = (0..r - 1).collect();
        a.push(k);
        let mut b: Vec<usize> = (0..r - 1).collect();
        b.push(n);
        ShardingRule { operands: vec![a, b], results: vec![vec![k, n]], factors: vec![FactorKind::Free; r + 1], linearity: Linearity::Product }
    }
}
