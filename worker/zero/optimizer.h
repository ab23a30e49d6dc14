// Optimizers that update one rank's fp32 parameter shard in place.
//
// Each follows torch.optim's single-tensor implementation (PyTorch 1.13 / 2.x;
// foreach=False, fused=False, amsgrad=False, maximize=False), including its
// order of float operations and which scalars are rounded to float first, so
// a shard updated here matches the same elements updated by PyTorch to within
// float rounding (PyTorch's vectorized CPU kernels may fuse a multiply-add
// where this code rounds twice). PyTorch 2.x computes Adam's first moment with
// lerp_ instead of mul_/add_; that too differs only in rounding.
//
// ZeRO shards the flattened parameters, and every update rule here is
// elementwise, so updating each rank's slice with its own state gives the
// same result as updating the whole model at once.
#ifndef ZEROSHARD_WORKER_ZERO_OPTIMIZER_H_
#define ZEROSHARD_WORKER_ZERO_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace zeroshard {

// torch.optim.Adam / AdamW's default learning rate. (SGD has none in 1.13.)
inline constexpr double kAdamDefaultLr = 1e-3;

// Hyperparameters, with PyTorch's defaults. The learning rate is not here: it
// is passed to every Step() so the caller can run a schedule.
struct OptimizerOptions {
  // SGD only.
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  // Adam / AdamW only.
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  // Unset: the optimizer's default (0 for SGD and Adam, 1e-2 for AdamW). SGD
  // and Adam add weight_decay * param to the gradient (L2); AdamW instead
  // scales the parameter by (1 - lr * weight_decay) before the Adam step.
  std::optional<double> weight_decay;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of params[0, n) with grads[0, n) at learning rate `lr`, then
  // step() + 1. `n` must equal size(); INVALID_ARGUMENT (nothing changed) for
  // a different n, null pointers, or lr negative or not finite.
  virtual absl::Status Step(float* params, const float* grads, int64_t n, double lr) = 0;

  // "sgd", "adam" or "adamw".
  virtual const char* name() const = 0;
  // Elements of the shard the state was sized for.
  int64_t size() const { return size_; }
  // Steps taken (PyTorch's state["step"]); restore it with set_step() when
  // loading a checkpoint. SGD has no step counter in PyTorch; here step() == 0
  // is what marks its momentum buffer as not yet initialized (PyTorch's
  // "momentum_buffer is None"), so restore the buffer and step together.
  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }

  // Bytes of optimizer state (the moment buffers), for memory accounting.
  virtual int64_t StateBytes() const;
  // The state buffers (size() floats each), for checkpointing; null when the
  // optimizer has no such state. Adam / AdamW: exp_avg and exp_avg_sq. SGD
  // with momentum: exp_avg() is the momentum buffer; exp_avg_sq() is null.
  // SGD without momentum: both null.
  // In the memory of the backend that made the optimizer (backend.h).
  virtual float* exp_avg() { return exp_avg_.empty() ? nullptr : exp_avg_.data(); }
  virtual float* exp_avg_sq() { return exp_avg_sq_.empty() ? nullptr : exp_avg_sq_.data(); }
  const float* exp_avg() const { return const_cast<Optimizer*>(this)->exp_avg(); }
  const float* exp_avg_sq() const { return const_cast<Optimizer*>(this)->exp_avg_sq(); }

 protected:
  // Allocates `buffers` (0, 1 or 2) zeroed state arrays of n floats.
  Optimizer(int64_t n, int buffers);
  // The checks Step() documents.
  absl::Status CheckStepArgs(const float* params, const float* grads, int64_t n, double lr) const;

  std::vector<float> exp_avg_;
  std::vector<float> exp_avg_sq_;
  int64_t step_ = 0;

 private:
  int64_t size_ = 0;
};

// An optimizer for a shard of n >= 0 elements: "sgd", "adam" or "adamw".
// INVALID_ARGUMENT for an unknown name, n < 0, a hyperparameter PyTorch would
// reject (negative momentum / weight decay / eps, betas outside [0, 1),
// nesterov without momentum or with dampening, non-finite values), or one
// the named optimizer does not use set to a non-default value (e.g. momentum
// for adam), which is almost certainly a configuration mistake.
absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(const std::string& name, int64_t n,
                                                         const OptimizerOptions& options = {});

// sum(x[i]^2) over [0, n), accumulated in double in a fixed order (the same
// result for the same input on every run). Ranks add their shards' values to
// get the global squared gradient norm for clipping.
double SquaredL2Norm(const float* x, int64_t n);

// torch.nn.utils.clip_grad_norm_'s scale for gradients whose global L2 norm
// is `total_norm`: min(1, max_norm / (total_norm + 1e-6)).
double ClipCoefficient(double total_norm, double max_norm);

// x[i] *= factor over [0, n).
void ScaleInPlace(float* x, int64_t n, float factor);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_OPTIMIZER_H_
