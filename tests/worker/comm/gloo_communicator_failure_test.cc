// GlooCommunicator when peers do not show up, never call the collective, or
// go away: every call returns a status within its timeout (plus slack).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
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
using ::zeroshard::comm_test::RunThreads;

constexpr absl::Duration kShortTimeout = absl::Milliseconds(500);
// Scheduling slack on a busy 2-core machine.
constexpr absl::Duration kSlack = absl::Milliseconds(1500);

TEST(GlooCommunicatorCreateTest, RejectsBadArguments) {
  InMemoryKvStore store;
  EXPECT_EQ(GlooCommunicator::Create(nullptr, 0, 2, "t").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GlooCommunicator::Create(&store, 2, 2, "t").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GlooCommunicator::Create(&store, 0, 0, "t").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GlooCommunicator::Create(&store, 0, 2, "").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GlooCommunicatorCreateTest, MissingPeerIsDeadlineExceeded) {
  InMemoryKvStore store;
  GlooCommunicator::Options options;
  options.connect_timeout = absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  auto comm = GlooCommunicator::Create(&store, 0, 2, "lonely", options);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("rank 0 of 2, tag 'lonely'"));
  EXPECT_LT(absl::Now() - start, options.connect_timeout + kSlack);
}

TEST(GlooCommunicatorCreateTest, UnresolvableHostIsAnError) {
  InMemoryKvStore store;
  GlooCommunicator::Options options;
  options.hostname = "no-such-host.invalid";
  options.connect_timeout = absl::Milliseconds(300);
  // (Gloo itself crashes on an unresolvable name; Create checks first.)
  for (int i = 0; i < 3; ++i) {
    auto comm = GlooCommunicator::Create(&store, 0, 2, "badhost", options);
    EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument) << comm.status();
    EXPECT_THAT(std::string(comm.status().message()), HasSubstr("no-such-host.invalid"));
  }
}

// Rank 1 never calls the all-gather: rank 0 gets DEADLINE_EXCEEDED after its
// timeout, and the communicator stays unusable.
TEST(GlooCommunicatorFailureTest, AllGatherTimesOutWhenPeerNeverCalls) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 2, "gather");
  ASSERT_NE(comms[0], nullptr);
  ASSERT_NE(comms[1], nullptr);
  std::vector<float> in(16, 1.0f), out(32);
  const absl::Time start = absl::Now();
  absl::Status status = comms[0]->AllGather(in.data(), out.data(), 16, DType::kF32, kShortTimeout);
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("all_gather timed out after 500ms (rank 0 of 2, tag 'gather')"));
  EXPECT_GE(elapsed, kShortTimeout - absl::Milliseconds(10));
  EXPECT_LT(elapsed, kShortTimeout + kSlack);

  // Unusable afterwards, without waiting.
  status = comms[0]->AllGather(in.data(), out.data(), 16, DType::kF32, kShortTimeout);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("unusable"));

  // The late peer fails promptly (its connections were closed), long before
  // its own 5 s timeout.
  const absl::Time late_start = absl::Now();
  status = comms[1]->AllGather(in.data(), out.data(), 16, DType::kF32, absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("all_gather failed: a peer is gone"));
  EXPECT_LT(absl::Now() - late_start, kSlack);
}

// The same for the ring algorithm (own deadline handling), with 3 ranks of
// which rank 2 never calls.
TEST(GlooCommunicatorFailureTest, ReduceScatterTimesOutWhenPeerNeverCalls) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 3, "reduce");
  for (const auto& comm : comms) ASSERT_NE(comm, nullptr);
  std::vector<absl::Status> status(2);
  std::vector<absl::Duration> elapsed(2);
  RunThreads(2, [&](int r) {
    std::vector<float> in(3 * 100, 1.0f), out(100);
    const absl::Time start = absl::Now();
    status[r] = comms[r]->ReduceScatter(in.data(), out.data(), 100, DType::kF32, ReduceOp::kSum,
                                        kShortTimeout);
    elapsed[r] = absl::Now() - start;
  });
  int deadline_exceeded = 0;
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(status[r].ok());
    EXPECT_LT(elapsed[r], kShortTimeout + kSlack) << "rank " << r;
    EXPECT_THAT(std::string(status[r].message()), HasSubstr("reduce_scatter"));
    if (status[r].code() == absl::StatusCode::kDeadlineExceeded) {
      ++deadline_exceeded;
      EXPECT_THAT(std::string(status[r].message()),
                  HasSubstr(absl::StrCat("reduce_scatter timed out after 500ms (rank ", r,
                                         " of 3, tag 'reduce')")));
    } else {
      EXPECT_EQ(status[r].code(), absl::StatusCode::kUnavailable) << status[r];
    }
  }
  // Rank 1 waits on rank 0, which waits on the absent rank 2: rank 0 times
  // out; rank 1 times out too or sees rank 0 close its connections.
  EXPECT_GE(deadline_exceeded, 1);
}

