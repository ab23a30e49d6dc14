// Token data for the GPT model: byte-level tokens (vocabulary 256) from a text
// file, or from a built-in synthetic addition task that needs no file.
//
// Samples follow the same world-size-independent layout as the regression
// data (regression_data.h): sample i of the micro-batch of (step, micro, rank)
// under W ranks is global sample
//   g = ((step * grad_accum + micro) * W + rank) * batch + i
// and the sample's tokens are a pure function of (seed, split, g, context).
// So a run with W = 1 and batch W * b sees exactly the samples that W ranks
// with batch b see together, rank by rank. Validation batches use `step` as
// the validation batch index.
#ifndef ZEROSHARD_WORKER_DATA_TEXT_DATA_H_
#define ZEROSHARD_WORKER_DATA_TEXT_DATA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace zeroshard {

enum class Split { kTrain, kValidation };

// "train" or "validation".
const char* SplitName(Split split);

class TokenData {
 public:
  // Byte-level tokens: token t is the byte value t (unsigned).
  static constexpr int kVocab = 256;

  virtual ~TokenData() = default;
  TokenData(const TokenData&) = delete;
  TokenData& operator=(const TokenData&) = delete;

  // Tokens are in [0, vocab()): kVocab for bytes and the addition task.
  virtual int vocab() const { return kVocab; }

  // One line for logs: the source and its sizes.
  virtual std::string Describe() const = 0;

  // OK if samples of `context` tokens (plus one target) can be drawn from both
  // splits; INVALID_ARGUMENT with the sizes otherwise. FillBatch() checks it
  // too; call it up front to fail before training starts.
  virtual absl::Status CheckContext(int context) const = 0;

  // The context + 1 tokens of global sample `sample` of `split` into
  // window[0, context + 1). Errors as CheckContext(); INVALID_ARGUMENT for
  // sample < 0 or a null window. Thread-safe.
  virtual absl::Status FillSample(Split split, int64_t sample, int context,
                                  int32_t* window) const = 0;

  // The micro-batch of (step, micro, rank) under `world` ranks: tokens and
  // targets [batch, context], row-major, where row i holds the first `context`
  // tokens of global sample g (above) and targets are the same window shifted
  // by one (the next token). INVALID_ARGUMENT for bad coordinates (as
  // MicroBatchStartRow()), context < 1 or null buffers; OUT_OF_RANGE if the
  // sample index overflows int64. Thread-safe.
  // `row_offset` shifts every sample index (the data cursor).
  absl::Status FillBatch(Split split, int64_t step, int micro, int rank, int world, int batch,
                         int grad_accum, int context, int32_t* tokens, int32_t* targets,
                         int64_t row_offset = 0) const;

 protected:
  TokenData() = default;
};

// A text file's bytes, read fully at Open(). The last `validation_fraction`
// of the bytes (rounded down) is the validation split, the rest the training
// split. Sample g of a split is the context + 1 bytes starting at offset
// InitBits(key(seed, split), g) mod (split bytes - context) within the split,
// so windows never cross the split boundary.
class TextFileData : public TokenData {
 public:
  static constexpr double kDefaultValidationFraction = 0.1;

  // NOT_FOUND / the errno's code for unreadable files; INVALID_ARGUMENT for
  // an empty file, a validation_fraction outside (0, 1), or a split of fewer
  // than 2 bytes (no room for even context 1). Messages name the file.
  static absl::StatusOr<std::unique_ptr<TextFileData>> Open(
      const std::string& path, uint64_t seed,
      double validation_fraction = kDefaultValidationFraction);

  std::string Describe() const override;
  absl::Status CheckContext(int context) const override;
  absl::Status FillSample(Split split, int64_t sample, int context, int32_t* window) const override;

  const std::string& path() const { return path_; }
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  // Byte offsets [begin, end) of a split within the file.
  int64_t split_begin(Split split) const { return split == Split::kTrain ? 0 : train_bytes_; }
  int64_t split_end(Split split) const { return split == Split::kTrain ? train_bytes_ : size(); }
  // The byte offset within the file where sample g of `split` starts (errors
  // as FillSample()).
  absl::StatusOr<int64_t> SampleOffset(Split split, int64_t sample, int context) const;

 private:
  TextFileData(std::string path, std::string bytes, int64_t train_bytes, uint64_t seed);

  const std::string path_;
  const std::string bytes_;    // the whole file
  const int64_t train_bytes_;  // bytes [0, train_bytes_) are training data
  const uint64_t train_key_;   // window-start stream of the training split
  const uint64_t validation_key_;
};

// One addition problem: prompt "a+b=" and the expected answer "a+b" in
// decimal (no leading zeros).
struct AdditionProblem {
  int64_t a = 0;
  int64_t b = 0;
  std::string prompt;  // e.g. "123+456="
  std::string answer;  // e.g. "579"
  // The full line, prompt + answer + "\n".
  std::string Line() const { return prompt + answer + "\n"; }
};

