#include "worker/data/regression_data.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/model_spec.h"
#include "common/safetensors.h"
#include "worker/model/init.h"

namespace zeroshard {
namespace {

// 2^-53: turns the top 53 bits of a draw into a double in [0, 1).
constexpr double kTwoPowMinus53 = 1.0 / 9007199254740992.0;

// A double in [-1, 1) from 64 random bits.
double Symmetric(uint64_t bits) {
  return 2.0 * (static_cast<double>(bits >> 11) * kTwoPowMinus53) - 1.0;
}

// Input columns each synthetic output reads.
constexpr int kMaxTaps = 8;

// Rows per chunk when writing a file: about 4 MiB of f32 per tensor.
int64_t WriteChunkRows(int64_t width) { return std::max<int64_t>(1, (int64_t{1} << 20) / width); }

// Finds tensor `name` and checks its dtype, rank and width.
absl::StatusOr<const TensorInfo*> FindDataTensor(const SafetensorsReader& reader,
                                                 const std::string& name, int64_t width,
                                                 const char* role) {
  const std::string file = absl::StrCat("data file ", reader.path());
  const TensorInfo* info = reader.Find(name);
  if (info == nullptr) {
    std::vector<std::string> names;
    for (const std::string& n : reader.names()) names.push_back(absl::StrCat("\"", n, "\""));
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": no tensor \"", name, "\" (the file holds ",
                     names.empty() ? "no tensors" : absl::StrJoin(names, ", "),
                     "); expected \"x\" [N, in] and \"y\" [N, out]"));
  }
  if (info->dtype != DType::kF32 && info->dtype != DType::kBF16 && info->dtype != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": tensor \"", name, "\" has dtype ",
                                                   DTypeName(info->dtype),
                                                   "; expected F32, BF16 or F16"));
  }
  if (info->shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": tensor \"", name, "\" has shape ",
                                                   ShapeString(info->shape), "; expected 2-d [N, ",
                                                   width, "]"));
  }
  if (info->shape[1] != width) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": tensor \"", name, "\" has shape ", ShapeString(info->shape), " but the model ",
        role, " ", width, " features per row; expected [N, ", width, "]"));
  }
  return info;
}

}  // namespace

absl::StatusOr<int64_t> MicroBatchStartRow(int64_t step, int micro, int rank, int world, int batch,
                                           int grad_accum) {
  if (step < 0 || world < 1 || rank < 0 || rank >= world || batch < 1 || grad_accum < 1 ||
      micro < 0 || micro >= grad_accum) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad micro-batch coordinates: step ", step, ", micro ", micro, " of grad_accum ",
        grad_accum, ", rank ", rank, " of world ", world, ", batch ", batch,
        " (need step >= 0, 0 <= micro < grad_accum, 0 <= rank < world, batch >= 1)"));
  }
  // ((step * grad_accum + micro) * world + rank) * batch, and the batch's end,
  // without signed overflow.
  int64_t v = 0;
  if (__builtin_mul_overflow(step, int64_t{grad_accum}, &v) ||
      __builtin_add_overflow(v, int64_t{micro}, &v) ||
      __builtin_mul_overflow(v, int64_t{world}, &v) ||
      __builtin_add_overflow(v, int64_t{rank}, &v) ||
      __builtin_mul_overflow(v, int64_t{batch}, &v) || v > INT64_MAX - batch) {
    return absl::OutOfRangeError(
        absl::StrCat("micro-batch row index overflows int64 at step ", step));
  }
  return v;
}

absl::Status RegressionData::CheckFillRows(int64_t first_row, int64_t count, const float* x,
                                           const float* y) const {
  if (first_row < 0 || count < 0 || first_row > INT64_MAX - count) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad row range: first row ", first_row, ", count ", count));
  }
  if (count > 0 && (x == nullptr || y == nullptr)) {
    return absl::InvalidArgumentError("null x or y buffer");
  }
  return absl::OkStatus();
}

absl::Status RegressionData::Fill(int64_t step, int micro, int rank, int world, int batch,
                                  int grad_accum, float* x, float* y, int64_t row_offset) const {
  absl::StatusOr<int64_t> start = MicroBatchStartRow(step, micro, rank, world, batch, grad_accum);
  if (!start.ok()) return start.status();
  return FillRows(*start + row_offset, batch, x, y);
}

// ---------------------------------------------------------------------------
// FileRegressionData

