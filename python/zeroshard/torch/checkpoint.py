"""Sharded checkpoints from PyTorch in zeroshard's format (common/checkpoint_format.h).

save(): every rank writes its pieces of the model's state dict, as the server's shard
plan for the state dict's spec assigns them, with the Adam moments of those pieces;
commits them; the server writes the manifest when all ranks committed. With a
ZeroRedundancyOptimizer each rank holds the moments of the parameters it owns, which
need not be the pieces the plan gives it: the moments move owner -> plan rank with
point-to-point sends, one piece at a time, so no rank holds more than its own state
plus its pieces. `shardctl consolidate` then merges parameters and moments into one
safetensors file on the server, in bounded memory.

FSDP2 (torch 2, `fully_shard`, 1-D or 2-D HSDP mesh): the state dict's tensors are
DTensors sharded on dim 0. The plan is then FSDP2's own layout (PlanOptions'
row_chunk_ranks = the shard group's size: every tensor cut as torch.chunk cuts it), so
each rank of the first replica writes exactly its local shards and their Adam moments,
the other replicas write empty files, and nothing is gathered.

load(): a consolidated file, or a sharded step directory at any world size, into a
model and (optionally) an optimizer (Adam, AdamW, or a ZeroRedundancyOptimizer over
one: each rank then loads only the moments of the parameters it owns). An FSDP2 module
of any mesh reads only the rows of its local shards.
"""
from __future__ import annotations

import json
import os
import re
import struct
import tempfile
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from zeroshard import _native

SHARD_FORMAT = "zeroshard-shard-v1"
EXP_AVG = "optim.exp_avg."
EXP_AVG_SQ = "optim.exp_avg_sq."
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _dtensor_class() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4
        return None
    return DTensor


