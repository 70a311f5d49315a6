"""PyTorch CPU reference for `shardc bench --torch`: one training step of the same model.

Builds the architecture shardc lowers from a spec (separate q/k/v projections, GPT-2's tanh
GELU or SwiGLU, LayerNorm or RMSNorm, learned or rotary positions, tied or untied head),
runs forward + backward + AdamW for --steps timed steps after one warm-up, and prints JSON:
{"step_s": median seconds, "peak_rss_bytes": peak resident memory}.
Reference and benchmark only; not part of the test suite.
"""

import argparse
import json
import math
import os
import resource
import statistics
import time
import tomllib

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        h, heads, kv = m["hidden"], m["heads"], m.get("kv_heads", m["heads"])
        bias = m.get("linear_bias", False)
        self.heads, self.kv, self.d = heads, kv, h // heads
        norm = torch.nn.LayerNorm if m["norm"] == "layernorm" else torch.nn.RMSNorm
        self.attn_norm, self.mlp_norm = norm(h, eps=m.get("norm_eps", 1e-5)), norm(h, eps=m.get("norm_eps", 1e-5))
        self.q = torch.nn.Linear(h, heads * self.d, bias=bias)
        self.k = torch.nn.Linear(h, kv * self.d, bias=bias)
        self.v = torch.nn.Linear(h, kv * self.d, bias=bias)
        self.out = torch.nn.Linear(heads * self.d, h, bias=bias)
        self.swiglu = m["activation"] == "swiglu"
        self.up = torch.nn.Linear(h, m["ffn_hidden"], bias=bias)
        if self.swiglu:
            self.gate = torch.nn.Linear(h, m["ffn_hidden"], bias=bias)
        self.down = torch.nn.Linear(m["ffn_hidden"], h, bias=bias)
        self.rope = m["positions"] == "rope"
        self.theta = m.get("rope_theta", 10000.0)

    def rotate(self, x):
        s, d = x.shape[2], x.shape[3]
        inv = self.theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
        cos, sin = ang.cos().float(), ang.sin().float()
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.attn_norm(x)
        q = self.q(y).view(b, s, self.heads, self.d).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv, self.d).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv, self.d).transpose(1, 2)
        if self.rope:
            q, k = self.rotate(q), self.rotate(k)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, -1))
        y = self.mlp_norm(x)
        inner = F.silu(self.gate(y)) * self.up(y) if self.swiglu else F.gelu(self.up(y), approximate="tanh")
        return x + self.down(inner)


class Model(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.tokens = torch.nn.Embedding(m["vocab"], m["hidden"])
        self.positions = torch.nn.Embedding(m["max_seq"], m["hidden"]) if m["positions"] == "learned" else None
        self.layers = torch.nn.ModuleList(Block(m) for _ in range(m["layers"]))
        norm = torch.nn.LayerNorm if m["norm"] == "layernorm" else torch.nn.RMSNorm
        self.final_norm = norm(m["hidden"], eps=m.get("norm_eps", 1e-5))
        self.tied = m.get("tied_embeddings", False)
        if not self.tied:
            self.head = torch.nn.Linear(m["hidden"], m["vocab"], bias=False)

    def forward(self, tokens, targets):
        x = self.tokens(tokens)
        if self.positions is not None:
            x = x + self.positions.weight[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x)
        logits = x @ self.tokens.weight.T if self.tied else self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("--seq", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with open(args.spec, "rb") as f:
        spec = tomllib.load(f)
    m = spec["model"]
    seq = args.seq or spec["training"].get("seq_len", m["max_seq"])
    batch = args.micro_batch or spec["training"]["micro_batch"]
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count())
    model = Model(m)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, min(m["vocab"], 256), (batch, seq))
    targets = torch.randint(0, min(m["vocab"], 256), (batch, seq))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        return loss.item()

    step()
    times = []
    for _ in range(max(args.steps, 1)):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"step_s": statistics.median(times), "peak_rss_bytes": peak, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
