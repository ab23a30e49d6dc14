// RequestBudget (common/request_budget.h): its bound on a parsed request is
// never under what protobuf holds for the KV requests taken as bytes
// (SpaceUsedLong), whatever their keys' and values' sizes; holds add up
// and go back; a request beyond the bound is refused naming it.
#include "common/request_budget.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "gtest/gtest.h"
#include "proto/zeroshard.pb.h"

namespace zeroshard {
namespace {

grpc::ByteBuffer Wire(const google::protobuf::Message& message) {
  grpc::ByteBuffer buffer;
  bool own = false;
  EXPECT_TRUE((grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(
                   message, &buffer, &own))
                  .ok());
  return buffer;
}

v1::MemberCredentials Member() {
  v1::MemberCredentials member;
  member.set_job_id("job");
  member.set_generation(3);
  member.set_rank(1);
  member.set_token(std::string(64, 't'));
  return member;
}

TEST(RequestBudgetTest, TheParsedBoundIsNeverUnderWhatProtobufHolds) {
  for (int keys : {0, 1, 17, 1000, 65536}) {
    for (int key_bytes : {1, 15, 16, 24, 200, 1024}) {
      v1::StoreWaitRequest wait;
      *wait.mutable_member() = Member();
      wait.set_timeout_ms(1000);
      for (int k = 0; k < keys; ++k) {
        std::string key = absl::StrCat(k, "/");
        key.resize(key_bytes, 'k');
        wait.add_keys(key);
      }
      v1::StoreWaitRequest parsed;
      ASSERT_TRUE(parsed.ParseFromString(wait.SerializeAsString()));
      absl::StatusOr<size_t> bound = RequestBudget::ParsedBytes(Wire(wait));
      ASSERT_TRUE(bound.ok()) << bound.status();
      EXPECT_GE(*bound, parsed.SpaceUsedLong()) << keys << " keys of " << key_bytes << " bytes";
      // Not far over either: within 2x and a few kB for the message.
      EXPECT_LE(*bound, 2 * parsed.SpaceUsedLong() + 4096) << keys << " keys of " << key_bytes;
    }
  }
  for (size_t value_bytes : {size_t{0}, size_t{15}, size_t{100}, size_t{4} << 20}) {
    v1::StoreSetRequest set;
    *set.mutable_member() = Member();
    set.set_key("k");
    set.set_value(std::string(value_bytes, 'v'));
    v1::StoreSetRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(set.SerializeAsString()));
    absl::StatusOr<size_t> bound = RequestBudget::ParsedBytes(Wire(set));
    ASSERT_TRUE(bound.ok()) << bound.status();
    EXPECT_GE(*bound, parsed.SpaceUsedLong()) << value_bytes;
  }
}

TEST(RequestBudgetTest, BytesThatAreNotAMessageAreRefused) {
  const char cut[] = {0x12, 0x7f, 'a'};  // field 2, 127 bytes announced, 1 there
  grpc::Slice slice(cut, sizeof(cut));
  grpc::ByteBuffer wire(&slice, 1);
  absl::StatusOr<size_t> bound = RequestBudget::ParsedBytes(wire);
  EXPECT_EQ(bound.status().code(), absl::StatusCode::kInvalidArgument) << bound.status();
}

TEST(RequestBudgetTest, HoldsAddUpGoBackAndTheBoundIsNamed) {
  RequestBudget budget(1000, "the server's --max_request_bytes_in_flight");
  absl::StatusOr<std::unique_ptr<RequestBudget::Hold>> a = budget.Take(600, "StoreWait");
  ASSERT_TRUE(a.ok());
  absl::StatusOr<std::unique_ptr<RequestBudget::Hold>> b = budget.Take(500, "StoreSet");
  ASSERT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(b.status().message(), "a StoreSet of 500 bytes")) << b.status();
  EXPECT_TRUE(absl::StrContains(b.status().message(), "--max_request_bytes_in_flight"))
      << b.status();
  EXPECT_TRUE(absl::StrContains(b.status().message(), "at most 1000")) << b.status();
  EXPECT_EQ(budget.in_use(), 600u);
  a->reset();
  EXPECT_EQ(budget.in_use(), 0u);
  absl::StatusOr<std::unique_ptr<RequestBudget::Hold>> c = budget.Take(1000, "StoreCheck");
  EXPECT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(budget.peak(), 1000u);
}

}  // namespace
}  // namespace zeroshard
