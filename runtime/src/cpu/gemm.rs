//! The one `unsafe` call of the CPU backend: the `gemm` crate's strided matrix product,
//! behind a wrapper that checks every index it can touch against the slices first.
#![allow(unsafe_code)]

use num_traits::Zero;

/// A strided view of a matrix inside a slice: element (i, j) is at `i * row_stride + j *
/// col_stride`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Strided {
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl Strided {
    /// A row-major `rows x cols` matrix, or its transpose when `transposed` (the slice holds
    /// `cols x rows` row-major).
    pub fn row_major(rows: usize, cols: usize, transposed: bool) -> Strided {
        if transposed { Strided { rows, cols, row_stride: 1, col_stride: rows } } else { Strided { rows, cols, row_stride: cols, col_stride: 1 } }
    }

    /// One past the largest index the view touches.
    fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 { 0 } else { (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride + 1 }
    }
}

/// `dst = lhs x rhs` (or `dst += ...` when `accumulate`) with `dst` row-major `m x n`.
pub(crate) fn matmul<T: 'static + Copy + Zero + num_traits::One>(
    dst: &mut [T],
    lhs: &[T],
    lhs_view: Strided,
    rhs: &[T],
    rhs_view: Strided,
    accumulate: bool,
) -> Result<(), String> {
    let (m, k, n) = (lhs_view.rows, lhs_view.cols, rhs_view.cols);
    if rhs_view.rows != k {
        return Err(format!("gemm: inner dimensions {k} and {} differ", rhs_view.rows));
    }
    if lhs_view.extent() > lhs.len() || rhs_view.extent() > rhs.len() || m * n > dst.len() {
        return Err("gemm: a view exceeds its buffer".into());
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(T::zero());
        }
        return Ok(());
    }
    // Threads pay off only for products big enough to split.
    let parallelism = if (m * n * k) >= (1 << 18) { gemm::Parallelism::Rayon(rayon::current_num_threads()) } else { gemm::Parallelism::None };
    // SAFETY: the checks above guarantee that every index `gemm` reads, (i, l) of lhs and
    // (l, j) of rhs for i < m, l < k, j < n, is inside its slice, and that dst holds m x n
    // row-major elements; dst is exclusively borrowed and does not overlap the shared inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_view.col_stride as isize,
            lhs_view.row_stride as isize,
            rhs.as_ptr(),
            rhs_view.col_stride as isize,
            rhs_view.row_stride as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}
