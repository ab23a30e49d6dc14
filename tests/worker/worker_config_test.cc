// WorkerConfigFromFlags: every flag shard_worker checks before joining, with
// the message that names the flag and what it takes.
#include "worker/worker_config.h"

#include <cmath>
#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"

ABSL_DECLARE_FLAG(std::string, job);
ABSL_DECLARE_FLAG(int, world_size);
ABSL_DECLARE_FLAG(int, join_timeout_s);
ABSL_DECLARE_FLAG(int, heads);
ABSL_DECLARE_FLAG(int, d_model);
ABSL_DECLARE_FLAG(std::string, gpu_attention);
ABSL_DECLARE_FLAG(int, local_rank);
ABSL_DECLARE_FLAG(bool, tf32);
ABSL_DECLARE_FLAG(std::string, worker_id);
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(int, steps);
ABSL_DECLARE_FLAG(int, batch);
ABSL_DECLARE_FLAG(int, threads);
ABSL_DECLARE_FLAG(int, stage);
ABSL_DECLARE_FLAG(int, grad_accum);
ABSL_DECLARE_FLAG(std::string, optimizer);
ABSL_DECLARE_FLAG(double, momentum);
ABSL_DECLARE_FLAG(std::string, param_dtype);
ABSL_DECLARE_FLAG(std::string, lr_schedule);
ABSL_DECLARE_FLAG(double, lr);
ABSL_DECLARE_FLAG(int, warmup_steps);
ABSL_DECLARE_FLAG(double, min_lr);
ABSL_DECLARE_FLAG(std::string, checkpoint_dir);
ABSL_DECLARE_FLAG(int, checkpoint_every);
ABSL_DECLARE_FLAG(std::string, checkpoint_transport);
ABSL_DECLARE_FLAG(std::string, resume);
ABSL_DECLARE_FLAG(std::string, init_from);
ABSL_DECLARE_FLAG(absl::Duration, collective_timeout);
ABSL_DECLARE_FLAG(std::string, token_file);
ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(std::string, loss_on);
ABSL_DECLARE_FLAG(std::string, task);
ABSL_DECLARE_FLAG(std::string, activation);
ABSL_DECLARE_FLAG(int, digits);
ABSL_DECLARE_FLAG(std::string, on_nonfinite);
ABSL_DECLARE_FLAG(int, max_skipped_steps);
ABSL_DECLARE_FLAG(int, replica_check_every);
ABSL_DECLARE_FLAG(std::string, testing_corrupt);
ABSL_DECLARE_FLAG(bool, two_level);
ABSL_DECLARE_FLAG(std::string, shard_group_size);
ABSL_DECLARE_FLAG(int, max_pending_commits);
ABSL_DECLARE_FLAG(double, loss_spike_zscore);
ABSL_DECLARE_FLAG(int, snapshot_every);
ABSL_DECLARE_FLAG(std::string, sync);
ABSL_DECLARE_FLAG(int, outer_every);
ABSL_DECLARE_FLAG(std::string, outer_dtype);

namespace zeroshard {
namespace {

// Each test starts from the defaults plus --job, and leaves them so.
class WorkerConfigTest : public ::testing::Test {
 protected:
  WorkerConfigTest() { absl::SetFlag(&FLAGS_job, "job-1"); }

  // The INVALID_ARGUMENT message of the current flags; "" when they pass.
  std::string Refusal() {
    absl::StatusOr<WorkerConfig> config = WorkerConfigFromFlags();
    if (config.ok()) return "";
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << config.status();
    return std::string(config.status().message());
  }

