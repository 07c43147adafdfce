#!/usr/bin/env python3
"""Fault campaign for mirrorq: a real cluster in network namespaces, a
confirmed-publish / consume workload on every node, and random faults
(kill -9, SIGSTOP, partitions, graceful restarts, the classic demo), then a
check that no confirmed message was lost.

    python3 tests/faults/campaign.py --bin target/debug/mirrorq --seeds 1,2

Needs root and iproute2 (`ip netns`); pika in the client namespace.
The same seed gives the same fault schedule (printed first), so a failing
seed reproduces with `--seed N`.

Addressing and users, from reading src/http/access.rs and src/amqp/auth.rs:
`guest` is refused from non-loopback peers on both HTTP and AMQP. So each
node serves HTTP on 127.0.0.1 *inside its own namespace* (each namespace
has its own loopback, so no clash) and every HTTP call runs there, as guest,
via `ip netns exec`; that also keeps management calls out of the partitions.
AMQP and the node link listen on 10.213.k.i; the AMQP clients, in their own
namespace, log in as a user this script creates over HTTP at setup.

`--broker rabbitmq` runs the same schedules against RabbitMQ 3.10 (Debian's
rabbitmq-server, installed if missing) with quorum queues: node i is
rabbit@10.213.k.i with an epmd of its own in its namespace, management on
that namespace's loopback as above, its data dir (RABBITMQ_MNESIA_BASE) on
faultfs with --faultfs. What is mirrorq's alone (the ha-mode `move`, the
epoch check, the log-storm limit, stopping on a failed fsync) is skipped
or noted, and the output says so.

    python3 tests/faults/campaign.py --broker rabbitmq --faultfs /path/to/faultfs --seeds 106
"""

import argparse
import datetime
import json
import os
import random
import secrets
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

QUEUES = ("fq1", "fq2", "fq3")
# fq3 is published to about once every this many seconds (every node's
# publisher together), so its group settles and goes quiet (no Raft
# heartbeats) between publishes: its failovers are a quiet group's.
SLOW_QUEUES = {"fq3": 4.0}
USER, PASSWORD = "mqf", "mqf-campaign"
RAFT_PORT, AMQP_PORT, HTTP_PORT = 25672, 5672, 15672
CLIENT_HOST = 250  # the client namespace's last octet
PUBLISH_STUCK_SECS = 60  # longer than any fault: a publish may rightly wait for a heal
PREFETCH = 100  # each consumer's window of unacked deliveries
UNACKED_BACK_SECS = 15  # the 10 s for a lost consumer's unacked, plus a sweep
# After a heal the minority's fork still serves until it learns that it
# yields; what it confirms or delivers meanwhile counts as "during" the split.
HEAL_GRACE_SECS = 10
FAULT_KINDS = ("kill9", "kill9-unacked", "sigstop", "partition", "partition-reject", "partition-reset", "restart", "move",
               "classic",
               "pause-heal", "powercut", "powercut-all", "corrupt", "fsync-eio", "slow-disk", "disk-full")
# Faults of the disk itself: only with --faultfs, which puts every node's
# data dir on a filesystem that forgets what was not synced.
DISK_FAULTS = ("powercut", "powercut-all", "corrupt", "fsync-eio", "slow-disk", "disk-full")
FAILURE_TIMEOUT_SECS = 5  # mirrorq's default, which the nodes run with
# RabbitMQ (--broker rabbitmq): Debian's package, started by hand.
RMQ_BIN = "/usr/lib/rabbitmq/bin"
# A RabbitMQ node boots in 10-30 s on two shared cores (mirrorq in about one);
# the waits for a node's HTTP after a start scale by this.
RMQ_BOOT_SECS = 120
DISK_FREE_LIMIT = 50_000_000  # mirrorq's (and RabbitMQ's) default, which the nodes run with
THIS = os.path.abspath(__file__)
TAG = f"mqf{os.getpid()}"

# Everything that must go on exit, however we exit.
LIVE_PROCS = {}  # pid -> Popen (each the leader of its own process group)
LIVE_NETNS = []
LIVE_MOUNTS = []


def sh(*cmd, check=True, timeout=20):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


def spawn(cmd, **kw):
    # A session of its own, so killpg takes whatever the command started.
    p = subprocess.Popen(cmd, start_new_session=True, **kw)
    LIVE_PROCS[p.pid] = p
    return p


def reap(p, sig=signal.SIGKILL, timeout=10):
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(5)
    LIVE_PROCS.pop(p.pid, None)


def cleanup_all():
    # A second Ctrl-C must not cut the cleanup short.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    for p in list(LIVE_PROCS.values()):
        try:
            os.killpg(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        reap(p)
    while LIVE_NETNS:
        subprocess.run(["ip", "netns", "del", LIVE_NETNS.pop()], capture_output=True)
    while LIVE_MOUNTS:
        # Lazy: a daemon already gone leaves a mount no plain umount takes.
        subprocess.run(["umount", "-l", LIVE_MOUNTS.pop()], capture_output=True)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)


