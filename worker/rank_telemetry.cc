#include "worker/rank_telemetry.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "worker/zero/memory_tracker.h"

namespace zeroshard {
namespace {

v1::CollectiveOp OpOf(const char* op) {
  if (std::strcmp(op, "all_gather") == 0) return v1::ALL_GATHER;
  if (std::strcmp(op, "reduce_scatter") == 0) return v1::REDUCE_SCATTER;
  if (std::strcmp(op, "all_reduce") == 0) return v1::ALL_REDUCE;
  return v1::COLLECTIVE_OP_UNSPECIFIED;
}

}  // namespace

void FillLiveTelemetry(const ZeroEngine& engine, const DataPlane* plane, v1::RankTelemetry* out) {
  const MemoryTracker& m = engine.memory();
  using C = MemoryCategory;
  v1::MemoryUsage* memory = out->mutable_memory();
  memory->set_params(m.current(C::kParamsSharded) + m.current(C::kParamsReplicated) +
                     m.current(C::kParamsGathered) + m.current(C::kParamsSecondary));
  memory->set_grads(m.current(C::kGradsPersistent) + m.current(C::kGradsTransient));
  memory->set_optimizer_state(m.current(C::kOptimizerState));
  memory->set_activations(m.current(C::kActivations));
  memory->set_comm_buffers(m.current(C::kCommBuffers));
  memory->set_cached(m.current(C::kPoolCached));
  if (plane != nullptr && plane->gather != nullptr && plane->reduce != nullptr) {
    const HostBytes by_host = plane->BytesByHost();
    out->set_bytes_moved(by_host.intra_host + by_host.inter_host);
    out->set_comm_bytes_intra_host(by_host.intra_host);
    out->set_comm_bytes_inter_host(by_host.inter_host);
  }
  const ZeroEngine::CollectiveProgress progress = engine.Collectives();
  out->set_gathers_entered(progress.gathers_entered);
  out->set_reductions_entered(progress.reductions_entered);
  if (progress.oldest.op != nullptr) {
    v1::CollectiveInProgress* c = out->mutable_in_progress();
    c->set_op(OpOf(progress.oldest.op));
    c->set_unit(progress.oldest.unit);
    c->set_seq(progress.oldest.seq);
    c->set_started_unix_ms(absl::ToUnixMillis(progress.oldest.started));
    // Its age now, as this report is written: the viewers show this, not
    // their time minus the start (which adds the report's own age).
    c->set_age_ms(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(absl::Now() - progress.oldest.started)));
  } else {
    out->clear_in_progress();
  }
}

void ArrivalLag::Add(double lag_ms) {
  lags_.push_back(lag_ms);
  if (lags_.size() > kWindow) lags_.pop_front();
}

double ArrivalLag::Median() const {
  if (lags_.size() < kWindow) return -1;
  std::vector<double> sorted(lags_.begin(), lags_.end());
  std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
  return sorted[sorted.size() / 2];
}

std::function<void(const char*, int64_t)> StallBeforeGather(int64_t n,
                                                            std::function<bool()> aborted) {
  return [n, aborted = std::move(aborted)](const char* op, int64_t seq) {
    if (std::strcmp(op, "all_gather") != 0 || seq != n) return;
    while (!aborted()) absl::SleepFor(absl::Milliseconds(50));
  };
}

absl::Status ShareArrival(ZeroEngine& engine, absl::Time arrival, int rank, ArrivalLag* lag,
                          v1::RankTelemetry* out, double* spread) {
  absl::StatusOr<std::vector<double>> arrivals =
      engine.GatherOverRanks(absl::ToUnixMicros(arrival) / 1e6, "arrival times");
  if (!arrivals.ok()) return arrivals.status();
  const double first = *std::min_element(arrivals->begin(), arrivals->end());
  if (spread != nullptr) *spread = *std::max_element(arrivals->begin(), arrivals->end()) - first;
  const double lag_ms = ((*arrivals)[rank] - first) * 1e3;
  lag->Add(lag_ms);
  out->set_first_collective_unix_us(absl::ToUnixMicros(arrival));
  out->set_arrival_lag_ms(static_cast<float>(lag_ms));
  out->set_arrival_lag_median_ms(static_cast<float>(lag->Median()));
  return absl::OkStatus();
}

}  // namespace zeroshard
