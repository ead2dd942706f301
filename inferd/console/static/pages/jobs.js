// Batch jobs: progress, ETA with what it was estimated from, cancel, results download.

import { api, every, request } from '../api.js';
import { confirm, duration, h, num, panel, replace, route, stateLabel, table, toast, when } from '../dom.js';

const REFRESH_MS = 3000;
const TERMINAL = new Set(['succeeded', 'failed', 'cancelled', 'expired']);

export async function render(main, { query }) {
  const model = query.get('model') || '';
  const list = h('div');
  main.append(h('h1', null, 'Batch jobs' + (model ? ' of ' + model : '')),
    panel(null, h('p', { class: 'muted' }, 'Submit with ', h('code', null, 'POST /api/v1/batch'), ' or ', h('code', null, 'inferd jobs submit'), '. An admin sees every job; others see their own.'), list));
  const refresh = async () => {
    try {
      const params = new URLSearchParams({ limit: '100' });
      if (model) params.set('model', model);
      const { data } = await api('GET', '/api/v1/batch?' + params.toString());
      draw(list, data.jobs, refresh);
    } catch (error) {
      replace(list, h('div', { class: 'notice bad', role: 'alert' }, 'Could not list jobs: ' + error.message));
    }
  };
  const poller = every(REFRESH_MS, refresh);
  await poller.first;
  return poller.stop;
}

function eta(job) {
  if (TERMINAL.has(job.status)) return h('span', { class: 'muted' }, job.finished_at ? 'ended ' + when(job.finished_at) : '–');
  const estimate = job.estimate;
  if (!estimate) return '–';
  return [h('span', null, duration(estimate.seconds)), h('div', { class: 'muted' }, estimate.method + ': ' + estimate.basis)];
}

function progress(job) {
  const bar = h('div');
  bar.style.width = Math.round((job.progress || 0) * 100) + '%';
  return [h('div', { class: 'progress', role: 'progressbar', 'aria-valuemin': '0', 'aria-valuemax': '100', 'aria-valuenow': String(Math.round((job.progress || 0) * 100)), 'aria-label': 'Progress of ' + job.batch_id }, bar),
    h('div', { class: 'muted' }, job.succeeded + ' done, ' + job.failed + ' failed of ' + job.total + (job.items_per_s ? ' · ' + num(job.items_per_s, 1) + '/s' : ''))];
}

function draw(node, jobs, refresh) {
  replace(node, table([
    { title: 'Job', cell: (j) => h('code', null, j.batch_id) },
    { title: 'Model', cell: (j) => h('a', { href: route('models', j.model) }, j.model + (j.version ? ':' + j.version : '')) },
    { title: 'Status', cell: (j) => [stateLabel(j.status), j.error ? h('div', { class: 'muted' }, j.error) : null] },
    { title: 'Progress', cell: progress },
    { title: 'ETA', cell: eta },
    { title: 'Submitted', cell: (j) => when(j.created_at) },
    { title: '', cell: (j) => actions(j, refresh) },
  ], jobs, { caption: 'Batch jobs', empty: 'No batch job yet.' }));
}

function actions(job, refresh) {
  const out = [h('button', { type: 'button', class: 'secondary', onclick: () => download(job) }, 'Results')];
  if (!TERMINAL.has(job.status)) {
    out.push(' ', h('button', { type: 'button', class: 'danger', onclick: async () => {
      if (!(await confirm('Cancel ' + job.batch_id + '?', 'Inputs not yet run never run; results already in stay.', 'Cancel job'))) return;
      try {
        await api('DELETE', '/api/v1/batch/' + encodeURIComponent(job.batch_id));
        toast('Cancelled ' + job.batch_id);
      } catch (error) {
        toast('Not cancelled: ' + error.message);
      }
      refresh();
    } }, 'Cancel'));
  }
  return out;
}

// The results (JSON Lines) fetched with the credential, then saved from a blob: the
// credential cannot ride on a plain link.
async function download(job) {
  const res = await request('GET', '/api/v1/batch/' + encodeURIComponent(job.batch_id) + '/results');
  if (!res.ok) {
    toast('No results: ' + res.status);
    return;
  }
  const url = URL.createObjectURL(await res.blob());
  const link = h('a', { href: url, download: job.batch_id + '.jsonl' });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}
