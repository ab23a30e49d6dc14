// Each kernel's backward against central finite differences of its forward,
// and the forwards against naive reference loops.
#include "worker/model/layers.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "tests/worker/model/test_util.h"
#include "worker/model/fast_math.h"
#include "worker/model/parallel.h"

namespace zeroshard {
namespace {

using ::zeroshard::testing::kFloat32Unit;
using ::zeroshard::testing::SumErrorBound;

// A float32 product whose output elements are sums of `n` terms a_k b_k with
// |a_k|, |b_k| <= 1 (and a bias <= 1 as one more term), against the same sum
// in double: gamma_n * sum|terms| <= gamma_n * n (tests/testing/error_model.h),
// whichever OpenBLAS kernel or tile does it; plus the result's own rounding.
double ProductTolerance(int64_t n) { return SumErrorBound(n) * n + kFloat32Unit * n; }

// The element functions (exp, erf, tanh in float32: a handful of roundings,
// and FastExp's <= 2e-7 relative) against double formulas or PyTorch's
// float32 values (themselves within u / 2): 16 u of max(1, |y|) covers them.
double ElementTolerance(double want) { return 16 * kFloat32Unit * std::max(1.0, std::fabs(want)); }

using ::zeroshard::testing::Dot;
using ::zeroshard::testing::ExpectGradientMatches;
using ::zeroshard::testing::FdOptions;
using ::zeroshard::testing::RandomVector;

// Parameter gradients start from this value, so the checks also prove that
// backward ADDs into them rather than overwriting.
constexpr float kGradStart = 0.25f;

std::vector<float> Minus(const std::vector<float>& v, float c) {
  std::vector<float> out(v);
  for (float& x : out) x -= c;
  return out;
}

// ---------------------------------------------------------------------------
// Linear / Conv1D

TEST(LinearTest, ForwardMatchesNaiveLoop) {
  const int64_t n = 5, in = 7, out = 3;
  auto x = RandomVector(n * in, -1, 1, 1);
  auto w = RandomVector(out * in, -1, 1, 2);  // [OUT,IN]
  auto b = RandomVector(out, -1, 1, 3);
  std::vector<float> y(n * out), y_nobias(n * out);
  LinearForward(y.data(), x.data(), w.data(), b.data(), n, in, out);
  LinearForward(y_nobias.data(), x.data(), w.data(), nullptr, n, in, out);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0.0;
      for (int64_t k = 0; k < in; ++k) acc += double{x[i * in + k]} * w[o * in + k];
      EXPECT_NEAR(y_nobias[i * out + o], acc, ProductTolerance(in));
      EXPECT_NEAR(y[i * out + o], acc + b[o], ProductTolerance(in + 1));
    }
  }
}

TEST(LinearTest, BackwardMatchesFiniteDifferences) {
  const int64_t n = 4, in = 5, out = 3;
  auto x = RandomVector(n * in, -1, 1, 1);
  auto w = RandomVector(out * in, -1, 1, 2);
  auto b = RandomVector(out, -1, 1, 3);
  auto dy = RandomVector(n * out, -1, 1, 4);
  std::vector<float> y(n * out), dx(n * in);
  std::vector<float> dw(w.size(), kGradStart), db(b.size(), kGradStart);
  LinearBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), n, in, out);
  auto loss = [&] {
    LinearForward(y.data(), x.data(), w.data(), b.data(), n, in, out);
    return Dot(dy.data(), y.data(), y.size());
  };
  FdOptions opt;
  ExpectGradientMatches(loss, x.data(), dx.data(), x.size(), opt, "dx");
  ExpectGradientMatches(loss, w.data(), Minus(dw, kGradStart).data(), w.size(), opt, "dw");
  ExpectGradientMatches(loss, b.data(), Minus(db, kGradStart).data(), b.size(), opt, "db");
}

TEST(Conv1dTest, ForwardMatchesNaiveLoop) {
  const int64_t n = 4, in = 6, out = 5;
  auto x = RandomVector(n * in, -1, 1, 5);
  auto w = RandomVector(in * out, -1, 1, 6);  // [IN,OUT]
  auto b = RandomVector(out, -1, 1, 7);
  std::vector<float> y(n * out);
  Conv1dForward(y.data(), x.data(), w.data(), b.data(), n, in, out);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b[o];
      for (int64_t k = 0; k < in; ++k) acc += double{x[i * in + k]} * w[k * out + o];
      EXPECT_NEAR(y[i * out + o], acc, ProductTolerance(in + 1));
    }
  }
}

