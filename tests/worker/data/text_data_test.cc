// Tests of the GPT token data: the world-size-independent sample layout, the
// text file's train/validation split, the synthetic addition task, answer
// checking, the factory and error messages.
#include "worker/data/text_data.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TestDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/text_data_" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name();
  mkdir(dir.c_str(), 0777);
  return dir;
}

std::string WriteFile(const std::string& name, const std::string& bytes) {
  const std::string path = TestDir() + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  EXPECT_NE(f, nullptr) << path;
  if (f == nullptr) return path;
  EXPECT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
  std::fclose(f);
  return path;
}

// 1800 bytes of printable ASCII followed by 200 bytes in [128, 256): with
// validation_fraction 0.1 the train split is exactly the ASCII part, so the
// byte values tell which split a token came from.
std::string TwoRegionBytes() {
  std::string bytes;
  uint32_t x = 12345;
  for (int i = 0; i < 1800; ++i) {
    x = x * 1103515245u + 12345u;
    bytes.push_back(static_cast<char>(0x20 + (x >> 16) % 95));
  }
  for (int i = 0; i < 200; ++i) {
    x = x * 1103515245u + 12345u;
    bytes.push_back(static_cast<char>(128 + (x >> 16) % 128));
  }
  return bytes;
}

// A micro-batch: tokens and targets [batch, context].
struct Batch {
  std::vector<int32_t> tokens, targets;
  bool operator==(const Batch& o) const { return tokens == o.tokens && targets == o.targets; }
};

Batch FillOrDie(const TokenData& data, Split split, int64_t step, int micro, int rank, int world,
                int batch, int grad_accum, int context) {
  Batch b{std::vector<int32_t>(batch * context, -7), std::vector<int32_t>(batch * context, -7)};
  absl::Status s = data.FillBatch(split, step, micro, rank, world, batch, grad_accum, context,
                                  b.tokens.data(), b.targets.data());
  EXPECT_TRUE(s.ok()) << s;
  return b;
}

std::unique_ptr<TextFileData> OpenOrDie(const std::string& path, uint64_t seed,
                                        double validation_fraction = 0.1) {
  absl::StatusOr<std::unique_ptr<TextFileData>> data =
      TextFileData::Open(path, seed, validation_fraction);
  EXPECT_TRUE(data.ok()) << data.status();
  return data.ok() ? *std::move(data) : nullptr;
}

// W = 1 with batch W * b equals the W ranks' micro-batches of b, concatenated
// in rank order, for every (step, micro), in both splits.
void ExpectWorldSizeIndependent(const TokenData& data, int context) {
  constexpr int kGradAccum = 2;
  constexpr int kB = 3;
  for (Split split : {Split::kTrain, Split::kValidation}) {
    for (int world : {2, 3, 4}) {
      for (int64_t step : {0, 1, 5}) {
        for (int micro = 0; micro < kGradAccum; ++micro) {
          const Batch whole =
              FillOrDie(data, split, step, micro, 0, 1, world * kB, kGradAccum, context);
          Batch joined;
          for (int rank = 0; rank < world; ++rank) {
            const Batch part =
                FillOrDie(data, split, step, micro, rank, world, kB, kGradAccum, context);
            joined.tokens.insert(joined.tokens.end(), part.tokens.begin(), part.tokens.end());
            joined.targets.insert(joined.targets.end(), part.targets.begin(), part.targets.end());
          }
          EXPECT_TRUE(whole == joined)
              << SplitName(split) << " world " << world << " step " << step << " micro " << micro;
        }
      }
    }
  }
}

