#include "worker/comm/quantized.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

int64_t BlocksOf(int64_t n) { return (n + kInt8Block - 1) / kInt8Block; }

const float* ScalesOf(const void* packed) { return static_cast<const float*>(packed); }

const int8_t* ValuesOf(const void* packed, int64_t n) {
  return reinterpret_cast<const int8_t*>(static_cast<const char*>(packed) + 4 * BlocksOf(n));
}

// Staging kept per thread (grow-only, each engine stream has its own
// thread) so that a collective does not page-fault fresh memory in. Host
// memory of about a quarter of the largest unit's f32 bytes (times W for
// the receive side), outside the engine's memory accounting.
char* Scratch(int index, int64_t bytes) {
  thread_local std::vector<char> scratch[3];
  if (static_cast<int64_t>(scratch[index].size()) < bytes) scratch[index].resize(bytes);
  return scratch[index].data();
}

// Per rank: the end of its blocks in its shard (elements).
std::vector<int64_t> ShardExtents(const std::vector<ShardBlock>& blocks, int world_size) {
  std::vector<int64_t> extent(world_size, 0);
  for (const ShardBlock& b : blocks) {
    extent[b.rank] = std::max(extent[b.rank], b.shard_offset + b.count);
  }
  return extent;
}

// The stream of `rank`'s part for `destination`: ranks and parts must not
// share dithers (equal dithers on equal values would round them alike).
Int8Rounding PartRounding(Int8Rounding rounding, int rank, int destination) {
  std::seed_seq seq{static_cast<uint32_t>(rounding.seed),
                    static_cast<uint32_t>(rounding.seed >> 32), static_cast<uint32_t>(rank),
                    static_cast<uint32_t>(destination)};
  uint32_t words[2];
  seq.generate(words, words + 2);
  rounding.seed = (static_cast<uint64_t>(words[1]) << 32) | words[0];
  return rounding;
}

int64_t MaxPackedBytes(const std::vector<int64_t>& extents) {
  int64_t bytes = 0;
  for (int64_t e : extents) bytes = std::max(bytes, Int8PackedBytes(e));
  return bytes;
}

// max|x| of a block of `count` values, or 0 where the block needs no
// quanta: all zeros (scale 0, exact) or holding a NaN or ±Inf (scale NaN:
// every element dequantizes to NaN, see the header); *scale is set then.
float SpecialBlockScale(const float* x, int64_t count, float* scale) {
  float amax = 0;
  bool finite = true;
  for (int64_t i = 0; i < count; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  if (finite && amax > 0) return amax;
  *scale = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  return 0;
}

// The all-reduce of both widths: every rank quantizes its buffer once
// (`quantize` into `packed` bytes), an all-gather delivers every rank's to
// every rank, and each sums them in f32 in rank order (`dequantize` then
// `add`): the same values in the same order, so the same bits everywhere.
template <typename Quantize, typename Dequantize, typename Add>
absl::Status AllReduceQuantizedOnce(Communicator* comm, float* buffer, int64_t count, ReduceOp op,
                                    absl::Duration timeout, const char* what, int64_t packed,
                                    Quantize quantize, Dequantize dequantize, Add add) {
  const int w = comm->world_size();
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": negative count ", count));
  }
  if (w == 1 || count == 0) return absl::OkStatus();
  char* send = Scratch(0, packed);
  char* recv = Scratch(1, packed * w);
  quantize(buffer, count, send);
  // Words of 4 bytes (nothing is added, so the dtype only sizes them).
  if (absl::Status s = comm->AllGather(send, recv, packed / 4, DType::kF32, timeout); !s.ok()) {
    return s;
  }
  dequantize(recv, count, 0, count, buffer);
  for (int r = 1; r < w; ++r) add(recv + r * packed, count, 0, count, buffer);
  if (op == ReduceOp::kAverage) {
    const float divisor = static_cast<float>(w);
    for (int64_t i = 0; i < count; ++i) buffer[i] /= divisor;
  }
  return absl::OkStatus();
}

}  // namespace

int64_t Int8PackedBytes(int64_t n) {
  const int64_t bytes = 4 * BlocksOf(n) + n;
  return (bytes + 3) / 4 * 4;
}

