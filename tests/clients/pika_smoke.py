"""Stock pika against a mirrorq node: confirms, properties, get, consume
with prefetch, requeue, exchanges. Exits non-zero on the first mismatch."""
import os
import sys

import pika

port = int(os.environ["AMQP_PORT"])
params = pika.ConnectionParameters(
    host="127.0.0.1", port=port, credentials=pika.PlainCredentials("guest", "guest"), heartbeat=10
)
conn = pika.BlockingConnection(params)
ch = conn.channel()
ch.confirm_delivery()
ch.queue_declare(queue="pika-q", durable=True)

props = pika.BasicProperties(
    content_type="text/plain", delivery_mode=2, headers={"k": "v", "n": 7}, message_id="id-1"
)
for i in range(20):
    # With confirms on, basic_publish raises if the broker nacks.
    ch.basic_publish(exchange="", routing_key="pika-q", body=f"m{i}".encode(), properties=props, mandatory=True)

method, header, body = ch.basic_get(queue="pika-q", auto_ack=False)
assert body == b"m0", body
assert method.message_count == 19, method.message_count
assert header.content_type == "text/plain", header.content_type
assert header.delivery_mode == 2
assert header.headers == {"k": "v", "n": 7}, header.headers
assert header.message_id == "id-1"
ch.basic_nack(method.delivery_tag, requeue=True)

ch.basic_qos(prefetch_count=5)
seen = []
for method, header, body in ch.consume("pika-q", inactivity_timeout=5):
    if method is None:
        break
    seen.append((body, method.redelivered))
    ch.basic_ack(method.delivery_tag)
    if len(seen) == 20:
        break
ch.cancel()
assert seen[0] == (b"m0", True), seen[0]
assert [b for b, _ in seen] == [f"m{i}".encode() for i in range(20)], seen
assert all(not r for _, r in seen[1:])

# Unroutable mandatory publish: pika raises UnroutableError.
try:
    ch.basic_publish(exchange="", routing_key="nowhere", body=b"x", mandatory=True)
    sys.exit("unroutable mandatory publish was not returned")
except pika.exceptions.UnroutableError:
    pass

ch.exchange_declare(exchange="pika-fanout", exchange_type="fanout")
ch.queue_declare(queue="pika-a")
ch.queue_declare(queue="pika-b")
ch.queue_bind(queue="pika-a", exchange="pika-fanout")
ch.queue_bind(queue="pika-b", exchange="pika-fanout")
ch.basic_publish(exchange="pika-fanout", routing_key="", body=b"both")
for q in ("pika-a", "pika-b"):
    _, _, body = ch.basic_get(queue=q, auto_ack=True)
    assert body == b"both", (q, body)

# A missing queue closes the channel with 404.
try:
    ch.queue_declare(queue="missing", passive=True)
    sys.exit("passive declare of a missing queue succeeded")
except pika.exceptions.ChannelClosedByBroker as e:
    assert e.reply_code == 404, e

conn.close()
print("pika ok")
