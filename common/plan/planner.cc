#include "common/plan/planner.h"

#include <xxhash.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/plan/planner_internal.h"

namespace zeroshard {
namespace planner_internal {

std::string Describe(size_t index, const TensorSpec& tensor) {
  return absl::StrCat("tensor ", index, " (\"", tensor.name, "\")");
}

absl::Status CheckWorldSize(int world_size) {
  if (world_size < 1 || world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size ", world_size, " is out of range; expected 1 to ", kMaxWorldSize));
  }
  return absl::OkStatus();
}

}  // namespace planner_internal

using planner_internal::CheckWorldSize;
using planner_internal::Describe;
using planner_internal::TensorSize;

namespace {

// Fills in the defaults of `options`, refusing values out of range.
absl::StatusOr<PlanOptions> ResolveOptions(const PlanOptions& options) {
  PlanOptions resolved = options;
  if (options.max_unit_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_unit_bytes ", options.max_unit_bytes,
                     " is negative; expected bytes > 0 (0: default)"));
  }
  if (options.max_unit_bytes == 0) resolved.max_unit_bytes = kDefaultMaxUnitBytes;

  if (options.alignment_elements < 0 || options.alignment_elements > kMaxAlignmentElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("alignment_elements ", options.alignment_elements,
                     " is out of range; expected 1 to ", kMaxAlignmentElements, " (0: default)"));
  }
  if (options.alignment_elements == 0) resolved.alignment_elements = kDefaultAlignmentElements;

  if (!std::isfinite(options.split_fraction) || options.split_fraction < 0 ||
      options.split_fraction > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("split_fraction ", options.split_fraction,
                     " is out of range; expected (0, 1] (0: default)"));
  }
  if (options.split_fraction == 0) resolved.split_fraction = kDefaultSplitFraction;
  if (options.row_chunk_ranks < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "row_chunk_ranks ", options.row_chunk_ranks,
        " is negative; expected 0 (the balanced planner) or the ranks of an FSDP2 shard group"));
  }
  return resolved;
}

// INVALID_ARGUMENT naming the first tensor whose name an earlier one has.
//
// Sorted 64-bit name hashes find candidates: one sequential sort instead of
// a million random probes into a hash table, about 2.5x faster at that size
// (which matters for the 1 s budget). Names are compared only if two hashes
// are equal, so a collision costs time, never a wrong refusal.
absl::Status CheckNamesUnique(const ModelSpec& spec) {
  std::vector<uint64_t> hashes;
  hashes.reserve(spec.tensors.size());
  for (const TensorSpec& tensor : spec.tensors) {
    hashes.push_back(XXH3_64bits(tensor.name.data(), tensor.name.size()));
  }
  std::sort(hashes.begin(), hashes.end());
  if (std::adjacent_find(hashes.begin(), hashes.end()) == hashes.end()) return absl::OkStatus();

  absl::flat_hash_map<absl::string_view, size_t> first_use;
  first_use.reserve(spec.tensors.size());
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    auto [it, inserted] = first_use.emplace(spec.tensors[i].name, i);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat(
          Describe(i, spec.tensors[i]), ": duplicate name, first used by tensor ", it->second));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<TensorSize>> planner_internal::MeasureTensors(const ModelSpec& spec) {
  if (spec.tensors.empty()) {
    return absl::InvalidArgumentError("model spec has no tensors; nothing to plan");
  }
  std::vector<TensorSize> sizes(spec.tensors.size());
  int64_t total_elements = 0;
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    const TensorSpec& tensor = spec.tensors[i];
    if (tensor.name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, " has an empty name; every tensor needs a unique name"));
    }
    absl::StatusOr<DType> dtype = ParseDType(tensor.dtype);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(Describe(i, tensor), ": dtype \"", tensor.dtype, "\" is not a safetensors ",
                       "dtype; expected F32, BF16, F16, F64, I64, I32, I16, I8, U8 or BOOL"));
    }

    TensorSize& size = sizes[i];
    size.rows = 1;
    size.row_elements = 1;
    for (size_t d = 0; d < tensor.shape.size(); ++d) {
      const int64_t dim = tensor.shape[d];
      if (dim <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(Describe(i, tensor), ": shape ",
                                                       ShapeString(tensor.shape), " has dimension ",
                                                       d, " = ", dim, "; dimensions must be > 0"));
      }
      if (d == 0) {
        size.rows = dim;
      } else if (__builtin_mul_overflow(size.row_elements, dim, &size.row_elements)) {
        return absl::InvalidArgumentError(absl::StrCat(Describe(i, tensor), ": shape ",
                                                       ShapeString(tensor.shape),
                                                       " overflows int64 elements"));
      }
    }
    if (__builtin_mul_overflow(size.rows, size.row_elements, &size.elements)) {
      return absl::InvalidArgumentError(absl::StrCat(
          Describe(i, tensor), ": shape ", ShapeString(tensor.shape), " overflows int64 elements"));
    }
    if (__builtin_mul_overflow(size.elements, int64_t{DTypeSize(*dtype)}, &size.bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(Describe(i, tensor), ": ", size.elements,
                                                     " elements of ", tensor.dtype,
                                                     " overflow int64 bytes"));
    }
    if (size.elements > kMaxTotalElements - total_elements) {
      return absl::InvalidArgumentError(
          absl::StrCat(Describe(i, tensor), ": with its ", size.elements,
                       " elements the spec exceeds the planner's limit of 2^53 elements in total"));
    }
    total_elements += size.elements;
  }
  if (absl::Status status = CheckNamesUnique(spec); !status.ok()) return status;
  return sizes;
}

