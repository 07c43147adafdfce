"""RabbitMQ's queue and exchange features through stock pika against a
three-node mirrorq cluster, each kept across the SIGKILL of the node that
masters the queues: priority queues, exchange-to-exchange bindings,
alternate exchanges, single active consumer, consumer priorities,
x-expires, x-queue-mode / x-queue-version, connection.update-secret,
at-least-once dead-lettering.

Environment: AMQP_PORTS, HTTP_PORTS and PIDS, one per node, comma
separated. Exits non-zero on the first mismatch; prints "features ok".
"""
import base64
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

import pika

AMQP = [int(p) for p in os.environ["AMQP_PORTS"].split(",")]
HTTP = [int(p) for p in os.environ["HTTP_PORTS"].split(",")]
PIDS = [int(p) for p in os.environ["PIDS"].split(",")]
AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()


def log(*a):
    print(*a, flush=True)


def api(node, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{HTTP[node]}{path}", data=data, method=method)
    req.add_header("Authorization", AUTH)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, json.loads(text) if text else None


def until(what, check, limit=30.0, detail=lambda: ""):
    end = time.time() + limit
    while True:
        got = check()
        if got:
            return got
        if time.time() > end:
            sys.exit(f"timed out waiting for {what} {detail()}")
        time.sleep(0.2)


def connect(node):
    params = pika.ConnectionParameters(
        host="127.0.0.1", port=AMQP[node], credentials=pika.PlainCredentials("guest", "guest"), heartbeat=10
    )
    return pika.BlockingConnection(params)


def pump(conns, seconds):
    """Let each connection's consumers run for a while."""
    end = time.time() + seconds
    while time.time() < end:
        for c in conns:
            c.process_data_events(time_limit=0.05)


def publish(ch, exchange, key, bodies, priority=None):
    for b in bodies:
        ch.basic_publish(
            exchange=exchange, routing_key=key, body=b.encode(),
            properties=pika.BasicProperties(delivery_mode=2, priority=priority), mandatory=False,
        )


# A policy mirroring every queue of the test on all three nodes.
until("the policy", lambda: api(0, "PUT", "/api/policies/%2F/ha-features", {
    "pattern": r"^f\.", "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"}, "apply-to": "queues",
})[0] in (201, 204))

# Every queue mastered on node 0 (client-local), the node killed later.
c0 = connect(0)
ch0 = c0.channel()
ch0.confirm_delivery()
local = {"x-queue-master-locator": "client-local"}
ch0.queue_declare("f.prio", durable=True, arguments={**local, "x-max-priority": 10})
ch0.queue_declare("f.sac", durable=True, arguments={**local, "x-single-active-consumer": True})
ch0.queue_declare("f.cprio", durable=True, arguments=local)
ch0.queue_declare("f.logs", durable=True, arguments=local)
ch0.queue_declare("f.unrouted", durable=True, arguments=local)
ch0.queue_declare("f.lazy", durable=True, arguments={**local, "x-queue-mode": "lazy", "x-queue-version": 2})
ch0.exchange_declare("f.ae", exchange_type="fanout", durable=True)
# At-least-once dead-lettering to an exchange that routes nowhere yet;
# placed by RabbitMQ 4's name for the master locator.
ch0.exchange_declare("f.dlx", exchange_type="direct", durable=True)
ch0.queue_declare("f.dlq-src", durable=True, arguments={
    "x-queue-leader-locator": "client-local", "x-dead-letter-exchange": "f.dlx", "x-dead-letter-strategy": "at-least-once",
    "x-overflow": "reject-publish", "x-max-length": 100})
ch0.exchange_declare("f.front", exchange_type="direct", durable=True, arguments={"alternate-exchange": "f.ae"})
ch0.exchange_declare("f.topic", exchange_type="topic", durable=True)
ch0.exchange_bind(destination="f.topic", source="f.front", routing_key="log")
ch0.queue_bind("f.logs", "f.topic", routing_key="#")
ch0.queue_bind("f.unrouted", "f.ae")
for q in ("f.prio", "f.sac", "f.cprio", "f.logs", "f.unrouted", "f.lazy", "f.dlq-src"):
    until(f"{q} mirrored", lambda: (lambda s, b: s == 200 and b["node"] == "mirrorq@1"
                                    and len(b.get("synchronised_slave_nodes", [])) == 2)(*api(1, "GET", f"/api/queues/%2F/{q}")))

