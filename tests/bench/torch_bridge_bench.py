"""The PyTorch bridge's numbers (issue #16):

1. zeroshard.torch.Store against torch's TCPStore on this machine: the latency of set,
   get and add (median and p99, one caller) and their ops/s, over loopback.
2. The memory of consolidating seed 001's optimizer state (DDP + ZeroRedundancyOptimizer
   over Adam, 2 ranks): through zeroshard (each rank saves its pieces with
   zeroshard.torch.save, the server merges with `shardctl consolidate`) against
   ZeroRedundancyOptimizer.consolidate_state_dict(to=0) + torch.save on rank 0. Peak
   RSS growth during the save of each rank (Linux: peak reset through
   /proc/self/clear_refs) and of the server during the merge.

    bazel build //python:zeroshard //shard_server //client:shardctl
    ~/.cache/zeroshard/venv-torch2/bin/python tests/bench/torch_bridge_bench.py [--width=2000 --layers=20] [--json=out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import harness  # noqa: E402
from harness import PYTHON, Procs, Server, binary, free_port  # noqa: E402


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak(pid="self"):
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def time_ops(fn, n):
    lat = []
    start = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    lat.sort()
    return {"median_us": statistics.median(lat) * 1e6, "p99_us": lat[int(0.99 * len(lat))] * 1e6,
            "ops_per_s": n / total}


def store_bench(server, n):
    import torch.distributed as dist
    import zeroshard
    import zeroshard.torch as zt
    c = zeroshard.Client(server.address)
    c.join("store-bench", 1, "w0", timeout=30)
    stores = {"zeroshard.torch.Store": zt.Store(c),
              "TCPStore": dist.TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=30))}
    value = b"x" * 64
    rows = []
    for name, s in stores.items():
        for s_op, fn in (("set", lambda i: s.set(f"k{i % 100}", value)),
                         ("get", lambda i: s.get(f"k{i % 100}")),
                         ("add", lambda i: s.add("counter", 1))):
            fn(0)
            r = time_ops(fn, n)
            rows.append(dict(store=name, op=s_op, **r))
    c.leave()
    return rows


SAVE_PROGRAM = r'''
import os, sys, json, time, torch, torch.nn as nn, torch.distributed as dist
from datetime import timedelta
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
mode, server, width, layers, out, port, rank = sys.argv[1:8]
width, layers, rank = int(width), int(layers), int(rank)
def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"): return int(line.split()[1])
if mode == "zeroshard":
    import zeroshard.torch as zt
    s = zt.init_process_group(server=server, job="mem", world_size=2, worker_id=f"w{rank}")
else:
    store = dist.TCPStore("127.0.0.1", int(port), 2, rank == 0, timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
ddp = DDP(model)
opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
nn.MSELoss()(ddp(torch.randn(20, width)), torch.randn(20, width)).backward()
opt.step()
opt.zero_grad(set_to_none=True)
dist.barrier()
rss = status_kib("VmRSS"); open("/proc/self/clear_refs", "w").write("5")
t = time.time()
if mode == "zeroshard":
    zt.save(1, ddp, opt)
else:
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out)
seconds = time.time() - t
peak = status_kib("VmHWM")
print(json.dumps({"rank": rank, "rss_before_mib": rss / 1024, "peak_during_save_mib": peak / 1024,
                  "growth_mib": (peak - rss) / 1024, "seconds": seconds}), flush=True)
dist.barrier()
os._exit(0)
'''


def memory_bench(server, d, width, layers):
    prog = os.path.join(d, "save_program.py")
    with open(prog, "w") as f:
        f.write(SAVE_PROGRAM)
    results = {}
    for mode in ("zeroshard", "torch"):
        procs = Procs(d)
        port = free_port()
        for r in range(2):
            procs.start([PYTHON, prog, mode, server.address, str(width), str(layers),
                         os.path.join(d, "torch.pt"), str(port), str(r)], f"{mode}{r}")
        codes = procs.wait_all(900)
        if any(codes):
            raise RuntimeError(f"{mode}: {codes} {procs.output(0)[-2000:]} {procs.output(1)[-2000:]}")
        ranks = [json.loads(procs.output(i).strip().splitlines()[-1]) for i in range(2)]
        results[mode] = {"ranks": ranks}
        if mode == "zeroshard":
            reset_peak(server.proc.pid)
            rss = status_kib(server.proc.pid, "VmRSS")
            out = os.path.join(d, "mem.safetensors")
            t = time.time()
            subprocess.run([binary("client/shardctl"), f"--server={server.address}",
                            "consolidate", "--job=mem", "--step=1", f"--out={out}"],
                           check=True, capture_output=True)
            results[mode]["server"] = {
                "rss_before_mib": rss / 1024,
                "peak_during_merge_mib": status_kib(server.proc.pid, "VmHWM") / 1024,
                "seconds": time.time() - t, "file_mib": os.path.getsize(out) / 2**20}
            os.remove(out)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=5000)
    ap.add_argument("--width", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="torch-bridge-bench-")
    server = Server(d)
    try:
        stores = store_bench(server, args.ops)
        mem = memory_bench(server, d, args.width, args.layers)
    finally:
        server.stop()
    print(f"Store latency, {args.ops} ops each, one caller, loopback, 64-byte values")
    print(f"{'store':24} {'op':4} {'median us':>10} {'p99 us':>9} {'ops/s':>9}")
    for r in stores:
        print(f"{r['store']:24} {r['op']:4} {r['median_us']:10.1f} {r['p99_us']:9.1f} "
              f"{r['ops_per_s']:9.0f}")
    params = args.width * args.width * args.layers + args.width * args.layers
    print(f"\nSaving seed 001's state (nn.Sequential of {args.layers} x Linear({args.width}, "
          f"{args.width}): {params / 1e6:.1f} M parameters, {params * 4 / 2**20:.0f} MiB; "
          f"Adam moments {params * 8 / 2**20:.0f} MiB), 2 ranks")
    print(f"{'how':44} {'rank 0 +MiB':>11} {'rank 1 +MiB':>11} {'server +MiB':>11} {'s':>6}")
    z, t = mem["zeroshard"], mem["torch"]
    print(f"{'zeroshard.torch.save + shardctl consolidate':44} "
          f"{z['ranks'][0]['growth_mib']:11.0f} {z['ranks'][1]['growth_mib']:11.0f} "
          f"{z['server']['peak_during_merge_mib'] - z['server']['rss_before_mib']:11.0f} "
          f"{max(r['seconds'] for r in z['ranks']) + z['server']['seconds']:6.1f}")
    print(f"{'consolidate_state_dict(to=0) + torch.save':44} "
          f"{t['ranks'][0]['growth_mib']:11.0f} {t['ranks'][1]['growth_mib']:11.0f} "
          f"{'-':>11} {max(r['seconds'] for r in t['ranks']):6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"store": stores, "memory": mem, "width": args.width,
                       "layers": args.layers}, f, indent=1)


if __name__ == "__main__":
    main()
