#include "worker/cuda/cuda_backend.h"

#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/kernels.h"

namespace zeroshard {
namespace {

class CudaFence : public Fence {
 public:
  explicit CudaFence(cudaEvent_t event) : event_(event) {}
  ~CudaFence() override { cudaEventDestroy(event_); }
  absl::Status Wait() override {
    return CudaErrorToStatus(cudaEventSynchronize(event_), "waiting for a fence (cudaEvent)");
  }

 private:
  cudaEvent_t event_;
};

// Adam / AdamW with moments in device memory, stepping on the calling
// thread's stream of `backend`.
class CudaAdamOptimizer : public Optimizer {
 public:
  CudaAdamOptimizer(CudaBackend* backend, int64_t n, bool decoupled, const OptimizerOptions& o,
                    double weight_decay, float* exp_avg, float* exp_avg_sq)
      : Optimizer(n, 0),
        backend_(backend),
        decoupled_(decoupled),
        options_(o),
        weight_decay_(weight_decay),
        exp_avg_device_(exp_avg),
        exp_avg_sq_device_(exp_avg_sq) {}
  ~CudaAdamOptimizer() override {
    cudaFree(exp_avg_device_);
    cudaFree(exp_avg_sq_device_);
  }

  const char* name() const override { return decoupled_ ? "adamw" : "adam"; }
  float* exp_avg() override { return exp_avg_device_; }
  float* exp_avg_sq() override { return exp_avg_sq_device_; }
  int64_t StateBytes() const override { return 2 * size() * static_cast<int64_t>(sizeof(float)); }

  absl::Status Step(float* params, const float* grads, int64_t n, double lr) override {
    if (absl::Status s = CheckStepArgs(params, grads, n, lr); !s.ok()) return s;
    gpu::AdamStepParams p;
    p.lr = lr;
    p.step = step_ + 1;
    p.beta1 = options_.beta1;
    p.beta2 = options_.beta2;
    p.eps = options_.eps;
    p.weight_decay = weight_decay_;
    p.decoupled = decoupled_;
    absl::Status s = gpu::AdamStep(params, grads, exp_avg_device_, exp_avg_sq_device_, n, p,
                                   backend_->StreamForThisThread());
    if (s.ok()) step_ += 1;
    return s;
  }

 private:
  CudaBackend* const backend_;
  const bool decoupled_;
  const OptimizerOptions options_;
  const double weight_decay_;
  float* const exp_avg_device_;
  float* const exp_avg_sq_device_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  if (absl::Status s = CheckCudaDevice(device); !s.ok()) return s;
  // Keep freed blocks in the device's pool instead of returning them to the
  // driver at every synchronization (the engine frees and reallocates the
  // same sizes every unit).
  cudaMemPool_t pool = nullptr;
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
    uint64_t keep = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  cudaGetLastError();
  return std::unique_ptr<CudaBackend>(new CudaBackend(device));
}

CudaBackend::~CudaBackend() {
  absl::MutexLock lock(&mu_);
  for (auto& [thread, stream] : streams_) {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  }
}

std::string CudaBackend::name() const { return absl::StrCat("cuda:", device_); }

cudaStream_t CudaBackend::StreamForThisThread() {
  const std::thread::id self = std::this_thread::get_id();
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(self);
  if (it != streams_.end()) return it->second;
  cudaStream_t stream = nullptr;
  absl::Status s =
      CudaErrorToStatus(cudaSetDevice(device_), absl::StrCat(name(), ": cudaSetDevice"));
  if (s.ok()) {
    s = CudaErrorToStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                          absl::StrCat(name(), ": cudaStreamCreate"));
  }
  if (!s.ok()) {
    if (first_error_.ok()) first_error_ = s;
    stream = nullptr;  // the legacy stream: work still runs, the error is reported
  }
  streams_[self] = stream;
  return stream;
}

void CudaBackend::Check(const absl::Status& status) {
  if (status.ok()) return;
  absl::MutexLock lock(&mu_);
  if (first_error_.ok()) first_error_ = status;
}

absl::Status CudaBackend::sticky() const {
  absl::MutexLock lock(&mu_);
  return first_error_;
}

void* CudaBackend::Allocate(int64_t bytes) {
  void* data = nullptr;
  cudaError_t error = cudaMallocAsync(&data, bytes, StreamForThisThread());
  if (error != cudaSuccess) {
    cudaGetLastError();  // out of memory is not sticky: the caller reports it
    return nullptr;
  }
  return data;
}

void CudaBackend::Free(void* data, int64_t) {
  Check(CudaErrorToStatus(cudaFreeAsync(data, StreamForThisThread()), "cudaFreeAsync"));
}

void CudaBackend::Zero(void* dst, int64_t bytes) {
  Check(
      CudaErrorToStatus(cudaMemsetAsync(dst, 0, bytes, StreamForThisThread()), "cudaMemsetAsync"));
}

void CudaBackend::Copy(void* dst, const void* src, int64_t bytes) {
  Check(CudaErrorToStatus(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, StreamForThisThread()),
      "cudaMemcpyAsync (device to device)"));
}

