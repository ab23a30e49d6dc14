// Helpers of the emulated kernel tests (*_emulated_test.cc): "device" buffers
// at a chosen alignment, F32 / BF16 tensors as floats, and per-element
// tolerance checks.
#ifndef ZEROSHARD_TESTS_WORKER_CUDA_EMULATED_TEST_UTIL_H_
#define ZEROSHARD_TESTS_WORKER_CUDA_EMULATED_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"

namespace zeroshard::emulated {

// n elements of `dtype` starting `offset_elements` after a 256-byte boundary
// (the CUDA allocator's alignment), so a kernel whose loads depend on the
// address (16-byte vectors) sees the address the test chooses.
class Buffer {
 public:
  Buffer(size_t n, DType dtype, size_t offset_elements = 0)
      : n_(n), dtype_(dtype), offset_(offset_elements * DTypeSize(dtype)) {
    const size_t bytes = (offset_ + std::max<size_t>(n, 1) * DTypeSize(dtype) + 255) / 256 * 256;
    base_ = static_cast<unsigned char*>(std::aligned_alloc(256, bytes));
    std::memset(base_, 0xff, bytes);  // NaN in both dtypes
  }
  Buffer(const std::vector<float>& v, DType dtype, size_t offset_elements = 0)
      : Buffer(v.size(), dtype, offset_elements) {
    Set(v);
  }
  ~Buffer() { std::free(base_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* get() const { return base_ + offset_; }
  float* f32() const { return static_cast<float*>(get()); }
  uint16_t* bits() const { return static_cast<uint16_t*>(get()); }

  void Set(const std::vector<float>& v) {
    for (size_t i = 0; i < n_; ++i) {
      if (dtype_ == DType::kF32) {
        f32()[i] = v[i];
      } else {
        bits()[i] = FloatToBF16(v[i]);
      }
    }
  }
  std::vector<float> Get() const {
    std::vector<float> out(n_);
    for (size_t i = 0; i < n_; ++i)
      out[i] = dtype_ == DType::kF32 ? f32()[i] : BF16ToFloat(bits()[i]);
    return out;
  }

 private:
  size_t n_;
  DType dtype_;
  size_t offset_;
  unsigned char* base_ = nullptr;
};

inline std::vector<float> Random(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// v as the dtype stores it (bf16: rounded to nearest even).
inline std::vector<float> RoundTo(std::vector<float> v, DType dtype) {
  if (dtype == DType::kBF16) {
    for (float& x : v) x = BF16ToFloat(FloatToBF16(x));
  }
  return v;
}

// Every element within its own tolerance (NaN matches NaN only); reports the
// count off and the worst.
inline ::testing::AssertionResult WithinTolerances(const std::vector<float>& got,
                                                   const std::vector<double>& want,
                                                   const std::vector<double>& tol,
                                                   const std::string& what) {
  if (got.size() != want.size() || tol.size() != want.size()) {
    return ::testing::AssertionFailure()
           << what << ": sizes " << got.size() << ", " << want.size() << ", " << tol.size();
  }
  size_t bad = 0, worst = 0;
  double worst_ratio = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i]) && std::isnan(got[i])) continue;
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= tol[i])) {
      ++bad;
      const double ratio = std::isnan(err) ? 1e300 : err / std::max(tol[i], 1e-300);
      if (ratio > worst_ratio) worst_ratio = ratio, worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << got.size() << " elements off; worst [" << worst
         << "] got " << got[worst] << " want " << want[worst] << " tolerance " << tol[worst] << " ("
         << worst_ratio << "x)";
}

}  // namespace zeroshard::emulated

#endif  // ZEROSHARD_TESTS_WORKER_CUDA_EMULATED_TEST_UTIL_H_
