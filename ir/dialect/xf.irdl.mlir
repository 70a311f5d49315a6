// The xf dialect: shardc's transformer ops, in IRDL.
// Generated from the op registry (ir/src/ops) by `shardc dialect`; do not edit.
// IRDL checks operand kinds and equal-type constraints; shape rules live in Rust.
irdl.dialect @xf {
  // xf.embedding: row lookup: out[..., :] = table[ids[...], :]
  irdl.operation @embedding {
    %W = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %O = irdl.base "!builtin.tensor"
    irdl.operands(table: %W, ids: %I)
    irdl.results(out: %O)
  }
  // xf.matmul: batched matrix product lhs[..., m, k] x rhs[(...), k, n], optional transposes
  irdl.operation @matmul {
    %A = irdl.base "!builtin.tensor"
    %B = irdl.base "!builtin.tensor"
    %C = irdl.base "!builtin.tensor"
    %transpose_lhs = irdl.base "#builtin.integer"
    %transpose_rhs = irdl.base "#builtin.integer"
    irdl.attributes {"transpose_lhs" = %transpose_lhs, "transpose_rhs" = %transpose_rhs}
    irdl.operands(lhs: %A, rhs: %B)
    irdl.results(out: %C)
  }
  // xf.add: lhs + rhs; rhs equals the trailing dims of lhs and is broadcast over the rest
  irdl.operation @add {
    %L = irdl.base "!builtin.tensor"
    %R = irdl.base "!builtin.tensor"
    irdl.operands(lhs: %L, rhs: %R)
    irdl.results(out: %L)
  }
  // xf.mul: lhs * rhs; rhs equals the trailing dims of lhs and is broadcast over the rest
  irdl.operation @mul {
    %L = irdl.base "!builtin.tensor"
    %R = irdl.base "!builtin.tensor"
    irdl.operands(lhs: %L, rhs: %R)
    irdl.results(out: %L)
  }
  // xf.scale: factor * x
  irdl.operation @scale {
    %T = irdl.base "!builtin.tensor"
    %factor = irdl.base "#builtin.float"
    irdl.attributes {"factor" = %factor}
    irdl.operands(x: %T)
    irdl.results(y: %T)
  }
  // xf.gelu: GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  irdl.operation @gelu {
    %T = irdl.base "!builtin.tensor"
    irdl.operands(x: %T)
    irdl.results(y: %T)
  }
  // xf.silu: SiLU: x * sigmoid(x)
  irdl.operation @silu {
    %T = irdl.base "!builtin.tensor"
    irdl.operands(x: %T)
    irdl.results(y: %T)
  }
  // xf.swiglu: SwiGLU gating: silu(gate) * up
  irdl.operation @swiglu {
    %T = irdl.base "!builtin.tensor"
    irdl.operands(gate: %T, up: %T)
    irdl.results(y: %T)
  }
  // xf.layernorm: (x - mean) / sqrt(var + epsilon) * gamma + beta over the last dim
  irdl.operation @layernorm {
    %T = irdl.base "!builtin.tensor"
    %P = irdl.base "!builtin.tensor"
    %epsilon = irdl.base "#builtin.float"
    irdl.attributes {"epsilon" = %epsilon}
    irdl.operands(x: %T, gamma: %P, beta: %P)
    irdl.results(y: %T)
  }
  // xf.rmsnorm: x / sqrt(mean(x^2) + epsilon) * gamma over the last dim
  irdl.operation @rmsnorm {
    %T = irdl.base "!builtin.tensor"
    %P = irdl.base "!builtin.tensor"
    %epsilon = irdl.base "#builtin.float"
    irdl.attributes {"epsilon" = %epsilon}
    irdl.operands(x: %T, gamma: %P)
    irdl.results(y: %T)
  }
  // xf.rope: rotary position embedding (rotate-half) on each head of [batch, seq, heads * head_dim]
  irdl.operation @rope {
    %T = irdl.base "!builtin.tensor"
    %theta = irdl.base "#builtin.float"
    %head_dim = irdl.base "#builtin.integer"
    irdl.attributes {"theta" = %theta, "head_dim" = %head_dim}
    irdl.operands(x: %T)
    irdl.results(y: %T)
  }
  // xf.slice: contiguous slice x[start:start+size] along one axis
  irdl.operation @slice {
    %T = irdl.base "!builtin.tensor"
    %U = irdl.base "!builtin.tensor"
    %axis = irdl.base "#builtin.integer"
    %start = irdl.base "#builtin.integer"
    %size = irdl.base "#builtin.integer"
    irdl.attributes {"axis" = %axis, "start" = %start, "size" = %size}
    irdl.operands(x: %T)
    irdl.results(y: %U)
  }
  // xf.repeat_heads: [b, s, h*d] -> [b, s, h*times*d], head j reads head j / times
  irdl.operation @repeat_heads {
    %T = irdl.base "!builtin.tensor"
    %U = irdl.base "!builtin.tensor"
    %times = irdl.base "#builtin.integer"
    %head_dim = irdl.base "#builtin.integer"
    irdl.attributes {"times" = %times, "head_dim" = %head_dim}
    irdl.operands(x: %T)
    irdl.results(y: %U)
  }
  // xf.zigzag: reorder one axis into zigzag order of `chunks` chunks (part r: chunks r and chunks-1-r), or back
  irdl.operation @zigzag {
    %T = irdl.base "!builtin.tensor"
    %axis = irdl.base "#builtin.integer"
    %chunks = irdl.base "#builtin.integer"
    %inverse = irdl.base "#builtin.integer"
    irdl.attributes {"axis" = %axis, "chunks" = %chunks, "inverse" = %inverse}
    irdl.operands(x: %T)
    irdl.results(y: %T)
  }
  // xf.sum_heads: [b, s, h*times*d] -> [b, s, h*d], summing each group of times heads
  irdl.operation @sum_heads {
    %T = irdl.base "!builtin.tensor"
    %U = irdl.base "!builtin.tensor"
    %times = irdl.base "#builtin.integer"
    %head_dim = irdl.base "#builtin.integer"
    irdl.attributes {"times" = %times, "head_dim" = %head_dim}
    irdl.operands(x: %T)
    irdl.results(y: %U)
  }
  // xf.attention: softmax(scale * q k^T + causal mask) v over heads; kv heads shared by q_heads/kv_heads; (out, lse)
  irdl.operation @attention {
    %Q = irdl.base "!builtin.tensor"
    %K = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    %causal = irdl.base "#builtin.integer"
    %scale = irdl.base "#builtin.float"
    %head_dim = irdl.base "#builtin.integer"
    irdl.attributes {"causal" = %causal, "scale" = %scale, "head_dim" = %head_dim}
    irdl.operands(q: %Q, k: %K, v: %K)
    irdl.results(out: %Q, lse: %S)
  }
  // xf.attention_block: one ring-attention step: queries against the key/value block held at xf.ring_step; (out, lse)
  irdl.operation @attention_block {
    %Q = irdl.base "!builtin.tensor"
    %K = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    %causal = irdl.base "#builtin.integer"
    %scale = irdl.base "#builtin.float"
    %head_dim = irdl.base "#builtin.integer"
    %xf.ring_step = irdl.base "#builtin.integer"
    irdl.attributes {"causal" = %causal, "scale" = %scale, "head_dim" = %head_dim, "xf.ring_step" = %xf.ring_step}
    irdl.operands(q: %Q, k: %K, v: %K)
    irdl.results(out: %Q, lse: %S)
  }
  // xf.attention_merge: merge two partial attentions (out, lse) over disjoint keys by their log-sum-exps
  irdl.operation @attention_merge {
    %Q = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    irdl.operands(out_a: %Q, lse_a: %S, out_b: %Q, lse_b: %S)
    irdl.results(out: %Q, lse: %S)
  }
  // xf.attention_block_grad: ring-attention step backward: (dq, dk, dv) of the block at xf.ring_step from q, k, v, out, lse, dout
  irdl.operation @attention_block_grad {
    %Q = irdl.base "!builtin.tensor"
    %K = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    %causal = irdl.base "#builtin.integer"
    %scale = irdl.base "#builtin.float"
    %head_dim = irdl.base "#builtin.integer"
    %xf.ring_step = irdl.base "#builtin.integer"
    irdl.attributes {"causal" = %causal, "scale" = %scale, "head_dim" = %head_dim, "xf.ring_step" = %xf.ring_step}
    irdl.operands(q: %Q, k: %K, v: %K, out: %Q, lse: %S, dout: %Q)
    irdl.results(dq: %Q, dk: %K, dv: %K)
  }
  // xf.cross_entropy: mean over tokens of logsumexp(logits) - logits[target]; scalar result
  irdl.operation @cross_entropy {
    %L = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    irdl.operands(logits: %L, targets: %I)
    irdl.results(loss: %S)
  }
  // xf.moe_route: top-k gating: experts = argtop_k(logits), gates = softmax over the chosen logits
  irdl.operation @moe_route {
    %L = irdl.base "!builtin.tensor"
    %G = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %top_k = irdl.base "#builtin.integer"
    irdl.attributes {"top_k" = %top_k}
    irdl.operands(logits: %L)
    irdl.results(gates: %G, experts: %I)
  }
  // xf.moe_slots: slot of each choice in its expert's buffer (-1: dropped past capacity), and rows per buffer
  irdl.operation @moe_slots {
    %I = irdl.base "!builtin.tensor"
    %C = irdl.base "!builtin.tensor"
    %experts = irdl.base "#builtin.integer"
    %capacity = irdl.base "#builtin.integer"
    irdl.attributes {"experts" = %experts, "capacity" = %capacity}
    irdl.operands(experts: %I)
    irdl.results(slots: %I, counts: %C)
  }
  // xf.moe_dispatch: permute tokens into per-expert buffers: buf[experts, b, slots, :] = x[b, s, :]
  irdl.operation @moe_dispatch {
    %X = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %B = irdl.base "!builtin.tensor"
    %experts = irdl.base "#builtin.integer"
    %capacity = irdl.base "#builtin.integer"
    irdl.attributes {"experts" = %experts, "capacity" = %capacity}
    irdl.operands(x: %X, experts: %I, slots: %I)
    irdl.results(buffer: %B)
  }
  // xf.expert_matmul: grouped expert GEMM: out[e, b, r] = x[e, b, r] @ w[e] for rows r < counts[e, b], zeros after
  irdl.operation @expert_matmul {
    %X = irdl.base "!builtin.tensor"
    %W = irdl.base "!builtin.tensor"
    %C = irdl.base "!builtin.tensor"
    %Y = irdl.base "!builtin.tensor"
    %transpose_rhs = irdl.base "#builtin.integer"
    %routed = irdl.base "#builtin.integer"
    %experts_total = irdl.base "#builtin.integer"
    irdl.attributes {"transpose_rhs" = %transpose_rhs, "routed" = %routed, "experts_total" = %experts_total}
    irdl.operands(x: %X, w: %W, counts: %C)
    irdl.results(out: %Y)
  }
  // xf.moe_combine: unpermute expert outputs, weighed by gates: y[b, s, :] = sum_j gates_j buf[experts_j, b, slots_j, :]
  irdl.operation @moe_combine {
    %B = irdl.base "!builtin.tensor"
    %G = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %X = irdl.base "!builtin.tensor"
    irdl.operands(buffer: %B, gates: %G, experts: %I, slots: %I)
    irdl.results(y: %X)
  }
  // xf.moe_aux_loss: load-balancing loss per sequence: E/(S k) sum_e count_e * mean_s softmax(logits)_e
  irdl.operation @moe_aux_loss {
    %L = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %O = irdl.base "!builtin.tensor"
    irdl.operands(logits: %L, experts: %I)
    irdl.results(loss: %O)
  }
  // xf.sum_leading: sum over the leading dims, keeping the trailing `keep` dims
  irdl.operation @sum_leading {
    %T = irdl.base "!builtin.tensor"
    %U = irdl.base "!builtin.tensor"
    %keep = irdl.base "#builtin.integer"
    irdl.attributes {"keep" = %keep}
    irdl.operands(x: %T)
    irdl.results(y: %U)
  }
  // xf.fill_like: a tensor of x's type filled with value
  irdl.operation @fill_like {
    %T = irdl.base "!builtin.tensor"
    %value = irdl.base "#builtin.float"
    irdl.attributes {"value" = %value}
    irdl.operands(x: %T)
    irdl.results(y: %T)
  }
  // xf.pad: zero-pad x to extent size along axis, x at offset start (slice's transpose)
  irdl.operation @pad {
    %T = irdl.base "!builtin.tensor"
    %U = irdl.base "!builtin.tensor"
    %axis = irdl.base "#builtin.integer"
    %start = irdl.base "#builtin.integer"
    %size = irdl.base "#builtin.integer"
    irdl.attributes {"axis" = %axis, "start" = %start, "size" = %size}
    irdl.operands(x: %T)
    irdl.results(y: %U)
  }
  // xf.wait: x, once the asynchronous collective that produced it has completed
  irdl.operation @wait {
    %T = irdl.base "!builtin.tensor"
    irdl.operands(x: %T)
    irdl.results(y: %T)
  }
  // xf.embedding_grad: scatter-add: out[ids[...], :] += dy[..., :] into [vocab, hidden]
  irdl.operation @embedding_grad {
    %I = irdl.base "!builtin.tensor"
    %D = irdl.base "!builtin.tensor"
    %W = irdl.base "!builtin.tensor"
    %vocab = irdl.base "#builtin.integer"
    irdl.attributes {"vocab" = %vocab}
    irdl.operands(ids: %I, dy: %D)
    irdl.results(out: %W)
  }
  // xf.matmul_wgrad: sum over batch of a[..., m, k]^T b[..., m, n] -> [k, n] (weight gradient)
  irdl.operation @matmul_wgrad {
    %A = irdl.base "!builtin.tensor"
    %B = irdl.base "!builtin.tensor"
    %C = irdl.base "!builtin.tensor"
    irdl.operands(a: %A, b: %B)
    irdl.results(out: %C)
  }
  // xf.gelu_grad: dy * gelu'(x) (tanh approximation)
  irdl.operation @gelu_grad {
    %T = irdl.base "!builtin.tensor"
    irdl.operands(x: %T, dy: %T)
    irdl.results(dx: %T)
  }
  // xf.silu_grad: dy * silu'(x)
  irdl.operation @silu_grad {
    %T = irdl.base "!builtin.tensor"
    irdl.operands(x: %T, dy: %T)
    irdl.results(dx: %T)
  }
  // xf.swiglu_grad: (dy * up * silu'(gate), dy * silu(gate))
  irdl.operation @swiglu_grad {
    %T = irdl.base "!builtin.tensor"
    irdl.operands(gate: %T, up: %T, dy: %T)
    irdl.results(dgate: %T, dup: %T)
  }
  // xf.layernorm_grad: layernorm backward: (dx, dgamma, dbeta) from x, gamma, dy
  irdl.operation @layernorm_grad {
    %T = irdl.base "!builtin.tensor"
    %P = irdl.base "!builtin.tensor"
    %epsilon = irdl.base "#builtin.float"
    irdl.attributes {"epsilon" = %epsilon}
    irdl.operands(x: %T, gamma: %P, dy: %T)
    irdl.results(dx: %T, dgamma: %P, dbeta: %P)
  }
  // xf.rmsnorm_grad: rmsnorm backward: (dx, dgamma) from x, gamma, dy
  irdl.operation @rmsnorm_grad {
    %T = irdl.base "!builtin.tensor"
    %P = irdl.base "!builtin.tensor"
    %epsilon = irdl.base "#builtin.float"
    irdl.attributes {"epsilon" = %epsilon}
    irdl.operands(x: %T, gamma: %P, dy: %T)
    irdl.results(dx: %T, dgamma: %P)
  }
  // xf.rope_grad: rotary embedding backward: rotate by -angle
  irdl.operation @rope_grad {
    %T = irdl.base "!builtin.tensor"
    %theta = irdl.base "#builtin.float"
    %head_dim = irdl.base "#builtin.integer"
    irdl.attributes {"theta" = %theta, "head_dim" = %head_dim}
    irdl.operands(dy: %T)
    irdl.results(dx: %T)
  }
  // xf.attention_grad: attention backward: (dq, dk, dv) from q, k, v, out, lse, dout; recomputes the probabilities
  irdl.operation @attention_grad {
    %Q = irdl.base "!builtin.tensor"
    %K = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    %causal = irdl.base "#builtin.integer"
    %scale = irdl.base "#builtin.float"
    %head_dim = irdl.base "#builtin.integer"
    irdl.attributes {"causal" = %causal, "scale" = %scale, "head_dim" = %head_dim}
    irdl.operands(q: %Q, k: %K, v: %K, out: %Q, lse: %S, dout: %Q)
    irdl.results(dq: %Q, dk: %K, dv: %K)
  }
  // xf.cross_entropy_grad: dloss * (softmax(logits) - onehot(targets)) / tokens
  irdl.operation @cross_entropy_grad {
    %L = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    irdl.operands(logits: %L, targets: %I, dloss: %S)
    irdl.results(dlogits: %L)
  }
  // xf.moe_route_grad: gradient of top-k gating: dlogits[experts] = gates * (dgates - <gates, dgates>)
  irdl.operation @moe_route_grad {
    %G = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %L = irdl.base "!builtin.tensor"
    %experts = irdl.base "#builtin.integer"
    irdl.attributes {"experts" = %experts}
    irdl.operands(gates: %G, experts: %I, dgates: %G)
    irdl.results(dlogits: %L)
  }
  // xf.moe_aux_loss_grad: gradient of the load-balancing loss with respect to the router logits
  irdl.operation @moe_aux_loss_grad {
    %L = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %O = irdl.base "!builtin.tensor"
    irdl.operands(logits: %L, experts: %I, dloss: %O)
    irdl.results(dlogits: %L)
  }
  // xf.moe_collect: sum each token's rows back out of per-expert buffers (the adjoint of moe_dispatch)
  irdl.operation @moe_collect {
    %B = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %X = irdl.base "!builtin.tensor"
    irdl.operands(buffer: %B, experts: %I, slots: %I)
    irdl.results(y: %X)
  }
  // xf.moe_combine_grad: gradients of moe_combine: dbuf = gates * dy in the choices' slots, dgates = <dy, buf row>
  irdl.operation @moe_combine_grad {
    %B = irdl.base "!builtin.tensor"
    %G = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %X = irdl.base "!builtin.tensor"
    irdl.operands(buffer: %B, gates: %G, experts: %I, slots: %I, dy: %X)
    irdl.results(dbuffer: %B, dgates: %G)
  }
  // xf.expert_matmul_wgrad: weight gradient of the grouped expert GEMM: dw[e] = sum_b x[e, b]^T dy[e, b] over filled rows
  irdl.operation @expert_matmul_wgrad {
    %X = irdl.base "!builtin.tensor"
    %Y = irdl.base "!builtin.tensor"
    %C = irdl.base "!builtin.tensor"
    %W = irdl.base "!builtin.tensor"
    %routed = irdl.base "#builtin.integer"
    %experts_total = irdl.base "#builtin.integer"
    irdl.attributes {"routed" = %routed, "experts_total" = %experts_total}
    irdl.operands(x: %X, dy: %Y, counts: %C)
    irdl.results(dw: %W)
  }
  // xf.row_max: maximum over the last dim (vocab-parallel cross-entropy)
  irdl.operation @row_max {
    %T = irdl.base "!builtin.tensor"
    %U = irdl.base "!builtin.tensor"
    irdl.operands(x: %T)
    irdl.results(max: %U)
  }
  // xf.cross_entropy_stats: local sum of exp(logits - max) and the owned target logit (vocab-parallel cross-entropy)
  irdl.operation @cross_entropy_stats {
    %L = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %M = irdl.base "!builtin.tensor"
    irdl.operands(logits: %L, targets: %I, max: %M)
    irdl.results(sumexp: %M, target: %M)
  }
  // xf.cross_entropy_finish: mean of max + ln(sumexp) - target (vocab-parallel cross-entropy)
  irdl.operation @cross_entropy_finish {
    %M = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    irdl.operands(max: %M, sumexp: %M, target: %M)
    irdl.results(loss: %S)
  }
  // xf.cross_entropy_grad_shard: cross-entropy gradient on a vocab shard from the global max and sumexp
  irdl.operation @cross_entropy_grad_shard {
    %L = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    %M = irdl.base "!builtin.tensor"
    irdl.operands(logits: %L, targets: %I, dloss: %S, max: %M, sumexp: %M)
    irdl.results(dlogits: %L)
  }
  // xf.adamw: AdamW update with bias correction: (param, m, v) -> (param', m', v')
  irdl.operation @adamw {
    %P = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    %G = irdl.base "!builtin.tensor"
    %lr = irdl.base "#builtin.float"
    %min_lr = irdl.base "#builtin.float"
    %warmup_steps = irdl.base "#builtin.integer"
    %decay_steps = irdl.base "#builtin.integer"
    %cosine = irdl.base "#builtin.integer"
    %beta1 = irdl.base "#builtin.float"
    %beta2 = irdl.base "#builtin.float"
    %epsilon = irdl.base "#builtin.float"
    %weight_decay = irdl.base "#builtin.float"
    irdl.attributes {"lr" = %lr, "min_lr" = %min_lr, "warmup_steps" = %warmup_steps, "decay_steps" = %decay_steps, "cosine" = %cosine, "beta1" = %beta1, "beta2" = %beta2, "epsilon" = %epsilon, "weight_decay" = %weight_decay}
    irdl.operands(param: %P, grad: %P, m: %P, v: %P, step: %S, grad_scale: %G)
    irdl.results(new_param: %P, new_m: %P, new_v: %P)
  }
  // xf.sgd: SGD update: param - lr (grad + weight_decay param)
  irdl.operation @sgd {
    %P = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    %G = irdl.base "!builtin.tensor"
    %lr = irdl.base "#builtin.float"
    %min_lr = irdl.base "#builtin.float"
    %warmup_steps = irdl.base "#builtin.integer"
    %decay_steps = irdl.base "#builtin.integer"
    %cosine = irdl.base "#builtin.integer"
    %weight_decay = irdl.base "#builtin.float"
    irdl.attributes {"lr" = %lr, "min_lr" = %min_lr, "warmup_steps" = %warmup_steps, "decay_steps" = %decay_steps, "cosine" = %cosine, "weight_decay" = %weight_decay}
    irdl.operands(param: %P, grad: %P, step: %S, grad_scale: %G)
    irdl.results(new_param: %P)
  }
  // xf.sum_squares: sum of squares of every element (a gradient's share of the global norm)
  irdl.operation @sum_squares {
    %T = irdl.base "!builtin.tensor"
    %U = irdl.base "!builtin.tensor"
    irdl.operands(x: %T)
    irdl.results(y: %U)
  }
  // xf.clip_coef: gradient clipping coefficient min(1, max_norm / (sqrt(sum_squares) + 1e-6))
  irdl.operation @clip_coef {
    %T = irdl.base "!builtin.tensor"
    %max_norm = irdl.base "#builtin.float"
    irdl.attributes {"max_norm" = %max_norm}
    irdl.operands(sum_squares: %T)
    irdl.results(coef: %T)
  }
  // xf.constant: one value of float type `to` (tensor<1xT>)
  irdl.operation @constant {
    %T = irdl.base "!builtin.tensor"
    %value = irdl.base "#builtin.float"
    %to = irdl.base "#builtin.type"
    irdl.attributes {"value" = %value, "to" = %to}
    irdl.operands()
    irdl.results(y: %T)
  }
  // xf.cast: x converted to the float element type `to` (mixed precision)
  irdl.operation @cast {
    %X = irdl.base "!builtin.tensor"
    %Y = irdl.base "!builtin.tensor"
    %to = irdl.base "#builtin.type"
    irdl.attributes {"to" = %to}
    irdl.operands(x: %X)
    irdl.results(y: %Y)
  }
}
