#include "common/checkpoint_format.h"

#include <cstdint>
#include <climits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace zeroshard {

std::string CheckpointStepDir(absl::string_view job, int64_t step) {
  return absl::StrCat(job, "/step-", step);
}

std::string CheckpointShardFileName(int rank, int world_size) {
  return absl::StrCat("rank-", rank, "-of-", world_size, ".safetensors");
}

// Canonical decimal only ("7", not "07", "+7" or " 7"): a name parses only
// if the name made from what it parses to is the same name.
bool ParseCanonical(absl::string_view text, int64_t* out) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 0 || absl::StrCat(value) != text) return false;
  *out = value;
  return true;
}

bool ParseCheckpointStepDirName(absl::string_view name, int64_t* step) {
  return absl::ConsumePrefix(&name, "step-") && ParseCanonical(name, step);
}

bool ParseCheckpointShardFileName(absl::string_view name, int* rank, int* world_size) {
  if (!absl::ConsumePrefix(&name, "rank-") || !absl::ConsumeSuffix(&name, ".safetensors")) {
    return false;
  }
  const size_t of = name.find("-of-");
  int64_t r = 0, w = 0;
  if (of == absl::string_view::npos || !ParseCanonical(name.substr(0, of), &r) ||
      !ParseCanonical(name.substr(of + 4), &w) || r >= w || w > INT32_MAX) {
    return false;
  }
  *rank = static_cast<int>(r);
  *world_size = static_cast<int>(w);
  return true;
}

std::string CheckpointShardPath(absl::string_view job, int64_t step, int rank, int world_size) {
  return absl::StrCat(CheckpointStepDir(job, step), "/", CheckpointShardFileName(rank, world_size));
}

std::string CheckpointManifestPath(absl::string_view job, int64_t step) {
  return absl::StrCat(CheckpointStepDir(job, step), "/", kManifestFileName);
}

std::string ConsolidatedDir(absl::string_view job, int64_t step) {
  return absl::StrCat(job, "/consolidated/step-", step);
}

absl::string_view ShardTensorPrefix(ShardTensorKind kind) {
  switch (kind) {
    case ShardTensorKind::kParams:
      return "";
    case ShardTensorKind::kExpAvg:
      return kExpAvgPrefix;
    case ShardTensorKind::kExpAvgSq:
      return kExpAvgSqPrefix;
    case ShardTensorKind::kOuterAnchor:
      return kOuterAnchorPrefix;
    case ShardTensorKind::kOuterMomentum:
      return kOuterMomentumPrefix;
  }
  return "";
}

std::string ShardTensorName(ShardTensorKind kind, absl::string_view tensor, int64_t row_begin,
                            int64_t row_end) {
  return absl::StrCat(ShardTensorPrefix(kind), tensor, ":", row_begin, "-", row_end);
}

bool ParseShardTensorName(absl::string_view name, ParsedShardTensorName* out) {
  ParsedShardTensorName parsed;
  const absl::string_view full = name;
  // The longer prefix first: "optim.exp_avg." is a prefix of "optim.exp_avg_sq.".
  if (absl::ConsumePrefix(&name, kExpAvgSqPrefix)) {
    parsed.kind = ShardTensorKind::kExpAvgSq;
  } else if (absl::ConsumePrefix(&name, kExpAvgPrefix)) {
    parsed.kind = ShardTensorKind::kExpAvg;
  } else if (absl::ConsumePrefix(&name, kOuterAnchorPrefix)) {
    parsed.kind = ShardTensorKind::kOuterAnchor;
  } else if (absl::ConsumePrefix(&name, kOuterMomentumPrefix)) {
    parsed.kind = ShardTensorKind::kOuterMomentum;
  }
  size_t colon = name.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return false;
  absl::string_view rows = name.substr(colon + 1);
  size_t dash = rows.find('-');
  if (dash == absl::string_view::npos) return false;
  if (!absl::SimpleAtoi(rows.substr(0, dash), &parsed.row_begin) ||
      !absl::SimpleAtoi(rows.substr(dash + 1), &parsed.row_end)) {
    return false;
  }
  // SimpleAtoi accepts a sign and spaces; the canonical form has neither.
  if (ShardTensorName(parsed.kind, name.substr(0, colon), parsed.row_begin, parsed.row_end) !=
      full) {
    return false;
  }
  if (parsed.row_begin < 0 || parsed.row_end <= parsed.row_begin) return false;
  parsed.tensor = std::string(name.substr(0, colon));
  *out = std::move(parsed);
  return true;
}

}  // namespace zeroshard
