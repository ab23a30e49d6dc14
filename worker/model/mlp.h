// A stack of square Linear layers trained with MSE: the benchmark model whose
// parameters are all big dense matrices.
//
// Equivalent PyTorch module (activation "relu", 3 layers):
//   nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
//                 nn.Linear(w, w))
// with loss nn.MSELoss()(model(x), y). Tensor names are the Sequential's
// state_dict names: Linear j is module 2j with an activation, j without.
#ifndef ZEROSHARD_WORKER_MODEL_MLP_H_
#define ZEROSHARD_WORKER_MODEL_MLP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "worker/model/init.h"
#include "worker/model/model.h"
#include "worker/model/model_util.h"

namespace zeroshard {

struct MlpConfig {
  int layers = 2;                   // Linear layers, >= 1
  int64_t width = 0;                // in = out features of every Linear
  std::string activation = "none";  // "none" | "relu" | "gelu" (exact)
};

// An MLP as the training task drives it: a Model plus its batch. MlpModel
// runs on the CPU; CudaMlpModel (//worker/cuda:cuda_mlp) on a GPU.
class RegressionModel : public Model {
 public:
  // The batch for the next pass: x and y are [rows, width] in host memory.
  // Both are copied, so the caller's buffers may change right after the
  // call. Resets the op order (the next call must be Forward(0)).
  virtual absl::Status SetBatch(const float* x, const float* y, int64_t rows) = 0;
  // The output [rows, width] of the last forward pass, in host memory.
  virtual absl::StatusOr<std::vector<float>> OutputToHost() const = 0;
};

class MlpModel : public RegressionModel {
 public:
  // INVALID_ARGUMENT for layers < 1, width < 1 or an unknown activation.
  static absl::StatusOr<std::unique_ptr<MlpModel>> Create(const MlpConfig& config);

  // The batch for the next pass: x and y are [rows, width]. Both are copied,
  // so the caller's buffers may change right after the call. Resets the op
  // order (the next call must be Forward(0)).
  absl::Status SetBatch(const float* x, const float* y, int64_t rows) override;

  // The model output [rows, width] of the last forward pass.
  const float* Output() const;
  absl::StatusOr<std::vector<float>> OutputToHost() const override {
    return std::vector<float>(Output(), Output() + rows_ * config_.width);
  }
  int64_t rows() const { return rows_; }
  const MlpConfig& config() const { return config_; }

  // Model. One op per Linear: op j uses unit j (Linear j's weight, bias);
  // the last op also computes the MSE loss.
  const ModelSpec& Spec() const override { return spec_; }
  const std::vector<int>& ForwardOps() const override { return forward_ops_; }
  absl::Status Forward(int op, const UnitTensors& params) override;
  absl::Status Backward(int op, const UnitTensors& params, UnitTensors& grads) override {
    return BackwardInto(op, params, grads, GradMode::kAdd);
  }
  // kOverwrite writes the Linear gradients directly (GEMM with beta 0).
  absl::Status BackwardInto(int op, const UnitTensors& params, UnitTensors& grads,
                            GradMode mode) override;
  double Loss() const override { return loss_; }
  int64_t ActivationBytes() const override;
  // PyTorch's nn.Linear default: weight and bias uniform in
  // [-1/sqrt(fan_in), 1/sqrt(fan_in)], fan_in = width. Unknown names: zeros.
  void InitRows(const TensorSpec& tensor, int64_t row_begin, int64_t row_end, uint64_t seed,
                float* out) const override;

 private:
  enum class Activation { kNone, kRelu, kGelu };

  // `spec`: MlpSpec of `config` (the model zoo's tensor list).
  MlpModel(const MlpConfig& config, Activation activation, ModelSpec spec);

  bool HasActivation(int layer) const {
    return activation_ != Activation::kNone && layer + 1 < config_.layers;
  }
  // The input [rows, width] of Linear j: x, or the previous layer's output.
  const float* LayerInput(int layer) const;

  MlpConfig config_;
  Activation activation_;
  ModelSpec spec_;
  std::vector<std::vector<int>> unit_tensors_;  // spec indices per unit
  std::vector<int> forward_ops_;
  OpSequencer sequencer_;

  // The batch (copied by SetBatch).
  int64_t rows_ = 0;
  std::vector<float> x_, y_;  // [rows, width]
  // Activations: z_[j] = Linear j's output; act_[j] = activation(z_[j]) for
  // layers with an activation (empty otherwise).
  std::vector<std::vector<float>> z_, act_;
  // Backward scratch [rows, width]: the gradient at the current op's output,
  // and the one it produces at its input (swapped after each op).
  std::vector<float> dout_, dinp_;
  double loss_ = 0.0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_MLP_H_
