// #29 item 3 with real processes: a job that floods the KV store with
// StoreWaits of many keys is refused at its own bound (--kv_max_job_bytes,
// which counts what its held waits make the server hold), naming the job,
// the bound and the flag, while another job joins and trains normally.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/zeroshard.grpc.pb.h"
#include "tests/testing/cluster.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

constexpr int64_t kJobBound = 32 << 20;  // --kv_max_job_bytes
constexpr int kWaits = 6;
// ~12 MB held per wait as the server counts it (the parsed request, the
// waiter's keys, the key index): a few fit under the bound, not six.
constexpr int kKeysPerWait = 20000;

TEST(KvIsolationTest, AFloodingJobIsRefusedAtItsBoundWhileAnotherTrains) {
  testing::LocalCluster cluster(testing::MakeTempDir("kv-isolation"),
                                {absl::StrCat("--kv_max_job_bytes=", kJobBound),
                                 absl::StrCat("--kv_max_total_bytes=", int64_t{256} << 20)});
  ASSERT_TRUE(cluster.ok());
  ClientOptions options;
  options.server = cluster.address();
  absl::StatusOr<std::unique_ptr<Client>> flooder = Client::Connect(options);
  ASSERT_TRUE(flooder.ok()) << flooder.status();
  ASSERT_TRUE((*flooder)->Join("flood", 1, "w0", "127.0.0.1", absl::Seconds(20)).ok());
  (*flooder)->StartHeartbeats([](absl::StatusOr<v1::HeartbeatResponse>) {});
  const v1::MemberCredentials member = (*flooder)->credentials();

  absl::Mutex mu;
  std::vector<grpc::Status> answers;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(kWaits);
  std::vector<std::thread> threads;
  for (int t = 0; t < kWaits; ++t) {
    contexts[t] = std::make_unique<grpc::ClientContext>();
    contexts[t]->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    threads.emplace_back([&, t] {
      auto stub = v1::Coordinator::NewStub(
          grpc::CreateChannel(cluster.address(), grpc::InsecureChannelCredentials()));
      v1::StoreWaitRequest request;
      *request.mutable_member() = member;
      request.set_timeout_ms(120000);
      for (int k = 0; k < kKeysPerWait; ++k) {
        request.add_keys(absl::StrFormat("%s-%02d-%06d", std::string(70, 'k'), t, k));
      }
      v1::StoreWaitResponse response;
      grpc::Status s = stub->StoreWait(contexts[t].get(), request, &response);
      absl::MutexLock lock(&mu);
      answers.push_back(s);
    });
  }
  // The refusals come at once; the waits that fit are held.
  grpc::Status refusal;
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        absl::MutexLock lock(&mu);
        for (const grpc::Status& s : answers) {
          if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) refusal = s;
        }
        return !refusal.ok();
      },
      absl::Seconds(60)));
  EXPECT_TRUE(absl::StrContains(refusal.error_message(), "job 'flood'")) << refusal.error_message();
  EXPECT_TRUE(absl::StrContains(refusal.error_message(), "--kv_max_job_bytes"))
      << refusal.error_message();
  EXPECT_TRUE(absl::StrContains(refusal.error_message(), absl::StrCat(kJobBound)))
      << refusal.error_message();

  // Meanwhile another job joins, bootstraps through the store and trains.
  EXPECT_TRUE(cluster.Run("calm", 2,
                          {"--model=mlp", "--layers=2", "--width=32", "--steps=5",
                           "--checkpoint_at_end"},
                          absl::Seconds(90)));

  {
    absl::MutexLock lock(&mu);
    EXPECT_LT(answers.size(), static_cast<size_t>(kWaits)) << "no wait was held";
  }
  for (auto& context : contexts) context->TryCancel();
  for (auto& t : threads) t.join();
  (*flooder)->StopHeartbeats();
}

}  // namespace
}  // namespace zeroshard
