#include "worker/data/text_data.h"

#include <algorithm>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "worker/data/regression_data.h"
#include "worker/model/init.h"
#include "worker/model/layers.h"

namespace zeroshard {
namespace {

// The shortest addition line, "0+0=0\n", in bytes.
constexpr int64_t kMinAdditionLineBytes = 6;

absl::Status CheckWindowArgs(int64_t sample, int context, const int32_t* window) {
  if (sample < 0) return absl::InvalidArgumentError(absl::StrCat("negative sample index ", sample));
  if (context < 1) {
    return absl::InvalidArgumentError(absl::StrCat("context must be >= 1, got ", context));
  }
  if (window == nullptr) return absl::InvalidArgumentError("null token window");
  return absl::OkStatus();
}

// Reads the whole file at `path`; errors carry the path and strerror.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat("cannot open text data file ", path));
  }
  std::string bytes;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) bytes.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) return absl::ErrnoToStatus(err, absl::StrCat("error reading text data file ", path));
  return bytes;
}

}  // namespace

const char* SplitName(Split split) { return split == Split::kTrain ? "train" : "validation"; }

absl::Status TokenData::FillBatch(Split split, int64_t step, int micro, int rank, int world,
                                  int batch, int grad_accum, int context, int32_t* tokens,
                                  int32_t* targets, int64_t row_offset) const {
  absl::StatusOr<int64_t> first = MicroBatchStartRow(step, micro, rank, world, batch, grad_accum);
  if (!first.ok()) return first.status();
  *first += row_offset;
  if (context < 1) {
    return absl::InvalidArgumentError(absl::StrCat("context must be >= 1, got ", context));
  }
  if (tokens == nullptr || targets == nullptr) {
    return absl::InvalidArgumentError("null tokens or targets buffer");
  }
  if (absl::Status s = CheckContext(context); !s.ok()) return s;
  std::vector<int32_t> window(static_cast<size_t>(context) + 1);
  for (int i = 0; i < batch; ++i) {
    if (absl::Status s = FillSample(split, *first + i, context, window.data()); !s.ok()) return s;
    int32_t* row_tokens = tokens + static_cast<int64_t>(i) * context;
    int32_t* row_targets = targets + static_cast<int64_t>(i) * context;
    std::memcpy(row_tokens, window.data(), sizeof(int32_t) * context);
    std::memcpy(row_targets, window.data() + 1, sizeof(int32_t) * context);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// TextFileData

TextFileData::TextFileData(std::string path, std::string bytes, int64_t train_bytes, uint64_t seed)
    : path_(std::move(path)),
      bytes_(std::move(bytes)),
      train_bytes_(train_bytes),
      train_key_(InitStreamKey(seed, "text_data/train")),
      validation_key_(InitStreamKey(seed, "text_data/validation")) {}

absl::StatusOr<std::unique_ptr<TextFileData>> TextFileData::Open(const std::string& path,
                                                                 uint64_t seed,
                                                                 double validation_fraction) {
  // Written so that NaN fails too.
  if (!(validation_fraction > 0.0 && validation_fraction < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("validation_fraction must be in (0, 1), got ",
                                                   validation_fraction, " (text data file ", path,
                                                   ")"));
  }
  absl::StatusOr<std::string> bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  const int64_t size = static_cast<int64_t>(bytes->size());
  if (size == 0) {
    return absl::InvalidArgumentError(absl::StrCat("text data file ", path, " is empty"));
  }
  // The last validation_fraction of the bytes, rounded down.
  const int64_t validation_bytes =
      static_cast<int64_t>(std::floor(static_cast<double>(size) * validation_fraction));
  const int64_t train_bytes = size - validation_bytes;
  if (train_bytes < 2 || validation_bytes < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "text data file ", path, " is too short: its ", size, " bytes split into ", train_bytes,
        " train and ", validation_bytes, " validation bytes (validation_fraction ",
        validation_fraction, "); each split needs at least context + 1 >= 2 bytes"));
  }
  return std::unique_ptr<TextFileData>(
      new TextFileData(path, *std::move(bytes), train_bytes, seed));
}

std::string TextFileData::Describe() const {
  return absl::StrCat("text file ", path_, " (", size(), " bytes: ", train_bytes_, " train, ",
                      size() - train_bytes_, " validation)");
}

