// A model: live charts per version, its deployment (traffic split to edit, rollback,
// promote, rollout progress with each canary analysis), versions, the serving version's
// input drift, replicas, scaling events and the history of its traffic.

import { ApiError, api, every, get } from '../api.js';
import { LiveChart, SeriesFeed } from '../charts.js';
import {
  bytes, confirm, h, kv, ms, num, panel, pct, replace, route, stateLabel, table, toast, when,
} from '../dom.js';

const REFRESH_MS = 5000;
const STRATEGIES = ['rolling', 'canary', 'blue_green', 'shadow'];

export async function render(main, { me, params }) {
  const name = params[0];
  if (!name) {
    location.hash = '#/';
    return null;
  }
  const path = '/api/v1/models/' + encodeURIComponent(name);
  let model;
  try {
    model = await get(path);
  } catch (error) {
    main.append(h('h1', null, name), h('div', { class: 'notice bad', role: 'alert' }, error.message));
    return null;
  }
  const generative = model.framework === 'gpt2' || model.framework === 'llm';
  const head = h('div');
  const deployment = h('div');
  const versions = h('div');
  const drift = h('div');
  const replicas = h('div');
  const events = h('div');
  const history = h('div');
  const charts = makeCharts(generative);
  main.append(
    head,
    h('section', { class: 'charts spaced', 'aria-label': 'Live charts' }, Object.values(charts).map((c) => c.node)),
    me.admin ? panel('Deployment', deployment) : null,
    panel('Versions', versions),
    generative ? null : panel('Input drift', drift),
    panel('Replicas', replicas),
    me.admin ? panel('Scaling events', events) : null,
    me.admin ? panel('Traffic history', history) : null,
  );
  const editor = new TrafficEditor(name);
  const rollout = h('div');
  const deploy = h('div');
  let deployFor = '';
  if (me.admin) deployment.append(editor.node, rollout, deploy);
  const refresh = async () => {
    try {
      model = await get(path);
      const deployed = me.admin ? await get('/api/v1/deployments/' + encodeURIComponent(name)) : null;
      drawHead(head, model, me);
      drawVersions(versions, model);
      if (!generative) { // asked only of a serving version (a 404 is a browser error)
        drawDrift(drift, model.serving_version ? await get(path + '/drift').catch(() => null) : null);
      }
      drawReplicas(replicas, model, deployed);
      if (deployed) {
        editor.update(deployed, model, refresh);
        replace(rollout, rolloutOf(deployed));
        const versionsNow = model.versions.map((v) => v.version).join(',') + '|' + deployed.mode;
        if (versionsNow !== deployFor) { // rebuilt only when there is something new to offer
          deployFor = versionsNow;
          replace(deploy, deployForm(name, model, deployed, refresh));
        }
        drawEvents(events, deployed.scaling_events || []);
        drawHistory(history, deployed.history || []);
      }
    } catch (error) {
      toast('Refresh failed: ' + error.message);
    }
  };
  const poller = every(REFRESH_MS, refresh);
  await poller.first;
  const feed = new SeriesFeed([name], { windowS: 300 }).start();
  feed.subscribe((f) => drawCharts(charts, f, name));
  return () => {
    poller.stop();
    feed.stop();
    Object.values(charts).forEach((c) => c.destroy());
  };
}

function drawHead(node, model, me) {
  const tags = Object.entries(model.tags || {}).map(([k, v]) => h('span', { class: 'chip' }, k + '=' + v));
  replace(node,
    h('p', { class: 'muted' }, h('a', { href: '#/' }, 'Overview'), ' / model'),
    h('h1', null, model.name),
    model.description ? h('p', null, model.description) : null,
    kv([
      ['Framework', model.framework],
      ['Serving', model.serving_version || (model.loaded ? 'not yet' : 'unloaded')],
      ['Owner', model.owner || '–'],
      ['Labels', tags.length ? tags : '–'],
      ['Registered', when(model.created_at)],
    ]),
    h('p', { class: 'row' },
      h('a', { class: 'button', href: route('playground', model.name) }, 'Try it in the playground'),
      me.admin ? h('a', { href: '#/logs?model=' + encodeURIComponent(model.name) }, 'Inference log') : null,
      h('a', { href: '#/jobs?model=' + encodeURIComponent(model.name) }, 'Batch jobs')));
}

