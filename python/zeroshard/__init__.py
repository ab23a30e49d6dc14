"""zeroshard for Python: the shard server's client (join, heartbeats, the job's
key-value store, shard plans, checkpoints, consolidation) over the C++ client
library, and `zeroshard.torch` for PyTorch programs (a torch.distributed Store,
init_process_group, failure checks, sharded checkpoints).

    import zeroshard
    client = zeroshard.Client("10.0.0.1:7070", token_file="/etc/zeroshard/token")
    me = client.join("my-job", world_size=4, worker_id="host-a/0")
    print(me.rank, me.world_size, me.generation)
"""
from zeroshard.errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                              FailedPrecondition, GenerationChanged, Internal, InvalidArgument,
                              NotFound, PermissionDenied, ResourceExhausted, Unauthenticated,
                              Unavailable, ZeroshardError)
from zeroshard.client import Client, JoinInfo, Member

__all__ = [
    "Client", "JoinInfo", "Member", "ZeroshardError", "GenerationChanged", "Unauthenticated",
    "DeadlineExceeded", "NotFound", "InvalidArgument", "FailedPrecondition", "Aborted",
    "AlreadyExists", "Cancelled", "DataLoss", "Internal", "PermissionDenied",
    "ResourceExhausted", "Unavailable",
]
