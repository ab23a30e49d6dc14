#include "common/request_budget.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace zeroshard {
namespace {

using google::protobuf::internal::WireFormatLite;

// A std::string of `size` characters as the heap holds it (libstdc++: 15
// inline; a longer one's block of size + 1, which malloc rounds up to 16
// with an 8-byte header, 32 at least), and its pointer in a repeated field,
// whose array grows by doubling: up to two pointers' room a string.
size_t ParsedStringBytes(uint32_t size) {
  constexpr size_t kSlot = 2 * sizeof(void*);
  if (size <= 15) return kSlot + sizeof(std::string);
  return kSlot + sizeof(std::string) + std::max<size_t>(32, (size + 1 + 8 + 15) / 16 * 16);
}

// The message object itself and its small fields: a fixed allowance beyond
// the fields' own bytes.
constexpr size_t kMessageBytes = 1024;

}  // namespace

absl::StatusOr<std::unique_ptr<RequestBudget::Hold>> RequestBudget::Take(size_t bytes,
                                                                         absl::string_view method) {
  absl::MutexLock lock(&mu_);
  if (in_use_ + bytes > max_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a ", method, " of ", bytes, " bytes (as received and parsed) while requests of ", in_use_,
        " bytes are in flight; at most ", max_bytes_, " (", bound_,
        "): send it again later, or a smaller one"));
  }
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  return std::make_unique<Hold>(this, bytes);
}

void RequestBudget::Release(size_t bytes) {
  absl::MutexLock lock(&mu_);
  in_use_ -= bytes;
}

size_t RequestBudget::in_use() {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

size_t RequestBudget::peak() {
  absl::MutexLock lock(&mu_);
  return peak_;
}

absl::StatusOr<size_t> RequestBudget::ParsedBytes(const grpc::ByteBuffer& wire) {
  // ProtoBufferReader reads the slices in place (no copy of the request).
  grpc::ByteBuffer copy(wire);  // shares the slices: a reference count each
  grpc::ProtoBufferReader reader(&copy);
  google::protobuf::io::CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT32_MAX);
  size_t parsed = kMessageBytes;
  while (uint32_t tag = in.ReadTag()) {
    bool ok = true;
    switch (WireFormatLite::GetTagWireType(tag)) {
      case WireFormatLite::WIRETYPE_LENGTH_DELIMITED: {
        uint32_t size = 0;
        ok = in.ReadVarint32(&size) && in.Skip(static_cast<int>(size));
        parsed += ParsedStringBytes(size);
        break;
      }
      case WireFormatLite::WIRETYPE_VARINT: {
        uint64_t ignored = 0;
        ok = in.ReadVarint64(&ignored);
        parsed += 8;
        break;
      }
      case WireFormatLite::WIRETYPE_FIXED64:
        ok = in.Skip(8);
        parsed += 8;
        break;
      case WireFormatLite::WIRETYPE_FIXED32:
        ok = in.Skip(4);
        parsed += 8;
        break;
      default:  // groups: no zeroshard message has one
        ok = false;
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("the request's bytes are not a protobuf message (field ",
                       WireFormatLite::GetTagFieldNumber(tag), " cut short or malformed)"));
    }
  }
  return parsed;
}

}  // namespace zeroshard