  absl::FlagSaver saver_;
};

TEST_F(WorkerConfigTest, DefaultsAreTheFlagsDefaults) {
  // A numeric address: the default --host is the local address of the route
  // to the server, found without DNS (which test machines may not have).
  absl::SetFlag(&FLAGS_server, "127.0.0.1:7070");
  absl::StatusOr<WorkerConfig> config = WorkerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->job, "job-1");
  EXPECT_EQ(config->client.server, "127.0.0.1:7070");
  EXPECT_EQ(config->host, "127.0.0.1");
  EXPECT_EQ(config->world_size, 1);
  // No --worker_id: HOST/PID.
  EXPECT_TRUE(absl::StrContains(config->worker_id, "/")) << config->worker_id;
  EXPECT_EQ(config->data_plane.backend, DataPlaneBackend::kGloo);
  EXPECT_TRUE(config->data_plane.shared_memory);
  EXPECT_EQ(config->data_plane.timeout, absl::Seconds(60));
  EXPECT_EQ(config->engine.collective_timeout, absl::Seconds(60));
  EXPECT_EQ(config->engine.stage, 3);
  EXPECT_EQ(config->engine.optimizer, "adam");
  EXPECT_FALSE(config->engine.optimizer_options.weight_decay.has_value());
  EXPECT_EQ(config->task.model, "mlp");
  EXPECT_EQ(config->schedule.steps, 10);
  EXPECT_EQ(config->schedule.kind, LrSchedule::kConstant);
  EXPECT_EQ(config->initial.resume, InitialState::Resume::kOff);
  EXPECT_FALSE(config->checkpoint.enabled());
  EXPECT_EQ(config->checkpoint.transport, CheckpointTransport::kFs);
}

// --sync=diloco (worker/outer_sync_config.h): DiLoCo's defaults, and the
// default snapshots moved to the outer steps, where the groups hold one
// model; a snapshot interval set by hand must be a multiple of H.
TEST_F(WorkerConfigTest, DiLoCoTakesItsDefaultsAndMovesTheSnapshotsToOuterSteps) {
  absl::SetFlag(&FLAGS_server, "127.0.0.1:7070");
  absl::SetFlag(&FLAGS_world_size, 4);
  absl::SetFlag(&FLAGS_shard_group_size, "2");
  absl::SetFlag(&FLAGS_sync, "diloco");
  absl::StatusOr<WorkerConfig> config = WorkerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->engine.replica_sync, ReplicaSync::kDiLoCo);
  EXPECT_EQ(config->engine.outer.every, 50);
  EXPECT_EQ(config->engine.outer.lr, 0.7);
  EXPECT_EQ(config->engine.outer.momentum, 0.9);
  EXPECT_EQ(config->engine.outer.wire, OuterWire::kF32);
  EXPECT_EQ(config->recovery.snapshot_every, 50);
  absl::SetFlag(&FLAGS_outer_every, 4);
  absl::SetFlag(&FLAGS_outer_dtype, "int8");
  absl::SetFlag(&FLAGS_snapshot_every, 8);
  config = WorkerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->engine.outer.wire, OuterWire::kInt8);
  absl::SetFlag(&FLAGS_outer_dtype, "int4");
  config = WorkerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->engine.outer.wire, OuterWire::kInt4);
  absl::SetFlag(&FLAGS_outer_dtype, "int8");
  EXPECT_EQ(config->recovery.snapshot_every, 8);
  absl::SetFlag(&FLAGS_snapshot_every, 6);
  EXPECT_TRUE(absl::StrContains(Refusal(), "--snapshot_every=6 with --sync=diloco --outer_every=4"))
      << Refusal();
  // Every-step HSDP keeps its snapshots and refuses the outer flags.
  absl::SetFlag(&FLAGS_sync, "every_step");
  EXPECT_EQ(Refusal(), "--outer_every sets DiLoCo's outer step: it needs --sync=diloco");
}

TEST_F(WorkerConfigTest, JobIsRequiredAndMustBeAValidId) {
  absl::SetFlag(&FLAGS_job, "");
  EXPECT_EQ(Refusal(), "--job is required");
  absl::SetFlag(&FLAGS_job, "../escape");
  EXPECT_TRUE(absl::StartsWith(Refusal(), "--job: ")) << Refusal();
}

