// CPU kernels for the models: f32, row-major, each layer's forward next to
// its backward.
//
// Conventions (as in llm.c):
//  - N is the number of rows (positions, or batch rows); C, IN, OUT, V are
//    feature widths. A tensor "[N,C]" is N*C contiguous floats.
//  - Backward functions ADD into parameter gradients (so several ops or
//    micro-batches can accumulate into one buffer) and OVERWRITE input
//    gradients. An input-gradient pointer may be nullptr when the caller does
//    not need it (e.g. the first layer's input).
//  - Gradients are of a scalar loss; dy/dout is d(loss)/d(output).
//  - Elementwise kernels (activations) allow out == in / dx == dy.
#ifndef ZEROSHARD_WORKER_MODEL_LAYERS_H_
#define ZEROSHARD_WORKER_MODEL_LAYERS_H_

#include <cstdint>

namespace zeroshard {

// ----------------------------------------------------------------------------
// Linear, PyTorch nn.Linear layout: w [OUT,IN], b [OUT] (b may be nullptr).
// y[N,OUT] = x[N,IN] w^T + b.

void LinearForward(float* y, const float* x, const float* w, const float* b, int64_t n, int64_t in,
                   int64_t out);
// dx[N,IN] = dy w (written); dw += dy^T x; db += column sums of dy (db may be
// nullptr when there is no bias). `accumulate` false: dw and db are written
// (=) instead, whatever they held.
void LinearBackward(float* dx, float* dw, float* db, const float* dy, const float* x,
                    const float* w, int64_t n, int64_t in, int64_t out, bool accumulate = true);

// ----------------------------------------------------------------------------
// Conv1D, the Hugging Face GPT-2 layout: w [IN,OUT], b [OUT].
// y[N,OUT] = x[N,IN] w + b.

void Conv1dForward(float* y, const float* x, const float* w, const float* b, int64_t n, int64_t in,
                   int64_t out);
// dx[N,IN] = dy w^T (written); dw += x^T dy; db += column sums of dy.
void Conv1dBackward(float* dx, float* dw, float* db, const float* dy, const float* x,
                    const float* w, int64_t n, int64_t in, int64_t out);

// ----------------------------------------------------------------------------
// ReLU over n elements. Backward needs the forward input x.

void ReluForward(float* y, const float* x, int64_t n);
void ReluBackward(float* dx, const float* dy, const float* x, int64_t n);

// ----------------------------------------------------------------------------
// GELU, exact: x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) (PyTorch nn.GELU()).

void GeluForward(float* y, const float* x, int64_t n);
void GeluBackward(float* dx, const float* dy, const float* x, int64_t n);

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// (PyTorch nn.GELU(approximate="tanh"), Hugging Face "gelu_new").

void GeluTanhForward(float* y, const float* x, int64_t n);
void GeluTanhBackward(float* dx, const float* dy, const float* x, int64_t n);

// ----------------------------------------------------------------------------
// MSE loss over n elements: mean((pred - target)^2) (torch.nn.MSELoss()).

double MseForward(const float* pred, const float* target, int64_t n);
// dpred = d(mean loss)/d(pred) = 2 (pred - target) / n (written).
void MseBackward(float* dpred, const float* pred, const float* target, int64_t n);

// ----------------------------------------------------------------------------
// LayerNorm over the last dim C, eps 1e-5, biased variance (nn.LayerNorm).
// out[N,C] = (x - mean) * rstd * w + b; mean[N] and rstd[N] are saved for
// the backward pass.

constexpr float kLayerNormEps = 1e-5f;

void LayerNormForward(float* out, float* mean, float* rstd, const float* x, const float* w,
                      const float* b, int64_t n, int64_t c);
// dx written (must not alias dout); dw += sum over rows of dout * xhat;
// db += column sums of dout.
void LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x,
                       const float* w, const float* mean, const float* rstd, int64_t n, int64_t c);

// ----------------------------------------------------------------------------
// Causal multi-head self-attention on packed projections.
// qkv [B,T,3C] holds q = [..., 0:C], k = [..., C:2C], v = [..., 2C:3C]
// (the Hugging Face GPT-2 c_attn split); each of them splits C into NH heads
// of HS = C/NH. For each head, position t attends to positions <= t with
// weights softmax(q_t . k_s / sqrt(HS)).
// out [B,T,C]: the heads' outputs side by side (head h at columns h*HS..).
// att [B,NH,T,T]: the attention weights, saved for backward (entries above
// the diagonal are 0).

void AttentionForward(float* out, float* att, const float* qkv, int64_t b, int64_t t, int64_t c,
                      int64_t nh);
// dqkv [B,T,3C] written.
void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                       int64_t b, int64_t t, int64_t c, int64_t nh);

// ----------------------------------------------------------------------------
// Token + position embedding: out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].
// wte [V,C], wpe [>=T,C], tokens [B,T] each in [0,V) (not checked here).

void EmbeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                      int64_t b, int64_t t, int64_t c);
// Scatter-add: dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:].
void EmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                       int64_t b, int64_t t, int64_t c);

// ----------------------------------------------------------------------------
// Tied LM head: logits[N,V] = x[N,C] wte^T, wte [V,C] (the embedding matrix).

void LmHeadForward(float* logits, const float* x, const float* wte, int64_t n, int64_t c,
                   int64_t v);
// dx[N,C] = dlogits wte (written); dwte += dlogits^T x.
void LmHeadBackward(float* dx, float* dwte, const float* dlogits, const float* x, const float* wte,
                    int64_t n, int64_t c, int64_t v);

// ----------------------------------------------------------------------------
// dst[i] = a[i] + b[i] over n elements (dst may alias a or b): residual paths.

void ResidualAdd(float* dst, const float* a, const float* b, int64_t n);

// ----------------------------------------------------------------------------
// Softmax cross-entropy over N positions with V classes; the loss is the mean
// over scored positions of -log softmax(logits)[target]. probs [N,V] is
// written for the backward pass. targets each in [0,V), or kUnscoredTarget
// for a position that adds nothing to the loss or its gradient (PyTorch's
// ignore_index); not checked here. No scored position: loss 0.
inline constexpr int32_t kUnscoredTarget = -1;

// Positions among targets[0, n) that are not kUnscoredTarget.
int64_t ScoredPositions(const int32_t* targets, int64_t n);

double CrossEntropyForward(float* probs, const float* logits, const int32_t* targets, int64_t n,
                           int64_t v);
// dlogits = (probs - onehot(target)) / (scored positions) (written); 0 on the
// rows of unscored positions.
void CrossEntropyBackward(float* dlogits, const float* probs, const int32_t* targets, int64_t n,
                          int64_t v);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_LAYERS_H_
