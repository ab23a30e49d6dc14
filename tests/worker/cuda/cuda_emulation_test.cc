// The CPU emulation of CUDA itself (emulation/cuda_emulation.h), on which the
// *_emulated_test kernel tests rest: thread and block numbering of 2-D blocks
// and grids, warps of consecutive threads, 8-byte shuffles, barriers that
// order shared memory, the launch limits, and the allocator's alignment,
// poison and count.
#include <cuda_runtime.h>  // the emulation's (tests/worker/cuda/emulation)

#include <cstdint>
#include <cstring>
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

}  // namespace
