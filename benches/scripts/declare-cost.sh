#!/usr/bin/env bash
# What a declare costs as queues accumulate: three mirrorq nodes on
# loopback, policy ha-mode all, then BATCHES batches of 1,000 durable
# queues declared over the HTTP API by P clients spread over the nodes,
# each on one keep-alive connection (scale.py's declare).
# For each batch: declares per second, and the CPU (utime + stime from
# /proc, all three nodes) per declare. A cost that grows batch after batch
# is a cost per queue hidden in each declare.
#
# Usage: benches/scripts/declare-cost.sh
#   BATCHES=10 P=8 (defaults); MIRRORQ_BIN=target/release/mirrorq (built if missing)
#   VIA=amqp: declare with AMQP queue.declare (pika) instead of HTTP
#   PERF=FILE: record node 1 with perf (call graphs) during the last batch;
#   with PERF_ALL=1 every CPU instead, without call graphs
set -euo pipefail
cd "$(dirname "$0")/../.."
BATCHES=${BATCHES:-10}
P=${P:-8}
BIN=${MIRRORQ_BIN:-target/release/mirrorq}
[ -x "$BIN" ] || cargo build --release --quiet --bin mirrorq
BIN=$(realpath "$BIN")
export BIN MIRRORQ_ONLY=1 MIRRORQ_LOG=${MIRRORQ_LOG:-warn}
DIR=$(mktemp -d /tmp/declare-cost.XXXXXX)
# shellcheck source=benches/scripts/clusters.sh
. benches/scripts/clusters.sh
trap cleanup EXIT
start_mirrorq
"$BIN" ctl --url http://127.0.0.1:15691 set-policy ha-all '^scale-' \
  '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues >/dev/null
cpu() {
  local t=0 i a b
  for i in 1 2 3; do
    read -r a b < <(cut -d' ' -f14,15 "/proc/$(cat "$DIR/m$i.pid")/stat")
    t=$((t + a + b))
  done
  echo $t
}
# Sum of one counter over the three nodes' metrics.
counter() {
  local t=0 i v
  for i in 1 2 3; do
    v=$(curl -sf "http://127.0.0.1:1569$i/metrics" | awk -v n="$1" '$1 == n {print $2}')
    t=$((t + ${v%.*}))
  done
  echo $t
}
hz=$(getconf CLK_TCK)
echo "Run $(date -u '+%Y-%m-%d %H:%M') UTC at $(git rev-parse --short HEAD), $(nproc) cores; BATCHES=$BATCHES P=$P VIA=${VIA:-http}"
echo "| queues | declares/s | CPU per declare, 3 nodes (ms) | syncs per declare | appends received per declare |"
echo "|---|---|---|---|---|"
perf_pid=
for b in $(seq 1 "$BATCHES"); do
  if [ "$b" -eq "$BATCHES" ] && [ -n "${PERF:-}" ]; then
    if [ -n "${PERF_ALL:-}" ]; then
      # Every CPU, no call graphs: what each process and function costs.
      perf record -a -F "${PERF_HZ:-999}" -o "$PERF" >/dev/null 2>&1 &
    else
      perf record -F "${PERF_HZ:-250}" --call-graph dwarf,32768 -p "$(cat "$DIR/m1.pid")" -o "$PERF" >/dev/null 2>&1 &
    fi
    perf_pid=$!
  fi
  s0=$(counter mirrorq_fsync_seconds_count)
  a0=$(counter mirrorq_raft_appends_received_total)
  c0=$(cpu)
  t0=$(date +%s.%N)
  if [ "${VIA:-http}" = amqp ]; then
    SCALE_FIRST=$(((b - 1) * 1000)) SCALE_RESULTS=$DIR/results.jsonl \
      python3 benches/scripts/scale.py declare-amqp mirrorq 1000 "$P" 5691 5692 5693
  else
    SCALE_FIRST=$(((b - 1) * 1000)) SCALE_RESULTS=$DIR/results.jsonl \
      python3 benches/scripts/scale.py declare mirrorq 1000 "$P" 15691 15692 15693
  fi
  t1=$(date +%s.%N)
  c1=$(cpu)
  s1=$(counter mirrorq_fsync_seconds_count)
  a1=$(counter mirrorq_raft_appends_received_total)
  python3 -c "print(f'| {$(((b - 1) * 1000 + 1))}-{$((b * 1000))} | {1000 / ($t1 - $t0):.1f} | {($c1 - $c0) * 1000 / $hz / 1000:.2f} | {($s1 - $s0) / 1000:.2f} | {($a1 - $a0) / 1000:.2f} |')"
done
[ -z "$perf_pid" ] || { kill -INT "$perf_pid"; wait "$perf_pid" || true; }
