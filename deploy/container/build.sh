#!/usr/bin/env bash
# Builds the zeroshard container image, offline, with podman: a root holding
# only shard_server, shard_worker, shardctl, shard_agent, etcd (Debian's
# etcd-server, for deploy/k8s/ha), /bin/sh and sleep (the workers' wait for
# the server), exactly the shared libraries these need (from ldd, so from
# this machine's Debian packages), the Python wheel under /opt/zeroshard, and
# a user 65532 ("zeroshard", the manifests' runAsUser). No base image is
# pulled: FROM scratch (deploy/container/Containerfile).
#
#   deploy/container/build.sh                 # zeroshard:<commit> and zeroshard:latest
#   deploy/container/build.sh --no_build      # the binaries already in bazel-bin
#   deploy/container/build.sh --save=FILE     # also write the image as a docker archive
#   deploy/container/build.sh --bin_dir=DIR   # the binaries and the wheel from DIR, no bazel
#   deploy/container/build.sh --podman_root=DIR  # podman's storage there, not the system's
#
# The tag is the commit (git rev-parse --short=12 HEAD), "-dirty" when the work
# tree has changes. Push: docs/deploy.md ("The container image").
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin:/usr/bin:/bin"  # ldconfig; tests run with a minimal PATH
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
IMAGE=zeroshard  # deploy/k8s names this repository (tests/deploy checks it)

build=1
save=""
bin_dir=""
# crun (podman's default) refuses this kind of machine's cgroups: runc, cgroupfs.
PODMAN=(podman --runtime runc --cgroup-manager cgroupfs)
for arg in "$@"; do
  case "$arg" in
    --no_build) build=0 ;;
    --save=*) save="${arg#*=}" ;;
    --bin_dir=*) bin_dir="${arg#*=}"; build=0 ;;
    --podman_root=*)
      PODMAN+=(--root "${arg#*=}/storage" --runroot "${arg#*=}/run") ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown option '$arg' (expected --no_build, --save=FILE, --bin_dir=DIR," \
         "--podman_root=DIR)" >&2; exit 2 ;;
  esac
done
tools=(podman runc ldd ldconfig)
if ((build)); then tools+=(bazel); fi
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null ||
    { echo "build.sh: '$tool' not found: run tools/install_deps.sh" >&2; exit 1; }
done
[[ -x /usr/bin/etcd ]] || { echo "build.sh: /usr/bin/etcd not found: run tools/install_deps.sh" >&2; exit 1; }

# The commit; outside a git checkout (a test's runfiles) "dev".
if tag=$(git rev-parse --short=12 HEAD 2>/dev/null); then
  if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then tag+="-dirty"; fi
  revision=$(git rev-parse HEAD)
else
  tag=dev
  revision=unknown
fi

started=$SECONDS
if ((build)); then
  bazel build //shard_server //worker:shard_worker //client:shardctl //agent:shard_agent \
    //python:wheel >&2
fi
binaries=(bazel-bin/shard_server/shard_server bazel-bin/worker/shard_worker
  bazel-bin/client/shardctl bazel-bin/agent/shard_agent)
wheels=(bazel-bin/python/zeroshard-*.whl)
if [[ -n "$bin_dir" ]]; then
  binaries=("${binaries[@]/#bazel-bin\/*\//$bin_dir/}")
  wheels=("$bin_dir"/zeroshard-*.whl)
fi
for f in "${binaries[@]}" "${wheels[0]}"; do
  [[ -f "$f" ]] || { echo "build.sh: $f is missing (bazel build, or --bin_dir=DIR)" >&2; exit 1; }
done

stage=$(mktemp -d /tmp/zeroshard-image.XXXXXX)
trap 'rm -rf "$stage"' EXIT
root="$stage/root"
mkdir -p "$root"/{usr/local/bin,bin,etc,tmp,opt/zeroshard,var/lib/zeroshard/state,var/lib/zeroshard/checkpoints,var/lib/etcd,etc/zeroshard}
chmod 1777 "$root/tmp"

# Every executable, then each shared library ldd resolves for it, at the path
# ldd names (symlinks followed: the file itself is copied).
install -m 0755 "${binaries[@]}" "$root/usr/local/bin/"
install -m 0755 /usr/bin/etcd "$root/usr/local/bin/etcd"
install -m 0755 /bin/dash "$root/bin/sh"
install -m 0755 /bin/sleep "$root/bin/sleep"
for exe in "$root"/usr/local/bin/* "$root/bin/sh" "$root/bin/sleep"; do
  ldd "$exe" | awk '/=> \// { print $3 } /^\t\/[^ ]+ \(/ { print $1 }'
done | sort -u | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
# The loader's cache, so that the libraries are found wherever ldd found them.
ldd "$root/usr/local/bin/"* 2>/dev/null | awk '/=> \// { print $3 }' | xargs -n1 dirname |
  sort -u >"$root/etc/ld.so.conf"
ldconfig -r "$root"
cp "${wheels[0]}" "$root/opt/zeroshard/"

cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
zeroshard:x:65532:65532:zeroshard:/var/lib/zeroshard:/bin/sh
EOF
cat >"$root/etc/group" <<'EOF'
root:x:0:
zeroshard:x:65532:
EOF
printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
chown -R 65532:65532 "$root/var/lib/zeroshard" "$root/var/lib/etcd"

tar -C "$root" -cf "$stage/root.tar" .
cp deploy/container/Containerfile "$stage/"
"${PODMAN[@]}" build --format docker \
  --label org.opencontainers.image.revision="$revision" \
  -t "$IMAGE:$tag" -t "$IMAGE:latest" -f "$stage/Containerfile" "$stage" >&2
if [[ -n "$save" ]]; then
  "${PODMAN[@]}" save --format docker-archive -o "$save" "$IMAGE:$tag"
fi
size=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE:$tag")
echo "build.sh: $IMAGE:$tag (also $IMAGE:latest), $((size / 1048576)) MiB," \
  "$((SECONDS - started)) s" >&2
echo "$IMAGE:$tag"
