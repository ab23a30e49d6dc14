#include "worker/cuda/cuda_gpt.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_device.h"

namespace zeroshard {

using Layout = gpu::CublasLinear::Layout;

// Every CUDA call below returns a status; this returns it from the caller.
#define ZS_RETURN_IF_ERROR(expr)              \
  do {                                        \
    if (absl::Status _s = (expr); !_s.ok()) { \
      return _s;                              \
    }                                         \
  } while (0)

absl::StatusOr<std::unique_ptr<CudaGptModel>> CudaGptModel::Create(const GptConfig& config,
                                                                   int max_batch,
                                                                   DType matmul_dtype,
                                                                   CudaBackend* backend) {
  if (max_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaGptModel: max_batch must be >= 1, got ", max_batch));
  }
  if (matmul_dtype != DType::kF32 && matmul_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("CudaGptModel: matrix products in ",
                                                   DTypeName(matmul_dtype),
                                                   " are not supported (F32 and BF16 are)"));
  }
  auto host = GptModel::Create(config);
  if (!host.ok()) return host.status();
  if (backend == nullptr) return absl::InvalidArgumentError("CudaGptModel: null backend");
  auto linear = gpu::CublasLinear::Create(backend->StreamForThisThread());
  if (!linear.ok()) return linear.status();
  std::unique_ptr<CudaGptModel> model(
      new CudaGptModel(*std::move(host), max_batch, matmul_dtype, backend, *std::move(linear)));
  if (absl::Status s = model->AllocateActivations(); !s.ok()) return s;
  return model;
}

CudaGptModel::CudaGptModel(std::unique_ptr<GptModel> host, int max_batch, DType matmul_dtype,
                           CudaBackend* backend, std::unique_ptr<gpu::CublasLinear> linear)
    : host_(std::move(host)),
      max_batch_(max_batch),
      matmul_dtype_(matmul_dtype),
      backend_(backend),
      stream_(backend->StreamForThisThread()),
      linear_(std::move(linear)),
      unit_tensors_(TensorsByUnit(host_->Spec())),
      sequencer_(host_->config().n_layer + 2) {}

CudaGptModel::~CudaGptModel() {
  // Queued kernels may still use the buffers.
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  for (void* p : allocations_) cudaFree(p);
}

absl::Status CudaGptModel::Allocate(int64_t bytes, void** out) {
  *out = nullptr;
  void* p = nullptr;
  const cudaError_t error = cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1)));
  // Out of memory is not sticky, but cudaGetLastError would still return it
  // and the next kernel launch anywhere on this thread would report it.
  if (error != cudaSuccess) cudaGetLastError();
  ZS_RETURN_IF_ERROR(CudaErrorToStatus(
      error,
      absl::StrCat("CudaGptModel: allocating ", bytes, " bytes of activations (", allocated_bytes_,
                   " allocated so far; a smaller --batch or --context needs "
                   "less)")));
  allocations_.push_back(p);
  allocated_bytes_ += bytes;
  *out = p;
  return absl::OkStatus();
}

