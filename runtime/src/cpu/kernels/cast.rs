//! CPU kernels: `xf.cast` (`ir/src/ops/cast.rs`).

use super::*;

/// One kernel for both instances: the types it converts between are the buffers' own.
pub(super) const KERNELS: &[CpuKernel] = &[CpuKernel { op: "xf.cast", f32: cast_kernel, f64: cast_kernel, scratch: |_, _| 0 }];

fn cast_kernel(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    cast(ins, outs)
}

/// `xf.cast`: the value in the result's type (bf16 operands and results arrive widened to
/// f32; the executor rounds a bf16 result).
pub(super) fn cast(ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    match (ins[0].dtype(), outs[0].buffer.dtype) {
        (DType::F32, DType::F32) => outs[0].get::<f32>()?.copy_from_slice(ins[0].get::<f32>()?),
        (DType::F64, DType::F64) => outs[0].get::<f64>()?.copy_from_slice(ins[0].get::<f64>()?),
        (DType::F32, DType::F64) => outs[0].get::<f64>()?.iter_mut().zip(ins[0].get::<f32>()?).for_each(|(d, &s)| *d = s as f64),
        (DType::F64, DType::F32) => outs[0].get::<f32>()?.iter_mut().zip(ins[0].get::<f64>()?).for_each(|(d, &s)| *d = s as f32),
        (from, to) => return Err(format!("no cast from {from:?} to {to:?}")),
    }
    Ok(())
}
