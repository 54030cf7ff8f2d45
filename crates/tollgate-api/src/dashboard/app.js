// The tollgate operations dashboard: polls /admin/overview every second and
// renders it. No library, no network beyond this api. Every value from the
// server is written with textContent, never as HTML.
'use strict';

// The page's own errors, kept for the status line (and read by the browser test).
window.tollgateErrors = window.tollgateErrors || [];
window.addEventListener('error', (e) => window.tollgateErrors.push(String(e.message)));
window.addEventListener('unhandledrejection', (e) => window.tollgateErrors.push(String(e.reason)));
document.addEventListener('securitypolicyviolation', (e) =>
  window.tollgateErrors.push('CSP: ' + e.violatedDirective));

const POLL_MS = 1000;
let listedOnOpen = false;
const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells) {
  const tr = document.createElement('tr');
  for (const c of cells) tr.appendChild(c instanceof Node ? c : el('td', c));
  return tr;
}

function num(v, digits) {
  return el('td', v === null || v === undefined ? '–' : Number(v).toFixed(digits || 0), 'num');
}

// Amounts as the api writes them: an integer of tokens, or with a currency
// an exact decimal string of it ("0.00015"), shown as written (never through
// a float) with its code.
function amountText(v, currency) {
  if (v === null || v === undefined) return '–';
  return typeof v === 'string' ? v + ' ' + (currency || '') : String(v);
}

function amountCell(v, currency) {
  return el('td', amountText(v, currency), 'num');
}

// What a charge is (a job's settled charge once its settle changed it), with
// what was reserved beside it when that differs.
function chargeCell(c, currency) {
  const td = amountCell(c.cost, currency);
  if (c.reserved !== undefined && c.reserved !== null) {
    td.title = 'reserved ' + amountText(c.reserved, currency);
    td.appendChild(el('span', ' (reserved ' + amountText(c.reserved, currency) + ')', 'muted'));
  }
  return td;
}

// A decimal string of money (at most 6 places) in micro-units, as a BigInt;
// an integer of tokens as one.
function minor(v) {
  if (typeof v !== 'string') return BigInt(v || 0);
  const [whole, frac = ''] = v.split('.');
  return BigInt(whole) * 1000000n + BigInt((frac + '000000').slice(0, 6));
}

function show(id) {
  for (const s of ['login', 'disabled', 'app']) $(s).hidden = s !== id;
  $('logout').hidden = id !== 'app';
}

function loginMessage() {
  const q = new URLSearchParams(location.search).get('login');
  const msg = $('login-error');
  if (q === 'failed') msg.textContent = 'Wrong token.';
  else if (q === 'limited') msg.textContent = 'Too many failed logins from this address: wait a moment.';
  msg.hidden = !msg.textContent;
}

function fill(tbody, rows, empty, width) {
  tbody.replaceChildren(...rows);
  if (!rows.length) {
    const td = el('td', empty, 'empty');
    td.colSpan = width;
    tbody.appendChild(row([td]));
  }
}

function renderRoles(roles) {
  const parts = roles.embedded
    ? ['embedded: api, worker and throttle run in this one process']
    : ['workers alive: ' + (roles.workers ?? 0), 'throttlers alive: ' + (roles.throttlers ?? 0)];
  $('roles').textContent = parts.join(' · ');
  $('roles').className = !roles.embedded && (!roles.workers || !roles.throttlers) ? 'error' : '';
}

