#include "shard_server/observability/observability_pages.h"

#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/util/json_util.h"
#include "shard_server/observability/rank_views.h"

// The dashboard, compiled in (dashboard.html through a genrule).
extern const char kDashboardHtml[];

namespace zeroshard {
namespace {

std::string Json(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

HttpResponse JsonResponse(std::string body) { return {200, "application/json", std::move(body)}; }

HttpResponse Failure(int status, const absl::Status& error) {
  return {status, "text/plain; charset=utf-8", absl::StrCat(error.ToString(), "\n")};
}

v1::GetStatusResponse AnnotatedStatus(const ObservabilitySources& s, const std::string& job) {
  v1::GetStatusResponse status = s.membership->Status(job);
  if (s.diagnosis != nullptr) s.diagnosis->Annotate(&status);
  if (s.control_plane) s.control_plane(status.mutable_control_plane());
  return status;
}

// ?rank=R,R (comma-separated ranks >= 0) of `page`.
absl::StatusOr<std::vector<int>> RankList(absl::string_view page, absl::string_view text) {
  std::vector<int> ranks;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int rank = 0;
    if (!absl::SimpleAtoi(item, &rank) || rank < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(page, "?rank=", text, ": expected ranks >= 0, comma-separated"));
    }
    ranks.push_back(rank);
  }
  return ranks;
}

// /api/status's view of large jobs, as GetStatusRequest has it:
// ?max_members=N&worst_ranks=N&worst_hosts=N&rank=R,R&host=H,H.
absl::StatusOr<v1::GetStatusRequest> StatusViewOf(const std::map<std::string, std::string>& query) {
  v1::GetStatusRequest view;
  const std::pair<const char*, void (v1::GetStatusRequest::*)(int32_t)> counts[] = {
      {"max_members", &v1::GetStatusRequest::set_max_members},
      {"worst_ranks", &v1::GetStatusRequest::set_worst_ranks},
      {"worst_hosts", &v1::GetStatusRequest::set_worst_hosts}};
  for (const auto& [name, set] : counts) {
    auto it = query.find(name);
    if (it == query.end()) continue;
    int value = 0;
    if (!absl::SimpleAtoi(it->second, &value) || value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("/api/status?", name, "=", it->second, ": expected a count >= 0"));
    }
    (view.*set)(value);
  }
  if (auto it = query.find("rank"); it != query.end()) {
    absl::StatusOr<std::vector<int>> ranks = RankList("/api/status", it->second);
    if (!ranks.ok()) return ranks.status();
    for (int rank : *ranks) view.add_ranks(rank);
  }
  if (auto it = query.find("host"); it != query.end()) {
    for (absl::string_view host : absl::StrSplit(it->second, ',', absl::SkipEmpty())) {
      view.add_hosts(std::string(host));
    }
  }
  return view;
}

// Every job's checkpoints counted by state, for /metrics.
std::map<std::string, CheckpointCounts> CountCheckpoints(const ObservabilitySources& s) {
  std::map<std::string, CheckpointCounts> counts;
  if (s.checkpoints == nullptr) return counts;
  absl::StatusOr<v1::ListCheckpointsResponse> listed = s.checkpoints->List("");
  if (!listed.ok()) return counts;
  for (const v1::CheckpointInfo& c : listed->checkpoints()) {
    CheckpointCounts& n = counts[c.job_id()];
    if (!c.complete()) {
      n.incomplete++;
      continue;
    }
    n.complete++;
    if (c.verification() == "verified") n.verified++;
    if (c.verification() == "pending") n.pending++;
    if (c.verification() == "failed") n.failed++;
    if (c.step() > n.latest_step) {
      n.latest_step = c.step();
      n.latest_bytes = c.total_bytes();
    }
  }
  return counts;
}

