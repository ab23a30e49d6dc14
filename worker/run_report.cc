#include "worker/run_report.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "worker/model/blas_kernel.h"
#include "worker/model/parallel.h"
#include "worker/zero/memory_tracker.h"

namespace zeroshard {

void RunMetrics::RecordStep(double loss, double ms, double cpu_ms, const StepTimes& times,
                            const KernelTimes& kernels_before, const KernelTimes& kernels_after) {
  losses.push_back(loss);
  step_ms.push_back(ms);
  step_times.push_back(times);
  step_cpu_ms.push_back(cpu_ms);
  for (size_t k = 0; k < kernels_after.size(); ++k) {
    kernel_ms[k] += kernels_after[k] - kernels_before[k];
  }
}
namespace {

// The GPT's shape under the names Hugging Face's GPT2Config uses.
template <typename Json>
void AddGptShape(const TaskOptions& task, Json* out) {
  if (task.model != "gpt") return;
  (*out)["n_layer"] = task.layers;
  (*out)["n_head"] = task.heads;
  (*out)["n_embd"] = task.d_model;
  (*out)["n_ctx"] = task.context;
  (*out)["vocab_size"] = 256;
}

// This process's peak resident set (VmHWM of /proc/self/status), bytes;
// -1 where it cannot be read. Counts what the engine's memory tracker does
// not: communication scratch, the shared-memory segment's touched pages,
// libraries.
int64_t PeakRssBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    long long kib = 0;
    if (std::sscanf(line.c_str(), "VmHWM: %lld kB", &kib) == 1) return kib * 1024;
  }
  return -1;
}

double ItemsPerSecond(const RunMetrics& m) {
  return m.step_ms.empty() ? 0.0 : m.items_per_second_sum / static_cast<double>(m.step_ms.size());
}

int64_t Parameters(const ZeroEngine& engine) {
  int64_t parameters = 0;
  for (const UnitLayout& u : engine.units()) parameters += u.flat_elements;
  return parameters;
}

// A sample may hold bytes that are not UTF-8: replaced, not fatal.
template <typename Json>
absl::Status WriteJson(const Json& json, const std::string& path, const char* flag) {
  std::ofstream file(path);
  file << json.dump(2, ' ', false, Json::error_handler_t::replace) << "\n";
  if (!file) return absl::InternalError(absl::StrCat("cannot write --", flag, " ", path));
  return absl::OkStatus();
}

// The report's "data_plane": each bulk communicator by role, {"transport":
// "shm"|"tcp"|"two-level"|"nccl"}, Gloo's adding "note" and
// "shm_segment_bytes", a group's its "tag".
nlohmann::json DataPlaneJson(const DataPlaneDescription& d) {
  nlohmann::json out = nlohmann::json::object();
  const std::pair<const char*, const std::optional<CommunicatorDescription>*> roles[] = {
      {"gather", &d.gather},
      {"reduce", &d.reduce},
      {"replicas", &d.replicas},
      {"secondary", &d.secondary}};
  for (const auto& [role, described] : roles) {
    if (!described->has_value()) continue;
    const CommunicatorDescription& c = **described;
    nlohmann::json& entry = out[role];
    entry["transport"] = BulkTransportName(c.transport);
    if (c.transport != BulkTransport::kNccl) {
      entry["note"] = c.note;
      entry["shm_segment_bytes"] = c.shm_segment_bytes;
    }
    if (!c.tag.empty()) entry["tag"] = c.tag;
  }
  return out;
}

nlohmann::json RewindJson(const RewindRecord& r) {
  nlohmann::json out = {{"bad_step", r.bad_step}, {"to_step", r.to_step}, {"why", r.why}};
  if (r.cause != RewindCause::kNotRerun) {
    out["cause"] = r.cause == RewindCause::kData ? "data" : "transient";
  }
  if (r.corrupted_rank >= 0) out["corrupted_rank"] = r.corrupted_rank;
  return out;
}

