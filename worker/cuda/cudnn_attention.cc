// Causal self-attention through cuDNN's fused scaled-dot-product attention
// (cudnn_attention.h), built with the cuDNN frontend's graph API.
//
// The frontend is compiled in its dynamic-loading mode
// (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING, set by @local_cuda//:cudnn_frontend):
// every cuDNN call goes through cudnn_frontend::cudnn_dlhandle, which
// LoadCudnn fills with dlopen on first use. Nothing links libcudnn, so a CPU
// run never maps it (linked in, it would cost every process its start-up
// and resident memory, as cuBLAS did: cublas_lazy.cc).
//
// Layout: the packed qkv [B,T,3C] is read in place as three strided 4-D
// tensors [B,NH,T,HS] with strides [T*3C, HS, 3C, 1] at offsets 0, C and 2C
// (q, k, v side by side per position); out and dout [B,T,C] as [B,NH,T,HS]
// with strides [T*C, HS, C, 1]; lse [B,NH,T] as [B,NH,T,1] f32; dqkv like
// qkv. bf16 storage, f32 softmax and accumulation, scale 1/sqrt(HS), the
// causal mask aligned top-left (query t sees keys s <= t).
#include "worker/cuda/cudnn_attention.h"

#include <cuda_runtime_api.h>
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/cudnn_attention_internal.h"

namespace cudnn_frontend {
// The library every cuDNN call of the frontend is resolved in
// (cudnn_frontend_shim.h, dynamic-loading mode). Set once by LoadCudnn,
// before any frontend call: the frontend caches each resolved symbol.
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace zeroshard {
namespace gpu {
namespace {

namespace fe = cudnn_frontend;

#define ZS_STR2(x) #x
#define ZS_STR(x) ZS_STR2(x)
constexpr char kSoname[] = "libcudnn.so." ZS_STR(CUDNN_MAJOR);

#define ZS_RETURN_IF_ERROR(expr)              \
  do {                                        \
    if (absl::Status _s = (expr); !_s.ok()) { \
      return _s;                              \
    }                                         \
  } while (0)

// The tensors' uids in the graphs and their variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// Head sizes cuDNN's fused attention takes at most (Hopper and later; 128
// before, which the frontend's validation reports).
constexpr int64_t kMaxHeadSize = 256;

// The loaded library, process-wide.
struct Library {
  absl::Mutex mu;
  void* handle ABSL_GUARDED_BY(mu) = nullptr;
  size_t version ABSL_GUARDED_BY(mu) = 0;  // cudnnGetVersion(): 91900 for 9.19.0
};

Library& TheLibrary() {
  static Library* library = new Library;
  return *library;
}

std::string VersionString(size_t v) {
  return absl::StrCat(v / 10000, ".", (v % 10000) / 100, ".", v % 100);
}

std::string HowToGetCudnn() {
  return absl::StrCat("cuDNN ", CUDNN_MAJOR, " for CUDA ", CUDART_VERSION / 1000,
                      " is needed: put the directory holding ", kSoname,
                      " on LD_LIBRARY_PATH (PyTorch's pip packages bring it: "
                      "<python site-packages>/nvidia/cudnn/lib, from nvidia-cudnn-cu",
                      CUDART_VERSION / 1000, ") or set ", cudnn_internal::kLibraryEnv,
                      " to its path");
}

// Checks that the library at `handle` is cuDNN CUDNN_MAJOR built for this
// binary's CUDA major; returns its version.
absl::StatusOr<size_t> CheckLoaded(void* handle, const std::string& name) {
  using VersionFn = size_t (*)();
  auto get_version = reinterpret_cast<VersionFn>(dlsym(handle, "cudnnGetVersion"));
  auto get_cudart = reinterpret_cast<VersionFn>(dlsym(handle, "cudnnGetCudartVersion"));
  if (get_version == nullptr || get_cudart == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cuDNN: ", name, " has no cudnnGetVersion / cudnnGetCudartVersion: not cuDNN? ",
        HowToGetCudnn()));
  }
  const size_t version = get_version();
  if (version / 10000 != CUDNN_MAJOR) {
    return absl::UnavailableError(
        absl::StrCat("cuDNN: ", name, " is cuDNN ", VersionString(version), "; ", HowToGetCudnn()));
  }
  const size_t cudart = get_cudart();
  if (cudart / 1000 != CUDART_VERSION / 1000) {
    return absl::UnavailableError(absl::StrCat("cuDNN: ", name, " (", VersionString(version),
                                               ") was built for CUDA ", cudart / 1000, ".",
                                               (cudart % 1000) / 10, ", this binary for CUDA ",
                                               CUDART_VERSION / 1000, ": ", HowToGetCudnn()));
  }
  return version;
}

// A frontend call that may throw (its dynamic-loading mode throws when a
// symbol is missing) as a status.
template <typename F>
absl::Status Guarded(const std::string& what, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": the cuDNN frontend threw: ", e.what()));
  }
}

