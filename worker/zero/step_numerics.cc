#include "worker/zero/step_numerics.h"

#include <cfloat>
#include <cmath>
#include <string>
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
  if (finite()) return "finite";
  const bool beyond = std::isfinite(value);
  return absl::StrFormat("the %s is %s%s on rank %d", NonFiniteQuantityName(nonfinite),
                         beyond ? absl::StrFormat("%g", value) : absl::StrFormat("%f", value),
                         beyond ? " (beyond float32's range)" : "", first_rank);
}

StepVerdict JudgeStep(const std::vector<RankNumerics>& ranks, bool shards_summed, int group_size,
                      int own_rank) {
  StepVerdict verdict;
  const int world = static_cast<int>(ranks.size());
  if (world == 0) return verdict;
  // In rank order, as MeanOverRanks always added them: the same bits as
  // before the verdict shared this collective.
  double loss_sum = 0, squares_sum = 0;
  for (const RankNumerics& r : ranks) {
    loss_sum += r.loss;
    squares_sum += r.grad_squares;
  }
  verdict.mean_loss = loss_sum / world;
  // Every shard is held by W / G replicas (bitwise equal after their
  // all-reduce): the sum over ranks counts it that often.
  const double squares =
      shards_summed ? squares_sum / world * group_size : ranks[own_rank].grad_squares;
  verdict.grad_norm = std::sqrt(squares);
  for (int r = 0; r < world; ++r) {
    if (!FiniteInF32(ranks[r].loss)) {
      verdict.nonfinite = NonFiniteQuantity::kLoss;
      verdict.first_rank = r;
      verdict.value = ranks[r].loss;
      return verdict;
    }
  }
  if (FiniteInF32(verdict.grad_norm)) return verdict;
  verdict.nonfinite = NonFiniteQuantity::kGradNorm;
  verdict.value = verdict.grad_norm;
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
