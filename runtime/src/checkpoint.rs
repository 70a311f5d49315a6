//! Parameters in the safetensors format, named as in the IR (`layers.3.attn.q.weight`):
//! single files (`to_bytes`/`from_bytes`, the caller does the IO) and sharded training
//! checkpoints (one file per rank and a manifest, written atomically, read back under any
//! mesh).

use std::collections::HashMap;

use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use crate::collectives::MeshShape;
use crate::program::{Program, Role};
use crate::train::TrainState;
use crate::RuntimeError;

/// Named f32 tensors: `(name, shape, values)`.
pub type NamedTensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Writes a run's parameters (by name, global: what `--load` reads) to the safetensors file
/// `path`, one tensor at a time as `source` reads them: in f32, which an f32 or bf16 model's
/// parameters (a bf16 model's fp32 masters) take exactly, or in f64 for an f64 model (`f64`),
/// so that a file loads back to the values saved.
pub fn write_parameters(path: &std::path::Path, source: &dyn crate::train::ParameterSource, f64: bool) -> Result<(), RuntimeError> {
    let dtype = if f64 { Dtype::F64 } else { Dtype::F32 };
    let header: Vec<(String, Vec<usize>, Dtype)> = source.parameter_shapes()?.into_iter().map(|(name, shape)| (name, shape, dtype)).collect();
    // The writer checks each tensor's bytes against its shape.
    crate::tensor_file::write_streamed(path, &header, &[("format", "pt")], |i| {
        let values = source.parameter_values(&header[i].0)?;
        Ok(if f64 { values.iter().flat_map(|x| x.to_le_bytes()).collect() } else { values.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect() })
    })?;
    Ok(())
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

/// Every parameter of `programs` (each pipeline rank's) with the shape it has outside
/// programs (a padded vocabulary's real rows): what `--save` writes and `--load` reads.
pub fn model_parameters(programs: &[Program]) -> std::collections::BTreeMap<String, Vec<usize>> {
    let mut out = std::collections::BTreeMap::new();
    for program in programs {
        for a in program.args.iter().filter(|a| a.role == Some(Role::Param)) {
            let global = a.layout.as_ref().map_or_else(|| program.buffers[a.buffer].shape.clone(), |l| l.global_shape.clone());
            out.entry(a.name.clone()).or_insert_with(|| a.logical_shape(&global));
        }
    }
    out
}

/// A parameter file (`--load`: global tensors by name, as `--save` writes them) checked
/// against the model of `programs` before any value is read, the same on every backend:
/// every tensor is a parameter of the model, floating point (f32, f64, bf16 or f16: read as
/// the parameter's dtype), of the parameter's shape, and every parameter is there. Values
/// are read one tensor at a time ([`crate::tensor_file::TensorFile::read_f64`], which
/// refuses a value that is not finite).
pub fn open_parameter_file(path: &std::path::Path, programs: &[Program]) -> Result<crate::tensor_file::TensorFile, RuntimeError> {
    let file = crate::tensor_file::TensorFile::open(path)?;
    let parameters = model_parameters(programs);
    let bad = |what: String| RuntimeError::Binding(format!("{}: {what}", path.display()));
    for name in file.names() {
        let info = file.info(&name).expect("a name of the file");
        let Some(shape) = parameters.get(&name) else {
            // Hugging Face names (`transformer.h.0.…`, `model.layers.0.…`, `lm_head.weight`).
            let hint = if ["transformer.", "model.", "lm_head."].iter().any(|p| name.starts_with(p)) { "; a Hugging Face model's weights load from its folder with `--hf DIR`" } else { "" };
            let example = parameters.keys().next().map_or(String::new(), |p| format!(" such as `{p}`"));
            return Err(bad(format!("tensor `{name}` is not a parameter of this model (it has {} parameters{example}, named as `--save` writes them): the file was saved from another model{hint}", parameters.len())));
        };
        if !crate::tensor_file::is_float(info.dtype) {
            return Err(bad(format!("tensor `{name}` is {:?}: parameters are read from floating-point tensors (f32, f64, bf16 or f16)", info.dtype)));
        }
        if info.shape != *shape {
            return Err(bad(format!("tensor `{name}` has shape {:?}, the model needs {shape:?}", info.shape)));
        }
    }
    let missing: Vec<&String> = parameters.keys().filter(|p| file.info(p).is_none()).collect();
    if let Some(first) = missing.first() {
        let more = if missing.len() > 1 { format!(" and {} more", missing.len() - 1) } else { String::new() };
        return Err(bad(format!("has no `{first}`{more}, a parameter of this model: the file was saved from another model")));
    }
    Ok(file)
}

/// The manifest of a sharded checkpoint (`manifest.json` beside one safetensors file per
/// rank).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    /// Bumped on incompatible changes.
    pub format_version: u32,
    /// Optimizer steps taken: the run resumes at `step + 1` (batches are a function of the
    /// seed and the step; `data` holds the samples consumed).
    pub step: u64,
    /// Seed of the run (initialisation and data order).
    pub seed: u64,
    /// Mesh extents (dp, tp, pp) the shards were cut for.
    pub mesh: Vec<usize>,
    /// The model spec the run trained, as given (for checks and for reading it back).
    pub spec: serde_json::Value,
    /// Every tensor: parameters and optimizer state, with their global shape and split.
    pub tensors: Vec<ManifestTensor>,
    /// The rank files, in rank order.
    pub files: Vec<String>,
    /// CRC-32 of each rank file, in the order of `files`: a file that changed after it was
    /// written (a flipped bit, a truncated copy) is refused instead of resumed into garbage.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checksums: Vec<u32>,
    /// The data the run read and how far it got (absent in checkpoints written before shardc
    /// recorded it: those resume with the data order of (seed, step)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<crate::data::DataRecord>,
    /// The update rule, learning-rate schedule and clipping the programs were compiled with
    /// (absent in checkpoints written before shardc recorded it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerRecord>,
}

/// What a training step's updates do, read from its compiled programs: the update op, its
/// learning-rate schedule and the clipping norm. A resumed run must continue it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OptimizerRecord {
    /// `adamw` or `sgd`.
    pub update: String,
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the decay.
    pub min_lr: f64,
    /// Iterations of warmup.
    pub warmup_steps: i64,
    /// Iteration at which the decay ends (0: none).
    pub decay_steps: i64,
    /// Cosine decay (else linear).
    pub cosine: bool,
    /// Largest global gradient norm (0: no clipping).
    pub clip_grad: f64,
}

impl OptimizerRecord {
    /// The record of `programs`' first update op and clipping coefficient; `None` for
    /// programs without updates.
    pub fn of(programs: &[Program]) -> Option<OptimizerRecord> {
        let instrs = || programs.iter().flat_map(|p| p.instrs.iter());
        let update = instrs().find(|i| i.op == "xf.adamw" || i.op == "xf.sgd")?;
        let clip_grad = instrs().find(|i| i.op == "xf.clip_coef").and_then(|i| i.float("max_norm").ok()).unwrap_or(0.0);
        Some(OptimizerRecord {
            update: update.op.trim_start_matches("xf.").to_string(),
            lr: update.float("lr").ok()?,
            min_lr: update.float("min_lr").ok()?,
            warmup_steps: update.int("warmup_steps").ok()?,
            decay_steps: update.int("decay_steps").ok()?,
            cosine: update.int("cosine").ok()? != 0,
            clip_grad,
        })
    }

