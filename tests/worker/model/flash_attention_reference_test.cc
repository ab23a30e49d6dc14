// The GPU flash attention's algorithm (worker/model/flash_attention_reference.h:
// query and key tiles, online softmax, causal tile skipping, the backward
// split into a pass per key tile and a pass per query tile) against layers.h's
// naive attention, which stores the whole T x T weights. Tolerances from
// tests/testing/attention_error_model.h, element by element.
#include "worker/model/flash_attention_reference.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/attention_error_model.h"
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

// The largest tolerance must stay well below the values compared, or the
// comparison would pass anything. The model is worst-case (n u per sum of n
// terms, every term's error carried at full size), so in the backward, where
// key 0's dk sums the errors of every row's D, it reaches ~1% of the largest
// value at T ~ 150 with peaked weights (~0.1-0.4% with milder ones); an error
// of the algorithm (a skipped or doubled tile, a missing rescale, a wrong
// mask) is of the values' own size.
void ExpectMeaningful(const std::vector<double>& tol, const std::vector<float>& want,
                      const char* what) {
  double max_tol = 0, max_want = 0;
  for (double x : tol) max_tol = std::max(max_tol, x);
  for (float x : want) max_want = std::max<double>(max_want, std::fabs(x));
  EXPECT_LT(max_tol, 2e-2 * max_want) << what << ": the tolerance would hide real errors";
}

void ExpectMatchesNaive(const Shape& s, const FlashTiles& tiles, float range, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << s << " tiles " << tiles.query_rows << "x" << tiles.key_cols
                                    << " step " << tiles.softmax_step);
  const std::vector<float> qkv = RandomVector(s.b * s.t * 3 * s.c, -range, range, seed);
  const std::vector<float> dout = RandomVector(s.b * s.t * s.c, -1, 1, seed + 1);

  std::vector<float> out(s.b * s.t * s.c), att(s.b * s.nh * s.t * s.t), dqkv(qkv.size());
  AttentionForward(out.data(), att.data(), qkv.data(), s.b, s.t, s.c, s.nh);
  AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), s.b, s.t, s.c, s.nh);

  // Sentinels: an element the reference fails to write shows.
  std::vector<float> flash_out(out.size(), NAN), lse(s.b * s.nh * s.t, NAN),
      flash_dqkv(qkv.size(), NAN);
  FlashAttentionForwardReference(flash_out.data(), lse.data(), qkv.data(), s.b, s.t, s.c, s.nh,
                                 tiles);
  FlashAttentionBackwardReference(flash_dqkv.data(), dout.data(), qkv.data(), flash_out.data(),
                                  lse.data(), s.b, s.t, s.c, s.nh, tiles);

  AttentionErrorModel model;
  model.key_cols = tiles.key_cols;
  model.softmax_step = tiles.softmax_step;
  const AttentionTolerances tol = CausalAttentionTolerances(qkv, dout, s.b, s.t, s.c, s.nh, model);
  std::string worst;
  EXPECT_EQ(CountOutside(flash_out, out, tol.out, &worst), 0) << "out, worst " << worst;
  EXPECT_EQ(CountOutside(lse, tol.lse_exact, tol.lse, &worst), 0) << "lse, worst " << worst;
  EXPECT_EQ(CountOutside(flash_dqkv, dqkv, tol.dqkv, &worst), 0) << "dqkv, worst " << worst;
  ExpectMeaningful(tol.out, out, "out");
  ExpectMeaningful(tol.dqkv, dqkv, "dqkv");
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

// Larger scores: peaked weights, many rescales of the running sums.
TEST(FlashAttentionReferenceTest, PeakedSoftmax) {
  ExpectMatchesNaive({1, 130, 128, 2}, FlashTiles{}, 4.0f, 13);
}

}  // namespace
}  // namespace zeroshard