TEST(Conv1dTest, BackwardMatchesFiniteDifferences) {
  const int64_t n = 3, in = 4, out = 6;
  auto x = RandomVector(n * in, -1, 1, 8);
  auto w = RandomVector(in * out, -1, 1, 9);
  auto b = RandomVector(out, -1, 1, 10);
  auto dy = RandomVector(n * out, -1, 1, 11);
  std::vector<float> y(n * out), dx(n * in);
  std::vector<float> dw(w.size(), kGradStart), db(b.size(), kGradStart);
  Conv1dBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), n, in, out);
  auto loss = [&] {
    Conv1dForward(y.data(), x.data(), w.data(), b.data(), n, in, out);
    return Dot(dy.data(), y.data(), y.size());
  };
  FdOptions opt;
  ExpectGradientMatches(loss, x.data(), dx.data(), x.size(), opt, "dx");
  ExpectGradientMatches(loss, w.data(), Minus(dw, kGradStart).data(), w.size(), opt, "dw");
  ExpectGradientMatches(loss, b.data(), Minus(db, kGradStart).data(), b.size(), opt, "db");
}

// ---------------------------------------------------------------------------
// Activations

using ActivationFn = void (*)(float*, const float*, int64_t);
using ActivationGradFn = void (*)(float*, const float*, const float*, int64_t);

