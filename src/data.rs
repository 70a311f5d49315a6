//! `shardc run`'s data: which file, read how (`--data`, `--data-format`, a Hugging Face
//! `tokenizer.json` for text), the validation split (`--eval-fraction`), the validation loss
//! (`--eval-every`), and the data's record in checkpoints.
//!
//! Reading and sampling live in `shardc_runtime::data`; this module picks the format, runs
//! the tokenizer and compiles the forward pass the validation loss runs on.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use miette::{IntoDiagnostic, Result, miette};
use shardc_ir::spec::Spec;
use shardc_runtime::data::{Corpus, DataRecord, Source, Tokens, Width};
use shardc_runtime::eval::Evaluator;

/// How `--data` is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DataFormat {
    /// Megatron-LM when `PREFIX.idx` is beside the file (or the file is a `.idx`), flat uint16
    /// for a `.bin` (nanoGPT), else text.
    Auto,
    /// Text: one token per byte, or the ids of a tokenizer (--tokenizer, or the --hf
    /// folder's tokenizer.json).
    Text,
    /// Flat little-endian uint16 token ids (nanoGPT's train.bin).
    U16,
    /// Flat little-endian uint32 token ids.
    U32,
    /// Megatron-LM's indexed dataset: PREFIX.bin and PREFIX.idx (give either, or PREFIX).
    Megatron,
}

/// The data arguments of `shardc run`.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Data")]
pub struct DataArgs {
    /// Training data: text, flat token ids or a Megatron-LM indexed dataset (see
    /// --data-format). Default: the built-in text, data/kjv-genesis-exodus.txt.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// How to read --data (auto: by the file's name and the files beside it).
    #[arg(long, value_enum, default_value_t = DataFormat::Auto, value_name = "FORMAT")]
    pub data_format: DataFormat,
    /// A Hugging Face tokenizer.json for text data. Default: the --hf folder's tokenizer.json
    /// if it has one; without a tokenizer, text is one token per byte.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Share of the data's windows (of seq + 1 tokens) held out of training for validation:
    /// the last ones, at least one; 0 holds out none.
    #[arg(long, default_value_t = shardc_runtime::data::DEFAULT_EVAL_FRACTION, value_name = "FRACTION")]
    pub eval_fraction: f64,
    /// Print the validation loss every N steps, counted from the start of training, and at
    /// the end (0: never).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub eval_every: u64,
    /// Held-out windows the validation loss averages over (the first ones; fewer when fewer
    /// are held out). Default: 64.
    #[arg(long, value_name = "N")]
    pub eval_windows: Option<u64>,
}

/// Held-out windows the validation loss averages over unless --eval-windows says.
const DEFAULT_EVAL_WINDOWS: u64 = 64;

/// How the built-in corpus is named in messages and in a checkpoint's data record.
const BUILT_IN_SOURCE: &str = "the built-in corpus (data/kjv-genesis-exodus.txt)";

/// The built-in corpus (data/kjv-genesis-exodus.txt), inside the binary so that `shardc run`
/// trains wherever it runs.
const BUILT_IN_CORPUS: &[u8] = include_bytes!("../data/kjv-genesis-exodus.txt");

/// Text tokenized in one piece: larger text is better tokenized once, ahead of training.
const MAX_TOKENIZED_TEXT: u64 = 64 << 20;

/// Most bytes of a `tokenizer.json` (the largest published ones are about 35 MB).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Refuses a `--data` path that cannot be read as data: a directory, or a device such as
/// `/dev/zero` that never ends. Token files are read by their size, so they must be regular
/// files; text may also come through a pipe (`--data <(zcat corpus.txt.gz)`).
fn check_readable(path: &Path, text: bool) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| miette!("--data {}: {e}", path.display()))?;
    if meta.is_file() {
        return Ok(());
    }
    use std::os::unix::fs::FileTypeExt;
    let kind = meta.file_type();
    let what = if meta.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        if text {
            return Ok(());
        }
        "a pipe"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else {
        "not a regular file"
    };
    let help = if text { "give a text file (or a pipe)" } else { "give the token file itself: token files are read by their size, so a pipe or a device cannot be one" };
    Err(miette!(help = help, "--data {}: {what}, not a file of training data", path.display()))
}

/// The format `--data-format` resolves to for `path`.
fn resolve(format: DataFormat, path: &Path) -> DataFormat {
    match format {
        DataFormat::Auto if shardc_runtime::data::is_megatron(path) => DataFormat::Megatron,
        // An index alone is a Megatron-LM dataset missing its .bin, not text.
        DataFormat::Auto if path.extension().is_some_and(|e| e == "idx") => DataFormat::Megatron,
        DataFormat::Auto if path.extension().is_some_and(|e| e == "bin") => DataFormat::U16,
        DataFormat::Auto => DataFormat::Text,
        other => other,
    }
}

