//! Tensor types as plain Rust data: what the op registry's shape rules compute with.
//!
//! They print exactly as MLIR's builtin ranked tensor types (`tensor<2x8xf32>`), so a type
//! inferred here can be handed to melior as text and compared with what MLIR holds.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE single precision: the default training type.
    F32,
    /// bfloat16 (training on accelerators; accumulation stays f32 in kernels).
    Bf16,
    /// IEEE double precision, used by gradient checks.
    F64,
    /// 32-bit signed integers: token ids and targets.
    I32,
}

impl DType {
    /// Size of one element in bytes.
    pub fn bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::Bf16 => 2,
            DType::F64 => 8,
        }
    }

    /// Whether this is a floating-point type (activations, weights) rather than ids.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }

    /// MLIR spelling of the element type.
    pub fn mlir(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F64 => "f64",
            DType::I32 => "i32",
        }
    }

    /// Parses the MLIR spelling back.
    pub fn from_mlir(text: &str) -> Option<DType> {
        Some(match text {
            "f32" => DType::F32,
            "bf16" => DType::Bf16,
            "f64" => DType::F64,
            "i32" => DType::I32,
            _ => return None,
        })
    }
}

/// A ranked tensor type with static shape; rank 0 is a scalar (`tensor<f32>`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorTy {
    /// Extent of each dimension, outermost first.
    pub shape: Vec<i64>,
    /// Element type.
    pub dtype: DType,
}

impl TensorTy {
    /// A tensor type of this shape and element type.
    pub fn new(shape: impl Into<Vec<i64>>, dtype: DType) -> Self {
        TensorTy { shape: shape.into(), dtype }
    }

    /// A rank-0 tensor.
    pub fn scalar(dtype: DType) -> Self {
        TensorTy { shape: Vec::new(), dtype }
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements; saturates instead of overflowing on absurd shapes.
    pub fn num_elements(&self) -> u64 {
        self.shape.iter().fold(1u64, |acc, &d| acc.saturating_mul(d.max(0) as u64))
    }

    /// Size in bytes; saturates like [`TensorTy::num_elements`].
    pub fn bytes(&self) -> u64 {
        self.num_elements().saturating_mul(self.dtype.bytes() as u64)
    }

    /// The last dimension (the feature dimension for activations); `None` for scalars.
    pub fn last_dim(&self) -> Option<i64> {
        self.shape.last().copied()
    }

    /// Parses MLIR's spelling of a static ranked tensor type, e.g. `tensor<2x8xf32>`.
    pub fn parse(text: &str) -> Option<TensorTy> {
        let inner = text.trim().strip_prefix("tensor<")?.strip_suffix('>')?;
        let mut parts: Vec<&str> = inner.split('x').collect();
        let dtype = DType::from_mlir(parts.pop()?)?;
        let shape = parts.iter().map(|p| p.parse::<i64>().ok()).collect::<Option<Vec<_>>>()?;
        Some(TensorTy { shape, dtype })
    }
}

impl fmt::Display for TensorTy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tensor<")?;
        for d in &self.shape {
            write!(f, "{d}x")?;
        }
        write!(f, "{}>", self.dtype.mlir())
    }
}
