// The ZeRO engine: stages 0-3 over a shard plan, with one schedule for every
// backend.
//
// Layouts. A unit's "flat" layout is its tensors back to back (what the model
// computes on); its "chunked" layout is W chunks of chunk_elements each, rank
// r's chunk holding r's pieces at their plan offsets (what collectives move).
// A piece is a contiguous range in both, so packing and unpacking are range
// copies ("segments").
//
// Stages (Ψ parameters, W ranks, fp32 unless --param_dtype=bf16):
//   0: replicated params, full grads all-reduced, full optimizer state.  16Ψ
//   1: + optimizer state sharded; grads reduce-scattered at the step.    8Ψ + 8Ψ/W
//   2: + gradient shards, reduce-scattered per unit during backward.     4Ψ + 12Ψ/W
//   3: + parameter shards, gathered per unit just in time, then freed.   16Ψ/W
// With shard groups of G ranks (hybrid sharding, planner.h) read G for W:
// gathers and reduce-scatters run inside the group (`gather`, `reduce`), and
// each reduced gradient shard is then averaged over the W / G replicas
// (EngineOptions::replicas), on a replica thread of its own, overlapping the
// backward and the group's next reduce-scatters.
// DiLoCo (EngineOptions::replica_sync kDiLoCo): no per-step average over
// the replicas; each group trains its own copy and OuterStep averages the
// groups' parameter changes every H steps (engine_outer.cc).
// Stage 3's window: before computing op position k, gathers for the next
// `prefetch` positions (forward) or the previous one (backward) are in
// flight, so at most 1 + prefetch units are unsharded at once. The next
// pass's first 1 + prefetch gathers start inside Step, as soon as their
// units are updated, overlapping the rest of the optimizer.
//
// hpZ (ZeRO++'s secondary shards, EngineOptions::secondary, stage 3): the
// forward's gather of a unit (over the gather group) yields the full unit;
// each rank keeps its 1/H slice of it (an even split of the flat layout
// over the H ranks of its secondary group, the ranks of a host) and the
// backward gathers the unit from those slices over the secondary group only,
// so the backward's gathers never leave the host. A unit's slice is stale
// from its optimizer update (or Initialize: a resume or a recovery) until
// the next primary gather of it, which rebuilds it; a backward position
// whose unit's slice is stale gathers from the primary shards instead. The
// slices are bit copies of what the primary gather delivered, so hpZ runs
// compute on the same bits as runs without it. Costs Psi/H f32 per rank
// (params_secondary).
//
// Threads: the caller's (compute), a gather thread and a reduce thread, each
// with its own communicator, so gathers, reductions and compute overlap;
// with shard groups also a replica thread (the replicas' communicator), so
// that a unit's all-reduce across the groups (across hosts, with groups by
// host) runs while the reduce thread goes on with the next unit's
// reduce-scatter inside the group. Under DiLoCo that thread runs only the
// outer all-reduces of streaming fragments, overlapping the next steps.
// Collectives are issued in the same order on every rank.
//
// Files (docs/design.md, "ZeRO engine"): engine_options.h and unit_layout.h
// what an engine is made of; engine.cc the core and the unit walk;
// engine_setup.cc what Create plans, the step's buffers included
// (step_buffers.h: no step allocates); engine_gather.cc the gathers and the
// window (gather_window.h; ReleaseParams frees a gathered unit);
// engine_reduce.cc the reductions; engine_step.cc the norm and the update;
// engine_state.cc the state in and out; engine_integrity.cc the checksum;
// engine_outer.cc DiLoCo's outer step, engine_outer_stream.cc its streaming
// fragments.
#ifndef ZEROSHARD_WORKER_ZERO_ENGINE_H_
#define ZEROSHARD_WORKER_ZERO_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/plan/shard_plan.h"
#include "common/plan/stage_traits.h"
#include "worker/comm/communicator.h"
#include "worker/model/model.h"
#include "worker/zero/backend.h"
#include "worker/zero/engine_options.h"
#include "worker/zero/gather_window.h"
#include "worker/zero/memory_tracker.h"
#include "worker/zero/optimizer.h"
#include "worker/zero/step_buffers.h"
#include "worker/zero/step_numerics.h"
#include "worker/zero/task_thread.h"
#include "worker/zero/unit_layout.h"

