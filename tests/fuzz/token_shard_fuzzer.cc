// An llm.c token shard (--data=GLOB): any file opens as a validated shard or
// gives an error; every token of an accepted shard is below the vocabulary.
// The bytes are the file (an anonymous memory file, mapped as a real one is).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "worker/data/token_shards.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("token_shard", 0);
  if (fd < 0) std::abort();
  if (size > 0 && write(fd, data, size) != static_cast<ssize_t>(size)) std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  constexpr int64_t kVocab = 50257;
  auto shard = zeroshard::TokenShard::Open(path, kVocab);
  if (shard.ok()) {
    for (int64_t i = 0; i < (*shard)->size(); ++i) {
      if ((*shard)->token(i) >= kVocab) std::abort();
    }
  }
  (void)zeroshard::TokenShard::Open(path, 0);  // no vocabulary check
  close(fd);
  return 0;
}
