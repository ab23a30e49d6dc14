#include "common/plan/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/model_zoo.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;

TensorSpec Tensor(std::string name, std::vector<int64_t> shape, std::string unit = "",
                  std::string dtype = "F32") {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dtype = std::move(dtype);
  t.unit = std::move(unit);
  return t;
}

int64_t Rows(const TensorSpec& t) { return t.shape.empty() ? 1 : t.shape[0]; }
int64_t RowElements(const TensorSpec& t) {
  int64_t n = 1;
  for (size_t d = 1; d < t.shape.size(); ++d) n *= t.shape[d];
  return n;
}
int64_t Elements(const TensorSpec& t) { return Rows(t) * RowElements(t); }
int64_t PieceElements(const ShardUnit& unit, const Piece& p) {
  return (p.row_end - p.row_begin) * RowElements(unit.tensors[p.tensor]);
}
int64_t UnitElements(const ShardUnit& unit) {
  int64_t n = 0;
  for (const TensorSpec& t : unit.tensors) n += Elements(t);
  return n;
}
int64_t Bytes(const TensorSpec& t) {
  const std::string& d = t.dtype;
  const int size = d == "F64" || d == "I64"                  ? 8
                   : d == "F32" || d == "I32"                ? 4
                   : d == "BF16" || d == "F16" || d == "I16" ? 2
                                                             : 1;
  return Elements(t) * size;
}

// Σ units W * chunk / Σ elements - 1, as the issue defines padding overhead.
double Padding(const ShardPlan& plan) {
  double allocated = 0, elements = 0;
  for (const ShardUnit& unit : plan.units) {
    allocated += static_cast<double>(plan.world_size) * unit.chunk_elements;
    elements += UnitElements(unit);
  }
  return allocated / elements - 1;
}