function renderProviders(providers) {
  const rows = providers.map((p) => {
    const tr = row([
      el('td', p.provider),
      num(p.rate, 2), num(p.burst),
      p.paused_ms > 0
        ? el('td', 'paused ' + (p.paused_ms / 1000).toFixed(1) + ' s', 'num error')
        : num(p.tokens, 1),
      num(p.waiters),
      num(p.grants_per_sec, 2), num(p.grants_last_minute),
      el('td', p.p95_wait_ms === null ? '–' : p.p95_wait_ms.toFixed(1) + ' ms', 'num'),
      num(p.throttlers),
      el('td', Number(p.effective_rate ?? p.rate).toFixed(2), p.effective_rate < p.rate ? 'num error' : 'num'),
    ]);
    tr.dataset.provider = p.provider;
    tr.dataset.grantsMinute = String(p.grants_last_minute);
    return [tr, ...(p.members || []).map((m) => memberRow(p, m))];
  }).flat();
  fill($('providers').tBodies[0], rows, 'no providers configured', 10);
}

// A pool member's sub-row: its own request bucket, pause and grants (its
// grants /s over the overviews of the last minute; its grants as the
// pool's choice counts them); its slots held in the throttlers column.
function memberRow(p, m) {
  const bucket = (m.limits || [])[0] || { rate: 0, burst: 0, available: 0 };
  const perSec = (p.member_grants_per_sec || {})[m.member];
  const tr = row([
    el('td', '↳ ' + m.member, 'member'),
    num(bucket.rate, 2), num(bucket.burst),
    m.paused_ms > 0
      ? el('td', 'paused ' + (m.paused_ms / 1000).toFixed(1) + ' s', 'num error')
      : num(bucket.available, 1),
    el('td', '', 'num'),
    el('td', perSec === undefined ? '–' : perSec.toFixed(2), 'num'),
    num(m.grants),
    el('td', '', 'num'),
    el('td', m.in_flight ? m.in_flight + ' in flight' : '', 'num'),
    num(m.effective_rate, 2),
  ]);
  tr.className = 'member';
  // Not data-provider: the provider's own row is the one per provider.
  tr.dataset.pool = p.provider;
  tr.dataset.member = m.member;
  tr.dataset.paused = String(m.paused_ms > 0);
  return tr;
}

// --- the last hour (GET /admin/history) ---------------------------------
// The page keeps the points it has read and asks only for newer ones.
const hist = { points: [], interval_ms: 10000, span_ms: 3600 * 1000, now_ms: 0, last: 0 };
const HISTORY_POLL_MS = 5000;

async function pollHistory() {
  try {
    const newest = hist.points.length ? hist.points[hist.points.length - 1].at_ms : null;
    const url = '/admin/history' + (newest === null ? '' : '?after_ms=' + newest);
    const r = await fetch(url, { credentials: 'same-origin', cache: 'no-store' });
    if (r.ok) {
      const h = await r.json();
      hist.interval_ms = h.interval_ms;
      hist.span_ms = h.span_ms;
      hist.now_ms = h.now_ms;
      hist.points.push(...h.points);
      const from = h.now_ms - h.span_ms;
      while (hist.points.length && hist.points[0].at_ms < from) hist.points.shift();
      renderHistory();
    }
  } catch (err) {
    window.tollgateErrors.push('history: ' + err.message);
  }
  setTimeout(pollHistory, Math.min(HISTORY_POLL_MS, Math.max(1000, hist.interval_ms)));
}

// The series of one chart: [label, color, point -> value or null].
function charts() {
  const per = 'per ' + (hist.interval_ms / 1000) + ' s interval';
  const out = [
    ['calls and budget denials (429), ' + per, 'all', [
      ['calls', '#2f6fde', (p) => p.calls],
      ['denials', '#c9372c', (p) => p.denials],
    ]],
    ['jobs queued and running, workers alive (at each sample)', 'queues', [
      ['queued', '#2f6fde', (p) => p.queued],
      ['running', '#237a3b', (p) => p.running],
      ['workers', '#c9372c', (p) => p.workers],
    ]],
  ];
  const providers = new Set();
  for (const p of hist.points) for (const name of Object.keys(p.providers || {})) providers.add(name);
  for (const name of [...providers].sort()) {
    const of = (p) => (p.providers || {})[name];
    out.push([name + ': grants/s, waiters, and non-2xx answers ' + per, 'provider:' + name, [
      ['grants/s', '#2f6fde', (p) => of(p) ? of(p).grants_per_sec : null],
      ['waiters', '#c9372c', (p) => of(p) ? of(p).waiters : null],
      ['non-2xx answers', '#b7791f', (p) => {
        const a = of(p) && of(p).answers;
        return a ? (a['4xx'] || 0) + (a['429'] || 0) + (a['5xx'] || 0) + (a.timeout || 0) : null;
      }],
    ]]);
  }
  return out;
}

