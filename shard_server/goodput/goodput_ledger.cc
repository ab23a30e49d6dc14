#include "shard_server/goodput/goodput_ledger.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"

namespace zeroshard {
namespace {

using Getter = double (v1::TimeLedger::*)() const;
// The causes a worker reports, and where they go.
constexpr std::pair<GoodputLedger::Cause, Getter> kWorkerCauses[] = {
    {GoodputLedger::kProductive, &v1::TimeLedger::productive},
    {GoodputLedger::kStartup, &v1::TimeLedger::startup},
    {GoodputLedger::kRestore, &v1::TimeLedger::restore},
    {GoodputLedger::kDataWait, &v1::TimeLedger::data_wait},
    {GoodputLedger::kCheckpointPause, &v1::TimeLedger::checkpoint_pause},
    {GoodputLedger::kSnapshotPause, &v1::TimeLedger::snapshot_pause},
    {GoodputLedger::kLostWork, &v1::TimeLedger::lost_work},
    {GoodputLedger::kStall, &v1::TimeLedger::stall},
    {GoodputLedger::kStraggler, &v1::TimeLedger::straggler},
    {GoodputLedger::kEvaluation, &v1::TimeLedger::evaluation},
    {GoodputLedger::kOther, &v1::TimeLedger::other},
};

bool Usable(double v) { return std::isfinite(v) && v >= 0; }

double Between(absl::Time from, absl::Time to) {
  return std::max(0.0, absl::ToDoubleSeconds(to - from));
}

// A running segment of `segment` seconds split by `ledger` (summing
// `ledger_sum`): its causes, scaled down to the segment when they sum more,
// and the rest as `rest`; its MFU terms scaled alike.
void SplitRunning(double segment, const v1::TimeLedger& ledger, double ledger_sum,
                  GoodputLedger::Cause rest, std::array<double, GoodputLedger::kCauseCount>& out,
                  double* flops, double* budget) {
  const double scale = ledger_sum > segment && ledger_sum > 0 ? segment / ledger_sum : 1.0;
  double covered = 0;
  for (const auto& [cause, get] : kWorkerCauses) {
    const double s = (ledger.*get)() * scale;
    out[cause] += s;
    covered += s;
  }
  out[rest] += std::max(0.0, segment - covered);
  *flops += ledger.model_flops() * scale;
  *budget += ledger.peak_flop_budget() * scale;
}

}  // namespace

const char* GoodputLedger::CauseName(int cause) {
  static constexpr const char* kNames[kCauseCount] = {
      "productive",     "rendezvous", "startup",   "restore",   "data_wait", "checkpoint_pause",
      "snapshot_pause", "detection",  "reforming", "lost_work", "stall",     "straggler",
      "evaluation",     "other",      "in_flight"};
  return cause >= 0 && cause < kCauseCount ? kNames[cause] : "?";
}

double LedgerSeconds(const v1::TimeLedger& ledger) {
  double sum = 0;
  for (const auto& [cause, get] : kWorkerCauses) {
    const double v = (ledger.*get)();
    if (!Usable(v)) return -1;
    sum += v;
  }
  for (double v : {ledger.model_flops(), ledger.peak_flop_budget(), ledger.peak_flops(),
                   ledger.flops_per_item()}) {
    if (!Usable(v)) return -1;
  }
  return sum;
}

absl::Status ValidateTimeLedger(const v1::TimeLedger& ledger, absl::string_view where) {
  const google::protobuf::Descriptor* d = ledger.GetDescriptor();
  const google::protobuf::Reflection* r = ledger.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_DOUBLE) continue;
    const double v = r->GetDouble(ledger, f);
    if (!Usable(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".", f->name(), " is ", v,
                       "; a time ledger holds seconds and FLOP counts, each finite and >= 0 "
                       "(is this client a zeroshard worker?)"));
    }
  }
  return absl::OkStatus();
}

void GoodputLedger::Open(Phase phase, absl::Time at) {
  phase_ = phase;
  phase_start_ = at;
  if (phase != Phase::kRunning) {
    ledger_.Clear();
    ledger_sum_ = 0;
    ledger_rank_ = -1;
  }
}

void GoodputLedger::CloseOpen(absl::Time end, Cause rest) {
  const double segment = Between(phase_start_, end);
  switch (phase_) {
    case Phase::kNone:
      break;
    case Phase::kRendezvous:
      closed_[kRendezvous] += segment;
      break;
    case Phase::kReforming:
      closed_[kReforming] += segment;
      break;
    case Phase::kRunning:
      SplitRunning(segment, ledger_, ledger_sum_, rest, closed_, &closed_flops_, &closed_budget_);
      ledger_.Clear();
      ledger_sum_ = 0;
      ledger_rank_ = -1;
      break;
  }
  phase_ = Phase::kNone;
  phase_start_ = std::max(phase_start_, end);
}

