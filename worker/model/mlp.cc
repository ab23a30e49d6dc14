#include "worker/model/mlp.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/model_zoo.h"
#include "worker/model/layers.h"

namespace zeroshard {

absl::StatusOr<std::unique_ptr<MlpModel>> MlpModel::Create(const MlpConfig& config) {
  if (config.layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("MLP layers must be >= 1, got ", config.layers));
  }
  if (config.width < 1) {
    return absl::InvalidArgumentError(absl::StrCat("MLP width must be >= 1, got ", config.width));
  }
  Activation activation;
  if (config.activation == "none") {
    activation = Activation::kNone;
  } else if (config.activation == "relu") {
    activation = Activation::kRelu;
  } else if (config.activation == "gelu") {
    activation = Activation::kGelu;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("MLP activation must be none, relu or gelu, got \"", config.activation, "\""));
  }
  // The tensors are the model zoo's (nn.Sequential names: with an
  // activation, Linear j is module 2j), so that the spec shardctl plans is
  // the one this model trains.
  absl::StatusOr<ModelSpec> spec = MlpSpec(config.layers, config.width, config.activation);
  if (!spec.ok()) return spec.status();
  return std::unique_ptr<MlpModel>(new MlpModel(config, activation, *std::move(spec)));
}

MlpModel::MlpModel(const MlpConfig& config, Activation activation, ModelSpec spec)
    : config_(config), activation_(activation), spec_(std::move(spec)), sequencer_(config.layers) {
  for (int j = 0; j < config.layers; ++j) forward_ops_.push_back(j);
  unit_tensors_ = TensorsByUnit(spec_);
  z_.resize(config.layers);
  act_.resize(config.layers);
}

absl::Status MlpModel::SetBatch(const float* x, const float* y, int64_t rows) {
  if (rows < 1) return absl::InvalidArgumentError(absl::StrCat("rows must be >= 1, got ", rows));
  const int64_t n = rows * config_.width;
  rows_ = rows;
  x_.assign(x, x + n);
  y_.assign(y, y + n);
  for (int j = 0; j < config_.layers; ++j) {
    z_[j].resize(n);
    act_[j].resize(HasActivation(j) ? n : 0);
  }
  dout_.resize(n);
  dinp_.resize(n);
  loss_ = 0.0;
  sequencer_.Reset();
  return absl::OkStatus();
}

const float* MlpModel::LayerInput(int layer) const {
  if (layer == 0) return x_.data();
  return HasActivation(layer - 1) ? act_[layer - 1].data() : z_[layer - 1].data();
}

const float* MlpModel::Output() const { return z_.back().data(); }

absl::Status MlpModel::Forward(int op, const UnitTensors& params) {
  if (rows_ == 0) return absl::FailedPreconditionError("MlpModel::Forward before SetBatch");
  if (absl::Status s = sequencer_.CheckForward(op); !s.ok()) return s;
  if (absl::Status s = CheckUnitTensors(spec_, unit_tensors_[op], params, "params"); !s.ok()) {
    return s;
  }
  const int64_t w = config_.width;
  const int64_t n = rows_ * w;
  const float* weight = params[0].data;
  const float* bias = params[1].data;

  LinearForward(z_[op].data(), LayerInput(op), weight, bias, rows_, w, w);
  if (HasActivation(op)) {
    if (activation_ == Activation::kRelu) {
      ReluForward(act_[op].data(), z_[op].data(), n);
    } else {
      GeluForward(act_[op].data(), z_[op].data(), n);
    }
  }
  if (op == config_.layers - 1) loss_ = MseForward(z_[op].data(), y_.data(), n);

  sequencer_.MarkForward(op);
  return absl::OkStatus();
}

absl::Status MlpModel::BackwardInto(int op, const UnitTensors& params, UnitTensors& grads,
                                    GradMode mode) {
  if (absl::Status s = sequencer_.CheckBackward(op); !s.ok()) return s;
  if (absl::Status s = CheckUnitTensors(spec_, unit_tensors_[op], params, "params"); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckUnitTensors(spec_, unit_tensors_[op], grads, "grads"); !s.ok()) {
    return s;
  }
  const int64_t w = config_.width;
  const int64_t n = rows_ * w;

  // dout_ becomes d(loss)/d(z_op).
  if (op == config_.layers - 1) {
    MseBackward(dout_.data(), z_[op].data(), y_.data(), n);
  } else if (HasActivation(op)) {
    // dout_ holds d(loss)/d(act_op) from op+1; in place through the activation.
    if (activation_ == Activation::kRelu) {
      ReluBackward(dout_.data(), dout_.data(), z_[op].data(), n);
    } else {
      GeluBackward(dout_.data(), dout_.data(), z_[op].data(), n);
    }
  }
  // The first layer's input is data: no gradient needed.
  float* dx = op > 0 ? dinp_.data() : nullptr;
  LinearBackward(dx, grads[0].data, grads[1].data, dout_.data(), LayerInput(op), params[0].data,
                 rows_, w, w, /*accumulate=*/mode == GradMode::kAdd);
  std::swap(dout_, dinp_);  // op-1 continues from d(loss)/d(its output)

  sequencer_.MarkBackward(op);
  return absl::OkStatus();
}

int64_t MlpModel::ActivationBytes() const {
  int64_t floats = x_.size() + y_.size() + dout_.size() + dinp_.size();
  for (int j = 0; j < config_.layers; ++j) floats += z_[j].size() + act_[j].size();
  return floats * static_cast<int64_t>(sizeof(float));
}

void MlpModel::InitRows(const TensorSpec& tensor, int64_t row_begin, int64_t row_end, uint64_t seed,
                        float* out) const {
  const int64_t row_elements = tensor.RowElements();
  const int64_t first = row_begin * row_elements;
  const int64_t count = (row_end - row_begin) * row_elements;
  bool known = false;
  for (const TensorSpec& t : spec_.tensors) known = known || t.name == tensor.name;
  if (!known) {
    FillConstant(0.0f, count, out);
    return;
  }
  const float bound = 1.0f / std::sqrt(static_cast<float>(config_.width));
  FillInit(InitRule::Uniform(-bound, bound), seed, tensor.name, first, count, out);
}

}  // namespace zeroshard
