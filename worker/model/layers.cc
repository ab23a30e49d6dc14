#include "worker/model/layers.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "worker/model/fast_math.h"
#include "worker/model/kernel_profile.h"
#include "worker/model/parallel.h"

// Loops marked ZS_VECTOR_CLONES are compiled twice, for AVX2 + FMA (x86-64-v3)
// and for the baseline, and the loader picks the one the CPU runs (GCC's
// target_clones). Both give the same results: contraction to FMA is off in
// ISO C++ mode, so the AVX2 clone does the same roundings 8 lanes at a time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZS_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ZS_VECTOR_CLONES
#endif

namespace zeroshard {
namespace {

// Rows (or columns, or elements) per parallel range: below this a loop stays
// on the calling thread.
constexpr int64_t kRowGrain = 16;
constexpr int64_t kElementGrain = 1 << 14;
constexpr int64_t kColumnGrain = 64;

// Row-major single-precision GEMM, C[M,N] = alpha op(A)[M,K] op(B)[K,N] +
// beta C. Sizes come in as int64_t and go to BLAS as blasint (32-bit here);
// every matrix in these models is far below 2^31 elements per dimension.
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

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
// Causal multi-head self-attention
//
// Per (batch row, head) the q, k, v of that head are strided views into qkv
// (row stride 3C), so the GEMMs read them in place without copies. Scores
// are computed for the full TxT square and the upper triangle is then
// zeroed: twice the minimal work, but one GEMM instead of T small ones.

namespace {

// Sums and maxima over a row go in 8 lanes (lane l takes s = l mod 8, in
// order), then the lanes combine pairwise: a fixed order, so the same bits
// whatever the thread count, and the lane loop vectorizes (a single running
// sum would be one dependent add per element).
constexpr int kLanes = 8;

inline float CombineLanes(const float* p) {
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// The maximum of row[0..len), len >= 1.
ZS_VECTOR_CLONES float RowMax(const float* __restrict row, int64_t len) {
  float m[kLanes];
  for (int l = 0; l < kLanes; ++l) m[l] = row[0];
  int64_t s = 0;
  for (; s + kLanes <= len; s += kLanes) {
    for (int l = 0; l < kLanes; ++l) m[l] = m[l] > row[s + l] ? m[l] : row[s + l];
  }
  for (; s < len; ++s) m[0] = m[0] > row[s] ? m[0] : row[s];
  float max = m[0];
  for (int l = 1; l < kLanes; ++l) max = max > m[l] ? max : m[l];
  return max;
}

// row[s] = e^(row[s] - max) for s < len; returns their sum.
ZS_VECTOR_CLONES float ExpShifted(float* __restrict row, int64_t len, float max) {
  for (int64_t s = 0; s < len; ++s) row[s] = FastExp(row[s] - max);
  float part[kLanes] = {};
  int64_t s = 0;
  for (; s + kLanes <= len; s += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += row[s + l];
  }
  for (int l = 0; s < len; ++s, ++l) part[l] += row[s];
  return CombineLanes(part);
}

ZS_VECTOR_CLONES void Scale(float* __restrict row, int64_t len, float scale) {
  for (int64_t s = 0; s < len; ++s) row[s] *= scale;
}

// d[s] = a[s] (d[s] - sum_r a[r] d[r]) for s < len.
ZS_VECTOR_CLONES void SoftmaxBackwardRow(float* __restrict d, const float* __restrict a,
                                         int64_t len) {
  float part[kLanes] = {};
  int64_t s = 0;
  for (; s + kLanes <= len; s += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += a[s + l] * d[s + l];
  }
  for (int l = 0; s < len; ++s, ++l) part[l] += a[s] * d[s];
  const float dot = CombineLanes(part);
  for (int64_t s = 0; s < len; ++s) d[s] = a[s] * (d[s] - dot);
}

}  // namespace

// The products of one (batch row, head) go through a register-tiled kernel:
// OpenBLAS's packing and its zero fill of C (beta = 0) cost as much as its
// arithmetic at these sizes (head size 64, T = 128: 2/3 of attention's time
// went outside sgemm's kernel). A tile is R <= 4 rows x 16 columns of C,
// its 2R vectors of 8 accumulators stay in registers while the contraction
// index p runs: per p, one row of B (2 vectors, contiguous) and R
// broadcasts of A. A is addressed with two strides, so A^T (the backward's
// att^T and dscore^T) needs no copy. B is read from per-head scratch: k
// (forward scores) and v (backward datt) transposed, v, k, q and dout
// copied contiguous (rows 3C floats apart fall in few L1 sets and thrash).
// Tiles of 4 rows: 6 rows (12 accumulators) spill one under GCC, 5 gain
// nothing (the loop is near the FMA peak). Every output element is one sum
// over p in order, computed by one thread: results do not depend on
// --threads. These kernels
// are compiled for x86-64-v3 only and contract a * b + c into FMAs (as
// OpenBLAS's kernels do for these products on such CPUs); without AVX2 and
// FMA (checked at run time), or off x86-64 GCC, attention keeps OpenBLAS.
namespace {

// One (batch row, head)'s views: q, k, v (and their gradients) are strided
// views into qkv / dqkv (rows 3C apart), out and dout rows C apart, att and
// its gradient a T x T block. Shared by both attention implementations.
struct HeadViews {
  const float* q;
  const float* k;
  const float* v;
  float* dq;  // null in the forward
  float* dk;
  float* dv;
  int64_t att;  // offset of the head's T x T block
  int64_t out;  // offset of the head's columns in out / dout
};

inline HeadViews Head(const float* qkv, float* dqkv, int64_t bh, int64_t nh, int64_t t,
                      int64_t c) {
  const int64_t bi = bh / nh;
  const int64_t hs = c / nh;
  const int64_t at = bi * t * 3 * c + (bh % nh) * hs;
  HeadViews v;
  v.q = qkv + at;
  v.k = v.q + c;
  v.v = v.q + 2 * c;
  v.dq = dqkv == nullptr ? nullptr : dqkv + at;
  v.dk = dqkv == nullptr ? nullptr : v.dq + c;
  v.dv = dqkv == nullptr ? nullptr : v.dq + 2 * c;
  v.att = bh * t * t;
  v.out = bi * t * c + (bh % nh) * hs;
  return v;
}

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZS_TILED_ATTENTION 1
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#pragma GCC optimize("fp-contract=fast")

namespace {

typedef float V8 __attribute__((vector_size(32)));
constexpr int64_t kTileRows = 4;
constexpr int64_t kTileCols = 16;

inline __attribute__((always_inline)) V8 LoadV8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline __attribute__((always_inline)) void StoreV8(float* p, V8 v) {
  std::memcpy(p, &v, sizeof(v));
}

// c[r*ldc + j] = alpha sum_{p<k} A(r,p) b[p*ldb + j] for r < R, j < 16,
// with A(r,p) = a[r*lda + p], or a[p*lda + r] when kAT (A stored transposed).
template <int R, bool kAT>
inline __attribute__((always_inline)) void Tile(float* __restrict c, int64_t ldc,
                                                const float* __restrict a, int64_t lda,
                                                const float* __restrict b, int64_t ldb, int64_t k,
                                                float alpha) {
  V8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V8{};
  for (int64_t p = 0; p < k; ++p) {
    const V8 b0 = LoadV8(b + p * ldb);
    const V8 b1 = LoadV8(b + p * ldb + 8);
    for (int r = 0; r < R; ++r) {
      const V8 ar = (kAT ? a[p * lda + r] : a[r * lda + p]) - V8{};  // broadcast
      acc[r][0] += ar * b0;
      acc[r][1] += ar * b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    StoreV8(c + r * ldc, alpha * acc[r][0]);
    StoreV8(c + r * ldc + 8, alpha * acc[r][1]);
  }
}

// The same for any rows <= kTileRows and cols <= kTileCols (edges).
template <bool kAT>
inline __attribute__((always_inline)) void TileAny(float* __restrict c, int64_t ldc, int64_t rows,
                                                   int64_t cols, const float* __restrict a,
                                                   int64_t lda, const float* __restrict b,
                                                   int64_t ldb, int64_t k, float alpha) {
  if (cols == kTileCols) {
    switch (rows) {
      case 4:
        return Tile<4, kAT>(c, ldc, a, lda, b, ldb, k, alpha);
      case 3:
        return Tile<3, kAT>(c, ldc, a, lda, b, ldb, k, alpha);
      case 2:
        return Tile<2, kAT>(c, ldc, a, lda, b, ldb, k, alpha);
      default:
        return Tile<1, kAT>(c, ldc, a, lda, b, ldb, k, alpha);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kTileCols] = {};
    for (int64_t p = 0; p < k; ++p) {
      const float ar = kAT ? a[p * lda + r] : a[r * lda + p];
      for (int64_t j = 0; j < cols; ++j) acc[j] += ar * b[p * ldb + j];
    }
    for (int64_t j = 0; j < cols; ++j) c[r * ldc + j] = alpha * acc[j];
  }
}

// C[m,n] = alpha A[m,k] B[k,n], B row-major (ldb), A row-major (lda) or,
// when kAT, stored transposed. With causal, the rows' A is lower triangular
// (0 at p > row): row block i0 runs p < i0 + rows; with kAT, A^T is lower
// triangular (A is 0 at p < row): block i0 runs p >= i0.
template <bool kAT>
inline __attribute__((always_inline)) void Product(float* __restrict c, int64_t ldc, int64_t m,
                                                   int64_t n, const float* __restrict a,
                                                   int64_t lda, const float* __restrict b,
                                                   int64_t ldb, int64_t k, float alpha) {
  for (int64_t i0 = 0; i0 < m; i0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, m - i0);
    const int64_t p0 = kAT ? i0 : 0;
    const int64_t p1 = kAT ? k : std::min(k, i0 + rows);
    const float* a_i0 = kAT ? a + p0 * lda + i0 : a + i0 * lda;
    for (int64_t j0 = 0; j0 < n; j0 += kTileCols) {
      TileAny<kAT>(c + i0 * ldc + j0, ldc, rows, std::min(kTileCols, n - j0), a_i0, lda,
                   b + p0 * ldb + j0, ldb, p1 - p0, alpha);
    }
  }
}

void CausalProduct(float* __restrict c, int64_t ldc, int64_t m, int64_t n,
                   const float* __restrict a, int64_t lda, const float* __restrict b, int64_t ldb,
                   int64_t k, float alpha) {
  Product<false>(c, ldc, m, n, a, lda, b, ldb, k, alpha);
}

void CausalProductAT(float* __restrict c, int64_t ldc, int64_t m, int64_t n,
                     const float* __restrict a, int64_t lda, const float* __restrict b, int64_t ldb,
                     int64_t k, float alpha) {
  Product<true>(c, ldc, m, n, a, lda, b, ldb, k, alpha);
}

// Scores of query rows i0..i0+rows against keys < i0 + rows (rounded up to
// whole tiles; the extra entries are above the diagonal). kt: [hs, ldkt].
void ScoreRows(float* __restrict s, int64_t lds, int64_t i0, int64_t rows, int64_t t,
               const float* __restrict q, int64_t ldq, const float* __restrict kt, int64_t ldkt,
               int64_t hs, float alpha) {
  const int64_t keys = i0 + rows;
  for (int64_t j0 = 0; j0 < keys; j0 += kTileCols) {
    TileAny<false>(s + i0 * lds + j0, lds, rows, std::min(kTileCols, t - j0), q + i0 * ldq, ldq,
                   kt + j0, ldkt, hs, alpha);
  }
}

// dst[s*hs + d] = src[s*ld + d] (contiguous copy of a head's view).
void CopyHead(float* __restrict dst, const float* __restrict src, int64_t ld, int64_t t,
              int64_t hs) {
  for (int64_t s = 0; s < t; ++s) std::memcpy(dst + s * hs, src + s * ld, hs * sizeof(float));
}

typedef int32_t I8 __attribute__((vector_size(32)));

// The transpose of 8 x 8 floats: dst[j*ldd + i] = src[i*lds + j].
inline __attribute__((always_inline)) void Transpose8x8(float* __restrict dst, int64_t ldd,
                                                        const float* __restrict src, int64_t lds) {
  V8 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = LoadV8(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shuffle(r[i], r[i + 1], I8{0, 8, 1, 9, 4, 12, 5, 13});
    t[i + 1] = __builtin_shuffle(r[i], r[i + 1], I8{2, 10, 3, 11, 6, 14, 7, 15});
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = __builtin_shuffle(t[i], t[i + 2], I8{0, 1, 8, 9, 4, 5, 12, 13});
    u[i + 1] = __builtin_shuffle(t[i], t[i + 2], I8{2, 3, 10, 11, 6, 7, 14, 15});
    u[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], I8{0, 1, 8, 9, 4, 5, 12, 13});
    u[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], I8{2, 3, 10, 11, 6, 7, 14, 15});
  }
  for (int j = 0; j < 4; ++j) {
    StoreV8(dst + j * ldd, __builtin_shuffle(u[j], u[j + 4], I8{0, 1, 2, 3, 8, 9, 10, 11}));
    StoreV8(dst + (j + 4) * ldd, __builtin_shuffle(u[j], u[j + 4], I8{4, 5, 6, 7, 12, 13, 14, 15}));
  }
}

// dst[d*ldt + s] = src[s*ld + d] for s < t, d < hs, in blocks of 8 x 8.
void TransposeHead(float* __restrict dst, int64_t ldt, const float* __restrict src, int64_t ld,
                   int64_t t, int64_t hs) {
  int64_t s0 = 0;
  for (; s0 + 8 <= t; s0 += 8) {
    int64_t d0 = 0;
    for (; d0 + 8 <= hs; d0 += 8) Transpose8x8(dst + d0 * ldt + s0, ldt, src + s0 * ld + d0, ld);
    for (int64_t d = d0; d < hs; ++d) {
      for (int64_t s = s0; s < s0 + 8; ++s) dst[d * ldt + s] = src[s * ld + d];
    }
  }
  for (int64_t s = s0; s < t; ++s) {
    for (int64_t d = 0; d < hs; ++d) dst[d * ldt + s] = src[s * ld + d];
  }
}

// Leading dimension of a head's transposed copy: t rounded up to whole
// tiles, plus 8 so that its rows do not all fall in the same cache sets.
int64_t TransposedLd(int64_t t) { return (t + kTileCols - 1) / kTileCols * kTileCols + 8; }

}  // namespace

#pragma GCC pop_options

namespace {

// The tiled kernels are compiled for x86-64-v3 only: in the baseline's SSE2
// the 8-lane vectors are lowered piecewise (20x slower than OpenBLAS).
bool TiledAttention() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

void AttentionForwardTiled(float* out, float* att, const float* qkv, int64_t b, int64_t t,
                           int64_t c, int64_t nh) {
  const int64_t hs = c / nh;  // head size
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // Threads take (batch row, head) pairs; each pair runs on its thread.
  ParallelFor(b * nh, 1, [&](int64_t begin, int64_t end) {
    // One head's k transposed and a contiguous copy of its v.
    const int64_t ldkt = TransposedLd(t);
    std::vector<float> kt(static_cast<size_t>(hs * ldkt)), vc(static_cast<size_t>(t * hs));
    for (int64_t bh = begin; bh < end; ++bh) {
      const auto [q, k, v, dq_unused, dk_unused, dv_unused, att_at, out_at] =
          Head(qkv, nullptr, bh, nh, t, c);
      float* att_bh = att + att_at;
      float* out_bh = out + out_at;
      TransposeHead(kt.data(), ldkt, k, 3 * c, t, hs);
      CopyHead(vc.data(), v, 3 * c, t, hs);
      for (int64_t r0 = 0; r0 < t; r0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, t - r0);
        const int64_t keys = r0 + rows;  // positions these rows may attend to
        // scores[rows,keys] = scale q[rows,HS] . k^T[HS,keys]
        ScoreRows(att_bh, t, r0, rows, t, q, 3 * c, kt.data(), ldkt, hs, scale);
        // Causal softmax of each row over s <= t (max-subtracted for stability).
        for (int64_t ti = r0; ti < keys; ++ti) {
          float* row = att_bh + ti * t;
          const float sum = ExpShifted(row, ti + 1, RowMax(row, ti + 1));
          Scale(row, ti + 1, 1.0f / sum);
          std::fill(row + ti + 1, row + t, 0.0f);
        }
      }
      // out_h[T,HS] = att[T,T] . v[T,HS], row block i over keys < i + rows.
      CausalProduct(out_bh, c, t, hs, att_bh, t, vc.data(), hs, t, 1.0f);
    }
  });
}

void AttentionBackwardTiled(float* dqkv, const float* dout, const float* qkv, const float* att,
                            int64_t b, int64_t t, int64_t c, int64_t nh) {
  const int64_t hs = c / nh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  ParallelFor(b * nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> datt(static_cast<size_t>(t * t));  // d(loss)/d(att) of one head
    // Contiguous copies of one head's q, k and dout, and v transposed.
    const int64_t ldvt = TransposedLd(t);
    std::vector<float> qc(static_cast<size_t>(t * hs)), kc(qc.size()), doc(qc.size());
    std::vector<float> vt(static_cast<size_t>(hs * ldvt));
    for (int64_t bh = begin; bh < end; ++bh) {
      const auto [q, k, v, dq, dk, dv, att_at, out_at] = Head(qkv, dqkv, bh, nh, t, c);
      const float* att_bh = att + att_at;
      const float* dout_bh = dout + out_at;
      CopyHead(qc.data(), q, 3 * c, t, hs);
      CopyHead(kc.data(), k, 3 * c, t, hs);
      CopyHead(doc.data(), dout_bh, c, t, hs);
      TransposeHead(vt.data(), ldvt, v, 3 * c, t, hs);
      for (int64_t r0 = 0; r0 < t; r0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, t - r0);
        const int64_t keys = r0 + rows;
        // datt[rows,keys] = dout_h[rows,HS] . v^T[HS,keys]
        ScoreRows(datt.data(), t, r0, rows, t, doc.data(), hs, vt.data(), ldvt, hs, 1.0f);
        // Softmax backward, in place: dscore_s = att_s (datt_s - sum_r att_r datt_r),
        // and 0 above the diagonal.
        for (int64_t ti = r0; ti < keys; ++ti) {
          float* d = datt.data() + ti * t;
          SoftmaxBackwardRow(d, att_bh + ti * t, ti + 1);
          std::fill(d + ti + 1, d + t, 0.0f);
        }
      }
      // scores = scale q k^T: dq[T,HS] = scale dscore[T,T] . k[T,HS]
      CausalProduct(dq, 3 * c, t, hs, datt.data(), t, kc.data(), hs, t, scale);
      // Key s is attended to by the rows from s on:
      // dv[T,HS] = att^T[T,T] . dout_h[T,HS]; dk[T,HS] = scale dscore^T[T,T] . q[T,HS].
      CausalProductAT(dv, 3 * c, t, hs, att_bh, t, doc.data(), hs, t, 1.0f);
      CausalProductAT(dk, 3 * c, t, hs, datt.data(), t, qc.data(), hs, t, scale);
    }
  });
}

}  // namespace