namespace zeroshard {

struct Int8Rounding;  // worker/comm/quantized.h
class ShardHasher;    // common/shard_hash.h

// Where a step's wall time went on the compute thread (milliseconds).
// Communication that overlaps compute does not show; what shows in the
// wait_* fields is communication the schedule failed to hide.
struct StepTimes {
  double forward_ms = 0;      // model forward (all micro-batches)
  double backward_ms = 0;     // model backward
  double gather_wait_ms = 0;  // waiting for a unit's all-gather
  // Waiting for gradient reductions: at the step, and in the backward for a
  // flat-gradient buffer the reductions still hold (step_buffers.h).
  double reduce_wait_ms = 0;
  double optimizer_ms = 0;     // clip + optimizer on this rank's state
  double param_sync_ms = 0;    // stages 1-2: all-gather of the updated parameters
  double replica_hash_ms = 0;  // HashShardAtNextUpdate's hashing (in optimizer_ms)
};

struct StepStats {
  double loss = 0;       // mean over this rank's micro-batches
  double grad_norm = 0;  // global, before clipping
  // The step's mean loss over ranks, its norm again, and whether both are
  // finite, the same on every rank. A step that is not finite updated
  // nothing (verdict.finite() false): the caller decides whether to go on.
  StepVerdict verdict;
  StepTimes times;
};

// One DiLoCo outer step (ZeroEngine::OuterStep).
struct OuterStats {
  int64_t outer_step = 0;  // outer steps taken so far, this one included
  // Bytes this rank sent over the replicas' communicator for it (the outer
  // all-reduce: f32, bf16, int8 or int4 payload and the ring's or all-gather's
  // repeats).
  int64_t bytes_sent = 0;
  double ms = 0;  // wall time of the outer step on this rank
  // Squared L2 norm of this rank's part of the averaged outer gradient
  // (its shard, padding zero): every replica holds the same; summed over a
  // group's ranks it is the outer gradient's.
  double shard_squares = 0;
  // bf16 / int8 / int4 outer dtype: squared L2 norm of this rank's kept residual
  // (what its wire copy lost, added to the next outer gradient); 0 in f32.
  double residual_squares = 0;
  // Streaming (FinishOuterFragment): the fragment synced (-1: every unit,
  // OuterStep), the tag its BeginOuterFragment was given (the worker's
  // step), whether its all-reduce ran on the replica thread (not the
  // compute thread), that all-reduce's wall time there, and how long the
  // compute thread waited for it at the finish (0 when it had ended).
  int fragment = -1;
  int64_t began_tag = -1;
  bool on_replica_thread = false;
  double all_reduce_ms = 0;
  double wait_ms = 0;
  // Elastic outer steps (OuterStepAmong): this group was stale (it missed
  // outer steps) and was caught up from an up-to-date group before this
  // one; the present groups that were stale.
  bool caught_up = false;
  int stale_groups = 0;
};

class ZeroEngine {
 public:
  // `gather` and `reduce` are distinct communicators over the same ranks:
  // all W, or this rank's shard group when the plan has groups. `aux` is
  // over all W ranks (small collectives of the compute thread; its rank is
  // this rank's). Not owned.
  static absl::StatusOr<std::unique_ptr<ZeroEngine>> Create(Model* model, const ShardPlan& plan,
                                                            Communicator* gather,
                                                            Communicator* reduce, Communicator* aux,
                                                            const EngineOptions& options);
  ~ZeroEngine();

  // Fills every parameter this rank holds. `fill(tensor, row_begin, row_end,
  // out)` writes f32 values of those rows; it is asked only for the rows this
  // rank needs (its own pieces at stage 3, every row at stages 0-2).
  using RowSource = std::function<absl::Status(const TensorSpec& tensor, int64_t row_begin,
                                               int64_t row_end, float* out)>;
  absl::Status Initialize(const RowSource& fill);
  // Fills the optimizer's moments the same way (from a checkpoint), asking
  // for the rows this rank keeps moments of. FAILED_PRECONDITION if the
  // optimizer has no such state.
  enum class Moment { kExpAvg, kExpAvgSq };
  absl::Status InitializeMoment(Moment moment, const RowSource& fill);

  // One micro-batch: forward and backward of the batch already set on the
  // model. `last_micro` marks the last pass of the step (stages 0-1 reduce
  // then). Returns the local loss.
  absl::StatusOr<double> ForwardBackward(bool last_micro);
  // A pass that carries no data (EngineOptions::global_micro_batches > 0,
  // for a rank with fewer micro-batches than the step's passes, after its
  // last ForwardBackward): the pass's collectives (stage 3's gathers,
  // stages 2-3's reduce-scatters of a zero gradient, the last pass's
  // reductions), no model computation; it adds nothing to the gradient and
  // does not count in the loss.
  absl::Status PadMicroBatch(bool last_micro);

