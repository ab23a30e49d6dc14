#include "worker/model/gpt.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/model_zoo.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

constexpr float kInitStd = 0.02f;  // Hugging Face GPT2Config.initializer_range

}  // namespace

absl::StatusOr<std::unique_ptr<GptModel>> GptModel::Create(const GptConfig& config) {
  if (config.n_layer < 1 || config.n_head < 1 || config.n_embd < 1 || config.vocab < 1 ||
      config.n_ctx < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPT sizes must be positive: n_layer=", config.n_layer, " n_head=", config.n_head,
        " n_embd=", config.n_embd, " vocab=", config.vocab, " n_ctx=", config.n_ctx));
  }
  if (config.n_embd % config.n_head != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_embd ", config.n_embd, " is not divisible by n_head ", config.n_head));
  }
  constexpr int64_t kMaxSize = std::numeric_limits<int>::max();
  if (config.n_embd > kMaxSize || config.vocab > kMaxSize || config.n_ctx > kMaxSize) {
    return absl::InvalidArgumentError(absl::StrCat("GPT sizes must fit an int: n_embd=",
                                                   config.n_embd, " vocab=", config.vocab,
                                                   " n_ctx=", config.n_ctx));
  }
  // The tensors are the model zoo's, so that the spec shardctl plans is the
  // one this model trains.
  absl::StatusOr<ModelSpec> spec =
      Gpt2Spec(config.n_layer, static_cast<int>(config.n_embd), config.n_head,
               static_cast<int>(config.vocab), static_cast<int>(config.n_ctx));
  if (!spec.ok()) return spec.status();
  return std::unique_ptr<GptModel>(new GptModel(config, *std::move(spec)));
}

GptModel::GptModel(const GptConfig& config, ModelSpec spec)
    : config_(config), spec_(std::move(spec)), sequencer_(config.n_layer + 2) {
  // GPT-2 scales the init of the projections that write into the residual
  // stream by 1/sqrt(2 n_layer), so the stream's variance stays O(1) with depth.
  const float proj_std = kInitStd / std::sqrt(2.0f * static_cast<float>(config.n_layer));
  for (const TensorSpec& t : spec_.tensors) {
    if (absl::EndsWith(t.name, ".bias")) {
      init_rules_.push_back(InitRule::Constant(0.0f));
    } else if (absl::StrContains(t.name, ".ln_")) {  // ln_1, ln_2, ln_f weights
      init_rules_.push_back(InitRule::Constant(1.0f));
    } else if (absl::EndsWith(t.name, ".c_proj.weight")) {
      init_rules_.push_back(InitRule::Normal(0.0f, proj_std));
    } else {  // wte, wpe, c_attn, c_fc
      init_rules_.push_back(InitRule::Normal(0.0f, kInitStd));
    }
  }
  unit_tensors_ = TensorsByUnit(spec_);
  for (int op = 0; op <= config.n_layer; ++op) forward_ops_.push_back(op);
  forward_ops_.push_back(0);
}

absl::Status GptModel::SetBatch(const int32_t* tokens, const int32_t* targets, int b, int t) {
  if (b < 1 || t < 1 || t > config_.n_ctx) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch [", b, ",", t, "] needs b >= 1 and 1 <= t <= n_ctx ", config_.n_ctx));
  }
  const int64_t n = static_cast<int64_t>(b) * t;
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= config_.vocab ||
        (targets[i] != kUnscoredTarget && (targets[i] < 0 || targets[i] >= config_.vocab))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "position ", i, ": token ", tokens[i], " / target ", targets[i], " not in [0, ",
          config_.vocab, ") (a target may also be ", kUnscoredTarget, ": not scored)"));
    }
  }
  tokens_.assign(tokens, tokens + n);
  targets_.assign(targets, targets + n);

  const int64_t c = config_.n_embd;
  const int64_t v = config_.vocab;
  const int64_t nh = config_.n_head;
  b_ = b;
  t_ = t;
  // resize keeps the allocation when the size is unchanged.
  resid_.resize(config_.n_layer + 1);
  for (auto& r : resid_) r.resize(n * c);
  blocks_.resize(config_.n_layer);
  for (BlockActs& a : blocks_) {
    a.ln1.resize(n * c);
    a.ln1_mean.resize(n);
    a.ln1_rstd.resize(n);
    a.qkv.resize(n * 3 * c);
    a.att.resize(static_cast<int64_t>(b) * nh * t * t);
    a.atty.resize(n * c);
    a.res2.resize(n * c);
    a.ln2.resize(n * c);
    a.ln2_mean.resize(n);
    a.ln2_rstd.resize(n);
    a.fch.resize(n * 4 * c);
    a.fch_gelu.resize(n * 4 * c);
  }
  lnf_.resize(n * c);
  lnf_mean_.resize(n);
  lnf_rstd_.resize(n);
  logits_.resize(n * v);
  probs_.resize(n * v);
  for (auto* d : {&dresid_, &dres2_, &dtmp_, &dtmp2_}) d->resize(n * c);
  dqkv_.resize(n * 3 * c);
  dfch_.resize(n * 4 * c);
  dlogits_.resize(n * v);
  loss_ = 0.0;
  sequencer_.Reset();
  return absl::OkStatus();
}

