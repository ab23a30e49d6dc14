#include "worker/comm/gloo_ring.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "gloo/context.h"
#include "gloo/transport/unbound_buffer.h"
#include "worker/comm/comm_internal.h"

namespace zeroshard {
namespace {

using comm_internal::Mod;
using gloo::transport::UnboundBuffer;

// dst[i] = (received[i] + own[i]) / divisor, added in f32 and rounded once to
// `dtype`. dst may alias received or own.
void Accumulate(DType dtype, const void* received, const void* own, void* dst, int64_t n,
                float divisor) {
  if (dtype == DType::kF32) {
    const float* a = static_cast<const float*>(received);
    const float* b = static_cast<const float*>(own);
    float* d = static_cast<float*>(dst);
    if (divisor == 1.0f) {
      for (int64_t i = 0; i < n; ++i) d[i] = a[i] + b[i];
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = (a[i] + b[i]) / divisor;
    }
    return;
  }
  const uint16_t* a = static_cast<const uint16_t*>(received);
  const uint16_t* b = static_cast<const uint16_t*>(own);
  uint16_t* d = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    float sum = BF16ToFloat(a[i]) + BF16ToFloat(b[i]);
    if (divisor != 1.0f) sum /= divisor;
    d[i] = FloatToBF16(sum);
  }
}

}  // namespace

GlooRing::GlooRing(gloo::Context* context, int rank, int world_size, WaitFn wait)
    : context_(context), rank_(rank), world_size_(world_size), wait_(std::move(wait)) {}

char* GlooRing::Stage(int index, size_t bytes) {
  if (stage_[index].size() < bytes) stage_[index].resize(bytes);
  return stage_[index].data();
}

void GlooRing::AllGatherBlocks(const char* in, char* out, const BlockGroups& g, DType dtype,
                               uint64_t slot, absl::Time deadline,
                               const std::function<void()>& copy_own,
                               std::atomic<int64_t>* counter) {
  const int w = world_size_;
  const int right = Mod(rank_ + 1, w);
  const int left = Mod(rank_ - 1, w);
  const size_t esize = DTypeSize(dtype);
  // Gloo only reads from send buffers.
  std::unique_ptr<UnboundBuffer> shard_buffer =
      context_->createUnboundBuffer(const_cast<char*>(in), g.shard_extent[rank_] * esize);
  std::unique_ptr<UnboundBuffer> send_buffer =
      context_->createUnboundBuffer(out, g.full_extent * esize);
  std::unique_ptr<UnboundBuffer> recv_buffer =
      context_->createUnboundBuffer(out, g.full_extent * esize);
  // Step s forwards rank (rank - s)'s blocks to the right (step 0 straight
  // from the shard) and receives rank (rank - s - 1)'s from the left, one
  // message per block, straight into place.
  for (int s = 0; s < w - 1; ++s) {
    const int send_rank = Mod(rank_ - s, w);
    const int recv_rank = Mod(rank_ - s - 1, w);
    for (const ShardBlock* b : g.blocks[recv_rank]) {
      recv_buffer->recv(left, slot, b->full_offset * esize, b->count * esize);
    }
    UnboundBuffer* source = s == 0 ? shard_buffer.get() : send_buffer.get();
    for (const ShardBlock* b : g.blocks[send_rank]) {
      source->send(right, slot, (s == 0 ? b->shard_offset : b->full_offset) * esize,
                   b->count * esize);
    }
    if (s == 0) copy_own();  // while the first messages travel
    for (size_t k = 0; k < g.blocks[recv_rank].size(); ++k) {
      wait_(recv_buffer.get(), /*send=*/false, deadline);
    }
    for (size_t k = 0; k < g.blocks[send_rank].size(); ++k) {
      wait_(source, /*send=*/true, deadline);
    }
    counter->fetch_add(g.total[send_rank] * esize);
  }
}

