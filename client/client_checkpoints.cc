// The client's checkpoint calls: commit and abandon a step's shard, upload a
// shard to the server, list checkpoints, and consolidate (into safetensors,
// streamed to a local file or directory). The rest of the client is
// client.cc.
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/client.h"
#include "common/file_util.h"

namespace zeroshard {

namespace {

// Runs `attempt` (given the time left) again while it fails with UNAVAILABLE
// or CANCELLED and time is left: a call in flight when the server died (or,
// replicated, when its leader died) fails so even with wait_for_ready, one in
// flight on a leader that lost its lease (etcd without quorum: it stops
// serving and shuts its calls down) is CANCELLED by that server (these calls'
// contexts are never cancelled here), and the server takes a repeated commit
// or upload as the same one (its answer was lost).
template <typename T>
absl::StatusOr<T> RetryWhileUnavailable(
    absl::Duration timeout, const std::function<absl::StatusOr<T>(absl::Duration)>& attempt) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(100);
  for (;;) {
    absl::StatusOr<T> result = attempt(deadline - absl::Now());
    const bool again = absl::IsUnavailable(result.status()) || absl::IsCancelled(result.status());
    if (result.ok() || !again || absl::Now() + backoff >= deadline) return result;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

}  // namespace

absl::StatusOr<v1::CommitShardResponse> Client::CommitShard(
    int64_t step, const std::string& file, int64_t size_bytes,
    const std::map<std::string, std::string>& checksums, absl::Duration timeout) {
  return RetryWhileUnavailable<v1::CommitShardResponse>(
      std::max(options_.rpc_timeout, timeout), [&](absl::Duration left) {
        return CommitShardOnce(step, file, size_bytes, checksums, left);
      });
}

absl::StatusOr<v1::CommitShardResponse> Client::CommitShardOnce(
    int64_t step, const std::string& file, int64_t size_bytes,
    const std::map<std::string, std::string>& checksums, absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(&context, timeout);
  // Training goes on without the server; a checkpoint made while it
  // restarts is committed when it is back, within the deadline.
  context.set_wait_for_ready(true);
  v1::CommitShardRequest request;
  *request.mutable_member() = credentials();
  request.set_step(step);
  request.set_file(file);
  request.set_size_bytes(size_bytes);
  for (const auto& [tensor, hex] : checksums) {
    v1::TensorChecksum* c = request.add_checksums();
    c->set_tensor(tensor);
    c->set_xxh64(hex);
  }
  v1::CommitShardResponse response;
  absl::Status s = FromGrpcStatus(stub_->CommitShard(&context, request, &response));
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("commit of ", file, ": ", s.message()));
  return response;
}

absl::Status Client::AbandonCheckpointStep(int64_t step, const std::string& failure,
                                           int64_t retry_step, absl::Duration timeout) {
  return RetryWhileUnavailable<v1::CommitShardResponse>(
             std::max(options_.rpc_timeout, timeout),
             [&](absl::Duration left) -> absl::StatusOr<v1::CommitShardResponse> {
               grpc::ClientContext context;
               Prepare(&context, left);
               context.set_wait_for_ready(true);
               v1::CommitShardRequest request;
               *request.mutable_member() = credentials();
               request.set_step(step);
               request.set_failure(failure);
               request.set_retry_step(retry_step);
               v1::CommitShardResponse response;
               absl::Status s = FromGrpcStatus(stub_->CommitShard(&context, request, &response));
               if (!s.ok()) {
                 return absl::Status(s.code(), absl::StrCat("abandoning checkpoint step ", step,
                                                            ": ", s.message()));
               }
               return response;
             })
      .status();
}

absl::StatusOr<int64_t> Client::UploadShard(int64_t step, const std::string& file,
                                            const std::string& local_path, absl::Duration timeout) {
  return RetryWhileUnavailable<int64_t>(
      timeout, [&](absl::Duration left) { return UploadShardOnce(step, file, local_path, left); });
}

absl::StatusOr<int64_t> Client::UploadShardOnce(int64_t step, const std::string& file,
                                                const std::string& local_path,
                                                absl::Duration timeout) {
  int fd = open(local_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", local_path);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    absl::Status s = ErrnoStatus(errno, "cannot stat", local_path);
    close(fd);
    return s;
  }
  grpc::ClientContext context;
  Prepare(&context, timeout);
  context.set_wait_for_ready(true);  // as CommitShard: the server may be restarting
  v1::UploadShardResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::UploadShardRequest>> stream =
      stub_->UploadShard(&context, &response);
  v1::UploadShardRequest message;
  *message.mutable_member() = credentials();
  message.set_step(step);
  message.set_file(file);
  message.set_size_bytes(st.st_size);
  absl::Status local;
  bool open_stream = stream->Write(message);
  message.Clear();
  constexpr size_t kChunk = size_t{1} << 20;  // bytes per message
  int64_t sent = 0;
  while (open_stream && sent < st.st_size) {
    std::string* data = message.mutable_data();
    data->resize(static_cast<size_t>(std::min<int64_t>(kChunk, st.st_size - sent)));
    ssize_t n = pread(fd, data->data(), data->size(), sent);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      local = n < 0 ? ErrnoStatus(errno, "cannot read", local_path)
                    : absl::DataLossError(absl::StrCat(local_path, " shrank while uploading"));
      break;
    }
    data->resize(static_cast<size_t>(n));
    sent += n;
    open_stream = stream->Write(message);
  }
  close(fd);
  if (!local.ok()) context.TryCancel();  // the server keeps nothing of a short upload
  stream->WritesDone();
  absl::Status s = FromGrpcStatus(stream->Finish());
  if (!local.ok()) return local;
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("upload of ", file, ": ", s.message()));
  return response.size_bytes();
}

