// The bf16 tensor-core kernels of flash_attention.h: the same tiling, online
// softmax and backward split as the CUDA-core kernels of flash_attention.cu
// (worker/model/flash_attention_reference.h with 64-key softmax steps), with
// the five products as wmma bf16 16x16x16 products, f32 accumulation. As in
// FlashAttention-2, the weights P and the score gradients dS are rounded to
// bf16 to enter the products (relative error 2^-8 each). The softmax
// statistics, D, and every accumulation stay f32. (f32 storage runs on
// tensor cores through mma.sync instead: flash_attention_mma.cu.) The
// templates take the storage type S, uint16_t (bf16 bits) only.
//
// Threads. A block of 4 warps owns a tile of 64 rows of one head (queries in
// the forward and the dq pass, keys in the dk/dv pass); warp w owns rows
// 16w..16w+15. Products go through shared memory with wmma's documented
// row/column-major loads and stores, so nothing depends on the fragments'
// register layout: a warp's 16 x 64 score tile is stored to shared memory,
// where two lanes per row (lane / 2 is the row, lane % 2 takes the even or
// odd columns) apply the mask and the softmax, and write the weight operands
// of the next product. The forward keeps its output accumulator in shared
// memory (its rows are rescaled by the lanes between products); the backward
// keeps dk, dv (or dq) in accumulator fragments for the whole pass.
//
// Shared memory (dynamic, opted in: it exceeds 48 KiB). HS' = the head size
// padded to 64 or 128 (zero past HS and past T); f32 score tiles [64][68];
// head tiles [64][HS' + 8] bf16 (9 / 17 KiB), bf16 weight tiles [64][72]
// (9 KiB), the forward's f32 output tile [64][HS' + 4] (17 / 33 KiB).
// Forward: 3 head tiles + score + weights + output = 70 KiB (HS' 64) /
// 110 KiB (128); dk/dv: 4 head + 2 score + 2 weight tiles + 512 bytes of lse
// and D = 89 / 121 KiB; dq: 4 head + 2 score + 1 weight = 79 / 111 KiB. All
// within the 163 KiB an A100 block may opt in to (Layout asserts it).
//
// Requirements checked by the caller (flash_attention.cu): qkv and dout
// 16-byte aligned (tiles are staged 16 bytes at a time), so a head size that
// is a multiple of 8; up to 128.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_util.cuh"
#include "worker/cuda/flash_attention_internal.cuh"
#include "worker/cuda/flash_attention_variants.h"

