// Jobs, generations and members: the join barrier, fencing, heartbeats and
// failure detection. No gRPC in here: the service adapts calls to it, and
// tests drive it directly with a FakeClock.
//
// A job's life: the first Join creates it (generation 1, JOINING). Joins wait
// until `world_size` distinct worker ids are in; then all are answered at once
// with ranks in sorted worker-id order and fresh tokens (RUNNING). A member
// whose heartbeats stop for `heartbeat_timeout` is declared dead: the job
// turns DEGRADED, the generation is bumped, and survivors' heartbeats are
// answered ABORT_GENERATION_CHANGED until they re-join the new generation.
// When every member left cleanly the job is FINISHED; a later Join starts it
// again with a new generation (and may change the world size).
//
// Durability: with a state store, a change is saved before anyone is told of
// it. A join or leave whose change cannot be saved fails with the store's
// error and leaves the job as it was; a generation that cannot be formed
// answers every waiting join with the error. A death has no caller to fail
// and cannot be undone (the member is silent whatever the disk says), so it
// is applied in memory and the job is marked unsaved: the save is retried on
// every Tick and before every call of the job's members (heartbeats, member
// checks, leaves, joins), which are refused with UNAVAILABLE naming the
// store's error until a save succeeds. So no member acts on a generation
// change that a restarted server would not know (such a server gives the
// members a full timeout and declares the silent one dead again).
//
// One class, its definitions by what they do (shard_server/membership/):
//   membership.cc    construction, listeners; generations formed, started,
//                    announced; idle jobs forgotten
//   member_table.h   what is kept of each job and member (private)
//   joins.cc         Join, CancelJoin: validate -> classify -> apply
//   heartbeats.cc    Heartbeat(s), CheckMember, closed streams, undelivered
//                    join answers
//   leave.cc         Leave
//   tick.cc          Tick: the timer's pass over every job
//   deaths.cc        where a member is declared dead (failure_detector.h's
//                    verdicts on the members the tick judges)
//   shrink.cc        a smaller generation after --rejoin_grace (rejoin_wait.h)
//   grow_back.cc     a shrunk job's missing workers taken back
//   status.cc        GetStatus, WorldSize
//   fences.cc        EvictHost, UnfenceHost: machines fenced from a job
//   persistence.cc   the state store: Restore, saves, syncs
//   goodput.cc       where each job's wall clock went (its goodput ledger)
#ifndef ZEROSHARD_SHARD_SERVER_MEMBERSHIP_MEMBERSHIP_H_
#define ZEROSHARD_SHARD_SERVER_MEMBERSHIP_MEMBERSHIP_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/zeroshard.pb.h"
#include "shard_server/base/clock.h"
#include "shard_server/base/event_log.h"
#include "shard_server/goodput/goodput_ledger.h"
#include "shard_server/membership/failure_detector.h"
#include "shard_server/membership/rejoin_wait.h"
#include "shard_server/state/state_store.h"

namespace zeroshard {

struct MembershipOptions {
  int max_world_size = 131072;
  absl::Duration heartbeat_interval = absl::Seconds(1);  // advertised to members
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // When every member of a job is silent, how long the server suspects its
  // own network before it declares them dead (shard_server/membership/failure_detector.h,
  // rule 4). Zero: no suspicion.
  absl::Duration isolation_grace = absl::ZeroDuration();
  absl::Duration join_timeout = absl::Minutes(10);
  // Jobs the server holds at once (--max_jobs); a Join that would create one
  // more is refused with RESOURCE_EXHAUSTED.
  int max_jobs = 10000;
  // Joins held at once over all jobs (--max_pending_joins). Within a job
  // they are bounded by its world size (<= max_world_size).
  int max_pending_joins = 1 << 18;
  // A job with no live member and no pending join is forgotten (memory and
  // state store; its checkpoints stay on disk and listed) after this long
  // (--job_ttl). A job that never formed is forgotten as soon as its last
  // pending join expires or is cancelled, which frees its id at once.
  absl::Duration job_ttl = absl::Hours(24);
  // A member whose join was made with ClockStart::kAtFirstBeat and that has
  // not beaten within this long after its generation formed has its
  // liveness clock started then (--answer_delivery_timeout): such a member
  // that never beats is declared dead at most this plus heartbeat_timeout
  // after formation.
  absl::Duration answer_delivery_timeout = absl::Seconds(30);
  // After a restart or a failover, how long restored members have to beat
  // again, counted from serving (at least heartbeat_timeout;
  // --restore_grace). Every agent and worker re-attaches at once to a
  // server that has just started: at 100,000 ranks (12,500 agents) that
  // burst took 4-11 s on a loaded 2-core machine (scale_bench
  // --etcd_members), and a member still in it must not be taken for dead.
  absl::Duration restore_grace = absl::Seconds(10);
};

// Thread-safe. Callbacks are never run while an internal lock is held.
class Membership {
 public:
  using JoinDone = std::function<void(absl::StatusOr<v1::JoinResponse>)>;
  // Told when a job's generation changes or the job finishes, so that data
  // scoped to the old generation (the KV store) can be dropped.
  using GenerationListener = std::function<void(const std::string& job_id, int64_t generation)>;