void CheckActivation(ActivationFn forward, ActivationGradFn backward, std::vector<float> x,
                     const char* what) {
  const int64_t n = x.size();
  auto dy = RandomVector(n, -1, 1, 12);
  std::vector<float> y(n), dx(n);
  backward(dx.data(), dy.data(), x.data(), n);
  auto loss = [&] {
    forward(y.data(), x.data(), n);
    return Dot(dy.data(), y.data(), n);
  };
  FdOptions opt;
  opt.eps = 1e-3f;
  ExpectGradientMatches(loss, x.data(), dx.data(), n, opt, what);
  // In place (dx == dy) gives the same result.
  std::vector<float> inplace(dy);
  backward(inplace.data(), inplace.data(), x.data(), n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(inplace[i], dx[i]) << what << " in place " << i;
}

TEST(ActivationTest, Relu) {
  // Away from the kink, where finite differences are meaningful.
  std::vector<float> x = {-2.0f, -0.5f, -0.1f, 0.1f, 0.7f, 3.0f};
  std::vector<float> y(x.size());
  ReluForward(y.data(), x.data(), x.size());
  EXPECT_EQ(y, (std::vector<float>{0, 0, 0, 0.1f, 0.7f, 3.0f}));
  CheckActivation(ReluForward, ReluBackward, x, "relu");
}

TEST(ActivationTest, GeluExact) {
  std::vector<float> x = {-5.0f, -2.0f, -1.0f, -0.3f, 0.0f, 0.4f, 1.0f, 2.5f};
  std::vector<float> y(x.size());
  GeluForward(y.data(), x.data(), x.size());
  // torch.nn.functional.gelu(torch.tensor([-1., 1., 2.5]))
  EXPECT_NEAR(y[2], -0.15865525f, ElementTolerance(-0.15865525));
  EXPECT_NEAR(y[6], 0.84134475f, ElementTolerance(0.84134475));
  EXPECT_NEAR(y[7], 2.48447584f, ElementTolerance(2.48447584));
  CheckActivation(GeluForward, GeluBackward, x, "gelu");
}

TEST(ActivationTest, GeluTanh) {
  std::vector<float> x = {-5.0f, -2.0f, -1.0f, -0.3f, 0.0f, 0.4f, 1.0f, 2.5f};
  std::vector<float> y(x.size());
  GeluTanhForward(y.data(), x.data(), x.size());
  // torch.nn.functional.gelu(torch.tensor([-1., 1.]), approximate="tanh")
  EXPECT_NEAR(y[2], -0.15880801f, ElementTolerance(-0.15880801));
  EXPECT_NEAR(y[6], 0.84119199f, ElementTolerance(0.84119199));
  CheckActivation(GeluTanhForward, GeluTanhBackward, x, "gelu_tanh");
}

// ---------------------------------------------------------------------------
// MSE

TEST(MseTest, ForwardIsMeanOfSquares) {
  std::vector<float> p = {1, 2, 3, 4}, t = {0, 2, 5, 3};
  EXPECT_DOUBLE_EQ(MseForward(p.data(), t.data(), 4), (1.0 + 0.0 + 4.0 + 1.0) / 4.0);
}

TEST(MseTest, BackwardMatchesFiniteDifferences) {
  const int64_t n = 12;
  auto p = RandomVector(n, -1, 1, 13);
  auto t = RandomVector(n, -1, 1, 14);
  std::vector<float> dp(n);
  MseBackward(dp.data(), p.data(), t.data(), n);
  FdOptions opt;
  opt.eps = 1e-3f;
  opt.atol = 1e-4;
  ExpectGradientMatches([&] { return MseForward(p.data(), t.data(), n); }, p.data(), dp.data(), n,
                        opt, "dpred");
}

// ---------------------------------------------------------------------------
// LayerNorm

TEST(LayerNormTest, ForwardNormalizesRows) {
  const int64_t n = 3, c = 16;
  auto x = RandomVector(n * c, -3, 5, 15);
  std::vector<float> w(c, 1.0f), b(c, 0.0f), out(n * c), mean(n), rstd(n);
  LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c);
  for (int64_t i = 0; i < n; ++i) {
    double m = 0, v = 0;
    for (int64_t j = 0; j < c; ++j) m += x[i * c + j];
    m /= c;
    for (int64_t j = 0; j < c; ++j) v += (x[i * c + j] - m) * (x[i * c + j] - m);
    v /= c;  // biased, as PyTorch
    // Our kernel, float32: the mean is a sum of c terms |x| <= 5 (gamma_c 5);
    // the variance a sum of c squares, relative gamma_c plus twice the mean's
    // relative error carried into x - m; rstd halves that, and each output is
    // (x - m) rstd: its terms' errors add, plus a few roundings.
    const double rstd_want = 1.0 / std::sqrt(v + 1e-5);
    const double mean_tol = SumErrorBound(c) * 5;
    const double rstd_rel = SumErrorBound(c) + 2 * mean_tol * 8 / v + 4 * kFloat32Unit;
    EXPECT_NEAR(mean[i], m, mean_tol);
    EXPECT_NEAR(rstd[i], rstd_want, rstd_rel * rstd_want);
    for (int64_t j = 0; j < c; ++j) {
      const double centered = x[i * c + j] - m;
      EXPECT_NEAR(
          out[i * c + j], centered * rstd_want,
          mean_tol * rstd_want + std::fabs(centered) * rstd_want * (rstd_rel + 2 * kFloat32Unit));
    }
  }
}

TEST(LayerNormTest, BackwardMatchesFiniteDifferences) {
  const int64_t n = 3, c = 8;
  auto x = RandomVector(n * c, -2, 2, 16);
  auto w = RandomVector(c, 0.5f, 1.5f, 17);
  auto b = RandomVector(c, -0.5f, 0.5f, 18);
  auto dout = RandomVector(n * c, -1, 1, 19);
  std::vector<float> out(n * c), mean(n), rstd(n), dx(n * c);
  std::vector<float> dw(c, kGradStart), db(c, kGradStart);
  LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c);
  LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                    rstd.data(), n, c);
  auto loss = [&] {
    LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c);
    return Dot(dout.data(), out.data(), out.size());
  };
  FdOptions opt;
  opt.eps = 1e-3f;
  ExpectGradientMatches(loss, x.data(), dx.data(), x.size(), opt, "dx");
  ExpectGradientMatches(loss, w.data(), Minus(dw, kGradStart).data(), c, opt, "dw");
  ExpectGradientMatches(loss, b.data(), Minus(db, kGradStart).data(), c, opt, "db");
}

// ---------------------------------------------------------------------------
// Attention