function makeCharts(generative) {
  const charts = {
    rps: new LiveChart('Requests/s', { format: (v) => num(v, 1) }),
    latency: new LiveChart('Latency p50 / p99 (ms)', { format: (v) => num(v, 1) }),
    errors: new LiveChart('Error rate', { format: (v) => pct(v, 1) }),
  };
  if (generative) {
    charts.ttft = new LiveChart('Time to first token p50 / p99 (ms)', { format: (v) => num(v, 1) });
    charts.itl = new LiveChart('Inter-token latency p50 / p99 (ms)', { format: (v) => num(v, 1) });
    charts.tokens = new LiveChart('Tokens/s', { format: (v) => num(v, 1) });
    charts.kv = new LiveChart('KV-cache use', { format: (v) => pct(v, 0) });
    charts.queue = new LiveChart('Waiting generations', { format: (v) => num(v, 1) });
  } else {
    charts.batch = new LiveChart('Batch size (rows)', { format: (v) => num(v, 1) });
    charts.queue = new LiveChart('Queue depth (rows)', { format: (v) => num(v, 1) });
  }
  return charts;
}

function drawCharts(charts, feed, model) {
  const versions = feed.versions(model);
  const per = (figure) => versions.map((v) => ({ label: v, values: feed.get(model, v, figure) }));
  const pair = (low, high) => versions.flatMap((v, i) => [
    { label: v + ' p50', values: feed.get(model, v, low), color: colorFor(i) },
    { label: v + ' p99', values: feed.get(model, v, high), dash: [6, 4], color: colorFor(i) },
  ]);
  charts.rps.set(feed.t, per('rps'));
  charts.latency.set(feed.t, pair('p50_ms', 'p99_ms'));
  charts.errors.set(feed.t, per('error_rate'));
  if (charts.batch) charts.batch.set(feed.t, per('batch_size'));
  charts.queue.set(feed.t, per('queue'));
  if (charts.ttft) {
    charts.ttft.set(feed.t, pair('ttft_p50_ms', 'ttft_p99_ms'));
    charts.itl.set(feed.t, pair('itl_p50_ms', 'itl_p99_ms'));
    charts.tokens.set(feed.t, per('tokens_per_s'));
    charts.kv.set(feed.t, per('kv_use'));
  }
}

const PALETTE = ['#1f5fbf', '#c2410c', '#15803d', '#7e22ce'];
const colorFor = (i) => PALETTE[i % PALETTE.length];

// -- the traffic split, edited in place ------------------------------------------------------

class TrafficEditor {
  constructor(model) {
    this.model = model;
    this.form = h('div');
    this.message = h('div', { role: 'alert' }); // outlives redraws: what the last action did
    this.node = h('div', null, this.form, this.message);
    this.revision = null;
    this.dirty = false;
  }

  update(deployed, model, refresh) {
    if (this.dirty && deployed.revision === this.revision) return; // keep what is being typed
    this.refresh = refresh;
    if (!this.dirty) this.revision = deployed.revision;
    this.latest = deployed;
    if (this.dirty) return;
    this.draw(deployed);
  }

