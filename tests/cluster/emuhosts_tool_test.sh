#!/usr/bin/env bash
# deploy/emuhosts.sh driven as a user drives it: two hosts that reach each
# other, a cut that drops silently both ways, a heal, a rate shown in its
# state, clear refusals, and a teardown that leaves nothing behind (also of
# a set whose owner died). Needs root, as every emulated-hosts test.
#
#   emuhosts_tool_test.sh EMUHOSTS_SH NET_PROBE_PY
set -uo pipefail
emu=$(realpath "$1")
probe=$(realpath "$2")
name="emutest-$$"
E() { bash "$emu" --name "$name" "$@"; }
trap 'E down >/dev/null 2>&1' EXIT
fail() {
  echo "FAIL: $*" >&2
  E show >&2 2>&1 || true
  exit 1
}

# What host $1 sees connecting to host $2's probe server: ok, timeout, error.
reach() { E run "$1" python3 "$probe" connect "198.18.0.$(($2 + 1))" 9000 1.5 2>&1; }

# Waits (deadline 15 s) until `reach $1 $2` says $3.
wait_reach() {
  local deadline=$((SECONDS + 15)) got=""
  while ((SECONDS < deadline)); do
    got=$(reach "$1" "$2")
    [[ "$got" == "$3" ]] && return 0
    sleep 0.2
  done
  fail "host $1 -> host $2: '$got', expected '$3' within 15 s"
}

json() { E --json show | python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

E create 2 --owner $$ || fail "create 2"
[[ $(json 'len(d["hosts"])') == 2 ]] || fail "show --json: not 2 hosts"
[[ $(E run 1 hostname) == host1 ]] || fail "host 1's hostname: $(E run 1 hostname)"
E run 1 ip -4 -o addr show dev eth0 | grep -q ' 198.18.0.2/24 ' || fail "host 1's address"
ip -4 -o addr show | grep -q '198\.18\.' && fail "the test-only range leaked into this machine's namespace"

E run 1 python3 "$probe" serve 9000 >/dev/null 2>&1 &
wait_reach 1 1 ok
wait_reach 0 1 ok

E cut 1 || fail "cut 1"
[[ $(json 'd["hosts"][1]["cut_from"]') == "[0]" ]] || fail "show: host 1 not cut from host 0"
[[ $(reach 0 1) == timeout ]] || fail "host 0 -> cut host 1: not a silent drop"
[[ $(reach 1 1) == ok ]] || fail "a cut host no longer reaches itself"
E heal 1 || fail "heal 1"
wait_reach 0 1 ok
[[ $(json 'd["hosts"][1]["cut_from"]') == "[]" ]] || fail "show: host 1 still cut after heal"

E cut 0 --from 1 || fail "cut 0 --from 1"
[[ $(reach 0 1) == timeout ]] || fail "a cut pair still connects"
E heal || fail "heal (all)"
wait_reach 0 1 ok

E rate 1 4m || fail "rate 1 4m"
[[ $(json 'd["hosts"][1]["rate_bps"]') == 4000000 ]] || fail "show: host 1's rate"
E rate 1 0 || fail "rate 1 0"
[[ $(json 'd["hosts"][1]["rate_bps"]') == 0 ]] || fail "show: host 1 still rate-limited"

# Refusals, each saying what to do.
out=$(E create 2 2>&1) && fail "a second create of '$name' succeeded"
grep -q "exist already" <<<"$out" || fail "second create: '$out'"
out=$(E cut 5 2>&1) && fail "cut of host 5 of 2 succeeded"
grep -q "has hosts 0..1" <<<"$out" || fail "cut 5: '$out'"
out=$(E rate 1 fast 2>&1) && fail "rate 'fast' accepted"
grep -q "is not a rate" <<<"$out" || fail "rate fast: '$out'"
out=$(bash "$emu" --name "nosuch-$$" show 2>&1) && fail "show of a set that does not exist"
grep -q "no emulated hosts named" <<<"$out" || fail "show nosuch: '$out'"
if command -v setpriv >/dev/null; then
  out=$(setpriv --reuid=65534 --regid=65534 --clear-groups bash "$emu" --name "$name" cut 1 2>&1) &&
    fail "cut as an unprivileged user succeeded"
  grep -q "needs root" <<<"$out" || fail "not root: '$out'"
fi

# Teardown: the probe server killed, namespaces and state gone; twice is fine.
E down || fail "down"
E down || fail "a second down failed"
ip netns list | grep -q "^$name-" && fail "namespaces left: $(ip netns list | grep "^$name-")"
[[ -e /run/zeroshard-emuhosts/$name ]] && fail "state left in /run/zeroshard-emuhosts/$name"
wait  # the backgrounded `run` ends with its namespace's processes

# A set whose owner is gone (a crashed test) is swept.
bash -c 'exit 0' &
gone=$!
wait "$gone"
E create 1 --owner "$gone" || fail "create 1 --owner $gone"
E sweep || fail "sweep"
ip netns list | grep -q "^$name-" && fail "sweep left $(ip netns list | grep "^$name-")"
echo PASS
