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
  EXPECT_NE(local.status().message().find("host 'no-such-host.invalid' does not resolve"),
            std::string::npos)
      << local.status();
  EXPECT_NE(local.status().message().find("check --server=HOST:PORT"), std::string::npos)
      << local.status();
  EXPECT_NE(local.status().message().find("pass --host="), std::string::npos) << local.status();
}

// A port that is not one (what a mistyped --server looks like): said so,
// not blamed on this machine's address.
TEST(LocalAddressTest, AServerPortThatIsNotANumberIsRefused) {
  for (const char* server : {"not-a-host:port::", "10.0.0.1:99999", "10.0.0.1:0", "h:7o70"}) {
    absl::StatusOr<std::string> local = LocalAddressTowards(server);
    EXPECT_EQ(local.status().code(), absl::StatusCode::kInvalidArgument) << server;
    EXPECT_NE(local.status().message().find("is not a port number (1-65535): pass --server="),
              std::string::npos)
        << local.status();
  }
}

TEST(LocalAddressTest, ListenAddressesAreHostAndPortOrUnixPaths) {
  EXPECT_TRUE(CheckListenAddress("listen", "127.0.0.1:0", false).ok());
  EXPECT_TRUE(CheckListenAddress("listen", "0.0.0.0:65535", false).ok());
  EXPECT_TRUE(CheckListenAddress("listen", "[::1]:7070", false).ok());
  EXPECT_TRUE(CheckListenAddress("listen", "unix:/run/zs.sock", true).ok());
  const absl::Status wraps = CheckListenAddress("listen", "127.0.0.1:99999", false);
  EXPECT_EQ(wraps.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wraps.message().find("--listen=127.0.0.1:99999: port '99999' is not a port number; "
                                 "expected HOST:PORT (a port of 0-65535"),
            std::string::npos)
      << wraps;
  const absl::Status no_port = CheckListenAddress("metrics_listen", "garbage", true);
  EXPECT_NE(no_port.message().find("--metrics_listen=garbage has no port: expected HOST:PORT"),
            std::string::npos)
      << no_port;
  EXPECT_NE(no_port.message().find("or unix:PATH"), std::string::npos) << no_port;
  EXPECT_FALSE(CheckListenAddress("listen", "unix:/run/zs.sock", false).ok());
  EXPECT_FALSE(CheckListenAddress("listen", "127.0.0.1:-1", false).ok());
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