nlohmann::json RecoveryJson(const RecoveryReport& r) {
  nlohmann::json transfers = nlohmann::json::array();
  for (const SnapshotTransfer& t : r.transfers) {
    transfers.push_back({{"from", t.from},
                         {"to", t.to},
                         {"old_rank", t.old_rank},
                         {"kind", std::string(TransferKindName(t.kind))}});
  }
  const v1::RecoveryRecord& record = r.record;
  return {{"generation", record.generation()},
          {"source", record.source()},
          {"restored_step", record.restored_step()},
          {"failed_step", record.failed_step()},
          {"world_size", record.world_size()},
          {"rejoin_ms", record.rejoin_ms()},
          {"restore_ms", record.restore_ms()},
          {"first_step_ms", record.first_step_ms()},
          {"transfers", transfers},
          {"failure_seen_unix_ms", r.failure_seen_unix_ms},
          {"verdict_unix_ms", r.verdict_unix_ms},
          {"confirmed_unix_ms", r.confirmed_unix_ms},
          {"joined_unix_ms", r.joined_unix_ms},
          {"first_step_unix_ms", r.first_step_unix_ms},
          {"grad_accum", r.grad_accum},
          {"micro_batches_per_step", r.micro_batches_per_step},
          {"global_batch_kept", r.global_batch_kept}};
}

// The report's "goodput": the process's seconds by cause (which, with the
// time between generations, cover its first join answer to
// accounted_until), its goodput and its MFU.
nlohmann::ordered_json GoodputJson(const GoodputSummary& g) {
  const v1::TimeLedger& t = g.ledger;
  nlohmann::ordered_json seconds;
  seconds["startup"] = t.startup();
  seconds["restore"] = t.restore();
  seconds["productive"] = t.productive();
  seconds["data_wait"] = t.data_wait();
  seconds["checkpoint_pause"] = t.checkpoint_pause();
  seconds["snapshot_pause"] = t.snapshot_pause();
  seconds["lost_work"] = t.lost_work();
  seconds["stall"] = t.stall();
  seconds["straggler"] = t.straggler();
  seconds["evaluation"] = t.evaluation();
  seconds["other"] = t.other();
  double accounted = 0;
  for (const auto& s : seconds) accounted += s.get<double>();
  const double wall = absl::ToDoubleSeconds(g.written - g.join_answer);
  nlohmann::ordered_json out;
  out["seconds"] = seconds;
  out["accounted_seconds"] = accounted;
  out["between_generations_seconds"] = g.between_generations_seconds;
  out["wall_seconds"] = wall;
  out["join_answer_unix_us"] = absl::ToUnixMicros(g.join_answer);
  out["accounted_until_unix_us"] = absl::ToUnixMicros(g.accounted_until);
  out["written_unix_us"] = absl::ToUnixMicros(g.written);
  out["goodput"] = wall > 0 ? t.productive() / wall : 0.0;
  out["model_flops"] = t.model_flops();
  out["peak_flop_budget"] = t.peak_flop_budget();
  out["peak_flops"] = t.peak_flops();
  out["peak_flops_source"] = g.peak_flops_source;
  out["flops_per_item"] = t.flops_per_item();
  out["mfu"] = t.peak_flop_budget() > 0 ? t.model_flops() / t.peak_flop_budget() : -1.0;
  return out;
}

// The checkpoints', snapshots' and recoveries' fields of the report.
void AddPauseFields(const RunMetrics& m, nlohmann::ordered_json* out) {
  nlohmann::ordered_json& o = *out;
  o["checkpoint_pause_ms"] = m.checkpoint_pause_ms;
  o["checkpoint_commit_ms"] = m.checkpoint_commit_ms;
  o["checkpoint_failures"] = m.checkpoint_failures;
  o["snapshot_pause_ms"] = m.snapshot_pause_ms;
  o["snapshot_copy_ms"] = m.snapshot_copy_ms;
  o["snapshot_transfer_ms"] = m.snapshot_transfer_ms;
  o["snapshots_skipped"] = m.snapshots_skipped;
  o["snapshots_waited"] = m.snapshots_waited;
  o["snapshot_refusals"] = m.snapshot_refusals;
  o["snapshots_from_replicas"] = m.snapshots_from_replicas;
  o["snapshot_committed_step"] = m.snapshot_committed_step;
  nlohmann::json recoveries = nlohmann::json::array();
  for (const RecoveryReport& r : m.recoveries) recoveries.push_back(RecoveryJson(r));
  o["recoveries"] = recoveries;
}

}  // namespace

