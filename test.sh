#!/usr/bin/env bash
# Runs every test on a fresh machine, installing what the tests drive: the
# stock Python clients (pika, Celery) in a virtual environment under
# target/, Debian's rabbitmqadmin (unpacked from its package), Debian's
# Chromium and playwright-core for the browser test of the web UI,
# Debian's nftables for the fault campaign's firewall.
# Formatting and clippy's lints are checked first. Extra arguments go to
# `cargo test` (e.g. `./test.sh --test t40_amqp`).
set -euo pipefail
cd "$(dirname "$0")"

venv=target/test-venv
if [ ! -x "$venv/bin/python3" ]; then
  mkdir -p target
  python3 -m venv "$venv"
fi
"$venv/bin/python3" -m pip install --quiet --disable-pip-version-check pika celery
# The tests run `python3`: this one, with the clients.
export PATH="$PWD/$venv/bin:$PATH"

SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
# Debian's rabbitmqadmin, the management CLI RabbitMQ users bring: a Python
# script in the rabbitmq-server package, unpacked without installing
# RabbitMQ (t53 drives it).
admin=target/rabbitmqadmin
if [ ! -s "$admin" ]; then
  deb=$(mktemp -d)
  (cd "$deb" && { apt-get download -q rabbitmq-server || { $SUDO apt-get update -q && apt-get download -q rabbitmq-server; }; })
  dpkg-deb -x "$deb"/rabbitmq-server_*.deb "$deb/x"
  cp "$(find "$deb/x" -name rabbitmqadmin -type f | head -1)" "$admin"
  rm -rf "$deb"
fi
export MIRRORQ_RABBITMQADMIN="$PWD/$admin"

if ! command -v chromium >/dev/null; then
  $SUDO apt-get install -y -q chromium || { $SUDO apt-get update -q && $SUDO apt-get install -y -q chromium; }
fi
npm install --prefix tests/ui --no-audit --no-fund --silent
# nftables: the fault campaign's firewall that rejects with a TCP reset (t60).
if ! command -v nft >/dev/null; then
  $SUDO apt-get install -y -q nftables || { $SUDO apt-get update -q && $SUDO apt-get install -y -q nftables; }
fi

# The code's form first: formatting and lints are part of the tests.
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

exec cargo test --workspace "$@"
