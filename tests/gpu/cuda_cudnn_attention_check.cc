// cuDNN's fused causal attention (worker/cuda/cudnn_attention.h) against the
// CPU attention (worker/model/layers.h AttentionForward / AttentionBackward)
// run on the same bf16-rounded inputs: out, lse and dqkv, at GPT-2 124M's
// shape (B 8, T 1024, NH 12, HS 64; a sample of heads is compared, every
// element is checked written) and at small odd shapes (every head). Also
// prints the forward and backward time at GPT-2's shape (not checked: speed
// lives in the benches). Run by tests/gpu/run.sh.
//
// Exit status: 0 all passed, 1 a check failed, 2 not run: no GPU, or cuDNN
// could not be loaded or used (the message says which and what to do).
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
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/cudnn_attention.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

using gpu_test::CudaOrDie;
using gpu_test::DeviceBuffer;
using gpu_test::RandomFloats;

constexpr double kU = 1.0 / 256;        // bf16 unit roundoff, 2^-8
constexpr double kE = 1.0 / (1 << 24);  // f32 unit roundoff, 2^-24
constexpr uint16_t kBf16NaN = 0x7FC0;   // prefilled outputs: unwritten stays NaN
constexpr float kF32NaN = std::numeric_limits<float>::quiet_NaN();

struct Shape {
  int64_t b, t, c, nh;
  int64_t hs() const { return c / nh; }
};

std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBF16(v[i]);
  return out;
}

std::vector<float> FromBf16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = BF16ToFloat(v[i]);
  return out;
}

// One head of the problem as its own B = 1, NH = 1 problem (qkv [T, 3HS],
// out / dout [T, HS]), and the bounds of the error model above.
struct Head {
  int64_t t, hs;
  std::vector<float> qkv, dout;       // inputs (bf16 values)
  std::vector<float> out, att, dqkv;  // CPU reference
  std::vector<double> lse;            // reference, in double
  std::vector<double> out_bound, lse_bound, dqkv_bound;

  float q(int64_t r, int64_t i) const { return qkv[r * 3 * hs + i]; }
  float k(int64_t r, int64_t i) const { return qkv[r * 3 * hs + hs + i]; }
  float v(int64_t r, int64_t i) const { return qkv[r * 3 * hs + 2 * hs + i]; }
  float p(int64_t r, int64_t s) const { return att[r * t + s]; }
};

Head ExtractHead(const Shape& s, const std::vector<float>& qkv, const std::vector<float>& dout,
                 int64_t bi, int64_t h) {
  Head head{s.t, s.hs()};
  const int64_t hs = s.hs();
  head.qkv.resize(s.t * 3 * hs);
  head.dout.resize(s.t * hs);
  for (int64_t r = 0; r < s.t; ++r) {
    const int64_t row = bi * s.t + r;
    for (int part = 0; part < 3; ++part) {
      for (int64_t i = 0; i < hs; ++i) {
        head.qkv[r * 3 * hs + part * hs + i] = qkv[row * 3 * s.c + part * s.c + h * hs + i];
      }
    }
    for (int64_t i = 0; i < hs; ++i) head.dout[r * hs + i] = dout[row * s.c + h * hs + i];
  }
  return head;
}

