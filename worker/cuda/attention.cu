// Causal multi-head self-attention, forward and backward.
//
// Straightforward kernels, not flash attention: one thread block per
// (batch row, head, query position t). The block computes the t + 1 scores of
// its row into `att` (global memory, so T is not limited by shared memory),
// normalizes them, and sums the value vectors. Every reduction has a fixed
// order, so results are deterministic.
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_util.cuh"
#include "worker/cuda/kernels.h"

namespace zeroshard {
namespace gpu {
namespace {

using internal::AsStream;
using internal::BlockReduce;
using internal::CheckCount;
using internal::LaunchStatus;
using internal::MaxOp;
using internal::SumOp;

constexpr int kAttentionThreads = 128;

struct Dims {
  int64_t t;    // sequence length
  int64_t c;    // model width
  int64_t nh;   // heads
  int64_t hs;   // head size, c / nh
  float scale;  // 1 / sqrt(hs)
};

// Row (b, h, t) of the launch grid (x = t, y = h, z = b).
struct Row {
  int64_t b, h, t;
};
__device__ __forceinline__ Row ThisRow() {
  return Row{static_cast<int64_t>(blockIdx.z), static_cast<int64_t>(blockIdx.y),
             static_cast<int64_t>(blockIdx.x)};
}

// Pointer to head h's q (which = 0), k (1) or v (2) vector at position pos of
// batch row b in qkv [B,T,3C].
__device__ __forceinline__ const float* Qkv(const float* qkv, const Dims& d, int64_t b, int64_t pos,
                                            int64_t h, int which) {
  return qkv + (b * d.t + pos) * 3 * d.c + which * d.c + h * d.hs;
}

// Dynamic shared memory: this row's query vector (hs floats).
__global__ void AttentionForwardKernel(float* out, float* att, const float* qkv, Dims d) {
  extern __shared__ float q_shared[];
  const Row r = ThisRow();
  const float* q = Qkv(qkv, d, r.b, r.t, r.h, 0);
  for (int64_t i = threadIdx.x; i < d.hs; i += blockDim.x) q_shared[i] = q[i];
  __syncthreads();

  float* row = att + ((r.b * d.nh + r.h) * d.t + r.t) * d.t;
  // Scores for s <= t, scaled as the CPU GEMM scales them (alpha = scale).
  float local_max = -INFINITY;
  for (int64_t s = threadIdx.x; s <= r.t; s += blockDim.x) {
    const float* k = Qkv(qkv, d, r.b, s, r.h, 1);
    float dot = 0.0f;
    for (int64_t i = 0; i < d.hs; ++i) dot += q_shared[i] * k[i];
    const float score = d.scale * dot;
    row[s] = score;
    local_max = fmaxf(local_max, score);
  }
  const float max_score = BlockReduce(local_max, MaxOp(), -INFINITY);
  float local_sum = 0.0f;
  for (int64_t s = threadIdx.x; s <= r.t; s += blockDim.x) {
    const float e = expf(row[s] - max_score);
    row[s] = e;
    local_sum += e;
  }
  const float inv_sum = 1.0f / BlockReduce(local_sum, SumOp(), 0.0f);
  for (int64_t s = threadIdx.x; s < d.t; s += blockDim.x) {
    row[s] = s <= r.t ? row[s] * inv_sum : 0.0f;
  }
  __syncthreads();  // the row's weights, written by other threads, are read below

  // out_h[t, i] = sum_s att[t, s] v_s[i].
  float* out_row = out + (r.b * d.t + r.t) * d.c + r.h * d.hs;
  for (int64_t i = threadIdx.x; i < d.hs; i += blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = 0; s <= r.t; ++s) acc += row[s] * Qkv(qkv, d, r.b, s, r.h, 2)[i];
    out_row[i] = acc;
  }
}

// Row pass of the backward: for query t, datt_s = dout_t . v_s, then the
// softmax backward dscore_s = att_s (datt_s - sum_r att_r datt_r) into
// `dscore` (scratch, [B,NH,T,T], lower triangle only), then
// dq_t = scale sum_s dscore_s k_s. Dynamic shared memory: dout_t (hs floats).
__global__ void AttentionBackwardRowKernel(float* dqkv, float* dscore, const float* dout,
                                           const float* qkv, const float* att, Dims d) {
  extern __shared__ float dout_shared[];
  const Row r = ThisRow();
  const float* dout_t = dout + (r.b * d.t + r.t) * d.c + r.h * d.hs;
  for (int64_t i = threadIdx.x; i < d.hs; i += blockDim.x) dout_shared[i] = dout_t[i];
  __syncthreads();

  const int64_t row_offset = ((r.b * d.nh + r.h) * d.t + r.t) * d.t;
  const float* att_row = att + row_offset;
  float* dscore_row = dscore + row_offset;
  float local_dot = 0.0f;
  for (int64_t s = threadIdx.x; s <= r.t; s += blockDim.x) {
    const float* v = Qkv(qkv, d, r.b, s, r.h, 2);
    float datt = 0.0f;
    for (int64_t i = 0; i < d.hs; ++i) datt += dout_shared[i] * v[i];
    dscore_row[s] = datt;
    local_dot += att_row[s] * datt;
  }
  const float dot = BlockReduce(local_dot, SumOp(), 0.0f);
  for (int64_t s = threadIdx.x; s <= r.t; s += blockDim.x) {
    dscore_row[s] = att_row[s] * (dscore_row[s] - dot);
  }
  __syncthreads();

  float* dq = dqkv + (r.b * d.t + r.t) * 3 * d.c + r.h * d.hs;
  for (int64_t i = threadIdx.x; i < d.hs; i += blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = 0; s <= r.t; ++s) acc += dscore_row[s] * Qkv(qkv, d, r.b, s, r.h, 1)[i];
    dq[i] = d.scale * acc;
  }
}

// Column pass: for key/value position s (blockIdx.x), over the queries t >= s
// that attend to it: dk_s = scale sum_t dscore[t, s] q_t and
// dv_s = sum_t att[t, s] dout_t. Written, not accumulated.
__global__ void AttentionBackwardColumnKernel(float* dqkv, const float* dscore, const float* dout,
                                              const float* qkv, const float* att, Dims d) {
  const Row r = ThisRow();
  const int64_t s = r.t;
  const int64_t head_offset = (r.b * d.nh + r.h) * d.t * d.t;
  float* dk = dqkv + (r.b * d.t + s) * 3 * d.c + d.c + r.h * d.hs;
  float* dv = dk + d.c;
  for (int64_t i = threadIdx.x; i < d.hs; i += blockDim.x) {
    float dk_acc = 0.0f;
    float dv_acc = 0.0f;
    for (int64_t t = s; t < d.t; ++t) {
      const int64_t at = head_offset + t * d.t + s;
      dk_acc += dscore[at] * Qkv(qkv, d, r.b, t, r.h, 0)[i];
      dv_acc += att[at] * dout[(r.b * d.t + t) * d.c + r.h * d.hs + i];
    }
    dk[i] = d.scale * dk_acc;
    dv[i] = dv_acc;
  }
}

absl::Status CheckDims(const char* what, int64_t b, int64_t t, int64_t c, int64_t nh, Dims* d) {
  if (absl::Status s = CheckCount(what, "b", b); !s.ok()) return s;
  if (absl::Status s = CheckCount(what, "t", t); !s.ok()) return s;
  if (absl::Status s = CheckCount(what, "c", c); !s.ok()) return s;
  if (nh <= 0 || c % nh != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": c ", c, " is not a positive multiple of nh ", nh));
  }
  // Grid limits: x (t) up to 2^31 - 1, y (heads) and z (batch) up to 65535.
  if (t > 0x7fffffff || nh > 65535 || b > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shape b ", b, " t ", t, " nh ", nh,
                                                   " exceeds the launch grid limits"));
  }
  if (c / nh * static_cast<int64_t>(sizeof(float)) > 48 * 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": head size ", c / nh, " exceeds 48 KiB of shared memory"));
  }
  d->t = t;
  d->c = c;
  d->nh = nh;
  d->hs = c / nh;
  d->scale = d->hs > 0 ? 1.0f / std::sqrt(static_cast<float>(d->hs)) : 0.0f;
  return absl::OkStatus();
}

}  // namespace

