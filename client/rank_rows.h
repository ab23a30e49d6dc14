// Which ranks shardctl status and top list: every rank of a job of up to
// kMaxListedRanks ranks; of a larger one (issue #31: 100,000 ranks) the
// server's summary (GetStatusRequest.max_members): its worst ranks, its worst
// hosts and histograms over the ranks, so a refresh does not fetch every
// rank. Any rank stays reachable by --rank=R, a host's ranks by --host=H,
// and every rank by --all. --json prints the same view (with --all: whole).
#ifndef ZEROSHARD_CLIENT_RANK_ROWS_H_
#define ZEROSHARD_CLIENT_RANK_ROWS_H_

#include <string>
#include <vector>

#include "proto/zeroshard.pb.h"

namespace zeroshard {

inline constexpr int kMaxListedRanks = 64;  // a larger job is summarized
inline constexpr int kWorstRanksShown = 32;
inline constexpr int kWorstHostsShown = 16;

// What status and top ask for: `job` ("" every job), summarized above
// kMaxListedRanks unless `all`; `rank` >= 0 and `host` look ranks up.
v1::GetStatusRequest StatusRequest(const std::string& job, int rank, const std::string& host,
                                   bool all);

struct RankRows {
  std::vector<const v1::MemberStatus*> members;  // the rows, in order
  // Empty when every member is listed; else says what the rows are, e.g.
  // "worst 32 of 100000 ranks (--rank=R or --host=H for others, --all for every rank)".
  std::string caption;
};
// `rank` >= 0: only that rank; `host` not empty: only that host's ranks;
// else a summarized job's worst ranks, or every member.
RankRows SelectRankRows(const v1::JobStatus& job, int rank, const std::string& host);

// Ranks of the job alive and not left (from the summary when it has one).
int AliveRanks(const v1::JobStatus& job);

// For a summarized job and no look-up: its worst hosts as a table, and its
// histograms over the ranks; empty otherwise.
std::string HostsAndHistograms(const v1::JobStatus& job, int rank, const std::string& host);

}  // namespace zeroshard

#endif  // ZEROSHARD_CLIENT_RANK_ROWS_H_
