#include "worker/model/model.h"

#include <cstring>

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "worker/model/model_util.h"

namespace zeroshard {

int64_t TensorView::elements() const {
  int64_t n = 1;  // a 0-d tensor holds one element
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<std::vector<int>> TensorsByUnit(const ModelSpec& spec) {
  std::vector<std::vector<int>> units;
  std::map<std::string, int> unit_of_label;
  for (int i = 0; i < static_cast<int>(spec.tensors.size()); ++i) {
    auto [it, inserted] =
        unit_of_label.emplace(spec.tensors[i].unit, static_cast<int>(units.size()));
    if (inserted) units.emplace_back();
    units[it->second].push_back(i);
  }
  return units;
}

absl::Status CheckUnitTensors(const ModelSpec& spec, const std::vector<int>& unit_tensors,
                              const UnitTensors& views, absl::string_view what) {
  if (views.size() != unit_tensors.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": got ", views.size(), " tensors, the unit has ", unit_tensors.size()));
  }
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorSpec& t = spec.tensors[unit_tensors[i]];
    if (views[i].data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", t.name, " has no data"));
    }
    if (views[i].shape != t.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", t.name, " has shape [", absl::StrJoin(views[i].shape, ","),
                       "], expected [", absl::StrJoin(t.shape, ","), "]"));
    }
  }
  return absl::OkStatus();
}

void OpSequencer::Reset() {
  forwards_done_ = 0;
  next_backward_ = -1;
}

absl::Status OpSequencer::CheckForward(int op) const {
  if (op < 0 || op >= num_ops_) {
    return absl::OutOfRangeError(absl::StrCat("forward op ", op, " not in [0, ", num_ops_, ")"));
  }
  if (op != 0 && op != forwards_done_) {
    return absl::FailedPreconditionError(
        absl::StrCat("forward op ", op, " out of order: next is ", forwards_done_));
  }
  return absl::OkStatus();
}

void OpSequencer::MarkForward(int op) {
  forwards_done_ = op + 1;
  next_backward_ = -1;
}

absl::Status OpSequencer::CheckBackward(int op) const {
  if (op < 0 || op >= num_ops_) {
    return absl::OutOfRangeError(absl::StrCat("backward op ", op, " not in [0, ", num_ops_, ")"));
  }
  if (forwards_done_ != num_ops_) {
    return absl::FailedPreconditionError(
        absl::StrCat("backward op ", op, " before the forward pass finished (", forwards_done_,
                     " of ", num_ops_, " ops ran)"));
  }
  if (op != num_ops_ - 1 && op != next_backward_) {
    return absl::FailedPreconditionError(
        absl::StrCat("backward op ", op, " out of order: next is ", next_backward_));
  }
  return absl::OkStatus();
}

void OpSequencer::MarkBackward(int op) { next_backward_ = op - 1; }

absl::Status Model::BackwardInto(int op, const UnitTensors& params, UnitTensors& grads,
                                 GradMode mode) {
  if (mode == GradMode::kOverwrite) {
    for (TensorView& g : grads) {
      if (g.data != nullptr) std::memset(g.data, 0, g.elements() * sizeof(float));
    }
  }
  return Backward(op, params, grads);
}

}  // namespace zeroshard
