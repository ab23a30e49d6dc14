#include "tests/worker/zero/engine_train.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/plan/planner.h"
#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/data/batch_layout.h"
#include "worker/data/regression_data.h"
#include "worker/model/mlp.h"
#include "worker/zero/engine.h"

namespace zeroshard {
namespace engine_testing {
namespace {

// A communicator that forwards to another and counts its plain AllGather
// calls (not AllGatherBlocks).
class CountingCommunicator : public Communicator {
 public:
  CountingCommunicator(std::unique_ptr<Communicator> inner, std::atomic<int>* all_gathers)
      : inner_(std::move(inner)), all_gathers_(all_gathers) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  absl::Status AllGather(const void* input, void* output, int64_t count, DType dtype,
                         absl::Duration timeout) override {
    ++*all_gathers_;
    return inner_->AllGather(input, output, count, dtype, timeout);
  }
  absl::Status ReduceScatter(const void* input, void* output, int64_t count, DType dtype,
                             ReduceOp op, absl::Duration timeout) override {
    return inner_->ReduceScatter(input, output, count, dtype, op, timeout);
  }
  absl::Status AllGatherBlocks(const void* shard, void* full, const std::vector<ShardBlock>& blocks,
                               DType dtype, absl::Duration timeout) override {
    return inner_->AllGatherBlocks(shard, full, blocks, dtype, timeout);
  }
  absl::Status ReduceScatterBlocks(const void* full, void* shard,
                                   const std::vector<ShardBlock>& blocks, DType dtype, ReduceOp op,
                                   absl::Duration timeout) override {
    return inner_->ReduceScatterBlocks(full, shard, blocks, dtype, op, timeout);
  }
  absl::Status AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                         absl::Duration timeout) override {
    return inner_->AllReduce(buffer, count, dtype, op, timeout);
  }
  absl::Status Broadcast(void* buffer, int64_t count, DType dtype, int root,
                         absl::Duration timeout) override {
    return inner_->Broadcast(buffer, count, dtype, root, timeout);
  }
  absl::Status Barrier(absl::Duration timeout) override { return inner_->Barrier(timeout); }
  CollectiveBytes bytes_sent() const override { return inner_->bytes_sent(); }
  void Abort() override { inner_->Abort(); }

