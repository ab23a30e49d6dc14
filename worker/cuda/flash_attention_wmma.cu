// The bf16 tensor-core kernels of flash_attention.h: the same tiling, online
// softmax and backward split as the CUDA-core kernels of flash_attention.cu
// (worker/model/flash_attention_reference.h with 64-key softmax steps), with
// the five products on tensor cores through nvcuda::wmma (bf16 16x16x16, f32
// accumulation). As in FlashAttention-2, the weights P and the score
// gradients dS are rounded to bf16 to enter the products (relative error
// 2^-8 each); the softmax statistics, D, and every accumulation stay f32.
//
// Threads. A block of 4 warps owns a tile of 64 rows of one head (queries in
// the forward and the dq pass, keys in the dk/dv pass); warp w owns rows
// 16w..16w+15. Products go through shared memory with wmma's documented
// row/column-major loads and stores, so nothing depends on the fragments'
// register layout: a warp's 16 x 64 score tile is stored to shared memory,
// where two lanes per row (lane / 2 is the row, lane % 2 takes the even or
// odd columns) apply the mask and the softmax, and write the bf16 operands of
// the next product. The forward keeps its output accumulator in shared memory
// (its rows are rescaled by the lanes between products); the backward keeps
// dk, dv (or dq) in accumulator fragments for the whole pass.
//
// Shared memory (dynamic, opted in: it exceeds 48 KiB): bf16 head tiles
// [64][HS' + 8] (HS' = 64 or 128, the head size padded; zero past HS and past
// T), f32 score tiles [64][68], bf16 weight tiles [64][72], and the forward's
// f32 output tile [64][HS' + 4]. Forward: 3 head tiles + score + weights +
// output = 70 KiB (HS' 64) / 110 KiB (128); dk/dv: 4 head + 2 score + 2
// weight tiles + 512 bytes of lse and D = 89 / 121 KiB; dq: 4 head + 2 score
// + 1 weight = 79 / 111 KiB. Within the 163 KiB an A100 block may opt in to
// (227 KiB on H100).
//
// Requirements checked by the caller (flash_attention.cu): bf16, HS a
// multiple of 8 up to 128, qkv and dout 16-byte aligned (tiles are staged 8
// elements at a time).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_util.cuh"
#include "worker/cuda/flash_attention_internal.cuh"

