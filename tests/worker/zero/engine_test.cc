// The ZeRO engine with real Gloo communicators, ranks as threads in one
// process: every stage, prefetch depth and accumulation setting trains the
// MLP to the same parameters as one process on the global batch; memory
// matches the ZeRO formulas.
#include "worker/zero/engine.h"

#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/dtype.h"
#include "common/plan/planner.h"
#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "tests/testing/params.h"
#include "tests/worker/zero/forwarding_backend.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/data/batch_layout.h"
#include "worker/data/regression_data.h"
#include "worker/model/mlp.h"

namespace zeroshard {
namespace {

constexpr double kLr = 1e-2;

struct RunConfig {
  int world = 2;
  int stage = 3;
  int prefetch = 1;
  int grad_accum = 1;
  int batch = 4;  // rows per rank per micro-batch
  int steps = 5;
  int layers = 4;
  int width = 24;
  DType param_dtype = DType::kF32;
  DType reduce_dtype = DType::kF32;
  std::string optimizer = "adam";
  bool shared_gather = true;   // EngineOptions::shared_gather (the communicators use shm)
  std::optional<bool> packed;  // EngineOptions::packed_collectives
  Backend* backend = nullptr;  // EngineOptions::backend (nullptr: the host's)
  // Rank 1's batch of this step holds a NaN (the step must change nothing);
  // -1: none.
  int nan_step = -1;
  // This step's data is left out entirely (no forward, no Step): the run a
  // skipped step must equal; -1: none.
  int drop_step = -1;
  int max_grad_norm = 0;
  // The ranks whose micro-batches the `world` ranks share
  // (worker/data/batch_layout.h: a generation shrunk from data_world under
  // --keep_global_batch); 0: world (each rank its own grad_accum).
  int data_world = 0;
  // hpZ: secondary groups of this many consecutive ranks (EngineOptions::
  // secondary); 0: none.
  int secondary = 0;
  // When set: counts the secondary communicators' plain AllGather calls.
  std::atomic<int>* secondary_all_gathers = nullptr;
};

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

struct RankResult {
  int64_t model_state = 0;
  int64_t peak_gathered = 0;
  int64_t peak_comm_buffers = 0;
  int64_t pool_cached = 0;  // every pool's buffers, as planned at Create
  int64_t largest_unit_bytes = 0;
  int64_t gather_bytes = 0;  // sent by the all-gathers of the whole run
  // Buffers allocated from the first micro-batch to the end of the last
  // step (the step path lends only buffers planned at Create).
  int64_t step_allocations = 0;
  std::vector<double> losses;
  std::vector<int> nonfinite_steps;  // steps whose verdict was not finite
};

struct RunResult {
  testing::Params params;  // the full model after training
  double params_sum = 0;
  std::vector<RankResult> ranks;
  ShardPlan plan;
};

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

// How far a run may be from `reference` when the two differ only in the
// order of their float32 sums (OpenBLAS's kernels block the products
// differently per CPU; W ranks reduce in ring order; micro-batches add partial
// gradients): tests/testing/error_model.h's Adam bound for this MLP, relative
// to each tensor's scale (what MaxRelativeDifference measures). E.g. the
// default config (4 layers, width 24, 16 rows, 5 steps, lr 1e-2, smallest
// tensor scale ~0.2): ~1e-3, where a lost micro-batch, a wrong shard offset or
// a missing average moves parameters by >= lr / scale = 5e-2.
double Tolerance(const RunConfig& c, const RunResult& reference) {
  testing::TrainingErrorModel m;
  m.layers = c.layers;
  m.sum_length = std::max<int64_t>(c.width, int64_t{c.batch} * c.world * c.grad_accum);
  m.steps = c.steps;
  m.lr = kLr;
  m.param_scale = testing::SmallestTensorScale(reference.params);
  return testing::AdamRelativeParamBound(m);
}

// Runs differ by at most Tolerance() * the tensor's scale per element, so the
// sums of all parameters by that over every element, plus the summation's own
// error (the engine and the reference sum in other orders: 2 gamma_P sum|p|).
double SumTolerance(double tolerance, const RunResult& reference) {
  double bound = 0, absolute = 0;
  int64_t count = 0;
  for (const auto& [name, values] : reference.params) {
    double scale = 0;
    for (float v : values) scale = std::max(scale, std::fabs(double{v}));
    for (float v : values) absolute += std::fabs(double{v});
    bound += tolerance * scale * values.size();
    count += values.size();
  }
  return bound + 2 * testing::SumErrorBound(count) * absolute;
}

// The loss of the last step: its forward pass sums in another order (2 gamma_n
// per layer, relative) on parameters already apart by Tolerance() (each layer's
// output moves by that, relative, for weights of the tensor's scale); L layers
// chain both.
double LossTolerance(double tolerance, const RunConfig& c, double loss) {
  const int64_t n = std::max<int64_t>(c.width, int64_t{c.batch} * c.world * c.grad_accum);
  return 2.0 * c.layers * (tolerance + 2 * testing::SumErrorBound(n)) * std::fabs(loss);
}

using testing::ExpectWithinBound;
using testing::MaxRelativeDifference;

RunConfig Single(RunConfig c) {
  // One process on the global batch: W ranks × batch rows.
  c.batch *= c.world;
  c.world = 1;
  c.stage = 0;
  return c;
}

// A step whose loss is NaN on one rank changes nothing on any rank, at
// every stage, clipped or not: the run equals, bit for bit, one that never
// saw that step's data (same rows on the same ranks otherwise, the same
// reductions, Adam's step count untouched).
TEST(EngineTest, ANonFiniteStepChangesNothingAtEveryStage) {
  for (int stage = 0; stage <= 3; ++stage) {
    for (int clip : {0, 1}) {
      RunConfig c;
      c.stage = stage;
      c.max_grad_norm = clip;
      c.nan_step = 2;
      RunResult skipped = Train(c);
      c.nan_step = -1;
      c.drop_step = 2;
      RunResult dropped = Train(c);
      for (int rank = 0; rank < c.world; ++rank) {
        EXPECT_EQ(skipped.ranks[rank].nonfinite_steps, std::vector<int>{2})
            << "stage " << stage << ", rank " << rank;
        EXPECT_TRUE(dropped.ranks[rank].nonfinite_steps.empty());
      }
      for (const auto& [name, values] : skipped.params) {
        for (float v : values) ASSERT_TRUE(std::isfinite(v)) << "stage " << stage << " " << name;
      }
      EXPECT_EQ(skipped.params, dropped.params) << "stage " << stage << ", clip " << clip;
    }
  }
}

TEST(EngineTest, EveryStageMatchesOneProcessOnTheGlobalBatch) {
  RunConfig base;
  RunResult reference = Train(Single(base));
  RunResult stage0;
  for (int stage = 0; stage <= 3; ++stage) {
    RunConfig c = base;
    c.stage = stage;
    RunResult r = Train(c);
    // Among the stages at W = 2: the same products per rank, reductions of two
    // numbers (a + b == b + a exactly), an elementwise optimizer: the same bits.
    if (stage == 0) stage0 = r;
    EXPECT_EQ(r.params, stage0.params) << "stage " << stage << " vs stage 0";
    const double tolerance = Tolerance(c, reference);
    ExpectWithinBound(MaxRelativeDifference(r.params, reference.params), tolerance,
                      absl::StrCat("stage ", stage));
    EXPECT_NEAR(r.params_sum, reference.params_sum, SumTolerance(tolerance, reference));
    EXPECT_NEAR(r.ranks[0].losses.back(), reference.ranks[0].losses.back(),
                LossTolerance(tolerance, c, reference.ranks[0].losses.back()));
  }
  // Training did something.
  EXPECT_LT(reference.ranks[0].losses.back(), reference.ranks[0].losses.front());
}

TEST(EngineTest, PrefetchDepthDoesNotChangeTheResult) {
  RunConfig base;
  base.world = 3;
  RunResult reference = Train(Single(base));
  RunResult depth0;
  for (int prefetch : {0, 1, 2}) {
    RunConfig c = base;
    c.prefetch = prefetch;
    RunResult r = Train(c);
    ExpectWithinBound(MaxRelativeDifference(r.params, reference.params), Tolerance(c, reference),
                      absl::StrCat("prefetch ", prefetch));
    // Prefetch moves when a gather runs, not what is summed or in which order.
    if (prefetch == 0) depth0 = r;
    EXPECT_EQ(r.params, depth0.params) << "prefetch " << prefetch << " vs 0";
  }
}

// Stage 3's gathers into host-shared regions (read in place) only move
// bytes: the same bits as gathers into each rank's own buffers, at every
// prefetch depth, with accumulation, and at 3 ranks.
TEST(EngineTest, SharedGathersGiveTheSameBits) {
  for (int prefetch : {0, 1, 2}) {
    for (int world : {2, 3}) {
      RunConfig c;
      c.world = world;
      c.prefetch = prefetch;
      c.grad_accum = prefetch == 1 ? 2 : 1;
      RunConfig own = c;
      own.shared_gather = false;
      RunResult shared = Train(c);
      RunResult reference = Train(own);
      const std::string label = absl::StrCat("prefetch ", prefetch, " world ", world);
      EXPECT_EQ(shared.params, reference.params) << label;
      EXPECT_EQ(shared.ranks[0].losses, reference.ranks[0].losses) << label;
      for (int rank = 0; rank < world; ++rank) {
        // The shared regions exist (and count as comm buffers); the window
        // is bounded as before.
        EXPECT_GE(shared.ranks[rank].peak_comm_buffers,
                  (prefetch + 2) * shared.ranks[rank].largest_unit_bytes)
            << label;
        EXPECT_LT(reference.ranks[rank].peak_comm_buffers,
                  (prefetch + 2) * reference.ranks[rank].largest_unit_bytes)
            << label;
        EXPECT_LE(shared.ranks[rank].peak_gathered,
                  (1 + prefetch) * shared.ranks[rank].largest_unit_bytes)
            << label;
        EXPECT_EQ(shared.ranks[rank].model_state, reference.ranks[rank].model_state) << label;
      }
    }
  }
}

// The host backend counting UnpackRaw calls: stages 1-2's packed
// parameter sync.
class CountingUnpackRawBackend : public testing::ForwardingBackend {
 public:
  void UnpackRaw(const PackedLayout& layout, const void* packed, DType dtype, void* full) override {
    ++calls;
    Backend::UnpackRaw(layout, packed, dtype, full);
  }
  std::atomic<int> calls{0};
};

// Packed collectives (EngineOptions::packed_collectives: the device path,
// here on the CPU) only move bytes another way: the plain AllGather /
// ReduceScatter over packed chunks sum each element over the same ranks in
// the same order as the block collectives, and Pack / Unpack convert each
// element as the block path does, so the runs are equal bit for bit, at
// stages 1-3, f32 and bf16 (parameters and reductions), 1-3 ranks (the plan
// pads chunks to 4 elements: padding runs), prefetch and accumulation; int8
// reductions keep their own path (the same bits trivially, and no buffer
// planned for a path not taken). Stages 1-2's parameter sync goes packed
// too: one UnpackRaw per unit, rank and step into the replicated
// parameters (stage 3 has none).
TEST(EngineTest, PackedCollectivesGiveTheSameBits) {
  for (int stage : {1, 2, 3}) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8}) {
      for (int world : {1, 2, 3}) {
        RunConfig c;
        c.stage = stage;
        c.world = world;
        c.param_dtype = dtype == DType::kI8 ? DType::kF32 : dtype;
        c.reduce_dtype = dtype;
        c.shared_gather = false;
        c.prefetch = world == 3 ? 2 : 1;
        c.grad_accum = world == 2 ? 2 : 1;
        c.steps = 3;
        CountingUnpackRawBackend counting;
        RunConfig packed = c;
        packed.packed = true;
        packed.backend = &counting;
        RunConfig blocks = c;
        blocks.packed = false;
        RunResult p = Train(packed);
        RunResult b = Train(blocks);
        const std::string label =
            absl::StrCat("stage ", stage, " ", DTypeName(dtype), " world ", world);
        const int syncs = stage < 3 ? c.steps * world * static_cast<int>(p.plan.units.size()) : 0;
        EXPECT_EQ(counting.calls.load(), syncs) << label;
        EXPECT_EQ(p.params, b.params) << label;
        EXPECT_EQ(p.ranks[0].losses, b.ranks[0].losses) << label;
        for (int rank = 0; rank < world; ++rank) {
          EXPECT_EQ(p.ranks[rank].step_allocations, 0) << label << " rank " << rank;
        }
        // Training happened (the runs are not equal by doing nothing).
        EXPECT_LT(p.ranks[0].losses.back(), p.ranks[0].losses.front()) << label;
      }
    }
  }
}

