// GlooCommunicator's SharedGather (Communicator::MakeSharedGather): gathers
// into host-shared regions that every rank reads in place. Ranks run as
// threads of this process, or (for a peer that dies) as forked processes
// bootstrapped through a store in a temporary directory.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_store.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;
using ::zeroshard::comm_test::CreateCommunicators;
using ::zeroshard::comm_test::DestroyCommunicators;
using ::zeroshard::comm_test::RunThreads;

constexpr absl::Duration kTimeout = absl::Seconds(20);

float Value(int rank, int64_t i) { return static_cast<float>(rank * 100000 + i) * 0.5f; }

// A layout of `full` elements cut into blocks of random sizes, dealt to
// random ranks, each rank's blocks at increasing shard offsets (with gaps).
std::vector<ShardBlock> RandomLayout(int world_size, int64_t full, uint32_t seed,
                                     std::vector<int64_t>* shard_sizes) {
  std::mt19937 rng(seed);
  std::vector<ShardBlock> blocks;
  shard_sizes->assign(world_size, 0);
  for (int64_t at = 0; at < full;) {
    const int64_t n = std::min<int64_t>(full - at, 1 + rng() % 3000);
    const int r = static_cast<int>(rng() % world_size);
    (*shard_sizes)[r] += rng() % 3;  // a gap
    blocks.push_back({r, (*shard_sizes)[r], at, n});
    (*shard_sizes)[r] += n;
    at += n;
  }
  return blocks;
}

std::vector<float> Shard(int rank, int64_t size) {
  std::vector<float> shard(size);
  for (int64_t i = 0; i < size; ++i) shard[i] = Value(rank, i);
  return shard;
}

std::vector<float> Expected(const std::vector<ShardBlock>& blocks, int64_t full) {
  std::vector<float> out(full);
  for (const ShardBlock& b : blocks) {
    for (int64_t i = 0; i < b.count; ++i)
      out[b.full_offset + i] = Value(b.rank, b.shard_offset + i);
  }
  return out;
}

std::vector<SharedGather*> MakeAll(std::vector<std::unique_ptr<HostCommunicator>>* comms,
                                   int regions, int64_t region_bytes) {
  std::vector<SharedGather*> gathers(comms->size());
  RunThreads(static_cast<int>(comms->size()), [&](int r) {
    absl::StatusOr<SharedGather*> g =
        (*comms)[r]->MakeSharedGather(regions, region_bytes, kTimeout);
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_NE(*g, nullptr) << (*comms)[r]->transport_note();
    gathers[r] = *g;
  });
  return gathers;
}

// Every rank sees the same full buffer as AllGatherBlocks gives, for many
// layouts, at 2 and 3 ranks; the byte counters match too.
TEST(SharedGatherTest, MatchesAllGatherBlocks) {
  for (int world : {2, 3}) {
    InMemoryKvStore store;
    auto comms = CreateCommunicators(&store, world, "gather", /*shared_memory=*/true);
    const int64_t full = 20000;
    auto gathers = MakeAll(&comms, 2, full * 4);
    for (uint32_t seed = 1; seed <= 6; ++seed) {
      std::vector<int64_t> sizes;
      const std::vector<ShardBlock> blocks = RandomLayout(world, full - seed * 7, seed, &sizes);
      const std::vector<float> expected = Expected(blocks, full - seed * 7);
      RunThreads(world, [&](int r) {
        const std::vector<float> shard = Shard(r, sizes[r]);
        std::vector<float> reference(full - seed * 7, -1.0f);
        const int64_t before = comms[r]->bytes_sent().all_gather;
        ASSERT_TRUE(
            comms[r]
                ->AllGatherBlocks(shard.data(), reference.data(), blocks, DType::kF32, kTimeout)
                .ok());
        const int64_t ring_bytes = comms[r]->bytes_sent().all_gather - before;
        absl::StatusOr<SharedGather::Result> got =
            gathers[r]->Gather(shard.data(), blocks, DType::kF32, kTimeout);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_EQ(comms[r]->bytes_sent().all_gather - before, 2 * ring_bytes);
        const float* full_buffer = static_cast<const float*>(got->full);
        EXPECT_EQ(std::vector<float>(full_buffer, full_buffer + expected.size()), reference)
            << "world " << world << " seed " << seed << " rank " << r;
        EXPECT_EQ(reference, expected);
        // Read by every rank before any rank may overwrite it: with two
        // regions, the next gather but one waits for this release.
        gathers[r]->Release(got->ticket);
      });
    }
    DestroyCommunicators(&comms);
  }
}

