#include "worker/worker.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/checkpoint_format.h"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/model/parallel.h"
#include "worker/zero/task_thread.h"

#ifdef ZEROSHARD_HAVE_CUDA
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_mlp.h"
#endif

namespace zeroshard {
namespace {

// A checkpoint's commit: the server reads the file's header and, for the
// last rank, writes and fsyncs the manifest, on a shared filesystem that may
// be slow.
constexpr absl::Duration kCommitTimeout = absl::Minutes(5);
// An upload (--checkpoint_transport=grpc) moves the whole shard.
constexpr absl::Duration kUploadTimeout = absl::Hours(1);

// "<what>: <CODE>: <message>" with the code kept: the text shard_worker
// prints for a failure of `what`.
absl::Status Annotate(const absl::Status& status, absl::string_view what) {
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.ToString()));
}

CollectiveBytes operator-(const CollectiveBytes& a, const CollectiveBytes& b) {
  return {a.all_gather - b.all_gather, a.reduce_scatter - b.reduce_scatter,
          a.all_reduce - b.all_reduce, a.broadcast - b.broadcast};
}

CollectiveBytes& operator+=(CollectiveBytes& a, const CollectiveBytes& b) {
  a.all_gather += b.all_gather;
  a.reduce_scatter += b.reduce_scatter;
  a.all_reduce += b.all_reduce;
  a.broadcast += b.broadcast;
  return a;
}

// Saves this rank's shard. The snapshot is the training thread's pause; the
// write, the upload (--checkpoint_transport=grpc) and the commit run on a
// thread of their own, one checkpoint in flight at a time. Destroying it
// waits for the checkpoint in flight.
class Checkpointer {
 public:
  // `client` and `pause_ms` outlive it.
  Checkpointer(Client* client, const CheckpointConfig& config, const std::string& optimizer,
               std::vector<double>* pause_ms)
      : client_(client), config_(config), optimizer_(optimizer), pause_ms_(pause_ms) {}

  // Waits for the previous checkpoint ("previous checkpoint: ..."), then
  // snapshots `engine` as `id` and queues the rest.
  absl::Status Save(ZeroEngine& engine, const ShardIdentity& id) {
    const absl::Time start = absl::Now();
    if (absl::Status s = thread_.Drain(); !s.ok()) return Annotate(s, "previous checkpoint");
    absl::StatusOr<ShardSnapshot> snapshot =
        SnapshotShard(engine, id, optimizer_, config_.save_optimizer);
    if (!snapshot.ok()) return Annotate(snapshot.status(), "checkpoint snapshot");
    pause_ms_->push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    auto shared = std::make_shared<ShardSnapshot>(*std::move(snapshot));
    thread_.Submit([shared, client = client_, config = config_]() -> absl::Status {
      absl::StatusOr<WrittenShard> written = WriteShard(*shared, config.dir);
      if (!written.ok()) return written.status();
      if (config.transport == CheckpointTransport::kGrpc) {
        absl::Status uploaded = client
                                    ->UploadShard(shared->id.step, written->relative_path,
                                                  written->path, kUploadTimeout)
                                    .status();
        if (!uploaded.ok()) return uploaded;
      }
      return client
          ->CommitShard(shared->id.step, written->relative_path, written->size_bytes,
                        written->checksums, kCommitTimeout)
          .status();
    });
    return absl::OkStatus();
  }

  // Waits for the last checkpoint ("checkpoint: ...").
  absl::Status Drain() {
    absl::Status s = thread_.Drain();
    return s.ok() ? s : Annotate(s, "checkpoint");
  }

 private:
  Client* const client_;
  const CheckpointConfig config_;
  const std::string optimizer_;
  std::vector<double>* const pause_ms_;
  TaskThread thread_{"checkpoint"};
};

}  // namespace

Worker::Worker(WorkerConfig config, AbortLatch* abort)
    : config_(std::move(config)),
      abort_(abort),
      task_options_(config_.task),
      engine_options_(config_.engine) {}

