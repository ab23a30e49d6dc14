// When a server or client refuses an unprotected setup: a token over
// plaintext off loopback, and a server off loopback that authenticates no one.
#include "common/secret_file.h"

#include <string>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(CheckListenAuthenticatedTest, LoopbackNeedsNoAuthentication) {
  for (const char* address : {"127.0.0.1:7070", "127.0.0.1:0", "[::1]:7070", "localhost:7070"}) {
    EXPECT_TRUE(CheckListenAuthenticated(address, false, false).ok()) << address;
  }
}

TEST(CheckListenAuthenticatedTest, OffLoopbackWithoutAuthenticationIsRefusedSayingWhatToDo) {
  for (const char* address :
       {"0.0.0.0:7070", "[::]:7070", ":7070", "10.0.0.1:7070", "198.18.0.1:7070", "host:7070"}) {
    absl::Status s = CheckListenAuthenticated(address, false, false);
    ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << address;
    const std::string message(s.message());
    EXPECT_NE(message.find(std::string("--listen=") + address), std::string::npos) << message;
    for (const char* way : {"--auth_token_file", "--tls_client_ca", "127.0.0.1", "--insecure"}) {
      EXPECT_NE(message.find(way), std::string::npos) << way << ": " << message;
    }
  }
}

TEST(CheckListenAuthenticatedTest, AuthenticationOrInsecureLetsItServe) {
  EXPECT_TRUE(CheckListenAuthenticated("0.0.0.0:7070", /*authenticated=*/true, false).ok());
  EXPECT_TRUE(CheckListenAuthenticated("0.0.0.0:7070", false, /*insecure=*/true).ok());
}

TEST(CheckTokenTransportTest, ATokenOverPlaintextIsRefusedOffLoopbackOnly) {
  EXPECT_TRUE(CheckTokenTransport(true, false, "127.0.0.1:7070", false, "--tls_cert").ok());
  EXPECT_TRUE(CheckTokenTransport(true, true, "0.0.0.0:7070", false, "--tls_cert").ok());
  EXPECT_TRUE(CheckTokenTransport(false, false, "0.0.0.0:7070", false, "--tls_cert").ok());
  EXPECT_TRUE(CheckTokenTransport(true, false, "0.0.0.0:7070", true, "--tls_cert").ok());
  EXPECT_EQ(CheckTokenTransport(true, false, "0.0.0.0:7070", false, "--tls_cert").code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard
