//! The norm kernels (issue 18 §5): one read of the row from global memory when it fits in
//! shared memory, the re-reading fallback for wider rows, and parameter gradients reduced in
//! two deterministic stages (per chunk of rows, then the chunks in order). Forward and
//! backward of layernorm and rmsnorm on one-op programs, the device plan's launches checked
//! here and (with `--features cuda`) the values on the emulated device against the CPU
//! backend.

use shardc_codegen::device::device_plan;
use shardc_ir::attrs::{AttrValue, Attrs};
use shardc_ir::graph::{ArgRole, FuncBuilder};
use shardc_ir::types::{DType, TensorTy};
use shardc_runtime::program::{DeviceCall, DevicePlan};
use shardc_runtime::Program;

/// Features wider than the row kernels' shared-memory cache in fp32 (25312 forward, 12656
/// backward, in the 99 KiB a block may opt into), so both fall back to reading the row from
/// global memory on every pass.
const WIDE: i64 = 25_313;

/// GPT-3's hidden size, and one more: cached both ways in fp32, past the 48 KiB a block has
/// without opting in.
const GPT3: i64 = 12_289;

/// Forward and backward of a layernorm (`centered`) or rmsnorm over `x [rows, n]`: results
/// `y`, `dx`, `dgamma` and (layernorm) `dbeta`.
fn norm_program(centered: bool, rows: i64, n: i64, dtype: DType) -> Program {
    let (xt, pt) = (TensorTy::new(vec![rows, n], dtype), TensorTy::new(vec![n], dtype));
    let mut fb = FuncBuilder::new("norm");
    let x = fb.arg("x", xt.clone(), ArgRole::Input);
    let gamma = fb.arg("gamma", pt.clone(), ArgRole::Input);
    let beta = centered.then(|| fb.arg("beta", pt, ArgRole::Input));
    let dy = fb.arg("dy", xt, ArgRole::Input);
    let (op, operands) = match beta {
        Some(beta) => ("layernorm", vec![x, gamma, beta]),
        None => ("rmsnorm", vec![x, gamma]),
    };
    let attrs = Attrs::new().with("epsilon", AttrValue::Float(1e-5));
    let y = fb.op_multi(&format!("xf.{op}"), &operands, attrs.clone(), "fwd").unwrap();
    let grads = fb.op_multi(&format!("xf.{op}_grad"), &[x, gamma, dy], attrs, "bwd").unwrap();
    let mut results = vec![y[0]];
    results.extend(&grads);
    let names: Vec<String> = results_of(centered).iter().map(|s| s.to_string()).collect();
    let func = fb.finish(&results, &names);
    shardc_codegen::lower_func(&func).unwrap()
}

fn results_of(centered: bool) -> &'static [&'static str] {
    if centered { &["y", "dx", "dgamma", "dbeta"] } else { &["y", "dx", "dgamma"] }
}

/// `(grid, shared bytes)` of every launch of `kernel` in the plan.
fn launches(plan: &DevicePlan, kernel: &str) -> Vec<([u32; 3], u32)> {
    plan.calls
        .iter()
        .flatten()
        .filter_map(|c| match c {
            DeviceCall::Launch { kernel: k, grid, shared_bytes, block, .. } if k == kernel => {
                assert_eq!(block % 32, 0, "`{kernel}`: {block} threads");
                Some((*grid, *shared_bytes))
            }
            _ => None,
        })
        .collect()
}

/// The row kernels keep the row in shared memory up to the limit (x and dy * gamma backward)
/// and not beyond it; the parameter gradients take one chunk of rows per 64 and no more than
/// 256 chunks, in tiles of 32 features.
#[test]
fn norm_launches_cache_rows_that_fit_and_chunk_the_parameter_gradients() {
    for centered in [true, false] {
        for (rows, n, dtype, forward_cached, backward_cached) in [
            (257, 773, DType::F32, true, true),
            (3, GPT3, DType::F32, true, true),
            (3, 12_657, DType::F32, true, false),
            (3, WIDE, DType::F32, false, false),
            (3, 6_320, DType::F64, true, true),
            (3, 6_321, DType::F64, true, false),
            (3, 12_641, DType::F64, false, false),
        ] {
            let what = format!("centered={centered} rows={rows} n={n} {dtype:?}");
            let acc = if dtype == DType::F64 { 8 } else { 4 };
            let plan = device_plan(&norm_program(centered, rows, n, dtype)).unwrap();
            assert_eq!(launches(&plan, "norm_rows"), vec![([rows as u32, 1, 1], if forward_cached { (n * acc) as u32 } else { 0 })], "{what}");
            assert_eq!(launches(&plan, "norm_grad_rows"), vec![([rows as u32, 1, 1], if backward_cached { (2 * n * acc) as u32 } else { 0 })], "{what}");
            let chunks = (rows as u32).div_ceil(64);
            assert_eq!(launches(&plan, "norm_grad_param_chunks"), vec![([(n as u32).div_ceil(32), chunks, 1], 2 * 256 * acc as u32)], "{what}");
            // Statistics, then dgamma's partials (and dbeta's).
            let partials = (1 + centered as usize) * chunks as usize * n as usize;
            assert_eq!(plan.workspace_bytes, (2 * rows as usize + partials) * acc as usize, "{what}");
        }
    }
    // 8192 rows (batch 8 x 1024 positions) of 768: 128 chunks of 64 rows, 24 x 128 blocks of
    // 256 threads in the first stage; a million rows: 256 chunks of 4096.
    for (rows, chunks) in [(8_192u32, 128u32), (1 << 20, 256)] {
        let plan = device_plan(&norm_program(true, rows as i64, 768, DType::F32)).unwrap();
        assert_eq!(launches(&plan, "norm_grad_param_chunks")[0].0, [24, chunks, 1], "{rows} rows");
    }
}

