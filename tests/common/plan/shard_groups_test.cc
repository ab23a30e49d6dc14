#include "common/plan/shard_groups.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(ShardGroupsTest, PlainShardingIsOneGroupOfEveryRank) {
  for (int g : {0, 4, 8}) {
    const ShardGroups groups(4, g);
    EXPECT_EQ(groups.size(), 4) << g;
    EXPECT_EQ(groups.count(), 1) << g;
    EXPECT_FALSE(groups.hybrid()) << g;
    EXPECT_EQ(groups.NextReplica(2), -1) << g;
  }
}

TEST(ShardGroupsTest, HybridGroupsAreConsecutiveRanksAndReplicasShareAMemberIndex) {
  const ShardGroups groups(6, 2);  // groups {0,1} {2,3} {4,5}
  EXPECT_TRUE(groups.hybrid());
  EXPECT_EQ(groups.count(), 3);
  EXPECT_EQ(groups.GroupOf(3), 1);
  EXPECT_EQ(groups.MemberOf(3), 1);
  EXPECT_EQ(groups.RankOf(2, 1), 5);
  EXPECT_TRUE(groups.SameShard(1, 5));
  EXPECT_FALSE(groups.SameShard(1, 4));
  EXPECT_EQ(groups.NextReplica(1), 3);
  EXPECT_EQ(groups.NextReplica(5), 1);  // cyclic
}

TEST(ShardGroupsTest, SecondaryGroupsStartAtMultiplesOfH) {
  const ShardGroups groups(8, 4, 2);
  EXPECT_EQ(groups.secondary(), 2);
  EXPECT_EQ(groups.SecondaryBase(5), 4);
  EXPECT_EQ(groups.SecondaryBase(7), 6);
}

TEST(ShardGroupsTest, MakeRefusesSizesThatDoNotFitNamingTheFlag) {
  EXPECT_TRUE(ShardGroups::Make(8, 4, 2).ok());
  EXPECT_TRUE(ShardGroups::Make(8, 0, 4).ok());
  const absl::StatusOr<ShardGroups> uneven = ShardGroups::Make(6, 4, 0);
  ASSERT_FALSE(uneven.ok());
  EXPECT_NE(uneven.status().message().find("shard_group_size 4 does not divide the world size 6"),
            std::string::npos)
      << uneven.status();
  const absl::StatusOr<ShardGroups> big = ShardGroups::Make(8, 2, 2);  // H must be < G
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("smaller than the shard groups of 2 ranks"),
            std::string::npos)
      << big.status();
  EXPECT_FALSE(ShardGroups::Make(8, 4, 3).ok());  // 3 does not divide 8
  EXPECT_FALSE(ShardGroups::Make(0, 0, 0).ok());
}

}  // namespace
}  // namespace zeroshard