// /metrics[?all=1][?job=J&rank=R]: the Prometheus exposition.
HttpResponse MetricsPage(const ObservabilitySources& s,
                         const std::map<std::string, std::string>& query) {
  MetricsView view;
  if (auto all = query.find("all"); all != query.end()) view.all_ranks = all->second != "0";
  if (auto rank = query.find("rank"); rank != query.end()) {
    auto job = query.find("job");
    if (job == query.end() || !absl::SimpleAtoi(rank->second, &view.rank) || view.rank < 0) {
      return Failure(400, absl::InvalidArgumentError(absl::StrCat(
                              "/metrics?rank=", rank->second,
                              ": expected a rank >= 0 and ?job=ID (/metrics?job=J&rank=R)")));
    }
    view.job = job->second;
  }
  v1::GetStatusResponse status = AnnotatedStatus(s, "");
  return HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8",
                      MetricsExposition(*s.metrics, status, CountCheckpoints(s), view)};
}

// /api/status[?job=J&...]: the status (StatusViewOf's view) and, for one
// job, its checkpoints.
HttpResponse StatusPage(const ObservabilitySources& s,
                        const std::map<std::string, std::string>& query) {
  absl::StatusOr<v1::GetStatusRequest> view = StatusViewOf(query);
  if (!view.ok()) return Failure(400, view.status());
  auto job = query.find("job");
  v1::GetStatusResponse status = AnnotatedStatus(s, job == query.end() ? "" : job->second);
  SummarizeLargeJobs(*view, &status);
  v1::ListCheckpointsResponse checkpoints;
  if (s.checkpoints != nullptr && job != query.end() && !job->second.empty()) {
    absl::StatusOr<v1::ListCheckpointsResponse> listed = s.checkpoints->List(job->second);
    if (listed.ok()) checkpoints = *std::move(listed);
  }
  return JsonResponse(
      absl::StrCat("{\"status\":", Json(status), ",\"checkpoints\":", Json(checkpoints), "}"));
}

// /api/history?job=J[&rank=R,R]: the job's history points (every rank's
// without ?rank: a large job's history is every rank's).
HttpResponse HistoryPage(const ObservabilitySources& s,
                         const std::map<std::string, std::string>& query) {
  auto job = query.find("job");
  if (job == query.end() || job->second.empty()) {
    return Failure(400, absl::InvalidArgumentError("/api/history needs ?job=ID"));
  }
  std::vector<int> ranks;
  if (auto rank = query.find("rank"); rank != query.end()) {
    absl::StatusOr<std::vector<int>> listed = RankList("/api/history", rank->second);
    if (!listed.ok()) return Failure(400, listed.status());
    ranks = *std::move(listed);
  }
  if (ranks.empty()) ranks.push_back(-1);  // every rank
  v1::GetHistoryResponse response;
  for (int rank : ranks) {
    if (s.history == nullptr) break;
    absl::StatusOr<std::vector<v1::HistoryPoint>> points = s.history->Points(job->second, rank);
    if (!points.ok()) return Failure(500, points.status());
    for (v1::HistoryPoint& p : *points) *response.add_points() = std::move(p);
  }
  return JsonResponse(Json(response));
}

}  // namespace

std::map<std::string, HttpPage> ObservabilityPages(const ObservabilitySources& sources) {
  const ObservabilitySources s = sources;
  std::map<std::string, HttpPage> pages;
  pages["/metrics"].render = [s](const std::map<std::string, std::string>& query) {
    return MetricsPage(s, query);
  };
  pages["/"] = {[](const std::map<std::string, std::string>&) {
                  return HttpResponse{200, "text/html; charset=utf-8", kDashboardHtml};
                },
                /*needs_token=*/false};
  pages["/api/status"].render = [s](const std::map<std::string, std::string>& query) {
    return StatusPage(s, query);
  };
  pages["/api/history"].render = [s](const std::map<std::string, std::string>& query) {
    return HistoryPage(s, query);
  };
  return pages;
}

}  // namespace zeroshard
