// The tutorial mirrorq started from, click for click in Debian's headless
// Chromium, at RabbitMQ's URLs and with RabbitMQ's labels:
//   setup BASE1 BASE2 BASE3: on broker 1, Admin > Policies > "Add / update
//     a policy" (ha-mode all, ha-sync-mode automatic); Queues > "Add a new
//     queue", durable; the queue seen mirrored and synchronised from
//     brokers 2 and 3; then #/queues/%2F/ha-queue-demo > "Publish message".
//   get BASE3 [frozen]: once brokers 1 and 2 are switched off, broker 3's
//     #/queues/%2F/ha-queue-demo > "Get Message(s)" shows the message (a
//     user clicks again while the queue is taken over). With `frozen`
//     (brokers 1 and 2 stopped, not gone: broker 3 waits out the failure
//     timeout before it takes the queue over) the page must first show
//     the queue down, its master unknown and the 1 message its replica
//     last had, never 0. Either way the mirrors on brokers 1 and 2 end
//     up shown down.
// Each page opens in a browser context of its own (a fresh browser, as a
// user on another machine) and logs in. Exit 0 and a last line "ok".
const { chromium } = require('playwright-core');

const [phase, ...bases] = process.argv.slice(2);
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const QUEUE = 'ha-queue-demo';
const MESSAGE = 'hello world HA-MESSAGE';
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// A new page at `url` in a context of its own, logged in as guest: the
// page asked for, not the overview.
async function open(browser, url) {
  const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
  page.setDefaultTimeout(30000);
  await page.goto(url);
  await page.fill('#user', 'guest');
  await page.fill('#pass', 'guest');
  await page.click('#login button[type=submit]');
  return page;
}

async function setup(browser, [b1, b2, b3]) {
  const page = await open(browser, b1 + '/#/policies');
  await page.click('nav a:text("Admin")');
  await page.click('nav.sub a:text("Policies")');
  await page.waitForSelector('h2:text("Add / update a policy")');
  await page.fill('#p-name', QUEUE);
  await page.fill('#p-pattern', '^ha-');
  await page.selectOption('#p-apply', 'queues');
  await page.fill('#p-priority', '0');
  await page.selectOption('#p-mode', 'all');
  await page.selectOption('#p-sync', 'automatic');
  await page.click('#policy-form button[type=submit]');
  await page.waitForSelector(`#policies tr[data-policy="${QUEUE}"]`);
  console.log('broker 1: policy added');

  await page.click('nav a:text("Queues")');
  await page.click('h2:text("Add a new queue")');
  await page.selectOption('#new-type', 'classic');
  await page.fill('#new-queue', QUEUE);
  await page.selectOption('#new-durable', 'true');
  await page.click('#add-queue button[type=submit]');
  await page.waitForSelector('#queues-msg.ok');
  console.log('broker 1: durable queue added');

  for (const [n, base] of [[2, b2], [3, b3]]) {
    const other = await open(browser, base + '/#/queues');
    await other.waitForFunction((q) => {
      const row = document.querySelector(`#queues tr[data-queue="${q}"]`);
      return row && row.querySelectorAll('td:nth-child(3) .pill.ok').length === 2;
    }, QUEUE);
    console.log(`broker ${n}: ${QUEUE} mirrored on two synchronised mirrors`);
    await other.close();
  }

  const queue = await open(browser, b1 + '/#/queues/%2F/' + QUEUE);
  await queue.waitForSelector('h2:text("Publish message")');
  await queue.fill('#pub-payload', MESSAGE);
  await queue.click('#publish button[type=submit]');
  await queue.waitForSelector('#publish-msg.ok');
  console.log('broker 1: message published');
}

async function get(browser, [b3, frozen]) {
  const page = await open(browser, b3 + '/#/queues/%2F/' + QUEUE);
  await page.waitForSelector('h2:text("Get messages")');
  if (frozen) {
    // One look at the page as drawn (a refresh may redraw it meanwhile).
    const seen = await page.waitForFunction(() => {
      const d = document.getElementById('queue-details');
      const down = [...(d?.querySelectorAll('h1 .pill.bad') || [])].some((e) => e.textContent === 'down');
      if (!down) return null;
      const master = d.querySelector('.card .pill.bad');
      return { ready: document.getElementById('q-ready').textContent.trim(), master: master ? master.textContent : null };
    }, null, { timeout: 15000 }).then((h) => h.jsonValue());
    if (seen.ready !== '1*') throw new Error(`during the takeover broker 3 shows ${seen.ready} ready, not the last known 1*`);
    if (seen.master !== 'master unknown') throw new Error(`during the takeover the master shown is ${seen.master}`);
    console.log('broker 3: the queue is down, master unknown, 1* ready (as its replica last applied)');
  }
  const until = Date.now() + 60000;
  for (;;) {
    await page.selectOption('#get-mode', 'ack_requeue_false');
    await page.click('#get button[type=submit]');
    const shown = await page.waitForSelector('#got table.got pre.payload, #got .msg', { timeout: 30000 });
    const text = await shown.textContent();
    if (await shown.evaluate((e) => e.classList.contains('payload'))) {
      if (text !== MESSAGE) throw new Error(`got ${JSON.stringify(text)}`);
      console.log('broker 3: got ' + text);
      // The switched-off brokers' mirrors are shown down, not as mirrors
      // merely catching up.
      await page.waitForFunction(() => {
        const pills = [...document.querySelectorAll('#queue-details .card .pill.bad')];
        return pills.filter((p) => p.textContent.endsWith(' down')).length === 2;
      }, null, { timeout: 30000 });
      console.log('broker 3: the mirrors on brokers 1 and 2 shown down');
      return;
    }
    // While it is taken over the queue answers an error, never "empty".
    if (text.includes('empty')) throw new Error('broker 3 answered: ' + text);
    if (Date.now() > until) throw new Error('no message on broker 3 within 60 s: ' + text);
    console.log('broker 3: ' + text + ' (clicking again)');
    await page.evaluate(() => { document.getElementById('got').innerHTML = ''; });
    await sleep(1000);
  }
}

(async () => {
  const browser = await chromium.launch({ executablePath: CHROMIUM, args: ['--no-sandbox'] });
  if (phase === 'setup') await setup(browser, bases);
  else if (phase === 'get') await get(browser, bases);
  else throw new Error('usage: node tutorial.js setup BASE1 BASE2 BASE3 | get BASE3 [frozen]');
  await browser.close();
  console.log('ok');
})().catch((e) => { console.error(String(e && e.stack || e)); process.exit(1); });
