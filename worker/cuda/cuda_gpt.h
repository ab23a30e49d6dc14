// The GPT of worker/model/gpt.h on a CUDA device: the same spec (tensor
// names, shapes, Hugging Face GPT-2 layouts), initialization, units and op
// order, because the spec and InitRows come from a host GptModel; forward and
// backward run the kernels of kernels.h and cuBLAS on the compute thread's
// stream of a CudaBackend, on device views the engine hands in.
//
// Matrix products: with DType::kF32, f32 cuBLAS GEMMs (no TF32), which match
// the CPU model to float rounding. With DType::kBF16 (--param_dtype=bf16),
// every Linear / Conv1D / LM-head product rounds its operands (activations,
// weights, incoming gradients) to bf16 and multiplies on tensor cores with
// f32 accumulation into f32 results (CublasLinear::ForwardMixed /
// BackwardMixed); weight gradients accumulate in f32. LayerNorm, attention,
// GELU, softmax / cross-entropy and the residual stream stay f32 in both
// modes, as PyTorch autocast(bfloat16) keeps them.
//
// Activations are sized once, in Create, for batches of up to max_batch
// sequences of n_ctx tokens (and any smaller batch); SetBatch allocates
// nothing. The attention backward and the cross-entropy forward take their
// scratch from the device's stream-ordered pool (kernels.h).
#ifndef ZEROSHARD_WORKER_CUDA_CUDA_GPT_H_
#define ZEROSHARD_WORKER_CUDA_CUDA_GPT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/kernels.h"
#include "worker/model/gpt.h"
#include "worker/model/model_util.h"

namespace zeroshard {

class CudaGptModel : public TokenModel {
 public:
  // INVALID_ARGUMENT for a bad config (as GptModel::Create), max_batch < 1 or
  // a matmul dtype other than F32 / BF16; RESOURCE_EXHAUSTED when the
  // activations do not fit on the device; other CUDA errors otherwise.
  // `backend` is not owned; every call must come from one thread (the
  // engine's compute thread, the one calling Create), whose stream the model
  // uses.
  static absl::StatusOr<std::unique_ptr<CudaGptModel>> Create(const GptConfig& config,
                                                              int max_batch, DType matmul_dtype,
                                                              CudaBackend* backend);
  ~CudaGptModel() override;
  CudaGptModel(const CudaGptModel&) = delete;
  CudaGptModel& operator=(const CudaGptModel&) = delete;

  // TokenModel. SetBatch checks the tokens on the host (as GptModel does)
  // and copies them to the device (waits for the copy). INVALID_ARGUMENT
  // also when b * t positions exceed what Create sized for.
  absl::Status SetBatch(const int32_t* tokens, const int32_t* targets, int b, int t) override;
  absl::Status LogitsRowToHost(int64_t position, float* out) const override;
  const GptConfig& config() const override { return host_->config(); }

  // Model.
  const ModelSpec& Spec() const override { return host_->Spec(); }
  const std::vector<int>& ForwardOps() const override { return host_->ForwardOps(); }
  absl::Status Forward(int op, const UnitTensors& params) override;
  absl::Status Backward(int op, const UnitTensors& params, UnitTensors& grads) override {
    return BackwardInto(op, params, grads, GradMode::kAdd);
  }
  // kOverwrite clears the gradient views on the stream first (every kernel
  // here adds into parameter gradients, as the CPU kernels do).
  absl::Status BackwardInto(int op, const UnitTensors& params, UnitTensors& grads,
                            GradMode mode) override;
  // Copies the loss of the last forward pass from the device (waits).
  double Loss() const override;
  // Every device buffer the model allocated in Create.
  int64_t ActivationBytes() const override { return allocated_bytes_; }
  void InitRows(const TensorSpec& tensor, int64_t row_begin, int64_t row_end, uint64_t seed,
                float* out) const override {
    host_->InitRows(tensor, row_begin, row_end, seed, out);
  }

  DType matmul_dtype() const { return matmul_dtype_; }

