// Elastic DiLoCo outer steps in the worker (--outer_timeout; docs/diloco.md,
// "Elastic outer steps"), and every outer step's record.
//
// At each outer step the groups meet at a quorum kept in the generation's KV
// store on the shard server (outer_quorum.h): each group's leader (its
// member 0) takes part in the decision, the other members read it. A group
// left out skips the outer step
// and trains on; the engine catches it up at the next one it is in
// (ZeroEngine::OuterStepAmong). Checkpoint steps and the last step wait for
// every group (a checkpoint, and the run's end, hold one model).
#include <bitset>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/status_context.h"
#include "worker/outer_quorum.h"
#include "worker/outer_sync_config.h"
#include "worker/worker.h"

namespace zeroshard {
namespace {

// Quorums kept in the KV store, the newest ones: a group this many outer
// steps behind would find its step's decision gone. Deleted by the leaders.
constexpr int kQuorumsKept = 64;

int Groups(uint64_t mask) { return static_cast<int>(std::bitset<64>(mask).count()); }

}  // namespace

bool Worker::ElasticOuter() const {
  return config_.engine.replica_sync == ReplicaSync::kDiLoCo &&
         config_.outer_timeout > absl::ZeroDuration();
}

absl::Status Worker::ElasticOuterStep(int completed) {
  ZeroEngine& e = *generation_->engine;
  const int group = rank_ / e.group_size();
  absl::StatusOr<uint64_t> present =
      AccountAs(ledger_, TimeCause::kStraggler, [&] { return OuterQuorum(completed); });
  if (!present.ok()) return present.status();
  const int groups = e.world_size() / e.group_size();
  outer_quorum_full_ = Groups(*present) == groups;
  outer_group_current_ = (*present >> group & 1) != 0;
  if ((*present >> group & 1) == 0) {
    // Late: the others went on without this group. It trains on from its
    // anchor; the next outer step it reaches in time catches it up.
    OuterStats none;
    none.outer_step = e.outer_steps();
    return RecordOuterStep(completed, none, *present, /*took_part=*/false);
  }
  absl::StatusOr<Communicator*> comm = PresentGroupsComm(*present);
  if (!comm.ok()) return comm.status();
  absl::StatusOr<OuterStats> outer = e.OuterStepAmong(*comm);
  if (!outer.ok()) return Annotate(outer.status(), absl::StrCat("outer step after ", completed));
  return RecordOuterStep(completed, *outer, *present, /*took_part=*/true);
}

absl::StatusOr<uint64_t> Worker::OuterQuorum(int completed) {
  ZeroEngine& e = *generation_->engine;
  QuorumCall call;
  call.after_step = completed;
  call.group = rank_ / e.group_size();
  call.groups = e.world_size() / e.group_size();  // <= kMaxOuterQuorumGroups (the flags)
  call.wait_for_all = completed == config_.schedule.steps ||
                      (config_.checkpoint.every > 0 && completed % config_.checkpoint.every == 0);
  call.up_to_date = outer_group_current_;
  call.timeout = config_.outer_timeout;
  call.limit = config_.engine.collective_timeout + config_.outer_timeout;
  const int64_t forget = completed - int64_t{kQuorumsKept} * config_.engine.outer.every;
  call.forget_step = forget > 0 ? forget : 0;
  ClientQuorumStore store(client_.get());
  return rank_ % e.group_size() == 0 ? LeadOuterQuorum(&store, call)
                                     : ReadOuterQuorum(&store, call);
}

absl::StatusOr<Communicator*> Worker::PresentGroupsComm(uint64_t present) {
  Generation& g = *generation_;
  const int groups = g.engine->world_size() / g.engine->group_size();
  if (Groups(present) < 2) return nullptr;  // alone: the group's own step
  if (Groups(present) == groups) return g.data_plane->replicas.get();
  std::unique_ptr<Communicator>& cached = g.data_plane->replica_subsets[present];
  if (cached == nullptr) {
    AbortLatch* const abort = abort_;
    absl::StatusOr<std::unique_ptr<Communicator>> comm =
        ConnectReplicaSubset(client_.get(), rank_, world(), g.plane_options, present,
                             [abort] { return abort->tripped(); });
    if (!comm.ok()) {
      return Annotate(comm.status(), absl::StrCat("the replicas of outer groups ", present));
    }
    cached = *std::move(comm);
  }
  return cached.get();
}

absl::Status Worker::RecordOuterStep(int completed, const OuterStats& outer, uint64_t present,
                                     bool took_part) {
  ZeroEngine& e = *generation_->engine;
  // Every replica holds the same averaged outer gradient: the sum of the
  // ranks' squares counts it W / G times. Elastic: the group's ranks hold
  // one copy (the groups do not meet here).
  double norm = 0;
  if (took_part) {
    absl::StatusOr<double> squares = ElasticOuter()
                                         ? e.SumOverStepRanks(outer.shard_squares, "outer squares")
                                         : e.MeanOverRanks(outer.shard_squares, "outer squares");
    if (!squares.ok()) return Annotate(squares.status(), "outer step");
    norm = std::sqrt(*squares * (ElasticOuter() ? 1 : e.group_size()));
  }
  // Numbered by the run's steps, not this engine's count: a recovery (a new
  // engine) or a resume goes on with the run's numbers. Streaming: one
  // number per H / F steps (a fragment's turn), by the step it began after.
  const OuterOptions& options = config_.engine.outer;
  const int period = std::max(1, options.every / std::max(1, options.fragments));
  const int64_t began = outer.fragment >= 0 ? outer.began_tag : completed;
  OuterStepRecord record;
  record.after_step = completed;
  record.outer_step = (began + period - 1) / period;
  // Every group of the generation took part (a recovery that lost a group
  // formed a generation without it), or those of the quorum.
  record.groups = present != 0 ? Groups(present) : e.world_size() / e.group_size();
  record.generation = generation_->membership.generation;
  record.bytes_sent = outer.bytes_sent;
  record.ms = outer.ms;
  record.outer_grad_norm = norm;
  record.residual_norm = std::sqrt(outer.residual_squares);
  record.fragment = outer.fragment;
  record.began_after_step = began;
  record.on_replica_thread = outer.on_replica_thread;
  record.all_reduce_ms = outer.all_reduce_ms;
  record.wait_ms = outer.wait_ms;
  record.present_groups = present;
  record.took_part = took_part;
  record.caught_up = outer.caught_up;
  record.stale_groups = outer.stale_groups;
  metrics_.outer_steps.push_back(record);
  if (rank_ == 0) ReportOuterStep(record, outer);
  return absl::OkStatus();
}

// Rank 0: to the server (with the next heartbeat) and the log.
void Worker::ReportOuterStep(const OuterStepRecord& record, const OuterStats& outer) {
  v1::OuterStepRecord sent;
  sent.set_outer_step(record.outer_step);
  sent.set_after_step(record.after_step);
  sent.set_generation(record.generation);
  sent.set_groups(record.groups);
  sent.set_group_size(generation_->engine->group_size());
  sent.set_present_groups(record.present_groups);
  client_->ReportOuterStep(sent);
  const std::string what = outer.fragment < 0
                               ? std::string("")
                               : absl::StrCat(" (fragment ", outer.fragment, ", begun after step ",
                                              outer.began_tag, ")");
  std::string elastic;
  if (record.present_groups != 0) {
    elastic = absl::StrCat(
        " (groups ",
        std::bitset<64>(record.present_groups)
            .to_string()
            .substr(64 - generation_->engine->world_size() / generation_->engine->group_size()),
        record.took_part ? "" : "; rank 0's group was late and skipped it",
        record.stale_groups > 0 ? "; stale groups caught up" : "", ")");
  }
  std::fprintf(stderr,
               "outer step %lld after step %lld%s: outer_grad_norm %.6f  %.1f ms  %lld bytes  "
               "%d group(s)%s\n",
               static_cast<long long>(record.outer_step), static_cast<long long>(record.after_step),
               what.c_str(), record.outer_grad_norm, record.ms,
               static_cast<long long>(record.bytes_sent), record.groups, elastic.c_str());
}

}  // namespace zeroshard
