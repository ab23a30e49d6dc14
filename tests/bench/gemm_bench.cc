// Which BLAS for the CPU kernels: times the GEMMs of one gpt_bench GPT step
// (6 blocks, d_model 384, 4 x 128 tokens, 6 heads, vocab 256; forward and
// backward) through each candidate library, loaded with dlopen, at 1 and 2
// threads. Libraries that are not installed are skipped.
//
//   bazel run //tests/bench:gemm_bench -- [--reps=5] [--json_out=FILE]
//   bazel run //tests/bench:gemm_bench -- --libs=/path/libfoo.so,...
//
// cblas_sgemm is called where the library has it, dnnl_sgemm (oneDNN)
// otherwise; threads are set with openblas_set_num_threads,
// bli_thread_set_num_threads and omp_set_num_threads, whichever exist.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "tests/testing/bench_json.h"
#include "tests/testing/bench_machine.h"

ABSL_FLAG(std::string, libs,
          "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0,"
          "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0,"
          "/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0,"
          "/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4,"
          "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4,"
          "/usr/lib/x86_64-linux-gnu/libdnnl.so.2",
          "Comma-separated shared libraries to compare");
ABSL_FLAG(std::string, threads, "1,2", "Thread counts");
ABSL_FLAG(int, reps, 5, "Repetitions (the best is reported)");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");

namespace {

// cblas enums (row major, no-trans, trans).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                            int, float, float*, int);
using DnnlSgemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);

