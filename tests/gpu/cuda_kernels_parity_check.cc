// GPU-versus-CPU parity: every kernel of //worker/cuda:cuda_kernels against
// its CPU twin (worker/model/layers.h, the Adam of worker/zero/optimizer.h,
// common/dtype.h's casts) on the same random inputs. Needs a GPU; without
// one it exits 1 with the no-device message. Run by tests/gpu/run.sh.
//
// Tolerances: elementwise kernels and reductions differ from the CPU only
// by float rounding (device erff/expf/tanhf are within 2 ulp, sums run in
// another order, nvcc fuses multiply-adds), so they are checked to ~1e-5
// relative; the Adam update and the casts must match bit for bit.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/testing/flash_attention_error_model.h"
#include "worker/cuda/flash_attention.h"
#include "worker/cuda/flash_attention_variants.h"
#include "worker/cuda/kernels.h"
#include "worker/model/layers.h"
#include "worker/zero/optimizer.h"

namespace zeroshard {
namespace {

using gpu_test::AllNear;
using gpu_test::DeviceBuffer;
using gpu_test::RandomFloats;
using gpu_test::RandomInts;

constexpr float kTight = 1e-5f;

double DownloadScalar(const DeviceBuffer<double>& d) { return d.Download()[0]; }

// ----------------------------------------------------------------------------
// Activations and MSE

TEST(ParityTest, Activations) {
  const size_t n = 10007;
  const std::vector<float> x = RandomFloats(n, 1, -5.0f, 5.0f);
  const std::vector<float> dy = RandomFloats(n, 2);
  DeviceBuffer<float> d_x(x), d_dy(dy), d_out(n);
  std::vector<float> want(n);

  struct Unary {
    const char* name;
    void (*cpu)(float*, const float*, int64_t);
    absl::Status (*gpu)(float*, const float*, int64_t, void*);
  };
  for (const Unary& f :
       {Unary{"relu", ReluForward, gpu::ReluForward}, Unary{"gelu", GeluForward, gpu::GeluForward},
        Unary{"gelu_tanh", GeluTanhForward, gpu::GeluTanhForward}}) {
    f.cpu(want.data(), x.data(), n);
    ASSERT_TRUE(f.gpu(d_out.get(), d_x.get(), n, nullptr).ok()) << f.name;
    EXPECT_TRUE(AllNear(d_out.Download(), want, kTight, kTight)) << f.name << " forward";
  }
  struct Binary {
    const char* name;
    void (*cpu)(float*, const float*, const float*, int64_t);
    absl::Status (*gpu)(float*, const float*, const float*, int64_t, void*);
  };
  for (const Binary& f : {Binary{"relu", ReluBackward, gpu::ReluBackward},
                          Binary{"gelu", GeluBackward, gpu::GeluBackward},
                          Binary{"gelu_tanh", GeluTanhBackward, gpu::GeluTanhBackward}}) {
    f.cpu(want.data(), dy.data(), x.data(), n);
    ASSERT_TRUE(f.gpu(d_out.get(), d_dy.get(), d_x.get(), n, nullptr).ok()) << f.name;
    EXPECT_TRUE(AllNear(d_out.Download(), want, kTight, kTight)) << f.name << " backward";
  }
}

TEST(ParityTest, Mse) {
  const size_t n = 4099;
  const std::vector<float> pred = RandomFloats(n, 3), target = RandomFloats(n, 4);
  DeviceBuffer<float> d_pred(pred), d_target(target), d_grad(n);
  DeviceBuffer<double> d_loss(1);
  ASSERT_TRUE(gpu::MseForward(d_loss.get(), d_pred.get(), d_target.get(), n, nullptr).ok());
  const double want = MseForward(pred.data(), target.data(), n);
  EXPECT_NEAR(DownloadScalar(d_loss), want, 1e-10 * std::fabs(want));
  std::vector<float> want_grad(n);
  MseBackward(want_grad.data(), pred.data(), target.data(), n);
  ASSERT_TRUE(gpu::MseBackward(d_grad.get(), d_pred.get(), d_target.get(), n, nullptr).ok());
  EXPECT_TRUE(AllNear(d_grad.Download(), want_grad, kTight, kTight));
}

// ----------------------------------------------------------------------------
// LayerNorm

TEST(ParityTest, LayerNorm) {
  const int64_t n = 37, c = 769;  // c not a multiple of any block size
  // A large mean: the variance must not be lost to cancellation.
  const std::vector<float> x = RandomFloats(n * c, 5, 2.0f, 4.0f);
  const std::vector<float> w = RandomFloats(c, 6), b = RandomFloats(c, 7);
  const std::vector<float> dout = RandomFloats(n * c, 8);
  const std::vector<float> dw0 = RandomFloats(c, 9), db0 = RandomFloats(c, 10);

  std::vector<float> out(n * c), mean(n), rstd(n), dx(n * c), dw = dw0, db = db0;
  LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c);
  LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                    rstd.data(), n, c);

