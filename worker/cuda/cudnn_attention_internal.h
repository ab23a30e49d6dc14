// The parts of cudnn_attention.cc that need no GPU, for its host-side test
// (tests/worker/cuda/cudnn_attention_host_test.cc): loading libcudnn, the
// shape checks, and building + validating the cuDNN graphs for a given GPU
// generation. Not for other callers: use cudnn_attention.h.
#ifndef ZEROSHARD_WORKER_CUDA_CUDNN_ATTENTION_INTERNAL_H_
#define ZEROSHARD_WORKER_CUDA_CUDNN_ATTENTION_INTERNAL_H_

#include <cstdint>

#include "absl/status/status.h"

namespace zeroshard {
namespace gpu {
namespace cudnn_internal {

// The environment variable naming the cuDNN library to load instead of
// libcudnn.so.<CUDNN_MAJOR> (a path, or another name for the loader).
inline constexpr char kLibraryEnv[] = "ZEROSHARD_CUDNN_LIBRARY";

// Loads libcudnn (once per process; a failure is retried on the next call)
// and hands it to the cuDNN frontend. UNAVAILABLE when it cannot be loaded,
// is not cuDNN 9, or was built for another CUDA major version than this
// binary, saying what to do.
absl::Status LoadCudnn();

// INVALID_ARGUMENT unless b, t, c, nh are positive, t >= 2, nh divides c and
// the head size c / nh is one cuDNN's fused attention takes (a multiple of 8,
// <= 256).
absl::Status CheckShape(int64_t b, int64_t t, int64_t c, int64_t nh);

// Builds the forward and backward graphs of this shape and validates them
// with the frontend as for a GPU of compute capability sm_version / 10
// (90: Hopper). Needs libcudnn (LoadCudnn), not a GPU. UNIMPLEMENTED with
// the frontend's message when cuDNN would refuse the graph.
absl::Status ValidateGraphs(int64_t b, int64_t t, int64_t c, int64_t nh, int sm_version);

}  // namespace cudnn_internal
}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUDNN_ATTENTION_INTERNAL_H_
