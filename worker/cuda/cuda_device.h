// Host-side CUDA helpers shared by the GPU data plane: the device check every
// GPU entry point runs first, and CUDA errors as absl statuses.
#ifndef ZEROSHARD_WORKER_CUDA_CUDA_DEVICE_H_
#define ZEROSHARD_WORKER_CUDA_CUDA_DEVICE_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

// OK if CUDA device `device` (an index among the visible devices, i.e. after
// CUDA_VISIBLE_DEVICES) exists. Otherwise FAILED_PRECONDITION:
//   "no CUDA device found (cudaGetDeviceCount: cudaErrorNoDevice: ...);
//    --backend=gloo runs on CPUs"
// when the machine has no usable device or driver, or "CUDA device 3 not
// found: 2 visible ..." when the index is out of range; INVALID_ARGUMENT for a
// negative index. Does not change the calling thread's current device.
absl::Status CheckCudaDevice(int device);

// OK for cudaSuccess; otherwise a status whose message is
// "<what>: <cudaGetErrorName>: <cudaGetErrorString>". Out-of-memory is
// RESOURCE_EXHAUSTED, invalid arguments INVALID_ARGUMENT, a missing device or
// driver FAILED_PRECONDITION, anything else INTERNAL.
absl::Status CudaErrorToStatus(cudaError_t error, absl::string_view what);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUDA_DEVICE_H_