  DeviceBuffer<float> d_x(x), d_w(w), d_b(b), d_dout(dout), d_out(n * c), d_mean(n), d_rstd(n),
      d_dx(n * c), d_dw(dw0), d_db(db0);
  ASSERT_TRUE(gpu::LayerNormForward(d_out.get(), d_mean.get(), d_rstd.get(), d_x.get(), d_w.get(),
                                    d_b.get(), n, c, nullptr)
                  .ok());
  EXPECT_TRUE(AllNear(d_out.Download(), out, kTight, kTight));
  EXPECT_TRUE(AllNear(d_mean.Download(), mean, 1e-7f, 2e-7f));
  EXPECT_TRUE(AllNear(d_rstd.Download(), rstd, 0.0f, 1e-6f));
  ASSERT_TRUE(gpu::LayerNormBackward(d_dx.get(), d_dw.get(), d_db.get(), d_dout.get(), d_x.get(),
                                     d_w.get(), d_mean.get(), d_rstd.get(), n, c, nullptr)
                  .ok());
  EXPECT_TRUE(AllNear(d_dx.Download(), dx, 1e-5f, 1e-4f));
  EXPECT_TRUE(AllNear(d_dw.Download(), dw, 1e-5f, 1e-4f));
  EXPECT_TRUE(AllNear(d_db.Download(), db, 1e-5f, 1e-4f));

  // dx == nullptr: only the parameter gradients (accumulated again).
  LayerNormBackward(nullptr, dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                    rstd.data(), n, c);
  ASSERT_TRUE(gpu::LayerNormBackward(nullptr, d_dw.get(), d_db.get(), d_dout.get(), d_x.get(),
                                     d_w.get(), d_mean.get(), d_rstd.get(), n, c, nullptr)
                  .ok());
  EXPECT_TRUE(AllNear(d_dw.Download(), dw, 1e-5f, 1e-4f));
  EXPECT_TRUE(AllNear(d_db.Download(), db, 1e-5f, 1e-4f));
}

// The device GPT's forms: bf16 output (rounded once from the f32 result: half
// a bf16 ulp, <= 2^-8 of the value, plus one ulp, <= 2^-7, where float
// reordering moved the f32 result across a rounding boundary), the skip
// path's gradient added in the same pass (dx = LN's dx + plus), and rows
// spanning several of the parameter-gradient chunks (256 rows each; 600 is
// not a multiple).
TEST(ParityTest, LayerNormBf16OutputAndSkipPath) {
  const int64_t n = 600, c = 96;
  const std::vector<float> x = RandomFloats(n * c, 15, 2.0f, 4.0f);
  const std::vector<float> w = RandomFloats(c, 16), b = RandomFloats(c, 17);
  const std::vector<float> dout = RandomFloats(n * c, 18), plus = RandomFloats(n * c, 19);
  std::vector<float> out(n * c), mean(n), rstd(n), dx(n * c), dw(c, 0.0f), db(c, 0.0f);
  LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c);
  LayerNormBackward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                    rstd.data(), n, c);
  for (int64_t i = 0; i < n * c; ++i) dx[i] += plus[i];

  DeviceBuffer<float> d_x(x), d_w(w), d_b(b), d_dout(dout), d_plus(plus), d_mean(n), d_rstd(n),
      d_dx(n * c), d_dw(std::vector<float>(c, 0.0f)), d_db(std::vector<float>(c, 0.0f));
  DeviceBuffer<uint16_t> d_out16(n * c);
  ASSERT_TRUE(gpu::LayerNormForwardTo(d_out16.get(), DType::kBF16, d_mean.get(), d_rstd.get(),
                                      d_x.get(), d_w.get(), d_b.get(), n, c, nullptr)
                  .ok());
  const std::vector<uint16_t> got16 = d_out16.Download();
  std::vector<float> got(n * c);
  for (int64_t i = 0; i < n * c; ++i) got[i] = BF16ToFloat(got16[i]);
  EXPECT_TRUE(AllNear(got, out, 1e-6f, 1.0f / 256 + 1.0f / 128));
  ASSERT_TRUE(gpu::LayerNormBackward(d_dx.get(), d_dw.get(), d_db.get(), d_dout.get(), d_x.get(),
                                     d_w.get(), d_mean.get(), d_rstd.get(), n, c, nullptr,
                                     d_plus.get())
                  .ok());
  EXPECT_TRUE(AllNear(d_dx.Download(), dx, 1e-5f, 1e-4f));
  EXPECT_TRUE(AllNear(d_dw.Download(), dw, 1e-5f, 1e-4f));
  EXPECT_TRUE(AllNear(d_db.Download(), db, 1e-5f, 1e-4f));
}

