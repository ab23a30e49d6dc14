#include "common/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model_spec.h"
#include "nlohmann/json.hpp"

namespace zeroshard {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; reads and writes copy raw bytes");

using OrderedJson = nlohmann::ordered_json;

namespace {

constexpr char kMetadataKey[] = "__metadata__";

// Product of `shape` times `element_size`, in bytes; false on a negative dim
// or int64 overflow.
bool ShapeBytes(const std::vector<int64_t>& shape, int64_t element_size, int64_t* bytes) {
  int64_t n = element_size;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return false;
  }
  *bytes = n;
  return true;
}

// A JSON integer that fits int64.
bool GetInt64(const OrderedJson& value, int64_t* out) {
  if (value.is_number_unsigned()) {
    uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (value.is_number_integer()) {
    *out = value.get<int64_t>();
    return true;
  }
  return false;
}

std::string Describe(const OrderedJson& value) {
  std::string text = value.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
  if (text.size() > 80) text = absl::StrCat(text.substr(0, 77), "...");
  return text;
}

// __metadata__: null, or an object of strings, into `*out`.
absl::Status ParseMetadata(const std::string& path, const OrderedJson& value,
                           SafetensorsMetadata* out) {
  if (value.is_null()) return absl::OkStatus();
  if (!value.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": __metadata__ is ", Describe(value),
                                                   "; expected an object of strings"));
  }
  for (auto m = value.begin(); m != value.end(); ++m) {
    if (!m.value().is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": __metadata__[\"", m.key(), "\"] is ",
                                                     Describe(m.value()), "; expected a string"));
    }
    (*out)[m.key()] = m.value().get<std::string>();
  }
  return absl::OkStatus();
}

// One tensor entry {"dtype", "shape", "data_offsets"}, its offsets relative
// to the data section and checked against its dtype and shape.
absl::StatusOr<TensorInfo> ParseTensorEntry(const std::string& path, const std::string& name,
                                            const OrderedJson& value) {
  const std::string where = absl::StrCat(path, ": tensor \"", name, "\"");
  if (!value.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " is ", Describe(value), "; expected an object"));
  }
  TensorInfo info;
  info.name = name;

  auto dtype_it = value.find("dtype");
  if (dtype_it == value.end() || !dtype_it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": dtype is ", dtype_it == value.end() ? "missing" : Describe(*dtype_it),
        "; expected a string such as \"F32\""));
  }
  absl::StatusOr<DType> dtype = ParseDType(dtype_it->get<std::string>());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", dtype.status().message()));
  }
  info.dtype = *dtype;

  auto shape_it = value.find("shape");
  if (shape_it == value.end() || !shape_it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": shape is ", shape_it == value.end() ? "missing" : Describe(*shape_it),
        "; expected an array of non-negative integers"));
  }
  for (const OrderedJson& dim : *shape_it) {
    int64_t d;
    if (!GetInt64(dim, &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": shape ", Describe(*shape_it),
                                                     " has dim ", Describe(dim),
                                                     "; expected non-negative integers"));
    }
    info.shape.push_back(d);
  }
  int64_t bytes;
  if (!ShapeBytes(info.shape, DTypeSize(info.dtype), &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": shape ", ShapeString(info.shape), " is larger than 2^63 bytes"));
  }

  auto off_it = value.find("data_offsets");
  int64_t begin = 0, end = 0;
  if (off_it == value.end() || !off_it->is_array() || off_it->size() != 2 ||
      !GetInt64((*off_it)[0], &begin) || !GetInt64((*off_it)[1], &end) || begin < 0 ||
      end < begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": data_offsets is ", off_it == value.end() ? "missing" : Describe(*off_it),
        "; expected [begin, end] with 0 <= begin <= end"));
  }
  if (end - begin != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": data_offsets [", begin, ",", end, "] span ", end - begin, " bytes; expected ",
        bytes, " (", DTypeName(info.dtype), " ", ShapeString(info.shape), ")"));
  }
  info.begin = begin;  // relative to the data section until CheckTensorsTileTheData
  info.end = end;
  return info;
}

}  // namespace

int64_t TensorInfo::Rows() const { return shape.empty() ? 1 : shape[0]; }

