// Shard planner benchmark.
//
//   bazel run -c opt //tests/bench:planner_bench -- [--json_out=FILE]
//
// 1. Padding: for GPT-2 124M, 355M, 774M and 1.5B (Hugging Face shapes, one
//    unit per block plus "embed") at W = 2, 8, 64, 512, our plan's padding
//    overhead, (sum over units of W * chunk) / (sum of elements) - 1, beside
//    what FSDP2's per-parameter dim-0 sharding pads for the same spec (each
//    tensor's rows padded up to a multiple of W): sum of ceil(rows / W) * W *
//    row_elements / sum of elements - 1. Also the plan's time and pieces.
// 2. Scale: the time to plan 1,000,000 tensors over 4,096 ranks (target
//    < 1 s). The spec is mixture-of-experts shaped: 64 layers, each one unit
//    of 15,625 tensors (attention, norms, router and 5,206 SwiGLU experts of
//    three [512, 1024] / [1024, 512] matrices), 5.2e11 parameters. Plan time
//    grows with pieces, about (tensors + W) per unit, so a spec cut into many
//    more units than this one costs more (see --units).
//
// Median of --repeats runs; planning is single-threaded.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/model_spec.h"
#include "common/model_zoo.h"
#include "nlohmann/json.hpp"
#include "common/plan/plan_codec.h"
#include "common/plan/planner.h"

ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");
ABSL_FLAG(int, repeats, 3, "Runs per measurement; the median is reported");
ABSL_FLAG(int, tensors, 1000000, "Tensors in the scale run");
ABSL_FLAG(int, world, 4096, "World size of the scale run");
ABSL_FLAG(int, units, 64, "Units (layers) the scale run's tensors are labeled into");

