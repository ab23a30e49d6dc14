// All-gather and reduce-scatter bandwidth of NcclCommunicator on every
// visible GPU of this machine: one rank per GPU, as threads of this process,
// bootstrapped through an InMemoryKvStore.
//
// Definitions are nccl-tests' (doc/PERFORMANCE.md), so the numbers compare
// with all_gather_perf / reduce_scatter_perf:
//   size   the bytes of the full buffer: all-gather's output, reduce-scatter's
//          input (W * count * element size)
//   time   per operation: each rank's mean over --iters, then the slowest rank
//   algbw  size / time
//   busbw  algbw * (W - 1) / W, the bandwidth each link must sustain in a ring,
//          comparable to the hardware's peak (e.g. NVLink) whatever W is
// Unlike nccl-tests, each operation here waits for completion before the next
// is issued (the Communicator API is synchronous, as ZeRO uses it), so small
// sizes include the host's polling latency.
//
// Without a GPU it exits 1 with the no-device message.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/cuda/nccl_communicator.h"
#include "worker/cuda/cuda_device.h"

ABSL_FLAG(int64_t, min_bytes, int64_t{1} << 20, "Smallest size (bytes of the full buffer)");
ABSL_FLAG(int64_t, max_bytes, int64_t{1} << 30, "Largest size; sizes double from min_bytes");
ABSL_FLAG(int, warmup, 5, "Untimed iterations per size");
ABSL_FLAG(int, iters, 20, "Timed iterations per size");
ABSL_FLAG(std::string, dtype, "F32", "F32 or BF16");
ABSL_FLAG(int, gpus, 0, "Ranks (one per GPU); 0 = every visible GPU");

namespace zeroshard {
namespace {

constexpr absl::Duration kTimeout = absl::Minutes(5);

enum class Op { kAllGather, kReduceScatter };

struct Row {
  int64_t bytes = 0;
  int64_t count = 0;           // elements per rank (NCCL's count for both operations)
  double seconds[2] = {0, 0};  // per operation, slowest rank
};

absl::Status Fail(int rank, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("rank ", rank, ": ", status.message()));
}

// Runs every size for one rank; `seconds[op]` of each row is raised to this
// rank's mean time if it is the slowest so far (rows are written under
// `mu`).
absl::Status RunRank(int rank, int world, DType dtype, KeyValueStore* store, std::vector<Row>* rows,
                     absl::Mutex* mu) {
  if (cudaError_t e = cudaSetDevice(rank); e != cudaSuccess) {
    return Fail(rank, CudaErrorToStatus(e, "cudaSetDevice"));
  }
  auto comm = NcclCommunicator::Create(store, rank, world, rank, "busbw", absl::Minutes(2));
  if (!comm.ok()) return Fail(rank, comm.status());
  const int64_t max_bytes = rows->back().bytes;
  void* full = nullptr;   // all-gather output, reduce-scatter input
  void* chunk = nullptr;  // all-gather input, reduce-scatter output
  if (cudaError_t e = cudaMalloc(&full, max_bytes); e != cudaSuccess) {
    return Fail(rank, CudaErrorToStatus(e, absl::StrCat("cudaMalloc(", max_bytes, ")")));
  }
  if (cudaError_t e = cudaMalloc(&chunk, max_bytes / world + 256); e != cudaSuccess) {
    cudaFree(full);
    return Fail(rank, CudaErrorToStatus(e, "cudaMalloc"));
  }
  cudaMemset(full, 0, max_bytes);
  cudaMemset(chunk, 0, max_bytes / world + 256);
  cudaDeviceSynchronize();

  absl::Status status;
  for (Row& row : *rows) {
    for (Op op : {Op::kAllGather, Op::kReduceScatter}) {
      auto run = [&] {
        return op == Op::kAllGather ? (*comm)->AllGather(chunk, full, row.count, dtype, kTimeout)
                                    : (*comm)->ReduceScatter(full, chunk, row.count, dtype,
                                                             ReduceOp::kSum, kTimeout);
      };
      // Aligns the ranks so that one rank's setup is not timed by another.
      status = (*comm)->Barrier(kTimeout);
      for (int i = 0; status.ok() && i < absl::GetFlag(FLAGS_warmup); ++i) status = run();
      if (status.ok()) status = (*comm)->Barrier(kTimeout);
      const absl::Time start = absl::Now();
      const int iters = absl::GetFlag(FLAGS_iters);
      for (int i = 0; status.ok() && i < iters; ++i) status = run();
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start) / iters;
      if (!status.ok()) break;
      absl::MutexLock lock(mu);
      double& slowest = row.seconds[op == Op::kAllGather ? 0 : 1];
      slowest = std::max(slowest, seconds);
    }
    if (!status.ok()) break;
  }
  cudaFree(full);
  cudaFree(chunk);
  return status.ok() ? absl::OkStatus() : Fail(rank, status);
}

