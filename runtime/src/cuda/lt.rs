//! cuBLASLt for GEMMs with fused epilogues (bias, GELU with its stored input, GELU's
//! gradient): the thin wrapper that keeps its descriptors and raw calls in one place.
//!
//! Descriptors and the heuristic's algorithm are built once per GEMM shape and reused every
//! step; only the pointers change between calls. A shape cuBLASLt has no algorithm for is
//! remembered as such, and the caller runs the plain GEMM and the epilogue kernel instead.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::result as drv;

use super::device::{ColumnMajorGemm, DeviceEpilogue};
use super::err;
use crate::program::EpilogueActivation;
use crate::{DType, RuntimeError};

/// What a cached plan depends on: the GEMM without its pointers, the epilogue's kind, and the
/// pointers' alignments (the heuristic picks algorithms for them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    bf16: bool,
    transpose: (bool, bool),
    mnk: (usize, usize, usize),
    ld: (usize, usize, usize),
    strides: (usize, usize, usize),
    batch: usize,
    bias: bool,
    aux: bool,
    activation: EpilogueActivation,
    align: [u32; 4],
}

/// Descriptors and the chosen algorithm of one shape.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by `Lt::plan`, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for layout in self.layouts {
                let _ = lt::destroy_matrix_layout(layout);
            }
        }
    }
}

/// The cuBLASLt handle of one GPU, its workspace and its plans.
pub struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
    /// None: cuBLASLt has no algorithm for the shape.
    plans: Mutex<HashMap<Key, Option<Plan>>>,
}

// SAFETY: the handle and descriptors are used under the plans' lock or by the one thread that
// drives this GPU's stream; cuBLASLt handles may move between threads.
unsafe impl Send for Lt {}
// SAFETY: as above.
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.lock().map(|mut p| p.clear()).unwrap_or_default();
        // SAFETY: created in `new`, freed once, after the plans that use the handle.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
            let _ = drv::free_sync(self.workspace);
        }
    }
}

/// The largest power of two (up to 256) that divides `ptr`: the alignment cuBLASLt may assume.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 { 256 } else { (1u64 << ptr.trailing_zeros().min(8)) as u32 }
}

