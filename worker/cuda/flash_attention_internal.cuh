// Shared between the two implementations of flash_attention.h (private to
// //worker/cuda:cuda_kernels' .cu files): the CUDA-core kernels of
// flash_attention.cu (f32 or bf16 storage, any head size up to 128) and the
// tensor-core kernels of flash_attention_wmma.cu (bf16) and
// flash_attention_mma.cu (f32 as 3xTF32).
#ifndef ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_INTERNAL_CUH_
#define ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_INTERNAL_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_device.h"

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

// Rows of a block's tile in every kernel family (queries in the forward and
// the dq pass, keys in the dk/dv pass): grid x counts them.
constexpr int kFlashTile = 64;

// Head h of batch row b (grid y, z): its q row 0 in qkv (k, v at +C, +2C;
// rows 3C apart), its out / dout row 0 (rows C apart), its lse / D row 0.
struct HeadBase {
  int64_t qkv, out, lse;
};
__device__ __forceinline__ HeadBase ThisHead(const Dims& d) {
  const int64_t h = blockIdx.y, b = blockIdx.z;
  return HeadBase{b * d.t * 3 * d.c + h * d.hs, b * d.t * d.c + h * d.hs, (b * d.nh + h) * d.t};
}

// Without nvcc (tests/worker/cuda/emulation), no host side.
#ifndef ZEROSHARD_FLASH_ATTENTION_EMULATED

// The grid: a block per tile of kFlashTile rows, head, batch row.
inline dim3 TileGrid(int64_t b, const Dims& d) {
  return dim3(static_cast<unsigned int>((d.t + kFlashTile - 1) / kFlashTile),
              static_cast<unsigned int>(d.nh), static_cast<unsigned int>(b));
}

// Lets `kernel` use `bytes` of dynamic shared memory (an opt-in above 48 KiB;
// cheap, so done at every launch rather than tracked per device).
template <typename Kernel>
absl::Status AllowSharedMemory(Kernel kernel, size_t bytes, const char* what) {
  if (bytes <= 48 * 1024) return absl::OkStatus();
  return CudaErrorToStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(bytes)),
                           absl::StrCat(what, ": allowing ", bytes, " bytes of shared memory"));
}

#endif  // ZEROSHARD_FLASH_ATTENTION_EMULATED

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
// The most shared memory per block the f32 ones take (102.5 KiB: more than
// the 99 KiB of sm_86 and sm_89 cards, which run the sm_80 build).
int64_t MmaSharedBytes();
absl::Status MmaBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                         const float* dvec, int64_t b, const Dims& d, cudaStream_t stream);

}  // namespace flash_internal
}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_FLASH_ATTENTION_INTERNAL_CUH_
