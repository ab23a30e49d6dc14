#include "worker/worker.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/checkpoint_format.h"
#include "common/fault_messages.h"
#include "common/local_address.h"
#include "common/status_context.h"
#include "worker/checkpointer.h"
#include "worker/comm/client_kv_store.h"
#include "worker/comm/two_level_communicator.h"
#include "worker/model/parallel.h"
#include "worker/outer_sync_config.h"
#include "worker/replica_check.h"

#ifdef ZEROSHARD_HAVE_CUDA
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_gpt.h"
#include "worker/cuda/cuda_mlp.h"
#endif

namespace zeroshard {
namespace {

// What each communicator of a data plane has sent (zero for one it lacks).
struct PlaneBytes {
  CollectiveBytes gather, reduce, replicas, secondary;
  static PlaneBytes Of(const DataPlane& plane) {
    PlaneBytes b;
    b.gather = plane.gather->bytes_sent();
    b.reduce = plane.reduce->bytes_sent();
    if (plane.replicas != nullptr) b.replicas = plane.replicas->bytes_sent();
    if (plane.secondary != nullptr) b.secondary = plane.secondary->bytes_sent();
    return b;
  }
};

}  // namespace

Worker::Worker(WorkerConfig config, AbortLatch* abort)
    : config_(std::move(config)),
      abort_(abort),
      task_options_(config_.task),
      engine_options_(config_.engine) {
  if (config_.test_stall_before_gather > 0) {
    engine_options_.before_collective =
        StallBeforeGather(config_.test_stall_before_gather, [abort] { return abort->tripped(); });
  }
}

Worker::~Worker() {
  EndGeneration();
  // The heartbeat thread calls back into this object: stop it while the
  // object is whole.
  if (client_ != nullptr) client_->StopHeartbeats();
}

// ---- Before joining ----

// --backend=nccl: the engine's buffers on this process's GPU (CudaBackend),
// gathers and reductions over NCCL, the model's kernels on the GPU. The
// schedule is the same ZeroEngine code as with gloo.
absl::Status Worker::OpenDevice() {
  if (config_.data_plane.backend != DataPlaneBackend::kNccl) return absl::OkStatus();
#ifdef ZEROSHARD_HAVE_CUDA
  absl::StatusOr<std::unique_ptr<CudaBackend>> created =
      CudaBackend::Create(config_.data_plane.cuda_device);
  if (!created.ok()) {
    return absl::Status(created.status().code(),
                        absl::StrCat("--backend=nccl: ", created.status().message()));
  }
  CudaBackend* device = created->get();
  device_ = *std::move(created);
  engine_options_.backend = device;
  task_options_.mlp_factory =
      [device](const MlpConfig& config) -> absl::StatusOr<std::unique_ptr<RegressionModel>> {
    absl::StatusOr<std::unique_ptr<CudaMlpModel>> model = CudaMlpModel::Create(config, device);
    if (!model.ok()) return model.status();
    return std::unique_ptr<RegressionModel>(*std::move(model));
  };
  // The GPT's matrix products in the dtype parameters are gathered in.
  CudaGptOptions gpt_options;
  gpt_options.matmul_dtype = engine_options_.param_dtype;
  gpt_options.tf32 = config_.data_plane.tf32;
  // Batches are --context long (training, validation, --sample's windows),
  // which may be shorter than the model's --positions.
  gpt_options.max_t = task_options_.context;
  absl::StatusOr<CudaGptOptions::Attention> attention =
      ParseAttention(config_.data_plane.gpu_attention);
  if (!attention.ok()) return attention.status();
  gpt_options.attention = *attention;
  task_options_.gpt_factory = [device, gpt_options](
                                  const GptConfig& config,
                                  int max_batch) -> absl::StatusOr<std::unique_ptr<TokenModel>> {
    absl::StatusOr<std::unique_ptr<CudaGptModel>> model =
        CudaGptModel::Create(config, max_batch, gpt_options, device);
    if (!model.ok()) return model.status();
    return std::unique_ptr<TokenModel>(*std::move(model));
  };
  return absl::OkStatus();
#else
  // WorkerConfigFromFlags refuses --backend=nccl in such a build.
  return absl::FailedPreconditionError("--backend=nccl: built without CUDA");
#endif
}

absl::Status Worker::LoadTask() {
  SetComputeThreads(config_.blas_threads);
  absl::StatusOr<std::unique_ptr<TrainingTask>> task = MakeTrainingTask(task_options_);
  if (!task.ok()) return Annotate(task.status(), "model");
  task_ = *std::move(task);
  ledger_.SetFlops(task_->FlopsPerItem(), PeakFlops());
  return absl::OkStatus();
}

// ---- One job generation ----

absl::Status Worker::Join() {
  EndGeneration();  // a generation left over from a failed run
  if (metrics_.first_join_unix_ms == 0) {
    metrics_.first_join_unix_ms = absl::ToUnixMillis(absl::Now());
  }
  if (client_ == nullptr) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(config_.client);
    if (!client.ok()) return Annotate(client.status(), "connect");
    client_ = *std::move(client);
    absl::BitGen gen;
    // The server grows a shrunk job back to whole shard groups only: part
    // of a group leaves no plan. (A G that does not divide W is the plan's
    // error to name.)
    const int g = config_.shard_group_by_host ? 0 : config_.plan.shard_group_size;
    const int multiple = g > 1 && config_.world_size % g == 0 ? g : 0;
    client_->set_join_extras({config_.recovery.min_world_size, config_.recovery.rejoin_grace,
                              absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen)),
                              HostIdentity(), multiple});
  }
  client_->set_steps_completed(ledger_.steps_completed());
  absl::StatusOr<JoinInfo> joined = client_->Join(
      config_.job, config_.world_size, config_.worker_id, config_.host,
      timeline_.recovering() ? std::max(config_.recovery.rejoin_timeout,
                                        config_.recovery.rejoin_grace + absl::Seconds(30))
                             : config_.join_timeout);
  if (!joined.ok()) {
    return Annotate(joined.status(), timeline_.recovering() ? "recovery: re-join" : "join");
  }
  const absl::Time answered = absl::Now();
  timeline_.Joined(answered);
  generation_ = std::make_unique<Generation>();
  generation_->membership = *std::move(joined);
  rank_ = generation_->membership.rank;
  // A generation of a job that already trained (a re-join, a replacement)
  // sets up to restore; the first of a fresh job starts up.
  const int64_t steps_done = generation_->membership.steps_done;
  ledger_.StartGeneration(answered, recoveries_ > 0 || steps_done > 0, steps_done, world());
  SayPeakOnce();
  std::vector<std::string> hosts;
  for (const v1::Member& m : generation_->membership.members) hosts.push_back(m.host());
  buddy_shift_ = hosts.size() == static_cast<size_t>(world()) ? BuddyShift(hosts) : 1;
  // The generation's first ranks carry the ledger (proto/goodput.proto).
  constexpr int kLedgerRanks = 8;
  const bool send_time = rank_ < kLedgerRanks;
  client_->SetTelemetrySource([this, send_time](v1::RankTelemetry* telemetry) {
    if (send_time) *telemetry->mutable_time() = ledger_.Generation();
    absl::MutexLock lock(&abort_mu_);
    if (abortable_engine_ != nullptr) {
      FillLiveTelemetry(*abortable_engine_, abortable_data_plane_, telemetry);
    }
    if (checkpointer_ != nullptr) telemetry->set_commits_pending(checkpointer_->pending_commits());
  });
  arrival_lag_.Clear();
  client_->StartHeartbeats(
      [this](absl::StatusOr<v1::HeartbeatResponse> reply) { OnServerCommand(reply); });
  return absl::OkStatus();
}

