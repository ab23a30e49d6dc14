// The preupdate hook's declarations are behind this in sqlite3.h; Debian's
// libsqlite3 is built with it.
#define SQLITE_ENABLE_PREUPDATE_HOOK 1
#include "shard_server/state/sql_replication.h"

#include <sqlite3.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "proto/state_rows.pb.h"

namespace zeroshard {
namespace {

constexpr char kSchemaKey[] = "schema";
constexpr char kRowsPrefix[] = "rows/";

// A key component: bytes outside [A-Za-z0-9._-] as %XX, so that '/' only
// separates components and keys stay readable in etcdctl.
std::string Escape(absl::string_view raw) {
  std::string out;
  out.reserve(raw.size());
  for (unsigned char c : raw) {
    if (absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-') {
      out.push_back(static_cast<char>(c));
    } else {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", c);
      out += hex;
    }
  }
  return out;
}

std::string Unescape(absl::string_view escaped) {
  std::string out;
  for (size_t i = 0; i < escaped.size(); ++i) {
    int byte = 0;
    if (escaped[i] == '%' && i + 2 < escaped.size() &&
        std::sscanf(std::string(escaped.substr(i + 1, 2)).c_str(), "%2x", &byte) == 1) {
      out.push_back(static_cast<char>(byte));
      i += 2;
    } else {
      out.push_back(escaped[i]);
    }
  }
  return out;
}

// A value with its type tag ("i", "r", "t", "b"; "n" for NULL), as RowRef
// keeps it: comparable, and bindable back (BindTagged).
std::string Tagged(sqlite3_value* v) {
  switch (sqlite3_value_type(v)) {
    case SQLITE_INTEGER:
      return absl::StrCat("i", sqlite3_value_int64(v));
    case SQLITE_FLOAT: {
      char text[32];
      std::snprintf(text, sizeof text, "r%.17g", sqlite3_value_double(v));
      return text;
    }
    case SQLITE_TEXT:
      return absl::StrCat("t",
                          absl::string_view(reinterpret_cast<const char*>(sqlite3_value_text(v)),
                                            sqlite3_value_bytes(v)));
    case SQLITE_BLOB:
      return absl::StrCat("b", absl::string_view(static_cast<const char*>(sqlite3_value_blob(v)),
                                                 sqlite3_value_bytes(v)));
    default:
      return "n";
  }
}

int BindTagged(sqlite3_stmt* stmt, int index, const std::string& tagged) {
  const std::string body = tagged.substr(1);
  switch (tagged[0]) {
    case 'i': {
      int64_t v = 0;
      (void)absl::SimpleAtoi(body, &v);
      return sqlite3_bind_int64(stmt, index, v);
    }
    case 'r': {
      double v = 0;
      (void)absl::SimpleAtod(body, &v);
      return sqlite3_bind_double(stmt, index, v);
    }
    case 't':
      return sqlite3_bind_text(stmt, index, body.data(), static_cast<int>(body.size()),
                               SQLITE_TRANSIENT);
    case 'b':
      return sqlite3_bind_blob(stmt, index, body.data(), static_cast<int>(body.size()),
                               SQLITE_TRANSIENT);
    default:
      return sqlite3_bind_null(stmt, index);
  }
}

std::string Quoted(const std::string& identifier) {
  std::string out = "\"";
  for (char c : identifier) {
    if (c == '"') out.push_back('"');
    out.push_back(c);
  }
  return out + "\"";
}

// A statement finalized when it goes out of scope.
struct Stmt {
  sqlite3_stmt* p = nullptr;
  ~Stmt() { sqlite3_finalize(p); }
};

void ColumnTo(sqlite3_stmt* stmt, int column, state::StateValue* out) {
  switch (sqlite3_column_type(stmt, column)) {
    case SQLITE_INTEGER:
      out->set_integer(sqlite3_column_int64(stmt, column));
      break;
    case SQLITE_FLOAT:
      out->set_real(sqlite3_column_double(stmt, column));
      break;
    case SQLITE_TEXT:
      out->set_text(reinterpret_cast<const char*>(sqlite3_column_text(stmt, column)),
                    sqlite3_column_bytes(stmt, column));
      break;
    case SQLITE_BLOB:
      out->set_blob(static_cast<const char*>(sqlite3_column_blob(stmt, column)),
                    sqlite3_column_bytes(stmt, column));
      break;
    default:
      out->set_null(true);
  }
}

int BindValue(sqlite3_stmt* stmt, int index, const state::StateValue& v) {
  switch (v.value_case()) {
    case state::StateValue::kInteger:
      return sqlite3_bind_int64(stmt, index, v.integer());
    case state::StateValue::kReal:
      return sqlite3_bind_double(stmt, index, v.real());
    case state::StateValue::kText:
      return sqlite3_bind_text(stmt, index, v.text().data(), static_cast<int>(v.text().size()),
                               SQLITE_TRANSIENT);
    case state::StateValue::kBlob:
      return sqlite3_bind_blob(stmt, index, v.blob().data(), static_cast<int>(v.blob().size()),
                               SQLITE_TRANSIENT);
    default:
      return sqlite3_bind_null(stmt, index);
  }
}

}  // namespace

SqlReplication::SqlReplication(sqlite3* db, std::string name, std::vector<PagedTable> paged)
    : db_(db), name_(std::move(name)) {
  for (const PagedTable& p : paged) rows_per_page_[p.table] = std::max(1, p.rows_per_page);
  sqlite3_preupdate_hook(
      db_,
      [](void* self, sqlite3*, int op, const char* database, const char* table, sqlite3_int64,
         sqlite3_int64) { static_cast<SqlReplication*>(self)->Changed(op, database, table); },
      this);
}

SqlReplication::~SqlReplication() { sqlite3_preupdate_hook(db_, nullptr, nullptr); }

std::vector<std::string> SqlReplication::TableNames() {
  std::vector<std::string> tables;
  Stmt stmt;
  sqlite3_prepare_v2(db_,
                     "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE "
                     "'sqlite_%'",
                     -1, &stmt.p, nullptr);
  while (sqlite3_step(stmt.p) == SQLITE_ROW) {
    tables.push_back(reinterpret_cast<const char*>(sqlite3_column_text(stmt.p, 0)));
  }
  return tables;
}

absl::Status SqlReplication::Begin() {
  changed_.clear();
  unknown_table_changed_ = false;
  // Every table's key columns, read now: the hook may not run SQL.
  const std::vector<std::string> tables = TableNames();
  for (const std::string& table : tables) {
    if (absl::StatusOr<const TableInfo*> info = Info(table); !info.ok()) return info.status();
  }
  recording_ = true;
  return absl::OkStatus();
}

// The preupdate hook: a row of `table` is about to be inserted, updated or
// deleted; its key (old and, for an update, new) goes into changed_.
void SqlReplication::Changed(int op, const char* database, const char* table) {
  if (!recording_ || std::strcmp(database, "main") != 0 || std::strncmp(table, "sqlite_", 7) == 0) {
    return;
  }
  auto it = tables_.find(table);
  if (it == tables_.end()) {  // created in this transaction: Collect reads it whole
    unknown_table_changed_ = true;
    return;
  }
  const TableInfo& info = it->second;
  auto add = [&](bool new_values) {
    RowRef ref;
    ref.table = table;
    for (int column : info.key_columns) {
      sqlite3_value* v = nullptr;
      if (new_values) {
        sqlite3_preupdate_new(db_, column, &v);
      } else {
        sqlite3_preupdate_old(db_, column, &v);
      }
      ref.key.push_back(v != nullptr ? Tagged(v) : "n");
    }
    if (info.rows_per_page > 0) {
      int64_t last = 0;
      (void)absl::SimpleAtoi(absl::string_view(ref.key.back()).substr(1), &last);
      ref.key.back() = absl::StrCat("i", last / info.rows_per_page);
      ref.page = true;
    }
    changed_.insert(std::move(ref));
  };
  if (op != SQLITE_INSERT) add(/*new_values=*/false);
  if (op != SQLITE_DELETE) add(/*new_values=*/true);
}

absl::StatusOr<const SqlReplication::TableInfo*> SqlReplication::Info(const std::string& table) {
  auto it = tables_.find(table);
  if (it != tables_.end()) return &it->second;
  TableInfo info;
  Stmt stmt;
  const std::string sql = absl::StrCat("SELECT name, pk FROM pragma_table_info(?1)");
  if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt.p, nullptr) != SQLITE_OK) {
    return absl::InternalError(
        absl::StrCat(name_, ": read table ", table, ": ", sqlite3_errmsg(db_)));
  }
  sqlite3_bind_text(stmt.p, 1, table.data(), static_cast<int>(table.size()), SQLITE_TRANSIENT);
  std::map<int, int> key_order;  // pk position (1-based) -> column index
  while (sqlite3_step(stmt.p) == SQLITE_ROW) {
    const int pk = sqlite3_column_int(stmt.p, 1);
    if (pk > 0) key_order[pk] = static_cast<int>(info.columns.size());
    info.columns.push_back(reinterpret_cast<const char*>(sqlite3_column_text(stmt.p, 0)));
  }
  if (key_order.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        name_, ": table ", table, " has no PRIMARY KEY: a replicated table needs one"));
  }
  for (const auto& [position, column] : key_order) info.key_columns.push_back(column);
  auto paged = rows_per_page_.find(table);
  if (paged != rows_per_page_.end()) info.rows_per_page = paged->second;
  return &tables_.emplace(table, std::move(info)).first->second;
}

