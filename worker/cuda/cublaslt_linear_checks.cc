// CublasLtLinear's argument checks (cublaslt_linear.h): plain host code, run
// before any CUDA call, so that the host tests exercise them without a GPU.
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cublaslt_linear.h"

namespace zeroshard {
namespace gpu {
namespace {

absl::Status CheckDtype(const char* what, const char* name, DType dtype) {
  if (dtype == DType::kF32 || dtype == DType::kBF16) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ", name, " ", DTypeName(dtype), " is not supported (F32 or BF16)"));
}

// F32 operands multiply into F32 only (cuBLASLt has no F32 x F32 -> BF16).
absl::Status CheckOutputDtype(const char* what, const char* name, DType in_dtype, DType out) {
  if (absl::Status s = CheckDtype(what, name, out); !s.ok()) return s;
  if (in_dtype == DType::kF32 && out != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", name, " ", DTypeName(out),
                                                   " with in_dtype F32; F32 operands need an "
                                                   "F32 result (or pass BF16 operands)"));
  }
  return absl::OkStatus();
}

absl::Status CheckShape(const char* what, int64_t n, int64_t in, int64_t out) {
  if (n < 0 || in < 0 || out < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": negative shape n ", n, " in ", in, " out ", out));
  }
  if (n > 0 && (in == 0 || out == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": in ", in, " out ", out, " for ", n,
                                                   " rows; a layer needs in >= 1 and out >= 1"));
  }
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (n > kMax || in > kMax || out > kMax) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shape n ", n, " in ", in, " out ", out,
                                                   " exceeds 2^31 - 1 in a dimension"));
  }
  return absl::OkStatus();
}

// A row stride `ld` of a [rows, cols] operand: 0 (packed) or cols <= ld <=
// 2^31 - 1 (cuBLASLt's leading dimension; the fallback kernels' indices).
absl::Status CheckRowStride(const char* what, const char* name, int64_t ld, int64_t cols) {
  if (ld == 0 || (ld >= cols && ld <= std::numeric_limits<int32_t>::max())) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": ", name, " ", ld, " for out ", cols, "; ", name,
      " is the elements between the starts of consecutive rows: 0 (packed) or out <= ", name,
      " <= 2^31 - 1"));
}

// A required (or, with optional, a possibly null) buffer aligned to its
// elements.
absl::Status CheckBuffer(const char* what, const char* name, const void* p, int bytes,
                         bool optional = false) {
  if (p == nullptr) {
    if (optional) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", name, " is null"));
  }
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", name, " at 0x", absl::Hex(reinterpret_cast<uintptr_t>(p)),
                     " is not aligned to its ", bytes, "-byte elements"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CublasLtLinear::CheckForward(const ForwardArgs& a) {
  static constexpr char kWhat[] = "CublasLtLinear::Forward";
  if (absl::Status s = CheckDtype(kWhat, "in_dtype", a.in_dtype); !s.ok()) return s;
  if (absl::Status s = CheckOutputDtype(kWhat, "y_dtype", a.in_dtype, a.y_dtype); !s.ok()) {
    return s;
  }
  if (a.residual != nullptr && a.y_dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": a residual needs y_dtype F32 (the residual stream is f32), got ",
                     DTypeName(a.y_dtype)));
  }
  if (a.residual != nullptr && a.gelu_input != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        kWhat,
        ": residual and gelu_input together (cuBLASLt would compute gelu(residual + x W "
        "+ b)); a layer has one or the other"));
  }
  if (a.gelu_input != nullptr && a.gelu_input == a.y) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": gelu_input aliases y; the pre-activation must be kept apart"));
  }
  if (absl::Status s = CheckShape(kWhat, a.n, a.in, a.out); !s.ok()) return s;
  if (absl::Status s = CheckRowStride(kWhat, "ld_y", a.ld_y, a.out); !s.ok()) return s;
  if (a.ld_y != 0 && a.ld_y != a.out && (a.residual != nullptr || a.gelu_input != nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": ld_y ", a.ld_y, " (padded rows, out ", a.out, ") with ",
                     a.residual != nullptr ? "a residual" : "gelu_input",
                     "; padded rows are for plain products (the LM head): pass ld_y 0 or out"));
  }
  if (a.n == 0) return absl::OkStatus();
  const int in_bytes = DTypeSize(a.in_dtype), y_bytes = DTypeSize(a.y_dtype);
  for (absl::Status s :
       {CheckBuffer(kWhat, "y", a.y, y_bytes), CheckBuffer(kWhat, "x", a.x, in_bytes),
        CheckBuffer(kWhat, "w", a.w, in_bytes),
        CheckBuffer(kWhat, "bias", a.bias, 4, /*optional=*/true),
        CheckBuffer(kWhat, "residual", a.residual, 4, /*optional=*/true),
        CheckBuffer(kWhat, "gelu_input", a.gelu_input, y_bytes, true)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CublasLtLinear::CheckBackwardInput(const BackwardInputArgs& a) {
  static constexpr char kWhat[] = "CublasLtLinear::BackwardInput";
  if (absl::Status s = CheckDtype(kWhat, "in_dtype", a.in_dtype); !s.ok()) return s;
  if (absl::Status s = CheckOutputDtype(kWhat, "dx_dtype", a.in_dtype, a.dx_dtype); !s.ok()) {
    return s;
  }
  if (a.gelu_bias_grad != nullptr && a.gelu_input == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat,
                     ": gelu_bias_grad without gelu_input (the bias gradient comes with "
                     "the GELU derivative; pass both)"));
  }
  if (a.gelu_input != nullptr && a.gelu_input == a.dx) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": gelu_input aliases dx; dx is written while gelu_input is read"));
  }
  if (absl::Status s = CheckShape(kWhat, a.n, a.in, a.out); !s.ok()) return s;
  if (absl::Status s = CheckRowStride(kWhat, "ld_dy", a.ld_dy, a.out); !s.ok() || a.n == 0) {
    return s;
  }
  const int in_bytes = DTypeSize(a.in_dtype), dx_bytes = DTypeSize(a.dx_dtype);
  for (absl::Status s :
       {CheckBuffer(kWhat, "dx", a.dx, dx_bytes), CheckBuffer(kWhat, "dy", a.dy, in_bytes),
        CheckBuffer(kWhat, "w", a.w, in_bytes),
        CheckBuffer(kWhat, "gelu_input", a.gelu_input, dx_bytes, true),
        CheckBuffer(kWhat, "gelu_bias_grad", a.gelu_bias_grad, 4, true)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CublasLtLinear::CheckBackwardWeight(const BackwardWeightArgs& a) {
  static constexpr char kWhat[] = "CublasLtLinear::BackwardWeight";
  if (absl::Status s = CheckDtype(kWhat, "in_dtype", a.in_dtype); !s.ok()) return s;
  if (absl::Status s = CheckShape(kWhat, a.n, a.in, a.out); !s.ok()) return s;
  if (absl::Status s = CheckRowStride(kWhat, "ld_dy", a.ld_dy, a.out); !s.ok() || a.n == 0) {
    return s;
  }
  const int in_bytes = DTypeSize(a.in_dtype);
  for (absl::Status s :
       {CheckBuffer(kWhat, "dw", a.dw, 4), CheckBuffer(kWhat, "db", a.db, 4, /*optional=*/true),
        CheckBuffer(kWhat, "dy", a.dy, in_bytes), CheckBuffer(kWhat, "x", a.x, in_bytes)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace gpu
}  // namespace zeroshard
