#!/usr/bin/env bash
# `A && B || die` is meant throughout: B is a test, never a command that fails.
# shellcheck disable=SC2015
# emuhosts.sh: N emulated hosts on one Linux machine, and the network faults
# between them: the tool the multi-host tests use (tests/testing/
# emulated_hosts.h calls it), for reproducing docs/multihost.md's failure
# table by hand. Needs root and iproute2, nftables, util-linux
# (tools/install_deps.sh).
#
# Host k is a network namespace NAME-hk with one interface, eth0, at
# 198.18.0.(k+1)/24 (RFC 2544's benchmarking range: it exists only inside
# these namespaces); a command run on it gets a UTS namespace named "hostk".
# Each eth0 is one end of a veth whose other end is a port of a bridge in a
# namespace of its own, NAME-br: nothing is added to this machine's own
# network. Faults, all on the path between hosts, never inside one:
#   cut      nftables drops on the bridge: silent both ways (no FIN, RST or
#            ICMP; the host's own sockets see no error either);
#   rate     tbf on both ends of the host's veth (uplink and downlink);
#   firewall new TCP connections from other hosts accepted on a port range
#            only (the host's own nftables input hook).
# State (what is cut, the rates) lives in /run/zeroshard-emuhosts/NAME, next
# to the namespaces in /run/netns; both go at reboot.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: emuhosts.sh [--name NAME] [--json] COMMAND [ARGS]

  create N [--owner PID]  make hosts 0..N-1 (1..200); --owner: `sweep` removes
                          them once PID is gone (the tests' crash cleanup)
  run K CMD [ARGS...]     run CMD on host K (its network, hostname hostK)
  cut K [--from J]        drop every packet between host K and host J (without
                          --from: between K and every other host)
  heal [K]                undo the cuts that involve host K (without K: all)
  rate K RATE             limit host K's link to RATE each way: bits/s, or with
                          a suffix k, m, g (10m = 10 Mbit/s); 0 removes the limit
  firewall K FIRST LAST   host K accepts new TCP connections from other hosts
                          on ports FIRST..LAST only (dropped silently otherwise)
  show [--json]           the hosts, their addresses, cuts, rates, processes
                          (--json: one JSON object; also before the command)
  list                    every set of emulated hosts on this machine
  down                    kill what runs on the hosts and delete them (also
                          after a failure; nothing to delete is not an error)
  sweep                   down every set whose --owner process is gone
  netns K | address K     the namespace's name, the host's address

NAME (default zsemu) names the set: namespaces NAME-h0.., NAME-br.
Example, a worker host cut off for 20 s (--insecure: a server off loopback
with no authentication refuses to start without it; 198.18.0.0/24 exists only
inside these namespaces):
  emuhosts.sh create 3
  emuhosts.sh run 0 shard_server --listen=198.18.0.1:7070 --insecure &
  emuhosts.sh run 1 shard_worker --server=198.18.0.1:7070 ... &
  emuhosts.sh cut 1; sleep 20; emuhosts.sh heal 1
  emuhosts.sh down
EOF
}

STATE_ROOT=${ZS_EMUHOSTS_STATE:-/run/zeroshard-emuhosts}
MAX_HOSTS=200
NAME=zsemu
JSON=0

die() {
  echo "emuhosts: $*" >&2
  exit 1
}

# The absolute path of a system tool: tests run with a minimal PATH.
tool() {
  local dir
  for dir in /usr/sbin /sbin /usr/bin /bin; do
    if [[ -x "$dir/$1" ]]; then
      echo "$dir/$1"
      return
    fi
  done
  return 1
}

need_root_and_tools() {
  if [[ $(id -u) != 0 ]]; then
    die "needs root (network and UTS namespaces, nftables, tc): run it with sudo"
  fi
  local t
  for t in ip tc nft unshare flock; do
    tool "$t" >/dev/null ||
      die "needs the '$t' tool, not found: install iproute2, nftables and util-linux (tools/install_deps.sh)"
  done
  IP=$(tool ip)
  TC=$(tool tc)
  NFT=$(tool nft)
}

dir() { echo "$STATE_ROOT/$NAME"; }
host_ns() { echo "$NAME-h$1"; }
bridge_ns() { echo "$NAME-br"; }
address() { echo "198.18.0.$(($1 + 1))"; }

