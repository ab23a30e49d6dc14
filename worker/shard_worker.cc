// shard_worker: one training process of a zeroshard job.
//
//   shard_worker --server=HOST:PORT --job=ID --world_size=W --model=mlp \
//       --layers=20 --width=2000 --stage=3 --steps=100
//
// Joins the job, gets its rank and the shard plan from the server, bootstraps
// Gloo through the server's KV store, and trains with ZeRO stage 0-3.
// Progress goes to stderr (rank 0); --report writes a JSON summary.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "worker/comm/client_kv_store.h"
#include "common/table.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"
#include "common/plan/plan_codec.h"
#include "worker/checkpoint/shard_checkpoint.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/training_task.h"
#include "worker/zero/engine.h"

#ifdef ZEROSHARD_HAVE_CUDA
#include "worker/comm/nccl_communicator.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/cuda_mlp.h"
#endif

extern "C" void openblas_set_num_threads(int num_threads);

ABSL_FLAG(std::string, server, "127.0.0.1:7070", "Shard server HOST:PORT");
ABSL_FLAG(std::string, token_file, "", "File holding the server's bearer token");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA file: connect with TLS and verify the server");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mutual TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM client key (mutual TLS)");
ABSL_FLAG(std::string, job, "", "Job id (letters, digits, '-', '_', '.')");
ABSL_FLAG(int, world_size, 1, "Number of workers in the job");
ABSL_FLAG(std::string, worker_id, "",
          "Stable worker identity; ranks follow sorted worker ids (default: HOST/PID)");
ABSL_FLAG(std::string, host, "127.0.0.1",
          "Address peers reach this worker at; the data plane binds to it");
ABSL_FLAG(bool, shm, true,
          "gloo: gathers and reductions through shared memory when every rank of the job runs "
          "on this host (falls back to TCP otherwise, saying why)");
ABSL_FLAG(int, join_timeout_s, 600, "Give up joining after this many seconds");
ABSL_FLAG(std::string, model, "mlp", "Model: mlp | gpt (GPT-2 decoder on bytes)");
ABSL_FLAG(int, layers, 4, "Layers of the model (Linears of the MLP, blocks of the GPT)");
ABSL_FLAG(int, width, 256, "MLP width (in = out features of every Linear)");
ABSL_FLAG(std::string, activation, "none", "MLP activation between Linears: none|relu|gelu");
ABSL_FLAG(int, heads, 4, "GPT attention heads");
ABSL_FLAG(int, d_model, 128, "GPT embedding width (n_embd)");
ABSL_FLAG(int, context, 64, "GPT sequence length (n_ctx)");
ABSL_FLAG(std::string, task, "addition",
          "GPT data without --data: 'addition' (synthetic multi-digit sums; accuracy shows "
          "learning) or 'reversed-addition' (the sums written least-significant digit first)");
ABSL_FLAG(int, digits, 2, "addition task: operands have up to this many digits (1-9)");
ABSL_FLAG(double, validation_fraction, 0.1, "GPT --data: the tail of the file held out");
ABSL_FLAG(int, val_every, 0, "Validation loss every N steps (0: only at the end)");
ABSL_FLAG(int, val_batches, 4, "Validation batches per rank per evaluation");
ABSL_FLAG(int, sample, 0, "GPT: print a generated text of N bytes at the end");
ABSL_FLAG(int, warmup_steps, 0, "Linear learning-rate warmup steps");
ABSL_FLAG(std::string, lr_schedule, "constant", "constant | cosine (decay to --min_lr)");
ABSL_FLAG(double, min_lr, 0, "Final learning rate of the cosine schedule");
ABSL_FLAG(int, stage, 3, "ZeRO stage 0-3");
ABSL_FLAG(int, steps, 10, "Optimizer steps (the total, counting resumed ones)");
ABSL_FLAG(int, batch, 8, "Rows per rank per micro-batch");
ABSL_FLAG(double, lr, 1e-3, "Learning rate");
ABSL_FLAG(std::string, optimizer, "adam", "adam|adamw|sgd (PyTorch update rules and defaults)");
ABSL_FLAG(double, weight_decay, -1, "Weight decay (default: the optimizer's own)");
ABSL_FLAG(double, momentum, 0, "SGD momentum");
ABSL_FLAG(int, prefetch, 1, "Stage 3: units gathered ahead of use");
ABSL_FLAG(std::string, param_dtype, "f32", "Dtype parameters are gathered in: f32|bf16");
ABSL_FLAG(std::string, reduce_dtype, "f32", "Dtype gradients are reduced in: f32|bf16");
ABSL_FLAG(int, grad_accum, 1, "Micro-batches per optimizer step");
ABSL_FLAG(double, max_grad_norm, 0, "Clip gradients to this global norm (0: off)");
ABSL_FLAG(int64_t, seed, 0, "Seed of the initial parameters and of synthetic data");
ABSL_FLAG(int, threads, 1, "OpenBLAS threads for this worker");
ABSL_FLAG(std::string, init_from, "",
          "Initialize from this safetensors file (each rank reads only its rows)");
