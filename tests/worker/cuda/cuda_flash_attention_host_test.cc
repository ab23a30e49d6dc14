// What worker/cuda/flash_attention.h does without running a kernel, so that
// CI machines without a GPU check it: argument validation (each bad value
// named), empty inputs, and that a launch with no device is an error status
// naming the function. The numerics are checked against the CPU attention on
// a GPU machine by //tests/gpu:cuda_kernels_parity_check, and the algorithm
// on the host by //tests/worker/model:flash_attention_reference_test.
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/cuda/flash_attention.h"
#include "worker/cuda/flash_attention_variants.h"

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
void* const kFake = reinterpret_cast<void*>(0x1000);
float* const kFakeF = reinterpret_cast<float*>(0x1000);

TEST(FlashAttentionHostTest, EmptyInputsAreNoOps) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    EXPECT_TRUE(FlashAttentionForward(nullptr, nullptr, nullptr, 0, 4, 8, 2, dtype, nullptr).ok());
    EXPECT_TRUE(FlashAttentionForward(nullptr, nullptr, nullptr, 2, 0, 8, 2, dtype, nullptr).ok());
    EXPECT_TRUE(FlashAttentionBackward(nullptr, nullptr, nullptr, nullptr, nullptr, 2, 4, 0, 2,
                                       dtype, nullptr)
                    .ok());
  }
}

// The message names the function and the offending value.
void ExpectInvalid(const absl::Status& s, const std::string& what, const std::string& detail) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(what)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(detail)) << s;
}