// out [B,T,C] by the definition, in double, one position at a time.
std::vector<double> NaiveAttention(const std::vector<float>& qkv, int64_t b, int64_t t, int64_t c,
                                   int64_t nh) {
  const int64_t hs = c / nh;
  std::vector<double> out(b * t * c, 0.0);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t h = 0; h < nh; ++h) {
      for (int64_t i = 0; i < t; ++i) {
        const float* q = &qkv[(bi * t + i) * 3 * c + h * hs];
        std::vector<double> w(i + 1);
        double max_s = -1e300, sum = 0;
        for (int64_t s = 0; s <= i; ++s) {
          const float* k = &qkv[(bi * t + s) * 3 * c + c + h * hs];
          double dot = 0;
          for (int64_t d = 0; d < hs; ++d) dot += double{q[d]} * k[d];
          w[s] = dot / std::sqrt(double(hs));
          max_s = std::max(max_s, w[s]);
        }
        for (int64_t s = 0; s <= i; ++s) sum += (w[s] = std::exp(w[s] - max_s));
        for (int64_t s = 0; s <= i; ++s) {
          const float* v = &qkv[(bi * t + s) * 3 * c + 2 * c + h * hs];
          for (int64_t d = 0; d < hs; ++d) out[(bi * t + i) * c + h * hs + d] += w[s] / sum * v[d];
        }
      }
    }
  }
  return out;
}

// Attention against the naive loop in double (|q|, |k|, |v| <= 1.5): scores
// are sums of hs terms <= 2.25 (gamma_hs 2.25 hs, scaled by 1/sqrt(hs));
// softmax turns an absolute score error d into a relative weight error <= 2d
// (plus a few u for exp and the sum of t weights, gamma_t); the output is a
// weighted sum of t values <= 1.5 with weights summing to 1. OpenBLAS per head
// or our tiled kernel: either within this.
double AttentionTolerance(int64_t t, int64_t hs) {
  const double score = SumErrorBound(hs) * 2.25 * hs / std::sqrt(double(hs));
  const double weight = 2 * score + SumErrorBound(t) + 4 * kFloat32Unit;
  return 1.5 * (weight + SumErrorBound(t));
}

TEST(AttentionTest, ForwardMatchesNaiveLoop) {
  const int64_t b = 2, t = 6, c = 12, nh = 3;
  auto qkv = RandomVector(b * t * 3 * c, -1.5f, 1.5f, 20);
  std::vector<float> out(b * t * c), att(b * nh * t * t);
  AttentionForward(out.data(), att.data(), qkv.data(), b, t, c, nh);
  auto want = NaiveAttention(qkv, b, t, c, nh);
  const double tolerance = AttentionTolerance(t, c / nh);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], want[i], tolerance) << i;
  // Rows of att sum to 1 over s <= t and are 0 above the diagonal.
  for (int64_t r = 0; r < b * nh; ++r) {
    for (int64_t i = 0; i < t; ++i) {
      double sum = 0;
      for (int64_t s = 0; s < t; ++s) {
        const float a = att[(r * t + i) * t + s];
        if (s > i) {
          EXPECT_EQ(a, 0.0f);
        }
        sum += a;
      }
      // t weights, each its exp and the normalising sum of t terms apart.
      EXPECT_NEAR(sum, 1.0, SumErrorBound(t) + 4 * t * kFloat32Unit);
    }
  }
}

TEST(AttentionTest, IsCausal) {
  const int64_t b = 2, t = 7, c = 8, nh = 2;
  auto qkv = RandomVector(b * t * 3 * c, -1, 1, 21);
  std::vector<float> out(b * t * c), att(b * nh * t * t);
  AttentionForward(out.data(), att.data(), qkv.data(), b, t, c, nh);
  for (int64_t cut = 0; cut + 1 < t; ++cut) {
    // Change q, k and v at every position after `cut`.
    auto changed = qkv;
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t i = cut + 1; i < t; ++i) {
        for (int64_t j = 0; j < 3 * c; ++j) changed[(bi * t + i) * 3 * c + j] += 0.75f;
      }
    }
    std::vector<float> out2(out.size()), att2(att.size());
    AttentionForward(out2.data(), att2.data(), changed.data(), b, t, c, nh);
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t i = 0; i < t; ++i) {
        for (int64_t j = 0; j < c; ++j) {
          const int64_t k = (bi * t + i) * c + j;
          if (i <= cut) {
            EXPECT_EQ(out2[k], out[k]) << "cut " << cut << " position " << i;
          }
        }
      }
      // ...while the later positions do change.
      EXPECT_NE(out2[(bi * t + t - 1) * c], out[(bi * t + t - 1) * c]);
    }
  }
}

