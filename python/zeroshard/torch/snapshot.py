"""zt.Snapshot: a rank's training state kept in memory, its own copy and a copy of its
neighbour's (the buddy), so that zt.elastic recovers a replaced member without the disk.

    state = zt.ElasticState(build, root=..., save_every=100, snapshot_every=5)

Every `snapshot_every` steps each rank serializes its local shards of the model and
optimizer state (get_state_dict: DTensors as their local tensors, torch.save of plain
tensors and numbers) into bytes, sends them to rank (r + 1) % W, receives rank
(r - 1) % W's, and, after a barrier that says every rank and every buddy holds step S,
commits both: the previous snapshot stays until then, so a death during the exchange
leaves the last committed one.

At a recovery (recover()), the members agree (all_gather_object of what each holds) on
the newest step S that covers every member of the new generation: each holds its own
snapshot of S or another member holds its copy, and each has the rank and world size it
had at S (a replacement takes the dead worker's id, so its rank). Copies go to those
that need them (send/recv), everyone loads its bytes with the restricted unpickler
(torch.load(weights_only=True)) into the freshly built model and optimizer. A shrunk or
grown world, or a member whose both copies died, gives None: the caller loads the
latest disk checkpoint instead (a checkpoint newer than S wins too).

Only the model and optimizer state are kept: the data position and RNG are the
caller's (zt.elastic's steps are a function of the step number).
"""
from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


def _local(value: Any) -> Any:
    """The state dict with every DTensor replaced by a copy of its local shard."""
    from torch.distributed.tensor import DTensor
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def _fill(fresh: Any, saved: Any, where: str = "") -> Any:
    """`fresh` (a state dict of the model just built) with the values of `saved`
    (_local()'s form, of the same world and rank): tensors copied in place."""
    from torch.distributed.tensor import DTensor
    if isinstance(fresh, dict):
        if set(fresh) != set(saved):
            raise ValueError(f"snapshot: keys of {where or 'the state'} differ: "
                             f"{sorted(set(fresh) ^ set(saved))[:5]}")
        return {k: _fill(v, saved[k], f"{where}/{k}") for k, v in fresh.items()}
    if isinstance(fresh, (list, tuple)):
        return type(fresh)(_fill(v, s, f"{where}[{i}]")
                           for i, (v, s) in enumerate(zip(fresh, saved)))
    if isinstance(fresh, torch.Tensor):
        local = fresh.to_local() if isinstance(fresh, DTensor) else fresh
        if local.shape != saved.shape:
            raise ValueError(f"snapshot: {where} has shape {tuple(local.shape)} here and "
                             f"{tuple(saved.shape)} in the snapshot")
        with torch.no_grad():
            local.copy_(saved)
        return fresh
    return saved


def _serialize(state: Dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(_local(state), buffer)
    return buffer.getvalue()


def _deserialize(data: bytes) -> Dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)


def _exchange(send: List[Tuple[int, bytes]], receive: List[Tuple[int, int]]) -> List[bytes]:
    """Sends each (rank, bytes) and receives each (rank, size) in the default group,
    all posted at once (so no pair of ranks waits on the other); the received bytes."""
    works, buffers = [], []
    for peer, data in send:
        works.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer))
    for peer, size in receive:
        buffer = torch.empty(size, dtype=torch.uint8)
        buffers.append(buffer)
        works.append(dist.irecv(buffer, peer))
    for work in works:
        work.wait()
    return [b.numpy().tobytes() for b in buffers]


class Snapshot:
    """What this process holds: its own committed snapshot and its buddy's copy (see the
    module). Lives across generations in the process that took it."""

    def __init__(self) -> None:
        # (step, world_size, rank, worker_id, bytes) of the committed own snapshot.
        self.own: Optional[Tuple[int, int, int, str, bytes]] = None
        # The same for the copy of another member's (its worker id in the tuple).
        self.copy: Optional[Tuple[int, int, int, str, bytes]] = None

    def take(self, step: int, state: Dict[str, Any], session: Any) -> None:
        """Collective: snapshots `state` (get_state_dict's {"model", "optim"}) as step
        `step`, exchanges copies with the neighbours and commits when all hold them."""
        data = _serialize(state)
        world, rank = session.world_size, session.rank
        buddy, source = (rank + 1) % world, (rank - 1) % world
        members = session.info.members
        if world > 1:
            size = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(sizes, size)
            (received,) = _exchange([(buddy, data)], [(source, int(sizes[source][0]))])
            copy = (step, world, source, members[source].worker_id, received)
        else:
            copy = None
        dist.barrier()  # every rank and every buddy holds `step`
        self.own = (step, world, rank, session.worker_id, data)
        self.copy = copy

    def holdings(self) -> Dict[str, Any]:
        """What this process can contribute to a recovery (no bytes)."""
        held = {}
        for kind, entry in (("own", self.own), ("copy", self.copy)):
            if entry is not None:
                step, world, rank, worker, data = entry
                held[kind] = {"step": step, "world": world, "rank": rank, "worker": worker,
                              "size": len(data)}
        return held

    def recover(self, fresh: Dict[str, Any], session: Any) -> Optional[Tuple[int, Dict]]:
        """Collective in the new generation: (step, `fresh` filled with it) when every
        member's snapshot of one step is held by someone (see the module), else None."""
        world, rank = session.world_size, session.rank
        everyone: List[Any] = [None] * world
        dist.all_gather_object(everyone, {"worker": session.worker_id,
                                          "held": self.holdings()})
        plan = _plan(everyone, world)
        if plan is None:
            return None
        step, sources = plan
        sends = [(r, self._bytes_of(everyone[r]["worker"], step))
                 for r, holder in enumerate(sources) if holder == rank and r != rank]
        receive = [] if sources[rank] == rank else [
            (sources[rank], _held_size(everyone[sources[rank]]["held"],
                                       session.worker_id, step))]
        received = _exchange(sends, receive)
        data = received[0] if received else self._bytes_of(session.worker_id, step)
        filled = _fill(fresh, _deserialize(data))
        # A replacement now holds its own bytes too (its copy comes with the next take()).
        self.own = (step, world, rank, session.worker_id, data)
        return step, filled

    def _bytes_of(self, worker: str, step: int) -> bytes:
        for entry in (self.own, self.copy):
            if entry is not None and entry[3] == worker and entry[0] == step:
                return entry[4]
        raise AssertionError(f"snapshot: no bytes of {worker} at step {step} here")


def _held_size(held: Dict[str, Any], worker: str, step: int) -> int:
    for entry in held.values():
        if entry["worker"] == worker and entry["step"] == step:
            return entry["size"]
    raise AssertionError(f"snapshot: {worker}'s step {step} is not held where planned")


def _plan(everyone: List[Dict[str, Any]], world: int) -> Optional[Tuple[int, List[int]]]:
    """The newest step S at which every rank r of the new generation can get its own
    snapshot (taken at world size `world` as rank r by the same worker): (S, the rank that
    sends each rank's bytes, itself when it holds them). None when no step covers all."""
    steps = sorted({e["step"] for x in everyone for e in x["held"].values()}, reverse=True)
    for step in steps:
        sources = []
        for r, member in enumerate(everyone):
            holders = [h for h, x in enumerate(everyone) for e in x["held"].values()
                       if e["worker"] == member["worker"] and e["step"] == step
                       and e["world"] == world and e["rank"] == r]
            if not holders:
                break
            sources.append(r if r in holders else holders[0])
        else:
            return step, sources
    return None
