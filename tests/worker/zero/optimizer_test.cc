// Tests of the shard optimizers against PyTorch and against the update rules
// written out in double precision.
#include "worker/zero/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;

// The shared test problem: six parameters (one with a zero gradient on the
// first step, one starting at zero) and four steps of gradients. All values
// are exact in float, so PyTorch and C++ start from identical inputs.
constexpr int kN = 6;
constexpr float kP0[kN] = {0.5f, -1.25f, 2.0f, 0.0f, -0.375f, 3.0f};
constexpr float kGrads[4][kN] = {
    {0.25f, -0.5f, 1.5f, -0.125f, 0.0f, 2.0f},
    {-0.75f, 0.5f, 0.25f, 0.0625f, -1.0f, 1.0f},
    {0.5f, 0.125f, -2.0f, 0.25f, 0.75f, -0.5f},
    {1.0f, -0.25f, 0.5f, -0.5f, 0.375f, 0.0f},
};

// Reference values from PyTorch 1.13 (Debian's python3-torch), produced once
// by a throwaway script along the lines of
//   /usr/bin/python3 -c "import torch; p = torch.nn.Parameter(torch.tensor(P0));
//     opt = torch.optim.Adam([p], foreach=False); for each step t:
//     opt.param_groups[0]['lr'] = lrs[t]; p.grad = torch.tensor(G[t]); opt.step();
//     print('%.9g' % v for v in p.tolist())"
// with the constructor arguments and per-step learning rates of each test
// below; the *_momentum_buffer / *_exp_avg / *_exp_avg_sq arrays are
// opt.state[p] after the last step.

// SgdPlain
constexpr float kSgdPlainParams[3][6] = {
    {0.474999994f, -1.20000005f, 1.85000002f, 0.0125000002f, -0.375f, 2.79999995f},
    {0.512499988f, -1.22500002f, 1.83749998f, 0.00937500037f, -0.324999988f, 2.75f},
    {0.412499994f, -1.25f, 2.23749995f, -0.0406249985f, -0.474999994f, 2.8499999f},
};
// SgdMomentumDampeningDecay
constexpr float kSgdMomentumDampeningDecayParams[4][6] = {
    {0.4745f, -1.19875002f, 1.84800005f, 0.0125000002f, -0.374624997f, 2.79699993f},
    {0.496561468f, -1.19764805f, 1.7675184f, 0.0153068751f, -0.329287678f, 2.65939116f},
    {0.485088974f, -1.21402526f, 1.83460307f, -0.0196159277f, -0.300480574f, 2.24921322f},
    {0.38948977f, -1.19780242f, 1.81814003f, 0.00968646444f, -0.32099694f, 2.06260872f},
};
constexpr float kSgdMomentumDampeningDecay_momentum_buffer[6] = {
    0.955991983f, -0.162228554f, 0.164630175f, -0.293023914f, 0.205163687f, 1.86604404f};
// SgdNesterov
constexpr float kSgdNesterovParams[4][6] = {
    {0.450500011f, -1.14874995f, 1.71200001f, 0.022499999f, -0.371625006f, 2.61299992f},
    {0.563845515f, -1.19241118f, 1.54919195f, 0.0190474987f, -0.187080368f, 2.27188277f},
    {0.545066655f, -1.19579887f, 1.62198961f, 0.00619447138f, -0.207230493f, 2.23801613f},
    {0.159612253f, -1.09188139f, 1.49344146f, 0.157685861f, -0.327464312f, 1.95528519f},
};
constexpr float kSgdNesterov_momentum_buffer[6] = {1.12502325f,   -0.26224643f, 0.0770512223f,
                                                   -0.322208375f, 0.295663267f, 1.62719238f};
// AdamDefault
constexpr float kAdamDefaultParams[4][6] = {
    {0.499000013f, -1.24899995f, 1.99899995f, 0.000999999815f, -0.375f, 2.99900007f},
    {0.499494195f, -1.24905264f, 1.99821663f, 0.00126633677f, -0.374255866f, 2.99806786f},
    {0.499400258f, -1.24980938f, 1.99892879f, -0.00102032209f, -0.373872459f, 2.99524951f},
    {0.490698636f, -1.24832499f, 1.99894691f, 0.00534453383f, -0.376011491f, 2.98601508f},
};
constexpr float kAdamDefault_exp_avg[6] = {0.102475002f,   -0.00969999842f, -0.00039999187f,
                                           -0.0315500014f, 0.0240000058f,   0.181800008f};
