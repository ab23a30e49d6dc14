// The flash attention kernels' device code (worker/cuda/flash_attention.cu,
// CUDA cores; worker/cuda/flash_attention_wmma.cu, tensor cores, bf16;
// worker/cuda/flash_attention_mma.cu, tensor cores, f32 as 3xTF32 through
// mma.sync with the emulation's tf32 rounding and PTX's fragment layout) run
// on the CPU under a thread-per-CUDA-thread emulation
// (emulation/cuda_emulation.h), launched as their host code launches them,
// and compared with layers.h's naive attention under the error model of
// tests/testing/flash_attention_error_model.h, as
// //tests/gpu:cuda_kernels_parity_check compares the real launches on a GPU
// (the f32 tensor-core kernels also with worker/model/flash_attention_reference.h).
// This checks what can be wrong without a GPU: indexing, masks, tile
// skipping, shared-memory layout, the order of barriers (the emulated wmma
// stores write a lane's share only, so a missing __syncwarp reads stale
// data; its wmma loads and stores check wmma's alignment rules; the emulated
// mma.sync takes each element from the lane and register PTX documents, so a
// fragment in the wrong place gives a wrong product; shared memory
// is poisoned before each block and checked past each launch's budget). Not
// the hardware's rounding, speed, or register and shared-memory limits.
#define ZEROSHARD_FLASH_ATTENTION_EMULATED 1

#include <cuda_runtime.h>  // the emulation's (tests/worker/cuda/emulation)

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/testing/flash_attention_error_model.h"
#include "worker/model/flash_attention_reference.h"
#include "worker/model/layers.h"

// The kernels' dynamic shared memory (`extern __shared__` in each kernel
// refers to these: blocks run one at a time).
namespace zeroshard::gpu {
namespace {
alignas(128) float4 shared4[(96 * 1024) / sizeof(float4)];
}  // namespace
namespace flash_internal {
namespace {
alignas(128) unsigned char smem[128 * 1024];
}  // namespace
}  // namespace flash_internal
namespace flash_mma {
namespace {
alignas(128) float smem[(112 * 1024) / sizeof(float)];
}  // namespace
}  // namespace flash_mma
}  // namespace zeroshard::gpu

#include "tests/worker/cuda/flash_attention.cu.inc"
#include "tests/worker/cuda/flash_attention_mma.cu.inc"
#include "tests/worker/cuda/flash_attention_wmma.cu.inc"

