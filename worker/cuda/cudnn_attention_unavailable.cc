// CudnnAttention in a build without cuDNN or its frontend (@local_cuda's
// CUDNN_AVAILABLE is False): Create says so, and the device GPT's kAuto falls
// back to the flash kernel. See third_party/cuda/cuda_configure.bzl for how
// cuDNN and the frontend are found (tools/install_deps.sh fetches the
// frontend's headers from PyPI; then `bazel sync --configure`).
#include "absl/status/status.h"
#include "worker/cuda/cudnn_attention.h"

namespace zeroshard {
namespace gpu {

struct CudnnAttention::State {};

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(void* /*stream*/) {
  return absl::UnavailableError(
      "cuDNN attention: this build has no cuDNN (the cuDNN frontend's headers or cudnn.h were "
      "not found when it was configured; tools/install_deps.sh fetches the frontend, then "
      "`bazel sync --configure` and rebuild); --gpu_attention=flash runs without it");
}

CudnnAttention::CudnnAttention(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudnnAttention::~CudnnAttention() = default;

absl::Status CudnnAttention::Prepare(int64_t, int64_t, int64_t, int64_t) {
  return absl::FailedPreconditionError("cuDNN attention: not built");
}

absl::Status CudnnAttention::Forward(uint16_t*, float*, const uint16_t*, int64_t, int64_t, int64_t,
                                     int64_t) {
  return absl::FailedPreconditionError("cuDNN attention: not built");
}

absl::Status CudnnAttention::Backward(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*,
                                      const float*, int64_t, int64_t, int64_t, int64_t) {
  return absl::FailedPreconditionError("cuDNN attention: not built");
}

absl::Status CudnnAttention::CheckHeads(int64_t, int64_t) {
  return absl::UnavailableError("cuDNN attention: this build has no cuDNN");
}

std::string CudnnAttention::LoadedVersion() { return ""; }

}  // namespace gpu
}  // namespace zeroshard
