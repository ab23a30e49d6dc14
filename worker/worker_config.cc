#include "worker/worker_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "client/connection_flags.h"
#include "common/hf_gpt2_config.h"
#include "common/job_id.h"
#include "common/local_address.h"
#include "common/server_list.h"
#include "worker/comm/gloo_port_range.h"
#include "worker/outer_sync_config.h"
#include "worker/zero/optimizer.h"

ABSL_FLAG(std::string, job, "", "Job id (letters, digits, '-', '_', '.')");
ABSL_FLAG(int, world_size, 1, "Number of workers in the job");
ABSL_FLAG(std::string, worker_id, "",
          "Stable worker identity; ranks follow sorted worker ids (default: HOST/PID)");
ABSL_FLAG(std::string, host, "",
          "Address peers reach this worker at; the data plane binds to it (default: this "
          "machine's address on its route to --server)");
ABSL_FLAG(std::string, agent, "",
          "The node agent of this host (shard_agent --listen), e.g. "
          "unix:/run/zeroshard/agent.sock: heartbeats, joins and bootstrap StoreWaits go through "
          "it, one stream per host to the server; straight to the server while it does not "
          "answer. Empty: none");
ABSL_FLAG(std::string, data_plane_ports, "",
          "LO-HI: the data plane's TCP connections are made to ports of this range of each "
          "worker's --host (for a firewall between hosts; each rank needs world_size - 1 free "
          "ports of it while it connects, shared by the ranks of a host); empty: ephemeral "
          "ports");
ABSL_FLAG(bool, shm, true,
          "gloo: gathers and reductions through shared memory when every rank of the job runs "
          "on this host (falls back to TCP otherwise, saying why)");
ABSL_FLAG(bool, two_level, false,
          "Gathers and reductions in two levels when the job's ranks share hosts: inside each "
          "host (shared memory), then across hosts along one TCP ring per local rank, so each "
          "byte crosses the network once per host (needs the same number of ranks on every "
          "host; otherwise, and on one host, the usual flat transport). Results equal the flat "
          "ring's up to the order of additions");
ABSL_FLAG(std::string, shard_group_size, "",
          "Hybrid sharding (HSDP): parameters, gradients and optimizer state sharded inside "
          "groups of G consecutive ranks and replicated across the W / G groups; gradients "
          "reduce-scattered in the group, then averaged over the replicas. G (dividing the "
          "world size), or 'host': the ranks of one host (each host's ranks consecutive). "
          "Empty or 0: shard over every rank. Stages 1-3");
ABSL_FLAG(std::string, secondary_shard_group_size, "",
          "hpZ (ZeRO++): keep a secondary copy of the parameters sharded over groups of H "
          "consecutive ranks, taken from each forward gather and refreshed after every step, "
          "and gather the backward's parameters from it inside the group only. H (dividing "
          "the world size, smaller than the shard groups), or 'host': the ranks of one host. "
          "Costs params/H f32 per rank. Stage 3");
ABSL_FLAG(int, join_timeout_s, 600, "Give up joining after this many seconds");
ABSL_FLAG(int, max_recoveries, 10,
          "Fault tolerance: after a peer dies, re-join the job's next generation and resume "
          "(from in-memory snapshots, else the latest disk checkpoint) up to this many times; "
          "0: exit 3 as soon as the generation ends");
ABSL_FLAG(absl::Duration, rejoin_timeout, absl::Minutes(5),
          "Fault tolerance: how long a re-join waits for the next generation to form (the "
          "replacement of a dead worker, or the shrink after --rejoin_grace)");
ABSL_FLAG(int, min_world_size, 0,
          "Fault tolerance: with no replacement within --rejoin_grace, go on with the survivors "
          "when there are at least this many (0: never shrink; wait for a replacement)");
ABSL_FLAG(bool, keep_global_batch, true,
          "Fault tolerance: after a shrink (--min_world_size), the survivors share the step's "
          "--world_size x --grad_accum micro-batches, so each step keeps the global batch, the "
          "samples, their order and the loss scaling of --world_size ranks (when the survivors "
          "do not divide them, some train one micro-batch more a step and the others wait); "
          "when false, each rank keeps its per-rank batch and the global batch shrinks");
ABSL_FLAG(absl::Duration, rejoin_grace, absl::Seconds(30),
          "Fault tolerance: how long the server waits for a replacement before shrinking the "
          "job to its survivors (with --min_world_size)");
ABSL_FLAG(int, snapshot_every, 20,
          "Fault tolerance: every N steps each rank copies its shard state to host memory and "
          "to its buddy rank (in HSDP: also its replica's run, see --snapshot_buddy), in the "
          "background (0: off; recovery then uses disk checkpoints)");
ABSL_FLAG(std::string, snapshot_buddy, "auto",
          "Fault tolerance: auto (in HSDP with 2 or more replicas a rank's snapshot also holds "
          "its replica's run of the shard, and no copy goes to a buddy: a lost rank comes back "
          "from its replica) | always (a buddy copy in every layout; in HSDP it also survives "
          "the loss of every replica of a shard whose buddies live)");
ABSL_FLAG(std::string, model, "mlp", "Model: mlp | gpt (GPT-2 decoder)");
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
ABSL_FLAG(std::string, loss_on, "all",
          "GPT: the tokens the loss (training and validation) covers: all | answers (addition "
          "tasks: only each line's answer, the text after '=' and its newline)");
