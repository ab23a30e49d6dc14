// shardctl spec / plan: the spec of a benchmark model, and the shard plan and
// per-rank memory a job of that model would get, known before the job starts.
//
//   shardctl spec --model=gpt2 --layers=12 --d_model=768 --heads=12 --vocab=50257
//   shardctl spec --model=gpt2 --preset=124M [--context=256]
//       --context=1024 > gpt2.json
//   shardctl plan --spec=gpt2.json --world=8 [--stage=3] [--local] [--json]
//
// `plan` asks the server (a one-off plan, nothing stored: the same planner a
// job's first PlanShards runs) or, with --local, plans in-process; both give
// the identical plan for the identical spec, world size and options.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/shardctl_commands.h"
#include "common/dtype.h"
#include "common/file_util.h"
#include "common/model_spec.h"
#include "common/model_zoo.h"
#include "common/plan/memory_estimate.h"
#include "common/plan/plan_codec.h"
#include "common/plan/planner.h"
#include "common/plan/shard_groups.h"
#include "common/plan/shard_plan.h"
#include "common/table.h"
#include "nlohmann/json.hpp"

// 0 and "" mean "not given": spec refuses flags of the other model and names
// the missing ones, rather than building a model nobody asked for.
ABSL_FLAG(std::string, model, "", "spec: mlp or gpt2");
ABSL_FLAG(int, layers, 0, "spec: Linear layers (mlp) or transformer blocks (gpt2)");
ABSL_FLAG(int64_t, width, 0, "spec --model=mlp: in and out features of every Linear");
ABSL_FLAG(std::string, activation, "",
          "spec --model=mlp: none (default), relu or gelu after every Linear but the last");
ABSL_FLAG(int, d_model, 0, "spec --model=gpt2: embedding width");
ABSL_FLAG(int, heads, 0, "spec --model=gpt2: attention heads (must divide --d_model)");
ABSL_FLAG(int, vocab, 0, "spec --model=gpt2: vocabulary size");
ABSL_FLAG(int, context, 0, "spec --model=gpt2: context length (positions)");
ABSL_FLAG(std::string, preset, "",
          "spec --model=gpt2: a GPT-2 release's shape, 124M, 355M, 774M or 1.5B (vocabulary "
          "50257, context 1024); --layers, --d_model, --heads, --vocab, --context override it");

ABSL_FLAG(std::string, spec, "", "plan: model spec JSON file, as shardctl spec prints it");
ABSL_FLAG(int, world, 0, "plan: world size (ranks), 1 to 131072");
ABSL_FLAG(int, stage, 3, "plan: the ZeRO stage (0-3) to mark in the memory estimate");
ABSL_FLAG(int64_t, max_unit_bytes, 0,
          "plan: bytes per packed unit of unlabeled tensors (0: the planner's 256 MiB)");
ABSL_FLAG(int, prefetch, 1, "plan: units gathered ahead of use at stage 3");
ABSL_FLAG(int, shard_group_size, 0,
          "plan: hybrid sharding, shards spread over groups of this many consecutive ranks and "
          "replicated across the --world / G groups (0: over every rank)");
ABSL_FLAG(int, secondary_shard_group_size, 0,
          "plan: hpZ's secondary groups of H ranks (0: none; H divides --world and is smaller "
          "than the shard groups): adds each rank's f32 secondary slice to the stage-3 memory");
ABSL_FLAG(bool, local, false, "plan: plan in-process instead of asking --server");
ABSL_FLAG(std::string, param_dtype, "f32", "plan: parameter (compute) dtype: f32, bf16 or f16");
ABSL_FLAG(std::string, reduce_dtype, "", "plan: gradient reduce dtype (empty: --param_dtype)");

