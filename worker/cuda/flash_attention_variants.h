// The two implementations behind flash_attention.h, for the checks and the
// benchmark that compare them; models call flash_attention.h, which picks
// (bf16: the tensor cores where they take the arguments, see
// kDefaultBf16Kernels in flash_attention.cu; f32: the CUDA cores, until the
// 3xTF32 mma.sync kernels have been checked and timed on a GPU, see
// kDefaultF32Kernels).
//
//  - kCudaCores: f32 or bf16 storage, any head size up to 128; f32
//    arithmetic throughout (flash_attention.cu).
//  - kTensorCores: the products on tensor cores, f32 accumulation, qkv and
//    dout 16-byte aligned:
//     - bf16 storage, head size a multiple of 8 up to 128: wmma bf16, the
//       weights and score gradients rounded to bf16 to enter the products,
//       as FlashAttention-2 does (flash_attention_wmma.cu);
//     - f32 storage, head size a multiple of 4 up to 64: "3xTF32" (as
//       cutlass's OpMultiplyAddFastF32) through mma.sync, scores, weights
//       and accumulators in registers (flash_attention_mma.cu): every f32
//       operand, the weights and score gradients included, split into two
//       tf32 parts, each product taken as three tf32 products (relative
//       error under 3 * 2^-22 each, against f32 products' 2^-24), so
//       results stay at f32's accuracy.
//
// Same arguments, layout, results and errors as flash_attention.h; a kernel
// choice that cannot take the arguments is INVALID_ARGUMENT, saying why.
#ifndef ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_VARIANTS_H_
#define ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_VARIANTS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "worker/cuda/flash_attention.h"

namespace zeroshard {
namespace gpu {

enum class FlashKernels { kCudaCores, kTensorCores };

// The largest head size kTensorCores takes with F32 storage: the kernels pad
// head rows to 64 (flash_attention_mma.cu).
inline constexpr int64_t kFlashTensorCoresF32MaxHeadSize = 64;

// The head sizes kTensorCores takes with `dtype` storage (F32 or BF16): a
// multiple of 4 (F32) or 8 (BF16), so that rows are staged 16 bytes at a
// time, up to kFlashTensorCoresF32MaxHeadSize (F32) or
// kFlashAttentionMaxHeadSize (BF16). INVALID_ARGUMENT saying which rule
// head size `hs` breaks (callers add what to use instead).
inline absl::Status CheckTensorCoresHeadSize(int64_t hs, DType dtype) {
  const bool f32 = dtype == DType::kF32;
  const int64_t multiple = f32 ? 4 : 8;
  const int64_t largest = f32 ? kFlashTensorCoresF32MaxHeadSize : kFlashAttentionMaxHeadSize;
  if (hs % multiple != 0 || hs > largest) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tensor-core flash kernels take head sizes that are multiples of ",
                     multiple, " (16-byte rows) up to ", largest, " with ", DTypeName(dtype),
                     ", not ", hs, f32 ? " (the f32 kernels pad head rows to 64)" : ""));
  }
  return absl::OkStatus();
}

absl::Status FlashAttentionForwardWith(FlashKernels kernels, void* out, float* lse, const void* qkv,
                                       int64_t b, int64_t t, int64_t c, int64_t nh, DType dtype,
                                       void* stream);

absl::Status FlashAttentionBackwardWith(FlashKernels kernels, void* dqkv, const void* dout,
                                        const void* qkv, const void* out, const float* lse,
                                        int64_t b, int64_t t, int64_t c, int64_t nh, DType dtype,
                                        void* stream);

}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_VARIANTS_H_