// ----------------------------------------------------------------------------
// Attention

TEST(ParityTest, CausalAttention) {
  for (const auto& [b, t, c, nh] :
       std::vector<std::array<int64_t, 4>>{{2, 37, 48, 4}, {1, 1, 8, 1}, {3, 130, 64, 2}}) {
    SCOPED_TRACE(::testing::Message() << "b " << b << " t " << t << " c " << c << " nh " << nh);
    const std::vector<float> qkv = RandomFloats(b * t * 3 * c, 11, -2.0f, 2.0f);
    const std::vector<float> dout = RandomFloats(b * t * c, 12);
    std::vector<float> out(b * t * c), att(b * nh * t * t), dqkv(b * t * 3 * c);
    AttentionForward(out.data(), att.data(), qkv.data(), b, t, c, nh);
    AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), b, t, c, nh);

    DeviceBuffer<float> d_qkv(qkv), d_dout(dout), d_out(out.size()), d_att(att.size()),
        d_dqkv(dqkv.size());
    ASSERT_TRUE(
        gpu::AttentionForward(d_out.get(), d_att.get(), d_qkv.get(), b, t, c, nh, nullptr).ok());
    EXPECT_TRUE(AllNear(d_att.Download(), att, 1e-6f, 1e-5f));
    EXPECT_TRUE(AllNear(d_out.Download(), out, 1e-5f, 1e-5f));
    ASSERT_TRUE(gpu::AttentionBackward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_att.get(), b, t,
                                       c, nh, nullptr)
                    .ok());
    EXPECT_TRUE(AllNear(d_dqkv.Download(), dqkv, 1e-5f, 1e-4f));
  }
}

// ----------------------------------------------------------------------------
// Embedding

TEST(ParityTest, Embedding) {
  const int64_t b = 3, t = 17, c = 33, v = 50;
  const std::vector<int32_t> tokens = RandomInts(b * t, 13, 0, 9);  // many repeats
  const std::vector<float> wte = RandomFloats(v * c, 14), wpe = RandomFloats(t * c, 15);
  const std::vector<float> dout = RandomFloats(b * t * c, 16);
  const std::vector<float> dwte0 = RandomFloats(v * c, 17), dwpe0 = RandomFloats(t * c, 18);
  std::vector<float> out(b * t * c), dwte = dwte0, dwpe = dwpe0;
  EmbeddingForward(out.data(), tokens.data(), wte.data(), wpe.data(), b, t, c);
  EmbeddingBackward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), b, t, c);

  DeviceBuffer<int32_t> d_tokens(tokens);
  DeviceBuffer<float> d_wte(wte), d_wpe(wpe), d_dout(dout), d_out(out.size()), d_dwte(dwte0),
      d_dwpe(dwpe0);
  ASSERT_TRUE(gpu::EmbeddingForward(d_out.get(), d_tokens.get(), d_wte.get(), d_wpe.get(), b, t, c,
                                    v, nullptr)
                  .ok());
  EXPECT_TRUE(AllNear(d_out.Download(), out, 0.0f, 0.0f));
  ASSERT_TRUE(gpu::EmbeddingBackward(d_dwte.get(), d_dwpe.get(), d_dout.get(), d_tokens.get(), b, t,
                                     c, v, nullptr)
                  .ok());
  EXPECT_TRUE(AllNear(d_dwte.Download(), dwte, 1e-6f, 1e-5f));
  EXPECT_TRUE(AllNear(d_dwpe.Download(), dwpe, 1e-6f, 1e-5f));

  // An out-of-range token: NaN row forward, skipped backward.
  std::vector<int32_t> bad = tokens;
  bad[4] = static_cast<int32_t>(v);
  d_tokens.Upload(bad);
  ASSERT_TRUE(gpu::EmbeddingForward(d_out.get(), d_tokens.get(), d_wte.get(), d_wpe.get(), b, t, c,
                                    v, nullptr)
                  .ok());
  const std::vector<float> got = d_out.Download();
  EXPECT_TRUE(std::isnan(got[4 * c]));
  EXPECT_FALSE(std::isnan(got[3 * c]));
}

// ----------------------------------------------------------------------------
// Bias, f32 and bf16

std::vector<uint16_t> ToBF16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBF16(v[i]);
  return out;
}

std::vector<float> FromBF16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = BF16ToFloat(v[i]);
  return out;
}