def remove_stale_netns():
    """Namespaces (and their processes) left by earlier runs that died."""
    for line in sh("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.match(r"^mqf(\d+)-", name)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"campaign" in f.read():
                    continue  # a campaign running right now
        except OSError:
            pass
        for p in sh("ip", "netns", "pids", name, check=False).split():
            try:
                os.kill(int(p), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        sh("ip", "netns", "del", name, check=False)
        print(f"removed stale namespace {name}", flush=True)


# ---------------------------------------------------------------- network


class Net:
    """One bridge namespace, a namespace per node and one for the clients.
    Partitions are blackhole routes between node namespaces only."""

    def __init__(self, n):
        self.k = os.getpid() % 200 + 20  # private namespaces; k only eases reading
        self.n = n
        self.ns = {i: f"{TAG}-n{i}" for i in range(1, n + 1)}
        self.ns["cl"] = f"{TAG}-cl"
        self.br = f"{TAG}-br"
        self.cuts = {}  # (from, to) -> the route kind

    def addr(self, i):
        return f"10.213.{self.k}.{CLIENT_HOST if i == 'cl' else i}"

    def setup(self):
        sh("ip", "netns", "add", self.br)
        LIVE_NETNS.append(self.br)
        sh("ip", "-n", self.br, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.br, "link", "set", "br0", "up")
        for i, ns in self.ns.items():
            sh("ip", "netns", "add", ns)
            LIVE_NETNS.append(ns)
            # Both veth ends are created from inside the bridge namespace:
            # the root namespace's links are never touched.
            sh("ip", "-n", self.br, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", self.br, "link", "set", f"v{i}", "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def cut(self, a, b, route="blackhole"):
        """`route`: blackhole drops what `a` and `b` send each other;
        unreachable rejects it at once, as a firewall that answers with an
        ICMP host-unreachable (a dial fails with EHOSTUNREACH, not a
        refusal: the peer is not dead); reset is a firewall that rejects
        TCP with a reset (nftables on each side's input: a dial is refused
        and a live connection reset, exactly as if the peer's process were
        gone)."""
        for x, y in ((a, b), (b, a)):
            if (x, y) in self.cuts:
                continue
            if route == "reset":
                ns = self.ns[x]
                sh("ip", "netns", "exec", ns, "nft", "add", "table", "inet", "mqf")
                sh("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "mqf", "input",
                   "{ type filter hook input priority 0 ; }")
                # A reset itself passes: the other side's firewall sends it.
                sh("ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "mqf", "input",
                   "ip", "saddr", self.addr(y), "tcp", "flags", "&", "rst", "==", "0", "reject", "with", "tcp", "reset")
            else:
                sh("ip", "-n", self.ns[x], "route", "add", route, f"{self.addr(y)}/32")
            self.cuts[(x, y)] = route

    def cut_from(self, a, b):
        """`a` can no longer send to `b` (one way: `b` still sends to `a`)."""
        if (a, b) not in self.cuts:
            sh("ip", "-n", self.ns[a], "route", "add", "blackhole", f"{self.addr(b)}/32")
            self.cuts[(a, b)] = "blackhole"

    def heal(self):
        for (x, y), route in sorted(self.cuts.items()):
            if route == "reset":
                sh("ip", "netns", "exec", self.ns[x], "nft", "delete", "table", "inet", "mqf", check=False)
            else:
                sh("ip", "-n", self.ns[x], "route", "del", route, f"{self.addr(y)}/32", check=False)
        self.cuts.clear()


# ---------------------------------------------------------------- disks


class Disk:
    """A node's disk: its data dir through faultfs, over a real directory.
    What the node writes stays in faultfs's cache until the node fsyncs it
    (and, strict, a new or renamed name until its directory is fsync'd), so
    a power cut here loses exactly what a real one may."""

    def __init__(self, i, args, root):
        self.faultfs, self.strict = args.faultfs, args.strict_dirs
        self.backing = os.path.join(root, f"node{i}.disk")
        self.mnt = os.path.join(root, f"node{i}.mnt")
        self.sock = os.path.join(root, f"node{i}.fs.sock")
        self.log = os.path.join(root, f"node{i}.fs.log")
        self.proc = None

    def mount(self):
        os.makedirs(self.backing, exist_ok=True)
        os.makedirs(self.mnt, exist_ok=True)
        cmd = [self.faultfs, "mount", "--backing", self.backing, "--mountpoint", self.mnt, "--control", self.sock]
        if self.strict:
            cmd.append("--strict")
        with open(self.log, "ab") as log:
            self.proc = spawn(cmd, stdout=log, stderr=log)
        LIVE_MOUNTS.append(self.mnt)
        end = time.time() + 20
        while not (os.path.ismount(self.mnt) and os.path.exists(self.sock)):
            if self.proc.poll() is not None or time.time() > end:
                raise RuntimeError(f"faultfs did not mount {self.mnt}; see {self.log}")
            time.sleep(0.05)

    def ctl(self, *args):
        r = subprocess.run([self.faultfs, "ctl", self.sock, *map(str, args)], capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"faultfs ctl {' '.join(map(str, args))}: {r.stdout.strip()} {r.stderr.strip()}")
        return r.stdout.strip()

    def files(self, under):
        """Regular files under `under` of the data dir, largest first."""
        top = os.path.join(self.mnt, "data", under)
        found = []
        for d, _, names in os.walk(top):
            for n in names:
                p = os.path.join(d, n)
                found.append((os.path.getsize(p), os.path.relpath(p, self.mnt)))
        return [p for size, p in sorted(found, reverse=True) if size > 0]


def rabbit_files(d, where):
    """A RabbitMQ node's files to corrupt, largest first. "wal" is Ra's
    write-ahead log (one per node, for every quorum queue on it); "sled",
    mirrorq's state store, stands for what Ra keeps per queue beside it
    (segments, snapshots, metadata)."""
    found = []
    for dp, _, names in os.walk(os.path.join(d.mnt, "data")):
        if "/quorum/" not in dp + "/":
            continue
        for n in names:
            if n.endswith(".wal") == (where == "wal"):
                p = os.path.join(dp, n)
                found.append((os.path.getsize(p), os.path.relpath(p, d.mnt)))
    return [p for size, p in sorted(found, reverse=True) if size > 0]


# ---------------------------------------------------------------- nodes


class Node:
    def __init__(self, i, args, net, root, secret):
        self.i, self.args, self.net = i, args, net
        self.disk = Disk(i, args, root) if args.faultfs else None
        # On faultfs the data dir is made by the node inside the mount, so
        # creating it has to be made durable by the node too.
        self.data = os.path.join(self.disk.mnt, "data") if self.disk else os.path.join(root, f"node{i}")
        self.log = os.path.join(root, f"node{i}.log")
        self.secret = secret
        self.proc = None
        self.stopped = False

    def note(self, what):
        # Marks in the node's own log make its lines easy to match to faults.
        with open(self.log, "a") as f:
            f.write(f"===== campaign t={now():.1f}: {what} =====\n")

    def start(self):
        a = self.net.addr
        cluster = ",".join(f"{j}={a(j)}:{RAFT_PORT}" for j in range(1, self.net.n + 1))
        cmd = ["ip", "netns", "exec", self.net.ns[self.i], self.args.bin, "serve", "--node-id", str(self.i),
               "--data-dir", self.data, "--raft-listen", f"{a(self.i)}:{RAFT_PORT}",
               "--amqp-listen", f"{a(self.i)}:{AMQP_PORT}", "--http-listen", f"127.0.0.1:{HTTP_PORT}",
               "--cluster", cluster]
        if self.secret:
            cmd += ["--cluster-secret-file", self.secret]
        if self.args.failure_timeout is not None:
            cmd += ["--failure-timeout", str(self.args.failure_timeout)]
        self.note("start")
        env = dict(os.environ, MIRRORQ_LOG=os.environ.get("CAMPAIGN_NODE_LOG", "info,openraft=warn"))
        with open(self.log, "ab") as log:
            # `ip netns exec` execs the binary: the pid is mirrorq's own.
            self.proc = spawn(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
        self.stopped = False

    def up(self):
        return self.proc is not None and self.proc.poll() is None

    def kill9(self):
        self.note("kill -9")
        if self.proc:
            reap(self.proc)
        self.proc, self.stopped = None, False

    def term(self, timeout=30):
        """Graceful stop; False if it had to be killed."""
        self.note("SIGTERM")
        if self.stopped:
            self.cont()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return False
        LIVE_PROCS.pop(self.proc.pid, None)
        self.proc = None
        return True

    def stop(self):
        self.note("SIGSTOP")
        self.proc.send_signal(signal.SIGSTOP)
        self.stopped = True

    def cont(self):
        self.note("SIGCONT")
        self.proc.send_signal(signal.SIGCONT)
        self.stopped = False


class RabbitNode(Node):
    """A RabbitMQ node in its namespace, named rabbit@<its address> (long
    names), with its own epmd. epmd runs in the node's process group, so a
    kill -9 or a power cut takes it with beam.smp; it is started first and
    waited for, or erl would start `epmd -daemon`, which leaves the group."""

    def __init__(self, i, args, net, root, secret):
        super().__init__(i, args, net, root, secret)
        self.root = root

    def start(self):
        # A node that died by itself may have left its epmd behind.
        self.kill_group()
        a = self.net.addr
        conf = os.path.join(self.root, f"node{self.i}.rabbitmq.conf")
        with open(conf, "w") as f:
            f.write(f"listeners.tcp.default = {a(self.i)}:{AMQP_PORT}\n"
                    f"management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {HTTP_PORT}\n"
                    # Queue counts for the drain fresher than the default 5 s.
                    "collect_statistics_interval = 1000\n"
                    # A blank node joins whichever listed node runs; node 1
                    # starts alone first at setup (run_one), so one cluster forms.
                    "cluster_formation.peer_discovery_backend = classic_config\n"
                    + "".join(f"cluster_formation.classic_config.nodes.{j} = rabbit@{a(j)}\n"
                              for j in range(1, self.net.n + 1)))
        plugins = os.path.join(self.root, f"node{self.i}.enabled_plugins")
        with open(plugins, "w") as f:
            f.write("[rabbitmq_management].\n")
        env = dict(os.environ, HOME=os.path.join(self.root, "rabbitmq-home"),
                   RABBITMQ_NODENAME=f"rabbit@{a(self.i)}", RABBITMQ_USE_LONGNAME="true",
                   RABBITMQ_CONFIG_FILE=conf, RABBITMQ_ENABLED_PLUGINS_FILE=plugins,
                   RABBITMQ_MNESIA_BASE=self.data, RABBITMQ_LOG_BASE=os.path.join(self.root, f"node{self.i}.rlog"),
                   RABBITMQ_LOGS="-", RABBITMQ_PID_FILE=os.path.join(self.root, f"node{self.i}.pid"),
                   RABBITMQ_PLUGINS_EXPAND_DIR=os.path.join(self.root, f"node{self.i}.plugins"),
                   ERL_CRASH_DUMP=os.path.join(self.root, f"node{self.i}.erl_crash.dump"),
                   # Three VMs on two shared cores: schedulers that spin
                   # while idle starve the others (no durability setting).
                   RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="+sbwt none +sbwtdcpu none +sbwtdio none")
        script = ('epmd & k=0; until epmd -names >/dev/null 2>&1 || [ $k -ge 100 ]; do sleep 0.1; k=$((k+1)); done; '
                  'exec "$0"')
        cmd = ["ip", "netns", "exec", self.net.ns[self.i], "sh", "-c", script, os.path.join(RMQ_BIN, "rabbitmq-server")]
        self.note("start")
        with open(self.log, "ab") as log:
            # The script forwards SIGTERM to beam.smp as a graceful stop.
            self.proc = spawn(cmd, stdout=log, stderr=log, env=env)
        self.stopped = False

    def kill_group(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def term(self, timeout=30):
        group = self.proc.pid
        ok = super().term(timeout)
        try:
            # epmd outlives a graceful stop; the next start brings its own.
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return ok

    def stop(self):
        # The whole node (beam.smp and its children), not the start script.
        self.note("SIGSTOP")
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self):
        self.note("SIGCONT")
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.stopped = False


T0 = time.time()


def now():
    return time.time() - T0


def say(msg):
    print(f"[t={now():6.1f}] {msg}", flush=True)


def http(net, i, method, path, body=None, timeout=10):
    """(status, json) of one call as guest over node i's loopback; status 0
    when no answer came."""
    cmd = ["ip", "netns", "exec", net.ns[i], sys.executable, THIS, "_http", method,
           f"http://127.0.0.1:{HTTP_PORT}{path}", "" if body is None else json.dumps(body), str(timeout)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 10)
        out = json.loads(r.stdout)
        return out["status"], out["body"]
    except (subprocess.TimeoutExpired, ValueError, KeyError) as e:
        return 0, str(e)


def http_main(method, url, body, timeout):
    req = urllib.request.Request(url, method=method, data=body.encode() if body else None)
    req.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=float(timeout)) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    except Exception as e:  # refused, reset, timeout: no answer
        status, text = 0, json.dumps(repr(e))
    try:
        parsed = json.loads(text) if text else None
    except ValueError:
        parsed = text
    print(json.dumps({"status": status, "body": parsed}))


class Cluster:
    def __init__(self, args, net, root, secret):
        self.net = net
        self.rabbit = args.broker == "rabbitmq"
        # The mirroring policy's keys besides the mode (ha-promote-on-failure).
        self.ha = {"ha-promote-on-failure": args.promote_on_failure} if args.promote_on_failure else {}
        kind = RabbitNode if self.rabbit else Node
        self.nodes = {i: kind(i, args, net, root, secret) for i in range(1, args.nodes + 1)}
        self.anomalies = []
        # Anomalies that fail the run: a node that stopped by itself (one
        # that cannot start again after a power cut among them).
        self.fatal = []
        # What differs from mirrorq's contract without being a loss (RabbitMQ).
        self.notes = []
        self.expect_up = set()
        self.boot_secs = RMQ_BOOT_SECS if self.rabbit else 30

    def start(self, i):
        self.nodes[i].start()
        self.expect_up.add(i)

    def kill9(self, i):
        self.expect_up.discard(i)
        self.nodes[i].kill9()

    def power_cut(self, i, torn, seed):
        """Node i's disk loses what was not synced (its process is dead)."""
        d = self.nodes[i].disk
        self.nodes[i].note(f"power cut ({'torn' if torn else 'cut'} {seed})")
        out = d.ctl("torn" if torn else "cut", seed)
        self.nodes[i].note(f"disk: {out}")

    def restart(self, i, down=0.0):
        self.expect_up.discard(i)
        if not self.nodes[i].term():
            self.anomalies.append(f"n{i} ignored SIGTERM for 30s")
        self.sleep(down)
        self.start(i)

    def check(self):
        """A node that exited on its own is a finding; start it again."""
        for i in sorted(self.expect_up):
            n = self.nodes[i]
            if not n.up():
                code = n.proc.returncode
                with open(n.log, errors="replace") as f:
                    tail = " / ".join(re.sub(r"\x1b\[[0-9;]*m", "", l).strip() for l in f.readlines()[-3:])
                self.fatal.append(f"n{i} exited by itself (code {code}) at t={now():.0f}: {tail}")
                say(f"!! n{i} exited by itself, code {code}; starting it again. Log tail: {tail}")
                LIVE_PROCS.pop(n.proc.pid, None)
                n.start()

    def sleep(self, secs):
        end = time.time() + secs
        while time.time() < end:
            self.check()
            time.sleep(min(0.5, max(0.0, end - time.time())))

    def api(self, method, path, body=None, timeout=10, prefer=None):
        order = sorted(self.nodes, key=lambda j: (j != prefer, j))
        for j in order:
            n = self.nodes[j]
            if n.up() and not n.stopped:
                return http(self.net, j, method, path, body, timeout)
        return 0, "no node up"

    def wait_http(self, i, timeout=30):
        end = time.time() + timeout
        while time.time() < end:
            if http(self.net, i, "GET", "/api/health/checks/alarms", timeout=3)[0] == 200:
                return True
            self.sleep(0.3)
        return False


def until(what, fn, timeout):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        ok, last = fn()
        if ok:
            return last
        time.sleep(0.5)
    raise RuntimeError(f"setup: {what} not done in {timeout}s (last: {last})")


def setup_broker(c):
    for i in c.nodes:
        if not c.wait_http(i, RMQ_BOOT_SECS if c.rabbit else 60):
            raise RuntimeError(f"setup: n{i} never answered HTTP; see {c.nodes[i].log}")
    n = len(c.nodes)

    def nodes_ok():
        s, b = c.api("GET", "/api/nodes")
        # RabbitMQ lists stopped members too.
        ok = s == 200 and isinstance(b, list) and len(b) == n
        return ok and (not c.rabbit or all(x.get("running") for x in b)), (s, b)

    until("all nodes registered", nodes_ok, 60)
    calls = [
        ("PUT", f"/api/users/{USER}", {"password": PASSWORD, "tags": "administrator"}),
        ("PUT", f"/api/permissions/%2F/{USER}", {"configure": ".*", "write": ".*", "read": ".*"}),
    ]
    if c.rabbit:
        # Quorum queues: a member on every node (the default initial group
        # size is the whole cluster), durability settings left at their
        # defaults; no ha policy, which applies to classic queues only.
        calls += [("PUT", f"/api/queues/%2F/{q}", {"durable": True, "auto_delete": False,
                                                   "arguments": {"x-queue-type": "quorum"}}) for q in QUEUES]
    else:
        calls += [("PUT", "/api/policies/%2F/ha",
                   {"pattern": ".*", "definition": {"ha-mode": "all", **c.ha}, "apply-to": "queues"})]
        calls += [("PUT", f"/api/queues/%2F/{q}", {"durable": True, "auto_delete": False, "arguments": {}})
                  for q in QUEUES]
    for method, path, body in calls:
        until(f"{method} {path}", lambda: ((s := c.api(method, path, body)[0]) in (200, 201, 204), s), 60)

    for q in QUEUES:
        def mirrored():
            s, b = c.api("GET", f"/api/queues/%2F/{q}")
            if c.rabbit:
                ok = (s == 200 and b.get("state") == "running" and len(b.get("members", [])) == n
                      and len(b.get("online", [])) == n)
            else:
                ok = s == 200 and b.get("state") == "running" and len(b.get("synchronised_slave_nodes", [])) == n - 1
            return ok, (s, b)
        b = until(f"{q} mirrored on every node", mirrored, 60)[1]
        if c.rabbit:
            say(f"{q}: leader {b.get('leader')}, members {b['members']}")
        else:
            say(f"{q}: master {b['node']}, mirrors {b['synchronised_slave_nodes']}")


# ---------------------------------------------------------------- faults


def fq1_master(c):
    """fq1's master node id, as the cluster tells it now (None if unknown)."""
    try:
        s, b = c.api("GET", "/api/queues/%2F/fq1")
        if s == 200 and b.get("node", "").startswith("mirrorq@"):
            return int(b["node"].split("@", 1)[1])
        # A quorum queue's leader, rabbit@10.213.k.<id>.
        if c.rabbit and s == 200 and str(b.get("leader", "")).startswith("rabbit@"):
            return int(b["leader"].rsplit(".", 1)[1])
    except Exception:
        pass
    return None


def plan(seed, args):
    """The whole schedule from the seed alone, before anything runs: the
    same seed gives the same faults whatever the timing does."""
    rng = random.Random(seed)
    ids = list(range(1, args.nodes + 1))
    minority = (args.nodes - 1) // 2
    kinds = {"kill9": 3, "kill9-unacked": 2, "sigstop": 2, "partition": 3, "restart": 2, "move": 1}
    if args.classic:
        kinds["classic"] = 1
        kinds["pause-heal"] = 1
    if args.faultfs:
        # A full disk only with --faults: in the default mix it would
        # change every seed's schedule (t61 runs chosen seeds).
        kinds.update({"powercut": 3, "powercut-all": 1, "corrupt": 1, "fsync-eio": 1, "slow-disk": 1})
    if args.faults:
        # Kinds asked for that the mix leaves out (disk-full) weigh 1; the
        # others keep their weights and order, so seeds keep their schedules.
        kinds = {k: w for k, w in kinds.items() if k in args.faults}
        for k in args.faults:
            kinds.setdefault(k, 1)
    faults, t = [], rng.uniform(2, 5)
    while t < args.duration and kinds:
        kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
        f = {"kind": kind, "at": round(t, 1), "hold": round(rng.uniform(3, 20), 1), "gap": round(rng.uniform(1, 6), 1)}
        if kind in ("kill9", "sigstop"):
            f["nodes"] = sorted(rng.sample(ids, rng.randint(1, minority)))
        elif kind in ("kill9-unacked", "restart"):
            f["nodes"] = [rng.choice(ids)]
        elif kind == "move":
            # fq1 goes to a majority of the nodes (ha-mode: nodes) and,
            # when the fault ends, back to all of them.
            f["nodes"] = sorted(rng.sample(ids, minority + 1))
        elif kind == "classic":
            keep = rng.choice(ids)
            f["nodes"] = [i for i in ids if i != keep]
            f["hold"] = max(f["hold"], 8.0)  # past the failure timeout, so the survivor re-forms
            kinds.pop("classic")  # once a run is "occasionally"
        elif kind in ("powercut", "powercut-all"):
            f["nodes"] = ids if kind == "powercut-all" else sorted(rng.sample(ids, rng.randint(1, minority)))
            f["torn"] = rng.random() < 0.4  # else every unsynced write is simply gone
            f["fsseed"] = rng.randrange(1 << 31)
            if kind == "powercut-all":
                f["hold"] = min(f["hold"], 8.0)
                kinds.pop("powercut-all")
        elif kind == "corrupt":
            # One replica only: the promise holds while one synchronised
            # replica's disk survives.
            f["nodes"] = [rng.choice(ids)]
            f["where"] = rng.choice(["wal", "sled"])
            f["how"] = rng.choice(["flip", "zero", "truncate"])
            f["fsseed"] = rng.randrange(1 << 31)
        elif kind == "fsync-eio":
            f["nodes"] = [rng.choice(ids)]
            f["fsseed"] = rng.randrange(1 << 31)
        elif kind == "slow-disk":
            f["nodes"] = [rng.choice(ids)]
            f["ms"] = rng.choice([10, 50, 200])
        elif kind == "disk-full":
            f["nodes"] = [rng.choice(ids)]
            # alarm: room left below the disk free limit, so the disk alarm
            # blocks publishers there before a write can fail; enospc: 1 MiB,
            # so the node's own writes (replication, acks, sled) meet ENOSPC
            # too, and it may stop (fail-stop) until space is freed.
            f["room"] = rng.choice(["alarm", "enospc"])
        elif kind == "pause-heal":
            # Who is isolated and who is paused depends on where fq1's
            # master is when it runs; this order picks them.
            f["nodes"] = rng.sample(ids, len(ids))
            f["hold"] = max(f["hold"], 12.0)  # the paused wake past the failure timeout
            kinds.pop("pause-heal")
        elif kind in ("partition-reject", "partition-reset"):
            # Only when asked for (--faults): in the default mix they would
            # change every seed's schedule. A firewall that rejects: with
            # an ICMP host-unreachable (a route of type unreachable), or a
            # TCP reset (nftables), which answers a dial as the host of a
            # dead process does.
            how, route = ("reject", "unreachable") if kind == "partition-reject" else ("reset", "reset")
            shape = rng.choice(["halves", "isolate"])
            order = rng.sample(ids, len(ids))
            cut = len(ids) // 2 if shape == "halves" else 1
            f.update(kind="partition", shape=f"{how}-{shape}", route=route, bridge=None,
                     sides=[sorted(order[:cut]), sorted(order[cut:])])
        else:
            shape = rng.choice(["halves", "isolate", "bridge", "oneway"])
            order = rng.sample(ids, len(ids))
            # oneway: nothing reaches the first node, which still sends to
            # every other (its packets arrive; nothing comes back).
            if shape in ("isolate", "oneway"):
                f["sides"], f["bridge"] = [order[:1], order[1:]], None
            elif shape == "halves":
                half = len(ids) // 2  # 1|2 of three, 2|3 of five
                f["sides"], f["bridge"] = [order[:half], order[half:]], None
            else:
                rest = order[1:]
                cut = rng.randint(1, len(rest) - 1)
                f["sides"], f["bridge"] = [rest[:cut], rest[cut:]], order[0]
            f["sides"] = [sorted(s) for s in f["sides"]]
            f["shape"] = shape
        faults.append(f)
        t += f["hold"] + f["gap"]
    # Half the runs with disk faults cut the power of the whole cluster
    # once, whatever the draw gave.
    if "powercut-all" in kinds and rng.random() < 0.5 and faults:
        k = rng.randrange(len(faults))
        faults[k] = dict(faults[k], kind="powercut-all", nodes=ids, torn=rng.random() < 0.4,
                         fsseed=rng.randrange(1 << 31), hold=min(faults[k]["hold"], 8.0))
    # Every run with disk faults cuts some power at least once.
    if args.faultfs and faults and not any(f["kind"].startswith("powercut") for f in faults) \
            and (not args.faults or "powercut" in args.faults):
        k = rng.randrange(len(faults))
        faults[k] = dict(faults[k], kind="powercut", nodes=sorted(rng.sample(ids, rng.randint(1, minority))),
                         torn=rng.random() < 0.4, fsseed=rng.randrange(1 << 31))
    return faults


def describe(f):
    if f["kind"] == "partition":
        x = f"|x=n{f['bridge']}" if f["bridge"] else ""
        who = "|".join("".join(map(str, s)) for s in f["sides"]) + x
        return f"partition-{f['shape']}({who},{f['hold']:.0f}s)"
    if f["kind"] == "pause-heal":
        return f"pause-heal({f['hold']:.0f}s)"
    if f["kind"] in ("powercut", "powercut-all"):
        how = "torn" if f["torn"] else "cut"
        return f"{f['kind']}-{how}({','.join(f'n{i}' for i in f['nodes'])},{f['hold']:.0f}s)"
    if f["kind"] == "corrupt":
        return f"corrupt-{f['where']}-{f['how']}(n{f['nodes'][0]},{f['hold']:.0f}s)"
    if f["kind"] == "slow-disk":
        return f"slow-disk(n{f['nodes'][0]},{f['ms']}ms,{f['hold']:.0f}s)"
    if f["kind"] == "disk-full":
        seen = f":{f['outcome']}" if f.get("outcome") else ""
        return f"disk-full-{f['room']}(n{f['nodes'][0]},{f['hold']:.0f}s{seen})"
    return f"{f['kind']}({','.join(f'n{i}' for i in f['nodes'])},{f['hold']:.0f}s)"


def run_fault(f, c, net, ctl):
    say(f"fault {describe(f)}")
    kind, nodes = f["kind"], f.get("nodes", [])
    if kind in ("kill9", "classic"):
        for i in nodes:
            c.kill9(i)
        c.sleep(f["hold"])
        for i in nodes:
            c.start(i)
    elif kind == "kill9-unacked":
        i = nodes[0]
        # Consumers on n_i stop acking, so they hold up to a prefetch of
        # unacked deliveries when their node dies under them.
        hold = os.path.join(ctl, f"hold-n{i}")
        open(hold, "w").close()
        c.sleep(1.5)
        c.kill9(i)
        os.unlink(hold)
        c.sleep(f["hold"])
        c.start(i)
    elif kind == "pause-heal":
        # A node cut off alone re-forms fq1 (a minority's fork); fq1's
        # master and enough others to leave the old group without a
        # majority are paused just before the heal, so the rest heal into
        # the fork while the master sleeps. When it wakes, the old epoch it
        # mastered is gone: it must rejoin the fork, not go on alone.
        master = fq1_master(c) or nodes[0]
        others = [i for i in nodes if i != master]
        iso, paused = others[0], [master] + others[1:(len(nodes) - 1) // 2]
        say(f"  n{iso} isolated, then n{','.join(map(str, paused))} paused through the heal")
        for y in c.nodes:
            if y != iso:
                net.cut(iso, y)
        f["cut_at"] = now()
        c.sleep(FAILURE_TIMEOUT_SECS + 4)  # the isolated node re-forms alone
        for i in paused:
            c.nodes[i].stop()
        net.heal()
        f["healed_at"] = now()
        for i in c.nodes:
            c.nodes[i].note(f"healed; n{','.join(map(str, paused))} paused")
        c.sleep(f["hold"])
        for i in paused:
            c.nodes[i].cont()
    elif kind in ("powercut", "powercut-all"):
        # Every process first, then every disk: one instant for all of them.
        for i in nodes:
            c.kill9(i)
        for i in nodes:
            c.power_cut(i, f["torn"], f["fsseed"] + i)
        c.sleep(f["hold"])
        for i in nodes:
            c.start(i)
    elif kind == "corrupt":
        i = nodes[0]
        d = c.nodes[i].disk
        rng = random.Random(f["fsseed"])
        c.kill9(i)
        files = rabbit_files(d, f["where"]) if c.rabbit else d.files(f["where"])
        if files:
            path = rng.choice(files[:4])
            # Log segments are preallocated: aim at what was written, not
            # at the zeros after it.
            with open(os.path.join(d.mnt, path), "rb") as fh:
                size = len(fh.read().rstrip(b"\0")) or 1
            off = rng.randrange(size)
            if f["how"] == "flip":
                d.ctl("flip", path, off, rng.randint(1, 8))
            elif f["how"] == "zero":
                d.ctl("zero", path, off, min(size - off, rng.choice([1, 512, 4096, 65536])))
            else:
                d.ctl("truncate", path, off)
            c.nodes[i].note(f"disk: {f['how']} {path} at {off} of {size}")
            say(f"  n{i}: {f['how']} {path} at {off} of {size}")
        else:
            say(f"  n{i}: no {f['where']} file to corrupt")
        c.sleep(f["hold"])
        c.start(i)
    elif kind == "fsync-eio":
        i = nodes[0]
        d = c.nodes[i].disk
        c.expect_up.discard(i)
        d.ctl("fail-fsync", 1)
        end = time.time() + 15
        while c.nodes[i].up() and time.time() < end:
            time.sleep(0.1)
        if c.nodes[i].up() and c.rabbit:
            # Stopping on a failed fsync is mirrorq's rule, not RabbitMQ's:
            # whether what it confirmed survives is the loss check's to say.
            c.notes.append(f"n{i} still running 15s after an fsync failed under it (t={now():.0f})")
            say(f"  n{i} still running 15s after a failed fsync (RabbitMQ does not stop on one)")
            d.ctl("fail-fsync", 0)
        elif c.nodes[i].up():
            c.anomalies.append(f"n{i} still running 15s after an fsync failed under it")
            say(f"!! n{i} still running 15s after a failed fsync")
            d.ctl("fail-fsync", 0)
        else:
            say(f"  n{i} stopped on the failed fsync (code {c.nodes[i].proc.returncode})")
            LIVE_PROCS.pop(c.nodes[i].proc.pid, None)
        c.kill9(i)
        # What the failed sync was to make durable may never reach the disk.
        c.power_cut(i, False, f["fsseed"])
        c.sleep(f["hold"])
        c.start(i)
    elif kind == "slow-disk":
        d = c.nodes[nodes[0]].disk
        d.ctl("delay-fsync", f["ms"])
        c.sleep(f["hold"])
        d.ctl("delay-fsync", 0)
    elif kind == "disk-full":
        i = nodes[0]
        n, d = c.nodes[i], c.nodes[i].disk
        used = sum(os.path.getsize(os.path.join(dp, x)) for dp, _, xs in os.walk(d.backing) for x in xs)
        room = DISK_FREE_LIMIT // 2 if f["room"] == "alarm" else 1 << 20
        # It may stop by itself (fail-stop on ENOSPC): not a finding here.
        c.expect_up.discard(i)
        d.ctl("enospc", used + room)
        n.note(f"disk full: {room} bytes left")
        start, blocked, stopped = time.time(), None, None
        while time.time() < start + f["hold"]:
            c.check()
            if stopped is None and not n.up():
                stopped = (time.time() - start, n.proc.returncode)
                LIVE_PROCS.pop(n.proc.pid, None)
            if blocked is None and stopped is None:
                status, _ = http(c.net, i, "GET", "/api/health/checks/alarms", None, 5)
                if status == 503:
                    blocked = time.time() - start
            time.sleep(0.5)
        d.ctl("enospc", "off")
        seen = []
        seen.append(f"blocked@{blocked:.0f}s" if blocked is not None else "never-blocked")
        if stopped is not None:
            with open(n.log, errors="replace") as fh:
                why = [l.strip() for l in fh if "stopping the node" in l or "did not stop within" in l]
            seen.append(f"stopped@{stopped[0]:.0f}s(code {stopped[1]})")
            say(f"  n{i} stopped on the full disk, code {stopped[1]}: {why[0][:300] if why else 'no reason logged'}")
            if not why:
                c.anomalies.append(f"n{i} stopped on a full disk without saying why")
            if stopped[1] != 1:
                # Fail-stop exits 1; anything else (a panic's 101, a signal)
                # is not the rule.
                c.anomalies.append(f"n{i} stopped on a full disk with exit code {stopped[1]}, not 1")
            c.start(i)
            if not c.wait_http(i):
                c.anomalies.append(f"n{i} did not serve after a restart on its freed disk")
                seen.append("not-restarted")
            else:
                seen.append("restarted")
        else:
            c.expect_up.add(i)
            if blocked is None and f["room"] == "alarm":
                c.anomalies.append(f"n{i}: no disk alarm with {room} bytes left (limit {DISK_FREE_LIMIT})")
        f["outcome"] = ",".join(seen)
        say(f"  n{i} on a full disk ({f['room']}): {f['outcome']}")
    elif kind == "sigstop":
        for i in nodes:
            c.nodes[i].stop()
        c.sleep(f["hold"])
        for i in nodes:
            c.nodes[i].cont()
    elif kind == "restart":
        c.restart(nodes[0], down=min(f["hold"], 5))
        c.sleep(max(0, f["hold"] - 5))
    elif kind == "move" and c.rabbit:
        # ha-mode policies do not apply to quorum queues (their members
        # change only by CLI); the slot stays idle so the schedule keeps its times.
        say("  move: skipped for rabbitmq (no ha-mode policy for quorum queues); the fault's time passes idle")
        c.sleep(f["hold"])
    elif kind == "move":
        names = [f"mirrorq@{i}" for i in nodes]
        body = {"pattern": "^fq1$", "definition": {"ha-mode": "nodes", "ha-params": names, **c.ha},
                "priority": 10, "apply-to": "queues"}
        status, _ = c.api("PUT", "/api/policies/%2F/mqf-move", body)
        say(f"  fq1 to {names}: {status}")
        c.sleep(f["hold"])
        status, _ = c.api("DELETE", "/api/policies/%2F/mqf-move")
        say(f"  fq1 back to every node: {status}")
    else:
        a, b = f["sides"]
        for x in a:
            for y in b:
                if f["shape"] == "oneway":
                    net.cut_from(y, x)
                else:
                    net.cut(x, y, f.get("route", "blackhole"))
        for i in c.nodes:
            c.nodes[i].note(f"partition {describe(f)}")
        f["cut_at"] = now()
        c.sleep(f["hold"])
        net.heal()
        f["healed_at"] = now()
        for i in c.nodes:
            c.nodes[i].note("healed")
    c.sleep(f["gap"])


# ---------------------------------------------------------------- clients
# These run in the client namespace, in one process (`_clients`), a thread
# and a BlockingConnection per publisher and per consumer.


def client_params(spec, node):
    import pika
    return pika.ConnectionParameters(
        host=spec["addrs"][str(node)], port=AMQP_PORT, credentials=pika.PlainCredentials(USER, PASSWORD),
        heartbeat=10, blocked_connection_timeout=30, socket_timeout=5, stack_timeout=15, connection_attempts=1)


def flag(spec, name):
    return os.path.exists(os.path.join(spec["ctl"], name))


def publisher(spec, node, queue, watch):
    import pika
    t0, run = spec["t0"], spec["run"]
    log = open(os.path.join(spec["out"], f"pub-n{node}-{queue}.log"), "a", buffering=1)
    props = pika.BasicProperties(delivery_mode=2)
    conn, ch, counter = None, None, 0
    gap = 1.0 / spec["rate"] if spec["rate"] > 0 else 0
    if queue in SLOW_QUEUES:
        gap = SLOW_QUEUES[queue] * len(spec["addrs"])
    due = time.monotonic() + random.uniform(0, gap)
    while not flag(spec, "stop-pub"):
        try:
            if conn is None:
                conn = pika.BlockingConnection(client_params(spec, node))
                ch = conn.channel()
                ch.confirm_delivery()
            counter += 1
            mid = f"{run}-n{node}-{queue}-{counter}"
            # Attempted before the wire: a delivery of it is then never "unexpected".
            log.write(f"A {time.time() - t0:.3f} {mid}\n")
            watch[(node, queue)] = (time.monotonic(), conn)
            try:
                ch.basic_publish("", queue, mid.encode(), props, mandatory=True)
            finally:
                watch.pop((node, queue), None)
            log.write(f"C {time.time() - t0:.3f} {mid}\n")
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as e:
            log.write(f"N {time.time() - t0:.3f} {mid} {type(e).__name__}\n")
        except Exception as e:
            log.write(f"E {time.time() - t0:.3f} {type(e).__name__}: {e}\n")
            try:
                conn and conn.close()
            except Exception:
                pass
            conn = None
            time.sleep(0.5)
        due = max(due + gap, time.monotonic() - 1)
        time.sleep(max(0, due - time.monotonic()))
    try:
        conn and conn.close()
    except Exception:
        pass


def consumer(spec, node, queue):
    import pika
    t0 = spec["t0"]
    # Slower than the publishers: the queues grow deep, so a split's
    # hand-backs show what they cost.
    gap = 1.0 / spec["consume_rate"] if spec.get("consume_rate", 0) > 0 else 0
    log = open(os.path.join(spec["out"], f"cons-n{node}-{queue}.log"), "a", buffering=1)
    while not flag(spec, "stop-cons"):
        held = None  # last delivery tag left unacked while hold-n<node> exists
        try:
            conn = pika.BlockingConnection(client_params(spec, node))
            ch = conn.channel()
            ch.basic_qos(prefetch_count=100)
            resumed = True
            while resumed and not flag(spec, "stop-cons"):
                # With --cancel-resume a consumer cancels itself every few
                # seconds (basic.cancel; pika requeues what it had not yet
                # handed over) and consumes again on the same channel.
                until = time.monotonic() + random.uniform(1, 4) if spec.get("cancel_resume") else None
                for method, _props, body in ch.consume(queue, inactivity_timeout=0.5):
                    holding = flag(spec, f"hold-n{node}")
                    if method is not None:
                        # Recorded on receipt, before the ack.
                        log.write(f"D {time.time() - t0:.3f} {body.decode(errors='replace')} "
                                  f"{int(method.redelivered)}\n")
                        held = method.delivery_tag
                        if gap and not flag(spec, "stop-pub"):
                            time.sleep(gap)
                    if held is not None and not holding:
                        ch.basic_ack(held, multiple=True)
                        held = None
                    if flag(spec, "stop-cons") or (until is not None and time.monotonic() > until):
                        break
                else:
                    log.write(f"E {time.time() - t0:.3f} consumer cancelled by the broker\n")
                    resumed = False
                ch.cancel()
                resumed = resumed and until is not None
            conn.close()
        except Exception as e:
            log.write(f"E {time.time() - t0:.3f} {type(e).__name__}: {e}\n")
            time.sleep(0.5)


def watchdog(spec, watch):
    """A confirm that never comes would block a BlockingConnection forever;
    past PUBLISH_STUCK_SECS the socket is shut so the publisher moves on
    (the message stays unconfirmed)."""
    log = open(os.path.join(spec["out"], "watchdog.log"), "a", buffering=1)
    while True:
        time.sleep(1)
        for key, (since, conn) in list(watch.items()):
            if time.monotonic() - since > PUBLISH_STUCK_SECS:
                log.write(f"W {time.time() - spec['t0']:.3f} publish n{key[0]} {key[1]} unconfirmed for "
                          f"{PUBLISH_STUCK_SECS}s; dropping the connection\n")
                watch.pop(key, None)
                try:
                    import socket
                    conn._impl._transport._sock.shutdown(socket.SHUT_RDWR)
                except Exception as e:
                    log.write(f"W could not shut the socket: {e}\n")


def clients_main(spec_path):
    spec = json.load(open(spec_path))
    parent = os.getppid()
    watch = {}
    pubs, cons = [], []
    for node in spec["addrs"]:
        for q in QUEUES:
            pubs.append(threading.Thread(target=publisher, args=(spec, int(node), q, watch), daemon=True))
            cons.append(threading.Thread(target=consumer, args=(spec, int(node), q), daemon=True))
    threading.Thread(target=watchdog, args=(spec, watch), daemon=True).start()
    for t in pubs + cons:
        t.start()
    # Bounded: stop when told, or when the campaign that started us is gone.
    while not flag(spec, "stop-pub") and os.getppid() == parent:
        time.sleep(0.5)
    for t in pubs:
        t.join(PUBLISH_STUCK_SECS + 15)
    open(os.path.join(spec["ctl"], "pubs-done"), "w").close()
    while not flag(spec, "stop-cons") and os.getppid() == parent:
        time.sleep(0.5)
    for t in cons:
        t.join(20)
    os._exit(0)


# ---------------------------------------------------------------- one run


ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r"\s\w+=")
# A node writes each log line at most 5 times a minute (its log throttle); a
# line seen far more often than that in one minute is a log storm.
STORM_LINES_PER_MINUTE = 30


def log_storms(path):
    """The lines of a node's log that repeated more than STORM_LINES_PER_MINUTE
    times within one minute: {(minute, shape): count} over the limit."""
    seen = Counter()
    try:
        with open(path, errors="replace") as f:
            for line in f:
                line = ANSI.sub("", line)
                if len(line) < 30 or not line[:4].isdigit():
                    continue
                minute, rest = line[:16], line[28:]
                # Level, target and message; field values (queue names,
                # indexes, addresses) and digits do not make a new line.
                shape = re.sub(r"\d+", "#", FIELD.split(rest, 1)[0].strip())[:120]
                seen[(minute, shape)] += 1
    except OSError:
        return {}
    return {k: n for k, n in seen.items() if n > STORM_LINES_PER_MINUTE}


REFORM_LINE = "no majority of the queue's replicas"


def early_reforms(c, faults, failure_timeout):
    """A partition by a firewall that rejects (ICMP unreachable, or TCP
    reset) must not make a live node look dead: no queue may be re-formed
    before the failure timeout has run since the cut, as for a partition
    that drops. Lines of every node's log that did: each fails the run."""
    found = []
    for f in faults:
        if f.get("route") not in ("unreachable", "reset") or "cut_at" not in f:
            continue
        start, end = T0 + f["cut_at"], T0 + min(f["cut_at"] + failure_timeout - 0.5, f.get("healed_at", 1e12))
        for i, n in c.nodes.items():
            try:
                lines = open(n.log, errors="replace").read().splitlines()
            except OSError:
                continue
            for line in lines:
                line = ANSI.sub("", line)
                if REFORM_LINE not in line or not line[:4].isdigit():
                    continue
                try:
                    at = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()
                except ValueError:
                    continue
                if start <= at < end:
                    found.append(f"n{i} re-formed a queue {at - start:.1f}s into {describe(f)}, before the failure "
                                 f"timeout ({failure_timeout}s): a live peer behind a firewall taken for dead")
    return found


def read_lines(path):
    try:
        with open(path) as f:
            return [l.split() for l in f]
    except OSError:
        return []


def run_one(args, seed, root):
    global T0
    T0 = time.time()
    faults = plan(seed, args)
    print(f"===== seed={seed} nodes={args.nodes} duration={args.duration} workdir={root}", flush=True)
    print(f"schedule: {[describe(f) for f in faults]}", flush=True)
    shutil.rmtree(root, ignore_errors=True)  # a --workdir used before
    os.makedirs(root)
    out, ctl = os.path.join(root, "clients"), os.path.join(root, "ctl")
    os.makedirs(out)
    os.makedirs(ctl)
    secret = None
    if args.broker == "rabbitmq":
        # One Erlang cookie for every node, in the HOME they all run with.
        home = os.path.join(root, "rabbitmq-home")
        os.makedirs(home)
        with open(os.path.join(home, ".erlang.cookie"), "w") as f:
            f.write(secrets.token_hex(16))
        os.chmod(os.path.join(home, ".erlang.cookie"), 0o400)
    elif "--cluster-secret-file" in sh(args.bin, "serve", "--help"):
        # The node link is not on loopback here, so a secret is required.
        secret = os.path.join(root, "cluster.secret")
        with open(secret, "w") as f:
            f.write(secrets.token_hex(32) + "\n")  # random, as the docs ask
        os.chmod(secret, 0o600)  # refused otherwise, as an Erlang cookie is
    net = Net(args.nodes)
    c = Cluster(args, net, root, secret)
    clients = None
    wedged, undrained, held, splits = [], {}, {}, {}
    run = f"s{seed}"
    try:
        net.setup()
        for n in c.nodes.values():
            if n.disk:
                n.disk.mount()
        if c.rabbit:
            # Node 1 forms the cluster alone first; the others, blank, find
            # it running and join it (classic config peer discovery).
            c.start(1)
            if not c.wait_http(1, RMQ_BOOT_SECS):
                raise RuntimeError(f"setup: n1 never answered HTTP; see {c.nodes[1].log}")
            for i in list(c.nodes)[1:]:
                c.start(i)
        else:
            for i in c.nodes:
                c.start(i)
        setup_broker(c)

        spec = {"addrs": {str(i): net.addr(i) for i in c.nodes}, "out": out, "ctl": ctl, "t0": T0,
                "run": run, "rate": args.rate, "consume_rate": args.consume_rate,
                "cancel_resume": args.cancel_resume,
                "promote_on_failure": args.promote_on_failure}
        with open(os.path.join(root, "spec.json"), "w") as f:
            json.dump(spec, f)
        with open(os.path.join(root, "clients.log"), "ab") as log:
            clients = spawn(["ip", "netns", "exec", net.ns["cl"], sys.executable, THIS, "_clients",
                             os.path.join(root, "spec.json")], stdout=log, stderr=log)
        c.sleep(3)

        for f in faults:
            run_fault(f, c, net, ctl)

        say("settling: heal, continue, start the dead, then restart every node once")
        net.heal()
        for n in c.nodes.values():
            if n.stopped:
                n.cont()
        for i, n in c.nodes.items():
            if not n.up():
                c.start(i)
        for i in c.nodes:
            c.wait_http(i, c.boot_secs)
        for i in c.nodes:
            c.restart(i)
            if not c.wait_http(i, c.boot_secs):
                c.anomalies.append(f"n{i} did not answer HTTP {c.boot_secs}s after its final restart")
        wedged = probe_queues(c, out, run)

        if clients.poll() is not None:
            c.anomalies.append(f"the client process died early: see {os.path.join(root, 'clients.log')}")
        say("stopping publishers")
        open(os.path.join(ctl, "stop-pub"), "w").close()
        end = time.time() + PUBLISH_STUCK_SECS + 20
        while not os.path.exists(os.path.join(ctl, "pubs-done")) and time.time() < end:
            c.sleep(0.5)
        drain(c, out, args.drain_timeout, args.drain_idle)
        open(os.path.join(ctl, "stop-cons"), "w").close()
        try:
            clients.wait(30)
        except subprocess.TimeoutExpired:
            c.anomalies.append("client process did not stop in 30s")
        reap(clients)
        undrained, held = leftovers(c, out)
        if c.rabbit:
            say("epoch check skipped: replica epochs are mirrorq's (a Raft group cannot fork)")
        else:
            splits = epoch_splits(c)
    finally:
        if clients:
            reap(clients)
        cleanup_all()

    return analyse(args, seed, root, faults, c, out, wedged, undrained, held, splits)


EPOCH_RE = re.compile(r'^mirrorq_queue_epoch_(term|node)\{queue="([^"]+)",vhost="/"\} (\d+)$')


def replica_epochs(c):
    """{queue: {node: "term.node"}} from each node's metrics; None when a
    node did not answer or its build has no epoch metric."""
    seen = {q: {} for q in QUEUES}
    for i in c.nodes:
        s, text = http(c.net, i, "GET", "/metrics", timeout=5)
        if s != 200 or not isinstance(text, str) or "mirrorq_queue_epoch_term" not in text:
            return None
        parts = {}
        for line in text.splitlines():
            m = EPOCH_RE.match(line)
            if m and m.group(2) in seen:
                parts.setdefault(m.group(2), {})[m.group(1)] = m.group(3)
        for q, p in parts.items():
            seen[q][i] = f"{p.get('term')}.{p.get('node')}"
    return seen


def epoch_splits(c, timeout=60):
    """Queues whose replicas are still in different epochs a minute after
    the drain: a minority's fork and the group that kept its majority that
    never met to decide which keeps the queue. The drain alone cannot see
    this when the fork serves and the majority's copy holds messages the
    fork lacks (seed 1168)."""
    end = time.time() + timeout
    while True:
        seen = replica_epochs(c)
        split = {} if seen is None else {q: e for q, e in seen.items() if len(set(e.values())) > 1}
        if not split or time.time() >= end:
            break
        c.sleep(2)
    if seen is None:
        c.anomalies.append("replica epochs not known: a node's metrics did not answer or have no epoch")
    for q, e in split.items():
        say(f"!! SPLIT: {q} replicas in different epochs {timeout}s after the drain: {e}")
    return split


def probe_queues(c, out, run):
    """A queue that accepts no confirmed publish within 30 s of the last
    restart is wedged. Probes go in through each node in turn, so the
    forwarding path counts too; they are expected deliveries like any other."""
    wedged = []
    log = open(os.path.join(out, "pub-probe.log"), "a", buffering=1)
    end = time.time() + 30
    for q in QUEUES:
        k, ok = 0, False
        while not ok and time.time() < end:
            k += 1
            mid = f"{run}-probe-{q}-{k}"
            log.write(f"A {now():.3f} {mid}\n")
            node = 1 + k % len(c.nodes)
            s, b = c.api("POST", "/api/exchanges/%2F/amq.default/publish", prefer=node, timeout=5, body={
                "properties": {"delivery_mode": 2}, "routing_key": q, "payload": mid, "payload_encoding": "string"})
            ok = s == 200 and isinstance(b, dict) and b.get("routed") is True
            if ok:
                log.write(f"C {now():.3f} {mid}\n")
            else:
                time.sleep(0.5)
        if not ok:
            s, b = c.api("GET", f"/api/queues/%2F/{q}")
            say(f"!! WEDGE: {q} accepted no publish within 30s of the last restart; GET: {s} {b}")
            wedged.append(q)
    return wedged


def queue_counts(c):
    """{queue: (ready, unacked)}, None where the API did not answer."""
    counts = {}
    for q in QUEUES:
        s, b = c.api("GET", f"/api/queues/%2F/{q}", timeout=5)
        ok = s == 200 and isinstance(b, dict)
        counts[q] = (b.get("messages_ready"), b.get("messages_unacknowledged")) if ok else None
    return counts


def drain(c, out, bound, idle):
    """Consumers go on until every queue is empty and nothing arrived for
    5 s; or nothing arrived for `idle` s although a queue still counts
    messages (then leftovers() tells stuck from phantom); or `bound` s."""
    say("draining")
    start = time.time()
    quiet_since, last = None, None
    while time.time() - start < bound:
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.startswith("cons-"))
        counts = queue_counts(c)
        quiet_since = (quiet_since or time.time()) if size == last else None
        quiet = time.time() - quiet_since if quiet_since else 0
        if quiet >= 5 and all(v == (0, 0) for v in counts.values()):
            say(f"drained in {time.time() - start:.0f}s")
            return
        if quiet >= idle:
            break
        last = size
        c.sleep(1)
    say(f"!! not drained after {time.time() - start:.0f}s: (ready, unacked) per queue {counts}")
    c.anomalies.append(f"drain did not reach empty queues: (ready, unacked) {counts}")


def leftovers(c, out):
    """Whatever the consumers never got: fetched with basic.get over HTTP so
    that a message stuck in a queue is told apart from a lost one."""
    found = {}
    # Every consumer is gone: what they held unacked must be back within
    # UNACKED_BACK_SECS (the bound), so fetch until then.
    until = time.time() + UNACKED_BACK_SECS
    with open(os.path.join(out, "leftover.log"), "w") as log:
        while True:
            for q in QUEUES:
                for _ in range(200):
                    s, b = c.api("POST", f"/api/queues/%2F/{q}/get", timeout=10,
                                 body={"count": 500, "ackmode": "ack_requeue_false", "encoding": "auto"})
                    if s != 200 or not b:
                        break
                    for m in b:
                        log.write(f"L 0 {m.get('payload')} 0 {q}\n")
                        found[q] = found.get(q, 0) + 1
            counts = queue_counts(c)
            if all(v == (0, 0) for v in counts.values()) or time.time() > until:
                break
            c.sleep(1)
    stuck = {q: v for q, v in counts.items() if v != (0, 0)}
    if stuck:
        # Nothing left to get, yet counted: held by no consumer, never back.
        say(f"!! {UNACKED_BACK_SECS}s after the consumers left, the queues still count (ready, unacked) {counts}")
        c.anomalies.append(f"queues count messages no one can get: (ready, unacked) {counts}")
    return found, stuck


def queue_of(mid):
    """Ids are <run>-<publisher>-<queue>-<counter>."""
    parts = mid.split("-")
    return parts[-2] if len(parts) >= 4 else None


def minority_of(f, n):
    """The nodes of a partition that could not reach a majority."""
    bridge = 1 if f["bridge"] else 0
    return sorted(i for s in f["sides"] if len(s) + bridge < n // 2 + 1 for i in s)


def duplicate_bound(args, faults, out):
    """The duplicates the issue allows. A partition may duplicate at most
    what its minority side confirmed or delivered during it (the minority's
    fork hands back what it confirmed; what it delivered the majority may
    deliver again), plus the unacked windows of that side's consumers,
    which the master gives back when their node stays unreachable. Every
    other fault, and the final restart of every node, may give back every
    affected consumer's unacked window (at least once, marked redelivered).
    None when the run had the classic demo or a pause through a heal: the
    re-formed epoch then becomes the queue, and the issue sets no bound for
    that."""
    if any(f["kind"] in ("classic", "pause-heal") for f in faults):
        return None
    window = PREFETCH * len(QUEUES)  # one node's consumers
    bound = window * args.nodes  # the final restarts
    by_node = {}
    for name in os.listdir(out):
        m = re.match(r"(pub|cons)-n(\d+)-", name)
        if m:
            want = "C" if m.group(1) == "pub" else "D"
            times = [float(r[1]) for r in read_lines(os.path.join(out, name)) if r and r[0] == want and len(r) >= 3]
            by_node.setdefault(int(m.group(2)), []).extend(times)
    for f in faults:
        if f["kind"] == "partition":
            if "cut_at" not in f:
                continue
            lo, hi = f["cut_at"], f.get("healed_at", f["cut_at"] + f["hold"]) + HEAL_GRACE_SECS
            minority = minority_of(f, args.nodes)
            bound += sum(1 for i in minority for t in by_node.get(i, []) if lo <= t <= hi)
            bound += window * len(minority)
        elif f["kind"] == "move":
            bound += PREFETCH * args.nodes  # fq1's consumers
        else:
            bound += window * len(f["nodes"])
    return bound


def rabbit_restarts(c):
    """How RabbitMQ nodes came back, from their logs: a node whose database
    dir is empty at a start after the first lost its whole state (users,
    queue records, Ra logs), and one that starts "as a blank standalone
    node" after setup founded a new cluster of its own."""
    for i, n in c.nodes.items():
        text = ANSI.sub("", open(n.log, errors="replace").read())
        empty = len(re.findall(r"Node database directory at \S+ is empty", text)) - 1
        alone = len(re.findall(r"Starting as a blank standalone node", text)) - (1 if i == 1 else 0)
        if empty > 0:
            c.anomalies.append(f"n{i} came back with an empty database dir {empty} time(s): its state was not durable")
        if alone > 0:
            c.anomalies.append(f"n{i} founded a new cluster alone {alone} time(s) after setup")


def analyse(args, seed, root, faults, c, out, wedged, undrained, held, splits):
    attempted, confirmed, errors = {}, {}, 0
    for f in sorted(os.listdir(out)):
        if not f.startswith("pub-"):
            continue
        for rec in read_lines(os.path.join(out, f)):
            if rec[0] == "A":
                attempted[rec[2]] = f[4:-4]
            elif rec[0] == "C":
                confirmed[rec[2]] = float(rec[1])
            elif rec[0] == "E":
                errors += 1
    delivered, where = Counter(), {}
    for f in sorted(os.listdir(out)):
        if f.startswith("cons-") or f == "leftover.log":
            q = f.rsplit("-", 1)[-1][:-4]
            for rec in read_lines(os.path.join(out, f)):
                if rec[0] in "DL" and len(rec) >= 3:
                    delivered[rec[2]] += 1
                    where.setdefault(rec[2], set()).add(rec[4] if rec[0] == "L" else q)
    # One seen on another queue than its id names is unexpected too.
    unexpected = [m for m in delivered if m not in attempted or where[m] != {queue_of(m)}]
    lost = sorted((m for m in confirmed if m not in delivered), key=lambda m: confirmed[m])
    dups = sum(n - 1 for n in delivered.values())
    stuck = sum(1 for l in read_lines(os.path.join(out, "watchdog.log")) if l and l[0] == "W")
    panics = [i for i, n in c.nodes.items() if "panicked" in open(n.log, errors="replace").read()]
    # Data dirs a node found damaged at its start and set aside to be
    # refilled by its peers: not a failure, but worth seeing.
    set_aside = sum(open(n.log, errors="replace").read().count("the data dir is damaged") for n in c.nodes.values())
    if set_aside and not any(f["kind"] == "corrupt" for f in faults):
        # Only a corrupted disk may be found damaged: after a mere power
        # cut, a torn tail taken for damage would send every node waiting
        # for a refill once the whole cluster's power went.
        c.fatal.append(f"{set_aside} data dir(s) set aside as damaged in a run that corrupted none")
    # The storm limit is mirrorq's log throttle; RabbitMQ has none to check.
    storms = {} if c.rabbit else {i: log_storms(n.log) for i, n in c.nodes.items()}
    storms = {i: st for i, st in storms.items() if st}
    for i, st in storms.items():
        (minute, shape), n = max(st.items(), key=lambda kv: kv[1])
        c.anomalies.append(f"n{i} log storm: {len(st)} line(s) over {STORM_LINES_PER_MINUTE}/min, "
                           f"worst {n} in {minute}: {shape}")
    if c.rabbit:
        rabbit_restarts(c)
    if not c.rabbit:
        c.fatal.extend(early_reforms(c, faults, args.failure_timeout or FAILURE_TIMEOUT_SECS))
    bound = duplicate_bound(args, faults, out)
    if bound is not None and dups > bound:
        c.anomalies.append(f"{dups} duplicates, more than the {bound} the faults allow")
    ok = (not lost and not unexpected and not wedged and not undrained and not held and not storms and not splits
          and not c.fatal and (bound is None or dups <= bound))
    if not confirmed:
        # Nothing confirmed means the workload never ran, not that all is well.
        c.anomalies.append(f"no publish was confirmed: see {os.path.join(root, 'clients.log')}")
        ok = False
    print(f"seed={seed}{' broker=rabbitmq' if c.rabbit else ''} nodes={args.nodes} faults=[{', '.join(describe(f) for f in faults)}] "
          f"attempted={len(attempted)} confirmed={len(confirmed)} delivered_unique={len(delivered)} "
          f"lost={len(lost)} unexpected={len(unexpected)} duplicates={dups} "
          f"duplicate_bound={'-' if bound is None else bound} wedged={len(wedged)} "
          f"undrained={sum(undrained.values())} held={sum((r or 0) + (u or 0) for r, u in (v or (0, 0) for v in held.values()))} client_errors={errors} stuck_publishes={stuck} "
          f"node_panics={len(panics)} log_storms={len(storms)} splits={len(splits)} set_aside={set_aside} result={'PASS' if ok else 'FAIL'}", flush=True)
    for a in c.fatal + c.anomalies + [f"n{i} log contains 'panicked'" for i in panics]:
        print(f"  anomaly: {a}")
    for a in c.notes:
        print(f"  note: {a}")
    if wedged:
        print(f"  wedged queues: {wedged}")
    for q, e in splits.items():
        print(f"  split: {q} replicas in epochs {e}")
    if undrained:
        print(f"  undrained (in the queue, never delivered to a consumer): {undrained}")
    for m in lost[:20]:
        print(f"  lost: {m} (queue {queue_of(m)}, publisher {attempted[m]}, confirmed at t={confirmed[m]:.1f})")
    for m in unexpected[:20]:
        print(f"  unexpected: {m} on {sorted(where[m])}")
    if not ok or args.keep:
        print(f"  workdir kept: {root}", flush=True)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return ok


# ---------------------------------------------------------------- main


def ensure_rabbitmq():
    """Debian's rabbitmq-server, installed if missing, its own service
    neither started by the install nor left running: its node would hold
    epmd and the ports of the root namespace and read /var/lib/rabbitmq."""
    if not os.path.exists(os.path.join(RMQ_BIN, "rabbitmq-server")):
        guard = "/usr/sbin/policy-rc.d"
        mine = not os.path.exists(guard)
        if mine:
            # invoke-rc.d asks this before starting a service; 101: never.
            with open(guard, "w") as f:
                f.write("#!/bin/sh\nexit 101\n")
            os.chmod(guard, 0o755)
        try:
            print("campaign: installing rabbitmq-server", flush=True)
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "rabbitmq-server"]
            if subprocess.run(cmd, capture_output=True, env=env, timeout=900).returncode != 0:
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
                if r.returncode != 0:
                    sys.exit(f"campaign: apt-get install rabbitmq-server failed: {r.stderr.strip()[-500:]}")
        finally:
            if mine:
                os.unlink(guard)
    # Started anyway (a systemd machine, or an earlier install): stop it.
    if subprocess.run(["pgrep", "-u", "rabbitmq", "-x", "beam.smp"], capture_output=True).returncode == 0:
        for cmd in (["systemctl", "disable", "--now", "rabbitmq-server"], ["service", "rabbitmq-server", "stop"]):
            subprocess.run(cmd, capture_output=True, timeout=120)
        if subprocess.run(["pgrep", "-u", "rabbitmq", "-x", "beam.smp"], capture_output=True).returncode == 0:
            sys.exit("campaign: Debian's rabbitmq-server service is running and would not stop")
    print(f"campaign: RabbitMQ {rabbitmq_version()}", flush=True)


def rabbitmq_version():
    try:
        return sh("dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server").strip()
    except (RuntimeError, OSError):
        return "unknown"


def on_signal(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main():
    global FAILURE_TIMEOUT_SECS
    if len(sys.argv) > 1 and sys.argv[1] == "_http":
        return http_main(*sys.argv[2:6])
    if len(sys.argv) > 1 and sys.argv[1] == "_clients":
        return clients_main(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--broker", choices=["mirrorq", "rabbitmq"], default="mirrorq",
                    help="rabbitmq: Debian's rabbitmq-server (3.10) with quorum queues, installed if missing")
    ap.add_argument("--bin", help="the mirrorq binary (mirrorq only)")
    ap.add_argument("--nodes", type=int, default=3, choices=[3, 5])
    ap.add_argument("--seed", type=int)
    ap.add_argument("--seeds", help="comma-separated; one run each")
    ap.add_argument("--duration", type=float, default=60, help="seconds of faults per run (planned)")
    ap.add_argument("--workdir", help="default: a new directory under /tmp")
    ap.add_argument("--keep", action="store_true", help="keep every run's workdir, not only failing ones")
    ap.add_argument("--rate", type=float, default=50, help="messages/s per publisher (0: unthrottled)")
    ap.add_argument("--consume-rate", type=float, default=0,
                    help="messages/s per consumer until the publishers stop (0: as fast as they come)")
    ap.add_argument("--cancel-resume", action="store_true",
                    help="consumers cancel themselves every 1-4 s and consume again on the same channel")
    ap.add_argument("--drain-timeout", type=float, default=120, help="bound on draining, seconds")
    ap.add_argument("--drain-idle", type=float, default=30,
                    help="stop draining when no delivery came for this long, even if queues count messages")
    ap.add_argument("--no-classic", dest="classic", action="store_false",
                    help="never kill all nodes but one (the classic demo)")
    ap.add_argument("--faults", type=lambda s: s.split(","), default=None,
                    help=f"only these fault kinds, comma-separated, of {','.join(FAULT_KINDS)}")
    ap.add_argument("--promote-on-failure", choices=["always", "when-synced"], default=None,
                    help="the policy's ha-promote-on-failure (mirrorq; default: the policy's default, always): "
                         "when-synced keeps a minority from re-forming a queue, as a quorum queue's does")
    ap.add_argument("--failure-timeout", type=float, default=None,
                    help="the nodes' --failure-timeout, seconds (mirrorq; default: theirs, "
                         f"{FAILURE_TIMEOUT_SECS}): a minority re-forms only after it")
    ap.add_argument("--faultfs", help="the faultfs binary: every data dir on it, and disk faults in the schedule")
    ap.add_argument("--faultfs-mode", choices=["strict", "ordered"], default="strict",
                    help="strict: a new or renamed name is durable only once its directory is synced; "
                         "ordered: any sync makes every name durable, as ext4's journal does")
    args = ap.parse_args()
    if args.failure_timeout is not None:
        if args.failure_timeout <= 0:
            ap.error("--failure-timeout must be positive")
        # The schedule holds the faults that must outlast it longer.
        FAILURE_TIMEOUT_SECS = args.failure_timeout
    # The clients run in a child; without pika they would die in their
    # threads and the run would check nothing.
    import importlib.util
    if importlib.util.find_spec("pika") is None:
        ap.error("this python has no pika: run with target/test-venv/bin/python3 (./test.sh makes it) "
                 "or pip install pika")
    if args.broker == "mirrorq" and not args.bin:
        ap.error("--bin is required for mirrorq")
    if args.broker == "mirrorq":
        args.bin = os.path.abspath(args.bin)
    args.strict_dirs = args.faultfs_mode == "strict"
    if args.faultfs:
        args.faultfs = os.path.abspath(args.faultfs)
    elif args.faults and set(args.faults) & set(DISK_FAULTS):
        ap.error("--faults: disk faults need --faultfs")
    if args.faults and not set(args.faults) <= set(FAULT_KINDS):
        ap.error(f"--faults: unknown kind in {args.faults}; known: {','.join(FAULT_KINDS)}")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed if args.seed is not None else
                                                                         random.SystemRandom().randrange(10**6)]
    if os.geteuid() != 0:
        sys.exit("campaign.py needs root (network namespaces)")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    remove_stale_netns()
    root = args.workdir or tempfile.mkdtemp(prefix="mqf-")
    os.makedirs(root, exist_ok=True)
    if args.broker == "rabbitmq":
        ensure_rabbitmq()
        args.bin = None
    else:
        # A private copy: a `cargo build` replacing the binary mid-campaign
        # would otherwise make nodes fail to start, which looks like a crash.
        try:
            os.link(args.bin, os.path.join(root, "mirrorq"))  # the old inode lives on
        except OSError:
            shutil.copy2(args.bin, os.path.join(root, "mirrorq"))
        args.bin = os.path.join(root, "mirrorq")
    failed = []
    try:
        for seed in seeds:
            try:
                ok = run_one(args, seed, os.path.join(root, f"seed{seed}"))
            except RuntimeError as e:
                print(f"seed={seed}{' broker=rabbitmq' if args.broker == 'rabbitmq' else ''} nodes={args.nodes} "
                      f"result=ERROR {e}", flush=True)
                print(f"  workdir kept: {os.path.join(root, f'seed{seed}')}", flush=True)
                ok = False
            if not ok:
                failed.append(seed)
    except KeyboardInterrupt as e:
        print(f"campaign: interrupted ({e or 'Ctrl-C'}); cleaned up; workdir {root}", flush=True)
        sys.exit(130)
    finally:
        cleanup_all()
        if args.bin:
            os.unlink(args.bin)
    if not args.workdir and not args.keep and not failed:
        shutil.rmtree(root, ignore_errors=True)
    print(f"campaign: runs={len(seeds)} passed={len(seeds) - len(failed)} failed={len(failed)}"
          + (f" failing_seeds={','.join(map(str, failed))} workdir={root}" if failed else ""), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
