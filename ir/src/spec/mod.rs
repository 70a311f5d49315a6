//! Model specs: the frontend's input.
//!
//! A spec is a TOML or JSON file with a `[model]` section (architecture) and a `[training]`
//! section (sequence length and batch sizes); see `models/*.toml`. Parsing never stops at the
//! first problem: [`parse`] returns every error it finds, each naming the field, carrying the
//! byte span of the field in the source and saying how to fix it. The CLI renders them with
//! miette; this crate stays free of rendering.

pub mod hf;
mod locate;
mod lower;

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::types::DType;

pub use lower::{lower, lower_logits, LowerError};

/// Most layers a spec may have: the frontend builds every layer's ops, and the deepest
/// published models have around a hundred and fifty.
pub const MAX_LAYERS: u64 = 4096;

/// Largest size accepted for any dimension. Bigger values are surely typos, and keeping every
/// product of two or three sizes inside `i64`/`f64` range keeps the arithmetic exact.
pub const MAX_DIM: u64 = 1 << 31;

/// Most elements one tensor of a step may have: 2^48, a petabyte of f32, far beyond any
/// device yet small enough that a tensor's bytes (at most 8 per element, 2^51) and sums of a
/// few thousand such tensors stay inside `u64`/`usize` arithmetic. Sizes that each pass
/// [`MAX_DIM`] can still multiply past this (a `hidden` of 2^31 makes a `[hidden, hidden]`
/// weight of 2^62 elements): [`check`] and [`Spec::batch`] refuse them, naming the field.
pub const MAX_TENSOR_ELEMENTS: u64 = 1 << 48;

/// A whole spec file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// Display name, e.g. `gpt2-small`.
    pub name: String,
    /// The architecture.
    pub model: ModelSpec,
    /// Sequence length and batch sizes of a training step.
    pub training: TrainingSpec,
}

/// Normalisation layer kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Norm {
    /// LayerNorm with learned scale and shift (GPT).
    LayerNorm,
    /// RMSNorm with learned scale (Llama).
    RmsNorm,
}

/// MLP kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// `down(gelu(up(x)))` (GPT).
    Gelu,
    /// `down(silu(gate(x)) * up(x))` (Llama).
    Swiglu,
}

/// Position encoding kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Positions {
    /// A learned `[max_seq, hidden]` table added to the token embeddings (GPT).
    Learned,
    /// Rotary embedding of queries and keys (Llama).
    Rope,
}

/// Training data types the frontend accepts for parameters and activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecDType {
    /// 32-bit floats.
    F32,
    /// bfloat16.
    Bf16,
    /// 64-bit floats (gradient checks).
    F64,
}

impl From<SpecDType> for DType {
    fn from(d: SpecDType) -> DType {
        match d {
            SpecDType::F32 => DType::F32,
            SpecDType::Bf16 => DType::Bf16,
            SpecDType::F64 => DType::F64,
        }
    }
}

fn default_eps() -> f64 {
    1e-5
}
fn default_theta() -> f64 {
    10000.0
}
fn default_dtype() -> SpecDType {
    SpecDType::F32
}

/// Megatron-LM's default `make-vocab-size-divisible-by`.
pub const DEFAULT_VOCAB_MULTIPLE: u64 = 128;

fn default_vocab_multiple() -> u64 {
    DEFAULT_VOCAB_MULTIPLE
}

