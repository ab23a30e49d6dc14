#include "worker/model/layers.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "worker/model/fast_math.h"
#include "worker/model/kernel_profile.h"
#include "worker/model/layers_internal.h"
#include "worker/model/parallel.h"

namespace zeroshard {
namespace layers_internal {

void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

ZS_VECTOR_CLONES void Scale(float* __restrict row, int64_t len, float scale) {
  for (int64_t s = 0; s < len; ++s) row[s] *= scale;
}

}  // namespace layers_internal

using layers_internal::Gemm;
using layers_internal::kColumnGrain;
using layers_internal::kElementGrain;
using layers_internal::kRowGrain;
using layers_internal::Scale;

namespace {

// y[i,:] = b for every row (b may be nullptr: y untouched). Returns the beta
// the following GEMM should use: 1 to add onto the bias, 0 to overwrite.
float BroadcastBias(float* y, const float* b, int64_t n, int64_t out) {
  if (b == nullptr) return 0.0f;
  ParallelFor(n, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(y + i * out, b, out * sizeof(float));
  });
  return 1.0f;
}

// db[o] += sum over rows i of dy[i,o] for o in [begin, end), rows in order.
ZS_VECTOR_CLONES void AddColumnSumsRange(float* __restrict db, const float* __restrict dy,
                                         int64_t n, int64_t out, int64_t begin, int64_t end) {
  for (int64_t i = 0; i < n; ++i) {
    const float* dy_i = dy + i * out;
    for (int64_t o = begin; o < end; ++o) db[o] += dy_i[o];
  }
}

// db[o] += sum over rows of dy[i,o]. Threads split the columns, so every
// sum runs over the rows in order whatever their number.
void AddColumnSums(float* db, const float* dy, int64_t n, int64_t out) {
  if (db == nullptr) return;
  ParallelFor(out, kColumnGrain,
              [&](int64_t begin, int64_t end) { AddColumnSumsRange(db, dy, n, out, begin, end); });
}

// dst[i] += a[i].
ZS_VECTOR_CLONES void AddInPlace(float* __restrict dst, const float* __restrict a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += a[i];
}

// dst[i] = a[i] + b[i].
ZS_VECTOR_CLONES void AddTo(float* __restrict dst, const float* __restrict a,
                            const float* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
}

}  // namespace

// ----------------------------------------------------------------------------
// Linear (PyTorch layout, w [OUT,IN])

namespace {

void LinearForwardImpl(float* y, const float* x, const float* w, const float* b, int64_t n,
                       int64_t in, int64_t out) {
  const float beta = BroadcastBias(y, b, n, out);
  // y[N,OUT] (+)= x[N,IN] . w^T[IN,OUT]
  Gemm(false, true, n, out, in, 1.0f, x, in, w, in, beta, y, out);
}

void LinearBackwardImpl(float* dx, float* dw, float* db, const float* dy, const float* x,
                        const float* w, int64_t n, int64_t in, int64_t out, bool accumulate) {
  // dx[N,IN] = dy[N,OUT] . w[OUT,IN]
  if (dx != nullptr) Gemm(false, false, n, in, out, 1.0f, dy, out, w, in, 0.0f, dx, in);
  // dw[OUT,IN] (+)= dy^T[OUT,N] . x[N,IN]
  Gemm(true, false, out, in, n, 1.0f, dy, out, x, in, accumulate ? 1.0f : 0.0f, dw, in);
  if (db != nullptr && !accumulate) std::fill(db, db + out, 0.0f);
  AddColumnSums(db, dy, n, out);
}

}  // namespace

void LinearForward(float* y, const float* x, const float* w, const float* b, int64_t n, int64_t in,
                   int64_t out) {
  KernelTimer timer(Kernel::kMatmul);
  LinearForwardImpl(y, x, w, b, n, in, out);
}

void LinearBackward(float* dx, float* dw, float* db, const float* dy, const float* x,
                    const float* w, int64_t n, int64_t in, int64_t out, bool accumulate) {
  KernelTimer timer(Kernel::kMatmul);
  LinearBackwardImpl(dx, dw, db, dy, x, w, n, in, out, accumulate);
}

// ----------------------------------------------------------------------------
// Conv1D (Hugging Face GPT-2 layout, w [IN,OUT])