/// The tokenizer text is read with: `--tokenizer`, or the Hugging Face folder's.
fn tokenizer_path(args: &DataArgs, hf_dir: Option<&Path>) -> Option<PathBuf> {
    args.tokenizer.clone().or_else(|| hf_dir.map(|d| d.join("tokenizer.json")).filter(|p| p.is_file()))
}

/// About the bytes the run's data takes in memory once read (before it is read, for the
/// host memory check): a token file at its own width (at most: Megatron's int64 ids are
/// kept as 32-bit), byte-level text byte for byte, text for a tokenizer with its ids (4 bytes
/// each, at most one a byte). A pipe's size is unknown: 0.
pub fn memory_bytes(args: &DataArgs, hf_dir: Option<&Path>) -> u64 {
    let tokenized = |bytes: u64| if tokenizer_path(args, hf_dir).is_some() { bytes.min(MAX_TOKENIZED_TEXT).saturating_mul(5) } else { bytes };
    let Some(path) = &args.data else { return tokenized(BUILT_IN_CORPUS.len() as u64) };
    let size = |p: &Path| std::fs::metadata(p).ok().filter(|m| m.is_file()).map_or(0, |m| m.len());
    match resolve(args.data_format, path) {
        DataFormat::Megatron => size(&shardc_runtime::data::megatron_paths(path).0),
        DataFormat::U16 | DataFormat::U32 => size(path),
        DataFormat::Text | DataFormat::Auto => tokenized(size(path)),
    }
}

/// Refuses data options that would change nothing, before any work: a validation size
/// without validation, a format without a file to read.
pub fn refuse_unused(args: &DataArgs) -> Result<()> {
    if let (0, Some(n)) = (args.eval_every, args.eval_windows) {
        return Err(miette!(help = "add --eval-every N to evaluate every N steps", "--eval-windows {n} sizes the validation loss, which a run prints only with --eval-every"));
    }
    if args.data.is_none() && args.data_format != DataFormat::Auto {
        return Err(miette!(help = "give --data FILE to train on it, or leave --data-format out", "--data-format says how to read --data, and there is none: the run trains on the built-in text"));
    }
    Ok(())
}

/// Reads the run's data (`--data`, or the built-in text) and cuts it into windows for
/// `spec`'s sequence, with the validation split.
pub fn training_corpus(args: &DataArgs, spec: &Spec, hf_dir: Option<&Path>) -> Result<Corpus> {
    let seq = spec.seq_len() as usize;
    let vocab = spec.model.vocab as usize;
    if !(0.0..1.0).contains(&args.eval_fraction) {
        return Err(miette!(help = "give a fraction such as 0.01, or 0 to hold out nothing", "--eval-fraction {} is not in [0, 1)", args.eval_fraction));
    }
    let fail = |e: shardc_runtime::RuntimeError| miette!("--data: {e}");
    let (tokens, source) = match &args.data {
        None => text_tokens(BUILT_IN_CORPUS.to_vec(), BUILT_IN_SOURCE.into(), args, hf_dir)?,
        Some(path) => {
            let name = path.display().to_string();
            let format = resolve(args.data_format, path);
            if args.tokenizer.is_some() && format != DataFormat::Text {
                return Err(miette!(help = "give --data-format text for text to tokenize, or leave out --tokenizer", "--tokenizer: --data {name} is read as {} token ids, not text", format!("{format:?}").to_lowercase()));
            }
            let megatron = format == DataFormat::Megatron;
            if megatron {
                let (bin, idx) = shardc_runtime::data::megatron_paths(path);
                check_readable(&bin, false)?;
                check_readable(&idx, false)?;
            } else {
                check_readable(path, matches!(format, DataFormat::Text | DataFormat::Auto))?;
            }
            match format {
                DataFormat::U16 => (shardc_runtime::data::read_flat(path, Width::U16).map_err(fail)?, Source { name, format: "uint16".into(), bytes_per_token: Some(2) }),
                DataFormat::U32 => (shardc_runtime::data::read_flat(path, Width::U32).map_err(fail)?, Source { name, format: "uint32".into(), bytes_per_token: Some(4) }),
                DataFormat::Megatron => {
                    let (tokens, dtype, size) = shardc_runtime::data::read_megatron(path).map_err(fail)?;
                    let (bin, _) = shardc_runtime::data::megatron_paths(path);
                    (tokens, Source { name: bin.display().to_string(), format: format!("megatron {dtype}"), bytes_per_token: Some(size) })
                }
                DataFormat::Text | DataFormat::Auto => {
                    // Text for a tokenizer is read up to its limit (one byte more tells it was
                    // longer); byte-level text whole.
                    let limit = if tokenizer_path(args, hf_dir).is_some() { MAX_TOKENIZED_TEXT + 1 } else { u64::MAX };
                    let mut bytes = Vec::new();
                    std::fs::File::open(path).and_then(|f| std::io::Read::read_to_end(&mut std::io::Read::take(f, limit), &mut bytes)).map_err(|e| miette!("--data: reading {name}: {e}"))?;
                    text_tokens(bytes, name, args, hf_dir)?
                }
            }
        }
    };
    Corpus::from_tokens(tokens, source, seq, vocab, args.eval_fraction).map_err(fail)
}

