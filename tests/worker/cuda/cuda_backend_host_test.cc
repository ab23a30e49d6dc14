// CudaBackend and the engine's GPU arithmetic kernels on a machine without a
// GPU: creation fails with the message shard_worker prints, and the new
// kernels reject bad arguments before touching a device. (On a GPU machine
// tests/gpu/run.sh runs the engine on this backend.)
#include <cuda_runtime_api.h>

#include "gtest/gtest.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/kernels.h"

namespace zeroshard {
namespace {

bool HasDevice() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  cudaGetLastError();
  return ok;
}

TEST(CudaBackendHostTest, CreateWithoutDeviceSaysSoAndPointsToGloo) {
  if (HasDevice()) GTEST_SKIP() << "this machine has a CUDA device";
  auto backend = CudaBackend::Create(0);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(backend.status().message().find("no CUDA device found"), std::string::npos)
      << backend.status();
  EXPECT_NE(backend.status().message().find("--backend=gloo runs on CPUs"), std::string::npos)
      << backend.status();
}

TEST(CudaBackendHostTest, NegativeDeviceIsInvalid) {
  EXPECT_EQ(CudaBackend::Create(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaBackendHostTest, ArithmeticKernelsCheckArgumentsFirst) {
  float x = 0;
  double out = 0;
  EXPECT_EQ(gpu::AddInto(&x, nullptr, DType::kF32, 4, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu::AddInto(&x, &x, DType::kF16, 1, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu::Scale(nullptr, 3, 2.0f, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu::Scale(&x, -1, 2.0f, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu::SquaredNorm(nullptr, &x, 1, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu::SquaredNorm(&out, nullptr, 5, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  // Zero elements: nothing to launch, nothing to fail.
  EXPECT_TRUE(gpu::AddInto(&x, &x, DType::kF32, 0, nullptr).ok());
  EXPECT_TRUE(gpu::Scale(&x, 0, 2.0f, nullptr).ok());
}

}  // namespace
}  // namespace zeroshard
