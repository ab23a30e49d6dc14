// shard_worker's --blas_kernel decision, case by case (the re-execution with
// OPENBLAS_CORETYPE is tested with real processes in binaries_test).
#include "worker/model/blas_kernel.h"

#include <string>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

struct Case {
  const char* flag;
  const char* loaded;
  const char* cpu;
  const char* environment;
  const char* want;  // the kernel to set, "" to keep the loaded one
};

TEST(BlasKernelTest, KernelToSetByCase) {
  const Case cases[] = {
      // OpenBLAS older than the CPU fell back to SSE3: upgrade to what it runs.
      {"auto", "Prescott", "SkylakeX", nullptr, "SkylakeX"},
      {"auto", "Prescott", "Haswell", nullptr, "Haswell"},
      {"auto", "Sandybridge", "Haswell", nullptr, "Haswell"},
      // OpenBLAS's pick is as wide as the CPU (or wider, by its own model table).
      {"auto", "SkylakeX", "SkylakeX", nullptr, ""},
      {"auto", "Zen", "Haswell", nullptr, ""},
      {"auto", "SapphireRapids", "SkylakeX", nullptr, ""},
      // A CPU without AVX: nothing better to choose.
      {"auto", "Nehalem", "", nullptr, ""},
      // The environment and --blas_kernel=openblas always win.
      {"auto", "Prescott", "SkylakeX", "Prescott", ""},
      {"haswell", "Prescott", "SkylakeX", "Sandybridge", ""},
      {"openblas", "Prescott", "SkylakeX", nullptr, ""},
      // A forced name, unless it is the one loaded (names without case).
      {"Haswell", "SkylakeX", "SkylakeX", nullptr, "Haswell"},
      {"skylakex", "SkylakeX", "SkylakeX", nullptr, ""},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::string> got = KernelToSet(c.flag, c.loaded, c.cpu, c.environment);
    ASSERT_TRUE(got.ok()) << c.flag << " " << got.status();
    EXPECT_EQ(*got, c.want) << "flag " << c.flag << ", loaded " << c.loaded << ", cpu " << c.cpu
                            << ", environment " << (c.environment ? c.environment : "unset");
  }
}

TEST(BlasKernelTest, AnUnknownNameIsRefusedNamingIt) {
  absl::StatusOr<std::string> got = KernelToSet("Pentium5", "Prescott", "SkylakeX", nullptr);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("--blas_kernel=Pentium5"), std::string::npos);
}

TEST(BlasKernelTest, LevelsOrderTheExtensions) {
  EXPECT_EQ(KernelLevel("Prescott"), 0);
  EXPECT_EQ(KernelLevel("sandybridge"), 1);
  EXPECT_EQ(KernelLevel("Zen"), 2);
  EXPECT_EQ(KernelLevel("SkylakeX"), 3);
  EXPECT_EQ(KernelLevel("nonsense"), -1);
  // This process's own pick is one OpenBLAS has (whatever the CPU).
  EXPECT_GE(KernelLevel(BlasKernel()), 0) << BlasKernel();
}

}  // namespace
}  // namespace zeroshard
