// The device GPT (CudaGptModel) against the CPU GPT (GptModel), W = 1.
// Needs a GPU (run by tests/gpu/run.sh; run on an H200 and an H100).
//
// 1. ModelParity: one forward and backward of the same batch with the same
//    parameters (the model zoo's initialization, perturbed so that biases and
//    LayerNorm weights are not 0 / 1 and an indexing bug cannot hide behind
//    them), at t = n_ctx and t < n_ctx. Prints, per tensor, the largest
//    absolute difference of the gradients and that difference relative to
//    the tensor's largest CPU gradient, so a first GPU run points at the
//    kernel at fault (a block's c_attn gradient: attention backward; wpe:
//    embedding; ln_f: the head...). The gradient buffers start as NaN, so a
//    kOverwrite that does not clear shows too.
// 2. MixedLinear: CublasLinear::ForwardMixed / BackwardMixed (bf16 operands,
//    f32 results; the device MLP's products) against the CPU Linear / Conv1D
//    on bf16-rounded operands. (The GPT's cuBLASLt products are checked by
//    cuda_fused_parity_check.)
// 3. EngineParity: 5 Adam steps through the ZeRO engine (CPU backend + Gloo
//    against CudaBackend + NCCL), stages 0 and 3: the loss of every step,
//    every step's gradients (recovered from Adam's first moment) and every
//    parameter after the last, per tensor.
//
// Tolerances (stated here and in docs/gpu.md):
//   F32  (cuBLAS f32, no TF32): loss and logits to 1e-4 relative; gradients
//        within 1e-3 of each tensor's largest gradient. The same with
//        flash_tc, whose f32 attention products are 3xTF32 (each within
//        ~3 * 2^-22 relative, under f32's own accumulation error;
//        worker/cuda/flash_attention_wmma.cu).
//   BF16 (the GPU stores activations and the gradients between products in
//        bf16, cuda_gpt.h, and multiplies bf16 operands; the CPU reference
//        multiplies the same bf16-rounded parameters in f32 with f32
//        activations): loss to 2e-2 relative, logits within 5e-2 of their
//        largest value, gradients within 5e-2 of each tensor's largest.
//        Error model: each bf16 rounding is <= 2^-9 relative; a value of
//        this 2-layer model passes through at most ~20 roundings on its way
//        to a gradient (forward and backward), so even aligned errors stay
//        under 20 * 2^-9 ~ 4e-2 of the tensor's scale.
//   Parameters after the engine's steps: what Adam makes of each run's own
//        gradients, replayed in double, to within float rounding (the
//        bound's derivation is at the comparison). Not a bound on |diff|
//        alone: Adam normalizes every element's step, so an element whose
//        gradient is within rounding of 0 may step lr either way (session
//        60's first run of this check: c_attn's key bias, exact gradient 0,
//        moved ~4 lr apart in bf16, as it should).
// A wrong index makes whole tensors differ by O(1) of their scale, far
// outside every bound; float rounding stays well inside.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/plan/planner.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_gpt.h"
#include "worker/cuda/nccl_communicator.h"
#include "worker/model/gpt.h"
#include "worker/model/layers.h"
#include "worker/model/model_util.h"
#include "worker/zero/engine.h"
#include "worker/zero/optimizer.h"