absl::Status TextFileData::CheckContext(int context) const {
  if (context < 1) {
    return absl::InvalidArgumentError(absl::StrCat("context must be >= 1, got ", context));
  }
  for (Split split : {Split::kTrain, Split::kValidation}) {
    const int64_t bytes = split_end(split) - split_begin(split);
    if (bytes < int64_t{context} + 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("text data file ", path_, " is too short for context ", context, ": its ",
                       SplitName(split), " split has ", bytes, " bytes (of ", size(),
                       " in the file) but a sample needs context + 1 = ", int64_t{context} + 1,
                       "; use a longer file, a smaller context or another validation_fraction"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> TextFileData::SampleOffset(Split split, int64_t sample, int context) const {
  if (sample < 0) return absl::InvalidArgumentError(absl::StrCat("negative sample index ", sample));
  if (absl::Status s = CheckContext(context); !s.ok()) return s;
  const int64_t begin = split_begin(split);
  // Windows of context + 1 bytes can start at split offsets [0, starts).
  const uint64_t starts = static_cast<uint64_t>(split_end(split) - begin - context);
  const uint64_t key = split == Split::kTrain ? train_key_ : validation_key_;
  // Modulo bias is below starts / 2^64: negligible for any real file.
  return begin + static_cast<int64_t>(InitBits(key, static_cast<uint64_t>(sample)) % starts);
}

absl::Status TextFileData::FillSample(Split split, int64_t sample, int context,
                                      int32_t* window) const {
  if (absl::Status s = CheckWindowArgs(sample, context, window); !s.ok()) return s;
  absl::StatusOr<int64_t> offset = SampleOffset(split, sample, context);
  if (!offset.ok()) return offset.status();
  const unsigned char* src = reinterpret_cast<const unsigned char*>(bytes_.data()) + *offset;
  // Through unsigned char so bytes >= 128 become tokens 128..255, not negatives.
  for (int j = 0; j <= context; ++j) window[j] = src[j];
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// AdditionTaskData

namespace {

int64_t PowerOfTen(int digits) {
  int64_t p = 1;
  for (int i = 0; i < digits; ++i) p *= 10;
  return p;
}

}  // namespace

AdditionTaskData::AdditionTaskData(uint64_t seed, int digits, bool reversed)
    : seed_(seed),
      digits_(digits),
      reversed_(reversed),
      modulus_(digits >= 1 && digits <= kMaxDigits ? PowerOfTen(digits) : 0),
      train_key_(InitStreamKey(seed, "addition/train")),
      validation_key_(InitStreamKey(seed, "addition/validation")),
      partition_key_(InitStreamKey(seed, "addition/held_out_digit")) {}

absl::Status AdditionTaskData::CheckDigits() const {
  if (modulus_ == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("addition task: digits must be in [1, ", kMaxDigits, "], got ", digits_));
  }
  return absl::OkStatus();
}

std::string AdditionTaskData::Describe() const {
  return absl::StrCat("addition task (operands of up to ", digits_, " digits, seed ", seed_,
                      ", 1 in ", kValidationShareInverse, " problems held out for validation)");
}

absl::Status AdditionTaskData::CheckContext(int context) const {
  if (absl::Status s = CheckDigits(); !s.ok()) return s;
  if (context < 1) {
    return absl::InvalidArgumentError(absl::StrCat("context must be >= 1, got ", context));
  }
  return absl::OkStatus();
}

int AdditionTaskData::HeldOutDigit(int64_t a) const {
  return static_cast<int>(InitBits(partition_key_, static_cast<uint64_t>(a)) %
                          kValidationShareInverse);
}

bool AdditionTaskData::IsValidationPair(int64_t a, int64_t b) const {
  return b >= 0 && b % 10 == HeldOutDigit(a);
}

AdditionProblem AdditionTaskData::Problem(Split split, int64_t line) const {
  AdditionProblem p;
  if (modulus_ == 0 || line < 0) return p;  // callers check CheckDigits()
  // Three draws per line: a, b's leading digits, and (train only) b's last
  // digit among the nine that are not held out for this a.
  const uint64_t key = split == Split::kValidation ? validation_key_ : train_key_;
  const uint64_t counter = static_cast<uint64_t>(line) * 3;
  p.a = static_cast<int64_t>(InitBits(key, counter) % static_cast<uint64_t>(modulus_));
  const int64_t high =
      static_cast<int64_t>(InitBits(key, counter + 1) % static_cast<uint64_t>(modulus_ / 10));
  const int held = HeldOutDigit(p.a);
  int last = held;
  if (split == Split::kTrain) {
    last = static_cast<int>(InitBits(key, counter + 2) % (kValidationShareInverse - 1));
    if (last >= held) ++last;
  }
  p.b = high * 10 + last;
  if (reversed_) {
    // Fixed width: operands zero-padded to `digits`, the sum to digits + 1
    // and written least-significant digit first, so that every digit sits at
    // the same offset from '=' in every line.
    p.prompt = absl::StrFormat("%0*d+%0*d=", digits_, p.a, digits_, p.b);
    p.answer = absl::StrFormat("%0*d", digits_ + 1, p.a + p.b);
    std::reverse(p.answer.begin(), p.answer.end());
  } else {
    p.prompt = absl::StrCat(p.a, "+", p.b, "=");
    p.answer = absl::StrCat(p.a + p.b);
  }
  return p;
}

std::vector<AdditionProblem> AdditionTaskData::ValidationProblems(int count) const {
  std::vector<AdditionProblem> problems;
  if (modulus_ == 0) return problems;
  for (int i = 0; i < count; ++i) problems.push_back(Problem(Split::kValidation, i));
  return problems;
}

int64_t AdditionTaskData::LinesPerSample(int context) {
  const int64_t need = int64_t{context} + 1;
  return (need + kMinAdditionLineBytes - 1) / kMinAdditionLineBytes;
}

absl::Status AdditionTaskData::FillSample(Split split, int64_t sample, int context,
                                          int32_t* window) const {
  if (absl::Status s = CheckWindowArgs(sample, context, window); !s.ok()) return s;
  if (absl::Status s = CheckDigits(); !s.ok()) return s;
  const int64_t lines = LinesPerSample(context);
  int64_t line = 0;
  if (__builtin_mul_overflow(sample, lines, &line) || line > INT64_MAX - lines) {
    return absl::OutOfRangeError(
        absl::StrCat("addition task: line index of sample ", sample, " overflows int64"));
  }
  int filled = 0;
  while (filled <= context) {
    const std::string text = Problem(split, line++).Line();
    for (size_t j = 0; j < text.size() && filled <= context; ++j) {
      window[filled++] = static_cast<unsigned char>(text[j]);
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Free functions

bool CheckAnswer(const std::string& generated_after_prompt, const std::string& expected) {
  const size_t newline = generated_after_prompt.find('\n');
  return absl::string_view(generated_after_prompt).substr(0, newline) == expected;
}

absl::StatusOr<std::unique_ptr<TokenData>> OpenTokenData(const std::string& data_path_or_empty,
                                                         const std::string& task, uint64_t seed,
                                                         double validation_fraction,
                                                         int addition_digits) {
  const bool has_path = !data_path_or_empty.empty();
  if (task == "addition" || task == "reversed-addition") {
    if (has_path) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the addition task generates its data and reads no file, but a data file was given: ",
          data_path_or_empty, " (use task \"text\" to train on it)"));
    }
    if (addition_digits < 1 || addition_digits > AdditionTaskData::kMaxDigits) {
      return absl::InvalidArgumentError(absl::StrCat("addition task: digits must be in [1, ",
                                                     AdditionTaskData::kMaxDigits, "], got ",
                                                     addition_digits));
    }
    return std::unique_ptr<TokenData>(
        new AdditionTaskData(seed, addition_digits, task == "reversed-addition"));
  }
  if (task == "text" || task.empty()) {
    if (!has_path) {
      return absl::InvalidArgumentError(
          "the text task needs a data file (a path to a text file); or use task \"addition\" for "
          "the built-in synthetic task");
    }
    absl::StatusOr<std::unique_ptr<TextFileData>> text =
        TextFileData::Open(data_path_or_empty, seed, validation_fraction);
    if (!text.ok()) return text.status();
    return std::unique_ptr<TokenData>(std::move(*text));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--task=", task,
      " is unknown: expected addition or reversed-addition (built-in synthetic sums); for text, "
      "pass --data=FILE"));
}

void ScoreOnlyAnswers(const int32_t* tokens, int32_t* targets, int rows, int context) {
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* row_tokens = tokens + r * context;
    int32_t* row_targets = targets + r * context;
    bool in_answer = false;  // rows start at a line's first token
    for (int j = 0; j < context; ++j) {
      // Target j follows token j: an answer token iff the last '=' or '\n'
      // up to token j is '='.
      if (row_tokens[j] == '=') in_answer = true;
      if (row_tokens[j] == '\n') in_answer = false;
      if (!in_answer) row_targets[j] = kUnscoredTarget;
    }
  }
}

std::string TokensToText(const int32_t* tokens, int n) {
  std::string out;
  if (tokens == nullptr) return out;
  for (int i = 0; i < n; ++i) {
    const int32_t t = tokens[i];
    if (t < 0 || t >= TokenData::kVocab) {
      absl::StrAppend(&out, "<", t, ">");
    } else if (t == '\n') {
      out += "\\n";
    } else if (t == '\t') {
      out += "\\t";
    } else if (t == '\r') {
      out += "\\r";
    } else if (t == '\\') {
      out += "\\\\";
    } else if (t >= 0x20 && t < 0x7f) {
      out += static_cast<char>(t);
    } else {
      absl::StrAppendFormat(&out, "\\x%02x", t);
    }
  }
  return out;
}

}  // namespace zeroshard