constexpr float kAdamDefault_exp_avg_sq[6] = {0.00187343836f, 0.000576860388f, 0.00655163219f,
                                              0.00033191414f, 0.00170056359f,  0.00523576327f};
// AdamDecayBetas
constexpr float kAdamDecayBetasParams[4][6] = {
    {0.490000039f, -1.24000001f, 1.99000001f, 0.00999992061f, -0.365000278f, 2.99000001f},
    {0.499483854f, -1.23732543f, 1.97379792f, 0.0140967155f, -0.348882914f, 2.97130251f},
    {0.498800784f, -1.23684716f, 1.97429872f, 0.011364812f, -0.3484945f, 2.9681983f},
    {0.493077487f, -1.23309779f, 1.97322595f, 0.0151203023f, -0.349687397f, 2.96271729f},
};
constexpr float kAdamDecayBetas_exp_avg[6] = {0.238959759f,   -0.0904061496f, 0.0826187506f,
                                              -0.0642191544f, 0.045935981f,   0.428696811f};
constexpr float kAdamDecayBetas_exp_avg_sq[6] = {0.019706158f,   0.00657227496f, 0.0670510679f,
                                                 0.00330552482f, 0.0167629085f,  0.0691554993f};
// AdamWDefault
constexpr float kAdamWDefaultParams[4][6] = {
    {0.498995006f, -1.24898744f, 1.99897993f, 0.000999999815f, -0.374996245f, 2.99897003f},
    {0.503886998f, -1.24938881f, 1.99094677f, 0.00366326934f, -0.367517382f, 2.98934841f},
    {0.503648698f, -1.25077736f, 1.992172f, -0.000910414848f, -0.366713822f, 2.98341274f},
    {0.502328396f, -1.25051713f, 1.99211502f, 4.43407334e-05f, -0.367023677f, 2.98193812f},
};
constexpr float kAdamWDefault_exp_avg[6] = {0.102475002f,   -0.00969999842f, -0.00039999187f,
                                            -0.0315500014f, 0.0240000058f,   0.181800008f};
constexpr float kAdamWDefault_exp_avg_sq[6] = {0.00187343836f, 0.000576860388f, 0.00655163219f,
                                               0.00033191414f, 0.00170056359f,  0.00523576327f};
// AdamWDecay
constexpr float kAdamWDecayParams[4][6] = {
    {0.442519993f, -1.18125999f, 1.92000341f, 0.0499600321f, -0.36937499f, 2.90500236f},
    {0.502245903f, -1.17914879f, 1.79880726f, 0.0484612323f, -0.266412735f, 2.73216653f},
    {0.495306045f, -1.17913795f, 1.79965293f, 0.0314113125f, -0.268703014f, 2.71128416f},
    {0.446714371f, -1.15235221f, 1.77790987f, 0.0636707172f, -0.28515467f, 2.66439581f},
};
constexpr float kAdamWDecay_exp_avg[6] = {0.546875f, -0.0625f, -0.125f, -0.1875f, 0.25f, 0.125f};
constexpr float kAdamWDecay_exp_avg_sq[6] = {0.172618747f,  0.0461312458f, 0.55408746f,
                                             0.0320804678f, 0.145687491f,  0.395099968f};

// ---------------------------------------------------------------------------
// Hand-derived references in double: the textbook update rules, stepping a
// double copy of the parameters.

struct SgdRef {
  double momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  std::vector<double> buf;
  int64_t t = 0;

