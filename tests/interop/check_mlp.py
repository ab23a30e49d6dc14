"""Loads a consolidated zeroshard MLP with the official safetensors library
into PyTorch and checks it against what the engine computed.

usage: check_mlp.py MODEL.safetensors EVAL.json LAYERS WIDTH ACTIVATION
"""
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

import error_model


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
    x = torch.tensor(record["x"], dtype=torch.float64)
    y = torch.tensor(record["y"], dtype=torch.float64)
    engine_out = torch.tensor(record["output"], dtype=torch.float64)
    with torch.no_grad():
        # The loaded model in float64: the exact reference, with the bound of
        # the engine's float32 rounding around it.
        model = model.double()
        out = model(x)
        linears = [m for m in model if isinstance(m, torch.nn.Linear)]
        bound = error_model.mlp_output_bound(linears, x, activation)
        loss = torch.nn.functional.mse_loss(out, y).item()
        loss_bound = error_model.mse_loss_bound(out, y, bound)
    excess = ((engine_out - out).abs() - bound).max().item()
    diff = (engine_out - out).abs().max().item()
    print(f"max |engine - exact| = {diff:.3e}, bound {bound.max().item():.3e}; "
          f"loss exact {loss:.8f} engine {record['loss']:.8f} (bound {loss_bound:.3e})")
    assert excess <= 0, f"outputs differ by up to {excess:.3e} beyond the error bound"
    assert abs(loss - record["loss"]) <= loss_bound, "losses differ beyond the error bound"
    print("OK")


if __name__ == "__main__":
    main()
