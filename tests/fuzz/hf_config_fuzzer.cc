// Hugging Face config.json (--init_from=DIR): any bytes give a config or an
// error, never a crash; an accepted config written back by HfGpt2ConfigJson
// parses to the same config.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "common/hf_gpt2_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<zeroshard::HfGpt2Config> config = zeroshard::ParseHfGpt2Config(text, "fuzz");
  if (!config.ok()) return 0;
  absl::StatusOr<zeroshard::HfGpt2Config> again =
      zeroshard::ParseHfGpt2Config(zeroshard::HfGpt2ConfigJson(*config), "written");
  if (!again.ok() || again->n_layer != config->n_layer || again->n_head != config->n_head ||
      again->n_embd != config->n_embd || again->n_positions != config->n_positions ||
      again->vocab_size != config->vocab_size) {
    std::abort();  // what we write must read back as what we read
  }
  return 0;
}
