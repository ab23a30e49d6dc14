// A model as the ZeRO engine drives it: a sequence of ops, each using the
// parameters of one unit, with explicit forward and backward. The engine owns
// every parameter and gradient byte; the model only sees views the engine
// hands in for the duration of one call, and owns its activations.
#ifndef ZEROSHARD_WORKER_MODEL_MODEL_H_
#define ZEROSHARD_WORKER_MODEL_MODEL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/model_spec.h"

namespace zeroshard {

// A dense row-major f32 tensor owned by someone else.
struct TensorView {
  float* data = nullptr;
  std::vector<int64_t> shape;
  int64_t elements() const;
};

// The tensors of one unit, in the order Spec() lists that unit's tensors.
using UnitTensors = std::vector<TensorView>;

class Model {
 public:
  virtual ~Model() = default;

  // Every parameter tensor, in a fixed order, each labelled with its unit.
  // Units are numbered by the first appearance of their label.
  virtual const ModelSpec& Spec() const = 0;

  // The forward pass as ops; ForwardOps()[k] is the unit whose parameters op
  // k uses. A unit may appear more than once (e.g. a tied embedding used by
  // the first and the last op).
  virtual const std::vector<int>& ForwardOps() const = 0;

  // Runs op k forward on the current batch (set through the concrete model).
  // REQUIRES: ops are run in order 0..n-1.
  virtual absl::Status Forward(int op, const UnitTensors& params) = 0;

  // Runs op k backward and ADDS d(loss)/d(params) into `grads` (same shapes as
  // params). REQUIRES: all forwards ran; ops are run in order n-1..0.
  virtual absl::Status Backward(int op, const UnitTensors& params, UnitTensors& grads) = 0;

  // Backward with a choice: kAdd is Backward; kOverwrite is for `grads` that
  // hold garbage (a fresh buffer, the first op of a unit in a micro-batch)
  // and makes them d(loss)/d(params) of this op alone. The default zeroes
  // `grads` (host memory) and adds; models override it to write instead (no
  // clearing pass); device models must override it.
  enum class GradMode { kAdd, kOverwrite };
  virtual absl::Status BackwardInto(int op, const UnitTensors& params, UnitTensors& grads,
                                    GradMode mode);

  // Loss of the last forward pass: the mean over the batch.
  virtual double Loss() const = 0;

  // Bytes of activations currently held (for memory accounting).
  virtual int64_t ActivationBytes() const = 0;

  // Writes the initial values of rows [row_begin, row_end) of `tensor` into
  // `out`. Depends only on (seed, tensor name, element index): every world
  // size initializes the same model, each rank computing only its rows.
  virtual void InitRows(const TensorSpec& tensor, int64_t row_begin, int64_t row_end,
                        uint64_t seed, float* out) const = 0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_MODEL_H_
