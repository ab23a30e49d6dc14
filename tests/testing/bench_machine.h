// What a benchmark ran on: the CPU, its vector extensions and the OpenBLAS
// kernel set chosen for it. Every benchmark prints this first and writes it
// into its --json_out, so that figures from different machines (or from
// OPENBLAS_CORETYPE overrides) are never compared unknowingly.
#ifndef ZEROSHARD_TESTS_TESTING_BENCH_MACHINE_H_
#define ZEROSHARD_TESTS_TESTING_BENCH_MACHINE_H_

#include <string>

#include "nlohmann/json.hpp"

namespace zeroshard {

struct BenchMachine {
  std::string cpu;  // /proc/cpuinfo's model name
  int cores = 0;    // online logical CPUs
  std::string isa;  // the widest of avx512f / avx2+fma / avx / sse
  // The OpenBLAS kernel set the measured processes used: a worker's run
  // report ("compute": {"blas_kernel"}), or openblas_get_corename() of the
  // library a benchmark loaded itself. Empty until the caller knows it.
  std::string blas_kernel;

  // "CPU <model> (<cores> cores, <isa>), OpenBLAS kernel <kernel>".
  std::string Line() const;
  nlohmann::json Json() const;
};

// The CPU from /proc/cpuinfo; blas_kernel as given.
BenchMachine DescribeBenchMachine(std::string blas_kernel);

}  // namespace zeroshard

#endif  // ZEROSHARD_TESTS_TESTING_BENCH_MACHINE_H_
