// TelemetryAnalyzer::Diagnose on hand-made job snapshots: what is a hang,
// a schedule disagreement, a straggler, and what is not.
#include "shard_server/observability/telemetry_analyzer.h"

#include <map>
#include <string>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "shard_server/base/clock.h"
#include "shard_server/base/event_log.h"

namespace zeroshard {
namespace {

const absl::Time kNow = absl::FromUnixSeconds(1'800'000'000);

v1::JobStatus Job(int world) {
  v1::JobStatus job;
  job.set_job_id("j");
  job.set_state(v1::RUNNING);
  job.set_generation(1);
  job.set_world_size(world);
  for (int r = 0; r < world; ++r) {
    v1::MemberStatus* m = job.add_members();
    m->set_rank(r);
    m->set_worker_id("host/" + std::to_string(r));
    m->set_alive(true);
    m->set_last_heartbeat_age_ms(100);
    m->mutable_last_step()->set_step_ms(400);
    m->mutable_telemetry()->set_gathers_entered(5123);
    m->mutable_telemetry()->set_reductions_entered(900);
    m->mutable_telemetry()->set_arrival_lag_median_ms(1);
  }
  return job;
}

void Waiting(v1::MemberStatus* m, v1::CollectiveOp op, int64_t seq, const std::string& unit,
             absl::Duration for_how_long) {
  v1::CollectiveInProgress* c = m->mutable_telemetry()->mutable_in_progress();
  c->set_op(op);
  c->set_seq(seq);
  c->set_unit(unit);
  c->set_started_unix_ms(absl::ToUnixMillis(kNow - for_how_long));
}

std::vector<absl::Time> StalledSince(int world, absl::Duration ago) {
  return std::vector<absl::Time>(world, kNow - ago);
}

TEST(TelemetryAnalyzerTest, NamesTheRankThatHasNotEnteredTheCollectiveOthersWaitIn) {
  v1::JobStatus job = Job(4);
  job.mutable_members(2)->mutable_telemetry()->set_gathers_entered(5122);
  for (int r : {0, 1, 3}) {
    Waiting(job.mutable_members(r), v1::ALL_GATHER, 5123, "transformer.h.7", absl::Seconds(12));
  }
  std::vector<v1::Diagnosis> d =
      TelemetryAnalyzer::Diagnose(job, StalledSince(4, absl::Seconds(12)), kNow, {});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].kind(), v1::Diagnosis::HANG);
  EXPECT_EQ(d[0].message(),
            "rank 2 (host/2) has not entered all_gather #5123 (unit transformer.h.7) for 12.0 s; "
            "ranks 0,1,3 are waiting in it");
  ASSERT_EQ(d[0].ranks_size(), 1);
  EXPECT_EQ(d[0].ranks(0), 2);
}

TEST(TelemetryAnalyzerTest, SaysNothingBeforeHangReport) {
  v1::JobStatus job = Job(2);
  job.mutable_members(1)->mutable_telemetry()->set_gathers_entered(5122);
  Waiting(job.mutable_members(0), v1::ALL_GATHER, 5123, "u", absl::Seconds(9));
  EXPECT_TRUE(
      TelemetryAnalyzer::Diagnose(job, StalledSince(2, absl::Seconds(30)), kNow, {}).empty());
}

TEST(TelemetryAnalyzerTest, ALaggardThatStillAdvancesIsNotHung) {
  v1::JobStatus job = Job(2);
  job.mutable_members(1)->mutable_telemetry()->set_gathers_entered(5122);
  Waiting(job.mutable_members(0), v1::ALL_GATHER, 5123, "u", absl::Seconds(30));
  std::vector<absl::Time> progressed = StalledSince(2, absl::Seconds(30));
  progressed[1] = kNow - absl::Seconds(1);
  EXPECT_TRUE(TelemetryAnalyzer::Diagnose(job, progressed, kNow, {}).empty());
}

TEST(TelemetryAnalyzerTest, DifferentCollectivesUnderOneNumberAreAScheduleMismatch) {
  v1::JobStatus job = Job(3);
  Waiting(job.mutable_members(0), v1::ALL_GATHER, 5123, "h.7", absl::Seconds(11));
  Waiting(job.mutable_members(1), v1::ALL_GATHER, 5123, "h.7", absl::Seconds(11));
  Waiting(job.mutable_members(2), v1::ALL_GATHER, 5123, "h.8", absl::Seconds(11));
  std::vector<v1::Diagnosis> d =
      TelemetryAnalyzer::Diagnose(job, StalledSince(3, absl::Seconds(11)), kNow, {});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].kind(), v1::Diagnosis::SCHEDULE_MISMATCH);
  EXPECT_EQ(d[0].message(),
            "ranks disagree on the collective schedule: at all_gather #5123 for 11.0 s: ranks "
            "0,1 in all_gather (unit h.7); rank 2 in all_gather (unit h.8)");
}

