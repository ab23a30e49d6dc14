#!/bin/bash
# Every /metrics series the binaries can emit has a row in
# docs/observability.md: the names are read from the binaries themselves
# (their string literals), so a new series without a row fails here.
# Histograms count once (their _bucket, _count and _sum series).
# usage: metrics_doc_test.sh DOC BINARY...
set -u
doc=$1
shift
missing=0
for binary in "$@"; do
  names=$(strings "$binary" | grep -oE '\bzeroshard_[a-z0-9_]+' | sed -E 's/_(bucket|count|sum)$//' |
    sort -u)
  if [[ -z "$names" ]]; then
    echo "no zeroshard_ series names found in $binary (strings failed?)"
    exit 1
  fi
  for name in $names; do
    if ! grep -q "\`$name" "$doc"; then
      echo "$binary emits $name, which $doc does not list (add a row to its table)"
      missing=$((missing + 1))
    fi
  done
done
echo "$missing series missing from $doc"
[[ $missing -eq 0 ]]
