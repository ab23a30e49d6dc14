#include "shard_server/state/etcd_state.h"

#include <zlib.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/server_list.h"

namespace zeroshard {
namespace {

// Renewals per TTL: three may fail (a slow etcd, a leader election of etcd's
// own) before the lease is at risk.
constexpr int kRenewalsPerTtl = 4;

// Images start with their uncompressed size (8 bytes, little-endian), then
// zlib's stream.
absl::StatusOr<std::string> Compress(absl::string_view image) {
  uLongf bound = compressBound(image.size());
  std::string out(8 + bound, '\0');
  uint64_t size = image.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((size >> (8 * i)) & 0xff);
  int code = compress2(reinterpret_cast<Bytef*>(&out[8]), &bound,
                       reinterpret_cast<const Bytef*>(image.data()), image.size(), 6);
  if (code != Z_OK) return absl::InternalError(absl::StrCat("zlib compress failed: ", code));
  out.resize(8 + bound);
  return out;
}

absl::StatusOr<std::string> Decompress(absl::string_view stored) {
  if (stored.size() < 8) return absl::DataLossError("state image is shorter than its header");
  uint64_t size = 0;
  for (int i = 0; i < 8; ++i) size |= uint64_t{static_cast<unsigned char>(stored[i])} << (8 * i);
  if (size > (uint64_t{1} << 32)) {
    return absl::DataLossError(absl::StrCat("state image claims ", size, " bytes"));
  }
  std::string image(size, '\0');
  uLongf length = size;
  int code = uncompress(reinterpret_cast<Bytef*>(image.data()), &length,
                        reinterpret_cast<const Bytef*>(stored.data() + 8), stored.size() - 8);
  if (code != Z_OK || length != size) {
    return absl::DataLossError(absl::StrCat("state image does not decompress (zlib ", code, ")"));
  }
  return image;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdSession>> EtcdSession::Connect(const EtcdOptions& options) {
  absl::StatusOr<std::string> target = GrpcTargetForServers(options.endpoints);
  if (!target.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--etcd_endpoints: ", target.status().message()));
  }
  if (options.lease_ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError("the etcd lease TTL must be at least 1 s (etcd's unit)");
  }
  std::unique_ptr<EtcdSession> session(new EtcdSession(options));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  // An etcd member that went away is left within a renewal period.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 500);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  session->channel_ = grpc::CreateCustomChannel(*target, grpc::InsecureChannelCredentials(), args);
  session->kv_ = etcdserverpb::KV::NewStub(session->channel_);
  session->lease_stub_ = etcdserverpb::Lease::NewStub(session->channel_);
  session->election_ = v3electionpb::Election::NewStub(session->channel_);
  return session;
}

EtcdSession::~EtcdSession() {
  Cancel();
  if (renewer_.joinable()) renewer_.join();
}

std::unique_ptr<grpc::ClientContext> EtcdSession::CallContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  return context;
}

absl::Status EtcdSession::Unavailable(absl::string_view what, const grpc::Status& status) const {
  return absl::UnavailableError(absl::StrCat("etcd (", options_.endpoints, "): ", what, ": ",
                                             status.error_message(),
                                             " (is a quorum of etcd members up?)"));
}

absl::Status EtcdSession::StartLease() {
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(absl::ToInt64Seconds(options_.lease_ttl));
  etcdserverpb::LeaseGrantResponse response;
  grpc::Status status = lease_stub_->LeaseGrant(CallContext().get(), request, &response);
  if (!status.ok()) return Unavailable("grant a lease", status);
  if (!response.error().empty()) {
    return absl::UnavailableError(absl::StrCat("etcd: grant a lease: ", response.error()));
  }
  absl::MutexLock lock(&mu_);
  lease_ = response.id();
  renewed_at_ = absl::Now();
  renewer_ = std::thread([this, lease = response.id()] { RenewLoop(lease); });
  return absl::OkStatus();
}

absl::StatusOr<int64_t> EtcdSession::RenewOnce(int64_t lease) {
  std::unique_ptr<grpc::ClientContext> context = CallContext();
  auto stream = lease_stub_->LeaseKeepAlive(context.get());
  etcdserverpb::LeaseKeepAliveRequest request;
  request.set_id(lease);
  etcdserverpb::LeaseKeepAliveResponse response;
  if (!stream->Write(request) || !stream->Read(&response)) {
    context->TryCancel();
    grpc::Status status = stream->Finish();
    return Unavailable("renew the lease", status);
  }
  stream->WritesDone();
  context->TryCancel();  // one exchange per stream: a stalled one ends at its deadline
  stream->Finish().ok();
  return response.ttl();
}

void EtcdSession::RenewLoop(int64_t lease) {
  const absl::Duration period = options_.lease_ttl / kRenewalsPerTtl;
  // The lease lasts a TTL from etcd's receipt of the last renewal, which is
  // later than its sending: counting from the sending is safe.
  absl::Time renewed_at = absl::Now();
  std::string last_error;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return cancelled_ || !lost_.empty(); };
      if (mu_.AwaitWithTimeout(absl::Condition(&done), period)) return;
    }
    absl::Time sent = absl::Now();
    absl::StatusOr<int64_t> ttl = RenewOnce(lease);
    if (ttl.ok() && *ttl > 0) {
      renewed_at = sent;
      absl::MutexLock lock(&mu_);
      renewed_at_ = sent;
      continue;
    }
    if (ttl.ok()) {
      MarkLost("etcd says the lease expired (this server was paused or cut off past its TTL)");
      return;
    }
    last_error = std::string(ttl.status().message());
    if (absl::Now() - renewed_at >= options_.lease_ttl) {
      MarkLost(absl::StrCat("the lease was not renewed for ",
                            absl::FormatDuration(options_.lease_ttl), ": ", last_error));
      return;
    }
  }
}

