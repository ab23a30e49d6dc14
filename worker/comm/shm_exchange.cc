#include "worker/comm/shm_exchange.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/local_address.h"
#include "worker/comm/shm_futex.h"

namespace zeroshard {

namespace {

// The segment's first cache line. (ShmExchange::Header is this layout; the
// bootstrap below fills and checks it.)
struct SegmentHeader {
  uint64_t magic;
  uint32_t world_size;
  uint32_t reserved;
  int64_t slot_bytes;
  std::atomic<uint32_t> failed;
};

}  // namespace

struct ShmExchange::Header : SegmentHeader {};

struct alignas(64) ShmExchange::RankLine {
  std::atomic<uint32_t> posted;    // the last round this rank published (futex word)
  std::atomic<uint32_t> sleepers;  // ranks in FUTEX_WAIT on `posted`
};

namespace {

using shm::CpuRelax;
using shm::FutexWait;
using shm::FutexWakeAll;
using shm::Reached;

constexpr uint64_t kMagic = 0x317865686d73737aULL;  // "zsshmex1"
// Each rank's liveness lock: one byte at kLockBase + rank (beyond the data;
// record locks need not lie inside the file).
constexpr off_t kLockBase = off_t{1} << 40;
constexpr absl::Duration kSleepSlice = absl::Milliseconds(50);
constexpr absl::Duration kLivenessEvery = absl::Milliseconds(100);
// Brief spinning before sleeping: ranks usually arrive within microseconds
// of each other, but on an oversubscribed host a spinning waiter takes the
// core from the rank it waits for, so the spin stays short.
constexpr int kSpins = 64;
constexpr int64_t kMinSlotBytes = 4096;
constexpr int64_t kMaxSlotBytes = int64_t{1} << 30;
// Reductions add this many elements at a time in an f32 scratch array.
constexpr int64_t kReduceTile = 2048;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The write lock on rank `rank`'s liveness byte.
struct flock LivenessLock(int rank) {
  struct flock lock;
  std::memset(&lock, 0, sizeof(lock));
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = kLockBase + rank;
  lock.l_len = 1;
  return lock;
}

// The header's cache line, one line per rank, rounded to a page.
size_t HeaderBytes(int world_size) {
  return RoundUp(64 + static_cast<size_t>(world_size) * 64, 4096);
}

// A segment being set up: unmapped and closed on destruction unless
// released to the ShmExchange that keeps it.
struct Segment {
  int fd = -1;
  void* base = MAP_FAILED;
  size_t bytes = 0;
  std::string path;  // /proc/<pid of rank 0>/fd/<fd>

