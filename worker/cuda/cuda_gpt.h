// The GPT of worker/model/gpt.h on a CUDA device: the same spec (tensor
// names, shapes, Hugging Face GPT-2 layouts), initialization, units and op
// order, because the spec and InitRows come from a host GptModel; forward and
// backward run our CUDA kernels, cuBLASLt and (for bf16 attention, when it
// loads) cuDNN on the compute thread's stream of a CudaBackend, on device
// views the engine hands in.
//
// Activation dtype = the matrix products' dtype (CudaGptOptions):
//  - F32: f32 everywhere; products are f32 GEMMs (TF32 only with tf32).
//  - BF16 (--param_dtype=bf16), where PyTorch's autocast(bfloat16) keeps
//    bf16: the LayerNorm outputs that feed products, the products' outputs
//    (qkv, the MLP's pre-activation and its GELU), attention in and out, the
//    logits, and the gradients flowing between products are stored in bf16;
//    products multiply on tensor cores with f32 accumulation. Kept in f32:
//    the residual stream and its gradient (projections add into it inside
//    the product), LayerNorm statistics and arithmetic, softmax statistics,
//    the loss, and every parameter gradient (accumulated in f32).
// Fused: bias and tanh-GELU in the products' epilogues (and GELU's
// derivative and the bias gradient in the backward's), attention that never
// stores T x T (flash_attention.h or cudnn_attention.h), a classifier that
// keeps the logits once and turns them into their gradient in place
// (classifier.h).
//
// Activations are sized once, in Create, for batches of up to max_batch
// sequences of max_t (default n_ctx) tokens, and any smaller batch; SetBatch
// allocates nothing. Kernels take small scratch from the device's stream-ordered pool.
#ifndef ZEROSHARD_WORKER_CUDA_CUDA_GPT_H_
#define ZEROSHARD_WORKER_CUDA_CUDA_GPT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/cuda/cublaslt_linear.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cudnn_attention.h"
#include "worker/cuda/kernels.h"
#include "worker/cuda/section_timer.h"
#include "worker/model/gpt.h"
#include "worker/model/model_util.h"