// A rank's communicator is destroyed (its sockets close): the peer gets
// UNAVAILABLE promptly rather than hanging until its timeout.
TEST(GlooCommunicatorFailureTest, DestroyedPeerIsUnavailable) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 2, "gone");
  ASSERT_NE(comms[0], nullptr);
  comms[1].reset();
  std::vector<float> in(1000, 1.0f), out(2000);
  const absl::Time start = absl::Now();
  absl::Status status =
      comms[0]->AllGather(in.data(), out.data(), 1000, DType::kF32, absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("all_gather failed: a peer is gone (connection closed or lost) "
                        "(rank 0 of 2, tag 'gone')"));
  EXPECT_LT(absl::Now() - start, kSlack);
}

// The peer goes away while the others are blocked inside a ring collective;
// ranks that do not talk to it directly fail promptly too, because a failing
// rank closes all of its connections.
TEST(GlooCommunicatorFailureTest, PeerDestroyedDuringRingFailsEveryone) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 3, "ring");
  for (const auto& comm : comms) ASSERT_NE(comm, nullptr);
  std::vector<absl::Status> status(2);
  std::vector<absl::Duration> elapsed(2);
  RunThreads(3, [&](int r) {
    if (r == 2) {
      // Leave only once both others are inside the collective.
      ASSERT_TRUE(comms[0]->AwaitCollectiveInFlight(absl::Seconds(10)));
      ASSERT_TRUE(comms[1]->AwaitCollectiveInFlight(absl::Seconds(10)));
      comms[2].reset();
      return;
    }
    std::vector<float> buf(3000, 1.0f);
    const absl::Time start = absl::Now();
    status[r] =
        comms[r]->AllReduce(buf.data(), 3000, DType::kF32, ReduceOp::kSum, absl::Seconds(10));
    elapsed[r] = absl::Now() - start;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kUnavailable)
        << "rank " << r << ": " << status[r];
    EXPECT_THAT(std::string(status[r].message()), HasSubstr("all_reduce failed: a peer is gone"));
    EXPECT_LT(elapsed[r], kSlack) << "rank " << r;
  }
}

TEST(GlooCommunicatorFailureTest, BarrierTimesOut) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 2, "barrier");
  ASSERT_NE(comms[0], nullptr);
  const absl::Time start = absl::Now();
  absl::Status status = comms[0]->Barrier(kShortTimeout);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("barrier timed out after 500ms"));
  EXPECT_LT(absl::Now() - start, kShortTimeout + kSlack);
}

// Shared memory: rank 1 never calls; rank 0 times out, and rank 1's late
// call fails at once because rank 0 marked the segment failed.
TEST(GlooCommunicatorShmFailureTest, TimesOutWhenPeerNeverCallsAndPeersFailFast) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 2, "gather", /*shared_memory=*/true);
  ASSERT_NE(comms[0], nullptr);
  ASSERT_NE(comms[1], nullptr);
  std::vector<float> in(16, 1.0f), out(32);
  const absl::Time start = absl::Now();
  absl::Status status = comms[0]->AllGather(in.data(), out.data(), 16, DType::kF32, kShortTimeout);
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("all_gather timed out after 500ms (rank 0 of 2, tag 'gather', shared "
                        "memory): rank 1 did not reach the collective"));
  EXPECT_GE(elapsed, kShortTimeout - absl::Milliseconds(10));
  EXPECT_LT(elapsed, kShortTimeout + kSlack);
  status = comms[0]->AllGather(in.data(), out.data(), 16, DType::kF32, kShortTimeout);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("unusable"));

  const absl::Time late_start = absl::Now();
  status = comms[1]->AllGather(in.data(), out.data(), 16, DType::kF32, absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("all_gather failed: a peer is gone"));
  EXPECT_LT(absl::Now() - late_start, kSlack);
}

