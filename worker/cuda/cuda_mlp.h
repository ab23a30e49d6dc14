// The MLP of worker/model/mlp.h on a CUDA device: the same spec, tensor
// names, initialization and op order, with activations in device memory,
// Linear through cuBLAS and the elementwise kernels of kernels.h, launched
// on the compute thread's stream of a CudaBackend (the engine hands it views
// of device buffers). Results match the CPU model to float rounding.
#ifndef ZEROSHARD_WORKER_CUDA_CUDA_MLP_H_
#define ZEROSHARD_WORKER_CUDA_CUDA_MLP_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/kernels.h"
#include "worker/model/mlp.h"

namespace zeroshard {

class CudaMlpModel : public RegressionModel {
 public:
  // INVALID_ARGUMENT for a bad config (as MlpModel); CUDA errors otherwise.
  // `backend` is not owned; every call must come from one thread (the
  // engine's compute thread), whose stream the model uses.
  static absl::StatusOr<std::unique_ptr<CudaMlpModel>> Create(const MlpConfig& config,
                                                             CudaBackend* backend);
  ~CudaMlpModel() override;

  absl::Status SetBatch(const float* x, const float* y, int64_t rows) override;
  absl::StatusOr<std::vector<float>> OutputToHost() const override;

  const ModelSpec& Spec() const override { return host_->Spec(); }
  const std::vector<int>& ForwardOps() const override { return host_->ForwardOps(); }
  absl::Status Forward(int op, const UnitTensors& params) override;
  absl::Status Backward(int op, const UnitTensors& params, UnitTensors& grads) override {
    return BackwardInto(op, params, grads, GradMode::kAdd);
  }
  // kOverwrite clears the gradient views on the stream first (cuBLAS adds).
  absl::Status BackwardInto(int op, const UnitTensors& params, UnitTensors& grads,
                            GradMode mode) override;
  // Copies the loss of the last forward pass from the device (waits).
  double Loss() const override;
  int64_t ActivationBytes() const override;
  void InitRows(const TensorSpec& tensor, int64_t row_begin, int64_t row_end, uint64_t seed,
                float* out) const override {
    host_->InitRows(tensor, row_begin, row_end, seed, out);
  }

 private:
  CudaMlpModel(std::unique_ptr<MlpModel> host, CudaBackend* backend,
               std::unique_ptr<gpu::CublasLinear> linear)
      : host_(std::move(host)),
        backend_(backend),
        linear_(std::move(linear)),
        sequencer_(host_->config().layers) {}
  bool HasActivation(int layer) const;
  const float* LayerInput(int layer) const;
  // Device array of n floats, grown as needed.
  absl::Status Ensure(float** buffer, int64_t* capacity, int64_t n);

  std::unique_ptr<MlpModel> host_;  // spec, config and initialization
  CudaBackend* backend_;
  std::unique_ptr<gpu::CublasLinear> linear_;
  OpSequencer sequencer_;
  int64_t rows_ = 0;
  // Device buffers [rows, width] (capacity in floats): x, y, z_j, act_j, and
  // the backward scratch pair; one device double for the loss.
  struct Array {
    float* data = nullptr;
    int64_t capacity = 0;
  };
  Array x_, y_, dout_, dinp_;
  std::vector<Array> z_, act_;
  double* loss_ = nullptr;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUDA_MLP_H_
