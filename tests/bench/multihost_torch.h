// PyTorch 2's FSDP2 on the emulated hosts, for multihost_bench to run beside
// zeroshard's modes with the same shapes, hosts and links: one process per
// rank (tests/bench/peers/peer.py --rank), started in its host's namespaces,
// Gloo over the hosts' eth0.
#ifndef ZEROSHARD_TESTS_BENCH_MULTIHOST_TORCH_H_
#define ZEROSHARD_TESTS_BENCH_MULTIHOST_TORCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tests/testing/emulated_hosts.h"

namespace zeroshard::testing {

// The modes multihost_bench runs with PyTorch: "fsdp2" (fully_shard over
// every rank) and "fsdp2-hsdp" (a 2-D DeviceMesh: shard inside a host,
// replicate across hosts).
bool IsTorchMode(const std::string& mode);

struct TorchShape {
  std::string model = "mlp";  // or "gpt": peer.py's gpt_bench GPT (vocab 256)
  int layers = 8;
  int width = 1024;     // mlp
  int d_model = 384;    // gpt
  int heads = 6;        // gpt
  int context = 128;    // gpt
  int batch = 8;        // rows (mlp) or sequences (gpt) per rank
  int steps = 10;
};

struct TorchRun {
  double step_ms = 0;                 // median over steps of the slowest rank's step
  std::vector<int64_t> peak_rss;      // per rank, VmHWM
  std::string blas_kernel;            // torch's BLAS and vector ISA
};

// Runs one job of PyTorch ranks: rank r on host rank_hosts[r], rank 0's
// TCPStore on `master_port` of its host. `python` must have torch 2.x.
absl::StatusOr<TorchRun> RunTorchPeers(EmulatedHosts& hosts, const std::vector<int>& rank_hosts,
                                       const std::string& mode, const TorchShape& shape,
                                       const std::string& python, int master_port,
                                       const std::string& log_dir);

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_BENCH_MULTIHOST_TORCH_H_
