#include "worker/data/batch_layout.h"

#include <climits>

#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::Status BatchLayout::Check() const {
  if (world < 1 || data_world < 1 || data_accum < 1 || MicroBatches() > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad batch layout: ", world, " rank(s) taking the micro-batches of ", data_world,
        " rank(s) x ", data_accum, " (need each >= 1 and their product below 2^31)"));
  }
  return absl::OkStatus();
}

std::string BatchLayout::Describe() const {
  return absl::StrCat(MicroBatches(), " micro-batches (", data_world, " ranks x ", data_accum,
                      ") over ", world, " rank(s)");
}

}  // namespace zeroshard