// Targets are the tokens shifted by one, and the last target is the window's
// extra token.
void ExpectTargetsShifted(const TokenData& data, Split split, int context) {
  constexpr int kBatch = 4;
  const Batch b = FillOrDie(data, split, 2, 1, 1, 3, kBatch, 2, context);
  // Global sample of row i: ((2 * 2 + 1) * 3 + 1) * 4 + i.
  const int64_t first = ((2 * 2 + 1) * 3 + 1) * kBatch;
  for (int i = 0; i < kBatch; ++i) {
    std::vector<int32_t> window(context + 1);
    ASSERT_TRUE(data.FillSample(split, first + i, context, window.data()).ok());
    for (int j = 0; j < context; ++j) {
      EXPECT_EQ(b.tokens[i * context + j], window[j]) << "row " << i << " pos " << j;
      EXPECT_EQ(b.targets[i * context + j], window[j + 1]) << "row " << i << " pos " << j;
      if (j + 1 < context) {
        EXPECT_EQ(b.targets[i * context + j], b.tokens[i * context + j + 1]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Text files

TEST(TextFileData, SplitsTheLastFractionOffForValidation) {
  auto data = OpenOrDie(WriteFile("t.txt", TwoRegionBytes()), 1);
  ASSERT_NE(data, nullptr);
  EXPECT_EQ(data->size(), 2000);
  EXPECT_EQ(data->split_begin(Split::kTrain), 0);
  EXPECT_EQ(data->split_end(Split::kTrain), 1800);
  EXPECT_EQ(data->split_begin(Split::kValidation), 1800);
  EXPECT_EQ(data->split_end(Split::kValidation), 2000);
  EXPECT_THAT(data->Describe(), AllOf(HasSubstr("t.txt"), HasSubstr("2000 bytes"),
                                      HasSubstr("1800 train"), HasSubstr("200 validation")));
}

TEST(TextFileData, SplitsAreDisjointAndHighBytesAreUnsignedTokens) {
  const std::string bytes = TwoRegionBytes();
  auto data = OpenOrDie(WriteFile("t.txt", bytes), 7);
  ASSERT_NE(data, nullptr);
  constexpr int kContext = 32;
  for (int64_t step = 0; step < 20; ++step) {
    const Batch train = FillOrDie(*data, Split::kTrain, step, 0, 0, 1, 8, 1, kContext);
    const Batch val = FillOrDie(*data, Split::kValidation, step, 0, 0, 1, 8, 1, kContext);
    for (size_t k = 0; k < train.tokens.size(); ++k) {
      ASSERT_GE(train.tokens[k], 0x20);
      ASSERT_LT(train.tokens[k], 0x7f);
      ASSERT_GE(train.targets[k], 0x20);
      ASSERT_LT(train.targets[k], 0x7f);
    }
    for (size_t k = 0; k < val.tokens.size(); ++k) {
      ASSERT_GE(val.tokens[k], 128);
      ASSERT_LT(val.tokens[k], 256);
      ASSERT_GE(val.targets[k], 128);
      ASSERT_LT(val.targets[k], 256);
    }
  }
  // Every window is the file's bytes at its offset, within its split.
  for (Split split : {Split::kTrain, Split::kValidation}) {
    for (int64_t g = 0; g < 200; ++g) {
      absl::StatusOr<int64_t> offset = data->SampleOffset(split, g, kContext);
      ASSERT_TRUE(offset.ok()) << offset.status();
      ASSERT_GE(*offset, data->split_begin(split));
      ASSERT_LE(*offset + kContext + 1, data->split_end(split));
      std::vector<int32_t> window(kContext + 1);
      ASSERT_TRUE(data->FillSample(split, g, kContext, window.data()).ok());
      for (int j = 0; j <= kContext; ++j) {
        ASSERT_EQ(window[j], static_cast<unsigned char>(bytes[*offset + j]));
      }
    }
  }
}

TEST(TextFileData, WindowsCoverTheWholeSplit) {
  // Context 1 in a 20-byte file: train has 18 bytes (17 starts), validation
  // 2 bytes (1 start). A few hundred samples reach every start.
  std::string bytes;
  for (int i = 0; i < 20; ++i) bytes.push_back(static_cast<char>('a' + i));
  auto data = OpenOrDie(WriteFile("t.txt", bytes), 3);
  ASSERT_NE(data, nullptr);
  std::set<int64_t> starts;
  for (int64_t g = 0; g < 500; ++g) starts.insert(*data->SampleOffset(Split::kTrain, g, 1));
  EXPECT_EQ(starts.size(), 17u);
  EXPECT_EQ(*starts.begin(), 0);
  EXPECT_EQ(*starts.rbegin(), 16);
  for (int64_t g = 0; g < 10; ++g) EXPECT_EQ(*data->SampleOffset(Split::kValidation, g, 1), 18);
}

TEST(TextFileData, DeterministicPerSeed) {
  const std::string path = WriteFile("t.txt", TwoRegionBytes());
  auto a = OpenOrDie(path, 11);
  auto b = OpenOrDie(path, 11);
  auto c = OpenOrDie(path, 12);
  ASSERT_TRUE(a && b && c);
  for (Split split : {Split::kTrain, Split::kValidation}) {
    const Batch x = FillOrDie(*a, split, 3, 1, 1, 2, 4, 2, 16);
    EXPECT_TRUE(x == FillOrDie(*a, split, 3, 1, 1, 2, 4, 2, 16));
    EXPECT_TRUE(x == FillOrDie(*b, split, 3, 1, 1, 2, 4, 2, 16));
    EXPECT_FALSE(x == FillOrDie(*c, split, 3, 1, 1, 2, 4, 2, 16));
  }
  // Different steps draw different windows.
  EXPECT_FALSE(FillOrDie(*a, Split::kTrain, 0, 0, 0, 1, 4, 1, 16) ==
               FillOrDie(*a, Split::kTrain, 1, 0, 0, 1, 4, 1, 16));
}

TEST(TextFileData, WorldSizeIndependent) {
  auto data = OpenOrDie(WriteFile("t.txt", TwoRegionBytes()), 5);
  ASSERT_NE(data, nullptr);
  ExpectWorldSizeIndependent(*data, 24);
}

TEST(TextFileData, TargetsAreTokensShiftedByOne) {
  auto data = OpenOrDie(WriteFile("t.txt", TwoRegionBytes()), 5);
  ASSERT_NE(data, nullptr);
  ExpectTargetsShifted(*data, Split::kTrain, 20);
  ExpectTargetsShifted(*data, Split::kValidation, 20);
}

TEST(TextFileData, MissingFile) {
  const std::string path = TestDir() + "/no_such_file.txt";
  absl::StatusOr<std::unique_ptr<TextFileData>> data = TextFileData::Open(path, 1);
  ASSERT_FALSE(data.ok());
  EXPECT_EQ(data.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(data.status().message(), HasSubstr(path));
}

TEST(TextFileData, EmptyFile) {
  const std::string path = WriteFile("empty.txt", "");
  absl::StatusOr<std::unique_ptr<TextFileData>> data = TextFileData::Open(path, 1);
  ASSERT_FALSE(data.ok());
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(), AllOf(HasSubstr(path), HasSubstr("empty")));
}

TEST(TextFileData, FileTooShortToSplit) {
  // 10 bytes: validation would get 1 byte.
  const std::string path = WriteFile("tiny.txt", "0123456789");
  absl::StatusOr<std::unique_ptr<TextFileData>> data = TextFileData::Open(path, 1);
  ASSERT_FALSE(data.ok());
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(data.status().message(), AllOf(HasSubstr(path), HasSubstr("10 bytes"),
                                             HasSubstr("9 train"), HasSubstr("1 validation")));
}

TEST(TextFileData, FileTooShortForContext) {
  // 100 bytes: 90 train, 10 validation.
  const std::string path = WriteFile("short.txt", std::string(100, 'x'));
  auto data = OpenOrDie(path, 1);
  ASSERT_NE(data, nullptr);
  EXPECT_TRUE(data->CheckContext(9).ok());
  absl::Status s = data->CheckContext(10);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr(path), HasSubstr("context 10"),
                                 HasSubstr("validation split has 10 bytes"), HasSubstr("100"),
                                 HasSubstr("context + 1 = 11")));
  s = data->CheckContext(90);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("train split has 90 bytes"), HasSubstr("= 91")));
  // FillBatch refuses too, with the same message.
  std::vector<int32_t> tokens(64), targets(64);
  s = data->FillBatch(Split::kTrain, 0, 0, 0, 1, 1, 1, 64, tokens.data(), targets.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr(path), HasSubstr("too short")));
}

