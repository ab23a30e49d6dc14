// Emulated CUDA (see cuda_emulation.h): the runtime API's names that
// worker/cuda/cuda_device.h and cuda_util.cuh declare against (never called
// by the emulated kernels).
#ifndef ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_RUNTIME_API_H_
#define ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_RUNTIME_API_H_
enum cudaError_t { cudaSuccess = 0, cudaErrorUnknown = 999 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
#endif  // ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_RUNTIME_API_H_
