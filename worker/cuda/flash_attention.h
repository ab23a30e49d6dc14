// Fused causal self-attention of our own (FlashAttention-2's tiling and
// online softmax): the T x T scores never reach global memory. Same packed
// layout and conventions as kernels.h's AttentionForward / AttentionBackward
// (qkv [B,T,3C], out [B,T,C], C = NH * HS; device pointers, `stream` a
// cudaStream_t as void*, enqueued without waiting), with two differences:
//
//  - Storage in `dtype`, F32 or BF16 (raw bits), for qkv, out, dout and
//    dqkv alike; arithmetic is f32 in both (bf16 operands are widened
//    exactly, results rounded once to nearest even).
//  - Instead of the weights att [B,NH,T,T], the forward saves
//    lse [B,NH,T] (f32): the natural log of each row's softmax denominator
//    over the scaled scores, lse = m + log(sum_s exp(q.k_s / sqrt(HS) - m)),
//    from which the backward recomputes the weights tile by tile.
//
// Deterministic (no atomics): the backward runs one pass per key tile for
// dk, dv and one per query tile for dq. Head sizes up to 128.
#ifndef ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_H_
#define ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace zeroshard {
namespace gpu {

// The largest head size (C / NH) the kernels take.
inline constexpr int64_t kFlashAttentionMaxHeadSize = 128;

absl::Status FlashAttentionForward(void* out, float* lse, const void* qkv, int64_t b, int64_t t,
                                   int64_t c, int64_t nh, DType dtype, void* stream);

// dqkv [B,T,3C] written. `out` and `lse` are the forward's. Uses B*NH*T
// floats of scratch (each row's dout . out), allocated and freed on `stream`.
absl::Status FlashAttentionBackward(void* dqkv, const void* dout, const void* qkv, const void* out,
                                    const float* lse, int64_t b, int64_t t, int64_t c, int64_t nh,
                                    DType dtype, void* stream);

}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_H_
