#!/usr/bin/env bash
# Side by side, in one run, with one client (`mirrorq perf`) on this machine:
#   - RabbitMQ classic mirrored queues (ha-mode all), 3 nodes
#   - RabbitMQ quorum queues (3 replicas), the same 3 nodes
#   - mirrorq (ha-mode all: every replica fsyncs before a confirm), 3 nodes
# Every server listens on loopback only. Installs Debian's rabbitmq-server if
# missing; stops everything it started. Results: $OUT/results.jsonl, then
# benches/compare_report.py writes the table into docs/benchmarks.md and the
# chart docs/compare-rabbitmq.png.
#
# Usage: benches/compare-rabbitmq.sh            (TIME=10 seconds per case)
#        MIRRORQ_BIN=target/release/mirrorq SYSTEMS="mirrorq" benches/compare-rabbitmq.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TIME=${TIME:-10}
DRAIN=${DRAIN:-50000}
SYSTEMS=${SYSTEMS:-"rabbitmq-mirrored rabbitmq-quorum mirrorq"}
OUT=${OUT:-target/compare}
BIN=${MIRRORQ_BIN:-target/release/mirrorq}
[ -n "${MIRRORQ_BIN:-}" ] || cargo build --release --quiet --bin mirrorq
BIN=$(realpath "$BIN")
mkdir -p "$OUT"
: > "$OUT/results.jsonl"
DIR=$(mktemp -d /tmp/compare-rabbitmq.XXXXXX)
RMQ=/usr/lib/rabbitmq/bin

cleanup() {
  for i in 1 2 3; do
    [ -f "$DIR/r$i/pid" ] && kill "$(cat "$DIR/r$i/pid")" 2>/dev/null || true
  done
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
  pkill -f "epmd.*-address 127.0.0.1" 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT

if [ ! -x $RMQ/rabbitmq-server ]; then
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get install -y -q --no-install-recommends rabbitmq-server >/dev/null \
    || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends rabbitmq-server >/dev/null; }
fi

# --- RabbitMQ: three nodes rmq1..3@localhost, AMQP 5681-5683, management 15681-15683.
export HOME=$DIR ERL_EPMD_ADDRESS=127.0.0.1
export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
printf MIRRORQCOMPARECOOKIE > "$DIR/.erlang.cookie"
chmod 400 "$DIR/.erlang.cookie"
ctl() { "$RMQ/rabbitmqctl" -n "rmq$1@localhost" "${@:2}" >/dev/null; }
start_rabbitmq() {
  for i in 1 2 3; do
    mkdir -p "$DIR/r$i"
    printf 'listeners.tcp.default = 127.0.0.1:568%s\nmanagement.tcp.ip = 127.0.0.1\nmanagement.tcp.port = 1568%s\n' \
      "$i" "$i" > "$DIR/r$i/rabbitmq.conf"
    echo "[rabbitmq_management]." > "$DIR/r$i/enabled_plugins"
    RABBITMQ_NODENAME=rmq$i@localhost RABBITMQ_DIST_PORT=2568$i \
      RABBITMQ_CONFIG_FILE=$DIR/r$i/rabbitmq.conf RABBITMQ_ENABLED_PLUGINS_FILE=$DIR/r$i/enabled_plugins \
      RABBITMQ_MNESIA_BASE=$DIR/r$i/mnesia RABBITMQ_LOG_BASE=$DIR/r$i/log \
      RABBITMQ_PLUGINS_EXPAND_DIR=$DIR/r$i/plugins RABBITMQ_PID_FILE=$DIR/r$i/pid \
      RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}" \
      setsid "$RMQ/rabbitmq-server" > "$DIR/r$i/out.log" 2>&1 &
  done
  for i in 1 2 3; do "$RMQ/rabbitmqctl" -n "rmq$i@localhost" wait "$DIR/r$i/pid" --timeout 120 >/dev/null; done
  for i in 2 3; do
    ctl $i stop_app; ctl $i join_cluster rmq1@localhost; ctl $i start_app
  done
  ctl 1 set_policy ha-all '^mirrored' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues
}

# --- mirrorq: three nodes, AMQP 5691-5693, HTTP 15691-15693.
start_mirrorq() {
  local c=1=127.0.0.1:26691,2=127.0.0.1:26692,3=127.0.0.1:26693
  for i in 1 2 3; do
    MIRRORQ_LOG=warn "$BIN" serve --node-id $i --data-dir "$DIR/m$i" --raft-listen 127.0.0.1:2669$i \
      --amqp-listen 127.0.0.1:569$i --http-listen 127.0.0.1:1569$i --cluster $c 2>"$DIR/m$i.log" &
  done
  for _ in $(seq 150); do
    "$BIN" ctl --url http://127.0.0.1:15691 cluster-status 2>/dev/null | grep -c true | grep -q 3 && break
    sleep 0.2
  done
  # Masters on the node the client declares on, as RabbitMQ places them.
  "$BIN" ctl --url http://127.0.0.1:15691 set-policy ha-all '^mirrored' \
    '{"ha-mode":"all","ha-sync-mode":"automatic","queue-master-locator":"client-local"}' --apply-to queues >/dev/null
}

# perf SYSTEM CASE ARGS...: one JSON line, tagged, appended to the results.
perf() {
  local system=$1 case=$2; shift 2
  local uri quorum=()
  case $system in
    rabbitmq-*) uri=amqp://guest:guest@127.0.0.1:5681/%2f ;;
    mirrorq) uri=amqp://guest:guest@127.0.0.1:5691/%2f ;;
  esac
  [ "$system" = rabbitmq-quorum ] && quorum=(--quorum)
  local line
  line=$("$BIN" perf --uri "$uri" "${quorum[@]}" --json "$@")
  printf '{"system":"%s","case":"%s",%s\n' "$system" "$case" "${line#\{}" | tee -a "$OUT/results.jsonl"
}

matrix() {
  local s=$1 prefix=mirrored-$1
  # Quorum queues are not classic queues: the ha policy does not name them.
  [ "$s" = rabbitmq-quorum ] && prefix=quorum
  for size in 100 4096; do
    for window in 1 1000; do
      perf "$s" "1p1c ${size}B window $window" --queue "$prefix-$size-$window" --size $size --confirm $window \
        --time "$TIME"
    done
  done
  perf "$s" "10 queues 10p10c 100B window 100" --queue "$prefix-many" --queues 10 --producers 10 --consumers 10 \
    --size 100 --confirm 100 --time "$TIME"
  # Drain: fill a queue, then consume it alone.
  perf "$s" "fill $DRAIN x 100B" --queue "$prefix-drain" --size 100 --confirm 1000 --consumers 0 \
    --pmessages "$DRAIN" --time 120
  perf "$s" "drain $DRAIN x 100B" --queue "$prefix-drain" --size 100 --producers 0 --consumers 1 \
    --cmessages "$DRAIN" --time 120
}

for s in $SYSTEMS; do
  case $s in
    rabbitmq-*) [ -f "$DIR/r1/pid" ] || start_rabbitmq ;;
    mirrorq) start_mirrorq ;;
  esac
  matrix "$s"
done
cleanup
trap - EXIT
python3 -c "import matplotlib" 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check matplotlib
python3 benches/compare_report.py "$OUT/results.jsonl"