  draw(deployed) {
    const inputs = new Map();
    const total = h('output', { id: 'split-total', 'aria-live': 'polite' });
    const save = h('button', { type: 'submit', disabled: true }, 'Apply split');
    const message = this.message;
    const recount = () => {
      const sum = [...inputs.values()].reduce((n, i) => n + (Number(i.value) || 0), 0);
      total.textContent = 'Total ' + sum + ' %';
      save.disabled = sum !== 100;
    };
    const lines = deployed.versions.filter((v) => deployed.mode === 'deployments').map((v) => {
      const id = 'split-' + v.version.replace(/[^A-Za-z0-9_-]/g, '_');
      const number = h('input', { id, type: 'number', min: 0, max: 100, step: 1, value: String(deployed.traffic[v.version] ?? 0), 'data-version': v.version });
      const slider = h('input', { type: 'range', min: 0, max: 100, step: 1, value: String(deployed.traffic[v.version] ?? 0), 'aria-label': 'Traffic to ' + v.version });
      number.addEventListener('input', () => { slider.value = number.value; this.dirty = true; recount(); });
      slider.addEventListener('input', () => { number.value = slider.value; this.dirty = true; recount(); });
      inputs.set(v.version, number);
      return h('div', { class: 'line' }, h('label', { for: id, class: 'inline' }, v.version, ' ', stateLabel(v.state)), slider, h('span', null, number, ' %'));
    });
    const form = h('form', { class: 'split', 'aria-label': 'Traffic split' });
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      const split = Object.fromEntries([...inputs].map(([v, i]) => [v, Number(i.value) || 0]));
      await this.apply(split, message);
    });
    const buttons = h('div', { class: 'row' }, save,
      h('button', { type: 'button', class: 'secondary', onclick: () => { this.dirty = false; this.draw(this.latest); } }, 'Reset'),
      h('button', { type: 'button', class: 'danger', onclick: () => this.rollback(message) }, 'Roll back'),
      promoteButton(deployed, (version) => this.promote(version, deployed, message)));
    if (deployed.mode === 'deployments') {
      append(form, lines, total, buttons);
    } else {
      append(form, h('p', { class: 'muted' }, 'Automatic mode: the newest version serves all the traffic. Deploy a version below to split traffic between versions.'), buttons);
    }
    recount();
    replace(this.form, h('p', { class: 'muted' }, 'Mode ' + deployed.mode + ' · revision ' + deployed.revision), form);
  }

  async apply(split, message) {
    replace(message);
    try {
      const { data } = await api('PUT', '/api/v1/deployments/' + encodeURIComponent(this.model) + '/traffic', {
        body: split, headers: { 'If-Match': '"' + this.revision + '"', 'X-Inferd-Actor': 'console' },
      });
      this.dirty = false;
      this.revision = data.revision;
      toast('Traffic now ' + Object.entries(data.traffic).map(([v, p]) => v + ' ' + p + ' %').join(', '));
      message.append(h('div', { class: 'notice ok' }, 'Applied: revision ' + data.revision + '.'));
      this.refresh();
    } catch (error) {
      if (error instanceof ApiError && error.status === 409) {
        const latest = await get('/api/v1/deployments/' + encodeURIComponent(this.model)).catch(() => null);
        const now = latest ? Object.entries(latest.traffic).map(([v, p]) => v + ' ' + p + ' %').join(', ') : 'unknown';
        replace(message, h('div', { class: 'notice bad', 'data-conflict': '' },
          'Not applied: the split changed since you loaded it (revision ' + this.revision + ' → ' + (latest ? latest.revision : '?') + '). It is now ' + now + '. ',
          h('button', { type: 'button', class: 'secondary', onclick: () => { this.dirty = false; this.revision = latest?.revision ?? this.revision; if (latest) this.draw(latest); } }, 'Load the current split')));
      } else {
        replace(message, h('div', { class: 'notice bad' }, 'Not applied: ' + error.message));
      }
    }
  }

  async rollback(message) {
    const ok = await confirm('Roll back ' + this.model + '?', 'All traffic goes back at once to the last stable split (one version at 100 %).', 'Roll back');
    if (!ok) return;
    replace(message);
    try {
      const { data } = await api('POST', '/api/v1/deployments/' + encodeURIComponent(this.model) + '/rollback', { headers: { 'X-Inferd-Actor': 'console' } });
      this.dirty = false;
      message.append(h('div', { class: 'notice ok' }, 'Rolled back: ' + Object.entries(data.traffic).map(([v, p]) => v + ' ' + p + ' %').join(', ') + (data.detail ? ' (' + data.detail + ')' : '')));
      this.refresh();
    } catch (error) {
      message.append(h('div', { class: 'notice bad' }, 'Rollback refused: ' + error.message));
    }
  }

  async promote(version, deployed, message) {
    const ok = await confirm('Promote ' + version + '?', 'It takes 100 % of the traffic now, ending its rollout; the other versions keep running until undeployed.', 'Promote', false);
    if (!ok) return;
    const split = Object.fromEntries(deployed.versions.map((v) => [v.version, v.version === version ? 100 : 0]));
    await this.apply(split, message);
  }
}

