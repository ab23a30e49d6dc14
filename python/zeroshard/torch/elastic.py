"""Recovery inside the process (torch 2): a training loop that survives a member's death
without restarting the survivors.

    def build(session):                      # called in every generation
        model = make_model(); fully_shard(...)  # on this generation's world
        return model, torch.optim.Adam(model.parameters(), lr=...)

    state = zt.ElasticState(build, root="/shared/checkpoints", save_every=10)
    for step in zt.elastic(range(1, 1001), state=state):
        with state.guard():                   # the whole step, its collectives included
            loss = train_step(state.model, state.optimizer, step)

Every `save_every` steps the loop saves the model and optimizer through DCP into the
server (zt.dcp.StorageWriter). When a member dies, the survivors' collectives fail (with
Gloo, at the server's verdict at the latest: the bridge shuts the group's connections
down, see abort.py), the guard turns that into the server's verdict (GenerationChanged)
and swallows it, and the next iteration recovers in place: it destroys the process
group, re-joins the job with the same worker id (rejoin()), builds a new process group
from the new generation's Store, calls `build` for the new world, loads the latest
complete step (DCP through zt.dcp.StorageReader, resharded onto the new world size) and
goes on with the step after it. A replacement process (the dead worker's id) joins the
same generation and starts from the same step; without one, a job started with
min_world_size shrinks after rejoin_grace. A member that dies during a recovery ends
that generation too: the loop re-joins again, up to `max_recoveries` re-joins in all.
No process exits with status 75 for a dead peer.

With snapshot_every, the state also comes from memory (zt.Snapshot: each rank's own copy
and its neighbour's, taken every snapshot_every steps): a recovery at the same world size
(a replacement with the dead worker's id) restores the newest snapshot that every member
can get from itself or from the holder of its copy, without the disk; a shrunk job, or a
member whose both copies died, loads the latest checkpoint (so does one newer than the
snapshot).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from zeroshard.errors import GenerationChanged
from zeroshard.torch import dcp as zdcp
from zeroshard.torch.process_group import exit_grace, failure_guard, rejoin, session
from zeroshard.torch.snapshot import Snapshot


class ElasticState:
    """What zt.elastic keeps: how to build the model and optimizer for a generation, where
    checkpoints go, and the current model, optimizer and recovery records."""

    def __init__(self, build: Callable[[Any], Tuple[torch.nn.Module, Any]], *, root: str,
                 save_every: int, snapshot_every: int = 0, join_timeout: float = 600.0,
                 max_recoveries: int = 10) -> None:
        if save_every <= 0:
            raise ValueError(f"save_every {save_every}: expected a positive number of steps")
        if snapshot_every < 0:
            raise ValueError(f"snapshot_every {snapshot_every}: expected a number of steps "
                             f"(0: no in-memory snapshots)")
        if max_recoveries < 0:
            raise ValueError(f"max_recoveries {max_recoveries}: expected 0 or more re-joins")
        self.build, self.root, self.save_every = build, root, save_every
        self.join_timeout, self.max_recoveries = join_timeout, max_recoveries
        self.snapshot_every = snapshot_every
        self.snapshot: Optional[Snapshot] = Snapshot() if snapshot_every else None
        self.restored_from = ""  # "memory" or "disk": where restore()'s step came from
        self.model: Optional[torch.nn.Module] = None
        self.optimizer: Any = None
        self.failure: Optional[GenerationChanged] = None
        self.failed_at = 0.0
        # One per re-join: {"generation", "world_size", "rank", "error" (what ended the
        # generation before), "failed_at", "from_step", "tier" (restored_from),
        # "recovered_at"} (time.time()
        # seconds). A member that died during the recovery leaves from_step and
        # recovered_at None, and the next record's error names it.
        self.recoveries: List[Dict[str, Any]] = []

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Runs a step's body; a member's death inside it (GenerationChanged, or a failed
        collective the server explains as one) is kept for the loop to recover from, not
        raised. Other errors propagate."""
        try:
            with failure_guard():
                yield
        except GenerationChanged as error:
            self.failure = error
            self.failed_at = time.time()

    def _state_dict(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        dcp.save(self._state_dict(), storage_writer=zdcp.StorageWriter(step, root=self.root))

    def take_snapshot(self, step: int) -> None:
        """Collective: the in-memory snapshot of `step` (see zt.Snapshot)."""
        self.snapshot.take(step, self._state_dict(), session())

    def restore(self) -> Optional[int]:
        """Builds the model and optimizer for the current generation and loads the newest
        state: the in-memory snapshot when every member can get it and no checkpoint is
        newer, else the latest complete step (the one rank 0 finds, so every rank loads
        the same); its number, or None without one."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        s = session()
        self.model, self.optimizer = self.build(s)
        latest = torch.tensor([-1], dtype=torch.int64)
        if s.rank == 0:
            complete = [int(c["step"]) for c in s.client.checkpoints(s.info.job)
                        if c.get("complete")]
            latest[0] = max(complete, default=-1)
        dist.broadcast(latest, src=0)
        step = int(latest[0])
        if self.snapshot is not None:
            memory = self.snapshot.recover(self._state_dict(), s)
            if memory is not None and memory[0] >= step:
                state = memory[1]
                set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
                self.restored_from = "memory"
                return memory[0]
        self.restored_from = "disk"
        if step < 0:
            return None
        state = self._state_dict()
        dcp.load(state, storage_reader=zdcp.StorageReader(
            os.path.join(self.root, s.info.job, f"step-{step}")))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return step


def _index_after(steps: List[int], step: Optional[int]) -> int:
    """The index of the first step after `step` (0 when None)."""
    if step is None:
        return 0
    return next((i for i, s in enumerate(steps) if s > step), len(steps))


def _check_watchdog(s: Any) -> None:
    """Without an abort (NCCL), the watchdog must not end a survivor that is still waiting
    for its collective to time out (the only way out of a collective blocked on another
    survivor). Gloo's groups are aborted at the server's verdict: nothing to check."""
    grace = exit_grace(s)
    timeout = s.timeout.total_seconds()
    if s.connections is None and 0 < grace <= timeout + s.info.heartbeat_timeout:
        raise ValueError(
            f"zt.elastic: the watchdog would end this process {grace:.0f} s after a member's "
            f"death, before a collective blocked on a survivor times out ({timeout:.0f} s, "
            f"the process group's timeout) and recovers; pass init_process_group("
            f"timeout=<seconds, short>, exit_if_blocked=<more than timeout + "
            f"{s.info.heartbeat_timeout:.0f} s>)")


def _restore_through_failures(state: ElasticState) -> Optional[int]:
    """Restores the state in the current generation; when a member dies on the way (or
    died before: state.failure), re-joins and tries again, up to state.max_recoveries
    re-joins in all (then raises the last failure). Returns restore()'s step."""
    while True:
        error = state.failure
        if error is not None:
            if len(state.recoveries) >= state.max_recoveries:
                raise error
            failed_at = state.failed_at
            state.failure = None
            state.model = state.optimizer = None
            try:
                rejoin(state.join_timeout)
            except GenerationChanged as died:  # a member died while the new group formed
                state.failure, state.failed_at = died, time.time()
            s = session()
            record = {"generation": s.generation, "world_size": s.world_size, "rank": s.rank,
                      "error": str(error), "failed_at": failed_at, "from_step": None,
                      "recovered_at": None}
            state.recoveries.append(record)
            if state.failure is not None:
                continue
        with state.guard():
            from_step = state.restore()
        if state.failure is None:
            if error is not None:
                record.update(from_step=from_step, tier=state.restored_from,
                              recovered_at=time.time())
            return from_step


def elastic(steps: Iterable[int], *, state: ElasticState) -> Iterator[int]:
    """Yields the steps to run, in order; resumes from the latest complete checkpoint at
    the start and after every recovery (see the module). Call zt.init_process_group
    first (with min_world_size and rejoin_grace to let the job shrink)."""
    _check_watchdog(session())
    order = list(steps)
    i = _index_after(order, _restore_through_failures(state))
    while i < len(order):
        step = order[i]
        yield step
        if state.failure is None and step % state.save_every == 0:
            with state.guard():
                state.save(step)
        if state.failure is None and state.snapshot_every and step % state.snapshot_every == 0:
            with state.guard():
                state.take_snapshot(step)
        if state.failure is None:
            i += 1
            continue
        i = _index_after(order, _restore_through_failures(state))
