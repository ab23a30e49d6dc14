// Live diagnosis end to end: a real shard_server and 3 real shard_worker
// processes (the MLP, ZeRO-3) on loopback, with a rank made to stall before
// a collective or to arrive late every step by a test-only worker flag.
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/coordinator_stub.h"
#include "tests/testing/process.h"

namespace zeroshard {
namespace {

using testing::LocalCluster;

constexpr int kHangReportMs = 2000;

std::vector<std::string> MlpFlags(int steps) {
  return {"--model=mlp", "--layers=4",
          "--width=32",  "--batch=8",
          "--stage=3",   absl::StrCat("--steps=", steps),
          "--lr=0.01",   "--collective_timeout=300s"};
}

// The job's status from the server, with its diagnoses.
std::optional<v1::JobStatus> JobStatusOf(const std::string& address, const std::string& job) {
  auto stub = testing::NewCoordinatorStub(address);
  grpc::ClientContext context;
  testing::PrepareContext(&context, absl::Seconds(5));
  v1::GetStatusRequest request;
  request.set_job_id(job);
  v1::GetStatusResponse response;
  if (!stub->GetStatus(&context, request, &response).ok() || response.jobs().empty()) {
    return std::nullopt;
  }
  return response.jobs(0);
}

// Waits (up to `timeout`) for a diagnosis of `kind`; the job's status then.
std::optional<v1::JobStatus> WaitForDiagnosis(const std::string& address, const std::string& job,
                                              v1::Diagnosis::Kind kind, absl::Duration timeout) {
  std::optional<v1::JobStatus> found;
  testing::WaitFor(
      [&] {
        std::optional<v1::JobStatus> status = JobStatusOf(address, job);
        if (!status.has_value()) return false;
        for (const v1::Diagnosis& d : status->diagnoses()) {
          if (d.kind() == kind) {
            found = status;
            return true;
          }
        }
        absl::SleepFor(absl::Milliseconds(100));
        return false;
      },
      timeout);
  return found;
}

const v1::Diagnosis* Find(const v1::JobStatus& job, v1::Diagnosis::Kind kind) {
  for (const v1::Diagnosis& d : job.diagnoses()) {
    if (d.kind() == kind) return &d;
  }
  return nullptr;
}

TEST(ObservabilityTest, ARankStoppedBeforeACollectiveIsNamedWithTheOpAndUnit) {
  LocalCluster cluster(testing::MakeTempDir("hang"),
                       {absl::StrCat("--hang_report_ms=", kHangReportMs)});
  ASSERT_TRUE(cluster.ok());
  // Worker w2 (rank 2) stops before its 30th all-gather: a few steps in.
  cluster.StartWorkers("hang", 3, MlpFlags(100000), {{2, {"--test_stall_before_gather=30"}}});
  std::optional<v1::JobStatus> status =
      WaitForDiagnosis(cluster.address(), "hang", v1::Diagnosis::HANG, absl::Seconds(90));
  ASSERT_TRUE(status.has_value()) << cluster.server()->Log() << cluster.WorkerLog(2);
  const v1::Diagnosis& hang = *Find(*status, v1::Diagnosis::HANG);
  EXPECT_EQ(hang.ranks().size(), 1);
  EXPECT_EQ(hang.ranks(0), 2);
  EXPECT_NE(hang.message().find("rank 2 (w2) has not entered all_gather #30 (unit "),
            std::string::npos)
      << hang.message();
  EXPECT_NE(hang.message().find("; ranks 0,1 are waiting in it"), std::string::npos)
      << hang.message();
  // The waiters' collective, as they report it, and when the server named
  // the laggard: --hang_report_ms after the last progress it heard, which
  // comes with a beat up to one interval (1 s) after the waiters entered it
  // and is seen by the analyzer's next pass (every 500 ms); 3 s more for a
  // late beat or pass on a loaded 2-core machine (the bound is a sanity
  // check, not a timing measurement).
  int64_t entered_ms = 0;
  for (const v1::MemberStatus& m : status->members()) {
    EXPECT_EQ(m.hung(), m.rank() == 2) << m.rank();
    if (m.rank() == 2) {
      EXPECT_EQ(m.telemetry().gathers_entered(), 29);
      continue;
    }
    ASSERT_TRUE(m.telemetry().has_in_progress()) << m.rank();
    EXPECT_EQ(m.telemetry().in_progress().op(), v1::ALL_GATHER);
    EXPECT_EQ(m.telemetry().in_progress().seq(), 30);
    EXPECT_NE(hang.message().find(absl::StrCat("(unit ", m.telemetry().in_progress().unit(), ")")),
              std::string::npos);
    entered_ms = std::max(entered_ms, m.telemetry().in_progress().started_unix_ms());
  }
  EXPECT_LE(hang.since_unix_ms() - entered_ms, kHangReportMs + 1000 + 500 + 3000)
      << hang.message();
  EXPECT_GE(hang.since_unix_ms() - entered_ms, kHangReportMs - 1000) << hang.message();
  // ... and in the server's log.
  EXPECT_TRUE(testing::WaitFor(
      [&] { return cluster.server()->Log().find("event=hang") != std::string::npos; },
      absl::Seconds(10)));
}

TEST(ObservabilityTest, ARankLateToEveryStepIsFlaggedAStraggler) {
  LocalCluster cluster(testing::MakeTempDir("straggler"));
  ASSERT_TRUE(cluster.ok());
  // Rank 1 starts every step 150 ms after the others: over 50 ms and over
  // 20 % of the step (which the others spend waiting for it).
  cluster.StartWorkers("slow", 3, MlpFlags(100000), {{1, {"--test_step_delay_ms=150"}}});
  std::optional<v1::JobStatus> status =
      WaitForDiagnosis(cluster.address(), "slow", v1::Diagnosis::STRAGGLER, absl::Seconds(90));
  ASSERT_TRUE(status.has_value()) << cluster.server()->Log() << cluster.WorkerLog(1);
  for (const v1::Diagnosis& d : status->diagnoses()) {
    EXPECT_EQ(d.kind(), v1::Diagnosis::STRAGGLER) << d.message();
    ASSERT_EQ(d.ranks().size(), 1);
    EXPECT_EQ(d.ranks(0), 1) << d.message();
    EXPECT_NE(d.message().find("rank 1 (w1) is a straggler"), std::string::npos) << d.message();
  }
  for (const v1::MemberStatus& m : status->members()) {
    EXPECT_EQ(m.straggler(), m.rank() == 1) << m.rank();
    EXPECT_FALSE(m.hung());
    if (m.rank() == 1) {
      EXPECT_GT(m.telemetry().arrival_lag_median_ms(), 100);
    } else {
      EXPECT_LT(m.telemetry().arrival_lag_median_ms(), 50);
      EXPECT_GE(m.telemetry().arrival_lag_median_ms(), 0);
    }
  }
}

TEST(ObservabilityTest, AHealthyJobHasNoDiagnosisAndFullTelemetry) {
  LocalCluster cluster(testing::MakeTempDir("healthy"),
                       {absl::StrCat("--hang_report_ms=", kHangReportMs)});
  ASSERT_TRUE(cluster.ok());
  cluster.StartWorkers("healthy", 2, MlpFlags(100000));
  // 20 steps in (the lag median needs them), and well past --hang_report_ms.
  std::optional<v1::JobStatus> status;
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        status = JobStatusOf(cluster.address(), "healthy");
        bool ready = status.has_value() && status->members_size() == 2;
        for (int r = 0; ready && r < 2; ++r) {
          ready = status->members(r).telemetry().arrival_lag_median_ms() >= 0;
        }
        if (!ready) absl::SleepFor(absl::Milliseconds(100));
        return ready;
      },
      absl::Seconds(90)))
      << cluster.server()->Log();
  // Then until every rank has completed a step that began more than
  // --hang_report_ms (plus the analyzer's 500 ms period and slack) after
  // that: the server watched a progressing job for a whole hang window.
  // (Ranks run on this host: their clock is the test's.)
  const int64_t window_end_us =
      absl::ToUnixMicros(absl::Now() + absl::Milliseconds(kHangReportMs + 1500));
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        status = JobStatusOf(cluster.address(), "healthy");
        bool past = status.has_value() && status->members_size() == 2;
        for (int r = 0; past && r < 2; ++r) {
          past = status->members(r).telemetry().first_collective_unix_us() > window_end_us;
        }
        if (!past) absl::SleepFor(absl::Milliseconds(100));
        return past;
      },
      absl::Seconds(90)))
      << cluster.server()->Log();
  for (const v1::Diagnosis& d : status->diagnoses()) ADD_FAILURE() << d.message();
  for (const v1::MemberStatus& m : status->members()) {
    const v1::RankTelemetry& t = m.telemetry();
    EXPECT_GT(t.memory().params(), 0);
    EXPECT_GT(t.memory().optimizer_state(), 0);
    EXPECT_GT(t.bytes_moved(), 0);
    // Both ranks on this host: every byte stayed on it.
    EXPECT_EQ(t.comm_bytes_intra_host(), t.bytes_moved());
    EXPECT_EQ(t.comm_bytes_inter_host(), 0);
    EXPECT_GT(t.gathers_entered(), 20);
    EXPECT_GT(t.reductions_entered(), 20);
    EXPECT_GT(t.first_collective_unix_us(), 0);
    EXPECT_FALSE(m.straggler());
    EXPECT_FALSE(m.hung());
  }
}

}  // namespace
}  // namespace zeroshard
