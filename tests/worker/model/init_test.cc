#include "worker/model/init.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(InitTest, StreamKeysDependOnSeedAndName) {
  EXPECT_EQ(InitStreamKey(7, "0.weight"), InitStreamKey(7, "0.weight"));
  EXPECT_NE(InitStreamKey(7, "0.weight"), InitStreamKey(8, "0.weight"));
  EXPECT_NE(InitStreamKey(7, "0.weight"), InitStreamKey(7, "0.bias"));
  EXPECT_NE(InitStreamKey(7, "transformer.h.1.ln_1.weight"),
            InitStreamKey(7, "transformer.h.2.ln_1.weight"));
}

TEST(InitTest, UniformPartsEqualWhole) {
  const uint64_t key = InitStreamKey(42, "t");
  const int64_t n = 1000;
  std::vector<float> whole(n), parts(n);
  FillUniform(key, 0, n, -0.5f, 0.5f, whole.data());
  FillUniform(key, 0, 333, -0.5f, 0.5f, parts.data());
  FillUniform(key, 333, 1, -0.5f, 0.5f, parts.data() + 333);
  FillUniform(key, 334, n - 334, -0.5f, 0.5f, parts.data() + 334);
  EXPECT_EQ(whole, parts);
}

TEST(InitTest, UniformBoundsAndMoments) {
  const int64_t n = 200000;
  std::vector<float> v(n);
  FillUniform(InitStreamKey(1, "u"), 0, n, -0.25f, 0.75f, v.data());
  double sum = 0, sq = 0;
  for (float x : v) {
    ASSERT_GE(x, -0.25f);
    ASSERT_LE(x, 0.75f);
    sum += x;
    sq += x * x;
  }
  const double mean = sum / n;
  EXPECT_NEAR(mean, 0.25, 0.005);
  EXPECT_NEAR(sq / n - mean * mean, 1.0 / 12.0, 0.002);  // variance of U(a, a+1)
}

TEST(InitTest, NormalPartsEqualWholeAndMoments) {
  const uint64_t key = InitStreamKey(3, "n");
  const int64_t n = 200000;
  std::vector<float> whole(n), parts(n);
  FillNormal(key, 0, n, 1.0f, 2.0f, whole.data());
  FillNormal(key, 0, 12345, 1.0f, 2.0f, parts.data());
  FillNormal(key, 12345, n - 12345, 1.0f, 2.0f, parts.data() + 12345);
  EXPECT_EQ(whole, parts);
  double sum = 0, sq = 0;
  int64_t beyond_3_sigma = 0;
  for (float x : whole) {
    ASSERT_TRUE(std::isfinite(x));
    sum += x;
    sq += double{x} * x;
    beyond_3_sigma += std::fabs(x - 1.0f) > 6.0f;
  }
  const double mean = sum / n;
  EXPECT_NEAR(mean, 1.0, 0.02);
  EXPECT_NEAR(std::sqrt(sq / n - mean * mean), 2.0, 0.02);
  // P(|z| > 3) = 0.27%.
  EXPECT_NEAR(static_cast<double>(beyond_3_sigma) / n, 0.0027, 0.0006);
}

TEST(InitTest, FillInitRules) {
  std::vector<float> a(10), b(10);
  FillInit(InitRule::Constant(1.5f), 0, "x", 0, 10, a.data());
  EXPECT_EQ(a, std::vector<float>(10, 1.5f));
  FillInit(InitRule::Normal(0, 1), 9, "x", 0, 10, a.data());
  FillNormal(InitStreamKey(9, "x"), 0, 10, 0, 1, b.data());
  EXPECT_EQ(a, b);
  FillInit(InitRule::Uniform(-1, 1), 9, "x", 5, 10, a.data());
  FillUniform(InitStreamKey(9, "x"), 5, 10, -1, 1, b.data());
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace zeroshard