// The reference values and the forward bounds (out, lse); fills sigma.
void ForwardReference(Head& hd, std::vector<double>& sigma) {
  const int64_t t = hd.t, hs = hd.hs;
  hd.out.assign(t * hs, 0.0f);
  hd.att.assign(t * t, 0.0f);
  AttentionForward(hd.out.data(), hd.att.data(), hd.qkv.data(), 1, t, hs, 1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  hd.lse.assign(t, 0.0);
  hd.lse_bound.assign(t, 0.0);
  hd.out_bound.assign(t * hs, 0.0);
  sigma.assign(t, 0.0);
  for (int64_t r = 0; r < t; ++r) {
    std::vector<double> score(r + 1);
    double max_score = -1e300, max_abs = 0.0;
    for (int64_t s = 0; s <= r; ++s) {
      double dot = 0.0, abs_dot = 0.0;
      for (int64_t i = 0; i < hs; ++i) {
        dot += static_cast<double>(hd.q(r, i)) * hd.k(s, i);
        abs_dot += std::fabs(static_cast<double>(hd.q(r, i)) * hd.k(s, i));
      }
      score[s] = scale * dot;
      max_score = std::max(max_score, score[s]);
      max_abs = std::max(max_abs, abs_dot);
    }
    double sum = 0.0;
    for (int64_t s = 0; s <= r; ++s) sum += std::exp(score[s] - max_score);
    hd.lse[r] = max_score + std::log(sum);
    sigma[r] = hs * kE * scale * max_abs;
    hd.lse_bound[r] = sigma[r] + (t + 8) * kE * (1.0 + std::fabs(hd.lse[r]));
    const double rel = kU + 2 * sigma[r] + (t + hs + 8) * kE;
    for (int64_t i = 0; i < hs; ++i) {
      double m = 0.0;
      for (int64_t s = 0; s <= r; ++s) m += hd.p(r, s) * std::fabs(hd.v(s, i));
      hd.out_bound[r * hs + i] = rel * m + kU * std::fabs(hd.out[r * hs + i]);
    }
  }
}

// The reference gradients and their bounds (dqkv laid out like qkv).
void BackwardReference(Head& hd, const std::vector<double>& sigma) {
  const int64_t t = hd.t, hs = hd.hs;
  hd.dqkv.assign(t * 3 * hs, 0.0f);
  AttentionBackward(hd.dqkv.data(), hd.dout.data(), hd.qkv.data(), hd.att.data(), 1, t, hs, 1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  // E_ts (dS's error bound) and |dS_ts|, lower triangle, row-major [t, t].
  std::vector<double> err(t * t, 0.0), ds(t * t, 0.0);
  for (int64_t r = 0; r < t; ++r) {
    std::vector<double> dp(r + 1), dp_abs(r + 1);
    double d = 0.0, dd = 0.0;
    for (int64_t s = 0; s <= r; ++s) {
      for (int64_t i = 0; i < hs; ++i) {
        dp[s] += static_cast<double>(hd.dout[r * hs + i]) * hd.v(s, i);
        dp_abs[s] += std::fabs(static_cast<double>(hd.dout[r * hs + i]) * hd.v(s, i));
      }
      d += hd.p(r, s) * dp[s];
    }
    for (int64_t i = 0; i < hs; ++i)
      dd += std::fabs(hd.dout[r * hs + i]) * hd.out_bound[r * hs + i];
    const double rel = kU + 2 * sigma[r] + (t + 8) * kE;
    for (int64_t s = 0; s <= r; ++s) {
      const double g = std::fabs(dp[s] - d);
      err[r * t + s] = hd.p(r, s) * (rel * g + dd + hs * kE * dp_abs[s]);
      ds[r * t + s] = hd.p(r, s) * g;
    }
  }
  hd.dqkv_bound.assign(t * 3 * hs, 0.0);
  auto dq = [&](int64_t r, int64_t i) -> double& { return hd.dqkv_bound[r * 3 * hs + i]; };
  auto dk = [&](int64_t r, int64_t i) -> double& { return hd.dqkv_bound[r * 3 * hs + hs + i]; };
  auto dv = [&](int64_t r, int64_t i) -> double& { return hd.dqkv_bound[r * 3 * hs + 2 * hs + i]; };
  for (int64_t r = 0; r < t; ++r) {
    const double rel = kU + 2 * sigma[r] + (t + 8) * kE;
    for (int64_t s = 0; s <= r; ++s) {
      const double e = err[r * t + s], a = ds[r * t + s], p = hd.p(r, s);
      for (int64_t i = 0; i < hs; ++i) {
        dq(r, i) += scale * (e + t * kE * a) * std::fabs(hd.k(s, i));
        dk(s, i) += scale * (e + t * kE * a) * std::fabs(hd.q(r, i));
        dv(s, i) += p * rel * std::fabs(hd.dout[r * hs + i]);
      }
    }
  }
  for (int64_t j = 0; j < t * 3 * hs; ++j) hd.dqkv_bound[j] += kU * std::fabs(hd.dqkv[j]);
}

// got[j] within bound[j] of want[j] for every j; reports the worst and the
// largest error / bound ratio seen (how close the model is to binding).
::testing::AssertionResult WithinBounds(const std::vector<float>& got,
                                        const std::vector<double>& want,
                                        const std::vector<double>& bound, const std::string& what) {
  size_t bad = 0, worst = 0;
  double worst_ratio = 0.0;
  for (size_t j = 0; j < got.size(); ++j) {
    const double err = std::fabs(static_cast<double>(got[j]) - want[j]);
    const double ratio = std::isfinite(err) ? err / std::max(bound[j], 1e-30) : 1e300;
    if (!(err <= bound[j])) ++bad;
    if (ratio > worst_ratio || j == 0) worst_ratio = ratio, worst = j;
  }
  std::printf("  %-28s max |error| / bound = %.3f\n", what.c_str(), worst_ratio);
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << got.size() << " outside the error model; worst at ["
         << worst << "]: got " << got[worst] << ", want " << want[worst] << ", bound "
         << bound[worst];
}

template <typename T>
std::vector<double> ToDouble(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// The GPU's results for one head, cut out of the full tensors.
void CompareHead(const Shape& s, const Head& hd, int64_t bi, int64_t h,
                 const std::vector<float>& out, const std::vector<float>& lse,
                 const std::vector<float>& dqkv) {
  const int64_t hs = s.hs();
  std::vector<float> got_out(s.t * hs), got_lse(s.t), got_dqkv(s.t * 3 * hs);
  for (int64_t r = 0; r < s.t; ++r) {
    const int64_t row = bi * s.t + r;
    for (int64_t i = 0; i < hs; ++i) got_out[r * hs + i] = out[row * s.c + h * hs + i];
    got_lse[r] = lse[(bi * s.nh + h) * s.t + r];
    for (int part = 0; part < 3; ++part) {
      for (int64_t i = 0; i < hs; ++i) {
        got_dqkv[r * 3 * hs + part * hs + i] = dqkv[row * 3 * s.c + part * s.c + h * hs + i];
      }
    }
  }
  const std::string at = "b " + std::to_string(bi) + " h " + std::to_string(h) + " ";
  EXPECT_TRUE(WithinBounds(got_out, ToDouble(hd.out), hd.out_bound, at + "out"));
  EXPECT_TRUE(WithinBounds(got_lse, hd.lse, hd.lse_bound, at + "lse"));
  EXPECT_TRUE(WithinBounds(got_dqkv, ToDouble(hd.dqkv), hd.dqkv_bound, at + "dqkv"));
}

class CudnnAttentionCheck : public ::testing::Test {
 protected:
  void SetUp() override {
    CudaOrDie(cudaStreamCreate(&stream_), "cudaStreamCreate");
    auto attention = gpu::CudnnAttention::Create(stream_);
    ASSERT_TRUE(attention.ok()) << attention.status();
    attention_ = std::move(*attention);
  }
  void TearDown() override {
    attention_.reset();
    cudaStreamDestroy(stream_);
  }

  // Runs forward and backward on random inputs and compares the heads
  // `heads` ((b, h) pairs; every head when empty) with the CPU.
  void Check(const Shape& s, std::vector<std::pair<int64_t, int64_t>> heads);

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<gpu::CudnnAttention> attention_;
};

void CudnnAttentionCheck::Check(const Shape& s, std::vector<std::pair<int64_t, int64_t>> heads) {
  std::printf("B %ld T %ld C %ld NH %ld (HS %ld), cuDNN %s\n", static_cast<long>(s.b),
              static_cast<long>(s.t), static_cast<long>(s.c), static_cast<long>(s.nh),
              static_cast<long>(s.hs()), gpu::CudnnAttention::LoadedVersion().c_str());
  // Scores of a few units: peaked and flat rows both occur.
  const std::vector<uint16_t> qkv_bits = ToBf16(RandomFloats(s.b * s.t * 3 * s.c, 21, -3.0f, 3.0f));
  const std::vector<uint16_t> dout_bits = ToBf16(RandomFloats(s.b * s.t * s.c, 22));
  DeviceBuffer<uint16_t> qkv(qkv_bits), dout(dout_bits);
  DeviceBuffer<uint16_t> out(std::vector<uint16_t>(s.b * s.t * s.c, kBf16NaN));
  DeviceBuffer<uint16_t> dqkv(std::vector<uint16_t>(s.b * s.t * 3 * s.c, kBf16NaN));
  DeviceBuffer<float> lse(std::vector<float>(s.b * s.nh * s.t, kF32NaN));
  ASSERT_TRUE(attention_->Forward(out.get(), lse.get(), qkv.get(), s.b, s.t, s.c, s.nh).ok());
  ASSERT_TRUE(
      attention_
          ->Backward(dqkv.get(), dout.get(), qkv.get(), out.get(), lse.get(), s.b, s.t, s.c, s.nh)
          .ok());
  const std::vector<float> got_out = FromBf16(out.Download());
  const std::vector<float> got_lse = lse.Download();
  const std::vector<float> got_dqkv = FromBf16(dqkv.Download());
  // Every element written (the NaN prefill gone) and finite.
  for (const auto& [name, v] : {std::pair<const char*, const std::vector<float>*>{"out", &got_out},
                                {"lse", &got_lse},
                                {"dqkv", &got_dqkv}}) {
    const size_t bad =
        std::count_if(v->begin(), v->end(), [](float x) { return !std::isfinite(x); });
    EXPECT_EQ(bad, 0u) << name << ": elements not written or not finite";
  }
  if (heads.empty()) {
    for (int64_t bi = 0; bi < s.b; ++bi) {
      for (int64_t h = 0; h < s.nh; ++h) heads.emplace_back(bi, h);
    }
  }
  const std::vector<float> qkv_f = FromBf16(qkv_bits), dout_f = FromBf16(dout_bits);
  for (const auto& [bi, h] : heads) {
    Head hd = ExtractHead(s, qkv_f, dout_f, bi, h);
    std::vector<double> sigma;
    ForwardReference(hd, sigma);
    BackwardReference(hd, sigma);
    CompareHead(s, hd, bi, h, got_out, got_lse, got_dqkv);
  }
}

TEST_F(CudnnAttentionCheck, Gpt2ShapeOnASampleOfHeads) {
  Check({8, 1024, 768, 12}, {{0, 0}, {3, 5}, {5, 2}, {7, 11}});
}

TEST_F(CudnnAttentionCheck, OddShapesEveryHead) {
  Check({3, 37, 120, 3}, {});   // HS 40, T not a multiple of any tile
  Check({2, 130, 128, 2}, {});  // T one past two tiles of 64
  Check({1, 2, 16, 2}, {});     // the smallest: T 2, HS 8
}

TEST_F(CudnnAttentionCheck, BadArgumentsAreRefusedBeforeAnyLaunch) {
  DeviceBuffer<uint16_t> buf(4 * 64 * 3 * 64 + 8);
  DeviceBuffer<float> lse(4 * 64);
  const absl::Status hs12 = attention_->Forward(buf.get(), lse.get(), buf.get(), 1, 4, 24, 2);
  EXPECT_EQ(hs12.code(), absl::StatusCode::kInvalidArgument) << hs12;
  const absl::Status misaligned =
      attention_->Forward(buf.get(), lse.get(), buf.get() + 1, 1, 4, 64, 1);
  EXPECT_EQ(misaligned.code(), absl::StatusCode::kInvalidArgument) << misaligned;
  EXPECT_NE(misaligned.message().find("qkv"), std::string::npos) << misaligned;
}

// Forward is deterministic: the cached plan gives the same bits again, also
// after another shape was built in between.
TEST_F(CudnnAttentionCheck, CachedPlansGiveTheSameForward) {
  const Shape a{2, 96, 128, 2}, other{1, 40, 64, 1};
  DeviceBuffer<uint16_t> qkv(ToBf16(RandomFloats(a.b * a.t * 3 * a.c, 31, -3.0f, 3.0f)));
  DeviceBuffer<uint16_t> out(a.b * a.t * a.c);
  DeviceBuffer<float> lse(a.b * a.nh * a.t);
  ASSERT_TRUE(attention_->Forward(out.get(), lse.get(), qkv.get(), a.b, a.t, a.c, a.nh).ok());
  const std::vector<uint16_t> first = out.Download();
  ASSERT_TRUE(
      attention_->Forward(out.get(), lse.get(), qkv.get(), other.b, other.t, other.c, other.nh)
          .ok());
  ASSERT_TRUE(attention_->Forward(out.get(), lse.get(), qkv.get(), a.b, a.t, a.c, a.nh).ok());
  EXPECT_EQ(out.Download(), first);
}

// Time per call at GPT-2's shape, printed for the comparison with
// flash_attention.h (#46: keep the faster). Not a pass/fail criterion.
TEST_F(CudnnAttentionCheck, Gpt2ShapeTiming) {
  const Shape s{8, 1024, 768, 12};
  DeviceBuffer<uint16_t> qkv(ToBf16(RandomFloats(s.b * s.t * 3 * s.c, 41, -3.0f, 3.0f)));
  DeviceBuffer<uint16_t> dout(ToBf16(RandomFloats(s.b * s.t * s.c, 42)));
  DeviceBuffer<uint16_t> out(s.b * s.t * s.c), dqkv(s.b * s.t * 3 * s.c);
  DeviceBuffer<float> lse(s.b * s.nh * s.t);
  auto forward = [&] {
    return attention_->Forward(out.get(), lse.get(), qkv.get(), s.b, s.t, s.c, s.nh);
  };
  auto backward = [&] {
    return attention_->Backward(dqkv.get(), dout.get(), qkv.get(), out.get(), lse.get(), s.b, s.t,
                                s.c, s.nh);
  };
  cudaEvent_t start, stop;
  CudaOrDie(cudaEventCreate(&start), "cudaEventCreate");
  CudaOrDie(cudaEventCreate(&stop), "cudaEventCreate");
  // Causal: half of the 4 B NH T^2 HS flops of full attention; backward 2.5x.
  const double forward_flops = 2.0 * s.b * s.nh * s.t * s.t * s.hs();
  constexpr int kWarmup = 3, kRuns = 20;
  for (const auto& [name, fn, flops] :
       {std::make_tuple("forward", std::function<absl::Status()>(forward), forward_flops),
        std::make_tuple("backward", std::function<absl::Status()>(backward),
                        2.5 * forward_flops)}) {
    for (int i = 0; i < kWarmup; ++i) ASSERT_TRUE(fn().ok());
    CudaOrDie(cudaEventRecord(start, stream_), "cudaEventRecord");
    for (int i = 0; i < kRuns; ++i) ASSERT_TRUE(fn().ok());
    CudaOrDie(cudaEventRecord(stop, stream_), "cudaEventRecord");
    CudaOrDie(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    CudaOrDie(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    const double per_call = ms / kRuns;
    std::printf("cuDNN attention %s, GPT-2 shape: %.3f ms/call, %.1f TFLOP/s\n", name, per_call,
                flops / (per_call * 1e-3) / 1e12);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace
}  // namespace zeroshard

// Exit 2 (not run) without a GPU or a usable cuDNN, saying which.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const absl::Status device = zeroshard::CheckCudaDevice(0);
  if (!device.ok()) {
    std::fprintf(stderr, "%s: not run: %s\n", argv[0], std::string(device.message()).c_str());
    return 2;
  }
  auto attention = zeroshard::gpu::CudnnAttention::Create(nullptr);
  if (!attention.ok()) {
    std::fprintf(stderr, "%s: not run: %s\n", argv[0], attention.status().ToString().c_str());
    return 2;
  }
  attention->reset();
  return RUN_ALL_TESTS();
}