Worker::~Worker() {
  EndGeneration();
  // The heartbeat thread calls back into this object: stop it while the
  // object is whole.
  if (client_ != nullptr) client_->StopHeartbeats();
}

// ---- Before joining ----

// --backend=nccl: the engine's buffers on this process's GPU (CudaBackend),
// gathers and reductions over NCCL, the MLP's kernels on the GPU. The
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
  return absl::OkStatus();
}

// ---- One job generation ----

absl::Status Worker::Join() {
  EndGeneration();  // a generation left over from a failed run
  if (client_ == nullptr) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(config_.client);
    if (!client.ok()) return Annotate(client.status(), "connect");
    client_ = *std::move(client);
  }
  absl::StatusOr<JoinInfo> joined = client_->Join(
      config_.job, config_.world_size, config_.worker_id, config_.host, config_.join_timeout);
  if (!joined.ok()) return Annotate(joined.status(), "join");
  generation_ = std::make_unique<Generation>();
  generation_->membership = *std::move(joined);
  rank_ = generation_->membership.rank;
  client_->StartHeartbeats(
      [this](absl::StatusOr<v1::HeartbeatResponse> reply) { OnServerCommand(reply); });
  return absl::OkStatus();
}

absl::Status Worker::Plan() {
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  absl::StatusOr<ShardPlan> planned =
      client_->PlanShards(task_->model()->Spec(), config_.plan, config_.world_size);
  if (!planned.ok()) return Annotate(planned.status(), "plan");
  generation_->plan = *std::move(planned);
  return absl::OkStatus();
}

absl::Status Worker::BootstrapDataPlane() {
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  Generation& g = *generation_;
  const int world = config_.world_size;
  absl::StatusOr<std::unique_ptr<DataPlane>> plane =
      ConnectDataPlane(client_.get(), rank_, world, config_.data_plane);
  if (!plane.ok()) return plane.status();
  g.data_plane = *std::move(plane);
  ExposeToAbort(g.data_plane.get(), nullptr);
  if (rank_ == 0 && world > 1) {
    for (const char* tag : {"gather", "reduce"}) {
      const nlohmann::json& d = g.data_plane->description.at(tag);
      const std::string transport = d["transport"];
      if (transport == "nccl") continue;
      std::fprintf(stderr, "data plane (%s): %s, %s\n", tag,
                   transport == "shm" ? "shared memory" : "TCP",
                   d["note"].get<std::string>().c_str());
    }
  }
  absl::StatusOr<std::unique_ptr<ZeroEngine>> engine =
      ZeroEngine::Create(task_->model(), g.plan, g.data_plane->gather.get(),
                         g.data_plane->reduce.get(), g.data_plane->aux.get(), engine_options_);
  if (!engine.ok()) return Annotate(engine.status(), "engine");
  g.engine = *std::move(engine);
  ExposeToAbort(g.data_plane.get(), g.engine.get());
  return CheckNotAborted();
}

