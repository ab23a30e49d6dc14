// A CPU emulation of the little of CUDA that our kernels use (worker/cuda/
// flash_attention*.cu, classifier.cu, layernorm.cu, cublaslt_epilogue.cu), so
// that their device code runs, thread by thread, on a machine without a GPU:
// every CUDA thread of a block is a std::thread; __syncthreads, __syncwarp and
// __shfl_xor_sync are barriers; shared memory is ordinary memory (blocks run
// one at a time; the test genrule turns a kernel's static __shared__ arrays
// into function statics, one copy for all threads, NaN-filled between
// blocks); wmma fragments hold the whole 16 x 16 tile in every lane (see
// mma.h here). The genrule also turns
// `kernel<<<grid, block, bytes, stream>>>(args)` into a Launcher(...).Run
// call, which checks the launch configuration as CUDA does (an invalid one
// is cudaErrorInvalidConfiguration from cudaGetLastError) and runs the grid.
// uint4 / float4 are 16-byte aligned types as in CUDA, so a vector load from
// a misaligned address is undefined here too (the tests build with
// -fsanitize=alignment: it aborts, as the GPU faults). It checks the kernels'
// indexing, masking, tiling and synchronisation logic, not their speed or the
// hardware's rounding. Test-only; never on a product path.
#ifndef ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_EMULATION_H_
#define ZEROSHARD_TESTS_WORKER_CUDA_EMULATION_CUDA_EMULATION_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return uint4{x, y, z, w};
}
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace cuda_emulation {

// A reusable barrier for n threads.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  // The last thread to arrive runs `last` (if any) before any is released.
  void Wait(const std::function<void()>* last = nullptr) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = generation_;
    if (++waiting_ == n_) {
      if (last != nullptr && *last) (*last)();
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
    for (int w = 0; w < (threads + 31) / 32; ++w) {
      warps.push_back(std::make_unique<Barrier>(std::min(32, threads - 32 * w)));
    }
    slots.resize(static_cast<size_t>(threads));
    words.resize(static_cast<size_t>(threads) * 2 * kWords);
  }
  static constexpr int kWords = 18;
  Barrier block;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<uint64_t> slots;  // a shuffled value's bytes (at most 8)
  // A warp-wide operation's operands: two sets of kWords per thread, used
  // in turn (see mma_sync.h).
  std::vector<float> words;
};

inline thread_local dim3 tl_thread_idx, tl_block_idx;
inline thread_local unsigned int tl_linear = 0;  // the thread's index in its block
inline thread_local uint64_t tl_warp_ops = 0;    // the thread's warp-wide operations so far
inline dim3 g_grid_dim, g_block_dim;
inline Block* g_block = nullptr;

// The kernels' static __shared__ arrays (emulate_source.sh registers each
// where it is declared, the first time a thread passes it): filled with 0xff
// bytes before each block after the first (before the first, they hold
// zeros or the last launch's values).
inline std::mutex g_shared_mu;
inline std::vector<std::pair<void*, size_t>> g_shared_arrays;  // guarded by g_shared_mu

inline void SharedArray(void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_shared_mu);
  for (const auto& a : g_shared_arrays) {
    if (a.first == p) return;
  }
  g_shared_arrays.emplace_back(p, bytes);
}
inline void PoisonSharedArrays() {
  std::lock_guard<std::mutex> lock(g_shared_mu);
  for (const auto& a : g_shared_arrays) std::memset(a.first, 0xff, a.second);
}

// Called before and after each block (the test poisons and checks shared
// memory there); empty by default.
inline std::function<void()> g_before_block, g_after_block;

