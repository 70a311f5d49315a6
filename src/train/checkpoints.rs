//! What a run writes: sharded checkpoints (saved, resumed), `--save`, and the checks that
//! every output path is writable before any work.

use super::*;

/// Whether two spec values of a manifest and a run are the same: numbers by value (a
/// manifest rewritten by a JSON tool may write `10000.0` as `10000`), anything else exactly.
pub(super) fn same_value(a: Option<&serde_json::Value>, b: Option<&serde_json::Value>) -> bool {
    match (a, b) {
        (Some(serde_json::Value::Number(x)), Some(serde_json::Value::Number(y))) => x == y || x.as_f64().zip(y.as_f64()).is_some_and(|(x, y)| x == y),
        _ => a == b,
    }
}

/// Checkpoint and resume settings of a run.
pub(super) struct Checkpoints {
    pub(super) dir: Option<PathBuf>,
    pub(super) every: u64,
    pub(super) spec: serde_json::Value,
    /// Fault injection (`SHARDC_FAULT_CHECKPOINT=N:R`): the N-th checkpoint of this run kills
    /// the process after writing rank R's file.
    pub(super) fault: Option<(usize, usize)>,
    pub(super) saved: usize,
    /// This run's hold on `dir` (rank 0's, in a multi-process run).
    pub(super) _lock: Option<shardc_runtime::checkpoint::FolderLock>,
    /// Whether this process prints what it saves and resumes (rank 0 of a multi-process
    /// run, or the one process).
    pub(super) speaks: bool,
}

impl Checkpoints {
    pub(super) fn new(args: &RunArgs, spec: &Spec) -> Result<Checkpoints> {
        Checkpoints::for_process(args, spec, None)
    }

    /// The checkpoints of one process of a multi-process run (`process_rank`; `None`: the
    /// only one): rank 0 holds the folder for the run, and speaks for it.
    pub(super) fn for_process(args: &RunArgs, spec: &Spec, process_rank: Option<usize>) -> Result<Checkpoints> {
        let leads = process_rank.is_none_or(|r| r == 0);
        let fault = match std::env::var("SHARDC_FAULT_CHECKPOINT") {
            Ok(text) => {
                let parsed = text.split_once(':').and_then(|(n, r)| Some((n.parse::<usize>().ok()?, r.parse::<usize>().ok()?)));
                Some(parsed.ok_or_else(|| miette!("SHARDC_FAULT_CHECKPOINT={text}: expected CHECKPOINT:RANK, e.g. 2:1"))?)
            }
            Err(_) => None,
        };
        if args.checkpoint_every == Some(0) {
            return Err(miette!(help = "give a positive number of steps", "--checkpoint-every 0"));
        }
        let lock = match &args.checkpoint {
            Some(dir) if leads => Some(shardc_runtime::checkpoint::lock_folder(dir).map_err(|e| miette!("--checkpoint {e}"))?),
            _ => None,
        };
        Ok(Checkpoints { dir: args.checkpoint.clone(), every: args.checkpoint_every.unwrap_or(args.steps.max(1)), spec: serde_json::to_value(&spec.model).into_diagnostic()?, fault, saved: 0, _lock: lock, speaks: leads })
    }

    /// The run's starting state from `--resume`, checked against this spec and `corpus`
    /// (which continues from the checkpoint's place in the data order); and its seed.
    pub(super) fn resume(&self, args: &RunArgs, programs: &[Program], corpus: &mut Corpus) -> Result<(Option<shardc_runtime::train::TrainState>, u64)> {
        let Some(dir) = &args.resume else {
            // `--load FILE` starts from its parameters (global tensors by name).
            if let Some(path) = &args.load {
                let read = || -> Result<_, shardc_runtime::RuntimeError> {
                    let file = shardc_runtime::checkpoint::open_parameter_file(path, programs)?;
                    file.names().into_iter().map(|name| Ok((name.clone(), file.read_f64(&name)?.expect("checked floating point")))).collect()
                };
                let params = read().map_err(|e| miette!("--load {e}"))?;
                return Ok((Some(shardc_runtime::train::TrainState::from_parameters(params, programs)), args.seed.unwrap_or(0)));
            }
            // A Hugging Face model starts from its weights.
            if let Some(hf) = args.step.hf_dir(args.spec.as_deref()) {
                let params = crate::hf::load_weights(&hf, &args.step.load_spec(args.spec.as_deref())?)?;
                if self.speaks {
                    println!("  weights     {} tensors from {}", params.len(), hf.display());
                }
                return Ok((Some(shardc_runtime::train::TrainState::from_parameters(params, programs)), args.seed.unwrap_or(0)));
            }
            return Ok((None, args.seed.unwrap_or(0)));
        };
        let (manifest, state) = shardc_runtime::checkpoint::load_sharded(dir).into_diagnostic().wrap_err_with(|| format!("resuming from {}", dir.display()))?;
        let resumed = self.check_resume(args, dir, &manifest, programs, corpus)?;
        if self.speaks {
            println!("{resumed}");
        }
        Ok((Some(state), manifest.seed))
    }

