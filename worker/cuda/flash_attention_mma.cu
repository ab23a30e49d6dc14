// The f32 tensor-core kernels of flash_attention.h (FlashKernels::
// kTensorCores with f32 storage): FlashAttention-2's tiling, online softmax
// (64-key steps) and backward split, as worker/model/flash_attention_reference.h
// runs them, with the five products as "3xTF32" mma.sync products
// (mma_tf32.cuh: every f32 operand split into two tf32 parts, each product
// taken as three tf32 products into an f32 accumulator; cutlass's
// OpMultiplyAddFastF32, and PyTorch's f32 memory-efficient attention), so
// results keep f32's accuracy: each product is off by under (3 + 2^-9)
// 2^-22 of |a b| (mma_tf32.cuh), and the three products go into the same
// f32 accumulator, so a sum of n products is a sum of 3n f32 terms
// (tests/testing/flash_attention_error_model.h: WithThreeTf32Products).
//
// Threads. A block of 4 warps owns a tile of 64 rows of one head (queries
// in the forward and the dq pass, keys in the dk/dv pass); warp w owns rows
// 16w..16w+15. Unlike the wmma kernels (bf16, flash_attention_wmma.cu),
// nothing a warp computes goes through shared memory: the scores, the
// weights, the score gradients and the accumulators (o, or dk and dv, or
// dq) stay in mma fragments, in registers, for a whole pass. A warp's
// 16 x 64 score tile is eight 16 x 8 accumulator fragments; the lane holding
// row r's columns 2t and 2t + 1 of each applies the mask and the softmax to
// them, the row's maximum and sum taken over the four lanes of the row
// (t = 0..3) by shuffles. The weights then enter the next product as its A
// operand straight from those registers: mma's A fragment wants, for a
// depth step of 8 keys, row g's keys t and t + 4 where the accumulator holds
// keys 2t and 2t + 1, so the product's depth runs over the keys in the order
// 0, 2, 4, 6, 1, 3, 5, 7 and the B operand (V, dO, Q or K rows) is read in
// that order too: a permutation of a sum's terms, the same product.
//
// Shared memory (dynamic, opted in: over 48 KiB): head tiles [64][68] f32,
// zero past HS (padded to 64) and past T, staged 16 bytes at a time; the
// row stride 68 makes every fragment load below free of bank conflicts.
// What a product reads as its B operand (K and V in the forward and the dq
// pass, Q and dO in the dk/dv pass) is staged split: two tiles, the tf32
// big parts and then the small ones, so that each value is split once per
// block rather than by every warp at every use (the split is 7 instructions
// a value in SASS: cvt.rna.tf32 is emulated). So is the forward's Q, the A
// operand of its scores for every key tile. Other A operands (the warp's
// own 16 rows in the backward, or the weights in registers) are split as
// they are loaded, once per depth step for all eight column groups (split
// tiles of them would not leave room for two blocks per SM). Forward: split
// Q, K and V (102 KiB); dk/dv: K, V, split Q and dO, and 512 bytes of lse
// and D (102.5 KiB); dq: Q, dO, split K and V (102 KiB).
//
// Tile kinds. With heads of 57..64 components (kAll), a tile's products
// cover all eight column groups and depth steps with no test: straight-line
// code over eight independent accumulators that the compiler interleaves,
// where a test per column group made each group's three dependent products
// wait for one another. Interior tiles (every key visible to every row: key
// tiles before the query tile, or query tiles past the key tile and within
// T) are not masked either. The diagonal tile and the tile at T are masked
// (kMask), but their products are taken in full all the same (hidden pairs
// get weight 0, as before; 5 % more products at T = 1024). Smaller heads
// take the tested code (kAll false), which skips the groups and steps that
// are wholly hidden or padding.
//
// Requirements checked by the caller (flash_attention.cu): f32, qkv and
// dout 16-byte aligned, head size a multiple of 4 up to 64.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_util.cuh"
#include "worker/cuda/flash_attention_internal.cuh"
#include "worker/cuda/flash_attention_variants.h"
#include "worker/cuda/mma_tf32.cuh"

