//! Hugging Face checkpoints: read a model folder's safetensors (one file or an index of
//! shards; f32, f16 or bf16) with its tensors renamed and laid out as shardc's parameters,
//! and write shardc's parameters back in the Hugging Face layout.
//!
//! Layouts: shardc stores linear weights `[in, out]`. GPT-2's Conv1D weights are already
//! `[in, out]` (the transpose of `nn.Linear`), and its fused `c_attn` splits into q, k, v
//! along the output dimension. Llama's `nn.Linear` weights are `[out, in]` and are
//! transposed; its q/k projections are in the rotate-half order that shardc's RoPE uses
//! (pairs `(i, i + d/2)`), as `transformers` stores them, so no permutation is needed.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::tensor::Dtype;

use crate::RuntimeError;

/// Which family's names and layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// GPT-2 (`transformer.h.N.attn.c_attn`, Conv1D).
    Gpt2,
    /// Llama (`model.layers.N.self_attn.q_proj`, Linear).
    Llama,
    /// Mixtral: Llama's names, and `block_sparse_moe.gate` (the router) and
    /// `block_sparse_moe.experts.E.w1/w3/w2` (each expert's gate, up and down, Linear) for
    /// the MLP.
    Mixtral,
}

/// Named tensors: `name -> (shape, values)`.
pub type Tensors = BTreeMap<String, (Vec<usize>, Vec<f64>)>;

fn bad(message: String) -> RuntimeError {
    RuntimeError::Binding(message)
}

/// Largest `model.safetensors.index.json` read (a weight map of names, a few hundred KB).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

/// A Hugging Face model folder's weight files (`model.safetensors`, or the files
/// `model.safetensors.index.json` lists), their headers read and checked: each tensor in
/// one file, where the index says; the tensors themselves are read one at a time. Weight
/// files must be regular files inside the folder.
#[derive(Debug)]
pub struct HfFolder {
    files: Vec<crate::tensor_file::TensorFile>,
    /// Every tensor's file (an index into `files`).
    tensors: BTreeMap<String, usize>,
}

impl HfFolder {
    /// Reads the index (if any) and the header of every weight file of `dir`.
    pub fn open(dir: &Path) -> Result<HfFolder, RuntimeError> {
        let index = dir.join("model.safetensors.index.json");
        // With an index, where its weight_map says each tensor is.
        let mut weight_map: Option<BTreeMap<String, String>> = None;
        let paths: Vec<std::path::PathBuf> = if index.exists() {
            let text = read_regular(&index, MAX_INDEX_BYTES)?;
            let json: serde_json::Value = serde_json::from_slice(&text).map_err(|e| bad(format!("{}: {e}", index.display())))?;
            let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad(format!("{}: no weight_map", index.display())))?;
            let map: BTreeMap<String, String> = map
                .iter()
                .map(|(name, file)| file.as_str().map(|f| (name.clone(), f.to_string())).ok_or_else(|| bad(format!("{}: the weight_map's entry for `{name}` is not a file name", index.display()))))
                .collect::<Result<_, _>>()?;
            let mut files: Vec<String> = map.values().cloned().collect();
            files.sort();
            files.dedup();
            if let Some(outside) = files.iter().find(|f| f.is_empty() || f.contains(['/', '\\']) || *f == "." || *f == "..") {
                return Err(bad(format!("{}: the weight_map names `{outside}`, which is not a file of the folder", index.display())));
            }
            weight_map = Some(map);
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut files = Vec::new();
        let mut tensors: BTreeMap<String, usize> = BTreeMap::new();
        for path in paths {
            let file = crate::tensor_file::TensorFile::open(&path).map_err(|e| bad(format!("{e} (a Hugging Face folder holds model.safetensors or model.safetensors.index.json)")))?;
            let file_name = path.file_name().map_or_else(String::new, |n| n.to_string_lossy().to_string());
            for name in file.names() {
                if let Some(&first) = tensors.get(&name) {
                    let first = files.get(first).map_or_else(String::new, |f: &crate::tensor_file::TensorFile| f.path().file_name().map_or_else(String::new, |n| n.to_string_lossy().to_string()));
                    return Err(bad(format!("{}: tensor `{name}` is also in {first}, another file of the folder: keep one copy", path.display())));
                }
                if let Some(map) = &weight_map {
                    match map.get(&name) {
                        Some(listed) if *listed == file_name => {}
                        Some(listed) => return Err(bad(format!("{}: tensor `{name}` is in {file_name}, but the index's weight_map puts it in {listed}", index.display()))),
                        None => return Err(bad(format!("{}: tensor `{name}` is in {file_name}, but the index's weight_map does not list it", index.display()))),
                    }
                }
                tensors.insert(name, files.len());
            }
            files.push(file);
        }
        if let Some(map) = &weight_map
            && let Some((name, listed)) = map.iter().find(|(name, _)| !tensors.contains_key(*name) && !is_mask_buffer(name))
        {
            return Err(bad(format!("{}: the weight_map puts tensor `{name}` in {listed}, which does not hold it", index.display())));
        }
        Ok(HfFolder { files, tensors })
    }

    /// Every tensor's name.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// One tensor as f64 (shape, values); `None` for GPT-2's mask buffers (of any dtype),
    /// which are not parameters and are not read; any other integer tensor is an error naming
    /// it.
    pub fn read(&self, name: &str) -> Result<Option<crate::tensor_file::Tensor>, RuntimeError> {
        let file = &self.files[*self.tensors.get(name).ok_or_else(|| bad(format!("the folder has no tensor `{name}`")))?];
        // Not read at all: a mask is no weight, whatever its dtype or values.
        if is_mask_buffer(name) {
            return Ok(None);
        }
        match file.read_f64(name)? {
            Some(tensor) => Ok(Some(tensor)),
            None if is_mask_buffer(name) => Ok(None),
            None => Err(bad(format!("{}: tensor `{name}` is {:?}: weights are floating point (only GPT-2's attention-mask buffers may be otherwise)", file.path().display(), file.info(name).map(|i| i.dtype)))),
        }
    }
}

