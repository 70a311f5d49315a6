//! CPU kernels of every `xf` op, generic over f32 and f64.
//!
//! Semantics are those documented on the ops in `ir/src/ops`. Parallel loops split work over
//! rows (rayon); every reduction across rows sums fixed chunks in a fixed order, so results
//! are bit-identical from run to run whatever the thread schedule.

use num_traits::Float;
use rayon::prelude::*;

use super::gemm::{matmul as gemm_matmul, Strided};
use super::{Element, In, Out, RankCx};
use crate::program::{DType, Instr};

/// A kernel of one op for one element type.
type KernelFn = fn(&Instr, &[In<'_>], &mut [Out<'_>], &RankCx) -> Result<(), String>;

/// Elements of working memory a kernel allocates while it runs, beyond its operands, from
/// the instruction and its operands' shapes.
type ScratchFn = fn(&Instr, &[&[usize]]) -> usize;

/// An op's CPU kernels: its f32 and f64 instances (bf16 runs widened to f32), and the
/// working memory they allocate.
pub(crate) struct CpuKernel {
    op: &'static str,
    f32: KernelFn,
    f64: KernelFn,
    scratch: ScratchFn,
}

/// The entry of `op` for a generic kernel `f::<T>` (allocating `scratch` elements, or no more
/// than a row or two).
macro_rules! kernel {
    ($op:literal, $f:ident) => {
        CpuKernel { op: $op, f32: $f::<f32>, f64: $f::<f64>, scratch: |_, _| 0 }
    };
    ($op:literal, $f:ident, $scratch:expr) => {
        CpuKernel { op: $op, f32: $f::<f32>, f64: $f::<f64>, scratch: $scratch }
    };
}

mod attention;
mod cast;
mod elementwise;
// The emulated device's GEMM epilogues apply the CPU kernels' GELU.
#[cfg(feature = "cuda")]
pub(crate) use elementwise::{gelu, gelu_derivative};
mod embedding;
mod heads;
mod loss;
mod matmul;
mod moe;
mod norm;
mod optim;
mod reduce;
mod rope;

pub use optim::learning_rate;

/// Every op's CPU kernels, by family: one file per file of `ir/src/ops`, each listing its
/// ops' kernels beside them. Adding an op adds its kernel and its entry to its family's file.
const FAMILIES: &[&[CpuKernel]] = &[attention::KERNELS, cast::KERNELS, elementwise::KERNELS, embedding::KERNELS, heads::KERNELS, loss::KERNELS, matmul::KERNELS, moe::KERNELS, norm::KERNELS, optim::KERNELS, reduce::KERNELS, rope::KERNELS];

/// The kernels by op name (every op once: see the test below).
fn registry() -> &'static std::collections::HashMap<&'static str, &'static CpuKernel> {
    static REGISTRY: std::sync::OnceLock<std::collections::HashMap<&'static str, &'static CpuKernel>> = std::sync::OnceLock::new();
    REGISTRY.get_or_init(|| FAMILIES.iter().flat_map(|family| family.iter()).map(|k| (k.op, k)).collect())
}

/// Whether `op` has a CPU kernel.
pub(crate) fn supported(op: &str) -> bool {
    registry().contains_key(op)
}

/// The ops with CPU kernels.
pub(crate) fn ops() -> impl Iterator<Item = &'static str> {
    FAMILIES.iter().flat_map(|family| family.iter()).map(|k| k.op)
}

/// Bytes of working memory the kernel of instruction `instr` of `program` allocates while it
/// runs, beyond its operands' storage, in the element type it computes in: f64 with an f64
/// operand, else f32 (bf16 operands are widened first; see `run_widened`).
pub(crate) fn scratch_bytes(program: &crate::program::Program, instr: &Instr) -> usize {
    let Some(kernel) = registry().get(instr.op.as_str()) else { return 0 };
    let buffers = instr.inputs.iter().chain(&instr.outputs).filter_map(|&b| program.buffers.get(b));
    let element = if buffers.clone().any(|b| b.dtype == DType::F64) { 8 } else { 4 };
    let shapes: Vec<&[usize]> = instr.inputs.iter().filter_map(|&b| program.buffers.get(b)).map(|b| b.shape.as_slice()).collect();
    (kernel.scratch)(instr, &shapes).saturating_mul(element)
}