absl::Status FrontendStatus(fe::error_t error, const std::string& what, absl::StatusCode code) {
  if (error.is_good()) return absl::OkStatus();
  return absl::Status(code, absl::StrCat(what, ": ", error.get_message()));
}

// ----------------------------------------------------------------------------
// Graphs

struct Shape {
  int64_t b, t, c, nh;
  int64_t hs() const { return c / nh; }
  bool operator<(const Shape& o) const {
    return std::array<int64_t, 4>{b, t, c, nh} < std::array<int64_t, 4>{o.b, o.t, o.c, o.nh};
  }
  std::string ToString() const {
    return absl::StrCat("B ", b, " T ", t, " C ", c, " NH ", nh, " (HS ", hs(), ")");
  }
};

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

std::vector<int64_t> HeadDims(const Shape& s) { return {s.b, s.nh, s.t, s.hs()}; }
// q, k, v, dq, dk, dv: one of the three C-wide slices of each [T, 3C] row.
std::vector<int64_t> PackedStrides(const Shape& s) { return {s.t * 3 * s.c, s.hs(), 3 * s.c, 1}; }
// out, dout: [B,T,C].
std::vector<int64_t> RowStrides(const Shape& s) { return {s.t * s.c, s.hs(), s.c, 1}; }
std::vector<int64_t> StatsDims(const Shape& s) { return {s.b, s.nh, s.t, 1}; }
std::vector<int64_t> StatsStrides(const Shape& s) { return {s.nh * s.t, s.t, 1, 1}; }

TensorPtr Input(fe::graph::Graph& g, const char* name, Uid uid, std::vector<int64_t> dims,
                std::vector<int64_t> strides) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim(std::move(dims))
                      .set_stride(std::move(strides)));
}

void Output(const TensorPtr& tensor, Uid uid, std::vector<int64_t> dims,
            std::vector<int64_t> strides) {
  tensor->set_output(true).set_uid(uid).set_dim(std::move(dims)).set_stride(std::move(strides));
}

// The same scale as the CPU attention (worker/model/attention.cc).
float Scale(const Shape& s) { return 1.0f / std::sqrt(static_cast<float>(s.hs())); }

std::shared_ptr<fe::graph::Graph> NewGraph(int sm_version) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  // Only for validation without a device; with one the frontend asks it.
  if (sm_version > 0) graph->set_sm_version(sm_version);
  return graph;
}