double ProcessCpuMs() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

absl::Status WriteSummary(const FinishedRun& run, const std::string& path) {
  const WorkerConfig& config = *run.config;
  const RunMetrics& m = *run.metrics;
  const Evaluation& eval = m.last_eval;
  const int world = config.world_size;
  const int stage = config.engine.stage;
  const int64_t parameters = Parameters(*run.engine);
  nlohmann::ordered_json summary;
  AddGptShape(config.task, &summary);
  summary["model"] = run.model;
  summary["parameters"] = parameters;
  summary["world_size"] = world;
  summary["stage"] = stage;
  summary["steps"] = config.schedule.steps;
  summary["loss_first"] = m.losses.empty() ? 0.0 : m.losses.front();
  summary["loss_last"] = m.losses.empty() ? 0.0 : m.losses.back();
  summary["val_loss"] = eval.loss;
  summary["accuracy"] =
      eval.accuracy >= 0 ? nlohmann::ordered_json(eval.accuracy) : nlohmann::ordered_json();
  summary["accuracy_in_context"] = eval.accuracy_in_context >= 0
                                       ? nlohmann::ordered_json(eval.accuracy_in_context)
                                       : nlohmann::ordered_json();
  summary["sample"] = m.sample;
  summary["step_time_ms_median"] = Median(m.step_ms);
  summary["items_per_second"] = ItemsPerSecond(m);
  // Stage 0 keeps fp32 params, grads and Adam moments whole: 16 bytes per parameter.
  summary["stage0_model_state_bytes"] = 16 * parameters;
  nlohmann::ordered_json per_rank = nlohmann::ordered_json::array();
  for (int r = 0; r < world; ++r) {
    per_rank.push_back({{"rank", r},
                        {"model_state_bytes", static_cast<int64_t>(run.model_state_bytes[r])},
                        {"peak_bytes", static_cast<int64_t>(run.peak_bytes[r])}});
  }
  summary["memory_per_rank"] = per_rank;

  // For people: the same as a table.
  Table table({"", ""});
  table.AddRow({"model", run.model});
  table.AddRow({"parameters", absl::StrCat(parameters)});
  table.AddRow({"ranks / ZeRO stage", absl::StrCat(world, " / ", stage)});
  table.AddRow(
      {"loss first -> last", absl::StrFormat("%.4f -> %.4f", summary["loss_first"].get<double>(),
                                             summary["loss_last"].get<double>())});
  table.AddRow({"validation loss", absl::StrFormat("%.4f", eval.loss)});
  if (eval.accuracy >= 0) {
    // Greedy answers to held-out problems asked at the start of a sequence.
    table.AddRow({"accuracy (held-out sums, as a first line)",
                  absl::StrFormat("%.1f%%", 100 * eval.accuracy)});
    if (eval.accuracy_in_context >= 0) {
      table.AddRow({"accuracy (held-out sums, after another line)",
                    absl::StrFormat("%.1f%%", 100 * eval.accuracy_in_context)});
    }
  }
  table.AddRow({"step time (median)", absl::StrFormat("%.1f ms", Median(m.step_ms))});
  table.AddRow({config.task.model == "gpt" ? "tokens/s" : "rows/s",
                absl::StrFormat("%.0f", summary["items_per_second"].get<double>())});
  for (int r = 0; r < world; ++r) {
    table.AddRow({absl::StrCat("rank ", r, " memory"),
                  absl::StrCat(HumanBytes(run.model_state_bytes[r]),
                               " model state (stage 0 would need ", HumanBytes(16.0 * parameters),
                               "), ", HumanBytes(run.peak_bytes[r]), " peak")});
  }
  std::fprintf(stderr, "\nsummary\n%s", table.ToString().c_str());
  return WriteJson(summary, path, "summary_out");
}

