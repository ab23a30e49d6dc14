#include "worker/cuda/cuda_gpt.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/cuda/classifier.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/flash_attention.h"
#include "worker/cuda/flash_attention_variants.h"
#include "worker/model/layers.h"

namespace zeroshard {

using Layout = gpu::CublasLinear::Layout;

// Every CUDA call below returns a status; this returns it from the caller.
#define ZS_RETURN_IF_ERROR(expr)              \
  do {                                        \
    if (absl::Status _s = (expr); !_s.ok()) { \
      return _s;                              \
    }                                         \
  } while (0)

const char* AttentionName(CudaGptOptions::Attention a) {
  switch (a) {
    case CudaGptOptions::Attention::kAuto:
      return "auto";
    case CudaGptOptions::Attention::kCudnn:
      return "cudnn";
    case CudaGptOptions::Attention::kFlash:
      return "flash";
    case CudaGptOptions::Attention::kFlashTc:
      return "flash_tc";
    case CudaGptOptions::Attention::kNaive:
      return "naive";
  }
  return "?";
}

absl::StatusOr<CudaGptOptions::Attention> ParseAttention(const std::string& name) {
  for (auto a : {CudaGptOptions::Attention::kAuto, CudaGptOptions::Attention::kCudnn,
                 CudaGptOptions::Attention::kFlash, CudaGptOptions::Attention::kFlashTc,
                 CudaGptOptions::Attention::kNaive}) {
    if (name == AttentionName(a)) return a;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "attention kernel '", name, "': expected auto, cudnn, flash, flash_tc or naive"));
}

