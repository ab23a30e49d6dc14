#!/usr/bin/env python3
"""The layout rules of the product code (issue #48), checked in CI (tests/run.sh):

1. No product source file (C++, CUDA, Python, .proto) over 800 lines.
2. No product function over 80 lines, flag tables excepted. Functions are found
   by their shape in Google style: a definition starts at column 0 and its body
   ends with a `}` at column 0 (functions defined inside a class body are not
   measured; they are short by convention here). Functions over the limit that
   are still to be cut are listed in KNOWN_LONG: a new one fails, and so does a
   listed one that got short (take it off the list).
3. The package graph points down: every package has a layer (LAYERS), and a
   dependency (deps, srcs, hdrs, data) of a product package goes only to a
   package of a lower layer. Tests and tools may depend on anything, but no
   product package depends on them, and no package graph cycle exists. The
   edges come from `bazel query`.
4. The control plane links none of the programs that call it: no package under
   shard_server/ depends on client/, worker/, agent/ or python/ (FORBIDDEN),
   though LAYERS puts them lower.

  python3 tools/check_layout.py [--no_bazel] [--json]

Exits 1 with one line per violation, naming the file or edge and the rule.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT_DIRS = ["agent", "client", "common", "proto", "python", "shard_server", "worker"]
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80

# Layers, lowest first. A product package may depend only on packages of a
# lower layer. Folders of one layer do not depend on each other.
LAYERS = [
    ["proto", "proto/etcd"],
    ["common"],
    ["common/plan"],
    ["client"],
    ["agent", "python", "worker/model"],
    ["worker/comm", "worker/data"],
    ["worker/zero"],
    ["worker/checkpoint", "worker/cuda"],
    ["worker/recovery"],
    ["worker"],
    ["shard_server/base", "shard_server/auth", "shard_server/goodput"],
    ["shard_server/state"],
    ["shard_server/kv", "shard_server/membership"],
    ["shard_server/checkpoint"],
    ["shard_server/observability"],
    ["shard_server"],
]

# (source package prefix, destination package prefixes it must not reach).
FORBIDDEN = [
    ("shard_server", ("client", "worker", "agent", "python")),
]


def forbidden(src, dst):
    def under(p, prefix):
        return p == prefix or p.startswith(prefix + "/")
    return any(under(src, s) and any(under(dst, d) for d in ds) for s, ds in FORBIDDEN)


# Functions over MAX_FUNCTION_LINES still to be cut ("file:function name").
# Flag tables (a binary's flags read into its config, one statement a flag)
# are exempt and listed in FLAG_TABLES instead.
FLAG_TABLES = {
    "worker/worker_config.cc:ReadEngine",
    "worker/worker_config.cc:ReadRun",
}
KNOWN_LONG: set = set()

_NOT_A_DEFINITION = ("//", "#", "}", "namespace", "using ", "class ", "struct ", "enum ",
                     "template", "ABSL_FLAG", "ABSL_RETIRED", "extern", "static_assert",
                     "typedef", "constexpr", "inline constexpr", "const ", "union", ")")


def source_files():
    for top in PRODUCT_DIRS:
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for name in sorted(names):
                if name.endswith((".cc", ".h", ".cu", ".py", ".proto")):
                    yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def function_name(header):
    """`absl::Status Foo::Bar(int x) {` -> `Foo::Bar`."""
    m = re.search(r"([A-Za-z_~][\w:~]*)\s*\(", header)
    return m.group(1) if m else header.strip()[:60]


def long_functions(path):
    """(name, first line, length) of every column-0 function over the limit."""
    lines = open(os.path.join(ROOT, path), errors="replace").read().split("\n")
    found = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line and not line[0].isspace() and not line.startswith(_NOT_A_DEFINITION):
            body = None
            for j in range(i, min(i + 8, len(lines))):
                text = lines[j].rstrip()
                if text.endswith(";") and "{" not in text:
                    break
                if text.endswith("{"):
                    body = j
                    break
            header = " ".join(l.strip() for l in lines[i:(body or i) + 1])
            if body is not None and "(" in header and not header.endswith("= {"):
                k = body + 1
                while k < len(lines) and not (lines[k] == "}" or lines[k].startswith("};")):
                    k += 1
                length = k - i + 1
                if length > MAX_FUNCTION_LINES:
                    found.append((function_name(header), i + 1, length))
                i = k + 1
                continue
        i += 1
    return found


def check_sizes():
    errors, long_seen = [], set()
    for path in source_files():
        with open(os.path.join(ROOT, path), errors="replace") as f:
            n = sum(1 for _ in f)
        if n > MAX_FILE_LINES:
            errors.append(f"{path}: {n} lines, over {MAX_FILE_LINES}: cut it along its seams")
        if not path.endswith((".cc", ".h", ".cu")):
            continue
        for name, line, length in long_functions(path):
            key = f"{path}:{name}"
            if key in FLAG_TABLES:
                continue
            long_seen.add(key)
            if key not in KNOWN_LONG:
                errors.append(f"{path}:{line}: {name} is {length} lines, over {MAX_FUNCTION_LINES}: "
                              "split it (or, for a flag table, list it in FLAG_TABLES)")
    for key in sorted(KNOWN_LONG - long_seen):
        errors.append(f"{key}: listed in KNOWN_LONG but no longer over {MAX_FUNCTION_LINES} lines "
                      "(or gone): take it off the list")
    return errors, sorted(long_seen & KNOWN_LONG)


def package_edges():
    out = subprocess.run(["bazel", "query", "kind(rule, //...)", "--output=xml"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit("bazel query failed:\n" + out.stderr[-2000:])
    edges = collections.defaultdict(set)
    for rule in ET.fromstring(out.stdout).iter("rule"):
        src = rule.get("name").split(":")[0][2:]
        for attr in rule.findall("list"):
            if attr.get("name") not in ("deps", "srcs", "hdrs", "data", "implementation_deps"):
                continue
            for label in attr.findall("label"):
                value = label.get("value")
                if value.startswith("//"):
                    dst = value.split(":")[0][2:]
                    if dst != src:
                        edges[src].add(dst)
    return edges


def is_product(package):
    return package.split("/")[0] in PRODUCT_DIRS


def check_graph(edges):
    layer = {p: i for i, names in enumerate(LAYERS) for p in names}
    errors = []
    packages = set(edges) | {d for ds in edges.values() for d in ds}
    for p in sorted(packages):
        if is_product(p) and p not in layer:
            errors.append(f"package //{p} has no layer: add it to LAYERS in tools/check_layout.py")
    for src in sorted(edges):
        for dst in sorted(edges[src]):
            if not is_product(src):
                continue
            if not is_product(dst):
                errors.append(f"//{src} -> //{dst}: a product package depends on tests or tools")
            elif forbidden(src, dst):
                errors.append(f"//{src} -> //{dst}: the control plane depends on a program that "
                              f"calls it; move what both need to //common")
            elif src in layer and dst in layer and layer[dst] >= layer[src]:
                errors.append(f"//{src} -> //{dst}: points {'up' if layer[dst] > layer[src] else 'sideways'} "
                              f"(layer {layer[src]} to {layer[dst]}); move the shared code down")
    # Cycles among all packages (tests included).
    state = {}

    def visit(p, stack):
        state[p] = 1
        stack.append(p)
        for q in sorted(edges.get(p, ())):
            if state.get(q) == 1:
                errors.append("package cycle: " + " -> ".join("//" + x for x in stack[stack.index(q):] + [q]))
            elif q not in state:
                visit(q, stack)
        stack.pop()
        state[p] = 2

    for p in sorted(packages):
        if p not in state:
            visit(p, [])
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no_bazel", action="store_true", help="skip the package graph")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    errors, still_long = check_sizes()
    edges = {} if args.no_bazel else package_edges()
    if not args.no_bazel:
        errors += check_graph(edges)
    if args.json:
        print(json.dumps({"errors": errors, "known_long": still_long,
                          "packages": len(set(edges) | {d for ds in edges.values() for d in ds})},
                         indent=1))
    else:
        for e in errors:
            print(e)
        print(f"layout: {len(errors)} violations; {len(still_long)} known long functions left to cut")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