function renderHistory() {
  const box = $('charts');
  const now = hist.now_ms || Date.now();
  let drawn = 0;
  for (const [title, key, series] of charts()) {
    let card = box.querySelector('[data-chart="' + CSS.escape(key) + '"]');
    if (!card) {
      card = el('div', null, 'chart');
      card.dataset.chart = key;
      card.appendChild(el('h3', title));
      card.appendChild(document.createElement('canvas'));
      card.appendChild(el('div', null, 'axis'));
      const legend = el('div', null, 'legend');
      for (const [label, color] of series) {
        const span = el('span', '— ' + label + ' ');
        span.style.color = color;
        legend.appendChild(span);
      }
      card.appendChild(legend);
      box.appendChild(card);
    }
    card.querySelector('h3').textContent = title; // the interval is known after the first read
    const stats = draw(card.querySelector('canvas'), series, now);
    axisLabels(card.querySelector('.axis'), stats);
    card.dataset.points = String(stats.points);
    card.dataset.gaps = String(stats.gaps);
    card.dataset.fromMs = String(stats.from);
    card.dataset.ticks = String(stats.ticks);
    drawn += 1;
  }
  const n = hist.points.length;
  $('history-note').textContent = n
    ? '· ' + n + ' sample(s), every ' + (hist.interval_ms / 1000) + ' s'
    : '· no sample yet';
  document.body.dataset.historyPoints = String(n);
  document.body.dataset.historyOldest = n ? String(hist.points[0].at_ms) : '';
  document.body.dataset.historyNewest = n ? String(hist.points[n - 1].at_ms) : '';
  document.body.dataset.historyCharts = String(drawn);
}

// The steps a time axis may tick at, smallest first.
const TICK_STEPS = [10e3, 30e3, 60e3, 120e3, 300e3, 600e3, 900e3, 1800e3];
const AXIS = 4; // px under the lines for the tick marks

// The time axis's labels, as text under the canvas (readable, selectable),
// each at its tick: from the left edge at the axis's start to the right edge
// at now.
function axisLabels(box, stats) {
  const spans = stats.tickTimes.map((t) => {
    const label = new Date(t).toLocaleTimeString([], stats.step < 60e3
      ? { hour: '2-digit', minute: '2-digit', second: '2-digit' }
      : { hour: '2-digit', minute: '2-digit' });
    const pct = ((t - stats.from) / Math.max(1, stats.now - stats.from)) * 100;
    const span = el('span', label);
    span.style.left = pct.toFixed(2) + '%';
    span.style.transform = 'translateX(-' + pct.toFixed(2) + '%)';
    span.dataset.atMs = String(t);
    return span;
  });
  box.replaceChildren(...spans);
}

