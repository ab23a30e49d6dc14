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
// Tolerances: the per-element error model of
// tests/testing/attention_error_model.h.
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
#include "tests/testing/attention_error_model.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/cudnn_attention.h"

namespace zeroshard {
namespace {

using gpu_test::CudaOrDie;
using gpu_test::DeviceBuffer;
using gpu_test::RandomFloats;

constexpr uint16_t kBf16NaN = 0x7FC0;  // prefilled outputs: unwritten stays NaN
constexpr float kF32NaN = std::numeric_limits<float>::quiet_NaN();

using Shape = testing::AttentionShape;
using testing::FromBf16;
using testing::ToBf16;

// A status as a gtest result that prints the status when it is not OK
// (cuDNN's reason is the point of a failure here).
::testing::AssertionResult Ok(const absl::Status& s) {
  if (s.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << s;
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
  ASSERT_TRUE(Ok(attention_->Forward(out.get(), lse.get(), qkv.get(), s.b, s.t, s.c, s.nh)));
  ASSERT_TRUE(Ok(attention_->Backward(dqkv.get(), dout.get(), qkv.get(), out.get(), lse.get(), s.b,
                                      s.t, s.c, s.nh)));
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
  EXPECT_TRUE(testing::AttentionWithinErrorModel(s, FromBf16(qkv_bits), FromBf16(dout_bits),
                                                 {got_out, got_lse, got_dqkv}, std::move(heads)));
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
  ASSERT_TRUE(Ok(attention_->Forward(out.get(), lse.get(), qkv.get(), a.b, a.t, a.c, a.nh)));
  const std::vector<uint16_t> first = out.Download();
  ASSERT_TRUE(Ok(
      attention_->Forward(out.get(), lse.get(), qkv.get(), other.b, other.t, other.c, other.nh)));
  ASSERT_TRUE(Ok(attention_->Forward(out.get(), lse.get(), qkv.get(), a.b, a.t, a.c, a.nh)));
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
    for (int i = 0; i < kWarmup; ++i) ASSERT_TRUE(Ok(fn()));
    CudaOrDie(cudaEventRecord(start, stream_), "cudaEventRecord");
    for (int i = 0; i < kRuns; ++i) ASSERT_TRUE(Ok(fn()));
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
  // Not run where cuDNN is missing (UNAVAILABLE) or the device too old
  // (FAILED_PRECONDITION); a cuDNN that loads but cannot start is a failure.
  auto attention = zeroshard::gpu::CudnnAttention::Create(nullptr);
  if (!attention.ok()) {
    const bool absent =
        absl::IsUnavailable(attention.status()) || absl::IsFailedPrecondition(attention.status());
    std::fprintf(stderr, "%s: %s: %s\n", argv[0], absent ? "not run" : "FAILED",
                 attention.status().ToString().c_str());
    return absent ? 2 : 1;
  }
  attention->reset();
  return RUN_ALL_TESTS();
}
