// A cuBLAS / cuBLASLt status as an absl::Status, for cublas_linear.cc and
// cublaslt_linear.cc (each builds the message with its own library's status
// names, since either library may be the only one loaded).
#ifndef ZEROSHARD_WORKER_CUDA_CUBLAS_STATUS_H_
#define ZEROSHARD_WORKER_CUDA_CUBLAS_STATUS_H_

#include <cublas_api.h>

#include <string>

#include "absl/status/status.h"

namespace zeroshard {
namespace gpu {

// OK for CUBLAS_STATUS_SUCCESS; otherwise `message` with the code that
// says what a caller can do: RESOURCE_EXHAUSTED (out of memory),
// INVALID_ARGUMENT (a value cuBLAS rejects), FAILED_PRECONDITION (not
// loaded, or not supported on this GPU), INTERNAL (the rest).
inline absl::Status CublasStatusToStatus(cublasStatus_t status, const std::string& message) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return absl::OkStatus();
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_INVALID_VALUE:
      return absl::InvalidArgumentError(message);
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUBLAS_STATUS_H_
