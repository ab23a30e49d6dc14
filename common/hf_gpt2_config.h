// Hugging Face's GPT2Config (config.json), both ways: what --init_from=DIR
// reads to shape the model, and what `shardctl consolidate --format=hf`
// writes beside the weights so that GPT2LMHeadModel.from_pretrained loads
// them.
//
// Only configurations our GptModel computes exactly are accepted: GELU with
// the tanh approximation ("gelu_new" or "gelu_pytorch_tanh"), LayerNorm eps
// 1e-5, an MLP of 4 x n_embd, the LM head tied to wte, attention scaled by
// 1/sqrt(head size) and not by layer index. Anything else is an error naming
// the key, rather than a model that silently computes something else.
#ifndef ZEROSHARD_COMMON_HF_GPT2_CONFIG_H_
#define ZEROSHARD_COMMON_HF_GPT2_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

struct HfGpt2Config {
  int n_layer = 0;
  int n_head = 0;
  int64_t n_embd = 0;
  int64_t n_positions = 0;  // rows of wpe
  int64_t vocab_size = 0;   // rows of wte
};

// Parses config.json text; `source` names it in messages. INVALID_ARGUMENT
// naming the key for a missing or bad value or a configuration outside the
// set above.
absl::StatusOr<HfGpt2Config> ParseHfGpt2Config(absl::string_view json, const std::string& source);

// Reads DIR/config.json (errors as ParseHfGpt2Config, or reading the file).
absl::StatusOr<HfGpt2Config> ReadHfGpt2Config(const std::string& dir);

// config.json for `config`: a complete GPT2Config (architectures
// GPT2LMHeadModel, no dropout, eos/bos 50256 when the vocabulary has it,
// else the last token).
std::string HfGpt2ConfigJson(const HfGpt2Config& config);

// generation_config.json to go with it.
std::string HfGpt2GenerationConfigJson(const HfGpt2Config& config);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_HF_GPT2_CONFIG_H_