/// Every tensor of a Hugging Face model folder (see [`HfFolder`]), as f64.
pub fn read_dir(dir: &Path) -> Result<Tensors, RuntimeError> {
    let folder = HfFolder::open(dir)?;
    let mut out = Tensors::new();
    for name in folder.names() {
        if let Some(tensor) = folder.read(name)? {
            out.insert(name.clone(), tensor);
        }
    }
    Ok(out)
}

/// Whether `name`, directly in a Hugging Face model folder, is one of the model's own files:
/// its config and weights (what `--save-hf` writes and an `--hf` folder is read from), an
/// index of them, or its tokenizer's.
pub fn is_model_file(name: &std::ffi::OsStr) -> bool {
    let name = name.to_string_lossy();
    ["config.json", "generation_config.json"].contains(&name.as_ref()) || name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json") || name.starts_with("tokenizer")
}

/// GPT-2's causal-mask buffers (bool or integer), which are not parameters: read past.
fn is_mask_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")
}

/// Reads `path` whole if it is a regular file of at most `limit` bytes (a device such as
/// /dev/zero never ends).
fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>, RuntimeError> {
    let fail = |e: String| bad(format!("{}: {e}", path.display()));
    let meta = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?;
    if !meta.is_file() {
        return Err(fail("not a regular file".into()));
    }
    if meta.len() > limit {
        return Err(fail(format!("{} bytes, more than the {limit} this file may have", meta.len())));
    }
    std::fs::read(path).map_err(|e| fail(e.to_string()))
}

/// `[rows, cols]` transposed.
fn transpose(shape: &[usize], values: &[f64]) -> (Vec<usize>, Vec<f64>) {
    let (r, c) = (shape[0], shape[1]);
    let mut out = vec![0.0; values.len()];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = values[i * c + j];
        }
    }
    (vec![c, r], out)
}

/// Columns `[start, start + width)` of a `[rows, cols]` matrix (or elements of a vector).
fn columns(shape: &[usize], values: &[f64], start: usize, width: usize) -> (Vec<usize>, Vec<f64>) {
    if shape.len() == 1 {
        return (vec![width], values[start..start + width].to_vec());
    }
    let (r, c) = (shape[0], shape[1]);
    let out = (0..r).flat_map(|i| values[i * c + start..i * c + start + width].iter().copied()).collect();
    (vec![r, width], out)
}

/// How a Hugging Face tensor becomes shardc parameters.
enum Mapping {
    /// The same values and shape, under another name.
    Same(String),
    /// `nn.Linear`'s `[out, in]` transposed to shardc's `[in, out]`.
    Transposed(String),
    /// GPT-2's fused `c_attn` (Conv1D `[in, q + k + v]`, or its bias): q, k and v side by side
    /// along the last dimension.
    Fused([String; 3]),
    /// One expert's `nn.Linear` `[out, in]`: transposed, it is slice `index` of shardc's
    /// stacked `[experts, in, out]` (see [`expert_slice`]).
    ExpertSlice(String, usize),
    /// Not a parameter shardc models (GPT-2's mask buffers, a tied head's copy, RoPE's cached
    /// frequencies).
    Skipped,
}

/// The name under which [`import_tensor`] returns slice `index` of the stacked expert
/// parameter `ours`; [`stack_experts`] joins them.
pub fn expert_slice(ours: &str, index: usize) -> String {
    format!("{ours}[{index}]")
}

/// Joins the expert slices of `tensors` (`name[i]`, each `[in, out]`) into the stacked
/// parameters `name` `[experts, in, out]` the model has (`expected`); an expert missing or
/// given twice is an error naming it.
pub fn stack_experts(tensors: &mut Tensors, expected: &BTreeMap<String, Vec<usize>>) -> Result<(), RuntimeError> {
    let slices: Vec<String> = tensors.keys().filter(|k| k.ends_with(']') && k.contains('[')).cloned().collect();
    let mut stacked: BTreeMap<String, (Vec<usize>, Vec<f64>, Vec<bool>)> = BTreeMap::new();
    for key in slices {
        let (slice_shape, values) = tensors.remove(&key).unwrap_or_default();
        let (ours, index) = key.trim_end_matches(']').rsplit_once('[').ok_or_else(|| bad(format!("`{key}` is not an expert slice")))?;
        let index: usize = index.parse().map_err(|_| bad(format!("`{key}` is not an expert slice")))?;
        let shape = expected.get(ours).ok_or_else(|| bad(format!("the model has no expert parameter `{ours}`")))?;
        let entry = stacked.entry(ours.to_string()).or_insert_with(|| (shape.clone(), vec![0.0; shape.iter().product()], vec![false; shape[0]]));
        let per = values.len();
        if shape.len() != 3 || slice_shape != shape[1..] || index >= shape[0] {
            return Err(bad(format!("expert {index} of `{ours}` ({slice_shape:?}) does not fit {shape:?}")));
        }
        if std::mem::replace(&mut entry.2[index], true) {
            return Err(bad(format!("expert {index} of `{ours}` is given twice")));
        }
        entry.1[index * per..(index + 1) * per].copy_from_slice(&values);
    }
    for (ours, (shape, values, seen)) in stacked {
        if let Some(missing) = seen.iter().position(|s| !s) {
            return Err(bad(format!("expert {missing} of `{ours}` is missing from the folder ({} experts expected)", shape[0])));
        }
        tensors.insert(ours, (shape, values));
    }
    Ok(())
}