// Shared memory: a rank closes its communicator (as its process would by
// exiting) while the others wait in a reduce-scatter and an all-reduce: they
// see it gone through its released lock, long before their timeout.
TEST(GlooCommunicatorShmFailureTest, DestroyedPeerIsUnavailableBeforeTheTimeout) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 3, "gone", /*shared_memory=*/true);
  for (const auto& comm : comms) ASSERT_NE(comm, nullptr);
  std::vector<absl::Status> status(2);
  std::vector<absl::Duration> elapsed(2);
  RunThreads(3, [&](int r) {
    if (r == 2) {
      // Leave only once both others are inside the collective.
      ASSERT_TRUE(comms[0]->AwaitCollectiveInFlight(absl::Seconds(10)));
      ASSERT_TRUE(comms[1]->AwaitCollectiveInFlight(absl::Seconds(10)));
      comms[2].reset();
      return;
    }
    std::vector<float> buf(3000, 1.0f), out(1000);
    const absl::Time start = absl::Now();
    status[r] = r == 0 ? comms[r]->ReduceScatter(buf.data(), out.data(), 1000, DType::kF32,
                                                 ReduceOp::kSum, absl::Seconds(20))
                       : comms[r]->AllReduce(buf.data(), 3000, DType::kF32, ReduceOp::kSum,
                                             absl::Seconds(20));
    elapsed[r] = absl::Now() - start;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kUnavailable)
        << "rank " << r << ": " << status[r];
    EXPECT_THAT(std::string(status[r].message()), HasSubstr("failed: a peer is gone"));
    EXPECT_LT(elapsed[r], kSlack) << "rank " << r;
  }
}

// Creates two ranks with per-rank options; returns them.
std::vector<std::unique_ptr<HostCommunicator>> CreatePair(
    InMemoryKvStore* store, const std::string& tag,
    const std::vector<GlooCommunicator::Options>& options) {
  std::vector<std::unique_ptr<HostCommunicator>> comms(2);
  RunThreads(2, [&](int rank) {
    auto comm = CreateHostCommunicator(store, rank, 2, tag, options[rank]);
    ASSERT_TRUE(comm.ok()) << comm.status();
    comms[rank] = *std::move(comm);
  });
  return comms;
}

// Whenever shared memory cannot be used by every rank — one rank has it off,
// the ranks expect different segments, the settings are out of range — all
// ranks stay on TCP, say why, and the collectives work (no rank waits on a
// transport the other does not use).
TEST(GlooCommunicatorShmFailureTest, RanksThatCannotAllUseSharedMemoryAllUseTcp) {
  GlooCommunicator::Options on;
  on.connect_timeout = absl::Seconds(10);
  GlooCommunicator::Options off = on;
  off.shared_memory = false;
  GlooCommunicator::Options other_slot = on;
  other_slot.shm_slot_bytes = on.shm_slot_bytes * 2;
  GlooCommunicator::Options huge = on;
  huge.shm_slot_bytes = int64_t{1} << 50;
  struct Case {
    std::string name;
    std::vector<GlooCommunicator::Options> options;
    std::string why;  // in every rank's transport note
  };
  const std::vector<Case> cases = {
      {"off", {on, off}, "shared memory is off"},
      {"off0", {off, on}, "shared memory is off"},
      {"slots", {on, other_slot}, "same settings"},
      {"huge", {huge, huge}, "outside [4096, 1073741824]"},
  };
  for (const Case& c : cases) {
    InMemoryKvStore store;
    auto comms = CreatePair(&store, c.name, c.options);
    for (int r = 0; r < 2; ++r) {
      ASSERT_NE(comms[r], nullptr) << c.name;
      EXPECT_EQ(comms[r]->transport(), HostTransport::kTcp) << c.name;
      EXPECT_THAT(comms[r]->transport_note(), HasSubstr(c.why)) << c.name;
    }
    std::vector<std::vector<float>> out(2, std::vector<float>(8));
    RunThreads(2, [&](int r) {
      std::vector<float> in(4, static_cast<float>(r + 1));
      absl::Status s = comms[r]->AllGather(in.data(), out[r].data(), 4, DType::kF32, kShortTimeout);
      ASSERT_TRUE(s.ok()) << c.name << ": " << s;
    });
    EXPECT_EQ(out[0], (std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2})) << c.name;
    EXPECT_EQ(out[1], out[0]) << c.name;
  }
}

// Abort() from another thread ends whatever collective rank 0 is blocked in
// (rank 1 never calls it) long before its timeout, over TCP (Gloo's own
// collectives and the rings here) and over shared memory; the peer's next
// collective fails promptly, and so does every later call on rank 0.
constexpr absl::Duration kLong = absl::Seconds(20);

