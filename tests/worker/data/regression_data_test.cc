// Tests of the regression data sources: the global row layout, file reading
// (cached and streamed, F32/BF16/F16), validation and synthetic data.
#include "worker/data/regression_data.h"

#include <sys/stat.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;

std::string TestDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/regression_data_" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name();
  mkdir(dir.c_str(), 0777);
  return dir;
}

// A micro-batch's rows: x [batch, in] and y [batch, out].
struct Rows {
  std::vector<float> x, y;
  bool operator==(const Rows& o) const { return x == o.x && y == o.y; }
};

Rows FillOrDie(const RegressionData& data, int64_t step, int micro, int rank, int world, int batch,
               int grad_accum) {
  Rows r{std::vector<float>(batch * data.in_width()), std::vector<float>(batch * data.out_width())};
  absl::Status s = data.Fill(step, micro, rank, world, batch, grad_accum, r.x.data(), r.y.data());
  EXPECT_TRUE(s.ok()) << s;
  return r;
}

Rows RowsOrDie(const RegressionData& data, int64_t first, int64_t count) {
  Rows r{std::vector<float>(count * data.in_width()), std::vector<float>(count * data.out_width())};
  absl::Status s = data.FillRows(first, count, r.x.data(), r.y.data());
  EXPECT_TRUE(s.ok()) << s;
  return r;
}

void Append(Rows& to, const Rows& from) {
  to.x.insert(to.x.end(), from.x.begin(), from.x.end());
  to.y.insert(to.y.end(), from.y.begin(), from.y.end());
}

// Writes a file with the given tensors, every byte zero.
std::string WriteTensors(const std::string& path, const std::vector<TensorEntry>& entries) {
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w = SafetensorsWriter::Create(path, entries);
  EXPECT_TRUE(w.ok()) << w.status();
  int64_t bytes = 0;
  for (const auto& [begin, end] : (*w)->offsets()) bytes += end - begin;
  EXPECT_TRUE((*w)->Append(std::string(bytes, '\0').data(), bytes).ok());
  EXPECT_TRUE((*w)->Finish().ok());
  return path;
}

std::unique_ptr<FileRegressionData> OpenOrDie(const std::string& path, int64_t in, int64_t out,
                                              int64_t cache_limit) {
  absl::StatusOr<std::unique_ptr<FileRegressionData>> data =
      FileRegressionData::Open(path, in, out, cache_limit);
  EXPECT_TRUE(data.ok()) << data.status();
  return data.ok() ? std::move(*data) : nullptr;
}

// ---------------------------------------------------------------------------
// The row formula.

TEST(MicroBatchStartRowTest, Formula) {
  // ((s * G + m) * W + r) * b
  EXPECT_EQ(*MicroBatchStartRow(0, 0, 0, 1, 8, 1), 0);
  EXPECT_EQ(*MicroBatchStartRow(0, 0, 3, 4, 8, 1), 24);
  EXPECT_EQ(*MicroBatchStartRow(2, 1, 3, 4, 5, 3), ((2 * 3 + 1) * 4 + 3) * 5);
  EXPECT_EQ(*MicroBatchStartRow(1, 0, 0, 2, 4, 2), 16);
  EXPECT_EQ(*MicroBatchStartRow(1, 1, 0, 2, 4, 2), 24);
}

TEST(MicroBatchStartRowTest, BadCoordinates) {
  for (auto [step, micro, rank, world, batch, ga] :
       std::vector<std::array<int64_t, 6>>{{-1, 0, 0, 1, 1, 1},
                                           {0, 2, 0, 1, 1, 2},
                                           {0, -1, 0, 1, 1, 2},
                                           {0, 0, 2, 2, 1, 1},
                                           {0, 0, -1, 2, 1, 1},
                                           {0, 0, 0, 0, 1, 1},
                                           {0, 0, 0, 1, 0, 1},
                                           {0, 0, 0, 1, 1, 0}}) {
    absl::StatusOr<int64_t> start = MicroBatchStartRow(step, micro, rank, world, batch, ga);
    EXPECT_EQ(start.status().code(), absl::StatusCode::kInvalidArgument)
        << step << " " << micro << " " << rank << " " << world << " " << batch << " " << ga;
    EXPECT_THAT(start.status().message(), HasSubstr("bad micro-batch coordinates"));
  }
  EXPECT_EQ(MicroBatchStartRow(int64_t{1} << 62, 0, 0, 4, 4, 1).status().code(),
            absl::StatusCode::kOutOfRange);
  // The last row must fit too.
  EXPECT_EQ(MicroBatchStartRow(INT64_MAX / 2, 0, 0, 1, 2, 1).status().code(),
            absl::StatusCode::kOutOfRange);
}

