#include "common/model_spec.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace zeroshard {

using OrderedJson = nlohmann::ordered_json;

int64_t TensorSpec::Rows() const { return shape.empty() ? 1 : shape[0]; }

int64_t TensorSpec::RowElements() const {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

int64_t TensorSpec::Elements() const { return Rows() * RowElements(); }

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

namespace {

// For messages: a short rendering of a JSON value ("-3", "\"F32\"", "an array").
std::string Describe(const OrderedJson& value) {
  if (value.is_structured()) return absl::StrCat("a JSON ", value.type_name());
  std::string text = value.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
  if (text.size() > 60) text = absl::StrCat(text.substr(0, 57), "...");
  return text;
}

// "tensor 3 (\"0.weight\")" or "tensor 3" while the name is still unknown.
std::string Where(size_t index, const std::string* name) {
  if (name == nullptr) return absl::StrCat("tensor ", index);
  return absl::StrCat("tensor ", index, " (\"", *name, "\")");
}

absl::StatusOr<TensorSpec> ParseTensor(const OrderedJson& item, size_t index) {
  if (!item.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("model spec: ", Where(index, nullptr),
                                                   ": expected an object, got ", Describe(item)));
  }
  TensorSpec tensor;
  auto name_it = item.find("name");
  if (name_it == item.end() || !name_it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model spec: ", Where(index, nullptr), ": \"name\" ",
                     name_it == item.end() ? "is missing" : absl::StrCat("is ", Describe(*name_it)),
                     "; expected a string"));
  }
  tensor.name = name_it->get<std::string>();
  const std::string where = absl::StrCat("model spec: ", Where(index, &tensor.name));

  for (auto it = item.begin(); it != item.end(); ++it) {
    const std::string& key = it.key();
    if (key != "name" && key != "shape" && key != "dtype" && key != "unit") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": unknown field \"", key, "\"; expected name, shape, dtype, unit"));
    }
  }

  auto shape_it = item.find("shape");
  if (shape_it == item.end() || !shape_it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": \"shape\" ",
        shape_it == item.end() ? "is missing" : absl::StrCat("is ", Describe(*shape_it)),
        "; expected an array of integers"));
  }
  for (size_t d = 0; d < shape_it->size(); ++d) {
    const OrderedJson& dim = (*shape_it)[d];
    // Unsigned values above INT64_MAX would wrap; refuse them here. Negative
    // dims are a semantic error left to the planner.
    const bool fits =
        dim.is_number_integer() &&
        (!dim.is_number_unsigned() || dim.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX));
    if (!fits) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": shape[", d, "] is ", Describe(dim),
                                                     "; expected a 64-bit integer"));
    }
    tensor.shape.push_back(dim.get<int64_t>());
  }

  // Optional strings: dtype defaults to "F32", unit to "".
  for (auto [key, field] : {std::pair<const char*, std::string*>{"dtype", &tensor.dtype},
                            std::pair<const char*, std::string*>{"unit", &tensor.unit}}) {
    auto it = item.find(key);
    if (it == item.end()) continue;
    if (!it->is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": \"", key, "\" is ", Describe(*it), "; expected a string"));
    }
    *field = it->get<std::string>();
  }
  return tensor;
}

}  // namespace

absl::StatusOr<ModelSpec> ParseModelSpecJson(absl::string_view json) {
  OrderedJson root;
  try {
    root = OrderedJson::parse(json.begin(), json.end());
  } catch (const OrderedJson::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("model spec: not valid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model spec: expected a JSON object {\"tensors\": [...]}, got ", Describe(root)));
  }
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() != "tensors") {
      return absl::InvalidArgumentError(
          absl::StrCat("model spec: unknown top-level field \"", it.key(), "\"; expected tensors"));
    }
  }
  auto tensors_it = root.find("tensors");
  if (tensors_it == root.end() || !tensors_it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model spec: \"tensors\" ",
        tensors_it == root.end() ? "is missing" : absl::StrCat("is ", Describe(*tensors_it)),
        "; expected an array of tensor objects"));
  }
  ModelSpec spec;
  spec.tensors.reserve(tensors_it->size());
  for (size_t i = 0; i < tensors_it->size(); ++i) {
    absl::StatusOr<TensorSpec> tensor = ParseTensor((*tensors_it)[i], i);
    if (!tensor.ok()) return tensor.status();
    spec.tensors.push_back(*std::move(tensor));
  }
  return spec;
}

std::string ModelSpecToJson(const ModelSpec& spec) {
  OrderedJson tensors = OrderedJson::array();
  for (const TensorSpec& t : spec.tensors) {
    OrderedJson item = OrderedJson::object();
    item["name"] = t.name;
    item["shape"] = t.shape;
    item["dtype"] = t.dtype;
    item["unit"] = t.unit;
    tensors.push_back(std::move(item));
  }
  OrderedJson root = OrderedJson::object();
  root["tensors"] = std::move(tensors);
  // Replace invalid UTF-8 rather than throw: this function cannot fail.
  return root.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

}  // namespace zeroshard