/// Where a Hugging Face tensor of `family` goes, by name; an error names a tensor that has no
/// place in the family.
fn mapping(family: Family, name: &str, tied: bool) -> Result<Mapping, RuntimeError> {
    let bare = name.strip_prefix("transformer.").or_else(|| name.strip_prefix("model.")).unwrap_or(name);
    let same = |n: &str| Ok(Mapping::Same(n.to_string()));
    match family {
        Family::Gpt2 => {
            if bare.ends_with(".attn.bias") || bare.ends_with(".attn.masked_bias") || (bare == "lm_head.weight" && tied) {
                return Ok(Mapping::Skipped);
            }
            match bare {
                "wte.weight" => return same("embed.tokens.weight"),
                "wpe.weight" => return same("embed.positions.weight"),
                "ln_f.weight" => return same("final_norm.weight"),
                "ln_f.bias" => return same("final_norm.bias"),
                "lm_head.weight" => return Ok(Mapping::Transposed("lm_head.weight".into())),
                _ => {}
            }
            let no_place = || bad(format!("Hugging Face tensor `{name}` has no place in a GPT-2 model"));
            let rest = bare.strip_prefix("h.").ok_or_else(no_place)?;
            let (layer, part) = rest.split_once('.').ok_or_else(no_place)?;
            let p = format!("layers.{layer}");
            let kind = if part.ends_with(".weight") { "weight" } else { "bias" };
            match part {
                "ln_1.weight" | "ln_1.bias" => same(&format!("{p}.attn_norm.{kind}")),
                "ln_2.weight" | "ln_2.bias" => same(&format!("{p}.mlp_norm.{kind}")),
                "attn.c_attn.weight" | "attn.c_attn.bias" => Ok(Mapping::Fused(["q", "k", "v"].map(|w| format!("{p}.attn.{w}.{kind}")))),
                "attn.c_proj.weight" | "attn.c_proj.bias" => same(&format!("{p}.attn.out.{kind}")),
                "mlp.c_fc.weight" | "mlp.c_fc.bias" => same(&format!("{p}.mlp.up.{kind}")),
                "mlp.c_proj.weight" | "mlp.c_proj.bias" => same(&format!("{p}.mlp.down.{kind}")),
                _ => Err(no_place()),
            }
        }
        Family::Llama | Family::Mixtral => {
            if bare == "lm_head.weight" {
                return if tied { Ok(Mapping::Skipped) } else { Ok(Mapping::Transposed("lm_head.weight".into())) };
            }
            if bare.ends_with("rotary_emb.inv_freq") {
                return Ok(Mapping::Skipped);
            }
            match bare {
                "embed_tokens.weight" => return same("embed.tokens.weight"),
                "norm.weight" => return same("final_norm.weight"),
                _ => {}
            }
            let family_name = if family == Family::Mixtral { "Mixtral" } else { "Llama" };
            let no_place = || bad(format!("Hugging Face tensor `{name}` has no place in a {family_name} model (biases and other extras are not supported)"));
            let rest = bare.strip_prefix("layers.").ok_or_else(no_place)?;
            let (layer, part) = rest.split_once('.').ok_or_else(no_place)?;
            let p = format!("layers.{layer}");
            // nn.Linear stores [out, in]; shardc [in, out].
            let linear = |ours: &str| Ok(Mapping::Transposed(format!("{p}.{ours}.weight")));
            match part {
                "input_layernorm.weight" => same(&format!("{p}.attn_norm.weight")),
                "post_attention_layernorm.weight" => same(&format!("{p}.mlp_norm.weight")),
                "self_attn.q_proj.weight" => linear("attn.q"),
                "self_attn.k_proj.weight" => linear("attn.k"),
                "self_attn.v_proj.weight" => linear("attn.v"),
                "self_attn.o_proj.weight" => linear("attn.out"),
                "mlp.gate_proj.weight" if family == Family::Llama => linear("mlp.gate"),
                "mlp.up_proj.weight" if family == Family::Llama => linear("mlp.up"),
                "mlp.down_proj.weight" if family == Family::Llama => linear("mlp.down"),
                "block_sparse_moe.gate.weight" if family == Family::Mixtral => linear("mlp.router"),
                _ if family == Family::Mixtral && part.starts_with("block_sparse_moe.experts.") => {
                    let rest = &part["block_sparse_moe.experts.".len()..];
                    let (index, which) = rest.split_once('.').ok_or_else(no_place)?;
                    let index: usize = index.parse().map_err(|_| no_place())?;
                    let ours = match which {
                        "w1.weight" => "gate",
                        "w3.weight" => "up",
                        "w2.weight" => "down",
                        _ => return Err(no_place()),
                    };
                    Ok(Mapping::ExpertSlice(format!("{p}.mlp.experts.{ours}.weight"), index))
                }
                _ => Err(no_place()),
            }
        }
    }
}

/// The shardc name and layout of every Hugging Face tensor of `family`; tensors shardc does
/// not model (GPT-2's attention mask buffers, a tied head's copy) are skipped. `expected`
/// holds the shape of every parameter of the model the config describes (shardc names,
/// unpadded): each tensor must have the shape they make in Hugging Face's layout, checked
/// before its values are touched, so a 1-D `lm_head.weight` or a scalar `c_attn` is an error
/// naming the tensor and the shape the config makes it. Every name left unmapped, and every
/// tensor that maps to a parameter the model does not have (a layer past `num_hidden_layers`),
/// is an error naming it.
pub fn import(family: Family, hf: &Tensors, tied: bool, expected: &BTreeMap<String, Vec<usize>>) -> Result<Tensors, RuntimeError> {
    check_names(hf.keys())?;
    let mut out = Tensors::new();
    for (name, (shape, values)) in hf {
        out.extend(import_tensor(family, name, shape, values, tied, expected)?);
    }
    stack_experts(&mut out, expected)?;
    Ok(out)
}

/// Refuses a folder holding one weight under two prefixes: `transformer.h.0.x` and `h.0.x`
/// (or `model.layers.0.x` and `layers.0.x`) would silently overwrite each other.
pub fn check_names<'a>(names: impl Iterator<Item = &'a String>) -> Result<(), RuntimeError> {
    let mut bare_names: HashMap<&str, &str> = HashMap::new();
    for name in names {
        let bare = name.strip_prefix("transformer.").or_else(|| name.strip_prefix("model.")).unwrap_or(name);
        if let Some(other) = bare_names.insert(bare, name) {
            return Err(bad(format!("tensors `{other}` and `{name}` are the same weight under two prefixes: keep one")));
        }
    }
    Ok(())
}