namespace zeroshard {
namespace gpu {
namespace flash_internal {
namespace {

namespace wmma = nvcuda::wmma;
using internal::FloatToBF16Bits;
using internal::LaunchStatus;

constexpr int kTile = 64;  // rows per block, rows per staged tile, keys per softmax step
constexpr int kWarps = 4;  // 16 rows each
constexpr int kThreads = 32 * kWarps;
constexpr int kLdS = kTile + 4;  // f32 score tiles [64][68]
constexpr int kLdP = kTile + 8;  // bf16 weight tiles [64][72]
constexpr size_t kScoreTile = size_t{kTile} * kLdS * sizeof(float);
constexpr size_t kWeightTile = size_t{kTile} * kLdP * sizeof(uint16_t);

using Bf16 = __nv_bfloat16;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Tiles for a padded head size kHs (64 or 128). Every tile's size is a
// multiple of 128 bytes and every fragment's first element 32-byte aligned
// (rows 16 apart, columns 16 apart), as wmma's loads and stores require.
template <int kHs>
struct Layout {
  static constexpr int kLdH = kHs + 8;  // bf16 head tiles [64][kHs + 8]
  static constexpr int kLdO = kHs + 4;  // f32 head tiles [64][kHs + 4]
  static constexpr size_t kHeadTile = size_t{kTile} * kLdH * sizeof(uint16_t);
  static constexpr size_t kOutTile = size_t{kTile} * kLdO * sizeof(float);
  static constexpr size_t kForwardBytes = 3 * kHeadTile + kScoreTile + kWeightTile + kOutTile;
  // + the lse and D rows of the query tile.
  static constexpr size_t kKeyBytes =
      4 * kHeadTile + 2 * kScoreTile + 2 * kWeightTile + 2 * kTile * sizeof(float);
  static constexpr size_t kQueryBytes = 4 * kHeadTile + 2 * kScoreTile + kWeightTile;
  // The backward's output staging reuses its two score tiles.
  static_assert(kOutTile <= 2 * kScoreTile, "output staging must fit the score tiles");
};

__device__ __forceinline__ const Bf16* AsBf16(const uint16_t* p) {
  return reinterpret_cast<const Bf16*>(p);
}

// Head h of batch row b (grid y, z): its q row 0 in qkv (k, v at +C, +2C;
// rows 3C apart), its out / dout row 0 (rows C apart), its lse / D row 0.
struct HeadBase {
  int64_t qkv, out, lse;
};
__device__ __forceinline__ HeadBase ThisHead(const Dims& d) {
  const int64_t h = blockIdx.y, b = blockIdx.z;
  return HeadBase{b * d.t * 3 * d.c + h * d.hs, b * d.t * d.c + h * d.hs, (b * d.nh + h) * d.t};
}

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
// tile [64][kLdH], 8 bf16 (16 bytes) at a time; zero past T and past HS.
// All threads call it.
template <int kHs>
__device__ __forceinline__ void Stage(uint16_t* tile, const uint16_t* src, int64_t stride,
                                      int64_t first, const Dims& d) {
  constexpr int kChunks = kHs / 8;
  for (int idx = threadIdx.x; idx < kTile * kChunks; idx += kThreads) {
    const int r = idx / kChunks, i = idx % kChunks * 8;
    const int64_t pos = first + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (pos < d.t && i < d.hs) v = *reinterpret_cast<const uint4*>(src + pos * stride + i);
    *reinterpret_cast<uint4*>(tile + r * Layout<kHs>::kLdH + i) = v;
  }
}

// out [16 x 64] (f32, ld kLdS) = A [16 x kHs] . B^T, A the 16 rows at `a`
// and B the 64 rows of `b` (bf16 head tiles): a warp's scores q k^T (or
// k q^T, v dout^T, ...).
template <int kHs>
__device__ __forceinline__ void TimesTransposed(float* out, const uint16_t* a, const uint16_t* b) {
  constexpr int kLdH = Layout<kHs>::kLdH;
  FragA fa[kHs / 16];
#pragma unroll
  for (int kb = 0; kb < kHs / 16; ++kb) wmma::load_matrix_sync(fa[kb], AsBf16(a + kb * 16), kLdH);
#pragma unroll
  for (int nb = 0; nb < kTile / 16; ++nb) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kb = 0; kb < kHs / 16; ++kb) {
      FragBCol fb;  // element (k, n) = b[(16 nb + n) kLdH + 16 kb + k]
      wmma::load_matrix_sync(fb, AsBf16(b + nb * 16 * kLdH + kb * 16), kLdH);
      wmma::mma_sync(acc, fa[kb], fb, acc);
    }
    wmma::store_matrix_sync(out + nb * 16, acc, kLdS, wmma::mem_row_major);
  }
}

// acc[nb] (columns 16 nb.. of a 16 x kHs result) += P [16 x 64] . B [64 x kHs],
// P the warp's bf16 weight rows at `p`, B a bf16 head tile.
template <int kHs>
__device__ __forceinline__ void AccumulateProduct(FragC (&acc)[kHs / 16], const uint16_t* p,
                                                  const uint16_t* b) {
  constexpr int kLdH = Layout<kHs>::kLdH;
  FragA pa[kTile / 16];
#pragma unroll
  for (int kb = 0; kb < kTile / 16; ++kb) wmma::load_matrix_sync(pa[kb], AsBf16(p + kb * 16), kLdP);
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) {
#pragma unroll
    for (int kb = 0; kb < kTile / 16; ++kb) {
      FragBRow fb;  // element (k, n) = b[(16 kb + k) kLdH + 16 nb + n]
      wmma::load_matrix_sync(fb, AsBf16(b + kb * 16 * kLdH + nb * 16), kLdH);
      wmma::mma_sync(acc[nb], pa[kb], fb, acc[nb]);
    }
  }
}

// The forward's O rows [16 x kHs] at o (f32, ld kLdO) += P . V, through
// accumulator fragments loaded from and stored back to shared memory.
template <int kHs>
__device__ __forceinline__ void AccumulateIntoShared(float* o, const uint16_t* p,
                                                     const uint16_t* v) {
  constexpr int kLdO = Layout<kHs>::kLdO;
  FragC acc[kHs / 16];
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) {
    wmma::load_matrix_sync(acc[nb], o + nb * 16, kLdO, wmma::mem_row_major);
  }
  AccumulateProduct<kHs>(acc, p, v);
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) {
    wmma::store_matrix_sync(o + nb * 16, acc[nb], kLdO, wmma::mem_row_major);
  }
}

