// Fused causal self-attention (FlashAttention-2's tiling and online softmax):
// the T x T scores live only in registers, tile by tile. The algorithm, step
// for step, is worker/model/flash_attention_reference.{h,cc}, which is tested
// against the naive attention on the host; this file maps it onto threads.
//
// Threads. A block owns one tile of kTile = 64 rows (query rows in the
// forward and the dq pass, key rows in the dk/dv pass) of one head. Each row
// belongs to a group of kTpr consecutive lanes (1, 2 or 4 for head sizes up
// to 32, 64, 128), each lane holding kLaneDims = 32 of the row's head
// components in registers: lane `part` of a group holds the float4 chunks
// part, part + kTpr, part + 2 kTpr, ... of the (zero-padded) row, so that the
// lanes of a group read adjacent 16-byte words of a shared row (no bank
// conflicts) and every group of a warp reads the same shared row (broadcast).
// A dot product is each lane's partial sum, then an xor-butterfly over the
// group's lanes: every lane of the group ends with the same bits, so the
// group's lanes make the same softmax decisions.
//
// Shared memory (dynamic): two tiles of kTile rows x kTpr * 32 floats (K and
// V in the forward and the dq pass, Q and dO in the dk/dv pass) staged from
// global memory (bf16 widened exactly, rows past T and components past HS
// zero): 16 KiB (HS <= 32), 32 KiB (<= 64), 64 KiB (<= 128, over the 48 KiB
// default: the kernels opt in with cudaFuncSetAttribute), plus 512 bytes of
// lse and D in the dk/dv pass.
//
// Every sum has a fixed order (no atomics), so results are deterministic.
// Arithmetic is f32 whatever the storage; results are rounded to the storage
// type once.
//
// These are the CUDA-core kernels; the tensor-core ones are in
// flash_attention_wmma.cu (bf16) and flash_attention_mma.cu (f32 as 3xTF32)
// (flash_attention_variants.h picks explicitly; the public functions at the
// end of this file choose, see kDefaultBf16Kernels and kDefaultF32Kernels).
// All run on the CPU too, under
// //tests/worker/cuda:flash_attention_emulated_test.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "worker/cuda/cuda_util.cuh"
#include "worker/cuda/flash_attention.h"
#include "worker/cuda/flash_attention_internal.cuh"
#include "worker/cuda/flash_attention_variants.h"

namespace zeroshard {
namespace gpu {
namespace {

using internal::AsStream;
using internal::BF16BitsToFloat;
using internal::CheckCount;
using internal::FloatToBF16Bits;
using internal::LaunchStatus;
using internal::SumOp;
using internal::WarpReduce;

constexpr int kTile = flash_internal::kFlashTile;  // rows per block, and per staged tile
constexpr int kStep = 16;                          // keys per online-softmax update (forward)
constexpr int kLaneDims = 32;                      // head components per lane
constexpr int kMaxHeadSize = static_cast<int>(kFlashAttentionMaxHeadSize);

using flash_internal::Dims;
using flash_internal::HeadBase;
using flash_internal::ThisHead;

// bf16 runs on the tensor cores where they take the arguments, the CUDA
// cores elsewhere: on an H200 (2026-11-30) the tensor-core kernels passed
// cuda_kernels_parity_check and the device GPT's parity check and took 1.32
// ms per GPT-2 layer (forward + backward) against the CUDA cores' 3.41.
constexpr FlashKernels kDefaultBf16Kernels = FlashKernels::kTensorCores;
// f32 runs as 3xTF32 on the tensor cores (the mma.sync kernels of
// flash_attention_mma.cu) where they take the head size (up to 64) and the
// GPU has their shared memory, the CUDA cores elsewhere: on an H200
// (2026-11-30) they passed cuda_kernels_parity_check
// (errors within the f32 error model, as the CUDA cores') and took 1.79 ms
// per GPT-2 layer (forward + backward) against the CUDA cores' 3.38; the
// device GPT-2 124M in f32 went from 46,153 to 51,731 tokens/s.
constexpr FlashKernels kDefaultF32Kernels = FlashKernels::kTensorCores;

__device__ __forceinline__ int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }

// Storage: f32, or bf16 as raw bits (widened exactly, rounded to nearest even).
__device__ __forceinline__ float Load(const float* p) { return *p; }
__device__ __forceinline__ float Load(const uint16_t* p) { return BF16BitsToFloat(*p); }
__device__ __forceinline__ void Store(float* p, float v) { *p = v; }
__device__ __forceinline__ void Store(uint16_t* p, float v) { *p = FloatToBF16Bits(v); }

// Where this thread sits: its row of the block's tile and its lane in the
// row's group.
template <int kTpr>
struct Place {
  static constexpr int kThreads = kTile * kTpr;
  static constexpr int kDims = kTpr * kLaneDims;  // the padded head size
  int group;                                      // row in the tile
  int part;                                       // lane in the group, 0..kTpr-1

