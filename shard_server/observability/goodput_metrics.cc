#include "shard_server/observability/goodput_metrics.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace zeroshard {
namespace {

void Family(std::string* out, const char* name, const char* type, const char* help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

// 12 significant digits: a year of seconds to the microsecond (absl::StrCat's
// 6 would round a day's seconds to 0.1 s).
std::string Num(double v) { return absl::StrFormat("%.12g", v); }

}  // namespace

void WriteGoodputFamilies(const v1::GetStatusResponse& status,
                          const std::vector<std::string>& job_labels, std::string* out) {
  Family(out, "zeroshard_job_seconds_total", "counter",
         "Wall-clock seconds of the job since its first join (not while it is finished), by "
         "cause: productive or a cause of badput (docs/goodput.md). The causes sum to the wall "
         "clock; in_flight is the running generation's time its workers have not reported yet, "
         "and moves to another cause when they do.");
  for (int j = 0; j < status.jobs_size(); ++j) {
    const v1::Goodput& g = status.jobs(j).goodput();
    absl::StrAppend(out, "zeroshard_job_seconds_total{", job_labels[j], ",cause=\"productive\"} ",
                    Num(g.productive_seconds()), "\n");
    // By name: the same order on every scrape.
    const std::map<std::string, double> badput(g.badput_seconds().begin(),
                                               g.badput_seconds().end());
    for (const auto& [cause, seconds] : badput) {
      absl::StrAppend(out, "zeroshard_job_seconds_total{", job_labels[j], ",cause=\"", cause,
                      "\"} ", Num(seconds), "\n");
    }
  }
  Family(out, "zeroshard_job_goodput_ratio", "gauge",
         "Productive seconds of the job over its wall-clock seconds (0 before it started).");
  for (int j = 0; j < status.jobs_size(); ++j) {
    absl::StrAppend(out, "zeroshard_job_goodput_ratio{", job_labels[j], "} ",
                    Num(status.jobs(j).goodput().goodput()), "\n");
  }
  Family(out, "zeroshard_job_mfu_ratio", "gauge",
         "Model FLOPs utilization of the job's productive steps: model FLOPs over the peak FLOPs "
         "its ranks could have done meanwhile (-1: not known yet).");
  for (int j = 0; j < status.jobs_size(); ++j) {
    absl::StrAppend(out, "zeroshard_job_mfu_ratio{", job_labels[j], "} ",
                    Num(status.jobs(j).goodput().mfu()), "\n");
  }
}

}  // namespace zeroshard
