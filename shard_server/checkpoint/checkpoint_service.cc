#include "shard_server/checkpoint/checkpoint_service.h"

#include <cassert>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "shard_server/checkpoint/checkpoint_consolidator.h"
#include "shard_server/checkpoint/checkpoint_paths.h"
#include "shard_server/base/grpc_status.h"

namespace zeroshard {
namespace {

// Largest `data` payload of a ConsolidateResponse, bytes. (256 KiB was
// tried on 2026-11-23: the server spent ~50 % more CPU on the extra
// messages, and the client's time, dominated by its page-cache writes, did
// not change beyond the noise of that machine.)
constexpr size_t kMaxDataMessage = size_t{1} << 20;
// Progress messages at most this often.
constexpr absl::Duration kProgressInterval = absl::Milliseconds(250);

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context,
                                    const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

grpc::Status Error(absl::StatusCode code, const std::string& message) {
  return grpc::Status(static_cast<grpc::StatusCode>(code), message);
}

}  // namespace

// ---------------------------------------------------------------------------
// UploadShard: the first message opens "<root>/<file>.tmp-<random>", data
// is appended as it arrives, and the file is renamed into place only when
// the stream ended with exactly size_bytes. Anything else removes it.

class UploadReactor : public grpc::ServerReadReactor<v1::UploadShardRequest> {
 public:
  UploadReactor(CheckpointService* service, const absl::StatusOr<Caller>& caller,
                v1::UploadShardResponse* response)
      : service_(service), response_(response), caller_(caller.value_or(Caller())) {
    grpc::Status status = caller.ok() ? service->Available() : ToGrpcStatus(caller.status());
    if (!status.ok()) {
      Finish(status);
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      End();
      return;
    }
    if (file_ == nullptr) {
      if (absl::Status s = Begin(); !s.ok()) {
        Fail(s);
        return;
      }
    }
    const std::string& data = request_.data();
    if (written_ + static_cast<int64_t>(data.size()) > size_) {
      Fail(absl::InvalidArgumentError(absl::StrCat("upload of '", relative_,
                                                   "' sent more than the announced size_bytes ",
                                                   size_, "; nothing was kept")));
      return;
    }
    if (!data.empty()) {
      if (absl::Status s = file_->Write(data.data(), data.size()); !s.ok()) {
        Fail(s);
        return;
      }
      written_ += static_cast<int64_t>(data.size());
    }
    StartRead(&request_);
  }

  void OnDone() override {
    // Released once the temporary file is published or removed (file_).
    CheckpointService* service = service_;
    const std::string job = job_;
    const int64_t reserved = reserved_;
    delete this;
    if (reserved > 0) service->ReleaseUpload(job, reserved);
  }