  __device__ Place() : group(threadIdx.x / kTpr), part(threadIdx.x % kTpr) {}
  // Head component held in register e (0..kLaneDims-1).
  __device__ int Dim(int e) const { return ((e / 4) * kTpr + part) * 4 + e % 4; }
};

// This lane's components of one head row (zero past HS or past T).
template <int kTpr, typename S>
__device__ __forceinline__ void LoadRow(float (&x)[kLaneDims], const S* row, bool live, int64_t hs,
                                        const Place<kTpr>& at) {
#pragma unroll
  for (int e = 0; e < kLaneDims; ++e) {
    const int dim = at.Dim(e);
    x[e] = live && dim < hs ? Load(row + dim) : 0.0f;
  }
}

template <int kTpr, typename S>
__device__ __forceinline__ void StoreRow(S* row, const float (&x)[kLaneDims], float factor,
                                         int64_t hs, const Place<kTpr>& at) {
#pragma unroll
  for (int e = 0; e < kLaneDims; ++e) {
    const int dim = at.Dim(e);
    if (dim < hs) Store(row + dim, factor * x[e]);
  }
}

// x . row over the whole (padded) head: this lane's chunks, then the group's
// butterfly. `row` is a shared-memory row of kDims floats, 16-byte aligned.
template <int kTpr>
__device__ __forceinline__ float RowDot(const float (&x)[kLaneDims], const float* row, int part) {
  const float4* r4 = reinterpret_cast<const float4*>(row);
  float dot = 0.0f;
#pragma unroll
  for (int ch = 0; ch < kLaneDims / 4; ++ch) {
    const float4 y = r4[ch * kTpr + part];
    dot += x[4 * ch] * y.x;
    dot += x[4 * ch + 1] * y.y;
    dot += x[4 * ch + 2] * y.z;
    dot += x[4 * ch + 3] * y.w;
  }
#pragma unroll
  for (int offset = 1; offset < kTpr; offset <<= 1) {
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  }
  return dot;
}

// acc += w * row, this lane's components.
template <int kTpr>
__device__ __forceinline__ void RowAxpy(float (&acc)[kLaneDims], float w, const float* row,
                                        int part) {
  const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll
  for (int ch = 0; ch < kLaneDims / 4; ++ch) {
    const float4 y = r4[ch * kTpr + part];
    acc[4 * ch] += w * y.x;
    acc[4 * ch + 1] += w * y.y;
    acc[4 * ch + 2] += w * y.z;
    acc[4 * ch + 3] += w * y.w;
  }
}

// Stages rows first..first+kTile-1 of one head (row r at src + r * stride)
// into tile [kTile][kDims], zero past T and past HS. All threads call it.
template <int kTpr, typename S>
__device__ __forceinline__ void LoadTile(float* tile, const S* src, int64_t stride, int64_t first,
                                         const Dims& d) {
  constexpr int kDims = Place<kTpr>::kDims;
  for (int idx = threadIdx.x; idx < kTile * kDims; idx += Place<kTpr>::kThreads) {
    const int r = idx / kDims, i = idx % kDims;
    const int64_t pos = first + r;
    tile[idx] = pos < d.t && i < d.hs ? Load(src + pos * stride + i) : 0.0f;
  }
}

// ---------------------------------------------------------------------------
// Forward. Block: query tile (blockIdx.x counted from the last tile, the
// longest, so they start first), head, batch row. Thread group: one query
// row; it keeps q, the output accumulator o, the running max m and sum l in
// registers and walks the key tiles up to the block's last row, kStep keys
// per online-softmax update.
template <typename S, int kTpr>
__global__ void __launch_bounds__(Place<kTpr>::kThreads)
    FlashForwardKernel(S* out, float* lse, const S* qkv, Dims d) {
  constexpr int kDims = Place<kTpr>::kDims;
  extern __shared__ float4 shared4[];
  float* k_tile = reinterpret_cast<float*>(shared4);
  float* v_tile = k_tile + kTile * kDims;
  const Place<kTpr> at;
  const HeadBase head = ThisHead(d);
  const int64_t stride = 3 * d.c;
  const int64_t tile0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kTile;
  const int64_t row = tile0 + at.group;
  const bool live = row < d.t;

  float q[kLaneDims], o[kLaneDims];
  LoadRow(q, qkv + head.qkv + row * stride, live, d.hs, at);
#pragma unroll
  for (int e = 0; e < kLaneDims; ++e) o[e] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int64_t rows_end = Min(tile0 + kTile, d.t);
  for (int64_t j0 = 0; j0 < rows_end; j0 += kTile) {  // key tiles with a key <= the last row
    __syncthreads();                                  // the previous tile is consumed
    LoadTile<kTpr>(k_tile, qkv + head.qkv + d.c, stride, j0, d);
    LoadTile<kTpr>(v_tile, qkv + head.qkv + 2 * d.c, stride, j0, d);
    __syncthreads();
    const int64_t last = live ? row - j0 : -1;  // keys j0 + c, c <= last, are visible
    for (int c0 = 0; c0 < kTile; c0 += kStep) {
      float s[kStep];
      float next_m = m;
#pragma unroll
      for (int c = 0; c < kStep; ++c) {
        const float dot = RowDot<kTpr>(q, k_tile + (c0 + c) * kDims, at.part);
        s[c] = c0 + c <= last ? d.scale * dot : -INFINITY;
        next_m = fmaxf(next_m, s[c]);
      }
      // No visible key yet only in rows past T (key 0 comes first).
      const bool any = next_m != -INFINITY;
      const float alpha = any ? expf(m - next_m) : 1.0f;  // 0 on the first step
      l *= alpha;
#pragma unroll
      for (int e = 0; e < kLaneDims; ++e) o[e] *= alpha;
#pragma unroll
      for (int c = 0; c < kStep; ++c) {
        const float p = any ? expf(s[c] - next_m) : 0.0f;  // 0 where masked
        l += p;
        RowAxpy<kTpr>(o, p, v_tile + (c0 + c) * kDims, at.part);
      }
      m = next_m;
    }
  }
  if (!live) return;
  StoreRow(out + head.out + row * d.c, o, 1.0f / l, d.hs, at);
  if (at.part == 0) lse[head.lse + row] = m + logf(l);
}

// ---------------------------------------------------------------------------
// Backward, first pass: D [B,NH,T], each row's dout . out, one warp per row
// (the lanes' strided partial sums, then the butterfly).
template <typename S>
__global__ void FlashRowDotKernel(float* dvec, const S* dout, const S* out, Dims d, int64_t rows) {
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32; r < rows;
       r += static_cast<int64_t>(gridDim.x) * warps) {  // uniform per warp
    const int64_t pos = r % d.t, h = (r / d.t) % d.nh, b = r / (d.t * d.nh);
    const int64_t at = (b * d.t + pos) * d.c + h * d.hs;
    float sum = 0.0f;
    for (int64_t i = lane; i < d.hs; i += 32) sum += Load(dout + at + i) * Load(out + at + i);
    sum = WarpReduce(sum, SumOp());
    if (lane == 0) dvec[r] = sum;
  }
}

// Backward, dk and dv. Block: key tile (blockIdx.x; tile 0, seen by every
// query, first), head, batch row. Thread group: one key row s; it keeps k_s,
// v_s and the accumulators dk_s, dv_s in registers and walks the query tiles
// from its own on (Q, dO, lse, D staged), query row by query row:
// p = e^(scale q.k - lse), dv += p dO, ds = p (dO.v - D), dk += ds q.
template <typename S, int kTpr>
__global__ void __launch_bounds__(Place<kTpr>::kThreads)
    FlashBackwardKeyKernel(S* dqkv, const S* dout, const S* qkv, const float* lse,
                           const float* dvec, Dims d) {
  constexpr int kDims = Place<kTpr>::kDims;
  extern __shared__ float4 shared4[];
  float* q_tile = reinterpret_cast<float*>(shared4);
  float* g_tile = q_tile + kTile * kDims;
  float* lse_tile = g_tile + kTile * kDims;  // [kTile]
  float* d_tile = lse_tile + kTile;          // [kTile]
  const Place<kTpr> at;
  const HeadBase head = ThisHead(d);
  const int64_t stride = 3 * d.c;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t key = j0 + at.group;
  const bool live = key < d.t;

  float k[kLaneDims], v[kLaneDims], dk[kLaneDims], dv[kLaneDims];
  LoadRow(k, qkv + head.qkv + d.c + key * stride, live, d.hs, at);
  LoadRow(v, qkv + head.qkv + 2 * d.c + key * stride, live, d.hs, at);
#pragma unroll
  for (int e = 0; e < kLaneDims; ++e) dk[e] = dv[e] = 0.0f;
  for (int64_t i0 = j0; i0 < d.t; i0 += kTile) {  // query tiles holding a row >= j0
    __syncthreads();
    LoadTile<kTpr>(q_tile, qkv + head.qkv, stride, i0, d);
    LoadTile<kTpr>(g_tile, dout + head.out, d.c, i0, d);
    for (int r = threadIdx.x; r < kTile; r += Place<kTpr>::kThreads) {
      const bool in = i0 + r < d.t;
      lse_tile[r] = in ? lse[head.lse + i0 + r] : 0.0f;
      d_tile[r] = in ? dvec[head.lse + i0 + r] : 0.0f;
    }
    __syncthreads();
    const int64_t first = live ? key - i0 : kTile;            // query rows r >= first see the key
    const int rows = static_cast<int>(Min(kTile, d.t - i0));  // uniform
    for (int r = 0; r < rows; ++r) {
      const float* qr = q_tile + r * kDims;
      const float* gr = g_tile + r * kDims;
      const float qk = RowDot<kTpr>(k, qr, at.part);
      const float gv = RowDot<kTpr>(v, gr, at.part);
      const float p = r >= first ? expf(d.scale * qk - lse_tile[r]) : 0.0f;
      const float ds = p * (gv - d_tile[r]);
      RowAxpy<kTpr>(dv, p, gr, at.part);
      RowAxpy<kTpr>(dk, ds, qr, at.part);
    }
  }
  if (!live) return;
  StoreRow(dqkv + head.qkv + d.c + key * stride, dk, d.scale, d.hs, at);
  StoreRow(dqkv + head.qkv + 2 * d.c + key * stride, dv, 1.0f, d.hs, at);
}

// Backward, dq. Block: query tile (the last, longest, first), head, batch
// row. Thread group: one query row t; it keeps q_t, dO_t, lse_t, D_t and the
// accumulator dq_t in registers and walks the key tiles up to the block's
// last row (K, V staged): ds = e^(scale q.k - lse) (dO.v - D), dq += ds k.
template <typename S, int kTpr>
__global__ void __launch_bounds__(Place<kTpr>::kThreads)
    FlashBackwardQueryKernel(S* dqkv, const S* dout, const S* qkv, const float* lse,
                             const float* dvec, Dims d) {
  constexpr int kDims = Place<kTpr>::kDims;
  extern __shared__ float4 shared4[];
  float* k_tile = reinterpret_cast<float*>(shared4);
  float* v_tile = k_tile + kTile * kDims;
  const Place<kTpr> at;
  const HeadBase head = ThisHead(d);
  const int64_t stride = 3 * d.c;
  const int64_t tile0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kTile;
  const int64_t row = tile0 + at.group;
  const bool live = row < d.t;

  float q[kLaneDims], g[kLaneDims], dq[kLaneDims];
  LoadRow(q, qkv + head.qkv + row * stride, live, d.hs, at);
  LoadRow(g, dout + head.out + row * d.c, live, d.hs, at);
#pragma unroll
  for (int e = 0; e < kLaneDims; ++e) dq[e] = 0.0f;
  const float row_lse = live ? lse[head.lse + row] : 0.0f;
  const float row_d = live ? dvec[head.lse + row] : 0.0f;
  const int64_t rows_end = Min(tile0 + kTile, d.t);
  for (int64_t j0 = 0; j0 < rows_end; j0 += kTile) {
    __syncthreads();
    LoadTile<kTpr>(k_tile, qkv + head.qkv + d.c, stride, j0, d);
    LoadTile<kTpr>(v_tile, qkv + head.qkv + 2 * d.c, stride, j0, d);
    __syncthreads();
    const int64_t last = live ? row - j0 : -1;                // keys c <= last visible
    const int keys = static_cast<int>(Min(kTile, d.t - j0));  // uniform
    for (int c = 0; c < keys; ++c) {
      const float* kr = k_tile + c * kDims;
      const float qk = RowDot<kTpr>(q, kr, at.part);
      const float gv = RowDot<kTpr>(g, v_tile + c * kDims, at.part);
      const float p = c <= last ? expf(d.scale * qk - row_lse) : 0.0f;
      RowAxpy<kTpr>(dq, p * (gv - row_d), kr, at.part);
    }
  }
  if (live) StoreRow(dqkv + head.qkv + row * stride, dq, d.scale, d.hs, at);
}

// Dynamic shared memory of the tiled kernels: two tiles of floats (and the
// dk/dv pass's lse and D rows).
template <int kTpr>
constexpr size_t TileBytes() {
  return 2 * kTile * Place<kTpr>::kDims * sizeof(float);
}
template <int kTpr>
constexpr size_t KeyBytes() {
  return TileBytes<kTpr>() + 2 * kTile * sizeof(float);
}

// Without nvcc (tests/worker/cuda/emulation runs the kernels above on the
// CPU), nothing below: it launches them.
#ifndef ZEROSHARD_FLASH_ATTENTION_EMULATED

// ---------------------------------------------------------------------------
// Host side.

using flash_internal::AllowSharedMemory;
using flash_internal::TileGrid;

absl::Status CheckDims(const char* what, int64_t b, int64_t t, int64_t c, int64_t nh, DType dtype,
                       Dims* d) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": dtype ", DTypeName(dtype), " is not supported; use F32 or BF16"));
  }
  if (absl::Status s = CheckCount(what, "b", b); !s.ok()) return s;
  if (absl::Status s = CheckCount(what, "t", t); !s.ok()) return s;
  if (absl::Status s = CheckCount(what, "c", c); !s.ok()) return s;
  if (nh <= 0 || c % nh != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": c ", c, " is not a positive multiple of nh ", nh));
  }
  if (c / nh > kMaxHeadSize) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": head size ", c / nh, " (c ", c,
                                                   " / nh ", nh, ") exceeds ", kMaxHeadSize,
                                                   "; use more heads or the naive attention"));
  }
  // Grid: x (tiles) up to 2^31 - 1, y (heads) and z (batch) up to 65535.
  if (nh > 65535 || b > 65535 || (t + kTile - 1) / kTile > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shape b ", b, " t ", t, " nh ", nh,
                                                   " exceeds the launch grid limits"));
  }
  d->t = t;
  d->c = c;
  d->nh = nh;
  d->hs = c / nh;
  d->scale = d->hs > 0 ? 1.0f / std::sqrt(static_cast<float>(d->hs)) : 0.0f;
  return absl::OkStatus();
}

