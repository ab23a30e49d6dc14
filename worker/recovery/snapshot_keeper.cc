#include "worker/recovery/snapshot_keeper.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/checkpoint_format.h"
#include "common/checksum.h"

namespace zeroshard {
namespace {

// Tags of the buddy swap on the snapshot context.
constexpr uint32_t kHeaderTag = 1;
constexpr uint32_t kBlobTag = 2;

int Mod(int a, int b) { return ((a % b) + b) % b; }

}  // namespace

nlohmann::json SnapshotBlob::Describe() const {
  nlohmann::json pieces_json = nlohmann::json::array();
  for (const RowRange& p : pieces) pieces_json.push_back({p.tensor, p.row_begin, p.row_end});
  return {{"step", step},
          {"rank", rank},
          {"world_size", world_size},
          {"plan_hash", plan_hash},
          {"data_row", data_row},
          {"bytes", static_cast<int64_t>(bytes.size())},
          {"xxh64", ChecksumToHex(xxh64)},
          {"pieces", pieces_json}};
}

int BuddyShift(const std::vector<std::string>& hosts) {
  const int w = static_cast<int>(hosts.size());
  for (int k = 1; k < w; ++k) {
    bool apart = true;
    for (int r = 0; r < w && apart; ++r) apart = hosts[(r + k) % w] != hosts[r];
    if (apart) return k;
  }
  return 1;
}

absl::StatusOr<std::shared_ptr<SnapshotBlob>> BlobFromBytes(std::string bytes, uint64_t xxh64) {
  if (Checksum(bytes) != xxh64) {
    return absl::DataLossError(absl::StrCat("snapshot blob of ", bytes.size(), " bytes: XXH64 ",
                                            ChecksumToHex(Checksum(bytes)), ", expected ",
                                            ChecksumToHex(xxh64)));
  }
  uint64_t header_size = 0;
  if (bytes.size() < 8) return absl::DataLossError("snapshot blob shorter than 8 bytes");
  std::memcpy(&header_size, bytes.data(), 8);  // little-endian hosts only, as the writer
  if (header_size > bytes.size() - 8) return absl::DataLossError("snapshot blob header too long");
  nlohmann::json header =
      nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + header_size, nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::DataLossError("snapshot blob header is not JSON");
  }
  auto blob = std::make_shared<SnapshotBlob>();
  const nlohmann::json meta = header.value("__metadata__", nlohmann::json::object());
  auto number = [&](const char* key, int64_t* out) {
    return meta.contains(key) && meta[key].is_string() &&
           absl::SimpleAtoi(meta[key].get<std::string>(), out);
  };
  int64_t rank = 0, world = 0;
  if (!number(ShardMetadataKey::kStep, &blob->step) || !number(ShardMetadataKey::kRank, &rank) ||
      !number(ShardMetadataKey::kWorldSize, &world) ||
      !number(ShardMetadataKey::kDataRow, &blob->data_row)) {
    return absl::DataLossError("snapshot blob metadata lacks step, rank, world_size or data_row");
  }
  blob->rank = static_cast<int>(rank);
  blob->world_size = static_cast<int>(world);
  blob->plan_hash = meta.value(ShardMetadataKey::kPlanHash, "");
  for (auto it = header.begin(); it != header.end(); ++it) {
    ParsedShardTensorName parsed;
    if (it.key() == "__metadata__" || !ParseShardTensorName(it.key(), &parsed)) continue;
    if (parsed.kind != ShardTensorKind::kParams) continue;
    blob->pieces.push_back({parsed.tensor, parsed.row_begin, parsed.row_end});
  }
  blob->bytes = std::move(bytes);
  blob->xxh64 = xxh64;
  return blob;
}

SnapshotKeeper::~SnapshotKeeper() { thread_.reset(); }

void SnapshotKeeper::AddLocked(std::shared_ptr<const SnapshotBlob> blob) {
  auto [it, inserted] = blobs_.emplace(KeyOf(*blob), blob);
  if (!inserted) {
    bytes_ -= static_cast<int64_t>(it->second->bytes.size());
    it->second = blob;
  }
  bytes_ += static_cast<int64_t>(blob->bytes.size());
  peak_bytes_ = std::max(peak_bytes_, bytes_);
}