/// The architecture of a GPT- or Llama-style decoder-only transformer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Vocabulary size.
    pub vocab: u64,
    /// Longest sequence the model supports (size of the learned position table).
    pub max_seq: u64,
    /// Hidden (model) dimension.
    pub hidden: u64,
    /// Number of transformer layers.
    pub layers: u64,
    /// Attention (query) heads.
    pub heads: u64,
    /// Key/value heads (grouped-query attention); defaults to `heads`.
    #[serde(default)]
    pub kv_heads: Option<u64>,
    /// Inner dimension of the MLP.
    pub ffn_hidden: u64,
    /// Normalisation layer.
    pub norm: Norm,
    /// MLP kind.
    pub activation: Activation,
    /// Position encoding.
    pub positions: Positions,
    /// Whether linear layers (and LayerNorm) carry biases.
    #[serde(default)]
    pub linear_bias: bool,
    /// Whether the LM head reuses the token embedding table.
    #[serde(default)]
    pub tied_embeddings: bool,
    /// Epsilon of the normalisation layers.
    #[serde(default = "default_eps")]
    pub norm_eps: f64,
    /// Base of the rotary embedding's frequencies.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Parameter and activation type.
    #[serde(default = "default_dtype")]
    pub dtype: SpecDType,
    /// The embedding table and LM head are padded to a multiple of `vocab_multiple x tp`
    /// rows (Megatron-LM's `make-vocab-size-divisible-by`, default 128), so that tensor
    /// parallelism splits the vocabulary whatever its size. Padded logits never enter the
    /// softmax or the loss, and padded rows stay zero.
    #[serde(default = "default_vocab_multiple")]
    pub vocab_multiple: u64,
    /// Mixture-of-experts MLPs (absent: every MLP is dense).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeSpec>,
}

fn default_aux_loss_weight() -> f64 {
    0.01
}
fn default_every() -> u64 {
    1
}

/// Mixture-of-experts MLPs: which layers have them, and how tokens are routed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeSpec {
    /// Routed experts per MoE layer.
    pub experts: u64,
    /// Experts each token is sent to (top-k gating).
    pub top_k: u64,
    /// Inner dimension of each expert's MLP; defaults to the model's `ffn_hidden`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_ffn_hidden: Option<u64>,
    /// Shared experts every token goes through besides its routed ones (Qwen-MoE,
    /// DeepSeek), as one dense MLP of `shared_experts x expert_ffn_hidden`.
    #[serde(default)]
    pub shared_experts: u64,
    /// Leading layers that stay dense (DeepSeek's `first_k_dense_replace`).
    #[serde(default)]
    pub first_dense: u64,
    /// After those, every `every`-th layer is MoE (Megatron's `moe-layer-freq`); 1: all.
    #[serde(default = "default_every")]
    pub every: u64,
    /// Weight of the load-balancing loss added to the language-model loss.
    #[serde(default = "default_aux_loss_weight")]
    pub aux_loss_weight: f64,
    /// Slots per expert and sequence as a multiple of the even share `seq_len x top_k /
    /// experts`: choices past it are dropped. Absent: dropless routing (every choice is kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_factor: Option<f64>,
}

impl MoeSpec {
    /// Inner dimension of each expert's MLP.
    pub fn expert_ffn(&self, model_ffn: u64) -> u64 {
        self.expert_ffn_hidden.unwrap_or(model_ffn)
    }

    /// Whether layer `layer` (from 0) has a MoE MLP.
    pub fn is_moe_layer(&self, layer: u64) -> bool {
        layer >= self.first_dense && (layer - self.first_dense).is_multiple_of(self.every.max(1))
    }

    /// Slots of each expert's buffer per sequence of `seq` tokens: `seq` when dropless (an
    /// expert can receive each token at most once), else `ceil(capacity_factor x seq x top_k
    /// / experts)`, at least 1 and at most `seq`.
    pub fn capacity(&self, seq: u64) -> u64 {
        match self.capacity_factor {
            None => seq,
            Some(factor) => {
                let even = seq as f64 * self.top_k as f64 / self.experts.max(1) as f64;
                ((factor * even).ceil() as u64).clamp(1, seq.max(1))
            }
        }
    }
}

impl ModelSpec {
    /// Key/value heads, with the default applied.
    pub fn kv_heads(&self) -> u64 {
        self.kv_heads.unwrap_or(self.heads)
    }

    /// Dimension of one attention head.
    pub fn head_dim(&self) -> u64 {
        self.hidden / self.heads.max(1)
    }

    /// The vocabulary padded for `tp`-way tensor parallelism: the next multiple of
    /// `vocab_multiple x tp`.
    pub fn padded_vocab(&self, tp: u64) -> u64 {
        let multiple = self.vocab_multiple.max(1).saturating_mul(tp.max(1));
        self.vocab.div_ceil(multiple).saturating_mul(multiple)
    }
}

/// Shape of one training step, in Megatron-LM's terms: `micro_batch` sequences per
/// data-parallel replica in each forward pass, `global_batch = micro_batch x dp x
/// micro-batches` sequences per optimizer step (see [`Spec::batch`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingSpec {
    /// Tokens per sequence; defaults to the model's `max_seq`.
    #[serde(default)]
    pub seq_len: Option<u64>,
    /// Sequences per micro-batch on each data-parallel replica (what one replica's forward
    /// pass sees).
    pub micro_batch: u64,
    /// Sequences per optimizer step over all data-parallel replicas and micro-batches;
    /// defaults to one micro-batch per replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<u64>,
}

/// The batch of one optimizer step on a mesh: `global_batch = micro_batch x dp x
/// microbatches`, the same meaning as Megatron-LM's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// Sequences per micro-batch on each data-parallel replica.
    pub micro_batch: u64,
    /// Data-parallel replicas.
    pub dp: u64,
    /// Micro-batches per optimizer step (gradient accumulation, the pipeline's m).
    pub microbatches: u64,
    /// Sequences per optimizer step.
    pub global_batch: u64,
}

impl Batch {
    /// Rows of one micro-batch over all replicas: the batch dimension of the lowered step.
    pub fn rows(&self) -> u64 {
        self.micro_batch * self.dp
    }
}

/// How a step is lowered for a mesh: the rows of a micro-batch and the vocabulary as padded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    /// Rows of one micro-batch over all data-parallel replicas (`micro_batch x dp`).
    pub rows: u64,
    /// Rows of the embedding table and columns of the LM head: the vocabulary padded to a
    /// multiple of `vocab_multiple x tp` (Megatron's `make-vocab-size-divisible-by`).
    pub padded_vocab: u64,
    /// The order of the sequence inside the step: 1 for the natural order, else the number
    /// of chunks of its zigzag order (`2 x cp` under context parallelism, so that each cp
    /// rank's part holds one early and one late chunk; see `ops::zigzag_position`).
    pub sequence_chunks: u64,
}

impl Spec {
    /// Sequence length of a step, with the default applied.
    pub fn seq_len(&self) -> u64 {
        self.training.seq_len.unwrap_or(self.model.max_seq)
    }

    /// The step's batch on `dp` replicas. `microbatches` (a command line's
    /// `--microbatches`), when given, sets the global batch unless `global_batch` (a
    /// command line's `--global-batch`) is given too, and then they must agree; otherwise the
    /// micro-batches are derived from the global batch (`global_batch` or the spec's),
    /// which must then be a multiple of `micro_batch x dp`. The error names all three numbers
    /// and a fix.
    pub fn batch(&self, dp: u64, microbatches: Option<u64>, global_batch: Option<u64>) -> Result<Batch, SpecError> {
        let mb = self.training.micro_batch;
        let dp = dp.max(1);
        let per_micro = mb.checked_mul(dp).filter(|&r| r > 0 && r <= MAX_DIM);
        let fail = |message: String, help: String| SpecError { field: "training.global_batch".into(), message, help: Some(help), span: None };
        let Some(per_micro) = per_micro else {
            return Err(fail(format!("micro_batch ({mb}) x dp ({dp}) is out of range"), "use a micro-batch of at least 1 and a smaller dp".into()));
        };
        if let Some(e) = self.tensor_size_errors(per_micro, self.model.padded_vocab(1)).into_iter().next() {
            return Err(e);
        }
        match (microbatches, global_batch.or(self.training.global_batch)) {
            (Some(m), _) => {
                let global = per_micro.checked_mul(m).filter(|&g| g <= MAX_DIM && m > 0).ok_or_else(|| fail(format!("{m} micro-batches of micro_batch ({mb}) x dp ({dp}) sequences is out of range"), "use fewer micro-batches".into()))?;
                match global_batch {
                    Some(g) if g != global => Err(fail(
                        format!("global batch {g} is not micro-batch {mb} x dp {dp} x {m} micro-batches = {global}"),
                        format!("give --global-batch {global}, or leave out --microbatches to derive it ({g} / ({mb} x {dp}))"),
                    )),
                    _ => Ok(Batch { micro_batch: mb, dp, microbatches: m, global_batch: global }),
                }
            }
            (None, None) => Ok(Batch { micro_batch: mb, dp, microbatches: 1, global_batch: per_micro }),
            (None, Some(g)) => {
                if g == 0 || !g.is_multiple_of(per_micro) {
                    let lower = (g / per_micro).max(1) * per_micro;
                    return Err(fail(
                        format!("global batch {g} is not a multiple of micro-batch {mb} x dp {dp} = {per_micro} sequences"),
                        format!("use a global batch of {lower} or {} (--global-batch), a micro-batch that divides {g} / {dp}, or give --microbatches", lower + per_micro),
                    ));
                }
                Ok(Batch { micro_batch: mb, dp, microbatches: g / per_micro, global_batch: g })
            }
        }
    }

    /// How the step is lowered for `mesh`: `micro_batch x dp` rows, and the vocabulary padded
    /// for its tensor parallelism.
    pub fn step_shape(&self, mesh: &crate::mesh::Mesh) -> StepShape {
        let sequence_chunks = if mesh.cp > 1 { mesh.cp.saturating_mul(2) } else { 1 };
        StepShape { rows: self.training.micro_batch.saturating_mul(mesh.dp.max(1)), padded_vocab: self.model.padded_vocab(mesh.tp), sequence_chunks }
    }

    /// The step's tensors that would have more than [`MAX_TENSOR_ELEMENTS`] elements with
    /// `rows` rows per micro-batch (`micro_batch x dp`), each as an error naming the field to
    /// change. The sizes must be positive and at most [`MAX_DIM`] each (products are taken in
    /// `u128`, so they cannot overflow). The vocabulary is padded for tp = 1: tensor
    /// parallelism pads it by at most `vocab_multiple x tp` rows, which the limit's headroom
    /// below `u64` absorbs.
    fn tensor_size_errors(&self, rows: u64, padded_vocab: u64) -> Vec<SpecError> {
        let m = &self.model;
        let seq = self.seq_len();
        // The sequence or the batch, whichever is the larger factor, is the one to name.
        let batch_field = if seq > rows { "training.seq_len" } else { "training.micro_batch" };
        let batch_help = "use a smaller micro_batch or seq_len (or fewer data-parallel replicas)";
        let mut tensors: Vec<(&str, String, Vec<u64>, &str)> = vec![
            ("model.vocab", "the embedding table [vocab, hidden]".into(), vec![padded_vocab, m.hidden], "use a smaller vocab or hidden size"),
            ("model.hidden", "an attention projection [hidden, hidden]".into(), vec![m.hidden, m.hidden], "use a smaller hidden size"),
            ("model.ffn_hidden", "an MLP weight [hidden, ffn_hidden]".into(), vec![m.hidden, m.ffn_hidden], "use a smaller ffn_hidden or hidden size"),
            (batch_field, "a micro-batch's activations [micro_batch x dp, seq_len, hidden]".into(), vec![rows, seq, m.hidden], batch_help),
            (batch_field, "a micro-batch's MLP activations [micro_batch x dp, seq_len, ffn_hidden]".into(), vec![rows, seq, m.ffn_hidden], batch_help),
            (batch_field, "a micro-batch's logits [micro_batch x dp, seq_len, vocab]".into(), vec![rows, seq, padded_vocab], batch_help),
        ];
        if let Some(moe) = m.moe.as_ref().filter(|moe| moe.experts <= MAX_EXPERTS && moe.expert_ffn(m.ffn_hidden) <= MAX_DIM) {
            let ffn = moe.expert_ffn(m.ffn_hidden);
            tensors.push(("model.moe.experts", "an MoE layer's expert weights [experts, hidden, expert_ffn_hidden]".into(), vec![moe.experts, m.hidden, ffn], "use fewer experts or a smaller expert_ffn_hidden"));
            tensors.push((batch_field, "a micro-batch's expert buffers [experts, micro_batch x dp, capacity, expert_ffn_hidden]".into(), vec![moe.experts, rows, moe.capacity(seq), ffn.max(m.hidden)], batch_help));
            if moe.shared_experts > 0 {
                tensors.push(("model.moe.shared_experts", "the shared experts' weight [hidden, shared_experts x expert_ffn_hidden]".into(), vec![m.hidden, moe.shared_experts.saturating_mul(ffn)], "use fewer shared experts or a smaller expert_ffn_hidden"));
                tensors.push((batch_field, "a micro-batch's shared-expert activations [micro_batch x dp, seq_len, shared_experts x expert_ffn_hidden]".into(), vec![rows, seq, moe.shared_experts.saturating_mul(ffn)], batch_help));
            }
        }
        if m.positions == Positions::Learned {
            tensors.push(("model.max_seq", "the position table [max_seq, hidden]".into(), vec![m.max_seq, m.hidden], "use a smaller max_seq or hidden size"));
        }
        let mut errors: Vec<SpecError> = Vec::new();
        for (field, what, dims, help) in tensors {
            let elements = dims.iter().fold(1u128, |acc, &d| acc.saturating_mul(d as u128));
            // One error per field: the first (largest-scope) tensor says enough.
            if elements > MAX_TENSOR_ELEMENTS as u128 && !errors.iter().any(|e| e.field == field) {
                let shape = dims.iter().map(u64::to_string).collect::<Vec<_>>().join(" x ");
                errors.push(SpecError {
                    field: field.to_string(),
                    message: format!("{what} would be {shape} = {elements} elements, more than the {MAX_TENSOR_ELEMENTS} (2^48) one tensor may have"),
                    help: Some(help.to_string()),
                    span: None,
                });
            }
        }
        errors
    }
}

