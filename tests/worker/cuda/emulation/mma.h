// Emulated nvcuda::wmma (see cuda_emulation.h) for the shape the bf16 flash
// attention kernels use: bf16 16 x 16 x 16, f32 accumulators. Every lane holds the whole tile, so
// results do not depend on the hardware's register layout (the kernels must not either;
// element-wise work on a fragment's x[0..num_elements) is layout free, and here touches the whole
// tile). Loads read the whole tile (so they need everything written before them); stores write only
// the elements e with e % 32 == lane, so a missing __syncwarp between a store and another lane's
// read shows as stale data.
//
// The products of bf16 operands are exact in f32; each is added to the f32
// accumulator in order, k = 0 first, rounded to nearest even (the
// hardware's internal order and rounding are not emulated).
#ifndef ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_MMA_H_
#define ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_MMA_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

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

// Rows x columns of a fragment: A m x k, B k x n, C m x n.
template <typename Use, int M, int N, int K>
struct Extent {
  static constexpr int kRows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int kCols = std::is_same_v<Use, matrix_a> ? K : N;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int kRows = Extent<Use, M, N, K>::kRows;
  static constexpr int kCols = Extent<Use, M, N, K>::kCols;
  static constexpr int num_elements = kRows * kCols;
  float x[num_elements];  // (row, col) at x[kCols row + col]
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
inline float Widen(const float& v) { return v; }

// A and B operands: (row, col) of the fragment at p[row * ldm + col]
// (row_major) or p[col * ldm + row] (col_major).
template <typename Use, int M, int N, int K, typename T, typename L>
void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const T* p, unsigned ldm) {
  static_assert(std::is_same_v<L, row_major> || std::is_same_v<L, col_major>);
  CheckOperand(p, ldm);
  using F = fragment<Use, M, N, K, T, L>;
  for (int r = 0; r < F::kRows; ++r)
    for (int c = 0; c < F::kCols; ++c)
      f.x[F::kCols * r + c] = Widen(std::is_same_v<L, row_major> ? p[r * ldm + c] : p[c * ldm + r]);
}
template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm,
                      layout_t layout) {
  CheckOperand(p, ldm);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n)
      f.x[N * m + n] = layout == mem_row_major ? p[m * ldm + n] : p[n * ldm + m];
}
template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                       layout_t layout) {
  CheckOperand(p, ldm);
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int e = lane; e < M * N; e += 32) {
    const int m = e / N, n = e % N;
    (layout == mem_row_major ? p[m * ldm + n] : p[n * ldm + m]) = f.x[e];
  }
}
template <typename Use, int M, int N, int K, typename T, typename L>
void fill_fragment(fragment<Use, M, N, K, T, L>& f, float v) {
  for (float& x : f.x) x = v;
}

template <int M, int N, int K, typename TA, typename TB, typename LA, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d,
              const fragment<matrix_a, M, N, K, TA, LA>& a,
              const fragment<matrix_b, M, N, K, TB, LB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  static_assert(std::is_same_v<TA, TB>, "A and B of one precision");
  float r[M * N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float s = c.x[N * m + n];
      for (int k = 0; k < K; ++k) s += a.x[K * m + k] * b.x[N * k + n];
      r[N * m + n] = s;
    }
  std::memcpy(d.x, r, sizeof(r));
}

}  // namespace wmma
}  // namespace nvcuda

#endif  // ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_MMA_H_
