#include "common/safetensors.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/file_util.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

std::string TestDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/safetensors_" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name();
  mkdir(dir.c_str(), 0777);
  return dir;
}

size_t CountFiles(const std::string& dir) {
  size_t n = 0;
  DIR* d = opendir(dir.c_str());
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

std::string LittleEndianU64(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out;
}

// A file with header `json` (unpadded) followed by `data_bytes` zero bytes.
std::string WriteRaw(const std::string& dir, const std::string& name, const std::string& json,
                     size_t data_bytes) {
  const std::string path = dir + "/" + name;
  EXPECT_TRUE(
      WriteFileAtomically(path, LittleEndianU64(json.size()) + json + std::string(data_bytes, '\0'))
          .ok());
  return path;
}

// Open() fails with `code` and a message holding the path and every part.
void ExpectOpenError(const std::string& path, absl::StatusCode code,
                     std::vector<std::string> parts) {
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_FALSE(reader.ok()) << path;
  EXPECT_EQ(reader.status().code(), code) << reader.status();
  parts.push_back(path);
  for (const std::string& part : parts) {
    EXPECT_NE(reader.status().message().find(part), std::string::npos)
        << "message \"" << reader.status().message() << "\" lacks \"" << part << "\"";
  }
}

std::string Bytes(const void* data, size_t size) {
  return std::string(static_cast<const char*>(data), size);
}

struct Fixture {
  std::vector<TensorEntry> entries;
  std::vector<std::string> data;  // raw bytes per entry
};

// Several dtypes, a 0-d tensor and an empty one.
Fixture MakeFixture() {
  Fixture f;
  std::vector<float> w(3 * 4);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f * i - 2;
  f.entries.push_back({"layer.weight", DType::kF32, {3, 4}});
  f.data.push_back(Bytes(w.data(), w.size() * 4));

  std::vector<uint16_t> b = {FloatToBF16(1.0f), FloatToBF16(-2.5f), FloatToBF16(3.0f),
                             FloatToBF16(0.125f), FloatToBF16(100.0f)};
  f.entries.push_back({"bf", DType::kBF16, {5}});
  f.data.push_back(Bytes(b.data(), b.size() * 2));

  std::vector<uint16_t> h;
  for (int i = 0; i < 6; ++i) h.push_back(FloatToF16(i * 0.25f));
  f.entries.push_back({"half", DType::kF16, {2, 3}});
  f.data.push_back(Bytes(h.data(), h.size() * 2));

  int64_t ints[2] = {-7, int64_t{1} << 40};
  f.entries.push_back({"step", DType::kI64, {2}});
  f.data.push_back(Bytes(ints, sizeof(ints)));

  float scalar = 42.0f;
  f.entries.push_back({"scalar", DType::kF32, {}});
  f.data.push_back(Bytes(&scalar, 4));

  f.entries.push_back({"empty", DType::kF32, {0, 7}});
  f.data.push_back("");

  f.entries.push_back({"flags", DType::kBool, {3}});
  f.data.push_back(std::string("\x01\x00\x01", 3));

  double d = 3.25;
  f.entries.push_back({"dbl", DType::kF64, {1}});
  f.data.push_back(Bytes(&d, 8));
  return f;
}

std::string AllData(const Fixture& f) {
  std::string out;
  for (const std::string& d : f.data) out += d;
  return out;
}

// Writes the fixture, appending the data in awkward pieces that straddle tensors.
std::string WriteFixture(const std::string& path, const Fixture& f,
                         const SafetensorsMetadata& metadata) {
  auto writer = SafetensorsWriter::Create(path, f.entries, metadata);
  EXPECT_TRUE(writer.ok()) << writer.status();
  const std::string all = AllData(f);
  for (size_t pos = 0; pos < all.size(); pos += 5) {
    const size_t n = std::min<size_t>(5, all.size() - pos);
    EXPECT_TRUE((*writer)->Append(all.data() + pos, n).ok());
  }
  EXPECT_TRUE((*writer)->Append(nullptr, 0).ok());
  absl::Status status = (*writer)->Finish();
  EXPECT_TRUE(status.ok()) << status;
  return (*writer)->header();
}

TEST(SafetensorsTest, RoundTrip) {
  const std::string dir = TestDir();
  const std::string path = dir + "/model.safetensors";
  const Fixture f = MakeFixture();
  const SafetensorsMetadata metadata = {{"format", "pt"}, {"step", "100"}};
  const std::string header = WriteFixture(path, f, metadata);
  EXPECT_EQ(CountFiles(dir), 1u) << "temp file left behind";

  // Layout: size field, padded JSON with __metadata__ first, data.
  absl::StatusOr<std::string> file = ReadFileToString(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(header.size() % 8, 0u);
  EXPECT_EQ(file->substr(0, header.size()), header);
  EXPECT_EQ(file->substr(header.size()), AllData(f));
  EXPECT_EQ(file->substr(0, 8), LittleEndianU64(header.size() - 8));
  EXPECT_EQ(header.substr(8, 16), "{\"__metadata__\":");
  EXPECT_NE(
      header.find("\"layer.weight\":{\"dtype\":\"F32\",\"shape\":[3,4],\"data_offsets\":[0,48]}"),
      std::string::npos)
      << header;
  EXPECT_NE(header.find("\"scalar\":{\"dtype\":\"F32\",\"shape\":[],"), std::string::npos);

  auto reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const SafetensorsReader& r = **reader;
  EXPECT_EQ(r.metadata(), metadata);
  EXPECT_EQ(r.file_size(), static_cast<int64_t>(file->size()));
  EXPECT_EQ(r.data_begin(), static_cast<int64_t>(header.size()));
  std::vector<std::string> names;
  for (const TensorEntry& e : f.entries) names.push_back(e.name);
  EXPECT_EQ(r.names(), names);
  int64_t offset = r.data_begin();
  for (size_t i = 0; i < f.entries.size(); ++i) {
    const TensorInfo* t = r.Find(f.entries[i].name);
    ASSERT_NE(t, nullptr) << f.entries[i].name;
    EXPECT_EQ(t->dtype, f.entries[i].dtype);
    EXPECT_EQ(t->shape, f.entries[i].shape);
    EXPECT_EQ(t->begin, offset);
    EXPECT_EQ(t->Bytes(), static_cast<int64_t>(f.data[i].size()));
    offset = t->end;
    std::string bytes(t->Bytes(), '\0');
    ASSERT_TRUE(r.ReadBytes(t->name, 0, t->Bytes(), bytes.data()).ok());
    EXPECT_EQ(bytes, f.data[i]) << t->name;
  }
  EXPECT_EQ(offset, r.file_size());
  EXPECT_EQ(r.Find("missing"), nullptr);

  const TensorInfo* scalar = r.Find("scalar");
  EXPECT_EQ(scalar->Rows(), 1);
  EXPECT_EQ(scalar->Elements(), 1);
  float value = 0;
  ASSERT_TRUE(r.ReadRowsAsF32("scalar", 0, 1, &value).ok());
  EXPECT_EQ(value, 42.0f);
  EXPECT_EQ(r.Find("empty")->Elements(), 0);
  ASSERT_TRUE(r.ReadRowsAsF32("empty", 0, 0, nullptr).ok());
}

TEST(SafetensorsTest, EmptyMetadataAndNoTensors) {
  const std::string dir = TestDir();
  const Fixture f = MakeFixture();
  const std::string header = WriteFixture(dir + "/a.safetensors", f, {});
  EXPECT_EQ(header.find("__metadata__"), std::string::npos);
  auto reader = SafetensorsReader::Open(dir + "/a.safetensors");
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_TRUE((*reader)->metadata().empty());
  EXPECT_EQ((*reader)->tensors().size(), f.entries.size());

  auto writer = SafetensorsWriter::Create(dir + "/empty.safetensors", {});
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Finish().ok());
  EXPECT_EQ((*writer)->file_size(), 16);  // size field + "{}" padded to 8
  auto empty = SafetensorsReader::Open(dir + "/empty.safetensors");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE((*empty)->tensors().empty());
}

TEST(SafetensorsTest, PartialReads) {
  const std::string dir = TestDir();
  const std::string path = dir + "/rows.safetensors";
  const int64_t rows = 10, cols = 3;
  std::vector<float> f32(rows * cols);
  std::vector<uint16_t> bf16(rows * cols), f16(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    f32[i] = 0.25f * i - 1.0f;  // exact in all three formats
    bf16[i] = FloatToBF16(f32[i]);
    f16[i] = FloatToF16(f32[i]);
  }
  auto writer = SafetensorsWriter::Create(path, {{"f32", DType::kF32, {rows, cols}},
                                                 {"bf16", DType::kBF16, {rows, cols}},
                                                 {"f16", DType::kF16, {rows, cols}},
                                                 {"i32", DType::kI32, {2}}});
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Append(f32.data(), f32.size() * 4).ok());
  ASSERT_TRUE((*writer)->Append(bf16.data(), bf16.size() * 2).ok());
  ASSERT_TRUE((*writer)->Append(f16.data(), f16.size() * 2).ok());
  int32_t ints[2] = {1, 2};
  ASSERT_TRUE((*writer)->Append(ints, 8).ok());
  ASSERT_TRUE((*writer)->Finish().ok());

  auto reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const SafetensorsReader& r = **reader;
  for (const char* name : {"f32", "bf16", "f16"}) {
    std::vector<float> out(3 * cols, -99.0f);
    ASSERT_TRUE(r.ReadRowsAsF32(name, 2, 5, out.data()).ok()) << name;
    for (int64_t i = 0; i < 3 * cols; ++i) EXPECT_EQ(out[i], f32[2 * cols + i]) << name << i;
    std::vector<float> last(cols);
    ASSERT_TRUE(r.ReadRowsAsF32(name, rows - 1, rows, last.data()).ok());
    EXPECT_EQ(last[cols - 1], f32.back());
  }
  float two[2];
  ASSERT_TRUE(r.ReadBytes("f32", 4 * 7, 8, two).ok());
  EXPECT_EQ(two[0], f32[7]);
  EXPECT_EQ(two[1], f32[8]);

  float sink[64];
  EXPECT_EQ(r.ReadRowsAsF32("f32", 5, 11, sink).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.ReadRowsAsF32("f32", 3, 2, sink).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.ReadRowsAsF32("f32", -1, 2, sink).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.ReadRowsAsF32("nope", 0, 1, sink).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.ReadRowsAsF32("i32", 0, 1, sink).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.ReadBytes("f32", 100, 21, sink).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.ReadBytes("f32", -1, 4, sink).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.ReadBytes("f32", 0, -4, sink).code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(r.ReadBytes("f32", 120, 0, sink).ok());
  EXPECT_EQ(r.ReadBytes("nope", 0, 1, sink).code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, SinkWriterMatchesFileWriter) {
  const std::string dir = TestDir();
  const Fixture f = MakeFixture();
  WriteFixture(dir + "/file.safetensors", f, {{"k", "v"}});
  std::string streamed;
  StringSink sink(&streamed);
  auto writer = SafetensorsWriter::CreateToSink(&sink, f.entries, {{"k", "v"}});
  ASSERT_TRUE(writer.ok());
  const std::string all = AllData(f);
  ASSERT_TRUE((*writer)->Append(all.data(), all.size()).ok());
  ASSERT_TRUE((*writer)->Finish().ok());
  EXPECT_EQ(streamed, *ReadFileToString(dir + "/file.safetensors"));
  EXPECT_EQ((*writer)->file_size(), static_cast<int64_t>(streamed.size()));
}

TEST(SafetensorsTest, BuildHeaderOffsetsAndSize) {
  std::vector<std::pair<int64_t, int64_t>> offsets;
  int64_t file_size = 0;
  auto header = BuildSafetensorsHeader(
      {{"a", DType::kF16, {3}}, {"b", DType::kF32, {}}, {"c", DType::kU8, {0}}}, {}, &offsets,
      &file_size);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(offsets, (std::vector<std::pair<int64_t, int64_t>>{{0, 6}, {6, 10}, {10, 10}}));
  EXPECT_EQ(file_size, static_cast<int64_t>(header->size()) + 10);
  EXPECT_EQ(header->size() % 8, 0u);
  EXPECT_EQ(header->back(), ' ');  // this JSON needs padding
}

TEST(SafetensorsTest, WriterRefusesBadEntriesAndByteCounts) {
  const std::string dir = TestDir();
  std::vector<std::pair<int64_t, int64_t>> offsets;
  EXPECT_EQ(BuildSafetensorsHeader({{"a", DType::kF32, {1}}, {"a", DType::kF32, {1}}}, {}, &offsets)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildSafetensorsHeader({{"a", DType::kF32, {2, -1}}}, {}, &offsets).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      BuildSafetensorsHeader({{"__metadata__", DType::kF32, {1}}}, {}, &offsets).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildSafetensorsHeader({{"", DType::kF32, {1}}}, {}, &offsets).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildSafetensorsHeader({{"big", DType::kF64, {int64_t{1} << 31, int64_t{1} << 31}}}, {},
                                   &offsets)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildSafetensorsHeader({{"bad\xff", DType::kF32, {1}}}, {}, &offsets).status().code(),
            absl::StatusCode::kInvalidArgument);

  const std::string path = dir + "/partial.safetensors";
  {
    auto writer =
        SafetensorsWriter::Create(path, {{"a", DType::kF32, {2}}, {"b", DType::kF32, {3}}});
    ASSERT_TRUE(writer.ok());
    float data[5] = {1, 2, 3, 4, 5};
    absl::Status too_much = (*writer)->Append(data, 24);
    EXPECT_EQ(too_much.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*writer)->data_bytes_appended(), 0);
    ASSERT_TRUE((*writer)->Append(data, 12).ok());
    absl::Status early = (*writer)->Finish();
    EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(early.message().find("\"b\" has 4 of 12 bytes"), std::string::npos) << early;
    // The writer is dropped without finishing: no file, no temp file.
  }
  EXPECT_EQ(CountFiles(dir), 0u);
}

TEST(SafetensorsTest, TensorsInAnyHeaderOrder) {
  const std::string dir = TestDir();
  const std::string path =
      WriteRaw(dir, "order.safetensors",
               R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
               R"("a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"__metadata__":{"x":"y"}})",
               12);
  auto reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->names(), (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ((*reader)->metadata().at("x"), "y");
  EXPECT_EQ((*reader)->Find("a")->begin, (*reader)->data_begin());
}

