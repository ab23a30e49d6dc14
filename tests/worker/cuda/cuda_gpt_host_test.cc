// CudaGptModel on any machine: arguments are checked before any device is
// touched. (Its numerics against the CPU GPT need a GPU:
// tests/gpu/cuda_gpt_parity_check, run by tests/gpu/run.sh.)
#include "gtest/gtest.h"
#include "worker/cuda/cuda_gpt.h"

namespace zeroshard {
namespace {

GptConfig Small() { return GptConfig{2, 2, 16, 32, 8}; }

CudaGptOptions With(DType dtype,
                    CudaGptOptions::Attention attention = CudaGptOptions::Attention::kAuto) {
  CudaGptOptions o;
  o.matmul_dtype = dtype;
  o.attention = attention;
  return o;
}

TEST(CudaGptHostTest, CreateChecksItsArgumentsFirst) {
  auto no_batch = CudaGptModel::Create(Small(), 0, With(DType::kF32), nullptr);
  EXPECT_EQ(no_batch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_batch.status().message().find("max_batch"), std::string::npos) << no_batch.status();

  auto f16 = CudaGptModel::Create(Small(), 2, With(DType::kF16), nullptr);
  EXPECT_EQ(f16.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f16.status().message().find("F16"), std::string::npos) << f16.status();

  GptConfig bad = Small();
  bad.n_head = 3;  // 16 % 3 != 0
  auto heads = CudaGptModel::Create(bad, 2, With(DType::kBF16), nullptr);
  EXPECT_EQ(heads.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(heads.status().message().find("n_head"), std::string::npos) << heads.status();

  auto no_backend = CudaGptModel::Create(Small(), 2, With(DType::kF32), nullptr);
  EXPECT_EQ(no_backend.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_backend.status().message().find("backend"), std::string::npos)
      << no_backend.status();
}

// An attention kernel that cannot take the products' dtype is refused
// before any device work, naming the flag value that would work.
TEST(CudaGptHostTest, AttentionKernelMustTakeTheDtype) {
  using A = CudaGptOptions::Attention;
  auto cudnn_f32 = CudaGptModel::Create(Small(), 2, With(DType::kF32, A::kCudnn), nullptr);
  EXPECT_EQ(cudnn_f32.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cudnn_f32.status().message().find("--gpu_attention=flash"), std::string::npos)
      << cudnn_f32.status();
  // flash_tc takes f32 (as 3xTF32): Create gets as far as the null backend.
  auto tc_f32 = CudaGptModel::Create(Small(), 2, With(DType::kF32, A::kFlashTc), nullptr);
  EXPECT_NE(tc_f32.status().message().find("null backend"), std::string::npos) << tc_f32.status();
  auto naive_bf16 = CudaGptModel::Create(Small(), 2, With(DType::kBF16, A::kNaive), nullptr);
  EXPECT_EQ(naive_bf16.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(naive_bf16.status().message().find("f32 only"), std::string::npos)
      << naive_bf16.status();
}

// Head sizes a kernel cannot take: refused by name, or resolved around by
// kAuto (f32 heads past flash's 128 run the naive kernel; no backend is
// needed to see which, since Create stops at the null backend after).
TEST(CudaGptHostTest, HeadSizesPickTheKernel) {
  using A = CudaGptOptions::Attention;
  GptConfig wide = Small();
  wide.n_embd = 320;
  wide.n_head = 2;  // head size 160
  auto flash = CudaGptModel::Create(wide, 2, With(DType::kF32, A::kFlash), nullptr);
  EXPECT_EQ(flash.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(flash.status().message().find("head size 160 exceeds the flash kernel's 128"),
            std::string::npos)
      << flash.status();
  auto auto_f32 = CudaGptModel::Create(wide, 2, With(DType::kF32), nullptr);
  EXPECT_NE(auto_f32.status().message().find("null backend"), std::string::npos)
      << auto_f32.status();
  // flash_tc: head sizes up to 128 (multiples of 8) with bf16, up to 64
  // (multiples of 4) with f32.
  GptConfig h128 = Small();
  h128.n_embd = 256;
  h128.n_head = 2;
  auto tc_f32 = CudaGptModel::Create(h128, 2, With(DType::kF32, A::kFlashTc), nullptr);
  EXPECT_EQ(tc_f32.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tc_f32.status().message().find("multiples of 4 (16-byte rows) up to 64 with F32, "
                                           "not 128"),
            std::string::npos)
      << tc_f32.status();
  auto tc_bf16 = CudaGptModel::Create(h128, 2, With(DType::kBF16, A::kFlashTc), nullptr);
  EXPECT_NE(tc_bf16.status().message().find("null backend"), std::string::npos)
      << tc_bf16.status();
  GptConfig h12 = Small();
  h12.n_embd = 24;
  h12.n_head = 2;  // head size 12: a multiple of 4, not of 8
  auto tc12_f32 = CudaGptModel::Create(h12, 2, With(DType::kF32, A::kFlashTc), nullptr);
  EXPECT_NE(tc12_f32.status().message().find("null backend"), std::string::npos)
      << tc12_f32.status();
  auto tc12_bf16 = CudaGptModel::Create(h12, 2, With(DType::kBF16, A::kFlashTc), nullptr);
  EXPECT_EQ(tc12_bf16.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tc12_bf16.status().message().find("multiples of 8 (16-byte rows) up to 128 with BF16, not 12"),
            std::string::npos)
      << tc12_bf16.status();
  GptConfig odd = Small();
  odd.n_embd = 12;
  odd.n_head = 2;  // head size 6: not a multiple of 8 for cuDNN
  auto cudnn = CudaGptModel::Create(odd, 2, With(DType::kBF16, A::kCudnn), nullptr);
  if (cudnn.status().code() == absl::StatusCode::kInvalidArgument) {
    EXPECT_NE(cudnn.status().message().find("--gpu_attention=flash"), std::string::npos)
        << cudnn.status();
  } else {
    // A build without cuDNN cannot check head sizes: it fails at the backend.
    EXPECT_NE(cudnn.status().message().find("null backend"), std::string::npos) << cudnn.status();
  }
}

TEST(CudaGptHostTest, AttentionNamesRoundTrip) {
  using A = CudaGptOptions::Attention;
  for (A a : {A::kAuto, A::kCudnn, A::kFlash, A::kFlashTc, A::kNaive}) {
    absl::StatusOr<A> parsed = ParseAttention(AttentionName(a));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, a);
  }
  absl::StatusOr<A> bad = ParseAttention("xformers");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("expected auto, cudnn, flash, flash_tc or naive"),
            std::string::npos);
}

}  // namespace
}  // namespace zeroshard