ABSL_FLAG(std::string, data, "",
          "safetensors file with x [N, width] and y [N, width] (default: seeded synthetic)");
ABSL_FLAG(std::string, backend, "gloo", "Data plane: gloo (CPUs) | nccl (one GPU per process)");
ABSL_FLAG(int, local_rank, -1,
          "nccl: the GPU of this process (default: 0, i.e. the first of CUDA_VISIBLE_DEVICES)");
ABSL_FLAG(absl::Duration, collective_timeout, absl::Seconds(60),
          "Every collective gives up after this long");
ABSL_FLAG(int64_t, max_unit_bytes, 0, "Plan: largest unit of unlabeled tensors (0: default)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Root of sharded checkpoints: DIR/<job>/step-<N>/rank-<R>-of-<W>.safetensors (shared "
          "with the server's --checkpoint_root, or a local staging dir with "
          "--checkpoint_transport=grpc)");
ABSL_FLAG(int, checkpoint_every, 0, "Checkpoint every K steps (0: never)");
ABSL_FLAG(bool, checkpoint_at_end, false, "Checkpoint after the last step");
ABSL_FLAG(bool, save_optimizer, true, "Save the optimizer state (Adam moments, step)");
ABSL_FLAG(std::string, checkpoint_transport, "fs",
          "fs: the server reads the files on a shared filesystem; grpc: stream them to it");
ABSL_FLAG(std::string, resume, "",
          "Resume from this job's checkpoint 'latest' or step N (same world size)");
ABSL_FLAG(std::string, summary_out, "",
          "Rank 0 writes the run's summary here (JSON: model shape, loss first/last, "
          "validation loss, accuracy, sample, memory per rank) and prints it as a table");
ABSL_FLAG(std::string, eval_out, "",
          "After training, rank 0 writes its first validation batch and what the model computed "
          "on it (JSON), for checking the consolidated model in other tools");
ABSL_FLAG(std::string, report, "",
          "Write a JSON report here when done; '{rank}' is replaced by the rank (without it, "
          "rank 0 writes)");