absl::Status CudaGptModel::AllocateActivations() {
  const GptConfig& cfg = host_->config();
  const int64_t p = int64_t{max_batch_} * cfg.n_ctx;  // positions
  const int64_t c = cfg.n_embd;
  const int64_t v = cfg.vocab;
  const int64_t att = int64_t{max_batch_} * cfg.n_head * cfg.n_ctx * cfg.n_ctx;
  ZS_RETURN_IF_ERROR(Allocate(p, &tokens_));
  ZS_RETURN_IF_ERROR(Allocate(p, &targets_));
  resid_.resize(cfg.n_layer + 1);
  for (float*& r : resid_) ZS_RETURN_IF_ERROR(Allocate(p * c, &r));
  blocks_.resize(cfg.n_layer);
  for (BlockActs& a : blocks_) {
    ZS_RETURN_IF_ERROR(Allocate(p * c, &a.ln1));
    ZS_RETURN_IF_ERROR(Allocate(p, &a.ln1_mean));
    ZS_RETURN_IF_ERROR(Allocate(p, &a.ln1_rstd));
    ZS_RETURN_IF_ERROR(Allocate(p * 3 * c, &a.qkv));
    ZS_RETURN_IF_ERROR(Allocate(att, &a.att));
    ZS_RETURN_IF_ERROR(Allocate(p * c, &a.atty));
    ZS_RETURN_IF_ERROR(Allocate(p * c, &a.res2));
    ZS_RETURN_IF_ERROR(Allocate(p * c, &a.ln2));
    ZS_RETURN_IF_ERROR(Allocate(p, &a.ln2_mean));
    ZS_RETURN_IF_ERROR(Allocate(p, &a.ln2_rstd));
    ZS_RETURN_IF_ERROR(Allocate(p * 4 * c, &a.fch));
    ZS_RETURN_IF_ERROR(Allocate(p * 4 * c, &a.fch_gelu));
  }
  ZS_RETURN_IF_ERROR(Allocate(p * c, &lnf_));
  ZS_RETURN_IF_ERROR(Allocate(p, &lnf_mean_));
  ZS_RETURN_IF_ERROR(Allocate(p, &lnf_rstd_));
  ZS_RETURN_IF_ERROR(Allocate(p * v, &logits_));
  ZS_RETURN_IF_ERROR(Allocate(p * v, &probs_));
  ZS_RETURN_IF_ERROR(Allocate(1, &loss_));
  ZS_RETURN_IF_ERROR(Allocate(p * c, &dresid_));
  ZS_RETURN_IF_ERROR(Allocate(p * c, &dres2_));
  ZS_RETURN_IF_ERROR(Allocate(p * c, &dtmp_));
  ZS_RETURN_IF_ERROR(Allocate(p * 3 * c, &dqkv_));
  ZS_RETURN_IF_ERROR(Allocate(p * 4 * c, &dfch_));
  if (matmul_dtype_ == DType::kBF16) {
    // The widest input of a product is c_fc's output feeding mlp.c_proj
    // (4C); the widest output gradient the LM head's (V) or c_fc's (4C);
    // the largest weight wte (V x C) or c_fc / mlp.c_proj (4C x C).
    ZS_RETURN_IF_ERROR(Allocate(p * 4 * c, &x16_));
    ZS_RETURN_IF_ERROR(Allocate(p * std::max(v, 4 * c), &dy16_));
    ZS_RETURN_IF_ERROR(Allocate(std::max(v * c, 4 * c * c), &w16_));
  }
  return absl::OkStatus();
}

absl::Status CudaGptModel::SetBatch(const int32_t* tokens, const int32_t* targets, int b, int t) {
  const GptConfig& cfg = host_->config();
  if (b < 1 || t < 1 || t > cfg.n_ctx) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch [", b, ",", t, "] needs b >= 1 and 1 <= t <= n_ctx ", cfg.n_ctx));
  }
  const int64_t n = static_cast<int64_t>(b) * t;
  // The buffers hold max_batch * n_ctx positions and max_batch * n_ctx^2
  // attention weights per head.
  if (n > int64_t{max_batch_} * cfg.n_ctx || n * t > int64_t{max_batch_} * cfg.n_ctx * cfg.n_ctx) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch [", b, ",", t, "] does not fit the device GPT's activations, sized for up to ",
        max_batch_, " sequences of ", cfg.n_ctx, " tokens"));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= cfg.vocab || targets[i] < 0 || targets[i] >= cfg.vocab) {
      return absl::InvalidArgumentError(absl::StrCat("position ", i, ": token ", tokens[i],
                                                     " / target ", targets[i], " not in [0, ",
                                                     cfg.vocab, ")"));
    }
  }
  ZS_RETURN_IF_ERROR(backend_->CopyFromHost(tokens_, tokens, n * sizeof(int32_t)));
  ZS_RETURN_IF_ERROR(backend_->CopyFromHost(targets_, targets, n * sizeof(int32_t)));
  b_ = b;
  t_ = t;
  n_ = n;
  sequencer_.Reset();
  return absl::OkStatus();
}

absl::Status CudaGptModel::LogitsRowToHost(int64_t position, float* out) const {
  if (position < 0 || position >= n_) {
    return absl::OutOfRangeError(
        absl::StrCat("logits row ", position, " of a batch of ", n_, " positions"));
  }
  const int64_t v = host_->config().vocab;
  return backend_->CopyToHost(out, logits_ + position * v, v * sizeof(float));
}

