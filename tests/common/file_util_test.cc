#include "common/file_util.h"

#include <dirent.h>
#include <sys/stat.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
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

// Direct mode: whole 8 KiB blocks through O_DIRECT, the tail through the
// page cache; the bytes come out the same whatever the write sizes, on a
// filesystem that takes O_DIRECT (the test tmpdir) and on one that may not
// (/dev/shm, tmpfs: the fallback).
TEST(FileUtilTest, DirectModeWritesTheSameBytes) {
  std::vector<std::string> dirs = {TestDir()};
  if (mkdir("/dev/shm/zeroshard_file_util_test", 0777) == 0 || errno == EEXIST) {
    dirs.push_back("/dev/shm/zeroshard_file_util_test");
  }
  for (const std::string& dir : dirs) {
    for (size_t total : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{8192},
                         size_t{3 * 8192 + 4096 + 17}}) {
      std::string data(total, '\0');
      for (size_t i = 0; i < total; ++i) data[i] = static_cast<char>((i * 131 + 7) % 251);
      const std::string path = dir + "/direct_" + std::to_string(total) + ".bin";
      AtomicFileOptions options;
      options.direct = true;
      options.block_bytes = 8192;
      auto file = AtomicFile::Create(path, options);
      ASSERT_TRUE(file.ok()) << file.status();
      // Uneven pieces, crossing block boundaries.
      for (size_t at = 0, piece = 1; at < total; at += piece, piece = piece * 3 + 1) {
        piece = std::min(piece, total - at);
        ASSERT_TRUE((*file)->Write(data.data() + at, piece).ok());
      }
      ASSERT_TRUE((*file)->Commit().ok()) << dir << " " << total;
      absl::StatusOr<std::string> read = ReadFileToString(path);
      ASSERT_TRUE(read.ok()) << read.status();
      EXPECT_EQ(*read, data) << dir << " " << total << " bytes";
      unlink(path.c_str());
    }
    // Abandoned in direct mode: nothing left behind.
    {
      AtomicFileOptions options;
      options.direct = true;
      options.block_bytes = 8192;
      auto file = AtomicFile::Create(dir + "/abandoned.bin", options);
      ASSERT_TRUE(file.ok());
      std::string block(20000, 'x');
      ASSERT_TRUE((*file)->Write(block.data(), block.size()).ok());
    }
    for (const std::string& name : ListDir(dir)) {
      EXPECT_EQ(name.find("abandoned"), std::string::npos) << name;
    }
  }
  rmdir("/dev/shm/zeroshard_file_util_test");
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