void Conv1dForward(float* y, const float* x, const float* w, const float* b, int64_t n, int64_t in,
                   int64_t out) {
  KernelTimer timer(Kernel::kMatmul);
  const float beta = BroadcastBias(y, b, n, out);
  // y[N,OUT] (+)= x[N,IN] . w[IN,OUT]
  Gemm(false, false, n, out, in, 1.0f, x, in, w, out, beta, y, out);
}

void Conv1dBackward(float* dx, float* dw, float* db, const float* dy, const float* x,
                    const float* w, int64_t n, int64_t in, int64_t out) {
  KernelTimer timer(Kernel::kMatmul);
  // dx[N,IN] = dy[N,OUT] . w^T[OUT,IN]
  if (dx != nullptr) Gemm(false, true, n, in, out, 1.0f, dy, out, w, out, 0.0f, dx, in);
  // dw[IN,OUT] += x^T[IN,N] . dy[N,OUT]
  Gemm(true, false, in, out, n, 1.0f, x, in, dy, out, 1.0f, dw, out);
  AddColumnSums(db, dy, n, out);
}

// ----------------------------------------------------------------------------
// ReLU

void ReluForward(float* y, const float* x, int64_t n) {
  KernelTimer timer(Kernel::kActivation);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void ReluBackward(float* dx, const float* dy, const float* x, int64_t n) {
  KernelTimer timer(Kernel::kActivation);
  // The derivative at exactly 0 is taken as 0, as PyTorch does.
  for (int64_t i = 0; i < n; ++i) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

// ----------------------------------------------------------------------------
// GELU, exact

namespace {
constexpr float kInvSqrt2 = 0.70710678118654752440f;     // 1/sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;   // 1/sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286535588f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;
}  // namespace

void GeluForward(float* y, const float* x, int64_t n) {
  KernelTimer timer(Kernel::kActivation);
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    y[i] = 0.5f * xi * (1.0f + std::erf(xi * kInvSqrt2));
  }
}

void GeluBackward(float* dx, const float* dy, const float* x, int64_t n) {
  KernelTimer timer(Kernel::kActivation);
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    // d/dx [x Phi(x)] = Phi(x) + x phi(x), phi the standard normal density.
    const float cdf = 0.5f * (1.0f + std::erf(xi * kInvSqrt2));
    const float pdf = kInvSqrt2Pi * std::exp(-0.5f * xi * xi);
    dx[i] = dy[i] * (cdf + xi * pdf);
  }
}

// ----------------------------------------------------------------------------
// GELU, tanh approximation

namespace {

// 0.5 (1 + tanh(u)) = sigmoid(2u) = 1 / (1 + e^(-2u)): the form without
// cancellation where tanh(u) is near -1, and with FastExp it vectorizes.

// d = dy * dy/dx, with y = x s, s = sigmoid(2u):
// dy/dx = s + x s (1 - s) 2 du/dx.
inline float GeluTanhGrad(float xi) {
  const float u = kSqrt2OverPi * (xi + kGeluCubic * xi * xi * xi);
  const float du_dx = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * xi * xi);
  const float sg = 1.0f / (1.0f + FastExp(-2.0f * u));
  return sg + 2.0f * xi * sg * (1.0f - sg) * du_dx;
}

inline float GeluTanhValue(float xi) {
  const float u = kSqrt2OverPi * (xi + kGeluCubic * xi * xi * xi);
  return xi / (1.0f + FastExp(-2.0f * u));
}

ZS_VECTOR_CLONES void GeluTanhForwardInPlace(float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = GeluTanhValue(y[i]);
}

ZS_VECTOR_CLONES void GeluTanhForwardTo(float* __restrict y, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = GeluTanhValue(x[i]);
}

ZS_VECTOR_CLONES void GeluTanhBackwardInPlace(float* __restrict d, const float* __restrict x,
                                              int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = d[i] * GeluTanhGrad(x[i]);
}

ZS_VECTOR_CLONES void GeluTanhBackwardTo(float* __restrict dx, const float* __restrict dy,
                                         const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * GeluTanhGrad(x[i]);
}

}  // namespace

