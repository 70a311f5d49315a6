//! Training data: token files read into memory, the split into training and validation
//! windows, and the deterministic sampler of `(tokens, targets)` batches.
//!
//! Formats: text read as bytes (one token per byte); flat little-endian `uint16` or `uint32`
//! token ids (nanoGPT's `train.bin` is flat `uint16`); and Megatron-LM's indexed dataset
//! (`PREFIX.bin` with its index `PREFIX.idx`). Text through a tokenizer arrives as ids from
//! the command line ([`Tokens::U32`]).
//!
//! The sampler: the corpus is cut into non-overlapping windows of `seq + 1` tokens (a
//! window's first `seq` tokens are the input, its last `seq` the targets). The last windows
//! are the validation split (a fraction of them, at least one), never trained on. The others
//! are visited once per epoch, in an order shuffled by (seed, epoch): sample `k` of a run is
//! training window `permutation(seed, k / n)[k % n]`, and step `s` takes samples
//! `(s - 1) x rows .. s x rows`. A batch is therefore a function of (seed, step) alone, and a
//! run resumed at any step continues the same order.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::RuntimeError;
use crate::init::{key, splitmix64};

/// The share of windows held out for validation unless the caller says otherwise.
pub const DEFAULT_EVAL_FRACTION: f64 = 0.01;

/// Token ids in memory, each in the narrowest type its file used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tokens {
    /// One byte per token (byte-level text, Megatron `uint8`/`int8`).
    U8(Vec<u8>),
    /// Two bytes per token (nanoGPT's `.bin`, Megatron `uint16`/`int16`).
    U16(Vec<u16>),
    /// Four bytes per token (flat `uint32`, Megatron `int32`/`int64`, tokenized text).
    U32(Vec<u32>),
}

impl Tokens {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        match self {
            Tokens::U8(v) => v.len(),
            Tokens::U16(v) => v.len(),
            Tokens::U32(v) => v.len(),
        }
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token `i`.
    pub fn get(&self, i: usize) -> u32 {
        match self {
            Tokens::U8(v) => v[i] as u32,
            Tokens::U16(v) => v[i] as u32,
            Tokens::U32(v) => v[i],
        }
    }

    /// Appends tokens `range` to `out`.
    fn extend_into(&self, range: std::ops::Range<usize>, out: &mut Vec<i32>) {
        match self {
            Tokens::U8(v) => out.extend(v[range].iter().map(|&t| t as i32)),
            Tokens::U16(v) => out.extend(v[range].iter().map(|&t| t as i32)),
            // Ids are checked against the vocabulary (far below 2^31) when the corpus is made.
            Tokens::U32(v) => out.extend(v[range].iter().map(|&t| t as i32)),
        }
    }
}

/// The element type of a flat token file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    /// Little-endian `uint16` (nanoGPT's `train.bin`).
    U16,
    /// Little-endian `uint32`.
    U32,
}

/// What a run trains on, as the checkpoint records it: a resumed run must read the same.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DataIdentity {
    /// Where the data came from (a path as given, or the built-in corpus).
    pub source: String,
    /// How it was read (`text, one token per byte`, `uint16`, `megatron int32`, ...).
    pub format: String,
    /// Number of tokens.
    pub tokens: u64,
    /// CRC-32 of the token ids written as little-endian `uint32`: the same ids give the same
    /// fingerprint whatever file format held them.
    pub fingerprint: u32,
}

/// The data of a checkpoint: what was read, how it was cut, and how far the run got.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DataRecord {
    /// The data read.
    pub identity: DataIdentity,
    /// Tokens per window (`seq + 1`).
    pub window: u64,
    /// Windows trained on (one epoch).
    pub train_windows: u64,
    /// Windows held out for validation.
    pub validation_windows: u64,
    /// Training windows consumed since the start of training, over all epochs.
    pub samples: u64,
    /// The epoch the next sample is in (`samples / train_windows`).
    pub epoch: u64,
}

/// The most training windows a run consumes: [`crate::train::MAX_STEPS`] steps of at most
/// 2^31 sequences (the largest global batch a spec may have).
pub const MAX_SAMPLES: u64 = crate::train::MAX_STEPS << 31;

impl DataRecord {
    /// Checks what the fields must mean together (a hand-edited manifest could make the
    /// sampler overflow or divide by zero): windows of at least two tokens, as many as the
    /// tokens make, at least one to train on, at most [`MAX_SAMPLES`] consumed, and the epoch
    /// those samples are in. Errors name the field.
    pub fn check(&self) -> Result<(), String> {
        if self.window < 2 {
            return Err(format!("`window` is {}: a window is a sequence and its next token, at least 2 tokens", self.window));
        }
        let windows = self.identity.tokens / self.window;
        if self.train_windows == 0 || self.train_windows.checked_add(self.validation_windows) != Some(windows) {
            return Err(format!(
                "`train_windows` {} and `validation_windows` {} are not the {windows} windows of {} tokens that {} tokens make, with at least one to train on",
                self.train_windows, self.validation_windows, self.window, self.identity.tokens
            ));
        }
        if self.samples > MAX_SAMPLES {
            return Err(format!("`samples` is {}, more than a run consumes ({MAX_SAMPLES}): the manifest was edited or is corrupt", self.samples));
        }
        if self.epoch != self.samples / self.train_windows {
            return Err(format!("`epoch` is {}, and {} samples of {} training windows are in epoch {}", self.epoch, self.samples, self.train_windows, self.samples / self.train_windows));
        }
        Ok(())
    }
}

