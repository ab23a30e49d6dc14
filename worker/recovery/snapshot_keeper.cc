#include "worker/recovery/snapshot_keeper.h"

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/checkpoint_format.h"
#include "common/checksum.h"
#include "common/finite_scan.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"

namespace zeroshard {
namespace {

// Tags of the buddy swap on the snapshot context.
constexpr uint32_t kHeaderTag = 1;
constexpr uint32_t kBlobTag = 2;

int Mod(int a, int b) { return ((a % b) + b) % b; }

}  // namespace

int BuddyShift(const std::vector<std::string>& hosts) {
  const int w = static_cast<int>(hosts.size());
  for (int k = 1; k < w; ++k) {
    bool apart = true;
    for (int r = 0; r < w && apart; ++r) apart = hosts[(r + k) % w] != hosts[r];
    if (apart) return k;
  }
  return 1;
}

namespace {

// The size field and JSON header's length (bytes), or -1 when `bytes` is too
// short to hold them.
int64_t HeaderLength(const std::string& bytes) {
  uint64_t header_size = 0;
  if (bytes.size() < 8) return -1;
  std::memcpy(&header_size, bytes.data(), 8);  // little-endian hosts only, as the writer
  if (header_size > bytes.size() - 8) return -1;
  return 8 + static_cast<int64_t>(header_size);
}

}  // namespace

uint64_t BlobChecksum(const std::string& bytes) {
  const int64_t header = HeaderLength(bytes);
  return Checksum(bytes.data(), header < 0 ? bytes.size() : static_cast<size_t>(header));
}

namespace {

// The blob's step, saver and data row from its __metadata__ (all written by
// SerializeShardInto as decimal strings); DATA_LOSS naming the key.
absl::Status ReadBlobMetadata(const SafetensorsReader& reader, BlobDescription* out) {
  const SafetensorsMetadata& meta = reader.metadata();
  auto number = [&](const char* key, int64_t* value) -> absl::Status {
    auto it = meta.find(key);
    if (it == meta.end()) {
      return absl::DataLossError(absl::StrCat(reader.path(), ": its metadata has no \"", key,
                                              "\" (every snapshot blob records it)"));
    }
    if (!absl::SimpleAtoi(it->second, value)) {
      return absl::DataLossError(absl::StrCat(reader.path(), ": metadata \"", key, "\" is \"",
                                              it->second, "\", not an integer"));
    }
    return absl::OkStatus();
  };
  int64_t rank = 0, world = 0;
  const std::pair<const char*, int64_t*> numbers[] = {{ShardMetadataKey::kStep, &out->step},
                                                      {ShardMetadataKey::kRank, &rank},
                                                      {ShardMetadataKey::kWorldSize, &world},
                                                      {ShardMetadataKey::kDataRow, &out->data_row}};
  for (const auto& [key, value] : numbers) {
    if (absl::Status s = number(key, value); !s.ok()) return s;
  }
  out->rank = static_cast<int>(rank);
  out->world_size = static_cast<int>(world);
  auto plan = meta.find(ShardMetadataKey::kPlanHash);
  out->plan_hash = plan == meta.end() ? "" : plan->second;
  return absl::OkStatus();
}

// Every tensor of the blob against the XXH64 its metadata records (the
// header's own XXH64 was checked before), and the parameter pieces into
// `out`. `what` names the blob in errors.
absl::Status CheckBlobTensors(const SafetensorsReader& reader, absl::string_view bytes,
                              const std::string& what, BlobDescription* out) {
  auto recorded = reader.metadata().find(ShardMetadataKey::kChecksums);
  const nlohmann::json checksums =
      recorded == reader.metadata().end()
          ? nlohmann::json()
          : nlohmann::json::parse(recorded->second, nullptr, /*allow_exceptions=*/false);
  if (!checksums.is_object()) {
    return absl::DataLossError(absl::StrCat(what, ": metadata \"", ShardMetadataKey::kChecksums,
                                            "\" is missing or not a JSON object"));
  }
  for (const TensorInfo& t : reader.tensors()) {
    auto want = checksums.find(t.name);
    if (want == checksums.end() || !want->is_string()) {
      return absl::DataLossError(
          absl::StrCat(what, ": tensor ", t.name, " has no recorded checksum"));
    }
    const std::string got =
        ChecksumToHex(Checksum(bytes.data() + t.begin, static_cast<size_t>(t.Bytes())));
    if (got != want->get<std::string>()) {
      return absl::DataLossError(absl::StrCat(what, ": tensor ", t.name, ": XXH64 ", got,
                                              ", expected ", want->get<std::string>()));
    }
    ParsedShardTensorName parsed;
    if (!ParseShardTensorName(t.name, &parsed) || parsed.kind != ShardTensorKind::kParams) {
      continue;
    }
    out->pieces.push_back({parsed.tensor, parsed.row_begin, parsed.row_end});
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<SnapshotBlob>> BlobFromBytes(std::string bytes, uint64_t xxh64) {
  const std::string name = absl::StrCat("snapshot blob of ", bytes.size(), " bytes");
  if (HeaderLength(bytes) < 0) {
    return absl::DataLossError(absl::StrCat(name, ": shorter than its header says"));
  }
  if (BlobChecksum(bytes) != xxh64) {
    return absl::DataLossError(absl::StrCat(name, ": header XXH64 ",
                                            ChecksumToHex(BlobChecksum(bytes)), ", expected ",
                                            ChecksumToHex(xxh64)));
  }
  // The header's JSON, dtypes, shapes and offsets (the tensors tile the
  // data exactly), checked by the reader; its errors name the blob.
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader =
      SafetensorsReader::OpenBuffer(name, bytes);
  if (!reader.ok()) return absl::DataLossError(reader.status().message());
  auto blob = std::make_shared<SnapshotBlob>();
  BlobDescription& d = blob->description;
  if (absl::Status s = ReadBlobMetadata(**reader, &d); !s.ok()) return s;
  const std::string what =
      absl::StrCat("snapshot blob of step ", d.step, " (rank ", d.rank, " of ", d.world_size, ")");
  if (absl::Status s = CheckBlobTensors(**reader, bytes, what, &d); !s.ok()) return s;
  reader->reset();  // it reads `bytes`, which move below
  d.bytes = static_cast<int64_t>(bytes.size());
  d.xxh64 = xxh64;
  d.received = true;
  blob->bytes = std::move(bytes);
  return blob;
}

SnapshotKeeper::~SnapshotKeeper() { thread_.reset(); }

void SnapshotKeeper::UpdateBytesLocked() {
  int64_t total = 0;
  for (const auto& [key, blob] : blobs_) total += static_cast<int64_t>(blob->bytes.capacity());
  for (const std::string& buffer : pool_) total += static_cast<int64_t>(buffer.capacity());
  bytes_ = total;
  peak_bytes_ = std::max(peak_bytes_, bytes_);
}

void SnapshotKeeper::AddLocked(std::shared_ptr<SnapshotBlob> blob) {
  auto [it, inserted] = blobs_.emplace(KeyOf(*blob), blob);
  if (!inserted) {
    std::shared_ptr<SnapshotBlob> old = std::move(it->second);
    it->second = std::move(blob);
    DropLocked(std::move(old));
  }
  UpdateBytesLocked();
}

void SnapshotKeeper::DropLocked(std::shared_ptr<SnapshotBlob> blob) {
  // Two steps' blobs (own + received) are held at most: four buffers in
  // all; a shrink may leave more behind, which are freed.
  constexpr size_t kMaxPool = 4;
  if (blob.use_count() == 1 && pool_.size() < kMaxPool) pool_.push_back(std::move(blob->bytes));
}

std::string SnapshotKeeper::TakeBuffer() {
  absl::MutexLock lock(&mu_);
  if (pool_.empty()) return std::string();
  auto largest = std::max_element(
      pool_.begin(), pool_.end(),
      [](const std::string& a, const std::string& b) { return a.capacity() < b.capacity(); });
  std::string buffer = std::move(*largest);
  pool_.erase(largest);
  return buffer;
}

void SnapshotKeeper::Reserve(int64_t bytes, int count) {
  {
    // Counts as in flight: a boundary that comes first skips its snapshot
    // rather than wait behind the first touches of the buffers.
    absl::MutexLock lock(&mu_);
    in_flight_ = true;
  }
  thread_->Submit([this, bytes, count]() -> absl::Status {
    struct Done {
      SnapshotKeeper* keeper;
      ~Done() {
        absl::MutexLock lock(&keeper->mu_);
        keeper->in_flight_ = false;
      }
    } done{this};
    int have = 0;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [key, blob] : blobs_) {
        have += static_cast<int64_t>(blob->bytes.capacity()) >= bytes ? 1 : 0;
      }
      for (const std::string& buffer : pool_) {
        have += static_cast<int64_t>(buffer.capacity()) >= bytes ? 1 : 0;
      }
    }
    for (; have < count; ++have) {
      std::string buffer(bytes, '\0');  // every page touched here, once
      absl::MutexLock lock(&mu_);
      // A buffer too small to use is replaced.
      auto small = std::min_element(
          pool_.begin(), pool_.end(),
          [](const std::string& a, const std::string& b) { return a.capacity() < b.capacity(); });
      if (small != pool_.end() && static_cast<int64_t>(small->capacity()) < bytes) {
        *small = std::move(buffer);
      } else {
        pool_.push_back(std::move(buffer));
      }
      UpdateBytesLocked();
    }
    return absl::OkStatus();
  });
}

absl::Status SnapshotKeeper::Start(ShardView view, GlooCommunicator* comm, int shift,
                                   absl::Duration timeout) {
  // Nothing in flight (REQUIRES): this returns at once, with the previous
  // transfer's error if it failed (a failed TaskThread runs no later task).
  assert(!in_flight() && "SnapshotKeeper::Start while a snapshot is in flight");
  if (absl::Status s = Wait(); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    copying_ = true;
    in_flight_ = true;
  }
  auto shared = std::make_shared<ShardView>(std::move(view));
  thread_->Submit([this, shared, comm, shift, timeout]() -> absl::Status {
    absl::Status s = Transfer(*shared, comm, shift, timeout);
    absl::MutexLock lock(&mu_);
    copying_ = false;
    in_flight_ = false;
    return s;
  });
  return absl::OkStatus();
}

void SnapshotKeeper::WaitCopied() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](bool* copying) { return !*copying; }, &copying_));
}

