// What /metrics shows of a job too large to list rank by rank: the worst
// ranks, host summaries and histograms; every rank on request.
#include "shard_server/observability/rank_views.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "shard_server/observability/server_metrics.h"

namespace zeroshard {
namespace {

// A job of `world` healthy ranks, 8 to a host, beating and stepping.
v1::GetStatusResponse Job(int world) {
  v1::GetStatusResponse status;
  v1::JobStatus* job = status.add_jobs();
  job->set_job_id("big");
  job->set_world_size(world);
  job->set_state(v1::RUNNING);
  for (int r = 0; r < world; ++r) {
    v1::MemberStatus* m = job->add_members();
    m->set_rank(r);
    m->set_worker_id(absl::StrFormat("node%05d/%d", r / 8, r % 8));
    m->set_host(absl::StrFormat("node%05d", r / 8));
    m->set_alive(true);
    m->set_step(100);
    m->set_last_heartbeat_age_ms(200);
    m->mutable_last_step()->set_step_ms(500);
    m->mutable_telemetry()->set_arrival_lag_median_ms(2);
  }
  return status;
}

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(RankViewsTest, WorstRanksPutTheDeadThenTheHungThenStragglersThenTheSilent) {
  v1::GetStatusResponse status = Job(64);
  v1::JobStatus* job = status.mutable_jobs(0);
  job->mutable_members(40)->set_last_heartbeat_age_ms(2500);
  job->mutable_members(7)->set_straggler(true);
  job->mutable_members(30)->set_hung(true);
  job->mutable_members(50)->set_alive(false);
  std::vector<int> ranks;
  for (const v1::MemberStatus* m : WorstRanks(*job, 4)) ranks.push_back(m->rank());
  EXPECT_EQ(ranks, (std::vector<int>{50, 30, 7, 40}));
  EXPECT_EQ(WorstRanks(*job, 100).size(), 64u);
}

TEST(RankViewsTest, HostsSummarizeTheirRanks) {
  v1::GetStatusResponse status = Job(16);
  v1::JobStatus* job = status.mutable_jobs(0);
  job->mutable_members(9)->set_alive(false);
  job->mutable_members(10)->set_step(90);
  job->mutable_members(11)->mutable_last_step()->set_step_ms(1500);
  const std::vector<HostSummary> hosts = SummarizeHosts(*job);
  ASSERT_EQ(hosts.size(), 2u);
  EXPECT_EQ(hosts[1].host, "node00001");
  EXPECT_EQ(hosts[1].ranks, 8);
  EXPECT_EQ(hosts[1].alive, 7);
  EXPECT_EQ(hosts[1].step_min, 90);
  EXPECT_DOUBLE_EQ(hosts[1].step_seconds_max, 1.5);
  EXPECT_DOUBLE_EQ(hosts[0].heartbeat_age_max, 0.2);
}

TEST(RankViewsTest, AHistogramCountsEachValueUnderItsFirstBoundAndSkipsNone) {
  RankHistogram h = MakeRankHistogram({1, 2});
  for (double v : {0.5, 1.0, 1.5, 3.0, -1.0}) h.Add(v);
  EXPECT_EQ(h.counts, (std::vector<int64_t>{2, 1, 1}));
  EXPECT_EQ(h.count, 4);
  EXPECT_DOUBLE_EQ(h.sum, 6.0);
}

TEST(RankViewsTest, MetricsOfASmallJobListEveryRank) {
  const std::string text = MetricsExposition(ServerMetrics(), Job(16), {});
  EXPECT_EQ(Count(text, "zeroshard_rank_step{"), 16);
  EXPECT_NE(text.find("zeroshard_job_ranks_listed{job=\"big\"} 16\n"), std::string::npos);
}

TEST(RankViewsTest, MetricsOfALargeJobListItsWorstRanksAndSummarizeTheRest) {
  constexpr int kWorld = 4096;
  v1::GetStatusResponse status = Job(kWorld);
  status.mutable_jobs(0)->mutable_members(1234)->set_alive(false);
  const std::string text = MetricsExposition(ServerMetrics(), status, {});
  EXPECT_EQ(Count(text, "zeroshard_rank_step{"), MetricsView().worst_ranks);
  EXPECT_NE(text.find("zeroshard_rank_alive{job=\"big\",rank=\"1234\",worker=\"node00154/2\"} 0"),
            std::string::npos);
  EXPECT_EQ(Count(text, "zeroshard_host_ranks{"), kWorld / 8);
  EXPECT_NE(text.find("zeroshard_host_alive_ranks{job=\"big\",host=\"node00154\"} 7\n"),
            std::string::npos);
  EXPECT_NE(text.find("zeroshard_job_rank_step_seconds_bucket{job=\"big\",le=\"0.5\"} 4095\n"),
            std::string::npos);
  EXPECT_NE(text.find("zeroshard_job_rank_step_seconds_count{job=\"big\"} 4095\n"),
            std::string::npos);
  // Bytes per rank: the host lines (one per 8 ranks) and no per-rank listing.
  EXPECT_LT(text.size(), size_t{kWorld} * 150);

  MetricsView all;
  all.all_ranks = true;
  EXPECT_EQ(Count(MetricsExposition(ServerMetrics(), status, {}, all), "zeroshard_rank_step{"),
            kWorld);
  MetricsView one;
  one.job = "big";
  one.rank = 777;
  const std::string single = MetricsExposition(ServerMetrics(), status, {}, one);
  EXPECT_EQ(Count(single, "zeroshard_rank_step{"), 1);
  EXPECT_NE(single.find("zeroshard_rank_step{job=\"big\",rank=\"777\","), std::string::npos);
}

TEST(RankViewsTest, AStatusViewLeavesJobsOfUpToMaxMembersWhole) {
  v1::GetStatusResponse status = Job(64);
  v1::GetStatusRequest view;
  view.set_max_members(64);
  SummarizeLargeJobs(view, &status);
  EXPECT_EQ(status.jobs(0).members_size(), 64);
  EXPECT_FALSE(status.jobs(0).has_summary());
  view.set_max_members(0);  // the default: every member of every job
  v1::GetStatusResponse large = Job(4096);
  SummarizeLargeJobs(view, &large);
  EXPECT_EQ(large.jobs(0).members_size(), 4096);
}

TEST(RankViewsTest, AStatusViewOfALargeJobSendsItsSummaryWorstRanksAndLookUps) {
  constexpr int kWorld = 4096;
  v1::GetStatusResponse status = Job(kWorld);
  v1::JobStatus* job = status.mutable_jobs(0);
  job->mutable_members(1234)->set_alive(false);  // host node00154
  job->mutable_members(99)->set_straggler(true);
  job->mutable_members(3000)->set_last_heartbeat_age_ms(4000);
  v1::GetStatusRequest view;
  view.set_max_members(64);
  view.set_worst_ranks(3);
  view.set_worst_hosts(2);
  view.add_ranks(5);
  view.add_ranks(1234);  // already among the worst: listed once
  view.add_hosts("node00400");
  SummarizeLargeJobs(view, &status);
  job = status.mutable_jobs(0);
  ASSERT_TRUE(job->has_summary());
  const v1::JobSummary& summary = job->summary();
  EXPECT_EQ(summary.ranks(), kWorld);
  EXPECT_EQ(summary.alive(), kWorld - 1);
  EXPECT_EQ(summary.stragglers(), 1);
  EXPECT_EQ(summary.hosts(), kWorld / 8);
  EXPECT_EQ(summary.worst_listed(), 3);
  std::vector<int> ranks;
  for (const v1::MemberStatus& m : job->members()) ranks.push_back(m.rank());
  // The worst three, worst first; then rank 5 and host node00400's 8 ranks, by rank.
  EXPECT_EQ(ranks, (std::vector<int>{1234, 99, 3000, 5, 3200, 3201, 3202, 3203, 3204, 3205, 3206,
                                     3207}));
  ASSERT_EQ(summary.worst_hosts_size(), 2);
  EXPECT_EQ(summary.worst_hosts(0).host(), "node00154");  // a rank down
  EXPECT_EQ(summary.worst_hosts(0).alive(), 7);
  EXPECT_EQ(summary.worst_hosts(1).host(), "node00012");  // a straggler
  // The histograms are /metrics's, over the alive ranks.
  ASSERT_EQ(summary.histograms_size(), static_cast<int>(RankHistogramSpecs().size()));
  const v1::RankHistogram* age = nullptr;
  for (const v1::RankHistogram& h : summary.histograms()) {
    if (h.name() == "heartbeat_age_seconds") age = &h;
  }
  ASSERT_NE(age, nullptr);
  ASSERT_EQ(age->counts_size(), age->bounds_size() + 1);
  EXPECT_EQ(age->count(), kWorld - 1);
  EXPECT_EQ(age->counts(0), kWorld - 2);  // 0.2 s <= 0.25 s
  EXPECT_EQ(age->counts(5), 1);           // 4 s: (3, 5]
}

}  // namespace
}  // namespace zeroshard
