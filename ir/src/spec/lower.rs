//! Frontend lowering: a [`Spec`] becomes `func.func @forward(params..., tokens, targets) -> loss`
//! in `xf` ops, one block of ops per transformer layer, each op located by its place in the
//! model (`layers.3.attn.q`), each parameter argument named (`layers.3.attn.q.weight`).
//!
//! Linear weights are stored `[in, out]`, so a column-parallel split is a split of dimension 1
//! and a row-parallel split one of dimension 0. Attention uses separate q, k and v projections
//! so that each splits by whole heads, grouped-query attention included.

use super::{Activation, Norm, Positions, Spec, StepShape};
use crate::attrs::{AttrValue, Attrs};
use crate::facts::{Block, Origin, ParamKind};
use crate::graph::{ArgRole, BuildError, Func, FuncBuilder, Module, Value};
use crate::types::{DType, TensorTy};

/// Error from lowering a spec: a shape rule rejected an op, which means the spec passed
/// validation but is still inconsistent (a bug in validation or the frontend).
pub type LowerError = BuildError;

/// Lowers a validated spec to a module holding `@forward`, for a step of `shape` (rows of a
/// micro-batch over all replicas, padded vocabulary; see [`Spec::step_shape`]).
pub fn lower(spec: &Spec, shape: StepShape) -> Result<Module, LowerError> {
    Ok(Module { grids: Vec::new(), funcs: vec![forward(spec, shape, true)?], notes: Default::default() })
}

/// Lowers a spec to `func.func @logits(params..., tokens) -> logits`: the forward pass
/// without the loss, for inference and for comparing with other implementations.
pub fn lower_logits(spec: &Spec, shape: StepShape) -> Result<Module, LowerError> {
    let mut func = forward(spec, shape, false)?;
    func.name = "logits".into();
    Ok(Module { grids: Vec::new(), funcs: vec![func], notes: Default::default() })
}

/// Shorthand for attribute sets.
fn attrs(items: &[(&str, AttrValue)]) -> Attrs {
    items.iter().fold(Attrs::new(), |a, (k, v)| a.with(k, v.clone()))
}