  // `state` may be null (no persistence). Not owned.
  Membership(Clock* clock, EventLog* log, StateStore* state, MembershipOptions options);
  ~Membership();

  // Loads jobs from the state store. Members of running jobs get
  // restore_grace (at least a heartbeat timeout) from now to beat again
  // before they are declared dead.
  absl::Status Restore();
  // Gives every live member restore_grace (at least a heartbeat timeout)
  // from now: called when the server starts serving, so that the grace of restored members is not
  // spent on the rest of the server's start (a checkpoint recovery, say).
  void StartGrace();

  void SetGenerationListener(GenerationListener listener);
  // Told when a job is forgotten (job_ttl), so that what other components
  // keep for it can go too.
  using ForgetListener = std::function<void(const std::string& job_id)>;
  void SetForgetListener(ForgetListener listener);
  // The highest generation anything durable outside Membership recorded for
  // a job (checkpoints): a job created again after it was forgotten starts
  // above it, so generation numbers of one job id never repeat.
  using GenerationFloor = std::function<int64_t(const std::string& job_id)>;
  void SetGenerationFloor(GenerationFloor floor);

  // Either calls `done` at once (a refusal, which changes no state) or holds
  // the join until the barrier completes (with a rank, or with the store's
  // error when the generation cannot be saved), `deadline` (capped at now +
  // join_timeout) passes, or CancelJoin. Returns an id for CancelJoin.
  //
  // `clock`: when the member's liveness clock (the heartbeat timeout) starts
  // in the generation the join forms. kAtFormation: when it forms, for an
  // answer written at once (a Join call of its own). kAtFirstBeat: when the
  // member first beats, when its answer could not be delivered
  // (AnswersUndeliverable), or options.answer_delivery_timeout after
  // formation, whichever comes first: a node agent's host join, whose
  // answers for a 100,000-rank job take longer than a heartbeat timeout to
  // reach every agent and its ranks on a busy machine, must not have them
  // declared dead on the way.
  enum class ClockStart { kAtFormation, kAtFirstBeat };
  uint64_t Join(const v1::JoinRequest& request, absl::Time deadline, JoinDone done,
                ClockStart clock = ClockStart::kAtFormation);
  // Answers of kAtFirstBeat joins that could not be written to their caller
  // (its call broke), by the JoinResponse they carried: each member's clock
  // starts now, so it is declared dead a heartbeat timeout later unless it
  // beats. Answers of an older generation, or of a member whose clock
  // already started, change nothing.
  struct UndeliveredAnswer {
    std::string job_id;
    int64_t generation = 0;
    int rank = 0;
  };
  void AnswersUndeliverable(const std::vector<UndeliveredAnswer>& answers);
  // The caller went away: forget its pending join and answer CANCELLED.
  void CancelJoin(uint64_t join_id);

  // OK when `member` is a live member of the job's current, formed generation
  // presenting its token; FAILED_PRECONDITION (stale generation, wrong token,
  // departed member), NOT_FOUND (unknown job) or UNAVAILABLE (the job has an
  // unsaved change) otherwise.
  absl::Status CheckMember(const v1::MemberCredentials& member);

