// The host backend: plain loops over host memory (vectorized at -O3).
#include <cstdlib>
#include <cstring>

#include "worker/zero/backend.h"

namespace zeroshard {
namespace {

class CpuBackendImpl : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  bool host_accessible() const override { return true; }

  void* Allocate(int64_t bytes) override {
    return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  }
  void Free(void* data, int64_t) override { std::free(data); }

  void Zero(void* dst, int64_t bytes) override { std::memset(dst, 0, bytes); }
  void Copy(void* dst, const void* src, int64_t bytes) override { std::memcpy(dst, src, bytes); }
  absl::Status CopyToHost(void* host, const void* src, int64_t bytes) override {
    std::memcpy(host, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(void* dst, const void* host, int64_t bytes) override {
    std::memcpy(dst, host, bytes);
    return absl::OkStatus();
  }

  void Convert(const void* src, DType from, void* dst, DType to, int64_t n) override {
    if (from == to) {
      std::memcpy(dst, src, n * DTypeSize(from));
    } else if (from == DType::kF32) {
      const float* in = static_cast<const float*>(src);
      uint16_t* out = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) out[i] = FloatToBF16(in[i]);
    } else {
      const uint16_t* in = static_cast<const uint16_t*>(src);
      float* out = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) out[i] = BF16ToFloat(in[i]);
    }
  }

  void AddInto(const void* src, DType dtype, float* __restrict dst, int64_t n) override {
    if (dtype == DType::kF32) {
      const float* __restrict in = static_cast<const float*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] += in[i];
    } else {
      const uint16_t* in = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] += BF16ToFloat(in[i]);
    }
  }

  void Scale(float* x, int64_t n, float factor) override { ScaleInPlace(x, n, factor); }

  absl::StatusOr<double> SquaredNorm(const float* x, int64_t n) override {
    return SquaredL2Norm(x, n);
  }

  absl::Status Synchronize() override { return absl::OkStatus(); }
  std::unique_ptr<Fence> Record() override { return nullptr; }

  absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(
      const std::string& name, int64_t n, const OptimizerOptions& options) override {
    return zeroshard::MakeOptimizer(name, n, options);
  }
};

}  // namespace

Backend* CpuBackend() {
  static CpuBackendImpl* backend = new CpuBackendImpl();
  return backend;
}

}  // namespace zeroshard