    /// Checks the record holds what `run`'s options accept (so a resume's advice never names
    /// a flag value that does not exist): a known update rule, a finite positive `lr`, a
    /// `min_lr` in `0..=lr`, warmup and decay within the step counter (a decay ending after
    /// the warmup), and a finite `clip_grad` of at least 0. Errors name the manifest field.
    pub fn check(&self) -> Result<(), String> {
        let edited = "the manifest was edited or is corrupt";
        if !matches!(self.update.as_str(), "adamw" | "sgd") {
            return Err(format!("`optimizer.update` is `{}`, which is not an optimizer shardc has (adamw or sgd): {edited}", self.update.escape_debug()));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!("`optimizer.lr` is {}, not a positive learning rate: {edited}", self.lr));
        }
        if !(self.min_lr.is_finite() && (0.0..=self.lr).contains(&self.min_lr)) {
            return Err(format!("`optimizer.min_lr` is {}, outside 0..=`optimizer.lr` ({}): {edited}", self.min_lr, self.lr));
        }
        let limit = i32::MAX as i64;
        for (field, value) in [("warmup_steps", self.warmup_steps), ("decay_steps", self.decay_steps)] {
            if !(0..=limit).contains(&value) {
                return Err(format!("`optimizer.{field}` is {value}, outside 0..={limit} (the step counter's range): {edited}"));
            }
        }
        if self.decay_steps > 0 && self.decay_steps <= self.warmup_steps {
            return Err(format!("`optimizer.decay_steps` {} does not exceed `optimizer.warmup_steps` {}: {edited}", self.decay_steps, self.warmup_steps));
        }
        if !(self.clip_grad.is_finite() && self.clip_grad >= 0.0) {
            return Err(format!("`optimizer.clip_grad` is {}, not a finite norm of at least 0: {edited}", self.clip_grad));
        }
        Ok(())
    }

    /// The settings that differ from `other`'s, as `name saved (this run: now)`.
    pub fn differences(&self, now: &OptimizerRecord) -> Vec<String> {
        let mut out = Vec::new();
        let mut check = |name: &str, saved: String, this: String| {
            if saved != this {
                out.push(format!("{name} {saved} (this run: {this})"));
            }
        };
        check("optimizer", self.update.clone(), now.update.clone());
        check("lr", self.lr.to_string(), now.lr.to_string());
        check("min-lr", self.min_lr.to_string(), now.min_lr.to_string());
        check("lr-warmup-steps", self.warmup_steps.to_string(), now.warmup_steps.to_string());
        check("lr-decay-steps", self.decay_steps.to_string(), now.decay_steps.to_string());
        let decay = |r: &OptimizerRecord| if r.decay_steps == 0 { "constant" } else if r.cosine { "cosine" } else { "linear" };
        check("lr-decay", decay(self).into(), decay(now).into());
        check("clip-grad", self.clip_grad.to_string(), now.clip_grad.to_string());
        out
    }
}

/// One tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ManifestTensor {
    /// Name (`layers.0.attn.q.weight`, `opt.m.layers.0.attn.q.weight`).
    pub name: String,
    /// The whole tensor's shape.
    pub global_shape: Vec<usize>,
    /// Grid axes splitting each dimension.
    pub split: Vec<Vec<usize>>,
    /// A padded tensor's real shape (a vocabulary padded for tensor parallelism): what it is
    /// when read back, whatever the next run pads it to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpadded: Option<Vec<usize>>,
}

/// The checkpoint format version.
pub const CHECKPOINT_VERSION: u32 = 3;

fn io(path: &std::path::Path, e: std::io::Error) -> RuntimeError {
    RuntimeError::Binding(format!("{}: {e}", path.display()))
}

/// Writes `bytes` to `path` and flushes them to the disk.
fn write_synced(path: &std::path::Path, bytes: &[u8]) -> Result<(), RuntimeError> {
    use std::io::Write;
    let mut file = std::fs::File::create(path).map_err(|e| io(path, e))?;
    file.write_all(bytes).map_err(|e| io(path, e))?;
    file.sync_all().map_err(|e| io(path, e))
}

fn sync_dir(path: &std::path::Path) -> Result<(), RuntimeError> {
    std::fs::File::open(path).and_then(|d| d.sync_all()).map_err(|e| io(path, e))
}

/// f64 tensors as safetensors bytes (a checkpoint of format 2, for the tests that read one).
#[cfg(test)]
fn f64_bytes(tensors: &[(String, Vec<usize>, Vec<f64>)]) -> Result<Vec<u8>, RuntimeError> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| safetensors::tensor::TensorView::new(Dtype::F64, shape.clone(), b).map(|view| (name.clone(), view)).map_err(|e| RuntimeError::Program(format!("tensor {name}: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize(views, None).map_err(|e| RuntimeError::Program(format!("serializing tensors: {e}")))
}

/// Where a tensor lives: its layout (replicated when the program has none) and which
/// program (pipeline coordinate) holds it.
fn layouts(programs: &[Program]) -> Vec<(crate::program::Binding, crate::program::Layout, usize)> {
    let mut out: Vec<(crate::program::Binding, crate::program::Layout, usize)> = Vec::new();
    for (s, program) in programs.iter().enumerate() {
        for a in program.args.iter().filter(|a| a.role.is_some_and(Role::is_state)) {
            if out.iter().any(|(b, _, _)| b.name == a.name) {
                continue;
            }
            let layout = a.layout.clone().unwrap_or_else(|| {
                let shape = program.buffers[a.buffer].shape.clone();
                crate::program::Layout { split: vec![Vec::new(); shape.len()], global_shape: shape }
            });
            out.push((a.clone(), layout, s));
        }
    }
    out
}

/// A run's hold on its checkpoint folder: while it lives, another run cannot write there
/// (released when dropped, or when the process ends however it ends).
#[derive(Debug)]
pub struct FolderLock {
    _file: std::fs::File,
}

/// Takes `dir` (created if needed) for this run's checkpoints: refuses when another run holds
/// it, and clears what crashed runs left half-written there (`.partial-*` folders, `.LATEST-*`
/// files), which nobody else can be writing while the lock is held.
pub fn lock_folder(dir: &std::path::Path) -> Result<FolderLock, RuntimeError> {
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let path = dir.join(".lock");
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(|e| io(&path, e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(RuntimeError::Binding(format!("{}: another run is writing checkpoints into this folder; wait for it to end, or give this run another --checkpoint folder", dir.display())));
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(&path, e)),
    }
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))?.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".partial-") {
            let _ = std::fs::remove_dir_all(entry.path());
        } else if name.starts_with(".LATEST-") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(FolderLock { _file: file })
}