TEST_F(WorkerConfigTest, EveryBadValueNamesItsFlagAndWhatItTakes) {
  struct Case {
    void (*set)();
    std::string message;  // a part of it
  };
  const Case cases[] = {
      {[] { absl::SetFlag(&FLAGS_world_size, 0); }, "--world_size=0: expected 1 or more"},
      {[] { absl::SetFlag(&FLAGS_backend, "mpi"); },
       "--backend=mpi is unknown: expected gloo or nccl"},
      {[] { absl::SetFlag(&FLAGS_gpu_attention, "xformers"); },
       "--gpu_attention=xformers: expected auto, cudnn, flash, flash_tc or naive"},
      {[] { absl::SetFlag(&FLAGS_gpu_attention, "flash"); },
       "--gpu_attention applies to the device GPT (--backend=nccl); drop it with --backend=gloo"},
      {[] { absl::SetFlag(&FLAGS_tf32, true); },
       "--tf32 applies to the device GPT (--backend=nccl)"},
      {[] { absl::SetFlag(&FLAGS_worker_id, "w\x1b[31mred"); },
       "--worker_id: worker_id 'w\\033[31mred' has a control character"},
      {[] { absl::SetFlag(&FLAGS_worker_id, std::string(300, 'w')); },
       "--worker_id: worker_id is 300 characters long; at most 256"},
      {[] { absl::SetFlag(&FLAGS_model, "transformer"); },
       "--model=transformer is unknown: expected mlp or gpt"},
      {[] { absl::SetFlag(&FLAGS_activation, "tanh"); },
       "--activation=tanh: expected none, relu or gelu"},
      {[] { absl::SetFlag(&FLAGS_task, "text"); },
       "--task=text is unknown: expected addition or reversed-addition (built-in synthetic sums); "
       "for text, pass --data=FILE"},
      {[] { absl::SetFlag(&FLAGS_digits, 10); }, "--digits=10: expected 1 to 9"},
      {[] { absl::SetFlag(&FLAGS_local_rank, -2); },
       "--local_rank=-2: expected a GPU index, 0 or more (or -1"},
      {[] { absl::SetFlag(&FLAGS_local_rank, 1); },
       "--local_rank picks this process's GPU (--backend=nccl); drop it with --backend=gloo"},
      {[] { absl::SetFlag(&FLAGS_steps, -1); }, "--steps=-1: expected 0 or more"},
      {[] { absl::SetFlag(&FLAGS_batch, 0); }, "--batch=0: expected 1 or more"},
      {[] { absl::SetFlag(&FLAGS_join_timeout_s, -1); }, "--join_timeout_s=-1: expected 1 or more"},
      {[] { absl::SetFlag(&FLAGS_lr, -1.0); }, "--lr=-1: expected a finite learning rate >= 0"},
      {[] { absl::SetFlag(&FLAGS_lr, std::nan("")); }, "--lr=nan: expected a finite learning"},
      {[] { absl::SetFlag(&FLAGS_min_lr, -0.5); }, "--min_lr=-0.5: expected a finite learning"},
      {[] { absl::SetFlag(&FLAGS_warmup_steps, -2); }, "--warmup_steps=-2: expected 0 or more"},
      {[] { absl::SetFlag(&FLAGS_checkpoint_every, -3); },
       "--checkpoint_every=-3: expected 0 or more (0: never"},
      {[] {
         absl::SetFlag(&FLAGS_model, "gpt");
         absl::SetFlag(&FLAGS_heads, 3);
       },
       "--d_model=128 is not divisible by --heads=3"},
      {[] {
         absl::SetFlag(&FLAGS_model, "gpt");
         absl::SetFlag(&FLAGS_heads, 0);
       },
       "--heads=0: expected 1 or more"},
      {[] {
         absl::SetFlag(&FLAGS_model, "gpt");
         absl::SetFlag(&FLAGS_d_model, -128);
       },
       "--d_model=-128: expected 1 or more"},
      {[] {
         absl::SetFlag(&FLAGS_world_size, 4);
         absl::SetFlag(&FLAGS_stage, 3);
         absl::SetFlag(&FLAGS_shard_group_size, "3");
       },
       "--shard_group_size=3 does not divide --world_size=4"},
      {[] { absl::SetFlag(&FLAGS_threads, 0); }, "--threads must be >= 1"},
      {[] { absl::SetFlag(&FLAGS_stage, 4); }, "--stage=4: expected 0, 1, 2 or 3"},
      {[] { absl::SetFlag(&FLAGS_grad_accum, 0); }, "--grad_accum=0: expected 1 or more"},
      {[] { absl::SetFlag(&FLAGS_optimizer, "lamb"); },
       "--optimizer=lamb: expected adam, adamw or sgd"},
      {[] { absl::SetFlag(&FLAGS_momentum, 0.9); }, "--optimizer=adam --momentum=0.9: "},
      {[] { absl::SetFlag(&FLAGS_param_dtype, "f16"); },
       "--param_dtype=f16 is not a dtype: expected f32 or bf16"},
      {[] { absl::SetFlag(&FLAGS_collective_timeout, absl::ZeroDuration()); },
       "--collective_timeout=0: expected a positive duration"},
      {[] { absl::SetFlag(&FLAGS_lr_schedule, "step"); },
       "--lr_schedule=step: expected constant or cosine"},
      {[] { absl::SetFlag(&FLAGS_checkpoint_every, 5); },
       "--checkpoint_every / --checkpoint_at_end need --checkpoint_dir"},
      {[] { absl::SetFlag(&FLAGS_checkpoint_transport, "nfs"); },
       "--checkpoint_transport=nfs: expected fs or grpc"},
      {[] { absl::SetFlag(&FLAGS_resume, "latest"); }, "--resume needs --checkpoint_dir"},
      {[] { absl::SetFlag(&FLAGS_loss_on, "digits"); },
       "--loss_on=digits: expected all or answers"},
      {[] { absl::SetFlag(&FLAGS_loss_on, "answers"); },  // the default model is the MLP
       "--loss_on=answers needs --model=gpt on an addition task"},
      {[] {
         absl::SetFlag(&FLAGS_model, "gpt");
         absl::SetFlag(&FLAGS_task, "text");
         absl::SetFlag(&FLAGS_loss_on, "answers");
       },
       "--loss_on=answers needs --model=gpt on an addition task"},
      {[] {
         absl::SetFlag(&FLAGS_resume, "latest");
         absl::SetFlag(&FLAGS_init_from, "/m.safetensors");
       },
       "--resume and --init_from are exclusive"},
      {[] {
         absl::SetFlag(&FLAGS_resume, "-3");
         absl::SetFlag(&FLAGS_checkpoint_dir, "/ck");
       },
       "--resume=-3: expected 'latest' or a step number"},
      {[] {
         absl::SetFlag(&FLAGS_stage, 3);
         absl::SetFlag(&FLAGS_shard_group_size, "host");
         absl::SetFlag(&FLAGS_two_level, true);
       },
       "--two_level with --shard_group_size=host has no second level"},
      {[] {
         absl::SetFlag(&FLAGS_checkpoint_dir, "/ck");
         absl::SetFlag(&FLAGS_max_pending_commits, 0);
       },
       "--max_pending_commits=0: expected at least 1"},
  };
  for (const Case& c : cases) {
    absl::FlagSaver restore;
    c.set();
    const std::string refusal = Refusal();
    EXPECT_TRUE(absl::StrContains(refusal, c.message))
        << "expected '" << c.message << "' in '" << refusal << "'";
  }
}

// --backend=nccl trains either model (CudaMlpModel, CudaGptModel) in a CUDA
// build; without CUDA it is refused, pointing to gloo.
TEST_F(WorkerConfigTest, NumericalIntegrityFlagsNameWhatTheyTake) {
  absl::StatusOr<WorkerConfig> config = WorkerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->numerics.on_nonfinite, OnNonFinite::kStop);  // the default
  EXPECT_EQ(config->numerics.max_skipped_steps, 10);
  EXPECT_EQ(config->replica_check_every, 0);
  EXPECT_TRUE(config->testing_corrupt.empty());
  EXPECT_EQ(config->loss_spike_zscore, 0);  // off

  absl::SetFlag(&FLAGS_on_nonfinite, "ignore");
  EXPECT_TRUE(absl::StrContains(Refusal(), "--on_nonfinite=ignore: expected stop")) << Refusal();
  absl::SetFlag(&FLAGS_on_nonfinite, "skip");
  absl::SetFlag(&FLAGS_max_skipped_steps, -1);
  EXPECT_TRUE(absl::StrContains(Refusal(), "--max_skipped_steps=-1: expected 0 or more"))
      << Refusal();
  absl::SetFlag(&FLAGS_max_skipped_steps, 3);
  absl::SetFlag(&FLAGS_replica_check_every, -5);
  EXPECT_TRUE(absl::StrContains(Refusal(), "--replica_check_every=-5")) << Refusal();
  absl::SetFlag(&FLAGS_replica_check_every, 5);
  // Without shard groups smaller than the job there is nothing to compare:
  // refused with the flags, not after the first step.
  EXPECT_TRUE(absl::StrContains(Refusal(), "--replica_check_every needs replicas: shard groups "
                                           "smaller than the job (--shard_group_size=G < "
                                           "--world_size=1"))
      << Refusal();
  absl::SetFlag(&FLAGS_world_size, 4);
  absl::SetFlag(&FLAGS_shard_group_size, "4");
  EXPECT_TRUE(absl::StrContains(Refusal(), "--replica_check_every needs replicas")) << Refusal();
  absl::SetFlag(&FLAGS_shard_group_size, "2");
  for (const char* bad : {"1", "1:0", "x:3", "-1:3", "1:2:3", "1:2:31", "1:2,", "1:2:23:4"}) {
    absl::SetFlag(&FLAGS_testing_corrupt, bad);
    EXPECT_TRUE(absl::StrContains(Refusal(), "expected RANK:STEP")) << bad << ": " << Refusal();
  }
  absl::SetFlag(&FLAGS_testing_corrupt, "1:12,1:17:30");
  absl::SetFlag(&FLAGS_loss_spike_zscore, -1);
  EXPECT_TRUE(absl::StrContains(Refusal(), "--loss_spike_zscore=-1: expected 0 (off)"))
      << Refusal();
  absl::SetFlag(&FLAGS_loss_spike_zscore, 6);
  absl::SetFlag(&FLAGS_snapshot_every, 0);
  EXPECT_TRUE(absl::StrContains(Refusal(), "pass --snapshot_every=N")) << Refusal();
  absl::SetFlag(&FLAGS_snapshot_every, 5);
  config = WorkerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->numerics.on_nonfinite, OnNonFinite::kSkip);
  EXPECT_EQ(config->numerics.max_skipped_steps, 3);
  EXPECT_EQ(config->replica_check_every, 5);
  ASSERT_EQ(config->testing_corrupt.size(), 2u);
  EXPECT_EQ(config->testing_corrupt[0].rank, 1);
  EXPECT_EQ(config->testing_corrupt[0].step, 12);
  EXPECT_EQ(config->testing_corrupt[0].bit, 23);  // the lowest exponent bit
  EXPECT_EQ(config->testing_corrupt[1].step, 17);
  EXPECT_EQ(config->testing_corrupt[1].bit, 30);
  EXPECT_EQ(config->loss_spike_zscore, 6);
}