// hpZ with packed collectives: the backward's gathers from the secondary
// shards are one plain AllGather straight into the unit, whose slices are
// consecutive in flat order. Secondary groups of 3 in a shard group of 6
// and width 25, so that a unit's 650 elements per layer do not split
// evenly: the last member's slice is shorter and the gather writes its tail
// past the unit's elements, into the buffer's room for it. The same bits
// as the block collectives, and no step allocates.
TEST(EngineTest, PackedSecondaryGathersGiveTheSameBits) {
  RunConfig c;
  c.world = 6;
  c.secondary = 3;
  c.stage = 3;
  c.width = 25;
  c.layers = 5;
  c.steps = 5;
  c.shared_gather = false;
  std::atomic<int> plain_packed{0}, plain_blocks{0};
  RunConfig packed = c;
  packed.packed = true;
  packed.secondary_all_gathers = &plain_packed;
  RunConfig blocks = c;
  blocks.packed = false;
  blocks.secondary_all_gathers = &plain_blocks;
  const RunResult p = Train(packed);
  const RunResult b = Train(blocks);
  EXPECT_EQ(p.params, b.params);
  EXPECT_EQ(p.ranks[0].losses, b.ranks[0].losses);
  // The backward gathered from the secondary shards, and plainly only when
  // packed.
  EXPECT_GT(plain_packed.load(), 0);
  EXPECT_EQ(plain_blocks.load(), 0);
  for (int rank = 0; rank < c.world; ++rank) {
    EXPECT_EQ(p.ranks[rank].step_allocations, 0) << "rank " << rank;
  }
  // Training happened (the runs are not equal by doing nothing): the
  // parameters moved past the first step's. (The losses of these few noisy
  // steps need not fall.)
  RunConfig one_step = packed;
  one_step.steps = 1;
  EXPECT_NE(Train(one_step).params, p.params);
}

