// cuBLASLt, loaded on first use, as cuBLAS is (cublas_lazy.cc, which says
// why: linked in, libcublasLt alone maps ~200 MB into every process, CPU runs
// included). The fourteen cuBLASLt functions CublasLtLinear calls are defined
// here and forward to libcublasLt.so.<CUBLAS_VER_MAJOR>, dlopen'ed (through
// the binary's runpath) the first time one of them runs. When it cannot be
// loaded, every call returns CUBLAS_STATUS_NOT_INITIALIZED and the status
// strings say so.
#include <cublasLt.h>

#include "worker/cuda/lazy_library.h"

namespace {

#define ZS_LT_STR2(x) #x
#define ZS_LT_STR(x) ZS_LT_STR2(x)
constexpr char kSoname[] = "libcublasLt.so." ZS_LT_STR(CUBLAS_VER_MAJOR);
constexpr char kName[] = "cuBLASLt";

}  // namespace

#define ZS_LT_FORWARD(ret, name, params, args, fallback) \
  ZS_LAZY_FORWARD(kSoname, kName, ret, name, params, args, fallback)

#define ZS_LT_NOT_LOADED CUBLAS_STATUS_NOT_INITIALIZED

ZS_LT_FORWARD(cublasStatus_t, cublasLtCreate, (cublasLtHandle_t * handle), (handle),
              ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(cublasStatus_t, cublasLtDestroy, (cublasLtHandle_t handle), (handle),
              ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(const char*, cublasLtGetStatusName, (cublasStatus_t status), (status),
              "CUBLAS_STATUS_(cuBLASLt not loaded)")
ZS_LT_FORWARD(const char*, cublasLtGetStatusString, (cublasStatus_t status), (status),
              "cuBLASLt could not be loaded")
ZS_LT_FORWARD(cublasStatus_t, cublasLtMatmulDescCreate,
              (cublasLtMatmulDesc_t * desc, cublasComputeType_t compute, cudaDataType_t scale),
              (desc, compute, scale), ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(cublasStatus_t, cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t desc), (desc),
              ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(cublasStatus_t, cublasLtMatmulDescSetAttribute,
              (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf,
               size_t size),
              (desc, attr, buf, size), ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(cublasStatus_t, cublasLtMatrixLayoutCreate,
              (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows, uint64_t cols,
               int64_t ld),
              (layout, type, rows, cols, ld), ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(cublasStatus_t, cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t layout),
              (layout), ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(cublasStatus_t, cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref),
              (pref), ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(cublasStatus_t, cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref),
              (pref), ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(cublasStatus_t, cublasLtMatmulPreferenceSetAttribute,
              (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
               const void* buf, size_t size),
              (pref, attr, buf, size), ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(cublasStatus_t, cublasLtMatmulAlgoGetHeuristic,
              (cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
               cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
               cublasLtMatmulPreference_t pref, int requested,
               cublasLtMatmulHeuristicResult_t results[], int* returned),
              (handle, op, a, b, c, d, pref, requested, results, returned), ZS_LT_NOT_LOADED)
ZS_LT_FORWARD(cublasStatus_t, cublasLtMatmul,
              (cublasLtHandle_t handle, cublasLtMatmulDesc_t op, const void* alpha, const void* a,
               cublasLtMatrixLayout_t a_desc, const void* b, cublasLtMatrixLayout_t b_desc,
               const void* beta, const void* c, cublasLtMatrixLayout_t c_desc, void* d,
               cublasLtMatrixLayout_t d_desc, const cublasLtMatmulAlgo_t* algo, void* workspace,
               size_t workspace_bytes, cudaStream_t stream),
              (handle, op, alpha, a, a_desc, b, b_desc, beta, c, c_desc, d, d_desc, algo, workspace,
               workspace_bytes, stream),
              ZS_LT_NOT_LOADED)
