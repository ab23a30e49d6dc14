// The CPU emulation of CUDA itself (emulation/cuda_emulation.h), on which the
// *_emulated_test kernel tests rest: thread and block numbering of 2-D blocks
// and grids, warps of consecutive threads, 8-byte shuffles, barriers that
// order shared memory, the launch limits, and the allocator's alignment,
// poison and count; tf32 rounding and mma.sync's m16n8k8 tf32 product over
// PTX's fragment layout (emulation/mma_sync.h).
#include <cuda_runtime.h>  // the emulation's (tests/worker/cuda/emulation)
#include <mma_sync.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace {

// Each thread writes its (block, thread) coordinates at its global index.
__global__ void Coordinates(unsigned int* out) {
  const unsigned int block = blockIdx.y * gridDim.x + blockIdx.x;
  const unsigned int thread = threadIdx.y * blockDim.x + threadIdx.x;
  const unsigned int i = block * blockDim.x * blockDim.y + thread;
  out[4 * i + 0] = blockIdx.x;
  out[4 * i + 1] = blockIdx.y;
  out[4 * i + 2] = threadIdx.x;
  out[4 * i + 3] = threadIdx.y;
}

TEST(CudaEmulationTest, TwoDimensionalBlocksAndGrids) {
  std::vector<unsigned int> out(4 * 3 * 2 * 8 * 4, 0xffffffffu);
  cuda_emulation::Launcher(dim3(3, 2), dim3(8, 4))
      .Run([](auto... a) { Coordinates(a...); }, out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (unsigned int by = 0; by < 2; ++by) {
    for (unsigned int bx = 0; bx < 3; ++bx) {
      for (unsigned int ty = 0; ty < 4; ++ty) {
        for (unsigned int tx = 0; tx < 8; ++tx) {
          const unsigned int i = (by * 3 + bx) * 32 + ty * 8 + tx;
          EXPECT_EQ(out[4 * i + 0], bx);
          EXPECT_EQ(out[4 * i + 1], by);
          EXPECT_EQ(out[4 * i + 2], tx);
          EXPECT_EQ(out[4 * i + 3], ty);
        }
      }
    }
  }
}

// A butterfly over the warp in double: every lane gets the warp's sum; lanes
// are consecutive linear thread indices (a 16 x 4 block is two warps).
__global__ void WarpSums(double* out) {
  const unsigned int t = threadIdx.y * blockDim.x + threadIdx.x;
  double v = t;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  out[t] = v;
}

TEST(CudaEmulationTest, ShufflesMoveDoublesWithinWarps) {
  std::vector<double> out(64, -1);
  cuda_emulation::Launcher(1, dim3(16, 4)).Run([](auto... a) { WarpSums(a...); }, out.data());
  for (int t = 0; t < 64; ++t) {
    EXPECT_EQ(out[t], t < 32 ? 31 * 32 / 2 : (32 + 63) * 32 / 2) << "thread " << t;
  }
}

// Thread 0 writes shared memory after every other thread has read it; the
// barrier between makes the readers see the previous value.
__global__ void ReadThenWrite(int* out) {
  static int shared;  // what `__shared__ int shared;` becomes (emulate_source.sh)
  if (threadIdx.x == 0) shared = static_cast<int>(blockIdx.x) + 1;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = shared;
  __syncthreads();
  if (threadIdx.x == 0) shared = -1;
}

TEST(CudaEmulationTest, BarriersOrderSharedMemory) {
  std::vector<int> out(3 * 128, 0);
  cuda_emulation::Launcher(3, 128).Run([](auto... a) { ReadThenWrite(a...); }, out.data());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], static_cast<int>(i / 128) + 1) << i;
}

// Limits of every current GPU: an invalid launch runs nothing and leaves
// cudaErrorInvalidConfiguration for cudaGetLastError (read once).
TEST(CudaEmulationTest, InvalidLaunchesRunNothing) {
  std::vector<unsigned int> out(4 * 2048, 7);
  for (const auto& [grid, block] : {std::pair<dim3, dim3>{dim3(0), dim3(32)},
                                    {dim3(1), dim3(2048)},
                                    {dim3(1), dim3(32, 32, 2)},
                                    {dim3(1, 65536), dim3(32)},
                                    {dim3(1), dim3(0)}}) {
    cuda_emulation::Launcher(grid, block).Run([](auto... a) { Coordinates(a...); }, out.data());
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
  for (unsigned int x : out) ASSERT_EQ(x, 7u);
  cuda_emulation::Launcher(1, 1024).Run([](auto... a) { Coordinates(a...); }, out.data());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CudaEmulationTest, AllocationsAreAlignedPoisonedAndCounted) {
  const int live = cuda_emulation::LiveAllocations();
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(&p, 10, nullptr), cudaSuccess);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u);
  float f;
  std::memcpy(&f, p, sizeof(f));
  EXPECT_TRUE(f != f) << "fresh memory reads as NaN";
  EXPECT_EQ(cuda_emulation::LiveAllocations(), live + 1);
  ASSERT_EQ(cudaFreeAsync(p, nullptr), cudaSuccess);
  EXPECT_EQ(cuda_emulation::LiveAllocations(), live);
}