void GeluTanhForward(float* y, const float* x, int64_t n) {
  KernelTimer timer(Kernel::kActivation);
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    if (y == x) {
      GeluTanhForwardInPlace(y + begin, end - begin);
    } else {
      GeluTanhForwardTo(y + begin, x + begin, end - begin);
    }
  });
}

void GeluTanhBackward(float* dx, const float* dy, const float* x, int64_t n) {
  KernelTimer timer(Kernel::kActivation);
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    if (dx == dy) {
      GeluTanhBackwardInPlace(dx + begin, x + begin, end - begin);
    } else {
      GeluTanhBackwardTo(dx + begin, dy + begin, x + begin, end - begin);
    }
  });
}

// ----------------------------------------------------------------------------
// MSE loss

double MseForward(const float* pred, const float* target, int64_t n) {
  KernelTimer timer(Kernel::kCrossEntropy);
  if (n == 0) return 0.0;
  double sum = 0.0;  // double: the mean of many small squares
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(pred[i]) - target[i];
    sum += d * d;
  }
  return sum / static_cast<double>(n);
}

void MseBackward(float* dpred, const float* pred, const float* target, int64_t n) {
  KernelTimer timer(Kernel::kCrossEntropy);
  const float scale = 2.0f / static_cast<float>(n);
  for (int64_t i = 0; i < n; ++i) dpred[i] = scale * (pred[i] - target[i]);
}

// ----------------------------------------------------------------------------
// LayerNorm

namespace {

// LayerNorm's row sums run in double over kSumLanes interleaved partial sums
// (element j goes to lane j % kSumLanes), combined pairwise at the end: the
// same order on every CPU and thread count, and 8 independent additions the
// compiler can put in vector registers (one running double sum was a chain of
// dependent additions: most of LayerNorm's time).
constexpr int kSumLanes = 8;

inline double CombineLanes(const double* lane) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

inline __attribute__((always_inline)) double SumLanes(const float* __restrict x, int64_t c) {
  double lane[kSumLanes] = {};
  int64_t j = 0;
  for (; j + kSumLanes <= c; j += kSumLanes) {
    for (int k = 0; k < kSumLanes; ++k) lane[k] += x[j + k];
  }
  for (int k = 0; j < c; ++j, ++k) lane[k] += x[j];
  return CombineLanes(lane);
}

inline __attribute__((always_inline)) double SquaredDeviationLanes(const float* __restrict x,
                                                                    int64_t c, double m) {
  double lane[kSumLanes] = {};
  int64_t j = 0;
  for (; j + kSumLanes <= c; j += kSumLanes) {
    for (int k = 0; k < kSumLanes; ++k) {
      const double d = x[j + k] - m;
      lane[k] += d * d;
    }
  }
  for (int k = 0; j < c; ++j, ++k) {
    const double d = x[j] - m;
    lane[k] += d * d;
  }
  return CombineLanes(lane);
}

ZS_VECTOR_CLONES void LayerNormForwardRows(float* __restrict out, float* __restrict mean,
                                           float* __restrict rstd, const float* __restrict x,
                                           const float* __restrict w, const float* __restrict b,
                                           int64_t c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float* x_i = x + i * c;
    // Two passes in double: the variance of activations with a large mean
    // loses everything to cancellation in a one-pass float sum.
    const double m = SumLanes(x_i, c) / static_cast<double>(c);
    const double var = SquaredDeviationLanes(x_i, c, m) / static_cast<double>(c);  // biased
    const float s = static_cast<float>(1.0 / std::sqrt(var + kLayerNormEps));
    const float mf = static_cast<float>(m);
    float* out_i = out + i * c;
    for (int64_t j = 0; j < c; ++j) out_i[j] = (x_i[j] - mf) * s * w[j] + b[j];
    mean[i] = mf;
    rstd[i] = s;
  }
}

