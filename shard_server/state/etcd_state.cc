#include "shard_server/state/etcd_state.h"

#include <zlib.h>

#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
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
  // Keepalive pings as etcd's server permits them: no more often than its
  // --grpc-keepalive-min-time (5 s by default) and only while a call is open
  // (its permit-without-stream is off by default); pings beyond that get
  // GOAWAY "too_many_pings". A stalled member is found by the calls'
  // deadlines (rpc_timeout) and the lease renewals anyway.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  session->channel_ = grpc::CreateCustomChannel(*target, grpc::InsecureChannelCredentials(), args);
  session->kv_ = etcdserverpb::KV::NewStub(session->channel_);
  session->lease_stub_ = etcdserverpb::Lease::NewStub(session->channel_);
  session->election_ = v3electionpb::Election::NewStub(session->channel_);
  session->maintenance_ = etcdserverpb::Maintenance::NewStub(session->channel_);
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
  return EtcdError(options_.endpoints, what, status);
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
    // The call is over (the deadline, or the channel failed): Finish returns
    // its status at once. No TryCancel first: a cancel racing the call's end
    // turned DEADLINE_EXCEEDED into CANCELLED, whose message lost the hint
    // that etcd has no quorum (seen under load in failover_test).
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

absl::Status EtcdError(absl::string_view endpoints, absl::string_view what,
                       const grpc::Status& status) {
  const std::string& message = status.error_message();
  auto has = [&](const char* text) { return message.find(text) != std::string::npos; };
  const std::string where = absl::StrCat("etcd (", endpoints, "): ", what, ": ", message);
  if (has("database space exceeded")) {
    return absl::ResourceExhaustedError(absl::StrCat(
        where,
        " (etcd's NOSPACE alarm: its database reached its --quota-backend-bytes. "
        "Compact and defragment it (etcdctl compact, etcdctl defrag), then "
        "`etcdctl alarm disarm`; or restart etcd with a larger quota. docs/deploy.md)"));
  }
  if (has("request is too large") || has("larger than max")) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     " (the request is over etcd's --max-request-bytes, 1.5 MiB by default: lower "
                     "shard_server's --etcd_max_txn_bytes under it)"));
  }
  if (has("too many operations in txn")) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     " (over etcd's --max-txn-ops, 128 by default: lower shard_server's "
                     "--etcd_max_txn_ops to it)"));
  }
  if (has("no leader") || has("leader changed") || has("timed out")) {
    return absl::UnavailableError(
        absl::StrCat(where,
                     " (etcd has no leader of its own, or is electing one: is a quorum of etcd "
                     "members up?)"));
  }
  // CANCELLED: the exchange ended without an answer (etcd cancels a member's
  // streams when it loses its leader; a call cut short here likewise).
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
      status.error_code() == grpc::StatusCode::CANCELLED) {
    return absl::UnavailableError(
        absl::StrCat(where, " (no etcd member answered in time: is a quorum of etcd members up?)"));
  }
  return absl::UnavailableError(where);
}

absl::Status EtcdSession::FencedPut(const std::string& key, const std::string& value) {
  absl::StatusOr<int64_t> revision = FencedTxn({EtcdOp{key, value}});
  return revision.status();
}

absl::StatusOr<int64_t> EtcdSession::FencedTxn(const std::vector<EtcdOp>& ops) {
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
  for (const EtcdOp& op : ops) {
    etcdserverpb::RequestOp* request = txn.add_success();
    if (op.is_delete) {
      request->mutable_request_delete_range()->set_key(op.key);
      if (!op.range_end.empty())
        request->mutable_request_delete_range()->set_range_end(op.range_end);
    } else {
      etcdserverpb::PutRequest* put = request->mutable_request_put();
      put->set_key(op.key);
      put->set_value(op.value);
    }
  }
  etcdserverpb::TxnResponse response;
  grpc::Status status = kv_->Txn(CallContext().get(), txn, &response);
  if (!status.ok()) {
    return Unavailable(ops.size() == 1 ? absl::StrCat("write ", ops[0].key)
                                       : absl::StrCat("write ", ops.size(), " keys"),
                       status);
  }
  if (!response.succeeded()) {
    MarkLost("its leadership key is gone from etcd (another server leads)");
    return absl::UnavailableError(
        "this shard server no longer leads (its leadership key is gone from etcd): write "
        "refused; retry against the current leader");
  }
  return response.header().revision();
}

