//! Hugging Face model configurations (`config.json`) as shardc specs, and back, for the GPT-2
//! and Llama families. Fields shardc cannot honour are refused by name rather than ignored.

use serde_json::{json, Map, Value};

use super::{Activation, ModelSpec, Norm, Positions, Spec, SpecDType, TrainingSpec};

/// The model families shardc reads from Hugging Face.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfFamily {
    /// `GPT2LMHeadModel`: learned positions, LayerNorm, GELU (tanh), biases, Conv1D weights.
    Gpt2,
    /// `LlamaForCausalLM`: RoPE (rotate-half), RMSNorm, SwiGLU, no biases, GQA.
    Llama,
    /// `MixtralForCausalLM`: Llama's attention, every MLP a mixture of SwiGLU experts with
    /// softmax top-k gating, dropless.
    Mixtral,
}

impl HfFamily {
    /// The family of a spec, when it matches one.
    pub fn of(spec: &Spec) -> Option<HfFamily> {
        let m = &spec.model;
        match (m.norm, m.activation, m.positions) {
            (Norm::LayerNorm, Activation::Gelu, Positions::Learned) if m.linear_bias => Some(HfFamily::Gpt2),
            (Norm::RmsNorm, Activation::Swiglu, Positions::Rope) if !m.linear_bias => match &m.moe {
                None => Some(HfFamily::Llama),
                // Mixtral's experts: in every layer, none shared, none dropped.
                Some(moe) if moe.shared_experts == 0 && moe.first_dense == 0 && moe.every == 1 && moe.capacity_factor.is_none() && moe.expert_ffn_hidden.is_none_or(|f| f == m.ffn_hidden) => Some(HfFamily::Mixtral),
                Some(_) => None,
            },
            _ => None,
        }
    }
}

fn field<'a>(config: &'a Map<String, Value>, name: &str) -> Result<&'a Value, String> {
    config.get(name).filter(|v| !v.is_null()).ok_or_else(|| format!("config.json: `{name}` is missing"))
}

fn uint(config: &Map<String, Value>, name: &str) -> Result<u64, String> {
    field(config, name)?.as_u64().filter(|&v| v > 0).ok_or_else(|| format!("config.json: `{name}` must be a positive integer"))
}

fn float(config: &Map<String, Value>, name: &str, default: f64) -> Result<f64, String> {
    match config.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().ok_or_else(|| format!("config.json: `{name}` must be a number")),
    }
}

fn boolean(config: &Map<String, Value>, name: &str, default: bool) -> Result<bool, String> {
    match config.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_bool().ok_or_else(|| format!("config.json: `{name}` must be true or false")),
    }
}

/// Refuses a field whose value shardc would silently compute differently.
fn require(config: &Map<String, Value>, name: &str, ok: impl Fn(&Value) -> bool, why: &str) -> Result<(), String> {
    match config.get(name) {
        Some(v) if !v.is_null() && !ok(v) => Err(format!("config.json: `{name}` = {v} is not supported: {why}")),
        _ => Ok(()),
    }
}

/// The base of RoPE's frequencies, from either layout: `rope_theta` at the top level
/// (transformers 4), or in `rope_parameters` with its `rope_type` (transformers 5); when both
/// are given they must agree. Only the default, unscaled RoPE is implemented: another
/// `rope_type` (llama3, linear, dynamic, yarn, ...), a partial rotary factor, or any
/// `rope_scaling` is refused naming the field, rather than trained with other frequencies
/// than the model's.
fn rope_theta(config: &Map<String, Value>) -> Result<f64, String> {
    require(config, "rope_scaling", |v| v.is_null(), "RoPE scaling (long-context variants) is not implemented")?;
    let number = |value: Option<&Value>, name: &str| match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().filter(|t| t.is_finite()).map(Some).ok_or_else(|| format!("config.json: `{name}` must be a number")),
    };
    let top = number(config.get("rope_theta"), "rope_theta")?;
    let nested = match config.get("rope_parameters") {
        None | Some(Value::Null) => None,
        Some(Value::Object(parameters)) => {
            match parameters.get("rope_type") {
                None | Some(Value::Null) => {}
                Some(Value::String(kind)) if kind == "default" => {}
                Some(other) => {
                    return Err(format!(
                        "config.json: `rope_parameters.rope_type` = {other} is not supported: shardc implements the default RoPE only (no llama3, linear, dynamic or yarn scaling)"
                    ));
                }
            }
            require(parameters, "partial_rotary_factor", |v| v.as_f64() == Some(1.0), "RoPE rotates every dimension of a head in shardc")
                .map_err(|e| e.replace("`partial_rotary_factor`", "`rope_parameters.partial_rotary_factor`"))?;
            number(parameters.get("rope_theta"), "rope_parameters.rope_theta")?
        }
        Some(other) => return Err(format!("config.json: `rope_parameters` = {other} must be an object, e.g. {{\"rope_type\": \"default\", \"rope_theta\": 10000.0}}")),
    };
    match (top, nested) {
        (Some(a), Some(b)) if a != b => Err(format!("config.json: `rope_theta` = {a} and `rope_parameters.rope_theta` = {b} disagree: give one of them")),
        (top, nested) => Ok(nested.or(top).unwrap_or(10000.0)),
    }
}