namespace {

using Attention = CudaGptOptions::Attention;

constexpr int64_t kFlashMaxHeadSize = gpu::kFlashAttentionMaxHeadSize;

// The longest sequence a batch will have: options.max_t, at most n_ctx.
int MaxPositions(const CudaGptOptions& options, const GptConfig& config) {
  return static_cast<int>(options.max_t > 0 ? std::min<int64_t>(options.max_t, config.n_ctx)
                                            : config.n_ctx);
}

// Refuses a kernel that cannot take the dtype, before anything else.
absl::Status CheckAttentionDtype(const CudaGptOptions& o) {
  const bool bf16 = o.matmul_dtype == DType::kBF16;
  if (o.attention == Attention::kCudnn && !bf16) {
    return absl::InvalidArgumentError(
        "attention kernel cudnn takes bf16 only (cuDNN's fused attention has no f32 form): "
        "use --param_dtype=bf16, or --gpu_attention=flash for f32");
  }
  if (o.attention == Attention::kNaive && bf16) {
    return absl::InvalidArgumentError(
        "attention kernel naive is f32 only: use --gpu_attention=flash or cudnn with bf16");
  }
  return absl::OkStatus();
}

// Resolves kAuto for the model's head size (c / nh; the config is valid),
// and refuses a kernel asked for by name that cannot take it. kCudnn may
// still turn out unavailable when the library is loaded (Create).
absl::StatusOr<Attention> ResolveAttention(const CudaGptOptions& o, int64_t c, int64_t nh) {
  const int64_t hs = c / nh;
  const bool flash_ok = hs <= kFlashMaxHeadSize;
  const absl::Status cudnn_heads = gpu::CudnnAttention::CheckHeads(c, nh);
  switch (o.attention) {
    case Attention::kNaive:
      return o.attention;
    case Attention::kFlash:
      if (!flash_ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            "head size ", hs, " exceeds the flash kernel's ", kFlashMaxHeadSize,
            ": use --gpu_attention=naive (f32) or cudnn (bf16, head sizes up to 256)"));
      }
      return o.attention;
    case Attention::kFlashTc: {
      // bf16: bf16 products; f32: 3xTF32 (flash_attention_variants.h).
      if (absl::Status s = gpu::CheckTensorCoresHeadSize(hs, o.matmul_dtype); !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--gpu_attention=flash_tc: ", s.message(), "; use --gpu_attention=flash"));
      }
      return o.attention;
    }
    case Attention::kCudnn:
      if (absl::IsInvalidArgument(cudnn_heads)) {
        return absl::InvalidArgumentError(absl::StrCat(cudnn_heads.message(),
                                                       "; --gpu_attention=flash takes head "
                                                       "sizes up to ",
                                                       kFlashMaxHeadSize));
      }
      return o.attention;
    case Attention::kAuto:
      if (o.matmul_dtype == DType::kF32) return flash_ok ? Attention::kFlash : Attention::kNaive;
      if (cudnn_heads.ok()) return Attention::kCudnn;
      if (flash_ok) return Attention::kFlash;
      return absl::InvalidArgumentError(
          absl::StrCat("no bf16 attention kernel takes head size ", hs, " (flash: up to ",
                       kFlashMaxHeadSize, "; cuDNN: ", cudnn_heads.message(),
                       "): use --param_dtype=f32 with "
                       "--gpu_attention=naive, or another --d_model / --heads"));
  }
  return absl::InvalidArgumentError("unknown attention kernel");
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaGptModel>> CudaGptModel::Create(const GptConfig& config,
                                                                   int max_batch,
                                                                   const CudaGptOptions& options,
                                                                   CudaBackend* backend) {
  if (max_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaGptModel: max_batch must be >= 1, got ", max_batch));
  }
  if (options.matmul_dtype != DType::kF32 && options.matmul_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("CudaGptModel: matrix products in ",
                                                   DTypeName(options.matmul_dtype),
                                                   " are not supported (F32 and BF16 are)"));
  }
  if (absl::Status s = CheckAttentionDtype(options); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("CudaGptModel: ", s.message()));
  }
  auto host = GptModel::Create(config);
  if (!host.ok()) return host.status();
  absl::StatusOr<Attention> attention = ResolveAttention(options, config.n_embd, config.n_head);
  if (!attention.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("CudaGptModel: ", attention.status().message()));
  }
  if (backend == nullptr) return absl::InvalidArgumentError("CudaGptModel: null backend");
  void* stream = backend->StreamForThisThread();
  auto linear = gpu::CublasLtLinear::Create(stream, options.tf32);
  if (!linear.ok()) return linear.status();
  CudaGptOptions resolved = options;
  resolved.attention = *attention;
  std::unique_ptr<gpu::CudnnAttention> cudnn;
  if (resolved.attention == Attention::kCudnn) {
    // cuDNN loaded, and its plans for the training shape built now: where it
    // has no engine for this shape (or its runtime compiler is missing), kAuto
    // can still choose flash, and the build's seconds stay out of the steps.
    const int max_t = MaxPositions(options, config);
    auto created = gpu::CudnnAttention::Create(stream);
    absl::Status ready = created.status();
    if (ready.ok() && max_t >= 2) {
      ready = (*created)->Prepare(max_batch, max_t, config.n_embd, config.n_head);
    }
    if (ready.ok()) {
      cudnn = *std::move(created);
    } else if (options.attention == Attention::kAuto &&
               config.n_embd / config.n_head <= kFlashMaxHeadSize) {
      // kAuto: our own kernel when cuDNN cannot run (said once, here).
      std::fprintf(stderr, "CudaGptModel: cuDNN attention unavailable (%s); using flash\n",
                   std::string(ready.message()).c_str());
      resolved.attention = Attention::kFlash;
    } else {
      return ready;
    }
  }
  std::unique_ptr<CudaGptModel> model(new CudaGptModel(
      *std::move(host), max_batch, resolved, backend, *std::move(linear), std::move(cudnn)));
  if (absl::Status s = model->AllocateActivations(); !s.ok()) return s;
  return model;
}