/// Where a token came from, for error messages: the file, its format, and the bytes each
/// token took there (none for tokenized text, whose tokens have no byte position).
#[derive(Clone, Debug)]
pub struct Source {
    /// A path as given, or a description.
    pub name: String,
    /// How it was read.
    pub format: String,
    /// Bytes per token in the file.
    pub bytes_per_token: Option<usize>,
}

fn data_error(message: String) -> RuntimeError {
    RuntimeError::Binding(message)
}

fn io_error(path: &Path, e: std::io::Error) -> RuntimeError {
    data_error(format!("{}: {e}", path.display()))
}

/// Reads `count` elements of `N` bytes from `file` (at its current position), handing each
/// to `push` with its index; one pass through a fixed buffer, no copy of the whole file.
fn read_elements<const N: usize>(file: &mut std::fs::File, path: &Path, count: usize, mut push: impl FnMut(usize, [u8; N]) -> Result<(), RuntimeError>) -> Result<(), RuntimeError> {
    const CHUNK: usize = 1 << 20;
    let mut buffer = vec![0u8; CHUNK - CHUNK % N];
    let mut index = 0;
    while index < count {
        let n = (count - index).min(buffer.len() / N);
        file.read_exact(&mut buffer[..n * N]).map_err(|e| io_error(path, e))?;
        for chunk in buffer[..n * N].chunks_exact(N) {
            push(index, chunk.try_into().expect("chunks_exact yields N bytes"))?;
            index += 1;
        }
    }
    Ok(())
}

/// The number of `size`-byte tokens in `path`'s `len` bytes: refuses an empty file and a
/// length that is not a whole number of tokens (a truncated file, or another format).
fn whole_tokens(path: &Path, len: u64, size: usize, what: &str, fix: &str) -> Result<usize, RuntimeError> {
    if len == 0 {
        return Err(data_error(format!("{}: the file is empty; {fix}", path.display())));
    }
    if !len.is_multiple_of(size as u64) {
        return Err(data_error(format!(
            "{}: {len} bytes is not a whole number of {what} tokens ({size} bytes each): the file is truncated, or holds another format; {fix}",
            path.display()
        )));
    }
    usize::try_from(len / size as u64).map_err(|_| data_error(format!("{}: {len} bytes is more than this machine can address", path.display())))
}

/// The length of `file`, a regular file: token files are read by their size, which a pipe
/// or a device (`/dev/zero`) does not have.
fn regular_len(path: &Path) -> Result<u64, RuntimeError> {
    let meta = std::fs::metadata(path).map_err(|e| io_error(path, e))?;
    if !meta.is_file() {
        return Err(data_error(format!("{}: not a regular file (a directory, pipe or device); token files are read by their size: give the file itself", path.display())));
    }
    Ok(meta.len())
}

/// Reads a flat file of little-endian token ids (`uint16` as nanoGPT writes `train.bin`, or
/// `uint32`).
pub fn read_flat(path: &Path, width: Width) -> Result<Tokens, RuntimeError> {
    let len = regular_len(path)?;
    let mut file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
    let fix = "write the token ids as a flat array (numpy: ids.astype(np.uint16).tofile(path)), or give --data-format for what the file holds";
    match width {
        Width::U16 => {
            let count = whole_tokens(path, len, 2, "uint16", fix)?;
            let mut out = Vec::with_capacity(count);
            read_elements::<2>(&mut file, path, count, |_, b| {
                out.push(u16::from_le_bytes(b));
                Ok(())
            })?;
            Ok(Tokens::U16(out))
        }
        Width::U32 => {
            let count = whole_tokens(path, len, 4, "uint32", fix)?;
            let mut out = Vec::with_capacity(count);
            read_elements::<4>(&mut file, path, count, |_, b| {
                out.push(u32::from_le_bytes(b));
                Ok(())
            })?;
            Ok(Tokens::U32(out))
        }
    }
}

/// The magic bytes that open a Megatron-LM index (`_INDEX_HEADER` in
/// `megatron/core/datasets/indexed_dataset.py`).
pub const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// Megatron-LM's element types by their code in the index (`DType` in
/// `megatron/core/datasets/indexed_dataset.py`): name and bytes per element.
fn megatron_dtype(code: u8) -> Option<(&'static str, usize)> {
    Some(match code {
        1 => ("uint8", 1),
        2 => ("int8", 1),
        3 => ("int16", 2),
        4 => ("int32", 4),
        5 => ("int64", 8),
        6 => ("float64", 8),
        7 => ("float32", 4),
        8 => ("uint16", 2),
        _ => return None,
    })
}

