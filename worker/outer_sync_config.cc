#include "worker/outer_sync_config.h"

#include <cmath>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

ABSL_FLAG(std::string, sync, "every_step",
          "With --shard_group_size: every_step (HSDP: each step's gradient averaged over the "
          "groups) | diloco (each group trains on its own; every --outer_every steps the groups "
          "average their parameter change and an outer Nesterov SGD applies it; docs/diloco.md)");
ABSL_FLAG(int, outer_every, 50, "--sync=diloco: inner steps per outer step (H)");
ABSL_FLAG(double, outer_lr, 0.7, "--sync=diloco: the outer SGD's learning rate");
ABSL_FLAG(double, outer_momentum, 0.9,
          "--sync=diloco: the outer SGD's Nesterov momentum (0: plain SGD)");
ABSL_FLAG(std::string, outer_dtype, "f32",
          "--sync=diloco: the outer all-reduce's wire dtype: f32 | bf16 | int8 | int4 (int8: one "
          "f32 scale per 256 values, int4: per 64; all but f32 keep each rank's quantization "
          "residual for the next outer step: error feedback; docs/diloco.md)");

ABSL_FLAG(int, outer_fragments, 1,
          "--sync=diloco: F, streaming DiLoCo's fragments: the units split into F contiguous runs "
          "of about equal parameter count, one synced every --outer_every / F steps, each every "
          "--outer_every steps (1: the whole model at once; docs/diloco.md)");
ABSL_FLAG(int, outer_delay, 1,
          "--sync=diloco with --outer_fragments > 1: tau, the inner steps a fragment's outer "
          "all-reduce overlaps (on the replica thread) before its result is applied; 0 to "
          "--outer_every / F (0: applied at once). With --outer_fragments=1 it is 0 unless set");
ABSL_FLAG(double, outer_mix, 0.5,
          "Streaming DiLoCo: alpha, the share of a fragment's local parameters (the group's own, "
          "--outer_delay steps after its all-reduce began) kept when the outer result is applied "
          "(params = outer + alpha (local - outer)); 0: the outer result overwrites them");

ABSL_FLAG(absl::Duration, outer_timeout, absl::ZeroDuration(),
          "--sync=diloco: a shard group later than this at an outer step (counted from the "
          "first group's arrival) is left out of it and caught up at the next one it reaches "
          "in time; the groups are then not coupled between outer steps. 0: every outer step "
          "waits for every group");

