// What a server (the shard server, a node agent) holds of the requests it is
// receiving, parsing and serving at once (#44 finding 7): 480 StoreWaits of 65,536 keys each were
// parsed at the same time, each ~8 MB once parsed, while the KV store,
// which refused most of them, counted only those it held. Such requests are
// taken as bytes (gRPC's raw callback methods) and counted here before they
// are parsed: their size and a bound on what parsing them costs, held
// until the call ends, against --max_request_bytes_in_flight. A request
// beyond it is refused RESOURCE_EXHAUSTED unparsed.
//
// Thread-safe.
#ifndef ZEROSHARD_COMMON_REQUEST_BUDGET_H_
#define ZEROSHARD_COMMON_REQUEST_BUDGET_H_

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/byte_buffer.h"

namespace zeroshard {

class RequestBudget {
 public:
  // Bytes held until destroyed.
  class Hold {
   public:
    Hold(RequestBudget* budget, size_t bytes) : budget_(budget), bytes_(bytes) {}
    ~Hold() { budget_->Release(bytes_); }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    size_t bytes() const { return bytes_; }

   private:
    RequestBudget* const budget_;
    const size_t bytes_;
  };

  // `bound`: who sets the bound, for refusals ("the server's
  // --max_request_bytes_in_flight").
  RequestBudget(size_t max_bytes, std::string bound)
      : max_bytes_(max_bytes), bound_(std::move(bound)) {}

  // Holds `bytes` for a request of `method`, or RESOURCE_EXHAUSTED naming
  // the bound and its flag when the requests in flight hold too much.
  absl::StatusOr<std::unique_ptr<Hold>> Take(size_t bytes, absl::string_view method);

  // An upper bound on the message parsed from `wire`: each length-delimited
  // field (a string, bytes or a small message) counted as a std::string
  // with its heap block and two slots in a repeated field (whose array
  // grows by doubling), each other field
  // as 8 bytes; exact for messages of strings and scalars (KV requests),
  // whose repeated strings are what a large request is made of.
  // INVALID_ARGUMENT when the bytes are not a protobuf message's. A request
  // then holds wire.Length() and this times the copies its handler makes.
  static absl::StatusOr<size_t> ParsedBytes(const grpc::ByteBuffer& wire);

  size_t in_use();
  size_t max_bytes() const { return max_bytes_; }
  // The most held at once since the start.
  size_t peak();

 private:
  void Release(size_t bytes);

  const size_t max_bytes_;
  const std::string bound_;
  absl::Mutex mu_;
  size_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  size_t peak_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_REQUEST_BUDGET_H_