// The host backend with a one-pass UnpackThrough (as the CUDA backend has:
// each value rounded through `through` as it is unpacked), counting calls.
class OnePassUnpackBackend : public testing::ForwardingBackend {
 public:
  bool UnpackThrough(const PackedLayout& layout, const float* packed, DType through,
                     float* full) override {
    ++calls;
    for (size_t i = 0; i < layout.runs.size(); ++i) {
      const PackedRun& run = layout.runs[i];
      if (run.full_offset < 0) continue;
      for (int64_t k = 0; k < layout.RunLength(i); ++k) {
        const float x = packed[run.packed_begin + k];
        full[run.full_offset + k] = through == DType::kBF16 ? BF16ToFloat(FloatToBF16(x)) : x;
      }
    }
    return true;
  }
  std::atomic<int> calls{0};
};

// Stage 3 over a gather group of one with bf16 parameters: a backend that
// gathers in one pass (UnpackThrough) trains to the same bits as the
// host's narrow-then-unpack.
TEST(EngineTest, GroupOfOneGathersInOnePassGiveTheSameBits) {
  RunConfig c;
  c.world = 1;
  c.stage = 3;
  c.param_dtype = DType::kBF16;
  c.reduce_dtype = DType::kBF16;
  c.shared_gather = false;
  c.packed = true;
  c.steps = 3;
  OnePassUnpackBackend one_pass;
  RunConfig fused = c;
  fused.backend = &one_pass;
  RunResult f = Train(fused);
  RunResult two = Train(c);
  EXPECT_GT(one_pass.calls.load(), 0);
  EXPECT_EQ(f.params, two.params);
  EXPECT_EQ(f.ranks[0].losses, two.ranks[0].losses);
  EXPECT_LT(f.ranks[0].losses.back(), f.ranks[0].losses.front());
}