absl::StatusOr<std::string> SqlReplication::Schema() {
  Stmt stmt;
  if (sqlite3_prepare_v2(db_,
                         "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE "
                         "'sqlite_%' ORDER BY rowid",
                         -1, &stmt.p, nullptr) != SQLITE_OK) {
    return absl::InternalError(absl::StrCat(name_, ": read the schema: ", sqlite3_errmsg(db_)));
  }
  std::vector<std::string> statements;
  while (sqlite3_step(stmt.p) == SQLITE_ROW) {
    statements.push_back(reinterpret_cast<const char*>(sqlite3_column_text(stmt.p, 0)));
  }
  return absl::StrJoin(statements, ";\n") + ";\n";
}

absl::Status SqlReplication::AddEveryRow(std::set<RowRef>& refs) {
  const std::vector<std::string> tables = TableNames();
  for (const std::string& table : tables) {
    absl::StatusOr<const TableInfo*> info = Info(table);
    if (!info.ok()) return info.status();
    std::vector<std::string> key_names;
    for (int c : (*info)->key_columns) key_names.push_back(Quoted((*info)->columns[c]));
    const std::string sql =
        absl::StrCat("SELECT ", absl::StrJoin(key_names, ", "), " FROM ", Quoted(table));
    Stmt stmt;
    if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt.p, nullptr) != SQLITE_OK) {
      return absl::InternalError(absl::StrCat(name_, ": read ", table, ": ", sqlite3_errmsg(db_)));
    }
    while (sqlite3_step(stmt.p) == SQLITE_ROW) {
      RowRef ref;
      ref.table = table;
      for (int i = 0; i < static_cast<int>(key_names.size()); ++i) {
        ref.key.push_back(Tagged(sqlite3_column_value(stmt.p, i)));
      }
      if ((*info)->rows_per_page > 0) {
        ref.key.back() =
            absl::StrCat("i", sqlite3_column_int64(stmt.p, static_cast<int>(key_names.size()) - 1) /
                                  (*info)->rows_per_page);
        ref.page = true;
      }
      refs.insert(std::move(ref));
    }
  }
  return absl::OkStatus();
}

