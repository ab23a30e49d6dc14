#include "worker/zero/optimizer.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "worker/model/parallel.h"

// The inner loops below are written so GCC vectorizes them (the target builds
// with -O3 -fno-math-errno): restrict-qualified pointers, no branches inside,
// every scalar hoisted and already rounded to float the way PyTorch rounds it
// (a Python float hyperparameter becomes a float scalar in the CPU kernel).

namespace zeroshard {
namespace {

// Elements per thread's range, at least: smaller updates stay on the caller.
constexpr int64_t kParallelGrain = 1 << 16;

// d = g + wd * p (PyTorch: grad.add(param, alpha=weight_decay)).
template <bool kDecay>
inline float DecayedGrad(float g, float p, float wd) {
  if constexpr (kDecay) {
    return g + wd * p;
  } else {
    return g;
  }
}

// Calls f(std::true_type{}) or f(std::false_type{}): turns a runtime flag into
// a template argument.
template <typename F>
void DispatchBool(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// SGD without momentum: p += -lr * d.
template <bool kDecay>
void SgdPlain(float* __restrict p, const float* __restrict g, int64_t n, float wd, float neg_lr) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = DecayedGrad<kDecay>(g[i], p[i], wd);
    p[i] = p[i] + neg_lr * d;
  }
}

// SGD with momentum. First step: buf = clone(d). Later steps:
// buf.mul_(momentum).add_(d, alpha=1 - dampening). Then d = buf, or with
// nesterov d = d.add(buf, alpha=momentum); finally p.add_(d, alpha=-lr).
template <bool kDecay, bool kFirst, bool kNesterov>
void SgdMomentum(float* __restrict p, const float* __restrict g, float* __restrict buf, int64_t n,
                 float wd, float momentum, float one_minus_dampening, float neg_lr) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = DecayedGrad<kDecay>(g[i], p[i], wd);
    float b;
    if constexpr (kFirst) {
      b = d;
    } else {
      b = buf[i] * momentum;
      b = b + one_minus_dampening * d;
    }
    buf[i] = b;
    const float update = kNesterov ? d + momentum * b : b;
    p[i] = p[i] + neg_lr * update;
  }
}

// The float scalars of one Adam step, in PyTorch's rounding.
struct AdamScalars {
  float wd;               // L2 weight decay (Adam only)
  float param_scale;      // AdamW: param.mul_(1 - lr * weight_decay) first
  float beta1;            // exp_avg.mul_(beta1)
  float one_minus_beta1;  // .add_(grad, alpha=1 - beta1)
  float beta2;            // exp_avg_sq.mul_(beta2)
  float one_minus_beta2;  // .addcmul_(grad, grad, value=1 - beta2)
  float bc2_sqrt;         // exp_avg_sq.sqrt() / bias_correction2_sqrt
  float eps;              // .add_(eps)
  float neg_step_size;    // param.addcdiv_(exp_avg, denom, value=-step_size)
};

// PyTorch 1.13 _single_tensor_adam / _single_tensor_adamw, per element:
//   param = param * (1 - lr * wd)                 (AdamW with weight decay)
//   grad = grad + wd * param                      (Adam with weight decay)
//   m = m * b1;  m = m + (1 - b1) * grad
//   v = v * b2;  v = v + ((1 - b2) * grad) * grad
//   denom = sqrt(v) / sqrt(bc2) + eps
//   param = param + ((-step_size) * m) / denom
// AdamW's scaling is fused into the same pass (same arithmetic, one fewer
// sweep over the parameters).
template <bool kL2, bool kDecoupled>
void AdamUpdate(float* __restrict p, const float* __restrict g, float* __restrict m,
                float* __restrict v, int64_t n, const AdamScalars& s) {
  const AdamScalars c = s;  // local copy: no aliasing with the arrays
  for (int64_t i = 0; i < n; ++i) {
    float param = p[i];
    if constexpr (kDecoupled) param = param * c.param_scale;
    const float grad = DecayedGrad<kL2>(g[i], param, c.wd);
    float mi = m[i] * c.beta1;
    mi = mi + c.one_minus_beta1 * grad;
    float vi = v[i] * c.beta2;
    vi = vi + (c.one_minus_beta2 * grad) * grad;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    p[i] = param + (c.neg_step_size * mi) / denom;
  }
}

// x *= factor.
void Scale(float* __restrict x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * factor;
}

