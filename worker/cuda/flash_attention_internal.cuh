// Shared between the two implementations of flash_attention.h (private to
// //worker/cuda:cuda_kernels' .cu files): the CUDA-core kernels of
// flash_attention.cu (f32 or bf16 storage, any head size up to 128) and the
// tensor-core kernels of flash_attention_wmma.cu (bf16) and
// flash_attention_mma.cu (f32 as 3xTF32).
#ifndef ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_INTERNAL_CUH_
#define ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_INTERNAL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace zeroshard {
namespace gpu {
namespace flash_internal {

struct Dims {
  int64_t t;    // sequence length
  int64_t c;    // model width
  int64_t nh;   // heads
  int64_t hs;   // head size, c / nh
  float scale;  // 1 / sqrt(hs)
};

// The tensor-core kernels, qkv and dout 16-byte aligned, shapes and
// pointers already checked, enqueued on `stream`: bf16 storage through wmma
// (flash_attention_wmma.cu; hs % 8 == 0, hs <= 128), f32 storage as 3xTF32
// through mma.sync (flash_attention_mma.cu; hs % 4 == 0, hs <= 64). The
// backward computes dk, dv and dq from D [B,NH,T] (each row's dout . out,
// already computed).
absl::Status WmmaForward(uint16_t* out, float* lse, const uint16_t* qkv, int64_t b, const Dims& d,
                         cudaStream_t stream);
absl::Status WmmaBackward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv,
                          const float* lse, const float* dvec, int64_t b, const Dims& d,
                          cudaStream_t stream);
absl::Status MmaForward(float* out, float* lse, const float* qkv, int64_t b, const Dims& d,
                        cudaStream_t stream);
absl::Status MmaBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                         const float* dvec, int64_t b, const Dims& d, cudaStream_t stream);

}  // namespace flash_internal
}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_INTERNAL_CUH_
