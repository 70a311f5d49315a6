//! `--hf` and `--save-hf`: Hugging Face model folders in and out, and `shardc logits`.

use std::path::{Path, PathBuf};

use clap::Args;
use miette::{IntoDiagnostic, Result, WrapErr, miette};
use shardc_ir::spec::hf::{to_hf_config, HfFamily};
use shardc_ir::spec::Spec;
use shardc_runtime::hf::{self as rhf, Family, Tensors};

use crate::options::StepArgs;

fn family(spec: &Spec) -> Result<Family> {
    match HfFamily::of(spec) {
        Some(HfFamily::Gpt2) => Ok(Family::Gpt2),
        Some(HfFamily::Llama) => Ok(Family::Llama),
        Some(HfFamily::Mixtral) => Ok(Family::Mixtral),
        None => Err(miette!("{}", to_hf_config(spec).err().unwrap_or_default())),
    }
}

/// The weights of a Hugging Face folder as shardc parameters, checked against the spec: every
/// tensor must have the shape the spec (its config.json) gives the parameter it becomes.
/// Only the tensors that become parameters are read, as [`LazyWeights`] reads them: not
/// GPT-2's mask buffers, a tied model's output head or Llama's rotary frequencies.
pub fn load_weights(dir: &Path, spec: &Spec) -> Result<Tensors> {
    let folder = rhf::HfFolder::open(dir).into_diagnostic()?;
    let (family, tied) = (family(spec)?, spec.model.tied_embeddings);
    let context = || format!("reading the weights of {}", dir.display());
    rhf::check_names(folder.names()).into_diagnostic().wrap_err_with(context)?;
    let mut raw = Tensors::new();
    for name in folder.names() {
        if rhf::parameters_of(family, name, tied).into_diagnostic().wrap_err_with(context)?.is_empty() {
            continue;
        }
        if let Some(tensor) = folder.read(name).into_diagnostic()? {
            raw.insert(name.clone(), tensor);
        }
    }
    let params = rhf::import(family, &raw, tied, &parameter_shapes(spec)?).into_diagnostic().wrap_err_with(context)?;
    Ok(params)
}

#[cfg(feature = "cuda")]
/// A Hugging Face folder's weights as shardc parameters read one at a time, for a process
/// that keeps only its own shards: the folder's headers and names are checked at once (as
/// [`load_weights`] checks them), each tensor's values when a parameter asks for it.
pub struct LazyWeights {
    folder: rhf::HfFolder,
    family: Family,
    tied: bool,
    expected: std::collections::BTreeMap<String, Vec<usize>>,
    /// Every parameter's Hugging Face tensors (several for a stacked expert parameter).
    source: std::collections::BTreeMap<String, Vec<String>>,
    /// The parameters the tensor read last became (GPT-2's fused q, k, v come together).
    last: Vec<(String, shardc_runtime::tensor_file::Tensor)>,
}

#[cfg(feature = "cuda")]
impl LazyWeights {
    pub fn open(dir: &Path, spec: &Spec) -> Result<LazyWeights> {
        let folder = rhf::HfFolder::open(dir).into_diagnostic()?;
        let (family, tied, expected) = (family(spec)?, spec.model.tied_embeddings, parameter_shapes(spec)?);
        let context = || format!("reading the weights of {}", dir.display());
        rhf::check_names(folder.names()).into_diagnostic().wrap_err_with(context)?;
        let mut source: std::collections::BTreeMap<String, Vec<String>> = std::collections::BTreeMap::new();
        for name in folder.names() {
            for ours in rhf::parameters_of(family, name, tied).into_diagnostic().wrap_err_with(context)? {
                if !expected.contains_key(&ours) {
                    // The error import gives a tensor with no place in the model.
                    rhf::import_tensor(family, name, &[], &[], tied, &expected).into_diagnostic().wrap_err_with(context)?;
                }
                source.entry(ours).or_default().push(name.clone());
            }
        }
        Ok(LazyWeights { folder, family, tied, expected, source, last: Vec::new() })
    }

