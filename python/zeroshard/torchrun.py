"""The zeroshard rendezvous handler for torch's elastic agent (torchrun).

With the zeroshard wheel installed (torch 2), torchrun finds it through the
`torchrun.handlers` entry point:

    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=zeroshard \\
        --rdzv-endpoint=10.0.0.1:7070 --rdzv-id=run-7 \\
        [--rdzv-conf=node_id=host-a,token_file=/etc/zeroshard/token] train.py ...

`python -m zeroshard.torchrun ...` does the same without the wheel (and on torch 1.13,
which has no entry points for handlers; it spells the flags with underscores, the
dashed forms are accepted too); --rdzv_backend defaults to zeroshard there. The agents (one per node) join the job <rdzv_id> on the shard server:
node ranks are the sorted order of node ids (rdzv_conf node_id, default
"<hostname>/<agent pid>"), the rendezvous store is that generation's key-value store
(authenticated, fenced). When the server declares a node dead, the job's generation
changes and the surviving agents restart their workers (num_nodes_waiting() reports
it to the agent's monitor loop), re-joining in a new generation with the restarted
node. The workers get ZEROSHARD_SERVER (and ZEROSHARD_TOKEN_FILE): in them,
zeroshard.torch.init_process_group() with no arguments joins the job
<rdzv_id>.workers with the torchrun rank and world size.
"""
from __future__ import annotations

import os
import socket
import sys
from typing import List, Optional, Tuple

from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousHandler,
                                                  RendezvousParameters)
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

from zeroshard.client import Client
from zeroshard.errors import GenerationChanged, ZeroshardError
from zeroshard.torch.store import Store

try:  # torch >= 2.4: next_rendezvous returns a RendezvousInfo
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo as _RendezvousInfo
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousStoreInfo as _RendezvousStoreInfo)
except ImportError:
    _RendezvousInfo = _RendezvousStoreInfo = None

_CLOSED_KEY = "zeroshard/rdzv_closed"


class ZeroshardRendezvousHandler(RendezvousHandler):
    """torch.distributed.elastic's RendezvousHandler over a zeroshard job of nodes."""

    def __init__(self, params: RendezvousParameters) -> None:
        if not params.endpoint:
            raise ValueError("the zeroshard rendezvous needs --rdzv_endpoint=HOST:PORT of the "
                             "shard server")
        if params.min_nodes != params.max_nodes:
            raise ValueError(f"--nnodes={params.min_nodes}:{params.max_nodes}: the zeroshard "
                             f"rendezvous forms jobs of a fixed size; give --nnodes=N")
        self._endpoint = params.endpoint
        self._run_id = params.run_id
        self._nodes = params.max_nodes
        self._node_id = params.get("node_id") or f"{socket.gethostname()}/{os.getpid()}"
        self._token_file = params.get("token_file")
        self._join_timeout = float(params.get("join_timeout", 600))
        self._client = Client(self._endpoint, token_file=self._token_file)
        # The workers inherit the agent's environment: init_process_group() there finds
        # the server (and the token) without arguments.
        os.environ["ZEROSHARD_SERVER"] = self._endpoint
        if self._token_file:
            os.environ["ZEROSHARD_TOKEN_FILE"] = self._token_file
        self._joined = False
        self._closed = False

    def get_backend(self) -> str:
        return "zeroshard"

    def next_rendezvous(self) -> Tuple[Store, int, int]:
        if self.is_closed():
            raise RendezvousClosedError()
        if self._joined:
            # A new round (the agent restarts its workers): leaving and joining again
            # starts a new generation, which every other node follows.
            try:
                self._client.leave()
            except ZeroshardError:
                pass
        info = self._client.join(self._run_id, self._nodes, self._node_id,
                                 timeout=self._join_timeout)
        self._joined = True
        store = Store(self._client)
        if _RendezvousInfo is None:  # torch 1.13: a tuple
            return store, info.rank, info.world_size
        # torch 2: MASTER_ADDR/MASTER_PORT for the workers, agreed through the store
        # (workers that use zeroshard.torch.init_process_group do not need them).
        bootstrap = _RendezvousStoreInfo.build(info.rank, store, local_addr=None)
        return _RendezvousInfo(store, info.rank, info.world_size, bootstrap)

    def is_closed(self) -> bool:
        if self._closed:
            return True
        if self._joined:
            try:
                self._closed = self._client.store_check([_CLOSED_KEY])
            except ZeroshardError:
                pass
        return self._closed

    def set_closed(self) -> None:
        self._closed = True
        if self._joined:
            try:
                self._client.store_set(_CLOSED_KEY, b"1")
            except ZeroshardError:
                pass

    def num_nodes_waiting(self) -> int:
        # Fixed-size jobs: nobody waits to be admitted. A generation the server moved
        # past (a node died) is reported as a node waiting, so the agent's monitor
        # loop restarts its workers and re-joins.
        if self._joined and isinstance(self._client.failure(), GenerationChanged):
            return 1
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        if self._joined:
            try:
                self._client.leave()
            except ZeroshardError:
                return False
            self._joined = False
        return True


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    return ZeroshardRendezvousHandler(params)


