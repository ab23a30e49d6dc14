// The default data-plane address: the local end of the route to the server.
#include "common/local_address.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(LocalAddressTest, ALoopbackServerIsReachedFromLoopback) {
  absl::StatusOr<std::string> local = LocalAddressTowards("127.0.0.1:7070");
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(*local, "127.0.0.1");
}

TEST(LocalAddressTest, ANameIsResolvedPreferringIpv4) {
  absl::StatusOr<std::string> local = LocalAddressTowards("localhost:7070");
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(*local, "127.0.0.1");
}

TEST(LocalAddressTest, AnAddressWithoutAPortIsRefused) {
  absl::StatusOr<std::string> local = LocalAddressTowards("10.0.0.1");
  EXPECT_EQ(local.status().code(), absl::StatusCode::kInvalidArgument) << local.status();
  EXPECT_NE(local.status().message().find("'10.0.0.1' is not HOST:PORT"), std::string::npos);
}

TEST(LocalAddressTest, AnUnresolvableServerSaysWhatToPass) {
  absl::StatusOr<std::string> local = LocalAddressTowards("no-such-host.invalid:7070");
  ASSERT_FALSE(local.ok());
  EXPECT_NE(local.status().message().find("pass --host="), std::string::npos) << local.status();
}

TEST(LocalAddressTest, LoopbackAddresses) {
  EXPECT_TRUE(IsLoopback("127.0.0.1"));
  EXPECT_TRUE(IsLoopback("127.1.2.3"));
  EXPECT_TRUE(IsLoopback("::1"));
  EXPECT_TRUE(IsLoopback("localhost"));
  EXPECT_FALSE(IsLoopback("198.18.0.1"));
  EXPECT_FALSE(IsLoopback("10.127.0.1"));
}

TEST(LocalAddressTest, TheHostIdentityIsTheHostnameAndTheBootId) {
  const std::string identity = HostIdentity();
  ASSERT_FALSE(identity.empty());
  EXPECT_NE(identity.find(' '), std::string::npos) << identity;
}

}  // namespace
}  // namespace zeroshard
