// Pre-tokenized training data: llm.c-format token shards, memory-mapped.
//
// One shard file:
//
//   +------------------------------------+ offset 0
//   | header: 256 little-endian int32    |   [0] magic 20240520
//   |                                    |   [1] version 1
//   |                                    |   [2] token count N (>= 1)
//   |                                    |   [3..255] unused
//   +------------------------------------+ offset 1024
//   | N tokens, little-endian uint16     |
//   +------------------------------------+ offset 1024 + 2 N = the file size
//
// A split (train or validation) is the tokens of its shards concatenated in
// the sorted order of the glob's matches: the "stream". Window k of a split
// is its tokens [k * context, k * context + context] (context + 1 tokens,
// stride context: each token is a target exactly once); a split of S tokens
// has (S - 1) / context windows.
//
// Training sample g (the world-size-independent layout of text_data.h) is
// window g mod windows. Validation is defined so that anyone can recompute
// it outside the worker: the mean cross-entropy over every position of
// windows 0 .. ValidationWindows() - 1 of the validation stream
// (ValidationWindows() = val_tokens / context, or every window when
// val_tokens is 0).
#ifndef ZEROSHARD_WORKER_DATA_TOKEN_SHARDS_H_
#define ZEROSHARD_WORKER_DATA_TOKEN_SHARDS_H_

#include <cassert>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/data/text_data.h"

namespace zeroshard {

inline constexpr int32_t kTokenShardMagic = 20240520;
inline constexpr int32_t kTokenShardVersion = 1;
inline constexpr int64_t kTokenShardHeaderBytes = 256 * sizeof(int32_t);
// uint16 tokens: the largest vocabulary a shard can address.
inline constexpr int64_t kMaxTokenShardVocab = 65536;
// GPT-2's BPE tokenizer: the vocabulary token shards default to.
inline constexpr int64_t kGpt2Vocab = 50257;

// One shard, mapped read-only for the object's lifetime. Thread-safe (reads
// only).
class TokenShard {
 public:
  // Maps and validates `path`: INVALID_ARGUMENT naming the file for a file
  // shorter than the header, a wrong magic or version, a token count of 0 or
  // one that disagrees with the file size, or (when vocab > 0) a token >=
  // vocab (with its byte offset in the file); the errno's code for a file
  // that cannot be opened or mapped.
  static absl::StatusOr<std::unique_ptr<TokenShard>> Open(const std::string& path, int64_t vocab);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return count_; }  // tokens
  // REQUIRES: 0 <= i < size().
  int32_t token(int64_t i) const {
    assert(i >= 0 && i < count_);
    return tokens_[i];
  }

 private:
  TokenShard(std::string path, void* map, size_t map_bytes, int64_t count);

  const std::string path_;
  void* const map_;  // the whole file
  const size_t map_bytes_;
  const int64_t count_;
  const uint16_t* const tokens_;  // into map_; little-endian hosts only (x86-64)
};

// The files `pattern` matches (glob(3), sorted); INVALID_ARGUMENT naming the
// flag and the pattern when none does.
absl::StatusOr<std::vector<std::string>> ExpandGlob(const std::string& flag,
                                                    const std::string& pattern);

// Whether --data names token shards rather than byte text: a glob pattern
// (* ? [) or a path ending in ".bin".
bool LooksLikeTokenShards(const std::string& data);

class TokenShardData : public TokenData {
 public:
  // Opens every shard of both globs (`train_flag`/`val_flag` name them in
  // messages). Errors as TokenShard::Open and ExpandGlob; INVALID_ARGUMENT for
  // vocab outside [1, 65536] or val_tokens < 0.
  static absl::StatusOr<std::unique_ptr<TokenShardData>> Open(const std::string& train_glob,
                                                              const std::string& val_glob,
                                                              int64_t vocab, int64_t val_tokens);

  int vocab() const override { return static_cast<int>(vocab_); }
  std::string Describe() const override;
  absl::Status CheckContext(int context) const override;
  absl::Status FillSample(Split split, int64_t sample, int context, int32_t* window) const override;

  // Tokens of a split's stream.
  int64_t StreamTokens(Split split) const;
  // Windows of `context` in a split's stream ((tokens - 1) / context).
  int64_t Windows(Split split, int context) const;
  // The validation windows the validation loss averages over.
  int64_t ValidationWindows(int context) const;
  // The validation shards, in stream order.
  std::vector<std::string> ValidationPaths() const;

 private:
  struct Stream {
    std::vector<std::unique_ptr<TokenShard>> shards;
    std::vector<int64_t> starts;  // stream offset of each shard's first token
    int64_t tokens = 0;
  };
  TokenShardData(Stream train, Stream validation, int64_t vocab, int64_t val_tokens);
  static absl::StatusOr<Stream> OpenStream(const std::string& flag, const std::string& glob,
                                           int64_t vocab);
  const Stream& stream(Split split) const { return split == Split::kTrain ? train_ : validation_; }
  // Tokens [begin, begin + n) of a stream into out (REQUIRES: in range).
  void CopyTokens(const Stream& s, int64_t begin, int64_t n, int32_t* out) const;

  const Stream train_;
  const Stream validation_;
  const int64_t vocab_;
  const int64_t val_tokens_;  // 0: the whole validation stream
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_DATA_TOKEN_SHARDS_H_
