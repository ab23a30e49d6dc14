#include "shard_server/membership/silence_order.h"

#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

// The ranks from the oldest beat to the newest.
std::vector<int> Walk(const SilenceOrder& order) {
  std::vector<int> ranks;
  for (int r = order.Oldest(); r != -1; r = order.Next(r)) ranks.push_back(r);
  return ranks;
}

TEST(SilenceOrderTest, StartsEmpty) {
  SilenceOrder order;
  order.Reset(4);
  EXPECT_EQ(order.size(), 0);
  EXPECT_EQ(order.Oldest(), -1);
  EXPECT_EQ(order.Newest(), -1);
  EXPECT_FALSE(order.Contains(0));
  EXPECT_FALSE(order.Contains(7));
}

TEST(SilenceOrderTest, ABeatMovesItsMemberToTheBack) {
  SilenceOrder order;
  order.Reset(4);
  for (int r : {0, 1, 2, 3}) order.MoveToBack(r);
  EXPECT_EQ(Walk(order), (std::vector<int>{0, 1, 2, 3}));
  order.MoveToBack(0);  // the front
  EXPECT_EQ(Walk(order), (std::vector<int>{1, 2, 3, 0}));
  order.MoveToBack(2);  // the middle
  EXPECT_EQ(Walk(order), (std::vector<int>{1, 3, 0, 2}));
  order.MoveToBack(2);  // already the back
  EXPECT_EQ(Walk(order), (std::vector<int>{1, 3, 0, 2}));
  EXPECT_EQ(order.size(), 4);
  EXPECT_EQ(order.Oldest(), 1);
  EXPECT_EQ(order.Newest(), 2);
}

TEST(SilenceOrderTest, RemoveUnlinksFromAnyPlaceAndIgnoresTheUnlinked) {
  SilenceOrder order;
  order.Reset(5);
  for (int r : {4, 3, 2, 1, 0}) order.MoveToBack(r);
  order.Remove(2);  // middle
  order.Remove(4);  // front
  order.Remove(0);  // back
  order.Remove(0);  // again: nothing
  EXPECT_EQ(Walk(order), (std::vector<int>{3, 1}));
  EXPECT_EQ(order.size(), 2);
  EXPECT_EQ(order.Newest(), 1);
  order.MoveToBack(4);  // linked again, at the back
  EXPECT_EQ(Walk(order), (std::vector<int>{3, 1, 4}));
  order.Remove(3);
  order.Remove(1);
  order.Remove(4);
  EXPECT_EQ(order.size(), 0);
  EXPECT_EQ(order.Oldest(), -1);
  EXPECT_EQ(order.Newest(), -1);
}

TEST(SilenceOrderTest, ResetForgetsEveryone) {
  SilenceOrder order;
  order.Reset(3);
  for (int r : {0, 1, 2}) order.MoveToBack(r);
  order.Reset(2);
  EXPECT_EQ(order.size(), 0);
  EXPECT_FALSE(order.Contains(1));
  order.MoveToBack(1);
  EXPECT_EQ(Walk(order), (std::vector<int>{1}));
}

}  // namespace
}  // namespace zeroshard