#endif  // ZS_TILED_ATTENTION

namespace {

// Without AVX2 + FMA (or off x86-64 with GCC): OpenBLAS per head. Causal
// blocking: the rows (queries) go in blocks of kAttentionBlock, and a
// block's GEMMs stop at its last row's position, so the zeros above the
// diagonal are neither computed nor multiplied (5/8 of the full square's work
// at T = 128); the backward's transposed products (dv, dk) go by column
// blocks of keys, each starting at its first key's row.
constexpr int64_t kAttentionBlock = 32;

void AttentionForwardBlas(float* out, float* att, const float* qkv, int64_t b, int64_t t, int64_t c,
                          int64_t nh) {
  const int64_t hs = c / nh;  // head size
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // Threads take (batch row, head) pairs; each pair's GEMMs run on its thread.
  ParallelFor(b * nh, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const auto [q, k, v, dq_unused, dk_unused, dv_unused, att_at, out_at] =
          Head(qkv, nullptr, bh, nh, t, c);
      float* att_bh = att + att_at;
      float* out_bh = out + out_at;
      for (int64_t r0 = 0; r0 < t; r0 += kAttentionBlock) {
        const int64_t rows = std::min(kAttentionBlock, t - r0);
        const int64_t keys = r0 + rows;  // positions these rows may attend to
        // scores[rows,keys] = scale q[rows,HS] . k^T[HS,keys]
        Gemm(false, true, rows, keys, hs, scale, q + r0 * 3 * c, 3 * c, k, 3 * c, 0.0f,
             att_bh + r0 * t, t);
        // Causal softmax of each row over s <= t (max-subtracted for stability).
        for (int64_t ti = r0; ti < keys; ++ti) {
          float* row = att_bh + ti * t;
          const float sum = ExpShifted(row, ti + 1, RowMax(row, ti + 1));
          Scale(row, ti + 1, 1.0f / sum);
          std::fill(row + ti + 1, row + t, 0.0f);
        }
        // out_h[rows,HS] = att[rows,keys] . v[keys,HS]
        Gemm(false, false, rows, hs, keys, 1.0f, att_bh + r0 * t, t, v, 3 * c, 0.0f,
             out_bh + r0 * c, c);
      }
    }
  });
}