namespace {

// The quanta of one finite block with max|x| = amax > 0 (the ratio
// 127 / amax finite), rounded up with probability equal to the fraction of
// the quantum: floor(r + v), v = 24 random bits / 2^24 in [0, 1). r + v is
// an f32 of magnitude below 128, whose ulp is at most 2^-17: v's low bits
// round away, a bias below 2^-17 of a quantum. The clamp keeps
// |r| <= 127 (1 + 2u) from reaching 128 when v is near 1.
void RoundStochastically(const float* x, int64_t count, float ratio, std::mt19937* gen, int8_t* q) {
  constexpr float kTwoToMinus24 = 1.0f / (1 << 24);
  for (int64_t i = 0; i < count; ++i) {
    const float v = static_cast<float>((*gen)() >> 8) * kTwoToMinus24;
    const float rounded = std::floor(x[i] * ratio + v);
    q[i] = static_cast<int8_t>(std::clamp(rounded, -127.0f, 127.0f));
  }
}

}  // namespace

void QuantizeInt8(const float* x, int64_t n, void* packed, Int8Rounding rounding) {
  std::mt19937 gen;
  if (rounding.stochastic) {
    std::seed_seq seq{static_cast<uint32_t>(rounding.seed),
                      static_cast<uint32_t>(rounding.seed >> 32)};
    gen.seed(seq);
  }
  float* scales = static_cast<float*>(packed);
  int8_t* q = const_cast<int8_t*>(ValuesOf(packed, n));
  for (int64_t block = 0; block < BlocksOf(n); ++block) {
    const int64_t begin = block * kInt8Block;
    const int64_t end = std::min(n, begin + kInt8Block);
    const float amax = SpecialBlockScale(x + begin, end - begin, &scales[block]);
    if (amax == 0) {
      std::memset(q + begin, 0, end - begin);
      continue;
    }
    scales[block] = static_cast<float>(static_cast<double>(amax) / 127.0);
    const float ratio = static_cast<float>(127.0 / static_cast<double>(amax));
    if (!std::isfinite(ratio)) {
      // amax below ~3e-37: x * 127 / amax in double (no overflow).
      const double exact = 127.0 / static_cast<double>(amax);
      for (int64_t i = begin; i < end; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(static_cast<double>(x[i]) * exact));
      }
      continue;
    }
    if (rounding.stochastic) {
      RoundStochastically(x + begin, end - begin, ratio, &gen, q + begin);
      continue;
    }
    // Rounds half away from zero by truncation (vectorizes; nearbyint is a
    // library call per element here). |x * ratio| <= 127 (1 + 2u), so the
    // result stays in [-127, 127].
    for (int64_t i = begin; i < end; ++i) {
      const float r = x[i] * ratio;
      q[i] = static_cast<int8_t>(static_cast<int32_t>(r + (r < 0 ? -0.5f : 0.5f)));
    }
  }
}

namespace {

// out[i] (= or +=) element begin + i, block by block so that the inner
// loops vectorize.
template <bool kAdd>
void Dequantize(const void* packed, int64_t n, int64_t begin, int64_t count, float* out) {
  const float* scales = ScalesOf(packed);
  const int8_t* q = ValuesOf(packed, n);
  int64_t i = 0;
  while (i < count) {
    const int64_t k = begin + i;
    const int64_t block = k / kInt8Block;
    const int64_t run = std::min(count - i, (block + 1) * kInt8Block - k);
    const float scale = scales[block];
    const int8_t* from = q + k;
    float* to = out + i;
    for (int64_t j = 0; j < run; ++j) {
      if (kAdd) {
        to[j] += static_cast<float>(from[j]) * scale;
      } else {
        to[j] = static_cast<float>(from[j]) * scale;
      }
    }
    i += run;
  }
}

}  // namespace

void DequantizeInt8(const void* packed, int64_t n, int64_t begin, int64_t count, float* out) {
  Dequantize<false>(packed, n, begin, count, out);
}

void AddDequantizedInt8(const void* packed, int64_t n, int64_t begin, int64_t count, float* acc) {
  Dequantize<true>(packed, n, begin, count, acc);
}

