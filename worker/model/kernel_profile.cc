#include "worker/model/kernel_profile.h"

namespace zeroshard {

namespace internal {
std::array<std::atomic<int64_t>, static_cast<int>(Kernel::kCount)> kernel_ns{};
}  // namespace internal

const char* KernelName(Kernel kernel) {
  switch (kernel) {
    case Kernel::kMatmul:
      return "matmul";
    case Kernel::kAttention:
      return "attention";
    case Kernel::kLayerNorm:
      return "layernorm";
    case Kernel::kActivation:
      return "activation";
    case Kernel::kLmHead:
      return "lm_head";
    case Kernel::kCrossEntropy:
      return "cross_entropy";
    case Kernel::kEmbedding:
      return "embedding";
    case Kernel::kResidual:
      return "residual";
    case Kernel::kCount:
      break;
  }
  return "?";
}

KernelTimes KernelTimesSnapshot() {
  KernelTimes out{};
  for (int k = 0; k < static_cast<int>(Kernel::kCount); ++k) {
    out[k] = static_cast<double>(internal::kernel_ns[k].load(std::memory_order_relaxed)) / 1e6;
  }
  return out;
}

}  // namespace zeroshard
