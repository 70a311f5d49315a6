//! GEMM epilogues (issue 18 §5, cuBLASLt's fused bias, GELU and GELU-gradient epilogues):
//! one-chain programs whose device plans fold the element-wise ops into the GEMM, run on the
//! emulated device (cuBLASLt's contract, and the plain GEMM followed by the prelude's
//! epilogue kernel, what a GPU runs where cuBLASLt has no algorithm) against the CPU backend.

use shardc_codegen::device::device_plan;
use shardc_ir::attrs::{AttrValue, Attrs};
use shardc_ir::graph::{ArgRole, FuncBuilder};
use shardc_ir::types::{DType, TensorTy};
use shardc_runtime::program::{DeviceCall, EpilogueActivation};
use shardc_runtime::Program;

/// `y = gelu(x w + b)`, with the pre-activation `h = x w + b` a result too (so the epilogue
/// stores it), and `dx = (dy w^T) * gelu'(h)`; plus `z = x w + b` alone (bias only), over
/// `x [batch, rows, k]`, `w [k, n]`.
fn chain(batch: i64, rows: i64, k: i64, n: i64, dtype: DType) -> Program {
    let mut fb = FuncBuilder::new("chain");
    let x = fb.arg("x", TensorTy::new(vec![batch, rows, k], dtype), ArgRole::Input);
    let w = fb.arg("w", TensorTy::new(vec![k, n], dtype), ArgRole::Input);
    let b = fb.arg("b", TensorTy::new(vec![n], dtype), ArgRole::Input);
    let w2 = fb.arg("w2", TensorTy::new(vec![k, n], dtype), ArgRole::Input);
    let dy = fb.arg("dy", TensorTy::new(vec![batch, rows, k], dtype), ArgRole::Input);
    let plain = |t: bool| Attrs::new().with("transpose_lhs", AttrValue::Bool(false)).with("transpose_rhs", AttrValue::Bool(t));
    let p = fb.op("xf.matmul", &[x, w], plain(false), "up").unwrap();
    let h = fb.op("xf.add", &[p, b], Attrs::new(), "up.bias_add").unwrap();
    let y = fb.op("xf.gelu", &[h], Attrs::new(), "act").unwrap();
    let q = fb.op("xf.matmul", &[x, w2], plain(false), "side").unwrap();
    let z = fb.op("xf.add", &[q, b], Attrs::new(), "side.bias_add").unwrap();
    let dh = fb.op("xf.matmul", &[dy, w2], plain(false), "back").unwrap();
    let dx = fb.op("xf.gelu_grad", &[h, dh], Attrs::new(), "act.grad").unwrap();
    let names: Vec<String> = ["y", "h", "z", "dx"].iter().map(|s| s.to_string()).collect();
    let func = fb.finish(&[y, h, z, dx], &names);
    shardc_codegen::lower_func(&func).unwrap()
}

#[test]
fn chains_become_one_gemm_each() {
    let plan = device_plan(&chain(2, 3, 5, 5, DType::F32)).unwrap();
    let epilogues: Vec<(bool, EpilogueActivation, bool)> = plan
        .calls
        .iter()
        .flatten()
        .filter_map(|c| if let DeviceCall::GemmEpilogue { epilogue: e, .. } = c { Some((e.bias.is_some(), e.activation, e.aux.is_some())) } else { None })
        .collect();
    assert_eq!(epilogues, [(true, EpilogueActivation::Gelu, true), (true, EpilogueActivation::None, false), (false, EpilogueActivation::GeluGrad, true)]);
    assert!(!plan.calls.iter().flatten().any(|c| matches!(c, DeviceCall::Launch { .. })), "nothing element-wise is left: {:?}", plan.calls);
}