using planner_internal::MeasureTensors;

namespace {

// ---------------------------------------------------------------------------
// Units

struct UnitDraft {
  std::string name;
  std::vector<int32_t> tensors;  // spec indices, ascending
};

// Groups tensors into units: by label, or runs of unlabeled tensors packed up
// to `max_unit_bytes`. Units are ordered by their first tensor.
std::vector<UnitDraft> GroupIntoUnits(const ModelSpec& spec, const std::vector<TensorSize>& sizes,
                                      int64_t max_unit_bytes) {
  std::vector<UnitDraft> units;
  absl::flat_hash_map<absl::string_view, size_t> unit_of_label;
  std::vector<size_t> packed_units;         // indices into `units`, to be named below
  bool packing = false;                     // the last unit is a packed one still open
  int64_t packed_bytes = 0;                 // bytes in that unit
  const std::string* last_label = nullptr;  // of the previous labeled tensor
  size_t last_label_unit = 0;               // its unit
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    const TensorSpec& tensor = spec.tensors[i];
    if (!tensor.unit.empty()) {
      packing = false;
      // Labeled tensors mostly come in runs: skip the map within one.
      if (last_label == nullptr || *last_label != tensor.unit) {
        auto [it, inserted] = unit_of_label.emplace(tensor.unit, units.size());
        if (inserted) units.push_back(UnitDraft{tensor.unit, {}});
        last_label = &tensor.unit;
        last_label_unit = it->second;
      }
      units[last_label_unit].tensors.push_back(static_cast<int32_t>(i));
      continue;
    }
    const int64_t bytes = sizes[i].bytes;
    if (!packing || bytes > max_unit_bytes - packed_bytes) {
      packed_units.push_back(units.size());
      units.emplace_back();
      packing = true;
      packed_bytes = 0;
    }
    units.back().tensors.push_back(static_cast<int32_t>(i));
    packed_bytes += bytes;
  }
  // Packed units are named "packed.<k>"; a label that already took the name
  // pushes the packed unit to "packed.<k>~" (then "~~", ...), so names stay
  // unique and deterministic.
  for (size_t k = 0; k < packed_units.size(); ++k) {
    std::string name = absl::StrCat("packed.", k);
    while (unit_of_label.contains(name)) name += "~";
    units[packed_units[k]].name = std::move(name);
  }
  return units;
}

// ---------------------------------------------------------------------------
// Assignment

