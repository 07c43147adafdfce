#!/usr/bin/env bash
# Where a message's time goes at one message in flight: a 3-node mirrorq
# cluster (benches/scripts/clusters.sh), `mirrorq perf --size 100 --confirm 1`, and
# one second of scheduler and syscall tracepoints across the machine
# (`perf record -a`, Debian's linux-perf; root). benches/scripts/window1_breakdown.py
# pairs each publish the master receives with the syscalls that follow it
# (AppendEntries written, mirrors' receive, sync and answer, the confirm)
# and prints each segment's p50/p90, then how long woken node threads
# waited to run.
# Usage: benches/scripts/window1-breakdown.sh     (MIRRORQ_BIN=... to skip the build)
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v perf >/dev/null || { echo "needs perf (Debian: linux-perf)" >&2; exit 2; }
DIR=$(mktemp -d /tmp/window1.XXXXXX)
MIRRORQ_ONLY=1
# shellcheck source=benches/scripts/clusters.sh
. benches/scripts/clusters.sh
trap cleanup EXIT
start_mirrorq
# Thread ids of each node, to tell the nodes apart in the trace.
for i in 1 2 3; do
  for t in /proc/"$(cat "$DIR/m$i.pid")"/task/*; do echo "$(basename "$t") N$i"; done
done > "$DIR/threads"
"$BIN" perf --uri amqp://guest:guest@127.0.0.1:5691/%2f --queue mirrored-w1-breakdown --size 100 --confirm 1 \
  --time 7 > "$DIR/perf.out" &
PERF=$!
sleep 3
perf record -q -a -o "$DIR/trace.data" -e sched:sched_switch,sched:sched_wakeup \
  -e syscalls:sys_enter_fdatasync,syscalls:sys_exit_fdatasync,syscalls:sys_exit_recvfrom \
  -e syscalls:sys_enter_sendto,syscalls:sys_enter_writev,syscalls:sys_enter_pwrite64 -- sleep 1 >/dev/null 2>&1
wait "$PERF"
grep -A1 summary "$DIR/perf.out"
perf script -i "$DIR/trace.data" -F comm,tid,cpu,time,event,trace 2>/dev/null > "$DIR/trace.txt"
python3 benches/scripts/window1_breakdown.py "$DIR/trace.txt" "$DIR/threads"