/// Saves `state` as a sharded checkpoint under `dir`: one safetensors file per rank of the
/// programs' mesh holding that rank's shards, and the manifest. Atomic: everything is written
/// and synced in a temporary folder, which is renamed to `step-NNNNNNNN`; then `LATEST` is
/// replaced (write, sync, rename). A crash at any point leaves the previous checkpoint
/// loadable. `abort_after_rank` kills the process after writing that rank's file (fault
/// injection for tests). Keeps this checkpoint and the newest one before it. `data` is the
/// run's data and position, recorded in the manifest.
#[allow(clippy::too_many_arguments)]
pub fn save_sharded(
    dir: &std::path::Path,
    state: &TrainState,
    programs: &[Program],
    spec: serde_json::Value,
    seed: u64,
    data: Option<crate::data::DataRecord>,
    abort_after_rank: Option<usize>,
) -> Result<std::path::PathBuf, RuntimeError> {
    let mesh = checkpoint_mesh(programs)?;
    save_rank_shards(dir, state.step, programs, spec, seed, data, abort_after_rank, |rank, tensor, layout| {
        let global = state.for_program(tensor, &layout.global_shape)?;
        Ok(crate::layout::local_shard(&global, layout, &mesh, rank))
    })
}

/// [`save_sharded`] from each rank's shards as `shard(rank, tensor, layout)` gives them, one
/// tensor of one rank at a time: a process that holds every rank on its devices writes their
/// files from device memory without assembling the global state.
#[allow(clippy::too_many_arguments)]
pub fn save_rank_shards(
    dir: &std::path::Path,
    step: u64,
    programs: &[Program],
    spec: serde_json::Value,
    seed: u64,
    data: Option<crate::data::DataRecord>,
    abort_after_rank: Option<usize>,
    shard: impl Fn(usize, &crate::program::Binding, &crate::program::Layout) -> Result<Vec<f64>, RuntimeError>,
) -> Result<std::path::PathBuf, RuntimeError> {
    let mesh = checkpoint_mesh(programs)?;
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let partial = dir.join(format!(".partial-{}-{}", step_folder(step), std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).map_err(|e| io(&partial, e))?;
    let mut checksums = Vec::new();
    for rank in 0..mesh.ranks() {
        match write_rank_file(&partial, programs, rank, false, |tensor, layout| shard(rank, tensor, layout)) {
            Ok(crc) => checksums.push(crc),
            Err(e) => {
                // Nothing of a checkpoint that is not kept stays behind.
                let _ = std::fs::remove_dir_all(&partial);
                return Err(e);
            }
        }
        if abort_after_rank == Some(rank) {
            std::process::abort();
        }
    }
    commit(dir, &partial, programs, step, spec, seed, data, checksums)
}

/// Whether `name`, directly in a checkpoint folder, is one the checkpoints own: they write or
/// remove it (`LATEST`, the `step-*` folders, what a write in progress leaves, the lock).
/// What a run may not put its other outputs on.
pub fn owns_name(name: &std::ffi::OsStr) -> bool {
    let name = name.to_string_lossy();
    name == "LATEST" || name == ".lock" || name.starts_with(".LATEST-") || name.starts_with("step-") || name.starts_with(".partial-")
}

/// The folder a checkpoint of step `step` is kept in.
fn step_folder(step: u64) -> String {
    format!("step-{step:08}")
}

/// The mesh of the programs' ranks (one rank without one).
fn checkpoint_mesh(programs: &[Program]) -> Result<MeshShape, RuntimeError> {
    let first = programs.first().ok_or_else(|| RuntimeError::Program("no programs to checkpoint".into()))?;
    Ok(MeshShape(if first.mesh.is_empty() { vec![1] } else { first.mesh.clone() }))
}

/// The name of rank `rank`'s file.
fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Writes rank `rank`'s file into `folder`: each state tensor the rank holds (mirrored
/// tensors of a pipeline by their first holder only), its values `shard(binding, layout)`
/// (the rank's shard, in the program's form); returns the file's CRC-32.
fn write_rank_file(folder: &std::path::Path, programs: &[Program], rank: usize, parameters_only: bool, shard: impl Fn(&crate::program::Binding, &crate::program::Layout) -> Result<Vec<f64>, RuntimeError>) -> Result<u32, RuntimeError> {
    let mesh = checkpoint_mesh(programs)?;
    let program_of = |rank: usize| if programs.len() == 1 { 0 } else { mesh.coords(rank).get(2).copied().unwrap_or(0) };
    // Parameters only: each shard once, from the lowest rank of its program holding it.
    let wanted = |tensor: &crate::program::Binding, layout: &crate::program::Layout| {
        if !parameters_only {
            return true;
        }
        let mine = crate::layout::shard_index(layout, &mesh, rank);
        matches!(tensor.role, Some(Role::Param | Role::Master)) && !(0..rank).any(|r| program_of(r) == program_of(rank) && crate::layout::shard_index(layout, &mesh, r) == mine)
    };
    // The rank's tensors, each in the type its values take exactly (f64 in an f64 program,
    // f32 otherwise: fp32 masters, moments and gradients, and bf16 values widen exactly),
    // laid end to end; the header first, then each tensor as its shard is read, one at a
    // time: no rank file is assembled in memory.
    let tensors: Vec<(crate::program::Binding, crate::program::Layout, Vec<usize>, Dtype)> = layouts(programs)
        .into_iter()
        .filter(|(tensor, layout, holder)| (*holder == program_of(rank) || programs.len() == 1) && wanted(tensor, layout))
        .map(|(tensor, layout, holder)| {
            let shape = crate::layout::local_shape(&layout, &mesh);
            let dtype = if programs[holder].buffers[tensor.buffer].dtype == crate::DType::F64 { Dtype::F64 } else { Dtype::F32 };
            (tensor, layout, shape, dtype)
        })
        .collect();
    let header: Vec<(String, Vec<usize>, Dtype)> = tensors.iter().map(|(tensor, _, shape, dtype)| (tensor.name.clone(), shape.clone(), *dtype)).collect();
    crate::tensor_file::write_streamed(&folder.join(rank_file_name(rank)), &header, &[], |i| {
        let (tensor, layout, shape, dtype) = &tensors[i];
        let local = shard(tensor, layout)?;
        if local.len() != shape.iter().product::<usize>() {
            return Err(RuntimeError::Program(format!("rank {rank}'s shard of `{}` has {} values, its shape {shape:?} holds {}", tensor.name, local.len(), shape.iter().product::<usize>())));
        }
        if let Some(&value) = local.iter().find(|v| !v.is_finite()) {
            return Err(RuntimeError::NonFiniteState { tensor: tensor.name.clone(), rank, value });
        }
        Ok(if *dtype == Dtype::F64 { local.iter().flat_map(|x| x.to_le_bytes()).collect() } else { local.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect() })
    })
}

/// Writes the manifest of the rank files in `partial` (their CRC-32s `checksums`, in rank
/// order), then makes the checkpoint visible atomically: `partial` is renamed to
/// `step-NNNNNNNN` and `LATEST` replaced (write, sync, rename); the newest checkpoint before
/// it stays and older ones go.
#[allow(clippy::too_many_arguments)]
fn commit(dir: &std::path::Path, partial: &std::path::Path, programs: &[Program], step: u64, spec: serde_json::Value, seed: u64, data: Option<crate::data::DataRecord>, checksums: Vec<u32>) -> Result<std::path::PathBuf, RuntimeError> {
    let mesh = checkpoint_mesh(programs)?;
    let tensors = layouts(programs);
    let manifest = Manifest {
        format_version: CHECKPOINT_VERSION,
        step,
        seed,
        mesh: mesh.0.clone(),
        spec,
        tensors: tensors.iter().map(|(b, l, _)| ManifestTensor { name: b.name.clone(), global_shape: l.global_shape.clone(), split: l.split.clone(), unpadded: b.unpadded.clone() }).collect(),
        files: (0..mesh.ranks()).map(rank_file_name).collect(),
        checksums,
        data,
        optimizer: OptimizerRecord::of(programs),
    };
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| RuntimeError::Program(e.to_string()))?;
    write_synced(&partial.join("manifest.json"), &text)?;
    sync_dir(partial)?;
    let name = step_folder(step);
    let done = dir.join(&name);
    let _ = std::fs::remove_dir_all(&done);
    std::fs::rename(partial, &done).map_err(|e| io(&done, e))?;
    sync_dir(dir)?;
    let latest = dir.join("LATEST");
    let latest_partial = dir.join(format!(".LATEST-{}", std::process::id()));
    write_synced(&latest_partial, format!("{name}\n").as_bytes())?;
    std::fs::rename(&latest_partial, &latest).map_err(|e| io(&latest, e))?;
    sync_dir(dir)?;
    // Of the checkpoints before this one, the newest stays and older ones go. Later steps
    // (another run's, in a folder reused without --resume) are not this run's to delete, and
    // the one just written, which LATEST names, always stays.
    let mut older: Vec<(u64, String)> = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| Some((n.strip_prefix("step-")?.parse::<u64>().ok()?, n)))
        .filter(|(s, _)| *s < step)
        .collect();
    older.sort();
    for (_, old) in older.iter().rev().skip(1) {
        let _ = std::fs::remove_dir_all(dir.join(old));
    }
    Ok(done)
}