impl Lt {
    /// Bytes of its workspace.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace_bytes
    }

    /// A handle and workspace on the current context (NVIDIA's recommended sizes: 32 MiB on
    /// Hopper and later, 4 MiB before).
    pub fn new(compute_major: i32) -> Result<Lt, RuntimeError> {
        let handle = lt::create_handle().map_err(|e| err(format!("cuBLASLt: {e:?}")))?;
        let workspace_bytes = if compute_major >= 9 { crate::program::CUBLASLT_WORKSPACE_BYTES } else { crate::program::CUBLASLT_WORKSPACE_BYTES_BEFORE_SM90 };
        // SAFETY: a fresh allocation on the current context, owned by this handle.
        let workspace = match unsafe { drv::malloc_sync(workspace_bytes) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created above, destroyed once.
                let _ = unsafe { lt::destroy_handle(handle) };
                return Err(err(format!("allocating cuBLASLt's workspace: {e:?}")));
            }
        };
        Ok(Lt { handle, workspace, workspace_bytes, plans: Mutex::new(HashMap::new()) })
    }

    /// Runs `g` with epilogue `e` on `stream`; false where cuBLASLt has no algorithm for it.
    pub fn matmul(&self, dtype: DType, g: &ColumnMajorGemm, e: &DeviceEpilogue, stream: sys::cudaStream_t) -> Result<bool, RuntimeError> {
        if !matches!(dtype, DType::F32 | DType::Bf16) || std::env::var("SHARDC_CUBLASLT").is_ok_and(|v| v == "0") {
            return Ok(false);
        }
        let key = Key {
            bf16: dtype == DType::Bf16,
            transpose: (g.transpose_a, g.transpose_b),
            mnk: (g.m, g.n, g.k),
            ld: (g.lda, g.ldb, g.ldc),
            strides: (g.stride_a, g.stride_b, g.stride_c),
            batch: g.batch,
            bias: e.bias != 0,
            aux: e.aux != 0,
            activation: e.activation,
            align: [alignment(g.a), alignment(g.b), alignment(g.c), alignment(e.aux).min(alignment(e.bias))],
        };
        let mut plans = self.plans.lock().map_err(|_| err("cuBLASLt's plan cache was poisoned by a failed call"))?;
        if let std::collections::hash_map::Entry::Vacant(slot) = plans.entry(key) {
            slot.insert(self.plan(&key, e)?);
        }
        let Some(plan) = plans.get(&key).and_then(|p| p.as_ref()) else { return Ok(false) };
        let lt_err = |what: &str, e: lt::CublasError| err(format!("cuBLASLt {what} for a {}x{}x{} GEMM: {e:?}", g.m, g.n, g.k));
        // SAFETY: the descriptor is this plan's; the pointers are device addresses of live
        // allocations laid out as `g` and `e` state; alpha and beta outlive the call.
        unsafe {
            let set = |attr: sys::cublasLtMatmulDescAttributes_t, ptr: &u64| lt::set_matmul_desc_attribute(plan.desc, attr, ptr as *const u64 as *const c_void, size_of::<u64>());
            if e.bias != 0 {
                set(sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &e.bias).map_err(|x| lt_err("bias pointer", x))?;
            }
            if e.aux != 0 {
                set(sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &e.aux).map_err(|x| lt_err("aux pointer", x))?;
            }
            let (alpha, beta) = (1.0f32, 0.0f32);
            let [a_layout, b_layout, c_layout] = plan.layouts;
            match lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                g.a as *const c_void,
                a_layout,
                g.b as *const c_void,
                b_layout,
                g.c as *const c_void,
                c_layout,
                g.c as *mut c_void,
                c_layout,
                &plan.algo,
                self.workspace as *mut c_void,
                self.workspace_bytes,
                stream,
            ) {
                Ok(()) => Ok(true),
                Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => Ok(false),
                Err(x) => Err(lt_err("matmul", x)),
            }
        }
    }

    /// The descriptors and algorithm of `key`'s shape; None where cuBLASLt offers none.
    fn plan(&self, key: &Key, e: &DeviceEpilogue) -> Result<Option<Plan>, RuntimeError> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        // cuBLASLt's epilogue matrix wants a leading dimension and batch stride in multiples
        // of 8 elements; other shapes take the fallback.
        if key.aux && (key.ld.2 % 8 != 0 || (key.batch > 1 && key.strides.2 % 8 != 0)) {
            return Ok(None);
        }
        let ty = if key.bf16 { sys::cudaDataType_t::CUDA_R_16BF } else { sys::cudaDataType_t::CUDA_R_32F };
        let fail = |what: &str, e: lt::CublasError| err(format!("cuBLASLt {what}: {e:?}"));
        let (m, n, k) = key.mnk;
        let (rows_a, cols_a) = if key.transpose.0 { (k, m) } else { (m, k) };
        let (rows_b, cols_b) = if key.transpose.1 { (n, k) } else { (k, n) };
        let shapes = [(rows_a, cols_a, key.ld.0, key.strides.0), (rows_b, cols_b, key.ld.1, key.strides.1), (m, n, key.ld.2, key.strides.2)];
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F).map_err(|e| fail("descriptor", e))?;
        let mut layouts = [std::ptr::null_mut(); 3];
        for (slot, &(rows, cols, ld, stride)) in layouts.iter_mut().zip(&shapes) {
            let layout = lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64);
            match layout {
                Ok(l) => *slot = l,
                Err(e) => {
                    // SAFETY: created above, destroyed once.
                    unsafe {
                        let _ = lt::destroy_matmul_desc(desc);
                        for l in layouts.iter().filter(|l| !l.is_null()) {
                            let _ = lt::destroy_matrix_layout(*l);
                        }
                    }
                    return Err(fail("matrix layout", e));
                }
            }
            if key.batch > 1 {
                let (count, offset) = (i32::try_from(key.batch).unwrap_or(i32::MAX), stride as i64);
                // SAFETY: a live layout; the values outlive the calls.
                unsafe {
                    lt::set_matrix_layout_attribute(*slot, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count as *const i32 as *const c_void, size_of::<i32>()).map_err(|e| fail("batch count", e))?;
                    lt::set_matrix_layout_attribute(*slot, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset as *const i64 as *const c_void, size_of::<i64>()).map_err(|e| fail("batch stride", e))?;
                }
            }
        }
        // From here the plan owns the descriptors (dropping it destroys them).
        // SAFETY: the algorithm is plain data (filled in by the heuristic below).
        let mut plan = Plan { desc, layouts, algo: unsafe { std::mem::zeroed() } };
        let epilogue = match (key.activation, key.bias, key.aux) {
            (EpilogueActivation::None, true, _) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            (EpilogueActivation::None, false, _) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            (EpilogueActivation::Gelu, false, false) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU,
            (EpilogueActivation::Gelu, true, false) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
            (EpilogueActivation::Gelu, false, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX,
            (EpilogueActivation::Gelu, true, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            (EpilogueActivation::GeluGrad, false, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU,
            // A bias before GELU's gradient is no cuBLASLt epilogue.
            (EpilogueActivation::GeluGrad, _, _) => return Ok(None),
        };
        let (ta, tb) = (key.transpose.0 as i32, key.transpose.1 as i32);
        let (aux_ld, aux_stride) = (key.ld.2 as i64, key.strides.2 as i64);
        // SAFETY: live descriptors; every value outlives its call and has the attribute's type.
        unsafe {
            let set = |attr: D, ptr: *const c_void, bytes: usize| lt::set_matmul_desc_attribute(desc, attr, ptr, bytes).map_err(|e| fail("descriptor attribute", e));
            set(D::CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const i32 as *const c_void, size_of::<i32>())?;
            set(D::CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const i32 as *const c_void, size_of::<i32>())?;
            set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue as *const sys::cublasLtEpilogue_t as *const c_void, size_of::<sys::cublasLtEpilogue_t>())?;
            // The heuristic reads the bias and aux pointers for their alignment (cuBLASLt's
            // docs): this call's, which the key's alignments match for every later call.
            if e.bias != 0 {
                set(D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &e.bias as *const u64 as *const c_void, size_of::<u64>())?;
            }
            if e.aux != 0 {
                set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &e.aux as *const u64 as *const c_void, size_of::<u64>())?;
            }
            if key.aux {
                set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld as *const i64 as *const c_void, size_of::<i64>())?;
                if key.batch > 1 {
                    set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &aux_stride as *const i64 as *const c_void, size_of::<i64>())?;
                }
            }
        }
        let pref = lt::create_matmul_pref().map_err(|e| fail("preference", e))?;
        let workspace = self.workspace_bytes as u64;
        // SAFETY: a live preference; values outlive the calls; destroyed once below.
        let heuristic = unsafe {
            let mut ok = lt::set_matmul_pref_attribute(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace as *const u64 as *const c_void, size_of::<u64>()).is_ok();
            let attrs = [P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES];
            let aligns = [key.align[0], key.align[1], key.align[2], key.align[2]];
            for (attr, align) in attrs.into_iter().zip(aligns) {
                ok &= lt::set_matmul_pref_attribute(pref, attr, &align as *const u32 as *const c_void, size_of::<u32>()).is_ok();
            }
            let found = if ok { lt::get_matmul_algo_heuristic(self.handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref).ok() } else { None };
            let _ = lt::destroy_matmul_pref(pref);
            found
        };
        // No algorithm (an epilogue this build lacks for the shape or alignment): the plain
        // GEMM and the epilogue kernel run instead.
        let Some(heuristic) = heuristic else { return Ok(None) };
        plan.algo = heuristic.algo;
        Ok(Some(plan))
    }
}