  void Step(std::vector<double>& p, const float* g, double lr) {
    if (buf.empty()) buf.assign(p.size(), 0.0);
    for (size_t i = 0; i < p.size(); ++i) {
      double d = g[i] + weight_decay * p[i];
      if (momentum != 0) {
        // First step: the buffer starts as the gradient (no dampening).
        buf[i] = t == 0 ? d : momentum * buf[i] + (1 - dampening) * d;
        d = nesterov ? d + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
    ++t;
  }
};

struct AdamRef {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool decoupled = false;
  std::vector<double> m, v;
  int64_t t = 0;

  void Step(std::vector<double>& p, const float* g, double lr) {
    if (m.empty()) m.assign(p.size(), 0.0), v.assign(p.size(), 0.0);
    ++t;
    const double bc1 = 1 - std::pow(beta1, t);
    const double bc2 = 1 - std::pow(beta2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      double grad = g[i];
      if (decoupled) {
        p[i] *= 1 - lr * weight_decay;
      } else {
        grad += weight_decay * p[i];
      }
      m[i] = beta1 * m[i] + (1 - beta1) * grad;
      v[i] = beta2 * v[i] + (1 - beta2) * grad * grad;
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + eps;
      p[i] -= lr / bc1 * m[i] / denom;
    }
  }
};

std::unique_ptr<Optimizer> Make(const std::string& name, const OptimizerOptions& options,
                                int64_t n = kN) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = MakeOptimizer(name, n, options);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return opt.ok() ? std::move(*opt) : nullptr;
}

// Against PyTorch: float rounding only. The optimizers are our own
// elementwise kernels (no OpenBLAS, no FMA contraction: the same bits on every
// x86-64), so the only difference is PyTorch's: its AVX2 kernels fuse some
// multiply-adds, one rounding fewer per fused pair. Per step that is a few u of
// the update, which is <= |p| here; over these 3-4 steps and the moments'
// updates, <= 7 u of max(1, |p|): 4e-7.
void ExpectNearTorch(const float* actual, const float* expected, int n, const std::string& what) {
  for (int i = 0; i < n; ++i) {
    const float tol = 4e-7f * std::max(1.0f, std::fabs(expected[i]));
    EXPECT_NEAR(actual[i], expected[i], tol) << what << " element " << i;
  }
}

// Against the double reference: a few steps of float rounding. A step rounds
// ~8 times (the moments' two updates, sqrt, the bias corrections, the
// division, the product with lr, the subtraction), each u of a quantity below
// max(1, |p|) once the moments' conditioning (<= 4 for these gradients, which
// never nearly cancel across steps) is counted: <= 8 * 4 u per step relative;
// 4 steps: ~128 u = 7.6e-6 bounds it, and the tests' 2e-6 (33 u) holds because
// the updates are lr-sized (lr <= 0.2): 0.2 * 128 u + 4 u |p| <= 2e-6 max(1, |p|).
void ExpectNearRef(const float* actual, const std::vector<double>& expected,
                   const std::string& what) {
  for (size_t i = 0; i < expected.size(); ++i) {
    const double tol = 2e-6 * std::max(1.0, std::fabs(expected[i]));
    EXPECT_NEAR(actual[i], expected[i], tol) << what << " element " << i;
  }
}

// Runs `opt` and the double reference side by side over lrs.size() steps of
// kGrads, checking each step against the reference and `torch_params`.
template <typename Ref>
void RunAndCompare(Optimizer& opt, Ref& ref, const std::vector<double>& lrs,
                   const float (*torch_params)[kN]) {
  std::vector<float> p(kP0, kP0 + kN);
  std::vector<double> ref_p(kP0, kP0 + kN);
  for (size_t t = 0; t < lrs.size(); ++t) {
    ASSERT_TRUE(opt.Step(p.data(), kGrads[t], kN, lrs[t]).ok());
    ref.Step(ref_p, kGrads[t], lrs[t]);
    EXPECT_EQ(opt.step(), static_cast<int64_t>(t + 1));
    ExpectNearTorch(p.data(), torch_params[t], kN, "torch, step " + std::to_string(t + 1));
    ExpectNearRef(p.data(), ref_p, "double reference, step " + std::to_string(t + 1));
  }
}

TEST(SgdTest, PlainMatchesTorchWithChangingLr) {
  auto opt = Make("sgd", {});
  SgdRef ref;
  RunAndCompare(*opt, ref, {0.1, 0.05, 0.2}, kSgdPlainParams);
  EXPECT_EQ(opt->exp_avg(), nullptr);
  EXPECT_EQ(opt->exp_avg_sq(), nullptr);
  EXPECT_EQ(opt->StateBytes(), 0);
  EXPECT_STREQ(opt->name(), "sgd");
}

TEST(SgdTest, PlainFirstStepIsExact) {
  // p - lr * g with lr = 0.5 and power-of-two values: no rounding at all.
  auto opt = Make("sgd", {});
  std::vector<float> p(kP0, kP0 + kN);
  ASSERT_TRUE(opt->Step(p.data(), kGrads[0], kN, 0.5).ok());
  for (int i = 0; i < kN; ++i) EXPECT_EQ(p[i], kP0[i] - 0.5f * kGrads[0][i]) << i;
}

TEST(SgdTest, MomentumDampeningWeightDecayMatchesTorch) {
  OptimizerOptions o;
  o.momentum = 0.9;
  o.dampening = 0.1;
  o.weight_decay = 0.01;
  auto opt = Make("sgd", o);
  SgdRef ref{0.9, 0.1, 0.01};
  RunAndCompare(*opt, ref, {0.1, 0.05, 0.2, 0.1}, kSgdMomentumDampeningDecayParams);
  ASSERT_NE(opt->exp_avg(), nullptr);
  EXPECT_EQ(opt->exp_avg_sq(), nullptr);
  EXPECT_EQ(opt->StateBytes(), kN * 4);
  ExpectNearTorch(opt->exp_avg(), kSgdMomentumDampeningDecay_momentum_buffer, kN, "buffer");
}

TEST(SgdTest, MomentumBufferStartsAsTheGradient) {
  // PyTorch: the first step clones d_p into the buffer, without dampening.
  OptimizerOptions o;
  o.momentum = 0.9;
  o.dampening = 0.5;
  auto opt = Make("sgd", o);
  std::vector<float> p(kP0, kP0 + kN);
  ASSERT_TRUE(opt->Step(p.data(), kGrads[0], kN, 0.5).ok());
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(opt->exp_avg()[i], kGrads[0][i]) << i;
    EXPECT_EQ(p[i], kP0[i] - 0.5f * kGrads[0][i]) << i;
  }
}