/// The folder the processes of a multi-process run write step `step`'s rank files into
/// before rank 0 commits them (one name for all: the processes share no process id, and
/// rank 0's [`lock_folder`] keeps other runs out and clears what a crashed run left).
pub fn partial_folder(dir: &std::path::Path, step: u64) -> std::path::PathBuf {
    dir.join(format!(".partial-{}-processes", step_folder(step)))
}

/// One process of a multi-process run writes its rank's file of step `step`'s checkpoint
/// into [`partial_folder`] from its own shards alone: `shard(binding)` is the rank's local
/// value of a state tensor, read from device memory. Returns the file's CRC-32, which rank 0
/// needs for the manifest ([`commit_processes`]), after every rank's file is written.
///
/// With `parameters_only`, the parameters (and their fp32 masters) alone, each shard by the
/// lowest rank that holds it: files to assemble the parameters from (`--save` of a
/// multi-process run), not to resume from.
pub fn write_own_rank_file(dir: &std::path::Path, step: u64, programs: &[Program], rank: usize, parameters_only: bool, shard: impl Fn(&crate::program::Binding) -> Result<Vec<f64>, RuntimeError>) -> Result<u32, RuntimeError> {
    let partial = partial_folder(dir, step);
    std::fs::create_dir_all(&partial).map_err(|e| io(&partial, e))?;
    write_rank_file(&partial, programs, rank, parameters_only, |binding, _| shard(binding))
}

/// Rank 0 of a multi-process run, once every rank has written its file
/// ([`write_own_rank_file`], CRC-32s `checksums` in rank order), writes the manifest and
/// makes the checkpoint visible, atomically as [`save_sharded`] does.
#[allow(clippy::too_many_arguments)]
pub fn commit_processes(dir: &std::path::Path, step: u64, programs: &[Program], spec: serde_json::Value, seed: u64, data: Option<crate::data::DataRecord>, checksums: Vec<u32>) -> Result<std::path::PathBuf, RuntimeError> {
    let mesh = checkpoint_mesh(programs)?;
    if checksums.len() != mesh.ranks() {
        return Err(RuntimeError::Program(format!("{} checksums for the {} rank files of mesh {:?}", checksums.len(), mesh.ranks(), mesh.0)));
    }
    let partial = partial_folder(dir, step);
    for rank in 0..mesh.ranks() {
        let file = partial.join(rank_file_name(rank));
        if !file.is_file() {
            return Err(RuntimeError::Binding(format!("{}: rank {rank} did not write its file (is the checkpoint folder shared by every node?)", file.display())));
        }
    }
    commit(dir, &partial, programs, step, spec, seed, data, checksums)
}

/// The manifest of the checkpoint `dir` names (a checkpoint folder, or a folder of them
/// whose `LATEST` names the newest), checked, without reading the rank files.
pub fn read_manifest(dir: &std::path::Path) -> Result<Manifest, RuntimeError> {
    Ok(read_manifest_in(dir)?.1)
}

/// The checkpoint folder `dir` names (itself when it holds a manifest, else the one its
/// `LATEST` names), and its manifest, checked: what a run resolves once, so that every read
/// of a resume is of one checkpoint while another run may move `LATEST`.
pub fn resolve(dir: &std::path::Path) -> Result<(std::path::PathBuf, Manifest), RuntimeError> {
    read_manifest_in(dir)
}

fn read_manifest_in(dir: &std::path::Path) -> Result<(std::path::PathBuf, Manifest), RuntimeError> {
    let folder = if dir.join("manifest.json").exists() {
        dir.to_path_buf()
    } else {
        let latest = dir.join("LATEST");
        let bytes = read_limited(&latest, 4096).map_err(|e| RuntimeError::Binding(format!("{} is not a checkpoint folder (no LATEST): {e}", dir.display())))?;
        let name = String::from_utf8_lossy(&bytes).trim().to_string();
        if !is_plain_file_name(&name) {
            return Err(RuntimeError::Binding(format!("{}: names `{name}`, which is not a checkpoint folder inside {}; give --resume the checkpoint folder itself", latest.display(), dir.display())));
        }
        dir.join(name)
    };
    let path = folder.join("manifest.json");
    let text = read_limited(&path, MAX_MANIFEST_BYTES).map_err(|e| io(&path, e))?;
    let manifest = parse_manifest(&text).map_err(|e| RuntimeError::Binding(format!("{}: {e}", path.display())))?;
    Ok((folder, manifest))
}