namespace zeroshard {
namespace gpu {
namespace {

// Launches like cuda_emulation::Launch with `bytes` of dynamic shared memory
// in `shared` (sizeof_shared in all): before each block all of it is set to
// 0xff bytes (NaN as f32 and as bf16), so a read of shared memory the block
// has not written shows in the results, and after it the bytes past `bytes`
// must still be 0xff (a write past the budget the launch asks for fails).
template <typename Kernel, typename... Args>
void Launch(void* shared, size_t sizeof_shared, size_t bytes, dim3 grid, int threads, Kernel kernel,
            Args... args) {
  ASSERT_LE(bytes, sizeof_shared);
  unsigned char* base = static_cast<unsigned char*>(shared);
  cuda_emulation::g_before_block = [=] { std::memset(base, 0xff, sizeof_shared); };
  cuda_emulation::g_after_block = [=] {
    for (size_t i = bytes; i < sizeof_shared; ++i) {
      if (base[i] != 0xff) {
        ADD_FAILURE() << "shared memory written at byte " << i << ", past the " << bytes
                      << " bytes the launch asks for";
        return;
      }
    }
  };
  cuda_emulation::Launch(grid, threads, kernel, args...);
  cuda_emulation::g_before_block = nullptr;
  cuda_emulation::g_after_block = nullptr;
}

// The two kernel families' shared memory.
#define SIMT_SHARED shared4, sizeof(shared4)
#define WMMA_SHARED flash_internal::smem, sizeof(flash_internal::smem)
#define MMA_SHARED flash_mma::smem, sizeof(flash_mma::smem)

enum class Path { kCudaCores, kTensorCores };

struct Shape {
  int64_t b, t, c, nh;
};

dim3 Tiles(const Shape& s) {
  return dim3(static_cast<unsigned int>((s.t + kTile - 1) / kTile), static_cast<unsigned int>(s.nh),
              static_cast<unsigned int>(s.b));
}

// As flash_attention.cu's Forward / Backward launch the CUDA-core kernels.
template <typename S, int kTpr>
void CudaCores(S* out, float* lse, S* dqkv, const S* qkv, const S* dout, float* dvec,
               const Shape& s, const Dims& d) {
  constexpr int kThreads = Place<kTpr>::kThreads;
  Launch(SIMT_SHARED, TileBytes<kTpr>(), Tiles(s), kThreads, FlashForwardKernel<S, kTpr>, out, lse,
         qkv, d);
  Launch(SIMT_SHARED, 0, dim3(3), 64, FlashRowDotKernel<S>, dvec, static_cast<const S*>(dout),
         static_cast<const S*>(out), d, s.b * s.nh * s.t);
  Launch(SIMT_SHARED, KeyBytes<kTpr>(), Tiles(s), kThreads, FlashBackwardKeyKernel<S, kTpr>, dqkv,
         dout, qkv, static_cast<const float*>(lse), static_cast<const float*>(dvec), d);
  Launch(SIMT_SHARED, TileBytes<kTpr>(), Tiles(s), kThreads, FlashBackwardQueryKernel<S, kTpr>,
         dqkv, dout, qkv, static_cast<const float*>(lse), static_cast<const float*>(dvec), d);
}

// As flash_attention_wmma.cu's Forward / Backward launch the bf16 tensor-core
// kernels.
template <int kHs>
void TensorCores(uint16_t* out, float* lse, uint16_t* dqkv, const uint16_t* qkv,
                 const uint16_t* dout, float* dvec, const Shape& s, const Dims& d) {
  using flash_internal::kThreads;
  using S = uint16_t;
  using L = flash_internal::Layout<S, kHs>;
  Launch(WMMA_SHARED, L::kForwardBytes, Tiles(s), kThreads,
         flash_internal::WmmaForwardKernel<S, kHs>, out, lse, qkv, d);
  Launch(WMMA_SHARED, 0, dim3(3), 64, FlashRowDotKernel<S>, dvec, dout, static_cast<const S*>(out),
         d, s.b * s.nh * s.t);
  Launch(WMMA_SHARED, L::kKeyBytes, Tiles(s), kThreads,
         flash_internal::WmmaBackwardKeyKernel<S, kHs>, dqkv, dout, qkv,
         static_cast<const float*>(lse), static_cast<const float*>(dvec), d);
  Launch(WMMA_SHARED, L::kQueryBytes, Tiles(s), kThreads,
         flash_internal::WmmaBackwardQueryKernel<S, kHs>, dqkv, dout, qkv,
         static_cast<const float*>(lse), static_cast<const float*>(dvec), d);
}

// As flash_attention_mma.cu's Forward / Backward launch the f32 ones.
void TensorCores(float* out, float* lse, float* dqkv, const float* qkv, const float* dout,
                 float* dvec, const Shape& s, const Dims& d) {
  using flash_mma::kThreads;
  Launch(MMA_SHARED, flash_mma::kForwardBytes, Tiles(s), kThreads, flash_mma::MmaForwardKernel, out,
         lse, qkv, d);
  Launch(MMA_SHARED, 0, dim3(3), 64, FlashRowDotKernel<float>, dvec, dout,
         static_cast<const float*>(out), d, s.b * s.nh * s.t);
  Launch(MMA_SHARED, flash_mma::kKeyBytes, Tiles(s), kThreads, flash_mma::MmaBackwardKeyKernel,
         dqkv, dout, qkv, static_cast<const float*>(lse), static_cast<const float*>(dvec), d);
  Launch(MMA_SHARED, flash_mma::kQueryBytes, Tiles(s), kThreads, flash_mma::MmaBackwardQueryKernel,
         dqkv, dout, qkv, static_cast<const float*>(lse), static_cast<const float*>(dvec), d);
}

std::vector<uint16_t> ToBF16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBF16(v[i]);
  return out;
}
std::vector<float> FromBF16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = BF16ToFloat(v[i]);
  return out;
}

struct Run {
  std::vector<float> out, lse, dqkv;
};

// The kernels on the storage type S; sentinels (NaN) where nothing is written.
template <typename S>
Run RunKernels(Path path, const std::vector<float>& qkv_f, const std::vector<float>& dout_f,
               const Shape& s) {
  const Dims d{s.t, s.c, s.nh, s.c / s.nh, 1.0f / std::sqrt(static_cast<float>(s.c / s.nh))};
  std::vector<S> qkv, dout, out, dqkv;
  if constexpr (std::is_same_v<S, float>) {
    qkv = qkv_f;
    dout = dout_f;
    out.assign(s.b * s.t * s.c, NAN);
    dqkv.assign(qkv.size(), NAN);
  } else {
    qkv = ToBF16(qkv_f);
    dout = ToBF16(dout_f);
    out.assign(s.b * s.t * s.c, 0x7fc0);  // bf16 NaN
    dqkv.assign(qkv.size(), 0x7fc0);
  }
  std::vector<float> lse(s.b * s.nh * s.t, NAN), dvec(lse.size(), NAN);
  if (path == Path::kTensorCores) {
    if constexpr (std::is_same_v<S, uint16_t>) {
      (d.hs <= 64 ? TensorCores<64> : TensorCores<128>)(out.data(), lse.data(), dqkv.data(),
                                                        qkv.data(), dout.data(), dvec.data(), s, d);
    } else {  // f32: head sizes up to 64
      EXPECT_LE(d.hs, kFlashTensorCoresF32MaxHeadSize);
      TensorCores(out.data(), lse.data(), dqkv.data(), qkv.data(), dout.data(), dvec.data(), s, d);
    }
  } else if (d.hs <= 32) {
    CudaCores<S, 1>(out.data(), lse.data(), dqkv.data(), qkv.data(), dout.data(), dvec.data(), s,
                    d);
  } else if (d.hs <= 64) {
    CudaCores<S, 2>(out.data(), lse.data(), dqkv.data(), qkv.data(), dout.data(), dvec.data(), s,
                    d);
  } else {
    CudaCores<S, 4>(out.data(), lse.data(), dqkv.data(), qkv.data(), dout.data(), dvec.data(), s,
                    d);
  }
  if constexpr (std::is_same_v<S, float>) {
    return Run{out, lse, dqkv};
  } else {
    return Run{FromBF16(out), lse, FromBF16(dqkv)};
  }
}

std::vector<float> Random(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

template <typename S>
void ExpectMatchesNaive(Path path, const Shape& s, uint32_t seed) {
  const bool bf16 = std::is_same_v<S, uint16_t>;
  const bool tc = path == Path::kTensorCores;
  SCOPED_TRACE(::testing::Message()
               << (bf16 ? "bf16" : "f32") << (tc ? " tensor cores" : " CUDA cores") << " b " << s.b
               << " t " << s.t << " c " << s.c << " nh " << s.nh);
  std::vector<float> qkv = Random(s.b * s.t * 3 * s.c, seed, -2.0f, 2.0f);
  std::vector<float> dout = Random(s.b * s.t * s.c, seed + 1, -1.0f, 1.0f);
  if (bf16) {  // what the kernels read is what the CPU computes on
    qkv = FromBF16(ToBF16(qkv));
    dout = FromBF16(ToBF16(dout));
  }
  std::vector<float> out(s.b * s.t * s.c), att(s.b * s.nh * s.t * s.t), dqkv(qkv.size());
  AttentionForward(out.data(), att.data(), qkv.data(), s.b, s.t, s.c, s.nh);
  AttentionBackward(dqkv.data(), dout.data(), qkv.data(), att.data(), s.b, s.t, s.c, s.nh);

  const Run run = RunKernels<S>(path, qkv, dout, s);
  testing::AttentionErrorModel model;  // host expf is within 1 ulp: inside the model's 2
  model.softmax_step = tc ? 64 : 16;
  model.storage_unit = bf16 ? 0x1p-8 : 0.0;
  // bf16 tensor cores round the weights and ds to bf16; f32 ones keep them
  // f32 and take every product as 3xTF32.
  model.operand_unit = tc && bf16 ? 0x1p-8 : 0.0;
  if (tc && !bf16) model = testing::WithThreeTf32Products(model);
  const testing::AttentionTolerances tol =
      testing::CausalAttentionTolerances(qkv, dout, s.b, s.t, s.c, s.nh, model);
  std::string worst;
  EXPECT_EQ(testing::CountOutside(run.out, out, tol.out, &worst), 0) << "out, worst " << worst;
  EXPECT_EQ(testing::CountOutside(run.lse, tol.lse_exact, tol.lse, &worst), 0)
      << "lse, worst " << worst;
  EXPECT_EQ(testing::CountOutside(run.dqkv, dqkv, tol.dqkv, &worst), 0) << "dqkv, worst " << worst;

  // f32 tensor cores against the host reference of their own algorithm
  // (64-key softmax steps, f32 weights): the reference is a float32
  // computation within the same bounds (its sums' gamma_n is within the
  // 3xTF32 sums' bound), so the same tolerances hold.
  if (tc && !bf16) {
    const FlashTiles tiles{64, 64, 64, false};
    std::vector<float> ref_out(out.size()), ref_lse(run.lse.size()), ref_dqkv(qkv.size());
    FlashAttentionForwardReference(ref_out.data(), ref_lse.data(), qkv.data(), s.b, s.t, s.c, s.nh,
                                   tiles);
    FlashAttentionBackwardReference(ref_dqkv.data(), dout.data(), qkv.data(), ref_out.data(),
                                    ref_lse.data(), s.b, s.t, s.c, s.nh, tiles);
    EXPECT_EQ(testing::CountOutside(run.out, ref_out, tol.out, &worst), 0)
        << "out against the reference, worst " << worst;
    EXPECT_EQ(testing::CountOutside(run.dqkv, ref_dqkv, tol.dqkv, &worst), 0)
        << "dqkv against the reference, worst " << worst;
  }
}

// Head sizes 16, 20, 32 (one lane per row on CUDA cores), 64 (two), 128
// (four); T below a tile, not a multiple of 64, over two tiles.
TEST(FlashAttentionEmulatedTest, CudaCoresF32) {
  ExpectMatchesNaive<float>(Path::kCudaCores, {2, 37, 48, 3}, 1);
  ExpectMatchesNaive<float>(Path::kCudaCores, {1, 70, 60, 3}, 2);
  ExpectMatchesNaive<float>(Path::kCudaCores, {1, 130, 128, 2}, 3);
  ExpectMatchesNaive<float>(Path::kCudaCores, {1, 70, 256, 2}, 4);
}

// T of 1, of exactly one tile, and one past it; batch rows and heads > 1.
TEST(FlashAttentionEmulatedTest, TileBoundaries) {
  for (const Shape& s : {Shape{2, 1, 64, 2}, Shape{1, 64, 128, 2}, Shape{2, 65, 64, 2}}) {
    ExpectMatchesNaive<float>(Path::kCudaCores, s, 11);
    ExpectMatchesNaive<uint16_t>(Path::kTensorCores, s, 12);
    ExpectMatchesNaive<float>(Path::kTensorCores, s, 17);
  }
}

TEST(FlashAttentionEmulatedTest, CudaCoresBF16) {
  ExpectMatchesNaive<uint16_t>(Path::kCudaCores, {2, 37, 48, 3}, 5);
  ExpectMatchesNaive<uint16_t>(Path::kCudaCores, {1, 130, 128, 2}, 6);
}

TEST(FlashAttentionEmulatedTest, TensorCoresBF16) {
  ExpectMatchesNaive<uint16_t>(Path::kTensorCores, {2, 37, 48, 3}, 7);    // hs 16, padded to 64
  ExpectMatchesNaive<uint16_t>(Path::kTensorCores, {1, 130, 128, 2}, 8);  // hs 64
  ExpectMatchesNaive<uint16_t>(Path::kTensorCores, {1, 70, 256, 2}, 9);   // hs 128
  ExpectMatchesNaive<uint16_t>(Path::kTensorCores, {1, 64, 80, 2}, 10);   // hs 40, T one tile
}

// f32 as 3xTF32: head sizes 64 and smaller ones padded to 64 (multiples of
// 4), T not a multiple of 64 and over two tiles, several heads and rows.
TEST(FlashAttentionEmulatedTest, TensorCoresF32) {
  ExpectMatchesNaive<float>(Path::kTensorCores, {1, 130, 128, 2}, 13);  // hs 64
  ExpectMatchesNaive<float>(Path::kTensorCores, {2, 37, 48, 3}, 14);    // hs 16
  ExpectMatchesNaive<float>(Path::kTensorCores, {1, 70, 60, 3}, 15);    // hs 20
  ExpectMatchesNaive<float>(Path::kTensorCores, {1, 200, 256, 4}, 16);  // hs 64, four heads
  // The branch-free tiles (heads of 57..64): hs 60 (padded components
  // 60..63 in every depth step), and hs 64 with T under one tile (the
  // diagonal tile alone, masked, with keys and rows past T).
  ExpectMatchesNaive<float>(Path::kTensorCores, {1, 100, 120, 2}, 18);  // hs 60
  ExpectMatchesNaive<float>(Path::kTensorCores, {2, 37, 128, 2}, 19);   // hs 64, T 37
}

}  // namespace
}  // namespace gpu
}  // namespace zeroshard
