//! Structured facts about ops that passes, codegen and runtimes read instead of names.
//!
//! A pass decides by these, never by an op's location string or an argument's name: the
//! location (`layers.3.attn.q`) is for people reading dumps and messages.

use serde::{Deserialize, Serialize};

/// A section of a pipeline stage, in execution order within a micro-batch: what runs per
/// micro-batch (forward, backward, weight) and once per global batch (step). Ops carry it as
/// their `xf.phase` attribute once stages are split; a rank program's pipeline plan gives
/// each phase's instruction range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// What the loss needs.
    Forward = 0,
    /// Input gradients (and, unless split off, weight gradients).
    Backward = 1,
    /// Weight gradients, deferred by zero-bubble schedules.
    Weight = 2,
    /// Once per global batch: optimizer updates on the accumulated gradients.
    Step = 3,
}

impl Phase {
    /// Every phase, in order.
    pub const ALL: [Phase; 4] = [Phase::Forward, Phase::Backward, Phase::Weight, Phase::Step];

    /// The `xf.phase` attribute value.
    pub fn label(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Weight => "weight",
            Phase::Step => "step",
        }
    }

    /// Parses an `xf.phase` value.
    pub fn parse(text: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.label() == text)
    }
}

/// The part of the model an op or a parameter belongs to: what pipeline stages are cut
/// between and recomputation replays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Block {
    /// Not placed by the model (a pass's own op; placed by its neighbours).
    #[default]
    Unplaced,
    /// The token and position embeddings.
    Embedding,
    /// Layer N's attention, with its norm and residual add.
    Attention(u32),
    /// Layer N's MLP, with its norm and residual add.
    Mlp(u32),
    /// The final norm, the LM head and the loss.
    Head,
}

impl Block {
    /// Whether the model did not place it.
    pub fn is_unplaced(&self) -> bool {
        *self == Block::Unplaced
    }

    /// The transformer layer, for a layer's blocks.
    pub fn layer(self) -> Option<u32> {
        match self {
            Block::Attention(n) | Block::Mlp(n) => Some(n),
            _ => None,
        }
    }
}

/// What an op computes for the training step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The forward pass (and what a pass adds to it).
    #[default]
    Forward,
    /// A forward op replayed in the backward (activation recomputation).
    Recompute,
    /// Gradients (the backward pass).
    Gradient,
    /// The optimizer: gradient casts, the global norm and clipping, the updates.
    Optimizer,
}

/// Where an op comes from, as structured facts: set where the op is built (the model's
/// lowering, autodiff, the optimizer), carried by every pass that copies it, and read by the
/// passes that need it in place of its location string.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Origin {
    /// The part of the model.
    #[serde(default, skip_serializing_if = "is_default")]
    pub block: Block,
    /// What it computes.
    #[serde(default, skip_serializing_if = "is_default")]
    pub role: Role,
    /// Its result is the residual stream between blocks, or the output of a block about to
    /// join it (the bias add closing a row-parallel linear): what sequence parallelism splits
    /// along the sequence.
    #[serde(default, skip_serializing_if = "is_default")]
    pub residual: bool,
}

fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}

impl Origin {
    /// Whether this is the default (an unplaced forward op).
    pub fn is_default(&self) -> bool {
        *self == Origin::default()
    }

    /// A forward op of `block`.
    pub fn of(block: Block) -> Origin {
        Origin { block, ..Origin::default() }
    }

    /// The same place, in another role.
    pub fn with_role(self, role: Role) -> Origin {
        Origin { role, ..self }
    }
}

/// How tensor parallelism may split a parameter, as the model declares it (Megatron-LM's
/// `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamKind {
    /// Weight `[in, out]` or bias `[out]` of a linear whose outputs split (q, up, gate).
    Column,
    /// The same for the key and value projections: split only when tp divides the key-value
    /// heads (else they are replicated, or expanded to whole heads).
    KeyValue,
    /// Weight `[in, out]` (split `in`) or bias `[out]` (replicated) of a linear whose inputs
    /// split (the attention's output projection, the MLP's down projection).
    Row,
    /// The token embedding table `[vocab, hidden]`: split by vocabulary rows.
    TokenEmbedding,
    /// The LM head `[hidden, vocab]`: split by vocabulary columns.
    LmHead,
    /// Everything tensor parallelism replicates (norms, learned positions, routers).
    Replicated,
    /// Experts' weights `[experts, in, out]` whose outputs split (their up and gate).
    ExpertColumn,
    /// Experts' weights `[experts, in, out]` whose inputs split (their down projection).
    ExpertRow,
}

/// The name of parameter `param`'s optimizer state `state` (`m`, `v`, or `master` for the
/// fp32 master copy): `opt.<state>.<param>`. Arguments, results, initial values and
/// checkpoints name optimizer state so; this and [`state_of`] are the one place that says
/// how.
pub fn state_name(state: &str, param: &str) -> String {
    format!("opt.{state}.{param}")
}

/// The state and the parameter an optimizer-state name ([`state_name`]) stands for.
pub fn state_of(name: &str) -> Option<(&str, &str)> {
    name.strip_prefix("opt.")?.split_once('.')
}

/// The name of parameter `param`'s fp32 master copy.
pub fn master_name(param: &str) -> String {
    state_name("master", param)
}

/// The parameter a master copy belongs to.
pub fn master_of(name: &str) -> Option<&str> {
    state_of(name).and_then(|(state, param)| (state == "master").then_some(param))
}
