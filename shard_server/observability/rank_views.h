// What a view shows of a job too large to list rank by rank (issue #31: a
// job of 100,000 ranks): its worst ranks, one summary per host, and
// histograms over the ranks. /metrics uses them above
// MetricsView::max_rank_series ranks; every rank stays reachable on request
// (/metrics?all=1, /metrics?job=J&rank=R). GetStatus and /api/status send
// them instead of every member when asked (GetStatusRequest.max_members;
// SummarizeLargeJobs).
#ifndef ZEROSHARD_SHARD_SERVER_OBSERVABILITY_RANK_VIEWS_H_
#define ZEROSHARD_SHARD_SERVER_OBSERVABILITY_RANK_VIEWS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "proto/zeroshard.pb.h"

namespace zeroshard {

// The `n` members of `job` (with a rank) that most need a look, worst first:
// dead or left before alive, then named in a hang, then stragglers, then by
// heartbeat age, median arrival lag and step time, longest first; rank
// breaks ties. O(W log n).
std::vector<const v1::MemberStatus*> WorstRanks(const v1::JobStatus& job, int n);

// One host's ranks of a job, summarized. Times in seconds; -1: no rank of
// the host has reported one yet.
struct HostSummary {
  std::string host;
  int ranks = 0;
  int alive = 0;  // alive and not left
  int stragglers = 0;
  double heartbeat_age_max = -1;
  double step_seconds_max = -1;
  int64_t step_min = -1;  // the host's slowest rank's completed steps
};
// By host name; members without a rank (still joining) are left out.
std::vector<HostSummary> SummarizeHosts(const v1::JobStatus& job);

// A histogram over a job's ranks: counts per upper bound (not cumulative),
// then the count above the last bound; values below zero ("none yet") are
// left out.
struct RankHistogram {
  std::vector<double> bounds;
  std::vector<int64_t> counts;  // bounds.size() + 1
  double sum = 0;
  int64_t count = 0;
  void Add(double value);
};
RankHistogram MakeRankHistogram(std::vector<double> bounds);

// The histograms every view draws over a job's alive ranks, one definition
// for /metrics (zeroshard_job_rank_<name>) and GetStatus (JobSummary).
struct RankHistogramSpec {
  const char* name;  // "heartbeat_age_seconds"
  const char* help;
  std::vector<double> bounds;
  double (*value)(const v1::MemberStatus&);  // < 0: none yet
};
const std::vector<RankHistogramSpec>& RankHistogramSpecs();
// `spec` over the ranks of `job` that are alive and not left.
RankHistogram HistogramOverRanks(const v1::JobStatus& job, const RankHistogramSpec& spec);

// `hosts` with the `n` worst first (most ranks down, then stragglers, oldest
// heartbeat, slowest step), cut to `n`.
void KeepWorstHosts(std::vector<HostSummary>* hosts, int n);

// Defaults of GetStatusRequest's summary fields (0 there).
inline constexpr int kDefaultWorstRanks = 32;
inline constexpr int kDefaultWorstHosts = 16;

// Applies `request`'s view to `status` (annotated already: the worst ranks
// need the straggler and hang flags): each job of more than
// request.max_members() members gets a JobSummary, and its members become
// its worst ranks, worst first, then the ranks and hosts `request` looks up,
// by rank. max_members 0: nothing changes. O(W log n) per job.
void SummarizeLargeJobs(const v1::GetStatusRequest& request, v1::GetStatusResponse* status);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_OBSERVABILITY_RANK_VIEWS_H_