  ~Segment() {
    if (base != MAP_FAILED) munmap(base, bytes);
    if (fd >= 0) close(fd);
  }
  int ReleaseFd() { return std::exchange(fd, -1); }
  void* ReleaseBase() { return std::exchange(base, MAP_FAILED); }
};

// What this rank offers: "ok:<host identity> world <W> slot <bytes>", or
// "no:" and why it cannot take part.
std::string OfferOf(bool enabled, int64_t slot_bytes, int world_size) {
  if (!enabled) return "no:shared memory is off";
  if (slot_bytes < kMinSlotBytes || slot_bytes > kMaxSlotBytes) {
    return absl::StrCat("no:shared-memory slot of ", slot_bytes, " bytes is outside [",
                        kMinSlotBytes, ", ", kMaxSlotBytes, "]");
  }
  if (slot_bytes / world_size < 4096) {
    return absl::StrCat("no:", world_size, " ranks are too many for slots of ", slot_bytes,
                        " bytes");
  }
  const std::string host = HostIdentity();
  if (host.empty()) return "no:cannot read this host's name and boot id";
  return absl::StrCat("ok:", host, " world ", world_size, " slot ", RoundUp(slot_bytes, 4096));
}

// Rank 0: "" when every rank offers what rank 0 does, else "no:" and the
// first difference. Errors are the store's.
absl::StatusOr<std::string> CollectOffers(KeyValueStore* store, const std::string& prefix,
                                          const std::string& offer, int world_size,
                                          const std::function<absl::Duration()>& remaining) {
  if (!absl::StartsWith(offer, "ok:")) return offer;
  for (int r = 1; r < world_size; ++r) {
    absl::StatusOr<std::string> peer = store->Get(absl::StrCat(prefix, "offer/", r), remaining());
    if (!peer.ok()) return peer.status();
    if (absl::StartsWith(*peer, "no:")) return absl::StrCat("no:rank ", r, ": ", peer->substr(3));
    if (*peer != offer) {
      return absl::StrCat("no:the ranks are not all on one host with the same settings (rank ", r,
                          " offers '", peer->substr(3), "', rank 0 '", offer.substr(3), "')");
    }
  }
  return std::string();
}

// Rank 0: an anonymous memfd of segment->bytes that peers open through
// /proc/<pid>/fd/<fd> (no name to leak: it lives as long as some rank holds
// it), mapped, its header written before anyone is told where it is.
// Returns the verdict to publish: "ok:<path>" or "no:" and why.
std::string MakeSegment(Segment* segment, int world_size, int64_t slot_bytes) {
  const size_t total = segment->bytes;
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  const uint64_t physical =
      pages > 0 && page_size > 0 ? static_cast<uint64_t>(pages) * page_size : 0;
  if (total > physical / 4) {
    return absl::StrCat("no:a segment of ", total,
                        " bytes would take more than a quarter of this host's memory");
  }
  const int fd = memfd_create("zeroshard-collectives", MFD_CLOEXEC);
  if (fd < 0) return absl::StrCat("no:memfd_create: ", std::strerror(errno));
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(total));
  if (rc != 0) {
    close(fd);
    return absl::StrCat("no:reserving ", total, " bytes of shared memory: ", std::strerror(rc));
  }
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int error = errno;
    close(fd);
    return absl::StrCat("no:mmap of ", total, " bytes: ", std::strerror(error));
  }
  SegmentHeader* header = static_cast<SegmentHeader*>(base);
  header->world_size = static_cast<uint32_t>(world_size);
  header->slot_bytes = slot_bytes;
  header->failed.store(0);
  std::atomic_thread_fence(std::memory_order_release);
  header->magic = kMagic;
  segment->fd = fd;
  segment->base = base;
  segment->path = absl::StrCat("/proc/", getpid(), "/fd/", fd);
  return absl::StrCat("ok:", segment->path);
}

// Ranks but 0: opens the segment rank 0 published; "" or why not.
std::string OpenPublishedSegment(const std::string& verdict, Segment* segment) {
  if (!absl::StartsWith(verdict, "ok:")) return verdict.substr(3);
  segment->path = verdict.substr(3);
  segment->fd = open(segment->path.c_str(), O_RDWR | O_CLOEXEC);
  if (segment->fd < 0) return absl::StrCat("open(", segment->path, "): ", std::strerror(errno));
  return "";
}

// Checks the segment's size, maps it (rank 0 has already) and takes this
// rank's liveness lock; "" or why not.
std::string MapAndLock(Segment* segment, int rank) {
  struct stat st;
  if (fstat(segment->fd, &st) != 0 || static_cast<size_t>(st.st_size) != segment->bytes) {
    // Not the object rank 0 made for these settings.
    return absl::StrCat("segment ", segment->path, " is not ", segment->bytes, " bytes");
  }
  if (segment->base == MAP_FAILED) {
    segment->base =
        mmap(nullptr, segment->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, segment->fd, 0);
  }
  if (segment->base == MAP_FAILED) {
    return absl::StrCat("mmap of ", segment->bytes, " bytes: ", std::strerror(errno));
  }
  struct flock lock = LivenessLock(rank);
  if (fcntl(segment->fd, F_OFD_SETLK, &lock) != 0) {
    return absl::StrCat("locking the segment: ", std::strerror(errno));
  }
  return "";
}

