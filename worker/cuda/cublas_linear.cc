// CublasLinear: Linear / Conv1D / LM-head GEMMs through cublasGemmEx.
//
// The tensors are row-major and cuBLAS is column-major. A row-major [R,C]
// matrix is, to cuBLAS, its transpose: a column-major C x R matrix with
// leading dimension C. So each row-major product Y = X W is issued as the
// column-major product Y^T = W^T X^T, which reads the same memory; the
// comments next to each call give the row-major formula and the operands.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cublas_status.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/kernels.h"

namespace zeroshard {
namespace gpu {
namespace {

absl::Status CublasToStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return CublasStatusToStatus(status, absl::StrCat(what, ": ", cublasGetStatusName(status), ": ",
                                                   cublasGetStatusString(status)));
}

cublasHandle_t AsHandle(void* handle) { return static_cast<cublasHandle_t>(handle); }

absl::Status CheckDtype(const char* what, DType dtype) {
  if (dtype == DType::kF32 || dtype == DType::kBF16) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": dtype ", DTypeName(dtype), " is not supported (F32 and BF16 are)"));
}

absl::Status CheckShape(const char* what, int64_t n, int64_t in, int64_t out) {
  if (n < 0 || in < 0 || out < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": negative shape n ", n, " in ", in, " out ", out));
  }
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (n > kMax || in > kMax || out > kMax) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shape n ", n, " in ", in, " out ", out,
                                                   " exceeds cuBLAS's 32-bit dimensions"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CublasLinear>> CublasLinear::Create(void* stream) {
  int device = 0;
  if (absl::Status s = CudaErrorToStatus(cudaGetDevice(&device), "CublasLinear: cudaGetDevice");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckCudaDevice(device); !s.ok()) return s;
  cublasHandle_t handle = nullptr;
  if (absl::Status s = CublasToStatus(cublasCreate(&handle), "CublasLinear: cublasCreate");
      !s.ok()) {
    return s;
  }
  // CUBLAS_DEFAULT_MATH: tensor cores for BF16, but no TF32 for F32 inputs,
  // so that F32 GEMMs keep f32 precision (the CPU parity check relies on it).
  absl::Status s = CublasToStatus(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH),
                                  "CublasLinear: cublasSetMathMode");
  if (s.ok()) {
    s = CublasToStatus(cublasSetStream(handle, static_cast<cudaStream_t>(stream)),
                       "CublasLinear: cublasSetStream");
  }
  if (!s.ok()) {
    cublasDestroy(handle);
    return s;
  }
  return std::unique_ptr<CublasLinear>(new CublasLinear(handle, stream));
}

CublasLinear::~CublasLinear() { cublasDestroy(AsHandle(handle_)); }

absl::Status CublasLinear::Gemm(const char* what, bool trans_a, bool trans_b, int64_t m, int64_t n,
                                int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb,
                                float beta, void* c, int64_t ldc, DType dtype, DType c_dtype) {
  const cudaDataType_t type = dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  const cudaDataType_t c_type = c_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  const float alpha = 1.0f;
  return CublasToStatus(
      cublasGemmEx(AsHandle(handle_), trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                   trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n),
                   static_cast<int>(k), &alpha, a, type, static_cast<int>(lda), b, type,
                   static_cast<int>(ldb), &beta, c, c_type, static_cast<int>(ldc),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      absl::StrCat(what, ": cublasGemmEx"));
}

absl::Status CublasLinear::ForwardProduct(const char* what, void* y, const void* x, const void* w,
                                          int64_t n, int64_t in, int64_t out, DType dtype,
                                          DType c_dtype, Layout layout) {
  if (in == 0) {
    // An empty product: y = 0. (cuBLAS is not asked about k == 0.)
    return CudaErrorToStatus(
        cudaMemsetAsync(y, 0, n * out * DTypeSize(c_dtype), static_cast<cudaStream_t>(stream_)),
        what);
  }
  if (layout == Layout::kOutIn) {
    // y[N,OUT] = x[N,IN] w^T, w [OUT,IN]: y^T = (w^T)^T x^T.
    return Gemm(what, true, false, out, n, in, w, in, x, in, 0.0f, y, out, dtype, c_dtype);
  }
  // y[N,OUT] = x[N,IN] w, w [IN,OUT]: y^T = w^T x^T.
  return Gemm(what, false, false, out, n, in, w, out, x, in, 0.0f, y, out, dtype, c_dtype);
}

