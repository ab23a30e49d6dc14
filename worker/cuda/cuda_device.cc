#include "worker/cuda/cuda_device.h"

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::Status CudaErrorToStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), ": ", cudaGetErrorString(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidConfiguration:
      return absl::InvalidArgumentError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorNoKernelImageForDevice:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CheckCudaDevice(int device) {
  if (device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device index ", device, " is negative"));
  }
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    // Not a sticky error: clear it so later CUDA calls do not report it again.
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device found (cudaGetDeviceCount: ", cudaGetErrorName(error), ": ",
                     cudaGetErrorString(error), "); --backend=gloo runs on CPUs"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(
        "no CUDA device found (cudaGetDeviceCount: 0 devices); --backend=gloo runs on CPUs");
  }
  if (device >= count) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA device ", device, " not found: ", count,
        " visible (CUDA_VISIBLE_DEVICES=", visible == nullptr ? "<unset>" : visible, ")"));
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
