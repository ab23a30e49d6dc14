#include "worker/nonfinite_policy.h"

#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

// The payload that marks the stop (IsNonFiniteStop).
constexpr char kStopPayload[] = "zeroshard.dev/nonfinite-stop";

}  // namespace

absl::Status ParseOnNonFinite(const std::string& value, OnNonFinite* out) {
  if (value == "stop") {
    *out = OnNonFinite::kStop;
  } else if (value == "skip") {
    *out = OnNonFinite::kSkip;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--on_nonfinite=", value,
        ": expected stop (exit at a step whose loss or gradient norm is not finite) or skip "
        "(drop that step's update and go on)"));
  }
  return absl::OkStatus();
}

bool IsNonFiniteStop(const absl::Status& status) {
  return status.GetPayload(kStopPayload).has_value();
}

absl::Status MarkNumericalStop(absl::Status status) {
  status.SetPayload(kStopPayload, absl::Cord("1"));
  return status;
}

absl::Status NonFinitePolicy::Judge(int64_t step, int64_t steps, const StepVerdict& verdict,
                                    const std::string& samples) {
  if (!verdict.bad()) {
    skipped_in_a_row_ = 0;
    return absl::OkStatus();
  }
  // Numbered as the progress lines number it: "step 4/10" is 0-based step 3.
  const std::string what =
      absl::StrCat("step ", step + 1, "/", steps, ": ", verdict.Describe(),
                   samples.empty() ? "" : absl::StrCat(" (its data: ", samples, ")"));
  absl::Status stop;
  if (config_.on_nonfinite == OnNonFinite::kStop) {
    stop = absl::FailedPreconditionError(absl::StrCat(
        what,
        "; stopping (--on_nonfinite=stop): no parameter or optimizer state took this step's "
        "update. Find the cause (the data rows, the learning rate), or pass --on_nonfinite=skip to "
        "drop such steps"));
  } else if (skipped_in_a_row_ + 1 > config_.max_skipped_steps) {
    stop = absl::FailedPreconditionError(absl::StrCat(
        what, "; stopping: ", skipped_in_a_row_ + 1,
        " steps in a row were not finite (--max_skipped_steps=", config_.max_skipped_steps,
        "), so the run is no longer training"));
  }
  if (!stop.ok()) return MarkNumericalStop(std::move(stop));
  ++skipped_in_a_row_;
  ++skipped_total_;
  last_skip_ = absl::StrCat(what, "; skipped (--on_nonfinite=skip): nothing was updated (",
                            skipped_total_, " skipped in all, ", skipped_in_a_row_, " in a row)");
  return absl::OkStatus();
}

}  // namespace zeroshard
