// The lines the binaries print while a fault is under way, built here so
// that they say what is happening (a rank that trains vs one that is
// stopped), measure from one event (the server's verdict on a failure, the
// same instant on every rank) and name the leader that leads now. Pure
// functions: tests/common/fault_messages_test.cc reads every case.
#ifndef ZEROSHARD_COMMON_FAULT_MESSAGES_H_
#define ZEROSHARD_COMMON_FAULT_MESSAGES_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace zeroshard {

// What a worker's client knows while the server does not answer its
// heartbeats.
struct ServerSilence {
  std::string job;
  int rank = 0;
  std::string server;       // --server as given
  absl::Duration silent;    // since the last answer
  int64_t steps_since = 0;  // steps this rank completed since that answer
};

// "job 'J' rank R: the server at S has not answered a heartbeat for 12s
// (...); training goes on here (N steps since ...)" when steps completed
// during the silence, and "...; no step has completed here since: this rank
// is stopped (...)" when none did: a rank stuck in a collective with its
// peers cut off must not read as training.
std::string ServerSilenceLine(const ServerSilence& s);

// What a recovery's times count from.
enum class RecoveryClock {
  kVerdict,  // the server's verdict that ended the generation (the same on every rank)
  kSeen,     // when this rank saw the failure (no verdict time came: its own give-up)
  kJoined,   // a replacement process: when it joined
};

// A recovered rank's first step: "shard_worker rank R: recovery: training
// again at step S, N ms after the server's verdict on the failure (...)",
// naming the event `clock` says.
std::string RecoveredLine(int rank, int64_t step, double ms, RecoveryClock clock);

// A follower's line when the leader it reads in etcd changes: "following L,
// the leader of P now (before: B)". `before` empty: the first one seen;
// `leader` empty: none leads now (an election is under way).
std::string LeaderSeenLine(const std::string& prefix, const std::string& leader,
                           const std::string& before);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_FAULT_MESSAGES_H_