  // Forward only (evaluation, generation): no gradients, no reductions.
  // Returns the loss of the batch set on the model.
  absl::StatusOr<double> Forward();

  // Stage 3, for many forwards in a row (generation): gathers every unit once
  // and keeps the full parameters until ReleaseHeldParameters, so each
  // Forward() reads them instead of gathering again (the job's collectives:
  // every rank calls both, in the same order). Holds the whole model's
  // parameters meanwhile (Ψ f32). A no-op at stages 0-2, whose parameters are
  // replicated already.
  absl::Status HoldGatheredParameters();
  void ReleaseHeldParameters();

  // The optimizer step after grad_accum passes: waits for the reductions,
  // averages over micro-batches (or divides the sum by
  // EngineOptions::global_micro_batches), agrees with every rank on the
  // step's loss and norm (one small all-gather), and, when both are finite,
  // clips and steps the shard. A non-finite step leaves the parameters and
  // the optimizer's state as they were (StepStats::verdict says why).
  absl::StatusOr<StepStats> Step(double lr);

  // DiLoCo (EngineOptions::replica_sync kDiLoCo; engine_outer.cc): after a
  // Step, with every rank of every group calling it in the same order. This
  // rank's f32 master shard gives the outer gradient anchor - master (plus
  // the quantization residual kept from the last outer step with a bf16,
  // int8 or int4 outer dtype), averaged over the replicas; the outer Nesterov SGD
  // steps the anchor with it; master = anchor, and the copies derived from
  // it (gathered units, stages 1-2's replicated parameters, bf16 copies)
  // are refreshed, so every group holds the same parameters afterwards.
  // The inner optimizer's state is kept (DiLoCo's). FAILED_PRECONDITION
  // without DiLoCo or between a step's micro-batches.
  // FAILED_PRECONDITION while a streaming fragment is pending.
  absl::StatusOr<OuterStats> OuterStep();
  // Elastic DiLoCo (--outer_timeout; engine_outer_elastic.cc): OuterStep over
  // the groups `present` connects (one rank per present group holding this
  // rank's shard; null or one rank: this group alone, no collective), called
  // by every rank of those groups and no other. Groups that took fewer outer
  // steps than the most of them (left out of earlier ones) are caught up
  // first: the lowest up-to-date group's anchor, outer momentum and counts
  // are broadcast to them, they add zero to the mean and the mean is over
  // the up-to-date groups; every present group then holds the same anchor
  // and parameters (the stale groups' inner progress is dropped).
  // OuterStep() is OuterStepAmong(the replicas' communicator).
  absl::StatusOr<OuterStats> OuterStepAmong(Communicator* present);
  int64_t outer_steps() const { return outer_steps_; }
  bool diloco() const { return options_.replica_sync == ReplicaSync::kDiLoCo; }
  // DiLoCo's outer state from a checkpoint (engine_state.cc), after
  // Initialize (which made the loaded parameters the anchor and zeroed the
  // momentum): the anchor from `anchor` and, when `momentum` is not null,
  // the outer momentum buffer, for the rows this rank keeps outer state of
  // (its member's shard); `outer_steps` outer steps taken so far. Without
  // `momentum` the momentum starts again at zero (its first outer step
  // fills it, as from a fresh start). The residual of a bf16 / int8 / int4 outer
  // dtype starts at zero (docs/diloco.md). FAILED_PRECONDITION without
  // DiLoCo, or for `momentum` with --outer_momentum=0 (no buffer).
  absl::Status InitializeOuterState(const RowSource& anchor, const RowSource* momentum,
                                    int64_t outer_steps);