// Ranks but 0: the header holds what rank 0 wrote for these settings (it
// wrote it before publishing the verdict this rank read); "" or why not.
std::string CheckHeaderRankZeroWrote(const Segment& segment, int world_size, int64_t slot_bytes) {
  const SegmentHeader* header = static_cast<const SegmentHeader*>(segment.base);
  if (header->magic != kMagic || header->world_size != static_cast<uint32_t>(world_size) ||
      header->slot_bytes != slot_bytes) {
    return absl::StrCat("segment ", segment.path, " does not hold what rank 0 wrote");
  }
  return "";
}

// Publishes this rank's outcome (*first_failure: "" or why not) and reads
// every other rank's; *first_failure becomes the first failure of any rank.
// Errors are the store's.
absl::Status AgreeOnMapping(KeyValueStore* store, const std::string& prefix, int rank,
                            int world_size, const std::function<absl::Duration()>& remaining,
                            std::string* first_failure) {
  absl::Status status =
      store->Set(absl::StrCat(prefix, "mapped/", rank),
                 first_failure->empty() ? "ok" : absl::StrCat("no:", *first_failure));
  for (int r = 0; r < world_size && status.ok(); ++r) {
    if (r == rank) continue;
    absl::StatusOr<std::string> mapped =
        store->Get(absl::StrCat(prefix, "mapped/", r), remaining());
    if (!mapped.ok()) {
      status = mapped.status();
    } else if (*mapped != "ok" && first_failure->empty()) {
      *first_failure = absl::StrCat("rank ", r, ": ", mapped->substr(3));
    }
  }
  return status;
}

// Calls fn(block, offset inside the block, packed offset, count) for the
// parts of `rank`'s blocks that fall in packed elements [lo, hi).
template <typename Fn>
void ForEachPiece(const BlockGroups& g, int rank, int64_t lo, int64_t hi, Fn&& fn) {
  const auto& blocks = g.blocks[rank];
  const auto& packed = g.packed_offset[rank];
  // First block ending after lo.
  size_t i = std::upper_bound(packed.begin(), packed.end(), lo) - packed.begin();
  if (i > 0) --i;
  for (; i < blocks.size() && packed[i] < hi; ++i) {
    const int64_t start = std::max(packed[i], lo);
    const int64_t end = std::min(packed[i] + blocks[i]->count, hi);
    if (start < end) fn(*blocks[i], start - packed[i], start, end - start);
  }
}

// out[i] = (own[i] + sum over sources s[i]) / divisor, in f32, rounded once.
void Reduce(DType dtype, const char* own, const std::vector<const char*>& sources, char* out,
            int64_t n, float divisor) {
  float acc[kReduceTile];
  for (int64_t at = 0; at < n; at += kReduceTile) {
    const int64_t m = std::min(kReduceTile, n - at);
    if (dtype == DType::kF32 && sources.size() == 1) {
      // Two ranks: one pass.
      const float* a = reinterpret_cast<const float*>(own) + at;
      const float* s = reinterpret_cast<const float*>(sources[0]) + at;
      float* d = reinterpret_cast<float*>(out) + at;
      if (divisor == 1.0f) {
        for (int64_t i = 0; i < m; ++i) d[i] = a[i] + s[i];
      } else {
        for (int64_t i = 0; i < m; ++i) d[i] = (a[i] + s[i]) / divisor;
      }
    } else if (dtype == DType::kF32) {
      const float* a = reinterpret_cast<const float*>(own) + at;
      for (int64_t i = 0; i < m; ++i) acc[i] = a[i];
      for (const char* src : sources) {
        const float* s = reinterpret_cast<const float*>(src) + at;
        for (int64_t i = 0; i < m; ++i) acc[i] += s[i];
      }
      float* d = reinterpret_cast<float*>(out) + at;
      if (divisor == 1.0f) {
        for (int64_t i = 0; i < m; ++i) d[i] = acc[i];
      } else {
        for (int64_t i = 0; i < m; ++i) d[i] = acc[i] / divisor;
      }
    } else {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(own) + at;
      for (int64_t i = 0; i < m; ++i) acc[i] = BF16ToFloat(a[i]);
      for (const char* src : sources) {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(src) + at;
        for (int64_t i = 0; i < m; ++i) acc[i] += BF16ToFloat(s[i]);
      }
      uint16_t* d = reinterpret_cast<uint16_t*>(out) + at;
      for (int64_t i = 0; i < m; ++i)
        d[i] = FloatToBF16(divisor == 1.0f ? acc[i] : acc[i] / divisor);
    }
  }
}

}  // namespace