// One 64-key online-softmax step of the lane's row (position `pos`), keys
// j0.. (past pos or past T masked): scores from srow (scaled here), the bf16
// weights e^(s - m') into prow, m and l updated in both lanes of the row
// alike (max and + commute). Returns the rescale factor alpha = e^(m - m').
__device__ __forceinline__ float SoftmaxStep(float* srow, uint16_t* prow, const Lane& ln,
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
    prow[c] = FloatToBF16Bits(p);
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  l = l * alpha + sum;
  m = next_m;
  return alpha;
}

// Writes a warp's 16 x kHs accumulators (times `factor`, rounded to bf16) to
// rows pos - ln.row + 16 w.. of dst (row stride `stride`), through the
// staging tile `ob` [64][kLdO]; rows past T are not written.
template <int kHs>
__device__ __forceinline__ void WriteRows(uint16_t* dst, int64_t stride, FragC (&acc)[kHs / 16],
                                          float* ob, const Lane& ln, int64_t pos, float factor,
                                          const Dims& d) {
  constexpr int kLdO = Layout<kHs>::kLdO;
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) {
    wmma::store_matrix_sync(ob + 16 * ln.warp * kLdO + nb * 16, acc[nb], kLdO, wmma::mem_row_major);
  }
  __syncwarp();
  if (pos < d.t) {
    for (int i = ln.half; i < d.hs; i += 2) {
      dst[pos * stride + i] = FloatToBF16Bits(factor * ob[ln.row * kLdO + i]);
    }
  }
  __syncwarp();
}

// ---------------------------------------------------------------------------
// Forward. Block: query tile (the last, longest, first), head, batch row.
template <int kHs>
__global__ void __launch_bounds__(kThreads)
    WmmaForwardKernel(uint16_t* out, float* lse, const uint16_t* qkv, Dims d) {
  using L = Layout<kHs>;
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem);
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem + L::kHeadTile);
  uint16_t* vs = reinterpret_cast<uint16_t*>(smem + 2 * L::kHeadTile);
  float* ss = reinterpret_cast<float*>(smem + 3 * L::kHeadTile);
  uint16_t* ps = reinterpret_cast<uint16_t*>(smem + 3 * L::kHeadTile + kScoreTile);
  float* os = reinterpret_cast<float*>(smem + 3 * L::kHeadTile + kScoreTile + kWeightTile);
  const Lane ln;
  const HeadBase head = ThisHead(d);
  const int64_t stride = 3 * d.c;
  const int64_t tile0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kTile;
  const int64_t pos = tile0 + ln.row;

  Stage<kHs>(qs, qkv + head.qkv, stride, tile0, d);
  for (int i = threadIdx.x; i < kTile * L::kLdO; i += kThreads) os[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int64_t rows_end = tile0 + kTile < d.t ? tile0 + kTile : d.t;
  for (int64_t j0 = 0; j0 < rows_end; j0 += kTile) {  // key tiles with a key <= the last row
    __syncthreads();                                  // the previous tiles are consumed
    Stage<kHs>(ks, qkv + head.qkv + d.c, stride, j0, d);
    Stage<kHs>(vs, qkv + head.qkv + 2 * d.c, stride, j0, d);
    __syncthreads();
    TimesTransposed<kHs>(ss + 16 * ln.warp * kLdS, qs + 16 * ln.warp * L::kLdH, ks);
    __syncwarp();
    const float alpha = SoftmaxStep(ss + ln.row * kLdS, ps + ln.row * kLdP, ln, pos, j0, d, m, l);
    for (int i = ln.half; i < kHs; i += 2) os[ln.row * L::kLdO + i] *= alpha;
    __syncwarp();
    AccumulateIntoShared<kHs>(os + 16 * ln.warp * L::kLdO, ps + 16 * ln.warp * kLdP, vs);
    __syncwarp();
  }
  if (pos >= d.t) return;
  const float inv = 1.0f / l;
  for (int i = ln.half; i < d.hs; i += 2) {
    out[head.out + pos * d.c + i] = FloatToBF16Bits(os[ln.row * L::kLdO + i] * inv);
  }
  if (ln.half == 0) lse[head.lse + pos] = m + logf(l);
}

