"""The HTTP requests Terraform's RabbitMQ provider (cyrilgdn/rabbitmq, over
the Go client rabbit-hole v3.2.0) makes for each resource mirrorq's API
serves, replayed as it sends them: create, the read that follows every
create, update where the provider has one, and delete; checking the fields
the provider reads back. (The provider itself cannot run here: Terraform
cannot reach its registry, and there is no Go toolchain to build it.)

Environment: HTTP_PORT. Exits non-zero on the first mismatch; prints
"terraform requests ok".
"""
import base64
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request

BASE = f"http://127.0.0.1:{os.environ['HTTP_PORT']}/api/"
AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()
pe = lambda s: urllib.parse.quote(s, safe="")  # noqa: E731  Go's url.PathEscape for these names


def call(method, path, body=None, want=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(BASE + path, data=data, method=method)
    req.add_header("Authorization", AUTH)
    req.add_header("Content-Type", "application/json")
    req.add_header("Connection", "close")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, headers, text = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, headers, text = e.code, e.headers, e.read()
    value = json.loads(text) if text else None
    if want is not None and status not in want:
        sys.exit(f"{method} {path}: {status} {value} (wanted {want})")
    return status, headers, value


vh = "tf-vhost"
# rabbitmq_vhost: create, then the read (the vhost and its limits).
call("PUT", f"vhosts/{pe(vh)}", {"description": "made by terraform", "tags": "", "tracing": False}, (201, 204))
_, _, v = call("GET", f"vhosts/{pe(vh)}", want=(200,))
assert v["name"] == vh and v.get("description") == "made by terraform" and v.get("tracing") is False, v
_, _, limits = call("GET", f"vhost-limits/{pe(vh)}", want=(200,))
assert limits == [], limits
# Update: limits cleared every time, a limit that cannot be enforced refused.
call("DELETE", f"vhost-limits/{pe(vh)}/max-connections", want=(204, 404))
call("DELETE", f"vhost-limits/{pe(vh)}/max-queues", want=(204, 404))
status, _, reason = call("PUT", f"vhost-limits/{pe(vh)}/max-queues", {"value": 10})
assert status == 400 and "reason" in reason, (status, reason)
status, _, reason = call("PUT", f"vhosts/{pe(vh)}", {"description": "", "tags": "", "tracing": True})
assert status == 400 and "tracing" in reason["reason"], (status, reason)

# rabbitmq_user
call("PUT", "users/tf-user", {"name": "", "tags": "management,policymaker", "password": "s3cret-pw"}, (201, 204))
_, _, u = call("GET", "users/tf-user", want=(200,))
tags = u["tags"] if isinstance(u["tags"], list) else u["tags"].split(",")
assert sorted(tags) == ["management", "policymaker"], u

# rabbitmq_permissions
perms = {"configure": ".*", "write": "^tf", "read": ".*"}
call("PUT", f"permissions/{pe(vh)}/tf-user", perms, (201, 204))
_, _, p = call("GET", f"permissions/{pe(vh)}/tf-user", want=(200,))
assert {k: p[k] for k in perms} == perms and p["user"] == "tf-user" and p["vhost"] == vh, p
call("PUT", f"permissions/{pe(vh)}/guest", {"configure": ".*", "write": ".*", "read": ".*"}, (201, 204))

# rabbitmq_policy: every value a string at first, integers sent as integers.
policy = {"vhost": vh, "name": "tf-ha", "pattern": "^tf", "apply-to": "queues", "priority": 1,
          "definition": {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"}}
call("PUT", f"policies/{pe(vh)}/tf-ha", policy, (201, 204))
_, _, pol = call("GET", f"policies/{pe(vh)}/tf-ha", want=(200,))
for k in ("name", "vhost", "pattern", "apply-to", "priority", "definition"):
    assert pol[k] == policy[k], (k, pol)

# rabbitmq_queue: every setting read back, or the provider replaces the queue.
queue = {"type": "", "durable": False, "auto_delete": True,
         "arguments": {"x-message-ttl": 60000, "x-queue-type": "classic", "x-custom": "kept"}}
call("PUT", f"queues/{pe(vh)}/tf-queue", queue, (201, 204))
_, _, q = call("GET", f"queues/{pe(vh)}/tf-queue", want=(200,))
assert (q["name"], q["vhost"], q["durable"], q["auto_delete"]) == ("tf-queue", vh, False, True), q
assert q["arguments"] == queue["arguments"], q["arguments"]
call("PUT", f"queues/{pe(vh)}/tf-durable", {"type": "", "durable": True}, (201, 204))
_, _, q = call("GET", f"queues/{pe(vh)}/tf-durable", want=(200,))
assert q["durable"] is True and q["auto_delete"] is False and q["arguments"] == {}, q

# rabbitmq_exchange: arguments read back as declared.
exchange = {"type": "topic", "durable": True, "auto_delete": True,
            "arguments": {"alternate-exchange": "tf-ae", "x-custom": "kept"}}
call("PUT", f"exchanges/{pe(vh)}/tf-exchange", exchange, (201, 204))
call("PUT", f"exchanges/{pe(vh)}/tf-fanout", {"type": "fanout", "durable": True}, (201, 204))
_, _, e = call("GET", f"exchanges/{pe(vh)}/tf-exchange", want=(200,))
assert (e["type"], e["durable"], e["auto_delete"], e["arguments"]) == ("topic", True, True, exchange["arguments"]), e

# rabbitmq_binding: the properties key comes from the Location header and
# must name the binding in the list read back.
def bind(dtype, dest, key, args):
    kind = "q" if dtype == "queue" else "e"
    body = {"source": "tf-exchange", "vhost": vh, "destination": dest, "destination_type": dtype,
            "routing_key": key, "arguments": args}
    status, headers, _ = call("POST", f"bindings/{pe(vh)}/e/tf-exchange/{kind}/{pe(dest)}", body, (201,))
    location = headers.get("Location")
    assert location, "no Location header"
    props = urllib.parse.unquote(location.rsplit("/", 1)[1])
    _, _, listed = call("GET", f"bindings/{pe(vh)}/e/tf-exchange/{kind}/{pe(dest)}", want=(200,))
    found = [b for b in listed if b["properties_key"] == props]
    assert len(found) == 1, (props, listed)
    b = found[0]
    assert (b["source"], b["destination"], b["destination_type"], b["routing_key"]) == (
        "tf-exchange", dest, dtype, key), b
    assert b["arguments"] == args, b
    assert "/" not in props, f"a properties key with '/' breaks the provider's ids: {props}"
    return kind, props

made = [
    bind("queue", "tf-queue", "a/b.#", {}),
    bind("queue", "tf-queue", "", {}),
    bind("queue", "tf-queue", "a/b.#", {"x-match": "any"}),
    bind("exchange", "tf-fanout", "logs.*", {}),
]
assert len({p for _, p in made}) == len(made), f"two bindings share a properties key: {made}"
for (kind, props), dest in zip(made, ["tf-queue", "tf-queue", "tf-queue", "tf-fanout"]):
    call("DELETE", f"bindings/{pe(vh)}/e/tf-exchange/{kind}/{pe(dest)}/{pe(props)}", want=(204,))
_, _, left = call("GET", f"bindings/{pe(vh)}/e/tf-exchange/q/tf-queue", want=(200,))
assert left == [], left

# Deletes, in the provider's order; a 404 counts as done.
call("DELETE", f"exchanges/{pe(vh)}/tf-exchange", want=(204, 404))
call("DELETE", f"queues/{pe(vh)}/tf-queue", want=(204, 404))
call("DELETE", f"policies/{pe(vh)}/tf-ha", want=(204, 404))
call("DELETE", f"permissions/{pe(vh)}/tf-user", want=(204, 404))
call("DELETE", "users/tf-user", want=(204, 404))
call("DELETE", f"vhosts/{pe(vh)}", want=(204, 404))
call("GET", f"vhosts/{pe(vh)}", want=(404,))
print("terraform requests ok")