absl::Status Worker::Restore() {
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  Generation& g = *generation_;
  ZeroEngine& e = *g.engine;
  Model* const m = task_->model();
  const InitialState& initial = config_.initial;
  const std::string& root = config_.checkpoint.dir;
  const std::string& job = config_.job;
  std::unique_ptr<CheckpointReader> reader;
  if (initial.resume != InitialState::Resume::kOff) {
    int64_t step = initial.resume_step;
    if (initial.resume == InitialState::Resume::kLatest) {
      step = LatestCompleteStep(root, job);
      if (step < 0) {
        return absl::NotFoundError(absl::StrCat("--resume=latest: no complete checkpoint of job '",
                                                job, "' under ", root));
      }
    }
    const std::string step_dir = absl::StrCat(root, "/", CheckpointStepDir(job, step));
    const std::string manifest = absl::StrCat(root, "/", CheckpointManifestPath(job, step));
    if (access(manifest.c_str(), F_OK) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("--resume=", initial.resume_flag, ": step ", step, " of job '", job,
                       "' is not a complete checkpoint (no ", manifest, ")"));
    }
    absl::StatusOr<std::unique_ptr<CheckpointReader>> opened =
        CheckpointReader::OpenStep(step_dir, CheckpointShardFileName(rank_, config_.world_size));
    if (!opened.ok()) return Annotate(opened.status(), "--resume");
    reader = *std::move(opened);
  } else if (!initial.init_from.empty()) {
    absl::StatusOr<std::unique_ptr<CheckpointReader>> opened =
        CheckpointReader::OpenFile(initial.init_from);
    if (!opened.ok()) return Annotate(opened.status(), "--init_from");
    reader = *std::move(opened);
  }

  g.start_step = 0;
  if (reader == nullptr) {
    const uint64_t seed = config_.task.seed;
    absl::Status s = e.Initialize([&](const TensorSpec& t, int64_t begin, int64_t end, float* out) {
      m->InitRows(t, begin, end, seed, out);
      return absl::OkStatus();
    });
    return s.ok() ? s : Annotate(s, "initialize");
  }
  CheckpointReader* r = reader.get();
  auto rows = [r](CheckpointReader::Kind kind) {
    return [r, kind](const TensorSpec& t, int64_t begin, int64_t end, float* out) {
      return r->ReadRows(kind, t, begin, end, out);
    };
  };
  if (absl::Status s = e.Initialize(rows(CheckpointReader::Kind::kParams)); !s.ok()) {
    return Annotate(s, absl::StrCat("load parameters from ", r->source()));
  }
  const EngineOptions& options = config_.engine;
  const bool has_moments = options.optimizer != "sgd" || options.optimizer_options.momentum > 0;
  if (r->has_optimizer_state() && has_moments) {
    absl::Status s =
        e.InitializeMoment(ZeroEngine::Moment::kExpAvg, rows(CheckpointReader::Kind::kExpAvg));
    if (!s.ok()) return Annotate(s, absl::StrCat("load exp_avg from ", r->source()));
    if (options.optimizer != "sgd") {
      s = e.InitializeMoment(ZeroEngine::Moment::kExpAvgSq,
                             rows(CheckpointReader::Kind::kExpAvgSq));
      if (!s.ok()) return Annotate(s, absl::StrCat("load exp_avg_sq from ", r->source()));
    }
    if (r->optimizer_step() >= 0) e.set_optimizer_step(r->optimizer_step());
  } else if (rank_ == 0) {
    std::fprintf(stderr, "note: %s has no optimizer state; moments start at zero\n",
                 r->source().c_str());
  }
  if (r->step() > 0) g.start_step = static_cast<int>(r->step());
  if (rank_ == 0) {
    std::fprintf(stderr, "restored %s (step %d)\n", r->source().c_str(), g.start_step);
  }
  return absl::OkStatus();
}

absl::Status Worker::Train() {
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  Generation& g = *generation_;
  ZeroEngine& e = *g.engine;
  const DataPlane& plane = *g.data_plane;
  const int steps = config_.schedule.steps;
  const CheckpointConfig& checkpoints = config_.checkpoint;
  const CollectiveBytes gather_before = plane.gather->bytes_sent();
  const CollectiveBytes reduce_before = plane.reduce->bytes_sent();
  if (rank_ == 0) {
    int64_t parameters = 0;
    for (const auto& t : task_->model()->Spec().tensors) parameters += t.Elements();
    std::fprintf(stderr, "job %s: %d ranks, stage %d, %zu units, plan %s, model %lld parameters\n",
                 config_.job.c_str(), config_.world_size, config_.engine.stage, g.plan.units.size(),
                 g.plan.hash.c_str(), static_cast<long long>(parameters));
  }
  Checkpointer checkpointer(client_.get(), checkpoints, config_.engine.optimizer,
                            &metrics_.checkpoint_pause_ms);
  for (int step = g.start_step; step < steps; ++step) {
    // Between steps, the abort needs no collective to notice it.
    if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
    step_ = step;
    if (absl::Status s = RunStep(step); !s.ok()) return s;
    const int completed = step + 1;
    if (config_.val_every > 0 && completed % config_.val_every == 0 && completed < steps) {
      if (absl::Status s = Evaluate(completed); !s.ok()) return s;
    }
    if ((checkpoints.every > 0 && completed % checkpoints.every == 0) ||
        (checkpoints.at_end && completed == steps)) {
      const ShardIdentity id{
          config_.job, completed, rank_, config_.world_size, g.membership.generation, g.plan.hash};
      if (absl::Status s = checkpointer.Save(e, id); !s.ok()) return s;
    }
  }
  if (absl::Status s = checkpointer.Drain(); !s.ok()) return s;
  // Training traffic only: evaluation and sampling move bytes too.
  metrics_.training_bytes += plane.gather->bytes_sent() - gather_before;
  metrics_.training_bytes += plane.reduce->bytes_sent() - reduce_before;
  return absl::OkStatus();
}

