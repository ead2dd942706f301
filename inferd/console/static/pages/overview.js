// Overview: health, alerts, live charts of the busiest models, and every model with
// what it serves and its figures over the last minutes.

import { every, get } from '../api.js';
import { LiveChart, SeriesFeed } from '../charts.js';
import { ago, h, ms, num, panel, pct, replace, route, stateLabel, table } from '../dom.js';

// The overview is the page left open on a wall screen: it polls gently (the model
// page follows one model at the server's resolution).
const REFRESH_MS = 10000;
const SERIES_MS = 5000;
const TOP = 6;

export async function render(main) {
  const status = h('div', { class: 'cards', 'aria-label': 'Health' });
  const alerts = h('div');
  const filter = h('input', { type: 'search', id: 'model-filter', placeholder: 'Filter models', 'aria-label': 'Filter models' });
  const models = h('div');
  const charts = {
    rps: new LiveChart('Requests/s by model', { format: (v) => num(v, 1) }),
    p99: new LiveChart('p99 latency by model (ms)', { format: (v) => num(v, 1) }),
    errors: new LiveChart('Error rate by model', { format: (v) => pct(v, 1) }),
  };
  main.append(
    h('h1', null, 'Overview'),
    status,
    panel('Alerts', alerts),
    h('section', { class: 'charts spaced', 'aria-label': 'Live charts' }, Object.values(charts).map((c) => c.node)),
    panel('Models', h('p', { class: 'row' }, filter, h('span', { class: 'muted', id: 'model-count' })), models),
  );
  let last = null;
  let sortBy = 'name';
  const draw = () => {
    if (last) drawModels(models, last, filter.value.trim().toLowerCase(), sortBy, (key) => { sortBy = key; draw(); });
  };
  filter.addEventListener('input', draw);

  const poller = every(REFRESH_MS, async () => {
    try {
      last = await get('/api/v1/console/overview');
      drawStatus(status, last);
      drawAlerts(alerts, last);
      draw();
    } catch (error) {
      replace(status, h('div', { class: 'notice bad', role: 'alert' }, 'Could not read the overview: ' + error.message));
    }
  });
  await poller.first;

  const feed = new SeriesFeed(null, { windowS: 300, everyMs: SERIES_MS });
  let drawnOnce = false;
  feed.subscribe((f) => {
    drawCharts(charts, f);
    if (!drawnOnce) {
      drawnOnce = true;
      performance.mark('inferd:overview-charts');
    }
  });
  feed.start();
  return () => {
    poller.stop();
    feed.stop();
    Object.values(charts).forEach((c) => c.destroy());
  };
}

function drawStatus(node, data) {
  const health = data.health;
  const ready = data.models.reduce((n, m) => n + m.replicas_ready, 0);
  const desired = data.models.reduce((n, m) => n + m.replicas_desired, 0);
  const firing = data.alerts.filter((a) => a.state === 'firing').length;
  const cards = [
    card('Models', String(data.models.length), data.models.filter((m) => m.serving_version).length + ' serving'),
    card('Replicas ready', ready + ' / ' + desired, 'ready / desired'),
    card('Alerts firing', String(firing), data.alerts.length - firing + ' pending'),
  ];
  if (health) {
    const server = health.server;
    cards.push(
      card('Control', server.role === 'serve' ? 'inferd serve' : 'inferd control', 'leader ' + server.host + ' (pid ' + server.pid + ') · ' + (health.leader.lock || 'leading')),
      card('Gateways', String(health.gateways.length), summarise(health.gateways)),
      card('Hosts', String(1 + health.hosts.length), health.hosts.length ? health.hosts.map((x) => x.host + ' ' + x.ready + '/' + x.replicas).join(', ') : 'replicas on this host' + (health.pods ? ', ' + health.pods + ' pods' : '')),
      card('Up since', ago(server.started_at), 'inferd ' + server.version + ' · backend ' + health.replica_backend),
    );
  }
  replace(node, cards);
}

function summarise(gateways) {
  const local = gateways.filter((g) => g === 'local').length;
  const remote = gateways.filter((g) => g !== 'local');
  return [local ? local + ' on this host' : '', remote.length ? remote.join(', ') : ''].filter(Boolean).join('; ') || 'none connected';
}

function card(label, value, detail) {
  return h('div', { class: 'card' }, h('div', { class: 'label' }, label), h('div', { class: 'value' }, value), h('div', { class: 'detail' }, detail));
}