absl::Status Worker::Plan() {
  assert(client_ != nullptr && generation_ != nullptr && "Plan before Join");
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  PlanOptions options = config_.plan;
  absl::StatusOr<int> group = ShardGroupSize();
  if (!group.ok()) return group.status();
  options.shard_group_size = *group;
  absl::StatusOr<ShardPlan> planned = client_->PlanShards(task_->model()->Spec(), options, world());
  if (!planned.ok()) return Annotate(planned.status(), "plan");
  generation_->plan = *std::move(planned);
  return absl::OkStatus();
}

absl::Status Worker::BootstrapDataPlane() {
  assert(generation_ != nullptr && generation_->plan.world_size == world() &&
         "BootstrapDataPlane before Plan");
  assert(generation_->data_plane == nullptr && "BootstrapDataPlane twice in a generation");
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  Generation& g = *generation_;
  const int world = this->world();
  DataPlaneOptions plane_options = config_.data_plane;
  plane_options.snapshots = config_.recovery.snapshot_every > 0 && world > 1;
  plane_options.shard_group_size = g.plan.options.shard_group_size;
  absl::StatusOr<int> secondary = SecondaryGroupSize(g.plan.options.shard_group_size);
  if (!secondary.ok() && recoveries_ > 0) {
    // A generation re-formed at another size (a shrink) may not fit the
    // secondary groups; hpZ is an optimization, so the survivors go on
    // without it (they all see the same sizes and hosts, so all agree). A
    // fresh process in such a generation (a replacement) still refuses.
    std::fprintf(stderr, "shard_worker rank %d: hpZ off in generation %lld: %s\n", rank_,
                 static_cast<long long>(g.membership.generation),
                 std::string(secondary.status().message()).c_str());
    secondary = 0;
  }
  if (!secondary.ok()) return secondary.status();
  plane_options.secondary_group_size = *secondary;
  plane_options.group_aux = ElasticOuter();
  outer_group_current_ = true;  // the generation's snapshot: one anchor
  g.plane_options = plane_options;
  AbortLatch* const abort = abort_;
  absl::StatusOr<std::unique_ptr<DataPlane>> plane = ConnectDataPlane(
      client_.get(), rank_, world, plane_options, [abort] { return abort->tripped(); });
  if (!plane.ok()) return plane.status();
  g.data_plane = *std::move(plane);
  ExposeToAbort(g.data_plane.get(), nullptr);
  if (rank_ == 0 && world > 1) LogHostTransports(*g.data_plane);
  if (absl::Status s = PlanGenerationBatch(); !s.ok()) return s;
  EngineOptions engine_options = engine_options_;
  engine_options.grad_accum = g.layout.Passes();
  // Ranks that train different numbers of micro-batches sum them, and the
  // step divides by the step's count (worker/recovery/global_batch.h).
  engine_options.global_micro_batches = g.layout.Even() ? 0 : g.layout.MicroBatches();
  engine_options.replicas = g.data_plane->replicas.get();
  engine_options.secondary = g.data_plane->secondary.get();
  // --outer_timeout: the step's loss and norm agreed inside the group.
  engine_options.numerics = g.data_plane->group_aux.get();
  // HSDP with a group inside one host (shared memory): its reduce-scatter
  // crosses no link, so only the replicas' all-reduce is quantized.
  // (DiLoCo has no per-step replicas' all-reduce: the group's stays int8.)
  engine_options.int8_group_reduce_in_f32 =
      engine_options.replicas != nullptr &&
      engine_options.replica_sync == ReplicaSync::kEveryStep &&
      g.data_plane->description.ReduceOverSharedMemory();
  absl::StatusOr<std::unique_ptr<ZeroEngine>> engine =
      ZeroEngine::Create(task_->model(), g.plan, g.data_plane->gather.get(),
                         g.data_plane->reduce.get(), g.data_plane->aux.get(), engine_options);
  if (!engine.ok()) return Annotate(engine.status(), "engine");
  g.engine = *std::move(engine);
  ExposeToAbort(g.data_plane.get(), g.engine.get());
  return CheckNotAborted();
}

