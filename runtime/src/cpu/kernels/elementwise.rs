//! CPU kernels: Element-wise ops (`ir/src/ops/elementwise.rs`).

use super::*;

pub(super) const KERNELS: &[CpuKernel] = &[
    kernel!("xf.add", add_kernel),
    kernel!("xf.mul", mul_kernel),
    kernel!("xf.scale", scale_kernel),
    kernel!("xf.gelu", gelu_kernel),
    kernel!("xf.gelu_grad", gelu_grad_kernel),
    kernel!("xf.silu", silu_kernel),
    kernel!("xf.silu_grad", silu_grad_kernel),
    kernel!("xf.swiglu", swiglu_kernel),
    kernel!("xf.swiglu_grad", swiglu_grad_kernel),
];

fn add_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    broadcast::<T>(ins, outs, |a, b| a + b)
}
fn mul_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    broadcast::<T>(ins, outs, |a, b| a * b)
}
fn scale_kernel<T: Real>(instr: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    let factor = T::of(instr.float("factor")?);
    unary::<T>(ins, outs, |x| x * factor)
}
fn gelu_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    unary::<T>(ins, outs, gelu)
}
fn gelu_grad_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    binary::<T>(ins, outs, |x, dy| dy * gelu_derivative(x))
}
fn silu_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    unary::<T>(ins, outs, |x| x * sigmoid(x))
}
fn silu_grad_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    binary::<T>(ins, outs, |x, dy| dy * silu_derivative(x))
}
fn swiglu_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    binary::<T>(ins, outs, |g, u| g * sigmoid(g) * u)
}
fn swiglu_grad_kernel<T: Real>(_: &Instr, ins: &[In<'_>], outs: &mut [Out<'_>], _: &RankCx) -> Result<(), String> {
    swiglu_grad::<T>(ins, outs)
}

pub(super) fn sigmoid<T: Real>(x: T) -> T {
    T::one() / (T::one() + (-x).exp())
}

pub(super) fn silu_derivative<T: Real>(x: T) -> T {
    let s = sigmoid(x);
    s * (T::one() + x * (T::one() - s))
}

pub(super) const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)

pub(super) const GELU_A: f64 = 0.044_715;

pub(crate) fn gelu<T: Real>(x: T) -> T {
    let u = T::of(GELU_C) * (x + T::of(GELU_A) * x * x * x);
    T::of(0.5) * x * (T::one() + u.tanh())
}

pub(crate) fn gelu_derivative<T: Real>(x: T) -> T {
    let u = T::of(GELU_C) * (x + T::of(GELU_A) * x * x * x);
    let t = u.tanh();
    let du = T::of(GELU_C) * (T::one() + T::of(3.0 * GELU_A) * x * x);
    T::of(0.5) * (T::one() + t) + T::of(0.5) * x * (T::one() - t * t) * du
}

pub(super) fn swiglu_grad<T: Real>(ins: &[In<'_>], outs: &mut [Out<'_>]) -> Result<(), String> {
    let (g, u, dy) = (ins[0].get::<T>()?, ins[1].get::<T>()?, ins[2].get::<T>()?);
    let (first, rest) = outs.split_at_mut(1);
    let (dg, du) = (first[0].get::<T>()?, rest[0].get::<T>()?);
    dg.par_chunks_mut(4096).zip(du.par_chunks_mut(4096)).enumerate().for_each(|(c, (dg, du))| {
        let base = c * 4096;
        for j in 0..dg.len() {
            let (g, u, dy) = (g[base + j], u[base + j], dy[base + j]);
            dg[j] = dy * u * silu_derivative(g);
            du[j] = dy * g * sigmoid(g);
        }
    });
    Ok(())
}