TEST(FlashAttentionHostTest, BadShapesAndTypesAreInvalidArgument) {
  const std::string fwd = "FlashAttentionForward", bwd = "FlashAttentionBackward";
  ExpectInvalid(FlashAttentionForward(kFake, kFakeF, kFake, 1, 4, 8, 2, DType::kF16, nullptr), fwd,
                "dtype F16");
  ExpectInvalid(
      FlashAttentionBackward(kFake, kFake, kFake, kFake, kFakeF, 1, 4, 8, 2, DType::kI32, nullptr),
      bwd, "dtype I32");
  ExpectInvalid(FlashAttentionForward(kFake, kFakeF, kFake, 1, 4, 10, 3, DType::kF32, nullptr), fwd,
                "c 10 is not a positive multiple of nh 3");
  ExpectInvalid(FlashAttentionForward(kFake, kFakeF, kFake, 1, -4, 8, 2, DType::kF32, nullptr), fwd,
                "negative t -4");
  ExpectInvalid(FlashAttentionForward(kFake, kFakeF, kFake, 1, 4, 258, 2, DType::kBF16, nullptr),
                fwd, "head size 129");
  ExpectInvalid(FlashAttentionBackward(kFake, kFake, kFake, kFake, kFakeF, 70000, 4, 8, 2,
                                       DType::kF32, nullptr),
                bwd, "grid");
  // Head size 128 is the largest accepted: it fails later (no device) or runs.
  EXPECT_NE(FlashAttentionForward(kFake, kFakeF, kFake, 1, 4, 256, 2, DType::kF32, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FlashAttentionHostTest, NullBuffersAreNamed) {
  const std::string fwd = "FlashAttentionForward", bwd = "FlashAttentionBackward";
  ExpectInvalid(FlashAttentionForward(nullptr, kFakeF, kFake, 1, 4, 8, 2, DType::kF32, nullptr),
                fwd, "out is null");
  ExpectInvalid(FlashAttentionForward(kFake, nullptr, kFake, 1, 4, 8, 2, DType::kF32, nullptr), fwd,
                "lse is null");
  ExpectInvalid(FlashAttentionForward(kFake, kFakeF, nullptr, 1, 4, 8, 2, DType::kF32, nullptr),
                fwd, "qkv is null");
  ExpectInvalid(FlashAttentionBackward(nullptr, kFake, kFake, kFake, kFakeF, 1, 4, 8, 2,
                                       DType::kBF16, nullptr),
                bwd, "dqkv is null");
  ExpectInvalid(FlashAttentionBackward(kFake, nullptr, kFake, kFake, kFakeF, 1, 4, 8, 2,
                                       DType::kBF16, nullptr),
                bwd, "dout is null");
  ExpectInvalid(FlashAttentionBackward(kFake, kFake, kFake, nullptr, kFakeF, 1, 4, 8, 2,
                                       DType::kBF16, nullptr),
                bwd, "out is null");
  ExpectInvalid(FlashAttentionBackward(kFake, kFake, kFake, kFake, nullptr, 1, 4, 8, 2,
                                       DType::kBF16, nullptr),
                bwd, "lse is null");
}

// The tensor-core kernels refuse what they cannot take, saying why.
TEST(FlashAttentionHostTest, TensorCoresRefuseWhatTheyCannotTake) {
  const FlashKernels tc = FlashKernels::kTensorCores;
  const std::string fwd = "FlashAttentionForward", bwd = "FlashAttentionBackward";
  ExpectInvalid(
      FlashAttentionForwardWith(tc, kFake, kFakeF, kFake, 1, 4, 60, 3, DType::kBF16, nullptr), fwd,
      "multiples of 8 (16-byte rows) up to 128 with BF16, not 20");
  // F32 (3xTF32): head sizes multiples of 4, up to 64.
  ExpectInvalid(
      FlashAttentionForwardWith(tc, kFake, kFakeF, kFake, 1, 4, 30, 3, DType::kF32, nullptr), fwd,
      "multiples of 4 (16-byte rows) up to 64 with F32, not 10");
  ExpectInvalid(
      FlashAttentionForwardWith(tc, kFake, kFakeF, kFake, 1, 4, 256, 2, DType::kF32, nullptr), fwd,
      "up to 64 with F32, not 128");
  ExpectInvalid(FlashAttentionBackwardWith(tc, kFake, kFake, kFake, kFake, kFakeF, 1, 4, 160, 2,
                                           DType::kF32, nullptr),
                bwd, "up to 64 with F32, not 80");
  void* const f32_misaligned = reinterpret_cast<char*>(kFake) + 4;
  ExpectInvalid(FlashAttentionForwardWith(tc, kFake, kFakeF, f32_misaligned, 1, 4, 128, 2,
                                          DType::kF32, nullptr),
                fwd, "qkv is not");
  ExpectInvalid(FlashAttentionBackwardWith(tc, kFake, f32_misaligned, kFake, kFake, kFakeF, 1, 4,
                                           128, 2, DType::kF32, nullptr),
                bwd, "dout is not");
  void* const misaligned = reinterpret_cast<char*>(kFake) + 2;
  ExpectInvalid(
      FlashAttentionForwardWith(tc, kFake, kFakeF, misaligned, 1, 4, 128, 2, DType::kBF16, nullptr),
      fwd, "qkv is not");
  ExpectInvalid(FlashAttentionBackwardWith(tc, kFake, misaligned, kFake, kFake, kFakeF, 1, 4, 128,
                                           2, DType::kBF16, nullptr),
                bwd, "dout is not");
  // The same arguments on the CUDA cores pass the checks (and fail later
  // without a device, or run).
  EXPECT_NE(FlashAttentionForwardWith(FlashKernels::kCudaCores, kFake, kFakeF, kFake, 1, 4, 60, 3,
                                      DType::kBF16, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_NE(FlashAttentionForwardWith(FlashKernels::kCudaCores, kFake, kFakeF, kFake, 1, 4, 256, 2,
                                      DType::kF32, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FlashAttentionHostTest, WithoutDeviceIsAnErrorNamingTheFunction) {
  if (HasDevice()) GTEST_SKIP() << "this machine has a CUDA device";
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t c : {16, 64, 256}) {  // each thread-per-row variant (head sizes 8, 32, 128)
      absl::Status s = FlashAttentionForward(kFake, kFakeF, kFake, 1, 70, c, 2, dtype, nullptr);
      EXPECT_FALSE(s.ok());
      EXPECT_THAT(std::string(s.message()), HasSubstr("FlashAttentionForward")) << s;
      s = FlashAttentionBackward(kFake, kFake, kFake, kFake, kFakeF, 1, 70, c, 2, dtype, nullptr);
      EXPECT_FALSE(s.ok());
      EXPECT_THAT(std::string(s.message()), HasSubstr("FlashAttentionBackward")) << s;
      if (dtype == DType::kBF16 || c / 2 <= kFlashTensorCoresF32MaxHeadSize) {
        s = FlashAttentionForwardWith(FlashKernels::kTensorCores, kFake, kFakeF, kFake, 1, 70, c, 2,
                                      dtype, nullptr);
        EXPECT_FALSE(s.ok());
        EXPECT_THAT(std::string(s.message()), HasSubstr("FlashAttentionForward (tensor cores)"))
            << s;
      }
    }
  }
}

}  // namespace
}  // namespace gpu
}  // namespace zeroshard
