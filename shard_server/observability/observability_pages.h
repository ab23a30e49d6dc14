// What the metrics port serves, over the server's components:
//   /metrics      Prometheus text (server, jobs, ranks)     token
//   /             the dashboard (static HTML, JS and CSS)   no token: it holds no data
//   /api/status   jobs, members, diagnoses, checkpoints     token
//                 (?max_members=N: a larger job's summary and worst ranks,
//                 &rank=R,R / &host=H,H look ranks up; GetStatusRequest)
//   /api/history  ?job=ID: the job's per-step history       token
//                 (&rank=R,R: those ranks')
#ifndef ZEROSHARD_SHARD_SERVER_OBSERVABILITY_OBSERVABILITY_PAGES_H_
#define ZEROSHARD_SHARD_SERVER_OBSERVABILITY_OBSERVABILITY_PAGES_H_

#include <functional>
#include <map>
#include <string>

#include "shard_server/checkpoint/checkpoint_registry.h"
#include "shard_server/observability/history_store.h"
#include "shard_server/membership/membership.h"
#include "shard_server/observability/metrics_http.h"
#include "shard_server/observability/server_metrics.h"
#include "shard_server/observability/telemetry_analyzer.h"

namespace zeroshard {

// Not owned; `checkpoints` and `history` may be null.
struct ObservabilitySources {
  Membership* membership = nullptr;
  const TelemetryAnalyzer* diagnosis = nullptr;
  CheckpointRegistry* checkpoints = nullptr;
  const ServerMetrics* metrics = nullptr;
  HistoryStore* history = nullptr;
  // The control plane's leadership (replicated_server.h); empty: a single server.
  std::function<void(v1::ControlPlaneStatus*)> control_plane;
};

std::map<std::string, HttpPage> ObservabilityPages(const ObservabilitySources& sources);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_OBSERVABILITY_OBSERVABILITY_PAGES_H_
