"""A torchrun worker: joins through zeroshard.torch.init_process_group() with no
arguments (the environment python -m zeroshard.torchrun gives it), all-reduces its
rank + 1 and writes what it saw to <out_dir>/rank-<RANK>.json."""
import json
import os
import sys

import torch
import torch.distributed as dist

import zeroshard.torch as zt

s = zt.init_process_group(backend="gloo", join_timeout=60)
t = torch.tensor([float(s.rank + 1)])
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank-{s.rank}.json"), "w") as f:
    json.dump({"rank": s.rank, "world_size": s.world_size, "sum": float(t),
               "torch_rank": int(os.environ["RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
               "local_rank": int(os.environ["LOCAL_RANK"]), "job": s.info.job,
               "zeroshard_file": zt.__file__}, f)
zt.shutdown()