absl::Status CublasLinear::BackwardProducts(const char* what, void* dx, void* dw, const void* dy,
                                            const void* x, const void* w, int64_t n, int64_t in,
                                            int64_t out, DType dtype, DType c_dtype,
                                            Layout layout) {
  if (dx != nullptr && in > 0) {
    absl::Status s;
    if (out == 0) {
      s = CudaErrorToStatus(
          cudaMemsetAsync(dx, 0, n * in * DTypeSize(c_dtype), static_cast<cudaStream_t>(stream_)),
          what);
    } else if (layout == Layout::kOutIn) {
      // dx[N,IN] = dy[N,OUT] w[OUT,IN]: dx^T = w^T dy^T.
      s = Gemm(what, false, false, in, n, out, w, in, dy, out, 0.0f, dx, in, dtype, c_dtype);
    } else {
      // dx[N,IN] = dy[N,OUT] w^T, w [IN,OUT]: dx^T = (w^T)^T dy^T.
      s = Gemm(what, true, false, in, n, out, w, out, dy, out, 0.0f, dx, in, dtype, c_dtype);
    }
    if (!s.ok()) return s;
  }
  if (in > 0 && out > 0) {
    if (layout == Layout::kOutIn) {
      // dw[OUT,IN] += dy^T x: dw^T += x^T dy.
      return Gemm(what, false, true, in, out, n, x, in, dy, out, 1.0f, dw, in, dtype, c_dtype);
    }
    // dw[IN,OUT] += x^T dy: dw^T += dy^T x.
    return Gemm(what, false, true, out, in, n, dy, out, x, in, 1.0f, dw, out, dtype, c_dtype);
  }
  return absl::OkStatus();
}

absl::Status CublasLinear::Forward(void* y, const void* x, const void* w, const void* b, int64_t n,
                                   int64_t in, int64_t out, DType dtype, Layout layout) {
  static constexpr char kWhat[] = "CublasLinear::Forward";
  if (absl::Status s = CheckDtype(kWhat, dtype); !s.ok()) return s;
  if (absl::Status s = CheckShape(kWhat, n, in, out); !s.ok()) return s;
  if (n == 0 || out == 0) return absl::OkStatus();
  if (y == nullptr || (in > 0 && (x == nullptr || w == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  absl::Status s = ForwardProduct(kWhat, y, x, w, n, in, out, dtype, dtype, layout);
  if (!s.ok() || b == nullptr) return s;
  return BiasAdd(y, b, n, out, dtype, stream_);
}

absl::Status CublasLinear::Backward(void* dx, void* dw, void* db, const void* dy, const void* x,
                                    const void* w, int64_t n, int64_t in, int64_t out, DType dtype,
                                    Layout layout) {
  static constexpr char kWhat[] = "CublasLinear::Backward";
  if (absl::Status s = CheckDtype(kWhat, dtype); !s.ok()) return s;
  if (absl::Status s = CheckShape(kWhat, n, in, out); !s.ok()) return s;
  if (n == 0) return absl::OkStatus();  // nothing to add to dw / db; dx is empty
  if (dw == nullptr || dy == nullptr || x == nullptr || w == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  absl::Status s = BackwardProducts(kWhat, dx, dw, dy, x, w, n, in, out, dtype, dtype, layout);
  if (!s.ok() || db == nullptr) return s;
  return BiasGrad(db, dy, n, out, dtype, stream_);
}

absl::Status CublasLinear::ForwardMixed(float* y, const uint16_t* x, const uint16_t* w,
                                        const float* b, int64_t n, int64_t in, int64_t out,
                                        Layout layout) {
  static constexpr char kWhat[] = "CublasLinear::ForwardMixed";
  if (absl::Status s = CheckShape(kWhat, n, in, out); !s.ok()) return s;
  if (n == 0 || out == 0) return absl::OkStatus();
  if (y == nullptr || (in > 0 && (x == nullptr || w == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  absl::Status s = ForwardProduct(kWhat, y, x, w, n, in, out, DType::kBF16, DType::kF32, layout);
  if (!s.ok() || b == nullptr) return s;
  return BiasAdd(y, b, n, out, DType::kF32, stream_);
}

absl::Status CublasLinear::BackwardMixed(float* dx, float* dw, float* db, const uint16_t* dy,
                                         const float* dy_f32, const uint16_t* x, const uint16_t* w,
                                         int64_t n, int64_t in, int64_t out, Layout layout) {
  static constexpr char kWhat[] = "CublasLinear::BackwardMixed";
  if (absl::Status s = CheckShape(kWhat, n, in, out); !s.ok()) return s;
  if (n == 0) return absl::OkStatus();
  if (dw == nullptr || dy == nullptr || x == nullptr || w == nullptr ||
      (db != nullptr && dy_f32 == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": null buffer"));
  }
  absl::Status s =
      BackwardProducts(kWhat, dx, dw, dy, x, w, n, in, out, DType::kBF16, DType::kF32, layout);
  if (!s.ok() || db == nullptr) return s;
  return BiasGrad(db, dy_f32, n, out, DType::kF32, stream_);
}

}  // namespace gpu
}  // namespace zeroshard