template <typename S, int kTpr>
absl::Status Forward(void* out, float* lse, const void* qkv, int64_t b, const Dims& d,
                     cudaStream_t stream) {
  static constexpr char kWhat[] = "FlashAttentionForward";
  auto* kernel = FlashForwardKernel<S, kTpr>;
  if (absl::Status s = AllowSharedMemory(kernel, TileBytes<kTpr>(), kWhat); !s.ok()) return s;
  kernel<<<TileGrid(b, d), Place<kTpr>::kThreads, TileBytes<kTpr>(), stream>>>(
      static_cast<S*>(out), lse, static_cast<const S*>(qkv), d);
  return LaunchStatus(kWhat);
}

// dk, dv, then dq on CUDA cores (D already computed).
template <typename S, int kTpr>
absl::Status Backward(S* dqkv, const S* dout, const S* qkv, const float* lse, const float* dvec,
                      int64_t b, const Dims& d, cudaStream_t stream) {
  static constexpr char kWhat[] = "FlashAttentionBackward";
  auto* keys = FlashBackwardKeyKernel<S, kTpr>;
  if (absl::Status s = AllowSharedMemory(keys, KeyBytes<kTpr>(), kWhat); !s.ok()) return s;
  keys<<<TileGrid(b, d), Place<kTpr>::kThreads, KeyBytes<kTpr>(), stream>>>(dqkv, dout, qkv, lse,
                                                                            dvec, d);
  if (absl::Status s = LaunchStatus(kWhat); !s.ok()) return s;
  auto* queries = FlashBackwardQueryKernel<S, kTpr>;
  if (absl::Status s = AllowSharedMemory(queries, TileBytes<kTpr>(), kWhat); !s.ok()) return s;
  queries<<<TileGrid(b, d), Place<kTpr>::kThreads, TileBytes<kTpr>(), stream>>>(dqkv, dout, qkv,
                                                                                lse, dvec, d);
  return LaunchStatus(kWhat);
}