class SgdOptimizer : public Optimizer {
 public:
  SgdOptimizer(int64_t n, double momentum, double dampening, double weight_decay, bool nesterov)
      : Optimizer(n, momentum != 0.0 ? 1 : 0),
        momentum_(momentum),
        dampening_(dampening),
        weight_decay_(weight_decay),
        nesterov_(nesterov) {}

  const char* name() const override { return "sgd"; }

  absl::Status Step(float* params, const float* grads, int64_t n, double lr) override {
    if (absl::Status s = CheckStepArgs(params, grads, n, lr); !s.ok()) return s;
    const float wd = static_cast<float>(weight_decay_);
    const float neg_lr = static_cast<float>(-lr);
    const bool decay = weight_decay_ != 0.0;
    if (momentum_ == 0.0) {
      DispatchBool(decay,
                   [&](auto d) { SgdPlain<decltype(d)::value>(params, grads, n, wd, neg_lr); });
    } else {
      const float mom = static_cast<float>(momentum_);
      const float omd = static_cast<float>(1.0 - dampening_);
      float* buf = exp_avg_.data();
      // One branch-free loop per combination of the three flags.
      DispatchBool(decay, [&](auto d) {
        DispatchBool(step_ == 0, [&](auto first) {
          DispatchBool(nesterov_, [&](auto nv) {
            SgdMomentum<decltype(d)::value, decltype(first)::value, decltype(nv)::value>(
                params, grads, buf, n, wd, mom, omd, neg_lr);
          });
        });
      });
    }
    ++step_;
    return absl::OkStatus();
  }

 private:
  const double momentum_;
  const double dampening_;
  const double weight_decay_;
  const bool nesterov_;
};

class AdamOptimizer : public Optimizer {
 public:
  // decoupled: AdamW (decay the parameter) rather than Adam (L2 on the grad).
  AdamOptimizer(int64_t n, bool decoupled, double beta1, double beta2, double eps,
                double weight_decay)
      : Optimizer(n, 2),
        decoupled_(decoupled),
        beta1_(beta1),
        beta2_(beta2),
        eps_(eps),
        weight_decay_(weight_decay) {}

  const char* name() const override { return decoupled_ ? "adamw" : "adam"; }

  absl::Status Step(float* params, const float* grads, int64_t n, double lr) override {
    if (absl::Status s = CheckStepArgs(params, grads, n, lr); !s.ok()) return s;
    const int64_t t = step_ + 1;  // PyTorch increments state["step"] first
    // Python-float (double) arithmetic in PyTorch; only the results that
    // reach a tensor kernel are rounded to float.
    const double bias_correction1 = 1.0 - std::pow(beta1_, static_cast<double>(t));
    const double bias_correction2 = 1.0 - std::pow(beta2_, static_cast<double>(t));
    const double step_size = lr / bias_correction1;
    const double bias_correction2_sqrt = std::sqrt(bias_correction2);

    AdamScalars s;
    s.wd = static_cast<float>(weight_decay_);
    s.param_scale = static_cast<float>(1.0 - lr * weight_decay_);
    s.beta1 = static_cast<float>(beta1_);
    s.one_minus_beta1 = static_cast<float>(1.0 - beta1_);
    s.beta2 = static_cast<float>(beta2_);
    s.one_minus_beta2 = static_cast<float>(1.0 - beta2_);
    s.bc2_sqrt = static_cast<float>(bias_correction2_sqrt);
    s.eps = static_cast<float>(eps_);
    s.neg_step_size = static_cast<float>(-step_size);
    const bool decay = weight_decay_ != 0.0;
    DispatchBool(decay && !decoupled_, [&](auto l2) {
      DispatchBool(decay && decoupled_, [&](auto decoupled) {
        // Elementwise, so split among the compute threads with the same
        // results whatever their number.
        ParallelFor(n, kParallelGrain, [&](int64_t begin, int64_t end) {
          AdamUpdate<decltype(l2)::value, decltype(decoupled)::value>(
              params + begin, grads + begin, exp_avg_.data() + begin, exp_avg_sq_.data() + begin,
              end - begin, s);
        });
      });
    });
    step_ = t;
    return absl::OkStatus();
  }

 private:
  const bool decoupled_;
  const double beta1_;
  const double beta2_;
  const double eps_;
  const double weight_decay_;
};

absl::Status CheckNonNegative(const std::string& optimizer, const char* what, double value) {
  if (!std::isfinite(value) || value < 0.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(optimizer, ": invalid ", what, " ", value, " (must be finite and >= 0)"));
  }
  return absl::OkStatus();
}

