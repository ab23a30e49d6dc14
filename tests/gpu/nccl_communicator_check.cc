// NcclCommunicator on real GPUs: one rank per visible device, as threads of
// this process, bootstrapped through an InMemoryKvStore exactly as shard
// workers bootstrap through the server's store. Checks the collectives'
// results and byte counts for F32 and BF16, two roles (gather / reduce)
// running at once, and every failure path: a missing peer at init, a peer
// that never joins a collective, Abort() from another thread, host buffers.
// Needs a GPU (most cases need two); without one it exits 1 with the
// no-device message. Run by tests/gpu/run.sh.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_util.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/cuda/nccl_communicator.h"

namespace zeroshard {
namespace {

using gpu_test::CudaOrDie;
using gpu_test::DeviceBuffer;
using ::testing::HasSubstr;

constexpr absl::Duration kInitTimeout = absl::Seconds(60);
constexpr absl::Duration kTimeout = absl::Seconds(30);
constexpr absl::Duration kSlack = absl::Seconds(3);

int Devices() {
  int count = 0;
  CudaOrDie(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  return count;
}

// Runs fn(rank) on one thread per rank.
void RunRanks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) threads.emplace_back(fn, rank);
  for (std::thread& t : threads) t.join();
}

std::vector<std::unique_ptr<NcclCommunicator>> CreateAll(KeyValueStore* store, int world,
                                                         const std::string& tag) {
  std::vector<std::unique_ptr<NcclCommunicator>> comms(world);
  RunRanks(world, [&](int rank) {
    auto comm = NcclCommunicator::Create(store, rank, world, /*device=*/rank, tag, kInitTimeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    comms[rank] = *std::move(comm);
  });
  for (const auto& comm : comms) {
    if (comm == nullptr) return {};  // the failure is already recorded
  }
  return comms;
}

// Small integers, exact in BF16 and in sums over a few ranks.
float Value(int rank, int64_t i) { return static_cast<float>((rank + 1) * (i % 7 + 1)); }

// Host values in `dtype`'s encoding, as raw bytes.
std::vector<uint8_t> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&bytes[4 * i], &values[i], 4);
    } else {
      const uint16_t b = FloatToBF16(values[i]);
      std::memcpy(&bytes[2 * i], &b, 2);
    }
  }
  return bytes;
}

std::vector<float> Decode(const std::vector<uint8_t>& bytes, DType dtype) {
  std::vector<float> values(bytes.size() / DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&values[i], &bytes[4 * i], 4);
    } else {
      uint16_t b;
      std::memcpy(&b, &bytes[2 * i], 2);
      values[i] = BF16ToFloat(b);
    }
  }
  return values;
}

// GTEST_SKIP returns from the function it is written in, so it must be in the
// test body itself, not in a helper.
#define REQUIRE_TWO_GPUS()                                                    \
  if (world_ < 2) GTEST_SKIP() << "needs 2 GPUs, found " << world_

class NcclCheck : public ::testing::Test {
 protected:
  void SetUp() override { world_ = Devices(); }
  int world_ = 0;
};