ABSL_FLAG(double, validation_fraction, 0.1, "GPT --data: the tail of the file held out");
ABSL_FLAG(int, val_every, 0, "Validation loss every N steps (0: only at the end)");
ABSL_FLAG(int, val_batches, 4, "Validation batches per rank per evaluation");
ABSL_FLAG(int, sample, 0,
          "GPT: print a generated text of N bytes at the end (--loss_on=answers: up to the "
          "end of the answer to its prompt)");
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
ABSL_FLAG(std::string, param_dtype, "f32",
          "Dtype parameters are gathered in: f32|bf16 (with --backend=nccl also the GPT's "
          "matrix-product operands, accumulated in f32)");
ABSL_FLAG(std::string, reduce_dtype, "f32",
          "Dtype gradients are reduced in: f32|bf16|int8 (int8: block-quantized on the wire, "
          "summed in f32; docs/quantized_comm.md)");
ABSL_FLAG(std::string, int8_reduce_rounding, "nearest",
          "--reduce_dtype=int8: how gradients round to the int8 grid: nearest (a gradient "
          "below half its block's quantum becomes 0) | stochastic (unbiased: it counts on "
          "average; costs CPU). docs/quantized_comm.md");
ABSL_FLAG(bool, replica_thread, true,
          "With --shard_group_size: the replicas' all-reduce on a thread of its own, "
          "overlapping the group's next reduce-scatters (false: after each, on the reduce "
          "thread; for comparisons)");
ABSL_FLAG(std::string, gather_dtype, "f32",
          "Stage 3: dtype parameter gathers travel in: f32 (i.e. --param_dtype)|int8 "
          "(block-quantized, dequantized after the gather; the master shard stays f32)");
ABSL_FLAG(std::string, packed_collectives, "auto",
          "Stage 3's gathers, stages 1-2's parameter sync and stages 1-3's reduce-scatters of "
          "whole units through one packed buffer (one collective and one conversion pass each "
          "way) instead of block by block: "
          "auto (on with --backend=nccl, off on CPUs, where Gloo and shared memory move blocks "
          "in place)|on|off. The same bits either way");
ABSL_FLAG(int, grad_accum, 1, "Micro-batches per optimizer step");
ABSL_FLAG(double, max_grad_norm, 0, "Clip gradients to this global norm (0: off)");
ABSL_FLAG(std::string, on_nonfinite, "stop",
          "A step whose loss or global gradient norm is NaN, Inf or beyond float32's range is "
          "never applied (every rank knows before any update). stop: every rank exits 1 naming "
          "the step, the quantity, the first rank and its data rows | skip: drop the step and "
          "go on (docs/numerics.md)");
ABSL_FLAG(int, max_skipped_steps, 10,
          "--on_nonfinite=skip: stop after this many non-finite steps in a row");
ABSL_FLAG(int, replica_check_every, 0,
          "HSDP (--shard_group_size < world): every N steps the replicas of each shard compare "
          "an XXH3 of their master shard (8 bytes on the step's verdict all-gather); when they "
          "differ, every rank rewinds to the last in-memory snapshot they agreed on and names "
          "the corrupted rank (a second time: its host is evicted), or stops without one "
          "(0: off; docs/numerics.md)");
ABSL_FLAG(std::string, testing_corrupt, "",
          "Test-only: RANK:STEP[:BIT][,...] flips exponent bit BIT (23-30, default 23: the value "
          "doubles or halves) of one parameter of RANK's master shard after STEP's update, once "
          "per entry (what --replica_check_every and --loss_spike_zscore detect)");
ABSL_FLAG(double, loss_spike_zscore, 0,
          "A step whose mean loss is more than Z standard deviations above the last 32 steps' "
          "is bad: every rank rewinds to the last in-memory snapshot (--snapshot_every) and "
          "re-runs; a spike that comes back is the data's (--on_nonfinite: skip or stop), one "
          "that does not was transient (0: off; docs/numerics.md)");
ABSL_FLAG(int64_t, seed, 0, "Seed of the initial parameters and of synthetic data");
ABSL_FLAG(int, threads, 1,
          "Compute threads of this worker (its kernels and OpenBLAS, one OpenMP pool)");
ABSL_FLAG(double, peak_flops, 0,
          "This rank's peak compute in FLOP/s, for MFU (docs/goodput.md): e.g. 9.89e14 for an "
          "H100's dense bf16. 0: measured once at start with an f32 GEMM at --threads (CPU), "
          "or unknown with --backend=nccl (no MFU)");
ABSL_FLAG(std::string, init_from, "",
          "Initialize from this safetensors file, or (GPT) a Hugging Face GPT-2 directory: "
          "config.json (which sets --layers, --heads, --d_model, --vocab and the positions; "
          "flags that disagree are an error) and model.safetensors or shards with "
          "model.safetensors.index.json. Each rank reads only its rows");
ABSL_FLAG(std::string, data, "",
          "MLP: safetensors file with x [N, width] and y [N, width] (default: seeded synthetic). "
          "GPT: llm.c token shards (a glob, or a path ending in .bin; with --val_data) or a text "
          "file's bytes (default: the --task)");
ABSL_FLAG(std::string, val_data, "",
          "GPT token shards: the validation shards (a glob); the validation loss is the mean "
          "over consecutive windows of --context + 1 tokens (stride --context) from their start");
ABSL_FLAG(int64_t, val_tokens, 0,
          "GPT token shards: validation tokens the validation loss covers (0: every whole window "
          "of --val_data)");
