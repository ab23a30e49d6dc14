#include "tests/testing/bench_machine.h"

#include <unistd.h>

#include <fstream>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace zeroshard {

std::string BenchMachine::Line() const {
  return absl::StrCat("CPU ", cpu, " (", cores, " cores, ", isa, "), OpenBLAS kernel ",
                      blas_kernel.empty() ? "unknown" : blas_kernel);
}

nlohmann::json BenchMachine::Json() const {
  return {{"cpu", cpu}, {"cores", cores}, {"isa", isa}, {"blas_kernel", blas_kernel}};
}

BenchMachine DescribeBenchMachine(std::string blas_kernel) {
  BenchMachine m;
  m.blas_kernel = std::move(blas_kernel);
  m.cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  std::set<std::string> flags;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits(':', 1));
    const absl::string_view key = absl::StripAsciiWhitespace(kv.first);
    const absl::string_view value = absl::StripAsciiWhitespace(kv.second);
    if (key == "model name" && m.cpu.empty()) m.cpu = std::string(value);
    if (key == "flags" && flags.empty()) {
      for (absl::string_view f : absl::StrSplit(value, ' ')) flags.emplace(f);
    }
  }
  if (m.cpu.empty()) m.cpu = "unknown";
  if (flags.count("avx512f")) {
    m.isa = "AVX-512";
  } else if (flags.count("avx2") && flags.count("fma")) {
    m.isa = "AVX2+FMA";
  } else if (flags.count("avx")) {
    m.isa = "AVX";
  } else {
    m.isa = "SSE";
  }
  return m;
}

}  // namespace zeroshard
