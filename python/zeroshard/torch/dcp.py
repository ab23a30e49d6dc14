"""torch.distributed.checkpoint (DCP) through zeroshard: a StorageWriter and a
StorageReader, so that

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=zt.dcp.StorageWriter(step))
    ...
    dcp.load(state, storage_reader=zt.dcp.StorageReader("<root>/<job>/step-<N>"))

write and read a step in zeroshard's own sharded format (common/checkpoint_format.h),
committed through the server like zt.save: every rank writes one file of its own local
shards (FSDP2's DTensor shards as they are: the server's plan is FSDP2's layout), with
XXH64 checksums, uploaded or written under a shared root, and the server completes the
step (manifest.json, written last) only when every rank committed, so a crash never
leaves a step that looks complete. `shardctl consolidate` then merges it into one
safetensors file or Hugging Face shards with model.safetensors.index.json.

How a DCP state dict maps onto the format (DCP flattens it first: each entry has a
flat key and a path, e.g. "optim.state.0.weight.exp_avg" = ("optim", "state",
"0.weight", "exp_avg")):
- a floating-point tensor of at least one dimension is a model tensor of the plan,
  named by the last element of its path when the path has at most two elements
  ("model.0.weight" -> "0.weight", as zt.save and Hugging Face name it), else by its
  flat key;
- an optimizer's exp_avg / exp_avg_sq of such a tensor (path (..., "state", NAME,
  "exp_avg")) is stored as its Adam moment, "optim.exp_avg.NAME", piece for piece;
- everything else (the 0-d "step" tensors, integer tensors, the param_groups' numbers
  and lists) is small and the same on every rank (DCP assumes so too): rank 0 keeps it
  in its file's __metadata__ "dcp" as JSON (tensors as base64 bytes with their XXH64),
  beside the flat keys' paths and dtypes. Objects JSON cannot hold are kept as torch.save
  bytes and read back only through torch.load(weights_only=True), the restricted
  unpickler; nothing read from disk is ever unpickled otherwise.

The reader presents a complete step (its manifest.json) to DCP as a checkpoint whose
chunks are the step's pieces, so DCP's own load planner reshards it onto any mesh and
world size; every piece is checked against its XXH64 as it is read.
"""
from __future__ import annotations

import base64
import io
import json
import os
import pickle
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import StorageReader as _DcpReader
from torch.distributed.checkpoint import StorageWriter as _DcpWriter
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from zeroshard import _native
from zeroshard.torch import checkpoint as ck

DCP_METADATA_KEY = "dcp"  # the __metadata__ key of rank 0's file
DCP_FORMAT = "zeroshard-dcp-v1"
_MOMENT_PREFIX = {"exp_avg": ck.EXP_AVG, "exp_avg_sq": ck.EXP_AVG_SQ}


# ---- The mapping of a flat DCP state dict ----

def _path(key: str, mappings: Optional[Mapping[str, Tuple[Any, ...]]]) -> Tuple[Any, ...]:
    return tuple(mappings[key]) if mappings and key in mappings else (key,)