std::string SqlReplication::KeyOf(const RowRef& ref) const {
  std::string key = absl::StrCat(kRowsPrefix, Escape(ref.table));
  for (size_t i = 0; i < ref.key.size(); ++i) {
    const bool page = ref.page && i + 1 == ref.key.size();
    absl::StrAppend(&key, "/", page ? "p" : "", Escape(absl::string_view(ref.key[i]).substr(1)));
  }
  return key;
}

absl::Status SqlReplication::ReadRef(const RowRef& ref, ReplicaBatch& batch) {
  absl::StatusOr<const TableInfo*> info = Info(ref.table);
  if (!info.ok()) return info.status();
  const TableInfo& t = **info;
  std::vector<std::string> where;
  for (size_t i = 0; i < t.key_columns.size(); ++i) {
    const std::string column = Quoted(t.columns[t.key_columns[i]]);
    if (ref.page && i + 1 == t.key_columns.size()) {
      absl::StrAppend(&where.emplace_back(), column, " >= ?", i + 1, " AND ", column, " < ?",
                      i + 2);
    } else {
      where.push_back(absl::StrCat(column, " = ?", i + 1));
    }
  }
  const std::string sql =
      absl::StrCat("SELECT * FROM ", Quoted(ref.table), " WHERE ", absl::StrJoin(where, " AND "));
  Stmt stmt;
  if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt.p, nullptr) != SQLITE_OK) {
    return absl::InternalError(
        absl::StrCat(name_, ": read ", ref.table, ": ", sqlite3_errmsg(db_)));
  }
  for (size_t i = 0; i < ref.key.size(); ++i) {
    if (ref.page && i + 1 == ref.key.size()) {
      int64_t page = 0;
      (void)absl::SimpleAtoi(absl::string_view(ref.key[i]).substr(1), &page);
      sqlite3_bind_int64(stmt.p, static_cast<int>(i) + 1, page * t.rows_per_page);
      sqlite3_bind_int64(stmt.p, static_cast<int>(i) + 2, (page + 1) * t.rows_per_page);
    } else {
      BindTagged(stmt.p, static_cast<int>(i) + 1, ref.key[i]);
    }
  }
  state::StateRows rows;
  const int columns = sqlite3_column_count(stmt.p);
  int code;
  while ((code = sqlite3_step(stmt.p)) == SQLITE_ROW) {
    state::StateRow* row = rows.add_rows();
    for (int c = 0; c < columns; ++c) ColumnTo(stmt.p, c, row->add_columns());
  }
  if (code != SQLITE_DONE) {
    return absl::InternalError(
        absl::StrCat(name_, ": read ", ref.table, ": ", sqlite3_errmsg(db_)));
  }
  if (rows.rows_size() == 0) {
    batch.deletes.push_back(KeyOf(ref));
  } else {
    batch.puts.push_back({KeyOf(ref), rows.SerializeAsString()});
  }
  return absl::OkStatus();
}