BlockGroups GroupBlocks(const std::vector<ShardBlock>& blocks, int world_size) {
  BlockGroups g;
  g.blocks.resize(world_size);
  g.packed_offset.resize(world_size);
  g.total.assign(world_size, 0);
  g.shard_extent.assign(world_size, 0);
  for (const ShardBlock& b : blocks) {
    if (b.count == 0) continue;
    g.blocks[b.rank].push_back(&b);
    g.packed_offset[b.rank].push_back(g.total[b.rank]);
    g.total[b.rank] += b.count;
    g.full_extent = std::max(g.full_extent, b.full_offset + b.count);
    g.shard_extent[b.rank] = std::max(g.shard_extent[b.rank], b.shard_offset + b.count);
  }
  return g;
}

absl::StatusOr<std::unique_ptr<ShmExchange>> ShmExchange::Create(
    KeyValueStore* store, const std::string& prefix, int rank, int world_size, bool enabled,
    int64_t slot_bytes, absl::Duration timeout, std::string* why_not) {
  why_not->clear();
  if (world_size < 2) {
    *why_not = "a single rank has no peers";
    return std::unique_ptr<ShmExchange>();
  }
  // One deadline for the whole bootstrap.
  const absl::Time deadline = absl::Now() + timeout;
  auto remaining = [&] { return std::max(deadline - absl::Now(), absl::Milliseconds(1)); };

  // 1. Every rank publishes what it offers. Rank 0 decides for all, so the
  // ranks never end up on different transports.
  const std::string offer = OfferOf(enabled, slot_bytes, world_size);
  slot_bytes = static_cast<int64_t>(RoundUp(std::max<int64_t>(slot_bytes, 0), 4096));
  absl::Status status = store->Set(absl::StrCat(prefix, "offer/", rank), offer);
  if (!status.ok()) return status;

  // 2. Rank 0 makes the segment (or says why not); the others open it.
  Segment segment;
  segment.bytes = HeaderBytes(world_size) + 2 * static_cast<size_t>(world_size) * slot_bytes;
  std::string local_failure;
  if (rank == 0) {
    absl::StatusOr<std::string> verdict =
        CollectOffers(store, prefix, offer, world_size, remaining);
    if (!verdict.ok()) return verdict.status();
    if (verdict->empty()) *verdict = MakeSegment(&segment, world_size, slot_bytes);
    status = store->Set(absl::StrCat(prefix, "segment"), *verdict);
    if (!status.ok()) return status;  // `segment` unmaps and closes
    if (segment.fd < 0) local_failure = verdict->substr(3);
  } else {
    absl::StatusOr<std::string> verdict = store->Get(absl::StrCat(prefix, "segment"), remaining());
    if (!verdict.ok()) return verdict.status();
    local_failure = OpenPublishedSegment(*verdict, &segment);
  }

  // 3. Map it (rank 0 has), check it, take this rank's liveness lock.
  if (local_failure.empty()) local_failure = MapAndLock(&segment, rank);
  if (local_failure.empty() && rank != 0) {
    local_failure = CheckHeaderRankZeroWrote(segment, world_size, slot_bytes);
  }
  // 4. Every rank reports, and every rank reads every report: all use the
  // segment, or none does.
  std::string first_failure = local_failure;
  status = AgreeOnMapping(store, prefix, rank, world_size, remaining, &first_failure);
  if (!status.ok()) return status;
  if (!first_failure.empty()) {
    *why_not = first_failure;
    return std::unique_ptr<ShmExchange>();
  }
  const size_t bytes = segment.bytes;
  return std::unique_ptr<ShmExchange>(new ShmExchange(rank, world_size, segment.ReleaseFd(),
                                                      segment.ReleaseBase(), bytes, slot_bytes));
}