TEST(SgdTest, NesterovMatchesTorch) {
  OptimizerOptions o;
  o.momentum = 0.8;
  o.nesterov = true;
  o.weight_decay = 0.05;
  auto opt = Make("sgd", o);
  SgdRef ref{0.8, 0.0, 0.05, true};
  RunAndCompare(*opt, ref, {0.1, 0.1, 0.03, 0.2}, kSgdNesterovParams);
  ExpectNearTorch(opt->exp_avg(), kSgdNesterov_momentum_buffer, kN, "buffer");
}

TEST(AdamTest, DefaultsMatchTorchWithChangingLr) {
  auto opt = Make("adam", {});
  AdamRef ref;
  RunAndCompare(*opt, ref, {1e-3, 1e-3, 5e-3, 2e-2}, kAdamDefaultParams);
  EXPECT_STREQ(opt->name(), "adam");
  EXPECT_EQ(opt->StateBytes(), 2 * kN * 4);
  ExpectNearTorch(opt->exp_avg(), kAdamDefault_exp_avg, kN, "exp_avg");
  ExpectNearTorch(opt->exp_avg_sq(), kAdamDefault_exp_avg_sq, kN, "exp_avg_sq");
}

TEST(AdamTest, FirstStepMovesEachParameterByLrTimesSign) {
  // Step 1: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps); a
  // zero gradient leaves the parameter where it is (0 / eps).
  auto opt = Make("adam", {});
  std::vector<float> p(kP0, kP0 + kN);
  ASSERT_TRUE(opt->Step(p.data(), kGrads[0], kN, 1e-3).ok());
  for (int i = 0; i < kN; ++i) {
    const double g = kGrads[0][i];
    const double expected = kP0[i] - 1e-3 * g / (std::fabs(g) + 1e-8);
    EXPECT_NEAR(p[i], expected, 1e-7) << i;
  }
  EXPECT_EQ(p[4], kP0[4]);
}