namespace zeroshard {
namespace {

// ---- spec ----

struct GivenFlag {
  const char* name;
  bool given;
};

// INVALID_ARGUMENT listing every flag of `flags` that was not given.
absl::Status RequireFlags(const std::string& model, const std::vector<GivenFlag>& flags) {
  std::vector<std::string> missing;
  for (const GivenFlag& flag : flags) {
    if (!flag.given) missing.push_back(absl::StrCat("--", flag.name));
  }
  if (missing.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("spec --model=", model, " needs ", absl::StrJoin(missing, ", ")));
}

// INVALID_ARGUMENT naming a given flag of `flags`: it belongs to the other
// model, and silently ignoring it would hide a typo in --model.
absl::Status RefuseFlags(const std::string& model, const std::vector<GivenFlag>& flags) {
  for (const GivenFlag& flag : flags) {
    if (flag.given) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag.name, " does not apply to spec --model=", model));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelSpec> SpecFromFlags() {
  const std::string model = absl::GetFlag(FLAGS_model);
  const int layers = absl::GetFlag(FLAGS_layers);
  const int64_t width = absl::GetFlag(FLAGS_width);
  const std::string activation = absl::GetFlag(FLAGS_activation);
  const int d_model = absl::GetFlag(FLAGS_d_model);
  const int heads = absl::GetFlag(FLAGS_heads);
  const int vocab = absl::GetFlag(FLAGS_vocab);
  const int context = absl::GetFlag(FLAGS_context);
  if (model == "mlp") {
    absl::Status s = RefuseFlags(model, {{"preset", !absl::GetFlag(FLAGS_preset).empty()},
                                         {"d_model", d_model != 0},
                                         {"heads", heads != 0},
                                         {"vocab", vocab != 0},
                                         {"context", context != 0}});
    if (s.ok()) s = RequireFlags(model, {{"layers", layers != 0}, {"width", width != 0}});
    if (!s.ok()) return s;
    return MlpSpec(layers, width, activation.empty() ? "none" : activation);
  }
  if (model == "gpt2") {
    absl::Status s =
        RefuseFlags(model, {{"width", width != 0}, {"activation", !activation.empty()}});
    if (!s.ok()) return s;
    const std::string preset_name = absl::GetFlag(FLAGS_preset);
    if (!preset_name.empty()) {
      absl::StatusOr<Gpt2Shape> preset = Gpt2Preset(preset_name);
      if (!preset.ok()) return preset.status();
      return Gpt2Spec(layers != 0 ? layers : preset->layers,
                      d_model != 0 ? d_model : preset->d_model, heads != 0 ? heads : preset->heads,
                      vocab != 0 ? vocab : preset->vocab, context != 0 ? context : preset->context);
    }
    {
      s = RequireFlags(model, {{"layers", layers != 0},
                               {"d_model", d_model != 0},
                               {"heads", heads != 0},
                               {"vocab", vocab != 0},
                               {"context", context != 0}});
    }
    if (!s.ok()) return s;
    return Gpt2Spec(layers, d_model, heads, vocab, context);
  }
  return absl::InvalidArgumentError(
      model.empty() ? "spec needs --model=mlp or --model=gpt2"
                    : absl::StrCat("spec: --model is \"", model, "\"; expected mlp or gpt2"));
}

// ---- plan ----

struct PlanRequest {
  ModelSpec spec;
  int world_size = 0;
  PlanOptions options;
  MemoryEstimateOptions estimate;
  int stage = 3;
};

absl::StatusOr<ModelSpec> ReadSpecFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("spec file \"", path, "\": ", text.status().message()));
  }
  absl::StatusOr<ModelSpec> spec = ParseModelSpecJson(*text);
  if (!spec.ok()) {
    return absl::Status(spec.status().code(),
                        absl::StrCat("spec file \"", path, "\": ", spec.status().message()));
  }
  return spec;
}

// Everything `plan` needs from its flags, checked before any planning so that
// a typo costs no round trip and no planning time.
absl::StatusOr<PlanRequest> PlanRequestFromFlags() {
  PlanRequest request;
  const std::string path = absl::GetFlag(FLAGS_spec);
  if (path.empty()) {
    return absl::InvalidArgumentError(
        "plan needs --spec=FILE (a model spec JSON file; see shardctl spec)");
  }
  request.world_size = absl::GetFlag(FLAGS_world);
  if (request.world_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan needs --world=N, the number of ranks (1 to ", kMaxWorldSize, ")"));
  }
  request.stage = absl::GetFlag(FLAGS_stage);
  if (request.stage < 0 || request.stage > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stage is ", request.stage, "; expected a ZeRO stage 0 to 3"));
  }
  request.options.max_unit_bytes = absl::GetFlag(FLAGS_max_unit_bytes);
  request.options.shard_group_size = absl::GetFlag(FLAGS_shard_group_size);
  // Dtype names are F32/BF16/F16 in specs and plans; people type f32.
  request.estimate.param_dtype = absl::AsciiStrToUpper(absl::GetFlag(FLAGS_param_dtype));
  request.estimate.reduce_dtype = absl::AsciiStrToUpper(absl::GetFlag(FLAGS_reduce_dtype));
  request.estimate.prefetch = absl::GetFlag(FLAGS_prefetch);
  request.estimate.secondary_shard_group_size = absl::GetFlag(FLAGS_secondary_shard_group_size);
  // The estimate's own rules decide which dtypes and prefetch values are
  // valid; an empty plan lets them run now instead of after planning.
  ShardPlan empty;
  empty.world_size = 1;
  absl::StatusOr<MemoryEstimate> probe = EstimateMemory(empty, request.estimate);
  if (!probe.ok()) return probe.status();

  absl::StatusOr<ModelSpec> spec = ReadSpecFile(path);
  if (!spec.ok()) return spec.status();
  request.spec = *std::move(spec);
  return request;
}