int64_t AlignUp(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// A unit tensor as the assignment sees it.
struct Item {
  int64_t granule;  // smallest part it can be cut into: a row, or all of it
  int64_t rows;
  int64_t row_elements;
  int32_t tensor;  // index into the unit's tensors
};

// A placed piece: rows [row_begin, row_end) of unit tensor `tensor`.
struct Placement {
  int64_t row_begin;
  int64_t row_end;
  int64_t offset;  // elements into the rank's chunk
  int32_t tensor;
  int32_t rank;
};

// Ranks ordered by (load, rank), the least loaded on top. Ranks that hold
// nothing yet are not in the heap: they have load 0, below every loaded rank
// (a piece has >= 1 element), so they come first in rank order. That keeps a
// unit with few pieces from paying O(W) to start.
class LeastLoadedRanks {
 public:
  void Reset(int world_size) {
    world_size_ = world_size;
    next_empty_ = 0;
    heap_.clear();
  }
  int rank() const { return next_empty_ < world_size_ ? next_empty_ : heap_[0].rank; }
  int64_t load() const { return next_empty_ < world_size_ ? 0 : heap_[0].load; }

  // Adds `elements` (> 0) to the least-loaded rank.
  void AddToLeastLoaded(int64_t elements) {
    assert(elements > 0);
    if (next_empty_ < world_size_) {
      heap_.push_back(Entry{elements, next_empty_++});
      SiftUp(heap_.size() - 1);
    } else {
      heap_[0].load += elements;
      SiftDown(0);
    }
  }

 private:
  struct Entry {
    int64_t load;
    int32_t rank;
    bool operator<(const Entry& other) const {
      return load != other.load ? load < other.load : rank < other.rank;
    }
  };

  void SiftUp(size_t i) {
    const Entry entry = heap_[i];
    while (i > 0) {
      const size_t parent = (i - 1) / 2;
      if (!(entry < heap_[parent])) break;
      heap_[i] = heap_[parent];
      i = parent;
    }
    heap_[i] = entry;
  }

  void SiftDown(size_t i) {
    const Entry entry = heap_[i];
    const size_t n = heap_.size();
    for (;;) {
      size_t child = 2 * i + 1;
      if (child >= n) break;
      if (child + 1 < n && heap_[child + 1] < heap_[child]) ++child;
      if (!(heap_[child] < entry)) break;
      heap_[i] = heap_[child];
      i = child;
    }
    heap_[i] = entry;
  }

  int world_size_ = 0;
  int32_t next_empty_ = 0;
  std::vector<Entry> heap_;
};

// Plans one unit. Buffers live here so that units reuse their allocations.
class UnitAssigner {
 public:
  UnitAssigner(int world_size, const PlanOptions& options)
      : world_size_(world_size), options_(options) {}

  // Fills unit->pieces and unit->chunk_elements for the tensors `members`
  // (spec indices) of `unit`.
  void Assign(const std::vector<int32_t>& members, const std::vector<TensorSize>& sizes,
              ShardUnit* unit);

 private:
  // Places items_ in order with every rank's load <= cap, into `out`.
  // Returns the elements left unplaced: 0 on success; otherwise some granule
  // fit no rank, and `out` is partial.
  int64_t FillToCapacity(int64_t cap, std::vector<Placement>* out);
  int64_t SortItems(const std::vector<int32_t>& members, const std::vector<TensorSize>& sizes,
                    int64_t keep_whole);
  int64_t SearchCapacity(int64_t fair_share, int64_t max_granule);

  // FSDP2's layout (PlanOptions::row_chunk_ranks = S): tensor by tensor in
  // spec order, rows [k c, (k + 1) c) with c = ceil(rows / S) on rank k, as
  // torch.chunk cuts them (trailing ranks get nothing when rows < S c - c).
  void AssignRowChunks(const std::vector<int32_t>& members, const std::vector<TensorSize>& sizes,
                       ShardUnit* unit);

  void EmitSortedByRank(ShardUnit* unit);

  const int world_size_;
  const PlanOptions options_;
  int64_t unit_elements_ = 0;  // of the unit being assigned
  std::vector<Item> items_;
  std::vector<Placement> best_;
  std::vector<Placement> trial_;
  LeastLoadedRanks ranks_;
  std::vector<int32_t> rank_starts_;
};

int64_t UnitAssigner::FillToCapacity(int64_t cap, std::vector<Placement>* out) {
  out->clear();
  ranks_.Reset(world_size_);
  int64_t unplaced = unit_elements_;
  for (const Item& item : items_) {
    const bool cuttable = item.granule < item.rows * item.row_elements;
    int64_t row = 0;
    while (row < item.rows) {
      const int64_t space = cap - ranks_.load();
      const int64_t left = item.rows - row;
      // The least-loaded rank has the most space: if the granule does not
      // fit there, it fits nowhere under this cap.
      int64_t take;
      if (cuttable) {
        take = std::min(left, space / item.row_elements);
      } else {
        take = item.granule <= space ? left : 0;
      }
      if (take <= 0) return unplaced;
      const int64_t load = ranks_.load();
      out->push_back(Placement{row, row + take, load, item.tensor, ranks_.rank()});
      ranks_.AddToLeastLoaded(take * item.row_elements);
      unplaced -= take * item.row_elements;
      row += take;
    }
  }
  assert(unplaced == 0);
  return 0;
}

void UnitAssigner::AssignRowChunks(const std::vector<int32_t>& members,
                                   const std::vector<TensorSize>& sizes, ShardUnit* unit) {
  const int32_t s = options_.row_chunk_ranks;
  assert(s >= 1 && s <= world_size_);
  std::vector<int64_t> load(s, 0);  // elements
  best_.clear();
  for (size_t i = 0; i < members.size(); ++i) {
    const TensorSize& size = sizes[members[i]];
    const int64_t rows_per_rank = (size.rows + s - 1) / s;
    for (int32_t k = 0; k < s && k * rows_per_rank < size.rows; ++k) {
      const int64_t begin = k * rows_per_rank;
      const int64_t end = std::min(size.rows, begin + rows_per_rank);
      best_.push_back(Placement{begin, end, load[k], static_cast<int32_t>(i), k});
      load[k] += (end - begin) * size.row_elements;
    }
  }
  // Rank 0 holds the first chunk of every tensor: the most of any rank.
  unit->chunk_elements = AlignUp(load[0], options_.alignment_elements);
  EmitSortedByRank(unit);
}

// items_: the unit's tensors with their granules (whole up to `keep_whole`
// elements, else rows), in placement order. Returns the largest granule.
int64_t UnitAssigner::SortItems(const std::vector<int32_t>& members,
                                const std::vector<TensorSize>& sizes, int64_t keep_whole) {
  items_.clear();
  int64_t max_granule = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    const TensorSize& size = sizes[members[i]];
    const bool whole = size.rows == 1 || size.elements <= keep_whole;
    const int64_t granule = whole ? size.elements : size.row_elements;
    items_.push_back(Item{granule, size.rows, size.row_elements, static_cast<int32_t>(i)});
    max_granule = std::max(max_granule, granule);
  }
  // Coarsest first: holes a coarse granule leaves behind (< one granule) can
  // only be filled by finer ones, so those must come later. Then longest
  // first, then spec order, which makes the order (and the plan) total.
  std::sort(items_.begin(), items_.end(), [](const Item& a, const Item& b) {
    if (a.granule != b.granule) return a.granule > b.granule;
    const int64_t a_elements = a.rows * a.row_elements;
    const int64_t b_elements = b.rows * b.row_elements;
    if (a_elements != b_elements) return a_elements > b_elements;
    return a.tensor < b.tensor;
  });
  return max_granule;
}