/// The shardc parameters Hugging Face tensor `name` becomes (none for one shardc does not
/// model), by name only.
pub fn parameters_of(family: Family, name: &str, tied: bool) -> Result<Vec<String>, RuntimeError> {
    Ok(match mapping(family, name, tied)? {
        Mapping::Skipped => Vec::new(),
        Mapping::Same(ours) | Mapping::Transposed(ours) | Mapping::ExpertSlice(ours, _) => vec![ours],
        Mapping::Fused(parts) => parts.to_vec(),
    })
}

/// The shardc parameters one Hugging Face tensor (`name`, `shape`, `values`) becomes, checked
/// as [`import`] checks them.
pub fn import_tensor(family: Family, name: &str, shape: &[usize], values: &[f64], tied: bool, expected: &BTreeMap<String, Vec<usize>>) -> Result<Vec<(String, crate::tensor_file::Tensor)>, RuntimeError> {
    // Layers of the model the config describes, and the config key that says so.
    let layers = expected.keys().filter_map(|k| k.strip_prefix("layers.")?.split('.').next()?.parse::<usize>().ok()).max().map_or(0, |l| l + 1);
    let layers_key = match family {
        Family::Gpt2 => "n_layer",
        Family::Llama | Family::Mixtral => "num_hidden_layers",
    };
    let target = |ours: &str| {
        expected.get(ours).ok_or_else(|| match ours.strip_prefix("layers.").and_then(|r| r.split('.').next()?.parse::<usize>().ok()) {
            Some(layer) if layer >= layers => bad(format!("Hugging Face tensor `{name}` is in layer {layer}, past config.json's `{layers_key}` = {layers} (layers 0 to {}): the config and the weights disagree", layers.saturating_sub(1))),
            _ => bad(format!("Hugging Face tensor `{name}` would be `{ours}`, which the model its config.json describes does not have")),
        })
    };
    let wrong_shape = |wanted: &[usize]| bad(format!("Hugging Face tensor `{name}` has shape {shape:?}; its config.json makes it {wanted:?}"));
    Ok(match mapping(family, name, tied)? {
        Mapping::Skipped => Vec::new(),
        Mapping::Same(ours) => {
            let wanted = target(&ours)?;
            if shape != wanted.as_slice() {
                return Err(wrong_shape(wanted));
            }
            vec![(ours, (shape.to_vec(), values.to_vec()))]
        }
        Mapping::Transposed(ours) => {
            let wanted: Vec<usize> = target(&ours)?.iter().rev().copied().collect();
            if shape != wanted.as_slice() || shape.len() != 2 {
                return Err(wrong_shape(&wanted));
            }
            vec![(ours, transpose(shape, values))]
        }
        Mapping::ExpertSlice(ours, index) => {
            let stacked = target(&ours)?;
            // One expert's [out, in].
            let wanted: Vec<usize> = stacked.iter().skip(1).rev().copied().collect();
            if stacked.len() != 3 || shape != wanted.as_slice() {
                return Err(wrong_shape(&wanted));
            }
            if index >= stacked[0] {
                return Err(bad(format!("Hugging Face tensor `{name}` is expert {index}, past config.json's `num_local_experts` = {}", stacked[0])));
            }
            vec![(expert_slice(&ours, index), transpose(shape, values))]
        }
        Mapping::Fused(parts) => {
            let shapes = parts.iter().map(|ours| target(ours)).collect::<Result<Vec<_>, _>>()?;
            // Each part's shape with the fused dimension (the last) summed over q, k, v.
            let mut wanted = shapes[0].clone();
            let widths: Vec<usize> = shapes.iter().map(|s| s.last().copied().unwrap_or(0)).collect();
            if let Some(last) = wanted.last_mut() {
                *last = widths.iter().sum();
            }
            if shape != wanted.as_slice() || shapes.iter().any(|s| s.len() != wanted.len() || s[..s.len() - 1] != wanted[..wanted.len() - 1]) || !matches!(shape.len(), 1 | 2) {
                return Err(wrong_shape(&wanted));
            }
            let mut start = 0;
            let mut out = Vec::new();
            for (ours, width) in parts.into_iter().zip(widths) {
                out.push((ours, columns(shape, values, start, width)));
                start += width;
            }
            out
        }
    })
}

/// Where an exported tensor's values come from: shardc parameters, named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recipe {
    /// A parameter as it is.
    Same(String),
    /// An `[in, out]` weight as `nn.Linear`'s `[out, in]`.
    Transposed(String),
    /// Expert `e` of an `[experts, in, out]` weight, as `nn.Linear`'s `[out, in]`.
    Expert(String, usize),
    /// GPT-2's `c_attn`: q, k and v side by side along the output dimension.
    Fused([String; 3]),
}

/// One tensor of a Hugging Face model folder: its name, shape, and where its values come
/// from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    /// The Hugging Face name.
    pub name: String,
    /// The Hugging Face shape.
    pub shape: Vec<usize>,
    /// The shardc parameters it is made of.
    pub recipe: Recipe,
}