/// Text as tokens: a tokenizer's ids when there is one, else one token per byte.
fn text_tokens(bytes: Vec<u8>, name: String, args: &DataArgs, hf_dir: Option<&Path>) -> Result<(Tokens, Source)> {
    let Some(tokenizer) = tokenizer_path(args, hf_dir) else {
        return Ok((Tokens::U8(bytes), Source { name, format: "text, one token per byte".into(), bytes_per_token: Some(1) }));
    };
    if bytes.len() as u64 > MAX_TOKENIZED_TEXT {
        return Err(miette!(
            help = "tokenize it once with the model's tokenizer into a nanoGPT .bin (uint16) or a Megatron-LM .bin/.idx pair, and give that to --data",
            "--data {name}: more than {} MiB of text, the most shardc tokenizes at the start of a run",
            MAX_TOKENIZED_TEXT >> 20
        ));
    }
    let text = String::from_utf8(bytes).map_err(|e| miette!(help = "give UTF-8 text, or --data-format u16/u32/megatron for token ids", "--data {name}: not UTF-8 text ({e}), which a tokenizer needs"))?;
    let json = crate::input::read_text("--tokenizer", &tokenizer, MAX_TOKENIZER_BYTES)?;
    let loaded: tokenizers::Tokenizer = json.parse().map_err(|e| miette!(help = "give a Hugging Face tokenizer.json (from tokenizer.save or the model's folder)", "--tokenizer {}: {e}", tokenizer.display()))?;
    // Without special tokens: the text is a stream of documents, not one prompt.
    let encoding = loaded.encode_fast(text.as_str(), false).map_err(|e| miette!("--data {name}: the tokenizer {} failed: {e}", tokenizer.display()))?;
    let ids = encoding.get_ids().to_vec();
    let file = tokenizer.file_name().map_or_else(|| tokenizer.display().to_string(), |f| f.to_string_lossy().to_string());
    Ok((Tokens::U32(ids), Source { name, format: format!("text, tokenized by {file}"), bytes_per_token: None }))
}

/// A checkpoint's data against this run's: the same tokens (count and fingerprint), cut the
/// same way; then the run continues from the checkpoint's position in the data order.
/// Checkpoints from before shardc recorded the data have none, and continue by (seed, step).
pub fn resume_data(dir: &Path, saved: Option<&DataRecord>, corpus: &mut Corpus, step: u64) -> Result<()> {
    let Some(saved) = saved else { return Ok(()) };
    let (then, now) = (&saved.identity, corpus.identity());
    if then.tokens != now.tokens || then.fingerprint != now.fingerprint {
        return Err(miette!(
            help = if then.source == now.source {
                format!("the same source read another way: resume with the checkpoint's ({}), or start a new run", then.format)
            } else if then.source == BUILT_IN_SOURCE {
                "resume without --data (the checkpoint's run read the built-in corpus), or start a new run".to_string()
            } else {
                format!("resume with the checkpoint's data (--data {}), or start a new run", then.source)
            },
            "{}: the checkpoint's run trained on {} ({}, {} tokens), and this run reads {} ({}, {} tokens)",
            dir.display(),
            then.source,
            then.format,
            then.tokens,
            now.source,
            now.format,
            now.tokens
        ));
    }
    if saved.window != corpus.seq() as u64 + 1 {
        return Err(miette!(
            help = format!("resume with --seq {}", saved.window - 1),
            "{}: the checkpoint's run cut its data into windows of {} tokens (seq {}), and this run's seq is {}",
            dir.display(),
            saved.window,
            saved.window - 1,
            corpus.seq()
        ));
    }
    if saved.train_windows != corpus.train_windows() {
        return Err(miette!(
            help = "resume with the checkpoint's --eval-fraction",
            "{}: the checkpoint's run trained on {} windows and held out {}; this run's --eval-fraction holds out {}",
            dir.display(),
            saved.train_windows,
            saved.validation_windows,
            corpus.validation_windows()
        ));
    }
    corpus.start_at(step, saved.samples);
    Ok(())
}

/// The validation loss of a run, every `--eval-every` steps and at the end.
pub struct Evaluation {
    /// The CPU's forward pass (`None`: the run evaluates on its devices, with its own step).
    evaluator: Option<Evaluator>,
    windows: usize,
    every: u64,
}

