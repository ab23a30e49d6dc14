// Tests of GPT2Config (config.json) reading and writing: what a Hugging Face
// save_pretrained writes is accepted, configurations GptModel would compute
// differently are refused naming the key, and what we write reads back.
#include "common/hf_gpt2_config.h"

#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;

// transformers 4.45's save_pretrained of GPT2Config(n_layer=2, n_embd=128,
// n_head=4, n_positions=256).
constexpr char kSaved[] = R"({
  "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
  "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
  "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_embd": 128, "n_head": 4,
  "n_inner": null, "n_layer": 2, "n_positions": 256, "reorder_and_upcast_attn": false,
  "resid_pdrop": 0.1, "scale_attn_by_inverse_layer_idx": false, "scale_attn_weights": true,
  "torch_dtype": "float32", "use_cache": true, "vocab_size": 50257})";

std::string With(const std::string& key_value) {
  std::string json = kSaved;
  return json.substr(0, json.size() - 1) + ", " + key_value + "}";
}

TEST(HfGpt2ConfigTest, ReadsWhatSavePretrainedWrites) {
  absl::StatusOr<HfGpt2Config> c = ParseHfGpt2Config(kSaved, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->n_layer, 2);
  EXPECT_EQ(c->n_head, 4);
  EXPECT_EQ(c->n_embd, 128);
  EXPECT_EQ(c->n_positions, 256);
  EXPECT_EQ(c->vocab_size, 50257);
}

TEST(HfGpt2ConfigTest, RefusesWhatTheModelWouldComputeDifferently) {
  for (const std::string& bad :
       {std::string(R"("activation_function": "relu")"), std::string(R"("n_inner": 100)"),
        std::string(R"("tie_word_embeddings": false)"),
        std::string(R"("scale_attn_by_inverse_layer_idx": true)")}) {
    // A repeated key: nlohmann keeps the last value.
    absl::StatusOr<HfGpt2Config> c = ParseHfGpt2Config(With(bad), "dir/config.json");
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(c.status().message(), HasSubstr("dir/config.json")) << bad;
    EXPECT_THAT(c.status().message(), HasSubstr(bad.substr(0, bad.find(':')))) << bad;
  }
}

TEST(HfGpt2ConfigTest, AMissingSizeIsNamed) {
  absl::StatusOr<HfGpt2Config> c = ParseHfGpt2Config(R"({"model_type": "gpt2"})", "c.json");
  EXPECT_THAT(c.status().message(), HasSubstr("no \"n_layer\""));
  c = ParseHfGpt2Config(R"({"n_layer": 2, "n_head": 3, "n_embd": 128, "n_positions": 8,
                            "vocab_size": 9})",
                        "c.json");
  EXPECT_THAT(c.status().message(), HasSubstr("not a multiple of n_head 3"));
}

TEST(HfGpt2ConfigTest, WhatWeWriteReadsBack) {
  const HfGpt2Config small{3, 4, 96, 32, 256};
  absl::StatusOr<HfGpt2Config> c = ParseHfGpt2Config(HfGpt2ConfigJson(small), "ours");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->n_layer, 3);
  EXPECT_EQ(c->n_embd, 96);
  EXPECT_EQ(c->vocab_size, 256);
  // eos is the last token when the vocabulary has no GPT-2 end-of-text.
  EXPECT_THAT(HfGpt2GenerationConfigJson(small), HasSubstr("\"eos_token_id\": 255"));
  EXPECT_THAT(HfGpt2GenerationConfigJson({2, 4, 128, 256, 50257}),
              HasSubstr("\"eos_token_id\": 50256"));
}

}  // namespace
}  // namespace zeroshard
