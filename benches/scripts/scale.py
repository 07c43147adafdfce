#!/usr/bin/env python3
"""Measurements for benches/scripts/scale.sh (many idle replicated queues).

Every subcommand appends its figures, one JSON object a line
{"system", "key", "value"}, to the file named by $SCALE_RESULTS, and says
what it measured on stderr. Talks to the management HTTP API (mirrorq's or
RabbitMQ's, guest/guest, loopback only) and reads /proc.

  declare SYSTEM N PARALLEL PORT...      declare N durable queues (from
                                         number $SCALE_FIRST, default 0)
  declare-amqp SYSTEM N PARALLEL PORT... the same with AMQP queue.declare
                                         (pika, one connection per client;
                                         PORTs are AMQP ports)
  sync SYSTEM PORT N REPLICAS TIMEOUT    wait until all are synchronised
  rss SYSTEM KEY PID...                  VmRSS of each node (KiB)
  idle SYSTEM SECONDS PID...             CPU of each node over SECONDS
  served SYSTEM PORT N REPLICAS TIMEOUT SINCE
                                         a restarted node: time until it
                                         serves every queue, then until
                                         every queue is synchronised again
  report RESULTS N PARALLEL IDLE         the markdown table
"""
import base64
import datetime
import http.client
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.parse

PREFIX = "scale-"
AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()
SYSTEMS = ["mirrorq", "rabbitmq-quorum"]
LABELS = {"mirrorq": "mirrorq (ha-mode all)", "rabbitmq-quorum": "RabbitMQ 3.10 quorum"}
# Idle queues published to after the idle window (`wake`).
WAKE_COUNT = 50
# Queues published to through the rolling restart (`probe`).
PROBE_COUNT = 50
# How scale.sh runs benches/scripts/amqplib_declare.js.
AMQP_CLIENTS = "8 connections over 3 nodes, 4 channels each"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def record(system, key, value):
    with open(os.environ["SCALE_RESULTS"], "a") as f:
        f.write(json.dumps({"system": system, "key": key, "value": value}) + "\n")


def qname(i):
    return f"{PREFIX}{i:05d}"


class Api:
    """One keep-alive HTTP connection to one node's management API."""

    def __init__(self, port, timeout=60):
        self.port, self.timeout, self.conn = port, timeout, None

    def call(self, method, path, body=None):
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        headers = {"authorization": AUTH}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        try:
            self.conn.request(method, path, body=data, headers=headers)
            r = self.conn.getresponse()
            payload = r.read()
        except Exception:
            self.close()
            raise
        if r.getheader("connection", "").lower() == "close":
            self.close()
        return r.status, payload

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# ---- declare ---------------------------------------------------------------

def numbered(n):
    """A queue of the numbers of N queues to declare, from $SCALE_FIRST."""
    todo = queue.Queue()
    first = int(os.environ.get("SCALE_FIRST", "0"))
    for i in range(first, first + n):
        todo.put(i)
    return todo


def run_clients(client, parallel):
    """Run `client(c)` in PARALLEL threads; the seconds they took together."""
    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - start


def declare(system, n, parallel, ports):
    """PARALLEL clients, client c on node c mod 3, each taking the next queue
    name; a refused declare (503 under load, a reset) is retried up to 5 times."""
    n, parallel = int(n), int(parallel)
    ports = [int(p) for p in ports]
    todo = numbered(n)
    body = {"durable": True, "auto_delete": False, "arguments": {}}
    if system == "rabbitmq-quorum":
        body["arguments"] = {"x-queue-type": "quorum"}
    errors, retries = [], [0]
    lock = threading.Lock()

    def client(c):
        api = Api(ports[c % len(ports)])
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            path = "/api/queues/%2F/" + urllib.parse.quote(qname(i), safe="")
            for attempt in range(6):
                try:
                    status, payload = api.call("PUT", path, body)
                except Exception as e:  # noqa: BLE001
                    status, payload = None, str(e).encode()
                if status in (200, 201, 204):
                    break
                with lock:
                    retries[0] += 1
                time.sleep(0.2 * (attempt + 1))
            else:
                with lock:
                    errors.append(f"{qname(i)}: {status} {payload[:200]!r}")
        api.close()

    secs = run_clients(client, parallel)
    record(system, "declare_seconds", secs)
    record(system, "declares_per_s", (n - len(errors)) / secs)
    record(system, "declare_retries", retries[0])
    record(system, "declare_errors", len(errors))
    for e in errors[:5]:
        log(f"  declare failed: {e}")
    log(f"{system}: {n - len(errors)} of {n} queues declared in {secs:.1f} s "
        f"({(n - len(errors)) / secs:.1f}/s, {parallel} clients, {retries[0]} retries)")


