// The safetensors file format (https://github.com/huggingface/safetensors):
//   u64 little-endian N | N bytes of JSON header | data
// The header maps each tensor name to {"dtype", "shape", "data_offsets":
// [begin, end)} with offsets in bytes relative to the start of the data;
// tensors are row-major, little-endian and packed back to back. An optional
// "__metadata__" entry maps strings to strings.
#ifndef ZEROSHARD_COMMON_SAFETENSORS_H_
#define ZEROSHARD_COMMON_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/file_util.h"

namespace zeroshard {

using SafetensorsMetadata = std::map<std::string, std::string>;

// A tensor to write: the writer computes where its bytes go.
struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // empty: 0-d, one element
};

// A tensor found in a file.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // absolute byte offsets in the file, [begin, end)
  int64_t end = 0;

  int64_t Bytes() const { return end - begin; }
  int64_t Rows() const;         // dim 0; 1 for a 0-d tensor
  int64_t RowElements() const;  // product of dims 1..; 1 for 0-d and 1-d
  int64_t Elements() const;
};

// The 8-byte size followed by the JSON header, padded with spaces so the data
// starts at a multiple of 8 bytes. Header keys: "__metadata__" first (omitted
// when `metadata` is empty), then the entries in the given order, laid out
// back to back. `offsets` (if not null) gets each entry's [begin, end) in
// bytes relative to the data start; `file_size` (if not null) the total file
// size in bytes. INVALID_ARGUMENT for empty, duplicate or "__metadata__"
// names, negative dims, sizes overflowing int64 or names/metadata that are
// not UTF-8.
absl::StatusOr<std::string> BuildSafetensorsHeader(
    const std::vector<TensorEntry>& entries, const SafetensorsMetadata& metadata,
    std::vector<std::pair<int64_t, int64_t>>* offsets, int64_t* file_size = nullptr);

// Random access to a safetensors file. Open() reads and validates only the
// header; tensor data is read on demand with pread, so the methods are
// thread-safe.
class SafetensorsReader {
 public:
  // Headers larger than this are refused (bytes); the Rust reference uses the same.
  static constexpr int64_t kMaxHeaderBytes = 100'000'000;

  // Validates the header: size, JSON, every entry's dtype, shape and
  // data_offsets, and that the tensors tile the data section exactly (no gap,
  // no overlap, nothing after). INVALID_ARGUMENT names the file, the tensor
  // and the bad value; DATA_LOSS if the file is shorter than the header says.
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(const std::string& path);
  // The same over bytes in memory (a file's contents), named `name` in
  // errors. `bytes` must outlive the reader.
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> OpenBuffer(const std::string& name,
                                                                       absl::string_view bytes);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  // In header order (which is data order for files written by SafetensorsWriter
  // and by the Python library).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  std::vector<std::string> names() const;
  // Null if absent.
  const TensorInfo* Find(absl::string_view name) const;
  const SafetensorsMetadata& metadata() const { return metadata_; }
  int64_t data_begin() const { return data_begin_; }  // bytes: 8 + N
  int64_t file_size() const { return file_size_; }    // bytes

  // `length` bytes of tensor `name` starting `byte_offset` bytes into it.
  // NOT_FOUND for an unknown name, OUT_OF_RANGE outside the tensor, DATA_LOSS
  // if the file shrank since Open().
  absl::Status ReadBytes(absl::string_view name, int64_t byte_offset, int64_t length,
                         void* out) const;

  // Rows [row_begin, row_end) of dim 0 (a 0-d tensor has one row) as f32;
  // `out` holds (row_end - row_begin) * RowElements() floats. F32, BF16 and
  // F16 only (INVALID_ARGUMENT otherwise).
  absl::Status ReadRowsAsF32(absl::string_view name, int64_t row_begin, int64_t row_end,
                             float* out) const;

 private:
  SafetensorsReader(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  // Fills tensors_, index_ and metadata_ from the header, checked.
  absl::Status ParseHeader();
  // The header's JSON text; sets file_size_ and data_begin_.
  absl::StatusOr<std::string> ReadHeaderText();
  // The tensors tile the data section exactly; rebases their offsets to the
  // file.
  absl::Status CheckTensorsTileTheData();
  absl::Status PRead(int64_t offset, int64_t length, void* out) const;

  const std::string path_;
  const int fd_;              // -1: reading `buffer_`
  absl::string_view buffer_;  // OpenBuffer's bytes
  int64_t file_size_ = 0;
  int64_t data_begin_ = 0;
  std::vector<TensorInfo> tensors_;
  absl::flat_hash_map<std::string, size_t> index_;  // name -> tensors_ index
  SafetensorsMetadata metadata_;
};

// Streams a safetensors file without holding the tensors in memory: the
// header (with every offset) is written by Create(), then the caller
// Append()s each tensor's raw little-endian bytes in entry order, in pieces
// of any size, and calls Finish().
class SafetensorsWriter {
 public:
  // Writes to `path` through an AtomicFile: nothing appears at `path` until
  // Finish() succeeds; dropping the writer earlier leaves no file.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<TensorEntry> entries,
      const SafetensorsMetadata& metadata = {});
  // Writes to `sink` (not owned; must outlive the writer), e.g. an RPC stream.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> CreateToSink(
      ByteSink* sink, std::vector<TensorEntry> entries, const SafetensorsMetadata& metadata = {});

  // INVALID_ARGUMENT (nothing written) if `bytes` goes past the declared
  // data. A sink error is returned and sticks: every later call fails.
  absl::Status Append(const void* data, int64_t bytes);
  // FAILED_PRECONDITION naming the first incomplete tensor unless every
  // declared byte was appended; then commits the file (fsync + rename) when
  // writing to a path.
  absl::Status Finish();

  const std::vector<TensorEntry>& entries() const { return entries_; }
  // [begin, end) of each entry relative to the data start, bytes.
  const std::vector<std::pair<int64_t, int64_t>>& offsets() const { return offsets_; }
  // The size field and header exactly as written (its length is the data start).
  const std::string& header() const { return header_; }
  int64_t file_size() const { return file_size_; }           // bytes, when finished
  int64_t data_bytes_appended() const { return appended_; }  // bytes so far

 private:
  SafetensorsWriter() = default;
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Start(
      std::unique_ptr<AtomicFile> file, ByteSink* sink, std::vector<TensorEntry> entries,
      const SafetensorsMetadata& metadata);

  std::unique_ptr<AtomicFile> file_;  // set when writing to a path
  ByteSink* sink_ = nullptr;          // file_.get() or the caller's sink
  std::vector<TensorEntry> entries_;
  std::vector<std::pair<int64_t, int64_t>> offsets_;
  std::string header_;
  int64_t file_size_ = 0;
  int64_t data_size_ = 0;  // bytes
  int64_t appended_ = 0;   // data bytes appended
  absl::Status status_;    // first error; sticky
  bool finished_ = false;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_SAFETENSORS_H_
