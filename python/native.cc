// zeroshard._native: the C++ client (client/client.h) bound for Python with
// pybind11, plus the shard-file writer and the checksum the checkpoint format
// needs. The Python package (python/zeroshard) wraps it; nothing else should
// import it directly.
//
// Every call that may wait (join, store gets and waits, commits, uploads,
// consolidation) releases the GIL. Errors become zeroshard.errors exceptions
// (from_status(code, message)), raised with the GIL held.
//
// Heartbeats: the client's heartbeat thread never calls into Python; the
// first non-CONTINUE command or heartbeat error is kept here, and the Python
// side reads it with poll_event() / wait_event(timeout).
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "common/model_spec.h"
#include "common/plan/plan_codec.h"
#include "common/safetensors.h"
#include "common/secret_file.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"

namespace py = pybind11;

namespace zeroshard {
namespace {

[[noreturn]] void Raise(const absl::Status& status) {
  py::object errors = py::module_::import("zeroshard.errors");
  py::object error =
      errors.attr("from_status")(static_cast<int>(status.code()), std::string(status.message()));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Value(absl::StatusOr<T> result) {
  if (!result.ok()) Raise(result.status());
  return std::move(*result);
}

std::string ToJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

absl::Duration Seconds(double s) { return absl::Milliseconds(static_cast<int64_t>(s * 1000)); }

// What the heartbeat thread handed over: a command other than CONTINUE, or
// the error that ended heartbeating.
struct HeartbeatEvent {
  int code = 0;  // absl::StatusCode; 0 for a command
  std::string command;
  int64_t generation = 0;
  std::string message;
};

class PyClient {
 public:
  // `token_file` (when not empty) is read as shard_worker reads --token_file:
  // a file every user may read or a short token is refused unless
  // `insecure`, which also lets a token travel without TLS to a server that
  // is not on loopback (common/secret_file.h).
  PyClient(const std::string& server, const std::string& token, const std::string& token_file,
           const std::string& tls_ca, const std::string& tls_cert, const std::string& tls_key,
           const std::string& tls_server_name, double rpc_timeout_s, bool insecure) {
    ClientOptions options;
    options.server = server;
    options.insecure = insecure;
    options.token = token_file.empty() ? token : Value(ReadTokenFile(token_file, "token_file", insecure));
    options.tls_ca = tls_ca;
    options.tls_cert = tls_cert;
    options.tls_key = tls_key;
    options.tls_server_name = tls_server_name;
    options.rpc_timeout = Seconds(rpc_timeout_s);
    client_ = Value(Client::Connect(options));
  }
  ~PyClient() {
    py::gil_scoped_release release;
    client_.reset();  // stops heartbeats
  }

  py::dict Join(const std::string& job, int world_size, const std::string& worker_id,
                const std::string& host, double timeout_s) {
    absl::StatusOr<JoinInfo> info;
    {
      py::gil_scoped_release release;
      client_->StopHeartbeats();
      {
        absl::MutexLock lock(&mu_);
        event_.reset();
      }
      info = client_->Join(job, world_size, worker_id, host, Seconds(timeout_s));
    }
    JoinInfo joined = Value(std::move(info));
    py::list members;
    for (const v1::Member& m : joined.members) {
      py::dict d;
      d["rank"] = m.rank();
      d["worker_id"] = m.worker_id();
      d["host"] = m.host();
      members.append(d);
    }
    py::dict out;
    out["rank"] = joined.rank;
    out["world_size"] = joined.world_size;
    out["generation"] = joined.generation;
    out["job"] = joined.job_id;
    out["members"] = members;
    out["heartbeat_interval_s"] = absl::ToDoubleSeconds(joined.heartbeat_interval);
    out["heartbeat_timeout_s"] = absl::ToDoubleSeconds(joined.heartbeat_timeout);
    return out;
  }

  // The fault-tolerance fields sent with every later Join (JoinRequest's
  // min_world_size, rejoin_grace_ms, incarnation).
  void SetJoinExtras(int min_world_size, double rejoin_grace_s, const std::string& incarnation) {
    JoinExtras extras;
    extras.min_world_size = min_world_size;
    extras.rejoin_grace = Seconds(rejoin_grace_s);
    extras.incarnation = incarnation;
    client_->set_join_extras(extras);
  }

  void StartHeartbeats() {
    py::gil_scoped_release release;
    {
      absl::MutexLock lock(&mu_);
      event_.reset();
    }
    client_->StartHeartbeats([this](absl::StatusOr<v1::HeartbeatResponse> r) {
      HeartbeatEvent e;
      if (r.ok()) {
        e.command = v1::Command_Name(r->command());
        e.generation = r->generation();
        e.message = r->reason();
      } else {
        e.code = static_cast<int>(r.status().code());
        e.message = std::string(r.status().message());
      }
      absl::MutexLock lock(&mu_);
      if (!event_.has_value()) event_ = std::move(e);
    });
  }

  void StopHeartbeats() {
    py::gil_scoped_release release;
    client_->StopHeartbeats();
  }

  std::optional<py::dict> PollEvent() {
    absl::MutexLock lock(&mu_);
    return EventLocked();
  }

  // Waits up to timeout_s for a heartbeat event; None if none came.
  std::optional<py::dict> WaitEvent(double timeout_s) {
    {
      py::gil_scoped_release release;
      absl::MutexLock lock(&mu_);
      auto has = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return event_.has_value(); };
      mu_.AwaitWithTimeout(absl::Condition(&has), Seconds(timeout_s));
    }
    return PollEvent();
  }

  void ReportProgress(int64_t step, double loss, int64_t memory_bytes, int64_t collective_seq,
                      double step_ms, double items_per_second) {
    Progress p;
    p.step = step;
    p.loss = loss;
    p.memory_bytes = memory_bytes;
    p.collective_seq = collective_seq;
    p.last_step.set_step_ms(step_ms);
    p.last_step.set_items_per_second(items_per_second);
    client_->ReportProgress(p);
  }

  void Leave() {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = client_->Leave();
    }
    Check(s);
  }