// dx for rows [begin, end). With xhat = (x - mean) rstd and g = dout * w (the
// gradient at xhat): dx = rstd (g - mean(g) - xhat mean(g xhat)).
ZS_VECTOR_CLONES void LayerNormBackwardRows(float* __restrict dx, const float* __restrict dout,
                                            const float* __restrict x, const float* __restrict w,
                                            const float* __restrict mean,
                                            const float* __restrict rstd, int64_t c, int64_t begin,
                                            int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float* x_i = x + i * c;
    const float* dout_i = dout + i * c;
    const float m = mean[i];
    const float s = rstd[i];
    // kSumLanes partial sums in a fixed order, as in the forward.
    double g_lane[kSumLanes] = {}, gx_lane[kSumLanes] = {};
    int64_t j = 0;
    for (; j + kSumLanes <= c; j += kSumLanes) {
      for (int k = 0; k < kSumLanes; ++k) {
        const float xhat = (x_i[j + k] - m) * s;
        const float g = dout_i[j + k] * w[j + k];
        g_lane[k] += g;
        gx_lane[k] += static_cast<double>(g) * xhat;
      }
    }
    for (int k = 0; j < c; ++j, ++k) {
      const float xhat = (x_i[j] - m) * s;
      const float g = dout_i[j] * w[j];
      g_lane[k] += g;
      gx_lane[k] += static_cast<double>(g) * xhat;
    }
    const double g_sum = CombineLanes(g_lane);
    const double g_xhat_sum = CombineLanes(gx_lane);
    const float g_mean = static_cast<float>(g_sum / static_cast<double>(c));
    const float g_xhat_mean = static_cast<float>(g_xhat_sum / static_cast<double>(c));
    float* dx_i = dx + i * c;
    for (int64_t j = 0; j < c; ++j) {
      const float xhat = (x_i[j] - m) * s;
      dx_i[j] = s * (dout_i[j] * w[j] - g_mean - xhat * g_xhat_mean);
    }
  }
}

// dw[j] += sum over rows of dout * xhat, db[j] += sum of dout, for columns
// [begin, end), rows in order.
ZS_VECTOR_CLONES void LayerNormBackwardColumns(float* __restrict dw, float* __restrict db,
                                               const float* __restrict dout,
                                               const float* __restrict x,
                                               const float* __restrict mean,
                                               const float* __restrict rstd, int64_t n, int64_t c,
                                               int64_t begin, int64_t end) {
  for (int64_t i = 0; i < n; ++i) {
    const float* x_i = x + i * c;
    const float* dout_i = dout + i * c;
    const float m = mean[i];
    const float s = rstd[i];
    for (int64_t j = begin; j < end; ++j) {
      const float xhat = (x_i[j] - m) * s;
      dw[j] += dout_i[j] * xhat;
      db[j] += dout_i[j];
    }
  }
}

}  // namespace

void LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w,
                      const float* b, int64_t n, int64_t c) {
  KernelTimer timer(Kernel::kLayerNorm);
  ParallelFor(n, kRowGrain, [&](int64_t begin, int64_t end) {
    LayerNormForwardRows(out, mean, rstd, x, w, b, c, begin, end);
  });
}

void LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x,
                       const float* w, const float* mean, const float* rstd, int64_t n, int64_t c) {
  KernelTimer timer(Kernel::kLayerNorm);
  if (dx != nullptr) {
    ParallelFor(n, kRowGrain, [&](int64_t begin, int64_t end) {
      LayerNormBackwardRows(dx, dout, x, w, mean, rstd, c, begin, end);
    });
  }
  ParallelFor(c, kColumnGrain, [&](int64_t begin, int64_t end) {
    LayerNormBackwardColumns(dw, db, dout, x, mean, rstd, n, c, begin, end);
  });
}

// ----------------------------------------------------------------------------
// Token + position embedding

void EmbeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                      int64_t b, int64_t t, int64_t c) {
  KernelTimer timer(Kernel::kEmbedding);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t ti = 0; ti < t; ++ti) {
      float* out_bt = out + (bi * t + ti) * c;
      const float* tok = wte + static_cast<int64_t>(tokens[bi * t + ti]) * c;
      const float* pos = wpe + ti * c;
      for (int64_t j = 0; j < c; ++j) out_bt[j] = tok[j] + pos[j];
    }
  }
}

void EmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                       int64_t b, int64_t t, int64_t c) {
  KernelTimer timer(Kernel::kEmbedding);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t ti = 0; ti < t; ++ti) {
      const float* dout_bt = dout + (bi * t + ti) * c;
      float* dtok = dwte + static_cast<int64_t>(tokens[bi * t + ti]) * c;
      float* dpos = dwpe + ti * c;
      for (int64_t j = 0; j < c; ++j) {
        dtok[j] += dout_bt[j];
        dpos[j] += dout_bt[j];
      }
    }
  }
}