// out = softmax(scale q k^T, causal) v, and the softmax statistics (the
// natural log of each row's denominator, max included).
std::shared_ptr<fe::graph::Graph> ForwardGraph(const Shape& s, int sm_version) {
  auto graph = NewGraph(sm_version);
  TensorPtr q = Input(*graph, "q", kQ, HeadDims(s), PackedStrides(s));
  TensorPtr k = Input(*graph, "k", kK, HeadDims(s), PackedStrides(s));
  TensorPtr v = Input(*graph, "v", kV, HeadDims(s), PackedStrides(s));
  auto options = fe::graph::SDPA_attributes()
                     .set_name("causal_attention")
                     .set_generate_stats(true)
                     .set_causal_mask(true)
                     .set_attn_scale(Scale(s));
  auto [out, stats] = graph->sdpa(q, k, v, options);
  Output(out, kO, HeadDims(s), RowStrides(s));
  Output(stats, kStats, StatsDims(s), StatsStrides(s));
  stats->set_data_type(fe::DataType_t::FLOAT);
  return graph;
}

std::shared_ptr<fe::graph::Graph> BackwardGraph(const Shape& s, int sm_version) {
  auto graph = NewGraph(sm_version);
  TensorPtr q = Input(*graph, "q", kQ, HeadDims(s), PackedStrides(s));
  TensorPtr k = Input(*graph, "k", kK, HeadDims(s), PackedStrides(s));
  TensorPtr v = Input(*graph, "v", kV, HeadDims(s), PackedStrides(s));
  TensorPtr out = Input(*graph, "out", kO, HeadDims(s), RowStrides(s));
  TensorPtr dout = Input(*graph, "dout", kDO, HeadDims(s), RowStrides(s));
  TensorPtr stats = Input(*graph, "stats", kStats, StatsDims(s), StatsStrides(s));
  stats->set_data_type(fe::DataType_t::FLOAT);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("causal_attention_backward")
                     .set_causal_mask(true)
                     .set_attn_scale(Scale(s));
  auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, out, dout, stats, options);
  Output(dq, kDQ, HeadDims(s), PackedStrides(s));
  Output(dk, kDK, HeadDims(s), PackedStrides(s));
  Output(dv, kDV, HeadDims(s), PackedStrides(s));
  return graph;
}

// One graph built for the device: its plan chosen, its workspace known.
struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
};

// Validates, lowers and plans `graph` on `handle` (heuristics mode A, then
// the fallback list), the way the frontend's samples do.
absl::Status BuildPlan(fe::graph::Graph& graph, cudnnHandle_t handle, const std::string& what,
                       int64_t* workspace) {
  return Guarded(what, [&]() -> absl::Status {
    constexpr auto kUnsupported = absl::StatusCode::kUnimplemented;
    ZS_RETURN_IF_ERROR(FrontendStatus(graph.validate(), what + ": validate", kUnsupported));
    ZS_RETURN_IF_ERROR(FrontendStatus(graph.build_operation_graph(handle),
                                      what + ": build_operation_graph", kUnsupported));
    ZS_RETURN_IF_ERROR(
        FrontendStatus(graph.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                       what + ": create_execution_plans", kUnsupported));
    ZS_RETURN_IF_ERROR(
        FrontendStatus(graph.check_support(handle), what + ": check_support", kUnsupported));
    ZS_RETURN_IF_ERROR(FrontendStatus(graph.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE),
                                      what + ": build_plans", kUnsupported));
    return FrontendStatus(graph.get_workspace_size(*workspace), what + ": get_workspace_size",
                          absl::StatusCode::kInternal);
  });
}

// cuDNN's kernels load the bf16 tensors 16 bytes at a time; the heads'
// offsets (multiples of HS, itself a multiple of 8 bf16) keep that alignment.
// The f32 statistics need their own; the frontend checks what more its
// engine needs when it executes.
absl::Status CheckPointer(const char* op, const char* name, const void* p, int alignment = 16) {
  if (p == nullptr || reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("CudnnAttention::%s: %s (%p) must be a %d-byte aligned device pointer", op,
                        name, p, alignment));
  }
  return absl::OkStatus();
}

}  // namespace

// ----------------------------------------------------------------------------
// Loading and checks (cudnn_attention_internal.h)

