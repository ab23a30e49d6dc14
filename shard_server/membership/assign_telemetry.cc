#include "shard_server/membership/assign_telemetry.h"

namespace zeroshard {

void AssignTelemetry(const v1::RankTelemetry& from, v1::RankTelemetry* to) {
  // Taken out before the Clear() that would delete them; nullptr if absent.
  v1::MemoryUsage* memory = to->release_memory();
  v1::CollectiveInProgress* in_progress = to->release_in_progress();
  to->Clear();
  // Put back empty where `from` has one (its strings keep their buffers),
  // for MergeFrom to fill; a field MergeFrom does not know is still copied
  // by it, only with a fresh allocation.
  if (from.has_memory() && memory != nullptr) {
    memory->Clear();
    to->set_allocated_memory(memory);
  } else {
    delete memory;
  }
  if (from.has_in_progress() && in_progress != nullptr) {
    in_progress->Clear();
    to->set_allocated_in_progress(in_progress);
  } else {
    delete in_progress;
  }
  to->MergeFrom(from);
}

}  // namespace zeroshard
