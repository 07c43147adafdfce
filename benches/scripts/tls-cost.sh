#!/usr/bin/env bash
# What TLS costs, with a stock client (pika, benches/scripts/pika_perf.py)
# and with `mirrorq perf` (lapin): confirmed msg/s and confirm latency over
# plain AMQP and over TLS, for a mirrorq ha-mode:all queue and a RabbitMQ
# quorum queue, 3 nodes each on this machine, in one run. A CA and a server certificate for localhost
# are made with openssl. Every server listens on loopback only.
#
# Usage: benches/scripts/tls-cost.sh          (TIME=10 s per case)
#        MIRRORQ_BIN=target/release/mirrorq SYSTEMS=mirrorq benches/scripts/tls-cost.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
TIME=${TIME:-10}
SYSTEMS=${SYSTEMS:-"rabbitmq-quorum mirrorq"}
PY=${PYTHON:-target/test-venv/bin/python3}
OUT=${OUT:-target/tls-cost}
mkdir -p "$OUT"
: > "$OUT/results.jsonl"
DIR=$(mktemp -d /tmp/tls-cost.XXXXXX)
TLS_CERT=$DIR/server.pem TLS_KEY=$DIR/server.key CA=$DIR/ca.pem
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$DIR/ca.key" -out "$CA" -days 2 -subj /CN=bench-ca 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout "$TLS_KEY" -out "$DIR/server.csr" -subj /CN=localhost 2>/dev/null
printf 'subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n' > "$DIR/ext"
openssl x509 -req -in "$DIR/server.csr" -CA "$CA" -CAkey "$DIR/ca.key" -CAcreateserial -out "$TLS_CERT" -days 2 \
  -extfile "$DIR/ext" 2>/dev/null
chmod 644 "$TLS_KEY"  # RabbitMQ runs as this user too; loopback only
export TLS_CERT TLS_KEY
# shellcheck source=benches/scripts/clusters.sh
. benches/scripts/clusters.sh
trap cleanup EXIT

# run SYSTEM PLAIN_PORT TLS_PORT [--quorum]
run() {
  local system=$1 plain=$2 tls=$3; shift 3
  for window in 1 1000; do
    for mode in plain tls; do
      local port=$plain ca=()
      [ $mode = tls ] && port=$tls ca=(--ca "$CA")
      local line
      line=$("$PY" benches/scripts/pika_perf.py --port "$port" "${ca[@]}" --queue "mirrored-$mode-$window" \
        --window $window --time "$TIME" "$@")
      printf '{"system":"%s","client":"pika",%s\n' "$system" "${line#\{}" | tee -a "$OUT/results.jsonl"
      local scheme=amqp quorum=()
      [ $mode = tls ] && scheme=amqps
      [ "$system" = rabbitmq-quorum ] && quorum=(--quorum)
      line=$("$BIN" perf --uri "$scheme://guest:guest@localhost:$port/%2f" "${ca[@]}" "${quorum[@]}" \
        --queue "perf-$mode-$window" --size 100 --confirm $window --time "$TIME" --json)
      "$PY" -c 'import json,sys; v=json.loads(sys.argv[1]); print(json.dumps({"system": sys.argv[2], "client": "mirrorq perf",
        "msg_per_s": round(v["confirmed_per_sec"], 1), "p50_ms": v["confirm_latency_ms"]["p50"],
        "p99_ms": v["confirm_latency_ms"]["p99"], "window": int(sys.argv[3]), "tls": sys.argv[4] == "tls"}))' \
        "$line" "$system" $window $mode | tee -a "$OUT/results.jsonl"
    done
  done
}

for s in $SYSTEMS; do
  case $s in
    rabbitmq-quorum)
      start_rabbitmq
      run rabbitmq-quorum 5681 5661 --quorum
      stop_rabbitmq
      ;;
    mirrorq)
      quiet
      start_mirrorq
      run mirrorq 5691 5671
      for i in 1 2 3; do kill "$(cat "$DIR/m$i.pid")" 2>/dev/null || true; done
      ;;
  esac
done
"$PY" - "$OUT/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| client | system | in flight | plain msg/s | TLS msg/s | TLS/plain | plain p50 / p99 ms | TLS p50 / p99 ms |")
print("|---|---|---|---|---|---|---|---|")
for client in dict.fromkeys(r["client"] for r in rows):
    for system in dict.fromkeys(r["system"] for r in rows):
        for w in (1, 1000):
            case = [r for r in rows if (r["client"], r["system"], r["window"]) == (client, system, w)]
            p = next(r for r in case if not r["tls"])
            t = next(r for r in case if r["tls"])
            print(f"| {client} | {system} | {w} | {p['msg_per_s']:,} | {t['msg_per_s']:,} "
                  f"| {t['msg_per_s'] / p['msg_per_s']:.2f} | {p['p50_ms']} / {p['p99_ms']} | {t['p50_ms']} / {t['p99_ms']} |")
PY
