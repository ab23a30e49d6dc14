// A list of servers becomes one gRPC target over all of them.
#include "common/server_list.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(ServerListTest, OneServerIsLeftToGrpc) {
  auto target = GrpcTargetForServers("shard.example:7070");
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_EQ(*target, "shard.example:7070");  // not resolved here: DNS may hold several
}

TEST(ServerListTest, SeveralBecomeOneAddressList) {
  auto target = GrpcTargetForServers("127.0.0.1:7070, localhost:7071,127.0.0.3:7072");
  ASSERT_TRUE(target.ok()) << target.status();
  // localhost resolves to 127.0.0.1 or ::1; both families may not mix.
  if (target->rfind("ipv4:", 0) == 0) {
    EXPECT_EQ(*target, "ipv4:127.0.0.1:7070,127.0.0.1:7071,127.0.0.3:7072");
  }
  auto v6 = GrpcTargetForServers("[::1]:7070,[::1]:7071");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(*v6, "ipv6:[::1]:7070,[::1]:7071");
}

TEST(ServerListTest, BadEntriesAreNamed) {
  auto no_port = GrpcTargetForServers("127.0.0.1:7070,127.0.0.2");
  EXPECT_TRUE(absl::IsInvalidArgument(no_port.status()));
  EXPECT_NE(no_port.status().message().find("'127.0.0.2' is not HOST:PORT"), std::string::npos)
      << no_port.status();
  auto mixed = GrpcTargetForServers("127.0.0.1:7070,[::1]:7071");
  EXPECT_TRUE(absl::IsInvalidArgument(mixed.status()));
  EXPECT_NE(mixed.status().message().find("mix IPv4 and IPv6"), std::string::npos);
  EXPECT_TRUE(absl::IsInvalidArgument(GrpcTargetForServers("").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(GrpcTargetForServers("a:0").status()));
}

TEST(ServerListTest, TheFirstServerOfAList) {
  EXPECT_EQ(FirstServer("a:1"), "a:1");
  EXPECT_EQ(FirstServer(" a:1 ,b:2"), "a:1");
}

}  // namespace
}  // namespace zeroshard
