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
const HISTORY_MS = 5 * 60 * 1000;
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

function renderProviders(providers, now) {
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
    return tr;
  });
  fill($('providers').tBodies[0], rows, 'no providers configured', 10);
  const charts = $('charts');
  for (const p of providers) {
    let card = charts.querySelector('[data-chart="' + CSS.escape(p.provider) + '"]');
    if (!card) {
      card = el('div', null, 'chart');
      card.dataset.chart = p.provider;
      card.appendChild(el('h3', p.provider));
      card.appendChild(document.createElement('canvas'));
      const legend = el('div', null, 'legend');
      legend.appendChild(el('span', '— grants/s ', 'g'));
      legend.appendChild(el('span', '— waiters', 'w'));
      legend.appendChild(el('span', ' · up to the last 5 min'));
      card.appendChild(legend);
      charts.appendChild(card);
    }
    draw(card.querySelector('canvas'), p.history, now);
  }
}

// Two lines over the history (one minute at least, five at most), each
// scaled to its own maximum.
function draw(canvas, history, now) {
  const oldest = history.length ? history[0].at_ms : now;
  const span = Math.min(HISTORY_MS, Math.max(60 * 1000, now - oldest));
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 260, h = canvas.clientHeight || 90;
  canvas.width = Math.round(w * ratio);
  canvas.height = Math.round(h * ratio);
  const ctx = canvas.getContext('2d');
  if (!ctx) return;
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = '#dde1e8';
  ctx.beginPath();
  ctx.moveTo(0, h - 0.5); ctx.lineTo(w, h - 0.5);
  ctx.stroke();
  const series = [
    ['grants_per_sec', '#2f6fde'],
    ['waiters', '#c9372c'],
  ];
  for (const [key, color] of series) {
    const max = Math.max(1, ...history.map((pt) => pt[key]));
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    history.forEach((pt, i) => {
      const x = w - ((now - pt.at_ms) / span) * w;
      const y = h - 2 - (pt[key] / max) * (h - 8);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = color;
    ctx.font = '10px system-ui, sans-serif';
    ctx.fillText('max ' + (Number.isInteger(max) ? max : max.toFixed(2)), key === 'waiters' ? w - 60 : 4, 10);
  }
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

function renderQueues(queues) {
  const rows = queues.map((q) => {
    const tr = row([el('td', q.operation), num(q.queued), num(q.running), num(q.dead), num(q.workers)]);
    tr.dataset.operation = q.operation;
    if (q.dead > 0) tr.className = 'error';
    return tr;
  });
  fill($('queues').tBodies[0], rows, 'no operations configured', 5);
}

function renderTopUsers(users) {
  const rows = users.map((u) => {
    const bar = el('div', null, 'bar');
    const fillDiv = el('div');
    const share = u.limit ? Math.min(1, u.used / u.limit) : 0;
    fillDiv.style.width = (share * 100).toFixed(1) + '%';
    if (share >= 1) bar.classList.add('full');
    bar.appendChild(fillDiv);
    const barCell = el('td');
    barCell.appendChild(bar);
    const tr = row([el('td', u.user), el('td', u.plan), el('td', u.used + ' / ' + u.limit, 'num'), barCell,
      el('td', u.window_secs >= 3600 ? (u.window_secs / 3600).toFixed(1) + ' h' : u.window_secs + ' s')]);
    tr.dataset.user = u.user;
    return tr;
  });
  fill($('top-users').tBodies[0], rows, 'no spend seen yet', 5);
}

function renderEvents(events) {
  const rows = events.map((e) => {
    const tr = row([
      el('td', new Date(e.at_ms).toLocaleTimeString()),
      el('td', e.service_key ? `${e.user} (via ${e.service_key})` : e.user),
      el('td', e.operation ?? '(plain reserve)'),
      num(e.cost),
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
  renderProviders(o.providers, o.now_ms);
  renderAnswers(o.providers);
  renderDenials(o.denials, o.most_denied);
  renderQueues(o.queues);
  renderTopUsers(o.top_users);
  renderEvents(o.events);
  const status = $('status');
  status.textContent = 'updated ' + new Date(o.now_ms).toLocaleTimeString() +
    (window.tollgateErrors.length ? ' · ' + window.tollgateErrors.length + ' script error(s)' : '');
  status.className = 'status';
  document.body.dataset.updated = String(o.now_ms);
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
  } catch (err) {
    $('status').textContent = 'no answer from the api (' + err.message + '); retrying';
    $('status').className = 'status stale';
  }
  setTimeout(poll, POLL_MS);
}

poll();
