#!/usr/bin/env bash
# compare_gpt.py on benches' JSON written here: medians over rounds, the
# ratio to PyTorch's eager run (never the compiled one), the COMPILED column
# ("-" without a compiled run), stage labels, and its --json_out.
set -euo pipefail
compare="$1"
d="$(mktemp -d)"
trap 'rm -rf "$d"' EXIT
ours() {  # FILE TPS [STAGE PREFETCH COLLECTIVES]
  cat >"$1" <<JSON
{"device": "test GPU", "results": [
 {"model": "m", "dtype": "bf16", "attention": "cudnn", "stage": ${3:-0}, "prefetch": ${4:-1},
  "collectives": "${5:-packed}", "tokens_per_second": $2, "device_peak_bytes": 1073741824}]}
JSON
}
torch() {  # FILE TPS COMPILED DTYPE
  cat >"$1" <<JSON
{"results": [{"model": "m", "dtype": "${4:-bf16}", "compiled": $3, "tokens_per_second": $2,
  "device_peak_bytes": 2147483648}]}
JSON
}
ours "$d/a.1.json" 300
ours "$d/a.2.json" 330
ours "$d/a.3.json" 310
ours "$d/b.1.json" 200 3 1 blocks
ours "$d/s.1.json" 279 3 1 packed
torch "$d/t.1.json" 100 false
torch "$d/t.2.json" 110 false
torch "$d/t.3.json" 90 false
torch "$d/c.1.json" 150 true
torch "$d/c.2.json" 170 true
torch "$d/f.1.json" 999 true f32  # another dtype: not in the bf16 rows
python3 "$compare" "$d"/a.*.json "$d"/b.1.json "$d"/s.1.json -- "$d"/t.*.json "$d"/c.*.json \
  "$d"/f.1.json \
  --json_out="$d/out.json" >"$d/table.txt"
cat "$d/table.txt"
fail() { echo "FAIL: $*" >&2; exit 1; }
grep -q "COMPILED" "$d/table.txt" || fail "no COMPILED column"
# Stage 0: median 310 over eager median 100 -> 3.10; compiled median 160.
grep -Eq '^m +bf16 +cudnn +0 +310 +100 +3\.10 +1\.00 +2\.00 +160 +3$' "$d/table.txt" ||
  fail "stage 0 row"
grep -Eq '^m +bf16 +cudnn +3 blk +200 +100 +2\.00 .* 160 +1$' "$d/table.txt" || fail "3 blk row"
# Stage 3 (packed, prefetch 1) beside stage 0: 279 against 310, 10.0 % behind;
# the block collectives' stage 3 is not that comparison.
grep -Eq '^m +bf16 +cudnn +310 +279 +10\.0%$' "$d/table.txt" || fail "stage 3 against stage 0"
python3 - "$d/out.json" <<'PY' || fail "json_out"
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
assert len(rows) == 3, rows
r = rows[0]
assert r["ratio"] == 3.1 and r["torch_tokens_per_second"] == 100, r
assert r["torch_compiled_tokens_per_second"] == 160, r
versus = json.load(open(sys.argv[1]))["stage3_vs_stage0"]
assert len(versus) == 1 and abs(versus[0]["stage3_behind"] - 0.1) < 1e-12, versus
PY
# Without a compiled run the column says "-" and the JSON null.
python3 "$compare" "$d"/a.1.json -- "$d"/t.1.json --json_out="$d/out2.json" >"$d/table2.txt"
grep -Eq '^m +bf16 +cudnn +0 +300 +100 +3\.00 .* - +1$' "$d/table2.txt" || fail "no-compile row"
python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; assert r['torch_compiled_tokens_per_second'] is None, r" "$d/out2.json" ||
  fail "null compiled"
echo PASS
