// Fused causal self-attention through cuDNN's graph API (scaled dot-product
// attention, forward and backward; the cuDNN frontend's sdpa /
// sdpa_backward). Same packed layout as flash_attention.h: qkv [B,T,3C],
// out [B,T,C], lse [B,NH,T] f32 (cuDNN's softmax statistics: the natural log
// of each row's denominator over the scaled scores), bf16 storage only
// (cuDNN's fused attention takes fp16 / bf16).
//
// libcudnn is loaded on first use (a CPU run never loads it). Create returns
// UNAVAILABLE, saying which library could not be loaded and where it is
// looked for, when cuDNN is missing or too old; callers fall back to
// flash_attention.h. (FAILED_PRECONDITION: no device, or one older than
// compute capability 8.0.) Forward / Backward return INVALID_ARGUMENT for
// what cuDNN's fused attention does not take (head size not a multiple of 8
// or over 256, T < 2, misaligned pointers) and UNIMPLEMENTED when cuDNN
// refuses the shape on this GPU (head size over 128 before Hopper), both
// before anything is enqueued; a caller may fall back then too.
//
// One instance owns one cuDNN handle bound to one stream and device and
// caches one forward and one backward plan per shape; not thread-safe.
#ifndef ZEROSHARD_WORKER_CUDA_CUDNN_ATTENTION_H_
#define ZEROSHARD_WORKER_CUDA_CUDNN_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace zeroshard {
namespace gpu {

class CudnnAttention {
 public:
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(void* stream);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Builds (and caches) the forward and backward plans of this shape now,
  // rather than at the first Forward / Backward: where cuDNN has no engine
  // for it, or its runtime compiler is missing, this says so while the
  // caller can still choose another kernel, and the seconds a build can take
  // fall outside the timed steps. UNIMPLEMENTED / INTERNAL with cuDNN's
  // reason; INVALID_ARGUMENT for a shape CheckHeads would refuse or t < 2.
  absl::Status Prepare(int64_t b, int64_t t, int64_t c, int64_t nh);

  // out [B,T,C] and lse [B,NH,T] written; bf16 values are raw bits. lse
  // must be 16-byte aligned.
  absl::Status Forward(uint16_t* out, float* lse, const uint16_t* qkv, int64_t b, int64_t t,
                       int64_t c, int64_t nh);
  // dqkv [B,T,3C] written; out and lse are the forward's.
  absl::Status Backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv,
                        const uint16_t* out, const float* lse, int64_t b, int64_t t, int64_t c,
                        int64_t nh);

  // OK when cuDNN's fused attention takes heads of c / nh (a multiple of 8,
  // at most 256; Hopper is needed past 128); INVALID_ARGUMENT saying why
  // otherwise; UNAVAILABLE in a build without cuDNN. Needs no GPU.
  static absl::Status CheckHeads(int64_t c, int64_t nh);

  // The cuDNN library version loaded ("9.14.0"), for the benches' tables.
  static std::string LoadedVersion();

 private:
  struct State;
  explicit CudnnAttention(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUDNN_ATTENTION_H_