CudaGptModel::CudaGptModel(std::unique_ptr<GptModel> host, int max_batch,
                           const CudaGptOptions& options, CudaBackend* backend,
                           std::unique_ptr<gpu::CublasLtLinear> linear,
                           std::unique_ptr<gpu::CudnnAttention> cudnn)
    : host_(std::move(host)),
      max_batch_(max_batch),
      logits_ld_((host_->config().vocab + 63) / 64 * 64),
      max_t_(MaxPositions(options, host_->config())),
      options_(options),
      act_dtype_(options.matmul_dtype),
      act_bytes_(options.matmul_dtype == DType::kBF16 ? 2 : 4),
      backend_(backend),
      stream_(backend->StreamForThisThread()),
      linear_(std::move(linear)),
      cudnn_(std::move(cudnn)),
      timer_(stream_),
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
  const int64_t p = int64_t{max_batch_} * max_t_;  // positions
  const int64_t c = cfg.n_embd;
  const bool naive = options_.attention == Attention::kNaive;
  ZS_RETURN_IF_ERROR(Allocate(p, &tokens_));
  ZS_RETURN_IF_ERROR(Allocate(p, &targets_));
  resid_.resize(cfg.n_layer + 1);
  for (float*& r : resid_) ZS_RETURN_IF_ERROR(Allocate(p * c, &r));
  blocks_.assign(cfg.n_layer, BlockActs{});
  for (BlockActs& a : blocks_) {
    ZS_RETURN_IF_ERROR(AllocateAct(p * c, &a.ln1));
    ZS_RETURN_IF_ERROR(Allocate(p, &a.ln1_mean));
    ZS_RETURN_IF_ERROR(Allocate(p, &a.ln1_rstd));
    ZS_RETURN_IF_ERROR(AllocateAct(p * 3 * c, &a.qkv));
    ZS_RETURN_IF_ERROR(AllocateAct(p * c, &a.atty));
    if (naive) {
      ZS_RETURN_IF_ERROR(Allocate(p * cfg.n_head * max_t_, &a.att));
    } else {
      ZS_RETURN_IF_ERROR(Allocate(p * cfg.n_head, &a.lse));
    }
    ZS_RETURN_IF_ERROR(Allocate(p * c, &a.res2));
    ZS_RETURN_IF_ERROR(AllocateAct(p * c, &a.ln2));
    ZS_RETURN_IF_ERROR(Allocate(p, &a.ln2_mean));
    ZS_RETURN_IF_ERROR(Allocate(p, &a.ln2_rstd));
    ZS_RETURN_IF_ERROR(AllocateAct(p * 4 * c, &a.fch));
    ZS_RETURN_IF_ERROR(AllocateAct(p * 4 * c, &a.fch_gelu));
  }
  ZS_RETURN_IF_ERROR(AllocateAct(p * c, &lnf_));
  ZS_RETURN_IF_ERROR(Allocate(p, &lnf_mean_));
  ZS_RETURN_IF_ERROR(Allocate(p, &lnf_rstd_));
  ZS_RETURN_IF_ERROR(AllocateAct(p * logits_ld_, &logits_));
  ZS_RETURN_IF_ERROR(Allocate(p, &logits_lse_));
  ZS_RETURN_IF_ERROR(Allocate(1, &loss_));
  ZS_RETURN_IF_ERROR(Allocate(p * c, &dresid_));
  ZS_RETURN_IF_ERROR(Allocate(p * c, &dres2_));
  ZS_RETURN_IF_ERROR(Allocate(p * c, &dtmp_));
  ZS_RETURN_IF_ERROR(AllocateAct(p * c, &datty_));
  ZS_RETURN_IF_ERROR(AllocateAct(p * 3 * c, &dqkv_));
  ZS_RETURN_IF_ERROR(AllocateAct(p * 4 * c, &dfch_));
  if (act_dtype_ == DType::kBF16) {
    // The largest weight: wte (V x C, rows padded to logits_ld_: HeadWeight)
    // or c_fc / mlp.c_proj (4C x C).
    ZS_RETURN_IF_ERROR(Allocate(std::max(logits_ld_ * c, 4 * c * c), &w16_));
    ZS_RETURN_IF_ERROR(Allocate(p * c, &dy16_));
  }
  return absl::OkStatus();
}