// ----------------------------------------------------------------------------
// Tied LM head: a bias-free Linear whose weight is the embedding matrix.

void LmHeadForward(float* logits, const float* x, const float* wte, int64_t n, int64_t c,
                   int64_t v) {
  KernelTimer timer(Kernel::kLmHead);
  LinearForwardImpl(logits, x, wte, nullptr, n, c, v);
}

void LmHeadBackward(float* dx, float* dwte, const float* dlogits, const float* x, const float* wte,
                    int64_t n, int64_t c, int64_t v) {
  KernelTimer timer(Kernel::kLmHead);
  LinearBackwardImpl(dx, dwte, nullptr, dlogits, x, wte, n, c, v, true);
}

// ----------------------------------------------------------------------------
// Residual add

void ResidualAdd(float* dst, const float* a, const float* b, int64_t n) {
  KernelTimer timer(Kernel::kResidual);
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    if (dst == a) {
      AddInPlace(dst + begin, b + begin, end - begin);
    } else if (dst == b) {
      AddInPlace(dst + begin, a + begin, end - begin);
    } else {
      AddTo(dst + begin, a + begin, b + begin, end - begin);
    }
  });
}

// ----------------------------------------------------------------------------
// Softmax cross-entropy

namespace {

// p[j] = e^(z[j] - max) for j < v; returns their sum in double (in order).
ZS_VECTOR_CLONES double ExpShiftedDouble(float* __restrict p, const float* __restrict z, int64_t v,
                                         float max) {
  for (int64_t j = 0; j < v; ++j) p[j] = FastExp(z[j] - max);
  double sum = 0.0;
  for (int64_t j = 0; j < v; ++j) sum += p[j];
  return sum;
}

ZS_VECTOR_CLONES void ScaleTo(float* __restrict d, const float* __restrict p, int64_t v,
                              float scale) {
  for (int64_t j = 0; j < v; ++j) d[j] = p[j] * scale;
}

}  // namespace

int64_t ScoredPositions(const int32_t* targets, int64_t n) {
  int64_t scored = 0;
  for (int64_t i = 0; i < n; ++i) scored += targets[i] != kUnscoredTarget;
  return scored;
}

double CrossEntropyForward(float* probs, const float* logits, const int32_t* targets, int64_t n,
                           int64_t v) {
  KernelTimer timer(Kernel::kCrossEntropy);
  const int64_t scored = ScoredPositions(targets, n);
  if (scored == 0) return 0.0;
  std::vector<double> losses(n);  // by row, summed in order below
  ParallelFor(n, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* z = logits + i * v;
      float* p = probs + i * v;
      float max_z = z[0];
      for (int64_t j = 1; j < v; ++j) max_z = std::max(max_z, z[j]);
      const double sum = ExpShiftedDouble(p, z, v, max_z);
      Scale(p, v, static_cast<float>(1.0 / sum));
      // -log softmax(z)[y] = log sum_j exp(z_j - max) - (z_y - max): never
      // log(0), even when the target's probability underflows.
      losses[i] = targets[i] == kUnscoredTarget
                      ? 0.0
                      : std::log(sum) - (static_cast<double>(z[targets[i]]) - max_z);
    }
  });
  double loss_sum = 0.0;
  for (int64_t i = 0; i < n; ++i) loss_sum += losses[i];
  return loss_sum / static_cast<double>(scored);
}

void CrossEntropyBackward(float* dlogits, const float* probs, const int32_t* targets, int64_t n,
                          int64_t v) {
  KernelTimer timer(Kernel::kCrossEntropy);
  const int64_t scored = ScoredPositions(targets, n);
  const float inv_n = scored == 0 ? 0.0f : 1.0f / static_cast<float>(scored);
  ParallelFor(n, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* d = dlogits + i * v;
      if (targets[i] == kUnscoredTarget) {
        std::fill(d, d + v, 0.0f);
        continue;
      }
      ScaleTo(d, probs + i * v, v, inv_n);
      d[targets[i]] -= inv_n;
    }
  });
}

}  // namespace zeroshard