namespace zeroshard {
namespace {

using gpu_test::DeviceBuffer;

struct Tolerance {
  double loss_rel;        // |loss diff| / |cpu loss|
  double logits_rel;      // max |diff| / max |cpu logit|
  double grads_rel;       // per tensor: max |diff| / max |cpu grad|
};

constexpr double kLr = 1e-3;
constexpr int kSteps = 5;

Tolerance ToleranceFor(DType dtype) {
  if (dtype == DType::kF32) return {1e-4, 1e-4, 1e-3};
  return {2e-2, 5e-2, 5e-2};
}

GptConfig SmallGpt() {
  GptConfig config;
  config.n_layer = 2;
  config.n_head = 4;
  config.n_embd = 64;
  config.vocab = 256;
  config.n_ctx = 32;
  return config;
}
constexpr int kBatch = 4;

struct Diff {
  double max_abs = 0;   // largest |got - want| (inf for a NaN on one side only)
  double max_want = 0;  // largest |want|
  double p99 = 0;       // 99th percentile of |got - want|
  double rel() const { return max_abs / std::max(max_want, 1e-30); }
};

Diff Compare(const float* got, const float* want, size_t n) {
  Diff d;
  std::vector<double> diffs(n);
  for (size_t i = 0; i < n; ++i) {
    double e = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (std::isnan(got[i]) != std::isnan(want[i]) || std::isnan(e)) e = INFINITY;
    diffs[i] = e;
    d.max_abs = std::max(d.max_abs, e);
    d.max_want = std::max(d.max_want, std::fabs(static_cast<double>(want[i])));
  }
  if (n > 0) {
    size_t k = std::min(n - 1, static_cast<size_t>(0.99 * static_cast<double>(n)));
    std::nth_element(diffs.begin(), diffs.begin() + k, diffs.end());
    d.p99 = diffs[k];
  }
  return d;
}

// Parameters of every unit, flat in the unit's tensor order: the model's
// initialization plus a perturbation, rounded to bf16 values when the
// products are bf16 (the engine hands bf16-rounded values to both models).
std::vector<std::vector<float>> MakeParams(const GptModel& model, DType dtype) {
  const ModelSpec& spec = model.Spec();
  std::vector<std::vector<int>> units = TensorsByUnit(spec);
  std::vector<std::vector<float>> out(units.size());
  uint32_t seed = 11;
  for (size_t u = 0; u < units.size(); ++u) {
    for (int ti : units[u]) {
      const TensorSpec& t = spec.tensors[ti];
      std::vector<float> values(t.Elements());
      model.InitRows(t, 0, t.Rows(), /*seed=*/7, values.data());
      std::vector<float> noise = gpu_test::RandomFloats(values.size(), seed++, -0.05f, 0.05f);
      for (size_t i = 0; i < values.size(); ++i) {
        float v = values[i] + noise[i];
        if (dtype == DType::kBF16) v = BF16ToFloat(FloatToBF16(v));
        values[i] = v;
      }
      out[u].insert(out[u].end(), values.begin(), values.end());
    }
  }
  return out;
}

UnitTensors Views(const ModelSpec& spec, const std::vector<int>& unit, float* flat) {
  UnitTensors views;
  int64_t offset = 0;
  for (int ti : unit) {
    TensorView v;
    v.data = flat + offset;
    v.shape = spec.tensors[ti].shape;
    offset += spec.tensors[ti].Elements();
    views.push_back(v);
  }
  return views;
}

// Tokens and targets of `b` random sequences of t + 1 bytes.
void MakeBatch(int b, int t, uint32_t seed, std::vector<int32_t>* tokens,
               std::vector<int32_t>* targets) {
  std::vector<int32_t> seq = gpu_test::RandomInts(static_cast<size_t>(b) * (t + 1), seed, 0, 255);
  tokens->resize(static_cast<size_t>(b) * t);
  targets->resize(tokens->size());
  for (int i = 0; i < b; ++i) {
    for (int j = 0; j < t; ++j) {
      (*tokens)[i * t + j] = seq[i * (t + 1) + j];
      (*targets)[i * t + j] = seq[i * (t + 1) + j + 1];
    }
  }
}

CudaGptOptions Options(DType dtype,
                       CudaGptOptions::Attention attention = CudaGptOptions::Attention::kAuto) {
  CudaGptOptions o;
  o.matmul_dtype = dtype;
  o.attention = attention;
  return o;
}

// (dtype, t, attention kernel). At t < n_ctx every third target is
// kUnscoredTarget (--loss_on=answers' positions that are not scored).
class ModelParityTest
    : public ::testing::TestWithParam<std::tuple<DType, int, CudaGptOptions::Attention>> {};

void CheckOnePass(const GptConfig& config, DType dtype, int t,
                  CudaGptOptions::Attention attention) {
  const Tolerance tol = ToleranceFor(dtype);
  auto cpu = GptModel::Create(config);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto backend = CudaBackend::Create(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto gpu = CudaGptModel::Create(config, kBatch, Options(dtype, attention), backend->get());
  if (attention == CudaGptOptions::Attention::kCudnn && absl::IsUnavailable(gpu.status())) {
    GTEST_SKIP() << "cuDNN attention not available here: " << gpu.status();
  }
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  // The kernel asked for is the one that runs (cuDNN missing fails here,
  // not silently as flash).
  ASSERT_EQ((*gpu)->attention(), attention);
  const ModelSpec& spec = (*cpu)->Spec();
  ASSERT_EQ((*gpu)->Spec().tensors.size(), spec.tensors.size());
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    EXPECT_EQ((*gpu)->Spec().tensors[i].name, spec.tensors[i].name);
    EXPECT_EQ((*gpu)->Spec().tensors[i].shape, spec.tensors[i].shape);
  }
  const std::vector<std::vector<int>> units = TensorsByUnit(spec);
  const std::vector<int>& ops = (*cpu)->ForwardOps();
  const int n_ops = static_cast<int>(ops.size());

  std::vector<std::vector<float>> params = MakeParams(**cpu, dtype);
  std::vector<std::unique_ptr<DeviceBuffer<float>>> dparams, dgrads;
  std::vector<std::vector<float>> grads(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    dparams.push_back(std::make_unique<DeviceBuffer<float>>(params[u]));
    dgrads.push_back(std::make_unique<DeviceBuffer<float>>(params[u].size()));
    gpu_test::CudaOrDie(cudaMemset(dgrads[u]->get(), 0xff, params[u].size() * sizeof(float)),
                        "cudaMemset");  // NaN: kOverwrite must clear it
    grads[u].assign(params[u].size(), 0.0f);
  }
  gpu_test::CudaOrDie(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  std::vector<int32_t> tokens, targets;
  MakeBatch(kBatch, t, 21, &tokens, &targets);
  if (t < config.n_ctx) {
    for (size_t i = 0; i < targets.size(); i += 3) targets[i] = kUnscoredTarget;
  }
  ASSERT_TRUE((*cpu)->SetBatch(tokens.data(), targets.data(), kBatch, t).ok());
  ASSERT_TRUE((*gpu)->SetBatch(tokens.data(), targets.data(), kBatch, t).ok());

  for (int op = 0; op < n_ops; ++op) {
    const int u = ops[op];
    ASSERT_TRUE((*cpu)->Forward(op, Views(spec, units[u], params[u].data())).ok());
    absl::Status s = (*gpu)->Forward(op, Views(spec, units[u], dparams[u]->get()));
    ASSERT_TRUE(s.ok()) << "op " << op << ": " << s;
  }
  const double cpu_loss = (*cpu)->Loss();
  const double gpu_loss = (*gpu)->Loss();
  std::printf("[%s t=%d] loss: cpu %.8f gpu %.8f (rel diff %.3g)\n", DTypeName(dtype).c_str(), t,
              cpu_loss, gpu_loss, std::fabs(gpu_loss - cpu_loss) / std::fabs(cpu_loss));
  EXPECT_NEAR(gpu_loss, cpu_loss, tol.loss_rel * std::fabs(cpu_loss));

  const int64_t n = int64_t{kBatch} * t;
  std::vector<float> gpu_logits(n * config.vocab);
  for (int64_t pos = 0; pos < n; ++pos) {
    ASSERT_TRUE((*gpu)->LogitsRowToHost(pos, gpu_logits.data() + pos * config.vocab).ok());
  }
  const Diff logits = Compare(gpu_logits.data(), (*cpu)->Logits(), gpu_logits.size());
  std::printf("[%s t=%d] logits: max |diff| %.3g, relative to max |logit| %.3g: %.3g\n",
              DTypeName(dtype).c_str(), t, logits.max_abs, logits.max_want, logits.rel());
  EXPECT_LE(logits.rel(), tol.logits_rel) << "logits";

  std::vector<bool> seen(units.size(), false);
  for (int op = n_ops - 1; op >= 0; --op) {
    const int u = ops[op];
    UnitTensors cg = Views(spec, units[u], grads[u].data());
    ASSERT_TRUE((*cpu)->Backward(op, Views(spec, units[u], params[u].data()), cg).ok());
    UnitTensors gg = Views(spec, units[u], dgrads[u]->get());
    const Model::GradMode mode = seen[u] ? Model::GradMode::kAdd : Model::GradMode::kOverwrite;
    seen[u] = true;
    absl::Status s = (*gpu)->BackwardInto(op, Views(spec, units[u], dparams[u]->get()), gg, mode);
    ASSERT_TRUE(s.ok()) << "op " << op << ": " << s;
  }
  ASSERT_TRUE((*backend)->Synchronize().ok());

  std::printf("%-40s %12s %12s %12s %s\n", "gradient", "max|cpu|", "max|diff|", "relative",
              "verdict");
  for (size_t u = 0; u < units.size(); ++u) {
    std::vector<float> got = dgrads[u]->Download();
    int64_t offset = 0;
    for (int ti : units[u]) {
      const TensorSpec& ts = spec.tensors[ti];
      const Diff d = Compare(got.data() + offset, grads[u].data() + offset, ts.Elements());
      const bool ok = d.rel() <= tol.grads_rel;
      std::printf("%-40s %12.4g %12.4g %12.4g %s\n", ts.name.c_str(), d.max_want, d.max_abs,
                  d.rel(), ok ? "ok" : "FAIL");
      EXPECT_TRUE(ok) << ts.name << ": max |diff| " << d.max_abs << " of max |cpu| " << d.max_want;
      offset += ts.Elements();
    }
  }
}

TEST_P(ModelParityTest, OneForwardAndBackwardMatchTheCpuGpt) {
  const auto [dtype, t, attention] = GetParam();
  CheckOnePass(SmallGpt(), dtype, t, attention);
}

// A vocabulary that is not a multiple of 64: the bf16 LM head's forward and
// input-gradient products then run over the logits rows' padded width with
// zero weight rows (CudaGptModel::HeadWeight); f32 runs over V.
TEST(PaddedVocabTest, OneForwardAndBackwardMatchTheCpuGpt) {
  GptConfig config = SmallGpt();
  config.vocab = 300;  // rows of 320; the batches' tokens are bytes
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int t : {32, 25}) CheckOnePass(config, dtype, t, CudaGptOptions::Attention::kFlash);
  }
}

using A = CudaGptOptions::Attention;
INSTANTIATE_TEST_SUITE_P(DtypesLengthsAndKernels, ModelParityTest,
                         ::testing::Values(std::make_tuple(DType::kF32, 32, A::kNaive),
                                           std::make_tuple(DType::kF32, 25, A::kNaive),
                                           std::make_tuple(DType::kF32, 32, A::kFlash),
                                           std::make_tuple(DType::kF32, 25, A::kFlash),
                                           std::make_tuple(DType::kF32, 32, A::kFlashTc),
                                           std::make_tuple(DType::kF32, 25, A::kFlashTc),
                                           std::make_tuple(DType::kBF16, 32, A::kFlash),
                                           std::make_tuple(DType::kBF16, 25, A::kFlash),
                                           std::make_tuple(DType::kBF16, 32, A::kFlashTc),
                                           std::make_tuple(DType::kBF16, 25, A::kFlashTc),
                                           std::make_tuple(DType::kBF16, 32, A::kCudnn),
                                           std::make_tuple(DType::kBF16, 25, A::kCudnn)),
                         [](const auto& info) {
                           return absl::StrFormat("%s_t%d_%s", DTypeName(std::get<0>(info.param)),
                                                  std::get<1>(info.param),
                                                  AttentionName(std::get<2>(info.param)));
                         });

TEST(CudaGptModelTest, RefusesBatchesLargerThanItsActivations) {
  auto backend = CudaBackend::Create(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto gpu =
      CudaGptModel::Create(SmallGpt(), /*max_batch=*/2, Options(DType::kF32), backend->get());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::vector<int32_t> tokens(3 * 32, 1), targets(3 * 32, 2);
  absl::Status s = (*gpu)->SetBatch(tokens.data(), targets.data(), 3, 32);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE((*gpu)->SetBatch(tokens.data(), targets.data(), 2, 32).ok());
  EXPECT_TRUE((*gpu)->SetBatch(tokens.data(), targets.data(), 1, 5).ok());
  tokens[3] = 256;
  s = (*gpu)->SetBatch(tokens.data(), targets.data(), 1, 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(
      CudaGptModel::Create(SmallGpt(), 2, Options(DType::kF16), backend->get()).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// ---- CublasLinear's mixed-precision products (the bf16 GPT's GEMMs) ----

// Operands rounded to bf16 multiply exactly in f32, so with f32 accumulation
// the GPU matches the CPU kernels on the rounded values to summation order.
class MixedLinearTest : public ::testing::TestWithParam<gpu::CublasLinear::Layout> {};

std::vector<float> RoundedBf16(std::vector<float> v) {
  for (float& x : v) x = BF16ToFloat(FloatToBF16(x));
  return v;
}
std::vector<uint16_t> Bits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBF16(v[i]);
  return out;
}

TEST_P(MixedLinearTest, MatchesTheCpuOnBf16RoundedOperands) {
  const gpu::CublasLinear::Layout layout = GetParam();
  const bool out_in = layout == gpu::CublasLinear::Layout::kOutIn;
  const int64_t n = 37, in = 48, out = 80;
  std::vector<float> x = RoundedBf16(gpu_test::RandomFloats(n * in, 1));
  std::vector<float> w = RoundedBf16(gpu_test::RandomFloats(in * out, 2));
  std::vector<float> b = gpu_test::RandomFloats(out, 3);
  std::vector<float> dy = RoundedBf16(gpu_test::RandomFloats(n * out, 4));
  std::vector<float> dw0 = gpu_test::RandomFloats(in * out, 5);  // accumulated into
  std::vector<float> db0 = gpu_test::RandomFloats(out, 6);

  std::vector<float> y(n * out), dx(n * in), dw = dw0, db = db0;
  if (out_in) {
    LinearForward(y.data(), x.data(), w.data(), b.data(), n, in, out);
    LinearBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), n, in, out);
  } else {
    Conv1dForward(y.data(), x.data(), w.data(), b.data(), n, in, out);
    Conv1dBackward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), n, in, out);
  }