// The capacity search over items_ (best_ gets the placement that fits);
// returns the capacity.
int64_t UnitAssigner::SearchCapacity(int64_t fair_share, int64_t max_granule) {
  // Search a small capacity (a multiple of the alignment) that fits.
  // Invariant: `feasible` fits (best_ holds its placement once have_best);
  // `infeasible` does not, or is below every candidate. `feasible` starts
  // at a bound that always fits: if the least-loaded rank had less than a
  // granule g of space there, every rank would hold more than
  // ceil(E/W) + max_granule - g >= ceil(E/W) elements, W of them more than
  // E, with some still unplaced.
  //
  // Fit is not monotone in the capacity (a larger one can leave larger
  // holes), so this finds a capacity that fits where `tolerance` less did
  // not, not a global minimum. Probes start at ceil(E/W) and move up by at
  // least what a failed probe left unplaced, spread over the ranks, and by
  // at least doubling steps; then bisection narrows the last gap until it is
  // within `tolerance`: the alignment, or 1/2048 of a fair share (0.05%
  // padding) when that is larger, which saves passes on big units.
  const int64_t a = options_.alignment_elements;
  const int64_t w = world_size_;
  const int64_t tolerance = std::max(a, fair_share / 2048);
  const int64_t lowest = AlignUp(std::max(fair_share, max_granule), a);
  int64_t feasible = AlignUp(fair_share + max_granule, a);
  int64_t infeasible = lowest - a;
  bool have_best = false;
  for (int64_t step = a, cap = lowest; cap < feasible; step *= 2) {
    const int64_t unplaced = FillToCapacity(cap, &trial_);
    if (unplaced == 0) {
      feasible = cap;
      best_.swap(trial_);
      have_best = true;
      break;
    }
    infeasible = cap;
    cap = std::max(lowest + step, cap + AlignUp((unplaced + w - 1) / w, a));
  }
  if (!have_best) {
    const int64_t unplaced = FillToCapacity(feasible, &best_);
    assert(unplaced == 0);
    (void)unplaced;
  }
  while (feasible - infeasible > tolerance) {
    const int64_t cap = infeasible + (feasible - infeasible) / a / 2 * a;
    if (FillToCapacity(cap, &trial_) == 0) {
      feasible = cap;
      best_.swap(trial_);
    } else {
      infeasible = cap;
    }
  }
  return feasible;
}

