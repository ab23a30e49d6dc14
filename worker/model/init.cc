#include "worker/model/init.h"

#include <cmath>

namespace zeroshard {
namespace {

// SplitMix64's increment (2^64 / golden ratio, odd).
constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;

// 2^-53: turns the top 53 bits of a draw into a double in [0, 1).
constexpr double kTwoPowMinus53 = 1.0 / 9007199254740992.0;

// FNV-1a over the name bytes; SplitMix64Mix afterwards fixes its weak
// avalanche, so similar names ("h.1", "h.2") still land far apart.
uint64_t Fnv1a64(absl::string_view bytes) {
  uint64_t hash = 0xCBF29CE484222325ULL;
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 0x100000001B3ULL;
  }
  return hash;
}

// A double in [0, 1) from 64 random bits.
double UnitInterval(uint64_t bits) { return static_cast<double>(bits >> 11) * kTwoPowMinus53; }

}  // namespace

uint64_t SplitMix64Mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

uint64_t InitStreamKey(uint64_t seed, absl::string_view name) {
  return SplitMix64Mix(SplitMix64Mix(seed) ^ Fnv1a64(name));
}

uint64_t InitBits(uint64_t key, uint64_t counter) {
  // SplitMix64 state after counter+1 steps from `key` (wrapping arithmetic).
  return SplitMix64Mix(key + (counter + 1) * kGamma);
}

void FillUniform(uint64_t key, int64_t first_element, int64_t count, float low, float high,
                 float* out) {
  const double width = static_cast<double>(high) - static_cast<double>(low);
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t e = static_cast<uint64_t>(first_element + i);
    out[i] = static_cast<float>(low + width * UnitInterval(InitBits(key, e)));
  }
}

void FillNormal(uint64_t key, int64_t first_element, int64_t count, float mean, float stddev,
                float* out) {
  constexpr double kTwoPi = 6.283185307179586476925;
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t e = static_cast<uint64_t>(first_element + i);
    // u1 in (0, 1] so the log is finite; u2 in [0, 1).
    const double u1 = 1.0 - UnitInterval(InitBits(key, 2 * e));
    const double u2 = UnitInterval(InitBits(key, 2 * e + 1));
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
    out[i] = static_cast<float>(mean + stddev * z);
  }
}

void FillConstant(float value, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = value;
}

void FillInit(const InitRule& rule, uint64_t seed, absl::string_view name, int64_t first_element,
              int64_t count, float* out) {
  switch (rule.kind) {
    case InitRule::Kind::kUniform:
      FillUniform(InitStreamKey(seed, name), first_element, count, rule.a, rule.b, out);
      return;
    case InitRule::Kind::kNormal:
      FillNormal(InitStreamKey(seed, name), first_element, count, rule.a, rule.b, out);
      return;
    case InitRule::Kind::kConstant:
      FillConstant(rule.a, count, out);
      return;
  }
}

}  // namespace zeroshard