absl::Status AttentionForward(float* out, float* att, const float* qkv, int64_t b, int64_t t,
                              int64_t c, int64_t nh, void* stream) {
  static constexpr char kWhat[] = "AttentionForward";
  Dims d;
  if (absl::Status s = CheckDims(kWhat, b, t, c, nh, &d); !s.ok()) return s;
  if (b == 0 || t == 0 || c == 0) return absl::OkStatus();
  if (out == nullptr || att == nullptr || qkv == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  const dim3 grid(static_cast<unsigned int>(t), static_cast<unsigned int>(nh),
                  static_cast<unsigned int>(b));
  AttentionForwardKernel<<<grid, kAttentionThreads, d.hs * sizeof(float), AsStream(stream)>>>(
      out, att, qkv, d);
  return LaunchStatus(kWhat);
}

absl::Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                               int64_t b, int64_t t, int64_t c, int64_t nh, void* stream) {
  static constexpr char kWhat[] = "AttentionBackward";
  Dims d;
  if (absl::Status s = CheckDims(kWhat, b, t, c, nh, &d); !s.ok()) return s;
  if (b == 0 || t == 0 || c == 0) return absl::OkStatus();
  if (dqkv == nullptr || dout == nullptr || qkv == nullptr || att == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  const cudaStream_t st = AsStream(stream);
  float* dscore = nullptr;
  const size_t scratch_bytes = static_cast<size_t>(b * nh * t * t) * sizeof(float);
  if (absl::Status s = CudaErrorToStatus(
          cudaMallocAsync(reinterpret_cast<void**>(&dscore), scratch_bytes, st),
          absl::StrCat(kWhat, ": allocating ", scratch_bytes, " bytes of scratch"));
      !s.ok()) {
    return s;
  }
  const dim3 grid(static_cast<unsigned int>(t), static_cast<unsigned int>(nh),
                  static_cast<unsigned int>(b));
  AttentionBackwardRowKernel<<<grid, kAttentionThreads, d.hs * sizeof(float), st>>>(
      dqkv, dscore, dout, qkv, att, d);
  absl::Status status = LaunchStatus(kWhat);
  if (status.ok()) {
    AttentionBackwardColumnKernel<<<grid, kAttentionThreads, 0, st>>>(dqkv, dscore, dout, qkv, att,
                                                                      d);
    status.Update(LaunchStatus(kWhat));
  }
  // Stream-ordered: freed after the kernels above have run.
  absl::Status freed = CudaErrorToStatus(cudaFreeAsync(dscore, st), "AttentionBackward: free");
  return status.ok() ? freed : status;
}

}  // namespace gpu
}  // namespace zeroshard