// A synthetic task whose accuracy shows learning: a stream of lines
// "a+b=c\n" with a, b in [0, 10^digits). Line k of a split is a pure function
// of (seed, split, k), drawn with the counter-based generator of
// worker/model/init.h (each split from its own stream).
//
// The problem space is partitioned so that validation problems never occur in
// training and validation accuracy measures generalization, not memory: each
// a has one seeded "held-out" last digit h(a) in [0, 10), and (a, b) is a
// validation pair iff b mod 10 == h(a). That is exactly 1 in
// kValidationShareInverse of all pairs, every a occurs in both splits, and
// each split draws uniformly from its own pairs without rejection.
//
// Sample g of a split is the concatenation of lines g * L, g * L + 1, ...
// cut to context + 1 tokens, where L = LinesPerSample(context) is the most
// lines a window could need; every sample starts with a whole problem.
class AdditionTaskData : public TokenData {
 public:
  static constexpr int kDefaultDigits = 3;
  static constexpr int kMaxDigits = 9;  // a + b stays far below 2^63
  static constexpr int kValidationShareInverse = 10;

  // digits must be in [1, kMaxDigits]; otherwise every fill and CheckContext()
  // fail with FAILED_PRECONDITION.
  // `reversed`: fixed-width lines, answers least-significant digit first
  // ("47+35=280" for 082, "05+07=210" for 012): the order in which carries
  // can be computed one emitted digit at a time, at fixed offsets; small
  // models learn it far sooner.
  explicit AdditionTaskData(uint64_t seed, int digits = kDefaultDigits, bool reversed = false);

  std::string Describe() const override;
  absl::Status CheckContext(int context) const override;
  absl::Status FillSample(Split split, int64_t sample, int context, int32_t* window) const override;

  int digits() const { return digits_; }
  // Line `line` (>= 0) of `split`.
  AdditionProblem Problem(Split split, int64_t line) const;
  // Whether (a, b) is a validation problem (b mod 10 == h(a), above).
  bool IsValidationPair(int64_t a, int64_t b) const;
  // Validation lines [0, count) as problems, for accuracy via generation
  // (empty for count <= 0).
  std::vector<AdditionProblem> ValidationProblems(int count) const;
  // Lines per sample for `context`: enough that even the shortest lines
  // ("0+0=0\n", 6 bytes) fill context + 1 tokens.
  static int64_t LinesPerSample(int context);
  // The longest line in bytes: "99+99=198\n" for 2 digits (digits + 1 for
  // the sum, with or without `reversed`'s padding).
  int MaxLineBytes() const { return 3 * digits_ + 4; }

 private:
  absl::Status CheckDigits() const;
  // h(a): the last digit of b that makes (a, b) a validation pair.
  int HeldOutDigit(int64_t a) const;

  const uint64_t seed_;
  const int digits_;
  const bool reversed_ = false;
  const int64_t modulus_;  // 10^digits (0 if digits is out of range)
  const uint64_t train_key_;
  const uint64_t validation_key_;
  const uint64_t partition_key_;  // which pairs are validation problems
};

// Whether `generated_after_prompt` answers with `expected`: the text up to the
// first '\n' (or all of it, if there is none) equals `expected`. So callers
// generating at least expected.size() + 1 tokens need the model to stop with
// a newline; generating exactly expected.size() tokens accepts the digits alone.
bool CheckAnswer(const std::string& generated_after_prompt, const std::string& expected);

// The token source of a run:
//   - a non-empty data_path with task "text" or "": TextFileData::Open();
//   - task "addition" (or "reversed-addition": answers least-significant
//     digit first) with an empty data_path: AdditionTaskData(seed,
//     addition_digits);
// INVALID_ARGUMENT naming the problem otherwise (an unknown task, "text"
// without a file, or "addition" with a file).
absl::StatusOr<std::unique_ptr<TokenData>> OpenTokenData(
    const std::string& data_path_or_empty, const std::string& task, uint64_t seed,
    double validation_fraction = TextFileData::kDefaultValidationFraction,
    int addition_digits = AdditionTaskData::kDefaultDigits);

// Scores only the answers of addition lines: every target of the `rows` rows
// of [rows, context] tokens/targets (as FillBatch() writes them: each row
// starts at a line) that is not part of an answer -- the text after '=' up
// to and including the '\n' -- becomes kUnscoredTarget (worker/model/layers.h),
// so the loss and its gradient cover only what the task asks for.
void ScoreOnlyAnswers(const int32_t* tokens, int32_t* targets, int rows, int context);

// Tokens as text for logs: printable ASCII as is; '\n', '\t', '\r' and '\\'
// as C escapes; other bytes as \xNN; tokens outside [0, 256) as <N>. Empty for
// n <= 0 or null tokens.
std::string TokensToText(const int32_t* tokens, int n);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_DATA_TEXT_DATA_H_
