#include "shard_server/plan_service.h"

#include <xxhash.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/plan/plan_codec.h"
#include "common/plan/planner.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace zeroshard {
namespace {

// Identifies a request: the spec, the options and the world size.
std::string RequestDigest(int world_size, const v1::ModelSpec& spec,
                          const v1::PlanOptions& options) {
  std::string bytes =
      absl::StrCat(world_size, "|", spec.SerializeAsString(), "|", options.SerializeAsString());
  return absl::StrFormat("%016x", XXH64(bytes.data(), bytes.size(), 0));
}

// At most how many pieces a plan of `spec` over `world_size` ranks has: a
// piece is whole dim-0 rows of one tensor on one rank, so a tensor has at
// most min(rows, world size) of them (a 0-d tensor one).
int64_t OneOffPieces(int world_size, const v1::ModelSpec& spec) {
  int64_t pieces = 0;
  for (const v1::TensorSpec& t : spec.tensors()) {
    const int64_t rows = t.shape_size() > 0 ? std::max<int64_t>(t.shape(0), 1) : 1;
    pieces += std::min<int64_t>(rows, std::max(world_size, 1));
  }
  return pieces;
}

// The hash (field 3) of a serialized ShardPlan, read without parsing the
// units that follow it (a large job's plan is tens of MB). False: corrupt.
bool StoredPlanHash(const std::string& bytes, std::string* hash) {
  using google::protobuf::internal::WireFormatLite;
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  while (const uint32_t tag = in.ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) == v1::ShardPlan::kHashFieldNumber &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      return WireFormatLite::ReadString(&in, hash);
    }
    if (!WireFormatLite::SkipField(&in, tag)) return false;
  }
  return in.ConsumedEntireMessage();
}

}  // namespace

PlanService::PlanService(StateStore* state, EventLog* log, PlanServiceOptions options)
    : state_(state), log_(log), options_(std::move(options)) {}

absl::StatusOr<v1::ShardPlan> PlanService::Compute(int world_size, const v1::ModelSpec& spec,
                                                   const v1::PlanOptions& options) {
  const ModelSpec model = ModelSpecFromProto(spec);
  const PlanOptions plan_options = PlanOptionsFromProto(options);
  absl::StatusOr<ShardPlan> plan = options_.planner
                                       ? options_.planner(model, world_size, plan_options)
                                       : zeroshard::Plan(model, world_size, plan_options);
  if (!plan.ok()) return plan.status();
  return ShardPlanToProto(*plan);
}

absl::StatusOr<v1::ShardPlan> PlanService::OneOff(int world_size, const v1::ModelSpec& spec,
                                                  const v1::PlanOptions& options) {
  // Its size first (#44 finding 6: 20,000 tensors at 131,072 ranks made an
  // 81 MB answer and +540 MB).
  const int64_t pieces = OneOffPieces(world_size, spec);
  if (pieces > kMaxOneOffPlanPieces) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a one-off plan of ", spec.tensors_size(), " tensors over ", world_size,
        " ranks may have up to ", pieces, " pieces; the server computes at most ",
        kMaxOneOffPlanPieces,
        " for a caller that is not a member of a job (a piece per tensor and rank holding "
        "its rows); compute it on your machine with shardctl plan --local"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (one_off_in_progress_) {
      return absl::ResourceExhaustedError(
          "the server computes one one-off plan at a time and one is being computed; try again "
          "in a few seconds, or use shardctl plan --local");
    }
    one_off_in_progress_ = true;
  }
  absl::StatusOr<v1::ShardPlan> plan = Compute(world_size, spec, options);
  absl::MutexLock lock(&mu_);
  one_off_in_progress_ = false;
  return plan;
}

absl::StatusOr<v1::ShardPlan> PlanService::Plan(const std::string& job_id, int64_t generation,
                                                int world_size, const v1::ModelSpec& spec,
                                                const v1::PlanOptions& options) {
  if (job_id.empty()) return OneOff(world_size, spec, options);  // not stored

  const std::string digest = RequestDigest(world_size, spec, options);
  const Key key(job_id, generation);
  while (true) {
    std::shared_ptr<Entry> entry;
    bool fill = false;
    {
      absl::MutexLock lock(&mu_);
      auto it = plans_.find(key);
      if (it == plans_.end()) {
        entry = std::make_shared<Entry>();
        entry->digest = digest;
        plans_.emplace(key, entry);
        fill = true;
      } else {
        entry = it->second;
      }
      entry->last_used = ++uses_;
    }
    if (fill) {
      // Outside the lock: reading, computing and storing a large plan takes
      // seconds, and only this generation's ranks need to wait for it.
      Fill(key, world_size, spec, options, entry.get());
      absl::MutexLock lock(&mu_);
      if (entry->status.ok()) {
        latest_hash_[job_id] = entry->plan.hash();
      } else {
        // A refused spec stores nothing: the generation's next valid spec
        // becomes its plan.
        auto it = plans_.find(key);
        if (it != plans_.end() && it->second == entry) plans_.erase(it);
      }
      entry->done.Notify();
      EvictLocked();
    } else {
      entry->done.WaitForNotification();
    }
    if (!entry->status.ok()) {
      if (entry->digest == digest) return entry->status;
      continue;  // another request failed; this one may plan the generation
    }
    if (entry->digest != digest) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", job_id, "' generation ", generation, " already has plan ",
                       entry->plan.hash(), " for a different model spec or options (request ",
                       digest, " vs ", entry->digest, "); every rank must send the same spec"));
    }
    return entry->plan;
  }
}