// Lines over the samples there are (from the oldest, at least the last
// minute, at most the hour the server keeps: the first minutes after a start
// fill the width, not its right edge), each scaled to its own maximum, over a
// time axis; a line breaks where a slot has no sample (or a count is unknown
// after one): a gap is drawn as a gap, never bridged.
function draw(canvas, series, now) {
  const span = hist.span_ms;
  const gapAfter = hist.interval_ms * 1.5;
  const pts = hist.points;
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 260, h = canvas.clientHeight || 90;
  canvas.width = Math.round(w * ratio);
  canvas.height = Math.round(h * ratio);
  const ctx = canvas.getContext('2d');
  let gaps = 0;
  for (let i = 1; i < pts.length; i++) if (pts[i].at_ms - pts[i - 1].at_ms > gapAfter) gaps += 1;
  const oldest = pts.length ? pts[0].at_ms : now;
  const from = Math.max(now - span, Math.min(oldest, now - 60e3));
  const step = TICK_STEPS.find((s) => (now - from) / s <= 4) || 3600e3;
  const ticks = [];
  for (let t = Math.ceil(from / step) * step; t <= now; t += step) ticks.push(t);
  const stats = { points: pts.length, gaps, from, now, step, ticks: ticks.length, tickTimes: ticks };
  if (!ctx) return stats;
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, w, h);
  const x = (at) => ((at - from) / Math.max(1, now - from)) * w;
  const base = h - AXIS;
  ctx.strokeStyle = '#dde1e8';
  ctx.beginPath();
  ctx.moveTo(0, base - 0.5); ctx.lineTo(w, base - 0.5);
  ctx.stroke();
  ctx.fillStyle = '#677287';
  for (const t of ticks) ctx.fillRect(Math.min(x(t), w - 1), base, 1, 3);
  series.forEach(([, color, value], n) => {
    const values = pts.map(value);
    const max = Math.max(1, ...values.filter((v) => v !== null && v !== undefined));
    const y = (v) => base - 2 - (v / max) * (base - 8);
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = 1.5;
    let prev = null;
    pts.forEach((p, i) => {
      const v = values[i];
      if (v === null || v === undefined) { prev = null; return; }
      const joined = prev !== null && p.at_ms - pts[prev].at_ms <= gapAfter;
      if (joined) {
        ctx.beginPath();
        ctx.moveTo(x(pts[prev].at_ms), y(values[prev]));
        ctx.lineTo(x(p.at_ms), y(v));
        ctx.stroke();
      } else {
        ctx.fillRect(x(p.at_ms) - 1, y(v) - 1, 2, 2);
      }
      prev = i;
    });
    ctx.font = '10px system-ui, sans-serif';
    ctx.fillText('max ' + (Number.isInteger(max) ? max : max.toFixed(2)), 4 + n * 70, 10);
  });
  return stats;
}

const CLASSES = ['2xx', '4xx', '429', '5xx', 'timeout'];

// Per provider: the upstream's answers by class, and whether its bucket is
// paused (after a refusal) or refills below its rate (adaptive).
function renderAnswers(providers) {
  const rows = providers.map((p) => {
    const answers = p.answers || {};
    const cells = CLASSES.map((c) => {
      const td = num(answers[c] || 0);
      if (c !== '2xx' && answers[c] > 0) td.classList.add('error');
      td.dataset.class = c;
      return td;
    });
    let state = 'normal';
    if (p.paused_ms > 0) state = 'paused ' + (p.paused_ms / 1000).toFixed(1) + ' s';
    else if (p.effective_rate < p.rate) state = 'slowed to ' + p.effective_rate.toFixed(2) + ' /s';
    const tr = row([el('td', p.provider), ...cells, el('td', state, state === 'normal' ? '' : 'error')]);
    tr.dataset.provider = p.provider;
    for (const c of CLASSES) tr.dataset['a' + c] = String(answers[c] || 0);
    tr.dataset.state = state;
    return tr;
  });
  fill($('answers').tBodies[0], rows, 'no providers configured', 7);
}

function renderDenials(denials, users) {
  const rows = denials.map((d) => {
    const tr = row([el('td', d.operation), num(d.recent), num(d.total)]);
    tr.dataset.operation = d.operation;
    tr.dataset.recent = String(d.recent);
    if (d.recent > 0) tr.className = 'error';
    return tr;
  });
  fill($('denials').tBodies[0], rows, 'no operations configured', 3);
  const urows = users.map((u) => {
    const tr = row([el('td', u.user), num(u.denials), el('td', u.operations.join(', ')),
      el('td', new Date(u.last_ms).toLocaleTimeString())]);
    tr.dataset.user = u.user;
    tr.dataset.denials = String(u.denials);
    return tr;
  });
  fill($('most-denied').tBodies[0], urows, 'nobody denied in the last hour', 4);
}

