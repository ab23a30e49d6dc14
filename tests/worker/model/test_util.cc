#include "tests/worker/model/test_util.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "gtest/gtest.h"
#include "worker/model/model_util.h"

namespace zeroshard {
namespace testing {

std::vector<float> RandomVector(int64_t n, float low, float high, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(low, high);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void ExpectGradientMatches(const std::function<double()>& f, float* x, const float* analytic,
                           int64_t n, const FdOptions& options, const std::string& what) {
  std::vector<int64_t> indices(n);
  std::iota(indices.begin(), indices.end(), 0);
  if (options.max_checks > 0 && options.max_checks < n) {
    std::mt19937 rng(options.pick_seed);
    std::shuffle(indices.begin(), indices.end(), rng);
    indices.resize(options.max_checks);
  }
  for (int64_t i : indices) {
    const float saved = x[i];
    x[i] = saved + options.eps;
    const double plus = f();
    x[i] = saved - options.eps;
    const double minus = f();
    x[i] = saved;
    // The step actually taken, after rounding saved +- eps to f32.
    const double step =
        (static_cast<double>(saved) + options.eps) - (static_cast<double>(saved) - options.eps);
    const double fd = (plus - minus) / step;
    EXPECT_NEAR(analytic[i], fd, options.atol + options.rtol * std::fabs(fd))
        << what << "[" << i << "]";
  }
}

double Dot(const float* w, const float* y, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(w[i]) * y[i];
  return sum;
}

ParamStore::ParamStore(const Model& model)
    : model_(model), unit_tensors_(TensorsByUnit(model.Spec())) {
  for (const TensorSpec& t : model.Spec().tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    params_.emplace_back(n, 0.0f);
    grads_.emplace_back(n, 0.0f);
  }
}

void ParamStore::InitFromModel(uint64_t seed) {
  const auto& tensors = model_.Spec().tensors;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t rows = tensors[i].shape.empty() ? 1 : tensors[i].shape[0];
    model_.InitRows(tensors[i], 0, rows, seed, params_[i].data());
  }
}

void ParamStore::ZeroGrads() {
  for (auto& g : grads_) std::fill(g.begin(), g.end(), 0.0f);
}

UnitTensors ParamStore::Views(std::vector<std::vector<float>>& buffers, int unit) {
  UnitTensors views;
  for (int i : unit_tensors_[unit]) {
    views.push_back({buffers[i].data(), model_.Spec().tensors[i].shape});
  }
  return views;
}

UnitTensors ParamStore::Params(int unit) { return Views(params_, unit); }
UnitTensors ParamStore::Grads(int unit) { return Views(grads_, unit); }

double ParamStore::ForwardAll(Model& model) {
  const std::vector<int>& ops = model.ForwardOps();
  for (int op = 0; op < static_cast<int>(ops.size()); ++op) {
    absl::Status s = model.Forward(op, Params(ops[op]));
    EXPECT_TRUE(s.ok()) << "forward op " << op << ": " << s;
    if (!s.ok()) return std::numeric_limits<double>::quiet_NaN();
  }
  return model.Loss();
}

absl::Status ParamStore::BackwardAll(Model& model) {
  ZeroGrads();
  const std::vector<int>& ops = model.ForwardOps();
  for (int op = static_cast<int>(ops.size()) - 1; op >= 0; --op) {
    UnitTensors grads = Grads(ops[op]);
    absl::Status s = model.Backward(op, Params(ops[op]), grads);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace testing
}  // namespace zeroshard
