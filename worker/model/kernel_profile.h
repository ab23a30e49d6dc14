// Where the model's compute goes: wall time of the CPU kernels (layers.h) by
// kind, accumulated process-wide. Each public kernel in layers.cc times itself
// (two clock reads per call, a few hundred calls a step), so a run's report can
// say how much of a step was matrix products, attention, LayerNorm, ... and,
// by difference with the engine's forward/backward times, the engine's own
// copies. Meant for the one compute thread; threads a kernel fans out to are
// inside its wall time.
#ifndef ZEROSHARD_WORKER_MODEL_KERNEL_PROFILE_H_
#define ZEROSHARD_WORKER_MODEL_KERNEL_PROFILE_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace zeroshard {

enum class Kernel {
  kMatmul = 0,  // Linear / Conv1D forward and backward (GEMMs, bias)
  kAttention,   // causal self-attention (its GEMMs and softmax)
  kLayerNorm,
  kActivation,    // GELU / ReLU
  kLmHead,        // the tied LM head's GEMMs
  kCrossEntropy,  // softmax + cross-entropy (and MSE)
  kEmbedding,     // token + position embedding and its scatter-add
  kResidual,      // residual adds
  kCount,
};

// "matmul", "attention", "layernorm", "activation", "lm_head",
// "cross_entropy", "embedding", "residual".
const char* KernelName(Kernel kernel);

using KernelTimes = std::array<double, static_cast<int>(Kernel::kCount)>;  // milliseconds

// The totals since the process started (milliseconds by kernel). Take two
// snapshots and subtract to time a span.
KernelTimes KernelTimesSnapshot();

namespace internal {
extern std::array<std::atomic<int64_t>, static_cast<int>(Kernel::kCount)> kernel_ns;
}  // namespace internal

// Adds its lifetime to `kernel`'s total.
class KernelTimer {
 public:
  explicit KernelTimer(Kernel kernel) : kernel_(kernel), start_(std::chrono::steady_clock::now()) {}
  ~KernelTimer() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start_)
                        .count();
    internal::kernel_ns[static_cast<int>(kernel_)].fetch_add(ns, std::memory_order_relaxed);
  }
  KernelTimer(const KernelTimer&) = delete;
  KernelTimer& operator=(const KernelTimer&) = delete;

 private:
  Kernel kernel_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_KERNEL_PROFILE_H_
