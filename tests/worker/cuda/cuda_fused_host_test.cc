// What the fused classifier (worker/cuda/classifier.h) and CublasLtLinear
// (worker/cuda/cublaslt_linear.h) do without a GPU: argument errors before
// any CUDA call (naming the value and what was expected), a no-device error
// rather than a crash, and libcublasLt left unmapped by a process that links
// CublasLtLinear but computes on the CPU. The numerics are checked on a GPU
// by //tests/gpu:cuda_fused_parity_check.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdint>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/cuda/classifier.h"
#include "worker/cuda/cublaslt_linear.h"

namespace zeroshard {
namespace gpu {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

bool HasDevice() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

bool CublasLtMapped() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("libcublasLt") != std::string::npos) return true;
  }
  return false;
}

// Never dereferenced: every call below fails or returns before launching.
void* const kFake = reinterpret_cast<void*>(0x10000);
float* const kFakeF = static_cast<float*>(kFake);
double* const kFakeD = reinterpret_cast<double*>(0x20000);
const int32_t* const kFakeTargets = reinterpret_cast<const int32_t*>(0x30000);

MATCHER_P2(IsInvalid, a, b, "") {
  return arg.code() == absl::StatusCode::kInvalidArgument &&
         std::string(arg.message()).find(a) != std::string::npos &&
         std::string(arg.message()).find(b) != std::string::npos;
}

TEST(ClassifierHostTest, BadArgumentsAreInvalidArgument) {
  EXPECT_THAT(ClassifierForward(nullptr, kFakeF, kFake, kFakeTargets, 4, 10, DType::kF32, nullptr),
              IsInvalid("ClassifierForward", "loss is null"));
  EXPECT_THAT(ClassifierForward(kFakeD, kFakeF, kFake, kFakeTargets, -1, 10, DType::kF32, nullptr),
              IsInvalid("negative n", "-1"));
  EXPECT_THAT(ClassifierForward(kFakeD, kFakeF, kFake, kFakeTargets, 4, -3, DType::kF32, nullptr),
              IsInvalid("negative v", "-3"));
  EXPECT_THAT(ClassifierForward(kFakeD, kFakeF, kFake, kFakeTargets, 4, 10, DType::kI32, nullptr),
              IsInvalid("logits dtype I32", "F32 and BF16"));
  EXPECT_THAT(ClassifierForward(kFakeD, kFakeF, kFake, kFakeTargets, 4, 0, DType::kBF16, nullptr),
              IsInvalid("v is 0", "4 rows"));
  EXPECT_THAT(ClassifierForward(kFakeD, nullptr, kFake, kFakeTargets, 4, 10, DType::kF32, nullptr),
              IsInvalid("null buffer", "lse null"));
  EXPECT_THAT(ClassifierBackward(kFake, kFake, nullptr, kFakeTargets, 4, 10, DType::kF32, nullptr),
              IsInvalid("ClassifierBackward", "null buffer"));
  EXPECT_THAT(ClassifierBackward(kFake, kFake, kFakeF, kFakeTargets, 4, 10, DType::kF16, nullptr),
              IsInvalid("ClassifierBackward", "F16"));
  EXPECT_THAT(ClassifierBackward(kFake, kFake, kFakeF, kFakeTargets, int64_t{1} << 32, 10,
                                 DType::kF32, nullptr),
              IsInvalid("exceeds the grid limit", "4294967296"));
}

TEST(ClassifierHostTest, RowStrideBelowVIsInvalidArgument) {
  EXPECT_THAT(ClassifierForward(kFakeD, kFakeF, kFake, kFakeTargets, 4, 50257, 50256, DType::kBF16,
                                nullptr),
              IsInvalid("ClassifierForward: ld 50256", "less than v 50257"));
  EXPECT_THAT(
      ClassifierBackward(kFake, kFake, kFakeF, kFakeTargets, 4, 10, -1, DType::kF32, nullptr),
      IsInvalid("ClassifierBackward: ld -1", "less than v 10"));
  // Checked with no rows too: the stride is wrong whatever the batch.
  EXPECT_THAT(
      ClassifierBackward(nullptr, nullptr, nullptr, nullptr, 0, 10, 9, DType::kF32, nullptr),
      IsInvalid("ld 9", "v 10"));
  EXPECT_TRUE(
      ClassifierBackward(nullptr, nullptr, nullptr, nullptr, 0, 50257, 50304, DType::kBF16, nullptr)
          .ok());
}

