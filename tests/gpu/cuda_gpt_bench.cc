// Device GPT throughput at W = 1: the ZeRO engine on CudaBackend + NCCL (one
// rank) training CudaGptModel on random tokens, for the gpt_bench GPT (6
// layers, d_model 384, 6 heads, context 128, vocab 256, batch 4) and GPT-2
// 124M (12 layers, d_model 768, 12 heads, context 1024, vocab 50257, batch
// 8), f32 and bf16 products, ZeRO stages 0 and 3. Prints a table and writes
// JSON: tokens/s, step time, and peak device memory (the device's used bytes
// above what it used before the configuration, sampled after every step: the
// stream-ordered pool keeps what it reserved, so that is its high-water mark;
// plus the engine's own accounting). Needs a GPU (tests/gpu/run.sh runs it);
// exits 1 with the no-device message otherwise.
//
// --attention takes a list of kernels (CudaGptOptions::Attention); a kernel
// that cannot take a dtype (cudnn with f32, naive with bf16) is skipped for
// it, so `--attention=naive,flash,cudnn` compares every kernel in one run.
// flash_tc runs with both (f32 as 3xTF32; both models' heads are 64).
//
//   cuda_gpt_bench [--models=gpt_bench,gpt2_124m] [--dtypes=f32,bf16]
//                  [--stages=0,3] [--attention=auto] [--tf32] [--steps=10]
//                  [--warmup=3] [--json_out=FILE]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/dtype.h"
#include "common/plan/planner.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_store.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_device.h"
#include "worker/cuda/cuda_gpt.h"
#include "worker/cuda/nccl_communicator.h"
#include "worker/zero/engine.h"

ABSL_FLAG(std::string, models, "gpt_bench,gpt2_124m", "Models: gpt_bench, gpt2_124m");
ABSL_FLAG(std::string, dtypes, "f32,bf16", "Matrix-product / parameter dtypes: f32, bf16");
ABSL_FLAG(std::string, stages, "0,3", "ZeRO stages");
ABSL_FLAG(std::string, attention, "auto",
          "Attention kernels to compare: auto, cudnn, flash, flash_tc, naive (a list)");
ABSL_FLAG(bool, tf32, false, "f32 products as TF32");
ABSL_FLAG(bool, profile, false,
          "Also print each configuration's GPU time per kind of work (ms per step, from CUDA "
          "events around the model's sections)");
ABSL_FLAG(int, steps, 10, "Timed steps per configuration");
ABSL_FLAG(int, prefetch, 1, "Stage 3: units gathered ahead of use (the worker's --prefetch)");
ABSL_FLAG(int, warmup, 3, "Untimed steps first");
ABSL_FLAG(bool, packed_collectives, true,
          "Stages 1-3: the engine's packed gathers and reduce-scatters (the device default); "
          "false: NCCL's block collectives (the worker's --packed_collectives=off)");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");

