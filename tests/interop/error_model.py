"""Error models for comparing the engine's float32 results with PyTorch
(the Python side of tests/testing/error_model.h).

The references here are computed in float64, so only the engine's float32
rounding is bounded: a float32 sum or dot product of n terms, in any order or
blocking (OpenBLAS picks its kernels per CPU), with or without fused
multiply-adds, is within gamma(n) * sum|terms| of the exact value (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1).
"""
import torch

U = 2.0 ** -24  # float32 unit roundoff


def gamma(n):
    return n * U / (1 - n * U)


def mlp_output_bound(linears, x, activation):
    """Elementwise bound on |engine output - exact| for nn.Sequential Linear
    layers (float64 weights) on input x (float64), with ReLU or no activation
    between them (both 1-Lipschitz and exact in float32).

    Layer k computes z = W a + b, a sum of width + 1 terms: its own rounding is
    <= gamma(width + 1) (|W| |a| + |b|); the error e of its input a passes
    through as |W| e. The output is rounded once more when stored (u |z|)."""
    assert activation in ("relu", "none"), "the model covers exact 1-Lipschitz activations"
    a = x
    e = torch.zeros_like(x)
    for j, layer in enumerate(linears):
        w, b = layer.weight.double(), layer.bias.double()
        z = a @ w.T + b
        e = e @ w.abs().T + gamma(w.shape[1] + 1) * (a.abs() @ w.abs().T + b.abs()) + U * z.abs()
        a = z.clamp(min=0) if activation == "relu" and j + 1 < len(linears) else z
    return e


def mse_loss_bound(out, y, e):
    """|engine MSE - exact| when each output is off by at most e: the squared
    residuals move by <= 2 |r| e + e^2, and their float32 mean over N terms
    adds gamma(N) of the sum."""
    r = out - y
    n = r.numel()
    return float(((2 * r.abs() * e + e * e).sum() + gamma(n) * (r * r).sum()) / n)