  // Streaming DiLoCo (OuterOptions::fragments, delay, mix;
  // engine_outer_stream.cc). The fragments: contiguous runs of units, each
  // cut placed where the running parameter count (UnitLayout::flat_elements)
  // comes nearest to k / F of the model's, every fragment one unit or more.
  // Planned only when fragments > 1 or delay > 0 (0 fragments otherwise).
  int outer_fragments() const { return static_cast<int>(fragment_begin_.size()) - 1; }
  // Fragment p's units: [first, second).
  std::pair<int, int> OuterFragmentUnits(int fragment) const {
    return {fragment_begin_[fragment], fragment_begin_[fragment + 1]};
  }
  // After a Step, on every rank in the same order: this rank's outer
  // gradient of the fragment's units (anchor - master, plus the residual;
  // bf16 / int8 / int4 wire copies made here) into the buffers planned at Create,
  // then its all-reduce over the replicas queued on the replica thread; the
  // call returns without waiting for it, so the compute thread goes on with
  // the next steps. `tag` comes back in the stats. One fragment pending at
  // a time: FAILED_PRECONDITION while one is.
  absl::Status BeginOuterFragment(int fragment, int64_t tag);
  // Waits for the pending fragment's all-reduce, steps its anchor with the
  // outer SGD and sets its parameters to anchor + mix (master - anchor), as
  // OuterStep refreshes what derives from them. The anchor stays the outer
  // result: the next outer gradient is measured from it.
  absl::StatusOr<OuterStats> FinishOuterFragment();
  // The pending fragment, or -1; its tag.
  int pending_outer_fragment() const { return pending_.fragment; }
  int64_t pending_outer_tag() const { return pending_.tag; }

  // The sum of `value` over the ranks the step numerics are agreed over
  // (EngineOptions::numerics: the shard group's under --outer_timeout,
  // else all W), in rank order.
  absl::StatusOr<double> SumOverStepRanks(double value, const char* what);
  // Sum of every element of the full model (over ranks, in double).
  absl::StatusOr<double> ParamsSum();
  // Mean of `value` over ranks; every rank's value, by rank.
  // `what` names the value in errors ("the loss").
  absl::StatusOr<double> MeanOverRanks(double value, const char* what = "a metric");
  absl::StatusOr<std::vector<double>> GatherOverRanks(double value, const char* what = "a metric");

  // Visits this rank's pieces with their fp32 master values (and Adam
  // moments, when the optimizer has them): for checkpoints. The pointers are
  // host memory (copies, on a device backend) valid during the visit; a
  // visitor that writes through them changes the model on the CPU only.
  struct PieceView {
    const TensorSpec* tensor;
    int64_t row_begin, row_end;
    float* params;
    float* exp_avg;     // null without moments
    float* exp_avg_sq;  // null without moments
    // DiLoCo: the piece's outer anchor and outer momentum buffer (null
    // without DiLoCo; the momentum also with --outer_momentum=0). The
    // residual of a bf16 / int8 / int4 outer dtype is not visited: each rank's
    // differs (docs/diloco.md).
    float* outer_anchor;
    float* outer_momentum;
    int64_t elements;
  };
  // `with_replica_peer`: also the next replica's run (UnitLayout::replica_peer_saved),
  // after this rank's own pieces.
  absl::Status ForEachOwnPiece(const std::function<absl::Status(const PieceView&)>& visit,
                               bool with_replica_peer = false);
  // The rank whose run ForEachOwnPiece(.., true) adds; -1 without replicas
  // (no shard groups).
  int replica_peer() const;
  int64_t optimizer_step() const;
  void set_optimizer_step(int64_t step);

  // Integrity (engine_integrity.cc). XXH3 of this rank's master shard, every
  // unit's chunk in unit order, padding included: bitwise the same on every
  // replica of a member's shard (HSDP), whose optimizer steps see the same
  // bits. FAILED_PRECONDITION at stage 0 (no shard).
  absl::StatusOr<uint64_t> MasterShardChecksum();
  // This rank's master shard as MasterShardChecksum reads it (every unit's
  // chunk in unit order, padding included), copied to host memory: what a
  // rewind compares its re-run against. Stages 1-3.
  absl::StatusOr<std::vector<float>> CopyMasterShard();
  // --replica_check_every: the next Step hashes the master shard (as
  // MasterShardChecksum) unit by unit right after each unit's update, and the
  // Step after it sends the hash on its verdict's all-gather, whose verdict
  // then compares the replicas (StepVerdict::replica_mismatches; a mismatch
  // is not applied). No collective of its own. Stages 1-3.
  void HashShardAtNextUpdate() { hash_next_update_ = true; }
  // Called by every Step with its verdict after the ranks' numbers are
  // shared and before any update: it may mark the step bad (a loss spike,
  // worker/loss_spike.h), which then is not applied. Every rank's screen
  // must judge alike. Null: none.
  void SetVerdictScreen(std::function<void(StepVerdict*)> screen) {
    verdict_screen_ = std::move(screen);
  }
  // Test-only (--testing_corrupt): flips bit `bit` (an exponent bit, 23-30;
  // 23: the value doubles or halves and stays finite) of the first parameter
  // of this rank's first piece in its master shard, as a flipped bit in
  // memory would.
  absl::Status CorruptMasterForTesting(int bit = 23);
  // G: the ranks one shard is spread over (W without shard groups).
  int group_size() const { return group_size_; }