TEST(TextFileData, BadValidationFraction) {
  const std::string path = WriteFile("t.txt", TwoRegionBytes());
  for (double f : {0.0, 1.0, -0.5, 1.5, std::nan("")}) {
    absl::StatusOr<std::unique_ptr<TextFileData>> data = TextFileData::Open(path, 1, f);
    ASSERT_FALSE(data.ok()) << f;
    EXPECT_THAT(data.status().message(), HasSubstr("validation_fraction")) << f;
  }
  // Another fraction moves the boundary.
  auto data = OpenOrDie(path, 1, 0.25);
  ASSERT_NE(data, nullptr);
  EXPECT_EQ(data->split_end(Split::kTrain), 1500);
}

TEST(TokenData, RejectsBadCoordinates) {
  auto data = OpenOrDie(WriteFile("t.txt", TwoRegionBytes()), 1);
  ASSERT_NE(data, nullptr);
  std::vector<int32_t> tokens(64), targets(64);
  int32_t* t = tokens.data();
  int32_t* y = targets.data();
  EXPECT_FALSE(data->FillBatch(Split::kTrain, -1, 0, 0, 1, 1, 1, 8, t, y).ok());
  EXPECT_FALSE(data->FillBatch(Split::kTrain, 0, 1, 0, 1, 1, 1, 8, t, y).ok());  // micro
  EXPECT_FALSE(data->FillBatch(Split::kTrain, 0, 0, 2, 2, 1, 1, 8, t, y).ok());  // rank
  EXPECT_FALSE(data->FillBatch(Split::kTrain, 0, 0, 0, 1, 0, 1, 8, t, y).ok());  // batch
  EXPECT_FALSE(data->FillBatch(Split::kTrain, 0, 0, 0, 1, 1, 1, 0, t, y).ok());  // context
  EXPECT_FALSE(data->FillBatch(Split::kTrain, 0, 0, 0, 1, 1, 1, 8, nullptr, y).ok());
  EXPECT_FALSE(data->FillSample(Split::kTrain, -1, 8, t).ok());
  EXPECT_FALSE(data->FillSample(Split::kTrain, 0, 8, nullptr).ok());
}