TEST_F(NcclCheck, CollectivesAndByteCounts) {
  const int w = world_;
  // Odd, not a multiple of anything; every element is checked (NCCL before
  // 2.29.7 dropped the last ones of a one-rank average, issue #1950).
  const int64_t count = 1000003;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    InMemoryKvStore store;
    auto comms = CreateAll(&store, w, "check");
    ASSERT_EQ(comms.size(), static_cast<size_t>(w));
    const int64_t esize = DTypeSize(dtype);
    RunRanks(w, [&](int rank) {
      NcclCommunicator& comm = *comms[rank];
      CudaOrDie(cudaSetDevice(rank), "cudaSetDevice");

      // AllGather: every rank's block, in rank order.
      std::vector<float> mine(count);
      for (int64_t i = 0; i < count; ++i) mine[i] = Value(rank, i);
      DeviceBuffer<uint8_t> in(Encode(mine, dtype)), out(w * count * esize);
      ASSERT_TRUE(comm.AllGather(in.get(), out.get(), count, dtype, kTimeout).ok());
      std::vector<float> gathered = Decode(out.Download(), dtype);
      for (int r = 0; r < w; ++r) {
        for (int64_t i = 0; i < count; ++i) {
          ASSERT_EQ(gathered[r * count + i], Value(r, i)) << "all_gather r " << r << " i " << i;
        }
      }

      // ReduceScatter, sum and average: block `rank` of the sum over ranks.
      std::vector<float> full(w * count);
      for (int64_t i = 0; i < w * count; ++i) full[i] = Value(rank, i);
      DeviceBuffer<uint8_t> rs_in(Encode(full, dtype)), rs_out(count * esize);
      const float rank_sum = w * (w + 1) / 2.0f;  // sum over r of (r + 1)
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
        ASSERT_TRUE(comm.ReduceScatter(rs_in.get(), rs_out.get(), count, dtype, op, kTimeout).ok());
        std::vector<float> reduced = Decode(rs_out.Download(), dtype);
        for (int64_t i = 0; i < count; ++i) {
          const float base = static_cast<float>((rank * count + i) % 7 + 1);
          const float want = op == ReduceOp::kSum ? base * rank_sum : base * rank_sum / w;
          ASSERT_NEAR(reduced[i], want, dtype == DType::kF32 ? 1e-5f : want / 128)
              << "reduce_scatter i " << i;
        }
      }

      // AllReduce in place, Broadcast from the last rank, Barrier.
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
        DeviceBuffer<uint8_t> ar(Encode(mine, dtype));
        ASSERT_TRUE(comm.AllReduce(ar.get(), count, dtype, op, kTimeout).ok());
        std::vector<float> reduced = Decode(ar.Download(), dtype);
        for (int64_t i = 0; i < count; ++i) {
          const float base = static_cast<float>(i % 7 + 1);
          const float want = op == ReduceOp::kSum ? base * rank_sum : base * rank_sum / w;
          ASSERT_NEAR(reduced[i], want, dtype == DType::kF32 ? 1e-5f * want : want / 128)
              << "all_reduce i " << i;
        }
      }
      DeviceBuffer<uint8_t> bc(Encode(mine, dtype));
      ASSERT_TRUE(comm.Broadcast(bc.get(), count, dtype, w - 1, kTimeout).ok());
      std::vector<float> broadcast = Decode(bc.Download(), dtype);
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(broadcast[i], Value(w - 1, i)) << "broadcast i " << i;
      }
      ASSERT_TRUE(comm.Barrier(kTimeout).ok());

      // The ring formulas.
      const int64_t n = count * esize;
      const CollectiveBytes bytes = comm.bytes_sent();
      EXPECT_EQ(bytes.all_gather, (w - 1) * n);
      EXPECT_EQ(bytes.reduce_scatter, 2 * (w - 1) * n);  // two calls
      EXPECT_EQ(bytes.all_reduce, 2 * 2 * (w - 1) * n / w);  // two calls
      EXPECT_EQ(bytes.broadcast, w == 1 || (rank + 1) % w == w - 1 ? 0 : n);
      EXPECT_TRUE(comm.health().ok());
    });
  }
}

