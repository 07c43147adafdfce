// Drives mirrorq's web UI in Debian's headless Chromium, as a user would:
// log in, add a policy `ha-mode: all`, add a queue, wait until it shows a
// master and two synchronised mirrors, publish a message on the queue's
// page and get it back. Then, while messages flow through the HTTP API,
// the overview's rate chart draws, moves and plots a non-zero rate, and
// so does the flowing queue's. Usage: node browser.js BASE_URL SCREENSHOT_DIR
// Exit 0 and a last line "ok" when everything was seen.
const { chromium } = require('playwright-core');

const [base, shots] = process.argv.slice(2);
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// The HTTP API straight from node (no page): the load the charts show.
async function call(method, path, body) {
  const headers = { Authorization: 'Basic ' + Buffer.from('guest:guest').toString('base64'), 'Content-Type': 'application/json' };
  const r = await fetch(base + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await r.text();
  if (!r.ok) throw new Error(`${method} ${path}: HTTP ${r.status} ${text}`);
  return text ? JSON.parse(text) : null;
}

// A chart's line as the page drew it: its points, the value it ends on,
// and whether any point stands above the chart's zero line.
function line(page, chart, series) {
  return page.evaluate(([chart, series]) => {
    const svg = document.querySelector(`#main svg[data-chart=${chart}]`);
    const path = svg && svg.querySelector(`path[data-series=${series}]`);
    if (!path) return null;
    const zero = Number(svg.querySelector('line.axis').getAttribute('y1'));
    const ys = [...path.getAttribute('d').matchAll(/[ML]([\d.]+) ([\d.]+)/g)].map((m) => Number(m[2]));
    return { d: path.getAttribute('d'), points: ys.length, last: Number(path.dataset.last), above: ys.some((y) => y < zero - 1) };
  }, [chart, series]);
}

// Wait until `series` of `chart` is drawn (two points at least) with a
// non-zero rate plotted, and `also` holds of it.
async function drawn(page, chart, series, timeout, also = () => true) {
  const until = Date.now() + timeout;
  let seen = null;
  while (Date.now() < until) {
    seen = await line(page, chart, series);
    if (seen && seen.points >= 2 && seen.last > 0 && seen.above && also(seen)) return seen;
    await sleep(250);
  }
  throw new Error(`chart ${chart} line ${series} not drawn as expected in ${timeout} ms: ${JSON.stringify(seen)}`);
}

(async () => {
  const browser = await chromium.launch({ executablePath: CHROMIUM, args: ['--no-sandbox'] });
  const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
  page.setDefaultTimeout(30000);
  // "Close connection ...?" and the like: the user says yes.
  page.on('dialog', (d) => d.accept());
  await page.goto(base + '/');
  // As RabbitMQ's: the login form comes empty, no credentials in the page.
  const prefilled = await page.$eval('#pass', (el) => el.value) + await page.$eval('#user', (el) => el.value);
  if (prefilled !== '') throw new Error(`the login form comes filled in: '${prefilled}'`);
  await page.fill('#user', 'guest');
  await page.fill('#pass', 'guest');
  await page.click('#login button[type=submit]');
  await page.waitForSelector('#nodes');
  const running = await page.$$eval('#nodes .pill.ok', (els) => els.length);
  if (running !== 3) throw new Error(`overview shows ${running} running nodes, not 3`);
  console.log('overview: 3 nodes running');

  // The tutorial's clicks, with RabbitMQ's labels: Admin > Policies.
  await page.click('nav a:text("Admin")');
  await page.click('nav.sub a:text("Policies")');
  await page.waitForSelector('h2:text("Add / update a policy")');
  await page.fill('#p-name', 'ha-ui');
  await page.fill('#p-pattern', '^ui\\.');
  await page.selectOption('#p-mode', 'all');
  await page.selectOption('#p-sync', 'automatic');
  await page.click('#policy-form button[type=submit]');
  await page.waitForSelector('#policy-msg.ok');
  await page.waitForSelector('#policies tr[data-policy="ha-ui"]');
  console.log('policy ha-ui added');

  await page.click('nav a:text("Queues")');
  await page.waitForSelector('h2:text("Add a new queue")');
  await page.selectOption('#new-type', 'classic');
  await page.fill('#new-queue', 'ui.demo');
  await page.selectOption('#new-durable', 'true');
  await page.click('#add-queue button[type=submit]');
  await page.waitForSelector('#queues-msg.ok');
  // The page refreshes itself: wait for the master and two synchronised mirrors.
  await page.waitForFunction(() => {
    const row = document.querySelector('#queues tr[data-queue="ui.demo"]');
    return row && row.querySelectorAll('.pill.master').length === 1 && row.querySelectorAll('.pill.ok').length >= 3;
  });
  const mirrors = await page.$$eval('#queues tr[data-queue="ui.demo"] td:nth-child(3) .pill.ok', (els) => els.map((e) => e.textContent));
  if (mirrors.length !== 2) throw new Error(`expected two synchronised mirrors, saw ${mirrors}`);
  console.log(`ui.demo mirrored, synchronised mirrors: ${mirrors.join(' ')}`);
  const shown = await page.$$eval('#queues tr[data-queue="ui.demo"] td', (tds) => tds.map((t) => t.textContent.trim()));
  if (!shown.includes('classic') || !shown.includes('D')) throw new Error(`type and durability not shown: ${shown}`);
  await page.screenshot({ path: shots + '/queues.png' });

  // The queue's page at RabbitMQ's URL, opened in a new tab as the
  // tutorial does: log in there, and land on that page, not the overview.
  const tab = await browser.newPage({ viewport: { width: 1280, height: 800 } });
  tab.setDefaultTimeout(30000);
  await tab.goto(base + '/#/queues/%2F/ui.demo');
  await tab.fill('#user', 'guest');
  await tab.fill('#pass', 'guest');
  await tab.click('#login button[type=submit]');
  await tab.waitForSelector('h2:text("Publish message")');
  const kind = await tab.textContent('#q-kind');
  if (!kind.includes('classic') || !kind.includes('D')) throw new Error(`the queue page does not show a durable classic queue: ${kind}`);
  await tab.close();
  // Another tab of the same browser is logged in already, as with
  // RabbitMQ's UI: it opens on the page asked for, with no login form.
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const first = await ctx.newPage();
  await first.goto(base + '/#/overview');
  await first.fill('#user', 'guest');
  await first.fill('#pass', 'guest');
  await first.click('#login button[type=submit]');
  await first.waitForSelector('#total-messages', { timeout: 30000 });
  const same = await ctx.newPage();
  await same.goto(base + '/#/queues/%2F/ui.demo');
  await same.waitForSelector('h2:text("Publish message")', { timeout: 30000 });
  if (await same.$('#login')) throw new Error('a second tab of the same browser asked for a login');
  await ctx.close();
  await page.click('#queues a.q[href="#/queues/%2F/ui.demo"]');
  await page.waitForSelector('#publish');
  await page.fill('#pub-payload', 'hello from chromium');
  await page.fill('#pub-headers', '{"x-trace": "ui-1"}');
  await page.fill('#pub-props', '{"message_id": "m-ui"}');
  await page.click('#publish button[type=submit]');
  await page.waitForSelector('#publish-msg.ok');
  await page.selectOption('#get-mode', 'ack_requeue_false');
  await page.click('#get button[type=submit]');
  await page.waitForSelector('table.got pre.payload');
  const payload = await page.textContent('table.got pre.payload');
  if (payload !== 'hello from chromium') throw new Error(`got back ${JSON.stringify(payload)}`);
  const props = await page.textContent('table.got tr:has(th:text("Properties")) td');
  if (!props.includes('"x-trace":"ui-1"') || !props.includes('"message_id":"m-ui"')) {
    throw new Error(`the headers and properties published did not come back: ${props}`);
  }
  console.log('published and got back: ' + payload);
  await page.screenshot({ path: shots + '/queue.png', fullPage: true });

  // A mirror added under `ha-sync-mode: manual` (the test's setup):
  // Synchronise on the queue's page fills it.
  await page.evaluate(() => { location.hash = '#/queues/%2F/sync.q'; });
  await page.waitForSelector('#queue-details #sync');
  await page.click('#queue-details #sync');
  await page.waitForSelector('#queue-msg.ok');
  await page.waitForFunction(() => !document.getElementById('sync')
    && document.querySelectorAll('#queue-details .card .pill.ok').length === 1
    && document.querySelectorAll('#queue-details .card .pill.warn').length === 0);
  console.log('sync.q: its manual mirror synchronised from its page');

  // RabbitMQ's other pages, with the test's AMQP client connected (a
  // consumer "ui-consumer" on ui.consumed, through node 2).
  await page.click('nav a:text("Overview")');
  await page.waitForFunction(() => Number(document.getElementById('total-connections')?.textContent) >= 1);
  console.log('overview counts the client connection');
  await page.click('nav a:text("Channels")');
  await page.waitForSelector('#channels td:text("guest")');
  console.log('channels: the client channel is listed');

  await page.click('nav a:text("Exchanges")');
  await page.waitForSelector('h2:text("Add a new exchange")');
  if (!(await page.$('#exchanges tr[data-exchange="amq.topic"]'))) throw new Error('the standard exchanges are not listed');
  await page.fill('#x-name', 'ui.x');
  await page.selectOption('#x-type', 'direct');
  await page.click('#add-exchange button[type=submit]');
  await page.waitForSelector('#exchanges-msg.ok');
  await page.click('#exchanges tr[data-exchange="ui.x"] a.q');
  await page.waitForSelector('h2:text("Add binding from this exchange")');
  await page.fill('#b-dest', 'ui.consumed');
  await page.fill('#b-key', 'k');
  await page.click('#bind button[type=submit]');
  await page.waitForSelector('#x-bindings tr[data-binding="ui.consumed"]');
  await page.fill('#xp-key', 'k');
  await page.fill('#xp-payload', 'via ui.x');
  await page.click('#x-publish button[type=submit]');
  await page.waitForSelector('#x-publish-msg.show');
  const routed = await page.textContent('#x-publish-msg');
  if (!routed.includes('confirmed')) throw new Error(`the exchange's publish was not routed: ${routed}`);
  await page.screenshot({ path: shots + '/exchange.png', fullPage: true });
  console.log('exchange ui.x added, bound to ui.consumed, published through');

  await page.evaluate(() => { location.hash = '#/queues/%2F/ui.consumed'; });
  await page.waitForSelector('#q-consumers td:text("ui-consumer")');
  await page.waitForSelector('#q-bindings a.q:text("ui.x")');
  console.log('ui.consumed shows its consumer and its binding from ui.x');

  await page.click('nav a:text("Admin")');
  await page.waitForSelector('h2:text("Add a user")');
  await page.fill('#u-name', 'ui-user');
  await page.fill('#u-password', 'ui-secret');
  await page.fill('#u-tags', 'monitoring');
  await page.click('#add-user button[type=submit]');
  await page.waitForSelector('#users tr[data-user="ui-user"]');
  await page.selectOption('#pm-user', 'ui-user');
  await page.click('#set-permission button[type=submit]');
  await page.waitForSelector('#permission-msg.ok:has-text("Permission of ui-user")');
  await page.screenshot({ path: shots + '/users.png', fullPage: true });
  await page.click('nav.sub a:text("Virtual Hosts")');
  await page.fill('#vh-name', 'ui-vhost');
  await page.click('#add-vhost button[type=submit]');
  await page.waitForSelector('#vhosts tr[data-vhost="ui-vhost"]');
  console.log('user ui-user and virtual host ui-vhost added under Admin');

  // 123 queues: the server pages and filters them.
  await page.click('nav a:text("Queues")');
  await page.waitForFunction(() => /123 of 123 queues · page 1 of 2/.test(document.getElementById('queues-count')?.textContent));
  await page.click('#page-next');
  await page.waitForSelector('#queues tr[data-queue="zz.page.119"]');
  const onTwo = await page.$$eval('#queues tr[data-queue]', (rows) => rows.length);
  if (onTwo !== 23) throw new Error(`page 2 shows ${onTwo} queues, not 23`);
  await page.fill('#filter-name', 'PAGE.11');
  await page.click('#queue-filter button[type=submit]');
  await page.waitForFunction(() => /^10 of 123 queues/.test(document.getElementById('queues-count')?.textContent));
  await page.fill('#filter-name', '^zz\\.page\\.00[0-4]$');
  await page.check('#filter-regex');
  await page.click('#queue-filter button[type=submit]');
  await page.waitForFunction(() => /^5 of 123 queues/.test(document.getElementById('queues-count')?.textContent));
  await page.fill('#filter-name', '');
  await page.uncheck('#filter-regex');
  await page.click('#queue-filter button[type=submit]');
  await page.waitForFunction(() => /^123 of 123/.test(document.getElementById('queues-count')?.textContent));
  console.log('queues paged (100 + 23) and filtered (10 by name, 5 by regex)');

  await page.click('nav a:text("Connections")');
  await page.waitForSelector('#connections tr[data-connection]');
  await page.click('#connections [data-close="0"]');
  await page.waitForSelector('#connections-msg.ok');
  console.log('the client connection force-closed from Connections');

  // Messages flow: three publishers and a slower getter, so rates rise and
  // messages pile up.
  await call('PUT', '/api/queues/%2F/ui.flow', { durable: true });
  let flowing = true;
  let failed = null;
  const counts = { published: 0, got: 0 };
  const publisher = async () => {
    while (flowing) {
      await call('POST', '/api/exchanges/%2F/amq.default/publish', { properties: {}, routing_key: 'ui.flow', payload: 'tick', payload_encoding: 'string' });
      counts.published++;
    }
  };
  const getter = async () => {
    while (flowing) {
      counts.got += (await call('POST', '/api/queues/%2F/ui.flow/get', { count: 1, ackmode: 'ack_requeue_false', encoding: 'auto' })).length;
      await sleep(250);
    }
  };
  const flows = [publisher(), publisher(), publisher(), getter()].map((p) => p.catch((e) => { failed = failed || e; }));
  const started = Date.now();
  const since = () => `${((Date.now() - started) / 1000).toFixed(1)} s into the flow`;

  await page.click('nav a[data-page=overview]');
  const before = await drawn(page, 'rates', 'publish', 20000);
  console.log(`overview rate chart drawn: publish at ${before.last}/s over ${before.points} points, ${since()}`);
  // The page polls: the line moves on with the next point.
  const after = await drawn(page, 'rates', 'publish', 10000, (l) => l.d !== before.d);
  console.log(`overview rate chart moved: publish at ${after.last}/s over ${after.points} points, ${since()}`);
  await drawn(page, 'rates', 'deliver_get', 5000);
  // The rate axis reads as a scale: no two labels the same.
  const ticks = await page.$$eval('#main svg[data-chart=rates] text.tick', (ts) => ts.map((t) => t.textContent));
  if (ticks.length < 2 || new Set(ticks).size !== ticks.length) throw new Error(`rate axis labels repeat: ${ticks}`);
  const depth = await line(page, 'depth', 'ready');
  if (!depth || depth.points < 2) throw new Error(`no depth chart drawn: ${JSON.stringify(depth)}`);
  await page.screenshot({ path: shots + '/charts.png', fullPage: true });

  // The rates come from the server, for any client of the API.
  const ov = await call('GET', '/api/overview');
  if (!(ov.message_stats.publish > 0 && ov.message_stats.publish_details.rate > 0 && ov.message_stats.confirm_details.rate > 0)) {
    throw new Error('overview message_stats without a publish rate: ' + JSON.stringify(ov.message_stats));
  }
  const q = await call('GET', '/api/queues/%2F/ui.flow');
  if (!(q.message_stats.publish > 0 && q.message_stats.publish_details.rate > 0 && q.message_stats.deliver_get > 0)) {
    throw new Error('queue message_stats without a publish rate: ' + JSON.stringify(q.message_stats));
  }
  console.log(`API: overview publish ${ov.message_stats.publish_details.rate}/s, ui.flow publish ${q.message_stats.publish_details.rate}/s`);

  await page.evaluate(() => { location.hash = '#/queues/%2F/ui.flow'; });
  const queueLine = await drawn(page, 'rates', 'publish', 12000);
  console.log(`ui.flow rate chart drawn: publish at ${queueLine.last}/s over ${queueLine.points} points, ${since()}`);
  await page.screenshot({ path: shots + '/queue-charts.png', fullPage: true });
  flowing = false;
  await Promise.all(flows);
  if (failed) throw failed;
  console.log(`flowed: ${counts.published} published, ${counts.got} got`);
  await browser.close();
  console.log('ok');
})().catch((e) => { console.error(String(e && e.stack || e)); process.exit(1); });
