#include "common/model_zoo.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

void Add(ModelSpec& spec, std::string name, std::vector<int64_t> shape, const std::string& unit) {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dtype = "F32";
  t.unit = unit;
  spec.tensors.push_back(std::move(t));
}

}  // namespace

absl::StatusOr<ModelSpec> MlpSpec(int layers, int64_t width, const std::string& activation) {
  if (layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("mlp: layers is ", layers, "; expected >= 1"));
  }
  if (width < 1) {
    return absl::InvalidArgumentError(absl::StrCat("mlp: width is ", width, "; expected >= 1"));
  }
  if (activation != "none" && activation != "relu" && activation != "gelu") {
    return absl::InvalidArgumentError(
        absl::StrCat("mlp: activation is \"", activation, "\"; expected none, relu or gelu"));
  }
  // An activation module sits between consecutive Linears, shifting indices.
  const int stride = activation == "none" ? 1 : 2;
  ModelSpec spec;
  for (int j = 0; j < layers; ++j) {
    const std::string module = absl::StrCat(j * stride);
    Add(spec, absl::StrCat(module, ".weight"), {width, width}, module);
    Add(spec, absl::StrCat(module, ".bias"), {width}, module);
  }
  return spec;
}

absl::StatusOr<ModelSpec> Gpt2Spec(int layers, int d_model, int heads, int vocab, int context) {
  const std::pair<const char*, int> values[] = {{"layers", layers},
                                                {"d_model", d_model},
                                                {"heads", heads},
                                                {"vocab", vocab},
                                                {"context", context}};
  for (const auto& [name, value] : values) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpt2: ", name, " is ", value, "; expected >= 1"));
    }
  }
  if (d_model % heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpt2: d_model ", d_model, " is not a multiple of heads ", heads));
  }
  const int64_t c = d_model;
  ModelSpec spec;
  Add(spec, "transformer.wte.weight", {vocab, c}, "embed");
  Add(spec, "transformer.wpe.weight", {context, c}, "embed");
  for (int i = 0; i < layers; ++i) {
    const std::string p = absl::StrCat("transformer.h.", i, ".");
    const std::string unit = absl::StrCat("h.", i);
    Add(spec, p + "ln_1.weight", {c}, unit);
    Add(spec, p + "ln_1.bias", {c}, unit);
    Add(spec, p + "attn.c_attn.weight", {c, 3 * c}, unit);
    Add(spec, p + "attn.c_attn.bias", {3 * c}, unit);
    Add(spec, p + "attn.c_proj.weight", {c, c}, unit);
    Add(spec, p + "attn.c_proj.bias", {c}, unit);
    Add(spec, p + "ln_2.weight", {c}, unit);
    Add(spec, p + "ln_2.bias", {c}, unit);
    Add(spec, p + "mlp.c_fc.weight", {c, 4 * c}, unit);
    Add(spec, p + "mlp.c_fc.bias", {4 * c}, unit);
    Add(spec, p + "mlp.c_proj.weight", {4 * c, c}, unit);
    Add(spec, p + "mlp.c_proj.bias", {c}, unit);
  }
  Add(spec, "transformer.ln_f.weight", {c}, "embed");
  Add(spec, "transformer.ln_f.bias", {c}, "embed");
  return spec;
}

absl::StatusOr<Gpt2Shape> Gpt2Preset(const std::string& name) {
  if (name == "124M") return Gpt2Shape{12, 768, 12};
  if (name == "355M") return Gpt2Shape{24, 1024, 16};
  if (name == "774M") return Gpt2Shape{36, 1280, 20};
  if (name == "1.5B") return Gpt2Shape{48, 1600, 25};
  return absl::InvalidArgumentError(
      absl::StrCat("GPT-2 preset \"", name, "\" is unknown; expected 124M, 355M, 774M or 1.5B"));
}

}  // namespace zeroshard
