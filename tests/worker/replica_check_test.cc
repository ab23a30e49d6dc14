// Which replica sets disagree, and how the line names them.
#include "worker/replica_check.h"

#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(FindReplicaMismatchesTest, ComparesRanksOfTheSameMemberOnly) {
  // W = 4, G = 2: member 0 is ranks 0 and 2, member 1 ranks 1 and 3. The
  // members' shards differ from each other, as they should.
  EXPECT_TRUE(FindReplicaMismatches({10, 20, 10, 20}, 2).empty());
  const std::vector<ReplicaMismatch> m = FindReplicaMismatches({10, 20, 10, 21}, 2);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].member, 1);
  EXPECT_EQ(m[0].ranks, (std::vector<int>{1, 3}));
  EXPECT_EQ(m[0].checksums, (std::vector<uint64_t>{20, 21}));
}

TEST(DescribeReplicaMismatchTest, NamesTheMinorityWhenThereIsOne) {
  // Three replicas (W = 3, G = 1): rank 2 alone differs.
  const std::vector<ReplicaMismatch> m = FindReplicaMismatches({7, 7, 8}, 1);
  ASSERT_EQ(m.size(), 1u);
  const std::string line = DescribeReplicaMismatch(m[0], 15, 20, {"a", "b", "c"});
  EXPECT_NE(line.find("after step 15/20: the replicas of shard member 0 differ (rank 0 (host a) "
                      "XXH3 0000000000000007"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("silent data corruption on rank(s) 2 (the minority)"), std::string::npos)
      << line;
  const std::string two = DescribeReplicaMismatch(FindReplicaMismatches({1, 2}, 1)[0], 5, 20, {});
  EXPECT_NE(two.find("one of them (two replicas cannot say which)"), std::string::npos) << two;
}

}  // namespace
}  // namespace zeroshard
