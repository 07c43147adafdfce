#!/usr/bin/env bash
# Runs a client library's own test suite, as its authors wrote it, against
# an AMQP port: `tests/client_suites/run.sh SUITE PORT [HOST]`.
#
#   amqplib  amqplib 0.10.9's tests (callback API, promise API, connect),
#            from its npm package
#   py-amqp  py-amqp 5.3.1's integration tests without TLS, from its
#            source distribution on PyPI
#   kombu    kombu 5.5.4's py-amqp transport integration tests, from its
#            source distribution on PyPI
#
# (pika's acceptance tests are only in its public repository and dial
# 127.0.0.1:5672 whatever they are given, so they are not run from here.)
# Nothing of theirs is copied into this repository: each suite is fetched
# (pinned) into target/client-suites/ the first time. Left out are only
# tests that fail against RabbitMQ 3.10 as well, each named below with why.
set -euo pipefail
suite=${1:?usage: run.sh SUITE PORT [HOST]}
port=${2:?usage: run.sh SUITE PORT [HOST]}
host=${3:-127.0.0.1}
here=$(cd "$(dirname "$0")/../.." && pwd)
cache=$here/target/client-suites
mkdir -p "$cache"

python_env() {
  local venv=$cache/venv
  if [ ! -x "$venv/bin/python3" ]; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check \
    pytest==8.3.5 amqp==5.3.1 kombu==5.5.4
}

# The source distribution of a PyPI package, unpacked: its tests.
sdist() {
  local name=$1 version=$2 dir=$cache/$1-$2
  if [ ! -d "$dir" ]; then
    local tmp
    tmp=$(mktemp -d)
    "$cache/venv/bin/python3" -m pip download --quiet --disable-pip-version-check \
      --no-binary :all: --no-deps -d "$tmp" "$name==$version"
    tar xzf "$tmp"/*.tar.gz -C "$cache"
    rm -rf "$tmp"
  fi
  echo "$dir"
}

case $suite in
  amqplib)
    dir=$cache/amqplib-0.10.9
    if [ ! -d "$dir/node_modules/mocha" ]; then
      tmp=$(mktemp -d)
      (cd "$tmp" && npm pack --silent amqplib@0.10.9 >/dev/null)
      mkdir -p "$dir"
      tar xzf "$tmp"/amqplib-0.10.9.tgz -C "$dir" --strip-components=1
      rm -rf "$tmp"
      (cd "$dir" && npm install --silent --no-audit --no-fund --ignore-scripts --omit=dev \
        && npm install --silent --no-audit --no-fund --ignore-scripts --no-save mocha@9.2.2)
    fi
    cd "$dir"
    # serverProperties, custom heartbeat and ipv6 connect to port 5672
    # whatever URL says.
    URL="amqp://guest:guest@$host:$port" ./node_modules/.bin/mocha -u tdd --exit -R dot \
      --grep 'serverProperties|using custom heartbeat option|ipv6' --invert \
      test/callback_api.js test/channel_api.js test/connect.js
    ;;
  py-amqp)
    python_env
    cd "$(sdist amqp 5.3.1)"
    RABBITMQ_HOST=$host RABBITMQ_5672_TCP=$port "$cache/venv/bin/python3" -m pytest -q -p no:cacheprovider \
      t/integration/test_rmq.py -k 'not tls and not ssl'
    ;;
  kombu)
    python_env
    cd "$(sdist kombu 5.5.4)"
    # The priority requeue test drains one event within a second after a
    # requeue; it failed against RabbitMQ 3.10 in 5 of 6 runs.
    RABBITMQ_HOST=$host RABBITMQ_5672_TCP=$port "$cache/venv/bin/python3" -m pytest -q -p no:cacheprovider \
      t/integration/test_py_amqp.py \
      --deselect t/integration/test_py_amqp.py::test_PyAMQPPriority::test_publish_requeue_consume
    ;;
  *)
    echo "run.sh: unknown suite '$suite' (amqplib, py-amqp, kombu)" >&2
    exit 2
    ;;
esac
