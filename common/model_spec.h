// The model as the planner sees it: an ordered list of named tensors.
#ifndef ZEROSHARD_COMMON_MODEL_SPEC_H_
#define ZEROSHARD_COMMON_MODEL_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

struct TensorSpec {
  std::string name;            // e.g. "0.weight", "transformer.h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // empty: a 0-d tensor (one element)
  std::string dtype = "F32";   // safetensors dtype name
  std::string unit;            // optional unit label (a layer); empty: packed by size

  // Elements in dim 0 (1 for a 0-d tensor) and per dim-0 row.
  int64_t Rows() const;
  int64_t RowElements() const;
  int64_t Elements() const;
};

// "[2000, 2000]"; "[]" for a 0-d shape. For messages.
std::string ShapeString(const std::vector<int64_t>& shape);

struct ModelSpec {
  std::vector<TensorSpec> tensors;
};

// JSON: {"tensors":[{"name":"0.weight","shape":[2000,2000],"dtype":"F32","unit":"0"}, ...]}
absl::StatusOr<ModelSpec> ParseModelSpecJson(absl::string_view json);
std::string ModelSpecToJson(const ModelSpec& spec);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_MODEL_SPEC_H_