# The queue's arguments read back; a re-declare with another maximum priority is refused.
status, lazy = api(1, "GET", "/api/queues/%2F/f.lazy")
assert lazy["arguments"].get("x-queue-mode") == "lazy", lazy["arguments"]
assert lazy["arguments"].get("x-queue-version") == 2, lazy["arguments"]
try:
    ch0.queue_declare("f.prio", durable=True, arguments={**local, "x-max-priority": 5})
    sys.exit("a re-declare with another x-max-priority was accepted")
except pika.exceptions.ChannelClosedByBroker as e:
    assert e.reply_code == 406, e
ch0 = c0.channel()
ch0.confirm_delivery()

# Priorities, confirmed on all three replicas.
for body, prio in [("p0", None), ("p5", 5), ("p9a", 9), ("p1", 1), ("p9b", 12), ("p3", 3), ("p0b", 0)]:
    publish(ch0, "", "f.prio", [body], priority=prio)
# Through an exchange-to-exchange binding, and to the alternate exchange.
publish(ch0, "f.front", "log", ["to-logs"])
publish(ch0, "f.front", "nothing-bound", ["stray"])

# Single active consumer: the first registered gets everything.
c1, c2 = connect(1), connect(2)
seen = {"a": [], "b": []}
ch_a, ch_b = c1.channel(), c2.channel()
tag_a = ch_a.basic_consume("f.sac", lambda ch, m, p, b: (seen["a"].append(b), ch.basic_ack(m.delivery_tag)))
pump([c1, c2], 0.5)
tag_b = ch_b.basic_consume("f.sac", lambda ch, m, p, b: (seen["b"].append(b), ch.basic_ack(m.delivery_tag)))
pump([c1, c2], 0.5)
publish(ch0, "", "f.sac", [f"s{i}" for i in range(10)])
until("the active consumer's deliveries", lambda: (pump([c1, c2], 0.2), len(seen["a"]) == 10)[1])
pump([c1, c2], 1.0)
assert seen["b"] == [], f"the waiting consumer got {seen['b']}"
status, consumers = api(1, "GET", "/api/consumers")
assert sum(1 for k in consumers if k["queue"]["name"] == "f.sac") == 2, consumers
# As RabbitMQ's API shows them: the active one and the waiting one.
sac = {k["consumer_tag"]: k for k in consumers if k["queue"]["name"] == "f.sac"}
assert (sac[tag_a]["active"], sac[tag_a]["activity_status"]) == (True, "single_active"), sac
assert (sac[tag_b]["active"], sac[tag_b]["activity_status"]) == (False, "waiting"), sac
assert all(k["activity_status"] == "up" for k in consumers if k["queue"]["name"] != "f.sac"), consumers

# Rejected while the dead-letter exchange routes nowhere: held in the
# queue, not served again, not dropped.
publish(ch0, "", "f.dlq-src", ["d0", "d1", "d2"])
for _ in range(3):
    method, _, body = ch0.basic_get("f.dlq-src", auto_ack=False)
    assert method is not None, "f.dlq-src lacks a message"
    ch0.basic_reject(method.delivery_tag, requeue=False)
# After the rejects in the log: nothing of them is ready again.
assert ch0.basic_get("f.dlq-src", auto_ack=False)[0] is None, "a rejected message was served again"

# The node that masters every queue goes, with no warning.
c0.close()
os.kill(PIDS[0], signal.SIGKILL)
log("node 1 killed")

# The priority queue, from a mirror promoted: highest first, capped at 10.
ch1 = c1.channel()
order = []
def take():
    global ch1
    try:
        method, _, body = ch1.basic_get("f.prio", auto_ack=False)
    except pika.exceptions.ChannelClosedByBroker as e:
        # A get in flight to the killed master is refused (506) rather than
        # sent again: it may have been served. A client opens a channel again.
        assert e.reply_code == 506, e
        ch1 = c1.channel()
        return False
    if method is not None:
        order.append(body.decode())
        ch1.basic_ack(method.delivery_tag)
    return len(order) == 7
