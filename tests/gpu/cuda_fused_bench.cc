// #46's fused kernels against the current device path at GPT-2 124M's shapes
// (T 1024, batch 8: N = 8192 positions, C = 768, V = 50257), one GPU:
//  - the fused classifier (classifier.h: online softmax, lse only, gradient
//    in place), f32 and bf16 logits (the old two-pass cross-entropy with an
//    [N,V] probabilities buffer, removed since, ran 3.6 ms forward on an
//    H200: docs/gpu.md);
//  - the MLP block (c_fc + GELU + c_proj + residual), forward and backward:
//    CublasLinear with separate bias / GELU / residual / cast kernels against
//    CublasLtLinear's epilogues, f32 and bf16 (bf16: CublasLinear's mixed
//    products, f32 activations, against bf16 activations through cuBLASLt);
//  - the tied LM head (logits = x wte^T, then dw and dx from the logits'
//    gradient) through CublasLtLinear in bf16, with packed logits rows
//    (V = 50257: rows 2-byte aligned), rows padded to 50304 (ld_y /
//    ld_dy: 128-byte aligned), and also the forward's and dx's OUT padded
//    to 50304 with zero weight rows, as the device GPT runs it (an H200 ran
//    the forward at OUT 50257 at 95 TFLOP/s: the contiguous extent odd).
// Timing only: the tensors hold 0.01 (and whatever earlier calls left), not
// meaningful values; cuda_fused_parity_check checks the numbers.
// Prints a table (milliseconds per call, effective bandwidth or TFLOP/s,
// CublasLtLinear's fused / unfused product counts) and, with --json_out,
// the same as JSON. Exits 2 without a GPU.
//
//   cuda_fused_bench [--iters=20] [--warmup=3] [--json_out=FILE]
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "worker/cuda/classifier.h"
#include "worker/cuda/cublaslt_linear.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/kernels.h"

ABSL_FLAG(int, iters, 20, "Timed calls per measurement");
ABSL_FLAG(int, warmup, 3, "Untimed calls first");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");

