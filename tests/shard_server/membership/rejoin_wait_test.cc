// The rules a recovery past its --rejoin_grace follows
// (shard_server/membership/rejoin_wait.h), one case a row: job "j",
// generation 2, W = 4, grace 1 s.
#include "shard_server/membership/rejoin_wait.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

struct Case {
  std::string name;
  int min_world_size;
  bool grace_over;
  std::vector<std::string> rejoined;
  std::vector<MissingMember> missing;
  RejoinAction want;
  std::vector<std::string> want_waiting_for;
  // Each must appear in the decision's message.
  std::vector<std::string> want_in_message;
};

const MissingMember kLive2{"w2", 2, /*live=*/true, /*left=*/false};
const MissingMember kLive1{"w1", 1, true, false};
const MissingMember kDead3{"w3", 3, false, false};
const MissingMember kLeft2{"w2", 2, false, true};
const MissingMember kDead2{"w2", 2, false, false};

TEST(RejoinWaitTest, EachRuleDecidesItsCase) {
  const std::vector<Case> cases = {
      {"grace not over: wait for everyone",
       3,
       false,
       {"w0"},
       {kLive1, kLive2, kDead3},
       RejoinAction::kWaitForAll,
       {},
       {}},
      {"never shrinks (--min_world_size=0)",
       0,
       true,
       {"w0", "w1"},
       {kLive2, kDead3},
       RejoinAction::kWaitForAll,
       {},
       {}},
      {"every member is in", 3, false, {"w0", "w1", "w2", "w3"}, {}, RejoinAction::kForm, {}, {}},
      {"the minimum re-joined: form, though a live one is on its way",
       3,
       true,
       {"w0", "w1", "w3"},
       {kLive2},
       RejoinAction::kForm,
       {},
       {}},
      {"one short, a live survivor on its way: wait for it",
       3,
       true,
       {"w0", "w1"},
       {kLive2, kDead3},
       RejoinAction::kWaitForLive,
       {"w2"},
       {"job 'j' generation 2: 2 of 4 workers re-joined ('w0', 'w1') after --rejoin_grace=1s",
        "--min_world_size=3 needs 1 more: waiting for 'w2' (rank 2), whose heartbeats still "
        "arrive, for up to 58s more (the re-joins' --rejoin_timeout)"}},
      {"two short, two live: wait for both",
       3,
       true,
       {"w0"},
       {kLive1, kLive2, kDead3},
       RejoinAction::kWaitForLive,
       {"w1", "w2"},
       {"waiting for 'w1' (rank 1), 'w2' (rank 2)"}},
      {"one short, the missing survivor left: fail",
       3,
       true,
       {"w0", "w1"},
       {kLeft2, kDead3},
       RejoinAction::kFail,
       {},
       {"job 'j' generation 2 cannot be formed: only 2 of 4 workers re-joined ('w0', 'w1') "
        "after --rejoin_grace=1s, and --min_world_size=3 needs 3; no other member can come; "
        "'w2' (rank 2) left, 'w3' (rank 3) was declared dead"}},
      {"one short, the awaited survivor was declared dead: fail",
       3,
       true,
       {"w0", "w1"},
       {kDead2, kDead3},
       RejoinAction::kFail,
       {},
       {"'w2' (rank 2) was declared dead"}},
      {"two short, one live: too few could come, fail naming them",
       4,
       true,
       {"w0", "w1"},
       {kLive2, kDead3},
       RejoinAction::kFail,
       {},
       {"only 2 of 4 workers re-joined",
        "the 1 that could still come ('w2' (rank 2)) are too few; 'w3' (rank 3) was declared "
        "dead"}},
      {"nobody re-joined yet, enough live: wait",
       2,
       true,
       {},
       {kLive1, kLive2, kDead3},
       RejoinAction::kWaitForLive,
       {"w1", "w2"},
       {"0 of 4 workers re-joined after"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RejoinState s;
    s.job_id = "j";
    s.generation = 2;
    s.world_size = 4;
    s.min_world_size = c.min_world_size;
    s.rejoin_grace = absl::Seconds(1);
    s.grace_over = c.grace_over;
    s.rejoined = c.rejoined;
    s.missing = c.missing;
    s.deadline_left = absl::Milliseconds(58700);
    const RejoinDecision d = DecideRejoin(s);
    EXPECT_EQ(static_cast<int>(d.action), static_cast<int>(c.want));
    EXPECT_EQ(d.waiting_for, c.want_waiting_for);
    for (const std::string& part : c.want_in_message) {
      EXPECT_NE(d.message.find(part), std::string::npos) << d.message << "\nlacks: " << part;
    }
    if (c.want == RejoinAction::kForm || c.want == RejoinAction::kWaitForAll) {
      EXPECT_EQ(d.message, "");
    }
  }
}

TEST(RejoinWaitTest, WithoutAWaitingJoinTheMessageNamesNoDeadline) {
  RejoinState s;
  s.job_id = "j";
  s.generation = 2;
  s.world_size = 3;
  s.min_world_size = 2;
  s.rejoin_grace = absl::Seconds(5);
  s.grace_over = true;
  s.missing = {kLive1, kLive2};
  const RejoinDecision d = DecideRejoin(s);
  ASSERT_EQ(d.action, RejoinAction::kWaitForLive);
  EXPECT_EQ(d.message,
            "job 'j' generation 2: 0 of 3 workers re-joined after --rejoin_grace=5s; "
            "--min_world_size=2 needs 2 more: waiting for 'w1' (rank 1), 'w2' (rank 2), whose "
            "heartbeats still arrive");
}

// Whole shard groups of 2 (world_multiple): the re-joined count in whole
// groups, and --min_world_size rounds up to one.
TEST(RejoinWaitTest, InShardGroupsTheRejoinedCountInWholeGroups) {
  RejoinState s;
  s.job_id = "j";
  s.generation = 2;
  s.world_size = 4;
  s.world_multiple = 2;
  s.rejoin_grace = absl::Seconds(1);
  s.grace_over = true;
  s.rejoined = {"w0", "w1", "w2"};
  s.missing = {kDead3};
  s.min_world_size = 2;  // 3 in: one whole group of 2 forms, one waits aside
  RejoinDecision d = DecideRejoin(s);
  EXPECT_EQ(d.action, RejoinAction::kForm);
  EXPECT_EQ(d.form_size, 2);
  s.grace_over = false;  // within the grace: everyone is waited for
  EXPECT_EQ(DecideRejoin(s).action, RejoinAction::kWaitForAll);
  s.grace_over = true;
  s.min_world_size = 3;  // needs 4: w3 is dead
  d = DecideRejoin(s);
  EXPECT_EQ(d.action, RejoinAction::kFail);
  EXPECT_NE(d.message.find("of whom 2 make whole shard groups of 2, and --min_world_size=3 needs "
                           "4 (whole shard groups of 2); no other member can come"),
            std::string::npos)
      << d.message;
  s.missing = {{"w3", 3, /*live=*/true, /*left=*/false}};  // w3 can still come
  d = DecideRejoin(s);
  EXPECT_EQ(d.action, RejoinAction::kWaitForLive);
  EXPECT_NE(d.message.find("--min_world_size=3 (whole shard groups of 2) needs 1 more: waiting "
                           "for 'w3' (rank 3)"),
            std::string::npos)
      << d.message;
  // Everyone in, but as part of a group (growers widened the generation to
  // 3): not formed until the grace is over, then with the whole groups.
  s.world_size = 3;
  s.missing.clear();
  s.min_world_size = 2;
  s.grace_over = false;
  EXPECT_EQ(DecideRejoin(s).action, RejoinAction::kWaitForAll);
  s.grace_over = true;
  d = DecideRejoin(s);
  EXPECT_EQ(d.action, RejoinAction::kForm);
  EXPECT_EQ(d.form_size, 2);
}

}  // namespace
}  // namespace zeroshard