/// The tensors of a Hugging Face folder of `family` made from shardc parameters of
/// `shapes` (name -> global shape), the inverse of [`import`]: names, shapes and recipes,
/// no values, so that a writer can read each parameter when its tensor is written.
pub fn export_plan(family: Family, shapes: &BTreeMap<String, Vec<usize>>, tied: bool) -> Result<Vec<Exported>, RuntimeError> {
    let mut out = Vec::new();
    let shape = |name: &str| shapes.get(name).cloned().ok_or_else(|| bad(format!("the model has no parameter `{name}`")));
    let matrix = |name: &str| -> Result<Vec<usize>, RuntimeError> {
        let s = shape(name)?;
        if s.len() != 2 {
            return Err(bad(format!("parameter `{name}` has shape {s:?}; a matrix was expected")));
        }
        Ok(s)
    };
    let same = |ours: &str, theirs: String| -> Result<Exported, RuntimeError> { Ok(Exported { name: theirs, shape: shape(ours)?, recipe: Recipe::Same(ours.to_string()) }) };
    let transposed = |ours: &str, theirs: String| -> Result<Exported, RuntimeError> {
        let s = matrix(ours)?;
        Ok(Exported { name: theirs, shape: vec![s[1], s[0]], recipe: Recipe::Transposed(ours.to_string()) })
    };
    let layers = shapes.keys().filter_map(|k| k.strip_prefix("layers.")?.split('.').next()?.parse::<usize>().ok()).max().map_or(0, |l| l + 1);
    match family {
        Family::Gpt2 => {
            out.push(same("embed.tokens.weight", "transformer.wte.weight".into())?);
            out.push(same("embed.positions.weight", "transformer.wpe.weight".into())?);
            for l in 0..layers {
                let (p, h) = (format!("layers.{l}"), format!("transformer.h.{l}"));
                for kind in ["weight", "bias"] {
                    out.push(same(&format!("{p}.attn_norm.{kind}"), format!("{h}.ln_1.{kind}"))?);
                    let parts = ["q", "k", "v"].map(|w| format!("{p}.attn.{w}.{kind}"));
                    let part_shapes: Vec<Vec<usize>> = parts.iter().map(|n| shape(n)).collect::<Result<_, _>>()?;
                    let fused = if kind == "bias" {
                        vec![part_shapes.iter().map(|s| s.iter().product::<usize>()).sum()]
                    } else {
                        if part_shapes.iter().any(|s| s.len() != 2 || *s != part_shapes[0]) {
                            return Err(bad(format!("GPT-2's c_attn fuses q, k and v of one shape; {p}.attn has {part_shapes:?}")));
                        }
                        vec![part_shapes[0][0], 3 * part_shapes[0][1]]
                    };
                    out.push(Exported { name: format!("{h}.attn.c_attn.{kind}"), shape: fused, recipe: Recipe::Fused(parts) });
                    out.push(same(&format!("{p}.attn.out.{kind}"), format!("{h}.attn.c_proj.{kind}"))?);
                    out.push(same(&format!("{p}.mlp_norm.{kind}"), format!("{h}.ln_2.{kind}"))?);
                    out.push(same(&format!("{p}.mlp.up.{kind}"), format!("{h}.mlp.c_fc.{kind}"))?);
                    out.push(same(&format!("{p}.mlp.down.{kind}"), format!("{h}.mlp.c_proj.{kind}"))?);
                }
            }
            out.push(same("final_norm.weight", "transformer.ln_f.weight".into())?);
            out.push(same("final_norm.bias", "transformer.ln_f.bias".into())?);
            if !tied {
                out.push(transposed("lm_head.weight", "lm_head.weight".into())?);
            }
        }
        Family::Llama | Family::Mixtral => {
            out.push(same("embed.tokens.weight", "model.embed_tokens.weight".into())?);
            for l in 0..layers {
                let (p, h) = (format!("layers.{l}"), format!("model.layers.{l}"));
                out.push(same(&format!("{p}.attn_norm.weight"), format!("{h}.input_layernorm.weight"))?);
                out.push(same(&format!("{p}.mlp_norm.weight"), format!("{h}.post_attention_layernorm.weight"))?);
                let attention = [("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"), ("attn.out", "self_attn.o_proj")];
                let mlp: &[(&str, &str)] = if family == Family::Mixtral { &[("mlp.router", "block_sparse_moe.gate")] } else { &[("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj")] };
                for (ours, theirs) in attention.iter().chain(mlp) {
                    out.push(transposed(&format!("{p}.{ours}.weight"), format!("{h}.{theirs}.weight"))?);
                }
                if family == Family::Mixtral {
                    // Each expert's gate (w1), up (w3) and down (w2), as nn.Linear [out, in].
                    for (ours, theirs) in [("gate", "w1"), ("up", "w3"), ("down", "w2")] {
                        let name = format!("{p}.mlp.experts.{ours}.weight");
                        let s = shape(&name)?;
                        if s.len() != 3 {
                            return Err(bad(format!("parameter `{name}` has shape {s:?}; [experts, in, out] was expected")));
                        }
                        for e in 0..s[0] {
                            out.push(Exported { name: format!("{h}.block_sparse_moe.experts.{e}.{theirs}.weight"), shape: vec![s[2], s[1]], recipe: Recipe::Expert(name.clone(), e) });
                        }
                    }
                }
            }
            out.push(same("final_norm.weight", "model.norm.weight".into())?);
            if !tied {
                out.push(transposed("lm_head.weight", "lm_head.weight".into())?);
            }
        }
    }
    Ok(out)
}

/// The values of an exported tensor of shape `shape` (f32), its parameters read with
/// `read(name)` (global values, in shardc's layout of the shape `shapes` gives).
pub fn export_values(tensor: &Exported, shapes: &BTreeMap<String, Vec<usize>>, read: &mut dyn FnMut(&str) -> Result<std::rc::Rc<Vec<f64>>, RuntimeError>) -> Result<Vec<f32>, RuntimeError> {
    let shape_of = |name: &str| shapes.get(name).ok_or_else(|| bad(format!("the model has no parameter `{name}`")));
    let values: Vec<f64> = match &tensor.recipe {
        Recipe::Same(name) => read(name)?.to_vec(),
        Recipe::Transposed(name) => transpose(shape_of(name)?, &read(name)?).1,
        Recipe::Expert(name, e) => {
            let s = shape_of(name)?;
            let per = s[1] * s[2];
            transpose(&s[1..], &read(name)?[e * per..(e + 1) * per]).1
        }
        Recipe::Fused(parts) => {
            let parts: Vec<std::rc::Rc<Vec<f64>>> = parts.iter().map(|n| read(n)).collect::<Result<_, _>>()?;
            if tensor.shape.len() == 1 {
                parts.iter().flat_map(|t| t.iter().copied()).collect()
            } else {
                let (rows, width) = (tensor.shape[0], tensor.shape[1] / 3);
                (0..rows).flat_map(|r| parts.iter().flat_map(move |t| t[r * width..(r + 1) * width].iter().copied())).collect()
            }
        }
    };
    if values.len() != tensor.shape.iter().product::<usize>() {
        return Err(bad(format!("{}: {} values for shape {:?}", tensor.name, values.len(), tensor.shape)));
    }
    Ok(values.into_iter().map(|x| x as f32).collect())
}