// ---------------------------------------------------------------------------
// Backward, dk and dv. Block: key tile (tile 0, seen by every query, first),
// head, batch row. Per query tile from its own on: S^T = K Q^T and
// dP^T = V dO^T (a warp's 16 keys x 64 queries), then per element
// p = e^(scale s - lse), ds = p (dp - D), and dV += P^T dO, dK += dS^T Q.
template <int kHs>
__global__ void __launch_bounds__(kThreads)
    WmmaBackwardKeyKernel(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv,
                          const float* lse, const float* dvec, Dims d) {
  using L = Layout<kHs>;
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem);
  uint16_t* vs = reinterpret_cast<uint16_t*>(smem + L::kHeadTile);
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem + 2 * L::kHeadTile);
  uint16_t* gs = reinterpret_cast<uint16_t*>(smem + 3 * L::kHeadTile);
  float* st = reinterpret_cast<float*>(smem + 4 * L::kHeadTile);
  float* dt = st + kTile * kLdS;
  uint16_t* pt = reinterpret_cast<uint16_t*>(smem + 4 * L::kHeadTile + 2 * kScoreTile);
  uint16_t* zt = pt + kTile * kLdP;
  float* lse_s = reinterpret_cast<float*>(zt + kTile * kLdP);  // [kTile]
  float* d_s = lse_s + kTile;                                  // [kTile]
  const Lane ln;
  const HeadBase head = ThisHead(d);
  const int64_t stride = 3 * d.c;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t key = j0 + ln.row;

  Stage<kHs>(ks, qkv + head.qkv + d.c, stride, j0, d);
  Stage<kHs>(vs, qkv + head.qkv + 2 * d.c, stride, j0, d);
  FragC dk[kHs / 16], dv[kHs / 16];
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) {
    wmma::fill_fragment(dk[nb], 0.0f);
    wmma::fill_fragment(dv[nb], 0.0f);
  }
  for (int64_t i0 = j0; i0 < d.t; i0 += kTile) {  // query tiles holding a row >= j0
    __syncthreads();
    Stage<kHs>(qs, qkv + head.qkv, stride, i0, d);
    Stage<kHs>(gs, dout + head.out, d.c, i0, d);
    for (int r = threadIdx.x; r < kTile; r += kThreads) {
      const bool in = i0 + r < d.t;
      lse_s[r] = in ? lse[head.lse + i0 + r] : 0.0f;
      d_s[r] = in ? dvec[head.lse + i0 + r] : 0.0f;
    }
    __syncthreads();
    TimesTransposed<kHs>(st + 16 * ln.warp * kLdS, ks + 16 * ln.warp * L::kLdH, qs);
    TimesTransposed<kHs>(dt + 16 * ln.warp * kLdS, vs + 16 * ln.warp * L::kLdH, gs);
    __syncwarp();
#pragma unroll 8
    for (int jj = 0; jj < kTile / 2; ++jj) {
      const int c = 2 * jj + ln.half;
      const int64_t q = i0 + c;
      const bool visible = q >= key && q < d.t;  // false for keys past T too
      const float p = visible ? expf(d.scale * st[ln.row * kLdS + c] - lse_s[c]) : 0.0f;
      pt[ln.row * kLdP + c] = FloatToBF16Bits(p);
      zt[ln.row * kLdP + c] = FloatToBF16Bits(p * (dt[ln.row * kLdS + c] - d_s[c]));
    }
    __syncwarp();
    AccumulateProduct<kHs>(dv, pt + 16 * ln.warp * kLdP, gs);
    AccumulateProduct<kHs>(dk, zt + 16 * ln.warp * kLdP, qs);
  }
  __syncthreads();  // the staging below reuses every warp's score rows
  WriteRows<kHs>(dqkv + head.qkv + d.c, stride, dk, st, ln, key, d.scale, d);
  WriteRows<kHs>(dqkv + head.qkv + 2 * d.c, stride, dv, st, ln, key, 1.0f, d);
}