// Threads per row for head size hs: 32 components per lane.
int ThreadsPerRow(int64_t hs) { return hs <= 32 ? 1 : hs <= 64 ? 2 : 4; }

template <typename S>
absl::Status ForwardAs(void* out, float* lse, const void* qkv, int64_t b, const Dims& d,
                       cudaStream_t stream) {
  switch (ThreadsPerRow(d.hs)) {
    case 1:
      return Forward<S, 1>(out, lse, qkv, b, d, stream);
    case 2:
      return Forward<S, 2>(out, lse, qkv, b, d, stream);
    default:
      return Forward<S, 4>(out, lse, qkv, b, d, stream);
  }
}

// D = each row's dout . out into dvec, then the gradients on `kernels`.
template <typename S>
absl::Status BackwardAs(FlashKernels kernels, void* dqkv_v, const void* dout_v, const void* qkv_v,
                        const void* out, const float* lse, float* dvec, int64_t b, const Dims& d,
                        cudaStream_t stream) {
  S* dqkv = static_cast<S*>(dqkv_v);
  const S* dout = static_cast<const S*>(dout_v);
  const S* qkv = static_cast<const S*>(qkv_v);
  const int64_t rows = b * d.nh * d.t;
  constexpr int kRowThreads = 256;  // 8 rows per block
  FlashRowDotKernel<S><<<internal::GridFor(rows * 32, kRowThreads), kRowThreads, 0, stream>>>(
      dvec, dout, static_cast<const S*>(out), d, rows);
  if (absl::Status s = LaunchStatus("FlashAttentionBackward"); !s.ok()) return s;
  if (kernels == FlashKernels::kTensorCores) {
    if constexpr (std::is_same_v<S, float>) {
      return flash_internal::MmaBackward(dqkv, dout, qkv, lse, dvec, b, d, stream);
    } else {
      return flash_internal::WmmaBackward(dqkv, dout, qkv, lse, dvec, b, d, stream);
    }
  }
  switch (ThreadsPerRow(d.hs)) {
    case 1:
      return Backward<S, 1>(dqkv, dout, qkv, lse, dvec, b, d, stream);
    case 2:
      return Backward<S, 2>(dqkv, dout, qkv, lse, dvec, b, d, stream);
    default:
      return Backward<S, 4>(dqkv, dout, qkv, lse, dvec, b, d, stream);
  }
}