until("the priority queue served by its new master", take, limit=60)
# A get cut off by the kill may leave its message with the closed channel
# until that channel's release: equal priorities may come in either order.
rank = {"p9a": 10, "p9b": 10, "p5": 5, "p3": 3, "p1": 1, "p0": 0, "p0b": 0}
assert sorted(order) == sorted(rank), order
assert [rank[b] for b in order] == [10, 10, 5, 3, 1, 0, 0], order

# Exchange-to-exchange binding and alternate exchange, before and after.
ch1.confirm_delivery()
publish(ch1, "f.front", "log", ["to-logs-2"])
publish(ch1, "f.front", "other", ["stray-2"])
for q, want in (("f.logs", ["to-logs", "to-logs-2"]), ("f.unrouted", ["stray", "stray-2"])):
    got = []
    for _ in range(2):
        method, _, body = ch1.basic_get(q, auto_ack=True)
        assert method is not None, f"{q} lacks a message: got {got}"
        got.append(body.decode())
    assert got == want, (q, got)

# The new master dead-letters what the old one held, once the exchange
# routes somewhere; the source queue lets go of them only then.
ch1.queue_declare("f.dlq-target", durable=True)
ch1.queue_bind("f.dlq-target", "f.dlx", routing_key="f.dlq-src")
dead = []
def dead_lettered():
    method, props, body = ch1.basic_get("f.dlq-target", auto_ack=True)
    if method is not None:
        dead.append((body.decode(), props.headers["x-death"][0]["reason"]))
    return len(dead) == 3
until("the held dead letters in their target", dead_lettered, limit=60, detail=lambda: str(dead))
assert sorted(dead) == [("d0", "rejected"), ("d1", "rejected"), ("d2", "rejected")], dead
until("the source queue empty", lambda: ch1.queue_declare("f.dlq-src", passive=True).method.message_count == 0)
assert ch1.basic_get("f.dlq-src", auto_ack=True)[0] is None, "a dead letter was left in its source queue"

# Two targets, one of which refuses (full): the dead letter stays held
# (it fills its source queue, whose x-max-length counts it), the target
# that took it is not sent it again at every retry, and once the refusing
# one is unbound the source lets go of it.
ch1.exchange_declare("f.dlx2", exchange_type="fanout", durable=True)
ch1.queue_declare("f.dlq2-src", durable=True, arguments={
    "x-dead-letter-exchange": "f.dlx2", "x-dead-letter-strategy": "at-least-once",
    "x-overflow": "reject-publish", "x-max-length": 1})
