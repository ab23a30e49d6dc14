// The shard planner: splits a model into units and every unit into per-rank
// pieces of whole dim-0 rows, balanced so that padding stays small.
//
//   absl::StatusOr<ShardPlan> plan = Plan(spec, /*world_size=*/64, PlanOptions());
//
// Algorithm (docs/design.md, "Shard plan"), all sizes in elements unless named
// bytes:
//
//  1. Units. Tensors with a unit label are grouped by label; a label may
//     reappear anywhere in the spec (GPT-2's "embed" holds wte, wpe and the
//     final ln_f). Runs of consecutive unlabeled tensors are packed into units
//     named "packed.<k>" of at most max_unit_bytes (bytes in each tensor's own
//     dtype); a tensor larger than that is a unit by itself. Units are ordered
//     by their first tensor, and a unit's tensors keep spec order.
//
//  2. Pieces and assignment, per unit of E elements over W ranks. A tensor of
//     at most split_fraction * E / W elements is never cut; a larger one may be
//     cut into blocks of whole dim-0 rows. Tensors are taken coarsest first
//     (by their indivisible granule: a row, or the whole tensor if it may not
//     be cut; then by size, descending; then by spec order), and each goes to
//     the least-loaded rank (a min-heap keyed (load, rank)) as whole as the
//     rank's remaining capacity `cap - load` allows; the rows that do not fit
//     continue on the next least-loaded rank. A piece's offset is its rank's
//     load before the piece was added. The capacity is the smallest multiple of
//     the alignment, searched from ceil(E / W) upwards, for which everything
//     fits; cap = ceil(E / W) + (largest granule) always fits, which bounds the
//     largest load. The unit's chunk (identical on every rank, as equal-count
//     all-gather and reduce-scatter need) is the largest load rounded up to
//     the alignment.
//
//     Why not pre-cut every large tensor into fixed blocks (~fair/64) and run
//     plain longest-first greedy: the capacity-bounded greedy cuts only where
//     the balance needs it, so a unit has its tensors plus at most W pieces
//     per distinct row size (each cut leaves its rank less than a row of the
//     cut tensor's size, so no tensor of that row size is cut there again)
//     instead of up to (tensors + 64 W), most tensors stay whole, and
//     the padding is an order of magnitude smaller. GPT-2 (124M..1.5B) at
//     W = 64: 0.016-0.05% padding with 1.5k-6k pieces, against 0.4-1.0% with
//     46k-254k pieces for fixed fair/64 blocks.
//
//  3. The plan records the resolved options (defaults filled in), the plan
//     version, and an xxhash64 of its canonical serialization.
//
//  4. Shard groups (hybrid sharding, options.shard_group_size = G < W): the
//     unit is planned over G ranks as above, and that shard is held by each
//     of the R = W / G groups of G consecutive ranks (rank r is member r % G
//     of group r / G). So that the plan still gives every element to exactly
//     one rank (what checkpoints, consolidation and resharding rely on), each
//     group-member piece's rows are split in R nearly equal runs, run k on
//     replica k (rank k * G + member) at the offset those rows have in the
//     member's chunk: a rank saves its run, and computes on the union of its
//     replicas' runs, which is its member's shard. Chunks are the G-rank
//     plan's (per-rank memory 16 psi / G at stage 3).
//
// Pieces of a unit are stored sorted by (rank, offset): a rank's pieces are
// contiguous in ShardUnit::pieces and in its chunk order.
//
// Plan is a pure function: the same spec, world size and options give the
// identical plan and hash on every machine.
//
// Thread-safe (no shared state).
#ifndef ZEROSHARD_COMMON_PLAN_PLANNER_H_
#define ZEROSHARD_COMMON_PLAN_PLANNER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "common/plan/shard_plan.h"

namespace zeroshard {

// Bumped whenever the algorithm could plan the same input differently, so a
// stored plan is never mistaken for one computed by other rules.
inline constexpr int kPlanVersion = 1;

inline constexpr int kMaxWorldSize = 131072;

// 256 MiB per packed unit: the most parameter bytes one unlabeled unit adds to
// the stage-3 unsharded window; small enough that (1 + prefetch) gathered
// units fit next to activations on a 16 GB device, large enough that per-unit
// collective latency is amortized (NCCL reaches bus bandwidth well below it).
inline constexpr int64_t kDefaultMaxUnitBytes = int64_t{256} << 20;

// 64 elements: every rank's chunk starts a multiple of 64 elements into a
// gathered unit buffer, i.e. on a 64-byte (cache line) boundary even for
// 1-byte dtypes, 128 bytes for BF16 and 256 bytes for F32 (cudaMalloc's
// alignment), so collectives and vectorized copies never straddle. Costs at
// most 63 elements per rank per unit.
inline constexpr int64_t kDefaultAlignmentElements = 64;
inline constexpr int64_t kMaxAlignmentElements = int64_t{1} << 20;

// Tensors of at most 1/1024 of a fair share are never cut: cutting one could
// lower the unit's chunk by at most that much (0.1%), and keeping them whole
// keeps biases and norms in one piece at small W. Larger fractions cost
// padding: at 1/64, the d_model-sized 1-d tensors of a GPT-2 block could no
// longer fill the holes row blocks leave, and W = 64 padded 0.26-0.41%
// instead of 0.016-0.05%.
inline constexpr double kDefaultSplitFraction = 1.0 / 1024;

// The largest spec, in total elements, the planner accepts: 2^53, so that every
// derived count (16 bytes of Adam state per element, W * chunk as a double)
// is exact and fits in int64.
inline constexpr int64_t kMaxTotalElements = int64_t{1} << 53;

// Plans `spec` over `world_size` ranks.
//
// INVALID_ARGUMENT, naming the tensor and the value, for: an empty spec; an
// empty or duplicate tensor name; a zero or negative dimension; an element or
// byte count that overflows int64 (or a spec above kMaxTotalElements); a dtype
// that is not a safetensors name (F32, BF16, F16, F64, I64, I32, I16, I8, U8,
// BOOL); world_size outside [1, kMaxWorldSize]; options out of range
// (max_unit_bytes < 0, alignment_elements outside [0, kMaxAlignmentElements],
// split_fraction outside [0, 1] or not finite; a shard_group_size that is
// negative or does not divide world_size, or is combined with
// row_chunk_ranks). A zero option means its default.
absl::StatusOr<ShardPlan> Plan(const ModelSpec& spec, int world_size, const PlanOptions& options);

// OK iff `plan` is a well-formed plan of `spec`: the spec is valid (as Plan
// checks it); every spec tensor appears in exactly one unit with the same
// shape and dtype; every element of every tensor is in exactly one piece;
// every piece has a rank in [0, world_size) and lies inside [0, chunk) of its
// unit; a rank's pieces in a unit do not overlap; chunks are multiples of the
// plan's alignment; and the hash matches. It does not require that the
// grouping into units is the one Plan would choose.
// INVALID_ARGUMENT naming the unit and piece otherwise; DATA_LOSS for a hash
// mismatch (the plan was altered after it was hashed).
absl::Status ValidatePlan(const ModelSpec& spec, const ShardPlan& plan);

// The 16 lowercase hex digits of the xxhash64 of the plan's canonical form:
// version, world size, options, and every unit's name, tensors (name, shape,
// dtype, unit label), chunk and pieces, as little-endian fixed-width integers
// and length-prefixed strings. Ignores plan.hash itself.
std::string PlanHash(const ShardPlan& plan);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_PLAN_PLANNER_H_