# Every namespace of set NAME (hosts and bridge), also a half-made set's.
namespaces_of() {
  "$IP" netns list 2>/dev/null | awk '{print $1}' | grep -E "^$1-(h[0-9]+|br)\$" || true
}

# One command at a time per set: a cut and a heal never interleave.
lock() {
  mkdir -p "$STATE_ROOT"
  exec 9>"$STATE_ROOT/.lock-$NAME"
  flock 9
}

count() {
  [[ -f "$(dir)/count" ]] ||
    die "no emulated hosts named '$NAME' here (make them with \`emuhosts.sh --name $NAME create N\`)"
  cat "$(dir)/count"
}

host_arg() {
  local k=$1 n
  n=$(count)
  [[ "$k" =~ ^[0-9]+$ ]] && ((k < n)) ||
    die "host '$k' asked for: '$NAME' has hosts 0..$((n - 1)) (a number, not a hostname)"
}

# Runs one step of `create`; on failure removes the half-made set and says
# which command failed and why.
step() {
  local err
  if ! err=$("$@" 2>&1); then
    down_locked
    die "create: \`$*\` failed: ${err:-no message} (nothing of '$NAME' is left)"
  fi
}

# Writes the bridge's drop set from the state's cuts: one nft transaction.
apply_cuts() {
  local elements="" a b
  while read -r a b; do
    [[ -n "$a" ]] || continue
    elements+="${elements:+, }$(address "$a") . $(address "$b")"
  done <"$(dir)/cuts"
  {
    echo "flush set bridge zeroshard cut"
    [[ -z "$elements" ]] || echo "add element bridge zeroshard cut { $elements }"
  } | "$IP" netns exec "$(bridge_ns)" "$NFT" -f - ||
    die "the bridge's drops (nft in namespace $(bridge_ns)) could not be written"
}

cmd_create() {
  local n=${1:-} owner=""
  shift || true
  while (($#)); do
    case $1 in
      --owner) owner=${2:-}; shift 2 ;;
      --owner=*) owner=${1#--owner=}; shift ;;
      *) die "create: unknown argument '$1' (expected --owner PID)" ;;
    esac
  done
  [[ "$n" =~ ^[0-9]+$ ]] && ((n >= 1 && n <= MAX_HOSTS)) ||
    die "create: '$n' hosts asked for; expected a number 1..$MAX_HOSTS"
  lock
  local existing
  existing=$(namespaces_of "$NAME")
  if [[ -n "$existing" || -e "$(dir)" ]]; then
    die "hosts named '$NAME' exist already ($(echo "$existing" | wc -w) namespaces): \`emuhosts.sh --name $NAME down\` removes them, or pick another --name"
  fi
  mkdir -p "$(dir)"
  local br k
  br=$(bridge_ns)
  step "$IP" netns add "$br"
  step "$IP" -n "$br" link add br0 type bridge
  step "$IP" -n "$br" link set br0 up
  for ((k = 0; k < n; k++)); do
    local h
    h=$(host_ns "$k")
    step "$IP" netns add "$h"
    step "$IP" -n "$br" link add "v$k" type veth peer name eth0 netns "$h"
    step "$IP" -n "$br" link set "v$k" master br0 up
    step "$IP" -n "$h" addr add "$(address "$k")/24" dev eth0
    step "$IP" -n "$h" link set eth0 up
    step "$IP" -n "$h" link set lo up
  done
  # The drops: (source, destination) address pairs, on the bridge.
  step "$IP" netns exec "$br" "$NFT" -f - <<'EOF'
table bridge zeroshard {
  set cut { type ipv4_addr . ipv4_addr; }
  chain forward {
    type filter hook forward priority 0; policy accept;
    ip saddr . ip daddr @cut drop
  }
}
EOF
  : >"$(dir)/cuts"
  : >"$(dir)/rates"
  echo "$owner" >"$(dir)/owner"
  echo "$n" >"$(dir)/count"
  echo "emuhosts: '$NAME': hosts 0..$((n - 1)) at 198.18.0.1..$(address $((n - 1)))" >&2
}