TEST(GlooCommunicatorAbortTest, EndsTheBlockedCollectiveOfEveryKind) {
  struct Case {
    std::string name;
    bool shm;
    std::function<absl::Status(HostCommunicator*, std::vector<float>*)> call;
  };
  const std::vector<ShardBlock> blocks = {{0, 0, 0, 500}, {1, 0, 500, 500}};
  const std::vector<Case> cases = {
      {"all_gather", false,
       [](HostCommunicator* c, std::vector<float>* b) {
         return c->AllGather(b->data(), b->data() + 1000, 1000, DType::kF32, kLong);
       }},
      {"reduce_scatter", false,
       [](HostCommunicator* c, std::vector<float>* b) {
         return c->ReduceScatter(b->data(), b->data() + 2000, 1000, DType::kF32, ReduceOp::kSum,
                                 kLong);
       }},
      {"all_reduce", false,
       [](HostCommunicator* c, std::vector<float>* b) {
         return c->AllReduce(b->data(), 1000, DType::kF32, ReduceOp::kSum, kLong);
       }},
      {"all_gather", false,
       [&blocks](HostCommunicator* c, std::vector<float>* b) {
         return c->AllGatherBlocks(b->data() + 2000, b->data(), blocks, DType::kF32, kLong);
       }},
      {"broadcast", false,
       [](HostCommunicator* c, std::vector<float>* b) {
         return c->Broadcast(b->data(), 1000, DType::kF32, /*root=*/1, kLong);
       }},
      {"barrier", false,
       [](HostCommunicator* c, std::vector<float>*) { return c->Barrier(kLong); }},
      {"all_gather", true,
       [](HostCommunicator* c, std::vector<float>* b) {
         return c->AllGather(b->data(), b->data() + 1000, 1000, DType::kF32, kLong);
       }},
      {"reduce_scatter", true,
       [&blocks](HostCommunicator* c, std::vector<float>* b) {
         return c->ReduceScatterBlocks(b->data(), b->data() + 2000, blocks, DType::kF32,
                                       ReduceOp::kAverage, kLong);
       }},
  };
  int index = 0;
  for (const Case& c : cases) {
    const std::string label = absl::StrCat(c.name, c.shm ? " (shm)" : " (tcp)");
    InMemoryKvStore store;
    auto comms = CreateCommunicators(&store, 2, absl::StrCat("abort", index++), c.shm);
    ASSERT_NE(comms[0], nullptr);
    ASSERT_NE(comms[1], nullptr);
    std::vector<float> buffer(4000, 1.0f);
    absl::Status status;
    absl::Duration elapsed;
    RunThreads(2, [&](int r) {
      if (r == 1) {
        ASSERT_TRUE(comms[0]->AwaitCollectiveInFlight(absl::Seconds(10))) << label;
        comms[0]->Abort();
        return;
      }
      const absl::Time start = absl::Now();
      status = c.call(comms[0].get(), &buffer);
      elapsed = absl::Now() - start;
    });
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << label << ": " << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(absl::StrCat(c.name, " aborted (rank 0 of 2")))
        << label;
    EXPECT_LT(elapsed, kSlack) << label;

    // Later calls on the aborted communicator fail at once.
    absl::Status later = comms[0]->Barrier(kLong);
    EXPECT_EQ(later.code(), absl::StatusCode::kUnavailable) << label << ": " << later;
    // The peer does not wait for its timeout either.
    const absl::Time start = absl::Now();
    absl::Status peer = c.call(comms[1].get(), &buffer);
    EXPECT_FALSE(peer.ok()) << label;
    EXPECT_LT(absl::Now() - start, kSlack) << label << ": " << peer;
  }
}

TEST(GlooCommunicatorAbortTest, AbortBeforeACallIsIdempotentAndFailsTheCall) {
  InMemoryKvStore store;
  auto comms = CreateCommunicators(&store, 2, "early");
  ASSERT_NE(comms[0], nullptr);
  comms[0]->Abort();
  comms[0]->Abort();
  std::vector<float> in(8, 1.0f), out(16);
  absl::Status status = comms[0]->AllGather(in.data(), out.data(), 8, DType::kF32, kShortTimeout);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("was aborted"));
  const absl::Time start = absl::Now();
  status = comms[1]->AllGather(in.data(), out.data(), 8, DType::kF32, absl::Seconds(20));
  EXPECT_FALSE(status.ok());
  EXPECT_LT(absl::Now() - start, kSlack) << status;
}

TEST(GlooCommunicatorAbortTest, SingleRankAbortFailsLaterCalls) {
  InMemoryKvStore store;
  auto comm = GlooCommunicator::Create(&store, 0, 1, "alone");
  ASSERT_TRUE(comm.ok()) << comm.status();
  (*comm)->Abort();
  EXPECT_EQ((*comm)->Barrier(kShortTimeout).code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace zeroshard