 private:
  // Checks the first message and opens the temporary file.
  absl::Status Begin() {
    const v1::MemberCredentials& m = request_.member();
    CheckpointRegistry* registry = service_->registry_;
    if (grpc::Status allowed = caller_.MayActOn(m.job_id()); !allowed.ok()) {
      return absl::PermissionDeniedError(allowed.error_message());
    }
    if (absl::Status s = service_->membership_->CheckMember(m); !s.ok()) return s;
    absl::StatusOr<int> world = service_->membership_->WorldSize(m.job_id());
    if (!world.ok()) return world.status();
    if (absl::Status s = ValidateJobId(m.job_id()); !s.ok()) return s;
    if (request_.step() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("step ", request_.step(), " is negative"));
    }
    relative_ = request_.file();
    if (absl::Status s = ValidateRelativePath(relative_); !s.ok()) return s;
    const std::string expected = CheckpointShardPath(m.job_id(), request_.step(), m.rank(), *world);
    if (relative_ != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat("file '", relative_, "' is not the shard file of rank ", m.rank(), " of ",
                       *world, " for step ", request_.step(), "; expected '", expected, "'"));
    }
    if (request_.size_bytes() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("size_bytes ", request_.size_bytes(), " is not positive"));
    }
    size_ = request_.size_bytes();
    member_ = m;
    job_ = m.job_id();
    step_ = request_.step();
    if (absl::Status s = registry->CheckWritable(job_, step_, m.generation()); !s.ok()) return s;
    if (absl::Status s = service_->ReserveUpload(job_, size_); !s.ok()) return s;
    reserved_ = size_;
    if (absl::Status s = registry->root().MakeDirs(CheckpointStepDir(job_, step_)); !s.ok()) {
      return s;
    }
    absl::StatusOr<std::unique_ptr<AtomicFile>> file =
        AtomicFile::Create(registry->root().Join(relative_));
    if (!file.ok()) return file.status();
    file_ = *std::move(file);
    return absl::OkStatus();
  }

  void End() {
    if (file_ == nullptr) {
      Fail(absl::InvalidArgumentError("upload ended before its first message"));
      return;
    }
    // Only a stream that delivered every announced byte is kept, whether it
    // ended with WritesDone or a cancellation after the last byte.
    if (written_ != size_) {
      Fail(absl::InvalidArgumentError(absl::StrCat("upload of '", relative_, "' ended after ",
                                                   written_, " of ", size_,
                                                   " bytes; nothing was kept")));
      return;
    }
    // The member and the step were checked when the stream began, which may
    // be long ago: the rename happens only if both still allow it, checked
    // again under the registry's lock (see PublishIfWritable). A refused
    // file is removed with file_.
    if (absl::Status s = file_->Sync(); !s.ok()) {
      Fail(s);
      return;
    }
    absl::Status published = service_->registry_->PublishIfWritable(
        job_, step_, member_.generation(), [this] { return service_->membership_->CheckMember(member_); },
        [this] { return file_->Publish(); });
    if (!published.ok()) {
      Fail(published);
      return;
    }
    file_.reset();
    service_->log_->Log("checkpoint_upload", {{"job", job_},
                                              {"step", absl::StrCat(step_)},
                                              {"file", relative_},
                                              {"bytes", absl::StrCat(written_)}});
    response_->set_size_bytes(written_);
    ReleaseReservation();
    Finish(grpc::Status::OK);
  }

  void Fail(const absl::Status& status) {
    file_.reset();  // removes the temporary file
    service_->log_->Log("checkpoint_upload_failed",
                        {{"job", job_}, {"file", relative_}, {"error", status.ToString()}});
    ReleaseReservation();
    Finish(ToGrpcStatus(status));
  }

  // Gives the upload's bytes back to the bounds before the caller hears the
  // outcome: an uploader told "done" may start its next upload at once (OnDone
  // runs only later, and releases what a cancelled stream still holds).
  void ReleaseReservation() {
    if (reserved_ > 0) service_->ReleaseUpload(job_, reserved_);
    reserved_ = 0;
  }

  CheckpointService* const service_;
  v1::UploadShardResponse* const response_;
  const Caller caller_;  // who the bearer token proved
  v1::UploadShardRequest request_;
  std::unique_ptr<AtomicFile> file_;
  v1::MemberCredentials member_;  // of the first message
  std::string relative_;
  std::string job_;
  int64_t step_ = 0;
  int64_t size_ = 0;
  int64_t written_ = 0;
  int64_t reserved_ = 0;  // bytes of the service's upload bounds this upload holds
};

// ---------------------------------------------------------------------------
// Consolidate: a producer thread runs the Consolidator and hands messages to
// the reactor one at a time. At most two messages exist at once: the one
// being written and the one being filled.