// The forward equals the naive loop and the weights above the diagonal are
// exactly 0 (att starts at 7 so that an unwritten weight shows).
void ExpectForwardMatchesNaive(int64_t b, int64_t t, int64_t c, int64_t nh, uint32_t seed) {
  auto qkv = RandomVector(b * t * 3 * c, -1.5f, 1.5f, seed);
  std::vector<float> out(b * t * c), att(b * nh * t * t, 7.0f);
  AttentionForward(out.data(), att.data(), qkv.data(), b, t, c, nh);
  auto want = NaiveAttention(qkv, b, t, c, nh);
  const double tolerance = AttentionTolerance(t, c / nh);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], tolerance) << i;
  for (int64_t r = 0; r < b * nh; ++r) {
    for (int64_t i = 0; i < t; ++i) {
      for (int64_t s = i + 1; s < t; ++s) ASSERT_EQ(att[(r * t + i) * t + s], 0.0f);
    }
  }
}

// d(dout . out)/d(qkv) from the backward equals finite differences.
void ExpectBackwardMatchesFiniteDifferences(int64_t b, int64_t t, int64_t c, int64_t nh,
                                            uint32_t seed) {
  auto qkv = RandomVector(b * t * 3 * c, -1, 1, seed);
  auto dout = RandomVector(b * t * c, -1, 1, seed + 1);
  std::vector<float> out(b * t * c), att(b * nh * t * t), dqkv(qkv.size());
  AttentionForward(out.data(), att.data(), qkv.data(), b, t, c, nh);
  AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), b, t, c, nh);
  auto loss = [&] {
    std::vector<float> o(out.size()), a(att.size());
    AttentionForward(o.data(), a.data(), qkv.data(), b, t, c, nh);
    return Dot(dout.data(), o.data(), o.size());
  };
  FdOptions opt;
  opt.eps = 1e-3f;
  ExpectGradientMatches(loss, qkv.data(), dqkv.data(), qkv.size(), opt, "dqkv");
}

TEST(AttentionTest, BackwardMatchesFiniteDifferences) {
  ExpectBackwardMatchesFiniteDifferences(2, 5, 8, 2, 22);
}

// Sequences longer than the causal blocks (32 rows), with a ragged last block.
TEST(AttentionTest, BlockedMatchesNaiveLoopOnLongSequences) {
  ExpectForwardMatchesNaive(2, 70, 12, 3, 26);
}

TEST(AttentionTest, BlockedBackwardMatchesFiniteDifferences) {
  ExpectBackwardMatchesFiniteDifferences(1, 37, 8, 2, 27);
}

// Heads of 20 (one full 16-column tile and an edge of 4; 8 x 8 transposes
// and a remainder) and t = 37 (row tiles of 4 and an edge of 1): the
// register-tiled paths of every product, forward and backward.
TEST(AttentionTest, WideHeadsMatchNaiveLoopAndFiniteDifferences) {
  ExpectForwardMatchesNaive(1, 37, 40, 2, 29);
  ExpectBackwardMatchesFiniteDifferences(1, 37, 40, 2, 30);
}

// ---------------------------------------------------------------------------
// Embedding, LM head, cross-entropy

