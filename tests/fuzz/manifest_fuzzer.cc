// A step's manifest.json as the server reads it back from its checkpoint
// root (a file anyone with access to the root can edit): any bytes give a
// validated manifest or DATA_LOSS, never a crash; an accepted manifest
// written again parses again.
#include <cstdint>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "shard_server/checkpoint/checkpoint_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view json(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<zeroshard::CheckpointManifest> manifest = zeroshard::ParseManifestJson(json);
  std::map<std::string, std::string> checksums;
  (void)zeroshard::ChecksumsFromJson(std::string(json), &checksums);
  if (!manifest.ok()) return 0;
  (void)manifest->TotalBytes();
  absl::StatusOr<zeroshard::CheckpointManifest> again =
      zeroshard::ParseManifestJson(zeroshard::ManifestToJson(*manifest));
  if (!again.ok() || again->tensors.size() != manifest->tensors.size() ||
      again->files.size() != manifest->files.size()) {
    std::abort();  // what the server writes must read back
  }
  return 0;
}
