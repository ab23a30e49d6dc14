// #29 finding 6: a full checkpoint root is a recoverable error. Real
// processes and a really full filesystem: the server's checkpoint root is a
// small tmpfs mounted in a private mount namespace of this test (root only),
// which the server and workers started from here inherit. The disk fills
// after the first checkpoint landed; the next one fails on every rank and is
// abandoned, the job trains on, the test frees the space, and a later
// checkpoint lands. Both transports: with fs the workers' writes fail, with
// grpc the server's (the workers stage on a disk of their own).
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/model_zoo.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/cluster.h"
#include "tests/testing/params.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

constexpr int kLayers = 2;
constexpr int kWidth = 16;
// Checkpoints at 5, 10, ..., 30: the first one lands, the disk fills, and
// the test frees it as soon as a failure shows; under a loaded machine the
// test may be late by a few intervals and a later checkpoint still lands.
constexpr int kSteps = 30;
constexpr int kEvery = 5;
constexpr int kStepDelayMs = 150;

// The step of the first "checkpoint step N failed on rank" in `log` (0: none).
int64_t FirstFailedStep(const std::string& log) {
  const std::string marker = "checkpoint step ";
  for (size_t at = log.find(marker); at != std::string::npos; at = log.find(marker, at + 1)) {
    const size_t end = log.find(' ', at + marker.size());
    int64_t step = 0;
    if (end == std::string::npos ||
        !absl::SimpleAtoi(log.substr(at + marker.size(), end - at - marker.size()), &step)) {
      continue;
    }
    if (log.compare(end, 16, " failed on rank ") == 0) return step;
  }
  return 0;
}

