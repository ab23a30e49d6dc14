// Causal attention on one GPU: the naive kernels (worker/cuda/attention.cu,
// f32 only, T x T weights in global memory) against the fused ones
// (worker/cuda/flash_attention_variants.h: CUDA cores in f32 and bf16,
// tensor cores in bf16 and in f32 as 3xTF32), forward and backward,
// timed with CUDA events at GPT-2 124M's shape by default (batch 8, T 1024,
// 12 heads of 64). Prints the GPU's name and a table, and writes JSON with
// --json_out. Needs a GPU (tests/gpu/run.sh runs it); exits 1 with the
// no-device message otherwise, 2 on a bad flag.
//
// TFLOP/s counts the causal half of the products: forward 4 B NH T(T+1)/2 HS
// (q k^T and weights x v), backward 2.5 times that (five products, the
// FlashAttention-2 paper's convention), whatever each kernel recomputes.
//
//   cuda_attention_bench [--batch=8] [--seq=1024] [--heads=12] [--head_size=64]
//                        [--iters=20] [--warmup=3] [--json_out=FILE]
#include <cuda_runtime_api.h>

#include <cstdio>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/flash_attention_variants.h"
#include "worker/cuda/kernels.h"

ABSL_FLAG(int64_t, batch, 8, "Batch rows");
ABSL_FLAG(int64_t, seq, 1024, "Sequence length T");
ABSL_FLAG(int64_t, heads, 12, "Heads");
ABSL_FLAG(int64_t, head_size, 64, "Head size (at most 128 for the fused kernels)");
ABSL_FLAG(int, iters, 20, "Timed calls of each pass");
ABSL_FLAG(int, warmup, 3, "Untimed calls of each pass first");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");

