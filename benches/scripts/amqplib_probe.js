// Is every queue available through a rolling restart? One amqplib
// connection per node (opened again whenever its node drops or refuses
// it), each keeping one persistent message with publisher confirms in
// flight to every one of the given queues, the next one sent once the last
// is confirmed and --every ms (default 100) have passed since it was sent:
// a probe, not a load that would slow what it watches. A queue is available while some node confirms its
// publishes. Runs until the file --stop exists, then prints one JSON line:
// confirmed, failed (publishes nacked or lost with their connection),
// gap_ms (the longest stretch in which no node confirmed a publish to one
// of the queues) and worst (that queue and when its stretch began, in s
// from the start). Works against RabbitMQ and mirrorq.
//
// node amqplib_probe.js --ports 5691,5692,5693 --queues q1,q2 --stop FILE [--every 100]
'use strict';
const fs = require('fs');
const path = require('path');
const amqp = require(path.join(__dirname, '../node/node_modules/amqplib'));

const opts = { ports: '', queues: '', stop: '', every: '100' };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; i++) {
  const k = argv[i].replace(/^--/, '');
  if (!(k in opts)) throw new Error(`unknown option ${argv[i]}`);
  opts[k] = argv[++i];
}
const ports = opts.ports.split(',').filter((p) => p).map(Number);
const queues = opts.queues.split(',').filter((q) => q);
if (!ports.length || !queues.length || !opts.stop) throw new Error('--ports, --queues and --stop are required');

const start = Date.now();
const lastOk = new Map(queues.map((q) => [q, start]));
let gap = 0;
let worst = null;
let confirmed = 0;
let failed = 0;
let stopping = false;
const body = Buffer.from('probe');
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function ok(q) {
  const now = Date.now();
  const since = lastOk.get(q);
  if (now - since > gap) {
    gap = now - since;
    worst = { queue: q, from_s: (since - start) / 1000 };
  }
  lastOk.set(q, now);
  confirmed += 1;
}

// One node's client: connect, publish to every queue in parallel (one in
// flight each), start again after a failure.
async function client(port) {
  while (!stopping) {
    let conn;
    try {
      conn = await amqp.connect(`amqp://guest:guest@127.0.0.1:${port}/%2F`);
      conn.on('error', () => {});
      const ch = await conn.createConfirmChannel();
      ch.on('error', () => {});
      let broken = false;
      const closed = new Promise((resolve) => {
        conn.on('close', () => { broken = true; resolve(); });
        ch.on('close', () => { broken = true; resolve(); });
      });
      const one = async (q) => {
        while (!stopping && !broken) {
          const sent = Date.now();
          const done = new Promise((resolve) => {
            ch.publish('', q, body, { persistent: true, mandatory: true }, (err) => resolve(!err));
          });
          // A connection that goes away leaves its confirms unanswered.
          const confirmedHere = await Promise.race([done, closed.then(() => false)]);
          if (confirmedHere) ok(q);
          else failed += 1;
          const wait = sent + Number(opts.every) - Date.now();
          if (wait > 0) await sleep(wait);
        }
      };
      await Promise.all(queues.map(one));
      await conn.close().catch(() => {});
    } catch (e) {
      failed += 1;
      if (conn) conn.close().catch(() => {});
      await sleep(50);
    }
  }
}

async function main() {
  const clients = ports.map(client);
  while (!fs.existsSync(opts.stop)) await sleep(100);
  stopping = true;
  const now = Date.now();
  for (const [q, since] of lastOk) {
    if (now - since > gap) {
      gap = now - since;
      worst = { queue: q, from_s: (since - start) / 1000 };
    }
  }
  console.log(JSON.stringify({ confirmed, failed, gap_ms: gap, worst }));
  await Promise.race([Promise.all(clients), sleep(3000)]);
  process.exit(0);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