TEST(ParityTest, BiasAddAndGrad) {
  const int64_t n = 513, out = 77;
  const std::vector<float> y = RandomFloats(n * out, 21), b = RandomFloats(out, 22);
  const std::vector<float> db0 = RandomFloats(out, 23);
  std::vector<float> want_y = y, want_db = db0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < out; ++j) {
      want_y[i * out + j] += b[j];
      want_db[j] += y[i * out + j];
    }
  }
  {
    DeviceBuffer<float> d_y(y), d_b(b), d_db(db0);
    ASSERT_TRUE(gpu::BiasAdd(d_y.get(), d_b.get(), n, out, DType::kF32, nullptr).ok());
    EXPECT_TRUE(AllNear(d_y.Download(), want_y, 0.0f, 0.0f));
    d_y.Upload(y);
    ASSERT_TRUE(gpu::BiasGrad(d_db.get(), d_y.get(), n, out, DType::kF32, nullptr).ok());
    EXPECT_TRUE(AllNear(d_db.Download(), want_db, 1e-5f, 1e-5f));
  }
  {
    // bf16 storage: inputs rounded first; results within one bf16 rounding.
    const std::vector<uint16_t> y16 = ToBF16(y), b16 = ToBF16(b), db16 = ToBF16(db0);
    std::vector<float> want_y16(n * out), want_db16(out);
    const std::vector<float> yr = FromBF16(y16), br = FromBF16(b16), dbr = FromBF16(db16);
    for (int64_t j = 0; j < out; ++j) {
      float sum = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        want_y16[i * out + j] = BF16ToFloat(FloatToBF16(yr[i * out + j] + br[j]));
        sum += yr[i * out + j];
      }
      want_db16[j] = dbr[j] + sum;
    }
    DeviceBuffer<uint16_t> d_y(y16), d_b(b16), d_db(db16);
    ASSERT_TRUE(gpu::BiasAdd(d_y.get(), d_b.get(), n, out, DType::kBF16, nullptr).ok());
    EXPECT_TRUE(AllNear(FromBF16(d_y.Download()), want_y16, 0.0f, 0.0f));
    d_y.Upload(y16);
    ASSERT_TRUE(gpu::BiasGrad(d_db.get(), d_y.get(), n, out, DType::kBF16, nullptr).ok());
    EXPECT_TRUE(AllNear(FromBF16(d_db.Download()), want_db16, 1e-3f, 1.0f / 128));
  }
}

// ----------------------------------------------------------------------------
// Adam / AdamW: bit for bit

void ExpectBitwiseEqual(const std::vector<float>& got, const float* want, const char* what) {
  ASSERT_EQ(std::memcmp(got.data(), want, got.size() * sizeof(float)), 0)
      << what << " differs from the CPU optimizer";
}

TEST(ParityTest, AdamMatchesTheCpuOptimizerBitwise) {
  const int64_t n = 100003;
  for (const char* name : {"adam", "adamw"}) {
    for (double weight_decay : {0.0, 0.01}) {
      SCOPED_TRACE(::testing::Message() << name << " weight_decay " << weight_decay);
      OptimizerOptions options;
      options.weight_decay = weight_decay;
      auto cpu = MakeOptimizer(name, n, options);
      ASSERT_TRUE(cpu.ok()) << cpu.status();
      std::vector<float> params = RandomFloats(n, 24);
      DeviceBuffer<float> d_params(params), d_grads(n), d_m(std::vector<float>(n, 0.0f)),
          d_v(std::vector<float>(n, 0.0f));
      for (int step = 0; step < 3; ++step) {
        const std::vector<float> grads = RandomFloats(n, 100 + step, -0.1f, 0.1f);
        d_grads.Upload(grads);
        gpu::AdamStepParams p;
        p.lr = 1e-3 * (step + 1);
        p.step = (*cpu)->step() + 1;
        p.weight_decay = weight_decay;
        p.decoupled = std::string(name) == "adamw";
        ASSERT_TRUE((*cpu)->Step(params.data(), grads.data(), n, p.lr).ok());
        ASSERT_TRUE(
            gpu::AdamStep(d_params.get(), d_grads.get(), d_m.get(), d_v.get(), n, p, nullptr).ok());
      }
      ExpectBitwiseEqual(d_params.Download(), params.data(), "params");
      ExpectBitwiseEqual(d_m.Download(), (*cpu)->exp_avg(), "exp_avg");
      ExpectBitwiseEqual(d_v.Download(), (*cpu)->exp_avg_sq(), "exp_avg_sq");
    }
  }
}

// ----------------------------------------------------------------------------
// Casts: bit for bit, including ties, NaN, infinities and subnormals