/// The `.bin` and `.idx` paths of a Megatron-LM indexed dataset named by its prefix, its
/// `.bin` or its `.idx`.
pub fn megatron_paths(path: &Path) -> (PathBuf, PathBuf) {
    let text = path.as_os_str().to_string_lossy();
    let prefix = text.strip_suffix(".bin").or_else(|| text.strip_suffix(".idx")).unwrap_or(&text).to_string();
    (PathBuf::from(format!("{prefix}.bin")), PathBuf::from(format!("{prefix}.idx")))
}

/// Whether `path` names a Megatron-LM indexed dataset: a `.idx` beside its `.bin` (or the
/// prefix of such a pair).
pub fn is_megatron(path: &Path) -> bool {
    let (bin, idx) = megatron_paths(path);
    bin.is_file() && idx.is_file()
}

/// Little-endian integers at `at` in `bytes` (the caller checked the length).
fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Reads a Megatron-LM indexed dataset (`PREFIX.bin` with `PREFIX.idx`, named by either or
/// by the prefix): the index's header (`MMIDIDX\0\0`, version 1, the dtype code, sequence and
/// document counts, then each sequence's length and byte offset) is checked against the
/// `.bin`, and the sequences are read in order as one stream of tokens, as Megatron's GPT
/// dataset concatenates its documents. Integer dtypes are read (negative ids refused);
/// floating-point ones are refused. Returns the tokens, the dtype's name and its bytes.
pub fn read_megatron(path: &Path) -> Result<(Tokens, &'static str, usize), RuntimeError> {
    let (bin, idx) = megatron_paths(path);
    let index_len = regular_len(&idx)?;
    let mut index_file = std::fs::File::open(&idx).map_err(|e| io_error(&idx, e))?;
    let mut index = Vec::with_capacity(index_len.min(1 << 30) as usize);
    index_file.read_to_end(&mut index).map_err(|e| io_error(&idx, e))?;
    let fix = "write the pair again with Megatron-LM's tools/preprocess_data.py";
    if index.len() < 34 || &index[..9] != MEGATRON_MAGIC {
        return Err(data_error(format!("{}: not a Megatron-LM index (it does not start with the 34-byte MMIDIDX header); {fix}", idx.display())));
    }
    let version = u64_at(&index, 9);
    if version != 1 {
        return Err(data_error(format!("{}: index version {version}, shardc reads version 1; {fix}", idx.display())));
    }
    let code = index[17];
    let (dtype, size) = megatron_dtype(code).ok_or_else(|| data_error(format!("{}: unknown dtype code {code} (Megatron-LM's are 1 to 8); {fix}", idx.display())))?;
    if matches!(code, 6 | 7) {
        return Err(data_error(format!(
            "{}: the tokens are {dtype} (dtype code {code}); shardc reads integer token ids (uint8, int8, int16, uint16, int32, int64): {fix} and an integer dtype",
            idx.display()
        )));
    }
    let sequences = u64_at(&index, 18);
    let documents = u64_at(&index, 26);
    // Lengths (int32), pointers (int64) and document indices (int64) follow the header.
    let needed = sequences.checked_mul(12).and_then(|s| documents.checked_mul(8).and_then(|d| s.checked_add(d))).and_then(|n| n.checked_add(34));
    if needed.is_none_or(|n| (index.len() as u64) < n) {
        return Err(data_error(format!("{}: the index is truncated ({} bytes for {sequences} sequences and {documents} documents); {fix}", idx.display(), index.len())));
    }
    let sequences = sequences as usize;
    let (lengths_at, pointers_at) = (34, 34 + 4 * sequences);
    let mut total: u64 = 0;
    for i in 0..sequences {
        let length = i32::from_le_bytes(index[lengths_at + 4 * i..lengths_at + 4 * i + 4].try_into().expect("4 bytes"));
        let pointer = u64_at(&index, pointers_at + 8 * i);
        if length < 0 || pointer != total * size as u64 {
            return Err(data_error(format!(
                "{}: sequence {i} has length {length} at byte {pointer} of {}, where the sequences before it end at byte {}: the index does not describe the .bin as consecutive sequences; {fix}",
                idx.display(),
                bin.display(),
                total * size as u64
            )));
        }
        total += length as u64;
    }
    let len = regular_len(&bin)?;
    let mut file = std::fs::File::open(&bin).map_err(|e| io_error(&bin, e))?;
    let count = whole_tokens(&bin, len, size, dtype, fix)?;
    if count as u64 != total {
        return Err(data_error(format!(
            "{}: holds {count} {dtype} tokens ({len} bytes), and its index {} describes {total} ({} bytes): the two files are not a pair; {fix}",
            bin.display(),
            idx.display(),
            total * size as u64
        )));
    }
    let negative = |i: usize, value: i64| data_error(format!("{}: token {i} (byte offset {}) is {value}; token ids cannot be negative; {fix}", bin.display(), i * size));
    let tokens = match code {
        1 => {
            let mut out = Vec::with_capacity(count);
            read_elements::<1>(&mut file, &bin, count, |_, b| {
                out.push(b[0]);
                Ok(())
            })?;
            Tokens::U8(out)
        }
        2 => {
            let mut out = Vec::with_capacity(count);
            read_elements::<1>(&mut file, &bin, count, |i, b| {
                let v = i8::from_le_bytes(b);
                out.push(u8::try_from(v).map_err(|_| negative(i, v as i64))?);
                Ok(())
            })?;
            Tokens::U8(out)
        }
        3 | 8 => {
            let mut out = Vec::with_capacity(count);
            read_elements::<2>(&mut file, &bin, count, |i, b| {
                out.push(if code == 3 { u16::try_from(i16::from_le_bytes(b)).map_err(|_| negative(i, i16::from_le_bytes(b) as i64))? } else { u16::from_le_bytes(b) });
                Ok(())
            })?;
            Tokens::U16(out)
        }
        4 => {
            let mut out = Vec::with_capacity(count);
            read_elements::<4>(&mut file, &bin, count, |i, b| {
                let v = i32::from_le_bytes(b);
                out.push(u32::try_from(v).map_err(|_| negative(i, v as i64))?);
                Ok(())
            })?;
            Tokens::U32(out)
        }
        _ => {
            let mut out = Vec::with_capacity(count);
            read_elements::<8>(&mut file, &bin, count, |i, b| {
                let v = i64::from_le_bytes(b);
                if v < 0 {
                    return Err(negative(i, v));
                }
                // Beyond u32 it is far outside any vocabulary: saturate, and the vocabulary
                // check names it.
                out.push(u32::try_from(v).unwrap_or(u32::MAX));
                Ok(())
            })?;
            Tokens::U32(out)
        }
    };
    Ok((tokens, dtype, size))
}

/// A bijection of `0..n` chosen by `key`: a four-round Feistel network on the smallest
/// even number of bits that covers `n`, walked until it lands inside `0..n` (each walk stays
/// inside the network's cycle through `i`, so distinct inputs give distinct outputs).
/// Constant memory, whatever the number of windows.
fn permute(key: u64, n: u64, i: u64) -> u64 {
    debug_assert!(i < n);
    let bits = (64 - (n.max(2) - 1).leading_zeros()).max(2);
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut left, mut right) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = splitmix64(key ^ splitmix64(right ^ (round << 58))) & mask;
            (left, right) = (right, left ^ f);
        }
        x = (left << half) | right;
        if x < n {
            return x;
        }
    }
}