  // The collectives in flight right now, e.g. "all_gather of unit '3'", for
  // messages when a job is aborted from outside. Thread-safe.
  std::string InFlight() const;
  // What the collective threads are doing, for heartbeat telemetry: how many
  // collectives each stream entered (every rank issues a stream's
  // collectives in the same order, so equal numbers name the same
  // collective) and the one in flight longest. Thread-safe.
  struct CollectiveActivity {
    const char* op = nullptr;  // "all_gather", "reduce_scatter", "all_reduce"; null: none
    std::string unit;
    int64_t seq = 0;  // its number on its stream
    absl::Time started;
  };
  struct CollectiveProgress {
    int64_t gathers_entered = 0;
    int64_t reductions_entered = 0;
    CollectiveActivity oldest;  // op null: none in flight
  };
  CollectiveProgress Collectives() const;
  // When the first collective entered since the previous call began
  // (InfinitePast: none was), and starts watching for the next one: a step
  // calls it first and last to learn when it reached its first collective.
  absl::Time TakeFirstCollectiveStart();
  // Collectives completed so far (all threads): the sequence number members
  // report in heartbeats, so a stuck rank stands out in `shardctl status`.
  int64_t collective_seq() const { return collective_seq_.load(); }
  // Reductions' received chunks waiting for, or in, the replicas' all-reduce
  // count as comm buffers meanwhile (at most every unit's chunk, Ψ/G f32).