void PlanService::Fill(const Key& key, int world_size, const v1::ModelSpec& spec,
                       const v1::PlanOptions& options, Entry* entry) {
  const auto& [job_id, generation] = key;
  if (state_ != nullptr) {
    absl::StatusOr<std::optional<StoredPlan>> stored = state_->LoadPlan(job_id, generation);
    if (!stored.ok()) {
      entry->status = stored.status();
      return;
    }
    if (stored->has_value()) {
      // A restarted server, or a plan dropped from memory, is read back.
      if (!entry->plan.ParseFromString((*stored)->plan_bytes)) {
        entry->status = absl::DataLossError(absl::StrCat(
            "stored plan of job '", job_id, "' generation ", generation, " is corrupt"));
        return;
      }
      entry->digest = (*stored)->spec_hash;
      return;
    }
  }
  absl::StatusOr<v1::ShardPlan> plan = Compute(world_size, spec, options);
  if (!plan.ok()) {
    entry->status = plan.status();
    return;
  }
  if (state_ != nullptr) {
    entry->status =
        state_->SavePlan(job_id, generation, {entry->digest, plan->SerializeAsString()});
    if (!entry->status.ok()) return;
  }
  log_->Log("plan_computed", {{"job", job_id},
                              {"generation", absl::StrCat(generation)},
                              {"world_size", absl::StrCat(world_size)},
                              {"units", absl::StrCat(plan->units_size())},
                              {"plan", plan->hash()}});
  entry->plan = *std::move(plan);
}

void PlanService::EvictLocked() {
  // Only plans that are done (and so stored) may go; a linear scan is fine
  // for a cache of tens of entries. Without a state store the cache is the
  // only record of each generation's plan, so it stays.
  if (state_ == nullptr) return;
  while (plans_.size() > options_.max_cached_plans) {
    auto oldest = plans_.end();
    for (auto it = plans_.begin(); it != plans_.end(); ++it) {
      if (!it->second->done.HasBeenNotified()) continue;
      if (oldest == plans_.end() || it->second->last_used < oldest->second->last_used) {
        oldest = it;
      }
    }
    if (oldest == plans_.end()) return;
    plans_.erase(oldest);
  }
}

void PlanService::ForgetJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  latest_hash_.erase(job_id);
  for (auto it = plans_.begin(); it != plans_.end();) {
    // A plan still being computed stays with its waiters.
    if (it->first.first == job_id && it->second->done.HasBeenNotified()) {
      it = plans_.erase(it);
    } else {
      ++it;
    }
  }
}

std::string PlanService::PlanHash(const std::string& job_id) {
  {
    absl::MutexLock lock(&mu_);
    auto it = latest_hash_.find(job_id);
    if (it != latest_hash_.end() || state_ == nullptr) {
      return it == latest_hash_.end() ? "" : it->second;
    }
  }
  // Not planned by this process: a restarted server, or a new leader after
  // a failover, whose ranks have not asked for their plan again. The plan
  // is durable state: read its hash back once (outside the lock: reading a
  // large plan takes a while, and Plan() must not wait for it).
  absl::StatusOr<std::optional<StoredPlan>> stored = state_->LoadLatestPlan(job_id);
  if (!stored.ok()) return "";  // status says nothing rather than fail; asked again next time
  std::string hash;
  if (stored->has_value() && !StoredPlanHash((*stored)->plan_bytes, &hash)) hash.clear();
  absl::MutexLock lock(&mu_);
  // A plan computed meanwhile is newer than what was read: it stays. An
  // empty hash is kept too (a job without a plan yet is not read again).
  return latest_hash_.try_emplace(job_id, hash).first->second;
}

size_t PlanService::cached_plans() {
  absl::MutexLock lock(&mu_);
  return plans_.size();
}

}  // namespace zeroshard