/// Input format of a spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// TOML.
    Toml,
    /// JSON.
    Json,
}

impl Format {
    /// The format a file name implies, by extension; TOML unless it ends in `.json`.
    pub fn from_path(path: &str) -> Format {
        if path.to_ascii_lowercase().ends_with(".json") { Format::Json } else { Format::Toml }
    }
}

/// One problem with a spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    /// Dotted path of the field, e.g. `model.heads` (empty when the file does not parse).
    pub field: String,
    /// What is wrong.
    pub message: String,
    /// How to fix it.
    pub help: Option<String>,
    /// Byte range of the field (key and value) in the source, when it can be located.
    pub span: Option<Range<usize>>,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() { write!(f, "{}", self.message) } else { write!(f, "{}: {}", self.field, self.message) }
    }
}

/// Every problem found in one spec file, with the source they point into.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct SpecErrors {
    /// File name, for display.
    pub source_name: String,
    /// The file's text.
    pub text: String,
    /// The problems, in source order where known.
    pub errors: Vec<SpecError>,
}

impl fmt::Display for SpecErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.errors.len();
        write!(f, "invalid model spec {}: {n} error{}", self.source_name, if n == 1 { "" } else { "s" })?;
        for e in &self.errors {
            write!(f, "\n  {e}")?;
            if let Some(help) = &e.help {
                write!(f, " (help: {help})")?;
            }
        }
        Ok(())
    }
}

/// Parses and validates a spec. `source_name` is only used in messages.
pub fn parse(source: &str, format: Format, source_name: &str) -> Result<Spec, SpecErrors> {
    let fail = |errors: Vec<SpecError>| SpecErrors { source_name: source_name.to_string(), text: source.to_string(), errors };
    let spec = deserialize(source, format).map_err(|e| fail(vec![e]))?;
    let mut errors = validate(&spec);
    if errors.is_empty() {
        return Ok(spec);
    }
    for e in &mut errors {
        e.span = locate::field_span(source, format, &e.field);
    }
    errors.sort_by_key(|e| e.span.as_ref().map_or(usize::MAX, |s| s.start));
    Err(fail(errors))
}

/// Largest spec file read: specs are a few hundred bytes, and a file far larger (a wrong
/// path, `/dev/zero`) is refused before it fills memory or the error renderer.
pub const MAX_SPEC_BYTES: u64 = 16 << 20;

