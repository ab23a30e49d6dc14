#!/usr/bin/env python3
"""Runs every libFuzzer target (tests/fuzz) for a while and reports, per target:
executions, executions per second, coverage (libFuzzer's cov: edges and ft:
features at the end), the corpus it grew to, and findings (crash, leak,
timeout or out-of-memory inputs libFuzzer saved).

  bazel build --config=fuzz //tests/fuzz:all
  python3 tests/bench/fuzz_bench.py --minutes=10 [--targets=a,b] [--json_out=FILE]
      [--ledger=tests/fuzz/ledger.jsonl]
  python3 tests/bench/fuzz_bench.py --ledger_summary [--ledger=FILE] [--json]

One process per target, one after the other (-jobs is not used: the machine
is shared), or --parallel=N targets at a time. Each target starts from its
seed corpus (tests/fuzz/corpus/NAME) and grows a copy in a temporary
directory; --keep_corpus=DIR keeps the grown corpora. The CI smoke
(tests/run.sh) runs it with --seconds=30, a target per core. Exits 1 when
any target has a finding; the inputs are copied to --findings_dir (default
/tmp/zeroshard-fuzz-findings) so they can be added to the seed corpus as
regression inputs once fixed.

The ledger (tests/fuzz/ledger.jsonl, committed) is the fuzzing each target
has had: --ledger=FILE appends one JSON line per target per run (date,
commit, target, executions, seconds, exec/s, cov, ft, findings, CPU and
load), and --ledger_summary prints every target's totals from it (#29 asks
for 10 million executions per target with no open finding).
"""
import argparse
import concurrent.futures
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = [
    "safetensors_fuzzer",
    "shard_file_fuzzer",
    "manifest_fuzzer",
    "model_spec_fuzzer",
    "token_shard_fuzzer",
    "hf_config_fuzzer",
    "service_fuzzer",
    "server_fuzzer",
    "agent_fuzzer",
]
LEDGER = os.path.join(ROOT, "tests", "fuzz", "ledger.jsonl")
GOAL_EXECUTIONS = 10_000_000  # per target (#29)
FINDING_PREFIXES = ("crash-", "leak-", "timeout-", "oom-", "slow-unit-")


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_commit():
    """HEAD's hash, with "-dirty" when the tree has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def append_ledger(path, rows, commit):
    """One line per target of this run; `commit`: the tree's when it began."""
    load = os.getloadavg()[0]
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps({
                "date": r["started"], "commit": commit, "target": r["target"],
                "executions": r["executions"], "seconds": r["seconds"],
                "exec_per_s": r["exec_per_s"], "cpu_seconds": r["cpu_seconds"],
                "exec_per_cpu_s": r["exec_per_cpu_s"], "cov": r["cov"], "ft": r["ft"],
                "findings": len(r["findings"]),
                "finding_files": [os.path.basename(f) for f in r["findings"]],
                "cpu": cpu_name(), "load_at_end": round(load, 1),
                "libfuzzer_flags": r.get("libfuzzer_flags", []),
            }, sort_keys=True) + "\n")


def read_ledger(path):
    """The ledger's entries; a line that is not JSON is an error naming it."""
    entries = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not a JSON line ({e}); fix or remove that line")
    return entries


def summarize_ledger(entries):
    """Per target: runs, executions, seconds, the best cov/ft, findings."""
    totals = {}
    for e in entries:
        t = totals.setdefault(e["target"], {"target": e["target"], "runs": 0, "executions": 0,
                                            "seconds": 0.0, "cov": 0, "ft": 0, "findings": 0,
                                            "first": e["date"], "last": e["date"]})
        t["runs"] += 1
        t["executions"] += int(e["executions"])
        t["seconds"] += float(e["seconds"])
        t["cov"] = max(t["cov"], int(e.get("cov", 0)))
        t["ft"] = max(t["ft"], int(e.get("ft", 0)))
        t["findings"] += int(e.get("findings", 0))
        t["first"] = min(t["first"], e["date"])
        t["last"] = max(t["last"], e["date"])
    for t in totals.values():
        t["seconds"] = round(t["seconds"], 1)
        t["goal_met"] = t["executions"] >= GOAL_EXECUTIONS
    return [totals[k] for k in sorted(totals)]