// ---------------------------------------------------------------------------
// Addition task

// Parses "a+b=c" (no newline); false unless it is exactly that shape.
bool ParseLine(const std::string& line, int64_t* a, int64_t* b, int64_t* c) {
  const size_t plus = line.find('+');
  const size_t eq = line.find('=');
  if (plus == std::string::npos || eq == std::string::npos || eq < plus) return false;
  const std::string sa = line.substr(0, plus);
  const std::string sb = line.substr(plus + 1, eq - plus - 1);
  const std::string sc = line.substr(eq + 1);
  for (const std::string* s : {&sa, &sb, &sc}) {
    if (s->empty()) return false;
    for (char ch : *s) {
      if (ch < '0' || ch > '9') return false;
    }
    if (s->size() > 1 && (*s)[0] == '0') return false;  // no leading zeros
  }
  return absl::SimpleAtoi(sa, a) && absl::SimpleAtoi(sb, b) && absl::SimpleAtoi(sc, c);
}

std::string WindowText(const std::vector<int32_t>& window) {
  std::string text;
  for (int32_t t : window) text.push_back(static_cast<char>(t));
  return text;
}

TEST(AdditionTaskData, LinesAreCorrectAndParse) {
  const AdditionTaskData data(42);
  constexpr int kContext = 64;
  for (Split split : {Split::kTrain, Split::kValidation}) {
    int whole_lines = 0;
    for (int64_t g = 0; g < 100; ++g) {
      std::vector<int32_t> window(kContext + 1);
      ASSERT_TRUE(data.FillSample(split, g, kContext, window.data()).ok());
      const std::string text = WindowText(window);
      // The sample starts with line g * L of the split.
      const int64_t first_line = g * AdditionTaskData::LinesPerSample(kContext);
      ASSERT_EQ(text.rfind(data.Problem(split, first_line).prompt, 0), 0u) << text;
      std::vector<std::string> lines = absl::StrSplit(text, '\n');
      lines.pop_back();  // the cut-off tail (empty if the cut fell on a newline)
      ASSERT_GE(lines.size(), 3u) << text;
      for (const std::string& line : lines) {
        int64_t a, b, c;
        ASSERT_TRUE(ParseLine(line, &a, &b, &c)) << "\"" << line << "\"";
        EXPECT_EQ(a + b, c) << line;
        EXPECT_LT(a, 1000);
        EXPECT_LT(b, 1000);
        EXPECT_EQ(data.IsValidationPair(a, b), split == Split::kValidation) << line;
        ++whole_lines;
      }
    }
    EXPECT_GT(whole_lines, 400);
  }
}

