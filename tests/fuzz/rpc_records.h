// The input format the server fuzzers share: up to a bound of records
// [method byte][size: u16 little-endian][size bytes: a serialized request],
// where a request whose MemberCredentials token is "$" gets the credentials
// of the last successful Join (so beats, the KV store and checkpoints of a
// live member are reached), and the seeds written in it.
#ifndef ZEROSHARD_TESTS_FUZZ_RPC_RECORDS_H_
#define ZEROSHARD_TESTS_FUZZ_RPC_RECORDS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"
#include "proto/zeroshard.pb.h"

namespace zeroshard::fuzz {

// The zeroshard.v1.Coordinator methods by their method byte (byte % the
// fuzzer's count of operations). Bytes beyond are the fuzzer's own.
enum Method : uint8_t {
  kJoin = 0,
  kHeartbeat = 1,
  kLeave = 2,
  kStoreSet = 3,
  kStoreGet = 4,
  kStoreAdd = 5,
  kStoreWait = 6,
  kStoreCompareSet = 7,
  kStoreDelete = 8,
  kStoreCheck = 9,
  kStoreNumKeys = 10,
  kGetStatus = 11,
  kPlanShards = 12,
  kCommitShard = 13,
  kUploadShard = 14,
  kListCheckpoints = 15,
  kConsolidate = 16,
  kGetHistory = 17,
  kRpcMethods = 18,  // the count
};

// Calls `record(method, bytes)` for each record of `data`, at most
// `max_records`; a record cut short by the input's end keeps what is there.
void ForEachRecord(const uint8_t* data, size_t size, int max_records,
                   const std::function<void(uint8_t, absl::string_view)>& record);

// Appends one record.
void AddRecord(uint8_t method, const google::protobuf::Message& request, std::string* out);
void AddRawRecord(uint8_t method, absl::string_view bytes, std::string* out);

// Parses `bytes` into `request`; false when they are not one. A "$" token in
// its `member` field becomes `last_join`.
bool ParseRequest(absl::string_view bytes, const v1::MemberCredentials& last_join,
                  google::protobuf::Message* request);

// Credentials whose token is "$": the last join's.
v1::MemberCredentials LastJoin();

// The seeds both server fuzzers start from, by name: a member's life (join,
// beat, KV, plan, commit, leave), the calls that need no member, and an
// upload followed by its commit.
std::vector<std::pair<std::string, std::string>> ServerSeeds();
// Writes ServerSeeds() (and `more`) into `dir`, one file each.
void WriteSeeds(const std::string& dir,
                const std::vector<std::pair<std::string, std::string>>& seeds);

}  // namespace zeroshard::fuzz

#endif  // ZEROSHARD_TESTS_FUZZ_RPC_RECORDS_H_