/// Loads the checkpoint `LATEST` names under `dir` (or `dir` itself when it holds a
/// manifest): its manifest and the global value of every tensor, assembled from the rank
/// files with the mesh they were saved for. A manifest or file edited by hand is refused with
/// an error naming the field, tensor or file before anything is allocated for it (see
/// [`parse_manifest`]), and every rank file's shards must have the shapes the manifest's
/// layouts give them and cover each tensor whole.
pub fn load_sharded(dir: &std::path::Path) -> Result<(Manifest, TrainState), RuntimeError> {
    let (folder, manifest) = read_manifest_in(dir)?;
    let mesh = MeshShape(manifest.mesh.clone());
    let listed: HashMap<&str, &ManifestTensor> = manifest.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut shards: HashMap<String, Vec<(usize, Vec<f64>)>> = HashMap::new();
    for (index, file) in manifest.files.iter().enumerate() {
        let path = folder.join(file);
        // The rank whose shards the file holds.
        let rank = if manifest.format_version == 1 { mesh.rank(&mesh.row_major_coords(index)) } else { index };
        // A checkpoint's rank files are regular files; their size is what is read.
        let bytes = read_limited(&path, u64::MAX).map_err(|e| io(&path, e))?;
        if let Some(&expected) = manifest.checksums.get(index) {
            let found = crc32fast::hash(&bytes);
            if found != expected {
                return Err(RuntimeError::Binding(format!(
                    "{}: the file changed after it was written (CRC-32 {found:08x}, the manifest says {expected:08x}); resume from another checkpoint folder, or start again",
                    path.display()
                )));
            }
        }
        let st = SafeTensors::deserialize(&bytes).map_err(|e| RuntimeError::Binding(format!("{}: {e}", path.display())))?;
        for (name, view) in st.tensors() {
            if !matches!(view.dtype(), Dtype::F64 | Dtype::F32) {
                return Err(RuntimeError::Binding(format!("{}: `{name}` is not f32 or f64", path.display())));
            }
            let tensor = listed.get(name.as_str()).ok_or_else(|| RuntimeError::Binding(format!("{}: holds `{name}`, which the manifest does not list", path.display())))?;
            let expected = crate::layout::local_shape(&manifest_layout(tensor), &mesh);
            if view.shape() != expected.as_slice() {
                return Err(RuntimeError::Binding(format!(
                    "{}: `{name}` has shape {:?}, but the manifest's global shape {:?} split {:?} over the mesh {:?} makes shards of {expected:?}",
                    path.display(),
                    view.shape(),
                    tensor.global_shape,
                    tensor.split,
                    manifest.mesh
                )));
            }
            let values = crate::tensor_file::float_values(view.dtype(), view.data()).unwrap_or_default();
            crate::tensor_file::check_finite(&path, &name, view.shape(), &values)?;
            shards.entry(name).or_default().push((rank, values));
        }
    }
    let mut tensors = std::collections::BTreeMap::new();
    for t in &manifest.tensors {
        let parts = shards.remove(&t.name).ok_or_else(|| RuntimeError::Binding(format!("{}: no rank holds `{}`", folder.display(), t.name)))?;
        let layout = manifest_layout(t);
        // The ranks that hold a tensor must hold every one of its shards between them: a
        // missing one would be assembled as zeros.
        let mut pieces: Vec<Vec<usize>> = parts.iter().map(|(rank, _)| crate::layout::shard_index(&layout, &mesh, *rank)).collect();
        pieces.sort();
        pieces.dedup();
        let needed = crate::layout::shard_count(&layout, &mesh);
        if pieces.len() != needed {
            return Err(RuntimeError::Binding(format!("{}: the rank files hold {} of the {needed} shards of `{}`: a rank file is missing it", folder.display(), pieces.len(), t.name)));
        }
        let global = crate::layout::assemble_some(&parts, &layout, &mesh);
        let tensor = match &t.unpadded {
            Some(unpadded) if unpadded.len() == t.global_shape.len() && unpadded.iter().zip(&t.global_shape).all(|(u, g)| u <= g) => (unpadded.clone(), crate::layout::unpad(&global, &t.global_shape, unpadded)),
            Some(unpadded) => return Err(RuntimeError::Binding(format!("{}: `{}` has unpadded shape {unpadded:?} outside its shape {:?}", folder.display(), t.name, t.global_shape))),
            None => (t.global_shape.clone(), global),
        };
        tensors.insert(t.name.clone(), tensor);
    }
    Ok((manifest.clone(), TrainState { step: manifest.step, tensors }))
}

/// One rank's shards of the state arguments, by name, in the program's form.
pub type RankShards = HashMap<String, Vec<f64>>;

/// What one process of a multi-process run resumes from: the checkpoint `dir` names (as
/// [`load_sharded`] finds it), read for `ranks` of `program` (on `mesh`, which may differ
/// from the mesh the checkpoint was saved on) without assembling any tensor whole: for each
/// state argument, the rank's shard in the program's form (see [`ShardReader::shard`]).
pub fn load_own_shards(dir: &std::path::Path, program: &Program, mesh: &MeshShape, ranks: &[usize]) -> Result<(Manifest, Vec<RankShards>), RuntimeError> {
    let reader = ShardReader::open(dir)?;
    let mut out: Vec<RankShards> = vec![HashMap::new(); ranks.len()];
    for (local, &rank) in ranks.iter().enumerate() {
        for a in program.args.iter().filter(|a| a.role.is_some_and(Role::is_state)) {
            out[local].insert(a.name.clone(), reader.shard(program, a, mesh, rank)?);
        }
    }
    Ok((reader.manifest, out))
}

/// A checkpoint read one shard of one tensor at a time, for any mesh: what a process resumes
/// from without holding more of the state than the tensor it loads. Only the rank files
/// holding a needed shard are read: each is streamed once for its CRC-32 when first needed,
/// then each tensor read from it alone.
pub struct ShardReader {
    folder: std::path::PathBuf,
    manifest: Manifest,
    saved_mesh: MeshShape,
    /// Each rank file's header, with the rank whose shards it holds.
    headers: Vec<(usize, crate::tensor_file::TensorFile)>,
    /// The rank files whose CRC-32 was checked.
    checked: std::cell::RefCell<std::collections::HashSet<usize>>,
}

impl ShardReader {
    /// Opens the checkpoint `dir` names (`LATEST` resolved once) and reads its manifest and
    /// its rank files' headers.
    pub fn open(dir: &std::path::Path) -> Result<ShardReader, RuntimeError> {
        let (folder, manifest) = read_manifest_in(dir)?;
        let saved_mesh = MeshShape(manifest.mesh.clone());
        let listed: std::collections::HashSet<&str> = manifest.tensors.iter().map(|t| t.name.as_str()).collect();
        let mut headers = Vec::new();
        for (index, file) in manifest.files.iter().enumerate() {
            let rank = if manifest.format_version == 1 { saved_mesh.rank(&saved_mesh.row_major_coords(index)) } else { index };
            let header = rank_file_header(&folder.join(file))?;
            if let Some(name) = header.names().into_iter().find(|n| !listed.contains(n.as_str())) {
                return Err(RuntimeError::Binding(format!("{}: holds `{name}`, which the manifest does not list", folder.join(file).display())));
            }
            headers.push((rank, header));
        }
        Ok(ShardReader { folder, manifest, saved_mesh, headers, checked: Default::default() })
    }

