// Faults of the server's SQLite state store, for tests that check that a
// change the server cannot save fails its caller. Tests may run as root,
// where a read-only file or directory still takes writes; a trigger that a
// second connection adds to the database makes SQLite itself refuse them,
// on the server's own connection, deterministically.
#ifndef ZEROSHARD_TESTS_TESTING_STATE_FAULTS_H_
#define ZEROSHARD_TESTS_TESTING_STATE_FAULTS_H_

#include <string>

#include "absl/status/status.h"

namespace zeroshard::testing {

// The SQLite error message of every refused save.
inline constexpr char kRefusedSaveError[] = "database or disk is full (injected by the test)";

// From now on, every save of a job to the state database at `path` fails with
// kRefusedSaveError, until AllowJobSaves(path).
absl::Status RefuseJobSaves(const std::string& path);
absl::Status AllowJobSaves(const std::string& path);
// The same for the checkpoint registry's commits and abandonments.
absl::Status RefuseCheckpointSaves(const std::string& path);

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_STATE_FAULTS_H_
