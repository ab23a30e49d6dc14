// The lazily loaded cuBLAS (worker/cuda/cublas_lazy.cc): nothing of it is
// resident until a cuBLAS function is called, and then the calls reach the
// real library. Needs the CUDA toolkit's libraries, not a GPU.
#include <cublas_v2.h>
#include <dlfcn.h>

#include <string>

#define ZS_STR2(x) #x
#define ZS_STR(x) ZS_STR2(x)
#define CUBLAS_VER_MAJOR_STR ZS_STR(CUBLAS_VER_MAJOR)

#include "gtest/gtest.h"

namespace {

bool CublasResident() {
  void* h = dlopen("libcublas.so." CUBLAS_VER_MAJOR_STR, RTLD_NOW | RTLD_NOLOAD);
  if (h != nullptr) dlclose(h);
  return h != nullptr;
}

TEST(CublasLazyTest, LoadedOnFirstCallOnly) {
  EXPECT_FALSE(CublasResident()) << "libcublas is loaded before any cuBLAS call";
  // Pure functions of the library: no device needed.
  EXPECT_EQ(std::string(cublasGetStatusName(CUBLAS_STATUS_SUCCESS)), "CUBLAS_STATUS_SUCCESS");
  EXPECT_NE(std::string(cublasGetStatusString(CUBLAS_STATUS_INVALID_VALUE)),
            "cuBLAS could not be loaded");
  EXPECT_TRUE(CublasResident());
}

}  // namespace