namespace zeroshard {
namespace gpu {
namespace flash_internal {
namespace {

namespace wmma = nvcuda::wmma;
using internal::FloatToBF16Bits;
using internal::LaunchStatus;

constexpr int kTile = kFlashTile;  // rows per block, rows per staged tile, keys per softmax step
constexpr int kWarps = 4;          // 16 rows each
constexpr int kThreads = 32 * kWarps;
constexpr int kLdS = kTile + 4;  // f32 score tiles [64][68]
constexpr size_t kScoreTile = size_t{kTile} * kLdS * sizeof(float);

using Bf16 = __nv_bfloat16;

__device__ __forceinline__ const Bf16* AsBf16(const uint16_t* p) {
  return reinterpret_cast<const Bf16*>(p);
}

// The products for storage S (bf16 as raw bits): the head tiles'
// element (S itself), the weight operands' (W), and how an operand fragment
// is loaded and multiplied into an f32 accumulator fragment (Acc).
template <typename S>
struct Mma;

// bf16: one 16x16x16 product per step; weights rounded to bf16.
template <>
struct Mma<uint16_t> {
  using W = uint16_t;
  static constexpr int kK = 16;           // the products' depth
  static constexpr int kHeadPad = 8;      // head tiles [64][HS' + 8]
  static constexpr int kLdP = kTile + 8;  // weight tiles [64][72] bf16
  static constexpr size_t kWeightTile = size_t{kTile} * kLdP * sizeof(uint16_t);
  using A = wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::row_major>;
  using BRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::row_major>;
  using BCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::col_major>;
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  template <typename F>
  __device__ __forceinline__ static void Load(F& f, const uint16_t* p, unsigned ld) {
    wmma::load_matrix_sync(f, AsBf16(p), ld);
  }
  template <typename B>
  __device__ __forceinline__ static void Multiply(Acc& acc, const A& a, const B& b) {
    wmma::mma_sync(acc, a, b, acc);
  }
  __device__ __forceinline__ static void PutWeight(uint16_t* p, float v) {
    *p = FloatToBF16Bits(v);
  }
};

// Tiles for storage S and a padded head size kHs (64 or 128). Every tile's
// size is a multiple of 128 bytes and every fragment's first element 32-byte
// aligned (rows 8 or 16 apart, columns 8 or 16 apart, row strides multiples
// of 16 bytes), as wmma's loads and stores require.
template <typename S, int kHs>
struct Layout {
  static constexpr int kLdH = kHs + Mma<S>::kHeadPad;  // head tiles [64][kLdH] of S
  static constexpr int kLdO = kHs + 4;                 // f32 head tiles [64][kHs + 4]
  static constexpr size_t kHeadTile = size_t{kTile} * kLdH * sizeof(S);
  static constexpr size_t kOutTile = size_t{kTile} * kLdO * sizeof(float);
  static constexpr size_t kWeightTile = Mma<S>::kWeightTile;
  static constexpr size_t kForwardBytes = 3 * kHeadTile + kScoreTile + kWeightTile + kOutTile;
  // + the lse and D rows of the query tile.
  static constexpr size_t kKeyBytes =
      4 * kHeadTile + 2 * kScoreTile + 2 * kWeightTile + 2 * kTile * sizeof(float);
  static constexpr size_t kQueryBytes = 4 * kHeadTile + 2 * kScoreTile + kWeightTile;
  // The backward's output staging reuses its two score tiles.
  static_assert(kOutTile <= 2 * kScoreTile, "output staging must fit the score tiles");
  // What an A100 block may opt in to.
  static_assert(kForwardBytes <= 163 * 1024 && kKeyBytes <= 163 * 1024 && kQueryBytes <= 163 * 1024,
                "over an A100's shared memory per block");
};

// The weight tile `which` (0 or 1) after `scores` (the first score tile) and
// the `scores_count` score tiles.
template <typename S>
__device__ __forceinline__ typename Mma<S>::W* WeightTile(float* scores, int scores_count,
                                                          int which) {
  using W = typename Mma<S>::W;
  return reinterpret_cast<W*>(reinterpret_cast<unsigned char*>(scores) + scores_count * kScoreTile +
                              which * Mma<S>::kWeightTile);
}

// Storage: bf16 as raw bits (rounded to nearest even).
__device__ __forceinline__ void Store(uint16_t* p, float v) { *p = FloatToBF16Bits(v); }

// This lane's place: warp w, row 16w + lane / 2 of the block's tile, and the
// columns half, half + 2, ... of that row in the softmax steps.
struct Lane {
  int warp, row, half;
  __device__ Lane()
      : warp(threadIdx.x / 32),
        row(16 * (threadIdx.x / 32) + threadIdx.x % 32 / 2),
        half(threadIdx.x % 2) {}
};

// Stages rows first..first+63 of one head (row r at src + r * stride) into
// tile [64][kLdH], 16 bytes (8 bf16) at a time; zero past T and past
// HS. All threads call it.
template <typename S, int kHs>
__device__ __forceinline__ void Stage(S* tile, const S* src, int64_t stride, int64_t first,
                                      const Dims& d) {
  constexpr int kPer = 16 / sizeof(S);
  constexpr int kChunks = kHs / kPer;
  for (int idx = threadIdx.x; idx < kTile * kChunks; idx += kThreads) {
    const int r = idx / kChunks, i = idx % kChunks * kPer;
    const int64_t pos = first + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (pos < d.t && i < d.hs) v = *reinterpret_cast<const uint4*>(src + pos * stride + i);
    *reinterpret_cast<uint4*>(tile + r * Layout<S, kHs>::kLdH + i) = v;
  }
}

// out [16 x 64] (f32, ld kLdS) = A [16 x kHs] . B^T, A the 16 rows at `a`
// and B the 64 rows of `b` (head tiles): a warp's scores q k^T (or k q^T,
// v dout^T, ...).
template <typename S, int kHs>
__device__ __forceinline__ void TimesTransposed(float* out, const S* a, const S* b) {
  using M = Mma<S>;
  constexpr int kLdH = Layout<S, kHs>::kLdH;
  constexpr int kK = M::kK;
  typename M::A fa[kHs / kK];
#pragma unroll
  for (int kb = 0; kb < kHs / kK; ++kb) M::Load(fa[kb], a + kb * kK, kLdH);
#pragma unroll
  for (int nb = 0; nb < kTile / 16; ++nb) {
    typename M::Acc acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kb = 0; kb < kHs / kK; ++kb) {
      typename M::BCol fb;  // element (k, n) = b[(16 nb + n) kLdH + kK kb + k]
      M::Load(fb, b + nb * 16 * kLdH + kb * kK, kLdH);
      M::Multiply(acc, fa[kb], fb);
    }
    wmma::store_matrix_sync(out + nb * 16, acc, kLdS, wmma::mem_row_major);
  }
}

// acc[nb] (columns 16 nb.. of a 16 x kHs result) += P [16 x 64] . B [64 x kHs],
// P the warp's weight rows at `p` (ld Mma<S>::kLdP), B a head tile.
template <typename S, int kHs>
__device__ __forceinline__ void AccumulateProduct(typename Mma<S>::Acc (&acc)[kHs / 16],
                                                  const typename Mma<S>::W* p, const S* b) {
  using M = Mma<S>;
  constexpr int kLdH = Layout<S, kHs>::kLdH;
  constexpr int kK = M::kK;
  typename M::A pa[kTile / kK];
#pragma unroll
  for (int kb = 0; kb < kTile / kK; ++kb) M::Load(pa[kb], p + kb * kK, M::kLdP);
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) {
#pragma unroll
    for (int kb = 0; kb < kTile / kK; ++kb) {
      typename M::BRow fb;  // element (k, n) = b[(kK kb + k) kLdH + 16 nb + n]
      M::Load(fb, b + kb * kK * kLdH + nb * 16, kLdH);
      M::Multiply(acc[nb], pa[kb], fb);
    }
  }
}

// The forward's O rows [16 x kHs] at o (f32, ld kLdO) += P . V, through
// accumulator fragments loaded from and stored back to shared memory.
template <typename S, int kHs>
__device__ __forceinline__ void AccumulateIntoShared(float* o, const typename Mma<S>::W* p,
                                                     const S* v) {
  constexpr int kLdO = Layout<S, kHs>::kLdO;
  typename Mma<S>::Acc acc[kHs / 16];
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) {
    wmma::load_matrix_sync(acc[nb], o + nb * 16, kLdO, wmma::mem_row_major);
  }
  AccumulateProduct<S, kHs>(acc, p, v);
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) {
    wmma::store_matrix_sync(o + nb * 16, acc[nb], kLdO, wmma::mem_row_major);
  }
}