/// shardc parameters in the Hugging Face layout and names of `family` (f32), the inverse
/// of [`import`].
pub fn export(family: Family, params: &Tensors, tied: bool) -> Result<Vec<(String, Vec<usize>, Vec<f32>)>, RuntimeError> {
    let shapes: BTreeMap<String, Vec<usize>> = params.iter().map(|(n, (s, _))| (n.clone(), s.clone())).collect();
    let mut read = |name: &str| params.get(name).map(|(_, v)| std::rc::Rc::new(v.clone())).ok_or_else(|| bad(format!("the model has no parameter `{name}`")));
    export_plan(family, &shapes, tied)?.into_iter().map(|t| Ok((t.name.clone(), t.shape.clone(), export_values(&t, &shapes, &mut read)?))).collect()
}

/// Writes `model.safetensors` of `family` (f32, with the `pt` format metadata
/// `transformers` expects) from a run's parameters, one tensor at a time: each parameter is
/// read when the first tensor made of it is written (and kept only while the next one uses
/// it too: a Mixtral layer's experts), so that no more than a tensor or two is ever held.
pub fn write_model(path: &Path, family: Family, source: &dyn crate::train::ParameterSource, tied: bool) -> Result<(), RuntimeError> {
    let shapes = source.parameter_shapes()?;
    let plan = export_plan(family, &shapes, tied)?;
    let header: Vec<(String, Vec<usize>, Dtype)> = plan.iter().map(|t| (t.name.clone(), t.shape.clone(), Dtype::F32)).collect();
    let mut last: Option<(String, std::rc::Rc<Vec<f64>>)> = None;
    let mut read = |name: &str| -> Result<std::rc::Rc<Vec<f64>>, RuntimeError> {
        if let Some((held, values)) = &last
            && held == name
        {
            return Ok(values.clone());
        }
        let values = std::rc::Rc::new(source.parameter_values(name)?);
        last = Some((name.to_string(), values.clone()));
        Ok(values)
    };
    crate::tensor_file::write_streamed(path, &header, &[("format", "pt")], |i| Ok(export_values(&plan[i], &shapes, &mut read)?.iter().flat_map(|x| x.to_le_bytes()).collect()))?;
    Ok(())
}

