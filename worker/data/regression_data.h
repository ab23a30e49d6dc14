// Training data for the MLP regression model: rows of inputs x [in] and
// targets y [out], from a safetensors file (--data) or generated on the fly.
//
// Which rows a rank trains on depends only on its place in the global sample
// order, never on how the run is split: at optimizer step s, micro-step m
// (0 <= m < grad_accum), rank r of W takes the `batch` rows starting at global
// row
//   ((s * grad_accum + m) * W + r) * batch
// so each micro-step consumes W * batch consecutive rows, rank by rank, and a
// run with W = 1 and batch W * b sees exactly the rows that W ranks with batch
// b see together. A file of N rows is read cyclically: global row i is file
// row i mod N. Synthetic data has no end: global row i is a pure function of
// (seed, i).
#ifndef ZEROSHARD_WORKER_DATA_REGRESSION_DATA_H_
#define ZEROSHARD_WORKER_DATA_REGRESSION_DATA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/safetensors.h"

namespace zeroshard {

// The first global row of (step, micro, rank) as above. INVALID_ARGUMENT
// unless step >= 0, world >= 1, 0 <= rank < world, batch >= 1,
// grad_accum >= 1 and 0 <= micro < grad_accum; OUT_OF_RANGE if the rows
// [start, start + batch) do not fit in int64.
absl::StatusOr<int64_t> MicroBatchStartRow(int64_t step, int micro, int rank, int world, int batch,
                                           int grad_accum);

class RegressionData {
 public:
  virtual ~RegressionData() = default;
  RegressionData(const RegressionData&) = delete;
  RegressionData& operator=(const RegressionData&) = delete;

  int64_t in_width() const { return in_width_; }    // features per x row
  int64_t out_width() const { return out_width_; }  // features per y row
  // Rows in the data set; 0 means unbounded (synthetic data).
  virtual int64_t num_rows() const = 0;

  // Global rows [first_row, first_row + count) into x [count, in_width] and
  // y [count, out_width], row-major f32. INVALID_ARGUMENT for first_row < 0,
  // count < 0 or null buffers (count > 0); file read errors pass through.
  // Thread-safe.
  virtual absl::Status FillRows(int64_t first_row, int64_t count, float* x, float* y) const = 0;

  // The micro-batch of (step, micro, rank) under `world` ranks: `batch` rows
  // from MicroBatchStartRow() on, into x [batch, in_width] and y [batch,
  // out_width]. Errors as MicroBatchStartRow() and FillRows().
  // `row_offset` shifts every row (the data cursor of a job whose world
  // size changed: worker.h, "Recovery").
  absl::Status Fill(int64_t step, int micro, int rank, int world, int batch, int grad_accum,
                    float* x, float* y, int64_t row_offset = 0) const;

 protected:
  RegressionData(int64_t in_width, int64_t out_width)
      : in_width_(in_width), out_width_(out_width) {}
  // The argument checks FillRows() documents.
  absl::Status CheckFillRows(int64_t first_row, int64_t count, const float* x,
                             const float* y) const;

 private:
  const int64_t in_width_;
  const int64_t out_width_;
};

// A safetensors file holding "x" [N, in] and "y" [N, out] (F32, BF16 or F16;
// converted to f32 on read). Other tensors in the file are ignored.
class FileRegressionData : public RegressionData {
 public:
  // Files whose x and y together take at most this many bytes as f32 are
  // read into memory at Open(); larger ones are read row range by row range
  // on every Fill().
  static constexpr int64_t kDefaultCacheLimitBytes = int64_t{64} << 20;

  // Opens and validates `path`: x and y present, F32/BF16/F16, 2-d, the same
  // N >= 1 rows, and widths equal to the model's in_width / out_width.
  // INVALID_ARGUMENT naming the file, the tensor and its shape otherwise;
  // errors opening or reading the file pass through.
  static absl::StatusOr<std::unique_ptr<FileRegressionData>> Open(
      const std::string& path, int64_t in_width, int64_t out_width,
      int64_t cache_limit_bytes = kDefaultCacheLimitBytes);