absl::StatusOr<std::unique_ptr<FileRegressionData>> FileRegressionData::Open(
    const std::string& path, int64_t in_width, int64_t out_width, int64_t cache_limit_bytes) {
  if (in_width < 1 || out_width < 1) {
    return absl::InvalidArgumentError(absl::StrCat("data file ", path, ": model widths in ",
                                                   in_width, ", out ", out_width, " must be >= 1"));
  }
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  if (!reader.ok()) return reader.status();
  absl::StatusOr<const TensorInfo*> x = FindDataTensor(**reader, "x", in_width, "takes");
  if (!x.ok()) return x.status();
  absl::StatusOr<const TensorInfo*> y = FindDataTensor(**reader, "y", out_width, "produces");
  if (!y.ok()) return y.status();
  const int64_t rows = (*x)->shape[0];
  if ((*y)->shape[0] != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("data file ", path, ": tensors \"x\" ", ShapeString((*x)->shape),
                     " and \"y\" ", ShapeString((*y)->shape), " have different row counts"));
  }
  if (rows < 1) {
    return absl::InvalidArgumentError(absl::StrCat("data file ", path, ": tensors \"x\" ",
                                                   ShapeString((*x)->shape), " and \"y\" ",
                                                   ShapeString((*y)->shape), " have no rows"));
  }

  std::unique_ptr<FileRegressionData> data(
      new FileRegressionData(std::move(*reader), rows, in_width, out_width));
  // In double: rows * width * 4 cannot overflow here.
  const double f32_bytes = static_cast<double>(rows) * static_cast<double>(in_width + out_width) *
                           static_cast<double>(sizeof(float));
  if (f32_bytes <= static_cast<double>(cache_limit_bytes)) {
    data->x_cache_.resize(static_cast<size_t>(rows * in_width));
    data->y_cache_.resize(static_cast<size_t>(rows * out_width));
    if (absl::Status s = data->reader_->ReadRowsAsF32("x", 0, rows, data->x_cache_.data());
        !s.ok()) {
      return s;
    }
    if (absl::Status s = data->reader_->ReadRowsAsF32("y", 0, rows, data->y_cache_.data());
        !s.ok()) {
      return s;
    }
  }
  return data;
}

