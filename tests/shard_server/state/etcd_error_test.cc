// EtcdError: every way etcd can fail a call becomes a status naming the cause
// and what to do; the ones that mean "no quorum" say so.
#include "gtest/gtest.h"
#include "shard_server/state/etcd_state.h"

namespace zeroshard {
namespace {

constexpr char kEndpoints[] = "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379";
constexpr char kQuorumHint[] = "is a quorum of etcd members up?";

TEST(EtcdErrorTest, EveryCallWithoutAnAnswerAsksWhetherAQuorumIsUp) {
  for (grpc::StatusCode code : {grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::DEADLINE_EXCEEDED,
                                grpc::StatusCode::CANCELLED}) {
    const absl::Status s = EtcdError(kEndpoints, "renew the lease", grpc::Status(code, "x"));
    EXPECT_TRUE(absl::IsUnavailable(s)) << s;
    EXPECT_NE(s.message().find(kQuorumHint), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find("renew the lease"), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find(kEndpoints), absl::string_view::npos) << s;
  }
}

TEST(EtcdErrorTest, EtcdWithoutALeaderSaysSo) {
  const absl::Status s = EtcdError(kEndpoints, "put a key",
                                   grpc::Status(grpc::StatusCode::UNKNOWN, "etcdserver: no leader"));
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find(kQuorumHint), absl::string_view::npos) << s;
}

TEST(EtcdErrorTest, ARequestTooLargeNamesTheFlagToLower) {
  const absl::Status s = EtcdError(
      kEndpoints, "commit rows",
      grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "etcdserver: request is too large"));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("--etcd_max_txn_bytes"), absl::string_view::npos) << s;
}

TEST(EtcdErrorTest, AnotherErrorKeepsWhatFailed) {
  const absl::Status s = EtcdError(
      kEndpoints, "read the rows", grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "denied"));
  EXPECT_NE(s.message().find("read the rows"), absl::string_view::npos) << s;
  EXPECT_EQ(s.message().find(kQuorumHint), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace zeroshard