namespace zeroshard {
namespace {

absl::Status Bad(const std::string& message) { return absl::InvalidArgumentError(message); }

// Whether `flag` holds another value than its default. (Whether the command
// line named it is the parser's record, which a test that sets flags
// without parsing does not have.)
bool Changed(const char* flag) {
  const absl::CommandLineFlag* f = absl::FindCommandLineFlag(flag);
  return f != nullptr && f->CurrentValue() != f->DefaultValue();
}

// Streaming DiLoCo's fragments, delay and mix (after --outer_every).
absl::Status ReadStreaming(OuterOptions* outer) {
  const int h = outer->every;
  const int f = absl::GetFlag(FLAGS_outer_fragments);
  if (f < 1 || h % f != 0) {
    return Bad(absl::StrCat("--outer_fragments=", f, " with --outer_every=", h,
                            ": expected F >= 1 dividing --outer_every (one fragment synced every "
                            "H / F steps, each every H), e.g. --outer_every=",
                            f < 1 ? h : f * ((h + f - 1) / f)));
  }
  outer->fragments = f;
  // One fragment: today's DiLoCo, blocking, unless an overlap is asked for.
  outer->delay = f == 1 && !Changed("outer_delay") ? 0 : absl::GetFlag(FLAGS_outer_delay);
  if (outer->delay < 0 || outer->delay > h / f) {
    return Bad(absl::StrCat("--outer_delay=", outer->delay, " with --outer_every=", h,
                            " --outer_fragments=", f,
                            ": a fragment's outer step is applied before the next one begins: "
                            "expected 0 to H / F = ",
                            h / f));
  }
  outer->mix = absl::GetFlag(FLAGS_outer_mix);
  if (!(outer->mix >= 0 && outer->mix <= 1)) {
    return Bad(absl::StrCat("--outer_mix=", outer->mix,
                            ": expected a share in [0, 1] of the local parameters kept (0.5 is the "
                            "default; 0: the outer result overwrites them)"));
  }
  return absl::OkStatus();
}

// The outer optimizer's own values.
absl::Status ReadOuterOptions(OuterOptions* outer) {
  outer->every = absl::GetFlag(FLAGS_outer_every);
  if (outer->every < 1) {
    return Bad(absl::StrCat("--outer_every=", outer->every,
                            ": expected the inner steps between outer steps, 1 or more "
                            "(DiLoCo's H; 50 is typical)"));
  }
  outer->lr = absl::GetFlag(FLAGS_outer_lr);
  if (!(outer->lr > 0) || std::isinf(outer->lr)) {
    return Bad(absl::StrCat("--outer_lr=", outer->lr,
                            ": expected a finite learning rate > 0 (DiLoCo's is 0.7)"));
  }
  outer->momentum = absl::GetFlag(FLAGS_outer_momentum);
  if (!(outer->momentum >= 0 && outer->momentum < 1)) {
    return Bad(absl::StrCat("--outer_momentum=", outer->momentum,
                            ": expected a Nesterov momentum in [0, 1) (DiLoCo's is 0.9; 0: "
                            "plain SGD)"));
  }
  const std::string dtype = absl::GetFlag(FLAGS_outer_dtype);
  bool known = false;
  for (OuterWire wire : {OuterWire::kF32, OuterWire::kBF16, OuterWire::kInt8, OuterWire::kInt4}) {
    if (dtype != OuterWireName(wire)) continue;
    outer->wire = wire;
    known = true;
  }
  if (!known) {
    return Bad(absl::StrCat("--outer_dtype=", dtype,
                            ": expected f32, bf16, int8 or int4 (the outer all-reduce's wire)"));
  }
  return ReadStreaming(outer);
}

// --sync=diloco needs two groups or more: a numeric --shard_group_size G
// with W / G >= 2 (host-sized groups are counted when the job forms, and
// the engine refuses one group then).
absl::Status CheckGroups(const WorkerConfig& config) {
  const int w = config.world_size;
  const int g = config.plan.shard_group_size;
  if (config.shard_group_by_host) return absl::OkStatus();
  if (g <= 0 || g >= w) {
    return Bad(absl::StrCat(
        "--sync=diloco averages shard groups' parameters and this job has one group (--world_size=",
        w, ", --shard_group_size=", g <= 0 ? std::string("unset") : absl::StrCat(g),
        "): set --shard_group_size=G with G dividing W and W / G >= 2, e.g. --shard_group_size=",
        w >= 2 ? w / 2 : 1, (w >= 2 ? "" : " with --world_size=2 or more")));
  }
  return absl::OkStatus();
}

// What DiLoCo's groups, holding different parameters between outer steps,
// rule out or move.
absl::Status CheckCombinations(WorkerConfig* config) {
  const int every = config->engine.outer.every;
  if (config->data_plane.backend != DataPlaneBackend::kGloo) {
    return Bad(
        "--sync=diloco runs on --backend=gloo for now: its outer optimizer (SGD with Nesterov "
        "momentum) has no CUDA kernel yet (worker/cuda/cuda_backend.cc implements adam and "
        "adamw)");
  }
  if (config->replica_check_every > 0) {
    return Bad(absl::StrCat("--replica_check_every=", config->replica_check_every,
                            " compares the replicas' shards, which --sync=diloco lets differ "
                            "between outer steps: drop --replica_check_every"));
  }
  const int checkpoint_every = config->checkpoint.every;
  if (checkpoint_every > 0 && checkpoint_every % every != 0) {
    return Bad(absl::StrCat("--checkpoint_every=", checkpoint_every,
                            " with --sync=diloco --outer_every=", every,
                            ": checkpoints hold one model only right after an outer step; use a "
                            "multiple of --outer_every (e.g. ",
                            every, ")"));
  }
  int& snapshot_every = config->recovery.snapshot_every;
  if (!Changed("snapshot_every")) {
    // The default, moved to the outer steps; streaming: off, as each one
    // would be a full outer step (FullOuterStepAfter) every H steps.
    if (snapshot_every > 0) snapshot_every = StreamingOuter(config->engine.outer) ? 0 : every;
    if (snapshot_every == 0 && config->loss_spike_zscore > 0) {
      return Bad(absl::StrCat(
          "--loss_spike_zscore=", config->loss_spike_zscore,
          " rewinds to an in-memory snapshot, which streaming DiLoCo (--outer_fragments) takes "
          "only where --snapshot_every says (each one a full outer step): pass --snapshot_every=",
          every, " or a multiple of it"));
    }
  } else if (snapshot_every > 0 && snapshot_every % every != 0) {
    return Bad(absl::StrCat("--snapshot_every=", snapshot_every,
                            " with --sync=diloco --outer_every=", every,
                            ": a snapshot holds one model only right after an outer step; use 0 "
                            "or a multiple of --outer_every"));
  }
  return absl::OkStatus();
}

// --outer_timeout: the groups must not meet between outer steps, so what
// would make them meet is refused (the per-step loss agreement becomes the
// group's own; evaluation, snapshots and checkpoints happen at outer steps
// that every group took part in).
absl::Status CheckOuterTimeout(WorkerConfig* config) {
  const absl::Duration timeout = absl::GetFlag(FLAGS_outer_timeout);
  const std::string value = absl::FormatDuration(timeout);
  if (timeout < absl::ZeroDuration()) {
    return Bad(absl::StrCat("--outer_timeout=", value,
                            ": expected 0 (off) or how long an outer step waits for a late "
                            "shard group, e.g. 30s"));
  }
  config->outer_timeout = timeout;
  if (timeout == absl::ZeroDuration()) return absl::OkStatus();
  const OuterOptions& outer = config->engine.outer;
  if (StreamingOuter(outer)) {
    return Bad(absl::StrCat("--outer_timeout=", value, " with streaming DiLoCo (--outer_fragments=",
                            outer.fragments, ", --outer_delay=", outer.delay,
                            "): a late group is left out of whole outer steps only; drop "
                            "--outer_timeout or use --outer_fragments=1 --outer_delay=0"));
  }
  if (config->loss_spike_zscore > 0) {
    return Bad(absl::StrCat("--outer_timeout=", value,
                            " with --loss_spike_zscore=", config->loss_spike_zscore,
                            ": a rewind brings every group back to a snapshot together, which "
                            "groups that run apart cannot do; drop one of them"));
  }
  if (config->val_every > 0 && config->val_every % outer.every != 0) {
    return Bad(absl::StrCat("--outer_timeout=", value, " with --val_every=", config->val_every,
                            " and --outer_every=", outer.every,
                            ": an evaluation runs over every group, which meet only at outer "
                            "steps; use a multiple of --outer_every (e.g. ",
                            outer.every, ") or 0"));
  }
  const int w = config->world_size, g = config->plan.shard_group_size;
  if (!config->shard_group_by_host && g > 0 && w / g > kMaxOuterQuorumGroups) {
    return Bad(absl::StrCat("--outer_timeout=", value, " with ", w / g,
                            " shard groups: an outer quorum names at most ", kMaxOuterQuorumGroups,
                            " groups; use a larger --shard_group_size or drop --outer_timeout"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadOuterSync(WorkerConfig* config) {
  EngineOptions& engine = config->engine;
  const std::string sync = absl::GetFlag(FLAGS_sync);
  if (sync == "every_step") {
    engine.replica_sync = ReplicaSync::kEveryStep;
    for (const char* flag : {"outer_every", "outer_lr", "outer_momentum", "outer_dtype",
                             "outer_fragments", "outer_delay", "outer_mix", "outer_timeout"}) {
      if (Changed(flag)) {
        return Bad(absl::StrCat("--", flag, " sets DiLoCo's outer step: it needs --sync=diloco"));
      }
    }
    return absl::OkStatus();
  }
  if (sync != "diloco") {
    return Bad(absl::StrCat("--sync=", sync, ": expected every_step or diloco"));
  }
  engine.replica_sync = ReplicaSync::kDiLoCo;
  if (absl::Status s = ReadOuterOptions(&engine.outer); !s.ok()) return s;
  if (absl::Status s = CheckGroups(*config); !s.ok()) return s;
  if (absl::Status s = CheckCombinations(config); !s.ok()) return s;
  return CheckOuterTimeout(config);
}

bool OuterStepAfter(int completed, int steps, int every) {
  return every > 0 && completed > 0 && (completed % every == 0 || completed == steps);
}

bool StreamingOuter(const OuterOptions& outer) { return outer.fragments > 1 || outer.delay > 0; }

bool FullOuterStepAfter(const WorkerConfig& config, int completed) {
  const int steps = config.schedule.steps;
  if (completed <= 0) return false;
  if (completed == steps) return true;
  const int checkpoint_every = config.checkpoint.every;
  const int snapshot_every = config.recovery.snapshot_every;
  return (checkpoint_every > 0 && completed % checkpoint_every == 0) ||
         (snapshot_every > 0 && completed % snapshot_every == 0);
}

int FragmentBeganAfter(int completed, const OuterOptions& outer) {
  const int slot = outer.every / outer.fragments;
  if (completed <= 0 || slot <= 0 || completed % slot != 0) return -1;
  return (completed / slot - 1) % outer.fragments;
}

}  // namespace zeroshard
