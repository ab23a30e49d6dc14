// Which OpenBLAS kernel set this process computes with, and the remedy when
// OpenBLAS does not know the CPU.
//
// OpenBLAS's DYNAMIC_ARCH build picks its kernels from the CPU's family and
// model when the library loads. A release older than the CPU (Debian 12 has
// 0.3.21; Intel family 6 model 207 is newer) falls back to Prescott's SSE3
// kernels although the CPU runs AVX-512: the GPT's GEMMs took 3-5x as long
// (gemm_bench, 2026-11-25). OPENBLAS_CORETYPE overrides the pick, but only in
// the environment of a process before the library loads, so a worker that
// finds itself on such a fallback sets it and executes itself again.
#ifndef ZEROSHARD_WORKER_MODEL_BLAS_KERNEL_H_
#define ZEROSHARD_WORKER_MODEL_BLAS_KERNEL_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

// The kernel set OpenBLAS chose at load time ("SkylakeX", "Haswell",
// "Sandybridge", "Zen", "Prescott", ...).
const char* BlasKernel();

// The kernel set for the widest vector extension this CPU runs: "SkylakeX"
// (AVX-512 F/BW/VL/DQ/CD), "Haswell" (AVX2 + FMA), "Sandybridge" (AVX), or ""
// when it has none of those (OpenBLAS's own pick then stands).
std::string KernelForThisCpu();

// The vector extension level of a kernel set: 0 SSE (Prescott, Core2,
// Nehalem, ...), 1 AVX (Sandybridge, Bulldozer, ...), 2 AVX2 (Haswell, Zen,
// Excavator), 3 AVX-512 (SkylakeX, CooperLake, SapphireRapids); -1 for a name
// OpenBLAS does not have.
int KernelLevel(absl::string_view kernel);

// What --blas_kernel asks for, given the kernel `loaded`, the CPU's
// (`cpu_kernel`: KernelForThisCpu()) and the environment's OPENBLAS_CORETYPE
// (`environment`, null when unset; it always wins): "auto" keeps OpenBLAS's
// pick unless it is below the CPU's, "openblas" keeps it always, a kernel name
// forces that one. Returns the name to put in OPENBLAS_CORETYPE before
// executing again, or "" when the loaded one stands; INVALID_ARGUMENT naming
// the value for an unknown name.
absl::StatusOr<std::string> KernelToSet(absl::string_view flag, absl::string_view loaded,
                                        absl::string_view cpu_kernel, const char* environment);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_BLAS_KERNEL_H_
