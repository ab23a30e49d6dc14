#include "shard_server/kv/kv_store.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace zeroshard {

KvStore::KvStore(Clock* clock, KvLimits limits) : clock_(clock), limits_(limits) {}

absl::Status KvStore::CheckKey(const std::string& key) {
  if (key.empty()) return absl::InvalidArgumentError("key is empty");
  if (key.size() > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("key of ", key.size(), " bytes; at most ",
                                                   limits_.max_key_bytes));
  }
  return absl::OkStatus();
}

namespace {

// A swiss table keeps between 7/16 and 7/8 of its slots full (it doubles at
// 7/8): twice a slot and its control byte covers an entry's share.
template <typename Slot>
constexpr size_t TableEntryBytes() {
  return 2 * (sizeof(Slot) + 1);
}

// One rb-tree node of deadlines_ (three pointers and a color, the pair),
// as malloc rounds it.
constexpr size_t kDeadlineNodeBytes = 64;
// A small flat_hash_set<uint64_t>'s own heap block (control bytes and a
// slot), charged to each waiter of a key: an upper bound per member.
constexpr size_t kKeySetMemberBytes = 48;

}  // namespace

size_t KvStore::HeldBytes(const std::string& s) {
  // libstdc++ keeps up to 15 characters inline; a longer text is a heap
  // block of capacity + 1 bytes, which malloc rounds up to 16 bytes with an
  // 8-byte header (32 at least).
  constexpr size_t kInline = 15;
  if (s.capacity() <= kInline) return sizeof(std::string);
  const size_t block = std::max<size_t>(32, (s.capacity() + 1 + 8 + 15) / 16 * 16);
  return sizeof(std::string) + block;
}

KvStore::JobData& KvStore::Data(const std::string& job, int64_t generation, Deferred& deferred) {
  JobData& data = jobs_[job];
  if (data.generation < generation) {
    Clear(data, absl::AbortedError(absl::StrCat("job '", job, "' moved to generation ", generation)),
          deferred);
    data.generation = generation;
  }
  return data;
}

void KvStore::Clear(JobData& data, const absl::Status& why, Deferred& deferred) {
  for (auto& [id, w] : data.waiters) {
    waiter_job_.erase(id);
    deadlines_.erase({w.deadline, id});
    if (w.get_done) deferred.push_back([d = std::move(w.get_done), why] { d(why); });
    if (w.wait_done) deferred.push_back([d = std::move(w.wait_done), why] { d(why); });
  }
  data.waiters.clear();
  data.waiting_on.clear();
  data.values.clear();
  total_bytes_ -= data.bytes + data.wait_bytes;
  data.bytes = 0;
  data.wait_bytes = 0;
}

absl::Status KvStore::CheckRoom(const JobData& data, const std::string& job, size_t more,
                                absl::string_view what) {
  const size_t job_bytes = data.bytes + data.wait_bytes + more;
  if (job_bytes > limits_.max_job_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " would take job '", job, "' to ", job_bytes,
        " bytes held in the KV store (keys, values, held gets and waits); at most ",
        limits_.max_job_bytes, " per job (the server's --kv_max_job_bytes)"));
  }
  if (total_bytes_ + more > limits_.max_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " of job '", job, "' would take the KV store to ", total_bytes_ + more,
        " bytes over all jobs; at most ", limits_.max_total_bytes,
        " (the server's --kv_max_total_bytes)"));
  }
  return absl::OkStatus();
}

absl::Status KvStore::StoreValue(JobData& data, const std::string& job, const std::string& key,
                                 std::string value, bool* created) {
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("value for key '", key, "' has ", value.size(),
                                                   " bytes; at most ", limits_.max_value_bytes));
  }
  using Slot = std::pair<const std::string, std::string>;
  auto it = data.values.find(key);
  *created = it == data.values.end();
  const size_t old = *created ? 0 : HeldBytes(it->first) + HeldBytes(it->second) +
                                        TableEntryBytes<Slot>();
  // The value is moved in: its buffer is what the store holds.
  const size_t now = HeldBytes(key) + HeldBytes(value) + TableEntryBytes<Slot>();
  if (now > old) {
    if (absl::Status s = CheckRoom(data, job, now - old, "this value"); !s.ok()) return s;
  }
  total_bytes_ = total_bytes_ - old + now;
  data.bytes = data.bytes - old + now;
  if (*created) {
    data.values.emplace(key, std::move(value));
  } else {
    it->second = std::move(value);
  }
  return absl::OkStatus();
}