// Budget alerts ([alerts] configured): every deliverer's attempts, what
// waits in the outboxes, and the last failure.
function renderAlerts(a) {
  const panel = $('alerts-panel');
  panel.hidden = !a;
  if (!a) return;
  const failure = a.last_failure
    ? new Date(a.last_failure_ms).toLocaleTimeString() + ': ' + a.last_failure
    : '';
  const tr = row([num(a.delivered), num(a.retried), num(a.failed), num(a.waiting_subjects),
    el('td', a.overdue_ms ? (a.overdue_ms / 1000).toFixed(1) + ' s' : '', 'num'), el('td', failure)]);
  tr.dataset.delivered = String(a.delivered);
  tr.dataset.failed = String(a.failed);
  if (a.failed > 0 || a.overdue_ms > 60000) tr.className = 'error';
  fill($('alerts').tBodies[0], [tr], '', 6);
}

function renderQueues(queues) {
  const rows = queues.map((q) => {
    const tr = row([el('td', q.operation), num(q.queued), num(q.running), num(q.dead), num(q.workers)]);
    tr.dataset.operation = q.operation;
    if (q.dead > 0) tr.className = 'error';
    return tr;
  });
  fill($('queues').tBodies[0], rows, 'no operations configured', 5);
}

function renderTopUsers(users, currency) {
  const rows = users.map((u) => {
    const bar = el('div', null, 'bar');
    const fillDiv = el('div');
    // In exact integers (per mille): only the bar's width is a float.
    const limit = minor(u.limit);
    const permille = limit > 0n ? minor(u.used) * 1000n / limit : 0n;
    const share = Math.min(1, Number(permille) / 1000);
    fillDiv.style.width = (share * 100).toFixed(1) + '%';
    if (share >= 1) bar.classList.add('full');
    bar.appendChild(fillDiv);
    const barCell = el('td');
    barCell.appendChild(bar);
    const tr = row([el('td', u.user), el('td', u.custom_limits ? u.plan + ' (own limits)' : u.plan), el('td', typeof u.used === 'string' ? u.used + ' / ' + u.limit + ' ' + currency : u.used + ' / ' + u.limit, 'num'), barCell,
      el('td', u.resets_at ? u.period + ', resets ' + u.resets_at
        : u.window_secs >= 3600 ? (u.window_secs / 3600).toFixed(1) + ' h' : u.window_secs + ' s')]);
    tr.dataset.user = u.user;
    return tr;
  });
  fill($('top-users').tBodies[0], rows, 'no spend seen yet', 5);
}

function renderEvents(events, currency) {
  const rows = events.map((e) => {
    const tr = row([
      el('td', new Date(e.at_ms).toLocaleTimeString()),
      el('td', e.service_key ? `${e.user} (via ${e.service_key})` : e.user),
      el('td', e.operation ?? '(plain reserve)'),
      chargeCell(e, currency),
      el('td', e.request_id, 'mono'),
      el('td', e.refunded ? 'refunded' + (e.refund_reason ? ' (' + e.refund_reason + ')' : '') : '', 'flag'),
    ]);
    tr.dataset.requestId = e.request_id;
    if (e.refund_reason) tr.dataset.reason = e.refund_reason;
    if (e.refunded) tr.className = 'refunded';
    return tr;
  });
  fill($('events').tBodies[0], rows, 'no spend events yet', 6);
}

function render(o) {
  renderRoles(o.roles);
  renderProviders(o.providers);
  renderAnswers(o.providers);
  renderDenials(o.denials, o.most_denied);
  renderAlerts(o.alerts);
  renderQueues(o.queues);
  renderTopUsers(o.top_users, o.currency);
  renderEvents(o.events, o.currency);
  const status = $('status');
  status.textContent = 'updated ' + new Date(o.now_ms).toLocaleTimeString() +
    (window.tollgateErrors.length ? ' · ' + window.tollgateErrors.length + ' script error(s)' : '');
  status.className = 'status';
  document.body.dataset.updated = String(o.now_ms);
  serverNowMs = o.now_ms;
  document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
}