absl::StatusOr<ReplicaBatch> SqlReplication::Collect() {
  absl::StatusOr<std::string> schema = Schema();
  if (!schema.ok()) return schema.status();
  // Columns may have changed (an ALTER TABLE ADD COLUMN of a newer
  // version, which calls no hook): every row is written again, so that no
  // saved row has fewer columns than the saved schema (Load inserts them
  // by position). Once, at the upgrade.
  const bool schema_changed = *schema != saved_schema_;
  if (schema_changed) tables_.clear();
  recording_ = false;  // the reads below change nothing, but are no changes anyway
  std::set<RowRef> refs = unsaved_;
  if (write_everything_ || unknown_table_changed_ || schema_changed) {
    if (absl::Status s = AddEveryRow(refs); !s.ok()) return s;
  }
  refs.insert(changed_.begin(), changed_.end());
  changed_.clear();
  ReplicaBatch batch;
  if (schema_changed) batch.puts.push_back({kSchemaKey, *schema});
  for (const RowRef& ref : refs) {
    if (absl::Status s = ReadRef(ref, batch); !s.ok()) return s;
  }
  collected_schema_ = *std::move(schema);
  collected_ = std::move(refs);
  return batch;
}

void SqlReplication::Saved(bool saved) {
  recording_ = false;
  changed_.clear();
  if (saved) {
    saved_schema_ = std::move(collected_schema_);
    unsaved_.clear();
    write_everything_ = false;
  } else {
    // Rolled back: what the replica may have half-written is written again,
    // as the rows are then, with the next batch.
    unsaved_.insert(collected_.begin(), collected_.end());
    tables_.clear();
  }
  collected_.clear();
}

