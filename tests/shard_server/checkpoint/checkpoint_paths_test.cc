// The checkpoint root's path rules, on real directories and symlinks.
#include "shard_server/checkpoint/checkpoint_paths.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

class CheckpointPathsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("checkpoint_paths");
    outside_ = dir_ + "/outside";
    ASSERT_EQ(mkdir(outside_.c_str(), 0755), 0);
    testing::WriteFile(outside_ + "/secret.safetensors", "secret");
    auto root = CheckpointRoot::Open(dir_ + "/root/nested");
    ASSERT_TRUE(root.ok()) << root.status();
    root_ = std::make_unique<CheckpointRoot>(*root);
  }

  std::string dir_;
  std::string outside_;
  std::unique_ptr<CheckpointRoot> root_;
};

TEST(CheckpointNamesTest, FollowTheShardFileLayout) {
  EXPECT_EQ(CheckpointStepDir("job-1", 20), "job-1/step-20");
  EXPECT_EQ(CheckpointShardPath("job-1", 20, 3, 8), "job-1/step-20/rank-3-of-8.safetensors");
  EXPECT_EQ(ConsolidatedDir("job-1", 20), "job-1/consolidated/step-20");
}

TEST(CheckpointNamesTest, RelativePathsWithDotDotOrAbsoluteAreRefused) {
  EXPECT_TRUE(ValidateRelativePath("j/step-1/rank-0-of-1.safetensors").ok());
  for (const char* bad : {"", "/etc/passwd", "j/../../etc/passwd", "..", "j//step-1", "./j",
                          "j/step-1/"}) {
    absl::Status s = ValidateRelativePath(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad << ": " << s;
    if (std::string(bad).size() > 0) {
      EXPECT_NE(s.message().find(bad), absl::string_view::npos) << s << " names the value";
    }
  }
}

TEST(CheckpointNamesTest, JobIdsArePathSafeNames) {
  EXPECT_TRUE(ValidateJobId("train-1_a.b").ok());
  for (const char* bad : {"", "..", ".hidden", "-x", "a/b", "a b"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ValidateJobId(bad))) << bad;
  }
}

TEST_F(CheckpointPathsTest, OpenCreatesTheRootAndResolvesIt) {
  EXPECT_TRUE(Exists(dir_ + "/root/nested"));
  char* real = realpath((dir_ + "/root/nested").c_str(), nullptr);
  EXPECT_EQ(root_->real_path(), real);
  free(real);
}

TEST_F(CheckpointPathsTest, AFileInsideTheRootPasses) {
  ASSERT_TRUE(root_->MakeDirs("j/step-1").ok());
  testing::WriteFile(root_->Join("j/step-1/rank-0-of-1.safetensors"), "x");
  EXPECT_TRUE(root_->CheckInside("j/step-1/rank-0-of-1.safetensors").ok());
  EXPECT_TRUE(absl::IsNotFound(root_->CheckInside("j/step-1/rank-1-of-2.safetensors")));
}

TEST_F(CheckpointPathsTest, AFileSymlinkLeadingOutIsRefused) {
  ASSERT_TRUE(root_->MakeDirs("j/step-1").ok());
  ASSERT_EQ(symlink((outside_ + "/secret.safetensors").c_str(),
                    root_->Join("j/step-1/rank-0-of-1.safetensors").c_str()),
            0);
  absl::Status s = root_->CheckInside("j/step-1/rank-0-of-1.safetensors");
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("outside the checkpoint root"), absl::string_view::npos) << s;
}

TEST_F(CheckpointPathsTest, ADirectorySymlinkLeadingOutIsRefused) {
  ASSERT_EQ(symlink(outside_.c_str(), root_->Join("j").c_str()), 0);
  ASSERT_EQ(mkdir((outside_ + "/step-1").c_str(), 0755), 0);
  testing::WriteFile(outside_ + "/step-1/rank-0-of-1.safetensors", "x");
  absl::Status s = root_->CheckInside("j/step-1/rank-0-of-1.safetensors");
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  // MakeDirs through the symlink creates nothing outside.
  s = root_->MakeDirs("j/step-2");
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_FALSE(Exists(outside_ + "/step-2"));
}

TEST_F(CheckpointPathsTest, ASymlinkStayingInsideIsAllowed) {
  ASSERT_TRUE(root_->MakeDirs("real/step-1").ok());
  ASSERT_EQ(symlink(root_->Join("real").c_str(), root_->Join("j").c_str()), 0);
  testing::WriteFile(root_->Join("real/step-1/rank-0-of-1.safetensors"), "x");
  EXPECT_TRUE(root_->CheckInside("j/step-1/rank-0-of-1.safetensors").ok());
  EXPECT_TRUE(root_->MakeDirs("j/step-2").ok());
  EXPECT_TRUE(Exists(root_->Join("real/step-2")));
}

TEST_F(CheckpointPathsTest, RemoveDirRemovesFilesButNeverFollowsALink) {
  ASSERT_TRUE(root_->MakeDirs("j/step-1").ok());
  testing::WriteFile(root_->Join("j/step-1/a"), "a");
  ASSERT_EQ(symlink((outside_ + "/secret.safetensors").c_str(), root_->Join("j/step-1/b").c_str()),
            0);
  EXPECT_TRUE(root_->RemoveDir("j/step-1").ok());
  EXPECT_FALSE(Exists(root_->Join("j/step-1")));
  EXPECT_TRUE(Exists(outside_ + "/secret.safetensors"));
  // A symlinked directory: only the link goes.
  ASSERT_EQ(symlink(outside_.c_str(), root_->Join("j/step-2").c_str()), 0);
  EXPECT_TRUE(root_->RemoveDir("j/step-2").ok());
  EXPECT_TRUE(Exists(outside_ + "/secret.safetensors"));
}

}  // namespace
}  // namespace zeroshard