namespace {

// Medians over steps of where the compute thread's time went, and the
// model's kernels' means.
void AddStepTimes(const RunMetrics& m, nlohmann::ordered_json* report) {
  nlohmann::ordered_json& out = *report;
  // Medians over steps of where the compute thread's time went.
  auto median_of = [&](double StepTimes::*field) {
    std::vector<double> values;
    for (const StepTimes& t : m.step_times) values.push_back(t.*field);
    return Median(values);
  };
  out["step_breakdown_ms"] = {{"forward", median_of(&StepTimes::forward_ms)},
                              {"backward", median_of(&StepTimes::backward_ms)},
                              {"gather_wait", median_of(&StepTimes::gather_wait_ms)},
                              {"reduce_wait", median_of(&StepTimes::reduce_wait_ms)},
                              {"optimizer", median_of(&StepTimes::optimizer_ms)},
                              {"param_sync", median_of(&StepTimes::param_sync_ms)}};
  // Means over the training steps of the model's kernels (kernel_profile.h);
  // forward + backward less their sum is the engine's own work (copies,
  // gradient adds) inside those phases.
  nlohmann::ordered_json kernels;
  const double steps = std::max<size_t>(m.step_ms.size(), 1);
  for (int k = 0; k < static_cast<int>(Kernel::kCount); ++k) {
    kernels[KernelName(static_cast<Kernel>(k))] = m.kernel_ms[k] / steps;
  }
  out["kernel_breakdown_ms"] = kernels;
}

// The engine's memory by category (now and peak), and the host memory
// outside it.
void AddMemory(const RunMetrics& m, const MemoryTracker& mt, nlohmann::ordered_json* report) {
  nlohmann::ordered_json memory;
  for (int c = 0; c < static_cast<int>(MemoryCategory::kCount); ++c) {
    auto category = static_cast<MemoryCategory>(c);
    memory[MemoryCategoryName(category)] = mt.current(category);
    memory[absl::StrCat(MemoryCategoryName(category), "_peak")] = mt.peak(category);
  }
  memory["model_state_bytes"] = mt.model_state();
  memory["peak_bytes"] = mt.peak_total();
  // Host memory outside the engine: in-memory snapshots (own + buddy's).
  memory["snapshot_host_bytes_peak"] = m.snapshot_bytes_peak;
  // And the checkpoint writer's staging buffer (worker/checkpointer.h).
  memory["checkpoint_staging_bytes"] = m.checkpoint_staging_bytes;
  (*report)["memory"] = memory;
}

// The training's bytes by collective, and per step by where they went.
void AddCommBytes(const RunMetrics& m, nlohmann::ordered_json* report) {
  nlohmann::ordered_json& out = *report;
  const CollectiveBytes& bytes = m.training_bytes;
  out["comm_bytes"] = {{"all_gather", bytes.all_gather},
                       {"reduce_scatter", bytes.reduce_scatter},
                       {"all_reduce", bytes.all_reduce},
                       {"broadcast", bytes.broadcast},
                       {"secondary_all_gather", m.secondary_gather_bytes}};
  // Per step, and the median step: what stayed on this rank's host and what
  // crossed the network (the figure a slow link between hosts multiplies).
  out["comm_bytes_intra_host"] = m.step_bytes_intra_host;
  out["comm_bytes_inter_host"] = m.step_bytes_inter_host;
  auto median_bytes = [](const std::vector<int64_t>& v) {
    return static_cast<int64_t>(Median(std::vector<double>(v.begin(), v.end())));
  };
  out["comm_bytes_per_step"] = {{"intra_host", median_bytes(m.step_bytes_intra_host)},
                                {"inter_host", median_bytes(m.step_bytes_inter_host)}};
}

}  // namespace