namespace zeroshard {
namespace gpu {
namespace flash_mma {
namespace {

using flash_internal::Dims;
using flash_internal::HeadBase;
using flash_internal::ThisHead;
using internal::LaunchStatus;
using mma::Mma3xTf32;
using mma::SplitTf32;

constexpr int kTile =
    flash_internal::kFlashTile;      // rows per block and per staged tile; keys per softmax step
constexpr int kThreads = 128;        // 4 warps of 16 rows
constexpr int kDims = 64;            // the padded head size
constexpr int kLd = kDims + 4;       // head tiles [64][68]
constexpr int kGroups = kTile / 8;   // 8-wide column groups of a score tile
constexpr int kSplit = kTile * kLd;  // floats from a split tile's big parts to its small ones
constexpr size_t kHeadTile = size_t{kSplit} * sizeof(float);
constexpr size_t kForwardBytes = 6 * kHeadTile;
constexpr size_t kKeyBytes = 6 * kHeadTile + 2 * kTile * sizeof(float);
constexpr size_t kQueryBytes = 6 * kHeadTile;
static_assert(kFlashTensorCoresF32MaxHeadSize == kDims, "the kernels pad head rows to 64");
// Resident blocks per SM: H100/H200 (sm_90, 227 KiB of shared memory) hold
// two of each kernel, 8 warps; A100 (sm_80, 163 KiB) one. The launch bounds
// say two, which lets ptxas use up to 255 registers (2 x 128 threads x 255
// fit the 64 K): with no minimum it held the forward to 128 and spilled.
constexpr int kBlocksPerSm = 2;
constexpr size_t kMostBytes = std::max({kForwardBytes, kKeyBytes, kQueryBytes});
static_assert(kBlocksPerSm * (kMostBytes + 1024) <= 228 * 1024,
              "two blocks per SM on sm_90 (228 KiB, 1 KiB of each block's reserved)");
static_assert(kMostBytes <= 163 * 1024, "an A100's most shared memory per block");

// A warp's fragments: 8 groups of 8 columns (keys or queries for scores,
// head components for accumulators), each a 16 x 8 accumulator fragment.
using Frags = float[kGroups][4];

// This lane's place in its warp's fragments.
struct Lane {
  int warp, g, t;
  __device__ Lane() : warp(threadIdx.x / 32), g(threadIdx.x % 32 / 4), t(threadIdx.x % 4) {}
};

// Stages rows first..first+63 of one head (row r at src + r * stride) into
// tile [64][kLd], 16 bytes at a time; zero past T and past HS. kSplitTile:
// the tf32 big parts into tile and the small ones into tile + kSplit. All
// threads call it.
template <bool kSplitTile>
__device__ __forceinline__ void Stage(float* tile, const float* src, int64_t stride, int64_t first,
                                      const Dims& d) {
  constexpr int kChunks = kDims / 4;
  for (int idx = threadIdx.x; idx < kTile * kChunks; idx += kThreads) {
    const int r = idx / kChunks, col = 4 * (idx % kChunks);
    const int64_t pos = first + r;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (pos < d.t && col < d.hs) v = *reinterpret_cast<const float4*>(src + pos * stride + col);
    float* dst = tile + r * kLd + col;
    if constexpr (kSplitTile) {
      const float x[4] = {v.x, v.y, v.z, v.w};
      const mma::Split<4> p = SplitTf32(x);
      *reinterpret_cast<float4*>(dst) = make_float4(p.big[0], p.big[1], p.big[2], p.big[3]);
      *reinterpret_cast<float4*>(dst + kSplit) =
          make_float4(p.small[0], p.small[1], p.small[2], p.small[3]);
    } else {
      *reinterpret_cast<float4*>(dst) = v;
    }
  }
}

__device__ __forceinline__ void Zero(Frags& f) {
#pragma unroll
  for (int n = 0; n < kGroups; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[n][i] = 0.0f;
  }
}

// What a tile's products cover: column groups [first, end) of the scores
// (or of the weights, in Accumulate) and `steps` depth steps of 8 head
// components (HS rounded up to 8).
struct Span {
  int first, end, steps;
};

// B's two tf32 parts at element e of a split tile, and at e + `next`.
__device__ __forceinline__ mma::Split<2> LoadSplit(const float* e, int next) {
  return mma::Split<2>{{e[0], e[next]}, {e[kSplit], e[kSplit + next]}};
}

// s = A B^T for a warp's 16 rows: s's column group n (columns 8n..8n+7, for
// n in [first, end)) from rows 8n.. of `b`, over the head components
// (`steps` depth steps of 8, zero past HS); A's row r at a + r * kLd (f32,
// or a split tile if kSplitA), B's row c at b + c * kLd (a split tile).
// Groups outside [first, end) are left as they are. kAll: every group and
// step, `span` unread.
template <bool kAll, bool kSplitA = false>
__device__ __forceinline__ void Scores(Frags& s, const float* a, const float* b, const Span& span,
                                       const Lane& ln) {
#pragma unroll
  for (int kk = 0; kk < kDims / 8; ++kk) {
    if (!kAll && kk >= span.steps) break;
    const float* ar = a + ln.g * kLd + 8 * kk + ln.t;
    mma::Split<4> as;
    if constexpr (kSplitA) {
      as = mma::Split<4>{
          {ar[0], ar[8 * kLd], ar[4], ar[8 * kLd + 4]},
          {ar[kSplit], ar[kSplit + 8 * kLd], ar[kSplit + 4], ar[kSplit + 8 * kLd + 4]}};
    } else {
      const float ax[4] = {ar[0], ar[8 * kLd], ar[4], ar[8 * kLd + 4]};
      as = SplitTf32(ax);
    }
#pragma unroll
    for (int n = 0; n < kGroups; ++n) {
      if (!kAll && (n < span.first || n >= span.end)) continue;
      Mma3xTf32(s[n], as, LoadSplit(b + (8 * n + ln.g) * kLd + 8 * kk + ln.t, 4));
    }
  }
}

// acc += P Y for a warp's 16 rows: P's columns are the fragments p (column
// groups [first, end), 8 rows of Y each), Y's row c at y + c * kLd (a split
// tile); acc's column group n is head components 8n..8n+7 (for n <
// `steps`). Per depth step the keys run in the order 0, 2, 4, 6, 1, 3, 5, 7
// (the file comment). kAll: every group and step, `span` unread.
template <bool kAll>
__device__ __forceinline__ void Accumulate(Frags& acc, const Frags& p, const float* y,
                                           const Span& span, const Lane& ln) {
#pragma unroll
  for (int kb = 0; kb < kGroups; ++kb) {
    if (!kAll && (kb < span.first || kb >= span.end)) continue;
    const float ax[4] = {p[kb][0], p[kb][2], p[kb][1], p[kb][3]};
    const mma::Split<4> as = SplitTf32(ax);
    const float* y0 = y + (8 * kb + 2 * ln.t) * kLd + ln.g;  // key 2t; key 2t + 1 one row on
#pragma unroll
    for (int n = 0; n < kDims / 8; ++n) {
      if (!kAll && n >= span.steps) break;
      Mma3xTf32(acc[n], as, LoadSplit(y0 + 8 * n, kLd));
    }
  }
}

// The maximum (or sum) of a row's values over the four lanes holding it.
__device__ __forceinline__ float RowMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float RowSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Writes a warp's accumulators times `factor` to rows `row0` (c[0], c[1])
// and row0 + 8 (c[2], c[3]) of dst (row r at dst + r * stride), head
// components below HS; rows past T are not written.
__device__ __forceinline__ void WriteRows(float* dst, int64_t stride, const Frags& acc,
                                          int64_t row0, float factor0, float factor1,
                                          const Lane& ln, const Dims& d) {
#pragma unroll
  for (int n = 0; n < kDims / 8; ++n) {
    const int col = 8 * n + 2 * ln.t;
    if (col >= d.hs) break;  // HS is a multiple of 4: col + 1 < HS too
    if (row0 < d.t) {
      dst[row0 * stride + col] = factor0 * acc[n][0];
      dst[row0 * stride + col + 1] = factor0 * acc[n][1];
    }
    if (row0 + 8 < d.t) {
      dst[(row0 + 8) * stride + col] = factor1 * acc[n][2];
      dst[(row0 + 8) * stride + col + 1] = factor1 * acc[n][3];
    }
  }
}

// Head-component depth steps (and accumulator column groups) that HS needs.
__device__ __forceinline__ int Steps(const Dims& d) { return static_cast<int>((d.hs + 7) / 8); }

// A query tile's block (the forward and the dq pass): the tile (the last,
// longest, first), this lane's rows row0 and row0 + 8, the end of the key
// tiles it sees, and the head's place in qkv.
struct QueryTile {
  HeadBase head;
  int64_t tile0, row0, rows_end;
  __device__ QueryTile(const Lane& ln, const Dims& d)
      : head(ThisHead(d)),
        tile0(static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kTile),
        row0(tile0 + 16 * ln.warp + ln.g),
        rows_end(tile0 + kTile < d.t ? tile0 + kTile : d.t) {}
  // Key groups of the key tile at j0 with a key <= the warp's last row
  // (uniform over the warp).
  __device__ int VisibleGroups(int64_t j0, const Lane& ln) const {
    const int64_t seen = tile0 + 16 * ln.warp + 16 - j0;
    return seen >= kTile ? kGroups : static_cast<int>((seen + 7) / 8);
  }
  // Whether the key tile at j0 lies wholly before this query tile (every
  // key visible to every row; uniform over the block).
  __device__ bool Interior(int64_t j0) const { return j0 + kTile <= tile0; }
  // Stages the K and V rows of the key tile at j0, split, once every warp is
  // done with the previous ones. All threads call it.
  __device__ void StageKeys(float* ks, float* vs, const float* qkv, int64_t j0,
                            const Dims& d) const {
    __syncthreads();
    Stage<true>(ks, qkv + head.qkv + d.c, 3 * d.c, j0, d);
    Stage<true>(vs, qkv + head.qkv + 2 * d.c, 3 * d.c, j0, d);
    __syncthreads();
  }
};

// ---------------------------------------------------------------------------
// Forward. Block: query tile (the last, longest, first), head, batch row.
// Per key tile up to its last row: S = Q K^T, the online softmax on S's
// fragments (rows g and g + 8 of the warp: running max m, this lane's share
// of the running sum l), O += P V.

// One key tile of the forward (at j0; qs: the warp's Q rows, ks and vs the
// K and V tiles, all split). kAll and kMask: the file comment's tile kinds.
template <bool kAll, bool kMask>
__device__ __forceinline__ void ForwardTile(Frags& o, float (&m)[2], float (&l)[2], const float* qs,
                                            const float* ks, const float* vs, int64_t j0,
                                            const QueryTile& tile, const Lane& ln, const Dims& d) {
  const Span span{0, kAll ? kGroups : tile.VisibleGroups(j0, ln), Steps(d)};
  Frags s;
  Zero(s);
  Scores<kAll, true>(s, qs, ks, span, ln);
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // rows row0 (c[0], c[1]) and row0 + 8 (c[2], c[3])
    const int64_t row = tile.row0 + 8 * h;
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < kGroups; ++n) {
#pragma unroll
      for (int i = 2 * h; i < 2 * h + 2; ++i) {
        const int64_t key = j0 + 8 * n + 2 * ln.t + i % 2;
        s[n][i] = !kMask || (n < span.end && key <= row) ? d.scale * s[n][i] : -INFINITY;
        mx = fmaxf(mx, s[n][i]);
      }
    }
    const float next_m = fmaxf(m[h], RowMax(mx));
    // Every row sees key 0 in the first tile: next_m is finite.
    const float alpha = expf(m[h] - next_m);  // 0 on the first tile
    l[h] *= alpha;
#pragma unroll
    for (int n = 0; n < kDims / 8; ++n) {
      o[n][2 * h] *= alpha;
      o[n][2 * h + 1] *= alpha;
    }
#pragma unroll
    for (int n = 0; n < kGroups; ++n) {
#pragma unroll
      for (int i = 2 * h; i < 2 * h + 2; ++i) {
        s[n][i] = expf(s[n][i] - next_m);  // 0 where masked
        l[h] += s[n][i];
      }
    }
    m[h] = next_m;
  }
  Accumulate<kAll>(o, s, vs, span, ln);
}

__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    MmaForwardKernel(float* out, float* lse, const float* qkv, Dims d) {
  extern __shared__ __align__(128) float smem[];
  float* qs = smem;
  float* ks = qs + 2 * kSplit;
  float* vs = ks + 2 * kSplit;
  const Lane ln;
  const QueryTile tile(ln, d);
  Stage<true>(qs, qkv + tile.head.qkv, 3 * d.c, tile.tile0, d);
  const float* my_q = qs + 16 * ln.warp * kLd;
  const int64_t row0 = tile.row0;  // and row0 + 8
  const bool all_steps = Steps(d) == kDims / 8;
  Frags o;
  Zero(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int64_t j0 = 0; j0 < tile.rows_end; j0 += kTile) {  // key tiles with a key <= the last row
    tile.StageKeys(ks, vs, qkv, j0, d);
    if (!all_steps) {
      ForwardTile<false, true>(o, m, l, my_q, ks, vs, j0, tile, ln, d);
    } else if (tile.Interior(j0)) {
      ForwardTile<true, false>(o, m, l, my_q, ks, vs, j0, tile, ln, d);
    } else {
      ForwardTile<true, true>(o, m, l, my_q, ks, vs, j0, tile, ln, d);
    }
  }
  const float sum0 = RowSum(l[0]), sum1 = RowSum(l[1]);
  WriteRows(out + tile.head.out, d.c, o, row0, 1.0f / sum0, 1.0f / sum1, ln, d);
  if (ln.t == 0) {
    if (row0 < d.t) lse[tile.head.lse + row0] = m[0] + logf(sum0);
    if (row0 + 8 < d.t) lse[tile.head.lse + row0 + 8] = m[1] + logf(sum1);
  }
}

// ---------------------------------------------------------------------------
// Backward, dk and dv. Block: key tile (tile 0, seen by every query, first),
// head, batch row. Per query tile from its own on: S^T = K Q^T and
// dP^T = V dO^T (a warp's 16 keys x 64 queries), then per element
// p = e^(scale s - lse), ds = p (dp - D), and dV += P^T dO, dK += dS^T Q.

// The shared tiles of the dk/dv pass: the block's K and V (f32), the query
// tile's Q and dO (split) and its rows' lse and D.
struct KeyPassTiles {
  const float *ks, *vs, *qs, *gs, *lse_s, *d_s;
};

// One query tile (at i0) of the dk/dv pass, for this warp's keys key0 and
// key0 + 8. kAll and kMask: the file comment's tile kinds.
template <bool kAll, bool kMask>
__device__ __forceinline__ void KeyPassTile(Frags& dk, Frags& dv, const KeyPassTiles& tl,
                                            int64_t j0, int64_t i0, int64_t key0, const Lane& ln,
                                            const Dims& d) {
  // Query groups with a query >= this warp's first key and < T (uniform).
  Span span{0, kGroups, Steps(d)};
  if (!kAll) {
    const int64_t before = j0 + 16 * ln.warp - i0;
    span.first = before > 0 ? static_cast<int>(before / 8) : 0;
    const int64_t left = d.t - i0;
    span.end = left >= kTile ? kGroups : static_cast<int>((left + 7) / 8);
  }
  // Column c (query i0 + c, c in [0, 64)) is visible to key key0 + 8h
  // (h = 0, 1) when c >= lo + 8h and c < hi: 32-bit offsets clamped to
  // [-8, 64], which keeps every such test's answer (and lets the masked copy
  // fit its registers).
  const int lo = static_cast<int>(key0 - i0 < -8 ? -8 : (key0 - i0 > kTile ? kTile : key0 - i0));
  const int hi = static_cast<int>(d.t - i0 < kTile ? d.t - i0 : kTile);
  Frags p, ds;
  Zero(p);
  Zero(ds);
  Scores<kAll>(p, tl.ks + 16 * ln.warp * kLd, tl.qs, span, ln);
  Scores<kAll>(ds, tl.vs + 16 * ln.warp * kLd, tl.gs, span, ln);
#pragma unroll
  for (int n = 0; n < kGroups; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = 8 * n + 2 * ln.t + i % 2;
      const bool visible =
          !kMask || (n >= span.first && n < span.end && c >= lo + 8 * (i / 2) && c < hi);
      p[n][i] = visible ? expf(d.scale * p[n][i] - tl.lse_s[c]) : 0.0f;
      ds[n][i] = p[n][i] * (ds[n][i] - tl.d_s[c]);
    }
  }
  Accumulate<kAll>(dv, p, tl.gs, span, ln);
  Accumulate<kAll>(dk, ds, tl.qs, span, ln);
}

__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    MmaBackwardKeyKernel(float* dqkv, const float* dout, const float* qkv, const float* lse,
                         const float* dvec, Dims d) {
  extern __shared__ __align__(128) float smem[];
  float* ks = smem;
  float* vs = ks + kSplit;
  float* qs = vs + kSplit;
  float* gs = qs + 2 * kSplit;
  float* lse_s = gs + 2 * kSplit;  // [kTile]
  float* d_s = lse_s + kTile;      // [kTile]
  const KeyPassTiles tiles{ks, vs, qs, gs, lse_s, d_s};
  const Lane ln;
  const HeadBase head = ThisHead(d);
  const int64_t stride = 3 * d.c;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t key0 = j0 + 16 * ln.warp + ln.g;  // and key0 + 8
  const bool all_steps = Steps(d) == kDims / 8;

  Stage<false>(ks, qkv + head.qkv + d.c, stride, j0, d);
  Stage<false>(vs, qkv + head.qkv + 2 * d.c, stride, j0, d);
  Frags dk, dv;
  Zero(dk);
  Zero(dv);
  for (int64_t i0 = j0; i0 < d.t; i0 += kTile) {  // query tiles holding a row >= j0
    __syncthreads();
    Stage<true>(qs, qkv + head.qkv, stride, i0, d);
    Stage<true>(gs, dout + head.out, d.c, i0, d);
    for (int r = threadIdx.x; r < kTile; r += kThreads) {
      const bool in = i0 + r < d.t;
      lse_s[r] = in ? lse[head.lse + i0 + r] : 0.0f;
      d_s[r] = in ? dvec[head.lse + i0 + r] : 0.0f;
    }
    __syncthreads();
    // Interior: every query of the tile after every key of the block's, and
    // within T (uniform over the block).
    if (!all_steps) {
      KeyPassTile<false, true>(dk, dv, tiles, j0, i0, key0, ln, d);
    } else if (i0 >= j0 + kTile && i0 + kTile <= d.t) {
      KeyPassTile<true, false>(dk, dv, tiles, j0, i0, key0, ln, d);
    } else {
      KeyPassTile<true, true>(dk, dv, tiles, j0, i0, key0, ln, d);
    }
  }
  WriteRows(dqkv + head.qkv + d.c, stride, dk, key0, d.scale, d.scale, ln, d);
  WriteRows(dqkv + head.qkv + 2 * d.c, stride, dv, key0, 1.0f, 1.0f, ln, d);
}

// Backward, dq. Block: query tile (the last, longest, first), head, batch
// row. Per key tile up to its last row: S = Q K^T, dP = dO V^T, then
// ds = e^(scale s - lse) (dp - D) and dQ += dS K.

// One key tile (at j0) of the dq pass: qs and gs the warp's Q and dO rows
// (f32), ks and vs the split K and V tiles, row_lse and row_d the lane's
// rows' lse and D. kAll and kMask: the file comment's tile kinds. Without
// kMask (an interior tile), rows past T (zero Q and dO, lse and D 0) give
// finite values that no one reads: dQ's row r takes only row r's ds and is
// written below T.
template <bool kAll, bool kMask>
__device__ __forceinline__ void QueryPassTile(Frags& dq, const float* qs, const float* gs,
                                              const float* ks, const float* vs,
                                              const float (&row_lse)[2], const float (&row_d)[2],
                                              int64_t j0, const QueryTile& tile, const Lane& ln,
                                              const Dims& d) {
  const Span span{0, kAll ? kGroups : tile.VisibleGroups(j0, ln), Steps(d)};
  Frags p, ds;
  Zero(p);
  Zero(ds);
  Scores<kAll>(p, qs, ks, span, ln);
  Scores<kAll>(ds, gs, vs, span, ln);
#pragma unroll
  for (int n = 0; n < kGroups; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = i / 2;
      const int64_t row = tile.row0 + 8 * h, key = j0 + 8 * n + 2 * ln.t + i % 2;
      const bool visible = !kMask || (n < span.end && key <= row && row < d.t);
      const float w = visible ? expf(d.scale * p[n][i] - row_lse[h]) : 0.0f;
      ds[n][i] = w * (ds[n][i] - row_d[h]);
    }
  }
  Accumulate<kAll>(dq, ds, ks, span, ln);
}

