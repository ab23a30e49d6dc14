// The GPU flash attention's algorithm (worker/model/flash_attention_reference.h:
// query and key tiles, online softmax, causal tile skipping, the backward
// split into a pass per key tile and a pass per query tile) against layers.h's
// naive attention, which stores the whole T x T weights. Tolerances from
// tests/testing/flash_attention_error_model.h, element by element.
#include "worker/model/flash_attention_reference.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/testing/flash_attention_error_model.h"
#include "tests/worker/model/test_util.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

using testing::AttentionErrorModel;
using testing::AttentionTolerances;
using testing::CausalAttentionTolerances;
using testing::CountOutside;
using testing::RandomVector;

struct Shape {
  int64_t b, t, c, nh;
};

std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << "b " << s.b << " t " << s.t << " c " << s.c << " nh " << s.nh << " (hs "
            << s.c / s.nh << ")";
}

// The tolerances must stay well below the values compared, or the comparison
// would pass anything: an error of the algorithm (a skipped or doubled tile,
// a missing rescale, a wrong mask) moves elements by their own size. The
// model is worst-case (n u per sum of n terms, every term's error carried at
// full size) and dq, dk are sums that cancel (rows of ds sum to 0: values
// ~ their terms' magnitudes / sqrt(T)). In f32 its bounds average ~0.3% of
// out's values and ~3% of dq's and dk's at T = 1024; the bf16 operands add
// 2^-8 of every term: ~6% of out's and dv's values at T = 1024, but ~25%
// (T ~ 150) to ~90% (T = 1024) of dq's and dk's, which are therefore not
// held to a limit there (their comparison stays, as a bound).
// `limit` caps the mean tolerance relative to the mean |value| of one part
// (`which` 0, 1, 2 for dq, dk, dv in dqkv; -1 for all of it).
void ExpectMeaningful(const std::vector<double>& tol, const std::vector<float>& want, int64_t c,
                      int which, double limit, const char* what) {
  double sum_tol = 0, sum_want = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (which >= 0 && static_cast<int64_t>(i) % (3 * c) / c != which) continue;
    sum_tol += tol[i];
    sum_want += std::fabs(want[i]);
  }
  if (sum_want == 0) return;  // T = 1: dq, dk are exactly 0 (one key, ds = dp - dp)
  EXPECT_LT(sum_tol, limit * sum_want) << what << ": the tolerance would hide real errors";
}

// x rounded to bf16 (to nearest even) and widened back.
std::vector<float> RoundedToBF16(std::vector<float> x) {
  for (float& v : x) v = BF16ToFloat(FloatToBF16(v));
  return x;
}

// With bf16_storage, what the GPU's bf16 runs do: the inputs are bf16 values
// (the naive attention computes on the same), and out (read back by the
// backward for D) and dqkv are rounded to bf16 where they are stored: the
// error model's storage_unit, checked here before any GPU holds it to it.
void ExpectMatchesNaive(const Shape& s, const FlashTiles& tiles, float range, uint32_t seed,
                        bool bf16_storage = false) {
  SCOPED_TRACE(::testing::Message()
               << s << " tiles " << tiles.query_rows << "x" << tiles.key_cols << " step "
               << tiles.softmax_step << (bf16_storage ? " bf16 storage" : ""));
  std::vector<float> qkv = RandomVector(s.b * s.t * 3 * s.c, -range, range, seed);
  std::vector<float> dout = RandomVector(s.b * s.t * s.c, -1, 1, seed + 1);
  if (bf16_storage) {
    qkv = RoundedToBF16(qkv);
    dout = RoundedToBF16(dout);
  }

  std::vector<float> out(s.b * s.t * s.c), att(s.b * s.nh * s.t * s.t), dqkv(qkv.size());
  AttentionForward(out.data(), att.data(), qkv.data(), s.b, s.t, s.c, s.nh);
  AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), s.b, s.t, s.c, s.nh);

  // Sentinels: an element the reference fails to write shows.
  std::vector<float> flash_out(out.size(), NAN), lse(s.b * s.nh * s.t, NAN),
      flash_dqkv(qkv.size(), NAN);
  FlashAttentionForwardReference(flash_out.data(), lse.data(), qkv.data(), s.b, s.t, s.c, s.nh,
                                 tiles);
  if (bf16_storage) flash_out = RoundedToBF16(flash_out);
  FlashAttentionBackwardReference(flash_dqkv.data(), dout.data(), qkv.data(), flash_out.data(),
                                  lse.data(), s.b, s.t, s.c, s.nh, tiles);
  if (bf16_storage) flash_dqkv = RoundedToBF16(flash_dqkv);

  AttentionErrorModel model;
  model.key_cols = tiles.key_cols;
  model.softmax_step = tiles.softmax_step;
  model.operand_unit = tiles.bf16_operands ? 0x1p-8 : 0.0;
  model.storage_unit = bf16_storage ? 0x1p-8 : 0.0;
  const AttentionTolerances tol = CausalAttentionTolerances(qkv, dout, s.b, s.t, s.c, s.nh, model);
  std::string worst;
  EXPECT_EQ(CountOutside(flash_out, out, tol.out, &worst), 0) << "out, worst " << worst;
  EXPECT_EQ(CountOutside(lse, tol.lse_exact, tol.lse, &worst), 0) << "lse, worst " << worst;
  EXPECT_EQ(CountOutside(flash_dqkv, dqkv, tol.dqkv, &worst), 0) << "dqkv, worst " << worst;
  if (tiles.bf16_operands || bf16_storage) {
    ExpectMeaningful(tol.out, out, s.c, -1, 0.1, "out");
    ExpectMeaningful(tol.dqkv, dqkv, s.c, 2, 0.1, "dv");
  } else {
    ExpectMeaningful(tol.out, out, s.c, -1, 0.05, "out");
    for (int which : {0, 1, 2}) ExpectMeaningful(tol.dqkv, dqkv, s.c, which, 0.05, "dq, dk, dv");
  }
}

