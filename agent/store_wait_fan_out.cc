#include "agent/store_wait_fan_out.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace zeroshard {
namespace {

// Waits that may share a call: the same job generation and the same keys (in
// any order). Each part is length-prefixed: keys may hold any byte.
std::string SharingKey(const v1::StoreWaitRequest& request) {
  std::vector<std::string> keys(request.keys().begin(), request.keys().end());
  std::sort(keys.begin(), keys.end());
  std::string key = absl::StrCat(request.member().job_id().size(), ":", request.member().job_id(),
                                 "/", request.member().generation(), "/");
  for (const std::string& k : keys) absl::StrAppend(&key, k.size(), ":", k);
  return key;
}

// As the worker's own call (Client::StoreWait): the server answers at the
// store deadline, the call's deadline is a margin later.
constexpr absl::Duration kCallMargin = absl::Seconds(5);

}  // namespace

StoreWaitFanOut::StoreWaitFanOut(std::shared_ptr<grpc::Channel> channel, std::string authorization,
                                 VerifiedCredentials* verified)
    : stub_(v1::Coordinator::NewStub(std::move(channel))),
      authorization_(std::move(authorization)),
      verified_(verified) {}

StoreWaitFanOut::~StoreWaitFanOut() {
  Stop();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* in_flight) { return *in_flight == 0; }, &in_flight_));
}

uint64_t StoreWaitFanOut::Wait(const v1::StoreWaitRequest& request, Done done) {
  const absl::Time deadline =
      absl::Now() + absl::Milliseconds(std::max<int64_t>(1, request.timeout_ms()));
  // Unverified credentials: a call of their own, never shared.
  const std::string key = verified_->Contains(request.member()) ? SharingKey(request) : "";
  std::shared_ptr<Shared> started;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      id = next_id_++;
      auto open = key.empty() ? open_.end() : open_.find(key);
      if (open != open_.end()) {
        open->second->waiters[id] = Waiter{deadline, std::move(done)};
        by_waiter_[id] = open->second;
        return id;
      }
      started = StartShared(key, request, id, Waiter{deadline, std::move(done)});
    }
  }
  if (started == nullptr) {
    done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the node agent is stopping"));
    return 0;
  }
  stub_->async()->StoreWait(&started->context, &started->request, &started->response,
                            [this, started](grpc::Status status) { Answered(started, status); });
  return id;
}

std::shared_ptr<StoreWaitFanOut::Shared> StoreWaitFanOut::StartShared(
    const std::string& key, const v1::StoreWaitRequest& request, uint64_t id, Waiter waiter) {
  auto shared = std::make_shared<Shared>();
  shared->key = key;
  shared->request = request;
  const absl::Duration timeout = waiter.deadline - absl::Now();
  shared->request.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  if (!authorization_.empty()) shared->context.AddMetadata("authorization", authorization_);
  shared->context.set_deadline(absl::ToChronoTime(waiter.deadline + kCallMargin));
  shared->waiters[id] = std::move(waiter);
  by_waiter_[id] = shared;
  if (!key.empty()) open_[key] = shared;
  ++in_flight_;
  ++calls_;
  return shared;
}

void StoreWaitFanOut::Answered(const std::shared_ptr<Shared>& shared, const grpc::Status& status) {
  // The server accepted the credentials the call carried.
  if (status.ok()) verified_->Add(shared->request.member());
  std::map<uint64_t, Waiter> answered;
  std::vector<std::shared_ptr<Shared>> restarted;
  {
    absl::MutexLock lock(&mu_);
    auto open = open_.find(shared->key);
    if (open != open_.end() && open->second == shared) open_.erase(open);
    for (auto& [id, waiter] : shared->waiters) {
      by_waiter_.erase(id);
      // The shared call ran out of the first waiter's time: a later waiter
      // waits on for the rest of its own.
      const bool waits_on = !stopping_ &&
                            status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                            waiter.deadline - absl::Now() >= absl::Milliseconds(1);
      if (!waits_on) {
        answered.emplace(id, std::move(waiter));
        continue;
      }
      auto again = shared->key.empty() ? open_.end() : open_.find(shared->key);
      if (again != open_.end()) {
        again->second->waiters[id] = std::move(waiter);
        by_waiter_[id] = again->second;
      } else {
        restarted.push_back(StartShared(shared->key, shared->request, id, std::move(waiter)));
      }
    }
    shared->waiters.clear();
  }
  for (const std::shared_ptr<Shared>& call : restarted) {
    stub_->async()->StoreWait(&call->context, &call->request, &call->response,
                              [this, call](grpc::Status s) { Answered(call, s); });
  }
  for (auto& [id, waiter] : answered) waiter.done(status);
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

void StoreWaitFanOut::Cancel(uint64_t waiter) {
  Done done;
  std::shared_ptr<Shared> unwanted;
  {
    absl::MutexLock lock(&mu_);
    auto it = by_waiter_.find(waiter);
    if (it == by_waiter_.end()) return;  // answered already
    std::shared_ptr<Shared> shared = it->second;
    by_waiter_.erase(it);
    auto w = shared->waiters.find(waiter);
    done = std::move(w->second.done);
    shared->waiters.erase(w);
    if (shared->waiters.empty()) {
      auto open = open_.find(shared->key);
      if (open != open_.end() && open->second == shared) open_.erase(open);
      unwanted = shared;
    }
  }
  if (unwanted != nullptr) unwanted->context.TryCancel();
  done(grpc::Status(grpc::StatusCode::CANCELLED, "the rank's wait went away"));
}

void StoreWaitFanOut::Stop() {
  std::vector<Done> dones;
  std::vector<std::shared_ptr<Shared>> calls;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, shared] : by_waiter_) {
      auto w = shared->waiters.find(id);
      dones.push_back(std::move(w->second.done));
      shared->waiters.erase(w);
      if (shared->waiters.empty()) calls.push_back(shared);
    }
    by_waiter_.clear();
    open_.clear();
  }
  for (const std::shared_ptr<Shared>& call : calls) call->context.TryCancel();
  for (Done& done : dones) {
    done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the node agent is stopping"));
  }
}

int StoreWaitFanOut::held() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(by_waiter_.size());
}

int64_t StoreWaitFanOut::calls() {
  absl::MutexLock lock(&mu_);
  return calls_;
}

bool StoreWaitFanOut::idle() {
  absl::MutexLock lock(&mu_);
  return by_waiter_.empty() && in_flight_ == 0;
}

}  // namespace zeroshard