absl::Status QuantizedAllGatherBlocks(Communicator* comm, const float* shard, float* full,
                                      const std::vector<ShardBlock>& blocks,
                                      absl::Duration timeout) {
  const int w = comm->world_size();
  const int rank = comm->rank();
  if (absl::Status s = ValidateBlocks("all_gather (int8)", blocks, w); !s.ok()) return s;
  if (w == 1) {  // nothing travels: an exact copy
    for (const ShardBlock& b : blocks) {
      std::memmove(full + b.full_offset, shard + b.shard_offset, b.count * sizeof(float));
    }
    return absl::OkStatus();
  }
  const std::vector<int64_t> extent = ShardExtents(blocks, w);
  const int64_t packed = MaxPackedBytes(extent);
  if (packed == 0) return absl::OkStatus();
  char* send = Scratch(0, packed);
  char* recv = Scratch(1, packed * w);
  QuantizeInt8(shard, extent[rank], send);
  // Words of 4 bytes (nothing is added, so the dtype only sizes them).
  if (absl::Status s = comm->AllGather(send, recv, packed / 4, DType::kF32, timeout); !s.ok()) {
    return s;
  }
  // Own blocks too: every rank computes on the same (dequantized) values.
  for (const ShardBlock& b : blocks) {
    DequantizeInt8(recv + b.rank * packed, extent[b.rank], b.shard_offset, b.count,
                   full + b.full_offset);
  }
  return absl::OkStatus();
}

absl::Status QuantizedReduceScatterBlocks(Communicator* comm, const float* full, float* shard,
                                          const std::vector<ShardBlock>& blocks, ReduceOp op,
                                          absl::Duration timeout, Int8Rounding rounding) {
  const int w = comm->world_size();
  const int rank = comm->rank();
  if (absl::Status s = ValidateBlocks("reduce_scatter (int8)", blocks, w); !s.ok()) return s;
  if (w == 1) {
    for (const ShardBlock& b : blocks) {
      std::memmove(shard + b.shard_offset, full + b.full_offset, b.count * sizeof(float));
    }
    return absl::OkStatus();
  }
  const std::vector<int64_t> extent = ShardExtents(blocks, w);
  const int64_t packed = MaxPackedBytes(extent);
  if (packed == 0) return absl::OkStatus();
  const int64_t max_extent = *std::max_element(extent.begin(), extent.end());
  float* stage = reinterpret_cast<float*>(Scratch(2, max_extent * sizeof(float)));
  char* send = Scratch(0, packed * w);
  char* recv = Scratch(1, packed * w);
  // Rank r's contribution, in r's shard layout, quantized once.
  for (int r = 0; r < w; ++r) {
    std::fill(stage, stage + extent[r], 0.0f);
    for (const ShardBlock& b : blocks) {
      if (b.rank != r) continue;
      std::memcpy(stage + b.shard_offset, full + b.full_offset, b.count * sizeof(float));
    }
    QuantizeInt8(stage, extent[r], send + r * packed, PartRounding(rounding, rank, r));
  }
  if (absl::Status s = comm->AllToAll(send, recv, packed, timeout); !s.ok()) return s;
  const float divisor = op == ReduceOp::kAverage ? static_cast<float>(w) : 1.0f;
  for (const ShardBlock& b : blocks) {
    if (b.rank != rank) continue;
    float* out = shard + b.shard_offset;
    DequantizeInt8(recv, extent[rank], b.shard_offset, b.count, out);
    for (int r = 1; r < w; ++r) {
      AddDequantizedInt8(recv + r * packed, extent[rank], b.shard_offset, b.count, out);
    }
    if (divisor != 1.0f) {
      for (int64_t i = 0; i < b.count; ++i) out[i] /= divisor;
    }
  }
  return absl::OkStatus();
}