absl::Status GptModel::Forward(int op, const UnitTensors& params) {
  if (b_ == 0) return absl::FailedPreconditionError("GptModel::Forward before SetBatch");
  if (absl::Status s = sequencer_.CheckForward(op); !s.ok()) return s;
  const int unit = forward_ops_[op];
  if (absl::Status s = CheckUnitTensors(spec_, unit_tensors_[unit], params, "params"); !s.ok()) {
    return s;
  }
  if (op == 0) {
    EmbedForward(params);
  } else if (op <= config_.n_layer) {
    BlockForward(op - 1, params);
  } else {
    HeadForward(params);
  }
  sequencer_.MarkForward(op);
  return absl::OkStatus();
}

absl::Status GptModel::Backward(int op, const UnitTensors& params, UnitTensors& grads) {
  if (absl::Status s = sequencer_.CheckBackward(op); !s.ok()) return s;
  const int unit = forward_ops_[op];
  if (absl::Status s = CheckUnitTensors(spec_, unit_tensors_[unit], params, "params"); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckUnitTensors(spec_, unit_tensors_[unit], grads, "grads"); !s.ok()) {
    return s;
  }
  if (op == 0) {
    EmbedBackward(grads);
  } else if (op <= config_.n_layer) {
    BlockBackward(op - 1, params, grads);
  } else {
    HeadBackward(params, grads);
  }
  sequencer_.MarkBackward(op);
  return absl::OkStatus();
}

absl::Status GptModel::LogitsRowToHost(int64_t position, float* out) const {
  if (position < 0 || position >= static_cast<int64_t>(b_) * t_ || logits_.empty()) {
    return absl::OutOfRangeError(absl::StrCat("logits row ", position, " of a batch of ",
                                              static_cast<int64_t>(b_) * t_, " positions"));
  }
  const float* row = logits_.data() + position * config_.vocab;
  std::copy(row, row + config_.vocab, out);
  return absl::OkStatus();
}

// ----------------------------------------------------------------------------
// Op 0: token + position embedding.

void GptModel::EmbedForward(const UnitTensors& p) {
  EmbeddingForward(resid_[0].data(), tokens_.data(), p[kWte].data, p[kWpe].data, b_, t_,
                   config_.n_embd);
}

void GptModel::EmbedBackward(UnitTensors& g) {
  EmbeddingBackward(g[kWte].data, g[kWpe].data, dresid_.data(), tokens_.data(), b_, t_,
                    config_.n_embd);
}

// ----------------------------------------------------------------------------
// Ops 1..n_layer: block l.
//   res2 = x + c_proj(attn(c_attn(ln_1(x))))
//   out  = res2 + mlp.c_proj(gelu(mlp.c_fc(ln_2(res2))))

void GptModel::BlockForward(int layer, const UnitTensors& p) {
  const int64_t n = static_cast<int64_t>(b_) * t_;
  const int64_t c = config_.n_embd;
  BlockActs& a = blocks_[layer];
  const float* x = resid_[layer].data();
  float* out = resid_[layer + 1].data();

  LayerNormForward(a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data(), x, p[kLn1W].data,
                   p[kLn1B].data, n, c);
  Conv1dForward(a.qkv.data(), a.ln1.data(), p[kAttnW].data, p[kAttnB].data, n, c, 3 * c);
  AttentionForward(a.atty.data(), a.att.data(), a.qkv.data(), b_, t_, c, config_.n_head);
  Conv1dForward(a.res2.data(), a.atty.data(), p[kAttnProjW].data, p[kAttnProjB].data, n, c, c);
  ResidualAdd(a.res2.data(), a.res2.data(), x, n * c);

  LayerNormForward(a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), a.res2.data(), p[kLn2W].data,
                   p[kLn2B].data, n, c);
  Conv1dForward(a.fch.data(), a.ln2.data(), p[kFcW].data, p[kFcB].data, n, c, 4 * c);
  GeluTanhForward(a.fch_gelu.data(), a.fch.data(), n * 4 * c);
  Conv1dForward(out, a.fch_gelu.data(), p[kFcProjW].data, p[kFcProjB].data, n, 4 * c, c);
  ResidualAdd(out, out, a.res2.data(), n * c);
}

