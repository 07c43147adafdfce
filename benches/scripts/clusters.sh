# Sourced by the side-by-side benchmarks: 3-node RabbitMQ and mirrorq
# clusters on loopback only. Needs DIR (a scratch dir). The mirrorq binary
# is BIN if set, else MIRRORQ_BIN, else a fresh release build.
# RabbitMQ: nodes rmq1..3@localhost, AMQP 5681-5683, management 15681-15683.
# mirrorq: AMQP 5691-5693, HTTP 15691-15693.
# With TLS_CERT and TLS_KEY (PEM files) set, AMQP over TLS too: RabbitMQ on
# 5661-5663, mirrorq on 5671-5673.
RMQ=/usr/lib/rabbitmq/bin
if [ -z "${BIN:-}" ]; then
  BIN=${MIRRORQ_BIN:-target/release/mirrorq}
  [ -n "${MIRRORQ_BIN:-}" ] || cargo build --release --quiet --bin mirrorq
  BIN=$(realpath "$BIN")
fi
EPMD_BEFORE=$(pgrep -x epmd || true)

cleanup() {
  for i in 1 2 3; do
    [ -f "$DIR/r$i/pid" ] && kill "$(cat "$DIR/r$i/pid")" 2>/dev/null || true
  done
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
  # epmd outlives the nodes; stop it if this script started it.
  [ -n "${EPMD_BEFORE:-}" ] || epmd -kill >/dev/null 2>&1 || true
  rm -rf "$DIR"
}
# MIRRORQ_ONLY=1: a mirrorq-only script; RabbitMQ is not needed.
if [ -z "${MIRRORQ_ONLY:-}" ] && [ ! -x $RMQ/rabbitmq-server ]; then
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get install -y -q --no-install-recommends rabbitmq-server >/dev/null \
    || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends rabbitmq-server >/dev/null; }
fi

export HOME=$DIR ERL_EPMD_ADDRESS=127.0.0.1
export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
printf MIRRORQCOMPARECOOKIE > "$DIR/.erlang.cookie"
chmod 400 "$DIR/.erlang.cookie"
ctl() { "$RMQ/rabbitmqctl" -n "rmq$1@localhost" "${@:2}" >/dev/null; }
# Launch RabbitMQ node i (again, after a kill: it rejoins from its data
# dir) without waiting for it.
launch_rabbit_node() {
  local i=$1
  mkdir -p "$DIR/r$i"
  printf 'listeners.tcp.default = 127.0.0.1:568%s\nmanagement.tcp.ip = 127.0.0.1\nmanagement.tcp.port = 1568%s\n' \
    "$i" "$i" > "$DIR/r$i/rabbitmq.conf"
  if [ -n "${TLS_CERT:-}" ]; then
    printf 'listeners.ssl.default = 127.0.0.1:566%s\nssl_options.certfile = %s\nssl_options.keyfile = %s\nssl_options.verify = verify_none\n' \
      "$i" "$TLS_CERT" "$TLS_KEY" >> "$DIR/r$i/rabbitmq.conf"
  fi
  echo "[rabbitmq_management]." > "$DIR/r$i/enabled_plugins"
  RABBITMQ_NODENAME=rmq$i@localhost RABBITMQ_DIST_PORT=2568$i \
    RABBITMQ_CONFIG_FILE=$DIR/r$i/rabbitmq.conf RABBITMQ_ENABLED_PLUGINS_FILE=$DIR/r$i/enabled_plugins \
    RABBITMQ_MNESIA_BASE=$DIR/r$i/mnesia RABBITMQ_LOG_BASE=$DIR/r$i/log \
    RABBITMQ_PLUGINS_EXPAND_DIR=$DIR/r$i/plugins RABBITMQ_PID_FILE=$DIR/r$i/pid \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} ${RABBITMQ_EXTRA_ERL_ARGS:-}" \
    setsid "$RMQ/rabbitmq-server" >> "$DIR/r$i/out.log" 2>&1 &
}
# Node i, up and running.
start_rabbit_node() {
  launch_rabbit_node "$1"
  "$RMQ/rabbitmqctl" -n "rmq$1@localhost" wait "$DIR/r$1/pid" --timeout 120 >/dev/null
}
start_rabbitmq() {
  for i in 1 2 3; do start_rabbit_node $i; done
  for i in 2 3; do
    ctl $i stop_app; ctl $i join_cluster rmq1@localhost; ctl $i start_app
  done
  ctl 1 set_policy ha-all '^mirrored' '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues
}

# Stop the RabbitMQ nodes and wait for them to exit (SIGTERM: a clean stop).
stop_rabbitmq() {
  local pids=() i
  for i in 1 2 3; do
    [ -f "$DIR/r$i/pid" ] && pids+=("$(cat "$DIR/r$i/pid")") && rm -f "$DIR/r$i/pid"
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 300); do kill -0 "${pids[@]}" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "${pids[@]}" 2>/dev/null || true
}
# Each system starts on a quiet machine: the one before has written back
# what it left in the page cache (RabbitMQ's classic queues do not fsync;
# the kernel writes their pages out up to 30 s later, into whatever runs
# then), and its timers are gone.
quiet() {
  sync
  sleep "${QUIET:-5}"
}

# A server still stopping from an earlier run holds these ports and, while
# it hands its queues over, answers clients itself: wait for it to go.
ports_free() {
  ! ss -Htln 2>/dev/null | awk '{print $4}' | grep -Eq ':(2669[1-3]|569[1-3]|1569[1-3])$'
}
# Three nodes share two cores here: one runtime thread each does better than
# one per core (benches/results/HISTORY.md, "One runtime thread per node"). MIRRORQ_WORKERS="" gives
# tokio's default.
start_mirrorq() {
  local c=1=127.0.0.1:26691,2=127.0.0.1:26692,3=127.0.0.1:26693
  local workers=() tls=()
  [ -z "${MIRRORQ_WORKERS-1}" ] || workers=(--worker-threads "${MIRRORQ_WORKERS-1}")
  for _ in $(seq 150); do ports_free && break; sleep 0.2; done
  ports_free || { echo "mirrorq ports 5691-5693 / 15691-15693 / 26691-26693 still in use" >&2; return 1; }
  for i in 1 2 3; do
    [ -z "${TLS_CERT:-}" ] || tls=(--amqps-listen 127.0.0.1:567$i --tls-cert "$TLS_CERT" --tls-key "$TLS_KEY")
    MIRRORQ_LOG=${MIRRORQ_LOG:-warn} "$BIN" serve --node-id $i --data-dir "$DIR/m$i" --raft-listen 127.0.0.1:2669$i \
      --amqp-listen 127.0.0.1:569$i --http-listen 127.0.0.1:1569$i --cluster $c "${workers[@]}" "${tls[@]}" \
      2>"$DIR/m$i.log" &
    echo $! > "$DIR/m$i.pid"
  done
  for _ in $(seq 150); do
    "$BIN" ctl --url http://127.0.0.1:15691 cluster-status 2>/dev/null | grep -c true | grep -q 3 && break
    sleep 0.2
  done
  for i in 1 2 3; do
    kill -0 "$(cat "$DIR/m$i.pid")" 2>/dev/null || { echo "mirrorq node $i exited: $(cat "$DIR/m$i.log")" >&2; return 1; }
  done
  # Masters on the node the client declares on, as RabbitMQ places them.
  "$BIN" ctl --url http://127.0.0.1:15691 set-policy ha-all '^mirrored' \
    '{"ha-mode":"all","ha-sync-mode":"automatic","queue-master-locator":"client-local"}' --apply-to queues >/dev/null
}

