// cuBLAS, loaded on first use. The worker calls seven cuBLAS functions; they
// are defined here and forward to libcublas, which is dlopen'ed the first time
// one of them runs. A CPU run never loads it: linked in, libcublas (with
// libcublasLt) costs every process ~210 MB of resident memory at start-up,
// a third of a CPU rank's model state on seed 001's model (#15).
//
// The library's soname comes from the headers this is compiled against
// (libcublas.so.<CUBLAS_VER_MAJOR>), found through the binary's runpath like
// any linked library. When it cannot be loaded, every call returns
// CUBLAS_STATUS_NOT_INITIALIZED (cublasGetStatusString says why in the log).
#include <cublas_v2.h>

#include "worker/cuda/lazy_library.h"

namespace {

#define ZS_STR2(x) #x
#define ZS_STR(x) ZS_STR2(x)
constexpr char kSoname[] = "libcublas.so." ZS_STR(CUBLAS_VER_MAJOR);
constexpr char kName[] = "cuBLAS";

}  // namespace

#define ZS_FORWARD(ret, name, params, args, fallback) \
  ZS_LAZY_FORWARD(kSoname, kName, ret, name, params, args, fallback)

ZS_FORWARD(cublasStatus_t, cublasCreate_v2, (cublasHandle_t * handle), (handle),
           CUBLAS_STATUS_NOT_INITIALIZED)
ZS_FORWARD(cublasStatus_t, cublasDestroy_v2, (cublasHandle_t handle), (handle),
           CUBLAS_STATUS_NOT_INITIALIZED)
ZS_FORWARD(cublasStatus_t, cublasSetMathMode, (cublasHandle_t handle, cublasMath_t mode),
           (handle, mode), CUBLAS_STATUS_NOT_INITIALIZED)
ZS_FORWARD(cublasStatus_t, cublasSetStream_v2, (cublasHandle_t handle, cudaStream_t stream),
           (handle, stream), CUBLAS_STATUS_NOT_INITIALIZED)
ZS_FORWARD(const char*, cublasGetStatusName, (cublasStatus_t status), (status),
           "CUBLAS_STATUS_(cuBLAS not loaded)")
ZS_FORWARD(const char*, cublasGetStatusString, (cublasStatus_t status), (status),
           "cuBLAS could not be loaded")
ZS_FORWARD(cublasStatus_t, cublasGemmEx,
           (cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
            cublasComputeType_t computeType, cublasGemmAlgo_t algo),
           (handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
            ldc, computeType, algo),
           CUBLAS_STATUS_NOT_INITIALIZED)