function drawAlerts(node, data) {
  const evaluated = data.alerts_evaluated_at ? 'evaluated ' + ago(new Date(data.alerts_evaluated_at * 1000).toISOString()) : 'not evaluated yet';
  if (!data.alerts.length) {
    replace(node, h('p', { class: 'muted' }, 'No alert firing or pending (the shipped Prometheus rules, ' + evaluated + ').'));
    return;
  }
  replace(node, table([
    { title: 'Alert', cell: (a) => a.name },
    { title: 'Severity', cell: (a) => h('span', { class: 'severity-' + String(a.labels.severity || '').replace(/\W/g, '') }, a.labels.severity || '–') },
    { title: 'State', cell: (a) => stateLabel(a.state) },
    { title: 'Summary', cell: (a) => a.annotations.summary || a.annotations.description || '' },
    { title: 'Since', cell: (a) => (a.active_since ? ago(new Date(a.active_since * 1000).toISOString()) : '–') },
  ], data.alerts, { caption: 'Alerts' }), h('p', { class: 'muted' }, 'Rules: deploy/prometheus/alerts.yml, ' + evaluated + '.'));
}

function split(model) {
  const entries = Object.entries(model.traffic);
  if (!entries.length) return model.loaded ? h('span', { class: 'muted' }, 'not serving yet') : h('span', { class: 'muted' }, 'unloaded');
  return entries.map(([v, p]) => h('span', { class: 'chip' }, v + ' ' + p + ' %'));
}

function where(model) {
  const parts = Object.entries(model.where).map(([w, n]) => n + ' ' + w);
  return parts.join(', ');
}

const SORTS = {
  name: (a, b) => a.name.localeCompare(b.name),
  rps: (a, b) => (b.figures?.rps || 0) - (a.figures?.rps || 0),
  p99: (a, b) => (b.figures?.p99_ms || 0) - (a.figures?.p99_ms || 0),
  errors: (a, b) => (b.figures?.error_rate || 0) - (a.figures?.error_rate || 0),
};

function drawModels(node, data, filter, sortBy, sort) {
  const shown = data.models.filter((m) => !filter || m.name.toLowerCase().includes(filter) || (m.framework || '').includes(filter))
    .sort(SORTS[sortBy] || SORTS.name);
  document.getElementById('model-count').textContent = shown.length + ' of ' + data.models.length + ' · figures over the last ' + Math.round(data.window_s / 60) + ' min';
  const sorter = (title, key) => h('button', { type: 'button', class: 'sort', onclick: () => sort(key), 'aria-label': 'Sort by ' + title }, title + (sortBy === key ? ' ↓' : ''));
  const f = (m) => m.figures || {};
  replace(node, table([
    { title: sorter('Model', 'name'), cell: (m) => h('a', { href: route('models', m.name) }, m.name) },
    { title: 'Framework', cell: (m) => m.framework },
    { title: 'Serving', cell: split },
    { title: 'Replicas', cell: (m) => [h('span', null, m.replicas_ready + ' / ' + m.replicas_desired), h('div', { class: 'muted' }, where(m))] },
    { title: sorter('Req/s', 'rps'), num: true, cell: (m) => num(f(m).rps, 2) },
    { title: 'p50', num: true, cell: (m) => ms(f(m).p50_ms) },
    { title: sorter('p99', 'p99'), num: true, cell: (m) => ms(f(m).p99_ms) },
    { title: sorter('Errors', 'errors'), num: true, cell: (m) => pct(f(m).error_rate) },
    { title: 'Cache hits', num: true, cell: (m) => pct(f(m).cache_hit_rate, 1) },
  ], shown, { caption: 'Models', empty: 'No model matches.' }));
}

function drawCharts(charts, feed) {
  const models = feed.modelNames();
  const busiest = models.map((m) => [m, sum(feed.get(m, '*', 'rps'))]).sort((a, b) => b[1] - a[1]).slice(0, TOP).map(([m]) => m);
  const lines = (figure) => busiest.map((m) => ({ label: m, values: feed.get(m, '*', figure) }));
  charts.rps.set(feed.t, lines('rps'));
  charts.p99.set(feed.t, lines('p99_ms'));
  charts.errors.set(feed.t, lines('error_rate'));
}

function sum(values) {
  return (values || []).reduce((n, v) => n + (v || 0), 0);
}