absl::Status KvStore::StoreAndWake(JobData& data, const std::string& job, const std::string& key,
                                   std::string value, Deferred& deferred) {
  bool created = false;
  absl::Status s = StoreValue(data, job, key, std::move(value), &created);
  // A key that existed already was counted by every waiter that needed it.
  if (s.ok() && created) WakeWaitersOf(data, key, deferred);
  return s;
}

void KvStore::WakeWaitersOf(JobData& data, const std::string& key, Deferred& deferred) {
  auto index = data.waiting_on.find(key);
  if (index == data.waiting_on.end()) return;
  const absl::flat_hash_set<uint64_t> ids = std::move(index->second);
  data.waiting_on.erase(index);
  for (uint64_t id : ids) {
    ++waiter_visits_;
    auto it = data.waiters.find(id);
    if (it == data.waiters.end()) continue;
    Waiter& w = it->second;
    if (--w.missing > 0) continue;
    waiter_job_.erase(w.id);
    ReleaseWaiter(data, w);
    if (w.get_done) {
      deferred.push_back([d = std::move(w.get_done), v = data.values[w.keys[0]]] { d(v); });
    } else {
      deferred.push_back([d = std::move(w.wait_done)] { d(absl::OkStatus()); });
    }
    data.waiters.erase(it);
  }
}

uint64_t KvStore::HoldOrRefuse(JobData& data, const std::string& job, Waiter waiter,
                               Deferred& deferred) {
  auto refuse = [&](const absl::Status& s) {
    if (waiter.get_done) deferred.push_back([d = std::move(waiter.get_done), s] { d(s); });
    if (waiter.wait_done) deferred.push_back([d = std::move(waiter.wait_done), s] { d(s); });
    return uint64_t{0};
  };
  if (data.waiters.size() >= limits_.max_waiters_per_job) {
    return refuse(absl::ResourceExhaustedError(
        absl::StrCat("job '", job, "' already has ", data.waiters.size(),
                     " gets and waits held; at most ", limits_.max_waiters_per_job,
                     " (the server's --kv_max_waiters_per_job)")));
  }
  using WaiterSlot = std::pair<const uint64_t, Waiter>;
  using IndexSlot = std::pair<const std::string, absl::flat_hash_set<uint64_t>>;
  using JobSlot = std::pair<const uint64_t, std::string>;
  // The request the caller keeps alive (already in waiter.bytes), the
  // waiter, its keys (its own copies, the index's copy and entry), its
  // deadline and its job's name.
  waiter.bytes += TableEntryBytes<WaiterSlot>() + kDeadlineNodeBytes +
                  TableEntryBytes<JobSlot>() + sizeof(std::string) + job.size() +
                  waiter.keys.capacity() * sizeof(std::string);
  for (const std::string& k : waiter.keys) {
    waiter.bytes += 2 * HeldBytes(k) + TableEntryBytes<IndexSlot>() + kKeySetMemberBytes;
  }
  if (absl::Status s = CheckRoom(data, job, waiter.bytes, "holding this get or wait"); !s.ok()) {
    return refuse(s);
  }
  const uint64_t id = waiter.id;
  for (const std::string& k : waiter.keys) {
    if (!data.values.contains(k)) {
      data.waiting_on[k].insert(id);
      ++waiter.missing;
    }
  }
  data.wait_bytes += waiter.bytes;
  total_bytes_ += waiter.bytes;
  waiter_job_[id] = job;
  deadlines_.emplace(waiter.deadline, id);
  data.waiters.emplace(id, std::move(waiter));
  return id;
}

void KvStore::ReleaseWaiter(JobData& data, const Waiter& waiter) {
  data.wait_bytes -= waiter.bytes;
  total_bytes_ -= waiter.bytes;
  deadlines_.erase({waiter.deadline, waiter.id});
  if (waiter.missing == 0) return;  // no index entries left
  for (const std::string& k : waiter.keys) {
    auto index = data.waiting_on.find(k);
    if (index == data.waiting_on.end()) continue;
    index->second.erase(waiter.id);
    if (index->second.empty()) data.waiting_on.erase(index);
  }
}

absl::Status KvStore::Set(const std::string& job, int64_t generation, const std::string& key,
                          std::string value) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  Deferred deferred;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = StoreAndWake(Data(job, generation, deferred), job, key, std::move(value), deferred);
  }
  for (auto& f : deferred) f();
  return status;
}

