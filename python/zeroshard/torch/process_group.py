"""Joining a job and bootstrapping torch.distributed through the shard server, and
bringing the server's verdicts (a dead member, a new generation) to the training loop."""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch.distributed as dist

from zeroshard.client import Client, JoinInfo
from zeroshard.errors import GenerationChanged, ZeroshardError
from zeroshard.torch.abort import DataPlaneConnections, server_endpoints
from zeroshard.torch.store import Store

# Exit status of a process that the watchdog ended because it stayed blocked after the
# job's generation changed (EX_TEMPFAIL: an elastic agent restarts it).
BLOCKED_EXIT_CODE = 75


@dataclass
class Session:
    """A process's membership of a job: its client, store and join answer."""
    client: Client
    store: Store
    info: JoinInfo
    _acknowledged: threading.Event
    _watchdog: Optional[threading.Thread] = None
    # What rejoin() needs to join the next generation as this member again.
    worker_id: str = ""
    target_world_size: int = 0
    backend: str = "gloo"
    timeout: timedelta = timedelta(minutes=30)
    exit_if_blocked: Optional[float] = None
    min_world_size: int = 0
    rejoin_grace: float = 0.0
    # Gloo: the connections the process group makes, shut down when the server ends the
    # generation (abort.py). None for other backends.
    connections: Optional[DataPlaneConnections] = None

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def generation(self) -> int:
        return self.info.generation


_session: Optional[Session] = None


def session() -> Session:
    """The session of init_process_group. RuntimeError before it."""
    if _session is None:
        raise RuntimeError("zeroshard.torch: call zeroshard.torch.init_process_group() first")
    return _session


def _default_worker_id() -> str:
    host = socket.gethostname()
    local = os.environ.get("LOCAL_RANK")
    return f"{host}/{local}" if local is not None else f"{host}/{os.getpid()}"


def init_process_group(server: Optional[str] = None, job: Optional[str] = None,
                       world_size: Optional[int] = None, backend: str = "gloo", *,
                       worker_id: Optional[str] = None, token: Optional[str] = None,
                       token_file: Optional[str] = None, tls_ca_file: Optional[str] = None,
                       tls_cert_file: Optional[str] = None, tls_key_file: Optional[str] = None,
                       tls_server_name: str = "", join_timeout: float = 600.0,
                       timeout: timedelta = timedelta(minutes=30),
                       exit_if_blocked: Optional[float] = None, min_world_size: int = 0,
                       rejoin_grace: float = 0.0, insecure: bool = False) -> Session:
    """Joins `job` on the shard server at `server` and initializes torch.distributed's
    default process group over the job's key-value store, in one call.

    The rank is the position of `worker_id` (default "<hostname>/<LOCAL_RANK>", or
    "<hostname>/<pid>" without LOCAL_RANK) among the job's sorted worker ids, so a
    restarted worker keeps its rank. Heartbeats start at once; `check()` raises
    GenerationChanged within the server's heartbeat timeout of a member's death.

    A collective blocked on a dead peer: with Gloo, a peer process that died closes its
    connections, the collective fails at once, and `failure_guard()` turns that into
    GenerationChanged naming the dead member. A peer that hangs (or a host that vanished
    without closing its sockets) would leave the collective waiting until `timeout`, and
    torch cannot abort a Gloo group in place (abort.py); so when the server declares the
    generation over, a watcher thread shuts down the Gloo group's connections: every
    blocked collective of this process (and of its peers) fails at once, and
    failure_guard() raises GenerationChanged. NCCL's group is not aborted: once the
    server declared the generation over, the watcher ends this process with exit status
    75 if it has not noticed (check(), failure_guard()) within `exit_if_blocked` seconds
    (default: the heartbeat timeout + 1 s; 0 disables), and an elastic agent (torchrun)
    restarts it. With Gloo that exit is off unless `exit_if_blocked` is given.

    Under `python -m zeroshard.torchrun`, every argument may be left out: the server is
    the rendezvous endpoint (ZEROSHARD_SERVER), the job "<rdzv_id>.workers", the world
    size and the worker id come from torchrun (WORLD_SIZE, RANK), so the zeroshard rank
    is torchrun's.

    min_world_size, rejoin_grace (seconds): how the job forms its next generation after a
    member died (Client.join): zt.elastic re-joins in this process through rejoin().

    Returns the Session (client, store, rank, world size, generation).
    """
    global _session
    env = os.environ
    expected_rank = None
    if server is None:
        server = env.get("ZEROSHARD_SERVER")
        if not server:
            raise ValueError("init_process_group: give server= (or run under "
                             "python -m zeroshard.torchrun, which sets ZEROSHARD_SERVER)")
    if token is None and token_file is None and env.get("ZEROSHARD_TOKEN_FILE"):
        token_file = env["ZEROSHARD_TOKEN_FILE"]
    if job is None:
        if "TORCHELASTIC_RUN_ID" not in env:
            raise ValueError("init_process_group: give job=")
        job = env["TORCHELASTIC_RUN_ID"] + ".workers"
    if world_size is None:
        if "WORLD_SIZE" not in env:
            raise ValueError("init_process_group: give world_size=")
        world_size = int(env["WORLD_SIZE"])
    if worker_id is None and "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
        # Zero-padded, so the sorted order of worker ids is torchrun's rank order.
        expected_rank = int(env["RANK"])
        worker_id = f"rank-{expected_rank:06d}"
    client = Client(server, token=token, token_file=token_file, tls_ca_file=tls_ca_file,
                    tls_cert_file=tls_cert_file, tls_key_file=tls_key_file,
                    tls_server_name=tls_server_name, insecure=insecure)
    worker_id = worker_id or _default_worker_id()
    info = client.join(job, world_size, worker_id, timeout=join_timeout,
                       min_world_size=min_world_size, rejoin_grace=rejoin_grace)
    if expected_rank is not None and info.rank != expected_rank:
        raise RuntimeError(f"zeroshard gave rank {info.rank} to torchrun's rank {expected_rank} "
                           f"in job '{job}': another program joined it with other worker ids?")
    return _open_session(Session(
        client=client, store=Store(client, timeout=timeout), info=info,
        _acknowledged=threading.Event(), worker_id=worker_id, target_world_size=world_size,
        backend=backend, timeout=timeout, exit_if_blocked=exit_if_blocked,
        min_world_size=min_world_size, rejoin_grace=rejoin_grace))


