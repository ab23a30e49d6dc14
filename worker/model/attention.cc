// Causal multi-head self-attention, forward and backward: register-tiled
// kernels on CPUs with AVX2 + FMA, OpenBLAS otherwise. Part of
// //worker/model:layers (its copts apply); declared in layers.h.
#include <cmath>
#include <cstring>
#include <vector>

#include "worker/model/fast_math.h"
#include "worker/model/kernel_profile.h"
#include "worker/model/layers.h"
#include "worker/model/layers_internal.h"
#include "worker/model/parallel.h"

namespace zeroshard {

using layers_internal::Gemm;
using layers_internal::Scale;

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

}  // namespace zeroshard