/// A corpus of tokens cut into windows, with its validation split and its sampler.
#[derive(Clone, Debug)]
pub struct Corpus {
    tokens: Tokens,
    identity: DataIdentity,
    seq: usize,
    windows: u64,
    validation: u64,
    /// The step and the samples consumed by then at which this run's data order starts
    /// (a resumed run's checkpoint; `(0, 0)` for a fresh run).
    start: (u64, u64),
}

/// The byte-level constructor's former name.
pub type ByteCorpus = Corpus;

impl Corpus {
    /// A byte-level corpus: every byte of `bytes` is a token, of a `vocab`-sized vocabulary;
    /// windows of `seq + 1` bytes, [`DEFAULT_EVAL_FRACTION`] of them held out.
    pub fn new(bytes: Vec<u8>, seq: usize, vocab: usize) -> Result<Corpus, RuntimeError> {
        let source = Source { name: "the corpus".into(), format: "text, one token per byte".into(), bytes_per_token: Some(1) };
        Corpus::from_tokens(Tokens::U8(bytes), source, seq, vocab, DEFAULT_EVAL_FRACTION)
    }

    /// A corpus of `tokens` from `source`, cut into windows of `seq + 1` tokens, the last
    /// `eval_fraction` of them (rounded, at least one when the fraction is above zero) held
    /// out for validation. Every token must be below `vocab`; at least one window must be
    /// left to train on.
    pub fn from_tokens(tokens: Tokens, source: Source, seq: usize, vocab: usize, eval_fraction: f64) -> Result<Corpus, RuntimeError> {
        let name = &source.name;
        if !(0.0..1.0).contains(&eval_fraction) {
            return Err(data_error(format!("the validation fraction {eval_fraction} is not in [0, 1): give a fraction such as 0.01, or 0 to hold out nothing")));
        }
        if seq == 0 {
            return Err(data_error("a sequence of 0 tokens cannot be trained on".into()));
        }
        let window = seq + 1;
        let windows = (tokens.len() / window) as u64;
        if windows == 0 {
            return Err(data_error(format!(
                "{name}: {} tokens, fewer than one window of {window} (a sequence of {seq} and the next token): give more data, or a shorter --seq",
                tokens.len()
            )));
        }
        let validation = if eval_fraction > 0.0 { ((eval_fraction * windows as f64).round() as u64).max(1) } else { 0 };
        if validation >= windows {
            return Err(data_error(format!(
                "{name}: {} tokens make {windows} windows of {window}, and holding out {validation} for validation leaves none to train on: give more data, a shorter --seq, or a smaller --eval-fraction (0 holds out none)",
                tokens.len()
            )));
        }
        let fingerprint = check_vocab(&tokens, &source, vocab)?;
        let identity = DataIdentity { source: source.name, format: source.format, tokens: tokens.len() as u64, fingerprint };
        Ok(Corpus { tokens, identity, seq, windows, validation, start: (0, 0) })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the corpus is empty (never, once constructed).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// What was read.
    pub fn identity(&self) -> &DataIdentity {
        &self.identity
    }

    /// The sequence length the windows are cut for (a window is `seq + 1` tokens).
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Windows trained on in one epoch.
    pub fn train_windows(&self) -> u64 {
        self.windows - self.validation
    }

    /// Windows held out for validation.
    pub fn validation_windows(&self) -> u64 {
        self.validation
    }

    /// Refuses a program whose sequence is not the one the windows were cut for.
    pub fn check_seq(&self, seq: usize) -> Result<(), RuntimeError> {
        if seq != self.seq {
            return Err(data_error(format!("the corpus is cut into windows for sequences of {} tokens, and the program's sequence is {seq}", self.seq)));
        }
        Ok(())
    }

    /// Continues a run that stopped after `step` with `samples` training windows consumed:
    /// step `step + 1` takes the next ones.
    pub fn start_at(&mut self, step: u64, samples: u64) {
        self.start = (step, samples);
    }

    /// The training windows consumed by the end of `step` at `rows` per step.
    fn samples_by(&self, step: u64, rows: usize) -> u64 {
        self.start.1.saturating_add(step.saturating_sub(self.start.0).saturating_mul(rows as u64))
    }

    /// The training window of sample `k`: epoch `k / n` visits the `n` training windows in
    /// the order of the permutation drawn from (seed, epoch).
    pub fn train_window(&self, seed: u64, k: u64) -> u64 {
        let n = self.train_windows();
        let (epoch, i) = (k / n, k % n);
        permute(splitmix64(key(seed, "data") ^ splitmix64(epoch)), n, i)
    }

    /// Appends window `w`'s inputs and targets.
    fn push_window(&self, w: u64, tokens: &mut Vec<i32>, targets: &mut Vec<i32>) {
        let start = w as usize * (self.seq + 1);
        self.tokens.extend_into(start..start + self.seq, tokens);
        self.tokens.extend_into(start + 1..start + self.seq + 1, targets);
    }

    /// The batch of `step` (counted from 1): `rows` training windows, the next of the data
    /// order; targets are the tokens shifted by one.
    pub fn batch(&self, seed: u64, step: u64, rows: usize) -> (Vec<i32>, Vec<i32>) {
        let first = self.samples_by(step.saturating_sub(1), rows);
        let mut tokens = Vec::with_capacity(rows * self.seq);
        let mut targets = Vec::with_capacity(rows * self.seq);
        for row in 0..rows as u64 {
            self.push_window(self.train_window(seed, first + row), &mut tokens, &mut targets);
        }
        (tokens, targets)
    }

    /// Validation windows `first .. first + rows` (of [`Corpus::validation_windows`]), in
    /// file order.
    pub fn validation_batch(&self, first: usize, rows: usize) -> (Vec<i32>, Vec<i32>) {
        let mut tokens = Vec::with_capacity(rows * self.seq);
        let mut targets = Vec::with_capacity(rows * self.seq);
        for w in first..first + rows {
            self.push_window(self.train_windows() + w as u64, &mut tokens, &mut targets);
        }
        (tokens, targets)
    }

    /// The checkpoint's record after `step` at `rows` sequences per step.
    pub fn record(&self, step: u64, rows: usize) -> DataRecord {
        let samples = self.samples_by(step, rows);
        DataRecord {
            identity: self.identity.clone(),
            window: self.seq as u64 + 1,
            train_windows: self.train_windows(),
            validation_windows: self.validation,
            samples,
            epoch: samples / self.train_windows(),
        }
    }
}

/// Checks every token against the vocabulary; returns the fingerprint of the ids (one pass).
fn check_vocab(tokens: &Tokens, source: &Source, vocab: usize) -> Result<u32, RuntimeError> {
    let mut hasher = crc32fast::Hasher::new();
    let mut buffer = Vec::with_capacity(4 << 12);
    let len = tokens.len();
    for start in (0..len).step_by(1 << 12) {
        buffer.clear();
        for i in start..(start + (1 << 12)).min(len) {
            let id = tokens.get(i);
            if id as usize >= vocab {
                let at = match source.bytes_per_token {
                    Some(b) => format!("token {i} (byte offset {})", i * b),
                    None => format!("token {i}"),
                };
                let fix = if matches!(tokens, Tokens::U8(_)) && source.format.starts_with("text") {
                    "byte-level training needs vocab >= 256; give a model with a larger vocabulary, or a tokenizer".to_string()
                } else {
                    format!("tokenize with the model's tokenizer (ids below {vocab}), or give the model a larger vocabulary")
                };
                return Err(data_error(format!("{}: {at} is {id}, outside the model's vocabulary of {vocab}: {fix}", source.name)));
            }
            buffer.extend_from_slice(&id.to_le_bytes());
        }
        hasher.update(&buffer);
    }
    Ok(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("shardc-data-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn source(name: &str) -> Source {
        Source { name: name.into(), format: "uint16".into(), bytes_per_token: Some(2) }
    }

    /// A Megatron-LM index for `lengths` (sequences, one document each) of `code`-typed
    /// tokens of `size` bytes, as `_IndexWriter` writes it.
    fn megatron_index(code: u8, size: u64, lengths: &[i32]) -> Vec<u8> {
        let mut out = MEGATRON_MAGIC.to_vec();
        out.extend(1u64.to_le_bytes());
        out.push(code);
        out.extend((lengths.len() as u64).to_le_bytes());
        out.extend((lengths.len() as u64 + 1).to_le_bytes());
        out.extend(lengths.iter().flat_map(|l| l.to_le_bytes()));
        let mut pointer = 0u64;
        for l in lengths {
            out.extend(pointer.to_le_bytes());
            pointer += *l as u64 * size;
        }
        out.extend((0..=lengths.len() as u64).flat_map(|d| d.to_le_bytes()));
        out
    }

    #[test]
    fn reads_flat_uint16_and_uint32() {
        let dir = temp("flat");
        let ids: Vec<u32> = vec![1, 2, 300, 65535, 7];
        std::fs::write(dir.join("a.bin"), ids.iter().flat_map(|&i| (i as u16).to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        std::fs::write(dir.join("a.u32"), ids.iter().flat_map(|&i| (i * 1000).to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        assert_eq!(read_flat(&dir.join("a.bin"), Width::U16).unwrap(), Tokens::U16(ids.iter().map(|&i| i as u16).collect()));
        assert_eq!(read_flat(&dir.join("a.u32"), Width::U32).unwrap(), Tokens::U32(ids.iter().map(|&i| i * 1000).collect()));
        // More than one buffer's worth: the chunked reader keeps order across chunks.
        let long: Vec<u16> = (0..1_500_000u32).map(|i| (i % 65_521) as u16).collect();
        std::fs::write(dir.join("long.bin"), long.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        assert_eq!(read_flat(&dir.join("long.bin"), Width::U16).unwrap(), Tokens::U16(long));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn flat_files_that_are_empty_or_truncated_are_refused_by_name() {
        let dir = temp("flat-bad");
        std::fs::write(dir.join("empty.bin"), b"").unwrap();
        std::fs::write(dir.join("odd.bin"), [1u8, 0, 2]).unwrap();
        std::fs::write(dir.join("six.bin"), [0u8; 6]).unwrap();
        let err = read_flat(&dir.join("empty.bin"), Width::U16).unwrap_err().to_string();
        assert!(err.contains("empty.bin") && err.contains("empty"), "{err}");
        let err = read_flat(&dir.join("odd.bin"), Width::U16).unwrap_err().to_string();
        assert!(err.contains("odd.bin") && err.contains("3 bytes") && err.contains("truncated"), "{err}");
        let err = read_flat(&dir.join("six.bin"), Width::U32).unwrap_err().to_string();
        assert!(err.contains("6 bytes") && err.contains("uint32"), "{err}");
        assert!(read_flat(&dir.join("missing.bin"), Width::U16).unwrap_err().to_string().contains("missing.bin"));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn reads_megatron_indexed_datasets_of_every_integer_dtype() {
        let dir = temp("megatron");
        let lengths = [3, 0, 4];
        let ids: Vec<i64> = vec![5, 6, 7, 8, 9, 10, 11];
        for (code, size) in [(1u8, 1u64), (2, 1), (3, 2), (4, 4), (5, 8), (8, 2)] {
            let prefix = dir.join(format!("doc-{code}"));
            let bytes: Vec<u8> = ids.iter().flat_map(|&v| v.to_le_bytes()[..size as usize].to_vec()).collect();
            std::fs::write(prefix.with_extension("bin"), bytes).unwrap();
            std::fs::write(prefix.with_extension("idx"), megatron_index(code, size, &lengths)).unwrap();
            // Named by the prefix, the .bin or the .idx.
            for name in [prefix.clone(), prefix.with_extension("bin"), prefix.with_extension("idx")] {
                assert!(is_megatron(&name), "{}", name.display());
                let (tokens, _, bytes) = read_megatron(&name).unwrap();
                assert_eq!(bytes as u64, size);
                assert_eq!((0..tokens.len()).map(|i| tokens.get(i) as i64).collect::<Vec<_>>(), ids, "code {code}");
            }
        }
        assert_eq!(read_megatron(&dir.join("doc-4")).unwrap().1, "int32");
        assert_eq!(read_megatron(&dir.join("doc-5")).unwrap().1, "int64");
        assert_eq!(read_megatron(&dir.join("doc-8")).unwrap().1, "uint16");
        assert!(!is_megatron(&dir.join("nothing.bin")));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn megatron_errors_name_the_file_and_the_fix() {
        let dir = temp("megatron-bad");
        let write = |name: &str, bin: Vec<u8>, idx: Vec<u8>| {
            let prefix = dir.join(name);
            std::fs::write(prefix.with_extension("bin"), bin).unwrap();
            std::fs::write(prefix.with_extension("idx"), idx).unwrap();
            read_megatron(&prefix).unwrap_err().to_string()
        };
        // Floating-point tokens: float64 is code 6, float32 code 7.
        for code in [6u8, 7] {
            let err = write(&format!("float-{code}"), vec![0; 16], megatron_index(code, 8, &[2]));
            assert!(err.contains(".idx") && err.contains("float") && err.contains("integer"), "{err}");
        }
        let mut bad_magic = megatron_index(4, 4, &[1]);
        bad_magic[0] = b'X';
        assert!(write("magic", vec![0; 4], bad_magic).contains("not a Megatron-LM index"));
        // The index says int32, the .bin has a length that is no whole number of them.
        let err = write("truncated", vec![0; 10], megatron_index(4, 4, &[3]));
        assert!(err.contains("truncated.bin") && err.contains("10 bytes") && err.contains("int32"), "{err}");
        // The index describes 3 int32 tokens, the .bin holds 2.
        let err = write("mismatch", vec![0; 8], megatron_index(4, 4, &[3]));
        assert!(err.contains("mismatch.bin") && err.contains("mismatch.idx") && err.contains("not a pair"), "{err}");
        // An index cut short.
        let mut short = megatron_index(4, 4, &[3, 3]);
        short.truncate(40);
        assert!(write("short", vec![0; 24], short).contains("index is truncated"));
        // A negative id.
        let err = write("negative", (-3i32).to_le_bytes().to_vec(), megatron_index(4, 4, &[1]));
        assert!(err.contains("negative.bin") && err.contains("token 0") && err.contains("-3"), "{err}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_token_outside_the_vocabulary_is_named_with_its_offset() {
        let tokens = Tokens::U16((0..100).map(|i| if i == 57 { 900 } else { i % 50 }).collect());
        let err = Corpus::from_tokens(tokens, source("train.bin"), 4, 512, 0.1).unwrap_err().to_string();
        assert!(err.contains("train.bin") && err.contains("token 57 (byte offset 114)") && err.contains("900") && err.contains("512"), "{err}");
        let err = Corpus::new(b"hello".repeat(10), 4, 64).unwrap_err().to_string();
        assert!(err.contains("vocab >= 256"), "{err}");
    }

    #[test]
    fn too_little_data_is_refused_with_the_fix() {
        let tokens = |n: u16| Tokens::U16((0..n).collect());
        let err = Corpus::from_tokens(tokens(4), source("short.bin"), 4, 64, 0.0).unwrap_err().to_string();
        assert!(err.contains("short.bin") && err.contains("fewer than one window"), "{err}");
        // One window: nothing left to train on once one is held out.
        let err = Corpus::from_tokens(tokens(5), source("one.bin"), 4, 64, 0.01).unwrap_err().to_string();
        assert!(err.contains("one.bin") && err.contains("--eval-fraction"), "{err}");
        assert!(Corpus::from_tokens(tokens(5), source("one.bin"), 4, 64, 0.0).is_ok());
        assert!(Corpus::from_tokens(tokens(50), source("x"), 4, 64, 1.0).is_err());
    }

    /// The permutation of each epoch visits every training window exactly once, and never a
    /// validation window; the order is a function of the seed alone, and differs by seed
    /// and by epoch.
    #[test]
    fn each_epoch_visits_every_training_window_once() {
        for n_windows in [1usize, 2, 3, 7, 64, 100, 1000] {
            let corpus = Corpus::from_tokens(Tokens::U32((0..(n_windows as u32 + 1) * 5).collect()), source("x"), 4, usize::MAX, 0.0).unwrap();
            let n = corpus.train_windows();
            assert_eq!(n, n_windows as u64 + 1);
            for epoch in 0..3 {
                let mut seen: Vec<u64> = (0..n).map(|i| corpus.train_window(9, epoch * n + i)).collect();
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "{n} windows, epoch {epoch}");
            }
        }
        let corpus = Corpus::from_tokens(Tokens::U32((0..5000).collect()), source("x"), 4, usize::MAX, 0.1).unwrap();
        let (n, held) = (corpus.train_windows(), corpus.validation_windows());
        assert_eq!((n, held), (900, 100));
        let order = |seed: u64, epoch: u64| (0..n).map(|i| corpus.train_window(seed, epoch * n + i)).collect::<Vec<_>>();
        assert!(order(1, 0).iter().all(|&w| w < n), "a validation window was trained on");
        assert_eq!(order(1, 0), order(1, 0));
        assert_ne!(order(1, 0), order(2, 0), "seeds give the same order");
        assert_ne!(order(1, 0), order(1, 1), "epochs give the same order");
        assert_ne!(order(1, 0), (0..n).collect::<Vec<_>>(), "the order is not shuffled");
    }

    /// Batches are windows of the corpus, targets shifted by one, taken without replacement
    /// through an epoch; a run restarted from a step continues the same order.
    #[test]
    fn batches_take_windows_without_replacement_and_resume_in_order() {
        let seq = 4;
        let corpus = Corpus::from_tokens(Tokens::U32((0..41 * 5).collect()), source("x"), seq, usize::MAX, 0.0).unwrap();
        assert_eq!(corpus.train_windows(), 41);
        let rows = 3;
        let mut starts = Vec::new();
        for step in 1..=13 {
            let (tokens, targets) = corpus.batch(7, step, rows);
            for r in 0..rows {
                let (t, g) = (&tokens[r * seq..(r + 1) * seq], &targets[r * seq..(r + 1) * seq]);
                assert_eq!(t[0] % 5, 0, "a window starts at a multiple of seq + 1");
                assert_eq!(t.iter().map(|x| x + 1).collect::<Vec<_>>(), g);
                starts.push(t[0]);
            }
        }
        // 39 samples of an epoch of 41 windows: no window twice.
        let mut unique = starts.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), starts.len());
        // A run resumed after step 5 (15 samples) continues at step 6.
        let mut resumed = corpus.clone();
        resumed.start_at(5, corpus.record(5, rows).samples);
        assert_eq!(resumed.batch(7, 6, rows), corpus.batch(7, 6, rows));
        // With another batch size after resuming, the next samples follow the consumed ones.
        resumed.start_at(5, 15);
        let (t, _) = resumed.batch(7, 6, 2);
        assert_eq!(t[0], corpus.batch(7, 6, 3).0[0]);
        let record = corpus.record(14, rows);
        assert_eq!((record.samples, record.epoch, record.window), (42, 1, 5));
    }

    #[test]
    fn validation_windows_are_the_held_out_tail() {
        let corpus = Corpus::from_tokens(Tokens::U32((0..100 * 3).collect()), source("x"), 2, usize::MAX, 0.05).unwrap();
        assert_eq!((corpus.train_windows(), corpus.validation_windows()), (95, 5));
        let (t, g) = corpus.validation_batch(0, 5);
        assert_eq!(t, (95..100).flat_map(|w| [3 * w, 3 * w + 1]).collect::<Vec<i32>>());
        assert_eq!(g, (95..100).flat_map(|w| [3 * w + 1, 3 * w + 2]).collect::<Vec<i32>>());
    }

    /// Manifests from before the data record load, without it; new ones round-trip it.
    #[test]
    fn manifests_with_and_without_a_data_record_load() {
        let old = r#"{"format_version": 1, "step": 20, "seed": 3, "mesh": [1], "spec": {}, "tensors": [], "files": ["rank-00000.safetensors"]}"#;
        let manifest: crate::checkpoint::Manifest = serde_json::from_str(old).unwrap();
        assert_eq!(manifest.data, None);
        let corpus = Corpus::from_tokens(Tokens::U16((0..100).collect()), source("train.bin"), 4, 512, 0.1).unwrap();
        let with = crate::checkpoint::Manifest { data: Some(corpus.record(3, 2)), ..manifest };
        let text = serde_json::to_string(&with).unwrap();
        assert!(text.contains("\"samples\":6") && text.contains("train.bin"), "{text}");
        assert_eq!(serde_json::from_str::<crate::checkpoint::Manifest>(&text).unwrap(), with);
    }

    #[test]
    fn the_fingerprint_follows_the_ids_not_the_file_format() {
        let ids: Vec<u16> = (0..600).map(|i| i % 300).collect();
        let a = Corpus::from_tokens(Tokens::U16(ids.clone()), source("a"), 4, 512, 0.0).unwrap();
        let b = Corpus::from_tokens(Tokens::U32(ids.iter().map(|&i| i as u32).collect()), source("b"), 4, 512, 0.0).unwrap();
        assert_eq!(a.identity().fingerprint, b.identity().fingerprint);
        let mut other = ids;
        other[10] = 11;
        let c = Corpus::from_tokens(Tokens::U16(other), source("c"), 4, 512, 0.0).unwrap();
        assert_ne!(a.identity().fingerprint, c.identity().fingerprint);
    }
}