/// The fused contract and the fallback kernel both equal the CPU backend, in f32 and bf16
/// (the fused form rounds once, after the epilogue; the fallback rounds the product first,
/// as the unfused ops do), at odd sizes and a batched GEMM.
#[cfg(feature = "cuda")]
#[test]
fn fused_and_fallback_epilogues_equal_the_cpu() {
    use shardc_runtime::cuda::{device::Device, emulate::Emulated, gemm_then_epilogue, gemm_with_epilogue, CudaExecutor, Placement};
    for (batch, rows, k, n, dtype) in [(1, 1, 1, 1, DType::F32), (2, 3, 5, 7, DType::F32), (3, 17, 33, 65, DType::F32), (2, 9, 24, 40, DType::Bf16)] {
        let what = format!("{batch}x{rows}x{k}x{n} {dtype:?}");
        let program = shardc_codegen::device::with_device_plan(chain(batch, rows, k, n, dtype)).unwrap();
        let mut cpu = shardc_runtime::cpu::CpuExecutor::new(program.clone()).unwrap();
        let mut device = CudaExecutor::new(program.clone(), &Placement::Emulated).unwrap();
        let mut inputs = Vec::new();
        for (i, name) in ["x", "w", "b", "w2", "dy"].iter().enumerate() {
            let len = program.buffers[program.arg(name).unwrap().buffer].len();
            let values: Vec<f64> = (0..len).map(|j| 2.0 * (shardc_runtime::init::uniform(i as u64 + 5, j as u64) - 0.5)).collect();
            cpu.write_f64(name, &values).unwrap();
            device.write(0, name, &values).unwrap();
            inputs.push(values);
        }
        cpu.run().unwrap();
        device.run().unwrap();
        let tolerance = if dtype == DType::Bf16 { 2e-2 } else { 1e-5 };
        for name in ["y", "h", "z", "dx"] {
            let (c, g) = (cpu.read_f64(name).unwrap(), device.read(0, name).unwrap());
            let rel = c.iter().zip(&g).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / c.iter().map(|x| x.abs()).fold(1.0, f64::max);
            assert!(rel <= tolerance, "{what}: `{name}` differs by {rel:.2e}");
        }

        // The device calls themselves on a fresh emulated device: the fused call, and the
        // plain GEMM then the epilogue kernel, for every call of the plan.
        let plan = program.device.clone().unwrap();
        let kernels = vec![shardc_runtime::program::GEMM_EPILOGUE_KERNEL.to_string()];
        let mut emulated = Emulated::new(&plan.source, &kernels).unwrap();
        let bytes = dtype.bytes();
        let upload = |values: &[f64], emulated: &mut Emulated| {
            let ptr = emulated.alloc(values.len() * bytes).unwrap();
            let raw: Vec<u8> = values.iter().flat_map(|&v| if dtype == DType::Bf16 { shardc_runtime::cuda::bf16_bits(v as f32).to_le_bytes().to_vec() } else { (v as f32).to_le_bytes().to_vec() }).collect();
            emulated.upload(ptr, &raw).unwrap();
            ptr
        };
        let len = (batch * rows * n) as usize;
        let (x, w, b, dy) = (upload(&inputs[0], &mut emulated), upload(&inputs[1], &mut emulated), upload(&inputs[2], &mut emulated), upload(&inputs[4], &mut emulated));
        let pre = upload(&cpu.read_f64("h").unwrap(), &mut emulated);
        let read = |ptr: u64, emulated: &Emulated| -> Vec<f64> {
            let mut raw = vec![0u8; len * bytes];
            emulated.download(&mut raw, ptr).unwrap();
            raw.chunks(bytes).map(|c| if dtype == DType::Bf16 { f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64 } else { f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64 }).collect()
        };
        use shardc_runtime::cuda::device::{ColumnMajorGemm, DeviceEpilogue};
        let gemm = |a: u64, c: u64| {
            let g = shardc_ir::kernel::Gemm { a: 0, b: 1, c: 2, m: (batch * rows) as usize, n: n as usize, k: k as usize, transpose_a: false, transpose_b: false, lda: k as usize, ldb: n as usize, ldc: n as usize, stride_a: 0, stride_b: 0, stride_c: 0, batch: 1 };
            ColumnMajorGemm::of(&g, a, w, c)
        };
        for (activation, bias, aux_in, expect) in [
            (EpilogueActivation::Gelu, true, false, "y"),
            (EpilogueActivation::None, true, false, "h"),
            (EpilogueActivation::GeluGrad, false, true, "dx"),
        ] {
            // `dx` multiplies dy by w here (the chain's `back` product is dy w2; w2 = w below).
            let a = if activation == EpilogueActivation::GeluGrad { dy } else { x };
            let (fused_out, fallback_out, aux_fused, aux_fallback) = (emulated.alloc(len * bytes).unwrap(), emulated.alloc(len * bytes).unwrap(), emulated.alloc(len * bytes).unwrap(), emulated.alloc(len * bytes).unwrap());
            let epilogue = |aux_out: u64| DeviceEpilogue { bias: if bias { b } else { 0 }, activation, aux: if aux_in { pre } else if activation == EpilogueActivation::Gelu { aux_out } else { 0 } };
            gemm_with_epilogue(&emulated, dtype, &gemm(a, fused_out), &epilogue(aux_fused), len, n as usize).unwrap();
            gemm_then_epilogue(&emulated, dtype, &gemm(a, fallback_out), &epilogue(aux_fallback), len, n as usize).unwrap();
            let (fused, fallback) = (read(fused_out, &emulated), read(fallback_out, &emulated));
            let rel = fused.iter().zip(&fallback).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / fused.iter().map(|x| x.abs()).fold(1.0, f64::max);
            assert!(rel <= tolerance, "{what} {activation:?}: fused and fallback differ by {rel:.2e}");
            if activation == EpilogueActivation::Gelu {
                // Both store the pre-activation, equal to the CPU's `h`.
                let h = cpu.read_f64("h").unwrap();
                for aux in [aux_fused, aux_fallback] {
                    let stored = read(aux, &emulated);
                    let rel = stored.iter().zip(&h).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / h.iter().map(|x| x.abs()).fold(1.0, f64::max);
                    assert!(rel <= tolerance, "{what}: the stored pre-activation differs by {rel:.2e}");
                }
            }
            if expect != "dx" {
                let c = cpu.read_f64(expect).unwrap();
                let rel = fused.iter().zip(&c).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / c.iter().map(|x| x.abs()).fold(1.0, f64::max);
                assert!(rel <= tolerance, "{what} {activation:?}: differs from the CPU's `{expect}` by {rel:.2e}");
            }
        }
    }
}