  int64_t num_rows() const override { return rows_; }
  // Global row i is file row i mod num_rows().
  absl::Status FillRows(int64_t first_row, int64_t count, float* x, float* y) const override;
  // Whether the rows were read into memory at Open().
  bool cached() const { return !x_cache_.empty(); }

 private:
  FileRegressionData(std::unique_ptr<SafetensorsReader> reader, int64_t rows, int64_t in_width,
                     int64_t out_width)
      : RegressionData(in_width, out_width), reader_(std::move(reader)), rows_(rows) {}

  std::unique_ptr<SafetensorsReader> reader_;
  const int64_t rows_;
  std::vector<float> x_cache_;  // [rows, in_width] when cached
  std::vector<float> y_cache_;  // [rows, out_width] when cached
};

// Seeded synthetic data, a pure function of (seed, widths, global row):
//   x[r][c] ~ U(-1, 1), drawn by counter from (seed, r * in_width + c);
//   y[r][j] = sum_t w[j][t] * x[r][idx[j][t]] + b[j] + 0.01 * u[r][j]
// where each output j reads K = min(in_width, 8) input columns idx[j][t]
// with weights w[j][t] ~ U(-1, 1) * sqrt(3 / K) and bias b[j] ~ U(-0.1, 0.1)
// (all fixed by the seed: a sparse random linear map, so y has about the
// spread of x and costs O(K) per output), and u[r][j] ~ U(-1, 1) is
// deterministic per-row noise. A linear layer can fit it to ~0.01 error.
// Computed in double from the f32 x values, then rounded to f32.
class SyntheticRegressionData : public RegressionData {
 public:
  // The MLP's case: in = out = width.
  SyntheticRegressionData(uint64_t seed, int64_t width)
      : SyntheticRegressionData(seed, width, width) {}
  // Widths must be >= 1; FillRows() fails with FAILED_PRECONDITION otherwise.
  SyntheticRegressionData(uint64_t seed, int64_t in_width, int64_t out_width);

  int64_t num_rows() const override { return 0; }
  absl::Status FillRows(int64_t first_row, int64_t count, float* x, float* y) const override;

  uint64_t seed() const { return seed_; }

 private:
  // Noise amplitude of y, in units of y.
  static constexpr double kNoise = 0.01;

  const uint64_t seed_;
  uint64_t x_key_ = 0;              // stream of x values
  uint64_t noise_key_ = 0;          // stream of y noise
  int taps_ = 0;                    // K
  std::vector<int64_t> tap_index_;  // [out_width, K] input column
  std::vector<double> tap_weight_;  // [out_width, K]
  std::vector<double> bias_;        // [out_width]
};

// The data source a run uses: the file at `data_path` if it is not empty,
// otherwise SyntheticRegressionData(seed, in_width, out_width).
// INVALID_ARGUMENT for widths < 1; otherwise as FileRegressionData::Open().
absl::StatusOr<std::unique_ptr<RegressionData>> OpenRegressionData(const std::string& data_path,
                                                                   uint64_t seed, int64_t in_width,
                                                                   int64_t out_width);

// Writes rows [0, rows) of SyntheticRegressionData(seed, width) to `path` as
// a safetensors file with "x" [rows, width] and "y" [rows, width] in `dtype`
// (F32, BF16 or F16; BF16/F16 round to nearest even), streaming a few
// thousand rows at a time so large files need little memory. The file's
// metadata records the seed. INVALID_ARGUMENT for rows < 1, width < 1 or
// another dtype; write errors pass through (nothing appears at `path`).
absl::Status WriteRegressionFile(const std::string& path, int64_t rows, int64_t width,
                                 uint64_t seed, DType dtype = DType::kF32);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_DATA_REGRESSION_DATA_H_