absl::StatusOr<std::vector<EtcdKeyValue>> EtcdSession::Range(const std::string& key,
                                                             const std::string& range_end,
                                                             int64_t revision, int64_t limit,
                                                             bool keys_only, bool* more) {
  etcdserverpb::RangeRequest request;
  request.set_key(key);
  request.set_range_end(range_end);
  request.set_revision(revision);
  request.set_limit(limit);
  request.set_keys_only(keys_only);
  etcdserverpb::RangeResponse response;
  // A page of up to `limit` values of max_value_bytes: more than one call's
  // usual deadline on a slow link.
  std::unique_ptr<grpc::ClientContext> context = CallContext();
  context->set_deadline(absl::ToChronoTime(absl::Now() + 4 * options_.rpc_timeout));
  grpc::Status status = kv_->Range(context.get(), request, &response);
  if (!status.ok()) return Unavailable(absl::StrCat("read ", key), status);
  std::vector<EtcdKeyValue> out;
  out.reserve(response.kvs_size());
  for (const auto& kv : response.kvs()) out.push_back({kv.key(), kv.value(), kv.mod_revision()});
  if (more != nullptr) *more = response.more();
  return out;
}

absl::StatusOr<std::vector<EtcdKeyValue>> EtcdSession::RangeAll(const std::string& prefix,
                                                                int64_t revision, bool keys_only) {
  std::string end = prefix;
  end.back() = static_cast<char>(end.back() + 1);  // every key with the prefix
  std::vector<EtcdKeyValue> all;
  std::string from = prefix;
  // Pages of 64 keys: at most 64 * max_value_bytes (16 MiB) per answer.
  constexpr int64_t kPage = 64;
  for (;;) {
    bool more = false;
    absl::StatusOr<std::vector<EtcdKeyValue>> page =
        Range(from, end, revision, kPage, keys_only, &more);
    if (!page.ok()) return page.status();
    for (EtcdKeyValue& kv : *page) all.push_back(std::move(kv));
    if (!more || page->empty()) return all;
    from = all.back().key + std::string(1, '\0');
  }
}

absl::Status EtcdSession::Compact(int64_t revision) {
  etcdserverpb::CompactionRequest request;
  request.set_revision(revision);
  etcdserverpb::CompactionResponse response;
  grpc::Status status = kv_->Compact(CallContext().get(), request, &response);
  // Compacted already (by an operator, or this leader's last run): done.
  if (!status.ok() && status.error_message().find("compacted") != std::string::npos) {
    return absl::OkStatus();
  }
  if (!status.ok()) return Unavailable(absl::StrCat("compact at revision ", revision), status);
  return absl::OkStatus();
}

absl::StatusOr<EtcdHealth> EtcdSession::Health() {
  EtcdHealth health;
  etcdserverpb::StatusResponse status_response;
  grpc::Status status =
      maintenance_->Status(CallContext().get(), etcdserverpb::StatusRequest(), &status_response);
  if (!status.ok()) return Unavailable("read its status", status);
  health.db_size_bytes = status_response.dbsize();
  health.db_size_in_use_bytes = status_response.dbsizeinuse();
  etcdserverpb::AlarmRequest alarm_request;
  alarm_request.set_action(etcdserverpb::AlarmRequest::GET);
  etcdserverpb::AlarmResponse alarm_response;
  status = maintenance_->Alarm(CallContext().get(), alarm_request, &alarm_response);
  if (!status.ok()) return Unavailable("read its alarms", status);
  for (const auto& alarm : alarm_response.alarms()) {
    health.alarms.push_back(etcdserverpb::AlarmType_Name(alarm.alarm()));
  }
  return health;
}

