"""Seed 001's program (DDP + ZeroRedundancyOptimizer over Adam, an nn.Sequential of
Linear layers, MSE loss) at a width the tests choose, bootstrapped through
zeroshard.torch or a plain TCPStore. Deterministic data: step i of rank r is drawn
from seed 1000 * i + r, so a 1-process run over the concatenated batches takes the
same steps.

Writes --out (JSON): rank, world_size, the parameter sum after every step, and with
--final the final parameters (torch.save of the state dict)."""
import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def batch(step: int, rank: int, n: int, width: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", choices=["zeroshard", "tcp", "none"], default="zeroshard")
    ap.add_argument("--server", default="")
    ap.add_argument("--job", default="seed001")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--worker_id", default="")
    ap.add_argument("--rank", type=int, default=0)  # tcp only
    ap.add_argument("--tcp_port", type=int, default=0)
    ap.add_argument("--token_file", default=None)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--first_step", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)  # last step
    ap.add_argument("--save_at", type=int, default=0)
    ap.add_argument("--save_root", default=None)
    ap.add_argument("--resume", default="")
    ap.add_argument("--data_world", type=int, default=2)  # ranks whose batches make a step
    ap.add_argument("--step_sleep", type=float, default=0.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--final", default="")
    args = ap.parse_args()

    import zeroshard
    import zeroshard.torch as zt

    if args.store == "zeroshard":
        try:
            s = zt.init_process_group(server=args.server, job=args.job, world_size=args.world,
                                      backend="gloo", worker_id=args.worker_id,
                                      token_file=args.token_file, join_timeout=60,
                                      timeout=timedelta(seconds=60))
        except zeroshard.ZeroshardError as e:
            print(json.dumps({"error": type(e).__name__, "code": e.code, "message": e.message}),
                  flush=True)
            return 4
        rank, world = s.rank, s.world_size
    elif args.store == "tcp":
        store = dist.TCPStore("127.0.0.1", args.tcp_port, args.world, args.rank == 0,
                              timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
        rank, world = args.rank, args.world
    else:
        rank, world = 0, 1

    model = build(args.width, args.layers)
    if world > 1 or args.store != "none":
        ddp = DDP(model)
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                            lr=args.lr)
    else:
        ddp = model
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.resume:
        zt.load(args.resume, model, optimizer)
    if args.store == "zeroshard":
        zt.install_step_check(optimizer)
    loss_fn = nn.MSELoss()
    sums = []
    for step in range(args.first_step, args.steps + 1):
        if world > 1 or args.store != "none":
            x, y = batch(step, rank, args.batch, args.width)
        else:  # one process takes every rank's batch
            parts = [batch(step, r, args.batch, args.width) for r in range(args.data_world)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        try:
            if args.store == "zeroshard":
                with zt.failure_guard():
                    optimizer.zero_grad()
                    loss = loss_fn(ddp(x), y)
                    loss.backward()
                    optimizer.step()
                zt.report(step=step, loss=float(loss))
            else:
                optimizer.zero_grad()
                loss = loss_fn(ddp(x), y)
                loss.backward()
                optimizer.step()
        except zeroshard.GenerationChanged as e:
            print(json.dumps({"error": "GenerationChanged", "message": e.message,
                              "unix_time": time.time(), "step": step}), flush=True)
            # The process group has a dead peer: tearing it down at exit may hang or
            # abort in torch's own threads; leave now, as an elastic worker would.
            sys.stderr.flush()
            os._exit(3)
        sums.append(float(sum(p.sum() for p in model.parameters())))
        print(f"step {step} loss {float(loss):.6f} params sum is: {sums[-1]}", flush=True)
        if args.save_at == step:
            result = zt.save(step, ddp, optimizer, root=args.save_root)
            print(f"saved {json.dumps(result)}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rank": rank, "world_size": world, "sums": sums}, f)
    if args.final and rank == 0:
        torch.save(model.state_dict(), args.final)
    if args.store == "zeroshard":
        zt.shutdown()
    elif args.store == "tcp":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