  // Records a beat and says what the member should do. A member of the last
  // formed generation after a bump gets ABORT_GENERATION_CHANGED; a wrong
  // token or an older generation gets FAILED_PRECONDITION; a job with an
  // unsaved change UNAVAILABLE (the beat still counts).
  // `stream` names the heartbeat stream it came on (0: unknown).
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request,
                                                  uint64_t stream = 0);
  // Heartbeat for the ranks of one node agent's message, in order: one
  // acquisition of the lock and one wait for the state store for all of
  // them (at 100K ranks the server takes 12,500 such messages a second).
  struct StreamBeat {
    const v1::HeartbeatRequest* request;
    uint64_t stream;
    // The beat's credentials, when not request->member() (a node agent's
    // RankBeat.same_member: the server kept them from an earlier beat).
    const v1::MemberCredentials* member = nullptr;
  };
  std::vector<absl::StatusOr<v1::HeartbeatResponse>> Heartbeats(
      const std::vector<StreamBeat>& beats);
  // Heartbeat stream `stream` closed (the last beat on it named `member`):
  // when it carried the member's latest beat, evidence of death
  // (failure_detector.h, rules 0 and 1). An older stream closing is not.
  void HeartbeatStreamClosed(const v1::MemberCredentials& member, uint64_t stream = 0);

  // A clean exit. When every member left, the job is FINISHED. A leave that
  // cannot be saved returns the store's error and changes nothing.
  // `final`: the member's last step and loss as it left (LeaveRequest's
  // has_final; null: keep what its heartbeats said).
  absl::Status Leave(const v1::MemberCredentials& member, const v1::LeaveRequest* final = nullptr);

  // Declares members dead whose heartbeats stopped, expires pending joins and
  // retries the saves of unsaved jobs. Called by the server's timer every few
  // tens of milliseconds.
  void Tick();
  // How far behind the server's call queues are at `at` (failure_detector.h,
  // rule 4b: ServerLag). The server reads it before each Tick.
  void ReadServerLag(absl::Time at, absl::Duration lag) ABSL_LOCKS_EXCLUDED(mu_);

  v1::GetStatusResponse Status(const std::string& job_id);
  // The same into `*out` (cleared first): a message on an arena makes the
  // copy of a large job's members cheap (the server's timer, twice a second).
  void FillStatus(const std::string& job_id, v1::GetStatusResponse* out);

  // The job's world size, or NOT_FOUND.
  absl::StatusOr<int> WorldSize(const std::string& job_id);

  // ---- fences.cc: machines fenced from a job (docs/numerics.md) ----
  // A member (of the current or the last formed generation: every rank asks
  // at once, and the first ask moves the generation on) asks to evict the
  // machine of `rank`: its node (JoinRequest.node; its host when it sent
  // none) is fenced, saved first, and every live member there is declared
  // dead at once (a new generation, DEGRADED, as for a dead host). A machine
  // already fenced: OK with already = true, nothing changes.
  // INVALID_ARGUMENT for a rank outside the generation.
  absl::StatusOr<v1::EvictHostResponse> EvictHost(const v1::EvictHostRequest& request);
  // Lifts the job's fences whose node is `host` or whose hostname is (the
  // node's first word): the nodes lifted (none: OK, empty). NOT_FOUND for an
  // unknown job.
  absl::StatusOr<v1::UnfenceHostResponse> UnfenceHost(const std::string& job_id,
                                                      const std::string& host);

 private:
  // The member table (member_table.h): defined there, for Membership's own
  // files only.
  struct MemberState;
  struct PendingJoin;
  struct Job;
  using Deferred = std::vector<std::function<void()>>;

