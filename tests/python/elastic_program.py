"""fsdp_program's model and data (FSDP2 on a 1-D mesh of every rank) under zt.elastic:
a dcp.save through the server every --save_every steps, an in-memory zt.Snapshot every
--snapshot_every steps (0: none), recovery in the process after a member's death.

Prints one JSON line per generation at its first step ({"first_step", "generation",
"world_size", "rank", "time"}), and at the end {"recoveries": [...]}; rank 0 writes
<--dump_dir>/full-final.pt (the full model and optimizer state dicts).

--pause_after N: the last rank of generation 1, once step N is done (saved and
snapshotted when due), touches <--dump_dir>/victim-ready and sleeps (the test kills it
there, so the recovery point is the same on every run).

--recovery_victim ID: the process with worker id ID, in generation 2 (the first
recovery), touches <--dump_dir>/recovery-victim-ready inside `build` (its new group
formed, the others in the restore's collectives) and sleeps: the test kills it there."""
import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn

from fsdp_program import build, dump, local_batch, shard


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--worker_id", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--dump_dir", required=True)
    ap.add_argument("--min_world", type=int, default=0)
    ap.add_argument("--rejoin_grace", type=float, default=0.0)
    ap.add_argument("--width", type=int, default=40)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save_every", type=int, default=2)
    ap.add_argument("--snapshot_every", type=int, default=0)
    ap.add_argument("--pause_after", type=int, default=0)
    ap.add_argument("--recovery_victim", default="")
    # torch's default: a collective blocked on a live survivor must end at the server's
    # verdict (the bridge's abort), not at this timeout.
    ap.add_argument("--collective_timeout", type=float, default=1800.0)
    args = ap.parse_args()

    import zeroshard.torch as zt
    zt.init_process_group(server=args.server, job=args.job, world_size=args.world,
                          backend="gloo", worker_id=args.worker_id, join_timeout=120,
                          timeout=timedelta(seconds=args.collective_timeout),
                          min_world_size=args.min_world, rejoin_grace=args.rejoin_grace)

    def make(session):
        if args.worker_id == args.recovery_victim and session.generation == 2:
            open(os.path.join(args.dump_dir, "recovery-victim-ready"), "w").close()
            time.sleep(600)
        model = build(args.width, args.layers)
        shard(model, str(session.world_size), session.world_size)
        return model, torch.optim.Adam(model.parameters(), lr=args.lr)

    state = zt.ElasticState(make, root=args.root, save_every=args.save_every,
                            snapshot_every=args.snapshot_every)
    generation = None
    loss_fn = nn.MSELoss()
    for step in zt.elastic(range(1, args.steps + 1), state=state):
        s = zt.session()
        if s.generation != generation:
            generation = s.generation
            print(json.dumps({"first_step": step, "generation": s.generation,
                              "world_size": s.world_size, "rank": s.rank,
                              "time": time.time()}), flush=True)
        victim = s.generation == 1 and s.rank == s.world_size - 1
        if victim and args.pause_after and step == args.pause_after + 1:
            open(os.path.join(args.dump_dir, "victim-ready"), "w").close()
            time.sleep(600)
        with state.guard():
            x, y = local_batch(step, s.rank, s.world_size, args.batch, args.width)
            state.optimizer.zero_grad()
            loss = loss_fn(state.model(x), y)
            loss.backward()
            state.optimizer.step()
            print(f"step {step} loss {float(loss.detach()):.6f}", flush=True)
    dump(state.model, state.optimizer, os.path.join(args.dump_dir, "full-final.pt"),
         zt.session().rank)
    print(json.dumps({"recoveries": state.recoveries}), flush=True)
    zt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