void AttentionBackwardBlas(float* dqkv, const float* dout, const float* qkv, const float* att,
                           int64_t b, int64_t t, int64_t c, int64_t nh) {
  const int64_t hs = c / nh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  ParallelFor(b * nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> datt(static_cast<size_t>(t * t));  // d(loss)/d(att) of one head
    for (int64_t bh = begin; bh < end; ++bh) {
      const auto [q, k, v, dq, dk, dv, att_at, out_at] = Head(qkv, dqkv, bh, nh, t, c);
      const float* att_bh = att + att_at;
      const float* dout_bh = dout + out_at;
      for (int64_t r0 = 0; r0 < t; r0 += kAttentionBlock) {
        const int64_t rows = std::min(kAttentionBlock, t - r0);
        const int64_t keys = r0 + rows;
        // datt[rows,keys] = dout_h[rows,HS] . v^T[HS,keys]
        Gemm(false, true, rows, keys, hs, 1.0f, dout_bh + r0 * c, c, v, 3 * c, 0.0f,
             datt.data() + r0 * t, t);
        // Softmax backward, in place: dscore_s = att_s (datt_s - sum_r att_r datt_r),
        // and 0 above the diagonal.
        for (int64_t ti = r0; ti < keys; ++ti) {
          float* d = datt.data() + ti * t;
          SoftmaxBackwardRow(d, att_bh + ti * t, ti + 1);
          std::fill(d + ti + 1, d + t, 0.0f);
        }
        // scores = scale q k^T: dq[rows,HS] = scale dscore[rows,keys] . k[keys,HS]
        Gemm(false, false, rows, hs, keys, scale, datt.data() + r0 * t, t, k, 3 * c, 0.0f,
             dq + r0 * 3 * c, 3 * c);
      }
      // Keys s0..s0+cols are attended to by the rows from s0 on:
      // dv[cols,HS] = att^T[cols,T-s0] . dout_h[T-s0,HS];
      // dk[cols,HS] = scale dscore^T[cols,T-s0] . q[T-s0,HS].
      for (int64_t s0 = 0; s0 < t; s0 += kAttentionBlock) {
        const int64_t cols = std::min(kAttentionBlock, t - s0);
        Gemm(true, false, cols, hs, t - s0, 1.0f, att_bh + s0 * t + s0, t, dout_bh + s0 * c, c,
             0.0f, dv + s0 * 3 * c, 3 * c);
        Gemm(true, false, cols, hs, t - s0, scale, datt.data() + s0 * t + s0, t, q + s0 * 3 * c,
             3 * c, 0.0f, dk + s0 * 3 * c, 3 * c);
      }
    }
  });
}

}  // namespace

void AttentionForward(float* out, float* att, const float* qkv, int64_t b, int64_t t, int64_t c,
                      int64_t nh) {
  KernelTimer timer(Kernel::kAttention);
#ifdef ZS_TILED_ATTENTION
  if (TiledAttention()) return AttentionForwardTiled(out, att, qkv, b, t, c, nh);
#endif
  AttentionForwardBlas(out, att, qkv, b, t, c, nh);
}

void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                       int64_t b, int64_t t, int64_t c, int64_t nh) {
  KernelTimer timer(Kernel::kAttention);
#ifdef ZS_TILED_ATTENTION
  if (TiledAttention()) return AttentionBackwardTiled(dqkv, dout, qkv, att, b, t, c, nh);
#endif
  AttentionBackwardBlas(dqkv, dout, qkv, att, b, t, c, nh);
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
