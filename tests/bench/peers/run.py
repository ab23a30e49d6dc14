"""zeroshard beside PyTorch's data-parallel tools, interleaved, on one machine.

  tests/bench/peers/run.sh [--rounds 3] [--steps 8] [--suite gpt,mlp,threads]
                           [--json_out FILE]

Per round, every configuration runs once, in the same order (ours and theirs
alternate), so that a busy spell of a shared machine hits all of them alike;
the figure reported is the median over rounds. Suites:
  gpt:     the gpt_bench GPT (6 blocks, d_model 384, 6 heads, context 128,
           batch 4 per rank), W = 2, one thread per rank: ours at stages 0-3,
           PyTorch DDP, DDP + ZeroRedundancyOptimizer, FSDP2 (fully_shard per
           block). Tokens/s over both ranks.
  mlp:     seed 001's model (20 x Linear(2000, 2000), batch 20 per rank, Adam),
           W = 2, one thread per rank: ours at stages 0-3, DDP, ZeRO-1, FSDP2
           (fully_shard per Linear). Step time and peak RSS per rank (/proc).
  threads: the GPT at W = 1, ours with --threads=1 and --threads=2.
  gpt2:    GPT-2 124M (12 blocks, d_model 768, 12 heads, vocabulary 50,257;
           --gpt2_layers for fewer blocks) at context 256, batch 4 per rank,
           W = 2, one thread per rank, AdamW: ours at stage 3 and
           transformers' GPT2LMHeadModel under DDP and FSDP2, all reading the
           same windows of one llm.c token shard this script writes (seeded
           uniform tokens). Ours also gives the time of its step's GEMMs (the
           matmul and LM-head kernels, from the run report): the step's
           distance from what the matrix products alone take.
Each row also gives the CPU time per step of one rank's process (all its
threads): on a machine others are using, a steadier figure than wall time.

Prints one table per suite with the ratios the issue (#15) asks about and
writes everything to --json_out.
"""
import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def load():
    return os.getloadavg()[0]


class Ours:
    """A shard_server and W shard_worker processes (as tests/testing/cluster)."""

    def __init__(self, bin_dir, tmp):
        self.bin_dir = bin_dir
        self.tmp = tmp
        port_file = os.path.join(tmp, "port")
        self.server = subprocess.Popen(
            [os.path.join(bin_dir, "shard_server/shard_server"), "--listen=127.0.0.1:0",
             "--port_file=" + port_file, "--state_dir=" + os.path.join(tmp, "state"),
             "--checkpoint_root=" + os.path.join(tmp, "ckpt")],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "server.log"), "w"))
        deadline = time.time() + 30
        while time.time() < deadline:
            if os.path.exists(port_file):
                text = open(port_file).read()
                if text.endswith("\n"):
                    self.address = "127.0.0.1:" + text.strip()
                    return
            if self.server.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("shard_server did not start; see " + tmp + "/server.log")

    def close(self):
        self.server.terminate()
        self.server.wait(timeout=10)

    def run(self, job, world, flags):
        procs = []
        for r in range(world):
            args = [os.path.join(self.bin_dir, "worker/shard_worker"), "--server=" + self.address,
                    "--job=" + job, f"--world_size={world}", f"--worker_id=w{r}",
                    "--host=127.0.0.1", f"--report={self.tmp}/{job}-{r}.json",
                    "--collective_timeout=600s",
                    # The peers keep no in-memory recovery snapshots; ours are off here too
                    # (they hold 4 copies of the rank's shard state in host memory: README
                    # "Recovery").
                    "--snapshot_every=0"] + flags
            log = open(f"{self.tmp}/{job}-w{r}.log", "w")
            procs.append(subprocess.Popen(args, stdout=log, stderr=log))
        rss = []
        for p in procs:
            # wait4: the child's own peak RSS, from the kernel.
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            rss.append(usage.ru_maxrss * 1024)
        for r, p in enumerate(procs):
            if p.returncode != 0:
                raise RuntimeError(f"{job} rank {r} exited {p.returncode}; see "
                                   f"{self.tmp}/{job}-w{r}.log")
        report = json.load(open(f"{self.tmp}/{job}-0.json"))
        kernels = report.get("kernel_breakdown_ms") or {}
        return {
            "gemm_ms": kernels.get("matmul", 0) + kernels.get("lm_head", 0),
            "step_ms": report["step_time_ms_median"],
            "step_cpu_ms": report.get("step_cpu_ms_median"),
            "items_per_second": report["items_per_second"],
            "peak_rss_bytes": rss,
            "model_state_bytes": report["memory"]["model_state_bytes"],
            "step_breakdown_ms": report["step_breakdown_ms"],
            "kernel_breakdown_ms": report.get("kernel_breakdown_ms"),
            "blas_kernel": report.get("compute", {}).get("blas_kernel"),
        }