TEST(AdamTest, L2WeightDecayAndBetasMatchTorch) {
  OptimizerOptions o;
  o.beta1 = 0.8;
  o.beta2 = 0.99;
  o.eps = 1e-6;
  o.weight_decay = 0.1;
  auto opt = Make("adam", o);
  AdamRef ref{0.8, 0.99, 1e-6, 0.1};
  RunAndCompare(*opt, ref, {0.01, 0.02, 0.005, 0.01}, kAdamDecayBetasParams);
  ExpectNearTorch(opt->exp_avg(), kAdamDecayBetas_exp_avg, kN, "exp_avg");
  ExpectNearTorch(opt->exp_avg_sq(), kAdamDecayBetas_exp_avg_sq, kN, "exp_avg_sq");
}

TEST(AdamWTest, DefaultsMatchTorch) {
  // AdamW's default weight decay is 1e-2 (Adam's is 0).
  auto opt = Make("adamw", {});
  AdamRef ref{0.9, 0.999, 1e-8, 1e-2, true};
  RunAndCompare(*opt, ref, {1e-3, 1e-2, 1e-2, 3e-3}, kAdamWDefaultParams);
  EXPECT_STREQ(opt->name(), "adamw");
  // Decoupled decay leaves the moments exactly as plain Adam's.
  ExpectNearTorch(opt->exp_avg(), kAdamWDefault_exp_avg, kN, "exp_avg");
  ExpectNearTorch(opt->exp_avg_sq(), kAdamWDefault_exp_avg_sq, kN, "exp_avg_sq");
}

TEST(AdamWTest, StrongDecayMatchesTorch) {
  OptimizerOptions o;
  o.beta1 = 0.5;
  o.beta2 = 0.9;
  o.eps = 1e-4;
  o.weight_decay = 0.3;
  auto opt = Make("adamw", o);
  AdamRef ref{0.5, 0.9, 1e-4, 0.3, true};
  RunAndCompare(*opt, ref, {0.05, 0.1, 0.02, 0.05}, kAdamWDecayParams);
  ExpectNearTorch(opt->exp_avg(), kAdamWDecay_exp_avg, kN, "exp_avg");
  ExpectNearTorch(opt->exp_avg_sq(), kAdamWDecay_exp_avg_sq, kN, "exp_avg_sq");
}

TEST(AdamWTest, ZeroGradientOnlyDecays) {
  // With g = 0 the Adam part is 0 / (0 + eps) = 0: only p *= 1 - lr * wd.
  OptimizerOptions o;
  o.weight_decay = 0.5;
  auto opt = Make("adamw", o, 3);
  std::vector<float> p = {1.0f, -2.0f, 0.25f};
  const std::vector<float> g(3, 0.0f);
  ASSERT_TRUE(opt->Step(p.data(), g.data(), 3, 0.5).ok());
  EXPECT_EQ(p, (std::vector<float>{0.75f, -1.5f, 0.1875f}));
}

TEST(AdamTest, ZeroLrAdvancesStateOnly) {
  auto opt = Make("adam", {});
  std::vector<float> p(kP0, kP0 + kN);
  ASSERT_TRUE(opt->Step(p.data(), kGrads[0], kN, 0.0).ok());
  EXPECT_EQ(p, std::vector<float>(kP0, kP0 + kN));
  EXPECT_EQ(opt->step(), 1);
  EXPECT_NE(opt->exp_avg()[0], 0.0f);
}

// ---------------------------------------------------------------------------
// Sharding and checkpointing.

// A long, uneven shard (not a multiple of any vector width) split in two
// pieces with their own optimizers gives bit-for-bit the whole-array result:
// the vectorized loops and their scalar tails compute the same thing.
TEST(OptimizerTest, ShardedUpdateIsBitIdenticalToWhole) {
  constexpr int64_t kLen = 1003;
  constexpr int64_t kSplit = 389;
  std::vector<float> p0(kLen), g(kLen);
  for (int64_t i = 0; i < kLen; ++i) {
    p0[i] = std::sin(0.37f * i);
    g[i] = std::cos(1.3f * i) * (i % 7 == 0 ? 0.0f : 1.0f);
  }
  OptimizerOptions sgd_nesterov;
  sgd_nesterov.momentum = 0.9;
  sgd_nesterov.nesterov = true;
  sgd_nesterov.weight_decay = 1e-3;
  OptimizerOptions adam_l2;
  adam_l2.weight_decay = 0.05;
  const std::vector<std::pair<std::string, OptimizerOptions>> configs = {
      {"sgd", {}}, {"sgd", sgd_nesterov}, {"adam", {}}, {"adam", adam_l2}, {"adamw", {}}};
  for (const auto& [name, options] : configs) {
    auto whole = Make(name, options, kLen);
    auto left = Make(name, options, kSplit);
    auto right = Make(name, options, kLen - kSplit);
    std::vector<float> a = p0, b = p0;
    for (int t = 0; t < 3; ++t) {
      const double lr = 0.01 * (t + 1);
      ASSERT_TRUE(whole->Step(a.data(), g.data(), kLen, lr).ok());
      ASSERT_TRUE(left->Step(b.data(), g.data(), kSplit, lr).ok());
      ASSERT_TRUE(right->Step(b.data() + kSplit, g.data() + kSplit, kLen - kSplit, lr).ok());
    }
    EXPECT_EQ(a, b) << name;
    EXPECT_NE(a, p0) << name;
  }
}