// The host backend counting Pack calls: the way of a packed reduction's
// gradient into its wire buffer or shard.
class CountingPackBackend : public testing::ForwardingBackend {
 public:
  void Pack(const PackedLayout& layout, const float* full, void* packed, DType to) override {
    ++calls;
    Backend::Pack(layout, full, packed, to);
  }
  std::atomic<int> calls{0};
};

// Stages 2-3 over a group of one, packed, reducing in f32: the backward
// writes the gradient shard itself (each tensor at its place in the chunk),
// so no reduction packs or copies anything and no step allocates. With one
// micro-batch per step the run equals the block path's bit for bit (its
// reduce-scatter over one rank copies the same gradient into the shard).
// With two, the second micro-batch adds inside the model's backward, as
// stage 0 does, where the block path adds after the copy: the same sum,
// rounded in another place, so within the accumulation tolerance.
TEST(EngineTest, GroupOfOneBackwardWritesTheGradientShard) {
  for (int stage : {2, 3}) {
    for (int accum : {1, 2}) {
      RunConfig c;
      c.world = 1;
      c.stage = stage;
      c.grad_accum = accum;
      c.shared_gather = false;
      c.steps = 3;
      c.max_grad_norm = 1;
      CountingPackBackend counting;
      RunConfig into_shard = c;
      into_shard.packed = true;
      into_shard.backend = &counting;
      RunConfig blocks = c;
      blocks.packed = false;
      const RunResult a = Train(into_shard);
      const RunResult b = Train(blocks);
      const std::string label = absl::StrCat("stage ", stage, ", ", accum, " micro-batches");
      EXPECT_EQ(counting.calls.load(), 0) << label << ": a reduction packed its gradient";
      EXPECT_EQ(a.ranks[0].step_allocations, 0) << label;
      // Stage 3 plans nothing for the reductions or a wire (f32 gathers
      // unpack from the shard): its pools hold the gathered units at the
      // window's peak and no more.
      if (stage == 3) {
        EXPECT_EQ(a.ranks[0].pool_cached, a.ranks[0].peak_gathered) << label;
      }
      EXPECT_LT(a.ranks[0].losses.back(), a.ranks[0].losses.front()) << label;
      if (accum == 1) {
        EXPECT_EQ(a.params, b.params) << label;
        EXPECT_EQ(a.ranks[0].losses, b.ranks[0].losses) << label;
      } else {
        ExpectWithinBound(MaxRelativeDifference(a.params, b.params), Tolerance(c, b), label);
      }
    }
  }
  // bf16 reductions keep the packed path (the narrowing is the reduction's
  // rounding): the backend packs.
  RunConfig bf16;
  bf16.world = 1;
  bf16.reduce_dtype = DType::kBF16;
  bf16.shared_gather = false;
  bf16.packed = true;
  bf16.steps = 2;
  CountingPackBackend counting;
  bf16.backend = &counting;
  Train(bf16);
  EXPECT_GT(counting.calls.load(), 0);
}