int Main() {
  absl::Status device = CheckCudaDevice(0);
  if (!device.ok()) {
    std::fprintf(stderr, "nccl_busbw_bench: %s\n", std::string(device.message()).c_str());
    return 1;
  }
  int visible = 0;
  cudaGetDeviceCount(&visible);
  const int world = absl::GetFlag(FLAGS_gpus) > 0 ? absl::GetFlag(FLAGS_gpus) : visible;
  if (world > visible) {
    std::fprintf(stderr, "nccl_busbw_bench: --gpus=%d but only %d visible\n", world, visible);
    return 1;
  }
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok() || (*dtype != DType::kF32 && *dtype != DType::kBF16)) {
    std::fprintf(stderr, "nccl_busbw_bench: --dtype must be F32 or BF16\n");
    return 1;
  }
  if (absl::GetFlag(FLAGS_iters) < 1 || absl::GetFlag(FLAGS_min_bytes) < 1 ||
      absl::GetFlag(FLAGS_max_bytes) < absl::GetFlag(FLAGS_min_bytes)) {
    std::fprintf(stderr, "nccl_busbw_bench: need iters >= 1 and 1 <= min_bytes <= max_bytes\n");
    return 1;
  }

  // Sizes rounded down to a whole number of elements per rank.
  const int64_t unit = static_cast<int64_t>(world) * DTypeSize(*dtype);
  std::vector<Row> rows;
  for (int64_t bytes = absl::GetFlag(FLAGS_min_bytes); bytes <= absl::GetFlag(FLAGS_max_bytes);
       bytes *= 2) {
    Row row;
    row.count = std::max<int64_t>(bytes / unit, 1);
    row.bytes = row.count * unit;
    rows.push_back(row);
  }

  InMemoryKvStore store;
  absl::Mutex mu;
  std::vector<absl::Status> results(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back(
        [&, rank] { results[rank] = RunRank(rank, world, *dtype, &store, &rows, &mu); });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) {
      std::fprintf(stderr, "nccl_busbw_bench: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }

  std::printf("# NcclCommunicator bus bandwidth: %d GPU(s), dtype %s, %d iterations per size\n",
              world, DTypeName(*dtype).c_str(), absl::GetFlag(FLAGS_iters));
  std::printf("# busbw = algbw * (W-1)/W (nccl-tests); times are per operation, slowest rank\n");
  std::printf("%14s %12s | %-30s | %-30s\n", "", "", "all_gather", "reduce_scatter");
  std::printf("%14s %12s | %10s %9s %9s | %10s %9s %9s\n", "size(B)", "count", "time(us)", "algbw",
              "busbw", "time(us)", "algbw", "busbw");
  const double factor = static_cast<double>(world - 1) / world;
  for (const Row& row : rows) {
    std::printf("%14lld %12lld", static_cast<long long>(row.bytes),
                static_cast<long long>(row.count));
    for (double seconds : row.seconds) {
      const double algbw = row.bytes / seconds / 1e9;  // GB/s, as nccl-tests
      std::printf(" | %10.1f %9.2f %9.2f", seconds * 1e6, algbw, algbw * factor);
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