    #[cfg(feature = "cuda")]
    /// `--resume DIR`'s manifest, checked as [`Checkpoints::resume`] checks it, `corpus`
    /// moved to its place in the data order: what a process of a multi-process run resumes
    /// from, reading its own shards only.
    /// Returns the checkpoint folder itself (`LATEST` resolved once, so that every later read
    /// is of the checkpoint checked here), and the line to print once the run has resumed
    /// from it (its files are read after this, and may yet be refused).
    pub(super) fn resume_manifest(&self, args: &RunArgs, programs: &[Program], corpus: &mut Corpus) -> Result<Option<(PathBuf, String)>> {
        let Some(dir) = &args.resume else { return Ok(None) };
        let (folder, manifest) = shardc_runtime::checkpoint::resolve(dir).into_diagnostic().wrap_err_with(|| format!("resuming from {}", dir.display()))?;
        let resumed = self.check_resume(args, dir, &manifest, programs, corpus)?;
        Ok(Some((folder, resumed)))
    }

    /// Refuses to resume `manifest` (of the checkpoint `dir`) with another model, seed,
    /// optimizer or schedule; moves `corpus` to the checkpoint's place in the data order.
    /// Returns the line a run prints once it has resumed.
    pub(super) fn check_resume(&self, args: &RunArgs, dir: &std::path::Path, manifest: &shardc_runtime::checkpoint::Manifest, programs: &[Program], corpus: &mut Corpus) -> Result<String> {
        // Checkpoints hold real-shaped tensors and, in mixed precision, fp32 masters: the
        // padding and the precision may change between runs, the model may not.
        let differing: Vec<String> = match (&manifest.spec, &self.spec) {
            (serde_json::Value::Object(saved), serde_json::Value::Object(now)) => saved
                .keys()
                .chain(now.keys())
                .filter(|k| !matches!(k.as_str(), "vocab_multiple" | "dtype") && !same_value(saved.get(*k), now.get(*k)))
                .map(|k| format!("{k} {} (this run: {})", saved.get(k).map_or("unset".into(), |v| v.to_string()), now.get(k).map_or("unset".into(), |v| v.to_string())))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect(),
            (saved, now) if saved != now => vec!["the model".into()],
            _ => Vec::new(),
        };
        if !differing.is_empty() {
            return Err(miette!(help = "resume with the spec the checkpoint was trained with", "{}: the checkpoint was saved from another model: {}", dir.display(), differing.join(", ")));
        }
        // The seed fixes the run's data order, the optimizer its state: both come with the
        // checkpoint.
        if let Some(seed) = args.seed.filter(|&s| s != manifest.seed) {
            return Err(miette!(help = format!("resume without --seed (or with --seed {})", manifest.seed), "--seed {seed}: the checkpoint's run has seed {}, which fixes its data order", manifest.seed));
        }
        if args.step.training.optimizer == "sgd" && manifest.tensors.iter().any(|t| shardc_ir::facts::state_of(&t.name).is_some_and(|(state, _)| state != "master")) {
            return Err(miette!(help = "resume with the checkpoint's optimizer (--optimizer adamw)", "--optimizer sgd: {} holds AdamW's moments, which SGD would drop", dir.display()));
        }
        // The schedule and clipping continue the checkpoint's (Megatron-LM checks them too).
        if let (Some(saved), Some(now)) = (&manifest.optimizer, shardc_runtime::checkpoint::OptimizerRecord::of(programs)) {
            let differing = saved.differences(&now);
            let rule_changed = saved.update != now.update;
            if !differing.is_empty() && args.override_schedule && !rule_changed {
                if self.speaks {
                    println!("  schedule    overridden (--override-schedule): {}", differing.join(", "));
                }
            } else if !differing.is_empty() {
                let decay = if saved.decay_steps == 0 { "constant" } else if saved.cosine { "cosine" } else { "linear" };
                return Err(miette!(
                    help = format!(
                        "resume with the checkpoint's settings: --optimizer {} --lr {} --min-lr {} --lr-warmup-steps {} --lr-decay {decay}{} --clip-grad {} (or add --override-schedule to train on with this run's)",
                        saved.update,
                        saved.lr,
                        saved.min_lr,
                        saved.warmup_steps,
                        if saved.decay_steps > 0 { format!(" --lr-decay-steps {}", saved.decay_steps) } else { String::new() },
                        saved.clip_grad
                    ),
                    "{}: the checkpoint's run trained with other optimizer settings: {}",
                    dir.display(),
                    differing.join(", ")
                ));
            }
        }
        crate::data::resume_data(dir, manifest.data.as_ref(), corpus, manifest.step)?;
        Ok(format!("  resume      step {} from {} (saved on mesh {:?})", manifest.step, dir.display(), manifest.mesh))
    }

