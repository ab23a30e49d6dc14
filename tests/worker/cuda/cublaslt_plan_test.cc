// CublasLtLinear's mapping of row-major Linear / Conv1D products onto
// cuBLASLt's column-major D = op(A) op(B) (worker/cuda/cublaslt_plan.h),
// executed by a host column-major GEMM with cuBLASLt's operand conventions
// and compared with layers.h, for both weight layouts: what would otherwise
// only be checked on a GPU. Also the layouts' validity (ld >= stored rows),
// which operand's k-reduction is the bias gradient (BGRADA / BGRADB), and y /
// dy in padded rows (the LM head's logits, rows rounded up to 64 columns).
#include "worker/cuda/cublaslt_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace gpu {
namespace internal {
namespace {

using ::zeroshard::testing::SumErrorBound;

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// op(A)[i,l] and op(B)[l,j] as cuBLASLt reads them (column-major storage).
float OpA(const LtPlan& p, int64_t i, int64_t l) {
  const float* a = static_cast<const float*>(p.a);
  return p.trans_a ? a[l + i * p.lda] : a[i + l * p.lda];
}
float OpB(const LtPlan& p, int64_t l, int64_t j) {
  const float* b = static_cast<const float*>(p.b);
  return p.trans_b ? b[j + l * p.ldb] : b[l + j * p.ldb];
}

// D = op(A) op(B) in double; *abs gets the sums of |terms| (the error model's S).
void RunPlan(const LtPlan& p, std::vector<double>* abs) {
  float* d = static_cast<float*>(p.d);
  for (int64_t j = 0; j < p.n; ++j) {
    for (int64_t i = 0; i < p.m; ++i) {
      double s = 0, sa = 0;
      for (int64_t l = 0; l < p.k; ++l) {
        const double t = static_cast<double>(OpA(p, i, l)) * OpB(p, l, j);
        s += t;
        sa += std::fabs(t);
      }
      d[i + j * p.ldd] = static_cast<float>(s);
      (*abs)[i + j * p.ldd] = sa;
    }
  }
}

// cuBLASLt's layout rules: each stored matrix's ld covers its rows.
void ExpectValidLayouts(const LtPlan& p) {
  EXPECT_GE(p.lda, p.trans_a ? p.k : p.m) << "A's ld";
  EXPECT_GE(p.ldb, p.trans_b ? p.n : p.k) << "B's ld";
  EXPECT_GE(p.ldd, p.m) << "D's ld";
}

// The CPU computes in f32 (OpenBLAS), the host GEMM here in double: within
// gamma_k S of each other (tests/testing/error_model.h), plus the rounding of
// the double result to float.
void ExpectNear(const std::vector<float>& got, const std::vector<float>& want,
                const std::vector<double>& abs, int64_t k, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = SumErrorBound(k) * abs[i] + 0x1p-24 * std::fabs(want[i]) + 1e-30;
    ASSERT_NEAR(got[i], want[i], tol) << what << " element " << i;
  }
}

struct Shape {
  int64_t n, in, out;
};

// A packed [rows, cols] matrix in rows ld apart, the padding set to `pad`;
// and back.
std::vector<float> PadRows(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t ld,
                           float pad) {
  std::vector<float> out(rows * ld, pad);
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(m.begin() + i * cols, m.begin() + (i + 1) * cols, out.begin() + i * ld);
  }
  return out;
}
std::vector<float> UnpadRows(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> out(rows * cols);
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(m.begin() + i * ld, m.begin() + i * ld + cols, out.begin() + i * cols);
  }
  return out;
}

