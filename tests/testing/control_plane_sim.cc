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
  s.dir_owner = RemovedAtExit(s.dir);
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
    s.dir_owner.Keep();
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

}  // namespace zeroshard::testing
