// What a rank tells the server about itself beyond its step and loss: the
// RankTelemetry of its heartbeats (memory by category, bytes moved, the
// collective in flight) and the arrival lag at each step's first collective.
#ifndef ZEROSHARD_WORKER_RANK_TELEMETRY_H_
#define ZEROSHARD_WORKER_RANK_TELEMETRY_H_

#include <cstdint>
#include <deque>
#include <functional>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/zeroshard.pb.h"
#include "worker/data_plane.h"
#include "worker/zero/engine.h"

namespace zeroshard {

// Fills the fields that change between steps: memory, bytes moved, the
// collectives entered and the one in flight. `plane` may be null.
// Thread-safe as far as the engine and the data plane are.
void FillLiveTelemetry(const ZeroEngine& engine, const DataPlane* plane, v1::RankTelemetry* out);

// This rank's lag behind the first rank to arrive at each step's first
// collective, over the last kWindow steps.
class ArrivalLag {
 public:
  static constexpr int kWindow = 20;
  void Add(double lag_ms);
  // The median of the window; -1 until it is full.
  double Median() const;
  void Clear() { lags_.clear(); }

 private:
  std::deque<double> lags_;  // newest last
};

// Shares this rank's arrival at the step's first collective (`arrival`,
// from ZeroEngine::TakeFirstCollectiveStart) with every rank, adds its lag
// behind the first to `lag` and fills the arrival fields of `out`; sets
// `spread` (when not null) to the last rank's arrival minus the first's, in
// seconds (the same on every rank). Collective: every rank calls it after
// every step.
absl::Status ShareArrival(ZeroEngine& engine, absl::Time arrival, int rank, ArrivalLag* lag,
                          v1::RankTelemetry* out, double* spread = nullptr);

// The engine's before_collective hook of --test_stall_before_gather: blocks
// the all-gather number `n` until `aborted()` holds (polled every 50 ms).
std::function<void(const char*, int64_t)> StallBeforeGather(int64_t n,
                                                            std::function<bool()> aborted);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_RANK_TELEMETRY_H_
