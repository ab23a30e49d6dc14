#include "tests/testing/state_faults.h"

#include <sqlite3.h>

#include "absl/strings/str_cat.h"

namespace zeroshard::testing {
namespace {

absl::Status ExecuteOn(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  int code = sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr);
  if (code == SQLITE_OK) {
    sqlite3_busy_timeout(db, 5000);
    code = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr);
  }
  absl::Status status =
      code == SQLITE_OK
          ? absl::OkStatus()
          : absl::InternalError(absl::StrCat(path, ": ", db ? sqlite3_errmsg(db) : "no memory"));
  sqlite3_close(db);
  return status;
}

}  // namespace

absl::Status RefuseJobSaves(const std::string& path) {
  // StateStore::SaveJob writes the jobs row first, in its transaction.
  return ExecuteOn(path, absl::StrCat("CREATE TRIGGER refuse_job_saves BEFORE INSERT ON jobs "
                                      "BEGIN SELECT RAISE(ABORT, '",
                                      kRefusedSaveError, "'); END;"));
}

absl::Status RefuseCheckpointSaves(const std::string& path) {
  std::string sql;
  for (const char* table : {"checkpoint_commits", "checkpoint_abandoned"}) {
    absl::StrAppend(&sql, "CREATE TRIGGER refuse_", table, " BEFORE INSERT ON ", table,
                    " BEGIN SELECT RAISE(ABORT, '", kRefusedSaveError, "'); END;");
  }
  return ExecuteOn(path, sql);
}

absl::Status AllowJobSaves(const std::string& path) {
  return ExecuteOn(path, "DROP TRIGGER IF EXISTS refuse_job_saves;");
}

}  // namespace zeroshard::testing