absl::Status QuantizedAllReduce(Communicator* comm, float* buffer, int64_t count, ReduceOp op,
                                absl::Duration timeout, Int8Rounding rounding) {
  const Int8Rounding own = PartRounding(rounding, comm->rank(), 0);
  return AllReduceQuantizedOnce(
      comm, buffer, count, op, timeout, "all_reduce (int8)", Int8PackedBytes(count),
      [own](const float* x, int64_t n, void* packed) { QuantizeInt8(x, n, packed, own); },
      DequantizeInt8, AddDequantizedInt8);
}

// ---- Int4 ----

namespace {

int64_t Int4BlocksOf(int64_t n) { return (n + kInt4Block - 1) / kInt4Block; }

const uint8_t* Int4ValuesOf(const void* packed, int64_t n) {
  return reinterpret_cast<const uint8_t*>(static_cast<const char*>(packed) + 4 * Int4BlocksOf(n));
}

// Element k's quantum, from its nibble (two's complement: sign-extended by
// an arithmetic shift of the nibble placed in a byte's top half).
int Int4At(const uint8_t* values, int64_t k) {
  const uint8_t byte = values[k / 2];
  const uint8_t top = k % 2 == 0 ? static_cast<uint8_t>(byte << 4) : byte;
  return static_cast<int8_t>(top) >> 4;
}

template <bool kAdd>
void DequantizeNibbles(const void* packed, int64_t n, int64_t begin, int64_t count, float* out) {
  const float* scales = ScalesOf(packed);
  const uint8_t* values = Int4ValuesOf(packed, n);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t k = begin + i;
    const float v = static_cast<float>(Int4At(values, k)) * scales[k / kInt4Block];
    if (kAdd) {
      out[i] += v;
    } else {
      out[i] = v;
    }
  }
}

}  // namespace

int64_t Int4PackedBytes(int64_t n) {
  const int64_t bytes = 4 * Int4BlocksOf(n) + (n + 1) / 2;
  return (bytes + 3) / 4 * 4;
}

void QuantizeInt4(const float* x, int64_t n, void* packed) {
  float* scales = static_cast<float*>(packed);
  uint8_t* values = const_cast<uint8_t*>(Int4ValuesOf(packed, n));
  // Zero quanta and zero padding: blocks of zeros or non-finite values,
  // an odd n's last high nibble and the word's padding stay 0.
  std::memset(values, 0, Int4PackedBytes(n) - 4 * Int4BlocksOf(n));
  for (int64_t block = 0; block < Int4BlocksOf(n); ++block) {
    const int64_t begin = block * kInt4Block;
    const int64_t end = std::min(n, begin + kInt4Block);
    const float amax = SpecialBlockScale(x + begin, end - begin, &scales[block]);
    if (amax == 0) continue;
    scales[block] = static_cast<float>(static_cast<double>(amax) / 7.0);
    // 7 / amax in double (amax may be so small that its f32 overflows):
    // x * ratio errs by 2u of it, so |r| <= 7 (1 + 2u) and r + 0.5
    // truncates to at most 7.
    const double ratio = 7.0 / static_cast<double>(amax);
    const float ratio_f32 = static_cast<float>(ratio);
    const bool narrow = std::isfinite(ratio_f32);
    for (int64_t i = begin; i < end; ++i) {
      const double r = narrow ? static_cast<double>(x[i] * ratio_f32) : x[i] * ratio;
      const int q = static_cast<int>(r + (r < 0 ? -0.5 : 0.5));
      values[i / 2] |= static_cast<uint8_t>((q & 0xF) << (4 * (i % 2)));
    }
  }
}

void DequantizeInt4(const void* packed, int64_t n, int64_t begin, int64_t count, float* out) {
  DequantizeNibbles<false>(packed, n, begin, count, out);
}

void AddDequantizedInt4(const void* packed, int64_t n, int64_t begin, int64_t count, float* acc) {
  DequantizeNibbles<true>(packed, n, begin, count, acc);
}

absl::Status QuantizedAllReduceInt4(Communicator* comm, float* buffer, int64_t count, ReduceOp op,
                                    absl::Duration timeout) {
  return AllReduceQuantizedOnce(comm, buffer, count, op, timeout, "all_reduce (int4)",
                                Int4PackedBytes(count), QuantizeInt4, DequantizeInt4,
                                AddDequantizedInt4);
}

}  // namespace zeroshard
