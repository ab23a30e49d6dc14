// The ZeRO engine on a GPU against the same engine on the CPU: one process
// (W = 1, NCCL communicators of one rank), a 3-layer GELU MLP, 5 Adam steps
// at stages 0 and 3, fp32 and bf16 parameters. The schedule is the same
// ZeroEngine code; this checks CudaBackend, CudaMlpModel and the NCCL block
// collectives underneath it. Needs a GPU (run by tests/gpu/run.sh).
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "common/plan/planner.h"
#include "tests/gpu/gpu_test_util.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/cuda/nccl_communicator.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_mlp.h"
#include "worker/data/regression_data.h"
#include "worker/model/mlp.h"
#include "worker/zero/engine.h"

namespace zeroshard {
namespace {

constexpr int kLayers = 3;
constexpr int kWidth = 64;
constexpr int kBatch = 8;
constexpr int kSteps = 5;

struct Trained {
  std::vector<float> params;  // every piece, in the engine's piece order
  std::vector<double> losses;
};

// Trains with `model` on `backend` (null: the CPU) and the given
// communicators; returns the parameters after kSteps.
Trained Train(RegressionModel* model, Backend* backend, Communicator* gather,
              Communicator* reduce, Communicator* aux, int stage, DType param_dtype) {
  Trained out;
  auto plan = Plan(model->Spec(), 1, PlanOptions());
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return out;
  EngineOptions options;
  options.stage = stage;
  options.prefetch = 1;
  options.param_dtype = param_dtype;
  options.backend = backend;
  auto engine = ZeroEngine::Create(model, *plan, gather, reduce, aux, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return out;
  EXPECT_TRUE((*engine)
                  ->Initialize([&](const TensorSpec& t, int64_t b, int64_t e, float* rows) {
                    model->InitRows(t, b, e, /*seed=*/5, rows);
                    return absl::OkStatus();
                  })
                  .ok());
  SyntheticRegressionData data(/*seed=*/3, kWidth);
  std::vector<float> x(kBatch * kWidth), y(kBatch * kWidth);
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_TRUE(data.Fill(step, 0, 0, 1, kBatch, 1, x.data(), y.data()).ok());
    EXPECT_TRUE(model->SetBatch(x.data(), y.data(), kBatch).ok());
    auto loss = (*engine)->ForwardBackward(/*last_micro=*/true);
    EXPECT_TRUE(loss.ok()) << loss.status();
    auto stats = (*engine)->Step(/*lr=*/1e-2);
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (loss.ok()) out.losses.push_back(*loss);
  }
  EXPECT_TRUE((*engine)
                  ->ForEachOwnPiece([&](const ZeroEngine::PieceView& piece) {
                    out.params.insert(out.params.end(), piece.params,
                                      piece.params + piece.elements);
                    return absl::OkStatus();
                  })
                  .ok());
  return out;
}

class EngineParityTest : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(EngineParityTest, GpuEngineMatchesCpuEngine) {
  const auto [stage, dtype] = GetParam();
  const MlpConfig config{kLayers, kWidth, "gelu"};

  InMemoryKvStore cpu_store;
  auto g = GlooCommunicator::Create(&cpu_store, 0, 1, "gather");
  auto r = GlooCommunicator::Create(&cpu_store, 0, 1, "reduce");
  auto a = GlooCommunicator::Create(&cpu_store, 0, 1, "aux");
  ASSERT_TRUE(g.ok() && r.ok() && a.ok());
  auto cpu_model = MlpModel::Create(config);
  ASSERT_TRUE(cpu_model.ok());
  Trained cpu = Train(cpu_model->get(), nullptr, g->get(), r->get(), a->get(), stage, dtype);

  auto backend = CudaBackend::Create(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  InMemoryKvStore gpu_store;
  auto ng = NcclCommunicator::Create(&gpu_store, 0, 1, 0, "gather", absl::Seconds(60));
  auto nr = NcclCommunicator::Create(&gpu_store, 0, 1, 0, "reduce", absl::Seconds(60));
  auto ga = GlooCommunicator::Create(&gpu_store, 0, 1, "aux");
  ASSERT_TRUE(ng.ok()) << ng.status();
  ASSERT_TRUE(nr.ok()) << nr.status();
  ASSERT_TRUE(ga.ok()) << ga.status();
  auto gpu_model = CudaMlpModel::Create(config, backend->get());
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
  Trained gpu = Train(gpu_model->get(), backend->get(), ng->get(), nr->get(), ga->get(), stage,
                      dtype);

  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i) {
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-4 * std::fabs(cpu.losses[i]) + 1e-6)
        << "step " << i;
  }
  // cuBLAS and OpenBLAS sum in different orders, and Adam turns rounding
  // in near-zero gradients into steps of up to ~1e-3 lr; 5 steps of lr 1e-2
  // move a parameter by ~5e-2, so a schedule or kernel bug is far outside.
  const bool f32 = dtype == DType::kF32;
  EXPECT_TRUE(gpu_test::AllNear(gpu.params, cpu.params, /*atol=*/f32 ? 5e-5f : 1e-2f,
                                /*rtol=*/f32 ? 1e-3f : 1e-2f));
}

INSTANTIATE_TEST_SUITE_P(StagesAndDtypes, EngineParityTest,
                         ::testing::Combine(::testing::Values(0, 3),
                                            ::testing::Values(DType::kF32, DType::kBF16)));

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) { return zeroshard::gpu_test::RunIfGpu(argc, argv); }
