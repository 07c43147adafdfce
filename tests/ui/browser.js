// Drives mirrorq's web UI in Debian's headless Chromium, as a user would:
// log in, add a policy `ha-mode: all`, add a queue, wait until it shows a
// master and two synchronised mirrors, publish a message on the queue's
// page and get it back. Usage: node browser.js BASE_URL SCREENSHOT_DIR
// Exit 0 and a last line "ok" when everything was seen.
const { chromium } = require('playwright-core');

const [base, shots] = process.argv.slice(2);
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';

(async () => {
  const browser = await chromium.launch({ executablePath: CHROMIUM, args: ['--no-sandbox'] });
  const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
  page.setDefaultTimeout(30000);
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

  await page.click('nav a[data-page=policies]');
  await page.waitForSelector('#policy-form');
  await page.fill('#p-name', 'ha-ui');
  await page.fill('#p-pattern', '^ui\\.');
  await page.selectOption('#p-mode', 'all');
  await page.selectOption('#p-sync', 'automatic');
  await page.click('#policy-form button[type=submit]');
  await page.waitForSelector('#policy-msg.ok');
  await page.waitForSelector('#policies tr[data-policy="ha-ui"]');
  console.log('policy ha-ui added');

  await page.click('nav a[data-page=queues]');
  await page.waitForSelector('#add-queue');
  await page.fill('#new-queue', 'ui.demo');
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
  await page.screenshot({ path: shots + '/queues.png' });

  await page.click('#queues a.q[href="#/queue/%2F/ui.demo"]');
  await page.waitForSelector('#publish');
  await page.fill('#pub-payload', 'hello from chromium');
  await page.click('#publish button[type=submit]');
  await page.waitForSelector('#publish-msg.ok');
  await page.selectOption('#get-mode', 'ack_requeue_false');
  await page.click('#get button[type=submit]');
  await page.waitForSelector('table.got pre.payload');
  const payload = await page.textContent('table.got pre.payload');
  if (payload !== 'hello from chromium') throw new Error(`got back ${JSON.stringify(payload)}`);
  console.log('published and got back: ' + payload);
  await page.screenshot({ path: shots + '/queue.png', fullPage: true });
  await browser.close();
  console.log('ok');
})().catch((e) => { console.error(String(e && e.stack || e)); process.exit(1); });
