#!/usr/bin/env bash
# Three `mirrorq serve` processes on loopback, a policy `ha-mode: all`, and
# `mirrorq perf` over AMQP for each case. Prints one JSON line per case.
# Usage: benches/scripts/cluster-perf.sh [SECONDS]   (builds the release binary)
# CONSUMERS=0 measures publishing alone (default: one consumer running too).
set -euo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-10}
CONSUMERS=${CONSUMERS:-1}
# MIRRORQ_BIN=path uses an already built binary.
BIN=${MIRRORQ_BIN:-target/release/mirrorq}
[ -n "${MIRRORQ_BIN:-}" ] || cargo build --release --quiet
DIR=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"' EXIT
C=1=127.0.0.1:26671,2=127.0.0.1:26672,3=127.0.0.1:26673
for i in 1 2 3; do
  MIRRORQ_LOG=warn $BIN serve --node-id $i --data-dir "$DIR/n$i" --raft-listen 127.0.0.1:2667$i \
    --amqp-listen 127.0.0.1:567$((i+2)) --http-listen 127.0.0.1:1567$((i+2)) --cluster $C 2>"$DIR/n$i.log" &
done
for _ in $(seq 100); do
  curl -fsu guest:guest http://127.0.0.1:15673/api/overview >/dev/null 2>&1 && break
  sleep 0.2
done
curl -fsu guest:guest -X PUT -H 'content-type: application/json' \
  http://127.0.0.1:15673/api/policies/%2F/ha-all -d '{"pattern":"^perf","definition":{"ha-mode":"all","ha-sync-mode":"automatic"}}'
# Publish and consume on node 1: the master of each queue is wherever
# min-masters put it, as for any client of a RabbitMQ cluster.
URI=amqp://guest:guest@127.0.0.1:5673/%2f
for size in 100 4096; do
  for window in 1 1000; do
    q=perf-$size-$window
    printf '{"case":"%s",' "$q"
    $BIN perf --uri $URI --queue $q --size $size --confirm $window --consumers "$CONSUMERS" --time "$SECS" --json | sed 's/^{//'
  done
done