// Whether the tensor-core kernels take these arguments (INVALID_ARGUMENT
// saying why not) and, f32, whether the current GPU has the shared memory
// they ask for (FAILED_PRECONDITION; unknown without a GPU: the launch
// fails then).
absl::Status CheckTensorCores(const char* what, DType dtype, const Dims& d, const void* qkv,
                              const void* dout) {
  // CheckDims has taken F32 or BF16 only.
  if (absl::Status s = CheckTensorCoresHeadSize(d.hs, dtype); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", s.message(), "; use FlashKernels::kCudaCores"));
  }
  for (const void* p : {qkv, dout}) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the tensor-core kernels need qkv and dout 16-byte aligned (",
                       p == qkv ? "qkv" : "dout", " is not); use FlashKernels::kCudaCores"));
    }
  }
  if (dtype == DType::kF32) {  // the current device's shared memory
    int device = 0, most = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
            cudaSuccess) {
      cudaGetLastError();  // not sticky; the launch reports what is wrong
      return absl::OkStatus();
    }
    if (most < flash_internal::MmaSharedBytes()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": the f32 tensor-core kernels need ", flash_internal::MmaSharedBytes(),
          " bytes of shared memory per block and GPU ", device, " offers ", most,
          " (H100, H200 and A100 have enough); use FlashKernels::kCudaCores"));
    }
  }
  return absl::OkStatus();
}

