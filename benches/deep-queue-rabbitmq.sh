#!/usr/bin/env bash
# RabbitMQ's figures for what `cargo bench --bench deep_queue` measures of
# mirrorq: one node, N x 1 KiB persistent messages in one queue (KIND
# quorum, or classic), the broker's RSS with them queued, and the time from
# `kill -9` and restart to serving the queue with all N again (an AMQP
# passive declare answers with the count). Loopback only; stops what it
# started. Usage: N=1000000 KIND=quorum benches/deep-queue-rabbitmq.sh
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-1000000}
KIND=${KIND:-quorum}
BIN=${MIRRORQ_BIN:-target/release/mirrorq}
[ -n "${MIRRORQ_BIN:-}" ] || cargo build --release --quiet --bin mirrorq
BIN=$(realpath "$BIN")
RMQ=/usr/lib/rabbitmq/bin
EPMD_BEFORE=$(pgrep -x epmd || true)
DIR=$(mktemp -d /tmp/deep-rabbitmq.XXXXXX)
export HOME=$DIR ERL_EPMD_ADDRESS=127.0.0.1
export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
printf MIRRORQDEEPCOOKIE > "$DIR/.erlang.cookie"; chmod 400 "$DIR/.erlang.cookie"
printf 'listeners.tcp.default = 127.0.0.1:5685\nmanagement.tcp.ip = 127.0.0.1\nmanagement.tcp.port = 15685\n' > "$DIR/rabbitmq.conf"
echo "[rabbitmq_management]." > "$DIR/enabled_plugins"
cleanup() {
  [ -f "$DIR/pid" ] && kill -9 "$(cat "$DIR/pid")" 2>/dev/null || true
  # epmd outlives the nodes; stop it if this script started it.
  [ -n "${EPMD_BEFORE:-}" ] || epmd -kill >/dev/null 2>&1 || true
  rm -rf "$DIR"
}
trap cleanup EXIT
start() {
  RABBITMQ_NODENAME=deep@localhost RABBITMQ_DIST_PORT=25685 RABBITMQ_CONFIG_FILE=$DIR/rabbitmq.conf \
    RABBITMQ_ENABLED_PLUGINS_FILE=$DIR/enabled_plugins RABBITMQ_MNESIA_BASE=$DIR/mnesia \
    RABBITMQ_LOG_BASE=$DIR/log RABBITMQ_PLUGINS_EXPAND_DIR=$DIR/plugins RABBITMQ_PID_FILE=$DIR/pid \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}" \
    setsid "$RMQ/rabbitmq-server" >> "$DIR/out.log" 2>&1 &
}
# Seconds until the queue answers with N messages.
serving() {
  python3 - "$N" <<'PY'
import sys, time, pika
n, t0 = int(sys.argv[1]), time.time()
while True:
    try:
        c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", 5685))
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
start
"$RMQ/rabbitmqctl" -n deep@localhost wait "$DIR/pid" --timeout 120 >/dev/null
URI=amqp://guest:guest@127.0.0.1:5685/%2f
q=(); [ "$KIND" = quorum ] && q=(--quorum)
"$BIN" perf --uri $URI "${q[@]}" --queue deep --producers 8 --consumers 0 --pmessages $((N / 8)) \
  --size 1024 --confirm 200 --time 1200 --json | sed "s/^/fill ($KIND): /"
sleep 5
echo "rss with $N x 1 KiB queued ($KIND): $(( $(ps -o rss= -p "$(cat "$DIR/pid")") / 1024 )) MB"
echo "data dir: $(du -sm "$DIR/mnesia" | cut -f1) MB"
kill -9 "$(cat "$DIR/pid")"
sleep 1
start
secs=$(serving)
echo "kill -9 to serving the queue with $N: $secs s (from launch)"
sleep 5
echo "rss after restart: $(( $(ps -o rss= -p "$(cat "$DIR/pid")") / 1024 )) MB"