/// A plan read from a file that names a buffer the program lacks (in an epilogue, say) is
/// refused when it is loaded, never turned into a pointer.
#[cfg(feature = "cuda")]
#[test]
fn a_device_call_naming_a_missing_buffer_is_refused() {
    use shardc_runtime::cuda::{CudaExecutor, Placement};
    let mut program = shardc_codegen::device::with_device_plan(chain(1, 2, 3, 4, DType::F32)).unwrap();
    let buffers = program.buffers.len();
    let plan = program.device.as_mut().unwrap();
    let call = plan.calls.iter_mut().flatten().find(|c| matches!(c, DeviceCall::GemmEpilogue { .. })).unwrap();
    if let DeviceCall::GemmEpilogue { epilogue, .. } = call {
        epilogue.bias = Some(buffers + 7);
    }
    let message = CudaExecutor::new(program, &Placement::Emulated).err().expect("refused").to_string();
    assert!(message.contains(&format!("names buffer {}", buffers + 7)), "{message}");

    // Epilogues whose buffers do not fit them: GELU's gradient without its pre-activation, a
    // bias of the wrong length, a product past its buffer, dimensions that overflow.
    let fresh = || shardc_codegen::device::with_device_plan(chain(1, 2, 3, 4, DType::F32)).unwrap();
    let edit = |f: &dyn Fn(&mut shardc_runtime::program::Gemm, &mut shardc_runtime::program::Epilogue, usize), want: &str| {
        let mut program = fresh();
        let x = program.arg("x").unwrap().buffer;
        let plan = program.device.as_mut().unwrap();
        for call in plan.calls.iter_mut().flatten() {
            if let DeviceCall::GemmEpilogue { gemm, epilogue } = call {
                f(gemm, epilogue, x);
            }
        }
        let message = CudaExecutor::new(program, &Placement::Emulated).err().expect("refused").to_string();
        assert!(message.contains(want), "{want}: {message}");
    };
    edit(&|_, e, _| if e.activation == EpilogueActivation::GeluGrad { e.aux = None }, "without the pre-activation");
    edit(&|_, e, x| if e.bias.is_some() { e.bias = Some(x) }, "not one vector");
    edit(&|g, _, _| g.m *= 100, "into a smaller buffer");
    edit(&|g, _, _| g.batch = usize::MAX, "outside cuBLAS's range");
}