def theirs(python, model, mode, world, threads, steps, extra=()):
    out = subprocess.run([python, os.path.join(HERE, "peer.py"), "--model", model, "--mode", mode,
                          "--world", str(world), "--threads", str(threads), "--steps", str(steps)]
                         + list(extra), capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"peer.py {model} {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


GPT = ["--model=gpt", "--layers=6", "--d_model=384", "--heads=6", "--context=128", "--batch=4",
       "--lr=3e-4"]
MLP = ["--model=mlp", "--layers=20", "--width=2000", "--activation=none", "--batch=20",
       "--optimizer=adam", "--lr=1e-4"]


GPT2_CONTEXT = 256
GPT2_BATCH = 4


def write_token_shard(path, count, vocab=50257, seed=124):
    """An llm.c token shard (worker/data/token_shards.h) of seeded uniform tokens."""
    import array
    import random
    import struct
    rng = random.Random(seed)
    header = struct.pack("<3i", 20240520, 1, count) + bytes(1024 - 12)
    tokens = array.array("H", (rng.randrange(vocab) for _ in range(count)))
    with open(path, "wb") as f:
        f.write(header)
        f.write(tokens.tobytes())


def gpt2_flags(layers, shard):
    return ["--model=gpt", f"--layers={layers}", "--d_model=768", "--heads=12",
            f"--context={GPT2_CONTEXT}", f"--batch={GPT2_BATCH}", "--vocab=50257",
            f"--data={shard}", f"--val_data={shard}", f"--val_tokens={GPT2_CONTEXT}",
            "--optimizer=adamw", "--lr=3e-4"]


def gpt2_peer_args(layers, shard):
    return ["--layers", str(layers), "--d_model", "768", "--heads", "12", "--context",
            str(GPT2_CONTEXT), "--batch", str(GPT2_BATCH), "--vocab", "50257", "--data", shard]


def configs(suite, steps, gpt2_layers=12, shard=""):
    """(name, kind, spec): kind 'ours' with worker flags, or 'theirs' with a mode."""
    if suite == "gpt2":
        rows = [("ours stage 3", "ours", (2, gpt2_flags(gpt2_layers, shard) +
                                          ["--stage=3", "--threads=1"]))]
        rows += [(f"torch {m}", "theirs", ("gpt2", m, 2, 1, gpt2_peer_args(gpt2_layers, shard)))
                 for m in ("ddp", "fsdp2")]
    elif suite == "gpt":
        rows = [(f"ours stage {s}", "ours", (2, GPT + [f"--stage={s}", "--threads=1"]))
                for s in range(4)]
        rows += [(f"torch {m}", "theirs", ("gpt", m, 2, 1)) for m in ("ddp", "zero", "fsdp2")]
    elif suite == "mlp":
        rows = [(f"ours stage {s}", "ours", (2, MLP + [f"--stage={s}", "--threads=1"]))
                for s in range(4)]
        rows += [(f"torch {m}", "theirs", ("mlp", m, 2, 1)) for m in ("ddp", "zero", "fsdp2")]
    else:
        rows = [(f"ours W=1 threads={t}", "ours", (1, GPT + ["--stage=0", f"--threads={t}"]))
                for t in (1, 2)]
    # Interleave ours and theirs: ours s0, torch ddp, ours s1, ...
    ours = [r for r in rows if r[1] == "ours"]
    peers = [r for r in rows if r[1] == "theirs"]
    mixed = []
    for i in range(max(len(ours), len(peers))):
        mixed += ours[i:i + 1] + peers[i:i + 1]
    return [(n, k, s) for n, k, s in mixed]


def human(b):
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin_dir", required=True, help="bazel-bin of a build of //worker:shard_worker")
    p.add_argument("--peers_python", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--suite", default="gpt,mlp,threads")
    p.add_argument("--json_out", default="")
    p.add_argument("--gpt2_layers", type=int, default=12, help="gpt2 suite: blocks (124M: 12)")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="zeroshard-peers-")
    shard = os.path.join(tmp, "gpt2_tokens.bin")
    if "gpt2" in args.suite.split(","):
        # Every row of every step a distinct window: steps x 2 ranks x batch.
        write_token_shard(shard, args.steps * 2 * GPT2_BATCH * GPT2_CONTEXT + 1)
    cluster = Ours(args.bin_dir, tmp)
    results = {"date": datetime.date.today().isoformat(), "host_cpus": os.cpu_count(), "suites": {},
               "gpt2_layers": args.gpt2_layers}
    try:
        for suite in args.suite.split(","):
            rows = configs(suite, args.steps, args.gpt2_layers, shard)
            runs = {name: [] for name, _, _ in rows}
            for rnd in range(args.rounds):
                for i, (name, kind, spec) in enumerate(rows):
                    before = load()
                    if kind == "ours":
                        world, flags = spec
                        r = cluster.run(f"{suite}-{rnd}-{i}", world, flags + [f"--steps={args.steps}"])
                    else:
                        r = theirs(args.peers_python, *spec[:4], args.steps, *spec[4:])
                        if "skipped" in r:
                            print(f"  {name}: {r['skipped']}", file=sys.stderr)
                            continue
                    r["load_before"] = before
                    runs[name].append(r)
                    print(f"[{suite} round {rnd + 1}/{args.rounds}] {name}: {r['step_ms']:.0f} ms "
                          f"(cpu {r.get('step_cpu_ms') or 0:.0f} ms), load {before:.1f}",
                          file=sys.stderr)
            summary = {}
            for name, rs in runs.items():
                if not rs:
                    continue
                summary[name] = {
                    "step_ms": statistics.median(r["step_ms"] for r in rs),
                    "step_cpu_ms": statistics.median(r.get("step_cpu_ms") or 0 for r in rs),
                    "items_per_second": statistics.median(r["items_per_second"] for r in rs),
                    "peak_rss_bytes": max(max(r["peak_rss_bytes"]) for r in rs),
                    "gemm_ms": statistics.median(r.get("gemm_ms", 0) for r in rs),
                    "load": [round(r["load_before"], 2) for r in rs],
                    "runs": rs,
                }
            results["suites"][suite] = summary
            print_machine(results, summary)
            print_suite(suite, summary)
    finally:
        cluster.close()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json_out}")


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def print_machine(results, summary):
    """The CPU and the BLAS kernels each side ran on (ours: OpenBLAS's corename from the
    workers' run report; PyTorch's: its build's BLAS and CPU capability)."""
    kernels = sorted({r["blas_kernel"] for s in summary.values() for r in s["runs"]
                      if r.get("blas_kernel")})
    results["machine"] = {"cpu": cpu_model(), "cores": os.cpu_count(), "blas_kernel": kernels}
    print(f"CPU {results['machine']['cpu']} ({os.cpu_count()} cores); BLAS kernels: "
          f"{', '.join(kernels) or 'unknown'}")