ShmExchange::ShmExchange(int rank, int world_size, int fd, void* base, size_t mapped_bytes,
                         int64_t slot_bytes)
    : rank_(rank),
      world_size_(world_size),
      fd_(fd),
      base_(base),
      mapped_bytes_(mapped_bytes),
      slot_bytes_(slot_bytes) {
  char* bytes = static_cast<char*>(base);
  header_ = reinterpret_cast<Header*>(bytes);
  lines_ = reinterpret_cast<RankLine*>(bytes + 64);
  data_ = bytes + HeaderBytes(world_size);
  static_assert(sizeof(Header) <= 64, "the header fits its cache line");
  static_assert(sizeof(RankLine) == 64, "one cache line per rank");
}

ShmExchange::~ShmExchange() {
  munmap(base_, mapped_bytes_);
  close(fd_);  // releases the liveness lock: peers see this rank gone
}

char* ShmExchange::Slot(uint32_t round, int rank) const {
  return data_ + (static_cast<size_t>(round % 2) * world_size_ + rank) * slot_bytes_;
}

void ShmExchange::Post(uint32_t round) {
  RankLine& line = lines_[rank_];
  line.posted.store(round, std::memory_order_seq_cst);
  if (line.sleepers.load(std::memory_order_seq_cst) > 0) FutexWakeAll(&line.posted);
}

bool ShmExchange::PeerGone(int peer) const {
  struct flock lock = LivenessLock(peer);
  if (fcntl(fd_, F_OFD_GETLK, &lock) != 0) return false;
  return lock.l_type == F_UNLCK;
}