std::vector<std::string> MlpFlags(std::vector<std::string> extra) {
  std::vector<std::string> flags = {
      "--model=mlp", absl::StrCat("--layers=", kLayers), absl::StrCat("--width=", kWidth),
      absl::StrCat("--steps=", kSteps), "--seed=5", "--checkpoint_at_end",
      "--collective_timeout=30s"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

// Mounts a tmpfs of `size` at `dir` in a mount namespace of this thread
// only (the test's processes are started from it); an empty string, or the
// reason it could not.
std::string MountPrivateTmpfs(const std::string& dir, const std::string& size) {
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return "mkdir failed";
  if (unshare(CLONE_NEWNS) != 0) return absl::StrCat("unshare(CLONE_NEWNS): ", strerror(errno));
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return absl::StrCat("making / private: ", strerror(errno));
  }
  const std::string options = absl::StrCat("size=", size);
  if (mount("tmpfs", dir.c_str(), "tmpfs", 0, options.c_str()) != 0) {
    return absl::StrCat("mount tmpfs: ", strerror(errno));
  }
  return "";
}

// Writes `path` until the filesystem says ENOSPC; true if it did.
bool FillUntilFull(const std::string& path) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  const std::string chunk(64 << 10, 'x');
  bool full = false;
  while (true) {
    const ssize_t n = write(fd, chunk.data(), chunk.size());
    if (n < 0) {
      full = errno == ENOSPC;
      break;
    }
  }
  // Also the small writes (a manifest, a partial page) must fail.
  while (write(fd, "x", 1) == 1) {
  }
  close(fd);
  return full;
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

nlohmann::json ListCheckpoints(const LocalCluster& cluster, const std::string& job) {
  auto [code, out] = testing::RunCommand(absl::StrCat(testing::RunfilePath("client/shardctl"),
                                                      " --server=", cluster.address(),
                                                      " checkpoints --json --job=", job));
  EXPECT_EQ(code, 0) << out;
  return nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
}

void ExpectCheckpointRetriedAfterAFullDisk(const std::vector<std::string>& transport_flags,
                                           const std::string& name) {
  if (geteuid() != 0) {
    GTEST_SKIP() << "needs root to mount a tmpfs in a private mount namespace (CI runs as root)";
  }
  const std::string dir = testing::MakeTempDir(name);
  const std::string root = dir + "/checkpoints";
  if (std::string why = MountPrivateTmpfs(root, "4m"); !why.empty()) {
    GTEST_SKIP() << "cannot mount a private tmpfs: " << why;
  }
  {
    LocalCluster cluster(dir);
    ASSERT_TRUE(cluster.ok());
    // The same training with only the final checkpoint, undisturbed.
    ASSERT_TRUE(cluster.Run("calm", 2, MlpFlags(transport_flags)));

    std::vector<std::string> flags = MlpFlags(transport_flags);
    flags.push_back(absl::StrCat("--checkpoint_every=", kEvery));
    flags.push_back(absl::StrCat("--test_step_delay_ms=", kStepDelayMs));
    cluster.StartWorkers("full", 2, flags);
    const std::string first = absl::StrCat(root, "/full/step-", kEvery, "/manifest.json");
    ASSERT_TRUE(testing::WaitFor([&] { return Exists(first); }, absl::Seconds(60)));
    const std::string filler = root + "/filler";
    ASSERT_TRUE(FillUntilFull(filler));

    // The first failure frees the disk at once; then every rank must have
    // learnt of it and gone on, and the failure names the error and the retry.
    int64_t failed_step = 0;
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          failed_step = std::max(FirstFailedStep(cluster.WorkerLog(0)),
                                 FirstFailedStep(cluster.WorkerLog(1)));
          return failed_step > 0;
        },
        absl::Seconds(60)))
        << cluster.WorkerLog(0) << cluster.WorkerLog(1);
    ASSERT_EQ(unlink(filler.c_str()), 0);
    ASSERT_LT(failed_step, kSteps) << "the disk filled too late for a retry";
    const std::string failed = absl::StrCat("checkpoint step ", failed_step, " failed on rank ");
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          return absl::StrContains(cluster.WorkerLog(0), failed) &&
                 absl::StrContains(cluster.WorkerLog(1), failed);
        },
        absl::Seconds(60)))
        << cluster.WorkerLog(0) << cluster.WorkerLog(1);
    // The step is abandoned, listed as such, and nothing of it looks complete.
    nlohmann::json list = ListCheckpoints(cluster, "full");
    ASSERT_TRUE(list.contains("checkpoints")) << list.dump();
    bool listed_failure = false;
    for (const nlohmann::json& c : list["checkpoints"]) {
      // int64 fields are JSON strings in proto3's mapping.
      const int64_t step = std::stoll(c.value("step", std::string("0")));
      if (step == failed_step) {
        EXPECT_FALSE(c.value("complete", false)) << c.dump();
        const std::string failure = c.value("failure", "");
        EXPECT_TRUE(absl::StrContains(failure, "No space left on device")) << c.dump();
        EXPECT_TRUE(absl::StrContains(failure, absl::StrCat("retrying at step ", failed_step + kEvery)))
            << c.dump();
        listed_failure = true;
      }
    }
    EXPECT_TRUE(listed_failure) << list.dump();
    EXPECT_FALSE(Exists(absl::StrCat(root, "/full/step-", failed_step, "/manifest.json")));

    const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(120));
    ASSERT_EQ(codes, std::vector<int>({0, 0})) << cluster.WorkerLog(0) << cluster.WorkerLog(1);
    // The run report says what was abandoned.
    EXPECT_FALSE(cluster.Report("full", 0)["checkpoint_failures"].empty());
    EXPECT_FALSE(Exists(absl::StrCat(root, "/full/step-", failed_step, "/rank-0-of-2.safetensors")));
    EXPECT_TRUE(Exists(absl::StrCat(root, "/full/step-", kSteps, "/manifest.json")));

    // The failure changed no computation: the same float operations in the
    // same order, so the same bits.
    absl::StatusOr<ModelSpec> spec = MlpSpec(kLayers, kWidth, "none");
    ASSERT_TRUE(spec.ok());
    const testing::Params calm = testing::LoadCheckpointParams(root, "calm", kSteps, *spec);
    const testing::Params full = testing::LoadCheckpointParams(root, "full", kSteps, *spec);
    EXPECT_EQ(testing::MaxRelativeDifference(full, calm), 0.0);

    auto [code, out] = testing::RunCommand(absl::StrCat(
        testing::RunfilePath("client/shardctl"), " --server=", cluster.address(),
        " consolidate --job=full --step=latest --out=", dir, "/model.safetensors 2>&1"));
    EXPECT_EQ(code, 0) << out;
    EXPECT_TRUE(Exists(dir + "/model.safetensors"));
  }
  umount2(root.c_str(), MNT_DETACH);
}

