"""zeroshard.Client: the shard server's client for Python programs (over the C++
client library, client/client.h)."""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from zeroshard import _native
from zeroshard.errors import GenerationChanged, ZeroshardError, from_status

# Fields of the wire API that are 64-bit integers: protobuf's JSON writes them as
# strings; the dicts this module returns hold ints.
_INT64_FIELDS = frozenset({
    "generation", "step", "row_begin", "row_end", "offset", "chunk_elements", "shape",
    "total_bytes", "size_bytes", "created_unix_ms", "max_unit_bytes", "alignment_elements",
    "last_heartbeat_age_ms", "memory_bytes", "collective_seq", "unix_ms", "bytes_done",
    "bytes_total",
})


def _wire(obj: Any, key: str = "") -> Any:
    if isinstance(obj, dict):
        return {k: _wire(v, k) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_wire(v, key) for v in obj]
    if key in _INT64_FIELDS and isinstance(obj, str):
        return int(obj)
    return obj


def _read(path: Optional[str], what: str) -> str:
    if not path:
        return ""
    try:
        with open(path, "r") as f:
            return f.read()
    except OSError as e:
        raise FileNotFoundError(f"cannot read the {what} file {path}: {e.strerror}") from None


@dataclass(frozen=True)
class Member:
    rank: int
    worker_id: str
    host: str