// The kernels FlashAttentionForward / Backward run for these arguments: the
// dtype's default where it takes them, else the CUDA cores.
FlashKernels DefaultKernels(DType dtype, const Dims& d, const void* qkv, const void* dout) {
  const FlashKernels preferred = dtype == DType::kBF16 ? kDefaultBf16Kernels : kDefaultF32Kernels;
  if (preferred == FlashKernels::kTensorCores && CheckTensorCores("", dtype, d, qkv, dout).ok()) {
    return FlashKernels::kTensorCores;
  }
  return FlashKernels::kCudaCores;
}

// Checks what both implementations need; *skip when there is nothing to do.
absl::Status CheckCall(const char* what, int64_t b, int64_t t, int64_t c, int64_t nh, DType dtype,
                       std::initializer_list<std::pair<const char*, const void*>> buffers, Dims* d,
                       bool* skip) {
  if (absl::Status s = CheckDims(what, b, t, c, nh, dtype, d); !s.ok()) return s;
  *skip = b == 0 || t == 0 || c == 0;
  if (*skip) return absl::OkStatus();
  for (const auto& [name, p] : buffers) {
    if (absl::Status s = internal::CheckPointer(what, name, p); !s.ok()) return s;
  }
  return absl::OkStatus();
}

#endif  // ZEROSHARD_FLASH_ATTENTION_EMULATED

}  // namespace