    /// Steps between checkpoints, when the run writes them.
    pub(super) fn period(&self) -> Option<u64> {
        self.dir.as_ref().map(|_| self.every.max(1))
    }

    /// Whether the run checkpoints after iteration `step` of a run ending at `last`: every
    /// `every` iterations counted from the start of training, and at the end.
    pub(super) fn due(&self, step: u64, last: u64) -> bool {
        self.period().is_some_and(|every| step.is_multiple_of(every) || step == last)
    }

    pub(super) fn save(&mut self, state: &shardc_runtime::train::TrainState, programs: &[Program], seed: u64, data: shardc_runtime::data::DataRecord) -> Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        // A finite loss can precede an update that overflowed: a checkpoint must not keep it.
        if let Some((name, _)) = state.tensors.iter().find(|(_, (_, values))| values.iter().any(|v| !v.is_finite())) {
            return Err(miette!(
                help = "lower --lr; the checkpoints already in the folder are from before this step",
                "`{name}` is not finite after step {}: not checkpointed",
                state.step
            ));
        }
        self.saved += 1;
        let abort = self.fault.filter(|(n, _)| *n == self.saved).map(|(_, rank)| rank);
        let path = shardc_runtime::checkpoint::save_sharded(dir, state, programs, self.spec.clone(), seed, Some(data), abort).into_diagnostic().wrap_err_with(|| format!("checkpointing into {}", dir.display()))?;
        println!("  checkpoint  step {} in {}", state.step, path.display());
        Ok(())
    }

    /// A GPU run holding every rank checkpoints each rank's shards from device memory, one
    /// tensor at a time (the files [`Checkpoints::save`] writes from the global state).
    #[cfg(feature = "cuda")]
    pub(super) fn save_every_rank(&mut self, trainer: &shardc_runtime::cuda::CudaTrainer, data: shardc_runtime::data::DataRecord) -> Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        self.saved += 1;
        let abort = self.fault.filter(|(n, _)| *n == self.saved).map(|(_, rank)| rank);
        let path = match trainer.checkpoint_every_rank(dir, self.spec.clone(), Some(data), abort) {
            Ok(path) => path,
            // As `save` says it of the global state.
            Err(shardc_runtime::RuntimeError::NonFiniteState { tensor, value, .. }) => return Err(not_finite(&tensor, value, trainer.steps_taken(), None)),
            Err(e) => return Err(e).into_diagnostic().wrap_err_with(|| format!("checkpointing into {}", dir.display())),
        };
        println!("  checkpoint  step {} in {}", trainer.steps_taken(), path.display());
        Ok(())
    }

    /// One process of a multi-process GPU run checkpoints its own shards from device memory;
    /// rank 0 commits the checkpoint once every rank's file is written.
    #[cfg(feature = "cuda")]
    pub(super) fn save_own_shards(&mut self, trainer: &mut shardc_runtime::cuda::CudaTrainer, data: shardc_runtime::data::DataRecord) -> Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        self.saved += 1;
        let abort = self.fault.is_some_and(|(n, rank)| n == self.saved && trainer.process_rank() == Some(rank));
        let committed = match trainer.checkpoint_own_shards(dir, self.spec.clone(), Some(data), abort) {
            Ok(committed) => committed,
            Err(shardc_runtime::RuntimeError::NonFiniteState { tensor, value, rank }) => return Err(not_finite(&tensor, value, trainer.steps_taken(), Some(rank))),
            Err(e) => return Err(e).into_diagnostic().wrap_err_with(|| format!("checkpointing into {}", dir.display())),
        };
        if let Some(path) = committed {
            println!("  checkpoint  step {} in {} (each process wrote its own rank file)", trainer.steps_taken(), path.display());
        }
        Ok(())
    }

    /// Where a multi-process GPU run's `--save` and `--save-hf` read its final parameters
    /// from, and whether that folder is this call's to remove: the run's own checkpoint
    /// folder (whose last checkpoint is the final step's), or else rank files of the
    /// parameters every process writes from its shards for this alone, into a folder inside
    /// the output's (which every process reaches, as checkpoint folders must be).
    #[cfg(feature = "cuda")]
    pub(super) fn rank_files_for_saving(&self, args: &RunArgs, trainer: &mut shardc_runtime::cuda::CudaTrainer) -> Result<(PathBuf, bool)> {
        if let Some(dir) = &self.dir {
            return Ok((dir.clone(), false));
        }
        // Named after the output, so that runs saving other files into one folder do not
        // share it.
        let (base, name) = match (&args.save_hf, &args.save) {
            (Some(dir), _) => (dir.clone(), "model".to_string()),
            (None, Some(file)) => (
                file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new(".")).to_path_buf(),
                file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            ),
            (None, None) => return Err(miette!("nothing to save")),
        };
        let dir = base.join(format!(".shardc-rank-files-{name}-step-{:08}", trainer.steps_taken()));
        // The parameters alone, each shard once: about the saved file's size.
        let written = trainer.write_own_parameter_shards(&dir);
        if written.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        match written {
            Ok(_) => Ok((dir, true)),
            Err(shardc_runtime::RuntimeError::NonFiniteState { tensor, value, rank }) => Err(not_finite(&tensor, value, trainer.steps_taken(), Some(rank))),
            Err(e) => Err(e).into_diagnostic().wrap_err_with(|| format!("writing the rank files of --save into {}", dir.display())),
        }
    }
}