// tf32 rounding (emulation/mma_sync.h, as cvt.rna.tf32.f32): to 10 explicit
// mantissa bits, to nearest, ties away from zero (cvt.rna); the 3xTF32 split
// of the f32 tensor-core flash kernels recovers x to within 2^-22 |x|.
TEST(CudaEmulationTest, Tf32RoundsToNearestTiesAway) {
  const auto tf32 = cuda_emulation::RoundToTf32;
  EXPECT_EQ(tf32(1.0f + 0x1p-11f), 1.0f + 0x1p-10f);  // a tie: away from zero
  EXPECT_EQ(tf32(-1.0f - 0x1p-11f), -1.0f - 0x1p-10f);
  EXPECT_EQ(tf32(1.0f + 0x1p-11f - 0x1p-23f), 1.0f);  // below half: down
  EXPECT_EQ(tf32(1.0f + 0x1p-11f + 0x1p-23f), 1.0f + 0x1p-10f);
  EXPECT_EQ(tf32(1.0f + 0x1p-10f), 1.0f + 0x1p-10f);  // already tf32
  EXPECT_EQ(tf32(2.0f - 0x1p-23f), 2.0f);             // carries into the exponent
  EXPECT_EQ(tf32(INFINITY), INFINITY);
  EXPECT_TRUE(std::isnan(tf32(NAN)));
  EXPECT_EQ(tf32(FLT_MAX), INFINITY);  // over the largest tf32 by more than half

  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  for (int i = 0; i < 10000; ++i) {
    const float x = dist(rng);
    const float big = tf32(x), small = tf32(x - big);
    const double x_d = x;
    EXPECT_LE(std::fabs(x_d - big), 0x1p-11 * std::fabs(x_d)) << x;
    EXPECT_LE(std::fabs(x_d - big - small), 0x1p-22 * std::fabs(x_d)) << x;
  }
}

// One warp's m16n8k8 tf32 product: each lane puts the elements PTX's
// "Matrix Fragments for mma.m16n8k8" (.tf32) gives it into its registers
// (written out here independently of emulation/mma_sync.h) and reads its
// elements of D back from where that section puts them.
__global__ void MmaFromFragments(float* d, const float* a, const float* b, const float* c) {
  const int lane = static_cast<int>(threadIdx.x), g = lane / 4, t = lane % 4;
  // a: 16 x 8 at a[8 row + k]; b: 8 x 8 at b[8 k + n]; c, d: 16 x 8 at [8 row + n].
  const float fa[4] = {a[8 * g + t], a[8 * (g + 8) + t], a[8 * g + t + 4], a[8 * (g + 8) + t + 4]};
  const float fb[2] = {b[8 * t + g], b[8 * (t + 4) + g]};
  float fd[4] = {c[8 * g + 2 * t], c[8 * g + 2 * t + 1], c[8 * (g + 8) + 2 * t],
                 c[8 * (g + 8) + 2 * t + 1]};
  cuda_emulation::MmaM16N8K8Tf32Chain(fd, {fa}, {fb});
  d[8 * g + 2 * t] = fd[0];
  d[8 * g + 2 * t + 1] = fd[1];
  d[8 * (g + 8) + 2 * t] = fd[2];
  d[8 * (g + 8) + 2 * t + 1] = fd[3];
}

TEST(CudaEmulationTest, MmaSyncTf32FollowsPtxFragmentLayout) {
  std::vector<float> a(16 * 8), b(8 * 8), c(16 * 8), d(16 * 8, NAN);
  // Distinct small multiples of 2^-3 (tf32, every sum exact): a misplaced
  // element changes the result.
  for (int i = 0; i < 16 * 8; ++i) {
    a[i] = 0.125f * static_cast<float>(i % 29) - 1.5f;
    c[i] = static_cast<float>(i);
  }
  for (int i = 0; i < 8 * 8; ++i) b[i] = 0.25f * static_cast<float>(i % 11) - 1.0f;
  cuda_emulation::Launcher(dim3(1), dim3(32))
      .Run([](auto... x) { MmaFromFragments(x...); }, d.data(), static_cast<const float*>(a.data()),
           static_cast<const float*>(b.data()), static_cast<const float*>(c.data()));
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int row = 0; row < 16; ++row) {
    for (int n = 0; n < 8; ++n) {
      double want = c[8 * row + n];
      for (int k = 0; k < 8; ++k) want += static_cast<double>(a[8 * row + k]) * b[8 * k + n];
      EXPECT_EQ(d[8 * row + n], want) << row << " " << n;
    }
  }
}

// An operand with bits below tf32's ten (not rounded) aborts, as a kernel
// that forgot cvt.rna would compute on truncated values on the GPU.
TEST(CudaEmulationTest, MmaSyncTf32RefusesUnroundedOperands) {
  std::vector<float> a(16 * 8, 1.0f), b(8 * 8, 1.0f), c(16 * 8, 0.0f), d(16 * 8);
  a[5] = 1.0f + 0x1p-20f;
  EXPECT_DEATH(cuda_emulation::Launcher(dim3(1), dim3(32))
                   .Run([](auto... x) { MmaFromFragments(x...); }, d.data(),
                        static_cast<const float*>(a.data()), static_cast<const float*>(b.data()),
                        static_cast<const float*>(c.data())),
               "bits below tf32");
}

}  // namespace