TEST(FullDiskTest, FsTransportAbandonsTheStepOnEveryRankAndRetries) {
  ExpectCheckpointRetriedAfterAFullDisk({"--checkpoint_transport=fs"}, "full-disk-fs");
}

TEST(FullDiskTest, GrpcUploadToAFullServerRootAbandonsTheStepAndRetries) {
  const std::string staging = testing::MakeTempDir("full-disk-staging");
  ExpectCheckpointRetriedAfterAFullDisk(
      {"--checkpoint_transport=grpc", "--checkpoint_dir=" + staging}, "full-disk-grpc");
  // A committed upload's staged file is removed (the server holds the
  // copy), and an abandoned one's too: the staging directory keeps nothing.
  auto [code, staged] = testing::RunCommand("find " + staging + " -name '*.safetensors*'");
  EXPECT_EQ(code, 0);
  EXPECT_EQ(staged, "") << "left in the staging directory:\n" << staged;
}

// #44 finding 8: the last checkpoint fails on one rank only (its staging
// disk is full; the other's upload lands and waits for the manifest, then
// hears the step was abandoned). Every rank reports, leaves and exits 1 at
// once, saying the last checkpoint failed; none waits --rejoin_timeout
// (5 min) for the other as for a dead rank.
TEST(FullDiskTest, AFailedLastCheckpointEndsEveryRankAtOnce) {
  if (geteuid() != 0) {
    GTEST_SKIP() << "needs root to mount a tmpfs in a private mount namespace (CI runs as root)";
  }
  const std::string dir = testing::MakeTempDir("full-disk-last");
  const std::string full = dir + "/full-staging";
  if (std::string why = MountPrivateTmpfs(full, "1m"); !why.empty()) {
    GTEST_SKIP() << "cannot mount a private tmpfs: " << why;
  }
  {
    ASSERT_TRUE(FillUntilFull(full + "/filler"));
    LocalCluster cluster(dir + "/cluster");
    ASSERT_TRUE(cluster.ok());
    const std::string staging = testing::MakeTempDir("full-disk-last-staging");
    cluster.StartWorkers("last", 2, MlpFlags({"--checkpoint_transport=grpc"}),
                         {{0, {"--checkpoint_dir=" + full}}, {1, {"--checkpoint_dir=" + staging}}});
    // Well under --rejoin_timeout (5 min), which a rank waiting for its
    // peer's replacement would wait out.
    const std::vector<int> codes = cluster.WaitWorkers(absl::Seconds(90));
    EXPECT_EQ(codes, std::vector<int>({1, 1})) << cluster.WorkerLog(0) << cluster.WorkerLog(1);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_TRUE(absl::StrContains(cluster.WorkerLog(rank),
                                    "training finished, but its last checkpoint failed"))
          << cluster.WorkerLog(rank);
    }
    EXPECT_FALSE(
        Exists(absl::StrCat(cluster.checkpoint_root(), "/last/step-", kSteps, "/manifest.json")));
  }
  umount2(full.c_str(), MNT_DETACH);
}

}  // namespace
}  // namespace zeroshard