  void StoreSet(const std::string& key, const py::bytes& value) {
    std::string v = value;
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = client_->StoreSet(key, v);
    }
    Check(s);
  }
  py::bytes StoreGet(const std::string& key, double timeout_s) {
    absl::StatusOr<std::string> v;
    {
      py::gil_scoped_release release;
      v = client_->StoreGet(key, Seconds(timeout_s));
    }
    return py::bytes(Value(std::move(v)));
  }
  int64_t StoreAdd(const std::string& key, int64_t delta) {
    absl::StatusOr<int64_t> v;
    {
      py::gil_scoped_release release;
      v = client_->StoreAdd(key, delta);
    }
    return Value(std::move(v));
  }
  void StoreWait(const std::vector<std::string>& keys, double timeout_s) {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = client_->StoreWait(keys, Seconds(timeout_s));
    }
    Check(s);
  }
  py::bytes StoreCompareSet(const std::string& key, const py::bytes& expected,
                            const py::bytes& desired) {
    std::string e = expected, d = desired;
    absl::StatusOr<std::string> v;
    {
      py::gil_scoped_release release;
      v = client_->StoreCompareSet(key, e, d);
    }
    return py::bytes(Value(std::move(v)));
  }
  bool StoreDelete(const std::string& key) {
    absl::StatusOr<bool> v;
    {
      py::gil_scoped_release release;
      v = client_->StoreDelete(key);
    }
    return Value(std::move(v));
  }
  bool StoreCheck(const std::vector<std::string>& keys) {
    absl::StatusOr<bool> v;
    {
      py::gil_scoped_release release;
      v = client_->StoreCheck(keys);
    }
    return Value(std::move(v));
  }
  int64_t StoreNumKeys() {
    absl::StatusOr<int64_t> v;
    {
      py::gil_scoped_release release;
      v = client_->StoreNumKeys();
    }
    return Value(std::move(v));
  }

  std::string GetStatus(const std::string& job) {
    absl::StatusOr<v1::GetStatusResponse> r;
    {
      py::gil_scoped_release release;
      r = client_->GetStatus(job);
    }
    return ToJson(Value(std::move(r)));
  }

  // spec_json: {"tensors": [...]} as shardctl spec writes it;
  // row_chunk_ranks: PlanOptions' (0: the balanced planner). Returns the plan
  // as JSON (the wire message's fields).
  std::string Plan(const std::string& spec_json, int world_size, int64_t max_unit_bytes,
                   int row_chunk_ranks) {
    ModelSpec spec = Value(ParseModelSpecJson(spec_json));
    PlanOptions options;
    if (max_unit_bytes > 0) options.max_unit_bytes = max_unit_bytes;
    options.row_chunk_ranks = row_chunk_ranks;
    absl::StatusOr<ShardPlan> plan;
    {
      py::gil_scoped_release release;
      plan = client_->PlanShards(spec, options, world_size);
    }
    return ToJson(ShardPlanToProto(Value(std::move(plan))));
  }

  std::string ListCheckpoints(const std::string& job) {
    absl::StatusOr<v1::ListCheckpointsResponse> r;
    {
      py::gil_scoped_release release;
      r = client_->ListCheckpoints(job);
    }
    return ToJson(Value(std::move(r)));
  }

  std::string CommitShard(int64_t step, const std::string& file, int64_t size_bytes,
                          const std::map<std::string, std::string>& checksums, double timeout_s) {
    absl::StatusOr<v1::CommitShardResponse> r;
    {
      py::gil_scoped_release release;
      r = client_->CommitShard(step, file, size_bytes, checksums, Seconds(timeout_s));
    }
    return ToJson(Value(std::move(r)));
  }

  int64_t UploadShard(int64_t step, const std::string& file, const std::string& local_path,
                      double timeout_s) {
    absl::StatusOr<int64_t> r;
    {
      py::gil_scoped_release release;
      r = client_->UploadShard(step, file, local_path, Seconds(timeout_s));
    }
    return Value(std::move(r));
  }

  // progress(work_done, work_total, bytes_received, bytes_expected, file) is
  // called on this thread, with the GIL, as the server reports.
  std::string Consolidate(const std::string& job, int64_t step, bool weights_only,
                          const std::string& dtype, int64_t max_shard_bytes, bool on_server,
                          const std::string& out_path, py::object progress) {
    v1::ConsolidateRequest request;
    request.set_job_id(job);
    request.set_step(step);
    request.set_weights_only(weights_only);
    request.set_dtype(dtype);
    request.set_max_shard_bytes(max_shard_bytes);
    request.set_on_server(on_server);
    absl::StatusOr<v1::ConsolidateSummary> summary;
    std::optional<py::error_already_set> callback_error;
    {
      py::gil_scoped_release release;
      Client::ConsolidateProgressFn fn = nullptr;
      if (!progress.is_none()) {
        fn = [&](const ConsolidateProgress& p) {
          py::gil_scoped_acquire acquire;
          if (callback_error.has_value()) return;
          try {
            progress(p.work_done, p.work_total, p.bytes_received, p.bytes_expected, p.file);
          } catch (py::error_already_set& e) {
            callback_error = std::move(e);
          }
        };
      }
      summary = client_->Consolidate(request, out_path, fn);
    }
    if (callback_error.has_value()) throw std::move(*callback_error);
    return ToJson(Value(std::move(summary)));
  }

 private:
  std::optional<py::dict> EventLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!event_.has_value()) return std::nullopt;
    py::dict d;
    d["code"] = event_->code;
    d["command"] = event_->command;
    d["generation"] = event_->generation;
    d["message"] = event_->message;
    return d;
  }

  std::unique_ptr<Client> client_;
  absl::Mutex mu_;
  std::optional<HeartbeatEvent> event_ ABSL_GUARDED_BY(mu_);
};

