// The state store on etcd at job scale, without simulated ranks: what a
// generation of --members members costs to write (bytes, transactions,
// time, the largest value) and what a new leader's load costs, on a real
// etcd cluster on loopback.
//
//   bazel run -c opt //tests/bench:etcd_state_bench -- [--members=100000] [--etcd_members=3]
//       [--generations=3] [--json_out=FILE]
//
// Each generation gives every member a new token (as a re-formed job does),
// so every page of members is written; then one member's death (one page).
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/table.h"
#include "nlohmann/json.hpp"
#include "shard_server/state/etcd_state.h"
#include "shard_server/state/state_store.h"
#include "tests/testing/bench_json.h"
#include "tests/testing/bench_machine.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/process.h"

ABSL_FLAG(int, members, 100000, "Members of the job");
ABSL_FLAG(int, ranks_per_host, 8, "Ranks per host (ids and hosts as a cluster names them)");
ABSL_FLAG(int, etcd_members, 3, "etcd members");
ABSL_FLAG(int, generations, 3, "Generations written");
ABSL_FLAG(std::string, json_out, "", "Write the results here as JSON");
ABSL_FLAG(bool, sqlite_only, false,
          "Time the SQLite side alone (what the session extension finds changed), with a replica "
          "that keeps the batches in memory: no etcd");

