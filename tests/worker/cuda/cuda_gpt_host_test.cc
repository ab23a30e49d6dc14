// CudaGptModel on any machine: arguments are checked before any device is
// touched. (Its numerics against the CPU GPT need a GPU:
// tests/gpu/cuda_gpt_parity_check, run by tests/gpu/run.sh.)
#include "gtest/gtest.h"
#include "worker/cuda/cuda_gpt.h"

namespace zeroshard {
namespace {

GptConfig Small() { return GptConfig{2, 2, 16, 32, 8}; }

TEST(CudaGptHostTest, CreateChecksItsArgumentsFirst) {
  auto no_batch = CudaGptModel::Create(Small(), 0, DType::kF32, nullptr);
  EXPECT_EQ(no_batch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_batch.status().message().find("max_batch"), std::string::npos) << no_batch.status();

  auto f16 = CudaGptModel::Create(Small(), 2, DType::kF16, nullptr);
  EXPECT_EQ(f16.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f16.status().message().find("F16"), std::string::npos) << f16.status();

  GptConfig bad = Small();
  bad.n_head = 3;  // 16 % 3 != 0
  auto heads = CudaGptModel::Create(bad, 2, DType::kBF16, nullptr);
  EXPECT_EQ(heads.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(heads.status().message().find("n_head"), std::string::npos) << heads.status();

  auto no_backend = CudaGptModel::Create(Small(), 2, DType::kF32, nullptr);
  EXPECT_EQ(no_backend.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_backend.status().message().find("backend"), std::string::npos)
      << no_backend.status();
}

}  // namespace
}  // namespace zeroshard