namespace cudnn_internal {

absl::Status LoadCudnn() {
  Library& library = TheLibrary();
  absl::MutexLock lock(&library.mu);
  if (library.handle != nullptr) return absl::OkStatus();
  const char* env = std::getenv(kLibraryEnv);
  const std::string name = (env != nullptr && env[0] != '\0') ? env : kSoname;
  dlerror();
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return absl::UnavailableError(absl::StrCat("cuDNN: cannot load ", name, " (",
                                               error != nullptr ? error : "no reason given", "). ",
                                               HowToGetCudnn()));
  }
  absl::StatusOr<size_t> version = CheckLoaded(handle, name);
  if (!version.ok()) {
    dlclose(handle);
    return version.status();
  }
  library.handle = handle;
  library.version = *version;
  fe::cudnn_dlhandle = handle;
  // The frontend dlopens a CUDA runtime of its own for its few CUDA calls
  // (memsets on our stream among them), the first of libcudart.so.12 and .13
  // that loads. Make it the one this binary is linked with (already loaded,
  // so the same library) unless the user chose. Set once, before the
  // frontend's first CUDA call reads it.
  const std::string cudart = absl::StrCat("libcudart.so.", CUDART_VERSION / 1000);
  setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), /*overwrite=*/0);
  return absl::OkStatus();
}

absl::Status CheckShape(int64_t b, int64_t t, int64_t c, int64_t nh) {
  if (b < 1 || t < 1 || c < 1 || nh < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudnnAttention: b, t, c and nh must be positive; got b ", b, ", t ", t,
                     ", c ", c, ", nh ", nh));
  }
  if (c % nh != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CudnnAttention: c ", c, " is not a multiple of nh ", nh, " (head size c / nh)"));
  }
  if (t < 2) {
    // The frontend refuses the backward graph of s_q = s_kv = 1.
    return absl::InvalidArgumentError(
        absl::StrCat("CudnnAttention: t ", t,
                     ": cuDNN's fused attention takes sequences of 2 or more positions; use the "
                     "flash attention kernel (flash_attention.h)"));
  }
  const int64_t hs = c / nh;
  if (hs % 8 != 0 || hs > kMaxHeadSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudnnAttention: head size c / nh = ", hs,
                     "; cuDNN's fused attention takes multiples of 8 up to ", kMaxHeadSize,
                     " (128 before Hopper): use the flash attention kernel (flash_attention.h)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateGraphs(int64_t b, int64_t t, int64_t c, int64_t nh, int sm_version) {
  ZS_RETURN_IF_ERROR(LoadCudnn());
  ZS_RETURN_IF_ERROR(CheckShape(b, t, c, nh));
  const Shape shape{b, t, c, nh};
  const std::string what = absl::StrCat("cuDNN attention, ", shape.ToString(), ", sm_", sm_version);
  return Guarded(what, [&]() -> absl::Status {
    ZS_RETURN_IF_ERROR(FrontendStatus(ForwardGraph(shape, sm_version)->validate(),
                                      what + ": forward", absl::StatusCode::kUnimplemented));
    return FrontendStatus(BackwardGraph(shape, sm_version)->validate(), what + ": backward",
                          absl::StatusCode::kUnimplemented);
  });
}

}  // namespace cudnn_internal

// ----------------------------------------------------------------------------
// CudnnAttention

struct CudnnAttention::State {
  cudnnHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
  // Built on first use of a shape, then reused (building takes milliseconds
  // to seconds; executing microseconds).
  std::map<Shape, Plan> forward, backward;
  // One workspace for every plan, grown to the largest (stream-ordered:
  // the old one is freed after the work queued before the growth).
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;

  ~State() {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    if (workspace != nullptr) cudaFree(workspace);
    forward.clear();  // the plans before the handle they were built on
    backward.clear();
    if (handle != nullptr) fe::detail::destroy_handle(handle);
  }

