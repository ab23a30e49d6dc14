// CublasLtLinear: Linear / Conv1D products through cublasLtMatmul with the
// bias, GELU, residual and gradient epilogues fused where cuBLASLt offers an
// algorithm, else a plain product plus cublaslt_epilogue.h's kernels.
//
// Row-major tensors, column-major cuBLASLt: a row-major [R,C] matrix is the
// column-major C x R matrix with leading dimension C, so each row-major
// product Y = X W is issued as Y^T = W^T X^T (the same memory); comments
// beside each mapping give the row-major formula. The epilogue's bias runs
// along D's rows, which are the row-major columns (OUT or IN): what a Linear
// layer's bias needs. cuBLASLt's rules this file follows (cublasLt.h):
//  - the GELU epilogues' aux matrix (x W + b, saved for the backward) has
//    the output's type and a leading dimension that is a multiple of 8;
//  - the bias vector has the output's type (so a BF16 y gets its f32 bias
//    rounded to bf16 in scratch first, as PyTorch's autocast does), and the
//    bias gradients of DGELU_BGRAD / BGRADA / BGRADB are written (=) in the
//    output's type: into scratch here, then added (+=) into the f32 gradient;
//  - C may be D (in place) with the same layout and type: the residual and
//    the weight-gradient accumulation (beta 1);
//  - algorithms need aligned buffers: the heuristic is told each pointer's
//    alignment, and the fused forms are asked for only with 16-byte aligned
//    bias / aux buffers.
#include "worker/cuda/cublaslt_linear.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cublas_status.h"
#include "worker/cuda/cublaslt_epilogue.h"
#include "worker/cuda/cublaslt_plan.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/kernels.h"

namespace zeroshard {
namespace gpu {
namespace {

constexpr size_t kWorkspaceBytes = 32 << 20;

absl::Status LtToStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return CublasStatusToStatus(status, absl::StrCat(what, ": ", cublasLtGetStatusName(status), ": ",
                                                   cublasLtGetStatusString(status)));
}

cudaDataType_t CudaType(DType dtype) { return dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF; }

// The largest power of two <= 256 dividing the address (256 for nullptr).
uint32_t Alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  return static_cast<uint32_t>(std::min<uintptr_t>(256, a & (~a + 1)));
}

bool Aligned16(const void* p) { return Alignment(p) >= 16; }

// One cuBLASLt product, column-major: D[m,n] = op(A)[m,k] op(B)[k,n] + beta C
// (C = D's layout; beta 1 when c is set), then the epilogue.
struct Product {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  DType ab_dtype = DType::kF32;
  const void* c = nullptr;
  void* d = nullptr;
  int64_t ldd = 0;
  DType d_dtype = DType::kF32;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // the bias, or where a bias gradient goes
  void* aux = nullptr;         // GELU's saved input
  int64_t ld_aux = 0;
};

Product FromPlan(const internal::LtPlan& plan, DType ab_dtype, DType d_dtype) {
  Product p;
  p.trans_a = plan.trans_a;
  p.trans_b = plan.trans_b;
  p.m = plan.m;
  p.n = plan.n;
  p.k = plan.k;
  p.a = plan.a;
  p.lda = plan.lda;
  p.b = plan.b;
  p.ldb = plan.ldb;
  p.d = plan.d;
  p.ldd = plan.ldd;
  p.ab_dtype = ab_dtype;
  p.d_dtype = d_dtype;
  return p;
}

using CacheKey = std::array<int64_t, 20>;

struct CacheEntry {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
  // Why none was found: the heuristic's status (NOT_SUPPORTED: no kernel;
  // INVALID_VALUE: a descriptor cuBLASLt rejects), or that of a fused run
  // cuBLASLt refused after offering the algorithm.
  cublasStatus_t why = CUBLAS_STATUS_NOT_SUPPORTED;
};

template <typename T, cublasStatus_t (*Destroy)(T)>
struct LtDeleter {
  void operator()(T p) const { Destroy(p); }
};
using DescPtr = std::unique_ptr<cublasLtMatmulDescOpaque_t,
                                LtDeleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using LayoutPtr = std::unique_ptr<cublasLtMatrixLayoutOpaque_t,
                                  LtDeleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using PrefPtr =
    std::unique_ptr<cublasLtMatmulPreferenceOpaque_t,
                    LtDeleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

template <typename V>
absl::Status SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value,
                     const char* name) {
  return LtToStatus(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)),
                    absl::StrCat("CublasLtLinear: setting ", name));
}

