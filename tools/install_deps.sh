#!/usr/bin/env bash
# Installs every Debian package zeroshard needs to build, test and run.
# Idempotent: quiet and fast when everything is already there.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap        # Bazel 4.2.3, offline
  g++ pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev            # Abseil (status, flags, synchronization, time)
  libgloo-dev            # CPU collectives
  libopenblas-dev        # CPU matrix products (headers)
  libopenblas0-openmp    # ... linked in its OpenMP build (third_party/system.BUILD)
  libsqlite3-dev         # durable server state
  libgtest-dev libgmock-dev
  nlohmann-json3-dev libxxhash-dev
  openssl                # test-time TLS certificates
  libcivetweb-dev        # the metrics port's HTTP server (/metrics, the dashboard)
  prometheus tmux chromium curl  # observability tests: promtool, shardctl top, the dashboard
  python3 python3-venv python3-torch python3-numpy python3-yaml  # interop tests
  python3-dev pybind11-dev  # the Python package (python/zeroshard)
  iproute2 nftables      # emulated hosts (tests/cluster): namespaces, tc, silent drops
  etcd-server etcd-client  # replicated control plane (--etcd_endpoints): etcd v3 and its tests
  golang-etcd-server-dev golang-github-gogo-protobuf-dev golang-github-gogo-googleapis-dev  # etcd's v3 .proto files
  slurmctld slurmd slurmdbd slurm-client munge mariadb-server  # tests/slurm: a real Slurm cluster (sacct needs slurmdbd + MariaDB)
  podman runc            # deploy/container: the image, built offline, and its test
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]} > 0)); then
  echo "install_deps: installing ${missing[*]}" >&2
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "install_deps: done" >&2
fi

# The cuDNN frontend (header-only; not in Debian): the include/ directory of the
# PyPI wheel pinned in third_party/cuda/cudnn_frontend.pin, unpacked into the
# cache directory that third_party/cuda/cuda_configure.bzl looks in. Nothing is
# fetched when it is already there. Without it the build still works: the cuDNN
# attention target is left out (@local_cuda's CUDNN_AVAILABLE is False) and the
# device GPT uses its own attention kernel; so a failed fetch only warns.
fetch_cudnn_frontend() {
  local pin version wheel sha dest tmp pip
  pin="$(dirname "$0")/../third_party/cuda/cudnn_frontend.pin"
  version=$(sed -n 's/^version=//p' "$pin")
  wheel=$(sed -n 's/^wheel=//p' "$pin")
  sha=$(sed -n 's/^sha256=//p' "$pin")
  dest="${XDG_CACHE_HOME:-$HOME/.cache}/zeroshard/cudnn_frontend-$version"
  [[ -f "$dest/include/cudnn_frontend.h" ]] && return 0
  echo "install_deps: fetching the cuDNN frontend $version (PyPI: $wheel) into $dest" >&2
  tmp=$(mktemp -d)
  # pip from python3, else from a venv of its own (Debian's python3 has no pip
  # module without python3-pip; python3-venv brings one along).
  if python3 -m pip --version >/dev/null 2>&1; then
    pip=(python3 -m pip)
  else
    python3 -m venv "$tmp/venv" >/dev/null && pip=("$tmp/venv/bin/python" -m pip) || return 1
  fi
  # The wheel's tags pin the exact file (the hash is checked against it); its
  # headers are the same on every platform, so any machine can fetch this one.
  echo "nvidia-cudnn-frontend==$version --hash=sha256:$sha" >"$tmp/requirements.txt"
  "${pip[@]}" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp --abi cp311 \
    -r "$tmp/requirements.txt" -d "$tmp/wheel" >&2 || { rm -rf "$tmp"; return 1; }
  python3 - "$tmp/wheel/$wheel" "$tmp/unpacked" <<'PY' || { rm -rf "$tmp"; return 1; }
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
PY
  # Moved into place whole, so a half-unpacked directory is never taken as done.
  mkdir -p "$(dirname "$dest")"
  rm -rf "$dest.partial" && mv "$tmp/unpacked" "$dest.partial" && mv "$dest.partial" "$dest"
  rm -rf "$tmp"
  echo "install_deps: cuDNN frontend $version in $dest (run \`bazel sync --configure\` if a" \
    "build already ran without it)" >&2
}
if ! fetch_cudnn_frontend; then
  echo "install_deps: WARNING: could not fetch the cuDNN frontend (no network to PyPI?);" \
    "the cuDNN attention is left out of the build until this succeeds" >&2
fi