impl Evaluation {
    /// The evaluation `args` ask for (none without `--eval-every`): the spec's forward pass
    /// with its loss compiled for one device, at the spec's micro-batch (or fewer rows when
    /// fewer windows are evaluated).
    pub fn new(args: &DataArgs, spec: &Spec, corpus: &Corpus) -> Result<Option<Evaluation>> {
        let Some(windows) = Evaluation::windows_asked(args, corpus)? else { return Ok(None) };
        // The largest batch up to the micro-batch that divides the windows: every window
        // counts, whatever --micro-batch (a batch of 2 over 3 windows dropped the third).
        let rows = (1..=(spec.training.micro_batch as usize).clamp(1, windows)).rev().find(|r| windows.is_multiple_of(*r)).unwrap_or(1);
        let mut eval_spec = spec.clone();
        eval_spec.training.micro_batch = rows as u64;
        eval_spec.training.global_batch = None;
        let mesh = shardc_ir::mesh::Mesh::default();
        let shape = shardc_ir::spec::StepShape { rows: rows as u64, ..spec.step_shape(&mesh) };
        let mut module = shardc_ir::spec::lower(&eval_spec, shape).into_diagnostic()?;
        let options = shardc_passes::CompileOptions { mesh, vocab: shape.padded_vocab as i64, kv_heads: spec.model.kv_heads() as i64, ..Default::default() };
        let cx = crate::ir_context()?;
        shardc_passes::inference_pipeline(&options).run(&cx, &mut module, |_| false, |_, _| {}).into_diagnostic()?;
        let forward = module.func("forward").ok_or_else(|| miette!("the pipeline produced no @forward"))?;
        let program = shardc_codegen::lower_func(forward).into_diagnostic()?;
        let evaluator = Evaluator::new(program, corpus, windows).map_err(|e| miette!("--eval-every: {e}"))?;
        Ok(Some(Evaluation { windows: evaluator.windows(), evaluator: Some(evaluator), every: args.eval_every }))
    }

    /// The evaluation `args` ask for of a run that evaluates on its devices with its own
    /// training step's forward ([`shardc_runtime::cuda::CudaTrainer::evaluate`]): nothing is
    /// compiled for it.
    pub fn on_devices(args: &DataArgs, corpus: &Corpus) -> Result<Option<Evaluation>> {
        Ok(Evaluation::windows_asked(args, corpus)?.map(|windows| Evaluation { evaluator: None, windows, every: args.eval_every }))
    }

    /// The windows each evaluation averages over (none without `--eval-every`).
    fn windows_asked(args: &DataArgs, corpus: &Corpus) -> Result<Option<usize>> {
        if args.eval_every == 0 {
            return Ok(None);
        }
        if corpus.validation_windows() == 0 {
            return Err(miette!(help = "hold out windows with --eval-fraction, e.g. 0.01", "--eval-every {}: --eval-fraction 0 holds out no data to evaluate on", args.eval_every));
        }
        let windows = (args.eval_windows.unwrap_or(DEFAULT_EVAL_WINDOWS) as usize).min(corpus.validation_windows() as usize);
        if windows == 0 {
            return Err(miette!(help = "evaluate on at least one window, e.g. --eval-windows 64", "--eval-windows 0"));
        }
        Ok(Some(windows))
    }

    /// The validation windows each evaluation averages over.
    pub fn windows(&self) -> usize {
        self.windows
    }

    /// Steps between evaluations.
    pub fn every(&self) -> u64 {
        self.every
    }

    /// Whether the run evaluates after `step` (of a run ending at `last`).
    pub fn due(&self, step: u64, last: u64) -> bool {
        step.is_multiple_of(self.every) || step == last
    }

    /// Evaluates the run's `parameters` on the CPU and prints `step N validation loss X`.
    pub fn report(&mut self, step: u64, parameters: &dyn shardc_runtime::train::ParameterSource, corpus: &Corpus) -> Result<f64> {
        let evaluator = self.evaluator.as_mut().ok_or_else(|| miette!("this run evaluates on its devices"))?;
        let loss = evaluator.loss(parameters, corpus).map_err(|e| miette!("evaluating after step {step}: {e}"))?;
        Evaluation::print(step, loss);
        Ok(loss)
    }

    /// Prints `step N validation loss X`.
    pub fn print(step: u64, loss: f64) {
        println!("step {step} validation loss {loss:.6}");
    }

    /// What the validation loss averages over, for the run's header.
    pub fn describe(&self, corpus: &Corpus) -> String {
        let where_ = if self.evaluator.is_some() { "" } else { ", on the devices with the training step's forward" };
        format!("validation loss every {} steps on {} of the {} held-out windows{where_}", self.every, self.windows, corpus.validation_windows())
    }
}

