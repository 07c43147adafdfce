#!/usr/bin/env bash
# Many idle replicated queues, side by side (issue 27): mirrorq with policy
# ha-mode all (3 replicas each) and RabbitMQ 3.10 quorum queues (3 replicas),
# each a 3-node cluster on loopback (benches/scripts/clusters.sh), one after
# the other on a quiet machine. For each system:
#
#  1. declares: QUEUES durable queues (scale-00000...) over the HTTP API
#     (PUT /api/queues/%2F/NAME) by PARALLEL clients, client c on node
#     c mod 3, each with a keep-alive connection taking the next name;
#     RabbitMQ's with {"x-queue-type":"quorum"}. A refused declare is retried
#     (up to 5 times; counted). Reported: queues per second.
#  2. time to synchronised: from the last declare's answer until one
#     GET /api/queues/%2F on node 1 lists every queue synchronised (mirrorq:
#     state running and both other nodes in synchronised_slave_nodes;
#     RabbitMQ: a leader, 3 members, all online; its `state` field is not
#     used, it comes from the management statistics, 5-10 s late).
#  3. idle: SETTLE seconds (default 5) with nothing happening, then CPU per
#     node over IDLE seconds ((utime + stime) delta from /proc/PID/stat) and
#     VmRSS per node (/proc/PID/status) after it; RSS growth per replica =
#     (RSS after - RSS before the first declare) / QUEUES, as every node
#     holds one replica of every queue.
#  4. wake: one persistent message with confirms (pika, one connection to
#     node 1) to each of 50 idle queues spread over the range; each
#     publish's time to its confirm (p50 / max).
#  4b. busy: `mirrorq perf` with one producer and one consumer per queue
#     (confirm window 100, 100 B persistent messages, BUSY_TIME s) over
#     1, 10 and BUSY queues `scale-busy-*` before the idle queues are
#     declared, and over the BUSY queues again after the wake step, among
#     the idle ones: confirmed msg/s each time. RSS before is read after
#     the first busy runs: what they leave in memory (hundreds of MiB on
#     both systems) is not the idle queues' cost.
#  4c. declares over AMQP: AMQP_QUEUES more durable queues (scale-amqp-...)
#     declared with `queue.declare` by Node's amqplib
#     (benches/scripts/amqplib_declare.js: 8 connections spread over the
#     nodes, 4 channels each, every channel declaring its next queue once
#     the last one's declare-ok came). Reported: queues per second.
#  5. restart: node 3 gets SIGTERM (reported: time until it exited), is
#     started again on its data dir, and its GET /api/queues/%2F is polled
#     every 0.2 s. Reported, from the new process's start: until it answers
#     with every queue served (a master reachable: mirrorq state running or
#     syncing, RabbitMQ a leader among the online members; both answered
#     through that node, so its API must be up), then until every queue
#     is synchronised on all 3 replicas again.
#  6. rolling restart: nodes 1, 2 and 3 in turn, as in 5, each once every
#     queue is synchronised again. Meanwhile one amqplib client per node
#     publishes with confirms to each of 50 queues spread over the range,
#     one message in flight per queue and at most one each 100 ms
#     (benches/scripts/amqplib_probe.js, reconnecting
#     whenever its node drops or refuses it). Reported: each node's time
#     to serve every queue, and the longest a probed queue went without a
#     confirmed publish through any node.
#
# Prints a markdown table (also written to OUT if set) with the command,
# date, machine and git revision. Loopback only; every process it started
# is stopped on exit and on Ctrl-C.
#
# Usage: benches/scripts/scale.sh
#   QUEUES=1000 PARALLEL=4 IDLE=30 SETTLE=5 BUSY=100 BUSY_TIME=15 AMQP_QUEUES=1000 (defaults)
#   ROLLING=0: no rolling restart
#   MIRRORQ_ONLY=1 / RABBIT_ONLY=1: one system only
#   MIRRORQ_BIN=target/release/mirrorq (built if missing)
#   MIRRORQ_WORKERS=1 (clusters.sh: runtime threads per node; "" = tokio's default)
#   SYNC_TIMEOUT=1800 RESTART_TIMEOUT=600 (seconds); OUT=FILE for the table
set -euo pipefail
cd "$(dirname "$0")/../.."

# The command as given, for the report.
SCALE_COMMAND=
for v in QUEUES PARALLEL IDLE SETTLE BUSY BUSY_TIME AMQP_QUEUES ROLLING MIRRORQ_ONLY RABBIT_ONLY MIRRORQ_BIN MIRRORQ_WORKERS; do
  [ -z "${!v+x}" ] || SCALE_COMMAND+="$v=${!v} "
