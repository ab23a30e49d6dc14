#include "tests/fuzz/rpc_records.h"

#include <algorithm>
#include <fstream>
#include <utility>
#include <vector>

namespace zeroshard::fuzz {

void ForEachRecord(const uint8_t* data, size_t size, int max_records,
                   const std::function<void(uint8_t, absl::string_view)>& record) {
  size_t at = 0;
  for (int n = 0; n < max_records && at + 3 <= size; ++n) {
    const uint8_t method = data[at];
    const size_t length = std::min<size_t>(data[at + 1] | (data[at + 2] << 8), size - at - 3);
    record(method, absl::string_view(reinterpret_cast<const char*>(data + at + 3), length));
    at += 3 + length;
  }
}

void AddRawRecord(uint8_t method, absl::string_view bytes, std::string* out) {
  out->push_back(static_cast<char>(method));
  out->push_back(static_cast<char>(bytes.size() & 0xff));
  out->push_back(static_cast<char>((bytes.size() >> 8) & 0xff));
  out->append(bytes.data(), std::min<size_t>(bytes.size(), 0xffff));
}

void AddRecord(uint8_t method, const google::protobuf::Message& request, std::string* out) {
  AddRawRecord(method, request.SerializeAsString(), out);
}

bool ParseRequest(absl::string_view bytes, const v1::MemberCredentials& last_join,
                  google::protobuf::Message* request) {
  if (!request->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return false;
  const google::protobuf::FieldDescriptor* field =
      request->GetDescriptor()->FindFieldByName("member");
  if (field == nullptr || field->message_type() != v1::MemberCredentials::descriptor()) {
    return true;
  }
  auto* credentials =
      static_cast<v1::MemberCredentials*>(request->GetReflection()->MutableMessage(request, field));
  if (credentials->token() == "$") *credentials = last_join;
  return true;
}

v1::MemberCredentials LastJoin() {
  v1::MemberCredentials member;
  member.set_token("$");
  return member;
}

std::vector<std::pair<std::string, std::string>> ServerSeeds() {
  std::string life;
  v1::JoinRequest join;
  join.set_job_id("fuzz");
  join.set_world_size(1);
  join.set_worker_id("w0");
  join.set_host("127.0.0.1");
  AddRecord(kJoin, join, &life);
  v1::HeartbeatRequest beat;
  *beat.mutable_member() = LastJoin();
  beat.set_step(3);
  beat.set_loss(1.5);
  AddRecord(kHeartbeat, beat, &life);
  v1::StoreSetRequest set;
  *set.mutable_member() = LastJoin();
  set.set_key("k");
  set.set_value("v");
  AddRecord(kStoreSet, set, &life);
  v1::StoreWaitRequest wait;
  *wait.mutable_member() = LastJoin();
  wait.add_keys("k");
  wait.add_keys("absent");
  wait.set_timeout_ms(5);
  AddRecord(kStoreWait, wait, &life);
  v1::PlanShardsRequest plan;
  *plan.mutable_member() = LastJoin();
  plan.set_world_size(1);
  v1::TensorSpec* t = plan.mutable_spec()->add_tensors();
  t->set_name("0.weight");
  t->add_shape(8);
  t->add_shape(4);
  t->set_dtype("F32");
  AddRecord(kPlanShards, plan, &life);
  v1::CommitShardRequest commit;
  *commit.mutable_member() = LastJoin();
  commit.set_step(1);
  commit.set_file("fuzz/step-1/rank-0-of-1.safetensors");
  commit.set_size_bytes(8);
  AddRecord(kCommitShard, commit, &life);
  v1::LeaveRequest leave;
  *leave.mutable_member() = LastJoin();
  AddRecord(kLeave, leave, &life);

  std::string anonymous;
  v1::GetStatusRequest status;
  AddRecord(kGetStatus, status, &anonymous);
  plan.clear_member();
  plan.set_world_size(4);
  AddRecord(kPlanShards, plan, &anonymous);
  v1::ListCheckpointsRequest list;
  list.set_job_id("fuzz");
  AddRecord(kListCheckpoints, list, &anonymous);
  v1::ConsolidateRequest consolidate;
  AddRecord(kConsolidate, consolidate, &anonymous);

  std::string upload;
  AddRecord(kJoin, join, &upload);
  v1::UploadShardRequest chunk;
  *chunk.mutable_member() = LastJoin();
  chunk.set_step(1);
  chunk.set_file("fuzz/step-1/rank-0-of-1.safetensors");
  chunk.set_size_bytes(8);
  chunk.set_data("abcd");
  AddRecord(kUploadShard, chunk, &upload);
  AddRecord(kCommitShard, commit, &upload);
  return {{"member_life", life}, {"anonymous_calls", anonymous}, {"upload_and_commit", upload}};
}

void WriteSeeds(const std::string& dir,
                const std::vector<std::pair<std::string, std::string>>& seeds) {
  for (const auto& [name, bytes] : seeds) {
    std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
  }
}

}  // namespace zeroshard::fuzz