def _is_dtensor(t: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def _local_rows(t: torch.Tensor) -> Tuple[int, int]:
    """[begin, end): the dim-0 rows of the global tensor this rank holds of DTensor `t`
    (all of them when it is replicated)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if t.dim() == 0:
        return 0, 1
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return offset[0], offset[0] + shape[0]


def _shard_dim(t: torch.Tensor, name: str) -> Optional[int]:
    """The mesh dimension that shards DTensor `t` on dim 0 (None when it is replicated).
    ValueError for layouts zeroshard does not write (other dims, several shardings)."""
    from torch.distributed.tensor import Replicate, Shard
    dims = []
    for d, p in enumerate(t.placements):
        if isinstance(p, Shard) and p.dim == 0:
            dims.append(d)
        elif not isinstance(p, Replicate):
            raise ValueError(f"tensor '{name}' is a DTensor placed {list(t.placements)}; "
                             f"zeroshard checkpoints take FSDP2's Shard(0) (with Replicate on "
                             f"HSDP's other mesh dimension)")
    if len(dims) > 1:
        raise ValueError(f"tensor '{name}' is sharded on dim 0 over mesh dimensions {dims}; "
                         f"expected one")
    return dims[0] if dims else None


def _row_chunk_ranks(state: Mapping[str, torch.Tensor]) -> int:
    """FSDP2's shard group size S when the state dict holds DTensors sharded on dim 0
    (the plan then cuts every tensor as torch.chunk(t, S) does), else 0 (the balanced
    plan). Chunk k of replica 0 must live on global rank k, as init_device_mesh lays
    out (replicate, shard) meshes; ValueError otherwise."""
    groups = set()
    for name, t in state.items():
        if not _is_dtensor(t):
            continue
        d = _shard_dim(t, name)
        if d is None:
            continue
        mesh = t.device_mesh.mesh
        first_replica = mesh[tuple(0 if i != d else slice(None) for i in range(mesh.dim()))]
        ranks = [int(r) for r in first_replica.reshape(-1)]
        if ranks != list(range(len(ranks))):
            raise ValueError(
                f"tensor '{name}': its first replica's shards live on ranks {ranks}; "
                f"zeroshard's FSDP2 layout needs ranks 0..{len(ranks) - 1} in order "
                f"(build the mesh with init_device_mesh(..., (replicas, shards)))")
        groups.add(len(ranks))
    if len(groups) > 1:
        raise ValueError(f"the model's DTensors are sharded over groups of sizes "
                         f"{sorted(groups)}; zeroshard writes one layout per checkpoint")
    return groups.pop() if groups else 0


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # DistributedDataParallel keeps the model as .module; its names have "module.".
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _float_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in _unwrap(model).state_dict().items() if v.is_floating_point()}


def spec_of(state: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """The model spec the server plans for `state` (name -> floating-point tensor, in
    order): F32, unit = the name's module (so a layer is a unit)."""
    tensors = []
    for name, t in state.items():
        tensors.append({"name": name, "shape": list(t.shape), "dtype": "F32",
                        "unit": name.rsplit(".", 1)[0] if "." in name else name})
    return {"tensors": tensors}


def model_spec(model: torch.nn.Module) -> Dict[str, Any]:
    """The model spec the server plans: every floating-point tensor of the state dict."""
    return spec_of(_float_state(model))


def plan_for(client: Any, state: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """The server's shard plan for `state`: FSDP2's own layout when it holds DTensors
    sharded on dim 0, else the balanced plan."""
    return client.plan(spec_of(state), row_chunk_ranks=_row_chunk_ranks(state))


def _optimizer_parts(optimizer: Any) -> Tuple[Any, Optional[Dict[torch.Tensor, int]]]:
    """(the optimizer holding state, param -> owning rank or None when every rank holds
    every parameter's state)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.optim, optimizer._param_to_rank
    return optimizer, None


def _rows(t: torch.Tensor, a: int, b: int, name: str = "") -> torch.Tensor:
    """Rows [a, b) of `t` as float32 on the CPU; of a DTensor, from its local shard
    (ValueError when this rank does not hold them)."""
    if _is_dtensor(t):
        begin, end = _local_rows(t)
        if not (begin <= a and b <= end):
            raise ValueError(f"tensor '{name}': the plan gives this rank rows [{a}, {b}) but "
                             f"its shard holds [{begin}, {end})")
        local = t.to_local()
        return (local[a - begin:b - begin] if t.dim() > 0 else local.reshape(1)).detach().to(
            "cpu", torch.float32)
    return (t[a:b] if t.dim() > 0 else t.reshape(1)).detach().to("cpu", torch.float32)


def _shard_name(prefix: str, name: str, a: int, b: int) -> str:
    return f"{prefix}{name}:{a}-{b}"


def save(step: int, model: torch.nn.Module, optimizer: Any = None, *,
         root: Optional[str] = None, session: Any = None,
         timeout: float = 600.0) -> Dict[str, Any]:
    """Saves this rank's pieces of `model` (and of `optimizer`'s Adam moments) as step
    `step` of the job and commits them. Collective: every rank of the job calls it.

    root: the server's checkpoint root, when this machine shares it (the file is written
    there); without it the file is written to a temporary file and uploaded.
    Returns {"file", "step_complete", "committed"}; step_complete is True on the rank
    whose commit completed the step.
    """
    from zeroshard.torch.process_group import session as current
    s = session or current()
    client, info = s.client, s.info
    rank, world = info.rank, info.world_size
    state = _float_state(model)
    plan = plan_for(client, state)
    params = dict(_unwrap(model).named_parameters())

    inner, owner = (None, None) if optimizer is None else _optimizer_parts(optimizer)
    moments = inner is not None and any(len(v) for v in inner.state.values())
    if moments:
        for p, st in inner.state.items():
            if st and not all(m in st for m in _MOMENTS):
                raise ValueError(
                    f"{type(inner).__name__}'s state has {sorted(st)}; zeroshard checkpoints "
                    f"hold Adam's exp_avg and exp_avg_sq: pass optimizer=None to save the "
                    f"weights only")
    # Every rank must record one optimizer step count.
    optimizer_step = 0
    if moments:
        for st in inner.state.values():
            if "step" in st:
                optimizer_step = max(optimizer_step, int(float(st["step"])))
    if dist.is_initialized() and optimizer is not None:
        flag = torch.tensor([optimizer_step, int(moments)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        optimizer_step, moments = int(flag[0]), bool(flag[1])

    names: List[str] = []
    arrays: List[Any] = []
    moment_names: List[str] = []
    moment_arrays: List[Any] = []
    for unit in plan["units"]:
        for piece in unit["pieces"]:
            spec = unit["tensors"][piece.get("tensor", 0)]
            name, a, b, r = spec["name"], piece["row_begin"], piece["row_end"], piece["rank"]
            if r == rank:
                names.append(_shard_name("", name, a, b))
                arrays.append(_rows(state[name], a, b, name).contiguous().numpy())
            if not moments or name not in params:
                continue
            p = params[name]
            src = r if owner is None else owner[p]
            if src == r:
                if rank == r:
                    got = [_rows(inner.state[p][m], a, b, name) for m in _MOMENTS]
                else:
                    continue
            elif rank == src:
                dist.send(torch.cat([_rows(inner.state[p][m], a, b).reshape(-1)
                                     for m in _MOMENTS]), dst=r)
                continue
            elif rank == r:
                shape = _rows(state[name], a, b).shape
                buf = torch.empty(2 * shape.numel(), dtype=torch.float32)
                dist.recv(buf, src=src)
                got = [buf[: shape.numel()].reshape(shape), buf[shape.numel():].reshape(shape)]
            else:
                continue
            for prefix, t in zip((EXP_AVG, EXP_AVG_SQ), got):
                moment_names.append(_shard_name(prefix, name, a, b))
                moment_arrays.append(t.contiguous().numpy())
    names += moment_names
    arrays += moment_arrays

    return write_shard(step, names, arrays, session=s, plan_hash=plan["hash"],
                       optimizer=type(inner).__name__.lower() if moments else "",
                       optimizer_step=optimizer_step, root=root, timeout=timeout)


def write_shard(step: int, names: List[str], arrays: List[Any], *, session: Any,
                plan_hash: str, optimizer: str, optimizer_step: int,
                extra_metadata: Optional[Mapping[str, str]] = None,
                root: Optional[str] = None, timeout: float = 600.0) -> Dict[str, Any]:
    """Writes this rank's shard file of step `step` (tensors `names` = float32 `arrays`,
    with their XXH64 checksums), under `root` or uploaded, and commits it."""
    client, info = session.client, session.info
    relative = f"{info.job}/step-{step}/rank-{info.rank}-of-{info.world_size}.safetensors"
    metadata = {
        "format": SHARD_FORMAT, "job": info.job, "step": str(step), "rank": str(info.rank),
        "world_size": str(info.world_size), "generation": str(info.generation),
        "plan_hash": plan_hash, "optimizer": optimizer, "optimizer_step": str(optimizer_step),
    }
    metadata.update(extra_metadata or {})
    shapes = [list(a.shape) for a in arrays]
    if root is not None:
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        size, sums = _native.write_f32_safetensors(path, names, shapes, arrays, metadata)
    else:
        with tempfile.TemporaryDirectory(prefix="zeroshard-save-") as tmp:
            path = os.path.join(tmp, os.path.basename(relative))
            size, sums = _native.write_f32_safetensors(path, names, shapes, arrays, metadata)
            client.upload_shard(step, relative, path, timeout=timeout)
    committed = client.commit_shard(step, relative, size, sums, timeout=timeout)
    return {"file": relative, "step_complete": bool(committed.get("step_complete", False)),
            "committed": int(committed.get("committed", 0))}


# ---- Reading ----

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64}
_PIECE = re.compile(r"^(.*):(\d+)-(\d+)$")


class _SafetensorsFile:
    """The header of a safetensors file, and single tensors read on demand."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        self.data_start = 8 + n
        self.metadata: Dict[str, str] = header.pop("__metadata__", {}) or {}
        self.tensors: Dict[str, Dict[str, Any]] = header

    def read(self, name: str, rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """Tensor `name` as float32, or only its dim-0 rows [a, b) (a 0-d tensor is one
        row)."""
        t = self.tensors[name]
        begin, end = t["data_offsets"]
        if t["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor '{name}' is {t['dtype']}; expected a float")
        shape = list(t["shape"])
        if rows is not None:
            total = shape[0] if shape else 1
            a, b = rows
            if not 0 <= a <= b <= total:
                raise ValueError(f"{self.path}: rows [{a}, {b}) of tensor '{name}', which has "
                                 f"{total}")
            row_bytes = (end - begin) // total if total else 0
            begin, end = begin + a * row_bytes, begin + b * row_bytes
            shape = [b - a] + shape[1:] if shape else [b - a]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            raw = bytearray(f.read(end - begin))
        if len(raw) != end - begin:
            raise ValueError(f"{self.path}: tensor '{name}' is cut short")
        return torch.frombuffer(raw, dtype=_DTYPES[t["dtype"]]).reshape(shape).float() \
            if raw else torch.empty(shape)


class _Checkpoint:
    """Tensors by (prefix, model name), from a consolidated file or a sharded step."""

    def __init__(self, source: str) -> None:
        self.files: List[_SafetensorsFile] = []
        self.pieces: Dict[Tuple[str, str], List[Tuple[int, int, int, str]]] = {}
        if os.path.isdir(source):
            shards = sorted(f for f in os.listdir(source)
                            if f.startswith("rank-") and f.endswith(".safetensors"))
            if not shards:
                raise FileNotFoundError(f"no rank-*.safetensors in {source}")
            for i, f in enumerate(shards):
                sf = _SafetensorsFile(os.path.join(source, f))
                self.files.append(sf)
                for n in sf.tensors:
                    m = _PIECE.match(n)
                    if m is None:
                        raise ValueError(f"{sf.path}: tensor '{n}' is not <name>:<a>-<b>")
                    full, a, b = m.group(1), int(m.group(2)), int(m.group(3))
                    prefix = next((p for p in (EXP_AVG, EXP_AVG_SQ) if full.startswith(p)), "")
                    key = (prefix, full[len(prefix):])
                    self.pieces.setdefault(key, []).append((a, b, i, n))
            self.sharded = True
        else:
            self.files.append(_SafetensorsFile(source))
            self.sharded = False
        meta = self.files[0].metadata
        self.optimizer_step = int(meta.get("optimizer_step", "0") or 0)

    def has(self, prefix: str, name: str) -> bool:
        if self.sharded:
            return (prefix, name) in self.pieces
        return prefix + name in self.files[0].tensors

    def get_rows(self, prefix: str, name: str, like: torch.Tensor, a: int,
                 b: int) -> torch.Tensor:
        """Rows [a, b) of tensor `prefix + name`, which has `like`'s (global) shape,
        reading only the pieces (or the part of the consolidated tensor) that hold them."""
        rows = like.shape[0] if like.dim() > 0 else 1
        out_shape = [b - a] + list(like.shape[1:]) if like.dim() > 0 else [b - a]
        if not self.sharded:
            sf = self.files[0]
            t = sf.tensors.get(prefix + name)
            if t is None:
                raise ValueError(f"{sf.path} has no tensor '{prefix}{name}'")
            if list(t["shape"]) != list(like.shape):
                raise ValueError(f"tensor '{prefix}{name}' is {list(t['shape'])}; the model "
                                 f"has {list(like.shape)}")
            return sf.read(prefix + name, (a, b)).reshape(out_shape)
        out = torch.empty(out_shape, dtype=torch.float32)
        covered = 0
        for pa, pb, i, n in sorted(self.pieces[(prefix, name)]):
            if pa != covered:
                raise ValueError(f"tensor '{prefix}{name}': rows {covered}..{pa} missing")
            covered = pb
            lo, hi = max(a, pa), min(b, pb)
            if lo < hi:
                out[lo - a:hi - a] = self.files[i].read(n, (lo - pa, hi - pa)).reshape(
                    [hi - lo] + out_shape[1:])
        if covered != rows:
            raise ValueError(f"tensor '{prefix}{name}': {covered} rows of {rows}")
        return out

    def get(self, prefix: str, name: str, like: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            t = self.files[0].read(prefix + name)
        else:
            pieces = sorted(self.pieces[(prefix, name)])
            if like.dim() == 0:
                a, b, i, n = pieces[0]
                return self.files[i].read(n).reshape(())
            t = torch.empty(like.shape, dtype=torch.float32)
            covered = 0
            for a, b, i, n in pieces:
                if a != covered:
                    raise ValueError(f"tensor '{prefix}{name}': rows {covered}..{a} missing")
                t[a:b] = self.files[i].read(n)
                covered = b
            if covered != like.shape[0]:
                raise ValueError(f"tensor '{prefix}{name}': {covered} rows of {like.shape[0]}")
        if t.shape != like.shape:
            raise ValueError(f"tensor '{prefix}{name}' is {list(t.shape)}; the model has "
                             f"{list(like.shape)}")
        return t


def _read_like(ckpt: _Checkpoint, prefix: str, name: str, like: torch.Tensor) -> torch.Tensor:
    """Tensor `prefix + name` shaped and placed as `like`: of a DTensor, only its local
    rows, made a DTensor of the same mesh and placements."""
    if not _is_dtensor(like):
        return ckpt.get(prefix, name, like).to(like.dtype)
    a, b = _local_rows(like)
    local = ckpt.get_rows(prefix, name, like, a, b)
    if like.dim() == 0:
        local = local.reshape(())
    local = local.to(dtype=like.dtype, device=like.to_local().device)
    return _dtensor_class().from_local(local, like.device_mesh, like.placements,
                                       run_check=False, shape=like.shape, stride=like.stride())


def load(source: str, model: torch.nn.Module, optimizer: Any = None) -> int:
    """Loads a checkpoint into `model` (and `optimizer`): `source` is a consolidated
    safetensors file (`shardctl consolidate`) or a sharded step directory
    (<root>/<job>/step-<N>/), of any world size. The optimizer (Adam or AdamW, or a
    ZeroRedundancyOptimizer over one) gets the moments and step count through its
    load_state_dict; a ZeroRedundancyOptimizer rank loads only the parameters it owns.
    Returns the optimizer step count the checkpoint recorded."""
    ckpt = _Checkpoint(source)
    target = _unwrap(model)
    current = target.state_dict()
    loaded = {}
    for name, t in current.items():
        if t.is_floating_point():
            loaded[name] = _read_like(ckpt, "", name, t)
        else:
            loaded[name] = t
    target.load_state_dict(loaded)
    if optimizer is None:
        return ckpt.optimizer_step
    inner, _ = _optimizer_parts(optimizer)
    names = {p: n for n, p in target.named_parameters()}
    state_dict = inner.state_dict()
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    index = 0
    for group in inner.param_groups:
        for p in group["params"]:
            name = names.get(p)
            if name is None:
                raise ValueError("the optimizer holds a parameter that is not the model's")
            if ckpt.has(EXP_AVG, name):
                state[index] = {
                    "step": torch.tensor(float(ckpt.optimizer_step)),
                    "exp_avg": _read_like(ckpt, EXP_AVG, name, p),
                    "exp_avg_sq": _read_like(ckpt, EXP_AVG_SQ, name, p),
                }
            index += 1
    if not state:
        raise ValueError(f"{source} holds no optimizer state (consolidated with "
                         f"--weights_only?); load with optimizer=None")
    state_dict["state"] = state
    inner.load_state_dict(state_dict)
    return ckpt.optimizer_step
