// A plan's canonical hash (PlanHash) and its validation against a model spec
// (ValidatePlan): what a worker checks of a plan it was handed. The planner
// itself is planner.cc.
#include <xxhash.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/plan/planner.h"
#include "common/plan/planner_internal.h"

namespace zeroshard {

using planner_internal::CheckWorldSize;
using planner_internal::Describe;
using planner_internal::MeasureTensors;
using planner_internal::TensorSize;

namespace {

// ---------------------------------------------------------------------------
// Hashing

// Streams a canonical, platform-independent byte form of a plan into
// xxhash64: integers as 8 little-endian bytes, strings length-prefixed.
class CanonicalHasher {
 public:
  CanonicalHasher() : state_(XXH64_createState()) {
    XXH64_reset(state_.get(), 0);
    buffer_.reserve(kFlushBytes + 64);
  }

  void Int(int64_t value) {
    char bytes[8];
    const auto bits = static_cast<uint64_t>(value);
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(bits >> (8 * i));
    buffer_.append(bytes, 8);
    MaybeFlush();
  }

  void Double(double value) {
    uint64_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    Int(static_cast<int64_t>(bits));
  }

  void String(absl::string_view text) {
    Int(static_cast<int64_t>(text.size()));
    buffer_.append(text.data(), text.size());
    MaybeFlush();
  }

  std::string HexDigest() {
    XXH64_update(state_.get(), buffer_.data(), buffer_.size());
    buffer_.clear();
    return absl::StrFormat("%016x", XXH64_digest(state_.get()));
  }

 private:
  static constexpr size_t kFlushBytes = 64 << 10;

  struct StateDeleter {
    void operator()(XXH64_state_t* state) const { XXH64_freeState(state); }
  };

  void MaybeFlush() {
    if (buffer_.size() < kFlushBytes) return;
    XXH64_update(state_.get(), buffer_.data(), buffer_.size());
    buffer_.clear();
  }

  std::unique_ptr<XXH64_state_t, StateDeleter> state_;
  std::string buffer_;
};

// ---------------------------------------------------------------------------
// Plan validation helpers

std::string DescribePiece(const ShardUnit& unit, size_t index) {
  const Piece& p = unit.pieces[index];
  return absl::StrCat("unit \"", unit.name, "\" piece ", index, " (tensor ", p.tensor, ", rows [",
                      p.row_begin, ", ", p.row_end, "), rank ", p.rank, ", offset ", p.offset, ")");
}

// Checks one unit's pieces against its tensors' sizes (`sizes`, unit order).
absl::Status ValidateUnitPieces(const ShardUnit& unit, const std::vector<TensorSize>& sizes,
                                int world_size, std::vector<int32_t>* order) {
  for (size_t i = 0; i < unit.pieces.size(); ++i) {
    const Piece& p = unit.pieces[i];
    if (p.tensor < 0 || static_cast<size_t>(p.tensor) >= unit.tensors.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(DescribePiece(unit, i), ": no such tensor in the unit"));
    }
    const TensorSize& size = sizes[p.tensor];
    if (p.row_begin < 0 || p.row_begin >= p.row_end || p.row_end > size.rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          DescribePiece(unit, i), ": rows are not a non-empty range of [0, ", size.rows, ")"));
    }
    if (p.rank < 0 || p.rank >= world_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(DescribePiece(unit, i), ": rank outside [0, ", world_size, ")"));
    }
    const int64_t elements = (p.row_end - p.row_begin) * size.row_elements;
    if (p.offset < 0 || p.offset > unit.chunk_elements ||
        elements > unit.chunk_elements - p.offset) {
      return absl::InvalidArgumentError(absl::StrCat(DescribePiece(unit, i), ": ", elements,
                                                     " elements do not fit in the chunk of ",
                                                     unit.chunk_elements));
    }
  }

  // Coverage: per tensor, the pieces' rows tile [0, rows) exactly.
  order->resize(unit.pieces.size());
  for (size_t i = 0; i < order->size(); ++i) (*order)[i] = static_cast<int32_t>(i);
  std::sort(order->begin(), order->end(), [&unit](int32_t x, int32_t y) {
    const Piece& a = unit.pieces[x];
    const Piece& b = unit.pieces[y];
    return a.tensor != b.tensor ? a.tensor < b.tensor : a.row_begin < b.row_begin;
  });
  size_t next = 0;
  for (size_t t = 0; t < unit.tensors.size(); ++t) {
    int64_t covered = 0;  // rows [0, covered) are placed
    for (; next < order->size() && unit.pieces[(*order)[next]].tensor == static_cast<int>(t);
         ++next) {
      const Piece& p = unit.pieces[(*order)[next]];
      if (p.row_begin != covered) {
        return absl::InvalidArgumentError(absl::StrCat(
            DescribePiece(unit, (*order)[next]), ": tensor \"", unit.tensors[t].name, "\" rows [",
            std::min(covered, p.row_begin), ", ", std::max(covered, p.row_begin), ") are ",
            p.row_begin > covered ? "in no piece" : "in two pieces"));
      }
      covered = p.row_end;
    }
    if (covered != sizes[t].rows) {
      return absl::InvalidArgumentError(absl::StrCat("unit \"", unit.name, "\": tensor \"",
                                                     unit.tensors[t].name, "\" rows [", covered,
                                                     ", ", sizes[t].rows, ") are in no piece"));
    }
  }

  // Disjointness: per rank, pieces do not overlap inside the chunk.
  std::sort(order->begin(), order->end(), [&unit](int32_t x, int32_t y) {
    const Piece& a = unit.pieces[x];
    const Piece& b = unit.pieces[y];
    return a.rank != b.rank ? a.rank < b.rank : a.offset < b.offset;
  });
  for (size_t k = 1; k < order->size(); ++k) {
    const Piece& prev = unit.pieces[(*order)[k - 1]];
    const Piece& cur = unit.pieces[(*order)[k]];
    if (prev.rank != cur.rank) continue;
    const int64_t prev_end =
        prev.offset + (prev.row_end - prev.row_begin) * sizes[prev.tensor].row_elements;
    if (prev_end > cur.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          DescribePiece(unit, (*order)[k]), ": overlaps ", DescribePiece(unit, (*order)[k - 1])));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string PlanHash(const ShardPlan& plan) {
  CanonicalHasher hasher;
  hasher.String("zeroshard.ShardPlan");
  hasher.Int(plan.version);
  hasher.Int(plan.world_size);
  hasher.Int(plan.options.max_unit_bytes);
  hasher.Int(plan.options.alignment_elements);
  hasher.Double(plan.options.split_fraction);
  // Hashed only when set, so plans of the balanced planner keep their hashes.
  if (plan.options.row_chunk_ranks != 0) hasher.Int(plan.options.row_chunk_ranks);
  if (plan.options.shard_group_size != 0) hasher.Int(plan.options.shard_group_size);
  hasher.Int(static_cast<int64_t>(plan.units.size()));
  for (const ShardUnit& unit : plan.units) {
    hasher.String(unit.name);
    hasher.Int(static_cast<int64_t>(unit.tensors.size()));
    for (const TensorSpec& tensor : unit.tensors) {
      hasher.String(tensor.name);
      hasher.String(tensor.dtype);
      hasher.String(tensor.unit);
      hasher.Int(static_cast<int64_t>(tensor.shape.size()));
      for (int64_t dim : tensor.shape) hasher.Int(dim);
    }
    hasher.Int(unit.chunk_elements);
    hasher.Int(static_cast<int64_t>(unit.pieces.size()));
    for (const Piece& p : unit.pieces) {
      hasher.Int(p.tensor);
      hasher.Int(p.row_begin);
      hasher.Int(p.row_end);
      hasher.Int(p.rank);
      hasher.Int(p.offset);
    }
  }
  return hasher.HexDigest();
}

