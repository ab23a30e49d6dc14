"""Seed 001's model (an nn.Sequential of Linear layers, MSE loss, Adam) under FSDP2
(`fully_shard` on every Linear and the root) over a 1-D mesh ("--mesh 2") or HSDP's
2-D mesh ("--mesh 2x2": 2 replicas of a 2-rank shard group), bootstrapped through
zeroshard.torch. Deterministic data: step i's global batch of --batch samples is drawn
from seed i, and rank r of W takes rows [r B / W, (r + 1) B / W), so every world size
takes the same optimizer steps (up to rounding).

--save_at N: zt.save after step N (the step files on the server); with --dcp,
dcp.save of get_state_dict(model, optimizer) through zt.dcp.StorageWriter instead.
--resume PATH: zt.load a consolidated file or a step directory before --first_step;
with --dcp, dcp.load through zt.dcp.StorageReader(PATH) and set_state_dict.
--dump_at N (repeatable): rank 0 writes <--dump_dir>/full-<N>.pt, the full model and
optimizer state dicts (get_model_state_dict / get_optimizer_state_dict with
full_state_dict=True) after step N; N = first_step - 1 dumps what was loaded."""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def local_batch(step: int, rank: int, world: int, batch: int, width: int):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    a, b = rank * batch // world, (rank + 1) * batch // world
    return x[a:b], y[a:b]


def shard(model: nn.Sequential, mesh_arg: str, world: int) -> None:
    dims = tuple(int(d) for d in mesh_arg.split("x"))
    if len(dims) == 1:
        mesh = init_device_mesh("cpu", dims)
    else:
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("replicate", "shard"))
    assert mesh.size() == world, f"--mesh {mesh_arg} for {world} ranks"
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def dump(model, optimizer, path: str, rank: int) -> None:
    full = StateDictOptions(full_state_dict=True)
    state = {"model": get_model_state_dict(model, options=full),
             "optim": get_optimizer_state_dict(model, optimizer, options=full)}
    if rank == 0:
        torch.save(state, path)


def save(step: int, model, optimizer, use_dcp: bool) -> None:
    import zeroshard.torch as zt
    if not use_dcp:
        print(f"saved {zt.save(step, model, optimizer)}", flush=True)
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    writer = zt.dcp.StorageWriter(step)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
    print(f"saved {writer.result}", flush=True)


def resume(path: str, model, optimizer, use_dcp: bool) -> None:
    import zeroshard.torch as zt
    if not use_dcp:
        zt.load(path, model, optimizer)
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=zt.dcp.StorageReader(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--worker_id", required=True)
    ap.add_argument("--mesh", default="")  # default: 1-D over every rank
    ap.add_argument("--width", type=int, default=40)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--first_step", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)  # last step
    ap.add_argument("--save_at", type=int, default=0)
    ap.add_argument("--resume", default="")
    ap.add_argument("--dcp", action="store_true")
    ap.add_argument("--dump_at", type=int, action="append", default=[])
    ap.add_argument("--dump_dir", default="")
    args = ap.parse_args()

    import zeroshard.torch as zt
    s = zt.init_process_group(server=args.server, job=args.job, world_size=args.world,
                              backend="gloo", worker_id=args.worker_id, join_timeout=60,
                              timeout=timedelta(seconds=60))
    rank, world = s.rank, s.world_size
    model = build(args.width, args.layers)
    shard(model, args.mesh or str(world), world)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.resume:
        resume(args.resume, model, optimizer, args.dcp)
    if args.first_step - 1 in args.dump_at:
        dump(model, optimizer, os.path.join(args.dump_dir, f"full-{args.first_step - 1}.pt"), rank)
    loss_fn = nn.MSELoss()
    for step in range(args.first_step, args.steps + 1):
        x, y = local_batch(step, rank, world, args.batch, args.width)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {float(loss):.6f}", flush=True)
        if step == args.save_at:
            save(step, model, optimizer, args.dcp)
        if step in args.dump_at:
            dump(model, optimizer, os.path.join(args.dump_dir, f"full-{step}.pt"), rank)
    zt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
