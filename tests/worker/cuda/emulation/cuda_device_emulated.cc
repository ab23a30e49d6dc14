// Emulated CUDA (see cuda_emulation.h): worker/cuda/cuda_device.h's
// functions for the emulated tests, whose kernels' host code reports launch
// and allocation errors through CudaErrorToStatus (cuda_device.cc needs the
// real runtime). The same mapping of errors to codes as cuda_device.cc.
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_device.h"

namespace zeroshard {

absl::Status CheckCudaDevice(int device) {
  return absl::FailedPreconditionError(
      absl::StrCat("CUDA device ", device, ": the CPU emulation of CUDA has no device"));
}

absl::Status CudaErrorToStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorName(error), " (emulated)");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace zeroshard