// Backward, dq. Block: query tile (the last, longest, first), head, batch
// row. Per key tile up to its last row: S = Q K^T, dP = dO V^T, then
// ds = e^(scale s - lse) (dp - D) and dQ += dS K.
template <int kHs>
__global__ void __launch_bounds__(kThreads)
    WmmaBackwardQueryKernel(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv,
                            const float* lse, const float* dvec, Dims d) {
  using L = Layout<kHs>;
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem);
  uint16_t* gs = reinterpret_cast<uint16_t*>(smem + L::kHeadTile);
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem + 2 * L::kHeadTile);
  uint16_t* vs = reinterpret_cast<uint16_t*>(smem + 3 * L::kHeadTile);
  float* ss = reinterpret_cast<float*>(smem + 4 * L::kHeadTile);
  float* dps = ss + kTile * kLdS;
  uint16_t* zs = reinterpret_cast<uint16_t*>(smem + 4 * L::kHeadTile + 2 * kScoreTile);
  const Lane ln;
  const HeadBase head = ThisHead(d);
  const int64_t stride = 3 * d.c;
  const int64_t tile0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kTile;
  const int64_t pos = tile0 + ln.row;
  const bool live = pos < d.t;

  Stage<kHs>(qs, qkv + head.qkv, stride, tile0, d);
  Stage<kHs>(gs, dout + head.out, d.c, tile0, d);
  const float row_lse = live ? lse[head.lse + pos] : 0.0f;
  const float row_d = live ? dvec[head.lse + pos] : 0.0f;
  FragC dq[kHs / 16];
#pragma unroll
  for (int nb = 0; nb < kHs / 16; ++nb) wmma::fill_fragment(dq[nb], 0.0f);
  const int64_t rows_end = tile0 + kTile < d.t ? tile0 + kTile : d.t;
  for (int64_t j0 = 0; j0 < rows_end; j0 += kTile) {
    __syncthreads();
    Stage<kHs>(ks, qkv + head.qkv + d.c, stride, j0, d);
    Stage<kHs>(vs, qkv + head.qkv + 2 * d.c, stride, j0, d);
    __syncthreads();
    TimesTransposed<kHs>(ss + 16 * ln.warp * kLdS, qs + 16 * ln.warp * L::kLdH, ks);
    TimesTransposed<kHs>(dps + 16 * ln.warp * kLdS, gs + 16 * ln.warp * L::kLdH, vs);
    __syncwarp();
#pragma unroll 8
    for (int jj = 0; jj < kTile / 2; ++jj) {
      const int c = 2 * jj + ln.half;
      const bool visible = live && j0 + c <= pos;
      const float p = visible ? expf(d.scale * ss[ln.row * kLdS + c] - row_lse) : 0.0f;
      zs[ln.row * kLdP + c] = FloatToBF16Bits(p * (dps[ln.row * kLdS + c] - row_d));
    }
    __syncwarp();
    AccumulateProduct<kHs>(dq, zs + 16 * ln.warp * kLdP, ks);
  }
  __syncthreads();  // the staging below reuses every warp's score rows
  WriteRows<kHs>(dqkv + head.qkv, stride, dq, ss, ln, pos, d.scale, d);
}