  auto linear = gpu::CublasLinear::Create(nullptr);
  ASSERT_TRUE(linear.ok()) << linear.status();
  DeviceBuffer<uint16_t> dx16(Bits(x)), dw16(Bits(w)), ddy16(Bits(dy));
  DeviceBuffer<float> db_(b), ddy(dy), dy_out(n * out), ddx(n * in), ddw(dw0), ddb(db0);
  ASSERT_TRUE(
      (*linear)
          ->ForwardMixed(dy_out.get(), dx16.get(), dw16.get(), db_.get(), n, in, out, layout)
          .ok());
  ASSERT_TRUE((*linear)
                  ->BackwardMixed(ddx.get(), ddw.get(), ddb.get(), ddy16.get(), ddy.get(),
                                  dx16.get(), dw16.get(), n, in, out, layout)
                  .ok());
  EXPECT_TRUE(gpu_test::AllNear(dy_out.Download(), y, 1e-4f, 1e-4f)) << "y";
  EXPECT_TRUE(gpu_test::AllNear(ddx.Download(), dx, 1e-4f, 1e-4f)) << "dx";
  EXPECT_TRUE(gpu_test::AllNear(ddw.Download(), dw, 1e-4f, 1e-4f)) << "dw";
  EXPECT_TRUE(gpu_test::AllNear(ddb.Download(), db, 1e-4f, 1e-4f)) << "db";
}

