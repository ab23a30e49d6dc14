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
from zeroshard.errors import GenerationChanged
from zeroshard.torch.store import Store
from zeroshard.torch.process_group import (BLOCKED_EXIT_CODE, Session, check, failure_guard,
                                           init_process_group, install_step_check, rejoin,
                                           report, session, shutdown)
from zeroshard.torch.checkpoint import load, model_spec, save
from zeroshard.torch import dcp
from zeroshard.torch.dcp import StorageReader, StorageWriter
from zeroshard.torch.elastic import ElasticState, elastic
from zeroshard.torch.snapshot import Snapshot

__all__ = [
    "Store", "Session", "init_process_group", "session", "check", "failure_guard",
    "install_step_check", "report", "shutdown", "save", "load", "model_spec",
    "GenerationChanged", "BLOCKED_EXIT_CODE", "dcp", "StorageWriter", "StorageReader",
    "rejoin", "elastic", "ElasticState", "Snapshot",
]
