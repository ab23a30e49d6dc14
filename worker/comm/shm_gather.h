// ShmGather: the mechanics of ShmCommunicator's SharedGather
// (communicator.h) — all-gathers into buffers in host-shared memory that
// every rank reads in place, for jobs whose ranks all run on one host and
// already share a ShmExchange.
//
// ShmExchange's all-gather copies each rank's part into its slot and every
// rank copies every part out again (plus its own part into place): for a
// unit of U bytes over W ranks each rank moves U/W + U bytes. Here each rank
// writes its U/W bytes once, straight from its shard into a shared region,
// and nobody copies the result: the ranks compute from the region.
//
// Segment: a header page (for each rank one cache line with its published
// gather counter and one with its released counter, both futex words, each
// with a count of sleepers), then `regions` regions of `region_bytes`. Gather
// k (from 1) uses region (k - 1) % regions: a rank first waits until every
// rank (itself included) has released every gather up to k - regions, then
// writes its blocks, publishes k, and waits until every peer has published k.
// A rank's released counter is the longest prefix of gathers it has released
// (releases may come out of order; they are counted here in order).
//
// Failure: as ShmExchange (it uses the exchange's liveness locks and failed
// flag): every wait has the caller's deadline, a dead peer is noticed within
// 100 ms (UNAVAILABLE), Abort() marks the segment failed and wakes every
// waiter here and on the peers. After a failure the object is unusable.
//
// Bootstrap (Create, collective over the exchange): rank 0 makes an
// anonymous memfd (reserved with posix_fallocate) and publishes its
// /proc/<pid>/fd/<n> path through an all-gather on the exchange; every rank
// opens and maps it and reports through a second all-gather, so all ranks
// use it or none does.
#ifndef ZEROSHARD_WORKER_COMM_SHM_GATHER_H_
#define ZEROSHARD_WORKER_COMM_SHM_GATHER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/comm/shm_exchange.h"

namespace zeroshard {

class ShmGather {
 public:
  // Collective over the exchange's ranks (same regions and region_bytes on
  // every rank). nullptr and *why_not when the segment cannot be made or
  // mapped by every rank; an error when the exchange fails. `exchange` must
  // outlive the result.
  static absl::StatusOr<std::unique_ptr<ShmGather>> Create(ShmExchange* exchange, int rank,
                                                           int world_size, int regions,
                                                           int64_t region_bytes,
                                                           absl::Time deadline,
                                                           std::string* why_not);
  ~ShmGather();

  ShmGather(const ShmGather&) = delete;
  ShmGather& operator=(const ShmGather&) = delete;

  int regions() const { return regions_; }
  int64_t region_bytes() const { return region_bytes_; }
  int64_t segment_bytes() const { return static_cast<int64_t>(mapped_bytes_); }

  // The next gather (see the header comment); `g` groups the blocks, whose
  // full extent must fit a region (checked by the caller). Returns the
  // region and sets *ticket.
  absl::StatusOr<const void*> Gather(const void* shard, const BlockGroups& g, DType dtype,
                                     absl::Time deadline, int64_t* ticket);
  // Thread-safe.
  void Release(int64_t ticket);
  // Marks the exchange failed and wakes every waiter (here and on peers).
  void Abort();

 private:
  struct Line;

  ShmGather(ShmExchange* exchange, int rank, int world_size, int fd, void* base,
            size_t mapped_bytes, int regions, int64_t region_bytes);

  // Waits until `word` of rank q (posted or released) reaches `target`.
  absl::Status WaitFor(int q, bool released, uint32_t target, absl::Time deadline);

  ShmExchange* const exchange_;
  const int rank_;
  const int world_size_;
  const int fd_;
  void* const base_;
  const size_t mapped_bytes_;
  const int regions_;
  const int64_t region_bytes_;
  Line* lines_;  // per rank: [2 * rank] posted, [2 * rank + 1] released
  char* data_;
  absl::Status failed_;  // the gather thread's

  absl::Mutex release_mu_;
  int64_t gathers_ ABSL_GUARDED_BY(release_mu_) = 0;  // written by the gather thread
  int64_t released_prefix_ ABSL_GUARDED_BY(release_mu_) = 0;
  std::set<int64_t> released_ahead_ ABSL_GUARDED_BY(release_mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_SHM_GATHER_H_