TEST(ParityTest, CastsMatchCommonDtypeBitwise) {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               1.0f + 1.0f / 256,          // tie, rounds to even (down)
                               1.0f + 3.0f / 256,          // tie, rounds to even (up)
                               1.0f + 1.0f / 256 + 1e-7f,  // just above a tie
                               std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min(),
                               std::numeric_limits<float>::min()};
  uint32_t nan_bits = 0x7fa00001u;  // signalling NaN with a payload
  float nan;
  std::memcpy(&nan, &nan_bits, sizeof(nan));
  values.push_back(nan);
  std::mt19937 rng(25);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    values.push_back(f);
  }
  DeviceBuffer<float> d_in(values);
  DeviceBuffer<uint16_t> d_out(values.size());
  ASSERT_TRUE(gpu::CastF32ToBF16(d_out.get(), d_in.get(), values.size(), nullptr).ok());
  const std::vector<uint16_t> got = d_out.Download();
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(got[i], FloatToBF16(values[i])) << "value index " << i;
  }

  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  DeviceBuffer<uint16_t> d_bf16(all);
  DeviceBuffer<float> d_f32(all.size());
  ASSERT_TRUE(gpu::CastBF16ToF32(d_f32.get(), d_bf16.get(), all.size(), nullptr).ok());
  const std::vector<float> back = d_f32.Download();
  for (size_t i = 0; i < all.size(); ++i) {
    const float want = BF16ToFloat(all[i]);
    ASSERT_EQ(std::memcmp(&back[i], &want, sizeof(float)), 0) << "bf16 bits " << i;
  }
}

// ----------------------------------------------------------------------------
// Linear, Conv1D and the tied LM head through cuBLAS

struct LinearCase {
  gpu::CublasLinear::Layout layout;
  bool bias;
  const char* name;
};

TEST(ParityTest, CublasLinearF32) {
  const int64_t n = 33, in = 65, out = 47;
  auto linear = gpu::CublasLinear::Create(nullptr);
  ASSERT_TRUE(linear.ok()) << linear.status();
  for (const LinearCase& c : {LinearCase{gpu::CublasLinear::Layout::kOutIn, true, "linear"},
                              LinearCase{gpu::CublasLinear::Layout::kInOut, true, "conv1d"},
                              LinearCase{gpu::CublasLinear::Layout::kOutIn, false, "lm_head"}}) {
    SCOPED_TRACE(c.name);
    const std::vector<float> x = RandomFloats(n * in, 26), w = RandomFloats(in * out, 27);
    const std::vector<float> b = RandomFloats(out, 28), dy = RandomFloats(n * out, 29);
    const std::vector<float> dw0 = RandomFloats(in * out, 30), db0 = RandomFloats(out, 31);
    std::vector<float> y(n * out), dx(n * in), dw = dw0, db = db0;
    const float* bias = c.bias ? b.data() : nullptr;
    float* dbias = c.bias ? db.data() : nullptr;
    if (c.layout == gpu::CublasLinear::Layout::kOutIn) {
      LinearForward(y.data(), x.data(), w.data(), bias, n, in, out);
      LinearBackward(dx.data(), dw.data(), dbias, dy.data(), x.data(), w.data(), n, in, out);
    } else {
      Conv1dForward(y.data(), x.data(), w.data(), bias, n, in, out);
      Conv1dBackward(dx.data(), dw.data(), dbias, dy.data(), x.data(), w.data(), n, in, out);
    }
    DeviceBuffer<float> d_x(x), d_w(w), d_b(b), d_dy(dy), d_y(n * out), d_dx(n * in), d_dw(dw0),
        d_db(db0);
    ASSERT_TRUE((*linear)
                    ->Forward(d_y.get(), d_x.get(), d_w.get(), c.bias ? d_b.get() : nullptr, n, in,
                              out, DType::kF32, c.layout)
                    .ok());
    EXPECT_TRUE(AllNear(d_y.Download(), y, 1e-5f, 1e-4f));
    ASSERT_TRUE((*linear)
                    ->Backward(d_dx.get(), d_dw.get(), c.bias ? d_db.get() : nullptr, d_dy.get(),
                               d_x.get(), d_w.get(), n, in, out, DType::kF32, c.layout)
                    .ok());
    EXPECT_TRUE(AllNear(d_dx.Download(), dx, 1e-5f, 1e-4f));
    EXPECT_TRUE(AllNear(d_dw.Download(), dw, 1e-5f, 1e-4f));
    if (c.bias) {
      EXPECT_TRUE(AllNear(d_db.Download(), db, 1e-5f, 1e-4f));
    }
  }
}

