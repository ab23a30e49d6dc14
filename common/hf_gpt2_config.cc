#include "common/hf_gpt2_config.h"

#include <cmath>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "nlohmann/json.hpp"

namespace zeroshard {
namespace {

// GPT-2's end-of-text token, its bos and eos.
constexpr int64_t kGpt2EndOfText = 50256;

absl::Status Bad(const std::string& source, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", why));
}

// The largest value of each size: every one is an int somewhere (layers,
// heads, the model width, the context, token ids), so checked before any
// cast (#44 finding 9: n_layer 2^32+1 was cast to 1 and trained). Whether
// the model fits the machine is the worker's check (worker_config.h).
constexpr int64_t kMaxSize = (int64_t{1} << 31) - 1;

// A positive integer at `key` (required), at most kMaxSize.
absl::StatusOr<int64_t> PositiveInt(const nlohmann::json& j, const char* key,
                                    const std::string& source) {
  if (!j.contains(key)) return Bad(source, absl::StrCat("no \"", key, "\""));
  const nlohmann::json& v = j[key];
  // An unsigned value above int64's range reads as negative: refused too.
  if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > kMaxSize) {
    return Bad(source, absl::StrCat("\"", key, "\" is ", v.dump(), "; expected an integer in [1, ",
                                    kMaxSize, "]"));
  }
  return v.get<int64_t>();
}

// The value at `key` must be one of what GptModel computes (absent: the
// GPT2Config default, which GptModel computes).
absl::Status Expect(const nlohmann::json& j, const char* key,
                    std::initializer_list<nlohmann::json> accepted, const std::string& source) {
  if (!j.contains(key)) return absl::OkStatus();
  for (const nlohmann::json& a : accepted) {
    if (j[key] == a) return absl::OkStatus();
  }
  std::string expected;
  for (const nlohmann::json& a : accepted) {
    absl::StrAppend(&expected, expected.empty() ? "" : " or ", a.dump());
  }
  return Bad(source, absl::StrCat("\"", key, "\" is ", j[key].dump(), "; zeroshard's GPT-2 needs ",
                                  expected));
}

}  // namespace

absl::StatusOr<HfGpt2Config> ParseHfGpt2Config(absl::string_view json, const std::string& source) {
  nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Bad(source, "not a JSON object");
  if (absl::Status s = Expect(j, "model_type", {"gpt2"}, source); !s.ok()) return s;
  HfGpt2Config c;
  absl::StatusOr<int64_t> v = PositiveInt(j, "n_layer", source);
  if (!v.ok()) return v.status();
  c.n_layer = static_cast<int>(*v);
  if (v = PositiveInt(j, "n_head", source); !v.ok()) return v.status();
  c.n_head = static_cast<int>(*v);
  if (v = PositiveInt(j, "n_embd", source); !v.ok()) return v.status();
  c.n_embd = *v;
  if (v = PositiveInt(j, "n_positions", source); !v.ok()) return v.status();
  c.n_positions = *v;
  if (v = PositiveInt(j, "vocab_size", source); !v.ok()) return v.status();
  c.vocab_size = *v;
  if (c.n_embd % c.n_head != 0) {
    return Bad(source, absl::StrCat("n_embd ", c.n_embd, " is not a multiple of n_head ", c.n_head));
  }
  for (absl::Status s : {
           Expect(j, "activation_function", {"gelu_new", "gelu_pytorch_tanh"}, source),
           Expect(j, "n_inner", {nullptr, 4 * c.n_embd}, source),
           Expect(j, "tie_word_embeddings", {true}, source),
           Expect(j, "scale_attn_weights", {true}, source),
           Expect(j, "scale_attn_by_inverse_layer_idx", {false}, source),
           Expect(j, "add_cross_attention", {false}, source),
       }) {
    if (!s.ok()) return s;
  }
  if (j.contains("layer_norm_epsilon")) {
    const nlohmann::json& eps = j["layer_norm_epsilon"];
    if (!eps.is_number() || std::fabs(eps.get<double>() - 1e-5) > 1e-12) {
      return Bad(source, absl::StrCat("\"layer_norm_epsilon\" is ", eps.dump(),
                                      "; zeroshard's GPT-2 needs 1e-05"));
    }
  }
  return c;
}

absl::StatusOr<HfGpt2Config> ReadHfGpt2Config(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/config.json");
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  return ParseHfGpt2Config(*text, path);
}

namespace {

int64_t EndOfText(const HfGpt2Config& c) {
  return c.vocab_size > kGpt2EndOfText ? kGpt2EndOfText : c.vocab_size - 1;
}

}  // namespace

std::string HfGpt2ConfigJson(const HfGpt2Config& c) {
  nlohmann::ordered_json j;
  j["architectures"] = {"GPT2LMHeadModel"};
  j["model_type"] = "gpt2";
  j["vocab_size"] = c.vocab_size;
  j["n_positions"] = c.n_positions;
  j["n_ctx"] = c.n_positions;
  j["n_embd"] = c.n_embd;
  j["n_layer"] = c.n_layer;
  j["n_head"] = c.n_head;
  j["n_inner"] = nullptr;
  j["activation_function"] = "gelu_new";
  j["layer_norm_epsilon"] = 1e-5;
  j["initializer_range"] = 0.02;
  // The worker trains without dropout.
  j["resid_pdrop"] = 0.0;
  j["embd_pdrop"] = 0.0;
  j["attn_pdrop"] = 0.0;
  j["scale_attn_weights"] = true;
  j["scale_attn_by_inverse_layer_idx"] = false;
  j["reorder_and_upcast_attn"] = false;
  j["tie_word_embeddings"] = true;
  j["bos_token_id"] = EndOfText(c);
  j["eos_token_id"] = EndOfText(c);
  j["torch_dtype"] = "float32";
  j["use_cache"] = true;
  return j.dump(2) + "\n";
}

std::string HfGpt2GenerationConfigJson(const HfGpt2Config& c) {
  nlohmann::ordered_json j;
  j["bos_token_id"] = EndOfText(c);
  j["eos_token_id"] = EndOfText(c);
  return j.dump(2) + "\n";
}

}  // namespace zeroshard