INSTANTIATE_TEST_SUITE_P(Layouts, MixedLinearTest,
                         ::testing::Values(gpu::CublasLinear::Layout::kOutIn,
                                           gpu::CublasLinear::Layout::kInOut));

// ---- Through the ZeRO engine ----

// Diagnostic knobs (unset: the values above): ZEROSHARD_PARITY_PREFETCH sets
// the engine's prefetch depth of both runs, to tell a schedule-dependent
// difference from one in the arithmetic.
// ZEROSHARD_PARITY_STEPS sets the number of engine steps (after one Adam
// step a parameter moved by about lr * sign(gradient), or not at all where
// the gradient was zero, so one step shows which gradient elements differ).
int StepCount() {
  const char* v = std::getenv("ZEROSHARD_PARITY_STEPS");
  return v != nullptr ? std::atoi(v) : kSteps;
}

int PrefetchDepth() {
  const char* v = std::getenv("ZEROSHARD_PARITY_PREFETCH");
  return v != nullptr ? std::atoi(v) : 1;
}

struct Trained {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::map<std::string, std::vector<float>> params;  // by tensor name
  // Adam's first moment after every step, by tensor name (each step's
  // gradient follows from two of them, AdamGradients).
  std::vector<std::map<std::string, std::vector<float>>> exp_avg;
};