int64_t Worker::DataRow(int64_t step) const {
  const int64_t per_step = int64_t{config_.task.batch} * generation_->layout.MicroBatches();
  return task_->cursor_row() + (step - task_->cursor_step()) * per_step;
}

void Worker::SetCheckpointer(Checkpointer* checkpointer) {
  absl::MutexLock lock(&abort_mu_);
  checkpointer_ = checkpointer;
}

// What rank 0 says of the job when training starts; the other ranks, one
// line each, so that every rank's log says it trains.
void Worker::LogTrainingStart(const Generation& g) const {
  if (rank_ == 0) {
    int64_t parameters = 0;
    for (const auto& t : task_->model()->Spec().tensors) parameters += t.Elements();
    std::fprintf(stderr, "job %s: %d ranks, stage %d, %zu units, plan %s, model %lld parameters\n",
                 config_.job.c_str(), world(), config_.engine.stage, g.plan.units.size(),
                 g.plan.hash.c_str(), static_cast<long long>(parameters));
    // --steps counts from step 0, the restored file's steps included.
    if (g.start_step > 0 && g.start_step >= config_.schedule.steps) {
      std::fprintf(stderr,
                   "note: the state restored is at step %d and --steps=%d: nothing to train "
                   "(--steps is the run's total, the restored steps included)\n",
                   g.start_step, config_.schedule.steps);
    }
  } else {
    std::fprintf(stderr, "rank %d of %d: job %s, stage %d, plan %s; rank 0 logs the steps\n",
                 rank_, world(), config_.job.c_str(), config_.engine.stage,
                 g.plan.hash.c_str());
  }
}

