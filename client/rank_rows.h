// Which ranks shardctl status and top list: every rank of a job of up to
// kMaxListedRanks ranks; of a larger one (issue #31: 100,000 ranks) its worst
// ranks, a line per host worst first, and histograms over the ranks, with any
// rank reachable by --rank=R and every rank by --all. --json is always whole.
#ifndef ZEROSHARD_CLIENT_RANK_ROWS_H_
#define ZEROSHARD_CLIENT_RANK_ROWS_H_

#include <string>
#include <vector>

#include "proto/zeroshard.pb.h"

namespace zeroshard {

inline constexpr int kMaxListedRanks = 64;  // a larger job is summarized
inline constexpr int kWorstRanksShown = 32;
inline constexpr int kWorstHostsShown = 16;

struct RankRows {
  std::vector<const v1::MemberStatus*> members;  // the rows, in order
  // Empty when every member is listed; else says what the rows are, e.g.
  // "worst 32 of 100000 ranks (--rank=R for one, --all for every rank)".
  std::string caption;
};
// `rank` >= 0: only that rank. `all`: every member (today's view).
RankRows SelectRankRows(const v1::JobStatus& job, int rank, bool all);

// For a summarized job: its worst hosts as a table, and histograms of
// heartbeat age and step time over its ranks; empty otherwise.
std::string HostsAndHistograms(const v1::JobStatus& job, int rank, bool all);

}  // namespace zeroshard

#endif  // ZEROSHARD_CLIENT_RANK_ROWS_H_