absl::Status Worker::RunStep(int step) {
  ZeroEngine& e = *generation_->engine;
  const int world = config_.world_size;
  const int grad_accum = config_.engine.grad_accum;
  const absl::Time start = absl::Now();
  const KernelTimes kernels_before = KernelTimesSnapshot();
  const double cpu_before = ProcessCpuMs();
  for (int micro = 0; micro < grad_accum; ++micro) {
    if (absl::Status s = task_->SetTrainBatch(step, micro, rank_, world); !s.ok()) {
      return Annotate(s, "data");
    }
    absl::StatusOr<double> loss = e.ForwardBackward(micro + 1 == grad_accum);
    if (!loss.ok()) return Annotate(loss.status(), absl::StrCat("step ", step));
  }
  const double lr = config_.schedule.LearningRate(step);
  absl::StatusOr<StepStats> stats = e.Step(lr);
  if (!stats.ok()) return Annotate(stats.status(), absl::StrCat("step ", step, " optimizer"));
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  absl::StatusOr<double> mean = e.MeanOverRanks(stats->loss, "the step's loss");
  if (!mean.ok()) return Annotate(mean.status(), "loss");
  metrics_.losses.push_back(*mean);
  metrics_.step_ms.push_back(ms);
  metrics_.step_times.push_back(stats->times);
  metrics_.step_cpu_ms.push_back(ProcessCpuMs() - cpu_before);
  const KernelTimes kernels_after = KernelTimesSnapshot();
  for (size_t k = 0; k < kernels_after.size(); ++k) {
    metrics_.kernel_ms[k] += kernels_after[k] - kernels_before[k];
  }
  const double items_per_second = task_->ItemsPerMicroBatch() * grad_accum * world / (ms / 1000.0);
  Progress progress{step + 1, *mean, e.memory().total(), e.collective_seq()};
  progress.last_step.set_step_ms(ms);
  progress.last_step.set_items_per_second(items_per_second);
  progress.last_step.set_gather_wait_ms(stats->times.gather_wait_ms);
  progress.last_step.set_reduce_wait_ms(stats->times.reduce_wait_ms);
  client_->ReportProgress(progress);
  metrics_.items_per_second_sum += items_per_second;
  if (rank_ == 0) {
    std::fprintf(stderr,
                 "step %d/%d  loss %.6f  lr %.2e  grad_norm %.4f  %.1f ms  %.0f %s/s  "
                 "mem/rank %.1f MiB\n",
                 step + 1, config_.schedule.steps, *mean, lr, stats->grad_norm, ms,
                 items_per_second, config_.task.model == "gpt" ? "tokens" : "rows",
                 e.memory().peak_total() / 1048576.0);
  }
  return absl::OkStatus();
}

