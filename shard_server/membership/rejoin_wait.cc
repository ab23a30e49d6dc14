#include "shard_server/membership/rejoin_wait.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

std::string Quoted(const std::vector<std::string>& ids) {
  std::string out;
  for (const std::string& id : ids) absl::StrAppend(&out, out.empty() ? "" : ", ", "'", id, "'");
  return out;
}

std::string Named(const MissingMember& m) {
  return absl::StrCat("'", m.worker_id, "' (rank ", m.rank, ")");
}

// "2 of 4 workers re-joined ('w0', 'w1') after --rejoin_grace=1s"
std::string Rejoined(const RejoinState& s) {
  return absl::StrCat(s.rejoined.size(), " of ", s.world_size, " workers re-joined",
                      s.rejoined.empty() ? "" : absl::StrCat(" (", Quoted(s.rejoined), ")"),
                      " after --rejoin_grace=", absl::FormatDuration(s.rejoin_grace));
}

}  // namespace

RejoinDecision DecideRejoin(const RejoinState& s) {
  RejoinDecision d;
  const int in = static_cast<int>(s.rejoined.size());
  const int m = std::max(1, s.world_multiple);
  auto whole = [m](int n) { return n / m * m; };  // the largest multiple of m <= n
  if (in >= s.world_size && whole(in) == in) {
    d.action = RejoinAction::kForm;
    d.form_size = in;
    return d;
  }
  if (s.min_world_size <= 0 || !s.grace_over) return d;  // kWaitForAll
  // --min_world_size in whole groups: the least multiple of m at or above it.
  const int need = (s.min_world_size + m - 1) / m * m;
  const std::string groups = m > 1 ? absl::StrCat(" (whole shard groups of ", m, ")") : "";
  if (whole(in) >= need) {
    d.action = RejoinAction::kForm;
    d.form_size = whole(in);
    return d;
  }
  std::string live, gone;
  for (const MissingMember& mm : s.missing) {
    if (mm.live) {
      d.waiting_for.push_back(mm.worker_id);
      absl::StrAppend(&live, live.empty() ? "" : ", ", Named(mm));
    } else {
      absl::StrAppend(&gone, gone.empty() ? "" : ", ", Named(mm),
                      mm.left ? " left" : " was declared dead");
    }
  }
  const int could = static_cast<int>(d.waiting_for.size());
  if (whole(in + could) >= need) {
    d.action = RejoinAction::kWaitForLive;
    d.message = absl::StrCat(
        "job '", s.job_id, "' generation ", s.generation, ": ", Rejoined(s),
        "; --min_world_size=", s.min_world_size, groups, " needs ", need - in,
        " more: waiting for ", live, ", whose heartbeats still arrive",
        s.deadline_left == absl::InfiniteDuration()
            ? ""
            : absl::StrCat(", for up to ",
                           absl::FormatDuration(absl::Trunc(s.deadline_left, absl::Seconds(1))),
                           " more (the re-joins' --rejoin_timeout)"));
    return d;
  }
  d.action = RejoinAction::kFail;
  d.message = absl::StrCat(
      "job '", s.job_id, "' generation ", s.generation, " cannot be formed: only ", Rejoined(s),
      m > 1 && whole(in) < in
          ? absl::StrCat(", of whom ", whole(in), " make whole shard groups of ", m)
          : "",
      ", and --min_world_size=", s.min_world_size, " needs ", need, groups,
      could == 0 ? "; no other member can come"
                 : absl::StrCat("; the ", could, " that could still come (", live, ") are too few"),
      gone.empty() ? "" : absl::StrCat("; ", gone));
  d.waiting_for.clear();
  return d;
}

}  // namespace zeroshard
