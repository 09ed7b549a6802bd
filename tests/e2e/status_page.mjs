// The router's status page (GET /) in headless Chromium against a real `pdserve up` with an API
// key, driven over the DevTools protocol with node's own WebSocket (no npm packages): without the
// key the page shows nothing but the key prompt; with it, it lists the prefill and decode workers,
// draws its charts from /metrics, streams a chat answer, and logs no console error (but the 401
// of the keyless check). Checks read the DOM, never pixels. Waits are on DOM conditions (with a
// deadline), never fixed sleeps.
//
// Usage: node --experimental-websocket status_page.mjs --pdserve BIN [--chromium BIN]
// Exit: 0 pass, 1 fail, 77 skip (no chromium).
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import readline from 'node:readline';

const argv = process.argv.slice(2);
const arg = (name, fallback) => {
  const i = argv.indexOf(name);
  return i >= 0 ? argv[i + 1] : fallback;
};
const pdserve = arg('--pdserve');
const chromium = arg('--chromium', '/usr/bin/chromium');
if (!pdserve) {
  console.error('usage: status_page.mjs --pdserve BIN [--chromium BIN]');
  process.exit(2);
}
if (!existsSync(chromium)) {
  console.log(`SKIP: ${chromium} not found (scripts/install-deps.sh installs chromium)`);
  process.exit(77);
}
if (typeof WebSocket !== 'function') {
  console.error('node has no WebSocket: run it with --experimental-websocket (node >= 20.10)');
  process.exit(2);
}

const tmp = mkdtempSync(join(tmpdir(), 'pd-status-page-'));
const children = [];
let failed = false;
const fail = (msg) => {
  failed = true;
  console.error('FAIL: ' + msg);
};

// Resolves with the first capture of `re` in a stream's lines, or rejects at the deadline.
function waitLine(stream, re, ms, what) {
  return new Promise((resolve, reject) => {
    const rl = readline.createInterface({ input: stream });
    const timer = setTimeout(() => reject(new Error(`no ${what} within ${ms} ms`)), ms);
    rl.on('line', (line) => {
      const m = re.exec(line);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    });
    rl.on('close', () => reject(new Error(`${what}: the process closed its output`)));
  });
}

class Cdp {
  constructor(url) {
    this.ws = new WebSocket(url);
    this.next = 1;
    this.pending = new Map();
    this.listeners = [];
    this.ws.onmessage = (e) => {
      const msg = JSON.parse(e.data);
      if (msg.id && this.pending.has(msg.id)) {
        const { resolve, reject } = this.pending.get(msg.id);
        this.pending.delete(msg.id);
        if (msg.error) reject(new Error(msg.error.message));
        else resolve(msg.result);
      } else if (msg.method) {
        for (const l of this.listeners) l(msg);
      }
    };
  }
  open() {
    return new Promise((resolve, reject) => {
      this.ws.onopen = resolve;
      this.ws.onerror = () => reject(new Error('DevTools websocket failed'));
    });
  }
  send(method, params = {}) {
    const id = this.next++;
    this.ws.send(JSON.stringify({ id, method, params }));
    return new Promise((resolve, reject) => this.pending.set(id, { resolve, reject }));
  }
  async evaluate(expression) {
    const r = await this.send('Runtime.evaluate', { expression, returnByValue: true, awaitPromise: true });
    if (r.exceptionDetails) throw new Error(`${expression}: ${r.exceptionDetails.text}`);
    return r.result.value;
  }
  // Polls `expression` until it is truthy; its last value on the deadline is in the error.
  async waitFor(expression, ms, what) {
    const end = Date.now() + ms;
    let last;
    while (Date.now() < end) {
      last = await this.evaluate(expression);
      if (last) return last;
      await new Promise((r) => setTimeout(r, 200));
    }
    throw new Error(`${what}: not true within ${ms} ms (last ${JSON.stringify(last)})`);
  }
}