/// Reads a spec from a file, choosing the format by extension. Reads at most
/// [`MAX_SPEC_BYTES`]; a longer file (or one that never ends) is an error saying so.
pub fn parse_file(path: &std::path::Path) -> Result<Spec, SpecErrors> {
    use std::io::Read;
    let name = path.display().to_string();
    let fail = |message: String, help: Option<String>| SpecErrors { source_name: name.clone(), text: String::new(), errors: vec![SpecError { field: String::new(), message, help, span: None }] };
    let mut bytes = Vec::new();
    let read = std::fs::File::open(path).and_then(|file| file.take(MAX_SPEC_BYTES + 1).read_to_end(&mut bytes));
    if let Err(e) = read {
        return Err(fail(format!("cannot read {name}: {e}"), None));
    }
    if bytes.len() as u64 > MAX_SPEC_BYTES {
        return Err(fail(
            format!("{name} is larger than {} MiB, the most a spec file may be", MAX_SPEC_BYTES >> 20),
            Some("give a model spec (see models/*.toml); specs are a few hundred bytes".into()),
        ));
    }
    match String::from_utf8(bytes) {
        Ok(text) => parse(&text, Format::from_path(&name), &name),
        Err(e) => Err(fail(format!("cannot read {name}: not UTF-8 text ({e})"), Some("give a TOML or JSON model spec".into()))),
    }
}

/// Deserializes, turning serde's first error into a [`SpecError`] with the field path.
fn deserialize(source: &str, format: Format) -> Result<Spec, SpecError> {
    let help = |message: &str| -> Option<String> {
        let text = if message.contains("unknown field") {
            "remove the field or fix its spelling; the accepted fields are listed above"
        } else if message.contains("missing field") {
            "add the field; every size must be given explicitly (see models/tiny.toml)"
        } else if message.contains("unknown variant") {
            "use one of the values listed above"
        } else if message.contains("expected u64") {
            "sizes are positive whole numbers, e.g. 768"
        } else if message.contains("expected f64") {
            "give a number, e.g. 1e-5"
        } else if message.contains("expected a boolean") {
            "write true or false"
        } else {
            return None;
        };
        Some(text.to_string())
    };
    match format {
        Format::Toml => {
            let de = toml::Deserializer::parse(source).map_err(|e| SpecError {
                field: String::new(),
                message: e.message().to_string(),
                help: None,
                span: e.span(),
            })?;
            serde_path_to_error::deserialize(de).map_err(|e| {
                let field = path_string(e.path());
                let inner = e.into_inner();
                let message = inner.message().to_string();
                let field = missing_field_path(&field, &message);
                let span = inner.span().or_else(|| locate::field_span(source, format, &field)).or(Some(source.len()..source.len()));
                SpecError { help: help(&message), span, field, message }
            })
        }
        Format::Json => {
            let mut de = serde_json::Deserializer::from_str(source);
            serde_path_to_error::deserialize(&mut de).map_err(|e| {
                let field = path_string(e.path());
                let inner = e.into_inner();
                let offset = line_col_to_offset(source, inner.line(), inner.column());
                // serde_json appends " at line L column C"; the span already says where.
                let message = inner.to_string();
                let message = message.split(" at line ").next().unwrap_or(&message).to_string();
                let field = missing_field_path(&field, &message);
                // A syntax error is best shown where the parser stopped; a type error at the field.
                let at_parser = offset.saturating_sub(1)..offset.min(source.len());
                let span = if inner.is_syntax() || inner.is_eof() {
                    at_parser
                } else {
                    locate::field_span(source, format, &field).unwrap_or(at_parser)
                };
                SpecError { help: help(&message), span: Some(span), field, message }
            })
        }
    }
}

/// Dotted field path; `.` (serde_path_to_error's root) becomes empty, and the `?` it writes
/// for a key it could not read is dropped.
fn path_string(path: &serde_path_to_error::Path) -> String {
    let text = path.to_string();
    let text = text.trim_end_matches(".?").trim_end_matches('?');
    if text == "." { String::new() } else { text.to_string() }
}

