// Int8 (and int4, below) block-quantized collectives (--gather_dtype=int8, --reduce_dtype=int8),
// after ZeRO++'s qwZ (quantized weight all-gather) and qgZ (quantized
// gradient reduce-scatter through an all-to-all), written here over any
// Communicator: f32 buffers in and out, int8 plus one f32 scale per block of
// kInt8Block elements on the wire.
//
// Quantization (per block of at most 256 elements, max-abs scaling):
//   scale = max|x| / 127;  q = round(x / scale) in [-127, 127];  x' = q * scale
// so |x - x'| <= scale / 2 = max|x| / 254 per element, plus the f32
// roundings of the ratio, the scale and the product (4u max|x|, u = 2^-24):
// |x - x'| <= max|x| / 254 * (1 + 1016 u). A block of zeros is exact.
// Rounding (Int8Rounding): to nearest, as above, or stochastic:
//   q = floor(x / scale + v), v uniform in [0, 1) (24 random bits)
// which rounds up with probability equal to the fraction of the quantum, so
// E[x'] = x (unbiased) and |x - x'| < scale = max|x| / 127, plus the same
// f32 roundings: |x - x'| <= max|x| / 127 * (1 + 1016 u). Nearest's error is
// half as large but biased: every value below half its block's quantum
// becomes 0, on every step, so a small gradient that recurs is never
// applied; stochastic rounding applies it on average. The random bits come
// from std::mt19937 seeded with (seed, rank, destination): the same seed
// gives the same bits, so runs repeat.
// A block holding NaN or ±Inf gets scale NaN: every element of it comes back
// NaN, so a non-finite gradient still shows as a NaN norm (the step fails as
// it would in f32) instead of being clipped to ±127 silently.
//
// No value is quantized more than once on its way, so the error does not
// grow with the ring's length:
//   all-gather      each shard is quantized once by its owner, dequantized
//                   by every receiver (bound: max|x|/254 per element).
//   reduce-scatter  each rank packs its contribution for every destination
//                   and quantizes it once, an all-to-all delivers them, and
//                   the destination dequantizes and sums in f32 in rank
//                   order (bound: sum over ranks of their block's
//                   max|x_r|/254, before dividing by W for an average).
//   all-reduce      each rank quantizes its buffer once, an all-gather
//                   delivers every rank's to every rank, and each sums them
//                   in f32 in rank order: every rank ends with the same bits
//                   (replicas stay equal), same bound as the reduce-scatter.
// Elements outside this rank's blocks are left as they are, as in the f32
// collectives. Errors are the communicator's.
//
// Int4 (DiLoCo's --outer_dtype=int4; Streaming DiLoCo, Douillard et al.
// 2025, sends its outer gradient in 4 bits): per block of kInt4Block = 64
// elements, max-abs scaling to the 15 levels [-7, 7] (the 16th code, -8,
// is unused so that the range is symmetric and 0 is exact):
//   scale = max|x| / 7;  q = round(x / scale) in [-7, 7];  x' = q * scale
// rounded to nearest (half away from zero), two values a byte (element 2i
// in the low nibble of byte i, 2i + 1 in the high one, two's complement).
// So |x - x'| <= scale / 2 = max|x| / 14 per element, plus the f32
// roundings of the ratio, the scale and the product (4u max|x|):
// |x - x'| <= max|x| / 14 * (1 + 56 u). Zeros are exact; a block holding
// NaN or ±Inf gets scale NaN, as int8's. Why 64 and not int8's 256: with
// 15 levels the quantum is a seventh of the block's max, so one large value
// flattens every small one of its block to 0; smaller blocks confine an
// outlier to fewer neighbours, at 4 bytes of scale per block: 4 + 32 bytes
// per 64 elements, 4.5 bits an element, 9/64 of f32's bytes (256 would
// give 4.125 bits; 32 would give 5). The one int4 collective is the
// all-reduce, built as int8's (quantize once, all-gather, sum in f32 in
// rank order: every rank ends with the same bits), its error the sum over
// ranks of max|x_r| / 14 (1 + 56 u) plus the f32 sum's.
#ifndef ZEROSHARD_WORKER_COMM_QUANTIZED_H_
#define ZEROSHARD_WORKER_COMM_QUANTIZED_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace zeroshard {

inline constexpr int64_t kInt8Block = 256;  // elements per scale
inline constexpr int64_t kInt4Block = 64;   // elements per scale (even: whole bytes)

// How a value between two quanta rounds (see above). Stochastic: `seed`
// picks the random stream; callers give every call its own (e.g. unit and
// step) so that the dithers of successive steps are independent.
struct Int8Rounding {
  bool stochastic = false;
  uint64_t seed = 0;
};

// Bytes of `n` quantized elements: ceil(n / 256) f32 scales, then n int8
// values, rounded up to a multiple of 4 (the collectives move 4-byte words).
int64_t Int8PackedBytes(int64_t n);

// Quantizes x[0, n) into `packed` (Int8PackedBytes(n) bytes). Stochastic
// rounding draws n numbers from a std::mt19937 seeded with rounding.seed.
void QuantizeInt8(const float* x, int64_t n, void* packed, Int8Rounding rounding = {});
// out[i] = element begin + i of `packed` (n elements), for i in [0, count).
void DequantizeInt8(const void* packed, int64_t n, int64_t begin, int64_t count, float* out);
// acc[i] += element begin + i of `packed`, for i in [0, count).
void AddDequantizedInt8(const void* packed, int64_t n, int64_t begin, int64_t count, float* acc);

// As Communicator::AllGatherBlocks (f32), the shards travelling quantized.
absl::Status QuantizedAllGatherBlocks(Communicator* comm, const float* shard, float* full,
                                      const std::vector<ShardBlock>& blocks,
                                      absl::Duration timeout);
// As Communicator::ReduceScatterBlocks (f32), through one quantization of
// every contribution and Communicator::AllToAll. Stochastic rounding: each
// (rank, destination) part draws from its own stream of rounding.seed.
absl::Status QuantizedReduceScatterBlocks(Communicator* comm, const float* full, float* shard,
                                          const std::vector<ShardBlock>& blocks, ReduceOp op,
                                          absl::Duration timeout, Int8Rounding rounding = {});
// As Communicator::AllReduce (f32, in place), through one quantization of
// every rank's buffer and an all-gather; every rank still ends with the same
// bits (each sums the same quantized values), whatever the rounding.
absl::Status QuantizedAllReduce(Communicator* comm, float* buffer, int64_t count, ReduceOp op,
                                absl::Duration timeout, Int8Rounding rounding = {});

// Bytes of `n` int4 elements: ceil(n / 64) f32 scales, then ceil(n / 2)
// bytes of values, rounded up to a multiple of 4 (zero padding).
int64_t Int4PackedBytes(int64_t n);
// Quantizes x[0, n) into `packed` (Int4PackedBytes(n) bytes), to nearest.
void QuantizeInt4(const float* x, int64_t n, void* packed);
// out[i] = element begin + i of `packed` (n elements), for i in [0, count).
void DequantizeInt4(const void* packed, int64_t n, int64_t begin, int64_t count, float* out);
// acc[i] += element begin + i of `packed`, for i in [0, count).
void AddDequantizedInt4(const void* packed, int64_t n, int64_t begin, int64_t count, float* acc);
// As QuantizedAllReduce, through int4: every rank ends with the same bits.
absl::Status QuantizedAllReduceInt4(Communicator* comm, float* buffer, int64_t count, ReduceOp op,
                                    absl::Duration timeout);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_QUANTIZED_H_