absl::Status Worker::Train() {
  assert(generation_ != nullptr && generation_->engine != nullptr &&
         generation_->data_plane != nullptr && "Train before Restore");
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  Generation& g = *generation_;
  g.training = true;
  ZeroEngine& e = *g.engine;
  const DataPlane& plane = *g.data_plane;
  const int steps = config_.schedule.steps;
  const CheckpointConfig& checkpoints = config_.checkpoint;
  const PlaneBytes bytes_before = PlaneBytes::Of(plane);
  LogTrainingStart(g);
  if (absl::Status s = CheckReplicasExist(e); !s.ok()) return s;
  Checkpointer checkpointer(client_.get(), checkpoints, config_.engine.optimizer,
                            &metrics_.checkpoint_pause_ms);
  SetCheckpointer(&checkpointer);  // its commits_pending in the heartbeats
  if (device_ == nullptr) checkpointer.Reserve(e, IdentityAt(g.start_step));
  absl::Cleanup unpublish = [this] { SetCheckpointer(nullptr); };
  if (steps == 0 && checkpoints.at_end) {
    // A run of 0 steps checkpoints the state it starts from: how an
    // --init_from file becomes a checkpoint (and a consolidated model).
    absl::Status s = AccountAs(ledger_, TimeCause::kCheckpointPause, [&] {
      return checkpointer.Save(e, IdentityAt(0), 0, device_ != nullptr);
    });
    if (!s.ok()) return s;
  }
  // --loss_spike_zscore judges each step's loss before its update.
  if (spikes_.enabled()) e.SetVerdictScreen([this](StepVerdict* v) { spikes_.Screen(v); });
  const int first_step = g.start_step;
  for (int step = g.start_step; step < steps; ++step) {
    // Between steps, the abort needs no collective to notice it.
    if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
    step_ = step;
    if (absl::Status s = RunStep(step); !s.ok()) return s;
    if (rewind_.has_value()) {  // a bad step, not applied: go back and re-run
      absl::StatusOr<int> next = Rewind();
      if (!next.ok()) return next.status();
      step = *next - 1;
      continue;
    }
    if (absl::Status s = AfterStep(step + 1, step == first_step, &checkpointer); !s.ok()) {
      return s;
    }
  }
  absl::Status waited =
      AccountAs(ledger_, TimeCause::kSnapshotPause, [this] { return snapshots_.Wait(); });
  if (!waited.ok()) return Annotate(waited, "snapshot");
  absl::Status drained =
      AccountAs(ledger_, TimeCause::kCheckpointPause, [&] { return checkpointer.Drain(); });
  metrics_.checkpoint_commit_ms = checkpointer.commit_ms();
  for (std::string& failure : checkpointer.failures()) {
    metrics_.checkpoint_failures.push_back(std::move(failure));
  }
  if (!drained.ok()) {
    // The last checkpoint failed after every step trained: no re-join can
    // bring it back, and a peer must not wait for this rank as for a dead
    // one (#44 finding 8). Whatever else failed still ends the generation.
    if (abort_->tripped() || !Checkpointer::TrainingOutlives(drained)) return drained;
    last_checkpoint_failure_ = drained;
    metrics_.checkpoint_failures.push_back(std::string(drained.message()));
  }
  // Training traffic only: evaluation and sampling move bytes too.
  const PlaneBytes bytes_after = PlaneBytes::Of(plane);
  metrics_.training_bytes += bytes_after.gather - bytes_before.gather;
  metrics_.training_bytes += bytes_after.reduce - bytes_before.reduce;
  metrics_.training_bytes += bytes_after.replicas - bytes_before.replicas;
  const CollectiveBytes secondary = bytes_after.secondary - bytes_before.secondary;
  metrics_.training_bytes += secondary;
  metrics_.secondary_gather_bytes += secondary.all_gather;
  return absl::OkStatus();
}

absl::Status Worker::AfterStep(int completed, bool first, Checkpointer* checkpointer) {
  ZeroEngine& e = *generation_->engine;
  const int steps = config_.schedule.steps;
  const int every = config_.recovery.snapshot_every;
  const CheckpointConfig& checkpoints = config_.checkpoint;
  // First: what follows (evaluation, checkpoints, snapshots) sees one model.
  if (absl::Status s = MaybeOuterStep(completed); !s.ok()) return s;
  // Before any snapshot of this step: a corrupted shard must not be kept.
  if (absl::Status s = CheckIntegrity(completed); !s.ok()) return s;
  if (first && every > 0 && completed < steps && device_ == nullptr) {
    absl::Status s = AccountAs(ledger_, TimeCause::kSnapshotPause,
                               [&] { return snapshots_.Reserve(e, world()); });
    if (!s.ok()) return s;
  }
  // --outer_timeout: evaluations and snapshots (multiples of --outer_every)
  // run over every group, so only after an outer step all of them took part.
  const bool all_groups = !ElasticOuter() || outer_quorum_full_;
  if (config_.val_every > 0 && completed % config_.val_every == 0 && completed < steps &&
      all_groups) {
    if (absl::Status s = Evaluate(completed); !s.ok()) return s;
  }
  if ((checkpoints.every > 0 && completed % checkpoints.every == 0) ||
      (checkpoints.at_end && completed == steps)) {
    absl::Status s = AccountAs(ledger_, TimeCause::kCheckpointPause, [&] {
      return checkpointer->Save(e, IdentityAt(completed),
                                NextCheckpointStep(completed, checkpoints),
                                /*on_device=*/device_ != nullptr);
    });
    if (!s.ok()) return s;
  }
  if (every > 0 && completed % every == 0 && completed < steps && all_groups) {
    return AccountAs(ledger_, TimeCause::kSnapshotPause, [&] {
      return snapshots_.Take(e, IdentityAt(completed), generation_->data_plane->snapshot.get(),
                             buddy_shift_, /*on_device=*/device_ != nullptr);
    });
  }
  return absl::OkStatus();
}