class ConsolidateReactor : public grpc::ServerWriteReactor<v1::ConsolidateResponse>,
                           public ConsolidationOutput,
                           private ByteSink {
 public:
  ConsolidateReactor(CheckpointService* service, grpc::CallbackServerContext* context,
                     const grpc::Status& auth, v1::ConsolidateRequest request, std::string peer)
      : service_(service), context_(context), request_(std::move(request)), peer_(std::move(peer)) {
    grpc::Status status = auth.ok() ? service->Available() : auth;
    if (status.ok()) status = service->BeginConsolidation();
    if (!status.ok()) {
      Finish(status);
      return;
    }
    counted_ = true;
    producer_ = std::thread([this] { Produce(); });
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    in_flight_ = false;
    if (!ok) cancelled_ = true;
  }
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  void OnDone() override {
    // Finish() is the producer's last action, so this join is short.
    if (producer_.joinable()) producer_.join();
    if (counted_) service_->EndConsolidation();
    delete this;
  }

  // ConsolidationOutput
  absl::StatusOr<ByteSink*> BeginFile(const std::string& name, int64_t size_bytes) override {
    v1::ConsolidateResponse message;
    message.mutable_file()->set_name(name);
    message.mutable_file()->set_size_bytes(size_bytes);
    if (absl::Status s = Send(std::move(message)); !s.ok()) return s;
    return static_cast<ByteSink*>(this);
  }
  absl::Status EndFile() override { return FlushData(); }
  absl::Status Progress(int64_t done, int64_t total) override {
    absl::Time now = absl::Now();
    if (done < total && now - last_progress_ < kProgressInterval) return absl::OkStatus();
    last_progress_ = now;
    // Data already buffered goes first: the stream stays in file order.
    if (absl::Status s = FlushData(); !s.ok()) return s;
    v1::ConsolidateResponse message;
    message.mutable_progress()->set_bytes_done(done);
    message.mutable_progress()->set_bytes_total(total);
    return Send(std::move(message));
  }
  bool Cancelled() override {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

 private:
  // In-place writing: the bytes go straight into the next data message,
  // which is sent once it holds kMaxDataMessage bytes (or the file ends).
  char* NextBuffer(size_t* size) override {
    if (pending_used_ == kMaxDataMessage) {
      if (!FlushData().ok()) return nullptr;  // cancelled: the sink path reports it
    }
    if (!pending_.has_data()) {
      // A buffer of a message already written, if there is one: no
      // allocation and no zero-filling per message.
      if (spare_ != nullptr) {
        pending_.set_allocated_data(spare_.release());
      } else {
        pending_.mutable_data();
      }
    }
    std::string* buffer = pending_.mutable_data();
    if (buffer->size() != kMaxDataMessage) buffer->resize(kMaxDataMessage);
    *size = kMaxDataMessage - pending_used_;
    return buffer->data() + pending_used_;
  }
  absl::Status CommitBuffer(size_t used) override {
    pending_used_ += used;
    if (pending_used_ == kMaxDataMessage) return FlushData();
    return absl::OkStatus();
  }

  // ByteSink: copies into the data messages.
  absl::Status Write(const void* data, size_t size) override {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      size_t room = 0;
      char* buffer = NextBuffer(&room);
      if (buffer == nullptr) return absl::CancelledError("the caller went away");
      const size_t n = std::min(size, room);
      std::memcpy(buffer, p, n);
      if (absl::Status s = CommitBuffer(n); !s.ok()) return s;
      p += n;
      size -= n;
    }
    return absl::OkStatus();
  }

  absl::Status FlushData() {
    if (pending_used_ == 0) return absl::OkStatus();
    pending_.mutable_data()->resize(pending_used_);
    pending_used_ = 0;
    v1::ConsolidateResponse message;
    message.Swap(&pending_);
    return Send(std::move(message));
  }

  // Waits until the previous message is written, then starts this one.
  absl::Status Send(v1::ConsolidateResponse message) {
    {
      const absl::Time wait_start = absl::Now();
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !in_flight_ || cancelled_; };
      const absl::Duration stall = service_->options_.stall_timeout;
      if (!mu_.AwaitWithTimeout(absl::Condition(&ready), stall)) {
        // The caller has not taken the previous message for `stall`: end the
        // call, which completes the write in flight (as failed) and frees the
        // slot for others.
        cancelled_ = true;
        context_->TryCancel();
        return absl::DeadlineExceededError(
            absl::StrCat("the caller read nothing for ", absl::FormatDuration(stall),
                         " (the server's --consolidate_stall_timeout_s); consolidation cancelled"));
      }
      send_wait_ += absl::Now() - wait_start;
      if (cancelled_) return absl::CancelledError("the caller went away");
      in_flight_ = true;
      if (outgoing_.has_data() && outgoing_.data().capacity() >= kMaxDataMessage) {
        spare_.reset(outgoing_.release_data());
      }
      outgoing_ = std::move(message);
    }
    StartWrite(&outgoing_);
    return absl::OkStatus();
  }

  void WaitForWrites() {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !in_flight_; };
    mu_.Await(absl::Condition(&idle));
  }

  void Produce() {
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::ConsolidateSummary> summary = Consolidate();
    if (summary.ok()) {
      summary->set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
      v1::ConsolidateResponse done;
      *done.mutable_done() = *summary;
      absl::Status sent = Send(std::move(done));
      if (!sent.ok()) summary = sent;
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (summary.ok()) {
      if (service_->options_.on_consolidated) {
        service_->options_.on_consolidated(summary->total_bytes(), seconds);
      }
      service_->log_->Log(
          "consolidate_done",
          {{"job", request_.job_id()},
           {"step", absl::StrCat(summary->step())},
           {"files", absl::StrJoin(summary->files(), ",")},
           {"bytes", absl::StrCat(summary->total_bytes())},
           {"seconds", absl::StrFormat("%.3f", seconds)},
           {"verify_seconds", absl::StrFormat("%.3f", verify_seconds_)},
           {"write_seconds", absl::StrFormat("%.3f", write_seconds_)},
           {"read_seconds", absl::StrFormat("%.3f", read_seconds_)},
           {"send_wait_seconds", absl::StrFormat("%.3f", absl::ToDoubleSeconds(send_wait_))},
           {"gbps",
            absl::StrFormat("%.3f", summary->total_bytes() / 1e9 / std::max(seconds, 1e-9))}});
    } else {
      service_->log_->Log("consolidate_failed", {{"job", request_.job_id()},
                                                 {"step", absl::StrCat(request_.step())},
                                                 {"error", summary.status().ToString()}});
    }
    WaitForWrites();
    Finish(ToGrpcStatus(summary.status()));
  }

  absl::StatusOr<v1::ConsolidateSummary> Consolidate() {
    CheckpointRegistry* registry = service_->registry_;
    ConsolidationOptions options;
    options.weights_only = request_.weights_only();
    options.max_shard_bytes = request_.max_shard_bytes();
    options.require_hf_config = request_.require_hf_config();
    options.buffer_bytes = service_->options_.read_buffer_bytes;
    absl::StatusOr<DType> dtype = ParseConsolidationDType(request_.dtype());
    if (!dtype.ok()) return dtype.status();
    options.dtype = *dtype;
    if (request_.max_shard_bytes() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("max_shard_bytes ", request_.max_shard_bytes(),
                                                     " is negative; 0 writes one file"));
    }
    absl::StatusOr<std::unique_ptr<PinnedCheckpoint>> pinned =
        registry->Acquire(request_.job_id(), request_.step());
    if (!pinned.ok()) return pinned.status();
    const CheckpointManifest& manifest = (*pinned)->manifest();
    // A step the verifier already read back needs no verification pass.
    options.known_checksums = (*pinned)->verified_checksums();
    service_->log_->Log("consolidate_start",
                        {{"job", manifest.job},
                         {"step", absl::StrCat(manifest.step)},
                         {"dtype", DTypeName(options.dtype)},
                         {"weights_only", options.weights_only ? "true" : "false"},
                         {"max_shard_bytes", absl::StrCat(options.max_shard_bytes)},
                         {"on_server", request_.on_server() ? "true" : "false"},
                         {"peer", peer_}});
    Consolidator consolidator(registry->root(), manifest, options);
    v1::ConsolidateSummary summary;
    auto keep_timings = [this](const ConsolidationResult& r) {
      verify_seconds_ = r.verify_seconds;
      write_seconds_ = r.write_seconds;
      read_seconds_ = r.read_seconds;
    };
    summary.set_step(manifest.step);
    if (!request_.on_server()) {
      absl::StatusOr<ConsolidationResult> result = consolidator.Run(this);
      if (!result.ok()) return result.status();
      keep_timings(*result);
      for (const std::string& f : result->files) summary.add_files(f);
      summary.set_total_bytes(result->total_bytes);
      summary.set_hf_config(result->hf_config);
      return summary;
    }
    const std::string dir = ConsolidatedDir(manifest.job, manifest.step);
    absl::StatusOr<std::unique_ptr<DirectoryOutput>> output = DirectoryOutput::Create(
        registry->root(), dir,
        [this](int64_t done, int64_t total) { return Progress(done, total); },
        [this] { return Cancelled(); });
    if (!output.ok()) return output.status();
    absl::StatusOr<ConsolidationResult> result = consolidator.Run(output->get());
    if (!result.ok()) return result.status();
    keep_timings(*result);
    if (absl::Status s = (*output)->Commit(); !s.ok()) return s;
    for (const std::string& f : result->files) summary.add_files(absl::StrCat(dir, "/", f));
    summary.set_total_bytes(result->total_bytes);
    summary.set_hf_config(result->hf_config);
    return summary;
  }

  CheckpointService* const service_;
  grpc::CallbackServerContext* const context_;
  const v1::ConsolidateRequest request_;
  const std::string peer_;
  bool counted_ = false;  // holds a consolidation slot
  std::thread producer_;
  // Producer thread only.
  v1::ConsolidateResponse pending_;
  size_t pending_used_ = 0;             // bytes of pending_.data() that belong to the file
  std::unique_ptr<std::string> spare_;  // a written message's buffer, for reuse
  absl::Time last_progress_ = absl::InfinitePast();
  double verify_seconds_ = 0;  // of the last successful run, for the log
  double write_seconds_ = 0;
  double read_seconds_ = 0;   // of write_seconds_: reading and checking shard bytes
  absl::Duration send_wait_;  // waiting for the previous message to be written

  absl::Mutex mu_;
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  // Owned by gRPC while in_flight_; by the producer otherwise.
  v1::ConsolidateResponse outgoing_;
};