void GlooRing::ReduceScatter(const char* in, char* out, const BlockGroups& g, DType dtype,
                             float divisor, uint64_t slot, absl::Time deadline,
                             std::atomic<int64_t>* counter) {
  const int w = world_size_;
  const int right = Mod(rank_ + 1, w);
  const int left = Mod(rank_ - 1, w);
  const size_t esize = DTypeSize(dtype);
  const int64_t max_group = *std::max_element(g.total.begin(), g.total.end());
  // Step s sends the partial sums of rank (rank - s - 1)'s blocks to the
  // right (step 0 straight from `in`) and receives those of rank
  // (rank - s - 2)'s blocks from the left into packed staging, adding this
  // rank's values. Two staging buffers alternate: the one received into at
  // step s is sent at step s + 1. The last step receives this rank's own
  // blocks and writes the totals into `out`. Block lists are known to both
  // ends, so a rank with no blocks is skipped on both.
  char* stage[2] = {Stage(0, max_group * esize), Stage(1, max_group * esize)};
  std::unique_ptr<UnboundBuffer> stage_buffer[2] = {
      context_->createUnboundBuffer(stage[0], max_group * esize),
      context_->createUnboundBuffer(stage[1], max_group * esize)};
  // Gloo only reads from send buffers.
  std::unique_ptr<UnboundBuffer> full_buffer =
      context_->createUnboundBuffer(const_cast<char*>(in), g.full_extent * esize);
  for (int s = 0; s < w - 1; ++s) {
    const int send_rank = Mod(rank_ - s - 1, w);
    const int recv_rank = Mod(rank_ - s - 2, w);
    const int recv_index = (s + 1) % 2;
    const bool last = s == w - 2;
    const auto& recv_blocks = g.blocks[recv_rank];
    for (size_t k = 0; k < recv_blocks.size(); ++k) {
      stage_buffer[recv_index]->recv(left, slot, g.packed_offset[recv_rank][k] * esize,
                                     recv_blocks[k]->count * esize);
    }
    UnboundBuffer* source = s == 0 ? full_buffer.get() : stage_buffer[s % 2].get();
    const auto& send_blocks = g.blocks[send_rank];
    for (size_t k = 0; k < send_blocks.size(); ++k) {
      const int64_t offset = s == 0 ? send_blocks[k]->full_offset : g.packed_offset[send_rank][k];
      source->send(right, slot, offset * esize, send_blocks[k]->count * esize);
    }
    // Blocks arrive in order; each is added as soon as it is in.
    for (size_t k = 0; k < recv_blocks.size(); ++k) {
      wait_(stage_buffer[recv_index].get(), /*send=*/false, deadline);
      const ShardBlock& b = *recv_blocks[k];
      char* received = stage[recv_index] + g.packed_offset[recv_rank][k] * esize;
      Accumulate(dtype, received, in + b.full_offset * esize,
                 last ? out + b.shard_offset * esize : received, b.count, last ? divisor : 1.0f);
    }
    for (size_t k = 0; k < send_blocks.size(); ++k) wait_(source, /*send=*/true, deadline);
    counter->fetch_add(g.total[send_rank] * esize);
  }
}

void GlooRing::AllGatherInPlace(void* buffer, const std::vector<int64_t>& chunk_offset,
                                const std::vector<int64_t>& chunk_size, DType dtype, uint64_t slot,
                                absl::Time deadline, std::atomic<int64_t>* counter) {
  const int w = world_size_;
  const int right = Mod(rank_ + 1, w);
  const int left = Mod(rank_ - 1, w);
  const size_t esize = DTypeSize(dtype);
  const int64_t total = chunk_offset.back() + chunk_size.back();
  // Separate buffer objects for the pending send and the pending recv.
  std::unique_ptr<UnboundBuffer> send_buffer = context_->createUnboundBuffer(buffer, total * esize);
  std::unique_ptr<UnboundBuffer> recv_buffer = context_->createUnboundBuffer(buffer, total * esize);
  // Step s forwards chunk (rank - s) to the right and receives chunk
  // (rank - s - 1) from the left.
  for (int s = 0; s < w - 1; ++s) {
    const int send_chunk = Mod(rank_ - s, w);
    const int recv_chunk = Mod(rank_ - s - 1, w);
    const size_t send_bytes = chunk_size[send_chunk] * esize;
    const size_t recv_bytes = chunk_size[recv_chunk] * esize;
    if (recv_bytes > 0) {
      recv_buffer->recv(left, slot, chunk_offset[recv_chunk] * esize, recv_bytes);
    }
    if (send_bytes > 0) {
      send_buffer->send(right, slot, chunk_offset[send_chunk] * esize, send_bytes);
    }
    if (recv_bytes > 0) wait_(recv_buffer.get(), /*send=*/false, deadline);
    if (send_bytes > 0) {
      wait_(send_buffer.get(), /*send=*/true, deadline);
      counter->fetch_add(send_bytes);
    }
  }
}

}  // namespace zeroshard
