#!/usr/bin/env bash
# Failover side by side: RabbitMQ classic mirrored (ha-mode all), RabbitMQ
# quorum, mirrorq (ha-mode all); 3-node clusters on loopback, defaults.
#
# - kill -9 / SIGTERM of the master: the queue declared on node 1 (its
#   master there), one `mirrorq perf` publisher on node 2 with one publish
#   in flight, node 1 killed (or sent SIGTERM) 6 s in; the gap is the run's
#   longest confirm wait.
# - the classic demo: a persistent message published on node 1 over HTTP,
#   nodes 1 and 2 killed with kill -9 at once, node 3 asked over HTTP for a
#   get every 20 ms; the time until it serves the message (or "never" after
#   30 s: a quorum queue without a majority refuses).
#
# - the false-failover soak: SOAK seconds (default 600; 0 skips it) of
#   `mirrorq perf` at full rate (2 producers and 2 consumers, 1,000 in
#   flight each, on nodes 2 and 3) against a queue mastered on node 1,
#   plus two busy loops, so both cores are at 100%. Counted: elections won
#   and re-forms (mirrorq's /metrics, every node, before and after), and
#   for both systems every change of the queue's master seen by sampling
#   the HTTP API each second.
#
# Usage: benches/scripts/failover-gap.sh   (RUNS=1, TIME=16 seconds per
# publishing run; MIRRORQ_ONLY=1 skips RabbitMQ; SOAK=600; SOAK_ONLY=1 runs
# the soak alone)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-1}
TIME=${TIME:-16}
SOAK=${SOAK:-600}
DIR=$(mktemp -d /tmp/failover-gap.XXXXXX)
# shellcheck source=benches/scripts/clusters.sh
. benches/scripts/clusters.sh
trap cleanup EXIT

# gap SYSTEM EVENT QUEUE PORT1 PORT2 CMD...: declare on node 1, publish on node 2, run CMD.
gap() {
  local system=$1 event=$2 queue=$3 p1=$4 p2=$5; shift 5
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
print(f'$system $event: longest confirm wait {r[\"confirm_latency_ms\"][\"max\"]:.0f} ms, '
      f'{r[\"confirmed\"]} confirmed, {r[\"nacked\"]} nacked in $TIME s')"
}

# demo SYSTEM QUEUE HTTP1 HTTP3 PID1 PID2 [QUEUE-ARGS-JSON]: the classic demo over HTTP.
demo() {
  local system=$1 queue=$2 h1=$3 h3=$4 pid1=$5 pid2=$6 args=${7:-"{}"}
  local api=(curl -sf -u guest:guest -H 'content-type: application/json')
  "${api[@]}" -X PUT "http://127.0.0.1:$h1/api/queues/%2F/$queue" \
    -d "{\"durable\":true,\"arguments\":$args}" > /dev/null
  "${api[@]}" -X POST "http://127.0.0.1:$h1/api/exchanges/%2F/amq.default/publish" \
    -d '{"properties":{"delivery_mode":2},"routing_key":"'"$queue"'","payload":"hello","payload_encoding":"string"}' \
    > /dev/null
  sleep 2  # mirrored everywhere (RabbitMQ's publish answer does not wait for the mirrors)
  kill -9 "$pid1" "$pid2"
  local killed; killed=$(date +%s.%N)
  python3 - "$h3" "$system" "$queue" "$killed" <<'PY'
import base64, json, sys, time, urllib.request
port, system, queue, killed = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
start = time.monotonic() - (time.time() - killed)  # the kill, not this interpreter's start
body = json.dumps({"count": 1, "ackmode": "ack_requeue_true", "encoding": "auto"}).encode()
auth = "Basic " + base64.b64encode(b"guest:guest").decode()
while time.monotonic() - start < 30:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/queues/%2F/{queue}/get", data=body,
                                 headers={"content-type": "application/json", "authorization": auth})
    try:
        got = json.load(urllib.request.urlopen(req, timeout=5))
        if got and got[0].get("payload") == "hello":
            print(f"{system} classic demo: node 3 served the message {1000 * (time.monotonic() - start):.0f} ms after the kills")
            sys.exit(0)
    except Exception:
        pass
    time.sleep(0.02)
print(f"{system} classic demo: node 3 never served the message in 30 s")
PY
}

# Sum of a counter over mirrorq's three nodes' /metrics.
mq_counter() {
  local sum=0 v
  for h in 15691 15692 15693; do
    v=$(curl -sf "http://127.0.0.1:$h/metrics" | awk -v n="$1" '$1 == n || $1 == n"_total" {print $2}' | head -1)
    sum=$((sum + ${v:-0}))
  done
  echo "$sum"
}