TEST(SafetensorsTest, ValidationErrors) {
  const std::string dir = TestDir();
  using Code = absl::StatusCode;
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

  // Truncated: shorter than the size field, than the header, than the data.
  const std::string tiny = dir + "/tiny";
  ASSERT_TRUE(WriteFileAtomically(tiny, "abc").ok());
  ExpectOpenError(tiny, Code::kDataLoss, {"3 bytes"});
  const std::string full = WriteRaw(dir, "full", "{" + ok_entry + "}", 8);
  std::string bytes = *ReadFileToString(full);
  const std::string cut_header = dir + "/cut_header";
  ASSERT_TRUE(WriteFileAtomically(cut_header, bytes.substr(0, 20)).ok());
  ExpectOpenError(cut_header, Code::kDataLoss, {"header size"});
  const std::string cut_data = dir + "/cut_data";
  ASSERT_TRUE(WriteFileAtomically(cut_data, bytes.substr(0, bytes.size() - 3)).ok());
  ExpectOpenError(cut_data, Code::kDataLoss, {"data section is 5 bytes", "describes 8"});

  // Header size beyond the limit.
  const std::string huge = dir + "/huge";
  ASSERT_TRUE(WriteFileAtomically(huge, LittleEndianU64(200'000'000) + "{}").ok());
  ExpectOpenError(huge, Code::kInvalidArgument, {"header size 200000000", "limit"});

  ExpectOpenError(WriteRaw(dir, "notjson", "{\"a\": nope}", 0), Code::kInvalidArgument,
                  {"not valid JSON"});
  ExpectOpenError(WriteRaw(dir, "array", "[1,2]", 0), Code::kInvalidArgument,
                  {"JSON array", "expected an object"});
  ExpectOpenError(WriteRaw(dir, "entry", R"({"a":5})", 0), Code::kInvalidArgument,
                  {"tensor \"a\" is 5"});
  ExpectOpenError(WriteRaw(dir, "nodtype", R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8),
                  Code::kInvalidArgument, {"tensor \"a\"", "dtype is missing"});
  ExpectOpenError(
      WriteRaw(dir, "baddtype", R"({"a":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", 2),
      Code::kInvalidArgument, {"tensor \"a\"", "\"F8\"", "BF16"});
  ExpectOpenError(WriteRaw(dir, "noshape", R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8),
                  Code::kInvalidArgument, {"tensor \"a\"", "shape is missing"});
  ExpectOpenError(
      WriteRaw(dir, "negshape", R"({"a":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,8]}})", 8),
      Code::kInvalidArgument, {"tensor \"a\"", "dim -1", "non-negative"});
  ExpectOpenError(
      WriteRaw(dir, "floatshape", R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
      Code::kInvalidArgument, {"tensor \"a\"", "dim 2.0"});
  ExpectOpenError(WriteRaw(dir, "nooffsets", R"({"a":{"dtype":"F32","shape":[2]}})", 8),
                  Code::kInvalidArgument, {"tensor \"a\"", "data_offsets is missing"});
  ExpectOpenError(WriteRaw(dir, "threeoffsets",
                           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})", 8),
                  Code::kInvalidArgument,
                  {"tensor \"a\"", "data_offsets is [0,4,8]", "[begin, end]"});
  ExpectOpenError(
      WriteRaw(dir, "backwards", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
      Code::kInvalidArgument, {"tensor \"a\"", "begin <= end"});
  // Offsets length mismatch: F32 [2] is 8 bytes, not 6.
  ExpectOpenError(
      WriteRaw(dir, "length", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,6]}})", 6),
      Code::kInvalidArgument, {"tensor \"a\"", "span 6 bytes", "expected 8", "F32 [2]"});
  // Not contiguous: a gap, an overlap, a first tensor not at 0.
  ExpectOpenError(
      WriteRaw(dir, "gap",
               "{" + ok_entry + R"(,"b":{"dtype":"U8","shape":[4],"data_offsets":[12,16]}})", 16),
      Code::kInvalidArgument, {"tensor \"b\"", "expected 8", "where \"a\" ends", "gap"});
  ExpectOpenError(
      WriteRaw(dir, "overlap",
               "{" + ok_entry + R"(,"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", 8),
      Code::kInvalidArgument, {"tensor \"b\"", "expected 8", "where \"a\" ends", "overlap"});
  ExpectOpenError(
      WriteRaw(dir, "late", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", 8),
      Code::kInvalidArgument, {"tensor \"a\"", "expected 0", "data start"});
  // Data section size mismatch: trailing bytes after the last tensor.
  ExpectOpenError(WriteRaw(dir, "trailing", "{" + ok_entry + "}", 9), Code::kInvalidArgument,
                  {"data section is 9 bytes", "describes 8"});
  ExpectOpenError(WriteRaw(dir, "meta", "{" + ok_entry + R"(,"__metadata__":{"k":1}})", 8),
                  Code::kInvalidArgument, {"__metadata__[\"k\"] is 1", "expected a string"});
  ExpectOpenError(WriteRaw(dir, "meta2", R"({"__metadata__":[]})", 0), Code::kInvalidArgument,
                  {"__metadata__ is []"});
  EXPECT_EQ(SafetensorsReader::Open(dir + "/absent").status().code(), Code::kNotFound);
}

}  // namespace
}  // namespace zeroshard