ABSL_FLAG(int64_t, vocab, 0,
          "GPT vocabulary: rows of the embedding and the tied LM head (at most 65536 with token "
          "shards; 0: 256 for bytes, 50257 for token shards, or the --init_from config's)");
ABSL_FLAG(std::string, backend, "gloo", "Data plane: gloo (CPUs) | nccl (one GPU per process)");
ABSL_FLAG(int, local_rank, -1,
          "nccl: the GPU of this process (default -1: the first of CUDA_VISIBLE_DEVICES); "
          "refused with gloo");
ABSL_FLAG(std::string, gpu_attention, "auto",
          "nccl, GPT: the attention kernel: auto (bf16: cuDNN's fused attention when libcudnn "
          "loads, else flash; f32: flash) | cudnn (bf16 only) | flash (ours: on tensor cores "
          "where they take the head size, bf16 up to 128 and f32 as 3xTF32 up to 64, else on "
          "CUDA cores) | flash_tc (ours on tensor cores only; refused past those head sizes) | "
          "naive (f32 only; stores T x T weights: a reference)");
ABSL_FLAG(bool, tf32, false,
          "nccl, GPT with --param_dtype=f32: matrix products as TF32 on tensor cores (faster, "
          "10-bit mantissa operands; off as in PyTorch)");
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
ABSL_FLAG(int, max_pending_commits, 8,
          "Checkpoints written but not yet committed (the server or etcd's quorum out of reach) "
          "that a rank keeps while training goes on; past it the oldest waiting one is dropped "
          "(said on stderr) and its step abandoned once the server answers");
ABSL_FLAG(bool, checkpoint_staging, true,
          "CPU backend: copy the state into a kept host buffer of the shard's size before "
          "writing it, so that training never waits for write(2) (costs that much host memory "
          "per rank); false: write straight from the engine's memory, and the next optimizer "
          "update waits until the kernel holds every value");
ABSL_FLAG(std::string, checkpoint_transport, "fs",
          "fs: the server reads the files on a shared filesystem; grpc: stream them to it");
ABSL_FLAG(std::string, resume, "",
          "Resume from this job's checkpoint 'latest' or step N (same world size)");
ABSL_FLAG(std::string, summary_out, "",
          "Rank 0 writes the run's summary here (JSON: model shape, loss first/last, "
          "validation loss, accuracy, sample, memory per rank) and prints it as a table");
ABSL_FLAG(std::string, eval_out, "",
          "After training, rank 0 writes JSON for checking the consolidated model in other tools: "
          "with token shards the validation loss and its windows; otherwise its first validation "
          "batch and what the model computed on it");
ABSL_FLAG(std::string, report, "",
          "Write a JSON report here when done; '{rank}' is replaced by the rank (without it, "
          "rank 0 writes)");
ABSL_FLAG(int64_t, test_stall_before_gather, 0,
          "Test-only: block before this worker's N-th all-gather of a generation, as a rank "
          "stuck outside a collective (0: off)");
ABSL_FLAG(int, test_step_delay_ms, 0,
          "Test-only: sleep this long at the start of every step, as a straggler (0: off)");
ABSL_FLAG(
    std::vector<std::string>, test_step_delay_ranks, {},
    "Test-only: --test_step_delay_ms on these ranks only (comma-separated; empty: every rank)");
ABSL_FLAG(int, test_step_delay_until, 0,
          "Test-only: --test_step_delay_ms only before this step (0: every step), a transient "
          "straggler");
ABSL_FLAG(std::string, test_hold_data_plane, "",
          "Test-only: after publishing its data-plane addresses, wait until this file exists "
          "(at most --collective_timeout) before connecting to the peers, which keeps the "
          "listening sockets open for a test to connect to ('': off)");