TEST(EngineTest, GradientAccumulationEqualsADoubledBatch) {
  RunConfig accum;
  accum.grad_accum = 2;
  RunConfig doubled;
  doubled.batch = accum.batch * 2;
  // Same rows: with accumulation rank r takes micro-batches of `batch` rows,
  // so compare with one process on the same global rows.
  for (int stage : {0, 1, 2, 3}) {
    accum.stage = stage;
    RunResult a = Train(accum);
    RunConfig single = Single(accum);
    single.grad_accum = 2;
    RunResult s = Train(single);
    ExpectWithinBound(MaxRelativeDifference(a.params, s.params), Tolerance(accum, s),
                      absl::StrCat("accumulation, stage ", stage));
  }
  // And accumulation of two micro-batches equals one micro-batch of twice the
  // rows when they are the same rows (W = 1).
  RunConfig one;
  one.world = 1;
  one.stage = 3;
  one.grad_accum = 2;
  RunConfig twice = one;
  twice.grad_accum = 1;
  twice.batch = one.batch * 2;
  RunResult reference = Train(twice);
  ExpectWithinBound(MaxRelativeDifference(Train(one).params, reference.params),
                    Tolerance(one, reference), "two micro-batches vs one of twice the rows");
}

TEST(EngineTest, ModelStateMatchesTheZeroFormulasAndTheWindowIsBounded) {
  RunConfig c;
  c.world = 2;
  c.layers = 6;
  c.width = 32;
  for (int stage = 0; stage <= 3; ++stage) {
    c.stage = stage;
    c.prefetch = 1;
    RunResult r = Train(c);
    int64_t psi = 0, chunks = 0;
    for (const ShardUnit& u : r.plan.units) {
      for (const TensorSpec& t : u.tensors) psi += t.Elements();
      chunks += u.chunk_elements;
    }
    const int64_t w = c.world;
    // fp32: params 4, grads 4, Adam moments 8 bytes per element; sharded
    // parts hold this rank's chunks (Ψ/W plus the plan's padding).
    int64_t expected = 0;
    switch (stage) {
      case 0:
        expected = 16 * psi;
        break;
      case 1:
        expected = 8 * psi + 8 * chunks;
        break;
      case 2:
        expected = 4 * psi + 12 * chunks;
        break;
      case 3:
        expected = 16 * chunks;
        break;
    }
    for (int rank = 0; rank < c.world; ++rank) {
      EXPECT_EQ(r.ranks[rank].model_state, expected) << "stage " << stage;
      double padding = double(chunks * w) / psi - 1;
      EXPECT_LE(std::fabs(double(r.ranks[rank].model_state) - 16.0 * psi / (stage ? w : 1) -
                          (stage == 1 ? 8.0 * psi * (1 - 1.0 / w) : 0) -
                          (stage == 2 ? 4.0 * psi * (1 - 1.0 / w) : 0)),
                16.0 * psi * padding + 1)
          << "stage " << stage;
    }
    if (stage == 3) {
      std::vector<int64_t> gather_bytes;
      for (int prefetch : {0, 1, 2}) {
        c.prefetch = prefetch;
        RunResult p = Train(c);
        for (const RankResult& rr : p.ranks) {
          EXPECT_GT(rr.peak_gathered, 0);
          EXPECT_LE(rr.peak_gathered, (1 + prefetch) * rr.largest_unit_bytes)
              << "prefetch " << prefetch;
        }
        gather_bytes.push_back(p.ranks[0].gather_bytes);
      }
      // The last `prefetch` forward units are kept for the backward pass
      // instead of gathered again: deeper prefetch, fewer gathers.
      EXPECT_LT(gather_bytes[1], gather_bytes[0]);
      EXPECT_LT(gather_bytes[2], gather_bytes[1]);
    }
  }
}