def print_suite(suite, s):
    unit = "rows/s" if suite == "mlp" else "tokens/s"
    print(f"\n{suite}: median of rounds (load before each run: see --json_out)")
    print(f"{'CONFIG':<22} {'STEP ms':>8} {'CPU ms':>7} {'GEMM ms':>8} {unit:>9} "
          f"{'PEAK RSS/RANK':>14}  LOAD")
    for name, r in s.items():
        gemm = f"{r['gemm_ms']:.0f}" if r.get("gemm_ms") else "-"
        print(f"{name:<22} {r['step_ms']:>8.0f} {r['step_cpu_ms']:>7.0f} {gemm:>8} "
              f"{r['items_per_second']:>9.1f} {human(r['peak_rss_bytes']):>14}  "
              f"{','.join(f'{x:.1f}' for x in r['load'])}")
    def ratio(a, b, field="step_ms"):
        if a in s and b in s and s[a][field] > 0:
            return s[b][field] / s[a][field]
        return None
    checks = []
    if suite == "gpt":
        checks = [("ours stage 3 vs torch fsdp2 (tokens/s, >= 1.5)", ratio("ours stage 3", "torch fsdp2")),
                  ("ours stage 3 vs torch ddp (tokens/s, >= 1.3)", ratio("ours stage 3", "torch ddp")),
                  ("same by CPU time vs fsdp2", ratio("ours stage 3", "torch fsdp2", "step_cpu_ms")),
                  ("same by CPU time vs ddp", ratio("ours stage 3", "torch ddp", "step_cpu_ms"))]
    elif suite == "gpt2":
        checks = [("ours stage 3 vs torch ddp (tokens/s)", ratio("ours stage 3", "torch ddp")),
                  ("ours stage 3 vs torch fsdp2 (tokens/s)", ratio("ours stage 3", "torch fsdp2")),
                  ("same by CPU time vs ddp", ratio("ours stage 3", "torch ddp", "step_cpu_ms")),
                  ("same by CPU time vs fsdp2", ratio("ours stage 3", "torch fsdp2", "step_cpu_ms"))]
        if s.get("ours stage 3", {}).get("gemm_ms"):
            checks.append(("ours stage 3 step / its GEMMs' time",
                           s["ours stage 3"]["step_ms"] / s["ours stage 3"]["gemm_ms"]))
    elif suite == "mlp":
        r1 = ratio("torch fsdp2", "ours stage 3")
        r2 = ratio("ours stage 0", "ours stage 3")
        checks = [("ours stage 3 step / fsdp2's (<= 0.35)", r1),
                  ("ours stage 3 step / our stage 0 (<= 1.05)", r2)]
        if "ours stage 3" in s and "torch fsdp2" in s:
            checks.append(("ours stage 3 peak RSS / fsdp2's (<= 0.3)",
                           s["ours stage 3"]["peak_rss_bytes"] / s["torch fsdp2"]["peak_rss_bytes"]))
            state = s["ours stage 3"]["runs"][0]["model_state_bytes"]
            checks.append(("ours stage 3 peak RSS / ZeRO model state (<= 1.25)",
                           s["ours stage 3"]["peak_rss_bytes"] / state))
    else:
        checks = [("threads=2 vs threads=1 (>= 1.7)",
                   ratio("ours W=1 threads=2", "ours W=1 threads=1"))]
    for label, value in checks:
        print(f"  {label}: {'n/a' if value is None else f'{value:.2f}'}")


if __name__ == "__main__":
    main()