TEST(AdditionTaskData, ReversedAnswersAreTheSumLeastSignificantDigitFirst) {
  AdditionTaskData forward(5, 3), reversed(5, 3, /*reversed=*/true);
  for (int64_t line = 0; line < 200; ++line) {
    for (Split split : {Split::kTrain, Split::kValidation}) {
      AdditionProblem f = forward.Problem(split, line), r = reversed.Problem(split, line);
      EXPECT_EQ(r.prompt, absl::StrFormat("%03d+%03d=", f.a, f.b));
      std::string expected = absl::StrFormat("%04d", f.a + f.b);
      std::reverse(expected.begin(), expected.end());
      EXPECT_EQ(r.answer, expected) << r.Line();
      EXPECT_EQ(r.Line().size(), 3 + 1 + 3 + 1 + 4 + 1u);
    }
  }
  auto opened = OpenTokenData("", "reversed-addition", 5, 0.1, 3);
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto* data = dynamic_cast<AdditionTaskData*>(opened->get());
  ASSERT_NE(data, nullptr);
  AdditionProblem p = data->Problem(Split::kTrain, 0);
  std::string expected = absl::StrFormat("%04d", p.a + p.b);
  std::reverse(expected.begin(), expected.end());
  EXPECT_EQ(p.answer, expected);
}

TEST(AdditionTaskData, OperandsSpanTheRange) {
  const AdditionTaskData data(9, 2);
  int64_t max_a = 0, max_b = 0;
  std::set<int64_t> b_last_digits;
  for (int64_t k = 0; k < 2000; ++k) {
    const AdditionProblem p = data.Problem(Split::kTrain, k);
    ASSERT_GE(p.a, 0);
    ASSERT_GE(p.b, 0);
    ASSERT_LT(p.a, 100);
    ASSERT_LT(p.b, 100);
    max_a = std::max(max_a, p.a);
    max_b = std::max(max_b, p.b);
    b_last_digits.insert(p.b % 10);
  }
  EXPECT_GE(max_a, 95);
  EXPECT_GE(max_b, 90);
  EXPECT_EQ(b_last_digits.size(), 10u);  // the held-out digit varies with a
}

TEST(AdditionTaskData, MaxLineBytesBoundsEveryLine) {
  for (bool reversed : {false, true}) {
    for (int digits : {1, 2, 3}) {
      const AdditionTaskData data(4, digits, reversed);
      size_t longest = 0;
      for (Split split : {Split::kTrain, Split::kValidation}) {
        for (int64_t k = 0; k < 3000; ++k) {
          longest = std::max(longest, data.Problem(split, k).Line().size());
        }
      }
      // Reversed lines all have the longest length; "99+99=198\n" reaches it.
      EXPECT_EQ(longest, static_cast<size_t>(data.MaxLineBytes())) << digits << reversed;
    }
  }
}

TEST(AdditionTaskData, ValidationProblemsAreHeldOutOfTraining) {
  // With 2 digits the whole space is 10^4 pairs: exactly a tenth are
  // validation pairs, one last digit of b per a.
  const AdditionTaskData data(5, 2);
  int validation_pairs = 0;
  for (int64_t a = 0; a < 100; ++a) {
    int per_a = 0;
    for (int64_t b = 0; b < 100; ++b) per_a += data.IsValidationPair(a, b);
    EXPECT_EQ(per_a, 10) << a;
    validation_pairs += per_a;
  }
  EXPECT_EQ(validation_pairs, 1000);

  std::set<std::pair<int64_t, int64_t>> train;
  for (int64_t k = 0; k < 20000; ++k) {
    const AdditionProblem p = data.Problem(Split::kTrain, k);
    EXPECT_FALSE(data.IsValidationPair(p.a, p.b));
    train.insert({p.a, p.b});
  }
  EXPECT_GT(train.size(), 7800u);  // ~8030 expected of the 9000 training pairs
  const std::vector<AdditionProblem> val = data.ValidationProblems(500);
  ASSERT_EQ(val.size(), 500u);
  std::set<std::pair<int64_t, int64_t>> val_pairs;
  for (const AdditionProblem& p : val) {
    EXPECT_TRUE(data.IsValidationPair(p.a, p.b));
    EXPECT_EQ(train.count({p.a, p.b}), 0u) << p.prompt;
    val_pairs.insert({p.a, p.b});
  }
  EXPECT_GT(val_pairs.size(), 300u);
}