absl::Status Worker::Evaluate(int completed_steps) {
  absl::StatusOr<Evaluation> eval =
      task_->Evaluate(*generation_->engine, rank_, config_.world_size, config_.val_batches);
  if (!eval.ok()) return Annotate(eval.status(), "validation");
  metrics_.last_eval = *eval;
  metrics_.val_losses.push_back(eval->loss);
  if (rank_ == 0) {
    std::fprintf(stderr, "step %d  val_loss %.4f%s\n", completed_steps, eval->loss,
                 eval->accuracy >= 0
                     ? absl::StrFormat("  accuracy %.1f%% (after another line %.1f%%)",
                                       100 * eval->accuracy, 100 * eval->accuracy_in_context)
                           .c_str()
                     : "");
  }
  return absl::OkStatus();
}

void Worker::EndGeneration() {
  if (generation_ == nullptr) return;
  ExposeToAbort(nullptr, nullptr);
  // A generation that did not end with Leave may have collectives waiting on
  // this rank (here in the engine's threads, or on the peers): abort them,
  // so that the engine's threads can be joined now and the peers fail now.
  if (generation_->data_plane != nullptr) generation_->data_plane->Abort();
  // The engine uses the communicators.
  generation_->engine.reset();
  generation_->data_plane.reset();
  generation_.reset();
}

// ---- After training ----

absl::Status Worker::Report() {
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  Generation& g = *generation_;
  ZeroEngine& e = *g.engine;
  const int world = config_.world_size;
  if (config_.task.model == "gpt" || config_.val_every > 0) {
    if (absl::Status s = Evaluate(config_.schedule.steps); !s.ok()) return s;
  }
  if (config_.sample_bytes > 0) {
    absl::StatusOr<std::string> text = task_->Sample(e, config_.sample_bytes);
    if (!text.ok()) return Annotate(text.status(), "sample");
    metrics_.sample = *text;
    if (rank_ == 0) std::fprintf(stderr, "sample:\n%s\n", metrics_.sample.c_str());
  }
  if (!config_.eval_out.empty()) {
    absl::StatusOr<std::string> record = task_->EvalRecord(e, rank_, world);
    if (!record.ok()) return Annotate(record.status(), "--eval_out");
    if (rank_ == 0) {
      std::ofstream file(config_.eval_out);
      file << *record << "\n";
      if (!file) {
        return absl::InternalError(absl::StrCat("cannot write --eval_out ", config_.eval_out));
      }
    }
  }
  absl::StatusOr<double> params_sum = e.ParamsSum();
  if (!params_sum.ok()) return Annotate(params_sum.status(), "params sum");
  params_sum_ = *params_sum;
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
  run.model_state_bytes = *std::move(states);
  run.peak_bytes = *std::move(peaks);
  if (rank_ == 0 && !config_.summary_out.empty()) {
    if (absl::Status s = WriteSummary(run, config_.summary_out); !s.ok()) return s;
  }
  const bool per_rank = config_.report.find("{rank}") != std::string::npos;
  if (!config_.report.empty() && (per_rank || rank_ == 0)) {
    const std::string path = absl::StrReplaceAll(config_.report, {{"{rank}", absl::StrCat(rank_)}});
    if (absl::Status s = WriteReport(run, path); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Worker::Leave() {
  if (absl::Status s = CheckNotAborted(); !s.ok()) return s;
  // No abort can arrive once heartbeats stop.
  client_->StopHeartbeats();
  if (absl::Status s = client_->Leave(); !s.ok()) {
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
  if (rank_ == 0) std::fprintf(stderr, "done: params_sum %.9g\n", params_sum_);
  return absl::OkStatus();
}

// ---- Abort ----

void Worker::OnServerCommand(const absl::StatusOr<v1::HeartbeatResponse>& reply) {
  absl::MutexLock lock(&abort_mu_);
  const std::string in_flight = abortable_engine_ != nullptr ? abortable_engine_->InFlight() : "";
  const std::string during = absl::StrCat(
      "during step ", step_.load(), in_flight.empty() ? "" : absl::StrCat(", in ", in_flight));
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
