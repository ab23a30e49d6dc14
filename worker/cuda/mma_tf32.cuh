// Warp-level tf32 tensor-core products through PTX's mma.sync (sm_80 and
// later), with the fragments in registers, and the "3xTF32" split that
// keeps f32 accuracy (cutlass's OpMultiplyAddFastF32). Private to the .cu
// files of //worker/cuda:cuda_kernels.
//
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: D (16 x 8, f32) =
// A (16 x 8) B (8 x 8) + C, one warp. Which elements a lane holds (PTX ISA,
// "Matrix Fragments for mma.m16n8k8", .tf32), with g = lane / 4 and
// t = lane % 4:
//   A: a[0] (g, t), a[1] (g + 8, t), a[2] (g, t + 4), a[3] (g + 8, t + 4)
//   B: b[0] (t, g), b[1] (t + 4, g)                       (row k, column n)
//   C, D: c[0] (g, 2t), c[1] (g, 2t + 1), c[2] (g + 8, 2t), c[3] (g + 8, 2t + 1)
// Operands are f32 registers holding tf32 values (ToTf32's results: the 13
// low mantissa bits zero).
//
// Under the CPU emulation of CUDA (tests/worker/cuda/emulation, no nvcc),
// ToTf32 and MmaTf32Chain come from emulation/mma_sync.h, which computes
// the products from every lane's fragments laid out as above and refuses
// operands that are not tf32.
#ifndef ZEROSHARD_WORKER_CUDA_MMA_TF32_CUH_
#define ZEROSHARD_WORKER_CUDA_MMA_TF32_CUH_

#include <cuda_runtime.h>

#ifndef __CUDACC__
#include "mma_sync.h"  // tests/worker/cuda/emulation
#endif

namespace zeroshard {
namespace gpu {
namespace mma {

#ifdef __CUDACC__
// x rounded to tf32 (10 explicit mantissa bits), to nearest, ties away from
// zero (cvt.rna); NaN and infinities pass through.
__device__ __forceinline__ float ToTf32(float x) {
  unsigned int r = 0;
#if defined(__CUDA_ARCH__)
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
#endif
  return __uint_as_float(r);
}

// d += a b, one warp (every lane calls it, a[4] and b[2] laid out as the
// file comment says).
__device__ __forceinline__ void MmaTf32(float (&d)[4], const float* a, const float* b) {
#if defined(__CUDA_ARCH__)
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])),
        "r"(__float_as_uint(a[3])), "r"(__float_as_uint(b[0])), "r"(__float_as_uint(b[1])));
#endif
}

// d += a0 b0, then a1 b1, then a2 b2: three products into one accumulator,
// in that order.
__device__ __forceinline__ void MmaTf32Chain(float (&d)[4], const float* a0, const float* b0,
                                             const float* a1, const float* b1, const float* a2,
                                             const float* b2) {
  MmaTf32(d, a0, b0);
  MmaTf32(d, a1, b1);
  MmaTf32(d, a2, b2);
}
#else
__device__ __forceinline__ float ToTf32(float x) { return cuda_emulation::RoundToTf32(x); }
// The emulation takes the chain's three products through one exchange of
// the warp's fragments (one barrier rather than three), in the same order.
__device__ __forceinline__ void MmaTf32Chain(float (&d)[4], const float* a0, const float* b0,
                                             const float* a1, const float* b1, const float* a2,
                                             const float* b2) {
  cuda_emulation::MmaM16N8K8Tf32Chain(d, {a0, a1, a2}, {b0, b1, b2});
}
#endif

// An f32 operand as two tf32 parts: big = tf32(x), small = tf32(x - big)
// (x - big is exact in f32), so big + small = x (1 + e), |e| <= 2^-22.
template <int N>
struct Split {
  float big[N], small[N];
};

template <int N>
__device__ __forceinline__ Split<N> SplitTf32(const float (&x)[N]) {
  Split<N> s;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    s.big[i] = ToTf32(x[i]);
    s.small[i] = ToTf32(x[i] - s.big[i]);
  }
  return s;
}

// d += a b as three tf32 products, the small ones first: a.big b.small +
// a.small b.big + a.big b.big (a.small b.small, under 2^-44 of |a b|,
// dropped). Each product is off by under (3 + 2^-9) 2^-22 of |a b|.
__device__ __forceinline__ void Mma3xTf32(float (&d)[4], const Split<4>& a, const Split<2>& b) {
  MmaTf32Chain(d, a.big, b.small, a.small, b.big, a.big, b.big);
}

}  // namespace mma
}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_MMA_TF32_CUH_