TEST(ClassifierHostTest, NoRowsIsANoOpForTheBackward) {
  EXPECT_TRUE(
      ClassifierBackward(nullptr, nullptr, nullptr, nullptr, 0, 50257, DType::kBF16, nullptr).ok());
}

TEST(ClassifierHostTest, NoDeviceIsAnErrorNotACrash) {
  if (HasDevice()) GTEST_SKIP() << "a device is present";
  const absl::Status s =
      ClassifierForward(kFakeD, kFakeF, kFake, kFakeTargets, 4, 10, DType::kF32, nullptr);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("ClassifierForward"));
}

CublasLtLinear::ForwardArgs GoodForward() {
  CublasLtLinear::ForwardArgs a;
  a.y = kFake;
  a.x = kFake;
  a.w = kFake;
  a.in_dtype = DType::kBF16;
  a.y_dtype = DType::kBF16;
  a.n = 8;
  a.in = 16;
  a.out = 24;
  return a;
}

TEST(CublasLtLinearHostTest, ForwardChecks) {
  EXPECT_TRUE(CublasLtLinear::CheckForward(GoodForward()).ok());
  auto a = GoodForward();
  a.residual = kFakeF;  // a residual needs an f32 y
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("residual needs y_dtype F32", "BF16"));
  a.y_dtype = DType::kF32;
  a.residual = static_cast<const float*>(a.y);  // in place is allowed
  EXPECT_TRUE(CublasLtLinear::CheckForward(a).ok());
  a.gelu_input = reinterpret_cast<void*>(0x40000);
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("residual and gelu_input", "one or"));

  a = GoodForward();
  a.gelu_input = a.y;
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("gelu_input aliases y", "apart"));
  a = GoodForward();
  a.in_dtype = DType::kF32;  // F32 operands, BF16 result: not a cuBLASLt combination
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("y_dtype BF16 with in_dtype F32", "F32"));
  a.in_dtype = DType::kF16;
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("in_dtype F16", "F32 or BF16"));
  a = GoodForward();
  a.in = 0;
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("in 0 out 24", "in >= 1"));
  a = GoodForward();
  a.out = -2;
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("negative shape", "out -2"));
  a = GoodForward();
  a.n = int64_t{1} << 31;
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("n 2147483648", "2^31 - 1"));
  a = GoodForward();
  a.x = nullptr;
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("Forward", "x is null"));
  a = GoodForward();
  a.w = reinterpret_cast<const void*>(0x10001);  // bf16 at an odd address
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("w at 0x10001", "2-byte elements"));
  a = GoodForward();
  a.bias = reinterpret_cast<const float*>(0x10002);
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("bias at 0x10002", "4-byte elements"));
  // Padded rows of y: ld_y >= out, and only for a plain product.
  a = GoodForward();
  a.ld_y = 64;
  EXPECT_TRUE(CublasLtLinear::CheckForward(a).ok());
  a.ld_y = 23;
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("ld_y 23 for out 24", "out <= ld_y"));
  a.ld_y = -8;
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("ld_y -8", "0 (packed)"));
  a.ld_y = int64_t{1} << 31;
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("ld_y 2147483648", "2^31 - 1"));
  a.ld_y = 64;
  a.gelu_input = reinterpret_cast<void*>(0x40000);
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("ld_y 64", "with gelu_input"));
  a.ld_y = 24;  // trivial: packed
  EXPECT_TRUE(CublasLtLinear::CheckForward(a).ok());
  a = GoodForward();
  a.y_dtype = DType::kF32;
  a.residual = kFakeF;
  a.ld_y = 32;
  EXPECT_THAT(CublasLtLinear::CheckForward(a), IsInvalid("ld_y 32", "with a residual"));
  // No rows: nothing is read, null buffers are fine.
  CublasLtLinear::ForwardArgs empty;
  empty.in = 4;
  empty.out = 4;
  EXPECT_TRUE(CublasLtLinear::CheckForward(empty).ok());
}

