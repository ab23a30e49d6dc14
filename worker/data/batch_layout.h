// Which micro-batches each rank of a generation trains at a step
// (--keep_global_batch, #45 item 3; worker/recovery/global_batch.h plans it).
//
// The data layout (regression_data.h, text_data.h) numbers a step's samples
// by (micro m, rank r) of `data_world` ranks and `data_accum` micro-batches:
// the step is N = data_world * data_accum micro-batches of `batch` rows,
// micro-batch k = m * data_world + r starting at row (s * N + k) * batch. A
// generation of `world` ranks takes those N micro-batches round-robin: rank
// r' trains k = m' * world + r' for m' = 0, 1, ... while k < N, i.e.
// ceil((N - r') / world) of them; the ranks below N mod world take one more
// than the others when world does not divide N. The union is exactly the
// step's N micro-batches, each once, and every rank goes through them in
// increasing k. When world == data_world it is the layout itself (rank r
// trains its own micro-batches), and when world divides N it is the layout
// at (world, N / world): rank r' micro m' is k = m' * world + r' either way.
//
// Every rank runs Passes() = ceil(N / world) micro-batch passes a step (the
// engine's collectives are per pass); a rank with fewer micro-batches pads
// with passes that carry no data (ZeroEngine::PadMicroBatch).
#ifndef ZEROSHARD_WORKER_DATA_BATCH_LAYOUT_H_
#define ZEROSHARD_WORKER_DATA_BATCH_LAYOUT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace zeroshard {

struct BatchLayout {
  int world = 1;       // ranks of the generation
  int data_world = 1;  // ranks of the layout the rows follow (the job's --world_size when kept)
  int data_accum = 1;  // micro-batches per rank of that layout (--grad_accum)

  // INVALID_ARGUMENT unless all three are >= 1 and N fits an int.
  absl::Status Check() const;
  // N: the step's micro-batches over all ranks.
  int64_t MicroBatches() const { return int64_t{data_world} * data_accum; }
  // Micro-batch passes every rank runs a step: ceil(N / world).
  int Passes() const { return static_cast<int>((MicroBatches() + world - 1) / world); }
  // The micro-batches `rank` trains a step: ceil((N - rank) / world).
  int DataMicroBatches(int rank) const {
    return static_cast<int>((MicroBatches() - rank + world - 1) / world);
  }
  // Every rank trains Passes() micro-batches (no padding).
  bool Even() const { return MicroBatches() % world == 0; }

  // Where rank `rank`'s micro-batch `micro` (0 <= micro <
  // DataMicroBatches(rank)) lies in the data layout: micro-batch k / data_world
  // of rank k % data_world, k = micro * world + rank.
  struct Coordinates {
    int micro = 0;
    int rank = 0;
  };
  Coordinates At(int rank, int micro) const {
    const int64_t k = int64_t{micro} * world + rank;
    return {static_cast<int>(k / data_world), static_cast<int>(k % data_world)};
  }

  // "4 ranks x 1 micro-batch over 3 ranks", for messages.
  std::string Describe() const;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_DATA_BATCH_LAYOUT_H_