 private:
  // What block l keeps from forward for backward (P = max positions).
  struct BlockActs {
    float *ln1, *ln1_mean, *ln1_rstd;  // [P,C], [P], [P]
    float* qkv;                        // [P,3C]
    float* att;                        // [B,NH,T,T]
    float* atty;                       // [P,C]
    float* res2;                       // [P,C]
    float *ln2, *ln2_mean, *ln2_rstd;  // [P,C], [P], [P]
    float *fch, *fch_gelu;             // [P,4C]
  };

  CudaGptModel(std::unique_ptr<GptModel> host, int max_batch, DType matmul_dtype,
               CudaBackend* backend, std::unique_ptr<gpu::CublasLinear> linear);

  // cudaMalloc of `bytes`, kept until destruction.
  absl::Status Allocate(int64_t bytes, void** out);
  template <typename T>
  absl::Status Allocate(int64_t elements, T** out) {
    void* p = nullptr;
    absl::Status s = Allocate(elements * static_cast<int64_t>(sizeof(T)), &p);
    *out = static_cast<T*>(p);
    return s;
  }
  absl::Status AllocateActivations();

  // y[N,OUT] = x[N,IN] W (+ b) over the current batch's N positions, in the
  // model's matmul dtype; the backward as CublasLinear::Backward.
  absl::Status Linear(float* y, const float* x, const float* w, const float* b, int64_t in,
                      int64_t out, gpu::CublasLinear::Layout layout);
  absl::Status LinearBackward(float* dx, float* dw, float* db, const float* dy, const float* x,
                              const float* w, int64_t in, int64_t out,
                              gpu::CublasLinear::Layout layout);

  absl::Status EmbedForward(const UnitTensors& p);
  absl::Status BlockForward(int layer, const UnitTensors& p);
  absl::Status HeadForward(const UnitTensors& p);
  absl::Status EmbedBackward(UnitTensors& g);
  absl::Status BlockBackward(int layer, const UnitTensors& p, UnitTensors& g);
  absl::Status HeadBackward(const UnitTensors& p, UnitTensors& g);

  std::unique_ptr<GptModel> host_;  // spec, config, op order and initialization
  const int max_batch_;
  const DType matmul_dtype_;
  CudaBackend* const backend_;
  void* const stream_;  // the compute thread's
  std::unique_ptr<gpu::CublasLinear> linear_;
  std::vector<std::vector<int>> unit_tensors_;
  OpSequencer sequencer_;
  std::vector<void*> allocations_;
  int64_t allocated_bytes_ = 0;

  // The batch.
  int b_ = 0, t_ = 0;
  int64_t n_ = 0;                                   // b_ * t_ positions
  int32_t *tokens_ = nullptr, *targets_ = nullptr;  // [P]

  // Activations: resid_[l] is the residual stream entering block l.
  std::vector<float*> resid_;  // n_layer + 1 x [P,C]
  std::vector<BlockActs> blocks_;
  float *lnf_ = nullptr, *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr;  // [P,C], [P], [P]
  float* logits_ = nullptr;                                           // [P,V]
  // Softmax probabilities [P,V]; the head's backward overwrites them with
  // d(loss)/d(logits) (each element reads its own probability only).
  float* probs_ = nullptr;
  bool probs_valid_ = false;  // probs_ holds the last forward's probabilities
  double* loss_ = nullptr;    // one device double

  // Backward scratch: dresid_ carries d(loss)/d(residual stream) between ops.
  float *dresid_ = nullptr, *dres2_ = nullptr, *dtmp_ = nullptr;  // [P,C]
  float* dqkv_ = nullptr;                                         // [P,3C]
  float* dfch_ = nullptr;                                         // [P,4C]

  // BF16 products only: operands rounded to bf16 (raw bits).
  uint16_t* x16_ = nullptr;   // [P, 4C]: an input activation
  uint16_t* dy16_ = nullptr;  // [P, max(V, 4C)]: an output gradient
  uint16_t* w16_ = nullptr;   // max(V C, 4 C C): a weight
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUDA_GPT_H_