// The descriptors of one product.
struct Descriptors {
  DescPtr op;
  LayoutPtr a, b, d;
};

absl::Status MakeLayout(LayoutPtr* out, DType dtype, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  absl::Status s =
      LtToStatus(cublasLtMatrixLayoutCreate(&layout, CudaType(dtype), static_cast<uint64_t>(rows),
                                            static_cast<uint64_t>(cols), ld),
                 "CublasLtLinear: cublasLtMatrixLayoutCreate");
  out->reset(layout);
  return s;
}

absl::Status MakeDescriptors(const Product& p, bool tf32, Descriptors* out) {
  const cublasComputeType_t compute =
      p.ab_dtype == DType::kF32 && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  cublasLtMatmulDesc_t op = nullptr;
  absl::Status s = LtToStatus(cublasLtMatmulDescCreate(&op, compute, CUDA_R_32F),
                              "CublasLtLinear: cublasLtMatmulDescCreate");
  out->op.reset(op);
  if (!s.ok()) return s;
  const int32_t ta = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t tb = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint32_t epilogue = p.epilogue;
  s.Update(SetDesc(op, CUBLASLT_MATMUL_DESC_TRANSA, ta, "TRANSA"));
  s.Update(SetDesc(op, CUBLASLT_MATMUL_DESC_TRANSB, tb, "TRANSB"));
  s.Update(SetDesc(op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue, "EPILOGUE"));
  if (p.bias != nullptr) s.Update(SetDesc(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias, "BIAS"));
  if (p.aux != nullptr) {
    s.Update(SetDesc(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p.aux, "AUX_POINTER"));
    s.Update(SetDesc(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, p.ld_aux, "AUX_LD"));
  }
  if (!s.ok()) return s;
  s.Update(MakeLayout(&out->a, p.ab_dtype, p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k, p.lda));
  s.Update(MakeLayout(&out->b, p.ab_dtype, p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n, p.ldb));
  s.Update(MakeLayout(&out->d, p.d_dtype, p.m, p.n, p.ldd));
  return s;
}

CacheKey KeyOf(const Product& p, bool tf32) {
  return {p.trans_a,
          p.trans_b,
          p.m,
          p.n,
          p.k,
          p.lda,
          p.ldb,
          p.ldd,
          static_cast<int64_t>(p.ab_dtype),
          static_cast<int64_t>(p.d_dtype),
          static_cast<int64_t>(p.epilogue),
          p.ld_aux,
          p.c != nullptr,
          tf32,
          Alignment(p.a),
          Alignment(p.b),
          Alignment(p.c),
          Alignment(p.d),
          Alignment(p.bias),
          Alignment(p.aux)};
}

}  // namespace

struct CublasLtLinear::State {
  cublasLtHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  bool tf32 = false;
  void* workspace = nullptr;
  // Bias casts and bias gradients before they are added: grown on demand,
  // stream-ordered.
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  absl::flat_hash_map<CacheKey, CacheEntry> algos;
  PathCounts counts;

  ~State() {
    if (scratch != nullptr || workspace != nullptr) cudaStreamSynchronize(stream);
    if (scratch != nullptr) cudaFree(scratch);
    if (workspace != nullptr) cudaFree(workspace);
    if (handle != nullptr) cublasLtDestroy(handle);
  }

  absl::StatusOr<void*> Scratch(size_t bytes) {
    if (bytes <= scratch_bytes) return scratch;
    if (scratch != nullptr) {
      if (absl::Status s = CudaErrorToStatus(cudaFreeAsync(scratch, stream), "CublasLtLinear");
          !s.ok()) {
        return s;
      }
      scratch = nullptr;
      scratch_bytes = 0;
    }
    if (absl::Status s = CudaErrorToStatus(cudaMallocAsync(&scratch, bytes, stream),
                                           absl::StrCat("CublasLtLinear: ", bytes, " bytes"));
        !s.ok()) {
      return s;
    }
    scratch_bytes = bytes;
    return scratch;
  }