/// Writes `model.safetensors` (f32, with the `pt` format metadata `transformers` expects).
pub fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Result<(), RuntimeError> {
    let header: Vec<(String, Vec<usize>, Dtype)> = tensors.iter().map(|(name, shape, _)| (name.clone(), shape.clone(), Dtype::F32)).collect();
    crate::tensor_file::write_streamed(path, &header, &[("format", "pt")], |i| Ok(tensors[i].2.iter().flat_map(|x| x.to_le_bytes()).collect()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn folder(tag: &str, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("shardc-hf-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let views: Vec<(String, TensorView)> = tensors.iter().map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
        std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
        dir
    }

    fn floats(n: usize) -> Vec<u8> {
        (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect()
    }

    /// A folder of several safetensors files (name -> tensors), with `index` as its weight_map.
    fn sharded(tag: &str, files: &[(&str, &[&str])], index: &[(&str, &str)]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("shardc-hf-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let data = floats(2);
        for (file, names) in files {
            let views: Vec<(String, TensorView)> = names.iter().map(|n| (n.to_string(), TensorView::new(Dtype::F32, vec![2], &data).unwrap())).collect();
            std::fs::write(dir.join(file), safetensors::serialize(views, None).unwrap()).unwrap();
        }
        let map: serde_json::Map<String, serde_json::Value> = index.iter().map(|(n, f)| (n.to_string(), serde_json::Value::String(f.to_string()))).collect();
        std::fs::write(dir.join("model.safetensors.index.json"), serde_json::json!({"metadata": {}, "weight_map": map}).to_string()).unwrap();
        dir
    }

    /// The index and the files must agree on where each tensor is: a tensor in another file
    /// than its weight_map entry, in two files, in no entry, or an entry its file lacks, is an
    /// error naming the tensor and the files (issue 17).
    #[test]
    fn a_sharded_folder_whose_index_and_files_disagree_is_an_error() {
        let (a, b) = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
        let dir = sharded("index-ok", &[(a, &["h.0.ln_1.weight"]), (b, &["h.0.ln_1.bias"])], &[("h.0.ln_1.weight", a), ("h.0.ln_1.bias", b)]);
        assert_eq!(read_dir(&dir).unwrap().len(), 2);
        let _ = std::fs::remove_dir_all(&dir);
        let cases: [(&str, &[(&str, &[&str])], &[(&str, &str)], &[&str]); 4] = [
            // In b, the index says a.
            ("index-elsewhere", &[(a, &["h.0.ln_1.weight"]), (b, &["h.0.ln_1.bias", "h.0.ln_2.weight"])], &[("h.0.ln_1.weight", a), ("h.0.ln_1.bias", a), ("h.0.ln_2.weight", b)], &["`h.0.ln_1.bias`", "is in model-00002-of-00002", "puts it in model-00001-of-00002"]),
            // In both files.
            ("index-twice", &[(a, &["h.0.ln_1.weight"]), (b, &["h.0.ln_1.weight", "h.0.ln_1.bias"])], &[("h.0.ln_1.weight", a), ("h.0.ln_1.bias", b)], &["`h.0.ln_1.weight`", "is also in model-00001-of-00002", "keep one copy"]),
            // In a file, not in the index.
            ("index-unlisted", &[(a, &["h.0.ln_1.weight", "h.0.ln_2.weight"]), (b, &["h.0.ln_1.bias"])], &[("h.0.ln_1.weight", a), ("h.0.ln_1.bias", b)], &["`h.0.ln_2.weight`", "does not list it"]),
            // In the index, in no file.
            ("index-missing", &[(a, &["h.0.ln_1.weight"]), (b, &["h.0.ln_1.bias"])], &[("h.0.ln_1.weight", a), ("h.0.ln_1.bias", b), ("h.0.ln_2.weight", b)], &["`h.0.ln_2.weight`", "in model-00002-of-00002", "does not hold it"]),
        ];
        for (tag, files, index, says) in cases {
            let dir = sharded(tag, files, index);
            let e = read_dir(&dir).unwrap_err().to_string();
            for s in says {
                assert!(e.contains(s), "{tag}: `{s}` not in: {e}");
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// A tensor whose name has no place in the family, or lies in a layer past the config's
    /// layer count, is an error naming it (and the config key) rather than dropped (issue 17).
    /// Mixtral's experts come one tensor each and are stacked; one missing, one given twice,
    /// or one past the experts there are is an error naming it.
    #[test]
    fn experts_are_stacked_and_a_missing_one_is_named() {
        let expected: BTreeMap<String, Vec<usize>> = [("layers.0.mlp.experts.gate.weight".to_string(), vec![3, 2, 4])].into();
        let expert = |e: usize| (format!("model.layers.0.block_sparse_moe.experts.{e}.w1.weight"), (vec![4, 2], (0..8).map(|i| (10 * e + i) as f64).collect::<Vec<f64>>()));
        let hf: Tensors = (0..3).map(expert).collect();
        let ours = import(Family::Mixtral, &hf, false, &expected).unwrap();
        let (shape, values) = &ours["layers.0.mlp.experts.gate.weight"];
        assert_eq!(shape, &vec![3, 2, 4]);
        // Expert 1's [out 4, in 2] transposed to [in 2, out 4].
        assert_eq!(&values[8..16], &[10.0, 12.0, 14.0, 16.0, 11.0, 13.0, 15.0, 17.0]);
        let missing: Tensors = [expert(0), expert(2)].into_iter().collect();
        let e = import(Family::Mixtral, &missing, false, &expected).unwrap_err().to_string();
        assert!(e.contains("expert 1 of `layers.0.mlp.experts.gate.weight` is missing"), "{e}");
        let past: Tensors = (0..4).map(expert).collect();
        let e = import(Family::Mixtral, &past, false, &expected).unwrap_err().to_string();
        assert!(e.contains("is expert 3, past config.json's `num_local_experts` = 3"), "{e}");
    }

    #[test]
    fn tensors_with_no_place_in_the_model_are_named() {
        let t = |name: &str, shape: Vec<usize>| -> Tensors { [(name.to_string(), (shape.clone(), vec![0.0; shape.iter().product()]))].into() };
        for (family, name, says) in [
            (Family::Gpt2, "transformer.h.0.attn.c_attn.scale", "has no place in a GPT-2 model"),
            (Family::Gpt2, "transformer.wte.extra", "has no place in a GPT-2 model"),
            (Family::Gpt2, "score.weight", "has no place in a GPT-2 model"),
            (Family::Llama, "model.layers.0.self_attn.q_proj.bias", "has no place in a Llama model"),
            (Family::Llama, "model.layers.0", "has no place in a Llama model"),
        ] {
            let e = import(family, &t(name, vec![2]), true, &BTreeMap::new()).unwrap_err().to_string();
            assert!(e.contains(&format!("`{name}`")) && e.contains(says), "{name}: {e}");
        }
        // Two layers in the config (layers 0 and 1): layer 2 is past them.
        let expected: BTreeMap<String, Vec<usize>> = (0..2).flat_map(|l| [(format!("layers.{l}.attn_norm.weight"), vec![2]), (format!("layers.{l}.mlp_norm.weight"), vec![2])]).collect();
        for (family, name, key) in [(Family::Gpt2, "transformer.h.2.ln_1.weight", "`n_layer` = 2"), (Family::Llama, "model.layers.2.input_layernorm.weight", "`num_hidden_layers` = 2")] {
            let e = import(family, &t(name, vec![2]), true, &expected).unwrap_err().to_string();
            assert!(e.contains(&format!("`{name}`")) && e.contains("layer 2") && e.contains(key), "{name}: {e}");
        }
        let e = import(Family::Gpt2, &t("transformer.h.1.ln_1.weight", vec![2]), true, &expected).map(|t| t.len());
        assert_eq!(e.unwrap(), 1);
    }

    #[test]
    fn integer_weights_and_one_weight_under_two_prefixes_are_errors() {
        // GPT-2's mask buffer is skipped; an integer weight is an error naming it.
        let dir = folder("int", &[("h.0.attn.bias", Dtype::U8, vec![4], vec![1; 4]), ("h.0.ln_1.weight", Dtype::I64, vec![2], vec![0; 16])]);
        let e = read_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("h.0.ln_1.weight") && e.contains("I64"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
        let dir = folder("mask", &[("h.0.attn.bias", Dtype::U8, vec![4], vec![1; 4]), ("h.0.ln_1.weight", Dtype::F32, vec![2], floats(2))]);
        assert_eq!(read_dir(&dir).unwrap().len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
        // The same weight with and without the `transformer.` prefix.
        let dir = folder("dup", &[("transformer.h.0.ln_1.weight", Dtype::F32, vec![2], floats(2)), ("h.0.ln_1.weight", Dtype::F32, vec![2], floats(2))]);
        let e = import(Family::Gpt2, &read_dir(&dir).unwrap(), true, &BTreeMap::new()).unwrap_err().to_string();
        assert!(e.contains("transformer.h.0.ln_1.weight") && e.contains("two prefixes"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A run's parameters, counting how often each is read.
    struct Counting {
        state: crate::train::TrainState,
        reads: std::cell::RefCell<BTreeMap<String, usize>>,
    }

    impl crate::train::ParameterSource for Counting {
        fn parameter_shapes(&self) -> Result<BTreeMap<String, Vec<usize>>, RuntimeError> {
            self.state.parameter_shapes()
        }

        fn parameter_values(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
            *self.reads.borrow_mut().entry(name.to_string()).or_default() += 1;
            self.state.parameter_values(name)
        }
    }

    /// Distinct values for every parameter of `shapes` (and an fp32 master for one, which
    /// the export takes in place of the parameter).
    fn state_of(shapes: &[(&str, Vec<usize>)]) -> crate::train::TrainState {
        let mut tensors = BTreeMap::new();
        let mut next = 0.0;
        for (name, shape) in shapes {
            let values: Vec<f64> = (0..shape.iter().product::<usize>()).map(|_| {
                next += 0.25;
                next
            }).collect();
            tensors.insert(name.to_string(), (shape.clone(), values));
        }
        let (shape, values) = tensors["final_norm.weight"].clone();
        tensors.insert(crate::program::master_name("final_norm.weight"), (shape, values.iter().map(|v| v + 0.125).collect()));
        crate::train::TrainState { step: 0, tensors }
    }

    /// A model folder written a tensor at a time reads every parameter once (a Mixtral
    /// layer's experts share one read) and holds what the whole export holds, for GPT-2's
    /// fused attention, Llama's transposes and Mixtral's experts, tied or not.
    #[test]
    fn a_model_written_a_tensor_at_a_time_is_the_whole_export() {
        let (h, v, f, e) = (4, 6, 8, 3);
        let gpt2: Vec<(&str, Vec<usize>)> = vec![
            ("embed.tokens.weight", vec![v, h]),
            ("embed.positions.weight", vec![5, h]),
            ("layers.0.attn_norm.weight", vec![h]),
            ("layers.0.attn_norm.bias", vec![h]),
            ("layers.0.attn.q.weight", vec![h, h]),
            ("layers.0.attn.k.weight", vec![h, h]),
            ("layers.0.attn.v.weight", vec![h, h]),
            ("layers.0.attn.q.bias", vec![h]),
            ("layers.0.attn.k.bias", vec![h]),
            ("layers.0.attn.v.bias", vec![h]),
            ("layers.0.attn.out.weight", vec![h, h]),
            ("layers.0.attn.out.bias", vec![h]),
            ("layers.0.mlp_norm.weight", vec![h]),
            ("layers.0.mlp_norm.bias", vec![h]),
            ("layers.0.mlp.up.weight", vec![h, f]),
            ("layers.0.mlp.up.bias", vec![f]),
            ("layers.0.mlp.down.weight", vec![f, h]),
            ("layers.0.mlp.down.bias", vec![h]),
            ("final_norm.weight", vec![h]),
            ("final_norm.bias", vec![h]),
            ("lm_head.weight", vec![h, v]),
        ];
        let mut mixtral: Vec<(&str, Vec<usize>)> = vec![
            ("embed.tokens.weight", vec![v, h]),
            ("layers.0.attn_norm.weight", vec![h]),
            ("layers.0.mlp_norm.weight", vec![h]),
            ("layers.0.attn.q.weight", vec![h, h]),
            ("layers.0.attn.k.weight", vec![h, 2]),
            ("layers.0.attn.v.weight", vec![h, 2]),
            ("layers.0.attn.out.weight", vec![h, h]),
            ("final_norm.weight", vec![h]),
            ("lm_head.weight", vec![h, v]),
        ];
        let mut llama = mixtral.clone();
        llama.extend([("layers.0.mlp.gate.weight", vec![h, f]), ("layers.0.mlp.up.weight", vec![h, f]), ("layers.0.mlp.down.weight", vec![f, h])]);
        mixtral.extend([
            ("layers.0.mlp.router.weight", vec![h, e]),
            ("layers.0.mlp.experts.gate.weight", vec![e, h, f]),
            ("layers.0.mlp.experts.up.weight", vec![e, h, f]),
            ("layers.0.mlp.experts.down.weight", vec![e, f, h]),
        ]);
        for (family, shapes) in [(Family::Gpt2, gpt2), (Family::Llama, llama), (Family::Mixtral, mixtral)] {
            for tied in [false, true] {
                let what = format!("{family:?} tied={tied}");
                let source = Counting { state: state_of(&shapes), reads: Default::default() };
                let params: Tensors = source.state.tensors.keys().filter(|n| crate::program::state_of(n).is_none()).map(|n| (n.clone(), source.state.parameter(n).unwrap().clone())).collect();
                let whole = export(family, &params, tied).unwrap();
                let dir = std::env::temp_dir().join(format!("shardc-hf-stream-{family:?}-{tied}-{}", std::process::id()));
                std::fs::create_dir_all(&dir).unwrap();
                write_model(&dir.join("model.safetensors"), family, &source, tied).unwrap();
                let written = HfFolder::open(&dir).unwrap();
                assert_eq!(written.names().count(), whole.len(), "{what}");
                for (name, shape, values) in &whole {
                    let (have_shape, have) = written.read(name).unwrap().unwrap_or_else(|| panic!("{what}: no {name}"));
                    assert_eq!((&have_shape, have.iter().map(|&x| x as f32).collect::<Vec<_>>()), (shape, values.clone()), "{what}: {name}");
                }
                // The master, not the parameter, is exported.
                let norm = if family == Family::Gpt2 { "transformer.ln_f.weight" } else { "model.norm.weight" };
                assert_eq!(written.read(norm).unwrap().unwrap().1[0], source.state.tensors["final_norm.weight"].1[0] + 0.125, "{what}");
                let reads = source.reads.borrow();
                assert!(reads.values().all(|&n| n == 1), "{what}: {reads:?}");
                let used = params.len() - usize::from(tied);
                assert_eq!(reads.len(), used, "{what}: {reads:?}");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}