absl::Status SqlReplication::InsertRows(const std::string& table, const std::string& value) {
  state::StateRows rows;
  if (!rows.ParseFromString(value)) {
    return absl::DataLossError(
        absl::StrCat(name_, ": the replica's rows of table ", table, " do not parse"));
  }
  Stmt stmt;
  int prepared_for = -1;  // the column count `stmt` was prepared for
  for (const state::StateRow& row : rows.rows()) {
    int code = SQLITE_OK;
    if (row.columns_size() != prepared_for) {
      sqlite3_finalize(stmt.p);
      stmt.p = nullptr;
      std::vector<std::string> marks(row.columns_size(), "?");
      const std::string sql =
          absl::StrCat("INSERT INTO ", Quoted(table), " VALUES (", absl::StrJoin(marks, ", "), ")");
      code = sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt.p, nullptr);
      prepared_for = row.columns_size();
    } else {
      sqlite3_reset(stmt.p);
    }
    for (int c = 0; code == SQLITE_OK && c < row.columns_size(); ++c) {
      code = BindValue(stmt.p, c + 1, row.columns(c));
    }
    if (code == SQLITE_OK) code = sqlite3_step(stmt.p) == SQLITE_DONE ? SQLITE_OK : SQLITE_ERROR;
    if (code != SQLITE_OK) {
      return absl::DataLossError(absl::StrCat(name_, ": load a row of ", table,
                                              " from the replica: ", sqlite3_errmsg(db_)));
    }
  }
  return absl::OkStatus();
}

absl::Status SqlReplication::Load(const std::vector<ReplicaEntry>& entries) {
  // One transaction: 100,000 members load in well under a second.
  char* error = nullptr;
  auto exec = [&](const char* sql, absl::string_view what) -> absl::Status {
    if (sqlite3_exec(db_, sql, nullptr, nullptr, &error) == SQLITE_OK) return absl::OkStatus();
    std::string message = error != nullptr ? error : "";
    sqlite3_free(error);
    error = nullptr;
    return absl::DataLossError(absl::StrCat(name_, ": ", what, ": ", message));
  };
  if (absl::Status s = exec("BEGIN;", "load the replica"); !s.ok()) return s;
  absl::Status status;
  for (const ReplicaEntry& e : entries) {
    if (e.key != kSchemaKey) continue;
    status = exec(e.value.c_str(), "the replica's schema does not load");
    saved_schema_ = e.value;
  }
  for (const ReplicaEntry& e : entries) {
    if (!status.ok()) break;
    if (e.key.rfind(kRowsPrefix, 0) != 0) continue;
    std::vector<absl::string_view> parts =
        absl::StrSplit(absl::string_view(e.key).substr(sizeof kRowsPrefix - 1), '/');
    status = InsertRows(Unescape(parts[0]), e.value);
  }
  if (!status.ok()) {
    exec("ROLLBACK;", "rollback").IgnoreError();
    return status;
  }
  return exec("COMMIT;", "load the replica");
}

void SqlReplication::WriteEverythingNext() { write_everything_ = true; }

}  // namespace zeroshard