  // The algorithm for `p` (cached by shape, types, epilogue and alignments);
  // found false when cuBLASLt offers none.
  absl::StatusOr<CacheEntry> Algo(const Product& p, const Descriptors& desc) {
    const CacheKey key = KeyOf(p, tf32);
    if (auto it = algos.find(key); it != algos.end()) return it->second;
    cublasLtMatmulPreference_t raw = nullptr;
    absl::Status s = LtToStatus(cublasLtMatmulPreferenceCreate(&raw),
                                "CublasLtLinear: cublasLtMatmulPreferenceCreate");
    PrefPtr pref(raw);
    if (!s.ok()) return s;
    const uint64_t workspace_bytes = kWorkspaceBytes;
    s.Update(LtToStatus(
        cublasLtMatmulPreferenceSetAttribute(raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes, sizeof(workspace_bytes)),
        "CublasLtLinear: workspace preference"));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, const void*> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p.c != nullptr ? p.c : p.d},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.d}};
    for (const auto& [attr, ptr] : alignments) {
      const uint32_t bytes = Alignment(ptr);
      s.Update(LtToStatus(cublasLtMatmulPreferenceSetAttribute(raw, attr, &bytes, sizeof(bytes)),
                          "CublasLtLinear: alignment preference"));
    }
    if (!s.ok()) return s;
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    const cublasStatus_t h =
        cublasLtMatmulAlgoGetHeuristic(handle, desc.op.get(), desc.a.get(), desc.b.get(),
                                       desc.d.get(), desc.d.get(), raw, 1, &result, &returned);
    CacheEntry entry;
    if (h == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
      entry.found = true;
      entry.algo = result.algo;
    } else {
      entry.why = h != CUBLAS_STATUS_SUCCESS ? h
                  : returned > 0             ? result.state
                                             : CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (!entry.found && h != CUBLAS_STATUS_SUCCESS && h != CUBLAS_STATUS_NOT_SUPPORTED &&
        h != CUBLAS_STATUS_INVALID_VALUE) {
      return LtToStatus(h, "CublasLtLinear: cublasLtMatmulAlgoGetHeuristic");
    }
    algos.emplace(key, entry);
    return entry;
  }

  // Runs `p`. *ran false (and OK) when cuBLASLt has no algorithm for it and
  // `may_decline`; an error when it has none and the caller has no fallback.
  absl::Status Run(const Product& p, bool may_decline, bool* ran) {
    *ran = false;
    Descriptors desc;
    if (absl::Status s = MakeDescriptors(p, tf32, &desc); !s.ok()) return s;
    absl::StatusOr<CacheEntry> algo = Algo(p, desc);
    if (!algo.ok()) return algo.status();
    if (!algo->found) {
      if (may_decline) return absl::OkStatus();
      return absl::FailedPreconditionError(absl::StrCat(
          "CublasLtLinear: cuBLASLt has no algorithm for the ", p.m, " x ", p.n, " x ", p.k, " ",
          DTypeName(p.ab_dtype), " -> ", DTypeName(p.d_dtype), " product on this GPU (",
          cublasLtGetStatusName(algo->why), "; CUBLASLT_LOG_LEVEL=1 says which parameter)"));
    }
    const float alpha = 1.0f;
    const float beta = p.c != nullptr ? 1.0f : 0.0f;
    const void* c = p.c != nullptr ? p.c : p.d;
    const cublasStatus_t ran_status = cublasLtMatmul(
        handle, desc.op.get(), &alpha, p.a, desc.a.get(), p.b, desc.b.get(), &beta, c, desc.d.get(),
        p.d, desc.d.get(), &algo->algo, workspace, kWorkspaceBytes, stream);
    if (may_decline &&
        (ran_status == CUBLAS_STATUS_NOT_SUPPORTED || ran_status == CUBLAS_STATUS_INVALID_VALUE)) {
      // The heuristic offered an algorithm that cuBLASLt then refused (its
      // check "doesn't fully guarantee algo will run"): this product runs
      // unfused from now on, said once.
      std::fprintf(stderr,
                   "CublasLtLinear: cuBLASLt refused the fused %ld x %ld x %ld product (%s); "
                   "running it unfused\n",
                   static_cast<long>(p.m), static_cast<long>(p.n), static_cast<long>(p.k),
                   cublasLtGetStatusName(ran_status));
      CacheEntry refused;
      refused.why = ran_status;
      algos[KeyOf(p, tf32)] = refused;
      return absl::OkStatus();
    }
    if (absl::Status s = LtToStatus(ran_status, "CublasLtLinear: cublasLtMatmul"); !s.ok()) {
      return s;
    }
    *ran = true;
    return absl::OkStatus();
  }

  // Runs `fused` when cuBLASLt has it (counting it fused); otherwise runs
  // `plain` and `then` (the epilogue's work in kernels), counting unfused.
  template <typename Then>
  absl::Status RunFusedOr(const Product& fused, bool try_fused, Product plain, Then then) {
    if (try_fused) {
      bool ran = false;
      if (absl::Status s = Run(fused, /*may_decline=*/true, &ran); !s.ok()) return s;
      if (ran) {
        ++counts.fused;
        return absl::OkStatus();
      }
    }
    plain.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    plain.bias = nullptr;
    plain.aux = nullptr;
    plain.ld_aux = 0;
    bool ran = false;
    if (absl::Status s = Run(plain, /*may_decline=*/false, &ran); !s.ok()) return s;
    ++counts.unfused;
    return then();
  }
};

