// Helpers for the GPU checks in tests/gpu: device buffers, deterministic
// random inputs, tolerant comparisons, and a main() that refuses to run
// without a GPU.
#ifndef ZEROSHARD_TESTS_GPU_GPU_TEST_UTIL_H_
#define ZEROSHARD_TESTS_GPU_GPU_TEST_UTIL_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "worker/cuda/cuda_device.h"

namespace zeroshard {
namespace gpu_test {

// Test-setup CUDA failures are not what the checks are about: stop loudly.
inline void CudaOrDie(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s: %s\n", what, cudaGetErrorName(error), cudaGetErrorString(error));
  std::abort();
}

// `n` elements of T in device memory of the current device.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    CudaOrDie(cudaMalloc(reinterpret_cast<void**>(&data_), std::max<size_t>(n, 1) * sizeof(T)),
              "cudaMalloc");
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { Upload(host); }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return data_; }
  size_t size() const { return n_; }

  void Upload(const std::vector<T>& host) {
    CudaOrDie(cudaMemcpy(data_, host.data(), std::min(host.size(), n_) * sizeof(T),
                         cudaMemcpyHostToDevice),
              "cudaMemcpy to device");
  }
  // Waits for all work on the device first, so results of any stream count.
  std::vector<T> Download() const {
    CudaOrDie(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::vector<T> host(n_);
    CudaOrDie(cudaMemcpy(host.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost),
              "cudaMemcpy to host");
    return host;
  }

 private:
  size_t n_;
  T* data_ = nullptr;
};

// Uniform floats in [lo, hi) from a fixed seed.
inline std::vector<float> RandomFloats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

inline std::vector<int32_t> RandomInts(size_t n, uint32_t seed, int32_t lo, int32_t hi) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(lo, hi);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = dist(rng);
  return v;
}

// Every element within atol + rtol * |want|; reports the worst one and how
// many differ.
inline ::testing::AssertionResult AllNear(const std::vector<float>& got,
                                          const std::vector<float>& want, float atol, float rtol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << got.size() << " vs " << want.size();
  }
  size_t bad = 0, worst = 0;
  double worst_excess = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_nan = std::isnan(got[i]) && std::isnan(want[i]);
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double allowed = atol + rtol * std::fabs(want[i]);
    if (both_nan) continue;
    if (!(err <= allowed)) {
      ++bad;
      const double excess = std::isnan(err) ? 1e300 : err - allowed;
      if (bad == 1 || excess > worst_excess) {
        worst_excess = excess;
        worst = i;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements differ; worst at [" << worst << "]: got "
         << got[worst] << ", want " << want[worst] << " (atol " << atol << ", rtol " << rtol << ")";
}

// main() for the GPU checks: runs the tests only when CUDA device 0 exists,
// otherwise prints CheckCudaDevice's message and fails.
inline int RunIfGpu(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  absl::Status device = CheckCudaDevice(0);
  if (!device.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], std::string(device.message()).c_str());
    return 1;
  }
  return RUN_ALL_TESTS();
}

}  // namespace gpu_test
}  // namespace zeroshard

#endif  // ZEROSHARD_TESTS_GPU_GPU_TEST_UTIL_H_
