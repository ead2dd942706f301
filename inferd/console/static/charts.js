// Live charts: uPlot (vendored, made for time series) fed by /api/v1/console/series,
// polled with `since` so each poll carries only the new points.

import { get } from './api.js';
import { h, replace } from './dom.js';

const COLORS = ['#1f5fbf', '#c2410c', '#15803d', '#7e22ce', '#b91c1c', '#0e7490', '#a16207', '#4d7c0f'];
export const colorOf = (i) => COLORS[i % COLORS.length];

// Keeps the last `windowS` seconds of every series the server sends, by path
// "model|version|figure" (version "*" for a model's total).
export class SeriesFeed {
  // everyMs: how often to poll, at least once a slot (the server's resolution).
  constructor(models, { windowS = 300, everyMs = 0 } = {}) {
    this.models = models; // null: every model the caller may see
    this.windowS = windowS;
    this.minMs = everyMs;
    this.everyMs = Math.max(everyMs, 2000);
    this.t = [];
    this.values = new Map();
    this.until = null;
    this.answered = false;
    this.listeners = new Set();
    this.timer = 0;
    this.stopped = false;
  }

  start() {
    this.poll();
    return this;
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
  }

  subscribe(listener) {
    this.listeners.add(listener);
    if (this.t.length) listener(this);
  }

  async poll() {
    if (this.stopped) return;
    if (document.visibilityState !== 'hidden') {
      try {
        const params = new URLSearchParams({ window_s: String(this.windowS) });
        if (this.models) params.set('models', this.models.join(','));
        if (this.until !== null) params.set('since', String(this.until - 0.001));
        const answer = await get('/api/v1/console/series?' + params.toString());
        this.take(answer);
      } catch {
        // the next poll tries again; a 401 already sent the person to sign in
      }
    }
    if (!this.stopped) this.timer = setTimeout(() => this.poll(), this.everyMs);
  }

  take(answer) {
    const fresh = answer.t || [];
    this.until = answer.until;
    this.everyMs = Math.max(this.minMs, 1000, (answer.slot_s || 2) * 1000);
    const first = !this.answered;
    this.answered = true;
    if (!fresh.length) {
      if (first) for (const listener of this.listeners) listener(this); // draw "no figures"
      return;
    }
    const before = this.t.length;
    this.t.push(...fresh);
    for (const [model, entry] of Object.entries(answer.models || {})) {
      this.add(model, '*', entry.total || {}, before, fresh.length);
      for (const [version, figures] of Object.entries(entry.versions || {})) {
        this.add(model, version, figures, before, fresh.length);
      }
    }
    for (const [path, values] of this.values) {
      if (values.length < this.t.length) values.push(...new Array(this.t.length - values.length).fill(null));
      this.values.set(path, values);
    }
    const cut = this.t.findIndex((t) => t > this.t[this.t.length - 1] - this.windowS);
    if (cut > 0) {
      this.t.splice(0, cut);
      for (const values of this.values.values()) values.splice(0, cut);
    }
    for (const listener of this.listeners) listener(this);
  }

  add(model, version, figures, before, count) {
    for (const [name, values] of Object.entries(figures)) {
      const path = model + '|' + version + '|' + name;
      let known = this.values.get(path);
      if (!known) {
        known = new Array(before).fill(null);
        this.values.set(path, known);
      }
      if (known.length < before) known.push(...new Array(before - known.length).fill(null));
      known.push(...values.slice(0, count));
    }
  }

  get(model, version, name) {
    return this.values.get(model + '|' + version + '|' + name) || null;
  }

  versions(model) {
    const found = new Set();
    for (const path of this.values.keys()) {
      const [m, v] = path.split('|');
      if (m === model && v !== '*') found.add(v);
    }
    return [...found].sort();
  }

  modelNames() {
    return [...new Set([...this.values.keys()].map((p) => p.split('|')[0]))];
  }
}

// One chart: a title, lines by label, redrawn in place while the labels stay the same.
export class LiveChart {
  constructor(title, { unit = '', format = (v) => String(v), height = 190 } = {}) {
    this.title = title;
    this.unit = unit;
    this.format = format;
    this.height = height;
    this.plot = null;
    this.labels = '';
    this.body = h('div', { class: 'chart-body' }, h('p', { class: 'empty' }, 'Waiting for figures…'));
    this.summary = h('p', { class: 'visually-hidden', 'aria-live': 'off' });
    this.node = h('figure', { class: 'chart', role: 'group', 'aria-label': title, 'data-chart': title, 'data-points': '0' },
      h('h3', null, title), this.body, this.summary);
    this.resize = new ResizeObserver(() => this.fit());
    this.resize.observe(this.node);
  }

  // lines: [{label, values, dash}] aligned with t (seconds).
  set(t, lines) {
    const drawn = lines.filter((l) => l.values && l.values.some((v) => v !== null));
    if (!drawn.length || !t.length) {
      if (this.plot) { this.plot.destroy(); this.plot = null; this.labels = ''; }
      replace(this.body, h('p', { class: 'empty' }, 'No figures in this window.'));
      this.node.dataset.points = '0';
      return;
    }
    const labels = drawn.map((l) => l.label).join('\u0000');
    const data = [t, ...drawn.map((l) => l.values)];
    if (this.plot && labels === this.labels) {
      this.plot.setData(data);
    } else {
      if (this.plot) this.plot.destroy();
      this.labels = labels;
      replace(this.body);
      this.plot = new uPlot(this.options(drawn), data, this.body);
    }
    const last = drawn.map((l) => [l.label, lastValue(l.values)]);
    this.node.dataset.points = String(t.length);
    this.node.dataset.last = JSON.stringify(Object.fromEntries(last));
    this.summary.textContent = this.title + ': ' + last.map(([label, v]) => label + ' ' + (v === null ? 'no value' : this.format(v))).join(', ');
  }

  options(lines) {
    const format = this.format;
    return {
      width: this.width(),
      height: this.height,
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
      axes: [{ values: timeTicks, space: 60 }, { values: (u, ticks) => ticks.map((v) => format(v)), size: 64 }],
      legend: { live: false },
      cursor: { drag: { x: false, y: false } },
      series: [{}, ...lines.map((l, i) => ({
        label: l.label,
        stroke: l.color || colorOf(i),
        width: 1.6,
        dash: l.dash || undefined,
        spanGaps: false,
        value: (u, v) => (v === null || v === undefined ? '–' : format(v)),
      }))],
    };
  }

  width() {
    return Math.max(280, this.node.clientWidth - 22);
  }

  fit() {
    if (this.plot) this.plot.setSize({ width: this.width(), height: this.height });
  }

  destroy() {
    this.resize.disconnect();
    if (this.plot) this.plot.destroy();
  }
}

// Clock times, with seconds when the ticks are less than a minute apart.
function timeTicks(u, ticks) {
  const step = ticks.length > 1 ? ticks[1] - ticks[0] : 60;
  const options = { hour: '2-digit', minute: '2-digit', hour12: false };
  if (step < 60) options.second = '2-digit';
  return ticks.map((t) => new Date(t * 1000).toLocaleTimeString('en-GB', options));
}

function lastValue(values) {
  for (let i = values.length - 1; i >= 0; i -= 1) if (values[i] !== null) return values[i];
  return null;
}