void UnitAssigner::Assign(const std::vector<int32_t>& members, const std::vector<TensorSize>& sizes,
                          ShardUnit* unit) {
  if (options_.row_chunk_ranks > 0) {
    AssignRowChunks(members, sizes, unit);
    return;
  }
  const int64_t w = world_size_;
  unit_elements_ = 0;
  for (int32_t spec_index : members) unit_elements_ += sizes[spec_index].elements;
  const int64_t fair_share = (unit_elements_ + w - 1) / w;  // ceil(E / W)
  // Tensors up to this many elements are never cut (see planner.h).
  const auto keep_whole =
      static_cast<int64_t>(options_.split_fraction * (static_cast<double>(unit_elements_) / w));

  const int64_t max_granule = SortItems(members, sizes, keep_whole);

  const int64_t a = options_.alignment_elements;
  const int64_t feasible = SearchCapacity(fair_share, max_granule);

  int64_t max_load = 0;
  for (const Placement& p : best_) {
    const int64_t end =
        p.offset + (p.row_end - p.row_begin) * sizes[members[p.tensor]].row_elements;
    max_load = std::max(max_load, end);
  }
  assert(max_load <= feasible);
  (void)feasible;
  unit->chunk_elements = AlignUp(max_load, a);
  EmitSortedByRank(unit);
}

// best_ holds each rank's pieces in increasing offset (a rank's load only
// grows), so a stable grouping by rank yields (rank, offset) order.
void UnitAssigner::EmitSortedByRank(ShardUnit* unit) {
  unit->pieces.clear();
  unit->pieces.reserve(best_.size());
  auto emit = [unit](const Placement& p) {
    unit->pieces.push_back(Piece{p.tensor, p.row_begin, p.row_end, p.rank, p.offset});
  };
  if (best_.size() * 4 < static_cast<size_t>(world_size_)) {
    // Few pieces: sorting beats an O(W) counting pass.
    std::sort(best_.begin(), best_.end(), [](const Placement& x, const Placement& y) {
      return x.rank != y.rank ? x.rank < y.rank : x.offset < y.offset;
    });
    for (const Placement& p : best_) emit(p);
    return;
  }
  rank_starts_.assign(world_size_ + 1, 0);
  for (const Placement& p : best_) ++rank_starts_[p.rank + 1];
  for (int r = 0; r < world_size_; ++r) rank_starts_[r + 1] += rank_starts_[r];
  unit->pieces.resize(best_.size());
  for (const Placement& p : best_) {
    unit->pieces[rank_starts_[p.rank]++] =
        Piece{p.tensor, p.row_begin, p.row_end, p.rank, p.offset};
  }
}

}  // namespace