absl::Status FileRegressionData::FillRows(int64_t first_row, int64_t count, float* x,
                                          float* y) const {
  if (absl::Status s = CheckFillRows(first_row, count, x, y); !s.ok()) return s;
  const int64_t in = in_width();
  const int64_t out = out_width();
  // Walk the cyclic row range as contiguous file segments [pos, pos + seg).
  int64_t pos = first_row % rows_;
  int64_t done = 0;
  while (done < count) {
    const int64_t seg = std::min(count - done, rows_ - pos);
    if (cached()) {
      std::memcpy(x + done * in, x_cache_.data() + pos * in,
                  static_cast<size_t>(seg * in) * sizeof(float));
      std::memcpy(y + done * out, y_cache_.data() + pos * out,
                  static_cast<size_t>(seg * out) * sizeof(float));
    } else {
      if (absl::Status s = reader_->ReadRowsAsF32("x", pos, pos + seg, x + done * in); !s.ok()) {
        return s;
      }
      if (absl::Status s = reader_->ReadRowsAsF32("y", pos, pos + seg, y + done * out); !s.ok()) {
        return s;
      }
    }
    done += seg;
    pos += seg;
    if (pos == rows_) pos = 0;
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// SyntheticRegressionData

SyntheticRegressionData::SyntheticRegressionData(uint64_t seed, int64_t in_width, int64_t out_width)
    : RegressionData(in_width, out_width), seed_(seed) {
  if (in_width < 1 || out_width < 1) return;  // FillRows() reports it
  x_key_ = InitStreamKey(seed, "regression/x");
  noise_key_ = InitStreamKey(seed, "regression/noise");
  const uint64_t index_key = InitStreamKey(seed, "regression/tap_index");
  const uint64_t weight_key = InitStreamKey(seed, "regression/tap_weight");
  const uint64_t bias_key = InitStreamKey(seed, "regression/bias");
  taps_ = static_cast<int>(std::min<int64_t>(in_width, kMaxTaps));
  // Each term w * x has variance (3 / K) * (1/3) * (1/3) = 1 / (3K), so the K
  // terms sum to 1/3: the variance of x ~ U(-1, 1).
  const double weight_scale = std::sqrt(3.0 / taps_);
  tap_index_.resize(static_cast<size_t>(out_width * taps_));
  tap_weight_.resize(tap_index_.size());
  bias_.resize(static_cast<size_t>(out_width));
  for (int64_t j = 0; j < out_width; ++j) {
    for (int t = 0; t < taps_; ++t) {
      const uint64_t e = static_cast<uint64_t>(j * taps_ + t);
      tap_index_[e] =
          static_cast<int64_t>(InitBits(index_key, e) % static_cast<uint64_t>(in_width));
      tap_weight_[e] = weight_scale * Symmetric(InitBits(weight_key, e));
    }
    bias_[j] = 0.1 * Symmetric(InitBits(bias_key, static_cast<uint64_t>(j)));
  }
}

absl::Status SyntheticRegressionData::FillRows(int64_t first_row, int64_t count, float* x,
                                               float* y) const {
  if (taps_ == 0) {
    return absl::FailedPreconditionError(absl::StrCat("synthetic data: widths in ", in_width(),
                                                      ", out ", out_width(), " must be >= 1"));
  }
  if (absl::Status s = CheckFillRows(first_row, count, x, y); !s.ok()) return s;
  const int64_t in = in_width();
  const int64_t out = out_width();
  for (int64_t i = 0; i < count; ++i) {
    // Counters in wrapping uint64 arithmetic: any row index is fine.
    const uint64_t row = static_cast<uint64_t>(first_row + i);
    float* xr = x + i * in;
    float* yr = y + i * out;
    const uint64_t x_base = row * static_cast<uint64_t>(in);
    for (int64_t c = 0; c < in; ++c) {
      xr[c] = static_cast<float>(Symmetric(InitBits(x_key_, x_base + static_cast<uint64_t>(c))));
    }
    const uint64_t noise_base = row * static_cast<uint64_t>(out);
    for (int64_t j = 0; j < out; ++j) {
      double v = bias_[j];
      const int64_t* index = tap_index_.data() + j * taps_;
      const double* weight = tap_weight_.data() + j * taps_;
      for (int t = 0; t < taps_; ++t) v += weight[t] * static_cast<double>(xr[index[t]]);
      v += kNoise * Symmetric(InitBits(noise_key_, noise_base + static_cast<uint64_t>(j)));
      yr[j] = static_cast<float>(v);
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<RegressionData>> OpenRegressionData(const std::string& data_path,
                                                                   uint64_t seed, int64_t in_width,
                                                                   int64_t out_width) {
  if (in_width < 1 || out_width < 1) {
    return absl::InvalidArgumentError(absl::StrCat("regression data: model widths in ", in_width,
                                                   ", out ", out_width, " must be >= 1"));
  }
  if (data_path.empty()) {
    return std::unique_ptr<RegressionData>(
        std::make_unique<SyntheticRegressionData>(seed, in_width, out_width));
  }
  absl::StatusOr<std::unique_ptr<FileRegressionData>> file =
      FileRegressionData::Open(data_path, in_width, out_width);
  if (!file.ok()) return file.status();
  return std::unique_ptr<RegressionData>(std::move(*file));
}

absl::Status WriteRegressionFile(const std::string& path, int64_t rows, int64_t width,
                                 uint64_t seed, DType dtype) {
  if (rows < 1 || width < 1) {
    return absl::InvalidArgumentError(absl::StrCat("WriteRegressionFile ", path, ": rows ", rows,
                                                   " and width ", width, " must be >= 1"));
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat("WriteRegressionFile ", path, ": dtype ",
                                                   DTypeName(dtype),
                                                   " not supported (F32, BF16 or F16)"));
  }
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, {{"x", dtype, {rows, width}}, {"y", dtype, {rows, width}}},
                                {{"format", "zeroshard regression"}, {"seed", absl::StrCat(seed)}});
  if (!writer.ok()) return writer.status();

  const SyntheticRegressionData synthetic(seed, width);
  const int64_t chunk = std::min(rows, WriteChunkRows(width));
  std::vector<float> x(static_cast<size_t>(chunk * width));
  std::vector<float> y(x.size());
  std::vector<uint16_t> half(dtype == DType::kF32 ? 0 : x.size());
  // x for every row first, then y: the tensors are stored one after the other.
  for (const bool write_y : {false, true}) {
    for (int64_t r = 0; r < rows; r += chunk) {
      const int64_t n = std::min(chunk, rows - r);
      if (absl::Status s = synthetic.FillRows(r, n, x.data(), y.data()); !s.ok()) return s;
      const std::vector<float>& values = write_y ? y : x;
      const size_t count = static_cast<size_t>(n * width);
      absl::Status s;
      if (dtype == DType::kF32) {
        s = (*writer)->Append(values.data(), static_cast<int64_t>(count * sizeof(float)));
      } else {
        for (size_t i = 0; i < count; ++i) {
          half[i] = dtype == DType::kBF16 ? FloatToBF16(values[i]) : FloatToF16(values[i]);
        }
        s = (*writer)->Append(half.data(), static_cast<int64_t>(count * sizeof(uint16_t)));
      }
      if (!s.ok()) return s;
    }
  }
  return (*writer)->Finish();
}

}  // namespace zeroshard