__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    MmaBackwardQueryKernel(float* dqkv, const float* dout, const float* qkv, const float* lse,
                           const float* dvec, Dims d) {
  extern __shared__ __align__(128) float smem[];
  float* qs = smem;
  float* gs = qs + kSplit;
  float* ks = gs + kSplit;
  float* vs = ks + 2 * kSplit;
  const Lane ln;
  const QueryTile tile(ln, d);
  const HeadBase& head = tile.head;
  const int64_t row0 = tile.row0;  // and row0 + 8
  const bool all_steps = Steps(d) == kDims / 8;

  Stage<false>(qs, qkv + head.qkv, 3 * d.c, tile.tile0, d);
  Stage<false>(gs, dout + head.out, d.c, tile.tile0, d);
  const float* my_q = qs + 16 * ln.warp * kLd;
  const float* my_g = gs + 16 * ln.warp * kLd;
  float row_lse[2], row_d[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool live = row0 + 8 * h < d.t;
    row_lse[h] = live ? lse[head.lse + row0 + 8 * h] : 0.0f;
    row_d[h] = live ? dvec[head.lse + row0 + 8 * h] : 0.0f;
  }
  Frags dq;
  Zero(dq);
  for (int64_t j0 = 0; j0 < tile.rows_end; j0 += kTile) {
    tile.StageKeys(ks, vs, qkv, j0, d);
    if (!all_steps) {
      QueryPassTile<false, true>(dq, my_q, my_g, ks, vs, row_lse, row_d, j0, tile, ln, d);
    } else if (tile.Interior(j0)) {
      QueryPassTile<true, false>(dq, my_q, my_g, ks, vs, row_lse, row_d, j0, tile, ln, d);
    } else {
      QueryPassTile<true, true>(dq, my_q, my_g, ks, vs, row_lse, row_d, j0, tile, ln, d);
    }
  }
  WriteRows(dqkv + head.qkv, 3 * d.c, dq, row0, d.scale, d.scale, ln, d);
}