TEST(EmbeddingTest, ForwardAndScatterAddBackward) {
  const int64_t b = 2, t = 3, c = 4, v = 5, n_ctx = 4;
  // Token 1 appears three times: its gradient row must be the sum.
  std::vector<int32_t> tokens = {1, 3, 1, 1, 0, 4};
  auto wte = RandomVector(v * c, -1, 1, 24);
  auto wpe = RandomVector(n_ctx * c, -1, 1, 25);
  std::vector<float> out(b * t * c);
  EmbeddingForward(out.data(), tokens.data(), wte.data(), wpe.data(), b, t, c);
  for (int64_t i = 0; i < b * t; ++i) {
    for (int64_t j = 0; j < c; ++j) {
      EXPECT_FLOAT_EQ(out[i * c + j], wte[tokens[i] * c + j] + wpe[(i % t) * c + j]);
    }
  }
  auto dout = RandomVector(b * t * c, -1, 1, 26);
  std::vector<float> dwte(wte.size(), kGradStart), dwpe(wpe.size(), kGradStart);
  EmbeddingBackward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), b, t, c);
  auto loss = [&] {
    EmbeddingForward(out.data(), tokens.data(), wte.data(), wpe.data(), b, t, c);
    return Dot(dout.data(), out.data(), out.size());
  };
  FdOptions opt;
  ExpectGradientMatches(loss, wte.data(), Minus(dwte, kGradStart).data(), wte.size(), opt, "dwte");
  ExpectGradientMatches(loss, wpe.data(), Minus(dwpe, kGradStart).data(), wpe.size(), opt, "dwpe");
}

TEST(LmHeadTest, BackwardMatchesFiniteDifferences) {
  const int64_t n = 4, c = 6, v = 7;
  auto x = RandomVector(n * c, -1, 1, 27);
  auto wte = RandomVector(v * c, -1, 1, 28);
  auto dlogits = RandomVector(n * v, -1, 1, 29);
  std::vector<float> logits(n * v), dx(n * c), dwte(wte.size(), kGradStart);
  LmHeadForward(logits.data(), x.data(), wte.data(), n, c, v);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < v; ++k) {
      double acc = 0;
      for (int64_t j = 0; j < c; ++j) acc += double{x[i * c + j]} * wte[k * c + j];
      EXPECT_NEAR(logits[i * v + k], acc, ProductTolerance(c));
    }
  }
  LmHeadBackward(dx.data(), dwte.data(), dlogits.data(), x.data(), wte.data(), n, c, v);
  auto loss = [&] {
    LmHeadForward(logits.data(), x.data(), wte.data(), n, c, v);
    return Dot(dlogits.data(), logits.data(), logits.size());
  };
  FdOptions opt;
  ExpectGradientMatches(loss, x.data(), dx.data(), x.size(), opt, "dx");
  ExpectGradientMatches(loss, wte.data(), Minus(dwte, kGradStart).data(), wte.size(), opt, "dwte");
}

TEST(CrossEntropyTest, ForwardMatchesDefinition) {
  const int64_t n = 3, v = 4;
  std::vector<float> logits = {1, 2, 3, 4, 0, 0, 0, 0, -1, 5, 2, 0};
  std::vector<int32_t> targets = {3, 1, 0};
  std::vector<float> probs(n * v);
  double want = 0;
  for (int64_t i = 0; i < n; ++i) {
    double z = 0;
    for (int64_t j = 0; j < v; ++j) z += std::exp(double{logits[i * v + j]});
    want += -std::log(std::exp(double{logits[i * v + targets[i]]}) / z);
  }
  // Per row: the max-shifted exp of v logits (|z| <= 6, each ~1 ulp), their
  // sum (gamma_v), its log and the mean over n rows: a few u of each term.
  EXPECT_NEAR(CrossEntropyForward(probs.data(), logits.data(), targets.data(), n, v), want / n,
              (SumErrorBound(v) + SumErrorBound(n) + 8 * kFloat32Unit) * std::max(1.0, want / n));
  EXPECT_NEAR(probs[4], 0.25f, 4 * kFloat32Unit);  // exp(0) / 4: exact but for the division
}

TEST(CrossEntropyTest, StableForHugeLogits) {
  std::vector<float> logits = {1000.0f, -1000.0f, 0.0f};
  std::vector<int32_t> target = {1};
  std::vector<float> probs(3);
  const double loss = CrossEntropyForward(probs.data(), logits.data(), target.data(), 1, 3);
  // Finite, not inf or nan: the logit gap 2000, within a few u of it.
  EXPECT_NEAR(loss, 2000.0, 8 * kFloat32Unit * 2000);
  EXPECT_FLOAT_EQ(probs[0], 1.0f);
}