  absl::StatusOr<Plan*> GetPlan(bool is_forward, const Shape& shape);
  absl::Status Execute(const Plan& plan, std::unordered_map<int64_t, void*>& pack,
                       const std::string& what);
};

absl::StatusOr<Plan*> CudnnAttention::State::GetPlan(bool is_forward, const Shape& shape) {
  std::map<Shape, Plan>& plans = is_forward ? forward : backward;
  auto it = plans.find(shape);
  if (it != plans.end()) return &it->second;
  const std::string what = absl::StrCat("cuDNN attention ", is_forward ? "forward" : "backward",
                                        ", ", shape.ToString(), ", device ", device);
  Plan plan;
  absl::Status built = Guarded(what, [&]() -> absl::Status {
    // 0: the frontend asks the device (the handle's).
    plan.graph = is_forward ? ForwardGraph(shape, 0) : BackwardGraph(shape, 0);
    return BuildPlan(*plan.graph, handle, what, &plan.workspace);
  });
  if (!built.ok()) return built;
  return &plans.emplace(shape, std::move(plan)).first->second;
}

absl::Status CudnnAttention::State::Execute(const Plan& plan,
                                            std::unordered_map<int64_t, void*>& pack,
                                            const std::string& what) {
  // The backward's holds an f32 dq accumulator (25 MB at GPT-2's shape):
  // kept across calls rather than taken from and given back to the pool at
  // every call.
  if (plan.workspace > workspace_bytes) {
    if (workspace != nullptr) {
      ZS_RETURN_IF_ERROR(
          CudaErrorToStatus(cudaFreeAsync(workspace, stream), what + ": workspace cudaFreeAsync"));
      workspace = nullptr;
      workspace_bytes = 0;
    }
    ZS_RETURN_IF_ERROR(CudaErrorToStatus(cudaMallocAsync(&workspace, plan.workspace, stream),
                                         what + ": workspace cudaMallocAsync"));
    workspace_bytes = plan.workspace;
  }
  return Guarded(what, [&] {
    return FrontendStatus(plan.graph->execute(handle, pack, workspace), what + ": execute",
                          absl::StatusCode::kInternal);
  });
}

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(void* stream) {
  ZS_RETURN_IF_ERROR(cudnn_internal::LoadCudnn());
  ZS_RETURN_IF_ERROR(CheckCudaDevice(0));
  auto state = std::make_unique<State>();
  state->stream = static_cast<cudaStream_t>(stream);
  ZS_RETURN_IF_ERROR(CudaErrorToStatus(cudaGetDevice(&state->device), "cudaGetDevice"));
  int major = 0, minor = 0;
  ZS_RETURN_IF_ERROR(CudaErrorToStatus(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, state->device),
      "cudaDeviceGetAttribute"));
  ZS_RETURN_IF_ERROR(CudaErrorToStatus(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, state->device),
      "cudaDeviceGetAttribute"));
  if (major < 8) {
    return absl::FailedPreconditionError(
        absl::StrCat("CudnnAttention: cuDNN's fused attention in bf16 needs compute capability 8.0 "
                     "(Ampere) or newer; device ",
                     state->device, " is ", major, ".", minor, ": use the flash attention kernel"));
  }
  const cudnnStatus_t created = fe::detail::create_handle(&state->handle);
  if (created != CUDNN_STATUS_SUCCESS) {
    state->handle = nullptr;
    // cuDNN loaded but cannot start (a sub-library missing, ...): a broken
    // install, not a missing one.
    return absl::InternalError(absl::StrCat("cuDNN ", LoadedVersion(), ": cudnnCreate on device ",
                                            state->device,
                                            " failed: ", fe::detail::get_error_string(created)));
  }
  const cudnnStatus_t set = fe::detail::set_stream(state->handle, state->stream);
  if (set != CUDNN_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cudnnSetStream: ", fe::detail::get_error_string(set)));
  }
  return std::unique_ptr<CudnnAttention>(new CudnnAttention(std::move(state)));
}

