// Host reference of the fused causal attention that worker/cuda/flash_attention.cu
// runs on the GPU (FlashAttention-2's tiling and online softmax), in plain
// C++: the same tiles, the same order of operations per query row and per
// key row, the same recomputation in the backward. It exists so that the
// algorithm (tile skipping, masking of ragged tails, the rescaling of the
// running sums, the split of the backward) is tested on any CPU against the
// naive attention of layers.h; its speed does not matter.
//
// Layout and conventions as layers.h's AttentionForward / AttentionBackward
// (qkv [B,T,3C], out [B,T,C], C = NH * HS), except that the forward saves
// lse [B,NH,T] (the natural log of each row's softmax denominator over the
// scaled scores) instead of the weights.
#ifndef ZEROSHARD_WORKER_MODEL_FLASH_ATTENTION_REFERENCE_H_
#define ZEROSHARD_WORKER_MODEL_FLASH_ATTENTION_REFERENCE_H_

#include <cstdint>

namespace zeroshard {

// Tile sizes. The GPU kernels use the defaults (query and key tiles of 64
// rows, an online-softmax update every 16 keys).
struct FlashTiles {
  int64_t query_rows = 64;    // Br: query rows per tile (one thread block on the GPU)
  int64_t key_cols = 64;      // Bc: keys per tile (staged in shared memory on the GPU)
  int64_t softmax_step = 16;  // keys per online-softmax update inside a key tile
  // The tensor-core kernels' rounding: the weights p and score gradients ds
  // rounded to bf16 where they enter the products (o += p v, dv += p dout,
  // dk += ds q, dq += ds k); the sums l and every accumulation stay f32.
  // Those kernels run with tiles {64, 64, 64, true}.
  bool bf16_operands = false;
};

// Forward: for each query tile, the key tiles that hold a key <= its last row
// (later ones are skipped whole); for each row, steps of softmax_step keys
// (keys past the row masked): m' = max(m, scores), alpha = e^(m - m'),
// l = l alpha + sum e^(s - m'), o = o alpha + sum e^(s - m') v. Then
// out = o / l, lse = m + log(l). out [B,T,C] and lse [B,NH,T] written.
void FlashAttentionForwardReference(float* out, float* lse, const float* qkv, int64_t b, int64_t t,
                                    int64_t c, int64_t nh, const FlashTiles& tiles);

// Backward, split as the GPU splits it: D_t = dout_t . out_t; then per key
// tile, over the query tiles that can see it, for each key s and query t >= s:
// p = e^(scale q_t.k_s - lse_t), dv_s += p dout_t, dp = dout_t . v_s,
// ds = p (dp - D_t), dk_s += ds q_t (dk_s scaled by 1/sqrt(HS) at the end);
// and per query tile, over the key tiles it sees, dq_t += ds k_s likewise.
// dqkv [B,T,3C] written.
void FlashAttentionBackwardReference(float* dqkv, const float* dout, const float* qkv,
                                     const float* out, const float* lse, int64_t b, int64_t t,
                                     int64_t c, int64_t nh, const FlashTiles& tiles);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_FLASH_ATTENTION_REFERENCE_H_
