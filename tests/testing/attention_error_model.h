// The CPU reference and error model for a fused causal attention in bf16
// (cuDNN's, tests/gpu/cuda_cudnn_attention_check; usable for any kernel with
// the same layout: qkv [B,T,3C], out [B,T,C], lse [B,NH,T], dqkv [B,T,3C]):
// heads of the device's results are compared, element by element, with the
// CPU attention (worker/model/layers.h) run on the same bf16 inputs, each
// element within a bound computed from the reference by the model below.
// Host code only: the device's results come in as host vectors.
//
// Error model (u = 2^-8, bf16's unit roundoff; e = 2^-24, f32's). Inputs are
// bf16 on both sides, so products of two inputs are exact in f32; what
// differs is what cuDNN rounds to bf16 on the way, and f32 sums in another
// order. For query row t, key s, column i, with the reference's weights
// p_ts, scores s_ts = scale q_t.k_s and sigma_t = HS e scale max_s
// sum_i |q_ti k_si| (the f32 error of a score, which moves p_ts by at most
// 2 sigma_t relative, numerator and denominator):
//  - out: cuDNN multiplies V by the weights rounded to bf16 and rounds the
//    result: |d out_ti| <= (u + 2 sigma_t + (T + HS + 8) e) M_ti + u |out_ti|,
//    M_ti = sum_s p_ts |v_si| (the "+8" covers exp2's approximation).
//  - lse (f32 throughout): |d lse_t| <= sigma_t + (T + 8) e (1 + |lse_t|).
//  - backward: cuDNN forms D_t = dout_t . out_t from its bf16 out, so
//    |d D_t| <= dD_t = sum_i |dout_ti| bound(out_ti); dS_ts = p_ts (dP_ts - D_t)
//    is rounded to bf16 before the dq / dk products, so its error is at most
//    E_ts = p_ts ((u + 2 sigma_t + (T + 8) e) |dP_ts - D_t| + dD_t + HS e
//    sum_i |dout_ti v_si|). Then
//      |d dq_ti| <= scale sum_s E_ts |k_si| + u |dq_ti| + T e scale sum_s |dS_ts k_si|
//      |d dk_si| <= scale sum_t E_ts |q_ti| + u |dk_si| + T e scale sum_t |dS_ts q_ti|
//      |d dv_si| <= sum_t p_ts (u + 2 sigma_t + (T + 8) e) |dout_ti| + u |dv_si|
// The CPU reference's own f32 error (~T e relative) is inside the e terms.
// Each bound is computed per element from the reference; a wrong mask,
// scale, stride or head offset errs by O(1) of the values and fails.
#ifndef ZEROSHARD_TESTS_TESTING_ATTENTION_ERROR_MODEL_H_
#define ZEROSHARD_TESTS_TESTING_ATTENTION_ERROR_MODEL_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard::testing {

struct AttentionShape {
  int64_t b, t, c, nh;
  int64_t hs() const { return c / nh; }
};

// Round to bf16 (nearest even) and back.
std::vector<uint16_t> ToBf16(const std::vector<float>& v);
std::vector<float> FromBf16(const std::vector<uint16_t>& v);

// A fused attention's forward and backward results, widened to f32.
struct AttentionResults {
  std::vector<float> out;   // [B,T,C]
  std::vector<float> lse;   // [B,NH,T]
  std::vector<float> dqkv;  // [B,T,3C]
};

// Heads `heads` ((b, h) pairs; every head when empty) of `got` against the
// CPU attention on `qkv` [B,T,3C] and `dout` [B,T,C] (bf16 values) under the
// model above. Prints each tensor's largest error / bound ratio (how close
// the model is to binding); the failure names the worst element.
::testing::AssertionResult AttentionWithinErrorModel(
    const AttentionShape& s, const std::vector<float>& qkv, const std::vector<float>& dout,
    const AttentionResults& got, std::vector<std::pair<int64_t, int64_t>> heads);

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_ATTENTION_ERROR_MODEL_H_
