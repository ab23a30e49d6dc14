#include "tests/testing/small_mlp.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/model_zoo.h"
#include "tests/testing/error_model.h"

namespace zeroshard::testing {

std::vector<std::string> SmallMlp::Flags(int steps, const std::vector<std::string>& extra) const {
  std::vector<std::string> flags = {"--model=mlp",
                                    absl::StrCat("--layers=", layers),
                                    absl::StrCat("--width=", width),
                                    absl::StrCat("--activation=", activation),
                                    absl::StrCat("--steps=", steps),
                                    absl::StrCat("--lr=", lr),
                                    absl::StrCat("--seed=", seed),
                                    "--checkpoint_at_end",
                                    "--collective_timeout=30s"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

Params SmallMlp::Load(const std::string& checkpoint_root, const std::string& job,
                      int step) const {
  return LoadCheckpointParams(checkpoint_root, job, step, *MlpSpec(layers, width, activation));
}

double SmallMlp::Bound(int steps, int rows, const Params& reference) const {
  TrainingErrorModel m;
  m.layers = layers;
  m.sum_length = std::max(width, rows);
  m.steps = steps;
  m.lr = lr;
  m.param_scale = SmallestTensorScale(reference);
  return AdamRelativeParamBound(m);
}

}  // namespace zeroshard::testing