namespace zeroshard {
namespace {

struct Shape {
  int64_t b, t, nh, hs;
  int64_t c() const { return nh * hs; }
};

// Device memory for one configuration, freed at scope end.
class Buffer {
 public:
  explicit Buffer(size_t bytes) {
    status_ = CudaErrorToStatus(cudaMalloc(&p_, bytes), "cudaMalloc");
  }
  ~Buffer() { cudaFree(p_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* get() const { return p_; }
  const absl::Status& status() const { return status_; }

 private:
  void* p_ = nullptr;
  absl::Status status_;
};

// Random values in [-1, 1) in the storage type (f32 or bf16 bits).
absl::Status Fill(const Buffer& buffer, size_t n, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> f(n);
  for (float& x : f) x = dist(rng);
  if (dtype == DType::kF32) {
    return CudaErrorToStatus(
        cudaMemcpy(buffer.get(), f.data(), n * sizeof(float), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = FloatToBF16(f[i]);
  return CudaErrorToStatus(
      cudaMemcpy(buffer.get(), h.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice), "upload");
}

// Mean milliseconds of `call` over --iters calls after --warmup, by events.
absl::StatusOr<double> TimeMs(const std::function<absl::Status()>& call) {
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
    if (absl::Status s = call(); !s.ok()) return s;
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start);
  const int iters = absl::GetFlag(FLAGS_iters);
  absl::Status status;
  for (int i = 0; i < iters && status.ok(); ++i) status = call();
  cudaEventRecord(stop);
  status.Update(CudaErrorToStatus(cudaEventSynchronize(stop), "running the kernels"));
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!status.ok()) return status;
  return static_cast<double>(ms) / iters;
}

struct Timing {
  double forward_ms = 0, backward_ms = 0;
};

absl::StatusOr<Timing> TimeNaive(const Shape& s) {
  const size_t qkv = s.b * s.t * 3 * s.c(), out = s.b * s.t * s.c();
  Buffer d_qkv(qkv * 4), d_out(out * 4), d_dout(out * 4), d_dqkv(qkv * 4),
      d_att(static_cast<size_t>(s.b * s.nh * s.t * s.t) * 4);
  for (const Buffer* b : {&d_qkv, &d_out, &d_dout, &d_dqkv, &d_att}) {
    if (!b->status().ok()) return b->status();
  }
  if (absl::Status st = Fill(d_qkv, qkv, DType::kF32, 1); !st.ok()) return st;
  if (absl::Status st = Fill(d_dout, out, DType::kF32, 2); !st.ok()) return st;
  auto* q = static_cast<float*>(d_qkv.get());
  auto* o = static_cast<float*>(d_out.get());
  auto* att = static_cast<float*>(d_att.get());
  Timing t;
  absl::StatusOr<double> fwd =
      TimeMs([&] { return gpu::AttentionForward(o, att, q, s.b, s.t, s.c(), s.nh, nullptr); });
  if (!fwd.ok()) return fwd.status();
  absl::StatusOr<double> bwd = TimeMs([&] {
    return gpu::AttentionBackward(static_cast<float*>(d_dqkv.get()),
                                  static_cast<float*>(d_dout.get()), q, att, s.b, s.t, s.c(), s.nh,
                                  nullptr);
  });
  if (!bwd.ok()) return bwd.status();
  return Timing{*fwd, *bwd};
}

absl::StatusOr<Timing> TimeFlash(const Shape& s, gpu::FlashKernels kernels, DType dtype) {
  const size_t qkv = s.b * s.t * 3 * s.c(), out = s.b * s.t * s.c();
  const size_t e = DTypeSize(dtype);
  Buffer d_qkv(qkv * e), d_out(out * e), d_dout(out * e), d_dqkv(qkv * e),
      d_lse(static_cast<size_t>(s.b * s.nh * s.t) * 4);
  for (const Buffer* b : {&d_qkv, &d_out, &d_dout, &d_dqkv, &d_lse}) {
    if (!b->status().ok()) return b->status();
  }
  if (absl::Status st = Fill(d_qkv, qkv, dtype, 1); !st.ok()) return st;
  if (absl::Status st = Fill(d_dout, out, dtype, 2); !st.ok()) return st;
  auto* lse = static_cast<float*>(d_lse.get());
  absl::StatusOr<double> fwd = TimeMs([&] {
    return gpu::FlashAttentionForwardWith(kernels, d_out.get(), lse, d_qkv.get(), s.b, s.t, s.c(),
                                          s.nh, dtype, nullptr);
  });
  if (!fwd.ok()) return fwd.status();
  absl::StatusOr<double> bwd = TimeMs([&] {
    return gpu::FlashAttentionBackwardWith(kernels, d_dqkv.get(), d_dout.get(), d_qkv.get(),
                                           d_out.get(), lse, s.b, s.t, s.c(), s.nh, dtype, nullptr);
  });
  if (!bwd.ok()) return bwd.status();
  return Timing{*fwd, *bwd};
}

int Main() {
  if (absl::Status s = CheckCudaDevice(0); !s.ok()) {
    std::fprintf(stderr, "cuda_attention_bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  const Shape s{absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_seq), absl::GetFlag(FLAGS_heads),
                absl::GetFlag(FLAGS_head_size)};
  if (s.b <= 0 || s.t <= 0 || s.nh <= 0 || s.hs <= 0 || absl::GetFlag(FLAGS_iters) <= 0 ||
      absl::GetFlag(FLAGS_warmup) < 0) {
    std::fprintf(stderr,
                 "cuda_attention_bench: --batch, --seq, --heads, --head_size and --iters must be "
                 "positive, --warmup not negative\n");
    return 2;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("GPU: %s; batch %ld, T %ld, %ld heads of %ld\n", prop.name, static_cast<long>(s.b),
              static_cast<long>(s.t), static_cast<long>(s.nh), static_cast<long>(s.hs));
  const double fwd_flop = 4.0 * s.b * s.nh * s.hs * (s.t * (s.t + 1) / 2.0);
  const double bwd_flop = 2.5 * fwd_flop;

  nlohmann::ordered_json json;
  json["device"] = prop.name;
  json["shape"] = {{"batch", s.b}, {"seq", s.t}, {"heads", s.nh}, {"head_size", s.hs}};
  json["results"] = nlohmann::json::array();
  Table table({"KERNEL", "DTYPE", "FWD ms", "BWD ms", "FWD+BWD ms", "FWD TFLOP/s", "BWD TFLOP/s"});
  struct Config {
    const char* kernel;
    std::optional<gpu::FlashKernels> flash;  // none: the naive kernels
    DType dtype;
  };
  // The tensor cores last, f32's 3xTF32 (not yet run on a GPU) last of all: a
  // fault there leaves the context unusable, and the other rows are reported
  // anyway.
  int rc = 0;
  for (const Config& config :
       {Config{"naive", std::nullopt, DType::kF32},
        Config{"flash cuda cores", gpu::FlashKernels::kCudaCores, DType::kF32},
        Config{"flash cuda cores", gpu::FlashKernels::kCudaCores, DType::kBF16},
        Config{"flash tensor cores", gpu::FlashKernels::kTensorCores, DType::kBF16},
        Config{"flash tensor cores f32 (3xTF32)", gpu::FlashKernels::kTensorCores,
               DType::kF32}}) {
    const std::string dtype = config.dtype == DType::kF32 ? "f32" : "bf16";
    if (config.flash == gpu::FlashKernels::kTensorCores && config.dtype == DType::kF32 &&
        s.hs > gpu::kFlashTensorCoresF32MaxHeadSize) {
      std::printf("%s: skipped, head size %ld over its %ld\n", config.kernel,
                  static_cast<long>(s.hs), static_cast<long>(gpu::kFlashTensorCoresF32MaxHeadSize));
      continue;
    }
    absl::StatusOr<Timing> t =
        config.flash ? TimeFlash(s, *config.flash, config.dtype) : TimeNaive(s);
    if (!t.ok()) {
      std::fprintf(stderr, "cuda_attention_bench: %s %s: %s\n", config.kernel, dtype.c_str(),
                   t.status().ToString().c_str());
      json["results"].push_back(
          {{"kernel", config.kernel}, {"dtype", dtype}, {"error", t.status().ToString()}});
      rc = 1;
      break;
    }
    const double fwd_tflops = fwd_flop / (t->forward_ms * 1e9);
    const double bwd_tflops = bwd_flop / (t->backward_ms * 1e9);
    json["results"].push_back({{"kernel", config.kernel},
                               {"dtype", dtype},
                               {"forward_ms", t->forward_ms},
                               {"backward_ms", t->backward_ms},
                               {"forward_tflops", fwd_tflops},
                               {"backward_tflops", bwd_tflops}});
    table.AddRow({config.kernel, dtype, absl::StrFormat("%.3f", t->forward_ms),
                  absl::StrFormat("%.3f", t->backward_ms),
                  absl::StrFormat("%.3f", t->forward_ms + t->backward_ms),
                  absl::StrFormat("%.1f", fwd_tflops), absl::StrFormat("%.1f", bwd_tflops)});
  }
  std::printf("%s", table.ToString().c_str());
  const int json_rc = WriteBenchJson(json, absl::GetFlag(FLAGS_json_out));
  return rc != 0 ? rc : json_rc;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