int64_t TensorInfo::RowElements() const {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

int64_t TensorInfo::Elements() const { return Rows() * RowElements(); }

// ---------------------------------------------------------------------------
// Header

absl::StatusOr<std::string> BuildSafetensorsHeader(
    const std::vector<TensorEntry>& entries, const SafetensorsMetadata& metadata,
    std::vector<std::pair<int64_t, int64_t>>* offsets, int64_t* file_size) {
  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) {
    OrderedJson meta = OrderedJson::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[kMetadataKey] = std::move(meta);
  }
  std::vector<std::pair<int64_t, int64_t>> spans;
  spans.reserve(entries.size());
  std::set<absl::string_view> seen;
  int64_t data_size = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const TensorEntry& e = entries[i];
    if (e.name.empty() || e.name == kMetadataKey) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors entry ", i, ": name \"", e.name,
                       "\" is not allowed; expected a non-empty name other than __metadata__"));
    }
    if (!seen.insert(e.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors entry ", i, ": duplicate name \"", e.name, "\""));
    }
    int64_t bytes;
    if (!ShapeBytes(e.shape, DTypeSize(e.dtype), &bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors entry \"", e.name, "\": shape ", ShapeString(e.shape),
                       " has a negative dim or more than 2^63 bytes"));
    }
    int64_t end;
    if (__builtin_add_overflow(data_size, bytes, &end)) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors entry \"", e.name, "\": total data size overflows int64"));
    }
    spans.emplace_back(data_size, end);
    data_size = end;
    OrderedJson info = OrderedJson::object();
    info["dtype"] = DTypeName(e.dtype);
    info["shape"] = e.shape;
    info["data_offsets"] = {spans.back().first, spans.back().second};
    header[e.name] = std::move(info);
  }

  std::string json;
  try {
    json = header.dump(-1, ' ', false, OrderedJson::error_handler_t::strict);
  } catch (const OrderedJson::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors header: a name or metadata string is not UTF-8: ", e.what()));
  }
  // Pad so that 8 + N, the data start, is a multiple of 8 (aligned reads).
  json.append((8 - json.size() % 8) % 8, ' ');
  const uint64_t n = json.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += json;

  if (offsets != nullptr) *offsets = std::move(spans);
  if (file_size != nullptr) *file_size = static_cast<int64_t>(out.size()) + data_size;
  return out;
}

// ---------------------------------------------------------------------------
// Reader

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(
    const std::string& path) {
  // O_NONBLOCK: a FIFO's open would wait for a writer for ever (#44
  // finding 10); only a regular file is read, which the flag leaves alone.
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoStatus(errno, "open", path);
  std::unique_ptr<SafetensorsReader> reader(new SafetensorsReader(path, fd));
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoStatus(errno, "stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": not a regular file (a FIFO, socket or device); expected a "
                     "safetensors file"));
  }
  absl::Status status = reader->ParseHeader();
  if (!status.ok()) return status;
  return reader;
}

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::OpenBuffer(
    const std::string& name, absl::string_view bytes) {
  std::unique_ptr<SafetensorsReader> reader(new SafetensorsReader(name, -1));
  reader->buffer_ = bytes;
  absl::Status status = reader->ParseHeader();
  if (!status.ok()) return status;
  return reader;
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) close(fd_);
}

absl::Status SafetensorsReader::PRead(int64_t offset, int64_t length, void* out) const {
  if (fd_ < 0) {
    if (offset < 0 || length < 0 || offset + length > static_cast<int64_t>(buffer_.size())) {
      return absl::DataLossError(absl::StrCat(path_, ": unexpected end of data at byte ", offset,
                                              " (", length, " more bytes expected)"));
    }
    std::memcpy(out, buffer_.data() + offset, static_cast<size_t>(length));
    return absl::OkStatus();
  }
  char* p = static_cast<char*>(out);
  while (length > 0) {
    ssize_t n = pread(fd_, p, static_cast<size_t>(length), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "read", path_);
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path_, ": unexpected end of file at byte ", offset,
                                              " (", length, " more bytes expected)"));
    }
    p += n;
    offset += n;
    length -= n;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SafetensorsReader::ReadHeaderText() {
  if (fd_ >= 0) {
    struct stat st;
    if (fstat(fd_, &st) != 0) return ErrnoStatus(errno, "stat", path_);
    file_size_ = st.st_size;
  } else {
    file_size_ = static_cast<int64_t>(buffer_.size());
  }
  if (file_size_ < 8) {
    return absl::DataLossError(absl::StrCat(path_, ": file is ", file_size_,
                                            " bytes; expected at least the 8-byte header size"));
  }
  unsigned char size_bytes[8];
  absl::Status status = PRead(0, 8, size_bytes);
  if (!status.ok()) return status;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | size_bytes[i];
  if (n > static_cast<uint64_t>(kMaxHeaderBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": header size ", n,
                                                   " bytes exceeds the limit of ", kMaxHeaderBytes,
                                                   " (not a safetensors file?)"));
  }
  if (static_cast<int64_t>(n) > file_size_ - 8) {
    return absl::DataLossError(absl::StrCat(path_, ": header size ", n, " bytes but only ",
                                            file_size_ - 8,
                                            " bytes follow the size field (truncated?)"));
  }
  data_begin_ = 8 + static_cast<int64_t>(n);
  std::string text(n, '\0');
  status = PRead(8, static_cast<int64_t>(n), text.data());
  if (!status.ok()) return status;
  return text;
}