/// The spec of a Hugging Face `config.json`; `seq_len` and `micro_batch` shape the step.
pub fn from_hf_config(text: &str, name: &str, seq_len: u64, micro_batch: u64) -> Result<(Spec, HfFamily), String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("config.json: {e}"))?;
    let config = value.as_object().ok_or("config.json: not a JSON object")?;
    let model_type = field(config, "model_type")?.as_str().unwrap_or_default().to_string();
    let (model, family) = match model_type.as_str() {
        "gpt2" => {
            let hidden = uint(config, "n_embd")?;
            require(config, "activation_function", |v| matches!(v.as_str(), Some("gelu_new" | "gelu_pytorch_tanh" | "gelu_fast")), "shardc's GELU is the tanh approximation (gelu_new)")?;
            require(config, "scale_attn_weights", |v| v.as_bool() == Some(true), "attention is scaled by 1/sqrt(head_dim)")?;
            require(config, "scale_attn_by_inverse_layer_idx", |v| v.as_bool() == Some(false), "no per-layer attention scaling")?;
            require(config, "reorder_and_upcast_attn", |v| v.as_bool() == Some(false), "no attention reordering")?;
            let ffn = match config.get("n_inner") {
                // Too large a hidden size is refused by the spec check, which names it; the
                // default must not overflow on the way there.
                None | Some(Value::Null) => hidden.saturating_mul(4),
                Some(_) => uint(config, "n_inner")?,
            };
            let heads = uint(config, "n_head")?;
            (
                ModelSpec {
                    vocab: uint(config, "vocab_size")?,
                    max_seq: uint(config, "n_positions")?,
                    hidden,
                    layers: uint(config, "n_layer")?,
                    heads,
                    kv_heads: Some(heads),
                    ffn_hidden: ffn,
                    norm: Norm::LayerNorm,
                    activation: Activation::Gelu,
                    positions: Positions::Learned,
                    linear_bias: true,
                    tied_embeddings: boolean(config, "tie_word_embeddings", true)?,
                    norm_eps: float(config, "layer_norm_epsilon", 1e-5)?,
                    rope_theta: 10000.0,
                    dtype: SpecDType::F32,
                    vocab_multiple: super::DEFAULT_VOCAB_MULTIPLE,
                    moe: None,
                },
                HfFamily::Gpt2,
            )
        }
        "llama" | "mixtral" => {
            let mixtral = model_type == "mixtral";
            require(config, "hidden_act", |v| v.as_str() == Some("silu"), "the Llama MLP is SwiGLU with SiLU")?;
            require(config, "sliding_window", |v| v.is_null(), "attention is full causal attention in shardc (no sliding window)")?;
            require(config, "router_jitter_noise", |v| v.as_f64() == Some(0.0), "the router adds no noise in shardc")?;
            let moe = if mixtral {
                let (experts, top_k) = (uint(config, "num_local_experts")?, uint(config, "num_experts_per_tok")?);
                // Hugging Face's load-balancing loss is top_k times Megatron's (its token
                // fractions sum to top_k), whose normalisation shardc's loss has.
                let coef = float(config, "router_aux_loss_coef", 0.001)?;
                Some(super::MoeSpec { experts, top_k, expert_ffn_hidden: None, shared_experts: 0, first_dense: 0, every: 1, aux_loss_weight: coef * top_k as f64, capacity_factor: None })
            } else {
                None
            };
            require(config, "attention_bias", |v| v.as_bool() == Some(false), "Llama layers have no biases in shardc")?;
            require(config, "mlp_bias", |v| v.as_bool() == Some(false), "Llama layers have no biases in shardc")?;
            require(config, "pretraining_tp", |v| v.as_u64() == Some(1), "sliced pretraining-tp projections are not implemented")?;
            let heads = uint(config, "num_attention_heads")?;
            if let Some(head_dim) = config.get("head_dim").and_then(Value::as_u64)
                && head_dim.checked_mul(heads) != Some(uint(config, "hidden_size")?)
            {
                return Err(format!("config.json: `head_dim` = {head_dim} is not hidden_size / num_attention_heads; shardc derives it"));
            }
            (
                ModelSpec {
                    vocab: uint(config, "vocab_size")?,
                    max_seq: uint(config, "max_position_embeddings")?,
                    hidden: uint(config, "hidden_size")?,
                    layers: uint(config, "num_hidden_layers")?,
                    heads,
                    kv_heads: Some(match config.get("num_key_value_heads") {
                        None | Some(Value::Null) => heads,
                        Some(_) => uint(config, "num_key_value_heads")?,
                    }),
                    ffn_hidden: uint(config, "intermediate_size")?,
                    norm: Norm::RmsNorm,
                    activation: Activation::Swiglu,
                    positions: Positions::Rope,
                    linear_bias: false,
                    tied_embeddings: boolean(config, "tie_word_embeddings", false)?,
                    norm_eps: float(config, "rms_norm_eps", 1e-6)?,
                    rope_theta: rope_theta(config)?,
                    dtype: SpecDType::F32,
                    vocab_multiple: super::DEFAULT_VOCAB_MULTIPLE,
                    moe,
                },
                if mixtral { HfFamily::Mixtral } else { HfFamily::Llama },
            )
        }
        other => return Err(format!("config.json: model_type `{other}` is not supported (shardc reads gpt2, llama and mixtral)")),
    };
    let seq_len = seq_len.min(model.max_seq);
    let spec = Spec { name: name.to_string(), model, training: TrainingSpec { seq_len: Some(seq_len), micro_batch, global_batch: None } };
    Ok((spec, family))
}

