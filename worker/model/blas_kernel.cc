#include "worker/model/blas_kernel.h"

#include <array>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

extern "C" char* openblas_get_corename(void);

namespace zeroshard {
namespace {

// OpenBLAS's x86-64 kernel sets (the names OPENBLAS_CORETYPE takes, compared
// without case) by the vector extension they use.
constexpr std::array<std::pair<const char*, int>, 24> kKernelLevels = {{
    {"Katmai", 0},     {"Coppermine", 0},  {"Northwood", 0},   {"Prescott", 0},
    {"Banias", 0},     {"Atom", 0},        {"Core2", 0},       {"Penryn", 0},
    {"Dunnington", 0}, {"Nehalem", 0},     {"Opteron", 0},     {"Opteron_SSE3", 0},
    {"Barcelona", 0},  {"Nano", 0},        {"Sandybridge", 1}, {"Bulldozer", 1},
    {"Piledriver", 1}, {"Steamroller", 1}, {"Haswell", 2},     {"Zen", 2},
    {"Excavator", 2},  {"SkylakeX", 3},    {"CooperLake", 3},  {"SapphireRapids", 3},
}};

}  // namespace

const char* BlasKernel() { return openblas_get_corename(); }

std::string KernelForThisCpu() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512cd")) {
    return "SkylakeX";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  if (__builtin_cpu_supports("avx")) return "Sandybridge";
  return "";
}

int KernelLevel(absl::string_view kernel) {
  for (const auto& [name, level] : kKernelLevels) {
    if (absl::EqualsIgnoreCase(kernel, name)) return level;
  }
  return -1;
}

absl::StatusOr<std::string> KernelToSet(absl::string_view flag, absl::string_view loaded,
                                        absl::string_view cpu_kernel, const char* environment) {
  if (flag != "auto" && flag != "openblas" && KernelLevel(flag) < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--blas_kernel=", flag,
        ": expected auto, openblas or an OpenBLAS kernel set such as SkylakeX, Haswell, "
        "Sandybridge, Zen or Prescott"));
  }
  if (environment != nullptr || flag == "openblas") return std::string();
  if (flag != "auto") return absl::EqualsIgnoreCase(flag, loaded) ? "" : std::string(flag);
  if (cpu_kernel.empty() || KernelLevel(loaded) >= KernelLevel(cpu_kernel)) return std::string();
  return std::string(cpu_kernel);
}

}  // namespace zeroshard