TEST(AdditionTaskData, ValidationProblemsMatchTheValidationStream) {
  const AdditionTaskData data(77);
  const std::vector<AdditionProblem> problems = data.ValidationProblems(50);
  ASSERT_EQ(problems.size(), 50u);
  EXPECT_TRUE(data.ValidationProblems(0).empty());
  for (int i = 0; i < 50; ++i) {
    const AdditionProblem& p = problems[i];
    EXPECT_EQ(p.prompt, absl::StrCat(p.a, "+", p.b, "="));
    EXPECT_EQ(p.answer, absl::StrCat(p.a + p.b));
    EXPECT_EQ(p.Line(), p.prompt + p.answer + "\n");
    const AdditionProblem q = data.Problem(Split::kValidation, i);
    EXPECT_EQ(p.Line(), q.Line());
  }
  // Validation sample 0 is validation lines 0, 1, ... cut to the window.
  constexpr int kContext = 40;
  std::string stream;
  for (const AdditionProblem& p : problems) stream += p.Line();
  std::vector<int32_t> window(kContext + 1);
  ASSERT_TRUE(data.FillSample(Split::kValidation, 0, kContext, window.data()).ok());
  EXPECT_EQ(WindowText(window), stream.substr(0, kContext + 1));
  // The training stream is different.
  ASSERT_TRUE(data.FillSample(Split::kTrain, 0, kContext, window.data()).ok());
  EXPECT_NE(WindowText(window), stream.substr(0, kContext + 1));
}

TEST(AdditionTaskData, DeterministicPerSeed) {
  const AdditionTaskData a(3), b(3), c(4);
  for (Split split : {Split::kTrain, Split::kValidation}) {
    const Batch x = FillOrDie(a, split, 2, 0, 1, 2, 4, 1, 32);
    EXPECT_TRUE(x == FillOrDie(b, split, 2, 0, 1, 2, 4, 1, 32));
    EXPECT_FALSE(x == FillOrDie(c, split, 2, 0, 1, 2, 4, 1, 32));
  }
  EXPECT_EQ(a.ValidationProblems(10)[9].Line(), b.ValidationProblems(10)[9].Line());
}

TEST(AdditionTaskData, WorldSizeIndependent) {
  ExpectWorldSizeIndependent(AdditionTaskData(8), 30);
}

TEST(AdditionTaskData, TargetsAreTokensShiftedByOne) {
  const AdditionTaskData data(8);
  ExpectTargetsShifted(data, Split::kTrain, 17);
  ExpectTargetsShifted(data, Split::kValidation, 17);
}

TEST(AdditionTaskData, SamplesDoNotShareLines) {
  // Consecutive samples start at different problems, L lines apart.
  const AdditionTaskData data(1);
  constexpr int kContext = 23;  // L = 4
  EXPECT_EQ(AdditionTaskData::LinesPerSample(kContext), 4);
  EXPECT_EQ(AdditionTaskData::LinesPerSample(5), 1);
  EXPECT_EQ(AdditionTaskData::LinesPerSample(6), 2);
  std::vector<int32_t> window(kContext + 1);
  ASSERT_TRUE(data.FillSample(Split::kTrain, 3, kContext, window.data()).ok());
  EXPECT_EQ(WindowText(window).rfind(data.Problem(Split::kTrain, 12).prompt, 0), 0u);
}

TEST(ScoreOnlyAnswers, KeepsTheAnswersAndTheirNewlines) {
  // Two rows of "47+35=280\n05+07=210\n" cut to 12 tokens plus a target: each
  // line scores its 3 answer digits and '\n'; operands, '+' and '=' are not.
  const std::string text = "47+35=280\n05+07=210\n";
  constexpr int kContext = 12;
  std::vector<int32_t> tokens, targets;
  for (int r = 0; r < 2; ++r) {
    for (int j = 0; j < kContext; ++j) {
      tokens.push_back(static_cast<unsigned char>(text[j]));
      targets.push_back(static_cast<unsigned char>(text[j + 1]));
    }
  }
  ScoreOnlyAnswers(tokens.data(), targets.data(), 2, kContext);
  std::string kept;
  for (int32_t t : targets) kept += t == kUnscoredTarget ? '.' : static_cast<char>(t);
  EXPECT_EQ(kept.substr(0, kContext), ".....280\n...");
  EXPECT_EQ(kept.substr(kContext), kept.substr(0, kContext));  // each row from its own start
}