function append(node, ...children) {
  for (const child of children.flat()) if (child) node.append(child);
}

// A canary still progressing (or halted), or a blue-green not switched yet.
function promoteButton(deployed, promote) {
  const candidate = deployed.versions.find((v) => v.rollout && (
    (v.strategy === 'canary' && (v.rollout.state === 'progressing' || v.rollout.state === 'halted'))
    || (v.strategy === 'blue_green' && !v.rollout.switched_at)));
  if (!candidate) return null;
  return h('button', { type: 'button', class: 'secondary', onclick: () => promote(candidate.version) }, 'Promote ' + candidate.version);
}

// -- rollouts -------------------------------------------------------------------------------

function rolloutOf(deployed) {
  const shown = deployed.versions.filter((v) => v.rollout && v.strategy !== 'rolling');
  if (!shown.length) return null;
  return h('div', null, shown.map((v) => {
    const r = v.rollout;
    if (v.strategy === 'canary') return canaryOf(v, r);
    if (v.strategy === 'blue_green') {
      return h('div', null, h('h3', null, 'Blue-green: ' + v.version),
        kv([['Switched', r.switched_at ? when(r.switched_at) : 'waiting for every new replica to be ready'], ['Keep old for', num(r.keep_old_s, 0) + ' s'], ['Done', r.done ? 'yes' : 'no']]));
    }
    return h('div', null, h('h3', null, 'Shadow: ' + v.version), kv([['Mirrored', r.mirror_pct + ' % of requests'], ['Tolerance', String(r.tolerance)]]),
      v.live && v.live.shadow ? kv([['Compared', String(v.live.shadow.compared)], ['Agreement', pct(v.live.shadow.agreement)]]) : null);
  }));
}

function canaryOf(v, r) {
  const steps = h('div', { class: 'steps', 'aria-label': 'Canary steps' }, r.steps.map((s, i) => h('span', {
    class: i < r.step ? 'done' : (i === r.step ? 'now' : ''),
  }, s + ' %')));
  const analyses = r.analyses && r.analyses.length ? r.analyses : (r.analysis ? [r.analysis] : []);
  const side = (x) => (x ? [num(x.requests, 0) + ' req', ' · ', pct(x.error_rate), ' · p99 ', ms(x.p99_ms)] : '–');
  return h('div', { 'data-canary': v.version },
    h('h3', null, 'Canary: ' + v.version),
    kv([['State', stateLabel(r.state)], ['Step', (r.step + 1) + ' of ' + r.steps.length + ' (' + r.steps[r.step] + ' %)'],
      ['Window', num(r.step_s, 0) + ' s, at least ' + r.min_requests + ' requests'], ['Reason', r.reason || '–']]),
    steps,
    table([
      { title: 'Step', cell: (a) => String(a.step + 1) },
      { title: 'Traffic', num: true, cell: (a) => a.traffic_pct + ' %' },
      { title: 'Window', num: true, cell: (a) => num(a.window_s, 0) + ' s' },
      { title: 'Canary', cell: (a) => side(a.canary) },
      { title: 'Stable', cell: (a) => side(a.stable) },
      { title: 'Verdict', cell: (a) => h('span', { class: 'verdict-' + a.verdict }, a.verdict) },
      { title: 'Why', cell: (a) => a.reason },
    ], analyses, { caption: 'Canary analyses', empty: 'No analysis window has concluded yet.' }));
}