async function main() {
  const key = 'sk-status-page-test-' + process.pid;
  writeFileSync(join(tmp, 'keys'), key + '\n', { mode: 0o600 });
  const up = spawn(pdserve, ['up', '--router.port=0', '--log.level=warn', `--model.cache_dir=${join(tmp, 'cache')}`,
                             '--router.health_interval_ms=300', `--router.api_keys_file=${join(tmp, 'keys')}`],
                   { stdio: ['ignore', 'pipe', 'inherit'] });
  children.push(up);
  const router = await waitLine(up.stdout, /^PDSERVE_READY role=up url=(\S+)/, 300000, 'PDSERVE_READY from pdserve up');
  up.stdout.resume();
  console.log(`router at ${router}`);

  // The page and its script come from the binary, with a policy that allows this origin only.
  const page = await fetch(router + '/');
  if (page.status !== 200 || !(page.headers.get('content-type') || '').startsWith('text/html')) {
    fail(`GET / answered ${page.status} ${page.headers.get('content-type')}`);
  }
  if (!(page.headers.get('content-security-policy') || '').includes("script-src 'self'")) {
    fail('GET / has no Content-Security-Policy limiting scripts to this origin');
  }
  const html = await page.text();
  if (/https?:\/\/(?!127\.0\.0\.1)/.test(html)) fail('the page references another origin');

  const chromeArgs = ['--headless=new', '--disable-gpu', '--no-first-run', '--no-default-browser-check',
                      '--remote-debugging-port=0', `--user-data-dir=${join(tmp, 'chrome')}`, 'about:blank'];
  if (process.getuid && process.getuid() === 0) chromeArgs.unshift('--no-sandbox');
  const browser = spawn(chromium, chromeArgs, { stdio: ['ignore', 'ignore', 'pipe'] });
  children.push(browser);
  const wsUrl = await waitLine(browser.stderr, /DevTools listening on (ws:\/\/\S+)/, 60000, 'the DevTools endpoint');
  browser.stderr.resume();
  const port = new URL(wsUrl).port;
  const targets = await (await fetch(`http://127.0.0.1:${port}/json/list`)).json();
  const target = targets.find((t) => t.type === 'page');
  if (!target) throw new Error('no page target in ' + JSON.stringify(targets));

  const cdp = new Cdp(target.webSocketDebuggerUrl);
  await cdp.open();
  const consoleErrors = [];
  cdp.listeners.push((msg) => {
    if (msg.method === 'Runtime.consoleAPICalled' && (msg.params.type === 'error' || msg.params.type === 'assert')) {
      consoleErrors.push('console.' + msg.params.type + ': ' + msg.params.args.map((a) => a.value ?? a.description).join(' '));
    } else if (msg.method === 'Runtime.exceptionThrown') {
      consoleErrors.push('exception: ' + (msg.params.exceptionDetails.exception?.description ||
                                          msg.params.exceptionDetails.text));
    } else if (msg.method === 'Log.entryAdded' && msg.params.entry.level === 'error') {
      consoleErrors.push(`log (${msg.params.entry.source}): ${msg.params.entry.text} ${msg.params.entry.url || ''}`);
    }
  });
  await cdp.send('Runtime.enable');
  await cdp.send('Log.enable');
  await cdp.send('Page.enable');
  await cdp.send('Page.navigate', { url: router + '/' });

  await cdp.waitFor(`document.readyState === 'complete' && document.title === 'pdserve status'`, 30000, 'page load');
  // Without the key: the prompt, and nothing else.
  await cdp.waitFor(`document.getElementById('notice').textContent.includes('API key')`, 30000, 'the key prompt');
  if (!(await cdp.evaluate(`document.getElementById('main').hidden &&
                             document.querySelectorAll('#workers tr.worker').length === 0`))) {
    fail('the page shows its panels before the API key was given');
  }
  // The refused keyless check is the one console error expected.
  const refused = consoleErrors.filter((e) => e.includes('401') && e.includes('/v1/models'));
  if (refused.length !== 1) fail('expected one 401 from /v1/models, got: ' + JSON.stringify(consoleErrors));
  consoleErrors.length = 0;
  await cdp.evaluate(`(() => { document.getElementById('api-key').value = ${JSON.stringify(key)};
                               document.getElementById('key-form').requestSubmit(); return true; })()`);
  await cdp.waitFor(`!document.getElementById('main').hidden`, 30000, 'the page shows its panels with the key');
  if (await cdp.evaluate(`document.body.innerText.includes(${JSON.stringify(key)})`)) fail('the page shows the key');
  const roles = await cdp.waitFor(
      `(() => { const r = [...document.querySelectorAll('#workers tr.worker')].map((t) => t.dataset.role);
                return r.includes('prefill') && r.includes('decode') && r; })()`,
      60000, 'the workers table lists a prefill and a decode worker');
  console.log(`workers listed: ${roles.join(', ')}`);
  await cdp.waitFor(
      `(() => { const rows = [...document.querySelectorAll('#workers tr.worker')];
                return rows.length > 0 && rows.every((t) => t.children[2].textContent === 'in'); })()`,
      60000, 'every worker in rotation');
  await cdp.waitFor(`Number(document.getElementById('chart-rate').dataset.points) >= 2`, 30000, 'the request chart');

  await cdp.evaluate(`(() => { document.getElementById('chat-input').value = 'Hello, who are you?';
                               document.getElementById('chat-form').requestSubmit(); return true; })()`);
  const state = await cdp.waitFor(
      `(() => { const a = document.querySelector('.msg.assistant');
                return a && a.dataset.state !== 'streaming' && a.dataset.state; })()`,
      120000, 'the streamed chat answer');
  const answer = await cdp.evaluate(`document.querySelector('.msg.assistant .text').textContent`);
  const chunks = await cdp.evaluate(`Number(document.querySelector('.msg.assistant').dataset.chunks || 0)`);
  console.log(`chat answer (${state}, ${chunks} chunks): ${JSON.stringify(answer)}`);
  if (state !== 'done') fail(`the chat ended in state ${state}: ${answer}`);
  if (!answer || chunks < 1) fail('the chat answer is empty');
  // The request shows up in the charts' next polls: TTFT gets a value.
  await cdp.waitFor(
      `(() => { const c = document.getElementById('chart-ttft'); return Number(c.dataset.points) >= 3; })()`,
      30000, 'the TTFT chart keeps updating');

  if (consoleErrors.length) fail('console errors:\n  ' + consoleErrors.join('\n  '));
  cdp.ws.close();
}

let code = 0;
try {
  await main();
  code = failed ? 1 : 0;
} catch (e) {
  console.error('FAIL: ' + (e.stack || e));
  code = 1;
} finally {
  for (const child of children.reverse()) {
    if (child.exitCode === null && child.signalCode === null) {
      const exited = new Promise((r) => child.once('exit', r));
      child.kill('SIGTERM');
      await Promise.race([exited, new Promise((r) => setTimeout(r, 60000))]);
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
    }
  }
  rmSync(tmp, { recursive: true, force: true });
}
if (code === 0) console.log('PASS: status page');
process.exit(code);
