// Emulated nvcuda::wmma (see cuda_emulation.h) for the 16 x 16 x 16 bf16
// shapes: every lane holds the whole tile, so results do not depend on the
// hardware's register layout (the kernels must not either). Loads read the
// whole tile (so they need everything written before them); stores write
// only the elements e with e % 32 == lane, so a missing __syncwarp between a
// store and another lane's read shows as stale data.
#ifndef ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_MMA_H_
#define ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_MMA_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_bf16.h"
#include "cuda_emulation.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  float x[16 * 16];  // (row, col) at x[16 row + col]: A m x k, B k x n, C m x n
};

// What wmma requires of a load or store: a 256-bit aligned pointer, and a
// leading dimension a multiple of 16 bytes (8 bf16, 4 floats).
template <typename T>
void CheckOperand(const T* p, unsigned ldm) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || (ldm * sizeof(T)) % 16 != 0) {
    std::fprintf(stderr,
                 "wmma operand %p, ldm %u: not 32-byte aligned or ldm not a multiple of "
                 "16 bytes\n",
                 static_cast<const void*>(p), ldm);
    std::abort();
  }
}

inline float Widen(const __nv_bfloat16& v) {
  const unsigned int u = static_cast<unsigned int>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
void load_matrix_sync(fragment<matrix_a, 16, 16, 16, T, row_major>& f, const T* p, unsigned ldm) {
  CheckOperand(p, ldm);
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < 16; ++k) f.x[16 * i + k] = Widen(p[i * ldm + k]);
}
template <typename T>
void load_matrix_sync(fragment<matrix_b, 16, 16, 16, T, row_major>& f, const T* p, unsigned ldm) {
  CheckOperand(p, ldm);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 16; ++n) f.x[16 * k + n] = Widen(p[k * ldm + n]);
}
template <typename T>
void load_matrix_sync(fragment<matrix_b, 16, 16, 16, T, col_major>& f, const T* p, unsigned ldm) {
  CheckOperand(p, ldm);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 16; ++n) f.x[16 * k + n] = Widen(p[n * ldm + k]);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
  CheckOperand(p, ldm);
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n)
      f.x[16 * m + n] = layout == mem_row_major ? p[m * ldm + n] : p[n * ldm + m];
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
  CheckOperand(p, ldm);
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int e = lane; e < 256; e += 32) {
    const int m = e / 16, n = e % 16;
    (layout == mem_row_major ? p[m * ldm + n] : p[n * ldm + m]) = f.x[e];
  }
}
template <typename Use, int M, int N, int K, typename T, typename L>
void fill_fragment(fragment<Use, M, N, K, T, L>& f, float v) {
  for (float& x : f.x) x = v;
}
template <typename TA, typename TB, typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, TA, LA>& a,
              const fragment<matrix_b, 16, 16, 16, TB, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  float r[256];
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      float s = c.x[16 * m + n];
      for (int k = 0; k < 16; ++k) s += a.x[16 * m + k] * b.x[16 * k + n];
      r[16 * m + n] = s;
    }
  std::memcpy(d.x, r, sizeof(r));
}

}  // namespace wmma
}  // namespace nvcuda

#endif  // ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_MMA_H_