uint64_t KvStore::Get(const std::string& job, int64_t generation, const std::string& key,
                      absl::Time deadline, GetDone done, size_t request_bytes) {
  if (absl::Status s = CheckKey(key); !s.ok()) {
    done(s);
    return 0;
  }
  Deferred deferred;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    JobData& data = Data(job, generation, deferred);
    auto it = data.values.find(key);
    if (it != data.values.end()) {
      deferred.push_back([done = std::move(done), v = it->second] { done(v); });
    } else {
      Waiter w;
      w.id = next_id_++;
      w.keys = {key};
      w.bytes = request_bytes;
      w.deadline = deadline;
      w.get_done = std::move(done);
      id = HoldOrRefuse(data, job, std::move(w), deferred);
    }
  }
  for (auto& f : deferred) f();
  return id;
}

absl::StatusOr<int64_t> KvStore::Add(const std::string& job, int64_t generation,
                                     const std::string& key, int64_t delta) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  Deferred deferred;
  absl::StatusOr<int64_t> result;
  {
    absl::MutexLock lock(&mu_);
    JobData& data = Data(job, generation, deferred);
    int64_t value = 0;
    auto it = data.values.find(key);
    if (it != data.values.end() && !absl::SimpleAtoi(it->second, &value)) {
      result = absl::FailedPreconditionError(
          absl::StrCat("key '", key, "' holds a value that is not an integer; cannot add"));
    } else if ((delta > 0 && value > INT64_MAX - delta) ||
               (delta < 0 && value < INT64_MIN - delta)) {
      result = absl::OutOfRangeError(
          absl::StrCat("adding ", delta, " to key '", key, "' (", value, ") overflows int64"));
    } else {
      value += delta;
      absl::Status s = StoreAndWake(data, job, key, absl::StrCat(value), deferred);
      if (s.ok()) {
        result = value;
      } else {
        result = s;
      }
    }
  }
  for (auto& f : deferred) f();
  return result;
}

uint64_t KvStore::Wait(const std::string& job, int64_t generation, std::vector<std::string> keys,
                       absl::Time deadline, WaitDone done, size_t request_bytes) {
  waits_begun_.fetch_add(1, std::memory_order_relaxed);
  if (keys.size() > limits_.max_wait_keys) {
    done(absl::ResourceExhaustedError(
        absl::StrCat("a wait for ", keys.size(), " keys; at most ", limits_.max_wait_keys,
                     " per call (the server's --kv_max_wait_keys)")));
    return 0;
  }
  for (const std::string& k : keys) {
    if (absl::Status s = CheckKey(k); !s.ok()) {
      done(s);
      return 0;
    }
  }
  // Each key once (outside the lock: a wait may name 131,072 keys).
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  Deferred deferred;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    JobData& data = Data(job, generation, deferred);
    bool ready = true;
    for (const std::string& k : keys) ready = ready && data.values.contains(k);
    if (ready) {
      deferred.push_back([done = std::move(done)] { done(absl::OkStatus()); });
    } else {
      // Only the distinct keys not set yet are kept (and indexed).
      Waiter w;
      w.id = next_id_++;
      for (std::string& k : keys) {
        if (!data.values.contains(k)) w.keys.push_back(std::move(k));
      }
      w.keys.shrink_to_fit();
      w.bytes = request_bytes;
      w.deadline = deadline;
      w.wait_done = std::move(done);
      id = HoldOrRefuse(data, job, std::move(w), deferred);
    }
  }
  for (auto& f : deferred) f();
  return id;
}

absl::StatusOr<std::string> KvStore::CompareSet(const std::string& job, int64_t generation,
                                                const std::string& key, const std::string& expected,
                                                std::string desired) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  Deferred deferred;
  absl::StatusOr<std::string> result;
  {
    absl::MutexLock lock(&mu_);
    JobData& data = Data(job, generation, deferred);
    auto it = data.values.find(key);
    const bool swap = it == data.values.end() ? expected.empty() : it->second == expected;
    if (!swap) {
      result = it == data.values.end() ? expected : it->second;
    } else if (absl::Status s = StoreAndWake(data, job, key, desired, deferred); !s.ok()) {
      result = s;
    } else {
      result = std::move(desired);
    }
  }
  for (auto& f : deferred) f();
  return result;
}

absl::StatusOr<bool> KvStore::Delete(const std::string& job, int64_t generation,
                                     const std::string& key) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  Deferred deferred;
  bool deleted = false;
  {
    absl::MutexLock lock(&mu_);
    JobData& data = Data(job, generation, deferred);
    auto it = data.values.find(key);
    if (it != data.values.end()) {
      const size_t bytes = HeldBytes(it->first) + HeldBytes(it->second) +
                           TableEntryBytes<std::pair<const std::string, std::string>>();
      data.bytes -= bytes;
      total_bytes_ -= bytes;
      data.values.erase(it);
      deleted = true;
    }
  }
  for (auto& f : deferred) f();
  return deleted;
}