void GptModel::BlockBackward(int layer, const UnitTensors& p, UnitTensors& g) {
  const int64_t n = static_cast<int64_t>(b_) * t_;
  const int64_t c = config_.n_embd;
  const BlockActs& a = blocks_[layer];
  const float* x = resid_[layer].data();
  // On entry dresid_ = d(loss)/d(out); on exit d(loss)/d(x).

  // MLP branch: out = res2 + c_proj(gelu(c_fc(ln_2(res2)))).
  Conv1dBackward(dfch_.data(), g[kFcProjW].data, g[kFcProjB].data, dresid_.data(),
                 a.fch_gelu.data(), p[kFcProjW].data, n, 4 * c, c);
  GeluTanhBackward(dfch_.data(), dfch_.data(), a.fch.data(), n * 4 * c);
  Conv1dBackward(dtmp_.data(), g[kFcW].data, g[kFcB].data, dfch_.data(), a.ln2.data(), p[kFcW].data,
                 n, c, 4 * c);
  LayerNormBackward(dtmp2_.data(), g[kLn2W].data, g[kLn2B].data, dtmp_.data(), a.res2.data(),
                    p[kLn2W].data, a.ln2_mean.data(), a.ln2_rstd.data(), n, c);
  ResidualAdd(dres2_.data(), dresid_.data(), dtmp2_.data(), n * c);  // + the skip path

  // Attention branch: res2 = x + c_proj(attn(c_attn(ln_1(x)))).
  Conv1dBackward(dtmp_.data(), g[kAttnProjW].data, g[kAttnProjB].data, dres2_.data(), a.atty.data(),
                 p[kAttnProjW].data, n, c, c);
  AttentionBackward(dqkv_.data(), dtmp_.data(), a.qkv.data(), a.att.data(), b_, t_, c,
                    config_.n_head);
  Conv1dBackward(dtmp2_.data(), g[kAttnW].data, g[kAttnB].data, dqkv_.data(), a.ln1.data(),
                 p[kAttnW].data, n, c, 3 * c);
  LayerNormBackward(dtmp_.data(), g[kLn1W].data, g[kLn1B].data, dtmp2_.data(), x, p[kLn1W].data,
                    a.ln1_mean.data(), a.ln1_rstd.data(), n, c);
  ResidualAdd(dresid_.data(), dres2_.data(), dtmp_.data(), n * c);  // + the skip path
}

// ----------------------------------------------------------------------------
// Last op: ln_f, tied LM head, cross-entropy.

void GptModel::HeadForward(const UnitTensors& p) {
  const int64_t n = static_cast<int64_t>(b_) * t_;
  const int64_t c = config_.n_embd;
  const int64_t v = config_.vocab;
  LayerNormForward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(), resid_[config_.n_layer].data(),
                   p[kLnfW].data, p[kLnfB].data, n, c);
  LmHeadForward(logits_.data(), lnf_.data(), p[kWte].data, n, c, v);
  loss_ = CrossEntropyForward(probs_.data(), logits_.data(), targets_.data(), n, v);
}

void GptModel::HeadBackward(const UnitTensors& p, UnitTensors& g) {
  const int64_t n = static_cast<int64_t>(b_) * t_;
  const int64_t c = config_.n_embd;
  const int64_t v = config_.vocab;
  CrossEntropyBackward(dlogits_.data(), probs_.data(), targets_.data(), n, v);
  LmHeadBackward(dtmp_.data(), g[kWte].data, dlogits_.data(), lnf_.data(), p[kWte].data, n, c, v);
  LayerNormBackward(dresid_.data(), g[kLnfW].data, g[kLnfB].data, dtmp_.data(),
                    resid_[config_.n_layer].data(), p[kLnfW].data, lnf_mean_.data(),
                    lnf_rstd_.data(), n, c);
}

// ----------------------------------------------------------------------------

int64_t GptModel::ActivationBytes() const {
  int64_t floats = 0;
  for (const auto& r : resid_) floats += r.size();
  for (const BlockActs& a : blocks_) {
    for (const auto* v : {&a.ln1, &a.ln1_mean, &a.ln1_rstd, &a.qkv, &a.att, &a.atty, &a.res2,
                          &a.ln2, &a.ln2_mean, &a.ln2_rstd, &a.fch, &a.fch_gelu}) {
      floats += v->size();
    }
  }
  for (const auto* v : {&lnf_, &lnf_mean_, &lnf_rstd_, &logits_, &probs_, &dresid_, &dres2_, &dtmp_,
                        &dtmp2_, &dqkv_, &dfch_, &dlogits_}) {
    floats += v->size();
  }
  return floats * static_cast<int64_t>(sizeof(float)) +
         static_cast<int64_t>(tokens_.size() + targets_.size()) * sizeof(int32_t);
}

void GptModel::InitRows(const TensorSpec& tensor, int64_t row_begin, int64_t row_end, uint64_t seed,
                        float* out) const {
  const int64_t row_elements = tensor.RowElements();
  const int64_t first = row_begin * row_elements;
  const int64_t count = (row_end - row_begin) * row_elements;
  for (size_t i = 0; i < spec_.tensors.size(); ++i) {
    if (spec_.tensors[i].name == tensor.name) {
      FillInit(init_rules_[i], seed, tensor.name, first, count, out);
      return;
    }
  }
  FillConstant(0.0f, count, out);
}

}  // namespace zeroshard
