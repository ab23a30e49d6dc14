#include "shard_server/observability/metrics_http.h"

#include <civetweb.h>

#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "shard_server/auth/bearer_auth.h"

namespace zeroshard {
namespace {

std::string UrlDecode(absl::string_view in) {
  std::string out(in.size() + 1, '\0');
  int n = mg_url_decode(in.data(), static_cast<int>(in.size()), out.data(),
                        static_cast<int>(out.size()), /*is_form_url_encoded=*/1);
  out.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return out;
}

std::map<std::string, std::string> ParseQuery(const char* query) {
  std::map<std::string, std::string> out;
  if (query == nullptr) return out;
  for (absl::string_view pair : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(pair, absl::MaxSplits('=', 1));
    out[UrlDecode(kv.first)] = UrlDecode(kv.second);
  }
  return out;
}

void Send(mg_connection* connection, const HttpResponse& response) {
  const char* reason = response.status == 200   ? "OK"
                       : response.status == 401 ? "Unauthorized"
                       : response.status == 404 ? "Not Found"
                       : response.status == 400 ? "Bad Request"
                       : response.status == 503 ? "Service Unavailable"
                                                : "Error";
  mg_printf(connection,
            "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            response.status, reason, response.content_type.c_str(), response.body.size());
  mg_write(connection, response.body.data(), response.body.size());
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, std::string auth_token, std::map<std::string, HttpPage> pages) {
  static std::once_flag init;
  std::call_once(init, [] { mg_init_library(0); });
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->auth_token_ = std::move(auth_token);
  server->SetPages(std::move(pages));
  // civetweb gives each connection a thread until its request is read and
  // answered. With 4 threads and 10 s to send a request, six clients that
  // open a connection and say nothing held /metrics for ~15 s and a few
  // hundred held it for good (#29). So: enough threads for the scrapers and
  // dashboards a cluster has, a request must arrive within 2 s (a scraper's
  // GET takes milliseconds), idle keep-alives go after 1 s, at most 64
  // connections wait for a thread (more are refused at once, not queued
  // without end), and the request line and headers fit in 16 KiB. Linger
  // off (-1), not 0: with 0 the close after the last write was abortive (a
  // reset), and the kernel dropped what a slow reader had not read yet (a
  // 32K-rank /metrics stopped after 128,000 bytes under load, #31); off,
  // close returns at once and the kernel sends the rest, holding no thread.
  const char* options[] = {"listening_ports",
                           listen.c_str(),
                           "num_threads",
                           "32",
                           "connection_queue",
                           "64",
                           "listen_backlog",
                           "64",
                           "request_timeout_ms",
                           "2000",
                           "keep_alive_timeout_ms",
                           "1000",
                           "linger_timeout_ms",
                           "-1",
                           "max_request_size",
                           "16384",
                           nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  mg_init_data init_data{&callbacks, server.get(), options};
  char error_text[256] = "";
  unsigned error_code = 0;
  mg_error_data error{&error_code, error_text, sizeof(error_text)};
  server->context_ = mg_start2(&init_data, &error);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on --metrics_listen=", listen, ": ", error_text));
  }
  // Handlers match by prefix: "/" takes every path, and Handle matches
  // exactly (the set of pages changes while serving).
  mg_set_request_handler(server->context_, "/", &MetricsHttpServer::Handle, server.get());
  mg_server_port ports[4];
  int n = mg_get_server_ports(server->context_, 4, ports);
  if (n < 1) return absl::UnavailableError("metrics server: no listening port");
  server->port_ = ports[0].port;
  return server;
}

int MetricsHttpServer::Handle(mg_connection* connection, void* self_ptr) {
  auto* self = static_cast<MetricsHttpServer*>(self_ptr);
  const mg_request_info* info = mg_get_request_info(connection);
  // The page is rendered under the lock (SetPages waits for it: what it
  // reads may go after) and sent after it, so that a slow reader never
  // holds up a change of pages (a leader stepping down).
  HttpResponse response = self->Render(connection, info);
  Send(connection, response);
  return response.status;
}

HttpResponse MetricsHttpServer::Render(mg_connection* connection, const mg_request_info* info) {
  absl::ReaderMutexLock lock(&pages_mu_);
  if (pages_.empty()) return {503, "text/plain; charset=utf-8", "not serving (between terms)\n"};
  auto page = pages_.find(info->local_uri != nullptr ? info->local_uri : "");
  if (page == pages_.end()) return {404, "text/plain; charset=utf-8", "no such page\n"};
  if (page->second.needs_token && !auth_token_.empty()) {
    ClientMetadata metadata;
    const char* header = mg_get_header(connection, "Authorization");
    if (header != nullptr) metadata.emplace("authorization", grpc::string_ref(header));
    grpc::Status auth = CheckBearerToken(metadata, auth_token_);
    if (!auth.ok()) {
      return {401, "text/plain; charset=utf-8", absl::StrCat(auth.error_message(), "\n")};
    }
  }
  return page->second.render(ParseQuery(info->query_string));
}

void MetricsHttpServer::SetPages(std::map<std::string, HttpPage> pages) {
  absl::MutexLock lock(&pages_mu_);
  pages_ = std::move(pages);
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ != nullptr) mg_stop(context_);
}

}  // namespace zeroshard