absl::Status CheckBeta(const std::string& optimizer, const char* what, double value) {
  if (!(value >= 0.0 && value < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(optimizer, ": invalid ", what, " ", value, " (must be in [0, 1))"));
  }
  return absl::OkStatus();
}

}  // namespace

Optimizer::Optimizer(int64_t n, int buffers) : size_(n) {
  if (buffers >= 1) exp_avg_.assign(static_cast<size_t>(n), 0.0f);
  if (buffers >= 2) exp_avg_sq_.assign(static_cast<size_t>(n), 0.0f);
}

int64_t Optimizer::StateBytes() const {
  return static_cast<int64_t>((exp_avg_.size() + exp_avg_sq_.size()) * sizeof(float));
}

absl::Status Optimizer::CheckStepArgs(const float* params, const float* grads, int64_t n,
                                      double lr) const {
  if (n != size_) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": Step got ", n, " elements but the state holds ", size_));
  }
  if (n > 0 && (params == nullptr || grads == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": Step got a null buffer"));
  }
  if (!std::isfinite(lr) || lr < 0.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": invalid learning rate ", lr, " (must be finite and >= 0)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(const std::string& name, int64_t n,
                                                         const OptimizerOptions& options) {
  const bool sgd = name == "sgd";
  const bool adam = name == "adam";
  const bool adamw = name == "adamw";
  if (!sgd && !adam && !adamw) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown optimizer \"", name, "\" (expected adam, adamw or sgd)"));
  }
  if (n < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": negative shard size ", n));
  }
  const OptimizerOptions defaults;
  const double weight_decay = options.weight_decay.value_or(adamw ? 1e-2 : 0.0);
  if (absl::Status s = CheckNonNegative(name, "weight_decay", weight_decay); !s.ok()) return s;

  if (sgd) {
    if (options.beta1 != defaults.beta1 || options.beta2 != defaults.beta2 ||
        options.eps != defaults.eps) {
      return absl::InvalidArgumentError(
          "sgd: betas and eps apply only to adam and adamw; leave them at their defaults");
    }
    if (absl::Status s = CheckNonNegative(name, "momentum", options.momentum); !s.ok()) return s;
    if (!std::isfinite(options.dampening)) {
      return absl::InvalidArgumentError(
          absl::StrCat("sgd: invalid dampening ", options.dampening, " (must be finite)"));
    }
    if (options.nesterov && (options.momentum <= 0.0 || options.dampening != 0.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sgd: nesterov momentum requires momentum > 0 and dampening == 0 (got momentum ",
          options.momentum, ", dampening ", options.dampening, ")"));
    }
    return std::unique_ptr<Optimizer>(std::make_unique<SgdOptimizer>(
        n, options.momentum, options.dampening, weight_decay, options.nesterov));
  }

  if (options.momentum != defaults.momentum || options.dampening != defaults.dampening ||
      options.nesterov != defaults.nesterov) {
    return absl::InvalidArgumentError(
        absl::StrCat(name,
                     ": momentum, dampening and nesterov apply only to sgd; leave them at their "
                     "defaults"));
  }
  if (absl::Status s = CheckBeta(name, "beta1", options.beta1); !s.ok()) return s;
  if (absl::Status s = CheckBeta(name, "beta2", options.beta2); !s.ok()) return s;
  if (absl::Status s = CheckNonNegative(name, "eps", options.eps); !s.ok()) return s;
  return std::unique_ptr<Optimizer>(std::make_unique<AdamOptimizer>(
      n, adamw, options.beta1, options.beta2, options.eps, weight_decay));
}

double SquaredL2Norm(const float* x, int64_t n) {
  // Eight independent partial sums: a fixed summation order that still lets
  // the compiler keep several vector accumulators busy.
  constexpr int kLanes = 8;
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const double v = static_cast<double>(x[i + k]);
      acc[k] += v * v;
    }
  }
  for (int k = 0; i < n; ++i, ++k) {
    const double v = static_cast<double>(x[i]);
    acc[k] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

double ClipCoefficient(double total_norm, double max_norm) {
  const double coefficient = max_norm / (total_norm + 1e-6);
  // NaN passes through, as torch.clamp(nan, max=1) does.
  return coefficient > 1.0 ? 1.0 : coefficient;
}

void ScaleInPlace(float* x, int64_t n, float factor) { Scale(x, n, factor); }

}  // namespace zeroshard