bool SnapshotKeeper::WaitIdle(absl::Duration limit) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(
                                  +[](bool* in_flight) { return !*in_flight; }, &in_flight_),
                              limit);
}

bool SnapshotKeeper::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

namespace {

// A blob's description of `view`'s shard, whose bytes it holds.
void DescribeOwnBlob(const ShardView& view, SnapshotBlob* own) {
  BlobDescription& d = own->description;
  d.step = view.id.step;
  d.rank = view.id.rank;
  d.world_size = view.id.world_size;
  d.plan_hash = view.id.plan_hash;
  d.data_row = view.id.data_row;
  for (const TensorEntry& entry : view.entries) {
    ParsedShardTensorName parsed;
    if (!ParseShardTensorName(entry.name, &parsed) || parsed.kind != ShardTensorKind::kParams) {
      continue;
    }
    d.pieces.push_back({parsed.tensor, parsed.row_begin, parsed.row_end});
  }
  d.bytes = static_cast<int64_t>(own->bytes.size());
  d.xxh64 = BlobChecksum(own->bytes);
}

}  // namespace

absl::Status SnapshotKeeper::ExchangeWithBuddy(std::shared_ptr<SnapshotBlob> own, bool refused,
                                               GlooCommunicator* comm, int shift,
                                               absl::Duration timeout, absl::Time start) {
  const int64_t step = own->description.step;
  const int w = comm->world_size();
  const int to = Mod(comm->rank() + shift, w);
  const int from = Mod(comm->rank() - shift, w);
  // Sizes and checksums first, then the blobs.
  uint64_t send_header[3] = {own->bytes.size(), own->description.xxh64, refused ? uint64_t{1} : 0};
  uint64_t recv_header[3] = {0, 0, 0};
  absl::Status s = comm->SendRecv({{to, kHeaderTag, send_header, sizeof(send_header)}},
                                  {{from, kHeaderTag, recv_header, sizeof(recv_header)}}, timeout);
  if (!s.ok()) return s;
  // Tests only: stretch the transfer so that a kill lands inside it:
  // "MS" (every snapshot) or "MS@STEP" (the snapshot of STEP only).
  if (const char* delay = std::getenv("ZEROSHARD_TEST_SNAPSHOT_DELAY_MS")) {
    const char* at = std::strchr(delay, '@');
    if (at == nullptr || std::atoll(at + 1) == step) {
      absl::SleepFor(absl::Milliseconds(std::atoi(delay)));
    }
  }
  std::string received = TakeBuffer();
  // Same size as the buffer's last use (the usual case): nothing written.
  if (received.size() != recv_header[0]) received.resize(recv_header[0]);
  s = comm->SendRecv({{to, kBlobTag, own->bytes.data(), static_cast<int64_t>(own->bytes.size())}},
                     {{from, kBlobTag, received.data(), static_cast<int64_t>(received.size())}},
                     timeout);
  if (!s.ok()) return s;
  if (refused || recv_header[2] != 0) {
    absl::MutexLock lock(&mu_);
    if (refused) ReturnBufferLocked(std::move(own->bytes));  // sent: free again
    // The buddy refused its own shard: not kept here either.
    if (recv_header[2] != 0) {
      ReturnBufferLocked(std::move(received));
      return absl::OkStatus();
    }
  }
  absl::StatusOr<std::shared_ptr<SnapshotBlob>> theirs =
      BlobFromBytes(std::move(received), recv_header[1]);
  if (!theirs.ok()) {
    return absl::DataLossError(absl::StrCat("snapshot of step ", step, " from rank ", from, ": ",
                                            theirs.status().message()));
  }
  if ((*theirs)->description.step != step) {
    return absl::DataLossError(absl::StrCat("snapshot from rank ", from, " is of step ",
                                            (*theirs)->description.step, ", expected ", step));
  }
  absl::MutexLock lock(&mu_);
  AddLocked(*theirs);
  if (refused) return absl::OkStatus();  // theirs kept; this step never completes here
  complete_[step] = 2;
  last_transfer_ms_ = absl::ToDoubleMilliseconds(absl::Now() - start);
  return absl::OkStatus();
}