double CudaGptModel::Loss() const {
  double loss = 0;
  if (!backend_->CopyToHost(&loss, loss_, sizeof(double)).ok()) return NAN;
  return loss;
}

absl::Status CudaGptModel::Forward(int op, const UnitTensors& params) {
  if (n_ == 0) return absl::FailedPreconditionError("CudaGptModel::Forward before SetBatch");
  ZS_RETURN_IF_ERROR(sequencer_.CheckForward(op));
  const int unit = ForwardOps()[op];
  ZS_RETURN_IF_ERROR(CheckUnitTensors(Spec(), unit_tensors_[unit], params, "params"));
  const int n_layer = host_->config().n_layer;
  if (op == 0) {
    ZS_RETURN_IF_ERROR(EmbedForward(params));
  } else if (op <= n_layer) {
    ZS_RETURN_IF_ERROR(BlockForward(op - 1, params));
  } else {
    ZS_RETURN_IF_ERROR(HeadForward(params));
  }
  sequencer_.MarkForward(op);
  return absl::OkStatus();
}

absl::Status CudaGptModel::BackwardInto(int op, const UnitTensors& params, UnitTensors& grads,
                                        GradMode mode) {
  ZS_RETURN_IF_ERROR(sequencer_.CheckBackward(op));
  const int unit = ForwardOps()[op];
  ZS_RETURN_IF_ERROR(CheckUnitTensors(Spec(), unit_tensors_[unit], params, "params"));
  ZS_RETURN_IF_ERROR(CheckUnitTensors(Spec(), unit_tensors_[unit], grads, "grads"));
  const int n_layer = host_->config().n_layer;
  // Refused before kOverwrite clears anything (HeadBackward checks it too).
  if (op > n_layer && !probs_valid_) {
    return absl::FailedPreconditionError(
        "CudaGptModel: the head's backward ran twice for one forward pass (its softmax "
        "probabilities became the logits' gradient the first time)");
  }
  if (mode == GradMode::kOverwrite) {
    for (TensorView& g : grads) {
      ZS_RETURN_IF_ERROR(CudaErrorToStatus(cudaMemsetAsync(g.data, 0, g.elements() * sizeof(float),
                                                           static_cast<cudaStream_t>(stream_)),
                                           "CudaGptModel: clearing gradients"));
    }
  }
  if (op == 0) {
    ZS_RETURN_IF_ERROR(EmbedBackward(grads));
  } else if (op <= n_layer) {
    ZS_RETURN_IF_ERROR(BlockBackward(op - 1, params, grads));
  } else {
    ZS_RETURN_IF_ERROR(HeadBackward(params, grads));
  }
  sequencer_.MarkBackward(op);
  return absl::OkStatus();
}

// ----------------------------------------------------------------------------
// Products.

absl::Status CudaGptModel::Linear(float* y, const float* x, const float* w, const float* b,
                                  int64_t in, int64_t out, Layout layout) {
  if (matmul_dtype_ == DType::kF32) {
    return linear_->Forward(y, x, w, b, n_, in, out, DType::kF32, layout);
  }
  ZS_RETURN_IF_ERROR(gpu::CastF32ToBF16(x16_, x, n_ * in, stream_));
  ZS_RETURN_IF_ERROR(gpu::CastF32ToBF16(w16_, w, in * out, stream_));
  return linear_->ForwardMixed(y, x16_, w16_, b, n_, in, out, layout);
}

absl::Status CudaGptModel::LinearBackward(float* dx, float* dw, float* db, const float* dy,
                                          const float* x, const float* w, int64_t in, int64_t out,
                                          Layout layout) {
  if (matmul_dtype_ == DType::kF32) {
    return linear_->Backward(dx, dw, db, dy, x, w, n_, in, out, DType::kF32, layout);
  }
  // The forward's operands, rounded again (the same values), and dy.
  ZS_RETURN_IF_ERROR(gpu::CastF32ToBF16(dy16_, dy, n_ * out, stream_));
  ZS_RETURN_IF_ERROR(gpu::CastF32ToBF16(x16_, x, n_ * in, stream_));
  ZS_RETURN_IF_ERROR(gpu::CastF32ToBF16(w16_, w, in * out, stream_));
  return linear_->BackwardMixed(dx, dw, db, dy16_, dy, x16_, w16_, n_, in, out, layout);
}