def print_ledger_summary(path, as_json):
    totals = summarize_ledger(read_ledger(path)) if os.path.exists(path) else []
    if as_json:
        print(json.dumps({"ledger": path, "goal_executions": GOAL_EXECUTIONS, "targets": totals},
                         indent=1))
        return 0
    header = (f"{'target':<20} {'runs':>5} {'executions':>13} {'hours':>7} {'cov':>6} "
              f"{'ft':>7} {'findings':>8} {'10M':>4}  {'first':<20} {'last':<20}")
    print(f"fuzz ledger {path}: every run recorded, per target")
    print(header)
    print("-" * len(header))
    for t in totals:
        print(f"{t['target']:<20} {t['runs']:>5} {t['executions']:>13,} "
              f"{t['seconds'] / 3600:>7.2f} {t['cov']:>6} {t['ft']:>7} {t['findings']:>8} "
              f"{'yes' if t['goal_met'] else 'no':>4}  {t['first']:<20} {t['last']:<20}")
    missing = [t for t in TARGETS if t not in {x["target"] for x in totals}]
    if missing:
        print(f"no runs recorded for: {', '.join(missing)}")
    print("findings: inputs libFuzzer saved in those runs; whether each is fixed is in the "
          "commit that added it to tests/fuzz/corpus/<target>/")
    return 0


