"""Loads a consolidated zeroshard MLP with the official safetensors library
into PyTorch and checks it against what the engine computed.

usage: check_mlp.py MODEL.safetensors EVAL.json LAYERS WIDTH ACTIVATION
"""
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def main():
    path, eval_path, layers, width, activation = sys.argv[1:6]
    layers, width = int(layers), int(width)
    state = load_file(path)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    assert metadata.get("format") == "pt", f"__metadata__ format is {metadata.get('format')!r}"

    # nn.Sequential names: Linear j at index j, or 2j with activations between.
    modules = []
    for j in range(layers):
        modules.append(torch.nn.Linear(width, width))
        if activation != "none" and j + 1 < layers:
            modules.append(torch.nn.ReLU() if activation == "relu" else torch.nn.GELU())
    model = torch.nn.Sequential(*modules)
    expected = dict(model.state_dict())
    weights = {k: v for k, v in state.items() if not k.startswith("optim.")}
    assert set(weights) == set(expected), f"names {sorted(weights)} != {sorted(expected)}"
    for name, tensor in expected.items():
        assert weights[name].shape == tensor.shape, (name, weights[name].shape, tensor.shape)
        assert weights[name].dtype == torch.float32, (name, weights[name].dtype)
    model.load_state_dict(weights, strict=True)

    record = json.load(open(eval_path))
    x = torch.tensor(record["x"], dtype=torch.float32)
    y = torch.tensor(record["y"], dtype=torch.float32)
    engine_out = torch.tensor(record["output"], dtype=torch.float32)
    with torch.no_grad():
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y).item()
    diff = (out - engine_out).abs().max().item()
    scale = engine_out.abs().max().item()
    print(f"max |torch - engine| = {diff:.3e} (scale {scale:.3e}); "
          f"loss torch {loss:.8f} engine {record['loss']:.8f}")
    assert diff <= 1e-5 * max(scale, 1.0), "outputs differ"
    assert abs(loss - record["loss"]) <= 1e-5 * max(abs(loss), 1e-3), "losses differ"
    print("OK")


if __name__ == "__main__":
    main()
