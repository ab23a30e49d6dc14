// Test helpers: random data, finite-difference gradient checks, and a tiny
// stand-in for the ZeRO engine that owns every parameter and gradient.
#ifndef ZEROSHARD_TESTS_WORKER_MODEL_TEST_UTIL_H_
#define ZEROSHARD_TESTS_WORKER_MODEL_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/model_spec.h"
#include "worker/model/model.h"

namespace zeroshard {
namespace testing {

// n values uniform in [low, high) from a fixed-seed generator.
std::vector<float> RandomVector(int64_t n, float low, float high, uint32_t seed);

// Tolerances of a central-difference check in f32: |fd - analytic| must be
// <= atol + rtol * |fd|. The error model: fd = (f(x+eps) - f(x-eps)) / 2eps
// with f evaluated in float32 (the loss in double over float32 outputs, each
// within gamma_n of its terms' scale F: tests/testing/error_model.h) is off
// by the rounding, <= 2 gamma_n F / 2eps, plus the truncation eps^2/6 |f'''|.
// With the tests' sizes (n <= ~100 terms, F <= ~10) and eps = 1e-2 the
// rounding is <= 6e-4 (atol 1e-3), and the truncation of these smooth kernels
// a percent of |fd| at most (rtol 1e-2). Checks with a smaller eps (near
// kinks, through exp) have F ~ 1: rounding <= 2 gamma_n / 2eps ~ 1e-4 at
// eps = 1e-3, within their atol.
struct FdOptions {
  float eps = 1e-2f;
  double atol = 1e-3;
  double rtol = 1e-2;
  // Check at most this many elements (picked at random, without
  // repetition); <= 0: all of them.
  int max_checks = 0;
  uint32_t pick_seed = 1;
};

// For each checked element i of x[0, n): the central difference of the
// scalar `f` (evaluated with x[i] nudged by +-eps, then restored) against
// analytic[i]. Reports failures through gtest, naming `what` and i.
void ExpectGradientMatches(const std::function<double()>& f, float* x, const float* analytic,
                           int64_t n, const FdOptions& options, const std::string& what);

// sum_i w[i] * y[i] in double: a scalar loss whose gradient at y is w.
double Dot(const float* w, const float* y, int64_t n);

// Owns one buffer per spec tensor for params and grads, like the engine,
// and drives a Model through full forward/backward passes.
class ParamStore {
 public:
  explicit ParamStore(const Model& model);

  int num_tensors() const { return static_cast<int>(params_.size()); }
  std::vector<float>& param(int tensor) { return params_[tensor]; }
  std::vector<float>& grad(int tensor) { return grads_[tensor]; }

  // Every tensor from model.InitRows over all its rows.
  void InitFromModel(uint64_t seed);
  void ZeroGrads();

  // Views of one unit's tensors, in spec order.
  UnitTensors Params(int unit);
  UnitTensors Grads(int unit);

  // All ops forward; returns the model's loss (NaN on an error status, which
  // is also reported through gtest).
  double ForwardAll(Model& model);
  // Zeroes the grads once, then runs every op backward (ADDing into them).
  absl::Status BackwardAll(Model& model);

 private:
  UnitTensors Views(std::vector<std::vector<float>>& buffers, int unit);

  const Model& model_;
  std::vector<std::vector<int>> unit_tensors_;
  std::vector<std::vector<float>> params_, grads_;
};

}  // namespace testing
}  // namespace zeroshard

#endif  // ZEROSHARD_TESTS_WORKER_MODEL_TEST_UTIL_H_