absl::StatusOr<ShardPlan> PlanOnServer(const PlanRequest& request) {
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectFromFlags();
  if (!client.ok()) return client.status();
  // Never joined, so no member credentials: the server plans once and keeps
  // nothing.
  // The client validated the plan: the estimate and the tables rely on its
  // pieces lying inside its chunks.
  return (*client)->PlanShards(request.spec, request.options, request.world_size);
}

// 124439808 -> "124,439,808".
std::string Count(int64_t n) {
  std::string digits = absl::StrCat(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

std::string Percent(double fraction) { return absl::StrFormat("%.3f%%", 100 * fraction); }

int64_t UnitElements(const ShardUnit& unit) {
  int64_t elements = 0;
  for (const TensorSpec& tensor : unit.tensors) elements += tensor.Elements();
  return elements;
}

// Bytes of one element of `dtype`; the planner accepted the dtype already.
int64_t ElementBytes(const std::string& dtype) {
  absl::StatusOr<DType> parsed = ParseDType(dtype);
  return parsed.ok() ? DTypeSize(*parsed) : 0;
}

std::string SummaryText(const ShardPlan& plan, const MemoryEstimate& estimate) {
  size_t tensors = 0;
  size_t pieces = 0;
  const ShardUnit* largest = nullptr;  // the largest gathered unit: W * chunk
  for (const ShardUnit& unit : plan.units) {
    tensors += unit.tensors.size();
    pieces += unit.pieces.size();
    if (largest == nullptr || unit.chunk_elements > largest->chunk_elements) largest = &unit;
  }
  const int64_t p = ElementBytes(estimate.param_dtype);
  std::string out = absl::StrFormat("Plan %s for %d ranks\n", plan.hash, plan.world_size);
  absl::StrAppendFormat(&out, "  parameters    %s in %d tensors\n", Count(estimate.parameters),
                        tensors);
  absl::StrAppendFormat(&out, "  units         %d (max_unit_bytes %s, alignment %d elements)\n",
                        plan.units.size(), HumanBytes(plan.options.max_unit_bytes),
                        plan.options.alignment_elements);
  const ShardGroups groups = plan.options.Groups(plan.world_size);
  if (groups.hybrid()) {
    absl::StrAppendFormat(&out,
                          "  shard groups  %d groups of %d consecutive ranks, each holding the "
                          "model sharded %d ways (per-rank figures below are a %d-rank job's)\n",
                          groups.count(), groups.size(), groups.size(), groups.size());
  }
  absl::StrAppendFormat(&out, "  pieces        %s\n", Count(pieces));
  absl::StrAppendFormat(&out, "  padding       %s\n", Percent(PaddingOverhead(plan)));
  if (largest != nullptr) {
    absl::StrAppendFormat(&out, "  largest unit  %s: %s elements gathered (%s at %s)\n",
                          largest->name, Count(estimate.largest_unit_elements),
                          HumanBytes(static_cast<double>(estimate.largest_unit_elements) * p),
                          estimate.param_dtype);
  }
  return out;
}

std::string UnitTable(const ShardPlan& plan) {
  Table table({"UNIT", "TENSORS", "ELEMENTS", "CHUNK", "PIECES", "PADDING"});
  for (const ShardUnit& unit : plan.units) {
    const int64_t elements = UnitElements(unit);
    const double allocated =
        static_cast<double>(plan.options.Groups(plan.world_size).size()) * unit.chunk_elements;
    table.AddRow({unit.name, absl::StrCat(unit.tensors.size()), Count(elements),
                  Count(unit.chunk_elements), Count(unit.pieces.size()),
                  Percent(elements > 0 ? allocated / elements - 1 : 0)});
  }
  return table.ToString();
}

// What each rank owns (its pieces, in the tensors' own dtypes) against what
// it allocates (its chunks): the spread shows the balance, the gap padding.
std::string PerRankText(const ShardPlan& plan, const MemoryEstimate& estimate) {
  std::vector<int64_t> elements(plan.world_size, 0);
  std::vector<int64_t> bytes(plan.world_size, 0);
  for (const ShardUnit& unit : plan.units) {
    for (const Piece& piece : unit.pieces) {
      const TensorSpec& tensor = unit.tensors[piece.tensor];
      const int64_t n = (piece.row_end - piece.row_begin) * tensor.RowElements();
      elements[piece.rank] += n;
      bytes[piece.rank] += n * ElementBytes(tensor.dtype);
    }
  }
  const int min_rank = std::min_element(bytes.begin(), bytes.end()) - bytes.begin();
  const int max_rank = std::max_element(bytes.begin(), bytes.end()) - bytes.begin();
  Table table({"PER RANK", "ELEMENTS", "BYTES", "RANK"});
  table.AddRow({"owned, min", Count(elements[min_rank]), HumanBytes(bytes[min_rank]),
                absl::StrCat(min_rank)});
  table.AddRow({"owned, max", Count(elements[max_rank]), HumanBytes(bytes[max_rank]),
                absl::StrCat(max_rank)});
  table.AddRow({"chunks", Count(estimate.shard_elements),
                absl::StrCat(HumanBytes(static_cast<double>(estimate.shard_elements) *
                                        ElementBytes(estimate.param_dtype)),
                             " at ", estimate.param_dtype),
                "every"});
  return table.ToString();
}

std::string MemoryText(const MemoryEstimate& estimate, int selected_stage) {
  std::string out = absl::StrFormat(
      "Memory per rank: Adam with %s parameters, %s gradients, %d optimizer bytes per "
      "parameter, prefetch %d\n",
      estimate.param_dtype, estimate.reduce_dtype, estimate.optimizer_bytes_per_parameter,
      estimate.prefetch);
  // hpZ adds a column: each rank's secondary slice (stage 3).
  const bool hpz = estimate.secondary_shard_group_size > 0;
  std::vector<std::string> columns = {"STAGE", "PARAMS", "GRADS", "OPTIMIZER", "WINDOW"};
  if (hpz) columns.push_back("SECONDARY");
  columns.insert(columns.end(), {"PADDING", "TOTAL"});
  Table table(columns);
  for (const StageMemory& stage : estimate.stages) {
    std::vector<std::string> row = {
        absl::StrCat(stage.stage, stage.stage == selected_stage ? " *" : ""),
        HumanBytes(stage.parameter_bytes), HumanBytes(stage.gradient_bytes),
        HumanBytes(stage.optimizer_bytes), HumanBytes(stage.unsharded_window_bytes)};
    if (hpz) row.push_back(HumanBytes(stage.secondary_bytes));
    row.insert(row.end(), {HumanBytes(stage.padding_bytes), HumanBytes(stage.total_bytes)});
    table.AddRow(row);
  }
  absl::StrAppend(&out, table.ToString(), "* --stage=", selected_stage,
                  hpz ? absl::StrCat("; SECONDARY: hpZ's f32 slices, secondary groups of ",
                                     estimate.secondary_shard_group_size)
                      : "",
                  "; activations and communication buffers not included\n");
  return out;
}

}  // namespace

int SpecCommand() {
  absl::StatusOr<ModelSpec> spec = SpecFromFlags();
  if (!spec.ok()) return Fail(spec.status());
  // A spec the planner would refuse (a shape past int64) is refused here,
  // not printed for `plan` to refuse.
  if (absl::StatusOr<ShardPlan> plan = Plan(*spec, 1, PlanOptions{}); !plan.ok()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("these flags describe a model that cannot be planned: ",
                     plan.status().message())));
  }
  std::printf("%s\n", ModelSpecToJson(*spec).c_str());
  return 0;
}

int PlanCommand() {
  absl::StatusOr<PlanRequest> request = PlanRequestFromFlags();
  if (!request.ok()) return Fail(request.status());
  absl::StatusOr<ShardPlan> plan = absl::GetFlag(FLAGS_local)
                                       ? Plan(request->spec, request->world_size, request->options)
                                       : PlanOnServer(*request);
  if (!plan.ok()) return Fail(plan.status());
  absl::StatusOr<MemoryEstimate> estimate = EstimateMemory(*plan, request->estimate);
  if (!estimate.ok()) return Fail(estimate.status());

  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::ordered_json extra = nlohmann::ordered_json::object();
    extra["memory_estimate"] = MemoryEstimateJson(*estimate);
    std::printf("%s\n", PlanToJson(*plan, extra).c_str());
    return 0;
  }
  std::printf("%s\n%s\n%s\n%s", SummaryText(*plan, *estimate).c_str(), UnitTable(*plan).c_str(),
              PerRankText(*plan, *estimate).c_str(), MemoryText(*estimate, request->stage).c_str());
  return 0;
}

}  // namespace zeroshard