def _is_sharded_kind(t: Any) -> bool:
    """Stored as pieces of the plan: a floating-point tensor of at least one dimension."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0


def _storage_names(state: Mapping[str, Any],
                   mappings: Optional[Mapping[str, Tuple[Any, ...]]]) -> Dict[str, Tuple[str, str]]:
    """flat key -> (plan tensor name, prefix) for the entries stored as plan pieces:
    prefix "" for a model tensor, ck.EXP_AVG / ck.EXP_AVG_SQ for its Adam moments."""
    short: Dict[str, str] = {}
    moments: Dict[str, Tuple[str, str]] = {}
    for key, t in state.items():
        if not _is_sharded_kind(t):
            continue
        path = _path(key, mappings)
        if (len(path) >= 3 and path[-1] in _MOMENT_PREFIX and path[-3] == "state"
                and isinstance(path[-2], str)):
            moments[key] = (path[-2], _MOMENT_PREFIX[path[-1]])
        else:
            short[key] = path[-1] if len(path) <= 2 and isinstance(path[-1], str) else key
    counts: Dict[str, int] = {}
    for name in short.values():
        counts[name] = counts.get(name, 0) + 1
    names = {k: (n if counts[n] == 1 else k, "") for k, n in short.items()}
    by_name = {n: k for k, (n, _) in names.items()}
    for key, (param, prefix) in moments.items():
        owner = by_name.get(param)
        if owner is not None and state[owner].shape == state[key].shape:
            names[key] = (param, prefix)
        else:  # not a moment of a model tensor: a tensor of its own
            names[key] = (key, "")
    return names


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype '{name}' in a DCP step's metadata is not a torch dtype")
    return dtype


def _tensor_bytes(t: torch.Tensor) -> bytes:
    if ck._is_dtensor(t):
        from torch.distributed.tensor import Replicate
        if not all(isinstance(p, Replicate) for p in t.placements):
            raise ValueError(f"a DTensor placed {list(t.placements)} that is not a floating-point "
                             f"tensor of at least one dimension; zeroshard's DCP storage keeps "
                             f"such small entries whole (replicated)")
        t = t.to_local()
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _encode_object(obj: Any) -> Any:
    """A JSON value for `obj` (None, bool, int, float, str, list, tuple, dict of str), or
    raises TypeError. Tuples are tagged so that they come back as tuples."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_encode_object(v) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode_object(v) for v in obj]}
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj) and "__tuple__" not in obj:
        return {k: _encode_object(v) for k, v in obj.items()}
    raise TypeError(type(obj).__name__)


def _decode_object(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_object(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_decode_object(v) for v in value["__tuple__"])
        return {k: _decode_object(v) for k, v in value.items()}
    return value


def _small_entry(value: Any) -> Dict[str, Any]:
    """The JSON entry of an entry kept whole in rank 0's metadata."""
    if isinstance(value, torch.Tensor):
        raw = _tensor_bytes(value)
        return {"kind": "tensor", "dtype": _dtype_name(value.dtype), "shape": list(value.shape),
                "data": base64.b64encode(raw).decode(), "xxh64": _native.checksum_hex(raw)}
    try:
        return {"kind": "object", "json": _encode_object(value)}
    except TypeError:
        buf = io.BytesIO()
        torch.save(value, buf)
        raw = buf.getvalue()
        return {"kind": "pickle", "data": base64.b64encode(raw).decode(),
                "xxh64": _native.checksum_hex(raw)}


def _optimizer_step(state: Mapping[str, Any],
                    mappings: Optional[Mapping[str, Tuple[Any, ...]]]) -> int:
    """The largest optimizer "step" of the state dict (0 without one)."""
    step = 0
    for key, v in state.items():
        if _path(key, mappings)[-1] == "step" and isinstance(v, torch.Tensor) and v.numel() == 1:
            local = v.to_local() if ck._is_dtensor(v) else v
            step = max(step, int(float(local.reshape(()))))
    return step


def _planner_state(planner: Any) -> Tuple[Dict[str, Any], Optional[Dict[str, Tuple[Any, ...]]]]:
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping):
        raise TypeError(f"zeroshard's DCP StorageWriter needs a planner that keeps the flat "
                        f"state dict as .state_dict (DefaultSavePlanner does); got "
                        f"{type(planner).__name__}")
    return dict(state), getattr(planner, "mappings", None)


# ---- Writing ----

