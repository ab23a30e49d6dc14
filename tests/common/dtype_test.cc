#include "common/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint32_t ToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

TEST(DTypeTest, NamesSizesAndParsing) {
  const struct {
    DType dtype;
    const char* name;
    int size;
  } kCases[] = {{DType::kF32, "F32", 4},  {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},
                {DType::kF64, "F64", 8},  {DType::kI64, "I64", 8},   {DType::kI32, "I32", 4},
                {DType::kI16, "I16", 2},  {DType::kI8, "I8", 1},     {DType::kU8, "U8", 1},
                {DType::kBool, "BOOL", 1}};
  for (const auto& c : kCases) {
    EXPECT_EQ(DTypeName(c.dtype), c.name);
    EXPECT_EQ(DTypeSize(c.dtype), c.size) << c.name;
    absl::StatusOr<DType> parsed = ParseDType(c.name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, c.dtype);
  }
  for (const char* bad : {"f32", "FP32", "", "F8_E4M3"}) {
    absl::StatusOr<DType> parsed = ParseDType(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find(std::string("\"") + bad + "\""), std::string::npos)
        << parsed.status();
  }
}

TEST(BF16Test, ExactValues) {
  EXPECT_EQ(FloatToBF16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBF16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBF16(-0.0f), 0x8000);
  EXPECT_EQ(BF16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(BF16ToFloat(0xc049), FromBits(0xc0490000u));
}

TEST(BF16Test, RoundsToNearestEven) {
  // Halfway between 0x3f80 (even) and 0x3f81: down to even.
  EXPECT_EQ(FloatToBF16(FromBits(0x3f808000u)), 0x3f80);
  // Halfway between 0x3f81 (odd) and 0x3f82: up to even.
  EXPECT_EQ(FloatToBF16(FromBits(0x3f818000u)), 0x3f82);
  // Just off halfway goes to the nearer one.
  EXPECT_EQ(FloatToBF16(FromBits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(FloatToBF16(FromBits(0x3f817fffu)), 0x3f81);
  // Mantissa carry into the exponent: 1.99999... rounds to 2.
  EXPECT_EQ(FloatToBF16(FromBits(0x3fffffffu)), 0x4000);
  // The largest float rounds past the largest bf16 to infinity.
  EXPECT_EQ(FloatToBF16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBF16(FromBits(0x7f7f7fffu)), 0x7f7f);
}

TEST(BF16Test, InfAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBF16(inf), 0x7f80);
  EXPECT_EQ(FloatToBF16(-inf), 0xff80);
  EXPECT_TRUE(std::isinf(BF16ToFloat(0x7f80)));
  for (uint32_t nan_bits : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7fffffffu, 0x7f80ffffu}) {
    uint16_t b = FloatToBF16(FromBits(nan_bits));
    EXPECT_TRUE(std::isnan(BF16ToFloat(b))) << std::hex << nan_bits;
    EXPECT_EQ(b & 0x8000, (nan_bits >> 16) & 0x8000) << "sign kept";
  }
}

TEST(BF16Test, EveryValueRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    float f = BF16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(f))));
    } else {
      EXPECT_EQ(FloatToBF16(f), b) << std::hex << b;
    }
  }
}

// The result of converting `f` must be a nearest representable value, and the
// even one on a tie. `next_up` is the (virtual) value above the largest
// finite one, where rounding goes to infinity.
template <typename ToFn, typename FromFn>
void CheckNearestEven(float f, ToFn to, FromFn from, uint16_t max_finite, double next_up) {
  const uint16_t h = to(f);
  if (static_cast<double>(f) >= next_up) {
    ASSERT_EQ(h, max_finite + 1) << "f=" << f << " should overflow to infinity";
    return;
  }
  auto value = [&](int bits) -> double { return bits > max_finite ? next_up : from(bits); };
  const double x = f, got = value(h), err = std::fabs(got - x);
  if (h > 0) {
    const double down = std::fabs(value(h - 1) - x);
    ASSERT_LE(err, down) << "f=" << f << " bits=" << std::hex << h;
    if (err == down) {
      ASSERT_EQ(h & 1, 0) << "tie not to even, f=" << f;
    }
  }
  if (h <= max_finite) {
    const double up = std::fabs(value(h + 1) - x);
    ASSERT_LE(err, up) << "f=" << f << " bits=" << std::hex << h;
    if (err == up) {
      ASSERT_EQ(h & 1, 0) << "tie not to even, f=" << f;
    }
  }
}