done
export SCALE_COMMAND="${SCALE_COMMAND}benches/scripts/scale.sh"

QUEUES=${QUEUES:-1000}
PARALLEL=${PARALLEL:-4}
IDLE=${IDLE:-30}
SETTLE=${SETTLE:-5}
BUSY=${BUSY:-100}
BUSY_TIME=${BUSY_TIME:-15}
AMQP_QUEUES=${AMQP_QUEUES:-1000}
ROLLING=${ROLLING:-1}
# Every queue the restarts wait for.
TOTAL=$((QUEUES + AMQP_QUEUES))
SYNC_TIMEOUT=${SYNC_TIMEOUT:-1800}
RESTART_TIMEOUT=${RESTART_TIMEOUT:-600}
RMQ=/usr/lib/rabbitmq/bin
if [ -n "${MIRRORQ_ONLY:-}" ] && [ -n "${RABBIT_ONLY:-}" ]; then
  echo "MIRRORQ_ONLY and RABBIT_ONLY together leave nothing to run" >&2
  exit 2
fi

# The mirrorq binary (clusters.sh builds only when BIN is unset).
BIN=${MIRRORQ_BIN:-target/release/mirrorq}
if [ -z "${RABBIT_ONLY:-}" ] && [ ! -x "$BIN" ]; then
  cargo build --release --quiet --bin mirrorq
fi
BIN=$(realpath -m "$BIN")

# RabbitMQ when available: clusters.sh installs Debian's package if it is
# missing; if that fails too, run mirrorq alone rather than stop.
if [ -z "${MIRRORQ_ONLY:-}" ] && [ ! -x $RMQ/rabbitmq-server ]; then
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get install -y -q --no-install-recommends rabbitmq-server >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 \
         && $SUDO apt-get install -y -q --no-install-recommends rabbitmq-server >/dev/null 2>&1; } || true
  if [ ! -x $RMQ/rabbitmq-server ]; then
    [ -z "${RABBIT_ONLY:-}" ] || { echo "RabbitMQ is not installed and could not be" >&2; exit 1; }
    echo "RabbitMQ is not installed and could not be: mirrorq only" >&2
    MIRRORQ_ONLY=1
  fi
fi

DIR=$(mktemp -d /tmp/scale.XXXXXX)
SCALE_RESULTS=$(mktemp /tmp/scale-results.XXXXXX)
export SCALE_RESULTS
# shellcheck source=benches/scripts/clusters.sh
. benches/scripts/clusters.sh
finish() {
  cleanup
  rm -f "$SCALE_RESULTS"
}
trap finish EXIT
trap 'echo "interrupted: stopping everything this run started" >&2; exit 130' INT
trap 'exit 143' TERM

# The tests' virtual environment has pika (./test.sh makes it), for `wake`.
PY=python3
[ ! -x target/test-venv/bin/python3 ] || PY=target/test-venv/bin/python3
py() { "$PY" benches/scripts/scale.py "$@"; }
now() { date +%s.%N; }