// Copying (step, exp_avg, exp_avg_sq) into a fresh optimizer and continuing
// gives exactly what an uninterrupted run gives.
TEST(OptimizerTest, StateRoundTripsThroughAccessors) {
  OptimizerOptions sgd_momentum;
  sgd_momentum.momentum = 0.9;
  const std::vector<std::pair<std::string, OptimizerOptions>> configs = {
      {"sgd", sgd_momentum}, {"adam", {}}, {"adamw", {}}};
  for (const auto& [name, options] : configs) {
    auto straight = Make(name, options);
    auto first = Make(name, options);
    std::vector<float> a(kP0, kP0 + kN), b = a;
    for (int t = 0; t < 4; ++t) ASSERT_TRUE(straight->Step(a.data(), kGrads[t], kN, 0.01).ok());
    for (int t = 0; t < 2; ++t) ASSERT_TRUE(first->Step(b.data(), kGrads[t], kN, 0.01).ok());

    auto resumed = Make(name, options);
    resumed->set_step(first->step());
    std::copy(first->exp_avg(), first->exp_avg() + kN, resumed->exp_avg());
    if (first->exp_avg_sq() != nullptr) {
      std::copy(first->exp_avg_sq(), first->exp_avg_sq() + kN, resumed->exp_avg_sq());
    }
    for (int t = 2; t < 4; ++t) ASSERT_TRUE(resumed->Step(b.data(), kGrads[t], kN, 0.01).ok());
    EXPECT_EQ(a, b) << name;
    EXPECT_EQ(resumed->step(), 4) << name;
  }
}

TEST(OptimizerTest, EmptyShardIsFine) {
  for (const char* name : {"sgd", "adam", "adamw"}) {
    auto opt = Make(name, {}, 0);
    EXPECT_TRUE(opt->Step(nullptr, nullptr, 0, 0.1).ok()) << name;
    EXPECT_EQ(opt->StateBytes(), 0) << name;
  }
}

// ---------------------------------------------------------------------------
// Errors.

TEST(MakeOptimizerTest, UnknownName) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = MakeOptimizer("lamb", 4, {});
  EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(opt.status().message(), HasSubstr("unknown optimizer \"lamb\""));
  EXPECT_THAT(opt.status().message(), HasSubstr("adam, adamw or sgd"));
  EXPECT_FALSE(MakeOptimizer("Adam", 4, {}).ok());  // names are lower case
}

