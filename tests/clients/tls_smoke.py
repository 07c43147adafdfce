"""pika and the HTTP API over TLS against mirrorq, checking the server's
certificate against the test's CA (and showing a client certificate when
CLIENT_CERT is set). With EXPECT_REFUSED set, the AMQPS handshake must fail
instead (no client certificate where one is required)."""
import base64
import json
import os
import ssl
import urllib.request

import pika

amqps, https, ca = int(os.environ["AMQPS_PORT"]), int(os.environ["HTTPS_PORT"]), os.environ["CA"]
ctx = ssl.create_default_context(cafile=ca)
if os.environ.get("CLIENT_CERT"):
    ctx.load_cert_chain(os.environ["CLIENT_CERT"], os.environ["CLIENT_KEY"])
params = pika.ConnectionParameters(
    host="localhost", port=amqps, ssl_options=pika.SSLOptions(ctx, "localhost"),
    credentials=pika.PlainCredentials("guest", "guest"), connection_attempts=1,
)

if os.environ.get("EXPECT_REFUSED"):
    try:
        pika.BlockingConnection(params).close()
    except pika.exceptions.AMQPConnectionError as e:
        print(f"refused ok: {e!r}")
        raise SystemExit(0)
    raise SystemExit("connected without a client certificate")

conn = pika.BlockingConnection(params)
ch = conn.channel()
ch.confirm_delivery()
ch.queue_declare("tls-q", durable=True)
for i in range(100):
    ch.basic_publish("", "tls-q", f"over tls {i}".encode(), pika.BasicProperties(delivery_mode=2), mandatory=True)
got = []
while True:
    m, _, body = ch.basic_get("tls-q", auto_ack=True)
    if m is None:
        break
    got.append(body.decode())
assert got == [f"over tls {i}" for i in range(100)], got
conn.close()

auth = "Basic " + base64.b64encode(b"guest:guest").decode()
req = urllib.request.Request(f"https://localhost:{https}/api/queues/%2F/tls-q", headers={"Authorization": auth})
with urllib.request.urlopen(req, context=ctx) as r:
    q = json.load(r)
assert q["name"] == "tls-q" and q["messages"] == 0, q
print("tls ok")