/// Runs one instruction in the element type of its float buffers.
pub(crate) fn run(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], cx: &RankCx) -> Result<(), String> {
    let kernel = registry().get(instr.op.as_str()).ok_or_else(|| format!("no CPU kernel for `{}`", instr.op))?;
    let float = ins.iter().map(|i| i.dtype()).chain(outs.iter().map(|o| o.buffer.dtype)).find(|d| *d != DType::I32);
    match float {
        Some(DType::F64) => (kernel.f64)(instr, ins, outs, cx),
        _ => (kernel.f32)(instr, ins, outs, cx),
    }
}

/// The `head_dim` of an op that works per head of `[b, s, heads * head_dim]`.
pub(crate) fn head_dim(instr: &Instr) -> Result<usize, String> {
    usize::try_from(instr.int("head_dim")?).ok().filter(|&d| d > 0).ok_or_else(|| format!("`{}`: head_dim must be positive", instr.op))
}

/// The zigzag order of the sequence an op reads positions of (`xf.zigzag`: chunks and whole
/// length), `(1, 0)` for the natural order.
pub(crate) fn zigzag_order(instr: &Instr) -> (usize, usize) {
    shardc_ir::ops::zigzag_of(instr.ints(shardc_ir::ops::ZIGZAG_ATTR).ok().as_deref())
}

/// Float types with kernels.
pub(crate) trait Real: Float + Element + std::iter::Sum + std::ops::AddAssign + std::ops::SubAssign + std::ops::MulAssign + Send + Sync {
    fn of(v: f64) -> Self;
}

impl Real for f32 {
    fn of(v: f64) -> Self {
        v as f32
    }
}

impl Real for f64 {
    fn of(v: f64) -> Self {
        v
    }
}

/// Rows handled per parallel task in row-wise kernels and fixed-order reductions.
pub(super) const ROW_CHUNK: usize = 16;

pub(super) fn unary<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], f: impl Fn(T) -> T + Sync) -> Result<(), String> {
    let x = ins[0].get::<T>()?;
    let y = outs[0].get::<T>()?;
    y.par_chunks_mut(4096).zip(x.par_chunks(4096)).for_each(|(y, x)| y.iter_mut().zip(x).for_each(|(y, &x)| *y = f(x)));
    Ok(())
}

pub(super) fn binary<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], f: impl Fn(T, T) -> T + Sync) -> Result<(), String> {
    let (a, b) = (ins[0].get::<T>()?, ins[1].get::<T>()?);
    let y = outs[0].get::<T>()?;
    y.par_chunks_mut(4096)
        .zip(a.par_chunks(4096).zip(b.par_chunks(4096)))
        .for_each(|(y, (a, b))| y.iter_mut().zip(a.iter().zip(b)).for_each(|(y, (&a, &b))| *y = f(a, b)));
    Ok(())
}

/// `out[i] = f(a[i], b[i mod len(b)])`: `b` broadcast over the leading dims of `a`. When
/// the op runs in place (`out` is `a`'s buffer), `a` is read from `out`.
pub(super) fn broadcast<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], f: impl Fn(T, T) -> T + Sync) -> Result<(), String> {
    let b = ins[1].get::<T>()?;
    let y = outs[0].get::<T>()?;
    let n = b.len().max(1);
    if ins[0].is_taken() {
        y.par_chunks_mut(n).for_each(|y| {
            for (y, &b) in y.iter_mut().zip(b) {
                *y = f(*y, b);
            }
        });
        return Ok(());
    }
    let a = ins[0].get::<T>()?;
    y.par_chunks_mut(n).zip(a.par_chunks(n)).for_each(|(y, a)| {
        for ((y, &a), &b) in y.iter_mut().zip(a).zip(b) {
            *y = f(a, b);
        }
    });
    Ok(())
}

/// For an in-place update, copies each operand's old value into its result unless the
/// result already is the operand's buffer (then the input slot is empty).
pub(super) fn seed_in_place<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>], pairs: &[(usize, usize)]) -> Result<(), String> {
    for &(out, input) in pairs {
        if !ins[input].is_taken() {
            let old = ins[input].get::<T>()?;
            outs[out].get::<T>()?.copy_from_slice(old);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Every op has one entry: a second would shadow the first in the registry.
    #[test]
    fn every_op_is_registered_once() {
        let mut ops: Vec<&str> = super::ops().collect();
        let all = ops.len();
        ops.sort_unstable();
        ops.dedup();
        assert_eq!(ops.len(), all, "an op is registered twice");
    }
}
