//! The CPU backend's storage: a typed vector per memory-plan slot, and the views a kernel
//! gets of its operands and results.

use super::*;

/// Typed contents of one slot.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Storage {
    /// Taken out for an instruction's output (or never allocated).
    #[default]
    Empty,
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// i32 elements.
    I32(Vec<i32>),
    /// bfloat16 elements (kernels compute on them in f32 and round the results).
    Bf16(Vec<half::bf16>),
}

impl Storage {
    /// The first `len` elements as f64 (`None` for an empty or integer slot).
    pub(super) fn to_f64(&self, len: usize) -> Option<Vec<f64>> {
        match self {
            Storage::F32(v) => Some(v[..len].iter().map(|&x| x as f64).collect()),
            Storage::F64(v) => Some(v[..len].to_vec()),
            Storage::Bf16(v) => Some(v[..len].iter().map(|&x| x.to_f64()).collect()),
            _ => None,
        }
    }

    /// Overwrites the first elements with `values` (rounded to the slot's type).
    pub(super) fn set_f64(&mut self, values: &[f64]) -> bool {
        match self {
            Storage::F32(v) => v.iter_mut().zip(values).for_each(|(d, &s)| *d = s as f32),
            Storage::F64(v) => v[..values.len()].copy_from_slice(values),
            Storage::Bf16(v) => v.iter_mut().zip(values).for_each(|(d, &s)| *d = half::bf16::from_f64(s)),
            _ => return false,
        }
        true
    }

    /// A bf16 slot widened to f32 (the contents kept, so in-place kernels see them); other
    /// slots as they are.
    pub(super) fn widened(&self) -> Option<Storage> {
        match self {
            Storage::Bf16(v) => Some(Storage::F32(v.iter().map(|x| x.to_f32()).collect())),
            _ => None,
        }
    }
}

/// An element type the CPU backend stores.
pub trait Element: Copy + Default + Send + Sync + 'static {
    /// Its program dtype.
    const DTYPE: DType;
    /// The slot's elements, if it holds this type.
    fn slice(storage: &Storage) -> Option<&[Self]>;
    /// The slot's elements, mutably, if it holds this type.
    fn slice_mut(storage: &mut Storage) -> Option<&mut [Self]>;
}

macro_rules! element {
    ($t:ty, $variant:ident, $dtype:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            fn slice(storage: &Storage) -> Option<&[Self]> {
                match storage {
                    Storage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(storage: &mut Storage) -> Option<&mut [Self]> {
                match storage {
                    Storage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
element!(f32, F32, F32);
element!(f64, F64, F64);
element!(i32, I32, I32);
element!(half::bf16, Bf16, Bf16);

/// An input of a kernel: a buffer's descriptor and the slot holding it.
pub(crate) struct In<'a> {
    pub(super) buffer: &'a Buffer,
    pub(super) storage: &'a Storage,
}

impl<'a> In<'a> {
    pub(crate) fn shape(&self) -> &'a [usize] {
        &self.buffer.shape
    }
    pub(crate) fn dtype(&self) -> DType {
        self.buffer.dtype
    }
    /// Whether the slot was moved to an output (the op works in place on it).
    pub(crate) fn is_taken(&self) -> bool {
        matches!(self.storage, Storage::Empty)
    }
    pub(crate) fn get<T: Element>(&self) -> Result<&'a [T], String> {
        T::slice(self.storage).map(|s| &s[..self.buffer.len()]).ok_or_else(|| format!("input `{}` is not {:?}", self.buffer.name, T::DTYPE))
    }
}

/// An output of a kernel.
pub(crate) struct Out<'a> {
    pub(super) buffer: &'a Buffer,
    pub(super) storage: &'a mut Storage,
}

impl Out<'_> {
    pub(crate) fn shape(&self) -> &[usize] {
        &self.buffer.shape
    }
    pub(crate) fn get<T: Element>(&mut self) -> Result<&mut [T], String> {
        let (len, name) = (self.buffer.len(), &self.buffer.name);
        T::slice_mut(self.storage).map(|s| &mut s[..len]).ok_or_else(|| format!("output `{name}` is not {:?}", T::DTYPE))
    }
}
