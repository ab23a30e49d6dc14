// Helpers shared by the concrete models: grouping a spec's tensors by unit,
// checking the views the engine hands in, and enforcing the op order that
// Model's contract requires.
#ifndef ZEROSHARD_WORKER_MODEL_MODEL_UTIL_H_
#define ZEROSHARD_WORKER_MODEL_MODEL_UTIL_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/model_spec.h"
#include "worker/model/model.h"

namespace zeroshard {

// For each unit (numbered by first appearance of its label, as Model::Spec
// documents), the indices into spec.tensors of its tensors, in spec order.
std::vector<std::vector<int>> TensorsByUnit(const ModelSpec& spec);

// OK iff `views` has one non-null view per tensor of the unit, each with the
// spec's shape. `what` ("params", "grads") names the argument in errors.
absl::Status CheckUnitTensors(const ModelSpec& spec, const std::vector<int>& unit_tensors,
                              const UnitTensors& views, absl::string_view what);

// Tracks which ops have run so Forward/Backward calls out of order fail with
// FAILED_PRECONDITION instead of reading stale activations.
// Forward: op 0 may run at any time (starting a new pass); op k > 0 only
// right after op k-1. Backward: only after all forwards; op n-1 may run at
// any time then (restarting the backward pass), op k < n-1 right after k+1.
class OpSequencer {
 public:
  explicit OpSequencer(int num_ops) : num_ops_(num_ops) {}

  // A new batch: no forward has run.
  void Reset();

  // Checks without changing state; Mark* records a completed op.
  absl::Status CheckForward(int op) const;
  void MarkForward(int op);
  absl::Status CheckBackward(int op) const;
  void MarkBackward(int op);

 private:
  int num_ops_;
  int forwards_done_ = 0;   // ops 0..forwards_done_-1 ran forward, in order
  int next_backward_ = -1;  // the op whose backward may run next; -1: none yet
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_MODEL_UTIL_H_