namespace zeroshard {
namespace {

// Set once the engine exists: the heartbeat thread names what was in flight
// when the server aborts the generation.
std::atomic<ZeroEngine*> g_engine{nullptr};
std::atomic<int64_t> g_step{0};
std::atomic<int> g_rank{-1};

[[noreturn]] void Die(const std::string& message, int code = 1) {
  std::fprintf(stderr, "shard_worker%s: %s\n",
               g_rank.load() >= 0 ? absl::StrCat(" rank ", g_rank.load()).c_str() : "",
               message.c_str());
  std::fflush(stderr);
  std::_Exit(code);
}

void DieIfError(const absl::Status& status, const std::string& what) {
  if (!status.ok()) Die(absl::StrCat(what, ": ", status.ToString()));
}

absl::StatusOr<DType> ParseComputeDType(const std::string& flag, const std::string& value) {
  if (value == "f32") return DType::kF32;
  if (value == "bf16") return DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=", value, " is not a dtype: expected f32 or bf16"));
}

absl::Status CommitShardFile(Client* client, int64_t step, const WrittenShard& shard) {
  grpc::ClientContext context;
  client->Prepare(&context, absl::Minutes(5));
  v1::CommitShardRequest request;
  *request.mutable_member() = client->credentials();
  request.set_step(step);
  request.set_file(shard.relative_path);
  request.set_size_bytes(shard.size_bytes);
  for (const auto& [tensor, hex] : shard.checksums) {
    v1::TensorChecksum* c = request.add_checksums();
    c->set_tensor(tensor);
    c->set_xxh64(hex);
  }
  v1::CommitShardResponse response;
  absl::Status s = FromGrpcStatus(client->stub()->CommitShard(&context, request, &response));
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("commit of ", shard.relative_path, ": ",
                                                          s.message()));
  return absl::OkStatus();
}

// Streams a shard file to the server (--checkpoint_transport=grpc).
absl::Status UploadShardFile(Client* client, int64_t step, const std::string& relative,
                             const std::string& path, int64_t size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  grpc::ClientContext context;
  client->Prepare(&context, absl::Hours(1));
  v1::UploadShardResponse response;
  auto stream = client->stub()->UploadShard(&context, &response);
  v1::UploadShardRequest first;
  *first.mutable_member() = client->credentials();
  first.set_step(step);
  first.set_file(relative);
  first.set_size_bytes(size);
  bool ok = stream->Write(first);
  std::vector<char> buffer(1 << 20);  // 1 MiB messages
  while (ok && in) {
    in.read(buffer.data(), buffer.size());
    std::streamsize n = in.gcount();
    if (n <= 0) break;
    v1::UploadShardRequest chunk;
    chunk.set_data(buffer.data(), n);
    ok = stream->Write(chunk);
  }
  stream->WritesDone();
  absl::Status s = FromGrpcStatus(stream->Finish());
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("upload of ", relative, ": ",
                                                          s.message()));
  return absl::OkStatus();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int Main() {
  // ---- Flags ----
  const std::string job = absl::GetFlag(FLAGS_job);
  const int world = absl::GetFlag(FLAGS_world_size);
  if (job.empty()) Die("--job is required");
  const std::string backend = absl::GetFlag(FLAGS_backend);
  // --backend=nccl: the engine's buffers on this process's GPU (CudaBackend),
  // gathers and reductions over NCCL, the MLP's kernels on the GPU. The
  // schedule is the same ZeroEngine code as with gloo.
#ifdef ZEROSHARD_HAVE_CUDA
  std::unique_ptr<CudaBackend> cuda_backend;
  const int cuda_device = std::max(0, absl::GetFlag(FLAGS_local_rank));
#endif
  if (backend == "nccl") {
    // Checked before joining, so a misconfigured job fails fast and alone.
#ifdef ZEROSHARD_HAVE_CUDA
    auto created = CudaBackend::Create(cuda_device);
    if (!created.ok()) Die(absl::StrCat("--backend=nccl: ", created.status().message()), 2);
    cuda_backend = std::move(*created);
    if (absl::GetFlag(FLAGS_model) != "mlp") {
      Die("--backend=nccl trains --model=mlp; the GPT's CUDA kernels are built "
          "(worker/cuda/kernels.h) but no device GPT model drives them yet. Use --backend=gloo",
          2);
    }
#else
    Die("--backend=nccl: this shard_worker was built without CUDA, so no CUDA device can be "
        "used; --backend=gloo runs on CPUs",
        2);
#endif
  }
  if (backend != "gloo") {
    Die(absl::StrCat("--backend=", backend, " is unknown: expected gloo or nccl"), 2);
  }
  if (absl::GetFlag(FLAGS_steps) < 0 || absl::GetFlag(FLAGS_batch) < 1) {
    Die("--steps must be >= 0 and --batch >= 1", 2);
  }
  if (absl::GetFlag(FLAGS_threads) < 1) Die("--threads must be >= 1", 2);
  openblas_set_num_threads(absl::GetFlag(FLAGS_threads));
  EngineOptions engine_options;
  engine_options.stage = absl::GetFlag(FLAGS_stage);
  engine_options.prefetch = absl::GetFlag(FLAGS_prefetch);
  engine_options.grad_accum = absl::GetFlag(FLAGS_grad_accum);
  engine_options.collective_timeout = absl::GetFlag(FLAGS_collective_timeout);
  engine_options.optimizer = absl::GetFlag(FLAGS_optimizer);
  engine_options.max_grad_norm = absl::GetFlag(FLAGS_max_grad_norm);
  if (absl::GetFlag(FLAGS_weight_decay) >= 0) {
    engine_options.optimizer_options.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  }
  engine_options.optimizer_options.momentum = absl::GetFlag(FLAGS_momentum);
  auto param_dtype = ParseComputeDType("param_dtype", absl::GetFlag(FLAGS_param_dtype));
  auto reduce_dtype = ParseComputeDType("reduce_dtype", absl::GetFlag(FLAGS_reduce_dtype));
  DieIfError(param_dtype.status(), "bad flag");
  DieIfError(reduce_dtype.status(), "bad flag");
  engine_options.param_dtype = *param_dtype;
  engine_options.reduce_dtype = *reduce_dtype;

  TaskOptions task_options;
  task_options.model = absl::GetFlag(FLAGS_model);
  task_options.layers = absl::GetFlag(FLAGS_layers);
  task_options.width = absl::GetFlag(FLAGS_width);
  task_options.activation = absl::GetFlag(FLAGS_activation);
  task_options.heads = absl::GetFlag(FLAGS_heads);
  task_options.d_model = absl::GetFlag(FLAGS_d_model);
  task_options.context = absl::GetFlag(FLAGS_context);
  task_options.task = absl::GetFlag(FLAGS_task);
  task_options.digits = absl::GetFlag(FLAGS_digits);
  task_options.validation_fraction = absl::GetFlag(FLAGS_validation_fraction);
  task_options.data = absl::GetFlag(FLAGS_data);
  task_options.seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  task_options.batch = absl::GetFlag(FLAGS_batch);
  task_options.grad_accum = absl::GetFlag(FLAGS_grad_accum);
#ifdef ZEROSHARD_HAVE_CUDA
  if (cuda_backend != nullptr) {
    CudaBackend* device = cuda_backend.get();
    engine_options.backend = device;
    task_options.mlp_factory =
        [device](const MlpConfig& config) -> absl::StatusOr<std::unique_ptr<RegressionModel>> {
      auto model = CudaMlpModel::Create(config, device);
      if (!model.ok()) return model.status();
      return std::unique_ptr<RegressionModel>(std::move(*model));
    };
  }
#endif
  auto task = MakeTrainingTask(task_options);
  DieIfError(task.status(), "model");
  Model* const m = (*task)->model();
  const std::string schedule = absl::GetFlag(FLAGS_lr_schedule);
  if (schedule != "constant" && schedule != "cosine") {
    Die(absl::StrCat("--lr_schedule=", schedule, ": expected constant or cosine"), 2);
  }

  // ---- Join ----
  ClientOptions client_options;
  client_options.server = absl::GetFlag(FLAGS_server);
  DieIfError(LoadClientFiles(absl::GetFlag(FLAGS_token_file), absl::GetFlag(FLAGS_tls_ca),
                             absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                             &client_options),
             "client files");
  auto client = Client::Connect(client_options);
  DieIfError(client.status(), "connect");
  std::string worker_id = absl::GetFlag(FLAGS_worker_id);
  if (worker_id.empty()) {
    char hostname[256] = {0};
    gethostname(hostname, sizeof(hostname) - 1);
    worker_id = absl::StrCat(hostname, "/", getpid());
  }
  auto joined = (*client)->Join(job, world, worker_id, absl::GetFlag(FLAGS_host),
                                absl::Seconds(absl::GetFlag(FLAGS_join_timeout_s)));
  DieIfError(joined.status(), "join");
  const int rank = joined->rank;
  g_rank = rank;
  (*client)->StartHeartbeats([](absl::StatusOr<v1::HeartbeatResponse> reply) {
    ZeroEngine* engine = g_engine.load();
    std::string in_flight = engine ? engine->InFlight() : "";
    std::string during = absl::StrCat(
        "during step ", g_step.load(),
        in_flight.empty() ? "" : absl::StrCat(", in ", in_flight));
    if (reply.ok()) {
      Die(absl::StrCat("aborting ", during, ": ", reply->reason()), 3);
    }
    Die(absl::StrCat("heartbeats refused ", during, ": ", reply.status().ToString()), 3);
  });

  // ---- Plan ----
  PlanOptions plan_options;
  plan_options.max_unit_bytes = absl::GetFlag(FLAGS_max_unit_bytes);
  auto planned = (*client)->PlanShards(m->Spec(), plan_options, world);
  DieIfError(planned.status(), "plan");
  ShardPlan plan = *std::move(planned);

  // ---- Data plane: gathers, reductions (Gloo, or NCCL on GPUs) and a
  // small Gloo context for host-side metrics ----
  ClientKvStore store(client->get());
  GlooCommunicator::Options gloo;
  gloo.hostname = absl::GetFlag(FLAGS_host);
  gloo.connect_timeout = absl::GetFlag(FLAGS_collective_timeout);
  std::unique_ptr<Communicator> gather, reduce;
  nlohmann::json data_plane = nlohmann::json::object();  // for the report
  auto connect = [&](const std::string& tag) -> std::unique_ptr<Communicator> {
#ifdef ZEROSHARD_HAVE_CUDA
    if (cuda_backend != nullptr) {
      auto nccl = NcclCommunicator::Create(&store, rank, world, cuda_device, tag,
                                           absl::GetFlag(FLAGS_collective_timeout));
      DieIfError(nccl.status(), absl::StrCat("nccl bootstrap (", tag, ")"));
      data_plane[tag] = {{"transport", "nccl"}};
      return std::move(*nccl);
    }
#endif
    GlooCommunicator::Options options = gloo;
    options.shared_memory = absl::GetFlag(FLAGS_shm);
    auto created = GlooCommunicator::Create(&store, rank, world, tag, options);
    DieIfError(created.status(), absl::StrCat("gloo bootstrap (", tag, ")"));
    data_plane[tag] = {{"transport", (*created)->transport()},
                       {"note", (*created)->transport_note()},
                       {"shm_segment_bytes", (*created)->shm_segment_bytes()}};
    if (rank == 0 && world > 1) {
      std::fprintf(stderr, "data plane (%s): %s, %s\n", tag.c_str(),
                   (*created)->transport() == "shm" ? "shared memory" : "TCP",
                   (*created)->transport_note().c_str());
    }
    return std::move(*created);
  };
  gather = connect("gather");
  reduce = connect("reduce");
  // Host-side metrics only: small, so TCP.
  GlooCommunicator::Options aux_options = gloo;
  aux_options.shared_memory = false;
  auto aux = GlooCommunicator::Create(&store, rank, world, "aux", aux_options);
  DieIfError(aux.status(), "gloo bootstrap (aux)");

  auto engine = ZeroEngine::Create(m, plan, gather.get(), reduce.get(), aux->get(),
                                   engine_options);
  DieIfError(engine.status(), "engine");
  ZeroEngine& e = **engine;
  g_engine = engine->get();

  // ---- Initial state: a seed, a consolidated file, or this job's checkpoint ----
  const uint64_t seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  const std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  std::unique_ptr<CheckpointReader> restore;
  const std::string resume = absl::GetFlag(FLAGS_resume);
  if (!resume.empty() && !absl::GetFlag(FLAGS_init_from).empty()) {
    Die("--resume and --init_from are exclusive", 2);
  }
  if (!resume.empty()) {
    if (checkpoint_dir.empty()) Die("--resume needs --checkpoint_dir", 2);
    int64_t step = -1;
    if (resume == "latest") {
      step = LatestCompleteStep(checkpoint_dir, job);
      if (step < 0) {
        Die(absl::StrCat("--resume=latest: no complete checkpoint of job '", job, "' under ",
                         checkpoint_dir));
      }
    } else if (!absl::SimpleAtoi(resume, &step) || step < 0) {
      Die(absl::StrCat("--resume=", resume, ": expected 'latest' or a step number"), 2);
    }
    std::string step_dir = absl::StrCat(checkpoint_dir, "/", CheckpointStepDir(job, step));
    std::string manifest = absl::StrCat(checkpoint_dir, "/", CheckpointManifestPath(job, step));
    if (access(manifest.c_str(), F_OK) != 0) {
      Die(absl::StrCat("--resume=", resume, ": step ", step, " of job '", job,
                       "' is not a complete checkpoint (no ", manifest, ")"));
    }
    auto reader = CheckpointReader::OpenStep(step_dir, CheckpointShardFileName(rank, world));
    DieIfError(reader.status(), "--resume");
    restore = std::move(*reader);
  } else if (!absl::GetFlag(FLAGS_init_from).empty()) {
    auto reader = CheckpointReader::OpenFile(absl::GetFlag(FLAGS_init_from));
    DieIfError(reader.status(), "--init_from");
    restore = std::move(*reader);
  }
  int start_step = 0;
  if (restore == nullptr) {
    DieIfError(e.Initialize([&](const TensorSpec& t, int64_t begin, int64_t end, float* out) {
                 m->InitRows(t, begin, end, seed, out);
                 return absl::OkStatus();
               }),
               "initialize");
  } else {
    CheckpointReader* r = restore.get();
    auto rows = [r](CheckpointReader::Kind kind) {
      return [r, kind](const TensorSpec& t, int64_t begin, int64_t end, float* out) {
        return r->ReadRows(kind, t, begin, end, out);
      };
    };
    DieIfError(e.Initialize(rows(CheckpointReader::Kind::kParams)),
               absl::StrCat("load parameters from ", r->source()));
    bool has_moments = engine_options.optimizer != "sgd" ||
                       engine_options.optimizer_options.momentum > 0;
    if (r->has_optimizer_state() && has_moments) {
      DieIfError(e.InitializeMoment(ZeroEngine::Moment::kExpAvg,
                                    rows(CheckpointReader::Kind::kExpAvg)),
                 absl::StrCat("load exp_avg from ", r->source()));
      if (engine_options.optimizer != "sgd") {
        DieIfError(e.InitializeMoment(ZeroEngine::Moment::kExpAvgSq,
                                      rows(CheckpointReader::Kind::kExpAvgSq)),
                   absl::StrCat("load exp_avg_sq from ", r->source()));
      }
      if (r->optimizer_step() >= 0) e.set_optimizer_step(r->optimizer_step());
    } else if (rank == 0) {
      std::fprintf(stderr, "note: %s has no optimizer state; moments start at zero\n",
                   r->source().c_str());
    }
    if (r->step() > 0) start_step = static_cast<int>(r->step());
    if (rank == 0) {
      std::fprintf(stderr, "restored %s (step %d)\n", r->source().c_str(), start_step);
    }
  }
  restore.reset();


  // ---- Train ----
  const int steps = absl::GetFlag(FLAGS_steps);
  const int grad_accum = engine_options.grad_accum;
  std::vector<double> losses, step_ms, val_losses;
  std::vector<StepTimes> step_times;
  double tokens_per_second_sum = 0;
  Evaluation last_eval;
  auto learning_rate = [&](int step) {
    const double lr = absl::GetFlag(FLAGS_lr);
    const int warmup = absl::GetFlag(FLAGS_warmup_steps);
    if (step < warmup) return lr * (step + 1) / warmup;
    if (schedule == "constant") return lr;
    const double min_lr = absl::GetFlag(FLAGS_min_lr);
    double progress = double(step - warmup) / std::max(1, steps - warmup);
    return min_lr + 0.5 * (lr - min_lr) * (1 + std::cos(M_PI * std::min(1.0, progress)));
  };
  auto evaluate = [&](int completed) {
    auto eval = (*task)->Evaluate(e, rank, world, absl::GetFlag(FLAGS_val_batches));
    DieIfError(eval.status(), "validation");
    last_eval = *eval;
    val_losses.push_back(eval->loss);
    if (rank == 0) {
      std::fprintf(stderr, "step %d  val_loss %.4f%s\n", completed, eval->loss,
                   eval->accuracy >= 0
                       ? absl::StrFormat("  accuracy %.1f%% (after another line %.1f%%)",
                                         100 * eval->accuracy, 100 * eval->accuracy_in_context)
                             .c_str()
                       : "");
    }
  };
  CollectiveBytes comm_before = gather->bytes_sent();
  CollectiveBytes reduce_before = reduce->bytes_sent();
  if (rank == 0) {
    std::fprintf(stderr,
                 "job %s: %d ranks, stage %d, %zu units, plan %s, model %lld parameters\n",
                 job.c_str(), world, engine_options.stage, plan.units.size(), plan.hash.c_str(),
                 static_cast<long long>([&] {
                   int64_t n = 0;
                   for (const auto& t : m->Spec().tensors) n += t.Elements();
                   return n;
                 }()));
  }
  // Checkpoints: the snapshot is the pause; the write and the commit run on
  // their own thread, one checkpoint in flight at a time.
  const int checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  const bool checkpoint_at_end = absl::GetFlag(FLAGS_checkpoint_at_end);
  const std::string transport = absl::GetFlag(FLAGS_checkpoint_transport);
  if ((checkpoint_every > 0 || checkpoint_at_end) && checkpoint_dir.empty()) {
    Die("--checkpoint_every / --checkpoint_at_end need --checkpoint_dir", 2);
  }
  if (transport != "fs" && transport != "grpc") {
    Die(absl::StrCat("--checkpoint_transport=", transport, ": expected fs or grpc"), 2);
  }
  TaskThread checkpoint_thread("checkpoint");
  std::vector<double> pause_ms;
  Client* c = client->get();
  auto checkpoint = [&](int completed_steps) {
    absl::Time start = absl::Now();
    DieIfError(checkpoint_thread.Drain(), "previous checkpoint");
    ShardIdentity id{job, completed_steps, rank, world, joined->generation, plan.hash};
    auto snapshot = SnapshotShard(e, id, engine_options.optimizer,
                                  absl::GetFlag(FLAGS_save_optimizer));
    DieIfError(snapshot.status(), "checkpoint snapshot");
    pause_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    auto shared = std::make_shared<ShardSnapshot>(std::move(*snapshot));
    checkpoint_thread.Submit([shared, c, checkpoint_dir, transport]() -> absl::Status {
      auto written = WriteShard(*shared, checkpoint_dir);
      if (!written.ok()) return written.status();
      if (transport == "grpc") {
        absl::Status s = UploadShardFile(c, shared->id.step, written->relative_path,
                                         written->path, written->size_bytes);
        if (!s.ok()) return s;
      }
      return CommitShardFile(c, shared->id.step, *written);
    });
  };
  for (int step = start_step; step < steps; ++step) {
    g_step = step;
    absl::Time start = absl::Now();
    for (int micro = 0; micro < grad_accum; ++micro) {
      DieIfError((*task)->SetTrainBatch(step, micro, rank, world), "data");
      auto loss = e.ForwardBackward(micro + 1 == grad_accum);
      DieIfError(loss.status(), absl::StrCat("step ", step));
    }
    const double lr = learning_rate(step);
    auto stats = e.Step(lr);
    DieIfError(stats.status(), absl::StrCat("step ", step, " optimizer"));
    double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    auto mean = e.MeanOverRanks(stats->loss, "the step's loss");
    DieIfError(mean.status(), "loss");
    losses.push_back(*mean);
    step_ms.push_back(ms);
    step_times.push_back(stats->times);
    (*client)->ReportProgress(Progress{step + 1, *mean, e.memory().total(), e.collective_seq()});
    const double items_per_second =
        (*task)->ItemsPerMicroBatch() * grad_accum * world / (ms / 1000.0);
    tokens_per_second_sum += items_per_second;
    if (rank == 0) {
      std::fprintf(stderr,
                   "step %d/%d  loss %.6f  lr %.2e  grad_norm %.4f  %.1f ms  %.0f %s/s  "
                   "mem/rank %.1f MiB\n",
                   step + 1, steps, *mean, lr, stats->grad_norm, ms, items_per_second,
                   task_options.model == "gpt" ? "tokens" : "rows",
                   e.memory().peak_total() / 1048576.0);
    }
    const int val_every = absl::GetFlag(FLAGS_val_every);
    if (val_every > 0 && (step + 1) % val_every == 0 && step + 1 < steps) evaluate(step + 1);
    if ((checkpoint_every > 0 && (step + 1) % checkpoint_every == 0) ||
        (checkpoint_at_end && step + 1 == steps)) {
      checkpoint(step + 1);
    }
  }
  DieIfError(checkpoint_thread.Drain(), "checkpoint");
  // Training traffic only: evaluation and sampling below move bytes too.
  const CollectiveBytes gather_after = gather->bytes_sent();
  const CollectiveBytes reduce_after = reduce->bytes_sent();
  if (task_options.model == "gpt" || absl::GetFlag(FLAGS_val_every) > 0) evaluate(steps);
  std::string sample;
  if (absl::GetFlag(FLAGS_sample) > 0) {
    auto text = (*task)->Sample(e, absl::GetFlag(FLAGS_sample));
    DieIfError(text.status(), "sample");
    sample = *text;
    if (rank == 0) std::fprintf(stderr, "sample:\n%s\n", sample.c_str());
  }
  if (!absl::GetFlag(FLAGS_eval_out).empty()) {
    auto record = (*task)->EvalRecord(e, rank, world);
    DieIfError(record.status(), "--eval_out");
    if (rank == 0) {
      std::ofstream file(absl::GetFlag(FLAGS_eval_out));
      file << *record << "\n";
      if (!file) Die(absl::StrCat("cannot write --eval_out ", absl::GetFlag(FLAGS_eval_out)));
    }
  }
  auto params_sum = e.ParamsSum();
  DieIfError(params_sum.status(), "params sum");
  auto peaks = e.GatherOverRanks(static_cast<double>(e.memory().peak_total()));
  DieIfError(peaks.status(), "memory summary");
  auto states = e.GatherOverRanks(static_cast<double>(e.memory().model_state()));
  DieIfError(states.status(), "memory summary");
  int64_t parameters = 0;
  for (const UnitLayout& u : e.units()) parameters += u.flat_elements;
  if (rank == 0 && !absl::GetFlag(FLAGS_summary_out).empty()) {
    nlohmann::ordered_json summary;
    if (task_options.model == "gpt") {
      summary["n_layer"] = task_options.layers;
      summary["n_head"] = task_options.heads;
      summary["n_embd"] = task_options.d_model;
      summary["n_ctx"] = task_options.context;
      summary["vocab_size"] = 256;
    }
    summary["model"] = (*task)->Describe();
    summary["parameters"] = parameters;
    summary["world_size"] = world;
    summary["stage"] = engine_options.stage;
    summary["steps"] = steps;
    summary["loss_first"] = losses.empty() ? 0.0 : losses.front();
    summary["loss_last"] = losses.empty() ? 0.0 : losses.back();
    summary["val_loss"] = last_eval.loss;
    summary["accuracy"] = last_eval.accuracy >= 0 ? nlohmann::ordered_json(last_eval.accuracy)
                                                  : nlohmann::ordered_json();
    summary["accuracy_in_context"] = last_eval.accuracy_in_context >= 0
                                         ? nlohmann::ordered_json(last_eval.accuracy_in_context)
                                         : nlohmann::ordered_json();
    summary["sample"] = sample;
    summary["step_time_ms_median"] = Median(step_ms);
    summary["items_per_second"] =
        step_ms.empty() ? 0.0 : tokens_per_second_sum / static_cast<double>(step_ms.size());
    // Stage 0 keeps fp32 params, grads and Adam moments whole: 16 bytes per parameter.
    summary["stage0_model_state_bytes"] = 16 * parameters;
    nlohmann::ordered_json per_rank = nlohmann::ordered_json::array();
    for (int r = 0; r < world; ++r) {
      per_rank.push_back({{"rank", r},
                          {"model_state_bytes", static_cast<int64_t>((*states)[r])},
                          {"peak_bytes", static_cast<int64_t>((*peaks)[r])}});
    }
    summary["memory_per_rank"] = per_rank;
    // For people: the same as a table.
    Table table({"", ""});
    table.AddRow({"model", (*task)->Describe()});
    table.AddRow({"parameters", absl::StrCat(parameters)});
    table.AddRow({"ranks / ZeRO stage", absl::StrCat(world, " / ", engine_options.stage)});
    table.AddRow({"loss first -> last",
                  absl::StrFormat("%.4f -> %.4f", summary["loss_first"].get<double>(),
                                  summary["loss_last"].get<double>())});
    table.AddRow({"validation loss", absl::StrFormat("%.4f", last_eval.loss)});
    if (last_eval.accuracy >= 0) {
      // Greedy answers to held-out problems asked at the start of a sequence.
      table.AddRow({"accuracy (held-out sums, as a first line)",
                    absl::StrFormat("%.1f%%", 100 * last_eval.accuracy)});
      table.AddRow({"accuracy (held-out sums, after another line)",
                    absl::StrFormat("%.1f%%", 100 * last_eval.accuracy_in_context)});
    }
    table.AddRow({"step time (median)", absl::StrFormat("%.1f ms", Median(step_ms))});
    table.AddRow({task_options.model == "gpt" ? "tokens/s" : "rows/s",
                  absl::StrFormat("%.0f", summary["items_per_second"].get<double>())});
    for (int r = 0; r < world; ++r) {
      table.AddRow({absl::StrCat("rank ", r, " memory"),
                    absl::StrCat(HumanBytes((*states)[r]), " model state (stage 0 would need ",
                                 HumanBytes(16.0 * parameters), "), ", HumanBytes((*peaks)[r]),
                                 " peak")});
    }
    std::fprintf(stderr, "\nsummary\n%s", table.ToString().c_str());
    std::ofstream file(absl::GetFlag(FLAGS_summary_out));
    // A sample may hold bytes that are not UTF-8: replaced, not fatal.
    file << summary.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace)
         << "\n";
    if (!file) Die(absl::StrCat("cannot write --summary_out ", absl::GetFlag(FLAGS_summary_out)));
  }