absl::Status SnapshotKeeper::Transfer(const ShardView& view, GlooCommunicator* comm, int shift,
                                      absl::Duration timeout) {
  const absl::Time start = absl::Now();
  auto own = std::make_shared<SnapshotBlob>();
  own->bytes = TakeBuffer();
  absl::Status copied = SerializeShardInto(view, &own->bytes);
  // A shard holding NaN or Inf is never kept, here or by the buddy (the
  // exchange still runs, the refusal in its header): the step never
  // completes and the last committed snapshot stays (docs/numerics.md).
  const bool refused = IsNonFiniteTensorError(copied);
  {
    absl::MutexLock lock(&mu_);
    copying_ = false;  // the engine's state is free from here on
    last_copy_ms_ = absl::ToDoubleMilliseconds(absl::Now() - start);
    if (refused) refusals_.push_back(std::string(copied.message()));
  }
  if (!copied.ok() && !refused) return copied;
  DescribeOwnBlob(view, own.get());
  const int64_t step = own->description.step;
  const bool alone = comm == nullptr || comm->world_size() == 1;
  {
    absl::MutexLock lock(&mu_);
    if (!refused) {
      AddLocked(own);
      complete_[step] = alone ? 2 : 1;
    } else if (alone) {
      ReturnBufferLocked(std::move(own->bytes));
    }
    if (alone) last_transfer_ms_ = absl::ToDoubleMilliseconds(absl::Now() - start);
  }
  if (alone) return absl::OkStatus();
  return ExchangeWithBuddy(std::move(own), refused, comm, shift, timeout, start);
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

int64_t SnapshotKeeper::CompleteStepAtMost(int64_t limit) const {
  absl::MutexLock lock(&mu_);
  for (auto it = complete_.rbegin(); it != complete_.rend(); ++it) {
    if (it->first <= limit && it->second == 2) return it->first;
  }
  return -1;
}

void SnapshotKeeper::Commit(int64_t step) {
  absl::MutexLock lock(&mu_);
  if (step < 0) return;
  committed_ = std::max(committed_, step);
  for (auto it = blobs_.begin(); it != blobs_.end();) {
    if (std::get<0>(it->first) < committed_) {
      std::shared_ptr<SnapshotBlob> blob = std::move(it->second);
      it = blobs_.erase(it);
      DropLocked(std::move(blob));
    } else {
      ++it;
    }
  }
  complete_.erase(complete_.begin(), complete_.lower_bound(committed_));
  UpdateBytesLocked();
}

void SnapshotKeeper::DropNewerThan(int64_t step) {
  absl::MutexLock lock(&mu_);
  for (auto it = blobs_.begin(); it != blobs_.end();) {
    if (std::get<0>(it->first) > step) {
      std::shared_ptr<SnapshotBlob> blob = std::move(it->second);
      it = blobs_.erase(it);
      DropLocked(std::move(blob));
    } else {
      ++it;
    }
  }
  complete_.erase(complete_.upper_bound(step), complete_.end());
  UpdateBytesLocked();
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

void SnapshotKeeper::Keep(std::shared_ptr<SnapshotBlob> blob) {
  absl::MutexLock lock(&mu_);
  AddLocked(std::move(blob));
}

void SnapshotKeeper::DropOtherPlans(int world_size, const std::string& plan_hash) {
  absl::MutexLock lock(&mu_);
  bool dropped = false;
  for (auto it = blobs_.begin(); it != blobs_.end();) {
    if (std::get<2>(it->first) != world_size || std::get<3>(it->first) != plan_hash) {
      std::shared_ptr<SnapshotBlob> blob = std::move(it->second);
      it = blobs_.erase(it);
      DropLocked(std::move(blob));
      dropped = true;
    } else {
      ++it;
    }
  }
  if (dropped) {
    complete_.clear();
    committed_ = -1;
  }
  UpdateBytesLocked();
}

int64_t SnapshotKeeper::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

int64_t SnapshotKeeper::peak_bytes() const {
  absl::MutexLock lock(&mu_);
  return peak_bytes_;
}

double SnapshotKeeper::last_copy_ms() const {
  absl::MutexLock lock(&mu_);
  return last_copy_ms_;
}

double SnapshotKeeper::last_transfer_ms() const {
  absl::MutexLock lock(&mu_);
  return last_transfer_ms_;
}

void SnapshotKeeper::ReturnBufferLocked(std::string buffer) {
  pool_.push_back(std::move(buffer));
  UpdateBytesLocked();
}

std::vector<std::string> SnapshotKeeper::TakeRefusals() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  out.swap(refusals_);
  return out;
}

}  // namespace zeroshard
