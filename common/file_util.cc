#include "common/file_util.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace zeroshard {
namespace {

// Directory holding `path`, for the fsync that makes a rename durable.
std::string DirName(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// What the file at `st` is, for a person.
const char* FileKind(const struct stat& st) {
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISCHR(st.st_mode)) return "a character device";
  if (S_ISBLK(st.st_mode)) return "a block device";
  if (S_ISFIFO(st.st_mode)) return "a FIFO";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

absl::Status CheckReplaceable(const std::string& path) {
  struct stat st;
  // stat, not lstat: a link to a regular file is fine (the rename replaces
  // the link), a link to a device is not.
  if (stat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? absl::OkStatus() : ErrnoStatus(errno, "stat", path);
  }
  if (S_ISREG(st.st_mode)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(path, " is ", FileKind(st),
                   "; only a regular file is replaced: give the path of a new or regular file"));
}

absl::Status FsyncDirectory(const std::string& dir) {
  int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open directory", dir);
  absl::Status status;
  if (fsync(fd) != 0) status = ErrnoStatus(errno, "fsync directory", dir);
  close(fd);
  return status;
}

absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path) {
  return absl::ErrnoToStatus(err, absl::StrCat(what, " ", path));
}

absl::StatusOr<std::unique_ptr<AtomicFile>> AtomicFile::Create(const std::string& path,
                                                               const AtomicFileOptions& options) {
  if (path.empty()) return absl::InvalidArgumentError("AtomicFile: empty path");
  if (absl::Status s = CheckReplaceable(path); !s.ok()) return s;
  absl::BitGen gen;
  for (int attempt = 0; attempt < 16; ++attempt) {
    std::string temp_path =
        absl::StrCat(path, ".tmp-", absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen)));
    int fd = open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) {
      std::unique_ptr<AtomicFile> file(new AtomicFile(path, std::move(temp_path), fd));
      const size_t block = options.block_bytes / 4096 * 4096;
      if (options.direct && block > 0) {
        // Best effort: without O_DIRECT the file is written as usual.
        const int direct_fd = open(file->temp_path_.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
        // Two blocks: one fills while the other is written.
        void* buffers[2] = {nullptr, nullptr};
        if (direct_fd >= 0 && posix_memalign(&buffers[0], 4096, block) == 0 &&
            posix_memalign(&buffers[1], 4096, block) == 0) {
          file->direct_fd_ = direct_fd;
          file->block_ = std::unique_ptr<char, void (*)(void*)>(static_cast<char*>(buffers[0]), free);
          file->spare_ = std::unique_ptr<char, void (*)(void*)>(static_cast<char*>(buffers[1]), free);
          file->block_bytes_ = block;
        } else {
          free(buffers[0]);
          if (direct_fd >= 0) close(direct_fd);
        }
      }
      return file;
    }
    if (errno != EEXIST) return ErrnoStatus(errno, "create", temp_path);
  }
  return absl::AlreadyExistsError(
      absl::StrCat("create temp file for ", path, ": 16 random names already taken"));
}

AtomicFile::AtomicFile(std::string path, std::string temp_path, int fd)
    : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {}

AtomicFile::~AtomicFile() {
  if (!committed_) Abandon();
}

void AtomicFile::Abandon() {
  if (pending_.valid()) pending_.wait();  // it writes through the descriptors below
  if (direct_fd_ >= 0) {
    close(direct_fd_);
    direct_fd_ = -1;
  }
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
  }
  unlink(temp_path_.c_str());  // best effort; nothing to report to
}