class StorageWriter(_DcpWriter):
    """Writes a DCP save as step `step` of the job, committed through the server.

    session: the zeroshard.torch session (default: the one init_process_group made);
    client: a zeroshard.Client that joined the job, instead of a session.
    root: the server's checkpoint root when this machine shares it (files are written
    there); without it each rank's file is uploaded.
    """

    def __init__(self, step: int, *, session: Any = None, client: Any = None,
                 root: Optional[str] = None, timeout: float = 600.0) -> None:
        super().__init__()
        if step < 0:
            raise ValueError(f"step {step} is negative; expected a step number >= 0")
        self.step = int(step)
        self._session, self._client = session, client
        self.root, self.timeout = root, timeout
        self.result: Dict[str, Any] = {}

    def _resolved_session(self) -> Any:
        if self._client is not None:
            return _ClientSession(self._client)
        if self._session is not None:
            return self._session
        from zeroshard.torch.process_group import session
        return session()

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self.result = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return plans

    def storage_meta(self) -> Optional[StorageMeta]:
        s = self._resolved_session()
        return StorageMeta(checkpoint_id=f"zeroshard:{s.info.job}/step-{self.step}")

    def write_data(self, plan: SavePlan, planner: Any) -> Future:
        state, mappings = _planner_state(planner)
        self.result = save_flat(self.step, state, mappings, session=self._resolved_session(),
                                root=self.root, timeout=self.timeout)
        fut: Future = Future()
        fut.set_result([WriteResult(index=item.index, size_in_bytes=0,
                                    storage_data=self.result["file"]) for item in plan.items])
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        # Every rank committed inside write_data, before DCP gathered the results: the
        # server completed the step with the last commit (its manifest is the record).
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return False


class _ClientSession:
    """A session-like view of a Client that joined the job."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.info = client.info


def save_flat(step: int, state: Mapping[str, Any],
              mappings: Optional[Mapping[str, Tuple[Any, ...]]], *, session: Any,
              root: Optional[str] = None, timeout: float = 600.0) -> Dict[str, Any]:
    """Writes and commits this rank's file of a flat DCP state dict (see the module)."""
    names_of = _storage_names(state, mappings)
    params = {names_of[k][0]: state[k] for k in names_of if names_of[k][1] == ""}
    moments: Dict[str, Dict[str, torch.Tensor]] = {}
    for k, (name, prefix) in names_of.items():
        if prefix:
            moments.setdefault(name, {})[prefix] = state[k]
    plan = ck.plan_for(session.client, params)
    rank = session.info.rank
    names: List[str] = []
    arrays: List[Any] = []
    for unit in plan["units"]:
        for piece in unit["pieces"]:
            if piece["rank"] != rank:
                continue
            name = unit["tensors"][piece.get("tensor", 0)]["name"]
            a, b = piece["row_begin"], piece["row_end"]
            for prefix, t in [("", params[name])] + sorted(moments.get(name, {}).items()):
                names.append(ck._shard_name(prefix, name, a, b))
                arrays.append(ck._rows(t, a, b, prefix + name).contiguous().numpy())
    extra = {}
    if rank == 0:
        extra[DCP_METADATA_KEY] = json.dumps(_dcp_record(state, mappings, names_of),
                                             separators=(",", ":"))
    any_moments = any(moments.values())
    return ck.write_shard(step, names, arrays, session=session, plan_hash=plan["hash"],
                          optimizer="adam" if any_moments else "",
                          optimizer_step=_optimizer_step(state, mappings),
                          extra_metadata=extra, root=root, timeout=timeout)


def _dcp_record(state: Mapping[str, Any], mappings: Optional[Mapping[str, Tuple[Any, ...]]],
                names_of: Mapping[str, Tuple[str, str]]) -> Dict[str, Any]:
    """Rank 0's "dcp" metadata: every flat key, in order, with its path and how it is
    stored."""
    keys = []
    for key, value in state.items():
        entry: Dict[str, Any] = {"key": key, "path": list(_path(key, mappings))}
        if key in names_of:
            name, prefix = names_of[key]
            entry.update(kind="pieces", name=name, prefix=prefix,
                         dtype=_dtype_name(value.dtype), shape=list(value.shape))
        else:
            entry.update(_small_entry(value))
        keys.append(entry)
    return {"format": DCP_FORMAT, "keys": keys}


# ---- Reading ----