// ----------------------------------------------------------------------------
// Op 0: token + position embedding (GptModel::EmbedForward / EmbedBackward).

absl::Status CudaGptModel::EmbedForward(const UnitTensors& p) {
  const GptConfig& cfg = host_->config();
  // resid_[0][b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
  return gpu::EmbeddingForward(resid_[0], tokens_, p[kWte].data, p[kWpe].data, b_, t_, cfg.n_embd,
                               cfg.vocab, stream_);
}

absl::Status CudaGptModel::EmbedBackward(UnitTensors& g) {
  const GptConfig& cfg = host_->config();
  // dwte[tokens[b,t],:] += dresid[b,t,:]; dwpe[t,:] += dresid[b,t,:]
  return gpu::EmbeddingBackward(g[kWte].data, g[kWpe].data, dresid_, tokens_, b_, t_, cfg.n_embd,
                                cfg.vocab, stream_);
}

// ----------------------------------------------------------------------------
// Ops 1..n_layer: block l (GptModel::BlockForward / BlockBackward).
//   res2 = x + c_proj(attn(c_attn(ln_1(x))))
//   out  = res2 + mlp.c_proj(gelu(mlp.c_fc(ln_2(res2))))

absl::Status CudaGptModel::BlockForward(int layer, const UnitTensors& p) {
  const int64_t c = host_->config().n_embd;
  const int64_t nh = host_->config().n_head;
  const int64_t n = n_;
  const BlockActs& a = blocks_[layer];
  const float* x = resid_[layer];
  float* out = resid_[layer + 1];

  ZS_RETURN_IF_ERROR(gpu::LayerNormForward(a.ln1, a.ln1_mean, a.ln1_rstd, x, p[kLn1W].data,
                                           p[kLn1B].data, n, c, stream_));
  ZS_RETURN_IF_ERROR(
      Linear(a.qkv, a.ln1, p[kAttnW].data, p[kAttnB].data, c, 3 * c, Layout::kInOut));
  ZS_RETURN_IF_ERROR(gpu::AttentionForward(a.atty, a.att, a.qkv, b_, t_, c, nh, stream_));
  ZS_RETURN_IF_ERROR(
      Linear(a.res2, a.atty, p[kAttnProjW].data, p[kAttnProjB].data, c, c, Layout::kInOut));
  ZS_RETURN_IF_ERROR(gpu::AddInto(a.res2, x, DType::kF32, n * c, stream_));  // + the skip path

  ZS_RETURN_IF_ERROR(gpu::LayerNormForward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, p[kLn2W].data,
                                           p[kLn2B].data, n, c, stream_));
  ZS_RETURN_IF_ERROR(Linear(a.fch, a.ln2, p[kFcW].data, p[kFcB].data, c, 4 * c, Layout::kInOut));
  ZS_RETURN_IF_ERROR(gpu::GeluTanhForward(a.fch_gelu, a.fch, n * 4 * c, stream_));
  ZS_RETURN_IF_ERROR(
      Linear(out, a.fch_gelu, p[kFcProjW].data, p[kFcProjB].data, 4 * c, c, Layout::kInOut));
  return gpu::AddInto(out, a.res2, DType::kF32, n * c, stream_);  // + the skip path
}

