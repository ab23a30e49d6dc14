// Element types, named as safetensors names them ("F32", "BF16", ...).
#ifndef ZEROSHARD_COMMON_DTYPE_H_
#define ZEROSHARD_COMMON_DTYPE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

enum class DType { kF32, kBF16, kF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool };

// Bytes per element.
int DTypeSize(DType dtype);

// The safetensors name: "F32", "BF16", ...
std::string DTypeName(DType dtype);

// Parses a safetensors name (case-sensitive, as safetensors writes them).
// INVALID_ARGUMENT naming the value and the accepted names otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Conversions between f32 and the 16-bit float formats, rounding to nearest
// even (what PyTorch's .to(torch.bfloat16) / .half() do). NaN stays NaN.
uint16_t FloatToBF16(float value);
float BF16ToFloat(uint16_t bits);
uint16_t FloatToF16(float value);
float F16ToFloat(uint16_t bits);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_DTYPE_H_
