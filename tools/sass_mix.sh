#!/bin/bash
# The SASS instruction mix of the f32 tensor-core attention kernels
# (worker/cuda/flash_attention_mma.cu), compiled for sm_90 as the build
# compiles them: per kernel, its registers and spills (ptxas), instructions,
# HMMAs, shared-memory loads, NOPs and instructions per HMMA. A proxy, with
# no GPU, for what an edit does to the kernels' issue cost (docs/gpu.md);
# not a timing.
#
#   tools/sass_mix.sh              the kernels as built
#   tools/sass_mix.sh --interior   the interior tiles' code alone: the tile
#                                  dispatch forced to it (a build nothing runs)
#
# cuobjdump (and the nvdisasm it runs) are not among Debian's CUDA files; they
# come from PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels
# (pinned below, hashes checked), unpacked once into ~/.cache/zeroshard.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly WHEEL_VERSION=13.5.37
readonly CUOBJDUMP_SHA256=38780fee50863252a0b8926357faa91615ca1c8346490563f33a06100cd73f58
readonly NVDISASM_SHA256=d3fdbdd49fa53e2e4aacd3db8259d052bd2b049ececdcb69e92e083c6728e7ca
readonly SRC=worker/cuda/flash_attention_mma.cu
interior=false
case "${1:-}" in
  "") ;;
  --interior) interior=true ;;
  *) echo "usage: tools/sass_mix.sh [--interior]" >&2; exit 2 ;;
esac

cache="${XDG_CACHE_HOME:-$HOME/.cache}/zeroshard/cuobjdump-$WHEEL_VERSION"
cuobjdump="$cache/nvidia/cu13/bin/cuobjdump"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; rm -f worker/cuda/.sass_mix_tmp.cu' EXIT
if [[ ! -x "$cuobjdump" ]]; then
  echo "sass_mix: fetching cuobjdump and nvdisasm (PyPI, $WHEEL_VERSION) into $cache" >&2
  {
    echo "nvidia-cuda-cuobjdump==$WHEEL_VERSION --hash=sha256:$CUOBJDUMP_SHA256"
    echo "nvidia-cuda-nvdisasm==$WHEEL_VERSION --hash=sha256:$NVDISASM_SHA256"
  } >"$tmp/req.txt"
  # pip from python3, else from a venv of its own (as tools/install_deps.sh).
  pip=(python3 -m pip)
  if ! python3 -m pip --version >/dev/null 2>&1; then
    python3 -m venv "$tmp/venv" >/dev/null && pip=("$tmp/venv/bin/python" -m pip)
  fi
  "${pip[@]}" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    -r "$tmp/req.txt" -d "$tmp/wheel" >&2
  rm -rf "$cache.partial" && mkdir -p "$cache.partial"
  for w in "$tmp"/wheel/*.whl; do python3 -m zipfile -e "$w" "$cache.partial"; done
  chmod +x "$cache.partial"/nvidia/cu13/bin/*
  rm -rf "$cache" && mv "$cache.partial" "$cache"
fi

# Compiled beside the original so that its includes resolve the same way.
src=worker/cuda/.sass_mix_tmp.cu
cp "$SRC" "$src"
if $interior; then
  # Each kernel's "!all_steps / interior / else" chain made to take the
  # interior copy; each pattern must match as often as the kernels dispatch.
  for p in 'if (!all_steps) {:3' '} else if (tile.Interior(j0)) {:2' \
    '} else if (i0 >= j0 + kTile && i0 + kTile <= d.t) {:1'; do
    if [[ $(grep -cF "${p%:*}" "$src") != "${p##*:}" ]]; then
      echo "sass_mix: '${p%:*}' is not in $SRC ${p##*:} time(s): update the patterns here" >&2
      exit 1
    fi
  done
  sed -i -e 's/if (!all_steps) {/if (false) {/' \
    -e 's/} else if (tile.Interior(j0)) {/} else if (true) {/' \
    -e 's/} else if (i0 >= j0 + kTile \&\& i0 + kTile <= d.t) {/} else if (true) {/' "$src"
fi
nvcc -std=c++17 -O2 -gencode arch=compute_90,code=sm_90 -I. -I bazel-bin -c "$src" \
  -o "$tmp/k.o" -Xptxas -v 2>"$tmp/ptxas.txt"
PATH="$(dirname "$cuobjdump"):$PATH" "$cuobjdump" -sass "$tmp/k.o" >"$tmp/k.sass"

python3 - "$tmp/k.sass" "$tmp/ptxas.txt" <<'PY'
import re, sys
sass, ptxas = open(sys.argv[1]).read(), open(sys.argv[2]).read()
regs = {}
pattern = (r"Function properties for \S*?(Mma\w+Kernel)\S*\n.*?(\d+) bytes spill stores.*?\n"
           r".*?Used (\d+) registers")
for m in re.finditer(pattern, ptxas):
    regs[m.group(1)] = (int(m.group(3)), int(m.group(2)))
print(f"{'KERNEL':24} {'REGS':>4} {'SPILL':>5} {'INSTR':>6} {'HMMA':>5} {'LDS':>5} {'NOP':>4} "
      f"{'PER HMMA':>8}")
for body in sass.split("Function : ")[1:]:
    name = re.search(r"(Mma\w+Kernel)", body.splitlines()[0]).group(1)
    ops = re.findall(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)", body)
    count = lambda op: sum(1 for o in ops if o == op)
    hmma = count("HMMA")
    r, spill = regs.get(name, (0, 0))
    print(f"{name:24} {r:>4} {spill:>5} {len(ops):>6} {hmma:>5} {count('LDS'):>5} {count('NOP'):>4} "
          f"{len(ops) / max(hmma, 1):>8.2f}")
PY