  const MemoryTracker& memory() const { return memory_; }
  const std::vector<UnitLayout>& units() const { return units_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  // Largest unit, in flat elements.
  int64_t largest_unit_elements() const;

 private:
  struct UnitState;
  struct SharedLease;
  // Stage 3 (and bf16 compute copies): a pass position's unit, flat f32,
  // in `params` or, with a shared gather, in `shared`'s region.
  struct GatherSlot {
    int64_t ticket = 0;  // gather task; 0: none (handed over, or converted in place)
    TrackedBuffer params;
    std::shared_ptr<SharedLease> shared;
  };
  ZeroEngine() = default;

  // For engine_integrity.cc (UnitState is engine_internal.h's): a unit's master
  // shard, and hpZ's slice of it marked stale.
  TrackedBuffer& MasterShard(int unit);
  absl::Status HashMasterShard(int unit, ShardHasher* hasher);
  void MarkSecondaryStale(int unit);
  absl::Status BuildLayouts(const ShardPlan& plan);
  // Create's steps after the layouts: the pass's positions, each unit's
  // buffers and optimizer, the shared gather regions, the engine threads.
  absl::Status BuildSchedule();
  absl::Status AllocateUnitStates();
  // DiLoCo (engine_outer.cc): the anchor, outer momentum and residual of
  // every unit's shard and the outer step's scratch, allocated at Create;
  // the anchor set from the master shard (Initialize); one unit's outer
  // step; its outer gradient averaged over the replicas in the outer dtype;
  // this rank's master shard (f32) copied into `out`.
  absl::Status AllocateOuterState();
  absl::Status ResetOuterState();
  absl::Status CheckOuterStepAllowed() const;
  // OuterStep (elastic false: every group present, none stale, nothing
  // agreed first) and OuterStepAmong (elastic true).
  absl::StatusOr<OuterStats> RunOuterStep(Communicator* present, bool elastic);
  // Elastic outer steps (engine_outer_elastic.cc): the present groups'
  // counts, the catch-up of the stale ones, and a stale rank's zero
  // contribution.
  struct OuterProgress {
    int stale_groups = 0;  // present groups behind the newest
    int root = -1;         // `present` rank of the lowest up-to-date group
    bool stale = false;    // this rank's group is behind
    int64_t outer_steps = 0;
    int64_t optimizer_step = 0;  // the root's outer SGD step count
  };
  absl::StatusOr<OuterProgress> AgreeOuterProgress(Communicator* present);
  absl::Status CatchUpOuterState(Communicator* present, const OuterProgress& progress);
  absl::Status ZeroStaleOuterGradient(int unit, float* delta, void* wire);
  void MasterShardInto(int unit, float* out);
  // OuterStepUnit's parts, shared with streaming (`wire`: the unit's bf16
  // copy): the outer gradient and its wire copy (and residual); the
  // replicas' all-reduce of it; its outer SGD step and the parameters set
  // to anchor + mix (master - anchor) with what derives from them.
  // `comm`: the groups averaged over (null: this group alone).
  absl::Status OuterGradientInto(Communicator* comm, int unit, float* delta, void* wire);
  absl::Status AllReduceOuterGradient(Communicator* comm, int unit, float* delta, void* wire);
  absl::Status ApplyOuterGradient(int unit, float* delta, double mix, OuterStats* stats);
  // Streaming (engine_outer_stream.cc): the fragments and their buffers,
  // planned at Create; a pending fragment waited for and dropped (a
  // rewind's or a resume's Initialize).
  absl::Status PlanOuterFragments();
  absl::Status DropPendingFragment();
  // Gathers a Step issued early read the master about to be replaced: they
  // finish, and their units are gathered again by the next pass.
  absl::Status DropEarlyGathers();
  // Streaming DiLoCo: fragments planned, their all-reduces on the replica
  // thread.
  bool streaming_outer() const {
    return options_.replica_sync == ReplicaSync::kDiLoCo &&
           (options_.outer.fragments > 1 || options_.outer.delay > 0);
  }
  // Whether each step's gradient is averaged over the replicas (HSDP's
  // every-step sync): shard groups, and not DiLoCo.
  bool per_step_replicas() const {
    return replica_comm_ != nullptr && options_.replica_sync == ReplicaSync::kEveryStep;
  }
  absl::Status SetUpSharedGather();
  // Resolves packed_ and builds each unit's packed layout (Create).
  absl::Status SetUpPackedCollectives();
  // Fills backward_into_shard_ (Create, after SetUpPackedCollectives).
  void SetUpBackwardIntoShard();
  // Every buffer of the step path, sized and counted (step_buffers.h).
  void PlanStepBuffers();
  int MostUnitsOpenInBackward() const;
  void StartThreads();
  // From `pool`, whose buffers `giver`'s tasks give back: waits while they
  // are all lent, failing with `giver`'s first error or after the time two
  // collectives may take.
  absl::StatusOr<TrackedBuffer> LendWaiting(BufferPool& pool, MemoryCategory category,
                                            int64_t bytes, bool zero, TaskThread* giver);
  // The walk's parts: the unit's tensors over a flat buffer; backward
  // position n + j (op n - 1 - j) of a training pass.
  UnitTensors UnitViews(int unit, float* flat) const;
  // The unit's tensors at `offsets` from `base` (backward_into_shard_).
  UnitTensors UnitViewsAt(int unit, float* base, const std::vector<int64_t>& offsets) const;
  // `pad`: PadMicroBatch's (no model computation, a zero gradient).
  absl::Status Pass(bool last_micro, bool pad);
  absl::Status BackwardPosition(int j, bool last_micro, bool pad);
  // The reductions' op: average over ranks, or sum (global_micro_batches).
  ReduceOp GradientReduceOp() const;
  // Step's parts: the unit's gradient the optimizer reads (pointer and
  // elements); the squared norm of the micro-batch-averaged gradient this
  // rank holds (stale gradients cleared first); every rank's loss and
  // squares, gathered and judged (step_numerics.h); a non-finite step's
  // dropped update; the optimizer update of one unit and its parameter sync
  // (stages 1-2) or early gathers (stage 3).
  std::pair<float*, int64_t> StepGradient(int unit);
  absl::StatusOr<double> LocalGradientSquares();
  absl::StatusOr<StepVerdict> ShareStepNumerics(double grad_squares);
  void DropUpdate();
  absl::Status UpdateUnit(int unit, double lr, double* param_sync_ms);
  // fill(tensor, rows) into `target` (backend memory), through a host
  // staging buffer when the backend's memory is not host memory.
  absl::Status FillRows(const RowSource& fill, const TensorSpec& tensor, int64_t row_begin,
                        int64_t row_end, float* target);
  // Stage 3: position k of the pass (forward ops, then backward ops).
  absl::Status IssueGather(int position);
  // Prefetches no further than `last_position`.
  absl::StatusOr<float*> AcquireParams(int position, int last_position);
  // Frees position's gathered unit, or hands it to the position that uses
  // the same unit next when that needs no more than 1 + prefetch units
  // resident: the next position (same unit twice in a row) or, at the turn
  // from forward to backward, the backward position of the last `prefetch`
  // forward units (kept instead of gathered again, as DeepSpeed's reuse
  // distance does). `backward_follows` is false in evaluation passes.
  void ReleaseParams(int position, bool backward_follows = true);
  // `keep_secondary`: also keep this rank's hpZ slice of the gathered unit.
  absl::Status GatherUnit(int unit, TrackedBuffer* out, bool keep_secondary = false);
  // GatherUnit's packed path over a gather group of one.
  absl::Status GatherUnitAlone(int unit, TrackedBuffer* out, bool keep_secondary);
  absl::Status GatherUnitShared(int unit, SharedLease* lease, bool keep_secondary);
  // hpZ: copies this rank's secondary slice out of the full unit `flat`.
  void KeepSecondarySlice(int unit, const float* flat);
  // hpZ: the full unit from the secondary group's slices.
  absl::Status GatherUnitFromSecondary(int unit, TrackedBuffer* out);
  void BuildSecondaryLayouts();
  // Stages 2-3 reduce `grads_flat` (then free it); stages 0-1 the unit's
  // accumulated full gradient.
  // `computed`: the compute thread's work on the gradient, waited for first.
  // `last_micro`: the step's last reduction of this unit (stages 2-3 then
  // also take the squared norm of its gradient shard, off the compute thread).
  absl::Status ReduceUnit(int unit, TrackedBuffer* grads_flat, Fence* computed, bool last_micro);
  // ReduceUnit's parts: the reduce-scatter's output chunk (waiting for one
  // the replica thread gives back, with a replica thread); after the group's
  // reduce-scatter, the replicas' average (on the replica thread when there
  // is one) and FinishReduction.
  absl::StatusOr<TrackedBuffer> LendReceived(int unit, DType held);
  absl::Status ReduceScatterUnit(int unit, const void* input, void* output, DType dtype,
                                 bool packed, Int8Rounding rounding);
  // The flat gradient as the reduce-scatter takes it, from reduce_wire:
  // packed into G chunks (EngineOptions::packed_collectives), or narrowed to
  // `held`; empty when it goes as it is (f32, not packed).
  absl::StatusOr<TrackedBuffer> GradientOnTheWire(int unit, const float* grads_flat, DType held,
                                                  bool packed);
  absl::Status AverageAndFinish(int unit, TrackedBuffer received, bool direct, bool last_micro,
                                Int8Rounding replica_rounding);
  absl::Status AllReduceUnit(int unit);
  absl::Status AverageOverReplicas(int unit, void* chunk, DType dtype, Int8Rounding rounding);
  Int8Rounding QuantizedReduceRounding(int unit);
  // ReduceUnit's end, after the group's reduce-scatter (and the replicas'
  // average): this rank's pieces into the gradient shard (`direct`: already
  // there; `stale`: written, not added), then the shard's squared norm.
  absl::Status FinishReduction(int unit, TrackedBuffer* received, bool direct, bool stale,
                               bool last_micro);
  absl::Status AllGatherReplicated(int unit, const float* master_shard);
  // Stages 1-2 with packed collectives: UpdateUnit's optimizer step and
  // parameter sync through one packed buffer (engine_gather.cc).
  absl::Status UpdateReplicatedPacked(int unit, const float* grads, int64_t n, double lr,
                                      double* param_sync_ms);
  void PackOwn(const UnitLayout& u, const float* flat, float* chunk) const;
  // The elements a gather of `unit` from the secondary shards (hpZ) writes:
  // the flat unit, or with packed collectives every member's whole slice
  // (secondary group size x secondary_elements, up to h - 1 more).
  int64_t SecondaryGatherElements(int unit) const;
  std::string Where(int unit) const;
  enum Stream { kGatherStream = 0, kReduceStream = 1, kReplicaStream = 2 };
  void EnterCollective(Stream stream, const char* op, const std::string& unit);
  void LeaveCollective(Stream stream);

  // First: every TrackedBuffer below returns its memory here when destroyed.
  MemoryTracker memory_;
  // Second: the step path's buffers (planned at Create), lent to members
  // below; destroyed after them.
  StepBuffers buffers_;
  Model* model_ = nullptr;
  Backend* backend_ = nullptr;
  Communicator* gather_comm_ = nullptr;
  Communicator* reduce_comm_ = nullptr;
  Communicator* aux_comm_ = nullptr;
  // Stage 3: gathers into host-shared regions (see EngineOptions); null:
  // into slots' own buffers. Owned by gather_comm_. The regions count as
  // comm buffers, the part holding gathered units as params_gathered.
  SharedGather* shared_gather_ = nullptr;
  int64_t shared_gather_bytes_ = 0;
  // EngineOptions::packed_collectives as resolved at Create: stage 3's
  // gathers, stages 1-2's parameter sync and stages 1-3's reduce-scatters go
  // through UnitLayout::packed.
  bool packed_ = false;
  // Stages 2-3, packed, over a group of one without replicas, reducing in
  // f32 (a reduce-scatter over one rank is a copy): per unit, each tensor's
  // offset inside the unit's gradient shard, where every tensor lies in one
  // piece of it. The backward then writes (first micro-batch) or adds into
  // the shard itself and the reduction moves nothing. Empty for a unit that
  // does not qualify.
  std::vector<std::vector<int64_t>> backward_into_shard_;
  EngineOptions options_;
  StageTraits stage_;                       // from options_.stage
  int rank_ = 0;                            // in the job (aux)
  int world_ = 1;                           // W
  int group_size_ = 1;                      // G: ranks one shard is spread over (W without groups)
  Communicator* replica_comm_ = nullptr;    // EngineOptions::replicas
  Communicator* secondary_comm_ = nullptr;  // EngineOptions::secondary (hpZ)
  Communicator* numerics_comm_ = nullptr;   // EngineOptions::numerics, else aux
  std::vector<UnitLayout> units_;
  std::vector<std::unique_ptr<UnitState>> state_;
  std::vector<int> ops_;             // unit of each forward op
  GatherWindow window_;              // unit of each pass position (forward then backward)
  std::vector<int> first_backward_;  // per unit: the pass position of its first backward op
  std::vector<int> last_backward_;   // per unit: the pass position of its last backward op
  // Owned by the compute thread; a gather task writes only into the bytes of
  // its slot's buffer, which the compute thread reads after Wait(ticket).
  std::map<int, GatherSlot> slots_;
  std::vector<TrackedBuffer> held_;  // by unit: HoldGatheredParameters
  std::unique_ptr<TaskThread> gather_thread_;
  std::unique_ptr<TaskThread> reduce_thread_;
  std::unique_ptr<TaskThread> replica_thread_;  // shard groups only
  std::atomic<int64_t> collective_seq_{0};
  mutable absl::Mutex activity_mu_;
  CollectiveActivity activity_[3] ABSL_GUARDED_BY(activity_mu_);  // by Stream
  int64_t entered_[3] ABSL_GUARDED_BY(activity_mu_) = {0, 0, 0};
  absl::Time first_collective_start_ ABSL_GUARDED_BY(activity_mu_) = absl::InfinitePast();
  double loss_sum_ = 0;
  int micro_batches_ = 0;  // of the step so far, with data (the loss's)
  int passes_ = 0;         // of the step so far, padding included
  // Phase order: set by the step's last micro-batch, cleared by Step; a
  // ForwardBackward in between would reduce twice into the step.
  bool step_pending_ = false;
  bool hash_next_update_ = false;                     // HashShardAtNextUpdate
  std::optional<uint64_t> shard_checksum_;            // for the next verdict
  std::function<void(StepVerdict*)> verdict_screen_;  // SetVerdictScreen
  std::vector<RankNumerics> all_numerics_;            // ShareStepNumerics' all-gather, one per rank
  // Device backends: a master chunk copied to the host for the replicas' hash.
  std::vector<char> hash_staging_;
  StepTimes times_;  // of the step in progress
  // DiLoCo: outer steps taken; the outer gradient of one unit (the largest
  // chunk, f32) and its bf16 wire copy; int8's or int4's packed copy (host).
  int64_t outer_steps_ = 0;
  TrackedBuffer outer_delta_;
  TrackedBuffer outer_wire_;
  std::vector<char> outer_packed_;
  // Streaming: fragment p is units [fragment_begin_[p], fragment_begin_[p + 1]);
  // each unit's chunk at fragment_offset_[unit] in the fragment's outer
  // gradient (f32) and bf16 wire, sized for the largest fragment.
  std::vector<int> fragment_begin_;
  std::vector<int64_t> fragment_offset_;
  TrackedBuffer fragment_delta_;
  TrackedBuffer fragment_wire_;
  // The fragment whose all-reduce the replica thread runs (the compute
  // thread's): its ticket there, and the begin's time on the compute thread.
  struct PendingFragment {
    int fragment = -1;
    int64_t tag = -1;
    int64_t ticket = 0;
    double begin_ms = 0;
  };
  PendingFragment pending_;
  // Written by the pending fragment's task on the replica thread, read by
  // the compute thread only after Wait(ticket) (TaskThread's mutex orders
  // them).
  struct FragmentAllReduce {
    int64_t bytes_sent = 0;
    bool on_replica_thread = false;
    double ms = 0;
  };
  FragmentAllReduce fragment_done_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_ZERO_ENGINE_H_