// ---------------------------------------------------------------------------
// Files.

TEST(FileRegressionDataTest, WrittenFileHoldsTheSyntheticRows) {
  const std::string path = TestDir() + "/d.safetensors";
  ASSERT_TRUE(WriteRegressionFile(path, 10, 3, 42).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->metadata().at("seed"), "42");
  EXPECT_EQ((*reader)->Find("x")->shape, (std::vector<int64_t>{10, 3}));
  EXPECT_EQ((*reader)->Find("y")->dtype, DType::kF32);

  auto file = OpenOrDie(path, 3, 3, FileRegressionData::kDefaultCacheLimitBytes);
  ASSERT_NE(file, nullptr);
  EXPECT_TRUE(file->cached());
  EXPECT_EQ(file->num_rows(), 10);
  EXPECT_EQ(RowsOrDie(*file, 0, 10), RowsOrDie(SyntheticRegressionData(42, 3), 0, 10));
}

TEST(FileRegressionDataTest, RowsWrapModuloN) {
  const std::string path = TestDir() + "/d.safetensors";
  constexpr int64_t kN = 7;
  ASSERT_TRUE(WriteRegressionFile(path, kN, 2, 5).ok());
  const SyntheticRegressionData synthetic(5, 2);
  for (int64_t cache_limit : {FileRegressionData::kDefaultCacheLimitBytes, int64_t{0}}) {
    auto file = OpenOrDie(path, 2, 2, cache_limit);
    ASSERT_NE(file, nullptr);
    EXPECT_EQ(file->cached(), cache_limit > 0);
    // step 1, micro 0, rank 1 of 2, batch 3: start ((1 * 1 + 0) * 2 + 1) * 3 = 9,
    // so file rows 2, 3, 4.
    EXPECT_EQ(FillOrDie(*file, 1, 0, 1, 2, 3, 1), RowsOrDie(synthetic, 2, 3));
    // start 2 * 3 = 6: rows 6, 0, 1 (wrapping inside the batch).
    Rows expected = RowsOrDie(synthetic, 6, 1);
    Append(expected, RowsOrDie(synthetic, 0, 2));
    EXPECT_EQ(FillOrDie(*file, 1, 0, 0, 2, 3, 1), expected);
    // A batch longer than the file wraps more than once: start 16 = 2 mod 7.
    Rows many;
    for (int64_t i = 0; i < 16; ++i) Append(many, RowsOrDie(synthetic, (16 + i) % kN, 1));
    EXPECT_EQ(FillOrDie(*file, 1, 0, 0, 1, 16, 1), many);
    // A huge global row index.
    const int64_t far = (int64_t{1} << 40) + 3;
    EXPECT_EQ(RowsOrDie(*file, far, 2), RowsOrDie(synthetic, far % kN, 2));
  }
}

TEST(FileRegressionDataTest, HalfPrecisionFilesConvert) {
  const SyntheticRegressionData synthetic(9, 4);
  const Rows exact = RowsOrDie(synthetic, 0, 6);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const std::string path = TestDir() + "/" + DTypeName(dtype) + ".safetensors";
    ASSERT_TRUE(WriteRegressionFile(path, 6, 4, 9, dtype).ok());
    for (int64_t cache_limit : {FileRegressionData::kDefaultCacheLimitBytes, int64_t{0}}) {
      auto file = OpenOrDie(path, 4, 4, cache_limit);
      ASSERT_NE(file, nullptr);
      const Rows got = RowsOrDie(*file, 4, 4);  // rows 4, 5, 0, 1
      for (int i = 0; i < 16; ++i) {
        const int64_t src = ((4 + i / 4) % 6) * 4 + i % 4;
        const float x = exact.x[src], y = exact.y[src];
        if (dtype == DType::kBF16) {
          EXPECT_EQ(got.x[i], BF16ToFloat(FloatToBF16(x))) << i;
          EXPECT_EQ(got.y[i], BF16ToFloat(FloatToBF16(y))) << i;
        } else {
          EXPECT_EQ(got.x[i], F16ToFloat(FloatToF16(x))) << i;
          EXPECT_EQ(got.y[i], F16ToFloat(FloatToF16(y))) << i;
        }
        EXPECT_NEAR(got.x[i], x, 1e-2) << i;
      }
    }
  }
}