absl::StatusOr<bool> KvStore::Check(const std::string& job, int64_t generation,
                                    const std::vector<std::string>& keys) {
  if (keys.size() > limits_.max_wait_keys) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a check of ", keys.size(), " keys; at most ", limits_.max_wait_keys,
                     " per call (the server's --kv_max_wait_keys)"));
  }
  for (const std::string& k : keys) {
    if (absl::Status s = CheckKey(k); !s.ok()) return s;
  }
  Deferred deferred;
  bool all = true;
  {
    absl::MutexLock lock(&mu_);
    JobData& data = Data(job, generation, deferred);
    for (const std::string& k : keys) all = all && data.values.contains(k);
  }
  for (auto& f : deferred) f();
  return all;
}

int64_t KvStore::NumKeys(const std::string& job, int64_t generation) {
  Deferred deferred;
  int64_t n = 0;
  {
    absl::MutexLock lock(&mu_);
    n = static_cast<int64_t>(Data(job, generation, deferred).values.size());
  }
  for (auto& f : deferred) f();
  return n;
}

void KvStore::Cancel(uint64_t id) {
  Waiter w;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiter_job_.find(id);
    if (it == waiter_job_.end()) return;
    JobData& data = jobs_[it->second];
    waiter_job_.erase(it);
    auto wi = data.waiters.find(id);
    if (wi == data.waiters.end()) return;
    w = std::move(wi->second);
    ReleaseWaiter(data, w);
    data.waiters.erase(wi);
  }
  absl::Status cancelled = absl::CancelledError("cancelled by the caller");
  if (w.get_done) w.get_done(cancelled);
  if (w.wait_done) w.wait_done(cancelled);
}

void KvStore::DropJob(const std::string& job, int64_t new_generation) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job);
    if (it == jobs_.end()) return;
    Clear(it->second,
          absl::AbortedError(new_generation == std::numeric_limits<int64_t>::max()
                                 ? absl::StrCat("job '", job, "' ended")
                                 : absl::StrCat("job '", job, "' moved to generation ",
                                                new_generation)),
          deferred);
    jobs_.erase(it);
  }
  for (auto& f : deferred) f();
}

void KvStore::Tick() {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    // Only the expired waiters, oldest first: no work for the others.
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const uint64_t id = deadlines_.begin()->second;
      ++waiter_visits_;
      auto job_it = waiter_job_.find(id);
      if (job_it == waiter_job_.end()) {
        deadlines_.erase(deadlines_.begin());
        continue;
      }
      const std::string job = job_it->second;
      JobData& data = jobs_[job];
      auto it = data.waiters.find(id);
      if (it == data.waiters.end()) {
        deadlines_.erase(deadlines_.begin());
        waiter_job_.erase(job_it);
        continue;
      }
      Waiter& w = it->second;
      // Named, up to a few: the message travels in a status, whose
      // metadata a client limits to a few KiB.
      constexpr int kNamed = 4;
      std::string missing;
      int count = 0;
      for (const std::string& k : w.keys) {
        if (data.values.contains(k)) continue;
        if (count++ < kNamed) absl::StrAppend(&missing, missing.empty() ? "" : ", ", k);
      }
      if (count > kNamed) absl::StrAppend(&missing, " and ", count - kNamed, " more");
      absl::Status expired = absl::DeadlineExceededError(
          absl::StrCat("key(s) ", missing, " of job '", job, "' not set before the deadline"));
      waiter_job_.erase(job_it);
      ReleaseWaiter(data, w);
      if (w.get_done) deferred.push_back([d = std::move(w.get_done), expired] { d(expired); });
      if (w.wait_done) deferred.push_back([d = std::move(w.wait_done), expired] { d(expired); });
      data.waiters.erase(it);
    }
  }
  for (auto& f : deferred) f();
}

size_t KvStore::TotalBytes() {
  absl::MutexLock lock(&mu_);
  return total_bytes_;
}

size_t KvStore::JobBytes(const std::string& job) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.bytes + it->second.wait_bytes;
}

uint64_t KvStore::WaiterVisits() {
  absl::MutexLock lock(&mu_);
  return waiter_visits_;
}

uint64_t KvStore::WaitsBegun() { return waits_begun_.load(std::memory_order_relaxed); }

size_t KvStore::KeyCount(const std::string& job) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.values.size();
}

}  // namespace zeroshard
