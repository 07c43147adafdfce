// Node's amqplib as users write a publisher (a confirm channel, persistent
// messages, a window of unconfirmed messages, one callback per publish) and
// a consumer draining the queue meanwhile (prefetch 1000, acks every 100):
// confirmed messages per second and confirm latency, as one JSON line, the
// same fields as pika_perf.py. Works against RabbitMQ and mirrorq.
//
// node amqplib_perf.js --port 5672 [--window 1000] [--time 10] [--quorum] [--queue q]
'use strict';
const path = require('path');
const amqp = require(path.join(__dirname, '../node/node_modules/amqplib'));

const opts = { host: 'localhost', port: 0, queue: 'amqplib-perf', window: 1000, size: 100, time: 10, quorum: false };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; i++) {
  const k = argv[i].replace(/^--/, '');
  if (!(k in opts)) throw new Error(`unknown option ${argv[i]}`);
  if (typeof opts[k] === 'boolean') opts[k] = true;
  else opts[k] = typeof opts[k] === 'number' ? Number(argv[++i]) : argv[++i];
}
if (!opts.port) throw new Error('--port is required');

async function main() {
  const url = `amqp://guest:guest@${opts.host}:${opts.port}/%2F`;
  const queueArgs = opts.quorum ? { 'x-queue-type': 'quorum' } : {};
  const pub = await amqp.connect(url);
  const sub = await amqp.connect(url);
  const ch = await pub.createConfirmChannel();
  await ch.assertQueue(opts.queue, { durable: true, arguments: queueArgs });

  const cch = await sub.createChannel();
  await cch.prefetch(1000);
  let received = 0;
  await cch.consume(opts.queue, (msg) => {
    received += 1;
    if (received % 100 === 0) cch.ack(msg, true);
  });

  const body = Buffer.alloc(opts.size, 'x');
  const lat = [];
  let inFlight = 0;
  let done = false;
  const start = process.hrtime.bigint();
  let end = start;
  await new Promise((resolve) => {
    const fill = () => {
      while (!done && inFlight < opts.window) {
        inFlight += 1;
        const sent = process.hrtime.bigint();
        ch.publish('', opts.queue, body, { persistent: true }, (err) => {
          inFlight -= 1;
          if (!err) lat.push(Number(process.hrtime.bigint() - sent) / 1e6);
          // From the callback: the publisher refills as confirms come in.
          if (!done) setImmediate(fill);
        });
      }
    };
    setTimeout(() => {
      done = true;
      end = process.hrtime.bigint();
      resolve();
    }, opts.time * 1000);
    fill();
  });
  const seconds = Number(end - start) / 1e9;
  const confirmed = lat.length;
  lat.sort((a, b) => a - b);
  const pct = (p) => (lat.length ? Math.round(lat[Math.min(lat.length - 1, Math.floor(lat.length * p))] * 100) / 100 : null);
  console.log(JSON.stringify({
    confirmed, msg_per_s: Math.round((confirmed / seconds) * 10) / 10,
    p50_ms: pct(0.5), p99_ms: pct(0.99), window: opts.window, tls: false,
  }));
  await ch.waitForConfirms().catch(() => {});
  await pub.close().catch(() => {});
  await sub.close().catch(() => {});
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
