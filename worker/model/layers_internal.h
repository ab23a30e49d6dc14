// What layers.cc and attention.cc share: the vector-clone attribute, the
// parallel grains and the row-major GEMM. Internal to //worker/model:layers.
#ifndef ZEROSHARD_WORKER_MODEL_LAYERS_INTERNAL_H_
#define ZEROSHARD_WORKER_MODEL_LAYERS_INTERNAL_H_

#include <cstdint>

// Loops marked ZS_VECTOR_CLONES are compiled twice, for AVX2 + FMA (x86-64-v3)
// and for the baseline, and the loader picks the one the CPU runs (GCC's
// target_clones). Both give the same results: contraction to FMA is off in
// ISO C++ mode, so the AVX2 clone does the same roundings 8 lanes at a time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZS_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ZS_VECTOR_CLONES
#endif

namespace zeroshard::layers_internal {

// Rows (or columns, or elements) per parallel range: below this a loop stays
// on the calling thread.
constexpr int64_t kRowGrain = 16;
constexpr int64_t kElementGrain = 1 << 14;
constexpr int64_t kColumnGrain = 64;

// Row-major single-precision GEMM, C[M,N] = alpha op(A)[M,K] op(B)[K,N] +
// beta C. Sizes come in as int64_t and go to BLAS as blasint (32-bit here);
// every matrix in these models is far below 2^31 elements per dimension.
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// row[s] *= scale for s < len (softmax's normalization, in attention and the
// cross entropy).
void Scale(float* row, int64_t len, float scale);

}  // namespace zeroshard::layers_internal

#endif  // ZEROSHARD_WORKER_MODEL_LAYERS_INTERNAL_H_
