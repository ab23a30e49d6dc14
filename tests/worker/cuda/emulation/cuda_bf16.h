// Emulated CUDA (see cuda_emulation.h): bf16 as its raw bits.
#ifndef ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_BF16_H_
#define ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_BF16_H_
#include <cstdint>
struct __nv_bfloat16 {
  uint16_t bits;
};
#endif  // ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_BF16_H_