absl::Status AtomicFile::Write(const void* data, size_t size) {
  if (committed_ || failed_ || fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("write ", temp_path_, ": file already committed or failed"));
  }
  const char* p = static_cast<const char*>(data);
  if (block_ != nullptr) {  // direct mode: whole blocks through O_DIRECT
    while (size > 0) {
      const size_t take = std::min(size, block_bytes_ - fill_);
      std::memcpy(block_.get() + fill_, p, take);
      fill_ += take;
      p += take;
      size -= take;
      if (fill_ == block_bytes_) {
        if (absl::Status s = FlushFullBlock(); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }
  while (size > 0) {
    ssize_t n = write(fd_, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      failed_ = true;
      return ErrnoStatus(errno, "write", temp_path_);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status AtomicFile::WaitPending() {
  if (!pending_.valid()) return absl::OkStatus();
  absl::Status status = pending_.get();
  if (!status.ok()) failed_ = true;
  return status;
}

absl::Status AtomicFile::Overwrite(int64_t offset, const void* data, size_t size) {
  if (committed_ || failed_ || fd_ < 0 || block_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "overwrite ", temp_path_, ": file committed, failed, or written in direct mode"));
  }
  absl::Status s = WriteAt(static_cast<const char*>(data), size, offset, /*aligned=*/false);
  if (!s.ok()) failed_ = true;
  return s;
}

absl::Status AtomicFile::FlushFullBlock() {
  if (absl::Status s = WaitPending(); !s.ok()) return s;
  std::swap(block_, spare_);
  const char* data = spare_.get();
  const size_t size = fill_;
  const int64_t offset = offset_;
  pending_ = std::async(std::launch::async, [this, data, size, offset] {
    return WriteAt(data, size, offset, /*aligned=*/true);
  });
  offset_ += static_cast<int64_t>(size);
  fill_ = 0;
  return absl::OkStatus();
}

absl::Status AtomicFile::WriteAt(const char* data, size_t size, int64_t offset, bool aligned) {
  const char* p = data;
  size_t left = size;
  int64_t at = offset;
  while (left > 0) {
    ssize_t n = pwrite(aligned ? direct_fd_ : fd_, p, left, at);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && aligned && errno == EINVAL) {
      // The filesystem took O_DIRECT at open but refuses this write: the
      // rest goes through the page cache.
      close(direct_fd_);
      direct_fd_ = -1;
      aligned = false;
      continue;
    }
    if (n <= 0) return ErrnoStatus(n < 0 ? errno : EIO, "write", temp_path_);
    p += n;
    at += n;
    left -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status AtomicFile::Commit() {
  if (absl::Status s = Sync(); !s.ok()) return s;
  return Publish();
}

absl::Status AtomicFile::Sync() {
  if (committed_ || failed_ || fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("commit ", path_, ": file already committed or failed"));
  }
  if (absl::Status s = WaitPending(); !s.ok()) {
    Abandon();
    return s;
  }
  if (block_ != nullptr && fill_ > 0) {
    // The aligned part of the last block through O_DIRECT, the tail (not a
    // multiple of 4096) through the page cache; fsync below covers both.
    const size_t aligned = direct_fd_ >= 0 ? fill_ / 4096 * 4096 : 0;
    absl::Status s = WriteAt(block_.get(), aligned, offset_, /*aligned=*/true);
    if (s.ok()) {
      s = WriteAt(block_.get() + aligned, fill_ - aligned, offset_ + static_cast<int64_t>(aligned),
                  /*aligned=*/false);
    }
    if (!s.ok()) {
      failed_ = true;
      Abandon();
      return s;
    }
    offset_ += static_cast<int64_t>(fill_);
    fill_ = 0;
  }
  if (direct_fd_ >= 0) {
    close(direct_fd_);
    direct_fd_ = -1;
  }
  // Any failure below leaves `path` untouched (or, after the rename, already
  // replaced); either way the temp file must not linger.
  failed_ = true;
  if (fsync(fd_) != 0) {
    absl::Status status = ErrnoStatus(errno, "fsync", temp_path_);
    Abandon();
    return status;
  }
  // close() can report deferred write errors (NFS); don't retry it.
  int rc = close(fd_);
  fd_ = -1;
  if (rc != 0) {
    absl::Status status = ErrnoStatus(errno, "close", temp_path_);
    Abandon();
    return status;
  }
  synced_ = true;
  return absl::OkStatus();
}

absl::Status AtomicFile::Publish() {
  if (!synced_ || committed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("publish ", path_, ": file not synced, or already published"));
  }
  if (rename(temp_path_.c_str(), path_.c_str()) != 0) {
    absl::Status status = ErrnoStatus(errno, absl::StrCat("rename ", temp_path_, " to"), path_);
    Abandon();
    return status;
  }
  committed_ = true;
  failed_ = false;
  return FsyncDirectory(DirName(path_));
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  absl::StatusOr<std::unique_ptr<AtomicFile>> file = AtomicFile::Create(path);
  if (!file.ok()) return file.status();
  absl::Status status = (*file)->Write(contents.data(), contents.size());
  if (!status.ok()) return status;
  return (*file)->Commit();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open", path);
  std::string out;
  char buffer[1 << 16];
  while (true) {
    ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status status = ErrnoStatus(errno, "read", path);
      close(fd);
      return status;
    }
    if (n == 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

}  // namespace zeroshard