TEST(BF16Test, NearestEvenOverSampledFloats) {
  // Every 97th positive finite float bit pattern, plus all of one binade.
  auto check = [](uint32_t bits) {
    CheckNearestEven(FromBits(bits), FloatToBF16, BF16ToFloat, 0x7f7f, std::ldexp(1.0, 128));
  };
  for (uint32_t bits = 0; bits < 0x7f800000u; bits += 97) check(bits);
  for (uint32_t bits = 0x3f800000u; bits < 0x40000000u; ++bits) check(bits);
}

TEST(F16Test, ExactValues) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToF16(0.0f), 0x0000);
  EXPECT_EQ(FloatToF16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(F16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(F16ToFloat(0x3555), FromBits(0x3eaaa000u));  // 0.33325195
}

TEST(F16Test, RoundingAndOverflow) {
  // 1 + 2^-11 is halfway between 1 (even) and 1 + 2^-10: down.
  EXPECT_EQ(FloatToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3 * 2^-11 is halfway between 0x3c01 (odd) and 0x3c02: up.
  EXPECT_EQ(FloatToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(FloatToF16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);  // tie with odd 65504: to infinity
  EXPECT_EQ(FloatToF16(-1e6f), 0xfc00);
}

TEST(F16Test, Subnormals) {
  const float tiny = std::ldexp(1.0f, -24);  // smallest f16 subnormal
  EXPECT_EQ(FloatToF16(tiny), 0x0001);
  EXPECT_EQ(F16ToFloat(0x0001), tiny);
  EXPECT_EQ(F16ToFloat(0x8001), -tiny);
  EXPECT_EQ(F16ToFloat(0x03ff), 1023 * tiny);  // largest subnormal
  EXPECT_EQ(FloatToF16(1023 * tiny), 0x03ff);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  // Ties: half the smallest subnormal goes to 0 (even), 1.5 of it to 2.
  EXPECT_EQ(FloatToF16(tiny / 2), 0x0000);
  EXPECT_EQ(FloatToF16(-tiny / 2), 0x8000);
  EXPECT_EQ(FloatToF16(tiny * 1.5f), 0x0002);
  EXPECT_EQ(FloatToF16(tiny * 2.5f), 0x0002);
  EXPECT_EQ(FloatToF16(tiny / 2 * 1.0001f), 0x0001);
  // Between the largest subnormal and the smallest normal: tie up to even.
  EXPECT_EQ(FloatToF16(1023.5f * tiny), 0x0400);
  // Far below, including f32 subnormals: signed zero.
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(FloatToF16(-std::numeric_limits<float>::denorm_min()), 0x8000);
}

TEST(F16Test, InfAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToF16(inf), 0x7c00);
  EXPECT_EQ(FloatToF16(-inf), 0xfc00);
  EXPECT_EQ(F16ToFloat(0x7c00), inf);
  EXPECT_EQ(F16ToFloat(0xfc00), -inf);
  for (uint32_t nan_bits : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    uint16_t h = FloatToF16(FromBits(nan_bits));
    EXPECT_TRUE(std::isnan(F16ToFloat(h))) << std::hex << nan_bits;
    EXPECT_EQ(h & 0x8000, (nan_bits >> 16) & 0x8000) << "sign kept";
  }
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7c01)));
  EXPECT_TRUE(std::isnan(F16ToFloat(0xfe00)));
}

TEST(F16Test, EveryValueRoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = F16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(f))));
    } else {
      EXPECT_EQ(FloatToF16(f), h) << std::hex << h;
      // Sign bit agrees (catches -0.0 too).
      EXPECT_EQ(ToBits(f) >> 31, h >> 15);
    }
  }
}

TEST(F16Test, NearestEvenOverSampledFloats) {
  auto check = [](uint32_t bits) {
    CheckNearestEven(FromBits(bits), FloatToF16, F16ToFloat, 0x7bff, 65536.0);
  };
  for (uint32_t bits = 0; bits < 0x7f800000u; bits += 97) check(bits);
  // All floats around the subnormal/normal boundary and in [1, 2).
  for (uint32_t bits = 0x33000000u; bits < 0x38800100u; bits += 3) check(bits);
  for (uint32_t bits = 0x3f800000u; bits < 0x40000000u; ++bits) check(bits);
}

}  // namespace
}  // namespace zeroshard