void SnapshotKeeper::Start(ShardSnapshot snapshot, GlooCommunicator* comm, int shift,
                           absl::Duration timeout) {
  auto shared = std::make_shared<ShardSnapshot>(std::move(snapshot));
  thread_->Submit([this, shared, comm, shift, timeout]() mutable -> absl::Status {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::string> bytes = SerializeShard(*shared);
    if (!bytes.ok()) return bytes.status();
    const uint64_t sum = Checksum(*bytes);
    absl::StatusOr<std::shared_ptr<SnapshotBlob>> own = BlobFromBytes(*std::move(bytes), sum);
    if (!own.ok()) return own.status();
    const int64_t step = (*own)->step;
    shared.reset();  // the copies: gone once serialized
    {
      absl::MutexLock lock(&mu_);
      AddLocked(*own);
      complete_[step] = comm == nullptr || comm->world_size() == 1 ? 2 : 1;
    }
    if (comm == nullptr || comm->world_size() == 1) return absl::OkStatus();
    const int w = comm->world_size();
    const int to = Mod(comm->rank() + shift, w);
    const int from = Mod(comm->rank() - shift, w);
    // Sizes and checksums first, then the blobs.
    uint64_t send_header[2] = {(*own)->bytes.size(), sum};
    uint64_t recv_header[2] = {0, 0};
    absl::Status s =
        comm->SendRecv({{to, kHeaderTag, send_header, sizeof(send_header)}},
                       {{from, kHeaderTag, recv_header, sizeof(recv_header)}}, timeout);
    if (!s.ok()) return s;
    // Tests only: stretch the transfer so that a kill lands inside it.
    if (const char* delay = std::getenv("ZEROSHARD_TEST_SNAPSHOT_DELAY_MS")) {
      absl::SleepFor(absl::Milliseconds(std::atoi(delay)));
    }
    std::string received(recv_header[0], '\0');
    s = comm->SendRecv({{to, kBlobTag, const_cast<char*>((*own)->bytes.data()),
                         static_cast<int64_t>((*own)->bytes.size())}},
                       {{from, kBlobTag, received.data(), static_cast<int64_t>(received.size())}},
                       timeout);
    if (!s.ok()) return s;
    absl::StatusOr<std::shared_ptr<SnapshotBlob>> theirs =
        BlobFromBytes(std::move(received), recv_header[1]);
    if (!theirs.ok()) {
      return absl::DataLossError(absl::StrCat("snapshot of step ", step, " from rank ", from, ": ",
                                              theirs.status().message()));
    }
    if ((*theirs)->step != step) {
      return absl::DataLossError(absl::StrCat("snapshot from rank ", from, " is of step ",
                                              (*theirs)->step, ", expected ", step));
    }
    absl::MutexLock lock(&mu_);
    AddLocked(*theirs);
    complete_[step] = 2;
    last_transfer_ms_ = absl::ToDoubleMilliseconds(absl::Now() - start);
    return absl::OkStatus();
  });
}

absl::Status SnapshotKeeper::Wait() {
  absl::Status s = thread_->Drain();
  if (!s.ok()) {
    // A failed task sticks in a TaskThread; the next generation needs a
    // fresh one.
    thread_ = std::make_unique<TaskThread>("snapshot");
  }
  return s;
}

int64_t SnapshotKeeper::complete_step() const {
  absl::MutexLock lock(&mu_);
  for (auto it = complete_.rbegin(); it != complete_.rend(); ++it) {
    if (it->second == 2) return it->first;
  }
  return -1;
}

void SnapshotKeeper::Commit(int64_t step) {
  absl::MutexLock lock(&mu_);
  if (step < 0) return;
  committed_ = std::max(committed_, step);
  for (auto it = blobs_.begin(); it != blobs_.end();) {
    if (std::get<0>(it->first) < committed_) {
      bytes_ -= static_cast<int64_t>(it->second->bytes.size());
      it = blobs_.erase(it);
    } else {
      ++it;
    }
  }
  complete_.erase(complete_.begin(), complete_.lower_bound(committed_));
}

int64_t SnapshotKeeper::committed_step() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

std::vector<std::shared_ptr<const SnapshotBlob>> SnapshotKeeper::Holdings() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const SnapshotBlob>> out;
  for (const auto& [key, blob] : blobs_) out.push_back(blob);
  return out;
}

void SnapshotKeeper::Keep(std::shared_ptr<const SnapshotBlob> blob) {
  absl::MutexLock lock(&mu_);
  AddLocked(std::move(blob));
}

void SnapshotKeeper::DropOtherPlans(int world_size, const std::string& plan_hash) {
  absl::MutexLock lock(&mu_);
  bool dropped = false;
  for (auto it = blobs_.begin(); it != blobs_.end();) {
    if (std::get<2>(it->first) != world_size || std::get<3>(it->first) != plan_hash) {
      bytes_ -= static_cast<int64_t>(it->second->bytes.size());
      it = blobs_.erase(it);
      dropped = true;
    } else {
      ++it;
    }
  }
  if (dropped) {
    complete_.clear();
    committed_ = -1;
  }
}

int64_t SnapshotKeeper::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

int64_t SnapshotKeeper::peak_bytes() const {
  absl::MutexLock lock(&mu_);
  return peak_bytes_;
}

double SnapshotKeeper::last_transfer_ms() const {
  absl::MutexLock lock(&mu_);
  return last_transfer_ms_;
}

}  // namespace zeroshard
