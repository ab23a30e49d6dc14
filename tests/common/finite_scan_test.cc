// FirstNonFiniteF32 on every kind of non-finite value, at the block edges
// of its fast pass, and unaligned.
#include "common/finite_scan.h"

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(FirstNonFiniteF32Test, FiniteValuesAllPassTheLargestIncluded) {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, FLT_MAX, -FLT_MAX, FLT_MIN, 1e-45f /* denormal */};
  EXPECT_EQ(FirstNonFiniteF32(v.data(), static_cast<int64_t>(v.size())), -1);
  EXPECT_EQ(FirstNonFiniteF32(nullptr, 0), -1);
}

TEST(FirstNonFiniteF32Test, FindsTheFirstNaNOrInfWhereverItIs) {
  const float bad[] = {
      std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::signaling_NaN(),
      -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
      -std::numeric_limits<float>::infinity()};
  // Around the 4096-value blocks of the fast pass, and far into a later one.
  for (int64_t at : {0, 1, 4095, 4096, 4097, 9000, 12287}) {
    for (float b : bad) {
      std::vector<float> v(12288, 0.5f);
      v[at] = b;
      if (at + 1 < 12288) v[at + 1] = b;  // a later one does not hide the first
      EXPECT_EQ(FirstNonFiniteF32(v.data(), static_cast<int64_t>(v.size())), at) << b;
    }
  }
}

TEST(FirstNonFiniteF32Test, ReadsUnalignedBytes) {
  std::vector<char> bytes(4 * 100 + 1, 0);
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(bytes.data() + 1 + 4 * 37, &inf, 4);
  EXPECT_EQ(FirstNonFiniteF32(bytes.data() + 1, 100), 37);
}

TEST(NonFiniteTensorErrorTest, IsMarkedAndNamesTheTensorAndElement) {
  const absl::Status s = NonFiniteTensorError("shard of job j step 3 rank 1", "params/w", 7, NAN);
  EXPECT_TRUE(absl::IsFailedPrecondition(s));
  EXPECT_TRUE(IsNonFiniteTensorError(s));
  EXPECT_FALSE(IsNonFiniteTensorError(absl::FailedPreconditionError("other")));
  EXPECT_NE(
      s.message().find("shard of job j step 3 rank 1: tensor params/w holds nan at element 7"),
      std::string::npos)
      << s;
}

}  // namespace
}  // namespace zeroshard
