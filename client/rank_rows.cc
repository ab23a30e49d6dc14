#include "client/rank_rows.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/table.h"

namespace zeroshard {
namespace {

bool Summarized(const v1::JobStatus& job, int rank, const std::string& host) {
  return rank < 0 && host.empty() && job.has_summary();
}

std::string Seconds(double s) { return s < 0 ? "-" : absl::StrFormat("%.1fs", s); }

// "<=1s 32760  <=3s 5  >10s 3" for the buckets that hold ranks.
std::string HistogramLine(const v1::RankHistogram& h, const char* unit) {
  std::string out;
  for (int i = 0; i < h.counts_size(); ++i) {
    if (h.counts(i) == 0) continue;
    absl::StrAppend(&out, out.empty() ? "" : "  ",
                    i < h.bounds_size() ? absl::StrCat("<=", h.bounds(i), unit)
                                        : absl::StrCat(">", h.bounds(h.bounds_size() - 1), unit),
                    " ", h.counts(i));
  }
  return out.empty() ? "none yet" : out;
}

}  // namespace

v1::GetStatusRequest StatusRequest(const std::string& job, int rank, const std::string& host,
                                   bool all) {
  v1::GetStatusRequest request;
  request.set_job_id(job);
  if (all) return request;
  request.set_max_members(kMaxListedRanks);
  request.set_worst_ranks(kWorstRanksShown);
  request.set_worst_hosts(kWorstHostsShown);
  if (rank >= 0) request.add_ranks(rank);
  if (!host.empty()) request.add_hosts(host);
  return request;
}

RankRows SelectRankRows(const v1::JobStatus& job, int rank, const std::string& host) {
  RankRows rows;
  const int ranks = job.has_summary() ? job.summary().ranks() : job.members_size();
  if (rank >= 0 || !host.empty()) {
    for (const v1::MemberStatus& m : job.members()) {
      if (rank >= 0 ? m.rank() == rank : m.host() == host) rows.members.push_back(&m);
    }
    std::sort(rows.members.begin(), rows.members.end(),
              [](const v1::MemberStatus* a, const v1::MemberStatus* b) {
                return a->rank() < b->rank();
              });
    const std::string what = rank >= 0 ? absl::StrCat("rank ", rank) : "host " + host;
    if (rows.members.empty()) {
      rows.caption = absl::StrCat("no ", what, " in job ", job.job_id());
    } else if (rank >= 0) {
      rows.caption = absl::StrCat(what, " of ", ranks);
    } else {
      rows.caption = absl::StrCat(what, ": ", rows.members.size(), " of ", ranks, " ranks");
    }
    return rows;
  }
  const int listed = Summarized(job, rank, host) ? job.summary().worst_listed() : -1;
  for (const v1::MemberStatus& m : job.members()) {
    if (listed >= 0 && static_cast<int>(rows.members.size()) == listed) break;
    rows.members.push_back(&m);
  }
  if (listed >= 0) {
    rows.caption = absl::StrCat("worst ", rows.members.size(), " of ", ranks,
                                " ranks (--rank=R or --host=H for others, --all for every rank)");
  }
  return rows;
}

int AliveRanks(const v1::JobStatus& job) {
  if (job.has_summary()) return job.summary().alive();
  int alive = 0;
  for (const v1::MemberStatus& m : job.members()) alive += m.rank() >= 0 && m.alive() && !m.left();
  return alive;
}

std::string HostsAndHistograms(const v1::JobStatus& job, int rank, const std::string& host) {
  if (!Summarized(job, rank, host)) return "";
  const v1::JobSummary& summary = job.summary();
  Table table(
      {"HOST", "RANKS", "ALIVE", "STRAGGLERS", "HEARTBEAT MAX", "STEP TIME MAX", "SLOWEST STEP"});
  for (const v1::HostStatus& h : summary.worst_hosts()) {
    table.AddRow({h.host(), absl::StrCat(h.ranks()), absl::StrCat(h.alive()),
                  absl::StrCat(h.stragglers()), Seconds(h.heartbeat_age_max_seconds()),
                  Seconds(h.step_max_seconds()),
                  h.step_min() < 0 ? "-" : absl::StrCat(h.step_min())});
  }
  std::string out = absl::StrCat("worst ", summary.worst_hosts_size(), " of ", summary.hosts(),
                                 " hosts\n", table.ToString());
  for (const v1::RankHistogram& h : summary.histograms()) {
    // "heartbeat_age_seconds" -> "heartbeat age"
    const std::string name =
        absl::StrReplaceAll(h.name(), {{"step_seconds", "step time"}, {"_seconds", ""}, {"_", " "}});
    absl::StrAppend(&out, absl::StrFormat("%-26s", absl::StrCat(name, " over ranks:")),
                    HistogramLine(h, "s"), "\n");
  }
  return out;
}

}  // namespace zeroshard