#ifndef ZEROSHARD_FLASH_ATTENTION_EMULATED

absl::Status FlashAttentionForwardWith(FlashKernels kernels, void* out, float* lse, const void* qkv,
                                       int64_t b, int64_t t, int64_t c, int64_t nh, DType dtype,
                                       void* stream) {
  static constexpr char kWhat[] = "FlashAttentionForward";
  Dims d;
  bool skip = false;
  if (absl::Status s = CheckCall(kWhat, b, t, c, nh, dtype,
                                 {{"out", out}, {"lse", lse}, {"qkv", qkv}}, &d, &skip);
      !s.ok() || skip) {
    return s;
  }
  const cudaStream_t st = AsStream(stream);
  if (kernels == FlashKernels::kTensorCores) {
    if (absl::Status s = CheckTensorCores(kWhat, dtype, d, qkv, qkv); !s.ok()) return s;
    if (dtype == DType::kF32) {
      return flash_internal::MmaForward(static_cast<float*>(out), lse,
                                        static_cast<const float*>(qkv), b, d, st);
    }
    return flash_internal::WmmaForward(static_cast<uint16_t*>(out), lse,
                                       static_cast<const uint16_t*>(qkv), b, d, st);
  }
  if (dtype == DType::kBF16) return ForwardAs<uint16_t>(out, lse, qkv, b, d, st);
  return ForwardAs<float>(out, lse, qkv, b, d, st);
}