namespace zeroshard {
namespace {

StoredJob Generation(int members, int per_host, int64_t generation) {
  StoredJob job;
  job.job_id = "scale";
  job.world_size = members;
  job.generation = generation;
  job.members_generation = generation;
  uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(generation + 1);
  for (int r = 0; r < members; ++r) {
    const std::string host = absl::StrFormat("h%05d", r / per_host);
    std::string token;  // 128 random bits in hex, as the server makes them
    for (int i = 0; i < 2; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      absl::StrAppend(&token, absl::Hex(x, absl::kZeroPad16));
    }
    job.members.push_back({r, absl::StrCat(host, "/", r % per_host),
                           absl::StrCat("10.", r / per_host / 250, ".", r / per_host % 250, ".1"),
                           token, false, false});
  }
  return job;
}

std::unique_ptr<EtcdSession> Lead(const std::string& endpoints, const std::string& name) {
  EtcdOptions options;
  options.endpoints = endpoints;
  options.prefix = "/bench";
  auto session = EtcdSession::Connect(options);
  if (!session.ok() || !(*session)->StartLease().ok() || !(*session)->Campaign(name).ok()) {
    std::fprintf(stderr, "cannot lead on etcd %s\n", endpoints.c_str());
    std::exit(1);
  }
  return *std::move(session);
}

// A replica in memory: the SQLite side's own cost.
class MemoryReplica : public DatabaseReplica {
 public:
  absl::StatusOr<std::vector<ReplicaEntry>> Load() override { return std::vector<ReplicaEntry>(); }
  absl::Status Save(const ReplicaBatch& batch) override {
    last_bytes = 0;
    for (const ReplicaEntry& e : batch.puts) last_bytes += e.key.size() + e.value.size();
    return absl::OkStatus();
  }
  int64_t last_bytes = 0;
};

int SqliteOnly(int members, int per_host) {
  {
    auto plain = StateStore::Open(":memory:");
    if (!plain.ok()) return 1;
    for (int g = 1; g <= 2; ++g) {
      StoredJob job = Generation(members, per_host, g);
      const absl::Time start = absl::Now();
      if (!(*plain)->SaveJob(job).ok()) return 1;
      std::printf("not replicated, generation %d: %.0f ms\n", g,
                  absl::ToDoubleMilliseconds(absl::Now() - start));
    }
  }
  MemoryReplica replica;
  auto store = StateStore::OpenReplicated(&replica);
  if (!store.ok()) return 1;
  for (int g = 1; g <= absl::GetFlag(FLAGS_generations); ++g) {
    StoredJob job = Generation(members, per_host, g);
    const absl::Time start = absl::Now();
    if (!(*store)->SaveJob(job).ok()) return 1;
    std::printf("generation %d: %.0f ms, %lld bytes\n", g,
                absl::ToDoubleMilliseconds(absl::Now() - start),
                static_cast<long long>(replica.last_bytes));
  }
  StoredJob job = Generation(members, per_host, absl::GetFlag(FLAGS_generations));
  job.members[members / 2].dead = true;
  const absl::Time start = absl::Now();
  if (!(*store)->SaveJob(job).ok()) return 1;
  std::printf("one death: %.0f ms, %lld bytes\n", absl::ToDoubleMilliseconds(absl::Now() - start),
              static_cast<long long>(replica.last_bytes));
  return 0;
}

int Main() {
  const int members = absl::GetFlag(FLAGS_members);
  const int per_host = absl::GetFlag(FLAGS_ranks_per_host);
  if (absl::GetFlag(FLAGS_sqlite_only)) return SqliteOnly(members, per_host);
  const std::string dir = testing::MakeTempDir("etcd-state-bench");
  testing::RemovedAtExit dir_owner(dir);
  testing::EtcdCluster etcd(dir + "/etcd", absl::GetFlag(FLAGS_etcd_members), testing::OnHosts{},
                            {"--heartbeat-interval=100", "--election-timeout=1000"});
  if (!etcd.ok()) return 1;
  const BenchMachine machine = DescribeBenchMachine("none (no matrix products)");
  std::printf("%s\netcd: %d members on loopback; a job of %d members\n\n", machine.Line().c_str(),
              absl::GetFlag(FLAGS_etcd_members), members);
  Table table({"WRITE", "TIME", "BYTES", "TRANSACTIONS", "LARGEST VALUE"});
  nlohmann::ordered_json result;
  result["machine"] = machine.Json();
  result["members"] = members;
  result["etcd_members"] = absl::GetFlag(FLAGS_etcd_members);
  std::unique_ptr<EtcdSession> leader = Lead(etcd.endpoints(), "a:1");
  {
    EtcdStateReplica replica(leader.get());
    auto store = StateStore::OpenReplicated(&replica);
    if (!store.ok()) {
      std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
      return 1;
    }
    auto row = [&](const std::string& what, absl::Duration took) {
      const EtcdStateReplica::Stats s = replica.stats();
      table.AddRow({what, absl::StrFormat("%.0f ms", absl::ToDoubleMilliseconds(took)),
                    HumanBytes(s.last_batch_bytes), absl::StrCat(s.last_batch_transactions),
                    HumanBytes(s.largest_value_bytes)});
      result["writes"].push_back({{"what", what},
                                  {"ms", absl::ToDoubleMilliseconds(took)},
                                  {"bytes", s.last_batch_bytes},
                                  {"transactions", s.last_batch_transactions},
                                  {"largest_value_bytes", s.largest_value_bytes}});
    };
    for (int g = 1; g <= absl::GetFlag(FLAGS_generations); ++g) {
      StoredJob job = Generation(members, per_host, g);
      const absl::Time start = absl::Now();
      if (absl::Status s = (*store)->SaveJob(job); !s.ok()) {
        std::fprintf(stderr, "generation %d: %s\n", g, s.ToString().c_str());
        return 1;
      }
      row(absl::StrCat("generation ", g, " (every member's token new)"), absl::Now() - start);
    }
    StoredJob job = Generation(members, per_host, absl::GetFlag(FLAGS_generations));
    job.members[members / 2].dead = true;
    const absl::Time start = absl::Now();
    if (absl::Status s = (*store)->SaveJob(job); !s.ok()) {
      std::fprintf(stderr, "a death: %s\n", s.ToString().c_str());
      return 1;
    }
    row("one member declared dead", absl::Now() - start);
  }
  leader->Resign();
  // A new leader loads the state (ranged reads, paged).
  std::unique_ptr<EtcdSession> next = Lead(etcd.endpoints(), "b:1");
  EtcdStateReplica replica(next.get());
  const absl::Time start = absl::Now();
  auto store = StateStore::OpenReplicated(&replica);
  auto jobs = store.ok() ? (*store)->LoadJobs() : store.status();
  const absl::Duration load = absl::Now() - start;
  if (!jobs.ok() || jobs->size() != 1 || static_cast<int>((*jobs)[0].members.size()) != members) {
    std::fprintf(stderr, "the new leader's load: %s\n",
                 jobs.ok() ? "wrong members" : jobs.status().ToString().c_str());
    return 1;
  }
  const EtcdStateReplica::Stats s = replica.stats();
  std::printf("%s\n", table.ToString().c_str());
  std::printf("new leader's load: %.0f ms (etcd reads %.0f ms), %lld keys, %s\n",
              absl::ToDoubleMilliseconds(load), absl::ToDoubleMilliseconds(s.load_time),
              static_cast<long long>(s.loaded_keys), HumanBytes(s.loaded_bytes).c_str());
  result["load_ms"] = absl::ToDoubleMilliseconds(load);
  result["load_etcd_ms"] = absl::ToDoubleMilliseconds(s.load_time);
  result["loaded_keys"] = s.loaded_keys;
  result["loaded_bytes"] = s.loaded_bytes;
  return WriteBenchJson(result, absl::GetFlag(FLAGS_json_out));
}

}  // namespace
}  // namespace zeroshard

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return zeroshard::Main();
}