absl::Status Worker::MaybeOuterStep(int completed) {
  const EngineOptions& engine = config_.engine;
  if (engine.replica_sync == ReplicaSync::kDiLoCo && StreamingOuter(engine.outer)) {
    return StreamOuterStep(completed);
  }
  if (engine.replica_sync != ReplicaSync::kDiLoCo ||
      !OuterStepAfter(completed, config_.schedule.steps, engine.outer.every)) {
    return absl::OkStatus();
  }
  if (ElasticOuter()) return ElasticOuterStep(completed);
  absl::StatusOr<OuterStats> outer = generation_->engine->OuterStep();
  if (!outer.ok()) return Annotate(outer.status(), absl::StrCat("outer step after ", completed));
  return RecordOuterStep(completed, *outer);
}

bool Worker::TestStepDelayed(int step) const {
  if (config_.test_step_delay_ms <= 0) return false;
  if (config_.test_step_delay_until > 0 && step >= config_.test_step_delay_until) return false;
  const std::vector<int>& ranks = config_.test_step_delay_ranks;
  return ranks.empty() || std::find(ranks.begin(), ranks.end(), rank_) != ranks.end();
}

absl::Status Worker::CheckIntegrity(int completed) {
  ZeroEngine& e = *generation_->engine;
  if (absl::Status s = CompareWithFirstRun(completed); !s.ok()) return s;
  for (size_t i = 0; i < config_.testing_corrupt.size(); ++i) {
    const WorkerConfig::Corruption& c = config_.testing_corrupt[i];
    if (rank_ != c.rank || completed != c.step || !corrupted_.insert(i).second) continue;
    // Once per entry and process: a rewind's re-run of the step is clean.
    if (absl::Status s = e.CorruptMasterForTesting(c.bit); !s.ok()) return s;
    std::fprintf(stderr, "shard_worker rank %d: --testing_corrupt: flipped bit %d after step %d\n",
                 rank_, c.bit, completed);
  }
  const int every = config_.replica_check_every;
  if (every == 0 || e.group_size() >= e.world_size()) return absl::OkStatus();  // none to compare
  // The last step's hashes have no next step to travel with: compared here.
  if (completed != config_.schedule.steps || completed % every != 0) return absl::OkStatus();
  const absl::Time start = absl::Now();
  absl::Status s = CheckReplicas(e, completed, config_.schedule.steps, MemberHosts());
  metrics_.replica_check_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  return s;
}

absl::Status Worker::CheckReplicasExist(const ZeroEngine& e) {
  if (config_.replica_check_every == 0 || e.group_size() < e.world_size()) {
    return absl::OkStatus();
  }
  // A numeric --shard_group_size was checked with the flags: here the
  // groups are by host and every rank is on one, or the job shrank to one
  // group (a recovery), which a check cannot help and must not end.
  if (e.world_size() < config_.world_size) {
    if (rank_ == 0) {
      std::fprintf(stderr,
                   "shard_worker rank 0: replica checks paused: the job shrank to W=%d, one shard "
                   "group, so no shard has a replica; they resume when it grows back\n",
                   e.world_size());
    }
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "--replica_check_every needs replicas: shard groups smaller than the job (W=",
      e.world_size(),
      "; --shard_group_size=host made one group of them all: every rank is on one host)"));
}

std::vector<std::string> Worker::MemberHosts() const {
  std::vector<std::string> hosts;
  for (const auto& m : generation_->membership.members) hosts.push_back(m.host());
  return hosts;
}

int64_t Worker::NextCheckpointStep(int completed, const CheckpointConfig& checkpoints) const {
  const int steps = config_.schedule.steps;
  if (checkpoints.every > 0) {
    const int64_t next = (completed / checkpoints.every + 1) * int64_t{checkpoints.every};
    if (next <= steps) return next;
  }
  return checkpoints.at_end && completed < steps ? steps : 0;
}

ShardIdentity Worker::IdentityAt(int completed) const {
  const Generation& g = *generation_;
  return {config_.job,
          completed,
          rank_,
          world(),
          g.membership.generation,
          g.plan.hash,
          DataRow(completed),
          task_->HuggingFaceConfig()};
}

