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
};

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