/// A state tensor that is not finite after `step`, refused as a checkpoint of the global
/// state refuses it (`rank`: the process whose shard holds it, in a multi-process run).
#[cfg(feature = "cuda")]
fn not_finite(tensor: &str, value: f64, step: u64, rank: Option<usize>) -> miette::Report {
    let on = rank.map_or_else(String::new, |r| format!(" on rank {r}"));
    miette!(help = "lower --lr; the checkpoints already in the folder are from before this step", "`{tensor}` is not finite after step {step} ({value}{on}): not checkpointed")
}

/// Every place the run will write, checked before training: a wrong or read-only path found
/// after the last step would lose the run.
pub(super) fn check_outputs(args: &RunArgs) -> Result<()> {
    // Before any folder is made: outputs that would overwrite an input or each other.
    refuse_colliding_outputs(args)?;
    for (flag, dir) in [("--checkpoint", &args.checkpoint), ("--save-hf", &args.save_hf)] {
        if let Some(dir) = dir {
            writable_folder(flag, dir)?;
        }
    }
    for (flag, file) in [("--save", &args.save), ("--trace", &args.trace)] {
        if let Some(file) = file {
            writable_file(flag, file)?;
        }
    }
    Ok(())
}

/// `path` made absolute, through the links of the part of it that exists: two names of one
/// file compare equal (`out/../x`, `./x`, a link to it).
fn resolved(path: &std::path::Path) -> std::path::PathBuf {
    use std::path::Component;
    // A dangling link's target does not canonicalize: follow it by hand.
    let path = shardc_runtime::tensor_file::link_target(path).unwrap_or_else(|| path.to_path_buf());
    let absolute = std::path::absolute(&path).unwrap_or_else(|_| path.clone());
    // The longest existing head, canonical, with the rest appended (the folders a run makes:
    // `..` after one is its parent).
    let parts: Vec<Component> = absolute.components().collect();
    for keep in (0..=parts.len()).rev() {
        let Ok(mut real) = parts[..keep].iter().collect::<std::path::PathBuf>().canonicalize() else { continue };
        for part in &parts[keep..] {
            match part {
                Component::ParentDir => {
                    real.pop();
                }
                Component::CurDir => {}
                other => real.push(other),
            }
        }
        return real;
    }
    absolute
}

