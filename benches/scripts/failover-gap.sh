#!/usr/bin/env bash
# The longest wait for a publisher confirm when a queue's master (leader)
# is killed with `kill -9`, side by side: RabbitMQ classic mirrored
# (ha-mode all), RabbitMQ quorum, mirrorq (ha-mode all). Each: a 3-node
# cluster on loopback, the queue declared on node 1 (its master there), one
# `mirrorq perf` publisher on node 2 with one publish in flight, node 1
# killed 6 s in; the gap is the run's longest confirm latency.
# Usage: benches/scripts/failover-gap.sh   (RUNS=1, TIME=16 seconds per run;
# MIRRORQ_ONLY=1 skips RabbitMQ)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-1}
TIME=${TIME:-16}
DIR=$(mktemp -d /tmp/failover-gap.XXXXXX)
# shellcheck source=benches/scripts/clusters.sh
. benches/scripts/clusters.sh
trap cleanup EXIT

# gap SYSTEM QUEUE PORT1 PORT2 KILL...: declare on node 1, publish on node 2, kill node 1.
gap() {
  local system=$1 queue=$2 p1=$3 p2=$4; shift 4
  local q=(); [ "$system" = rabbitmq-quorum ] && q=(--quorum)
  "$BIN" perf --uri "amqp://guest:guest@127.0.0.1:$p1/%2f" "${q[@]}" --queue "$queue" --consumers 0 \
    --pmessages 1 --time 10 --json > /dev/null
  "$BIN" perf --uri "amqp://guest:guest@127.0.0.1:$p2/%2f" "${q[@]}" --queue "$queue" --consumers 0 \
    --confirm 1 --time "$TIME" --json > "$DIR/gap.json" 2>/dev/null &
  local perf=$!
  sleep 6
  "$@"
  wait $perf || true
  python3 -c "
import json; r = json.load(open('$DIR/gap.json'))
print(f'$system: longest confirm wait {r[\"confirm_latency_ms\"][\"max\"]:.0f} ms, '
      f'{r[\"confirmed\"]} confirmed, {r[\"nacked\"]} nacked in $TIME s')"
}

for run in $(seq "$RUNS"); do
  if [ -z "${MIRRORQ_ONLY:-}" ]; then
    start_rabbitmq
    gap rabbitmq-mirrored "mirrored-gap-$run" 5681 5682 kill -9 "$(cat "$DIR/r1/pid")"
    start_rabbit_node 1
    gap rabbitmq-quorum "quorum-gap-$run" 5681 5682 kill -9 "$(cat "$DIR/r1/pid")"
    cleanup; mkdir -p "$DIR"; printf MIRRORQCOMPARECOOKIE > "$DIR/.erlang.cookie"; chmod 400 "$DIR/.erlang.cookie"
  fi
  start_mirrorq
  gap mirrorq "mirrored-gap-$run" 5691 5692 kill -9 "$(cat "$DIR/m1.pid")"
  cleanup; mkdir -p "$DIR"; printf MIRRORQCOMPARECOOKIE > "$DIR/.erlang.cookie"; chmod 400 "$DIR/.erlang.cookie"
done
