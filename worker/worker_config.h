// WorkerConfig: everything shard_worker's flags say, read and checked once,
// before the worker joins its job. A bad flag is found here, alone, instead of
// failing a rank after every peer joined and bootstrapped.
//
// The flags are defined in worker_config.cc (the connection flags, shared
// with shardctl, in client/connection_flags.cc); nothing else reads them.
#ifndef ZEROSHARD_WORKER_WORKER_CONFIG_H_
#define ZEROSHARD_WORKER_WORKER_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/plan/planner.h"
#include "worker/data_plane.h"
#include "worker/nonfinite_policy.h"
#include "worker/training_task.h"
#include "worker/zero/engine.h"

namespace zeroshard {

enum class LrSchedule { kConstant, kCosine };

// The learning rate over the run: a linear warmup, then constant or a
// cosine decay to min_lr at the last step.
struct Schedule {
  int steps = 10;  // optimizer steps in all, resumed ones included
  double lr = 1e-3;
  int warmup_steps = 0;
  LrSchedule kind = LrSchedule::kConstant;
  double min_lr = 0;

  // The learning rate of (0-based) `step`.
  double LearningRate(int step) const;
};

// Where the parameters come from before the first step.
struct InitialState {
  enum class Resume { kOff, kLatest, kStep };
  Resume resume = Resume::kOff;
  int64_t resume_step = -1;  // Resume::kStep
  std::string resume_flag;   // --resume as given, for messages
  std::string init_from;     // a consolidated safetensors file; "" for the seed
};

enum class CheckpointTransport { kFs, kGrpc };

struct CheckpointConfig {
  // The root of sharded checkpoints (read by --resume, written by saves).
  std::string dir;
  int every = 0;  // save every K steps; 0: never
  bool at_end = false;
  bool save_optimizer = true;
  // kFs: the server reads the files on a shared filesystem; kGrpc: this
  // worker streams them to it (UploadShard) before committing.
  CheckpointTransport transport = CheckpointTransport::kFs;
  // Written checkpoints waiting for their commit (the server out of reach)
  // kept before the oldest waiting one is dropped (checkpointer.h).
  int max_pending_commits = 8;
  // --checkpoint_staging: the writer first copies the engine's state into a
  // host buffer of the shard's size that it keeps for the next checkpoint
  // (memcpy, ~10x faster than write(2) into the page cache), and writes from
  // it; off, write(2) reads the engine's memory and the next update waits
  // for it (worker/checkpointer.h).
  bool staging = true;

  bool enabled() const { return every > 0 || at_end; }
};

// Fault tolerance (worker.h, "Recovery").
struct RecoveryConfig {
  int max_recoveries = 10;  // 0: exit when the generation ends
  absl::Duration rejoin_timeout = absl::Minutes(5);
  int min_world_size = 0;  // 0: never shrink
  // --keep_global_batch: a shrunk generation accumulates the missing ranks'
  // micro-batches (worker/recovery/global_batch.h).
  bool keep_global_batch = true;
  absl::Duration rejoin_grace = absl::Seconds(30);
  int snapshot_every = 20;  // 0: no in-memory snapshots
  // --snapshot_buddy=always: a buddy copy even where replicas hold the rows
  // (HSDP with R >= 2); auto (false): the replica peer's run instead.
  bool snapshot_buddy_always = false;
};

struct WorkerConfig {
  // ---- The job and how to reach it ----
  ClientOptions client;  // token and TLS files already read
  std::string job;       // a valid job id (common/job_id.h)
  int world_size = 1;
  std::string worker_id;  // never empty: --worker_id, or HOST/PID
  std::string host;       // where peers reach this worker
  absl::Duration join_timeout = absl::Seconds(600);
  RecoveryConfig recovery;

  // ---- Compute ----
  DataPlaneOptions data_plane;
  int blas_threads = 1;
  // --peak_flops: this rank's FLOP/s for MFU; 0: measured (CPU) or unknown.
  double peak_flops = 0;
  // The model and its data; mlp_factory stays empty here (the CUDA device
  // is opened later, by the worker).
  TaskOptions task;
  // The ZeRO engine; backend stays null here, like mlp_factory.
  EngineOptions engine;
  PlanOptions plan;  // shard_group_size: --shard_group_size=G
  // --shard_group_size=host: G is the number of ranks per host, found when
  // the job forms (Worker::Plan).
  bool shard_group_by_host = false;
  // hpZ: --secondary_shard_group_size=H (0: off), or 'host' (the ranks per
  // host, found when the job forms, like shard_group_by_host).
  int secondary_group_size = 0;
  bool secondary_group_by_host = false;

  // ---- The run ----
  Schedule schedule;
  int val_every = 0;    // validation every N steps; 0: at the end only
  int val_batches = 4;  // per rank per evaluation
  int sample_bytes = 0;
  InitialState initial;
  CheckpointConfig checkpoint;
  NonFiniteConfig numerics;  // --on_nonfinite, --max_skipped_steps
  // --replica_check_every=N (0: off): HSDP replicas compare their master
  // shards' XXH3 every N steps (worker/replica_check.h).
  int replica_check_every = 0;
  // --loss_spike_zscore=Z (0: off): a step whose mean loss is more than Z
  // standard deviations above the recent window is bad (worker/loss_spike.h).
  double loss_spike_zscore = 0;
  // --outer_timeout (DiLoCo; worker_outer_elastic.cc): a shard group later
  // than this at an outer step, counted from the first group's arrival, is
  // left out of it. Zero: off, every outer step waits for every group.
  absl::Duration outer_timeout = absl::ZeroDuration();

  // ---- Outputs ("": not written) ----
  std::string summary_out;  // rank 0
  std::string eval_out;     // rank 0
  std::string report;       // "{rank}" in it: every rank writes its own; else rank 0

  // ---- Test-only: faults the observability tests provoke (0: off) ----
  // Blocks this worker before its N-th all-gather of a generation (until
  // the generation is aborted), as a rank stuck outside a collective would.
  int64_t test_stall_before_gather = 0;
  // Sleeps this long at the start of every step: a straggler. Only on the
  // ranks listed in --test_step_delay_ranks (empty: every rank), and only
  // before step --test_step_delay_until (0: every step): a transient one.
  int test_step_delay_ms = 0;
  std::vector<int> test_step_delay_ranks;
  int test_step_delay_until = 0;
  // --testing_corrupt=RANK:STEP[:BIT],...: rank RANK flips bit BIT (an
  // exponent bit, 23-30; default 23, the lowest) of one parameter of its
  // master shard after step STEP's update, once per entry (empty: off).
  struct Corruption {
    int rank = 0;
    int64_t step = 0;
    int bit = 23;
  };
  std::vector<Corruption> testing_corrupt;
};

// Reads every flag of shard_worker (the connection flags' token and TLS
// files included) and checks them and how they combine. INVALID_ARGUMENT
// naming the flag and the values it takes ("--lr_schedule=x: expected
// constant or cosine"), or the error of reading a connection file. Not
// checked here: what needs the model, its data or a device (the worker's
// first phases).
absl::StatusOr<WorkerConfig> WorkerConfigFromFlags();

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_WORKER_CONFIG_H_
