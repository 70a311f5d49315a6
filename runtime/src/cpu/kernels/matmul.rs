//! CPU kernels: Matrix products (`ir/src/ops/matmul.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[kernel!("xf.matmul", matmul_kernel), kernel!("xf.matmul_wgrad", matmul_wgrad_kernel)];

fn matmul_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    matmul::<T>(instr, ins, outs)
}
fn matmul_wgrad_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    matmul_wgrad::<T>(ins, outs)
}

pub(super) fn matmul<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (ta, tb) = (instr.bool("transpose_lhs")?, instr.bool("transpose_rhs")?);
    let (sa, sb) = (ins[0].shape(), ins[1].shape());
    let (a, b) = (ins[0].get::<T>()?, ins[1].get::<T>()?);
    let (ra, ca) = (sa[sa.len() - 2], sa[sa.len() - 1]);
    let (rb, cb) = (sb[sb.len() - 2], sb[sb.len() - 1]);
    let (m, k) = if ta { (ca, ra) } else { (ra, ca) };
    let n = if tb { rb } else { cb };
    let batch: usize = sa[..sa.len() - 2].iter().product();
    let shared_rhs = sb.len() == 2;
    let y = outs[0].get::<T>()?;
    if shared_rhs && !ta {
        // The batch folds into the rows: one product of (batch * m) x k by k x n.
        return gemm_matmul(y, a, Strided::row_major(batch * m, k, false), b, Strided::row_major(k, n, tb), false);
    }
    for i in 0..batch {
        let a_i = &a[i * ra * ca..(i + 1) * ra * ca];
        let b_i = if shared_rhs { b } else { &b[i * rb * cb..(i + 1) * rb * cb] };
        gemm_matmul(&mut y[i * m * n..(i + 1) * m * n], a_i, Strided::row_major(m, k, ta), b_i, Strided::row_major(k, n, tb), false)?;
    }
    Ok(())
}

pub(super) fn matmul_wgrad<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (a, b) = (ins[0].get::<T>()?, ins[1].get::<T>()?);
    let k = *ins[0].shape().last().unwrap_or(&1);
    let n = *ins[1].shape().last().unwrap_or(&1);
    let rows = a.len() / k.max(1);
    // out = a^T b with a viewed as rows x k.
    gemm_matmul(outs[0].get::<T>()?, a, Strided::row_major(k, rows, true), b, Strided::row_major(rows, n, false), false)
}
