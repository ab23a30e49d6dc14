#include "tests/testing/control_plane_sim.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace zeroshard::testing {

ServerProcess StartServerProcess(const std::string& binary,
                                 const std::vector<std::string>& extra) {
  ServerProcess s;
  s.dir = MakeTempDir("cpbench");
  std::vector<std::string> args = {"--listen=127.0.0.1:0", "--port_file=" + s.dir + "/port"};
  args.insert(args.end(), extra.begin(), extra.end());
  s.process = std::make_unique<ChildProcess>(binary, args, s.dir + "/server.log");
  std::string port;
  if (!WaitFor(
          [&] {
            port = ReadFileOrEmpty(s.dir + "/port");
            return !port.empty() && port.back() == '\n';
          },
          absl::Seconds(20))) {
    std::fprintf(stderr, "server did not start:\n%s\n", s.process->Log().c_str());
    std::exit(1);
  }
  port.pop_back();
  s.address = "127.0.0.1:" + port;
  return s;
}

int64_t RssBytes(pid_t pid) {
  std::string status = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/status"));
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, "VmRSS:")) continue;
    int64_t kib = 0;
    line = absl::StripAsciiWhitespace(line);
    absl::ConsumeSuffix(&line, " kB");
    return absl::SimpleAtoi(line, &kib) ? kib * 1024 : -1;
  }
  return -1;
}

double CpuSeconds(pid_t pid) {
  std::string stat = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/stat"));
  size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(paren + 2), ' ');
  double utime = 0, stime = 0;  // fields 14 and 15 of stat, 12 and 13 after the name
  if (fields.size() < 13 || !absl::SimpleAtod(fields[11], &utime) ||
      !absl::SimpleAtod(fields[12], &stime)) {
    return -1;
  }
  return (utime + stime) / sysconf(_SC_CLK_TCK);
}

void FillTelemetry(const std::string& telemetry, v1::HeartbeatRequest* request) {
  if (telemetry == "none") return;
  request->set_loss(2.718281828);
  request->set_memory_bytes(int64_t{3} << 30);
  request->set_collective_seq(1234567);
  v1::StepTelemetry* step = request->mutable_last_step();
  step->set_step_ms(123.456);
  step->set_items_per_second(81234.5);
  step->set_gather_wait_ms(12.5);
  step->set_reduce_wait_ms(3.25);
  if (telemetry != "full") return;
  v1::RankTelemetry* t = request->mutable_telemetry();
  v1::MemoryUsage* memory = t->mutable_memory();
  memory->set_params(int64_t{1} << 30);
  memory->set_grads(int64_t{1} << 29);
  memory->set_optimizer_state(int64_t{2} << 30);
  memory->set_activations(int64_t{3} << 28);
  memory->set_comm_buffers(int64_t{1} << 26);
  memory->set_cached(int64_t{1} << 27);
  t->set_bytes_moved(int64_t{123} << 30);
  t->set_gathers_entered(512345);
  t->set_reductions_entered(256789);
  t->set_first_collective_unix_us(1'790'000'000'123'456);
  t->set_arrival_lag_ms(3.5f);
  t->set_arrival_lag_median_ms(2.25f);
  v1::CollectiveInProgress* c = t->mutable_in_progress();
  c->set_op(v1::ALL_GATHER);
  c->set_unit("transformer.h.17");
  c->set_seq(512345);
  c->set_started_unix_ms(1'790'000'000'456);
}

}  // namespace zeroshard::testing