    /// How many parameters the folder holds.
    pub fn len(&self) -> usize {
        self.source.len()
    }

    /// Parameter `name` (shardc's name and layout), or `None` when the folder lacks it.
    pub fn parameter(&mut self, name: &str) -> Result<Option<shardc_runtime::tensor_file::Tensor>, shardc_runtime::RuntimeError> {
        if let Some((_, tensor)) = self.last.iter().find(|(n, _)| n == name) {
            return Ok(Some(tensor.clone()));
        }
        let Some(hf_names) = self.source.get(name) else { return Ok(None) };
        let mut parts = Vec::new();
        for hf_name in hf_names {
            let Some((shape, values)) = self.folder.read(hf_name)? else { return Ok(None) };
            parts.extend(rhf::import_tensor(self.family, hf_name, &shape, &values, self.tied, &self.expected)?);
        }
        // A stacked expert parameter, from each expert's tensor.
        if parts.iter().any(|(n, _)| n != name && n.starts_with(name) && n.ends_with(']')) {
            let mut tensors: Tensors = parts.into_iter().collect();
            rhf::stack_experts(&mut tensors, &self.expected)?;
            parts = tensors.into_iter().collect();
        }
        self.last = parts;
        Ok(self.last.iter().find(|(n, _)| n == name).map(|(_, t)| t.clone()))
    }
}

/// The shape of every parameter of the spec's model, as the frontend declares it (a padded
/// vocabulary's real size).
fn parameter_shapes(spec: &Spec) -> Result<std::collections::BTreeMap<String, Vec<usize>>> {
    let module = shardc_ir::spec::lower(spec, spec.step_shape(&shardc_ir::mesh::Mesh::default())).into_diagnostic()?;
    let forward = module.func("forward").ok_or_else(|| miette!("the frontend produced no @forward"))?;
    Ok(forward
        .args_with(shardc_ir::graph::ArgRole::Param)
        .filter_map(|a| {
            let shape = a.unpadded.clone().or_else(|| forward.tensor(a.value).map(|t| t.shape.clone()))?;
            Some((a.name.clone(), shape.iter().map(|&d| d.max(0) as usize).collect()))
        })
        .collect())
}

/// Writes `config.json` and `model.safetensors` for a run's parameters, a tensor at a time.
pub fn save(dir: &Path, spec: &Spec, source: &dyn shardc_runtime::train::ParameterSource) -> Result<()> {
    let config = to_hf_config(spec).map_err(|e| miette!(help = "--save-hf writes GPT-2, Llama and Mixtral models", "{e}"))?;
    std::fs::create_dir_all(dir).into_diagnostic().wrap_err_with(|| format!("creating {}", dir.display()))?;
    rhf::write_model(&dir.join("model.safetensors"), family(spec)?, source, spec.model.tied_embeddings).into_diagnostic()?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).into_diagnostic()?).into_diagnostic()?;
    println!("  saved       {} (Hugging Face {}: config.json, model.safetensors)", dir.display(), config["model_type"].as_str().unwrap_or(""));
    Ok(())
}

/// Arguments of `shardc logits`.
#[derive(Args, Debug)]
pub struct LogitsArgs {
    /// Token ids: rows separated by `;`, ids by `,` (every row the same length).
    #[arg(long)]
    pub tokens: String,
    /// Device mesh as axis=size pairs (the logits are computed partitioned and gathered).
    #[arg(long, default_value = "dp=1,tp=1,pp=1")]
    pub mesh: String,
    /// Write the logits as JSON (`{"shape": [b, s, vocab], "values": [...]}`).
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub model: crate::options::ModelArgs,
}

