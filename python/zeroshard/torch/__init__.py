"""zeroshard for PyTorch programs.

    import zeroshard.torch as zt
    s = zt.init_process_group(server="10.0.0.1:7070", job="run-7", world_size=8,
                              backend="nccl", token_file="/etc/zeroshard/token")
    # ... DDP / ZeroRedundancyOptimizer as usual; once per step:
    with zt.failure_guard():
        zt.check()
        ...
    zt.save(step, model, optimizer)      # sharded, committed; `shardctl consolidate` merges
    # or, with torch.distributed.checkpoint:
    dcp.save(state_dict, storage_writer=zt.dcp.StorageWriter(step))
    zt.shutdown()
"""
import torch as _torch


def _require_torch_2():
    """zeroshard.torch uses torch.distributed.checkpoint, DTensor and FSDP2: PyTorch 2.
    An older torch (Debian's python3-torch is 1.13) would fail further in with a
    ModuleNotFoundError that names none of this (#44 finding 10)."""
    version = _torch.__version__
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        return  # a build with an unusual version string: let the imports decide
    if major < 2:
        raise ImportError(
            f"zeroshard.torch needs PyTorch 2 or later (torch.distributed.checkpoint, DTensor, "
            f"FSDP2); this Python has torch {version} from {_torch.__file__}. Install PyTorch 2 "
            f"(pip install 'torch>=2') in a virtual environment and run from there.")


_require_torch_2()

# The imports below need PyTorch 2 (checked above).
from zeroshard.errors import GenerationChanged  # noqa: E402
from zeroshard.torch.store import Store  # noqa: E402
from zeroshard.torch.process_group import (  # noqa: E402
    BLOCKED_EXIT_CODE, Session, check, failure_guard, init_process_group, install_step_check,
    rejoin, report, session, shutdown)
from zeroshard.torch.checkpoint import load, model_spec, save  # noqa: E402
from zeroshard.torch import dcp  # noqa: E402
from zeroshard.torch.dcp import StorageReader, StorageWriter  # noqa: E402
from zeroshard.torch.elastic import ElasticState, elastic  # noqa: E402
from zeroshard.torch.snapshot import Snapshot  # noqa: E402

__all__ = [
    "Store", "Session", "init_process_group", "session", "check", "failure_guard",
    "install_step_check", "report", "shutdown", "save", "load", "model_spec",
    "GenerationChanged", "BLOCKED_EXIT_CODE", "dcp", "StorageWriter", "StorageReader",
    "rejoin", "elastic", "ElasticState", "Snapshot",
]
