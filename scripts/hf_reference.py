"""Reference check of shardc against Hugging Face transformers.

Creates small randomly initialised GPT-2 and Llama models with transformers, saves them,
computes logits with shardc (`shardc logits --hf`) at several meshes and compares them with
transformers' on the same tokens; then trains a few steps with shardc, saves the result with
`--save-hf`, loads it back in transformers and compares logits again. Prints a table and exits
non-zero on any mismatch. `--fixtures DIR` also writes the small models and their expected
logits that the Rust tests check (tests/data).

Usage: python scripts/hf_reference.py --shardc target/debug/shardc [--out out/hf] [--fixtures tests/data]
"""

import argparse
import json
import os
import subprocess
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

TOLERANCE = 1e-4
MESHES = ["dp=1,tp=1,pp=1", "dp=1,tp=2,pp=1", "dp=2,tp=2,pp=2"]


def make_model(family, size):
    torch.manual_seed(0 if family == "gpt2" else 1)
    if family == "gpt2":
        config = GPT2Config(vocab_size=size["vocab"], n_positions=size["positions"], n_embd=size["hidden"], n_layer=2, n_head=4,
                            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5)
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=2 * size["hidden"], num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=size["positions"], rms_norm_eps=1e-6,
                             rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
        model = LlamaForCausalLM(config)
    # Random norms and biases too (the defaults are ones and zeros), so every mapping counts.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.float().eval()


def tokens_for(size):
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, size["vocab"], (2, 8), generator=generator)


def shardc_logits(shardc, folder, tokens, mesh, out):
    text = ";".join(",".join(str(int(t)) for t in row) for row in tokens.tolist())
    subprocess.run([shardc, "logits", "--hf", folder, "--tokens", text, "--mesh", mesh, "-o", out], check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        data = json.load(f)
    return torch.tensor(data["values"], dtype=torch.float64).reshape(data["shape"])


def relative(ours, theirs):
    return float((ours - theirs).abs().max() / theirs.abs().max())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shardc", required=True)
    parser.add_argument("--out", default="out/hf")
    parser.add_argument("--fixtures", default=None)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows, failed = [], False
    size = {"vocab": 256, "positions": 64, "hidden": 32}
    for family in ["gpt2", "llama"]:
        model = make_model(family, size)
        folder = os.path.join(args.out, f"{family}-random")
        model.save_pretrained(folder, safe_serialization=True)
        tokens = tokens_for(size)
        with torch.no_grad():
            reference = model(tokens).logits.double()
        for mesh in MESHES:
            ours = shardc_logits(args.shardc, folder, tokens, mesh, os.path.join(args.out, f"{family}-logits.json"))
            error = relative(ours, reference)
            failed |= not error <= TOLERANCE
            rows.append((family, "logits", mesh, error))
        # Train with shardc, save as Hugging Face, load in transformers: same logits.
        trained = os.path.join(args.out, f"{family}-trained")
        subprocess.run([args.shardc, "run", "--hf", folder, "--steps", "3", "--seq", "8", "--micro-batch", "2", "--save-hf", trained], check=True, stdout=subprocess.DEVNULL)
        loaded = (GPT2LMHeadModel if family == "gpt2" else LlamaForCausalLM).from_pretrained(trained).float().eval()
        with torch.no_grad():
            reference = loaded(tokens).logits.double()
        ours = shardc_logits(args.shardc, trained, tokens, MESHES[0], os.path.join(args.out, f"{family}-trained-logits.json"))
        error = relative(ours, reference)
        failed |= not error <= TOLERANCE
        rows.append((family, "--save-hf reloaded", MESHES[0], error))
        if args.fixtures:
            small = {"vocab": 64, "positions": 16, "hidden": 16}
            fixture = os.path.join(args.fixtures, f"hf-tiny-{family}")
            model = make_model(family, small)
            model.save_pretrained(fixture, safe_serialization=True)
            tokens = tokens_for(small)
            with torch.no_grad():
                logits = model(tokens).logits.double()
            with open(os.path.join(fixture, "expected_logits.json"), "w") as f:
                json.dump({"tokens": tokens.tolist(), "shape": list(logits.shape), "values": [round(v, 9) for v in logits.flatten().tolist()]}, f)
    print(f"{'model':<8} {'check':<20} {'mesh':<16} {'max rel. error':>14}  match (<= {TOLERANCE:g})")
    for family, what, mesh, error in rows:
        print(f"{family:<8} {what:<20} {mesh:<16} {error:>14.2e}  {'yes' if error <= TOLERANCE else 'NO'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