// Each step's gradient of every element, from Adam's first moment after
// each step (m_k = beta1 m_{k-1} + (1 - beta1) g_k, m_0 = 0). Float rounding
// of the moments leaves ~1e-7 relative of |m| in g, far below the gradient
// error bounds this is compared with.
std::vector<std::vector<double>> AdamGradients(
    const std::vector<std::map<std::string, std::vector<float>>>& exp_avg,
    const std::string& name, double beta1) {
  std::vector<std::vector<double>> g(exp_avg.size());
  for (size_t k = 0; k < exp_avg.size(); ++k) {
    const std::vector<float>& m = exp_avg[k].at(name);
    g[k].resize(m.size());
    for (size_t i = 0; i < m.size(); ++i) {
      const double prev = k == 0 ? 0.0 : exp_avg[k - 1].at(name)[i];
      g[k][i] = (m[i] - beta1 * prev) / (1.0 - beta1);
    }
  }
  return g;
}

// What Adam (PyTorch's, no weight decay) moves each element by over the
// steps, divided by -lr, computed in double from a gradient sequence
// (grads[k][i], step k): sum_k m_hat_k / (sqrt(v_hat_k) + eps).
std::vector<double> AdamDisplacement(const std::vector<std::vector<double>>& grads,
                                     const OptimizerOptions& o) {
  const size_t n = grads.empty() ? 0 : grads[0].size();
  std::vector<double> m(n, 0.0), v(n, 0.0), sum(n, 0.0);
  for (size_t k = 0; k < grads.size(); ++k) {
    const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(k + 1));
    const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(k + 1));
    for (size_t i = 0; i < n; ++i) {
      const double g = grads[k][i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      sum[i] += (m[i] / bc1) / (std::sqrt(v[i]) / std::sqrt(bc2) + o.eps);
    }
  }
  return sum;
}

