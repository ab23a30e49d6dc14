#include "worker/comm/two_level_communicator.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/local_address.h"
#include "worker/comm/comm_internal.h"
#include "worker/comm/kv_gloo_store.h"

namespace zeroshard {
namespace {

using comm_internal::ChunkBlocks;
using comm_internal::EvenChunkBlocks;

}  // namespace

absl::StatusOr<std::vector<std::string>> ExchangeHostKeys(KeyValueStore* store, int rank,
                                                          int world_size, const std::string& tag,
                                                          const std::string& key,
                                                          absl::Duration timeout) {
  const std::string prefix = KvGlooStore::PrefixForTag(tag) + "two_level/host/";
  if (absl::Status s = store->Set(absl::StrCat(prefix, rank), key); !s.ok()) return s;
  std::vector<std::string> names(world_size);
  for (int r = 0; r < world_size; ++r) names[r] = absl::StrCat(prefix, r);
  // One deadline for all of them; then every key is there to read.
  if (absl::Status s = store->Wait(names, timeout); !s.ok()) return s;
  std::vector<std::string> keys(world_size);
  for (int r = 0; r < world_size; ++r) {
    absl::StatusOr<std::string> k = store->Get(names[r], absl::Seconds(1));
    if (!k.ok()) return k.status();
    keys[r] = *std::move(k);
  }
  return keys;
}

absl::StatusOr<HostLayout> HostLayout::Of(const std::vector<std::string>& host_keys) {
  HostLayout layout;
  const int w = static_cast<int>(host_keys.size());
  std::map<std::string, int> host_index;
  layout.host_of.resize(w);
  layout.local_of.resize(w);
  for (int r = 0; r < w; ++r) {
    auto [it, added] = host_index.emplace(host_keys[r], layout.hosts);
    if (added) {
      ++layout.hosts;
      layout.ranks_on.emplace_back();
    }
    layout.host_of[r] = it->second;
    layout.local_of[r] = static_cast<int>(layout.ranks_on[it->second].size());
    layout.ranks_on[it->second].push_back(r);
  }
  layout.local_size = layout.hosts > 0 ? static_cast<int>(layout.ranks_on[0].size()) : 0;
  std::vector<std::string> counts;
  bool uniform = true;
  for (const auto& ranks : layout.ranks_on) {
    counts.push_back(absl::StrCat(ranks.size()));
    uniform = uniform && static_cast<int>(ranks.size()) == layout.local_size;
  }
  if (!uniform) {
    return absl::FailedPreconditionError(
        absl::StrCat("hosts hold different numbers of ranks (", absl::StrJoin(counts, ", "),
                     "): two-level collectives need the same number on every host"));
  }
  return layout;
}

RailLayouts SplitByRail(const std::vector<ShardBlock>& blocks, const HostLayout& layout, int rank) {
  RailLayouts out;
  const int my_rail = layout.local_of[rank];
  std::vector<int64_t> rail_fill(layout.local_size, 0);
  out.intra.reserve(blocks.size());
  for (const ShardBlock& b : blocks) {
    const int rail = layout.local_of[b.rank];
    const int64_t at = rail_fill[rail];
    rail_fill[rail] += b.count;
    out.intra.push_back(ShardBlock{rail, at, b.full_offset, b.count});
    if (rail == my_rail) {
      out.inter.push_back(ShardBlock{layout.host_of[b.rank], b.shard_offset, at, b.count});
    }
  }
  out.rail_elements = rail_fill[my_rail];
  return out;
}

absl::StatusOr<std::unique_ptr<TwoLevelCommunicator>> TwoLevelCommunicator::Create(
    KeyValueStore* store, int rank, int world_size, const std::string& tag, const Options& options,
    std::string* why_not) {
  const std::string key = options.host_key.empty() ? HostIdentity() : options.host_key;
  absl::StatusOr<std::vector<std::string>> keys =
      ExchangeHostKeys(store, rank, world_size, tag, key, options.host.connect_timeout);
  if (!keys.ok()) {
    return absl::Status(
        keys.status().code(),
        absl::StrCat("two-level collectives (rank ", rank, " of ", world_size, ", tag '", tag,
                     "'): exchanging host identities: ", keys.status().message()));
  }
  absl::StatusOr<HostLayout> layout = HostLayout::Of(*keys);
  if (!layout.ok()) {
    *why_not = std::string(layout.status().message());
    return nullptr;
  }
  if (layout->hosts == 1 || layout->local_size == 1) {
    *why_not = absl::StrCat(layout->hosts, " host(s) of ", layout->local_size,
                            " rank(s): one level is all there is");
    return nullptr;
  }
  const int host = layout->host_of[rank];
  const int local = layout->local_of[rank];
  // Inside the host: shared memory when it can be made (CreateHostCommunicator
  // decides, as for a one-host job); across hosts and flat: TCP.
  absl::StatusOr<std::unique_ptr<HostCommunicator>> intra = CreateHostCommunicator(
      store, local, layout->local_size, absl::StrCat(tag, "/host", host), options.host);
  if (!intra.ok()) return intra.status();
  HostCommunicatorOptions tcp = options.host;
  tcp.shared_memory = false;
  absl::StatusOr<std::unique_ptr<HostCommunicator>> inter =
      CreateHostCommunicator(store, host, layout->hosts, absl::StrCat(tag, "/rail", local), tcp);
  if (!inter.ok()) return inter.status();
  absl::StatusOr<std::unique_ptr<HostCommunicator>> flat =
      CreateHostCommunicator(store, rank, world_size, absl::StrCat(tag, "/flat"), tcp);
  if (!flat.ok()) return flat.status();
  return std::unique_ptr<TwoLevelCommunicator>(
      new TwoLevelCommunicator(rank, world_size, tag, *std::move(layout), *std::move(intra),
                               *std::move(inter), *std::move(flat)));
}

TwoLevelCommunicator::TwoLevelCommunicator(int rank, int world_size, std::string tag,
                                           HostLayout layout,
                                           std::unique_ptr<HostCommunicator> intra,
                                           std::unique_ptr<HostCommunicator> inter,
                                           std::unique_ptr<HostCommunicator> flat)
    : rank_(rank),
      world_size_(world_size),
      tag_(std::move(tag)),
      layout_(std::move(layout)),
      intra_(std::move(intra)),
      inter_(std::move(inter)),
      flat_(std::move(flat)) {
  note_ = absl::StrCat(
      layout_.hosts, " hosts x ", layout_.local_size,
      " ranks: ", intra_->transport() == HostTransport::kSharedMemory ? "shared memory" : "TCP",
      " inside a host, TCP across (one rail per local rank)");
}

absl::Status TwoLevelCommunicator::health() const {
  for (const HostCommunicator* c : {intra_.get(), inter_.get(), flat_.get()}) {
    if (absl::Status s = c->health(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

bool TwoLevelCommunicator::AwaitCollectiveInFlight(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  // The levels run one after the other: poll each briefly until the deadline.
  while (true) {
    for (const HostCommunicator* c : {intra_.get(), inter_.get(), flat_.get()}) {
      if (c->AwaitCollectiveInFlight(absl::Milliseconds(1))) return true;
    }
    if (absl::Now() >= deadline) return false;
  }
}

char* TwoLevelCommunicator::RailBuffer(int64_t bytes) {
  if (static_cast<int64_t>(rail_buffer_.size()) < bytes) rail_buffer_.resize(bytes);
  return rail_buffer_.data();
}

absl::Status TwoLevelCommunicator::AllGatherBlocks(const void* shard, void* full,
                                                   const std::vector<ShardBlock>& blocks,
                                                   DType dtype, absl::Duration timeout) {
  if (absl::Status s = ValidateBlocks("all_gather", blocks, world_size_); !s.ok()) return s;
  const RailLayouts rails = SplitByRail(blocks, layout_, rank_);
  char* rail = RailBuffer(rails.rail_elements * static_cast<int64_t>(DTypeSize(dtype)));
  // Across hosts first (the rail's blocks of every host), then inside the
  // host (every rail).
  if (absl::Status s = inter_->AllGatherBlocks(shard, rail, rails.inter, dtype, timeout); !s.ok()) {
    return s;
  }
  return intra_->AllGatherBlocks(rail, full, rails.intra, dtype, timeout);
}

absl::Status TwoLevelCommunicator::ReduceScatterBlocks(const void* full, void* shard,
                                                       const std::vector<ShardBlock>& blocks,
                                                       DType dtype, ReduceOp op,
                                                       absl::Duration timeout) {
  if (absl::Status s = ValidateBlocks("reduce_scatter", blocks, world_size_); !s.ok()) return s;
  const RailLayouts rails = SplitByRail(blocks, layout_, rank_);
  char* rail = RailBuffer(rails.rail_elements * static_cast<int64_t>(DTypeSize(dtype)));
  // Inside the host first (the host's sum of this rail's blocks), then
  // across hosts; an average divides by L, then by H.
  if (absl::Status s = intra_->ReduceScatterBlocks(full, rail, rails.intra, dtype, op, timeout);
      !s.ok()) {
    return s;
  }
  return inter_->ReduceScatterBlocks(rail, shard, rails.inter, dtype, op, timeout);
}

absl::Status TwoLevelCommunicator::AllGather(const void* input, void* output, int64_t count,
                                             DType dtype, absl::Duration timeout) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("all_gather: count ", count));
  return AllGatherBlocks(input, output, ChunkBlocks(world_size_, count), dtype, timeout);
}

absl::Status TwoLevelCommunicator::ReduceScatter(const void* input, void* output, int64_t count,
                                                 DType dtype, ReduceOp op, absl::Duration timeout) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("reduce_scatter: count ", count));
  return ReduceScatterBlocks(input, output, ChunkBlocks(world_size_, count), dtype, op, timeout);
}

absl::Status TwoLevelCommunicator::AllReduce(void* buffer, int64_t count, DType dtype, ReduceOp op,
                                             absl::Duration timeout) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("all_reduce: count ", count));
  // A reduce-scatter of even chunks into the rank's own chunk of the buffer,
  // then their all-gather.
  const std::vector<ShardBlock> chunks = EvenChunkBlocks(world_size_, count);
  if (absl::Status s = ReduceScatterBlocks(buffer, buffer, chunks, dtype, op, timeout); !s.ok()) {
    return s;
  }
  return AllGatherBlocks(buffer, buffer, chunks, dtype, timeout);
}