# busy SYSTEM KEY AMQP_PORT N [perf args]: confirmed msg/s of `mirrorq perf`
# (it speaks plain AMQP to both systems) with N producers and N consumers,
# one of each per queue `scale-busy-1..N` (`scale-busy` when N is 1).
busy() {
  local system=$1 key=$2 port=$3 n=$4 out
  shift 4
  out=$("$BIN" perf --uri "amqp://guest:guest@127.0.0.1:$port/%2f" --queue scale-busy --queues "$n" \
    --producers "$n" --consumers "$n" --confirm 100 --size 100 --time "$BUSY_TIME" --json "$@" 2>/dev/null \
    | tail -1) || true
  out=$(echo "${out:-null}" | "$PY" -c 'import json,sys
try: print(json.load(sys.stdin)["confirmed_per_sec"])
except Exception: print("null")')
  echo "$system: $n busy queues ($key): $out confirmed msg/s" >&2
  py record "$system" "$key" "$out"
}
busy_before() {
  local system=$1 port=$2 n
  shift 2
  for n in 1 10 "$BUSY"; do busy "$system" "busy_$n" "$port" "$n" "$@"; done
}

# Node's amqplib (benches/node; npm installs it if missing).
have_amqplib() {
  command -v node >/dev/null || return 1
  [ -d benches/node/node_modules/amqplib ] || npm install --prefix benches/node --no-audit --no-fund >/dev/null 2>&1 || true
  [ -d benches/node/node_modules/amqplib ]
}

# amqp_declares SYSTEM PORTS [amqplib_declare.js args]: AMQP_QUEUES more
# queues declared over AMQP by amqplib.
amqp_declares() {
  local system=$1 ports=$2 line
  shift 2
  [ "$AMQP_QUEUES" -gt 0 ] || return 0
  have_amqplib || { echo "$system: no Node or amqplib: no AMQP declare figures" >&2; return 0; }
  line=$(node benches/scripts/amqplib_declare.js --ports "$ports" --count "$AMQP_QUEUES" \
    --connections 8 --channels 4 "$@" 2>&1 | tail -1) || true
  py amqp-declared "$system" "$line"
}

# rolling SYSTEM API_PORT_PREFIX AMQP_PORTS: nodes 1, 2, 3 restarted in
# turn (restart_node), each once the last one serves and has every queue
# synchronised, under the probe's publishes (benches/scripts/amqplib_probe.js).
rolling() {
  local system=$1 api=$2 ports=$3 stop=$DIR/probe-stop i probe_pid
  [ "$ROLLING" != 0 ] || return 0
  have_amqplib || { echo "$system: no Node or amqplib: no rolling restart" >&2; return 0; }
  rm -f "$stop"
  node benches/scripts/amqplib_probe.js --ports "$ports" --queues "$(py probe-queues "$QUEUES")" \
    --stop "$stop" > "$DIR/probe.out" 2>&1 &
  probe_pid=$!
  for i in 1 2 3; do
    restart_node "$system" "$i"
    py served "$system" "$api$i" "$TOTAL" 3 "$RESTART_TIMEOUT" "$STARTED" "rolling$i"
  done
  touch "$stop"
  wait "$probe_pid" || true
  py probed "$system" "$(tail -1 "$DIR/probe.out")"
}

# restart_node SYSTEM I: SIGTERM node I, wait for its exit, start it again
# on its data dir; STARTED: the new process's start time.
restart_node() {
  local system=$1 i=$2 pid
  if [ "$system" = mirrorq ]; then
    pid=$(cat "$DIR/m$i.pid")
    kill -TERM "$pid"
    wait_exit "$pid" 300
    wait "$pid" 2>/dev/null || true
    STARTED=$(now)
    launch_mirrorq_node "$i"
  else
    # Written early in the boot: a node restarted a moment ago may not have it yet.
    for _ in $(seq 100); do [ -f "$DIR/r$i/pid" ] && break; sleep 0.1; done
    pid=$(cat "$DIR/r$i/pid")
    kill -TERM "$pid"
    wait_exit "$pid" 300
    rm -f "$DIR/r$i/pid"
    STARTED=$(now)
    launch_rabbit_node "$i"
  fi
}

# wait_exit PID SECONDS: until PID is gone; kill -9 after SECONDS.
wait_exit() {
  local pid=$1 limit=$2 t0
  t0=$(date +%s)
  while kill -0 "$pid" 2>/dev/null; do
    if [ $(($(date +%s) - t0)) -ge "$limit" ]; then
      echo "pid $pid still running after ${limit} s: kill -9" >&2
      kill -9 "$pid" 2>/dev/null || true
    fi
    sleep 0.05
  done
}

# ---- mirrorq ----------------------------------------------------------------

# Node i again on its data dir, as start_mirrorq (clusters.sh) starts it.
launch_mirrorq_node() {
  local i=$1 workers=()
  [ -z "${MIRRORQ_WORKERS-1}" ] || workers=(--worker-threads "${MIRRORQ_WORKERS-1}")
  MIRRORQ_LOG=${MIRRORQ_LOG:-warn} "$BIN" serve --node-id "$i" --data-dir "$DIR/m$i" \
    --raft-listen "127.0.0.1:2669$i" --amqp-listen "127.0.0.1:569$i" --http-listen "127.0.0.1:1569$i" \
    --cluster 1=127.0.0.1:26691,2=127.0.0.1:26692,3=127.0.0.1:26693 "${workers[@]}" 2>>"$DIR/m$i.log" &
  echo $! > "$DIR/m$i.pid"
}
mirrorq_pids() { echo "$(cat "$DIR/m1.pid")" "$(cat "$DIR/m2.pid")" "$(cat "$DIR/m3.pid")"; }
stop_mirrorq() {
  local pids=() i
  for i in 1 2 3; do
    [ -f "$DIR/m$i.pid" ] && pids+=("$(cat "$DIR/m$i.pid")") && rm -f "$DIR/m$i.pid"
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for p in "${pids[@]}"; do wait_exit "$p" 120; wait "$p" 2>/dev/null || true; done
}

run_mirrorq() {
  echo "== mirrorq: $QUEUES queues, policy ha-mode all" >&2
  start_mirrorq
  "$BIN" ctl --url http://127.0.0.1:15691 set-policy scale '^scale-' \
    '{"ha-mode":"all","ha-sync-mode":"automatic"}' --apply-to queues >/dev/null
  py record mirrorq version "\"$("$BIN" --version)\""
  busy_before mirrorq 5691
  sleep "$SETTLE"
  # shellcheck disable=SC2046
  py rss mirrorq rss_before $(mirrorq_pids)
  py declare mirrorq "$QUEUES" "$PARALLEL" 15691 15692 15693
  py sync mirrorq 15691 "$QUEUES" 3 "$SYNC_TIMEOUT"
  sleep "$SETTLE"
  # shellcheck disable=SC2046
  py idle mirrorq "$IDLE" $(mirrorq_pids)
  # shellcheck disable=SC2046
  py rss mirrorq rss_after $(mirrorq_pids)
  py wake mirrorq 5691 "$QUEUES"
  busy mirrorq busy_among_idle 5691 "$BUSY"
  amqp_declares mirrorq 5691,5692,5693

  local pid t0 t1
  pid=$(cat "$DIR/m3.pid")
  t0=$(now)
  kill -TERM "$pid"
  wait_exit "$pid" 300
  t1=$(now)
  wait "$pid" 2>/dev/null || true
  py record mirrorq stop_seconds "$(python3 -c "print($t1 - $t0)")"
  echo "mirrorq: node 3 exited $(python3 -c "print(f'{$t1 - $t0:.1f}')") s after SIGTERM" >&2
  t0=$(now)
  launch_mirrorq_node 3
  py served mirrorq 15693 "$TOTAL" 3 "$RESTART_TIMEOUT" "$t0"
  rolling mirrorq 1569 5691,5692,5693
  stop_mirrorq
}

# ---- RabbitMQ -----------------------------------------------------------------

rabbit_pids() { echo "$(cat "$DIR/r1/pid")" "$(cat "$DIR/r2/pid")" "$(cat "$DIR/r3/pid")"; }

run_rabbitmq() {
  echo "== RabbitMQ: $QUEUES quorum queues" >&2
  start_rabbitmq
  py record rabbitmq-quorum version "$(curl -sf -u guest:guest http://127.0.0.1:15681/api/overview \
    | python3 -c 'import json,sys; print(json.dumps("RabbitMQ " + json.load(sys.stdin)["rabbitmq_version"]))')"
  busy_before rabbitmq-quorum 5681 --quorum
  sleep "$SETTLE"
  # shellcheck disable=SC2046
  py rss rabbitmq-quorum rss_before $(rabbit_pids)
  py declare rabbitmq-quorum "$QUEUES" "$PARALLEL" 15681 15682 15683
  py sync rabbitmq-quorum 15681 "$QUEUES" 3 "$SYNC_TIMEOUT"
  sleep "$SETTLE"
  # shellcheck disable=SC2046
  py idle rabbitmq-quorum "$IDLE" $(rabbit_pids)
  # shellcheck disable=SC2046
  py rss rabbitmq-quorum rss_after $(rabbit_pids)
  py wake rabbitmq-quorum 5681 "$QUEUES"
  busy rabbitmq-quorum busy_among_idle 5681 "$BUSY" --quorum
  amqp_declares rabbitmq-quorum 5681,5682,5683 --quorum

  local pid t0 t1
  pid=$(cat "$DIR/r3/pid")
  t0=$(now)
  kill -TERM "$pid"
  wait_exit "$pid" 300
  t1=$(now)
  rm -f "$DIR/r3/pid"
  py record rabbitmq-quorum stop_seconds "$(python3 -c "print($t1 - $t0)")"
  echo "rabbitmq-quorum: node 3 exited $(python3 -c "print(f'{$t1 - $t0:.1f}')") s after SIGTERM" >&2
  t0=$(now)
  launch_rabbit_node 3
  py served rabbitmq-quorum 15683 "$TOTAL" 3 "$RESTART_TIMEOUT" "$t0"
  rolling rabbitmq-quorum 1568 5681,5682,5683
  # Pid files (for stop_rabbitmq) are written early in the boot.
  for i in 1 2 3; do
    for _ in $(seq 100); do [ -f "$DIR/r$i/pid" ] && break; sleep 0.1; done
  done
  stop_rabbitmq
}

[ -n "${RABBIT_ONLY:-}" ] || run_mirrorq
if [ -z "${MIRRORQ_ONLY:-}" ]; then
  [ -n "${RABBIT_ONLY:-}" ] || quiet
  run_rabbitmq
fi
echo >&2
py report "$SCALE_RESULTS" "$QUEUES" "$PARALLEL" "$IDLE" "$BUSY" "$AMQP_QUEUES" | tee ${OUT:+"$OUT"}
