//! Parameters in the safetensors format, named as in the IR (`layers.3.attn.q.weight`).
//! These functions convert to and from bytes; the caller reads and writes files.

use std::collections::HashMap;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::RuntimeError;

/// Named f32 tensors: `(name, shape, values)`.
pub type NamedTensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Serializes f32 tensors `(name, shape, values)`.
pub fn to_bytes(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Result<Vec<u8>, RuntimeError> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            TensorView::new(Dtype::F32, shape.clone(), b).map(|view| (name.clone(), view)).map_err(|e| RuntimeError::Program(format!("tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata: Option<HashMap<String, String>> = Some([("format".to_string(), "pt".to_string())].into());
    safetensors::serialize(views, metadata).map_err(|e| RuntimeError::Program(format!("serializing tensors: {e}")))
}

/// Reads every f32 tensor of a safetensors file's bytes as `name -> (shape, values)`.
pub fn from_bytes(data: &[u8]) -> Result<HashMap<String, (Vec<usize>, Vec<f32>)>, RuntimeError> {
    let file = SafeTensors::deserialize(data).map_err(|e| RuntimeError::Binding(format!("not a safetensors file: {e}")))?;
    let mut out = HashMap::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(RuntimeError::Binding(format!("tensor {name} is {:?}; shardc reads f32 tensors", view.dtype())));
        }
        let values = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}
