#!/usr/bin/env bash
# Side by side, in one run, with one client (`mirrorq perf`) on this machine:
#   - RabbitMQ classic mirrored queues (ha-mode all), 3 nodes
#   - RabbitMQ quorum queues (3 replicas), the same 3 nodes
#   - mirrorq (ha-mode all: every replica fsyncs before a confirm), 3 nodes
# Every server listens on loopback only. Installs Debian's rabbitmq-server if
# missing; stops everything it started. Results: $OUT/results.jsonl, then
# benches/scripts/compare_report.py writes the table into docs/benchmarks.md and the
# chart docs/compare-rabbitmq.png.
#
# Usage: benches/scripts/compare-rabbitmq.sh            (TIME=10 seconds per case, DRAIN=50000)
#        MIRRORQ_BIN=target/release/mirrorq SYSTEMS="mirrorq" benches/scripts/compare-rabbitmq.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
TIME=${TIME:-10}
DRAIN=${DRAIN:-50000}
SYSTEMS=${SYSTEMS:-"rabbitmq-mirrored rabbitmq-quorum mirrorq"}
OUT=${OUT:-target/compare}
mkdir -p "$OUT"
: > "$OUT/results.jsonl"
DIR=$(mktemp -d /tmp/compare-rabbitmq.XXXXXX)
# shellcheck source=benches/scripts/clusters.sh
. benches/scripts/clusters.sh
trap cleanup EXIT

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
    # RabbitMQ ran with no mirrorq up; mirrorq runs with no RabbitMQ up.
    mirrorq) stop_rabbitmq; start_mirrorq ;;
  esac
  quiet
  matrix "$s"
done
cleanup
trap - EXIT
# REPORT=0: results only, docs untouched (a smoke run).
[ "${REPORT:-1}" = 1 ] || exit 0
python3 -c "import matplotlib" 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check matplotlib
python3 benches/scripts/compare_report.py "$OUT/results.jsonl"
