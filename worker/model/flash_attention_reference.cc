// The GPU's fused causal attention (worker/cuda/flash_attention.cu), on the
// host: see flash_attention_reference.h. Each function is written in the
// GPU's order: the outer loops are the thread blocks (one per query tile or
// key tile of one head), the loop over rows inside a tile is the block's
// threads, and each row's arithmetic is what one thread (group) does.
#include "worker/model/flash_attention_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/dtype.h"

namespace zeroshard {
namespace {

// x as it enters a product: rounded to bf16 when the tiles say so.
float Operand(float x, const FlashTiles& tiles) {
  return tiles.bf16_operands ? BF16ToFloat(FloatToBF16(x)) : x;
}

// One head of one batch row: where its q, k, v (and their gradients) and its
// out, lse rows live.
struct HeadView {
  int64_t t, c, hs;
  int64_t qkv_at;  // (batch row * T) * 3C + head * HS
  int64_t out_at;  // (batch row * T) * C + head * HS
  int64_t lse_at;  // (batch row * NH + head) * T

  int64_t Qkv(int64_t pos, int which) const { return qkv_at + pos * 3 * c + which * c; }
  int64_t Out(int64_t pos) const { return out_at + pos * c; }
};

HeadView Head(int64_t bh, int64_t t, int64_t c, int64_t nh) {
  const int64_t bi = bh / nh, h = bh % nh, hs = c / nh;
  return HeadView{t, c, hs, bi * t * 3 * c + h * hs, bi * t * c + h * hs, bh * t};
}

float Dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Running state of one query row's online softmax.
struct RowState {
  float m = -std::numeric_limits<float>::infinity();  // the largest score so far
  float l = 0.0f;                                     // sum of e^(score - m)
  std::vector<float> o;                               // sum of e^(score - m) v
};

// One online-softmax step of query row `row` over keys [k0, k1), those past
// `row` masked: what one GPU thread does for one step of a key tile.
void SoftmaxStep(RowState& st, const float* q, const float* qkv, const HeadView& hv, int64_t row,
                 int64_t k0, int64_t k1, float scale, const FlashTiles& tiles,
                 std::vector<float>& s) {
  float next_m = st.m;
  for (int64_t key = k0; key < k1; ++key) {
    s[key - k0] = key <= row ? scale * Dot(q, qkv + hv.Qkv(key, 1), hv.hs)
                             : -std::numeric_limits<float>::infinity();
    next_m = std::max(next_m, s[key - k0]);
  }
  if (next_m == -std::numeric_limits<float>::infinity()) return;  // no visible key yet
  const float alpha = std::exp(st.m - next_m);                    // 0 on the first step
  st.l *= alpha;
  for (float& x : st.o) x *= alpha;
  for (int64_t key = k0; key < k1; ++key) {
    const float p = std::exp(s[key - k0] - next_m);  // 0 where masked
    st.l += p;
    const float pv = Operand(p, tiles);
    const float* v = qkv + hv.Qkv(key, 2);
    for (int64_t i = 0; i < hv.hs; ++i) st.o[i] += pv * v[i];
  }
  st.m = next_m;
}

}  // namespace

void FlashAttentionForwardReference(float* out, float* lse, const float* qkv, int64_t b, int64_t t,
                                    int64_t c, int64_t nh, const FlashTiles& tiles) {
  if (b == 0 || t == 0 || c == 0) return;
  const int64_t hs = c / nh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  std::vector<float> s(static_cast<size_t>(tiles.softmax_step));
  for (int64_t bh = 0; bh < b * nh; ++bh) {
    const HeadView hv = Head(bh, t, c, nh);
    for (int64_t i0 = 0; i0 < t; i0 += tiles.query_rows) {  // a thread block
      const int64_t rows_end = std::min(i0 + tiles.query_rows, t);
      std::vector<RowState> rows(static_cast<size_t>(rows_end - i0));
      for (RowState& st : rows) st.o.assign(static_cast<size_t>(hs), 0.0f);
      // Key tiles with a key <= the tile's last row; the rest is skipped.
      for (int64_t j0 = 0; j0 < rows_end; j0 += tiles.key_cols) {
        const int64_t keys_end = std::min(j0 + tiles.key_cols, t);
        for (int64_t row = i0; row < rows_end; ++row) {  // a thread (group)
          const float* q = qkv + hv.Qkv(row, 0);
          // Steps wholly past the row are skipped here; on the GPU they run
          // masked, which changes nothing (alpha = e^0 = 1, p = 0).
          for (int64_t k0 = j0; k0 < keys_end && k0 <= row; k0 += tiles.softmax_step) {
            const int64_t k1 = std::min(k0 + tiles.softmax_step, keys_end);
            SoftmaxStep(rows[row - i0], q, qkv, hv, row, k0, k1, scale, tiles, s);
          }
        }
      }
      for (int64_t row = i0; row < rows_end; ++row) {
        const RowState& st = rows[row - i0];
        float* o = out + hv.Out(row);
        for (int64_t i = 0; i < hs; ++i) o[i] = st.o[i] / st.l;
        lse[hv.lse_at + row] = st.m + std::log(st.l);
      }
    }
  }
}

namespace {

// dk, dv of key tile [j0, j0 + key_cols) of one head: one GPU block, a thread
// (group) per key, looping over the query tiles from the one holding j0 on.
void KeyTileBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                     const float* d, const HeadView& hv, int64_t j0, const FlashTiles& tiles,
                     float scale) {
  const int64_t keys_end = std::min(j0 + tiles.key_cols, hv.t);
  const int64_t first_tile = j0 / tiles.query_rows * tiles.query_rows;
  std::vector<float> dk(static_cast<size_t>(hv.hs)), dv(dk.size());
  for (int64_t key = j0; key < keys_end; ++key) {
    const float* k = qkv + hv.Qkv(key, 1);
    const float* v = qkv + hv.Qkv(key, 2);
    std::fill(dk.begin(), dk.end(), 0.0f);
    std::fill(dv.begin(), dv.end(), 0.0f);
    for (int64_t i0 = first_tile; i0 < hv.t; i0 += tiles.query_rows) {
      const int64_t rows_end = std::min(i0 + tiles.query_rows, hv.t);
      for (int64_t row = std::max(i0, key); row < rows_end; ++row) {  // rows < key: p = 0
        const float* q = qkv + hv.Qkv(row, 0);
        const float* g = dout + hv.Out(row);
        const float p = std::exp(scale * Dot(q, k, hv.hs) - lse[hv.lse_at + row]);
        const float ds = Operand(p * (Dot(g, v, hv.hs) - d[hv.lse_at + row]), tiles);
        const float pv = Operand(p, tiles);
        for (int64_t i = 0; i < hv.hs; ++i) {
          dv[i] += pv * g[i];
          dk[i] += ds * q[i];
        }
      }
    }
    float* dk_out = dqkv + hv.Qkv(key, 1);
    float* dv_out = dqkv + hv.Qkv(key, 2);
    for (int64_t i = 0; i < hv.hs; ++i) {
      dk_out[i] = scale * dk[i];
      dv_out[i] = dv[i];
    }
  }
}

// dq of query tile [i0, i0 + query_rows) of one head: one GPU block, a thread
// (group) per query row, looping over the key tiles up to its last row.
void QueryTileBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                       const float* d, const HeadView& hv, int64_t i0, const FlashTiles& tiles,
                       float scale) {
  const int64_t rows_end = std::min(i0 + tiles.query_rows, hv.t);
  std::vector<float> dq(static_cast<size_t>(hv.hs));
  for (int64_t row = i0; row < rows_end; ++row) {
    const float* q = qkv + hv.Qkv(row, 0);
    const float* g = dout + hv.Out(row);
    std::fill(dq.begin(), dq.end(), 0.0f);
    for (int64_t j0 = 0; j0 < rows_end; j0 += tiles.key_cols) {
      const int64_t keys_end = std::min({j0 + tiles.key_cols, hv.t, row + 1});  // keys > row: 0
      for (int64_t key = j0; key < keys_end; ++key) {
        const float* k = qkv + hv.Qkv(key, 1);
        const float p = std::exp(scale * Dot(q, k, hv.hs) - lse[hv.lse_at + row]);
        const float ds =
            Operand(p * (Dot(g, qkv + hv.Qkv(key, 2), hv.hs) - d[hv.lse_at + row]), tiles);
        for (int64_t i = 0; i < hv.hs; ++i) dq[i] += ds * k[i];
      }
    }
    float* dq_out = dqkv + hv.Qkv(row, 0);
    for (int64_t i = 0; i < hv.hs; ++i) dq_out[i] = scale * dq[i];
  }
}

}  // namespace

