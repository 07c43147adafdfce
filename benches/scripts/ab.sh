#!/usr/bin/env bash
# A/B of mirrorq binaries on this noisy machine: each binary gets a fresh
# 3-node cluster (benches/scripts/clusters.sh) and runs the same short cases, the
# binaries alternating ROUNDS times so drift hits them alike. One line per
# case: name, confirmed msg/s, consumed msg/s, confirm p99 ms.
# Usage: benches/scripts/ab.sh OLD_BIN NEW_BIN [...]   (ROUNDS=2, T=6 s per case,
#        CASES="w1-100 w1000-100 w1-4k w1000-4k drain")
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-2}
T=${T:-6}
CASES=${CASES:-"w1-100 w1000-100 w1-4k w1000-4k drain"}
[ $# -ge 1 ] || { echo "usage: $0 BIN [BIN...]" >&2; exit 2; }
DIR=$(mktemp -d /tmp/ab.XXXXXX)
MIRRORQ_ONLY=1
BIN=$(realpath "$1")
# shellcheck source=benches/scripts/clusters.sh
. benches/scripts/clusters.sh
trap cleanup EXIT

run() {
  local name=$1; shift
  "$BIN" perf --uri amqp://guest:guest@127.0.0.1:5691/%2f --json "$@" | python3 -c "
import json, sys; d = json.load(sys.stdin)
print('  $name', round(d['confirmed_per_sec']), round(d['consumed_per_sec']), d['confirm_latency_ms']['p99'])"
}

for round in $(seq "$ROUNDS"); do
  for b in "$@"; do
    BIN=$(realpath "$b")
    echo "round $round: $b"
    start_mirrorq
    for c in $CASES; do
      q=mirrored-$c-$round
      case $c in
        w1-100) run "$c" --queue "$q" --size 100 --confirm 1 --time "$T" ;;
        w1000-100) run "$c" --queue "$q" --size 100 --confirm 1000 --time "$T" ;;
        w1-4k) run "$c" --queue "$q" --size 4096 --confirm 1 --time "$T" ;;
        w1000-4k) run "$c" --queue "$q" --size 4096 --confirm 1000 --time "$T" ;;
        drain)
          run fill --queue "$q" --size 100 --confirm 1000 --consumers 0 --pmessages 50000 --time 60
          run drain --queue "$q" --size 100 --producers 0 --cmessages 50000 --time 60 ;;
        *) echo "unknown case $c" >&2; exit 2 ;;
      esac
    done
    cleanup
    mkdir -p "$DIR"
  done
done
