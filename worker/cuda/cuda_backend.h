// The ZeRO engine's Backend on one CUDA device: buffers from the stream-
// ordered allocator (cudaMallocAsync / cudaFreeAsync, the device's default
// memory pool), one non-blocking stream per calling thread (the engine's
// compute, gather and reduce threads each get their own, so a gather's
// conversions overlap the compute stream's kernels), fences as CUDA events,
// and Adam / AdamW with their moments in device memory (the kernels of
// kernels.h, bitwise equal to the CPU update).
//
// The compute thread's stream is the one the device model must launch on:
// StreamForThisThread() from that thread.
#ifndef ZEROSHARD_WORKER_CUDA_CUDA_BACKEND_H_
#define ZEROSHARD_WORKER_CUDA_CUDA_BACKEND_H_

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/zero/backend.h"

namespace zeroshard {

class CudaBackend : public Backend {
 public:
  // FAILED_PRECONDITION (CheckCudaDevice's "no CUDA device found ...;
  // --backend=gloo runs on CPUs") when `device` does not exist.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device);
  ~CudaBackend() override;

  std::string name() const override;
  bool host_accessible() const override { return false; }
  void BindThread() override { StreamForThisThread(); }

  void* Allocate(int64_t bytes) override;
  void Free(void* data, int64_t bytes) override;
  void Zero(void* dst, int64_t bytes) override;
  void Copy(void* dst, const void* src, int64_t bytes) override;
  absl::Status CopyToHost(void* host, const void* src, int64_t bytes) override;
  absl::Status CopyFromHost(void* dst, const void* host, int64_t bytes) override;
  void Convert(const void* src, DType from, void* dst, DType to, int64_t n) override;
  absl::Status PreparePacked(PackedLayout* layout) override;
  void Pack(const PackedLayout& layout, const float* full, void* packed, DType to) override;
  void Unpack(const PackedLayout& layout, const void* packed, DType from, float* full) override;
  void UnpackRaw(const PackedLayout& layout, const void* packed, DType dtype, void* full) override;
  bool UnpackThrough(const PackedLayout& layout, const float* packed, DType through,
                     float* full) override;
  void AddInto(const void* src, DType dtype, float* dst, int64_t n) override;
  void Scale(float* x, int64_t n, float factor) override;
  absl::StatusOr<double> SquaredNorm(const float* x, int64_t n) override;
  absl::Status Synchronize() override;
  std::unique_ptr<Fence> Record() override;
  absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(
      const std::string& name, int64_t n, const OptimizerOptions& options) override;

  // The calling thread's stream (created on first use, with the device made
  // current on that thread).
  cudaStream_t StreamForThisThread();
  int device() const { return device_; }

 private:
  explicit CudaBackend(int device) : device_(device) {}
  // Keeps the first error of enqueued work (returned by Synchronize/Wait).
  void Check(const absl::Status& status);
  absl::Status sticky() const;

  const int device_;
  mutable absl::Mutex mu_;
  std::map<std::thread::id, cudaStream_t> streams_ ABSL_GUARDED_BY(mu_);
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUDA_BACKEND_H_
