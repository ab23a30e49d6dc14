"""Checkpointing seed 001's model under FSDP2 at W = 2 (issue #26): torch's own DCP path
beside zeroshard's, seconds and peak RSS of every process.

  torch DCP      dcp.save(FileSystemWriter(dir)) on both ranks, then DCP's own
                 consolidation to one file (format_utils.dcp_to_torch_save) in a process
  zeroshard DCP  dcp.save(storage_writer=zt.dcp.StorageWriter(step, root=...)) on both
                 ranks (committed through the server), then `shardctl consolidate` to one
                 safetensors file (merged by the server, streamed to shardctl)
  zt.save        zt.save(step, model, optimizer) on both ranks, then the same consolidate

Model: nn.Sequential of --layers x Linear(--width, --width) (seed 001: 20 x 2000), every
Linear and the root fully_shard-ed over a 1-D mesh of 2 CPU ranks (Gloo), Adam after one
step (so the moments exist). Peak RSS: each rank's VmHWM during its save (reset through
/proc/self/clear_refs just before), the server's during the save and during the merge
(reset through /proc/<pid>/clear_refs), and the consolidating process's whole-life peak
(ru_maxrss from wait4). Every mode writes to the same file system (--dir).

    bazel build //python:zeroshard //shard_server //client:shardctl
    ~/.cache/zeroshard/venv-torch2/bin/python tests/bench/dcp_bench.py \
        [--width=2000 --layers=20] [--json_out=out.json]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import harness  # noqa: E402
from harness import PYTHON, Procs, Server, binary, free_port  # noqa: E402

MODES = ("torch DCP", "zeroshard DCP", "zt.save")
JOB = {"zeroshard DCP": "bench-dcp", "zt.save": "bench-save"}
STEP = 1


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak(pid="self"):
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def rank_main(args):
    """One rank of a mode: train one step, save, print a JSON line."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from datetime import timedelta
    from torch.distributed.checkpoint.state_dict import get_state_dict
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    from fsdp_program import build, shard
    rank = args.rank
    if args.mode == "torch DCP":
        store = dist.TCPStore("127.0.0.1", args.port, 2, rank == 0, timedelta(seconds=300))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    else:
        import zeroshard.torch as zt
        zt.init_process_group(server=args.server, job=JOB[args.mode], world_size=2,
                              worker_id=f"w{rank}", timeout=timedelta(seconds=300))
    model = build(args.width, args.layers)
    shard(model, "2", 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    nn.MSELoss()(model(torch.randn(8, args.width, generator=g)),
                 torch.randn(8, args.width, generator=g)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    rss = status_kib("self", "VmRSS")
    reset_peak()
    start = time.time()
    if args.mode == "zt.save":
        zt.save(STEP, model, opt, root=args.root)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        if args.mode == "torch DCP":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(args.out))
        else:
            dcp.save(state, storage_writer=zt.dcp.StorageWriter(STEP, root=args.root))
    seconds = time.time() - start
    peak = status_kib("self", "VmHWM")
    dist.barrier()
    print(json.dumps({"rank": rank, "torch": torch.__version__, "seconds": seconds,
                      "rss_before_mib": rss / 1024,
                      "peak_mib": peak / 1024, "growth_mib": (peak - rss) / 1024}), flush=True)
    os._exit(0)


def run_child(argv):
    """Runs argv to the end; (seconds, peak RSS MiB over its life, output)."""
    start = time.time()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{argv[:3]} exited {p.returncode}: {out[-2000:]}")
    return time.time() - start, usage.ru_maxrss / 1024, out


def bench_mode(mode, server, d, args):
    out_dir = os.path.join(d, "torch-dcp")
    procs = Procs(d)
    port = free_port()
    server_rss = status_kib(server.proc.pid, "VmRSS")
    reset_peak(server.proc.pid)
    for r in range(2):
        procs.start([PYTHON, os.path.abspath(__file__), "--rank", str(r), "--mode", mode,
                     "--server", server.address, "--port", str(port), "--root",
                     server.checkpoint_root, "--out", out_dir, "--width", str(args.width),
                     "--layers", str(args.layers)], f"{mode.replace(' ', '_')}-{r}")
    codes = procs.wait_all(1800)
    if any(codes):
        raise RuntimeError(f"{mode}: exit codes {codes}\n{procs.output(0)[-2000:]}\n"
                           f"{procs.output(1)[-2000:]}")
    ranks = [json.loads(procs.output(i).strip().splitlines()[-1]) for i in range(2)]
    result = {"ranks": ranks, "save_seconds": max(r["seconds"] for r in ranks)}
    if mode == "torch DCP":
        result["server_save_growth_mib"] = None
        out = os.path.join(d, "torch-consolidated.pt")
        code = ("import sys; from torch.distributed.checkpoint.format_utils import "
                "dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])")
        seconds, peak, _ = run_child([PYTHON, "-c", code, out_dir, out])
        result.update(consolidate_seconds=seconds, consolidator="dcp_to_torch_save",
                      consolidator_peak_mib=peak, server_merge_growth_mib=None,
                      out_mib=os.path.getsize(out) / 2**20)
        os.remove(out)
        shutil.rmtree(out_dir)
        return result
    result["server_save_growth_mib"] = (status_kib(server.proc.pid, "VmHWM") - server_rss) / 1024
    out = os.path.join(d, f"{JOB[mode]}.safetensors")
    server_rss = status_kib(server.proc.pid, "VmRSS")
    reset_peak(server.proc.pid)
    seconds, peak, _ = run_child([binary("client/shardctl"), f"--server={server.address}",
                                  "consolidate", f"--job={JOB[mode]}", f"--step={STEP}",
                                  f"--out={out}"])
    result.update(consolidate_seconds=seconds, consolidator="shardctl consolidate",
                  consolidator_peak_mib=peak,
                  server_merge_growth_mib=(status_kib(server.proc.pid, "VmHWM") - server_rss)
                  / 1024, out_mib=os.path.getsize(out) / 2**20)
    os.remove(out)
    return result


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--dir", default="", help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--json_out", default="")
    # One rank of a mode (the benchmark starts these itself).
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--mode", default="")
    ap.add_argument("--server", default="")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--root", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.rank >= 0:
        return rank_main(args)

    # No torch in this process: a child's ru_maxrss starts from its parent's RSS at fork.
    d = tempfile.mkdtemp(prefix="dcp-bench-", dir=args.dir or None)
    server = Server(d, ["--heartbeat_timeout_ms=60000"])
    results = {}
    try:
        for mode in MODES:
            results[mode] = bench_mode(mode, server, d, args)
            print(f"{mode}: done", flush=True)
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)
    # What a consolidating Python process costs before it reads a byte.
    import_seconds, import_peak, _ = run_child([PYTHON, "-c", "import torch.distributed.checkpoint"])
    params = args.width * args.width * args.layers + args.width * args.layers
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(),
               "torch": results["torch DCP"]["ranks"][0]["torch"],
               "load_after": os.getloadavg()[0], "torch_import_seconds": import_seconds,
               "torch_import_peak_mib": import_peak}
    print(f"\nCPU {machine['cpu']} ({machine['cores']} cores), torch {machine['torch']}; "
          f"no GEMM is timed here, so the BLAS kernel does not matter; load average "
          f"{machine['load_after']:.1f} at the end")
    print(f"Seed 001's model under FSDP2, W = 2: {args.layers} x Linear({args.width}, "
          f"{args.width}) = {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB, "
          f"Adam moments {params * 8 / 2**20:.0f} MiB)")
    print(f"{'path':14} {'save s':>7} {'merge s':>8} {'total s':>8} {'rank 0 peak MiB':>16} "
          f"{'rank 1 peak MiB':>16} {'server +save':>12} {'server +merge':>13} "
          f"{'merger peak':>12} {'file MiB':>9}")
    for mode, r in results.items():
        ranks = [f"{x['peak_mib']:.0f} (+{x['growth_mib']:.0f})" for x in r["ranks"]]
        print(f"{mode:14} {r['save_seconds']:7.1f} {r['consolidate_seconds']:8.1f} "
              f"{r['save_seconds'] + r['consolidate_seconds']:8.1f} {ranks[0]:>16} "
              f"{ranks[1]:>16} {fmt(r['server_save_growth_mib'], '8.0f'):>8} MiB "
              f"{fmt(r['server_merge_growth_mib'], '9.0f'):>9} MiB "
              f"{r['consolidator_peak_mib']:8.0f} MiB {r['out_mib']:9.0f}")
    print(f"rank peaks: VmHWM during the save (+ its growth over the RSS before); server +: "
          f"growth of its peak over its RSS before; merger: the consolidating process's "
          f"peak (dcp_to_torch_save in Python, or shardctl receiving the server's stream); "
          f"a Python process importing torch.distributed.checkpoint alone takes "
          f"{import_seconds:.1f} s and {import_peak:.0f} MiB here")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"machine": machine, "width": args.width, "layers": args.layers,
                       "results": results}, f, indent=1)
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