@dataclass(frozen=True)
class JoinInfo:
    """What Join answered: this member's rank in the job's generation."""
    job: str
    rank: int
    world_size: int
    generation: int
    members: List[Member] = field(default_factory=list)  # ordered by rank
    heartbeat_interval: float = 1.0  # seconds
    heartbeat_timeout: float = 3.0   # seconds: a member silent this long is declared dead


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Client:
    """A connection to a shard server.

    Args:
        server: "HOST:PORT" of the shard server.
        token: the bearer token (or token_file: a file holding it; refused when every user
            may read it or the token is shorter than 16 characters, unless insecure).
        tls_ca_file: the CA (PEM) to verify the server against; turns TLS on.
        tls_cert_file, tls_key_file: this client's certificate and key, for mutual TLS.
        tls_server_name: the name expected in the server's certificate, if not the host.
        rpc_timeout: seconds for calls that do not wait.
        insecure: accept a weak token file, and send a token without TLS to a server that is
            not on loopback (refused otherwise), as shard_worker's --insecure.

    Thread-safe: store calls may come from several threads (torch.distributed does).
    """

    def __init__(self, server: str, *, token: Optional[str] = None,
                 token_file: Optional[str] = None, tls_ca_file: Optional[str] = None,
                 tls_cert_file: Optional[str] = None, tls_key_file: Optional[str] = None,
                 tls_server_name: str = "", rpc_timeout: float = 30.0,
                 insecure: bool = False) -> None:
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        self.server = server
        self._native = _native.Client(server, token or "", token_file or "",
                                      _read(tls_ca_file, "TLS CA"),
                                      _read(tls_cert_file, "TLS certificate"),
                                      _read(tls_key_file, "TLS key"), tls_server_name,
                                      float(rpc_timeout), bool(insecure))
        self._info: Optional[JoinInfo] = None
        self._incarnation = uuid.uuid4().hex
        self._why_cache: Optional[tuple] = None
        self._lock = threading.Lock()
        self._progress: Dict[str, Any] = dict(step=0, loss=0.0, memory_bytes=-1,
                                              collective_seq=0, step_ms=0.0,
                                              items_per_second=0.0)

    # ---- Membership ----

    def join(self, job: str, world_size: int, worker_id: str, *, host: Optional[str] = None,
             timeout: float = 600.0, heartbeats: bool = True, min_world_size: int = 0,
             rejoin_grace: float = 0.0) -> JoinInfo:
        """Joins `job` as `worker_id` and waits until `world_size` workers joined.

        Ranks are the sorted order of worker ids, so a worker that joins again with its
        id keeps its rank. Retries while the server is unreachable or an earlier
        incarnation of this worker id is still a live member, until `timeout` seconds.
        With `heartbeats`, beats on a background thread from now on (carrying what
        `report()` was last told); `check()` raises once the server says the generation
        changed.

        min_world_size, rejoin_grace (seconds): after a member died, the server forms the
        next generation with the members that re-joined within `rejoin_grace` when there
        are at least `min_world_size` of them (the job shrinks), or at once when a
        replacement takes the dead worker's id. Every member must send the same values;
        with either set, the join also carries this Client's incarnation (random), so a
        restarted process's join ends its old incarnation's membership at once.
        """
        if min_world_size or rejoin_grace:
            self._native.set_join_extras(int(min_world_size), float(rejoin_grace),
                                         self._incarnation)
        info = self._native.join(job, int(world_size), worker_id, host or socket.gethostname(),
                                 float(timeout))
        self._info = JoinInfo(
            job=info["job"], rank=info["rank"], world_size=info["world_size"],
            generation=info["generation"],
            members=[Member(m["rank"], m["worker_id"], m["host"]) for m in info["members"]],
            heartbeat_interval=info["heartbeat_interval_s"],
            heartbeat_timeout=info["heartbeat_timeout_s"])
        if heartbeats:
            self._native.start_heartbeats()
        return self._info

    @property
    def info(self) -> JoinInfo:
        """The last successful join. Raises RuntimeError before one."""
        if self._info is None:
            raise RuntimeError("not a member of a job: call join() first")
        return self._info

    def report(self, *, step: Optional[int] = None, loss: Optional[float] = None,
               memory_bytes: Optional[int] = None, step_time: Optional[float] = None,
               items_per_second: Optional[float] = None,
               collective_seq: Optional[int] = None) -> None:
        """What the next heartbeats carry (shardctl status shows it). Fields left out keep
        their last value; memory_bytes defaults to this process's resident set size.
        step_time is in seconds."""
        with self._lock:
            p = self._progress
            if step is not None:
                p["step"] = int(step)
            if loss is not None:
                p["loss"] = float(loss)
            if memory_bytes is not None:
                p["memory_bytes"] = int(memory_bytes)
            if step_time is not None:
                p["step_ms"] = float(step_time) * 1000.0
            if items_per_second is not None:
                p["items_per_second"] = float(items_per_second)
            if collective_seq is not None:
                p["collective_seq"] = int(collective_seq)
            memory = p["memory_bytes"] if p["memory_bytes"] >= 0 else _rss_bytes()
            self._native.report_progress(p["step"], p["loss"], memory, p["collective_seq"],
                                         p["step_ms"], p["items_per_second"])

    def failure(self) -> Optional[ZeroshardError]:
        """The error heartbeating ended with (GenerationChanged when the server said the
        job moved on, or this member was fenced), or None while all is well."""
        return self._event_error(self._native.poll_event())

    def wait_for_failure(self, timeout: float) -> Optional[ZeroshardError]:
        """Waits up to `timeout` seconds for what failure() reports."""
        return self._event_error(self._native.wait_event(float(timeout)))

    def check(self) -> None:
        """Raises failure() if there is one: call it once per step."""
        error = self.failure()
        if error is not None:
            raise error

    def _event_error(self, event: Optional[dict]) -> Optional[ZeroshardError]:
        if event is None:
            return None
        if event["code"] != 0:
            return from_status(event["code"], event["message"])
        if event["command"] == "ABORT_GENERATION_CHANGED":
            return GenerationChanged(
                f"job '{self.info.job}' moved to generation {event['generation']}: "
                f"{self._why(event['generation']) or event['message']}", 10,
                generation=event["generation"])
        return ZeroshardError(f"the server sent {event['command']}: {event['message']}")

    def server_verdict(self) -> Optional[ZeroshardError]:
        """Asks the server now (one GetStatus call) whether the job moved past this
        member's generation: GenerationChanged naming why, or None. failure() learns the
        same from the next heartbeat reply, up to a heartbeat interval later."""
        error = self.failure()
        if error is not None:
            return error
        try:
            jobs = self.status(self.info.job)
        except ZeroshardError:
            return None
        for job in jobs:
            if job.get("generation", 0) > self.info.generation:
                g = job["generation"]
                return GenerationChanged(
                    f"job '{self.info.job}' moved to generation {g}: {self._why(g)}", 10,
                    generation=g)
        return None

    def _why(self, generation: int) -> str:
        """The server's reason for `generation` ("worker 'w1' (rank 1) stopped
        heartbeating"), from the job's history; "" if it cannot be had."""
        if self._why_cache is not None and self._why_cache[0] == generation:
            return self._why_cache[1]
        try:
            jobs = self.status(self.info.job)
        except ZeroshardError:
            return ""
        for job in jobs:
            for change in job.get("history", []):
                if change.get("generation") == generation:
                    self._why_cache = (generation, change.get("reason", ""))
                    return self._why_cache[1]
        return ""

    def stop_heartbeats(self) -> None:
        self._native.stop_heartbeats()

    def leave(self) -> None:
        """A clean exit from the job (stops heartbeats first)."""
        self._native.leave()

    def close(self) -> None:
        """Stops heartbeats (does not leave)."""
        self._native.stop_heartbeats()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- The job generation's key-value store (after join) ----

    def store_set(self, key: str, value: Union[bytes, str]) -> None:
        self._native.store_set(key, value.encode() if isinstance(value, str) else bytes(value))

    def store_get(self, key: str, timeout: float = 300.0) -> bytes:
        """Waits up to `timeout` seconds for `key`; DeadlineExceeded after."""
        return self._native.store_get(key, float(timeout))

    def store_add(self, key: str, delta: int) -> int:
        """Adds to the decimal integer at `key` (created at 0); returns the sum."""
        return self._native.store_add(key, int(delta))

    def store_wait(self, keys: Sequence[str], timeout: float = 300.0) -> None:
        self._native.store_wait(list(keys), float(timeout))

    def store_compare_set(self, key: str, expected: Union[bytes, str],
                          desired: Union[bytes, str]) -> bytes:
        """TCPStore's compare_set: returns what `key` holds afterwards."""
        enc = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        return self._native.store_compare_set(key, enc(expected), enc(desired))

    def store_delete(self, key: str) -> bool:
        return self._native.store_delete(key)

    def store_check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists now (never waits)."""
        return self._native.store_check(list(keys))

    def store_num_keys(self) -> int:
        return self._native.store_num_keys()

    # ---- Plans, status, checkpoints ----

    def status(self, job: str = "") -> List[Dict[str, Any]]:
        """Jobs as `shardctl status --json` shows them (every job when `job` is empty)."""
        return _wire(json.loads(self._native.get_status(job))).get("jobs", [])

    def plan(self, spec: Union[Mapping[str, Any], str], world_size: Optional[int] = None,
             *, max_unit_bytes: int = 0, row_chunk_ranks: int = 0) -> Dict[str, Any]:
        """The shard plan for `spec` ({"tensors": [{"name", "shape", "dtype", "unit"}]}, or
        its JSON). As a member: the job generation's plan (computed once, identical for
        every rank). Before join: a one-off plan for `world_size`. row_chunk_ranks=S > 0
        asks for FSDP2's layout (every tensor cut as torch.chunk(t, S, dim=0) cuts it,
        chunk k on rank k) instead of the balanced planner."""
        if world_size is None:
            world_size = self.info.world_size
        text = spec if isinstance(spec, str) else json.dumps(spec)
        return _wire(json.loads(self._native.plan(text, int(world_size), int(max_unit_bytes),
                                                  int(row_chunk_ranks))))

    def checkpoints(self, job: str = "") -> List[Dict[str, Any]]:
        """Checkpoints of `job` (every job when empty), by job then step."""
        return _wire(json.loads(self._native.list_checkpoints(job))).get("checkpoints", [])

    def commit_shard(self, step: int, file: str, size_bytes: int,
                     checksums: Mapping[str, str], timeout: float = 120.0) -> Dict[str, Any]:
        """Commits this rank's shard file of `step` ("<job>/step-<N>/rank-<R>-of-<W>
        .safetensors" under the server's checkpoint root)."""
        return _wire(json.loads(self._native.commit_shard(int(step), file, int(size_bytes),
                                                          dict(checksums), float(timeout))))

    def upload_shard(self, step: int, file: str, local_path: str,
                     timeout: float = 86400.0) -> int:
        """Streams a local shard file to the server, stored as `file`; returns bytes."""
        return self._native.upload_shard(int(step), file, local_path, float(timeout))

    def consolidate(self, job: str, step: Union[int, str] = "latest", out: str = "",
                    *, weights_only: bool = False, dtype: str = "", max_shard_bytes: int = 0,
                    on_server: bool = False,
                    progress: Union[bool, Callable[[Dict[str, Any]], None]] = False
                    ) -> Dict[str, Any]:
        """Merges a complete checkpoint into safetensors on the server, streaming the bytes
        to `out` (a file, or a directory for Hugging Face shards), or with `on_server`
        writing them under the server's checkpoint root. `progress`: True prints a line to
        stderr as the server reports; a callable gets {"work_done", "work_total",
        "bytes_received", "bytes_expected", "file"}. Returns the summary."""
        step_number = -1 if step == "latest" else int(step)
        if not on_server and not out:
            raise ValueError("consolidate needs out= (a local path) unless on_server=True")

        callback = None
        if progress:
            def callback(done: int, total: int, received: int, expected: int, file: str) -> None:
                info = dict(work_done=done, work_total=total, bytes_received=received,
                            bytes_expected=expected, file=file)
                if callable(progress):
                    progress(info)
                else:
                    pct = 100.0 * done / total if total else 0.0
                    print(f"\rconsolidate {job}: {pct:5.1f}% ({received >> 20} MiB received)",
                          end="", file=sys.stderr, flush=True)
        summary = self._native.consolidate(job, step_number, weights_only, dtype,
                                           int(max_shard_bytes), on_server, out, callback)
        if progress is True:
            print(file=sys.stderr)
        return _wire(json.loads(summary))
