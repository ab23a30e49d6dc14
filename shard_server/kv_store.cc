#include "shard_server/kv_store.h"

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
    for (auto& [id, w] : data.waiters) {
      waiter_job_.erase(id);
      absl::Status aborted = absl::AbortedError(
          absl::StrCat("job '", job, "' moved to generation ", generation));
      if (w.get_done) deferred.push_back([d = std::move(w.get_done), aborted] { d(aborted); });
      if (w.wait_done) deferred.push_back([d = std::move(w.wait_done), aborted] { d(aborted); });
    }
    data.waiters.clear();
    data.values.clear();
    data.bytes = 0;
    data.generation = generation;
  }
  return data;
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
    return absl::ResourceExhaustedError(absl::StrCat("job '", job, "' would hold ", bytes,
                                                     " bytes in the store; at most ",
                                                     limits_.max_job_bytes));
  }
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
    if (w.get_done) {
      deferred.push_back([d = std::move(w.get_done), v = data.values[w.keys[0]]] { d(v); });
    } else {
      deferred.push_back([d = std::move(w.wait_done)] { d(absl::OkStatus()); });
    }
    it = data.waiters.erase(it);
  }
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
      id = next_id_++;
      Waiter& w = data.waiters[id];
      w.id = id;
      w.keys = {key};
      w.deadline = deadline;
      w.get_done = std::move(done);
      waiter_job_[id] = job;
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
      id = next_id_++;
      Waiter& w = data.waiters[id];
      w.id = id;
      w.keys = std::move(keys);
      w.deadline = deadline;
      w.wait_done = std::move(done);
      waiter_job_[id] = job;
    }
  }
  for (auto& f : deferred) f();
  return id;
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
    if (!jobs_.contains(job)) return;
    Data(job, new_generation, deferred);
    jobs_.erase(job);
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
        std::string missing;
        for (const std::string& k : w.keys) {
          if (!data.values.contains(k)) absl::StrAppend(&missing, missing.empty() ? "" : ", ", k);
        }
        absl::Status expired = absl::DeadlineExceededError(
            absl::StrCat("key(s) ", missing, " of job '", job, "' not set before the deadline"));
        waiter_job_.erase(w.id);
        if (w.get_done) deferred.push_back([d = std::move(w.get_done), expired] { d(expired); });
        if (w.wait_done) deferred.push_back([d = std::move(w.wait_done), expired] { d(expired); });
        it = data.waiters.erase(it);
      }
    }
  }
  for (auto& f : deferred) f();
}

size_t KvStore::KeyCount(const std::string& job) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.values.size();
}

}  // namespace zeroshard