/// Refuses outputs that would overwrite the run's inputs or one another, by what each writes
/// (`--save-hf DIR` writes `DIR/config.json` and `DIR/model.safetensors`), every path
/// followed through its links: an output file that is an input file (the spec, `--data`
/// with both files of a Megatron-LM dataset, `--tokenizer`, `--cluster`, the `--hf` folder's
/// config and weights wherever its links lead, and `--load` for any output but `--save`) or
/// another output file, or a name a folder's owner writes: in a `--checkpoint` or `--resume`
/// folder `LATEST` and `step-*` (a `--resume` of one step folder owns it whole, and its
/// folder's names); in a `--save-hf` or `--hf` folder its config and weights. A `--save-hf`
/// folder that holds another model's weights (an index, other shards: `--hf` would read
/// those, not what the run writes) is refused too. Outputs that merely share a folder are
/// fine (`--checkpoint runs/a --save runs/a/final.safetensors`), as is `--save` over the
/// `--load` file it started from (read whole before training, replaced at once after), and
/// `--checkpoint` in the `--resume` folder.
fn refuse_colliding_outputs(args: &RunArgs) -> Result<()> {
    use std::path::{Path, PathBuf};
    type Owns = fn(&std::ffi::OsStr) -> bool;
    let hf = args.step.hf_dir(args.spec.as_deref());
    let named = |flag: &'static str, path: &Option<PathBuf>| path.as_ref().map(|p| (flag, p.clone(), resolved(p)));
    let mut out_files: Vec<_> = [named("--save", &args.save), named("--trace", &args.trace)].into_iter().flatten().collect();
    if let Some(dir) = &args.save_hf {
        out_files.extend(["config.json", "model.safetensors"].iter().filter_map(|f| named("--save-hf", &Some(dir.join(f)))));
    }
    let spec_file = args.spec.as_ref().filter(|p| p.is_file()).cloned();
    let mut in_files: Vec<_> = [named("spec", &spec_file), named("--data", &args.input.data), named("--tokenizer", &args.input.tokenizer), named("--cluster", &args.step.hardware.cluster), named("--load", &args.load)].into_iter().flatten().collect();
    // A Megatron-LM dataset is two files, whichever of them (or their prefix) --data names.
    if let Some(data) = &args.input.data
        && (args.input.data_format == crate::data::DataFormat::Megatron || shardc_runtime::data::is_megatron(data))
    {
        let (bin, idx) = shardc_runtime::data::megatron_paths(data);
        in_files.extend([named("--data", &Some(bin)), named("--data", &Some(idx))].into_iter().flatten());
    }
    // The Hugging Face folder's own files, wherever its links lead (a hub cache's snapshot
    // links to blobs that other snapshots share).
    if let Some(dir) = &hf {
        let entries = std::fs::read_dir(dir).into_iter().flatten().flatten();
        in_files.extend(entries.filter(|e| shardc_runtime::hf::is_model_file(&e.file_name())).filter_map(|e| named("--hf", &Some(e.path()))));
    }
    // Folders and what in them is their owner's; `whole`: the folder itself and all in it.
    let resume_step = args.resume.as_ref().filter(|r| r.join("manifest.json").is_file());
    let folder = |flag: &'static str, path: &Option<PathBuf>, owns: Owns, whole: bool| named(flag, path).map(|(f, p, r)| (f, p, r, owns, whole));
    let folders: Vec<(&str, PathBuf, PathBuf, Owns, bool)> = [
        folder("--checkpoint", &args.checkpoint, shardc_runtime::checkpoint::owns_name, false),
        folder("--resume", &args.resume, shardc_runtime::checkpoint::owns_name, resume_step.is_some()),
        folder("--resume", &resume_step.and_then(|r| resolved(r).parent().map(Path::to_path_buf)), shardc_runtime::checkpoint::owns_name, false),
        folder("--save-hf", &args.save_hf, shardc_runtime::hf::is_model_file, false),
        folder("--hf", &hf, shardc_runtime::hf::is_model_file, false),
    ]
    .into_iter()
    .flatten()
    .collect();
    // The folder of `folders` (other than `mine`'s) that owns `path`.
    let owner = |path: &Path, mine: &str| {
        folders.iter().filter(|f| f.0 != mine).find(|(_, _, dir, owns, whole)| match path.strip_prefix(dir) {
            Ok(rest) => *whole || rest.iter().next().is_some_and(owns),
            Err(_) => false,
        })
    };
    let refuse = |what: String| Err(miette!(help = "give the output a path of its own", "{what}"));
    for (i, (flag, path, real)) in out_files.iter().enumerate() {
        if let Some((other, _, _)) = out_files[..i].iter().find(|o| o.2 == *real) {
            return refuse(format!("{flag} {} is also the {other} file: one would overwrite the other", path.display()));
        }
        if let Some((other, _, _)) = in_files.iter().filter(|o| !(*flag == "--save" && o.0 == "--load")).find(|o| o.2 == *real) {
            return refuse(format!("{flag} {} is the {other} file the run reads: writing it would destroy it", path.display()));
        }
        if let Some((other, _, _, _, _)) = folders.iter().find(|f| f.2 == *real) {
            return refuse(format!("{flag} {} is also the {other} folder", path.display()));
        }
        if let Some((other, dir, _, _, _)) = owner(real, flag) {
            return refuse(format!("{flag} {} is a file of the {other} folder {}, which the run reads or writes", path.display(), dir.display()));
        }
    }
    for (flag, path, real, _, _) in folders.iter().filter(|f| matches!(f.0, "--checkpoint" | "--save-hf")) {
        if *flag == "--save-hf"
            && let Some((_, dir, _, _, _)) = folders.iter().find(|f| f.0 == "--hf" && f.2 == *real)
        {
            return refuse(format!("--save-hf {} is the --hf folder {} the run starts from: it would write over those weights", path.display(), dir.display()));
        }
        if let Some((other, dir, _, _, _)) = owner(real, flag) {
            return refuse(format!("{flag} {} is a folder of the {other} folder {}, which the run reads or writes", path.display(), dir.display()));
        }
    }
    // A folder of another model's weights: `--hf` reads an index or its shards before a
    // `model.safetensors`, so what the run writes would not be what loads.
    if let Some(dir) = &args.save_hf {
        let stale: Vec<String> = std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.ends_with(".safetensors.index.json") || (n.ends_with(".safetensors") && n != "model.safetensors")).collect();
        if let Some(first) = stale.first() {
            return Err(miette!(help = "give an empty folder, or one --save-hf wrote", "--save-hf {}: holds {first}, another model's weights, which --hf would read instead of what this run writes", dir.display()));
        }
    }
    Ok(())
}