 private:
  std::unique_ptr<Communicator> inner_;
  std::atomic<int>* all_gathers_;
};

BatchLayout LayoutOf(const RunConfig& c) {
  return BatchLayout{c.world, c.data_world > 0 ? c.data_world : c.world, c.grad_accum};
}

}  // namespace

RunResult Train(const RunConfig& config) {
  RunResult result;
  // GELU, not ReLU: with ReLU a pre-activation within rounding of zero can
  // switch a unit on in one summation order and off in another, and Adam
  // (eps 1e-8) turns the resulting near-zero gradient into an lr-sized step,
  // so a 1e-5 comparison would test the CPU's GEMM rounding (seen with
  // OpenBLAS's Zen kernels), not the engine.
  MlpConfig mlp{config.layers, config.width, "gelu"};
  auto probe = MlpModel::Create(mlp);
  EXPECT_TRUE(probe.ok());
  PlanOptions plan_options;
  plan_options.alignment_elements = 4;
  auto plan = Plan((*probe)->Spec(), config.world, plan_options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  result.plan = *plan;
  for (const TensorSpec& t : (*probe)->Spec().tensors) {
    result.params[t.name].assign(t.Elements(), NAN);
  }
  result.ranks.resize(config.world);
  InMemoryKvStore store;
  absl::Mutex mu;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < config.world; ++rank) {
    threads.emplace_back([&, rank] {
      auto gather = CreateHostCommunicator(&store, rank, config.world, "gather");
      auto reduce = CreateHostCommunicator(&store, rank, config.world, "reduce");
      auto aux = CreateHostCommunicator(&store, rank, config.world, "aux");
      ASSERT_TRUE(gather.ok() && reduce.ok() && aux.ok()) << gather.status();
      absl::StatusOr<std::unique_ptr<Communicator>> secondary;
      if (config.secondary > 0) {
        secondary = CreateHostCommunicator(&store, rank % config.secondary, config.secondary,
                                           absl::StrCat("secondary", rank / config.secondary));
        ASSERT_TRUE(secondary.ok()) << secondary.status();
        if (config.secondary_all_gathers != nullptr) {
          secondary = std::make_unique<CountingCommunicator>(std::move(*secondary),
                                                             config.secondary_all_gathers);
        }
      }
      auto model = MlpModel::Create(mlp);
      ASSERT_TRUE(model.ok());
      EngineOptions options;
      options.stage = config.stage;
      options.prefetch = config.prefetch;
      const BatchLayout layout = LayoutOf(config);
      options.grad_accum = layout.Passes();
      options.global_micro_batches = layout.Even() ? 0 : layout.MicroBatches();
      options.param_dtype = config.param_dtype;
      options.reduce_dtype = config.reduce_dtype;
      options.optimizer = config.optimizer;
      options.collective_timeout = absl::Seconds(30);
      options.shared_gather = config.shared_gather;
      options.packed_collectives = config.packed;
      options.backend = config.backend;
      options.max_grad_norm = config.max_grad_norm;
      if (config.secondary > 0) options.secondary = secondary->get();
      auto engine = ZeroEngine::Create(model->get(), *plan, gather->get(), reduce->get(),
                                       aux->get(), options);
      ASSERT_TRUE(engine.ok()) << engine.status();
      ZeroEngine& e = **engine;
      Model* m = model->get();
      ASSERT_TRUE(e.Initialize([&](const TensorSpec& t, int64_t b, int64_t end, float* out) {
                     m->InitRows(t, b, end, /*seed=*/7, out);
                     return absl::OkStatus();
                   }).ok());
      const int64_t allocations_before = e.memory().allocations();
      SyntheticRegressionData data(/*seed=*/11, config.width);
      std::vector<float> x(config.batch * config.width), y(config.batch * config.width);
      for (int step = 0; step < config.steps; ++step) {
        if (step == config.drop_step) continue;
        const int passes = layout.Passes();
        for (int micro = 0; micro < passes; ++micro) {
          if (micro >= layout.DataMicroBatches(rank)) {  // fewer than others: pad
            ASSERT_TRUE(e.PadMicroBatch(micro + 1 == passes).ok());
            continue;
          }
          const BatchLayout::Coordinates at = layout.At(rank, micro);
          ASSERT_TRUE(data.Fill(step, at.micro, at.rank, layout.data_world, config.batch,
                                layout.data_accum, x.data(), y.data())
                          .ok());
          if (step == config.nan_step && rank == 1) x[3] = NAN;
          ASSERT_TRUE((*model)->SetBatch(x.data(), y.data(), config.batch).ok());
          auto loss = e.ForwardBackward(micro + 1 == passes);
          ASSERT_TRUE(loss.ok()) << loss.status();
        }
        auto stats = e.Step(kLr);
        ASSERT_TRUE(stats.ok()) << stats.status();
        if (!stats->verdict.finite()) result.ranks[rank].nonfinite_steps.push_back(step);
        // The step's mean loss over its micro-batches, as every rank agreed.
        result.ranks[rank].losses.push_back(stats->verdict.mean_loss);
      }
      const int64_t step_allocations = e.memory().allocations() - allocations_before;
      auto sum = e.ParamsSum();
      ASSERT_TRUE(sum.ok());
      absl::MutexLock lock(&mu);
      result.ranks[rank].step_allocations = step_allocations;
      if (rank == 0) result.params_sum = *sum;
      result.ranks[rank].model_state = e.memory().model_state();
      result.ranks[rank].peak_gathered = e.memory().peak(MemoryCategory::kParamsGathered);
      result.ranks[rank].peak_comm_buffers = e.memory().peak(MemoryCategory::kCommBuffers);
      result.ranks[rank].pool_cached = e.memory().peak(MemoryCategory::kPoolCached);
      result.ranks[rank].largest_unit_bytes = e.largest_unit_elements() * 4;
      result.ranks[rank].gather_bytes = (*gather)->bytes_sent().all_gather;
      ASSERT_TRUE(e.ForEachOwnPiece([&](const ZeroEngine::PieceView& piece) {
                     auto& full = result.params[piece.tensor->name];
                     int64_t start = piece.row_begin * piece.tensor->RowElements();
                     for (int64_t i = 0; i < piece.elements; ++i) full[start + i] = piece.params[i];
                     return absl::OkStatus();
                   }).ok());
    });
  }
  for (auto& t : threads) t.join();
  return result;
}

double Tolerance(const RunConfig& c, const RunResult& reference) {
  testing::TrainingErrorModel m;
  m.layers = c.layers;
  m.sum_length = std::max<int64_t>(c.width, int64_t{c.batch} * c.world * c.grad_accum);
  m.steps = c.steps;
  m.lr = kLr;
  m.param_scale = testing::SmallestTensorScale(reference.params);
  return testing::AdamRelativeParamBound(m);
}

}  // namespace engine_testing
}  // namespace zeroshard