def declare_amqp(system, n, parallel, ports):
    """As `declare`, through AMQP: PARALLEL pika clients, client c on node
    c mod 3, each on one connection and channel, declaring the next queue
    (durable) and waiting for its declare-ok."""
    import pika  # only this subcommand needs it

    n, parallel = int(n), int(parallel)
    ports = [int(p) for p in ports]
    todo = numbered(n)
    errors = []
    lock = threading.Lock()

    def client(c):
        params = pika.ConnectionParameters("127.0.0.1", ports[c % len(ports)],
                                           credentials=pika.PlainCredentials("guest", "guest"))
        conn = pika.BlockingConnection(params)
        ch = conn.channel()
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                break
            try:
                ch.queue_declare(qname(i), durable=True)
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(f"{qname(i)}: {e!r}")
                conn = pika.BlockingConnection(params)
                ch = conn.channel()
        conn.close()

    secs = run_clients(client, parallel)
    record(system, "amqp_declares_per_s", (n - len(errors)) / secs)
    record(system, "amqp_declare_errors", len(errors))
    for e in errors[:5]:
        log(f"  declare failed: {e}")
    log(f"{system}: {n - len(errors)} of {n} queues declared over AMQP in {secs:.1f} s "
        f"({(n - len(errors)) / secs:.1f}/s, {parallel} clients)")


# ---- what the API says about each queue ------------------------------------

def queue_states(system, q, replicas):
    """(served, synchronised) for one queue object of GET /api/queues.

    mirrorq: served = a master answered for it (`state` running or syncing;
    mirrorq says `down` when no master is reachable); synchronised = running
    with replicas-1 nodes in `synchronised_slave_nodes`.
    RabbitMQ quorum: served = a `leader` that is among the `online` members;
    synchronised = all replicas in `members` and `online` (the Ra member
    running; RabbitMQ shows no finer sync state for quorum queues). Both are
    read live when the listing is asked for; RabbitMQ's `state` is not used:
    it comes from the management statistics, which arrive every 5 s or so
    (absent for 5-10 s after a declare)."""
    if system == "mirrorq":
        served = q.get("state") in ("running", "syncing")
        synced = (q.get("state") == "running"
                  and len(q.get("synchronised_slave_nodes") or []) >= replicas - 1)
    else:
        served = bool(q.get("leader")) and q.get("leader") in (q.get("online") or [])
        synced = (served and len(q.get("members") or []) >= replicas
                  and len(q.get("online") or []) >= replicas)
    return served, synced


def list_queues(system, api):
    path = "/api/queues/%2F"
    if system == "rabbitmq-quorum":
        path += "?columns=name,state,leader,members,online,node"
    status, payload = api.call("GET", path)
    if status != 200:
        raise RuntimeError(f"GET {path}: {status} {payload[:200]!r}")
    return [q for q in json.loads(payload) if q.get("name", "").startswith(PREFIX)]


def tally(system, qs, n, replicas):
    served = synced = 0
    for q in qs:
        a, b = queue_states(system, q, replicas)
        served += a
        synced += b
    return served, synced


def sync(system, port, n, replicas, timeout):
    """From now (the last declare answered) until one listing shows all N
    queues synchronised."""
    n, replicas, timeout = int(n), int(replicas), float(timeout)
    api = Api(int(port), timeout=120)
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout:
        try:
            qs = list_queues(system, api)
            served, synced = tally(system, qs, n, replicas)
            last = (len(qs), served, synced)
            if len(qs) >= n and synced >= n:
                secs = time.monotonic() - start
                record(system, "sync_seconds", secs)
                log(f"{system}: all {n} queues synchronised {secs:.1f} s after the last declare")
                return
        except Exception as e:  # noqa: BLE001
            last = str(e)
        time.sleep(0.5)
    record(system, "sync_seconds", None)
    log(f"{system}: not all synchronised within {timeout:.0f} s (listed, served, synchronised: {last})")


