// Elementwise math written so that GCC vectorizes the loops calling it
// (-O3 -fno-math-errno -fno-trapping-math, see layers' BUILD): no calls into
// libm, no branches.
#ifndef ZEROSHARD_WORKER_MODEL_FAST_MATH_H_
#define ZEROSHARD_WORKER_MODEL_FAST_MATH_H_

#include <cstdint>
#include <cstring>

namespace zeroshard {

// e^x for float x, relative error below 1e-7 (about 1 ulp) for x in
// [-87, 88]; inputs outside are clamped there (e^-87 ~ 1.6e-38, e^88 ~
// 1.7e38), so the result is never 0, denormal or infinite. The Cephes
// scheme: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial,
// 2^n by building the float's exponent bits.
inline float FastExp(float x) {
  // Comparisons rather than fmax/fmin, which GCC only inlines with
  // -ffinite-math-only. A NaN goes through and comes out NaN.
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * kLog2e + kRound) - kRound;
  // ln2 in two parts, so that n * kLn2Hi is exact.
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_FAST_MATH_H_
