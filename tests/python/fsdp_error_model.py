"""How far one Adam step of seed 001's model (nn.Sequential of Linear layers, MSE)
may move between two runs that start from bitwise the same state but sum in another
order (another world size or mesh: other local batches, other reduce-scatter groups).

The gradient. Every float32 stage of forward, loss, backward and the batch mean is a
sum of products; computed in any order it is within gamma(n) |A| |B| of the exact
value (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 3.1 and
3.5), and the stages' errors compose to gamma(m) * S with m the summed lengths
(forward L (d + 1), backward L d, the batch N, the ranks W, the loss 2) and S the
gradient computed on absolute values (|x|, |W|, |b|, |residual| + |y|): a bound on
each run's error, so two runs differ by at most 2 gamma(m) S.

The update. Adam's step u(g) = lr m^ / (sqrt(v^) + eps) with m = b1 m0 + (1 - b1) g,
v = b2 v0 + (1 - b2) g^2 (m0, v0 the loaded moments, bitwise equal in both runs) moves
by at most sup |du/dg| * dg, and on the interval |du/dg| <= lr [(1 - b1) / c1 /
(sqrt(v^min) + eps) + |m^|max (1 - b2) |g|max / (c2 sqrt(v^min) (sqrt(v^min) + eps)^2)]
with v^min = b2 v0 / c2 (g^2 >= 0), c1 = 1 - b1^t, c2 = 1 - b2^t. The elementwise
float32 arithmetic of the step itself adds a few roundings of |p| and |u| in each
run: 8 u (|p| + |u|)."""
import torch

U = 2.0 ** -24  # float32 unit roundoff


def gamma(n):
    return n * U / (1 - n * U)


def abs_gradient(params, x, y):
    """S for every parameter of Linear layers params = [(W, b), ...] (float64) on the
    whole batch x, y: the gradient of the MSE computed on absolute values."""
    acts = [x.abs()]
    a = x
    for w, b in params:
        a = a @ w.T + b
        acts.append(acts[-1] @ w.abs().T + b.abs())
    n = y.numel()
    delta = 2 * (acts[-1] + y.abs()) / n
    out = []
    for k in range(len(params) - 1, -1, -1):
        w, _ = params[k]
        out.append((delta.T @ acts[k], delta.sum(0)))
        delta = delta @ w.abs()
    return out[::-1]


def chain_length(layers, width, batch, world):
    return layers * (2 * width + 1) + batch + world + 2


def adam_step_bound(p, m0, v0, g, s, m, step, lr, betas=(0.9, 0.999), eps=1e-8):
    """Elementwise bound on |p_a - p_b| after Adam step `step` from the same p, m0, v0,
    where each run's gradient is within gamma(m) * s of g (float64 tensors)."""
    b1, b2 = betas
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    dg = 2 * gamma(m) * s
    g_max = g.abs() + dg
    m_hat_max = (b1 * m0.abs() + (1 - b1) * g_max) / c1
    root_min = (b2 * v0 / c2).sqrt()
    slope = lr * ((1 - b1) / c1 / (root_min + eps) +
                  m_hat_max * (1 - b2) * g_max / (c2 * root_min.clamp(min=1e-300) *
                                                  (root_min + eps) ** 2))
    update = lr * m_hat_max / (root_min + eps)
    return slope * dg + 8 * U * (p.abs() + update)
