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
  // xf.rope: rotary position embedding (rotate-half) on [batch, heads, seq, head_dim]
  irdl.operation @rope {
    %T = irdl.base "!builtin.tensor"
    %theta = irdl.base "#builtin.float"
    irdl.attributes {"theta" = %theta}
    irdl.operands(x: %T)
    irdl.results(y: %T)
  }
  // xf.split_heads: [b, s, n*d] -> [b, n, s, d] (reshape, then transpose 0,2,1,3)
  irdl.operation @split_heads {
    %T = irdl.base "!builtin.tensor"
    %U = irdl.base "!builtin.tensor"
    %heads = irdl.base "#builtin.integer"
    irdl.attributes {"heads" = %heads}
    irdl.operands(x: %T)
    irdl.results(y: %U)
  }
  // xf.merge_heads: [b, n, s, d] -> [b, s, n*d] (transpose 0,2,1,3, then reshape)
  irdl.operation @merge_heads {
    %T = irdl.base "!builtin.tensor"
    %U = irdl.base "!builtin.tensor"
    irdl.operands(x: %T)
    irdl.results(y: %U)
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
  // xf.attention: softmax(scale * q k^T + causal mask) v over heads; kv heads shared by q_heads/kv_heads
  irdl.operation @attention {
    %Q = irdl.base "!builtin.tensor"
    %K = irdl.base "!builtin.tensor"
    %causal = irdl.base "#builtin.integer"
    %scale = irdl.base "#builtin.float"
    irdl.attributes {"causal" = %causal, "scale" = %scale}
    irdl.operands(q: %Q, k: %K, v: %K)
    irdl.results(out: %Q)
  }
  // xf.cross_entropy: mean over tokens of logsumexp(logits) - logits[target]; scalar result
  irdl.operation @cross_entropy {
    %L = irdl.base "!builtin.tensor"
    %I = irdl.base "!builtin.tensor"
    %S = irdl.base "!builtin.tensor"
    irdl.operands(logits: %L, targets: %I)
    irdl.results(loss: %S)
  }
}