absl::Status TwoLevelCommunicator::Broadcast(void* buffer, int64_t count, DType dtype, int root,
                                             absl::Duration timeout) {
  return flat_->Broadcast(buffer, count, dtype, root, timeout);
}

absl::Status TwoLevelCommunicator::Barrier(absl::Duration timeout) {
  return flat_->Barrier(timeout);
}

CollectiveBytes TwoLevelCommunicator::bytes_sent() const {
  CollectiveBytes sum = intra_->bytes_sent();
  sum += inter_->bytes_sent();
  sum += flat_->bytes_sent();
  return sum;
}

CollectiveBytes TwoLevelCommunicator::inter_host_bytes_sent() const {
  CollectiveBytes sum = inter_->bytes_sent();
  sum += flat_->bytes_sent();
  return sum;
}

void TwoLevelCommunicator::Abort() {
  for (HostCommunicator* c : {intra_.get(), inter_.get(), flat_.get()}) c->Abort();
}

}  // namespace zeroshard

namespace zeroshard {

// Flat, over every rank (a rank's pieces for its own host's ranks stay on
// the host's loopback, but count as crossing in inter_host_bytes_sent()).
absl::Status TwoLevelCommunicator::AllToAll(const void* input, void* output, int64_t bytes_per_rank,
                                            absl::Duration timeout) {
  return flat_->AllToAll(input, output, bytes_per_rank, timeout);
}

}  // namespace zeroshard