absl::StatusOr<v1::ListCheckpointsResponse> Client::ListCheckpoints(const std::string& job_id) {
  v1::ListCheckpointsRequest request;
  request.set_job_id(job_id);
  return Call(&v1::Coordinator::Stub::ListCheckpoints, request, options_.rpc_timeout);
}

namespace {

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Where streamed files go: a directory (made for sharded output), or ""
// when `out_path` is the single file itself.
absl::StatusOr<std::string> StreamedOutputDir(const std::string& out_path, bool sharded) {
  if (out_path.empty()) return absl::InvalidArgumentError("no output path for consolidation");
  if (!sharded) return IsDirectory(out_path) ? out_path : std::string();
  if (mkdir(out_path.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, "cannot create output directory", out_path);
  }
  if (!IsDirectory(out_path)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--out ", out_path, " is a file; sharded output (max_shard_bytes > 0) needs a directory"));
  }
  return out_path;
}

// The files of a Consolidate stream, written as they arrive. Every file stays
// at its temporary name until Commit (after the summary arrived), so a stream
// that breaks leaves nothing that looks complete.
class ConsolidationReceiver {
 public:
  ConsolidationReceiver(std::string out_path, std::string out_dir)
      : out_path_(std::move(out_path)), out_dir_(std::move(out_dir)) {}

  absl::Status StartFile(const v1::ConsolidateFile& file) {
    const std::string& name = file.name();
    if (file_received_ != file_size_) {
      return absl::DataLossError(absl::StrCat("unexpected file '", name, "' in the stream"));
    }
    // The server names files; they must not climb out of --out.
    if (name.empty() || name[0] == '.' || name.find('/') != std::string::npos ||
        (out_dir_.empty() && !files_.empty())) {
      return absl::DataLossError(absl::StrCat("the server sent file name '", name, "'"));
    }
    std::string path = out_dir_.empty() ? out_path_ : absl::StrCat(out_dir_, "/", name);
    // O_DIRECT: the multi-GB output goes to disk without a page-cache copy
    // (on this project's VM that copy cost 2-5x the CPU of the DMA).
    AtomicFileOptions direct;
    direct.direct = true;
    absl::StatusOr<std::unique_ptr<AtomicFile>> opened = AtomicFile::Create(path, direct);
    if (!opened.ok()) return opened.status();
    files_.push_back(*std::move(opened));
    paths_.push_back(path);
    file_size_ = file.size_bytes();
    file_received_ = 0;
    progress_.file = path;
    progress_.bytes_expected += file_size_;
    return absl::OkStatus();
  }