// ---------------------------------------------------------------------------

CheckpointService::CheckpointService(CheckpointRegistry* registry, Membership* membership,
                                     EventLog* log, CheckpointServiceOptions options)
    : registry_(registry), membership_(membership), log_(log), options_(options) {}

CheckpointService::~CheckpointService() { WaitIdle(); }

grpc::Status CheckpointService::Available() const {
  if (registry_ != nullptr) return grpc::Status::OK;
  return Error(absl::StatusCode::kFailedPrecondition,
               "this server has no checkpoint root; start shard_server with "
               "--checkpoint_root=DIR to commit, list and consolidate checkpoints");
}

absl::Status CheckpointService::ReserveUpload(const std::string& job, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = upload_bytes_.find(job);
  const int64_t job_bytes = (it == upload_bytes_.end() ? 0 : it->second) + bytes;
  if (job_bytes > options_.max_upload_job_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "an upload of ", bytes, " bytes would take job '", job, "' to ", job_bytes,
        " bytes of checkpoint uploads in flight; at most ", options_.max_upload_job_bytes,
        " per job (the server's --checkpoint_upload_max_job_bytes); the step is retried at the "
        "next checkpoint interval"));
  }
  if (upload_total_bytes_ + bytes > options_.max_upload_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "an upload of ", bytes, " bytes of job '", job, "' would take the server to ",
        upload_total_bytes_ + bytes, " bytes of checkpoint uploads in flight over all jobs; at most ",
        options_.max_upload_total_bytes,
        " (the server's --checkpoint_upload_max_total_bytes); the step is retried at the next "
        "checkpoint interval"));
  }
  upload_bytes_[job] = job_bytes;
  upload_total_bytes_ += bytes;
  return absl::OkStatus();
}

