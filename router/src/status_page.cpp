#include "pd/router/status_page.h"

#include <string>

namespace pd::router {
namespace {

// Only this origin; inline styles but no inline script (the script is /status.js).
constexpr std::string_view kPolicy =
    "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

constexpr std::string_view kHtml = R"pdhtml(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>pdserve status</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1d2330; background: #f5f6f8; }
  header { display: flex; gap: 1em; align-items: center; padding: .6em 1.2em; background: #1d2330; color: #fff; }
  header h1 { font-size: 1.2em; margin: 0; }
  header form { margin-left: auto; display: flex; gap: .4em; }
  main { padding: 1em 1.2em; display: grid; gap: 1em; }
  section { background: #fff; border-radius: 6px; padding: .8em 1em; box-shadow: 0 1px 2px #0002; }
  h2 { font-size: 1em; margin: 0 0 .6em; }
  table { border-collapse: collapse; width: 100%; }
  th, td { text-align: left; padding: .25em .6em; border-bottom: 1px solid #e3e5ea; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .in { color: #17803d; } .out { color: #b42318; }
  .charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(320px, 1fr)); gap: 1em; }
  figure { margin: 0; } figcaption { font-weight: 600; margin-bottom: .3em; }
  canvas { width: 100%; height: 140px; background: #fafbfc; border: 1px solid #e3e5ea; border-radius: 4px; }
  #chat-log { white-space: pre-wrap; margin-top: .6em; }
  .msg { margin: .3em 0; } .msg b { margin-right: .4em; }
  #chat-form { display: flex; gap: .4em; } #chat-input { flex: 1; }
  #notice { color: #b42318; }
</style>
</head>
<body>
<header>
  <h1>pdserve</h1><span id="model"></span><span id="notice" role="status"></span>
  <form id="key-form"><input id="api-key" type="password" placeholder="API key" autocomplete="off"
    aria-label="API key"><button type="submit">Use key</button></form>
</header>
<main id="main" hidden>
  <section>
    <h2>Workers</h2>
    <table id="workers">
      <thead><tr><th>role</th><th>worker</th><th>rotation</th><th class="num">queued</th>
        <th class="num">running</th><th class="num">KV / cache in use</th></tr></thead>
      <tbody></tbody>
    </table>
  </section>
  <section class="charts">
    <figure><figcaption>Requests / s</figcaption><canvas id="chart-rate" width="480" height="140"></canvas></figure>
    <figure><figcaption>Time to first token (s): p50, p99</figcaption><canvas id="chart-ttft" width="480" height="140"></canvas></figure>
    <figure><figcaption>Time per output token (s): p50, p99</figcaption><canvas id="chart-tpot" width="480" height="140"></canvas></figure>
    <figure><figcaption>MTP draft acceptance</figcaption><canvas id="chart-mtp" width="480" height="140"></canvas></figure>
  </section>
  <section>
    <h2>Chat</h2>
    <form id="chat-form"><input id="chat-input" placeholder="Say something" aria-label="message">
      <button id="chat-send" type="submit">Send</button></form>
    <div id="chat-log"></div>
  </section>
</main>
<script src="/status.js"></script>
</body>
</html>
)pdhtml";

constexpr std::string_view kScript = R"pdjs('use strict';
// pdserve status page: polls /metrics, draws charts, streams chat. Text goes into the DOM with
// textContent only.
const POLL_MS = 1500;
const HISTORY = 120;
const $ = (id) => document.getElementById(id);
let apiKey = sessionStorage.getItem('pdserve.key') || '';
let modelName = 'pdserve-default';
let previous = null;
const series = { rate: [[]], ttft: [[], []], tpot: [[], []], mtp: [[]] };
const chat = [];

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (apiKey) h.Authorization = 'Bearer ' + apiKey;
  return h;
}

function notice(text) { $('notice').textContent = text; }

// Prometheus text exposition -> [{name, labels, value}].
function parseMetrics(text) {
  const out = [];
  for (const line of text.split('\n')) {
    if (!line || line[0] === '#') continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    if (m[3]) {
      const re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
      let l;
      while ((l = re.exec(m[3])) !== null) labels[l[1]] = l[2].replace(/\\n/g, '\n').replace(/\\(.)/g, '$1');
    }
    out.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return out;
}

function sum(samples, name, filter) {
  let s = 0;
  for (const x of samples) if (x.name === name && (!filter || filter(x.labels))) s += x.value;
  return s;
}

// Cumulative bucket counts by upper bound, summed over every child.
function buckets(samples, name) {
  const by = new Map();
  for (const x of samples) {
    if (x.name !== name + '_bucket') continue;
    const le = x.labels.le === '+Inf' ? Infinity : Number(x.labels.le);
    by.set(le, (by.get(le) || 0) + x.value);
  }
  return [...by.entries()].sort((a, b) => a[0] - b[0]);
}

// histogram_quantile over the increase between two scrapes (or since start when nothing new).
function quantile(q, now, before) {
  let b = now;
  if (before) {
    const prev = new Map(before);
    const delta = now.map(([le, c]) => [le, c - (prev.get(le) || 0)]);
    if (delta.length && delta[delta.length - 1][1] > 0) b = delta;
  }
  if (!b.length) return null;
  const total = b[b.length - 1][1];
  if (!(total > 0)) return null;
  const rank = q * total;
  let lowerBound = 0, lowerCount = 0;
  for (const [le, c] of b) {
    if (c >= rank) {
      if (le === Infinity) return lowerBound;
      return lowerBound + (le - lowerBound) * ((rank - lowerCount) / Math.max(c - lowerCount, 1e-12));
    }
    lowerBound = le; lowerCount = c;
  }
  return lowerBound;
}

function push(list, value) {
  list.push(value);
  while (list.length > HISTORY) list.shift();
}

function draw(id, lines, format) {
  const canvas = $(id);
  const ctx = canvas.getContext('2d');
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const values = lines.flat().filter((v) => v !== null && isFinite(v));
  const max = Math.max(1e-9, ...values) * 1.15;
  ctx.strokeStyle = '#e3e5ea';
  ctx.beginPath(); ctx.moveTo(0, h - 18.5); ctx.lineTo(w, h - 18.5); ctx.stroke();
  const colors = ['#2563eb', '#d97706'];
  lines.forEach((line, i) => {
    ctx.strokeStyle = colors[i % colors.length];
    ctx.lineWidth = 2;
    ctx.beginPath();
    let started = false;
    line.forEach((v, k) => {
      if (v === null || !isFinite(v)) { started = false; return; }
      const x = (k / (HISTORY - 1)) * w;
      const y = h - 20 - (v / max) * (h - 30);
      if (started) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      started = true;
    });
    ctx.stroke();
  });
  ctx.fillStyle = '#1d2330';
  ctx.font = '12px system-ui, sans-serif';
  const last = lines.map((l) => l.length ? l[l.length - 1] : null).map((v) => v === null ? '-' : format(v));
  ctx.fillText(last.join('  /  '), 6, h - 5);
  canvas.dataset.points = String(Math.max(...lines.map((l) => l.length)));
}

function fmtSeconds(v) { return v < 1 ? (v * 1000).toFixed(1) + ' ms' : v.toFixed(2) + ' s'; }

function renderWorkers(samples) {
  const workers = new Map();
  const field = (name, key) => {
    for (const x of samples) {
      if (x.name !== name) continue;
      const id = x.labels.role + ' ' + x.labels.worker;
      if (!workers.has(id)) workers.set(id, { role: x.labels.role, worker: x.labels.worker });
      workers.get(id)[key] = x.value;
    }
  };
  field('pdserve_router_worker_in_rotation', 'in');
  field('pdserve_router_worker_queued_requests', 'queued');
  field('pdserve_router_worker_running_requests', 'running');
  field('pdserve_router_worker_kv_blocks_free', 'free');
  field('pdserve_router_worker_kv_blocks_total', 'total');
  const body = $('workers').tBodies[0];
  body.replaceChildren();
  for (const w of [...workers.values()].sort((a, b) => (a.role + a.worker).localeCompare(b.role + b.worker))) {
    const tr = document.createElement('tr');
    tr.className = 'worker';
    tr.dataset.role = w.role;
    const cell = (text, cls) => {
      const td = document.createElement('td');
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    };
    cell(w.role);
    cell(w.worker);
    cell(w.in ? 'in' : 'out', w.in ? 'in' : 'out');
    cell(String(w.queued ?? '-'), 'num');
    cell(String(w.running ?? '-'), 'num');
    cell(w.total ? (100 * (1 - w.free / w.total)).toFixed(1) + ' %' : '-', 'num');
    body.appendChild(tr);
  }
}

async function poll() {
  try {
    const r = await fetch('/metrics', { headers: headers(), cache: 'no-store' });
    if (!r.ok) throw new Error('/metrics: HTTP ' + r.status);
    const samples = parseMetrics(await r.text());
    const now = {
      t: performance.now() / 1000,
      requests: sum(samples, 'pdserve_router_requests_total', (l) => l.endpoint !== 'other'),
      ttft: buckets(samples, 'pdserve_router_time_to_first_token_seconds'),
      tpot: buckets(samples, 'pdserve_router_time_per_output_token_seconds'),
      proposed: sum(samples, 'pdserve_router_worker_mtp_drafts_proposed'),
      accepted: sum(samples, 'pdserve_router_worker_mtp_drafts_accepted'),
    };
    renderWorkers(samples);
    const p = previous;
    push(series.rate[0], p ? Math.max(0, now.requests - p.requests) / Math.max(now.t - p.t, 1e-3) : 0);
    push(series.ttft[0], quantile(0.5, now.ttft, p && p.ttft));
    push(series.ttft[1], quantile(0.99, now.ttft, p && p.ttft));
    push(series.tpot[0], quantile(0.5, now.tpot, p && p.tpot));
    push(series.tpot[1], quantile(0.99, now.tpot, p && p.tpot));
    const dp = p ? now.proposed - p.proposed : 0;
    const mtp = dp > 0 ? (now.accepted - p.accepted) / dp : (now.proposed > 0 ? now.accepted / now.proposed : null);
    push(series.mtp[0], mtp);
    previous = now;
    draw('chart-rate', series.rate, (v) => v.toFixed(2));
    draw('chart-ttft', series.ttft, fmtSeconds);
    draw('chart-tpot', series.tpot, fmtSeconds);
    draw('chart-mtp', series.mtp, (v) => (100 * v).toFixed(1) + ' %');
    notice('');
  } catch (e) {
    notice(String(e.message || e));
  }
}

function addMessage(role, text) {
  const div = document.createElement('div');
  div.className = 'msg ' + role;
  const who = document.createElement('b');
  who.textContent = role + ':';
  const body = document.createElement('span');
  body.className = 'text';
  body.textContent = text;
  div.append(who, body);
  $('chat-log').appendChild(div);
  return div;
}

async function send(text) {
  chat.push({ role: 'user', content: text });
  addMessage('user', text);
  const answer = addMessage('assistant', '');
  answer.dataset.state = 'streaming';
  const out = answer.querySelector('.text');
  $('chat-send').disabled = true;
  try {
    const r = await fetch('/v1/chat/completions', {
      method: 'POST',
      headers: headers({ 'Content-Type': 'application/json' }),
      body: JSON.stringify({ model: modelName, messages: chat, stream: true, max_tokens: 64 }),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || 'HTTP ' + r.status);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffered = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffered.indexOf('\n')) >= 0) {
        const line = buffered.slice(0, nl).trim();
        buffered = buffered.slice(nl + 1);
        if (!line.startsWith('data:')) continue;
        const data = line.slice(5).trim();
        if (data === '[DONE]') continue;
        const event = JSON.parse(data);
        if (event.error) throw new Error(event.error.message || 'stream error');
        const delta = event.choices && event.choices[0] && event.choices[0].delta;
        if (delta && delta.content) {
          out.textContent += delta.content;
          answer.dataset.chunks = String(Number(answer.dataset.chunks || 0) + 1);
        }
      }
    }
    chat.push({ role: 'assistant', content: out.textContent });
    answer.dataset.state = 'done';
  } catch (e) {
    answer.dataset.state = 'error';
    out.textContent = '[' + String(e.message || e) + ']';
  } finally {
    $('chat-send').disabled = false;
  }
}

// Shows the page once /v1/models accepts us (no key needed when the router has none).
async function authorize() {
  const r = await fetch('/v1/models', { headers: headers(), cache: 'no-store' });
  if (r.status === 401) {
    $('main').hidden = true;
    notice(apiKey ? 'API key refused' : 'This router needs an API key');
    return false;
  }
  if (!r.ok) { notice('/v1/models: HTTP ' + r.status); return false; }
  const models = await r.json();
  if (models.data && models.data[0]) modelName = models.data[0].id;
  $('model').textContent = modelName;
  $('main').hidden = false;
  notice('');
  return true;
}

let timer = null;
async function start() {
  if (!(await authorize())) return;
  if (timer === null) {
    await poll();
    timer = setInterval(poll, POLL_MS);
  }
}

$('key-form').addEventListener('submit', (e) => {
  e.preventDefault();
  apiKey = $('api-key').value.trim();
  sessionStorage.setItem('pdserve.key', apiKey);
  $('api-key').value = '';
  start();
});
$('chat-form').addEventListener('submit', (e) => {
  e.preventDefault();
  const text = $('chat-input').value.trim();
  if (!text) return;
  $('chat-input').value = '';
  send(text);
});
start();
)pdjs";

http::Response staticResponse(std::string_view content_type, std::string_view body) {
  http::Response r = http::Response::withBody(200, std::string(content_type), std::string(body));
  r.headers.push_back({"Content-Security-Policy", std::string(kPolicy)});
  r.headers.push_back({"X-Content-Type-Options", "nosniff"});
  r.headers.push_back({"Cache-Control", "no-cache"});
  return r;
}

}  // namespace

std::string_view statusPageHtml() {
  return kHtml;
}

std::string_view statusPageScript() {
  return kScript;
}

std::vector<http::Route> statusPageRoutes() {
  std::vector<http::Route> routes;
  routes.push_back({"GET", "/", [](const http::Request&, http::Exchange ex) {
                      ex.respond(staticResponse("text/html; charset=utf-8", kHtml));
                    }});
  routes.push_back({"GET", "/status.js", [](const http::Request&, http::Exchange ex) {
                      ex.respond(staticResponse("text/javascript; charset=utf-8", kScript));
                    }});
  return routes;
}

}  // namespace pd::router