# soak SYSTEM QUEUE PORT1 PORT2 PORT3 HTTP1 [--quorum]: SOAK seconds of full-rate
# load plus busy loops; prints the master changes seen.
soak() {
  local system=$1 queue=$2 p1=$3 p2=$4 p3=$5 h1=$6; shift 6
  "$BIN" perf --uri "amqp://guest:guest@127.0.0.1:$p1/%2f" "$@" --queue "$queue" --consumers 0 \
    --pmessages 1 --time 10 --json > /dev/null
  local before=()
  if [ "$system" = mirrorq ]; then
    before=("$(mq_counter mirrorq_queue_leaderships)" "$(mq_counter mirrorq_queue_reforms)" \
      "$(mq_counter mirrorq_metadata_leaderships)")
  fi
  local pids=()
  for p in "$p2" "$p3"; do
    "$BIN" perf --uri "amqp://guest:guest@127.0.0.1:$p/%2f" "$@" --queue "$queue" --consumers 1 \
      --time "$SOAK" --json > "$DIR/soak-$p.json" 2>/dev/null &
    pids+=($!)
  done
  local hogs=()
  for _ in 1 2; do python3 -c 'while True: pass' & hogs+=($!); done
  python3 - "$h1" "$queue" "$SOAK" "$system" > "$DIR/soak-masters.txt" <<'PY'
import base64, json, sys, time, urllib.request
port, queue, secs, system = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
auth = "Basic " + base64.b64encode(b"guest:guest").decode()
key = "node" if system == "mirrorq" else "leader"
seen, changes, unanswered = None, 0, 0
end = time.monotonic() + secs
while time.monotonic() < end:
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/queues/%2F/{queue}", headers={"authorization": auth})
        master = json.load(urllib.request.urlopen(req, timeout=5)).get(key)
        if seen is not None and master != seen:
            changes += 1
        seen = master
    except Exception:
        unanswered += 1
    time.sleep(1)
print(changes, unanswered)
PY
  kill "${hogs[@]}" 2>/dev/null || true
  for p in "${pids[@]}"; do wait "$p" || true; done
  local changes unanswered; read -r changes unanswered < "$DIR/soak-masters.txt"
  local rates; rates=$(python3 - "$SOAK" "$DIR/soak-$p2.json" "$DIR/soak-$p3.json" <<'PY'
import json, sys
rs = [json.load(open(f)) for f in sys.argv[2:]]
secs = int(sys.argv[1])
print(f"{sum(r['confirmed'] for r in rs) / secs:.0f} confirmed msg/s, "
      f"longest confirm wait {max(r['confirm_latency_ms']['max'] for r in rs):.0f} ms")
PY
)
  if [ "$system" = mirrorq ]; then
    local won=$(( $(mq_counter mirrorq_queue_leaderships) - before[0] ))
    local reforms=$(( $(mq_counter mirrorq_queue_reforms) - before[1] ))
    local meta=$(( $(mq_counter mirrorq_metadata_leaderships) - before[2] ))
    echo "$system soak ${SOAK}s at full CPU: $won queue elections won, $reforms re-forms, $meta metadata elections won, $changes master changes seen, $unanswered API samples unanswered; $rates"
  else
    echo "$system soak ${SOAK}s at full CPU: $changes leader changes seen, $unanswered API samples unanswered; $rates"
  fi
}

# Stop RabbitMQ node 1 with SIGTERM (a clean stop) and wait for it to exit.
stop_rabbit_node_1() {
  local pid; pid=$(cat "$DIR/r1/pid")
  kill -TERM "$pid"
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
}
# Stop a mirrorq node with SIGTERM and wait for it to exit.
term_mirrorq() {
  local pid; pid=$(cat "$DIR/m$1.pid")
  kill -TERM "$pid"
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
}
fresh() { cleanup; mkdir -p "$DIR"; printf MIRRORQCOMPARECOOKIE > "$DIR/.erlang.cookie"; chmod 400 "$DIR/.erlang.cookie"; }

for run in $(seq "$RUNS"); do
  if [ -z "${MIRRORQ_ONLY:-}" ] && [ -z "${SOAK_ONLY:-}" ]; then
    start_rabbitmq
    gap rabbitmq-mirrored kill-9 "mirrored-gap-$run" 5681 5682 kill -9 "$(cat "$DIR/r1/pid")"
    start_rabbit_node 1
    gap rabbitmq-quorum kill-9 "quorum-gap-$run" 5681 5682 kill -9 "$(cat "$DIR/r1/pid")"
    start_rabbit_node 1
    gap rabbitmq-mirrored SIGTERM "mirrored-term-$run" 5681 5682 stop_rabbit_node_1
    start_rabbit_node 1
    gap rabbitmq-quorum SIGTERM "quorum-term-$run" 5681 5682 stop_rabbit_node_1
    start_rabbit_node 1
    demo rabbitmq-mirrored "mirrored-demo-$run" 15681 15683 "$(cat "$DIR/r1/pid")" "$(cat "$DIR/r2/pid")"
    start_rabbit_node 1; start_rabbit_node 2
    demo rabbitmq-quorum "quorum-demo-$run" 15681 15683 "$(cat "$DIR/r1/pid")" "$(cat "$DIR/r2/pid")" \
      '{"x-queue-type":"quorum"}'
    fresh
  fi
  if [ -z "${MIRRORQ_ONLY:-}" ] && [ "$run" = 1 ] && [ "$SOAK" != 0 ]; then
    start_rabbitmq
    soak rabbitmq-quorum "quorum-soak" 5681 5682 5683 15681 --quorum
    fresh
  fi
  if [ -z "${SOAK_ONLY:-}" ]; then
    start_mirrorq
    gap mirrorq kill-9 "mirrored-gap-$run" 5691 5692 kill -9 "$(cat "$DIR/m1.pid")"
    fresh
    start_mirrorq
    gap mirrorq SIGTERM "mirrored-term-$run" 5691 5692 term_mirrorq 1
    fresh
    start_mirrorq
    demo mirrorq "mirrored-demo-$run" 15691 15693 "$(cat "$DIR/m1.pid")" "$(cat "$DIR/m2.pid")"
    fresh
  fi
  if [ "$run" = 1 ] && [ "$SOAK" != 0 ]; then
    start_mirrorq
    soak mirrorq "mirrored-soak" 5691 5692 5693 15691
    fresh
  fi
done