TEST(EngineTest, Bf16ParamsAndReductionsStayCloseToF32) {
  RunConfig c;
  c.stage = 3;
  RunResult f32 = Train(c);
  c.param_dtype = DType::kBF16;
  c.reduce_dtype = DType::kBF16;
  RunResult bf16 = Train(c);
  // bf16 has 8 bits of mantissa: loose agreement, and training still works.
  EXPECT_NEAR(bf16.ranks[0].losses.back(), f32.ranks[0].losses.back(),
              0.05 * f32.ranks[0].losses.back() + 1e-3);
  for (int stage : {0, 1, 2}) {
    c.stage = stage;
    RunResult r = Train(c);
    EXPECT_NEAR(r.ranks[0].losses.back(), bf16.ranks[0].losses.back(),
                0.05 * bf16.ranks[0].losses.back() + 1e-3);
  }
}

TEST(EngineTest, SgdAndAdamWTrainToo) {
  for (std::string optimizer : {"sgd", "adamw"}) {
    RunConfig c;
    c.optimizer = optimizer;
    RunResult reference = Train(Single(c));
    c.stage = 3;
    // SGD's update lr * g has no Adam conditioning: the same bound holds a
    // fortiori (the gradients of this normalised loss are below 1).
    ExpectWithinBound(MaxRelativeDifference(Train(c).params, reference.params),
                      Tolerance(c, reference), optimizer);
  }
}

// Every buffer of the step is planned at Create (worker/zero/step_buffers.h):
// forward, backward, reductions and updates lend them, at every stage, in
// f32 and bf16, with and without shared gathers, prefetch and accumulation.
TEST(EngineTest, TheStepPathAllocatesNothing) {
  for (int stage = 0; stage <= 3; ++stage) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (bool shared : {true, false}) {
        if (stage < 3 && !shared) continue;  // shared gathers are stage 3's
        RunConfig c;
        c.stage = stage;
        c.param_dtype = dtype;
        c.reduce_dtype = dtype;
        c.shared_gather = shared;
        c.grad_accum = 2;
        c.prefetch = stage == 3 ? 2 : 1;
        c.steps = 3;
        RunResult r = Train(c);
        for (int rank = 0; rank < c.world; ++rank) {
          EXPECT_EQ(r.ranks[rank].step_allocations, 0)
              << "stage " << stage << " " << DTypeName(dtype) << (shared ? " shared" : "")
              << " rank " << rank;
          EXPECT_EQ(r.ranks[rank].losses.size(), 3u);
        }
      }
    }
    // Padding passes (an uneven share of a step: rank 1 of 2 trains one of
    // the 3 micro-batches of a 3-rank step and pads) lend the same pools.
    RunConfig c;
    c.stage = stage;
    c.data_world = 3;
    c.prefetch = stage == 3 ? 2 : 1;
    c.steps = 3;
    RunResult r = Train(c);
    for (int rank = 0; rank < c.world; ++rank) {
      EXPECT_EQ(r.ranks[rank].step_allocations, 0) << "stage " << stage << " uneven, rank " << rank;
      EXPECT_EQ(r.ranks[rank].losses.size(), 3u);
    }
  }
}

