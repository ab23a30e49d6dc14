// CudnnAttention on any machine (CI has no GPU): libcudnn is not mapped until
// it is asked for, shapes are checked before any device is touched, the
// forward and backward graphs pass the cuDNN frontend's validation for the
// GPUs we run on, and Create without a GPU is a clear error. Its numerics
// need a GPU: tests/gpu/cuda_cudnn_attention_check.
//
// The validation cases need libcudnn itself (its version steers the
// frontend), not a GPU; they are skipped, saying so, where it cannot be
// loaded (a machine with cuDNN's headers only).
#include <cuda_runtime_api.h>
#include <cudnn_version.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/cudnn_attention.h"
#include "worker/cuda/cudnn_attention_internal.h"

namespace zeroshard {
namespace gpu {
namespace {

bool CudnnMapped() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("libcudnn") != std::string::npos) return true;
  }
  return false;
}

// Taken before main(), so before any test could have loaded it.
const bool kMappedAtStart = CudnnMapped();

bool Has(const absl::Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

TEST(CudnnAttentionHostTest, LibcudnnIsNotMappedAtStartUp) {
  EXPECT_FALSE(kMappedAtStart) << "libcudnn is mapped before any cuDNN call: linked, not loaded";
}

TEST(CudnnAttentionHostTest, ShapesAreCheckedFirst) {
  using cudnn_internal::CheckShape;
  EXPECT_TRUE(CheckShape(8, 1024, 768, 12).ok());  // GPT-2 124M: HS 64
  EXPECT_TRUE(CheckShape(3, 37, 120, 3).ok());     // HS 40
  EXPECT_TRUE(CheckShape(1, 2, 256, 1).ok());      // HS 256, two positions

  const absl::Status zero_t = CheckShape(2, 0, 64, 2);
  EXPECT_EQ(zero_t.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(zero_t, "t 0")) << zero_t;

  // cuDNN's backward refuses s_q = s_kv = 1 (the frontend: "s_q = s_kv = 1 is
  // not supported"), so both directions do.
  const absl::Status one = CheckShape(2, 1, 64, 2);
  EXPECT_EQ(one.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(one, "t 1")) << one;

  const absl::Status heads = CheckShape(2, 16, 100, 3);
  EXPECT_EQ(heads.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(heads, "c 100 is not a multiple of nh 3")) << heads;

  const absl::Status odd = CheckShape(2, 16, 36, 3);  // HS 12
  EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(odd, "head size c / nh = 12")) << odd;
  EXPECT_TRUE(Has(odd, "flash_attention.h")) << odd;

  const absl::Status big = CheckShape(1, 16, 264, 1);  // HS 264 > 256
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Has(big, "264")) << big;
}

// Skips the calling test when libcudnn cannot be loaded here.
#define SKIP_WITHOUT_LIBCUDNN()                                  \
  do {                                                           \
    const absl::Status loaded = cudnn_internal::LoadCudnn();     \
    if (loaded.code() == absl::StatusCode::kUnavailable) {       \
      GTEST_SKIP() << "no libcudnn on this machine: " << loaded; \
    }                                                            \
    ASSERT_TRUE(loaded.ok()) << loaded;                          \
  } while (0)

TEST(CudnnAttentionHostTest, GraphsValidateOnAmpereAndHopper) {
  SKIP_WITHOUT_LIBCUDNN();
  for (int sm : {80, 90}) {
    EXPECT_TRUE(cudnn_internal::ValidateGraphs(8, 1024, 768, 12, sm).ok()) << "GPT-2, sm " << sm;
    EXPECT_TRUE(cudnn_internal::ValidateGraphs(3, 37, 120, 3, sm).ok()) << "HS 40, sm " << sm;
    EXPECT_TRUE(cudnn_internal::ValidateGraphs(2, 2, 16, 2, sm).ok()) << "T 2, HS 8, sm " << sm;
  }
  EXPECT_TRUE(cudnn_internal::ValidateGraphs(1, 64, 512, 2, 90).ok()) << "HS 256 on Hopper";
}

TEST(CudnnAttentionHostTest, HeadSizesCudnnRefusesAreUnimplementedWithItsReason) {
  SKIP_WITHOUT_LIBCUDNN();
  // HS 256 passes our check (Hopper takes it) but not cuDNN's before Hopper.
  const absl::Status ampere = cudnn_internal::ValidateGraphs(1, 64, 512, 2, 80);
  EXPECT_EQ(ampere.code(), absl::StatusCode::kUnimplemented) << ampere;
  EXPECT_TRUE(Has(ampere, "HS 256")) << ampere;
  EXPECT_TRUE(Has(ampere, "sm_80")) << ampere;
  EXPECT_TRUE(Has(ampere, "128")) << ampere;  // the frontend's limit, in its words
}

TEST(CudnnAttentionHostTest, LoadedVersionIsTheLibrarys) {
  SKIP_WITHOUT_LIBCUDNN();
  const std::string version = CudnnAttention::LoadedVersion();
  EXPECT_EQ(version.rfind(std::to_string(CUDNN_MAJOR) + ".", 0), 0u) << version;
}

// The frontend loads a CUDA runtime of its own; it must be the one this
// binary links (libcudart.so.12 would be taken first where both exist).
TEST(CudnnAttentionHostTest, TheFrontendIsPointedAtOurCudaRuntime) {
  SKIP_WITHOUT_LIBCUDNN();
  const char* name = std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME");
  ASSERT_NE(name, nullptr);
  EXPECT_EQ(std::string(name), "libcudart.so." + std::to_string(CUDART_VERSION / 1000));
}

TEST(CudnnAttentionHostTest, CreateWithoutAGpuIsAClearError) {
  if (CheckCudaDevice(0).ok()) {
    GTEST_SKIP() << "this machine has a GPU: tests/gpu/cuda_cudnn_attention_check covers Create";
  }
  auto attention = CudnnAttention::Create(nullptr);
  ASSERT_FALSE(attention.ok());
  // No device (FAILED_PRECONDITION, CheckCudaDevice's message) or, first, no
  // cuDNN (UNAVAILABLE naming the library).
  const absl::Status& s = attention.status();
  if (s.code() == absl::StatusCode::kUnavailable) {
    EXPECT_TRUE(Has(s, "libcudnn") || Has(s, "cuDNN")) << s;
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(Has(s, "CUDA device")) << s;
  }
}

}  // namespace
}  // namespace gpu
}  // namespace zeroshard
