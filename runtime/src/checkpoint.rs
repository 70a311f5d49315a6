//! Parameters in the safetensors format, named as in the IR (`layers.3.attn.q.weight`):
//! single files (`to_bytes`/`from_bytes`, the caller does the IO) and sharded training
//! checkpoints (one file per rank and a manifest, written atomically, read back under any
//! mesh).

use std::collections::HashMap;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::collectives::MeshShape;
use crate::program::{Program, Role};
use crate::train::TrainState;
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
pub const CHECKPOINT_VERSION: u32 = 1;

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

/// f64 tensors as safetensors bytes.
fn f64_bytes(tensors: &[(String, Vec<usize>, Vec<f64>)]) -> Result<Vec<u8>, RuntimeError> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| TensorView::new(Dtype::F64, shape.clone(), b).map(|view| (name.clone(), view)).map_err(|e| RuntimeError::Program(format!("tensor {name}: {e}"))))
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
    let first = programs.first().ok_or_else(|| RuntimeError::Program("no programs to checkpoint".into()))?;
    let mesh = MeshShape(if first.mesh.is_empty() { vec![1] } else { first.mesh.clone() });
    let program_of = |rank: usize| if programs.len() == 1 { 0 } else { mesh.coords(rank).get(2).copied().unwrap_or(0) };
    let tensors = layouts(programs);
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let name = format!("step-{:08}", state.step);
    let partial = dir.join(format!(".partial-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).map_err(|e| io(&partial, e))?;
    let (mut files, mut checksums) = (Vec::new(), Vec::new());
    for rank in 0..mesh.ranks() {
        let mut shards = Vec::new();
        for (tensor, layout, holder) in &tensors {
            if *holder != program_of(rank) && programs.len() > 1 {
                // Mirrored tensors are saved by their first holder only.
                continue;
            }
            let global = state.for_program(tensor, &layout.global_shape)?;
            let local = crate::layout::local_shard(&global, layout, &mesh, rank);
            let shape = crate::layout::local_shape(layout, &mesh);
            shards.push((tensor.name.clone(), shape, local));
        }
        let file = format!("rank-{rank:05}.safetensors");
        let bytes = f64_bytes(&shards)?;
        write_synced(&partial.join(&file), &bytes)?;
        files.push(file);
        checksums.push(crc32fast::hash(&bytes));
        if abort_after_rank == Some(rank) {
            std::process::abort();
        }
    }
    let manifest = Manifest {
        format_version: CHECKPOINT_VERSION,
        step: state.step,
        seed,
        mesh: mesh.0.clone(),
        spec,
        tensors: tensors.iter().map(|(b, l, _)| ManifestTensor { name: b.name.clone(), global_shape: l.global_shape.clone(), split: l.split.clone(), unpadded: b.unpadded.clone() }).collect(),
        files,
        checksums,
        data,
    };
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| RuntimeError::Program(e.to_string()))?;
    write_synced(&partial.join("manifest.json"), &text)?;
    sync_dir(&partial)?;
    let done = dir.join(&name);
    let _ = std::fs::remove_dir_all(&done);
    std::fs::rename(&partial, &done).map_err(|e| io(&done, e))?;
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
        .filter(|(step, _)| *step < state.step)
        .collect();
    older.sort();
    for (_, old) in older.iter().rev().skip(1) {
        let _ = std::fs::remove_dir_all(dir.join(old));
    }
    Ok(done)
}

/// Loads the checkpoint `LATEST` names under `dir` (or `dir` itself when it holds a
/// manifest): its manifest and the global value of every tensor, assembled from the rank
/// files with the mesh they were saved for.
pub fn load_sharded(dir: &std::path::Path) -> Result<(Manifest, TrainState), RuntimeError> {
    let folder = if dir.join("manifest.json").exists() {
        dir.to_path_buf()
    } else {
        let latest = dir.join("LATEST");
        let name = std::fs::read_to_string(&latest).map_err(|e| RuntimeError::Binding(format!("{} is not a checkpoint folder (no LATEST): {e}", dir.display())))?;
        dir.join(name.trim())
    };
    let path = folder.join("manifest.json");
    let text = std::fs::read(&path).map_err(|e| io(&path, e))?;
    let manifest: Manifest = serde_json::from_slice(&text).map_err(|e| RuntimeError::Binding(format!("{}: {e}", path.display())))?;
    if manifest.format_version != CHECKPOINT_VERSION {
        return Err(RuntimeError::Binding(format!("{}: checkpoint format {} (this shardc reads {CHECKPOINT_VERSION})", path.display(), manifest.format_version)));
    }
    let mesh = MeshShape(manifest.mesh.clone());
    if manifest.files.len() != mesh.ranks() {
        return Err(RuntimeError::Binding(format!("{}: {} rank files for a mesh of {} ranks", path.display(), manifest.files.len(), mesh.ranks())));
    }
    if !manifest.checksums.is_empty() && manifest.checksums.len() != manifest.files.len() {
        return Err(RuntimeError::Binding(format!("{}: {} checksums for {} rank files", path.display(), manifest.checksums.len(), manifest.files.len())));
    }
    let mut shards: HashMap<String, Vec<(usize, Vec<f64>)>> = HashMap::new();
    for (rank, file) in manifest.files.iter().enumerate() {
        let path = folder.join(file);
        let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
        if let Some(&expected) = manifest.checksums.get(rank) {
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
            if view.dtype() != Dtype::F64 {
                return Err(RuntimeError::Binding(format!("{}: `{name}` is not f64", path.display())));
            }
            let values = view.data().chunks_exact(8).map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect();
            shards.entry(name).or_default().push((rank, values));
        }
    }
    let mut tensors = std::collections::BTreeMap::new();
    for t in &manifest.tensors {
        let parts = shards.remove(&t.name).ok_or_else(|| RuntimeError::Binding(format!("{}: no rank holds `{}`", folder.display(), t.name)))?;
        let layout = crate::program::Layout { global_shape: t.global_shape.clone(), split: t.split.clone() };
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