// One 64-key online-softmax step of the lane's row (position `pos`), keys
// j0.. (past pos or past T masked): scores from srow (scaled here), the
// weights e^(s - m') into prow (which may be srow: each element is read
// before it is written, by the same lane), m and l updated in both lanes of
// the row alike (max and + commute). Returns the rescale factor
// alpha = e^(m - m').
template <typename S>
__device__ __forceinline__ float SoftmaxStep(float* srow, typename Mma<S>::W* prow, const Lane& ln,
                                             int64_t pos, int64_t j0, const Dims& d, float& m,
                                             float& l) {
  float mx = -INFINITY;
#pragma unroll 8
  for (int jj = 0; jj < kTile / 2; ++jj) {
    const int c = 2 * jj + ln.half;
    const int64_t key = j0 + c;
    const float s = key <= pos && key < d.t ? d.scale * srow[c] : -INFINITY;
    srow[c] = s;
    mx = fmaxf(mx, s);
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  const float next_m = fmaxf(m, mx);
  const bool any = next_m != -INFINITY;  // false only in rows past T
  const float alpha = any ? expf(m - next_m) : 1.0f;
  float sum = 0.0f;
#pragma unroll 8
  for (int jj = 0; jj < kTile / 2; ++jj) {
    const int c = 2 * jj + ln.half;
    const float p = any ? expf(srow[c] - next_m) : 0.0f;
    sum += p;
    Mma<S>::PutWeight(prow + c, p);
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  l = l * alpha + sum;
  m = next_m;
  return alpha;
}

// Writes a warp's 16 x kHs accumulators (times `factor`, rounded to S) to
// rows pos - ln.row + 16 w.. of dst (row stride `stride`), through the
// staging tile `ob` [64][kLdO]; rows past T are not written.
template <typename S, int kHs>
__device__ __forceinline__ void WriteRows(S* dst, int64_t stride,
                                          typename Mma<S>::Acc (&acc)[kHs / 16], float* ob,
                                          const Lane& ln, int64_t pos, float factor,
                                          const Dims& d) {
  constexpr int kLdO = Layout<S, kHs>::kLdO;
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) {
    wmma::store_matrix_sync(ob + 16 * ln.warp * kLdO + nb * 16, acc[nb], kLdO, wmma::mem_row_major);
  }
  __syncwarp();
  if (pos < d.t) {
    for (int i = ln.half; i < d.hs; i += 2) {
      Store(dst + pos * stride + i, factor * ob[ln.row * kLdO + i]);
    }
  }
  __syncwarp();
}

// ---------------------------------------------------------------------------
// Forward. Block: query tile (the last, longest, first), head, batch row.
template <typename S, int kHs>
__global__ void __launch_bounds__(kThreads)
    WmmaForwardKernel(S* out, float* lse, const S* qkv, Dims d) {
  using L = Layout<S, kHs>;
  using W = typename Mma<S>::W;
  constexpr int kLdP = Mma<S>::kLdP;
  extern __shared__ __align__(128) unsigned char smem[];
  S* qs = reinterpret_cast<S*>(smem);
  S* ks = reinterpret_cast<S*>(smem + L::kHeadTile);
  S* vs = reinterpret_cast<S*>(smem + 2 * L::kHeadTile);
  float* ss = reinterpret_cast<float*>(smem + 3 * L::kHeadTile);
  W* ps = WeightTile<S>(ss, 1, 0);
  float* os = reinterpret_cast<float*>(smem + 3 * L::kHeadTile + kScoreTile + L::kWeightTile);
  const Lane ln;
  const HeadBase head = ThisHead(d);
  const int64_t stride = 3 * d.c;
  const int64_t tile0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kTile;
  const int64_t pos = tile0 + ln.row;

  Stage<S, kHs>(qs, qkv + head.qkv, stride, tile0, d);
  for (int i = threadIdx.x; i < kTile * L::kLdO; i += kThreads) os[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int64_t rows_end = tile0 + kTile < d.t ? tile0 + kTile : d.t;
  for (int64_t j0 = 0; j0 < rows_end; j0 += kTile) {  // key tiles with a key <= the last row
    __syncthreads();                                  // the previous tiles are consumed
    Stage<S, kHs>(ks, qkv + head.qkv + d.c, stride, j0, d);
    Stage<S, kHs>(vs, qkv + head.qkv + 2 * d.c, stride, j0, d);
    __syncthreads();
    TimesTransposed<S, kHs>(ss + 16 * ln.warp * kLdS, qs + 16 * ln.warp * L::kLdH, ks);
    __syncwarp();
    const float alpha =
        SoftmaxStep<S>(ss + ln.row * kLdS, ps + ln.row * kLdP, ln, pos, j0, d, m, l);
    for (int i = ln.half; i < kHs; i += 2) os[ln.row * L::kLdO + i] *= alpha;
    __syncwarp();
    AccumulateIntoShared<S, kHs>(os + 16 * ln.warp * L::kLdO, ps + 16 * ln.warp * kLdP, vs);
    __syncwarp();
  }
  if (pos >= d.t) return;
  const float inv = 1.0f / l;
  for (int i = ln.half; i < d.hs; i += 2) {
    Store(out + head.out + pos * d.c + i, os[ln.row * L::kLdO + i] * inv);
  }
  if (ln.half == 0) lse[head.lse + pos] = m + logf(l);
}

// ---------------------------------------------------------------------------
// Backward, dk and dv. Block: key tile (tile 0, seen by every query, first),
// head, batch row. Per query tile from its own on: S^T = K Q^T and
// dP^T = V dO^T (a warp's 16 keys x 64 queries), then per element
// p = e^(scale s - lse), ds = p (dp - D), and dV += P^T dO, dK += dS^T Q.
template <typename S, int kHs>
__global__ void __launch_bounds__(kThreads)
    WmmaBackwardKeyKernel(S* dqkv, const S* dout, const S* qkv, const float* lse, const float* dvec,
                          Dims d) {
  using L = Layout<S, kHs>;
  using M = Mma<S>;
  using W = typename M::W;
  constexpr int kLdP = M::kLdP;
  extern __shared__ __align__(128) unsigned char smem[];
  S* ks = reinterpret_cast<S*>(smem);
  S* vs = reinterpret_cast<S*>(smem + L::kHeadTile);
  S* qs = reinterpret_cast<S*>(smem + 2 * L::kHeadTile);
  S* gs = reinterpret_cast<S*>(smem + 3 * L::kHeadTile);
  float* st = reinterpret_cast<float*>(smem + 4 * L::kHeadTile);
  float* dt = st + kTile * kLdS;
  W* pt = WeightTile<S>(st, 2, 0);
  W* zt = WeightTile<S>(st, 2, 1);
  float* lse_s = reinterpret_cast<float*>(smem + 4 * L::kHeadTile + 2 * kScoreTile +
                                          2 * L::kWeightTile);  // [kTile]
  float* d_s = lse_s + kTile;                                   // [kTile]
  const Lane ln;
  const HeadBase head = ThisHead(d);
  const int64_t stride = 3 * d.c;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t key = j0 + ln.row;

  Stage<S, kHs>(ks, qkv + head.qkv + d.c, stride, j0, d);
  Stage<S, kHs>(vs, qkv + head.qkv + 2 * d.c, stride, j0, d);
  typename M::Acc dk[kHs / 16], dv[kHs / 16];
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) {
    wmma::fill_fragment(dk[nb], 0.0f);
    wmma::fill_fragment(dv[nb], 0.0f);
  }
  for (int64_t i0 = j0; i0 < d.t; i0 += kTile) {  // query tiles holding a row >= j0
    __syncthreads();
    Stage<S, kHs>(qs, qkv + head.qkv, stride, i0, d);
    Stage<S, kHs>(gs, dout + head.out, d.c, i0, d);
    for (int r = threadIdx.x; r < kTile; r += kThreads) {
      const bool in = i0 + r < d.t;
      lse_s[r] = in ? lse[head.lse + i0 + r] : 0.0f;
      d_s[r] = in ? dvec[head.lse + i0 + r] : 0.0f;
    }
    __syncthreads();
    TimesTransposed<S, kHs>(st + 16 * ln.warp * kLdS, ks + 16 * ln.warp * L::kLdH, qs);
    TimesTransposed<S, kHs>(dt + 16 * ln.warp * kLdS, vs + 16 * ln.warp * L::kLdH, gs);
    __syncwarp();
#pragma unroll 8
    for (int jj = 0; jj < kTile / 2; ++jj) {
      const int c = 2 * jj + ln.half;
      const int64_t q = i0 + c;
      const bool visible = q >= key && q < d.t;  // false for keys past T too
      const float p = visible ? expf(d.scale * st[ln.row * kLdS + c] - lse_s[c]) : 0.0f;
      const float ds = p * (dt[ln.row * kLdS + c] - d_s[c]);
      M::PutWeight(pt + ln.row * kLdP + c, p);
      M::PutWeight(zt + ln.row * kLdP + c, ds);
    }
    __syncwarp();
    AccumulateProduct<S, kHs>(dv, pt + 16 * ln.warp * kLdP, gs);
    AccumulateProduct<S, kHs>(dk, zt + 16 * ln.warp * kLdP, qs);
  }
  __syncthreads();  // the staging below reuses every warp's score rows
  WriteRows<S, kHs>(dqkv + head.qkv + d.c, stride, dk, st, ln, key, d.scale, d);
  WriteRows<S, kHs>(dqkv + head.qkv + 2 * d.c, stride, dv, st, ln, key, 1.0f, d);
}

// Backward, dq. Block: query tile (the last, longest, first), head, batch
// row. Per key tile up to its last row: S = Q K^T, dP = dO V^T, then
// ds = e^(scale s - lse) (dp - D) and dQ += dS K.
template <typename S, int kHs>
__global__ void __launch_bounds__(kThreads)
    WmmaBackwardQueryKernel(S* dqkv, const S* dout, const S* qkv, const float* lse,
                            const float* dvec, Dims d) {
  using L = Layout<S, kHs>;
  using M = Mma<S>;
  using W = typename M::W;
  constexpr int kLdP = M::kLdP;
  extern __shared__ __align__(128) unsigned char smem[];
  S* qs = reinterpret_cast<S*>(smem);
  S* gs = reinterpret_cast<S*>(smem + L::kHeadTile);
  S* ks = reinterpret_cast<S*>(smem + 2 * L::kHeadTile);
  S* vs = reinterpret_cast<S*>(smem + 3 * L::kHeadTile);
  float* ss = reinterpret_cast<float*>(smem + 4 * L::kHeadTile);
  float* dps = ss + kTile * kLdS;
  W* zs = WeightTile<S>(ss, 2, 0);
  const Lane ln;
  const HeadBase head = ThisHead(d);
  const int64_t stride = 3 * d.c;
  const int64_t tile0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kTile;
  const int64_t pos = tile0 + ln.row;
  const bool live = pos < d.t;

  Stage<S, kHs>(qs, qkv + head.qkv, stride, tile0, d);
  Stage<S, kHs>(gs, dout + head.out, d.c, tile0, d);
  const float row_lse = live ? lse[head.lse + pos] : 0.0f;
  const float row_d = live ? dvec[head.lse + pos] : 0.0f;
  typename M::Acc dq[kHs / 16];
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) wmma::fill_fragment(dq[nb], 0.0f);
  const int64_t rows_end = tile0 + kTile < d.t ? tile0 + kTile : d.t;
  for (int64_t j0 = 0; j0 < rows_end; j0 += kTile) {
    __syncthreads();
    Stage<S, kHs>(ks, qkv + head.qkv + d.c, stride, j0, d);
    Stage<S, kHs>(vs, qkv + head.qkv + 2 * d.c, stride, j0, d);
    __syncthreads();
    TimesTransposed<S, kHs>(ss + 16 * ln.warp * kLdS, qs + 16 * ln.warp * L::kLdH, ks);
    TimesTransposed<S, kHs>(dps + 16 * ln.warp * kLdS, gs + 16 * ln.warp * L::kLdH, vs);
    __syncwarp();
#pragma unroll 8
    for (int jj = 0; jj < kTile / 2; ++jj) {
      const int c = 2 * jj + ln.half;
      const bool visible = live && j0 + c <= pos;
      const float p = visible ? expf(d.scale * ss[ln.row * kLdS + c] - row_lse) : 0.0f;
      M::PutWeight(zs + ln.row * kLdP + c, p * (dps[ln.row * kLdS + c] - row_d));
    }
    __syncwarp();
    AccumulateProduct<S, kHs>(dq, zs + 16 * ln.warp * kLdP, ks);
  }
  __syncthreads();  // the staging below reuses every warp's score rows
  WriteRows<S, kHs>(dqkv + head.qkv, stride, dq, ss, ln, pos, d.scale, d);
}

