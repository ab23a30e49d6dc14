// The host-side parts of the NCCL data plane, which need no GPU: the unique id
// exchange through the KV store (ncclGetUniqueId works without a device) and
// the device check that makes GPU entry points fail clearly on CPU machines.
#include <cuda_runtime_api.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/cuda/cuda_device.h"

namespace zeroshard {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// Scheduling slack on a busy 2-core machine.
constexpr absl::Duration kSlack = absl::Milliseconds(1500);

int VisibleDevices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

TEST(NcclUniqueIdTest, RankZeroPublishesAndEveryRankGetsTheSameId) {
  InMemoryKvStore store;
  constexpr int kWorld = 4;
  std::vector<absl::StatusOr<std::string>> ids(kWorld, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  // Ranks 1..3 start first and must wait for rank 0's publication: rank 0
  // publishes once all three are blocked on the key.
  for (int rank = kWorld - 1; rank >= 0; --rank) {
    threads.emplace_back([&ids, &store, rank] {
      if (rank == 0 && !store.AwaitReaderBlocks(kWorld - 1, absl::Seconds(20))) {
        ADD_FAILURE() << "ranks 1.." << kWorld - 1 << " did not all block on the id";
      }
      ids[rank] = PublishOrFetchNcclUniqueId(&store, rank, "gather", absl::Seconds(20));
    });
  }
  for (std::thread& t : threads) t.join();

  ASSERT_TRUE(ids[0].ok()) << ids[0].status();
  EXPECT_EQ(ids[0]->size(), 128u);  // NCCL_UNIQUE_ID_BYTES
  EXPECT_NE(*ids[0], std::string(128, '\0')) << "ncclGetUniqueId returned an all-zero id";
  for (int rank = 1; rank < kWorld; ++rank) {
    ASSERT_TRUE(ids[rank].ok()) << "rank " << rank << ": " << ids[rank].status();
    EXPECT_EQ(*ids[rank], *ids[0]) << "rank " << rank;
  }
  absl::StatusOr<std::string> stored = store.Get("nccl/gather/unique_id", absl::ZeroDuration());
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(*stored, *ids[0]);
  EXPECT_EQ(NcclUniqueIdKey("gather"), "nccl/gather/unique_id");
}

TEST(NcclUniqueIdTest, EachTagGetsItsOwnId) {
  InMemoryKvStore store;
  absl::StatusOr<std::string> gather =
      PublishOrFetchNcclUniqueId(&store, 0, "gather", absl::Seconds(1));
  absl::StatusOr<std::string> reduce =
      PublishOrFetchNcclUniqueId(&store, 0, "reduce", absl::Seconds(1));
  ASSERT_TRUE(gather.ok()) << gather.status();
  ASSERT_TRUE(reduce.ok()) << reduce.status();
  EXPECT_NE(*gather, *reduce);
  absl::StatusOr<std::string> fetched =
      PublishOrFetchNcclUniqueId(&store, 1, "reduce", absl::Seconds(1));
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(*fetched, *reduce);
}

TEST(NcclUniqueIdTest, MissingRankZeroIsDeadlineExceededWithinTheTimeout) {
  InMemoryKvStore store;
  const absl::Duration timeout = absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> id = PublishOrFetchNcclUniqueId(&store, 2, "lonely", timeout);
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDeadlineExceeded) << id.status();
  EXPECT_THAT(std::string(id.status().message()), HasSubstr("rank 2, tag 'lonely'"));
  EXPECT_THAT(std::string(id.status().message()), HasSubstr("nccl/lonely/unique_id"));
  EXPECT_GE(elapsed, timeout - absl::Milliseconds(10));
  EXPECT_LT(elapsed, timeout + kSlack);
}

TEST(NcclUniqueIdTest, CorruptIdIsDataLoss) {
  InMemoryKvStore store;
  ASSERT_TRUE(store.Set("nccl/short/unique_id", "not 128 bytes").ok());
  absl::StatusOr<std::string> id = PublishOrFetchNcclUniqueId(&store, 1, "short", absl::Seconds(1));
  EXPECT_EQ(id.status().code(), absl::StatusCode::kDataLoss) << id.status();
  EXPECT_THAT(std::string(id.status().message()), HasSubstr("13 bytes, expected 128"));
}

TEST(NcclUniqueIdTest, RejectsBadArguments) {
  InMemoryKvStore store;
  EXPECT_EQ(PublishOrFetchNcclUniqueId(nullptr, 0, "t", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PublishOrFetchNcclUniqueId(&store, -1, "t", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PublishOrFetchNcclUniqueId(&store, 0, "", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// On a machine without a GPU (CI), the exact message; with GPUs, the range
// check instead.
TEST(CheckCudaDeviceTest, NoDeviceIsFailedPreconditionPointingToGloo) {
  const int devices = VisibleDevices();
  if (devices > 0) {
    EXPECT_TRUE(CheckCudaDevice(0).ok()) << CheckCudaDevice(0);
    absl::Status missing = CheckCudaDevice(devices);
    EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition) << missing;
    EXPECT_THAT(std::string(missing.message()), HasSubstr("not found"));
    return;
  }
  absl::Status status = CheckCudaDevice(0);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()),
              StartsWith("no CUDA device found (cudaGetDeviceCount: "));
  EXPECT_THAT(std::string(status.message()), EndsWith("); --backend=gloo runs on CPUs"));
  EXPECT_EQ(CheckCudaDevice(-1).code(), absl::StatusCode::kInvalidArgument);
}

TEST(NcclCommunicatorTest, CreateWithoutDeviceFailsBeforeTouchingTheStore) {
  if (VisibleDevices() > 0) GTEST_SKIP() << "this machine has a CUDA device";
  InMemoryKvStore store;
  auto comm = NcclCommunicator::Create(&store, 0, 2, 0, "gather", absl::Seconds(1));
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("no CUDA device found"));
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("--backend=gloo runs on CPUs"));
  // Rank 0 must not have published an id the others would wait on.
  EXPECT_EQ(store.size(), 0u);
}

TEST(NcclCommunicatorTest, CreateRejectsBadArguments) {
  InMemoryKvStore store;
  const absl::Duration t = absl::Seconds(1);
  EXPECT_EQ(NcclCommunicator::Create(nullptr, 0, 2, 0, "t", t).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(&store, 2, 2, 0, "t", t).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(&store, 0, 0, 0, "t", t).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(&store, 0, 2, 0, "", t).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(&store, 0, 2, 0, "t", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard
