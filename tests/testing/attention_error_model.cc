// The fused attention error model (attention_error_model.h).
#include "tests/testing/attention_error_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "worker/model/layers.h"

namespace zeroshard::testing {
namespace {

constexpr double kU = 0x1p-8;   // bf16 unit roundoff
constexpr double kE = 0x1p-24;  // f32 unit roundoff

// One head of the problem as its own B = 1, NH = 1 problem (qkv [T, 3HS],
// out / dout [T, HS]), and the bounds of the error model (attention_error_model.h).
struct Head {
  int64_t t, hs;
  std::vector<float> qkv, dout;       // inputs (bf16 values)
  std::vector<float> out, att, dqkv;  // CPU reference
  std::vector<double> lse;            // reference, in double
  std::vector<double> out_bound, lse_bound, dqkv_bound;

  float q(int64_t r, int64_t i) const { return qkv[r * 3 * hs + i]; }
  float k(int64_t r, int64_t i) const { return qkv[r * 3 * hs + hs + i]; }
  float v(int64_t r, int64_t i) const { return qkv[r * 3 * hs + 2 * hs + i]; }
  float p(int64_t r, int64_t s) const { return att[r * t + s]; }
};

Head ExtractHead(const AttentionShape& s, const std::vector<float>& qkv,
                 const std::vector<float>& dout, int64_t bi, int64_t h) {
  Head head{s.t, s.hs()};
  const int64_t hs = s.hs();
  head.qkv.resize(s.t * 3 * hs);
  head.dout.resize(s.t * hs);
  for (int64_t r = 0; r < s.t; ++r) {
    const int64_t row = bi * s.t + r;
    for (int part = 0; part < 3; ++part) {
      for (int64_t i = 0; i < hs; ++i) {
        head.qkv[r * 3 * hs + part * hs + i] = qkv[row * 3 * s.c + part * s.c + h * hs + i];
      }
    }
    for (int64_t i = 0; i < hs; ++i) head.dout[r * hs + i] = dout[row * s.c + h * hs + i];
  }
  return head;
}

// The reference values and the forward bounds (out, lse); fills sigma.
void ForwardReference(Head& hd, std::vector<double>& sigma) {
  const int64_t t = hd.t, hs = hd.hs;
  hd.out.assign(t * hs, 0.0f);
  hd.att.assign(t * t, 0.0f);
  AttentionForward(hd.out.data(), hd.att.data(), hd.qkv.data(), 1, t, hs, 1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  hd.lse.assign(t, 0.0);
  hd.lse_bound.assign(t, 0.0);
  hd.out_bound.assign(t * hs, 0.0);
  sigma.assign(t, 0.0);
  for (int64_t r = 0; r < t; ++r) {
    std::vector<double> score(r + 1);
    double max_score = -1e300, max_abs = 0.0;
    for (int64_t s = 0; s <= r; ++s) {
      double dot = 0.0, abs_dot = 0.0;
      for (int64_t i = 0; i < hs; ++i) {
        dot += static_cast<double>(hd.q(r, i)) * hd.k(s, i);
        abs_dot += std::fabs(static_cast<double>(hd.q(r, i)) * hd.k(s, i));
      }
      score[s] = scale * dot;
      max_score = std::max(max_score, score[s]);
      max_abs = std::max(max_abs, abs_dot);
    }
    double sum = 0.0;
    for (int64_t s = 0; s <= r; ++s) sum += std::exp(score[s] - max_score);
    hd.lse[r] = max_score + std::log(sum);
    sigma[r] = hs * kE * scale * max_abs;
    hd.lse_bound[r] = sigma[r] + (t + 8) * kE * (1.0 + std::fabs(hd.lse[r]));
    const double rel = kU + 2 * sigma[r] + (t + hs + 8) * kE;
    for (int64_t i = 0; i < hs; ++i) {
      double m = 0.0;
      for (int64_t s = 0; s <= r; ++s) m += hd.p(r, s) * std::fabs(hd.v(s, i));
      hd.out_bound[r * hs + i] = rel * m + kU * std::fabs(hd.out[r * hs + i]);
    }
  }
}

// The reference gradients and their bounds (dqkv laid out like qkv).
void BackwardReference(Head& hd, const std::vector<double>& sigma) {
  const int64_t t = hd.t, hs = hd.hs;
  hd.dqkv.assign(t * 3 * hs, 0.0f);
  AttentionBackward(hd.dqkv.data(), hd.dout.data(), hd.qkv.data(), hd.att.data(), 1, t, hs, 1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  // E_ts (dS's error bound) and |dS_ts|, lower triangle, row-major [t, t].
  std::vector<double> err(t * t, 0.0), ds(t * t, 0.0);
  for (int64_t r = 0; r < t; ++r) {
    std::vector<double> dp(r + 1), dp_abs(r + 1);
    double d = 0.0, dd = 0.0;
    for (int64_t s = 0; s <= r; ++s) {
      for (int64_t i = 0; i < hs; ++i) {
        dp[s] += static_cast<double>(hd.dout[r * hs + i]) * hd.v(s, i);
        dp_abs[s] += std::fabs(static_cast<double>(hd.dout[r * hs + i]) * hd.v(s, i));
      }
      d += hd.p(r, s) * dp[s];
    }
    for (int64_t i = 0; i < hs; ++i)
      dd += std::fabs(hd.dout[r * hs + i]) * hd.out_bound[r * hs + i];
    // P = exp(score - lse) recomputed from the forward's lse: off by the
    // score's error and lse's whole bound (which grows with |lse|).
    const double rel = kU + sigma[r] + hd.lse_bound[r];
    for (int64_t s = 0; s <= r; ++s) {
      const double g = std::fabs(dp[s] - d);
      err[r * t + s] = hd.p(r, s) * (rel * g + dd + hs * kE * dp_abs[s]);
      ds[r * t + s] = hd.p(r, s) * g;
    }
  }
  hd.dqkv_bound.assign(t * 3 * hs, 0.0);
  auto dq = [&](int64_t r, int64_t i) -> double& { return hd.dqkv_bound[r * 3 * hs + i]; };
  auto dk = [&](int64_t r, int64_t i) -> double& { return hd.dqkv_bound[r * 3 * hs + hs + i]; };
  auto dv = [&](int64_t r, int64_t i) -> double& { return hd.dqkv_bound[r * 3 * hs + 2 * hs + i]; };
  for (int64_t r = 0; r < t; ++r) {
    const double rel = kU + sigma[r] + hd.lse_bound[r];
    for (int64_t s = 0; s <= r; ++s) {
      const double e = err[r * t + s], a = ds[r * t + s], p = hd.p(r, s);
      for (int64_t i = 0; i < hs; ++i) {
        dq(r, i) += scale * (e + t * kE * a) * std::fabs(hd.k(s, i));
        dk(s, i) += scale * (e + t * kE * a) * std::fabs(hd.q(r, i));
        dv(s, i) += p * rel * std::fabs(hd.dout[r * hs + i]);
      }
    }
  }
  for (int64_t j = 0; j < t * 3 * hs; ++j) hd.dqkv_bound[j] += kU * std::fabs(hd.dqkv[j]);
}

// got[j] within bound[j] of want[j] for every j; reports the worst and the
// largest error / bound ratio seen (how close the model is to binding).
::testing::AssertionResult WithinBounds(const std::vector<float>& got,
                                        const std::vector<double>& want,
                                        const std::vector<double>& bound, const std::string& what) {
  size_t bad = 0, worst = 0;
  double worst_ratio = 0.0;
  for (size_t j = 0; j < got.size(); ++j) {
    const double err = std::fabs(static_cast<double>(got[j]) - want[j]);
    const double ratio = std::isfinite(err) ? err / std::max(bound[j], 1e-30) : 1e300;
    if (!(err <= bound[j])) ++bad;
    if (ratio > worst_ratio || j == 0) worst_ratio = ratio, worst = j;
  }
  std::printf("  %-28s max |error| / bound = %.3f\n", what.c_str(), worst_ratio);
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << got.size() << " outside the error model; worst at ["
         << worst << "]: got " << got[worst] << ", want " << want[worst] << ", bound "
         << bound[worst];
}

template <typename T>
std::vector<double> ToDouble(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// The device's results for one head, cut out of the full tensors.
::testing::AssertionResult CompareHead(const AttentionShape& s, const Head& hd, int64_t bi,
                                       int64_t h, const AttentionResults& got) {
  const int64_t hs = s.hs();
  std::vector<float> got_out(s.t * hs), got_lse(s.t), got_dqkv(s.t * 3 * hs);
  for (int64_t r = 0; r < s.t; ++r) {
    const int64_t row = bi * s.t + r;
    for (int64_t i = 0; i < hs; ++i) got_out[r * hs + i] = got.out[row * s.c + h * hs + i];
    got_lse[r] = got.lse[(bi * s.nh + h) * s.t + r];
    for (int part = 0; part < 3; ++part) {
      for (int64_t i = 0; i < hs; ++i) {
        got_dqkv[r * 3 * hs + part * hs + i] = got.dqkv[row * 3 * s.c + part * s.c + h * hs + i];
      }
    }
  }
  const std::string at = "b " + std::to_string(bi) + " h " + std::to_string(h) + " ";
  ::testing::AssertionResult results[] = {
      WithinBounds(got_out, ToDouble(hd.out), hd.out_bound, at + "out"),
      WithinBounds(got_lse, hd.lse, hd.lse_bound, at + "lse"),
      WithinBounds(got_dqkv, ToDouble(hd.dqkv), hd.dqkv_bound, at + "dqkv")};
  for (auto& r : results) {
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBF16(v[i]);
  return out;
}

std::vector<float> FromBf16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = BF16ToFloat(v[i]);
  return out;
}

::testing::AssertionResult AttentionWithinErrorModel(
    const AttentionShape& s, const std::vector<float>& qkv, const std::vector<float>& dout,
    const AttentionResults& got, std::vector<std::pair<int64_t, int64_t>> heads) {
  if (heads.empty()) {
    for (int64_t bi = 0; bi < s.b; ++bi) {
      for (int64_t h = 0; h < s.nh; ++h) heads.emplace_back(bi, h);
    }
  }
  ::testing::AssertionResult all = ::testing::AssertionSuccess();
  for (const auto& [bi, h] : heads) {
    Head hd = ExtractHead(s, qkv, dout, bi, h);
    std::vector<double> sigma;
    ForwardReference(hd, sigma);
    BackwardReference(hd, sigma);
    ::testing::AssertionResult head = CompareHead(s, hd, bi, h, got);
    if (!head && all) all = head;  // the first failing head's report
  }
  return all;
}

}  // namespace zeroshard::testing