// A prefetch window: each rank holds up to `regions` gathers at once and
// releases them out of order (as the engine does with units kept for the
// backward pass); a held region keeps its contents while later gathers
// reuse the others, and a gather beyond the window waits for the release.
TEST(SharedGatherTest, RegionsAreReusedOnlyAfterEveryRankReleased) {
  const int world = 3;
  const int regions = 3;
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, world, "gather", /*shared_memory=*/true);
  const int64_t full = 6000;
  auto gathers = MakeAll(&comms, regions, full * 4);
  std::vector<int64_t> sizes;
  const std::vector<ShardBlock> blocks = RandomLayout(world, full, 42, &sizes);
  const int kGathers = 40;
  RunThreads(world, [&](int r) {
    struct Held {
      int64_t ticket;
      int step;
      const float* data;
    };
    std::vector<Held> held;
    auto check_and_release = [&](size_t index) {
      const Held h = held[index];
      // Each gather's values differ: step s adds s to every element.
      for (const ShardBlock& b : blocks) {
        for (int64_t i = 0; i < b.count; i += 97) {
          ASSERT_EQ(h.data[b.full_offset + i], Value(b.rank, b.shard_offset + i) + h.step)
              << "rank " << r << " gather " << h.step << " was overwritten while held";
        }
      }
      gathers[r]->Release(h.ticket);
      held.erase(held.begin() + index);
    };
    for (int step = 0; step < kGathers; ++step) {
      // Before gather k (= step + 1), gathers up to k - regions must be
      // released (the engine's window); newer ones stay held, and every
      // third step the newest is released first: out of gather order.
      if (step % 3 == 0 && held.size() >= 2) check_and_release(held.size() - 1);
      while (!held.empty() && held.front().ticket <= step + 1 - regions) check_and_release(0);
      std::vector<float> shard = Shard(r, sizes[r]);
      for (float& v : shard) v += static_cast<float>(step);
      absl::StatusOr<SharedGather::Result> got =
          gathers[r]->Gather(shard.data(), blocks, DType::kF32, kTimeout);
      ASSERT_TRUE(got.ok()) << got.status();
      held.push_back({got->ticket, step, static_cast<const float*>(got->full)});
    }
    while (!held.empty()) check_and_release(0);
  });
  DestroyCommunicators(&comms);
}

// A rank that never releases: the next gather into its region times out on
// every rank (DEADLINE_EXCEEDED, naming the release), and later calls fail.
TEST(SharedGatherTest, AGatherWaitsForTheRegionsRelease) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 2, "gather", /*shared_memory=*/true);
  auto gathers = MakeAll(&comms, 1, 4096);
  const std::vector<ShardBlock> blocks = {{0, 0, 0, 8}, {1, 0, 8, 8}};
  std::vector<absl::Status> second(2);
  RunThreads(2, [&](int r) {
    std::vector<float> shard(8, 1.0f);
    auto first = gathers[r]->Gather(shard.data(), blocks, DType::kF32, kTimeout);
    ASSERT_TRUE(first.ok()) << first.status();
    if (r == 0) gathers[r]->Release(first->ticket);  // rank 1 keeps it
    second[r] =
        gathers[r]->Gather(shard.data(), blocks, DType::kF32, absl::Milliseconds(300)).status();
  });
  // The first to time out marks the segment failed; the other may see that
  // first (UNAVAILABLE).
  int timed_out = 0;
  for (const absl::Status& s : second) {
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      ++timed_out;
      EXPECT_THAT(std::string(s.message()), HasSubstr("did not release shared gather buffer 1"));
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    }
  }
  EXPECT_GE(timed_out, 1);
  std::vector<float> shard(8, 1.0f);
  EXPECT_EQ(gathers[0]->Gather(shard.data(), blocks, DType::kF32, kTimeout).status().code(),
            absl::StatusCode::kUnavailable);
  DestroyCommunicators(&comms);
}