def fuzz_bin_dir():
    out = subprocess.run(["bazel", "info", "--config=fuzz", "bazel-bin"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    return os.path.join(out, "tests", "fuzz")


def parse_output(text):
    """The last status line's cov/ft/corp and the final stats."""
    result = {"cov": 0, "ft": 0, "corpus_units": 0, "executions": 0}
    for m in re.finditer(r"^#(\d+)\s+\S+\s+cov: (\d+) ft: (\d+) corp: (\d+)", text, re.M):
        result.update(executions=int(m.group(1)), cov=int(m.group(2)), ft=int(m.group(3)),
                      corpus_units=int(m.group(4)))
    m = re.search(r"stat::number_of_executed_units: (\d+)", text)
    if m:
        result["executions"] = int(m.group(1))
    m = re.search(r"stat::peak_rss_mb:\s+(\d+)", text)
    if m:
        result["peak_rss_mb"] = int(m.group(1))
    return result


def run_target(name, bin_dir, seconds, work, findings_dir, keep_corpus, extra_corpus,
               libfuzzer_flags=()):
    binary = os.path.join(bin_dir, name)
    seeds = os.path.join(ROOT, "tests", "fuzz", "corpus", name)
    corpus = os.path.join(work, "corpus", name)
    artifacts = os.path.join(work, "artifacts", name) + "/"
    os.makedirs(corpus)
    os.makedirs(artifacts)
    cmd = [binary, f"-max_total_time={seconds}", "-print_final_stats=1", "-timeout=10",
           "-rss_limit_mb=2048", "-malloc_limit_mb=2048", f"-artifact_prefix={artifacts}",
           *libfuzzer_flags, corpus, seeds]
    if extra_corpus and os.path.isdir(os.path.join(extra_corpus, name)):
        cmd.append(os.path.join(extra_corpus, name))
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    start = time.time()
    # The child's own resource usage (os.wait4), so that targets run side by
    # side (--parallel) each count only their own CPU time.
    with open(os.path.join(work, f"{name}.stderr"), "w+", errors="replace") as err:
        proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=err)
        killer = threading.Timer(seconds + 120, proc.kill)
        killer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read()
    wall = time.time() - start
    # On a shared machine the wall-clock rate says more about the load than
    # about the target: the CPU time the fuzzer got is kept beside it.
    cpu = usage.ru_utime + usage.ru_stime
    result = parse_output(stderr)
    found = sorted(f for f in os.listdir(artifacts) if f.startswith(FINDING_PREFIXES))
    saved = []
    for f in found:
        os.makedirs(findings_dir, exist_ok=True)
        dest = os.path.join(findings_dir, f"{name}-{f}")
        shutil.copy(os.path.join(artifacts, f), dest)
        saved.append(dest)
    if proc.returncode != 0 and not saved:
        saved.append(f"exit {proc.returncode} without an artifact")
    if saved:
        tail = "\n".join(stderr.splitlines()[-40:])
        print(f"--- {name}: libFuzzer's last lines\n{tail}", file=sys.stderr)
    if keep_corpus:
        dest = os.path.join(keep_corpus, name)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(corpus, dest)
    result.update(target=name, started=started, seconds=round(wall, 1), findings=saved,
                  exec_per_s=round(result["executions"] / wall) if wall > 0 else 0,
                  cpu_seconds=round(cpu, 1),
                  exec_per_cpu_s=round(result["executions"] / cpu) if cpu > 0 else 0,
                  libfuzzer_flags=list(libfuzzer_flags))
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=0, help="per target")
    p.add_argument("--seconds", type=int, default=0, help="per target (overrides --minutes)")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--bin_dir", default="", help="default: bazel info --config=fuzz bazel-bin")
    p.add_argument("--json_out", default="")
    p.add_argument("--keep_corpus", default="", help="copy the grown corpora to DIR/<target>")
    p.add_argument("--extra_corpus", default="",
                   help="also start from DIR/<target> (e.g. an earlier --keep_corpus)")
    p.add_argument("--libfuzzer_flag", action="append", default=[],
                   help="passed on to every target, e.g. -entropic=0 (libFuzzer's plainer "
                        "scheduler: about twice the executions per second for service_fuzzer, "
                        "whose feature bookkeeping otherwise takes a third of its time); "
                        "recorded with each run")
    p.add_argument("--parallel", type=int, default=1,
                   help="targets run at a time (default 1: one after the other)")
    p.add_argument("--findings_dir", default="/tmp/zeroshard-fuzz-findings")
    p.add_argument("--ledger", default="",
                   help=f"append one JSON line per target to FILE (the committed one: {LEDGER}); "
                        "with --ledger_summary, the file to read (default: that one)")
    p.add_argument("--ledger_summary", action="store_true",
                   help="print every target's totals from the ledger and exit")
    p.add_argument("--json", action="store_true", help="with --ledger_summary: JSON")
    args = p.parse_args()
    if args.ledger_summary:
        return print_ledger_summary(args.ledger or LEDGER, args.json)
    commit = git_commit()  # now: the tree may change while the targets run
    seconds = args.seconds or int(args.minutes * 60) or 60
    bin_dir = args.bin_dir or fuzz_bin_dir()
    targets = [t for t in args.targets.split(",") if t]
    print(f"fuzz_bench: {len(targets)} targets x {seconds} s, 1 job each, {args.parallel} at a "
          f"time, on {cpu_name()} "
          f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}), at {commit}",
          flush=True)
    if args.parallel < 1:
        print(f"fuzz_bench: --parallel={args.parallel}: expected 1 or more", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="zeroshard-fuzz-") as work:
        def one(name):
            row = run_target(name, bin_dir, seconds, work, args.findings_dir, args.keep_corpus,
                             args.extra_corpus, args.libfuzzer_flag)
            print(f"  {name}: {row['executions']:,} executions, cov {row['cov']}, "
                  f"{len(row['findings'])} findings", flush=True)
            return row
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
            rows = list(pool.map(one, targets))  # in the targets' order
    header = f"{'target':<20} {'seconds':>8} {'executions':>12} {'exec/s':>8} {'per cpu-s':>9} " \
             f"{'cov':>6} {'ft':>7} {'corpus':>7} {'findings':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['target']:<20} {r['seconds']:>8} {r['executions']:>12,} {r['exec_per_s']:>8,} "
              f"{r['exec_per_cpu_s']:>9,} {r['cov']:>6} {r['ft']:>7} {r['corpus_units']:>7} "
              f"{len(r['findings']):>8}")
    total = sum(r["executions"] for r in rows)
    bad = [f for r in rows for f in r["findings"]]
    print(f"total: {total:,} executions, {len(bad)} findings" +
          (f" (inputs in {args.findings_dir})" if bad else ""))
    if args.ledger:
        append_ledger(args.ledger, rows, commit)
        print(f"ledger: {len(rows)} lines appended to {args.ledger}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"cpu": cpu_name(), "seconds_per_target": seconds, "targets": rows}, f,
                      indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