namespace zeroshard {
namespace {

constexpr int64_t kN = 8192, kC = 768, kV = 50257;
constexpr int64_t kPaddedV = (kV + 63) / 64 * 64;  // 50304: the device GPT's logits rows

// Device memory for the bench: filled with small values (0.01) so that no
// kernel meets a NaN or an overflow.
class Buf {
 public:
  Buf(size_t bytes, DType dtype) {
    cudaMalloc(&p_, bytes);
    const size_t n = bytes / DTypeSize(dtype);
    if (dtype == DType::kF32) {
      std::vector<float> v(n, 0.01f);
      cudaMemcpy(p_, v.data(), n * 4, cudaMemcpyHostToDevice);
    } else {
      std::vector<uint16_t> v(n, FloatToBF16(0.01f));
      cudaMemcpy(p_, v.data(), n * 2, cudaMemcpyHostToDevice);
    }
  }
  ~Buf() { cudaFree(p_); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  void* get() const { return p_; }
  float* f() const { return static_cast<float*>(p_); }
  uint16_t* h() const { return static_cast<uint16_t*>(p_); }

 private:
  void* p_ = nullptr;
};

std::unique_ptr<Buf> F32(int64_t n) { return std::make_unique<Buf>(n * 4, DType::kF32); }

// Milliseconds per call of `step` (which enqueues on the legacy stream),
// or the first error.
absl::StatusOr<double> TimeMs(const std::function<absl::Status()>& step) {
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
    if (absl::Status s = step(); !s.ok()) return s;
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const int iters = absl::GetFlag(FLAGS_iters);
  cudaEventRecord(start);
  for (int i = 0; i < iters; ++i) {
    if (absl::Status s = step(); !s.ok()) return s;
  }
  cudaEventRecord(stop);
  if (absl::Status s = CudaErrorToStatus(cudaEventSynchronize(stop), "bench"); !s.ok()) return s;
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / iters;
}

struct Row {
  std::string what, path, dtype;
  double fwd_ms = 0, bwd_ms = 0;
  std::string rate;  // GB/s or TFLOP/s, forward + backward
  std::string note;
};

#define BENCH_TRY(expr) \
  if (absl::Status _s = (expr); !_s.ok()) return _s;

absl::Status BenchClassifier(std::vector<Row>* rows) {
  const int64_t nv = kN * kV;
  auto targets = std::make_unique<Buf>(kN * 4, DType::kF32);
  {
    std::vector<int32_t> t(kN);
    for (int64_t i = 0; i < kN; ++i) t[i] = static_cast<int32_t>((i * 7919) % kV);
    cudaMemcpy(targets->get(), t.data(), kN * 4, cudaMemcpyHostToDevice);
  }
  const int32_t* tg = static_cast<const int32_t*>(targets->get());
  auto loss = std::make_unique<Buf>(8, DType::kF32);
  double* l = static_cast<double*>(loss->get());
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    auto logits = std::make_unique<Buf>(nv * DTypeSize(dtype), dtype);
    auto lse = F32(kN);
    absl::StatusOr<double> f = TimeMs([&] {
      return gpu::ClassifierForward(l, lse->f(), logits->get(), tg, kN, kV, dtype, nullptr);
    });
    if (!f.ok()) return f.status();
    // In place, as the model runs it. The gradient of 0.01-logits is small
    // and finite, so repeated calls stay finite.
    absl::StatusOr<double> b = TimeMs([&] {
      return gpu::ClassifierBackward(logits->get(), logits->get(), lse->f(), tg, kN, kV, dtype,
                                     nullptr);
    });
    if (!b.ok()) return b.status();
    const double gb = (3.0 * nv * DTypeSize(dtype)) / 1e9;  // read; read + write
    rows->push_back({"classifier", "classifier.h (fused)", DTypeName(dtype), *f, *b,
                     absl::StrFormat("%.0f GB/s", gb / ((*f + *b) / 1e3)), "lse [N] only"});
  }
  return absl::OkStatus();
}

// The MLP block's tensors: x [N,C] (the ln_2 output), fc w [C,4C] b [4C],
// pre/h [N,4C], proj w [4C,C] b [C], residual stream y [N,C]; gradients alike.
struct Mlp {
  explicit Mlp(DType act) {
    x = std::make_unique<Buf>(kN * kC * DTypeSize(act), act);
    wfc = std::make_unique<Buf>(kC * 4 * kC * DTypeSize(act), act);
    wproj = std::make_unique<Buf>(kC * 4 * kC * DTypeSize(act), act);
    pre = std::make_unique<Buf>(kN * 4 * kC * DTypeSize(act), act);
    h = std::make_unique<Buf>(kN * 4 * kC * DTypeSize(act), act);
    dh = std::make_unique<Buf>(kN * 4 * kC * DTypeSize(act), act);
    dy = std::make_unique<Buf>(kN * kC * DTypeSize(act), act);
    dx = std::make_unique<Buf>(kN * kC * DTypeSize(act), act);
    bfc = F32(4 * kC);
    bproj = F32(kC);
    dbfc = F32(4 * kC);
    dbproj = F32(kC);
    dwfc = F32(kC * 4 * kC);
    dwproj = F32(kC * 4 * kC);
    y = F32(kN * kC);
    tmp = F32(kN * 4 * kC);  // f32 scratch of the current path
    tmp2 = F32(kN * 4 * kC);
    dy_f32 = F32(kN * kC);
  }
  std::unique_ptr<Buf> x, wfc, wproj, pre, h, dh, dy, dx, bfc, bproj, dbfc, dbproj, dwfc, dwproj, y,
      tmp, tmp2, dy_f32;
};

constexpr auto kConv = gpu::CublasLinear::Layout::kInOut;

absl::Status BenchMlpCurrent(DType dtype, std::vector<Row>* rows) {
  auto linear = gpu::CublasLinear::Create(nullptr);
  if (!linear.ok()) return linear.status();
  gpu::CublasLinear& L = **linear;
  Mlp m(dtype);
  const int64_t c4 = 4 * kC;
  std::function<absl::Status()> fwd, bwd;
  if (dtype == DType::kF32) {
    fwd = [&]() -> absl::Status {
      BENCH_TRY(L.Forward(m.pre->get(), m.x->get(), m.wfc->get(), m.bfc->get(), kN, kC, c4,
                          DType::kF32, kConv));
      BENCH_TRY(gpu::GeluTanhForward(m.h->f(), m.pre->f(), kN * c4, nullptr));
      BENCH_TRY(L.Forward(m.tmp->get(), m.h->get(), m.wproj->get(), m.bproj->get(), kN, c4, kC,
                          DType::kF32, kConv));
      return gpu::AddInto(m.y->f(), m.tmp->get(), DType::kF32, kN * kC, nullptr);
    };
    bwd = [&]() -> absl::Status {
      BENCH_TRY(L.Backward(m.dh->get(), m.dwproj->get(), m.dbproj->get(), m.dy->get(), m.h->get(),
                           m.wproj->get(), kN, c4, kC, DType::kF32, kConv));
      BENCH_TRY(gpu::GeluTanhBackward(m.tmp->f(), m.dh->f(), m.pre->f(), kN * c4, nullptr));
      return L.Backward(m.dx->get(), m.dwfc->get(), m.dbfc->get(), m.tmp->get(), m.x->get(),
                        m.wfc->get(), kN, kC, c4, DType::kF32, kConv);
    };
  } else {
    fwd = [&]() -> absl::Status {
      BENCH_TRY(L.ForwardMixed(m.tmp->f(), m.x->h(), m.wfc->h(), m.bfc->f(), kN, kC, c4, kConv));
      BENCH_TRY(gpu::GeluTanhForward(m.tmp2->f(), m.tmp->f(), kN * c4, nullptr));
      BENCH_TRY(gpu::CastF32ToBF16(m.h->h(), m.tmp2->f(), kN * c4, nullptr));
      BENCH_TRY(
          L.ForwardMixed(m.tmp2->f(), m.h->h(), m.wproj->h(), m.bproj->f(), kN, c4, kC, kConv));
      return gpu::AddInto(m.y->f(), m.tmp2->get(), DType::kF32, kN * kC, nullptr);
    };
    bwd = [&]() -> absl::Status {
      BENCH_TRY(L.BackwardMixed(m.tmp->f(), m.dwproj->f(), m.dbproj->f(), m.dy->h(), m.dy_f32->f(),
                                m.h->h(), m.wproj->h(), kN, c4, kC, kConv));
      BENCH_TRY(gpu::GeluTanhBackward(m.tmp->f(), m.tmp->f(), m.tmp2->f(), kN * c4, nullptr));
      BENCH_TRY(gpu::CastF32ToBF16(m.dh->h(), m.tmp->f(), kN * c4, nullptr));
      return L.BackwardMixed(m.tmp2->f(), m.dwfc->f(), m.dbfc->f(), m.dh->h(), m.tmp->f(), m.x->h(),
                             m.wfc->h(), kN, kC, c4, kConv);
    };
  }
  absl::StatusOr<double> f = TimeMs(fwd);
  if (!f.ok()) return f.status();
  absl::StatusOr<double> b = TimeMs(bwd);
  if (!b.ok()) return b.status();
  const double tflop = 6.0 * 2 * kN * kC * c4 / 1e12;
  rows->push_back({"mlp block", "CublasLinear + kernels", DTypeName(dtype), *f, *b,
                   absl::StrFormat("%.0f TFLOP/s", tflop / ((*f + *b) / 1e3)),
                   dtype == DType::kBF16 ? "f32 activations" : ""});
  return absl::OkStatus();
}

absl::Status BenchMlpLt(DType dtype, std::vector<Row>* rows) {
  auto lt_or = gpu::CublasLtLinear::Create(nullptr, /*tf32=*/false);
  if (!lt_or.ok()) return lt_or.status();
  gpu::CublasLtLinear& lt = **lt_or;
  Mlp m(dtype);
  const int64_t c4 = 4 * kC;
  using Lt = gpu::CublasLtLinear;
  Lt::ForwardArgs fc{m.h->get(), dtype,   m.x->get(),   m.wfc->get(), dtype, kConv,
                     m.bfc->f(), nullptr, m.pre->get(), kN,           kC,    c4};
  Lt::ForwardArgs proj{m.y->get(), DType::kF32, m.h->get(),   m.wproj->get(),
                       dtype,      kConv,       m.bproj->f(), m.y->f(),
                       nullptr,    kN,          c4,           kC};
  Lt::BackwardWeightArgs proj_w{
      m.dwproj->f(), m.dbproj->f(), m.dy->get(), m.h->get(), dtype, kConv, kN, c4, kC};
  Lt::BackwardInputArgs proj_x{
      m.dh->get(), dtype, m.dy->get(), m.wproj->get(), dtype, kConv, m.pre->get(), m.dbfc->f(),
      kN,          c4,    kC};
  Lt::BackwardWeightArgs fc_w{m.dwfc->f(), nullptr, m.dh->get(), m.x->get(), dtype,
                              kConv,       kN,      kC,          c4};
  Lt::BackwardInputArgs fc_x{m.dx->get(), dtype,   m.dh->get(), m.wfc->get(), dtype, kConv,
                             nullptr,     nullptr, kN,          kC,           c4};
  absl::StatusOr<double> f = TimeMs([&]() -> absl::Status {
    BENCH_TRY(lt.Forward(fc));
    return lt.Forward(proj);
  });
  if (!f.ok()) return f.status();
  absl::StatusOr<double> b = TimeMs([&]() -> absl::Status {
    BENCH_TRY(lt.BackwardWeight(proj_w));
    BENCH_TRY(lt.BackwardInput(proj_x));
    BENCH_TRY(lt.BackwardWeight(fc_w));
    return lt.BackwardInput(fc_x);
  });
  if (!b.ok()) return b.status();
  const double tflop = 6.0 * 2 * kN * kC * c4 / 1e12;
  const auto counts = lt.path_counts();
  rows->push_back({"mlp block", "CublasLtLinear (epilogues)", DTypeName(dtype), *f, *b,
                   absl::StrFormat("%.0f TFLOP/s", tflop / ((*f + *b) / 1e3)),
                   absl::StrCat(counts.fused, " fused / ", counts.unfused, " unfused products",
                                dtype == DType::kBF16 ? ", bf16 activations" : "")});
  return absl::OkStatus();
}

// The LM head at ld (kV: packed): forward y [N,V] bf16 = x [N,C] wte^T
// (wte [V,C], Linear layout), backward dw [V,C] f32 += dy^T x and dx [N,C]
// f32 = dy wte, dy [N,V] bf16 in rows ld apart. pad_out: the forward and dx
// over OUT = ld with wte's rows padded to ld (as the device GPT runs them).
absl::Status BenchLmHead(int64_t ld, bool pad_out, std::vector<Row>* rows) {
  const int64_t out = pad_out ? ld : kV;
  auto lt_or = gpu::CublasLtLinear::Create(nullptr, /*tf32=*/false);
  if (!lt_or.ok()) return lt_or.status();
  gpu::CublasLtLinear& lt = **lt_or;
  constexpr DType kBf16 = DType::kBF16;
  constexpr auto kOutIn = gpu::CublasLinear::Layout::kOutIn;
  auto x = std::make_unique<Buf>(kN * kC * 2, kBf16),
       wte = std::make_unique<Buf>(out * kC * 2, kBf16);
  auto logits = std::make_unique<Buf>(kN * ld * 2, kBf16);
  auto dw = F32(kV * kC), dx = F32(kN * kC);
  using Lt = gpu::CublasLtLinear;
  Lt::ForwardArgs f{logits->get(), kBf16, x->get(), wte->get(), kBf16, kOutIn};
  f.n = kN, f.in = kC, f.out = out, f.ld_y = ld;
  Lt::BackwardWeightArgs bw{dw->f(), nullptr, logits->get(), x->get(), kBf16, kOutIn};
  bw.n = kN, bw.in = kC, bw.out = kV, bw.ld_dy = ld;
  Lt::BackwardInputArgs bi{dx->get(), DType::kF32, logits->get(), wte->get(), kBf16, kOutIn};
  bi.n = kN, bi.in = kC, bi.out = out, bi.ld_dy = ld;
  absl::StatusOr<double> fwd = TimeMs([&] { return lt.Forward(f); });
  if (!fwd.ok()) return fwd.status();
  absl::StatusOr<double> bwd = TimeMs([&]() -> absl::Status {
    BENCH_TRY(lt.BackwardWeight(bw));
    return lt.BackwardInput(bi);
  });
  if (!bwd.ok()) return bwd.status();
  const double tflop = 3.0 * 2 * kN * kC * kV / 1e12;
  const auto counts = lt.path_counts();
  rows->push_back({"lm head",
                   absl::StrCat("CublasLtLinear, rows of ", ld, pad_out ? ", OUT padded" : ""),
                   "bf16", *fwd, *bwd,
                   absl::StrFormat("%.0f TFLOP/s", tflop / ((*fwd + *bwd) / 1e3)),
                   absl::StrCat(ld == kV ? "packed" : "padded", "; ", counts.fused, " fused / ",
                                counts.unfused, " unfused products")});
  return absl::OkStatus();
}

int Main() {
  if (absl::Status s = CheckCudaDevice(0); !s.ok()) {
    std::fprintf(stderr, "cuda_fused_bench: no GPU, nothing measured: %s\n",
                 std::string(s.message()).c_str());
    return 2;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::vector<Row> rows;
  absl::Status s = BenchClassifier(&rows);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    if (s.ok()) s = BenchMlpCurrent(dtype, &rows);
    if (s.ok()) s = BenchMlpLt(dtype, &rows);
  }
  if (s.ok()) s = BenchLmHead(kV, false, &rows);
  if (s.ok()) s = BenchLmHead(kPaddedV, false, &rows);
  if (s.ok()) s = BenchLmHead(kPaddedV, true, &rows);
  if (!s.ok()) {
    std::fprintf(stderr, "cuda_fused_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  nlohmann::ordered_json json;
  json["device"] = prop.name;
  json["n"] = kN;
  json["c"] = kC;
  json["v"] = kV;
  json["iters"] = absl::GetFlag(FLAGS_iters);
  json["results"] = nlohmann::json::array();
  Table table({"WHAT", "PATH", "DTYPE", "FWD ms", "BWD ms", "RATE", "NOTE"});
  for (const Row& r : rows) {
    table.AddRow({r.what, r.path, r.dtype, absl::StrFormat("%.3f", r.fwd_ms),
                  absl::StrFormat("%.3f", r.bwd_ms), r.rate, r.note});
    json["results"].push_back({{"what", r.what},
                               {"path", r.path},
                               {"dtype", r.dtype},
                               {"forward_ms", r.fwd_ms},
                               {"backward_ms", r.bwd_ms},
                               {"rate", r.rate},
                               {"note", r.note}});
  }
  std::printf("%s (N %lld, C %lld, V %lld)\n%s", prop.name, static_cast<long long>(kN),
              static_cast<long long>(kC), static_cast<long long>(kV), table.ToString().c_str());
  return WriteBenchJson(json, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
