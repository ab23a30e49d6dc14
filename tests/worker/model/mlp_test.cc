#include "worker/model/mlp.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "tests/worker/model/test_util.h"

namespace zeroshard {
namespace {

using ::zeroshard::testing::ExpectGradientMatches;
using ::zeroshard::testing::FdOptions;
using ::zeroshard::testing::ParamStore;
using ::zeroshard::testing::RandomVector;

std::unique_ptr<MlpModel> MakeMlp(int layers, int64_t width, const std::string& activation) {
  auto model = MlpModel::Create({layers, width, activation});
  EXPECT_TRUE(model.ok()) << model.status();
  return std::move(model).value();
}

void ExpectTensor(const TensorSpec& t, const std::string& name, std::vector<int64_t> shape,
                  const std::string& unit) {
  EXPECT_EQ(t.name, name);
  EXPECT_EQ(t.shape, shape) << name;
  EXPECT_EQ(t.dtype, "F32") << name;
  EXPECT_EQ(t.unit, unit) << name;
}

TEST(MlpSpecTest, WithoutActivationModulesAreConsecutive) {
  auto model = MakeMlp(3, 4, "none");
  const auto& t = model->Spec().tensors;
  ASSERT_EQ(t.size(), 6u);
  ExpectTensor(t[0], "0.weight", {4, 4}, "0");
  ExpectTensor(t[1], "0.bias", {4}, "0");
  ExpectTensor(t[2], "1.weight", {4, 4}, "1");
  ExpectTensor(t[3], "1.bias", {4}, "1");
  ExpectTensor(t[4], "2.weight", {4, 4}, "2");
  ExpectTensor(t[5], "2.bias", {4}, "2");
  EXPECT_EQ(model->ForwardOps(), (std::vector<int>{0, 1, 2}));
}

TEST(MlpSpecTest, WithActivationLinearsAreEvenModules) {
  for (const char* act : {"relu", "gelu"}) {
    auto model = MakeMlp(3, 5, act);
    const auto& t = model->Spec().tensors;
    ASSERT_EQ(t.size(), 6u);
    ExpectTensor(t[0], "0.weight", {5, 5}, "0");
    ExpectTensor(t[1], "0.bias", {5}, "0");
    ExpectTensor(t[2], "2.weight", {5, 5}, "2");
    ExpectTensor(t[3], "2.bias", {5}, "2");
    ExpectTensor(t[4], "4.weight", {5, 5}, "4");
    ExpectTensor(t[5], "4.bias", {5}, "4");
    EXPECT_EQ(model->ForwardOps(), (std::vector<int>{0, 1, 2}));
  }
}

// The engine plans from common/model_zoo's spec and drives this model: the two
// must list the same tensors in the same order.
void ExpectSameSpec(const ModelSpec& got, const ModelSpec& want) {
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (size_t i = 0; i < got.tensors.size(); ++i) {
    EXPECT_EQ(got.tensors[i].name, want.tensors[i].name) << i;
    EXPECT_EQ(got.tensors[i].shape, want.tensors[i].shape) << want.tensors[i].name;
    EXPECT_EQ(got.tensors[i].dtype, want.tensors[i].dtype) << want.tensors[i].name;
    EXPECT_EQ(got.tensors[i].unit, want.tensors[i].unit) << want.tensors[i].name;
  }
}

TEST(MlpSpecTest, MatchesModelZoo) {
  for (const char* act : {"none", "relu", "gelu"}) {
    for (int layers : {1, 4}) {
      auto zoo = MlpSpec(layers, 7, act);
      ASSERT_TRUE(zoo.ok()) << zoo.status();
      ExpectSameSpec(MakeMlp(layers, 7, act)->Spec(), *zoo);
    }
  }
}

TEST(MlpSpecTest, CreateRejectsBadConfigs) {
  EXPECT_FALSE(MlpModel::Create({0, 4, "none"}).ok());
  EXPECT_FALSE(MlpModel::Create({2, 0, "none"}).ok());
  EXPECT_FALSE(MlpModel::Create({2, 4, "tanh"}).ok());
}

// Forward against a direct computation: relu(x W0^T + b0) W1^T + b1.
TEST(MlpModelTest, ForwardMatchesReference) {
  const int64_t w = 3, rows = 2;
  auto model = MakeMlp(2, w, "relu");
  ParamStore store(*model);
  store.InitFromModel(5);
  auto x = RandomVector(rows * w, -1, 1, 1);
  auto y = RandomVector(rows * w, -1, 1, 2);
  ASSERT_TRUE(model->SetBatch(x.data(), y.data(), rows).ok());
  const double loss = store.ForwardAll(*model);

  const auto& w0 = store.param(0);
  const auto& b0 = store.param(1);
  const auto& w1 = store.param(2);
  const auto& b1 = store.param(3);
  // The error model (tests/testing/error_model.h): each float32 output of a
  // layer is within gamma_{w+1} of the sum of its terms' magnitudes, and an
  // error e in its input h (ReLU passes it on, 1-Lipschitz) adds |w1| e.
  const double gamma = testing::SumErrorBound(w + 1);
  double want_loss = 0, loss_tolerance = 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> h(w), h_error(w);
    for (int64_t o = 0; o < w; ++o) {
      double z = b0[o], terms = std::fabs(b0[o]);
      for (int64_t i = 0; i < w; ++i) {
        z += double{w0[o * w + i]} * x[r * w + i];
        terms += std::fabs(double{w0[o * w + i]} * x[r * w + i]);
      }
      h[o] = std::max(z, 0.0);
      h_error[o] = gamma * terms;
    }
    for (int64_t o = 0; o < w; ++o) {
      double z = b1[o], terms = std::fabs(b1[o]), carried = 0;
      for (int64_t i = 0; i < w; ++i) {
        z += w1[o * w + i] * h[i];
        terms += std::fabs(w1[o * w + i] * h[i]);
        carried += std::fabs(w1[o * w + i]) * h_error[i];
      }
      const double error = gamma * terms + carried;
      EXPECT_NEAR(model->Output()[r * w + o], z, error);
      const double residual = z - y[r * w + o];
      want_loss += residual * residual;
      loss_tolerance += 2 * std::fabs(residual) * error + error * error;
    }
  }
  // The mean of rows * w squared residuals: their errors, and the sum's own.
  EXPECT_NEAR(loss, want_loss / (rows * w),
              (loss_tolerance + testing::SumErrorBound(rows * w) * want_loss) / (rows * w));
}

class MlpGradientTest : public ::testing::TestWithParam<const char*> {};

TEST_P(MlpGradientTest, MatchesFiniteDifferencesOfLoss) {
  const int64_t w = 6, rows = 4;
  auto model = MakeMlp(3, w, GetParam());
  ParamStore store(*model);
  store.InitFromModel(11);
  auto x = RandomVector(rows * w, -2, 2, 3);
  auto y = RandomVector(rows * w, -1, 1, 4);
  ASSERT_TRUE(model->SetBatch(x.data(), y.data(), rows).ok());
  store.ForwardAll(*model);
  ASSERT_TRUE(store.BackwardAll(*model).ok());

  FdOptions opt;
  opt.eps = 1e-3f;
  opt.atol = 5e-4;
  opt.rtol = 2e-2;
  opt.max_checks = 8;
  for (int i = 0; i < store.num_tensors(); ++i) {
    opt.pick_seed = 100 + i;
    const std::vector<float> grad = store.grad(i);  // FD forwards don't touch grads, but copy
    ExpectGradientMatches([&] { return store.ForwardAll(*model); }, store.param(i).data(),
                          grad.data(), grad.size(), opt, model->Spec().tensors[i].name);
  }
}

INSTANTIATE_TEST_SUITE_P(Activations, MlpGradientTest, ::testing::Values("none", "relu", "gelu"));

TEST(MlpModelTest, BackwardAddsIntoGradients) {
  const int64_t w = 4, rows = 3;
  auto model = MakeMlp(2, w, "gelu");
  ParamStore store(*model);
  store.InitFromModel(1);
  auto x = RandomVector(rows * w, -1, 1, 5);
  auto y = RandomVector(rows * w, -1, 1, 6);
  ASSERT_TRUE(model->SetBatch(x.data(), y.data(), rows).ok());
  store.ForwardAll(*model);
  ASSERT_TRUE(store.BackwardAll(*model).ok());
  std::vector<std::vector<float>> once;
  for (int i = 0; i < store.num_tensors(); ++i) once.push_back(store.grad(i));
  // A second backward pass without zeroing doubles every gradient.
  for (int op = 1; op >= 0; --op) {
    UnitTensors grads = store.Grads(op);
    ASSERT_TRUE(model->Backward(op, store.Params(op), grads).ok());
  }
  for (int i = 0; i < store.num_tensors(); ++i) {
    for (size_t k = 0; k < once[i].size(); ++k) {
      // The second pass adds its products into the first's sums (OpenBLAS's
      // beta = 1 may do it block by block): the same terms in another order,
      // within 2 gamma_n of their scale; with |x|, |y| <= 1 and these widths
      // that scale is below |g| + 0.1, and 2 gamma_32 < 4e-6.
      EXPECT_NEAR(store.grad(i)[k], 2 * once[i][k],
                  2 * testing::SumErrorBound(32) * (std::fabs(once[i][k]) + 0.1));
    }
  }
}

TEST(MlpModelTest, OverwriteModeWritesWhatAddModeAddsToZeros) {
  const int64_t w = 5, rows = 3;
  auto model = MakeMlp(2, w, "relu");
  ParamStore store(*model);
  store.InitFromModel(2);
  auto x = RandomVector(rows * w, -1, 1, 7);
  auto y = RandomVector(rows * w, -1, 1, 8);
  ASSERT_TRUE(model->SetBatch(x.data(), y.data(), rows).ok());
  store.ForwardAll(*model);
  ASSERT_TRUE(store.BackwardAll(*model).ok());  // into zeroed gradients
  std::vector<std::vector<float>> want;
  for (int i = 0; i < store.num_tensors(); ++i) want.push_back(store.grad(i));
  // Garbage (NaN) in every gradient: kOverwrite must not read it.
  store.ForwardAll(*model);
  for (int op = 1; op >= 0; --op) {
    UnitTensors grads = store.Grads(op);
    for (TensorView& g : grads) std::fill(g.data, g.data + g.elements(), NAN);
    ASSERT_TRUE(model->BackwardInto(op, store.Params(op), grads, Model::GradMode::kOverwrite).ok());
  }
  for (int i = 0; i < store.num_tensors(); ++i) {
    ASSERT_EQ(store.grad(i), want[i]) << model->Spec().tensors[i].name;
  }
}

TEST(MlpModelTest, RejectsOutOfOrderOpsAndBadViews) {
  const int64_t w = 4, rows = 2;
  auto model = MakeMlp(3, w, "relu");
  ParamStore store(*model);
  auto x = RandomVector(rows * w, -1, 1, 7);
  EXPECT_EQ(model->Forward(0, store.Params(0)).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(model->SetBatch(x.data(), x.data(), rows).ok());
  EXPECT_EQ(model->Forward(1, store.Params(1)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(model->Forward(3, store.Params(0)).code(), absl::StatusCode::kOutOfRange);
  UnitTensors bad = store.Params(0);
  bad[0].shape = {w, w + 1};
  EXPECT_EQ(model->Forward(0, bad).code(), absl::StatusCode::kInvalidArgument);
  bad = store.Params(0);
  bad.pop_back();
  EXPECT_EQ(model->Forward(0, bad).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(model->Forward(0, store.Params(0)).ok());
  UnitTensors grads = store.Grads(0);
  EXPECT_EQ(model->Backward(0, store.Params(0), grads).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(model->Forward(1, store.Params(1)).ok());
  ASSERT_TRUE(model->Forward(2, store.Params(2)).ok());
  grads = store.Grads(0);
  EXPECT_EQ(model->Backward(0, store.Params(0), grads).code(),
            absl::StatusCode::kFailedPrecondition);
  grads = store.Grads(2);
  EXPECT_TRUE(model->Backward(2, store.Params(2), grads).ok());
  EXPECT_GT(model->ActivationBytes(), 0);
}

TEST(MlpModelTest, InitRowsInPartsEqualsWholeAndRespectsBounds) {
  const int64_t w = 50;
  auto model = MakeMlp(2, w, "relu");
  const float bound = 1.0f / std::sqrt(static_cast<float>(w));
  for (const TensorSpec& t : model->Spec().tensors) {
    const int64_t rows = t.shape[0];
    const int64_t row_elems = t.Elements() / rows;
    std::vector<float> whole(t.Elements()), parts(t.Elements());
    model->InitRows(t, 0, rows, 1234, whole.data());
    model->InitRows(t, 0, 17, 1234, parts.data());
    model->InitRows(t, 17, 18, 1234, parts.data() + 17 * row_elems);
    model->InitRows(t, 18, rows, 1234, parts.data() + 18 * row_elems);
    EXPECT_EQ(whole, parts) << t.name;
    float lo = 1, hi = -1;
    for (float v : whole) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    EXPECT_GE(lo, -bound) << t.name;
    EXPECT_LE(hi, bound) << t.name;
    // Spread over most of the range (not constant, not a tiny interval).
    EXPECT_LT(lo, -0.8f * bound) << t.name;
    EXPECT_GT(hi, 0.8f * bound) << t.name;
    // Another seed gives other values.
    std::vector<float> other(t.Elements());
    model->InitRows(t, 0, rows, 1235, other.data());
    EXPECT_NE(whole, other) << t.name;
  }
  // Different tensors of the same shape get different values.
  const auto& t = model->Spec().tensors;
  std::vector<float> w0(t[0].Elements()), w1(t[2].Elements());
  model->InitRows(t[0], 0, w, 1, w0.data());
  model->InitRows(t[2], 0, w, 1, w1.data());
  EXPECT_NE(w0, w1);
}

}  // namespace
}  // namespace zeroshard
