#include "worker/comm/shm_gather.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "worker/comm/shm_futex.h"

namespace zeroshard {

struct alignas(64) ShmGather::Line {
  std::atomic<uint32_t> value;     // the counter (futex word)
  std::atomic<uint32_t> sleepers;  // ranks in FUTEX_WAIT on `value`
};

namespace {

using shm::CpuRelax;
using shm::FutexWait;
using shm::FutexWakeAll;
using shm::Reached;

constexpr absl::Duration kSleepSlice = absl::Milliseconds(50);
constexpr absl::Duration kLivenessEvery = absl::Milliseconds(100);
constexpr int kSpins = 64;
// Bootstrap records exchanged over the ShmExchange: one per rank.
constexpr int64_t kRecordBytes = 256;

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t HeaderBytes(int world_size) {
  return RoundUp(static_cast<size_t>(world_size) * 2 * 64, 4096);
}

// Every rank's `text` (at most kRecordBytes - 1 bytes), by rank, through an
// all-gather on the exchange.
absl::StatusOr<std::vector<std::string>> Exchange(ShmExchange* exchange, int rank, int world_size,
                                                  const std::string& text, absl::Time deadline) {
  const int64_t words = kRecordBytes / 4;
  std::vector<char> mine(kRecordBytes, 0);
  std::memcpy(mine.data(), text.data(), std::min<size_t>(text.size(), kRecordBytes - 1));
  std::vector<char> all(kRecordBytes * world_size, 0);
  std::vector<ShardBlock> blocks(world_size);
  for (int r = 0; r < world_size; ++r) blocks[r] = {r, 0, r * words, words};
  const BlockGroups g = GroupBlocks(blocks, world_size);
  absl::Status s = exchange->AllGatherBlocks(mine.data(), all.data(), g, DType::kF32, deadline);
  if (!s.ok()) return s;
  std::vector<std::string> out(world_size);
  for (int r = 0; r < world_size; ++r) out[r] = std::string(all.data() + r * kRecordBytes);
  return out;
}

// A mapping of the segment, made (rank 0) or opened (the others).
struct Mapping {
  int fd = -1;
  void* base = MAP_FAILED;
  size_t bytes = 0;
  void Undo() {
    if (base != MAP_FAILED) munmap(base, bytes);
    if (fd >= 0) close(fd);
    base = MAP_FAILED;
    fd = -1;
  }
};

// Rank 0: makes a zeroed segment of m->bytes and maps it. The verdict every
// rank reads: "ok:PATH" (where the others open it) or "no:WHY".
std::string MakeSegment(Mapping* m) {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  const uint64_t physical =
      pages > 0 && page_size > 0 ? static_cast<uint64_t>(pages) * page_size : 0;
  if (m->bytes > physical / 4) {
    return absl::StrCat("no:a shared gather segment of ", m->bytes,
                        " bytes would take more than a quarter of this host's memory");
  }
  if ((m->fd = memfd_create("zeroshard-gather", MFD_CLOEXEC)) < 0) {
    return absl::StrCat("no:memfd_create: ", std::strerror(errno));
  }
  if (int rc = posix_fallocate(m->fd, 0, static_cast<off_t>(m->bytes)); rc != 0) {
    return absl::StrCat("no:reserving ", m->bytes, " bytes of shared memory: ", std::strerror(rc));
  }
  m->base = mmap(nullptr, m->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd, 0);
  if (m->base == MAP_FAILED) {
    return absl::StrCat("no:mmap of ", m->bytes, " bytes: ", std::strerror(errno));
  }
  // A fresh memfd reads as zeros: every counter starts at 0.
  return absl::StrCat("ok:/proc/", getpid(), "/fd/", m->fd);
}

// The other ranks: opens and maps rank 0's segment at `path`; "" or why not.
std::string OpenSegment(const std::string& path, Mapping* m) {
  struct stat st;
  m->fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (m->fd < 0) return absl::StrCat("open(", path, "): ", std::strerror(errno));
  if (fstat(m->fd, &st) != 0 || static_cast<size_t>(st.st_size) != m->bytes) {
    return absl::StrCat("segment ", path, " is not ", m->bytes, " bytes");
  }
  m->base = mmap(nullptr, m->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd, 0);
  if (m->base == MAP_FAILED) {
    return absl::StrCat("mmap of ", m->bytes, " bytes: ", std::strerror(errno));
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmGather>> ShmGather::Create(ShmExchange* exchange, int rank,
                                                             int world_size, int regions,
                                                             int64_t region_bytes,
                                                             absl::Time deadline,
                                                             std::string* why_not) {
  why_not->clear();
  // Arguments are the same on every rank, so every rank decides alike here.
  if (regions < 1 || region_bytes < 1) {
    *why_not = absl::StrCat("bad shared gather geometry: ", regions, " regions of ", region_bytes,
                            " bytes");
    return std::unique_ptr<ShmGather>();
  }
  const size_t region = RoundUp(static_cast<size_t>(region_bytes), 4096);
  const size_t total_bytes = HeaderBytes(world_size) + static_cast<size_t>(regions) * region;

  // 1. Rank 0 makes the segment and says where it is (or why not).
  Mapping m;
  m.bytes = total_bytes;
  std::string verdict = rank == 0 ? MakeSegment(&m) : "";
  absl::StatusOr<std::vector<std::string>> verdicts =
      Exchange(exchange, rank, world_size, verdict, deadline);
  if (!verdicts.ok()) {
    m.Undo();
    return verdicts.status();
  }
  verdict = (*verdicts)[0];

  // 2. Every rank maps it and reports; all use it or none does.
  std::string local_failure;
  if (!absl::StartsWith(verdict, "ok:")) {
    local_failure = verdict.empty() ? "rank 0 sent no verdict" : verdict.substr(3);
  } else if (rank != 0) {
    local_failure = OpenSegment(verdict.substr(3), &m);
  }
  absl::StatusOr<std::vector<std::string>> reports = Exchange(
      exchange, rank, world_size, local_failure.empty() ? "ok" : "no:" + local_failure, deadline);
  if (!reports.ok()) {
    m.Undo();
    return reports.status();
  }
  for (int r = 0; r < world_size; ++r) {
    if ((*reports)[r] != "ok") {
      *why_not = absl::StrCat("rank ", r, ": ",
                              (*reports)[r].size() > 3 ? (*reports)[r].substr(3) : "no report");
      m.Undo();
      return std::unique_ptr<ShmGather>();
    }
  }
  return std::unique_ptr<ShmGather>(new ShmGather(exchange, rank, world_size, m.fd, m.base,
                                                  total_bytes, regions,
                                                  static_cast<int64_t>(region)));
}

ShmGather::ShmGather(ShmExchange* exchange, int rank, int world_size, int fd, void* base,
                     size_t mapped_bytes, int regions, int64_t region_bytes)
    : exchange_(exchange),
      rank_(rank),
      world_size_(world_size),
      fd_(fd),
      base_(base),
      mapped_bytes_(mapped_bytes),
      regions_(regions),
      region_bytes_(region_bytes) {
  static_assert(sizeof(Line) == 64, "one cache line per counter");
  lines_ = static_cast<Line*>(base);
  data_ = static_cast<char*>(base) + HeaderBytes(world_size);
}

ShmGather::~ShmGather() {
  munmap(base_, mapped_bytes_);
  close(fd_);
}

void ShmGather::Abort() {
  exchange_->Abort();
  for (int i = 0; i < 2 * world_size_; ++i) FutexWakeAll(&lines_[i].value);
}

void ShmGather::Release(int64_t ticket) {
  absl::MutexLock lock(&release_mu_);
  if (ticket <= released_prefix_ || ticket > gathers_) return;  // done, or never gathered
  released_ahead_.insert(ticket);
  int64_t prefix = released_prefix_;
  while (!released_ahead_.empty() && *released_ahead_.begin() == prefix + 1) {
    released_ahead_.erase(released_ahead_.begin());
    ++prefix;
  }
  if (prefix == released_prefix_) return;
  released_prefix_ = prefix;
  Line& line = lines_[2 * rank_ + 1];
  line.value.store(static_cast<uint32_t>(prefix), std::memory_order_seq_cst);
  if (line.sleepers.load(std::memory_order_seq_cst) > 0) FutexWakeAll(&line.value);
}

absl::Status ShmGather::WaitFor(int q, bool released, uint32_t target, absl::Time deadline) {
  Line& line = lines_[2 * q + (released ? 1 : 0)];
  if (Reached(line.value.load(std::memory_order_acquire), target)) return absl::OkStatus();
  for (int i = 0; i < kSpins; ++i) {
    CpuRelax();
    if (Reached(line.value.load(std::memory_order_acquire), target)) return absl::OkStatus();
  }
  absl::Time next_liveness_check = absl::Now() + kLivenessEvery;
  while (true) {
    const uint32_t seen = line.value.load(std::memory_order_acquire);
    if (Reached(seen, target)) break;
    if (exchange_->SegmentFailed()) {
      return absl::UnavailableError(
          absl::StrCat("a peer failed during this collective (waiting for rank ", q, ")"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          released ? absl::StrCat(q == rank_ ? "this rank" : absl::StrCat("rank ", q),
                                  " did not release shared gather buffer ", target)
                   : absl::StrCat("rank ", q, " did not reach the collective over shared memory"));
    }
    if (q != rank_ && now >= next_liveness_check) {
      if (exchange_->PeerGone(q)) {
        return absl::UnavailableError(
            absl::StrCat("rank ", q, " is gone (its process exited or closed the communicator)"));
      }
      next_liveness_check = now + kLivenessEvery;
    }
    line.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!Reached(line.value.load(std::memory_order_seq_cst), target) &&
        !exchange_->SegmentFailed()) {
      FutexWait(&line.value, seen, std::min(deadline - now, kSleepSlice));
    }
    line.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  return absl::OkStatus();
}

absl::StatusOr<const void*> ShmGather::Gather(const void* shard, const BlockGroups& g, DType dtype,
                                              absl::Time deadline, int64_t* ticket) {
  if (failed_.ok() && exchange_->SegmentFailed()) {
    failed_ = absl::UnavailableError("a peer failed in an earlier collective");
  }
  if (!failed_.ok()) return failed_;
  int64_t k;
  {
    absl::MutexLock lock(&release_mu_);
    k = gathers_ + 1;
  }
  char* region = data_ + static_cast<size_t>((k - 1) % regions_) * region_bytes_;
  auto fail = [&](absl::Status s) {
    failed_ = s;
    return s;
  };
  // The region's previous gather must be released everywhere, here too.
  if (k > regions_) {
    const uint32_t previous = static_cast<uint32_t>(k - regions_);
    for (int q = 0; q < world_size_; ++q) {
      if (absl::Status s = WaitFor(q, /*released=*/true, previous, deadline); !s.ok()) {
        return fail(s);
      }
    }
  }
  const size_t esize = DTypeSize(dtype);
  const char* in = static_cast<const char*>(shard);
  for (const ShardBlock* b : g.blocks[rank_]) {
    std::memcpy(region + b->full_offset * esize, in + b->shard_offset * esize, b->count * esize);
  }
  {
    absl::MutexLock lock(&release_mu_);
    gathers_ = k;
  }
  Line& mine = lines_[2 * rank_];
  mine.value.store(static_cast<uint32_t>(k), std::memory_order_seq_cst);
  if (mine.sleepers.load(std::memory_order_seq_cst) > 0) FutexWakeAll(&mine.value);
  for (int q = 0; q < world_size_; ++q) {
    if (q == rank_) continue;
    if (absl::Status s = WaitFor(q, /*released=*/false, static_cast<uint32_t>(k), deadline);
        !s.ok()) {
      return fail(s);
    }
  }
  *ticket = k;
  return static_cast<const void*>(region);
}

}  // namespace zeroshard
