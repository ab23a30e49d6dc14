#include "worker/checkpoint_loading.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_format.h"
#include "common/status_context.h"

namespace zeroshard {
namespace {

absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenResumeStep(const InitialState& initial,
                                                                 const std::string& root,
                                                                 const std::string& job, int rank,
                                                                 int world) {
  int64_t step = initial.resume_step;
  if (initial.resume == InitialState::Resume::kLatest) {
    step = LatestCompleteStep(root, job);
    if (step < 0) {
      return absl::NotFoundError(
          absl::StrCat("--resume=latest: no complete checkpoint of job '", job, "' under ", root));
    }
  }
  const std::string manifest = absl::StrCat(root, "/", CheckpointManifestPath(job, step));
  if (access(manifest.c_str(), F_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--resume=", initial.resume_flag, ": step ", step, " of job '", job,
                     "' is not a complete checkpoint (no ", manifest, ")"));
  }
  absl::StatusOr<std::unique_ptr<CheckpointReader>> opened = CheckpointReader::OpenStep(
      absl::StrCat(root, "/", CheckpointStepDir(job, step)), CheckpointShardFileName(rank, world));
  if (!opened.ok()) return Annotate(opened.status(), "--resume");
  return opened;
}

// DiLoCo's outer state, after the parameters and moments: restored from a
// checkpoint that has it, started fresh (anchor = the loaded parameters,
// momentum 0, as Initialize left it) from one without, and ignored (said
// once) by a job without --sync=diloco.
absl::Status LoadOuterState(CheckpointReader* r, ZeroEngine& engine, const EngineOptions& options,
                            bool log_notes) {
  auto rows = [r](CheckpointReader::Kind kind) {
    return [r, kind](const TensorSpec& t, int64_t begin, int64_t end, float* out) {
      return r->ReadRows(kind, t, begin, end, out);
    };
  };
  const char* source = r->source().c_str();
  if (!engine.diloco()) {
    if (r->has_outer_anchor() && log_notes) {
      std::fprintf(stderr,
                   "note: %s holds DiLoCo's outer state (anchor, outer momentum); this job does "
                   "not run --sync=diloco: ignored\n",
                   source);
    }
    return absl::OkStatus();
  }
  if (!r->has_outer_anchor()) {
    if (log_notes) {
      std::fprintf(stderr,
                   "note: %s has no DiLoCo outer state; it starts fresh: the loaded parameters "
                   "are the anchor, the outer momentum is zero\n",
                   source);
    }
    return absl::OkStatus();
  }
  const bool momentum = r->has_outer_momentum() && options.outer.momentum > 0;
  const ZeroEngine::RowSource momentum_rows = rows(CheckpointReader::Kind::kOuterMomentum);
  const int64_t outer_step = std::max<int64_t>(r->outer_step(), 0);
  absl::Status s = engine.InitializeOuterState(rows(CheckpointReader::Kind::kOuterAnchor),
                                               momentum ? &momentum_rows : nullptr, outer_step);
  if (!s.ok()) return Annotate(s, absl::StrCat("load DiLoCo's outer state from ", r->source()));
  if (log_notes) {
    std::fprintf(stderr, "DiLoCo outer state from %s: outer step %lld, anchor%s\n", source,
                 static_cast<long long>(outer_step),
                 momentum                     ? " and outer momentum"
                 : options.outer.momentum > 0 ? "; no outer momentum saved: it starts at zero"
                                              : "");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenInitialCheckpoint(const InitialState& initial,
                                                                        const std::string& root,
                                                                        const std::string& job,
                                                                        int rank, int world) {
  if (initial.resume != InitialState::Resume::kOff) {
    return OpenResumeStep(initial, root, job, rank, world);
  }
  if (initial.init_from.empty()) return nullptr;
  absl::StatusOr<std::unique_ptr<CheckpointReader>> opened =
      CheckpointReader::OpenFile(initial.init_from);
  if (!opened.ok()) return Annotate(opened.status(), "--init_from");
  return opened;
}

absl::StatusOr<LoadedPosition> LoadEngineState(CheckpointReader* r, ZeroEngine& engine,
                                               const EngineOptions& options, bool log_notes) {
  auto rows = [r](CheckpointReader::Kind kind) {
    return [r, kind](const TensorSpec& t, int64_t begin, int64_t end, float* out) {
      return r->ReadRows(kind, t, begin, end, out);
    };
  };
  if (absl::Status s = engine.Initialize(rows(CheckpointReader::Kind::kParams)); !s.ok()) {
    return Annotate(s, absl::StrCat("load parameters from ", r->source()));
  }
  const bool has_moments = options.optimizer != "sgd" || options.optimizer_options.momentum > 0;
  if (r->has_optimizer_state() && has_moments) {
    absl::Status s =
        engine.InitializeMoment(ZeroEngine::Moment::kExpAvg, rows(CheckpointReader::Kind::kExpAvg));
    if (!s.ok()) return Annotate(s, absl::StrCat("load exp_avg from ", r->source()));
    if (options.optimizer != "sgd") {
      s = engine.InitializeMoment(ZeroEngine::Moment::kExpAvgSq,
                                  rows(CheckpointReader::Kind::kExpAvgSq));
      if (!s.ok()) return Annotate(s, absl::StrCat("load exp_avg_sq from ", r->source()));
    }
    if (r->optimizer_step() >= 0) engine.set_optimizer_step(r->optimizer_step());
  } else if (log_notes) {
    std::fprintf(stderr, "note: %s has no optimizer state; moments start at zero\n",
                 r->source().c_str());
  }
  if (absl::Status s = LoadOuterState(r, engine, options, log_notes); !s.ok()) return s;
  return LoadedPosition{r->step(), r->data_row()};
}

}  // namespace zeroshard