TEST(ParityTest, CublasLinearBF16WithinBF16Rounding) {
  const int64_t n = 64, in = 128, out = 96;
  auto linear = gpu::CublasLinear::Create(nullptr);
  ASSERT_TRUE(linear.ok()) << linear.status();
  // The CPU reference runs in f32 on the bf16-rounded inputs; the GPU
  // accumulates in f32 and rounds each output once (relative error 2^-8).
  const std::vector<uint16_t> x16 = ToBF16(RandomFloats(n * in, 32));
  const std::vector<uint16_t> w16 = ToBF16(RandomFloats(in * out, 33));
  const std::vector<uint16_t> b16 = ToBF16(RandomFloats(out, 34));
  const std::vector<uint16_t> dy16 = ToBF16(RandomFloats(n * out, 35));
  const std::vector<float> x = FromBF16(x16), w = FromBF16(w16), b = FromBF16(b16),
                           dy = FromBF16(dy16);
  std::vector<float> y(n * out), dx(n * in), dw(in * out, 0.0f), db(out, 0.0f);
  LinearForward(y.data(), x.data(), w.data(), b.data(), n, in, out);
  LinearBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), n, in, out);

  DeviceBuffer<uint16_t> d_x(x16), d_w(w16), d_b(b16), d_dy(dy16), d_y(n * out), d_dx(n * in),
      d_dw(std::vector<uint16_t>(in * out, 0)), d_db(std::vector<uint16_t>(out, 0));
  const auto layout = gpu::CublasLinear::Layout::kOutIn;
  ASSERT_TRUE(
      (*linear)
          ->Forward(d_y.get(), d_x.get(), d_w.get(), d_b.get(), n, in, out, DType::kBF16, layout)
          .ok());
  // Forward rounds twice (GEMM output, then the bias add).
  EXPECT_TRUE(AllNear(FromBF16(d_y.Download()), y, 2e-2f, 1.0f / 64));
  ASSERT_TRUE((*linear)
                  ->Backward(d_dx.get(), d_dw.get(), d_db.get(), d_dy.get(), d_x.get(), d_w.get(),
                             n, in, out, DType::kBF16, layout)
                  .ok());
  EXPECT_TRUE(AllNear(FromBF16(d_dx.Download()), dx, 2e-2f, 1.0f / 128));
  EXPECT_TRUE(AllNear(FromBF16(d_dw.Download()), dw, 2e-2f, 1.0f / 128));
  EXPECT_TRUE(AllNear(FromBF16(d_db.Download()), db, 2e-2f, 1.0f / 128));
}

// ----------------------------------------------------------------------------
// Flash attention (worker/cuda/flash_attention_variants.h: the CUDA-core
// kernels in f32 and bf16, the tensor-core ones in bf16) against layers.h's
// naive attention. Tolerances element by element from
// tests/testing/flash_attention_error_model.h: the GPU's expf within 2 ulp, the
// kernels' key tiles (64) and softmax steps (16 keys on CUDA cores, 64 on
// tensor cores); in bf16 the CPU runs in f32 on the bf16-rounded inputs and
// the model adds the GPU's roundings of out (also read back for D) and of
// dqkv, 2^-8 each, and on tensor cores the rounding of the weights and score
// gradients to bf16 where they enter the products, 2^-8 each.

using gpu::FlashKernels;

// The inputs and results in the storage type S (float or bf16 bits).
template <typename S>
std::vector<S> ToStorage(const std::vector<float>& v) {
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else {
    return ToBF16(v);
  }
}
template <typename S>
std::vector<float> FromStorage(const std::vector<S>& v) {
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else {
    return FromBF16(v);
  }
}

struct FlashRun {
  std::vector<float> out, lse, dqkv;
};

template <typename S>
FlashRun RunFlash(FlashKernels kernels, const std::vector<float>& qkv,
                  const std::vector<float>& dout, int64_t b, int64_t t, int64_t c, int64_t nh) {
  const DType dtype = std::is_same_v<S, float> ? DType::kF32 : DType::kBF16;
  DeviceBuffer<S> d_qkv(ToStorage<S>(qkv)), d_dout(ToStorage<S>(dout)), d_out(b * t * c),
      d_dqkv(qkv.size());
  DeviceBuffer<float> d_lse(b * nh * t);
  FlashRun run;
  absl::Status s = gpu::FlashAttentionForwardWith(kernels, d_out.get(), d_lse.get(), d_qkv.get(), b,
                                                  t, c, nh, dtype, nullptr);
  EXPECT_TRUE(s.ok()) << s;
  if (!s.ok()) return run;
  s = gpu::FlashAttentionBackwardWith(kernels, d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(),
                                      d_lse.get(), b, t, c, nh, dtype, nullptr);
  EXPECT_TRUE(s.ok()) << s;
  run.out = FromStorage<S>(d_out.Download());
  run.lse = d_lse.Download();
  run.dqkv = FromStorage<S>(d_dqkv.Download());
  return run;
}