// The bias gradient of a BackwardWeight plan: the k-reduction of op(A) (one
// per row of D) or of op(B) (one per column of D) must be the column sums of
// dy (packed [N,OUT]), length OUT, as layers.h's db.
void ExpectBiasGradIsColumnSums(const LtPlan& bw, const std::vector<float>& dy,
                                const std::vector<float>& db, const Shape& s) {
  std::vector<float> bias_grad;
  if (bw.bias_grad_from_a) {
    ASSERT_EQ(bw.m, s.out);
    for (int64_t i = 0; i < bw.m; ++i) {
      double t = 0;
      for (int64_t l = 0; l < bw.k; ++l) t += OpA(bw, i, l);
      bias_grad.push_back(static_cast<float>(t));
    }
  } else {
    ASSERT_EQ(bw.n, s.out);
    for (int64_t j = 0; j < bw.n; ++j) {
      double t = 0;
      for (int64_t l = 0; l < bw.k; ++l) t += OpB(bw, l, j);
      bias_grad.push_back(static_cast<float>(t));
    }
  }
  std::vector<double> abs_db(s.out, 0.0);
  for (int64_t i = 0; i < s.n; ++i) {
    for (int64_t j = 0; j < s.out; ++j) abs_db[j] += std::fabs(dy[i * s.out + j]);
  }
  ExpectNear(bias_grad, db, abs_db, s.n, "db");
}

class PlanTest : public ::testing::TestWithParam<bool> {};  // true: w [OUT,IN]

TEST_P(PlanTest, ForwardBackwardInputAndWeightMatchLayers) {
  const bool out_in = GetParam();
  for (const Shape& s : {Shape{5, 7, 3}, Shape{4, 8, 16}, Shape{1, 1, 1}, Shape{9, 2, 11}}) {
    SCOPED_TRACE(std::string(out_in ? "Linear" : "Conv1D") + " n " + std::to_string(s.n) + " in " +
                 std::to_string(s.in) + " out " + std::to_string(s.out));
    const std::vector<float> x = Random(s.n * s.in, 1), w = Random(s.in * s.out, 2);
    const std::vector<float> dy = Random(s.n * s.out, 3);
    // layers.h: y, dx, dw (from 0), db (from 0).
    std::vector<float> y(s.n * s.out), dx(s.n * s.in), dw(s.in * s.out, 0.0f), db(s.out, 0.0f);
    if (out_in) {
      LinearForward(y.data(), x.data(), w.data(), nullptr, s.n, s.in, s.out);
      LinearBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), s.n, s.in,
                     s.out);
    } else {
      Conv1dForward(y.data(), x.data(), w.data(), nullptr, s.n, s.in, s.out);
      Conv1dBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), s.n, s.in,
                     s.out);
    }

    std::vector<float> got_y(y.size()), got_dx(dx.size()), got_dw(dw.size());
    std::vector<double> abs_y(y.size()), abs_dx(dx.size()), abs_dw(dw.size());
    const LtPlan fwd = PlanForward(out_in, got_y.data(), x.data(), w.data(), s.n, s.in, s.out);
    ExpectValidLayouts(fwd);
    EXPECT_EQ(fwd.m, s.out) << "the bias runs along D's rows: OUT";
    RunPlan(fwd, &abs_y);
    ExpectNear(got_y, y, abs_y, s.in, "y");

    const LtPlan bin =
        PlanBackwardInput(out_in, got_dx.data(), dy.data(), w.data(), s.n, s.in, s.out);
    ExpectValidLayouts(bin);
    EXPECT_EQ(bin.m, s.in) << "DGELU_BGRAD's bias gradient runs along D's rows: IN";
    EXPECT_EQ(bin.ldd, s.in) << "GELU's aux [N,IN] shares D's leading dimension";
    RunPlan(bin, &abs_dx);
    ExpectNear(got_dx, dx, abs_dx, s.out, "dx");

    const LtPlan bw =
        PlanBackwardWeight(out_in, got_dw.data(), x.data(), dy.data(), s.n, s.in, s.out);
    ExpectValidLayouts(bw);
    RunPlan(bw, &abs_dw);
    ExpectNear(got_dw, dw, abs_dw, s.n, "dw");

    ExpectBiasGradIsColumnSums(bw, dy, db, s);
  }
}

