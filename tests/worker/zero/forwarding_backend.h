// A Backend that forwards every operation to the host backend
// (CpuBackend()), for tests that change one operation of it: poisoned
// allocations, a one-pass UnpackThrough, a count of calls.
#ifndef ZEROSHARD_TESTS_WORKER_ZERO_FORWARDING_BACKEND_H_
#define ZEROSHARD_TESTS_WORKER_ZERO_FORWARDING_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/zero/backend.h"

namespace zeroshard {
namespace testing {

class ForwardingBackend : public Backend {
 public:
  std::string name() const override { return "cpu-forwarded"; }
  bool host_accessible() const override { return true; }
  void* Allocate(int64_t bytes) override { return cpu_->Allocate(bytes); }
  void Free(void* data, int64_t bytes) override { cpu_->Free(data, bytes); }
  void Zero(void* dst, int64_t bytes) override { cpu_->Zero(dst, bytes); }
  void Copy(void* dst, const void* src, int64_t bytes) override { cpu_->Copy(dst, src, bytes); }
  absl::Status CopyToHost(void* host, const void* src, int64_t bytes) override {
    return cpu_->CopyToHost(host, src, bytes);
  }
  absl::Status CopyFromHost(void* dst, const void* host, int64_t bytes) override {
    return cpu_->CopyFromHost(dst, host, bytes);
  }
  void Convert(const void* src, DType from, void* dst, DType to, int64_t n) override {
    cpu_->Convert(src, from, dst, to, n);
  }
  void AddInto(const void* src, DType dtype, float* dst, int64_t n) override {
    cpu_->AddInto(src, dtype, dst, n);
  }
  void Scale(float* x, int64_t n, float factor) override { cpu_->Scale(x, n, factor); }
  absl::StatusOr<double> SquaredNorm(const float* x, int64_t n) override {
    return cpu_->SquaredNorm(x, n);
  }
  absl::Status Synchronize() override { return cpu_->Synchronize(); }
  std::unique_ptr<Fence> Record() override { return cpu_->Record(); }
  absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(
      const std::string& name, int64_t n, const OptimizerOptions& options) override {
    return cpu_->MakeOptimizer(name, n, options);
  }

 protected:
  Backend* cpu_ = CpuBackend();
};

}  // namespace testing
}  // namespace zeroshard

#endif  // ZEROSHARD_TESTS_WORKER_ZERO_FORWARDING_BACKEND_H_