// Runs kernel(args...) over `grid` blocks of `block` threads, one block at a
// time (threadIdx.x fastest, then y, then z, as CUDA numbers them; warps are
// runs of 32 consecutive threads in that order).
template <typename Kernel, typename... Args>
void Launch(dim3 grid, dim3 block_dim, Kernel kernel, Args... args) {
  const int threads = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  if (blocks == 0 || threads == 0) return;
  g_grid_dim = grid;
  g_block_dim = block_dim;
  // One std::thread per CUDA thread of a block, reused for every block (the
  // grid runs one block at a time): after each block all of them meet at
  // `between`, whose last arrival runs the after / before hooks.
  Block block(threads);
  g_block = &block;
  Barrier between(threads);
  const std::function<void()> hooks = [] {
    if (g_after_block) g_after_block();
    PoisonSharedArrays();
    if (g_before_block) g_before_block();
  };
  PoisonSharedArrays();
  if (g_before_block) g_before_block();
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const unsigned int u = static_cast<unsigned int>(t);
      tl_linear = u;
      tl_warp_ops = 0;
      tl_thread_idx =
          dim3(u % block_dim.x, u / block_dim.x % block_dim.y, u / (block_dim.x * block_dim.y));
      for (uint64_t k = 0; k < blocks; ++k) {
        tl_block_idx = dim3(static_cast<unsigned int>(k % grid.x),
                            static_cast<unsigned int>(k / grid.x % grid.y),
                            static_cast<unsigned int>(k / (uint64_t{grid.x} * grid.y)));
        kernel(args...);
        between.Wait(k + 1 < blocks ? &hooks : nullptr);
      }
    });
  }
  for (std::thread& th : pool) th.join();
  g_block = nullptr;
  if (g_after_block) g_after_block();
}

// The launch limits of every current GPU (compute capability 7.0 to 10.x).
inline bool ValidLaunch(dim3 grid, dim3 block, size_t shared_bytes) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  return grid.x >= 1 && grid.x <= 0x7fffffffu && grid.y >= 1 && grid.y <= 65535 && grid.z >= 1 &&
         grid.z <= 65535 && threads >= 1 && threads <= 1024 && block.x <= 1024 && block.y <= 1024 &&
         block.z <= 64 && shared_bytes <= 48 * 1024;
}

// `kernel<<<grid, block, shared_bytes, stream>>>(args...)`, rewritten by the
// test genrule as Launcher(grid, block, shared_bytes, stream).Run(call,
// args...), where call(args...) calls the kernel (so a kernel template's
// arguments are deduced as nvcc deduces them). An invalid configuration runs
// nothing and leaves cudaErrorInvalidConfiguration for cudaGetLastError, as a
// real launch does. Dynamic shared memory (extern __shared__) is the test's
// to provide: none of the kernels launched this way use it.
struct Launcher {
  Launcher(dim3 grid_, dim3 block_, size_t shared_ = 0, cudaStream_t = nullptr)
      : grid(grid_), block(block_), shared_bytes(shared_) {}
  template <typename Call, typename... Args>
  void Run(Call call, Args... args) const {
    const bool injected = g_launches_until_failure > 0 && --g_launches_until_failure == 0;
    if (injected || !ValidLaunch(grid, block, shared_bytes)) {
      g_last_error = cudaErrorInvalidConfiguration;
      return;
    }
    ++g_launches;
    Launch(grid, block, call, args...);
  }
  dim3 grid, block;
  size_t shared_bytes;
  inline static std::atomic<int64_t> g_launches{0};
};

}  // namespace cuda_emulation

#define threadIdx (cuda_emulation::tl_thread_idx)
#define blockIdx (cuda_emulation::tl_block_idx)
#define gridDim (cuda_emulation::g_grid_dim)
#define blockDim (cuda_emulation::g_block_dim)

inline void __syncthreads() { cuda_emulation::g_block->block.Wait(); }
inline void __syncwarp(unsigned int = 0xffffffffu) {
  cuda_emulation::g_block->warps[cuda_emulation::tl_linear / 32]->Wait();
}
// Every lane of the warp must call it (the kernels use full masks).
template <typename T>
T __shfl_xor_sync(unsigned int, T v, int offset) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "a shuffle moves 8 bytes");
  cuda_emulation::Block& b = *cuda_emulation::g_block;
  const unsigned int me = cuda_emulation::tl_linear, lane = me % 32, base = me - lane;
  std::memcpy(&b.slots[me], &v, sizeof(T));
  __syncwarp();
  T other;
  std::memcpy(&other, &b.slots[base + (lane ^ static_cast<unsigned int>(offset))], sizeof(T));
  __syncwarp();
  return other;
}
// CUDA's device min / max (one type: mixed arguments do not compile, where
// nvcc would pick an overload).
template <typename T>
T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
T max(T a, T b) {
  return a < b ? b : a;
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