// Shard groups (planner.h, step 4): the G-rank plan's pieces, each split by
// rows over the R replicas of its group member. Returns the W-rank plan.
ShardPlan SpreadOverReplicas(ShardPlan group_plan, int world_size) {
  const int g = group_plan.world_size;
  const int replicas = world_size / g;
  for (ShardUnit& unit : group_plan.units) {
    std::vector<Piece> pieces;
    pieces.reserve(unit.pieces.size() * replicas);
    for (const Piece& p : unit.pieces) {
      const int64_t rows = p.row_end - p.row_begin;
      const int64_t row_elements = unit.tensors[p.tensor].RowElements();
      for (int k = 0; k < replicas; ++k) {
        const int64_t begin = rows * k / replicas, end = rows * (k + 1) / replicas;
        if (begin == end) continue;  // fewer rows than replicas
        pieces.push_back(Piece{p.tensor, p.row_begin + begin, p.row_begin + end, k * g + p.rank,
                               p.offset + begin * row_elements});
      }
    }
    std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
      return a.rank != b.rank ? a.rank < b.rank : a.offset < b.offset;
    });
    unit.pieces = std::move(pieces);
  }
  group_plan.world_size = world_size;
  group_plan.hash = PlanHash(group_plan);
  return group_plan;
}

absl::StatusOr<ShardPlan> Plan(const ModelSpec& spec, int world_size, const PlanOptions& options) {
  if (absl::Status status = CheckWorldSize(world_size); !status.ok()) return status;
  absl::StatusOr<PlanOptions> resolved = ResolveOptions(options);
  if (!resolved.ok()) return resolved.status();
  const int group = options.shard_group_size;
  if (group < 0 || (group > 0 && world_size % group != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_group_size ", group, " does not divide the world size ", world_size,
                     "; expected a divisor of it (or 0: shard over every rank)"));
  }
  if (group > 0 && group < world_size) {
    if (resolved->row_chunk_ranks != 0) {
      return absl::InvalidArgumentError(
          "shard_group_size and row_chunk_ranks cannot be combined: choose one layout");
    }
    PlanOptions inner = *resolved;
    inner.shard_group_size = 0;
    absl::StatusOr<ShardPlan> group_plan = Plan(spec, group, inner);
    if (!group_plan.ok()) return group_plan.status();
    group_plan->options.shard_group_size = group;
    return SpreadOverReplicas(*std::move(group_plan), world_size);
  }
  resolved->shard_group_size = 0;  // W itself means no groups
  if (resolved->row_chunk_ranks > world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("row_chunk_ranks ", resolved->row_chunk_ranks, " exceeds the world size ",
                     world_size, "; an FSDP2 shard group has at most every rank"));
  }
  absl::StatusOr<std::vector<TensorSize>> sizes = MeasureTensors(spec);
  if (!sizes.ok()) return sizes.status();

  std::vector<UnitDraft> drafts = GroupIntoUnits(spec, *sizes, resolved->max_unit_bytes);

  ShardPlan plan;
  plan.version = kPlanVersion;
  plan.world_size = world_size;
  plan.options = *resolved;
  plan.units.resize(drafts.size());
  UnitAssigner assigner(world_size, *resolved);
  for (size_t u = 0; u < drafts.size(); ++u) {
    ShardUnit& unit = plan.units[u];
    unit.name = std::move(drafts[u].name);
    unit.tensors.reserve(drafts[u].tensors.size());
    for (int32_t spec_index : drafts[u].tensors) unit.tensors.push_back(spec.tensors[spec_index]);
    assigner.Assign(drafts[u].tensors, *sizes, &unit);
  }
  plan.hash = PlanHash(plan);
  return plan;
}

}  // namespace zeroshard