// Writes a safetensors file of F32 tensors through an atomic rename:
// names[i] with shapes[i] and the bytes of buffers[i] (any object with the
// buffer protocol: a numpy array, a contiguous CPU torch tensor's numpy()).
// Adds "checksums" (tensor -> XXH64 hex) to `metadata`. Returns
// (file size, checksums).
std::pair<int64_t, std::map<std::string, std::string>> WriteF32Safetensors(
    const std::string& path, const std::vector<std::string>& names,
    const std::vector<std::vector<int64_t>>& shapes, const std::vector<py::buffer>& buffers,
    std::map<std::string, std::string> metadata) {
  if (names.size() != shapes.size() || names.size() != buffers.size()) {
    Raise(absl::InvalidArgumentError(absl::StrCat(names.size(), " names, ", shapes.size(),
                                                  " shapes and ", buffers.size(),
                                                  " buffers; expected as many of each")));
  }
  std::vector<py::buffer_info> infos;
  std::vector<TensorEntry> entries;
  std::map<std::string, std::string> checksums;
  nlohmann::ordered_json sums_json = nlohmann::ordered_json::object();
  for (size_t i = 0; i < names.size(); ++i) {
    py::buffer_info info = buffers[i].request();
    int64_t elements = 1;
    for (int64_t d : shapes[i]) elements *= d;
    if (info.itemsize != 4 || info.format != py::format_descriptor<float>::format() ||
        info.size != elements) {
      Raise(absl::InvalidArgumentError(absl::StrCat("tensor '", names[i], "': a buffer of ",
                                                    info.size, " items of format '", info.format,
                                                    "'; expected ", elements, " float32 values")));
    }
    // Contiguous, C order.
    int64_t stride = 4;
    for (int d = info.ndim - 1; d >= 0; --d) {
      if (info.shape[d] > 1 && info.strides[d] != stride) {
        Raise(absl::InvalidArgumentError(
            absl::StrCat("tensor '", names[i], "' is not contiguous; call .contiguous()")));
      }
      stride *= info.shape[d];
    }
    std::string hex = ChecksumToHex(Checksum(info.ptr, elements * 4));
    checksums[names[i]] = hex;
    entries.push_back({names[i], DType::kF32, shapes[i]});
    infos.push_back(std::move(info));
  }
  // The same JSON the worker writes: an object tensor -> hex, file order.
  for (const std::string& name : names) sums_json[name] = checksums[name];
  metadata["checksums"] = sums_json.dump();
  absl::Status status;
  int64_t size = 0;
  {
    py::gil_scoped_release release;
    SafetensorsMetadata meta(metadata.begin(), metadata.end());
    auto writer = SafetensorsWriter::Create(path, entries, meta);
    status = writer.status();
    for (size_t i = 0; status.ok() && i < infos.size(); ++i) {
      status = (*writer)->Append(infos[i].ptr, infos[i].size * 4);
    }
    if (status.ok()) status = (*writer)->Finish();
    if (status.ok()) size = (*writer)->file_size();
  }
  Check(status);
  return {size, checksums};
}