void GoodputLedger::Started(absl::Time at) {
  if (phase_ != Phase::kNone) return;
  steps_done_ = 0;
  Open(Phase::kRendezvous, at);
}

void GoodputLedger::Formed(int64_t generation, absl::Time at) {
  CloseOpen(at, kLostWork);
  generation_ = generation;
  ledger_.Clear();
  ledger_sum_ = 0;
  ledger_rank_ = -1;
  Open(Phase::kRunning, at);
}

bool GoodputLedger::Report(int64_t generation, int rank, const v1::TimeLedger& ledger) {
  const double sum = LedgerSeconds(ledger);
  if (phase_ != Phase::kRunning || generation != generation_ || sum < 0) return false;
  bool changed = false;
  if (ledger.peak_flops() > 0 && ledger.peak_flops() != peak_flops_) {
    peak_flops_ = ledger.peak_flops();
    changed = true;
  }
  if (ledger.flops_per_item() > 0 && ledger.flops_per_item() != flops_per_item_) {
    flops_per_item_ = ledger.flops_per_item();
    changed = true;
  }
  if (rank < 0) return changed;
  if (ledger_rank_ < 0 || rank < ledger_rank_ || (rank == ledger_rank_ && sum > ledger_sum_)) {
    ledger_ = ledger;
    ledger_sum_ = sum;
    ledger_rank_ = rank;
    changed = true;
  }
  return changed;
}

bool GoodputLedger::StepsCompleted(int64_t steps) {
  if (steps <= steps_done_) return false;
  steps_done_ = steps;
  return true;
}

void GoodputLedger::GenerationEnded(absl::Time evidence, absl::Time verdict) {
  if (phase_ != Phase::kRunning) return;
  verdict = std::max(verdict, phase_start_);
  // What the kept ledger covers ran (its worker's clock starts at its join
  // answer, after the formation): the death came later.
  const absl::Time covered = phase_start_ + absl::Seconds(ledger_sum_);
  const absl::Time end = std::clamp(std::max(evidence, covered), phase_start_, verdict);
  CloseOpen(end, kLostWork);
  closed_[kDetection] += Between(end, verdict);
  Open(Phase::kReforming, verdict);
}

void GoodputLedger::Finished(absl::Time at) {
  if (phase_ == Phase::kNone) return;
  CloseOpen(at, kOther);
}

void GoodputLedger::Reconcile(Phase phase, int64_t generation, absl::Time at) {
  if (phase == phase_ && (phase != Phase::kRunning || generation == generation_)) return;
  if (phase == Phase::kRunning) {
    Formed(generation, at);
    return;
  }
  CloseOpen(at, kLostWork);
  if (phase != Phase::kNone) Open(phase, at);
}

void GoodputLedger::AddOpen(absl::Time now, Seconds& seconds, double* flops, double* budget) const {
  const double open = Between(phase_start_, now);
  switch (phase_) {
    case Phase::kNone:
      break;
    case Phase::kRendezvous:
      seconds[kRendezvous] += open;
      break;
    case Phase::kReforming:
      seconds[kReforming] += open;
      break;
    case Phase::kRunning:
      SplitRunning(open, ledger_, ledger_sum_, kInFlight, seconds, flops, budget);
      break;
  }
}

v1::Goodput GoodputLedger::Snapshot(absl::Time now) const {
  Seconds seconds = closed_;
  double flops = closed_flops_;
  double budget = closed_budget_;
  AddOpen(now, seconds, &flops, &budget);
  v1::Goodput g;
  double wall = 0;
  for (int c = 0; c < kCauseCount; ++c) {
    wall += seconds[c];
    if (c != kProductive) (*g.mutable_badput_seconds())[CauseName(c)] = seconds[c];
  }
  g.set_wall_seconds(wall);
  g.set_productive_seconds(seconds[kProductive]);
  g.set_goodput(wall > 0 ? seconds[kProductive] / wall : 0);
  g.set_mfu(budget > 0 ? flops / budget : -1);
  g.set_peak_flops(peak_flops_);
  g.set_flops_per_item(flops_per_item_);
  for (const v1::GoodputSample& s : samples_) *g.add_samples() = s;
  return g;
}

