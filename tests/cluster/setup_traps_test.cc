// Setup that cannot go wrong silently across hosts: each trap of a first run
// on several hosts ends with a message that says what is wrong within 10 s.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/cluster/across_hosts.h"
#include "tests/testing/emulated_hosts.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

constexpr absl::Duration kWithin = absl::Seconds(10);

class SetupTrapsTest : public AcrossHostsTest {
 protected:
  std::unique_ptr<ChildProcess> StartServer(const std::vector<std::string>& args,
                                            const std::string& name) {
    // --insecure: these servers listen on an emulated host's address with
    // no authentication, which a server refuses unless told.
    std::vector<std::string> flags = args;
    flags.push_back("--insecure");
    return hosts_->Start(kServerHost, RunfilePath("shard_server/shard_server"), flags,
                         absl::StrCat(dir_, "/", name, ".log"));
  }
  bool MakeHosts() {
    absl::StatusOr<std::unique_ptr<EmulatedHosts>> hosts = EmulatedHosts::Create(3);
    EXPECT_TRUE(hosts.ok()) << hosts.status();  // never a silent skip
    if (hosts.ok()) hosts_ = *std::move(hosts);
    return hosts.ok();
  }
  // The log of `process` contains `text` within kWithin.
  static bool Says(ChildProcess& process, const std::string& text) {
    return WaitFor([&] { return process.Log().find(text) != std::string::npos; }, kWithin);
  }

  const std::string dir_ = MakeTempDir("traps");
};

TEST_F(SetupTrapsTest, TheDefaultHostIsTheAddressOfTheRouteToTheServer) {
  ASSERT_TRUE(StartCluster());
  // "--host=" last: the flag's default, whatever the cluster passed before.
  cluster_->StartWorkers("default-host", 4, Flags({"--steps=5", "--host="}));
  EXPECT_TRUE(AllExitZero(absl::Seconds(60)));
  const std::string log = cluster_->server()->Log();
  for (int host : {1, 2}) {
    EXPECT_NE(log.find(absl::StrCat("host=", hosts_->address(host))), std::string::npos) << log;
  }
  EXPECT_EQ(log.find("host=127.0.0.1"), std::string::npos) << log;
}

TEST_F(SetupTrapsTest, LoopbackAddressesAcrossHostsAreRefusedNamingThem) {
  ASSERT_TRUE(StartCluster());
  cluster_->StartWorkers("loopback", 4, Flags({"--steps=5", "--host=127.0.0.1"}));
  const std::vector<int> codes = cluster_->WaitWorkers(kWithin);
  for (size_t r = 0; r < codes.size(); ++r) {
    const std::string log = cluster_->WorkerLog(r);
    EXPECT_NE(codes[r], 0) << log;
    EXPECT_EQ(codes[r] == -1, false) << "still waiting after 10 s:\n" << log;
    EXPECT_NE(log.find("run on 2 machines but w0 (127.0.0.1), w1 (127.0.0.1), w2 (127.0.0.1), "
                       "w3 (127.0.0.1) advertise a loopback address"),
              std::string::npos)
        << log;
  }
}

TEST_F(SetupTrapsTest, AWorkerThatCannotReachTheServerSaysSoEveryFewSeconds) {
  ASSERT_TRUE(MakeHosts());
  // A server that remote workers cannot reach: listening on its loopback.
  auto server = StartServer({"--listen=127.0.0.1:7070"}, "server");
  auto worker = hosts_->Start(
      1, RunfilePath("worker/shard_worker"),
      {absl::StrCat("--server=", hosts_->address(kServerHost), ":7070"), "--job=unreachable",
       "--world_size=2", "--worker_id=w0", "--model=mlp", "--steps=1"},
      dir_ + "/worker.log");
  EXPECT_TRUE(Says(*worker, absl::StrCat("the server at ", hosts_->address(kServerHost),
                                         ":7070 has not accepted it")))
      << worker->Log();
  EXPECT_TRUE(Says(*worker, "last error: UNAVAILABLE")) << worker->Log();
  // And again a few seconds later, while it keeps trying.
  const size_t first = worker->Log().find("has not accepted it");
  EXPECT_TRUE(WaitFor(
      [&] { return worker->Log().find("has not accepted it", first + 1) != std::string::npos; },
      kWithin))
      << worker->Log();
}

TEST_F(SetupTrapsTest, ASilentlyDroppedServerIsReportedToo) {
  ASSERT_TRUE(MakeHosts());
  auto server =
      StartServer({absl::StrCat("--listen=", hosts_->address(kServerHost), ":7070")}, "server");
  ASSERT_TRUE(hosts_->CutOff(kServerHost).ok());
  auto worker = hosts_->Start(
      1, RunfilePath("worker/shard_worker"),
      {absl::StrCat("--server=", hosts_->address(kServerHost), ":7070"), "--job=dropped",
       "--world_size=2", "--worker_id=w0", "--model=mlp", "--steps=1"},
      dir_ + "/worker.log");
  EXPECT_TRUE(Says(*worker, "has not accepted it")) << worker->Log();
  EXPECT_TRUE(Says(*worker, "last error:")) << worker->Log();
}

TEST_F(SetupTrapsTest, ASecondServerOnAnAddressInUseFailsToStart) {
  ASSERT_TRUE(MakeHosts());
  const std::string listen = absl::StrCat("--listen=", hosts_->address(kServerHost), ":7070");
  auto first = StartServer({listen, "--state_dir=" + dir_ + "/a"}, "first");
  ASSERT_TRUE(Says(*first, "listening")) << first->Log();
  auto second = StartServer({listen, "--state_dir=" + dir_ + "/b"}, "second");
  EXPECT_NE(second->Wait(kWithin), 0) << second->Log();
  EXPECT_NE(second->Log().find("cannot listen on"), std::string::npos) << second->Log();
  EXPECT_TRUE(first->running());
}

TEST_F(SetupTrapsTest, TwoServersCannotShareAStateDirectory) {
  ASSERT_TRUE(MakeHosts());
  const std::string state = "--state_dir=" + dir_ + "/state";
  auto first = StartServer(
      {absl::StrCat("--listen=", hosts_->address(kServerHost), ":7070"), state}, "first");
  ASSERT_TRUE(Says(*first, "listening")) << first->Log();
  auto second = StartServer(
      {absl::StrCat("--listen=", hosts_->address(kServerHost), ":7071"), state}, "second");
  EXPECT_NE(second->Wait(kWithin), 0) << second->Log();
  EXPECT_NE(second->Log().find(absl::StrCat("is in use by another shard_server (process ")),
            std::string::npos)
      << second->Log();
  EXPECT_TRUE(first->running());
}

}  // namespace
}  // namespace zeroshard::testing