function deployForm(name, model, deployed, refresh) {
  const choices = model.versions.map((v) => v.version);
  if (!choices.length) return null;
  const version = h('select', { id: 'deploy-version' }, choices.slice().reverse().map((v) => h('option', { value: v }, v)));
  const traffic = h('input', { id: 'deploy-traffic', type: 'number', min: 0, max: 100, value: '10' });
  const strategy = h('select', { id: 'deploy-strategy' }, STRATEGIES.map((s) => h('option', { value: s }, s)));
  const message = h('div', { role: 'alert' });
  const form = h('form', { class: 'row', 'aria-label': 'Deploy a version' },
    h('label', { for: 'deploy-version' }, 'Version', version),
    h('label', { for: 'deploy-traffic' }, 'Traffic %', traffic),
    h('label', { for: 'deploy-strategy' }, 'Strategy', strategy),
    h('button', { type: 'submit' }, 'Deploy'));
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const ok = await confirm('Deploy ' + version.value + '?', strategy.value + ' deployment with ' + traffic.value + ' % of the traffic.', 'Deploy', false);
    if (!ok) return;
    const body = { model_name: name, version: version.value, traffic_percent: Number(traffic.value), strategy: strategy.value };
    if (strategy.value === 'shadow') { body.traffic_percent = 0; body.rollout = { mirror_pct: Number(traffic.value) || 10 }; }
    if (strategy.value === 'canary' || strategy.value === 'blue_green') delete body.traffic_percent;
    try {
      await api('POST', '/api/v1/deployments', { body, headers: { 'X-Inferd-Actor': 'console' } });
      replace(message, h('div', { class: 'notice ok' }, 'Deploying ' + version.value + '.'));
      refresh();
    } catch (error) {
      replace(message, h('div', { class: 'notice bad' }, 'Not deployed: ' + error.message));
    }
  });
  return h('details', { class: 'spaced-top' }, h('summary', null, 'Deploy a version'), form, message,
    h('p', { class: 'muted' }, deployed.mode === 'automatic' ? 'Deploying pins the model: from then on only deployed versions run.' : ''));
}

// -- versions, replicas, events, history ---------------------------------------------------

function signatureOf(signature) {
  const rows = [
    ...(signature.inputs || []).map((s) => ({ ...s, io: 'input' })),
    ...(signature.outputs || []).map((s) => ({ ...s, io: 'output' })),
  ];
  return table([
    { title: '', cell: (s) => s.io },
    { title: 'Name', cell: (s) => h('code', null, s.name) },
    { title: 'Datatype', cell: (s) => s.datatype },
    { title: 'Shape', cell: (s) => '[' + (s.shape || []).join(', ') + ']' },
  ], rows, { caption: 'Signature' });
}

function metadataOf(metadata) {
  const entries = Object.entries(metadata || {});
  if (!entries.length) return h('p', { class: 'muted' }, 'No metadata.');
  return h('dl', { class: 'kv' }, entries.map(([k, v]) => [h('dt', null, k), h('dd', null, typeof v === 'string' ? v : h('code', null, JSON.stringify(v)))]));
}

// Where the version came from: an MLflow import says so in its metadata; otherwise
// an upload, kept where the artifact URI says (a local folder or an S3 store).
function sourceOf(v) {
  const mlflow = (v.metadata || {}).mlflow;
  const kept = String(v.artifact_uri).startsWith('s3://') ? 'kept in S3: ' : 'kept at ';
  if (mlflow && typeof mlflow === 'object') {
    const parts = ['MLflow', mlflow.uri || mlflow.source || '', mlflow.run_id ? 'run ' + mlflow.run_id : '', mlflow.flavor ? '(' + mlflow.flavor + ')' : ''];
    return [parts.filter(Boolean).join(' '), h('div', { class: 'muted' }, kept + v.artifact_uri)];
  }
  return ['upload', h('div', { class: 'muted' }, kept + v.artifact_uri)];
}

function drawVersions(node, model) {
  const versions = model.versions.slice().reverse();
  replace(node, versions.map((v) => h('details', { open: versions.length <= 3, 'data-version': v.version },
    h('summary', null, v.version, ' · ', stateLabel(v.status), ' · ', v.framework, ' · ', bytes(v.size_bytes)),
    kv([
      ['Status', stateLabel(v.status)],
      ['Created', when(v.created_at)],
      ['sha256', h('code', { title: v.sha256 }, v.sha256)],
      ['Size', bytes(v.size_bytes)],
      ['Source', sourceOf(v)],
      ['Batching', v.batching ? h('code', null, JSON.stringify(v.batching)) : 'server default'],
    ]),
    h('h3', null, 'Signature'), signatureOf(v.signature),
    h('h3', null, 'Metadata'), metadataOf(v.metadata))));
}

