"""Loads a consolidated zeroshard GPT with the official safetensors library
and runs a GPT-2 forward written with PyTorch operations (Hugging Face GPT-2
names and layouts: Conv1D weights [in, out], pre-LayerNorm, eps 1e-5,
GELU tanh, causal attention, LM head tied to wte) on the engine's validation
tokens; the loss must match the engine's within 1e-4.

usage: check_gpt.py MODEL.safetensors EVAL.json N_LAYER N_HEAD
"""
import json
import math
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def gpt2_loss(w, tokens, targets, n_layer, n_head):
    b, t = tokens.shape
    x = w["transformer.wte.weight"][tokens] + w["transformer.wpe.weight"][:t]
    c = x.shape[-1]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        h = F.layer_norm(x, (c,), w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps=1e-5)
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = qkv.split(c, dim=-1)
        q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // n_head)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = F.layer_norm(x, (c,), w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps=1e-5)
        h = F.gelu(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"], approximate="tanh")
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (c,), w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], eps=1e-5)
    logits = x @ w["transformer.wte.weight"].T
    return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1)).item()


def main():
    path, eval_path, n_layer, n_head = sys.argv[1:5]
    n_layer, n_head = int(n_layer), int(n_head)
    w = {k: v.double() for k, v in load_file(path).items() if not k.startswith("optim.")}
    c = w["transformer.wte.weight"].shape[1]
    expected = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
                "transformer.ln_f.bias"}
    for i in range(n_layer):
        for name in ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                     "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                     "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]:
            expected.add(f"transformer.h.{i}.{name}")
    assert set(w) == expected, f"unexpected names: {sorted(set(w) ^ expected)}"
    assert w["transformer.h.0.attn.c_attn.weight"].shape == (c, 3 * c)
    assert w["transformer.h.0.mlp.c_fc.weight"].shape == (c, 4 * c)
    record = json.load(open(eval_path))
    tokens = torch.tensor(record["tokens"], dtype=torch.long)
    targets = torch.tensor(record["targets"], dtype=torch.long)
    with torch.no_grad():
        loss = gpt2_loss(w, tokens, targets, n_layer, n_head)
    print(f"loss torch {loss:.8f} engine {record['loss']:.8f}")
    assert abs(loss - record["loss"]) <= 1e-4, "losses differ"
    print("OK")


if __name__ == "__main__":
    main()
