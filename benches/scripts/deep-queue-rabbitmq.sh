#!/usr/bin/env bash
# RabbitMQ's figures for what `cargo bench --bench deep_queue` measures of
# mirrorq: one node, N x 1 KiB persistent messages in one queue (KIND
# quorum, or classic), the broker's RSS with them queued, and the time from
# `kill -9` and restart to serving the queue with all N again (an AMQP
# passive declare answers with the count). Loopback only; stops what it
# started. Usage: N=1000000 KIND=quorum benches/scripts/deep-queue-rabbitmq.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${N:-1000000}
KIND=${KIND:-quorum}
DIR=$(mktemp -d /tmp/deep-rabbitmq.XXXXXX)
# One node of the side-by-side set-up: rmq1@localhost, AMQP 5681.
# shellcheck source=benches/scripts/clusters.sh
. benches/scripts/clusters.sh
trap cleanup EXIT
# Seconds until the queue answers with N messages.
serving() {
  python3 - "$N" <<'PY'
import sys, time, pika
n, t0 = int(sys.argv[1]), time.time()
while True:
    try:
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", 5681))
        ch = c.channel()
        count = ch.queue_declare("deep", passive=True).method.message_count
        c.close()
        if count == n:
            print(f"{time.time() - t0:.2f}")
            break
    except Exception:
        pass
    time.sleep(0.05)
PY
}
start_rabbit_node 1
URI=amqp://guest:guest@127.0.0.1:5681/%2f
q=(); [ "$KIND" = quorum ] && q=(--quorum)
"$BIN" perf --uri $URI "${q[@]}" --queue deep --producers 8 --consumers 0 --pmessages $((N / 8)) \
  --size 1024 --confirm 200 --time 1200 --json | sed "s/^/fill ($KIND): /"
sleep 5
echo "rss with $N x 1 KiB queued ($KIND): $(( $(ps -o rss= -p "$(cat "$DIR/r1/pid")") / 1024 )) MB"
echo "data dir: $(du -sm "$DIR/r1/mnesia" | cut -f1) MB"
kill -9 "$(cat "$DIR/r1/pid")"
sleep 1
launch_rabbit_node 1
secs=$(serving)
echo "kill -9 to serving the queue with $N: $secs s (from launch)"
sleep 5
echo "rss after restart: $(( $(ps -o rss= -p "$(cat "$DIR/r1/pid")") / 1024 )) MB"
