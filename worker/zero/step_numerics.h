// The step's numbers every rank agrees on before any parameter changes: the
// mean loss, the global gradient norm, and whether both are finite. The
// engine all-gathers one record per rank (StepNumerics::Local) on the
// collective the step already ran for the gradient norm; JudgeStep is the
// pure function every rank applies to the gathered records, so every rank
// reaches the same verdict from the same bits.
//
// "Finite" means representable in float32 (|v| <= FLT_MAX): the model and
// the optimizer's state are f32, and a loss of 1e60 (an MSE over rows
// holding 1e30, summed in double) or a gradient norm above FLT_MAX
// overflows them as surely as an Inf does (Adam's v = g^2 becomes Inf and
// freezes the parameter; an unclipped update overflows).
#ifndef ZEROSHARD_WORKER_ZERO_STEP_NUMERICS_H_
#define ZEROSHARD_WORKER_ZERO_STEP_NUMERICS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {

// What one rank contributes: its mean loss over its micro-batches, how many
// it trained, and the sum of squares of the gradient it holds (its shard at
// stages 1-3, the full all-reduced gradient at stage 0). Five 8-byte fields:
// the all-gather moves them as ten f32 words.
struct RankNumerics {
  double loss = 0;
  double grad_squares = 0;
  // XXH3 of the rank's master shard after the previous step's update
  // (--replica_check_every), valid when has_checksum is 1.
  uint64_t shard_checksum = 0;
  uint64_t has_checksum = 0;
  // Micro-batches with data this step (a double: the record is all 8-byte
  // words). Ranks differ after an uneven shrink under --keep_global_batch.
  double micro_batches = 0;
};

// A replica set whose master shards differ (HSDP: the ranks r with the same
// r mod G hold one member's shard, bitwise equal by construction): the
// member and its ranks with their checksums, in rank order.
struct ReplicaMismatch {
  int member = 0;
  std::vector<int> ranks;
  std::vector<uint64_t> checksums;
};

// The replica sets of `checksums` (by rank) under groups of `group_size`
// ranks whose checksums are not all equal.
std::vector<ReplicaMismatch> FindReplicaMismatches(const std::vector<uint64_t>& checksums,
                                                   int group_size);

// Which quantity made a step non-finite.
enum class NonFiniteQuantity { kNone, kLoss, kGradNorm };
const char* NonFiniteQuantityName(NonFiniteQuantity quantity);  // "loss", "gradient norm"

struct StepVerdict {
  // The mean over the step's micro-batches: the sum of the ranks' losses in
  // rank order / W when every rank trained as many micro-batches, else each
  // rank's weighted by its count (sum of loss x count / sum of counts).
  double mean_loss = 0;
  double grad_norm = 0;  // global, before clipping
  NonFiniteQuantity nonfinite = NonFiniteQuantity::kNone;
  // The lowest rank whose own record was non-finite (its loss, or its
  // gradient's squares); -1 when the step is finite.
  int first_rank = -1;
  double value = 0;  // the non-finite value that rank saw (NaN, Inf, or out of f32 range)

  // Every rank sent its shard checksum and these replica sets disagree
  // (empty when they agree or nothing was compared). `checksums`: every
  // rank's, by rank, when compared.
  bool replicas_compared = false;
  std::vector<ReplicaMismatch> replica_mismatches;
  std::vector<uint64_t> checksums;

  // A finite mean loss more than --loss_spike_zscore standard deviations
  // above the recent window (worker/loss_spike.h sets these before the
  // engine applies the step). `zscore`: how many; `window_mean`,
  // `window_sd` and `window_steps`: the window it was measured against.
  bool loss_spike = false;
  double zscore = 0;
  double window_mean = 0;
  double window_sd = 0;
  int window_steps = 0;

  bool finite() const { return nonfinite == NonFiniteQuantity::kNone; }
  // A step no parameter may take: not finite, or a loss spike.
  bool bad() const { return !finite() || loss_spike; }
  // Whether the engine applies the step: not bad, and no replica disagrees.
  bool apply() const { return !bad() && replica_mismatches.empty(); }
  // "the loss is nan on rank 1", "the loss 3.2 is 41.0 standard deviations
  // above ...", for people.
  std::string Describe() const;
};

// Whether `v` is a finite value representable in float32.
bool FiniteInF32(double v);

// The verdict from every rank's record (by rank). `shards_summed`: the
// records hold gradient shards (stages 1-3), so the global squared norm is
// their sum over ranks divided by the W / group_size replicas that each hold
// the same shard; otherwise (stage 0) every rank holds the whole reduced
// gradient and `own_rank`'s squares are the norm's. A loss is checked before
// the norm: a bad batch shows in its rank's loss, while the norm only says
// that some gradient overflowed.
// `group_norms` (DiLoCo, shards_summed): the shard groups (group_size
// consecutive ranks each) hold different gradients, so the norm is
// `own_rank`'s group's: the sum of its G ranks' squares. The step is finite
// only when every group's norm is, so every rank still reaches one verdict.
StepVerdict JudgeStep(const std::vector<RankNumerics>& ranks, bool shards_summed, int group_size,
                      int own_rank, bool group_norms = false);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_STEP_NUMERICS_H_
