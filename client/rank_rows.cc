#include "client/rank_rows.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/table.h"
#include "shard_server/observability/rank_views.h"

namespace zeroshard {
namespace {

bool Summarized(const v1::JobStatus& job, int rank, bool all) {
  return !all && rank < 0 && job.members_size() > kMaxListedRanks;
}

std::string Seconds(double s) { return s < 0 ? "-" : absl::StrFormat("%.1fs", s); }

// "<=1s 32760  <=3s 5  >10s 3" for the buckets that hold ranks.
std::string HistogramLine(const RankHistogram& h, const char* unit) {
  std::string out;
  for (size_t i = 0; i < h.counts.size(); ++i) {
    if (h.counts[i] == 0) continue;
    absl::StrAppend(&out, out.empty() ? "" : "  ",
                    i < h.bounds.size() ? absl::StrCat("<=", h.bounds[i], unit)
                                        : absl::StrCat(">", h.bounds.back(), unit),
                    " ", h.counts[i]);
  }
  return out.empty() ? "none yet" : out;
}

}  // namespace

RankRows SelectRankRows(const v1::JobStatus& job, int rank, bool all) {
  RankRows rows;
  if (rank >= 0) {
    for (const v1::MemberStatus& m : job.members()) {
      if (m.rank() == rank) rows.members.push_back(&m);
    }
    rows.caption = rows.members.empty() ? absl::StrCat("no rank ", rank, " in job ", job.job_id())
                                        : absl::StrCat("rank ", rank, " of ", job.world_size());
    return rows;
  }
  if (!Summarized(job, rank, all)) {
    for (const v1::MemberStatus& m : job.members()) rows.members.push_back(&m);
    return rows;
  }
  rows.members = WorstRanks(job, kWorstRanksShown);
  rows.caption = absl::StrCat("worst ", rows.members.size(), " of ", job.members_size(),
                              " ranks (--rank=R for one, --all for every rank)");
  return rows;
}

std::string HostsAndHistograms(const v1::JobStatus& job, int rank, bool all) {
  if (!Summarized(job, rank, all)) return "";
  std::vector<HostSummary> hosts = SummarizeHosts(job);
  auto badness = [](const HostSummary& h) {
    return std::make_tuple(h.ranks - h.alive, h.stragglers, h.heartbeat_age_max,
                           h.step_seconds_max);
  };
  const size_t shown = std::min(hosts.size(), static_cast<size_t>(kWorstHostsShown));
  std::partial_sort(
      hosts.begin(), hosts.begin() + shown, hosts.end(),
      [&](const HostSummary& a, const HostSummary& b) { return badness(a) > badness(b); });
  Table table(
      {"HOST", "RANKS", "ALIVE", "STRAGGLERS", "HEARTBEAT MAX", "STEP TIME MAX", "SLOWEST STEP"});
  for (size_t i = 0; i < shown; ++i) {
    const HostSummary& h = hosts[i];
    table.AddRow({h.host, absl::StrCat(h.ranks), absl::StrCat(h.alive), absl::StrCat(h.stragglers),
                  Seconds(h.heartbeat_age_max), Seconds(h.step_seconds_max),
                  h.step_min < 0 ? "-" : absl::StrCat(h.step_min)});
  }
  std::string out =
      absl::StrCat("worst ", shown, " of ", hosts.size(), " hosts\n", table.ToString());
  RankHistogram age = MakeRankHistogram({1, 3, 10, 30});
  RankHistogram step = MakeRankHistogram({0.1, 0.3, 1, 3, 10});
  for (const v1::MemberStatus& m : job.members()) {
    if (m.rank() < 0) continue;
    age.Add(m.last_heartbeat_age_ms() < 0 ? -1 : m.last_heartbeat_age_ms() / 1e3);
    step.Add(m.last_step().step_ms() > 0 ? m.last_step().step_ms() / 1e3 : -1);
  }
  absl::StrAppend(&out, "heartbeat age over ranks: ", HistogramLine(age, "s"), "\n",
                  "step time over ranks:     ", HistogramLine(step, "s"), "\n");
  return out;
}

}  // namespace zeroshard