void FlashAttentionBackwardReference(float* dqkv, const float* dout, const float* qkv,
                                     const float* out, const float* lse, int64_t b, int64_t t,
                                     int64_t c, int64_t nh, const FlashTiles& tiles) {
  if (b == 0 || t == 0 || c == 0) return;
  const int64_t hs = c / nh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // The GPU's first kernel: D [B,NH,T], each row's dout . out.
  std::vector<float> d(static_cast<size_t>(b * nh * t));
  for (int64_t bh = 0; bh < b * nh; ++bh) {
    const HeadView hv = Head(bh, t, c, nh);
    for (int64_t row = 0; row < t; ++row) {
      d[hv.lse_at + row] = Dot(dout + hv.Out(row), out + hv.Out(row), hs);
    }
  }
  for (int64_t bh = 0; bh < b * nh; ++bh) {
    const HeadView hv = Head(bh, t, c, nh);
    for (int64_t j0 = 0; j0 < t; j0 += tiles.key_cols) {
      KeyTileBackward(dqkv, dout, qkv, lse, d.data(), hv, j0, tiles, scale);
    }
    for (int64_t i0 = 0; i0 < t; i0 += tiles.query_rows) {
      QueryTileBackward(dqkv, dout, qkv, lse, d.data(), hv, i0, tiles, scale);
    }
  }
}

}  // namespace zeroshard