absl::Status ValidatePlan(const ModelSpec& spec, const ShardPlan& plan) {
  absl::StatusOr<std::vector<TensorSize>> spec_sizes = MeasureTensors(spec);
  if (!spec_sizes.ok()) return spec_sizes.status();
  if (absl::Status status = CheckWorldSize(plan.world_size); !status.ok()) return status;
  if (plan.version < 1) {
    return absl::InvalidArgumentError(absl::StrCat("plan version ", plan.version, " is invalid"));
  }
  const int64_t alignment = plan.options.alignment_elements;
  if (alignment < 1 || alignment > kMaxAlignmentElements) {
    return absl::InvalidArgumentError(absl::StrCat("plan alignment_elements ", alignment,
                                                   " is out of range [1, ", kMaxAlignmentElements,
                                                   "]"));
  }

  absl::flat_hash_map<absl::string_view, int32_t> spec_index;
  spec_index.reserve(spec.tensors.size());
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    spec_index.emplace(spec.tensors[i].name, static_cast<int32_t>(i));
  }
  std::vector<bool> placed(spec.tensors.size(), false);
  absl::flat_hash_set<absl::string_view> unit_names;
  std::vector<TensorSize> unit_sizes;
  std::vector<int32_t> order;
  for (const ShardUnit& unit : plan.units) {
    if (unit.name.empty() || !unit_names.insert(unit.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("unit name \"", unit.name, "\" is empty or not unique"));
    }
    if (unit.chunk_elements < 0 || unit.chunk_elements % alignment != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unit \"", unit.name, "\": chunk of ",
                                                     unit.chunk_elements,
                                                     " elements is not a multiple of the "
                                                     "alignment ",
                                                     alignment));
    }
    unit_sizes.clear();
    for (const TensorSpec& tensor : unit.tensors) {
      auto it = spec_index.find(tensor.name);
      if (it == spec_index.end()) {
        return absl::InvalidArgumentError(absl::StrCat("unit \"", unit.name, "\": tensor \"",
                                                       tensor.name, "\" is not in the spec"));
      }
      const TensorSpec& expected = spec.tensors[it->second];
      if (placed[it->second]) {
        return absl::InvalidArgumentError(
            absl::StrCat("unit \"", unit.name, "\": tensor \"", tensor.name, "\" is in two units"));
      }
      if (tensor.shape != expected.shape || tensor.dtype != expected.dtype) {
        return absl::InvalidArgumentError(
            absl::StrCat("unit \"", unit.name, "\": tensor \"", tensor.name, "\" is ", tensor.dtype,
                         ShapeString(tensor.shape), " but the spec says ", expected.dtype,
                         ShapeString(expected.shape)));
      }
      placed[it->second] = true;
      unit_sizes.push_back((*spec_sizes)[it->second]);
    }
    if (absl::Status status = ValidateUnitPieces(unit, unit_sizes, plan.world_size, &order);
        !status.ok()) {
      return status;
    }
  }
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    if (!placed[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(Describe(i, spec.tensors[i]), " is in no unit of the plan"));
    }
  }
  const std::string hash = PlanHash(plan);
  if (hash != plan.hash) {
    return absl::DataLossError(absl::StrCat("plan hash \"", plan.hash,
                                            "\" does not match its "
                                            "contents (",
                                            hash, "); the plan was altered"));
  }
  return absl::OkStatus();
}

}  // namespace zeroshard
