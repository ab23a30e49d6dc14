"""Loads a consolidated zeroshard GPT with the official safetensors library
and runs a GPT-2 forward written with PyTorch operations (Hugging Face GPT-2
names and layouts: Conv1D weights [in, out], pre-LayerNorm, eps 1e-5,
GELU tanh, causal attention, LM head tied to wte) on the engine's validation
tokens, in float64; the engine's float32 loss must be within the error bound
of error_model.py (gpt_loss_bound below).

usage: check_gpt.py MODEL.safetensors EVAL.json N_LAYER N_HEAD
"""
import json
import math
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import error_model


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
    return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1)).item(), x


def gpt_loss_bound(w, final_hidden, loss, n_layer):
    """|engine float32 loss - exact|. Every product of the net (per block: the
    qkv projection, attention's two products, the output projection, the MLP's
    two; then the LM head) is within gamma(n) of its terms' scale, n <= 4c (the
    MLP's projection is the longest sum); LayerNorm renormalises the residual
    stream, so each carries its relative error into the final hidden state at
    most once: 6 per block + the head, relative to the logits' terms,
    S = max (|h| @ |wte|^T). The cross-entropy moves by at most 2 max|dz| (its
    gradient in the logits has l1 norm <= 2); its mean over the rows adds
    gamma(rows) of the loss, and the engine's exp (about 1 ulp) a few u."""
    wte = w["transformer.wte.weight"]
    c = wte.shape[1]
    terms = (final_hidden.abs().reshape(-1, c) @ wte.abs().T).max().item()
    logits = (6 * n_layer + 1) * error_model.gamma(4 * c) * terms
    rows = final_hidden.numel() // c
    return 2 * logits + error_model.gamma(rows) * abs(loss) + 4 * error_model.U


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
        loss, final_hidden = gpt2_loss(w, tokens, targets, n_layer, n_head)
        bound = gpt_loss_bound(w, final_hidden, loss, n_layer)
    print(f"loss exact {loss:.8f} engine {record['loss']:.8f} "
          f"(difference {abs(loss - record['loss']):.3e}, bound {bound:.3e})")
    assert abs(loss - record["loss"]) <= bound, "losses differ beyond the error bound"
    print("OK")


if __name__ == "__main__":
    main()
