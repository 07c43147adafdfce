"""A pika publisher as users write one (SelectConnection, persistent
messages, publisher confirms, a window of unconfirmed messages) and a
consumer draining the queue meanwhile: confirmed messages per second and
confirm latency, as one JSON line. Works against RabbitMQ and mirrorq, over
plain AMQP or TLS (--ca).

python3 pika_perf.py --port 5672 [--ca ca.pem] [--window 1000] [--time 10] [--quorum]
"""
import argparse
import json
import multiprocessing
import ssl
import time

import pika

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="localhost")
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--ca", help="CA file: connect over TLS, checking the server's certificate")
ap.add_argument("--queue", default="pika-perf")
ap.add_argument("--window", type=int, default=1000, help="unconfirmed messages in flight")
ap.add_argument("--size", type=int, default=100)
ap.add_argument("--time", type=float, default=10)
ap.add_argument("--quorum", action="store_true", help="declare a quorum queue (RabbitMQ)")
args = ap.parse_args()


def params():
    tls = None
    if args.ca:
        tls = pika.SSLOptions(ssl.create_default_context(cafile=args.ca), args.host)
    return pika.ConnectionParameters(args.host, args.port, credentials=pika.PlainCredentials("guest", "guest"),
                                     ssl_options=tls, heartbeat=0)


qargs = {"x-queue-type": "quorum"} if args.quorum else None
setup = pika.BlockingConnection(params())
setup.channel().queue_declare(args.queue, durable=True, arguments=qargs)
setup.close()

# The consumer runs in a process of its own, as users run one: a thread of
# this interpreter would hold the GIL through each burst of deliveries and
# show up as the publisher's confirm latency, whichever the broker.
fork = multiprocessing.get_context("fork")  # the child runs consume() from this state
stop = fork.Event()


def consume():
    conn = pika.BlockingConnection(params())
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1000)
    count = [0]

    def on_msg(c, method, _props, _body):
        count[0] += 1
        if count[0] % 100 == 0:
            c.basic_ack(method.delivery_tag, multiple=True)

    ch.basic_consume(args.queue, on_msg)
    while not stop.is_set():
        conn.process_data_events(time_limit=0.2)
    conn.close()


consumer = fork.Process(target=consume)
consumer.start()

body = b"x" * args.size
props = pika.BasicProperties(delivery_mode=2)
sent = {}  # delivery tag -> send time, in tag order
lat = []
st = {"tag": 0, "done": False, "start": 0.0, "end": 0.0}


def on_open(conn):
    conn.channel(on_open_callback=on_channel)


def on_channel(ch):
    st["ch"] = ch
    ch.confirm_delivery(on_confirm, callback=lambda _: begin())


def begin():
    st["start"] = time.monotonic()
    conn.ioloop.call_later(args.time, finish)
    fill()


def fill():
    ch = st["ch"]
    while not st["done"] and len(sent) < args.window:
        st["tag"] += 1
        sent[st["tag"]] = time.monotonic()
        ch.basic_publish("", args.queue, body, props)


def on_confirm(frame):
    m = frame.method
    now = time.monotonic()
    if m.multiple:
        while sent:
            tag = next(iter(sent))
            if tag > m.delivery_tag:
                break
            lat.append(now - sent.pop(tag))
    elif m.delivery_tag in sent:
        lat.append(now - sent.pop(m.delivery_tag))
    fill()


def finish():
    st["done"] = True
    st["end"] = time.monotonic()
    conn.close()


conn = pika.SelectConnection(params(), on_open_callback=on_open,
                             on_open_error_callback=lambda c, e: c.ioloop.stop(),
                             on_close_callback=lambda c, e: c.ioloop.stop())
conn.ioloop.start()
stop.set()
consumer.join()
lat.sort()
pct = lambda p: round(lat[min(len(lat) - 1, int(len(lat) * p))] * 1000, 2) if lat else None  # noqa: E731
print(json.dumps({"confirmed": len(lat), "msg_per_s": round(len(lat) / (st["end"] - st["start"]), 1),
                  "p50_ms": pct(0.5), "p99_ms": pct(0.99), "window": args.window, "tls": bool(args.ca)}))