def _interface_with_address(address: str) -> Optional[str]:
    """The name of this host's network interface that holds IPv4 `address`."""
    import fcntl
    import struct
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                reply = fcntl.ioctl(s.fileno(), siocgifaddr, request)
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def gloo_interface_towards(server: str) -> Optional[str]:
    """The interface of the route from this host to `server` ("HOST:PORT"): the one Gloo
    must use so that peers on other hosts can reach this rank. None when it cannot be told
    (no route, an IPv6 server, no interface holding the address)."""
    host, _, port = server.split(",")[0].strip().rpartition(":")  # a list: the first server
    host = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))  # UDP: picks the route, sends nothing
            address = s.getsockname()[0]
    except (OSError, ValueError):
        return None
    return _interface_with_address(address)


def _choose_gloo_interface(s: Session) -> None:
    """Gloo advertises the address of GLOO_SOCKET_IFNAME's interface, else the one its
    hostname resolves to, which on many hosts (Debian's /etc/hosts) is 127.0.1.1: peers
    on other hosts then cannot connect. Unless the user chose, use the interface of the
    route to the server, as shard_worker's --host does."""
    if s.backend != "gloo" or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = gloo_interface_towards(s.client.server)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def _open_session(s: Session) -> Session:
    """Makes `s` the current session, starts its watcher and initializes
    torch.distributed's default group over `s`'s Store. GenerationChanged when a member
    died while the group formed (`s` stays current, without a group, for rejoin())."""
    global _session
    _choose_gloo_interface(s)
    if s.backend == "gloo":
        s.connections = DataPlaneConnections(server_endpoints(s.client.server))
    _session = s
    s._watchdog = threading.Thread(target=_watch, args=(s, exit_grace(s)),
                                   name="zeroshard-watchdog", daemon=False)
    s._watchdog.start()
    with failure_guard():
        dist.init_process_group(s.backend, store=s.store, rank=s.info.rank,
                                world_size=s.info.world_size, timeout=s.timeout)
    return s


def exit_grace(s: Session) -> float:
    """Seconds the watcher waits, after the server's verdict, for this process to notice
    before it exits with status 75; 0: never."""
    if s.exit_if_blocked is not None:
        return s.exit_if_blocked
    return 0.0 if s.connections is not None else s.info.heartbeat_timeout + 1.0


def abort(s: Session, retire: bool = False) -> int:
    """Makes every collective of `s`'s Gloo groups, blocked or to come, fail at once here
    and at the peers (shuts down their connections); how many. 0 for other backends.
    With `retire` (the session is over), later calls do nothing."""
    return s.connections.shutdown(retire) if s.connections is not None else 0