/// For "missing field `x`" at the root, the path of the missing field itself (`training`), so
/// the error names what to add.
fn missing_field_path(field: &str, message: &str) -> String {
    match message.strip_prefix("missing field `").and_then(|rest| rest.split('`').next()) {
        Some(missing) if field.is_empty() => missing.to_string(),
        _ => field.to_string(),
    }
}

/// Byte offset of a 1-based line and column.
fn line_col_to_offset(source: &str, line: usize, column: usize) -> usize {
    let line_start: usize = source.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum();
    (line_start + column.saturating_sub(1)).min(source.len())
}

/// Re-checks a spec changed after parsing (command-line overrides such as `--seq`); errors
/// carry no spans, as the values did not come from the file.
pub fn check(spec: &Spec) -> Vec<SpecError> {
    validate(spec)
}

/// Checks the relations between fields that types alone cannot express.
fn validate(spec: &Spec) -> Vec<SpecError> {
    let mut errors = Vec::new();
    let mut error = |field: &str, message: String, help: String| {
        errors.push(SpecError { field: field.to_string(), message, help: Some(help), span: None });
    };
    let m = &spec.model;
    let t = &spec.training;
    // The name is printed in every summary: control characters (terminal escapes) would act
    // on the user's terminal instead of being shown.
    if spec.name.chars().any(char::is_control) {
        error("name", "contains control characters (such as terminal escape codes)".into(), "use printable characters".into());
    } else if spec.name.chars().count() > 200 {
        error("name", format!("is {} characters long", spec.name.chars().count()), "use a name of at most 200 characters".into());
    }
    let sizes = [
        ("model.vocab", m.vocab),
        ("model.max_seq", m.max_seq),
        ("model.hidden", m.hidden),
        ("model.layers", m.layers),
        ("model.heads", m.heads),
        ("model.kv_heads", m.kv_heads()),
        ("model.ffn_hidden", m.ffn_hidden),
        ("model.vocab_multiple", m.vocab_multiple),
        ("training.seq_len", spec.seq_len()),
        ("training.micro_batch", t.micro_batch),
        ("training.global_batch", t.global_batch.unwrap_or(t.micro_batch)),
    ];
    let mut sizes_ok = true;
    for (field, value) in sizes {
        if value == 0 {
            error(field, "must be at least 1".into(), "give a positive size".into());
            sizes_ok = false;
        } else if value > MAX_DIM {
            error(field, format!("{value} exceeds the largest supported size {MAX_DIM}"), "check the value for a typo".into());
            sizes_ok = false;
        }
    }
    if sizes_ok && m.layers > MAX_LAYERS {
        error("model.layers", format!("{} layers exceed the supported maximum of {MAX_LAYERS}", m.layers), "check the value for a typo".into());
        sizes_ok = false;
    }
    if !sizes_ok {
        // The relations below divide by these sizes.
        return errors;
    }
    if !m.hidden.is_multiple_of(m.heads) {
        let suggestion = (1..=m.heads).rev().find(|h| m.hidden.is_multiple_of(*h)).unwrap_or(1);
        error(
            "model.heads",
            format!("hidden ({}) must be divisible by heads ({})", m.hidden, m.heads),
            format!("use a number of heads that divides hidden, e.g. {suggestion}"),
        );
    } else if m.positions == Positions::Rope && !m.head_dim().is_multiple_of(2) {
        error(
            "model.heads",
            format!("rotary embedding needs an even head dimension, but hidden / heads = {}", m.head_dim()),
            "choose heads so that hidden / heads is even".into(),
        );
    }
    if !m.heads.is_multiple_of(m.kv_heads()) {
        error(
            "model.kv_heads",
            format!("heads ({}) must be a multiple of kv_heads ({})", m.heads, m.kv_heads()),
            "kv_heads must divide heads (equal to heads for multi-head attention)".into(),
        );
    }
    if spec.seq_len() > m.max_seq {
        error(
            "training.seq_len",
            format!("seq_len ({}) exceeds the model's max_seq ({})", spec.seq_len(), m.max_seq),
            "lower seq_len or raise model.max_seq".into(),
        );
    }
    if let Some(global) = t.global_batch
        && !global.is_multiple_of(t.micro_batch)
    {
        error(
            "training.global_batch",
            format!("global_batch ({global}) is not a multiple of micro_batch ({}): it is micro_batch x dp x micro-batches", t.micro_batch),
            format!("make global_batch a multiple of micro_batch, e.g. {}", global.div_ceil(t.micro_batch) * t.micro_batch),
        );
    }
    if m.vocab_multiple > 1 << 16 {
        error("model.vocab_multiple", format!("{} is larger than the supported 65536", m.vocab_multiple), "Megatron's default is 128; use 1 for no padding".into());
    }
    if !(m.norm_eps > 0.0 && m.norm_eps < 1.0) {
        error("model.norm_eps", format!("must be in (0, 1), got {}", m.norm_eps), "typical values are 1e-5 or 1e-6".into());
    }
    if !(m.rope_theta > 1.0 && m.rope_theta.is_finite()) {
        error("model.rope_theta", format!("must be greater than 1, got {}", m.rope_theta), "the usual base is 10000".into());
    }
    if m.norm == Norm::RmsNorm && m.linear_bias {
        // Not a contradiction in itself, but no model family we import combines them and the
        // frontend would silently drop the norm bias: say so instead.
        error(
            "model.linear_bias",
            "rmsnorm has no bias, and biased linears with rmsnorm are not a supported family".into(),
            "set linear_bias = false for Llama-style models".into(),
        );
    }
    if let Some(moe) = &m.moe {
        validate_moe(moe, m, &mut error);
    }
    // Sizes that each pass can still multiply into tensors no arithmetic should hold.
    errors.extend(spec.tensor_size_errors(t.micro_batch, m.padded_vocab(1)));
    errors
}

