#!/usr/bin/env bash
# What the power-cut work costs the publish path, and what faultfs costs a
# campaign: three `mirrorq serve` processes on loopback (each in its own
# session, as separate machines would be scheduled), `ha-mode: all`, one
# `mirrorq perf` client, 100 B, at 1 and 1,000 in flight, for each binary
# given, with the data dirs on the plain disk and on faultfs (--strict).
# Prints one JSON line per case. Needs root and /dev/fuse for faultfs.
# Usage: benches/scripts/faultfs-cost.sh FAULTFS_BIN LABEL=MIRRORQ_BIN...
#   e.g. faultfs-cost.sh target/release/faultfs before=/tmp/old/mirrorq after=target/release/mirrorq
set -euo pipefail
cd "$(dirname "$0")/../.."
FAULTFS=$(realpath "$1"); shift
SECS=${SECS:-10}
DIR=$(mktemp -d)
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  pkill -f "serve --node-id .* --data-dir $DIR" 2>/dev/null || true
  sleep 0.5
  for m in "$DIR"/*/n*.mnt; do [ -d "$m" ] && { umount -l "$m" 2>/dev/null || true; }; done
  pkill -f "faultfs mount --backing $DIR" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
C=1=127.0.0.1:26671,2=127.0.0.1:26672,3=127.0.0.1:26673
run() {  # label bin fs
  local label=$1 bin=$2 fs=$3 d="$DIR/$1-$3"
  mkdir -p "$d"
  for i in 1 2 3; do
    local data="$d/n$i"
    if [ "$fs" = faultfs ]; then
      mkdir -p "$d/n$i.disk" "$d/n$i.mnt"
      setsid "$FAULTFS" mount --backing "$d/n$i.disk" --mountpoint "$d/n$i.mnt" --control "$d/n$i.sock" --strict \
        2>"$d/fs$i.log" &
      for _ in $(seq 100); do mountpoint -q "$d/n$i.mnt" && break; sleep 0.05; done
      data="$d/n$i.mnt/data"
    fi
    MIRRORQ_LOG=warn setsid "$bin" serve --node-id $i --data-dir "$data" --raft-listen 127.0.0.1:2667$i \
      --amqp-listen 127.0.0.1:567$((i+2)) --http-listen 127.0.0.1:1567$((i+2)) --cluster $C 2>"$d/n$i.log" &
  done
  for _ in $(seq 150); do
    curl -fsu guest:guest http://127.0.0.1:15673/api/overview >/dev/null 2>&1 && break
    sleep 0.2
  done
  curl -fsu guest:guest -X PUT -H 'content-type: application/json' \
    http://127.0.0.1:15673/api/policies/%2F/ha-all -d '{"pattern":"^perf","definition":{"ha-mode":"all"}}'
  for window in 1 1000; do
    printf '{"binary":"%s","fs":"%s","window":%s,' "$label" "$fs" "$window"
    "$bin" perf --uri amqp://guest:guest@127.0.0.1:5673/%2f --queue "perf-$window" --size 100 --confirm $window \
      --consumers 1 --time "$SECS" --json | sed 's/^{//'
  done
  pkill -f -- "--data-dir $d/" || true
  sleep 1
  if [ "$fs" = faultfs ]; then
    for i in 1 2 3; do umount -l "$d/n$i.mnt" 2>/dev/null || true; done
    pkill -f "faultfs mount --backing $d/" || true
  fi
  sleep 1
}
for pair in "$@"; do
  for fs in plain faultfs; do
    run "${pair%%=*}" "$(realpath "${pair#*=}")" "$fs"
  done
done