absl::Status SafetensorsReader::ParseHeader() {
  absl::StatusOr<std::string> text = ReadHeaderText();
  if (!text.ok()) return text.status();
  OrderedJson header;
  try {
    header = OrderedJson::parse(*text);
  } catch (const OrderedJson::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": header is a JSON ", header.type_name(), "; expected an object"));
  }
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == kMetadataKey) {
      if (absl::Status s = ParseMetadata(path_, it.value(), &metadata_); !s.ok()) return s;
      continue;
    }
    absl::StatusOr<TensorInfo> info = ParseTensorEntry(path_, it.key(), it.value());
    if (!info.ok()) return info.status();
    index_.emplace(it.key(), tensors_.size());
    tensors_.push_back(*std::move(info));
  }
  return CheckTensorsTileTheData();
}

absl::Status SafetensorsReader::CheckTensorsTileTheData() {
  // The tensors must tile [0, data size) exactly. Sort by offset rather than
  // trusting header order, which JSON does not guarantee.
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(tensors_.size());
  for (const TensorInfo& t : tensors_) by_offset.push_back(&t);
  std::stable_sort(by_offset.begin(), by_offset.end(),
                   [](const TensorInfo* a, const TensorInfo* b) {
                     return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
                   });
  int64_t expected = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo* t : by_offset) {
    if (t->begin != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ": tensor \"", t->name, "\": data_offsets [", t->begin, ",", t->end,
                       "] begin at ", t->begin, "; expected ", expected,
                       previous == nullptr ? " (the data start)"
                                           : absl::StrCat(" where \"", previous->name, "\" ends"),
                       t->begin > expected ? " (gap)" : " (overlap)"));
    }
    expected = t->end;
    previous = t;
  }
  const int64_t data_size = file_size_ - data_begin_;
  if (data_size < expected) {
    return absl::DataLossError(absl::StrCat(path_, ": data section is ", data_size,
                                            " bytes; the header describes ", expected,
                                            " (truncated?)"));
  }
  if (data_size > expected) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": data section is ", data_size,
                                                   " bytes; the header describes ", expected,
                                                   " (trailing bytes)"));
  }
  for (TensorInfo& t : tensors_) {
    t.begin += data_begin_;
    t.end += data_begin_;
  }
  return absl::OkStatus();
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const TensorInfo& t : tensors_) out.push_back(t.name);
  return out;
}

const TensorInfo* SafetensorsReader::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status SafetensorsReader::ReadBytes(absl::string_view name, int64_t byte_offset,
                                          int64_t length, void* out) const {
  const TensorInfo* t = Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor \"", name, "\""));
  }
  if (byte_offset < 0 || length < 0 || byte_offset > t->Bytes() ||
      length > t->Bytes() - byte_offset) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": tensor \"", name, "\": bytes [",
                                              byte_offset, ", +", length, ") outside [0, ",
                                              t->Bytes(), ")"));
  }
  return PRead(t->begin + byte_offset, length, out);
}

absl::Status SafetensorsReader::ReadRowsAsF32(absl::string_view name, int64_t row_begin,
                                              int64_t row_end, float* out) const {
  const TensorInfo* t = Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor \"", name, "\""));
  }
  if (row_begin < 0 || row_begin > row_end || row_end > t->Rows()) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": tensor \"", name, "\": rows [", row_begin,
                                              ", ", row_end, ") outside [0, ", t->Rows(), ")"));
  }
  const int64_t elements = (row_end - row_begin) * t->RowElements();
  const int64_t first = row_begin * t->RowElements();
  const int64_t size = DTypeSize(t->dtype);
  if (t->dtype == DType::kF32) return PRead(t->begin + first * size, elements * size, out);
  if (t->dtype != DType::kBF16 && t->dtype != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": tensor \"", name, "\" is ", DTypeName(t->dtype), "; expected F32, BF16 or F16"));
  }
  // Convert in bounded chunks so a huge read does not double its memory.
  constexpr int64_t kChunk = 1 << 20;  // elements
  std::vector<uint16_t> buffer(static_cast<size_t>(std::min(elements, kChunk)));
  for (int64_t done = 0; done < elements;) {
    const int64_t n = std::min(kChunk, elements - done);
    absl::Status status = PRead(t->begin + (first + done) * 2, n * 2, buffer.data());
    if (!status.ok()) return status;
    if (t->dtype == DType::kBF16) {
      for (int64_t i = 0; i < n; ++i) out[done + i] = BF16ToFloat(buffer[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) out[done + i] = F16ToFloat(buffer[i]);
    }
    done += n;
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Writer

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Start(
    std::unique_ptr<AtomicFile> file, ByteSink* sink, std::vector<TensorEntry> entries,
    const SafetensorsMetadata& metadata) {
  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter());
  absl::StatusOr<std::string> header =
      BuildSafetensorsHeader(entries, metadata, &writer->offsets_, &writer->file_size_);
  if (!header.ok()) return header.status();
  writer->header_ = *std::move(header);
  writer->data_size_ = writer->file_size_ - static_cast<int64_t>(writer->header_.size());
  writer->entries_ = std::move(entries);
  writer->file_ = std::move(file);
  writer->sink_ = writer->file_ != nullptr ? writer->file_.get() : sink;
  absl::Status status = writer->sink_->Write(writer->header_.data(), writer->header_.size());
  if (!status.ok()) return status;
  return writer;
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<TensorEntry> entries,
    const SafetensorsMetadata& metadata) {
  absl::StatusOr<std::unique_ptr<AtomicFile>> file = AtomicFile::Create(path);
  if (!file.ok()) return file.status();
  return Start(*std::move(file), nullptr, std::move(entries), metadata);
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::CreateToSink(
    ByteSink* sink, std::vector<TensorEntry> entries, const SafetensorsMetadata& metadata) {
  if (sink == nullptr) return absl::InvalidArgumentError("SafetensorsWriter: null sink");
  return Start(nullptr, sink, std::move(entries), metadata);
}

absl::Status SafetensorsWriter::Append(const void* data, int64_t bytes) {
  if (!status_.ok()) return status_;
  if (finished_) return absl::FailedPreconditionError("SafetensorsWriter: Append after Finish");
  if (bytes < 0 || bytes > data_size_ - appended_) {
    return absl::InvalidArgumentError(
        absl::StrCat("SafetensorsWriter: append of ", bytes, " bytes at data byte ", appended_,
                     " exceeds the declared ", data_size_, " data bytes"));
  }
  if (bytes == 0) return absl::OkStatus();
  status_ = sink_->Write(data, static_cast<size_t>(bytes));
  if (!status_.ok()) return status_;
  appended_ += bytes;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (!status_.ok()) return status_;
  if (finished_) return absl::FailedPreconditionError("SafetensorsWriter: Finish called twice");
  if (appended_ != data_size_) {
    // The tensor holding the next byte to write is the incomplete one.
    size_t i = 0;
    while (i < offsets_.size() && offsets_[i].second <= appended_) ++i;
    return absl::FailedPreconditionError(
        absl::StrCat("SafetensorsWriter: Finish with ", data_size_ - appended_,
                     " data bytes missing; tensor \"", i < entries_.size() ? entries_[i].name : "?",
                     "\" has ", i < offsets_.size() ? appended_ - offsets_[i].first : 0, " of ",
                     i < offsets_.size() ? offsets_[i].second - offsets_[i].first : 0, " bytes"));
  }
  finished_ = true;
  if (file_ != nullptr) status_ = file_->Commit();
  return status_;
}

}  // namespace zeroshard
