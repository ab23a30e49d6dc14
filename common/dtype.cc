#include "common/dtype.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

struct DTypeRow {
  DType dtype;
  const char* name;
  int size;  // bytes
};

constexpr DTypeRow kDTypes[] = {
    {DType::kF32, "F32", 4},   {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},
    {DType::kF64, "F64", 8},   {DType::kI64, "I64", 8},   {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},   {DType::kI8, "I8", 1},     {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
};

uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float BitsFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace

int DTypeSize(DType dtype) {
  for (const DTypeRow& row : kDTypes) {
    if (row.dtype == dtype) return row.size;
  }
  return 0;  // unreachable for valid enum values
}

std::string DTypeName(DType dtype) {
  for (const DTypeRow& row : kDTypes) {
    if (row.dtype == dtype) return row.name;
  }
  return "UNKNOWN";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const DTypeRow& row : kDTypes) {
    if (name == row.name) return row.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype \"", name,
                   "\"; expected one of F32, BF16, F16, F64, I64, I32, I16, I8, U8, BOOL"));
}

uint16_t FloatToBF16(float value) {
  uint32_t bits = FloatBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    // NaN: keep sign and top payload bits, force quiet so truncation cannot
    // turn it into infinity.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Round to nearest even on the 16 dropped bits. A carry out of the mantissa
  // bumps the exponent, which is also correct (up to and including infinity).
  uint32_t lsb = (bits >> 16) & 1u;
  bits += 0x7fffu + lsb;
  return static_cast<uint16_t>(bits >> 16);
}

float BF16ToFloat(uint16_t bits) { return BitsFloat(static_cast<uint32_t>(bits) << 16); }

uint16_t FloatToF16(float value) {
  const uint32_t bits = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;

  if (abs >= 0x7f800000u) {
    if (abs == 0x7f800000u) return sign | 0x7c00u;  // infinity
    // NaN: quiet bit set, keep the top payload bits.
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x03ffu));
  }
  // 65520 = halfway between 65504 (max f16, odd mantissa) and 2^16: it and
  // everything above rounds to infinity.
  if (abs >= 0x477ff000u) return sign | 0x7c00u;

  if (abs < 0x38800000u) {
    // Below 2^-14: an f16 subnormal (units of 2^-24) or zero. The f32 value
    // is m * 2^(e - 150), so in units of 2^-24 it is m >> (126 - e).
    const uint32_t e = abs >> 23;
    if (e == 0) return sign;  // f32 zero/subnormal: far below 2^-25
    const uint32_t m = (abs & 0x007fffffu) | 0x00800000u;
    const uint32_t shift = 126 - e;  // >= 14
    if (shift > 24) return sign;     // < 2^-25: half of the smallest subnormal
    uint32_t result = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (result & 1u))) ++result;
    // result == 0x400 is the smallest normal; the encoding is the same.
    return static_cast<uint16_t>(sign | result);
  }

  // Normal: rebias the exponent (127 -> 15) and drop 13 mantissa bits with
  // round to nearest even; a carry into the exponent is correct.
  uint32_t result = (abs - 0x38000000u) >> 13;
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x03ffu;
  if (exp == 0) {
    if (mant == 0) return BitsFloat(sign);
    // Subnormal: mant * 2^-24, exact in f32.
    const float magnitude = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return BitsFloat(sign | FloatBits(magnitude));
  }
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

}  // namespace zeroshard