// Without nvcc (tests/worker/cuda/emulation runs the kernels above on the
// CPU), nothing below: it launches them.
#ifndef ZEROSHARD_FLASH_ATTENTION_EMULATED

// ---------------------------------------------------------------------------
// Host side.

using flash_internal::AllowSharedMemory;
using flash_internal::TileGrid;

absl::Status Forward(float* out, float* lse, const float* qkv, int64_t b, const Dims& d,
                     cudaStream_t stream) {
  static constexpr char kWhat[] = "FlashAttentionForward (tensor cores)";
  if (absl::Status s = AllowSharedMemory(MmaForwardKernel, kForwardBytes, kWhat); !s.ok()) return s;
  MmaForwardKernel<<<TileGrid(b, d), kThreads, kForwardBytes, stream>>>(out, lse, qkv, d);
  return LaunchStatus(kWhat);
}

absl::Status Backward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                      const float* dvec, int64_t b, const Dims& d, cudaStream_t stream) {
  static constexpr char kWhat[] = "FlashAttentionBackward (tensor cores)";
  if (absl::Status s = AllowSharedMemory(MmaBackwardKeyKernel, kKeyBytes, kWhat); !s.ok()) return s;
  MmaBackwardKeyKernel<<<TileGrid(b, d), kThreads, kKeyBytes, stream>>>(dqkv, dout, qkv, lse, dvec,
                                                                        d);
  if (absl::Status s = LaunchStatus(kWhat); !s.ok()) return s;
  if (absl::Status s = AllowSharedMemory(MmaBackwardQueryKernel, kQueryBytes, kWhat); !s.ok())
    return s;
  MmaBackwardQueryKernel<<<TileGrid(b, d), kThreads, kQueryBytes, stream>>>(dqkv, dout, qkv, lse,
                                                                            dvec, d);
  return LaunchStatus(kWhat);
}

#endif  // ZEROSHARD_FLASH_ATTENTION_EMULATED

}  // namespace
}  // namespace flash_mma

#ifndef ZEROSHARD_FLASH_ATTENTION_EMULATED

namespace flash_internal {

int64_t MmaSharedBytes() { return static_cast<int64_t>(flash_mma::kMostBytes); }

absl::Status MmaForward(float* out, float* lse, const float* qkv, int64_t b, const Dims& d,
                        cudaStream_t stream) {
  return flash_mma::Forward(out, lse, qkv, b, d, stream);
}

absl::Status MmaBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                         const float* dvec, int64_t b, const Dims& d, cudaStream_t stream) {
  return flash_mma::Backward(dqkv, dout, qkv, lse, dvec, b, d, stream);
}

}  // namespace flash_internal

#endif  // ZEROSHARD_FLASH_ATTENTION_EMULATED

}  // namespace gpu
}  // namespace zeroshard