// Bad layouts are refused before anything is moved.
TEST(SharedGatherTest, RejectsLayoutsBeyondTheRegion) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 2, "gather", /*shared_memory=*/true);
  auto gathers = MakeAll(&comms, 2, 4096);
  std::vector<float> shard(2048, 1.0f);
  const std::vector<ShardBlock> too_big = {{0, 0, 0, 1024}, {1, 0, 1024, 1024}};
  absl::Status s = gathers[0]->Gather(shard.data(), too_big, DType::kF32, kTimeout).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("regions hold 4096"));
  const std::vector<ShardBlock> bad_rank = {{2, 0, 0, 8}};
  s = gathers[0]->Gather(shard.data(), bad_rank, DType::kF32, kTimeout).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  DestroyCommunicators(&comms);
}

// Over TCP there is no shared gather: every rank gets nullptr.
TEST(SharedGatherTest, NoneOverTcp) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 2, "gather", /*shared_memory=*/false);
  RunThreads(2, [&](int r) {
    absl::StatusOr<SharedGather*> g = comms[r]->MakeSharedGather(3, 1 << 20, kTimeout);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(*g, nullptr);
  });
  DestroyCommunicators(&comms);
}

// Abort() from another thread ends a Gather waiting for a peer that never
// comes (ABORTED), and the peer's next gather fails instead of waiting.
TEST(SharedGatherTest, AbortEndsAWaitingGather) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 2, "gather", /*shared_memory=*/true);
  auto gathers = MakeAll(&comms, 2, 4096);
  const std::vector<ShardBlock> blocks = {{0, 0, 0, 8}, {1, 0, 8, 8}};
  absl::Status status;
  RunThreads(2, [&](int r) {
    if (r == 1) {
      ASSERT_TRUE(comms[0]->AwaitCollectiveInFlight(absl::Seconds(10)));
      comms[0]->Abort();
      return;
    }
    std::vector<float> shard(8, 1.0f);
    status = gathers[0]->Gather(shard.data(), blocks, DType::kF32, kTimeout).status();
  });
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("all_gather aborted (rank 0 of 2"));
  std::vector<float> shard(8, 1.0f);
  absl::Status peer = gathers[1]->Gather(shard.data(), blocks, DType::kF32, kTimeout).status();
  EXPECT_EQ(peer.code(), absl::StatusCode::kUnavailable) << peer;
  DestroyCommunicators(&comms);
}

// ---- A peer in another process that dies ----

// A KeyValueStore in a directory that processes share: one file per key,
// written whole (rename); Get polls.
class DirectoryKvStore : public KeyValueStore {
 public:
  explicit DirectoryKvStore(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    const std::string path = Path(key);
    const std::string tmp = absl::StrCat(path, ".tmp", getpid());
    {
      std::ofstream out(tmp, std::ios::binary);
      out << value;
      if (!out) return absl::InternalError(absl::StrCat("writing ", tmp));
    }
    if (rename(tmp.c_str(), path.c_str()) != 0) {
      return absl::InternalError(absl::StrCat("rename to ", path));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      std::ifstream in(Path(key), std::ios::binary);
      if (in) {
        std::stringstream buffer;
        buffer << in.rdbuf();
        return buffer.str();
      }
      if (absl::Now() >= deadline) return absl::DeadlineExceededError(absl::StrCat("key ", key));
      absl::SleepFor(absl::Milliseconds(2));
    }
  }
  absl::StatusOr<int64_t> Add(const std::string&, int64_t) override {
    return absl::UnimplementedError("Add");
  }
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    for (const std::string& key : keys) {
      absl::StatusOr<std::string> v =
          Get(key, std::max(deadline - absl::Now(), absl::ZeroDuration()));
      if (!v.ok()) return v.status();
    }
    return absl::OkStatus();
  }

 private:
  std::string Path(const std::string& key) const {
    std::string name = key;
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    return absl::StrCat(dir_, "/", name);
  }
  std::string dir_;
};

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string templ = absl::StrCat(base != nullptr ? base : "/tmp", "/shared_gather_XXXXXX");
  char* made = mkdtemp(templ.data());
  return made != nullptr ? std::string(made) : "";
}