# ---- /proc -----------------------------------------------------------------

def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def rss(system, key, *pids):
    values = [rss_kib(int(p)) for p in pids]
    record(system, key, values)
    log(f"{system}: {key} " + " / ".join(f"{v / 1024:.0f} MiB" for v in values))


def idle(system, seconds, *pids):
    pids = [int(p) for p in pids]
    hz = os.sysconf("SC_CLK_TCK")
    before = [cpu_ticks(p) for p in pids]
    t0 = time.monotonic()
    time.sleep(float(seconds))
    after = [cpu_ticks(p) for p in pids]
    elapsed = time.monotonic() - t0
    cores = [(a - b) / hz / elapsed for a, b in zip(after, before)]
    record(system, "idle_cpu", cores)
    log(f"{system}: idle CPU per node over {elapsed:.0f} s: " + " / ".join(f"{c:.3f}" for c in cores))


# ---- waking an idle queue ---------------------------------------------------

def wake(system, port, n, count):
    """After the idle window: one persistent message, with publisher
    confirms, to each of COUNT queues spread over the N (one connection to
    node 1, one at a time); each publish's time to its confirm. An idle
    queue's group must wake for it (mirrorq's quiet groups)."""
    n, count = int(n), int(count)
    try:
        import pika
    except ImportError:
        record(system, "wake_ms", None)
        log(f"{system}: pika is not installed (./test.sh installs it in target/test-venv): no wake figures")
        return
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=int(port), credentials=pika.PlainCredentials("guest", "guest")))
    ch = conn.channel()
    ch.confirm_delivery()
    props = pika.BasicProperties(delivery_mode=2)
    took = []
    for k in range(count):
        q = qname(k * n // count)
        t0 = time.perf_counter()
        ch.basic_publish("", q, b"wake", props, mandatory=True)
        took.append((time.perf_counter() - t0) * 1000)
    conn.close()
    record(system, "wake_ms", took)
    took.sort()
    log(f"{system}: publish to an idle queue, confirm ms: p50 {took[len(took) // 2]:.1f}, max {took[-1]:.1f}")


def json_line(line):
    """A client's one-line JSON result, or {} if it printed none."""
    try:
        r = json.loads(line)
    except ValueError:
        return {}
    return r if isinstance(r, dict) else {}


def amqp_declared(system, line):
    """Record the JSON line of benches/scripts/amqplib_declare.js."""
    r = json_line(line)
    record(system, "amqp_declares_per_s", r.get("per_s"))
    record(system, "amqp_declare_errors", r.get("errors"))
    for e in r.get("first_errors") or []:
        log(f"  declare failed: {e}")
    if r:
        log(f"{system}: {r['declared']} queues declared over AMQP in {r['seconds']:.1f} s ({r['per_s']}/s)")
    else:
        log(f"{system}: the AMQP declares gave no result: {line!r}")


# ---- restart ---------------------------------------------------------------

def served(system, port, n, replicas, timeout, since, key="restart"):
    """Poll the restarted node's GET /api/queues from SINCE (the epoch time
    its new process was started): first until it answers with every queue
    served, then until every queue is synchronised on all replicas again.
    Recorded as KEY_served_seconds and KEY_synced_seconds."""
    n, replicas, timeout = int(n), int(replicas), float(timeout)
    start = time.monotonic() - (time.time() - float(since))
    api = Api(int(port), timeout=120)
    got_served = None
    last = None
    while time.monotonic() - start < timeout:
        try:
            qs = list_queues(system, api)
            s, y = tally(system, qs, n, replicas)
            last = (len(qs), s, y)
            now = time.monotonic() - start
            if got_served is None and len(qs) >= n and s >= n:
                got_served = now
                record(system, f"{key}_served_seconds", now)
                log(f"{system}: restarted node serves all {n} queues {now:.1f} s after its start")
            if got_served is not None and y >= n:
                record(system, f"{key}_synced_seconds", now)
                log(f"{system}: all {n} queues synchronised again {now:.1f} s after the restart")
                return
        except Exception as e:  # noqa: BLE001
            api.close()
            last = str(e)
        time.sleep(0.2)
    if got_served is None:
        record(system, f"{key}_served_seconds", None)
    record(system, f"{key}_synced_seconds", None)
    log(f"{system}: restart not complete within {timeout:.0f} s (listed, served, synchronised: {last})")


def probe_queues(n, count):
    """The COUNT queues spread over the N that the rolling restart's probe
    publishes to, comma-separated."""
    n, count = int(n), int(count)
    print(",".join(qname(k * n // count) for k in range(count)))


def probed(system, line):
    """Record the JSON line of benches/scripts/amqplib_probe.js."""
    r = json_line(line)
    record(system, "rolling_gap_ms", r.get("gap_ms"))
    record(system, "rolling_confirmed", r.get("confirmed"))
    record(system, "rolling_failed", r.get("failed"))
    if r:
        log(f"{system}: rolling restart: {r['confirmed']} probe publishes confirmed, {r['failed']} failed; "
            f"longest a probed queue went without a confirm: {r['gap_ms']} ms ({r['worst']})")
    else:
        log(f"{system}: the rolling restart's probe gave no result: {line!r}")


# ---- report ----------------------------------------------------------------

def machine():
    model = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({model}), {mem:.0f} GiB, {os.uname().release}"


def report(path, n, parallel, idle_s, busy="100", amqp_n="0"):
    n, amqp_n = int(n), int(amqp_n)
    res = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                res.setdefault(r["system"], {})[r["key"]] = r["value"]
    systems = [s for s in SYSTEMS if s in res]

    def num(v, d=1):
        return "-" if v is None else f"{v:,.{d}f}"

    def per_node(v, d=3):
        return "-" if not v else " / ".join(f"{x:.{d}f}" for x in v)

    def cell(s, key):
        r = res[s]
        v = r.get(key)
        if key == "declares_per_s":
            extra = []
            if r.get("declare_retries"):
                extra.append(f"{r['declare_retries']} retried")
            if r.get("declare_errors"):
                extra.append(f"**{r['declare_errors']} failed**")
            return num(v) + (f" ({', '.join(extra)})" if extra else "") if v is not None else "-"
        if key == "sync_seconds":
            return "not within the timeout" if "sync_seconds" in r and v is None else num(v, 2)
        if key == "idle_cpu":
            return per_node(v)
        if key == "rss_after":
            return "-" if not v else " / ".join(f"{x / 1024:.0f}" for x in v)
        if key == "rss_growth":
            b, a = r.get("rss_before"), r.get("rss_after")
            if not a or not b:
                return "-"
            return " / ".join(f"{(y - x) / n:.0f}" for x, y in zip(b, a))
        if key == "wake_ms":
            if not v:
                return "-"
            w = sorted(v)
            return f"{w[len(w) // 2]:.1f} / {w[-1]:.1f}"
        if key == "busy_among_idle":
            alone = r.get(f"busy_{busy}")
            if v is None or not alone:
                return num(v, 0)
            return f"{v:,.0f} ({100 * v / alone:.0f}% of {busy} alone)"
        if key.startswith("busy_"):
            return num(v, 0)
        if key in ("restart_served_seconds", "restart_synced_seconds"):
            return "not within the timeout" if key in r and v is None else num(v, 2)
        if key == "rolling_served":
            got = [r.get(f"rolling{i}_served_seconds") for i in (1, 2, 3)]
            if all(f"rolling{i}_served_seconds" not in r for i in (1, 2, 3)):
                return "-"
            return " / ".join("not within the timeout" if x is None else f"{x:.2f}" for x in got)
        if key == "rolling_gap_ms":
            if v is None:
                return "-"
            return (f"{v:,.0f} ({r.get('rolling_confirmed', 0):,} publishes confirmed, "
                    f"{r.get('rolling_failed', 0):,} failed)")
        if key == "amqp_declares_per_s":
            if v is None:
                return "-"
            errors = r.get("amqp_declare_errors")
            return num(v) + (f" (**{errors} failed**)" if errors else "")
        return num(v, 2)

    rows = [
        ("declares per second (HTTP, %s clients over 3 nodes)" % parallel, "declares_per_s"),
        ("time to synchronised after the last declare (s)", "sync_seconds"),
        (f"idle CPU per node, of one core (over {idle_s} s)", "idle_cpu"),
        ("RSS per node, idle (MiB)", "rss_after"),
        ("RSS growth per replica (KiB, per node)", "rss_growth"),
        ("publish to an idle queue, confirmed (ms, p50 / max of %s)" % WAKE_COUNT, "wake_ms"),
        ("1 busy queue alone, confirmed msg/s", "busy_1"),
        ("10 busy queues alone, confirmed msg/s", "busy_10"),
        (f"{busy} busy queues alone, confirmed msg/s", f"busy_{busy}"),
        (f"{busy} busy queues among the {n:,} idle, confirmed msg/s", "busy_among_idle"),
        (f"declares per second (AMQP, amqplib, {AMQP_CLIENTS}), {amqp_n:,} more queues",
         "amqp_declares_per_s"),
        ("node 3 SIGTERM to exit (s)", "stop_seconds"),
        ("node 3 restarted: serves every queue (s from its start)", "restart_served_seconds"),
        ("node 3 restarted: every queue synchronised again (s)", "restart_synced_seconds"),
        ("rolling restart, nodes 1, 2, 3 in turn: each serves every queue (s from its start)", "rolling_served"),
        (f"rolling restart: longest a probed queue had no confirmed publish (ms, {PROBE_COUNT} queues)",
         "rolling_gap_ms"),
    ]
    rev = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                         capture_output=True, text=True).stdout.strip() or "?"
    versions = []
    for s in systems:
        if res[s].get("version"):
            versions.append(f"{LABELS[s]}: {res[s]['version']}")
    out = [
        f"Run {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')} at git revision `{rev}` "
        f"on {machine()}.",
        f"Command: `{os.environ.get('SCALE_COMMAND', 'benches/scripts/scale.sh')}`"
        + (f" ({'; '.join(versions)})." if versions else "."),
        "",
        f"| {n:,} queues x 3 replicas, 3 nodes on loopback | " + " | ".join(LABELS[s] for s in systems) + " |",
        "|---" * (len(systems) + 1) + "|",
    ]
    for label, key in rows:
        out.append(f"| {label} | " + " | ".join(cell(s, key) for s in systems) + " |")
    out += [
        "",
        "Per-node figures are node 1 / node 2 / node 3. RSS growth per replica = (VmRSS after the idle",
        "window - VmRSS before the first declare) / queues (every node holds one replica of each queue).",
        "Idle CPU = (utime + stime) delta from /proc/<pid>/stat over the idle window. \"Serves every queue\":",
        "the restarted node's GET /api/queues answers with every queue having a reachable master (mirrorq",
        "`state` running or syncing; RabbitMQ a `leader` among the `online` members). \"Synchronised\":",
        "every queue's mirrors all in `synchronised_slave_nodes` (mirrorq) or all 3 members `online`",
        "(RabbitMQ). Times to synchronised are from the last declare's answer; restart times from the",
        "restarted node's new process start, measured on that node's API. Busy: `mirrorq perf`, one",
        "producer (confirm window 100, 100 B persistent) and one consumer per queue, all through node 1;",
        "\"alone\" before the idle queues were declared, \"among\" after the idle window.",
    ]
    print("\n".join(out))


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "declare":
        declare(args[0], args[1], args[2], args[3:])
    elif cmd == "declare-amqp":
        declare_amqp(args[0], args[1], args[2], args[3:])
    elif cmd == "sync":
        sync(*args)
    elif cmd == "rss":
        rss(*args)
    elif cmd == "idle":
        idle(*args)
    elif cmd == "served":
        served(*args)
    elif cmd == "probe-queues":
        probe_queues(args[0], PROBE_COUNT)
    elif cmd == "probed":
        probed(*args)
    elif cmd == "amqp-declared":
        amqp_declared(*args)
    elif cmd == "wake":
        wake(args[0], args[1], args[2], WAKE_COUNT)
    elif cmd == "record":
        record(args[0], args[1], json.loads(args[2]))
    elif cmd == "report":
        report(*args)
    else:
        sys.exit(f"unknown subcommand {cmd}")


if __name__ == "__main__":
    main()