/// `shardc logits --hf DIR --tokens ..`: the model's logits on a batch, on a mesh.
pub fn logits(args: &LogitsArgs) -> Result<()> {
    let rows: Vec<Vec<i32>> = args
        .tokens
        .split(';')
        .map(|row| row.split(',').map(|t| t.trim().parse::<i32>().map_err(|e| miette!("--tokens: `{t}`: {e}"))).collect::<Result<Vec<_>>>())
        .collect::<Result<_>>()?;
    let seq = rows.first().map_or(0, Vec::len);
    if seq == 0 || rows.iter().any(|r| r.len() != seq) {
        return Err(miette!(help = "e.g. --tokens '1,2,3;4,5,6'", "--tokens: every row needs the same, non-zero number of ids"));
    }
    // The batch is the tokens' shape; the rest of the step does not enter the logits.
    let mut step = StepArgs { model: args.model.clone(), ..StepArgs::default() };
    step.batch.seq = Some(seq as u64);
    step.batch.micro_batch = Some(rows.len() as u64);
    let spec = step.load_spec(None)?;
    let hf = step.hf_dir(None).ok_or_else(|| miette!("shardc logits needs --hf DIR"))?;
    let mesh = shardc_ir::mesh::Mesh::parse(&args.mesh).map_err(|e| crate::report::mesh_report(vec![e]))?;
    if mesh.cp > 1 && !(seq as u64).is_multiple_of(2 * mesh.cp) {
        return Err(miette!(
            help = format!("give rows of a multiple of {} ids, or a smaller cp", 2 * mesh.cp),
            "--tokens: rows of {seq} ids do not split into the {} equal chunks of --mesh {mesh} (each context-parallel rank holds two)",
            2 * mesh.cp
        ));
    }
    let problems = mesh.check(&spec);
    if !problems.is_empty() {
        return Err(crate::report::mesh_report(problems));
    }
    let params = load_weights(&hf, &spec)?;
    // The rows are the whole batch, split over the data-parallel replicas.
    let shape = shardc_ir::spec::StepShape { rows: rows.len() as u64, ..spec.step_shape(&mesh) };
    let mut module = shardc_ir::spec::lower_logits(&spec, shape).into_diagnostic()?;
    let options = step.compile_options(&spec, mesh)?;
    let cx = crate::ir_context()?;
    shardc_passes::inference_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).into_diagnostic()?;
    let grid: Vec<i64> = module.grids.first().map(|g| g.shape.clone()).unwrap_or_default();
    let func = module.func("logits").ok_or_else(|| miette!("the pipeline produced no @logits"))?;
    let program = shardc_codegen::lower_func_on(func, &grid).into_diagnostic()?;
    let tokens: Vec<i32> = rows.concat();
    let values = shardc_runtime::train::logits(&program, &params, &tokens, spec.model.vocab as usize).into_diagnostic()?;
    let shape = [rows.len(), seq, spec.model.vocab as usize];
    let collectives = program.instrs.iter().filter(|i| i.op.starts_with("shard.")).count();
    println!("shardc: logits of {} on mesh {mesh} ({} ranks, {collectives} collectives each): shape {shape:?}, first {:?}", spec.name, mesh.ranks(), &values[..values.len().min(4)]);
    if let Some(path) = &args.output {
        // JSON has no NaN or infinity (serde writes null): say where instead of writing it.
        if let Some(at) = values.iter().position(|v| !v.is_finite()) {
            let (row, rest) = (at / (seq * shape[2]), at % (seq * shape[2]));
            return Err(miette!(
                help = "check the weights (a NaN or an overflow in the folder's tensors)",
                "the logit at [{row}, {}, {}] is {}: -o {} would not hold it",
                rest / shape[2],
                rest % shape[2],
                values[at],
                path.display()
            ));
        }
        let json = serde_json::json!({ "shape": shape, "values": values });
        std::fs::write(path, serde_json::to_string(&json).into_diagnostic()?).into_diagnostic().wrap_err_with(|| format!("writing {}", path.display()))?;
        println!("  written     {}", path.display());
    }
    Ok(())
}
