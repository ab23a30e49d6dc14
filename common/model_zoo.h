// Model specs of the benchmark models, with the tensor names PyTorch /
// Hugging Face give them, so checkpoints load into those frameworks as-is.
#ifndef ZEROSHARD_COMMON_MODEL_ZOO_H_
#define ZEROSHARD_COMMON_MODEL_ZOO_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace zeroshard {

// nn.Sequential of `layers` Linear(width, width), with `activation` ("none" |
// "relu" | "gelu") after every Linear but the last. Linear j is module j
// without activation, 2j with one; its "<module>.weight" [width, width] and
// "<module>.bias" [width] are unit "<module>". All F32.
// INVALID_ARGUMENT for layers < 1, width < 1 or an unknown activation.
absl::StatusOr<ModelSpec> MlpSpec(int layers, int64_t width, const std::string& activation);

// Hugging Face GPT2LMHeadModel state_dict (LM head tied to wte, so absent),
// in its order: wte [vocab, C], wpe [context, C], blocks "transformer.h.{i}.*"
// (unit "h.{i}"), ln_f. wte, wpe and ln_f form unit "embed". Conv1D weights
// are [in, out] as GPT-2 stores them. All F32.
// INVALID_ARGUMENT for non-positive values or d_model % heads != 0.
absl::StatusOr<ModelSpec> Gpt2Spec(int layers, int d_model, int heads, int vocab, int context);

// The shapes of OpenAI's GPT-2 releases (vocabulary 50,257, 1,024 positions).
struct Gpt2Shape {
  int layers = 0;
  int d_model = 0;
  int heads = 0;
  int vocab = 50257;
  int context = 1024;
};

// "124M" (12 layers, width 768, 12 heads), "355M" (24, 1024, 16), "774M"
// (36, 1280, 20) or "1.5B" (48, 1600, 25); INVALID_ARGUMENT naming them
// otherwise.
absl::StatusOr<Gpt2Shape> Gpt2Preset(const std::string& name);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_MODEL_ZOO_H_