    /// The checkpoint's manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Rank `rank`'s shard (on `mesh`) of state argument `a` of `program`, in the program's
    /// form: padded as the program pads it (zeros past the saved real shape), a parameter
    /// taking its fp32 master where the checkpoint keeps one, a master its parameter where it
    /// does not. Assembled from every saved shard that overlaps it.
    pub fn shard(&self, program: &Program, a: &crate::program::Binding, mesh: &MeshShape, rank: usize) -> Result<Vec<f64>, RuntimeError> {
        let manifest = &self.manifest;
        let listed = |name: &str| manifest.tensors.iter().find(|t| t.name == name);
        let buffer_shape = program.buffers[a.buffer].shape.clone();
        let layout = a.layout.clone().unwrap_or_else(|| crate::program::Layout { split: vec![Vec::new(); buffer_shape.len()], global_shape: buffer_shape.clone() });
        let logical = a.logical_shape(&layout.global_shape);
        let master = crate::program::master_name(&a.name);
        let name = match crate::program::master_of(&a.name) {
            Some(param) if listed(&a.name).is_none() => param.to_string(),
            None if a.role == Some(Role::Param) && listed(&master).is_some() => master,
            _ => a.name.clone(),
        };
        let tensor = listed(&name).ok_or_else(|| RuntimeError::Binding(format!("the checkpoint has no `{name}`: it was saved from another model or with another optimizer")))?;
        let saved_logical = tensor.unpadded.clone().unwrap_or_else(|| tensor.global_shape.clone());
        if saved_logical != logical {
            return Err(RuntimeError::Binding(format!("checkpoint tensor `{name}` has shape {saved_logical:?}, the model needs {logical:?}")));
        }
        self.read_box(tensor, &logical, &crate::layout::shard_box(&layout, mesh, rank))
    }

    /// Parameter `param` whole and as the model has it (a padded vocabulary's real rows),
    /// its fp32 master where the checkpoint keeps one: (shape, values), assembled from the
    /// saved shards one file at a time.
    pub fn parameter(&self, param: &str) -> Result<(Vec<usize>, Vec<f64>), RuntimeError> {
        let listed = |name: &str| self.manifest.tensors.iter().find(|t| t.name == name);
        let tensor = listed(&crate::program::master_name(param)).or_else(|| listed(param)).ok_or_else(|| RuntimeError::Binding(format!("the checkpoint has no parameter `{param}`")))?;
        let logical = tensor.unpadded.clone().unwrap_or_else(|| tensor.global_shape.clone());
        let whole: Vec<(usize, usize)> = logical.iter().map(|&n| (0, n)).collect();
        Ok((logical.clone(), self.read_box(tensor, &logical, &whole)?))
    }

    /// The block `target_box` (per dimension: first index, extent) of saved tensor `tensor`,
    /// whose real shape is `logical`: zeros past it, the rest from every saved shard that
    /// overlaps it.
    fn read_box(&self, tensor: &ManifestTensor, logical: &[usize], target_box: &[(usize, usize)]) -> Result<Vec<f64>, RuntimeError> {
        let (manifest, name) = (&self.manifest, &tensor.name);
        let mut out = vec![0.0; target_box.iter().map(|b| b.1).product()];
        // The real (unpadded) part of the target block, in global indices.
        let wanted: Vec<std::ops::Range<usize>> = target_box.iter().zip(logical).map(|(&(o, n), &l)| o.min(l)..(o + n).min(l)).collect();
        if wanted.iter().any(|r| r.is_empty()) {
            return Ok(out);
        }
        // Every distinct saved shard that overlaps it, from the first file that holds it.
        let saved_layout = manifest_layout(tensor);
        let expected = crate::layout::local_shape(&saved_layout, &self.saved_mesh);
        let mut taken: Vec<Vec<usize>> = Vec::new();
        for (index, (saved_rank, header)) in self.headers.iter().enumerate() {
            if header.info(&name).is_none() {
                continue;
            }
            let shard = crate::layout::shard_index(&saved_layout, &self.saved_mesh, *saved_rank);
            if taken.contains(&shard) {
                continue;
            }
            taken.push(shard);
            let source_box = crate::layout::shard_box(&saved_layout, &self.saved_mesh, *saved_rank);
            let region: Vec<std::ops::Range<usize>> = wanted.iter().zip(&source_box).map(|(w, &(o, n))| w.start.max(o)..w.end.min(o + n)).collect();
            if region.iter().any(|r| r.is_empty()) {
                continue;
            }
            let path = self.folder.join(&manifest.files[index]);
            // The tensor's shape in the file must be the saved layout's shard shape.
            let shape = header.info(&name).map(|i| i.shape.clone()).unwrap_or_default();
            if shape != expected {
                return Err(RuntimeError::Binding(format!("{}: `{name}` has shape {shape:?}, but the manifest's layout over the mesh {:?} makes shards of {expected:?}", path.display(), manifest.mesh)));
            }
            self.check(index)?;
            let (_, values) = header.read_f64(&name)?.ok_or_else(|| RuntimeError::Binding(format!("{}: `{name}` is not f32 or f64", path.display())))?;
            crate::layout::copy_region(&values, &source_box, &mut out, target_box, &region);
        }
        let count = crate::layout::shard_count(&saved_layout, &self.saved_mesh);
        if taken.len() != count {
            return Err(RuntimeError::Binding(format!("{}: the rank files hold {} of the {count} shards of `{name}`: a rank file is missing it", self.folder.display(), taken.len())));
        }
        Ok(out)
    }

    /// Checks rank file `index` against the manifest's CRC-32 the first time it is read.
    fn check(&self, index: usize) -> Result<(), RuntimeError> {
        if self.checked.borrow().contains(&index) {
            return Ok(());
        }
        let (_, header) = &self.headers[index];
        let crc = stream_tensors(header, &[], |_, _| {})?;
        if let Some(&expected) = self.manifest.checksums.get(index)
            && crc != expected
        {
            let path = self.folder.join(&self.manifest.files[index]);
            return Err(RuntimeError::Binding(format!("{}: the file changed after it was written (CRC-32 {crc:08x}, the manifest says {expected:08x}); resume from another checkpoint folder, or start again", path.display())));
        }
        self.checked.borrow_mut().insert(index);
        Ok(())
    }
}

impl crate::train::ParameterSource for ShardReader {
    fn parameter_shapes(&self) -> Result<std::collections::BTreeMap<String, Vec<usize>>, RuntimeError> {
        Ok(self
            .manifest
            .tensors
            .iter()
            .filter(|t| crate::program::state_of(&t.name).is_none())
            .map(|t| (t.name.clone(), t.unpadded.clone().unwrap_or_else(|| t.global_shape.clone())))
            .collect())
    }

    fn parameter_values(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        Ok(self.parameter(name)?.1)
    }
}

/// A rank file's header, every tensor f32 or f64 (files of format 2 hold f64 alone).
fn rank_file_header(path: &std::path::Path) -> Result<crate::tensor_file::TensorFile, RuntimeError> {
    let file = crate::tensor_file::TensorFile::open(path)?;
    if let Some(name) = file.names().into_iter().find(|n| file.info(n).is_some_and(|i| !matches!(i.dtype, Dtype::F64 | Dtype::F32))) {
        return Err(RuntimeError::Binding(format!("{}: `{name}` is not f32 or f64", path.display())));
    }
    Ok(file)
}