namespace zeroshard {
namespace {

struct BenchModel {
  std::string name;
  GptConfig config;
  int batch;
};

absl::StatusOr<BenchModel> ModelByName(const std::string& name) {
  BenchModel m;
  m.name = name;
  if (name == "gpt_bench") {
    m.config = GptConfig{6, 6, 384, 256, 128};
    m.batch = 4;
  } else if (name == "gpt2_124m") {
    m.config = GptConfig{12, 12, 768, 50257, 1024};
    m.batch = 8;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--models: unknown model '", name, "' (expected gpt_bench or gpt2_124m)"));
  }
  return m;
}

int64_t DeviceUsedBytes() {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
  return static_cast<int64_t>(total_bytes - free_bytes);
}

// Gives the pool's cached blocks back to the driver, so that the next
// configuration starts from a clean baseline.
void TrimPool() {
  cudaDeviceSynchronize();
  cudaMemPool_t pool = nullptr;
  int device = 0;
  cudaGetDevice(&device);
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) cudaMemPoolTrimTo(pool, 0);
}

struct Result {
  double tokens_per_second = 0;
  double step_ms = 0;
  int64_t device_peak_bytes = 0;
  int64_t engine_peak_bytes = 0;
  int64_t activation_bytes = 0;
  int64_t parameters = 0;
  double last_loss = 0;
  std::string attention;                     // the kernel the model resolved to
  std::map<std::string, double> profile_ms;  // per step, --profile only
  // The engine's host-side times per timed step (StepTimes): where the
  // compute thread waited for a gather or a reduction, and the optimizer.
  double gather_wait_ms = 0, reduce_wait_ms = 0, optimizer_ms = 0;
  gpu::CublasLtLinear::PathCounts linear_paths;
};

absl::StatusOr<Result> RunOne(const BenchModel& m, DType dtype, int stage,
                              CudaGptOptions::Attention attention, int run_id) {
  TrimPool();
  const int64_t baseline = DeviceUsedBytes();
  int64_t peak = baseline;
  Result result;
  {
    absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create(0);
    if (!backend.ok()) return backend.status();
    InMemoryKvStore store;
    const std::string tag = absl::StrCat("bench", run_id);
    auto gather = NcclCommunicator::Create(&store, 0, 1, 0, tag + "-gather", absl::Seconds(60));
    if (!gather.ok()) return gather.status();
    auto reduce = NcclCommunicator::Create(&store, 0, 1, 0, tag + "-reduce", absl::Seconds(60));
    if (!reduce.ok()) return reduce.status();
    auto aux = GlooCommunicator::Create(&store, 0, 1, tag + "-aux");
    if (!aux.ok()) return aux.status();
    CudaGptOptions gpt;
    gpt.matmul_dtype = dtype;
    gpt.attention = attention;
    gpt.tf32 = absl::GetFlag(FLAGS_tf32);
    auto model = CudaGptModel::Create(m.config, m.batch, gpt, backend->get());
    if (!model.ok()) return model.status();
    result.attention = AttentionName((*model)->attention());
    auto plan = Plan((*model)->Spec(), 1, PlanOptions());
    if (!plan.ok()) return plan.status();
    EngineOptions options;
    options.stage = stage;
    options.prefetch = absl::GetFlag(FLAGS_prefetch);
    options.packed_collectives = absl::GetFlag(FLAGS_packed_collectives);
    options.param_dtype = dtype;
    options.backend = backend->get();
    options.optimizer = "adamw";
    options.max_grad_norm = 1.0;
    auto engine =
        ZeroEngine::Create(model->get(), *plan, gather->get(), reduce->get(), aux->get(), options);
    if (!engine.ok()) return engine.status();
    TokenModel* tm = model->get();
    absl::Status s =
        (*engine)->Initialize([tm](const TensorSpec& t, int64_t b, int64_t e, float* rows) {
          tm->InitRows(t, b, e, /*seed=*/1, rows);
          return absl::OkStatus();
        });
    if (!s.ok()) return s;
    for (const TensorSpec& t : (*model)->Spec().tensors) result.parameters += t.Elements();

    const int t_len = static_cast<int>(m.config.n_ctx);
    std::vector<int32_t> tokens(static_cast<size_t>(m.batch) * t_len);
    std::vector<int32_t> targets(tokens.size());
    std::mt19937 rng(7);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(m.config.vocab - 1));
    const int warmup = absl::GetFlag(FLAGS_warmup);
    const int steps = absl::GetFlag(FLAGS_steps);
    auto start = std::chrono::steady_clock::now();
    for (int step = 0; step < warmup + steps; ++step) {
      if (step == warmup) {
        if (absl::GetFlag(FLAGS_profile)) {
          (*model)->EnableProfile(true);
          if (auto reset = (*model)->TakeProfile(); !reset.ok()) return reset.status();
        }
        cudaDeviceSynchronize();
        start = std::chrono::steady_clock::now();
      }
      for (size_t i = 0; i < tokens.size(); ++i) {
        tokens[i] = token(rng);
        targets[i] = token(rng);
      }
      if (s = (*model)->SetBatch(tokens.data(), targets.data(), m.batch, t_len); !s.ok()) return s;
      absl::StatusOr<double> loss = (*engine)->ForwardBackward(/*last_micro=*/true);
      if (!loss.ok()) return loss.status();
      absl::StatusOr<StepStats> stats = (*engine)->Step(3e-4);
      if (!stats.ok()) return stats.status();
      result.last_loss = *loss;
      if (step >= warmup) {
        result.gather_wait_ms += stats->times.gather_wait_ms / steps;
        result.reduce_wait_ms += stats->times.reduce_wait_ms / steps;
        result.optimizer_ms += stats->times.optimizer_ms / steps;
      }
      peak = std::max(peak, DeviceUsedBytes());
    }
    cudaDeviceSynchronize();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    result.tokens_per_second = static_cast<double>(steps) * tokens.size() / seconds;
    result.step_ms = 1e3 * seconds / steps;
    result.engine_peak_bytes = (*engine)->memory().peak_total();
    result.activation_bytes = (*model)->ActivationBytes();
    result.linear_paths = (*model)->linear_path_counts();
    if (absl::GetFlag(FLAGS_profile)) {
      absl::StatusOr<std::map<std::string, double>> profile = (*model)->TakeProfile();
      if (!profile.ok()) return profile.status();
      for (const auto& [name, ms] : *profile) result.profile_ms[name] = ms / steps;
    }
  }
  result.device_peak_bytes = peak - baseline;
  return result;
}

