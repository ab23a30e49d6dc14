// SqlReplication: what a replicated SqlDatabase (sql_database.h) writes to
// its replica, and how it loads from one.
//
// Entries: "schema" holds the database's CREATE statements; every row is
// "rows/<table>/<key>" where <key> is its primary-key columns in key order,
// each escaped (bytes outside [A-Za-z0-9._-] as %XX) and joined by '/'. A
// paged table's rows (PagedTable) share "rows/<table>/<key but the
// last>/p<page>". A value is a StateRows message (state_rows.proto) with
// every column of the row(s).
//
// Which rows a transaction changed comes from SQLite's preupdate hook (the
// key columns of every row inserted, updated or deleted; a statement that
// changes nothing, like an upsert whose WHERE finds the row equal, calls no
// hook), and their values are read back at the end of the transaction, so
// a row changed twice is written once. Every table needs a PRIMARY KEY.
// (SQLite's session extension would also drop rows changed and changed
// back, but cost 1-2 s per 100,000-member generation; the hook ~0.1 s.)
//
// Not thread-safe: used under SqlDatabase's mutex, inside its transactions.
#ifndef ZEROSHARD_SHARD_SERVER_STATE_SQL_REPLICATION_H_
#define ZEROSHARD_SHARD_SERVER_STATE_SQL_REPLICATION_H_

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shard_server/state/sql_database.h"

struct sqlite3;

namespace zeroshard {

class SqlReplication {
 public:
  SqlReplication(sqlite3* db, std::string name, std::vector<PagedTable> paged);
  ~SqlReplication();

  // Fills the (empty) database from the replica's entries.
  absl::Status Load(const std::vector<ReplicaEntry>& entries);
  // The next batch holds every row (after a database image was loaded).
  void WriteEverythingNext();

  // Starts recording the transaction just begun.
  absl::Status Begin();
  // The entries the open transaction changed (read inside it), with the
  // schema when it changed and the rows of a batch that was not saved.
  absl::StatusOr<ReplicaBatch> Collect();
  // After Collect: the replica saved the batch (true) or did not (then the
  // transaction is rolled back, and its rows go into the next batch, which
  // writes them back as they are).
  void Saved(bool saved);

 private:
  // A row or a page: the table and the primary-key values that name it (a
  // page: all but the last column, then the page number). Values as
  // SQLite's text of them, with a type tag, so that the set orders them.
  struct RowRef {
    std::string table;
    std::vector<std::string> key;  // each "i<int>", "r<real>", "t<text>", "b<blob>"
    bool page = false;
    bool operator<(const RowRef& o) const {
      return std::tie(table, key, page) < std::tie(o.table, o.key, o.page);
    }
  };
  struct TableInfo {
    std::vector<std::string> columns;  // every column, in order
    std::vector<int> key_columns;      // indices into columns, in key order
    int rows_per_page = 0;             // 0: not paged
  };

  absl::StatusOr<const TableInfo*> Info(const std::string& table);
  // The database's tables (not SQLite's own).
  std::vector<std::string> TableNames();
  // The preupdate hook's body.
  void Changed(int op, const char* database, const char* table);
  absl::Status AddEveryRow(std::set<RowRef>& refs);
  absl::StatusOr<std::string> Schema();
  // Adds the entry `ref` names now to `batch`: a put, or a delete when it
  // holds no row.
  absl::Status ReadRef(const RowRef& ref, ReplicaBatch& batch);
  std::string KeyOf(const RowRef& ref) const;
  absl::Status InsertRows(const std::string& table, const std::string& value);

  sqlite3* const db_;
  const std::string name_;  // the database's, for error messages
  std::map<std::string, int> rows_per_page_;
  std::map<std::string, TableInfo> tables_;  // read at first use; dropped when the schema changes
  bool recording_ = false;                   // between Begin and Collect
  std::set<RowRef> changed_;                 // rows the open transaction changed
  bool unknown_table_changed_ = false;       // a table created in it changed
  std::string saved_schema_;                 // the schema the replica holds
  std::string collected_schema_;             // the schema of the batch being saved
  bool write_everything_ = false;            // after an image was loaded
  std::set<RowRef> unsaved_;                 // rows of batches the replica did not save
  std::set<RowRef> collected_;               // the refs of the batch being saved
};

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_STATE_SQL_REPLICATION_H_
