// The lazily loaded cuBLAS and cuBLASLt (worker/cuda/cublas_lazy.cc,
// cublaslt_lazy.cc): nothing of either library is mapped until one of its
// functions is called, and then the calls reach the real library. This
// binary links both forwarders, as the worker does: a CPU run, which calls
// neither, maps neither. Needs the CUDA toolkit's libraries, not a GPU. The
// cases run in order (cuBLASLt first: libcublas itself loads libcublasLt).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <dlfcn.h>

#include <fstream>
#include <string>

#define ZS_STR2(x) #x
#define ZS_STR(x) ZS_STR2(x)
#define CUBLAS_VER_MAJOR_STR ZS_STR(CUBLAS_VER_MAJOR)

#include "gtest/gtest.h"

namespace {

constexpr char kCublas[] = "libcublas.so." CUBLAS_VER_MAJOR_STR;
constexpr char kCublasLt[] = "libcublasLt.so." CUBLAS_VER_MAJOR_STR;

bool Resident(const char* soname) {
  void* h = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
  if (h != nullptr) dlclose(h);
  return h != nullptr;
}

// Whether any mapping of this process comes from a file whose name contains
// `name` (what the ~200 MB are: mapped library segments).
bool Mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(name) != std::string::npos) return true;
  }
  return false;
}

TEST(CublasLazyTest, NeitherLibraryIsMappedAtStart) {
  EXPECT_FALSE(Resident(kCublasLt)) << "libcublasLt is loaded before any cuBLASLt call";
  EXPECT_FALSE(Resident(kCublas)) << "libcublas is loaded before any cuBLAS call";
  EXPECT_FALSE(Mapped("libcublasLt")) << "libcublasLt is mapped before any cuBLASLt call";
  EXPECT_FALSE(Mapped("libcublas.")) << "libcublas is mapped before any cuBLAS call";
}

TEST(CublasLazyTest, CublasLtLoadedOnFirstCallOnly) {
  ASSERT_FALSE(Resident(kCublasLt));
  // Pure functions of the library: no device needed.
  EXPECT_EQ(std::string(cublasLtGetStatusName(CUBLAS_STATUS_SUCCESS)), "CUBLAS_STATUS_SUCCESS");
  EXPECT_NE(std::string(cublasLtGetStatusString(CUBLAS_STATUS_INVALID_VALUE)),
            "cuBLASLt could not be loaded");
  EXPECT_TRUE(Resident(kCublasLt));
  EXPECT_TRUE(Mapped("libcublasLt"));
  EXPECT_FALSE(Resident(kCublas)) << "cuBLASLt alone must not pull in libcublas";
}

TEST(CublasLazyTest, CublasLoadedOnFirstCallOnly) {
  EXPECT_FALSE(Resident(kCublas)) << "libcublas is loaded before any cuBLAS call";
  EXPECT_EQ(std::string(cublasGetStatusName(CUBLAS_STATUS_SUCCESS)), "CUBLAS_STATUS_SUCCESS");
  EXPECT_NE(std::string(cublasGetStatusString(CUBLAS_STATUS_INVALID_VALUE)),
            "cuBLAS could not be loaded");
  EXPECT_TRUE(Resident(kCublas));
}

}  // namespace