std::string ChecksumHex(py::buffer buffer) {
  py::buffer_info info = buffer.request();
  return ChecksumToHex(Checksum(info.ptr, info.size * info.itemsize));
}

}  // namespace
}  // namespace zeroshard

PYBIND11_MODULE(_native, m) {
  using zeroshard::PyClient;
  m.doc() = "zeroshard's C++ client, bound for Python (use the zeroshard package, not this)";
  py::class_<PyClient>(m, "Client")
      .def(py::init<const std::string&, const std::string&, const std::string&, const std::string&,
                    const std::string&, const std::string&, const std::string&, double, bool>(),
           py::arg("server"), py::arg("token"), py::arg("token_file"), py::arg("tls_ca"),
           py::arg("tls_cert"), py::arg("tls_key"), py::arg("tls_server_name"),
           py::arg("rpc_timeout_s"), py::arg("insecure"))
      .def("join", &PyClient::Join)
      .def("set_join_extras", &PyClient::SetJoinExtras)
      .def("start_heartbeats", &PyClient::StartHeartbeats)
      .def("stop_heartbeats", &PyClient::StopHeartbeats)
      .def("poll_event", &PyClient::PollEvent)
      .def("wait_event", &PyClient::WaitEvent)
      .def("report_progress", &PyClient::ReportProgress)
      .def("leave", &PyClient::Leave)
      .def("store_set", &PyClient::StoreSet)
      .def("store_get", &PyClient::StoreGet)
      .def("store_add", &PyClient::StoreAdd)
      .def("store_wait", &PyClient::StoreWait)
      .def("store_compare_set", &PyClient::StoreCompareSet)
      .def("store_delete", &PyClient::StoreDelete)
      .def("store_check", &PyClient::StoreCheck)
      .def("store_num_keys", &PyClient::StoreNumKeys)
      .def("get_status", &PyClient::GetStatus)
      .def("plan", &PyClient::Plan)
      .def("list_checkpoints", &PyClient::ListCheckpoints)
      .def("commit_shard", &PyClient::CommitShard)
      .def("upload_shard", &PyClient::UploadShard)
      .def("consolidate", &PyClient::Consolidate);
  m.def("write_f32_safetensors", &zeroshard::WriteF32Safetensors);
  m.def("checksum_hex", &zeroshard::ChecksumHex);
}