/// Forward and backward on the emulated device equal the CPU backend: rows 1, 3 and 257
/// (several chunks of the parameter gradients, the last of one row), features 1, 7, 773 and
/// 12289 (rows cached in shared memory, the last in more than 48 KiB) and wider than the
/// cache (re-read from global memory), in f32, and a cached and a re-read width in f64.
#[cfg(feature = "cuda")]
#[test]
fn norm_kernels_on_the_emulated_device_equal_the_cpu() {
    use shardc_runtime::cuda::{CudaExecutor, Placement};
    let mut cases = Vec::new();
    for rows in [1, 3, 257] {
        for n in [1, 7, 773, GPT3, WIDE] {
            cases.push((rows, n, DType::F32));
        }
    }
    cases.extend([(257, 773, DType::F64), (3, 12_641, DType::F64)]);
    for centered in [true, false] {
        for &(rows, n, dtype) in &cases {
            let what = format!("{} rows={rows} n={n} {dtype:?}", if centered { "layernorm" } else { "rmsnorm" });
            let program = shardc_codegen::device::with_device_plan(norm_program(centered, rows, n, dtype)).unwrap();
            let mut cpu = shardc_runtime::cpu::CpuExecutor::new(program.clone()).unwrap();
            let mut device = CudaExecutor::new(program.clone(), &Placement::Emulated).unwrap();
            for (i, name) in ["x", "gamma", "beta", "dy"].iter().enumerate().filter(|(_, name)| centered || **name != "beta") {
                let len = program.buffers[program.arg(name).unwrap().buffer].len();
                let u = |j: usize| shardc_runtime::init::uniform(i as u64 + 21, j as u64) - 0.5;
                // Rows with an offset and a spread (the two-pass variance's case), a gamma
                // near 1.
                let values: Vec<f64> = match *name {
                    "x" => (0..len).map(|j| 3.0 + 4.0 * u(j) + 0.25 * (j % 5) as f64).collect(),
                    "gamma" => (0..len).map(|j| 1.0 + u(j)).collect(),
                    _ => (0..len).map(|j| 2.0 * u(j)).collect(),
                };
                cpu.write_f64(name, &values).unwrap();
                device.write(0, name, &values).unwrap();
            }
            cpu.run().unwrap();
            device.run().unwrap();
            for name in results_of(centered) {
                let (c, g) = (cpu.read_f64(name).unwrap(), device.read(0, name).unwrap());
                assert_eq!(c.len(), g.len(), "{what}: `{name}`");
                // Against the values' scale, at least 1: with one feature, y and dx are 0 up
                // to rounding.
                let rel = c.iter().zip(&g).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / c.iter().map(|x| x.abs()).fold(1.0, f64::max);
                // fp32 sums over the row: the rounding grows with its width.
                let tolerance = if dtype == DType::F64 { 1e-12 } else { 1e-5 * (n as f64 / GPT3 as f64).max(1.0) };
                assert!(rel <= tolerance, "{what}: `{name}` differs by {rel:.2e}");
            }
            // Twice on the device: bit for bit the same (no atomics anywhere).
            let first: Vec<Vec<f64>> = results_of(centered).iter().map(|name| device.read(0, name).unwrap()).collect();
            device.run().unwrap();
            for (name, before) in results_of(centered).iter().zip(&first) {
                let again = device.read(0, name).unwrap();
                assert!(again.iter().zip(before).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: `{name}` changed between runs");
            }
        }
    }
}
