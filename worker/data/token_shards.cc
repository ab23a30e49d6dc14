#include "worker/data/token_shards.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"

namespace zeroshard {
namespace {

absl::Status BadShard(const std::string& path, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("token shard ", path, ": ", why,
                   " (expected an llm.c token shard: a header of 256 int32 [magic ",
                   kTokenShardMagic, ", version ", kTokenShardVersion,
                   ", token count N], then N uint16 tokens)"));
}

// The first token >= vocab, or -1.
int64_t FirstTokenOutside(const uint16_t* tokens, int64_t count, int64_t vocab) {
  if (vocab >= kMaxTokenShardVocab) return -1;
  for (int64_t i = 0; i < count; ++i) {
    if (tokens[i] >= vocab) return i;
  }
  return -1;
}

}  // namespace

// ---------------------------------------------------------------------------
// TokenShard

TokenShard::TokenShard(std::string path, void* map, size_t map_bytes, int64_t count)
    : path_(std::move(path)),
      map_(map),
      map_bytes_(map_bytes),
      count_(count),
      tokens_(reinterpret_cast<const uint16_t*>(static_cast<const char*>(map) +
                                                kTokenShardHeaderBytes)) {}

TokenShard::~TokenShard() { munmap(map_, map_bytes_); }

absl::StatusOr<std::unique_ptr<TokenShard>> TokenShard::Open(const std::string& path,
                                                             int64_t vocab) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open token shard", path);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return ErrnoStatus(err, "cannot stat token shard", path);
  }
  const int64_t file_bytes = st.st_size;
  if (file_bytes == 0) {
    close(fd);
    return BadShard(path, "the file is empty");
  }
  if (file_bytes < kTokenShardHeaderBytes) {
    close(fd);
    return BadShard(path, absl::StrCat("the file is truncated: ", file_bytes,
                                       " bytes, shorter than the ", kTokenShardHeaderBytes,
                                       "-byte header"));
  }
  void* map = mmap(nullptr, static_cast<size_t>(file_bytes), PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);  // the mapping keeps the file
  if (map == MAP_FAILED) return ErrnoStatus(err, "cannot map token shard", path);
  // Owned from here: a failed check below unmaps it.
  auto unmap = [&] { munmap(map, static_cast<size_t>(file_bytes)); };
  int32_t header[3];
  std::memcpy(header, map, sizeof(header));
  if (header[0] != kTokenShardMagic) {
    unmap();
    return BadShard(path, absl::StrCat("wrong magic ", header[0]));
  }
  if (header[1] != kTokenShardVersion) {
    unmap();
    return BadShard(path, absl::StrCat("unsupported version ", header[1]));
  }
  const int64_t count = header[2];
  if (count <= 0) {
    unmap();
    return BadShard(path, absl::StrCat("the header says it holds ", count, " tokens"));
  }
  const int64_t expected_bytes = kTokenShardHeaderBytes + 2 * count;
  if (file_bytes != expected_bytes) {
    unmap();
    return BadShard(path,
                    absl::StrCat("the header says ", count, " tokens, so ", expected_bytes,
                                 " bytes, but the file has ", file_bytes,
                                 file_bytes < expected_bytes ? " (truncated)" : " (extra bytes)"));
  }
  std::unique_ptr<TokenShard> shard(
      new TokenShard(path, map, static_cast<size_t>(file_bytes), count));
  const int64_t outside = FirstTokenOutside(shard->tokens_, count, vocab);
  if (outside >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token shard ", path, ": token ", shard->token(outside), " at byte offset ",
        kTokenShardHeaderBytes + 2 * outside, " (token index ", outside,
        ") is not below the vocabulary size ", vocab,
        "; train with --vocab (or a checkpoint) that covers the tokenizer's vocabulary"));
  }
  return shard;
}

// ---------------------------------------------------------------------------
// Free functions

