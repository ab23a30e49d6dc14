// The error model of causal attention in float32: how far two float32
// computations of the same attention (layers.h's naive one and the tiled,
// online-softmax one of worker/model/flash_attention_reference.h or
// worker/cuda/flash_attention.cu) may be apart, element by element, given
// the inputs. The bounds are evaluated in double from the inputs (the exact
// weights, the magnitudes of every sum's terms); none comes from an observed
// difference.
//
// The model (u = 2^-24, gamma_n as in error_model.h; row t of a head sees
// keys s <= t, n = t + 1 of them):
//  - a score s = scale q.k is a sum of HS products: absolute error
//    <= (gamma_HS + 6u) scale max_s sum_i |q_i k_si| + 2u log(n) =: E, the 6u
//    and the log for the roundings of the scaling and of the subtractions
//    s - m and s - lse (|m|, |lse| <= that scale of the scores + log n);
//  - a weight a = e^(s - m) / l then has relative error
//    w = 2E + (r + 2)(x + u) + gamma_n + 2u: the score and the normaliser
//    (through lse) each off by E, each exp off by x (its relative error) and
//    the r online-softmax rescales of its row each one more exp and one
//    multiplication, the sum l of n positive terms gamma_n, the division u;
//    r = ceil(n / key_cols) * ceil(key_cols / softmax_step);
//  - out = sum_s a_s v_s: (w + gamma_n + u) sum_s a_s |v_s|;
//  - lse = m + log l: E + (r + 2)(x + u) + gamma_n + 4u (|lse| + scale of the scores);
//  - dp = dout . v: gamma_HS sum |dout_i v_i|; D = sum_s a dp (layers.h) or
//    dout . out (the tiled kernels, with out as stored: + storage_unit |out|):
//    the larger of the two bounds; ds = a (dp - D): a ((w + 2u)|dp - D| + the
//    errors of dp and D);
//  - dq, dk = scale sum ds k (or q), dv = sum a dout: sums of up to T terms,
//    each term's error carried, plus gamma_T of their magnitudes.
// Weights and ds rounded to operand_unit to enter the products add
// operand_unit of each term (out, dv: sum a |v|, sum a |dout|; dq, dk: sum
// (|ds| + its error) |k| or |q|), once: only the tiled computation rounds them.
// Two computations each within its bound of the exact value differ by at most
// twice the bound; a result stored in bf16 adds storage_unit of its size.
//
// Products on tensor cores as 3xTF32 (worker/cuda/flash_attention_wmma.cu,
// f32 storage): the sums of products the tiled computation takes there
// (scores q.k, dp = dout.v, out, dv, dq, dk; not l, D, or the softmax) carry
// two more terms:
//  - each product a b is taken with relative error product_error: with
//    t = 2^-11 (tf32's unit roundoff: 10 explicit mantissa bits, round to
//    nearest), big = tf32(a) = a (1 + e1), |e1| <= t; a - big is exact in
//    f32; small = tf32(a - big), so big + small = a (1 + d), |d| <= t^2,
//    and |small| <= t (1 + t) |a|. The sum of the three products is
//    (big + small)(big' + small') - small small' = a b ((1 + d)(1 + d') -
//    e), |e| <= t^2 (1 + t)^2: relative error <= 2 t^2 + t^4 + t^2 (1 + t)^2
//    = t^2 (3 + 2t + 2t^2) < (3 + 2^-9) 2^-22. The tf32 products are exact
//    in f32 (11-bit significands);
//  - each product is product_terms (3) f32 additions into the accumulator,
//    whose magnitudes sum to at most term_magnitude |a b| (|big big'| <=
//    (1 + t)^2 |a b|, |big small'|, |small big'| <= t (1 + t)^2 |a b|: in
//    all (1 + 2t)(1 + t)^2 < 1 + 2^-8), so a sum of n products has
//    gamma_(3n) term_magnitude sum |a b| of accumulation error instead of
//    gamma_n sum |a b|.
// The bound of such a sum, product_error + gamma_(terms n) term_magnitude,
// is larger than the plain f32 sum's gamma_n, so it bounds both
// computations (the naive one too); the rest of the model is unchanged.
#ifndef ZEROSHARD_TESTS_TESTING_FLASH_ATTENTION_ERROR_MODEL_H_
#define ZEROSHARD_TESTS_TESTING_FLASH_ATTENTION_ERROR_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard::testing {

struct AttentionErrorModel {
  // The tiled computation's tiles (worker/model/flash_attention_reference.h).
  int64_t key_cols = 64;
  int64_t softmax_step = 16;
  // Relative error of one exp: CUDA's expf is within 2 ulp (2 ulp of a float
  // in [1, 2) is 4u); std::exp and layers.h's FastExp within 1 ulp.
  double exp_error = 4 * 0x1p-24;
  // Unit roundoff of the stored out, dqkv (bf16: 2^-8); 0 for float32.
  double storage_unit = 0;
  // Unit roundoff of the weights p and score gradients ds where they enter
  // the products (bf16 tensor cores: 2^-8); 0 when they stay float32.
  double operand_unit = 0;
  // The tiled computation's products (see the file comment): f32 additions
  // per product, the relative error of each product, and the sum of its
  // terms' magnitudes relative to |a b|. Plain f32 (and bf16 products, exact
  // in f32): 1, 0, 1.
  int64_t product_terms = 1;
  double product_error = 0;
  double term_magnitude = 1;
};

// `m` with its products taken as 3xTF32 (the file comment's derivation).
inline AttentionErrorModel WithThreeTf32Products(AttentionErrorModel m) {
  m.product_terms = 3;
  m.product_error = (3 + 0x1p-9) * 0x1p-22;
  m.term_magnitude = 1 + 0x1p-8;
  return m;
}

struct AttentionTolerances {
  std::vector<double> out;        // [B,T,C]: |a - b| allowed between two computations
  std::vector<double> dqkv;       // [B,T,3C]: likewise
  std::vector<double> lse;        // [B,NH,T]: |lse - lse_exact| allowed for one computation
  std::vector<double> lse_exact;  // [B,NH,T], in double
};

// qkv [B,T,3C], dout [B,T,C] as in layers.h's attention. T^2 HS work per head
// in double, a few times over.
AttentionTolerances CausalAttentionTolerances(const std::vector<float>& qkv,
                                              const std::vector<float>& dout, int64_t b, int64_t t,
                                              int64_t c, int64_t nh,
                                              const AttentionErrorModel& model);

// How many elements of `got` are farther than tolerance[i] from `want`;
// the worst (by excess over its tolerance) described in *worst.
int64_t CountOutside(const std::vector<float>& got, const std::vector<double>& want,
                     const std::vector<double>& tolerance, std::string* worst);
int64_t CountOutside(const std::vector<float>& got, const std::vector<float>& want,
                     const std::vector<double>& tolerance, std::string* worst);

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_FLASH_ATTENTION_ERROR_MODEL_H_