/// Checks that `file` can be written, before the work that produces it: written through its
/// links, in a folder that exists or can be made (made when the file is written, with
/// [`make_parent`], so that a run refused later leaves no folder behind).
pub(crate) fn writable_file(flag: &str, file: &std::path::Path) -> Result<()> {
    if file.is_dir() || file.as_os_str().to_string_lossy().ends_with(std::path::MAIN_SEPARATOR) {
        return Err(miette!(help = "give a file name", "{flag} {}: is a folder", file.display()));
    }
    let written = through_links(flag, file)?;
    let parent = written.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    // Named as given: `--save /proc/x: in /proc: ...` says which output the folder is for.
    writable_folder(&format!("{flag} {}: in", file.display()), parent)
}

/// The folder that will hold `file` (through its links), made if it is not there yet: what
/// [`writable_file`] checked could be made.
pub(crate) fn make_parent(file: &std::path::Path) -> Result<()> {
    let written = shardc_runtime::tensor_file::link_target(file).unwrap_or_else(|| file.to_path_buf());
    match written.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => std::fs::create_dir_all(parent).into_diagnostic().wrap_err_with(|| format!("creating {}", parent.display())),
        None => Ok(()),
    }
}

/// Where `path` is written: its links followed (none: itself). A loop of links, or a link to
/// nothing through a folder that is a link to nothing, is refused.
fn through_links(flag: &str, path: &std::path::Path) -> Result<std::path::PathBuf> {
    let Some(target) = shardc_runtime::tensor_file::link_target(path) else { return Ok(path.to_path_buf()) };
    if std::fs::symlink_metadata(&target).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(miette!(help = "give a path that is not a loop of links", "{flag} {}: too many levels of links (a loop)", path.display()));
    }
    Ok(target)
}