TEST(CrossEntropyTest, BackwardMatchesFiniteDifferences) {
  const int64_t n = 4, v = 6;
  auto logits = RandomVector(n * v, -3, 3, 30);
  std::vector<int32_t> targets = {0, 5, 2, 2};
  std::vector<float> probs(n * v), dlogits(n * v);
  CrossEntropyForward(probs.data(), logits.data(), targets.data(), n, v);
  CrossEntropyBackward(dlogits.data(), probs.data(), targets.data(), n, v);
  FdOptions opt;
  opt.eps = 1e-3f;
  opt.atol = 2e-4;
  ExpectGradientMatches(
      [&] { return CrossEntropyForward(probs.data(), logits.data(), targets.data(), n, v); },
      logits.data(), dlogits.data(), logits.size(), opt, "dlogits");
}

TEST(CrossEntropyTest, UnscoredTargetsAddNothing) {
  // Rows 1 and 3 unscored: loss and gradient equal those of rows 0 and 2
  // alone -- the same row computations, the mean over 2 rows either way, so
  // bitwise equal.
  const int64_t n = 4, v = 5;
  auto logits = RandomVector(n * v, -3, 3, 31);
  std::vector<int32_t> targets = {4, kUnscoredTarget, 1, kUnscoredTarget};
  EXPECT_EQ(ScoredPositions(targets.data(), n), 2);
  std::vector<float> probs(n * v), dlogits(n * v, 7.0f);
  const double loss = CrossEntropyForward(probs.data(), logits.data(), targets.data(), n, v);
  CrossEntropyBackward(dlogits.data(), probs.data(), targets.data(), n, v);

  std::vector<float> kept_logits;
  for (int64_t i : {0, 2}) {
    kept_logits.insert(kept_logits.end(), logits.begin() + i * v, logits.begin() + (i + 1) * v);
  }
  std::vector<int32_t> kept_targets = {4, 1};
  std::vector<float> kept_probs(2 * v), kept_dlogits(2 * v);
  EXPECT_EQ(loss,
            CrossEntropyForward(kept_probs.data(), kept_logits.data(), kept_targets.data(), 2, v));
  CrossEntropyBackward(kept_dlogits.data(), kept_probs.data(), kept_targets.data(), 2, v);
  for (int64_t j = 0; j < v; ++j) {
    EXPECT_EQ(dlogits[0 * v + j], kept_dlogits[0 * v + j]) << j;
    EXPECT_EQ(dlogits[2 * v + j], kept_dlogits[1 * v + j]) << j;
    EXPECT_EQ(dlogits[1 * v + j], 0.0f) << j;
    EXPECT_EQ(dlogits[3 * v + j], 0.0f) << j;
  }

  // Nothing scored: loss 0 and no gradient.
  std::vector<int32_t> none(n, kUnscoredTarget);
  EXPECT_EQ(CrossEntropyForward(probs.data(), logits.data(), none.data(), n, v), 0.0);
  CrossEntropyBackward(dlogits.data(), probs.data(), none.data(), n, v);
  for (float d : dlogits) EXPECT_EQ(d, 0.0f);
}

// ---------------------------------------------------------------------------
// Vectorized math and threads

TEST(FastMathTest, ExpWithinOneMillionthOfLibm) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.00731f) {
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(FastExp(x) / want - 1.0));
  }
  EXPECT_LT(worst, 2e-7);
  // Clamped, never 0 or inf.
  EXPECT_GT(FastExp(-1000.0f), 0.0f);
  EXPECT_TRUE(std::isfinite(FastExp(1000.0f)));
  EXPECT_TRUE(std::isnan(FastExp(NAN)));
}