class _Step:
    """A complete step: its manifest, its files, and rank 0's "dcp" record."""

    def __init__(self, directory: str) -> None:
        manifest_path = os.path.join(directory, "manifest.json")
        if not os.path.exists(manifest_path):
            raise FileNotFoundError(
                f"{directory} has no manifest.json: the step is not complete (the server "
                f"writes it once every rank committed) or this is not a step directory")
        with open(manifest_path) as f:
            self.manifest = json.load(f)
        self.directory = directory
        self.files = {fi["file"]: fi for fi in self.manifest["files"]}
        self._open: Dict[str, ck._SafetensorsFile] = {}
        rank0 = next((fi["file"] for fi in self.manifest["files"] if fi["rank"] == 0), None)
        meta = self.file(rank0).metadata if rank0 else {}
        if DCP_METADATA_KEY not in meta:
            raise ValueError(f"{directory} was not saved through zeroshard.torch.dcp (rank 0's "
                             f"file has no '{DCP_METADATA_KEY}' metadata); load it with zt.load")
        record = json.loads(meta[DCP_METADATA_KEY])
        if record.get("format") != DCP_FORMAT:
            raise ValueError(f"{directory}: DCP record format {record.get('format')!r}; "
                             f"expected {DCP_FORMAT!r}")
        self.keys: Dict[str, Dict[str, Any]] = {e["key"]: e for e in record["keys"]}

    def file(self, name: str) -> ck._SafetensorsFile:
        if name not in self._open:
            self._open[name] = ck._SafetensorsFile(os.path.join(self.directory, name))
        return self._open[name]

    def pieces(self, name: str) -> List[Dict[str, Any]]:
        pieces = self.manifest["pieces"].get(name)
        if not pieces:
            raise ValueError(f"{self.directory}: the manifest has no pieces of tensor '{name}'")
        return pieces

    def read_piece(self, entry: Mapping[str, Any], row_begin: int) -> torch.Tensor:
        """The stored piece of `entry` that starts at row `row_begin`, checked against its
        XXH64 (DATA_LOSS-like ValueError naming the file and tensor otherwise)."""
        for p in self.pieces(entry["name"]):
            if p["row_begin"] != row_begin:
                continue
            tensor = entry["prefix"] + p["tensor"]
            sf = self.file(p["file"])
            t = sf.read(tensor)
            want = self.files[p["file"]]["checksums"].get(tensor)
            got = _native.checksum_hex(t.contiguous().numpy())
            if want is None or got != want.lower():
                raise ValueError(f"{sf.path}: tensor '{tensor}' has XXH64 {got}; the manifest "
                                 f"records {want} (the file is damaged)")
            return t
        raise ValueError(f"{self.directory}: no piece of '{entry['name']}' starts at row "
                         f"{row_begin}")

    def metadata(self) -> Metadata:
        sdm: Dict[str, Any] = {}
        for key, e in self.keys.items():
            if e["kind"] == "pieces":
                shape = list(e["shape"])
                chunks = [ChunkStorageMetadata(
                    offsets=torch.Size([p["row_begin"]] + [0] * (len(shape) - 1)),
                    sizes=torch.Size([p["row_end"] - p["row_begin"]] + shape[1:]))
                    for p in self.pieces(e["name"])]
                sdm[key] = TensorStorageMetadata(TensorProperties(dtype=_dtype_of(e["dtype"])),
                                                 torch.Size(shape), chunks)
            elif e["kind"] == "tensor":
                shape = torch.Size(e["shape"])
                sdm[key] = TensorStorageMetadata(
                    TensorProperties(dtype=_dtype_of(e["dtype"])), shape,
                    [ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)])
            else:
                sdm[key] = BytesStorageMetadata()
        planner_data = {k: tuple(e["path"]) for k, e in self.keys.items()}
        return Metadata(state_dict_metadata=sdm, planner_data=planner_data,
                        storage_meta=StorageMeta(checkpoint_id=self.directory))

    def small_tensor(self, e: Mapping[str, Any]) -> torch.Tensor:
        raw = base64.b64decode(e["data"])
        if _native.checksum_hex(raw) != e["xxh64"].lower():
            raise ValueError(f"{self.directory}: entry '{e['key']}' does not match its XXH64")
        dtype, shape = _dtype_of(e["dtype"]), list(e["shape"])
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)

    def object_bytes(self, e: Mapping[str, Any]) -> bytes:
        """torch.save bytes of an object entry, made here: the value is decoded from JSON,
        or unpickled by the restricted unpickler (weights_only=True) and saved again."""
        if e["kind"] == "object":
            value = _decode_object(e["json"])
        elif e["kind"] == "pickle":
            raw = base64.b64decode(e["data"])
            if _native.checksum_hex(raw) != e["xxh64"].lower():
                raise ValueError(f"{self.directory}: entry '{e['key']}' does not match its XXH64")
            try:
                value = torch.load(io.BytesIO(raw), weights_only=True)
            except pickle.UnpicklingError as err:
                first = next((line.strip() for line in str(err).splitlines()
                              if "Unsupported global" in line), str(err).splitlines()[0])
                raise ValueError(
                    f"{self.directory}: entry '{e['key']}' is a pickled object that the "
                    f"restricted unpickler (torch.load(weights_only=True)) refuses: {first}. "
                    f"Save it as JSON-like values (numbers, strings, lists, dicts) or tensors, "
                    f"or load it yourself under torch.serialization.safe_globals") from None
        else:
            raise ValueError(f"{self.directory}: entry '{e['key']}' is a {e['kind']}, "
                             f"not an object")
        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue()


