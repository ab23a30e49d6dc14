// Which worker ids a client certificate's identities may join as, and the
// map file's format.
#include "shard_server/auth/worker_id_binding.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(WorkerIdBindingTest, AnIdentityJoinsAsWorkerIdsOfItsOwnHostPart) {
  absl::StatusOr<WorkerIdBinding> binding = WorkerIdBinding::Parse("");
  ASSERT_TRUE(binding.ok()) << binding.status();
  EXPECT_TRUE(binding->Check({"node-a.example", "Node-7"}, "node-7/3").ok());
  EXPECT_TRUE(binding->Check({"node-7"}, "node-7").ok());  // an id without '/' is its host part
  EXPECT_TRUE(binding->Check({"NODE-7"}, "node-7/0").ok());  // DNS names ignore case
  absl::Status other = binding->Check({"node-7"}, "node-8/0");
  EXPECT_TRUE(absl::IsPermissionDenied(other)) << other;
  EXPECT_TRUE(absl::StrContains(other.message(), "'node-8/0'")) << other;
  EXPECT_TRUE(absl::StrContains(other.message(), "node-7")) << other;
  // A prefix is not a host part.
  EXPECT_TRUE(absl::IsPermissionDenied(binding->Check({"node-7"}, "node-70/0")));
  absl::Status anonymous = binding->Check({}, "node-7/0");
  EXPECT_TRUE(absl::IsPermissionDenied(anonymous)) << anonymous;
  EXPECT_TRUE(absl::StrContains(anonymous.message(), "carried none")) << anonymous;
}

TEST(WorkerIdBindingTest, TheMapPairsIdentitiesWithOtherHostParts) {
  absl::StatusOr<WorkerIdBinding> binding = WorkerIdBinding::Parse(
      "# gateways\n"
      "gw-1   node-1\n"
      "\tlauncher *  # joins for every host\n");
  ASSERT_TRUE(binding.ok()) << binding.status();
  EXPECT_TRUE(binding->Check({"gw-1"}, "node-1/0").ok());
  EXPECT_TRUE(absl::IsPermissionDenied(binding->Check({"gw-1"}, "node-2/0")));
  EXPECT_TRUE(binding->Check({"launcher"}, "anything/5").ok());
}

TEST(WorkerIdBindingTest, AMapLineThatIsNotTwoFieldsIsRefusedByNumber) {
  absl::StatusOr<WorkerIdBinding> binding = WorkerIdBinding::Parse("gw-1 node-1\ngw-2\n");
  EXPECT_TRUE(absl::IsInvalidArgument(binding.status())) << binding.status();
  EXPECT_TRUE(absl::StrContains(binding.status().message(), "line 2 'gw-2'")) << binding.status();
}

}  // namespace
}  // namespace zeroshard