// The same global sample order whatever the world size: one rank with batch
// W * b sees the W ranks' batches of b, in rank order, at every step and
// micro-step.
void ExpectWorldSizeIndependent(const RegressionData& data) {
  constexpr int kB = 2;
  for (int world : {2, 3, 4}) {
    for (int ga : {1, 3}) {
      for (int64_t step = 0; step < 4; ++step) {
        for (int micro = 0; micro < ga; ++micro) {
          Rows ranks;
          for (int rank = 0; rank < world; ++rank) {
            Append(ranks, FillOrDie(data, step, micro, rank, world, kB, ga));
          }
          EXPECT_EQ(FillOrDie(data, step, micro, 0, 1, world * kB, ga), ranks)
              << "world " << world << " ga " << ga << " step " << step << " micro " << micro;
        }
      }
    }
  }
}

TEST(FileRegressionDataTest, WorldSizeIndependent) {
  const std::string path = TestDir() + "/d.safetensors";
  ASSERT_TRUE(WriteRegressionFile(path, 11, 3, 1).ok());  // 11: wraps at odd places
  for (int64_t cache_limit : {FileRegressionData::kDefaultCacheLimitBytes, int64_t{0}}) {
    auto file = OpenOrDie(path, 3, 3, cache_limit);
    ASSERT_NE(file, nullptr);
    ExpectWorldSizeIndependent(*file);
  }
}

TEST(RegressionDataTest, GradAccumLayout) {
  const SyntheticRegressionData data(3, 2);
  // Micro-steps of one step are consecutive blocks of W * b rows: with G = 2,
  // step s micro m covers the rows that step 2s + m covers with G = 1.
  for (int64_t step = 0; step < 3; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      for (int rank = 0; rank < 3; ++rank) {
        EXPECT_EQ(FillOrDie(data, step, micro, rank, 3, 4, 2),
                  FillOrDie(data, 2 * step + micro, 0, rank, 3, 4, 1));
      }
    }
  }
  // W = 1: a step's G micro-batches of b rows are the step's G * b rows.
  Rows micro_batches = FillOrDie(data, 5, 0, 0, 1, 3, 2);
  Append(micro_batches, FillOrDie(data, 5, 1, 0, 1, 3, 2));
  EXPECT_EQ(micro_batches, FillOrDie(data, 5, 0, 0, 1, 6, 1));
  // Spelled out: step 1, micro 1, rank 0 of 2, batch 4, G = 2 starts at row
  // ((1 * 2 + 1) * 2 + 0) * 4 = 24.
  EXPECT_EQ(FillOrDie(data, 1, 1, 0, 2, 4, 2), RowsOrDie(data, 24, 4));
}

