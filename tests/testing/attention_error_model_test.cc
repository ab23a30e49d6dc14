// The fused attention error model (attention_error_model.h) on the CPU,
// against an emulation of what a bf16 flash attention does (cuDNN's, as the
// model describes it: f32 scores and softmax, the weights rounded to bf16
// before they multiply V, dS rounded to bf16 before dq / dk, every output
// rounded to bf16): the emulation must fall within the model everywhere (the
// model is not too tight for the arithmetic it describes), and emulations
// with a real bug (wrong scale, no causal mask, another head's values) must
// fall outside it (the model is not too loose to catch them). The device's
// own check is tests/gpu/cuda_cudnn_attention_check.
#include "tests/testing/attention_error_model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"

namespace zeroshard::testing {
namespace {

float Bf16(float x) { return BF16ToFloat(FloatToBF16(x)); }

struct Bugs {
  float scale = 0;         // 0: 1/sqrt(HS)
  bool causal = true;      // false: every key, also the later ones
  int64_t head_shift = 0;  // read the values of head (h + shift) % NH
};

// One head (bi, h) of a bf16 flash attention, forward and backward, written
// into the full tensors of `r`.
void EmulateHead(const AttentionShape& s, const std::vector<float>& qkv,
                 const std::vector<float>& dout, int64_t bi, int64_t h, const Bugs& bugs,
                 AttentionResults& r) {
  const int64_t hs = s.hs(), t = s.t, hv = (h + bugs.head_shift) % s.nh;
  const float scale = bugs.scale > 0 ? bugs.scale : 1.0f / std::sqrt(static_cast<float>(hs));
  auto at = [&](int64_t row, int part, int64_t head, int64_t i) {
    return qkv[(bi * t + row) * 3 * s.c + part * s.c + head * hs + i];
  };
  auto dO = [&](int64_t row, int64_t i) { return dout[(bi * t + row) * s.c + h * hs + i]; };
  auto O = [&](int64_t row, int64_t i) -> float& {
    return r.out[(bi * t + row) * s.c + h * hs + i];
  };
  const int64_t keys = bugs.causal ? 0 : t;  // keys seen by row q: max(q + 1, keys)
  std::vector<float> p(t * t, 0.0f), ds(t * t, 0.0f);
  for (int64_t q = 0; q < t; ++q) {
    const int64_t n = std::max(q + 1, keys);
    std::vector<float> score(n);
    float m = -INFINITY, l = 0;
    for (int64_t k = 0; k < n; ++k) {
      float dot = 0;
      for (int64_t i = 0; i < hs; ++i) dot += at(q, 0, h, i) * at(k, 1, h, i);
      score[k] = dot * scale;
      m = std::max(m, score[k]);
    }
    for (int64_t k = 0; k < n; ++k) l += (p[q * t + k] = std::exp(score[k] - m));
    r.lse[(bi * s.nh + h) * t + q] = m + std::log(l);
    for (int64_t i = 0; i < hs; ++i) {
      float acc = 0;
      for (int64_t k = 0; k < n; ++k) acc += Bf16(p[q * t + k]) * at(k, 2, hv, i);
      O(q, i) = Bf16(acc / l);
    }
    for (int64_t k = 0; k < n; ++k) p[q * t + k] /= l;
    float d = 0;  // from the bf16 out, as cuDNN does
    for (int64_t i = 0; i < hs; ++i) d += dO(q, i) * O(q, i);
    for (int64_t k = 0; k < n; ++k) {
      float dp = 0;
      for (int64_t i = 0; i < hs; ++i) dp += dO(q, i) * at(k, 2, hv, i);
      ds[q * t + k] = Bf16(p[q * t + k] * (dp - d));
    }
  }
  for (int64_t j = 0; j < t; ++j) {
    for (int64_t i = 0; i < hs; ++i) {
      float dq = 0, dk = 0, dv = 0;
      for (int64_t k = 0; k < t; ++k) dq += ds[j * t + k] * at(k, 1, h, i);
      for (int64_t q = 0; q < t; ++q) {
        dk += ds[q * t + j] * at(q, 0, h, i);
        dv += Bf16(p[q * t + j]) * dO(q, i);
      }
      float* row = &r.dqkv[(bi * t + j) * 3 * s.c + h * hs + i];
      row[0] = Bf16(dq * scale);
      row[s.c] = Bf16(dk * scale);
      row[2 * s.c] = Bf16(dv);
    }
  }
}

std::vector<float> Uniform(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return FromBf16(ToBf16(v));
}

// The emulation's results on the check's kind of inputs, against the model.
::testing::AssertionResult Emulated(const AttentionShape& s,
                                    std::vector<std::pair<int64_t, int64_t>> heads,
                                    const Bugs& bugs = {}) {
  const std::vector<float> qkv = Uniform(s.b * s.t * 3 * s.c, 21, -3.0f, 3.0f);
  const std::vector<float> dout = Uniform(s.b * s.t * s.c, 22, -1.0f, 1.0f);
  AttentionResults r{std::vector<float>(s.b * s.t * s.c), std::vector<float>(s.b * s.nh * s.t),
                     std::vector<float>(s.b * s.t * 3 * s.c)};
  if (heads.empty()) {
    for (int64_t bi = 0; bi < s.b; ++bi) {
      for (int64_t h = 0; h < s.nh; ++h) heads.emplace_back(bi, h);
    }
  }
  for (const auto& [bi, h] : heads) EmulateHead(s, qkv, dout, bi, h, bugs, r);
  return AttentionWithinErrorModel(s, qkv, dout, r, heads);
}

TEST(AttentionErrorModelTest, AFaithfulBf16FlashAttentionIsWithinIt) {
  EXPECT_TRUE(Emulated({3, 37, 120, 3}, {}));          // HS 40
  EXPECT_TRUE(Emulated({2, 130, 128, 2}, {}));         // T past two tiles of 64
  EXPECT_TRUE(Emulated({1, 2, 16, 2}, {}));            // T 2, HS 8
  EXPECT_TRUE(Emulated({2, 1024, 128, 2}, {{1, 1}}));  // GPT-2's T and HS
}

TEST(AttentionErrorModelTest, RealBugsAreOutsideIt) {
  Bugs scale;
  scale.scale = 1.0f / 40;  // 1/HS instead of 1/sqrt(HS)
  EXPECT_FALSE(Emulated({3, 37, 120, 3}, {{1, 1}}, scale));
  Bugs mask;
  mask.causal = false;
  EXPECT_FALSE(Emulated({3, 37, 120, 3}, {{1, 1}}, mask));
  Bugs head;
  head.head_shift = 1;  // a wrong head offset into v
  EXPECT_FALSE(Emulated({3, 37, 120, 3}, {{1, 1}}, head));
}

}  // namespace
}  // namespace zeroshard::testing
