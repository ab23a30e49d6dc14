// Emulated mma.sync (see cuda_emulation.h) for worker/cuda/mma_tf32.cuh:
// chains of the tf32 m16n8k8 product with f32 accumulators, from every lane's
// fragments laid out as PTX documents them (mma_tf32.cuh's comment), so a
// kernel that puts an element in the wrong lane or register computes the
// wrong product here too. Operands that are not tf32 (any of the 13 low
// mantissa bits set: the hardware would ignore them) abort, so a kernel
// that forgets to round fails. Each of D's elements is C's plus the eight
// products (exact in f32) added in order, k = 0 first, rounded to nearest
// even: the hardware's internal order and rounding are not emulated.
#ifndef ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_MMA_SYNC_H_
#define ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_MMA_SYNC_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "cuda_emulation.h"

namespace cuda_emulation {

// Rounds to tf32 as cvt.rna.tf32.f32 does: to nearest, ties away from zero
// (on the bits: add half of the 13 dropped bits' unit to the magnitude and
// clear them; a carry into the exponent is the correct rounding up, to
// infinity past the largest finite); NaN and infinities pass through.
inline float RoundToTf32(float in) {
  uint32_t u;
  std::memcpy(&u, &in, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & ~0x1fffu;
  float out;
  std::memcpy(&out, &u, 4);
  return out;
}

inline float CheckedTf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) != 0x7f800000u && (u & 0x1fffu) != 0) {
    std::fprintf(stderr, "tf32 mma operand %a has bits below tf32's 10 (not rounded by ToTf32)\n",
                 static_cast<double>(x));
    std::abort();
  }
  return x;
}

// d += a[0] b[0], then a[1] b[1], ... (up to three products, in order) over
// the warp: each lane publishes its fragments, a[i][4] and b[i][2]; after
// the warp's barrier each computes its own four elements of D from
// everyone's. One barrier per call: lanes alternate between two sets of
// operand words, so a lane's next call writes the other set while others may
// still read this one, and the call after waits at the next barrier for
// every lane to have finished reading.
inline void MmaM16N8K8Tf32Chain(float (&d)[4], std::initializer_list<const float*> a,
                                std::initializer_list<const float*> b) {
  constexpr int kPer = 6;  // words per product: a[4], b[2]
  const int products = static_cast<int>(a.size());
  if (products != static_cast<int>(b.size()) || products * kPer > Block::kWords) std::abort();
  Block& blk = *g_block;
  const unsigned int me = tl_linear, lane = me % 32, base = me - lane;
  const size_t set = static_cast<size_t>(tl_warp_ops++ % 2) * Block::kWords;
  const auto at = [&](unsigned int thread) {
    return &blk.words[static_cast<size_t>(thread) * 2 * Block::kWords + set];
  };
  for (int p = 0; p < products; ++p) {
    std::memcpy(at(me) + kPer * p, a.begin()[p], 4 * sizeof(float));
    std::memcpy(at(me) + kPer * p + 4, b.begin()[p], 2 * sizeof(float));
  }
  __syncwarp();
  const int g = static_cast<int>(lane / 4), t = static_cast<int>(lane % 4);
  for (int p = 0; p < products; ++p) {
    // A (row, k): lane 4 (row % 8) + k % 4, register (row / 8) + 2 (k / 4).
    const auto a_at = [&](int row, int k) {
      const unsigned int from = base + static_cast<unsigned int>(4 * (row % 8) + k % 4);
      return CheckedTf32(at(from)[kPer * p + row / 8 + 2 * (k / 4)]);
    };
    // B (k, n): lane 4 n + k % 4, register k / 4.
    const auto b_at = [&](int k, int n) {
      const unsigned int from = base + static_cast<unsigned int>(4 * n + k % 4);
      return CheckedTf32(at(from)[kPer * p + 4 + k / 4]);
    };
    float r[4];
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
      float s = d[i];
      for (int k = 0; k < 8; ++k) s += a_at(row, k) * b_at(k, col);
      r[i] = s;
    }
    std::memcpy(d, r, sizeof(r));
  }
}

}  // namespace cuda_emulation

#endif  // ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_MMA_SYNC_H_
