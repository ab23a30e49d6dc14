// Where the ZeRO engine's buffers live and how its few non-model operations
// run: on the CPU (host memory; every call is done when it returns) or on a
// CUDA device (device memory; work is enqueued on the calling thread's
// stream and the call returns at once). The engine's schedule — gathers,
// prefetch, reductions, the optimizer step — is one piece of code over this
// interface and the Communicator; only the implementations differ.
//
// Ordering rules the engine follows, which make both backends correct:
//  - Before a collective reads a buffer the calling thread wrote, the thread
//    calls Synchronize() (its stream's work is done; the communicator runs on
//    its own stream). Collectives return when their data is in place.
//  - A buffer the compute thread wrote and another thread reads (a unit's
//    gradient handed to the reduce thread) travels with a Fence recorded by
//    the compute thread; the reader waits on it first.
//  - Free() is ordered after the work the freeing thread enqueued before it,
//    so a freed block may be handed to another backend thread at once; but a
//    communicator runs on its own stream, so a thread synchronizes after
//    allocating a buffer and before a collective touches it.
//
// Errors of enqueued work are sticky: the first one is returned by the next
// Synchronize() or Fence::Wait() (and by later ones), as CUDA reports them.
#ifndef ZEROSHARD_WORKER_ZERO_BACKEND_H_
#define ZEROSHARD_WORKER_ZERO_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/zero/optimizer.h"
#include "worker/zero/packed_layout.h"

namespace zeroshard {

// The work one thread had enqueued when the fence was recorded.
class Fence {
 public:
  virtual ~Fence() = default;
  // Returns when that work is done; its first error, if any.
  virtual absl::Status Wait() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:N".
  virtual std::string name() const = 0;
  // True when buffers are host memory the CPU may read and write directly.
  virtual bool host_accessible() const = 0;
  // Called once on every thread that will use the backend, before its first
  // call (CUDA: makes the device current on that thread).
  virtual void BindThread() {}

  // `bytes` of memory, 64-byte aligned; null when none is left.
  virtual void* Allocate(int64_t bytes) = 0;
  virtual void Free(void* data, int64_t bytes) = 0;

  virtual void Zero(void* dst, int64_t bytes) = 0;
  // Within the backend's memory; regions do not overlap.
  virtual void Copy(void* dst, const void* src, int64_t bytes) = 0;
  // Between host memory and the backend's; both return when the copy is done.
  virtual absl::Status CopyToHost(void* host, const void* src, int64_t bytes) = 0;
  virtual absl::Status CopyFromHost(void* dst, const void* host, int64_t bytes) = 0;

  // dst[i] = src[i] converted from `from` to `to` (F32 or BF16; BF16 rounds
  // to nearest even as common/dtype.h does), i < n.
  virtual void Convert(const void* src, DType from, void* dst, DType to, int64_t n) = 0;
  // dst[i] += src[i] (src F32 or BF16, widened), i < n.
  virtual void AddInto(const void* src, DType dtype, float* dst, int64_t n) = 0;
  // x[i] *= factor, i < n.
  virtual void Scale(float* x, int64_t n, float factor) = 0;
  // Sum of x[i]^2 in double; waits for this thread's work.
  virtual absl::StatusOr<double> SquaredNorm(const float* x, int64_t n) = 0;

  // A unit's packed layout (packed_layout.h) made ready for Pack and Unpack
  // (CUDA: the runs copied to the device, layout->device_runs). Once per
  // layout, before any Pack or Unpack of it.
  virtual absl::Status PreparePacked(PackedLayout* layout) {
    (void)layout;
    return absl::OkStatus();
  }
  // packed (layout.packed_elements() of `to`, F32 or BF16): every run's full
  // elements converted from f32, padding runs zero.
  virtual void Pack(const PackedLayout& layout, const float* full, void* packed, DType to);
  // full[run's full elements] = packed's run widened from `from` to f32, for
  // every run that is not padding; the rest of `full` is left as it is.
  virtual void Unpack(const PackedLayout& layout, const void* packed, DType from, float* full);
  // Unpack with no conversion: `full` holds `dtype` (F32 or BF16) like
  // `packed`, and every run that is not padding is copied bit for bit.
  virtual void UnpackRaw(const PackedLayout& layout, const void* packed, DType dtype, void* full);
  // Unpack from f32 `packed` with each value rounded to `through` (F32 or
  // BF16) on the way, in one pass: what converting `packed` to `through`
  // and unpacking that would store. Returns false, doing nothing, where the
  // backend has no such pass (the default): the caller converts and
  // unpacks.
  virtual bool UnpackThrough(const PackedLayout& layout, const float* packed, DType through,
                             float* full) {
    (void)layout, (void)packed, (void)through, (void)full;
    return false;
  }

  // Waits for the work this thread enqueued so far.
  virtual absl::Status Synchronize() = 0;
  // A fence over the work this thread enqueued so far (CPU: already done).
  virtual std::unique_ptr<Fence> Record() = 0;

  // An optimizer whose state lives in this backend's memory and whose Step
  // takes pointers into it (see optimizer.h for the rules and `options`).
  virtual absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(
      const std::string& name, int64_t n, const OptimizerOptions& options) = 0;
};

// The host backend (process-wide; thread-safe).
Backend* CpuBackend();

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_BACKEND_H_