struct Lib {
  CblasSgemm cblas = nullptr;
  DnnlSgemm dnnl = nullptr;
  void Gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
            const float* b, int ldb, float beta, float* c, int ldc) const {
    if (cblas != nullptr) {
      cblas(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, m, n, k, alpha, a, lda, b,
            ldb, beta, c, ldc);
    } else {
      dnnl(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
  }
};

struct Times {
  double linears_ms = 1e30, attention_ms = 1e30, head_ms = 1e30;
  char kernel[32] = "-";  // openblas_get_corename() where the library has it
};

// One step's GEMMs with the GPT's shapes.
Times TimeStep(const Lib& lib, int reps) {
  constexpr int N = 512, C = 384, V = 256, B = 4, T = 128, NH = 6, HS = 64, L = 6;
  std::vector<float> x(N * 4 * C, 0.01f), w(4 * C * C, 0.02f), y(N * 4 * C), dw(4 * C * C);
  std::vector<float> qkv(N * 3 * C, 0.1f), att(T * T, 0.01f), o(N * C);
  const std::pair<int, int> linears[] = {{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}};
  Times best;
  using Clock = std::chrono::steady_clock;
  auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    for (int l = 0; l < L; ++l) {
      for (auto [in, out] : linears) {  // Conv1D: forward, dx, dw
        lib.Gemm(false, false, N, out, in, 1, x.data(), in, w.data(), out, 1, y.data(), out);
        lib.Gemm(false, true, N, in, out, 1, y.data(), out, w.data(), out, 0, x.data(), in);
        lib.Gemm(true, false, in, out, N, 1, x.data(), in, y.data(), out, 1, dw.data(), out);
      }
    }
    const auto t1 = Clock::now();
    for (int l = 0; l < L; ++l) {
      for (int bh = 0; bh < B * NH; ++bh) {  // per head: 2 forward, 4 backward
        const float* q = qkv.data() + (bh / NH) * T * 3 * C + (bh % NH) * HS;
        lib.Gemm(false, true, T, T, HS, 0.125f, q, 3 * C, q + C, 3 * C, 0, att.data(), T);
        lib.Gemm(false, false, T, HS, T, 1, att.data(), T, q + 2 * C, 3 * C, 0, o.data(), C);
        lib.Gemm(true, false, T, HS, T, 1, att.data(), T, o.data(), C, 0, y.data(), 3 * C);
        lib.Gemm(false, true, T, T, HS, 1, o.data(), C, q + 2 * C, 3 * C, 0, att.data(), T);
        lib.Gemm(false, false, T, HS, T, 1, att.data(), T, q + C, 3 * C, 0, y.data(), 3 * C);
        lib.Gemm(true, false, T, HS, T, 1, att.data(), T, q, 3 * C, 0, y.data() + C, 3 * C);
      }
    }
    const auto t2 = Clock::now();
    lib.Gemm(false, true, N, V, C, 1, x.data(), C, w.data(), C, 0, y.data(), V);  // LM head
    lib.Gemm(false, false, N, C, V, 1, y.data(), V, w.data(), C, 0, x.data(), C);
    lib.Gemm(true, false, V, C, N, 1, y.data(), V, x.data(), C, 1, dw.data(), C);
    const auto t3 = Clock::now();
    best.linears_ms = std::min(best.linears_ms, ms(t0, t1));
    best.attention_ms = std::min(best.attention_ms, ms(t1, t2));
    best.head_ms = std::min(best.head_ms, ms(t2, t3));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  zeroshard::Table table(
      {"LIBRARY", "KERNEL", "THREADS", "LINEARS ms", "GFLOP/s", "ATTENTION ms", "LM HEAD ms", "TOTAL ms"});
  nlohmann::ordered_json json = nlohmann::ordered_json::array();
  // 6 blocks x 3 GEMMs (forward, dx, dw) x 2 flops x 512 rows x 12 C^2.
  const double linear_flops = 6.0 * 3 * 2 * 512 * 12.0 * 384 * 384;
  const std::vector<std::string> libs =
      absl::StrSplit(absl::GetFlag(FLAGS_libs), ',', absl::SkipEmpty());
  const std::vector<std::string> thread_counts =
      absl::StrSplit(absl::GetFlag(FLAGS_threads), ',', absl::SkipEmpty());
  for (const std::string& path : libs) {
    for (const std::string& threads_text : thread_counts) {
      const int threads = std::stoi(threads_text);
      // Each (library, threads) in a child process: libraries and their
      // thread pools stay out of each other's way.
      std::fflush(stdout);
      int fds[2];
      if (pipe(fds) != 0) return 1;
      const pid_t pid = fork();
      if (pid == 0) {
        close(fds[0]);
        void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (h == nullptr) _exit(2);
        Lib lib;
        lib.cblas = reinterpret_cast<CblasSgemm>(dlsym(h, "cblas_sgemm"));
        lib.dnnl = reinterpret_cast<DnnlSgemm>(dlsym(h, "dnnl_sgemm"));
        if (lib.cblas == nullptr && lib.dnnl == nullptr) _exit(3);
        // dlsym on the library's handle also searches what it depends on: the
        // OpenMP runtime it loaded (RTLD_LOCAL keeps that out of
        // RTLD_DEFAULT's reach, so oneDNN used to run on every core).
        for (const char* name :
             {"openblas_set_num_threads", "bli_thread_set_num_threads", "omp_set_num_threads"}) {
          if (auto f = reinterpret_cast<void (*)(int)>(dlsym(h, name))) f(threads);
        }
        Times t = TimeStep(lib, absl::GetFlag(FLAGS_reps));
        if (auto corename = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_corename"))) {
          std::snprintf(t.kernel, sizeof(t.kernel), "%s", corename());
        }
        if (write(fds[1], &t, sizeof(t)) != sizeof(t)) _exit(4);
        _exit(0);
      }
      close(fds[1]);
      Times t;
      const bool ok = read(fds[0], &t, sizeof(t)) == sizeof(t);
      close(fds[0]);
      int status = 0;
      waitpid(pid, &status, 0);
      if (!ok) {
        std::fprintf(stderr, "%s: not loadable here, skipped\n", path.c_str());
        break;
      }
      const double total = t.linears_ms + t.attention_ms + t.head_ms;
      table.AddRow({path, t.kernel, threads_text, absl::StrFormat("%.1f", t.linears_ms),
                    absl::StrFormat("%.0f", linear_flops / t.linears_ms / 1e6),
                    absl::StrFormat("%.1f", t.attention_ms), absl::StrFormat("%.1f", t.head_ms),
                    absl::StrFormat("%.1f", total)});
      json.push_back({{"library", path},
                      {"blas_kernel", t.kernel},
                      {"threads", threads},
                      {"linears_ms", t.linears_ms},
                      {"attention_ms", t.attention_ms},
                      {"lm_head_ms", t.head_ms},
                      {"total_ms", total}});
    }
  }
  // Each library reports its own kernel (column KERNEL); the CPU is common.
  std::printf("%s\n%s", zeroshard::DescribeBenchMachine("see KERNEL").Line().c_str(),
              table.ToString().c_str());
  return zeroshard::WriteBenchJson(json, absl::GetFlag(FLAGS_json_out));
}
