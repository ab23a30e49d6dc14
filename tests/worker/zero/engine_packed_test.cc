// The ZeRO engine on packed collectives (EngineOptions::packed_collectives:
// the device path, here on the CPU's host backend and Gloo): the same bits
// as the block collectives at every stage, stages 1-2's parameter sync and
// hpZ's secondary gathers included, and over a group of one the shortcuts
// (one-pass unpacking, the backward writing the gradient shard itself).
// Harness: engine_train.h.
#include <atomic>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/testing/error_model.h"
#include "tests/testing/params.h"
#include "tests/worker/zero/engine_train.h"
#include "tests/worker/zero/forwarding_backend.h"
#include "worker/zero/backend.h"
#include "worker/zero/packed_layout.h"

namespace zeroshard {
namespace {

using engine_testing::RunConfig;
using engine_testing::RunResult;
using engine_testing::Tolerance;
using engine_testing::Train;
using testing::ExpectWithinBound;
using testing::MaxRelativeDifference;

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

// `c` trained through packed collectives (on `packed_backend`, the host's
// if null), then through the block collectives: {packed, blocks}.
std::pair<RunResult, RunResult> TrainPackedAndBlocks(const RunConfig& c,
                                                     Backend* packed_backend) {
  RunConfig packed = c;
  packed.packed = true;
  packed.backend = packed_backend;
  RunConfig blocks = c;
  blocks.packed = false;
  RunResult p = Train(packed);
  return {std::move(p), Train(blocks)};
}

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
        const auto [p, b] = TrainPackedAndBlocks(c, &counting);
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
      const auto [a, b] = TrainPackedAndBlocks(c, &counting);
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

}  // namespace
}  // namespace zeroshard