absl::Status FlashAttentionBackwardWith(FlashKernels kernels, void* dqkv, const void* dout,
                                        const void* qkv, const void* out, const float* lse,
                                        int64_t b, int64_t t, int64_t c, int64_t nh, DType dtype,
                                        void* stream) {
  static constexpr char kWhat[] = "FlashAttentionBackward";
  Dims d;
  bool skip = false;
  if (absl::Status s = CheckCall(
          kWhat, b, t, c, nh, dtype,
          {{"dqkv", dqkv}, {"dout", dout}, {"qkv", qkv}, {"out", out}, {"lse", lse}}, &d, &skip);
      !s.ok() || skip) {
    return s;
  }
  if (kernels == FlashKernels::kTensorCores) {
    if (absl::Status s = CheckTensorCores(kWhat, dtype, d, qkv, dout); !s.ok()) return s;
  }
  const cudaStream_t st = AsStream(stream);
  float* dvec = nullptr;  // D [B,NH,T]
  const size_t scratch_bytes = static_cast<size_t>(b * nh * t) * sizeof(float);
  if (absl::Status s = CudaErrorToStatus(
          cudaMallocAsync(reinterpret_cast<void**>(&dvec), scratch_bytes, st),
          absl::StrCat(kWhat, ": allocating ", scratch_bytes, " bytes of scratch"));
      !s.ok()) {
    return s;
  }
  absl::Status status =
      dtype == DType::kBF16
          ? BackwardAs<uint16_t>(kernels, dqkv, dout, qkv, out, lse, dvec, b, d, st)
          : BackwardAs<float>(kernels, dqkv, dout, qkv, out, lse, dvec, b, d, st);
  // Stream-ordered: freed after the kernels above have run.
  absl::Status freed = CudaErrorToStatus(cudaFreeAsync(dvec, st), "FlashAttentionBackward: free");
  return status.ok() ? freed : status;
}

absl::Status FlashAttentionForward(void* out, float* lse, const void* qkv, int64_t b, int64_t t,
                                   int64_t c, int64_t nh, DType dtype, void* stream) {
  Dims d;
  const FlashKernels kernels = CheckDims("", b, t, c, nh, dtype, &d).ok()
                                   ? DefaultKernels(dtype, d, qkv, qkv)
                                   : FlashKernels::kCudaCores;
  return FlashAttentionForwardWith(kernels, out, lse, qkv, b, t, c, nh, dtype, stream);
}

absl::Status FlashAttentionBackward(void* dqkv, const void* dout, const void* qkv, const void* out,
                                    const float* lse, int64_t b, int64_t t, int64_t c, int64_t nh,
                                    DType dtype, void* stream) {
  Dims d;
  const FlashKernels kernels = CheckDims("", b, t, c, nh, dtype, &d).ok()
                                   ? DefaultKernels(dtype, d, qkv, dout)
                                   : FlashKernels::kCudaCores;
  return FlashAttentionBackwardWith(kernels, dqkv, dout, qkv, out, lse, b, t, c, nh, dtype, stream);
}

#endif  // ZEROSHARD_FLASH_ATTENTION_EMULATED

}  // namespace gpu
}  // namespace zeroshard
