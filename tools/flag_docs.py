#!/usr/bin/env python3
"""Writes docs/flags.md: Markdown tables of every binary's flags, read from the
binaries' own --helpfull, so the flag reference stays true.

usage:
  tools/flag_docs.py > docs/flags.md
      (after bazel build //shard_server //worker:shard_worker //client:shardctl
       //agent:shard_agent)
  tools/flag_docs.py --check docs/flags.md [--binary NAME=PATH ...]
      exits 1 naming the first difference when the file is not what the
      binaries say (//tests/docs:flags_doc_test runs this)
"""
import argparse
import difflib
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARIES = [
    ("shard_server", "bazel-bin/shard_server/shard_server"),
    ("shard_worker", "bazel-bin/worker/shard_worker"),
    ("shardctl", "bazel-bin/client/shardctl"),
    ("shard_agent", "bazel-bin/agent/shard_agent"),
]


HEADER = """# Flags

Every flag of the four binaries, generated from their `--helpfull` by `tools/flag_docs.py`
(`tools/flag_docs.py > docs/flags.md` after building them); `//tests/docs:flags_doc_test` fails
when this file is stale.
"""


def flags_of(path):
    out = subprocess.run([path, "--helpfull"], capture_output=True, text=True).stdout
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


def render(binaries):
    lines = [HEADER]
    for name, path in binaries:
        lines.append(f"## `{name}`\n")
        lines.append("| flag | default | meaning |")
        lines.append("|---|---|---|")
        for flag, default, meaning in flags_of(path):
            lines.append(f"| `--{flag}` | `{default}` | {meaning} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", help="compare with this file instead of printing")
    parser.add_argument("--binary", action="append", default=[],
                        help="NAME=PATH of a binary (default: the bazel-bin ones)")
    args = parser.parse_args()
    paths = dict(b.split("=", 1) for b in args.binary)
    binaries = [(name, paths.get(name, os.path.join(ROOT, path))) for name, path in BINARIES]
    for name, path in binaries:
        if not os.access(path, os.X_OK):
            print(f"flag_docs: {name} not found at {path}; build it first "
                  "(bazel build //shard_server //worker:shard_worker //client:shardctl "
                  "//agent:shard_agent)",
                  file=sys.stderr)
            return 2
    text = render(binaries)
    if args.check is None:
        sys.stdout.write(text)
        return 0
    with open(args.check) as f:
        current = f.read()
    if current == text:
        return 0
    diff = difflib.unified_diff(current.splitlines(), text.splitlines(), args.check,
                                "what the binaries say", lineterm="", n=1)
    print(f"{args.check} is stale: regenerate it with tools/flag_docs.py > {args.check}",
          file=sys.stderr)
    print("\n".join(list(diff)[:40]), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