absl::Status Worker::RunStep(int step) {
  ZeroEngine& e = *generation_->engine;
  const BatchLayout& layout = generation_->layout;
  StepTiming timing;
  timing.step = step;
  timing.start = absl::Now();
  ledger_.Between(timing.start);  // the setup, or the last step's aftermath
  e.TakeFirstCollectiveStart();   // from here on: this step's first collective
  if (TestStepDelayed(step)) absl::SleepFor(absl::Milliseconds(config_.test_step_delay_ms));
  const KernelTimes kernels_before = KernelTimesSnapshot();
  const double cpu_before = ProcessCpuMs();
  const HostBytes bytes_before = generation_->data_plane->BytesByHost();
  if (absl::Status s = RunMicroBatches(e, step, &timing.data_wait); !s.ok()) return s;
  WaitForCopies(&timing);
  const double lr = config_.schedule.LearningRate(step);
  const int check_every = config_.replica_check_every;
  if (check_every > 0 && (step + 1) % check_every == 0 && e.group_size() < e.world_size()) {
    e.HashShardAtNextUpdate();
  }
  absl::StatusOr<StepStats> stats = e.Step(lr);
  if (!stats.ok()) return Annotate(stats.status(), absl::StrCat("step ", step, " optimizer"));
  timing.end = absl::Now();
  const double ms = absl::ToDoubleMilliseconds(timing.end - timing.start);
  timing.items = static_cast<double>(task_->ItemsPerMicroBatch()) * layout.MicroBatches();
  if (absl::Status s = ActOnVerdict(step, *stats); !s.ok()) return s;
  // A bad step is not applied (skipped, or rewound by Train): lost work.
  timing.applied = !stats->verdict.bad() && !rewind_.has_value();
  if (rewind_.has_value()) {
    timing.rewound = true;
    ledger_.Step(timing);
    return absl::OkStatus();
  }
  metrics_.RecordStep(stats->verdict.mean_loss, ms, ProcessCpuMs() - cpu_before, stats->times,
                      kernels_before, KernelTimesSnapshot());
  // Read after the loss's collective: the next step's early gathers (issued
  // inside Step) are this step's traffic.
  const HostBytes step_bytes = generation_->data_plane->BytesByHost() - bytes_before;
  metrics_.step_bytes_intra_host.push_back(step_bytes.intra_host);
  metrics_.step_bytes_inter_host.push_back(step_bytes.inter_host);
  const double items_per_second = timing.items / (ms / 1000.0);
  trained_ = true;
  NoteFirstStep(step);
  Progress progress = StepProgress(step, *stats, ms, items_per_second);
  // Arrival at the step's first collective, against every rank's.
  // (Not under --outer_timeout: the groups do not meet between outer steps.)
  const absl::Time arrival = e.TakeFirstCollectiveStart();
  if (arrival != absl::InfinitePast() && !ElasticOuter()) {
    absl::Status s =
        ShareArrival(e, arrival, rank_, &arrival_lag_, &progress.telemetry, &timing.arrival_spread);
    if (!s.ok()) return Annotate(s, "arrival times");
  }
  ledger_.Step(timing);
  client_->ReportProgress(progress);
  metrics_.items_per_second_sum += items_per_second;
  if (rank_ == 0) {
    std::fprintf(stderr,
                 "step %d/%d  loss %.6f  lr %.2e  grad_norm %.4f  %.1f ms  %.0f %s/s  "
                 "mem/rank %.1f MiB\n",
                 step + 1, config_.schedule.steps, stats->verdict.mean_loss, lr, stats->grad_norm,
                 ms, items_per_second, config_.task.model == "gpt" ? "tokens" : "rows",
                 e.memory().peak_total() / 1048576.0);
  }
  return absl::OkStatus();
}

absl::Status Worker::RunMicroBatches(ZeroEngine& e, int step, double* data_wait) {
  const BatchLayout& layout = generation_->layout;
  const int passes = layout.Passes();
  const int micro_batches = layout.DataMicroBatches(rank_);
  for (int micro = 0; micro < passes; ++micro) {
    // A rank with fewer of the step's micro-batches than others (an uneven
    // shrink under --keep_global_batch) pads: the pass's collectives only.
    if (micro >= micro_batches) {
      absl::Status s = e.PadMicroBatch(micro + 1 == passes);
      if (!s.ok()) return Annotate(s, absl::StrCat("step ", step));
      continue;
    }
    const absl::Time asked = absl::Now();
    if (absl::Status s = task_->SetTrainBatch(step, micro, rank_, world()); !s.ok()) {
      return Annotate(s, "data");
    }
    *data_wait += absl::ToDoubleSeconds(absl::Now() - asked);
    absl::StatusOr<double> loss = e.ForwardBackward(micro + 1 == passes);
    if (!loss.ok()) return Annotate(loss.status(), absl::StrCat("step ", step));
  }
  return absl::OkStatus();
}

