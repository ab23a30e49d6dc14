// The bounds of attention_error_model.h, evaluated in double per head.
#include "tests/testing/flash_attention_error_model.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "tests/testing/error_model.h"

namespace zeroshard::testing {
namespace {

constexpr double kU = kFloat32Unit;

// One head's inputs, read as doubles.
struct HeadIn {
  const std::vector<float>& qkv;
  const std::vector<float>& dout;
  int64_t t, c, hs, bi, h;
  double q(int64_t pos, int64_t i) const { return qkv[(bi * t + pos) * 3 * c + h * hs + i]; }
  double k(int64_t pos, int64_t i) const { return qkv[(bi * t + pos) * 3 * c + c + h * hs + i]; }
  double v(int64_t pos, int64_t i) const {
    return qkv[(bi * t + pos) * 3 * c + 2 * c + h * hs + i];
  }
  double g(int64_t pos, int64_t i) const { return dout[(bi * t + pos) * c + h * hs + i]; }
  int64_t Qkv(int64_t pos, int which, int64_t i) const {
    return (bi * t + pos) * 3 * c + which * c + h * hs + i;
  }
  int64_t Out(int64_t pos, int64_t i) const { return (bi * t + pos) * c + h * hs + i; }
};

// The per-head matrices of the backward, T x T (lower triangle used).
struct HeadTerms {
  std::vector<double> a, ds, dds;  // weights, exact ds, the bound on ds's error
  std::vector<double> w;           // per row: relative error bound of its weights
};

int64_t CeilDiv(int64_t x, int64_t y) { return (x + y - 1) / y; }

// Relative to sum |a b|: the error of a sum of n products as the tiled
// computation takes them (tensor cores), which bounds the naive one's
// gamma_n too (the header's 3xTF32 terms; gamma_n itself without them).
double ProductSum(int64_t n, const AttentionErrorModel& m) {
  return m.product_error + SumErrorBound(m.product_terms * n) * m.term_magnitude;
}

// Tolerance of a compared element: `single` bounds each computation's float32
// error, `operand` the tiled one's rounding of its product operands (the
// naive one has none), then the rounding to storage.
double Pair(double single, double operand, double exact, const AttentionErrorModel& m) {
  return 2 * single + operand + m.storage_unit * (std::fabs(exact) + single + operand);
}

// Forward and the row-wise parts of the backward of row r.
void Row(const HeadIn& in, int64_t r, const AttentionErrorModel& m, HeadTerms& ht,
         AttentionTolerances& tol) {
  const int64_t t = in.t, hs = in.hs, n = r + 1;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<double> s(n), dp(n), pabs(n);
  double sabs = 0, mx = -HUGE_VAL;
  for (int64_t j = 0; j < n; ++j) {
    double dot = 0, mag = 0;
    for (int64_t i = 0; i < hs; ++i) {
      dot += in.q(r, i) * in.k(j, i);
      mag += std::fabs(in.q(r, i) * in.k(j, i));
    }
    s[j] = scale * dot;
    sabs = std::max(sabs, scale * mag);
    mx = std::max(mx, s[j]);
  }
  double l = 0;
  for (int64_t j = 0; j < n; ++j) l += std::exp(s[j] - mx);
  double* a = &ht.a[r * t];
  for (int64_t j = 0; j < n; ++j) a[j] = std::exp(s[j] - mx) / l;
  const int64_t lse_at = (in.bi * (in.c / in.hs) + in.h) * t + r;
  const double lse = mx + std::log(l);
  tol.lse_exact[lse_at] = lse;

  const int64_t rescales = CeilDiv(n, m.key_cols) * CeilDiv(m.key_cols, m.softmax_step);
  const double e = (ProductSum(hs, m) + 6 * kU) * sabs + 2 * kU * std::log(double(n));
  const double chain = (rescales + 2) * (m.exp_error + kU);
  const double w = 2 * e + chain + SumErrorBound(n) + 2 * kU;
  ht.w[r] = w;
  tol.lse[lse_at] = e + chain + SumErrorBound(n) + 4 * kU * (std::fabs(lse) + sabs);

  double d_form_b = 0;  // D's error as dout . out
  for (int64_t i = 0; i < hs; ++i) {
    double o = 0, oabs = 0;
    for (int64_t j = 0; j < n; ++j) {
      o += a[j] * in.v(j, i);
      oabs += a[j] * std::fabs(in.v(j, i));
    }
    const double o_common = (w + ProductSum(n, m) + kU) * oabs;
    const double o_err = o_common + m.operand_unit * oabs;  // the tiled computation's
    tol.out[in.Out(r, i)] = Pair(o_common, m.operand_unit * oabs, o, m);
    const double g = std::fabs(in.g(r, i));
    d_form_b += SumErrorBound(hs) * g * std::fabs(o) +
                g * (o_err + m.storage_unit * (std::fabs(o) + o_err));
  }
  double d = 0, d_form_a = 0, adp = 0;  // D exact; D's error as sum_s a dp
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < hs; ++i) {
      dp[j] += in.g(r, i) * in.v(j, i);
      pabs[j] += std::fabs(in.g(r, i) * in.v(j, i));
    }
    d += a[j] * dp[j];
    adp += a[j] * std::fabs(dp[j]);
    d_form_a += a[j] * (w * std::fabs(dp[j]) + ProductSum(hs, m) * pabs[j]);
  }
  d_form_a += SumErrorBound(n) * adp;
  const double d_err = std::max(d_form_a, d_form_b);
  for (int64_t j = 0; j < n; ++j) {
    ht.ds[r * t + j] = a[j] * (dp[j] - d);
    ht.dds[r * t + j] =
        a[j] * ((w + 2 * kU) * std::fabs(dp[j] - d) + ProductSum(hs, m) * pabs[j] + d_err);
  }
}

// dq, dk, dv of one head from the row terms.
void Gradients(const HeadIn& in, const AttentionErrorModel& m, const HeadTerms& ht,
               AttentionTolerances& tol) {
  const int64_t t = in.t, hs = in.hs;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  for (int64_t i = 0; i < hs; ++i) {
    for (int64_t r = 0; r < t; ++r) {  // dq_r over keys s <= r
      double dq = 0, err = 0, op = 0, mag = 0;
      for (int64_t j = 0; j <= r; ++j) {
        const double dds = ht.dds[r * t + j], k = std::fabs(in.k(j, i));
        dq += ht.ds[r * t + j] * in.k(j, i);
        err += dds * k;
        op += m.operand_unit * (std::fabs(ht.ds[r * t + j]) + dds) * k;
        mag += std::fabs(ht.ds[r * t + j]) * k;
      }
      const double single = scale * (err + (ProductSum(r + 1, m) + 2 * kU) * mag);
      tol.dqkv[in.Qkv(r, 0, i)] = Pair(single, scale * op, scale * dq, m);
    }
    for (int64_t j = 0; j < t; ++j) {  // dk_j, dv_j over queries r >= j
      double dk = 0, dk_err = 0, dk_op = 0, dk_mag = 0, dv = 0, dv_err = 0, dv_mag = 0;
      for (int64_t r = j; r < t; ++r) {
        const double ds = ht.ds[r * t + j], a = ht.a[r * t + j], dds = ht.dds[r * t + j];
        dk += ds * in.q(r, i);
        dk_err += dds * std::fabs(in.q(r, i));
        dk_op += m.operand_unit * (std::fabs(ds) + dds) * std::fabs(in.q(r, i));
        dk_mag += std::fabs(ds * in.q(r, i));
        dv += a * in.g(r, i);
        dv_err += (ht.w[r] + kU) * a * std::fabs(in.g(r, i));
        dv_mag += a * std::fabs(in.g(r, i));
      }
      const double gamma = ProductSum(t - j, m);
      tol.dqkv[in.Qkv(j, 1, i)] =
          Pair(scale * (dk_err + (gamma + 2 * kU) * dk_mag), scale * dk_op, scale * dk, m);
      tol.dqkv[in.Qkv(j, 2, i)] = Pair(dv_err + gamma * dv_mag, m.operand_unit * dv_mag, dv, m);
    }
  }
}

}  // namespace

AttentionTolerances CausalAttentionTolerances(const std::vector<float>& qkv,
                                              const std::vector<float>& dout, int64_t b, int64_t t,
                                              int64_t c, int64_t nh,
                                              const AttentionErrorModel& model) {
  AttentionTolerances tol;
  tol.out.assign(b * t * c, 0.0);
  tol.dqkv.assign(b * t * 3 * c, 0.0);
  tol.lse.assign(b * nh * t, 0.0);
  tol.lse_exact.assign(b * nh * t, 0.0);
  const int64_t hs = c / nh;
  HeadTerms ht;
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t h = 0; h < nh; ++h) {
      const HeadIn in{qkv, dout, t, c, hs, bi, h};
      ht.a.assign(t * t, 0.0);
      ht.ds.assign(t * t, 0.0);
      ht.dds.assign(t * t, 0.0);
      ht.w.assign(t, 0.0);
      for (int64_t r = 0; r < t; ++r) Row(in, r, model, ht, tol);
      Gradients(in, model, ht, tol);
    }
  }
  return tol;
}

namespace {

template <typename Want>
int64_t Outside(const std::vector<float>& got, const std::vector<Want>& want,
                const std::vector<double>& tolerance, std::string* worst) {
  int64_t bad = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < got.size() && i < want.size() && i < tolerance.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    if (err <= tolerance[i]) continue;  // NaN is outside
    ++bad;
    const double excess = std::isnan(err) ? HUGE_VAL : err - tolerance[i];
    if (excess > worst_excess) {
      worst_excess = excess;
      std::ostringstream s;
      s << "[" << i << "]: got " << got[i] << ", want " << want[i] << ", tolerance "
        << tolerance[i];
      *worst = s.str();
    }
  }
  if (got.size() != want.size() || got.size() != tolerance.size()) {
    ++bad;
    *worst = "sizes differ";
  }
  return bad;
}

}  // namespace

int64_t CountOutside(const std::vector<float>& got, const std::vector<double>& want,
                     const std::vector<double>& tolerance, std::string* worst) {
  return Outside(got, want, tolerance, worst);
}

int64_t CountOutside(const std::vector<float>& got, const std::vector<float>& want,
                     const std::vector<double>& tolerance, std::string* worst) {
  return Outside(got, want, tolerance, worst);
}

}  // namespace zeroshard::testing