absl::Status CudaBackend::CopyToHost(void* host, const void* src, int64_t bytes) {
  cudaStream_t stream = StreamForThisThread();
  Check(CudaErrorToStatus(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream),
                          "cudaMemcpyAsync (device to host)"));
  return Synchronize();
}

absl::Status CudaBackend::CopyFromHost(void* dst, const void* host, int64_t bytes) {
  cudaStream_t stream = StreamForThisThread();
  Check(CudaErrorToStatus(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream),
                          "cudaMemcpyAsync (host to device)"));
  return Synchronize();  // `host` may be reused when this returns
}

void CudaBackend::Convert(const void* src, DType from, void* dst, DType to, int64_t n) {
  cudaStream_t stream = StreamForThisThread();
  if (from == to) {
    Copy(dst, src, n * DTypeSize(from));
  } else if (from == DType::kF32 && to == DType::kBF16) {
    Check(
        gpu::CastF32ToBF16(static_cast<uint16_t*>(dst), static_cast<const float*>(src), n, stream));
  } else if (from == DType::kBF16 && to == DType::kF32) {
    Check(
        gpu::CastBF16ToF32(static_cast<float*>(dst), static_cast<const uint16_t*>(src), n, stream));
  } else {
    Check(absl::InvalidArgumentError(
        absl::StrCat("Convert: ", DTypeName(from), " to ", DTypeName(to), " is not supported")));
  }
}

// The kernels take the runs as (packed_begin, full_offset) pairs.
static_assert(sizeof(PackedRun) == 2 * sizeof(int64_t) && std::is_standard_layout_v<PackedRun>,
              "PackedRun is two int64_t");

absl::Status CudaBackend::PreparePacked(PackedLayout* layout) {
  if (layout->runs.empty()) return absl::OkStatus();
  StreamForThisThread();  // the device current on this thread
  const size_t bytes = layout->runs.size() * sizeof(PackedRun);
  void* device = nullptr;
  if (absl::Status s = CudaErrorToStatus(
          cudaMalloc(&device, bytes),
          absl::StrCat("cudaMalloc of ", bytes, " bytes for a packed layout's runs"));
      !s.ok()) {
    return s;
  }
  layout->device_runs = std::shared_ptr<const PackedRun>(
      static_cast<const PackedRun*>(device),
      [](const PackedRun* p) { cudaFree(const_cast<PackedRun*>(p)); });
  return CudaErrorToStatus(cudaMemcpy(device, layout->runs.data(), bytes, cudaMemcpyHostToDevice),
                           "cudaMemcpy of a packed layout's runs");
}

void CudaBackend::Pack(const PackedLayout& layout, const float* full, void* packed, DType to) {
  if (layout.device_runs == nullptr && !layout.runs.empty()) {
    Check(absl::FailedPreconditionError("Pack: the packed layout was not prepared"));
    return;
  }
  Check(gpu::PackRuns(packed, to, full, reinterpret_cast<const int64_t*>(layout.device_runs.get()),
                      static_cast<int64_t>(layout.runs.size()), layout.packed_elements(),
                      StreamForThisThread()));
}

void CudaBackend::Unpack(const PackedLayout& layout, const void* packed, DType from, float* full) {
  if (layout.device_runs == nullptr && !layout.runs.empty()) {
    Check(absl::FailedPreconditionError("Unpack: the packed layout was not prepared"));
    return;
  }
  Check(gpu::UnpackRuns(
      full, packed, from, reinterpret_cast<const int64_t*>(layout.device_runs.get()),
      static_cast<int64_t>(layout.runs.size()), layout.packed_elements(), StreamForThisThread()));
}

void CudaBackend::UnpackRaw(const PackedLayout& layout, const void* packed, DType dtype,
                            void* full) {
  if (layout.device_runs == nullptr && !layout.runs.empty()) {
    Check(absl::FailedPreconditionError("UnpackRaw: the packed layout was not prepared"));
    return;
  }
  Check(gpu::UnpackRunsRaw(
      full, packed, dtype, reinterpret_cast<const int64_t*>(layout.device_runs.get()),
      static_cast<int64_t>(layout.runs.size()), layout.packed_elements(), StreamForThisThread()));
}