absl::Status Worker::ActOnVerdict(int step, const StepStats& stats) {
  const StepVerdict& verdict = stats.verdict;
  if (stats.times.replica_hash_ms > 0) {
    metrics_.replica_hash_ms.push_back(stats.times.replica_hash_ms);
  }
  // The hashes taken in the previous step's update, judged in this one's
  // verdict before its update (replica_check.h).
  if (!verdict.replica_mismatches.empty()) return OnReplicaMismatch(step, verdict);
  if (verdict.replicas_compared) last_verified_step_ = step;
  if (mismatch_.has_value() && mismatch_->step == step && verdict.replicas_compared) {
    if (absl::Status s = NameCorruptedRanks(step); !s.ok()) return s;
  }
  bool handled = false;
  if (absl::Status s = OnBadStep(step, verdict, &handled); !s.ok() || handled) return s;
  if (absl::Status s = nonfinite_.Judge(
          step, config_.schedule.steps, verdict,
          verdict.finite() ? "" : task_->TrainSamples(step, verdict.first_rank, world()));
      !s.ok()) {
    return s;
  }
  if (verdict.bad()) {
    metrics_.skipped_steps.push_back(step + 1);  // numbered as the log's "step N/M"
    if (rank_ == 0) std::fprintf(stderr, "%s\n", nonfinite_.last_skip().c_str());
  } else {
    spikes_.Record(step, verdict.mean_loss);
  }
  return absl::OkStatus();
}

absl::Status Worker::Evaluate(int completed_steps) {
  absl::StatusOr<Evaluation> eval = AccountAs(ledger_, TimeCause::kEvaluation, [&] {
    return task_->Evaluate(*generation_->engine, rank_, world(), config_.val_batches);
  });
  if (!eval.ok()) return Annotate(eval.status(), "validation");
  metrics_.last_eval = *eval;
  metrics_.val_losses.push_back(eval->loss);
  if (rank_ == 0) {
    std::fprintf(stderr, "step %d  val_loss %.4f%s\n", completed_steps, eval->loss,
                 eval->accuracy >= 0
                     ? absl::StrCat(absl::StrFormat("  accuracy %.1f%%", 100 * eval->accuracy),
                                    eval->accuracy_in_context >= 0
                                        ? absl::StrFormat(" (after another line %.1f%%)",
                                                          100 * eval->accuracy_in_context)
                                        : "")
                           .c_str()
                     : "");
  }
  return absl::OkStatus();
}

void Worker::EndGeneration() {
  if (generation_ == nullptr) return;
  // A rewind belongs to its generation: the next one starts from the state
  // its recovery agrees on, with checks and snapshots of its own.
  ledger_.EndGeneration(absl::Now());  // what it did since the ledger last heard: lost
  rewind_.reset();
  mismatch_.reset();
  spike_rewound_step_ = -1;
  last_verified_step_ = -1;
  ExposeToAbort(nullptr, nullptr);
  // A generation that did not end with Leave may have collectives waiting on
  // this rank (here in the engine's threads, or on the peers): abort them,
  // so that the engine's threads can be joined now and the peers fail now.
  if (generation_->data_plane != nullptr) generation_->data_plane->Abort();
  // The snapshot transfer in flight uses the snapshot context: with it
  // aborted, it ends now.
  snapshots_.EndGeneration();
  // The engine uses the communicators.
  generation_->engine.reset();
  generation_->data_plane.reset();
  generation_.reset();
}

// ---- After training ----