bool GoodputLedger::MaybeSample(absl::Time now) {
  if (phase_ == Phase::kNone) return false;
  if (!samples_.empty() && now - absl::FromUnixMillis(samples_.back().unix_ms()) < kSampleEvery) {
    return false;
  }
  Seconds seconds = closed_;
  double flops = 0, budget = 0;
  AddOpen(now, seconds, &flops, &budget);
  v1::GoodputSample s;
  s.set_unix_ms(absl::ToUnixMillis(now));
  double wall = 0;
  for (int c = 0; c < kCauseCount; ++c) {
    wall += seconds[c];
    // Only the causes that have time: 64 samples of every cause would be
    // most of a job's status.
    if (c != kProductive && seconds[c] > 0)
      (*s.mutable_badput_seconds())[CauseName(c)] = seconds[c];
  }
  s.set_wall_seconds(wall);
  s.set_productive_seconds(seconds[kProductive]);
  samples_.push_back(std::move(s));
  if (static_cast<int>(samples_.size()) > kMaxSamples) {
    // Every other one of the older half goes: [0, 2, 4, ..., half) kept.
    const size_t half = samples_.size() / 2;
    std::deque<v1::GoodputSample> thinned;
    for (size_t i = 0; i < samples_.size(); ++i) {
      if (i >= half || i % 2 == 0) thinned.push_back(std::move(samples_[i]));
    }
    samples_ = std::move(thinned);
  }
  return true;
}

v1::GoodputState GoodputLedger::State() const {
  v1::GoodputState s;
  for (int c = 0; c < kCauseCount; ++c) {
    if (closed_[c] != 0) (*s.mutable_closed_seconds())[CauseName(c)] = closed_[c];
  }
  s.set_closed_model_flops(closed_flops_);
  s.set_closed_peak_flop_budget(closed_budget_);
  s.set_phase(static_cast<int>(phase_));
  s.set_phase_start_unix_us(absl::ToUnixMicros(phase_start_));
  s.set_generation(generation_);
  *s.mutable_ledger() = ledger_;
  if (ledger_rank_ >= 0) s.set_ledger_rank(ledger_rank_);
  s.set_steps_done(steps_done_);
  s.set_peak_flops(peak_flops_);
  s.set_flops_per_item(flops_per_item_);
  for (const v1::GoodputSample& sample : samples_) *s.add_samples() = sample;
  return s;
}

absl::StatusOr<GoodputLedger> GoodputLedger::FromState(const v1::GoodputState& s) {
  auto invalid = [](auto&&... what) {
    return absl::InvalidArgumentError(absl::StrCat("goodput state: ", what...));
  };
  GoodputLedger l;
  for (const auto& [name, seconds] : s.closed_seconds()) {
    int cause = 0;
    while (cause < kCauseCount && name != CauseName(cause)) ++cause;
    if (cause == kCauseCount) return invalid("unknown cause '", name, "'");
    if (!Usable(seconds)) return invalid("cause '", name, "' has ", seconds, " seconds");
    l.closed_[cause] = seconds;
  }
  if (s.phase() < 0 || s.phase() > static_cast<int>(Phase::kReforming)) {
    return invalid("unknown phase ", s.phase(), " (expected 0..3)");
  }
  const double ledger_sum = LedgerSeconds(s.ledger());
  if (ledger_sum < 0) return invalid("its ledger has a negative or non-finite cause");
  for (double v :
       {s.closed_model_flops(), s.closed_peak_flop_budget(), s.peak_flops(), s.flops_per_item()}) {
    if (!Usable(v)) return invalid("a FLOP count is ", v);
  }
  l.closed_flops_ = s.closed_model_flops();
  l.closed_budget_ = s.closed_peak_flop_budget();
  l.phase_ = static_cast<Phase>(s.phase());
  l.phase_start_ = absl::FromUnixMicros(s.phase_start_unix_us());
  l.generation_ = s.generation();
  l.ledger_ = s.ledger();
  l.ledger_sum_ = ledger_sum;
  l.ledger_rank_ = s.has_ledger_rank() ? s.ledger_rank() : (ledger_sum > 0 ? 0 : -1);
  l.steps_done_ = std::max<int64_t>(0, s.steps_done());
  l.peak_flops_ = s.peak_flops();
  l.flops_per_item_ = s.flops_per_item();
  for (const v1::GoodputSample& sample : s.samples()) l.samples_.push_back(sample);
  while (static_cast<int>(l.samples_.size()) > kMaxSamples) l.samples_.pop_front();
  return l;
}

}  // namespace zeroshard
