// Token + position embedding, forward and backward.
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
using internal::CheckCount;
using internal::GlobalStride;
using internal::GlobalThread;
using internal::GridFor;
using internal::kThreads;
using internal::LaunchStatus;

// out[b,t,j] = wte[tokens[b,t], j] + wpe[t, j]; NaN for an out-of-range token.
__global__ void EmbeddingForwardKernel(float* out, const int32_t* tokens, const float* wte,
                                       const float* wpe, int64_t t, int64_t c, int64_t v,
                                       int64_t total) {
  for (int64_t i = GlobalThread(); i < total; i += GlobalStride()) {
    const int64_t position = i / c;  // b * T + t
    const int64_t j = i % c;
    const int64_t token = tokens[position];
    if (token < 0 || token >= v) {
      out[i] = NAN;
    } else {
      out[i] = wte[token * c + j] + wpe[(position % t) * c + j];
    }
  }
}

// dwte[tokens[b,t], j] += dout[b,t,j]. Positions with the same token add into
// the same row concurrently, hence the atomics.
__global__ void EmbeddingBackwardTokenKernel(float* dwte, const float* dout, const int32_t* tokens,
                                             int64_t c, int64_t v, int64_t total) {
  for (int64_t i = GlobalThread(); i < total; i += GlobalStride()) {
    const int64_t token = tokens[i / c];
    if (token < 0 || token >= v) continue;
    atomicAdd(&dwte[token * c + i % c], dout[i]);
  }
}

// dwpe[t, j] += sum_b dout[b,t,j]: one thread per (t, j), in batch order.
__global__ void EmbeddingBackwardPositionKernel(float* dwpe, const float* dout, int64_t b,
                                                int64_t t, int64_t c) {
  const int64_t total = t * c;
  for (int64_t i = GlobalThread(); i < total; i += GlobalStride()) {
    float sum = 0.0f;
    for (int64_t bi = 0; bi < b; ++bi) sum += dout[bi * total + i];
    dwpe[i] += sum;
  }
}

absl::Status CheckShape(const char* what, int64_t b, int64_t t, int64_t c, int64_t v) {
  if (absl::Status s = CheckCount(what, "b", b); !s.ok()) return s;
  if (absl::Status s = CheckCount(what, "t", t); !s.ok()) return s;
  if (absl::Status s = CheckCount(what, "c", c); !s.ok()) return s;
  return CheckCount(what, "v", v);
}

}  // namespace

absl::Status EmbeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                              int64_t b, int64_t t, int64_t c, int64_t v, void* stream) {
  static constexpr char kWhat[] = "EmbeddingForward";
  if (absl::Status s = CheckShape(kWhat, b, t, c, v); !s.ok()) return s;
  const int64_t total = b * t * c;
  if (total == 0) return absl::OkStatus();
  if (out == nullptr || tokens == nullptr || wte == nullptr || wpe == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  EmbeddingForwardKernel<<<GridFor(total), kThreads, 0, AsStream(stream)>>>(out, tokens, wte, wpe,
                                                                            t, c, v, total);
  return LaunchStatus(kWhat);
}

absl::Status EmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                               int64_t b, int64_t t, int64_t c, int64_t v, void* stream) {
  static constexpr char kWhat[] = "EmbeddingBackward";
  if (absl::Status s = CheckShape(kWhat, b, t, c, v); !s.ok()) return s;
  const int64_t total = b * t * c;
  if (total == 0) return absl::OkStatus();
  if (dwte == nullptr || dwpe == nullptr || dout == nullptr || tokens == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  const cudaStream_t st = AsStream(stream);
  EmbeddingBackwardTokenKernel<<<GridFor(total), kThreads, 0, st>>>(dwte, dout, tokens, c, v,
                                                                    total);
  if (absl::Status s = LaunchStatus(kWhat); !s.ok()) return s;
  EmbeddingBackwardPositionKernel<<<GridFor(t * c), kThreads, 0, st>>>(dwpe, dout, b, t, c);
  return LaunchStatus(kWhat);
}

}  // namespace gpu
}  // namespace zeroshard