int Main() {
  if (absl::Status s = CheckCudaDevice(0); !s.ok()) {
    std::fprintf(stderr, "cuda_gpt_bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  nlohmann::ordered_json json;
  json["device"] = prop.name;
  json["world_size"] = 1;
  json["results"] = nlohmann::json::array();
  Table table({"MODEL", "PARAMS", "DTYPE", "ATTENTION", "STAGE", "TOKENS/s", "STEP ms",
               "DEVICE PEAK", "ENGINE PEAK", "ACTIVATIONS", "WAIT GATHER/REDUCE ms", "OPT ms"});
  int run_id = 0;
  bool failed = false;
  std::vector<std::string> profiles;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_models), ',')) {
    absl::StatusOr<BenchModel> m = ModelByName(std::string(name));
    if (!m.ok()) {
      std::fprintf(stderr, "cuda_gpt_bench: %s\n", std::string(m.status().message()).c_str());
      return 2;
    }
    for (absl::string_view dtype_name : absl::StrSplit(absl::GetFlag(FLAGS_dtypes), ',')) {
      const DType dtype = dtype_name == "bf16" ? DType::kBF16 : DType::kF32;
      if (dtype_name != "bf16" && dtype_name != "f32") {
        std::fprintf(stderr, "cuda_gpt_bench: --dtypes: '%s' is not f32 or bf16\n",
                     std::string(dtype_name).c_str());
        return 2;
      }
      for (absl::string_view attention_name : absl::StrSplit(absl::GetFlag(FLAGS_attention), ',')) {
        absl::StatusOr<CudaGptOptions::Attention> attention =
            ParseAttention(std::string(attention_name));
        if (!attention.ok()) {
          std::fprintf(stderr, "cuda_gpt_bench: --attention: %s\n",
                       std::string(attention.status().message()).c_str());
          return 2;
        }
        using A = CudaGptOptions::Attention;
        if ((*attention == A::kCudnn && dtype != DType::kBF16) ||
            (*attention == A::kNaive && dtype != DType::kF32)) {
          continue;  // that kernel does not take this dtype
        }
        for (absl::string_view stage_name : absl::StrSplit(absl::GetFlag(FLAGS_stages), ',')) {
          int stage = -1;
          if (!absl::SimpleAtoi(stage_name, &stage) || stage < 0 || stage > 3) {
            std::fprintf(stderr, "cuda_gpt_bench: --stages: '%s' is not 0-3\n",
                         std::string(stage_name).c_str());
            return 2;
          }
          std::fprintf(stderr, "%s %s %s stage %d ...\n", m->name.c_str(),
                       std::string(dtype_name).c_str(), std::string(attention_name).c_str(), stage);
          absl::StatusOr<Result> r = RunOne(*m, dtype, stage, *attention, run_id++);
          if (!r.ok()) {
            std::fprintf(stderr, "cuda_gpt_bench: %s %s %s stage %d: %s\n", m->name.c_str(),
                         std::string(dtype_name).c_str(), std::string(attention_name).c_str(),
                         stage, r.status().ToString().c_str());
            // cuDNN missing on this machine: the other kernels still run.
            // Any other error fails the bench, after the results so far.
            if (*attention == A::kCudnn && absl::IsUnavailable(r.status())) continue;
            failed = true;
            continue;
          }
          json["results"].push_back({{"model", m->name},
                                     {"parameters", r->parameters},
                                     {"n_layer", m->config.n_layer},
                                     {"n_embd", m->config.n_embd},
                                     {"n_head", m->config.n_head},
                                     {"vocab", m->config.vocab},
                                     {"context", m->config.n_ctx},
                                     {"batch", m->batch},
                                     {"dtype", std::string(dtype_name)},
                                     {"attention", r->attention},
                                     {"tf32", absl::GetFlag(FLAGS_tf32)},
                                     {"stage", stage},
                                     {"prefetch", absl::GetFlag(FLAGS_prefetch)},
                                     {"collectives", absl::GetFlag(FLAGS_packed_collectives)
                                                         ? "packed"
                                                         : "blocks"},
                                     {"gather_wait_ms", r->gather_wait_ms},
                                     {"reduce_wait_ms", r->reduce_wait_ms},
                                     {"optimizer_ms", r->optimizer_ms},
                                     {"tokens_per_second", r->tokens_per_second},
                                     {"step_ms", r->step_ms},
                                     {"device_peak_bytes", r->device_peak_bytes},
                                     {"engine_peak_bytes", r->engine_peak_bytes},
                                     {"activation_bytes", r->activation_bytes},
                                     {"last_loss", r->last_loss},
                                     {"fused_products", r->linear_paths.fused},
                                     {"unfused_products", r->linear_paths.unfused},
                                     {"profile_ms_per_step", r->profile_ms}});
          if (!r->profile_ms.empty()) {
            std::string line = absl::StrFormat("  %s %s %s stage %d, GPU ms per step:", m->name,
                                               std::string(dtype_name), r->attention, stage);
            for (const auto& [section, ms] : r->profile_ms) {
              absl::StrAppendFormat(&line, " %s %.2f;", section, ms);
            }
            profiles.push_back(line);
          }
          table.AddRow({m->name, absl::StrFormat("%.1fM", r->parameters / 1e6),
                        std::string(dtype_name), r->attention, absl::StrCat(stage),
                        absl::StrFormat("%.0f", r->tokens_per_second),
                        absl::StrFormat("%.1f", r->step_ms), HumanBytes(r->device_peak_bytes),
                        HumanBytes(r->engine_peak_bytes), HumanBytes(r->activation_bytes),
                        absl::StrFormat("%.2f / %.2f", r->gather_wait_ms, r->reduce_wait_ms),
                        absl::StrFormat("%.2f", r->optimizer_ms)});
        }
      }
    }
  }
  std::printf("%s", table.ToString().c_str());
  for (const std::string& line : profiles) std::printf("%s\n", line.c_str());
  const int written = WriteBenchJson(json, absl::GetFlag(FLAGS_json_out));
  return failed ? 1 : written;
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