ch1.queue_declare("f.dlq2-a", durable=True)
ch1.queue_declare("f.dlq2-full", durable=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
ch1.queue_bind("f.dlq2-a", "f.dlx2")
ch1.queue_bind("f.dlq2-full", "f.dlx2")
publish(ch1, "", "f.dlq2-src", ["e0"])
method, _, _ = ch1.basic_get("f.dlq2-src", auto_ack=False)
ch1.basic_reject(method.delivery_tag, requeue=False)
count = lambda q: ch1.queue_declare(q, passive=True).method.message_count
until("the dead letter in the target that takes it", lambda: count("f.dlq2-a") == 1)
def refused(body):
    try:
        publish(ch1, "", "f.dlq2-src", [body])
        return False
    except pika.exceptions.NackError:
        return True
assert refused("e1"), "the source took a publish while a held dead letter filled it"
time.sleep(3)  # retries at 0.2, 0.4, 0.8 and 1.6 s
assert count("f.dlq2-a") == 1, f"the target that took it was sent it again: {count('f.dlq2-a')}"
ch1.queue_unbind("f.dlq2-full", "f.dlx2")
until("the source letting go of its dead letter", lambda: not refused("e2"), limit=30)
assert count("f.dlq2-a") == 1, count("f.dlq2-a")

# The new master goes on with the same active consumer.
publish(ch1, "", "f.sac", [f"t{i}" for i in range(10)])
until("the active consumer served after the failover", lambda: (pump([c1, c2], 0.2), len(seen["a"]) == 20)[1], 60)
pump([c1, c2], 1.0)
assert seen["b"] == [], f"the waiting consumer got {seen['b']} after the failover"
ch_a.basic_cancel(tag_a)
publish(ch1, "", "f.sac", [f"u{i}" for i in range(5)])
until("the next consumer active", lambda: (pump([c1, c2], 0.2), len(seen["b"]) == 5)[1])
assert len(seen["a"]) == 20, len(seen["a"])

# Consumer priorities: the higher one gets everything while it has room,
# the lower one what the higher cannot take (its prefetch full, no acks).
got = {"high": [], "low": []}
ch_h, ch_l = c1.channel(), c2.channel()
ch_h.basic_qos(prefetch_count=50)
ch_l.basic_qos(prefetch_count=50)
held = []
ch_h.basic_consume("f.cprio", lambda ch, m, p, b: (got["high"].append(b), held.append(m.delivery_tag)),
                   arguments={"x-priority": 10})
# The lower one gives no x-priority: priority 0, as in RabbitMQ.
ch_l.basic_consume("f.cprio", lambda ch, m, p, b: (got["low"].append(b), ch.basic_ack(m.delivery_tag)))
pump([c1, c2], 1.0)
publish(ch1, "", "f.cprio", [f"c{i}" for i in range(30)])
counts = lambda: f"(high {len(got['high'])}, low {len(got['low'])})"
until("the high-priority consumer served", lambda: (pump([c1, c2], 0.2), len(got["high"]) == 30)[1], detail=counts)
pump([c1, c2], 0.5)
assert got["low"] == [], f"the low-priority consumer got {len(got['low'])} while the high one had room"
publish(ch1, "", "f.cprio", [f"d{i}" for i in range(40)])
until("the low-priority consumer served once the high one is full",
      lambda: (pump([c1, c2], 0.2), len(got["high"]) + len(got["low"]) == 70)[1], detail=counts)
assert len(got["high"]) == 50, len(got["high"])
assert len(got["low"]) == 20, len(got["low"])

# The default exchange is no binding's destination; an alternate exchange
# needs write permission on it.
try:
    c1.channel().exchange_bind(destination="", source="f.front", routing_key="x")
    sys.exit("a binding to the default exchange was accepted")
except pika.exceptions.ChannelClosedByBroker as e:
    assert e.reply_code == 403, e
assert api(1, "PUT", "/api/users/limited", {"password": "limited-pw", "tags": ""})[0] in (201, 204)
assert api(1, "PUT", "/api/permissions/%2F/limited",
           {"configure": ".*", "write": "^f\\.mine", "read": ".*"})[0] in (201, 204)
lim = pika.BlockingConnection(pika.ConnectionParameters(
    host="127.0.0.1", port=AMQP[1], credentials=pika.PlainCredentials("limited", "limited-pw")))
try:
    lim.channel().exchange_declare("f.mine", exchange_type="direct", arguments={"alternate-exchange": "f.ae"})
    sys.exit("an alternate exchange the user may not write to was accepted")
except pika.exceptions.ChannelClosedByBroker as e:
    assert e.reply_code == 403, e
lim.channel().exchange_declare("f.mine", exchange_type="direct", arguments={"alternate-exchange": "f.mine-ae"})
lim.close()

# x-expires: an unused queue goes; one with a consumer stays.
ch1.queue_declare("f.exp", durable=True, arguments={"x-expires": 1500})
ch1.queue_declare("f.exp-kept", durable=True, arguments={"x-expires": 1500})
ch_k = c2.channel()
ch_k.basic_consume("f.exp-kept", lambda ch, m, p, b: None)
until("the unused queue expired", lambda: (pump([c1, c2], 0.1), api(1, "GET", "/api/queues/%2F/f.exp")[0] == 404)[1])
pump([c1, c2], 2.0)
assert api(2, "GET", "/api/queues/%2F/f.exp-kept")[0] == 200, "a queue with a consumer expired"
# A declare, passive or not, renews the lease (RabbitMQ: redeclaring
# resets the expiry timer), through whichever node the client is on.
ch1.queue_declare("f.exp-declared", durable=True, arguments={"x-expires": 1500})
ch_r = c2.channel()
for _ in range(8):
    ch_r.queue_declare("f.exp-declared", passive=True)
    pump([c1, c2], 0.4)
assert api(1, "GET", "/api/queues/%2F/f.exp-declared")[0] == 200, "a queue declared every 0.4 s expired"

# connection.update-secret, as RabbitMQ answers it for its internal users
# (whose credentials do not expire): update-secret-ok, the connection open.
c1.update_secret("guest", "rotated")
c2.update_secret("a token the broker does not check", "rotated")
pump([c1, c2], 1.0)
assert c1.is_open and c2.is_open
c1.close()
log("features ok")