absl::Status CudaGptModel::SetBatch(const int32_t* tokens, const int32_t* targets, int b, int t) {
  const GptConfig& cfg = host_->config();
  if (b < 1 || t < 1 || t > max_t_) {
    return absl::InvalidArgumentError(absl::StrCat("batch [", b, ",", t,
                                                   "] needs b >= 1 and 1 <= t <= ", max_t_,
                                                   " (the longest sequence the device GPT's "
                                                   "activations were sized for)"));
  }
  const int64_t n = static_cast<int64_t>(b) * t;
  // The buffers hold max_batch * max_t positions (and, for the naive
  // attention, max_batch * max_t^2 weights per head, which b t^2 then fits
  // too, since t <= max_t).
  if (n > int64_t{max_batch_} * max_t_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch [", b, ",", t, "] does not fit the device GPT's activations, sized for up to ",
        max_batch_, " sequences of ", max_t_, " tokens"));
  }
  for (int64_t i = 0; i < n; ++i) {
    const bool target_ok =
        targets[i] == kUnscoredTarget || (targets[i] >= 0 && targets[i] < cfg.vocab);
    if (tokens[i] < 0 || tokens[i] >= cfg.vocab || !target_ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "position ", i, ": token ", tokens[i], " / target ", targets[i], " not in [0, ",
          cfg.vocab, ") (a target may also be ", kUnscoredTarget, ": not scored)"));
    }
  }
  // The attention kernel of this batch. cuDNN builds a plan per shape
  // (milliseconds to seconds) and takes sequences of 2 or more: batches of
  // the first length seen (training's --context) run cuDNN; others
  // (--sample's growing prompt) run flash, which keeps the same lse, unless
  // the heads are too large for it.
  Attention batch_attention = options_.attention;
  if (options_.attention == Attention::kCudnn) {
    const bool flash_ok = cfg.n_embd / cfg.n_head <= kFlashMaxHeadSize;
    if (t < 2 && !flash_ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch [", b, ",", t,
                       "]: cuDNN attention takes 2 or more positions and the flash "
                       "kernel head sizes up to ",
                       kFlashMaxHeadSize, " (this model's: ", cfg.n_embd / cfg.n_head, ")"));
    }
    if (cudnn_t_ == 0 && t >= 2) cudnn_t_ = t;
    if (t < 2 || (t != cudnn_t_ && flash_ok)) batch_attention = Attention::kFlash;
  }
  ZS_RETURN_IF_ERROR(backend_->CopyFromHost(tokens_, tokens, n * sizeof(int32_t)));
  ZS_RETURN_IF_ERROR(backend_->CopyFromHost(targets_, targets, n * sizeof(int32_t)));
  b_ = b;
  t_ = t;
  n_ = n;
  batch_attention_ = batch_attention;
  logits_valid_ = false;
  sequencer_.Reset();
  return absl::OkStatus();
}