namespace zeroshard {

struct CudaGptOptions {
  // F32 or BF16: the products' operands and the stored activations.
  DType matmul_dtype = DType::kF32;
  enum class Attention {
    kAuto,     // BF16: cuDNN when it loads, else flash; F32: flash
    kCudnn,    // cuDNN's fused attention (BF16 only)
    kFlash,    // our fused kernel (flash_attention.h), its dtype's default variant
    kFlashTc,  // the same on tensor cores (BF16; F32 as 3xTF32; flash_attention_variants.h)
    kNaive,    // the T x T kernels of kernels.h (F32 only): a reference
  };
  Attention attention = Attention::kAuto;
  // F32 products as TF32 on tensor cores (off: PyTorch's default too).
  bool tf32 = false;
  // The longest sequence a batch will have (--context), when shorter than
  // the model's n_ctx positions (--positions): activations are sized for
  // max_batch x max_t positions. 0: n_ctx.
  int max_t = 0;
};

// "auto", "cudnn", "flash", "flash_tc", "naive" (the --gpu_attention values).
const char* AttentionName(CudaGptOptions::Attention a);
absl::StatusOr<CudaGptOptions::Attention> ParseAttention(const std::string& name);

class CudaGptModel : public TokenModel {
 public:
  // INVALID_ARGUMENT for a bad config (as GptModel::Create), max_batch < 1,
  // a matmul dtype other than F32 / BF16, or an attention kernel that cannot
  // take that dtype; UNAVAILABLE when kCudnn was asked for and cuDNN does not
  // load; RESOURCE_EXHAUSTED when the activations do not fit on the device;
  // other CUDA errors otherwise.
  // `backend` is not owned; every call must come from one thread (the
  // engine's compute thread, the one calling Create), whose stream the model
  // uses.
  static absl::StatusOr<std::unique_ptr<CudaGptModel>> Create(const GptConfig& config,
                                                              int max_batch,
                                                              const CudaGptOptions& options,
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

  DType matmul_dtype() const { return options_.matmul_dtype; }
  // The attention kernel in use (never kAuto).
  CudaGptOptions::Attention attention() const { return options_.attention; }
  // The cuBLASLt products that ran with fused epilogues, and those that fell
  // back to separate kernels (CublasLtLinear::path_counts).
  gpu::CublasLtLinear::PathCounts linear_path_counts() const { return linear_->path_counts(); }

  // GPU time per kind of work (section_timer.h): "attention", "matmul",
  // "layernorm", "classifier", "embedding", "cast", "clear grads", and the
  // stream's time between the model's ops. Off by default (no events).
  void EnableProfile(bool on) { timer_.set_enabled(on); }
  // Milliseconds per section since the last call (waits for the stream).
  absl::StatusOr<std::map<std::string, double>> TakeProfile() { return timer_.Take(); }

 private:
  // What block l keeps from forward for backward (P = max positions). "act"
  // buffers are in the activation dtype (act_dtype_), the rest f32.
  struct BlockActs {
    void* ln1;                   // act [P,C]
    float *ln1_mean, *ln1_rstd;  // [P], [P]
    void* qkv;                   // act [P,3C]
    void* atty;                  // act [P,C]
    float* lse;                  // [B,NH,T] (fused attention)
    float* att;                  // [B,NH,T,T] (kNaive only)
    float* res2;                 // [P,C]: the residual stream after attention
    void* ln2;                   // act [P,C]
    float *ln2_mean, *ln2_rstd;  // [P], [P]
    void* fch;                   // act [P,4C]: c_fc's output before GELU
    void* fch_gelu;              // act [P,4C]
  };

  CudaGptModel(std::unique_ptr<GptModel> host, int max_batch, const CudaGptOptions& options,
               CudaBackend* backend, std::unique_ptr<gpu::CublasLtLinear> linear,
               std::unique_ptr<gpu::CudnnAttention> cudnn);

  // cudaMalloc of `bytes`, kept until destruction.
  absl::Status Allocate(int64_t bytes, void** out);
  template <typename T>
  absl::Status Allocate(int64_t elements, T** out) {
    void* p = nullptr;
    absl::Status s = Allocate(elements * static_cast<int64_t>(sizeof(T)), &p);
    *out = static_cast<T*>(p);
    return s;
  }
  absl::Status AllocateAct(int64_t elements, void** out) {
    return Allocate(elements * act_bytes_, out);
  }
  absl::Status AllocateActivations();

  // The weight as the products' operand: w itself (F32), or rounded into
  // w16_ (BF16; the next product's weight overwrites it, in stream order).
  absl::StatusOr<const void*> Weight(const float* w, int64_t elements);
  // The tied LM head's weight wte [V,C] as the operand of its forward and
  // input-gradient products, and the products' OUT extent: BF16, rounded into
  // w16_ with rows V..logits_ld_ zero, so the products run over OUT =
  // logits_ld_ (a multiple of 64). cuBLASLt's fast kernels need the
  // contiguous extent of D in the forward (OUT) and of dy in the input
  // gradient (its K, OUT again) to be a multiple of 8 elements: with V =
  // 50257 the forward ran at 95 TFLOP/s on an H200 (the whole MLP block at
  // 434). The padded logits columns come out 0 (zero rows, no bias) and the
  // classifier neither reads them nor leaves their gradient non-zero. F32:
  // wte itself and OUT = V (a padded copy of wte made no difference to the
  // f32 step on the H200, whose f32 products run on CUDA cores, and cost
  // 154 MB at GPT-2).
  absl::StatusOr<std::pair<const void*, int64_t>> HeadWeight(const float* wte);
  // The f32 gradient dy [N,width] as the products' operand (BF16: rounded
  // into dy16_).
  absl::StatusOr<const void*> GradOperand(const float* dy, int64_t width);

  absl::Status AttentionForward(const BlockActs& a);
  absl::Status AttentionBackward(const BlockActs& a, const void* datty, void* dqkv);

  absl::Status EmbedForward(const UnitTensors& p);
  absl::Status BlockForward(int layer, const UnitTensors& p);
  absl::Status HeadForward(const UnitTensors& p);
  absl::Status EmbedBackward(UnitTensors& g);
  absl::Status BlockBackward(int layer, const UnitTensors& p, UnitTensors& g);
  absl::Status MlpBackward(const BlockActs& a, const UnitTensors& p, UnitTensors& g);
  absl::Status HeadBackward(const UnitTensors& p, UnitTensors& g);

  std::unique_ptr<GptModel> host_;  // spec, config, op order and initialization
  const int max_batch_;
  // Elements between logits rows: V rounded up to 64, so that every row
  // starts 16-byte aligned in bf16 and f32 (cuBLASLt's fast kernels need
  // it; V = 50257 alone would leave bf16 rows 2-byte aligned).
  const int64_t logits_ld_;
  const int max_t_;  // options.max_t, or n_ctx
  const CudaGptOptions options_;
  const DType act_dtype_;    // = options_.matmul_dtype
  const int64_t act_bytes_;  // 4 or 2
  CudaBackend* const backend_;
  void* const stream_;  // the compute thread's
  std::unique_ptr<gpu::CublasLtLinear> linear_;
  std::unique_ptr<gpu::CudnnAttention> cudnn_;  // kCudnn only
  gpu::SectionTimer timer_;
  std::vector<std::vector<int>> unit_tensors_;
  OpSequencer sequencer_;
  std::vector<void*> allocations_;
  int64_t allocated_bytes_ = 0;

  // The batch.
  int b_ = 0, t_ = 0;
  int64_t n_ = 0;  // b_ * t_ positions
  // The attention kernel of this batch: options_.attention, except kFlash
  // for a kCudnn model's batches of t < 2.
  CudaGptOptions::Attention batch_attention_ = CudaGptOptions::Attention::kFlash;
  int cudnn_t_ = 0;  // kCudnn: the sequence length cuDNN runs (0: none yet)
  int32_t *tokens_ = nullptr, *targets_ = nullptr;  // [P]

  // Activations: resid_[l] (f32) is the residual stream entering block l.
  std::vector<float*> resid_;  // n_layer + 1 x [P,C]
  std::vector<BlockActs> blocks_;
  void* lnf_ = nullptr;                              // act [P,C]
  float *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr;  // [P], [P]
  // act [P,V] in rows logits_ld_ apart (the padding is never read); the
  // head's backward turns them into d(loss)/d(logits).
  void* logits_ = nullptr;
  float* logits_lse_ = nullptr;  // [P]
  bool logits_valid_ = false;    // logits_ holds the last forward's logits
  double* loss_ = nullptr;       // one device double

  // Backward scratch: dresid_ carries d(loss)/d(residual stream) between
  // ops (f32).
  float *dresid_ = nullptr, *dres2_ = nullptr, *dtmp_ = nullptr;  // [P,C]
  void* datty_ = nullptr;                                         // act [P,C]
  void* dqkv_ = nullptr;                                          // act [P,3C]
  void* dfch_ = nullptr;                                          // act [P,4C]

  // BF16 only: a weight and an f32 gradient rounded to bf16 (raw bits).
  uint16_t* w16_ = nullptr;   // max(logits_ld_ C, 4 C C)
  uint16_t* dy16_ = nullptr;  // [P,C]
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUDA_GPT_H_