CudnnAttention::CudnnAttention(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudnnAttention::~CudnnAttention() = default;

absl::Status CudnnAttention::Prepare(int64_t b, int64_t t, int64_t c, int64_t nh) {
  ZS_RETURN_IF_ERROR(cudnn_internal::CheckShape(b, t, c, nh));
  const Shape shape{b, t, c, nh};
  if (absl::StatusOr<Plan*> f = state_->GetPlan(/*is_forward=*/true, shape); !f.ok()) {
    return f.status();
  }
  absl::StatusOr<Plan*> bw = state_->GetPlan(/*is_forward=*/false, shape);
  return bw.ok() ? absl::OkStatus() : bw.status();
}

absl::Status CudnnAttention::Forward(uint16_t* out, float* lse, const uint16_t* qkv, int64_t b,
                                     int64_t t, int64_t c, int64_t nh) {
  ZS_RETURN_IF_ERROR(cudnn_internal::CheckShape(b, t, c, nh));
  ZS_RETURN_IF_ERROR(CheckPointer("Forward", "out", out));
  // 16 bytes: what the frontend declares for every tensor, Stats included
  // (it checks only Q, K, V, O and their gradients itself).
  ZS_RETURN_IF_ERROR(CheckPointer("Forward", "lse", lse, 16));
  ZS_RETURN_IF_ERROR(CheckPointer("Forward", "qkv", qkv));
  const Shape shape{b, t, c, nh};
  absl::StatusOr<Plan*> plan = state_->GetPlan(/*is_forward=*/true, shape);
  if (!plan.ok()) return plan.status();
  uint16_t* in = const_cast<uint16_t*>(qkv);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, in}, {kK, in + c}, {kV, in + 2 * c}, {kO, out}, {kStats, lse}};
  return state_->Execute(**plan, pack, "cuDNN attention forward, " + shape.ToString());
}

absl::Status CudnnAttention::Backward(uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv,
                                      const uint16_t* out, const float* lse, int64_t b, int64_t t,
                                      int64_t c, int64_t nh) {
  ZS_RETURN_IF_ERROR(cudnn_internal::CheckShape(b, t, c, nh));
  ZS_RETURN_IF_ERROR(CheckPointer("Backward", "dqkv", dqkv));
  ZS_RETURN_IF_ERROR(CheckPointer("Backward", "dout", dout));
  ZS_RETURN_IF_ERROR(CheckPointer("Backward", "qkv", qkv));
  ZS_RETURN_IF_ERROR(CheckPointer("Backward", "out", out));
  ZS_RETURN_IF_ERROR(CheckPointer("Backward", "lse", lse, 16));
  const Shape shape{b, t, c, nh};
  absl::StatusOr<Plan*> plan = state_->GetPlan(/*is_forward=*/false, shape);
  if (!plan.ok()) return plan.status();
  uint16_t* in = const_cast<uint16_t*>(qkv);
  std::unordered_map<int64_t, void*> pack = {{kQ, in},
                                             {kK, in + c},
                                             {kV, in + 2 * c},
                                             {kO, const_cast<uint16_t*>(out)},
                                             {kDO, const_cast<uint16_t*>(dout)},
                                             {kStats, const_cast<float*>(lse)},
                                             {kDQ, dqkv},
                                             {kDK, dqkv + c},
                                             {kDV, dqkv + 2 * c}};
  return state_->Execute(**plan, pack, "cuDNN attention backward, " + shape.ToString());
}

absl::Status CudnnAttention::CheckHeads(int64_t c, int64_t nh) {
  return cudnn_internal::CheckShape(/*b=*/1, /*t=*/2, c, nh);
}

std::string CudnnAttention::LoadedVersion() {
  Library& library = TheLibrary();
  absl::MutexLock lock(&library.mu);
  return library.handle != nullptr ? VersionString(library.version) : std::string();
}

}  // namespace gpu
}  // namespace zeroshard
