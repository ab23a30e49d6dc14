// Byte sinks and crash-safe file replacement.
#ifndef ZEROSHARD_COMMON_FILE_UTIL_H_
#define ZEROSHARD_COMMON_FILE_UTIL_H_

#include <cstddef>
#include <future>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

// Where streamed bytes go: a file, an RPC stream, a buffer. Write() takes all
// `size` bytes or fails; after a failure the sink is unusable.
class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual absl::Status Write(const void* data, size_t size) = 0;
};

// Appends to a std::string (tests, small files).
class StringSink : public ByteSink {
 public:
  explicit StringSink(std::string* out) : out_(out) {}
  absl::Status Write(const void* data, size_t size) override {
    out_->append(static_cast<const char*>(data), size);
    return absl::OkStatus();
  }

 private:
  std::string* out_;  // not owned
};

// A file that appears at `path` complete or not at all. Bytes go to
// "<path>.tmp-<random>" in the same directory; Commit() fsyncs it, renames it
// over `path` and fsyncs the directory, so after a crash `path` holds either
// the old or the new contents. Destroying an uncommitted AtomicFile removes
// the temp file.
struct AtomicFileOptions {
  // Write the data through O_DIRECT in aligned blocks of `block_bytes`
  // (the unaligned tail through the page cache, at Commit): a large output
  // goes to disk without being copied into and filling the page cache —
  // copying multi-GB files into fresh page-cache pages costs several times
  // more CPU than the DMA, and evicts the caller's working set. Where the
  // filesystem refuses O_DIRECT (tmpfs, some network filesystems), writes go
  // through the page cache as usual.
  bool direct = false;
  size_t block_bytes = size_t{8} << 20;  // a multiple of 4096
};

// OK when nothing is at `path` or a regular file is (through a symlink
// too); FAILED_PRECONDITION naming what is there otherwise (a device, a FIFO,
// a directory, a socket): a rename over it would replace it, and as root
// that replaced /dev/full.
absl::Status CheckReplaceable(const std::string& path);

class AtomicFile : public ByteSink {
 public:
  static absl::StatusOr<std::unique_ptr<AtomicFile>> Create(const std::string& path,
                                                            const AtomicFileOptions& options = {});
  ~AtomicFile() override;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  absl::Status Write(const void* data, size_t size) override;
  // Writes `size` bytes at `offset` over what Write wrote there (a header
  // whose contents are known only after the data: checksums). REQUIRES:
  // not direct mode; the range already written.
  absl::Status Overwrite(int64_t offset, const void* data, size_t size);
  // Once only; FAILED_PRECONDITION after a failed Write or a second Commit.
  // Sync() then Publish().
  absl::Status Commit();
  // The two halves of Commit, for a caller that must decide, after the bytes
  // are durable, whether they may replace `path` (and decide it atomically
  // with the rename): Sync writes what is buffered, fsyncs and closes the
  // temporary file; Publish renames it to `path` and fsyncs the directory.
  // A file that is synced but never published is removed by the destructor.
  absl::Status Sync();
  absl::Status Publish();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }

 private:
  AtomicFile(std::string path, std::string temp_path, int fd);
  void Abandon();  // close and unlink the temp file
  // Direct mode: writes `size` bytes of `data` at `offset` (through
  // direct_fd_ when `aligned`, else fd_). May run on another thread.
  absl::Status WriteAt(const char* data, size_t size, int64_t offset, bool aligned);
  // Direct mode: hands the full block to a background write (after the
  // previous one finished) and continues in the other buffer.
  absl::Status FlushFullBlock();
  // Direct mode: waits for the background write; its status.
  absl::Status WaitPending();

  const std::string path_;
  const std::string temp_path_;
  int fd_;  // -1 once closed
  bool failed_ = false;
  bool committed_ = false;
  bool synced_ = false;  // Sync succeeded: the temporary file is complete and closed
  // Direct mode (AtomicFileOptions::direct and O_DIRECT available).
  int direct_fd_ = -1;
  std::unique_ptr<char, void (*)(void*)> block_{nullptr, nullptr};
  std::unique_ptr<char, void (*)(void*)> spare_{nullptr, nullptr};  // being written
  std::future<absl::Status> pending_;  // the write of spare_, if any
  size_t block_bytes_ = 0;
  size_t fill_ = 0;      // bytes in block_
  int64_t offset_ = 0;   // file bytes written before block_
};

// Replaces `path` with `contents` through an AtomicFile.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

// The whole file. NOT_FOUND if missing; other errors name the path.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// fsync of directory `dir`: what makes a rename or a new file in it durable.
absl::Status FsyncDirectory(const std::string& dir);

// An absl::Status for a failed system call: errno mapped to a status code,
// message "<what> <path>: <strerror>".
absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_FILE_UTIL_H_