Trained Train(TokenModel* model, Backend* backend, Communicator* gather, Communicator* reduce,
              Communicator* aux, int stage, DType param_dtype,
              std::optional<bool> packed = std::nullopt) {
  Trained out;
  auto plan = Plan(model->Spec(), 1, PlanOptions());
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return out;
  EngineOptions options;
  options.stage = stage;
  options.prefetch = PrefetchDepth();
  options.param_dtype = param_dtype;
  options.packed_collectives = packed;
  options.backend = backend;
  options.optimizer = "adam";
  auto engine = ZeroEngine::Create(model, *plan, gather, reduce, aux, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return out;
  absl::Status s =
      (*engine)->Initialize([&](const TensorSpec& t, int64_t b, int64_t e, float* rows) {
        model->InitRows(t, b, e, /*seed=*/5, rows);
        return absl::OkStatus();
      });
  EXPECT_TRUE(s.ok()) << s;
  std::vector<int32_t> tokens, targets;
  for (int step = 0; step < StepCount(); ++step) {
    MakeBatch(kBatch, SmallGpt().n_ctx, 100 + step, &tokens, &targets);
    EXPECT_TRUE(model->SetBatch(tokens.data(), targets.data(), kBatch, SmallGpt().n_ctx).ok());
    auto loss = (*engine)->ForwardBackward(/*last_micro=*/true);
    EXPECT_TRUE(loss.ok()) << loss.status();
    auto stats = (*engine)->Step(kLr);
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (loss.ok()) out.losses.push_back(*loss);
    if (stats.ok()) out.grad_norms.push_back(stats->grad_norm);
    {
      std::map<std::string, std::vector<float>>& m = out.exp_avg.emplace_back();
      s = (*engine)->ForEachOwnPiece([&](const ZeroEngine::PieceView& piece) {
        std::vector<float>& all = m[piece.tensor->name];
        all.resize(piece.tensor->Elements());
        if (piece.exp_avg == nullptr) return absl::InternalError("Adam has no exp_avg");
        std::copy(piece.exp_avg, piece.exp_avg + piece.elements,
                  all.begin() + piece.row_begin * piece.tensor->RowElements());
        return absl::OkStatus();
      });
      EXPECT_TRUE(s.ok()) << s;
    }
  }
  s = (*engine)->ForEachOwnPiece([&](const ZeroEngine::PieceView& piece) {
    std::vector<float>& all = out.params[piece.tensor->name];
    all.resize(piece.tensor->Elements());
    const int64_t row = piece.tensor->RowElements();
    std::copy(piece.params, piece.params + piece.elements, all.begin() + piece.row_begin * row);
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// The parameters after the steps of two runs (`cpu` the reference), per
// tensor; the loss is compared by the caller.
void ExpectSameParameters(const Trained& cpu, const Trained& gpu, const Tolerance& tol) {
  ASSERT_EQ(gpu.params.size(), cpu.params.size());
  ASSERT_EQ(cpu.exp_avg.size(), cpu.losses.size());
  ASSERT_EQ(gpu.exp_avg.size(), gpu.losses.size());
  // Adam divides each element's step by that element's own gradient scale,
  // so a gradient within rounding of 0 (c_attn's key bias, whose exact
  // gradient is 0 because softmax ignores a constant added to a row's
  // scores; any element whose gradient crosses 0) may step either way: no
  // bound on the parameters alone can tell that from a wrong optimizer. So
  // the check is in two parts, both per element:
  //  (a) every step's gradient (recovered from Adam's first moment) within
  //      tol.grads_rel of the tensor's largest CPU gradient that step, the
  //      one-pass check's bound, now through the engine at every step;
  //  (b) the two runs' parameters differ by what Adam's arithmetic, replayed
  //      in double from each run's own gradients (AdamDisplacement), says
  //      they should, to within float rounding: per step and run <= 8 f32
  //      ulps of the parameter's and the update's size (the moments, bias
  //      corrections, sqrt, division and the update each round once; FMA or
  //      not), plus lr 2^-20 for the gradients recovered from f32 moments.
  // The largest and 99th-percentile differences are printed for scale.
  const OptimizerOptions adam;  // the engine's "adam": PyTorch's defaults
  const int steps = static_cast<int>(cpu.losses.size());
  const double ulp = std::ldexp(1.0, -23);
  std::printf("%-36s %10s %10s %10s %10s %s\n", "parameter after the steps", "max|diff|",
              "p99|diff|", "grad err", "vs replay", "verdict");
  for (const auto& [name, want] : cpu.params) {
    const std::vector<float>& got = gpu.params.at(name);
    ASSERT_EQ(got.size(), want.size()) << name;
    const std::vector<std::vector<double>> g_cpu = AdamGradients(cpu.exp_avg, name, adam.beta1);
    const std::vector<std::vector<double>> g_gpu = AdamGradients(gpu.exp_avg, name, adam.beta1);
    // (a): the worst step's largest gradient difference over its bound.
    double grad_ratio = 0;
    int grad_step = -1;
    for (int k = 0; k < steps; ++k) {
      double largest = 0, diff = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        largest = std::max(largest, std::fabs(g_cpu[k][i]));
        const double d = std::fabs(g_gpu[k][i] - g_cpu[k][i]);
        diff = std::isnan(d) ? INFINITY : std::max(diff, d);
      }
      const double ratio = diff / std::max(tol.grads_rel * largest, 1e-30);
      if (ratio > grad_ratio) grad_ratio = ratio, grad_step = k;
    }
    // (b): the worst element's departure from the replayed difference over
    // its rounding bound.
    const std::vector<double> u_cpu = AdamDisplacement(g_cpu, adam);
    const std::vector<double> u_gpu = AdamDisplacement(g_gpu, adam);
    double replay_ratio = 0;
    size_t replay_at = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double expected = -kLr * (u_gpu[i] - u_cpu[i]);
      const double scale = std::fabs(want[i]) + kLr * (std::fabs(u_cpu[i]) + std::fabs(u_gpu[i]));
      const double bound = 2 * steps * (8 * ulp * scale + kLr * std::ldexp(1.0, -20));
      double ratio = std::fabs((static_cast<double>(got[i]) - want[i]) - expected) / bound;
      if (std::isnan(ratio)) ratio = INFINITY;
      if (ratio > replay_ratio) replay_ratio = ratio, replay_at = i;
    }
    const Diff d = Compare(got.data(), want.data(), want.size());
    const bool ok = grad_ratio <= 1 && replay_ratio <= 1;
    std::printf("%-36s %10.3g %10.3g %10.3g %10.3g %s\n", name.c_str(), d.max_abs, d.p99,
                grad_ratio, replay_ratio, ok ? "ok" : "FAIL");
    EXPECT_LE(grad_ratio, 1) << name << ": step " << grad_step
                             << "'s gradients differ by more than their bound";
    EXPECT_LE(replay_ratio, 1) << name << ": element " << replay_at << " is " << got[replay_at]
                               << " on the GPU and " << want[replay_at]
                               << " on the CPU, not what Adam makes of their gradients";
  }
}

// (stage, dtype, packed collectives on the device: EngineOptions'
// packed_collectives, on by default there; the block collectives too).
class EngineParityTest : public ::testing::TestWithParam<std::tuple<int, DType, bool>> {};

TEST_P(EngineParityTest, FiveStepsMatchTheCpuGpt) {
  const auto [stage, dtype, packed] = GetParam();
  const Tolerance tol = ToleranceFor(dtype);
  const GptConfig config = SmallGpt();

  InMemoryKvStore cpu_store;
  auto g = GlooCommunicator::Create(&cpu_store, 0, 1, "gather");
  auto r = GlooCommunicator::Create(&cpu_store, 0, 1, "reduce");
  auto a = GlooCommunicator::Create(&cpu_store, 0, 1, "aux");
  ASSERT_TRUE(g.ok() && r.ok() && a.ok());
  auto cpu_model = GptModel::Create(config);
  ASSERT_TRUE(cpu_model.ok());
  Trained cpu =
      Train(cpu_model->get(), nullptr, g->get(), r->get(), a->get(), stage, dtype);

  auto backend = CudaBackend::Create(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  InMemoryKvStore gpu_store;
  auto ng = NcclCommunicator::Create(&gpu_store, 0, 1, 0, "gather", absl::Seconds(60));
  auto nr = NcclCommunicator::Create(&gpu_store, 0, 1, 0, "reduce", absl::Seconds(60));
  auto ga = GlooCommunicator::Create(&gpu_store, 0, 1, "aux");
  ASSERT_TRUE(ng.ok()) << ng.status();
  ASSERT_TRUE(nr.ok()) << nr.status();
  ASSERT_TRUE(ga.ok()) << ga.status();
  auto gpu_model = CudaGptModel::Create(config, kBatch, Options(dtype), backend->get());
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
  Trained gpu = Train(gpu_model->get(), backend->get(), ng->get(), nr->get(), ga->get(), stage,
                      dtype, packed);

  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i) {
    std::printf(
        "[stage %d %s] step %zu loss: cpu %.8f gpu %.8f; gradient norm: cpu %.8f gpu %.8f\n", stage,
        DTypeName(dtype).c_str(), i, cpu.losses[i], gpu.losses[i],
        i < cpu.grad_norms.size() ? cpu.grad_norms[i] : -1.0,
        i < gpu.grad_norms.size() ? gpu.grad_norms[i] : -1.0);
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], tol.loss_rel * std::fabs(cpu.losses[i]))
        << "step " << i;
  }
  ExpectSameParameters(cpu, gpu, tol);
}

std::string EngineCaseName(const ::testing::TestParamInfo<std::tuple<int, DType, bool>>& info) {
  return absl::StrFormat("stage%d_%s%s", std::get<0>(info.param),
                         DTypeName(std::get<1>(info.param)),
                         std::get<2>(info.param) ? "" : "_blocks");
}

INSTANTIATE_TEST_SUITE_P(StagesAndDtypes, EngineParityTest,
                         ::testing::Combine(::testing::Values(0, 3),
                                            ::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(true)),
                         EngineCaseName);
// Stage 3 through NCCL's block collectives (--packed_collectives=off).
INSTANTIATE_TEST_SUITE_P(BlockCollectives, EngineParityTest,
                         ::testing::Combine(::testing::Values(3),
                                            ::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(false)),
                         EngineCaseName);

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) { return zeroshard::gpu_test::RunIfGpu(argc, argv); }