TEST(FlashAttentionReferenceTest, SinglePosition) {
  ExpectMatchesNaive({1, 1, 16, 1}, FlashTiles{}, 1.5f, 1);
  ExpectMatchesNaive({2, 1, 64, 4}, FlashTiles{}, 1.5f, 2);
}

TEST(FlashAttentionReferenceTest, LengthNotAMultipleOfTheTiles) {
  ExpectMatchesNaive({2, 37, 32, 2}, FlashTiles{}, 1.5f, 3);    // one partial tile, hs 16
  ExpectMatchesNaive({1, 150, 128, 2}, FlashTiles{}, 1.5f, 4);  // 2 full + 1 partial, hs 64
  ExpectMatchesNaive({1, 97, 128, 1}, FlashTiles{}, 1.5f, 5);   // hs 128
}

TEST(FlashAttentionReferenceTest, LengthAMultipleOfTheTiles) {
  ExpectMatchesNaive({2, 128, 128, 2}, FlashTiles{}, 1.5f, 6);
  ExpectMatchesNaive({1, 192, 384, 3}, FlashTiles{}, 1.5f, 7);  // hs 128
}

// GPT-2's head: T 1024, HS 64 (16 query tiles, up to 64 rescales per row).
TEST(FlashAttentionReferenceTest, Gpt2Head) {
  ExpectMatchesNaive({1, 1024, 64, 1}, FlashTiles{}, 1.5f, 17);
  ExpectMatchesNaive({1, 1024, 64, 1}, FlashTiles{64, 64, 64, true}, 1.5f, 18);
}

// Query and key tiles of different sizes, steps that do not divide the key
// tile, tiny tiles: the skipping and masking at every kind of boundary.
TEST(FlashAttentionReferenceTest, OtherTileShapes) {
  const Shape shape{2, 45, 48, 3};  // hs 16
  ExpectMatchesNaive(shape, FlashTiles{16, 32, 8}, 1.5f, 8);
  ExpectMatchesNaive(shape, FlashTiles{32, 16, 16}, 1.5f, 9);
  ExpectMatchesNaive(shape, FlashTiles{7, 5, 3}, 1.5f, 10);
  ExpectMatchesNaive(shape, FlashTiles{1, 1, 1}, 1.5f, 11);
  ExpectMatchesNaive(shape, FlashTiles{64, 64, 64}, 1.5f, 12);
}

// The tensor-core kernels' variant: 64-key softmax steps, the weights and
// score gradients rounded to bf16 where they enter the products.
TEST(FlashAttentionReferenceTest, Bf16Operands) {
  const FlashTiles tensor_cores{64, 64, 64, true};
  ExpectMatchesNaive({2, 37, 32, 2}, tensor_cores, 1.5f, 14);
  ExpectMatchesNaive({1, 150, 128, 2}, tensor_cores, 1.5f, 15);
  ExpectMatchesNaive({1, 128, 256, 2}, tensor_cores, 1.5f, 16);
}

// The GPU parity check's bf16 runs, on the host: CUDA-core tiles (f32
// operands) and tensor-core ones, scores as peaked as there (|qkv| <= 2).
TEST(FlashAttentionReferenceTest, Bf16Storage) {
  for (const FlashTiles& tiles : {FlashTiles{}, FlashTiles{64, 64, 64, true}}) {
    ExpectMatchesNaive({2, 37, 48, 3}, tiles, 2.0f, 19, true);
    ExpectMatchesNaive({2, 130, 128, 2}, tiles, 2.0f, 20, true);
    ExpectMatchesNaive({1, 97, 256, 2}, tiles, 2.0f, 21, true);
    ExpectMatchesNaive({1, 1024, 64, 1}, tiles, 2.0f, 22, true);
  }
}

// Larger scores: peaked weights, many rescales of the running sums.
TEST(FlashAttentionReferenceTest, PeakedSoftmax) {
  ExpectMatchesNaive({1, 130, 128, 2}, FlashTiles{}, 4.0f, 13);
}

}  // namespace
}  // namespace zeroshard