// Without nvcc (tests/worker/cuda/emulation runs the kernels above on the
// CPU), nothing below: it launches them.
#ifndef ZEROSHARD_FLASH_ATTENTION_EMULATED

// ---------------------------------------------------------------------------
// Host side.

template <typename Kernel>
absl::Status AllowBytes(Kernel kernel, size_t bytes, const char* what) {
  return CudaErrorToStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(bytes)),
                           absl::StrCat(what, ": allowing ", bytes, " bytes of shared memory"));
}

dim3 TileGrid(int64_t b, const Dims& d) {
  return dim3(static_cast<unsigned int>((d.t + kTile - 1) / kTile), static_cast<unsigned int>(d.nh),
              static_cast<unsigned int>(b));
}

template <int kHs>
absl::Status Forward(uint16_t* out, float* lse, const uint16_t* qkv, int64_t b, const Dims& d,
                     cudaStream_t stream) {
  static constexpr char kWhat[] = "FlashAttentionForward (tensor cores)";
  constexpr size_t kBytes = Layout<kHs>::kForwardBytes;
  auto* kernel = WmmaForwardKernel<kHs>;
  if (absl::Status s = AllowBytes(kernel, kBytes, kWhat); !s.ok()) return s;
  kernel<<<TileGrid(b, d), kThreads, kBytes, stream>>>(out, lse, qkv, d);
  return LaunchStatus(kWhat);
}

template <int kHs>
absl::Status Backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const float* lse,
                      const float* dvec, int64_t b, const Dims& d, cudaStream_t stream) {
  static constexpr char kWhat[] = "FlashAttentionBackward (tensor cores)";
  auto* keys = WmmaBackwardKeyKernel<kHs>;
  if (absl::Status s = AllowBytes(keys, Layout<kHs>::kKeyBytes, kWhat); !s.ok()) return s;
  keys<<<TileGrid(b, d), kThreads, Layout<kHs>::kKeyBytes, stream>>>(dqkv, dout, qkv, lse, dvec, d);
  if (absl::Status s = LaunchStatus(kWhat); !s.ok()) return s;
  auto* queries = WmmaBackwardQueryKernel<kHs>;
  if (absl::Status s = AllowBytes(queries, Layout<kHs>::kQueryBytes, kWhat); !s.ok()) return s;
  queries<<<TileGrid(b, d), kThreads, Layout<kHs>::kQueryBytes, stream>>>(dqkv, dout, qkv, lse,
                                                                          dvec, d);
  return LaunchStatus(kWhat);
}

#endif  // ZEROSHARD_FLASH_ATTENTION_EMULATED

}  // namespace

#ifndef ZEROSHARD_FLASH_ATTENTION_EMULATED

absl::Status WmmaForward(uint16_t* out, float* lse, const uint16_t* qkv, int64_t b, const Dims& d,
                         cudaStream_t stream) {
  if (d.hs <= 64) return Forward<64>(out, lse, qkv, b, d, stream);
  return Forward<128>(out, lse, qkv, b, d, stream);
}

absl::Status WmmaBackward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv,
                          const float* lse, const float* dvec, int64_t b, const Dims& d,
                          cudaStream_t stream) {
  if (d.hs <= 64) return Backward<64>(dqkv, dout, qkv, lse, dvec, b, d, stream);
  return Backward<128>(dqkv, dout, qkv, lse, dvec, b, d, stream);
}

#endif  // ZEROSHARD_FLASH_ATTENTION_EMULATED

}  // namespace flash_internal
}  // namespace gpu
}  // namespace zeroshard