void EtcdSession::MarkLost(const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (lost_.empty()) lost_ = why;
  if (campaign_ != nullptr) campaign_->TryCancel();
}

absl::Status EtcdSession::Campaign(const std::string& value) {
  v3electionpb::CampaignRequest request;
  request.set_name(options_.prefix + "/leader");
  request.set_value(value);
  grpc::ClientContext context;  // no deadline: waiting for the leader to go is the point
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return absl::CancelledError(kCancelled);
    if (!lost_.empty()) return absl::UnavailableError(lost_);
    request.set_lease(lease_);
    campaign_ = &context;
  }
  v3electionpb::CampaignResponse response;
  grpc::Status status = election_->Campaign(&context, request, &response);
  absl::MutexLock lock(&mu_);
  campaign_ = nullptr;
  if (cancelled_) return absl::CancelledError(kCancelled);
  if (!lost_.empty()) return absl::UnavailableError(lost_);
  if (!status.ok()) return Unavailable("campaign for leadership", status);
  leader_key_ = response.leader();
  have_leader_key_ = true;
  return absl::OkStatus();
}

std::string EtcdSession::WaitLost() {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return cancelled_ || !lost_.empty(); };
  mu_.Await(absl::Condition(&done));
  return lost_.empty() ? kCancelled : lost_;
}

void EtcdSession::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (campaign_ != nullptr) campaign_->TryCancel();
}

void EtcdSession::Resign() {
  v3electionpb::ResignRequest request;
  {
    absl::MutexLock lock(&mu_);
    if (!have_leader_key_) return;
    *request.mutable_leader() = leader_key_;
    have_leader_key_ = false;
  }
  v3electionpb::ResignResponse response;
  election_->Resign(CallContext().get(), request, &response).ok();  // else the TTL ends it
}

int64_t EtcdSession::lease_id() const {
  absl::MutexLock lock(&mu_);
  return lease_;
}

absl::Time EtcdSession::last_renewal() const {
  absl::MutexLock lock(&mu_);
  return renewed_at_;
}

absl::Status EtcdSession::Register(const std::string& value) {
  etcdserverpb::PutRequest request;
  request.set_key(options_.prefix + "/servers/" + value);
  request.set_value(value);
  {
    absl::MutexLock lock(&mu_);
    request.set_lease(lease_);
  }
  etcdserverpb::PutResponse response;
  grpc::Status status = kv_->Put(CallContext().get(), request, &response);
  if (!status.ok()) return Unavailable("register this server", status);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> EtcdSession::Servers() {
  etcdserverpb::RangeRequest request;
  const std::string prefix = options_.prefix + "/servers/";
  request.set_key(prefix);
  std::string end = prefix;
  end.back() = static_cast<char>(end.back() + 1);  // every key with the prefix
  request.set_range_end(end);
  etcdserverpb::RangeResponse response;
  grpc::Status status = kv_->Range(CallContext().get(), request, &response);
  if (!status.ok()) return Unavailable("list the servers", status);
  std::vector<std::string> servers;
  for (const auto& kv : response.kvs()) servers.push_back(kv.value());
  return servers;
}

absl::StatusOr<std::string> EtcdSession::Leader() {
  v3electionpb::LeaderRequest request;
  request.set_name(options_.prefix + "/leader");
  v3electionpb::LeaderResponse response;
  grpc::Status status = election_->Leader(CallContext().get(), request, &response);
  // etcd answers "election: no leader" (UNKNOWN) when nobody leads.
  if (!status.ok() && status.error_message().find("no leader") != std::string::npos) return "";
  if (!status.ok()) return Unavailable("read the leader", status);
  return response.kv().value();
}

absl::StatusOr<std::string> EtcdSession::Get(const std::string& key) {
  etcdserverpb::RangeRequest request;
  request.set_key(key);
  etcdserverpb::RangeResponse response;
  grpc::Status status = kv_->Range(CallContext().get(), request, &response);
  if (!status.ok()) return Unavailable(absl::StrCat("read ", key), status);
  if (response.kvs_size() == 0) return std::string();
  return response.kvs(0).value();
}

absl::Status EtcdSession::FencedPut(const std::string& key, const std::string& value) {
  etcdserverpb::TxnRequest txn;
  {
    absl::MutexLock lock(&mu_);
    if (!have_leader_key_) {
      return absl::UnavailableError("this shard server does not lead: write refused");
    }
    etcdserverpb::Compare* still_leader = txn.add_compare();
    still_leader->set_key(leader_key_.key());
    still_leader->set_target(etcdserverpb::Compare::CREATE);
    still_leader->set_result(etcdserverpb::Compare::EQUAL);
    still_leader->set_create_revision(leader_key_.rev());
  }
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  etcdserverpb::TxnResponse response;
  grpc::Status status = kv_->Txn(CallContext().get(), txn, &response);
  if (!status.ok()) return Unavailable(absl::StrCat("write ", key), status);
  if (!response.succeeded()) {
    MarkLost("its leadership key is gone from etcd (another server leads)");
    return absl::UnavailableError(
        "this shard server no longer leads (its leadership key is gone from etcd): write "
        "refused; retry against the current leader");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> EtcdStateReplica::Load() {
  absl::StatusOr<std::string> stored = session_->Get(key_);
  if (!stored.ok() || stored->empty()) return stored;
  return Decompress(*stored);
}

absl::Status EtcdStateReplica::Save(absl::string_view image) {
  absl::StatusOr<std::string> stored = Compress(image);
  if (!stored.ok()) return stored.status();
  return session_->FencedPut(key_, *stored);
}

}  // namespace zeroshard