namespace zeroshard {
namespace {

struct Gpt2Size {
  const char* name;
  int layers, d_model, heads;
};
constexpr Gpt2Size kGpt2Sizes[] = {{"gpt2-124M", 12, 768, 12},
                                   {"gpt2-355M", 24, 1024, 16},
                                   {"gpt2-774M", 36, 1280, 20},
                                   {"gpt2-1.5B", 48, 1600, 25}};
constexpr int kWorldSizes[] = {2, 8, 64, 512};

// FSDP2 shards every parameter on dim 0 and pads its rows to a multiple of W.
double Fsdp2Padding(const ModelSpec& spec, int w) {
  double padded = 0, elements = 0;
  for (const TensorSpec& t : spec.tensors) {
    const int64_t rows = t.Rows();
    padded += static_cast<double>((rows + w - 1) / w) * w * t.RowElements();
    elements += static_cast<double>(t.Elements());
  }
  return padded / elements - 1;
}

struct Timed {
  ShardPlan plan;
  double seconds = 0;  // median
};

// Plans `repeats` times; exits on a refused spec (a bug in this benchmark).
Timed TimePlan(const ModelSpec& spec, int w, int repeats) {
  Timed result;
  std::vector<double> seconds;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    const absl::Time start = absl::Now();
    absl::StatusOr<ShardPlan> plan = Plan(spec, w, PlanOptions());
    seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    if (!plan.ok()) {
      std::fprintf(stderr, "planning failed: %s\n", plan.status().ToString().c_str());
      std::exit(1);
    }
    result.plan = *std::move(plan);
  }
  std::sort(seconds.begin(), seconds.end());
  result.seconds = seconds[seconds.size() / 2];
  return result;
}

size_t Pieces(const ShardPlan& plan) {
  size_t n = 0;
  for (const ShardUnit& unit : plan.units) n += unit.pieces.size();
  return n;
}

void Add(ModelSpec& spec, std::string name, std::vector<int64_t> shape, const std::string& unit) {
  TensorSpec& t = spec.tensors.emplace_back();
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dtype = "BF16";
  t.unit = unit;
}

// The mixture-of-experts spec of the scale run (see the top of this file).
ModelSpec MixtureOfExpertsSpec(int tensors, int units) {
  ModelSpec spec;
  spec.tensors.reserve(tensors);
  const int per_unit = tensors / units;
  for (int u = 0; u < units; ++u) {
    const std::string unit = absl::StrCat("layers.", u);
    const std::string prefix = unit + ".";
    // Unit u gets the remainder's extra tensor when tensors % units != 0.
    const int count = per_unit + (u < tensors % units ? 1 : 0);
    int made = 0;
    const std::pair<const char*, std::vector<int64_t>> kDense[] = {
        {"attn.qkv.weight", {3072, 1024}},
        {"attn.out.weight", {1024, 1024}},
        {"norm1.weight", {1024}},
        {"norm2.weight", {1024}},
        {"router.weight", {512, 1024}},
        {"router.bias", {512}},
        {"attn.scale", {}}};
    for (const auto& [name, shape] : kDense) {
      if (made == count) break;
      Add(spec, prefix + name, shape, unit);
      ++made;
    }
    for (int e = 0; made < count; ++e) {
      const char* kExpert[] = {"w1", "w2", "w3"};
      for (int k = 0; k < 3 && made < count; ++k, ++made) {
        Add(spec, absl::StrCat(prefix, "experts.", e, ".", kExpert[k], ".weight"),
            k == 1 ? std::vector<int64_t>{1024, 512} : std::vector<int64_t>{512, 1024}, unit);
      }
    }
  }
  return spec;
}

int Run() {
  const int repeats = absl::GetFlag(FLAGS_repeats);
  nlohmann::ordered_json padding_json;
  std::printf("%-10s %5s %10s %10s %10s %9s\n", "model", "W", "ours", "fsdp2", "plan ms", "pieces");
  for (const Gpt2Size& size : kGpt2Sizes) {
    absl::StatusOr<ModelSpec> spec = Gpt2Spec(size.layers, size.d_model, size.heads, 50257, 1024);
    if (!spec.ok()) {
      std::fprintf(stderr, "%s\n", spec.status().ToString().c_str());
      return 1;
    }
    for (int w : kWorldSizes) {
      const Timed timed = TimePlan(*spec, w, repeats);
      const double ours = PaddingOverhead(timed.plan);
      const double fsdp2 = Fsdp2Padding(*spec, w);
      std::printf("%-10s %5d %9.3f%% %9.3f%% %10.2f %9zu\n", size.name, w, 100 * ours, 100 * fsdp2,
                  1e3 * timed.seconds, Pieces(timed.plan));
      nlohmann::ordered_json& entry = padding_json[size.name][std::to_string(w)];
      entry["ours"] = ours;
      entry["fsdp2"] = fsdp2;
      entry["plan_seconds"] = timed.seconds;
      entry["pieces"] = Pieces(timed.plan);
    }
  }

  const int tensors = absl::GetFlag(FLAGS_tensors);
  const int world = absl::GetFlag(FLAGS_world);
  const int units = std::max(1, std::min(absl::GetFlag(FLAGS_units), tensors));
  const ModelSpec big = MixtureOfExpertsSpec(tensors, units);
  const Timed timed = TimePlan(big, world, repeats);
  std::printf(
      "\nplan %d tensors (%d units) over %d ranks: %.3f s (median of %d), %zu pieces, "
      "padding %.4f%%\n",
      tensors, units, world, timed.seconds, std::max(1, repeats), Pieces(timed.plan),
      100 * PaddingOverhead(timed.plan));

  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  if (!json_out.empty()) {
    nlohmann::ordered_json out;
    out["padding"] = std::move(padding_json);
    out[absl::StrCat("plan_", tensors == 1000000 ? "1m" : std::to_string(tensors), "_tensors_",
                     world, "_ranks_seconds")] = timed.seconds;
    out["scale_run"] = {{"tensors", tensors},
                        {"units", units},
                        {"world_size", world},
                        {"pieces", Pieces(timed.plan)},
                        {"padding_overhead", PaddingOverhead(timed.plan)}};
    std::ofstream file(json_out);
    file << out.dump(2) << "\n";
    if (!file) {
      std::fprintf(stderr, "cannot write %s\n", json_out.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Run();
}
