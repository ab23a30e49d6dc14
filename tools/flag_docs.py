#!/usr/bin/env python3
"""Prints Markdown tables of every binary's flags, read from the binaries'
own --helpfull, so README's flag reference stays true.

usage: tools/flag_docs.py  (after bazel build //shard_server //worker:shard_worker //client:shardctl)
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARIES = [
    ("shard_server", "bazel-bin/shard_server/shard_server"),
    ("shard_worker", "bazel-bin/worker/shard_worker"),
    ("shardctl", "bazel-bin/client/shardctl"),
]


def flags_of(path):
    out = subprocess.run([os.path.join(ROOT, path), "--helpfull"], capture_output=True,
                         text=True).stdout
    flags, section_ours = [], False
    entry = None
    for line in out.splitlines():
        m = re.match(r"\s+Flags from (\S+):", line)
        if m:
            section_ours = not m.group(1).startswith("./absl") and "absl/" not in m.group(1)
            continue
        if not section_ours:
            continue
        m = re.match(r"\s{4}--(\w+) \((.*)", line)
        if m:
            entry = [m.group(1), m.group(2)]
            flags.append(entry)
        elif entry is not None and line.startswith("      "):
            entry[1] += " " + line.strip()
    rows = []
    for name, text in flags:
        m = re.match(r"(.*)\);\s*default: (.*);$", text)
        meaning, default = (m.group(1), m.group(2)) if m else (text, "")
        rows.append((name, default, meaning.replace("|", "\\|")))
    return sorted(rows)


def main():
    for name, path in BINARIES:
        print(f"#### `{name}`\n")
        print("| flag | default | meaning |")
        print("|---|---|---|")
        for flag, default, meaning in flags_of(path):
            print(f"| `--{flag}` | `{default}` | {meaning} |")
        print()


if __name__ == "__main__":
    sys.exit(main())