absl::Status CudaGptModel::LogitsRowToHost(int64_t position, float* out) const {
  if (position < 0 || position >= n_) {
    return absl::OutOfRangeError(
        absl::StrCat("logits row ", position, " of a batch of ", n_, " positions"));
  }
  if (!logits_valid_) {
    return absl::FailedPreconditionError(
        "CudaGptModel: no logits to read (no forward pass of the head since the batch was set, "
        "or its backward has turned them into their gradient)");
  }
  const int64_t v = host_->config().vocab;
  if (act_dtype_ == DType::kF32) {
    return backend_->CopyToHost(out, static_cast<const float*>(logits_) + position * logits_ld_,
                                v * sizeof(float));
  }
  std::vector<uint16_t> row(static_cast<size_t>(v));
  ZS_RETURN_IF_ERROR(backend_->CopyToHost(
      row.data(), static_cast<const uint16_t*>(logits_) + position * logits_ld_,
      v * sizeof(uint16_t)));
  for (int64_t i = 0; i < v; ++i) out[i] = BF16ToFloat(row[i]);
  return absl::OkStatus();
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
  timer_.Mark(nullptr);
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
  if (op > n_layer && !logits_valid_) {
    return absl::FailedPreconditionError(
        "CudaGptModel: the head's backward ran twice for one forward pass (its logits became "
        "their gradient the first time)");
  }
  if (mode == GradMode::kOverwrite) {
    timer_.Mark("clear grads");
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
  timer_.Mark(nullptr);
  sequencer_.MarkBackward(op);
  return absl::OkStatus();
}

// ----------------------------------------------------------------------------
// Operands.

absl::StatusOr<const void*> CudaGptModel::Weight(const float* w, int64_t elements) {
  if (act_dtype_ == DType::kF32) return static_cast<const void*>(w);
  timer_.Mark("cast");
  ZS_RETURN_IF_ERROR(gpu::CastF32ToBF16(w16_, w, elements, stream_));
  timer_.Mark("matmul");
  return static_cast<const void*>(w16_);
}

absl::StatusOr<std::pair<const void*, int64_t>> CudaGptModel::HeadWeight(const float* wte) {
  const int64_t c = host_->config().n_embd;
  const int64_t v = host_->config().vocab;
  if (act_dtype_ == DType::kF32) return std::pair<const void*, int64_t>{wte, v};
  absl::StatusOr<const void*> w = Weight(wte, v * c);
  if (!w.ok()) return w.status();
  // The other weights share w16_ and may have overwritten the padding rows.
  timer_.Mark("cast");
  ZS_RETURN_IF_ERROR(CudaErrorToStatus(
      cudaMemsetAsync(w16_ + v * c, 0, static_cast<size_t>((logits_ld_ - v) * c) * 2,
                      static_cast<cudaStream_t>(stream_)),
      "CudaGptModel: clearing the LM head's padding rows"));
  timer_.Mark("matmul");
  return std::pair<const void*, int64_t>{*w, logits_ld_};
}

absl::StatusOr<const void*> CudaGptModel::GradOperand(const float* dy, int64_t width) {
  if (act_dtype_ == DType::kF32) return static_cast<const void*>(dy);
  timer_.Mark("cast");
  ZS_RETURN_IF_ERROR(gpu::CastF32ToBF16(dy16_, dy, n_ * width, stream_));
  return static_cast<const void*>(dy16_);
}

#define ZS_ASSIGN_OR_RETURN(lhs, expr)          \
  auto lhs##_or = (expr);                       \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  const void* lhs = *lhs##_or

// ----------------------------------------------------------------------------
// Op 0: token + position embedding (GptModel::EmbedForward / EmbedBackward).

absl::Status CudaGptModel::EmbedForward(const UnitTensors& p) {
  const GptConfig& cfg = host_->config();
  // resid_[0][b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
  timer_.Mark("embedding");
  return gpu::EmbeddingForward(resid_[0], tokens_, p[kWte].data, p[kWpe].data, b_, t_, cfg.n_embd,
                               cfg.vocab, stream_);
}

absl::Status CudaGptModel::EmbedBackward(UnitTensors& g) {
  const GptConfig& cfg = host_->config();
  // dwte[tokens[b,t],:] += dresid[b,t,:]; dwpe[t,:] += dresid[b,t,:]
  timer_.Mark("embedding");
  return gpu::EmbeddingBackward(g[kWte].data, g[kWpe].data, dresid_, tokens_, b_, t_, cfg.n_embd,
                                cfg.vocab, stream_);
}

// ----------------------------------------------------------------------------
// Attention.

absl::Status CudaGptModel::AttentionForward(const BlockActs& a) {
  const int64_t c = host_->config().n_embd;
  const int64_t nh = host_->config().n_head;
  timer_.Mark("attention");
  switch (batch_attention_) {
    case Attention::kCudnn:
      return cudnn_->Forward(static_cast<uint16_t*>(a.atty), a.lse,
                             static_cast<const uint16_t*>(a.qkv), b_, t_, c, nh);
    case Attention::kFlashTc:
      return gpu::FlashAttentionForwardWith(gpu::FlashKernels::kTensorCores, a.atty, a.lse, a.qkv,
                                            b_, t_, c, nh, act_dtype_, stream_);
    case Attention::kNaive:
      return gpu::AttentionForward(static_cast<float*>(a.atty), a.att,
                                   static_cast<const float*>(a.qkv), b_, t_, c, nh, stream_);
    default:
      return gpu::FlashAttentionForward(a.atty, a.lse, a.qkv, b_, t_, c, nh, act_dtype_, stream_);
  }
}

absl::Status CudaGptModel::AttentionBackward(const BlockActs& a, const void* datty, void* dqkv) {
  const int64_t c = host_->config().n_embd;
  const int64_t nh = host_->config().n_head;
  timer_.Mark("attention");
  switch (batch_attention_) {
    case Attention::kCudnn:
      return cudnn_->Backward(static_cast<uint16_t*>(dqkv), static_cast<const uint16_t*>(datty),
                              static_cast<const uint16_t*>(a.qkv),
                              static_cast<const uint16_t*>(a.atty), a.lse, b_, t_, c, nh);
    case Attention::kFlashTc:
      return gpu::FlashAttentionBackwardWith(gpu::FlashKernels::kTensorCores, dqkv, datty, a.qkv,
                                             a.atty, a.lse, b_, t_, c, nh, act_dtype_, stream_);
    case Attention::kNaive:
      return gpu::AttentionBackward(static_cast<float*>(dqkv), static_cast<const float*>(datty),
                                    static_cast<const float*>(a.qkv), a.att, b_, t_, c, nh,
                                    stream_);
    default:
      return gpu::FlashAttentionBackward(dqkv, datty, a.qkv, a.atty, a.lse, b_, t_, c, nh,
                                         act_dtype_, stream_);
  }
}

// ----------------------------------------------------------------------------
// Ops 1..n_layer: block l (GptModel::BlockForward / BlockBackward).
//   res2 = x + c_proj(attn(c_attn(ln_1(x))))
//   out  = res2 + mlp.c_proj(gelu(mlp.c_fc(ln_2(res2))))

absl::Status CudaGptModel::BlockForward(int layer, const UnitTensors& p) {
  const int64_t c = host_->config().n_embd;
  const int64_t n = n_;
  const BlockActs& a = blocks_[layer];
  const float* x = resid_[layer];
  using Args = gpu::CublasLtLinear::ForwardArgs;

  timer_.Mark("layernorm");
  ZS_RETURN_IF_ERROR(gpu::LayerNormForwardTo(a.ln1, act_dtype_, a.ln1_mean, a.ln1_rstd, x,
                                             p[kLn1W].data, p[kLn1B].data, n, c, stream_));
  {
    timer_.Mark("matmul");
    ZS_ASSIGN_OR_RETURN(w, Weight(p[kAttnW].data, c * 3 * c));
    Args f{a.qkv, act_dtype_, a.ln1, w, act_dtype_, Layout::kInOut, p[kAttnB].data};
    f.n = n, f.in = c, f.out = 3 * c;
    ZS_RETURN_IF_ERROR(linear_->Forward(f));
  }
  ZS_RETURN_IF_ERROR(AttentionForward(a));
  {
    // res2 = x + atty W + b: the skip path added by the product.
    timer_.Mark("matmul");
    ZS_ASSIGN_OR_RETURN(w, Weight(p[kAttnProjW].data, c * c));
    Args f{a.res2, DType::kF32, a.atty, w, act_dtype_, Layout::kInOut, p[kAttnProjB].data, x};
    f.n = n, f.in = c, f.out = c;
    ZS_RETURN_IF_ERROR(linear_->Forward(f));
  }
  timer_.Mark("layernorm");
  ZS_RETURN_IF_ERROR(gpu::LayerNormForwardTo(a.ln2, act_dtype_, a.ln2_mean, a.ln2_rstd, a.res2,
                                             p[kLn2W].data, p[kLn2B].data, n, c, stream_));
  {
    // fch_gelu = gelu(ln2 W + b), with ln2 W + b kept in fch.
    timer_.Mark("matmul");
    ZS_ASSIGN_OR_RETURN(w, Weight(p[kFcW].data, c * 4 * c));
    Args f{a.fch_gelu, act_dtype_, a.ln2, w, act_dtype_, Layout::kInOut, p[kFcB].data};
    f.gelu_input = a.fch;
    f.n = n, f.in = c, f.out = 4 * c;
    ZS_RETURN_IF_ERROR(linear_->Forward(f));
  }
  timer_.Mark("matmul");
  ZS_ASSIGN_OR_RETURN(w, Weight(p[kFcProjW].data, 4 * c * c));
  Args f{resid_[layer + 1], DType::kF32,    a.fch_gelu,       w,
         act_dtype_,        Layout::kInOut, p[kFcProjB].data, a.res2};
  f.n = n, f.in = 4 * c, f.out = c;
  return linear_->Forward(f);
}

// The MLP branch's backward: on entry dresid_ = d(loss)/d(out); on exit
// dres2_ = d(loss)/d(res2) (the LayerNorm path plus the skip path).
absl::Status CudaGptModel::MlpBackward(const BlockActs& a, const UnitTensors& p, UnitTensors& g) {
  const int64_t c = host_->config().n_embd;
  const int64_t n = n_;
  ZS_ASSIGN_OR_RETURN(dy, GradOperand(dresid_, c));
  gpu::CublasLtLinear::BackwardWeightArgs bw{g[kFcProjW].data, g[kFcProjB].data, dy,
                                             a.fch_gelu,       act_dtype_,       Layout::kInOut};
  bw.n = n, bw.in = 4 * c, bw.out = c;
  timer_.Mark("matmul");
  ZS_RETURN_IF_ERROR(linear_->BackwardWeight(bw));
  {
    // dfch = (dy W^T) * gelu'(fch), and c_fc's bias gradient from it.
    timer_.Mark("matmul");
    ZS_ASSIGN_OR_RETURN(w, Weight(p[kFcProjW].data, 4 * c * c));
    gpu::CublasLtLinear::BackwardInputArgs bi{dfch_,      act_dtype_,     dy,    w,
                                              act_dtype_, Layout::kInOut, a.fch, g[kFcB].data};
    bi.n = n, bi.in = 4 * c, bi.out = c;
    ZS_RETURN_IF_ERROR(linear_->BackwardInput(bi));
  }
  gpu::CublasLtLinear::BackwardWeightArgs fw{g[kFcW].data, nullptr,    dfch_,
                                             a.ln2,        act_dtype_, Layout::kInOut};
  fw.n = n, fw.in = c, fw.out = 4 * c;
  timer_.Mark("matmul");
  ZS_RETURN_IF_ERROR(linear_->BackwardWeight(fw));
  {
    timer_.Mark("matmul");
    ZS_ASSIGN_OR_RETURN(w, Weight(p[kFcW].data, c * 4 * c));
    gpu::CublasLtLinear::BackwardInputArgs bi{dtmp_, DType::kF32, dfch_,
                                              w,     act_dtype_,  Layout::kInOut};
    bi.n = n, bi.in = c, bi.out = 4 * c;
    ZS_RETURN_IF_ERROR(linear_->BackwardInput(bi));
  }
  timer_.Mark("layernorm");
  return gpu::LayerNormBackward(dres2_, g[kLn2W].data, g[kLn2B].data, dtmp_, a.res2, p[kLn2W].data,
                                a.ln2_mean, a.ln2_rstd, n, c, stream_, /*dx_plus=*/dresid_);
}

absl::Status CudaGptModel::BlockBackward(int layer, const UnitTensors& p, UnitTensors& g) {
  const int64_t c = host_->config().n_embd;
  const int64_t n = n_;
  const BlockActs& a = blocks_[layer];
  // On entry dresid_ = d(loss)/d(out); on exit d(loss)/d(x).
  ZS_RETURN_IF_ERROR(MlpBackward(a, p, g));

  // Attention branch: res2 = x + c_proj(attn(c_attn(ln_1(x)))).
  ZS_ASSIGN_OR_RETURN(dy, GradOperand(dres2_, c));
  gpu::CublasLtLinear::BackwardWeightArgs pw{g[kAttnProjW].data, g[kAttnProjB].data, dy, a.atty,
                                             act_dtype_,         Layout::kInOut};
  pw.n = n, pw.in = c, pw.out = c;
  timer_.Mark("matmul");
  ZS_RETURN_IF_ERROR(linear_->BackwardWeight(pw));
  {
    timer_.Mark("matmul");
    ZS_ASSIGN_OR_RETURN(w, Weight(p[kAttnProjW].data, c * c));
    gpu::CublasLtLinear::BackwardInputArgs bi{datty_, act_dtype_, dy,
                                              w,      act_dtype_, Layout::kInOut};
    bi.n = n, bi.in = c, bi.out = c;
    ZS_RETURN_IF_ERROR(linear_->BackwardInput(bi));
  }
  ZS_RETURN_IF_ERROR(AttentionBackward(a, datty_, dqkv_));
  gpu::CublasLtLinear::BackwardWeightArgs qw{g[kAttnW].data, g[kAttnB].data, dqkv_,
                                             a.ln1,          act_dtype_,     Layout::kInOut};
  qw.n = n, qw.in = c, qw.out = 3 * c;
  timer_.Mark("matmul");
  ZS_RETURN_IF_ERROR(linear_->BackwardWeight(qw));
  {
    timer_.Mark("matmul");
    ZS_ASSIGN_OR_RETURN(w, Weight(p[kAttnW].data, c * 3 * c));
    gpu::CublasLtLinear::BackwardInputArgs bi{dtmp_, DType::kF32, dqkv_,
                                              w,     act_dtype_,  Layout::kInOut};
    bi.n = n, bi.in = c, bi.out = 3 * c;
    ZS_RETURN_IF_ERROR(linear_->BackwardInput(bi));
  }
  // d(loss)/d(x): the LayerNorm path plus the skip path.
  timer_.Mark("layernorm");
  return gpu::LayerNormBackward(dresid_, g[kLn1W].data, g[kLn1B].data, dtmp_, resid_[layer],
                                p[kLn1W].data, a.ln1_mean, a.ln1_rstd, n, c, stream_,
                                /*dx_plus=*/dres2_);
}

// ----------------------------------------------------------------------------
// Last op: ln_f, tied LM head, cross-entropy (GptModel::HeadForward /
// HeadBackward).

absl::Status CudaGptModel::HeadForward(const UnitTensors& p) {
  const GptConfig& cfg = host_->config();
  const int64_t c = cfg.n_embd;
  const int64_t v = cfg.vocab;
  timer_.Mark("layernorm");
  ZS_RETURN_IF_ERROR(gpu::LayerNormForwardTo(lnf_, act_dtype_, lnf_mean_, lnf_rstd_,
                                             resid_[cfg.n_layer], p[kLnfW].data, p[kLnfB].data, n_,
                                             c, stream_));
  // logits[N,V] = lnf[N,C] wte^T: wte [V,C] is nn.Linear's [OUT,IN].
  timer_.Mark("matmul");
  const auto head = HeadWeight(p[kWte].data);
  if (!head.ok()) return head.status();
  gpu::CublasLtLinear::ForwardArgs f{logits_,     act_dtype_, lnf_,
                                     head->first, act_dtype_, Layout::kOutIn};
  f.n = n_, f.in = c, f.out = head->second;
  f.ld_y = logits_ld_;
  ZS_RETURN_IF_ERROR(linear_->Forward(f));
  timer_.Mark("classifier");
  ZS_RETURN_IF_ERROR(gpu::ClassifierForward(loss_, logits_lse_, logits_, targets_, n_, v,
                                            logits_ld_, act_dtype_, stream_));
  logits_valid_ = true;
  return absl::OkStatus();
}

absl::Status CudaGptModel::HeadBackward(const UnitTensors& p, UnitTensors& g) {
  const GptConfig& cfg = host_->config();
  const int64_t c = cfg.n_embd;
  const int64_t v = cfg.vocab;
  if (!logits_valid_) {
    return absl::FailedPreconditionError(
        "CudaGptModel: the head's backward ran twice for one forward pass (its logits became "
        "their gradient the first time)");
  }
  // In place: the logits become d(loss)/d(logits).
  logits_valid_ = false;
  timer_.Mark("classifier");
  ZS_RETURN_IF_ERROR(gpu::ClassifierBackward(logits_, logits_, logits_lse_, targets_, n_, v,
                                             logits_ld_, act_dtype_, stream_));
  gpu::CublasLtLinear::BackwardWeightArgs bw{g[kWte].data, nullptr,    logits_,
                                             lnf_,         act_dtype_, Layout::kOutIn};
  bw.n = n_, bw.in = c, bw.out = v;
  bw.ld_dy = logits_ld_;
  timer_.Mark("matmul");
  ZS_RETURN_IF_ERROR(linear_->BackwardWeight(bw));
  {
    timer_.Mark("matmul");
    // Over the padded OUT (HeadWeight): the classifier's backward wrote the
    // padding columns of dy 0, and the padding rows of the weight are 0.
    const auto head = HeadWeight(p[kWte].data);
    if (!head.ok()) return head.status();
    gpu::CublasLtLinear::BackwardInputArgs bi{dtmp_,       DType::kF32, logits_,
                                              head->first, act_dtype_,  Layout::kOutIn};
    bi.n = n_, bi.in = c, bi.out = head->second;
    bi.ld_dy = logits_ld_;
    ZS_RETURN_IF_ERROR(linear_->BackwardInput(bi));
  }
  timer_.Mark("layernorm");
  return gpu::LayerNormBackward(dresid_, g[kLnfW].data, g[kLnfB].data, dtmp_, resid_[cfg.n_layer],
                                p[kLnfW].data, lnf_mean_, lnf_rstd_, n_, c, stream_);
}

#undef ZS_ASSIGN_OR_RETURN
#undef ZS_RETURN_IF_ERROR

}  // namespace zeroshard
