#include "worker/zero/step_numerics.h"

#include <cfloat>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"

namespace zeroshard {

const char* NonFiniteQuantityName(NonFiniteQuantity quantity) {
  switch (quantity) {
    case NonFiniteQuantity::kNone:
      return "nothing";
    case NonFiniteQuantity::kLoss:
      return "loss";
    case NonFiniteQuantity::kGradNorm:
      return "gradient norm";
  }
  return "?";
}

bool FiniteInF32(double v) { return std::isfinite(v) && std::fabs(v) <= FLT_MAX; }

std::string StepVerdict::Describe() const {
  if (loss_spike) {
    return absl::StrFormat(
        "the loss %g is %.1f standard deviations above the mean %g of the last %d steps (sd %g)",
        mean_loss, zscore, window_mean, window_steps, window_sd);
  }
  if (finite()) return "finite";
  const bool beyond = std::isfinite(value);
  // NaN's sign bit means nothing to a reader: "nan", never "-nan".
  const std::string shown = std::isnan(value) ? "nan"
                            : beyond          ? absl::StrFormat("%g", value)
                                              : (value > 0 ? "inf" : "-inf");
  return absl::StrFormat("the %s is %s%s on rank %d", NonFiniteQuantityName(nonfinite), shown,
                         beyond ? " (beyond float32's range)" : "", first_rank);
}

std::vector<ReplicaMismatch> FindReplicaMismatches(const std::vector<uint64_t>& checksums,
                                                   int group_size) {
  std::vector<ReplicaMismatch> out;
  const int world = static_cast<int>(checksums.size());
  if (group_size < 1) return out;
  for (int member = 0; member < group_size && member < world; ++member) {
    ReplicaMismatch set;
    set.member = member;
    bool differ = false;
    for (int r = member; r < world; r += group_size) {
      set.ranks.push_back(r);
      set.checksums.push_back(checksums[r]);
      differ = differ || checksums[r] != checksums[member];
    }
    if (differ) out.push_back(std::move(set));
  }
  return out;
}

namespace {

// DiLoCo: each group's norm from its G consecutive ranks' squares, summed in
// rank order: the own group's, and the first group's that is not finite
// (when one is not).
struct GroupNorms {
  double own = 0;
  double first_nonfinite = 0;
  bool all_finite = true;
};

GroupNorms JudgeGroupNorms(const std::vector<RankNumerics>& ranks, int group_size, int own_rank) {
  GroupNorms out;
  const int world = static_cast<int>(ranks.size());
  for (int begin = 0; begin < world; begin += group_size) {
    double squares = 0;
    for (int r = begin; r < begin + group_size && r < world; ++r) squares += ranks[r].grad_squares;
    const double norm = std::sqrt(squares);
    if (own_rank >= begin && own_rank < begin + group_size) out.own = norm;
    if (out.all_finite && !FiniteInF32(norm)) {
      out.all_finite = false;
      out.first_nonfinite = norm;
    }
  }
  return out;
}

}  // namespace

StepVerdict JudgeStep(const std::vector<RankNumerics>& ranks, bool shards_summed, int group_size,
                      int own_rank, bool group_norms) {
  StepVerdict verdict;
  const int world = static_cast<int>(ranks.size());
  if (world == 0) return verdict;
  verdict.replicas_compared = true;
  std::vector<uint64_t> checksums;
  for (const RankNumerics& r : ranks) {
    verdict.replicas_compared = verdict.replicas_compared && r.has_checksum != 0;
    checksums.push_back(r.shard_checksum);
  }
  if (verdict.replicas_compared) {
    verdict.checksums = checksums;
    verdict.replica_mismatches = FindReplicaMismatches(checksums, group_size);
  }
  // In rank order, as MeanOverRanks always added them: the same bits as
  // before the verdict shared this collective.
  double loss_sum = 0, squares_sum = 0, weighted_sum = 0, micro_batches = 0;
  bool equal_counts = true;
  for (const RankNumerics& r : ranks) {
    loss_sum += r.loss;
    squares_sum += r.grad_squares;
    weighted_sum += r.loss * r.micro_batches;
    micro_batches += r.micro_batches;
    equal_counts = equal_counts && r.micro_batches == ranks[0].micro_batches;
  }
  // Ranks with fewer micro-batches (an uneven shrink under
  // --keep_global_batch) weigh less: the mean over the step's micro-batches.
  verdict.mean_loss =
      equal_counts || micro_batches <= 0 ? loss_sum / world : weighted_sum / micro_batches;
  // Every shard is held by W / G replicas (bitwise equal after their
  // all-reduce): the sum over ranks counts it that often.
  const double squares =
      shards_summed ? squares_sum / world * group_size : ranks[own_rank].grad_squares;
  verdict.grad_norm = std::sqrt(squares);
  // The norm judged below: one that is not finite in any group.
  double judged = verdict.grad_norm;
  if (group_norms && shards_summed && group_size >= 1) {
    const GroupNorms norms = JudgeGroupNorms(ranks, group_size, own_rank);
    verdict.grad_norm = norms.own;
    judged = norms.all_finite ? norms.own : norms.first_nonfinite;
  }
  for (int r = 0; r < world; ++r) {
    if (!FiniteInF32(ranks[r].loss)) {
      verdict.nonfinite = NonFiniteQuantity::kLoss;
      verdict.first_rank = r;
      verdict.value = ranks[r].loss;
      return verdict;
    }
  }
  if (FiniteInF32(judged)) return verdict;
  verdict.nonfinite = NonFiniteQuantity::kGradNorm;
  verdict.value = judged;
  // The first rank whose own part overflowed; when none did alone (finite
  // parts whose sum passed FLT_MAX), rank 0 stands for all of them.
  verdict.first_rank = 0;
  for (int r = 0; r < world; ++r) {
    if (!FiniteInF32(std::sqrt(ranks[r].grad_squares))) {
      verdict.first_rank = r;
      break;
    }
  }
  return verdict;
}

}  // namespace zeroshard