absl::StatusOr<std::vector<std::string>> ExpandGlob(const std::string& flag,
                                                    const std::string& pattern) {
  glob_t matches;
  std::memset(&matches, 0, sizeof(matches));
  const int rc = glob(pattern.c_str(), 0, nullptr, &matches);
  std::vector<std::string> paths;
  for (size_t i = 0; rc == 0 && i < matches.gl_pathc; ++i) paths.push_back(matches.gl_pathv[i]);
  globfree(&matches);
  if (paths.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", pattern, " matches no file"));
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

bool LooksLikeTokenShards(const std::string& data) {
  return data.find_first_of("*?[") != std::string::npos || absl::EndsWith(data, ".bin");
}

// ---------------------------------------------------------------------------
// TokenShardData

TokenShardData::TokenShardData(Stream train, Stream validation, int64_t vocab, int64_t val_tokens)
    : train_(std::move(train)),
      validation_(std::move(validation)),
      vocab_(vocab),
      val_tokens_(val_tokens) {}

absl::StatusOr<TokenShardData::Stream> TokenShardData::OpenStream(const std::string& flag,
                                                                  const std::string& glob,
                                                                  int64_t vocab) {
  absl::StatusOr<std::vector<std::string>> paths = ExpandGlob(flag, glob);
  if (!paths.ok()) return paths.status();
  Stream stream;
  for (const std::string& path : *paths) {
    absl::StatusOr<std::unique_ptr<TokenShard>> shard = TokenShard::Open(path, vocab);
    if (!shard.ok()) return shard.status();
    stream.starts.push_back(stream.tokens);
    stream.tokens += (*shard)->size();
    stream.shards.push_back(*std::move(shard));
  }
  return stream;
}

absl::StatusOr<std::unique_ptr<TokenShardData>> TokenShardData::Open(const std::string& train_glob,
                                                                     const std::string& val_glob,
                                                                     int64_t vocab,
                                                                     int64_t val_tokens) {
  if (vocab < 1 || vocab > kMaxTokenShardVocab) {
    return absl::InvalidArgumentError(absl::StrCat("--vocab=", vocab, ": token shards hold uint16 "
                                                   "tokens, so the vocabulary must be in [1, ",
                                                   kMaxTokenShardVocab, "]"));
  }
  if (val_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--val_tokens=", val_tokens, ": expected 0 (all) or more"));
  }
  if (val_glob.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--data=", train_glob, " reads token shards; --val_data=GLOB must name the validation "
        "shards too"));
  }
  absl::StatusOr<Stream> train = OpenStream("data", train_glob, vocab);
  if (!train.ok()) return train.status();
  absl::StatusOr<Stream> validation = OpenStream("val_data", val_glob, vocab);
  if (!validation.ok()) return validation.status();
  return std::unique_ptr<TokenShardData>(
      new TokenShardData(*std::move(train), *std::move(validation), vocab, val_tokens));
}

std::string TokenShardData::Describe() const {
  return absl::StrCat("token shards (vocabulary ", vocab_, "): ", train_.shards.size(),
                      " train shard(s), ", train_.tokens, " tokens; ", validation_.shards.size(),
                      " validation shard(s), ", validation_.tokens, " tokens");
}

int64_t TokenShardData::StreamTokens(Split split) const { return stream(split).tokens; }

int64_t TokenShardData::Windows(Split split, int context) const {
  if (context < 1) return 0;
  return (stream(split).tokens - 1) / context;
}

int64_t TokenShardData::ValidationWindows(int context) const {
  const int64_t all = Windows(Split::kValidation, context);
  if (val_tokens_ == 0 || context < 1) return all;
  return std::min(all, val_tokens_ / context);
}

std::vector<std::string> TokenShardData::ValidationPaths() const {
  std::vector<std::string> paths;
  for (const auto& shard : validation_.shards) paths.push_back(shard->path());
  return paths;
}

absl::Status TokenShardData::CheckContext(int context) const {
  if (context < 1) {
    return absl::InvalidArgumentError(absl::StrCat("context must be >= 1, got ", context));
  }
  for (Split split : {Split::kTrain, Split::kValidation}) {
    if (Windows(split, context) < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the ", SplitName(split), " token shards hold ", stream(split).tokens,
          " tokens, fewer than one window of context + 1 = ", int64_t{context} + 1));
    }
  }
  if (val_tokens_ > 0 && val_tokens_ / context < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--val_tokens=", val_tokens_,
                                                   " is less than one window of --context=",
                                                   context));
  }
  return absl::OkStatus();
}

void TokenShardData::CopyTokens(const Stream& s, int64_t begin, int64_t n, int32_t* out) const {
  // The shard holding `begin`: the last one starting at or before it.
  size_t shard = static_cast<size_t>(
      std::upper_bound(s.starts.begin(), s.starts.end(), begin) - s.starts.begin() - 1);
  int64_t at = begin - s.starts[shard];
  for (int64_t i = 0; i < n; ++i) {
    while (at >= s.shards[shard]->size()) {
      ++shard;
      at = 0;
    }
    out[i] = s.shards[shard]->token(at++);
  }
}

absl::Status TokenShardData::FillSample(Split split, int64_t sample, int context,
                                        int32_t* window) const {
  if (sample < 0) return absl::InvalidArgumentError(absl::StrCat("negative sample index ", sample));
  if (window == nullptr) return absl::InvalidArgumentError("null token window");
  if (absl::Status s = CheckContext(context); !s.ok()) return s;
  const int64_t windows = Windows(split, context);
  CopyTokens(stream(split), (sample % windows) * context, int64_t{context} + 1, window);
  return absl::OkStatus();
}

}  // namespace zeroshard
