#include "shard_server/kv/kv_store.h"

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
    if (w.get_done) deferred.push_back([d = std::move(w.get_done), why] { d(why); });
    if (w.wait_done) deferred.push_back([d = std::move(w.wait_done), why] { d(why); });
  }
  data.waiters.clear();
  data.values.clear();
  total_bytes_ -= data.bytes + data.wait_bytes;
  data.bytes = 0;
  data.wait_bytes = 0;
}

absl::Status KvStore::StoreValue(JobData& data, const std::string& job, const std::string& key,
                                 std::string value) {
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("value for key '", key, "' has ", value.size(),
                                                   " bytes; at most ", limits_.max_value_bytes));
  }
  auto it = data.values.find(key);
  size_t old = it == data.values.end() ? 0 : key.size() + it->second.size();
  size_t bytes = data.bytes - old + key.size() + value.size();
  if (bytes > limits_.max_job_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job '", job, "' would hold ", bytes, " bytes in the store; at most ",
                     limits_.max_job_bytes, " (the server's --kv_max_job_bytes)"));
  }
  if (bytes > data.bytes && total_bytes_ + (bytes - data.bytes) > limits_.max_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the store would hold ", total_bytes_ + (bytes - data.bytes),
        " bytes over all jobs; at most ", limits_.max_total_bytes,
        " (the server's --kv_max_total_bytes)"));
  }
  total_bytes_ = total_bytes_ - data.bytes + bytes;
  data.bytes = bytes;
  data.values[key] = std::move(value);
  return absl::OkStatus();
}

void KvStore::WakeWaiters(JobData& data, Deferred& deferred) {
  for (auto it = data.waiters.begin(); it != data.waiters.end();) {
    Waiter& w = it->second;
    bool ready = true;
    for (const std::string& k : w.keys) ready = ready && data.values.contains(k);
    if (!ready) {
      ++it;
      continue;
    }
    waiter_job_.erase(w.id);
    ReleaseWaiter(data, w);
    if (w.get_done) {
      deferred.push_back([d = std::move(w.get_done), v = data.values[w.keys[0]]] { d(v); });
    } else {
      deferred.push_back([d = std::move(w.wait_done)] { d(absl::OkStatus()); });
    }
    it = data.waiters.erase(it);
  }
}

absl::Status KvStore::AddWaiter(JobData& data, const std::string& job, Waiter& waiter) {
  if (data.waiters.size() >= limits_.max_waiters_per_job) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job '", job, "' already has ", data.waiters.size(),
                     " gets and waits held; at most ", limits_.max_waiters_per_job,
                     " (the server's --kv_max_waiters_per_job)"));
  }
  // The keys' bytes and a share for the waiter's own bookkeeping.
  waiter.bytes = 64;
  for (const std::string& k : waiter.keys) waiter.bytes += k.size() + 32;
  if (total_bytes_ + waiter.bytes > limits_.max_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "holding this wait would take the store to ", total_bytes_ + waiter.bytes,
        " bytes over all jobs; at most ", limits_.max_total_bytes,
        " (the server's --kv_max_total_bytes)"));
  }
  data.wait_bytes += waiter.bytes;
  total_bytes_ += waiter.bytes;
  waiter_job_[waiter.id] = job;
  const uint64_t id = waiter.id;
  data.waiters.emplace(id, std::move(waiter));
  return absl::OkStatus();
}

void KvStore::ReleaseWaiter(JobData& data, const Waiter& waiter) {
  data.wait_bytes -= waiter.bytes;
  total_bytes_ -= waiter.bytes;
}

absl::Status KvStore::Set(const std::string& job, int64_t generation, const std::string& key,
                          std::string value) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  Deferred deferred;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    JobData& data = Data(job, generation, deferred);
    status = StoreValue(data, job, key, std::move(value));
    if (status.ok()) WakeWaiters(data, deferred);
  }
  for (auto& f : deferred) f();
  return status;
}

uint64_t KvStore::Get(const std::string& job, int64_t generation, const std::string& key,
                      absl::Time deadline, GetDone done) {
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
      const uint64_t waiter_id = next_id_++;
      Waiter w;
      w.id = waiter_id;
      w.keys = {key};
      w.deadline = deadline;
      w.get_done = std::move(done);
      if (absl::Status s = AddWaiter(data, job, w); !s.ok()) {
        deferred.push_back([d = std::move(w.get_done), s] { d(s); });
      } else {
        id = waiter_id;
      }
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
      absl::Status s = StoreValue(data, job, key, absl::StrCat(value));
      if (s.ok()) {
        result = value;
        WakeWaiters(data, deferred);
      } else {
        result = s;
      }
    }
  }
  for (auto& f : deferred) f();
  return result;
}

uint64_t KvStore::Wait(const std::string& job, int64_t generation, std::vector<std::string> keys,
                       absl::Time deadline, WaitDone done) {
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
      const uint64_t waiter_id = next_id_++;
      Waiter w;
      w.id = waiter_id;
      w.keys = std::move(keys);
      w.deadline = deadline;
      w.wait_done = std::move(done);
      if (absl::Status s = AddWaiter(data, job, w); !s.ok()) {
        deferred.push_back([d = std::move(w.wait_done), s] { d(s); });
      } else {
        id = waiter_id;
      }
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
    } else if (absl::Status s = StoreValue(data, job, key, desired); !s.ok()) {
      result = s;
    } else {
      result = std::move(desired);
      WakeWaiters(data, deferred);
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
      const size_t bytes = it->first.size() + it->second.size();
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
    absl::Time now = clock_->Now();
    for (auto& [job, data] : jobs_) {
      for (auto it = data.waiters.begin(); it != data.waiters.end();) {
        Waiter& w = it->second;
        if (w.deadline > now) {
          ++it;
          continue;
        }
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
        waiter_job_.erase(w.id);
        ReleaseWaiter(data, w);
        if (w.get_done) deferred.push_back([d = std::move(w.get_done), expired] { d(expired); });
        if (w.wait_done) deferred.push_back([d = std::move(w.wait_done), expired] { d(expired); });
        it = data.waiters.erase(it);
      }
    }
  }
  for (auto& f : deferred) f();
}

size_t KvStore::TotalBytes() {
  absl::MutexLock lock(&mu_);
  return total_bytes_;
}

size_t KvStore::KeyCount(const std::string& job) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.values.size();
}

}  // namespace zeroshard