void CheckpointService::ReleaseUpload(const std::string& job, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = upload_bytes_.find(job);
  assert(it != upload_bytes_.end() && it->second >= bytes && upload_total_bytes_ >= bytes);
  upload_total_bytes_ -= bytes;
  if ((it->second -= bytes) == 0) upload_bytes_.erase(it);
}

grpc::Status CheckpointService::BeginConsolidation() {
  absl::MutexLock lock(&mu_);
  if (consolidations_ >= options_.max_consolidations) {
    return Error(absl::StatusCode::kResourceExhausted,
                 absl::StrCat(consolidations_,
                              " consolidations are running, the server's limit "
                              "(--max_consolidations); try again when one finished"));
  }
  ++consolidations_;
  return grpc::Status::OK;
}

void CheckpointService::EndConsolidation() {
  absl::MutexLock lock(&mu_);
  --consolidations_;
}

void CheckpointService::WaitIdle() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return consolidations_ == 0; };
  mu_.Await(absl::Condition(&idle));
}

grpc::ServerUnaryReactor* CheckpointService::CommitShard(grpc::CallbackServerContext* context,
                                                         const grpc::Status& auth,
                                                         const v1::CommitShardRequest* request,
                                                         v1::CommitShardResponse* response) {
  if (!auth.ok()) return FinishNow(context, auth);
  if (grpc::Status s = Available(); !s.ok()) return FinishNow(context, s);
  if (absl::Status s = membership_->CheckMember(request->member()); !s.ok()) {
    return FinishNow(context, ToGrpcStatus(s));
  }
  absl::StatusOr<int> world = membership_->WorldSize(request->member().job_id());
  if (!world.ok()) return FinishNow(context, ToGrpcStatus(world.status()));
  if (request->member().rank() == options_.testing_hold_commit_of_rank) {
    absl::SleepFor(options_.testing_commit_hold);  // a test's window; blocks one callback thread
  }
  absl::StatusOr<v1::CommitShardResponse> result = registry_->Commit(*request, *world);
  if (result.ok()) *response = *std::move(result);
  return FinishNow(context, ToGrpcStatus(result.status()));
}

grpc::ServerReadReactor<v1::UploadShardRequest>* CheckpointService::UploadShard(
    grpc::CallbackServerContext* /*context*/, const absl::StatusOr<Caller>& caller,
    v1::UploadShardResponse* response) {
  return new UploadReactor(this, caller, response);
}

grpc::ServerUnaryReactor* CheckpointService::ListCheckpoints(
    grpc::CallbackServerContext* context, const grpc::Status& auth,
    const v1::ListCheckpointsRequest* request, v1::ListCheckpointsResponse* response) {
  if (!auth.ok()) return FinishNow(context, auth);
  if (grpc::Status s = Available(); !s.ok()) return FinishNow(context, s);
  absl::StatusOr<v1::ListCheckpointsResponse> list = registry_->List(request->job_id());
  if (list.ok()) *response = *std::move(list);
  return FinishNow(context, ToGrpcStatus(list.status()));
}

grpc::ServerWriteReactor<v1::ConsolidateResponse>* CheckpointService::Consolidate(
    grpc::CallbackServerContext* context, const grpc::Status& auth,
    const v1::ConsolidateRequest* request) {
  return new ConsolidateReactor(this, context, auth, *request, context->peer());
}

}  // namespace zeroshard