TEST(MakeOptimizerTest, BadHyperparameters) {
  struct Case {
    std::string name;
    OptimizerOptions options;
    std::string message;
  };
  std::vector<Case> cases;
  auto add = [&](std::string name, std::string message, auto edit) {
    OptimizerOptions o;
    edit(o);
    cases.push_back({std::move(name), o, std::move(message)});
  };
  add("adam", "beta1 1", [](OptimizerOptions& o) { o.beta1 = 1.0; });
  add("adam", "beta1 -0.1", [](OptimizerOptions& o) { o.beta1 = -0.1; });
  add("adamw", "beta2 1.5", [](OptimizerOptions& o) { o.beta2 = 1.5; });
  add("adamw", "beta2 nan", [](OptimizerOptions& o) { o.beta2 = std::nan(""); });
  add("adam", "eps -1e-08", [](OptimizerOptions& o) { o.eps = -1e-8; });
  add("adam", "weight_decay -0.1", [](OptimizerOptions& o) { o.weight_decay = -0.1; });
  add("adamw", "weight_decay inf", [](OptimizerOptions& o) { o.weight_decay = INFINITY; });
  add("sgd", "momentum -0.5", [](OptimizerOptions& o) { o.momentum = -0.5; });
  add("sgd", "nesterov momentum requires momentum > 0",
      [](OptimizerOptions& o) { o.nesterov = true; });
  add("sgd", "dampening == 0", [](OptimizerOptions& o) {
    o.nesterov = true;
    o.momentum = 0.9;
    o.dampening = 0.1;
  });
  add("sgd", "apply only to adam", [](OptimizerOptions& o) { o.beta1 = 0.95; });
  add("adam", "apply only to sgd", [](OptimizerOptions& o) { o.momentum = 0.9; });
  for (const Case& c : cases) {
    absl::StatusOr<std::unique_ptr<Optimizer>> opt = MakeOptimizer(c.name, 4, c.options);
    EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(opt.status().message(), HasSubstr(c.message));
    EXPECT_THAT(opt.status().message(), HasSubstr(c.name + ":"));
  }
  EXPECT_THAT(MakeOptimizer("adam", -1, {}).status().message(), HasSubstr("negative shard size"));
}

TEST(OptimizerTest, BadStepArgumentsChangeNothing) {
  auto opt = Make("adam", {}, 4);
  std::vector<float> p = {1, 2, 3, 4}, g = {1, 1, 1, 1};
  const std::vector<float> p_before = p;
  absl::Status s = opt->Step(p.data(), g.data(), 3, 0.1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("got 3 elements but the state holds 4"));
  EXPECT_THAT(opt->Step(p.data(), g.data(), 4, -0.1).message(), HasSubstr("learning rate"));
  EXPECT_THAT(opt->Step(p.data(), g.data(), 4, std::nan("")).message(), HasSubstr("learning rate"));
  EXPECT_THAT(opt->Step(nullptr, g.data(), 4, 0.1).message(), HasSubstr("null"));
  EXPECT_EQ(p, p_before);
  EXPECT_EQ(opt->step(), 0);
  EXPECT_EQ(opt->exp_avg()[0], 0.0f);
}

// ---------------------------------------------------------------------------
// Norm helpers.

TEST(SquaredL2NormTest, SmallExactValues) {
  EXPECT_EQ(SquaredL2Norm(nullptr, 0), 0.0);
  const float x[] = {3.0f, -4.0f};
  EXPECT_EQ(SquaredL2Norm(x, 2), 25.0);
  // 13 elements: one full group of eight and a tail of five.
  std::vector<float> y(13);
  double expected = 0;
  for (int i = 0; i < 13; ++i) {
    y[i] = 0.5f * (i - 6);
    expected += static_cast<double>(y[i]) * y[i];
  }
  EXPECT_EQ(SquaredL2Norm(y.data(), 13), expected);
}

TEST(SquaredL2NormTest, AccumulatesInDouble) {
  // 10^6 copies of 0.1f: a float accumulator would be off by ~1e-2 or worse
  // (relative 1e-6); double keeps the relative error near 1e-12.
  const std::vector<float> x(1000000, 0.1f);
  const double v = static_cast<double>(0.1f);
  const double whole = SquaredL2Norm(x.data(), x.size());
  EXPECT_NEAR(whole, 1e6 * v * v, 1e-6);
  // Shards add up to the whole (up to double rounding).
  EXPECT_NEAR(SquaredL2Norm(x.data(), 300001) + SquaredL2Norm(x.data() + 300001, 699999), whole,
              1e-7);
}

TEST(ClipTest, CoefficientAndScale) {
  EXPECT_EQ(ClipCoefficient(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(ClipCoefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6));
  EXPECT_TRUE(std::isnan(ClipCoefficient(std::nan(""), 1.0)));
  std::vector<float> x = {1.0f, -2.0f, 4.0f};
  ScaleInPlace(x.data(), 3, 0.25f);
  EXPECT_EQ(x, (std::vector<float>{0.25f, -0.5f, 1.0f}));
}

}  // namespace
}  // namespace zeroshard