// --keep_global_batch after an uneven shrink (worker/recovery/global_batch.h):
// 3 ranks share a step of 4 micro-batches (rank 0 trains two, ranks 1 and 2
// one and pad), the reductions sum and the step divides by 4. At every stage
// that trains the MLP as one process on the same 16 rows a step does, within
// the same error model as the even runs (the step's rows: sum_length 16).
// The model is loose (correct runs measure ~1e-5 of it) and Adam's update is
// nearly scale-free, so a wrong divisor shows only weakly here: dividing by
// 3 ranks x 2 passes instead of 4 came out at 2.6x the bound (measured once,
// 2026-11-29); recovery_test's SGD case sees the step's scaling in full. The
// loss of the first step
// (the same parameters in both runs) is the mean over the 4 micro-batches,
// not over the 3 ranks: within two layers' forward rounding (LossTolerance
// with parameters not yet apart) of the single run's 16-row mean, where the
// ranks' unweighted mean is off by (l1 + l2 - l0 - l3) / 12 of the
// micro-batch losses l_k.
TEST(EngineTest, AnUnevenShareOfTheStepEqualsOneProcessOnTheGlobalBatch) {
  RunConfig even;
  even.world = 4;  // the layout's, for the reference and the error model
  RunResult reference = Train(Single(even));
  for (int stage = 0; stage <= 3; ++stage) {
    RunConfig c = even;
    c.world = 3;
    c.data_world = 4;
    c.stage = stage;
    RunResult r = Train(c);
    const std::string label = absl::StrCat("stage ", stage);
    ExpectWithinBound(MaxRelativeDifference(r.params, reference.params), Tolerance(even, reference),
                      label);
    const double first = reference.ranks[0].losses.front();
    for (int rank = 0; rank < c.world; ++rank) {
      EXPECT_NEAR(r.ranks[rank].losses.front(), first, LossTolerance(0, even, first)) << label;
      EXPECT_EQ(r.ranks[rank].losses, r.ranks[0].losses) << label << ": ranks agree";
    }
  }
}

// A plan whose pieces do not fit their chunk, or leave part of a unit
// uncovered, is refused at Create naming the unit: the step path's copies
// and gathers trust those bounds.
TEST(EngineTest, APlanThatDoesNotFitItsChunksIsRefusedAtCreate) {
  MlpConfig mlp{2, 8, "gelu"};
  auto model = MlpModel::Create(mlp);
  ASSERT_TRUE(model.ok());
  auto plan = Plan((*model)->Spec(), /*world_size=*/1, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  InMemoryKvStore store;
  auto gather = CreateHostCommunicator(&store, 0, 1, "gather");
  auto reduce = CreateHostCommunicator(&store, 0, 1, "reduce");
  auto aux = CreateHostCommunicator(&store, 0, 1, "aux");
  ASSERT_TRUE(gather.ok() && reduce.ok() && aux.ok());
  auto create = [&](const ShardPlan& p) {
    return ZeroEngine::Create(model->get(), p, gather->get(), reduce->get(), aux->get(),
                              EngineOptions());
  };
  ASSERT_TRUE(create(*plan).ok());
  ShardPlan outside = *plan;
  outside.units[0].pieces[0].offset = outside.units[0].chunk_elements;
  auto refused = create(outside);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("'" + plan->units[0].name + "'"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("does not fit a chunk"), std::string::npos)
      << refused.status();
  ShardPlan gap = *plan;
  gap.units[0].pieces.pop_back();
  refused = create(gap);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("gap or an overlap"), std::string::npos)
      << refused.status();
}

}  // namespace
}  // namespace zeroshard
