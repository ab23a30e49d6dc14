// Helpers for running several ranks as threads of one test process.
#ifndef ZEROSHARD_TESTS_WORKER_COMM_COMM_TEST_UTIL_H_
#define ZEROSHARD_TESTS_WORKER_COMM_COMM_TEST_UTIL_H_

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_store.h"

namespace zeroshard {
namespace comm_test {

// Runs fn(0) .. fn(n - 1) on n threads and waits for all of them, at most
// `limit`: a hang aborts the test binary instead of waiting for Bazel's
// timeout.
inline void RunThreads(int n, const std::function<void(int)>& fn,
                       absl::Duration limit = absl::Seconds(30)) {
  struct Shared {
    absl::Mutex mu;
    int done = 0;
  };
  auto shared = std::make_shared<Shared>();
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([shared, fn, i] {
      fn(i);
      absl::MutexLock lock(&shared->mu);
      ++shared->done;
    });
  }
  {
    absl::MutexLock lock(&shared->mu);
    const int target = n;
    auto all_done = [&shared, target] { return shared->done == target; };
    if (!shared->mu.AwaitWithTimeout(absl::Condition(&all_done), limit)) {
      std::fprintf(stderr, "RunThreads: %d threads still running after %s; aborting\n",
                   n - shared->done, absl::FormatDuration(limit).c_str());
      std::abort();
    }
  }
  for (std::thread& t : threads) t.join();
}

// Creates world_size communicators for `tag` over `store`, one per rank,
// connecting concurrently. With `shared_memory`, the gathers and reductions
// go through shared memory with the smallest slots allowed (so that even
// small collectives take several rounds); otherwise over TCP.
inline std::vector<std::unique_ptr<HostCommunicator>> CreateCommunicators(
    KeyValueStore* store, int world_size, const std::string& tag, bool shared_memory = false) {
  std::vector<std::unique_ptr<HostCommunicator>> comms(world_size);
  RunThreads(world_size, [&](int rank) {
    GlooCommunicator::Options options;
    options.hostname = "127.0.0.1";
    options.connect_timeout = absl::Seconds(10);
    options.shared_memory = shared_memory;
    options.shm_slot_bytes = 4096 * world_size;
    auto comm = CreateHostCommunicator(store, rank, world_size, tag, options);
    ASSERT_TRUE(comm.ok()) << comm.status();
    if (world_size > 1) {
      EXPECT_EQ((*comm)->transport(),
                shared_memory ? HostTransport::kSharedMemory : HostTransport::kTcp)
          << (*comm)->transport_note();
    }
    comms[rank] = *std::move(comm);
  });
  for (const auto& comm : comms) {
    if (comm == nullptr) ADD_FAILURE() << "a communicator was not created";
  }
  return comms;
}

// Destroys communicators concurrently (each takes a few tens of ms to stop
// its Gloo event loop).
inline void DestroyCommunicators(std::vector<std::unique_ptr<HostCommunicator>>* comms) {
  RunThreads(static_cast<int>(comms->size()), [comms](int i) { (*comms)[i].reset(); });
  comms->clear();
}

}  // namespace comm_test
}  // namespace zeroshard

#endif  // ZEROSHARD_TESTS_WORKER_COMM_COMM_TEST_UTIL_H_
