// A GPT-2 decoder (pre-LayerNorm, tied LM head) on the CPU, with tensor names
// and shapes exactly as Hugging Face's GPT2LMHeadModel state_dict
// (transformer.*; lm_head.weight is tied to transformer.wte.weight and not a
// separate tensor). Activation "gelu_new" (tanh approximation), no dropout.
//
// Units and ops:
//   unit 0 "embed": transformer.wte.weight [V,C], transformer.wpe.weight
//     [n_ctx,C], transformer.ln_f.weight [C], transformer.ln_f.bias [C]
//     (ln_f comes last in Spec() but carries the "embed" label);
//   unit i+1 "h.{i}": the 12 tensors of block i.
//   ForwardOps() = [0, 1, ..., n_layer, 0]: op 0 embeds the tokens, op i+1
//   runs block i, the last op runs ln_f, the tied LM head and the loss.
//   Unit 0's gradient gets contributions from both op 0 and the last op; both
//   ADD, so the engine zeroes that buffer once per step.
#ifndef ZEROSHARD_WORKER_MODEL_GPT_H_
#define ZEROSHARD_WORKER_MODEL_GPT_H_

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

struct GptConfig {
  int n_layer = 2;      // blocks, >= 1
  int n_head = 4;       // attention heads; must divide n_embd
  int64_t n_embd = 64;  // C
  int64_t vocab = 256;  // V (bytes by default)
  int64_t n_ctx = 128;  // maximum sequence length T (rows of wpe)
};

// A language model over tokens, on any device: what the GPT task needs
// beyond Model (GptModel on the CPU, CudaGptModel on a GPU).
class TokenModel : public Model {
 public:
  // The batch for the next pass: tokens and targets are [b, t] in host
  // memory, tokens in [0, vocab), targets too or kUnscoredTarget, t <= n_ctx
  // (CudaGptModel: <= the length it was sized for). Both are copied. Resets
  // the op order (the next call must be Forward(0)).
  virtual absl::Status SetBatch(const int32_t* tokens, const int32_t* targets, int b, int t) = 0;
  // Copies the logits [vocab] of `position` (b * t + t) of the last forward
  // pass into `out` (host memory). Valid once the last op ran forward, and
  // until the head's backward (CudaGptModel turns the logits into their
  // gradient in place: FAILED_PRECONDITION after it).
  virtual absl::Status LogitsRowToHost(int64_t position, float* out) const = 0;
  virtual const GptConfig& config() const = 0;

 protected:
  // Positions of the tensors within unit 0 and within a block's unit (the
  // order of Spec(), which is Hugging Face's state_dict order), the same in
  // every implementation.
  enum EmbedParam { kWte, kWpe, kLnfW, kLnfB, kNumEmbedParams };
  enum BlockParam {
    kLn1W,
    kLn1B,
    kAttnW,
    kAttnB,
    kAttnProjW,
    kAttnProjB,
    kLn2W,
    kLn2B,
    kFcW,
    kFcB,
    kFcProjW,
    kFcProjB,
    kNumBlockParams
  };
};

class GptModel : public TokenModel {
 public:
  // INVALID_ARGUMENT for non-positive sizes or n_embd % n_head != 0.
  static absl::StatusOr<std::unique_ptr<GptModel>> Create(const GptConfig& config);

  // The batch for the next pass: tokens and targets are [b, t], each in
  // [0, vocab) (a target may be kUnscoredTarget: layers.h), t <= n_ctx.
  // Both are copied. Resets the op order (the next call must be
  // Forward(0)). Activation buffers are sized here for b*t positions and
  // kept while b*t stays the same.
  absl::Status SetBatch(const int32_t* tokens, const int32_t* targets, int b, int t) override;
  absl::Status LogitsRowToHost(int64_t position, float* out) const override;

  // The logits [b, t, vocab] of the last forward pass (valid once the last
  // op ran forward; e.g. for sampling or accuracy).
  const float* Logits() const { return logits_.data(); }
  int batch() const { return b_; }
  int seq_len() const { return t_; }
  const GptConfig& config() const override { return config_; }

  // Model.
  const ModelSpec& Spec() const override { return spec_; }
  const std::vector<int>& ForwardOps() const override { return forward_ops_; }
  absl::Status Forward(int op, const UnitTensors& params) override;
  absl::Status Backward(int op, const UnitTensors& params, UnitTensors& grads) override;
  // Mean cross-entropy over the b*t positions' scored targets (layers.h), in nats.
  double Loss() const override { return loss_; }
  int64_t ActivationBytes() const override;
  // Hugging Face GPT-2 init: weights and embeddings normal(0, 0.02), the two
  // c_proj weights of each block normal(0, 0.02 / sqrt(2 n_layer)), biases
  // 0, LayerNorm weight 1 and bias 0. Unknown names: zeros.
  void InitRows(const TensorSpec& tensor, int64_t row_begin, int64_t row_end, uint64_t seed,
                float* out) const override;

 private:
  // What block l keeps from forward for backward (N = b*t positions).
  struct BlockActs {
    std::vector<float> ln1, ln1_mean, ln1_rstd;  // [N,C], [N], [N]
    std::vector<float> qkv;                      // [N,3C]
    std::vector<float> att;                      // [B,NH,T,T] attention weights
    std::vector<float> atty;                     // [N,C] attention output
    std::vector<float> res2;                     // [N,C] x + attn(ln_1(x))
    std::vector<float> ln2, ln2_mean, ln2_rstd;  // [N,C], [N], [N]
    std::vector<float> fch, fch_gelu;            // [N,4C] c_fc output, after GELU
  };

  // `spec`: Gpt2Spec of `config` (the model zoo's tensor list).
  GptModel(const GptConfig& config, ModelSpec spec);

  void EmbedForward(const UnitTensors& p);
  void BlockForward(int layer, const UnitTensors& p);
  void HeadForward(const UnitTensors& p);
  void EmbedBackward(UnitTensors& g);
  void BlockBackward(int layer, const UnitTensors& p, UnitTensors& g);
  void HeadBackward(const UnitTensors& p, UnitTensors& g);

  GptConfig config_;
  ModelSpec spec_;
  std::vector<InitRule> init_rules_;            // per spec tensor
  std::vector<std::vector<int>> unit_tensors_;  // spec indices per unit
  std::vector<int> forward_ops_;
  OpSequencer sequencer_;

  // The batch.
  int b_ = 0, t_ = 0;
  std::vector<int32_t> tokens_, targets_;  // [B,T]

  // Activations. resid_[l] is the residual stream entering block l
  // (resid_[0] = embeddings, resid_[n_layer] = last block's output).
  std::vector<std::vector<float>> resid_;  // n_layer+1 x [N,C]
  std::vector<BlockActs> blocks_;
  std::vector<float> lnf_, lnf_mean_, lnf_rstd_;  // [N,C], [N], [N]
  std::vector<float> logits_, probs_;             // [N,V]
  double loss_ = 0.0;

  // Backward scratch. dresid_ carries d(loss)/d(residual stream) from one op
  // to the previous.
  std::vector<float> dresid_, dres2_, dtmp_, dtmp2_;  // [N,C]
  std::vector<float> dqkv_;                           // [N,3C]
  std::vector<float> dfch_;                           // [N,4C]
  std::vector<float> dlogits_;                        // [N,V]
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_GPT_H_