TEST_F(WorkerConfigTest, NcclTakesTheGptWhenBuiltWithCuda) {
  absl::SetFlag(&FLAGS_backend, "nccl");
  absl::SetFlag(&FLAGS_model, "gpt");
  absl::StatusOr<WorkerConfig> config = WorkerConfigFromFlags();
#ifdef ZEROSHARD_HAVE_CUDA
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->data_plane.backend, DataPlaneBackend::kNccl);
  EXPECT_EQ(config->task.model, "gpt");
#else
  ASSERT_FALSE(config.ok());
  EXPECT_TRUE(absl::StrContains(config.status().message(), "--backend=gloo")) << config.status();
#endif
}

TEST_F(WorkerConfigTest, ResumeTakesLatestOrAStep) {
  absl::SetFlag(&FLAGS_checkpoint_dir, "/ck");
  absl::SetFlag(&FLAGS_resume, "latest");
  absl::StatusOr<WorkerConfig> latest = WorkerConfigFromFlags();
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->initial.resume, InitialState::Resume::kLatest);
  absl::SetFlag(&FLAGS_resume, "40");
  absl::StatusOr<WorkerConfig> step = WorkerConfigFromFlags();
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->initial.resume, InitialState::Resume::kStep);
  EXPECT_EQ(step->initial.resume_step, 40);
  EXPECT_EQ(step->initial.resume_flag, "40");
}

TEST_F(WorkerConfigTest, AnUnreadableTokenFileIsRefusedBeforeJoining) {
  absl::SetFlag(&FLAGS_token_file, "/nonexistent/token");
  absl::StatusOr<WorkerConfig> config = WorkerConfigFromFlags();
  ASSERT_FALSE(config.ok());
  EXPECT_TRUE(absl::StartsWith(config.status().message(), "client files: NOT_FOUND"))
      << config.status();
  EXPECT_TRUE(absl::StrContains(config.status().message(), "/nonexistent/token"));
}

TEST(ScheduleTest, WarmupThenConstantOrCosineToMinLr) {
  Schedule s;
  s.steps = 10;
  s.lr = 1.0;
  s.warmup_steps = 2;
  EXPECT_DOUBLE_EQ(s.LearningRate(0), 0.5);
  EXPECT_DOUBLE_EQ(s.LearningRate(1), 1.0);
  EXPECT_DOUBLE_EQ(s.LearningRate(5), 1.0);
  s.kind = LrSchedule::kCosine;
  s.min_lr = 0.1;
  EXPECT_DOUBLE_EQ(s.LearningRate(2), 1.0);  // decay starts at the peak
  EXPECT_NEAR(s.LearningRate(6), 0.1 + 0.45 * (1 + std::cos(M_PI * 0.5)), 1e-12);  // halfway
  EXPECT_NEAR(s.LearningRate(10), 0.1, 1e-12);                                     // reaches min_lr
  EXPECT_NEAR(s.LearningRate(20), 0.1, 1e-12);  // and stays there
}

}  // namespace
}  // namespace zeroshard