absl::Status CudaGptModel::BlockBackward(int layer, const UnitTensors& p, UnitTensors& g) {
  const int64_t c = host_->config().n_embd;
  const int64_t nh = host_->config().n_head;
  const int64_t n = n_;
  const BlockActs& a = blocks_[layer];
  const float* x = resid_[layer];
  // On entry dresid_ = d(loss)/d(out); on exit d(loss)/d(x).

  // MLP branch: out = res2 + c_proj(gelu(c_fc(ln_2(res2)))).
  ZS_RETURN_IF_ERROR(LinearBackward(dfch_, g[kFcProjW].data, g[kFcProjB].data, dresid_, a.fch_gelu,
                                    p[kFcProjW].data, 4 * c, c, Layout::kInOut));
  ZS_RETURN_IF_ERROR(gpu::GeluTanhBackward(dfch_, dfch_, a.fch, n * 4 * c, stream_));
  ZS_RETURN_IF_ERROR(LinearBackward(dtmp_, g[kFcW].data, g[kFcB].data, dfch_, a.ln2, p[kFcW].data,
                                    c, 4 * c, Layout::kInOut));
  ZS_RETURN_IF_ERROR(gpu::LayerNormBackward(dres2_, g[kLn2W].data, g[kLn2B].data, dtmp_, a.res2,
                                            p[kLn2W].data, a.ln2_mean, a.ln2_rstd, n, c, stream_));
  // dres2 = d(loss)/d(res2): the LayerNorm path plus the skip path.
  ZS_RETURN_IF_ERROR(gpu::AddInto(dres2_, dresid_, DType::kF32, n * c, stream_));

  // Attention branch: res2 = x + c_proj(attn(c_attn(ln_1(x)))).
  ZS_RETURN_IF_ERROR(LinearBackward(dtmp_, g[kAttnProjW].data, g[kAttnProjB].data, dres2_, a.atty,
                                    p[kAttnProjW].data, c, c, Layout::kInOut));
  ZS_RETURN_IF_ERROR(gpu::AttentionBackward(dqkv_, dtmp_, a.qkv, a.att, b_, t_, c, nh, stream_));
  // dtmp_ (d atty) is read by the attention backward above, which runs
  // before this product on the same stream: it may be overwritten now.
  ZS_RETURN_IF_ERROR(LinearBackward(dtmp_, g[kAttnW].data, g[kAttnB].data, dqkv_, a.ln1,
                                    p[kAttnW].data, c, 3 * c, Layout::kInOut));
  ZS_RETURN_IF_ERROR(gpu::LayerNormBackward(dresid_, g[kLn1W].data, g[kLn1B].data, dtmp_, x,
                                            p[kLn1W].data, a.ln1_mean, a.ln1_rstd, n, c, stream_));
  // d(loss)/d(x): the LayerNorm path plus the skip path.
  return gpu::AddInto(dresid_, dres2_, DType::kF32, n * c, stream_);
}

// ----------------------------------------------------------------------------
// Last op: ln_f, tied LM head, cross-entropy (GptModel::HeadForward /
// HeadBackward).

absl::Status CudaGptModel::HeadForward(const UnitTensors& p) {
  const GptConfig& cfg = host_->config();
  const int64_t c = cfg.n_embd;
  const int64_t v = cfg.vocab;
  ZS_RETURN_IF_ERROR(gpu::LayerNormForward(lnf_, lnf_mean_, lnf_rstd_, resid_[cfg.n_layer],
                                           p[kLnfW].data, p[kLnfB].data, n_, c, stream_));
  // logits[N,V] = lnf[N,C] wte^T: wte [V,C] is nn.Linear's [OUT,IN].
  ZS_RETURN_IF_ERROR(Linear(logits_, lnf_, p[kWte].data, nullptr, c, v, Layout::kOutIn));
  ZS_RETURN_IF_ERROR(gpu::CrossEntropyForward(loss_, probs_, logits_, targets_, n_, v, stream_));
  probs_valid_ = true;
  return absl::OkStatus();
}

absl::Status CudaGptModel::HeadBackward(const UnitTensors& p, UnitTensors& g) {
  const GptConfig& cfg = host_->config();
  const int64_t c = cfg.n_embd;
  const int64_t v = cfg.vocab;
  if (!probs_valid_) {
    return absl::FailedPreconditionError(
        "CudaGptModel: the head's backward ran twice for one forward pass (its softmax "
        "probabilities became the logits' gradient the first time)");
  }
  float* dlogits = probs_;  // in place: element i reads probs[i] only
  probs_valid_ = false;
  ZS_RETURN_IF_ERROR(gpu::CrossEntropyBackward(dlogits, probs_, targets_, n_, v, stream_));
  ZS_RETURN_IF_ERROR(LinearBackward(dtmp_, g[kWte].data, nullptr, dlogits, lnf_, p[kWte].data, c, v,
                                    Layout::kOutIn));
  return gpu::LayerNormBackward(dresid_, g[kLnfW].data, g[kLnfB].data, dtmp_, resid_[cfg.n_layer],
                                p[kLnfW].data, lnf_mean_, lnf_rstd_, n_, c, stream_);
}

#undef ZS_RETURN_IF_ERROR

}  // namespace zeroshard
