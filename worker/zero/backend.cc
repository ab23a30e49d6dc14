// Backend's default Pack and Unpack: a Convert (or Zero, or Copy) per run,
// in the calling thread's order of work like every other op.
#include "worker/zero/backend.h"

namespace zeroshard {

void Backend::Pack(const PackedLayout& layout, const float* full, void* packed, DType to) {
  char* out = static_cast<char*>(packed);
  const int64_t esize = DTypeSize(to);
  for (size_t i = 0; i < layout.runs.size(); ++i) {
    const PackedRun& run = layout.runs[i];
    const int64_t n = layout.RunLength(i);
    if (run.full_offset < 0) {
      Zero(out + run.packed_begin * esize, n * esize);
    } else {
      Convert(full + run.full_offset, DType::kF32, out + run.packed_begin * esize, to, n);
    }
  }
}

void Backend::Unpack(const PackedLayout& layout, const void* packed, DType from, float* full) {
  const char* in = static_cast<const char*>(packed);
  const int64_t esize = DTypeSize(from);
  for (size_t i = 0; i < layout.runs.size(); ++i) {
    const PackedRun& run = layout.runs[i];
    if (run.full_offset < 0) continue;
    Convert(in + run.packed_begin * esize, from, full + run.full_offset, DType::kF32,
            layout.RunLength(i));
  }
}

void Backend::UnpackRaw(const PackedLayout& layout, const void* packed, DType dtype, void* full) {
  const char* in = static_cast<const char*>(packed);
  char* out = static_cast<char*>(full);
  const int64_t esize = DTypeSize(dtype);
  for (size_t i = 0; i < layout.runs.size(); ++i) {
    const PackedRun& run = layout.runs[i];
    if (run.full_offset < 0) continue;
    Copy(out + run.full_offset * esize, in + run.packed_begin * esize, layout.RunLength(i) * esize);
  }
}

}  // namespace zeroshard
