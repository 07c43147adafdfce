#!/usr/bin/env bash
# What users see with the clients they already have: pika (Python,
# benches/scripts/pika_perf.py) and amqplib (Node, benches/scripts/amqplib_perf.js)
# publishing persistent 100 B messages with confirms, 1 and 1,000 in flight,
# one consumer draining the queue meanwhile, against a mirrorq ha-mode:all
# queue and a RabbitMQ quorum queue, 3 nodes each on this machine, in one
# run. Writes target/stock-clients/{results.jsonl,table.md} and puts the
# table into docs/benchmarks.md between its stock-clients markers.
#
# Usage: benches/scripts/stock-clients.sh            (TIME=10 s per case)
#        MIRRORQ_BIN=target/release/mirrorq SYSTEMS=mirrorq benches/scripts/stock-clients.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
TIME=${TIME:-10}
SYSTEMS=${SYSTEMS:-"rabbitmq-quorum mirrorq"}
CLIENTS=${CLIENTS:-"pika amqplib"}
PY=${PYTHON:-target/test-venv/bin/python3}
OUT=${OUT:-target/stock-clients}
mkdir -p "$OUT"
: > "$OUT/results.jsonl"
[ -d benches/node/node_modules/amqplib ] || npm install --prefix benches/node --no-audit --no-fund >/dev/null
DIR=$(mktemp -d /tmp/stock-clients.XXXXXX)
# shellcheck source=benches/scripts/clusters.sh
. benches/scripts/clusters.sh
trap cleanup EXIT

# run SYSTEM PORT [--quorum]
run() {
  local system=$1 port=$2; shift 2
  for window in 1 1000; do
    local line client
    for client in $CLIENTS; do
      case $client in
        pika) line=$("$PY" benches/scripts/pika_perf.py --port "$port" --queue "mirrored-pika-$window" \
          --window $window --time "$TIME" "$@") ;;
        amqplib) line=$(node benches/scripts/amqplib_perf.js --port "$port" --queue "mirrored-amqplib-$window" \
          --window $window --time "$TIME" "$@") ;;
      esac
      printf '{"system":"%s","client":"%s",%s\n' "$system" "$client" "${line#\{}" | tee -a "$OUT/results.jsonl"
    done
  done
}

for s in $SYSTEMS; do
  case $s in
    rabbitmq-quorum)
      quiet
      start_rabbitmq
      run rabbitmq-quorum 5681 --quorum
      stop_rabbitmq
      ;;
    mirrorq)
      quiet
      start_mirrorq
      run mirrorq 5691
      for i in 1 2 3; do kill "$(cat "$DIR/m$i.pid")" 2>/dev/null || true; done
      ;;
  esac
done
"$PY" - "$OUT/results.jsonl" "$OUT/table.md" "$(git rev-parse --short HEAD)" "$TIME" <<'PY'
import datetime, json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
out = [f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, build `{sys.argv[3]}`, "
       f"{sys.argv[4]} s per case, `benches/scripts/stock-clients.sh`:", "",
       "| client | in flight | mirrorq msg/s | RabbitMQ quorum msg/s | ratio | mirrorq p50 / p99 ms | quorum p50 / p99 ms | p99 ratio |",
       "|---|---|---|---|---|---|---|---|"]
for client in dict.fromkeys(r["client"] for r in rows):
    for w in (1, 1000):
        case = {r["system"]: r for r in rows if (r["client"], r["window"]) == (client, w)}
        m, q = case.get("mirrorq"), case.get("rabbitmq-quorum")
        if not m or not q:
            continue
        out.append(f"| {client} | {w:,} | {m['msg_per_s']:,} | {q['msg_per_s']:,} | {m['msg_per_s'] / q['msg_per_s']:.2f} "
                   f"| {m['p50_ms']} / {m['p99_ms']} | {q['p50_ms']} / {q['p99_ms']} | {m['p99_ms'] / q['p99_ms']:.2f} |")
table = "\n".join(out) + "\n"
open(sys.argv[2], "w").write(table)
print(table)
doc = open("docs/benchmarks.md").read()
begin, end = "<!-- stock-clients:begin -->", "<!-- stock-clients:end -->"
if begin in doc and end in doc and len(out) > 4:
    doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{table}{end}", doc, flags=re.S)
    open("docs/benchmarks.md", "w").write(doc)
PY