// The session's CSRF token goes into the logout form (a cross-site page
// cannot read it). A Bearer-less page without a session gets 401 here.
async function loadSession() {
  try {
    const r = await fetch('/dashboard/session', { credentials: 'same-origin', cache: 'no-store' });
    if (!r.ok) return;
    const s = await r.json();
    $('csrf').value = s.csrf || '';
    $('role').textContent = s.role === 'viewer' ? 'viewer (read-only)' : s.role;
    document.body.dataset.role = s.role;
  } catch (err) {
    window.tollgateErrors.push('session: ' + err.message);
  }
}

async function poll() {
  try {
    const r = await fetch('/admin/overview', { credentials: 'same-origin', cache: 'no-store' });
    if (r.status === 401) {
      show('login');
      loginMessage();
      return; // the login form reloads the page
    }
    if (r.status === 403) {
      show('disabled');
      return;
    }
    if (!r.ok) throw new Error('overview answered ' + r.status);
    render(await r.json());
    if (!$('csrf').value) await loadSession();
    show('app');
    // The lists load on open (once logged in), without pressing List; a
    // link to a job's card (#job=<id>) opens it.
    if (!listedOnOpen) {
      listedOnOpen = true;
      listJobs();
      openFromHash();
      pollSpend();
    }
  } catch (err) {
    $('status').textContent = 'no answer from the api (' + err.message + '); retrying';
    $('status').className = 'status stale';
  }
  setTimeout(poll, POLL_MS);
}

// --- spend today (GET /admin/spend) --------------------------------------
// By model and the top spenders, from the spend report of today's UTC day
// (step=1d from today's date: one row per key). Amounts are shown as the
// server writes them (money: exact decimal strings) and ordered as BigInts
// of the micro-unit: no float ever touches money.
// A report reads every user's rollups (O(users): about 0.3 ms a user on
// Redis), so the page waits at least 20 times as long as the last read took
// before the next: a large deployment is read less often, never hammered.
const SPEND_POLL_MS = 30000;
const SPEND_PAUSE_FACTOR = 20;
const SPEND_TOP = 10;
// A report by user reads every user; the page reads at most this many pages
// of 10,000 rows, and says so when there were more.
const SPEND_PAGES = 5;
let serverNowMs = 0;

async function spendToday(by) {
  const day = new Date(serverNowMs || Date.now()).toISOString().slice(0, 10);
  const rows = [];
  let cursor = '', page = null, pages = 0;
  while (pages < SPEND_PAGES) {
    pages += 1;
    const q = new URLSearchParams({ by, step: '1d', from: day, limit: '10000' });
    if (cursor) q.set('cursor', cursor);
    page = await getJSON('/admin/spend?' + q);
    rows.push(...page.rows);
    cursor = page.next_cursor || '';
    if (!cursor) break;
  }
  // The largest first (exact), then by name; nothing spent, no row.
  const spent = rows.filter((r) => minor(r.amount) > 0n);
  spent.sort((a, b) => {
    const x = minor(a.amount), y = minor(b.amount);
    return x === y ? (a.key < b.key ? -1 : 1) : (x > y ? -1 : 1);
  });
  return { day, rows: spent, currency: page.currency, pages, complete: !cursor, total: page.total };
}

function spendRows(report, attr, name, limit) {
  return report.rows.slice(0, limit).map((r) => {
    const tr = row([el('td', name(r.key)), amountCell(r.amount, report.currency)]);
    tr.dataset[attr] = r.key;
    tr.dataset.amount = String(r.amount);
    return tr;
  });
}