  // ---- membership.cc: generations, the job table ----
  // The job of `member`'s formed generation, its token checked (and, unless
  // `allow_stale`, that generation the job's current one): NOT_FOUND or
  // FAILED_PRECONDITION otherwise.
  absl::StatusOr<Job*> FindMemberJob(const v1::MemberCredentials& member, bool allow_stale)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers every held join of `job` with `status` and forgets them.
  void FailPendingJoins(Job& job, const absl::Status& status, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK unless the pending joins come from several machines and some
  // advertise loopback hosts: FAILED_PRECONDITION naming them.
  static absl::Status CheckHostsReachable(const Job& job);
  // Assigns ranks to the pending joins and answers them. When the save
  // fails, every pending join is answered with the error instead and the job
  // is left as it was.
  void FormGeneration(Job& job, Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FormGeneration's answers: each pending join gets its rank and token in
  // the formed generation (the member table unless it asked to skip it).
  void AnswerPendingJoins(Job& job, Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the job to a new generation (and world size) in `state`, saved
  // first: on a failed save the job is left as it was and the error returned.
  absl::Status StartGeneration(Job& job, int world_size, v1::JobState state,
                               const std::string& reason, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What follows a generation change in memory: joins pending for
  // `old_generation` are abandoned, the listener is told. The caller
  // Remember()s why, before saving the change.
  void AnnounceGeneration(Job& job, int64_t old_generation, const std::string& reason,
                          Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records why `job` is at its current generation (bounded history, saved
  // with the job: call it before the save that it explains).
  void Remember(Job& job, const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // True when `job` has no live member and no pending join and either never
  // formed or has been idle for job_ttl, and it is gone from the state store
  // (the listener is told): the caller erases it from jobs_.
  bool ForgetIfIdle(Job& job, absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewToken();
  // A duration as the event log writes it: whole milliseconds.
  static std::string Ms(absl::Duration d);

  // ---- joins.cc: validate -> classify -> apply ----
  // What a valid join does to the server's state.
  enum class JoinKind {
    kNewJob,                   // no such job: create it (generation 1, JOINING)
    kJoinForming,              // a generation is forming: wait in it
    kRestartFinished,          // the job finished: a new generation, JOINING
    kRejoin,                   // a member that left or died: a new generation, DEGRADED
    kReplaceRestartedProcess,  // a live member's id whose heartbeat stream
                               // closed or went silent for an interval: it is
                               // gone, a new generation, DEGRADED
    kGrowBack,                 // a worker id missing from a shrunk job: waits
                               // for the next snapshot boundary (formed job) or
                               // widens the forming generation
  };
  // INVALID_ARGUMENT naming the field; needs no state.
  absl::Status ValidateJoinRequest(const v1::JoinRequest& request) const;
  // The join's kind against `job` (null: none by that id), or why it is
  // refused; changes nothing but saving the job's unsaved change.
  absl::StatusOr<JoinKind> ClassifyJoin(const v1::JoinRequest& request, Job* job)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<JoinKind> ClassifyJoinToJob(const v1::JoinRequest& request, Job* job)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<JoinKind> ClassifyJoinToFormedJob(const v1::JoinRequest& request,
                                                   const Job& job) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION when the request's world size or recovery options
  // differ from the job's.
  absl::Status CheckSameJobOptions(const v1::JoinRequest& request, const Job& job) const;
  // FAILED_PRECONDITION naming the fence when the join comes from a machine
  // fenced from `job` (fences.cc).
  absl::Status CheckNotFenced(const v1::JoinRequest& request, const Job& job) const;
  // Makes the change `kind` names; the job the join then waits in. On an
  // error (a failed save) nothing changed.
  absl::StatusOr<Job*> ApplyJoin(JoinKind kind, const v1::JoinRequest& request, Job* job,
                                 absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Job*> CreateJob(const v1::JoinRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // REQUIRES: `worker_id` is a live member of `job`; `incarnation` is the
  // joining process's.
  absl::Status ReplaceRestartedMember(Job& job, const std::string& worker_id,
                                      const std::string& incarnation, absl::Time now,
                                      Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Holds the join in `job` (forming the generation when it is the last);
  // its id for CancelJoin.
  uint64_t AddPendingJoin(Job& job, const v1::JoinRequest& request, absl::Time deadline,
                          absl::Time now, ClockStart clock, JoinDone done, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- heartbeats.cc ----
  // Heartbeat's record of a beat whose credentials are `member` (request's
  // own member is not read); `*commit`: the job's last commit, which the
  // answer may reveal.
  absl::StatusOr<v1::HeartbeatResponse> RecordHeartbeat(const v1::HeartbeatRequest& request,
                                                        const v1::MemberCredentials& member,
                                                        uint64_t stream, int64_t* commit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A member's report of a recovery phase (HeartbeatRequest.recovery):
  // kept (one per generation, the last 32) and logged when its generation or
  // phase is not the last one's.
  void RecordRecovery(Job& job, const v1::RecoveryRecord& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rank 0's outer steps (HeartbeatRequest / LeaveRequest.outer_steps,
  // checked by ValidateOuterSteps): each one not yet kept is added, with the
  // worker ids of its generation's ranks that took part (outer_steps.cc).
  void RecordOuterSteps(Job& job,
                        const google::protobuf::RepeatedPtrField<v1::OuterStepRecord>& records)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A member beat again after `silent` (over two intervals): logged, or
  // counted when the job's second already listed kResumedListed.
  void LogResumed(Job& job, const MemberState& m, absl::Duration silent, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the count of the second's unlisted resumes once it is over.
  void FlushResumed(Job& job, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- leave.cc ----
  // Every member of `job` left (it is FINISHED): logged, growers still
  // waiting answered OUT_OF_RANGE, the listener told.
  void AnnounceFinished(Job& job, Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A member failed (LeaveRequest.failure; `job` is FAILED, its generation
  // bumped from `previous_generation`): logged, every pending join refused
  // with JobFailedError, the members told the generation ended.
  void AnnounceFailed(Job& job, int64_t previous_generation, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `job` FAILED by member `m`'s `failure`: the reason kept, the generation
  // bumped, the history told. UnmarkFailed undoes it when the save fails.
  void MarkFailed(Job& job, const MemberState& m, const std::string& failure)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnmarkFailed(Job& job, int64_t previous_generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION naming `job`'s failure, for a join of a member of
  // the failed run (`worker_id`; "" for "this worker").
  absl::Status JobFailedError(const Job& job, const std::string& worker_id) const;

  // ---- tick.cc and deaths.cc: the timer's pass; where a member is declared dead ----
  // Answers the joins of `job` whose deadline passed with DEADLINE_EXCEEDED.
  void ExpireJoins(Job& job, absl::Time now, Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A restart of an ended job whose every join timed out before it formed:
  // back to the state it ended in (Job::restarted_from), saved.
  void AbandonRestart(Job& job, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a join of `job` that timed out at `now` is told: how many had
  // joined a forming generation; a grower, why the job did not grow back.
  static std::string JoinTimeoutMessage(const Job& job, const PendingJoin& p, absl::Time now);
  // At the job's delivery deadline, starts the clocks of the members that
  // have not beaten.
  void StartOverdueClocks(Job& job, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live members Tick must judge at `now`: those silent longer than a
  // beating member can be (the front of `job.silence`) and those whose
  // stream closed; by rank. Of the members rule 4b holds alive for the
  // server's lag since their last beat (server_lag_), only the longest
  // silent, and those after it that may be dead by a smaller lag.
  std::vector<MemberState*> MembersToJudge(Job& job, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The failure detector's verdicts on `live` (MembersToJudge), in order.
  std::vector<MemberVerdict> Verdicts(const Job& job, const std::vector<MemberState*>& live,
                                      absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Declares dead the live members the failure detector finds dead (deaths.cc).
  // A death in the formed generation moves the job to a new one (DEGRADED):
  // applied at once, saved when it can be. True when one did.
  bool DeclareDeaths(Job& job, absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Logs the start and end of the failure detector's doubts about `live`
  // (its rules 3 and 4) for `job`.
  void LogDoubts(Job& job, const std::vector<const MemberState*>& live,
                 const std::vector<MemberVerdict>& verdicts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- fences.cc ----
  // Every live member on machine `node` is dead (logged with `why`), joins
  // held from there are refused, and a formed generation moves on
  // (DEGRADED); applied at once, saved when it can be, as a death.
  // `m` dead now (its member_dead line says `why`), its name appended to
  // *dead (the generation's history). The caller bumps the generation.
  void MarkDead(Job& job, MemberState& m, absl::Time now, absl::string_view why, std::string* dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeclareMachineDead(Job& job, const std::string& node, const std::string& why, absl::Time now,
                          Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- shrink.cc and grow_back.cc ----
  // A job in DEGRADED whose rejoin grace is over forms a smaller generation
  // once min_world_size members re-joined, waits while live members could
  // still make it up, and fails the waiting joins otherwise (rejoin_wait.h;
  // shrink.cc).
  void MaybeShrink(Job& job, absl::Time now, Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whole shard groups: takes out of `job.pending` the re-joined that a
  // shrink to `form_size` leaves out (whole old groups are kept first, by
  // old rank; then survivors of broken groups; growers last), each with its
  // `parked` reason; *why: who and why, for the generation's history.
  std::map<std::string, PendingJoin> ParkBrokenGroups(Job& job, int form_size, std::string* why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Who re-joined `job`'s forming generation and who did not, at `now`.
  static RejoinState RejoinStateOf(const Job& job, absl::Time now);
  // The status's waiting_for and waiting while the job waits for survivors
  // past its grace.
  static void FillRejoinWait(const Job& job, absl::Time now, v1::JobStatus* out);
  // The status's growing and growing_note: a formed job's growers, and what
  // they wait for.
  static void FillGrowing(const Job& job, v1::JobStatus* out);
  // Ends a formed generation that growers wait on once its members
  // committed the snapshot after the first grower came (or kGrowBoundaryWait
  // passed without one): they all join the next, larger generation.
  void MaybeGrowBack(Job& job, absl::Time now, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- persistence.cc ----
  // The last beat a restored member is given: its silence reaches
  // heartbeat_timeout restore_grace after `now`.
  absl::Time RestoredBeat(absl::Time now) const;
  // Writes the job to the state store (OK without one).
  absl::Status Persist(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Persist for a change a caller is told about: a failure is logged and
  // returned as "<failure>: <the store's error>".
  absl::Status SaveChange(const Job& job, absl::string_view failure)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Persist for a change that stands whatever the disk says (a death): a
  // failure marks the job unsaved.
  void SaveOrMarkUnsaved(Job& job, absl::string_view change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when the job has no unsaved change or saving it now succeeds;
  // otherwise UNAVAILABLE naming the store's error.
  absl::Status SaveUnsaved(Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes the state store's commits up to `commit` durable; called after mu_
  // is released and before anyone hears of them, so that no call waiting for
  // mu_ (a heartbeat) waits for the disk, and callers syncing at once share
  // one fsync. A failure is logged and returned.
  absl::Status SyncState(int64_t commit) ABSL_LOCKS_EXCLUDED(mu_);
  // ---- goodput.cc: each job's ledger (shard_server/goodput/goodput_ledger.h) ----
  // The ledger's phase that `job`'s state is in.
  static GoodputLedger::Phase GoodputPhase(const Job& job);
  // The last sign of life of `m` at `now`: the close of its heartbeat stream
  // when that carried its latest beat (a killed process's closes at once),
  // else its latest beat (a member restored and silent since: the restore).
  static absl::Time LastSignOfLife(const Job& job, const MemberState& m, absl::Time now);
  // Saves the job's ledger: now when `phase_changed`; else when it changed
  // and its last save is kGoodputSaveEvery old, or the last save failed. A
  // failure is logged once and retried by the next Tick; it fails nothing
  // (the ledger is not what anyone is told).
  void SaveGoodput(Job& job, absl::Time now, bool phase_changed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Restore's part: the saved ledgers, each moved to its job's phase.
  absl::Status RestoreGoodput(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A beat's part: its step, and its TimeLedger when it sent one.
  void RecordGoodputBeat(Job& job, int64_t generation, int rank,
                         const v1::HeartbeatRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The running generation ended at `now` (AnnounceGeneration).
  void EndGoodputGeneration(Job& job, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Every commit so far (0 without a store).
  int64_t LastCommit() const { return state_ == nullptr ? 0 : state_->LastCommit(); }

  Clock* const clock_;
  EventLog* const log_;
  StateStore* const state_;
  const MembershipOptions options_;
  const FailureDetectorOptions detector_options_;

  absl::Mutex mu_;
  ServerLag server_lag_ ABSL_GUARDED_BY(mu_);  // ReadServerLag
  absl::flat_hash_map<std::string, std::unique_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // Where each pending join is held: CancelJoin in O(1), not a scan of the
  // job's pending joins (a withdrawn 100,000-rank barrier cancels them all).
  struct PendingPlace {
    std::string job_id;
    std::string worker_id;  // its key in the job's `pending`
  };
  absl::flat_hash_map<uint64_t, PendingPlace> pending_by_id_ ABSL_GUARDED_BY(mu_);
  uint64_t next_join_id_ ABSL_GUARDED_BY(mu_) = 1;
  GenerationListener listener_ ABSL_GUARDED_BY(mu_);
  ForgetListener forget_listener_ ABSL_GUARDED_BY(mu_);
  GenerationFloor generation_floor_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_MEMBERSHIP_MEMBERSHIP_H_