ModelSpec Gpt2(int layers, int d_model, int heads) {
  absl::StatusOr<ModelSpec> spec = Gpt2Spec(layers, d_model, heads, 50257, 1024);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// The plan's invariants, checked here independently of ValidatePlan: every
// element of every spec tensor in exactly one piece; every rank's pieces
// disjoint and inside [0, chunk); pieces sorted by (rank, offset); the
// longest-first bound; chunks aligned and tight.
void ExpectPlanInvariants(const ModelSpec& spec, const ShardPlan& plan) {
  const int w = plan.world_size;
  const int64_t alignment = plan.options.alignment_elements;
  size_t tensors_seen = 0;
  for (const ShardUnit& unit : plan.units) {
    SCOPED_TRACE(absl::StrCat("unit ", unit.name, " W=", w));
    tensors_seen += unit.tensors.size();
    // Rows covered exactly once: count per tensor, then walk sorted ranges.
    std::vector<std::vector<std::pair<int64_t, int64_t>>> rows(unit.tensors.size());
    std::vector<int64_t> load(w, 0);
    int64_t largest_piece = 0;
    for (size_t i = 0; i < unit.pieces.size(); ++i) {
      const Piece& p = unit.pieces[i];
      ASSERT_GE(p.tensor, 0);
      ASSERT_LT(p.tensor, static_cast<int>(unit.tensors.size()));
      ASSERT_GE(p.rank, 0);
      ASSERT_LT(p.rank, w);
      ASSERT_LT(p.row_begin, p.row_end);
      rows[p.tensor].push_back({p.row_begin, p.row_end});
      const int64_t n = PieceElements(unit, p);
      largest_piece = std::max(largest_piece, n);
      ASSERT_GE(p.offset, 0);
      ASSERT_LE(p.offset + n, unit.chunk_elements);
      if (i > 0) {
        const Piece& prev = unit.pieces[i - 1];
        ASSERT_TRUE(prev.rank < p.rank || (prev.rank == p.rank && prev.offset < p.offset))
            << "pieces not sorted by (rank, offset) at " << i;
        if (prev.rank == p.rank) {
          ASSERT_LE(prev.offset + PieceElements(unit, prev), p.offset) << "overlap at " << i;
        }
      }
      load[p.rank] = std::max(load[p.rank], p.offset + n);
    }
    for (size_t t = 0; t < rows.size(); ++t) {
      std::sort(rows[t].begin(), rows[t].end());
      int64_t covered = 0;
      for (const auto& [begin, end] : rows[t]) {
        ASSERT_EQ(begin, covered) << unit.tensors[t].name;
        covered = end;
      }
      ASSERT_EQ(covered, Rows(unit.tensors[t])) << unit.tensors[t].name;
    }
    const int64_t elements = UnitElements(unit);
    const int64_t max_load = *std::max_element(load.begin(), load.end());
    EXPECT_LE(max_load, (elements + w - 1) / w + largest_piece) << "longest-first bound";
    EXPECT_EQ(unit.chunk_elements % alignment, 0);
    EXPECT_EQ(unit.chunk_elements, (max_load + alignment - 1) / alignment * alignment);
  }
  EXPECT_EQ(tensors_seen, spec.tensors.size());
}

void ExpectSamePlan(const ShardPlan& a, const ShardPlan& b) {
  ASSERT_EQ(a.hash, b.hash);
  ASSERT_EQ(a.units.size(), b.units.size());
  for (size_t u = 0; u < a.units.size(); ++u) {
    ASSERT_EQ(a.units[u].name, b.units[u].name);
    ASSERT_EQ(a.units[u].chunk_elements, b.units[u].chunk_elements);
    ASSERT_EQ(a.units[u].pieces.size(), b.units[u].pieces.size());
    for (size_t i = 0; i < a.units[u].pieces.size(); ++i) {
      const Piece& x = a.units[u].pieces[i];
      const Piece& y = b.units[u].pieces[i];
      ASSERT_EQ(std::tie(x.tensor, x.row_begin, x.row_end, x.rank, x.offset),
                std::tie(y.tensor, y.row_begin, y.row_end, y.rank, y.offset));
    }
  }
}

// A random spec: 0-d to 3-d shapes from tiny to ~1M elements, all dtypes,
// labels from a small pool (so labels recur non-consecutively) or none.
ModelSpec RandomSpec(std::mt19937_64& rng) {
  static const char* kDTypes[] = {"F32", "BF16", "F16", "F64", "I64",
                                  "I32", "I16",  "I8",  "U8",  "BOOL"};
  static const char* kLabels[] = {"a", "b", "c", "d", "e", "f"};
  auto uniform = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  ModelSpec spec;
  const int n = static_cast<int>(uniform(1, 40));
  const int label_percent = static_cast<int>(uniform(0, 100));
  for (int i = 0; i < n; ++i) {
    std::vector<int64_t> shape;
    const int ndim = static_cast<int>(uniform(0, 3));
    for (int d = 0; d < ndim; ++d) {
      shape.push_back(uniform(0, 3) == 0 ? uniform(1, 4) : uniform(1, ndim == 1 ? 200000 : 1000));
    }
    std::string label = uniform(0, 99) < label_percent ? kLabels[uniform(0, 5)] : "";
    spec.tensors.push_back(Tensor(absl::StrCat("t", i), shape, label, kDTypes[uniform(0, 9)]));
  }
  return spec;
}

// ---------------------------------------------------------------------------
// Properties over random specs

TEST(PlannerProperty, RandomSpecsKeepEveryInvariant) {
  std::mt19937_64 rng(20261122);
  const int64_t kAlignments[] = {0, 1, 7, 64, 256};
  const double kSplitFractions[] = {0, 1.0 / 64, 0.25, 1};
  for (int iteration = 0; iteration < 1000; ++iteration) {
    SCOPED_TRACE(absl::StrCat("iteration ", iteration));
    const ModelSpec spec = RandomSpec(rng);
    // Log-uniform W in [1, 1024].
    const int w = static_cast<int>(
        std::lround(std::exp2(std::uniform_real_distribution<double>(0, 10)(rng))));
    PlanOptions options;
    options.alignment_elements = kAlignments[rng() % 5];
    options.split_fraction = kSplitFractions[rng() % 4];
    options.max_unit_bytes = rng() % 3 == 0 ? 0 : static_cast<int64_t>(1 + rng() % 4000000);

    absl::StatusOr<ShardPlan> plan = Plan(spec, w, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_NO_FATAL_FAILURE(ExpectPlanInvariants(spec, *plan));
    ASSERT_TRUE(ValidatePlan(spec, *plan).ok()) << ValidatePlan(spec, *plan);

    absl::StatusOr<ShardPlan> again = Plan(spec, w, options);
    ASSERT_TRUE(again.ok());
    ASSERT_NO_FATAL_FAILURE(ExpectSamePlan(*plan, *again));
    ASSERT_EQ(plan->hash, PlanHash(*again));
  }
}

TEST(PlannerProperty, UnitsFollowLabelsAndPackRunsOfUnlabeledTensors) {
  std::mt19937_64 rng(7);
  for (int iteration = 0; iteration < 200; ++iteration) {
    SCOPED_TRACE(absl::StrCat("iteration ", iteration));
    const ModelSpec spec = RandomSpec(rng);
    PlanOptions options;
    options.max_unit_bytes = static_cast<int64_t>(1 + rng() % 2000000);
    absl::StatusOr<ShardPlan> plan = Plan(spec, 1 + static_cast<int>(rng() % 16), options);
    ASSERT_TRUE(plan.ok()) << plan.status();

    // Spec index of every unit tensor; units by first appearance, tensors in
    // spec order, labeled tensors in the unit named by their label.
    std::vector<int> first_index;
    int previous_first = -1;
    std::vector<int64_t> packed_bytes;
    for (const ShardUnit& unit : plan->units) {
      int previous = -1;
      int64_t bytes = 0;
      for (const TensorSpec& t : unit.tensors) {
        const int index = std::stoi(t.name.substr(1));
        ASSERT_GT(index, previous);
        previous = index;
        bytes += Bytes(t);
        if (!t.unit.empty()) {
          ASSERT_EQ(unit.name, t.unit);
        } else {
          ASSERT_EQ(unit.name.rfind("packed.", 0), 0u) << unit.name;
        }
      }
      const int first = std::stoi(unit.tensors.front().name.substr(1));
      ASSERT_GT(first, previous_first);
      previous_first = first;
      if (unit.tensors.front().unit.empty()) {
        // A packed unit holds a run of consecutive unlabeled tensors within
        // the budget, unless it is a single tensor above the budget.
        const int last = std::stoi(unit.tensors.back().name.substr(1));
        ASSERT_EQ(last - first + 1, static_cast<int>(unit.tensors.size()));
        if (unit.tensors.size() > 1) {
          ASSERT_LE(bytes, plan->options.max_unit_bytes);
        }
        // Maximal: the next tensor, if unlabeled, did not fit.
        if (static_cast<size_t>(last + 1) < spec.tensors.size() &&
            spec.tensors[last + 1].unit.empty()) {
          ASSERT_GT(bytes + Bytes(spec.tensors[last + 1]), plan->options.max_unit_bytes);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Padding on GPT-2

struct Gpt2Size {
  const char* name;
  int layers, d_model, heads;
};
constexpr Gpt2Size kGpt2Sizes[] = {
    {"124M", 12, 768, 12}, {"355M", 24, 1024, 16}, {"774M", 36, 1280, 20}, {"1.5B", 48, 1600, 25}};

TEST(PlannerPadding, Gpt2WithinOnePercentUpTo64RanksAndThreeAt512) {
  for (const Gpt2Size& size : kGpt2Sizes) {
    const ModelSpec spec = Gpt2(size.layers, size.d_model, size.heads);
    for (int w : {2, 8, 64, 512}) {
      SCOPED_TRACE(absl::StrCat("GPT-2 ", size.name, " W=", w));
      absl::StatusOr<ShardPlan> plan = Plan(spec, w, PlanOptions());
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_LE(Padding(*plan), w <= 64 ? 0.01 : 0.03);
      EXPECT_TRUE(ValidatePlan(spec, *plan).ok());
    }
  }
}

TEST(PlannerUnits, Gpt2EmbedUnitGathersWteWpeAndFinalLayerNorm) {
  const ModelSpec spec = Gpt2(2, 64, 4);
  absl::StatusOr<ShardPlan> plan = Plan(spec, 4, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->units.size(), 3u);
  EXPECT_EQ(plan->units[0].name, "embed");
  EXPECT_EQ(plan->units[1].name, "h.0");
  EXPECT_EQ(plan->units[2].name, "h.1");
  std::vector<std::string> embed;
  for (const TensorSpec& t : plan->units[0].tensors) embed.push_back(t.name);
  EXPECT_THAT(embed, ::testing::ElementsAre("transformer.wte.weight", "transformer.wpe.weight",
                                            "transformer.ln_f.weight", "transformer.ln_f.bias"));
}

// ---------------------------------------------------------------------------
// Behaviour on small, hand-checked specs

TEST(Planner, ZeroDimensionalTensorIsOneRowOfOneElement) {
  ModelSpec spec{{Tensor("scale", {})}};
  absl::StatusOr<ShardPlan> plan = Plan(spec, 8, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->units.size(), 1u);
  ASSERT_EQ(plan->units[0].pieces.size(), 1u);
  const Piece& p = plan->units[0].pieces[0];
  EXPECT_EQ(p.row_begin, 0);
  EXPECT_EQ(p.row_end, 1);
  EXPECT_EQ(p.rank, 0);
  EXPECT_EQ(p.offset, 0);
  EXPECT_EQ(plan->units[0].chunk_elements, kDefaultAlignmentElements);
}

// FSDP2's layout: torch.chunk(t, S, dim=0) gives chunks of ceil(rows / S)
// rows, the last shorter and trailing ones missing when rows run out.
TEST(PlannerRowChunks, EveryTensorIsCutAsTorchChunkCutsIt) {
  ModelSpec spec{
      {Tensor("w", {10, 3}, "layer"), Tensor("b", {5}, "layer"), Tensor("scale", {}, "layer")}};
  PlanOptions options;
  options.row_chunk_ranks = 4;
  options.alignment_elements = 1;
  absl::StatusOr<ShardPlan> plan = Plan(spec, 4, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(ValidatePlan(spec, *plan).ok()) << ValidatePlan(spec, *plan);
  ASSERT_EQ(plan->units.size(), 1u);
  std::vector<std::tuple<std::string, int64_t, int64_t, int>> got;
  for (const Piece& p : plan->units[0].pieces) {
    got.emplace_back(plan->units[0].tensors[p.tensor].name, p.row_begin, p.row_end, p.rank);
  }
  std::sort(got.begin(), got.end());
  using T = std::tuple<std::string, int64_t, int64_t, int>;
  EXPECT_EQ(got,
            (std::vector<T>{T{"b", 0, 2, 0}, T{"b", 2, 4, 1}, T{"b", 4, 5, 2}, T{"scale", 0, 1, 0},
                            T{"w", 0, 3, 0}, T{"w", 3, 6, 1}, T{"w", 6, 9, 2}, T{"w", 9, 10, 3}}));
  EXPECT_EQ(plan->units[0].chunk_elements, 9 + 2 + 1);  // rank 0: 3 rows of 3, 2, 1
}

TEST(PlannerRowChunks, RanksPastTheShardGroupHoldNothing) {
  ModelSpec spec{{Tensor("w", {8, 2})}};
  PlanOptions options;
  options.row_chunk_ranks = 2;  // HSDP: 2 replicas of a 2-rank shard group
  absl::StatusOr<ShardPlan> plan = Plan(spec, 4, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(ValidatePlan(spec, *plan).ok()) << ValidatePlan(spec, *plan);
  for (const Piece& p : plan->units[0].pieces) EXPECT_LT(p.rank, 2);
  EXPECT_EQ(plan->options.row_chunk_ranks, 2);
}

TEST(PlannerRowChunks, MoreChunkRanksThanTheWorldIsRefused) {
  PlanOptions options;
  options.row_chunk_ranks = 5;
  absl::StatusOr<ShardPlan> plan = Plan(ModelSpec{{Tensor("w", {8})}}, 4, options);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("row_chunk_ranks 5 exceeds the world size 4"));
}

TEST(PlannerRowChunks, TheLayoutIsPartOfTheHash) {
  ModelSpec spec{{Tensor("w", {8, 2})}};
  PlanOptions chunks;
  chunks.row_chunk_ranks = 1;
  // At W = 1 both layouts put everything on rank 0; the hashes still differ.
  EXPECT_NE(Plan(spec, 1, chunks)->hash, Plan(spec, 1, PlanOptions())->hash);
}

// Hybrid sharding: the G-rank plan's shard of member m is held by every
// rank r with r % G == m, and each of them saves a disjoint run of it.
TEST(PlannerShardGroups, EachGroupHoldsTheGroupPlansShardsSplitOverReplicas) {
  const ModelSpec spec = Gpt2(2, 64, 4);
  PlanOptions grouped;
  grouped.shard_group_size = 2;
  absl::StatusOr<ShardPlan> plan = Plan(spec, 6, grouped);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(ValidatePlan(spec, *plan).ok()) << ValidatePlan(spec, *plan);
  absl::StatusOr<ShardPlan> group_plan = Plan(spec, 2, PlanOptions());
  ASSERT_TRUE(group_plan.ok());
  ASSERT_EQ(plan->units.size(), group_plan->units.size());
  for (size_t u = 0; u < plan->units.size(); ++u) {
    const ShardUnit& unit = plan->units[u];
    EXPECT_EQ(unit.chunk_elements, group_plan->units[u].chunk_elements);
    // Every element of member m's chunk, by (tensor, row): where it sits.
    std::map<std::tuple<int, int, int64_t>, int64_t> want;  // (member, tensor, row) -> offset
    for (const Piece& p : group_plan->units[u].pieces) {
      for (int64_t row = p.row_begin; row < p.row_end; ++row) {
        want[{p.rank, p.tensor, row}] =
            p.offset + (row - p.row_begin) * unit.tensors[p.tensor].RowElements();
      }
    }
    std::map<std::tuple<int, int, int64_t>, int64_t> got;
    for (const Piece& p : unit.pieces) {
      for (int64_t row = p.row_begin; row < p.row_end; ++row) {
        const auto key = std::make_tuple(p.rank % 2, p.tensor, row);
        EXPECT_FALSE(got.count(key))
            << "row " << row << " saved twice in group member " << p.rank % 2;
        got[key] = p.offset + (row - p.row_begin) * unit.tensors[p.tensor].RowElements();
      }
    }
    EXPECT_EQ(got, want) << unit.name;
  }
}

TEST(PlannerShardGroups, AGroupSizeThatDoesNotDivideTheWorldIsRefused) {
  PlanOptions options;
  options.shard_group_size = 3;
  absl::StatusOr<ShardPlan> plan = Plan(ModelSpec{{Tensor("w", {8})}}, 4, options);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("shard_group_size 3 does not divide the world size 4"));
}

TEST(PlannerShardGroups, GroupsArePartOfTheHashAndAGroupOfAllIsNone) {
  ModelSpec spec{{Tensor("w", {8, 2})}};
  PlanOptions halves, all;
  halves.shard_group_size = 2;
  all.shard_group_size = 4;
  EXPECT_NE(Plan(spec, 4, halves)->hash, Plan(spec, 4, PlanOptions())->hash);
  EXPECT_EQ(Plan(spec, 4, all)->hash, Plan(spec, 4, PlanOptions())->hash);
}

TEST(Planner, OneDimensionalTensorIsCutIntoElementRanges) {
  ModelSpec spec{{Tensor("bias", {1000})}};
  PlanOptions options;
  options.alignment_elements = 1;
  absl::StatusOr<ShardPlan> plan = Plan(spec, 4, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const ShardUnit& unit = plan->units[0];
  EXPECT_EQ(unit.chunk_elements, 250);
  ASSERT_EQ(unit.pieces.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(unit.pieces[r].rank, r);
    EXPECT_EQ(unit.pieces[r].row_begin, 250 * r);
    EXPECT_EQ(unit.pieces[r].row_end, 250 * (r + 1));
  }
}

TEST(Planner, EvenSpecHasNoPaddingWithAlignmentOne) {
  ModelSpec spec;
  for (int i = 0; i < 6; ++i) spec.tensors.push_back(Tensor(absl::StrCat("w", i), {30, 7}, "u"));
  PlanOptions options;
  options.alignment_elements = 1;
  for (int w : {1, 2, 3, 5, 6, 9, 10}) {
    absl::StatusOr<ShardPlan> plan = Plan(spec, w, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->units[0].chunk_elements * w, 6 * 30 * 7) << "W=" << w;
  }
}

TEST(Planner, SingleRankHoldsEveryTensorWhole) {
  ModelSpec spec{{Tensor("a", {10, 10}), Tensor("b", {3}), Tensor("c", {})}};
  absl::StatusOr<ShardPlan> plan = Plan(spec, 1, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  const ShardUnit& unit = plan->units[0];
  ASSERT_EQ(unit.pieces.size(), 3u);
  EXPECT_EQ(unit.chunk_elements, 128);  // 104 elements, aligned to 64
  for (const Piece& p : unit.pieces) {
    EXPECT_EQ(p.rank, 0);
    EXPECT_EQ(p.row_end - p.row_begin, Rows(unit.tensors[p.tensor]));
  }
}

TEST(Planner, TensorsBelowTheSplitFractionStayWhole) {
  // 64 rows of 1000 plus 200 small 1-d tensors of 50 elements: fair share at
  // W=4 is 18,500; 1/64 of it is 289, so the small tensors are never cut.
  ModelSpec spec{{Tensor("big", {64, 1000}, "u")}};
  for (int i = 0; i < 200; ++i) spec.tensors.push_back(Tensor(absl::StrCat("s", i), {50}, "u"));
  PlanOptions options;
  options.split_fraction = 1.0 / 64;
  absl::StatusOr<ShardPlan> plan = Plan(spec, 4, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const Piece& p : plan->units[0].pieces) {
    const TensorSpec& t = plan->units[0].tensors[p.tensor];
    if (t.name != "big") {
      EXPECT_EQ(p.row_end - p.row_begin, 50) << t.name;
    }
  }
}

TEST(Planner, LargeTensorsAreCutOnlyWhereTheBalanceNeedsIt) {
  // Eight equal tensors over four ranks: two whole tensors per rank, no cuts.
  ModelSpec spec;
  for (int i = 0; i < 8; ++i) spec.tensors.push_back(Tensor(absl::StrCat("w", i), {128, 64}, "u"));
  absl::StatusOr<ShardPlan> plan = Plan(spec, 4, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->units[0].pieces.size(), 8u);
  EXPECT_EQ(plan->units[0].chunk_elements, 2 * 128 * 64);
}

TEST(Planner, PackedUnitsRespectMaxUnitBytesAndKeepOversizedTensorsAlone) {
  // F32: 1,000 elements = 4,000 bytes each; budget 10,000 bytes.
  ModelSpec spec{{Tensor("a", {1000}), Tensor("b", {1000}), Tensor("huge", {5000}),
                  Tensor("c", {1000}), Tensor("lab", {10}, "L"), Tensor("d", {1000})}};
  PlanOptions options;
  options.max_unit_bytes = 10000;
  absl::StatusOr<ShardPlan> plan = Plan(spec, 2, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::string> units;
  for (const ShardUnit& unit : plan->units) {
    std::string tensors;
    for (const TensorSpec& t : unit.tensors) absl::StrAppend(&tensors, t.name, " ");
    units.push_back(absl::StrCat(unit.name, ": ", tensors));
  }
  EXPECT_THAT(units, ::testing::ElementsAre("packed.0: a b ", "packed.1: huge ", "packed.2: c ",
                                            "L: lab ", "packed.3: d "));
}

TEST(Planner, PackedUnitMayFillItsBudgetExactly) {
  ModelSpec spec{{Tensor("a", {1000}), Tensor("b", {1000}), Tensor("c", {1})}};
  PlanOptions options;
  options.max_unit_bytes = 8000;  // a and b: 4,000 bytes each
  absl::StatusOr<ShardPlan> plan = Plan(spec, 2, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->units.size(), 2u);
  EXPECT_EQ(plan->units[0].tensors.size(), 2u);
}

TEST(Planner, PackedUnitNamesAvoidLabels) {
  ModelSpec spec{{Tensor("a", {4}), Tensor("b", {4}, "packed.0")}};
  absl::StatusOr<ShardPlan> plan = Plan(spec, 2, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->units[0].name, "packed.0~");
  EXPECT_EQ(plan->units[1].name, "packed.0");
  EXPECT_TRUE(ValidatePlan(spec, *plan).ok());
}

TEST(Planner, RecordsResolvedOptionsAndVersion) {
  ModelSpec spec{{Tensor("w", {16, 16})}};
  absl::StatusOr<ShardPlan> plan = Plan(spec, 2, PlanOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->version, kPlanVersion);
  EXPECT_EQ(plan->world_size, 2);
  EXPECT_EQ(plan->options.max_unit_bytes, kDefaultMaxUnitBytes);
  EXPECT_EQ(plan->options.alignment_elements, kDefaultAlignmentElements);
  EXPECT_EQ(plan->options.split_fraction, kDefaultSplitFraction);
  EXPECT_EQ(plan->hash.size(), 16u);
}

TEST(Planner, HashDependsOnWorldSizeAndOptions) {
  const ModelSpec spec = Gpt2(1, 64, 4);
  PlanOptions aligned_one;
  aligned_one.alignment_elements = 1;
  absl::StatusOr<ShardPlan> a = Plan(spec, 4, PlanOptions());
  absl::StatusOr<ShardPlan> b = Plan(spec, 8, PlanOptions());
  absl::StatusOr<ShardPlan> c = Plan(spec, 4, aligned_one);
  PlanOptions explicit_defaults;
  explicit_defaults.alignment_elements = kDefaultAlignmentElements;
  absl::StatusOr<ShardPlan> d = Plan(spec, 4, explicit_defaults);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
  EXPECT_NE(a->hash, b->hash);
  EXPECT_NE(a->hash, c->hash);
  EXPECT_EQ(a->hash, d->hash);  // defaults are resolved before hashing
}

// ---------------------------------------------------------------------------
// Refusals

void ExpectRefused(const ModelSpec& spec, int world_size, const PlanOptions& options,
                   const std::vector<std::string>& message_parts) {
  absl::StatusOr<ShardPlan> plan = Plan(spec, world_size, options);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  for (const std::string& part : message_parts) {
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr(part));
  }
}

TEST(PlannerRefuses, EmptySpec) { ExpectRefused(ModelSpec{}, 2, PlanOptions(), {"no tensors"}); }

TEST(PlannerRefuses, EmptyName) {
  ExpectRefused(ModelSpec{{Tensor("ok", {2}), Tensor("", {2})}}, 2, PlanOptions(),
                {"tensor 1", "empty name"});
}

TEST(PlannerRefuses, DuplicateName) {
  ExpectRefused(ModelSpec{{Tensor("w", {2}), Tensor("v", {2}), Tensor("w", {3})}}, 2, PlanOptions(),
                {"\"w\"", "duplicate", "tensor 0"});
}

TEST(PlannerRefuses, ZeroDimension) {
  ExpectRefused(ModelSpec{{Tensor("w", {3, 0})}}, 2, PlanOptions(), {"\"w\"", "[3, 0]", "= 0"});
}

TEST(PlannerRefuses, NegativeDimension) {
  ExpectRefused(ModelSpec{{Tensor("w", {-5, 2})}}, 2, PlanOptions(), {"\"w\"", "-5"});
}

TEST(PlannerRefuses, ElementCountOverflow) {
  ExpectRefused(ModelSpec{{Tensor("w", {int64_t{1} << 40, int64_t{1} << 40})}}, 2, PlanOptions(),
                {"\"w\"", "1099511627776", "overflows"});
  ExpectRefused(ModelSpec{{Tensor("v", {2, int64_t{1} << 32, int64_t{1} << 32})}}, 2, PlanOptions(),
                {"\"v\"", "overflows"});
}

TEST(PlannerRefuses, ByteCountOverflow) {
  // 2^61 elements fit in int64; 2^61 * 8 bytes of F64 do not.
  ExpectRefused(ModelSpec{{Tensor("w", {int64_t{1} << 61}, "", "F64")}}, 2, PlanOptions(),
                {"\"w\"", "2305843009213693952", "F64", "overflow"});
}

TEST(PlannerRefuses, SpecAboveTheTotalElementLimit) {
  ExpectRefused(ModelSpec{{Tensor("a", {int64_t{1} << 52}, "", "U8"),
                           Tensor("b", {int64_t{1} << 52}, "", "U8"), Tensor("c", {1}, "", "U8")}},
                2, PlanOptions(), {"\"c\"", "2^53"});
}

TEST(PlannerRefuses, UnknownDType) {
  ExpectRefused(ModelSpec{{Tensor("w", {2}, "", "FP8")}}, 2, PlanOptions(), {"\"w\"", "FP8"});
  ExpectRefused(ModelSpec{{Tensor("w", {2}, "", "f32")}}, 2, PlanOptions(), {"\"w\"", "f32"});
}

TEST(PlannerRefuses, WorldSizeOutOfRange) {
  const ModelSpec spec{{Tensor("w", {2})}};
  ExpectRefused(spec, 0, PlanOptions(), {"world size 0"});
  ExpectRefused(spec, -3, PlanOptions(), {"world size -3"});
  ExpectRefused(spec, kMaxWorldSize + 1, PlanOptions(), {"131073"});
  EXPECT_TRUE(Plan(spec, kMaxWorldSize, PlanOptions()).ok());
}

TEST(PlannerRefuses, OptionsOutOfRange) {
  const ModelSpec spec{{Tensor("w", {2})}};
  PlanOptions options;
  options.max_unit_bytes = -1;
  ExpectRefused(spec, 2, options, {"max_unit_bytes -1"});
  options = PlanOptions();
  options.alignment_elements = -4;
  ExpectRefused(spec, 2, options, {"alignment_elements -4"});
  options.alignment_elements = kMaxAlignmentElements + 1;
  ExpectRefused(spec, 2, options, {"alignment_elements 1048577"});
  options = PlanOptions();
  options.split_fraction = 1.5;
  ExpectRefused(spec, 2, options, {"split_fraction 1.5"});
  options.split_fraction = -0.1;
  ExpectRefused(spec, 2, options, {"split_fraction -0.1"});
  options.split_fraction = std::numeric_limits<double>::quiet_NaN();
  ExpectRefused(spec, 2, options, {"split_fraction nan"});
}

// ---------------------------------------------------------------------------
// ValidatePlan

class ValidatePlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = Gpt2(2, 64, 4);
    absl::StatusOr<ShardPlan> plan = Plan(spec_, 8, PlanOptions());
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = *plan;
    ASSERT_TRUE(ValidatePlan(spec_, plan_).ok());
  }
  // Re-hashes after a change, so the structural check is what refuses it.
  absl::Status Check() {
    plan_.hash = PlanHash(plan_);
    return ValidatePlan(spec_, plan_);
  }
  ModelSpec spec_;
  ShardPlan plan_;
};

TEST_F(ValidatePlanTest, RefusesRowsInNoPiece) {
  plan_.units[1].pieces.pop_back();
  EXPECT_EQ(Check().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ValidatePlanTest, RefusesRowsInTwoPieces) {
  // A copy of a piece on another rank, in room made at the end of the chunk.
  ShardUnit& unit = plan_.units[1];
  Piece extra = unit.pieces[0];
  extra.rank = (extra.rank + 1) % 8;
  extra.offset = unit.chunk_elements;
  unit.chunk_elements += (PieceElements(unit, extra) + 63) / 64 * 64;
  unit.pieces.push_back(extra);
  absl::Status status = Check();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("in two pieces"));
}

TEST_F(ValidatePlanTest, RefusesOverlappingPieces) {
  ShardUnit& unit = plan_.units[1];
  // Two pieces of the same rank: move the second onto the first.
  for (size_t i = 1; i < unit.pieces.size(); ++i) {
    if (unit.pieces[i].rank == unit.pieces[i - 1].rank) {
      unit.pieces[i].offset = unit.pieces[i - 1].offset;
      break;
    }
  }
  absl::Status status = Check();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("overlaps"));
}

TEST_F(ValidatePlanTest, RefusesPieceOutsideTheChunk) {
  plan_.units[0].pieces[0].offset = plan_.units[0].chunk_elements;
  EXPECT_EQ(Check().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ValidatePlanTest, RefusesRankOutsideTheWorld) {
  plan_.units[0].pieces[0].rank = 8;
  EXPECT_EQ(Check().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ValidatePlanTest, RefusesMissingOrForeignTensor) {
  ShardPlan original = plan_;
  plan_.units.pop_back();
  EXPECT_EQ(Check().code(), absl::StatusCode::kInvalidArgument);
  plan_ = original;
  plan_.units[0].tensors[0].name = "not.in.spec";
  EXPECT_EQ(Check().code(), absl::StatusCode::kInvalidArgument);
  plan_ = original;
  plan_.units[0].tensors[0].shape[0] += 1;
  EXPECT_EQ(Check().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ValidatePlanTest, RefusesUnalignedChunk) {
  plan_.units[0].chunk_elements += 1;
  EXPECT_EQ(Check().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ValidatePlanTest, ReportsAlteredPlanAsDataLoss) {
  plan_.hash = "0000000000000000";
  EXPECT_EQ(ValidatePlan(spec_, plan_).code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace zeroshard