// Padded rows: y and dy [N,OUT] with rows ld > OUT apart (0 < ld - OUT, not
// always a multiple of anything), against layers.h on packed copies. dy's
// padding is NaN, so a plan that read it would make a product NaN; y's
// padding starts NaN and must stay NaN (never written). The last shape is
// GPT-2's tied LM head: OUT = V = 50257, ld = round_up(V, 64) = 50304 (a
// Linear: wte [V,C]; the Conv1D instance checks the other layout alike).
TEST_P(PlanTest, PaddedRowsOfYAndDyMatchLayers) {
  const bool out_in = GetParam();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  struct Padded {
    Shape s;
    int64_t ld;
  };
  for (const Padded& c : {Padded{{5, 7, 3}, 4}, Padded{{9, 2, 11}, 64}, Padded{{4, 8, 16}, 17},
                          Padded{{3, 6, 50257}, 50304}}) {
    const Shape& s = c.s;
    const int64_t ld = c.ld;
    SCOPED_TRACE(std::string(out_in ? "Linear" : "Conv1D") + " n " + std::to_string(s.n) + " in " +
                 std::to_string(s.in) + " out " + std::to_string(s.out) + " ld " +
                 std::to_string(ld));
    const std::vector<float> x = Random(s.n * s.in, 4), w = Random(s.in * s.out, 5);
    const std::vector<float> dy = Random(s.n * s.out, 6);
    std::vector<float> y(s.n * s.out), dx(s.n * s.in), dw(s.in * s.out, 0.0f), db(s.out, 0.0f);
    if (out_in) {
      LinearForward(y.data(), x.data(), w.data(), nullptr, s.n, s.in, s.out);
      LinearBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), s.n, s.in,
                     s.out);
    } else {
      Conv1dForward(y.data(), x.data(), w.data(), nullptr, s.n, s.in, s.out);
      Conv1dBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), s.n, s.in,
                     s.out);
    }
    const std::vector<float> padded_dy = PadRows(dy, s.n, s.out, ld, kNaN);

    std::vector<float> got_y(s.n * ld, kNaN);
    std::vector<double> abs_y(s.n * ld);
    const LtPlan fwd = PlanForward(out_in, got_y.data(), x.data(), w.data(), s.n, s.in, s.out, ld);
    ExpectValidLayouts(fwd);
    EXPECT_EQ(fwd.ldd, ld) << "y's rows are D's columns, ld apart";
    RunPlan(fwd, &abs_y);
    for (int64_t i = 0; i < s.n; ++i) {
      for (int64_t j = s.out; j < ld; ++j) {
        ASSERT_TRUE(std::isnan(got_y[i * ld + j])) << "padding of y written: " << i << "," << j;
      }
    }
    std::vector<double> abs_y_packed;
    for (int64_t i = 0; i < s.n; ++i) {
      abs_y_packed.insert(abs_y_packed.end(), abs_y.begin() + i * ld,
                          abs_y.begin() + i * ld + s.out);
    }
    ExpectNear(UnpadRows(got_y, s.n, s.out, ld), y, abs_y_packed, s.in, "y");

    std::vector<float> got_dx(s.n * s.in), got_dw(s.in * s.out);
    std::vector<double> abs_dx(got_dx.size()), abs_dw(got_dw.size());
    const LtPlan bin =
        PlanBackwardInput(out_in, got_dx.data(), padded_dy.data(), w.data(), s.n, s.in, s.out, ld);
    ExpectValidLayouts(bin);
    EXPECT_EQ(bin.ldb, ld) << "dy's rows are B's columns, ld apart";
    EXPECT_EQ(bin.ldd, s.in) << "dx stays packed";
    RunPlan(bin, &abs_dx);
    ExpectNear(got_dx, dx, abs_dx, s.out, "dx");

    const LtPlan bw =
        PlanBackwardWeight(out_in, got_dw.data(), x.data(), padded_dy.data(), s.n, s.in, s.out, ld);
    ExpectValidLayouts(bw);
    EXPECT_EQ(bw.bias_grad_from_a ? bw.lda : bw.ldb, ld) << "dy's operand has leading dimension ld";
    RunPlan(bw, &abs_dw);
    ExpectNear(got_dw, dw, abs_dw, s.n, "dw");
    ExpectBiasGradIsColumnSums(bw, dy, db, s);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, PlanTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "Linear" : "Conv1D");
                         });

}  // namespace
}  // namespace internal
}  // namespace gpu
}  // namespace zeroshard
