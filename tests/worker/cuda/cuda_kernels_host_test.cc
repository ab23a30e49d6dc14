// What //worker/cuda:cuda_kernels does without running a kernel, so that CI
// machines without a GPU check it: argument validation, empty inputs, and
// that a launch with no device is an error status naming the kernel (not a
// crash). The numerics are checked against the CPU kernels on a GPU machine
// by //tests/gpu:cuda_kernels_parity_check.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/cuda/kernels.h"

namespace zeroshard {
namespace gpu {
namespace {

using ::testing::HasSubstr;

bool HasDevice() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

// Never dereferenced: every call below fails or returns before launching.
float* const kFake = reinterpret_cast<float*>(0x1000);

TEST(CudaKernelsHostTest, EmptyInputsAreNoOps) {
  EXPECT_TRUE(GeluForward(nullptr, nullptr, 0, nullptr).ok());
  EXPECT_TRUE(GeluTanhBackward(nullptr, nullptr, nullptr, 0, nullptr).ok());
  EXPECT_TRUE(ReluForward(nullptr, nullptr, 0, nullptr).ok());
  EXPECT_TRUE(
      LayerNormForward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, nullptr).ok());
  EXPECT_TRUE(AttentionForward(nullptr, nullptr, nullptr, 0, 4, 8, 2, nullptr).ok());
  EXPECT_TRUE(EmbeddingBackward(nullptr, nullptr, nullptr, nullptr, 2, 0, 8, 10, nullptr).ok());
  EXPECT_TRUE(BiasGrad(nullptr, nullptr, 0, 4, DType::kBF16, nullptr).ok());
  EXPECT_TRUE(CastF32ToBF16(nullptr, nullptr, 0, nullptr).ok());
  EXPECT_TRUE(AdamStep(nullptr, nullptr, nullptr, nullptr, 0, AdamStepParams(), nullptr).ok());
}

TEST(CudaKernelsHostTest, BadArgumentsAreInvalidArgument) {
  auto code = [](const absl::Status& s) { return s.code(); };
  constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code(GeluForward(kFake, kFake, -1, nullptr)), kInvalid);
  EXPECT_EQ(code(GeluForward(nullptr, kFake, 4, nullptr)), kInvalid);
  EXPECT_EQ(code(MseForward(nullptr, kFake, kFake, 4, nullptr)), kInvalid);
  EXPECT_EQ(code(LayerNormBackward(kFake, kFake, kFake, kFake, kFake, kFake, kFake, kFake, 2, 4,
                                   nullptr)),
            kInvalid)
      << "dx aliasing dout must be rejected";
  EXPECT_EQ(code(AttentionForward(kFake, kFake, kFake, 1, 4, 10, 3, nullptr)), kInvalid)
      << "c not a multiple of nh";
  EXPECT_EQ(code(BiasAdd(kFake, kFake, 2, 2, DType::kI32, nullptr)), kInvalid);
  AdamStepParams params;
  params.step = 0;
  EXPECT_EQ(code(AdamStep(kFake, kFake, kFake, kFake, 4, params, nullptr)), kInvalid);
  params.step = 1;
  params.lr = -1.0;
  EXPECT_EQ(code(AdamStep(kFake, kFake, kFake, kFake, 4, params, nullptr)), kInvalid);
  absl::Status status = GeluForward(nullptr, kFake, 4, nullptr);
  EXPECT_THAT(std::string(status.message()), HasSubstr("GeluForward"));
}

TEST(CudaKernelsHostTest, LaunchWithoutDeviceIsAnErrorNamingTheKernel) {
  if (HasDevice()) GTEST_SKIP() << "this machine has a CUDA device";
  absl::Status status = GeluForward(kFake, kFake, 16, nullptr);
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(std::string(status.message()), HasSubstr("GeluForward: kernel launch: cuda"));
}

TEST(CudaKernelsHostTest, CublasWithoutDeviceIsFailedPrecondition) {
  if (HasDevice()) GTEST_SKIP() << "this machine has a CUDA device";
  auto linear = CublasLinear::Create(nullptr);
  EXPECT_EQ(linear.status().code(), absl::StatusCode::kFailedPrecondition) << linear.status();
}

}  // namespace
}  // namespace gpu
}  // namespace zeroshard
