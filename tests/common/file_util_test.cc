#include "common/file_util.h"

#include <dirent.h>
#include <sys/stat.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

// A fresh, empty directory per test.
std::string TestDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/file_util_" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name();
  mkdir(dir.c_str(), 0777);
  return dir;
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  return names;
}

TEST(FileUtilTest, WriteAtomicallyCreatesAndReplaces) {
  const std::string dir = TestDir();
  const std::string path = dir + "/out.bin";
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  absl::StatusOr<std::string> read = ReadFileToString(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "first");
  std::string binary("a\0b", 3);
  ASSERT_TRUE(WriteFileAtomically(path, binary).ok());
  EXPECT_EQ(*ReadFileToString(path), binary);
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"out.bin"});
}

TEST(FileUtilTest, UncommittedAtomicFileLeavesNothing) {
  const std::string dir = TestDir();
  const std::string path = dir + "/never.bin";
  {
    absl::StatusOr<std::unique_ptr<AtomicFile>> file = AtomicFile::Create(path);
    ASSERT_TRUE(file.ok()) << file.status();
    ASSERT_TRUE((*file)->Write("data", 4).ok());
    EXPECT_EQ((*file)->temp_path().rfind(path + ".tmp-", 0), 0u) << (*file)->temp_path();
    EXPECT_EQ(ListDir(dir).size(), 1u);  // the temp file
  }
  EXPECT_TRUE(ListDir(dir).empty());
  EXPECT_EQ(ReadFileToString(path).status().code(), absl::StatusCode::kNotFound);
}

TEST(FileUtilTest, UncommittedAtomicFileKeepsOldContents) {
  const std::string dir = TestDir();
  const std::string path = dir + "/keep.bin";
  ASSERT_TRUE(WriteFileAtomically(path, "old").ok());
  {
    auto file = AtomicFile::Create(path);
    ASSERT_TRUE(file.ok());
    ASSERT_TRUE((*file)->Write("new", 3).ok());
  }
  EXPECT_EQ(*ReadFileToString(path), "old");
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"keep.bin"});
}

TEST(FileUtilTest, CommitOnceThenWritesFail) {
  const std::string dir = TestDir();
  auto file = AtomicFile::Create(dir + "/once.bin");
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*file)->Write("ab", 2).ok());
  ASSERT_TRUE((*file)->Write("cd", 2).ok());
  ASSERT_TRUE((*file)->Commit().ok());
  EXPECT_EQ((*file)->Write("x", 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*file)->Commit().code(), absl::StatusCode::kFailedPrecondition);
  file->reset();  // destroying a committed file keeps it
  EXPECT_EQ(*ReadFileToString(dir + "/once.bin"), "abcd");
}

TEST(FileUtilTest, Errors) {
  const std::string dir = TestDir();
  absl::Status status = WriteFileAtomically(dir + "/no/such/dir/f", "x");
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(status.message().find("no/such/dir"), std::string::npos) << status;
  EXPECT_EQ(AtomicFile::Create("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadFileToString(dir + "/missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(FileUtilTest, StringSinkAppends) {
  std::string out;
  StringSink sink(&out);
  ASSERT_TRUE(sink.Write("ab", 2).ok());
  ASSERT_TRUE(sink.Write("c", 1).ok());
  EXPECT_EQ(out, "abc");
}

}  // namespace
}  // namespace zeroshard
