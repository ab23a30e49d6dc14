// The metrics port: a small HTTP server (civetweb, Debian's libcivetweb)
// serving a fixed set of pages — /metrics for Prometheus, the dashboard and
// its JSON. Pages are functions that build their whole body per request;
// each runs on one of civetweb's threads (a few), so they must be
// thread-safe.
//
// Why civetweb: a maintained, embeddable C library packaged by Debian
// (libcivetweb-dev), a thread pool and nothing else we would not use.
#ifndef ZEROSHARD_SHARD_SERVER_OBSERVABILITY_METRICS_HTTP_H_
#define ZEROSHARD_SHARD_SERVER_OBSERVABILITY_METRICS_HTTP_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

struct mg_context;
struct mg_connection;
struct mg_request_info;

namespace zeroshard {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

struct HttpPage {
  // The request's query parameters ("?job=a&rank=1").
  std::function<HttpResponse(const std::map<std::string, std::string>& query)> render;
  // With a token configured: 401 unless the request carries
  // "Authorization: Bearer <token>".
  bool needs_token = true;
};

class MetricsHttpServer {
 public:
  // Serves `pages` (by exact path) on `listen` (HOST:PORT; port 0 picks a
  // free one). `auth_token` empty: no page needs one. UNAVAILABLE naming
  // the address when it cannot listen.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, std::string auth_token, std::map<std::string, HttpPage> pages);
  ~MetricsHttpServer();  // stops serving; waits for requests in progress

  // Serves `pages` from now on, in place of the current ones, on the same
  // listening socket; returns once no request renders an old page (so that
  // what the old pages read may go). The replicated server keeps one port
  // across its terms this way: a follower's /metrics, then the leader's
  // pages, then the follower's again. Stopping civetweb instead costs up to
  // 2 s (its listener checks its stop flag that often), and a new leader
  // would wait that long for its own port. No pages: every path answers
  // 503 "not serving".
  void SetPages(std::map<std::string, HttpPage> pages) ABSL_LOCKS_EXCLUDED(pages_mu_);

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  static int Handle(::mg_connection* connection, void* self);
  // The response to a request, under pages_mu_ (shared).
  HttpResponse Render(::mg_connection* connection, const ::mg_request_info* info)
      ABSL_LOCKS_EXCLUDED(pages_mu_);

  std::string auth_token_;
  // Held shared while a page renders, exclusively while the set changes.
  absl::Mutex pages_mu_;
  std::map<std::string, HttpPage> pages_ ABSL_GUARDED_BY(pages_mu_);
  mg_context* context_ = nullptr;
  int port_ = 0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_OBSERVABILITY_METRICS_HTTP_H_
