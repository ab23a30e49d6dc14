#include "worker/cuda/cuda_mlp.h"

#include <cuda_runtime_api.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_device.h"

namespace zeroshard {

absl::StatusOr<std::unique_ptr<CudaMlpModel>> CudaMlpModel::Create(const MlpConfig& config,
                                                                   CudaBackend* backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("CudaMlpModel: null backend");
  auto host = MlpModel::Create(config);
  if (!host.ok()) return host.status();
  auto linear = gpu::CublasLinear::Create(backend->StreamForThisThread());
  if (!linear.ok()) return linear.status();
  std::unique_ptr<CudaMlpModel> model(
      new CudaMlpModel(std::move(*host), backend, std::move(*linear)));
  model->z_.resize(config.layers);
  model->act_.resize(config.layers);
  void* loss = nullptr;
  if (absl::Status s = CudaErrorToStatus(cudaMalloc(&loss, sizeof(double)), "CudaMlpModel loss");
      !s.ok()) {
    return s;
  }
  model->loss_ = static_cast<double*>(loss);
  return model;
}

CudaMlpModel::~CudaMlpModel() {
  cudaStreamSynchronize(backend_->StreamForThisThread());
  for (Array* a : {&x_, &y_, &dout_, &dinp_}) cudaFree(a->data);
  for (auto* arrays : {&z_, &act_}) {
    for (Array& a : *arrays) cudaFree(a.data);
  }
  cudaFree(loss_);
}

bool CudaMlpModel::HasActivation(int layer) const {
  return host_->config().activation != "none" && layer + 1 < host_->config().layers;
}

const float* CudaMlpModel::LayerInput(int layer) const {
  if (layer == 0) return x_.data;
  return HasActivation(layer - 1) ? act_[layer - 1].data : z_[layer - 1].data;
}

absl::Status CudaMlpModel::Ensure(float** buffer, int64_t* capacity, int64_t n) {
  if (*capacity >= n) return absl::OkStatus();
  cudaStreamSynchronize(backend_->StreamForThisThread());  // the old one may be in use
  cudaFree(*buffer);
  *buffer = nullptr;
  *capacity = 0;
  void* p = nullptr;
  if (absl::Status s = CudaErrorToStatus(cudaMalloc(&p, n * sizeof(float)),
                                         absl::StrCat("CudaMlpModel activations (", n, " floats)"));
      !s.ok()) {
    return s;
  }
  *buffer = static_cast<float*>(p);
  *capacity = n;
  return absl::OkStatus();
}

absl::Status CudaMlpModel::SetBatch(const float* x, const float* y, int64_t rows) {
  if (rows < 1) return absl::InvalidArgumentError(absl::StrCat("rows must be >= 1, got ", rows));
  const int64_t n = rows * host_->config().width;
  for (Array* a : {&x_, &y_, &dout_, &dinp_}) {
    if (absl::Status s = Ensure(&a->data, &a->capacity, n); !s.ok()) return s;
  }
  for (int j = 0; j < host_->config().layers; ++j) {
    if (absl::Status s = Ensure(&z_[j].data, &z_[j].capacity, n); !s.ok()) return s;
    if (HasActivation(j)) {
      if (absl::Status s = Ensure(&act_[j].data, &act_[j].capacity, n); !s.ok()) return s;
    }
  }
  // The host buffers may change after return: copy and wait.
  if (absl::Status s = backend_->CopyFromHost(x_.data, x, n * sizeof(float)); !s.ok()) return s;
  if (absl::Status s = backend_->CopyFromHost(y_.data, y, n * sizeof(float)); !s.ok()) return s;
  rows_ = rows;
  sequencer_.Reset();
  return absl::OkStatus();
}

absl::Status CudaMlpModel::Forward(int op, const UnitTensors& params) {
  if (rows_ == 0) return absl::FailedPreconditionError("CudaMlpModel::Forward before SetBatch");
  if (absl::Status s = sequencer_.CheckForward(op); !s.ok()) return s;
  if (params.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("op ", op, ": expected 2 parameter views"));
  }
  void* stream = backend_->StreamForThisThread();
  const int64_t w = host_->config().width;
  const int64_t n = rows_ * w;
  absl::Status s = linear_->Forward(z_[op].data, LayerInput(op), params[0].data, params[1].data,
                                    rows_, w, w, DType::kF32, gpu::CublasLinear::Layout::kOutIn);
  if (s.ok() && HasActivation(op)) {
    s = host_->config().activation == "relu"
            ? gpu::ReluForward(act_[op].data, z_[op].data, n, stream)
            : gpu::GeluForward(act_[op].data, z_[op].data, n, stream);
  }
  if (s.ok() && op == host_->config().layers - 1) {
    s = gpu::MseForward(loss_, z_[op].data, y_.data, n, stream);
  }
  if (!s.ok()) return s;
  sequencer_.MarkForward(op);
  return absl::OkStatus();
}

absl::Status CudaMlpModel::BackwardInto(int op, const UnitTensors& params, UnitTensors& grads,
                                        GradMode mode) {
  if (absl::Status s = sequencer_.CheckBackward(op); !s.ok()) return s;
  if (params.size() != 2 || grads.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("op ", op, ": expected 2 parameter and 2 gradient views"));
  }
  void* stream = backend_->StreamForThisThread();
  const int64_t w = host_->config().width;
  const int64_t n = rows_ * w;
  absl::Status s;
  if (op == host_->config().layers - 1) {
    s = gpu::MseBackward(dout_.data, z_[op].data, y_.data, n, stream);
  } else if (HasActivation(op)) {
    s = host_->config().activation == "relu"
            ? gpu::ReluBackward(dout_.data, dout_.data, z_[op].data, n, stream)
            : gpu::GeluBackward(dout_.data, dout_.data, z_[op].data, n, stream);
  }
  if (s.ok() && mode == GradMode::kOverwrite) {
    for (TensorView& g : grads) {
      s = CudaErrorToStatus(cudaMemsetAsync(g.data, 0, g.elements() * sizeof(float),
                                            static_cast<cudaStream_t>(stream)),
                            "CudaMlpModel: clearing gradients");
      if (!s.ok()) break;
    }
  }
  if (s.ok()) {
    float* dx = op > 0 ? dinp_.data : nullptr;
    s = linear_->Backward(dx, grads[0].data, grads[1].data, dout_.data, LayerInput(op),
                          params[0].data, rows_, w, w, DType::kF32,
                          gpu::CublasLinear::Layout::kOutIn);
  }
  if (!s.ok()) return s;
  std::swap(dout_, dinp_);
  sequencer_.MarkBackward(op);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> CudaMlpModel::OutputToHost() const {
  std::vector<float> out(rows_ * host_->config().width);
  if (out.empty()) return out;
  absl::Status s = backend_->CopyToHost(out.data(), z_.back().data, out.size() * sizeof(float));
  if (!s.ok()) return s;
  return out;
}

double CudaMlpModel::Loss() const {
  double loss = 0;
  if (!backend_->CopyToHost(&loss, loss_, sizeof(double)).ok()) return NAN;
  return loss;
}

int64_t CudaMlpModel::ActivationBytes() const {
  int64_t floats = x_.capacity + y_.capacity + dout_.capacity + dinp_.capacity;
  for (const auto* arrays : {&z_, &act_}) {
    for (const Array& a : *arrays) floats += a.capacity;
  }
  return floats * static_cast<int64_t>(sizeof(float));
}

}  // namespace zeroshard