async function pollSpend() {
  const started = performance.now();
  try {
    const [models, users] = await Promise.all([spendToday('model'), spendToday('user')]);
    const mrows = spendRows(models, 'model', (k) => k || '(no sheet entry: unpriced)', Infinity);
    // A single page's total is the server's; more pages would be a sum.
    if (mrows.length && models.complete && models.pages === 1) {
      const tr = row([el('td', 'total'), amountCell(models.total, models.currency)]);
      tr.className = 'total';
      tr.dataset.total = String(models.total);
      mrows.push(tr);
    }
    fill($('spend-models').tBodies[0], mrows, 'nothing spent today', 2);
    fill($('spend-users').tBodies[0], spendRows(users, 'user', (k) => k, SPEND_TOP), 'nothing spent today', 2);
    $('spend-note').textContent = '· ' + models.day + ' (UTC), in ' + models.currency +
      (users.complete ? '' : ' · top spenders among the first ' + (SPEND_PAGES * 10000) + ' rows read only');
    for (const th of document.querySelectorAll('#spend th.num')) th.textContent = 'spent today (' + models.currency + ')';
    document.body.dataset.spendRead = String(Number(document.body.dataset.spendRead || 0) + 1);
  } catch (err) {
    $('spend-note').textContent = '· the spend report failed: ' + err.message;
  }
  const pause = Math.max(SPEND_POLL_MS, SPEND_PAUSE_FACTOR * (performance.now() - started));
  $('spend-every').textContent = 'read every ' + Math.round(pause / 1000) + ' s';
  setTimeout(pollSpend, pause);
}

// --- the job browser (GET /admin/jobs, /admin/jobs/{id}) ----------------
const time = (ms) => (ms ? new Date(ms).toLocaleTimeString() : '–');

async function getJSON(url) {
  const r = await fetch(url, { credentials: 'same-origin', cache: 'no-store' });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.detail || body.title || ('answered ' + r.status));
  return body;
}

// How many rows the list asks for: 25, doubled by "Show more" (at most 100,
// the route's bound), back to 25 on a new search.
let jobLimit = 25;

async function listJobs() {
  const q = new URLSearchParams({ view: $('job-view').value, limit: String(jobLimit) });
  if ($('job-user').value.trim()) q.set('user', $('job-user').value.trim());
  if ($('job-operation').value.trim()) q.set('operation', $('job-operation').value.trim());
  const tbody = $('job-list').tBodies[0];
  try {
    const list = await getJSON('/admin/jobs?' + q);
    $('job-scope').textContent = 'From ' + list.scope + (list.more ? ' · more match' : '');
    $('job-more').hidden = !list.more || jobLimit >= 100;
    let rows;
    if (list.view === 'dead') {
      rows = list.dead.map((d) => {
        const tr = row([el('td', ''), el('td', d.entry, 'mono'), el('td', ''), el('td', d.operation),
          el('td', ''), el('td', 'dead', 'error'), el('td', d.reason)]);
        tr.dataset.id = d.entry;
        return tr;
      });
    } else {
      rows = list.rows.map((j) => {
        // The id links to its card (#job=<id>: a link that can be shared).
        const idCell = el('td', null, 'mono');
        const link = el('a', j.id);
        link.href = '#job=' + encodeURIComponent(j.id) + '&user=' + encodeURIComponent(j.user);
        idCell.appendChild(link);
        const tr = row([el('td', time(j.at_ms)), idCell, el('td', j.user), el('td', j.operation),
          chargeCell(j, list.currency), el('td', j.state + (j.cause ? ' (' + j.cause + ')' : ''), j.state === 'failed' ? 'error' : ''),
          el('td', j.refunded ? 'went back' : '')]);
        tr.dataset.id = j.id;
        tr.dataset.user = j.user;
        tr.dataset.state = j.state;
        tr.addEventListener('click', () => showJob(j.id, j.user));
        return tr;
      });
    }
    fill(tbody, rows, 'no job matches', 7);
    document.body.dataset.jobRows = String(rows.length);
  } catch (err) {
    fill(tbody, [], 'search failed: ' + err.message, 7);
  }
}

