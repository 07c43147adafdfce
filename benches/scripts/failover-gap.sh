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
# Usage: benches/scripts/failover-gap.sh   (RUNS=1, TIME=16 seconds per
# publishing run; MIRRORQ_ONLY=1 skips RabbitMQ)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-1}
TIME=${TIME:-16}
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
  if [ -z "${MIRRORQ_ONLY:-}" ]; then
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
  start_mirrorq
  gap mirrorq kill-9 "mirrored-gap-$run" 5691 5692 kill -9 "$(cat "$DIR/m1.pid")"
  fresh
  start_mirrorq
  gap mirrorq SIGTERM "mirrored-term-$run" 5691 5692 term_mirrorq 1
  fresh
  start_mirrorq
  demo mirrorq "mirrored-demo-$run" 15691 15693 "$(cat "$DIR/m1.pid")" "$(cat "$DIR/m2.pid")"
  fresh
done