/// Reads `path` once from start to end, computing its CRC-32, and hands each of `names`
/// (tensors of its `header`) to `take` as f64 values when its bytes have passed; returns the
/// CRC-32.
fn stream_tensors(header: &crate::tensor_file::TensorFile, names: &[String], mut take: impl FnMut(&str, &[f64])) -> Result<u32, RuntimeError> {
    use std::io::Read;
    let path = header.path();
    let mut order: Vec<(&str, std::ops::Range<u64>)> = names.iter().filter_map(|n| Some((n.as_str(), header.byte_range(n)?))).collect();
    order.sort_by_key(|(_, r)| r.start);
    let mut file = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path).map_err(|e| io(path, e))?);
    let mut hasher = crc32fast::Hasher::new();
    let mut at = 0u64;
    let mut chunk = vec![0u8; 1 << 20];
    let mut read_into = |buf: &mut [u8], at: &mut u64, hasher: &mut crc32fast::Hasher| -> Result<(), RuntimeError> {
        file.read_exact(buf).map_err(|e| io(path, e))?;
        hasher.update(buf);
        *at += buf.len() as u64;
        Ok(())
    };
    for (name, range) in order {
        // Tensors of one file do not overlap (safetensors' writer lays them end to end).
        if range.start < at {
            return Err(RuntimeError::Binding(format!("{}: `{name}` overlaps another tensor", path.display())));
        }
        while at < range.start {
            let n = ((range.start - at) as usize).min(chunk.len());
            read_into(&mut chunk[..n], &mut at, &mut hasher)?;
        }
        let mut bytes = vec![0u8; (range.end - range.start) as usize];
        read_into(&mut bytes, &mut at, &mut hasher)?;
        let values: Vec<f64> = header.info(name).and_then(|i| crate::tensor_file::float_values(i.dtype, &bytes)).unwrap_or_default();
        drop(bytes);
        take(name, &values);
    }
    // The rest of the file, a chunk at a time.
    loop {
        let n = file.read(&mut chunk).map_err(|e| io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&chunk[..n]);
    }
    Ok(hasher.finalize())
}

/// Largest `manifest.json` read: a manifest lists names and shapes, a few megabytes for the
/// largest models.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// Most ranks a checkpoint's mesh may have (a mesh axis holds at most 2^20).
pub const MAX_CHECKPOINT_RANKS: usize = 1 << 20;

/// Most elements one checkpoint tensor may have: what a spec allows one tensor
/// (`shardc_ir::spec::MAX_TENSOR_ELEMENTS`, 2^48).
pub const MAX_CHECKPOINT_ELEMENTS: usize = 1 << 48;

/// Reads `path` whole, refusing what is not a regular file (a device such as /dev/zero never
/// ends) and files over `limit` bytes, before reading.
fn read_limited(path: &std::path::Path, limit: u64) -> Result<Vec<u8>, std::io::Error> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if meta.len() > limit {
        return Err(std::io::Error::other(format!("{} bytes, more than the {limit} this file may have", meta.len())));
    }
    std::fs::read(path)
}

/// Whether `name` names an entry of the folder itself (no separators, not `.` or `..`).
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0'])
}

/// The layout a manifest gives a tensor.
fn manifest_layout(t: &ManifestTensor) -> crate::program::Layout {
    crate::program::Layout { global_shape: t.global_shape.clone(), split: t.split.clone() }
}

/// Reads and checks a checkpoint manifest (the text of `manifest.json`): a field of the wrong
/// type names its path (`tensors[3].global_shape[0]`), and [`Manifest::check`] refuses what
/// its fields cannot mean together.
pub fn parse_manifest(text: &[u8]) -> Result<Manifest, RuntimeError> {
    let mut de = serde_json::Deserializer::from_slice(text);
    let manifest: Manifest = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = inner.to_string();
        let message = message.split(" at line ").next().unwrap_or(&message).to_string();
        if path == "." { RuntimeError::Binding(message) } else { RuntimeError::Binding(format!("`{path}`: {message}")) }
    })?;
    manifest.check()?;
    Ok(manifest)
}