absl::Status EtcdSession::CheckLeading() const {
  absl::MutexLock lock(&mu_);
  if (!lost_.empty())
    return absl::UnavailableError(absl::StrCat("this shard server lost its lead: ", lost_));
  if (!have_leader_key_) return absl::UnavailableError("this shard server does not lead");
  const absl::Duration since = absl::Now() - renewed_at_;
  if (since >= options_.lease_ttl) {
    return absl::UnavailableError(absl::StrCat(
        "this shard server's etcd lease was last renewed ", absl::FormatDuration(since),
        " ago (TTL ", absl::FormatDuration(options_.lease_ttl),
        "): another server may lead now; not acknowledged, retry against the current leader"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// EtcdStateReplica

namespace {

// Values are framed: 'r' + the entry's bytes, or 'z' + zlib's (Compress),
// when that is smaller; a framed value over max_value_bytes is stored as
// 'm' + its part count (4 bytes, little-endian) + its first part, the rest
// under "<key>/~<i>".
constexpr size_t kCompressAbove = 1024;
constexpr char kPartMark[] = "/~";

std::string Frame(const std::string& value) {
  if (value.size() > kCompressAbove) {
    absl::StatusOr<std::string> z = Compress(value);
    if (z.ok() && z->size() < value.size()) return "z" + *z;
  }
  return "r" + value;
}

absl::StatusOr<std::string> Unframe(absl::string_view framed) {
  if (framed.empty()) return absl::DataLossError("an empty state value");
  if (framed[0] == 'r') return std::string(framed.substr(1));
  if (framed[0] == 'z') return Decompress(framed.substr(1));
  return absl::DataLossError(
      absl::StrCat("a state value of unknown kind '", absl::CEscape(framed.substr(0, 1)), "'"));
}

std::string PartKey(const std::string& key, int part) { return absl::StrCat(key, kPartMark, part); }

bool IsPartKey(absl::string_view key) { return key.find(kPartMark) != absl::string_view::npos; }

uint32_t ReadU32(absl::string_view bytes) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  return v;
}

std::string U32(uint32_t v) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

}  // namespace

EtcdStateReplica::EtcdStateReplica(EtcdSession* session)
    : session_(session),
      rows_prefix_(session->options().prefix + "/state/"),
      head_key_(session->options().prefix + "/state.head"),
      pending_key_(session->options().prefix + "/state.pending"),
      legacy_key_(session->options().prefix + "/state") {}

EtcdStateReplica::Stats EtcdStateReplica::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

absl::StatusOr<std::vector<ReplicaEntry>> EtcdStateReplica::Load() {
  absl::MutexLock lock(&mu_);
  const absl::Time start = absl::Now();
  bool more = false;
  absl::StatusOr<std::vector<EtcdKeyValue>> head =
      session_->Range(head_key_, "", 0, 1, false, &more);
  if (!head.ok()) return head.status();
  absl::StatusOr<std::string> pending = session_->Get(pending_key_);
  if (!pending.ok()) return pending.status();
  const int64_t head_revision = head->empty() ? 0 : (*head)[0].mod_revision;
  if (!head->empty()) (void)absl::SimpleAtoi((*head)[0].value, &head_value_);
  stats_.head_revision = head_revision;
  std::vector<ReplicaEntry> entries;
  if (head_revision == 0) {
    absl::StatusOr<std::string> legacy = session_->Get(legacy_key_);
    if (!legacy.ok()) return legacy.status();
    if (!legacy->empty()) {
      absl::StatusOr<std::string> image = Decompress(*legacy);
      if (!image.ok()) return image.status();
      legacy_ = true;
      entries.push_back({"image", *std::move(image)});
    }
    if (!pending->empty()) {
      // A first batch that never completed: none of it is state.
      std::string end = rows_prefix_;
      end.back() = static_cast<char>(end.back() + 1);
      absl::StatusOr<int64_t> cleared = session_->FencedTxn(
          {EtcdOp{rows_prefix_, "", true, end}, EtcdOp{pending_key_, "", true}});
      if (!cleared.ok()) return cleared.status();
      stats_.repaired = true;
    }
    stats_.load_time = absl::Now() - start;
    return entries;
  }
  absl::StatusOr<std::vector<EtcdKeyValue>> at_head = RowsAtHead(head_revision, *pending);
  if (!at_head.ok()) return at_head.status();
  std::map<std::string, const EtcdKeyValue*> by_key;
  for (const EtcdKeyValue& kv : *at_head) {
    by_key[kv.key] = &kv;
    stats_.loaded_bytes += kv.key.size() + kv.value.size();
  }
  stats_.loaded_keys = at_head->size();
  for (const EtcdKeyValue& kv : *at_head) {
    if (IsPartKey(kv.key)) continue;
    std::string framed = kv.value;
    if (!framed.empty() && framed[0] == 'm') {
      if (framed.size() < 5)
        return absl::DataLossError(absl::StrCat(kv.key, ": a cut part header"));
      const uint32_t parts = ReadU32(absl::string_view(framed).substr(1));
      std::string whole = framed.substr(5);
      for (uint32_t p = 1; p < parts; ++p) {
        auto part = by_key.find(PartKey(kv.key, p));
        if (part == by_key.end()) {
          return absl::DataLossError(
              absl::StrCat(kv.key, ": part ", p, " of ", parts, " is missing"));
        }
        whole += part->second->value;
      }
      parts_[kv.key.substr(rows_prefix_.size())] = parts;
      framed = std::move(whole);
    }
    absl::StatusOr<std::string> value = Unframe(framed);
    if (!value.ok()) {
      return absl::Status(value.status().code(),
                          absl::StrCat(kv.key, ": ", value.status().message()));
    }
    entries.push_back({kv.key.substr(rows_prefix_.size()), *std::move(value)});
  }
  if (!pending->empty()) {
    if (absl::Status s = Repair(head_revision, *at_head); !s.ok()) return s;
    stats_.repaired = true;
  }
  stats_.load_time = absl::Now() - start;
  return entries;
}

absl::StatusOr<std::vector<EtcdKeyValue>> EtcdStateReplica::RowsAtHead(int64_t head_revision,
                                                                       const std::string& pending) {
  // Without a change cut half-way (no pending), the rows now are the rows
  // as of head (a complete change writes head in its last transaction):
  // read them now. Head's revision may have been compacted meanwhile (an
  // operator's etcdctl compact, etcd's --auto-compaction-retention, another
  // control plane on the same etcd), and a read at it would be refused: no
  // server could lead again.
  absl::StatusOr<std::vector<EtcdKeyValue>> at_head =
      session_->RangeAll(rows_prefix_, pending.empty() ? 0 : head_revision, /*keys_only=*/false);
  if (!at_head.ok() && !pending.empty() &&
      absl::StrContains(at_head.status().message(), "compacted")) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a change to the state was cut half-way (", pending_key_,
        " is set) and etcd no longer holds the state before it (revision ", head_revision, " of ",
        head_key_,
        " was compacted), so no leader can put it back. To serve the state as it is, with that "
        "change partly applied, delete the key: etcdctl del ",
        pending_key_,
        ". Compact etcd only at or below the leader's zeroshard_etcd_compacted_revision, which "
        "the leader keeps up to date itself"));
  }
  return at_head;
}

absl::Status EtcdStateReplica::Repair(int64_t head_revision,
                                      const std::vector<EtcdKeyValue>& at_head) {
  // Whatever a half-written batch changed after head: put back as of head.
  absl::StatusOr<std::vector<EtcdKeyValue>> now =
      session_->RangeAll(rows_prefix_, 0, /*keys_only=*/true);
  if (!now.ok()) return now.status();
  std::map<std::string, const EtcdKeyValue*> then;
  for (const EtcdKeyValue& kv : at_head) then[kv.key] = &kv;
  std::vector<EtcdOp> ops;
  std::set<std::string> present;
  for (const EtcdKeyValue& kv : *now) {
    present.insert(kv.key);
    auto old = then.find(kv.key);
    if (old == then.end()) {
      ops.push_back({kv.key, "", true});
    } else if (kv.mod_revision > head_revision) {
      ops.push_back({kv.key, old->second->value});
    }
  }
  for (const EtcdKeyValue& kv : at_head) {
    if (present.count(kv.key) == 0) ops.push_back({kv.key, kv.value});
  }
  return Commit(std::move(ops), /*pending_exists=*/true);
}

int EtcdStateReplica::AddPut(const ReplicaEntry& entry, std::vector<EtcdOp>& ops) {
  const std::string key = rows_prefix_ + entry.key;
  std::string framed = Frame(entry.value);
  const size_t max_part = std::max<size_t>(session_->options().max_value_bytes, 64) - 8;
  int parts = 1;
  if (framed.size() > max_part) {
    parts = static_cast<int>((framed.size() + max_part - 1) / max_part);
    ops.push_back({key, "m" + U32(parts) + framed.substr(0, max_part)});
    for (int p = 1; p < parts; ++p)
      ops.push_back({PartKey(key, p), framed.substr(p * max_part, max_part)});
  } else {
    ops.push_back({key, std::move(framed)});
  }
  auto known = parts_.find(entry.key);
  const int before = known == parts_.end() ? 1 : known->second;
  for (int p = parts; p < before; ++p) ops.push_back({PartKey(key, p), "", true});
  return parts;
}

void EtcdStateReplica::AddDelete(const std::string& key, std::vector<EtcdOp>& ops) {
  ops.push_back({rows_prefix_ + key, "", true});
  auto known = parts_.find(key);
  const int before = known == parts_.end() ? 1 : known->second;
  for (int p = 1; p < before; ++p) ops.push_back({PartKey(rows_prefix_ + key, p), "", true});
}

absl::Status EtcdStateReplica::Save(const ReplicaBatch& batch) {
  absl::MutexLock lock(&mu_);
  std::vector<EtcdOp> ops;
  std::vector<int> parts;  // of each put, framed (compressed) once
  parts.reserve(batch.puts.size());
  for (const ReplicaEntry& e : batch.puts) parts.push_back(AddPut(e, ops));
  for (const std::string& key : batch.deletes) AddDelete(key, ops);
  if (legacy_) ops.push_back({legacy_key_, "", true});
  absl::Status committed = Commit(std::move(ops), pending_left_);
  // The part counts: after a failure, the larger of before and after, so
  // that the next write of the entry deletes every part that may exist.
  for (size_t i = 0; i < batch.puts.size(); ++i) {
    const std::string& key = batch.puts[i].key;
    int& known = parts_[key];
    known = committed.ok() ? parts[i] : std::max(std::max(known, 1), parts[i]);
    if (known == 1) parts_.erase(key);
  }
  if (committed.ok()) {
    for (const std::string& key : batch.deletes) parts_.erase(key);
    legacy_ = false;
    MaybeCompact();
  }
  return committed;
}

absl::Status EtcdStateReplica::Commit(std::vector<EtcdOp> ops, bool pending_exists) {
  const EtcdOptions& o = session_->options();
  // Two operations of each transaction are kept for head and pending.
  const size_t max_ops = static_cast<size_t>(std::max(3, o.max_txn_ops)) - 2;
  std::vector<std::vector<EtcdOp>> txns(1);
  size_t bytes = 0;
  for (EtcdOp& op : ops) {
    const size_t size = op.key.size() + op.value.size() + 16;
    if (!txns.back().empty() && (txns.back().size() >= max_ops || bytes + size > o.max_txn_bytes)) {
      txns.emplace_back();
      bytes = 0;
    }
    bytes += size;
    txns.back().push_back(std::move(op));
  }
  const int64_t head = head_value_ + 1;
  if (txns.size() > 1) txns.front().push_back({pending_key_, absl::StrCat(head)});
  txns.back().push_back({head_key_, absl::StrCat(head)});
  if (txns.size() > 1 || pending_exists) txns.back().push_back({pending_key_, "", true});
  int64_t written = 0;
  int64_t revision = 0;
  for (size_t i = 0; i < txns.size(); ++i) {
    for (const EtcdOp& op : txns[i]) {
      written += op.key.size() + op.value.size();
      stats_.largest_value_bytes = std::max<int64_t>(stats_.largest_value_bytes, op.value.size());
    }
    absl::StatusOr<int64_t> done = session_->FencedTxn(txns[i]);
    if (!done.ok()) {
      // A batch cut after its first transaction leaves pending behind.
      pending_left_ = pending_left_ || (txns.size() > 1 && i > 0);
      return done.status();
    }
    revision = *done;
    stats_.transactions += 1;
  }
  pending_left_ = false;
  head_value_ = head;
  stats_.batches += 1;
  stats_.bytes_written += written;
  stats_.last_batch_bytes = written;
  stats_.last_batch_transactions = static_cast<int64_t>(txns.size());
  stats_.head_revision = revision;
  writes_since_compaction_ += 1;
  return absl::OkStatus();
}

void EtcdStateReplica::MaybeCompact() {
  const EtcdOptions& o = session_->options();
  if (writes_since_compaction_ < o.compact_every_writes &&
      absl::Now() - last_compaction_try_ < o.compact_interval) {
    return;
  }
  writes_since_compaction_ = 0;
  last_compaction_try_ = absl::Now();
  absl::Status compacted = session_->Compact(stats_.head_revision);
  stats_.compaction_error = compacted.ok() ? "" : std::string(compacted.message());
  if (compacted.ok()) {
    stats_.compacted_revision = stats_.head_revision;
    stats_.compacted_at = absl::Now();
  }
}

}  // namespace zeroshard