  absl::Status Append(const std::string& data) {
    const auto n = static_cast<int64_t>(data.size());
    if (files_.empty() || file_received_ + n > file_size_) {
      return absl::DataLossError("the server sent more bytes than it announced");
    }
    if (absl::Status s = files_.back()->Write(data.data(), data.size()); !s.ok()) return s;
    file_received_ += n;
    progress_.bytes_received += n;
    return absl::OkStatus();
  }

  // Every announced byte arrived: the files take their names.
  absl::Status Commit(v1::ConsolidateSummary* summary) {
    if (file_received_ != file_size_) {
      return absl::DataLossError(absl::StrCat(progress_.file, ": ", file_received_, " of ",
                                              file_size_, " bytes received"));
    }
    if (files_.empty()) return absl::DataLossError("the server sent no file");
    for (auto& f : files_) {
      if (absl::Status c = f->Commit(); !c.ok()) return c;
    }
    summary->clear_files();
    for (const std::string& p : paths_) summary->add_files(p);
    return absl::OkStatus();
  }

  ConsolidateProgress& progress() { return progress_; }

 private:
  const std::string out_path_;
  const std::string out_dir_;
  std::vector<std::unique_ptr<AtomicFile>> files_;
  std::vector<std::string> paths_;
  int64_t file_size_ = 0, file_received_ = 0;
  ConsolidateProgress progress_;
};

}  // namespace

absl::StatusOr<v1::ConsolidateSummary> Client::Consolidate(const v1::ConsolidateRequest& request,
                                                           const std::string& out_path,
                                                           ConsolidateProgressFn progress) {
  const bool streamed = !request.on_server();
  std::string out_dir;
  if (streamed) {
    absl::StatusOr<std::string> dir = StreamedOutputDir(out_path, request.max_shard_bytes() > 0);
    if (!dir.ok()) return dir.status();
    out_dir = *std::move(dir);
  }
  grpc::ClientContext context;
  Prepare(&context, absl::Hours(24));
  std::unique_ptr<grpc::ClientReader<v1::ConsolidateResponse>> stream =
      stub_->Consolidate(&context, request);
  ConsolidationReceiver receiver(out_path, out_dir);
  v1::ConsolidateResponse message;
  std::optional<v1::ConsolidateSummary> summary;
  absl::Status local;
  while (local.ok() && stream->Read(&message)) {
    switch (message.kind_case()) {
      case v1::ConsolidateResponse::kFile:
        local = !streamed || summary.has_value()
                    ? absl::DataLossError(absl::StrCat("unexpected file '", message.file().name(),
                                                       "' in the stream"))
                    : receiver.StartFile(message.file());
        break;
      case v1::ConsolidateResponse::kData:
        local = receiver.Append(message.data());
        break;
      case v1::ConsolidateResponse::kProgress:
        receiver.progress().work_done = message.progress().bytes_done();
        receiver.progress().work_total = message.progress().bytes_total();
        if (progress) progress(receiver.progress());
        break;
      case v1::ConsolidateResponse::kDone:
        summary = message.done();
        break;
      default:
        break;
    }
  }
  if (!local.ok()) context.TryCancel();
  absl::Status s = FromGrpcStatus(stream->Finish());
  if (!local.ok()) return local;  // the files go with their temporary names
  if (!s.ok()) return s;
  if (!summary.has_value()) return absl::DataLossError("the stream ended without a summary");
  if (streamed) {
    if (absl::Status c = receiver.Commit(&*summary); !c.ok()) return c;
  }
  return *std::move(summary);
}

}  // namespace zeroshard