/// The Hugging Face `config.json` of a spec of one of the families.
pub fn to_hf_config(spec: &Spec) -> Result<Value, String> {
    let m = &spec.model;
    match HfFamily::of(spec) {
        Some(HfFamily::Gpt2) => Ok(json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": m.vocab,
            "n_positions": m.max_seq,
            "n_ctx": m.max_seq,
            "n_embd": m.hidden,
            "n_layer": m.layers,
            "n_head": m.heads,
            "n_inner": m.ffn_hidden,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": m.norm_eps,
            "tie_word_embeddings": m.tied_embeddings,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "torch_dtype": "float32",
        })),
        Some(family @ (HfFamily::Llama | HfFamily::Mixtral)) => {
            let mut config = json!({
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": m.vocab,
                "max_position_embeddings": m.max_seq,
                "hidden_size": m.hidden,
                "intermediate_size": m.ffn_hidden,
                "num_hidden_layers": m.layers,
                "num_attention_heads": m.heads,
                "num_key_value_heads": m.kv_heads(),
                "hidden_act": "silu",
                "rms_norm_eps": m.norm_eps,
                "rope_theta": m.rope_theta,
                "tie_word_embeddings": m.tied_embeddings,
                "torch_dtype": "float32",
            });
            let extra = match (family, &m.moe) {
                (HfFamily::Mixtral, Some(moe)) => json!({
                    "architectures": ["MixtralForCausalLM"],
                    "model_type": "mixtral",
                    "num_local_experts": moe.experts,
                    "num_experts_per_tok": moe.top_k,
                    // Hugging Face's load-balancing loss is top_k times shardc's.
                    "router_aux_loss_coef": moe.aux_loss_weight / moe.top_k as f64,
                    "router_jitter_noise": 0.0,
                    "sliding_window": null,
                    "output_router_logits": false,
                }),
                _ => json!({ "attention_bias": false, "mlp_bias": false }),
            };
            if let (Some(config), Value::Object(extra)) = (config.as_object_mut(), extra) {
                config.extend(extra);
            }
            Ok(config)
        }
        None => Err(format!("`{}` is neither GPT-2-shaped (layernorm, gelu, learned positions, biases) nor Llama-shaped (rmsnorm, swiglu, rope, no biases; with experts, Mixtral's: in every layer, none shared, dropless)", spec.name)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Llama config with `rope` merged into tiny-llama's fields.
    fn llama(rope: Value) -> String {
        let mut config = json!({
            "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
        });
        config.as_object_mut().unwrap().extend(rope.as_object().unwrap().clone());
        config.to_string()
    }

    fn theta(rope: Value) -> Result<f64, String> {
        from_hf_config(&llama(rope), "t", 8, 1).map(|(spec, _)| spec.model.rope_theta)
    }

    /// RoPE's base is read from transformers 5's `rope_parameters` as well as from the top
    /// level; scaled variants and disagreeing values are refused naming the field.
    #[test]
    fn rope_theta_is_read_from_either_layout() {
        assert_eq!(theta(json!({})), Ok(10000.0));
        assert_eq!(theta(json!({"rope_theta": 500000.0})), Ok(500000.0));
        assert_eq!(theta(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})), Ok(500000.0));
        assert_eq!(theta(json!({"rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})), Ok(500000.0));
        let refused = [
            (json!({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0}}), "disagree"),
            (json!({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}), "`rope_parameters.rope_type` = \"llama3\""),
            (json!({"rope_parameters": {"rope_type": "default", "rope_theta": "big"}}), "`rope_parameters.rope_theta` must be a number"),
            (json!({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}), "`rope_parameters.partial_rotary_factor`"),
            (json!({"rope_parameters": 7}), "`rope_parameters` = 7"),
            (json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}), "`rope_scaling`"),
        ];
        for (rope, says) in refused {
            let e = theta(rope.clone()).unwrap_err();
            assert!(e.contains(says), "{rope}: {e}");
        }
    }
}