CublasLtLinear::CublasLtLinear(std::unique_ptr<State> state) : state_(std::move(state)) {}
CublasLtLinear::~CublasLtLinear() = default;

CublasLtLinear::PathCounts CublasLtLinear::path_counts() const { return state_->counts; }

absl::StatusOr<std::unique_ptr<CublasLtLinear>> CublasLtLinear::Create(void* stream, bool tf32) {
  int device = 0;
  if (absl::Status s = CudaErrorToStatus(cudaGetDevice(&device), "CublasLtLinear: cudaGetDevice");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckCudaDevice(device); !s.ok()) return s;
  auto state = std::make_unique<State>();
  state->stream = static_cast<cudaStream_t>(stream);
  state->tf32 = tf32;
  if (absl::Status s = LtToStatus(cublasLtCreate(&state->handle), "CublasLtLinear: cublasLtCreate");
      !s.ok()) {
    state->handle = nullptr;
    return s;
  }
  if (absl::Status s = CudaErrorToStatus(
          cudaMalloc(&state->workspace, kWorkspaceBytes),
          absl::StrCat("CublasLtLinear: allocating the ", kWorkspaceBytes, "-byte workspace"));
      !s.ok()) {
    state->workspace = nullptr;
    return s;
  }
  return std::unique_ptr<CublasLtLinear>(new CublasLtLinear(std::move(state)));
}

// Forward: y[N,OUT] = x W (+ b) (+ residual), or gelu(x W + b) with x W + b
// saved. Column-major D = y^T, OUT x N.
absl::Status CublasLtLinear::Forward(const ForwardArgs& a) {
  if (absl::Status s = CheckForward(a); !s.ok() || a.n == 0) return s;
  State& st = *state_;
  Product p = FromPlan(
      internal::PlanForward(a.layout == Layout::kOutIn, a.y, a.x, a.w, a.n, a.in, a.out, a.ld_y),
      a.in_dtype, a.y_dtype);
  p.c = a.residual;
  // The bias in y's type (cuBLASLt's rule): a BF16 y gets it rounded to bf16.
  const void* bias = a.bias;
  if (a.bias != nullptr && a.y_dtype == DType::kBF16) {
    absl::StatusOr<void*> scratch = st.Scratch(a.out * sizeof(uint16_t));
    if (!scratch.ok()) return scratch.status();
    if (absl::Status s = CastF32ToBF16(static_cast<uint16_t*>(*scratch), a.bias, a.out, st.stream);
        !s.ok()) {
      return s;
    }
    bias = *scratch;
  }
  const bool gelu = a.gelu_input != nullptr;
  Product fused = p;
  fused.bias = bias;
  if (gelu) {
    fused.epilogue = bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    fused.aux = a.gelu_input;
    fused.ld_aux = a.out;
  } else if (bias != nullptr) {
    fused.epilogue = CUBLASLT_EPILOGUE_BIAS;
  }
  const bool try_fused = fused.epilogue == CUBLASLT_EPILOGUE_DEFAULT ||
                         ((bias == nullptr || Aligned16(bias)) &&
                          (!gelu || (a.out % 8 == 0 && Aligned16(a.gelu_input))));
  // Unfused: the product into gelu_input (or y), then the bias, then GELU.
  // Padded y rows (CheckForward: no residual, no GELU) take the strided bias.
  Product plain = p;
  if (gelu) plain.d = a.gelu_input;
  return st.RunFusedOr(fused, try_fused, plain, [&]() -> absl::Status {
    if (bias != nullptr) {
      absl::Status s = p.ldd == a.out ? BiasAdd(plain.d, bias, a.n, a.out, a.y_dtype, st.stream)
                                      : internal::LtBiasAddRows(plain.d, bias, a.n, a.out, p.ldd,
                                                                a.y_dtype, st.stream);
      if (!s.ok()) return s;
    }
    if (!gelu) return absl::OkStatus();
    return internal::LtGeluTanhForward(a.y, a.gelu_input, a.n * a.out, a.y_dtype, st.stream);
  });
}