TEST(ScoreOnlyAnswers, ScoresFourTargetsPerReversedLine) {
  // Fixed-width lines: every window of the quickstart's shape scores the same
  // number of targets, so the mean over ranks is the mean over all of them.
  const AdditionTaskData data(5, 2, /*reversed=*/true);
  constexpr int kContext = 32, kBatch = 8;
  std::vector<int32_t> tokens(kBatch * kContext), targets(kBatch * kContext);
  ASSERT_TRUE(
      data.FillBatch(Split::kTrain, 3, 0, 1, 2, kBatch, 1, kContext, tokens.data(), targets.data())
          .ok());
  ScoreOnlyAnswers(tokens.data(), targets.data(), kBatch, kContext);
  for (int r = 0; r < kBatch; ++r) {
    // 33 tokens hold lines at 0, 10, 20 and 30: three whole answers (4
    // targets each) and none of the fourth line's.
    EXPECT_EQ(ScoredPositions(targets.data() + r * kContext, kContext), 12) << r;
  }
}

TEST(AdditionTaskData, BadDigits) {
  const AdditionTaskData data(1, 0);
  std::vector<int32_t> tokens(8), targets(8);
  absl::Status s =
      data.FillBatch(Split::kTrain, 0, 0, 0, 1, 1, 1, 8, tokens.data(), targets.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("digits"));
  EXPECT_TRUE(data.ValidationProblems(3).empty());
  EXPECT_FALSE(AdditionTaskData(1, 10).CheckContext(8).ok());
  EXPECT_TRUE(AdditionTaskData(1, 9).CheckContext(8).ok());
}

TEST(CheckAnswer, ComparesUpToTheFirstNewline) {
  EXPECT_TRUE(CheckAnswer("579\n", "579"));
  EXPECT_TRUE(CheckAnswer("579\n12+3=15\n", "579"));
  EXPECT_TRUE(CheckAnswer("579", "579"));  // generation stopped right after the digits
  EXPECT_FALSE(CheckAnswer("5791\n", "579"));
  EXPECT_FALSE(CheckAnswer("57\n9", "579"));
  EXPECT_FALSE(CheckAnswer("578\n", "579"));
  EXPECT_FALSE(CheckAnswer("\n579", "579"));
  EXPECT_FALSE(CheckAnswer("", "579"));
  EXPECT_FALSE(CheckAnswer(" 579\n", "579"));
}

// ---------------------------------------------------------------------------
// Factory and printing

TEST(OpenTokenData, PicksTheSource) {
  const std::string path = WriteFile("t.txt", TwoRegionBytes());
  for (const char* task : {"text", ""}) {
    absl::StatusOr<std::unique_ptr<TokenData>> text = OpenTokenData(path, task, 1, 0.1);
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_NE(dynamic_cast<TextFileData*>(text->get()), nullptr);
  }
  absl::StatusOr<std::unique_ptr<TokenData>> add = OpenTokenData("", "addition", 1, 0.1);
  ASSERT_TRUE(add.ok()) << add.status();
  auto* addition = dynamic_cast<AdditionTaskData*>(add->get());
  ASSERT_NE(addition, nullptr);
  EXPECT_EQ(addition->digits(), 3);
  EXPECT_EQ((*add)->vocab(), 256);
}

TEST(OpenTokenData, ClearErrors) {
  const std::string path = WriteFile("t.txt", TwoRegionBytes());
  absl::StatusOr<std::unique_ptr<TokenData>> r = OpenTokenData("", "text", 1, 0.1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("needs a data file"));
  r = OpenTokenData("", "", 1, 0.1);
  EXPECT_THAT(r.status().message(), HasSubstr("needs a data file"));
  r = OpenTokenData(path, "addition", 1, 0.1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), AllOf(HasSubstr("reads no file"), HasSubstr(path)));
  r = OpenTokenData("", "multiplication", 1, 0.1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      r.status().message(),
      HasSubstr("--task=multiplication is unknown: expected addition or reversed-addition"));
  r = OpenTokenData("", "addition", 1, 0.1, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  r = OpenTokenData(TestDir() + "/missing.txt", "text", 1, 0.1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("missing.txt"));
}

TEST(TokensToText, EscapesNonPrintableBytes) {
  const std::vector<int32_t> tokens = {'1',  '+', '2', '=', '3', '\n', '\t',
                                       '\\', 0,   127, 200, 255, 256,  -1};
  EXPECT_EQ(TokensToText(tokens.data(), static_cast<int>(tokens.size())),
            "1+2=3\\n\\t\\\\\\x00\\x7f\\xc8\\xff<256><-1>");
  EXPECT_EQ(TokensToText(tokens.data(), 0), "");
  EXPECT_EQ(TokensToText(nullptr, 3), "");
}

}  // namespace
}  // namespace zeroshard
