// A safetensors file from anywhere (--init_from, a consolidated file, a shard
// file): any bytes open as a validated file or give an error, and every
// tensor of an accepted file reads back within the bytes given.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/safetensors.h"

namespace {

// Elements read back per tensor at most: enough to touch its first and last
// rows, small enough to keep an execution under a millisecond.
constexpr int64_t kMaxElementsRead = 1 << 14;

void ReadEveryTensor(const zeroshard::SafetensorsReader& reader) {
  std::vector<float> rows;
  for (const zeroshard::TensorInfo& t : reader.tensors()) {
    if (t.begin < reader.data_begin() || t.end > reader.file_size() || t.begin > t.end) {
      std::abort();  // Open promised that tensors tile the data section
    }
    const int64_t row_elements = t.RowElements();
    if (row_elements > 0 && row_elements <= kMaxElementsRead && t.Rows() > 0) {
      rows.resize(row_elements);
      (void)reader.ReadRowsAsF32(t.name, 0, 1, rows.data());
      (void)reader.ReadRowsAsF32(t.name, t.Rows() - 1, t.Rows(), rows.data());
    }
    char byte;
    if (t.Bytes() > 0) (void)reader.ReadBytes(t.name, t.Bytes() - 1, 1, &byte);
    (void)reader.ReadBytes(t.name, 0, t.Bytes() + 1, nullptr);  // OUT_OF_RANGE, never a write
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto reader = zeroshard::SafetensorsReader::OpenBuffer("fuzz.safetensors", bytes);
  if (reader.ok()) ReadEveryTensor(**reader);
  return 0;
}
