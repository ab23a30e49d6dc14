// A CPU emulation of the little of CUDA that the flash attention kernels use
// (worker/cuda/flash_attention*.cu), so that their device code runs, thread
// by thread, on a machine without a GPU: every CUDA thread of a block is a
// std::thread; __syncthreads, __syncwarp and __shfl_xor_sync are barriers;
// shared memory is ordinary memory (blocks run one at a time); wmma fragments
// hold the whole 16 x 16 tile in every lane (see mma.h here). It checks the
// kernels' indexing, masking, tiling and synchronisation logic, not their
// speed or the hardware's rounding. Test-only; never on a product path.
#ifndef ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_EMULATION_H_
#define ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_EMULATION_H_

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return uint4{x, y, z, w};
}
using cudaStream_t = void*;

namespace cuda_emulation {

// A reusable barrier for n threads.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = generation_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, waiting_ = 0;
  uint64_t generation_ = 0;
};

// The block being run: its barriers and each warp's exchange slots.
struct Block {
  explicit Block(int threads) : block(threads) {
    for (int w = 0; w < (threads + 31) / 32; ++w) warps.push_back(std::make_unique<Barrier>(32));
    slots.resize(static_cast<size_t>(threads));
  }
  Barrier block;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<float> slots;
};

inline thread_local dim3 tl_thread_idx, tl_block_idx;
inline dim3 g_grid_dim, g_block_dim;
inline Block* g_block = nullptr;

// Called before and after each block (the test poisons and checks shared
// memory there); empty by default.
inline std::function<void()> g_before_block, g_after_block;

// Runs kernel(args...) over `grid` blocks of `threads` threads, one block at
// a time (blockDim.x only: the kernels use one-dimensional blocks).
template <typename Kernel, typename... Args>
void Launch(dim3 grid, int threads, Kernel kernel, Args... args) {
  g_grid_dim = grid;
  g_block_dim = dim3(static_cast<unsigned int>(threads));
  for (unsigned int z = 0; z < grid.z; ++z) {
    for (unsigned int y = 0; y < grid.y; ++y) {
      for (unsigned int x = 0; x < grid.x; ++x) {
        if (g_before_block) g_before_block();
        Block block(threads);
        g_block = &block;
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([=] {
            tl_thread_idx = dim3(static_cast<unsigned int>(t));
            tl_block_idx = dim3(x, y, z);
            kernel(args...);
          });
        }
        for (std::thread& th : pool) th.join();
        g_block = nullptr;
        if (g_after_block) g_after_block();
      }
    }
  }
}

}  // namespace cuda_emulation

#define threadIdx (cuda_emulation::tl_thread_idx)
#define blockIdx (cuda_emulation::tl_block_idx)
#define gridDim (cuda_emulation::g_grid_dim)
#define blockDim (cuda_emulation::g_block_dim)

inline void __syncthreads() { cuda_emulation::g_block->block.Wait(); }
inline void __syncwarp(unsigned int = 0xffffffffu) {
  cuda_emulation::g_block->warps[threadIdx.x / 32]->Wait();
}
// Every lane of the warp must call it (the kernels use full masks).
inline float __shfl_xor_sync(unsigned int, float v, int offset) {
  cuda_emulation::Block& b = *cuda_emulation::g_block;
  const unsigned int lane = threadIdx.x % 32, base = threadIdx.x - lane;
  b.slots[threadIdx.x] = v;
  __syncwarp();
  const float other = b.slots[base + (lane ^ static_cast<unsigned int>(offset))];
  __syncwarp();
  return other;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#endif  // ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_EMULATION_H_