impl Manifest {
    /// Checks what the fields must mean together, so that reading the rank files by it can
    /// neither panic nor allocate more than they hold: the format version, the step (within
    /// the run's 32-bit counter), the mesh (extents of at least 1, at most
    /// [`MAX_CHECKPOINT_RANKS`] ranks), one plain file name per rank, one checksum per file,
    /// and for every tensor a unique name, a shape of at most [`MAX_CHECKPOINT_ELEMENTS`]
    /// elements, and a split over existing grid axes, each used once, into parts that divide
    /// the dimensions they split, and an optimizer record `run` could have written (see
    /// [`OptimizerRecord::check`]). Errors name the field and the tensor.
    pub fn check(&self) -> Result<(), RuntimeError> {
        let bad = |m: String| Err(RuntimeError::Binding(m));
        // Format 1 numbered rank files row-major (pp fastest); they are read in that order.
        if !(1..=CHECKPOINT_VERSION).contains(&self.format_version) {
            return bad(format!("checkpoint format {} (this shardc reads formats 1 to {CHECKPOINT_VERSION})", self.format_version));
        }
        if self.step > crate::train::MAX_STEPS {
            return bad(format!("`step` is {}, more than a run counts to ({}): the manifest was edited or is corrupt", self.step, crate::train::MAX_STEPS));
        }
        if self.mesh.is_empty() || self.mesh.contains(&0) {
            return bad(format!("`mesh` {:?} needs at least one axis and extents of at least 1", self.mesh));
        }
        let ranks = self.mesh.iter().try_fold(1usize, |acc, &e| acc.checked_mul(e)).filter(|&r| r <= MAX_CHECKPOINT_RANKS);
        let Some(ranks) = ranks else {
            return bad(format!("`mesh` {:?} has more than {MAX_CHECKPOINT_RANKS} ranks", self.mesh));
        };
        if self.files.len() != ranks {
            return bad(format!("{} rank files for a mesh of {ranks} ranks", self.files.len()));
        }
        if let Some((i, file)) = self.files.iter().enumerate().find(|(_, f)| !is_plain_file_name(f)) {
            return bad(format!("`files[{i}]` is `{file}`, which is not a file name inside the checkpoint folder"));
        }
        if !self.checksums.is_empty() && self.checksums.len() != self.files.len() {
            return bad(format!("{} checksums for {} rank files", self.checksums.len(), self.files.len()));
        }
        if let Some(data) = &self.data {
            data.check().map_err(|m| RuntimeError::Binding(format!("`data`: {m}")))?;
        }
        if let Some(optimizer) = &self.optimizer {
            optimizer.check().map_err(RuntimeError::Binding)?;
        }
        let mut names = std::collections::HashSet::new();
        for (i, t) in self.tensors.iter().enumerate() {
            let name = &t.name;
            if !names.insert(name.as_str()) {
                return bad(format!("`tensors[{i}]`: `{name}` is listed twice"));
            }
            if t.global_shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).is_none_or(|n| n > MAX_CHECKPOINT_ELEMENTS) {
                return bad(format!("`tensors[{i}].global_shape` of `{name}` is {:?}, more than the {MAX_CHECKPOINT_ELEMENTS} elements a tensor may have", t.global_shape));
            }
            if t.split.len() > t.global_shape.len() {
                return bad(format!("`tensors[{i}].split` of `{name}` splits {} dimensions of a {}-dimensional tensor", t.split.len(), t.global_shape.len()));
            }
            if let Some(unpadded) = &t.unpadded
                && (unpadded.len() != t.global_shape.len() || unpadded.iter().zip(&t.global_shape).any(|(u, g)| u > g))
            {
                return bad(format!("`tensors[{i}].unpadded` of `{name}` is {unpadded:?}, outside its global shape {:?}", t.global_shape));
            }
            let mut used = vec![false; self.mesh.len()];
            for (dim, axes) in t.split.iter().enumerate() {
                let mut parts = 1usize;
                for &axis in axes {
                    match used.get_mut(axis) {
                        None => return bad(format!("`tensors[{i}].split` of `{name}` names grid axis {axis}, but the mesh {:?} has {} axes", self.mesh, self.mesh.len())),
                        Some(true) => return bad(format!("`tensors[{i}].split` of `{name}` uses grid axis {axis} twice")),
                        Some(seen) => *seen = true,
                    }
                    parts *= self.mesh[axis];
                }
                if !t.global_shape[dim].is_multiple_of(parts) {
                    return bad(format!("`tensors[{i}]`: dimension {dim} of `{name}` ({}) does not split into {parts} equal parts over grid axes {axes:?}", t.global_shape[dim]));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(mesh: Vec<usize>, tensors: Vec<ManifestTensor>) -> Manifest {
        let files = (0..mesh.iter().product()).map(|r| format!("rank-{r:05}.safetensors")).collect();
        Manifest { format_version: CHECKPOINT_VERSION, step: 3, seed: 0, mesh, spec: serde_json::Value::Null, tensors, files, data: None, optimizer: None, checksums: Vec::new() }
    }

    fn tensor(name: &str, global_shape: Vec<usize>, split: Vec<Vec<usize>>) -> ManifestTensor {
        ManifestTensor { name: name.into(), global_shape, split, unpadded: None }
    }

    /// A manifest edited by hand is refused naming the field and the tensor, whatever was
    /// changed; nothing is read or allocated by its numbers first.
    #[test]
    fn edited_manifests_are_refused_naming_the_field() {
        let mut good = manifest(vec![1, 2, 1], vec![tensor("w", vec![4, 2], vec![vec![1], vec![]])]);
        let source = crate::data::Source { name: "train.bin".into(), format: "uint16".into(), bytes_per_token: Some(2) };
        let corpus = crate::data::Corpus::from_tokens(crate::data::Tokens::U16((0..100).collect()), source, 4, 512, 0.1).unwrap();
        good.data = Some(corpus.record(3, 2));
        assert!(good.check().is_ok());
        let text = |m: &Manifest| serde_json::to_vec(m).unwrap();
        assert!(parse_manifest(&text(&good)).is_ok());
        let cases: Vec<(Box<dyn Fn(&mut Manifest)>, &str)> = vec![
            (Box::new(|m| m.step = 1 << 40), "`step` is 1099511627776"),
            (Box::new(|m| m.mesh = vec![1, 0, 1]), "`mesh`"),
            (Box::new(|m| m.mesh = vec![1 << 32, 1 << 32, 1]), "more than 1048576 ranks"),
            (Box::new(|m| m.files[1] = "../rank-00001.safetensors".into()), "`files[1]`"),
            (Box::new(|m| m.tensors[0].split = vec![vec![5], vec![]]), "names grid axis 5"),
            (Box::new(|m| m.tensors[0].split = vec![vec![1], vec![1]]), "uses grid axis 1 twice"),
            (Box::new(|m| m.tensors[0].split = vec![vec![], vec![], vec![1]]), "splits 3 dimensions"),
            (Box::new(|m| m.tensors[0].global_shape = vec![3, 2]), "does not split into 2 equal parts"),
            (Box::new(|m| m.tensors[0].global_shape = vec![usize::MAX, 2]), "`tensors[0].global_shape` of `w`"),
            (Box::new(|m| m.tensors.push(m.tensors[0].clone())), "listed twice"),
            // The data record: a hand-edited position or cut made the sampler overflow.
            (Box::new(|m| m.data.as_mut().unwrap().samples = u64::MAX), "`data`: `samples`"),
            (Box::new(|m| m.data.as_mut().unwrap().window = 0), "`data`: `window` is 0"),
            (Box::new(|m| m.data.as_mut().unwrap().window = 1), "`data`: `window` is 1"),
            (Box::new(|m| m.data.as_mut().unwrap().train_windows = 0), "`data`: `train_windows`"),
            (Box::new(|m| m.data.as_mut().unwrap().train_windows = 1 << 63), "`data`: `train_windows`"),
            (Box::new(|m| m.data.as_mut().unwrap().epoch = 7), "`data`: `epoch` is 7"),
        ];
        for (edit, says) in cases {
            let mut m = good.clone();
            edit(&mut m);
            let e = parse_manifest(&text(&m)).unwrap_err().to_string();
            assert!(e.contains(says), "{says}: {e}");
        }
        // A field of the wrong type names its path.
        let mut value = serde_json::to_value(&good).unwrap();
        value["step"] = serde_json::json!(-1);
        let e = parse_manifest(value.to_string().as_bytes()).unwrap_err().to_string();
        assert!(e.contains("`step`"), "{e}");
        value["step"] = serde_json::json!(1);
        value["tensors"][0]["global_shape"][1] = serde_json::json!("two");
        let e = parse_manifest(value.to_string().as_bytes()).unwrap_err().to_string();
        assert!(e.contains("`tensors[0].global_shape[1]`"), "{e}");
    }

    /// Rank files must hold shards of the shapes the manifest's layouts make, and between them
    /// every shard of every tensor: a missing one is an error, not zeros.
    #[test]
    fn rank_files_must_hold_every_shard_in_its_shape() {
        let dir = std::env::temp_dir().join(format!("shardc-ckpt-shards-{}", std::process::id()));
        let write = |m: &Manifest, files: &[Vec<(String, Vec<usize>, Vec<f64>)>]| {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("manifest.json"), serde_json::to_vec(m).unwrap()).unwrap();
            for (rank, shards) in files.iter().enumerate() {
                std::fs::write(dir.join(&m.files[rank]), f64_bytes(shards).unwrap()).unwrap();
            }
        };
        let m = manifest(vec![1, 2, 1], vec![tensor("w", vec![4], vec![vec![1]])]);
        let shard = |values: Vec<f64>| vec![("w".to_string(), vec![values.len()], values)];
        write(&m, &[shard(vec![1.0, 2.0]), shard(vec![3.0, 4.0])]);
        let (_, state) = load_sharded(&dir).unwrap();
        assert_eq!(state.tensors["w"], (vec![4], vec![1.0, 2.0, 3.0, 4.0]));
        write(&m, &[shard(vec![1.0, 2.0]), Vec::new()]);
        let e = load_sharded(&dir).unwrap_err().to_string();
        assert!(e.contains("hold 1 of the 2 shards of `w`"), "{e}");
        write(&m, &[shard(vec![1.0, 2.0, 3.0]), shard(vec![3.0, 4.0])]);
        let e = load_sharded(&dir).unwrap_err().to_string();
        assert!(e.contains("`w` has shape [3]") && e.contains("makes shards of [2]"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
