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
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "install_deps: installing ${missing[*]}" >&2
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install_deps: done" >&2