TEST_F(NcclCheck, GatherAndReduceRolesRunConcurrently) {
  const int w = world_;
  InMemoryKvStore store;
  std::vector<std::unique_ptr<NcclCommunicator>> gather(w), reduce(w);
  RunRanks(w, [&](int rank) {
    auto g = NcclCommunicator::Create(&store, rank, w, rank, "gather", kInitTimeout);
    ASSERT_TRUE(g.ok()) << g.status();
    auto r = NcclCommunicator::Create(&store, rank, w, rank, "reduce", kInitTimeout);
    ASSERT_TRUE(r.ok()) << r.status();
    gather[rank] = *std::move(g);
    reduce[rank] = *std::move(r);
  });
  for (int rank = 0; rank < w; ++rank) {
    ASSERT_NE(gather[rank], nullptr);
    ASSERT_NE(reduce[rank], nullptr);
  }
  ASSERT_NE(gather[0]->stream(), reduce[0]->stream()) << "one stream per role";
  const int64_t count = 1 << 20;
  std::atomic<int> failures{0};
  RunRanks(w, [&](int rank) {
    std::thread gathers([&] {
      CudaOrDie(cudaSetDevice(rank), "cudaSetDevice");
      DeviceBuffer<float> in(std::vector<float>(count, rank + 1.0f)), out(w * count);
      for (int i = 0; i < 20; ++i) {
        if (!gather[rank]->AllGather(in.get(), out.get(), count, DType::kF32, kTimeout).ok()) {
          ++failures;
        }
      }
      if (out.Download()[(w - 1) * count] != w) ++failures;
    });
    std::thread reductions([&] {
      CudaOrDie(cudaSetDevice(rank), "cudaSetDevice");
      DeviceBuffer<float> in(std::vector<float>(w * count, 1.0f)), out(count);
      for (int i = 0; i < 20; ++i) {
        if (!reduce[rank]
                 ->ReduceScatter(in.get(), out.get(), count, DType::kF32, ReduceOp::kSum, kTimeout)
                 .ok()) {
          ++failures;
        }
      }
      if (out.Download()[count - 1] != w) ++failures;
    });
    gathers.join();
    reductions.join();
  });
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(NcclCheck, InitWithoutPeersIsDeadlineExceeded) {
  InMemoryKvStore store;
  const absl::Duration timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  // World 2, but rank 1 never comes.
  auto comm = NcclCommunicator::Create(&store, 0, 2, 0, "alone", timeout);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_LT(absl::Now() - start, timeout + kSlack);
  // And a rank waiting for an id nobody publishes.
  auto waiting = NcclCommunicator::Create(&store, 1, 2, 0, "no_rank_zero", timeout);
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kDeadlineExceeded) << waiting.status();
  EXPECT_THAT(std::string(waiting.status().message()), HasSubstr("nccl/no_rank_zero/unique_id"));
}

TEST_F(NcclCheck, PeerThatNeverCallsIsDeadlineExceededThenUnusable) {
  REQUIRE_TWO_GPUS();
  InMemoryKvStore store;
  auto comms = CreateAll(&store, world_, "missing");
  ASSERT_EQ(comms.size(), static_cast<size_t>(world_));
  CudaOrDie(cudaSetDevice(0), "cudaSetDevice");
  DeviceBuffer<float> buffer(1024);
  const absl::Duration timeout = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  absl::Status status =
      comms[0]->AllReduce(buffer.get(), 1024, DType::kF32, ReduceOp::kSum, timeout);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("all_reduce timed out after 500ms"));
  EXPECT_LT(absl::Now() - start, timeout + kSlack);
  absl::Status after = comms[0]->Barrier(kTimeout);
  EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << after;
  EXPECT_FALSE(comms[0]->health().ok());
  // The others never saw a collective; abort them so teardown is quick.
  for (auto& comm : comms) comm->Abort();
}

TEST_F(NcclCheck, AbortFromAnotherThreadEndsAWaitingCollective) {
  REQUIRE_TWO_GPUS();
  InMemoryKvStore store;
  auto comms = CreateAll(&store, world_, "abort");
  ASSERT_EQ(comms.size(), static_cast<size_t>(world_));
  CudaOrDie(cudaSetDevice(0), "cudaSetDevice");
  DeviceBuffer<float> buffer(1024);
  std::thread aborter([&] {
    if (!comms[0]->AwaitCollectiveInFlight(absl::Seconds(30))) ADD_FAILURE() << "no call began";
    comms[0]->Abort();  // what the worker does when the server reports a new generation
  });
  const absl::Time start = absl::Now();
  absl::Status status =
      comms[0]->AllReduce(buffer.get(), 1024, DType::kF32, ReduceOp::kSum, absl::Seconds(60));
  aborter.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_LT(absl::Now() - start, kSlack);
  EXPECT_EQ(comms[0]->Barrier(kTimeout).code(), absl::StatusCode::kUnavailable);
  for (auto& comm : comms) comm->Abort();
}

TEST_F(NcclCheck, HostBuffersAreRejected) {
  InMemoryKvStore store;
  auto comm = NcclCommunicator::Create(&store, 0, 1, 0, "host", kInitTimeout);
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::vector<float> host(16), out(16);
  absl::Status status = (*comm)->AllGather(host.data(), out.data(), 16, DType::kF32, kTimeout);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("not device memory"));
  EXPECT_TRUE((*comm)->health().ok()) << "argument errors must not break the communicator";
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) { return zeroshard::gpu_test::RunIfGpu(argc, argv); }
