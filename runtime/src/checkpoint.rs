//! Parameters in safetensors files, named as in the IR (`layers.3.attn.q.weight`).

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::RuntimeError;

/// Writes f32 tensors `(name, shape, values)` to `path`.
pub fn save(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Result<(), RuntimeError> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            TensorView::new(Dtype::F32, shape.clone(), b).map(|view| (name.clone(), view)).map_err(|e| RuntimeError::Program(format!("tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata: Option<HashMap<String, String>> = Some([("format".to_string(), "pt".to_string())].into());
    let data = safetensors::serialize(views, metadata).map_err(|e| RuntimeError::Program(format!("serializing {}: {e}", path.display())))?;
    std::fs::write(path, data).map_err(|source| RuntimeError::Io { context: format!("writing {}", path.display()), source })
}

/// Reads every f32 tensor of `path` as `name -> (shape, values)`.
pub fn load(path: &Path) -> Result<HashMap<String, (Vec<usize>, Vec<f32>)>, RuntimeError> {
    let data = std::fs::read(path).map_err(|source| RuntimeError::Io { context: format!("reading {}", path.display()), source })?;
    let file = SafeTensors::deserialize(&data).map_err(|e| RuntimeError::Binding(format!("{} is not a safetensors file: {e}", path.display())))?;
    let mut out = HashMap::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(RuntimeError::Binding(format!("{}: tensor {name} is {:?}; shardc reads f32 tensors", path.display(), view.dtype())));
        }
        let values = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}