/// Builds `@forward`. Parameters are declared as they are first used, so argument order
/// follows the model from embedding to head.
fn forward(spec: &Spec, shape: StepShape, with_loss: bool) -> Result<Func, LowerError> {
    let m = &spec.model;
    let dtype: DType = m.dtype.into();
    let (b, s) = (shape.rows as i64, spec.seq_len() as i64);
    let (h, v, f) = (m.hidden as i64, shape.padded_vocab as i64, m.ffn_hidden as i64);
    let (heads, kv_heads) = (m.heads as i64, m.kv_heads() as i64);
    let head_dim = h / heads;
    let mut fb = FuncBuilder::new("forward");
    let param = |fb: &mut FuncBuilder, name: &str, shape: &[i64], kind: ParamKind| {
        let value = fb.arg(name, TensorTy::new(shape, dtype), ArgRole::Param);
        fb.set_kind(value, kind);
        value
    };
    fb.set_origin(Origin::of(Block::Embedding));

    // Parameters that the whole model shares are declared up front; per-layer ones as used.
    let wte = param(&mut fb, "embed.tokens.weight", &[v, h], ParamKind::TokenEmbedding);
    // A padded vocabulary: the table's real rows, and the loss's real classes.
    let padded = shape.padded_vocab != m.vocab;
    if padded {
        fb.set_unpadded(wte, Some(vec![m.vocab as i64, h]));
    }
    let wpe = (m.positions == Positions::Learned).then(|| param(&mut fb, "embed.positions.weight", &[m.max_seq as i64, h], ParamKind::Replicated));
    let tokens = fb.arg("tokens", TensorTy::new([b, s], DType::I32), ArgRole::Input);
    let targets = with_loss.then(|| fb.arg("targets", TensorTy::new([b, s], DType::I32), ArgRole::Input));

    // Context parallelism: the step runs on its sequences in zigzag order (one early and one
    // late chunk in each cp rank's part), its tokens, targets and position table reordered,
    // and the ops that read positions told the order.
    let chunks = shape.sequence_chunks as i64;
    let zigzag = |fb: &mut FuncBuilder, x: Value, axis: i64, inverse: bool, loc: &str| -> Result<Value, LowerError> {
        if chunks <= 1 {
            return Ok(x);
        }
        Ok(fb.op("xf.zigzag", &[x], attrs(&[("axis", AttrValue::Int(axis)), ("chunks", AttrValue::Int(chunks)), ("inverse", AttrValue::Bool(inverse))]), loc)?)
    };
    let order = |a: Attrs| if chunks > 1 { a.with(crate::ops::ZIGZAG_ATTR, AttrValue::Ints(vec![chunks, s])) } else { a };
    let tokens = zigzag(&mut fb, tokens, 1, false, "embed.tokens.zigzag")?;
    let mut x = fb.op("xf.embedding", &[wte, tokens], Attrs::new(), "embed.tokens")?;
    if let Some(wpe) = wpe {
        let pos = fb.op(
            "xf.slice",
            &[wpe],
            attrs(&[("axis", AttrValue::Int(0)), ("start", AttrValue::Int(0)), ("size", AttrValue::Int(s))]),
            "embed.positions.slice",
        )?;
        let pos = zigzag(&mut fb, pos, 0, false, "embed.positions.zigzag")?;
        fb.set_origin(Origin { residual: true, ..fb.origin() });
        x = fb.op("xf.add", &[x, pos], Attrs::new(), "embed.positions")?;
    }

    let mut cx = LayerCx { fb, spec, dtype };
    let mut aux_losses = Vec::new();
    for layer in 0..m.layers {
        let p = format!("layers.{layer}");
        let index = u32::try_from(layer).unwrap_or(u32::MAX);
        // Attention block: x + out(attention(q, k, v)).
        cx.fb.set_origin(Origin::of(Block::Attention(index)));
        let normed = cx.norm(x, &format!("{p}.attn_norm"))?;
        let q = cx.linear(normed, h, heads * head_dim, &format!("{p}.attn.q"), ParamKind::Column)?;
        let k = cx.linear(normed, h, kv_heads * head_dim, &format!("{p}.attn.k"), ParamKind::KeyValue)?;
        let val = cx.linear(normed, h, kv_heads * head_dim, &format!("{p}.attn.v"), ParamKind::KeyValue)?;
        // Heads stay side by side in the features ([b, s, heads * head_dim]): rotary
        // embedding and attention read each at a row stride, as FlashAttention does.
        let (mut q, mut k) = (q, k);
        if m.positions == Positions::Rope {
            let theta = order(attrs(&[("theta", AttrValue::Float(m.rope_theta)), ("head_dim", AttrValue::Int(head_dim))]));
            q = cx.fb.op("xf.rope", &[q], theta.clone(), &format!("{p}.attn.q.rope"))?;
            k = cx.fb.op("xf.rope", &[k], theta, &format!("{p}.attn.k.rope"))?;
        }
        let scale = 1.0 / (head_dim as f64).sqrt();
        // (out, lse): the rows' log-sum-exp is kept for the backward, as FlashAttention does.
        let core = cx.fb.op_multi(
            "xf.attention",
            &[q, k, val],
            order(attrs(&[("causal", AttrValue::Bool(true)), ("scale", AttrValue::Float(scale)), ("head_dim", AttrValue::Int(head_dim))])),
            &format!("{p}.attn.core"),
        )?[0];
        let out = cx.linear(core, heads * head_dim, h, &format!("{p}.attn.out"), ParamKind::Row)?;
        x = cx.residual(x, out, &format!("{p}.attn.residual"))?;

        // MLP block: x + down(act(up(x))), or a mixture of experts.
        cx.fb.set_origin(Origin::of(Block::Mlp(index)));
        let normed = cx.norm(x, &format!("{p}.mlp_norm"))?;
        let out = match m.moe.as_ref().filter(|moe| moe.is_moe_layer(layer)) {
            Some(moe) => {
                let (out, aux) = cx.experts(normed, moe, s, &order, &format!("{p}.mlp"))?;
                aux_losses.push(aux);
                out
            }
            None => cx.mlp(normed, f, &format!("{p}.mlp"))?,
        };
        x = cx.residual(x, out, &format!("{p}.mlp.residual"))?;
    }

    cx.fb.set_origin(Origin::of(Block::Head));
    let x = cx.norm(x, "final_norm")?;
    let logits = if m.tied_embeddings {
        // The LM head reads the [vocab, hidden] embedding table transposed.
        cx.fb.op("xf.matmul", &[x, wte], matmul_attrs(false, true), "lm_head")?
    } else {
        let w = param(&mut cx.fb, "lm_head.weight", &[h, v], ParamKind::LmHead);
        if padded {
            cx.fb.set_unpadded(w, Some(vec![h, m.vocab as i64]));
        }
        cx.fb.op("xf.matmul", &[x, w], matmul_attrs(false, false), "lm_head")?
    };
    let Some(targets) = targets else {
        // Logits come out in the natural order.
        let logits = zigzag(&mut cx.fb, logits, 1, true, "logits.zigzag")?;
        return Ok(cx.fb.finish(&[logits], &["logits".to_string()]));
    };
    let targets = zigzag(&mut cx.fb, targets, 1, false, "loss.targets.zigzag")?;
    // Mixed precision computes the loss in fp32, as Megatron-LM does, from the bf16 logits
    // themselves: the loss kernels read bf16 and compute and return fp32 (the loss, its
    // per-token statistics), and the logits' gradient is bf16. A cast to fp32 first gives the
    // same numbers (bf16 widens exactly) at the cost of an fp32 copy of the logits and of
    // their gradient, each vocabulary-wide.
    let classes = if padded { attrs(&[("xf.classes", AttrValue::Int(m.vocab as i64))]) } else { Attrs::new() };
    let mut loss = cx.fb.op("xf.cross_entropy", &[logits, targets], classes, "loss")?;
    // The load-balancing losses (one per layer and sequence) join the loss as their mean
    // over sequences, weighed.
    if let Some(moe) = m.moe.as_ref().filter(|_| !aux_losses.is_empty()) {
        let mut per_sequence = aux_losses[0];
        for (i, &aux) in aux_losses.iter().enumerate().skip(1) {
            per_sequence = cx.fb.op("xf.add", &[per_sequence, aux], Attrs::new(), &format!("loss.aux.layers.{i}"))?;
        }
        let mut total = cx.fb.op("xf.sum_leading", &[per_sequence], attrs(&[("keep", AttrValue::Int(0))]), "loss.aux.sum")?;
        if dtype == DType::Bf16 {
            total = cx.fb.op("xf.cast", &[total], crate::ops::cast::cast_attrs(DType::F32), "loss.aux.to_f32")?;
        }
        let weighed = cx.fb.op("xf.scale", &[total], attrs(&[("factor", AttrValue::Float(moe.aux_loss_weight / b as f64))]), "loss.aux")?;
        loss = cx.fb.op("xf.add", &[loss, weighed], Attrs::new(), "loss.total")?;
    }
    Ok(cx.fb.finish(&[loss], &["loss".to_string()]))
}