/// Most routed experts a MoE layer may have (DeepSeek-V3 has 256).
pub const MAX_EXPERTS: u64 = 1 << 16;

fn validate_moe(moe: &MoeSpec, m: &ModelSpec, error: &mut impl FnMut(&str, String, String)) {
    if moe.experts == 0 || moe.experts > MAX_EXPERTS {
        error("model.moe.experts", format!("must be from 1 to {MAX_EXPERTS}, got {}", moe.experts), "Mixtral has 8 experts, DeepSeek-V3 256".into());
    } else if moe.top_k == 0 || moe.top_k > moe.experts {
        error("model.moe.top_k", format!("must be from 1 to the {} experts, got {}", moe.experts, moe.top_k), "Mixtral sends each token to 2 experts".into());
    }
    if moe.expert_ffn(m.ffn_hidden) == 0 || moe.expert_ffn(m.ffn_hidden) > MAX_DIM {
        error("model.moe.expert_ffn_hidden", format!("must be from 1 to {MAX_DIM}, got {}", moe.expert_ffn(m.ffn_hidden)), "give a positive size, or leave it out to use ffn_hidden".into());
    }
    if moe.shared_experts > 64 {
        error("model.moe.shared_experts", format!("{} shared experts is more than the supported 64", moe.shared_experts), "published models have 0 to 2".into());
    }
    if moe.every == 0 || moe.every > MAX_LAYERS {
        error("model.moe.every", format!("must be from 1 to {MAX_LAYERS}, got {}", moe.every), "1 makes every layer after first_dense a MoE layer".into());
    }
    if moe.first_dense >= m.layers {
        error("model.moe.first_dense", format!("{} dense layers leave none of the {} layers for experts", moe.first_dense, m.layers), format!("use first_dense < {}", m.layers));
    }
    if !(moe.aux_loss_weight.is_finite() && (0.0..=1e3).contains(&moe.aux_loss_weight)) {
        error("model.moe.aux_loss_weight", format!("must be a number from 0 to 1000, got {}", moe.aux_loss_weight), "Megatron-LM uses 1e-2, Mixtral 2e-2".into());
    }
    if let Some(factor) = moe.capacity_factor
        && !(factor.is_finite() && factor > 0.0 && factor <= 1e3)
    {
        error("model.moe.capacity_factor", format!("must be a number above 0 (and at most 1000), got {factor}"), "1.0 to 2.0 is usual; leave it out for dropless routing".into());
    }
}