absl::Status Worker::Report() {
  assert(generation_ != nullptr && generation_->engine != nullptr && "Report before Train");
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  Generation& g = *generation_;
  ZeroEngine& e = *g.engine;
  const int world = this->world();
  if (config_.task.model == "gpt" || config_.val_every > 0) {
    if (absl::Status s = Evaluate(config_.schedule.steps); !s.ok()) return s;
  }
  if (config_.sample_bytes > 0) {
    absl::StatusOr<std::string> text = AccountAs(
        ledger_, TimeCause::kEvaluation, [&] { return task_->Sample(e, config_.sample_bytes); });
    if (!text.ok()) return Annotate(text.status(), "sample");
    metrics_.sample = *text;
    if (rank_ == 0) std::fprintf(stderr, "sample:\n%s\n", metrics_.sample.c_str());
  }
  if (!config_.eval_out.empty()) {
    absl::StatusOr<std::string> record = AccountAs(
        ledger_, TimeCause::kEvaluation, [&] { return task_->EvalRecord(e, rank_, world); });
    if (!record.ok()) return Annotate(record.status(), "--eval_out");
    if (rank_ == 0) {
      if (absl::Status s = WriteEvalOut(*record, config_.eval_out); !s.ok()) return s;
    }
  }
  absl::StatusOr<double> params_sum = e.ParamsSum();
  if (!params_sum.ok()) return Annotate(params_sum.status(), "params sum");
  params_sum_ = *params_sum;
  // DiLoCo: this rank's own f32 master shard, summed in order: replicas
  // holding the same bits (the groups after an outer step) report the same
  // sum. Stage 0 has no master shard (its state is not sharded).
  std::optional<double> shard_sum;
  if (config_.engine.replica_sync == ReplicaSync::kDiLoCo) {
    absl::StatusOr<std::vector<float>> shard = e.CopyMasterShard();
    if (!shard.ok()) return Annotate(shard.status(), "master shard sum");
    shard_sum = 0;
    for (float v : *shard) *shard_sum += v;
  }
  absl::StatusOr<std::vector<double>> peaks =
      e.GatherOverRanks(static_cast<double>(e.memory().peak_total()));
  if (!peaks.ok()) return Annotate(peaks.status(), "memory summary");
  absl::StatusOr<std::vector<double>> states =
      e.GatherOverRanks(static_cast<double>(e.memory().model_state()));
  if (!states.ok()) return Annotate(states.status(), "memory summary");

  FinishedRun run;
  run.config = &config_;
  run.rank = rank_;
  run.model = task_->Describe();
  run.engine = &e;
  run.metrics = &metrics_;
  run.plan_hash = g.plan.hash;
  run.data_plane = g.data_plane->description;
  run.params_sum = params_sum_;
  run.master_shard_sum = shard_sum;
  run.model_state_bytes = *std::move(states);
  run.peak_bytes = *std::move(peaks);
  ledger_.Between(absl::Now());
  run.goodput = GoodputReport();
  return WriteRunOutputs(run);
}

absl::Status Worker::Leave() {
  assert(client_ != nullptr && generation_ != nullptr && "Leave before Join");
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  // No abort can arrive once heartbeats stop.
  client_->StopHeartbeats();
  ledger_.Between(absl::Now());  // the report, after the last step
  if (absl::Status s = client_->Leave(ledger_.Generation()); !s.ok()) {
    // Training and its checkpoints are complete (Train drained the last
    // commit): a server that cannot be reached to say goodbye does not make
    // the run a failure. It declares the member dead later, which changes
    // nothing for a job that is done.
    if (!absl::IsUnavailable(s) && !absl::IsDeadlineExceeded(s)) return Annotate(s, "leave");
    std::fprintf(stderr,
                 "shard_worker rank %d: warning: training finished, but leaving the job failed "
                 "(%s); the server will see this member as dead\n",
                 rank_, s.ToString().c_str());
  }
  // Every collective completed: the communicators close as usual (no
  // Abort, which would fail a peer still finishing its last one).
  ExposeToAbort(nullptr, nullptr);
  generation_->engine.reset();
  generation_.reset();
  if (rank_ == 0) {
    std::fprintf(stderr, "done: params_sum %.9g\n", params_sum_);
  } else {
    std::fprintf(stderr, "rank %d: done\n", rank_);
  }
  return absl::OkStatus();
}

// ---- Abort ----

void Worker::OnServerCommand(const absl::StatusOr<v1::HeartbeatResponse>& reply) {
  absl::MutexLock lock(&abort_mu_);
  const std::string in_flight = abortable_engine_ != nullptr ? abortable_engine_->InFlight() : "";
  const std::string during = absl::StrCat(
      "during step ", step_.load(), in_flight.empty() ? "" : absl::StrCat(", in ", in_flight));
  if (reply.ok() && reply->verdict_unix_ms() > 0 && !abort_->tripped()) {
    verdict_ = absl::FromUnixMillis(reply->verdict_unix_ms());
  }
  abort_->Trip(reply.ok()
                   ? absl::StrCat("aborting ", during, ": ", reply->reason())
                   : absl::StrCat("heartbeats refused ", during, ": ", reply.status().ToString()));
  if (abortable_data_plane_ != nullptr) abortable_data_plane_->Abort();
}

absl::Status Worker::CheckNotAborted() const {
  if (!abort_->tripped()) return absl::OkStatus();
  return absl::AbortedError(abort_->message());
}

void Worker::ExposeToAbort(DataPlane* data_plane, const ZeroEngine* engine) {
  absl::MutexLock lock(&abort_mu_);
  abortable_data_plane_ = data_plane;
  abortable_engine_ = engine;
  // The server may have ended the generation while the data plane was being
  // made.
  if (data_plane != nullptr && abort_->tripped()) data_plane->Abort();
}

}  // namespace zeroshard