  // ---- Report ----
  std::string report = absl::GetFlag(FLAGS_report);
  bool per_rank = report.find("{rank}") != std::string::npos;
  if (!report.empty() && (per_rank || rank == 0)) {
    report = absl::StrReplaceAll(report, {{"{rank}", absl::StrCat(rank)}});
    nlohmann::ordered_json out;
    out["rank"] = rank;
    out["world_size"] = world;
    out["stage"] = engine_options.stage;
    out["steps"] = steps;
    out["losses"] = losses;
    out["params_sum"] = *params_sum;
    out["step_time_ms_median"] = Median(step_ms);
    // Medians over steps of where the compute thread's time went.
    auto median_of = [&](double StepTimes::*field) {
      std::vector<double> values;
      for (const StepTimes& t : step_times) values.push_back(t.*field);
      return Median(values);
    };
    out["step_breakdown_ms"] = {{"forward", median_of(&StepTimes::forward_ms)},
                                {"backward", median_of(&StepTimes::backward_ms)},
                                {"gather_wait", median_of(&StepTimes::gather_wait_ms)},
                                {"reduce_wait", median_of(&StepTimes::reduce_wait_ms)},
                                {"optimizer", median_of(&StepTimes::optimizer_ms)},
                                {"param_sync", median_of(&StepTimes::param_sync_ms)}};
    nlohmann::ordered_json memory;
    const MemoryTracker& mt = e.memory();
    for (int c = 0; c < static_cast<int>(MemoryCategory::kCount); ++c) {
      auto category = static_cast<MemoryCategory>(c);
      memory[MemoryCategoryName(category)] = mt.current(category);
      memory[absl::StrCat(MemoryCategoryName(category), "_peak")] = mt.peak(category);
    }
    memory["model_state_bytes"] = mt.model_state();
    memory["peak_bytes"] = mt.peak_total();
    out["memory"] = memory;
    const CollectiveBytes& g = gather_after;
    const CollectiveBytes& r = reduce_after;
    out["comm_bytes"] = {
        {"all_gather", (g.all_gather - comm_before.all_gather) + (r.all_gather - reduce_before.all_gather)},
        {"reduce_scatter",
         (g.reduce_scatter - comm_before.reduce_scatter) + (r.reduce_scatter - reduce_before.reduce_scatter)},
        {"all_reduce", (g.all_reduce - comm_before.all_reduce) + (r.all_reduce - reduce_before.all_reduce)},
        {"broadcast", (g.broadcast - comm_before.broadcast) + (r.broadcast - reduce_before.broadcast)}};
    out["plan_hash"] = plan.hash;
    out["data_plane"] = data_plane;
    out["checkpoint_pause_ms"] = pause_ms;
    out["model"] = (*task)->Describe();
    if (task_options.model == "gpt") {
      out["n_layer"] = task_options.layers;
      out["n_head"] = task_options.heads;
      out["n_embd"] = task_options.d_model;
      out["n_ctx"] = task_options.context;
      out["vocab_size"] = 256;
    }
    out["val_losses"] = val_losses;
    out["val_loss"] = last_eval.loss;
    if (last_eval.accuracy >= 0) out["accuracy"] = last_eval.accuracy;
    if (last_eval.accuracy_in_context >= 0) {
      out["accuracy_in_context"] = last_eval.accuracy_in_context;
    }
    out["sample"] = sample;
    out["items_per_second"] =
        step_ms.empty() ? 0.0 : tokens_per_second_sum / static_cast<double>(step_ms.size());
    out["largest_unit_bytes"] = e.largest_unit_elements() * 4;
    int64_t parameters = 0, shard_elements = 0;
    for (const UnitLayout& u : e.units()) {
      parameters += u.flat_elements;
      shard_elements += u.chunk_elements;
    }
    out["parameters"] = parameters;          // Ψ
    out["shard_elements"] = shard_elements;  // this rank's chunks: Ψ/W + padding
    out["prefetch"] = engine_options.prefetch;
    std::ofstream file(report);
    file << out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!file) Die(absl::StrCat("cannot write --report ", report));
  }
  g_engine = nullptr;
  (*client)->StopHeartbeats();
  DieIfError((*client)->Leave(), "leave");
  if (rank == 0) std::fprintf(stderr, "done: params_sum %.9g\n", *params_sum);
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("zeroshard worker: joins a job and trains with ZeRO stage 0-3");
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
