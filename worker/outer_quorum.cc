#include "worker/outer_quorum.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

std::string Key(int64_t after_step, const char* what) {
  return absl::StrCat("outer_quorum/", after_step, "/", what);
}

uint64_t AllGroups(int groups) { return groups >= 64 ? ~uint64_t{0} : (uint64_t{1} << groups) - 1; }

absl::StatusOr<uint64_t> Parse(const absl::StatusOr<std::string>& decided, const QuorumCall& call) {
  const std::string where = absl::StrCat("the outer quorum after step ", call.after_step);
  if (!decided.ok()) {
    return absl::Status(decided.status().code(),
                        absl::StrCat(where, ": ", decided.status().message()));
  }
  uint64_t mask = 0;
  if (!absl::SimpleAtoi(*decided, &mask) || mask == 0 || (mask & ~AllGroups(call.groups)) != 0) {
    return absl::InternalError(
        absl::StrCat(where, " decided '", *decided, "': not a mask of ", call.groups, " groups"));
  }
  return mask;
}

absl::StatusOr<std::string> Decide(QuorumStore* store, const QuorumCall& call) {
  const std::string arrived_key = Key(call.after_step, "arrived");
  const std::string decision_key = Key(call.after_step, "decision");
  if (call.forget_step > 0) {
    for (const char* what : {"arrived", "decision"}) {
      if (absl::Status s = store->Delete(Key(call.forget_step, what)); !s.ok()) return s;
    }
  }
  const uint64_t all = AllGroups(call.groups);
  absl::StatusOr<int64_t> arrived = store->Add(arrived_key, int64_t{1} << call.group);
  if (!arrived.ok()) return arrived.status();
  if (static_cast<uint64_t>(*arrived) == all) {
    return store->CompareSet(decision_key, "", absl::StrCat(all));
  }
  const bool wait = call.wait_for_all || !call.up_to_date;  // no deciding alone
  absl::StatusOr<std::string> decided = store->Get(decision_key, wait ? call.limit : call.timeout);
  if (decided.ok() || wait || !absl::IsDeadlineExceeded(decided.status())) {
    return decided;
  }
  // Timed out: the groups arrived by now take part, unless another leader
  // decided first (its decision stands).
  arrived = store->Add(arrived_key, 0);
  if (!arrived.ok()) return arrived.status();
  return store->CompareSet(decision_key, "", absl::StrCat(*arrived));
}

}  // namespace

absl::StatusOr<uint64_t> LeadOuterQuorum(QuorumStore* store, const QuorumCall& call) {
  return Parse(Decide(store, call), call);
}

absl::StatusOr<uint64_t> ReadOuterQuorum(QuorumStore* store, const QuorumCall& call) {
  return Parse(store->Get(Key(call.after_step, "decision"), call.limit), call);
}

}  // namespace zeroshard