TEST(TelemetryAnalyzerTest, RanksWaitingForEachOtherDisagreeOnTheSchedule) {
  v1::JobStatus job = Job(2);
  // Rank 0 gathers #5123 that rank 1 skipped; rank 1 reduces #901 that rank
  // 0 has not reached.
  Waiting(job.mutable_members(0), v1::ALL_GATHER, 5123, "h.7", absl::Seconds(15));
  job.mutable_members(1)->mutable_telemetry()->set_gathers_entered(5122);
  job.mutable_members(1)->mutable_telemetry()->set_reductions_entered(901);
  Waiting(job.mutable_members(1), v1::REDUCE_SCATTER, 901, "h.7", absl::Seconds(15));
  std::vector<v1::Diagnosis> d =
      TelemetryAnalyzer::Diagnose(job, StalledSince(2, absl::Seconds(15)), kNow, {});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].kind(), v1::Diagnosis::SCHEDULE_MISMATCH);
  EXPECT_EQ(d[0].message(),
            "ranks disagree on the collective schedule: rank 0 waits in all_gather #5123 (unit "
            "h.7) for 15.0 s, which rank 1 has not entered, while rank 1 waits in "
            "reduce_scatter #901 (unit h.7)");
}

TEST(TelemetryAnalyzerTest, FlagsARankLaggingMoreThanTwentyPercentOfTheStepOrFiftyMs) {
  v1::JobStatus job = Job(3);
  job.mutable_members(1)->mutable_telemetry()->set_arrival_lag_median_ms(120);  // > 80 ms
  job.mutable_members(2)->mutable_telemetry()->set_arrival_lag_median_ms(70);   // < 80 ms
  std::vector<v1::Diagnosis> d =
      TelemetryAnalyzer::Diagnose(job, StalledSince(3, absl::ZeroDuration()), kNow, {});
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].kind(), v1::Diagnosis::STRAGGLER);
  EXPECT_EQ(d[0].ranks(0), 1);
  // Short steps: the 50 ms floor.
  for (auto& m : *job.mutable_members()) m.mutable_last_step()->set_step_ms(10);
  job.mutable_members(1)->mutable_telemetry()->set_arrival_lag_median_ms(45);
  job.mutable_members(2)->mutable_telemetry()->set_arrival_lag_median_ms(-1);  // < 20 steps
  EXPECT_TRUE(
      TelemetryAnalyzer::Diagnose(job, StalledSince(3, absl::ZeroDuration()), kNow, {}).empty());
}

TEST(TelemetryAnalyzerTest, OnlyRunningJobsAreDiagnosed) {
  v1::JobStatus job = Job(2);
  job.mutable_members(1)->mutable_telemetry()->set_arrival_lag_median_ms(500);
  job.set_state(v1::DEGRADED);
  EXPECT_TRUE(
      TelemetryAnalyzer::Diagnose(job, StalledSince(2, absl::ZeroDuration()), kNow, {}).empty());
}

// A hang that ends with its generation (the job recovered, or moved on)
// says so in the log, as one that ends in place does: an operator reading
// the log sees every diagnosis end.
TEST(TelemetryAnalyzerTest, ADiagnosisEndedByANewGenerationIsLoggedAsCleared) {
  FakeClock clock(kNow);
  std::vector<std::string> lines;
  EventLog log([&lines](const std::string& line) { lines.push_back(line); });
  TelemetryAnalyzer analyzer(&clock, &log, {});
  v1::GetStatusResponse status;
  v1::JobStatus* job = status.add_jobs();
  *job = Job(2);
  job->mutable_members(1)->mutable_telemetry()->set_gathers_entered(5122);
  Waiting(job->mutable_members(0), v1::ALL_GATHER, 5123, "u", absl::Seconds(1));
  analyzer.Analyze(status);  // rank 1's progress noted now
  clock.Advance(absl::Seconds(12));
  Waiting(job->mutable_members(0), v1::ALL_GATHER, 5123, "u", absl::Seconds(13));
  analyzer.Analyze(status);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("event=hang"), std::string::npos) << lines[0];

  job->set_generation(2);
  job->mutable_members(0)->mutable_telemetry()->clear_in_progress();
  analyzer.Analyze(status);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[1].find("event=diagnosis_cleared"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("generation 2 began"), std::string::npos) << lines[1];

  // A job that is gone takes its diagnoses with it, said too.
  job->mutable_members(0)->mutable_telemetry()->set_gathers_entered(9);
  Waiting(job->mutable_members(0), v1::ALL_GATHER, 5123, "u", absl::Seconds(13));
  analyzer.Analyze(status);
  clock.Advance(absl::Seconds(12));
  Waiting(job->mutable_members(0), v1::ALL_GATHER, 5123, "u", absl::Seconds(25));
  analyzer.Analyze(status);
  const size_t before = lines.size();
  analyzer.Analyze(v1::GetStatusResponse());
  ASSERT_GT(lines.size(), before);
  EXPECT_NE(lines.back().find("the job is gone"), std::string::npos) << lines.back();
}

TEST(TelemetryAnalyzerTest, FormatRanksFoldsRunsAndCapsThem) {
  EXPECT_EQ(FormatRanks({3, 0, 1, 2, 7, 9, 10}), "0-3,7,9,10");
  EXPECT_EQ(FormatRanks({0, 2, 4, 6}, 2), "0,2 and 2 more");
}

}  // namespace
}  // namespace zeroshard