cmd_run() {
  (($# >= 2)) || die "run: expected a host and a command (run K CMD [ARGS...])"
  host_arg "$1"
  local k=$1
  shift
  # exec: the command is the namespace's process (signals reach it).
  # shellcheck disable=SC2016  # $0 and $@ are the inner shell's
  exec "$IP" netns exec "$(host_ns "$k")" "$(tool unshare)" --uts /bin/sh -c \
    'hostname "$0" && exec "$@"' "host$k" "$@"
}

cmd_cut() {
  (($# >= 1)) || die "cut: expected a host (cut K [--from J])"
  host_arg "$1"
  local k=$1 from="" j n
  shift
  if (($#)); then
    [[ "$1" == --from ]] && (($# == 2)) || die "cut: unknown arguments '$*' (expected --from J)"
    host_arg "$2"
    from=$2
    [[ "$from" != "$k" ]] || die "cut: host $k from itself: a host always reaches itself"
  fi
  lock
  n=$(count)
  for ((j = 0; j < n; j++)); do
    [[ $j != "$k" ]] || continue
    [[ -z "$from" || "$from" == "$j" ]] || continue
    printf '%s %s\n%s %s\n' "$k" "$j" "$j" "$k" >>"$(dir)/cuts"
  done
  sort -u -o "$(dir)/cuts" "$(dir)/cuts"
  apply_cuts
}

cmd_heal() {
  local k=${1:-}
  [[ -z "$k" ]] || host_arg "$k"
  lock
  count >/dev/null
  if [[ -z "$k" ]]; then
    : >"$(dir)/cuts"
  else
    awk -v k="$k" '$1 != k && $2 != k' "$(dir)/cuts" >"$(dir)/cuts.new"
    mv "$(dir)/cuts.new" "$(dir)/cuts"
  fi
  apply_cuts
}

# RATE in bits/s: digits with an optional k, m or g (decimal).
parse_rate() {
  local r=${1,,}
  case $r in
    *[0-9]k) echo $((${r%k} * 1000)) ;;
    *[0-9]m) echo $((${r%m} * 1000000)) ;;
    *[0-9]g) echo $((${r%g} * 1000000000)) ;;
    *) echo "$r" ;;
  esac
}

cmd_rate() {
  (($# == 2)) || die "rate: expected a host and a rate (rate K RATE, e.g. rate 1 10m)"
  host_arg "$1"
  local k=$1 bps
  bps=$(parse_rate "$2" 2>/dev/null || true)
  [[ "$bps" =~ ^[0-9]+$ ]] ||
    die "rate: '$2' is not a rate: bits/s as a whole number, optionally with k, m or g (10m)"
  lock
  local ns dev
  for ns_dev in "$(host_ns "$k") eth0" "$(bridge_ns) v$k"; do
    read -r ns dev <<<"$ns_dev"
    if ((bps == 0)); then
      "$TC" -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true  # none of ours: fine
      continue
    fi
    # 10 ms of traffic per burst, at least a few full frames.
    local burst=$((bps / 8 / 100))
    ((burst >= 16384)) || burst=16384
    "$TC" -n "$ns" qdisc replace dev "$dev" root tbf rate "${bps}bit" burst "$burst" latency 200ms ||
      die "rate: tc on $dev in namespace $ns failed"
  done
  awk -v k="$k" '$1 != k' "$(dir)/rates" >"$(dir)/rates.new"
  ((bps == 0)) || echo "$k $bps" >>"$(dir)/rates.new"
  mv "$(dir)/rates.new" "$(dir)/rates"
}

cmd_firewall() {
  (($# == 3)) || die "firewall: expected a host and a port range (firewall K FIRST LAST)"
  host_arg "$1"
  [[ "$2" =~ ^[0-9]+$ && "$3" =~ ^[0-9]+$ ]] && (($2 <= $3 && $3 <= 65535)) ||
    die "firewall: ports '$2'..'$3': expected FIRST <= LAST <= 65535"
  "$IP" netns exec "$(host_ns "$1")" "$NFT" -f - <<EOF || die "firewall: nft on host $1 failed"
table inet zeroshard_firewall {
  chain input {
    type filter hook input priority 0; policy accept;
    iif lo accept
    ct state new tcp dport != $2-$3 drop
  }
}
EOF
}

# "1,2" or "-": the hosts host k is cut from.
cut_from() { awk -v k="$1" '$1 == k {printf "%s%s", (n++ ? "," : ""), $2} END {if (!n) print "-"}' "$(dir)/cuts"; }
rate_of() { awk -v k="$1" '$1 == k {print $2; f=1} END {if (!f) print 0}' "$(dir)/rates"; }
pids_of() { "$IP" netns pids "$(host_ns "$1")" 2>/dev/null | wc -l; }

cmd_show() {
  local n k
  while (($#)); do
    case $1 in
      --json) JSON=1; shift ;;
      *) die "show: unknown argument '$1' (expected --json)" ;;
    esac
  done
  n=$(count)
  if ((JSON)); then
    printf '{"name":"%s","bridge_netns":"%s","owner":"%s","hosts":[' "$NAME" "$(bridge_ns)" \
      "$(cat "$(dir)/owner")"
    for ((k = 0; k < n; k++)); do
      local from
      from=$(cut_from "$k")
      [[ "$from" != "-" ]] || from=""
      printf '%s{"host":%d,"hostname":"host%d","address":"%s","netns":"%s","rate_bps":%s,"cut_from":[%s],"processes":%d}' \
        "$( ((k)) && echo ,)" "$k" "$k" "$(address "$k")" "$(host_ns "$k")" "$(rate_of "$k")" \
        "$from" "$(pids_of "$k")"
    done
    echo "]}"
    return
  fi
  echo "emulated hosts '$NAME' (bridge in namespace $(bridge_ns))"
  printf '%-8s %-14s %-16s %-14s %-12s %s\n' HOST ADDRESS NETNS "RATE bit/s" "CUT FROM" PROCESSES
  for ((k = 0; k < n; k++)); do
    local rate
    rate=$(rate_of "$k")
    ((rate)) || rate="-"
    printf '%-8s %-14s %-16s %-14s %-12s %s\n' "host$k" "$(address "$k")" "$(host_ns "$k")" \
      "$rate" "$(cut_from "$k")" "$(pids_of "$k")"
  done
}

cmd_list() {
  local d owner
  for d in "$STATE_ROOT"/*/; do
    [[ -f "$d/count" ]] || continue
    owner=$(cat "$d/owner" 2>/dev/null || true)
    echo "$(basename "$d"): $(cat "$d/count") hosts, owner ${owner:--}"
  done
}

# Kills what runs in the set's namespaces and deletes them and the state.
down_locked() {
  local ns pid
  for ns in $(namespaces_of "$NAME"); do
    for pid in $("$IP" netns pids "$ns" 2>/dev/null); do
      ((pid > 1)) && kill -KILL "$pid" 2>/dev/null || true
    done
    "$IP" netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$(dir)"
}

cmd_down() {
  lock
  down_locked
  rm -f "$STATE_ROOT/.lock-$NAME"
}

# Sets whose owner process is gone: a test that crashed before its teardown.
# Also namespaces of the tests' sets (zshosts-<pid>-...) without state, made
# by a run that died half-way, when that pid is gone.
cmd_sweep() {
  local d owner ns
  for d in "$STATE_ROOT"/*/; do
    [[ -d "$d" ]] || continue
    owner=$(cat "$d/owner" 2>/dev/null || true)
    [[ "$owner" =~ ^[0-9]+$ && ! -d "/proc/$owner" ]] || continue
    (NAME=$(basename "$d") && cmd_down)
  done
  for ns in $("$IP" netns list 2>/dev/null | awk '{print $1}'); do
    [[ "$ns" =~ ^(zshosts-([0-9]+))-(h[0-9]+|br)$ ]] || continue
    [[ ! -d "/proc/${BASH_REMATCH[2]}" && ! -d "$STATE_ROOT/${BASH_REMATCH[1]}" ]] || continue
    (NAME=${BASH_REMATCH[1]} && cmd_down)
  done
}

main() {
  while (($#)); do
    case $1 in
      --name) NAME=${2:-}; shift 2 ;;
      --name=*) NAME=${1#--name=}; shift ;;
      --json) JSON=1; shift ;;
      -h | --help | help) usage; exit 0 ;;
      --*) die "unknown flag '$1' (expected --name NAME, --json; see --help)" ;;
      *) break ;;
    esac
  done
  [[ "$NAME" =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,30}$ ]] ||
    die "--name '$NAME': letters, digits, '-' and '_', at most 31 (it prefixes namespace names)"
  (($#)) || { usage >&2; exit 2; }
  local command=$1
  shift
  case $command in
    netns) host_arg "${1:-}"; host_ns "$1"; return ;;
    address) host_arg "${1:-}"; address "$1"; return ;;
  esac
  need_root_and_tools
  case $command in
    create | run | cut | heal | rate | firewall | show | list | down | sweep) "cmd_$command" "$@" ;;
    *) die "unknown command '$command' (see --help)" ;;
  esac
}

main "$@"