namespace zeroshard {
namespace {

absl::Status Bad(const std::string& message) { return absl::InvalidArgumentError(message); }

absl::StatusOr<DType> ParseComputeDType(const std::string& flag, const std::string& value) {
  if (value == "f32") return DType::kF32;
  if (value == "bf16") return DType::kBF16;
  return Bad(absl::StrCat("--", flag, "=", value, " is not a dtype: expected f32 or bf16"));
}

std::string DefaultWorkerId() {
  char hostname[256] = {0};
  gethostname(hostname, sizeof(hostname) - 1);
  return absl::StrCat(hostname, "/", getpid());
}

absl::Status ReadMembership(WorkerConfig* config) {
  config->job = absl::GetFlag(FLAGS_job);
  if (config->job.empty()) return Bad("--job is required");
  if (absl::Status s = ValidateJobId(config->job); !s.ok()) {
    return Bad(absl::StrCat("--job: ", s.message()));
  }
  config->world_size = absl::GetFlag(FLAGS_world_size);
  if (config->world_size < 1) {
    return Bad(absl::StrCat("--world_size=", config->world_size, ": expected 1 or more"));
  }
  config->worker_id = absl::GetFlag(FLAGS_worker_id);
  if (config->worker_id.empty()) config->worker_id = DefaultWorkerId();
  if (absl::Status s = ValidateWorkerId(config->worker_id); !s.ok()) {
    return Bad(absl::StrCat("--worker_id: ", s.message()));
  }
  config->host = absl::GetFlag(FLAGS_host);
  if (absl::GetFlag(FLAGS_join_timeout_s) < 1) {
    return Bad(absl::StrCat("--join_timeout_s=", absl::GetFlag(FLAGS_join_timeout_s),
                            ": expected 1 or more seconds"));
  }
  config->join_timeout = absl::Seconds(absl::GetFlag(FLAGS_join_timeout_s));
  RecoveryConfig& r = config->recovery;
  r.max_recoveries = absl::GetFlag(FLAGS_max_recoveries);
  if (r.max_recoveries < 0) {
    return Bad(absl::StrCat("--max_recoveries=", r.max_recoveries, ": expected 0 or more"));
  }
  r.rejoin_timeout = absl::GetFlag(FLAGS_rejoin_timeout);
  if (r.rejoin_timeout <= absl::ZeroDuration()) {
    return Bad(absl::StrCat("--rejoin_timeout=", absl::FormatDuration(r.rejoin_timeout),
                            ": expected a positive duration"));
  }
  r.min_world_size = absl::GetFlag(FLAGS_min_world_size);
  if (r.min_world_size < 0 || r.min_world_size > config->world_size) {
    return Bad(absl::StrCat("--min_world_size=", r.min_world_size, ": expected 0..",
                            config->world_size, " (--world_size; 0: never shrink)"));
  }
  r.keep_global_batch = absl::GetFlag(FLAGS_keep_global_batch);
  r.rejoin_grace = absl::GetFlag(FLAGS_rejoin_grace);
  if (r.rejoin_grace < absl::ZeroDuration()) {
    return Bad(absl::StrCat("--rejoin_grace=", absl::FormatDuration(r.rejoin_grace),
                            ": expected a duration >= 0"));
  }
  r.snapshot_every = absl::GetFlag(FLAGS_snapshot_every);
  if (r.snapshot_every < 0) {
    return Bad(absl::StrCat("--snapshot_every=", r.snapshot_every, ": expected 0 or more"));
  }
  const std::string buddy = absl::GetFlag(FLAGS_snapshot_buddy);
  if (buddy != "auto" && buddy != "always") {
    return Bad(absl::StrCat("--snapshot_buddy=", buddy, ": expected auto or always"));
  }
  r.snapshot_buddy_always = buddy == "always";
  return absl::OkStatus();
}

// --backend and the data plane's ports, timeout and threads.
absl::Status ReadDataPlane(WorkerConfig* config) {
  DataPlaneOptions& plane = config->data_plane;
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend == "nccl") {
#ifdef ZEROSHARD_HAVE_CUDA
    plane.backend = DataPlaneBackend::kNccl;
#else
    return Bad(
        "--backend=nccl: this shard_worker was built without CUDA, so no CUDA device can be "
        "used; --backend=gloo runs on CPUs");
#endif
  } else if (backend != "gloo") {
    return Bad(absl::StrCat("--backend=", backend, " is unknown: expected gloo or nccl"));
  }
  const int local_rank = absl::GetFlag(FLAGS_local_rank);
  if (local_rank < -1) {
    return Bad(absl::StrCat("--local_rank=", local_rank,
                            ": expected a GPU index, 0 or more (or -1, the default: the first "
                            "of CUDA_VISIBLE_DEVICES)"));
  }
  if (local_rank >= 0 && backend != "nccl") {
    return Bad(
        absl::StrCat("--local_rank picks this process's GPU (--backend=nccl); drop it "
                     "with --backend=",
                     backend));
  }
  plane.cuda_device = std::max(0, local_rank);
  plane.gpu_attention = absl::GetFlag(FLAGS_gpu_attention);
  plane.tf32 = absl::GetFlag(FLAGS_tf32);
  if (plane.gpu_attention != "auto" && plane.gpu_attention != "cudnn" &&
      plane.gpu_attention != "flash" && plane.gpu_attention != "flash_tc" &&
      plane.gpu_attention != "naive") {
    return Bad(absl::StrCat("--gpu_attention=", plane.gpu_attention,
                            ": expected auto, cudnn, flash, flash_tc or naive"));
  }
  if (backend != "nccl" && (plane.gpu_attention != "auto" || plane.tf32)) {
    return Bad(absl::StrCat(
        plane.tf32 ? "--tf32" : "--gpu_attention",
        " applies to the device GPT (--backend=nccl); drop it with --backend=", backend));
  }
  plane.host = config->host;
  plane.shared_memory = absl::GetFlag(FLAGS_shm);
  plane.two_level = absl::GetFlag(FLAGS_two_level);
  absl::StatusOr<PortRange> ports = ParsePortRange(absl::GetFlag(FLAGS_data_plane_ports));
  if (!ports.ok()) return Bad(std::string(ports.status().message()));
  plane.ports = *ports;
  plane.timeout = absl::GetFlag(FLAGS_collective_timeout);
  if (plane.timeout <= absl::ZeroDuration()) {
    return Bad(absl::StrCat("--collective_timeout=", absl::FormatDuration(plane.timeout),
                            ": expected a positive duration"));
  }
  config->blas_threads = absl::GetFlag(FLAGS_threads);
  if (config->blas_threads < 1) return Bad("--threads must be >= 1");
  config->peak_flops = absl::GetFlag(FLAGS_peak_flops);
  if (!(config->peak_flops >= 0) || std::isinf(config->peak_flops)) {
    return Bad(absl::StrCat("--peak_flops=", config->peak_flops,
                            ": expected this rank's peak FLOP/s (>= 0; 0: measure it)"));
  }
  return absl::OkStatus();
}

// The model and its data.
absl::Status ReadTask(WorkerConfig* config) {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  const std::string model = absl::GetFlag(FLAGS_model);
  TaskOptions& task = config->task;
  task.model = model;
  task.layers = absl::GetFlag(FLAGS_layers);
  task.width = absl::GetFlag(FLAGS_width);
  task.activation = absl::GetFlag(FLAGS_activation);
  task.heads = absl::GetFlag(FLAGS_heads);
  task.d_model = absl::GetFlag(FLAGS_d_model);
  task.context = absl::GetFlag(FLAGS_context);
  task.task = absl::GetFlag(FLAGS_task);
  task.digits = absl::GetFlag(FLAGS_digits);
  task.loss_on = absl::GetFlag(FLAGS_loss_on);
  task.validation_fraction = absl::GetFlag(FLAGS_validation_fraction);
  task.data = absl::GetFlag(FLAGS_data);
  task.val_data = absl::GetFlag(FLAGS_val_data);
  task.val_tokens = absl::GetFlag(FLAGS_val_tokens);
  task.vocab = absl::GetFlag(FLAGS_vocab);
  if (task.vocab < 0) return Bad(absl::StrCat("--vocab=", task.vocab, ": expected 1 or more"));
  task.seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  task.batch = absl::GetFlag(FLAGS_batch);
  task.grad_accum = absl::GetFlag(FLAGS_grad_accum);
  if (absl::GetFlag(FLAGS_steps) < 0) {
    return Bad(absl::StrCat("--steps=", absl::GetFlag(FLAGS_steps),
                            ": expected 0 or more (0: checkpoint the state it starts from)"));
  }
  if (task.batch < 1) return Bad(absl::StrCat("--batch=", task.batch, ": expected 1 or more"));
  return CheckTaskOptions(task);
}

// The ZeRO stage, the optimizer and the compute types.
absl::Status ReadEngine(WorkerConfig* config) {
  const TaskOptions& task = config->task;
  EngineOptions& engine = config->engine;
  engine.stage = absl::GetFlag(FLAGS_stage);
  if (engine.stage < 0 || engine.stage > 3) {
    return Bad(absl::StrCat("--stage=", engine.stage, ": expected 0, 1, 2 or 3"));
  }
  engine.prefetch = absl::GetFlag(FLAGS_prefetch);
  if (engine.prefetch < 0) {
    return Bad(absl::StrCat("--prefetch=", engine.prefetch, ": expected 0 or more"));
  }
  engine.grad_accum = task.grad_accum;
  if (engine.grad_accum < 1) {
    return Bad(absl::StrCat("--grad_accum=", engine.grad_accum, ": expected 1 or more"));
  }
  engine.collective_timeout = config->data_plane.timeout;
  engine.optimizer = absl::GetFlag(FLAGS_optimizer);
  engine.max_grad_norm = absl::GetFlag(FLAGS_max_grad_norm);
  if (absl::GetFlag(FLAGS_weight_decay) >= 0) {
    engine.optimizer_options.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  }
  engine.optimizer_options.momentum = absl::GetFlag(FLAGS_momentum);
  if (engine.optimizer != "adam" && engine.optimizer != "adamw" && engine.optimizer != "sgd") {
    return Bad(absl::StrCat("--optimizer=", engine.optimizer, ": expected adam, adamw or sgd"));
  }
  // The optimizer's own checks of the options it takes, on an empty shard:
  // the rules the engine applies after joining.
  if (absl::Status s = MakeOptimizer(engine.optimizer, 0, engine.optimizer_options).status();
      !s.ok()) {
    const double weight_decay = absl::GetFlag(FLAGS_weight_decay);
    return Bad(absl::StrCat("--optimizer=", engine.optimizer,
                            " --momentum=", engine.optimizer_options.momentum,
                            weight_decay >= 0 ? absl::StrCat(" --weight_decay=", weight_decay) : "",
                            ": ", s.message()));
  }
  absl::StatusOr<DType> param_dtype =
      ParseComputeDType("param_dtype", absl::GetFlag(FLAGS_param_dtype));
  if (!param_dtype.ok()) return param_dtype.status();
  const std::string reduce_flag = absl::GetFlag(FLAGS_reduce_dtype);
  absl::StatusOr<DType> reduce_dtype =
      reduce_flag == "int8" ? DType::kI8 : ParseComputeDType("reduce_dtype", reduce_flag);
  if (!reduce_dtype.ok()) {
    return Bad(absl::StrCat("--reduce_dtype=", reduce_flag,
                            " is not a dtype: expected f32, bf16 or int8"));
  }
  const std::string gather_flag = absl::GetFlag(FLAGS_gather_dtype);
  if (gather_flag != "f32" && gather_flag != "int8") {
    return Bad(absl::StrCat("--gather_dtype=", gather_flag,
                            " is not a gather dtype: expected f32 (gathers travel in "
                            "--param_dtype) or int8"));
  }
  engine.param_dtype = *param_dtype;
  engine.reduce_dtype = *reduce_dtype;
  engine.gather_dtype = gather_flag == "int8" ? DType::kI8 : DType::kF32;
  const std::string packed = absl::GetFlag(FLAGS_packed_collectives);
  if (packed == "on" || packed == "off") {
    engine.packed_collectives = packed == "on";
  } else if (packed != "auto") {
    return Bad(absl::StrCat("--packed_collectives=", packed,
                            " is not one of auto, on, off (auto is right unless you are "
                            "comparing the two paths)"));
  }
  engine.replica_thread = absl::GetFlag(FLAGS_replica_thread);
  const std::string rounding = absl::GetFlag(FLAGS_int8_reduce_rounding);
  if (rounding != "stochastic" && rounding != "nearest") {
    return Bad(absl::StrCat("--int8_reduce_rounding=", rounding,
                            " is not a rounding: expected stochastic or nearest"));
  }
  engine.int8_stochastic_reduce = rounding == "stochastic";
  if (engine.gather_dtype == DType::kI8 &&
      (absl::GetFlag(FLAGS_stage) != 3 || engine.param_dtype != DType::kF32)) {
    return Bad(absl::StrCat("--gather_dtype=int8 quantizes stage 3's f32 gathers; got --stage=",
                            absl::GetFlag(FLAGS_stage),
                            " --param_dtype=", absl::GetFlag(FLAGS_param_dtype),
                            ": use --stage=3 --param_dtype=f32, or drop --gather_dtype"));
  }

  config->plan.max_unit_bytes = absl::GetFlag(FLAGS_max_unit_bytes);
  const std::string group = absl::GetFlag(FLAGS_shard_group_size);
  if (group == "host") {
    config->shard_group_by_host = true;
  } else if (!group.empty() && (!absl::SimpleAtoi(group, &config->plan.shard_group_size) ||
                                config->plan.shard_group_size < 0)) {
    return Bad(absl::StrCat("--shard_group_size=", group,
                            " is neither a number of ranks (>= 0) nor 'host'"));
  }
  if (config->plan.shard_group_size > 0 &&
      config->world_size % config->plan.shard_group_size != 0) {
    return Bad(absl::StrCat("--shard_group_size=", group,
                            " does not divide --world_size=", config->world_size,
                            ": the ranks are cut into groups of that size; pick a divisor of "
                            "the world size, or 'host'"));
  }
  if (config->shard_group_by_host && absl::GetFlag(FLAGS_two_level)) {
    return Bad(
        "--two_level with --shard_group_size=host has no second level: each shard group is one "
        "host, so its gathers and reduce-scatters stay in the host (shared memory), and the "
        "replicas' all-reduce joins one rank per host. Drop --two_level (HSDP already sends the "
        "fewest bytes across hosts), or drop --shard_group_size=host to keep the state sharded "
        "over every rank in two levels");
  }
  if ((config->shard_group_by_host || config->plan.shard_group_size > 0) && engine.stage == 0) {
    return Bad("--shard_group_size needs --stage=1, 2 or 3 (stage 0 replicates every state)");
  }
  const std::string secondary = absl::GetFlag(FLAGS_secondary_shard_group_size);
  if (secondary == "host") {
    config->secondary_group_by_host = true;
  } else if (!secondary.empty() && (!absl::SimpleAtoi(secondary, &config->secondary_group_size) ||
                                    config->secondary_group_size < 0)) {
    return Bad(absl::StrCat("--secondary_shard_group_size=", secondary,
                            " is neither a number of ranks (>= 0) nor 'host'"));
  }
  if ((config->secondary_group_by_host || config->secondary_group_size > 0) && engine.stage != 3) {
    return Bad(
        absl::StrCat("--secondary_shard_group_size (hpZ) serves stage 3's backward "
                     "gathers; got --stage=",
                     engine.stage, ": use --stage=3 or drop the flag"));
  }
  return absl::OkStatus();
}

absl::Status ReadCompute(WorkerConfig* config) {
  if (absl::Status s = ReadDataPlane(config); !s.ok()) return s;
  if (absl::Status s = ReadTask(config); !s.ok()) return s;
  return ReadEngine(config);
}

// --testing_corrupt=RANK:STEP[:BIT][,RANK:STEP[:BIT]...].
absl::Status ParseTestingCorrupt(const std::string& value,
                                 std::vector<WorkerConfig::Corruption>* out) {
  if (value.empty()) return absl::OkStatus();
  for (absl::string_view entry : absl::StrSplit(value, ',')) {
    std::vector<std::string> parts = absl::StrSplit(entry, ':');
    WorkerConfig::Corruption c;
    if (parts.size() < 2 || parts.size() > 3 || !absl::SimpleAtoi(parts[0], &c.rank) ||
        !absl::SimpleAtoi(parts[1], &c.step) ||
        (parts.size() == 3 && !absl::SimpleAtoi(parts[2], &c.bit)) || c.rank < 0 || c.step < 1 ||
        c.bit < 23 || c.bit > 30) {
      return Bad(absl::StrCat("--testing_corrupt=", value,
                              ": expected RANK:STEP[:BIT] entries "
                              "separated by commas, a rank >= 0, a step >= 1 and an exponent "
                              "bit 23-30 (got '",
                              entry, "')"));
    }
    out->push_back(c);
  }
  return absl::OkStatus();
}

absl::Status ReadRun(WorkerConfig* config) {
  Schedule& schedule = config->schedule;
  schedule.steps = absl::GetFlag(FLAGS_steps);
  schedule.lr = absl::GetFlag(FLAGS_lr);
  schedule.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  schedule.min_lr = absl::GetFlag(FLAGS_min_lr);
  const std::pair<const char*, double> rates[] = {{"lr", schedule.lr}, {"min_lr", schedule.min_lr}};
  for (const auto& [flag, value] : rates) {
    if (!std::isfinite(value) || value < 0) {
      return Bad(absl::StrCat("--", flag, "=", value, ": expected a finite learning rate >= 0"));
    }
  }
  if (schedule.warmup_steps < 0) {
    return Bad(absl::StrCat("--warmup_steps=", schedule.warmup_steps, ": expected 0 or more"));
  }
  const std::string kind = absl::GetFlag(FLAGS_lr_schedule);
  if (kind == "constant") {
    schedule.kind = LrSchedule::kConstant;
  } else if (kind == "cosine") {
    schedule.kind = LrSchedule::kCosine;
  } else {
    return Bad(absl::StrCat("--lr_schedule=", kind, ": expected constant or cosine"));
  }
  config->val_every = absl::GetFlag(FLAGS_val_every);
  config->val_batches = absl::GetFlag(FLAGS_val_batches);
  config->sample_bytes = absl::GetFlag(FLAGS_sample);

  CheckpointConfig& checkpoint = config->checkpoint;
  checkpoint.dir = absl::GetFlag(FLAGS_checkpoint_dir);
  checkpoint.every = absl::GetFlag(FLAGS_checkpoint_every);
  checkpoint.at_end = absl::GetFlag(FLAGS_checkpoint_at_end);
  checkpoint.save_optimizer = absl::GetFlag(FLAGS_save_optimizer);
  if (checkpoint.every < 0) {
    return Bad(absl::StrCat("--checkpoint_every=", checkpoint.every,
                            ": expected 0 or more (0: never; --checkpoint_at_end: at the end)"));
  }
  if (checkpoint.enabled() && checkpoint.dir.empty()) {
    return Bad("--checkpoint_every / --checkpoint_at_end need --checkpoint_dir");
  }
  checkpoint.max_pending_commits = absl::GetFlag(FLAGS_max_pending_commits);
  checkpoint.staging = absl::GetFlag(FLAGS_checkpoint_staging);
  if (checkpoint.max_pending_commits < 1) {
    return Bad(absl::StrCat("--max_pending_commits=", checkpoint.max_pending_commits,
                            ": expected at least 1 (the checkpoint being committed)"));
  }
  const std::string transport = absl::GetFlag(FLAGS_checkpoint_transport);
  if (transport == "fs") {
    checkpoint.transport = CheckpointTransport::kFs;
  } else if (transport == "grpc") {
    checkpoint.transport = CheckpointTransport::kGrpc;
  } else {
    return Bad(absl::StrCat("--checkpoint_transport=", transport, ": expected fs or grpc"));
  }

  InitialState& initial = config->initial;
  initial.init_from = absl::GetFlag(FLAGS_init_from);
  initial.resume_flag = absl::GetFlag(FLAGS_resume);
  if (!initial.resume_flag.empty()) {
    if (!initial.init_from.empty()) return Bad("--resume and --init_from are exclusive");
    if (checkpoint.dir.empty()) return Bad("--resume needs --checkpoint_dir");
    if (initial.resume_flag == "latest") {
      initial.resume = InitialState::Resume::kLatest;
    } else if (absl::SimpleAtoi(initial.resume_flag, &initial.resume_step) &&
               initial.resume_step >= 0) {
      initial.resume = InitialState::Resume::kStep;
    } else {
      return Bad(
          absl::StrCat("--resume=", initial.resume_flag, ": expected 'latest' or a step number"));
    }
  }

  NonFiniteConfig& numerics = config->numerics;
  if (absl::Status s = ParseOnNonFinite(absl::GetFlag(FLAGS_on_nonfinite), &numerics.on_nonfinite);
      !s.ok()) {
    return s;
  }
  numerics.max_skipped_steps = absl::GetFlag(FLAGS_max_skipped_steps);
  if (numerics.max_skipped_steps < 0) {
    return Bad(absl::StrCat("--max_skipped_steps=", numerics.max_skipped_steps,
                            ": expected 0 or more (0: stop at the first non-finite step)"));
  }

  config->replica_check_every = absl::GetFlag(FLAGS_replica_check_every);
  if (config->replica_check_every < 0) {
    return Bad(absl::StrCat("--replica_check_every=", config->replica_check_every,
                            ": expected 0 (off) or a number of steps"));
  }
  const int group = config->plan.shard_group_size;
  if (config->replica_check_every > 0 && !config->shard_group_by_host &&
      (group == 0 || group >= config->world_size)) {
    return Bad(absl::StrCat("--replica_check_every needs replicas: shard groups smaller than the "
                            "job (--shard_group_size=G < --world_size=",
                            config->world_size, ", or 'host' across hosts); without them "
                            "there is no copy of a shard to compare against"));
  }
  if (absl::Status s =
          ParseTestingCorrupt(absl::GetFlag(FLAGS_testing_corrupt), &config->testing_corrupt);
      !s.ok()) {
    return s;
  }
  config->loss_spike_zscore = absl::GetFlag(FLAGS_loss_spike_zscore);
  if (!(config->loss_spike_zscore >= 0)) {
    return Bad(absl::StrCat("--loss_spike_zscore=", config->loss_spike_zscore,
                            ": expected 0 (off) or a number of standard deviations, e.g. 6"));
  }
  if (config->loss_spike_zscore > 0 && config->recovery.snapshot_every == 0) {
    return Bad(absl::StrCat("--loss_spike_zscore=", config->loss_spike_zscore,
                            " rewinds to the last in-memory snapshot, and --snapshot_every=0 "
                            "takes none: pass --snapshot_every=N (e.g. 5)"));
  }

  config->summary_out = absl::GetFlag(FLAGS_summary_out);
  config->eval_out = absl::GetFlag(FLAGS_eval_out);
  config->report = absl::GetFlag(FLAGS_report);
  config->test_stall_before_gather = absl::GetFlag(FLAGS_test_stall_before_gather);
  config->test_step_delay_ms = absl::GetFlag(FLAGS_test_step_delay_ms);
  config->test_step_delay_until = absl::GetFlag(FLAGS_test_step_delay_until);
  for (const std::string& r : absl::GetFlag(FLAGS_test_step_delay_ranks)) {
    int rank = -1;
    if (!absl::SimpleAtoi(r, &rank) || rank < 0) {
      return Bad(absl::StrCat("--test_step_delay_ranks: '", r,
                              "' is not a rank: expected comma-separated ranks, e.g. 2,3"));
    }
    config->test_step_delay_ranks.push_back(rank);
  }
  config->data_plane.test_hold_file = absl::GetFlag(FLAGS_test_hold_data_plane);
  if (config->test_stall_before_gather < 0 || config->test_step_delay_ms < 0) {
    return Bad("--test_stall_before_gather and --test_step_delay_ms must be >= 0");
  }
  return absl::OkStatus();
}

// Whether the command line named `flag` (a value equal to the default
// included). Debian's Abseil keeps CommandLineFlag::IsSpecifiedOnCommandLine
// private; the parser's own record is the same answer.
bool GivenOnCommandLine(absl::string_view flag) {
  return absl::flags_internal::WasPresentOnCommandLine(flag);
}

// The value of a model flag against the checkpoint's: a flag left out takes
// the config's value; one given must agree.
absl::Status Agree(const char* flag, int64_t given, int64_t config_value, const char* key,
                   const std::string& dir) {
  if (!GivenOnCommandLine(flag) || given == config_value) return absl::OkStatus();
  return Bad(absl::StrCat("--", flag, "=", given, " disagrees with --init_from=", dir,
                          ": its config.json has ", key, " ", config_value, "; leave --", flag,
                          " out (the checkpoint sets it) or start from "
                          "another checkpoint"));
}

// --init_from=DIR (a Hugging Face GPT-2 directory): its config.json shapes
// the model. --context may be shorter than n_positions (the training window).
absl::Status ApplyHuggingFaceConfig(WorkerConfig* config) {
  const std::string& dir = config->initial.init_from;
  struct stat st;
  if (dir.empty() || stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::OkStatus();
  }
  TaskOptions& task = config->task;
  if (GivenOnCommandLine("model") && task.model != "gpt") {
    return Bad(absl::StrCat("--init_from=", dir, " is a Hugging Face GPT-2 directory, but --model=",
                            task.model, "; use --model=gpt (or leave it out)"));
  }
  absl::StatusOr<HfGpt2Config> hf = ReadHfGpt2Config(dir);
  if (!hf.ok()) return Bad(absl::StrCat("--init_from: ", hf.status().message()));
  for (absl::Status s : {Agree("layers", task.layers, hf->n_layer, "n_layer", dir),
                         Agree("heads", task.heads, hf->n_head, "n_head", dir),
                         Agree("d_model", task.d_model, hf->n_embd, "n_embd", dir),
                         Agree("vocab", task.vocab, hf->vocab_size, "vocab_size", dir)}) {
    if (!s.ok()) return s;
  }
  if (GivenOnCommandLine("context") && task.context > hf->n_positions) {
    return Bad(absl::StrCat("--context=", task.context, " is longer than the n_positions ",
                            hf->n_positions, " of --init_from=", dir, "/config.json"));
  }
  task.model = "gpt";
  task.layers = hf->n_layer;
  task.heads = hf->n_head;
  task.d_model = static_cast<int>(hf->n_embd);
  task.vocab = hf->vocab_size;
  task.positions = hf->n_positions;
  if (!GivenOnCommandLine("context")) task.context = static_cast<int>(hf->n_positions);
  return absl::OkStatus();
}

}  // namespace

