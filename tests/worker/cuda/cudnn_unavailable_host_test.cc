// CudnnAttention where libcudnn cannot be loaded (here: ZEROSHARD_CUDNN_LIBRARY
// names a file that does not exist): every entry point says so, naming the
// library and what to do, and nothing crashes or stays half-loaded; once the
// library can be found, the next call loads it. Its own binary, so that no
// earlier test has loaded cuDNN into the process.
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"
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

bool Has(const absl::Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

TEST(CudnnUnavailableHostTest, EveryEntryPointSaysWhatIsMissingThenLoadsWhenItIsThere) {
  constexpr char kMissing[] = "/nonexistent/libcudnn.so.9";
  ASSERT_EQ(setenv(cudnn_internal::kLibraryEnv, kMissing, 1), 0);

  auto attention = CudnnAttention::Create(nullptr);
  ASSERT_FALSE(attention.ok());
  EXPECT_EQ(attention.status().code(), absl::StatusCode::kUnavailable) << attention.status();
  EXPECT_TRUE(Has(attention.status(), std::string("cannot load ") + kMissing))
      << attention.status();
  EXPECT_TRUE(Has(attention.status(), "LD_LIBRARY_PATH")) << attention.status();
  EXPECT_TRUE(Has(attention.status(), "nvidia/cudnn/lib")) << attention.status();

  // The graph validation must not reach the frontend without the library
  // (the frontend caches every symbol it resolves, missing ones too).
  const absl::Status validate = cudnn_internal::ValidateGraphs(2, 16, 64, 2, 90);
  EXPECT_EQ(validate.code(), absl::StatusCode::kUnavailable) << validate;
  EXPECT_EQ(CudnnAttention::LoadedVersion(), "");
  EXPECT_FALSE(CudnnMapped());

  // Found again (the default soname): the failure was not cached.
  ASSERT_EQ(unsetenv(cudnn_internal::kLibraryEnv), 0);
  const absl::Status loaded = cudnn_internal::LoadCudnn();
  if (loaded.code() == absl::StatusCode::kUnavailable) {
    GTEST_SKIP() << "no libcudnn on this machine for the second half: " << loaded;
  }
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_TRUE(CudnnMapped());
  EXPECT_NE(CudnnAttention::LoadedVersion(), "");
  EXPECT_TRUE(cudnn_internal::ValidateGraphs(2, 16, 64, 2, 90).ok());
}

}  // namespace
}  // namespace gpu
}  // namespace zeroshard