bool CudaBackend::UnpackThrough(const PackedLayout& layout, const float* packed, DType through,
                                float* full) {
  if (layout.device_runs == nullptr && !layout.runs.empty()) {
    Check(absl::FailedPreconditionError("UnpackThrough: the packed layout was not prepared"));
    return true;  // the error is this thread's sticky status
  }
  Check(gpu::UnpackRunsThrough(
      full, packed, through, reinterpret_cast<const int64_t*>(layout.device_runs.get()),
      static_cast<int64_t>(layout.runs.size()), layout.packed_elements(), StreamForThisThread()));
  return true;
}

void CudaBackend::AddInto(const void* src, DType dtype, float* dst, int64_t n) {
  Check(gpu::AddInto(dst, src, dtype, n, StreamForThisThread()));
}

void CudaBackend::Scale(float* x, int64_t n, float factor) {
  Check(gpu::Scale(x, n, factor, StreamForThisThread()));
}

absl::StatusOr<double> CudaBackend::SquaredNorm(const float* x, int64_t n) {
  cudaStream_t stream = StreamForThisThread();
  void* result = nullptr;
  if (absl::Status s = CudaErrorToStatus(cudaMallocAsync(&result, sizeof(double), stream),
                                         "SquaredNorm: cudaMallocAsync");
      !s.ok()) {
    return s;
  }
  Check(gpu::SquaredNorm(static_cast<double*>(result), x, n, stream));
  double value = 0;
  absl::Status copied = CopyToHost(&value, result, sizeof(double));
  cudaFreeAsync(result, stream);
  if (!copied.ok()) return copied;
  return value;
}

absl::Status CudaBackend::Synchronize() {
  Check(CudaErrorToStatus(cudaStreamSynchronize(StreamForThisThread()),
                          absl::StrCat(name(), ": cudaStreamSynchronize")));
  return sticky();
}

std::unique_ptr<Fence> CudaBackend::Record() {
  cudaEvent_t event = nullptr;
  // Blocking sync: a thread waiting on the fence sleeps instead of spinning
  // on a core the compute thread needs.
  absl::Status s = CudaErrorToStatus(
      cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync),
      "cudaEventCreate");
  if (s.ok()) {
    s = CudaErrorToStatus(cudaEventRecord(event, StreamForThisThread()), "cudaEventRecord");
  }
  if (!s.ok()) {
    Check(s);
    // Without an event, wait here: the fence is then already passed.
    cudaStreamSynchronize(StreamForThisThread());
    if (event != nullptr) cudaEventDestroy(event);
    return nullptr;
  }
  return std::make_unique<CudaFence>(event);
}

absl::StatusOr<std::unique_ptr<Optimizer>> CudaBackend::MakeOptimizer(
    const std::string& name, int64_t n, const OptimizerOptions& options) {
  // The CPU factory validates the name and options and knows the defaults.
  absl::StatusOr<std::unique_ptr<Optimizer>> validated = zeroshard::MakeOptimizer(name, 0, options);
  if (!validated.ok()) return validated.status();
  if (name != "adam" && name != "adamw") {
    return absl::UnimplementedError(
        absl::StrCat("optimizer '", name,
                     "' has no CUDA implementation yet; use adam or adamw with "
                     "--backend=nccl, or --backend=gloo"));
  }
  const bool decoupled = name == "adamw";
  const double weight_decay = options.weight_decay.value_or(decoupled ? 1e-2 : 0.0);
  void* moments[2] = {nullptr, nullptr};
  for (void*& m : moments) {
    absl::Status s = CudaErrorToStatus(cudaMalloc(&m, std::max<int64_t>(n, 1) * sizeof(float)),
                                       absl::StrCat(name, " state on ", this->name()));
    // Zeroed on this thread's stream (cudaMemset would run on the legacy
    // stream, which the backend's non-blocking streams do not wait for).
    if (s.ok()) {
      s = CudaErrorToStatus(cudaMemsetAsync(m, 0, n * sizeof(float), StreamForThisThread()),
                            "cudaMemsetAsync");
    }
    if (s.ok()) s = Synchronize();
    if (!s.ok()) {
      cudaFree(moments[0]);
      cudaFree(moments[1]);
      return s;
    }
  }
  return std::unique_ptr<Optimizer>(new CudaAdamOptimizer(this, n, decoupled, options, weight_decay,
                                                          static_cast<float*>(moments[0]),
                                                          static_cast<float*>(moments[1])));
}

}  // namespace zeroshard
