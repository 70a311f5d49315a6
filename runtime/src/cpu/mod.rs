//! The CPU backend: executes a [`Program`] on this machine's cores.
//!
//! Storage is one typed vector per memory-plan slot. To run an instruction, its output slots
//! are moved out of the slot table (so they can be written while the inputs are borrowed from
//! the table), the kernel runs, and the outputs are put back. An in-place op's input slot is
//! then empty; its kernel reads the old value from the output instead.

mod gemm;
mod kernels;

use crate::program::{Buffer, Program, Role};
use crate::{DType, RuntimeError};

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

/// An input of a kernel: a buffer's descriptor and the slot holding it.
pub(crate) struct In<'a> {
    buffer: &'a Buffer,
    storage: &'a Storage,
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
        T::slice(self.storage)
            .map(|s| &s[..self.buffer.len()])
            .ok_or_else(|| format!("input `{}` is not {:?}", self.buffer.name, T::DTYPE))
    }
}

/// An output of a kernel.
pub(crate) struct Out<'a> {
    buffer: &'a Buffer,
    storage: &'a mut Storage,
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

/// Runs one program on the CPU, keeping its arguments (parameters, optimizer state) between
/// runs.
#[derive(Debug)]
pub struct CpuExecutor {
    program: Program,
    slots: Vec<Storage>,
}

impl CpuExecutor {
    /// Validates `program` and allocates its slots, zero-filled.
    pub fn new(program: Program) -> Result<CpuExecutor, RuntimeError> {
        program.validate()?;
        for instr in &program.instrs {
            if !kernels::supported(&instr.op) {
                return Err(RuntimeError::Program(format!("no CPU kernel for `{}` (at {})", instr.op, instr.loc)));
            }
        }
        let slots = program
            .memory
            .slots
            .iter()
            .map(|&(len, dtype)| match dtype {
                DType::F32 => Ok(Storage::F32(vec![0.0; len])),
                DType::F64 => Ok(Storage::F64(vec![0.0; len])),
                DType::I32 => Ok(Storage::I32(vec![0; len])),
                DType::Bf16 => Err(RuntimeError::Program(
                    "bf16 programs need an accelerator backend; set dtype = \"f32\" in the spec to run on the CPU".into(),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CpuExecutor { program, slots })
    }

    /// The program being run.
    pub fn program(&self) -> &Program {
        &self.program
    }

    fn binding(&self, name: &str) -> Result<&Buffer, RuntimeError> {
        let binding = self
            .program
            .arg(name)
            .or_else(|| self.program.result(name))
            .ok_or_else(|| RuntimeError::Binding(format!("the program has no argument or result `{name}`")))?;
        Ok(&self.program.buffers[binding.buffer])
    }

    /// Writes an argument (or any named buffer).
    pub fn write<T: Element>(&mut self, name: &str, data: &[T]) -> Result<(), RuntimeError> {
        let buffer = self.binding(name)?.clone();
        if buffer.len() != data.len() || buffer.dtype != T::DTYPE {
            return Err(RuntimeError::Binding(format!(
                "`{name}` takes {} {:?} elements (shape {:?}), got {} {:?}",
                buffer.len(),
                buffer.dtype,
                buffer.shape,
                data.len(),
                T::DTYPE
            )));
        }
        let slot = T::slice_mut(&mut self.slots[buffer.slot]).ok_or_else(|| RuntimeError::Binding(format!("`{name}` has no storage")))?;
        slot[..data.len()].copy_from_slice(data);
        Ok(())
    }

    /// Reads a result or argument.
    pub fn read<T: Element>(&self, name: &str) -> Result<&[T], RuntimeError> {
        let buffer = self.binding(name)?;
        T::slice(&self.slots[buffer.slot])
            .map(|s| &s[..buffer.len()])
            .ok_or_else(|| RuntimeError::Binding(format!("`{name}` is {:?}, not {:?}", buffer.dtype, T::DTYPE)))
    }

    /// Names and shapes of the arguments with `role`.
    pub fn args_with(&self, role: Role) -> Vec<(String, Vec<usize>)> {
        self.program
            .args
            .iter()
            .filter(|a| a.role == Some(role))
            .map(|a| (a.name.clone(), self.program.buffers[a.buffer].shape.clone()))
            .collect()
    }

    /// Runs every instruction once.
    pub fn run(&mut self) -> Result<(), RuntimeError> {
        let CpuExecutor { program, slots } = self;
        for (index, instr) in program.instrs.iter().enumerate() {
            let mut taken: Vec<(usize, Storage)> = instr
                .outputs
                .iter()
                .map(|&b| {
                    let slot = program.buffers[b].slot;
                    (slot, std::mem::take(&mut slots[slot]))
                })
                .collect();
            let result = {
                let ins: Vec<In<'_>> =
                    instr.inputs.iter().map(|&b| In { buffer: &program.buffers[b], storage: &slots[program.buffers[b].slot] }).collect();
                let mut outs: Vec<Out<'_>> = taken
                    .iter_mut()
                    .zip(&instr.outputs)
                    .map(|((_, storage), &b)| Out { buffer: &program.buffers[b], storage })
                    .collect();
                kernels::run(instr, &ins, &mut outs)
            };
            // Put the outputs back before reporting any error: the arguments (parameters)
            // stay intact and readable.
            for (slot, storage) in taken {
                slots[slot] = storage;
            }
            result.map_err(|message| RuntimeError::Kernel { index, op: instr.op.clone(), loc: instr.loc.clone(), message })?;
        }
        Ok(())
    }
}
