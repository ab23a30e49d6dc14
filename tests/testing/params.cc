#include "tests/testing/params.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "worker/checkpoint/shard_checkpoint.h"

namespace zeroshard::testing {

Params LoadCheckpointParams(const std::string& root, const std::string& job, int64_t step,
                            const ModelSpec& spec) {
  Params params;
  auto reader = CheckpointReader::OpenStep(absl::StrCat(root, "/", CheckpointStepDir(job, step)));
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return params;
  for (const TensorSpec& t : spec.tensors) {
    std::vector<float> values(t.Elements());
    absl::Status s =
        (*reader)->ReadRows(CheckpointReader::Kind::kParams, t, 0, t.Rows(), values.data());
    EXPECT_TRUE(s.ok()) << s;
    params[t.name] = std::move(values);
  }
  return params;
}

Params LoadSafetensorsParams(const std::string& path) {
  Params params;
  auto reader = SafetensorsReader::Open(path);
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return params;
  for (const TensorInfo& t : (*reader)->tensors()) {
    std::vector<float> values(t.Elements());
    absl::Status s = (*reader)->ReadRowsAsF32(t.name, 0, t.Rows(), values.data());
    EXPECT_TRUE(s.ok()) << s;
    params[t.name] = std::move(values);
  }
  return params;
}

double MaxRelativeDifference(const Params& a, const Params& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (const auto& [name, values] : b) {
    auto it = a.find(name);
    if (it == a.end() || it->second.size() != values.size()) return INFINITY;
    double diff = 0, scale = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      double d = std::fabs(double(it->second[i]) - values[i]);
      if (!(d <= diff)) diff = d;  // NaN counts as worse
      scale = std::max(scale, std::fabs(double(values[i])));
    }
    worst = std::max(worst, diff / std::max(scale, 1e-12));
  }
  return worst;
}

double SmallestTensorScale(const Params& params) {
  double smallest = INFINITY;
  for (const auto& [name, values] : params) {
    double scale = 0;
    for (float v : values) scale = std::max(scale, std::fabs(double{v}));
    smallest = std::min(smallest, scale);
  }
  return smallest;
}

void ExpectWithinBound(double measured, double bound, const std::string& what) {
  std::fprintf(stderr, "%s: %.3g (bound %.3g, %.0f%% of it)\n", what.c_str(), measured, bound,
               100 * measured / bound);
  EXPECT_LE(measured, bound) << what;
}

}  // namespace zeroshard::testing