/// Checks that `dir` can be made or written in, making nothing: it is a folder (through its
/// links), or does not exist yet below a folder that does, in which a file can be written.
pub(super) fn writable_folder(flag: &str, dir: &std::path::Path) -> Result<()> {
    let target = through_links(flag, dir)?;
    if target.as_path() != dir && !target.exists() {
        return Err(miette!(help = "make the folder it names, or give another", "{flag} {}: a link to {}, which does not exist", dir.display(), target.display()));
    }
    if target.exists() && !target.is_dir() {
        return Err(miette!(help = "give a folder, not a file", "{flag} {}: is not a folder", dir.display()));
    }
    // The nearest folder that exists: what the run's writes will make the rest in.
    let mut existing = target.as_path();
    while !existing.exists() {
        existing = match existing.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => std::path::Path::new("."),
        };
    }
    let fail = |e: std::io::Error| {
        let at = if existing == target.as_path() { String::new() } else { format!(" (in {})", existing.display()) };
        miette!(help = "give a folder this user can write to", "{flag} {}{at}: {e}", dir.display())
    };
    if !existing.is_dir() {
        return Err(miette!(help = "give a path under folders, not files", "{flag} {}: {} is not a folder", dir.display(), existing.display()));
    }
    let probe = existing.join(format!(".shardc-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(fail)?;
    std::fs::remove_file(&probe).map_err(fail)
}

/// `--load` starts a fresh run from given parameters; `--resume` continues a saved one.
pub(super) fn refuse_load_with_resume(args: &RunArgs) -> Result<()> {
    if args.load.is_some() && args.resume.is_some() {
        return Err(miette!(help = "give one of them: --resume continues a checkpoint with its optimizer state, --load starts fresh from parameters", "--load and --resume both say where to start"));
    }
    // A Hugging Face folder starts from its own weights (its model is the spec).
    if let (Some(file), Some(dir)) = (&args.load, args.step.hf_dir(args.spec.as_deref()))
        && args.resume.is_none()
    {
        return Err(miette!(
            help = "give one of them: the folder starts from its weights, --load from the file's (write them as a Hugging Face folder with --save-hf to start from them with that model)",
            "--load {} and the Hugging Face folder {} both say where the parameters start",
            file.display(),
            dir.display()
        ));
    }
    Ok(())
}

/// `--save FILE`: the trained parameters as global tensors, whatever the mesh.
pub(super) fn save_parameters(args: &RunArgs, spec: &Spec, source: Option<&dyn shardc_runtime::train::ParameterSource>) -> Result<()> {
    let (Some(path), Some(source)) = (&args.save, source) else { return Ok(()) };
    make_parent(path)?;
    let f64 = spec.model.dtype == shardc_ir::spec::SpecDType::F64;
    shardc_runtime::checkpoint::write_parameters(path, source, f64).into_diagnostic().wrap_err_with(|| format!("writing {}", path.display()))?;
    println!("  saved       {}", path.display());
    Ok(())
}