// dx[N,IN] = dy W^T (* gelu'(gelu_input)); column-major D = dx^T, IN x N.
absl::Status CublasLtLinear::BackwardInput(const BackwardInputArgs& a) {
  if (absl::Status s = CheckBackwardInput(a); !s.ok() || a.n == 0) return s;
  State& st = *state_;
  const Product p = FromPlan(internal::PlanBackwardInput(a.layout == Layout::kOutIn, a.dx, a.dy,
                                                         a.w, a.n, a.in, a.out, a.ld_dy),
                             a.in_dtype, a.dx_dtype);
  if (a.gelu_input == nullptr) {
    bool ran = false;
    absl::Status s = st.Run(p, /*may_decline=*/false, &ran);
    if (s.ok()) ++st.counts.fused;  // nothing to fuse: the product is the whole call
    return s;
  }
  const bool bgrad = a.gelu_bias_grad != nullptr;
  void* bgrad_scratch = nullptr;
  if (bgrad) {
    absl::StatusOr<void*> scratch = st.Scratch(a.in * DTypeSize(a.dx_dtype));
    if (!scratch.ok()) return scratch.status();
    bgrad_scratch = *scratch;
  }
  Product fused = p;
  fused.epilogue = bgrad ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
  fused.aux = const_cast<void*>(a.gelu_input);  // read, not written, by the D epilogues
  fused.ld_aux = a.in;
  fused.bias = bgrad_scratch;
  const bool try_fused = a.in % 8 == 0 && Aligned16(a.gelu_input);
  bool fused_ran = true;
  absl::Status s = st.RunFusedOr(fused, try_fused, p, [&]() -> absl::Status {
    fused_ran = false;
    absl::Status g =
        internal::LtGeluTanhBackwardInPlace(a.dx, a.gelu_input, a.n * a.in, a.dx_dtype, st.stream);
    if (!g.ok() || !bgrad) return g;
    return internal::LtColumnSumsAdd(a.gelu_bias_grad, a.dx, a.n, a.in, /*ld=*/a.in, a.dx_dtype,
                                     st.stream);
  });
  if (!s.ok() || !bgrad || !fused_ran) return s;
  // DGELU_BGRAD wrote the bias gradient (=, in dx's type): add it.
  return AddInto(a.gelu_bias_grad, bgrad_scratch, a.dx_dtype, a.in, st.stream);
}

// dw += x^T dy (f32, beta 1), db += column sums of dy.
absl::Status CublasLtLinear::BackwardWeight(const BackwardWeightArgs& a) {
  if (absl::Status s = CheckBackwardWeight(a); !s.ok() || a.n == 0) return s;
  State& st = *state_;
  const internal::LtPlan plan = internal::PlanBackwardWeight(a.layout == Layout::kOutIn, a.dw, a.x,
                                                             a.dy, a.n, a.in, a.out, a.ld_dy);
  Product p = FromPlan(plan, a.in_dtype, DType::kF32);
  p.c = a.dw;  // dw += (beta 1, in place)
  const cublasLtEpilogue_t bgrad =
      plan.bias_grad_from_a ? CUBLASLT_EPILOGUE_BGRADA : CUBLASLT_EPILOGUE_BGRADB;
  if (a.db == nullptr) {
    bool ran = false;
    absl::Status s = st.Run(p, /*may_decline=*/false, &ran);
    if (s.ok()) ++st.counts.fused;
    return s;
  }
  absl::StatusOr<void*> scratch = st.Scratch(a.out * sizeof(float));
  if (!scratch.ok()) return scratch.status();
  Product fused = p;
  fused.epilogue = bgrad;
  fused.bias = *scratch;
  bool fused_ran = true;
  absl::Status s = st.RunFusedOr(fused, /*try_fused=*/true, p, [&]() -> absl::Status {
    fused_ran = false;
    // dy's rows ld_dy apart: the sums cover its OUT columns only.
    const int64_t ld_dy = a.ld_dy == 0 ? a.out : a.ld_dy;
    return internal::LtColumnSumsAdd(a.db, a.dy, a.n, a.out, ld_dy, a.in_dtype, st.stream);
  });
  if (!s.ok() || !fused_ran) return s;
  return AddInto(a.db, *scratch, DType::kF32, a.out, st.stream);
}

}  // namespace gpu
}  // namespace zeroshard