def handler_factory():
    """The `torchrun.handlers` entry point (the wheel's "zeroshard"): torch calls it and
    registers what it returns, the function that makes a handler from torchrun's
    rendezvous parameters."""
    return _create_handler


def register() -> None:
    """Registers the "zeroshard" rendezvous backend with torch's registry (idempotent)."""
    try:
        rendezvous_handler_registry.register("zeroshard", _create_handler)
    except ValueError:
        pass  # already registered


_DASHED = {"--rdzv-endpoint": "--rdzv_endpoint", "--rdzv-id": "--rdzv_id",
           "--rdzv-conf": "--rdzv_conf", "--rdzv-backend": "--rdzv_backend",
           "--nproc-per-node": "--nproc_per_node", "--max-restarts": "--max_restarts",
           "--monitor-interval": "--monitor_interval", "--node-rank": "--node_rank"}


def _translate(argv: List[str]) -> List[str]:
    """torchrun's arguments with the dashed spellings made torch 1.13's, and
    --rdzv_backend=zeroshard added. Stops at the training script."""
    out: List[str] = []
    for i, a in enumerate(argv):
        if not a.startswith("-"):
            out += argv[i:]
            break
        name, eq, value = a.partition("=")
        out.append(_DASHED.get(name, name) + eq + value)
    if not any(a.startswith("--rdzv_backend") for a in out):
        out.insert(0, "--rdzv_backend=zeroshard")
    return out


def _endpoint_and_conf(argv: List[str]) -> Tuple[Optional[str], Optional[str]]:
    endpoint = conf = None
    for i, a in enumerate(argv):
        if not a.startswith("-"):
            break
        for flag in ("--rdzv_endpoint", "--rdzv_conf"):
            value = None
            if a.startswith(flag + "="):
                value = a.split("=", 1)[1]
            elif a == flag and i + 1 < len(argv):
                value = argv[i + 1]
            if value is not None:
                if flag == "--rdzv_endpoint":
                    endpoint = value
                else:
                    conf = value
    return endpoint, conf


def _fix_std_from_str() -> None:
    """torch 1.13's Std.from_str finds a value by iterating the IntFlag Std, which on
    Python >= 3.11 leaves out NONE (0) and ALL (3): "--redirects=0" (the default) becomes
    None and the agent fails starting its workers. Parsed here by value instead."""
    import re
    from torch.distributed.elastic.multiprocessing import api
    if (sys.version_info < (3, 11) or _RendezvousInfo is not None
            or getattr(api.Std, "_zeroshard_fixed", False)):
        return

    def from_str(cls, vm: str):
        if re.match(api._VALUE_REGEX, vm):
            return cls(int(vm))
        if re.match(api._MAPPING_REGEX, vm):
            return {int(i): cls(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
        raise ValueError(f"{vm} does not match: <{api._VALUE_REGEX}> or <{api._MAPPING_REGEX}>")

    api.Std.from_str = classmethod(from_str)
    api.Std._zeroshard_fixed = True


def main(argv: Optional[List[str]] = None) -> None:
    argv = _translate(list(sys.argv[1:] if argv is None else argv))
    register()
    _fix_std_from_str()
    endpoint, conf = _endpoint_and_conf(argv)
    # The workers inherit the agent's environment.
    if endpoint:
        os.environ["ZEROSHARD_SERVER"] = endpoint
    for item in (conf or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "token_file":
            os.environ["ZEROSHARD_TOKEN_FILE"] = value.strip()
    from torch.distributed.run import main as torchrun_main
    torchrun_main(argv)


if __name__ == "__main__":
    main()