fn matmul_attrs(transpose_lhs: bool, transpose_rhs: bool) -> Attrs {
    attrs(&[("transpose_lhs", AttrValue::Bool(transpose_lhs)), ("transpose_rhs", AttrValue::Bool(transpose_rhs))])
}

/// Builders for the repeated pieces of a layer.
struct LayerCx<'s> {
    fb: FuncBuilder,
    spec: &'s Spec,
    dtype: DType,
}

impl LayerCx<'_> {
    fn param(&mut self, name: &str, shape: &[i64], kind: ParamKind) -> Value {
        let value = self.fb.arg(name, TensorTy::new(shape, self.dtype), ArgRole::Param);
        self.fb.set_kind(value, kind);
        value
    }

    /// `x @ W (+ b)` with `W [in, out]`, named `{name}.weight` / `{name}.bias`, split by
    /// tensor parallelism as `kind` says.
    fn linear(&mut self, x: Value, fan_in: i64, fan_out: i64, name: &str, kind: ParamKind) -> Result<Value, LowerError> {
        let w = self.param(&format!("{name}.weight"), &[fan_in, fan_out], kind);
        let y = self.fb.op("xf.matmul", &[x, w], matmul_attrs(false, false), name)?;
        if !self.spec.model.linear_bias {
            return Ok(y);
        }
        let bias = self.param(&format!("{name}.bias"), &[fan_out], kind);
        // A row-parallel linear's bias add closes its block's output, which joins the
        // residual stream.
        let block = self.fb.origin();
        self.fb.set_origin(Origin { residual: kind == ParamKind::Row, ..block });
        let y = self.fb.op("xf.add", &[y, bias], Attrs::new(), &format!("{name}.bias_add"));
        self.fb.set_origin(block);
        y
    }

    /// `x + y`: the residual stream.
    fn residual(&mut self, x: Value, y: Value, name: &str) -> Result<Value, LowerError> {
        let block = self.fb.origin();
        self.fb.set_origin(Origin { residual: true, ..block });
        let sum = self.fb.op("xf.add", &[x, y], Attrs::new(), name);
        self.fb.set_origin(block);
        sum
    }

    /// The spec's normalisation over the hidden dimension.
    fn norm(&mut self, x: Value, name: &str) -> Result<Value, LowerError> {
        let model = &self.spec.model;
        let hidden = model.hidden as i64;
        let eps = attrs(&[("epsilon", AttrValue::Float(model.norm_eps))]);
        let gamma = self.param(&format!("{name}.weight"), &[hidden], ParamKind::Replicated);
        match model.norm {
            Norm::LayerNorm => {
                let beta = self.param(&format!("{name}.bias"), &[hidden], ParamKind::Replicated);
                self.fb.op("xf.layernorm", &[x, gamma, beta], eps, name)
            }
            Norm::RmsNorm => self.fb.op("xf.rmsnorm", &[x, gamma], eps, name),
        }
    }

    /// A dense MLP of inner size `f` on `x`, its weights named `{name}.up` (and `.gate`,
    /// `.down`).
    fn mlp(&mut self, x: Value, f: i64, name: &str) -> Result<Value, LowerError> {
        let h = self.spec.model.hidden as i64;
        let inner = match self.spec.model.activation {
            Activation::Gelu => {
                let up = self.linear(x, h, f, &format!("{name}.up"), ParamKind::Column)?;
                self.fb.op("xf.gelu", &[up], Attrs::new(), &format!("{name}.act"))?
            }
            Activation::Swiglu => {
                let gate = self.linear(x, h, f, &format!("{name}.gate"), ParamKind::Column)?;
                let up = self.linear(x, h, f, &format!("{name}.up"), ParamKind::Column)?;
                self.fb.op("xf.swiglu", &[gate, up], Attrs::new(), &format!("{name}.act"))?
            }
        };
        self.linear(inner, f, h, &format!("{name}.down"), ParamKind::Row)
    }

    /// A mixture-of-experts MLP on `x [batch, seq, hidden]`: the router's logits pick each
    /// token's experts, the tokens are permuted into per-expert buffers, every expert runs
    /// its MLP on its buffer as one grouped GEMM, and the outputs come back weighed by the
    /// gates (plus the shared experts' dense MLP). Returns the output and the layer's
    /// load-balancing loss of each sequence. Experts' MLPs carry no biases (as
    /// Mixtral's).
    fn experts(&mut self, x: Value, moe: &super::MoeSpec, seq: i64, order: &dyn Fn(Attrs) -> Attrs, name: &str) -> Result<(Value, Value), LowerError> {
        let model = &self.spec.model;
        let (h, e, k) = (model.hidden as i64, moe.experts as i64, moe.top_k as i64);
        let f = moe.expert_ffn(model.ffn_hidden) as i64;
        let int = AttrValue::Int;
        let router = self.param(&format!("{name}.router.weight"), &[h, e], ParamKind::Replicated);
        let logits = self.fb.op("xf.matmul", &[x, router], matmul_attrs(false, false), &format!("{name}.router"))?;
        let route = self.fb.op_multi("xf.moe_route", &[logits], attrs(&[("top_k", int(k))]), &format!("{name}.route"))?;
        let (gates, chosen) = (route[0], route[1]);
        let capacity = attrs(&[("experts", int(e)), ("capacity", int(moe.capacity(seq as u64) as i64))]);
        // Slots go to the tokens in the order of their positions.
        let slots = self.fb.op_multi("xf.moe_slots", &[chosen], order(capacity.clone()), &format!("{name}.slots"))?;
        let (slots, counts) = (slots[0], slots[1]);
        let buffer = self.fb.op("xf.moe_dispatch", &[x, chosen, slots], capacity, &format!("{name}.dispatch"))?;
        let gemm = attrs(&[("transpose_rhs", AttrValue::Bool(false)), ("routed", int(seq * k)), ("experts_total", int(e))]);
        let expert = |cx: &mut Self, input: Value, part: &str, fan_in: i64, fan_out: i64, kind: ParamKind| {
            let w = cx.param(&format!("{name}.experts.{part}.weight"), &[e, fan_in, fan_out], kind);
            cx.fb.op("xf.expert_matmul", &[input, w, counts], gemm.clone(), &format!("{name}.experts.{part}"))
        };
        let inner = match model.activation {
            Activation::Gelu => {
                let up = expert(self, buffer, "up", h, f, ParamKind::ExpertColumn)?;
                self.fb.op("xf.gelu", &[up], Attrs::new(), &format!("{name}.experts.act"))?
            }
            Activation::Swiglu => {
                let gate = expert(self, buffer, "gate", h, f, ParamKind::ExpertColumn)?;
                let up = expert(self, buffer, "up", h, f, ParamKind::ExpertColumn)?;
                self.fb.op("xf.swiglu", &[gate, up], Attrs::new(), &format!("{name}.experts.act"))?
            }
        };
        let down = expert(self, inner, "down", f, h, ParamKind::ExpertRow)?;
        let mut out = self.fb.op("xf.moe_combine", &[down, gates, chosen, slots], Attrs::new(), &format!("{name}.combine"))?;
        if moe.shared_experts > 0 {
            let shared = self.mlp(x, f * moe.shared_experts as i64, &format!("{name}.shared"))?;
            out = self.fb.op("xf.add", &[out, shared], Attrs::new(), &format!("{name}.shared.add"))?;
        }
        let aux = self.fb.op("xf.moe_aux_loss", &[logits, chosen], Attrs::new(), &format!("{name}.aux_loss"))?;
        Ok((out, aux))
    }

}