async function showJob(id, user) {
  const q = user ? '?user=' + encodeURIComponent(user) : '';
  const box = $('job-detail-body');
  $('job-detail').hidden = false;
  $('job-detail-id').textContent = id;
  try {
    const d = await getJSON('/admin/jobs/' + encodeURIComponent(id) + q);
    $('job-detail-note').textContent = d.note || '';
    box.replaceChildren(...d.jobs.map(jobCard(id)));
    $('job-detail').dataset.found = String(d.found);
    $('job-detail').dataset.id = id;
  } catch (err) {
    $('job-detail-note').textContent = 'lookup failed: ' + err.message;
    box.replaceChildren();
  }
}

function jobCard(id) {
  return (j) => {
    const card = el('div', null, 'job-card');
    const r = j.record;
    card.appendChild(el('h4', 'user ' + j.user + (r ? ' · ' + r.operation + ' · ' + r.state
      + ' · run ' + r.run : ' · record gone')));
    if (j.note) card.appendChild(el('p', j.note, 'muted note'));
    const table = document.createElement('table');
    table.className = 'timeline';
    const head = row([el('th', 'time'), el('th', 'step'), el('th', 'what')]);
    table.appendChild(head);
    for (const e of j.timeline) {
      const tr = row([el('td', time(e.at_ms)), el('td', e.step), el('td', e.what)]);
      tr.dataset.step = e.step;
      table.appendChild(tr);
    }
    card.appendChild(table);
    card.appendChild(el('p', 'charge: ' + j.charge, 'charge'));
    card.dataset.user = j.user;
    card.dataset.state = r ? r.state : 'gone';
    if (j.cancellable && document.body.dataset.role === 'admin') card.appendChild(cancelForm(id, j.user));
    return card;
  };
}

// Cancelling a queued job refunds its charge through the operator refund
// route, with the admin token typed here as Bearer: a session cookie alone
// never opens a write.
function cancelForm(id, user) {
  const form = el('form', null, 'inline cancel');
  const token = document.createElement('input');
  token.type = 'password';
  token.placeholder = 'admin token, to cancel';
  token.className = 'cancel-token';
  const button = el('button', 'Cancel job (refund its charge)');
  button.type = 'submit';
  const out = el('span', '', 'cancel-result');
  form.append(token, button, out);
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    try {
      const r = await fetch('/admin/users/' + encodeURIComponent(user) + '/refunds/' + encodeURIComponent(id), {
        method: 'POST', cache: 'no-store', credentials: 'omit',
        headers: { Authorization: 'Bearer ' + token.value },
      });
      const body = await r.json().catch(() => ({}));
      out.textContent = r.ok ? 'done: ' + (body.outcome || 'refunded') : 'refused: ' + (body.detail || r.status);
      out.className = 'cancel-result ' + (r.ok ? 'ok' : 'error');
      token.value = '';
      if (r.ok) setTimeout(() => showJob(id, user), 300);
    } catch (err) {
      out.textContent = 'failed: ' + err.message;
    }
  });
  return form;
}

$('job-search').addEventListener('submit', (ev) => { ev.preventDefault(); jobLimit = 25; listJobs(); });
$('job-more').addEventListener('click', () => { jobLimit = Math.min(100, jobLimit * 2); listJobs(); });
// A link to a job (#job=<id>&user=<user>) opens its card, on load and on click.
function openFromHash() {
  const h = new URLSearchParams(location.hash.slice(1));
  if (h.get('job')) showJob(h.get('job'), h.get('user') || '');
}
window.addEventListener('hashchange', openFromHash);
$('job-find').addEventListener('click', () => {
  const id = $('job-id').value.trim();
  if (id) showJob(id, $('job-user').value.trim());
});

poll();
pollHistory();