TEST(ActivationTest, GeluTanhMatchesDoublePrecisionFormula) {
  std::vector<float> x;
  for (float v = -12.0f; v <= 12.0f; v += 0.0037f) x.push_back(v);
  std::vector<float> y(x.size()), dx(x.size()), ones(x.size(), 1.0f);
  GeluTanhForward(y.data(), x.data(), x.size());
  GeluTanhBackward(dx.data(), ones.data(), x.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double xi = x[i];
    const double u = std::sqrt(2.0 / M_PI) * (xi + 0.044715 * xi * xi * xi);
    const double t = std::tanh(u);
    const double want = 0.5 * xi * (1.0 + t);
    const double dwant = 0.5 * (1.0 + t) + 0.5 * xi * (1.0 - t * t) * std::sqrt(2.0 / M_PI) *
                                               (1.0 + 3.0 * 0.044715 * xi * xi);
    // A polynomial, FastExp (<= 2e-7 relative) inside tanh and a few
    // products: 16 u. The derivative has twice the operations, and its
    // 1 - t^2 cancels where t -> 1: tanh's absolute error (<= 4 u) comes out
    // doubled and multiplied by 0.5 x sqrt(2/pi) (1 + 3 * 0.044715 x^2).
    const double amplification =
        0.5 * std::fabs(xi) * std::sqrt(2.0 / M_PI) * (1.0 + 3.0 * 0.044715 * xi * xi);
    ASSERT_NEAR(y[i], want, ElementTolerance(want)) << "x=" << xi;
    ASSERT_NEAR(dx[i], dwant, 2 * ElementTolerance(dwant) + amplification * 8 * kFloat32Unit)
        << "x=" << xi;
  }
}

// Our kernels split rows or columns among threads, never a sum: the results
// are the same bits whatever the number of threads (and in place or not).
// Attention's GEMMs run one (batch row, head) per thread, so they are too; a
// Linear's GEMM is OpenBLAS's to split, and its last bits may differ.
TEST(ThreadsTest, KernelsGiveTheSameBitsWithOneAndTwoThreads) {
  const int64_t b = 2, t = 64, c = 96, nh = 4, v = 80, n = b * t;
  auto x = RandomVector(n * c, -2, 2, 40);
  auto w = RandomVector(c, 0.5f, 1.5f, 41);
  auto bias = RandomVector(c, -0.5f, 0.5f, 42);
  auto qkv = RandomVector(n * 3 * c, -1, 1, 43);
  auto dout = RandomVector(n * c, -1, 1, 44);
  auto h = RandomVector(n * 4 * c, -4, 4, 45);
  auto logits = RandomVector(n * v, -5, 5, 46);
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = static_cast<int32_t>((i * 7) % v);
  auto dy2 = RandomVector(n * 4 * c, -1, 1, 48);

  auto run = [&](int threads) {
    SetComputeThreads(threads);
    std::vector<std::vector<float>> out;
    std::vector<float> ln(n * c), mean(n), rstd(n), dx(n * c), dw(c, 0.0f), db(c, 0.0f);
    LayerNormForward(ln.data(), mean.data(), rstd.data(), x.data(), w.data(), bias.data(), n, c);
    LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                      rstd.data(), n, c);
    std::vector<float> y(n * c), att(b * nh * t * t), dqkv(n * 3 * c);
    AttentionForward(y.data(), att.data(), qkv.data(), b, t, c, nh);
    AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), b, t, c, nh);
    std::vector<float> g(h.size()), dg = dy2;
    GeluTanhForward(g.data(), h.data(), h.size());
    GeluTanhBackward(dg.data(), dg.data(), h.data(), h.size());  // in place
    std::vector<float> probs(n * v), dlogits(n * v);
    const double loss = CrossEntropyForward(probs.data(), logits.data(), targets.data(), n, v);
    CrossEntropyBackward(dlogits.data(), probs.data(), targets.data(), n, v);
    std::vector<float> r(n * c);
    ResidualAdd(r.data(), x.data(), dout.data(), n * c);
    ResidualAdd(r.data(), r.data(), x.data(), n * c);
    out = {ln, mean, rstd, dx, dw, db, y, att, dqkv, g, dg, probs, dlogits, {float(loss)}, r};
    return out;
  };
  const auto one = run(1);
  const auto two = run(2);
  SetComputeThreads(1);
  ASSERT_EQ(one.size(), two.size());
  for (size_t i = 0; i < one.size(); ++i) {
    ASSERT_EQ(one[i].size(), two[i].size());
    EXPECT_EQ(0, std::memcmp(one[i].data(), two[i].data(), one[i].size() * sizeof(float)))
        << "output " << i << " differs between 1 and 2 threads";
  }
  // Out of place GELU backward equals in place.
  std::vector<float> dg(h.size());
  GeluTanhBackward(dg.data(), dy2.data(), h.data(), h.size());
  EXPECT_EQ(0, std::memcmp(dg.data(), one[10].data(), dg.size() * sizeof(float)));
}

}  // namespace
}  // namespace zeroshard