// Without nvcc (tests/worker/cuda/emulation runs the kernels above on the
// CPU), nothing below: it launches them.
#ifndef ZEROSHARD_FLASH_ATTENTION_EMULATED

// ---------------------------------------------------------------------------
// Host side.

template <typename S, int kHs>
absl::Status Forward(S* out, float* lse, const S* qkv, int64_t b, const Dims& d,
                     cudaStream_t stream) {
  static constexpr char kWhat[] = "FlashAttentionForward (tensor cores)";
  constexpr size_t kBytes = Layout<S, kHs>::kForwardBytes;
  auto* kernel = WmmaForwardKernel<S, kHs>;
  if (absl::Status s = AllowSharedMemory(kernel, kBytes, kWhat); !s.ok()) return s;
  kernel<<<TileGrid(b, d), kThreads, kBytes, stream>>>(out, lse, qkv, d);
  return LaunchStatus(kWhat);
}

template <typename S, int kHs>
absl::Status Backward(S* dqkv, const S* dout, const S* qkv, const float* lse, const float* dvec,
                      int64_t b, const Dims& d, cudaStream_t stream) {
  static constexpr char kWhat[] = "FlashAttentionBackward (tensor cores)";
  using L = Layout<S, kHs>;
  auto* keys = WmmaBackwardKeyKernel<S, kHs>;
  if (absl::Status s = AllowSharedMemory(keys, L::kKeyBytes, kWhat); !s.ok()) return s;
  keys<<<TileGrid(b, d), kThreads, L::kKeyBytes, stream>>>(dqkv, dout, qkv, lse, dvec, d);
  if (absl::Status s = LaunchStatus(kWhat); !s.ok()) return s;
  auto* queries = WmmaBackwardQueryKernel<S, kHs>;
  if (absl::Status s = AllowSharedMemory(queries, L::kQueryBytes, kWhat); !s.ok()) return s;
  queries<<<TileGrid(b, d), kThreads, L::kQueryBytes, stream>>>(dqkv, dout, qkv, lse, dvec, d);
  return LaunchStatus(kWhat);
}

#endif  // ZEROSHARD_FLASH_ATTENTION_EMULATED

}  // namespace

#ifndef ZEROSHARD_FLASH_ATTENTION_EMULATED

absl::Status WmmaForward(uint16_t* out, float* lse, const uint16_t* qkv, int64_t b, const Dims& d,
                         cudaStream_t stream) {
  if (d.hs <= 64) return Forward<uint16_t, 64>(out, lse, qkv, b, d, stream);
  return Forward<uint16_t, 128>(out, lse, qkv, b, d, stream);
}

absl::Status WmmaBackward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv,
                          const float* lse, const float* dvec, int64_t b, const Dims& d,
                          cudaStream_t stream) {
  if (d.hs <= 64) return Backward<uint16_t, 64>(dqkv, dout, qkv, lse, dvec, b, d, stream);
  return Backward<uint16_t, 128>(dqkv, dout, qkv, lse, dvec, b, d, stream);
}

#endif  // ZEROSHARD_FLASH_ATTENTION_EMULATED

}  // namespace flash_internal
}  // namespace gpu
}  // namespace zeroshard