double Schedule::LearningRate(int step) const {
  if (step < warmup_steps) return lr * (step + 1) / warmup_steps;
  if (kind == LrSchedule::kConstant) return lr;
  const double progress = double(step - warmup_steps) / std::max(1, steps - warmup_steps);
  return min_lr + 0.5 * (lr - min_lr) * (1 + std::cos(M_PI * std::min(1.0, progress)));
}

absl::StatusOr<WorkerConfig> WorkerConfigFromFlags() {
  WorkerConfig config;
  if (absl::Status s = ReadMembership(&config); !s.ok()) return s;
  if (absl::Status s = ReadCompute(&config); !s.ok()) return s;
  if (absl::Status s = ReadRun(&config); !s.ok()) return s;
  if (absl::Status s = ReadOuterSync(&config); !s.ok()) return s;
  if (absl::Status s = ApplyHuggingFaceConfig(&config); !s.ok()) return s;
  // Last: the only check that reads files.
  absl::StatusOr<ClientOptions> client = ClientOptionsFromFlags();
  if (!client.ok()) {
    return absl::Status(client.status().code(),
                        absl::StrCat("client files: ", client.status().ToString()));
  }
  config.client = *std::move(client);
  config.client.agent = absl::GetFlag(FLAGS_agent);
  if (config.host.empty()) {
    absl::StatusOr<std::string> local = LocalAddressTowards(FirstServer(config.client.server));
    if (!local.ok()) return local.status();
    config.host = *local;
    config.data_plane.host = *local;
  }
  return config;
}

}  // namespace zeroshard
