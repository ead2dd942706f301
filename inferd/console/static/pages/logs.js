// The inference log: filters (model, version, status, time range, request id) and a
// latency histogram of the rows found.

import { get } from '../api.js';
import { h, ms, panel, replace, route, table, when } from '../dom.js';

export const adminOnly = true;

const FIELDS = [
  ['model', 'Model', 'text'], ['version', 'Version', 'text'], ['status', 'Status code', 'number'],
  ['request_id', 'Request id', 'text'], ['since', 'Since', 'datetime-local'], ['until', 'Until', 'datetime-local'],
];

export async function render(main, { query }) {
  const inputs = {};
  const form = h('form', { class: 'row', 'aria-label': 'Filters' }, FIELDS.map(([key, label, type]) => {
    const input = h('input', { id: 'log-' + key, name: key, type, value: query.get(key) || '' });
    inputs[key] = input;
    return h('label', { for: 'log-' + key }, label, input);
  }), h('label', { for: 'log-limit' }, 'Rows', inputs.limit = h('input', { id: 'log-limit', type: 'number', min: 1, max: 1000, value: query.get('limit') || '200' })),
  h('button', { type: 'submit' }, 'Search'));
  const histogram = h('div');
  const rows = h('div');
  main.append(h('h1', null, 'Inference log'), panel(null, form), panel('Latency', histogram), panel('Requests', rows));
  const search = async () => {
    const params = new URLSearchParams();
    for (const [key, input] of Object.entries(inputs)) {
      if (!input.value) continue;
      params.set(key, key === 'since' || key === 'until' ? new Date(input.value).toISOString() : input.value);
    }
    try {
      const data = await get('/api/v1/logs?' + params.toString());
      drawHistogram(histogram, data.logs);
      drawRows(rows, data.logs);
    } catch (error) {
      replace(rows, h('div', { class: 'notice bad', role: 'alert' }, error.message));
      replace(histogram);
    }
  };
  form.addEventListener('submit', (event) => { event.preventDefault(); search(); });
  await search();
  return null;
}

// Buckets doubling from 0.25 ms: tabular answers in a millisecond and generations in
// seconds both show their shape.
function drawHistogram(node, logs) {
  const bounds = [];
  for (let b = 0.25; b <= 60000; b *= 2) bounds.push(b);
  const counts = new Array(bounds.length + 1).fill(0);
  for (const row of logs) {
    let i = bounds.findIndex((b) => row.latency_ms <= b);
    if (i < 0) i = bounds.length;
    counts[i] += 1;
  }
  let first = counts.findIndex((c) => c > 0);
  let last = counts.length - 1 - [...counts].reverse().findIndex((c) => c > 0);
  if (first < 0) {
    replace(node, h('p', { class: 'muted' }, 'No rows.'));
    return;
  }
  first = Math.max(0, first - 1);
  last = Math.min(counts.length - 1, last + 1);
  const top = Math.max(...counts);
  const label = (i) => (i < bounds.length ? '≤' + ms(bounds[i]) : '>' + ms(bounds[bounds.length - 1]));
  const bars = [];
  const axis = [];
  for (let i = first; i <= last; i += 1) {
    const bar = h('div', { class: 'bar', title: label(i) + ': ' + counts[i] + ' requests' });
    bar.style.height = (counts[i] / top) * 100 + '%';
    bars.push(bar);
    axis.push(h('span', null, label(i)));
  }
  const sorted = logs.map((r) => r.latency_ms).sort((a, b) => a - b);
  const q = (p) => sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))];
  replace(node,
    h('div', { class: 'hist', role: 'img', 'aria-label': 'Latency histogram of ' + logs.length + ' requests: p50 ' + ms(q(0.5)) + ', p99 ' + ms(q(0.99)), 'data-rows': String(logs.length) }, bars),
    h('div', { class: 'hist-axis', 'aria-hidden': 'true' }, axis),
    h('p', { class: 'muted' }, logs.length + ' requests · p50 ' + ms(q(0.5)) + ' · p99 ' + ms(q(0.99)) + ' · max ' + ms(sorted[sorted.length - 1])));
}

function drawRows(node, logs) {
  replace(node, table([
    { title: 'When', cell: (r) => when(r.timestamp) },
    { title: 'Request', cell: (r) => h('code', null, r.request_id) },
    { title: 'Model', cell: (r) => h('a', { href: route('models', r.model_name) }, r.model_name) },
    { title: 'Version', cell: (r) => r.version || '–' },
    { title: 'API', cell: (r) => r.api },
    { title: 'Status', num: true, cell: (r) => String(r.status_code) },
    { title: 'Latency', num: true, cell: (r) => ms(r.latency_ms) },
    { title: 'Cache', cell: (r) => (r.cache_hit === null || r.cache_hit === undefined ? '' : (r.cache_hit ? 'hit' : 'miss')) },
    { title: 'User', cell: (r) => (r.user_hash ? h('code', null, r.user_hash) : '') },
  ], logs, { caption: 'Inference log rows', empty: 'No request matches these filters.' }));
}