function drawReplicas(node, model, deployed) {
  const rows = [];
  const placements = new Map();
  for (const d of deployed?.versions || []) for (const r of d.replicas || []) placements.set(r.id, r);
  for (const v of model.versions) {
    for (const r of v.replicas || []) rows.push({ version: v.version, ...placements.get(r.id), ...r });
  }
  replace(node, table([
    { title: 'Version', cell: (r) => r.version },
    { title: 'Replica', cell: (r) => h('code', null, r.id) },
    { title: 'State', cell: (r) => stateLabel(r.state) },
    { title: 'Where', cell: (r) => (r.placement || 'local') + (r.pid ? ' · pid ' + r.pid : '') + (r.gpus ? ' · GPU ' + r.gpus.join(',') : '') },
    { title: 'Restarts', num: true, cell: (r) => String(r.restarts) },
    { title: 'In flight', num: true, cell: (r) => num(r.stats?.inflight, 0) },
    { title: 'Queue', num: true, cell: (r) => num(r.stats?.queued_rows ?? r.stats?.waiting, 0) },
    { title: 'Memory', num: true, cell: (r) => bytes(r.stats?.rss_bytes) },
    { title: 'Why not ready', cell: (r) => r.message || '' },
  ], rows, { caption: 'Replicas', empty: 'No replica runs (not deployed, unloaded, or scaled to zero).' }));
}

function drawDrift(node, view) {
  if (!view) {
    replace(node, h('p', { class: 'muted' }, 'No serving version.'));
    return;
  }
  const ref = view.reference;
  const source = ref ? ref.rows + ' rows, ' + (ref.source === 'sample' ? 'the registered sample' : 'its first requests') : 'none yet (' + num(view.collected_rows, 0) + ' rows collected)';
  replace(node, h('div', null, kv([
    ['Version', view.version],
    ['Status', stateLabel(view.status)],
    ['Reference', source],
    ['Window', num(view.window.rows, 0) + ' rows'],
    ['Flag at', 'PSI ≥ ' + view.threshold.psi],
  ]), table([
    { title: 'Feature', cell: (f) => h('code', null, f.name) },
    { title: 'PSI', num: true, cell: (f) => num(f.psi, 3) },
    { title: 'KS / chi²', num: true, cell: (f) => num(f.ks ?? f.chi2, 3) },
    { title: 'p-value', num: true, cell: (f) => (f.ks_p_value ?? f.chi2_p_value).toExponential(1) },
    { title: 'Mean moved (std)', num: true, cell: (f) => num(f.mean_shift_sigma, 2) },
    { title: 'Drifted', cell: (f) => (f.drifted ? stateLabel('drifted') : '') },
  ], view.features, { caption: 'Input drift by feature', empty: 'No scores yet: too few rows in the window.' })));
}

function drawEvents(node, events) {
  replace(node, table([
    { title: 'When', cell: (e) => when(e.at) },
    { title: 'Version', cell: (e) => e.version },
    { title: 'Replicas', cell: (e) => e.from + ' → ' + e.to },
    { title: 'Reason', cell: (e) => e.reason },
    { title: 'Detail', cell: (e) => e.detail || '' },
    { title: 'Figures', cell: (e) => h('code', null, JSON.stringify(e.figures || {})) },
  ], events, { caption: 'Scaling events', empty: 'No autoscaling decision yet.' }));
}

function drawHistory(node, history) {
  replace(node, table([
    { title: 'Revision', num: true, cell: (c) => String(c.revision) },
    { title: 'When', cell: (c) => when(c.created_at) },
    { title: 'Split', cell: (c) => Object.entries(c.split).map(([v, p]) => h('span', { class: 'chip' }, v + ' ' + p + ' %')) },
    { title: 'Reason', cell: (c) => c.reason },
    { title: 'By', cell: (c) => c.actor },
    { title: 'Detail', cell: (c) => c.detail || '' },
  ], history, { caption: 'Traffic history' }));
}

