// Declaring many queues over AMQP as a Node service does at its start:
// amqplib, several connections spread over the nodes, several channels on
// each, every channel declaring the next queue (durable, `queue.declare`
// and its declare-ok) as soon as its last one was answered. Prints one
// JSON line: declared, errors, seconds, per_s. Works against RabbitMQ
// (--quorum: quorum queues) and mirrorq.
//
// node amqplib_declare.js --ports 5691,5692,5693 --count 1000
//   [--connections 8] [--channels 4] [--prefix scale-amqp-] [--from 0] [--quorum]
'use strict';
const path = require('path');
const amqp = require(path.join(__dirname, '../node/node_modules/amqplib'));

const opts = { ports: '', count: 1000, connections: 8, channels: 4, prefix: 'scale-amqp-', from: 0, quorum: false };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; i++) {
  const k = argv[i].replace(/^--/, '');
  if (!(k in opts)) throw new Error(`unknown option ${argv[i]}`);
  if (typeof opts[k] === 'boolean') opts[k] = true;
  else opts[k] = typeof opts[k] === 'number' ? Number(argv[++i]) : argv[++i];
}
const ports = opts.ports.split(',').filter((p) => p).map(Number);
if (!ports.length) throw new Error('--ports is required');

async function main() {
  const args = opts.quorum ? { 'x-queue-type': 'quorum' } : {};
  const conns = [];
  for (let c = 0; c < opts.connections; c++) {
    conns.push(await amqp.connect(`amqp://guest:guest@127.0.0.1:${ports[c % ports.length]}/%2F`));
  }
  const channels = [];
  for (const conn of conns) {
    for (let k = 0; k < opts.channels; k++) {
      const ch = await conn.createChannel();
      // A refused declare closes its channel: a new one takes its place.
      channels.push({ conn, ch });
    }
  }
  let next = 0;
  let declared = 0;
  const errors = [];
  const name = (i) => `${opts.prefix}${String(opts.from + i).padStart(5, '0')}`;
  const start = process.hrtime.bigint();
  await Promise.all(channels.map(async (slot) => {
    while (next < opts.count) {
      const i = next++;
      try {
        await slot.ch.assertQueue(name(i), { durable: true, arguments: args });
        declared += 1;
      } catch (e) {
        errors.push(`${name(i)}: ${e.message}`);
        slot.ch = await slot.conn.createChannel();
      }
    }
  }));
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  console.log(JSON.stringify({
    declared, errors: errors.length, first_errors: errors.slice(0, 5),
    seconds: Math.round(seconds * 1000) / 1000, per_s: Math.round((declared / seconds) * 10) / 10,
  }));
  for (const conn of conns) await conn.close().catch(() => {});
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