absl::Status ShmExchange::WaitAll(uint32_t round, absl::Time deadline) {
  for (int q = 0; q < world_size_; ++q) {
    if (q == rank_) continue;
    RankLine& line = lines_[q];
    if (Reached(line.posted.load(std::memory_order_acquire), round)) continue;
    for (int i = 0; i < kSpins; ++i) {
      CpuRelax();
      if (Reached(line.posted.load(std::memory_order_acquire), round)) break;
    }
    absl::Time next_liveness_check = absl::Now() + kLivenessEvery;
    while (true) {
      const uint32_t seen = line.posted.load(std::memory_order_acquire);
      if (Reached(seen, round)) break;
      if (header_->failed.load(std::memory_order_acquire) != 0) {
        return absl::UnavailableError(
            absl::StrCat("a peer failed during this collective (waiting for rank ", q, ")"));
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("rank ", q, " did not reach the collective over shared memory"));
      }
      if (now >= next_liveness_check) {
        if (PeerGone(q)) {
          return absl::UnavailableError(
              absl::StrCat("rank ", q, " is gone (its process exited or closed the communicator)"));
        }
        next_liveness_check = now + kLivenessEvery;
      }
      line.sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (!Reached(line.posted.load(std::memory_order_seq_cst), round) &&
          header_->failed.load(std::memory_order_seq_cst) == 0) {
        FutexWait(&line.posted, seen, std::min(deadline - now, kSleepSlice));
      }
      line.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  return absl::OkStatus();
}

bool ShmExchange::SegmentFailed() const {
  return header_->failed.load(std::memory_order_acquire) != 0;
}

void ShmExchange::Abort() {
  // A waiter that checked `failed` just before this store sleeps at most one
  // slice (50 ms) before it sees it.
  header_->failed.store(1, std::memory_order_seq_cst);
  for (int q = 0; q < world_size_; ++q) FutexWakeAll(&lines_[q].posted);
}

absl::Status ShmExchange::CheckUsable() {
  if (failed_.ok() && header_->failed.load(std::memory_order_acquire) != 0) {
    failed_ = absl::UnavailableError("a peer failed in an earlier collective");
  }
  return failed_;
}

absl::Status ShmExchange::AllGatherBlocks(const void* shard, void* full, const BlockGroups& g,
                                          DType dtype, absl::Time deadline) {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  const size_t esize = DTypeSize(dtype);
  const char* in = static_cast<const char*>(shard);
  char* out = static_cast<char*>(full);
  const int64_t per_round = slot_bytes_ / static_cast<int64_t>(esize);
  const int64_t max_total = *std::max_element(g.total.begin(), g.total.end());
  bool own_copied = false;
  for (int64_t lo = 0; lo < max_total; lo += per_round) {
    const int64_t hi = lo + per_round;
    const uint32_t round = ++round_;
    char* mine = Slot(round, rank_);
    ForEachPiece(
        g, rank_, lo, hi, [&](const ShardBlock& b, int64_t off, int64_t packed, int64_t n) {
          std::memcpy(mine + (packed - lo) * esize, in + (b.shard_offset + off) * esize, n * esize);
        });
    Post(round);
    if (!own_copied) {
      // This rank's own blocks, while the peers start on the first round.
      for (const ShardBlock* b : g.blocks[rank_]) {
        std::memmove(out + b->full_offset * esize, in + b->shard_offset * esize, b->count * esize);
      }
      own_copied = true;
    }
    absl::Status status = WaitAll(round, deadline);
    if (!status.ok()) {
      failed_ = status;
      return status;
    }
    for (int q = 0; q < world_size_; ++q) {
      if (q == rank_) continue;
      const char* theirs = Slot(round, q);
      ForEachPiece(g, q, lo, hi, [&](const ShardBlock& b, int64_t off, int64_t packed, int64_t n) {
        std::memcpy(out + (b.full_offset + off) * esize, theirs + (packed - lo) * esize, n * esize);
      });
    }
  }
  return absl::OkStatus();
}

absl::Status ShmExchange::ReduceScatterBlocks(const void* full, void* shard, const BlockGroups& g,
                                              DType dtype, float divisor, absl::Time deadline) {
  if (absl::Status usable = CheckUsable(); !usable.ok()) return usable;
  const size_t esize = DTypeSize(dtype);
  const char* in = static_cast<const char*>(full);
  char* out = static_cast<char*>(shard);
  // Each slot holds one part per destination rank.
  const int64_t part_bytes = slot_bytes_ / world_size_ / 64 * 64;
  const int64_t per_round = part_bytes / static_cast<int64_t>(esize);
  const int64_t max_total = *std::max_element(g.total.begin(), g.total.end());
  std::vector<const char*> sources(world_size_ - 1);
  for (int64_t lo = 0; lo < max_total; lo += per_round) {
    const int64_t hi = lo + per_round;
    const uint32_t round = ++round_;
    char* mine = Slot(round, rank_);
    for (int d = 0; d < world_size_; ++d) {
      if (d == rank_) continue;
      char* part = mine + d * part_bytes;
      ForEachPiece(g, d, lo, hi, [&](const ShardBlock& b, int64_t off, int64_t packed, int64_t n) {
        std::memcpy(part + (packed - lo) * esize, in + (b.full_offset + off) * esize, n * esize);
      });
    }
    Post(round);
    absl::Status status = WaitAll(round, deadline);
    if (!status.ok()) {
      failed_ = status;
      return status;
    }
    ForEachPiece(g, rank_, lo, hi,
                 [&](const ShardBlock& b, int64_t off, int64_t packed, int64_t n) {
                   int k = 0;
                   for (int q = 0; q < world_size_; ++q) {
                     if (q == rank_) continue;
                     sources[k++] = Slot(round, q) + rank_ * part_bytes + (packed - lo) * esize;
                   }
                   Reduce(dtype, in + (b.full_offset + off) * esize, sources,
                          out + (b.shard_offset + off) * esize, n, divisor);
                 });
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