template <typename S>
void ExpectFlashMatchesNaive(FlashKernels kernels, int64_t b, int64_t t, int64_t c, int64_t nh,
                             uint32_t seed) {
  const bool bf16 = !std::is_same_v<S, float>;
  const bool tensor_cores = kernels == FlashKernels::kTensorCores;
  SCOPED_TRACE(::testing::Message()
               << (bf16 ? "BF16" : "F32") << (tensor_cores ? " tensor cores" : " CUDA cores")
               << " b " << b << " t " << t << " c " << c << " nh " << nh << " (hs " << c / nh
               << ")");
  // In the storage's values: what the GPU reads is what the CPU computes on.
  const std::vector<float> qkv =
      FromStorage<S>(ToStorage<S>(RandomFloats(b * t * 3 * c, seed, -2.0f, 2.0f)));
  const std::vector<float> dout = FromStorage<S>(ToStorage<S>(RandomFloats(b * t * c, seed + 1)));
  std::vector<float> out(b * t * c), att(b * nh * t * t), dqkv(qkv.size());
  AttentionForward(out.data(), att.data(), qkv.data(), b, t, c, nh);
  AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), b, t, c, nh);

  const FlashRun run = RunFlash<S>(kernels, qkv, dout, b, t, c, nh);
  ASSERT_FALSE(run.out.empty());
  testing::AttentionErrorModel model;  // 64-key tiles, expf within 2 ulp
  model.softmax_step = tensor_cores ? 64 : 16;
  model.storage_unit = bf16 ? 0x1p-8 : 0.0;
  // bf16 tensor cores round the weights and ds to bf16; f32 ones (3xTF32)
  // keep them f32 and carry the split products' terms.
  model.operand_unit = tensor_cores && bf16 ? 0x1p-8 : 0.0;
  if (tensor_cores && !bf16) model = testing::WithThreeTf32Products(model);
  const testing::AttentionTolerances tol =
      testing::CausalAttentionTolerances(qkv, dout, b, t, c, nh, model);
  std::string worst;
  EXPECT_EQ(testing::CountOutside(run.out, out, tol.out, &worst), 0) << "out, worst " << worst;
  EXPECT_EQ(testing::CountOutside(run.lse, tol.lse_exact, tol.lse, &worst), 0)
      << "lse, worst " << worst;
  EXPECT_EQ(testing::CountOutside(run.dqkv, dqkv, tol.dqkv, &worst), 0) << "dqkv, worst " << worst;

  // Deterministic: a second run gives the same bits.
  const FlashRun again = RunFlash<S>(kernels, qkv, dout, b, t, c, nh);
  EXPECT_EQ(std::memcmp(again.out.data(), run.out.data(), run.out.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(again.lse.data(), run.lse.data(), run.lse.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(again.dqkv.data(), run.dqkv.data(), run.dqkv.size() * sizeof(float)), 0);
}

// Every thread-per-row variant of the CUDA-core kernels (head sizes <= 32,
// <= 64, <= 128, some not a power of 2) and both padded head sizes of the
// tensor-core ones (64, 128); T of 1, below one tile, not a multiple of the
// 64-row tiles, a multiple; and GPT-2's T 1024, HS 64 (with 1 x 4 heads
// rather than 8 x 12: the same tiles, and the double-precision error model
// stays quick). All head sizes are multiples of 8 (what the tensor cores take).
constexpr std::array<std::array<int64_t, 4>, 7> kFlashShapes = {{{1, 1, 64, 1},
                                                                 {2, 37, 48, 3},
                                                                 {2, 130, 128, 2},
                                                                 {1, 97, 256, 2},
                                                                 {1, 200, 80, 2},
                                                                 {1, 128, 384, 3},
                                                                 {1, 1024, 256, 4}}};

TEST(ParityTest, FlashAttentionF32) {
  uint32_t seed = 40;
  for (const auto& [b, t, c, nh] : kFlashShapes) {
    ExpectFlashMatchesNaive<float>(FlashKernels::kCudaCores, b, t, c, nh, seed++);
  }
  ExpectFlashMatchesNaive<float>(FlashKernels::kCudaCores, 2, 50, 60, 3, seed++);  // hs 20
}

TEST(ParityTest, FlashAttentionBF16) {
  uint32_t seed = 60;
  for (const auto& [b, t, c, nh] : kFlashShapes) {
    ExpectFlashMatchesNaive<uint16_t>(FlashKernels::kCudaCores, b, t, c, nh, seed++);
  }
  ExpectFlashMatchesNaive<uint16_t>(FlashKernels::kCudaCores, 2, 50, 60, 3, seed++);  // hs 20
}

TEST(ParityTest, FlashAttentionBF16TensorCores) {
  uint32_t seed = 80;
  for (const auto& [b, t, c, nh] : kFlashShapes) {
    ExpectFlashMatchesNaive<uint16_t>(FlashKernels::kTensorCores, b, t, c, nh, seed++);
  }
  // Head size 20 is not a multiple of 8: refused, saying so.
  DeviceBuffer<uint16_t> d_qkv(2 * 50 * 3 * 60), d_out(2 * 50 * 60);
  DeviceBuffer<float> d_lse(2 * 3 * 50);
  const absl::Status s =
      gpu::FlashAttentionForwardWith(FlashKernels::kTensorCores, d_out.get(), d_lse.get(),
                                     d_qkv.get(), 2, 50, 60, 3, DType::kBF16, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// f32 as 3xTF32: the shapes with head sizes up to 64 (the f32 tensor-core
// kernels' largest), and head size 20 (a multiple of 4, which f32 takes).
TEST(ParityTest, FlashAttentionF32TensorCores) {
  uint32_t seed = 100;
  for (const auto& [b, t, c, nh] : kFlashShapes) {
    if (c / nh > gpu::kFlashTensorCoresF32MaxHeadSize) continue;
    ExpectFlashMatchesNaive<float>(FlashKernels::kTensorCores, b, t, c, nh, seed++);
  }
  ExpectFlashMatchesNaive<float>(FlashKernels::kTensorCores, 2, 50, 60, 3, seed++);  // hs 20
  // Head size 128: refused, saying so.
  DeviceBuffer<float> d_qkv(1 * 97 * 3 * 256), d_out(1 * 97 * 256), d_lse(2 * 97);
  const absl::Status s =
      gpu::FlashAttentionForwardWith(FlashKernels::kTensorCores, d_out.get(), d_lse.get(),
                                     d_qkv.get(), 1, 97, 256, 2, DType::kF32, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// f32's default is the 3xTF32 tensor-core kernels where they take the head
// size (up to 64), the CUDA cores past it: the public functions' results
// equal those of the variant named, bit for bit.
TEST(ParityTest, FlashAttentionF32DefaultIsTensorCoresUpToTheirHeadSize) {
  const int64_t b = 2, t = 100, nh = 2;
  for (const auto& [c, kernels] : {std::pair{int64_t{128}, FlashKernels::kTensorCores},
                                   std::pair{int64_t{256}, FlashKernels::kCudaCores}}) {
    SCOPED_TRACE(absl::StrCat("head size ", c / nh));
    const std::vector<float> qkv = RandomFloats(b * t * 3 * c, 92, -2.0f, 2.0f);
    const std::vector<float> dout = RandomFloats(b * t * c, 93);
    DeviceBuffer<float> d_qkv(qkv), d_dout(dout), d_out(b * t * c), d_dqkv(qkv.size()),
        d_lse(b * nh * t);
    ASSERT_TRUE(gpu::FlashAttentionForward(d_out.get(), d_lse.get(), d_qkv.get(), b, t, c, nh,
                                           DType::kF32, nullptr)
                    .ok());
    ASSERT_TRUE(gpu::FlashAttentionBackward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(),
                                            d_lse.get(), b, t, c, nh, DType::kF32, nullptr)
                    .ok());
    const FlashRun run = RunFlash<float>(kernels, qkv, dout, b, t, c, nh);
    EXPECT_TRUE(run.out == d_out.Download() && run.dqkv == d_dqkv.Download())
        << "f32 FlashAttentionForward / Backward do not match the "
        << (kernels == FlashKernels::kTensorCores ? "tensor-core" : "CUDA-core") << " kernels";
  }
}

// The public functions (flash_attention.h) run one of the two: their results
// equal, bit for bit, those of the CUDA-core or of the tensor-core kernels.
TEST(ParityTest, FlashAttentionDefaultIsOneOfTheVariants) {
  const int64_t b = 2, t = 100, c = 128, nh = 2;
  const std::vector<uint16_t> qkv = ToBF16(RandomFloats(b * t * 3 * c, 90, -2.0f, 2.0f));
  const std::vector<uint16_t> dout = ToBF16(RandomFloats(b * t * c, 91));
  DeviceBuffer<uint16_t> d_qkv(qkv), d_dout(dout), d_out(b * t * c), d_dqkv(qkv.size());
  DeviceBuffer<float> d_lse(b * nh * t);
  ASSERT_TRUE(gpu::FlashAttentionForward(d_out.get(), d_lse.get(), d_qkv.get(), b, t, c, nh,
                                         DType::kBF16, nullptr)
                  .ok());
  ASSERT_TRUE(gpu::FlashAttentionBackward(d_dqkv.get(), d_dout.get(), d_qkv.get(), d_out.get(),
                                          d_lse.get(), b, t, c, nh, DType::kBF16, nullptr)
                  .ok());
  const std::vector<float> out = FromBF16(d_out.Download()), dqkv = FromBF16(d_dqkv.Download());
  bool matched = false;
  for (FlashKernels kernels : {FlashKernels::kCudaCores, FlashKernels::kTensorCores}) {
    const FlashRun run = RunFlash<uint16_t>(kernels, FromBF16(qkv), FromBF16(dout), b, t, c, nh);
    matched = matched || (run.out == out && run.dqkv == dqkv);
  }
  EXPECT_TRUE(matched) << "FlashAttentionForward / Backward match neither variant";
}
}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) { return zeroshard::gpu_test::RunIfGpu(argc, argv); }