TEST(FileRegressionDataTest, ValidationErrors) {
  const std::string dir = TestDir();
  struct Case {
    std::string name;
    std::vector<TensorEntry> tensors;
    std::vector<std::string> message_parts;
  };
  const std::vector<Case> cases = {
      {"no_x",
       {{"y", DType::kF32, {4, 3}}, {"z", DType::kF32, {1}}},
       {"no tensor \"x\"", "\"y\", \"z\""}},
      {"no_y", {{"x", DType::kF32, {4, 2}}}, {"no tensor \"y\""}},
      {"x_1d",
       {{"x", DType::kF32, {8}}, {"y", DType::kF32, {4, 3}}},
       {"tensor \"x\" has shape [8]", "expected 2-d [N, 2]"}},
      {"y_3d",
       {{"x", DType::kF32, {4, 2}}, {"y", DType::kF32, {4, 3, 1}}},
       {"tensor \"y\" has shape [4, 3, 1]", "expected 2-d [N, 3]"}},
      {"x_width",
       {{"x", DType::kF32, {4, 5}}, {"y", DType::kF32, {4, 3}}},
       {"tensor \"x\" has shape [4, 5] but the model takes 2 features"}},
      {"y_width",
       {{"x", DType::kF32, {4, 2}}, {"y", DType::kBF16, {4, 2}}},
       {"tensor \"y\" has shape [4, 2] but the model produces 3 features"}},
      {"rows",
       {{"x", DType::kF32, {4, 2}}, {"y", DType::kF32, {5, 3}}},
       {"tensors \"x\" [4, 2] and \"y\" [5, 3] have different row counts"}},
      {"empty", {{"x", DType::kF32, {0, 2}}, {"y", DType::kF32, {0, 3}}}, {"have no rows"}},
      {"dtype",
       {{"x", DType::kI32, {4, 2}}, {"y", DType::kF32, {4, 3}}},
       {"tensor \"x\" has dtype I32", "F32, BF16 or F16"}},
  };
  for (const Case& c : cases) {
    const std::string path = WriteTensors(dir + "/" + c.name + ".safetensors", c.tensors);
    absl::StatusOr<std::unique_ptr<FileRegressionData>> data = FileRegressionData::Open(path, 2, 3);
    ASSERT_FALSE(data.ok()) << c.name;
    EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(data.status().message(), HasSubstr("data file " + path)) << c.name;
    for (const std::string& part : c.message_parts) {
      EXPECT_THAT(data.status().message(), HasSubstr(part)) << c.name;
    }
  }
  // A valid mix of dtypes opens.
  const std::string ok = WriteTensors(dir + "/ok.safetensors",
                                      {{"x", DType::kF16, {4, 2}}, {"y", DType::kBF16, {4, 3}}});
  EXPECT_TRUE(FileRegressionData::Open(ok, 2, 3).ok());
  EXPECT_FALSE(FileRegressionData::Open(dir + "/missing.safetensors", 2, 3).ok());
  EXPECT_EQ(FileRegressionData::Open(ok, 0, 3).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FileRegressionDataTest, BadFillArguments) {
  const std::string path = TestDir() + "/d.safetensors";
  ASSERT_TRUE(WriteRegressionFile(path, 4, 2, 0).ok());
  auto file = OpenOrDie(path, 2, 2, 0);
  ASSERT_NE(file, nullptr);
  std::vector<float> x(4), y(4);
  EXPECT_EQ(file->Fill(0, 0, 2, 2, 2, 1, x.data(), y.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(file->Fill(0, 0, 0, 1, 2, 1, nullptr, y.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(file->FillRows(-1, 2, x.data(), y.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(file->FillRows(3, 0, nullptr, nullptr).ok());
}

TEST(WriteRegressionFileTest, Errors) {
  const std::string dir = TestDir();
  EXPECT_EQ(WriteRegressionFile(dir + "/a.safetensors", 0, 2, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteRegressionFile(dir + "/a.safetensors", 2, 0, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(WriteRegressionFile(dir + "/a.safetensors", 2, 2, 0, DType::kI32).message(),
              HasSubstr("dtype I32"));
  EXPECT_FALSE(WriteRegressionFile(dir + "/no/such/dir/a.safetensors", 2, 2, 0).ok());
}

TEST(WriteRegressionFileTest, ManyChunks) {
  // Width 1024 writes 1024 rows per chunk: 2500 rows take three chunks.
  const std::string path = TestDir() + "/big.safetensors";
  ASSERT_TRUE(WriteRegressionFile(path, 2500, 1024, 8).ok());
  auto file = OpenOrDie(path, 1024, 1024, 0);
  ASSERT_NE(file, nullptr);
  const SyntheticRegressionData synthetic(8, 1024);
  for (int64_t row : {0, 1023, 1024, 2047, 2048, 2499}) {
    EXPECT_EQ(RowsOrDie(*file, row, 1), RowsOrDie(synthetic, row, 1)) << row;
  }
}

// ---------------------------------------------------------------------------
// Synthetic data.

TEST(SyntheticRegressionDataTest, DeterministicAndSeeded) {
  const SyntheticRegressionData a(7, 16), b(7, 16), c(8, 16);
  EXPECT_EQ(RowsOrDie(a, 100, 5), RowsOrDie(b, 100, 5));
  EXPECT_NE(RowsOrDie(a, 100, 5).x, RowsOrDie(c, 100, 5).x);
  EXPECT_NE(RowsOrDie(a, 100, 5).y, RowsOrDie(c, 100, 5).y);
  // A row is a function of its index alone: reading it inside a longer range
  // or on its own gives the same values.
  const Rows range = RowsOrDie(a, 98, 5);
  const Rows single = RowsOrDie(a, 100, 1);
  EXPECT_EQ(std::vector<float>(range.x.begin() + 32, range.x.begin() + 48), single.x);
  EXPECT_EQ(std::vector<float>(range.y.begin() + 32, range.y.begin() + 48), single.y);
  // Far-away rows are fine.
  EXPECT_EQ(RowsOrDie(a, INT64_MAX - 3, 3), RowsOrDie(b, INT64_MAX - 3, 3));
  EXPECT_EQ(a.num_rows(), 0);
  EXPECT_EQ(a.seed(), 7u);
}

TEST(SyntheticRegressionDataTest, WorldSizeIndependent) {
  const SyntheticRegressionData data(11, 5);
  ExpectWorldSizeIndependent(data);
  // Each rank's batch is the global rows of the formula.
  EXPECT_EQ(FillOrDie(data, 3, 1, 2, 4, 6, 2), RowsOrDie(data, ((3 * 2 + 1) * 4 + 2) * 6, 6));
}

// Solves the n x n system a z = b in place (Gaussian elimination with
// partial pivoting); small and well conditioned here.
std::vector<double> Solve(std::vector<std::vector<double>> a, std::vector<double> b) {
  const size_t n = b.size();
  for (size_t k = 0; k < n; ++k) {
    size_t pivot = k;
    for (size_t i = k + 1; i < n; ++i) {
      if (std::fabs(a[i][k]) > std::fabs(a[pivot][k])) pivot = i;
    }
    std::swap(a[k], a[pivot]);
    std::swap(b[k], b[pivot]);
    for (size_t i = k + 1; i < n; ++i) {
      const double f = a[i][k] / a[k][k];
      for (size_t j = k; j < n; ++j) a[i][j] -= f * a[k][j];
      b[i] -= f * b[k];
    }
  }
  std::vector<double> z(n);
  for (size_t k = n; k-- > 0;) {
    double s = b[k];
    for (size_t j = k + 1; j < n; ++j) s -= a[k][j] * z[j];
    z[k] = s / a[k][k];
  }
  return z;
}

TEST(SyntheticRegressionDataTest, LearnableByALinearMap) {
  // Least squares y_j ~ x . w + c on 4000 rows: the residual is the noise
  // (0.01 * U(-1, 1), RMS 0.0058) while y itself has RMS around 0.58.
  constexpr int kIn = 12, kOut = 3, kRows = 4000;
  const SyntheticRegressionData data(123, kIn, kOut);
  const Rows r = RowsOrDie(data, 1000, kRows);
  for (float v : r.x) {
    ASSERT_GE(v, -1.0f);
    ASSERT_LE(v, 1.0f);
  }
  for (int j = 0; j < kOut; ++j) {
    // Normal equations over features (x_0 .. x_{in-1}, 1).
    std::vector<std::vector<double>> ata(kIn + 1, std::vector<double>(kIn + 1, 0.0));
    std::vector<double> aty(kIn + 1, 0.0);
    double y_sq = 0;
    for (int i = 0; i < kRows; ++i) {
      std::vector<double> f(r.x.begin() + i * kIn, r.x.begin() + (i + 1) * kIn);
      f.push_back(1.0);
      const double y = r.y[i * kOut + j];
      y_sq += y * y;
      for (int a = 0; a <= kIn; ++a) {
        aty[a] += f[a] * y;
        for (int b = 0; b <= kIn; ++b) ata[a][b] += f[a] * f[b];
      }
    }
    const std::vector<double> w = Solve(ata, aty);
    double residual_sq = 0;
    for (int i = 0; i < kRows; ++i) {
      double pred = w[kIn];
      for (int a = 0; a < kIn; ++a) pred += w[a] * r.x[i * kIn + a];
      const double e = r.y[i * kOut + j] - pred;
      residual_sq += e * e;
    }
    const double y_rms = std::sqrt(y_sq / kRows);
    const double residual_rms = std::sqrt(residual_sq / kRows);
    EXPECT_GT(y_rms, 0.2) << j;
    EXPECT_LT(residual_rms, 0.0065) << j;
    EXPECT_GT(residual_rms, 0.004) << j;  // the noise is really there
  }
}

TEST(SyntheticRegressionDataTest, BadWidths) {
  const SyntheticRegressionData data(1, 0);
  std::vector<float> x(4), y(4);
  EXPECT_EQ(data.FillRows(0, 1, x.data(), y.data()).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(OpenRegressionDataTest, FileOrSynthetic) {
  absl::StatusOr<std::unique_ptr<RegressionData>> synthetic = OpenRegressionData("", 4, 3, 3);
  ASSERT_TRUE(synthetic.ok());
  EXPECT_EQ((*synthetic)->num_rows(), 0);
  EXPECT_EQ(RowsOrDie(**synthetic, 0, 2), RowsOrDie(SyntheticRegressionData(4, 3), 0, 2));

  const std::string path = TestDir() + "/d.safetensors";
  ASSERT_TRUE(WriteRegressionFile(path, 5, 3, 4).ok());
  absl::StatusOr<std::unique_ptr<RegressionData>> file = OpenRegressionData(path, 999, 3, 3);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ((*file)->num_rows(), 5);
  EXPECT_EQ(RowsOrDie(**file, 0, 2), RowsOrDie(SyntheticRegressionData(4, 3), 0, 2));

  EXPECT_THAT(OpenRegressionData(path, 0, 2, 3).status().message(),
              HasSubstr("but the model takes 2 features"));
  EXPECT_EQ(OpenRegressionData("", 0, 0, 3).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard
