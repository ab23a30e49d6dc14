// ZeroEngine's small collectives over ranks (engine.h): one value per rank,
// all-gathered on the aux communicator, for the worker's summaries and checks.
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/zero/engine.h"

namespace zeroshard {

absl::StatusOr<std::vector<double>> ZeroEngine::GatherOverRanks(double value, const char* what) {
  // Doubles travel as raw bytes: two f32 words each.
  std::vector<double> all(world_);
  absl::Status s =
      aux_comm_->AllGather(&value, all.data(), 2, DType::kF32, options_.collective_timeout);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("all_gather of ", what, " (rank ", rank_, " of ",
                                               world_, "): ", s.message()));
  }
  return all;
}

absl::StatusOr<double> ZeroEngine::MeanOverRanks(double value, const char* what) {
  absl::StatusOr<std::vector<double>> all = GatherOverRanks(value, what);
  if (!all.ok()) return all.status();
  double sum = 0;
  for (double v : *all) sum += v;
  return sum / world_;
}

absl::StatusOr<double> ZeroEngine::SumOverStepRanks(double value, const char* what) {
  Communicator* comm = numerics_comm_;
  std::vector<double> all(comm->world_size());
  absl::Status s = comm->AllGather(&value, all.data(), 2, DType::kF32, options_.collective_timeout);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("all_gather of ", what, " (rank ", comm->rank(),
                                               " of ", comm->world_size(), "): ", s.message()));
  }
  double sum = 0;
  for (double v : all) sum += v;
  return sum;
}

absl::StatusOr<double> ZeroEngine::ParamsSum() {
  double local = 0;
  absl::Status s = ForEachOwnPiece([&](const PieceView& piece) {
    for (int64_t i = 0; i < piece.elements; ++i) local += piece.params[i];
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  absl::StatusOr<double> mean = MeanOverRanks(local, "the parameter sum");
  if (!mean.ok()) return mean.status();
  return *mean * world_;
}

}  // namespace zeroshard