class StorageReader(_DcpReader):
    """Reads a complete zeroshard step written through StorageWriter, for dcp.load.

    step_or_path: the step directory (<root>/<job>/step-<N>), or a step number (or
    "latest", the newest complete step the server lists) with `root`, the server's
    checkpoint root as this machine sees it, and the job of the session (or `job=`).
    """

    def __init__(self, step_or_path: Union[int, str, os.PathLike], *,
                 root: Optional[str] = None, job: Optional[str] = None,
                 session: Any = None, client: Any = None) -> None:
        super().__init__()
        self._source = step_or_path
        self._root, self._job = root, job
        self._session, self._client = session, client
        self._step: Optional[_Step] = None

    def _directory(self) -> str:
        src = self._source
        if isinstance(src, (str, os.PathLike)) and str(src) != "latest":
            return os.fspath(src)
        if self._root is None:
            raise ValueError(f"StorageReader({src!r}) needs root= (the server's checkpoint root "
                             f"as this machine sees it), or pass the step directory")
        client = self._client
        if client is None:
            from zeroshard.torch.process_group import session
            client = (self._session or session()).client
        job = self._job or client.info.job
        if src == "latest":
            complete = [c for c in client.checkpoints(job) if c.get("complete")]
            if not complete:
                raise FileNotFoundError(f"job '{job}' has no complete checkpoint step")
            src = max(int(c["step"]) for c in complete)
        return os.path.join(self._root, job, f"step-{int(src)}")

    def _loaded(self) -> _Step:
        if self._step is None:
            self._step = _Step(self._directory())
        return self._step

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self._source = checkpoint_id
        self._step = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._loaded().metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        step = self._loaded()
        # A piece read once serves every request of this rank that falls in it.
        by_chunk: Dict[Tuple[str, Tuple[int, ...]], List[Any]] = {}
        for req in plan.items:
            index: MetadataIndex = req.storage_index
            by_chunk.setdefault((index.fqn, tuple(index.offset or ())), []).append(req)
        for (fqn, offset), reqs in by_chunk.items():
            e = step.keys.get(fqn)
            if e is None:
                raise ValueError(f"{step.directory} has no entry '{fqn}'")
            if reqs[0].type == LoadItemType.BYTE_IO:
                raw = step.object_bytes(e)
                for req in reqs:
                    planner.load_bytes(req, io.BytesIO(raw))
                continue
            if e["kind"] == "pieces":
                stored = step.read_piece(e, offset[0] if offset else 0)
            else:
                stored = step.small_tensor(e)
            for req in reqs:
                src = stored
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    src = src.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise ValueError(f"'{fqn}': a request of {list(req.lengths)} for a target "
                                     f"of {list(target.size())}")
                target.copy_(src)
                planner.commit_tensor(req, target)
            del stored
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return False