std::unique_ptr<HostCommunicator> Connect(KeyValueStore* store, int rank) {
  GlooCommunicator::Options options;
  options.connect_timeout = absl::Seconds(20);
  options.shm_slot_bytes = 8192;
  auto comm = CreateHostCommunicator(store, rank, 2, "gather", options);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().ToString().c_str());
    return nullptr;
  }
  return *std::move(comm);
}

// Rank 1 runs in a child process, which is killed (SIGKILL) while rank 0
// waits in a gather for it — for its data, or (`holds`) for its release of
// the only region. Rank 0 sees it gone (UNAVAILABLE, long before its 20 s
// deadline: the liveness lock, not the timeout).
void PeerKilledMidGather(bool holds) {
  const std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  DirectoryKvStore store(dir);
  const std::vector<ShardBlock> blocks = {{0, 0, 0, 1000}, {1, 0, 1000, 1000}};
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(ready[0]);
    std::unique_ptr<HostCommunicator> comm = Connect(&store, 1);
    if (comm == nullptr) _exit(2);
    absl::StatusOr<SharedGather*> g = comm->MakeSharedGather(1, 8000, kTimeout);
    if (!g.ok() || *g == nullptr) _exit(3);
    std::vector<float> shard(1000, 2.0f);
    auto first = (*g)->Gather(shard.data(), blocks, DType::kF32, kTimeout);
    if (!first.ok()) _exit(4);
    if (!holds) (*g)->Release(first->ticket);
    char byte = 1;
    if (write(ready[1], &byte, 1) != 1) _exit(5);
    pause();  // until killed
    _exit(6);
  }
  close(ready[1]);
  struct Reap {
    pid_t pid;
    ~Reap() {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  } reap{child};
  std::unique_ptr<HostCommunicator> comm = Connect(&store, 0);
  ASSERT_NE(comm, nullptr);
  absl::StatusOr<SharedGather*> g = comm->MakeSharedGather(1, 8000, kTimeout);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_NE(*g, nullptr) << comm->transport_note();
  std::vector<float> shard(1000, 1.0f);
  auto first = (*g)->Gather(shard.data(), blocks, DType::kF32, kTimeout);
  ASSERT_TRUE(first.ok()) << first.status();
  const float* full = static_cast<const float*>(first->full);
  EXPECT_EQ(full[0], 1.0f);
  EXPECT_EQ(full[1999], 2.0f);
  (*g)->Release(first->ticket);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  close(ready[0]);
  // Killed while rank 0 is inside the gather.
  std::thread killer([child, &comm] {
    if (!comm->AwaitCollectiveInFlight(absl::Seconds(10))) ADD_FAILURE() << "no gather began";
    kill(child, SIGKILL);
  });
  absl::Status second = (*g)->Gather(shard.data(), blocks, DType::kF32, kTimeout).status();
  killer.join();
  EXPECT_EQ(second.code(), absl::StatusCode::kUnavailable) << second;
  EXPECT_THAT(std::string(second.message()), HasSubstr("rank 1 is gone"));
}

TEST(SharedGatherDeathTest, PeerKilledWhileRankWaitsForItsData) { PeerKilledMidGather(false); }

TEST(SharedGatherDeathTest, PeerKilledWhileHoldingTheRegion) { PeerKilledMidGather(true); }

}  // namespace
}  // namespace zeroshard