def rejoin(join_timeout: float = 600.0) -> Session:
    """After GenerationChanged, in this process: destroys the process group, joins the
    job's next generation with the same worker id (a shrunk job gives a new rank and
    world size) and initializes a new default group over that generation's Store.
    Returns the new Session. The old Gloo groups' connections are shut down first (the
    watcher did so at the server's verdict already), so no peer stays blocked on this
    process. GenerationChanged when a member of the new generation died before its group
    formed: call rejoin() again."""
    global _session
    old = session()
    old._acknowledged.set()  # this generation's watchdog must not end the process
    _session = None
    abort(old, retire=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    client = old.client
    info = client.join(old.info.job, old.target_world_size, old.worker_id,
                       timeout=join_timeout, min_world_size=old.min_world_size,
                       rejoin_grace=old.rejoin_grace)
    return _open_session(Session(
        client=client, store=Store(client, timeout=old.timeout), info=info,
        _acknowledged=threading.Event(), worker_id=old.worker_id,
        target_world_size=old.target_world_size, backend=old.backend, timeout=old.timeout,
        exit_if_blocked=old.exit_if_blocked, min_world_size=old.min_world_size,
        rejoin_grace=old.rejoin_grace))


# How often (seconds) the watcher looks whether its session or the main thread ended.
_WATCH_POLL_S = 0.5


def _watching(s: Session) -> bool:
    """Whether `s`'s watcher goes on: its session is current and the main thread runs.
    The watcher is not a daemon thread: one that woke in native code while the
    interpreter finalizes is ended by pthread_exit inside pybind11's noexcept GIL
    guard, and std::terminate aborts the process ("terminate called without an active
    exception", status -6 after a clean run). So it ends within _WATCH_POLL_S of the
    main thread, before finalization."""
    return s is _session and threading.main_thread().is_alive()


def _watch(s: Session, grace: float) -> None:
    """The watcher thread of session `s`: at the server's verdict, aborts `s`'s Gloo
    groups; then, with a grace, ends a process that did not notice in time."""
    error = None
    while error is None:
        if not _watching(s):
            return
        error = s.client.wait_for_failure(_WATCH_POLL_S)
    if not _watching(s):
        return  # a later session's verdict: its own watcher acts on it
    abort(s)
    if grace <= 0:
        return
    deadline = time.monotonic() + grace
    while not s._acknowledged.wait(min(_WATCH_POLL_S, max(0.0, deadline - time.monotonic()))):
        if not _watching(s):
            return
        if time.monotonic() >= deadline:
            print(f"zeroshard: {error}; this process did not notice within {grace:.1f} s "
                  f"(blocked in a collective?): exiting with status {BLOCKED_EXIT_CODE}",
                  file=sys.stderr, flush=True)
            os._exit(BLOCKED_EXIT_CODE)


def check() -> None:
    """Raises GenerationChanged once the server said the job moved on (a member died or
    left uncleanly) or fenced this member. Cheap (no RPC): call it every step."""
    s = session()
    error = s.client.failure()
    if error is not None:
        s._acknowledged.set()
        raise error


def report(*, step: Optional[int] = None, loss: Optional[float] = None,
           memory_bytes: Optional[int] = None, step_time: Optional[float] = None,
           items_per_second: Optional[float] = None) -> None:
    """What this rank's heartbeats carry (shardctl status shows it)."""
    session().client.report(step=step, loss=loss, memory_bytes=memory_bytes,
                            step_time=step_time, items_per_second=items_per_second)


@contextlib.contextmanager
def failure_guard(wait: Optional[float] = None) -> Iterator[None]:
    """Turns a failed collective into the server's verdict.

        with zeroshard.torch.failure_guard():
            loss = loss_fn(ddp_model(x), y); loss.backward(); optimizer.step()

    When the body raises (Gloo: "Connection closed by peer", a timeout, ...), waits up to
    `wait` seconds (default: the heartbeat timeout + interval) for the server to declare
    the member dead and raises GenerationChanged naming it, chained to the original
    error; if the server says nothing in that time, the original error propagates.
    """
    s = session()
    try:
        check()
        yield
    except ZeroshardError:
        s._acknowledged.set()
        raise
    except Exception as error:  # noqa: BLE001 - collectives raise RuntimeError and others
        s._acknowledged.set()
        limit = s.info.heartbeat_timeout + s.info.heartbeat_interval if wait is None else wait
        deadline = time.monotonic() + limit
        # Polled (every 100 ms) rather than left to the next heartbeat reply, which may
        # come a heartbeat interval after the server's verdict.
        while True:
            verdict = s.client.server_verdict()
            if verdict is not None:
                raise verdict from error
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            s.client.wait_for_failure(min(0.1, left))


def install_step_check(optimizer: Any) -> Any:
    """The optimizer hook: optimizer.step() first calls check(), so a step never runs in
    a generation the server abandoned. Returns the optimizer."""
    step = optimizer.step

    def checked_step(*args: Any, **kwargs: Any) -> Any:
        check()
        return step(*args, **kwargs)

    optimizer.step = checked_step
    return optimizer


def shutdown(leave: bool = True) -> None:
    """Destroys the process group and, with `leave`, leaves the job cleanly."""
    global _session
    s, _session = _session, None
    if dist.is_initialized():
        dist.destroy_process_group()
    if s is not None:
        if leave:
            s.client.leave()
        else:
            s.client.close()
