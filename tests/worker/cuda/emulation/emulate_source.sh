#!/bin/bash
# Copies a CUDA source of //worker/cuda for the CPU emulation tests
# (cuda_emulation.h): emulate_source.sh IN OUT.
# - its private includes ("worker/cuda/x.cuh") point at the copies
#   (tests/worker/cuda/x.cuh.inc);
# - static __shared__ arrays become function statics (one copy shared by the
#   block's threads; blocks run one at a time), registered with the emulation
#   (cuda_emulation::SharedArray), which fills them with 0xff bytes (NaN as
#   f32 / f64) before every block after the first, so a block that reads
#   shared memory it has not written sees NaN, not the last block's values;
#   extern __shared__ become plain extern declarations (the test defines the
#   dynamic shared memory);
# - kernel<<<grid, block, bytes, stream>>>(args) becomes
#   cuda_emulation::Launcher(grid, block, bytes, stream).Run(
#       [=](auto... a) { kernel(a...); }, args)
#   (a generic lambda, so that a kernel template's arguments are deduced from
#   args as nvcc deduces them; the launch may span lines).
set -euo pipefail
sed -E -z \
  -e 's|"worker/cuda/([a-z0-9_]*\.cuh)"|"tests/worker/cuda/\1.inc"|g' \
  -e 's/extern __shared__/extern/g' \
  -e 's/__shared__ ([A-Za-z_][A-Za-z0-9_:<>]*) ([A-Za-z_][A-Za-z0-9_]*)((\[[^];]*\])*);/static \1 \2\3; cuda_emulation::SharedArray(\&\2, sizeof(\2));/g' \
  -e 's/__shared__/static/g' \
  -e 's/([A-Za-z_][A-Za-z0-9_]*(<[A-Za-z0-9_:, ]*>)?)<<<(([^>]|>{1,2}[^>])*)>>>\(/cuda_emulation::Launcher(\3).Run([=](auto... a) { \1(a...); }, /g' \
  "$1" >"$2"