absl::Status WriteReport(const FinishedRun& run, const std::string& path) {
  const WorkerConfig& config = *run.config;
  const RunMetrics& m = *run.metrics;
  const ZeroEngine& e = *run.engine;
  nlohmann::ordered_json out;
  out["rank"] = run.rank;
  out["world_size"] = config.world_size;
  out["stage"] = config.engine.stage;
  out["steps"] = config.schedule.steps;
  out["losses"] = m.losses;
  out["skipped_steps"] = m.skipped_steps;
  std::vector<nlohmann::json> rewinds;
  for (const RewindRecord& r : m.rewinds) rewinds.push_back(RewindJson(r));
  out["rewinds"] = rewinds;
  nlohmann::json outer_steps = nlohmann::json::array();
  for (const OuterStepRecord& o : m.outer_steps) {
    outer_steps.push_back({{"after_step", o.after_step},
                           {"outer_step", o.outer_step},
                           {"bytes_sent", o.bytes_sent},
                           {"ms", o.ms},
                           {"outer_grad_norm", o.outer_grad_norm},
                           {"residual_norm", o.residual_norm},
                           {"fragment", o.fragment},
                           {"began_after_step", o.began_after_step},
                           {"on_replica_thread", o.on_replica_thread},
                           {"all_reduce_ms", o.all_reduce_ms},
                           {"wait_ms", o.wait_ms},
                           {"groups", o.groups},
                           {"generation", o.generation},
                           {"present_groups", o.present_groups},
                           {"took_part", o.took_part},
                           {"caught_up", o.caught_up},
                           {"stale_groups", o.stale_groups}});
  }
  out["outer_steps"] = outer_steps;
  out["replica_check_ms_median"] = Median(m.replica_check_ms);
  out["replica_hash_ms_median"] = Median(m.replica_hash_ms);
  out["params_sum"] = run.params_sum;
  if (run.master_shard_sum.has_value()) out["master_shard_sum"] = *run.master_shard_sum;
  out["step_time_ms_median"] = Median(m.step_ms);
  out["step_ms"] = m.step_ms;  // every step's, in order (this process's)
  out["step_cpu_ms_median"] = Median(m.step_cpu_ms);
  AddStepTimes(m, &out);
  AddMemory(m, e.memory(), &out);
  AddCommBytes(m, &out);
  out["plan_hash"] = run.plan_hash;
  out["data_plane"] = DataPlaneJson(run.data_plane);
  out["compute"] = {{"threads", ComputeThreads()}, {"blas_kernel", BlasKernel()}};
  AddPauseFields(m, &out);
  out["goodput"] = GoodputJson(run.goodput);
  out["first_join_unix_ms"] = m.first_join_unix_ms;
  out["model"] = run.model;
  AddGptShape(config.task, &out);
  out["val_losses"] = m.val_losses;
  out["val_loss"] = m.last_eval.loss;
  if (m.last_eval.accuracy >= 0) out["accuracy"] = m.last_eval.accuracy;
  if (m.last_eval.accuracy_in_context >= 0) {
    out["accuracy_in_context"] = m.last_eval.accuracy_in_context;
  }
  out["sample"] = m.sample;
  out["items_per_second"] = ItemsPerSecond(m);
  out["peak_rss_bytes"] = PeakRssBytes();
  out["largest_unit_bytes"] = e.largest_unit_elements() * 4;
  int64_t shard_elements = 0;
  for (const UnitLayout& u : e.units()) shard_elements += u.chunk_elements;
  out["parameters"] = Parameters(e);       // Ψ
  out["shard_elements"] = shard_elements;  // this rank's chunks: Ψ/W + padding
  out["prefetch"] = config.engine.prefetch;
  return WriteJson(out, path, "report");
}

absl::Status WriteRunOutputs(const FinishedRun& run) {
  const WorkerConfig& config = *run.config;
  if (run.rank == 0 && !config.summary_out.empty()) {
    if (absl::Status s = WriteSummary(run, config.summary_out); !s.ok()) return s;
  }
  const bool per_rank = config.report.find("{rank}") != std::string::npos;
  if (config.report.empty() || (!per_rank && run.rank != 0)) return absl::OkStatus();
  return WriteReport(run, absl::StrReplaceAll(config.report, {{"{rank}", absl::StrCat(run.rank)}}));
}

absl::Status WriteEvalOut(const std::string& record, const std::string& path) {
  std::ofstream file(path);
  file << record << "\n";
  if (!file) return absl::InternalError(absl::StrCat("cannot write --eval_out ", path));
  return absl::OkStatus();
}

}  // namespace zeroshard