TEST(CublasLtLinearHostTest, BackwardChecks) {
  CublasLtLinear::BackwardInputArgs b;
  b.dx = kFake;
  b.dy = kFake;
  b.w = kFake;
  b.in_dtype = DType::kBF16;
  b.dx_dtype = DType::kBF16;
  b.n = 8;
  b.in = 32;
  b.out = 16;
  EXPECT_TRUE(CublasLtLinear::CheckBackwardInput(b).ok());
  b.gelu_bias_grad = kFakeF;
  EXPECT_THAT(CublasLtLinear::CheckBackwardInput(b),
              IsInvalid("gelu_bias_grad without gelu_input", "pass both"));
  b.gelu_input = b.dx;
  EXPECT_THAT(CublasLtLinear::CheckBackwardInput(b), IsInvalid("gelu_input aliases dx", "read"));
  b.gelu_input = reinterpret_cast<const void*>(0x50000);
  EXPECT_TRUE(CublasLtLinear::CheckBackwardInput(b).ok());
  b.dx_dtype = DType::kF32;  // mixed: bf16 operands, f32 gradient (gelu_input in f32 then)
  EXPECT_TRUE(CublasLtLinear::CheckBackwardInput(b).ok());
  b.in_dtype = DType::kF32;
  b.dx_dtype = DType::kBF16;
  EXPECT_THAT(CublasLtLinear::CheckBackwardInput(b), IsInvalid("dx_dtype BF16", "in_dtype F32"));
  b.dx_dtype = DType::kF32;
  b.ld_dy = 64;  // padded dy rows, with or without the GELU of dx
  EXPECT_TRUE(CublasLtLinear::CheckBackwardInput(b).ok());
  b.ld_dy = 15;
  EXPECT_THAT(CublasLtLinear::CheckBackwardInput(b),
              IsInvalid("BackwardInput: ld_dy 15 for out 16", "out <= ld_dy"));

  CublasLtLinear::BackwardWeightArgs w;
  w.dw = kFakeF;
  w.dy = kFake;
  w.x = kFake;
  w.in_dtype = DType::kBF16;
  w.n = 8;
  w.in = 32;
  w.out = 16;
  EXPECT_TRUE(CublasLtLinear::CheckBackwardWeight(w).ok());
  w.ld_dy = 50304;
  EXPECT_TRUE(CublasLtLinear::CheckBackwardWeight(w).ok());
  w.ld_dy = 8;
  EXPECT_THAT(CublasLtLinear::CheckBackwardWeight(w),
              IsInvalid("BackwardWeight: ld_dy 8 for out 16", "out <= ld_dy"));
  w.ld_dy = 0;
  w.db = reinterpret_cast<float*>(0x10006);
  EXPECT_THAT(CublasLtLinear::CheckBackwardWeight(w), IsInvalid("db at 0x10006", "4-byte"));
  w.db = nullptr;
  w.dw = nullptr;
  EXPECT_THAT(CublasLtLinear::CheckBackwardWeight(w), IsInvalid("BackwardWeight", "dw is null"));
  w.in_dtype = DType::kI8;
  EXPECT_THAT(CublasLtLinear::CheckBackwardWeight(w), IsInvalid("in_dtype I8", "F32 or BF16"));
}

TEST(CublasLtLinearHostTest, NoDeviceIsAnErrorAndLeavesCublasLtUnmapped) {
  if (HasDevice()) GTEST_SKIP() << "a device is present";
  EXPECT_FALSE(CublasLtMapped()) << "libcublasLt is mapped at start";
  auto linear = CublasLtLinear::Create(nullptr, /*tf32=*/false);
  EXPECT_FALSE(linear.ok());
  // The device check comes before the first cuBLASLt call: still unmapped.
  EXPECT_FALSE(CublasLtMapped()) << "a failed Create loaded libcublasLt";
}

}  // namespace
}  // namespace gpu
}  // namespace zeroshard
